//! The behaviour every [`Store`] must show, written once and run against each backend.
//!
//! Each case is a function taking a fresh, empty store. [`conformance_tests!`] expands to one
//! `#[tokio::test]` per case, so a failure names the case and the backend:
//!
//! ```ignore
//! async fn setup() -> Option<(trellis_store::SharedStore, ())> {
//!     Some((std::sync::Arc::new(trellis_store::MemoryStore::new()), ()))
//! }
//! trellis_store::conformance_tests!(setup);
//! ```
//!
//! `setup` returns `None` to skip (e.g. etcd is not installed), and a guard (e.g. the etcd
//! process) that lives as long as the test. The calling crate needs `tokio` with the `macros`
//! and `rt-multi-thread` features. Cases panic on failure: this is test code.
//!
//! [`conformance_tests!`]: crate::conformance_tests

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;

use crate::{
    Compare, KeyValue, LeaseId, Op, Revision, SharedStore, Store, StoreError, Txn, WatchEvent,
    WatchStream,
};

/// Expands to one `#[tokio::test]` per conformance case, each calling `$setup().await` for
/// an `Option<(SharedStore, Guard)>` and skipping on `None`.
#[macro_export]
macro_rules! conformance_tests {
    ($setup:path) => {
        $crate::conformance_tests!(@cases $setup;
            get_missing_then_put_then_get,
            versions_and_revisions_increase,
            list_by_prefix_is_sorted_and_scoped,
            list_revisions_matches_the_listing_without_values,
            size_counts_keys_and_values_under_the_prefix,
            delete_reports_whether_the_key_existed,
            txn_success_branch_is_atomic,
            txn_failure_branch,
            txn_value_compare,
            txn_mod_revision_compare,
            txn_create_if_absent_has_one_winner,
            txn_cas_counter_loses_no_increment,
            txn_larger_than_etcd_allows_is_refused,
            txn_chunks_each_fit,
            watch_from_now_sees_puts_and_deletes_in_order,
            watch_resumes_without_gaps_or_duplicates,
            watch_from_listing_revision_misses_nothing,
            watch_ignores_keys_outside_its_prefix,
            watch_txn_events_share_one_revision,
            lease_revoke_deletes_keys_with_events,
            lease_expiry_deletes_keys_with_events,
            lease_keep_alive_postpones_expiry,
            lease_operations_on_a_revoked_lease_fail,
            put_without_lease_detaches_the_key,
            txn_put_attaches_a_lease,
        );
    };
    (@cases $setup:path; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                let Some((store, _guard)) = $setup().await else {
                    return;
                };
                $crate::conformance::$case(store).await;
            }
        )*
    };
}

/// How long a case waits for an event that must come (lease expiry on etcd takes ~2.5 s).
const EVENT_TIMEOUT: Duration = Duration::from_secs(10);

/// The next event, failing the test on an error, the stream's end or a timeout.
pub async fn next_event(events: &mut WatchStream) -> WatchEvent {
    match tokio::time::timeout(EVENT_TIMEOUT, events.next()).await {
        Ok(Some(Ok(event))) => event,
        Ok(Some(Err(err))) => panic!("watch failed: {err}"),
        Ok(None) => panic!("watch ended"),
        Err(_) => panic!("no watch event within {EVENT_TIMEOUT:?}"),
    }
}

fn put_event(event: &WatchEvent) -> &KeyValue {
    match event {
        WatchEvent::Put(kv) => kv,
        WatchEvent::Delete { key, .. } => panic!("expected a put, got a delete of {key}"),
    }
}

fn delete_event(event: &WatchEvent) -> (&str, Revision) {
    match event {
        WatchEvent::Delete { key, mod_revision } => (key, *mod_revision),
        WatchEvent::Put(kv) => panic!("expected a delete, got a put of {}", kv.key),
    }
}

async fn put(store: &SharedStore, key: &str, value: &str) -> Revision {
    store
        .put(key, value.as_bytes().to_vec())
        .await
        .expect("put succeeds")
}

