//! Forming the mesh: every leaf peers with the hub through the brokers (token handshake), then
//! the lab watches the TunnelEndpoints every broker lists until each leaf has one for the hub
//! and, with induced peering, one for every other leaf.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context as _, bail};
use futures::StreamExt as _;
use tonic::transport::Channel;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::{GetTokenRequest, ListTunnelEndpointsRequest, PeerRequest};
use trellis_api::pb::types::{PeeringKind, TunnelEndpoint};

use trellis_runtime::retry::{RetryPolicy, Retryable as _, retry};

use crate::plan::{ClusterPlan, Role};

/// Peer requests in flight at once (the hub's broker handles each with a few store writes).
const PEER_CONCURRENCY: usize = 16;

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

    fn len(&self) -> usize {
        self.brokers.len()
    }
}

/// Lists every broker's TunnelEndpoints (concurrently; a cluster whose broker does not answer
/// counts as having none yet).
pub async fn snapshot(brokers: &Brokers) -> Snapshot {
    let listed: Vec<(String, Vec<TunnelEndpoint>)> =
        futures::stream::iter(brokers.brokers.iter().map(|(id, client)| async move {
            let tunnels = client
                .clone()
                .list_tunnel_endpoints(ListTunnelEndpointsRequest::default())
                .await
                .map(|r| r.into_inner().tunnel_endpoints)
                .unwrap_or_default();
            (id.clone(), tunnels)
        }))
        .buffer_unordered(PEER_CONCURRENCY)
        .collect()
        .await;
    Snapshot {
        tunnels: listed.into_iter().collect(),
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

/// Polls until the mesh is complete or `timeout` passes; `progress` sees every change.
pub async fn converge(
    brokers: &Brokers,
    expected: &Expected,
    timeout: Duration,
    mut on_change: impl FnMut(&Progress),
) -> anyhow::Result<Snapshot> {
    let deadline = tokio::time::Instant::now() + timeout;
    // Listing is O(clusters²) TunnelEndpoints; poll big labs less often.
    let interval = Duration::from_millis(100 + 4 * brokers.len() as u64);
    let mut last = None;
    loop {
        let snap = snapshot(brokers).await;
        let progress = expected.progress(&snap);
        if last != Some(progress) {
            on_change(&progress);
            last = Some(progress);
        }
        if progress.complete() {
            return Ok(snap);
        }
        if tokio::time::Instant::now() >= deadline {
            let missing = expected.missing(&snap, 5);
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
        tokio::time::sleep(interval).await;
    }
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
    fn ten_clusters_want_nine_times_eight_induced_tunnels() {
        let clusters = plan(10, true, 0, false).expect("plan");
        let p = Expected::new(&clusters, true).progress(&Snapshot::default());
        assert_eq!(p.induced_wanted, 9 * 8);
        assert_eq!(p.full_wanted, 2 * 9);
    }
}
