//! NAT routers in front of a site's gateway: what a leaf behind a home router, a cloud NAT
//! gateway or a carrier-grade NAT looks like from the rest of the fabric.
//!
//! Only the gateway's WireGuard datagrams cross the router; its TCP control plane (the six
//! services on the uplink address) stays reachable as before, as it would be through a
//! load balancer or a port forward. A router namespace `tl<run>-<site>-nat` sits between the
//! gateway namespace and the internet bridge:
//!
//! ```text
//!   gateway ns                              router ns                        internet ns
//!  [wan 192.0.2.N]  ------------------------------------------------------- [p<i>   ┐
//!  [natlink 198.18.N.2] --veth-- [lan 198.18.N.1 | wan 198.51.100.N] --veth-- [q<i> ┘ br0
//! ```
//!
//! In the gateway namespace a policy rule sends what the local WireGuard port sends (`iif lo
//! ipproto udp sport <port>`) through the router, from the private address `198.18.N.2`, which
//! is what the gateway advertises and what nobody else can route to. The router translates
//! it to its public address `198.51.100.N` as its [`NatKind`] says (RFC 4787 terms):
//!
//! | kind | mapping | filtering of what comes back |
//! |---|---|---|
//! | `none` | no router: the gateway sends from its uplink address | none |
//! | `one-to-one` | static 1:1, ports kept | endpoint-independent (everything passes) |
//! | `easy` | endpoint-independent: one public port for every destination | address-dependent: from addresses the gateway sent to |
//! | `hard` | endpoint-dependent: a new random port per destination | address-and-port-dependent: replies only |
//!
//! `easy` filters on the address, not the port (a "restricted cone"): with Linux's own
//! masquerade, which also filters on the port, no peer can learn the port a `hard` NAT picks
//! for it, and such a pair needs a relay. [`NatRouter::probe`] lets a test show a router
//! behaves as named before anything relies on it.

use std::net::{Ipv4Addr, SocketAddr};
use std::str::FromStr;

use anyhow::{Context as _, bail};

use crate::netns::{exec, ip, nft_apply};
use crate::topology::{BRIDGE, Site, Topology, UPLINK};

/// The router's nftables table.
const TABLE: &str = "netlab-nat";
/// The gateway namespace's interface towards its router.
pub const NAT_LINK: &str = "natlink";
/// The routing table the gateway's WireGuard datagrams take.
const NAT_TABLE: &str = "200";
/// The policy rule's priority: before the main table and the gateway's own rules.
const RULE_PRIORITY: &str = "90";
/// The public port an `easy` router maps the gateway to (plus the site index).
const EASY_PORT_BASE: u16 = 40000;
/// The range a `hard` router picks a random port from, per destination.
const HARD_PORTS: &str = "20000-39999";
/// How long an `easy` router lets an address it sent to send back.
const EASY_FILTER_TIMEOUT: &str = "120s";

/// How a router translates and filters (see the module table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NatKind {
    None,
    OneToOne,
    Easy,
    Hard,
}

impl NatKind {
    pub const ALL: [Self; 4] = [Self::None, Self::OneToOne, Self::Easy, Self::Hard];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::OneToOne => "one-to-one",
            Self::Easy => "easy",
            Self::Hard => "hard",
        }
    }
}

impl std::fmt::Display for NatKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for NatKind {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .with_context(|| format!("NAT kind {s:?}: one of none, one-to-one, easy, hard"))
    }
}

/// The network every router's public address is in (TEST-NET-2), on the same bridge as the
/// sites' uplinks.
pub const PUBLIC_NET: &str = "198.51.100.0/24";

