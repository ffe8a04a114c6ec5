//! `trellis-lab up --dataplane netns`: the lab with real packets. Every cluster is a set of
//! node network namespaces on a node bridge of its own (a host-routed pod network: each node
//! owns a /24 of the pod CIDR and has one pod), node 0 runs the six services and the gateway
//! (userspace WireGuard), every node runs `trellis-route`, and the gateways meet on a bridge
//! playing the internet. The services are the real binaries, run as processes inside the
//! namespaces (`trellis-netlab`).
//!
//! The lab waits for the tunnels as the control-plane lab does, then for every pod to answer
//! pings from every pod of the other clusters at the address its cluster uses for it, and
//! prints the matrix ([`crate::check`]). Everything it built (processes, namespaces with their
//! devices, routes and nftables tables) is removed when it exits, on Ctrl-C as on
//! `--until-converged`.

use std::time::Instant;

use anyhow::{Context as _, bail};
use trellis_netlab::{Fabric, FabricOptions, Service};
use trellis_runtime::Shutdown;

use crate::Progress;
use crate::check;
use crate::config::{StoreKind, UpConfig};
use crate::mesh::{self, Brokers, Expected};
use crate::plan::{self, ClusterPlan};
use crate::report::{
    self, Reach, Topology, TopologyGateway, TopologyNat, TopologyNode, TopologyPod,
};

/// Clusters the namespace lab builds at most: each is 6 service processes plus a route agent
/// per node (and with `--store etcd` six etcds), far more than the control-plane lab's
/// in-process clusters.
pub const MAX_CLUSTERS: u16 = 32;

/// Every cluster's external CIDR in the namespace lab: identical on purpose (the IPAM remaps
/// them), and clear of the node networks (100.64.<cluster + 1>.0/24).
const EXTERNAL_CIDR: &str = "10.201.0.0/16";

/// The binaries the lab starts.
const BINARIES: [&str; 7] = [
    "trellis-discovery",
    "trellis-broker",
    "trellis-forwarder",
    "trellis-ipam",
    "trellis-endpoints",
    "trellis-gateway",
    "trellis-route",
];

/// Refuses clearly what cannot work here, before anything is created.
fn preflight(config: &UpConfig) -> anyhow::Result<()> {
    if config.clusters > MAX_CLUSTERS {
        bail!(
            "--dataplane netns builds at most {MAX_CLUSTERS} clusters (each is {} processes); \
             use --dataplane none for bigger labs",
            6 + usize::from(config.nodes)
        );
    }
    let missing = trellis_netlab::missing_prerequisites(&["ip", "nft", "ping", "sysctl"]);
    if !missing.is_empty() {
        bail!(
            "--dataplane netns needs {}; run it as root, or use --dataplane none",
            missing.join(", ")
        );
    }
    for binary in BINARIES {
        trellis_netlab::bins::bin_path(binary)?;
    }
    Ok(())
}