async fn get(store: &SharedStore, key: &str) -> Option<KeyValue> {
    store.get(key).await.expect("get succeeds")
}

async fn revision(store: &SharedStore) -> Revision {
    store.list("").await.expect("list succeeds").revision
}

fn keys(kvs: &[KeyValue]) -> Vec<&str> {
    kvs.iter().map(|kv| kv.key.as_str()).collect()
}

/// Reading a missing key is `None`; after a put it has the put's revision and version 1.
pub async fn get_missing_then_put_then_get(store: SharedStore) {
    assert_eq!(get(&store, "k").await, None);
    let rev = put(&store, "k", "v1").await;
    let kv = get(&store, "k").await.expect("k exists");
    assert_eq!(
        kv,
        KeyValue {
            key: "k".into(),
            value: Bytes::from_static(b"v1"),
            create_revision: rev,
            mod_revision: rev,
            version: 1,
            lease: None,
        }
    );
}

/// Every write bumps the store revision; versions count writes since creation.
pub async fn versions_and_revisions_increase(store: SharedStore) {
    let first = put(&store, "k", "1").await;
    let second = put(&store, "k", "2").await;
    let other = put(&store, "other", "x").await;
    assert!(
        first < second && second < other,
        "{first} < {second} < {other}"
    );
    let kv = get(&store, "k").await.expect("k exists");
    assert_eq!(
        (kv.create_revision, kv.mod_revision, kv.version),
        (first, second, 2)
    );
    assert_eq!(revision(&store).await, other);

    assert!(store.delete("k").await.expect("delete"));
    let recreated = put(&store, "k", "3").await;
    let kv = get(&store, "k").await.expect("k exists again");
    assert_eq!(
        (kv.create_revision, kv.mod_revision, kv.version),
        (recreated, recreated, 1),
        "a recreated key starts over"
    );
}

/// Listings hold exactly the keys under the prefix, sorted, at the current revision.
pub async fn list_by_prefix_is_sorted_and_scoped(store: SharedStore) {
    for key in ["a/2", "ab/1", "a/1", "b", "a/3/x", "a"] {
        put(&store, key, key).await;
    }
    let last = put(&store, "a/0", "a/0").await;

    let listing = store.list("a/").await.expect("list");
    assert_eq!(keys(&listing.kvs), ["a/0", "a/1", "a/2", "a/3/x"]);
    assert_eq!(listing.revision, last);
    assert_eq!(listing.kvs[1].value, &b"a/1"[..]);

    let listing = store.list("ab/").await.expect("list");
    assert_eq!(keys(&listing.kvs), ["ab/1"]);

    let listing = store.list("").await.expect("list");
    assert_eq!(
        keys(&listing.kvs),
        ["a", "a/0", "a/1", "a/2", "a/3/x", "ab/1", "b"]
    );

    let listing = store.list("zz/").await.expect("list");
    assert!(listing.kvs.is_empty());
    assert_eq!(listing.revision, last);
}

/// `list_revisions` names the same keys as `list`, each with the revision it last changed at,
/// as of the same store revision; it follows updates and deletes and keeps to its prefix.
pub async fn list_revisions_matches_the_listing_without_values(store: SharedStore) {
    for key in ["r/2", "r/1", "rr/1", "r/3"] {
        put(&store, key, "first").await;
    }
    put(&store, "r/1", "second").await;
    store.delete("r/3").await.expect("delete");
    let last = put(&store, "q", "outside").await;

    let listing = store.list("r/").await.expect("list");
    let revisions = store.list_revisions("r/").await.expect("list revisions");
    assert_eq!(keys(&listing.kvs), ["r/1", "r/2"]);
    let expected: Vec<(String, Revision)> = listing
        .kvs
        .iter()
        .map(|kv| (kv.key.clone(), kv.mod_revision))
        .collect();
    assert_eq!(revisions.keys, expected);
    assert_eq!(revisions.revision, last);
    // The updated key's revision is its update's, not its creation's.
    assert!(revisions.keys[0].1 > revisions.keys[1].1);

    let empty = store.list_revisions("zz/").await.expect("list revisions");
    assert!(empty.keys.is_empty());
    assert_eq!(empty.revision, last);
}

