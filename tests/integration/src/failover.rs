//! Gateway failover with real packets, shared by the failover tests and the failover
//! benchmark: which replica of a cluster is active, long-lived flows between pods (the
//! `flows.py` script: echoed TCP connections, connections on which only the server speaks, a
//! 10 ms UDP probe) and what they measured across a failover.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use ipnet::Ipv4Net;
use trellis_api::pb::gateway::{GetReplicaStatusRequest, GetReplicaStatusResponse};
use trellis_netlab::Fabric;

/// The flows script (see its docstring for the targets it takes).
pub const FLOWS: &str = include_str!("flows.py");

/// The port the flows server listens on (TCP and UDP).
pub const PORT: u16 = 7500;

/// The address a pod of cluster `from` uses for `to`'s pod `pod_ip`.
pub async fn address(
    fabric: &Fabric,
    from: usize,
    to: usize,
    pod_ip: Ipv4Addr,
) -> anyhow::Result<Ipv4Addr> {
    let view: Ipv4Net = fabric.view(from, to, false).await?;
    let site = &fabric.topology.sites[to];
    let offset = u32::from(pod_ip) - u32::from(site.pod_cidr.network());
    Ok(Ipv4Addr::from(u32::from(view.network()) + offset))
}

/// What the replica of `cluster` on `node` says of the election.
pub async fn replica_status(
    fabric: &Fabric,
    cluster: usize,
    node: usize,
) -> anyhow::Result<GetReplicaStatusResponse> {
    let mut client = fabric.clusters[cluster].gateway_replica(node)?;
    let status = tokio::time::timeout(
        Duration::from_secs(2),
        client.get_replica_status(GetReplicaStatusRequest {}),
    )
    .await??;
    Ok(status.into_inner())
}

