//! The one nftables table the gateway owns, `ip trellis`, rendered as a single `nft -f` script
//! that deletes and recreates it in one transaction: the ruleset is never half-applied, and
//! applying it twice (or after a crash) never duplicates a rule.
//!
//! Per peer interface (ADR 0008):
//! - `pre_raw` and `out_raw` (before conntrack): every connection with the peer lives in the
//!   peer's own conntrack zone (its slot). Peers with the same real pod CIDR often address us
//!   alike too (every IPAM takes the first free range), so two peers' pods at one address send
//!   identical tuples, and a peer's tuple may even equal the reply tuple of another peer's
//!   connection (its source as we see it equal to our address as the other peer sees us); in
//!   one shared table such packets matched the other peer's entry and took its translation
//!   and its route (ADR 0008). Packets from the peer's tunnel take its zone by interface;
//!   packets from our side (our pods' connections to the peer, replies to the peer's) by
//!   destination, our views of the peer. The hub path crosses two tunnels, so its connections
//!   are zoned in the original direction only: the replies, arriving from the destination's
//!   tunnel towards the mapping's external address, are found in the default zone, where the
//!   reply tuple (the destination as we address it, that address) is unique.
//! - `pre_mangle`: a new connection arriving from the peer gets the peer's conntrack mark;
//!   reply packets of marked connections carry it as their fwmark, so `ip rule fwmark → table`
//!   sends them back through the peer's tunnel even when the peer's real pod CIDR equals ours.
//!   Only reply-direction packets are marked: marking forward packets would route them back
//!   into the tunnel they came from.
//! - `pre_nat`: DNAT the destination from how the peer addresses us to our real ranges.
//! - `post_nat`: SNAT the source from the peer's real ranges to how we address the peer.
//!
//! The chains every packet crosses (`pre_raw`, `out_raw`, `pre_mangle`) hold one map per
//! purpose, keyed by interface or destination, not one rule per peer: nft walks a chain's rules
//! in order, so a hub's packets paid for every leaf before theirs (ADR 0033). The NAT chains
//! keep a rule per peer, since nft consults them only for a connection's first packet.

use std::fmt::Write as _;
use std::net::IpAddr;

use ipnet::IpNet;

use crate::names::MARK_MASK;

/// Name of our table (family `ip`).
pub const TABLE: &str = "trellis";

/// What the ruleset needs to know about one peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerNat {
    pub interface: String,
    pub mark: u32,
    /// Hub path: `(the external address as the peer addresses it, the destination as we
    /// address it)`, matched before the prefix maps.
    pub hub_dnat: Vec<(IpAddr, IpAddr)>,
    /// `(how the peer sees us, our real range)`: destination prefix map.
    pub dnat: Vec<(IpNet, IpNet)>,
    /// `(the peer's real range, how we see it)`: source prefix map.
    pub snat: Vec<(IpNet, IpNet)>,
    /// ADR 0032's stateless wire convention: the peer sends in our terms and we translate what
    /// we send it, so its traffic is left untracked (but for the hub path's, which DNAT needs)
    /// and gets no zone, mark or prefix NAT (`dnat` and `snat` then only say what its views
    /// are).
    pub stateless: bool,
}

impl PeerNat {
    /// The peer's conntrack zone: its slot, the high half of its mark (unique per peer).
    pub fn zone(&self) -> u16 {
        zone(self.mark)
    }

    /// How we address the peer: the ranges routed into its tunnel (the source map's targets).
    pub fn views(&self) -> Vec<IpNet> {
        let mut views: Vec<IpNet> = self
            .snat
            .iter()
            .map(|(_, seen)| *seen)
            .filter(|n| n.addr().is_ipv4())
            .collect();
        views.sort();
        views.dedup();
        views
    }
}

fn set<T: ToString>(items: impl IntoIterator<Item = T>) -> Option<String> {
    let items: Vec<String> = items.into_iter().map(|i| i.to_string()).collect();
    (!items.is_empty()).then(|| format!("{{ {} }}", items.join(", ")))
}

/// The conntrack zone of the peer with connection mark `mark`: the mark's high half (its
/// slot); 0, the default zone, for none.
pub fn zone(mark: u32) -> u16 {
    u16::try_from(mark >> 16).unwrap_or(u16::MAX)
}