/// `size` counts the keys under the prefix and the bytes of their keys and values.
pub async fn size_counts_keys_and_values_under_the_prefix(store: SharedStore) {
    assert_eq!(
        store.size("").await.expect("size"),
        crate::StoreSize::default()
    );
    put(&store, "a/1", "xyz").await;
    put(&store, "a/22", "").await;
    put(&store, "b", "0123456789").await;
    let size = store.size("a/").await.expect("size");
    assert_eq!((size.keys, size.bytes), (2, 3 + 3 + 4));
    let size = store.size("").await.expect("size");
    assert_eq!((size.keys, size.bytes), (3, 3 + 3 + 4 + 1 + 10));
    assert_eq!(
        store.size("zz/").await.expect("size"),
        crate::StoreSize::default()
    );
}

/// `delete` says whether there was something to delete; deleting nothing changes nothing.
pub async fn delete_reports_whether_the_key_existed(store: SharedStore) {
    assert!(!store.delete("k").await.expect("delete"));
    put(&store, "k", "v").await;
    assert!(store.delete("k").await.expect("delete"));
    assert_eq!(get(&store, "k").await, None);
    let after = revision(&store).await;
    assert!(!store.delete("k").await.expect("delete"));
    assert_eq!(
        revision(&store).await,
        after,
        "a no-op delete is not a revision"
    );
}

/// When every compare holds, all success ops apply at one revision.
pub async fn txn_success_branch_is_atomic(store: SharedStore) {
    put(&store, "gone", "x").await;
    let outcome = store
        .txn(
            Txn::new()
                .when(Compare::absent("a"))
                .when(Compare::absent("b"))
                .then(Op::put("a", "1"))
                .then(Op::put("b", "2"))
                .then(Op::delete("gone"))
                .otherwise(Op::put("failed", "1")),
        )
        .await
        .expect("txn");
    assert!(outcome.succeeded);
    let a = get(&store, "a").await.expect("a written");
    let b = get(&store, "b").await.expect("b written");
    assert_eq!(
        (a.mod_revision, b.mod_revision),
        (outcome.revision, outcome.revision)
    );
    assert_eq!(get(&store, "gone").await, None);
    assert_eq!(get(&store, "failed").await, None);
    assert_eq!(revision(&store).await, outcome.revision);
}

/// etcd refuses a transaction with more than `--max-txn-ops` (128 by default) compares or ops
/// in a branch and writes nothing; the memory store must refuse the same, or code that only
/// ever ran against memory would fail in production.
pub async fn txn_larger_than_etcd_allows_is_refused(store: SharedStore) {
    let puts = |n: usize| {
        (0..n)
            .map(|i| Op::put(format!("k/{i:03}"), "v"))
            .collect::<Vec<_>>()
    };
    let largest = Txn {
        success: puts(crate::MAX_TXN_OPS),
        ..Txn::default()
    };
    assert!(store.txn(largest).await.expect("128 ops fit").succeeded);
    store
        .txn(Txn::new().then(Op::delete("k/000")))
        .await
        .expect("delete");
    for too_large in [
        Txn {
            success: [puts(crate::MAX_TXN_OPS), vec![Op::put("extra", "v")]].concat(),
            ..Txn::default()
        },
        Txn {
            compares: (0..=crate::MAX_TXN_OPS)
                .map(|i| Compare::absent(format!("c/{i:03}")))
                .collect(),
            success: vec![Op::put("extra", "v")],
            ..Txn::default()
        },
    ] {
        let before = revision(&store).await;
        let err = store.txn(too_large).await.expect_err("refused");
        assert!(matches!(err, StoreError::Internal(_)), "{err:?}");
        assert!(err.to_string().contains("too many operations"), "{err}");
        assert_eq!(revision(&store).await, before, "nothing written");
        assert_eq!(get(&store, "extra").await, None);
    }
}

