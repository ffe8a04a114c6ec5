//! One fresh fabric, timed: the hub and every leaf started but not peered; a prober in every
//! leaf's pod (`probe.py`) sending to every other leaf's pod every 10 ms; a watch on every
//! leaf's TunnelEndpoints; then the peering. Per unordered leaf pair, t0 is the earlier of the
//! moments the two brokers wrote their induced TunnelEndpoint for each other (when the
//! benchmark's watch received it) and t1 the arrival of the first probe of either pod at the
//! other (the receiver's clock); both are CLOCK_REALTIME on the same machine.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail, ensure};
use serde::Deserialize;
use tonic::transport::Channel;
use trellis_api::pb::gateway::{GetTunnelStatusRequest, TunnelPath};
use trellis_api::pb::peering::WatchTunnelEndpointsRequest;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::types::{PeeringKind, WatchEventType};
use trellis_integration::failover::{PodProcess, python_in};
use trellis_netlab::{Fabric, FabricOptions, NatKind, StoreKind};

use super::{Settings, layout, paths, pod_cidr};
use crate::results::{LeafTimes, NatRepeat, PairSample};

/// The prober (see its docstring).
const PROBE: &str = include_str!("probe.py");
/// The UDP port every prober listens and sends on.
const PORT: u16 = 7600;
/// Python takes a moment to start on a loaded machine; the peering waits for every prober.
const READY_LIMIT: Duration = Duration::from_secs(30);

/// Seconds since the epoch, CLOCK_REALTIME: the clock the probers stamp with too.
fn wall() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// What the watches saw: when each leaf's broker first held an induced TunnelEndpoint for each
/// remote cluster.
#[derive(Debug, Default)]
struct Tunnels {
    /// (leaf index, remote cluster ID) → wall-clock seconds.
    at: BTreeMap<(usize, String), f64>,
    /// The same for the first version carrying candidates (where the hub sees the remote).
    candidates_at: BTreeMap<(usize, String), f64>,
    /// Leaves whose watch has delivered its snapshot.
    watching: BTreeSet<usize>,
    /// Streams that ended and were opened again (their events in between arrive late).
    restarts: usize,
}

