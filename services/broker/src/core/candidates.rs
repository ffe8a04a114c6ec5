//! The broker's part in NAT traversal (ADR 0025). A hub tells the leaves it introduced where
//! its gateway sees their induced peers' gateways: the source of their authenticated WireGuard
//! packets, which a NAT in front of them chose (their reflexive endpoints). A leaf asks, per
//! hub, for every induced peer that hub introduced, and writes the answers into those
//! TunnelEndpoints as candidates beside the advertised endpoints; its gateway then sends its
//! first handshakes to all of them at once.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use trellis_api::model::{PeeringKind, TunnelEndpoint};
use trellis_api::peers::Peers;
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_runtime::Shutdown;
use trellis_store::{Compare, Op, Txn};

use super::Broker;
use crate::records::{TunnelRecord, decode, encode, tunnel_key};
use crate::remote::gateway::Observed;

impl Broker {
    /// Where our gateway sees the gateways of `ids`, for the full peer `requester`: only for
    /// clusters that are full peers of ours too (the pairs we introduce), never the requester
    /// itself; clusters we do not see recently are left out.
    pub async fn observed_for(
        &self,
        requester: &ClusterIdentity,
        ids: &[ClusterId],
    ) -> Result<Vec<(ClusterId, Observed)>> {
        self.check_peers(&[&requester.id], |peers| {
            if peers.is_full_peer(&requester.id) {
                Ok(())
            } else {
                Err(Error::PermissionDenied(format!(
                    "{} is not a full peer of this cluster",
                    requester.id
                )))
            }
        })
        .await?;
        let peers = self.view().await?;
        let observed = self.ports.gateway().observed().await?;
        Ok(ids
            .iter()
            .filter(|id| **id != requester.id && peers.is_full_peer(id))
            .filter_map(|id| observed.get(id).map(|seen| (id.clone(), *seen)))
            .collect())
    }

    /// One refresh: asks each hub where it sees the induced peers it introduced, and writes
    /// what changed into their TunnelEndpoints. Returns how many changed. A hub that does not
    /// answer leaves its peers' candidates as they were.
    pub async fn refresh_candidates(&self) -> Result<usize> {
        let (tunnels, _) = self.tunnels().await?;
        let mut by_hub: BTreeMap<ClusterId, Vec<&TunnelRecord>> = BTreeMap::new();
        for (tunnel, _) in &tunnels {
            if let (PeeringKind::Induced, Some(hub)) = (tunnel.kind, &tunnel.via) {
                by_hub.entry(hub.id.clone()).or_default().push(tunnel);
            }
        }
        if by_hub.is_empty() {
            return Ok(0);
        }
        // Only the hubs' records: a whole view per refresh cost a leaf with hundreds of peers
        // more than everything else the refresh does.
        let hubs: Vec<&ClusterId> = by_hub.keys().collect();
        let peers = Peers::from_foreign_clusters(&self.ports.discovery().lookup(&hubs).await?);
        let mut changed = 0;
        for (hub, tunnels) in by_hub {
            let Some((_, addresses, _)) = peers.full.get(&hub) else {
                continue;
            };
            if addresses.broker.is_empty() {
                continue;
            }
            let ids: Vec<ClusterId> = tunnels.iter().map(|t| t.remote.id.clone()).collect();
            let seen: HashMap<ClusterId, SocketAddr> = match self
                .ports
                .peers()
                .observed_endpoints(&addresses.broker, &hub, &self.identity, &ids)
                .await
            {
                Ok(seen) => seen.into_iter().collect(),
                Err(err) => {
                    tracing::debug!(hub = %hub, error = %err, "the hub does not say where it sees our induced peers");
                    continue;
                }
            };
            for tunnel in tunnels {
                let want = wanted(tunnel, seen.get(&tunnel.remote.id).copied());
                if want != tunnel.remote_candidates
                    && self.write_candidates(&tunnel.remote.id, &want).await?
                {
                    changed += 1;
                }
            }
        }
        Ok(changed)
    }

    /// Sets the candidates of `id`'s TunnelEndpoint (a new generation); false when it is gone,
    /// already has them, or changed meanwhile (the next refresh looks again).
    async fn write_candidates(&self, id: &ClusterId, want: &[SocketAddr]) -> Result<bool> {
        let key = tunnel_key(id);
        let Some(kv) = self.store.get(&key).await? else {
            return Ok(false);
        };
        let mut tunnel: TunnelEndpoint = decode(&key, &kv.value)?;
        if tunnel.remote_candidates == want {
            return Ok(false);
        }
        tunnel.remote_candidates = want.to_vec();
        tunnel.generation += 1;
        let committed = self
            .store
            .txn(
                Txn::new()
                    .when(Compare::mod_revision(key.clone(), kv.mod_revision))
                    .then(Op::put(key, encode(&tunnel)?)),
            )
            .await?;
        if committed.succeeded {
            tracing::info!(remote.id = %id, candidates = ?want, generation = tunnel.generation, "tunnel endpoint candidates");
        }
        Ok(committed.succeeded)
    }
}

/// The candidates `tunnel` should carry when its hub sees the remote at `seen`: that endpoint,
/// unless it is the advertised one already.
fn wanted(tunnel: &TunnelRecord, seen: Option<SocketAddr>) -> Vec<SocketAddr> {
    seen.filter(|ep| tunnel.remote_endpoint.socket_addr() != Some(*ep))
        .into_iter()
        .collect()
}

/// After a new induced TunnelEndpoint, how often and how long the candidates are refreshed
/// faster than the period: the hub may not have heard the new peer yet.
const SOON: Duration = Duration::from_secs(1);
const SOON_FOR: Duration = Duration::from_secs(30);

