//! One delivery attempt of a relay (its NetworkConfig to the destination, the destination's
//! status to the origin, or a withdrawal) and what its outcome leaves stored: nothing once
//! answered, a failure for good, or the next attempt's time under the relay's backoff.

use trellis_api::pb::types as pb;
use trellis_error::{Error, Result};
use trellis_runtime::retry::Retryable as _;

use super::{Forwarder, OriginWait, nanos};
use crate::ends::Ends;
use crate::records::{RelayRecord, RelayedStatus, State, now_nanos};

impl Forwarder {
    /// One delivery attempt of `record` (stored at `revision`; `None`: nothing stored yet, see
    /// [`Self::relay_answering`]), recording the outcome.
    /// `answering_origin` is set when the origin waits on this attempt (its Relay call): a
    /// status obtained now goes back in that reply instead of through a later report.
    /// Returns the state after the attempt and the destination's status when known.
    pub(super) async fn attempt(
        &self,
        key: &str,
        mut record: RelayRecord,
        revision: Option<i64>,
        answering_origin: Option<&OriginWait>,
        known: Option<Ends>,
    ) -> Result<(State, Option<RelayedStatus>)> {
        // Both ends, as just checked by the caller when it did.
        let peers = match known {
            Some(peers) => peers,
            None => {
                self.peers(&[&record.origin.id, &record.destination.id])
                    .await?
            }
        };
        let result: Result<Option<State>> = async {
            match record.state {
                State::Pending | State::Delivered => {
                    let broker = peers.broker_of(&record.destination.id, "destination")?;
                    let answer = self.brokers.submit(&broker, &record).await?;
                    let decided = answer.filter(|s| {
                        matches!(
                            pb::NetworkConfigState::try_from(s.state),
                            Ok(pb::NetworkConfigState::Processed
                                | pb::NetworkConfigState::Rejected)
                        )
                    });
                    match decided {
                        Some(s) => {
                            record.status = Some(RelayedStatus::from_pb(s));
                            // The origin is told in the Relay reply (when it waits on this
                            // attempt) or through ReportNetworkConfigStatus, rejections too.
                            Ok(Some(State::StatusPending))
                        }
                        None => Ok(Some(State::Delivered)),
                    }
                }
                State::StatusPending => {
                    let broker = peers.broker_of(&record.origin.id, "origin")?;
                    let status = record
                        .status
                        .clone()
                        .ok_or_else(|| Error::Internal("a status relay without a status".into()))?;
                    self.brokers
                        .report_status(&broker, &record.origin, &record.destination, &status)
                        .await?;
                    Ok(None)
                }
                State::Withdrawing => {
                    let broker = peers.broker_of(&record.destination.id, "destination")?;
                    self.brokers
                        .withdraw(&broker, &record.origin, &record.destination, &record.reason)
                        .await?;
                    Ok(None)
                }
                State::Failed => Ok(Some(State::Failed)),
                State::Completed => Ok(None),
            }
        }
        .await;

        let now = now_nanos();
        // Taken on every outcome, so a marker never outlives the attempt it was meant for.
        let expedited = self.take_expedited(key);
        let (origin_id, destination_id) = (record.origin.id.clone(), record.destination.id.clone());
        let next = match result {
            // Done: nothing left to keep.
            Ok(None) => None,
            Ok(Some(State::StatusPending)) if answering_origin.is_some_and(OriginWait::answer) => {
                // The origin gets the status in its Relay reply: complete.
                let status = record.status.clone();
                if let Some(revision) = revision {
                    self.save(key, revision, None).await?;
                }
                tracing::debug!(origin = %record.origin.id, destination = %record.destination.id, "relay completed");
                let rejected = status
                    .as_ref()
                    .is_some_and(|s| s.state == pb::NetworkConfigState::Rejected as i32);
                return Ok((
                    if rejected {
                        State::Failed
                    } else {
                        State::Completed
                    },
                    status,
                ));
            }
            Ok(Some(state)) => {
                record.state = state;
                record.attempts = 0;
                record.last_error.clear();
                record.next_attempt_nanos = if state == State::StatusPending {
                    now
                } else {
                    0
                };
                Some(record)
            }
            // Given up for good only when the other end refused the content itself; anything
            // else (unreachable, not peered yet, a bug a restart may clear) is retried.
            Err(err) if err.is_permanent() => {
                tracing::warn!(origin = %record.origin.id, destination = %record.destination.id, error = %err, "relay refused for good");
                record.state = State::Failed;
                record.last_error = err.to_string();
                record.next_attempt_nanos = 0;
                Some(record)
            }
            Err(err) => {
                self.retried.inc();
                record.attempts += 1;
                record.last_error = err.to_string();
                record.next_attempt_nanos = if expedited {
                    // The other direction arrived meanwhile: what this attempt was refused
                    // for is likely gone.
                    now
                } else {
                    let wait = self.delivery.retry_policy().delay_after(record.attempts);
                    now.saturating_add(nanos(wait))
                };
                tracing::debug!(origin = %record.origin.id, destination = %record.destination.id, attempts = record.attempts, error = %err, "relay delivery will be retried");
                Some(record)
            }
        };
        let state = next.as_ref().map_or(State::Completed, |r| r.state);
        let status = next.as_ref().and_then(|r| r.status.clone());
        match (&next, revision) {
            (Some(r), Some(revision)) => {
                let mut stored = r.clone();
                stored.updated_nanos = now;
                self.save(key, revision, Some(&stored)).await?;
            }
            (Some(r), None) => {
                // A first attempt with nothing stored: its outcome is stored now, over what an
                // origin that stopped waiting had stored (the same relay, still pending), never
                // over a newer generation or a withdrawal.
                let mut stored = r.clone();
                stored.updated_nanos = now;
                // Held while storing: an origin that stops waiting meanwhile finds the relay
                // stored, not a stale copy to store over this outcome.
                let _unstored = match answering_origin {
                    Some(wait) => {
                        let mut unstored = wait.unstored.lock().await;
                        unstored.take();
                        Some(unstored)
                    }
                    None => None,
                };
                self.store_first(key, &stored, |held| {
                    Self::stored_wins(held, stored.generation)
                })
                .await?;
            }
            (None, Some(revision)) => {
                self.save(key, revision, None).await?;
                tracing::debug!(origin = %origin_id, destination = %destination_id, "relay completed");
            }
            (None, None) => {
                tracing::debug!(origin = %origin_id, destination = %destination_id, "relay completed");
            }
        }
        Ok((state, status))
    }
}
