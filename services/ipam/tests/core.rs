//! Behaviour of the IPAM core on the in-memory store: remapping, endpoint translation,
//! freeing, and the no-overlap invariant under random sequences of operations.

// Tests spawn plainly: there is no service subscriber to keep (services/clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use proptest::prelude::*;
use trellis_api::net::overlaps;
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::Error;
use trellis_ipam::core::{Ipam, MappingPath};
use trellis_ipam::subnets::{LocalRanges, LocalSubnets};
use trellis_store::{MemoryStore, SharedStore};

fn net(s: &str) -> IpNet {
    s.parse().expect("test network")
}
fn ip(s: &str) -> IpAddr {
    s.parse().expect("test ip")
}
fn cluster(id: &str) -> ClusterIdentity {
    ClusterIdentity::parse("cluster_id", id, "cluster_name", &format!("name-{id}"))
        .expect("valid id")
}
fn id(s: &str) -> ClusterId {
    ClusterId::parse("cluster_id", s).expect("valid id")
}

fn local(pools: &[&str]) -> LocalSubnets {
    LocalSubnets::new(
        LocalRanges {
            pod_cidr: net("10.0.0.0/16"),
            service_cidr: Some(net("10.96.0.0/12")),
            external_cidr: net("10.201.0.0/16"),
        },
        pools.iter().map(|p| net(p)).collect(),
        vec![],
    )
    .expect("valid local subnets")
}

async fn ipam_with(pools: &[&str]) -> (Ipam, SharedStore) {
    let store: SharedStore = Arc::new(MemoryStore::new());
    let ipam = Ipam::open(store.clone(), local(pools))
        .await
        .expect("opens");
    (ipam, store)
}

/// An IPAM on a memory store whose every read takes `latency`: on tokio's paused clock, a
/// test reads from the time an operation took how many reads it made one after another.
async fn ipam_with_read_latency(latency: Duration) -> Ipam {
    let store: SharedStore = Arc::new(
        trellis_store::counted::Counted::new(Arc::new(MemoryStore::new()))
            .with_read_latency(latency),
    );
    Ipam::open(store, local(&["10.0.0.0/8"]))
        .await
        .expect("opens")
}

/// The hub's side of leaves A and C, both on our pod CIDR (so both remapped), C having told us
/// how it addresses our ranges: A's view and A's pod 10.0.1.5 as the hub addresses it.
async fn a_and_c_at_the_hub(ipam: &Ipam) -> (trellis_ipam::records::RemoteView, IpAddr) {
    let a = ipam
        .subnets_for(&cluster("a"), net("10.0.0.0/16"), net("10.201.0.0/16"))
        .await
        .expect("a");
    ipam.subnets_for(&cluster("c"), net("10.0.0.0/16"), net("10.201.0.0/16"))
        .await
        .expect("c");
    ipam.set_local_nat(&cluster("c"), net("10.80.0.0/16"), net("10.70.0.0/16"))
        .await
        .expect("c nat");
    let pod_in_a = trellis_api::net::translate(ip("10.0.1.5"), net("10.0.0.0/16"), a.pod_cidr_nat)
        .expect("inside");
    (a, pod_in_a)
}

/// An IPAM that reuses freed ranges at once.
async fn ipam_without_quarantine(pools: &[&str]) -> Ipam {
    let store: SharedStore = Arc::new(MemoryStore::new());
    Ipam::open(store, local(pools).with_quarantine(Duration::ZERO))
        .await
        .expect("opens")
}

async fn ipam() -> Ipam {
    ipam_with(&["10.0.0.0/8", "192.168.0.0/16", "172.16.0.0/12"])
        .await
        .0
}

#[tokio::test]
async fn a_remote_cidr_equal_to_ours_is_remapped_with_the_same_prefix_length() {
    let ipam = ipam().await;
    let view = ipam
        .subnets_for(&cluster("a"), net("10.0.0.0/16"), net("10.201.0.0/16"))
        .await
        .expect("maps");
    assert_ne!(view.pod_cidr_nat, net("10.0.0.0/16"));
    assert_eq!(view.pod_cidr_nat.prefix_len(), 16);
    assert_ne!(view.external_cidr_nat, net("10.201.0.0/16"));
    assert_eq!(view.external_cidr_nat.prefix_len(), 16);
    for mine in ipam.local().blocked() {
        assert!(
            !overlaps(view.pod_cidr_nat, mine),
            "{} overlaps {mine}",
            view.pod_cidr_nat
        );
        assert!(!overlaps(view.external_cidr_nat, mine));
    }
    assert!(!overlaps(view.pod_cidr_nat, view.external_cidr_nat));
}

#[tokio::test]
async fn a_free_remote_cidr_is_kept_and_the_call_is_idempotent() {
    let ipam = ipam().await;
    let first = ipam
        .subnets_for(&cluster("a"), net("10.5.0.0/16"), net("10.205.0.0/16"))
        .await
        .expect("maps");
    assert_eq!(first.pod_cidr_nat, net("10.5.0.0/16"));
    assert_eq!(first.external_cidr_nat, net("10.205.0.0/16"));
    let again = ipam
        .subnets_for(&cluster("a"), net("10.5.0.0/16"), net("10.205.0.0/16"))
        .await
        .expect("maps again");
    assert_eq!(first, again);
    let changed = ipam
        .subnets_for(&cluster("a"), net("10.6.0.0/16"), net("10.205.0.0/16"))
        .await
        .expect_err("different CIDR for a mapped cluster");
    assert!(matches!(changed, Error::FailedPrecondition(_)), "{changed}");
}

