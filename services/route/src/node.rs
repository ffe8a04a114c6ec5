//! Reading and programming the node's network namespace: the VXLAN device, its overlay address,
//! the routes into it (tagged with our own route protocol number, so they are found again after
//! a restart and never confused with anyone else's), `rp_filter` and forwarding, and, in the
//! nftables table `ip trellis-route` (recreated atomically, like the gateway's), the TCP MSS
//! clamp, the node guard (no new connection from a remote prefix to the node itself) and the
//! overlay guard (VXLAN only from the node network, never from a pod).
//!
//! Before anything is routed, the node's own networks are read from its addresses: a remote
//! prefix overlapping one of them is refused ([`crate::plan::refuse`]), logged and counted.
//!
//! Every step compares what is there with what is wanted first, so a pass over a node that is
//! already right changes nothing, and a killed agent's successor finds its own objects instead
//! of adding second copies.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use ipnet::{IpNet, Ipv4Net};
use serde_json::Value;
use trellis_runtime::cmd;
use trellis_runtime::metrics::Metrics;
use trellis_runtime::metrics::prometheus_client::metrics::gauge::Gauge;

use crate::plan::{self, NodeSettings, Wanted};

/// The route protocol number our routes carry (`ip route ... proto 214`): not one iproute2
/// names, so no routing daemon claims it.
pub const ROUTE_PROTO: &str = "214";

/// The metric of our routes: above the gateway's own (0), so on the node where a standby
/// gateway takes over, its routes into the tunnels win at once, before this agent hears of
/// the takeover and withdraws ours, and neither writer replaces the other's route.
pub const ROUTE_METRIC: &str = "1024";

/// Our nftables table (family `ip`).
pub const NFT_TABLE: &str = "trellis-route";

/// The VXLAN device as found on the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundVxlan {
    pub id: u32,
    pub port: u16,
    pub local: Option<Ipv4Addr>,
    pub remote: Option<Ipv4Addr>,
    pub mtu: u32,
    pub up: bool,
    pub learning: bool,
    pub mac: String,
}

/// What the node holds of ours, and the networks of its own addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// `None`: no device of that name; `Some(None)`: a device that is not a VXLAN.
    pub vxlan: Option<Option<FoundVxlan>>,
    pub addresses: Vec<Ipv4Net>,
    pub routes: BTreeSet<Ipv4Net>,
    /// Our routes with another metric (an agent before [`ROUTE_METRIC`]): `(prefix, metric)`,
    /// removed.
    pub other_metric: Vec<(Ipv4Net, u64)>,
    /// `(interface, network)` of every IPv4 address of the node but loopback's.
    pub own: Vec<(String, Ipv4Net)>,
}

/// The remote prefixes this node refuses to route, as of its last reconciliation: shared with
/// the status RPC, and counted by the `trellis_route_refused_prefixes` gauge. Clones share.
#[derive(Debug, Clone, Default)]
pub struct Refused {
    prefixes: Arc<Mutex<BTreeSet<Ipv4Net>>>,
    gauge: Gauge,
}

impl Refused {
    /// A new one whose gauge is in `metrics`.
    pub fn registered(metrics: &Metrics) -> Self {
        let this = Self::default();
        metrics.register(
            "trellis_route_refused_prefixes",
            "Remote prefixes the gateway announced that this node does not route, because each \
             overlaps a network of the node (its node network, a bridge, the overlay); a peer's \
             range to remap (the IPAM's --reserved)",
            this.gauge.clone(),
        );
        this
    }

    /// The refused prefixes.
    pub fn prefixes(&self) -> BTreeSet<Ipv4Net> {
        self.prefixes.lock().map(|p| p.clone()).unwrap_or_default()
    }

