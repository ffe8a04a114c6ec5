//! The figures over every repeat: per grid cell (an unordered pair of NAT kinds) the
//! percentiles of t1 - t0 and the path it ends on, and per measured path its RTT percentiles
//! and throughput.

use std::collections::BTreeMap;

use trellis_netlab::NatKind;

use super::percentile;
use crate::median;
use crate::results::{NatCell, NatRepeat, PathSummary, Percentiles};

fn percentiles(values: &[f64]) -> Option<Percentiles> {
    Some(Percentiles {
        p50: percentile(values, 0.5)?,
        p95: percentile(values, 0.95)?,
        max: percentile(values, 1.0)?,
    })
}

/// The 10 cells of the grid, in the order of [`NatKind::ALL`] (none × none, none × one-to-one,
/// ..., hard × hard), each with every pair of every repeat whose kinds are the cell's.
pub fn cells(repeats: &[NatRepeat]) -> Vec<NatCell> {
    let mut out = Vec::new();
    for (i, a) in NatKind::ALL.into_iter().enumerate() {
        for c in NatKind::ALL.into_iter().skip(i) {
            let (a, c) = (a.as_str(), c.as_str());
            let pairs: Vec<_> = repeats
                .iter()
                .flat_map(|r| &r.pairs)
                .filter(|p| (p.a_kind == a && p.c_kind == c) || (p.a_kind == c && p.c_kind == a))
                .collect();
            if pairs.is_empty() {
                continue;
            }
            let first: Vec<f64> = pairs.iter().filter_map(|p| p.first_packet_ms).collect();
            let echo: Vec<f64> = pairs.iter().filter_map(|p| p.first_echo_ms).collect();
            let mut paths = BTreeMap::new();
            for p in &pairs {
                *paths.entry(p.path.clone()).or_insert(0) += 1;
            }
            let path = match paths.keys().collect::<Vec<_>>().as_slice() {
                [one] => (*one).clone(),
                _ => "mixed".to_owned(),
            };
            out.push(NatCell {
                a_kind: a.to_owned(),
                c_kind: c.to_owned(),
                samples: pairs.len(),
                unreached: pairs.iter().filter(|p| p.first_packet_ms.is_none()).count(),
                first_packet_ms: percentiles(&first),
                first_echo_ms: percentiles(&echo),
                path,
                paths,
            });
        }
    }
    out
}

/// Each measured path (by name and kinds, in the order measured) over every repeat.
pub fn path_summaries(repeats: &[NatRepeat]) -> Vec<PathSummary> {
    let mut keys: Vec<(String, String, String)> = Vec::new();
    for m in repeats.iter().flat_map(|r| &r.paths) {
        let key = (m.name.clone(), m.from_kind.clone(), m.to_kind.clone());
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    keys.into_iter()
        .map(|(name, from_kind, to_kind)| {
            let of: Vec<_> = repeats
                .iter()
                .flat_map(|r| &r.paths)
                .filter(|m| m.name == name && m.from_kind == from_kind && m.to_kind == to_kind)
                .collect();
            let rtts: Vec<f64> = of.iter().flat_map(|m| m.rtts_ms.iter().copied()).collect();
            let mbit_s: Vec<f64> = of
                .iter()
                .filter_map(|m| m.transfer.as_ref().map(|t| t.mbit_s))
                .collect();
            let cpu: Vec<f64> = of
                .iter()
                .filter_map(|m| m.transfer.as_ref()?.cpu_seconds_per_gb)
                .collect();
            let mut paths_seen = BTreeMap::new();
            let mut hub_drops = BTreeMap::new();
            for m in &of {
                *paths_seen.entry(m.path_seen.clone()).or_insert(0) += 1;
                for (reason, n) in &m.hub_drops {
                    *hub_drops.entry(reason.clone()).or_insert(0.0) += n;
                }
            }
            PathSummary {
                name,
                from_kind,
                to_kind,
                paths_seen,
                pings_sent: of.iter().map(|m| m.pings_sent).sum(),
                pings_answered: rtts.len(),
                rtt_p50_ms: percentile(&rtts, 0.5),
                rtt_p99_ms: percentile(&rtts, 0.99),
                median_mbit_s: median(&mbit_s),
                median_cpu_seconds_per_gb: median(&cpu),
                hub_drops,
                mbit_s,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::PairSample;

    fn pair(a: &str, c: &str, first: Option<f64>, path: &str) -> PairSample {
        PairSample {
            a: "x".into(),
            c: "y".into(),
            a_kind: a.into(),
            c_kind: c.into(),
            a_tunnel_at_ms: Some(100.0),
            c_tunnel_at_ms: Some(120.0),
            a_candidates_at_ms: None,
            c_candidates_at_ms: None,
            first_packet_at_ms: first.map(|f| f + 100.0),
            first_direction: Some("a>c".into()),
            first_echo_at_ms: first.map(|f| f + 101.0),
            first_packet_ms: first,
            first_echo_ms: first.map(|f| f + 1.0),
            sent_after_first: 10,
            lost_after_first: 0,
            max_gap_after_first_ms: 110.0,
            path: path.into(),
        }
    }

    #[test]
    fn cells_pool_both_orders_and_repeats_and_keep_unreached_out_of_the_figures() {
        let repeat = |pairs| NatRepeat {
            repeat: 0,
            setup_seconds: 1.0,
            mesh_seconds: 1.0,
            grid_seconds: 1.0,
            leaves: Vec::new(),
            hub_unknown_peer_drops: None,
            gateway_drops: BTreeMap::new(),
            pairs,
            paths: Vec::new(),
        };
        let repeats = [
            repeat(vec![
                pair("easy", "hard", Some(300.0), "direct"),
                pair("hard", "hard", Some(3500.0), "relayed"),
            ]),
            repeat(vec![
                pair("hard", "easy", Some(500.0), "direct"),
                pair("hard", "easy", None, "none"),
            ]),
        ];
        let cells = cells(&repeats);
        assert_eq!(cells.len(), 2);
        let eh = &cells[0];
        assert_eq!((eh.a_kind.as_str(), eh.c_kind.as_str()), ("easy", "hard"));
        assert_eq!((eh.samples, eh.unreached), (3, 1));
        let p = eh.first_packet_ms.as_ref().expect("figures");
        assert_eq!((p.p50, p.p95, p.max), (300.0, 500.0, 500.0));
        assert_eq!(eh.path, "mixed");
        assert_eq!(cells[1].path, "relayed");
    }
}
