//! The two probes every scenario uses: ping for round-trip times, iperf3 for TCP throughput
//! (with the CPU time the tunnel processes spent meanwhile).

use std::net::Ipv4Addr;
use std::time::Duration;

use anyhow::{Context as _, bail};
use trellis_netlab::netns::exec;
use trellis_netlab::topology::ping_rtts;

use super::rr::quantile;
use crate::results::{Rtt, Transfer};

impl Rtt {
    pub(super) fn of(mut rtts: Vec<f64>, sent: u32) -> anyhow::Result<Self> {
        if rtts.is_empty() {
            bail!("no ping was answered");
        }
        rtts.sort_by(f64::total_cmp);
        let at = |q: f64| quantile(&rtts, q).unwrap_or(f64::NAN);
        Ok(Self {
            samples: rtts.len(),
            lost: sent.saturating_sub(u32::try_from(rtts.len()).unwrap_or(u32::MAX)),
            min_ms: rtts[0],
            median_ms: at(0.5),
            p90_ms: at(0.9),
            max_ms: rtts[rtts.len() - 1],
        })
    }
}

pub(super) fn rtt(ns: &str, target: Ipv4Addr, samples: u32) -> anyhow::Result<Rtt> {
    // One warm-up ping (ARP, conntrack, a handshake if one is due), then the samples.
    let _ = ping_rtts(ns, target, 1, 0.2)?;
    Rtt::of(ping_rtts(ns, target, samples, 0.2)?, samples)
}

/// The summed CPU seconds (utime + stime) of `pids`.
fn cpu_seconds(pids: &[u32]) -> anyhow::Result<f64> {
    pids.iter()
        .map(|p| crate::proc::usage(*p).map(|u| u.cpu_seconds))
        .sum()
}

/// iperf3 TCP with `streams` parallel streams from `client_ns` to a one-shot server in
/// `server_ns` bound to `server_ip`, reading the CPU time of the tunnel processes `pids` around
/// the client's run.
pub(crate) async fn iperf(
    client_ns: &str,
    server_ns: &str,
    server_ip: Ipv4Addr,
    connect_to: Ipv4Addr,
    seconds: u32,
    streams: u32,
    pids: &[u32],
) -> anyhow::Result<Transfer> {
    let mut server = std::process::Command::new("ip")
        .args(["netns", "exec", server_ns, "iperf3", "-s", "-1", "-B"])
        .arg(server_ip.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("starting the iperf3 server")?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (client_ns, target, secs, parallel) = (
        client_ns.to_owned(),
        connect_to.to_string(),
        seconds.to_string(),
        streams.to_string(),
    );
    let cpu_before = cpu_seconds(pids)?;
    let out = tokio::task::spawn_blocking(move || {
        exec(
            &client_ns,
            "iperf3",
            &["-c", &target, "-t", &secs, "-P", &parallel, "-J"],
        )
    })
    .await??;
    let cpu = cpu_seconds(pids)? - cpu_before;
    let _ = server.kill();
    let _ = server.wait();
    let json: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("iperf3 -J output")?;
    if let Some(err) = json["error"].as_str() {
        bail!("iperf3: {err}");
    }
    let received = &json["end"]["sum_received"];
    let bps = received["bits_per_second"]
        .as_f64()
        .context("no end.sum_received.bits_per_second in iperf3's output")?;
    let bytes = received["bytes"]
        .as_u64()
        .context("no end.sum_received.bytes in iperf3's output")?;
    Ok(Transfer {
        mbit_s: bps / 1e6,
        bytes,
        cpu_seconds: cpu,
        cpu_seconds_per_gb: (bytes > 0).then(|| cpu / (bytes as f64 / 1e9)),
    })
}
