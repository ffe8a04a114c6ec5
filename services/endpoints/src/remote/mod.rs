//! gRPC clients: this cluster's IPAM and discovery, other clusters' IPAMs (the induced path) and
//! endpoints services (delivery). Channels connect lazily, carry trace context and are bounded by
//! timeouts; remote IPAM channels are cached per cluster (replaced when the cluster advertises a
//! new address), and a call to one is retried a bounded number of times when it is unavailable,
//! so a dead home cluster costs at most `attempts × timeout`. With mutual TLS configured
//! (ADR 0014) every channel to another cluster presents our certificate and verifies the
//! server against that cluster's pinned CA.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use trellis_api::ClusterId;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::discovery::{GetForeignClusterRequest, GetIdentityRequest};
use trellis_api::pb::endpoints::endpoint_mapper_client::EndpointMapperClient;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::types::ForeignCluster;
use trellis_error::{Error, Result};
use trellis_runtime::client::{Timeouts, TracedChannel, local_channel};
use trellis_runtime::retry::{RetryPolicy, retry};
use trellis_runtime::tls::{PeerTls, cluster_channel};

/// Pause between two attempts of a remote IPAM call: long enough for a restarting server to
/// listen again, short enough to stay well inside the caller's budget.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// How a remote IPAM call is retried: [`RETRY_PAUSE`] between `attempts` attempts in all.
fn remote_ipam_retry(attempts: u32) -> RetryPolicy {
    RetryPolicy::fixed(RETRY_PAUSE).with_max_attempts(attempts)
}

/// Every client the endpoints service uses.
#[derive(Debug)]
pub struct Clients {
    ipam: TracedChannel,
    discovery: TracedChannel,
    remote_ipam_timeouts: Timeouts,
    remote_ipam_attempts: u32,
    deliver_timeouts: Timeouts,
    remote_ipams: Mutex<HashMap<ClusterId, (String, TracedChannel)>>,
    remote_endpoints: Mutex<HashMap<(ClusterId, String), TracedChannel>>,
    tls: Option<PeerTls>,
    metrics: trellis_runtime::metrics::Metrics,
}

/// Settings of [`Clients::new`].
#[derive(Debug, Clone)]
pub struct ClientSettings {
    pub ipam: String,
    pub discovery: String,
    pub local: Timeouts,
    pub remote_ipam: Timeouts,
    pub remote_ipam_attempts: u32,
    pub deliver: Timeouts,
    /// Mutual TLS towards other clusters, when configured.
    pub tls: Option<PeerTls>,
    /// Sent to the local IPAM and discovery only (ADR 0020).
    pub local_token: trellis_runtime::local_auth::LocalToken,
    /// The service's registry: every channel's calls count there (`grpc_client_*`).
    pub metrics: trellis_runtime::metrics::Metrics,
}

impl Clients {
    /// Channels to the local services (validated addresses; nothing connects yet).
    pub fn new(settings: ClientSettings) -> Result<Self> {
        Ok(Self {
            ipam: local_channel(
                "ipam",
                &settings.ipam,
                settings.local,
                &settings.local_token,
                &settings.metrics,
            )?,
            discovery: local_channel(
                "discovery",
                &settings.discovery,
                settings.local,
                &settings.local_token,
                &settings.metrics,
            )?,
            remote_ipam_timeouts: settings.remote_ipam,
            remote_ipam_attempts: settings.remote_ipam_attempts.max(1),
            deliver_timeouts: settings.deliver,
            remote_ipams: Mutex::new(HashMap::new()),
            remote_endpoints: Mutex::new(HashMap::new()),
            tls: settings.tls,
            metrics: settings.metrics,
        })
    }

    /// The channel to this cluster's discovery (the trust store follows its full peers).
    pub fn discovery_channel(&self) -> TracedChannel {
        self.discovery.clone()
    }

    /// This cluster's IPAM.
    pub fn ipam(&self) -> IpamClient<TracedChannel> {
        IpamClient::new(self.ipam.clone())
    }

