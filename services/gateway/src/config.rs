//! Command-line flags of `trellis-gateway` (each also `TRELLIS_<FLAG>`).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use clap::{Parser, ValueEnum};
use trellis_api::model::EndpointHost;
use trellis_runtime::CommonConfig;
use trellis_runtime::config::{HasCommon, ports as default_ports, underlay_mtu_arg};

use crate::ports::PortRange;

/// The gateway's busy-polling window by default, in microseconds (`--busy-poll-us`): long
/// enough for a lone request's reply through two gateways on one virtual machine (ADR 0032).
pub const DEFAULT_BUSY_POLL_US: u64 = 500;

/// Which data plane the gateway drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DataplaneFlag {
    /// Control plane only: keys, ports and tunnel status from the desired state; no interfaces,
    /// routes or rules (the lab without root).
    None,
    /// Userspace WireGuard (boringtun) on a tun device.
    Userspace,
    /// The Linux kernel WireGuard module.
    Kernel,
    /// Kernel when the wireguard module is loaded, userspace otherwise.
    Auto,
}

fn port_range_arg(value: &str) -> Result<PortRange, String> {
    PortRange::parse(value)
}

fn node_name_arg(value: &str) -> Result<String, String> {
    trellis_api::ident::dns_label("--node-name", value).map_err(|e| e.to_string())
}

fn endpoint_address_arg(value: &str) -> Result<EndpointHost, String> {
    EndpointHost::parse("--endpoint-address", value).map_err(|e| e.to_string())
}

fn prefix_arg(value: &str) -> Result<String, String> {
    crate::names::validate_prefix(value).map(|()| value.to_owned())
}

/// The gateway of one Trellis cluster: one WireGuard interface per remote cluster behind one
/// UDP port (userspace), routes and nftables NAT, reconciled from the local broker's
/// TunnelEndpoints.
#[derive(Debug, Clone, Parser)]
#[command(name = "trellis-gateway", version, about, long_about = None)]
pub struct Config {
    #[command(flatten)]
    pub common: CommonConfig,

