//! `trellis-lab failover CLUSTER`: SIGKILL the active gateway replica of one cluster of a
//! running `--dataplane netns` lab, as a node failure would, and report when another replica
//! took over (ADR 0023). The replicas come from the topology file; which one is active is asked
//! of each (GetReplicaStatus), since the file may predate earlier failovers.

use std::io::Write;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use serde::Deserialize;
use trellis_api::pb::gateway::GetReplicaStatusRequest;
use trellis_api::pb::gateway::gateway_client::GatewayClient;

use crate::config::FailoverConfig;
use crate::report::TopologyGateway;

/// The parts of the topology file the failover reads.
#[derive(Debug, Deserialize)]
struct TopologyFile {
    clusters: Vec<Cluster>,
}

#[derive(Debug, Deserialize)]
struct Cluster {
    id: String,
    #[serde(default)]
    gateways: Vec<TopologyGateway>,
}

/// Whether the replica says it is active, and its epoch; `None` when it does not answer.
async fn active(replica: &TopologyGateway) -> Option<(bool, u64)> {
    let addr: SocketAddr = replica.address.parse().ok()?;
    let channel = trellis_netlab::netns::channel_in(&replica.netns, addr).ok()?;
    let status = tokio::time::timeout(
        Duration::from_secs(2),
        GatewayClient::new(channel).get_replica_status(GetReplicaStatusRequest {}),
    )
    .await
    .ok()?
    .ok()?
    .into_inner();
    Some((status.active, status.epoch))
}

/// Kills the active replica of `config.cluster` and waits for the next one.
pub async fn run(config: &FailoverConfig, out: &mut dyn Write) -> anyhow::Result<()> {
    let path = &config.topology_file;
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the topology file {}", path.display()))?;
    let file: TopologyFile = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a topology file of trellis-lab", path.display()))?;
    let ids: Vec<&str> = file.clusters.iter().map(|c| c.id.as_str()).collect();
    let cluster = file
        .clusters
        .iter()
        .find(|c| c.id == config.cluster)
        .with_context(|| {
            format!(
                "no cluster {:?} in the lab (it has {ids:?})",
                config.cluster
            )
        })?;
    if cluster.gateways.len() < 2 {
        bail!(
            "cluster {} has {} gateway replica(s): start the lab with --gateways 2 for a failover",
            cluster.id,
            cluster.gateways.len()
        );
    }
    let mut victim = None;
    for replica in &cluster.gateways {
        if let Some((true, epoch)) = active(replica).await {
            victim = Some((replica, epoch));
        }
    }
    let (victim, epoch) =
        victim.with_context(|| format!("no replica of {} says it is active", cluster.id))?;
    let pid = victim
        .pid
        .with_context(|| format!("the topology file has no pid for {}'s replica", victim.node))?;
    let killed = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .context("running kill")?;
    if !killed.success() {
        bail!(
            "could not kill the gateway replica on {} (pid {pid}): is the lab still running, and \
             are you root?",
            victim.node
        );
    }
    let killed = Instant::now();
    writeln!(
        out,
        "{}: killed the active gateway replica on {} (pid {pid}, epoch {epoch})",
        cluster.id, victim.node
    )?;
    let bound = Duration::from_secs(config.timeout);
    loop {
        for replica in cluster.gateways.iter().filter(|r| r.node != victim.node) {
            if let Some((true, new_epoch)) = active(replica).await {
                writeln!(
                    out,
                    "{}: the replica on {} took over after {} ms (epoch {new_epoch})",
                    cluster.id,
                    replica.node,
                    killed.elapsed().as_millis()
                )?;
                return Ok(());
            }
        }
        if killed.elapsed() > bound {
            bail!(
                "no replica of {} took over within {bound:?} (see its gateway logs)",
                cluster.id
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