#[tokio::test]
async fn two_remotes_with_the_same_cidr_get_different_non_overlapping_remaps() {
    let ipam = ipam().await;
    let a = ipam
        .subnets_for(&cluster("a"), net("10.0.0.0/16"), net("10.201.0.0/16"))
        .await
        .expect("maps a");
    let c = ipam
        .subnets_for(&cluster("c"), net("10.0.0.0/16"), net("10.201.0.0/16"))
        .await
        .expect("maps c");
    let all = [
        a.pod_cidr_nat,
        a.external_cidr_nat,
        c.pod_cidr_nat,
        c.external_cidr_nat,
    ];
    for (i, x) in all.iter().enumerate() {
        for y in &all[i + 1..] {
            assert!(!overlaps(*x, *y), "{x} overlaps {y}");
        }
    }
}

#[tokio::test]
async fn exhausted_pools_are_resource_exhausted_and_store_nothing() {
    // Pools with room for exactly one more /16 besides our own ranges.
    let (ipam, _store) = ipam_with(&["10.0.0.0/15"]).await;
    // 10.0.0.0/16 is ours; 10.1.0.0/16 is the only free /16 in the pool.
    let a = ipam
        .subnets_for(&cluster("a"), net("10.0.0.0/16"), net("192.168.7.0/24"))
        .await
        .expect("first remap fits");
    assert_eq!(a.pod_cidr_nat, net("10.1.0.0/16"));
    let before = ipam.list_clusters().await.expect("lists");
    let err = ipam
        .subnets_for(&cluster("b"), net("10.0.0.0/16"), net("192.168.8.0/24"))
        .await
        .expect_err("pools exhausted");
    assert!(matches!(err, Error::ResourceExhausted(_)), "{err}");
    assert!(
        err.to_string().contains("10.0.0.0/15"),
        "message names the pools: {err}"
    );
    assert_eq!(ipam.list_clusters().await.expect("lists"), before);
}

#[tokio::test]
async fn local_pod_ips_map_through_the_targets_view_of_us() {
    let ipam = ipam().await;
    let c = id("c");
    let err = ipam
        .map_endpoint_ip(&c, ip("10.0.3.7"), false)
        .await
        .expect_err("unknown cluster");
    assert!(matches!(err, Error::NotFound(_)), "{err}");
    ipam.subnets_for(&cluster("c"), net("10.0.0.0/16"), net("10.201.0.0/16"))
        .await
        .expect("maps");
    let err = ipam
        .map_endpoint_ip(&c, ip("10.0.3.7"), false)
        .await
        .expect_err("no local nat yet");
    assert!(matches!(err, Error::FailedPrecondition(_)), "{err}");
    assert!(!ipam.mapping_exists(&c).await.expect("answers"));

    ipam.set_local_nat(&cluster("c"), net("10.81.0.0/16"), net("10.82.0.0/16"))
        .await
        .expect("sets");
    assert!(ipam.mapping_exists(&c).await.expect("answers"));
    for induced in [false, true] {
        let m = ipam
            .map_endpoint_ip(&c, ip("10.0.3.7"), induced)
            .await
            .expect("maps");
        assert_eq!(m.ip, ip("10.81.3.7"));
        assert_eq!(m.path, MappingPath::LocalNat);
    }
}

#[tokio::test]
async fn set_local_nat_requires_our_prefix_lengths() {
    let ipam = ipam().await;
    let err = ipam
        .set_local_nat(&cluster("c"), net("10.81.0.0/24"), net("10.82.0.0/16"))
        .await
        .expect_err("wrong size");
    assert!(
        matches!(&err, Error::InvalidArgument { field, .. } if field == "pod_cidr"),
        "{err}"
    );
    assert!(ipam.list_clusters().await.expect("lists").is_empty());
}