/// Runs the namespace lab until the pods reach each other (and, without `--until-converged`,
/// until `lab` is cancelled), then removes everything.
pub(crate) async fn run(
    config: &UpConfig,
    lab: &Shutdown,
    progress: &mut Progress<'_>,
) -> anyhow::Result<()> {
    preflight(config)?;
    // A lab killed hard (SIGKILL, a job's timeout) could not remove its namespaces; its
    // processes died with it.
    for leftover in trellis_netlab::owner::leftovers()? {
        let removed = leftover.remove()?;
        progress.say(format_args!(
            "removed the leftovers of lab run {} (no longer running): {} namespaces, {} \
             processes still in them",
            leftover.run, removed.namespaces, removed.processes
        ));
    }
    let mut plans = plan::plan(
        config.clusters,
        config.same_pod_cidr,
        config.base_port,
        false,
    )?;
    let nodes = usize::from(config.nodes);
    progress.say(format_args!(
        "building {} clusters x {nodes} nodes in network namespaces: {} processes with {} stores",
        plans.len(),
        plans.len() * (6 + nodes),
        match config.store {
            StoreKind::Memory => "memory",
            StoreKind::Etcd => "etcd",
        },
    ));
    let options = FabricOptions {
        names: plans.iter().map(|p| p.id.clone()).collect(),
        hub: 0,
        pod_cidr: plans[0].pod_cidr.to_string(),
        pod_cidrs: plans.iter().map(|p| p.pod_cidr.to_string()).collect(),
        external_cidr: EXTERNAL_CIDR.to_owned(),
        hub_no_induced: false,
        store: match config.store {
            StoreKind::Memory => trellis_netlab::StoreKind::Memory,
            StoreKind::Etcd => trellis_netlab::StoreKind::EtcdPerService,
        },
        extra_args: {
            let mut extra = Vec::new();
            if !config.induced() {
                extra.push((Service::Discovery, vec!["--no-induced".to_owned()]));
            }
            if !config.nat.is_empty() {
                // Leaves behind NAT learn where the hub sees each other within a second.
                extra.push((
                    Service::Broker,
                    vec!["--candidates-refresh".to_owned(), "1".to_owned()],
                ));
            }
            extra
        },
        cluster_args: Vec::new(),
        nodes,
        node_networks: Vec::new(),
        unreserved: Vec::new(),
        endpoint_names: false,
        gateways: usize::from(config.gateways),
        nat: config.nat_kinds(plans.len()),
        tls: config.tls(),
    };
    let clock = Instant::now();
    let fabric = tokio::select! {
        built = Fabric::up(options) => built.context("building the namespace lab")?,
        () = lab.cancelled() => bail!("interrupted while building the namespaces"),
    };
    progress.say(format_args!(
        "services and route agents serving, leaves peered with the hub ({:.2}s)",
        clock.elapsed().as_secs_f64()
    ));
    // From here on the plans describe the clusters as built: services on the bridge addresses.
    for (plan, cluster) in plans.iter_mut().zip(&fabric.clusters) {
        plan.external_cidr = EXTERNAL_CIDR.parse()?;
        let at = |s: Service| cluster.addr(s);
        plan.ports = plan::Ports {
            discovery: at(Service::Discovery),
            broker: at(Service::Broker),
            forwarder: at(Service::Forwarder),
            ipam: at(Service::Ipam),
            endpoints: at(Service::Endpoints),
            gateway: at(Service::Gateway),
        };
        plan.dns = cluster.dns_addr();
    }
    let result = converge(config, &plans, &fabric, progress, lab).await;
    let result = match result {
        Ok(()) if config.until_converged => Ok(()),
        Ok(()) => {
            progress.say(format_args!("running; press Ctrl-C to stop everything"));
            lab.cancelled().await;
            Ok(())
        }
        Err(err) => Err(err),
    };
    let namespaces = fabric.topology.namespaces().len();
    let mut fabric = fabric;
    let stopping = fabric.clusters.iter_mut().map(|cluster| async move {
        if let Err(err) = cluster.stop_all().await {
            tracing::warn!(cluster = %cluster.id, error = format!("{err:#}"), "stopping a cluster");
        }
    });
    futures::future::join_all(stopping).await;
    drop(fabric);
    progress.say(format_args!(
        "stopped every process and removed {namespaces} network namespaces"
    ));
    result
}

/// Waits for the tunnels, writes the topology file, waits for every pod pair, reports.
async fn converge(
    config: &UpConfig,
    plans: &[ClusterPlan],
    fabric: &Fabric,
    progress: &mut Progress<'_>,
    lab: &Shutdown,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + config.timeout();
    let brokers = Brokers::new(
        fabric
            .clusters
            .iter()
            .map(|c| Ok((c.id.clone(), c.channel(Service::Broker)?)))
            .collect::<anyhow::Result<_>>()?,
    );
    let expected = Expected::new(plans, config.induced());
    let clock = Instant::now();
    let following = mesh::Following::start(&brokers, &expected);
    let converged = following.converge(config.timeout(), |p| {
        progress.say(format_args!(
            "tunnels: full {}/{}, induced {}/{}",
            p.full, p.full_wanted, p.induced, p.induced_wanted
        ));
    });
    let snapshot = tokio::select! {
        result = converged => result?.snapshot,
        () = lab.cancelled() => bail!("interrupted before the mesh converged"),
    };
    progress.say(format_args!(
        "tunnels complete in {:.2}s; pinging every pod from every pod of the other clusters",
        clock.elapsed().as_secs_f64()
    ));
    let reach = reach(fabric).await?;
    let topology = topology(plans, fabric, &snapshot, reach.clone());
    if let Some(path) = &config.topology_file {
        topology.write(path)?;
        progress.say(format_args!("topology written to {}", path.display()));
    }
    let bound = deadline.saturating_duration_since(Instant::now());
    let outcomes = tokio::select! {
        outcomes = check::ping_all(&reach, bound) => outcomes,
        () = lab.cancelled() => bail!("interrupted while pinging the pods"),
    };
    let ids: Vec<String> = plans.iter().map(|p| p.id.clone()).collect();
    let ok = check::answered(&outcomes);
    progress.say(format_args!(
        "{ok}/{} pod pairs answered ({:.2}s after the services were serving)",
        outcomes.len(),
        clock.elapsed().as_secs_f64()
    ));
    let out = &mut *progress.out;
    writeln!(out, "\n{}", report::summary(plans, &snapshot))?;
    writeln!(out, "{}", report::nat_views(plans, &snapshot))?;
    writeln!(out, "{}", check::report(&ids, &outcomes))?;
    if ok != outcomes.len() {
        out.flush()?;
        bail!(
            "{} of {} pod pairs did not answer within --timeout",
            outcomes.len() - ok,
            outcomes.len()
        );
    }
    let gateway_ns = &fabric.topology.sites[0].gw_ns;
    writeln!(
        out,
        "Try it (the services listen inside the namespaces; grpcurl ships in .tools/bin after \
         `make setup`):"
    )?;
    for line in report::grpcurl_commands(plans).lines() {
        match line.strip_prefix("grpcurl ") {
            Some(rest) => writeln!(out, "ip netns exec {gateway_ns} grpcurl {rest}")?,
            None => writeln!(out, "{line}")?,
        }
    }
    if let Some(first) = reach.first() {
        writeln!(
            out,
            "# a pod of {} pings a pod of {}:",
            first.from, first.to
        )?;
        writeln!(
            out,
            "ip netns exec {} ping -c 3 {}",
            first.from_pod, first.address
        )?;
    }
    if let Some(path) = &config.topology_file {
        writeln!(
            out,
            "# the whole matrix again:\ntrellis-lab check --topology-file {}",
            path.display()
        )?;
    }
    out.flush()?;
    Ok(())
}

