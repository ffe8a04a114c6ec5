//! Address arithmetic on validated networks: families, host-bit translation between two
//! networks of the same size, and the integer view used by allocators.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// The ranges a peer's networks (its pod and external CIDRs, and how it addresses ours) must
/// lie in: they are routed into that peer's tunnel, so a peer advertising a public range,
/// loopback or half the address space would capture our traffic to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedRanges(Vec<IpNet>);

impl AllowedRanges {
    /// Private (RFC 1918, RFC 4193) and shared (RFC 6598) address space.
    pub const DEFAULT: &'static str =
        "10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,100.64.0.0/10,fc00::/7";

    /// A comma-separated list of CIDRs (host bits must be zero).
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let mut nets = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let net: IpNet = part
                .parse()
                .map_err(|_| format!("{part:?} is not a CIDR (like 10.0.0.0/8)"))?;
            if net.trunc() != net {
                return Err(format!(
                    "{part:?} has host bits set; did you mean {}?",
                    net.trunc()
                ));
            }
            nets.push(net);
        }
        if nets.is_empty() {
            return Err("at least one CIDR is needed".into());
        }
        Ok(Self(nets))
    }

    /// Whether `net` lies entirely within one of the ranges.
    pub fn contains(&self, net: IpNet) -> bool {
        self.0.iter().any(|r| r.contains(&net))
    }

    /// `InvalidArgument` on `field` unless `net` lies within the ranges.
    pub fn check(&self, field: &str, net: IpNet) -> trellis_error::Result<()> {
        if self.contains(net) {
            return Ok(());
        }
        Err(trellis_error::Error::invalid(
            field,
            format!("{net} is outside the ranges peers may use ({self}; --allowed-remote-cidrs)"),
        ))
    }
}

impl Default for AllowedRanges {
    fn default() -> Self {
        Self::parse(Self::DEFAULT).unwrap_or_else(|_| Self(Vec::new()))
    }
}

impl fmt::Display for AllowedRanges {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&list.join(","))
    }
}

/// An address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    /// The family of an address.
    pub fn of_ip(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Self::V4,
            IpAddr::V6(_) => Self::V6,
        }
    }

    /// The family of a network.
    pub fn of_net(net: IpNet) -> Self {
        Self::of_ip(net.addr())
    }

    /// Address width in bits.
    pub fn bits(self) -> u8 {
        match self {
            Self::V4 => 32,
            Self::V6 => 128,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        })
    }
}

/// An address as an unsigned integer (IPv4 in the low 32 bits).
pub fn ip_to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

/// The inverse of [`ip_to_u128`]; `None` when the value does not fit the family.
pub fn u128_to_ip(family: Family, value: u128) -> Option<IpAddr> {
    match family {
        Family::V4 => u32::try_from(value)
            .ok()
            .map(|v| IpAddr::V4(Ipv4Addr::from(v))),
        Family::V6 => Some(IpAddr::V6(Ipv6Addr::from(value))),
    }
}

/// The network of `family` starting at integer `start` with `prefix_len`; `None` when out of
/// range.
pub fn net_from_u128(family: Family, start: u128, prefix_len: u8) -> Option<IpNet> {
    match u128_to_ip(family, start)? {
        IpAddr::V4(a) => Ipv4Net::new(a, prefix_len).ok().map(IpNet::V4),
        IpAddr::V6(a) => Ipv6Net::new(a, prefix_len).ok().map(IpNet::V6),
    }
}

/// First and last address of a network as integers (inclusive).
pub fn net_bounds(net: IpNet) -> (u128, u128) {
    (ip_to_u128(net.network()), ip_to_u128(net.broadcast()))
}

/// Whether two networks share at least one address.
pub fn overlaps(a: IpNet, b: IpNet) -> bool {
    if Family::of_net(a) != Family::of_net(b) {
        return false;
    }
    let (a0, a1) = net_bounds(a);
    let (b0, b1) = net_bounds(b);
    a0 <= b1 && b0 <= a1
}

/// The networks of a node's own addresses, from `ip -j addr show`: `(interface, network)` for
/// every address except host-scoped ones (loopback), host bits cleared. These are the node's
/// connected networks (its node network, bridges, overlays): a route that overlaps one takes
/// the node's own traffic away from it (`ip route replace` of the same prefix even replaces the
/// connected route), so the data plane refuses to route a peer's range into any of them.
pub fn address_networks(ip_json: &str) -> Result<Vec<(String, IpNet)>, String> {
    let links: serde_json::Value =
        serde_json::from_str(ip_json).map_err(|e| format!("parsing `ip -j addr show`: {e}"))?;
    let mut out = Vec::new();
    for link in links.as_array().into_iter().flatten() {
        let name = link["ifname"].as_str().unwrap_or_default();
        for addr in link["addr_info"].as_array().into_iter().flatten() {
            if addr["scope"].as_str() == Some("host") {
                continue;
            }
            let ip = addr["local"]
                .as_str()
                .and_then(|a| a.parse::<IpAddr>().ok());
            let len = addr["prefixlen"]
                .as_u64()
                .and_then(|l| u8::try_from(l).ok());
            if let (Some(ip), Some(len)) = (ip, len)
                && let Ok(net) = IpNet::new(ip, len)
            {
                out.push((name.to_owned(), net.trunc()));
            }
        }
    }
    Ok(out)
}

