//! What mutual TLS between the clusters costs the induced mesh's setup (issue 37): one hub and
//! `--leaves` leaves in this process, built as `mesh-bench --mode in-process` builds them, set
//! up in plaintext (`--insecure-plaintext-peering`) and with mutual TLS (`mesh-bench --mode
//! in-process-tls`: every cluster-facing service on a peer listener, the hub's services making
//! its CA and their certificates in a directory, the leaves pinning the hub's CA at first
//! contact as a join command does), alternately, `--repeats` times each, every run in a
//! process of its own. The clock is mesh-bench's: from the leaves' Peer requests until every
//! leaf holds an induced TunnelEndpoint for every other. The ratio of the two medians, taken
//! in the same run on the same machine, is the price of security; the absolute seconds depend
//! on the machine.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use trellis_bench::mesh::{Mode, one_run_to, run_alone};
use trellis_bench::proc::raise_nofile_limit;
use trellis_bench::results::{MeshRun, TlsParameters, TlsResult};
use trellis_bench::{Machine, RunArgs, RunInfo, median, write_json};

/// Measures the induced mesh's setup with mutual TLS against plaintext and writes a JSON
/// result (read by `bench-report`).
#[derive(Debug, Parser)]
struct Args {
    /// Leaves of the hub.
    #[arg(long, default_value_t = 100)]
    leaves: usize,
    /// Runs of each kind (plaintext, TLS), alternating.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Give up on one run after this many seconds (recorded as not converged).
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Where to write the JSON result.
    #[arg(long, default_value = "bench/results/tls.json")]
    out: PathBuf,
    /// Internal: which kind of run `--one-run` is.
    #[arg(long, value_enum, hide = true, default_value_t = Mode::InProcess)]
    mode: Mode,
    /// Internal: measure one run of this many leaves and write its outcome to `--out` (every
    /// run is made so, in a process of its own).
    #[arg(long, hide = true)]
    one_run: Option<usize>,
    #[command(flatten)]
    run: RunArgs,
}

fn medians(runs: &[MeshRun]) -> Option<f64> {
    let converged: Vec<f64> = runs
        .iter()
        .filter(|r| r.converged)
        .map(|r| r.seconds)
        .collect();
    median(&converged)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _telemetry = trellis_runtime::telemetry::init_with_default(
        &trellis_runtime::telemetry::ServiceIdentity {
            service: "tls-bench",
            cluster_id: String::new(),
            cluster_name: String::new(),
        },
        trellis_runtime::config::LogFormat::Text,
        "off",
    )?;
    anyhow::ensure!(args.repeats >= 1, "--repeats must be at least 1");
    anyhow::ensure!(args.leaves >= 2, "--leaves: a mesh needs at least 2 leaves");
    anyhow::ensure!(
        matches!(args.mode, Mode::InProcess | Mode::InProcessTls),
        "--mode: in-process or in-process-tls"
    );
    if let Err(err) = raise_nofile_limit() {
        eprintln!("tls-bench: could not raise the open-file limit: {err:#}");
    }
    let timeout = Duration::from_secs(args.timeout);
    if let Some(leaves) = args.one_run {
        return one_run_to(args.mode, leaves, timeout, &args.out).await;
    }
    let mut result = TlsResult {
        benchmark: "mesh_setup_tls_against_plaintext".into(),
        run: Some(RunInfo::start(&args.run)),
        machine: Some(Machine::describe()),
        parameters: TlsParameters {
            leaves: args.leaves,
            repeats: args.repeats,
            timeout_seconds: args.timeout,
        },
        plaintext: Vec::new(),
        tls: Vec::new(),
        plaintext_median_seconds: None,
        tls_median_seconds: None,
        ratio: None,
    };
    for repeat in 0..args.repeats {
        for (mode, name) in [(Mode::InProcess, "plaintext"), (Mode::InProcessTls, "TLS")] {
            let outcome = run_alone(mode, args.leaves, args.timeout)
                .await?
                .context("an in-process run needs nothing installed")?;
            eprintln!(
                "tls-bench: run {}, {name}, 1 hub + {} leaves: {} after {:.3} s",
                repeat + 1,
                args.leaves,
                if outcome.run.converged {
                    "converged"
                } else {
                    "NOT converged"
                },
                outcome.run.seconds
            );
            match mode {
                Mode::InProcessTls => result.tls.push(outcome.run),
                _ => result.plaintext.push(outcome.run),
            }
            // Written after every run, so a run stopped midway keeps what it measured.
            write_json(&args.out, &result)?;
        }
    }
    result.plaintext_median_seconds = medians(&result.plaintext);
    result.tls_median_seconds = medians(&result.tls);
    result.ratio = match (result.tls_median_seconds, result.plaintext_median_seconds) {
        (Some(tls), Some(plain)) if plain > 0.0 => Some(tls / plain),
        _ => None,
    };
    write_json(&args.out, &result)?;
    eprintln!(
        "tls-bench: 1 hub + {} leaves, median setup: plaintext {}, mutual TLS {}, ratio {}",
        args.leaves,
        result
            .plaintext_median_seconds
            .map_or_else(|| "none".into(), |s| format!("{s:.3} s")),
        result
            .tls_median_seconds
            .map_or_else(|| "none".into(), |s| format!("{s:.3} s")),
        result
            .ratio
            .map_or_else(|| "none".into(), |r| format!("{r:.2}"))
    );
    eprintln!("tls-bench: wrote {}", args.out.display());
    Ok(())
}
