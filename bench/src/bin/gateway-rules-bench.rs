//! What the gateway's nftables tables and policy-routing rules cost a forwarded packet, as
//! root in three network namespaces with real packets: a pod, a router holding the tables the
//! gateway renders (`nft::script`, `guard::script`) and one policy rule per peer, and a peer
//! reached through a veth standing in for its tunnel. The peer pings the pod through the
//! router's DNAT and SNAT, `--pings-per-round` at `--ping-interval-ms`, with the router in turns
//! in five configurations per round: no table at all (plain routing), one peer's rules, a
//! hub's (`--peers`, the measured peer last, every other one with views, marks, a policy rule
//! and an allowed range of its own) with only the measured peer's policy rule and with all of
//! them, and a sketch of what one peer's rules would be under a stateless wire convention
//! (ADR 0032). The gap between one peer and the hub is what a packet pays for the peers it does
//! not come from (ADR 0033).

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::PathBuf;

use anyhow::{Context as _, bail, ensure};
use clap::Parser;
use ipnet::IpNet;
use trellis_bench::nat::percentile;
use trellis_bench::results::{GatewayRulesParameters, GatewayRulesResult, RulesVariant};
use trellis_bench::{Machine, RunArgs, RunInfo, median, write_json};
use trellis_gateway::dataplane::guard::{self, TunnelGuard};
use trellis_gateway::dataplane::linux::policy_rules;
use trellis_gateway::dataplane::nft::{self, PeerNat};
use trellis_gateway::names::{PAST_RULES_PRIORITY, SKIP_PRIORITY};
use trellis_netlab::netns::{Namespaces, exec, ip, nft_apply};
use trellis_netlab::topology::ping_rtts;

/// Measures ping RTT through a router holding the gateway's rules for one peer and for a hub's
/// peers, against plain routing; writes the result as JSON.
#[derive(Debug, Parser)]
struct Args {
    /// Peers in the hub configuration (2 to 10,000).
    #[arg(long, default_value_t = 254)]
    peers: usize,
    /// Rounds, each measuring every configuration once, in turns.
    #[arg(long, default_value_t = 8)]
    rounds: usize,
    /// Pings per configuration and round.
    #[arg(long, default_value_t = 40)]
    pings_per_round: u32,
    /// Interval between the pings, in milliseconds: 200, as the data-plane benchmark's RTT,
    /// lets every vCPU idle between them.
    #[arg(long, default_value_t = 200)]
    ping_interval_ms: u64,
    /// Where to write the JSON result.
    #[arg(long, default_value = "bench/results/gateway-rules.json")]
    out: PathBuf,
    #[command(flatten)]
    run: RunArgs,
}

/// The configuration with [`configure_stateless_sketch`]'s rules.
const STATELESS_SKETCH: &str = "one peer, stateless sketch (ADR 0032)";

/// The interface standing in for the measured peer's tunnel, in the router.
const TUNNEL: &str = "tgbench";
/// The pod, as the peer addresses it through the router's DNAT.
const POD_SEEN: Ipv4Addr = Ipv4Addr::new(10, 83, 0, 2);
const POD: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);

fn net(s: &str) -> IpNet {
    s.parse().expect("a valid literal")
}

/// Peer `i` of `n` (1-based): the measured one is the last, on [`TUNNEL`]; the others have
/// interfaces that do not exist, which costs a packet the same lookups.
fn peer(i: usize, n: usize) -> (PeerNat, TunnelGuard, u32) {
    // Slots as the gateway's default range hands them out (its first port onwards): they are
    // also the routing tables, and the small numbers 253-255 are the kernel's own.
    let slot = 51_840 + u32::try_from(i).expect("few peers");
    let mark = slot << 16;
    if i == n {
        let nat = PeerNat {
            interface: TUNNEL.into(),
            mark,
            hub_dnat: vec![],
            dnat: vec![(net("10.83.0.0/16"), net("10.0.0.0/16"))],
            snat: vec![(net("172.16.0.0/30"), net("10.81.0.0/30"))],
            stateless: false,
        };
        let guard = TunnelGuard {
            interface: TUNNEL.into(),
            allowed: vec![net("10.0.0.0/16")],
            zoned: true,
        };
        return (nat, guard, slot);
    }
    let (hi, lo) = (i / 256, i % 256);
    let interface = format!("tgb{i:07}");
    let nat = PeerNat {
        interface: interface.clone(),
        mark,
        hub_dnat: vec![],
        dnat: vec![(
            net(&format!("10.{}.{lo}.0/24", 64 + hi)),
            net("10.0.0.0/24"),
        )],
        snat: vec![(
            net("172.31.0.0/30"),
            net(&format!("10.{}.{lo}.0/30", 128 + hi)),
        )],
        stateless: false,
    };
    let guard = TunnelGuard {
        interface,
        allowed: vec![net("10.0.0.0/16")],
        zoned: true,
    };
    (nat, guard, slot)
}

