//! The heartbeat socket: our heartbeat sent to every other replica each interval, whatever
//! the store does, and every datagram received checked before it counts. Heartbeats and the
//! active's handoff parts share the socket; a datagram that is not authentic and fresh is
//! refused, counted by reason, and changes nothing.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use tokio::sync::mpsc;
use trellis_runtime::Shutdown;
use trellis_runtime::log_limit::LogLimit;

use super::heartbeat::{self, Heartbeat, Refusal};
use super::{Replicas, handoff};
use crate::records::now_nanos;

impl Replicas {
    /// Receives heartbeats, hands the authentic and fresh ones to the loop; and handoff
    /// parts, handed to [`Replicas::hold_connections`] when they come from the active we
    /// follow.
    pub(super) async fn receive(
        self: Arc<Self>,
        tx: mpsc::Sender<(Heartbeat, Instant)>,
        parts: mpsc::Sender<handoff::Part>,
    ) {
        let mut buf = vec![0u8; heartbeat::MAX_LEN.max(handoff::MAX_LEN) + 1];
        let mut last_sent: std::collections::HashMap<String, i64> =
            std::collections::HashMap::new();
        let refused_log = LogLimit::new(trellis_runtime::log_limit::PERIOD);
        loop {
            let Ok((n, from)) = self.socket.recv_from(&mut buf).await else {
                continue;
            };
            let datagram = buf.get(..n).unwrap_or_default();
            let outcome = if datagram.starts_with(handoff::MAGIC) {
                self.take_part(datagram, &parts)
            } else {
                Heartbeat::decode(datagram, &self.key)
                    .and_then(|beat| {
                        if heartbeat::fresh(
                            beat.sent_nanos,
                            last_sent.get(&beat.replica).copied(),
                            now_nanos(),
                        ) {
                            Ok(beat)
                        } else {
                            Err(Refusal::Stale)
                        }
                    })
                    .map(|beat| {
                        last_sent.insert(beat.replica.clone(), beat.sent_nanos);
                        if beat.replica != self.settings.replica
                            && let Ok(mut targets) = self.targets.lock()
                        {
                            targets.insert(beat.replica.clone(), from);
                        }
                        let _ = tx.try_send((beat, Instant::now()));
                    })
            };
            if let Err(reason) = outcome {
                self.metrics
                    .refused
                    .get_or_create(&vec![("reason", reason.label().to_owned())])
                    .inc();
                if let Some(held) = refused_log.admit() {
                    tracing::warn!(%from, reason = reason.label(), held_back = held, "refused a heartbeat or handoff datagram");
                }
            }
        }
    }

    /// One handoff datagram: authentic and fresh, from the active this standby follows (a
    /// deposed active's sets are ignored), it goes to [`Replicas::hold_connections`].
    fn take_part(
        &self,
        datagram: &[u8],
        parts: &mpsc::Sender<handoff::Part>,
    ) -> std::result::Result<(), Refusal> {
        let part = handoff::decode(datagram, &self.key)?;
        if !handoff::fresh(part.sent_nanos, now_nanos()) {
            return Err(Refusal::Stale);
        }
        let view = self.view.borrow().clone();
        let from_leader = view
            .leader
            .as_ref()
            .is_some_and(|l| l.replica == part.replica && l.epoch == part.epoch);
        if self.handoff.get().is_some() && !view.active && from_leader {
            let _ = parts.try_send(part);
        }
        Ok(())
    }

    /// Sends our heartbeat to every other replica each interval, whatever the store does.
    pub(super) async fn send(self: Arc<Self>, shutdown: Shutdown) {
        let mut tick = tokio::time::interval(self.settings.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let targets = self.targets();
            if targets.is_empty() {
                continue;
            }
            let view = self.view.borrow().clone();
            let datagram = Heartbeat {
                replica: self.settings.replica.clone(),
                active: view.active,
                warm: self.warm.load(Ordering::Relaxed),
                epoch: view.epoch(),
                sent_nanos: now_nanos(),
            }
            .encode(&self.key);
            for to in targets {
                if let Err(err) = self.socket.send_to(&datagram, to).await {
                    tracing::trace!(%to, error = %err, "sending a heartbeat failed");
                }
            }
        }
    }
}