/// [`Txn::chunks`] splits 300 guarded writes into transactions the store accepts, each
/// carrying the shared guard.
pub async fn txn_chunks_each_fit(store: SharedStore) {
    let guard = put(&store, "guard", "g").await;
    let groups = (0..300)
        .map(|i| {
            let key = format!("r/{i:03}");
            (vec![Compare::absent(key.clone())], vec![Op::put(key, "v")])
        })
        .collect();
    let chunks = Txn::chunks(&[Compare::mod_revision("guard", guard)], groups).expect("chunks");
    assert!(chunks.len() >= 3, "{} chunks", chunks.len());
    for chunk in chunks {
        assert!(store.txn(chunk).await.expect("a chunk fits").succeeded);
    }
    assert_eq!(store.list("r/").await.expect("list").kvs.len(), 300);
}

/// When a compare fails, only the failure ops apply.
pub async fn txn_failure_branch(store: SharedStore) {
    put(&store, "k", "v").await;
    let outcome = store
        .txn(
            Txn::new()
                .when(Compare::absent("k"))
                .then(Op::put("x", "1"))
                .otherwise(Op::put("y", "1"))
                .otherwise(Op::delete("k")),
        )
        .await
        .expect("txn");
    assert!(!outcome.succeeded);
    assert_eq!(get(&store, "x").await, None);
    assert_eq!(get(&store, "k").await, None);
    let y = get(&store, "y").await.expect("y written");
    assert_eq!(y.mod_revision, outcome.revision);

    // A failed txn without failure ops writes nothing.
    let before = revision(&store).await;
    let outcome = store
        .txn(
            Txn::new()
                .when(Compare::absent("y"))
                .then(Op::put("z", "1")),
        )
        .await
        .expect("txn");
    assert!(!outcome.succeeded);
    assert_eq!(outcome.revision, before);
}

/// A value compare holds only for an existing key with exactly that value.
pub async fn txn_value_compare(store: SharedStore) {
    put(&store, "k", "a").await;
    let attempt = |value: &'static str, key: &'static str| {
        let store = Arc::clone(&store);
        async move {
            store
                .txn(
                    Txn::new()
                        .when(Compare::value(key, value))
                        .then(Op::put("hit", value)),
                )
                .await
                .expect("txn")
                .succeeded
        }
    };
    assert!(!attempt("b", "k").await);
    assert!(
        !attempt("", "missing").await,
        "a missing key has no value, not an empty one"
    );
    assert!(attempt("a", "k").await);
    assert_eq!(
        get(&store, "hit").await.map(|kv| kv.value),
        Some(Bytes::from_static(b"a"))
    );
}

/// A mod-revision compare holds only for the revision that last wrote the key.
pub async fn txn_mod_revision_compare(store: SharedStore) {
    let stale = put(&store, "k", "1").await;
    let current = put(&store, "k", "2").await;
    let swap = |revision: Revision| {
        Txn::new()
            .when(Compare::mod_revision("k", revision))
            .then(Op::put("k", "3"))
    };
    assert!(!store.txn(swap(stale)).await.expect("txn").succeeded);
    assert!(
        !store.txn(swap(0)).await.expect("txn").succeeded,
        "0 means absent"
    );
    assert!(store.txn(swap(current)).await.expect("txn").succeeded);
    assert_eq!(
        get(&store, "k").await.map(|kv| kv.value),
        Some(Bytes::from_static(b"3"))
    );
}

/// Many racing "create if absent" transactions: exactly one wins.
pub async fn txn_create_if_absent_has_one_winner(store: SharedStore) {
    const RACERS: usize = 16;
    let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
    let racers: Vec<_> = (0..RACERS)
        .map(|i| {
            let store = Arc::clone(&store);
            let barrier = Arc::clone(&barrier);
            tokio::spawn(async move {
                barrier.wait().await;
                let txn = Txn::new()
                    .when(Compare::absent("leader"))
                    .then(Op::put("leader", format!("racer-{i}")));
                (i, store.txn(txn).await.expect("txn").succeeded)
            })
        })
        .collect();
    let mut winners = Vec::new();
    for racer in racers {
        let (i, won) = racer.await.expect("racer finished");
        if won {
            winners.push(i);
        }
    }
    assert_eq!(winners.len(), 1, "winners: {winners:?}");
    let leader = get(&store, "leader").await.expect("leader written");
    assert_eq!(leader.value, format!("racer-{}", winners[0]).into_bytes());
    assert_eq!(leader.version, 1);
}

