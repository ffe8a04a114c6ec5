//! The client side towards other clusters: the rustls client configurations of a service
//! (mutual TLS against the pinned CAs, first contact with or without a pinned CA hash) and the
//! traced, metered channels built on them. Plaintext stands in when a service has no TLS
//! flags (ADR 0014), so that callers need not care.

use std::sync::Arc;

use tonic::service::interceptor::InterceptedService;
use trellis_error::{Error, Result};

use super::endpoint::TlsEndpoint;
use super::peer_tls::{OwnCert, PeerTls};
use super::pin::CaCertHash;
use super::trust::{PinnedCa, TrustStore};
use super::verification::{algorithms, provider};
use super::verifiers::PeerServerVerifier;
use crate::client::{Timeouts, TracedChannel};
use crate::metrics::Metrics;
use crate::propagation::TraceInterceptor;

pub(super) fn client_config(
    verifier: PeerServerVerifier,
    own: Option<Arc<OwnCert>>,
) -> Result<Arc<rustls::ClientConfig>> {
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| Error::Internal(format!("TLS client configuration: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier));
    let mut config = match own {
        Some(own) => builder.with_client_cert_resolver(own),
        None => builder.with_no_client_auth(),
    };
    config.resumption = rustls::client::Resumption::disabled();
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

impl PeerTls {
    fn client_config_with(
        &self,
        verifier: PeerServerVerifier,
        present: bool,
    ) -> Result<Arc<rustls::ClientConfig>> {
        client_config(verifier, present.then(|| self.own_cert().clone()))
    }

    /// A client configuration presenting our certificate and requiring the server to chain to
    /// a pinned CA (`expected`'s when given).
    pub fn client_config(&self, expected: Option<&str>) -> Result<Arc<rustls::ClientConfig>> {
        self.client_config_with(
            PeerServerVerifier {
                trust: Some(self.trust().clone()),
                expected: expected.map(str::to_owned),
                pin: None,
                algorithms: algorithms(),
            },
            true,
        )
    }

    /// The first-contact configuration of the handshake: no client certificate, any server
    /// certificate (the token authenticates; ADR 0014).
    pub fn handshake_client_config(&self) -> Result<Arc<rustls::ClientConfig>> {
        self.client_config_with(
            PeerServerVerifier {
                trust: None,
                expected: None,
                pin: None,
                algorithms: algorithms(),
            },
            false,
        )
    }

    /// [`PeerTls::handshake_client_config`] that accepts only a server whose chain anchors at
    /// the CA `pin` names.
    pub fn pinned_handshake_client_config(
        &self,
        pin: CaCertHash,
    ) -> Result<Arc<rustls::ClientConfig>> {
        self.client_config_with(
            PeerServerVerifier {
                trust: None,
                expected: None,
                pin: Some(pin),
                algorithms: algorithms(),
            },
            false,
        )
    }
}

fn tls_channel(
    field: &str,
    address: &str,
    timeouts: Timeouts,
    config: Arc<rustls::ClientConfig>,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    let channel = TlsEndpoint::new(field, address, timeouts, config)?.connect_lazy();
    Ok(InterceptedService::new(
        metrics.meter_channel(channel),
        TraceInterceptor::default(),
    ))
}

/// A channel to another cluster's service over mutual TLS: we present our certificate, the
/// server must chain to the CA pinned for `expected` (any pinned CA when `None`).
pub fn peer_channel(
    tls: &PeerTls,
    field: &str,
    address: &str,
    expected: Option<&str>,
    timeouts: Timeouts,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    tls_channel(
        field,
        address,
        timeouts,
        tls.client_config(expected)?,
        metrics,
    )
}

/// A channel to cluster `expected`'s service at `address`: over mutual TLS when `tls` is
/// configured (see [`peer_channel`]), plaintext otherwise (no TLS flags, ADR 0014).
pub fn cluster_channel(
    tls: Option<&PeerTls>,
    field: &str,
    address: &str,
    expected: &str,
    timeouts: Timeouts,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    match tls {
        Some(tls) => peer_channel(tls, field, address, Some(expected), timeouts, metrics),
        None => crate::client::channel(field, address, timeouts, metrics),
    }
}

/// A first-contact channel (no client certificate, server unverified: see
/// [`handshake_channel`]) when `tls` is configured, plaintext otherwise.
pub fn first_contact_channel(
    tls: Option<&PeerTls>,
    field: &str,
    address: &str,
    timeouts: Timeouts,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    match tls {
        Some(tls) => handshake_channel(tls, field, address, timeouts, metrics),
        None => crate::client::channel(field, address, timeouts, metrics),
    }
}

/// A channel to a cluster whose CA is `ca` but no longer pinned (the unpeering notice): we
/// present our certificate, the server must chain to `ca` and name its cluster.
pub fn peer_channel_pinned(
    tls: &PeerTls,
    field: &str,
    address: &str,
    ca: PinnedCa,
    timeouts: Timeouts,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    let only = TrustStore::default();
    let expected = ca.cluster_id.clone();
    only.insert_quiet(ca);
    let config = tls.client_config_with(
        PeerServerVerifier {
            trust: Some(only),
            expected: Some(expected),
            pin: None,
            algorithms: algorithms(),
        },
        true,
    )?;
    tls_channel(field, address, timeouts, config, metrics)
}

/// A channel for the peering handshake that only reaches a server whose chain anchors at the
/// CA `pin` names (`--ca-cert-hash`): a man in the middle never sees the token.
pub fn pinned_handshake_channel(
    tls: &PeerTls,
    field: &str,
    address: &str,
    pin: CaCertHash,
    timeouts: Timeouts,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    tls_channel(
        field,
        address,
        timeouts,
        tls.pinned_handshake_client_config(pin)?,
        metrics,
    )
}

/// A channel for the peering handshake: TLS without a client certificate, server unverified
/// (first contact; the token authenticates, ADR 0014).
pub fn handshake_channel(
    tls: &PeerTls,
    field: &str,
    address: &str,
    timeouts: Timeouts,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    tls_channel(
        field,
        address,
        timeouts,
        tls.handshake_client_config()?,
        metrics,
    )
}
