//! An origin's withdrawal of its NetworkConfig: the pending relay is replaced by a withdrawal
//! the retry loop delivers like any relay, or, with no relay record to hold it, delivered once
//! while the origin waits. Discovery is read afresh rather than from the watch-fed copy: the
//! destination being gone is often why the origin withdraws, and then nobody is told.

use trellis_api::ClusterIdentity;
use trellis_error::Result;
use trellis_runtime::propagation::traceparent_of;
use trellis_store::retry::Contention;

use super::{Forwarder, INLINE_GRACE, nanos};
use crate::records::{RelayRecord, State, now_nanos, relay_key};

impl Forwarder {
    /// The origin withdraws its NetworkConfig: drop any pending relay and tell the destination.
    pub async fn relay_withdrawal(
        &self,
        origin: &ClusterIdentity,
        destination: &ClusterIdentity,
        reason: String,
    ) -> Result<State> {
        // The destination may already be gone from our peers (that is often why the origin
        // withdraws): then there is nobody left to tell.
        let peers = self.fresh_peers(&[&origin.id, &destination.id]).await?;
        peers.broker_of(&origin.id, "origin")?;
        let key = relay_key(&origin.id, &destination.id);
        // A first attempt delivering with nothing stored ends (and stores its outcome) first:
        // stored after the withdrawal, a retry would deliver the NetworkConfig again.
        self.unstored_ended(&key).await;
        if peers.broker_of(&destination.id, "destination").is_err() {
            if let Some((_, revision)) = self.load(&key).await? {
                self.save(&key, revision, None).await?;
            }
            return Ok(State::Completed);
        }
        let now = now_nanos();
        let record = RelayRecord {
            origin: origin.clone(),
            destination: destination.clone(),
            spec: match self.load(&key).await? {
                Some((held, _)) => held.spec,
                None => {
                    return self
                        .withdraw_without_record(origin, destination, &reason)
                        .await;
                }
            },
            generation: 0,
            held_generation: 0,
            state: State::Withdrawing,
            status: None,
            reason,
            attempts: 0,
            last_error: String::new(),
            created_nanos: now,
            updated_nanos: now,
            next_attempt_nanos: now + nanos(INLINE_GRACE),
            trace: traceparent_of(&tracing::Span::current()),
        };
        let mut contention = Contention::on(&self.store, "accepting a withdrawal");
        loop {
            let revision = self.load(&key).await?.map_or(0, |(_, r)| r);
            if let Some(revision) = self.save_at(&key, revision, Some(&record)).await? {
                return Ok(self
                    .attempt(&key, record, Some(revision), None, None)
                    .await?
                    .0);
            }
            contention.lost().await?;
        }
    }

    /// A withdrawal with no relay record to hold it: delivered once, synchronously; the
    /// origin retries on failure.
    async fn withdraw_without_record(
        &self,
        origin: &ClusterIdentity,
        destination: &ClusterIdentity,
        reason: &str,
    ) -> Result<State> {
        let peers = self.fresh_peers(&[&destination.id]).await?;
        let broker = peers.broker_of(&destination.id, "destination")?;
        self.brokers
            .withdraw(&broker, origin, destination, reason)
            .await?;
        Ok(State::Completed)
    }
}