/// 8 tasks x 25 compare-and-swap increments with retries end at exactly 200.
pub async fn txn_cas_counter_loses_no_increment(store: SharedStore) {
    const TASKS: usize = 8;
    const INCREMENTS: usize = 25;
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                for _ in 0..INCREMENTS {
                    loop {
                        let (value, revision) = match store.get("counter").await.expect("get") {
                            Some(kv) => (parse_counter(&kv.value), kv.mod_revision),
                            None => (0, 0),
                        };
                        let txn = Txn::new()
                            .when(Compare::mod_revision("counter", revision))
                            .then(Op::put("counter", (value + 1).to_string()));
                        if store.txn(txn).await.expect("txn").succeeded {
                            break;
                        }
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task finished");
    }
    let counter = get(&store, "counter").await.expect("counter written");
    assert_eq!(parse_counter(&counter.value), TASKS * INCREMENTS);
    assert_eq!(counter.version, (TASKS * INCREMENTS) as i64);
}

fn parse_counter(value: &[u8]) -> usize {
    std::str::from_utf8(value)
        .ok()
        .and_then(|text| text.parse().ok())
        .expect("counter holds a number")
}

/// A watch from now sees each later change once, in order, with its metadata.
pub async fn watch_from_now_sees_puts_and_deletes_in_order(store: SharedStore) {
    put(&store, "w/before", "x").await;
    let mut events = store.watch("w/", None).await.expect("watch");
    let first = put(&store, "w/a", "1").await;
    let second = put(&store, "w/a", "2").await;
    assert!(store.delete("w/a").await.expect("delete"));
    let deleted_at = revision(&store).await;

    let event = next_event(&mut events).await;
    let kv = put_event(&event);
    assert_eq!((kv.key.as_str(), &kv.value[..]), ("w/a", b"1".as_slice()));
    assert_eq!(
        (kv.create_revision, kv.mod_revision, kv.version),
        (first, first, 1)
    );

    let event = next_event(&mut events).await;
    let kv = put_event(&event);
    assert_eq!(kv.value, &b"2"[..]);
    assert_eq!(
        (kv.create_revision, kv.mod_revision, kv.version),
        (first, second, 2)
    );

    let event = next_event(&mut events).await;
    assert_eq!(delete_event(&event), ("w/a", deleted_at));
}

/// A consumer that saw up to revision R and resumes from R + 1 gets exactly what it missed.
pub async fn watch_resumes_without_gaps_or_duplicates(store: SharedStore) {
    let mut events = store.watch("r/", None).await.expect("watch");
    put(&store, "r/1", "a").await;
    let seen = next_event(&mut events).await.revision();
    drop(events);

    let missed = [put(&store, "r/2", "b").await, put(&store, "r/1", "c").await];
    assert!(store.delete("r/2").await.expect("delete"));
    put(&store, "elsewhere", "x").await;

    let mut events = store.watch("r/", Some(seen + 1)).await.expect("resume");
    let replayed = [
        next_event(&mut events).await,
        next_event(&mut events).await,
        next_event(&mut events).await,
    ];
    assert_eq!(put_event(&replayed[0]).key, "r/2");
    assert_eq!(put_event(&replayed[0]).mod_revision, missed[0]);
    assert_eq!(put_event(&replayed[1]).value, &b"c"[..]);
    assert_eq!(put_event(&replayed[1]).mod_revision, missed[1]);
    assert_eq!(delete_event(&replayed[2]).0, "r/2");

    // Then it follows live, with nothing replayed twice.
    let live = put(&store, "r/3", "d").await;
    let event = next_event(&mut events).await;
    assert_eq!((event.key(), event.revision()), ("r/3", live));
}

/// Watching from a listing's revision + 1 continues exactly where the listing left off.
pub async fn watch_from_listing_revision_misses_nothing(store: SharedStore) {
    put(&store, "l/1", "a").await;
    let listing = store.list("l/").await.expect("list");
    let after = put(&store, "l/2", "b").await;
    let mut events = store
        .watch("l/", Some(listing.revision + 1))
        .await
        .expect("watch");
    let event = next_event(&mut events).await;
    assert_eq!((event.key(), event.revision()), ("l/2", after));
}

/// A prefix watch never reports keys outside the prefix, even ones sharing its first bytes.
pub async fn watch_ignores_keys_outside_its_prefix(store: SharedStore) {
    let mut events = store.watch("p/", None).await.expect("watch");
    for key in ["q/1", "p", "pp/1", "P/1"] {
        put(&store, key, "x").await;
    }
    assert!(store.delete("q/1").await.expect("delete"));
    put(&store, "p/1", "x").await;
    assert_eq!(next_event(&mut events).await.key(), "p/1");

    let mut everything = store.watch("", Some(1)).await.expect("watch all");
    assert_eq!(next_event(&mut everything).await.key(), "q/1");
}

/// The changes of one transaction arrive together, in order, at the transaction's revision.
pub async fn watch_txn_events_share_one_revision(store: SharedStore) {
    put(&store, "t/c", "x").await;
    let mut events = store.watch("t/", None).await.expect("watch");
    let outcome = store
        .txn(
            Txn::new()
                .then(Op::put("t/b", "1"))
                .then(Op::put("t/a", "1"))
                .then(Op::delete("t/c")),
        )
        .await
        .expect("txn");
    assert!(
        outcome.succeeded,
        "a txn without compares takes the success branch"
    );
    let got = [
        next_event(&mut events).await,
        next_event(&mut events).await,
        next_event(&mut events).await,
    ];
    assert_eq!(
        got.iter().map(WatchEvent::key).collect::<Vec<_>>(),
        ["t/b", "t/a", "t/c"]
    );
    assert!(got.iter().all(|event| event.revision() == outcome.revision));
    assert!(matches!(got[2], WatchEvent::Delete { .. }));
}

/// Revoking a lease deletes its keys, in one revision, with a delete event each.
pub async fn lease_revoke_deletes_keys_with_events(store: SharedStore) {
    let lease = store
        .grant_lease(Duration::from_secs(60))
        .await
        .expect("grant");
    let first = store
        .put_with_lease("l/1", b"a".to_vec(), lease)
        .await
        .expect("put");
    store
        .put_with_lease("l/2", b"b".to_vec(), lease)
        .await
        .expect("put");
    put(&store, "l/3", "unleased").await;
    let kv = get(&store, "l/1").await.expect("l/1 exists");
    assert_eq!((kv.lease, kv.mod_revision), (Some(lease), first));

    let mut events = store.watch("l/", None).await.expect("watch");
    store.revoke_lease(lease).await.expect("revoke");
    let deleted = [next_event(&mut events).await, next_event(&mut events).await];
    let deleted: Vec<_> = deleted.iter().map(delete_event).collect();
    assert_eq!(
        deleted.iter().map(|(key, _)| *key).collect::<BTreeSet<_>>(),
        BTreeSet::from(["l/1", "l/2"])
    );
    assert_eq!(
        deleted[0].1, deleted[1].1,
        "one revision for the whole lease"
    );
    assert_eq!(get(&store, "l/1").await, None);
    assert!(get(&store, "l/3").await.is_some());
}

/// A lease nobody refreshes ends by itself, deleting its keys with events.
pub async fn lease_expiry_deletes_keys_with_events(store: SharedStore) {
    let lease = store
        .grant_lease(Duration::from_secs(1))
        .await
        .expect("grant");
    store
        .put_with_lease("e/1", b"a".to_vec(), lease)
        .await
        .expect("put");
    let mut events = store.watch("e/", None).await.expect("watch");
    let event = next_event(&mut events).await;
    assert_eq!(delete_event(&event).0, "e/1");
    assert_eq!(get(&store, "e/1").await, None);
    assert_eq!(
        store.keep_alive(lease).await,
        Err(StoreError::LeaseNotFound(lease))
    );
}

/// Refreshing a lease more often than its TTL keeps its keys past the TTL.
pub async fn lease_keep_alive_postpones_expiry(store: SharedStore) {
    let lease = store
        .grant_lease(Duration::from_secs(2))
        .await
        .expect("grant");
    store
        .put_with_lease("k", b"v".to_vec(), lease)
        .await
        .expect("put");
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        store.keep_alive(lease).await.expect("lease alive");
    }
    assert!(
        get(&store, "k").await.is_some(),
        "4 s later the key is still there"
    );
}

