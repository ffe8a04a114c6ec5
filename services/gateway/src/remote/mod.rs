//! The gateway's ports to the other services of its cluster: each follows one service over
//! gRPC and publishes what it learns in the gateway's own terms on a watch channel, so the
//! core and the reconciler never see the wire types.
//!
//! - [`broker`]: the TunnelEndpoints, followed with a resumable watch;
//! - [`ipam`]: the external-CIDR endpoint mappings (hub-path DNAT), polled.

pub mod broker;
pub mod ipam;
