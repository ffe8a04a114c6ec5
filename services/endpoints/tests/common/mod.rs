//! Three in-process clusters for the endpoint tests: hub B with leaves A and C, all with pod
//! CIDR 10.0.0.0/16. Each has a real IPAM, a real discovery and an endpoints service on
//! loopback with memory stores; the peering state (subnets, local NAT, ForeignClusters) is set
//! by hand through the services' own RPCs, as the broker would.

#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;

use clap::Parser as _;
use ipnet::IpNet;
use tonic::transport::Channel;
use trellis_api::pb::discovery::UpdatePeeringRequest;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::endpoints::endpoint_mapper_client::EndpointMapperClient;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::ipam::{GetSubnetsPerClusterRequest, SetLocalNatRequest};
use trellis_api::pb::types::{ClusterIdentity, ServiceAddresses};
use trellis_runtime::Shutdown;
use trellis_testkit::peering::full_peering;

pub const POD_CIDR: &str = "10.0.0.0/16";

/// How long an endpoint test waits for a change to reach the clusters it should: generous, the
/// services share two cores with the other tests.
pub const LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// The slices the endpoints service behind `client` holds from `source` (every source when
/// empty).
pub async fn reflected(
    client: &mut EndpointMapperClient<Channel>,
    source: &str,
) -> Vec<trellis_api::pb::endpoints::ReflectedSlice> {
    client
        .list_reflected_slices(trellis_api::pb::endpoints::ListReflectedSlicesRequest {
            source_cluster_id: source.into(),
            namespace: String::new(),
        })
        .await
        .expect("lists reflected slices")
        .into_inner()
        .reflected_slices
}

/// Polls `probe` until it answers `want`, within [`LIMIT`].
pub async fn until<T, F, Fut>(what: &str, want: T, probe: F)
where
    T: PartialEq + std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    trellis_testkit::eventually_eq(what, LIMIT, want, probe).await;
}

/// One in-process cluster.
#[derive(Debug)]
pub struct Cluster {
    pub id: &'static str,
    pub external_cidr: &'static str,
    pub ipam: SocketAddr,
    pub discovery: SocketAddr,
    pub endpoints: SocketAddr,
    /// The endpoints service's `/metrics` listener, when started with one.
    pub endpoints_metrics: Option<SocketAddr>,
    /// Stops this cluster's IPAM only (the "remote IPAM down" test).
    pub ipam_shutdown: Shutdown,
    pub ipam_task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    pub shutdown: Shutdown,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.ipam_shutdown.cancel();
        self.shutdown.cancel();
    }
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

fn common(id: &str, listen: &str) -> Vec<String> {
    args(&[
        "x",
        "--listen",
        listen,
        "--store",
        "memory://",
        "--insecure-plaintext-peering",
        "--cluster-id",
        id,
        "--shutdown-grace",
        "1",
    ])
}

async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect")
}

impl Cluster {
    /// Starts IPAM, discovery and endpoints of cluster `id`; `writer` backs the endpoints
    /// service's Kubernetes writes.
    pub async fn start(
        id: &'static str,
        external_cidr: &'static str,
        writer: Option<trellis_endpoints::KubeWriter>,
    ) -> Self {
        Self::start_inner(id, external_cidr, writer, None, &[]).await
    }

    /// Like [`Self::start`], with `extra` flags for the endpoints service.
    pub async fn start_with_args(
        id: &'static str,
        external_cidr: &'static str,
        extra: &[&str],
    ) -> Self {
        Self::start_inner(id, external_cidr, None, None, extra).await
    }

    /// Like [`Self::start`], the endpoints service with `--kubernetes --kubeconfig FILE` (a
    /// fake API server's): export source and import side run.
    pub async fn start_kube(
        id: &'static str,
        external_cidr: &'static str,
        kubeconfig: &std::path::Path,
    ) -> Self {
        Self::start_inner(id, external_cidr, None, Some(kubeconfig), &[]).await
    }

    async fn start_inner(
        id: &'static str,
        external_cidr: &'static str,
        writer: Option<trellis_endpoints::KubeWriter>,
        kubeconfig: Option<&std::path::Path>,
        extra: &[&str],
    ) -> Self {
        let shutdown = Shutdown::new();
        let ipam_shutdown = Shutdown::new();
        let mut ipam = common(id, "127.0.0.1:0");
        ipam.extend(args(&[
            "--pod-cidr",
            POD_CIDR,
            "--external-cidr",
            external_cidr,
        ]));
        let ipam = trellis_ipam::start(
            trellis_ipam::Config::try_parse_from(ipam).expect("ipam config"),
            ipam_shutdown.clone(),
        )
        .await
        .expect("ipam starts");
        let discovery = trellis_discovery::start(
            trellis_discovery::Config::try_parse_from(common(id, "127.0.0.1:0"))
                .expect("discovery config"),
            shutdown.clone(),
        )
        .await
        .expect("discovery starts");
        let mut endpoints = common(id, "127.0.0.1:0");
        endpoints.extend(args(&[
            "--ipam",
            &ipam.addr.to_string(),
            "--discovery",
            &discovery.addr.to_string(),
            "--remote-ipam-timeout",
            "1000",
        ]));
        endpoints.extend(args(extra));
        let endpoints = match kubeconfig {
            Some(file) => {
                endpoints.extend(args(&[
                    "--kubernetes",
                    "--kubeconfig",
                    &file.display().to_string(),
                ]));
                trellis_endpoints::start(
                    trellis_endpoints::Config::try_parse_from(endpoints).expect("endpoints config"),
                    shutdown.clone(),
                )
                .await
            }
            None => {
                trellis_endpoints::start_with_writer(
                    trellis_endpoints::Config::try_parse_from(endpoints).expect("endpoints config"),
                    writer,
                    shutdown.clone(),
                )
                .await
            }
        }
        .expect("endpoints starts");
        Self {
            id,
            external_cidr,
            ipam: ipam.addr,
            discovery: discovery.addr,
            endpoints: endpoints.addr,
            endpoints_metrics: endpoints.metrics_addr,
            ipam_shutdown,
            ipam_task: Some(ipam.task),
            shutdown,
        }
    }

