//! Command-line flags of `trellis-route` (each also `TRELLIS_<FLAG>`).

use std::net::Ipv4Addr;
use std::path::PathBuf;

use clap::Parser;
use trellis_runtime::config::{BaseConfig, HasBase, address_arg, underlay_mtu_arg};

fn node_name_arg(value: &str) -> Result<String, String> {
    trellis_api::ident::dns_label("--node-name", value).map_err(|e| e.to_string())
}

fn interface_arg(value: &str) -> Result<String, String> {
    if value.is_empty()
        || value.len() > 15
        || !value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(format!(
            "{value:?} is not an interface name (1-15 of a-z, A-Z, 0-9, '-', '_')"
        ));
    }
    Ok(value.to_owned())
}

fn ipv4_arg(value: &str) -> Result<Ipv4Addr, String> {
    match value.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(ip)) if !ip.is_unspecified() => Ok(ip),
        Ok(_) => Err(format!(
            "{value:?}: the overlay runs over IPv4; give the node's IPv4 address"
        )),
        Err(_) => Err(format!("{value:?} is not an IP address")),
    }
}

fn ipv4_cidr_arg(value: &str) -> Result<ipnet::Ipv4Net, String> {
    match value.parse::<ipnet::Ipv4Net>() {
        Ok(net) if net.trunc() == net => Ok(net),
        Ok(net) => Err(format!(
            "{value:?} has host bits set; did you mean {}?",
            net.trunc()
        )),
        Err(_) => Err(format!("{value:?} is not an IPv4 CIDR (like 10.9.0.0/16)")),
    }
}

fn vni_arg(value: &str) -> Result<u32, String> {
    match value.parse::<u32>() {
        Ok(v) if (1..=0x00ff_ffff).contains(&v) => Ok(v),
        _ => Err(format!("{value:?} is not a VXLAN id (1-16777215)")),
    }
}

/// The route agent of one node: routes the node's traffic for remote clusters to the gateway
/// node over a VXLAN overlay, from the local gateway's `WatchRoutes` stream. Runs on every node
/// (a DaemonSet), as root or with NET_ADMIN, in the node's network namespace; keeps no state of
/// its own, so a restart reconciles the node from the gateway's next message.
#[derive(Debug, Clone, Parser)]
#[command(name = "trellis-route", version, about, long_about = None)]
pub struct Config {
    #[command(flatten)]
    pub base: BaseConfig,

    /// Addresses of the local gateway replicas' gRPC servers (`host:port`, comma-separated),
    /// whose WatchRoutes streams the agent follows, all at once: the message with the highest
    /// epoch wins, so the node follows a standby the moment it takes over (its own stream
    /// says so first). A name is resolved every few seconds and every address it has is
    /// followed (in Kubernetes, a headless Service of the gateway replicas). Each is retried
    /// with backoff while unreachable.
    #[arg(
        long,
        env = "TRELLIS_GATEWAY",
        value_name = "HOST:PORT,...",
        value_parser = address_arg,
        value_delimiter = ',',
        required = true
    )]
    pub gateway: Vec<String>,

    /// This node's name (in Kubernetes, the downward API's `spec.nodeName`). The node whose
    /// name the gateway announces is the gateway node: it receives overlay traffic and routes
    /// nothing into the overlay itself.
    #[arg(long, env = "TRELLIS_NODE_NAME", value_name = "NAME", value_parser = node_name_arg)]
    pub node_name: String,

    /// This node's address on the node network (in Kubernetes, `status.hostIP`): the VXLAN's
    /// local end, and the source of the overlay address (240.x.y.z from this IPv4's last three
    /// bytes).
    #[arg(long, env = "TRELLIS_NODE_IP", value_name = "IPV4", value_parser = ipv4_arg)]
    pub node_ip: Ipv4Addr,

    /// Comma-separated CIDRs of the node network, when the nodes span more than the network of
    /// --node-ip's own address (the default): the gateway node accepts the overlay (UDP
    /// --vxlan-port) only from these, no pod may send to that port of any of them, and no
    /// remote prefix overlapping one is ever routed.
    #[arg(
        long,
        env = "TRELLIS_NODE_CIDRS",
        value_name = "CIDR,...",
        value_delimiter = ',',
        value_parser = ipv4_cidr_arg
    )]
    pub node_cidrs: Vec<ipnet::Ipv4Net>,

    /// Name of the VXLAN device the agent owns on the node.
    #[arg(
        long,
        env = "TRELLIS_INTERFACE",
        value_name = "NAME",
        value_parser = interface_arg,
        default_value = "trellis-vx"
    )]
    pub interface: String,

    /// VXLAN network identifier of the overlay (the same on every node of a cluster).
    #[arg(
        long,
        env = "TRELLIS_VXLAN_ID",
        value_name = "VNI",
        value_parser = vni_arg,
        default_value_t = 7107
    )]
    pub vxlan_id: u32,

    /// UDP port of the overlay (open it between the nodes). 4800, not the IANA 4789 most CNIs'
    /// own VXLAN uses, so the two never share a socket.
    #[arg(
        long,
        env = "TRELLIS_VXLAN_PORT",
        value_name = "PORT",
        default_value_t = 4800,
        value_parser = clap::value_parser!(u16).range(1..)
    )]
    pub vxlan_port: u16,

    /// MTU of the node's network (the interface holding --node-ip), 1280-9000; detected when
    /// not given. The overlay's MTU is this minus the 50 bytes of VXLAN; routes to remote
    /// prefixes get the smaller of that and the gateway's tunnel MTU (from `WatchRoutes`).
    #[arg(
        long,
        env = "TRELLIS_UNDERLAY_MTU",
        value_name = "BYTES",
        value_parser = underlay_mtu_arg
    )]
    pub underlay_mtu: Option<u32>,

    /// Where the node's `net` sysctls are (ip_forward, rp_filter). In an unprivileged
    /// container `/proc/sys` is read-only: mount the host's `/proc/sys/net` elsewhere (e.g.
    /// `/host/proc/sys/net`, with host networking) and name it here. Values that already
    /// match are not written.
    #[arg(
        long,
        env = "TRELLIS_PROC_SYS_NET",
        value_name = "DIR",
        default_value = "/proc/sys/net"
    )]
    pub proc_sys_net: PathBuf,

    /// Resync period, in seconds: the node is re-checked against the last message even
    /// without a change (repairs routes or devices someone removed).
    #[arg(
        long,
        env = "TRELLIS_RESYNC_INTERVAL",
        value_name = "SECONDS",
        default_value_t = 30,
        value_parser = clap::value_parser!(u64).range(1..=86400)
    )]
    pub resync_interval: u64,
}