#[tokio::test]
async fn third_cluster_ips_go_through_one_shared_external_address() {
    let ipam = ipam().await;
    let (a, pod_in_a) = a_and_c_at_the_hub(&ipam).await;
    ipam.subnets_for(&cluster("d"), net("10.9.0.0/16"), net("10.209.0.0/16"))
        .await
        .expect("d");
    ipam.set_local_nat(&cluster("d"), net("10.60.0.0/16"), net("10.50.0.0/16"))
        .await
        .expect("d nat");
    let to_c = ipam
        .map_endpoint_ip(&id("c"), pod_in_a, false)
        .await
        .expect("maps for c");
    assert_eq!(to_c.path, MappingPath::External);
    assert!(
        net("10.70.0.0/16").contains(&to_c.ip),
        "{} not in C's view of our external CIDR",
        to_c.ip
    );
    let to_d = ipam
        .map_endpoint_ip(&id("d"), pod_in_a, false)
        .await
        .expect("maps for d");
    assert!(net("10.50.0.0/16").contains(&to_d.ip));
    // One external address per original IP, shared by all targets: same host bits.
    assert_eq!(
        trellis_api::net::translate(to_c.ip, net("10.70.0.0/16"), net("10.201.0.0/16")),
        trellis_api::net::translate(to_d.ip, net("10.50.0.0/16"), net("10.201.0.0/16")),
    );
    // Idempotent.
    assert_eq!(
        ipam.map_endpoint_ip(&id("c"), pod_in_a, false)
            .await
            .expect("again"),
        to_c
    );
    let mappings = ipam.list_endpoint_mappings().await.expect("lists");
    assert_eq!(mappings.len(), 1);
    assert_eq!(mappings[0].clusters.len(), 2);

    // A different endpoint gets a different external address.
    let other = trellis_api::net::translate(ip("10.0.1.6"), net("10.0.0.0/16"), a.pod_cidr_nat)
        .expect("inside");
    let other_c = ipam
        .map_endpoint_ip(&id("c"), other, false)
        .await
        .expect("maps");
    assert_ne!(other_c.ip, to_c.ip);

    // Unmapping releases the address only when the last target lets go.
    assert!(
        !ipam
            .unmap_endpoint_ip(&id("c"), pod_in_a)
            .await
            .expect("unmaps c")
    );
    assert!(
        ipam.unmap_endpoint_ip(&id("d"), pod_in_a)
            .await
            .expect("unmaps d")
    );
    assert!(
        !ipam
            .unmap_endpoint_ip(&id("d"), pod_in_a)
            .await
            .expect("idempotent")
    );
    assert_eq!(ipam.list_endpoint_mappings().await.expect("lists").len(), 1);

    // An induced request for a non-local IP is refused: the home IPAM answers those.
    let err = ipam
        .map_endpoint_ip(&id("c"), pod_in_a, true)
        .await
        .expect_err("not home");
    assert!(
        matches!(&err, Error::InvalidArgument { field, .. } if field == "ip"),
        "{err}"
    );
    // An IP no cluster owns is not mapped.
    let err = ipam
        .map_endpoint_ip(&id("c"), ip("172.31.0.1"), false)
        .await
        .expect_err("nobody's");
    assert!(matches!(err, Error::NotFound(_)), "{err}");
}

#[tokio::test]
async fn home_ip_identity_and_the_targets_own_pods() {
    let ipam = ipam().await;
    let a = ipam
        .subnets_for(&cluster("a"), net("10.0.0.0/16"), net("10.201.0.0/16"))
        .await
        .expect("a");
    let seen = trellis_api::net::translate(ip("10.0.4.2"), net("10.0.0.0/16"), a.pod_cidr_nat)
        .expect("inside");
    assert_eq!(
        ipam.home_pod_ip(&id("a"), seen).await.expect("home"),
        ip("10.0.4.2")
    );
    let who = ipam
        .cluster_identity(seen)
        .await
        .expect("answers")
        .expect("found");
    assert_eq!(who.id, id("a"));
    assert_eq!(who.name, "name-a");
    assert_eq!(
        ipam.cluster_identity(ip("172.31.9.9"))
            .await
            .expect("answers"),
        None
    );
    let err = ipam
        .home_pod_ip(&id("a"), ip("172.31.9.9"))
        .await
        .expect_err("outside");
    assert!(
        matches!(&err, Error::InvalidArgument { field, .. } if field == "ip"),
        "{err}"
    );
    // Reflecting A's pod back to A yields its home IP.
    ipam.set_local_nat(&cluster("a"), net("10.33.0.0/16"), net("10.34.0.0/16"))
        .await
        .expect("nat");
    let back = ipam
        .map_endpoint_ip(&id("a"), seen, false)
        .await
        .expect("maps");
    assert_eq!((back.ip, back.path), (ip("10.0.4.2"), MappingPath::Home));
}

#[tokio::test]
async fn free_releases_ranges_and_endpoint_mappings_and_is_idempotent() {
    let ipam = ipam_without_quarantine(&["10.0.0.0/15"]).await;
    let a = ipam
        .subnets_for(&cluster("a"), net("10.0.0.0/16"), net("192.168.1.0/24"))
        .await
        .expect("a");
    ipam.subnets_for(
        &cluster("c"),
        net("192.168.50.0/24"),
        net("192.168.51.0/24"),
    )
    .await
    .expect("c");
    ipam.set_local_nat(&cluster("c"), net("10.80.0.0/16"), net("10.70.0.0/16"))
        .await
        .expect("nat");
    let pod_in_a = trellis_api::net::translate(ip("10.0.1.5"), net("10.0.0.0/16"), a.pod_cidr_nat)
        .expect("inside");
    ipam.map_endpoint_ip(&id("c"), pod_in_a, false)
        .await
        .expect("maps");
    assert_eq!(ipam.list_endpoint_mappings().await.expect("lists").len(), 1);

    assert!(ipam.free(&id("a")).await.expect("frees"));
    // A's pod CIDR may now belong to someone else: its endpoint mapping is gone too.
    assert!(
        ipam.list_endpoint_mappings()
            .await
            .expect("lists")
            .is_empty()
    );
    assert!(!ipam.free(&id("a")).await.expect("idempotent"));
    // The range A held is free again (no quarantine here).
    let b = ipam
        .subnets_for(&cluster("b"), net("10.0.0.0/16"), net("192.168.2.0/24"))
        .await
        .expect("b");
    assert_eq!(b.pod_cidr_nat, a.pod_cidr_nat);
}

