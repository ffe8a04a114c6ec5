//! Full induced mesh setup time versus the number of leaves: one hub and n leaves, all with
//! the same pod and external CIDRs, every cluster's five services in this process with memory
//! stores (`trellis_integration::cluster::InProcessCluster`). The clock starts when the leaves
//! send their Peer requests to the hub and stops when every leaf holds an induced
//! TunnelEndpoint for every other leaf (n·(n-1) in total). After convergence it records what
//! the hub holds: TunnelEndpoints, NetworkConfigs, relays still in flight, IPAM records, and
//! the size of each hub service's store (keys, and bytes of keys plus values).
//!
//! The leaves are `InProcessCluster`s; the hub is started here from the same flags, keeping
//! each service's core so that its store can be read after convergence.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use serde::Serialize;
use tonic::transport::Channel;
use trellis_api::pb::ipam::ListClusterSubnetsRequest;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::forwarder_client::ForwarderClient;
use trellis_api::pb::peering::{
    GetTokenRequest, ListNetworkConfigsRequest, ListRelaysRequest, ListTunnelEndpointsRequest,
    PeerRequest,
};
use trellis_api::pb::types::PeeringKind;
use trellis_bench::Machine;
use trellis_integration::cluster::InProcessCluster;
use trellis_runtime::Shutdown;
use trellis_store::{SharedStore, StoreSize};

/// Measures induced mesh setup time and writes a JSON result.
#[derive(Debug, Parser)]
struct Args {
    /// Numbers of leaves to measure.
    #[arg(long, value_delimiter = ',', default_values_t = [2usize, 5, 10, 20, 50])]
    leaves: Vec<usize>,
    /// Runs per size; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Give up on one run after this many seconds.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Where to write the JSON result.
    #[arg(long, default_value = "bench/results/mesh.json")]
    out: PathBuf,
}

#[derive(Debug, Serialize)]
struct Run {
    seconds: f64,
}

/// One hub service's store after convergence.
#[derive(Debug, Clone, Copy, Default, Serialize)]
struct StoreUse {
    keys: usize,
    /// Keys plus values, in bytes.
    bytes: usize,
}

impl From<StoreSize> for StoreUse {
    fn from(size: StoreSize) -> Self {
        Self {
            keys: size.keys,
            bytes: size.bytes,
        }
    }
}

/// The hub's stores after convergence, per service, and their sum.
#[derive(Debug, Clone, Copy, Default, Serialize)]
struct HubStores {
    discovery: StoreUse,
    broker: StoreUse,
    forwarder: StoreUse,
    ipam: StoreUse,
    gateway: StoreUse,
    total: StoreUse,
}

/// What the hub holds after convergence.
#[derive(Debug, Clone, Copy, Default)]
struct Held {
    tunnels: usize,
    ncs: usize,
    relays: usize,
    ipam: usize,
    stores: HubStores,
}

#[derive(Debug, Serialize)]
struct Size {
    leaves: usize,
    induced_tunnel_endpoints: usize,
    runs: Vec<Run>,
    median_seconds: f64,
    hub_tunnel_endpoints: usize,
    hub_network_configs: usize,
    hub_relays_in_flight: usize,
    hub_ipam_records: usize,
    /// From the last run.
    hub_stores: HubStores,
}

#[derive(Debug, Serialize)]
struct Report {
    benchmark: &'static str,
    machine: Machine,
    sizes: Vec<Size>,
}

