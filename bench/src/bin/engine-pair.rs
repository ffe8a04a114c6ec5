//! The userspace WireGuard engine alone, against Debian's `wireguard-go` and GotaTun's
//! `gotatun`, in the same two namespaces in the same run (issue 18): a quick harness for
//! iterating on the engine. **Root only.**
//!
//! Two namespaces joined by a veth pair (MTU 1500); in each, a tunnel interface (MTU 1420) with
//! one peer, the other namespace. `trellis`: this process runs one [`Engine`] per namespace
//! (its threads enter the namespace); `wireguard-go` and `gotatun`: one such process per
//! namespace, configured with `wg` (`gotatun` comes from `scripts/install-gotatun.sh`);
//! `trellis-unbatched`: the engine with one syscall per datagram ([`Io::PerDatagram`], the
//! engine before batched I/O); `trellis-no-offload`: the engine with its TUN interfaces opened
//! without the kernel's offloads (one packet per read and write, the engine before ADR 0030);
//! `trellis-busy-poll`: the engine with its threads polling for [`BUSY_POLL_US`] after their
//! last packet (ADR 0032, opt-in). iperf3 TCP over the tunnel, one stream and `--streams`
//! streams, and the CPU seconds the implementation used per GB moved, then request/response
//! (sockperf ping-pong) at one and `--streams` connections, and ping's round trip through the
//! tunnel against the veth beneath it. No NAT, no nftables, no policy routing: the gateway's
//! full path is what `dataplane-bench` measures; this is the engine's ceiling.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use trellis_bench::dataplane::rr::{quantile, tcp_rr};
use trellis_bench::reference::Reference;
use trellis_bench::results::RequestResponse;
use trellis_gateway::dataplane::engine::{BUSY_POLL_US, Engine, Io, Options, PeerConfig};
use trellis_gateway::keys::KeyPair;
use trellis_netlab::netns::{Namespaces, exec, in_netns, ip};
use trellis_netlab::topology::ping_rtts;

#[derive(Debug, Parser)]
struct Args {
    /// Seconds per iperf3 run.
    #[arg(long, default_value_t = 10)]
    seconds: u32,
    /// Parallel streams of the multi-stream run, and connections of the second
    /// request/response run.
    #[arg(long, default_value_t = 4)]
    streams: u32,
    /// Seconds per request/response run (sockperf ping-pong, 64-byte TCP messages, one
    /// connection and `--streams` connections); 0 skips them.
    #[arg(long, default_value_t = 5)]
    rr_seconds: u32,
    /// Pings through the tunnel and on the veth beneath it; 0 skips them.
    #[arg(long, default_value_t = 25)]
    pings: u32,
    /// Seconds between pings (`dataplane-bench` sends them 0.2 s apart; ping refuses less than
    /// 0.002).
    #[arg(long, default_value_t = 0.2)]
    ping_interval: f64,
    /// Which implementations to run, in this order, repeats allowed (`trellis`,
    /// `trellis-no-offload`, `trellis-busy-poll`, `trellis-unbatched`, `wireguard-go`, `gotatun`).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "trellis,trellis-no-offload,trellis-busy-poll,trellis-unbatched,wireguard-go"
    )]
    only: Vec<String>,
}

const NS: [&str; 2] = ["ep-a", "ep-b"];
const UNDERLAY: [&str; 2] = ["192.168.77.1", "192.168.77.2"];
const INNER: [&str; 2] = ["10.99.0.1", "10.99.0.2"];
const PORT: u16 = 51820;
/// Tunnel interface names, one per namespace: wireguard-go's UAPI sockets
/// (`/var/run/wireguard/<name>.sock`) are host-wide, so the two must differ.
const DEV: [&str; 2] = ["wgpa", "wgpb"];

