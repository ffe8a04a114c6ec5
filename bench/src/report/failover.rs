//! The gateway failover (issue 33): its targets and its section.

use std::fmt::Write as _;

use super::document::opening;
use super::format::num;
use super::inputs::Inputs;
use super::parse::parse;
use super::targets::{Target, Verdict};
use crate::results::{FailoverResult, Kill};

/// Issue 33: the gateway failover's gap and the TCP connections it costs.
pub(super) fn failover_targets(inputs: &Inputs) -> Vec<Target> {
    const GAP: &str = "gateway failover: largest 10 ms probe gap p50 under 0.5 s and p99 under \
                       2 s over at least 20 kills (issue 33)";
    const TCP: &str = "gateway failover: no established TCP connection lost (issue 33)";
    let p = match parse::<FailoverResult>(inputs, "failover") {
        Ok(p) => p,
        Err(why) => {
            return [GAP, TCP]
                .map(|target| Target {
                    target,
                    measured: why.clone(),
                    verdict: Verdict::NotMeasured,
                })
                .into();
        }
    };
    let d = &p.doc;
    let gap = &d.probe_gap_ms;
    vec![
        Target {
            target: GAP,
            measured: format!(
                "p50 {} ms, p99 {} ms, max {} ms over {} kills",
                num(gap.p50, 0),
                num(gap.p99, 0),
                num(gap.max, 0),
                d.parameters.kills
            ),
            verdict: if d.parameters.kills < 20 {
                Verdict::NotMeasured
            } else if gap.p50 < 500.0 && gap.p99 < 2000.0 {
                Verdict::Met
            } else {
                Verdict::NotMet
            },
        },
        Target {
            target: TCP,
            measured: format!("{} of {} lost", d.tcp_broken, d.tcp_connections),
            verdict: if d.tcp_broken == 0 {
                Verdict::Met
            } else {
                Verdict::NotMet
            },
        },
    ]
}

pub(super) fn failover_section(md: &mut String, inputs: &Inputs) {
    md.push_str("## Gateway failover\n\n");
    let Some(p) = opening::<FailoverResult>(md, inputs, "failover") else {
        return;
    };
    let d = &p.doc;
    let _ = writeln!(
        md,
        "{} kills; per destination {} echoed TCP connections and {} on which only the server \
         speaks, fresh for each kill.\n",
        d.parameters.kills,
        d.parameters.connections_per_destination,
        d.parameters.pushed_per_destination
    );
    md.push_str("| per kill | p50 ms | p99 ms | max ms |\n|---|---|---|---|\n");
    for (name, s) in [
        ("largest gap of the 10 ms UDP probes", &d.probe_gap_ms),
        (
            "takeover (until the standby says it is active)",
            &d.takeover_ms,
        ),
    ] {
        let _ = writeln!(
            md,
            "| {name} | {} | {} | {} |",
            num(s.p50, 0),
            num(s.p99, 0),
            num(s.max, 0)
        );
    }
    md.push_str(
        "| Submariner, Liqo: Lease duration before a standby may take over (not measured here) \
         | 15 000 | 15 000 | 15 000 |\n\n",
    );
    md.push_str("| cluster killed | kills | largest probe gap ms | TCP connections broken |\n|---|---|---|---|\n");
    let mut clusters: Vec<&str> = d.kills.iter().map(|k| k.cluster.as_str()).collect();
    clusters.sort_unstable();
    clusters.dedup();
    for c in clusters {
        let of: Vec<&Kill> = d.kills.iter().filter(|k| k.cluster == c).collect();
        let gap = of.iter().map(|k| k.probe_gap_ms).fold(0.0, f64::max);
        let broken: usize = of.iter().map(|k| k.tcp_broken).sum();
        let _ = writeln!(md, "| {c} | {} | {} | {broken} |", of.len(), num(gap, 0));
    }
    let _ = writeln!(
        md,
        "\nTCP connections broken over all kills: **{} of {}**.\n",
        d.tcp_broken, d.tcp_connections
    );
}
