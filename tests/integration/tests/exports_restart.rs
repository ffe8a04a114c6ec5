//! Exports survive kill -9, with the real binaries each on its own real etcd: leaf A exports a
//! Service to hub B; A's endpoints service is killed and restarted, then B's. After each
//! restart A still lists its one export, B still holds exactly one slice from A with the same
//! endpoints (nothing lost, nothing duplicated), and a later change and unexport still reach B.
//!
//! Needs etcd and the service binaries (`cargo build --workspace --bins`); skips loudly without
//! etcd (fails in CI).

use std::time::Duration;

use ipnet::IpNet;
use trellis_api::pb::endpoints::{
    EndpointPort, ExportServiceRequest, ExportedEndpoint, ListExportsRequest,
    ListReflectedSlicesRequest, UnexportServiceRequest,
};
use trellis_api::pb::ipam::ListClusterSubnetsRequest;
use trellis_integration::peering::{host_at, peer};
use trellis_integration::processes::{ProcessCluster, Service};
use trellis_testkit::{within, within_eq};

const POD_CIDR: &str = "10.0.0.0/16";
const EXTERNAL_CIDR: &str = "10.201.0.0/16";
/// Generous: 12 processes and 12 etcds share two cores.
const LIMIT: Duration = Duration::from_secs(90);

fn export(hosts: &[&str]) -> ExportServiceRequest {
    ExportServiceRequest {
        namespace: "shop".into(),
        name: "web".into(),
        ports: vec![EndpointPort {
            port: Some(8080),
            ..Default::default()
        }],
        endpoints: hosts
            .iter()
            .map(|h| ExportedEndpoint {
                address: (*h).into(),
                ready: Some(true),
            })
            .collect(),
    }
}

/// Every slice B holds from A: (slice name, addresses); `Err` while B's service is down.
async fn held(b: &ProcessCluster) -> Result<Vec<(String, Vec<String>)>, String> {
    let mut client = b.endpoints().await.map_err(|e| format!("{e:#}"))?;
    let slices = client
        .list_reflected_slices(ListReflectedSlicesRequest {
            source_cluster_id: "leaf-a".into(),
            namespace: String::new(),
        })
        .await
        .map_err(|e| format!("{e:?}"))?
        .into_inner()
        .reflected_slices;
    Ok(slices
        .into_iter()
        .filter_map(|r| r.slice)
        .map(|s| {
            (
                s.name,
                s.endpoints.into_iter().flat_map(|e| e.addresses).collect(),
            )
        })
        .collect())
}

/// The generation of the one slice B holds from A.
async fn generation(b: &ProcessCluster) -> Option<i64> {
    let slices = b
        .endpoints()
        .await
        .ok()?
        .list_reflected_slices(ListReflectedSlicesRequest {
            source_cluster_id: "leaf-a".into(),
            namespace: String::new(),
        })
        .await
        .ok()?
        .into_inner()
        .reflected_slices;
    slices.first().map(|r| r.generation)
}

async fn until_held(
    what: &str,
    a: &ProcessCluster,
    b: &ProcessCluster,
    want: &[(String, Vec<String>)],
) {
    let waited = within(what, LIMIT, || async {
        let got = held(b).await;
        if got.as_deref() == Ok(want) {
            Ok(())
        } else {
            Err(format!("still {got:?}, want {want:?}"))
        }
    })
    .await;
    if let Err(timed_out) = waited {
        panic!("{timed_out}\n{}\n{}", a.logs(25), b.logs(25));
    }
}

async fn export_on(a: &ProcessCluster, hosts: &[&str]) {
    a.endpoints()
        .await
        .expect("connects")
        .export_service(export(hosts))
        .await
        .expect("exports");
}

