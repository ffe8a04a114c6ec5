//! The parts of `mesh-bench` (induced mesh setup time against the number of leaves; the
//! binary's doc describes the benchmark and its modes): the hub ([`hub`]) and the leaves
//! ([`leaves`]) of one run by mode, following every broker's TunnelEndpoints ([`tallies`]),
//! the measurement of one run ([`measure`]), each run in a process of its own ([`mod@run`]), and
//! the medians and summary table of one size ([`summary`]). What it writes is
//! [`crate::results::MeshResult`].

use std::net::SocketAddr;

use tonic::transport::Channel;

pub use crate::results::Mode;

mod hub;
mod lab;
mod leaves;
mod measure;
mod run;
mod summary;
mod tallies;

pub use run::{Held, Outcome, one_run_to, reexec_from_deps, run, run_alone};
pub use summary::{hold, print_table, summarize};

const HUB_ID: &str = "hub";
/// How many times one leaf's Peer request is sent again after UNAVAILABLE.
const PEER_RETRIES: usize = 5;
const POD_CIDR: &str = "10.0.0.0/16";
const EXTERNAL_CIDR: &str = "10.201.0.0/16";

impl Mode {
    /// Where the result goes without `--out`.
    pub fn default_out(self) -> &'static str {
        match self {
            Mode::InProcess => "bench/results/mesh.json",
            Mode::InProcessTls => "bench/results/mesh-tls.json",
            Mode::HubProcesses => "bench/results/mesh-hub-processes.json",
            Mode::HubEtcd => "bench/results/mesh-hub-etcd.json",
            Mode::EtcdProcesses => "bench/results/mesh-etcd.json",
            Mode::Lab => "bench/results/mesh-lab.json",
        }
    }

    /// Whether the hub is a `ProcessCluster` on etcd.
    pub fn hub_on_etcd(self) -> bool {
        matches!(self, Mode::HubEtcd | Mode::EtcdProcesses)
    }
}

async fn channel(addr: SocketAddr) -> anyhow::Result<Channel> {
    Ok(Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?)
}
