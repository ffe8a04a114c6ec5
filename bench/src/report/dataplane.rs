//! The data plane section: leaf-to-leaf RTT induced against through the hub, tunnel throughput,
//! the side-by-side comparison with wireguard-go, and their plots.

use std::fmt::Write as _;
use std::path::PathBuf;

use super::format::{busy_polling, cpu_latency, num, opt, run_line};
use super::inputs::Inputs;
use super::notes::note;
use super::output::PLOT_DIR;
use super::parse::parse;
use crate::results::{DataplaneResult, RequestResponse, RttOverhead, Side, SideBySide};
use crate::svg::{self, BarChart, Scale};

pub(super) fn dataplane_section(
    md: &mut String,
    inputs: &Inputs,
    files: &mut Vec<(PathBuf, String)>,
) {
    md.push_str(
        "## Data plane: leaf↔leaf RTT, induced vs through the hub, and tunnel throughput\n\n",
    );
    let mut chart = BarChart {
        title: "Leaf-to-leaf RTT: induced vs hub path".into(),
        y_label: "ms".into(),
        y_scale: Scale::Linear,
        categories: vec!["induced (A→C)".into(), "hub (A→B→C)".into()],
        series: vec![
            ("emulated link RTT".into(), vec![None, None]),
            ("measured median".into(), vec![None, None]),
            ("reference".into(), vec![None, None]),
        ],
    };
    let mut throughput_chart = BarChart {
        title: "Tunnel throughput: Trellis vs wireguard-go (iperf3 TCP, median)".into(),
        y_label: "Mbit/s".into(),
        y_scale: Scale::Linear,
        categories: vec!["1 stream".into(), "4 streams".into()],
        series: vec![
            ("Trellis".into(), vec![None, None]),
            ("wireguard-go".into(), vec![None, None]),
        ],
    };
    match parse::<DataplaneResult>(inputs, "dataplane") {
        Err(why) => {
            let _ = writeln!(md, "Not measured: {why}.\n");
        }
        Ok(p) => {
            let d = &p.doc;
            let _ = writeln!(md, "{}\n", run_line(&p.path, &p.common));
            md.push_str(&note(inputs, "dataplane"));
            let _ = writeln!(
                md,
                "WireGuard: {}{}; build: {}; {}; {}; store: {}; link delays by: {}; {} pings per measurement.\n",
                d.wireguard,
                if d.stateless_wire {
                    ", stateless wire convention (ADR 0034)"
                } else {
                    ""
                },
                d.build,
                busy_polling(d.busy_poll_us, d.busy_poll_budget_percent),
                cpu_latency(d.cpu_latency_limit),
                d.store,
                d.emulation.as_str().replace('_', " "),
                d.samples
                    .map_or("an unrecorded number of".into(), |s| s.to_string())
            );
            md.push_str(
                "| path | emulated link RTT ms | median ms | p90 ms | min ms | max ms | lost |\n",
            );
            md.push_str("|---|---|---|---|---|---|---|\n");
            let rows = [
                (
                    "induced (A→C direct)",
                    d.rtt_induced.as_ref(),
                    d.leaf_link_rtt_ms as f64,
                ),
                (
                    "hub (A→B→C, DNAT at B)",
                    d.rtt_hub_path.as_ref(),
                    2.0 * d.hub_link_rtt_ms as f64,
                ),
                (
                    "induced, no added delay",
                    d.rtt_no_netem_tunnel.as_ref(),
                    0.0,
                ),
                (
                    "induced through 0 ms relays",
                    d.rtt_through_zero_delay_relay.as_ref(),
                    0.0,
                ),
                (
                    "gateway to gateway, bare bridge path",
                    d.rtt_no_netem_bare.as_ref(),
                    0.0,
                ),
            ];
            for (name, rtt, emulated) in rows {
                let Some(r) = rtt else { continue };
                let _ = writeln!(
                    md,
                    "| {name} | {} | {} | {} | {} | {} | {}/{} |",
                    num(emulated, 0),
                    num(r.median_ms, 3),
                    num(r.p90_ms, 3),
                    num(r.min_ms, 3),
                    num(r.max_ms, 3),
                    r.lost,
                    r.samples as u32 + r.lost
                );
            }
            md.push('\n');
            if let Some(ratio) = d.ratio_hub_over_induced {
                let _ = write!(md, "Ratio hub / induced: **{}**", num(ratio, 1));
                if let (Some(ti), Some(th)) = (d.thesis_induced_ms, d.thesis_hub_ms) {
                    let _ = write!(
                        md,
                        " (the published reference measurement of induced peering with the same link delays: {} ms induced, {} ms through the hub, ratio {})",
                        num(ti, 0),
                        num(th, 0),
                        num(th / ti, 1)
                    );
                }
                md.push_str(".\n\n");
            }
            if let Some(t) = &d.throughput {
                md.push_str("| path (iperf3 TCP, one stream) | Mbit/s |\n|---|---|\n");
                let _ = writeln!(
                    md,
                    "| A's pod → C's pod through the A–C tunnel | {} |\n| A's gateway → C's gateway, same veth path, no tunnel | {} |\n",
                    num(t.tunnel_mbit_s, 0),
                    num(t.bare_veth_mbit_s, 0)
                );
                let _ = writeln!(
                    md,
                    "The tunnel carries {} % of the bare path ({} s per iperf3 run).\n",
                    num(100.0 * t.tunnel_fraction_of_bare, 1),
                    t.seconds
                );
            }
            if let Some(c) = &d.side_by_side {
                side_by_side_table(md, c);
                request_response_table(md, c);
                for (i, streams) in [1, 4].into_iter().enumerate() {
                    if let Some(x) = c.at(streams) {
                        throughput_chart.series[0].1[i] = x.trellis.median_mbit_s;
                        throughput_chart.series[1].1[i] = x.wireguard_go.median_mbit_s;
                    }
                }
            }
            if let (Some(i), Some(h)) = (d.induced_ready_seconds, d.hub_ready_seconds) {
                let _ = writeln!(
                    md,
                    "From starting the three clusters to the first answered ping: {} s (induced), {} s (hub path).\n",
                    num(i, 1),
                    num(h, 1)
                );
            }
            chart.series[0].1 = vec![
                Some(d.leaf_link_rtt_ms as f64),
                Some(2.0 * d.hub_link_rtt_ms as f64),
            ];
            chart.series[1].1 = vec![
                d.rtt_induced.as_ref().map(|r| r.median_ms),
                d.rtt_hub_path.as_ref().map(|r| r.median_ms),
            ];
            chart.series[2].1 = vec![d.thesis_induced_ms, d.thesis_hub_ms];
        }
    }
    md.push_str("![Leaf-to-leaf RTT](bench/dataplane-rtt.svg)\n\n");
    md.push_str(
        "![Tunnel throughput, Trellis vs wireguard-go](bench/dataplane-throughput.svg)\n\n",
    );
    md.push_str(&note(inputs, "dataplane-analysis"));
    files.push((
        PathBuf::from(PLOT_DIR).join("dataplane-rtt.svg"),
        svg::bar_chart(&chart),
    ));
    files.push((
        PathBuf::from(PLOT_DIR).join("dataplane-throughput.svg"),
        svg::bar_chart(&throughput_chart),
    ));
}

