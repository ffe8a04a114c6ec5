//! The handoff's two sides on this namespace's connection tracking: the active reads the
//! translated connections the peers opened and sends them to its standbys; a standby enters
//! each complete set in its own table (and removes what ended), so a takeover finds those
//! connections tracked and translated as the active had them. The wire format is
//! [`handoff`]'s.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use trellis_runtime::{Shutdown, cmd};

use super::{Replicas, handoff};
use crate::records::now_nanos;

/// This network namespace's connection tracking table, as text.
const CONNTRACK_TABLE: &str = "/proc/net/nf_conntrack";

impl Replicas {
    /// The active's side of the handoff: every `every`, the translated connections the peers
    /// opened (from this namespace's connection tracking), to every other replica.
    pub(super) async fn share_connections(self: Arc<Self>, every: Duration, shutdown: Shutdown) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        // Set numbers only need to differ from the previous run's.
        let mut set = u32::try_from(now_nanos().rem_euclid(i64::from(u32::MAX))).unwrap_or(0);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let view = self.view.borrow().clone();
            let targets = self.targets();
            if !view.active || targets.is_empty() {
                continue;
            }
            let table = match tokio::fs::read_to_string(CONNTRACK_TABLE).await {
                Ok(table) => table,
                Err(err) => {
                    self.metrics.handoff_errors.inc();
                    if let Some(held) = self.handoff_log.admit() {
                        tracing::warn!(path = CONNTRACK_TABLE, error = %err, held_back = held, "cannot read the connection tracking table: the standbys get no connections to continue after a takeover");
                    }
                    continue;
                }
            };
            let flows = handoff::parse(&table, crate::names::MARK_MASK);
            set = set.wrapping_add(1);
            let datagrams = handoff::encode(
                &self.settings.replica,
                view.epoch(),
                set,
                now_nanos(),
                &flows,
                &self.key,
            );
            self.metrics
                .handed_off
                .set(i64::try_from(flows.len()).unwrap_or(i64::MAX));
            for to in targets {
                for datagram in &datagrams {
                    if let Err(err) = self.socket.send_to(datagram, to).await {
                        tracing::trace!(%to, error = %err, "sending a handoff part failed");
                    }
                }
            }
        }
    }

    /// The standby's side of the handoff: each complete set from the active becomes this
    /// namespace's copy (new connections entered, ended ones removed), so a takeover finds
    /// them tracked and translated as the active had them.
    pub(super) async fn hold_connections(
        self: Arc<Self>,
        mut parts: mpsc::Receiver<handoff::Part>,
    ) {
        let mut assembler = handoff::Assembler::default();
        let mut held = std::collections::BTreeSet::new();
        while let Some(part) = parts.recv().await {
            let Some(wanted) = assembler.take(part) else {
                continue;
            };
            if self.view.borrow().active {
                // Ours now: what we track is the truth, and the next standby's business.
                held.clear();
                continue;
            }
            let (insert, remove) = handoff::diff(&held, &wanted);
            for flow in insert {
                let args = flow.insert_args();
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                match cmd::run("conntrack", &args, None).await {
                    Ok(_) => {
                        held.insert(flow);
                    }
                    Err(err) if handoff::already_tracked(&format!("{err:#}")) => {
                        held.insert(flow);
                    }
                    Err(err) => self.handoff_failed(&err),
                }
            }
            for flow in remove {
                let args = flow.delete_args();
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                match cmd::run("conntrack", &args, None).await {
                    Ok(_) => {}
                    Err(err) if format!("{err:#}").contains("0 flow entries") => {}
                    Err(err) => self.handoff_failed(&err),
                }
                held.remove(&flow);
            }
            self.metrics
                .handed_off
                .set(i64::try_from(held.len()).unwrap_or(i64::MAX));
        }
    }

    fn handoff_failed(&self, err: &anyhow::Error) {
        self.metrics.handoff_errors.inc();
        if let Some(held) = self.handoff_log.admit() {
            tracing::warn!(
                error = format!("{err:#}"),
                held_back = held,
                "could not enter a handed-off connection in connection tracking: it may be reset after a takeover"
            );
        }
    }
}