#[tokio::test]
async fn a_different_local_config_is_refused_on_an_existing_store() {
    let (_ipam, store) = ipam_with(&["10.0.0.0/8"]).await;
    let other = LocalSubnets::new(
        LocalRanges {
            pod_cidr: net("10.1.0.0/16"),
            service_cidr: Some(net("10.96.0.0/12")),
            external_cidr: net("10.201.0.0/16"),
        },
        vec![net("10.0.0.0/8")],
        vec![],
    )
    .expect("valid");
    let err = Ipam::open(store.clone(), other)
        .await
        .expect_err("mismatch");
    assert!(matches!(err, Error::FailedPrecondition(_)), "{err}");
    // The same config reopens fine (a second replica, or a restart).
    Ipam::open(store, local(&["10.0.0.0/8"]))
        .await
        .expect("same config reopens");
}

#[tokio::test]
async fn concurrent_allocations_on_one_store_never_collide() {
    let store: SharedStore = Arc::new(MemoryStore::new());
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(Arc::new(
            Ipam::open(store.clone(), local(&["10.0.0.0/8"]))
                .await
                .expect("opens"),
        ));
    }
    let mut tasks = Vec::new();
    for n in 0..30 {
        let replica = replicas[n % 3].clone();
        tasks.push(tokio::spawn(async move {
            replica
                .subnets_for(
                    &cluster(&format!("c{n}")),
                    net("10.0.0.0/16"),
                    net("10.201.0.0/16"),
                )
                .await
        }));
    }
    let mut nets = Vec::new();
    for t in tasks {
        let view = t.await.expect("joins").expect("maps");
        nets.extend([view.pod_cidr_nat, view.external_cidr_nat]);
    }
    for (i, x) in nets.iter().enumerate() {
        for y in &nets[i + 1..] {
            assert!(!overlaps(*x, *y), "{x} overlaps {y}");
        }
    }
}

/// Concurrent new peers are allocated in passes, each one transaction: 16 at once take far
/// fewer commits than 16: here 2, the first pass's and one for all the others (one at a time, each waited for the others' store round trips; on
/// etcd each commit is a write to disk). The same new cluster asked twice at once gets one
/// allocation, and every range is distinct.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_new_peers_are_committed_together() {
    let counted = Arc::new(trellis_store::counted::Counted::new(Arc::new(
        MemoryStore::new(),
    )));
    let store: SharedStore = counted.clone();
    let ipam = Arc::new(
        Ipam::open(store, local(&["10.0.0.0/8"]))
            .await
            .expect("opens"),
    );
    let before = counted.writes();
    // The first request to reach the store finds its commit held back, so the others line up
    // behind it as they would behind a slow disk.
    let held = counted.hold().await;
    let mut tasks = Vec::new();
    for n in 0..17 {
        let ipam = ipam.clone();
        // c0 twice: two requests for one new cluster.
        let name = format!("c{}", n.min(16) % 16);
        tasks.push(tokio::spawn(async move {
            ipam.subnets_for(&cluster(&name), net("10.0.0.0/16"), net("10.201.0.0/16"))
                .await
                .map(|view| (name, view))
        }));
    }
    // Each request reads its record once before it waits for a pass; the first pass reads
    // three times before its commit.
    trellis_testkit::eventually_eq(
        "every request waiting",
        Duration::from_secs(10),
        true,
        || async { counted.reads() >= 17 + 3 },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(held);
    let mut views = std::collections::BTreeMap::new();
    for t in tasks {
        let (name, view) = t.await.expect("joins").expect("maps");
        if let Some(first) = views.insert(name.clone(), view) {
            assert_eq!(first, view, "{name} asked twice got two allocations");
        }
    }
    assert_eq!(views.len(), 16);
    let commits = counted.writes() - before;
    assert!(
        commits <= 3,
        "16 concurrent new peers took {commits} commits (one each would be 16)"
    );
    let nets: Vec<IpNet> = views
        .values()
        .flat_map(|v| [v.pod_cidr_nat, v.external_cidr_nat])
        .collect();
    for (i, x) in nets.iter().enumerate() {
        for y in &nets[i + 1..] {
            assert!(!overlaps(*x, *y), "{x} overlaps {y}");
        }
    }
    // What was committed is what was answered.
    for (name, view) in &views {
        let again = ipam
            .subnets_for(&cluster(name), net("10.0.0.0/16"), net("10.201.0.0/16"))
            .await
            .expect("maps");
        assert_eq!(&again, view, "{name}");
    }
}

