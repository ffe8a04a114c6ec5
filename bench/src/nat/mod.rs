//! The parts of `nat-bench` (the binary's doc describes what it measures): one fresh fabric of
//! a hub and leaves behind every NAT kind, timed from the induced peerings to the first
//! pod-to-pod packets ([`grid`], with the per-pod prober `probe.py`); the RTT and throughput of
//! a direct, a relayed and a leaf-to-hub path in that fabric ([`paths`]); and the per-cell and
//! per-path figures over every repeat ([`summary`]). What it writes is
//! [`crate::results::NatResult`].

use std::time::Duration;

use trellis_netlab::NatKind;

mod grid;
mod paths;
mod summary;

pub use grid::repeat;
pub use summary::{cells, path_summaries};

/// What the binary's flags set.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Leaves behind each NAT kind.
    pub leaves_per_kind: usize,
    /// How long to wait for the whole induced mesh of TunnelEndpoints.
    pub mesh_timeout: Duration,
    /// How long after the first `Peer` call every pair's first reply may take.
    pub probe_timeout: Duration,
    /// How long the probes keep running (slowly) once every pair got its first reply, to count
    /// what is lost after it.
    pub settle: Duration,
    /// Pings per RTT measurement and their interval, in seconds.
    pub pings: u32,
    pub ping_interval: f64,
    /// Seconds of each iperf3 run.
    pub iperf_seconds: u32,
}

/// The one-letter prefix of a leaf's name behind `kind` (names are site names: short).
fn letter(kind: NatKind) -> char {
    match kind {
        NatKind::None => 'n',
        NatKind::OneToOne => 'o',
        NatKind::Easy => 'e',
        NatKind::Hard => 'h',
    }
}

/// The cluster names and NAT kinds of a fabric: the hub (index 0, no NAT), then
/// `per_kind` rounds of one leaf per kind (`n1 o1 e1 h1 n2 ...`), interleaved so that no kind
/// is always peered first or last.
pub fn layout(per_kind: usize) -> (Vec<String>, Vec<NatKind>) {
    let mut names = vec!["hub".to_owned()];
    let mut kinds = vec![NatKind::None];
    for k in 1..=per_kind {
        for kind in NatKind::ALL {
            names.push(format!("{}{k}", letter(kind)));
            kinds.push(kind);
        }
    }
    (names, kinds)
}

/// Pod CIDR of cluster `i`: a /20 of 172.16.0.0/12 each, all distinct, so every cluster keeps
/// every other's range as it is (no remap) and a pod's address seen from another cluster is
/// known before any peering. 172.16.0.0/12 is the last of the IPAM's default pools: the remaps
/// of the (shared) external CIDR come from 10.0.0.0/8 first and never take these.
pub fn pod_cidr(i: usize) -> String {
    format!("172.{}.{}.0/20", 16 + i / 16, (i % 16) * 16)
}

/// The nearest-rank percentile `p` (0–1) of `values`: always a measured value; `None` when
/// empty.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return None;
    }
    let rank = (p * sorted.len() as f64).ceil().max(1.0) as usize;
    Some(sorted[rank.min(sorted.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_interleaves_the_kinds_behind_a_hub_without_nat() {
        let (names, kinds) = layout(2);
        assert_eq!(
            names,
            ["hub", "n1", "o1", "e1", "h1", "n2", "o2", "e2", "h2"]
        );
        assert_eq!(kinds[0], NatKind::None);
        assert_eq!(kinds[4], NatKind::Hard);
        assert_eq!(kinds[6], NatKind::OneToOne);
    }

    #[test]
    fn pod_cidrs_are_distinct_and_outside_the_external_cidr() {
        let cidrs: Vec<ipnet::Ipv4Net> = (0..40)
            .map(|i| pod_cidr(i).parse().expect("a CIDR"))
            .collect();
        let external: ipnet::Ipv4Net = "10.201.0.0/16".parse().expect("a CIDR");
        let pool: ipnet::Ipv4Net = "172.16.0.0/12".parse().expect("a CIDR");
        for (i, a) in cidrs.iter().enumerate() {
            assert!(pool.contains(a), "{a}");
            assert!(!external.contains(a));
            for b in &cidrs[i + 1..] {
                assert!(!a.contains(b) && !b.contains(a), "{a} {b}");
            }
        }
        assert_eq!(pod_cidr(17), "172.17.16.0/20");
    }

    #[test]
    fn percentiles_are_nearest_rank_and_always_a_measured_value() {
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(10.0));
        assert_eq!(percentile(&v, 0.95), Some(19.0));
        assert_eq!(percentile(&v, 1.0), Some(20.0));
        assert_eq!(percentile(&[7.0], 0.95), Some(7.0));
        assert_eq!(percentile(&[], 0.5), None);
    }
}
