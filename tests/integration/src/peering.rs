//! What every peering test does with a cluster, in-process or as processes: wait for a
//! condition, read a broker's TunnelEndpoints, fetch a token, peer with another cluster, read
//! how one cluster addresses another, build the slice the reflection tests push.
//! One copy here instead of one per test file; the poller and the peering calls themselves are
//! the test kit's, re-exported, which the namespace lab shares.

use std::future::Future;
use std::net::SocketAddr;

use ipnet::IpNet;
use tonic::transport::Channel;
use trellis_api::pb::endpoints::{AddressType, Endpoint, EndpointSlice};
use trellis_api::pb::ipam::ListClusterSubnetsRequest;
use trellis_api::pb::peering::ListTunnelEndpointsRequest;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::types::{PeeringKind, TunnelEndpoint};

use crate::cluster::InProcessCluster;
use crate::processes::ProcessCluster;

pub use trellis_testkit::eventually;
pub use trellis_testkit::peering::{Peerable, peer, peer_with_token, token, unpeer};

impl Peerable for InProcessCluster {
    fn cluster_id(&self) -> &str {
        &self.id
    }

    fn peering_broker(&self) -> SocketAddr {
        InProcessCluster::peering_broker(self)
    }

    fn broker_client(&self) -> impl Future<Output = anyhow::Result<BrokerClient<Channel>>> + Send {
        self.broker()
    }
}

impl Peerable for ProcessCluster {
    fn cluster_id(&self) -> &str {
        &self.id
    }

    fn peering_broker(&self) -> SocketAddr {
        self.services.broker
    }

    fn broker_client(&self) -> impl Future<Output = anyhow::Result<BrokerClient<Channel>>> + Send {
        self.broker()
    }
}

/// The cluster's TunnelEndpoints.
pub async fn tunnels(cluster: &impl Peerable) -> anyhow::Result<Vec<TunnelEndpoint>> {
    Ok(cluster
        .broker_client()
        .await?
        .list_tunnel_endpoints(ListTunnelEndpointsRequest::default())
        .await?
        .into_inner()
        .tunnel_endpoints)
}

/// The cluster's TunnelEndpoint towards `remote`; `None` also while its broker cannot be
/// reached (callers poll through restarts). For waiting until a tunnel exists only: absence
/// checks use [`no_tunnel_to`] or [`answered_tunnel_to`].
pub async fn tunnel_to(cluster: &impl Peerable, remote: &str) -> Option<TunnelEndpoint> {
    tunnels(cluster)
        .await
        .ok()?
        .into_iter()
        .find(|t| t.remote.as_ref().is_some_and(|r| r.cluster_id == remote))
}

/// The cluster's TunnelEndpoint towards `remote` as its broker answers; an error when the
/// broker cannot be asked. What absence checks use: an unreachable broker must not read as "no
/// tunnel".
pub async fn answered_tunnel_to(
    cluster: &impl Peerable,
    remote: &str,
) -> anyhow::Result<Option<TunnelEndpoint>> {
    Ok(tunnels(cluster)
        .await?
        .into_iter()
        .find(|t| t.remote.as_ref().is_some_and(|r| r.cluster_id == remote)))
}

/// `Some` once the cluster's broker answers that it holds no TunnelEndpoint towards `remote`;
/// `None` while it holds one and while it cannot be reached (for [`eventually`]: absence is
/// proven by an answer, never by a failed call).
pub async fn no_tunnel_to(cluster: &impl Peerable, remote: &str) -> Option<()> {
    match answered_tunnel_to(cluster, remote).await {
        Ok(None) => Some(()),
        Ok(Some(_)) | Err(_) => None,
    }
}

/// How `viewer`'s IPAM addresses `remote`'s pod CIDR (after any remap); panics without one.
pub async fn pod_view(viewer: &InProcessCluster, remote: &str) -> IpNet {
    viewer
        .ipam()
        .await
        .expect("connects to the IPAM")
        .list_cluster_subnets(ListClusterSubnetsRequest {})
        .await
        .expect("lists cluster subnets")
        .into_inner()
        .clusters
        .into_iter()
        .find(|c| c.cluster_id == remote)
        .unwrap_or_else(|| panic!("no mapping for {remote}"))
        .remote_pod_cidr_nat
        .parse()
        .expect("a CIDR")
}

/// Host number `host` of the IPv4 network `net`, as a string.
pub fn host_at(net: IpNet, host: u32) -> String {
    match net {
        IpNet::V4(v4) => std::net::Ipv4Addr::from(u32::from(v4.network()) + host).to_string(),
        IpNet::V6(_) => panic!("IPv4 only"),
    }
}

/// The EndpointSlice the reflection tests push: `shop/web-1` of Service `web`, one IPv4
/// endpoint at `address`.
pub fn web_slice(address: String) -> EndpointSlice {
    EndpointSlice {
        namespace: "shop".into(),
        name: "web-1".into(),
        service_name: "web".into(),
        address_type: AddressType::Ipv4.into(),
        endpoints: vec![Endpoint {
            addresses: vec![address],
            ..Default::default()
        }],
        ports: vec![],
        labels: Default::default(),
    }
}

/// The remote cluster ID of a TunnelEndpoint (empty when it names none).
pub fn remote_id(t: &TunnelEndpoint) -> String {
    t.remote
        .as_ref()
        .map(|r| r.cluster_id.clone())
        .unwrap_or_default()
}

/// Whether two ends of a tunnel agree on the NAT views: what each calls the other is what the
/// other calls itself, for the pod and the external CIDR.
pub fn nat_views_agree(t: &TunnelEndpoint, back: &TunnelEndpoint) -> bool {
    t.local_pod_cidr_nat == back.remote_pod_cidr_nat
        && t.remote_pod_cidr_nat == back.local_pod_cidr_nat
        && t.local_external_cidr_nat == back.remote_external_cidr_nat
        && t.remote_external_cidr_nat == back.local_external_cidr_nat
}

/// The `(remote, kind)` of every TunnelEndpoint `holder` must hold in a converged mesh of `hub`
/// and `leaves`: the hub a full one to each leaf; a leaf a full one to the hub and an induced
/// one to every other leaf.
pub fn expected_hub_mesh(
    hub: &str,
    leaves: &[&str],
    holder: &str,
) -> std::collections::BTreeSet<(String, i32)> {
    let full = PeeringKind::Full as i32;
    if holder == hub {
        return leaves.iter().map(|l| ((*l).to_owned(), full)).collect();
    }
    std::iter::once((hub.to_owned(), full))
        .chain(
            leaves
                .iter()
                .filter(|l| **l != holder)
                .map(|l| ((*l).to_owned(), PeeringKind::Induced as i32)),
        )
        .collect()
}