    /// This cluster's discovery.
    pub fn discovery(&self) -> DiscoveryClient<TracedChannel> {
        DiscoveryClient::new(self.discovery.clone())
    }

    /// The ForeignCluster record of `id`, or `None` when discovery does not know it.
    pub async fn foreign_cluster(&self, id: &ClusterId) -> Result<Option<ForeignCluster>> {
        match self
            .discovery()
            .get_foreign_cluster(GetForeignClusterRequest {
                cluster_id: id.to_string(),
            })
            .await
        {
            Ok(response) => Ok(response.into_inner().foreign_cluster),
            Err(status) if status.code() == tonic::Code::NotFound => Ok(None),
            Err(status) => Err(local_error("discovery", status)),
        }
    }

    /// This cluster's identity, from discovery.
    pub async fn local_identity(&self) -> Result<trellis_api::ClusterIdentity> {
        let response = self
            .discovery()
            .get_identity(GetIdentityRequest {})
            .await
            .map_err(|s| local_error("discovery", s))?
            .into_inner();
        trellis_api::convert::identity_from_pb("identity", response.identity.as_ref())
    }

    /// The IPAM of cluster `id` at `address`, from the cache when the address is unchanged.
    pub fn remote_ipam(&self, id: &ClusterId, address: &str) -> Result<IpamClient<TracedChannel>> {
        if let Ok(cache) = self.remote_ipams.lock()
            && let Some((cached, found)) = cache.get(id)
            && cached == address
        {
            return Ok(IpamClient::new(found.clone()));
        }
        let created = cluster_channel(
            self.tls.as_ref(),
            "addresses.ipam",
            address,
            id.as_str(),
            self.remote_ipam_timeouts,
            &self.metrics,
        )?;
        if let Ok(mut cache) = self.remote_ipams.lock() {
            cache.insert(id.clone(), (address.to_owned(), created.clone()));
        }
        Ok(IpamClient::new(created))
    }

    /// Calls a remote IPAM with `call`, retrying while it fails transiently
    /// ([`trellis_runtime::retry::Retryable`]), each attempt bounded by the remote timeouts
    /// (also when the channel itself would wait longer).
    pub async fn remote_ipam_call<T, F, Fut>(
        &self,
        mut call: F,
    ) -> std::result::Result<T, tonic::Status>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = std::result::Result<T, tonic::Status>>,
    {
        let budget = self.remote_ipam_timeouts.connect + self.remote_ipam_timeouts.request;
        let policy = remote_ipam_retry(self.remote_ipam_attempts);
        retry(&policy, None, || {
            let attempt = tokio::time::timeout(budget, call());
            async move {
                attempt.await.unwrap_or_else(|_| {
                    Err(tonic::Status::deadline_exceeded(format!(
                        "no answer within {} ms",
                        budget.as_millis()
                    )))
                })
            }
        })
        .await
    }

    /// The endpoints service of cluster `id`, at `address`.
    pub fn remote_endpoints(
        &self,
        id: &ClusterId,
        address: &str,
    ) -> Result<EndpointMapperClient<TracedChannel>> {
        let key = (id.clone(), address.to_owned());
        if let Ok(cache) = self.remote_endpoints.lock()
            && let Some(found) = cache.get(&key)
        {
            return Ok(EndpointMapperClient::new(found.clone()));
        }
        let created = cluster_channel(
            self.tls.as_ref(),
            "addresses.endpoints",
            address,
            id.as_str(),
            self.deliver_timeouts,
            &self.metrics,
        )?;
        if let Ok(mut cache) = self.remote_endpoints.lock() {
            cache.insert(key, created.clone());
        }
        Ok(EndpointMapperClient::new(created))
    }
}

/// A local service's failure, keeping its kind; an unreachable one names the service.
pub fn local_error(service: &str, status: tonic::Status) -> Error {
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::DeadlineExceeded => {
            Error::Unavailable(format!("local {service} unreachable: {}", status.message()))
        }
        _ => Error::from(status).context(format!("local {service}")),
    }
}
