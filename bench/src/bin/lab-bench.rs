//! The lab against the benchmark (issue 34): `trellis-lab up --clusters N+1 --same-pod-cidr
//! --until-converged`, the command a user, a demo or a CI script runs, against `mesh-bench
//! --mode lab` with N leaves, which starts the very clusters the lab starts (six services each,
//! gateways following their brokers, `/metrics` served) with the lab's own code, and against
//! `mesh-bench --mode in-process-tls`, whose clusters run five services and neither. Each kind
//! runs `--repeats` times, alternating, every run in a process of its own; all use mutual TLS
//! between the clusters (the lab's default). The lab's times are the ones it prints:
//! "converged in S s" and "every full tunnel was up S s after the first Peer request", both
//! counted from its first Peer request, as mesh-bench counts. Two ratios of medians, taken in
//! the same run on the same machine: the lab over mesh-bench on the same clusters (what the
//! lab's own driving costs: progress, topology file, peering), and mesh-bench's lab clusters
//! over its five-service ones (what complete clusters cost). The lab binary is looked for next
//! to this one (`cargo build --release -p trellis-lab`), or at `--lab`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use trellis_bench::mesh::{Mode, one_run_to, run_alone};
use trellis_bench::proc::raise_nofile_limit;
use trellis_bench::results::{LabParameters, LabResult, LabRun, MeshRun};
use trellis_bench::{Machine, RunArgs, RunInfo, median, ratio, write_json};

/// Measures `trellis-lab up` against mesh-bench on the same clusters and on five-service ones,
/// and writes a JSON result (read by `bench-report`).
#[derive(Debug, Parser)]
struct Args {
    /// Leaves of the hub (the lab runs one cluster more: the hub).
    #[arg(long, default_value_t = 254)]
    leaves: usize,
    /// Runs of each kind (mesh-bench's two modes, the lab), alternating.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Give up on one run after this many seconds (recorded as not converged).
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// The trellis-lab binary [default: next to this binary].
    #[arg(long)]
    lab: Option<PathBuf>,
    /// Where to write the JSON result.
    #[arg(long, default_value = "bench/results/lab.json")]
    out: PathBuf,
    /// Internal: which kind of run `--one-run` is.
    #[arg(long, value_enum, hide = true, default_value_t = Mode::InProcessTls)]
    mode: Mode,
    /// Internal: measure one mesh-bench run of this many leaves and write its outcome to
    /// `--out` (every run is made so, in a process of its own).
    #[arg(long, hide = true)]
    one_run: Option<usize>,
    #[command(flatten)]
    run: RunArgs,
}

/// The seconds printed after `marker` ("... in 31.23s: ..." or "... up 10.80s after ...").
fn seconds_after(output: &str, marker: &str) -> Option<f64> {
    let line = output.lines().find(|l| l.contains(marker))?;
    let rest = &line[line.find(marker)? + marker.len()..];
    let number: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    number.parse().ok()
}

/// The CPU seconds (user + system) of the children this process waited for so far.
fn children_cpu() -> f64 {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN);
    usage.map_or(0.0, |u| {
        let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
        t(u.user_time()) + t(u.system_time())
    })
}

async fn lab_run(
    lab: &std::path::Path,
    command: &[String],
    timeout: u64,
) -> anyhow::Result<LabRun> {
    let cpu_before = children_cpu();
    let started = Instant::now();
    let child = tokio::process::Command::new(lab)
        .args(command)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", lab.display()))?;
    // The lab's own --timeout gives up first; this one is for a lab that hangs.
    let output = tokio::time::timeout(Duration::from_secs(timeout + 120), child.wait_with_output())
        .await
        .context("the lab did not finish")??;
    let wall_seconds = started.elapsed().as_secs_f64();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let converged = output.status.success();
    let seconds = seconds_after(&stdout, "converged in ");
    if converged && seconds.is_none() {
        bail!("the lab converged but printed no \"converged in\" line:\n{stdout}");
    }
    if !converged {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last: Vec<&str> = stderr.lines().rev().take(3).collect();
        eprintln!(
            "lab-bench: the lab failed ({}): {}",
            output.status,
            last.join(" | ")
        );
    }
    Ok(LabRun {
        converged,
        seconds: seconds.unwrap_or(wall_seconds),
        full_tunnels_seconds: seconds_after(&stdout, "every full tunnel was up "),
        process_cpu_seconds: Some(children_cpu() - cpu_before),
        wall_seconds,
    })
}

