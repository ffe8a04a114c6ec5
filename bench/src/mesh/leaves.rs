//! The leaves of one run, by mode: `InProcessCluster`s, `ProcessCluster`s on etcd, or the lab's
//! clusters, all with the same pod CIDR and each with an external /24 of its own.

use std::net::SocketAddr;

use trellis_integration::cluster::InProcessCluster;
use trellis_integration::processes::ProcessCluster;

use super::lab::LabClusters;
use super::{Mode, POD_CIDR};

/// Discovery's flags on every leaf, as the lab gives them: a leaf of an N-leaf hub is
/// introduced to N-1 others, above discovery's default cap (`--max-induced-per-hub`, 192) at
/// 254 leaves, where every Neighborhood would be refused.
fn leaf_discovery_flags() -> Vec<String> {
    vec!["--max-induced-per-hub".to_owned(), "4096".to_owned()]
}

/// Leaf `i`'s external CIDR: a /24 of its own in 100.64.0.0/10 (see [`super`]).
fn leaf_external(i: usize) -> String {
    format!("100.{}.{}.0/24", 64 + i / 256, i % 256)
}

/// The leaves of one run, by mode; only their brokers are used after start.
pub(super) enum Leaves {
    InProcess(Vec<InProcessCluster>),
    Etcd(Vec<ProcessCluster>),
    Lab(LabClusters),
}

impl Leaves {
    pub(super) async fn start(mode: Mode, n: usize) -> anyhow::Result<Option<Self>> {
        let name = |i: usize| format!("leaf-{i:03}");
        Ok(Some(match mode {
            Mode::EtcdProcesses => {
                let mut out = Vec::new();
                for i in 0..n {
                    let options = trellis_integration::processes::Options {
                        discovery_flags: leaf_discovery_flags(),
                        ..Default::default()
                    };
                    let Some(c) =
                        ProcessCluster::start_with(&name(i), POD_CIDR, &leaf_external(i), options)
                            .await?
                    else {
                        return Ok(None);
                    };
                    out.push(c);
                }
                Leaves::Etcd(out)
            }
            Mode::Lab => {
                // Clusters 1 to n of the lab's plan (cluster 0 is the hub, started apart).
                let leaves = LabClusters::plan(n)?.into_iter().skip(1).collect();
                Leaves::Lab(Box::pin(LabClusters::start(leaves)).await?)
            }
            _ => {
                let mut out = Vec::with_capacity(n);
                for i in 0..n {
                    let options = trellis_integration::cluster::Options {
                        discovery_flags: leaf_discovery_flags(),
                        tls: mode == Mode::InProcessTls,
                        ..Default::default()
                    };
                    out.push(
                        InProcessCluster::start_with(
                            &name(i),
                            POD_CIDR,
                            &leaf_external(i),
                            options,
                        )
                        .await?,
                    );
                }
                Leaves::InProcess(out)
            }
        }))
    }

    pub(super) fn brokers(&self) -> Vec<SocketAddr> {
        match self {
            Leaves::InProcess(l) => l.iter().map(|c| c.services.broker).collect(),
            Leaves::Etcd(l) => l.iter().map(|c| c.services.broker).collect(),
            Leaves::Lab(l) => l.plans().map(|p| p.ports.broker).collect(),
        }
    }

    pub(super) async fn stop(self) {
        match self {
            Leaves::InProcess(l) => {
                for leaf in l {
                    leaf.stop().await;
                }
            }
            Leaves::Etcd(l) => drop(l),
            Leaves::Lab(l) => l.stop().await,
        }
    }
}