    /// Records a reconciliation's refusals, logging each change once (not at every resync).
    fn record(&self, refused: &BTreeMap<Ipv4Net, (String, Ipv4Net)>) {
        let Ok(mut current) = self.prefixes.lock() else {
            return;
        };
        for (prefix, (interface, network)) in refused {
            if !current.contains(prefix) {
                tracing::warn!(
                    prefix = %prefix,
                    interface = %interface,
                    network = %network,
                    "refusing to route a remote prefix that overlaps a network of this node; \
                     reserve the node network in the IPAM (--reserved) so the peer is remapped"
                );
            }
        }
        for prefix in current.iter().filter(|p| !refused.contains_key(p)) {
            tracing::info!(prefix = %prefix, "a refused remote prefix is no longer announced or no longer overlaps");
        }
        *current = refused.keys().copied().collect();
        self.gauge
            .set(i64::try_from(current.len()).unwrap_or(i64::MAX));
    }
}

/// The interface holding `ip`, its MTU, and the network of that address.
pub async fn underlay(ip: Ipv4Addr) -> anyhow::Result<(String, u32, Ipv4Net)> {
    let json: Value = serde_json::from_str(&cmd::ip(&["-j", "addr", "show"]).await?)
        .context("parsing `ip -j addr show`")?;
    for link in json.as_array().into_iter().flatten() {
        let holds = link["addr_info"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|a| a["local"].as_str() == Some(&ip.to_string()));
        if holds {
            let name = link["ifname"].as_str().unwrap_or_default().to_owned();
            let mtu = link["mtu"].as_u64().and_then(|m| u32::try_from(m).ok());
            let len = link["addr_info"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|a| a["local"].as_str() == Some(&ip.to_string()))
                .and_then(|a| a["prefixlen"].as_u64())
                .and_then(|l| u8::try_from(l).ok())
                .unwrap_or(32);
            let network = Ipv4Net::new(ip, len).map_or(Ipv4Net::from(ip), |n| n.trunc());
            return Ok((name, mtu.unwrap_or(1500), network));
        }
    }
    anyhow::bail!("--node-ip {ip} is not an address of any interface of this node")
}

fn ipv4(v: &Value) -> Option<Ipv4Addr> {
    v.as_str().and_then(|s| s.parse().ok())
}

/// Reads what the node holds of ours.
pub async fn observe(interface: &str) -> anyhow::Result<Observed> {
    let mut observed = Observed::default();
    if let Ok(text) = cmd::ip(&["-d", "-j", "link", "show", "dev", interface]).await {
        let json: Value = serde_json::from_str(&text).context("parsing `ip -d -j link show`")?;
        let link = &json[0];
        let info = &link["linkinfo"];
        observed.vxlan = Some((info["info_kind"].as_str() == Some("vxlan")).then(|| {
            let data = &info["info_data"];
            FoundVxlan {
                id: data["id"]
                    .as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .unwrap_or(0),
                port: data["port"]
                    .as_u64()
                    .and_then(|v| u16::try_from(v).ok())
                    .unwrap_or(0),
                local: ipv4(&data["local"]),
                remote: ipv4(&data["remote"]),
                mtu: link["mtu"]
                    .as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .unwrap_or(0),
                up: link["flags"]
                    .as_array()
                    .is_some_and(|f| f.iter().any(|x| x.as_str() == Some("UP"))),
                learning: data["learning"].as_bool().unwrap_or(true),
                mac: link["address"].as_str().unwrap_or_default().to_owned(),
            }
        }));
        let text = cmd::ip(&["-j", "addr", "show", "dev", interface]).await?;
        let json: Value = serde_json::from_str(&text).context("parsing `ip -j addr show`")?;
        observed.addresses = json[0]["addr_info"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["family"].as_str() == Some("inet"))
            .filter_map(|a| {
                let addr = ipv4(&a["local"])?;
                let len = u8::try_from(a["prefixlen"].as_u64()?).ok()?;
                Ipv4Net::new(addr, len).ok()
            })
            .collect();
    }
    let text = cmd::ip(&["-j", "addr", "show"]).await?;
    observed.own = trellis_api::net::address_networks(&text)
        .map_err(anyhow::Error::msg)?
        .into_iter()
        .filter_map(|(interface, net)| match net {
            IpNet::V4(net) => Some((interface, net)),
            IpNet::V6(_) => None,
        })
        .collect();
    let text = cmd::ip(&["-j", "route", "show", "proto", ROUTE_PROTO]).await?;
    let json: Value = serde_json::from_str(&text).context("parsing `ip -j route show`")?;
    let metric: u64 = ROUTE_METRIC.parse().unwrap_or_default();
    for route in json.as_array().into_iter().flatten() {
        // A host route is listed without its /32.
        let Some(dst) = route["dst"].as_str().and_then(|dst| {
            dst.parse::<Ipv4Net>()
                .ok()
                .or_else(|| dst.parse::<Ipv4Addr>().ok().map(Ipv4Net::from))
        }) else {
            continue;
        };
        match route["metric"].as_u64().unwrap_or(0) {
            m if m == metric => {
                observed.routes.insert(dst);
            }
            other => observed.other_metric.push((dst, other)),
        }
    }
    Ok(observed)
}

