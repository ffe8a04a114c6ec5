//! Per-peer WireGuard listen ports. Every remote peer has its own interface, and two userspace
//! interfaces on one port silently break each other (spike note, pitfall 4), so each peer gets
//! a port of its own from a configured range: allocated on first request, persisted (stable
//! across restarts, so the endpoint published in NetworkConfigs stays valid), unique by a
//! compare-and-swap on the store, and released when the peer's tunnel is removed. A port handed
//! out for a peer that never gets a tunnel (a rejected or abandoned exchange, a made-up cluster
//! ID) goes back to the range once nobody asked for it during a grace period (ADR 0007).
//!
//! A port is also the peer's connection mark and routing table, so a port freed with its
//! tunnel is quarantined: it is handed out again only after the connections marked with it
//! were flushed from conntrack and `--port-quarantine` has passed, and never while a port that
//! nobody held is free (issue 15, item 11).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

use trellis_api::ClusterId;
use trellis_error::{Error, Result};
use trellis_runtime::config::ports::WIREGUARD;
use trellis_store::retry::Contention;
use trellis_store::{Compare, Op, SharedStore, Txn};

use crate::records::{
    FREED_PREFIX, FreedRecord, PEERS_PREFIX, PortRecord, USED_PREFIX, decode, encode, freed_key,
    now_nanos, peer_key, used_key,
};

/// Ports in the default range (51840-52095).
const DEFAULT_SIZE: u16 = 256;

/// An inclusive range of UDP ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortRange {
    first: u16,
    last: u16,
}

impl PortRange {
    /// `first..=last`; `None` when empty or starting below 1024. Ports double as routing
    /// table numbers (see [`crate::names::table`]), and below 1024 would hit the reserved
    /// tables 253-255.
    pub fn new(first: u16, last: u16) -> Option<Self> {
        (first >= 1024 && first <= last).then_some(Self { first, last })
    }

    /// The default range, starting at the default WireGuard port.
    pub fn default_range() -> Self {
        Self {
            first: WIREGUARD,
            last: WIREGUARD + DEFAULT_SIZE - 1,
        }
    }