/// "median (min–max)" of a side, with `decimals`.
fn median_spread(
    median: Option<f64>,
    min: Option<f64>,
    max: Option<f64>,
    decimals: usize,
) -> String {
    match (median, min, max) {
        (Some(m), Some(lo), Some(hi)) => format!(
            "{} ({}–{})",
            num(m, decimals),
            num(lo, decimals),
            num(hi, decimals)
        ),
        (m, _, _) => opt(m, decimals),
    }
}

/// The side-by-side comparison with wireguard-go (and GotaTun where it was measured):
/// throughput and CPU per GB at 1 and 4 streams, and RTT overhead over the underlay.
fn side_by_side_table(md: &mut String, c: &SideBySide) {
    let gota = c.throughput.iter().any(|x| x.gotatun.is_some()) || c.rtt_gotatun.is_some();
    let _ = writeln!(
        md,
        "Side by side with {}{} (two more gateway namespaces of the same topology for each, \
         configured with `wg set`; see the method above), {} round{} of {} s iperf3 runs, which \
         tunnel goes first rotating by round. Median (smallest–largest) over the rounds; ratios \
         of medians.\n",
        if c.reference.is_empty() {
            "wireguard-go"
        } else {
            c.reference.as_str()
        },
        c.gotatun_reference
            .as_ref()
            .map_or(String::new(), |g| format!(" and GotaTun's device ({g})")),
        c.rounds,
        if c.rounds == 1 { "" } else { "s" },
        c.iperf_seconds
    );
    if gota {
        md.push_str(
            "| measure | Trellis | wireguard-go | Trellis / wireguard-go | GotaTun | Trellis / GotaTun |\n\
             |---|---|---|---|---|---|\n",
        );
    } else {
        md.push_str(
            "| measure | Trellis | wireguard-go | Trellis / wireguard-go |\n|---|---|---|---|\n",
        );
    }
    let gota_cells =
        |side: Option<&Side>, ours: Option<f64>, pick: fn(&Side) -> [Option<f64>; 3], decimals| {
            if !gota {
                return String::new();
            }
            match side {
                None => " — | — |".to_owned(),
                Some(g) => {
                    let [m, lo, hi] = pick(g);
                    format!(
                        " {} | {} |",
                        median_spread(m, lo, hi, decimals),
                        opt(crate::ratio(ours, m), 2)
                    )
                }
            }
        };
    for x in &c.throughput {
        let streams = format!(
            "{} TCP stream{}",
            x.streams,
            if x.streams == 1 { "" } else { "s" }
        );
        let _ = writeln!(
            md,
            "| {streams}, Mbit/s | {} | {} | **{}** |{}",
            median_spread(
                x.trellis.median_mbit_s,
                x.trellis.min_mbit_s,
                x.trellis.max_mbit_s,
                0
            ),
            median_spread(
                x.wireguard_go.median_mbit_s,
                x.wireguard_go.min_mbit_s,
                x.wireguard_go.max_mbit_s,
                0
            ),
            opt(x.ratio_mbit_s, 2),
            gota_cells(
                x.gotatun.as_ref(),
                x.trellis.median_mbit_s,
                |g| [g.median_mbit_s, g.min_mbit_s, g.max_mbit_s],
                0
            )
        );
        let _ = writeln!(
            md,
            "| {streams}, tunnel CPU s per GB | {} | {} | {} |{}",
            median_spread(
                x.trellis.median_cpu_seconds_per_gb,
                x.trellis.min_cpu_seconds_per_gb,
                x.trellis.max_cpu_seconds_per_gb,
                1
            ),
            median_spread(
                x.wireguard_go.median_cpu_seconds_per_gb,
                x.wireguard_go.min_cpu_seconds_per_gb,
                x.wireguard_go.max_cpu_seconds_per_gb,
                1
            ),
            opt(x.ratio_cpu_seconds_per_gb, 2),
            gota_cells(
                x.gotatun.as_ref(),
                x.trellis.median_cpu_seconds_per_gb,
                |g| [
                    g.median_cpu_seconds_per_gb,
                    g.min_cpu_seconds_per_gb,
                    g.max_cpu_seconds_per_gb
                ],
                1
            )
        );
    }
    if let (Some(t), Some(w)) = (&c.rtt_trellis, &c.rtt_wireguard_go) {
        let g = c.rtt_gotatun.as_ref();
        let extra = |f: &dyn Fn(&RttOverhead) -> String| match (gota, g) {
            (false, _) => String::new(),
            (true, None) => " — | |".to_owned(),
            (true, Some(g)) => format!(" {} | |", f(g)),
        };
        let tunnel = |r: &RttOverhead| num(r.tunnel.median_ms, 3);
        let bare = |r: &RttOverhead| num(r.bare.median_ms, 3);
        let overhead = |r: &RttOverhead| num(r.overhead_ms, 3);
        let _ = writeln!(
            md,
            "| RTT pod to pod through the tunnel, median ms | {} | {} | |{}",
            tunnel(t),
            tunnel(w),
            extra(&tunnel)
        );
        let _ = writeln!(
            md,
            "| RTT gateway to gateway on the bridge (underlay), median ms | {} | {} | |{}",
            bare(t),
            bare(w),
            extra(&bare)
        );
        let _ = writeln!(
            md,
            "| RTT overhead (tunnel − underlay), ms | **{}** | {} | |{}",
            overhead(t),
            overhead(w),
            extra(&overhead)
        );
    }
    md.push('\n');
}

