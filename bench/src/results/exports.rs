//! `exports-bench`'s result (`bench/results/exports.json`): how fast an export change reaches
//! the induced consumers, a bulk export's reflection rate, how fast a new export's name
//! resolves at an induced consumer, and that consumer's DNS under load next to a peer's.

use serde::{Deserialize, Serialize};

use super::{LatencySummary, Machine, RunInfo};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ExportsResult {
    pub benchmark: String,
    pub run: Option<RunInfo>,
    pub machine: Option<Machine>,
    pub parameters: Option<ExportsParameters>,
    /// Seconds from the first Peer call to the complete induced mesh.
    pub mesh_seconds: f64,
    /// Export change → changed slice at the induced consumer.
    pub change_latency: Option<LatencySummary>,
    /// Seconds until every consumer listed every endpoint of a bulk export, per repeat.
    pub bulk_seconds: Vec<f64>,
    /// Consumers × bulk endpoints / median bulk seconds.
    pub reflected_endpoints_per_second: f64,
    /// A new export → its name answers the address at the induced consumer's DNS.
    pub dns_resolvable: Option<LatencySummary>,
    /// The same exports → their slice stored at the induced consumer (the part of
    /// [`Self::dns_resolvable`] before the DNS).
    pub dns_reflected: Option<LatencySummary>,
    /// The induced consumer's DNS under load.
    pub dns: Option<DnsLoad>,
    /// A peer DNS server (dnsmasq) under the same load in the same run.
    pub dns_peer: Option<DnsLoad>,
}

/// One DNS server under load: `clients` resolvers asking one name back to back.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct DnsLoad {
    /// What answered (`trellis`, or the peer's version).
    pub server: String,
    pub clients: usize,
    pub seconds: f64,
    pub sent: u64,
    /// Queries without a NOERROR answer carrying an address within a second.
    pub unanswered: u64,
    /// Answered queries: `ops_per_second` is the answered queries per second.
    pub latency: LatencySummary,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ExportsParameters {
    pub leaves: usize,
    pub consumers: usize,
    pub samples: usize,
    pub bulk_endpoints: usize,
    pub repeats: usize,
    pub poll_ms: u64,
    pub dns_samples: usize,
    pub dns_clients: usize,
    pub dns_seconds: f64,
    pub dns_rounds: usize,
}
