//! The result files, as one set of types: every benchmark binary serializes its result with
//! them and the report generator ([`crate::report`]) deserializes the same types. Results
//! written by earlier versions of the benchmarks (`bench/results/**.json`) must stay readable:
//! a field added later is `#[serde(default)]`, an `Option` where the report says "not
//! recorded" rather than showing a default, and a field whose writer may produce a non-finite
//! number is an `Option` too (serde_json writes NaN as `null`).

mod dataplane;
mod endpoints;
mod exports;
mod failover;
mod gateway_rules;
mod ipam;
mod lab;
mod latency;
mod mesh;
mod nat;
mod run;
mod tls;

pub use dataplane::{
    Comparison, CpuLatencyLimit, DataplaneResult, Emulation, NodePathResult, RequestResponse,
    RrComparison, RrPath, Rtt, RttOverhead, Side, SideBySide, Throughput, Transfer,
};
pub use endpoints::{EndpointsParameters, EndpointsResult, EndpointsScenario};
pub use exports::{DnsLoad, ExportsParameters, ExportsResult};
pub use failover::{FailoverParameters, FailoverResult, Kill, Spread};
pub use gateway_rules::{GatewayRulesParameters, GatewayRulesResult, RulesVariant};
pub use ipam::{Consistency, IpamParameters, IpamResult, IpamScenario, MetricsOverhead};
pub use lab::{LabParameters, LabResult, LabRun};
pub use latency::LatencySummary;
pub use mesh::{
    HubProcess, HubStores, MeshParameters, MeshResult, MeshRun, MeshSize, Mode, SizeStatus,
    StoreUse,
};
pub use nat::{
    LeafTimes, NatCell, NatParameters, NatRepeat, NatResult, PairSample, PathMeasure, PathSummary,
    Percentiles,
};
pub use run::{Header, Machine, RunInfo, RunKind};
pub use tls::{TlsParameters, TlsResult};

use serde::{Deserialize, Serialize};

/// Where a benchmark's services keep their state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Store {
    Memory,
    Etcd,
}

impl Store {
    /// The name the result files use.
    pub fn as_str(self) -> &'static str {
        match self {
            Store::Memory => "memory",
            Store::Etcd => "etcd",
        }
    }
}

impl std::fmt::Display for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `Some(v)` for a finite `v`: the JSON of a non-finite number is `null`, read back as `None`.
pub fn finite(v: f64) -> Option<f64> {
    v.is_finite().then_some(v)
}