/// A site's router, or the site's own uplink for [`NatKind::None`].
#[derive(Debug, Clone)]
pub struct NatRouter {
    pub kind: NatKind,
    /// The site behind it.
    pub site: usize,
    /// The router's namespace (`None` for [`NatKind::None`]).
    pub ns: Option<String>,
    /// What the gateway sends from and advertises: its private address behind a router, its
    /// uplink address without one.
    pub private_ip: Ipv4Addr,
    /// The router's public address (the uplink address for [`NatKind::None`]).
    pub public_ip: Ipv4Addr,
    /// The WireGuard port whose datagrams take the router.
    pub port: u16,
}

/// What a router did to one socket's datagrams ([`NatRouter::probe`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Behaviour {
    /// Where the first server saw the socket.
    pub mapped_first: SocketAddr,
    /// Where a second server, at another address, saw it.
    pub mapped_second: SocketAddr,
    /// Whether the first server's address, from a port the socket never sent to, got through.
    pub same_address_other_port: bool,
    /// Whether an address the socket never sent to got through.
    pub other_address: bool,
}

impl Behaviour {
    /// Whether every destination sees the same mapping.
    pub fn endpoint_independent_mapping(&self) -> bool {
        self.mapped_first == self.mapped_second
    }
}

impl Topology {
    /// Puts site `index`'s WireGuard port `port` behind a router of `kind`; every site (and
    /// every router) learns the public network on the bridge. Call once per site, before the
    /// site's gateway starts (it must advertise [`NatRouter::private_ip`]).
    pub fn add_nat(&mut self, index: usize, kind: NatKind, port: u16) -> anyhow::Result<NatRouter> {
        let site = self
            .sites
            .get(index)
            .with_context(|| format!("no site {index}"))?
            .clone();
        let n = u8::try_from(index + 1).context("NAT routers exist for sites 0 to 254 only")?;
        let public_ip = Ipv4Addr::new(198, 51, 100, n);
        // Every gateway reaches the routers' public addresses on the bridge itself.
        let reach = ip(&["-n", &site.gw_ns, "route", "show", PUBLIC_NET])?;
        if reach.trim().is_empty() {
            ip(&["-n", &site.gw_ns, "route", "add", PUBLIC_NET, "dev", UPLINK])?;
        }
        if kind == NatKind::None {
            return Ok(NatRouter {
                kind,
                site: index,
                ns: None,
                private_ip: site.uplink_ip,
                public_ip: site.uplink_ip,
                port,
            });
        }
        let private_ip = Ipv4Addr::new(198, 18, n, 2);
        let lan_ip = Ipv4Addr::new(198, 18, n, 1);
        let router = format!("tl{}-{}-nat", self.run, site.name);
        self.namespaces_mut().add(&router)?;
        wire_router(
            &self.inet_ns,
            &site,
            &router,
            lan_ip,
            private_ip,
            public_ip,
            port,
        )?;
        let rules = ruleset(kind, &site, private_ip, public_ip, port);
        nft_apply(&router, &rules)
            .with_context(|| format!("the {kind} router of {}", site.name))?;
        Ok(NatRouter {
            kind,
            site: index,
            ns: Some(router),
            private_ip,
            public_ip,
            port,
        })
    }
}

