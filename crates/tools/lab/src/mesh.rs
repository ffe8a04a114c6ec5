//! Forming the mesh: every leaf peers with the hub through the brokers (token handshake), then
//! the lab follows every broker's TunnelEndpoints (a watch each) until each leaf has one for
//! the hub and, with induced peering, one for every other leaf. (It listed every broker once
//! a second before: at 255 clusters each round listed 64,000 tunnels, took about 5 s and took
//! CPU from the mesh it waited for.)

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, bail};
use futures::StreamExt as _;
use tonic::transport::Channel;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::{GetTokenRequest, PeerRequest, WatchTunnelEndpointsRequest};
use trellis_api::pb::types::{PeeringKind, TunnelEndpoint, WatchEventType};

use trellis_runtime::retry::{RetryPolicy, Retryable as _, retry};

use crate::plan::{ClusterPlan, Role};

/// Peer requests in flight at once: every leaf of the largest lab, as mesh-bench sends them.
/// (16 at a time took 16 s to peer 254 leaves, while the mesh waited for its last leaves.)
const PEER_CONCURRENCY: usize = 256;

/// How one leaf's Peer request is sent again after a transient failure: 1 s doubling to 8 s,
/// six attempts in all.
const PEER_RETRY: RetryPolicy =
    RetryPolicy::exponential(Duration::from_secs(1), Duration::from_secs(8)).with_max_attempts(6);

async fn broker(addr: SocketAddr) -> anyhow::Result<BrokerClient<Channel>> {
    let channel = Channel::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(30))
        .connect()
        .await
        .with_context(|| format!("cannot reach the broker at {addr}"))?;
    Ok(BrokerClient::new(channel))
}

/// Peers every leaf with the hub; `progress` is told how many are done.
pub async fn peer_leaves(
    clusters: &[ClusterPlan],
    mut progress: impl FnMut(usize, usize),
) -> anyhow::Result<()> {
    let hub = clusters
        .iter()
        .find(|c| c.role == Role::Hub)
        .context("the lab has no hub")?;
    let answer = broker(hub.ports.broker)
        .await?
        .get_token(GetTokenRequest {})
        .await
        .context("asking the hub's broker for its token")?
        .into_inner();
    // With mutual TLS the leaves pin the hub's CA before first contact, as a join command does.
    let (token, ca_cert_hash) = (answer.token, answer.ca_cert_hash);
    let leaves: Vec<_> = clusters.iter().filter(|c| c.role == Role::Leaf).collect();
    let total = leaves.len();
    // With mutual TLS the leaves handshake with the hub's peer listener.
    let hub_broker = hub.facing_broker().to_string();
    let mut done = 0;
    let mut results = futures::stream::iter(leaves.into_iter().map(|leaf| {
        let request = PeerRequest {
            broker_address: hub_broker.clone(),
            token: token.clone(),
            expected_cluster_id: hub.id.clone(),
            ca_cert_hash: ca_cert_hash.clone(),
        };
        async move {
            let client = broker(leaf.ports.broker).await?;
            // On a loaded machine the hub's handshake can time out (UNAVAILABLE) while hundreds
            // of clusters start; an operator would run the command again, and so does the lab,
            // a few times, on the workspace's retry policy.
            let mut attempts = 0;
            retry(&PEER_RETRY, None, || {
                attempts += 1;
                let last = PEER_RETRY.gives_up_after(attempts);
                let mut client = client.clone();
                let request = request.clone();
                async move {
                    let answer = client.peer(request).await;
                    if let Err(status) = &answer
                        && status.is_transient()
                        && !last
                    {
                        tracing::warn!(
                            leaf = %leaf.id,
                            code = ?status.code(),
                            error = %status.message(),
                            "peering failed for now; asking again"
                        );
                    }
                    answer
                }
            })
            .await
            .with_context(|| format!("peering {} with the hub", leaf.id))?;
            anyhow::Ok(())
        }
    }))
    .buffer_unordered(PEER_CONCURRENCY);
    while let Some(result) = results.next().await {
        result?;
        done += 1;
        progress(done, total);
    }
    Ok(())
}

/// The TunnelEndpoints of every cluster at one moment, by cluster ID.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub tunnels: BTreeMap<String, Vec<TunnelEndpoint>>,
}