    /// The address remote gateways reach this gateway at (published in NetworkConfigs with
    /// each peer's port): an IP address, or a DNS name that the remote gateways resolve each
    /// time they configure the tunnel (so a gateway node whose public IP changes can be
    /// followed by updating the name). In Kubernetes, the public IP or name of the node
    /// labelled for the gateway. Required unless `--dataplane none`, where it defaults to
    /// 127.0.0.1.
    #[arg(
        long,
        env = "TRELLIS_ENDPOINT_ADDRESS",
        value_name = "IP|NAME",
        value_parser = endpoint_address_arg
    )]
    pub endpoint_address: Option<EndpointHost>,

    /// The one UDP port every remote gateway sends WireGuard packets to, with the userspace
    /// data plane (0: any free port, for tests). Kernel WireGuard cannot share a port between
    /// interfaces: with `--dataplane kernel` each peer gets its slot of `--wireguard-ports` as
    /// its own port instead.
    #[arg(
        long,
        env = "TRELLIS_WIREGUARD_PORT",
        value_name = "PORT",
        default_value_t = default_ports::WIREGUARD
    )]
    pub wireguard_port: u16,

    /// Per-peer slots (`FIRST-LAST`, inclusive): each remote peer holds one number of this
    /// range, persisted in the store and the same across restarts, which is its connection mark
    /// and routing table. With the userspace data plane nothing is bound to these numbers;
    /// with `--dataplane kernel` (and `none`) they are also the peers' UDP listen ports, one
    /// per peer. The range's size is the most peers the gateway can have.
    #[arg(
        long,
        env = "TRELLIS_WIREGUARD_PORTS",
        value_name = "FIRST-LAST",
        value_parser = port_range_arg,
        default_value_t = PortRange::default_range()
    )]
    pub wireguard_ports: PortRange,

    /// How long a port handed out by GetGatewayInfo for a peer that has no applied tunnel is
    /// kept after the last request for it, in seconds. GetGatewayInfo tells the broker, which
    /// asks again every quarter of it (at its next look at the exchange, at most a resync
    /// later) while it still works on the exchange; keep it above twice the broker's
    /// `--resync`. After that the port goes back to `--wireguard-ports` (a rejected or
    /// abandoned peering, a made-up cluster ID).
    #[arg(
        long,
        env = "TRELLIS_UNUSED_PORT_GRACE",
        value_name = "SECONDS",
        default_value_t = 600
    )]
    pub unused_port_grace: u64,

    /// How long a port freed with its peer's tunnel stays out of use at least, in seconds. A
    /// port is also its peer's connection mark and routing table: before it is handed out
    /// again, the connections the kernel tracks under its mark are flushed (`conntrack -D`),
    /// and a port nobody held is always preferred. The quarantine covers the connections the
    /// flush cannot see (the `conntrack` tool missing, packets still in flight).
    #[arg(
        long,
        env = "TRELLIS_PORT_QUARANTINE",
        value_name = "SECONDS",
        default_value_t = 120
    )]
    pub port_quarantine: u64,

    /// Opens the userspace data plane's interfaces without the kernel's offloads: one packet
    /// per read and per write, as on a kernel without them. By default each interface takes
    /// TCP (and, on Linux 6.2 and later, UDP) super-packets of up to 64 KiB from the kernel and
    /// gets coalesced ones back, which moves the same traffic with far fewer system calls; a
    /// kernel that refuses them gets the fallback anyway. For measurements and for ruling the
    /// offloads out when a flow misbehaves.
    #[arg(long, env = "TRELLIS_NO_TUN_OFFLOAD")]
    pub no_tun_offload: bool,

    /// How long, in microseconds, the userspace data plane's sending and receiving threads keep
    /// polling after their last packet before they sleep; 0 sleeps at once. On a virtual
    /// machine, waking a thread on an idle (halted) vCPU costs tens to hundreds of
    /// microseconds, and a round trip through two gateways wakes four threads: polling briefly
    /// keeps the vCPU running. The sending thread also reads the socket while it polls, so a
    /// reply arriving within the window is handled without a wake-up
    /// (`trellis_gateway_received_while_polling_total` counts those): for a lone request's
    /// reply, the window must exceed the round trip to the peer's gateway and back (500 µs, the
    /// default, covered two gateways on one virtual machine in our measurements). The price is
    /// CPU while traffic flows, never at idle, and `--busy-poll-budget-percent` caps it
    /// (`trellis_gateway_busy_poll_seconds_total` shows the time spent in polling windows).
    #[arg(
        long,
        env = "TRELLIS_BUSY_POLL_US",
        value_name = "MICROSECONDS",
        default_value_t = DEFAULT_BUSY_POLL_US,
        value_parser = clap::value_parser!(u64).range(0..=10_000)
    )]
    pub busy_poll_us: u64,

    /// The share of the time, in percent, each of the data plane's two polling threads may
    /// spend polling (`--busy-poll-us`); past it a thread sleeps at once until time has paid
    /// the share back (it may save up one second's share). Sparse request/response traffic,
    /// whose latency polling is for, needs far less than 1 % (a request every 200 ms, 0.25 %);
    /// a steady stream whose packets keep reopening the window would otherwise keep a core
    /// busy. At 5 % one connection's steady ping-pong ran 17-25 % slower than without polling
    /// in our measurements, at 1 % (the default) as fast. 100 polls without a cap; 0 never
    /// polls.
    #[arg(
        long,
        env = "TRELLIS_BUSY_POLL_BUDGET_PERCENT",
        value_name = "PERCENT",
        default_value_t = crate::dataplane::engine::BUSY_POLL_BUDGET_PERCENT,
        value_parser = clap::value_parser!(u8).range(0..=100)
    )]
    pub busy_poll_budget_percent: u8,

    /// Do not offer the stateless wire convention (ADR 0032, 0034). By default a userspace
    /// gateway offers it to every peer (its broker says so in its NetworkConfigs), and a
    /// tunnel to a peer whose gateway offers it too uses it: each side's engine translates
    /// what it sends into the other's terms, so that peer's traffic needs no connection
    /// tracking, NAT or policy routing here. With this flag, or with kernel WireGuard (which
    /// cannot rewrite what it sends), every tunnel keeps the kernels' double NAT (ADR 0008).
    #[arg(long, env = "TRELLIS_NO_STATELESS_WIRE")]
    pub no_stateless_wire: bool,

    /// Which WireGuard implementation to drive, or `none` for no data plane at all.
    #[arg(long, env = "TRELLIS_DATAPLANE", value_enum, default_value_t = DataplaneFlag::Auto)]
    pub dataplane: DataplaneFlag,

    /// Address of the local broker (`host:port`), whose TunnelEndpoints the gateway applies.
    /// Without it the gateway only serves keys, ports and status.
    #[arg(long, env = "TRELLIS_BROKER", value_name = "HOST:PORT")]
    pub broker: Option<String>,

    /// Address of the local IPAM (`host:port`). With it, the gateway follows the IPAM's
    /// external-CIDR endpoint mappings (`ListEndpointMappings`) and DNATs hub-path traffic from
    /// those external addresses to the endpoints they stand for (ADR 0008). Without it, hub-path
    /// addresses handed out by this cluster lead nowhere.
    #[arg(long, env = "TRELLIS_IPAM", value_name = "HOST:PORT")]
    pub ipam: Option<String>,

    /// How often the IPAM's endpoint mappings are read, in seconds (with `--ipam`).
    #[arg(
        long,
        env = "TRELLIS_MAPPINGS_INTERVAL",
        value_name = "SECONDS",
        default_value_t = 2
    )]
    pub mappings_interval: u64,

    /// Prefix of the WireGuard interface names (1-7 characters of a-z, 0-9, '-'); the rest is
    /// a hash of the (local, remote) cluster pair, so names are unique on the host.
    #[arg(
        long,
        env = "TRELLIS_INTERFACE_PREFIX",
        value_name = "PREFIX",
        value_parser = prefix_arg,
        default_value = "tg"
    )]
    pub interface_prefix: String,

    /// WireGuard persistent keepalive towards every peer, in seconds (0 = off). Keeps NAT
    /// mappings open and makes a restarted peer re-handshake promptly.
    #[arg(
        long,
        env = "TRELLIS_PERSISTENT_KEEPALIVE",
        value_name = "SECONDS",
        default_value_t = 25
    )]
    pub persistent_keepalive: u16,

    /// Do not relay: a hub relays the WireGuard datagrams of two of its full peers (leaves it
    /// introduced to each other) that cannot reach each other directly, as behind two NATs
    /// that each pick a new port per destination (ADR 0025). It forwards encrypted datagrams
    /// and can read none of them. With this flag it forwards nothing, and such pairs stay
    /// unreachable.
    #[arg(long, env = "TRELLIS_NO_RELAY")]
    pub no_relay: bool,

    /// Datagrams a second that one pair of leaves may send through this gateway's relay
    /// (bursts of a tenth of that); more are dropped and counted
    /// (`trellis_gateway_dropped_datagrams_total{reason="relay_rate_limited"}`), without
    /// touching other pairs.
    #[arg(
        long,
        env = "TRELLIS_RELAY_RATE",
        value_name = "DATAGRAMS",
        default_value_t = 20_000,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub relay_rate: u32,

    /// Name of the node this gateway runs on (in Kubernetes, the downward API's
    /// `spec.nodeName`), announced to the route agents (`WatchRoutes`) so every node knows
    /// where the gateway is. Defaults to the host name.
    #[arg(long, env = "TRELLIS_NODE_NAME", value_name = "NAME", value_parser = node_name_arg)]
    pub node_name: Option<String>,

    /// This node's address on the cluster's node network (in Kubernetes, `status.hostIP`): where
    /// the route agents of the other nodes send their overlay (VXLAN) traffic. Without it, no
    /// route agent can reach this gateway, and only pods wired to the gateway's own network
    /// namespace reach remote clusters.
    #[arg(long, env = "TRELLIS_NODE_IP", value_name = "IP")]
    pub node_ip: Option<IpAddr>,

    /// MTU of the network the WireGuard packets leave by (the interface towards the remote
    /// gateways), in bytes, 1280-9000. Every tunnel device gets this minus 80 (WireGuard's
    /// worst case, over IPv6): 1420 on a 1500-byte network. The route agents learn the tunnel
    /// MTU from `WatchRoutes` and route remote prefixes with the smaller of it and their
    /// overlay's MTU.
    #[arg(
        long,
        env = "TRELLIS_UNDERLAY_MTU",
        value_name = "BYTES",
        value_parser = underlay_mtu_arg,
        default_value_t = 1500
    )]
    pub underlay_mtu: u32,

    /// How often the data plane is re-checked against the desired state even without changes
    /// (repairs interfaces or rules someone removed), in seconds.
    #[arg(
        long,
        env = "TRELLIS_RESYNC_INTERVAL",
        value_name = "SECONDS",
        default_value_t = 30
    )]
    pub resync_interval: u64,

    /// This gateway's name among the cluster's gateway replicas (a DNS label, unique per
    /// replica; defaults to `--node-name`). Replicas are gateways of one cluster sharing one
    /// store: one is active, the others are warm standbys that take over when it goes silent
    /// (ADR 0023). A gateway alone is simply always the active.
    #[arg(long, env = "TRELLIS_REPLICA_ID", value_name = "NAME", value_parser = node_name_arg)]
    pub replica_id: Option<String>,

    /// Where this replica receives the other replicas' heartbeats (UDP, `IP:PORT`). Its
    /// address is registered in the store, where the others find it: with a wildcard IP, the
    /// node's `--node-ip` is registered. Port 0 takes any free port (Kubernetes manifests fix
    /// 7116 so a network policy can name it).
    #[arg(
        long,
        env = "TRELLIS_HEARTBEAT_LISTEN",
        value_name = "IP:PORT",
        default_value = "0.0.0.0:0"
    )]
    pub heartbeat_listen: SocketAddr,

    /// How often each replica sends its heartbeat to every other, in milliseconds (10-10000).
    #[arg(
        long,
        env = "TRELLIS_HEARTBEAT_INTERVAL",
        value_name = "MS",
        default_value_t = 100,
        value_parser = clap::value_parser!(u64).range(10..=10_000)
    )]
    pub heartbeat_interval: u64,

    /// How long the active replica may be silent before a standby takes over, in
    /// milliseconds; at least twice `--heartbeat-interval`. Also how long a starting replica
    /// listens for an active before it may claim the role itself.
    #[arg(
        long,
        env = "TRELLIS_FAILOVER_AFTER",
        value_name = "MS",
        default_value_t = 300,
        value_parser = clap::value_parser!(u64).range(20..=60_000)
    )]
    pub failover_after: u64,

    /// How often the active replica tells the standbys which connections the peers opened
    /// through it, in milliseconds (0: never). A standby enters them in its connection
    /// tracking, translation included, so that after a takeover those connections continue
    /// whichever side sends first (without it, our pod answering first gets the connection
    /// reset). A connection younger than one interval when the active dies is not handed off.
    /// Needs the `conntrack` tool; only with a data plane (not `--dataplane none`).
    #[arg(
        long,
        env = "TRELLIS_HANDOFF_INTERVAL",
        value_name = "MS",
        default_value_t = 1000,
        value_parser = clap::value_parser!(u64).range(0..=60_000)
    )]
    pub handoff_interval: u64,
}

