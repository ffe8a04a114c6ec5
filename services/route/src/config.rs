//! Command-line flags of `trellis-route` (each also `TRELLIS_<FLAG>`).

use std::net::IpAddr;
use std::path::PathBuf;

use clap::Parser;
use trellis_runtime::config::{BaseConfig, HasBase, underlay_mtu_arg};

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

    /// Address of the local gateway's gRPC server (`host:port`), whose WatchRoutes stream the
    /// agent follows. Retried with backoff while unreachable; a gateway that restarts elsewhere
    /// is followed when the stream comes back.
    #[arg(long, env = "TRELLIS_GATEWAY", value_name = "HOST:PORT")]
    pub gateway: String,

    /// This node's name (in Kubernetes, the downward API's `spec.nodeName`). The node whose
    /// name the gateway announces is the gateway node: it receives overlay traffic and routes
    /// nothing into the overlay itself.
    #[arg(long, env = "TRELLIS_NODE_NAME", value_name = "NAME", value_parser = node_name_arg)]
    pub node_name: String,

    /// This node's address on the node network (in Kubernetes, `status.hostIP`): the VXLAN's
    /// local end, and the source of the overlay address (240.x.y.z from this IPv4's last three
    /// bytes).
    #[arg(long, env = "TRELLIS_NODE_IP", value_name = "IP")]
    pub node_ip: IpAddr,

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
        default_value_t = 4800
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
        default_value_t = 30
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

    fn parse(extra: &[&str]) -> Result<Config, clap::Error> {
        let mut args = vec![
            "trellis-route",
            "--cluster-id",
            "a",
            "--gateway",
            "127.0.0.1:7106",
            "--node-name",
            "n1",
            "--node-ip",
            "100.64.1.2",
        ];
        args.extend_from_slice(extra);
        Config::try_parse_from(args)
    }

    #[test]
    fn defaults() {
        let c = parse(&[]).expect("parses");
        assert_eq!(c.underlay_mtu, None);
        assert_eq!(c.proc_sys_net, PathBuf::from("/proc/sys/net"));
        assert_eq!((c.vxlan_id, c.vxlan_port), (7107, 4800));
    }

    #[test]
    fn bad_values_name_the_flag() {
        for (flag, bad) in [
            ("--underlay-mtu", "1279"),
            ("--underlay-mtu", "9001"),
            ("--underlay-mtu", "mtu"),
            ("--vxlan-id", "0"),
            ("--vxlan-id", "16777216"),
            ("--interface", "much-too-long-name"),
            ("--node-name", "Node_1"),
            ("--node-ip", "node-1"),
        ] {
            let err = parse(&[flag, bad]).expect_err(bad).to_string();
            assert!(err.contains(flag), "{flag} {bad}: {err}");
        }
        let c = parse(&["--underlay-mtu", "9000"]).expect("jumbo");
        assert_eq!(c.underlay_mtu, Some(9000));
    }
}
