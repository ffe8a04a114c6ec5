//! The forwarder's operations. Every relay is persisted before it is acknowledged, then
//! delivered at once when the other end answers, otherwise by the retry loop ([`retry_loop`])
//! with backoff. Both ends are idempotent per generation, so re-delivery after a crash is
//! harmless; completed relays are deleted, relays refused for good after `--failed-retention`.
//!
//! The retry loop works from an in-memory due queue (`Schedule`): read from the store once
//! at start, then kept up to date by every write of a relay (`Forwarder::save`), so a wake
//! costs one store read per due relay, not a listing of all of them. Attempts run
//! concurrently (at most `--delivery-concurrency`), but never two at once towards the same
//! cluster: a destination that hangs until the delivery timeout ties up one slot, and the
//! relays to everyone else go on.
//!
//! This module keeps the [`Forwarder`] itself, its construction and the timings its parts share;
//! the work is cut along what it does:
//!
//! - [`relay`]: accepting a relay and a destination's status, the origin's wait on the first
//!   attempt, and expediting the relay the other way;
//! - `withdrawal`: accepting an origin's withdrawal and telling the destination;
//! - `delivery`: one delivery attempt and what its outcome leaves stored;
//! - `ledger`: reading and writing relay records, and which keys may be stored at all;
//! - [`schedule`]: the due queue and the retry loop working it;
//! - `peers`: the clusters at a relay's two ends, and whether a relay between them is allowed.
//!
//! The brokers at the two ends are called through [`crate::remote::Brokers`].

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;
use trellis_api::model::NetworkSpec;
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::Result;
use trellis_runtime::Shutdown;
use trellis_runtime::client::{Timeouts, TracedChannel, local_channel};
use trellis_runtime::foreign_clusters::ForeignClusters;
use trellis_runtime::metrics::Metrics;
use trellis_runtime::metrics::prometheus_client::metrics::counter::Counter;
use trellis_runtime::retry::RetryPolicy;
use trellis_runtime::tls::PeerTls;
use trellis_store::SharedStore;

use crate::records::{RELAYS_PREFIX, RelayRecord, decode};
use crate::remote::Brokers;

mod delivery;
mod ledger;
mod peers;
pub mod relay;
pub mod schedule;
mod withdrawal;

pub use relay::OriginWait;
pub use schedule::retry_loop;

use ledger::MaybeStored;
use schedule::Schedule;

/// A remote broker gets this long per delivery; the origin is waiting on the first attempt.
const DELIVERY: Timeouts = Timeouts {
    connect: Duration::from_secs(2),
    request: Duration::from_secs(5),
};
const LOCAL: Timeouts = Timeouts {
    connect: Duration::from_secs(2),
    request: Duration::from_secs(10),
};
/// The first wait before a failed delivery is retried; it doubles up to `--retry-max`.
const RETRY_MIN: Duration = Duration::from_millis(200);
/// An attempt made while the caller waits (Relay, RelayStatus, RelayWithdrawal) owns its
/// relay this long: the retry loop leaves it alone meanwhile rather than send it twice. The
/// attempt rewrites the record before then, so only a crash lets this pass.
const INLINE_GRACE: Duration =
    Duration::from_secs(DELIVERY.connect.as_secs() + DELIVERY.request.as_secs() + 1);

fn nanos(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

/// How relays are retried and kept.
#[derive(Debug, Clone, Copy)]
pub struct Delivery {
    /// Longest wait between two attempts of one relay.
    pub retry_max: Duration,
    /// Attempts in flight at once, over all destinations (each cluster gets one at a time).
    pub concurrency: usize,
    /// How long a relay refused for good (state Failed), or delivered but never answered
    /// (state Delivered), is kept for operators before it is deleted.
    pub retention: Duration,
}

impl Delivery {
    /// The retry policy of a relay's deliveries: [`RETRY_MIN`] doubling to `retry_max`.
    pub fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::exponential(RETRY_MIN, self.retry_max)
    }
}

/// What a relay request asks for.
#[derive(Debug, Clone)]
pub struct Passthrough {
    pub origin: ClusterIdentity,
    pub destination: ClusterIdentity,
    pub spec: NetworkSpec,
    pub generation: i64,
    /// The generation of the destination's NetworkConfig the origin holds (0: none).
    pub held_generation: i64,
}