async fn exports_of(a: &ProcessCluster) -> Vec<(String, usize)> {
    a.endpoints()
        .await
        .expect("connects")
        .list_exports(ListExportsRequest {})
        .await
        .expect("lists")
        .into_inner()
        .exports
        .into_iter()
        .map(|e| (e.name, e.endpoints.len()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_and_imports_survive_kill_9_of_either_endpoints_service() {
    if trellis_testkit::require_tool("etcd").is_none() {
        return;
    }
    let (b, a) = tokio::join!(
        ProcessCluster::start("hub-b", POD_CIDR, EXTERNAL_CIDR),
        ProcessCluster::start("leaf-a", POD_CIDR, EXTERNAL_CIDR),
    );
    let (Some(mut b), Some(mut a)) = (b.expect("b starts"), a.expect("a starts")) else {
        return;
    };
    peer(&a, &b).await;

    a.endpoints()
        .await
        .expect("connects")
        .export_service(export(&["10.0.0.7", "10.0.0.8"]))
        .await
        .expect("exports");
    // B's view of A's pods is known once A could translate for B.
    let first = within("B to import A's export", LIMIT, || async {
        held(&b).await.ok().filter(|got| !got.is_empty())
    })
    .await
    .unwrap_or_else(|timed_out| panic!("{timed_out}\n{}\n{}", a.logs(25), b.logs(25)));
    let b_view_a: IpNet = b
        .ipam()
        .await
        .expect("connects")
        .list_cluster_subnets(ListClusterSubnetsRequest {})
        .await
        .expect("lists")
        .into_inner()
        .clusters
        .into_iter()
        .find(|c| c.cluster_id == "leaf-a")
        .expect("b maps a")
        .remote_pod_cidr_nat
        .parse()
        .expect("cidr");
    let want = vec![(
        "web".to_owned(),
        vec![host_at(b_view_a, 7), host_at(b_view_a, 8)],
    )];
    assert_eq!(first, want);

    // kill -9 the exporter's endpoints service: its export is in its etcd. The restarted one
    // has forgotten what it delivered and sends it again: a newer generation of the same
    // slice, not a second one.
    let before = generation(&b).await.expect("held");
    a.kill9(Service::Endpoints).expect("kills");
    a.restart(Service::Endpoints).await.expect("a restarts");
    assert_eq!(exports_of(&a).await, vec![("web".to_owned(), 2)]);
    let resent = within("A to re-send after its restart", LIMIT, || async {
        generation(&b)
            .await
            .is_some_and(|g| g > before)
            .then_some(())
    })
    .await;
    if let Err(timed_out) = resent {
        panic!("{timed_out}\n{}", a.logs(25));
    }
    assert_eq!(
        held(&b).await,
        Ok(want.clone()),
        "one slice, same endpoints"
    );

    // kill -9 the importer's: its import is in its etcd.
    b.kill9(Service::Endpoints).expect("kills");
    b.restart(Service::Endpoints).await.expect("b restarts");
    assert_eq!(held(&b).await, Ok(want.clone()), "the import survives");

    // Both restarted services still follow changes: scale up, then unexport.
    a.endpoints()
        .await
        .expect("connects")
        .export_service(export(&["10.0.0.7", "10.0.0.8", "10.0.0.9"]))
        .await
        .expect("exports");
    until_held(
        "B follows the scale-up",
        &a,
        &b,
        &[(
            "web".to_owned(),
            vec![
                host_at(b_view_a, 7),
                host_at(b_view_a, 8),
                host_at(b_view_a, 9),
            ],
        )],
    )
    .await;
    assert_eq!(exports_of(&a).await, vec![("web".to_owned(), 3)]);
    a.endpoints()
        .await
        .expect("connects")
        .unexport_service(UnexportServiceRequest {
            namespace: "shop".into(),
            name: "web".into(),
        })
        .await
        .expect("unexports");
    until_held("B after unexport", &a, &b, &[]).await;
    assert_eq!(exports_of(&a).await, vec![]);
}

/// An exporter whose endpoints store is lost (rebuilt etcd, wiped volume) starts its
/// generations again. Its consumer holds a higher generation of the same slice from the earlier
/// incarnation; the new incarnation's changes must still reach it, promptly, not after as many
/// resends as the consumer's generation is ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exporter_that_lost_its_endpoints_store_still_updates_its_consumers() {
    if trellis_testkit::require_tool("etcd").is_none() {
        return;
    }
    let (b, a) = tokio::join!(
        ProcessCluster::start("hub-b", POD_CIDR, EXTERNAL_CIDR),
        ProcessCluster::start("leaf-a", POD_CIDR, EXTERNAL_CIDR),
    );
    let (Some(b), Some(mut a)) = (b.expect("b starts"), a.expect("a starts")) else {
        return;
    };
    peer(&a, &b).await;
    export_on(&a, &["10.0.0.7"]).await;
    let imported = within("B to import A's export", LIMIT, || async {
        (!held(&b).await.unwrap_or_default().is_empty()).then_some(())
    })
    .await;
    if let Err(timed_out) = imported {
        panic!("{timed_out}\n{}\n{}", a.logs(25), b.logs(25));
    }
    let b_view_a: IpNet = b
        .ipam()
        .await
        .expect("connects")
        .list_cluster_subnets(ListClusterSubnetsRequest {})
        .await
        .expect("lists")
        .into_inner()
        .clusters
        .into_iter()
        .find(|c| c.cluster_id == "leaf-a")
        .expect("b maps a")
        .remote_pod_cidr_nat
        .parse()
        .expect("cidr");
    // A few changes, so B holds a generation above the first one.
    export_on(&a, &["10.0.0.7", "10.0.0.8"]).await;
    until_held(
        "B follows the scale-up",
        &a,
        &b,
        &[(
            "web".to_owned(),
            vec![host_at(b_view_a, 7), host_at(b_view_a, 8)],
        )],
    )
    .await;
    let before = generation(&b).await.expect("held");

    // A's endpoints store is lost while the service is down: exports, reflections, all of it.
    a.kill9(Service::Endpoints).expect("kills");
    let keys = a.wipe_store(Service::Endpoints).await;
    assert!(!keys.is_empty(), "A's endpoints store held its export");
    let store = a.store(Service::Endpoints).await.expect("opens a's store");
    assert!(store.list("").await.expect("lists").kvs.is_empty());
    drop(store);
    a.restart(Service::Endpoints).await.expect("a restarts");

    // The exporter exports again, with other endpoints: B must follow within seconds.
    export_on(&a, &["10.0.0.9"]).await;
    let want = vec![("web".to_owned(), vec![host_at(b_view_a, 9)])];
    let limit = Duration::from_secs(10);
    let followed = within_eq("B to follow A's new export", limit, Ok(want), || held(&b));
    if let Err(timed_out) = followed.await {
        panic!(
            "{timed_out} (generation {:?}, was {before} before A lost its store)\n{}",
            generation(&b).await,
            a.logs(25)
        );
    }
    assert!(
        generation(&b).await.is_some_and(|g| g > before),
        "B holds a newer generation than before"
    );
}