/// A pass reads the records of the requests it takes all at once, not one after the other:
/// against a store whose every read takes 10 ms (tokio's paused clock), 16 concurrent new
/// peers are answered within a few reads' time. One read per request in turn made a pass of
/// 16 wait 16 reads, on etcd under load 16 round trips of a few milliseconds each.
#[tokio::test(start_paused = true)]
async fn a_pass_reads_the_records_of_its_requests_at_once() {
    let latency = Duration::from_millis(10);
    let ipam = Arc::new(ipam_with_read_latency(latency).await);
    let start = tokio::time::Instant::now();
    let tasks: Vec<_> = (0..16)
        .map(|n| {
            let ipam = ipam.clone();
            tokio::spawn(async move {
                ipam.subnets_for(
                    &cluster(&format!("c{n}")),
                    net("10.0.0.0/16"),
                    net("10.201.0.0/16"),
                )
                .await
            })
        })
        .collect();
    let mut nets = Vec::new();
    for t in tasks {
        let view = t.await.expect("joins").expect("maps");
        nets.extend([view.pod_cidr_nat, view.external_cidr_nat]);
    }
    let took = start.elapsed();
    // Each request's own read, then at most two passes of a few reads each (the epoch, the
    // table once, the records together).
    assert!(
        took <= latency * 10,
        "16 new peers took {took:?}: {} reads one after another",
        took.as_millis() / latency.as_millis()
    );
    for (i, x) in nets.iter().enumerate() {
        for y in &nets[i + 1..] {
            assert!(!overlaps(*x, *y), "{x} overlaps {y}");
        }
    }
}

/// A new external allocation waits as few store round trips as its reads allow: the target's
/// record once, then the endpoint, then the owner and a free address together, then the
/// commit. Against a store whose reads take 10 ms (tokio's paused clock) that is three reads'
/// time; reading the target twice and the owner and the address one after the other was five.
#[tokio::test(start_paused = true)]
async fn an_external_allocation_reads_what_it_can_at_once() {
    let latency = Duration::from_millis(10);
    let ipam = ipam_with_read_latency(latency).await;
    let (_, pod_in_a) = a_and_c_at_the_hub(&ipam).await;

    let start = tokio::time::Instant::now();
    let to_c = ipam
        .map_endpoint_ip(&id("c"), pod_in_a, false)
        .await
        .expect("maps for c");
    let took = start.elapsed();
    assert_eq!(to_c.path, MappingPath::External);
    assert!(net("10.70.0.0/16").contains(&to_c.ip), "{}", to_c.ip);
    assert!(
        took <= latency * 3,
        "a new external allocation took {took:?}: {} reads one after another",
        took.as_millis() / latency.as_millis()
    );
    // Asked again, it is the same address.
    let again = ipam
        .map_endpoint_ip(&id("c"), pod_in_a, false)
        .await
        .expect("maps again");
    assert_eq!(again, to_c);
}

/// Maps `endpoint` (a pod of another leaf) for leaf C: a new external allocation.
async fn map_for_c(ipam: &Ipam, endpoint: IpAddr) {
    let mapped = ipam
        .map_endpoint_ip(&id("c"), endpoint, false)
        .await
        .expect("maps for c");
    assert_eq!(mapped.path, MappingPath::External);
}

/// The listings `ipam` makes while it maps `endpoints` for leaf C.
async fn listings_mapping(
    counted: &trellis_store::counted::Counted,
    ipam: &Ipam,
    endpoints: impl IntoIterator<Item = IpAddr>,
) -> u64 {
    let before = counted.listings();
    for endpoint in endpoints {
        map_for_c(ipam, endpoint).await;
    }
    counted.listings() - before
}

/// At a hub, a new external allocation names the owner of its endpoint from the allocation
/// table the hub keeps and reads that one record, rather than listing every peer's record
/// (with n peers, n records decoded for every new endpoint). A restarted hub lists once, to
/// fill the table.
#[tokio::test]
async fn an_external_allocation_finds_its_owner_without_listing_every_peer() {
    let counted = Arc::new(trellis_store::counted::Counted::new(Arc::new(
        MemoryStore::new(),
    )));
    let store: SharedStore = counted.clone();
    let ipam = Ipam::open(store.clone(), local(&["10.0.0.0/8"]))
        .await
        .expect("opens");
    let (a, _) = a_and_c_at_the_hub(&ipam).await;
    for n in 0..30u8 {
        ipam.subnets_for(
            &cluster(&format!("p{n}")),
            net(&format!("172.16.{n}.0/24")),
            net(&format!("172.17.{n}.0/24")),
        )
        .await
        .expect("peer");
    }
    let pod_of_a = |host: u8| {
        trellis_api::net::translate(
            ip(&format!("10.0.1.{host}")),
            net("10.0.0.0/16"),
            a.pod_cidr_nat,
        )
        .expect("inside")
    };
    let listings = listings_mapping(&counted, &ipam, (1..=10).map(pod_of_a)).await;
    assert_eq!(
        listings, 0,
        "10 new external allocations at a hub of 32 peers listed the records {listings} times"
    );

    let restarted = Ipam::open(store, local(&["10.0.0.0/8"]))
        .await
        .expect("reopens");
    let listings = listings_mapping(&counted, &restarted, (11..=20).map(pod_of_a)).await;
    assert_eq!(
        listings, 1,
        "a restarted hub listed the records {listings} times for 10 new external allocations"
    );
}

