//! Full induced mesh setup time versus the number of leaves: one hub and n leaves, all with
//! the same pod and external CIDRs, every cluster's five services in this process with memory
//! stores (`trellis_integration::cluster::InProcessCluster`). The clock starts when the leaves
//! send their Peer requests to the hub and stops when every leaf holds an induced
//! TunnelEndpoint for every other leaf (n·(n-1) in total). After convergence it records what
//! the hub holds: TunnelEndpoints, NetworkConfigs, relays still in flight, IPAM records.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use serde::Serialize;
use trellis_api::pb::ipam::ListClusterSubnetsRequest;
use trellis_api::pb::peering::forwarder_client::ForwarderClient;
use trellis_api::pb::peering::{
    GetTokenRequest, ListNetworkConfigsRequest, ListRelaysRequest, ListTunnelEndpointsRequest,
    PeerRequest,
};
use trellis_api::pb::types::PeeringKind;
use trellis_bench::Machine;
use trellis_integration::cluster::InProcessCluster;

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
}

#[derive(Debug, Serialize)]
struct Report {
    benchmark: &'static str,
    machine: Machine,
    sizes: Vec<Size>,
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
async fn run(leaves: usize, timeout: Duration) -> anyhow::Result<(Duration, [usize; 4])> {
    let hub = InProcessCluster::start("hub", "10.0.0.0/16", "10.201.0.0/16").await?;
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
            broker_address: hub.services.broker.to_string(),
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
    let relays = ForwarderClient::connect(format!("http://{}", hub.services.forwarder))
        .await?
        .list_relays(ListRelaysRequest::default())
        .await?
        .into_inner()
        .relays
        .len();
    let ipam = hub
        .ipam()
        .await?
        .list_cluster_subnets(ListClusterSubnetsRequest {})
        .await?
        .into_inner()
        .clusters
        .len();
    hub.stop().await;
    for leaf in clusters {
        leaf.stop().await;
    }
    Ok((elapsed, [tunnels, ncs, relays, ipam]))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut sizes = Vec::new();
    for &leaves in &args.leaves {
        anyhow::ensure!(leaves >= 2, "--leaves: a mesh needs at least 2 leaves");
        let mut runs = Vec::new();
        let mut held = [0; 4];
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
            hub_tunnel_endpoints: held[0],
            hub_network_configs: held[1],
            hub_relays_in_flight: held[2],
            hub_ipam_records: held[3],
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
    eprintln!("mesh-bench: wrote {}", args.out.display());
    Ok(())
}
