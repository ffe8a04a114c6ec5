//! The reconciler: makes the store match what discovery says we are peered with. For every
//! remote we must exchange NetworkConfigs with, it keeps our NetworkConfig current (local IPAM
//! subnets and the gateway's endpoint and key for that remote), delivers it until the remote
//! decides (directly to a full peer's broker, or through the hub's forwarder for an induced
//! peer), and writes the TunnelEndpoint once both directions are decided. Everything held for
//! a remote that is no longer wanted is torn down. Runs on every wake-up (handlers, discovery
//! changes) and periodically; every step is idempotent, so a restart simply runs it again.
//!
//! This file keeps the entry point and what a pass reports; the work is split by step:
//!
//! - `scheduling`: when passes run: each lane's loop, its per-remote retries, and the
//!   discovery watch that wakes the lanes;
//! - [`pass`]: one pass, over every remote of a lane or over the woken ones only: who is
//!   wanted, who is held, what to exchange and what to tear down;
//! - [`exchange`]: keeping our NetworkConfig towards one remote current and delivering it
//!   until the remote decides;
//! - `tunnel`: the TunnelEndpoint, written once both directions are decided and removed first
//!   on a teardown;
//! - [`teardown`]: removing what is held for a remote no longer wanted or withdrawn, and freeing
//!   the IPAM mappings nothing holds.

pub mod exchange;
pub mod pass;
mod scheduling;
pub mod teardown;
mod tunnel;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use trellis_api::ClusterId;
use trellis_runtime::Shutdown;

use self::scheduling::{follow_discovery, run_lane};
use crate::core::Broker;
use crate::core::lanes::Lane;

/// Runs until `shutdown`, in two lanes: full peers and induced peers are reconciled by
/// separate loops ([`Lane`]), each with its own pending work and retries, so work for a full
/// peering (its NetworkConfig exchange and tunnel) never waits behind a pass over induced
/// exchanges, which each wait on a relay through a hub. Within a lane, a pass looks at every
/// remote of the lane on the periodic resync (and after a failure it could not pin on one
/// remote), otherwise only at the remotes something happened to ([`Broker::wake_for`]), so the
/// work per event does not grow with the number of peers.
pub async fn run(broker: Arc<Broker>, resync: Duration, shutdown: Shutdown) {
    trellis_runtime::telemetry::spawn(follow_discovery(broker.clone(), shutdown.clone()));
    let induced = trellis_runtime::telemetry::spawn(run_lane(
        broker.clone(),
        Lane::Induced,
        resync,
        shutdown.clone(),
    ));
    run_lane(broker, Lane::Full, resync, shutdown).await;
    let _ = induced.await;
}

/// What a pass left unfinished: remotes to retry, or (`all`) something not tied to one remote.
#[derive(Debug, Default)]
pub struct Unsettled {
    pub all: bool,
    pub ids: BTreeSet<ClusterId>,
}

/// A broker over an empty in-memory store whose local services never answer: what the unit
/// tests run passes, wake-ups and the core's store-only paths against.
#[cfg(test)]
pub(crate) fn broker() -> Broker {
    broker_on(Arc::new(trellis_store::MemoryStore::new()))
}

/// [`broker`] over `store`.
#[cfg(test)]
pub(crate) fn broker_on(store: trellis_store::SharedStore) -> Broker {
    let ports = crate::remote::Ports::new(
        "127.0.0.1:9",
        "127.0.0.1:9",
        "127.0.0.1:9",
        None,
        &trellis_runtime::local_auth::LocalToken::off(),
        &trellis_runtime::metrics::Metrics::new(),
    )
    .expect("valid addresses");
    let identity =
        trellis_api::ClusterIdentity::parse("id", "leaf-a", "name", "").expect("identity");
    Broker::new(identity, store, ports, None)
}
