//! Full induced mesh setup time versus the number of leaves: one hub and n leaves, all with
//! the same pod CIDR (so every cluster remaps every other's) and each with an external /24 of
//! its own, as the lab does: remapping both /16s of 254 peers would take 508 /16s, and the
//! IPAM's default pools hold 273, so no leaf could map more than about 135 peers (until this
//! was found, a 254-leaf run stalled near 28 % of its induced tunnels for that reason alone:
//! each end had mapped about half of the others, in its own order). The clock starts
//! when the leaves send their Peer requests to the hub and stops when every leaf holds an
//! induced TunnelEndpoint for every other leaf (n·(n-1) in total). The modes (`--mode`):
//!
//! - **in-process** (default): every cluster's five services in this process with memory
//!   stores (leaves are `trellis_integration::cluster::InProcessCluster`s; the hub is started
//!   here from the same flags, keeping each service's core so that its store can be sized after
//!   convergence: keys, and bytes of keys plus values);
//! - **hub-processes**: the same, but the hub's five services are the release service binaries
//!   as child processes (memory stores), so that the hub's CPU time (utime + stime) and peak
//!   memory (VmHWM) can be read from /proc at convergence;
//! - **hub-etcd**: the hub is a `trellis_integration::processes::ProcessCluster` (every service
//!   a process of the service binaries with its own etcd, as in production), the leaves run in
//!   this process as above: the hub's CPU, memory, etcd keys and etcd writes (each etcd's
//!   revision, which every write transaction raises by one) per induced tunnel at sizes up to
//!   254 leaves (issue 17);
//! - **etcd-processes**: hub and leaves as `ProcessCluster`s, every service a process with its
//!   own etcd; small n only. The hub's CPU, memory, etcd keys and writes are read as above.
//! - **lab**: the clusters `trellis-lab up --same-pod-cidr` runs, started by the lab's own code
//!   in this process: six services each (the endpoints service too), mutual TLS with the
//!   certificates the services make, gateways following their brokers, `/metrics` served. What
//!   a complete cluster costs over the in-process modes' five services shows next to
//!   **in-process-tls** (`lab-bench` runs both).
//!
//! A run that does not converge within `--timeout` is recorded (with how many induced
//! TunnelEndpoints existed) and the larger sizes are skipped, unless `--keep-going`.
//! Every run is a process of its own (this binary with the hidden `--one-run`), so that the
//! memory and CPU it records are its own, not partly an earlier run's.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use trellis_bench::mesh::{
    Mode, hold, one_run_to, print_table, reexec_from_deps, run_alone, summarize,
};
use trellis_bench::proc::raise_nofile_limit;
use trellis_bench::results::{MeshParameters, MeshResult, MeshSize, SizeStatus};
use trellis_bench::{Machine, RunArgs, RunInfo, write_json};

