//! `--mode lab`: the clusters `trellis-lab up --same-pod-cidr` runs, started by the lab's own
//! code (`trellis_lab::start_all` with the lab's plan), so that the benchmark measures complete
//! clusters as people run them: six services each, mutual TLS with certificates the services
//! make, gateways following their brokers, every service serving `/metrics`. The hub is the
//! lab's cluster 0 and the leaves its clusters 1 to n; only the clock and the following of the
//! brokers are the benchmark's.

use std::net::SocketAddr;

use anyhow::Context as _;
use trellis_lab::cluster::{LabCluster, Options};
use trellis_lab::config::StoreKind;
use trellis_lab::plan::ClusterPlan;
use trellis_runtime::Shutdown;

/// Started lab clusters and the token that stops them.
pub(super) struct LabClusters {
    shutdown: Shutdown,
    clusters: Vec<LabCluster>,
}

impl LabClusters {
    /// The lab's plan for a hub and `leaves` leaves (free ports, mutual TLS, one pod CIDR).
    pub(super) fn plan(leaves: usize) -> anyhow::Result<Vec<ClusterPlan>> {
        let clusters = u16::try_from(leaves + 1).context("too many leaves for a lab")?;
        trellis_lab::plan::plan(clusters, true, 0, true)
    }

    pub(super) async fn start(plans: Vec<ClusterPlan>) -> anyhow::Result<Self> {
        let shutdown = Shutdown::new();
        let options = Options {
            store: StoreKind::Memory,
            induced: true,
        };
        let clusters = Box::pin(trellis_lab::start_all(plans, options, &shutdown, true)).await?;
        Ok(Self { shutdown, clusters })
    }

    pub(super) fn plans(&self) -> impl Iterator<Item = &ClusterPlan> {
        self.clusters.iter().map(|c| &c.plan)
    }

    /// Where `service` of the first cluster (the hub, when it is one) listens locally.
    pub(super) fn addr(&self, service: &str) -> SocketAddr {
        let p = self.clusters[0].plan.ports;
        match service {
            "discovery" => p.discovery,
            "forwarder" => p.forwarder,
            "ipam" => p.ipam,
            "endpoints" => p.endpoints,
            "gateway" => p.gateway,
            _ => p.broker,
        }
    }

    /// Where other clusters peer with the first cluster.
    pub(super) fn facing_broker(&self) -> SocketAddr {
        self.clusters[0].plan.facing_broker()
    }

    pub(super) async fn stop(self) {
        self.shutdown.cancel();
        for cluster in self.clusters {
            if let Err(err) = cluster.finish().await {
                eprintln!("mesh-bench: a lab cluster stopped with an error: {err:#}");
            }
        }
    }
}