    /// Parses `FIRST-LAST`.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let (a, b) = text
            .split_once('-')
            .ok_or_else(|| format!("{text:?} is not FIRST-LAST (e.g. 51840-52095)"))?;
        let port = |s: &str| {
            s.trim()
                .parse::<u16>()
                .map_err(|_| format!("{s:?} is not a UDP port"))
        };
        Self::new(port(a)?, port(b)?)
            .ok_or_else(|| format!("{text:?} is empty or starts below port 1024"))
    }

    pub fn first(&self) -> u16 {
        self.first
    }

    /// Number of ports.
    pub fn len(&self) -> usize {
        usize::from(self.last - self.first) + 1
    }

    /// Never empty; for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether `port` is in the range.
    pub fn contains(&self, port: u16) -> bool {
        (self.first..=self.last).contains(&port)
    }

    fn iter(&self) -> impl Iterator<Item = u16> {
        self.first..=self.last
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

fn nanos(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

/// How ports are handed out and taken back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortPolicy {
    pub range: PortRange,
    /// How long a port handed out for a peer without a tunnel is kept after the last request
    /// (`--unused-port-grace`).
    pub unused_grace: Duration,
    /// How long a port freed with its tunnel stays out of use at least (`--port-quarantine`).
    pub quarantine: Duration,
}

/// Where [`allocate`] tries first: the port after the last one this process handed out. A
/// guess, kept in memory only: the transaction that takes the port checks that nobody holds
/// it and that it was never freed (no quarantine marker), and a wrong guess falls back to
/// reading every used port. Without it each new peer read the whole table: O(n²) reads for n
/// peers, 4 % of the CPU of the 255-cluster in-process mesh (issue 17).
#[derive(Debug, Default)]
pub struct Hint(AtomicU16);

impl Hint {
    /// The port to try, if the hint is in `range`.
    fn next(&self, range: PortRange) -> Option<u16> {
        let port = self.0.load(Ordering::Relaxed);
        range.contains(port).then_some(port)
    }

    /// `port` was handed out: try the one after it next.
    fn taken(&self, port: u16) {
        self.0.store(port.saturating_add(1), Ordering::Relaxed);
    }
}

/// A port `allocate` may take, and the compare that keeps the choice valid.
struct Candidate {
    port: u16,
    /// The freed marker's revision when the port is a quarantined one whose time is up.
    freed_revision: Option<i64>,
}

/// The port to take: the first one nobody held, else the longest-freed one whose connections
/// were flushed and whose quarantine has passed. Also returns how many free ports are still
/// in quarantine (for the error when there is none).
fn choose(
    range: PortRange,
    quarantine: Duration,
    used: &BTreeSet<u16>,
    freed: &BTreeMap<u16, (FreedRecord, i64)>,
    now: i64,
) -> (Option<Candidate>, usize) {
    let free = || range.iter().filter(|p| !used.contains(p));
    if let Some(port) = free().find(|p| !freed.contains_key(p)) {
        return (
            Some(Candidate {
                port,
                freed_revision: None,
            }),
            0,
        );
    }
    let mut waiting = 0;
    let mut best: Option<(i64, Candidate)> = None;
    for port in free() {
        let Some((record, revision)) = freed.get(&port) else {
            continue;
        };
        if !record.flushed || now.saturating_sub(record.freed_nanos) < nanos(quarantine) {
            waiting += 1;
            continue;
        }
        if best.as_ref().is_none_or(|(at, _)| record.freed_nanos < *at) {
            best = Some((
                record.freed_nanos,
                Candidate {
                    port,
                    freed_revision: Some(*revision),
                },
            ));
        }
    }
    (best.map(|(_, c)| c), waiting)
}

/// Every freed marker in the store, by port.
async fn freed_markers(store: &SharedStore) -> Result<BTreeMap<u16, (FreedRecord, i64)>> {
    let mut out = BTreeMap::new();
    for kv in store.list(FREED_PREFIX).await?.kvs {
        let Some(port) = kv
            .key
            .strip_prefix(FREED_PREFIX)
            .and_then(|p| p.parse().ok())
        else {
            continue;
        };
        out.insert(port, (decode(&kv.key, &kv.value)?, kv.mod_revision));
    }
    Ok(out)
}

/// The transaction giving `peer` a port nobody held before (no quarantine marker).
fn take_fresh(key: &str, peer: &ClusterId, port: u16, now: i64) -> Result<Txn> {
    let record = PortRecord {
        port,
        tunnel: false,
        requested_nanos: now,
    };
    Ok(Txn::new()
        .when(Compare::absent(key))
        .when(Compare::absent(used_key(port)))
        .when(Compare::absent(freed_key(port)))
        .then(Op::put(key, encode(&record)?))
        .then(Op::put(used_key(port), peer.as_str().as_bytes().to_vec())))
}

/// The peer's port, allocating one when it has none (trying `hint` first). Asking again keeps
/// a port without a tunnel from being released (see [`release_unused`]); when the range is
/// full, ports nobody asked for during the grace period are released first.
pub async fn allocate(
    store: &SharedStore,
    policy: &PortPolicy,
    hint: &Hint,
    peer: &ClusterId,
) -> Result<u16> {
    let (range, grace) = (policy.range, policy.unused_grace);
    let key = peer_key(peer);
    let mut contention = Contention::on(store, "allocating a WireGuard port");
    let mut reclaimed = false;
    let mut guess = hint.next(range);
    loop {
        let now = now_nanos();
        if let Some(kv) = store.get(&key).await? {
            let record: PortRecord = decode(&key, &kv.value)?;
            if record.tunnel || now.saturating_sub(record.requested_nanos) <= nanos(grace) / 4 {
                return Ok(record.port);
            }
            let refreshed = PortRecord {
                requested_nanos: now,
                ..record
            };
            let outcome = store
                .txn(
                    Txn::new()
                        .when(Compare::mod_revision(key.as_str(), kv.mod_revision))
                        .then(Op::put(key.as_str(), encode(&refreshed)?)),
                )
                .await?;
            if outcome.succeeded {
                return Ok(record.port);
            }
            // Bound, refreshed or released meanwhile: look again.
            contention.lost().await?;
            continue;
        }
        if let Some(port) = guess.take() {
            if store
                .txn(take_fresh(&key, peer, port, now)?)
                .await?
                .succeeded
            {
                hint.taken(port);
                tracing::info!(peer = %peer, port, "allocated a wireguard port");
                return Ok(port);
            }
            // Taken, freed, or the peer got one meanwhile: look at the table.
            continue;
        }
        let used: BTreeSet<u16> = store
            .list(USED_PREFIX)
            .await?
            .kvs
            .iter()
            .filter_map(|kv| kv.key.strip_prefix(USED_PREFIX)?.parse().ok())
            .collect();
        let freed = freed_markers(store).await?;
        let (chosen, waiting) = choose(range, policy.quarantine, &used, &freed, now);
        let Some(Candidate {
            port,
            freed_revision,
        }) = chosen
        else {
            if !reclaimed {
                reclaimed = true;
                if !release_unused(store, grace).await?.is_empty() {
                    continue;
                }
            }
            return Err(Error::ResourceExhausted(format!(
                "no free WireGuard port left in {range} ({} peers hold one, {waiting} are \
                 quarantined after their peers left, until their connections are flushed and \
                 --port-quarantine ({} s) passed; a port handed out for a peer without a tunnel \
                 returns after --unused-port-grace, {} s); widen --wireguard-ports",
                used.len(),
                policy.quarantine.as_secs(),
                grace.as_secs()
            )));
        };
        // The marker as it was chosen (or its absence) is part of the decision.
        let txn = match freed_revision {
            Some(revision) => {
                let record = PortRecord {
                    port,
                    tunnel: false,
                    requested_nanos: now,
                };
                Txn::new()
                    .when(Compare::absent(key.as_str()))
                    .when(Compare::absent(used_key(port)))
                    .when(Compare::mod_revision(freed_key(port), revision))
                    .then(Op::put(key.as_str(), encode(&record)?))
                    .then(Op::put(used_key(port), peer.as_str().as_bytes().to_vec()))
                    .then(Op::delete(freed_key(port)))
            }
            None => take_fresh(&key, peer, port, now)?,
        };
        let outcome = store.txn(txn).await?;
        if outcome.succeeded {
            hint.taken(port);
            tracing::info!(peer = %peer, port, "allocated a wireguard port");
            return Ok(port);
        }
        contention.skip()?;
    }
}

/// Releases the ports of peers without an applied tunnel that nobody asked for during `grace`:
/// exchanges that were rejected or abandoned, induced peers withdrawn before their tunnel,
/// made-up cluster IDs. The broker asks for the port of every exchange it is still working
/// on every quarter of the grace period (GetGatewayInfo tells it), at its next look, at most a
/// resync later. Returns the released peers.
pub async fn release_unused(store: &SharedStore, grace: Duration) -> Result<Vec<(ClusterId, u16)>> {
    let listing = store.list(PEERS_PREFIX).await?;
    let now = now_nanos();
    let mut released = Vec::new();
    for kv in listing.kvs {
        let Some(id) = kv
            .key
            .strip_prefix(PEERS_PREFIX)
            .and_then(|id| ClusterId::parse("cluster_id", id).ok())
        else {
            continue;
        };
        let record: PortRecord = decode(&kv.key, &kv.value)?;
        if record.tunnel {
            continue;
        }
        // Only if unchanged since the listing: a port asked for or bound meanwhile stays.
        let txn = Txn::new().when(Compare::mod_revision(kv.key.as_str(), kv.mod_revision));
        if record.requested_nanos == 0 {
            let stamped = PortRecord {
                requested_nanos: now,
                ..record
            };
            store
                .txn(txn.then(Op::put(kv.key.as_str(), encode(&stamped)?)))
                .await?;
            continue;
        }
        if now.saturating_sub(record.requested_nanos) <= nanos(grace) {
            continue;
        }
        let outcome = store
            .txn(
                txn.then(Op::delete(kv.key.as_str()))
                    .then(Op::delete(used_key(record.port))),
            )
            .await?;
        if outcome.succeeded {
            tracing::info!(peer = %id, port = record.port, "released a wireguard port no tunnel used");
            released.push((id, record.port));
        }
    }
    Ok(released)
}

/// Records that a TunnelEndpoint for `peer` is applied (allocating its port if needed), so the
/// port is released with the tunnel. Returns the port.
pub async fn bind_tunnel(
    store: &SharedStore,
    policy: &PortPolicy,
    hint: &Hint,
    peer: &ClusterId,
) -> Result<u16> {
    let key = peer_key(peer);
    let mut contention = Contention::on(store, "marking a WireGuard port in use");
    loop {
        let Some(kv) = store.get(&key).await? else {
            allocate(store, policy, hint, peer).await?;
            continue;
        };
        let record: PortRecord = decode(&key, &kv.value)?;
        if record.tunnel {
            return Ok(record.port);
        }
        let updated = PortRecord {
            tunnel: true,
            ..record
        };
        let outcome = store
            .txn(
                Txn::new()
                    .when(Compare::mod_revision(key.as_str(), kv.mod_revision))
                    .then(Op::put(key.as_str(), encode(&updated)?)),
            )
            .await?;
        if outcome.succeeded {
            return Ok(record.port);
        }
        contention.lost().await?;
    }
}

/// Releases the ports of peers whose tunnel was applied once and is not in `keep`, leaving a
/// freed marker that quarantines each (see [`unflushed`]). Ports only handed out by
/// GetGatewayInfo (no tunnel yet, so no connection carries their mark) are
/// [`release_unused`]'s. Returns the released peers.
pub async fn release_tunnels_except(
    store: &SharedStore,
    keep: &BTreeSet<ClusterId>,
) -> Result<Vec<(ClusterId, u16)>> {
    let listing = store.list(PEERS_PREFIX).await?;
    let mut released = Vec::new();
    for kv in listing.kvs {
        let Some(id) = kv.key.strip_prefix(PEERS_PREFIX) else {
            continue;
        };
        let Ok(id) = ClusterId::parse("cluster_id", id) else {
            continue;
        };
        let record: PortRecord = decode(&kv.key, &kv.value)?;
        if !record.tunnel || keep.contains(&id) {
            continue;
        }
        let freed = FreedRecord {
            peer: id.to_string(),
            freed_nanos: now_nanos(),
            flushed: false,
        };
        // Only if unchanged since the listing: a concurrent re-allocation wins, and the next
        // reconciliation looks again.
        let outcome = store
            .txn(
                Txn::new()
                    .when(Compare::mod_revision(kv.key.as_str(), kv.mod_revision))
                    .then(Op::delete(kv.key.as_str()))
                    .then(Op::delete(used_key(record.port)))
                    .then(Op::put(freed_key(record.port), encode(&freed)?)),
            )
            .await?;
        if outcome.succeeded {
            tracing::info!(peer = %id, port = record.port, "released a wireguard port");
            released.push((id, record.port));
        }
    }
    Ok(released)
}

/// Freed ports whose connections are not flushed yet, with their marker's revision for
/// [`mark_flushed`].
pub async fn unflushed(store: &SharedStore) -> Result<Vec<(u16, i64)>> {
    Ok(freed_markers(store)
        .await?
        .into_iter()
        .filter(|(_, (record, _))| !record.flushed)
        .map(|(port, (_, revision))| (port, revision))
        .collect())
}

/// Records that the connections of freed `port` were flushed; a marker changed meanwhile
/// (freed again, or taken) is left alone.
pub async fn mark_flushed(store: &SharedStore, port: u16, revision: i64) -> Result<()> {
    let key = freed_key(port);
    let Some(kv) = store.get(&key).await? else {
        return Ok(());
    };
    if kv.mod_revision != revision {
        return Ok(());
    }
    let record = FreedRecord {
        flushed: true,
        ..decode(&key, &kv.value)?
    };
    store
        .txn(
            Txn::new()
                .when(Compare::mod_revision(key.as_str(), revision))
                .then(Op::put(key.as_str(), encode(&record)?)),
        )
        .await?;
    Ok(())
}

/// The peer's port, if it has one.
pub async fn lookup(store: &SharedStore, peer: &ClusterId) -> Result<Option<u16>> {
    let key = peer_key(peer);
    match store.get(&key).await? {
        Some(kv) => Ok(Some(decode::<PortRecord>(&key, &kv.value)?.port)),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_display() {
        let r = PortRange::parse("51840-51842").expect("valid");
        assert_eq!((r.len(), r.to_string()), (3, "51840-51842".to_owned()));
        assert!(r.contains(51842) && !r.contains(51843));
        assert!(PortRange::parse("5-4").is_err());
        assert_eq!(PortRange::default_range().len(), 256);
    }

    fn id(s: &str) -> ClusterId {
        ClusterId::parse("cluster_id", s).expect("valid")
    }

    fn policy(first: u16, last: u16, quarantine: Duration) -> PortPolicy {
        PortPolicy {
            range: PortRange::new(first, last).expect("range"),
            unused_grace: Duration::from_secs(600),
            quarantine,
        }
    }

    /// Frees `peer`'s port with its tunnel, as the gateway does when its TunnelEndpoint goes.
    async fn bind_and_free(store: &SharedStore, policy: &PortPolicy, peer: &str) -> u16 {
        let port = bind_tunnel(store, policy, &Hint::default(), &id(peer))
            .await
            .expect("bind");
        let released = release_tunnels_except(store, &BTreeSet::new())
            .await
            .expect("release");
        assert_eq!(released, vec![(id(peer), port)]);
        port
    }

    #[tokio::test]
    async fn a_port_freed_with_its_tunnel_waits_for_the_flush_and_the_quarantine() {
        let store: SharedStore = std::sync::Arc::new(trellis_store::MemoryStore::new());
        let one = policy(40000, 40000, Duration::ZERO);
        let port = bind_and_free(&store, &one, "old").await;
        // Not flushed: the new peer would inherit the old peer's tracked connections.
        let err = allocate(&store, &one, &Hint::default(), &id("new"))
            .await
            .expect_err("quarantined");
        assert!(
            matches!(err, Error::ResourceExhausted(ref m) if m.contains("1 are quarantined")),
            "{err}"
        );
        let pending = unflushed(&store).await.expect("unflushed");
        assert_eq!(pending.iter().map(|p| p.0).collect::<Vec<_>>(), vec![port]);
        // Flushed, but a quarantine still running keeps it out too.
        mark_flushed(&store, port, pending[0].1)
            .await
            .expect("flushed");
        let long = policy(40000, 40000, Duration::from_secs(3600));
        assert!(
            allocate(&store, &long, &Hint::default(), &id("new"))
                .await
                .is_err()
        );
        assert!(unflushed(&store).await.expect("unflushed").is_empty());
        // Flushed and out of quarantine: taken, and the marker goes with it.
        assert_eq!(
            allocate(&store, &one, &Hint::default(), &id("new"))
                .await
                .expect("port"),
            port
        );
        assert!(store.list(FREED_PREFIX).await.expect("list").kvs.is_empty());
    }

    #[tokio::test]
    async fn a_port_nobody_held_is_preferred_to_a_freed_one() {
        let store: SharedStore = std::sync::Arc::new(trellis_store::MemoryStore::new());
        let two = policy(40000, 40001, Duration::ZERO);
        let first = bind_and_free(&store, &two, "old").await;
        let (_, revision) = unflushed(&store).await.expect("unflushed")[0];
        mark_flushed(&store, first, revision)
            .await
            .expect("flushed");
        let port = allocate(&store, &two, &Hint::default(), &id("new"))
            .await
            .expect("port");
        assert_ne!(
            port, first,
            "the freed port was reused while another was free"
        );
        // A stale revision changes nothing.
        mark_flushed(&store, port, 1).await.expect("no-op");
    }

    /// The hint is only a first guess: a port someone else took, or one in quarantine, is
    /// never handed out because the hint points at it.
    #[tokio::test]
    async fn a_hint_at_a_held_or_quarantined_port_falls_back_to_a_free_one() {
        let store: SharedStore = std::sync::Arc::new(trellis_store::MemoryStore::new());
        let three = policy(40000, 40002, Duration::from_secs(3600));
        let hint = Hint::default();
        assert_eq!(
            allocate(&store, &three, &hint, &id("a")).await.expect("a"),
            40000
        );
        // Another replica took the hinted port meanwhile.
        store
            .put(&used_key(40001), b"elsewhere".to_vec())
            .await
            .expect("put");
        assert_eq!(
            allocate(&store, &three, &hint, &id("b")).await.expect("b"),
            40002
        );
        // A freed (quarantined) port under the hint is left alone too.
        let released = release_tunnels_except(&store, &BTreeSet::new())
            .await
            .expect("release");
        assert!(released.is_empty(), "no tunnel was bound");
        bind_tunnel(&store, &three, &hint, &id("b"))
            .await
            .expect("bind");
        let released = release_tunnels_except(&store, &BTreeSet::new())
            .await
            .expect("release");
        assert_eq!(released, vec![(id("b"), 40002)]);
        store.delete(&used_key(40001)).await.expect("delete");
        let hint = Hint::default();
        hint.taken(40001);
        assert_eq!(
            allocate(&store, &three, &hint, &id("c")).await.expect("c"),
            40001
        );
        // The hint now points past the range's end; the quarantined 40002 stays out.
        let err = allocate(&store, &three, &hint, &id("d"))
            .await
            .expect_err("only a quarantined port is left");
        assert!(
            matches!(err, Error::ResourceExhausted(ref m) if m.contains("1 are quarantined")),
            "{err}"
        );
        let hint = Hint::default();
        hint.taken(40001);
        let err = allocate(&store, &three, &hint, &id("d"))
            .await
            .expect_err("the hinted port is quarantined");
        assert!(matches!(err, Error::ResourceExhausted(_)), "{err}");
    }

    #[test]
    fn the_longest_freed_port_is_reused_first() {
        let range = PortRange::new(40000, 40002).expect("range");
        let used = BTreeSet::from([40001]);
        let freed = |at: i64, flushed: bool| {
            (
                FreedRecord {
                    peer: "p".into(),
                    freed_nanos: at,
                    flushed,
                },
                at,
            )
        };
        let markers = BTreeMap::from([(40000, freed(20, true)), (40002, freed(10, true))]);
        let (chosen, waiting) = choose(range, Duration::ZERO, &used, &markers, 100);
        assert_eq!((chosen.map(|c| c.port), waiting), (Some(40002), 0));
        let markers = BTreeMap::from([(40000, freed(20, true)), (40002, freed(10, false))]);
        let (chosen, waiting) = choose(range, Duration::ZERO, &used, &markers, 100);
        assert_eq!((chosen.map(|c| c.port), waiting), (Some(40000), 1));
        let (chosen, waiting) = choose(range, Duration::from_nanos(90), &used, &markers, 100);
        assert_eq!((chosen.map(|c| c.port), waiting), (None, 2));
    }
}
