//! The node path section: pod to pod across non-gateway nodes against the gateway nodes.

use std::fmt::Write as _;

use super::document::opening;
use super::format::{busy_polling, cpu_latency, num};
use super::inputs::Inputs;
use crate::results::NodePathResult;

pub(super) fn node_path_section(md: &mut String, inputs: &Inputs) {
    md.push_str("## Data plane: pod to pod across non-gateway nodes (the node path)\n\n");
    let Some(p) = opening::<NodePathResult>(md, inputs, "dataplane-nodes") else {
        return;
    };
    let d = &p.doc;
    let _ = writeln!(
        md,
        "WireGuard: {}; build: {}; {}; {}; store: {}; {} nodes per cluster; {} pings per RTT, {} s per iperf3 run.\n",
        d.wireguard,
        d.build,
        busy_polling(d.busy_poll_us, d.busy_poll_budget_percent),
        cpu_latency(d.cpu_latency_limit),
        d.store,
        d.nodes_per_cluster.map_or("?".into(), |n| n.to_string()),
        d.samples.map_or("?".into(), |n| n.to_string()),
        d.iperf_seconds.map_or("?".into(), |n| n.to_string()),
    );
    md.push_str("| path (A's pod → C's pod, induced tunnel) | median RTT ms | p90 ms | lost | iperf3 TCP Mbit/s (each run) |\n|---|---|---|---|---|\n");
    let runs = |v: &[f64]| v.iter().map(|m| num(*m, 0)).collect::<Vec<_>>().join(", ");
    for (name, rtt, mbit) in [
        (
            "pods on the gateway nodes (tunnel only)",
            d.rtt_gateway_nodes.as_ref(),
            &d.mbit_s_gateway_nodes,
        ),
        (
            "pods on non-gateway nodes (node network, VXLAN to the gateway node, tunnel)",
            d.rtt_non_gateway_nodes.as_ref(),
            &d.mbit_s_non_gateway_nodes,
        ),
    ] {
        let Some(r) = rtt else { continue };
        let _ = writeln!(
            md,
            "| {name} | {} | {} | {}/{} | {} |",
            num(r.median_ms, 3),
            num(r.p90_ms, 3),
            r.lost,
            r.samples as u32 + r.lost,
            runs(mbit)
        );
    }
    md.push('\n');
    if let (Some(rtt), Some(tput)) = (d.rtt_ratio, d.throughput_ratio) {
        let _ = writeln!(
            md,
            "Non-gateway nodes against gateway nodes, same clusters and run: RTT ×**{}**, throughput ×**{}**.\n",
            num(rtt, 2),
            num(tput, 2)
        );
    }
}
