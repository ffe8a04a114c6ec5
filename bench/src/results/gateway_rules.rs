//! `gateway-rules-bench`'s result (`bench/results/gateway-rules.json`): what the gateway's
//! nftables tables and policy rules cost a forwarded packet, with one peer and with a hub's
//! worth, against plain routing, measured in turns in one run.

use serde::{Deserialize, Serialize};

use super::{Machine, RunInfo};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GatewayRulesResult {
    #[serde(default)]
    pub benchmark: String,
    #[serde(default)]
    pub run: Option<RunInfo>,
    #[serde(default)]
    pub machine: Option<Machine>,
    pub parameters: GatewayRulesParameters,
    /// Each configuration the router was measured in, pings pooled over the rounds.
    pub variants: Vec<RulesVariant>,
    /// Median RTT with one peer's rules over the median with none, in milliseconds.
    pub one_peer_over_bare_ms: Option<f64>,
    /// The hub's tables with only the measured peer's policy rule, over one peer's rules: what
    /// the nftables tables alone cost for the other peers.
    pub hub_tables_over_one_peer_ms: Option<f64>,
    /// Median RTT with the hub's rules over the median with none, in milliseconds.
    pub hub_over_bare_ms: Option<f64>,
    /// The hub's cost over one peer's: how much a packet pays for the peers it is not from.
    pub hub_over_one_peer_ms: Option<f64>,
    /// The sketch of a stateless wire convention's rules for one peer (ADR 0032) over plain
    /// routing; absent from runs before it was measured.
    #[serde(default)]
    pub stateless_sketch_over_bare_ms: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GatewayRulesParameters {
    /// Peers in the hub configuration (the measured one last).
    pub peers: usize,
    pub rounds: usize,
    pub pings_per_round: u32,
    pub ping_interval_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RulesVariant {
    pub name: String,
    pub peers: usize,
    /// Policy-routing rules in the router: one per peer, or only the measured peer's.
    pub policy_rules: usize,
    pub samples: usize,
    pub median_ms: Option<f64>,
    pub p90_ms: Option<f64>,
}
