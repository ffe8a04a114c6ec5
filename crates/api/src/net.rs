//! Address arithmetic on validated networks: families, host-bit translation between two
//! networks of the same size, and the integer view used by allocators.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

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
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().expect("test network")
    }
    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test ip")
    }

    #[test]
    fn translate_keeps_host_bits() {
        // thesis §6.3: C remapped A's 10.1.0.0/24 to 10.3.3.0/24; 10.1.0.18 -> 10.3.3.18.
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