/// A revoked lease cannot be refreshed, revoked again or attached to.
pub async fn lease_operations_on_a_revoked_lease_fail(store: SharedStore) {
    let lease = store
        .grant_lease(Duration::from_secs(60))
        .await
        .expect("grant");
    store.revoke_lease(lease).await.expect("revoke");
    let not_found = Err(StoreError::LeaseNotFound(lease));
    assert_eq!(store.keep_alive(lease).await, not_found);
    assert_eq!(store.revoke_lease(lease).await, not_found);
    assert_eq!(
        store
            .put_with_lease("k", b"v".to_vec(), lease)
            .await
            .map(|_| ()),
        not_found
    );
    let txn = Txn::new().then(Op::put_with_lease("k", "v", lease));
    assert_eq!(store.txn(txn).await.map(|_| ()), not_found);
    assert_eq!(get(&store, "k").await, None);

    let never_granted = LeaseId(0x7eed_5eed);
    assert_eq!(
        store.keep_alive(never_granted).await,
        Err(StoreError::LeaseNotFound(never_granted))
    );
}

/// A plain put over a leased key detaches it from the lease, as in etcd.
pub async fn put_without_lease_detaches_the_key(store: SharedStore) {
    let lease = store
        .grant_lease(Duration::from_secs(60))
        .await
        .expect("grant");
    store
        .put_with_lease("k", b"1".to_vec(), lease)
        .await
        .expect("put");
    put(&store, "k", "2").await;
    assert_eq!(get(&store, "k").await.map(|kv| kv.lease), Some(None));
    store.revoke_lease(lease).await.expect("revoke");
    assert_eq!(
        get(&store, "k").await.map(|kv| kv.value),
        Some(Bytes::from_static(b"2"))
    );
}