/// The router with `peers` peers' tables and their policy rules, laid out as the gateway lays
/// them out (none: plain routing), or with only the measured peer's rule (`every_rule` false).
fn configure(router: &str, peers: usize, every_rule: bool) -> anyhow::Result<()> {
    nft_apply(
        router,
        &format!("{}{}", nft::script(&[], &[]), guard::script(&[])),
    )?;
    // Whatever rules the previous configuration left at the gateway's priorities.
    for pref in SKIP_PRIORITY..=PAST_RULES_PRIORITY {
        while ip(&["-n", router, "rule", "del", "pref", &pref.to_string()]).is_ok() {}
    }
    if peers == 0 {
        return Ok(());
    }
    let all: Vec<_> = (1..=peers).map(|i| peer(i, peers)).collect();
    let last_slot = all.last().map(|(_, _, slot)| *slot).unwrap_or_default();
    let nats: Vec<PeerNat> = all.iter().map(|(n, _, _)| n.clone()).collect();
    let guards: Vec<TunnelGuard> = all.iter().map(|(_, g, _)| g.clone()).collect();
    nft_apply(
        router,
        &format!("{}{}", nft::script(&nats, &[]), guard::script(&guards)),
    )?;
    let marks: BTreeSet<(u32, u32)> = all
        .iter()
        .filter(|(_, _, slot)| every_rule || *slot == last_slot)
        .map(|(nat, _, slot)| (nat.mark, *slot))
        .collect();
    for rule in policy_rules(&marks) {
        let mut args = vec![
            "-n".to_owned(),
            router.to_owned(),
            "rule".into(),
            "add".into(),
        ];
        args.extend(rule.args());
        ip(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
    }
    ip(&[
        "-n",
        router,
        "route",
        "replace",
        "default",
        "via",
        "172.16.0.2",
        "dev",
        TUNNEL,
        "table",
        &last_slot.to_string(),
    ])?;
    Ok(())
}

/// The router with a sketch of the rules a stateless wire convention would need for the
/// measured peer (ADR 0032), none of it built in the gateway: packets from the peer's tunnel
/// and towards its range skip connection tracking; what arrives from the tunnel may reach the
/// pods only; and what leaves into the tunnel is translated by stateless rewrites, here to the
/// addresses it already has, so the ping still finds its way while every rewrite and its
/// checksum update are paid. No policy rule: replies find the tunnel by their destination.
fn configure_stateless_sketch(router: &str) -> anyhow::Result<()> {
    configure(router, 0, true)?;
    let script = r#"table ip TABLE {
  chain pre_raw {
    type filter hook prerouting priority raw; policy accept;
    iifname { "TUNNEL" } notrack
    ip daddr { 172.16.0.0/30 } notrack
  }
  chain forward {
    type filter hook forward priority filter; policy accept;
    iifname vmap { "TUNNEL" : jump from_peer }
  }
  chain from_peer {
    ip daddr { 10.0.0.0/16 } accept
    drop
  }
  chain post {
    type filter hook postrouting priority srcnat; policy accept;
    oifname vmap { "TUNNEL" : jump to_peer }
  }
  chain to_peer {
    ip saddr 10.0.0.0/16 ip saddr set ip saddr & 0.0.255.255 | 10.0.0.0
    ip daddr 172.16.0.0/30 ip daddr set ip daddr & 0.0.0.3 | 172.16.0.0
  }
}
"#
    .replace("TABLE", nft::TABLE)
    .replace("TUNNEL", TUNNEL);
    nft_apply(router, &script)
}