/// The allocation table a replica keeps can be behind another replica's work: after the
/// other frees leaf A, an endpoint in A's former range has no owner, whatever the kept table
/// says, and nothing is mapped into the freed range.
#[tokio::test]
async fn a_kept_table_behind_another_replicas_free_maps_nothing_into_the_freed_range() {
    let store: SharedStore = Arc::new(MemoryStore::new());
    let one = Ipam::open(store.clone(), local(&["10.0.0.0/8"]))
        .await
        .expect("opens");
    let (_, pod_in_a) = a_and_c_at_the_hub(&one).await;
    // `one` keeps the table in which A owns the range; `two` frees A behind its back.
    let two = Ipam::open(store, local(&["10.0.0.0/8"]))
        .await
        .expect("opens a second replica");
    assert!(two.free(&id("a")).await.expect("frees a"));
    let err = one
        .map_endpoint_ip(&id("c"), pod_in_a, false)
        .await
        .expect_err("a's range has no owner any more");
    assert!(matches!(err, Error::NotFound(_)), "{err}");
}

#[derive(Debug, Clone)]
enum Step {
    Get {
        cluster: u8,
        pod_third: u8,
        pod_len: u8,
        ext_third: u8,
    },
    Free {
        cluster: u8,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0u8..6, 0u8..8, 14u8..=20, 0u8..8).prop_map(|(cluster, pod_third, pod_len, ext_third)| Step::Get {
            cluster, pod_third, pod_len, ext_third
        }),
        1 => (0u8..6).prop_map(|cluster| Step::Free { cluster }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Over random sequences of get and free, with a small pool so that remaps and exhaustion
    /// both happen, no two mappings ever overlap each other or a local range, and every remap
    /// keeps its prefix length.
    #[test]
    fn mappings_never_overlap(steps in proptest::collection::vec(step(), 1..40)) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        runtime.block_on(async move {
            let (ipam, _store) = ipam_with(&["10.0.0.0/12"]).await;
            for step in steps {
                match step {
                    Step::Get { cluster: c, pod_third, pod_len, ext_third } => {
                        let pod = IpNet::new(std::net::Ipv4Addr::new(10, pod_third, 0, 0).into(), pod_len).expect("valid").trunc();
                        let ext = IpNet::new(std::net::Ipv4Addr::new(10, 200 + ext_third, 0, 0).into(), 20).expect("valid");
                        match ipam.subnets_for(&cluster(&format!("c{c}")), pod, ext).await {
                            Ok(view) => {
                                prop_assert_eq!(view.pod_cidr_nat.prefix_len(), pod.prefix_len());
                                prop_assert_eq!(view.external_cidr_nat.prefix_len(), ext.prefix_len());
                            }
                            Err(Error::ResourceExhausted(_) | Error::FailedPrecondition(_)) => {}
                            Err(other) => prop_assert!(false, "unexpected error {other}"),
                        }
                    }
                    Step::Free { cluster: c } => {
                        ipam.free(&id(&format!("c{c}"))).await.expect("frees");
                    }
                }
                let mut nets: Vec<IpNet> = Vec::new();
                for rec in ipam.list_clusters().await.expect("lists") {
                    if let Some(v) = rec.remote {
                        nets.extend([v.pod_cidr_nat, v.external_cidr_nat]);
                    }
                }
                for (i, x) in nets.iter().enumerate() {
                    for mine in ipam.local().blocked() {
                        prop_assert!(!overlaps(*x, mine), "{} overlaps local {}", x, mine);
                    }
                    for y in &nets[i + 1..] {
                        prop_assert!(!overlaps(*x, *y), "{} overlaps {}", x, y);
                    }
                }
            }
            Ok(())
        })?;
    }
}

#[tokio::test]
async fn a_full_external_cidr_is_resource_exhausted_until_an_address_is_released() {
    let store: SharedStore = Arc::new(MemoryStore::new());
    let tiny = LocalSubnets::new(
        LocalRanges {
            pod_cidr: net("10.0.0.0/16"),
            service_cidr: None,
            // Two usable addresses: .1 and .2.
            external_cidr: net("10.201.0.0/30"),
        },
        vec![net("10.0.0.0/8")],
        vec![],
    )
    .expect("valid");
    let ipam = Ipam::open(store, tiny).await.expect("opens");
    let a = ipam
        .subnets_for(&cluster("a"), net("10.0.0.0/16"), net("10.202.0.0/30"))
        .await
        .expect("a");
    ipam.subnets_for(&cluster("c"), net("10.7.0.0/16"), net("10.207.0.0/30"))
        .await
        .expect("c");
    ipam.set_local_nat(&cluster("c"), net("10.80.0.0/16"), net("10.70.0.0/30"))
        .await
        .expect("nat");
    let pod = |host: u32| {
        let base = u32::from(match a.pod_cidr_nat.network() {
            IpAddr::V4(v4) => v4,
            IpAddr::V6(_) => unreachable!(),
        });
        IpAddr::V4((base + host).into())
    };
    let first = ipam
        .map_endpoint_ip(&id("c"), pod(1), false)
        .await
        .expect("first");
    let second = ipam
        .map_endpoint_ip(&id("c"), pod(2), false)
        .await
        .expect("second");
    assert_ne!(first.ip, second.ip);
    for m in [first.ip, second.ip] {
        assert!(
            [ip("10.70.0.1"), ip("10.70.0.2")].contains(&m),
            "{m} is the network/broadcast address or outside C's view"
        );
    }
    let before = ipam.list_endpoint_mappings().await.expect("lists");
    let err = ipam
        .map_endpoint_ip(&id("c"), pod(3), false)
        .await
        .expect_err("full");
    assert!(matches!(err, Error::ResourceExhausted(_)), "{err}");
    assert_eq!(ipam.list_endpoint_mappings().await.expect("lists"), before);

    assert!(
        ipam.unmap_endpoint_ip(&id("c"), pod(1))
            .await
            .expect("unmaps")
    );
    let third = ipam
        .map_endpoint_ip(&id("c"), pod(3), false)
        .await
        .expect("reuses the freed address");
    assert_eq!(third.ip, first.ip);
}

