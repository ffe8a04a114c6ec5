//! The node path: pod to pod between non-gateway nodes (VXLAN to the gateway node, then the
//! tunnel) against pod to pod on the gateway nodes, in the same clusters and run.

use std::net::Ipv4Addr;
use std::time::Instant;

use anyhow::bail;
use trellis_api::pb::types::PeeringKind;
use trellis_netlab::Fabric;
use trellis_netlab::topology::ping_rtts;

use super::probe::{iperf, rtt};
use super::{A, C, LIMIT, Settings, WIREGUARD, build, options};
use crate::results::{Machine, NodePathResult, RunInfo};

/// Measures the node path in a fabric of three nodes per cluster.
pub async fn node_path(settings: &Settings, run: RunInfo) -> anyhow::Result<NodePathResult> {
    const NODES: usize = 3;
    let mut o = options(settings, false);
    o.nodes = NODES;
    let fabric = Fabric::up(o).await?;
    for (i, remotes) in [
        (A, [("b", PeeringKind::Full), ("c", PeeringKind::Induced)]),
        (C, [("a", PeeringKind::Induced), ("b", PeeringKind::Full)]),
    ] {
        fabric.wait_tunnel_endpoints(i, &remotes, LIMIT).await?;
    }
    let (a, c) = (&fabric.topology.sites[A], &fabric.topology.sites[C]);
    let view = fabric.view(A, C, false).await?;
    let at = |pod: Ipv4Addr| {
        Ipv4Addr::from(u32::from(view.network()) + u32::from(pod) - u32::from(c.pod_cidr.network()))
    };
    let (gw_from, gw_to) = (&a.nodes[0], &c.nodes[0]);
    let (far_from, far_to) = (&a.nodes[1], &c.nodes[2]);
    for (from, to) in [(gw_from, gw_to), (far_from, far_to)] {
        let deadline = Instant::now() + LIMIT;
        while ping_rtts(&from.pod_ns, at(to.pod_ip), 1, 0.2)?.is_empty() {
            if Instant::now() > deadline {
                bail!(
                    "{} never reached {}:\n{}",
                    from.name,
                    to.name,
                    fabric.logs()
                );
            }
        }
    }
    let rtt_gateway_nodes = rtt(&gw_from.pod_ns, at(gw_to.pod_ip), settings.samples)?;
    let rtt_non_gateway_nodes = rtt(&far_from.pod_ns, at(far_to.pod_ip), settings.samples)?;
    eprintln!(
        "dataplane-bench: node path RTT median {:.3} ms (gateway nodes) vs {:.3} ms (non-gateway nodes)",
        rtt_gateway_nodes.median_ms, rtt_non_gateway_nodes.median_ms
    );
    let (mut gw_mbit, mut far_mbit) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        for (from, to, into) in [
            (gw_from, gw_to, &mut gw_mbit),
            (far_from, far_to, &mut far_mbit),
        ] {
            let mbit = iperf(
                &from.pod_ns,
                &to.pod_ns,
                to.pod_ip,
                at(to.pod_ip),
                settings.iperf_seconds,
                1,
                &[],
            )
            .await?
            .mbit_s;
            eprintln!(
                "dataplane-bench: iperf3 {} -> {}: {mbit:.0} Mbit/s",
                from.pod_ns, to.pod_ns
            );
            into.push(mbit);
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    Ok(NodePathResult {
        benchmark: "dataplane_node_path".into(),
        run: Some(run),
        machine: Some(Machine::describe()),
        samples: Some(settings.samples),
        iperf_seconds: Some(settings.iperf_seconds),
        wireguard: WIREGUARD.into(),
        build: build().into(),
        busy_poll_us: Some(settings.busy_poll_us),
        busy_poll_budget_percent: Some(settings.busy_poll_budget_percent),
        stateless_wire: settings.stateless_wire,
        cpu_latency_limit: settings.cpu_latency_limit,
        store: settings.store,
        nodes_per_cluster: Some(NODES),
        rtt_ratio: Some(rtt_non_gateway_nodes.median_ms / rtt_gateway_nodes.median_ms),
        throughput_ratio: Some(mean(&far_mbit) / mean(&gw_mbit)),
        rtt_gateway_nodes: Some(rtt_gateway_nodes),
        rtt_non_gateway_nodes: Some(rtt_non_gateway_nodes),
        mbit_s_gateway_nodes: gw_mbit,
        mbit_s_non_gateway_nodes: far_mbit,
    })
}