/// Request/response through every tunnel and on its underlay, at 1 and 4 connections.
fn request_response_table(md: &mut String, c: &SideBySide) {
    if c.request_response.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "Request/response (sockperf ping-pong: a 64-byte TCP request, answered by a 64-byte \
         response before the next is sent; one client and one server per connection), {} s per \
         run in the same rounds, pod to pod through each tunnel and gateway to gateway on its \
         underlay. Transactions per second: median over the rounds, all connections together; \
         round-trip percentiles over every transaction of every round.\n",
        c.rr_seconds
    );
    md.push_str(
        "| path | connections | transactions/s | p50 µs | p99 µs | p99.9 µs | round trips |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for x in &c.request_response {
        for (name, r) in [
            ("Trellis tunnel", &x.trellis.tunnel),
            ("Trellis's underlay", &x.trellis.underlay),
            ("wireguard-go tunnel", &x.wireguard_go.tunnel),
            ("wireguard-go's underlay", &x.wireguard_go.underlay),
        ]
        .into_iter()
        .chain(x.gotatun.iter().flat_map(|g| {
            [
                ("GotaTun tunnel", &g.tunnel),
                ("GotaTun's underlay", &g.underlay),
            ]
        })) {
            let _ = writeln!(
                md,
                "| {name} | {} | {} | {} | {} | {} | {} |",
                x.connections,
                opt(r.median_per_s, 0),
                opt(r.p50_us, 0),
                opt(r.p99_us, 0),
                opt(r.p999_us, 0),
                num(r.samples as f64, 0)
            );
        }
    }
    md.push('\n');
    for x in &c.request_response {
        let ratio =
            |a: &RequestResponse, b: &RequestResponse| crate::ratio(a.median_per_s, b.median_per_s);
        let _ = writeln!(
            md,
            "{} connection{}: Trellis's tunnel ×{} its underlay's transactions per second \
             (wireguard-go's ×{}), ×{} wireguard-go's{}.\n",
            x.connections,
            if x.connections == 1 { "" } else { "s" },
            opt(ratio(&x.trellis.tunnel, &x.trellis.underlay), 2),
            opt(ratio(&x.wireguard_go.tunnel, &x.wireguard_go.underlay), 2),
            opt(ratio(&x.trellis.tunnel, &x.wireguard_go.tunnel), 2),
            x.gotatun.as_ref().map_or(String::new(), |g| format!(
                " and ×{} GotaTun's (its own ×{} its underlay's)",
                opt(ratio(&x.trellis.tunnel, &g.tunnel), 2),
                opt(ratio(&g.tunnel, &g.underlay), 2)
            ))
        );
    }
}
