//! Inter-cluster mutual TLS (ADR 0014), from the bottom up:
//!
//! - `pem`, `identity`: certificates as text, and the SPIFFE URIs
//!   `spiffe://trellis/cluster/<id>[/<service>]` that name clusters and their services;
//! - `trust`: [`TrustStore`], the peers' CAs pinned at the peering handshake, changed at run
//!   time;
//! - `verification`: [`verify_chain`], a chain checked against the pinned CAs and the
//!   caller's identity read from it; `pin`: [`CaCertHash`], a CA pinned by hash before first
//!   contact; `verifiers`: the rustls verifiers built on both;
//! - `ca`: [`ClusterCa`], a cluster's CA and the service certificates it issues;
//! - `peer_tls`: [`PeerTls`], a service's own certificate (re-read when its files change) plus
//!   the trust store; `expiry`: when its certificates stop being valid, as a metric
//!   ([`ExpiryCollector`]); `managed`: [`ManagedTls`], the CA and certificates Trellis makes
//!   and renews for itself in a directory (`--tls-dir`);
//! - `listener`: the peer listener's server configuration and accept loop ([`incoming`]),
//!   whose connections carry the verified caller ([`PeerConnectInfo`], [`caller`]) into every
//!   request;
//! - `endpoint`, `channel`, `tool`: the client side, [`TlsEndpoint`], the channels of a
//!   service to other clusters ([`peer_channel`], [`handshake_channel`], and
//!   [`cluster_channel`], [`first_contact_channel`], plaintext without TLS), and [`ToolTls`],
//!   trellisctl's.
//!
//! Each module uses only those above it in this list. The submodules are private: everything
//! public is re-exported here, so that callers name `tls::PeerTls`, not where it is defined.

mod ca;
mod channel;
mod endpoint;
mod expiry;
mod identity;
mod listener;
mod managed;
mod peer_tls;
mod pem;
mod pin;
mod tool;
mod trust;
mod verification;
mod verifiers;

pub use ca::{CA_LIFETIME, ClusterCa, IssueOptions, SERVICE_CERT_LIFETIME, ServiceCert};
pub use channel::{
    cluster_channel, first_contact_channel, handshake_channel, peer_channel, peer_channel_pinned,
    pinned_handshake_channel,
};
pub use endpoint::TlsEndpoint;
pub use expiry::{
    EXPIRY_METRIC, ExpiryCollector, NOT_BEFORE_METRIC, not_after, pem_not_after, pem_validity,
    validity,
};
pub use identity::{PeerIdentity, URI_PREFIX, ca_cluster_id, cluster_uri, service_uri};
pub use listener::{Caller, PeerConnectInfo, PeerStream, caller, caller_of, incoming};
pub use managed::{MANAGED_CERT_LIFETIME, ManagedTls, Rotation, announced, rotate_ca};
pub use peer_tls::{PeerTls, TlsFiles};
pub use pem::fingerprint;
pub use pin::CaCertHash;
pub use tool::ToolTls;
pub use trust::{PinnedCa, TrustStore};
pub use verification::verify_chain;

#[cfg(test)]
mod tests;