/// The forwarder of one hub cluster.
#[derive(Debug)]
pub struct Forwarder {
    identity: ClusterIdentity,
    store: SharedStore,
    discovery: TracedChannel,
    /// The local discovery service's records, as its watch last delivered them
    /// ([`Forwarder::follow_discovery`]): what a relay is authorized against.
    foreign_clusters: ForeignClusters,
    /// The brokers at the relays' ends, over mutual TLS (ADR 0014) when configured.
    brokers: Brokers,
    delivery: Delivery,
    /// The retry loop's due queue.
    schedule: Mutex<Schedule>,
    /// Wakes the retry loop (something was scheduled).
    wake: Notify,
    /// Relays whose other direction arrived while an attempt of theirs was in flight: if that
    /// attempt fails for a reason that may be gone now, it is retried at once, not after its
    /// backoff ([`Forwarder::expedite`]).
    expedited: Mutex<HashSet<String>>,
    /// First attempts running with nothing stored for their relay (see
    /// [`Forwarder::relay_answering`]), by key, and how many. A withdrawal of that relay waits
    /// for them to end ([`Forwarder::unstored_ended`]), so that an attempt's outcome is never
    /// stored (and retried) after the withdrawal.
    unstored: Mutex<HashMap<String, u32>>,
    /// Wakes withdrawals waiting for such attempts.
    unstored_end: Notify,
    /// Which relays may be stored ([`MaybeStored`]): accepting a relay known to be absent, the
    /// usual case, reads nothing.
    maybe_stored: Mutex<MaybeStored>,
    /// Attempts that failed and were scheduled again (`trellis_forwarder_relay_retries_total`).
    retried: Counter,
}

impl Forwarder {
    pub fn new(
        identity: ClusterIdentity,
        store: SharedStore,
        discovery: &str,
        delivery: Delivery,
        tls: Option<PeerTls>,
        local_token: &trellis_runtime::local_auth::LocalToken,
        metrics: &Metrics,
    ) -> Result<Self> {
        Ok(Self {
            discovery: local_channel("discovery", discovery, LOCAL, local_token, metrics)?,
            foreign_clusters: ForeignClusters::new(),
            brokers: Brokers::new(identity.clone(), tls, DELIVERY, metrics),
            identity,
            store,
            delivery: Delivery {
                concurrency: delivery.concurrency.max(1),
                ..delivery
            },
            schedule: Mutex::new(Schedule::default()),
            wake: Notify::new(),
            expedited: Mutex::new(HashSet::new()),
            unstored: Mutex::new(HashMap::new()),
            unstored_end: Notify::new(),
            maybe_stored: Mutex::new(MaybeStored::default()),
            retried: Counter::default(),
        })
    }

    pub fn identity(&self) -> &ClusterIdentity {
        &self.identity
    }

    /// The delivery attempts that failed and were scheduled again, so far.
    pub fn retried(&self) -> &Counter {
        &self.retried
    }

    /// The store the forwarder keeps its relays in.
    pub fn store(&self) -> &SharedStore {
        &self.store
    }

    /// Keeps the copy of discovery's records that relays are authorized against current,
    /// until `shutdown`. Without it running, every check reads discovery.
    pub async fn follow_discovery(&self, shutdown: Shutdown) {
        self.foreign_clusters
            .follow(self.discovery.clone(), shutdown, |_| {})
            .await;
    }

    /// The copy of discovery's records relays are authorized against.
    pub fn foreign_clusters(&self) -> &ForeignClusters {
        &self.foreign_clusters
    }

    /// The local discovery service's channel.
    pub fn discovery_channel(&self) -> TracedChannel {
        self.discovery.clone()
    }

    /// Moves relays stored in the old key layout to the current one ([`crate::migrate`]);
    /// returns how many moved. Run on start, before serving.
    pub async fn migrate_relay_keys(&self) -> Result<usize> {
        crate::migrate::relay_keys(&self.store).await
    }

    /// Relays still held, optionally for one cluster.
    pub async fn list(&self, cluster: Option<&ClusterId>) -> Result<Vec<RelayRecord>> {
        let listing = self.store.list(RELAYS_PREFIX).await?;
        let mut out = Vec::new();
        for kv in listing.kvs {
            let record: RelayRecord = decode(&kv.key, &kv.value)?;
            if cluster.is_none_or(|c| record.origin.id == *c || record.destination.id == *c) {
                out.push(record);
            }
        }
        Ok(out)
    }
}
