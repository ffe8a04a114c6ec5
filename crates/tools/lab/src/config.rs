//! Command line of `trellis-lab`. Every flag of
//! `up` is also read from `TRELLIS_LAB_<FLAG>`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use trellis_netlab::NatKind;

/// Runs a whole Trellis topology on this machine: cluster 0 is the hub, the others are leaves
/// peered with it; with induced peering (the default) the leaves then build a full mesh among
/// themselves through the hub. Every cluster runs all six services on loopback ports, each
/// with its own store, talking real gRPC to each other.
#[derive(Debug, Clone, Parser)]
#[command(name = "trellis-lab", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// What to do.
#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Start the topology, show progress until the mesh is complete, print a summary and
    /// ready-to-paste grpcurl commands, and keep running until Ctrl-C (or exit at once with
    /// `--until-converged`). Everything it started is stopped on exit.
    Up(UpConfig),
    /// Ping every pair of pods in different clusters of a running `--dataplane netns` lab (the
    /// `reach` list of its topology file), print a cluster × cluster matrix and every failing
    /// pair, and exit 0 only when every pair answered. Needs root (it enters the pods'
    /// namespaces).
    Check(CheckConfig),
    /// SIGKILL the active gateway replica of CLUSTER in a running `--dataplane netns --gateways
    /// 2` lab (the replicas are listed in its topology file), then wait until another replica
    /// says it is active and print how long that took. Needs root.
    Failover(FailoverConfig),
}

/// Flags of `trellis-lab failover`.
#[derive(Debug, Clone, Args)]
pub struct FailoverConfig {
    /// The cluster ID whose active gateway is killed (e.g. `leaf-1`).
    pub cluster: String,

    /// The topology file a running `trellis-lab up --dataplane netns --topology-file PATH`
    /// wrote.
    #[arg(long, env = "TRELLIS_LAB_TOPOLOGY_FILE", value_name = "PATH")]
    pub topology_file: PathBuf,

    /// Seconds to wait for another replica to take over before giving up.
    #[arg(long, env = "TRELLIS_LAB_FAILOVER_TIMEOUT", value_name = "SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=600))]
    pub timeout: u64,
}

/// Flags of `trellis-lab check`.
#[derive(Debug, Clone, Args)]
pub struct CheckConfig {
    /// The topology file a running `trellis-lab up --dataplane netns --topology-file PATH`
    /// wrote.
    #[arg(long, env = "TRELLIS_LAB_TOPOLOGY_FILE", value_name = "PATH")]
    pub topology_file: PathBuf,

    /// Seconds a pair may take to answer (its pings are retried until then) before it counts
    /// as failed.
    #[arg(long, env = "TRELLIS_LAB_CHECK_TIMEOUT", value_name = "SECONDS", default_value_t = 5,
          value_parser = clap::value_parser!(u64).range(1..=600))]
    pub timeout: u64,
}