/// Every link, address, route and sysctl of one router.
fn wire_router(
    inet_ns: &str,
    site: &Site,
    router: &str,
    lan_ip: Ipv4Addr,
    private_ip: Ipv4Addr,
    public_ip: Ipv4Addr,
    port: u16,
) -> anyhow::Result<()> {
    let gw = site.gw_ns.as_str();
    let bridge_port = format!("q{}", site.index);
    let (lan, private, public) = (
        format!("{lan_ip}/24"),
        format!("{private_ip}/24"),
        format!("{public_ip}/24"),
    );
    let (lan_text, private_text, port_text) =
        (lan_ip.to_string(), private_ip.to_string(), port.to_string());
    let uplink_net = format!("{}/24", Ipv4Addr::from(u32::from(site.uplink_ip) & !0xff));
    for args in [
        vec![
            "-n",
            router,
            "link",
            "add",
            UPLINK,
            "type",
            "veth",
            "peer",
            "name",
            &bridge_port,
            "netns",
            inet_ns,
        ],
        vec![
            "-n",
            inet_ns,
            "link",
            "set",
            &bridge_port,
            "master",
            BRIDGE,
            "up",
        ],
        vec!["-n", router, "addr", "add", &public, "dev", UPLINK],
        vec!["-n", router, "link", "set", UPLINK, "up"],
        // The sites' uplinks are on the same bridge: on-link.
        vec!["-n", router, "route", "add", &uplink_net, "dev", UPLINK],
        vec![
            "-n", router, "link", "add", "lan", "type", "veth", "peer", "name", NAT_LINK, "netns",
            gw,
        ],
        vec!["-n", router, "addr", "add", &lan, "dev", "lan"],
        vec!["-n", router, "link", "set", "lan", "up"],
        vec!["-n", gw, "addr", "add", &private, "dev", NAT_LINK],
        vec!["-n", gw, "link", "set", NAT_LINK, "up"],
        vec![
            "-n",
            gw,
            "route",
            "add",
            "default",
            "via",
            &lan_text,
            "dev",
            NAT_LINK,
            "src",
            &private_text,
            "table",
            NAT_TABLE,
        ],
        vec![
            "-n",
            gw,
            "rule",
            "add",
            "priority",
            RULE_PRIORITY,
            "iif",
            "lo",
            "ipproto",
            "udp",
            "sport",
            &port_text,
            "lookup",
            NAT_TABLE,
        ],
    ] {
        ip(&args).with_context(|| format!("wiring the router of {}", site.name))?;
    }
    for (ns, key) in [
        (router, "net.ipv4.ip_forward=1"),
        // Replies to the private address arrive on the router link, not the uplink the main
        // table would choose for their source.
        (gw, "net.ipv4.conf.all.rp_filter=0"),
        (gw, &format!("net.ipv4.conf.{NAT_LINK}.rp_filter=0")),
    ] {
        let out = exec(ns, "sysctl", &["-qw", key])?;
        if !out.status.success() {
            bail!(
                "sysctl {key} in {ns}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
    Ok(())
}

/// The router's nftables ruleset for `kind`.
fn ruleset(
    kind: NatKind,
    site: &Site,
    private_ip: Ipv4Addr,
    public_ip: Ipv4Addr,
    port: u16,
) -> String {
    let easy_port = EASY_PORT_BASE + site.index as u16;
    // What comes in from the internet gets forwarded only as the kind's filter allows;
    // nothing is answered (a real NAT drops silently).
    let (translate, inbound, forward) = match kind {
        NatKind::None => (String::new(), String::new(), String::new()),
        NatKind::OneToOne => (
            format!("oif \"{UPLINK}\" ip saddr {private_ip} snat to {public_ip}"),
            format!("iif \"{UPLINK}\" ip daddr {public_ip} dnat to {private_ip}"),
            String::new(),
        ),
        NatKind::Easy => (
            format!(
                "oif \"{UPLINK}\" ip saddr {private_ip} udp sport {port} snat to {public_ip}:{easy_port}"
            ),
            format!(
                "iif \"{UPLINK}\" ip daddr {public_ip} udp dport {easy_port} ip saddr @contacted dnat to {private_ip}:{port}"
            ),
            format!("iif \"lan\" oif \"{UPLINK}\" update @contacted {{ ip daddr }}"),
        ),
        NatKind::Hard => (
            format!(
                "oif \"{UPLINK}\" ip saddr {private_ip} meta l4proto udp snat to {public_ip}:{HARD_PORTS} fully-random"
            ),
            String::new(),
            String::new(),
        ),
    };
    format!(
        "table ip {TABLE} {{
  set contacted {{ type ipv4_addr; flags timeout; timeout {EASY_FILTER_TIMEOUT}; }}
  chain prerouted {{ type nat hook prerouting priority dstnat; {inbound}; }}
  chain postrouted {{ type nat hook postrouting priority srcnat; {translate}; }}
  chain forwarded {{
    type filter hook forward priority filter; policy drop;
    {forward}
    iif \"lan\" accept
    ct state established,related accept
    ct status dnat accept
  }}
  chain inbound {{ type filter hook input priority filter; iif \"{UPLINK}\" meta l4proto udp drop; }}
}}
"
    )
}

/// The table [`NatRouter::cut`] adds.
const CUT_TABLE: &str = "netlab-cut";

impl NatRouter {
    /// Silently drops every UDP datagram between this router's site and `other` (a public
    /// address) in both directions, until [`NatRouter::mend`]: a direct path between two
    /// leaves that dies while both still reach the hub.
    pub fn cut(&self, other: Ipv4Addr) -> anyhow::Result<()> {
        let ns = self
            .ns
            .as_deref()
            .context("a site without a router has nothing to cut")?;
        nft_apply(
            ns,
            &format!(
                "table ip {CUT_TABLE} {{
  chain forwarded {{
    type filter hook forward priority filter - 10;
    ip saddr {other} meta l4proto udp drop
    ip daddr {other} meta l4proto udp drop
  }}
}}
"
            ),
        )
    }

    /// Removes what [`NatRouter::cut`] added.
    pub fn mend(&self) -> anyhow::Result<()> {
        let ns = self
            .ns
            .as_deref()
            .context("a site without a router has nothing to mend")?;
        let out = exec(ns, "nft", &["delete", "table", "ip", CUT_TABLE])?;
        if !out.status.success() {
            bail!(
                "mending the cut in {ns}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// Shows what the router does: a socket on the WireGuard port in the gateway namespace
    /// sends to `first` and `second` (UDP sockets at two other addresses, each answering with
    /// where it saw the sender); then `first`'s address from `first_other_port`, and
    /// `stranger` (an address the socket never sent to), each send to the mapping `first` saw.
    pub async fn probe(
        &self,
        site: &Site,
        first: (&str, SocketAddr),
        first_other_port: u16,
        second: (&str, SocketAddr),
        stranger: (&str, SocketAddr),
    ) -> anyhow::Result<Behaviour> {
        use crate::netns::udp_in;
        use std::time::Duration;
        let client = udp_in(
            &site.gw_ns,
            SocketAddr::from((Ipv4Addr::UNSPECIFIED, self.port)),
        )?;
        let seen = |ns: &str, at: SocketAddr| -> anyhow::Result<tokio::net::UdpSocket> {
            udp_in(ns, at).with_context(|| format!("binding {at} in {ns}"))
        };
        let first_socket = seen(first.0, first.1)?;
        let second_socket = seen(second.0, second.1)?;
        let other_port = seen(first.0, SocketAddr::new(first.1.ip(), first_other_port))?;
        let stranger_socket = seen(stranger.0, stranger.1)?;
        let mut buf = [0u8; 64];
        let mut mapped = Vec::new();
        for (socket, at) in [(&first_socket, first.1), (&second_socket, second.1)] {
            client.send_to(b"where am i", at).await?;
            let (_, from) =
                tokio::time::timeout(Duration::from_secs(2), socket.recv_from(&mut buf))
                    .await
                    .with_context(|| format!("{at} heard nothing from the gateway's port"))??;
            mapped.push(from);
        }
        let mut passes = Vec::new();
        for socket in [&other_port, &stranger_socket] {
            socket.send_to(b"unsolicited", mapped[0]).await?;
            passes.push(
                tokio::time::timeout(Duration::from_millis(500), client.recv_from(&mut buf))
                    .await
                    .is_ok(),
            );
        }
        Ok(Behaviour {
            mapped_first: mapped[0],
            mapped_second: mapped[1],
            same_address_other_port: passes[0],
            other_address: passes[1],
        })
    }
}