/// Every pair of pods in different clusters, named as the topology file names them.
async fn reach(fabric: &Fabric) -> anyhow::Result<Vec<Reach>> {
    Ok(fabric
        .reach()
        .await
        .context("reading the clusters' views of each other")?
        .into_iter()
        .map(|r| Reach {
            from: fabric.clusters[r.from].id.clone(),
            from_pod: r.from_pod.netns,
            to: fabric.clusters[r.to].id.clone(),
            to_pod: r.to_pod.name,
            address: r.address.to_string(),
        })
        .collect())
}

/// The topology file's view of the built lab.
fn topology(
    plans: &[ClusterPlan],
    fabric: &Fabric,
    snapshot: &mesh::Snapshot,
    reach: Vec<Reach>,
) -> Topology {
    let mut topology = Topology::new(plans, Some(snapshot), true);
    for (cluster, site) in topology.clusters.iter_mut().zip(&fabric.topology.sites) {
        let pods = site.pods();
        cluster.gateway_netns = Some(site.gw_ns.clone());
        cluster.nat = fabric.routers.get(site.index).map(|r| TopologyNat {
            kind: r.kind.to_string(),
            netns: r.ns.clone(),
            private_ip: r.private_ip.to_string(),
            public_ip: r.public_ip.to_string(),
        });
        cluster.pod_netns = pods.first().map(|p| p.netns.clone());
        cluster.pod_ip = pods.first().map(|p| p.ip.to_string());
        cluster.nodes = if site.nodes.is_empty() {
            // One node: the gateway's namespace, its pod wired straight into it.
            vec![TopologyNode {
                name: "n0".to_owned(),
                netns: site.gw_ns.clone(),
                ip: site.uplink_ip.to_string(),
                gateway: true,
            }]
        } else {
            site.nodes
                .iter()
                .map(|n| TopologyNode {
                    name: n.name.clone(),
                    netns: n.netns.clone(),
                    ip: n.node_ip.to_string(),
                    gateway: n.index == 0,
                })
                .collect()
        };
        let index = site.index;
        cluster.gateways = fabric.clusters[index]
            .gateway_replica_nodes()
            .into_iter()
            .filter_map(|node| {
                let process = fabric.clusters[index].gateway_replica_process(node)?;
                Some(TopologyGateway {
                    node: site
                        .nodes
                        .get(node)
                        .map_or_else(|| "n0".to_owned(), |n| n.name.clone()),
                    netns: process.netns().to_owned(),
                    address: process.addr().to_string(),
                    pid: process.pid(),
                    // The first replica starts first and is elected first; the live answer
                    // is GetReplicaStatus (`trellis-lab failover` asks it).
                    active_at_start: node == 0,
                })
            })
            .collect();
        cluster.pods = pods
            .into_iter()
            .map(|p| TopologyPod {
                name: p.name,
                node: p.node,
                netns: p.netns,
                ip: p.ip.to_string(),
            })
            .collect();
    }
    topology.reach = reach;
    topology
}