/// The node of `cluster`'s one active replica, once exactly one says it is active, with its
/// epoch. Two actives at once are an error at once; none within `bound` is an error then.
pub async fn the_active(
    fabric: &Fabric,
    cluster: usize,
    bound: Duration,
) -> anyhow::Result<(usize, u64)> {
    let started = Instant::now();
    loop {
        let mut active = Vec::new();
        for node in fabric.clusters[cluster].gateway_replica_nodes() {
            if let Ok(s) = replica_status(fabric, cluster, node).await
                && s.active
            {
                active.push((node, s.epoch));
            }
        }
        match active.as_slice() {
            [one] => return Ok(*one),
            [] => {}
            more => bail!("two active replicas in cluster {cluster}: {more:?}"),
        }
        if started.elapsed() >= bound {
            bail!("no active replica in cluster {cluster} within {bound:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A process in a pod namespace, killed on drop.
#[derive(Debug)]
pub struct PodProcess(pub Child);

impl Drop for PodProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `python3 script args...` in the namespace `ns`.
pub fn python_in(ns: &str, script: &Path, args: &[String]) -> anyhow::Result<PodProcess> {
    let child = Command::new("ip")
        .args(["netns", "exec", ns, "python3"])
        .arg(script)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting python3")?;
    Ok(PodProcess(child))
}

/// The flows script running in a pod, until [`Flows::stop`].
#[derive(Debug)]
pub struct Flows {
    client: PodProcess,
    result: PathBuf,
    stop: PathBuf,
}

impl Flows {
    /// Starts flows to `targets` from the namespace `ns`; `dir` holds the script's files,
    /// named after `name`.
    pub fn start(
        ns: &str,
        script: &Path,
        dir: &Path,
        name: &str,
        targets: &[String],
    ) -> anyhow::Result<Self> {
        let result = dir.join(format!("{name}.json"));
        let stop = dir.join(format!("{name}.stop"));
        let _ = std::fs::remove_file(&result);
        let _ = std::fs::remove_file(&stop);
        let mut args = vec![
            "run".to_owned(),
            result.display().to_string(),
            stop.display().to_string(),
        ];
        args.extend(targets.iter().cloned());
        Ok(Self {
            client: python_in(ns, script, &args)?,
            result,
            stop,
        })
    }

    /// Stops the flows; their summary (one JSON object per target).
    pub fn stop(mut self) -> anyhow::Result<serde_json::Value> {
        std::fs::write(&self.stop, b"").context("writing the stop file")?;
        let asked = Instant::now();
        while self.client.0.try_wait()?.is_none() {
            if asked.elapsed() > Duration::from_secs(10) {
                bail!("the flows never stopped");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let text = std::fs::read(&self.result).context("reading the flows' result")?;
        Ok(serde_json::from_slice(&text)?)
    }
}

/// What the flows of one summary measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measured {
    /// `target: why` for every broken connection.
    pub broken: Vec<String>,
    /// The longest time any UDP probe went unanswered, in milliseconds.
    pub probe_gap_ms: f64,
    /// Targets of which nothing came back.
    pub silent: Vec<String>,
}

/// Reads a flows summary.
pub fn measured(summary: &serde_json::Value) -> Measured {
    let mut out = Measured::default();
    for target in summary.as_array().into_iter().flatten() {
        let name = target["target"].as_str().unwrap_or_default().to_owned();
        for b in target["broken"].as_array().into_iter().flatten() {
            out.broken
                .push(format!("{name}: {}", b.as_str().unwrap_or_default()));
        }
        let answered = target["echoes"]
            .as_u64()
            .or(target["received"].as_u64())
            .unwrap_or(0);
        if answered == 0 {
            out.silent.push(name.clone());
        }
        if name.starts_with("udp:") {
            out.probe_gap_ms = out
                .probe_gap_ms
                .max(target["max_gap_ms"].as_f64().unwrap_or(0.0));
        }
    }
    out
}

/// A flows server in the pod of cluster `to`, and what the pod of cluster `from` probes it
/// with: two echoed TCP connections and the 10 ms UDP probe, at the address `from` uses for
/// `to`'s pod (the script is written to `dir`).
#[derive(Debug)]
pub struct PodPair {
    pub server: PodProcess,
    pub script: PathBuf,
    /// The namespace of `from`'s pod, where [`Flows::start`] runs.
    pub from_pod: String,
    pub targets: Vec<String>,
}

impl PodPair {
    /// Starts the server and waits until `from`'s pod reaches `to`'s, for at most `limit`.
    pub async fn start(
        fabric: &Fabric,
        from: usize,
        to: usize,
        dir: &Path,
        limit: Duration,
    ) -> anyhow::Result<Self> {
        let script = dir.join("flows.py");
        std::fs::write(&script, FLOWS).context("writing the flows script")?;
        let to_pod = fabric.topology.sites[to].pod_ip;
        let address = fabric.pod_address(from, to, to_pod).await?;
        let server = python_in(
            &fabric.topology.sites[to].pod_ns,
            &script,
            &["serve".into(), PORT.to_string()],
        )?;
        let from_pod = fabric.topology.sites[from].pod_ns.clone();
        if !trellis_netlab::fabric::reaches(&from_pod, address, limit).await {
            bail!(
                "the pod of cluster {from} does not reach cluster {to}'s at {address}\n{}",
                fabric.logs()
            );
        }
        Ok(Self {
            server,
            script,
            from_pod,
            targets: vec![
                format!("tcp:{address}:{PORT}:2"),
                format!("udp:{address}:{PORT}"),
            ],
        })
    }
}

/// Sent and received probes of a flows summary's UDP target.
pub fn udp_probes(summary: &serde_json::Value) -> (u64, u64) {
    summary
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| t["target"].as_str().is_some_and(|n| n.starts_with("udp:")))
        .map(|t| {
            (
                t["sent"].as_u64().unwrap_or(0),
                t["received"].as_u64().unwrap_or(0),
            )
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_summary_gives_broken_connections_the_longest_probe_gap_and_silent_targets() {
        let summary = serde_json::json!([
            {"target": "tcp:10.1.2.10:7500:2", "broken": ["recv at 3.5 s: reset"], "max_gap_ms": 900.0, "connections": 2, "echoes": 10},
            {"target": "udp:10.1.2.10:7500", "broken": [], "max_gap_ms": 480.5, "sent": 10, "received": 9},
            {"target": "udp:10.3.2.10:7500", "broken": [], "max_gap_ms": 510.0, "sent": 10, "received": 0},
        ]);
        let m = measured(&summary);
        assert_eq!(m.broken, vec!["tcp:10.1.2.10:7500:2: recv at 3.5 s: reset"]);
        assert!((m.probe_gap_ms - 510.0).abs() < f64::EPSILON, "{m:?}");
        assert_eq!(m.silent, vec!["udp:10.3.2.10:7500"]);
    }
}
