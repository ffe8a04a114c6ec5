//! The conformance suite against both backends, plus the behaviour only one of them has:
//! etcd key prefixes, etcd compaction and connection failures.

use std::sync::Arc;
use std::time::{Duration, Instant};

use trellis_store::{EtcdStore, MemoryStore, SharedStore, Store, StoreError};
use trellis_testkit::Etcd;

mod memory {
    use super::*;

    async fn setup() -> Option<(SharedStore, ())> {
        Some((Arc::new(MemoryStore::new()), ()))
    }

    trellis_store::conformance_tests!(setup);
}

mod etcd {
    use super::*;

    /// A fresh etcd per test, reached through a prefixed URL so every case also exercises
    /// the prefix mapping.
    async fn setup() -> Option<(SharedStore, Etcd)> {
        let etcd = Etcd::start_or_skip()?;
        let store = trellis_store::open(&etcd.url("conformance"))
            .await
            .unwrap_or_else(|err| panic!("{err}; etcd log:\n{}", etcd.log_tail(20)));
        Some((store, etcd))
    }

    trellis_store::conformance_tests!(setup);
}

async fn connect(etcd: &Etcd, prefix: &str) -> EtcdStore {
    EtcdStore::connect(&[etcd.endpoint()], prefix)
        .await
        .expect("connect to etcd")
}

#[tokio::test]
async fn etcd_prefixes_isolate_stores() {
    let Some(etcd) = Etcd::start_or_skip() else {
        return;
    };
    let ipam = connect(&etcd, "ipam").await;
    let fabric = connect(&etcd, "/fabric/").await;
    let root = connect(&etcd, "").await;

    ipam.put("pools/a", b"1".to_vec()).await.expect("put");
    fabric.put("pools/b", b"2".to_vec()).await.expect("put");

    assert_eq!(ipam.get("pools/b").await.expect("get"), None);
    let listed = ipam.list("").await.expect("list");
    assert_eq!(
        listed
            .kvs
            .iter()
            .map(|kv| kv.key.as_str())
            .collect::<Vec<_>>(),
        ["pools/a"]
    );
    let listed = fabric.list("pools/").await.expect("list");
    assert_eq!(
        listed
            .kvs
            .iter()
            .map(|kv| kv.key.as_str())
            .collect::<Vec<_>>(),
        ["pools/b"]
    );
    // Without a prefix the raw layout shows: each service under its own directory.
    let listed = root.list("").await.expect("list");
    assert_eq!(
        listed
            .kvs
            .iter()
            .map(|kv| kv.key.as_str())
            .collect::<Vec<_>>(),
        ["/fabric/pools/b", "/ipam/pools/a"]
    );

    // Watches are scoped the same way, with keys relative to their store.
    let mut events = ipam.watch("", Some(1)).await.expect("watch");
    let event = trellis_store::conformance::next_event(&mut events).await;
    assert_eq!(event.key(), "pools/a");
    fabric.delete("pools/b").await.expect("delete");
    ipam.put("pools/c", Vec::new()).await.expect("put");
    let event = trellis_store::conformance::next_event(&mut events).await;
    assert_eq!(event.key(), "pools/c");
}

#[tokio::test]
async fn etcd_watch_from_a_compacted_revision_fails() {
    let Some(etcd) = Etcd::start_or_skip() else {
        return;
    };
    let store = connect(&etcd, "c").await;
    for i in 0..5u8 {
        store.put("k", vec![i]).await.expect("put");
    }
    let compact_at = store.list("").await.expect("list").revision;
    let mut raw = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .expect("raw client");
    raw.compact(compact_at, None).await.expect("compact");

    let err = trellis_store::conformance::assert_watch_compacted(&store, 2).await;
    assert_eq!(
        err,
        StoreError::Compacted {
            requested: 2,
            compacted: compact_at
        }
    );
    // The compaction revision itself is still replayable.
    let mut events = store.watch("", Some(compact_at)).await.expect("watch");
    let event = trellis_store::conformance::next_event(&mut events).await;
    assert_eq!(event.revision(), compact_at);
}