/// Measures induced mesh setup time (and what the hub holds and spends) and writes a JSON
/// result (read by `bench-report`).
#[derive(Debug, Parser)]
struct Args {
    /// Where the clusters' services run and what they store in; see the module doc.
    #[arg(long, value_enum, default_value_t = Mode::InProcess)]
    mode: Mode,
    /// Numbers of leaves to measure (at least 2 each), in order.
    #[arg(long, value_delimiter = ',', default_values_t = [2usize, 5, 10, 20, 50, 100, 254])]
    leaves: Vec<usize>,
    /// Runs per size; medians are reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Give up on one run after this many seconds (recorded as not converged).
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// After a size does not converge, still try the larger ones (by default they are
    /// recorded as skipped: they would only time out too).
    #[arg(long)]
    keep_going: bool,
    /// Where to write the JSON result [default: bench/results/mesh.json,
    /// mesh-hub-processes.json, mesh-hub-etcd.json or mesh-etcd.json by mode].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Internal: measure one run of this many leaves and write its outcome to `--out` (the
    /// benchmark runs every repeat so, in a process of its own).
    #[arg(long, hide = true)]
    one_run: Option<usize>,
    #[command(flatten)]
    run: RunArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Every service of the in-process clusters logs through this one subscriber: quiet unless
    // RUST_LOG asks (what a slow run waits on shows at debug).
    let _telemetry = trellis_runtime::telemetry::init_with_default(
        &trellis_runtime::telemetry::ServiceIdentity {
            service: "mesh-bench",
            cluster_id: String::new(),
            cluster_name: String::new(),
        },
        trellis_runtime::config::LogFormat::Text,
        "off",
    )?;
    anyhow::ensure!(args.repeats >= 1, "--repeats must be at least 1");
    if let Some(bad) = args.leaves.iter().find(|n| **n < 2) {
        anyhow::bail!("--leaves: a mesh needs at least 2 leaves, got {bad}");
    }
    if args.mode.hub_on_etcd() {
        reexec_from_deps()?;
    }
    let open_files_limit = match raise_nofile_limit() {
        Ok(limit) => Some(limit),
        Err(err) => {
            eprintln!("mesh-bench: could not raise the open-file limit: {err:#}");
            None
        }
    };
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(args.mode.default_out()));
    let timeout = Duration::from_secs(args.timeout);
    if let Some(leaves) = args.one_run {
        return one_run_to(args.mode, leaves, timeout, &out).await;
    }
    let run_info = RunInfo::start(&args.run);
    // Written again after every size, so a run stopped midway keeps the sizes it measured.
    let mut report = MeshResult {
        benchmark: "induced_mesh_setup".into(),
        mode: Some(args.mode),
        run: Some(run_info),
        machine: Some(Machine::describe()),
        parameters: Some(MeshParameters {
            leaves: args.leaves.clone(),
            repeats: args.repeats,
            timeout_seconds: args.timeout,
            keep_going: args.keep_going,
            open_files_limit,
        }),
        sizes: Vec::new(),
    };
    let mut gave_up: Option<String> = None;
    for &leaves in &args.leaves {
        let expected = leaves * (leaves - 1);
        let mut size = MeshSize::new(leaves);
        if let Some(reason) = &gave_up {
            size.status = SizeStatus::Skipped;
            size.reason = Some(reason.clone());
            eprintln!("mesh-bench: 1 hub + {leaves} leaves skipped: {reason}");
            report.sizes.push(size);
            write_json(&out, &report)?;
            continue;
        }
        let mut peaks = Vec::new();
        for repeat in 0..args.repeats {
            match run_alone(args.mode, leaves, args.timeout).await {
                Ok(None) => {
                    size.status = SizeStatus::Skipped;
                    size.reason = Some("etcd is not installed (`make setup`)".into());
                    break;
                }
                Ok(Some(outcome)) => {
                    eprintln!(
                        "mesh-bench: {:?}, 1 hub + {leaves} leaves, run {}: {} after {:.3} s ({} of {expected} induced TunnelEndpoints)",
                        args.mode,
                        repeat + 1,
                        if outcome.run.converged {
                            "converged"
                        } else {
                            "NOT converged"
                        },
                        outcome.run.seconds,
                        outcome.run.induced_reached
                    );
                    let converged = outcome.run.converged;
                    size.runs.push(outcome.run);
                    if let Some(held) = outcome.held {
                        hold(&mut size, held, &mut peaks);
                    }
                    if !converged {
                        size.status = SizeStatus::TimedOut;
                        size.reason = Some(format!(
                            "not converged within {} s; later repeats not run",
                            args.timeout
                        ));
                        break;
                    }
                }
                Err(err) => {
                    eprintln!("mesh-bench: 1 hub + {leaves} leaves failed: {err:#}");
                    size.status = SizeStatus::Failed;
                    size.reason = Some(format!("{err:#}"));
                    break;
                }
            }
        }
        summarize(&mut size, &peaks);
        if matches!(size.status, SizeStatus::TimedOut | SizeStatus::Failed) && !args.keep_going {
            gave_up = Some(format!(
                "1 hub + {leaves} leaves did not converge ({})",
                size.reason.as_deref().unwrap_or("")
            ));
        }
        report.sizes.push(size);
        write_json(&out, &report)?;
    }
    print_table(&report.sizes);
    eprintln!("mesh-bench: wrote {}", out.display());
    Ok(())
}
