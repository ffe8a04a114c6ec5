//! The gateway's Prometheus metrics (issue 19): one series per tunnel, labelled with the peer
//! cluster and the peering kind: bytes and packets in and out, the age of the last handshake
//! and the state (the same view `ListTunnels` gives), and how often the data plane configured
//! it. Read from the devices at every scrape,
//! so a removed tunnel's series disappear with it; the counters are the devices' own (they
//! restart from zero when a device is recreated, which Prometheus' `rate()` handles as a
//! counter reset).
//!
//! With the userspace engine, `trellis_gateway_dropped_datagrams_total{reason}` counts the
//! datagrams at the WireGuard port that were dropped (malformed, a bad MAC, for no peer, a
//! replay, failed authentication, an inner source outside the peer's AllowedIPs, a relay
//! datagram refused or over its pair's rate, a resent copy already had), `trellis_tunnel_path{path}`
//! how many tunnels go direct and how many through a hub's relay, and
//! `trellis_gateway_resent_datagrams_total` what was resent through a hub when a tunnel's
//! direct path died; `trellis_gateway_received_while_polling_total` what the sending thread
//! received while it busy-polled, so an operator sees whether replies come back within its
//! window, and `trellis_gateway_busy_poll_seconds_total` the time spent in polling windows.

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use trellis_api::model::PeeringKind;
use trellis_runtime::metrics::{Labels, Metrics, prometheus_client};

use crate::core::{Gateway, State, TunnelStatus};

/// One tunnel as last read.
#[derive(Debug, Clone)]
struct Sample {
    labels: Labels,
    state: State,
    handshake_age: Option<f64>,
    rx_bytes: u64,
    tx_bytes: u64,
    rx_packets: Option<u64>,
    tx_packets: Option<u64>,
    configurations: u64,
    /// `direct` or `relayed` once the tunnel had a handshake.
    path: Option<&'static str>,
}

impl Sample {
    fn of(t: &TunnelStatus, now: SystemTime) -> Self {
        let te = &t.plan.endpoint;
        let kind = match te.kind {
            PeeringKind::Full => "full",
            PeeringKind::Induced => "induced",
        };
        let stats = t.stats.unwrap_or_default();
        Self {
            labels: vec![
                ("peer", te.remote.id.to_string()),
                ("kind", kind.to_owned()),
            ],
            state: t.state,
            handshake_age: stats
                .last_handshake
                .map(|at| now.duration_since(at).unwrap_or_default().as_secs_f64()),
            rx_bytes: stats.rx_bytes,
            tx_bytes: stats.tx_bytes,
            rx_packets: stats.rx_packets,
            tx_packets: stats.tx_packets,
            configurations: t.configurations,
            path: stats
                .last_handshake
                .map(|_| if stats.relayed { "relayed" } else { "direct" }),
        }
    }
}

/// Encodes the last snapshot (refreshed by the scrape hook just before).
#[derive(Debug, Clone, Default)]
struct TunnelCollector {
    snapshot: Arc<Mutex<Vec<Sample>>>,
    /// The engine's drop counters, read at encoding time (atomics, no lock to wait for).
    core: Option<Arc<Gateway>>,
}

const STATES: [(State, &str); 4] = [
    (State::Connecting, "connecting"),
    (State::Up, "up"),
    (State::Down, "down"),
    (State::Error, "error"),
];

fn counters(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    samples: &[Sample],
    value: impl Fn(&Sample) -> Option<u64>,
) -> Result<(), std::fmt::Error> {
    let mut family =
        encoder.encode_descriptor(name, help, None, ConstCounter::new(0u64).metric_type())?;
    for s in samples {
        if let Some(v) = value(s) {
            ConstCounter::new(v).encode(family.encode_family(&s.labels)?)?;
        }
    }
    Ok(())
}