#[tokio::test]
async fn memory_watch_from_a_trimmed_revision_fails() {
    let store = MemoryStore::with_history_limit(3);
    for i in 0..5u8 {
        store.put("k", vec![i]).await.expect("put");
    }
    let err = trellis_store::conformance::assert_watch_compacted(&store, 2).await;
    assert_eq!(
        err,
        StoreError::Compacted {
            requested: 2,
            compacted: 4
        }
    );
}

/// The byte budget compacts like etcd: a start before the retained history fails with the
/// oldest retained revision, and that revision itself replays.
#[tokio::test]
async fn memory_watch_from_before_the_byte_budget_is_compacted() {
    // Room for two puts of a 100-byte value to "k" (as the budget counts an event).
    let per_put = std::mem::size_of::<trellis_store::WatchEvent>() + 1 + 100;
    let store = MemoryStore::with_history_limits(10_000, 2 * per_put);
    for i in 0..5u8 {
        store.put("k", vec![i; 100]).await.expect("put");
    }
    // Revisions 2..=6 were written; the budget keeps 5 and 6.
    let err = trellis_store::conformance::assert_watch_compacted(&store, 2).await;
    assert_eq!(
        err,
        StoreError::Compacted {
            requested: 2,
            compacted: 5
        }
    );
    let mut events = store.watch("", Some(5)).await.expect("watch");
    let event = trellis_store::conformance::next_event(&mut events).await;
    assert_eq!(event.revision(), 5);
}

#[tokio::test]
async fn open_fails_fast_when_etcd_is_unreachable() {
    let port = trellis_testkit::free_port();
    let started = Instant::now();
    let err = trellis_store::open(&format!("etcd://127.0.0.1:{port}/x"))
        .await
        .expect_err("nothing listens there");
    assert!(
        matches!(&err, StoreError::Unavailable(msg) if msg.contains(&format!("127.0.0.1:{port}"))),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "took {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn open_fails_fast_when_etcd_hangs() {
    // Accepts connections (the kernel completes the handshake) but never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = silent.local_addr().expect("local addr");
    let started = Instant::now();
    let err = trellis_store::open(&format!("etcd://{addr}"))
        .await
        .expect_err("nothing answers there");
    assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "took {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn open_rejects_bad_urls() {
    assert!(matches!(
        trellis_store::open("etcd://h:notaport").await,
        Err(StoreError::InvalidUrl(_))
    ));
    let store = trellis_store::open("memory://")
        .await
        .expect("memory store");
    assert_eq!(store.put("k", Vec::new()).await, Ok(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_outage_is_unavailable_and_recovers() {
    let Some(mut etcd) = Etcd::start_or_skip() else {
        return;
    };
    let store = connect(&etcd, "outage").await;
    store.put("k", b"v".to_vec()).await.expect("put");
    let mut events = store.watch("", None).await.expect("watch");

    etcd.kill();
    assert!(matches!(
        store.get("k").await,
        Err(StoreError::Unavailable(_))
    ));
    // A watch loses its stream: it reports that rather than going quiet.
    assert!(matches!(
        tokio::time::timeout(
            Duration::from_secs(15),
            futures::StreamExt::next(&mut events)
        )
        .await,
        Ok(Some(Err(StoreError::Unavailable(_))))
    ));

    tokio::task::block_in_place(|| etcd.restart()).expect("restart");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match store.get("k").await {
            Ok(kv) => {
                assert_eq!(kv.map(|kv| kv.value.to_vec()), Some(b"v".to_vec()));
                break;
            }
            Err(err) if Instant::now() < deadline => {
                eprintln!("still waiting for etcd: {err}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(err) => panic!("store did not recover after etcd restarted: {err}"),
        }
    }
}
