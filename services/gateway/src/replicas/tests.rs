//! The election run by real replicas over a memory store and loopback UDP: failover,
//! a returning replica, another key, forgeries, and the flags' checks.
#![allow(clippy::disallowed_methods)] // tests spawn plainly: there is no service subscriber to keep

use trellis_runtime::Shutdown;

use super::*;

const KEY: [u8; 32] = [7; 32];

fn settings(replica: &str) -> Settings {
    Settings {
        replica: replica.into(),
        node_name: replica.into(),
        node_ip: None,
        endpoint_host: format!("{replica}.example"),
        public_key: "the-key".into(),
        listen: "127.0.0.1:0".parse().expect("addr"),
        interval: Duration::from_millis(20),
        failover_after: Duration::from_millis(100),
    }
}

async fn start(replica: &str, store: &SharedStore) -> (Arc<Replicas>, Shutdown) {
    let replicas = Arc::new(
        Replicas::bind(settings(replica), store.clone(), &KEY, &Metrics::new())
            .await
            .expect("binds"),
    );
    let shutdown = Shutdown::new();
    tokio::spawn(replicas.clone().run(shutdown.clone()));
    (replicas, shutdown)
}

/// Waits until `f` holds of the views (checked every 10 ms), at most 5 s.
async fn until(what: &str, f: impl Fn() -> bool) {
    let started = Instant::now();
    while !f() {
        assert!(started.elapsed() < Duration::from_secs(5), "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_is_active_a_silent_one_is_replaced_and_a_returning_one_waits() {
    let store: SharedStore = Arc::new(trellis_store::MemoryStore::new());
    let (a, stop_a) = start("a", &store).await;
    until("a is active", || a.status().view.active).await;
    let (b, stop_b) = start("b", &store).await;
    until("b follows a", || b.status().view.epoch() == 1).await;
    until("a hears b", || {
        a.status().peers.iter().any(|p| p.replica == "b")
    })
    .await;
    // Healthy and heard: b never claims the role, however long it waits.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(a.status().view.active && !b.status().view.active);

    stop_a.cancel();
    until("b takes over", || b.status().view.active).await;
    let view = b.status().view;
    assert_eq!(view.epoch(), 2, "a takeover is the next epoch");
    assert_eq!(
        view.leader.as_ref().map(|l| l.endpoint_host.as_str()),
        Some("b.example"),
        "the active record says where peers that join later must go"
    );

    // a comes back: it hears b and stays a standby.
    let (a, stop_a) = start("a", &store).await;
    until("a follows b", || a.status().view.epoch() == 2).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!a.status().view.active && b.status().view.active);
    let record = read_active(&store).await.expect("reads").expect("a record");
    assert_eq!((record.0.replica.as_str(), record.0.epoch), ("b", 2));
    stop_a.cancel();
    stop_b.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_another_key_never_becomes_active_not_even_when_the_active_dies() {
    let store: SharedStore = Arc::new(trellis_store::MemoryStore::new());
    let (a, stop_a) = start("a", &store).await;
    until("a is active", || a.status().view.active).await;
    let mut odd = settings("odd");
    odd.public_key = "another-key".into();
    let odd = Arc::new(
        Replicas::bind(odd, store.clone(), &[9; 32], &Metrics::new())
            .await
            .expect("binds"),
    );
    let stop_odd = Shutdown::new();
    tokio::spawn(odd.clone().run(stop_odd.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(a.status().view.active && !odd.status().view.active);
    assert!(
        a.status().peers.iter().all(|p| p.replica != "odd"),
        "its heartbeats, under another key, are refused"
    );

    stop_a.cancel();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !odd.status().view.active,
        "a replica with another key took over"
    );
    let record = read_active(&store).await.expect("reads").expect("a record");
    assert_eq!((record.0.replica.as_str(), record.0.epoch), ("a", 1));
    stop_odd.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_heartbeats_neither_keep_a_dead_active_alive_nor_depose_a_live_one() {
    let store: SharedStore = Arc::new(trellis_store::MemoryStore::new());
    let (a, stop_a) = start("a", &store).await;
    until("a is active", || a.status().view.active).await;
    let (b, stop_b) = start("b", &store).await;
    until("b follows a", || b.status().view.epoch() == 1).await;
    let forger = tokio::net::UdpSocket::bind("127.0.0.1:0")
        .await
        .expect("binds");
    let forge = |replica: &str, epoch: u64| {
        let wrong_key = heartbeat::key(&[8; 32]);
        Heartbeat {
            replica: replica.into(),
            active: true,
            warm: true,
            epoch,
            sent_nanos: now_nanos(),
        }
        .encode(&wrong_key)
    };
    // A higher epoch, sent to the active under a key it does not hold.
    for _ in 0..20 {
        forger
            .send_to(&forge("b", 99), a.heartbeat_addr())
            .await
            .expect("sends");
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        a.status().view.active,
        "a forged heartbeat deposed the active"
    );
    // The active dies; forged "a is alive" heartbeats keep coming to the standby.
    stop_a.cancel();
    let b_addr = b.heartbeat_addr();
    let flood = tokio::spawn(async move {
        loop {
            let _ = forger.send_to(&forge("a", 1), b_addr).await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    until("b takes over despite the forgeries", || {
        b.status().view.active
    })
    .await;
    flood.abort();
    stop_b.cancel();
}

#[tokio::test]
async fn a_failover_time_under_two_heartbeats_is_refused_naming_both_flags() {
    let store: SharedStore = Arc::new(trellis_store::MemoryStore::new());
    let mut bad = settings("a");
    bad.failover_after = Duration::from_millis(30);
    let err = Replicas::bind(bad, store, &KEY, &Metrics::new())
        .await
        .expect_err("refused");
    let text = err.to_string();
    assert!(
        text.contains("--failover-after") && text.contains("--heartbeat-interval"),
        "{text}"
    );
}

#[test]
fn a_wildcard_listener_is_advertised_at_the_node_ip() {
    let node: IpAddr = "10.1.0.2".parse().expect("ip");
    assert_eq!(
        advertised("0.0.0.0:7116".parse().expect("addr"), 7116, Some(node)),
        "10.1.0.2:7116".parse().expect("addr")
    );
    assert_eq!(
        advertised("0.0.0.0:0".parse().expect("addr"), 40000, None),
        "127.0.0.1:40000".parse().expect("addr")
    );
    assert_eq!(
        advertised("10.9.0.1:0".parse().expect("addr"), 40000, Some(node)),
        "10.9.0.1:40000".parse().expect("addr")
    );
}
