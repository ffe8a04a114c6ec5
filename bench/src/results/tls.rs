//! `tls-bench`'s result (`bench/results/tls.json`): the induced mesh's setup time with mutual
//! TLS between the clusters against plaintext, measured alternately in one run.

use serde::{Deserialize, Serialize};

use super::{Machine, MeshRun, RunInfo};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TlsResult {
    #[serde(default)]
    pub benchmark: String,
    #[serde(default)]
    pub run: Option<RunInfo>,
    #[serde(default)]
    pub machine: Option<Machine>,
    pub parameters: TlsParameters,
    /// Each plaintext run, in the order run (alternating with the TLS runs).
    pub plaintext: Vec<MeshRun>,
    /// Each mutual-TLS run.
    pub tls: Vec<MeshRun>,
    /// Medians of the converged runs' setup seconds (none when no run converged).
    pub plaintext_median_seconds: Option<f64>,
    pub tls_median_seconds: Option<f64>,
    /// TLS median over plaintext median: the price of security.
    pub ratio: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TlsParameters {
    pub leaves: usize,
    pub repeats: usize,
    pub timeout_seconds: u64,
}