/// Moves `ip` from network `from` to the same host bits in `to`. `None` when `ip` is not in
/// `from`, or the two networks differ in family or prefix length.
pub fn translate(ip: IpAddr, from: IpNet, to: IpNet) -> Option<IpAddr> {
    if from.prefix_len() != to.prefix_len()
        || Family::of_net(from) != Family::of_net(to)
        || !from.contains(&ip)
    {
        return None;
    }
    let host_mask = ip_to_u128(from.hostmask());
    let host = ip_to_u128(ip) & host_mask;
    u128_to_ip(Family::of_net(to), ip_to_u128(to.network()) | host)
}

#[cfg(test)]
mod tests {
    #[test]
    fn address_networks_are_the_nodes_connected_networks_without_loopback() {
        let json = r#"[
          {"ifname":"lo","addr_info":[{"family":"inet","local":"127.0.0.1","prefixlen":8,"scope":"host"}]},
          {"ifname":"node","addr_info":[
            {"family":"inet","local":"10.9.0.2","prefixlen":16,"scope":"global"},
            {"family":"inet6","local":"fe80::1","prefixlen":64,"scope":"link"}]},
          {"ifname":"trellis-vx","addr_info":[{"family":"inet","local":"240.9.0.2","prefixlen":8,"scope":"global"}]},
          {"ifname":"down","addr_info":[]}
        ]"#;
        let found: Vec<(String, String)> = super::address_networks(json)
            .expect("parses")
            .into_iter()
            .map(|(i, n)| (i, n.to_string()))
            .collect();
        let want: Vec<(String, String)> = [
            ("node", "10.9.0.0/16"),
            ("node", "fe80::/64"),
            ("trellis-vx", "240.0.0.0/8"),
        ]
        .iter()
        .map(|(i, n)| ((*i).to_owned(), (*n).to_owned()))
        .collect();
        assert_eq!(found, want);
        assert!(super::address_networks("not json").is_err());
    }

    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().expect("test network")
    }
    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test ip")
    }

    #[test]
    fn translate_keeps_host_bits() {
        // C remapped A's 10.1.0.0/24 to 10.3.3.0/24; 10.1.0.18 -> 10.3.3.18.
        assert_eq!(
            translate(ip("10.1.0.18"), net("10.1.0.0/24"), net("10.3.3.0/24")),
            Some(ip("10.3.3.18"))
        );
        assert_eq!(
            translate(ip("fd00::1:2"), net("fd00::/64"), net("fd01::/64")),
            Some(ip("fd01::1:2"))
        );
    }

    #[test]
    fn translate_refuses_mismatches() {
        assert_eq!(
            translate(ip("10.2.0.1"), net("10.1.0.0/24"), net("10.3.3.0/24")),
            None
        );
        assert_eq!(
            translate(ip("10.1.0.1"), net("10.1.0.0/24"), net("10.3.0.0/16")),
            None
        );
        assert_eq!(
            translate(ip("10.1.0.1"), net("10.1.0.0/24"), net("fd00::/120")),
            None
        );
    }

    #[test]
    fn overlap_is_symmetric_and_family_aware() {
        assert!(overlaps(net("10.0.0.0/8"), net("10.1.0.0/16")));
        assert!(overlaps(net("10.1.0.0/16"), net("10.0.0.0/8")));
        assert!(!overlaps(net("10.0.0.0/16"), net("10.1.0.0/16")));
        assert!(!overlaps(net("0.0.0.0/0"), net("::/0")));
    }

    #[test]
    fn integer_view_round_trips() {
        let n = net("192.168.4.0/22");
        let (lo, hi) = net_bounds(n);
        assert_eq!(hi - lo + 1, 1024);
        assert_eq!(net_from_u128(Family::V4, lo, 22), Some(n));
        assert_eq!(u128_to_ip(Family::V4, u128::from(u32::MAX) + 1), None);
    }
}

#[cfg(test)]
mod allowed_tests {
    use super::*;

    #[test]
    fn the_default_holds_private_and_shared_space_only() {
        let allowed = AllowedRanges::default();
        for ok in [
            "10.0.0.0/16",
            "172.20.0.0/16",
            "192.168.1.0/24",
            "100.64.3.0/24",
            "fd00::/64",
        ] {
            assert!(allowed.contains(ok.parse().expect("net")), "{ok}");
        }
        for bad in [
            "8.8.8.0/24",
            "127.0.0.0/8",
            "0.0.0.0/1",
            "10.0.0.0/7",
            "2001:db8::/32",
        ] {
            assert!(!allowed.contains(bad.parse().expect("net")), "{bad}");
        }
        let err = allowed
            .check("spec.pod_cidr", "8.8.8.0/24".parse().expect("net"))
            .expect_err("public");
        assert!(err.to_string().contains("spec.pod_cidr"), "{err}");
    }

    #[test]
    fn a_list_parses_or_says_why_not() {
        assert_eq!(
            AllowedRanges::parse("10.0.0.0/8, 198.18.0.0/15")
                .expect("list")
                .to_string(),
            "10.0.0.0/8,198.18.0.0/15"
        );
        assert!(
            AllowedRanges::parse("10.0.0.1/8")
                .expect_err("host bits")
                .contains("10.0.0.0/8")
        );
        assert!(AllowedRanges::parse("ten").is_err());
        assert!(AllowedRanges::parse("").is_err());
    }
}