/// Issue 15 item 5: a `SetLocalNat` that arrives after the cluster was freed (a decision
/// racing the teardown) must not bring a record back, or `DoesClusterMappingExist` answers
/// true for a cluster we no longer peer with.
#[tokio::test]
async fn set_local_nat_after_a_free_is_refused_and_leaves_no_record() {
    let ipam = ipam().await;
    ipam.subnets_for(&cluster("a"), net("10.0.0.0/16"), net("192.168.1.0/24"))
        .await
        .expect("maps a");
    ipam.set_local_nat(&cluster("a"), net("10.80.0.0/16"), net("10.70.0.0/16"))
        .await
        .expect("nat");
    assert!(ipam.free(&id("a")).await.expect("frees"));

    let err = ipam
        .set_local_nat(&cluster("a"), net("10.80.0.0/16"), net("10.70.0.0/16"))
        .await
        .expect_err("a late SetLocalNat is refused");
    assert!(
        matches!(&err, Error::FailedPrecondition(m) if m.contains("cluster a") && m.contains("freed")),
        "{err:?}"
    );
    assert!(ipam.list_clusters().await.expect("lists").is_empty());
    assert!(!ipam.mapping_exists(&id("a")).await.expect("answers"));

    // A new peering with the same cluster maps it again first; then its decision is recorded.
    ipam.subnets_for(&cluster("a"), net("10.0.0.0/16"), net("192.168.1.0/24"))
        .await
        .expect("maps a again");
    ipam.set_local_nat(&cluster("a"), net("10.80.0.0/16"), net("10.70.0.0/16"))
        .await
        .expect("nat of the new peering");
    assert!(ipam.mapping_exists(&id("a")).await.expect("answers"));

    // A cluster never freed may still tell us its decision before we map it (the two
    // directions of an exchange complete in any order).
    ipam.set_local_nat(&cluster("b"), net("10.81.0.0/16"), net("10.71.0.0/16"))
        .await
        .expect("first contact");
    assert!(ipam.mapping_exists(&id("b")).await.expect("answers"));
}

/// A range freed with one cluster is not handed to another one at once: our pods' flows
/// towards the freed cluster may still run, and would enter the next holder's tunnel. The
/// cluster that held it may have it back.
#[tokio::test]
async fn a_freed_range_is_quarantined_from_other_clusters() {
    let ipam = ipam().await;
    let a = ipam
        .subnets_for(&cluster("a"), net("10.0.0.0/16"), net("10.201.0.0/16"))
        .await
        .expect("a");
    assert!(ipam.free(&id("a")).await.expect("frees"));
    let b = ipam
        .subnets_for(&cluster("b"), net("10.0.0.0/16"), net("10.201.0.0/16"))
        .await
        .expect("b");
    for (b_range, a_range) in [
        (b.pod_cidr_nat, a.pod_cidr_nat),
        (b.pod_cidr_nat, a.external_cidr_nat),
        (b.external_cidr_nat, a.pod_cidr_nat),
        (b.external_cidr_nat, a.external_cidr_nat),
    ] {
        assert!(
            !overlaps(b_range, a_range),
            "b got {b_range}, a range of the cluster freed just before ({a:?})"
        );
    }
    // A range kept as it was (no conflict) is quarantined all the same.
    let c = ipam
        .subnets_for(&cluster("c"), net("10.5.0.0/16"), net("10.6.0.0/16"))
        .await
        .expect("c");
    assert_eq!(c.pod_cidr_nat, net("10.5.0.0/16"));
    assert!(ipam.free(&id("c")).await.expect("frees"));
    let d = ipam
        .subnets_for(&cluster("d"), net("10.5.0.0/16"), net("10.6.0.0/16"))
        .await
        .expect("d");
    assert!(
        !overlaps(d.pod_cidr_nat, c.pod_cidr_nat)
            && !overlaps(d.external_cidr_nat, c.external_cidr_nat),
        "d got {d:?}, c's ranges freed just before"
    );
    // c itself, peering again, may have its ranges back.
    let again = ipam
        .subnets_for(&cluster("c"), net("10.5.0.0/16"), net("10.6.0.0/16"))
        .await
        .expect("c again");
    assert_eq!(again.pod_cidr_nat, net("10.5.0.0/16"));
}