/// Flags of `trellis-lab up`.
#[derive(Debug, Clone, Args)]
pub struct UpConfig {
    /// Number of clusters, hub included (at least 2: a hub and one leaf).
    #[arg(long, env = "TRELLIS_LAB_CLUSTERS", value_name = "N", default_value_t = 3,
          value_parser = clap::value_parser!(u16).range(2..=255))]
    pub clusters: u16,

    /// Give every cluster the same pod CIDR (10.0.0.0/16), so each leaf must remap all the
    /// others. Without it cluster i gets 10.i.0.0/16.
    #[arg(long, env = "TRELLIS_LAB_SAME_POD_CIDR")]
    pub same_pod_cidr: bool,

    /// Where the services keep their state: `memory` (embedded, lost on exit) or `etcd` (one
    /// real etcd process per service, from Debian's etcd-server; `make setup` installs it).
    #[arg(long, env = "TRELLIS_LAB_STORE", value_enum, default_value_t = StoreKind::Memory)]
    pub store: StoreKind,

    /// Data plane: `none` (control plane only) or `netns` (every cluster a set of node network
    /// namespaces with a pod each, the services and the gateway on node 0, a route agent on
    /// every node, gateways joined by a bridge playing the internet, real WireGuard tunnels; the
    /// lab waits until every pod reaches every remote pod and prints the matrix; needs root and
    /// the service binaries built next to `trellis-lab`).
    #[arg(long, env = "TRELLIS_LAB_DATAPLANE", value_enum, default_value_t = DataplaneKind::None)]
    pub dataplane: DataplaneKind,

    /// Nodes per cluster with `--dataplane netns` (1 to 16): node 0 hosts the gateway, each
    /// node owns a /24 of the pod CIDR and runs one pod and a route agent.
    #[arg(long, env = "TRELLIS_LAB_NODES", value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(1..=16))]
    pub nodes: u8,

    /// Gateway replicas per cluster with `--dataplane netns` (1 or 2; ADR 0023): on nodes 0
    /// and 1, sharing the cluster's gateway store (so 2 needs `--store etcd` and `--nodes` of
    /// at least 2). One is active, the other a warm standby; `trellis-lab failover` kills the
    /// active one.
    #[arg(long, env = "TRELLIS_LAB_GATEWAYS", value_name = "K", default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(1..=2))]
    pub gateways: u8,

    /// NAT routers in front of the leaves' gateways with `--dataplane netns`, one kind per leaf
    /// in order, repeated when there are more leaves than kinds (the hub stays reachable):
    /// `none`; `one-to-one` (static 1:1, ports kept); `easy` (one public port for every
    /// destination, answers only from addresses it sent to); `hard` (a new random port per
    /// destination, answers only to that port). Only the gateways' WireGuard datagrams cross
    /// the routers. Each leaf advertises its private address; the hub tells the others where
    /// it sees it, pairs punch through where they can, and `hard`-`hard` pairs are relayed by
    /// the hub (ADR 0025). E.g. `--nat easy,hard`.
    #[arg(
        long,
        env = "TRELLIS_LAB_NAT",
        value_name = "KIND[,KIND...]",
        value_delimiter = ','
    )]
    pub nat: Vec<NatKind>,

    /// Switch induced peering off on every cluster: leaves peer only with the hub, and
    /// leaf-to-leaf traffic would take the hub path.
    #[arg(long, env = "TRELLIS_LAB_NO_INDUCED")]
    pub no_induced: bool,

    /// Write the topology (clusters, service addresses, and with `--dataplane netns` the
    /// namespaces, pod addresses and who reaches whom at which address) to this JSON file as
    /// soon as the services listen, and again once the mesh is up.
    #[arg(long, env = "TRELLIS_LAB_TOPOLOGY_FILE", value_name = "PATH")]
    pub topology_file: Option<PathBuf>,

    /// Exit 0 as soon as the full mesh is up (every leaf has a TunnelEndpoint for the hub and,
    /// with induced peering, for every other leaf), printing the elapsed time; exit non-zero
    /// with the reason when `--timeout` passes first.
    #[arg(long, env = "TRELLIS_LAB_UNTIL_CONVERGED")]
    pub until_converged: bool,

    /// Seconds to wait for the mesh before giving up.
    #[arg(long, env = "TRELLIS_LAB_TIMEOUT", value_name = "SECONDS", default_value_t = 300,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout: u64,

    /// Peer in plaintext, without mutual TLS between clusters. By default each cluster's
    /// services share a certificate directory (`--tls-dir`: the first makes the cluster's CA,
    /// each issues and renews its own certificate), every cluster-facing service also listens
    /// for other clusters on a mutual-TLS peer port (listed as `peer_services` in the topology
    /// file), peering pins the hub's CA, and the mesh forms over mutual TLS. The plaintext
    /// listeners (and the printed grpcurl commands) are there either way.
    #[arg(long, env = "TRELLIS_LAB_INSECURE_PLAINTEXT_PEERING")]
    pub insecure_plaintext_peering: bool,

    /// First port of the lab: cluster i's services listen on BASE+10·i+1 (discovery) to
    /// BASE+10·i+6 (gateway), so the hub gets the default ports 7101-7106 and the printed
    /// grpcurl commands stay the same from run to run. 0 picks free ports instead.
    #[arg(
        long,
        env = "TRELLIS_LAB_BASE_PORT",
        value_name = "PORT",
        default_value_t = 7100
    )]
    pub base_port: u16,
}

