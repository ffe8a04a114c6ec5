//! The reconciler's two lanes as the broker keeps them: which remotes each lane must look at
//! next, and the wake-up that tells it so. Handlers only record what changed and wake a lane;
//! the lane's loop ([`crate::reconcile`]) takes the work, so no handler waits for a pass.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;
use trellis_api::ClusterId;

use super::Broker;

/// The remotes a reconciliation pass looks at: all of them, or only those something happened
/// to since the last pass.
#[derive(Debug, Default)]
pub struct Dirty {
    pub all: bool,
    pub ids: BTreeSet<ClusterId>,
}

/// Which of the reconciler's two lanes works on a remote. Full peers (direct NetworkConfig
/// exchange, the hub of induced peerings) and induced peers (relayed through a hub) are
/// reconciled by separate loops, so the handshake-to-tunnel path of a full peering never
/// waits behind a pass over hundreds of induced exchanges, each waiting on a relay through
/// the hub (ADR 0015).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lane {
    Full,
    Induced,
}

impl Lane {
    pub const ALL: [Lane; 2] = [Lane::Full, Lane::Induced];

    /// The lane of an exchange relayed through `via` (none: a direct one).
    pub fn of_via<T>(via: Option<&T>) -> Self {
        if via.is_some() {
            Lane::Induced
        } else {
            Lane::Full
        }
    }

    /// The lane of a remote routed as `route`.
    pub fn of_route(route: &trellis_api::peers::Route) -> Self {
        match route {
            trellis_api::peers::Route::Direct { .. } => Lane::Full,
            trellis_api::peers::Route::Relayed { .. } => Lane::Induced,
        }
    }

    /// The other lane.
    pub fn other(self) -> Self {
        match self {
            Lane::Full => Lane::Induced,
            Lane::Induced => Lane::Full,
        }
    }

    fn index(self) -> usize {
        match self {
            Lane::Full => 0,
            Lane::Induced => 1,
        }
    }
}

/// One lane's pending work and its wake-up.
#[derive(Debug)]
pub(super) struct LaneState {
    dirty: Mutex<Dirty>,
    wake: Arc<Notify>,
}

impl LaneState {
    pub(super) fn new() -> Self {
        Self {
            dirty: Mutex::new(Dirty {
                all: true,
                ids: BTreeSet::new(),
            }),
            wake: Arc::new(Notify::new()),
        }
    }
}

impl Broker {
    /// Asks both lanes of the reconciler for a pass over every remote.
    pub fn wake(&self) {
        for lane in &self.lanes {
            lane.dirty
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .all = true;
            lane.wake.notify_one();
        }
    }

    /// Asks `lane` for a pass over `remote` (what changed concerns only it). A remote woken
    /// in the wrong lane (its route changed meanwhile) is handed to the other one by the pass.
    pub fn wake_for(&self, remote: &ClusterId, lane: Lane) {
        let state = &self.lanes[lane.index()];
        state
            .dirty
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .ids
            .insert(remote.clone());
        state.wake.notify_one();
    }

    /// What `lane`'s next pass must look at; resets it.
    pub fn take_dirty(&self, lane: Lane) -> Dirty {
        std::mem::take(
            &mut *self.lanes[lane.index()]
                .dirty
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    /// Notified whenever `lane` has new work.
    pub(crate) fn lane_wake(&self, lane: Lane) -> Arc<Notify> {
        self.lanes[lane.index()].wake.clone()
    }
}
