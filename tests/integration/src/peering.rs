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
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::types::{PeeringKind, TunnelEndpoint};

use crate::cluster::InProcessCluster;
use crate::processes::ProcessCluster;

pub use trellis_testkit::eventually;
pub use trellis_testkit::peering::{
    Peerable, answered_tunnel_to, no_tunnel_to, peer, peer_request, peer_with_token, token,
    try_peer, tunnel_to, tunnels, unpeer,
};

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
        service: None,
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
