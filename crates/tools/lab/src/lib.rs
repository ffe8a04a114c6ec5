//! `trellis-lab`: a whole Trellis topology on one machine, the README's main command.
//!
//! Cluster 0 is the hub, the others are leaves that peer with it; with induced peering the
//! leaves then build the full mesh among themselves through the hub's Neighborhood and
//! forwarder. The lab shows progress while that happens, prints a summary and grpcurl
//! commands, and keeps running until Ctrl-C. Scripts and benchmarks rely on its contract
//! (docs/architecture.md): `--until-converged`, `--topology-file`, `--no-induced`.
//!
//! - [`config`]: the command line;
//! - [`plan`]: identities, CIDRs and ports, decided before anything starts;
//! - [`cluster`]: one cluster's six services, in this process, each with its own store;
//! - [`mesh`]: peering the leaves with the hub and waiting for the mesh;
//! - [`report`]: the summary, NAT views, grpcurl commands and the topology file;
//! - [`dataplane`]: `--dataplane netns`, the lab as namespaces with nodes, pods and real
//!   packets;
//! - [`check`]: pinging every pair of pods and the cluster × cluster matrix (`trellis-lab
//!   check`).

pub mod check;
pub mod cluster;
pub mod config;
pub mod dataplane;
pub mod failover;
pub mod mesh;
pub mod plan;
pub mod report;

use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context as _, bail};
use clap::Parser as _;
use futures::StreamExt as _;
use trellis_runtime::Shutdown;
use trellis_runtime::config::LogFormat;
use trellis_runtime::telemetry::{self, ServiceIdentity};

use crate::cluster::{LabCluster, Options};
use crate::config::{Cli, Command, DataplaneKind, StoreKind, UpConfig};
use crate::mesh::Expected;
use crate::plan::ClusterPlan;
use crate::report::Topology;

/// Clusters started at once (each start is a handful of binds and store opens, or six etcd
/// processes).
const START_CONCURRENCY: usize = 8;

/// How long the lab waits for every broker's tunnel watch to open before peering (they are all
/// listening by then; this only bounds a broker that does not answer).
const WATCH_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Free-port collisions tolerated per cluster with `--base-port 0`.
const START_ATTEMPTS: usize = 5;

/// Log lines the lab prints when `RUST_LOG` is unset: warnings only (hundreds of services share
/// the terminal). Spans are exported at `info` regardless (see `trellis_runtime::telemetry`).
pub(crate) const LOG_FILTER: &str = "warn";

/// The binary's `main`: parses the command line, sets up logging and signals, runs.
pub fn main() -> ExitCode {
    trellis_runtime::allocator::tune();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("trellis-lab: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        let identity = ServiceIdentity {
            service: "trellis-lab",
            cluster_id: "lab".to_owned(),
            cluster_name: "lab".to_owned(),
        };
        let telemetry = telemetry::init_with_default(&identity, LogFormat::Text, LOG_FILTER)?;
        let shutdown = trellis_runtime::shutdown::on_signals()?;
        let result = match cli.command {
            Command::Up(up) => run(up, shutdown, &mut std::io::stdout()).await,
            Command::Check(check) => check::run(&check, &mut std::io::stdout()).await,
            Command::Failover(failover) => failover::run(&failover, &mut std::io::stdout()).await,
        };
        telemetry.shutdown().await;
        result
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("trellis-lab: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Progress lines, stamped with the time since the lab started.
pub(crate) struct Progress<'a> {
    pub(crate) out: &'a mut dyn Write,
    started: Instant,
}

impl Progress<'_> {
    pub(crate) fn say(&mut self, message: std::fmt::Arguments<'_>) {
        let _ = writeln!(
            self.out,
            "[{:>7.2}s] {message}",
            self.started.elapsed().as_secs_f64()
        );
        let _ = self.out.flush();
    }
}

/// `trellis-lab up`: starts the topology, forms the mesh, reports, and (unless
/// `--until-converged`) waits for `shutdown`. Output goes to `out`.
pub async fn run(config: UpConfig, shutdown: Shutdown, out: &mut dyn Write) -> anyhow::Result<()> {
    config.validate()?;
    if config.store == StoreKind::Etcd && trellis_testkit::tool_path("etcd").is_none() {
        bail!(
            "--store etcd needs the etcd binary on PATH (Debian etcd-server; `make setup` installs it)"
        );
    }
    let mut progress = Progress {
        out,
        started: Instant::now(),
    };
    if config.dataplane == DataplaneKind::Netns {
        let lab = shutdown.child_token();
        let result = dataplane::run(&config, &lab, &mut progress).await;
        lab.cancel();
        return result;
    }
    let plans = plan::plan(
        config.clusters,
        config.same_pod_cidr,
        config.base_port,
        config.tls(),
    )?;
    progress.say(format_args!(
        "starting {} clusters (a hub and {} leaves), {} services with {} stores{}",
        plans.len(),
        plans.len() - 1,
        plans.len() * 6,
        match config.store {
            StoreKind::Memory => "memory",
            StoreKind::Etcd => "etcd",
        },
        match (config.induced(), config.tls()) {
            (true, true) => ", mutual TLS between clusters",
            (true, false) => ", PLAINTEXT between clusters (--insecure-plaintext-peering)",
            (false, true) => ", induced peering off, mutual TLS between clusters",
            (false, false) => ", induced peering off, PLAINTEXT between clusters",
        },
    ));
    // The lab's own token: cancelled on Ctrl-C, or by us once `--until-converged` is done.
    let lab = shutdown.child_token();
    let options = Options {
        store: config.store,
        induced: config.induced(),
    };
    let clusters = match start_all(plans, options, &lab, config.base_port == 0).await {
        Ok(clusters) => clusters,
        Err(err) => {
            lab.cancel();
            return Err(err);
        }
    };
    let plans: Vec<ClusterPlan> = clusters.iter().map(|c| c.plan.clone()).collect();
    progress.say(format_args!(
        "services listening; the hub on {}..{}",
        plans[0].ports.discovery,
        plans[0].ports.gateway.port()
    ));
    if let Some(path) = &config.topology_file {
        Topology::new(&plans, None, false).write(path)?;
        progress.say(format_args!("topology written to {}", path.display()));
    }

    let result = form_mesh(&config, &plans, &mut progress, &lab).await;
    let result = match result {
        Ok(()) if config.until_converged => Ok(()),
        Ok(()) => {
            let _ = writeln!(progress.out, "\nrunning; press Ctrl-C to stop everything");
            let _ = progress.out.flush();
            lab.cancelled().await;
            Ok(())
        }
        Err(err) => Err(err),
    };
    lab.cancel();
    let stopping = clusters.len();
    let mut first = Ok(());
    for cluster in clusters {
        if let Err(err) = cluster.finish().await {
            tracing::warn!(error = format!("{err:#}"), "service stopped with an error");
            if first.is_ok() {
                first = Err(err);
            }
        }
    }
    progress.say(format_args!("stopped {stopping} clusters"));
    // A failure to form the mesh matters more than one service's complaint on the way down.
    result.and(first)
}

