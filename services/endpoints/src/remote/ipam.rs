//! The port to the IPAMs: this cluster's (which cluster an address belongs to as we address
//! it, how an address is mapped for a target, the hub-path allocations given back, the record
//! of each peer) and other clusters' ([`RemoteIpam`], the induced path). Answers are converted
//! here; what they mean for a translation is the core's to decide.
//!
//! A call to a remote IPAM is retried a bounded number of times while it fails transiently,
//! each attempt bounded by the remote timeouts, so a dead home cluster costs at most
//! `attempts × timeout` before the hub path is taken instead.

use std::future::Future;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::ipam::{ClusterSubnets as WireSubnets, MappingPath as WirePath};
use trellis_api::pb::ipam::{
    DoesClusterMappingExistRequest, GetClusterIdentityRequest, GetHomePodIpRequest,
    GetLocalSubnetsRequest, ListClusterSubnetsRequest, MapEndpointIpRequest, MapEndpointIpResponse,
    UnmapEndpointIpRequest,
};
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_runtime::client::{Timeouts, TracedChannel};
use trellis_runtime::retry::{RetryPolicy, retry};
use trellis_runtime::tls::cluster_channel;

use super::{Clients, local_error};

/// Pause between two attempts of a remote IPAM call: long enough for a restarting server to
/// listen again, short enough to stay well inside the caller's budget.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// How an IPAM mapped an address for a target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MappingPath {
    /// Through how the target addresses the address's cluster.
    LocalNat,
    /// The address is the target's own.
    Home,
    /// Through our external CIDR (the hub path).
    External,
    /// A path this version does not know, as its wire number.
    Unknown(i32),
}

/// An IPAM's mapping of one address for a target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapped {
    pub path: MappingPath,
    /// The address the target uses, as the IPAM answered it (not checked here).
    pub ip: String,
}

/// The local IPAM's record of one peer, as it answered: how we address the peer and how it
/// addresses us. Compared whole to tell whether a translation still holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSubnets {
    pub cluster_id: String,
    pub cluster_name: String,
    /// The peer's real pod CIDR.
    pub remote_pod_cidr: String,
    /// How we address the peer's pod CIDR.
    pub remote_pod_cidr_nat: String,
    /// The peer's real external CIDR.
    pub remote_external_cidr: String,
    /// How we address the peer's external CIDR.
    pub remote_external_cidr_nat: String,
    /// How the peer addresses our pod CIDR.
    pub local_pod_cidr_nat: String,
    /// How the peer addresses our external CIDR.
    pub local_external_cidr_nat: String,
}

impl From<WireSubnets> for ClusterSubnets {
    fn from(c: WireSubnets) -> Self {
        Self {
            cluster_id: c.cluster_id,
            cluster_name: c.cluster_name,
            remote_pod_cidr: c.remote_pod_cidr,
            remote_pod_cidr_nat: c.remote_pod_cidr_nat,
            remote_external_cidr: c.remote_external_cidr,
            remote_external_cidr_nat: c.remote_external_cidr_nat,
            local_pod_cidr_nat: c.local_pod_cidr_nat,
            local_external_cidr_nat: c.local_external_cidr_nat,
        }
    }
}

fn mapped(answer: MapEndpointIpResponse) -> Mapped {
    let path = match WirePath::try_from(answer.path) {
        Ok(WirePath::LocalNat) => MappingPath::LocalNat,
        Ok(WirePath::Home) => MappingPath::Home,
        Ok(WirePath::External) => MappingPath::External,
        _ => MappingPath::Unknown(answer.path),
    };
    Mapped {
        path,
        ip: answer.ip,
    }
}

impl Clients {
    fn ipam(&self) -> IpamClient<TracedChannel> {
        IpamClient::new(self.ipam.clone())
    }

    /// This cluster's pod CIDR.
    pub async fn local_pod_cidr(&self) -> Result<IpNet> {
        let subnets = self
            .ipam()
            .get_local_subnets(GetLocalSubnetsRequest {})
            .await
            .map_err(|s| local_error("ipam", s))?
            .into_inner();
        subnets.pod_cidr.parse::<IpNet>().map_err(|_| {
            Error::Internal(format!(
                "local ipam answered pod CIDR {:?}",
                subnets.pod_cidr
            ))
        })
    }

    /// The peer whose pod or external CIDR holds `ip` as we address it; `None` when no peer's
    /// does. A refused address names `field`.
    pub async fn owner_of(&self, field: &str, ip: IpAddr) -> Result<Option<ClusterIdentity>> {
        let owner = self
            .ipam()
            .get_cluster_identity(GetClusterIdentityRequest { ip: ip.to_string() })
            .await
            .map_err(|s| address_error(field, s))?
            .into_inner();
        if owner.cluster_id.is_empty() {
            return Ok(None);
        }
        ClusterIdentity::parse(
            "cluster_id",
            &owner.cluster_id,
            "cluster_name",
            &owner.cluster_name,
        )
        .map(Some)
        .map_err(|e| {
            Error::Internal(format!(
                "local ipam answered a malformed owner of {ip}: {e}"
            ))
        })
    }

    /// `ip` (of cluster `home`, as we address it) as `home` addresses it itself.
    pub async fn home_pod_ip(&self, field: &str, home: &ClusterId, ip: IpAddr) -> Result<String> {
        Ok(self
            .ipam()
            .get_home_pod_ip(GetHomePodIpRequest {
                cluster_id: home.to_string(),
                ip: ip.to_string(),
            })
            .await
            .map_err(|s| address_error(field, s))?
            .into_inner()
            .home_ip)
    }