fn median_of(values: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    median(&values.flatten().collect::<Vec<_>>())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _telemetry = trellis_runtime::telemetry::init_with_default(
        &trellis_runtime::telemetry::ServiceIdentity {
            service: "lab-bench",
            cluster_id: String::new(),
            cluster_name: String::new(),
        },
        trellis_runtime::config::LogFormat::Text,
        "off",
    )?;
    anyhow::ensure!(args.repeats >= 1, "--repeats must be at least 1");
    anyhow::ensure!(
        (2..=254).contains(&args.leaves),
        "--leaves: 2 to 254 (a lab has at most 255 clusters)"
    );
    if let Err(err) = raise_nofile_limit() {
        eprintln!("lab-bench: could not raise the open-file limit: {err:#}");
    }
    let timeout = Duration::from_secs(args.timeout);
    if let Some(leaves) = args.one_run {
        return one_run_to(args.mode, leaves, timeout, &args.out).await;
    }
    let lab = match &args.lab {
        Some(lab) => lab.clone(),
        None => std::env::current_exe()
            .context("finding this binary")?
            .with_file_name("trellis-lab"),
    };
    anyhow::ensure!(
        lab.is_file(),
        "no trellis-lab at {}: build it (cargo build --release -p trellis-lab) or pass --lab",
        lab.display()
    );
    let command: Vec<String> = [
        "up",
        "--clusters",
        &(args.leaves + 1).to_string(),
        "--same-pod-cidr",
        "--until-converged",
        "--timeout",
        &args.timeout.to_string(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let mut result = LabResult {
        benchmark: "lab_against_mesh_bench".into(),
        run: Some(RunInfo::start(&args.run)),
        machine: Some(Machine::describe()),
        parameters: LabParameters {
            leaves: args.leaves,
            repeats: args.repeats,
            timeout_seconds: args.timeout,
            lab_command: std::iter::once("trellis-lab".to_owned())
                .chain(command.iter().cloned())
                .collect(),
            bench_mode: Some(Mode::Lab),
        },
        bench: Vec::new(),
        bare: Vec::new(),
        lab: Vec::new(),
        bench_median_seconds: None,
        lab_median_seconds: None,
        bench_full_median_seconds: None,
        lab_full_median_seconds: None,
        ratio: None,
        full_ratio: None,
        bare_median_seconds: None,
        bare_full_median_seconds: None,
        complete_cost: None,
    };
    for repeat in 0..args.repeats {
        for (mode, name) in [(Mode::InProcessTls, "five-service"), (Mode::Lab, "lab")] {
            let outcome = run_alone(mode, args.leaves, args.timeout)
                .await?
                .context("an in-process run needs nothing installed")?;
            eprintln!(
                "lab-bench: run {}, mesh-bench on {name} clusters, 1 hub + {} leaves: {} after \
                 {:.3} s (full tunnels {:.3} s)",
                repeat + 1,
                args.leaves,
                if outcome.run.converged {
                    "converged"
                } else {
                    "NOT converged"
                },
                outcome.run.seconds,
                outcome.run.full_tunnels_seconds.unwrap_or(f64::NAN),
            );
            match mode {
                Mode::Lab => result.bench.push(outcome.run),
                _ => result.bare.push(outcome.run),
            }
            write_json(&args.out, &result)?;
        }
        let run = lab_run(&lab, &command, args.timeout).await?;
        eprintln!(
            "lab-bench: run {}, trellis-lab, {} clusters: {} after {:.3} s (full tunnels {:.3} s)",
            repeat + 1,
            args.leaves + 1,
            if run.converged {
                "converged"
            } else {
                "NOT converged"
            },
            run.seconds,
            run.full_tunnels_seconds.unwrap_or(f64::NAN),
        );
        result.lab.push(run);
        write_json(&args.out, &result)?;
    }
    let converged = |runs: &[MeshRun]| -> (Option<f64>, Option<f64>) {
        let runs = || runs.iter().filter(|r| r.converged);
        (
            median_of(runs().map(|r| Some(r.seconds))),
            median_of(runs().map(|r| r.full_tunnels_seconds)),
        )
    };
    (
        result.bench_median_seconds,
        result.bench_full_median_seconds,
    ) = converged(&result.bench);
    (result.bare_median_seconds, result.bare_full_median_seconds) = converged(&result.bare);
    let converged_lab = || result.lab.iter().filter(|r| r.converged);
    result.lab_median_seconds = median_of(converged_lab().map(|r| Some(r.seconds)));
    result.lab_full_median_seconds = median_of(converged_lab().map(|r| r.full_tunnels_seconds));
    result.ratio = ratio(result.lab_median_seconds, result.bench_median_seconds);
    result.full_ratio = ratio(
        result.lab_full_median_seconds,
        result.bench_full_median_seconds,
    );
    result.complete_cost = ratio(result.bench_median_seconds, result.bare_median_seconds);
    write_json(&args.out, &result)?;
    let shown = |v: Option<f64>, digits: usize| {
        v.map_or_else(|| "none".to_owned(), |v| format!("{v:.digits$}"))
    };
    eprintln!(
        "lab-bench: {} leaves, medians: setup mesh-bench {} s on the lab's clusters ({} s on \
         five-service ones: complete clusters cost {}), lab {} s (ratio {}); full tunnels \
         mesh-bench {} s, lab {} s (ratio {})",
        args.leaves,
        shown(result.bench_median_seconds, 3),
        shown(result.bare_median_seconds, 3),
        shown(result.complete_cost, 2),
        shown(result.lab_median_seconds, 3),
        shown(result.ratio, 2),
        shown(result.bench_full_median_seconds, 3),
        shown(result.lab_full_median_seconds, 3),
        shown(result.full_ratio, 2),
    );
    eprintln!("lab-bench: wrote {}", args.out.display());
    Ok(())
}
