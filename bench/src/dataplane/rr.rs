//! Request/response over TCP, what latency-bound services feel: sockperf's ping-pong with
//! 64-byte messages, each request answered before the next is sent (netperf's TCP_RR), one
//! client process per connection against a server of its own, every round trip logged.

use std::net::Ipv4Addr;
use std::time::Duration;

use anyhow::{Context as _, bail};
use trellis_netlab::netns::exec;

use crate::results::RequestResponse;

/// The first server's port; connection `i` uses `PORT + i`.
const PORT: u16 = 11_111;

/// The size of every request and every response, bytes.
const MESSAGE_BYTES: &str = "64";

/// The servers of one measurement, stopped when it ends however it ends.
struct Servers(Vec<std::process::Child>);

impl Drop for Servers {
    fn drop(&mut self) {
        for s in &mut self.0 {
            let _ = s.kill();
            let _ = s.wait();
        }
    }
}

/// One measurement: the transactions per second of all connections together, and every
/// round trip, in microseconds.
#[derive(Debug)]
pub struct RrRun {
    pub per_s: f64,
    pub rtts_us: Vec<f64>,
}

/// `connections` sockperf clients in `client_ns`, each against its own server in `server_ns`
/// bound to `server_ip` and reached at `connect_to`, for `seconds` (sockperf leaves its
/// warm-up out of what it reports).
pub async fn tcp_rr(
    client_ns: &str,
    server_ns: &str,
    server_ip: Ipv4Addr,
    connect_to: Ipv4Addr,
    seconds: u32,
    connections: u16,
) -> anyhow::Result<RrRun> {
    let mut servers = Servers(Vec::new());
    for i in 0..connections {
        servers.0.push(
            std::process::Command::new("ip")
                .args(["netns", "exec", server_ns, "sockperf", "server", "--tcp"])
                .args(["-i", &server_ip.to_string(), "-p", &(PORT + i).to_string()])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .context("starting a sockperf server")?,
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let logs = tempfile::tempdir().context("a directory for sockperf's logs")?;
    let clients: Vec<_> = (0..connections)
        .map(|i| {
            let log = logs.path().join(format!("rr-{i}.csv"));
            let (ns, target, port, secs) = (
                client_ns.to_owned(),
                connect_to.to_string(),
                (PORT + i).to_string(),
                seconds.to_string(),
            );
            tokio::task::spawn_blocking(move || {
                let out = exec(
                    &ns,
                    "sockperf",
                    &[
                        "ping-pong",
                        "--tcp",
                        "-i",
                        &target,
                        "-p",
                        &port,
                        "-m",
                        MESSAGE_BYTES,
                        "-t",
                        &secs,
                        "--full-rtt",
                        "--full-log",
                        &log.to_string_lossy(),
                    ],
                )?;
                let stdout = String::from_utf8_lossy(&out.stdout);
                // sockperf exits 0 even when it cannot connect: what it printed decides.
                let Some(per_s) = valid_rate(&stdout) else {
                    bail!(
                        "sockperf to {target}:{port} reported no measurement: {}{}",
                        stdout.trim(),
                        String::from_utf8_lossy(&out.stderr).trim()
                    );
                };
                let text = std::fs::read_to_string(&log)
                    .with_context(|| format!("reading {}", log.display()))?;
                Ok((per_s, round_trips(&text)?))
            })
        })
        .collect();
    let mut run = RrRun {
        per_s: 0.0,
        rtts_us: Vec::new(),
    };
    for client in clients {
        let (per_s, rtts) = client.await??;
        run.per_s += per_s;
        run.rtts_us.extend(rtts);
    }
    drop(servers);
    Ok(run)
}

/// Transactions per second over sockperf's valid duration (warm-up excluded), from its
/// `[Valid Duration] RunTime=1.550 sec; SentMessages=70970; ReceivedMessages=70970` line.
fn valid_rate(stdout: &str) -> Option<f64> {
    let line = stdout.lines().find(|l| l.contains("[Valid Duration]"))?;
    let field = |name: &str| -> Option<f64> {
        let rest = &line[line.find(name)? + name.len()..];
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        rest[..end].parse().ok()
    };
    let (seconds, received) = (field("RunTime=")?, field("ReceivedMessages=")?);
    (seconds > 0.0).then(|| received / seconds)
}

/// The round trips of sockperf's `--full-log` CSV (`packet, txTime(sec), rxTime(sec),
/// rtt(usec)` with `--full-rtt`), in microseconds.
fn round_trips(log: &str) -> anyhow::Result<Vec<f64>> {
    let mut lines = log.lines().skip_while(|l| !l.starts_with("packet,"));
    if lines.next().is_none() {
        bail!("no round trips in sockperf's log");
    }
    let mut rtts = Vec::new();
    for line in lines.take_while(|l| !l.starts_with("---")) {
        let rtt = line
            .rsplit(',')
            .next()
            .and_then(|f| f.trim().parse::<f64>().ok())
            .with_context(|| format!("a line of sockperf's log without a round trip: {line}"))?;
        rtts.push(rtt);
    }
    Ok(rtts)
}

impl RequestResponse {
    /// The measurements of one path at one connection count, pooled over the rounds.
    pub fn of(runs: Vec<RrRun>) -> Self {
        let runs_per_s: Vec<f64> = runs.iter().map(|r| r.per_s).collect();
        let mut sorted = runs_per_s.clone();
        sorted.sort_by(f64::total_cmp);
        let mut rtts: Vec<f64> = runs.into_iter().flat_map(|r| r.rtts_us).collect();
        rtts.sort_by(f64::total_cmp);
        Self {
            median_per_s: quantile(&sorted, 0.5),
            samples: rtts.len(),
            p50_us: quantile(&rtts, 0.5),
            p99_us: quantile(&rtts, 0.99),
            p999_us: quantile(&rtts, 0.999),
            runs_per_s,
        }
    }
}

/// The `q` quantile of sorted `v` (nearest rank), none for none.
pub fn quantile(v: &[f64], q: f64) -> Option<f64> {
    let last = v.len().checked_sub(1)?;
    v.get(((last as f64 * q).round() as usize).min(last))
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Printed by sockperf 3.7 (Debian bookworm) for a 2 s ping-pong on loopback.
    const STDOUT: &str = "sockperf: [Total Run] RunTime=2.001 sec; Warm up time=400 msec; \
SentMessages=89368; ReceivedMessages=89367
sockperf: ========= Printing statistics for Server No: 0
sockperf: [Valid Duration] RunTime=1.550 sec; SentMessages=70970; ReceivedMessages=70970
sockperf: \u{1b}[2;35m====> avg-rtt=21.782 (std-dev=20.388)\u{1b}[0m
";

    #[test]
    fn the_rate_is_what_arrived_in_the_valid_duration() {
        let rate = valid_rate(STDOUT).expect("a valid duration");
        assert!((rate - 70_970.0 / 1.550).abs() < 1e-6, "{rate}");
        assert_eq!(
            valid_rate("sockperf: ERROR: Can`t connect socket (errno=111)"),
            None
        );
        assert_eq!(
            valid_rate("[Valid Duration] RunTime=0.000 sec; ReceivedMessages=0"),
            None
        );
    }

    #[test]
    fn round_trips_are_the_logs_last_column_up_to_its_footer() {
        let log = "------------------------------\n\
sockperf: [Valid Duration] RunTime=1.550 sec; SentMessages=3; ReceivedMessages=3\n\
packet, txTime(sec), rxTime(sec), rtt(usec)\n\
0, 2.445395885, 2.445421824, 25.939\n\
1, 2.445430000, 2.445450100, 20.100\n\
2, 2.445460000, 2.445493353, 33.353\n\
------------------------------\n";
        assert_eq!(round_trips(log).expect("a log"), vec![25.939, 20.1, 33.353]);
        assert!(round_trips("sockperf: nothing measured\n").is_err());
        assert!(round_trips("packet, txTime(sec), rxTime(sec), rtt(usec)\n0, 1, 2, x\n").is_err());
    }

    #[test]
    fn percentiles_pool_every_run_and_the_rate_is_the_median_run() {
        let runs = vec![
            RrRun {
                per_s: 300.0,
                rtts_us: (1..=500).map(f64::from).collect(),
            },
            RrRun {
                per_s: 100.0,
                rtts_us: (501..=1000).map(f64::from).collect(),
            },
            RrRun {
                per_s: 200.0,
                rtts_us: vec![],
            },
        ];
        let rr = RequestResponse::of(runs);
        assert_eq!(rr.samples, 1000);
        assert_eq!(rr.median_per_s, Some(200.0));
        assert_eq!(rr.runs_per_s, vec![300.0, 100.0, 200.0]);
        assert_eq!(rr.p50_us, Some(501.0));
        assert_eq!(rr.p99_us, Some(990.0));
        assert_eq!(rr.p999_us, Some(999.0));
        assert_eq!(RequestResponse::of(vec![]).p99_us, None);
    }
}