impl HasBase for Config {
    fn base(&self) -> &BaseConfig {
        &self.base
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: [&str; 9] = [
        "trellis-route",
        "--cluster-id",
        "a",
        "--gateway",
        "trellis-gateway:7106",
        "--node-name",
        "node-1",
        "--node-ip",
        "100.64.1.2",
    ];

    fn parse(extra: &[&str]) -> Result<Config, String> {
        let mut args = GOOD.to_vec();
        args.extend_from_slice(extra);
        Config::try_parse_from(args).map_err(|e| e.to_string())
    }

    #[test]
    fn the_defaults_are_the_documented_overlay() {
        let c = parse(&[]).expect("parses");
        assert_eq!(
            (
                c.interface.as_str(),
                c.vxlan_id,
                c.vxlan_port,
                c.resync_interval
            ),
            ("trellis-vx", 7107, 4800, 30)
        );
        assert_eq!(c.underlay_mtu, None);
        assert!(
            c.node_cidrs.is_empty(),
            "the network of --node-ip's address"
        );
        let spread = parse(&["--node-cidrs", "10.9.0.0/16,10.10.0.0/16"]).expect("two subnets");
        assert_eq!(spread.node_cidrs.len(), 2);
        assert_eq!(c.proc_sys_net, PathBuf::from("/proc/sys/net"));
        let jumbo = parse(&["--underlay-mtu", "9000"]).expect("jumbo frames");
        assert_eq!(jumbo.underlay_mtu, Some(9000));
    }

    #[test]
    fn bad_flags_are_refused_naming_the_flag_and_the_reason() {
        for (flag, value, reason) in [
            ("--gateway", "no port here", "--gateway"),
            ("--node-name", "Node_1", "--node-name"),
            ("--node-ip", "fd00::1", "IPv4"),
            ("--node-ip", "0.0.0.0", "IPv4"),
            ("--node-ip", "node-1", "not an IP address"),
            ("--interface", "a-name-longer-than-15", "interface name"),
            ("--vxlan-id", "0", "VXLAN id"),
            ("--vxlan-id", "16777216", "VXLAN id"),
            ("--vxlan-port", "0", "--vxlan-port"),
            ("--underlay-mtu", "576", "--underlay-mtu"),
            ("--underlay-mtu", "9001", "--underlay-mtu"),
            ("--resync-interval", "0", "--resync-interval"),
            ("--node-cidrs", "10.9.0.1/16", "host bits"),
            ("--node-cidrs", "fd00::/64", "IPv4 CIDR"),
        ] {
            let mut args: Vec<&str> = GOOD.to_vec();
            match args.iter().position(|a| *a == flag) {
                Some(at) => args[at + 1] = value,
                None => args.extend([flag, value]),
            }
            let err = Config::try_parse_from(&args)
                .map(|_| ())
                .expect_err(&format!("{flag} {value} is refused"));
            let text = err.to_string();
            assert!(text.contains(flag), "{flag} {value}: {text}");
            assert!(text.contains(reason), "{flag} {value}: {text}");
        }
    }
}