impl Collector for TunnelCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let samples = self
            .snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        // Counter names without `_total`: the encoder appends it.
        counters(
            &mut encoder,
            "trellis_gateway_tunnel_rx_bytes",
            "Bytes received from the peer through the tunnel (WireGuard's count)",
            &samples,
            |s| Some(s.rx_bytes),
        )?;
        counters(
            &mut encoder,
            "trellis_gateway_tunnel_tx_bytes",
            "Bytes sent to the peer through the tunnel (WireGuard's count)",
            &samples,
            |s| Some(s.tx_bytes),
        )?;
        counters(
            &mut encoder,
            "trellis_gateway_tunnel_rx_packets",
            "Packets the tunnel device delivered from the peer (the interface's count)",
            &samples,
            |s| s.rx_packets,
        )?;
        counters(
            &mut encoder,
            "trellis_gateway_tunnel_tx_packets",
            "Packets the tunnel device took to send to the peer (the interface's count)",
            &samples,
            |s| s.tx_packets,
        )?;
        counters(
            &mut encoder,
            "trellis_gateway_tunnel_configurations",
            "Times the data plane configured the tunnel's device and routes since the gateway \
             started (once, plus once per change of its TunnelEndpoint or repair)",
            &samples,
            |s| Some(s.configurations),
        )?;
        let mut age = encoder.encode_descriptor(
            "trellis_gateway_tunnel_handshake_age_seconds",
            "Seconds since the tunnel's last WireGuard handshake (absent before the first)",
            None,
            ConstGauge::new(0.0f64).metric_type(),
        )?;
        for s in &samples {
            if let Some(v) = s.handshake_age {
                ConstGauge::new(v).encode(age.encode_family(&s.labels)?)?;
            }
        }
        if let Some(core) = &self.core {
            let dropped = core.dropped_datagrams();
            if !dropped.is_empty() {
                let mut family = encoder.encode_descriptor(
                    "trellis_gateway_dropped_datagrams",
                    "Datagrams at the WireGuard port dropped by the userspace engine, by reason",
                    None,
                    ConstCounter::new(0u64).metric_type(),
                )?;
                for (reason, n) in dropped {
                    let labels: Labels = vec![("reason", reason.label().to_owned())];
                    ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
                }
            }
            if let Some(resent) = core.resent_datagrams() {
                let family = encoder.encode_descriptor(
                    "trellis_gateway_resent_datagrams",
                    "Datagrams sent straight to a remote gateway in the seconds before its tunnel \
                     moved to the hub's relay, sent again through the hub (what the dead path \
                     may have lost; the receiver drops copies it already has as relay_duplicate)",
                    None,
                    ConstCounter::new(0u64).metric_type(),
                )?;
                ConstCounter::new(resent).encode(family)?;
            }
            if let Some(caught) = core.received_while_polling() {
                let family = encoder.encode_descriptor(
                    "trellis_gateway_received_while_polling",
                    "Receive buffers (a datagram, or one sender's datagrams coalesced by GRO) \
                     the engine's sending thread filled while it busy-polled (--busy-poll-us): \
                     replies handled without waking the receiving thread; stays 0 with \
                     polling off",
                    None,
                    ConstCounter::new(0u64).metric_type(),
                )?;
                ConstCounter::new(caught).encode(family)?;
            }
            if let Some(polled) = core.busy_polled() {
                let family = encoder.encode_descriptor(
                    "trellis_gateway_busy_poll_seconds",
                    "Seconds the engine's sending and receiving threads spent inside their \
                     busy-polling windows (--busy-poll-us), together, the packets handled there \
                     included: what the budget (--busy-poll-budget-percent) charges; stays 0 \
                     with polling off",
                    None,
                    ConstCounter::new(0.0f64).metric_type(),
                )?;
                ConstCounter::new(polled.as_secs_f64()).encode(family)?;
            }
        }
        let mut paths = encoder.encode_descriptor(
            "trellis_tunnel_path",
            "Tunnels by the path their datagrams take: straight to the remote gateway (direct) \
             or through the hub that introduced the two clusters (relayed; ADR 0025)",
            None,
            ConstGauge::new(0i64).metric_type(),
        )?;
        for path in ["direct", "relayed"] {
            let n = samples.iter().filter(|s| s.path == Some(path)).count();
            let labels: Labels = vec![("path", path.to_owned())];
            ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX))
                .encode(paths.encode_family(&labels)?)?;
        }
        let mut state = encoder.encode_descriptor(
            "trellis_gateway_tunnel_state",
            "1 for the tunnel's current state (connecting, up, down, error), 0 for the others",
            None,
            ConstGauge::new(0i64).metric_type(),
        )?;
        for s in &samples {
            for (candidate, name) in STATES {
                let mut labels = s.labels.clone();
                labels.push(("state", name.to_owned()));
                ConstGauge::new(i64::from(s.state == candidate))
                    .encode(state.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

/// Registers the tunnel metrics of `core` on `metrics`.
pub fn register(metrics: &Metrics, core: &Arc<Gateway>) {
    let collector = TunnelCollector {
        core: Some(core.clone()),
        ..TunnelCollector::default()
    };
    let snapshot = collector.snapshot.clone();
    metrics.register_collector(collector);
    let core = core.clone();
    metrics.on_scrape(move || {
        let (core, snapshot) = (core.clone(), snapshot.clone());
        async move {
            let now = SystemTime::now();
            let samples: Vec<Sample> = core
                .tunnels()
                .await
                .iter()
                .map(|t| Sample::of(t, now))
                .collect();
            *snapshot.lock().unwrap_or_else(|e| e.into_inner()) = samples;
        }
    });
}