/// `{ key : value, ... }` of `entries`, or `None` for none: a map nft looks a key up in with
/// one hash or interval lookup, whatever the number of peers. Rules per peer would be walked
/// one by one by every packet, a cost that grows with the peers a hub has (ADR 0033).
fn lookup<K: std::fmt::Display, V: std::fmt::Display>(
    entries: impl IntoIterator<Item = (K, V)>,
) -> Option<String> {
    let entries: Vec<String> = entries
        .into_iter()
        .map(|(k, v)| format!("{k} : {v}"))
        .collect();
    (!entries.is_empty()).then(|| format!("{{ {} }}", entries.join(", ")))
}

/// Each peer's views with the zone of the peer they belong to, for an interval map, which
/// refuses overlapping keys: a view overlapping one already taken (of an earlier peer, or the
/// same peer's wider one) is left out. Our IPAM gives every peer views of its own, so this
/// only keeps a corrupt set of mappings from failing the whole script.
fn view_zones(zoned: &[&PeerNat]) -> Vec<(IpNet, u16)> {
    let mut taken: Vec<(IpNet, u16)> = Vec::new();
    for p in zoned {
        for view in p.views() {
            let overlaps = taken
                .iter()
                .any(|(t, _)| t.contains(&view) || view.contains(t));
            if !overlaps {
                taken.push((view, p.zone()));
            }
        }
    }
    taken
}

/// `"interface" . address` of each of `peers`' hub-path DNAT keys, with the peer's zone
/// (peers without a zone left out).
fn hub_originals(peers: &[&PeerNat]) -> Vec<(String, u16)> {
    let mut originals: Vec<(String, u16)> = peers
        .iter()
        .filter(|p| p.zone() != 0)
        .flat_map(|p| {
            p.hub_dnat
                .iter()
                .filter(|(k, _)| k.is_ipv4())
                .map(|(k, _)| (format!("\"{}\" . {k}", p.interface), p.zone()))
        })
        .collect();
    originals.sort();
    originals.dedup_by(|a, b| a.0 == b.0);
    originals
}

/// The zone rules of `pre_raw` (from a tunnel, or towards a peer) and of `out_raw` (the
/// gateway node's own packets towards a peer): one lookup each, keyed by interface or by
/// destination.
fn zones(s: &mut String, peers: &[PeerNat], hub_snat: &[(IpAddr, IpAddr)]) {
    let zoned: Vec<&PeerNat> = peers
        .iter()
        .filter(|p| p.zone() != 0 && !p.stateless)
        .collect();
    let stateless: Vec<&PeerNat> = peers.iter().filter(|p| p.stateless).collect();
    s.push_str("  chain pre_raw {\n    type filter hook prerouting priority raw; policy accept;\n");
    // A stateless peer's hub-path connections arrive for our real external addresses, which
    // the rule below leaves in the default zone for the replies. They need their peer's zone
    // in the original direction all the same: the guard lets nothing from the default zone
    // into a zoned tunnel, and the hub path may lead into one. Only replies from the
    // mapping's destination share these addresses, and no mapping is handed to the cluster
    // it leads to, so no reply matches a key.
    if let Some(m) = lookup(hub_originals(&stateless)) {
        let _ = writeln!(
            s,
            "    ct original zone set iifname . ip daddr map {m} accept"
        );
    }
    // Replies of hub-path connections: the default zone holds their reply tuples. Under the
    // stateless convention these addresses are also what a peer's hub-path connections arrive
    // for, tracked there too (their DNAT needs it).
    if let Some(externals) = set(hub_snat.iter().filter(|(_, x)| x.is_ipv4()).map(|(_, x)| x)) {
        let _ = writeln!(s, "    ip daddr {externals} return");
    }
    let untracked_from = set(stateless.iter().map(|p| format!("\"{}\"", p.interface)));
    if let Some(interfaces) = untracked_from {
        let _ = writeln!(s, "    iifname {interfaces} notrack accept");
    }
    let untracked_to = set(stateless.iter().flat_map(|p| p.views()))
        .map(|views| format!("    ip daddr {views} notrack accept\n"))
        .unwrap_or_default();
    if let Some(m) = lookup(hub_originals(&zoned)) {
        let _ = writeln!(
            s,
            "    ct original zone set iifname . ip daddr map {m} accept"
        );
    }
    if let Some(m) = lookup(
        zoned
            .iter()
            .map(|p| (format!("\"{}\"", p.interface), p.zone())),
    ) {
        let _ = writeln!(s, "    ct zone set iifname map {m} accept");
    }
    // Only after the zoned tunnels took theirs: what a zoned peer sends is addressed in its
    // own terms, which may be the very addresses we use as views of a stateless peer (both
    // are remaps of overlapping pod CIDRs), and it must reach its zone's DNAT.
    s.push_str(&untracked_to);
    let towards = lookup(view_zones(&zoned))
        .map(|m| format!("    ct zone set ip daddr map {m}\n"))
        .unwrap_or_default();
    s.push_str(&towards);
    s.push_str("  }\n");
    s.push_str("  chain out_raw {\n    type filter hook output priority raw; policy accept;\n");
    s.push_str(&untracked_to);
    s.push_str(&towards);
    s.push_str("  }\n");
}