impl Broker {
    /// A new induced TunnelEndpoint wants its candidates: refresh now, then every [`SOON`] for
    /// [`SOON_FOR`].
    pub fn wake_candidates(&self) {
        self.candidates_due.notify_one();
    }
}

/// Refreshes the candidates every `every` until `shutdown`, and soon (then every [`SOON`] for
/// [`SOON_FOR`]) after a new induced TunnelEndpoint is written. Never with a zero period: the
/// task then only waits, since a service's task that ends stops the service.
pub async fn run(broker: Arc<Broker>, every: Duration, shutdown: Shutdown) {
    if every.is_zero() {
        return shutdown.cancelled().await;
    }
    let refresh = || async {
        if let Err(err) = broker.refresh_candidates().await {
            tracing::warn!(error = %err, "refreshing the induced peers' candidates");
        }
    };
    schedule(every, &broker.candidates_due, &shutdown, refresh).await;
}

/// When [`run`] refreshes: after `every`, or [`SOON`] after the last refresh while a wake on
/// `due` is under [`SOON_FOR`] old. A wake never refreshes sooner than [`SOON`] after the last
/// refresh: while a mesh sets up, induced TunnelEndpoints arrive by the hundred, and a refresh
/// for each (every tunnel read, the hub asked about every peer) made the work per leaf grow
/// with the square of its peers.
async fn schedule<F, Fut>(
    every: Duration,
    due: &tokio::sync::Notify,
    shutdown: &Shutdown,
    refresh: F,
) where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut soon_until: Option<Instant> = None;
    let mut last = Instant::now();
    loop {
        let soon = soon_until.is_some_and(|until| Instant::now() < until);
        let next = last + if soon { every.min(SOON) } else { every };
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = trellis_runtime::timer::until(next) => {}
            () = due.notified() => {
                soon_until = Some(Instant::now() + SOON_FOR);
                let at = last + SOON;
                if at > Instant::now() {
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = trellis_runtime::timer::until(at) => {}
                    }
                }
            }
        }
        refresh().await;
        last = Instant::now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use trellis_api::model::{NatView, NetworkSpec, WgKey};

    fn induced_tunnel(endpoint: &str) -> TunnelEndpoint {
        let spec = |endpoint: &str, key: u8| NetworkSpec {
            pod_cidr: "10.0.0.0/16".parse().expect("net"),
            external_cidr: "10.201.0.0/16".parse().expect("net"),
            endpoint: endpoint.parse().expect("endpoint"),
            public_key: WgKey::from_bytes([key; 32]),
            stateless_wire: false,
        };
        let view = NatView {
            pod_cidr_nat: "10.0.0.0/16".parse().expect("net"),
            external_cidr_nat: "10.201.0.0/16".parse().expect("net"),
        };
        let identity = |id: &str| ClusterIdentity::parse("id", id, "name", id).expect("identity");
        TunnelEndpoint::merge(
            identity("c"),
            Some(identity("b")),
            (&spec("192.0.2.1:51840", 1), view),
            (&spec(endpoint, 3), view),
            1,
        )
    }

    /// Counts the refreshes [`schedule`] makes while `wakes` wakes arrive, one every `gap`.
    async fn refreshes_under(every: Duration, wakes: u32, gap: Duration, then: Duration) -> usize {
        let due = tokio::sync::Notify::new();
        let shutdown = Shutdown::new();
        let count = std::sync::atomic::AtomicUsize::new(0);
        let refresh = || async {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        };
        let waker = async {
            for _ in 0..wakes {
                trellis_runtime::timer::period(gap).await;
                due.notify_one();
            }
            trellis_runtime::timer::period(then).await;
            shutdown.cancel();
        };
        tokio::join!(schedule(every, &due, &shutdown, refresh), waker);
        count.load(std::sync::atomic::Ordering::SeqCst)
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_of_new_tunnels_refreshes_once_a_second() {
        // 300 new tunnels in 3 s (one every 10 ms), then quiet for 10 s: a refresh per second
        // during the burst and for SOON_FOR after the last wake, not one per tunnel.
        let every = Duration::from_secs(300);
        let refreshes = refreshes_under(
            every,
            300,
            Duration::from_millis(10),
            Duration::from_secs(10),
        )
        .await;
        assert!((10..=14).contains(&refreshes), "{refreshes} refreshes");
    }

    #[tokio::test(start_paused = true)]
    async fn without_wakes_it_refreshes_at_its_period_and_a_wake_is_soon() {
        let every = Duration::from_secs(5);
        assert_eq!(
            refreshes_under(every, 0, Duration::ZERO, Duration::from_secs(21)).await,
            4
        );
        // One wake after 2 s (3 s since the last refresh): refreshed at once, then each second.
        let refreshes = refreshes_under(
            every,
            1,
            Duration::from_secs(2),
            Duration::from_millis(2500),
        )
        .await;
        assert_eq!(refreshes, 3);
    }

    #[test]
    fn the_advertised_endpoint_is_no_candidate() {
        let mut tunnel = induced_tunnel("192.0.2.3:51840");
        assert!(wanted(&tunnel, None).is_empty());
        let same: SocketAddr = "192.0.2.3:51840".parse().expect("addr");
        assert!(wanted(&tunnel, Some(same)).is_empty());
        let mapped: SocketAddr = "198.51.100.3:40002".parse().expect("addr");
        assert_eq!(wanted(&tunnel, Some(mapped)), vec![mapped]);
        tunnel.remote_candidates = vec![mapped];
        assert_eq!(wanted(&tunnel, Some(mapped)), tunnel.remote_candidates);
    }
}