/// Every cluster's broker, by cluster ID, on channels that connect on first use and are kept
/// for every later poll.
#[derive(Debug, Clone)]
pub struct Brokers {
    brokers: Vec<(String, BrokerClient<Channel>)>,
}

impl Brokers {
    /// Brokers listening on this machine's loopback (`--dataplane none`).
    pub fn on_loopback(clusters: &[ClusterPlan]) -> anyhow::Result<Self> {
        let brokers = clusters
            .iter()
            .map(|c| {
                let channel = Channel::from_shared(format!("http://{}", c.ports.broker))?
                    .connect_timeout(Duration::from_secs(5))
                    .timeout(Duration::from_secs(30))
                    .connect_lazy();
                Ok((c.id.clone(), BrokerClient::new(channel)))
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self { brokers })
    }

    /// Brokers reached through channels of the caller's making (inside namespaces).
    pub fn new(brokers: Vec<(String, Channel)>) -> Self {
        Self {
            brokers: brokers
                .into_iter()
                .map(|(id, channel)| (id, BrokerClient::new(channel)))
                .collect(),
        }
    }
}

/// Who must have a TunnelEndpoint for whom once the mesh is up.
#[derive(Debug, Clone)]
pub struct Expected {
    /// (holder, remote, kind).
    pub wanted: BTreeSet<(String, String, Kind)>,
}

/// The kind of a tunnel, as the lab counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Full,
    Induced,
}

impl Kind {
    fn of(t: &TunnelEndpoint) -> Option<Self> {
        match PeeringKind::try_from(t.kind).ok()? {
            PeeringKind::Full => Some(Self::Full),
            PeeringKind::Induced => Some(Self::Induced),
            PeeringKind::Unspecified => None,
        }
    }
}

impl Expected {
    /// Full tunnels hub↔leaf both ways; with induced peering, induced tunnels leaf↔leaf.
    pub fn new(clusters: &[ClusterPlan], induced: bool) -> Self {
        let mut wanted = BTreeSet::new();
        let leaves: Vec<_> = clusters.iter().filter(|c| c.role == Role::Leaf).collect();
        for hub in clusters.iter().filter(|c| c.role == Role::Hub) {
            for leaf in &leaves {
                wanted.insert((hub.id.clone(), leaf.id.clone(), Kind::Full));
                wanted.insert((leaf.id.clone(), hub.id.clone(), Kind::Full));
            }
        }
        if induced {
            for a in &leaves {
                for c in &leaves {
                    if a.id != c.id {
                        wanted.insert((a.id.clone(), c.id.clone(), Kind::Induced));
                    }
                }
            }
        }
        Self { wanted }
    }

    fn wants(&self, holder: &str, remote: &str, kind: Kind) -> bool {
        self.wanted
            .contains(&(holder.to_owned(), remote.to_owned(), kind))
    }

    /// How far `snapshot` is: (full present, full wanted, induced present, induced wanted).
    pub fn progress(&self, snapshot: &Snapshot) -> Progress {
        let present = present(snapshot);
        let mut p = Progress::default();
        for want in &self.wanted {
            let have = present.contains(want);
            match want.2 {
                Kind::Full => {
                    p.full_wanted += 1;
                    p.full += usize::from(have);
                }
                Kind::Induced => {
                    p.induced_wanted += 1;
                    p.induced += usize::from(have);
                }
            }
        }
        p
    }

    /// What is still missing, for the timeout message (at most `limit` entries).
    pub fn missing(&self, snapshot: &Snapshot, limit: usize) -> Vec<String> {
        let present = present(snapshot);
        self.wanted
            .iter()
            .filter(|w| !present.contains(*w))
            .take(limit)
            .map(|(holder, remote, kind)| {
                format!("{holder} has no {kind:?} tunnel to {remote}").to_lowercase()
            })
            .collect()
    }
}

fn present(snapshot: &Snapshot) -> BTreeSet<(String, String, Kind)> {
    snapshot
        .tunnels
        .iter()
        .flat_map(|(holder, tunnels)| {
            tunnels.iter().filter_map(move |t| {
                Some((
                    holder.clone(),
                    t.remote.as_ref()?.cluster_id.clone(),
                    Kind::of(t)?,
                ))
            })
        })
        .collect()
}

/// Counts of present and wanted tunnels.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    pub full: usize,
    pub full_wanted: usize,
    pub induced: usize,
    pub induced_wanted: usize,
}