fn map(entries: &[(IpNet, IpNet)]) -> Option<String> {
    // Identity entries are no-ops; a map of only those needs no rule at all.
    lookup(entries.iter().filter(|(from, to)| from != to).copied())
}

fn addr_map(entries: &[(IpAddr, IpAddr)]) -> Option<String> {
    lookup(
        entries
            .iter()
            .filter(|(from, to)| from.is_ipv4() && to.is_ipv4())
            .copied(),
    )
}

/// The script that replaces our table with one for `peers` (or just removes it when there are
/// none). `hub_snat` (`(destination, external address)`, from [`super::hub_snat`]) gives
/// hub-path connections, recognised as DNAT'ed to one of those destinations, the external
/// address as their source.
pub fn script(peers: &[PeerNat], hub_snat: &[(IpAddr, IpAddr)]) -> String {
    // Creating the table first makes the delete succeed whether or not it exists.
    let mut s = format!("table ip {TABLE} {{}}\ndelete table ip {TABLE}\n");
    if peers.is_empty() {
        return s;
    }
    let _ = writeln!(s, "table ip {TABLE} {{");
    zones(&mut s, peers, hub_snat);
    s.push_str(
        "  chain pre_mangle {\n    type filter hook prerouting priority mangle; policy accept;\n",
    );
    let marks = peers
        .iter()
        .filter(|p| !p.stateless)
        .map(|p| (format!("\"{}\"", p.interface), format!("{:#010x}", p.mark)));
    if let Some(m) = lookup(marks) {
        let _ = writeln!(s, "    ct state new ct mark set iifname map {m}");
    }
    let _ = writeln!(
        s,
        "    ct direction reply ct mark and {MARK_MASK:#010x} != 0x00000000 meta mark set ct mark"
    );
    s.push_str("  }\n");
    s.push_str("  chain pre_nat {\n    type nat hook prerouting priority dstnat; policy accept;\n");
    for p in peers {
        // A lookup that finds nothing ends the rule, so other destinations fall through to
        // the prefix map below. One NAT per connection and hook: the hub-path rule must come
        // first, since the peer's view of our external CIDR is also in its prefix map.
        if let Some(m) = addr_map(&p.hub_dnat) {
            let _ = writeln!(
                s,
                "    iifname \"{}\" dnat ip to ip daddr map {m}",
                p.interface
            );
        }
        if let Some(m) = map(&p.dnat).filter(|_| !p.stateless) {
            let _ = writeln!(
                s,
                "    iifname \"{}\" dnat ip prefix to ip daddr map {m}",
                p.interface
            );
        }
    }
    s.push_str("  }\n");
    s.push_str(
        "  chain post_nat {\n    type nat hook postrouting priority srcnat; policy accept;\n",
    );
    if let Some(m) = addr_map(hub_snat) {
        let _ = writeln!(s, "    ct status dnat snat ip to ip daddr map {m}");
    }
    for p in peers.iter().filter(|p| !p.stateless) {
        if let Some(m) = map(&p.snat) {
            let _ = writeln!(
                s,
                "    iifname \"{}\" snat ip prefix to ip saddr map {m}",
                p.interface
            );
        }
    }
    s.push_str("  }\n}\n");
    s
}