/// Transaction puts can attach keys to a lease.
pub async fn txn_put_attaches_a_lease(store: SharedStore) {
    let lease = store
        .grant_lease(Duration::from_secs(60))
        .await
        .expect("grant");
    let outcome = store
        .txn(
            Txn::new()
                .when(Compare::absent("member/1"))
                .then(Op::put_with_lease("member/1", "up", lease)),
        )
        .await
        .expect("txn");
    assert!(outcome.succeeded);
    assert_eq!(
        get(&store, "member/1").await.and_then(|kv| kv.lease),
        Some(lease)
    );
    store.revoke_lease(lease).await.expect("revoke");
    assert_eq!(get(&store, "member/1").await, None);
}

/// Asserts that a watch from `start` fails with [`StoreError::Compacted`], from the call or
/// as the stream's first item (etcd reports compaction asynchronously).
pub async fn assert_watch_compacted(store: &dyn Store, start: Revision) -> StoreError {
    let err = match store.watch("", Some(start)).await {
        Err(err) => err,
        Ok(mut events) => match tokio::time::timeout(EVENT_TIMEOUT, events.next()).await {
            Ok(Some(Err(err))) => err,
            other => panic!("expected a compaction error, got {other:?}"),
        },
    };
    assert!(
        matches!(err, StoreError::Compacted { requested, .. } if requested == start),
        "expected compacted from {start}, got {err}"
    );
    err
}
