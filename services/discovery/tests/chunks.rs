//! A Neighborhood or an unpeering larger than one store transaction commits in chunks (etcd's
//! `--max-txn-ops`, ADR 0006). A process that dies between two chunks leaves a partial write
//! behind; the next process, given the same Neighborhood (the sender re-sends it) or the same
//! unpeering (the caller retries), must finish it, and nothing may count as applied before the
//! last chunk. On a real etcd (skipped loudly without one) and on the memory store.
//!
//! The death is played by [`Dies`], a fault injector around the real store: after a given
//! number of transactions every later write fails, as if the process had been killed right
//! after the last one committed. What is in the store is what a kill -9 at that point leaves.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use trellis_api::ClusterIdentity;
use trellis_api::peers::{Condition, UNPEERED_REASON};
use trellis_discovery::Discovery;
use trellis_discovery::core::{PeeringUpdate, ReceivedNeighborhood};
use trellis_discovery::records::{Addresses, Inbox, Kind, Neighbor, decode, inbox_key};
use trellis_store::{
    KeyValue, LeaseId, Listing, MemoryStore, Revision, SharedStore, Store, StoreError, Txn,
    TxnOutcome, WatchStream,
};
use trellis_testkit::Etcd;

/// The real store, dying (every write refused) after `left` more transactions; negative:
/// never.
#[derive(Debug)]
struct Dies {
    inner: SharedStore,
    left: AtomicI64,
}

impl Dies {
    fn new(inner: SharedStore, left: i64) -> Arc<Self> {
        Arc::new(Self {
            inner,
            left: AtomicI64::new(left),
        })
    }

    fn alive(&self) -> Result<(), StoreError> {
        if self.left.load(Ordering::SeqCst) == 0 {
            Err(StoreError::Unavailable("the process died (test)".into()))
        } else {
            Ok(())
        }
    }
}

#[async_trait::async_trait]
impl Store for Dies {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        self.inner.get(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Listing, StoreError> {
        self.inner.list(prefix).await
    }
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<Revision, StoreError> {
        self.alive()?;
        self.inner.put(key, value).await
    }
    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.alive()?;
        self.inner.delete(key).await
    }
    async fn txn(&self, txn: Txn) -> Result<TxnOutcome, StoreError> {
        self.alive()?;
        let outcome = self.inner.txn(txn).await?;
        if self.left.load(Ordering::SeqCst) > 0 {
            self.left.fetch_sub(1, Ordering::SeqCst);
        }
        Ok(outcome)
    }
    async fn watch(
        &self,
        prefix: &str,
        start: Option<Revision>,
    ) -> Result<WatchStream, StoreError> {
        self.inner.watch(prefix, start).await
    }
    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        self.inner.grant_lease(ttl).await
    }
    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.inner.keep_alive(lease).await
    }
    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.inner.revoke_lease(lease).await
    }
    async fn put_with_lease(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: LeaseId,
    ) -> Result<Revision, StoreError> {
        self.alive()?;
        self.inner.put_with_lease(key, value, lease).await
    }
}

fn identity(id: &str) -> ClusterIdentity {
    ClusterIdentity::parse("id", id, "name", "").expect("identity")
}

/// A leaf that takes Neighborhoods above the default cap: these tests need more neighbours
/// than one etcd transaction holds.
async fn open(store: SharedStore) -> Discovery {
    Discovery::open(store, identity("leaf"), Addresses::default())
        .await
        .expect("opens")
        .with_max_induced_per_hub(1024)
}

fn peering(peered: bool) -> PeeringUpdate {
    PeeringUpdate {
        identity: identity("hub"),
        peered,
        addresses: Addresses {
            discovery: "127.0.0.1:1".into(),
            broker: "127.0.0.1:2".into(),
            forwarder: "127.0.0.1:3".into(),
            ..Addresses::default()
        },
        outgoing: true,
        incoming: true,
        networking: true,
        reason: if peered {
            "HandshakeCompleted"
        } else {
            UNPEERED_REASON
        }
        .into(),
        message: String::new(),
        expected_revision: 0,
        ca_certificate: String::new(),
    }
}

