//! Endpoint reflection with the real binaries, each service on its own real etcd (issue 5):
//! hub B and leaves A and C, all three with the same pod and external CIDRs, peered through the
//! brokers. B's endpoints service reflects to C a slice whose endpoint is a pod running in A
//! (addressed as B sees it: in B's remap of A's pod CIDR) and delivers it to C's endpoints
//! service.
//!
//! - With induced peering, the address is the one C uses to reach A **directly** (C's remap of
//!   A's pod CIDR, A's host bits), answered by A's IPAM over gRPC.
//! - With induced peering disabled on B (`trellis-discovery --no-induced`), A and C never peer,
//!   and the address is in C's view of B's external CIDR (the hub path).
//!
//! Needs etcd and the service binaries (`cargo build --workspace --bins`, which `make test`
//! does first); skips loudly without etcd (fails in CI).

use std::future::Future;
use std::net::Ipv4Addr;
use std::time::Duration;

use ipnet::{IpNet, Ipv4Net};
use trellis_api::pb::endpoints::{
    AddressTranslation, ListReflectedSlicesRequest, ReflectEndpointSliceRequest,
    ReflectEndpointSliceResponse, ReflectedSlice, TranslationPath, UnreflectEndpointSliceRequest,
};
use trellis_api::pb::ipam::{
    ClusterSubnets, DoesClusterMappingExistRequest, ListClusterSubnetsRequest,
    MapEndpointIpRequest, MappingPath,
};
use trellis_api::pb::types::{ClusterIdentity, PeeringKind, TunnelEndpoint};
use trellis_integration::peering::{self, peer, web_slice};
use trellis_integration::processes::{Options, ProcessCluster};

const POD_CIDR: &str = "10.0.0.0/16";
const EXTERNAL_CIDR: &str = "10.201.0.0/16";
const HUB: &str = "hub-b";
const LEAF_A: &str = "leaf-a";
const LEAF_C: &str = "leaf-c";
/// The pod in A: its home IP is 10.0.0.7, i.e. host bits 7 in any view of A's pod CIDR.
const HOST: u32 = 7;
/// Generous: 18 processes and 18 etcds share two cores.
const LIMIT: Duration = Duration::from_secs(60);

/// Hub B and leaves A and C, all real processes.
struct Mesh {
    b: ProcessCluster,
    a: ProcessCluster,
    c: ProcessCluster,
}

impl Mesh {
    /// Starts the three clusters, B with `hub` options; `None` when etcd is missing.
    async fn start(hub: Options) -> Option<Self> {
        trellis_testkit::require_tool("etcd")?;
        let (b, a, c) = tokio::join!(
            ProcessCluster::start_with(HUB, POD_CIDR, EXTERNAL_CIDR, hub),
            ProcessCluster::start(LEAF_A, POD_CIDR, EXTERNAL_CIDR),
            ProcessCluster::start(LEAF_C, POD_CIDR, EXTERNAL_CIDR),
        );
        Some(Self {
            b: b.expect("b starts")?,
            a: a.expect("a starts")?,
            c: c.expect("c starts")?,
        })
    }