impl Progress {
    pub fn complete(&self) -> bool {
        self.full == self.full_wanted && self.induced == self.induced_wanted
    }
}

/// What the followed brokers hold right now, and how far that is from [`Expected`]: kept
/// current event by event, so neither a change nor the progress costs a listing.
#[derive(Debug)]
struct Held {
    /// By holder, then by remote cluster ID.
    tunnels: BTreeMap<String, BTreeMap<String, TunnelEndpoint>>,
    progress: Progress,
    /// When the last full tunnel appeared (first time all were up).
    full_at: Option<tokio::time::Instant>,
}

impl Held {
    fn new(expected: &Expected) -> Self {
        let mut progress = Progress::default();
        for (_, _, kind) in &expected.wanted {
            match kind {
                Kind::Full => progress.full_wanted += 1,
                Kind::Induced => progress.induced_wanted += 1,
            }
        }
        Self {
            tunnels: BTreeMap::new(),
            progress,
            full_at: None,
        }
    }

    /// Counts `(holder, remote, kind)` in or out of the progress, when it is wanted.
    fn count(
        &mut self,
        expected: &Expected,
        holder: &str,
        remote: &str,
        kind: Option<Kind>,
        up: bool,
    ) {
        let Some(kind) = kind.filter(|k| expected.wants(holder, remote, *k)) else {
            return;
        };
        let counter = match kind {
            Kind::Full => &mut self.progress.full,
            Kind::Induced => &mut self.progress.induced,
        };
        if up {
            *counter += 1;
        } else {
            *counter -= 1;
        }
    }

    /// `holder` now holds `tunnel` for `remote` (`None`: nothing).
    fn set(
        &mut self,
        expected: &Expected,
        holder: &str,
        remote: &str,
        tunnel: Option<TunnelEndpoint>,
    ) {
        let held = self.tunnels.entry(holder.to_owned()).or_default();
        let before = match &tunnel {
            Some(t) => held.insert(remote.to_owned(), t.clone()),
            None => held.remove(remote),
        };
        let (was, now) = (
            before.as_ref().and_then(Kind::of),
            tunnel.as_ref().and_then(Kind::of),
        );
        if was != now {
            self.count(expected, holder, remote, was, false);
            self.count(expected, holder, remote, now, true);
        }
        if self.full_at.is_none() && self.progress.full == self.progress.full_wanted {
            self.full_at = Some(tokio::time::Instant::now());
        }
    }

    /// Forgets what `holder` held (its watch starts again from a snapshot).
    fn forget(&mut self, expected: &Expected, holder: &str) {
        let remotes: Vec<String> = self
            .tunnels
            .get(holder)
            .map(|t| t.keys().cloned().collect())
            .unwrap_or_default();
        for remote in remotes {
            self.set(expected, holder, &remote, None);
        }
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            tunnels: self
                .tunnels
                .iter()
                .map(|(holder, t)| (holder.clone(), t.values().cloned().collect()))
                .collect(),
        }
    }
}

/// How often at most the progress is reported while tunnels appear.
const REPORT_EVERY: Duration = Duration::from_secs(2);

/// Every broker's TunnelEndpoints, followed by a watch each (so a tunnel is seen when it is
/// written and nothing is listed again), from [`Following::start`] until dropped.
#[derive(Debug)]
pub struct Following {
    expected: Arc<Expected>,
    held: Arc<Mutex<Held>>,
    changed: Arc<tokio::sync::Notify>,
    /// Each broker's watch has delivered its snapshot (by index in the brokers).
    watching: Arc<Mutex<Vec<bool>>>,
    followers: Vec<tokio::task::AbortHandle>,
}

impl Drop for Following {
    fn drop(&mut self) {
        for follower in &self.followers {
            follower.abort();
        }
    }
}

impl Following {
    /// Starts a watch on every broker.
    pub fn start(brokers: &Brokers, expected: &Expected) -> Self {
        let expected = Arc::new(expected.clone());
        let held = Arc::new(Mutex::new(Held::new(&expected)));
        let changed = Arc::new(tokio::sync::Notify::new());
        let watching = Arc::new(Mutex::new(vec![false; brokers.brokers.len()]));
        let followers = brokers
            .brokers
            .iter()
            .enumerate()
            .map(|(index, (id, client))| {
                let follower = Follower {
                    holder: id.clone(),
                    index,
                    expected: expected.clone(),
                    held: held.clone(),
                    changed: changed.clone(),
                    watching: watching.clone(),
                };
                tokio::spawn(follower.run(client.clone())).abort_handle()
            })
            .collect();
        Self {
            expected,
            held,
            changed,
            watching,
            followers,
        }
    }