/// Who may use this node's overlay: the senders whose VXLAN it accepts, and the node
/// addresses that no forwarded packet (a pod's) may send VXLAN to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverlayGuard {
    pub port: u16,
    /// The gateway node's address on every other node; the node network on the gateway node.
    pub senders: Vec<Ipv4Net>,
    /// The node network and the gateway node.
    pub nodes: Vec<Ipv4Net>,
}

impl OverlayGuard {
    /// The guard of `node` in the state `wanted`.
    pub fn of(node: &NodeSettings, wanted: &Wanted) -> Self {
        let mut nodes = node.node_cidrs.clone();
        nodes.extend(wanted.vxlan.remote.map(Ipv4Net::from));
        Self {
            port: wanted.vxlan.port,
            senders: match wanted.vxlan.remote {
                Some(gateway) => vec![Ipv4Net::from(gateway)],
                None => node.node_cidrs.clone(),
            },
            nodes: Ipv4Net::aggregate(&nodes),
        }
    }
}

/// An nftables set of IPv4 networks (no `elements` line when empty: nft refuses `{ }`).
fn set(name: &str, nets: &[Ipv4Net]) -> String {
    let mut s = format!("  set {name} {{\n    type ipv4_addr; flags interval;\n");
    if !nets.is_empty() {
        let elements: Vec<String> = Ipv4Net::aggregate(&nets.to_vec())
            .iter()
            .map(ToString::to_string)
            .collect();
        let _ = writeln!(s, "    elements = {{ {} }}", elements.join(", "));
    }
    s.push_str("  }\n");
    s
}

/// The nftables script that replaces our table: the remote prefixes as a set, a clamp of the
/// MSS of forwarded SYNs towards them to the route's MTU, the node guard and the overlay guard.
///
/// The node guard: the gateway's tunnel guard lets new connections from a peer through to our
/// whole pod CIDR, and a node holds addresses inside it (the first host of its pod slice here,
/// a CNI bridge's or tunnel device's address in a real cluster) that the gateway cannot tell
/// from pods. Everything a peer sends reaches the node with a source in a remote prefix (the
/// gateway translates peers' real sources into them, and its WireGuard AllowedIPs refuse the
/// rest), so dropping new connections from those sources to the node itself closes that door
/// without touching traffic forwarded to pods, or replies to what the node started.
///
/// The overlay guard: the VXLAN device takes any datagram at its port, so a pod could hand the
/// gateway node a frame carrying any inner packet (a forged source from another node's pod,
/// into a tunnel), or make another node's device learn a false address. The node accepts the
/// overlay's port only from its senders, and drops any forwarded packet (a pod's, possibly
/// masqueraded to the node's own address further on) towards a node's overlay port.
pub fn nft_script(clamp: &BTreeSet<Ipv4Net>, overlay: &OverlayGuard) -> String {
    let remote: Vec<Ipv4Net> = clamp.iter().copied().collect();
    let port = overlay.port;
    format!(
        "table ip {NFT_TABLE} {{}}\ndelete table ip {NFT_TABLE}\ntable ip {NFT_TABLE} {{\n\
         {}{}{}  chain forward {{\n    type filter hook forward priority mangle; policy \
         accept;\n    ip daddr @nodes udp dport {port} drop\n    ip daddr @remote tcp flags \
         syn tcp option maxseg size set rt mtu\n  }}\n  chain input {{\n    type filter hook \
         input priority filter; policy accept;\n    udp dport {port} ip saddr != @senders \
         drop\n    ip saddr @remote ct state new drop\n  }}\n}}\n",
        set("remote", &remote),
        set("senders", &overlay.senders),
        set("nodes", &overlay.nodes),
    )
}