    fn logs(&self) -> String {
        [&self.a, &self.b, &self.c]
            .iter()
            .map(|cluster| cluster.logs(25))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Polls `check` until it yields a value or [`LIMIT`] passes; on timeout fails with the
    /// last observation (`Err`) and the services' log tails.
    async fn eventually<T, F, Fut>(&self, what: &str, check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, String>>,
    {
        trellis_testkit::within(what, LIMIT, check)
            .await
            .unwrap_or_else(|timed_out| panic!("{timed_out}\n{}", self.logs()))
    }

    /// A and C peer with B through B's token, and every full tunnel is up.
    async fn peer_leaves_with_hub(&self) {
        for leaf in [&self.a, &self.c] {
            peer(leaf, &self.b).await;
        }
        for (local, remote) in [
            (&self.a, HUB),
            (&self.c, HUB),
            (&self.b, LEAF_A),
            (&self.b, LEAF_C),
        ] {
            let t = self
                .eventually(&format!("{}'s tunnel to {remote}", local.id), || {
                    tunnel(local, remote)
                })
                .await;
            assert_eq!(t.kind, PeeringKind::Full as i32, "{t:?}");
        }
    }
}

async fn tunnel(cluster: &ProcessCluster, remote: &str) -> Result<TunnelEndpoint, String> {
    let tunnels = peering::tunnels(cluster)
        .await
        .map_err(|e| format!("{}: {e:#}", cluster.id))?;
    tunnels
        .iter()
        .find(|t| t.remote.as_ref().is_some_and(|r| r.cluster_id == remote))
        .cloned()
        .ok_or_else(|| format!("{}: tunnels {tunnels:?}", cluster.id))
}

/// `viewer`'s IPAM record of `remote`.
async fn subnets(viewer: &ProcessCluster, remote: &str) -> Result<ClusterSubnets, String> {
    let mut ipam = viewer.ipam().await.map_err(|e| format!("{e:#}"))?;
    let records = ipam
        .list_cluster_subnets(ListClusterSubnetsRequest {})
        .await
        .map_err(|e| e.to_string())?
        .into_inner()
        .clusters;
    records
        .iter()
        .find(|r| r.cluster_id == remote)
        .cloned()
        .ok_or_else(|| format!("{}: records {records:?}", viewer.id))
}

fn v4(cidr: &str) -> Ipv4Net {
    match cidr.parse::<IpNet>() {
        Ok(IpNet::V4(net)) => net,
        other => panic!("{cidr:?} is not an IPv4 CIDR: {other:?}"),
    }
}

/// The address with `host` bits in `net`.
fn at(net: Ipv4Net, host: u32) -> String {
    Ipv4Addr::from(u32::from(net.network()) + host).to_string()
}

/// The host bits of `ip` in `net`, which must hold it.
fn host_bits(net: Ipv4Net, ip: &str) -> u32 {
    let ip: Ipv4Addr = ip.parse().unwrap_or_else(|_| panic!("{ip:?} is no IPv4"));
    assert!(net.contains(&ip), "{ip} is not in {net}");
    u32::from(ip) - u32::from(net.network())
}

fn identity(id: &str) -> Option<ClusterIdentity> {
    Some(ClusterIdentity {
        cluster_id: id.into(),
        cluster_name: String::new(),
    })
}

/// B reflects a slice holding the pod of A to C, delivering it to C's endpoints service.
async fn reflect_a_pod_to_c(mesh: &Mesh) -> (ReflectEndpointSliceResponse, String) {
    // How B addresses the pod: A's host bits in B's remap of A's pod CIDR.
    let b_view_a = v4(&subnets(&mesh.b, LEAF_A)
        .await
        .expect("B maps A")
        .remote_pod_cidr_nat);
    assert!(
        !b_view_a.contains(&v4(POD_CIDR).network()),
        "B remaps A's pod CIDR, equal to its own: {b_view_a}"
    );
    let original = at(b_view_a, HOST);
    let mut mapper = mesh.b.endpoints().await.expect("connects");
    let answer = mapper
        .reflect_endpoint_slice(ReflectEndpointSliceRequest {
            target: identity(LEAF_C),
            slice: Some(web_slice(original.clone())),
            deliver: true,
        })
        .await
        .unwrap_or_else(|err| panic!("B reflects to C: {err:?}\n{}", mesh.logs()))
        .into_inner();
    (answer, original)
}

fn only_translation(answer: &ReflectEndpointSliceResponse) -> &AddressTranslation {
    assert_eq!(answer.translations.len(), 1, "{answer:?}");
    let t = &answer.translations[0];
    let slice = answer.slice.as_ref().expect("a translated slice");
    assert_eq!(
        slice.endpoints[0].addresses,
        std::slice::from_ref(&t.translated_address),
        "{answer:?}"
    );
    assert!(answer.delivered, "delivered to C: {answer:?}");
    t
}

/// What C's endpoints service holds from B: exactly the delivered slice.
async fn assert_landed_on_c(mesh: &Mesh, translated: &str) -> ReflectedSlice {
    let held = mesh
        .c
        .endpoints()
        .await
        .expect("connects")
        .list_reflected_slices(ListReflectedSlicesRequest::default())
        .await
        .expect("C lists its reflected slices")
        .into_inner()
        .reflected_slices;
    assert_eq!(held.len(), 1, "C holds one reflected slice: {held:#?}");
    let reflected = &held[0];
    assert_eq!(
        reflected.source.as_ref().map(|s| s.cluster_id.as_str()),
        Some(HUB)
    );
    assert!(reflected.generation > 0, "{reflected:?}");
    let slice = reflected.slice.as_ref().expect("a slice");
    assert_eq!(
        (slice.namespace.as_str(), slice.name.as_str()),
        ("shop", "web-1")
    );
    assert_eq!(slice.service_name, "web");
    assert_eq!(slice.endpoints.len(), 1, "{slice:?}");
    assert_eq!(slice.endpoints[0].addresses, [translated.to_owned()]);
    assert!(
        reflected.object_name.is_empty(),
        "no Kubernetes access: nothing written, {reflected:?}"
    );
    reflected.clone()
}

/// B stops reflecting, and C drops the slice; returns how many external addresses B released.
async fn unreflect(mesh: &Mesh) -> u32 {
    let answer = mesh
        .b
        .endpoints()
        .await
        .expect("connects")
        .unreflect_endpoint_slice(UnreflectEndpointSliceRequest {
            target: identity(LEAF_C),
            namespace: "shop".into(),
            name: "web-1".into(),
            deliver: true,
        })
        .await
        .expect("B unreflects")
        .into_inner();
    assert!(answer.unreflected && answer.delivered, "{answer:?}");
    let held = mesh
        .c
        .endpoints()
        .await
        .expect("connects")
        .list_reflected_slices(ListReflectedSlicesRequest::default())
        .await
        .expect("C lists")
        .into_inner()
        .reflected_slices;
    assert!(held.is_empty(), "C dropped the slice: {held:?}");
    answer.released_addresses
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_in_a_reflected_by_the_hub_to_c_is_reached_directly() {
    let Some(mesh) = Mesh::start(Options::default()).await else {
        return;
    };
    mesh.peer_leaves_with_hub().await;
    // The induced peering A↔C is complete: both TunnelEndpoints exist and A's IPAM learned how
    // C addresses it (the status of A's NetworkConfig, relayed back by B's forwarder).
    let c_to_a = mesh
        .eventually("C's induced tunnel to A", || tunnel(&mesh.c, LEAF_A))
        .await;
    let a_to_c = mesh
        .eventually("A's induced tunnel to C", || tunnel(&mesh.a, LEAF_C))
        .await;
    for t in [&c_to_a, &a_to_c] {
        assert_eq!(t.kind, PeeringKind::Induced as i32, "{t:?}");
    }
    mesh.eventually("A's IPAM to know how C addresses A", || async {
        let record = subnets(&mesh.a, LEAF_C).await?;
        if record.local_pod_cidr_nat.is_empty() {
            Err(format!("{record:?}"))
        } else {
            Ok(())
        }
    })
    .await;

    // C's view of A's pod CIDR, as C's tunnel, C's IPAM and A's IPAM all record it.
    let c_view_a = v4(&c_to_a.remote_pod_cidr_nat);
    assert_eq!(
        subnets(&mesh.c, LEAF_A)
            .await
            .expect("C maps A")
            .remote_pod_cidr_nat,
        c_to_a.remote_pod_cidr_nat
    );
    assert_eq!(a_to_c.local_pod_cidr_nat, c_to_a.remote_pod_cidr_nat);
    assert_eq!(
        subnets(&mesh.a, LEAF_C)
            .await
            .expect("A maps C")
            .local_pod_cidr_nat,
        c_to_a.remote_pod_cidr_nat
    );
    // All three clusters have the same pod CIDR: C must remap A, and differently from B.
    let c_to_b = tunnel(&mesh.c, HUB).await.expect("C's tunnel to B");
    for (what, range) in [
        ("C's own pod CIDR", POD_CIDR),
        ("C's own external CIDR", EXTERNAL_CIDR),
        ("C's view of B's pod CIDR", &c_to_b.remote_pod_cidr_nat),
        (
            "C's view of B's external CIDR",
            &c_to_b.remote_external_cidr_nat,
        ),
    ] {
        let range = v4(range);
        assert!(
            !range.contains(&c_view_a.network()) && !c_view_a.contains(&range.network()),
            "C's view of A {c_view_a} overlaps {what} {range}"
        );
    }

    let (answer, original) = reflect_a_pod_to_c(&mesh).await;
    let t = only_translation(&answer);
    assert_eq!(t.original_address, original);
    assert_eq!(
        t.path,
        TranslationPath::Induced as i32,
        "the induced path: {t:?}"
    );
    assert_eq!(
        t.home_cluster.as_ref().map(|h| h.cluster_id.as_str()),
        Some(LEAF_A),
        "{t:?}"
    );
    assert!(t.detail.is_empty(), "{t:?}");
    // C reaches A directly: A's host bits in C's remap of A's pod CIDR.
    assert_eq!(host_bits(c_view_a, &t.translated_address), HOST, "{t:?}");
    assert_eq!(t.translated_address, at(c_view_a, HOST));
    // Which is what A's IPAM answers for C about its own pod 10.0.0.7.
    let home_ip = at(v4(POD_CIDR), HOST);
    let from_a = mesh
        .a
        .ipam()
        .await
        .expect("connects")
        .map_endpoint_ip(MapEndpointIpRequest {
            cluster_id: LEAF_C.into(),
            ip: home_ip,
            induced: true,
        })
        .await
        .expect("A's IPAM maps its pod for C")
        .into_inner();
    assert_eq!(from_a.path, MappingPath::LocalNat as i32, "{from_a:?}");
    assert_eq!(from_a.ip, t.translated_address, "A's IPAM answer for C");

    assert_landed_on_c(&mesh, &t.translated_address).await;
    assert_eq!(
        unreflect(&mesh).await,
        0,
        "the induced path allocates nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_induced_peering_disabled_the_endpoint_takes_the_hub_path() {
    let Some(mesh) = Mesh::start(Options {
        induced: false,
        ..Options::default()
    })
    .await
    else {
        return;
    };
    mesh.peer_leaves_with_hub().await;
    // B introduces nobody: A and C never map each other.
    mesh.eventually("C's IPAM to map B", || subnets(&mesh.c, HUB))
        .await;
    for (leaf, other) in [(&mesh.a, LEAF_C), (&mesh.c, LEAF_A)] {
        let exists = leaf
            .ipam()
            .await
            .expect("connects")
            .does_cluster_mapping_exist(DoesClusterMappingExistRequest {
                cluster_id: other.into(),
            })
            .await
            .expect("answers")
            .into_inner()
            .exists;
        assert!(!exists, "{} maps {other} without induced peering", leaf.id);
    }

    // C's view of B's external CIDR, as C's tunnel and C's IPAM record it, and as B learned it.
    let c_to_b = tunnel(&mesh.c, HUB).await.expect("C's tunnel to B");
    let b_to_c = tunnel(&mesh.b, LEAF_C).await.expect("B's tunnel to C");
    let c_view_b_external = v4(&c_to_b.remote_external_cidr_nat);
    assert_eq!(
        subnets(&mesh.c, HUB)
            .await
            .expect("C maps B")
            .remote_external_cidr_nat,
        c_to_b.remote_external_cidr_nat
    );
    assert_eq!(
        b_to_c.local_external_cidr_nat,
        c_to_b.remote_external_cidr_nat
    );
    assert_ne!(
        c_view_b_external,
        v4(EXTERNAL_CIDR),
        "C remaps B's external CIDR, equal to its own"
    );

    let (answer, original) = reflect_a_pod_to_c(&mesh).await;
    let t = only_translation(&answer);
    assert_eq!(t.original_address, original);
    assert_eq!(
        t.path,
        TranslationPath::HubExternal as i32,
        "the hub path: {t:?}"
    );
    assert_eq!(
        t.home_cluster.as_ref().map(|h| h.cluster_id.as_str()),
        Some(LEAF_A),
        "{t:?}"
    );
    // A has no induced peering with C: a plain decision, not a failure of A's IPAM.
    assert!(t.detail.is_empty(), "{t:?}");
    // An address of B's external CIDR, in C's view of it.
    let host = host_bits(c_view_b_external, &t.translated_address);
    assert!(
        !c_view_b_external.contains(&v4(POD_CIDR).network()),
        "{c_view_b_external}"
    );
    assert!(
        host > 0 && host < u32::from(c_view_b_external.hostmask()),
        "a usable host address: {t:?}"
    );
    let c_view_b_pod = v4(&c_to_b.remote_pod_cidr_nat);
    assert!(
        !c_view_b_pod.contains(&t.translated_address.parse::<Ipv4Addr>().expect("ip")),
        "not in C's view of B's pod CIDR: {t:?}"
    );
    // Reflecting the same slice again keeps the same external address (one per original IP).
    let first = held_generations(&mesh).await;
    let (again, _) = reflect_a_pod_to_c(&mesh).await;
    assert_eq!(
        again.translations[0].translated_address, t.translated_address,
        "{again:?}"
    );

    let landed = mesh
        .c
        .endpoints()
        .await
        .expect("connects")
        .list_reflected_slices(ListReflectedSlicesRequest::default())
        .await
        .expect("C lists")
        .into_inner()
        .reflected_slices;
    assert_eq!(landed.len(), 1, "{landed:#?}");
    assert_eq!(first.len(), 1, "{first:?}");
    assert!(
        landed[0].generation > first[0],
        "the second reflection: {landed:?}"
    );
    assert_eq!(
        landed[0]
            .slice
            .as_ref()
            .map(|s| s.endpoints[0].addresses.clone()),
        Some(vec![t.translated_address.clone()])
    );
    assert_eq!(
        unreflect(&mesh).await,
        1,
        "B's external address goes back to its pool"
    );
}

/// The generations of the slices C holds.
async fn held_generations(mesh: &Mesh) -> Vec<i64> {
    mesh.c
        .endpoints()
        .await
        .expect("connects")
        .list_reflected_slices(ListReflectedSlicesRequest::default())
        .await
        .expect("C lists")
        .into_inner()
        .reflected_slices
        .into_iter()
        .map(|r| r.generation)
        .collect()
}