async fn form_mesh(
    config: &UpConfig,
    plans: &[ClusterPlan],
    progress: &mut Progress<'_>,
    lab: &Shutdown,
) -> anyhow::Result<()> {
    let expected = Expected::new(plans, config.induced());
    // Every broker is followed from before the first Peer request, so that each tunnel is seen
    // when it is written.
    let following = mesh::Following::start(&mesh::Brokers::on_loopback(plans)?, &expected);
    following.all_watching(WATCH_LIMIT).await;
    let clock = Instant::now();
    let leaves = plans.len() - 1;
    let step = (leaves / 10).max(1);
    let peered = mesh::peer_leaves(plans, |done, total| {
        if done == total || done % step == 0 {
            progress.say(format_args!("peered {done}/{total} leaves with the hub"));
        }
    });
    tokio::select! {
        result = peered => result?,
        () = lab.cancelled() => bail!("interrupted while peering"),
    }
    let converged = following.converge(config.timeout(), |p| {
        progress.say(format_args!(
            "tunnels: full {}/{}, induced {}/{}",
            p.full, p.full_wanted, p.induced, p.induced_wanted
        ));
    });
    let converged = tokio::select! {
        result = converged => result?,
        () = lab.cancelled() => bail!("interrupted before the mesh converged"),
    };
    let elapsed = clock.elapsed();
    let snapshot = converged.snapshot;
    let totals = expected.progress(&snapshot);
    if let Some(full) = converged.full_at {
        progress.say(format_args!(
            "every full tunnel was up {:.2}s after the first Peer request",
            full.saturating_duration_since(clock).as_secs_f64()
        ));
    }
    progress.say(format_args!(
        "converged in {:.2}s: {} clusters, {} full and {} induced tunnels",
        elapsed.as_secs_f64(),
        plans.len(),
        totals.full,
        totals.induced
    ));
    if let Some(path) = &config.topology_file {
        Topology::new(plans, Some(&snapshot), true).write(path)?;
    }
    let out = &mut *progress.out;
    writeln!(out, "\n{}", report::summary(plans, &snapshot))?;
    writeln!(out, "{}", report::nat_views(plans, &snapshot))?;
    writeln!(
        out,
        "Try it (grpcurl ships in .tools/bin after `make setup`):"
    )?;
    writeln!(out, "{}", report::grpcurl_commands(plans))?;
    out.flush()?;
    Ok(())
}

/// Starts every cluster; with free ports, a cluster that lost a port race starts again on new
/// ones. Public so that `mesh-bench --mode lab` measures the clusters the lab runs.
pub async fn start_all(
    plans: Vec<ClusterPlan>,
    options: Options,
    lab: &Shutdown,
    free_ports: bool,
) -> anyhow::Result<Vec<LabCluster>> {
    let mut started: Vec<LabCluster> =
        futures::stream::iter(plans.into_iter().map(|plan| async move {
            let mut plan = plan;
            let mut attempt = 1;
            loop {
                match Box::pin(LabCluster::start(plan.clone(), options, lab)).await {
                    Err(err)
                        if attempt < START_ATTEMPTS
                            && format!("{err:#}").contains("cannot listen")
                            && (free_ports
                                || format!("{err:#}").contains("(metrics)")
                                || format!("{err:#}").contains("(dns, ")
                                || format!("{err:#}").contains("(peer listener)")) =>
                    {
                        attempt += 1;
                        plan = if free_ports {
                            plan.with_free_ports()
                        } else {
                            plan.with_other_free_ports()
                        };
                    }
                    other => {
                        return other.with_context(|| {
                            format!(
                                "starting cluster {} (ports {}..{}; another program may hold them: \
                             try --base-port)",
                                plan.id,
                                plan.ports.discovery,
                                plan.ports.gateway.port()
                            )
                        });
                    }
                }
            }
        }))
        .buffer_unordered(START_CONCURRENCY)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<anyhow::Result<_>>()?;
    started.sort_by_key(|c| c.plan.index);
    Ok(started)
}
