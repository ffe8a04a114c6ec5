//! Code generated from `proto/trellis/**` by `build.rs`: one module per proto package, e.g.
//! [`trellis::ipam::v1`]. Re-exported at short paths for the services.

#[allow(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    clippy::all,
    clippy::pedantic,
    rustdoc::all
)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/trellis.rs"));
}

pub use generated::trellis;
pub use generated::trellis::discovery::v1 as discovery;
pub use generated::trellis::endpoints::v1 as endpoints;
pub use generated::trellis::gateway::v1 as gateway;
pub use generated::trellis::ipam::v1 as ipam;
pub use generated::trellis::peering::v1 as peering;
pub use generated::trellis::route::v1 as route;
pub use generated::trellis::types::v1 as types;
