//! `lab-bench`'s result (`bench/results/lab.json`): `trellis-lab up` (the command a user runs)
//! against `mesh-bench` measuring the lab's own clusters (`--mode lab`), and both beside
//! mesh-bench's five-service clusters (`--mode in-process-tls`), measured alternately in one run
//! (issue 34).

use serde::{Deserialize, Serialize};

use super::{Machine, MeshRun, Mode, RunInfo};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LabResult {
    #[serde(default)]
    pub benchmark: String,
    #[serde(default)]
    pub run: Option<RunInfo>,
    #[serde(default)]
    pub machine: Option<Machine>,
    pub parameters: LabParameters,
    /// Each mesh-bench run in `parameters.bench_mode`, in the order run (alternating with the
    /// lab's).
    pub bench: Vec<MeshRun>,
    /// With `bench_mode` lab: each `mesh-bench --mode in-process-tls` run, whose clusters run
    /// five services without the gateways following their brokers or `/metrics` served.
    #[serde(default)]
    pub bare: Vec<MeshRun>,
    /// Each `trellis-lab up --until-converged` run.
    pub lab: Vec<LabRun>,
    /// Medians of the converged runs (none when no run of a kind converged).
    pub bench_median_seconds: Option<f64>,
    pub lab_median_seconds: Option<f64>,
    pub bench_full_median_seconds: Option<f64>,
    pub lab_full_median_seconds: Option<f64>,
    /// Lab median over bench median: setup, and every full tunnel up.
    pub ratio: Option<f64>,
    pub full_ratio: Option<f64>,
    #[serde(default)]
    pub bare_median_seconds: Option<f64>,
    #[serde(default)]
    pub bare_full_median_seconds: Option<f64>,
    /// What complete clusters cost: the bench median (the lab's clusters) over the bare one.
    #[serde(default)]
    pub complete_cost: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LabParameters {
    /// Leaves of the hub (the lab runs `--clusters leaves + 1`).
    pub leaves: usize,
    pub repeats: usize,
    pub timeout_seconds: u64,
    /// The lab's command line.
    pub lab_command: Vec<String>,
    /// The mode of the `bench` runs (absent in results from before `--mode lab`, whose `bench`
    /// runs were in-process-tls).
    #[serde(default)]
    pub bench_mode: Option<Mode>,
}

/// One lab run, as the lab reported it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LabRun {
    pub converged: bool,
    /// "converged in S s": from the first Peer request until every tunnel exists.
    pub seconds: f64,
    /// "every full tunnel was up S s after the first Peer request".
    pub full_tunnels_seconds: Option<f64>,
    /// The lab process's CPU time, start-up and shutdown included (user + system).
    pub process_cpu_seconds: Option<f64>,
    /// Wall time of the whole command, start-up and shutdown included.
    pub wall_seconds: f64,
}
