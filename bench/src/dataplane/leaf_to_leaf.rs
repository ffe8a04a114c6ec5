//! The leaf-to-leaf scenarios: induced (A's pod to C's pod through the A–C tunnel, with the
//! side by side against wireguard-go and the throughput against the bare path) and through the
//! hub (B with `--no-induced`), each in a fabric of its own.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use trellis_api::pb::endpoints::TranslationPath;
use trellis_api::pb::types::PeeringKind;
use trellis_netlab::netem::LinkDelay;
use trellis_netlab::{Fabric, Service};

use super::links::{delays, emulate};
use super::probe::{iperf, rtt};
use super::side_by_side::{TunnelPath, side_by_side};
use super::{A, B, C, LIMIT, Settings, WIREGUARD, build, options};
use crate::reference::{Reference, ReferencePair};
use crate::results::{DataplaneResult, Emulation, Machine, Rtt, RunInfo, SideBySide, Throughput};

/// What the induced scenario measured.
struct Induced {
    tunnel: Option<Rtt>,
    bare: Option<Rtt>,
    throughput: Throughput,
    relay_overhead: Option<Rtt>,
    delayed: Rtt,
    ready: f64,
    compared: SideBySide,
}

async fn induced(settings: &Settings, emulation: Emulation) -> anyhow::Result<Induced> {
    let started = Instant::now();
    let fabric = Fabric::up(options(settings, false)).await?;
    fabric
        .wait_tunnel_endpoints(
            A,
            &[("b", PeeringKind::Full), ("c", PeeringKind::Induced)],
            LIMIT,
        )
        .await?;
    let (path, address) = fabric.reflect_pod(B, C, A).await?;
    if path != TranslationPath::Induced {
        bail!("B reflected C's pod to A by the {path:?} path, expected INDUCED");
    }
    fabric.wait_ping(A, address, LIMIT).await?;
    let ready = started.elapsed().as_secs_f64();
    eprintln!("dataplane-bench: induced path up at {address} after {ready:.1} s");
    let sites = &fabric.topology.sites;
    let wg = ReferencePair::up(Reference::WireguardGo, LIMIT).await?;
    eprintln!("dataplane-bench: wireguard-go reference tunnel up");
    let gota = if trellis_netlab::missing_prerequisites(&[Reference::GotaTun.program()]).is_empty()
    {
        let pair = ReferencePair::up(Reference::GotaTun, LIMIT).await?;
        eprintln!("dataplane-bench: gotatun reference tunnel up");
        Some(pair)
    } else {
        eprintln!(
            "dataplane-bench: GotaTun NOT MEASURED: no {} on PATH \
             (`bash scripts/install-gotatun.sh` installs it)",
            Reference::GotaTun.program()
        );
        None
    };
    let mut pids = Vec::new();
    for i in [A, C] {
        pids.push(
            fabric.clusters[i]
                .process(Service::Gateway)?
                .pid()
                .context("a gateway is not running")?,
        );
    }
    let ours = TunnelPath {
        name: "trellis",
        from_pod_ns: &sites[A].pod_ns,
        to_pod_ns: &sites[C].pod_ns,
        to_pod_ip: sites[C].pod_ip,
        to_pod_at: address,
        from_gw_ns: &sites[A].gw_ns,
        to_gw_ns: &sites[C].gw_ns,
        to_gw_ip: sites[C].uplink_ip,
        pids,
    };
    let theirs = reference_path(&wg);
    let gota_path = gota.as_ref().map(reference_path);
    let compared = side_by_side(settings, &ours, &theirs, gota_path.as_ref()).await?;
    drop((wg, gota));
    for (name, r) in [
        ("trellis", &compared.rtt_trellis),
        ("wireguard-go", &compared.rtt_wireguard_go),
        ("gotatun", &compared.rtt_gotatun),
    ] {
        let Some(r) = r else { continue };
        eprintln!(
            "dataplane-bench: {name}: tunnel RTT median {:.3} ms, bare {:.3} ms, overhead {:.3} ms",
            r.tunnel.median_ms, r.bare.median_ms, r.overhead_ms
        );
    }
    let n = |v: Option<f64>| v.unwrap_or(f64::NAN);
    for c in &compared.throughput {
        eprintln!(
            "dataplane-bench: {} stream(s): trellis {:.0} Mbit/s, wireguard-go {:.0} Mbit/s (x{:.2}); CPU s/GB {:.1} vs {:.1}",
            c.streams,
            n(c.trellis.median_mbit_s),
            n(c.wireguard_go.median_mbit_s),
            n(c.ratio_mbit_s),
            n(c.trellis.median_cpu_seconds_per_gb),
            n(c.wireguard_go.median_cpu_seconds_per_gb)
        );
    }
    let tunnel = compared.rtt_trellis.as_ref().map(|r| r.tunnel.clone());
    let bare = compared.rtt_trellis.as_ref().map(|r| r.bare.clone());
    let tunnel_mbit = n(compared.throughput[0].trellis.median_mbit_s);
    let bare_mbit = iperf(
        &sites[A].gw_ns,
        &sites[C].gw_ns,
        sites[C].uplink_ip,
        sites[C].uplink_ip,
        settings.iperf_seconds,
        1,
        &[],
    )
    .await?
    .mbit_s;
    let fraction = tunnel_mbit / bare_mbit;
    eprintln!(
        "dataplane-bench: iperf3 tunnel {tunnel_mbit:.0} Mbit/s, bare veth {bare_mbit:.0} Mbit/s ({:.1} %)",
        fraction * 100.0
    );
    let throughput = Throughput {
        tunnel_mbit_s: tunnel_mbit,
        bare_veth_mbit_s: bare_mbit,
        tunnel_fraction_of_bare: fraction,
        target_fraction: 0.30,
        target_met: fraction >= 0.30,
        seconds: settings.iperf_seconds,
    };
    // The relay's own cost: the same path through a relay that adds no delay.
    let relay_overhead = if emulation == Emulation::UdpRelay {
        let zero = delays(settings).map(|l| LinkDelay {
            rtt: Duration::ZERO,
            ..l
        });
        let relays = emulate(&fabric, emulation, &zero).await?;
        let through_relay = rtt(&sites[A].pod_ns, address, settings.samples)?;
        drop(relays);
        eprintln!(
            "dataplane-bench: through a 0 ms relay: median {:.3} ms",
            through_relay.median_ms
        );
        Some(through_relay)
    } else {
        None
    };
    let relays = emulate(&fabric, emulation, &delays(settings)).await?;
    let delayed = rtt(&sites[A].pod_ns, address, settings.samples)?;
    drop(relays);
    eprintln!(
        "dataplane-bench: induced path with link delays: median {:.1} ms, p90 {:.1} ms",
        delayed.median_ms, delayed.p90_ms
    );
    Ok(Induced {
        tunnel,
        bare,
        throughput,
        relay_overhead,
        delayed,
        ready,
        compared,
    })
}