/// The quarantine ends: a range freed longer ago than it is anyone's again.
#[tokio::test]
async fn a_quarantine_ends() {
    let store: SharedStore = Arc::new(MemoryStore::new());
    let ipam = Ipam::open(
        store,
        local(&["10.0.0.0/8"]).with_quarantine(Duration::from_millis(300)),
    )
    .await
    .expect("opens");
    let a = ipam
        .subnets_for(&cluster("a"), net("10.0.0.0/16"), net("10.201.0.0/16"))
        .await
        .expect("a");
    assert!(ipam.free(&id("a")).await.expect("frees"));
    let b = ipam
        .subnets_for(&cluster("b"), net("10.0.0.0/16"), net("10.201.0.0/16"))
        .await
        .expect("b");
    assert!(!overlaps(b.pod_cidr_nat, a.pod_cidr_nat), "{b:?} {a:?}");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let c = ipam
        .subnets_for(&cluster("c"), net("10.0.0.0/16"), net("10.201.0.0/16"))
        .await
        .expect("c");
    assert_eq!(
        c.pod_cidr_nat, a.pod_cidr_nat,
        "a's range after its quarantine"
    );
}

/// A full pool does not refuse a peer for the quarantine's sake: the quarantined ranges are
/// handed out when nothing else is free.
#[tokio::test]
async fn quarantined_ranges_are_handed_out_when_nothing_else_is_free() {
    // 10.0.0.0/15: our pod CIDR and one free /16.
    let (ipam, _store) = ipam_with(&["10.0.0.0/15"]).await;
    let a = ipam
        .subnets_for(&cluster("a"), net("10.0.0.0/16"), net("192.168.1.0/24"))
        .await
        .expect("a");
    assert_eq!(a.pod_cidr_nat, net("10.1.0.0/16"));
    assert!(ipam.free(&id("a")).await.expect("frees"));
    let b = ipam
        .subnets_for(&cluster("b"), net("10.0.0.0/16"), net("192.168.2.0/24"))
        .await
        .expect("b gets the quarantined range rather than nothing");
    assert_eq!(b.pod_cidr_nat, a.pod_cidr_nat);
}

/// Quarantines live in the store: a restarted IPAM (or another replica) keeps them.
#[tokio::test]
async fn a_quarantine_outlives_a_restart() {
    let (ipam, store) = ipam_with(&["10.0.0.0/8"]).await;
    let a = ipam
        .subnets_for(&cluster("a"), net("10.0.0.0/16"), net("10.201.0.0/16"))
        .await
        .expect("a");
    assert!(ipam.free(&id("a")).await.expect("frees"));
    drop(ipam);
    let restarted = Ipam::open(store, local(&["10.0.0.0/8"]))
        .await
        .expect("opens");
    let b = restarted
        .subnets_for(&cluster("b"), net("10.0.0.0/16"), net("10.201.0.0/16"))
        .await
        .expect("b");
    assert!(!overlaps(b.pod_cidr_nat, a.pod_cidr_nat), "{b:?} {a:?}");
}

/// Two replicas on one store: each keeps its own table of used ranges between allocations,
/// and a range the other one allocated or freed meanwhile is seen by the next allocation.
#[tokio::test]
async fn replicas_see_each_others_allocations_and_frees() {
    let store: SharedStore = Arc::new(MemoryStore::new());
    // No quarantine: a freed range is free again at once.
    let local = || local(&["10.0.0.0/14"]).with_quarantine(Duration::ZERO);
    let first = Ipam::open(store.clone(), local()).await.expect("opens");
    let second = Ipam::open(store.clone(), local()).await.expect("opens");
    // Both load their tables.
    let a = first
        .subnets_for(&cluster("a"), net("10.0.0.0/16"), net("192.168.1.0/24"))
        .await
        .expect("a");
    let b = second
        .subnets_for(&cluster("b"), net("10.0.0.0/16"), net("192.168.2.0/24"))
        .await
        .expect("b");
    assert!(!overlaps(a.pod_cidr_nat, b.pod_cidr_nat));
    // The first replica allocates again after the second did: no overlap with b.
    let c = first
        .subnets_for(&cluster("c"), net("10.0.0.0/16"), net("192.168.3.0/24"))
        .await
        .expect("c");
    assert!(!overlaps(c.pod_cidr_nat, b.pod_cidr_nat));
    assert!(!overlaps(c.pod_cidr_nat, a.pod_cidr_nat));
    // A free on one replica makes the range available to the other.
    assert!(second.free(&id("a")).await.expect("frees"));
    let d = first
        .subnets_for(&cluster("d"), net("10.0.0.0/16"), net("192.168.4.0/24"))
        .await
        .expect("d");
    assert_eq!(d.pod_cidr_nat, a.pod_cidr_nat);
}
