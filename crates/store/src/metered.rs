//! Store metrics (issue 19, ADR 0018): a decorator around any [`Store`] that records every
//! operation's latency (`trellis_store_operation_seconds{operation}`) and failures
//! (`trellis_store_errors_total{operation,kind}`), and counts the compare-and-swap races
//! [`crate::retry::Contention`] retries (`trellis_store_transaction_retries_total`) and the
//! events its watches deliver (`trellis_store_watch_events_total`).
//!
//! Written once here, applied where `trellis_runtime` opens a service's store, so every
//! service gets them without code of its own. Labels are the trait's method names and the
//! [`StoreError`] variants: a fixed set, never keys or prefixes.

use std::time::{Duration, Instant};

use futures::StreamExt as _;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::{
    KeyValue, LeaseId, Listing, Revision, RevisionListing, SharedStore, Store, StoreError,
    StoreSize, Txn, TxnOutcome, WatchStream,
};

/// The latency buckets of every Trellis histogram (gRPC server and client, store): 100 µs to
/// ~13 s, exponential. Defined here, the lowest crate that records latencies, so the store and
/// the gRPC layers of `trellis_runtime` share one definition.
#[derive(Debug, Clone, Copy, Default)]
pub struct LatencyBuckets;

impl MetricConstructor<Histogram> for LatencyBuckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(exponential_buckets(0.0001, 2.0, 18))
    }
}

type OperationLabel = [(&'static str, &'static str); 1];
type ErrorLabels = [(&'static str, &'static str); 2];

/// The store metrics of one service. Cheap to clone; clones share the series.
#[derive(Debug, Clone)]
pub struct StoreMetrics {
    seconds: Family<OperationLabel, Histogram, LatencyBuckets>,
    errors: Family<ErrorLabels, Counter>,
    retries: Counter,
    watch_events: Counter,
}

impl Default for StoreMetrics {
    fn default() -> Self {
        Self {
            seconds: Family::new_with_constructor(LatencyBuckets),
            errors: Family::default(),
            retries: Counter::default(),
            watch_events: Counter::default(),
        }
    }
}

impl StoreMetrics {
    /// Registers the four families in `registry` (a service's own, ADR 0018).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "trellis_store_operation_seconds",
            "Store operations by method, from call to answer (a watch: until it is established), seconds",
            self.seconds.clone(),
        );
        registry.register(
            "trellis_store_errors",
            "Store operations that failed, by method and kind of error (a watch also counts the error ending its stream)",
            self.errors.clone(),
        );
        registry.register(
            "trellis_store_transaction_retries",
            "Compare-and-swap transactions retried because a concurrent writer won the race",
            self.retries.clone(),
        );
        registry.register(
            "trellis_store_watch_events",
            "Changes the store's watches delivered (each put or delete, to each watch)",
            self.watch_events.clone(),
        );
    }

    /// How many changes the watches delivered so far.
    pub fn watch_events(&self) -> u64 {
        self.watch_events.get()
    }

    /// How many lost races were retried so far.
    pub fn retries(&self) -> u64 {
        self.retries.get()
    }

    /// How many `operation`s failed with `kind` so far.
    pub fn errors(&self, operation: &'static str, kind: &'static str) -> u64 {
        self.errors
            .get_or_create(&[("operation", operation), ("kind", kind)])
            .get()
    }

    fn record<T>(
        &self,
        operation: &'static str,
        elapsed: Duration,
        result: &Result<T, StoreError>,
    ) {
        self.seconds
            .get_or_create(&[("operation", operation)])
            .observe(elapsed.as_secs_f64());
        if let Err(err) = result {
            self.error(operation, err);
        }
    }

    fn error(&self, operation: &'static str, err: &StoreError) {
        self.errors
            .get_or_create(&[("operation", operation), ("kind", kind(err))])
            .inc();
    }
}

/// The `kind` label of an error: its variant.
fn kind(err: &StoreError) -> &'static str {
    match err {
        StoreError::Unavailable(_) => "unavailable",
        StoreError::Compacted { .. } => "compacted",
        StoreError::LeaseNotFound(_) => "lease_not_found",
        StoreError::InvalidUrl(_) => "invalid_url",
        StoreError::Internal(_) => "internal",
    }
}

/// `inner`, recording into `metrics`.
pub fn metered(inner: SharedStore, metrics: &StoreMetrics) -> SharedStore {
    std::sync::Arc::new(MeteredStore {
        inner,
        metrics: metrics.clone(),
    })
}

/// See [`metered`].
#[derive(Debug)]
pub struct MeteredStore {
    inner: SharedStore,
    metrics: StoreMetrics,
}