/// The hub: the five services of [`InProcessCluster`], started with the same flags, whose
/// stores stay reachable.
struct Hub {
    broker: SocketAddr,
    forwarder: SocketAddr,
    ipam: SocketAddr,
    stores: [(&'static str, SharedStore); 5],
    shutdown: Shutdown,
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

fn flags(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

impl Hub {
    /// Ports are picked before binding (discovery advertises them first): on a collision the
    /// whole hub starts again on fresh ports.
    async fn start(id: &str, pod_cidr: &str, external_cidr: &str) -> anyhow::Result<Self> {
        let mut attempt = 0;
        loop {
            match Self::start_once(id, pod_cidr, external_cidr).await {
                Err(err) if attempt < 5 && format!("{err:#}").contains("cannot listen") => {
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    async fn start_once(id: &str, pod_cidr: &str, external_cidr: &str) -> anyhow::Result<Self> {
        use clap::Parser as _;
        let free = trellis_integration::free_addr;
        let (discovery, broker, forwarder, ipam, gateway) =
            (free(), free(), free(), free(), free());
        let shutdown = Shutdown::new();
        let stop_on_failure = shutdown.clone().drop_guard();
        let common = |listen: SocketAddr, extra: &[&str]| {
            let mut args = flags(&[
                "x",
                "--listen",
                &listen.to_string(),
                "--store",
                "memory://",
                "--cluster-id",
                id,
                "--shutdown-grace",
                "1",
            ]);
            args.extend(flags(extra));
            args
        };
        let mut tasks = Vec::new();

        let started = trellis_ipam::start(
            trellis_ipam::Config::try_parse_from(common(
                ipam,
                &["--pod-cidr", pod_cidr, "--external-cidr", external_cidr],
            ))?,
            shutdown.clone(),
        )
        .await
        .context("ipam")?;
        let ipam_store = started.core.store().clone();
        tasks.push(started.task);

        let started = trellis_gateway::start(
            trellis_gateway::Config::try_parse_from(common(
                gateway,
                &["--dataplane", "none", "--endpoint-address", "127.0.0.1"],
            ))?,
            shutdown.clone(),
        )
        .await
        .context("gateway")?;
        let gateway_store = started.core.store().clone();
        tasks.push(started.task);

        let started = trellis_discovery::start(
            trellis_discovery::Config::try_parse_from(common(
                discovery,
                &[
                    "--advertise-discovery",
                    &discovery.to_string(),
                    "--advertise-broker",
                    &broker.to_string(),
                    "--advertise-forwarder",
                    &forwarder.to_string(),
                    "--advertise-ipam",
                    &ipam.to_string(),
                    "--advertise-gateway",
                    &gateway.to_string(),
                    "--neighborhood-resync",
                    "5",
                    "--neighborhood-retry-max",
                    "2",
                ],
            ))?,
            shutdown.clone(),
        )
        .await
        .context("discovery")?;
        let discovery_store = started.core.store().clone();
        tasks.push(started.task);

        let started = trellis_forwarder::start(
            trellis_forwarder::Config::try_parse_from(common(
                forwarder,
                &["--discovery", &discovery.to_string(), "--retry-max", "1"],
            ))?,
            shutdown.clone(),
        )
        .await
        .context("forwarder")?;
        let forwarder_store = started.core.store().clone();
        tasks.push(started.task);

        let started = trellis_broker::start(
            trellis_broker::Config::try_parse_from(common(
                broker,
                &[
                    "--discovery",
                    &discovery.to_string(),
                    "--ipam",
                    &ipam.to_string(),
                    "--gateway",
                    &gateway.to_string(),
                    "--resync",
                    "2",
                ],
            ))?,
            shutdown.clone(),
        )
        .await
        .context("broker")?;
        let broker_store = started.core.store().clone();
        tasks.push(started.task);

        stop_on_failure.disarm();
        Ok(Self {
            broker,
            forwarder,
            ipam,
            stores: [
                ("discovery", discovery_store),
                ("broker", broker_store),
                ("forwarder", forwarder_store),
                ("ipam", ipam_store),
                ("gateway", gateway_store),
            ],
            shutdown,
            tasks,
        })
    }

    async fn channel(addr: SocketAddr) -> anyhow::Result<Channel> {
        Ok(Channel::from_shared(format!("http://{addr}"))?
            .connect()
            .await?)
    }

    async fn broker(&self) -> anyhow::Result<BrokerClient<Channel>> {
        Ok(BrokerClient::new(Self::channel(self.broker).await?))
    }

    /// Every key of every service's store, counted.
    async fn stores(&self) -> anyhow::Result<HubStores> {
        let mut out = HubStores::default();
        for (service, store) in &self.stores {
            let size = StoreUse::from(store.size("").await?);
            out.total.keys += size.keys;
            out.total.bytes += size.bytes;
            match *service {
                "discovery" => out.discovery = size,
                "broker" => out.broker = size,
                "forwarder" => out.forwarder = size,
                "ipam" => out.ipam = size,
                _ => out.gateway = size,
            }
        }
        Ok(out)
    }

    async fn stop(mut self) {
        self.shutdown.cancel();
        for task in self.tasks.drain(..) {
            let _ = task.await;
        }
    }
}

async fn induced(cluster: &InProcessCluster) -> usize {
    let Ok(mut broker) = cluster.broker().await else {
        return 0;
    };
    broker
        .list_tunnel_endpoints(ListTunnelEndpointsRequest {
            cluster_id: String::new(),
            kind: PeeringKind::Induced as i32,
        })
        .await
        .map_or(0, |r| r.into_inner().tunnel_endpoints.len())
}

/// One run: returns the setup time and, from the last run, the hub's holdings.
async fn run(leaves: usize, timeout: Duration) -> anyhow::Result<(Duration, Held)> {
    let hub = Hub::start("hub", "10.0.0.0/16", "10.201.0.0/16").await?;
    let mut clusters = Vec::with_capacity(leaves);
    for n in 0..leaves {
        clusters.push(
            InProcessCluster::start(&format!("leaf-{n:03}"), "10.0.0.0/16", "10.201.0.0/16")
                .await?,
        );
    }
    let token = hub
        .broker()
        .await?
        .get_token(GetTokenRequest {})
        .await?
        .into_inner()
        .token;
    let expected = leaves * (leaves - 1);

    let started = Instant::now();
    let mut peerings = Vec::new();
    for leaf in &clusters {
        let mut broker = leaf.broker().await?;
        let request = PeerRequest {
            broker_address: hub.broker.to_string(),
            token: token.clone(),
            expected_cluster_id: "hub".into(),
        };
        peerings.push(tokio::spawn(async move { broker.peer(request).await }));
    }
    for peering in peerings {
        peering.await?.context("a leaf peers with the hub")?;
    }
    loop {
        let mut total = 0;
        for leaf in &clusters {
            total += induced(leaf).await;
        }
        if total == expected {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < timeout,
            "only {total} of {expected} induced tunnel endpoints after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed();

    let tunnels = hub
        .broker()
        .await?
        .list_tunnel_endpoints(ListTunnelEndpointsRequest::default())
        .await?
        .into_inner()
        .tunnel_endpoints
        .len();
    let ncs = hub
        .broker()
        .await?
        .list_network_configs(ListNetworkConfigsRequest::default())
        .await?
        .into_inner()
        .network_configs
        .len();
    let relays = ForwarderClient::connect(format!("http://{}", hub.forwarder))
        .await?
        .list_relays(ListRelaysRequest::default())
        .await?
        .into_inner()
        .relays
        .len();
    let ipam = trellis_api::pb::ipam::ipam_client::IpamClient::new(Hub::channel(hub.ipam).await?)
        .list_cluster_subnets(ListClusterSubnetsRequest {})
        .await?
        .into_inner()
        .clusters
        .len();
    let stores = hub.stores().await?;
    hub.stop().await;
    for leaf in clusters {
        leaf.stop().await;
    }
    Ok((
        elapsed,
        Held {
            tunnels,
            ncs,
            relays,
            ipam,
            stores,
        },
    ))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut sizes = Vec::new();
    for &leaves in &args.leaves {
        anyhow::ensure!(leaves >= 2, "--leaves: a mesh needs at least 2 leaves");
        let mut runs = Vec::new();
        let mut held = Held::default();
        for repeat in 0..args.repeats {
            let (elapsed, hub) = run(leaves, Duration::from_secs(args.timeout)).await?;
            eprintln!(
                "mesh-bench: 1 hub + {leaves} leaves, run {}: {:.3} s",
                repeat + 1,
                elapsed.as_secs_f64()
            );
            runs.push(Run {
                seconds: elapsed.as_secs_f64(),
            });
            held = hub;
        }
        let mut sorted: Vec<f64> = runs.iter().map(|r| r.seconds).collect();
        sorted.sort_by(f64::total_cmp);
        sizes.push(Size {
            leaves,
            induced_tunnel_endpoints: leaves * (leaves - 1),
            median_seconds: sorted[sorted.len() / 2],
            runs,
            hub_tunnel_endpoints: held.tunnels,
            hub_network_configs: held.ncs,
            hub_relays_in_flight: held.relays,
            hub_ipam_records: held.ipam,
            hub_stores: held.stores,
        });
    }
    let report = Report {
        benchmark: "induced_mesh_setup",
        machine: Machine::describe(),
        sizes,
    };
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)? + "\n")?;
    eprintln!(
        "| leaves | induced TEs | median s | hub TEs | hub NCs | hub relays | hub IPAM records |"
    );
    eprintln!("|---|---|---|---|---|---|---|");
    for s in &report.sizes {
        eprintln!(
            "| {} | {} | {:.3} | {} | {} | {} | {} |",
            s.leaves,
            s.induced_tunnel_endpoints,
            s.median_seconds,
            s.hub_tunnel_endpoints,
            s.hub_network_configs,
            s.hub_relays_in_flight,
            s.hub_ipam_records
        );
    }
    eprintln!(
        "| leaves | discovery keys/bytes | broker | forwarder | ipam | gateway | total keys | total bytes |"
    );
    eprintln!("|---|---|---|---|---|---|---|---|");
    for s in &report.sizes {
        let h = &s.hub_stores;
        let kb = |u: &StoreUse| format!("{} / {}", u.keys, u.bytes);
        eprintln!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            s.leaves,
            kb(&h.discovery),
            kb(&h.broker),
            kb(&h.forwarder),
            kb(&h.ipam),
            kb(&h.gateway),
            h.total.keys,
            h.total.bytes
        );
    }
    eprintln!("mesh-bench: wrote {}", args.out.display());
    Ok(())
}