    pub fn identity(&self) -> ClusterIdentity {
        ClusterIdentity {
            cluster_id: self.id.into(),
            cluster_name: format!("cluster {}", self.id),
        }
    }

    pub async fn ipam(&self) -> IpamClient<Channel> {
        IpamClient::new(channel(self.ipam).await)
    }

    pub async fn endpoints(&self) -> EndpointMapperClient<Channel> {
        EndpointMapperClient::new(channel(self.endpoints).await)
    }

    /// Stops the IPAM and waits until it no longer serves.
    pub async fn stop_ipam(&mut self) {
        self.ipam_shutdown.cancel();
        if let Some(task) = self.ipam_task.take() {
            let _ = task.await;
        }
    }

    /// Records `peer` as a full peer with networking, advertising its IPAM and endpoints.
    pub async fn peer_with(&self, peer: &Cluster) {
        DiscoveryClient::new(channel(self.discovery).await)
            .update_peering(UpdatePeeringRequest {
                reason: "HandshakeCompleted".into(),
                ..full_peering(
                    peer.identity(),
                    ServiceAddresses {
                        discovery: peer.discovery.to_string(),
                        ipam: peer.ipam.to_string(),
                        endpoints: peer.endpoints.to_string(),
                        ..Default::default()
                    },
                )
            })
            .await
            .expect("update peering");
    }
}

/// How `viewer` addresses `other`'s pod and external CIDRs.
#[derive(Debug, Clone, Copy)]
pub struct View {
    pub pod: IpNet,
    pub external: IpNet,
}

/// `viewer`'s IPAM decides how it addresses `other` (GetSubnetsPerCluster).
pub async fn view(viewer: &Cluster, other: &Cluster) -> View {
    let answer = viewer
        .ipam()
        .await
        .get_subnets_per_cluster(GetSubnetsPerClusterRequest {
            cluster_id: other.id.into(),
            cluster_name: format!("cluster {}", other.id),
            pod_cidr: POD_CIDR.into(),
            external_cidr: other.external_cidr.into(),
        })
        .await
        .expect("get subnets")
        .into_inner();
    View {
        pod: answer.pod_cidr_nat.parse().expect("cidr"),
        external: answer.external_cidr_nat.parse().expect("cidr"),
    }
}

/// `x` learns how `y` addresses it (SetLocalNat), as the NetworkConfig status would tell it.
pub async fn set_local_nat(x: &Cluster, y: &Cluster, y_view_of_x: View) {
    x.ipam()
        .await
        .set_local_nat(SetLocalNatRequest {
            cluster_id: y.id.into(),
            cluster_name: format!("cluster {}", y.id),
            pod_cidr: y_view_of_x.pod.to_string(),
            external_cidr: y_view_of_x.external.to_string(),
        })
        .await
        .expect("set local nat");
}

/// Both directions of the network parameters between `x` and `y`.
pub async fn network(x: &Cluster, y: &Cluster) -> (View, View) {
    let x_view_of_y = view(x, y).await;
    let y_view_of_x = view(y, x).await;
    set_local_nat(x, y, y_view_of_x).await;
    set_local_nat(y, x, x_view_of_y).await;
    (x_view_of_y, y_view_of_x)
}

/// The address with `host`'s host bits inside `net`.
pub fn at(net: IpNet, host: u32) -> String {
    match net {
        IpNet::V4(v4) => std::net::Ipv4Addr::from(u32::from(v4.network()) + host).to_string(),
        IpNet::V6(_) => panic!("the tests use IPv4"),
    }
}

/// Hub B with leaves A and C (full peerings B-A and B-C in discovery and IPAM) and, when
/// `induced`, the A-C network parameters exchanged (an induced peering).
#[derive(Debug)]
pub struct Fabric {
    pub a: Cluster,
    pub b: Cluster,
    pub c: Cluster,
    /// B's view of A, of C; C's view of A and of B; A's view of C.
    pub b_view_a: View,
    pub b_view_c: View,
    pub c_view_b: View,
    pub c_view_a: Option<View>,
}

impl Fabric {
    pub async fn start(induced: bool) -> Self {
        let a = Cluster::start("a", "10.101.0.0/16", None).await;
        let b = Cluster::start("b", "10.102.0.0/16", None).await;
        let c = Cluster::start("c", "10.103.0.0/16", None).await;
        Self::connect(a, b, c, induced).await
    }

    pub async fn connect(a: Cluster, b: Cluster, c: Cluster, induced: bool) -> Self {
        let (b_view_a, _) = network(&b, &a).await;
        let (b_view_c, c_view_b) = network(&b, &c).await;
        let c_view_a = if induced {
            Some(network(&c, &a).await.0)
        } else {
            None
        };
        b.peer_with(&a).await;
        b.peer_with(&c).await;
        a.peer_with(&b).await;
        c.peer_with(&b).await;
        Self {
            a,
            b,
            c,
            b_view_a,
            b_view_c,
            c_view_b,
            c_view_a,
        }
    }
}