    /// Returns once every broker's watch has delivered its snapshot, or after `limit` (a
    /// broker that does not answer yet counts as holding nothing).
    pub async fn all_watching(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        while tokio::time::Instant::now() < deadline {
            if self.watching.lock().is_ok_and(|w| w.iter().all(|w| *w)) {
                return;
            }
            tokio::select! {
                () = self.changed.notified() => {}
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
    }

    fn read<T>(&self, f: impl FnOnce(&Held) -> T) -> anyhow::Result<T> {
        self.held
            .lock()
            .map(|h| f(&h))
            .map_err(|_| anyhow::anyhow!("a tunnel follower panicked"))
    }

    /// Waits until the mesh is complete or `timeout` passes. `on_change` sees the progress at
    /// most every [`REPORT_EVERY`] and when it completes; the answer holds the tunnels and
    /// when the last full tunnel appeared.
    pub async fn converge(
        &self,
        timeout: Duration,
        mut on_change: impl FnMut(&Progress),
    ) -> anyhow::Result<Converged> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last_reported: Option<(Progress, tokio::time::Instant)> = None;
        loop {
            let (progress, full_at) = self.read(|h| (h.progress, h.full_at))?;
            let due = last_reported.is_none_or(|(last, at)| {
                last != progress && (progress.complete() || at.elapsed() >= REPORT_EVERY)
            });
            if due {
                on_change(&progress);
                last_reported = Some((progress, tokio::time::Instant::now()));
            }
            if progress.complete() {
                return Ok(Converged {
                    snapshot: self.read(Held::snapshot)?,
                    full_at: full_at.map(tokio::time::Instant::into_std),
                });
            }
            if tokio::time::Instant::now() >= deadline {
                let missing = self.expected.missing(&self.read(Held::snapshot)?, 5);
                bail!(
                    "the mesh did not converge within {timeout:?}: {}/{} full and {}/{} induced \
                     tunnels; for example {}",
                    progress.full,
                    progress.full_wanted,
                    progress.induced,
                    progress.induced_wanted,
                    missing.join(", ")
                );
            }
            // Woken by a change, or in time to report one held back.
            tokio::select! {
                () = self.changed.notified() => {}
                () = tokio::time::sleep(REPORT_EVERY) => {}
            }
        }
    }
}

/// One broker's watch, feeding [`Following`].
struct Follower {
    holder: String,
    index: usize,
    expected: Arc<Expected>,
    held: Arc<Mutex<Held>>,
    changed: Arc<tokio::sync::Notify>,
    watching: Arc<Mutex<Vec<bool>>>,
}

impl Follower {
    /// Watches until aborted, from a fresh snapshot after every interruption.
    async fn run(self, client: BrokerClient<Channel>) {
        loop {
            if let Err(status) = self.watch(client.clone()).await {
                tracing::debug!(holder = %self.holder, code = ?status.code(), error = %status.message(), "tunnel watch ended; watching again");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn watch(&self, mut client: BrokerClient<Channel>) -> Result<(), tonic::Status> {
        let mut stream = client
            .watch_tunnel_endpoints(WatchTunnelEndpointsRequest { start_revision: 0 })
            .await?
            .into_inner();
        if let Ok(mut held) = self.held.lock() {
            held.forget(&self.expected, &self.holder);
        }
        while let Some(event) = stream.message().await? {
            let kind = WatchEventType::try_from(event.r#type);
            if kind == Ok(WatchEventType::Bookmark) {
                if let Ok(mut watching) = self.watching.lock() {
                    watching[self.index] = true;
                }
                self.changed.notify_one();
                continue;
            }
            let Some(tunnel) = event.tunnel_endpoint else {
                continue;
            };
            let Some(remote) = tunnel.remote.as_ref().map(|r| r.cluster_id.clone()) else {
                continue;
            };
            let tunnel = match kind {
                Ok(WatchEventType::Added | WatchEventType::Modified) => Some(tunnel),
                Ok(WatchEventType::Deleted) => None,
                _ => continue,
            };
            if let Ok(mut held) = self.held.lock() {
                held.set(&self.expected, &self.holder, &remote, tunnel);
            }
            self.changed.notify_one();
        }
        Ok(())
    }
}

/// A complete mesh: every broker's tunnels, and when every full tunnel was first up.
#[derive(Debug)]
pub struct Converged {
    pub snapshot: Snapshot,
    pub full_at: Option<std::time::Instant>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::plan;
    use trellis_api::pb::types::ClusterIdentity;

    fn te(remote: &str, kind: PeeringKind) -> TunnelEndpoint {
        TunnelEndpoint {
            remote: Some(ClusterIdentity {
                cluster_id: remote.into(),
                cluster_name: remote.into(),
            }),
            kind: kind as i32,
            ..Default::default()
        }
    }

    #[test]
    fn a_three_cluster_mesh_wants_four_full_and_two_induced_tunnels() {
        let clusters = plan(3, true, 0, false).expect("plan");
        let expected = Expected::new(&clusters, true);
        let mut snap = Snapshot::default();
        snap.tunnels.insert(
            "hub".into(),
            vec![
                te("leaf-1", PeeringKind::Full),
                te("leaf-2", PeeringKind::Full),
            ],
        );
        snap.tunnels.insert(
            "leaf-1".into(),
            vec![
                te("hub", PeeringKind::Full),
                te("leaf-2", PeeringKind::Induced),
            ],
        );
        // leaf-2's induced tunnel is missing, and a full tunnel does not count as induced.
        snap.tunnels.insert(
            "leaf-2".into(),
            vec![
                te("hub", PeeringKind::Full),
                te("leaf-1", PeeringKind::Full),
            ],
        );
        let p = expected.progress(&snap);
        assert_eq!(
            (p.full, p.full_wanted, p.induced, p.induced_wanted),
            (4, 4, 1, 2)
        );
        assert!(!p.complete());
        assert_eq!(
            expected.missing(&snap, 5),
            ["leaf-2 has no induced tunnel to leaf-1"]
        );
        let without = Expected::new(&clusters, false);
        assert!(without.progress(&snap).complete());
    }

    #[test]
    fn followed_events_keep_the_progress_that_a_listing_would_give() {
        let clusters = plan(4, true, 0, false).expect("plan");
        let expected = Expected::new(&clusters, true);
        let mut held = Held::new(&expected);
        let events: [(&str, &str, Option<PeeringKind>); 9] = [
            ("hub", "leaf-1", Some(PeeringKind::Full)),
            ("leaf-1", "hub", Some(PeeringKind::Full)),
            ("leaf-1", "leaf-2", Some(PeeringKind::Induced)),
            // The same tunnel again (modified): counted once.
            ("leaf-1", "leaf-2", Some(PeeringKind::Induced)),
            ("leaf-2", "leaf-1", Some(PeeringKind::Induced)),
            // A kind nobody wants there, then the wanted one in its place.
            ("leaf-3", "leaf-1", Some(PeeringKind::Full)),
            ("leaf-3", "leaf-1", Some(PeeringKind::Induced)),
            // Deleted.
            ("leaf-2", "leaf-1", None),
            // Something nobody wants at all.
            ("leaf-3", "elsewhere", Some(PeeringKind::Induced)),
        ];
        for (holder, remote, kind) in events {
            held.set(&expected, holder, remote, kind.map(|k| te(remote, k)));
            assert_eq!(
                held.progress,
                expected.progress(&held.snapshot()),
                "after {holder} -> {remote}"
            );
        }
        assert_eq!((held.progress.full, held.progress.induced), (2, 2));
        assert!(held.full_at.is_none(), "4 of 6 full tunnels are missing");
        // A watch that starts again forgets what its broker held.
        held.forget(&expected, "leaf-1");
        assert_eq!((held.progress.full, held.progress.induced), (1, 1));
        assert_eq!(held.progress, expected.progress(&held.snapshot()));
    }

    #[test]
    fn ten_clusters_want_nine_times_eight_induced_tunnels() {
        let clusters = plan(10, true, 0, false).expect("plan");
        let p = Expected::new(&clusters, true).progress(&Snapshot::default());
        assert_eq!(p.induced_wanted, 9 * 8);
        assert_eq!(p.full_wanted, 2 * 9);
    }
}