fn neighborhood(n: usize, generation: i64) -> ReceivedNeighborhood {
    ReceivedNeighborhood {
        sender: identity("hub"),
        recipient: identity("leaf"),
        neighbors: (0..n)
            .map(|i| Neighbor {
                identity: identity(&format!("n{i:03}")),
                addresses: Addresses::default(),
            })
            .collect(),
        generation,
    }
}

/// (active induced records, withdrawn induced records).
async fn induced(discovery: &Discovery) -> (usize, usize) {
    let (records, _) = discovery.list(Some(Kind::Induced)).await.expect("lists");
    let withdrawn = records
        .iter()
        .filter(|(r, _)| r.is(Condition::Withdrawn))
        .count();
    let active = records
        .iter()
        .filter(|(r, _)| r.is(Condition::InducedPeering) && !r.is(Condition::Withdrawn))
        .count();
    (active, withdrawn)
}

async fn inbox_generation(store: &SharedStore) -> Option<i64> {
    let key = inbox_key(&identity("hub").id);
    let kv = store.get(&key).await.expect("reads")?;
    Some(
        decode::<Inbox>(&key, &kv.value)
            .expect("decodes")
            .generation,
    )
}

async fn dying_between_chunks_is_finished_by_the_next_process(store: SharedStore) {
    open(store.clone())
        .await
        .update_peering(&peering(true))
        .await
        .expect("peers");

    // Killed after the first chunk of a 300-neighbour Neighborhood.
    let dying = Dies::new(store.clone(), 1);
    let first = open(dying.clone()).await;
    let err = first
        .receive_neighborhood(&neighborhood(300, 7))
        .await
        .expect_err("dies midway");
    assert!(err.to_string().contains("died"), "{err}");
    let (active, _) = induced(&first).await;
    assert!(
        active > 0 && active < 300,
        "one chunk written, not all: {active}"
    );
    assert_eq!(
        inbox_generation(&store).await,
        None,
        "the generation moves only with the last chunk"
    );

    // The next process gets the sender's re-send and finishes.
    let second = open(store.clone()).await;
    let applied = second
        .receive_neighborhood(&neighborhood(300, 7))
        .await
        .expect("applies");
    assert!(applied.applied, "{applied:?}");
    assert_eq!(induced(&second).await, (300, 0));
    assert_eq!(inbox_generation(&store).await, Some(7));

    // Unpeering the hub, killed after the first chunk: the hub is still a peer (the commit
    // point is last), some records already withdrawn.
    let dying = Dies::new(store.clone(), 1);
    let third = open(dying).await;
    third
        .update_peering(&peering(false))
        .await
        .expect_err("dies midway");
    let (active, withdrawn) = induced(&third).await;
    assert!(
        withdrawn > 0 && active > 0,
        "one chunk withdrawn: {active} active, {withdrawn} withdrawn"
    );
    let hub = third.get(&identity("hub").id).await.expect("hub record");
    assert!(
        hub.0.is(Condition::Peered),
        "the peer's record is the last write"
    );

    // The caller retries on the next process: everything withdrawn, the hub unpeered.
    let fourth = open(store.clone()).await;
    fourth
        .update_peering(&peering(false))
        .await
        .expect("unpeers");
    assert_eq!(induced(&fourth).await, (0, 300));
    let hub = fourth.get(&identity("hub").id).await.expect("hub record");
    assert!(!hub.0.is(Condition::Peered));
    assert_eq!(inbox_generation(&store).await, None, "inbox forgotten");
}

#[tokio::test]
async fn memory_dying_between_chunks_is_finished_by_the_next_process() {
    dying_between_chunks_is_finished_by_the_next_process(Arc::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn etcd_dying_between_chunks_is_finished_by_the_next_process() {
    let Some(etcd) = Etcd::start_or_skip() else {
        return;
    };
    let store = trellis_store::open(&etcd.url("discovery"))
        .await
        .unwrap_or_else(|err| panic!("{err}; etcd log:\n{}", etcd.log_tail(20)));
    dying_between_chunks_is_finished_by_the_next_process(store).await;
}
