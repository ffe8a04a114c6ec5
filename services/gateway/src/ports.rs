//! Per-peer WireGuard listen ports. Every remote peer has its own interface, and two userspace
//! interfaces on one port silently break each other (spike note, pitfall 4), so each peer gets
//! a port of its own from a configured range: allocated on first request, persisted (stable
//! across restarts, so the endpoint published in NetworkConfigs stays valid), unique by a
//! compare-and-swap on the store, and released when the peer's tunnel is removed. A port handed
//! out for a peer that never gets a tunnel (a rejected or abandoned exchange, a made-up cluster
//! ID) goes back to the range once nobody asked for it during a grace period (ADR 0007).

use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

use trellis_api::ClusterId;
use trellis_error::{Error, Result};
use trellis_runtime::config::ports::WIREGUARD;
use trellis_store::retry::Contention;
use trellis_store::{Compare, Op, SharedStore, Txn};

use crate::records::{
    PEERS_PREFIX, PortRecord, USED_PREFIX, decode, encode, now_nanos, peer_key, used_key,
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

    /// The default range, starting at the WireGuard port of DESIGN.md.
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

/// The peer's port, allocating one when it has none. Asking again keeps a port without a
/// tunnel from being released (see [`release_unused`]); when the range is full, ports nobody
/// asked for during `grace` are released first.
pub async fn allocate(
    store: &SharedStore,
    range: PortRange,
    grace: Duration,
    peer: &ClusterId,
) -> Result<u16> {
    let key = peer_key(peer);
    let mut contention = Contention::new("allocating a WireGuard port");
    let mut reclaimed = false;
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
        let used: BTreeSet<u16> = store
            .list(USED_PREFIX)
            .await?
            .kvs
            .iter()
            .filter_map(|kv| kv.key.strip_prefix(USED_PREFIX)?.parse().ok())
            .collect();
        let Some(port) = range.iter().find(|p| !used.contains(p)) else {
            if !reclaimed {
                reclaimed = true;
                if !release_unused(store, grace).await?.is_empty() {
                    continue;
                }
            }
            return Err(Error::ResourceExhausted(format!(
                "no free WireGuard port left in {range} ({} peers hold one; a port handed out \
                 for a peer without a tunnel returns after --unused-port-grace, {} s); widen \
                 --wireguard-ports",
                used.len(),
                grace.as_secs()
            )));
        };
        let record = PortRecord {
            port,
            tunnel: false,
            requested_nanos: now,
        };
        let outcome = store
            .txn(
                Txn::new()
                    .when(Compare::absent(key.as_str()))
                    .when(Compare::absent(used_key(port)))
                    .then(Op::put(key.as_str(), encode(&record)?))
                    .then(Op::put(used_key(port), peer.as_str().as_bytes().to_vec())),
            )
            .await?;
        if outcome.succeeded {
            tracing::info!(peer = %peer, port, "allocated a wireguard port");
            return Ok(port);
        }
        contention.skip()?;
    }
}

/// Releases the ports of peers without an applied tunnel that nobody asked for during `grace`:
/// exchanges that were rejected or abandoned, induced peers withdrawn before their tunnel,
/// made-up cluster IDs. The broker asks for the port of every exchange it is still working
/// on at least once per resync, far more often than any sensible grace period. Returns the
/// released peers.
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
    range: PortRange,
    grace: Duration,
    peer: &ClusterId,
) -> Result<u16> {
    let key = peer_key(peer);
    let mut contention = Contention::new("marking a WireGuard port in use");
    loop {
        let Some(kv) = store.get(&key).await? else {
            allocate(store, range, grace, peer).await?;
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

/// Releases the ports of peers whose tunnel was applied once and is not in `keep`. Ports only
/// handed out by GetGatewayInfo (no tunnel yet) are [`release_unused`]'s. Returns the released
/// peers.
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
        // Only if unchanged since the listing: a concurrent re-allocation wins, and the next
        // reconciliation looks again.
        let outcome = store
            .txn(
                Txn::new()
                    .when(Compare::mod_revision(kv.key.as_str(), kv.mod_revision))
                    .then(Op::delete(kv.key.as_str()))
                    .then(Op::delete(used_key(record.port))),
            )
            .await?;
        if outcome.succeeded {
            tracing::info!(peer = %id, port = record.port, "released a wireguard port");
            released.push((id, record.port));
        }
    }
    Ok(released)
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
}