async fn hub(settings: &Settings, emulation: Emulation) -> anyhow::Result<(Rtt, f64)> {
    let started = Instant::now();
    let fabric = Fabric::up(options(settings, true)).await?;
    fabric
        .wait_tunnel_endpoints(
            B,
            &[("a", PeeringKind::Full), ("c", PeeringKind::Full)],
            LIMIT,
        )
        .await?;
    fabric
        .wait_tunnel_endpoints(A, &[("b", PeeringKind::Full)], LIMIT)
        .await?;
    let (path, address) = fabric.reflect_pod(B, C, A).await?;
    if path != TranslationPath::HubExternal {
        bail!("B reflected C's pod to A by the {path:?} path, expected HUB_EXTERNAL");
    }
    fabric.wait_ping(A, address, LIMIT).await?;
    let ready = started.elapsed().as_secs_f64();
    eprintln!("dataplane-bench: hub path up at {address} after {ready:.1} s");
    let relays = emulate(&fabric, emulation, &delays(settings)).await?;
    let delayed = rtt(&fabric.topology.sites[A].pod_ns, address, settings.samples)?;
    drop(relays);
    eprintln!(
        "dataplane-bench: hub path with link delays: median {:.1} ms, p90 {:.1} ms",
        delayed.median_ms, delayed.p90_ms
    );
    Ok((delayed, ready))
}

/// Both scenarios, each in a fabric of its own, as one result.
pub async fn leaf_to_leaf(
    settings: &Settings,
    emulation: Emulation,
    run: RunInfo,
) -> anyhow::Result<DataplaneResult> {
    let Induced {
        tunnel,
        bare,
        throughput,
        relay_overhead,
        delayed: induced_rtt,
        ready: induced_ready,
        compared,
    } = induced(settings, emulation).await?;
    let (hub_rtt, hub_ready) = hub(settings, emulation).await?;
    Ok(DataplaneResult {
        benchmark: "dataplane_leaf_to_leaf".into(),
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
        emulation,
        rtt_through_zero_delay_relay: relay_overhead,
        hub_link_rtt_ms: settings.hub_link_ms,
        leaf_link_rtt_ms: settings.leaf_link_ms,
        rtt_no_netem_tunnel: tunnel,
        rtt_no_netem_bare: bare,
        throughput: Some(throughput),
        ratio_hub_over_induced: Some(hub_rtt.median_ms / induced_rtt.median_ms),
        rtt_induced: Some(induced_rtt),
        rtt_hub_path: Some(hub_rtt),
        thesis_induced_ms: Some(24.0),
        thesis_hub_ms: Some(365.0),
        induced_ready_seconds: Some(induced_ready),
        hub_ready_seconds: Some(hub_ready),
        side_by_side: Some(compared),
    })
}

/// A reference pair's tunnel, pod 0 to pod 1 (no NAT: the pod is reached at its own address).
fn reference_path(pair: &ReferencePair) -> TunnelPath<'_> {
    let sites = &pair.topology.sites;
    TunnelPath {
        name: pair.reference.name(),
        from_pod_ns: &sites[0].pod_ns,
        to_pod_ns: &sites[1].pod_ns,
        to_pod_ip: sites[1].pod_ip,
        to_pod_at: sites[1].pod_ip,
        from_gw_ns: &sites[0].gw_ns,
        to_gw_ns: &sites[1].gw_ns,
        to_gw_ip: sites[1].uplink_ip,
        pids: pair.pids(),
    }
}
