//! The wire and domain vocabulary of Trellis.
//!
//! - [`pb`]: code generated from `proto/` (prost messages, tonic clients and servers).
//! - [`ident`] and [`net`]: validated domain types (cluster identities, CIDRs, IPs).
//! - [`model`]: the peering model shared by broker and gateway (network parameters, NAT
//!   decisions, WireGuard keys, TunnelEndpoints), converted from and to the protos.
//! - [`address`] and [`convert`]: "host:port" service addresses, and conversions of shared
//!   messages (identities, advertised addresses, timestamps) both ways.
//! - [`peers`]: the peering vocabulary (ForeignCluster condition types, the predicates the
//!   services read ForeignClusters with, the NetworkConfig naming rule) and the peering view of
//!   discovery's ForeignClusters the broker and the forwarder share.
//! - [`wire`]: the parsing helpers that turn request strings into those types, failing with
//!   [`Error::InvalidArgument`] naming the offending field.
//!
//! Domain logic works on the validated types only; prost types stop at the gRPC handlers.

pub mod address;
pub mod convert;
pub mod ident;
pub mod model;
pub mod net;
pub mod pb;
pub mod peers;
pub mod wire;

pub use ident::{ClusterId, ClusterIdentity};
pub use trellis_error::{Error, Result};

/// The encoded `FileDescriptorSet` of every Trellis proto, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/trellis_descriptor.bin"));