/// Pod — router — peer, the router forwarding between them.
fn build(namespaces: &mut Namespaces, tag: &str) -> anyhow::Result<(String, String, String)> {
    let (pod, router, peer) = (format!("{tag}p"), format!("{tag}r"), format!("{tag}q"));
    for ns in [&pod, &router, &peer] {
        namespaces.add(ns)?;
    }
    ip(&[
        "link", "add", "grbpod", "netns", &pod, "type", "veth", "peer", "name", "grbr", "netns",
        &router,
    ])?;
    ip(&[
        "link", "add", "grbpeer", "netns", &peer, "type", "veth", "peer", "name", TUNNEL, "netns",
        &router,
    ])?;
    for (ns, dev, addr) in [
        (&pod, "grbpod", "10.0.0.2/24"),
        (&router, "grbr", "10.0.0.1/24"),
        (&router, TUNNEL, "172.16.0.1/30"),
        (&peer, "grbpeer", "172.16.0.2/30"),
    ] {
        ip(&["-n", ns, "addr", "add", addr, "dev", dev])?;
        ip(&["-n", ns, "link", "set", dev, "up"])?;
    }
    ip(&["-n", &pod, "route", "add", "default", "via", "10.0.0.1"])?;
    ip(&["-n", &peer, "route", "add", "default", "via", "172.16.0.1"])?;
    ip(&[
        "-n",
        &router,
        "route",
        "add",
        "10.81.0.0/16",
        "via",
        "172.16.0.2",
        "dev",
        TUNNEL,
    ])?;
    let forward = exec(&router, "sysctl", &["-qw", "net.ipv4.ip_forward=1"])?;
    ensure!(forward.status.success(), "ip_forward in {router}");
    Ok((pod, router, peer))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let run = RunInfo::start(&args.run);
    let missing = trellis_netlab::missing_prerequisites(&["ip", "nft", "ping", "sysctl"]);
    if !missing.is_empty() {
        bail!(
            "gateway-rules-bench builds network namespaces and needs {}",
            missing.join(", ")
        );
    }
    ensure!(
        (2..=10_000).contains(&args.peers),
        "--peers: between 2 and 10000"
    );
    ensure!(
        args.rounds >= 1 && args.pings_per_round >= 1,
        "--rounds and --pings-per-round: at least 1"
    );
    let mut namespaces = Namespaces::default();
    let (_pod, router, peer_ns) = build(&mut namespaces, &format!("grb{}", std::process::id()))?;
    let interval = args.ping_interval_ms as f64 / 1000.0;
    let variants = [
        ("no rules (plain routing)", 0, true),
        ("one peer", 1, true),
        ("hub's tables, one policy rule", args.peers, false),
        ("hub", args.peers, true),
        (STATELESS_SKETCH, 1, false),
    ];
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for round in 1..=args.rounds {
        for (i, (name, peers, every_rule)) in variants.iter().enumerate() {
            let sketch = *name == STATELESS_SKETCH;
            if sketch {
                configure_stateless_sketch(&router)
            } else {
                configure(&router, *peers, *every_rule)
            }
            .with_context(|| format!("configuring {name}"))?;
            // The sketch translates nothing on the way in: the peer would have sent the pod's
            // own address.
            let target = if *peers == 0 || sketch { POD } else { POD_SEEN };
            // One warm-up ping (ARP, the conntrack entry), then the samples.
            let _ = ping_rtts(&peer_ns, target, 1, 0.2)?;
            let rtts = ping_rtts(&peer_ns, target, args.pings_per_round, interval)?;
            ensure!(
                !rtts.is_empty(),
                "{name}: no ping through the router was answered"
            );
            eprintln!(
                "gateway-rules-bench: round {round}/{}: {name}: median {:.3} ms",
                args.rounds,
                median(&rtts).unwrap_or(f64::NAN)
            );
            samples[i].extend(rtts);
        }
    }
    let variants: Vec<RulesVariant> = variants
        .iter()
        .zip(samples)
        .map(|((name, peers, every_rule), rtts)| RulesVariant {
            name: (*name).into(),
            peers: *peers,
            policy_rules: match (*name == STATELESS_SKETCH, *every_rule) {
                (true, _) => 0,
                (false, true) => *peers,
                (false, false) => 1,
            },
            samples: rtts.len(),
            median_ms: median(&rtts),
            p90_ms: percentile(&rtts, 0.9),
        })
        .collect();
    let gap = |a: usize, b: usize| Some(variants[a].median_ms? - variants[b].median_ms?);
    let result = GatewayRulesResult {
        benchmark: "gateway_rules_cost_per_packet".into(),
        run: Some(run),
        machine: Some(Machine::describe()),
        parameters: GatewayRulesParameters {
            peers: args.peers,
            rounds: args.rounds,
            pings_per_round: args.pings_per_round,
            ping_interval_ms: args.ping_interval_ms,
        },
        one_peer_over_bare_ms: gap(1, 0),
        hub_tables_over_one_peer_ms: gap(2, 1),
        hub_over_bare_ms: gap(3, 0),
        hub_over_one_peer_ms: gap(3, 1),
        stateless_sketch_over_bare_ms: gap(4, 0),
        variants,
    };
    for v in &result.variants {
        eprintln!(
            "{:<30} {:>6} peers {:>6} policy rules  median {:.3} ms  p90 {:.3} ms  ({} pings)",
            v.name,
            v.peers,
            v.policy_rules,
            v.median_ms.unwrap_or(f64::NAN),
            v.p90_ms.unwrap_or(f64::NAN),
            v.samples
        );
    }
    write_json(&args.out, &result)?;
    drop(namespaces);
    Ok(())
}