/// Makes the node match `wanted`; returns how many changes it made (0 on a node that was
/// already right).
pub async fn apply(
    node: &NodeSettings,
    underlay: &str,
    wanted: &Wanted,
    observed: &Observed,
) -> anyhow::Result<usize> {
    let iface = node.interface.as_str();
    let mut own = observed.own.clone();
    own.extend(
        node.node_cidrs
            .iter()
            .map(|net| ("--node-cidrs".to_owned(), *net)),
    );
    let (kept, refused) = plan::refuse(wanted, &own);
    node.refused.record(&refused);
    let wanted = &kept;
    let mut changes = 0;
    let v = &wanted.vxlan;
    let found = observed.vxlan.clone();
    let same_device = matches!(&found, Some(Some(f)) if f.id == v.id && f.port == v.port
        && f.local == Some(v.local) && f.remote == v.remote && f.learning == v.learning
        && f.mac == v.mac);
    if !same_device {
        if found.is_some() {
            // A changed remote (the gateway moved) or a foreign device of our name: VXLAN
            // parameters cannot all be changed in place, so the device is recreated.
            cmd::ip(&["link", "del", iface]).await?;
        }
        let (id, port, local) = (v.id.to_string(), v.port.to_string(), v.local.to_string());
        let remote = v.remote.map(|r| r.to_string());
        let mut args = vec![
            "link", "add", iface, "address", &v.mac, "type", "vxlan", "id", &id, "dstport", &port,
            "local", &local,
        ];
        if let Some(remote) = &remote {
            args.extend(["remote", remote.as_str()]);
        }
        if !v.learning {
            args.push("nolearning");
        }
        cmd::ip(&args).await?;
        tracing::info!(interface = iface, remote = ?v.remote, "created the overlay device");
        changes += 1;
    }
    let settled = same_device && matches!(&found, Some(Some(f)) if f.mtu == v.mtu && f.up);
    if !settled {
        cmd::ip(&["link", "set", iface, "mtu", &v.mtu.to_string(), "up"]).await?;
        changes += 1;
    }
    let addresses = if same_device {
        observed.addresses.clone()
    } else {
        Vec::new()
    };
    if addresses != [v.address] {
        cmd::ip(&["addr", "flush", "dev", iface]).await?;
        cmd::ip(&["addr", "add", &v.address.to_string(), "dev", iface]).await?;
        changes += 1;
    }
    // Routes die with a recreated device; otherwise only differences are written. Every wanted
    // route is re-replaced on a change so a new MTU or next hop reaches all of them.
    let existing = if same_device {
        observed.routes.clone()
    } else {
        BTreeSet::new()
    };
    let mut batch = String::new();
    let mut deletes = String::new();
    if existing != wanted.routes || !settled {
        if let Some(via) = wanted.via {
            for net in &wanted.routes {
                let _ = writeln!(
                    batch,
                    "route replace {net} via {via} dev {iface} onlink mtu {} proto {ROUTE_PROTO} metric {ROUTE_METRIC}",
                    wanted.route_mtu
                );
            }
        }
        for net in existing.difference(&wanted.routes) {
            let _ = writeln!(
                deletes,
                "route del {net} proto {ROUTE_PROTO} metric {ROUTE_METRIC}"
            );
        }
    }
    for net in observed.routes.difference(&existing) {
        // Ours, but on a device we just replaced (or left over): gone with it, or stale.
        if !wanted.routes.contains(net) {
            let _ = writeln!(
                deletes,
                "route del {net} proto {ROUTE_PROTO} metric {ROUTE_METRIC}"
            );
        }
    }
    for (net, metric) in &observed.other_metric {
        let _ = writeln!(
            deletes,
            "route del {net} proto {ROUTE_PROTO} metric {metric}"
        );
    }
    if !batch.is_empty() {
        cmd::run("ip", &["-force", "-batch", "-"], Some(&batch)).await?;
        changes += 1;
    }
    if let (Some(via), Some(mac)) = (wanted.via, &wanted.via_mac) {
        let via = via.to_string();
        cmd::ip(&[
            "neigh",
            "replace",
            &via,
            "lladdr",
            mac,
            "dev",
            iface,
            "nud",
            "permanent",
        ])
        .await?;
    }
    if !deletes.is_empty() {
        match cmd::run("ip", &["-force", "-batch", "-"], Some(&deletes)).await {
            Ok(_) => {}
            // A route of a device just replaced went with it: gone is what was wanted.
            Err(err) if only_already_gone(&format!("{err:#}")) => {}
            Err(err) => return Err(err),
        }
        changes += 1;
    }
    // Replies of connections the gateway DNATs to this node's pods arrive over the node
    // network but route back through the overlay: strict reverse-path filtering would drop them.
    let root = node.proc_sys_net.as_path();
    ensure_sysctl(root, "ip_forward", "1").await?;
    ensure_sysctl(root, &format!("conf/{iface}/rp_filter"), "2").await?;
    ensure_sysctl(root, &format!("conf/{underlay}/rp_filter"), "2").await?;
    let overlay = OverlayGuard::of(node, wanted);
    cmd::run(
        "nft",
        &["-f", "-"],
        Some(&nft_script(&wanted.clamp, &overlay)),
    )
    .await?;
    Ok(changes)
}