impl Config {
    /// `--replica-id`, or the node name.
    pub fn replica_id(&self) -> anyhow::Result<String> {
        match &self.replica_id {
            Some(id) => Ok(id.clone()),
            None => self.node_name(),
        }
    }

    /// `--node-name`, or the host name.
    pub fn node_name(&self) -> anyhow::Result<String> {
        if let Some(name) = &self.node_name {
            return Ok(name.clone());
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_ascii_lowercase())
            .unwrap_or_default();
        trellis_api::ident::dns_label("--node-name", &host).map_err(|_| {
            anyhow::anyhow!(
                "the host name {host:?} is not a DNS label; set --node-name (TRELLIS_NODE_NAME)"
            )
        })
    }
}

impl HasCommon for Config {
    fn common(&self) -> &CommonConfig {
        &self.common
    }
}

impl Config {
    /// The endpoint address, checked against the data plane choice.
    pub fn endpoint_host(&self) -> anyhow::Result<EndpointHost> {
        match (&self.endpoint_address, self.dataplane) {
            (Some(host), _) => Ok(host.clone()),
            (None, DataplaneFlag::None) => Ok(EndpointHost::Ip(IpAddr::V4(Ipv4Addr::LOCALHOST))),
            (None, _) => anyhow::bail!(
                "--endpoint-address is required with a data plane (the address remote gateways \
                 send WireGuard packets to)"
            ),
        }
    }