/// Which store the lab's services use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// Embedded in-memory stores.
    Memory,
    /// One real etcd process per service.
    Etcd,
}

/// Which data plane the lab builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DataplaneKind {
    /// No tunnels: the gateways only publish their keys and endpoints.
    None,
    /// Network namespaces and userspace WireGuard (root only).
    Netns,
}

impl UpConfig {
    /// The NAT kind in front of each of `clusters` clusters' gateways (the hub, cluster 0, has
    /// none); empty without `--nat`.
    pub fn nat_kinds(&self, clusters: usize) -> Vec<NatKind> {
        if self.nat.is_empty() {
            return Vec::new();
        }
        (0..clusters)
            .map(|i| match i {
                0 => NatKind::None,
                leaf => self.nat[(leaf - 1) % self.nat.len()],
            })
            .collect()
    }

    /// The convergence deadline.
    pub fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout)
    }

    /// Whether the clusters peer over mutual TLS (the default).
    pub fn tls(&self) -> bool {
        !self.insecure_plaintext_peering
    }

    /// Whether the leaves are expected to peer with each other.
    pub fn induced(&self) -> bool {
        !self.no_induced
    }

    /// Flag combinations clap cannot refuse by itself.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.dataplane == DataplaneKind::None && self.nodes > 1 {
            anyhow::bail!(
                "--nodes needs --dataplane netns (without a data plane there are no nodes)"
            );
        }
        if self.gateways > 1
            && (self.dataplane != DataplaneKind::Netns
                || self.nodes < self.gateways
                || self.store != StoreKind::Etcd)
        {
            anyhow::bail!(
                "--gateways {} needs --dataplane netns, --nodes of at least {} and --store etcd \
                 (the replicas run on their own nodes and share the gateway's store)",
                self.gateways,
                self.gateways
            );
        }
        if !self.nat.is_empty() && (self.dataplane != DataplaneKind::Netns || self.gateways > 1) {
            anyhow::bail!(
                "--nat needs --dataplane netns with one gateway per cluster (the routers sit in \
                 front of node 0's gateway)"
            );
        }
        Ok(())
    }
}

impl CheckConfig {
    /// How long a pair may take to answer.
    pub fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(extra: &[&str]) -> Result<UpConfig, clap::Error> {
        let mut args = vec!["trellis-lab", "up"];
        args.extend_from_slice(extra);
        Cli::try_parse_from(args).map(|cli| match cli.command {
            Command::Up(up) => up,
            Command::Check(_) | Command::Failover(_) => panic!("not up"),
        })
    }

    #[test]
    fn defaults_are_a_hub_and_two_leaves_on_the_default_ports() {
        let c = up(&[]).expect("parses");
        assert_eq!(c.clusters, 3);
        assert_eq!(c.base_port, 7100);
        assert_eq!(c.store, StoreKind::Memory);
        assert_eq!(c.dataplane, DataplaneKind::None);
        assert!(c.induced() && !c.same_pod_cidr && !c.until_converged);
    }