    /// The local IPAM's mapping of `ip` for cluster `target` (not induced: local NAT, the
    /// target's own address, or the hub path, which allocates in our external CIDR).
    pub async fn map_endpoint_ip(
        &self,
        field: &str,
        target: &ClusterId,
        ip: IpAddr,
    ) -> Result<Mapped> {
        let answer = self
            .ipam()
            .map_endpoint_ip(MapEndpointIpRequest {
                cluster_id: target.to_string(),
                ip: ip.to_string(),
                induced: false,
            })
            .await
            .map_err(|s| match s.code() {
                tonic::Code::NotFound => Error::FailedPrecondition(format!(
                    "{field}: the local IPAM cannot map {ip} for cluster {target}: {}",
                    s.message()
                )),
                _ => address_error(field, s),
            })?
            .into_inner();
        Ok(mapped(answer))
    }

    /// Gives the hub-path allocation of `ip` for `target` back; returns whether the address
    /// went back to the pool (the IPAM keeps it while another target still uses it).
    pub async fn unmap_endpoint_ip(&self, target: &ClusterId, ip: &str) -> Result<bool> {
        Ok(self
            .ipam()
            .unmap_endpoint_ip(UnmapEndpointIpRequest {
                cluster_id: target.to_string(),
                ip: ip.to_owned(),
            })
            .await
            .map_err(|s| local_error("ipam", s))?
            .into_inner()
            .released)
    }

    /// The local IPAM's record of every peer.
    pub async fn cluster_subnets(&self) -> Result<Vec<ClusterSubnets>> {
        Ok(self
            .ipam()
            .list_cluster_subnets(ListClusterSubnetsRequest {})
            .await
            .map_err(|s| local_error("ipam", s))?
            .into_inner()
            .clusters
            .into_iter()
            .map(ClusterSubnets::from)
            .collect())
    }

    /// The IPAM of cluster `id` at `address`, from the cache when the address is unchanged.
    pub fn remote_ipam(&self, id: &ClusterId, address: &str) -> Result<RemoteIpam> {
        let channel = match self.remote_ipams.lock() {
            Ok(cache) => cache
                .get(id)
                .filter(|(cached, _)| cached == address)
                .map(|(_, found)| found.clone()),
            Err(_) => None,
        };
        let channel = match channel {
            Some(found) => found,
            None => {
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
                created
            }
        };
        Ok(RemoteIpam {
            client: IpamClient::new(channel),
            timeouts: self.remote_ipam_timeouts,
            attempts: self.remote_ipam_attempts,
        })
    }
}

/// Another cluster's IPAM.
#[derive(Debug, Clone)]
pub struct RemoteIpam {
    client: IpamClient<TracedChannel>,
    timeouts: Timeouts,
    attempts: u32,
}

impl RemoteIpam {
    /// Whether this IPAM knows how cluster `target` addresses its cluster (an induced
    /// peering between the two).
    pub async fn has_mapping_for(&self, target: &ClusterId) -> Result<bool> {
        let request = DoesClusterMappingExistRequest {
            cluster_id: target.to_string(),
        };
        let answer = self
            .call(|mut client| {
                let request = request.clone();
                async move { client.does_cluster_mapping_exist(request).await }
            })
            .await
            .map_err(remote_error)?;
        Ok(answer.into_inner().exists)
    }

    /// This IPAM's induced mapping of `home_ip` (an address of its own cluster) for cluster
    /// `target`.
    pub async fn map_induced(&self, target: &ClusterId, home_ip: &str) -> Result<Mapped> {
        let request = MapEndpointIpRequest {
            cluster_id: target.to_string(),
            ip: home_ip.to_owned(),
            induced: true,
        };
        let answer = self
            .call(|mut client| {
                let request = request.clone();
                async move { client.map_endpoint_ip(request).await }
            })
            .await
            .map_err(remote_error)?;
        Ok(mapped(answer.into_inner()))
    }

    /// Calls this IPAM with `call`, retrying while it fails transiently
    /// ([`trellis_runtime::retry::Retryable`]), each attempt bounded by the remote timeouts
    /// (also when the channel itself would wait longer).
    async fn call<T, F, Fut>(&self, mut call: F) -> std::result::Result<T, tonic::Status>
    where
        F: FnMut(IpamClient<TracedChannel>) -> Fut,
        Fut: Future<Output = std::result::Result<T, tonic::Status>>,
    {
        let budget = self.timeouts.connect + self.timeouts.request;
        let policy = RetryPolicy::fixed(RETRY_PAUSE).with_max_attempts(self.attempts);
        retry(&policy, None, || {
            let attempt = tokio::time::timeout(budget, call(self.client.clone()));
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
}

/// A failure of the local IPAM about one address: a refused address names the request field.
fn address_error(field: &str, status: tonic::Status) -> Error {
    match status.code() {
        tonic::Code::InvalidArgument => Error::invalid(field, status.message().to_owned()),
        _ => local_error("ipam", status),
    }
}

/// A remote IPAM's failure, keeping its kind; its text names the gRPC code, since what the
/// core makes of it is an explanation for operators of why the hub path was taken.
fn remote_error(status: tonic::Status) -> Error {
    let code = status.code();
    match Error::from(status) {
        // Already says which code.
        internal @ Error::Internal(_) => internal,
        other => other.context(code),
    }
}