    /// The MTU of every tunnel device: the underlay's minus WireGuard's overhead.
    pub fn tunnel_mtu(&self) -> u32 {
        crate::dataplane::wireguard::tunnel_mtu(self.underlay_mtu)
    }

    /// The resync period.
    pub fn resync(&self) -> Duration {
        Duration::from_secs(self.resync_interval.max(1))
    }

    /// The grace period of ports without a tunnel (at least one second).
    pub fn unused_port_grace(&self) -> Duration {
        Duration::from_secs(self.unused_port_grace.max(1))
    }

    /// The quarantine of a port freed with its tunnel.
    pub fn port_quarantine(&self) -> Duration {
        Duration::from_secs(self.port_quarantine)
    }

    /// The endpoint-mapping poll period.
    pub fn mappings_period(&self) -> Duration {
        Duration::from_secs(self.mappings_interval.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_runtime::config::ports;

    fn parse(extra: &[&str]) -> Result<Config, clap::Error> {
        let mut args = vec![
            "trellis-gateway",
            "--store",
            "memory://",
            "--cluster-id",
            "a",
        ];
        args.extend_from_slice(extra);
        Config::try_parse_from(args)
    }

    #[test]
    fn defaults() {
        let c = parse(&["--dataplane", "none"]).expect("parses");
        assert_eq!(c.wireguard_ports, PortRange::default_range());
        assert_eq!(c.wireguard_ports.first(), ports::WIREGUARD);
        assert_eq!(c.wireguard_port, ports::WIREGUARD);
        assert_eq!(c.interface_prefix, "tg");
        assert_eq!(
            c.endpoint_host().expect("defaulted"),
            EndpointHost::Ip(IpAddr::V4(Ipv4Addr::LOCALHOST))
        );
        assert_eq!((c.underlay_mtu, c.tunnel_mtu()), (1500, 1420));
    }

    #[test]
    fn the_tunnel_mtu_follows_the_underlay() {
        let c = parse(&["--underlay-mtu", "9000"]).expect("parses");
        assert_eq!(c.tunnel_mtu(), 8920);
        let c = parse(&["--underlay-mtu", "1280"]).expect("parses");
        assert_eq!(c.tunnel_mtu(), 1200);
        for bad in ["1279", "9001", "0", "big", ""] {
            let err = parse(&["--underlay-mtu", bad]).expect_err(bad).to_string();
            assert!(err.contains("--underlay-mtu"), "{err}");
            assert!(err.contains("between 1280 and 9000"), "{err}");
        }
    }

    #[test]
    fn the_endpoint_address_is_an_ip_or_a_dns_name() {
        let c = parse(&["--endpoint-address", "192.0.2.1"]).expect("ip");
        assert_eq!(
            c.endpoint_host().expect("set"),
            EndpointHost::Ip("192.0.2.1".parse().expect("ip"))
        );
        let c = parse(&["--endpoint-address", "GW.Hub.Example."]).expect("name");
        assert_eq!(
            c.endpoint_host().expect("set"),
            EndpointHost::Name("gw.hub.example".into())
        );
        for bad in [
            "",
            "0.0.0.0",
            "192.0.2.1:51840",
            "gw_hub.example",
            "gw..example",
            "-gw.example",
            "10.0.0.256",
            "http://gw.example",
        ] {
            let arg = format!("--endpoint-address={bad}");
            let err = parse(&[&arg]).expect_err(bad).to_string();
            assert!(err.contains("--endpoint-address"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn endpoint_address_is_required_with_a_data_plane() {
        let c = parse(&["--dataplane", "userspace"]).expect("parses");
        let err = c.endpoint_host().expect_err("required");
        assert!(err.to_string().contains("--endpoint-address"), "{err}");
    }

    #[test]
    fn bad_ranges_and_prefixes_are_refused() {
        for bad in ["51840", "52000-51840", "0-10", "a-b"] {
            assert!(parse(&["--wireguard-ports", bad]).is_err(), "{bad}");
        }
        for bad in ["", "toolongpf", "UP", "a b"] {
            assert!(parse(&["--interface-prefix", bad]).is_err(), "{bad:?}");
        }
        let c = parse(&["--wireguard-ports", "40000-40009"]).expect("parses");
        assert_eq!(c.wireguard_ports.len(), 10);
    }

    #[test]
    fn replica_flags_default_to_a_fast_failover_and_refuse_bad_values_naming_the_flag() {
        let c = parse(&["--dataplane", "none", "--node-name", "gw-1"]).expect("parses");
        assert_eq!(c.replica_id().expect("defaulted"), "gw-1", "the node name");
        assert_eq!((c.heartbeat_interval, c.failover_after), (100, 300));
        assert_eq!(c.heartbeat_listen, "0.0.0.0:0".parse().expect("addr"));
        assert_eq!(c.handoff_interval, 1000);
        for (flag, bad) in [
            ("--replica-id", "Gw_1"),
            ("--heartbeat-listen", "7116"),
            ("--heartbeat-interval", "5"),
            ("--heartbeat-interval", "10001"),
            ("--failover-after", "10"),
            ("--failover-after", "soon"),
            ("--handoff-interval", "60001"),
            ("--handoff-interval", "often"),
        ] {
            let err = parse(&[flag, bad]).expect_err(&format!("{flag} {bad} is refused"));
            assert!(err.to_string().contains(flag), "{flag} {bad}: {err}");
        }
    }
}