    #[test]
    fn flags_of_the_lab_contract_parse() {
        let c = up(&[
            "--clusters",
            "10",
            "--same-pod-cidr",
            "--store",
            "etcd",
            "--no-induced",
            "--topology-file",
            "/tmp/t.json",
            "--until-converged",
        ])
        .expect("parses");
        assert_eq!(c.clusters, 10);
        assert!(c.same_pod_cidr && !c.induced() && c.until_converged);
        assert_eq!(c.store, StoreKind::Etcd);
        assert_eq!(c.topology_file, Some(PathBuf::from("/tmp/t.json")));
    }

    #[test]
    fn nat_kinds_go_to_the_leaves_in_turn_and_need_namespaces() {
        let c = up(&["--dataplane", "netns", "--nat", "easy,hard"]).expect("parses");
        c.validate().expect("valid");
        assert_eq!(
            c.nat_kinds(4),
            [NatKind::None, NatKind::Easy, NatKind::Hard, NatKind::Easy]
        );
        assert!(up(&[]).expect("parses").nat_kinds(3).is_empty());
        let err = up(&["--nat", "easy"])
            .expect("parses")
            .validate()
            .expect_err("refused");
        assert!(err.to_string().contains("--nat needs"), "{err}");
        let err = up(&["--dataplane", "netns", "--nat", "symmetric"]).expect_err("refused");
        assert!(
            err.to_string()
                .contains("one of none, one-to-one, easy, hard"),
            "{err}"
        );
    }

    #[test]
    fn gateway_replicas_need_nodes_namespaces_and_etcd() {
        let c = up(&[
            "--dataplane",
            "netns",
            "--nodes",
            "2",
            "--store",
            "etcd",
            "--gateways",
            "2",
        ])
        .expect("parses");
        assert_eq!(c.gateways, 2);
        c.validate().expect("valid");
        for bad in [
            &["--gateways", "2"][..],
            &[
                "--dataplane",
                "netns",
                "--nodes",
                "1",
                "--store",
                "etcd",
                "--gateways",
                "2",
            ],
            &["--dataplane", "netns", "--nodes", "2", "--gateways", "2"],
        ] {
            let err = up(bad).expect("parses").validate().expect_err("refused");
            assert!(
                err.to_string().contains("--gateways 2 needs"),
                "{bad:?}: {err}"
            );
        }
        assert!(
            up(&["--gateways", "3"]).is_err(),
            "netns labs run at most 2"
        );
        let cli =
            Cli::try_parse_from(["trellis-lab", "failover", "leaf-1", "--topology-file", "t"])
                .expect("parses");
        let Command::Failover(f) = cli.command else {
            panic!("not failover")
        };
        assert_eq!((f.cluster.as_str(), f.timeout), ("leaf-1", 10));
    }

    #[test]
    fn refuses_too_few_or_too_many_clusters() {
        assert!(up(&["--clusters", "1"]).is_err());
        assert!(up(&["--clusters", "256"]).is_err());
        assert!(up(&["--timeout", "0"]).is_err());
    }

    #[test]
    fn nodes_need_the_namespace_data_plane() {
        let c = up(&["--dataplane", "netns", "--nodes", "3"]).expect("parses");
        assert_eq!((c.dataplane, c.nodes), (DataplaneKind::Netns, 3));
        c.validate().expect("valid");
        let err = up(&["--nodes", "3"])
            .expect("parses")
            .validate()
            .expect_err("no data plane");
        assert!(
            err.to_string().contains("--nodes needs --dataplane netns"),
            "{err}"
        );
        assert!(up(&["--dataplane", "netns", "--nodes", "0"]).is_err());
        assert!(up(&["--dataplane", "netns", "--nodes", "17"]).is_err());
    }

    #[test]
    fn check_needs_a_topology_file() {
        assert!(Cli::try_parse_from(["trellis-lab", "check"]).is_err());
        let cli = Cli::try_parse_from(["trellis-lab", "check", "--topology-file", "/tmp/t.json"])
            .expect("parses");
        let Command::Check(c) = cli.command else {
            panic!("not check");
        };
        assert_eq!(c.timeout(), Duration::from_secs(5));
    }
}