/// Which peers' rules nft takes, when the script for all of them was refused: each peer's
/// rules are checked on their own with `check` (in production `nft -c -f -`, which changes
/// nothing), so one peer whose NAT entries nft refuses (overlapping views, say) leaves every
/// other peer's rules applied instead of none. Returns the accepted peers and, per refused
/// interface, nft's reason.
pub async fn isolate<F, Fut>(
    peers: &[PeerNat],
    hub_snat: &[(IpAddr, IpAddr)],
    check: F,
) -> (Vec<PeerNat>, Vec<(String, String)>)
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let mut accepted = Vec::new();
    let mut refused = Vec::new();
    for peer in peers {
        match check(script(std::slice::from_ref(peer), hub_snat)).await {
            Ok(()) => accepted.push(peer.clone()),
            Err(err) => refused.push((peer.interface.clone(), format!("{err:#}"))),
        }
    }
    (accepted, refused)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().expect("net")
    }

    #[test]
    fn renders_marks_and_prefix_maps_skipping_identities() {
        let peers = [PeerNat {
            interface: "tg01234567".into(),
            mark: 0xca81_0000,
            hub_dnat: vec![],
            dnat: vec![
                (net("10.83.0.0/16"), net("10.0.0.0/16")),
                (net("10.201.0.0/16"), net("10.201.0.0/16")),
            ],
            snat: vec![(net("10.0.0.0/16"), net("10.81.0.0/16"))],
            stateless: false,
        }];
        let s = script(&peers, &[]);
        assert!(
            s.starts_with("table ip trellis {}\ndelete table ip trellis\n"),
            "{s}"
        );
        assert!(
            s.contains("ct state new ct mark set iifname map { \"tg01234567\" : 0xca810000 }"),
            "{s}"
        );
        // The peer's own conntrack zone (its slot), set before conntrack looks the packet up:
        // from its tunnel, and towards how we address it, from our side and from the node.
        let raw = s
            .find("type filter hook prerouting priority raw")
            .expect(&s);
        let from = s
            .find("ct zone set iifname map { \"tg01234567\" : 51841 } accept")
            .expect(&s);
        let towards = s
            .find("ct zone set ip daddr map { 10.81.0.0/16 : 51841 }")
            .expect(&s);
        let out = s.find("type filter hook output priority raw").expect(&s);
        assert!(raw < from && from < towards && towards < out, "{s}");
        assert!(
            s[out..].contains("ct zone set ip daddr map { 10.81.0.0/16 : 51841 }"),
            "{s}"
        );
        assert!(
            s.contains("dnat ip prefix to ip daddr map { 10.83.0.0/16 : 10.0.0.0/16 }"),
            "{s}"
        );
        assert!(!s.contains("10.201.0.0/16 : 10.201.0.0/16"), "{s}");
        assert!(
            s.contains("snat ip prefix to ip saddr map { 10.0.0.0/16 : 10.81.0.0/16 }"),
            "{s}"
        );
    }

    #[test]
    fn hub_path_rules_come_before_the_prefix_maps() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        let peers = [PeerNat {
            interface: "tga".into(),
            mark: 0x1_0000,
            hub_dnat: vec![(ip("10.92.3.7"), ip("10.83.0.10"))],
            dnat: vec![(net("10.92.0.0/16"), net("10.201.0.0/16"))],
            snat: vec![(net("10.0.0.0/16"), net("10.81.0.0/16"))],
            stateless: false,
        }];
        let s = script(&peers, &[(ip("10.83.0.10"), ip("10.201.3.7"))]);
        let hub = s
            .find("iifname \"tga\" dnat ip to ip daddr map { 10.92.3.7 : 10.83.0.10 }")
            .expect(&s);
        let prefix = s.find("dnat ip prefix to").expect(&s);
        assert!(hub < prefix, "{s}");
        // Hub-path connections: zoned in the original direction only, their replies (towards
        // the mapping's external address) looked up in the default zone.
        let replies = s.find("ip daddr { 10.201.3.7 } return").expect(&s);
        let hub_zone = s
            .find("ct original zone set iifname . ip daddr map { \"tga\" . 10.92.3.7 : 1 } accept")
            .expect(&s);
        let zone = s
            .find("ct zone set iifname map { \"tga\" : 1 } accept")
            .expect(&s);
        assert!(replies < hub_zone && hub_zone < zone, "{s}");
        let snat = s
            .find("ct status dnat snat ip to ip daddr map { 10.83.0.10 : 10.201.3.7 }")
            .expect(&s);
        assert!(snat < s.find("snat ip prefix to").expect(&s), "{s}");
    }

    /// A stateless peer (ADR 0032) next to a zoned one: its traffic from its tunnel is left
    /// untracked before the zones, and traffic towards its views after the zoned tunnels' own
    /// (whose destinations may be the same addresses in their terms) and before the zones
    /// towards views. It has no mark and no prefix NAT, and a zone only for its hub-path
    /// connections, in their original direction, ahead of the rule that keeps the replies to
    /// those addresses in the default zone; its hub-path DNAT stays, keyed as given.
    #[test]
    fn a_stateless_peer_is_untracked_and_gets_no_zone_mark_or_prefix_nat() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        let zoned = PeerNat {
            interface: "tgzoned001".into(),
            mark: 0xca01_0000,
            hub_dnat: vec![],
            dnat: vec![(net("10.83.0.0/16"), net("10.0.0.0/16"))],
            snat: vec![(net("10.0.0.0/16"), net("10.81.0.0/16"))],
            stateless: false,
        };
        let stateless = PeerNat {
            interface: "tgplain002".into(),
            mark: 0xca02_0000,
            hub_dnat: vec![(ip("10.201.3.7"), ip("10.100.0.9"))],
            dnat: vec![(net("10.84.0.0/16"), net("10.0.0.0/16"))],
            snat: vec![(net("10.0.0.0/16"), net("10.85.0.0/16"))],
            stateless: true,
        };
        let s = script(&[zoned, stateless], &[(ip("10.100.0.9"), ip("10.201.3.7"))]);
        let chain = |name: &str| {
            let at = s.find(&format!("chain {name} {{")).expect(name);
            s[at..at + s[at..].find("  }").expect("end")].to_owned()
        };
        let pre_raw = chain("pre_raw");
        let hub_zone = pre_raw
            .find(
                "ct original zone set iifname . ip daddr map { \"tgplain002\" . 10.201.3.7 : 51714 } accept",
            )
            .expect(&pre_raw);
        let hub = pre_raw
            .find("ip daddr { 10.201.3.7 } return")
            .expect(&pre_raw);
        assert!(hub_zone < hub, "{pre_raw}");
        let from = pre_raw
            .find("iifname { \"tgplain002\" } notrack accept")
            .expect(&pre_raw);
        let to = pre_raw
            .find("ip daddr { 10.85.0.0/16 } notrack accept")
            .expect(&pre_raw);
        let zones = pre_raw.find("ct zone set iifname map").expect(&pre_raw);
        let towards = pre_raw.find("ct zone set ip daddr map").expect(&pre_raw);
        assert!(
            hub < from && from < zones && zones < to && to < towards,
            "{pre_raw}"
        );
        assert!(!pre_raw[zones..].contains("tgplain002"), "{pre_raw}");
        assert!(!pre_raw[towards..].contains("10.85.0.0/16"), "{pre_raw}");
        assert!(chain("out_raw").contains("ip daddr { 10.85.0.0/16 } notrack accept"));
        assert!(!chain("pre_mangle").contains("tgplain002"), "{s}");
        let pre_nat = chain("pre_nat");
        assert!(
            pre_nat.contains(
                "iifname \"tgplain002\" dnat ip to ip daddr map { 10.201.3.7 : 10.100.0.9 }"
            ),
            "{pre_nat}"
        );
        assert!(
            !pre_nat.contains("tgplain002\" dnat ip prefix"),
            "{pre_nat}"
        );
        assert!(!chain("post_nat").contains("tgplain002"), "{s}");
    }

    #[test]
    fn no_peers_only_removes_the_table() {
        assert_eq!(
            script(&[], &[]),
            "table ip trellis {}\ndelete table ip trellis\n"
        );
    }

    #[test]
    fn every_peer_is_one_map_entry_and_overlapping_views_are_left_out() {
        let peer = |i: u32, view: &str| PeerNat {
            interface: format!("tg{i}"),
            mark: i << 16,
            hub_dnat: vec![],
            dnat: vec![],
            snat: vec![(net("10.0.0.0/16"), net(view))],
            stateless: false,
        };
        let peers: Vec<PeerNat> = (1..=254)
            .map(|i| peer(i, &format!("10.{}.0.0/16", 100 + i % 100)))
            .chain([peer(300, "10.250.0.0/16"), peer(301, "10.250.7.0/24")])
            .collect();
        let s = script(&peers, &[]);
        // However many peers, a packet meets the same few rules.
        let pre_raw = s.find("chain pre_raw").expect(&s);
        let out_raw = s.find("chain out_raw").expect(&s);
        assert_eq!(s[pre_raw..out_raw].matches("ct zone set").count(), 2, "{s}");
        let zones = s
            .lines()
            .find(|l| l.contains("ct zone set iifname map"))
            .expect(&s);
        assert!(
            zones.contains("\"tg254\" : 254") && zones.contains("\"tg1\" : 1"),
            "{zones}"
        );
        let marks = s
            .lines()
            .find(|l| l.contains("ct mark set iifname map"))
            .expect(&s);
        assert!(marks.contains("\"tg301\" : 0x012d0000"), "{marks}");
        // Views shared by two peers (a corrupt state) keep the first peer's zone rather than
        // failing the interval map, and so the whole script.
        let views = s
            .lines()
            .find(|l| l.contains("ct zone set ip daddr map"))
            .expect(&s);
        assert_eq!(views.matches("10.101.0.0/16").count(), 1, "{views}");
        assert!(views.contains("10.101.0.0/16 : 1,"), "{views}");
        assert!(views.contains("10.250.0.0/16 : 300"), "{views}");
        assert!(!views.contains("10.250.7.0/24"), "{views}");
    }
}