fn run(ns: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = exec(ns, args[0], &args[1..])?;
    if !out.status.success() {
        bail!(
            "{args:?} in {ns}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn topology() -> anyhow::Result<Namespaces> {
    let mut namespaces = Namespaces::default();
    for ns in NS {
        namespaces.add(ns)?;
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
    }
    ip(&[
        "link", "add", "va", "netns", NS[0], "type", "veth", "peer", "vb", "netns", NS[1],
    ])?;
    for (i, dev) in ["va", "vb"].iter().enumerate() {
        ip(&[
            "-n",
            NS[i],
            "addr",
            "add",
            &format!("{}/24", UNDERLAY[i]),
            "dev",
            dev,
        ])?;
        ip(&["-n", NS[i], "link", "set", dev, "up"])?;
    }
    Ok(namespaces)
}

fn address_tunnel(i: usize) -> anyhow::Result<()> {
    ip(&[
        "-n",
        NS[i],
        "addr",
        "add",
        &format!("{}/24", INNER[i]),
        "dev",
        DEV[i],
    ])?;
    ip(&["-n", NS[i], "link", "set", DEV[i], "mtu", "1420", "up"])?;
    Ok(())
}

/// CPU seconds (user + system) of process `pid` so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the command name.
    (ticks(11) + ticks(12)) / 100.0
}

/// One iperf3 run from A to B: (Mbit/s received, bytes).
fn iperf(seconds: u32, streams: u32) -> anyhow::Result<(f64, f64)> {
    let out = run(
        NS[0],
        &[
            "iperf3",
            "-c",
            INNER[1],
            "-t",
            &seconds.to_string(),
            "-P",
            &streams.to_string(),
            "-J",
        ],
    )?;
    let json: serde_json::Value = serde_json::from_str(&out).context("iperf3 json")?;
    let sum = &json["end"]["sum_received"];
    let bps = sum["bits_per_second"].as_f64().context("bits_per_second")?;
    let bytes = sum["bytes"].as_f64().context("bytes")?;
    Ok((bps / 1e6, bytes))
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn measure(label: &str, args: &Args, cpu: &dyn Fn() -> f64) -> anyhow::Result<()> {
    // Handshake and path warm-up.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !exec(NS[0], "ping", &["-c", "1", "-W", "1", INNER[1]])?
        .status
        .success()
    {
        if Instant::now() > deadline {
            bail!("{label}: no answer through the tunnel");
        }
    }
    for streams in [1, args.streams] {
        let before = cpu();
        let (mbps, bytes) = iperf(args.seconds, streams)?;
        let used = cpu() - before;
        eprintln!(
            "{label}: {streams} stream(s): {mbps:.0} Mbit/s, {:.1} CPU s/GB",
            used / (bytes / 1e9)
        );
    }
    if args.pings > 0 {
        let median = |target: &str| -> anyhow::Result<f64> {
            let mut rtts = ping_rtts(NS[0], target.parse()?, args.pings, args.ping_interval)?;
            rtts.sort_by(f64::total_cmp);
            quantile(&rtts, 0.5).context("no ping was answered")
        };
        let (tunnel, bare) = (median(INNER[1])?, median(UNDERLAY[1])?);
        eprintln!(
            "{label}: ping median {tunnel:.3} ms through the tunnel, {bare:.3} ms on the veth: \
             overhead {:.3} ms",
            tunnel - bare
        );
    }
    if args.rr_seconds > 0 {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        for connections in [1, u16::try_from(args.streams).unwrap_or(u16::MAX)] {
            let (to, at) = (INNER[1].parse()?, INNER[1].parse()?);
            let run =
                runtime.block_on(tcp_rr(NS[0], NS[1], to, at, args.rr_seconds, connections))?;
            let rr = RequestResponse::of(vec![run]);
            let us = |v: Option<f64>| v.unwrap_or(f64::NAN);
            eprintln!(
                "{label}: request/response, {connections} connection(s): {:.0}/s, p50 {:.0} µs, \
                 p99 {:.0} µs, p99.9 {:.0} µs",
                us(rr.median_per_s),
                us(rr.p50_us),
                us(rr.p99_us),
                us(rr.p999_us)
            );
        }
    }
    Ok(())
}

fn trellis(args: &Args, options: Options) -> anyhow::Result<()> {
    let keys = [KeyPair::generate(), KeyPair::generate()];
    let mut engines = Vec::new();
    for i in 0..2 {
        let private = keys[i].private_bytes();
        let config = PeerConfig {
            public_key: *keys[1 - i].public().as_bytes(),
            endpoint: format!("{}:{PORT}", UNDERLAY[1 - i]).parse()?,
            allowed_ips: vec![format!("{}/32", INNER[1 - i]).parse()?],
            keepalive: 0,
            candidates: Vec::new(),
            relay_via: None,
            relayable: false,
            translation: None,
        };
        let engine = in_netns(NS[i], move || {
            let engine = Engine::start_with(PORT, private, options)?;
            engine.add_peer(DEV[i], &config)?;
            Ok(Arc::new(engine))
        })?;
        address_tunnel(i)?;
        engines.push(engine);
    }
    let pid = std::process::id();
    let label = match options {
        Options {
            io: Io::PerDatagram,
            ..
        } => "trellis engine, unbatched",
        Options {
            tun_offload: false, ..
        } => "trellis engine, without tun offloads",
        Options { busy_poll, .. } if !busy_poll.is_zero() => "trellis engine, busy polling",
        _ => "trellis engine",
    };
    measure(label, args, &|| cpu_seconds(pid))
}

/// A reference device (`wireguard-go`, `gotatun`): one process per namespace, configured with
/// `wg`.
fn reference(args: &Args, reference: Reference) -> anyhow::Result<()> {
    let keys = [KeyPair::generate(), KeyPair::generate()];
    let mut processes = Vec::new();
    for i in 0..2 {
        let child = Command::new("ip")
            .args(["netns", "exec", NS[i], reference.program()])
            .args(reference.args(DEV[i]))
            .env("WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", reference.program()))?;
        processes.push(Killed(child));
        let socket = format!("/var/run/wireguard/{}.sock", DEV[i]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while ip(&["-n", NS[i], "link", "show", DEV[i]]).is_err()
            || !std::path::Path::new(&socket).exists()
        {
            if Instant::now() > deadline {
                bail!("{} made no {}", reference.program(), DEV[i]);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let conf = std::env::temp_dir().join(format!("engine-pair-{i}.conf"));
        std::fs::write(
            &conf,
            format!(
                "[Interface]\nPrivateKey = {}\nListenPort = {PORT}\n\n[Peer]\nPublicKey = {}\n\
                 Endpoint = {}:{PORT}\nAllowedIPs = {}/32\n",
                keys[i].private_base64(),
                keys[1 - i].public(),
                UNDERLAY[1 - i],
                INNER[1 - i]
            ),
        )?;
        run(
            NS[i],
            &[
                "wg",
                "setconf",
                DEV[i],
                conf.to_str().context("utf-8 path")?,
            ],
        )?;
        let _ = std::fs::remove_file(&conf);
        address_tunnel(i)?;
    }
    // `ip netns exec` is the devices' parent and exits into them: find their processes.
    let pattern = format!("{} .*wgp", reference.program());
    let pids: Vec<u32> = run(NS[0], &["pgrep", "-f", &pattern])?
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    let cleanup = || {
        for dev in DEV {
            let _ = std::fs::remove_file(format!("/var/run/wireguard/{dev}.sock"));
        }
    };
    let measured = measure(reference.name(), args, &|| {
        pids.iter().map(|p| cpu_seconds(*p)).sum()
    });
    drop(processes);
    cleanup();
    measured
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if !trellis_netlab::netns::is_root() {
        bail!("engine-pair needs root (network namespaces)");
    }
    let iperf_server = |_: ()| -> anyhow::Result<Killed> {
        Ok(Killed(
            Command::new("ip")
                .args(["netns", "exec", NS[1], "iperf3", "-s"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("iperf3 -s")?,
        ))
    };
    for which in &args.only {
        let _namespaces = topology()?;
        let _server = iperf_server(())?;
        std::thread::sleep(Duration::from_millis(300));
        match which.as_str() {
            "trellis" => trellis(&args, Options::default())?,
            "trellis-no-offload" => trellis(
                &args,
                Options {
                    tun_offload: false,
                    ..Options::default()
                },
            )?,
            "trellis-busy-poll" => trellis(
                &args,
                Options {
                    busy_poll: Duration::from_micros(BUSY_POLL_US),
                    ..Options::default()
                },
            )?,
            // The engine as first built: one system call per datagram and per packet.
            "trellis-unbatched" => trellis(
                &args,
                Options {
                    io: Io::PerDatagram,
                    tun_offload: false,
                    ..Options::default()
                },
            )?,
            "wireguard-go" => reference(&args, Reference::WireguardGo)?,
            "gotatun" => reference(&args, Reference::GotaTun)?,
            other => bail!("unknown implementation {other}"),
        }
    }
    Ok(())
}