impl MeteredStore {
    async fn timed<T>(
        &self,
        operation: &'static str,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let start = Instant::now();
        let result = call.await;
        self.metrics.record(operation, start.elapsed(), &result);
        result
    }
}

#[async_trait::async_trait]
impl Store for MeteredStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        self.timed("get", self.inner.get(key)).await
    }

    async fn list(&self, prefix: &str) -> Result<Listing, StoreError> {
        self.timed("list", self.inner.list(prefix)).await
    }

    async fn list_revisions(&self, prefix: &str) -> Result<RevisionListing, StoreError> {
        self.timed("list_revisions", self.inner.list_revisions(prefix))
            .await
    }

    async fn size(&self, prefix: &str) -> Result<StoreSize, StoreError> {
        self.timed("size", self.inner.size(prefix)).await
    }

    async fn put(&self, key: &str, value: Vec<u8>) -> Result<Revision, StoreError> {
        self.timed("put", self.inner.put(key, value)).await
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.timed("delete", self.inner.delete(key)).await
    }

    async fn txn(&self, txn: Txn) -> Result<TxnOutcome, StoreError> {
        self.timed("txn", self.inner.txn(txn)).await
    }

    async fn watch(
        &self,
        prefix: &str,
        start: Option<Revision>,
    ) -> Result<WatchStream, StoreError> {
        let stream = self.timed("watch", self.inner.watch(prefix, start)).await?;
        // A watch that fails later (compacted, etcd gone) ends with an error item: counted
        // too, under the same operation.
        let metrics = self.metrics.clone();
        Ok(Box::pin(stream.inspect(move |item| match item {
            Ok(_) => {
                metrics.watch_events.inc();
            }
            Err(err) => metrics.error("watch", err),
        })))
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        self.timed("grant_lease", self.inner.grant_lease(ttl)).await
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.timed("keep_alive", self.inner.keep_alive(lease)).await
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.timed("revoke_lease", self.inner.revoke_lease(lease))
            .await
    }

    async fn put_with_lease(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: LeaseId,
    ) -> Result<Revision, StoreError> {
        self.timed(
            "put_with_lease",
            self.inner.put_with_lease(key, value, lease),
        )
        .await
    }

    fn retried(&self) {
        self.metrics.retries.inc();
        self.inner.retried();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use prometheus_client::encoding::text::encode;

    use super::*;
    use crate::retry::Contention;
    use crate::{Compare, MemoryStore, Op};

    /// A fake store whose every operation fails as an unreachable etcd does (no real etcd can
    /// be made to fail on demand mid-test).
    #[derive(Debug)]
    struct Unreachable;

    fn down<T>() -> Result<T, StoreError> {
        Err(StoreError::Unavailable(
            "connection refused (test fake)".into(),
        ))
    }

    #[async_trait::async_trait]
    impl Store for Unreachable {
        async fn get(&self, _: &str) -> Result<Option<KeyValue>, StoreError> {
            down()
        }
        async fn list(&self, _: &str) -> Result<Listing, StoreError> {
            down()
        }
        async fn put(&self, _: &str, _: Vec<u8>) -> Result<Revision, StoreError> {
            down()
        }
        async fn delete(&self, _: &str) -> Result<bool, StoreError> {
            down()
        }
        async fn txn(&self, _: Txn) -> Result<TxnOutcome, StoreError> {
            down()
        }
        async fn watch(&self, _: &str, _: Option<Revision>) -> Result<WatchStream, StoreError> {
            down()
        }
        async fn grant_lease(&self, _: Duration) -> Result<LeaseId, StoreError> {
            down()
        }
        async fn keep_alive(&self, _: LeaseId) -> Result<(), StoreError> {
            down()
        }
        async fn revoke_lease(&self, _: LeaseId) -> Result<(), StoreError> {
            down()
        }
        async fn put_with_lease(
            &self,
            _: &str,
            _: Vec<u8>,
            _: LeaseId,
        ) -> Result<Revision, StoreError> {
            down()
        }
    }

    fn text(metrics: &StoreMetrics) -> String {
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let mut out = String::new();
        encode(&mut out, &registry).expect("encodes");
        out
    }

    fn sample(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
    }

    /// Two writers race for one key: the loser's compare-and-swap fails, it retries through
    /// `Contention` and wins; exactly that one lost race is counted.
    #[tokio::test]
    async fn a_lost_compare_and_swap_counts_one_retry() {
        let metrics = StoreMetrics::default();
        let store = metered(Arc::new(MemoryStore::new()), &metrics);
        store.put("k", b"0".to_vec()).await.expect("put");
        let mut contention = Contention::on(&store, "incrementing k");
        let mut attempts = 0;
        loop {
            attempts += 1;
            let seen = store.get("k").await.expect("get").expect("exists");
            if attempts == 1 {
                // The concurrent writer wins between our read and our write.
                store.put("k", b"5".to_vec()).await.expect("other writer");
            }
            let n: u32 = std::str::from_utf8(&seen.value)
                .expect("utf8")
                .parse()
                .expect("n");
            let outcome = store
                .txn(
                    Txn::new()
                        .when(Compare::mod_revision("k", seen.mod_revision))
                        .then(Op::put("k", (n + 1).to_string())),
                )
                .await
                .expect("txn");
            if outcome.succeeded {
                break;
            }
            contention.lost().await.expect("within the bound");
        }
        assert_eq!(attempts, 2);
        assert_eq!(metrics.retries(), 1);
        let value = store.get("k").await.expect("get").expect("exists").value;
        assert_eq!(value, &b"6"[..]);
        let text = text(&metrics);
        assert_eq!(
            sample(&text, "trellis_store_transaction_retries_total"),
            Some(1.0),
            "{text}"
        );
        // Three gets, two puts, two transactions, each timed under its method.
        for (operation, count) in [("get", 3.0), ("put", 2.0), ("txn", 2.0)] {
            assert_eq!(
                sample(
                    &text,
                    &format!("trellis_store_operation_seconds_count{{operation=\"{operation}\"}}")
                ),
                Some(count),
                "{text}"
            );
        }
        assert_eq!(metrics.errors("txn", "unavailable"), 0);
    }

    #[tokio::test]
    async fn each_change_a_watch_delivers_is_counted() {
        let metrics = StoreMetrics::default();
        let store = metered(Arc::new(MemoryStore::new()), &metrics);
        let mut one = store.watch("a/", None).await.expect("watch");
        let mut two = store.watch("", None).await.expect("watch");
        store.put("a/1", b"x".to_vec()).await.expect("put");
        store.delete("a/1").await.expect("delete");
        store.put("b/1", b"y".to_vec()).await.expect("put");
        for _ in 0..2 {
            one.next().await.expect("event").expect("ok");
        }
        for _ in 0..3 {
            two.next().await.expect("event").expect("ok");
        }
        // Two events to the first watch, three to the second.
        assert_eq!(metrics.watch_events(), 5);
        assert_eq!(
            sample(&text(&metrics), "trellis_store_watch_events_total"),
            Some(5.0)
        );
    }

    #[tokio::test]
    async fn a_failing_store_counts_errors_by_operation_and_kind() {
        let metrics = StoreMetrics::default();
        let store = metered(Arc::new(Unreachable), &metrics);
        store.get("k").await.expect_err("down");
        store.get("k").await.expect_err("down");
        store.txn(Txn::new()).await.expect_err("down");
        assert!(store.watch("", None).await.is_err());
        let text = text(&metrics);
        for (operation, count) in [("get", 2.0), ("txn", 1.0), ("watch", 1.0)] {
            assert_eq!(
                sample(
                    &text,
                    &format!(
                        "trellis_store_errors_total{{operation=\"{operation}\",kind=\"unavailable\"}}"
                    )
                ),
                Some(count),
                "{text}"
            );
            assert_eq!(
                sample(
                    &text,
                    &format!("trellis_store_operation_seconds_count{{operation=\"{operation}\"}}")
                ),
                Some(count),
                "{text}"
            );
        }
        assert_eq!(
            sample(&text, "trellis_store_transaction_retries_total"),
            Some(0.0)
        );
    }

    /// A watch that starts but falls too far behind ends its stream with an error
    /// (compacted): counted, although the watch call itself succeeded.
    #[tokio::test]
    async fn a_watch_ending_in_an_error_counts_it() {
        let metrics = StoreMetrics::default();
        let memory = Arc::new(MemoryStore::with_history_limit(16));
        let store = metered(memory.clone(), &metrics);
        let mut events = store.watch("", None).await.expect("watch");
        // The live buffer holds 1024 events; three times that overruns it.
        for i in 0..3 * 1024 {
            memory.put(&format!("k{i}"), Vec::new()).await.expect("put");
        }
        let mut ended_in_error = false;
        while let Some(item) = events.next().await {
            if item.is_err() {
                ended_in_error = true;
            }
        }
        assert!(ended_in_error, "the watcher fell behind");
        assert_eq!(metrics.errors("watch", "compacted"), 1);
    }
}