/// Follows leaf `i`'s TunnelEndpoints until aborted, stamping each induced one when first seen.
/// A push from the broker's store watch: no polling, and the stamp is taken as the event
/// arrives (milliseconds after the write on this machine).
async fn follow(i: usize, client: BrokerClient<Channel>, seen: Arc<Mutex<Tunnels>>) {
    loop {
        let watched = async {
            let mut stream = client
                .clone()
                .watch_tunnel_endpoints(WatchTunnelEndpointsRequest { start_revision: 0 })
                .await?
                .into_inner();
            while let Some(event) = stream.message().await? {
                let at = wall();
                let Ok(mut s) = seen.lock() else {
                    return anyhow::Ok(());
                };
                match WatchEventType::try_from(event.r#type) {
                    Ok(WatchEventType::Bookmark) => {
                        s.watching.insert(i);
                    }
                    Ok(WatchEventType::Added | WatchEventType::Modified) => {
                        if let Some(te) = event.tunnel_endpoint.as_ref()
                            && te.kind == PeeringKind::Induced as i32
                            && let Some(remote) = te.remote.as_ref()
                        {
                            s.at.entry((i, remote.cluster_id.clone())).or_insert(at);
                            if !te.remote_candidates.is_empty() {
                                s.candidates_at
                                    .entry((i, remote.cluster_id.clone()))
                                    .or_insert(at);
                            }
                        }
                    }
                    _ => {}
                }
            }
            anyhow::Ok(())
        };
        let _ = watched.await;
        if let Ok(mut s) = seen.lock() {
            s.restarts += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What a prober wrote (the fields the benchmark reads).
#[derive(Debug, Clone, Deserialize)]
struct ProbeSummary {
    heard: BTreeMap<String, Heard>,
    targets: BTreeMap<String, Target>,
}

#[derive(Debug, Clone, Deserialize)]
struct Heard {
    /// When the sender's first query arrived.
    first: f64,
}

#[derive(Debug, Clone, Deserialize)]
struct Target {
    first_reply: Option<f64>,
    sent_after_first: u64,
    lost_after_first: u64,
    max_gap_after_first_ms: f64,
}

/// The probers of every leaf pod, killed on drop.
struct Probes {
    running: Vec<PodProcess>,
    /// Leaf name → its summary file.
    results: BTreeMap<String, PathBuf>,
    ready: Vec<PathBuf>,
    stop: PathBuf,
}

impl Probes {
    /// Starts one prober in the pod of each of `leaves`, sending to every other leaf's pod at
    /// its own address (the pod CIDRs are distinct, nobody remaps them).
    fn start(
        fabric: &Fabric,
        names: &[String],
        leaves: &[usize],
        dir: &Path,
    ) -> anyhow::Result<Self> {
        let script = dir.join("probe.py");
        std::fs::write(&script, PROBE)?;
        let stop = dir.join("stop");
        let mut this = Self {
            running: Vec::new(),
            results: BTreeMap::new(),
            ready: Vec::new(),
            stop: stop.clone(),
        };
        for &i in leaves {
            let name = &names[i];
            let ready = dir.join(format!("{name}.ready"));
            let result = dir.join(format!("{name}.json"));
            let mut args = vec![
                "run".to_owned(),
                PORT.to_string(),
                name.clone(),
                ready.display().to_string(),
                stop.display().to_string(),
                result.display().to_string(),
            ];
            args.extend(
                leaves
                    .iter()
                    .filter(|&&j| j != i)
                    .map(|&j| format!("{}={}", names[j], fabric.topology.sites[j].pod_ip)),
            );
            this.running
                .push(python_in(&fabric.topology.sites[i].pod_ns, &script, &args)?);
            this.results.insert(name.clone(), result);
            this.ready.push(ready);
        }
        Ok(this)
    }

    /// Returns once every prober has bound its socket.
    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let started = Instant::now();
        while !self.ready.iter().all(|r| r.exists()) {
            for p in &mut self.running {
                if let Some(status) = p.0.try_wait()? {
                    bail!("a prober exited before it was ready: {status}");
                }
            }
            ensure!(
                started.elapsed() < READY_LIMIT,
                "the probers were not ready within {READY_LIMIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// The summaries written so far (a prober that has not written one yet is missing).
    fn read(&self) -> BTreeMap<String, ProbeSummary> {
        self.results
            .iter()
            .filter_map(|(name, path)| {
                let text = std::fs::read(path).ok()?;
                Some((name.clone(), serde_json::from_slice(&text).ok()?))
            })
            .collect()
    }

    /// Stops the probers and returns their last summaries.
    async fn stop(&mut self) -> anyhow::Result<BTreeMap<String, ProbeSummary>> {
        std::fs::write(&self.stop, b"").context("writing the probes' stop file")?;
        let asked = Instant::now();
        for p in &mut self.running {
            while p.0.try_wait()?.is_none() {
                ensure!(
                    asked.elapsed() < Duration::from_secs(10),
                    "a prober did not stop"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let read = self.read();
        ensure!(
            read.len() == self.results.len(),
            "{} of {} probers wrote no summary",
            self.results.len() - read.len(),
            self.results.len()
        );
        Ok(read)
    }
}

/// Whether every pair has had a reply in at least one direction.
fn all_answered(summaries: &BTreeMap<String, ProbeSummary>, pairs: &[(&str, &str)]) -> bool {
    pairs
        .iter()
        .all(|(a, c)| reply(summaries, a, c).is_some() || reply(summaries, c, a).is_some())
}

/// When `from`'s prober got its first reply from `to`.
fn reply(summaries: &BTreeMap<String, ProbeSummary>, from: &str, to: &str) -> Option<f64> {
    summaries.get(from)?.targets.get(to)?.first_reply
}

/// When `from`'s first query arrived at `to`'s prober.
fn arrival(summaries: &BTreeMap<String, ProbeSummary>, from: &str, to: &str) -> Option<f64> {
    Some(summaries.get(to)?.heard.get(from)?.first)
}

/// The path `i`'s gateway reports for its tunnel to `j`: `direct`, `relayed`, `none` (no
/// tunnel or no handshake yet), `unknown`, or `unanswered` (the gateway did not answer within
/// 2 s).
pub(super) async fn path_of(fabric: &Fabric, i: usize, j: usize) -> &'static str {
    let Ok(mut gateway) = fabric.clusters[i].gateway() else {
        return "unanswered";
    };
    let asked = gateway.get_tunnel_status(GetTunnelStatusRequest {
        cluster_id: fabric.clusters[j].id.clone(),
    });
    let Ok(Ok(answer)) = tokio::time::timeout(Duration::from_secs(2), asked).await else {
        return "unanswered";
    };
    let Some(tunnel) = answer.into_inner().tunnel else {
        return "none";
    };
    if tunnel.last_handshake_time.is_none() {
        return "none";
    }
    match TunnelPath::try_from(tunnel.path) {
        Ok(TunnelPath::Direct) => "direct",
        Ok(TunnelPath::Relayed) => "relayed",
        _ => "unknown",
    }
}

/// The path both gateways of a pair agree on, or `mixed (a's/c's)`.
pub(super) async fn pair_path(fabric: &Fabric, a: usize, c: usize) -> String {
    let (there, back) = (path_of(fabric, a, c).await, path_of(fabric, c, a).await);
    if there == back {
        there.to_owned()
    } else {
        format!("mixed ({there}/{back})")
    }
}

/// When `i`'s gateway last completed a handshake with `j`, wall-clock seconds; `None` without
/// one.
async fn handshake_at(fabric: &Fabric, i: usize, j: usize) -> Option<f64> {
    let mut gateway = fabric.clusters[i].gateway().ok()?;
    let asked = gateway.get_tunnel_status(GetTunnelStatusRequest {
        cluster_id: fabric.clusters[j].id.clone(),
    });
    let answer = tokio::time::timeout(Duration::from_secs(2), asked)
        .await
        .ok()?
        .ok()?;
    let at = answer.into_inner().tunnel?.last_handshake_time?;
    Some(at.seconds as f64 + f64::from(at.nanos) / 1e9)
}

/// The datagrams cluster `i`'s gateway dropped at its WireGuard port, by reason, the ones with
/// any (`trellis_gateway_dropped_datagrams_total{reason}`, scraped from its default metrics
/// port inside its namespace); `None` when the scrape failed.
pub(super) fn gateway_drops(fabric: &Fabric, i: usize) -> Option<BTreeMap<String, f64>> {
    const SCRAPE: &str = "import urllib.request; \
        print(urllib.request.urlopen('http://127.0.0.1:9106/metrics', timeout=5).read().decode())";
    let out =
        trellis_netlab::netns::exec(&fabric.clusters[i].ns, "python3", &["-c", SCRAPE]).ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut drops = BTreeMap::new();
    for line in text.lines() {
        let Some(labels) = line.strip_prefix("trellis_gateway_dropped_datagrams_total{") else {
            continue;
        };
        let reason = labels
            .split("reason=\"")
            .nth(1)
            .and_then(|r| r.split('"').next());
        let count = line
            .split_whitespace()
            .last()
            .and_then(|c| c.parse::<f64>().ok());
        if let (Some(reason), Some(count)) = (reason, count)
            && count > 0.0
        {
            *drops.entry(reason.to_owned()).or_insert(0.0) += count;
        }
    }
    Some(drops)
}

/// Every pair's path, asked again for up to `limit` while any is not settled (the gateways'
/// status follows their counters a little behind the packets).
async fn settled_paths(
    fabric: &Fabric,
    pairs: &[(usize, usize)],
    limit: Duration,
) -> BTreeMap<(usize, usize), String> {
    let started = Instant::now();
    loop {
        let mut paths = BTreeMap::new();
        for &(a, c) in pairs {
            paths.insert((a, c), pair_path(fabric, a, c).await);
        }
        let settled = paths.values().all(|p| p == "direct" || p == "relayed");
        if settled || started.elapsed() > limit {
            return paths;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Builds a fabric (hub + `settings.leaves_per_kind` leaves per NAT kind), times every leaf
/// pair from its induced peering to its first pod-to-pod packet, reads the paths, then measures
/// RTT and throughput over a direct, a relayed and the leaf-to-hub paths ([`paths`]).
pub async fn repeat(settings: &Settings, r: usize) -> anyhow::Result<NatRepeat> {
    let (names, kinds) = layout(settings.leaves_per_kind);
    let mut options = FabricOptions::three_clusters();
    options.names = names.clone();
    options.hub = 0;
    // The brokers', IPAMs' and gateways' own state in memory: the figure is about the path
    // across the NATs, not the stores (mesh-bench measures those).
    options.store = StoreKind::Memory;
    options.nat = kinds.clone();
    options.pod_cidrs = (0..names.len()).map(pod_cidr).collect();
    let started = Instant::now();
    let fabric = Fabric::start(options)
        .await
        .context("starting the clusters")?;
    let setup_seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "nat-bench: repeat {r}: {} clusters started in {setup_seconds:.1} s",
        names.len()
    );

    let leaves: Vec<usize> = (1..names.len()).collect();
    let dir = tempfile::tempdir()?;
    let mut probes = Probes::start(&fabric, &names, &leaves, dir.path())?;
    probes.wait_ready().await?;
    let seen = Arc::new(Mutex::new(Tunnels::default()));
    let mut watches = Vec::new();
    for &i in &leaves {
        watches.push(tokio::spawn(follow(
            i,
            fabric.clusters[i].broker()?,
            seen.clone(),
        )));
    }
    let watch_started = Instant::now();
    while seen.lock().map_or(0, |s| s.watching.len()) < leaves.len() {
        ensure!(
            watch_started.elapsed() < READY_LIMIT,
            "the brokers' watches did not start within {READY_LIMIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The clock starts: everything that measures is in place before the first peering.
    let peer_wall = wall();
    let peer_clock = Instant::now();
    // Each leaf with the hub in turn, as `Fabric::peer_leaves` does, stamping each.
    let mut peered = BTreeMap::new();
    for &i in &leaves {
        fabric
            .peer(i, fabric.hub)
            .await
            .with_context(|| format!("peering {} with the hub", names[i]))?;
        peered.insert(i, wall());
    }
    fabric
        .wait_mesh(settings.mesh_timeout)
        .await
        .context("waiting for the induced mesh")?;
    let mesh_seconds = peer_clock.elapsed().as_secs_f64();
    eprintln!(
        "nat-bench: repeat {r}: induced mesh of {} leaves in {mesh_seconds:.1} s",
        leaves.len()
    );
    // The probes aim at each pod's own address: every cluster must address every other's pod
    // CIDR as it is.
    for &a in &leaves {
        for &c in &leaves {
            if a != c {
                let view = fabric.view(a, c, false).await?;
                let own = fabric.topology.sites[c].pod_cidr;
                ensure!(
                    view == own,
                    "{} addresses {}'s pod CIDR {own} as {view}: the probes went to the wrong \
                     address",
                    names[a],
                    names[c]
                );
            }
        }
    }

    let pairs: Vec<(usize, usize)> = leaves
        .iter()
        .flat_map(|&a| leaves.iter().filter(move |&&c| c > a).map(move |&c| (a, c)))
        .collect();
    let named: Vec<(&str, &str)> = pairs
        .iter()
        .map(|&(a, c)| (names[a].as_str(), names[c].as_str()))
        .collect();
    loop {
        if all_answered(&probes.read(), &named) {
            break;
        }
        if peer_clock.elapsed() > settings.probe_timeout {
            eprintln!(
                "nat-bench: repeat {r}: some pairs had no reply within {:?} of the peering",
                settings.probe_timeout
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    tokio::time::sleep(settings.settle).await;
    let summaries = probes.stop().await?;
    for w in &watches {
        w.abort();
    }
    let (tunnel_at, candidates_at, restarts) = seen
        .lock()
        .map(|s| (s.at.clone(), s.candidates_at.clone(), s.restarts))
        .unwrap_or_default();
    if restarts > 0 {
        eprintln!(
            "nat-bench: repeat {r}: {restarts} watch streams were interrupted: their tunnels may \
             be stamped late"
        );
    }
    let paths_by_pair = settled_paths(&fabric, &pairs, Duration::from_secs(10)).await;
    // The hub's session with each leaf: no rekey is due within the first two minutes of a
    // session, so its last handshake is its first one here.
    // Every gateway's drops so far: the grid is what they saw (nothing else has run yet).
    let mut drops = BTreeMap::new();
    for (i, name) in names.iter().enumerate() {
        if let Some(d) = gateway_drops(&fabric, i) {
            drops.insert(name.clone(), d);
        }
    }
    let hub_unknown_peer_drops = drops
        .get(&names[fabric.hub])
        .map(|d| d.get("unknown_peer").copied().unwrap_or(0.0));
    let mut leaf_times = Vec::new();
    for &i in &leaves {
        leaf_times.push(LeafTimes {
            name: names[i].clone(),
            kind: kinds[i].as_str().to_owned(),
            peered_at_ms: peered.get(&i).map(|t| (t - peer_wall) * 1000.0),
            hub_handshake_at_ms: handshake_at(&fabric, fabric.hub, i)
                .await
                .map(|t| (t - peer_wall) * 1000.0),
        });
    }

    let ms = |t: Option<f64>| t.map(|t| (t - peer_wall) * 1000.0);
    let mut samples = Vec::new();
    for &(a, c) in &pairs {
        let (an, cn) = (names[a].as_str(), names[c].as_str());
        let a_tunnel = tunnel_at.get(&(a, cn.to_owned())).copied();
        let c_tunnel = tunnel_at.get(&(c, an.to_owned())).copied();
        let t0 = [a_tunnel, c_tunnel].into_iter().flatten().reduce(f64::min);
        let (a_candidates, c_candidates) = (
            candidates_at.get(&(a, cn.to_owned())).copied(),
            candidates_at.get(&(c, an.to_owned())).copied(),
        );
        let (to_c, to_a) = (arrival(&summaries, an, cn), arrival(&summaries, cn, an));
        let (first_packet, direction) = match (to_c, to_a) {
            (Some(x), Some(y)) if y < x => (Some(y), Some("c>a")),
            (Some(x), _) => (Some(x), Some("a>c")),
            (None, Some(y)) => (Some(y), Some("c>a")),
            (None, None) => (None, None),
        };
        let first_echo = [reply(&summaries, an, cn), reply(&summaries, cn, an)]
            .into_iter()
            .flatten()
            .reduce(f64::min);
        let after: Vec<&Target> = [(an, cn), (cn, an)]
            .iter()
            .filter_map(|(x, y)| summaries.get(*x)?.targets.get(*y))
            .collect();
        let since_t0 = |t: Option<f64>| Some((t? - t0?) * 1000.0);
        samples.push(PairSample {
            a: an.to_owned(),
            c: cn.to_owned(),
            a_kind: kinds[a].as_str().to_owned(),
            c_kind: kinds[c].as_str().to_owned(),
            a_tunnel_at_ms: ms(a_tunnel),
            c_tunnel_at_ms: ms(c_tunnel),
            a_candidates_at_ms: ms(a_candidates),
            c_candidates_at_ms: ms(c_candidates),
            first_packet_at_ms: ms(first_packet),
            first_direction: direction.map(str::to_owned),
            first_echo_at_ms: ms(first_echo),
            first_packet_ms: since_t0(first_packet),
            first_echo_ms: since_t0(first_echo),
            sent_after_first: after.iter().map(|t| t.sent_after_first).sum(),
            lost_after_first: after.iter().map(|t| t.lost_after_first).sum(),
            max_gap_after_first_ms: after
                .iter()
                .map(|t| t.max_gap_after_first_ms)
                .fold(0.0, f64::max),
            path: paths_by_pair
                .get(&(a, c))
                .cloned()
                .unwrap_or_else(|| "none".into()),
        });
    }
    let grid_seconds = samples
        .iter()
        .filter_map(|s| s.first_packet_at_ms)
        .fold(0.0, f64::max)
        / 1000.0;
    let reached = samples
        .iter()
        .filter(|s| s.first_packet_ms.is_some())
        .count();
    eprintln!(
        "nat-bench: repeat {r}: {reached} of {} pairs through, the last {grid_seconds:.1} s after \
         the first peering",
        samples.len()
    );
    drop(probes);

    let paths = paths::measure(&fabric, settings, &names, &kinds).await?;
    let _ = fabric;
    Ok(NatRepeat {
        repeat: r,
        setup_seconds,
        mesh_seconds,
        grid_seconds,
        leaves: leaf_times,
        hub_unknown_peer_drops,
        gateway_drops: drops,
        pairs: samples,
        paths,
    })
}

/// The index of the `n`-th (from 1) leaf behind `kind` in a [`layout`].
pub(super) fn leaf(kinds: &[NatKind], kind: NatKind, n: usize) -> Option<usize> {
    kinds
        .iter()
        .enumerate()
        .skip(1)
        .filter(|(_, k)| **k == kind)
        .nth(n.checked_sub(1)?)
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaves_are_found_by_kind_and_rank_never_the_hub() {
        let (_, kinds) = layout(2);
        assert_eq!(leaf(&kinds, NatKind::None, 1), Some(1));
        assert_eq!(leaf(&kinds, NatKind::Easy, 2), Some(7));
        assert_eq!(leaf(&kinds, NatKind::Hard, 3), None);
        assert_eq!(leaf(&kinds, NatKind::Hard, 0), None);
    }

    #[test]
    fn a_pair_counts_as_answered_by_a_reply_either_way() {
        let summary = |targets: serde_json::Value| -> ProbeSummary {
            serde_json::from_value(
                serde_json::json!({"name": "x", "heard": {}, "targets": targets}),
            )
            .expect("a summary")
        };
        let t = |first: Option<f64>| {
            serde_json::json!({"first_reply": first, "sent_after_first": 0, "lost_after_first": 0,
                               "max_gap_after_first_ms": 0.0})
        };
        let mut s = BTreeMap::new();
        s.insert("a".to_owned(), summary(serde_json::json!({"c": t(None)})));
        s.insert(
            "c".to_owned(),
            summary(serde_json::json!({"a": t(Some(5.0))})),
        );
        assert!(all_answered(&s, &[("a", "c")]));
        s.insert("c".to_owned(), summary(serde_json::json!({"a": t(None)})));
        assert!(!all_answered(&s, &[("a", "c")]));
    }
}