/// Whether every failure `ip -batch` reported in `error` is a route that no longer exists.
fn only_already_gone(error: &str) -> bool {
    error
        .lines()
        .filter(|l| l.contains("RTNETLINK answers"))
        .all(|l| l.contains("No such process"))
        && error.contains("RTNETLINK answers")
}

/// Sets `ipv4/<path>` under `root` (`--proc-sys-net`) to `value` unless it already is, so a
/// node whose values are right needs no write (and a read-only `/proc/sys` is then fine).
async fn ensure_sysctl(root: &Path, path: &str, value: &str) -> anyhow::Result<()> {
    cmd::ensure_sysctl(
        root,
        path,
        value,
        "read-only? mount the host's /proc/sys/net and set --proc-sys-net",
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_routes_already_gone_are_tolerated_when_deleting() {
        let gone = "ip -force -batch - failed (exit status: 1): RTNETLINK answers: No such \
                    process\nCommand failed -:1\nRTNETLINK answers: No such process";
        assert!(only_already_gone(gone));
        let denied = "ip -force -batch - failed (exit status: 1): RTNETLINK answers: No such \
                      process\nRTNETLINK answers: Operation not permitted";
        assert!(!only_already_gone(denied));
        assert!(!only_already_gone(
            "cannot run ip -force -batch -: not found"
        ));
    }

    #[tokio::test]
    async fn sysctls_are_written_under_the_given_root_only_when_they_differ() {
        let dir = std::env::temp_dir().join(format!("trellis-route-sysctl-{}", std::process::id()));
        let conf = dir.join("ipv4/conf/vx0");
        std::fs::create_dir_all(&conf).expect("dirs");
        std::fs::write(dir.join("ipv4/ip_forward"), "1\n").expect("write");
        std::fs::write(conf.join("rp_filter"), "1\n").expect("write");
        // Already right: not written (a write would have left "1" without the newline).
        ensure_sysctl(&dir, "ip_forward", "1")
            .await
            .expect("unchanged");
        assert_eq!(
            std::fs::read_to_string(dir.join("ipv4/ip_forward")).expect("read"),
            "1\n"
        );
        ensure_sysctl(&dir, "conf/vx0/rp_filter", "2")
            .await
            .expect("written");
        assert_eq!(
            std::fs::read_to_string(conf.join("rp_filter"))
                .expect("read")
                .trim(),
            "2"
        );
        // A missing file is an error naming the path and the flag.
        let err = ensure_sysctl(&dir, "conf/gone/rp_filter", "2")
            .await
            .expect_err("no such sysctl");
        let text = format!("{err:#}");
        assert!(
            text.contains("conf/gone/rp_filter") && text.contains("--proc-sys-net"),
            "{text}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_nft_script_clamps_guards_and_keeps_the_overlay_to_its_senders() {
        let guard = OverlayGuard {
            port: 4800,
            senders: vec!["100.64.1.1/32".parse().expect("net")],
            nodes: vec![
                "100.64.1.0/24".parse().expect("net"),
                "100.64.1.1/32".parse().expect("net"),
            ],
        };
        let none = nft_script(&BTreeSet::new(), &guard);
        assert!(none.starts_with("table ip trellis-route {}\ndelete table ip trellis-route\n"));
        assert!(
            none.contains("set remote {\n    type ipv4_addr; flags interval;\n  }"),
            "an empty set has no elements line: {none}"
        );
        let some = nft_script(&["10.83.0.0/16".parse().expect("net")].into(), &guard);
        assert!(some.contains("elements = { 10.83.0.0/16 }"), "{some}");
        assert!(some.contains("tcp option maxseg size set rt mtu"), "{some}");
        assert!(
            some.contains(
                "hook input priority filter; policy accept;\n    udp dport 4800 ip saddr != \
                 @senders drop\n    ip saddr @remote ct state new drop"
            ),
            "{some}"
        );
        assert!(
            some.contains("ip daddr @nodes udp dport 4800 drop"),
            "{some}"
        );
        // Overlapping nodes are merged (nft refuses overlapping intervals).
        assert!(some.contains("elements = { 100.64.1.0/24 }"), "{some}");
    }

    fn settings(node_cidrs: &[&str]) -> NodeSettings {
        NodeSettings {
            name: "n1".into(),
            ip: Ipv4Addr::new(10, 9, 0, 2),
            interface: "trellis-vx".into(),
            vxlan_id: 7107,
            vxlan_port: 4800,
            underlay_mtu: 1500,
            proc_sys_net: "/proc/sys/net".into(),
            node_cidrs: node_cidrs.iter().map(|n| n.parse().expect("net")).collect(),
            refused: Refused::default(),
        }
    }

    #[test]
    fn only_the_gateway_node_accepts_the_overlay_from_the_whole_node_network() {
        let message = |gateway: &str| crate::remote::RoutesUpdate {
            epoch: 1,
            gateway_node: gateway.into(),
            gateway_ip: crate::remote::GatewayIp::V4("10.9.0.1".parse().expect("ip")),
            remote_prefixes: BTreeSet::new(),
            tunnel_mtu: Some(1420),
        };
        let node = settings(&["10.9.0.0/16"]);
        let other = plan::plan(&node, &message("n0")).expect("plans");
        let guard = OverlayGuard::of(&node, &other);
        assert_eq!(guard.senders, ["10.9.0.1/32".parse().expect("net")]);
        assert_eq!(guard.nodes, ["10.9.0.0/16".parse().expect("net")]);
        let gateway = plan::plan(&node, &message("n1")).expect("plans");
        let guard = OverlayGuard::of(&node, &gateway);
        assert_eq!(guard.senders, ["10.9.0.0/16".parse().expect("net")]);
    }

    #[test]
    fn refusals_are_shared_and_counted() {
        let refused = Refused::default();
        let shared = refused.clone();
        let net: Ipv4Net = "10.9.0.0/16".parse().expect("net");
        refused.record(&[(net, ("node".to_owned(), net))].into());
        assert_eq!(shared.prefixes(), [net].into());
        assert_eq!(shared.gauge.get(), 1);
        refused.record(&BTreeMap::new());
        assert!(shared.prefixes().is_empty());
        assert_eq!(shared.gauge.get(), 0);
    }
}
