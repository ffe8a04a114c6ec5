//! Stateless address translation of a packet on its way into a peer's tunnel: the sending side
//! of the wire convention ADR 0032 prices ("A stateless wire convention"), where every packet on
//! a tunnel carries the source as the receiver addresses the sender and the receiver's real
//! destination, whoever opened the flow. The receiving gateway then needs no conntrack zone, no
//! NAT and no mark for it. The engine applies a peer's translation to every packet it reads
//! from the peer's TUN ([`PeerConfig::translation`](super::PeerConfig::translation)); the
//! gateway configures one for every peer whose tunnel uses the convention (both sides offered
//! it, ADR 0034), and for the others still translates on arrival (ADR 0008).
//!
//! A translation is two lists of prefix rewrites, one for the source and one for the
//! destination; an address in a rewrite's `from` keeps its host bits and takes `to`'s network
//! bits. Only IPv4 is translated (the gateway's NAT is IPv4 only); anything else passes as it
//! is. The checksums are updated in place, incrementally (RFC 1624): the IPv4 header's, the TCP
//! and UDP ones over the pseudo-header (a UDP checksum of zero, none, stays zero), and for ICMP
//! errors the packet they quote, which is translated the other way round (it went from the peer
//! to us), with the ICMP checksum over what changed in it.

use std::net::{IpAddr, Ipv4Addr};

use ipnet::Ipv4Net;

/// One prefix rewrite: addresses in `from` take `to`'s network bits and keep their host bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rewrite {
    from: Ipv4Net,
    to: Ipv4Net,
}

impl Rewrite {
    /// A rewrite from `from` to `to`; `None` when their prefix lengths differ (a remap keeps
    /// the size of a network).
    pub fn new(from: Ipv4Net, to: Ipv4Net) -> Option<Self> {
        (from.prefix_len() == to.prefix_len()).then(|| Self {
            from: from.trunc(),
            to: to.trunc(),
        })
    }

    fn apply(&self, address: Ipv4Addr) -> Option<Ipv4Addr> {
        match crate::dataplane::rebase(address.into(), self.from.into(), self.to.into())? {
            IpAddr::V4(rebased) => Some(rebased),
            IpAddr::V6(_) => None,
        }
    }
}

/// What the sending gateway does to a packet before encrypting it for one peer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Translation {
    /// Our real ranges to how the peer addresses them.
    pub source: Vec<Rewrite>,
    /// How we address the peer to its real ranges.
    pub destination: Vec<Rewrite>,
}

/// What [`Translation::apply`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// At least one address was rewritten.
    Translated,
    /// Nothing to rewrite: no address in a rewrite's range, or not IPv4.
    Untouched,
    /// An IPv4 header that does not describe the packet; left as it was.
    Malformed,
}

/// The first bytes of an ICMP message that quotes a packet: type, code, checksum and four more.
const ICMP_HEADER: usize = 8;

impl Translation {
    fn map(rewrites: &[Rewrite], address: Ipv4Addr) -> Ipv4Addr {
        rewrites
            .iter()
            .find_map(|r| r.apply(address))
            .unwrap_or(address)
    }

    /// Translates `packet` in place.
    pub fn apply(&self, packet: &mut [u8]) -> Outcome {
        let Some(header) = Header::parse(packet) else {
            return match packet.first() {
                Some(b) if b >> 4 == 4 => Outcome::Malformed,
                _ => Outcome::Untouched,
            };
        };
        let source = Self::map(&self.source, header.source(packet));
        let destination = Self::map(&self.destination, header.destination(packet));
        if !header.rewrite(packet, source, destination) {
            return Outcome::Untouched;
        }
        if header.first_fragment(packet)
            && header.protocol(packet) == ICMP
            && let Some(icmp) = packet.get_mut(header.payload())
            && icmp.first().copied().is_some_and(is_icmp_error)
        {
            self.translate_quoted(icmp);
        }
        Outcome::Translated
    }

    /// Translates the packet the ICMP error `icmp` quotes, then the error's checksum over every
    /// word that changed. The quoted packet went from the peer to us: its source is our view of
    /// the peer and its destination ours, so each takes the other list.
    fn translate_quoted(&self, icmp: &mut [u8]) {
        let at = ICMP_HEADER;
        let Some(inner) = icmp.get(at..).and_then(Header::parse_quoted) else {
            return;
        };
        let span = at..at + inner.end;
        let before = icmp[span.clone()].to_vec();
        let quoted = &mut icmp[span.clone()];
        let source = Self::map(&self.destination, inner.source(quoted));
        let destination = Self::map(&self.source, inner.destination(quoted));
        if !inner.rewrite(quoted, source, destination) {
            return;
        }
        // Every changed field is 16-bit aligned within the ICMP message (the quoted header
        // starts 8 bytes in, its fields and its transport header at multiples of 4).
        let after = icmp[span].to_vec();
        let mut checksum = u16::from_be_bytes([icmp[2], icmp[3]]);
        for (old, new) in before.chunks(2).zip(after.chunks(2)) {
            if old != new && old.len() == 2 {
                checksum = adjust(checksum, old, new);
            }
        }
        icmp[2..4].copy_from_slice(&checksum.to_be_bytes());
    }
}

const ICMP: u8 = 1;
const TCP: u8 = 6;
const UDP: u8 = 17;

/// Destination unreachable, source quench, redirect, time exceeded, parameter problem: the ICMP
/// messages that quote the packet they are about.
fn is_icmp_error(kind: u8) -> bool {
    matches!(kind, 3 | 4 | 5 | 11 | 12)
}

/// An IPv4 header checked against the bytes it heads.
struct Header {
    len: usize,
    /// The end of what the header says the packet holds (the quoted packet of an ICMP error
    /// may be cut short of it).
    end: usize,
}

impl Header {
    fn parse(packet: &[u8]) -> Option<Self> {
        let header = Self::parse_quoted(packet)?;
        let total = usize::from(u16::from_be_bytes([packet[2], packet[3]]));
        (total <= packet.len()).then_some(Self {
            end: total,
            ..header
        })
    }

    /// A header that may head fewer bytes than its total length says.
    fn parse_quoted(packet: &[u8]) -> Option<Self> {
        let first = *packet.first()?;
        let len = usize::from(first & 0x0f) * 4;
        if first >> 4 != 4 || len < 20 || packet.len() < len {
            return None;
        }
        let total = usize::from(u16::from_be_bytes([packet[2], packet[3]]));
        if total < len {
            return None;
        }
        Some(Self {
            len,
            end: total.min(packet.len()),
        })
    }

    fn source(&self, packet: &[u8]) -> Ipv4Addr {
        Ipv4Addr::new(packet[12], packet[13], packet[14], packet[15])
    }

    fn destination(&self, packet: &[u8]) -> Ipv4Addr {
        Ipv4Addr::new(packet[16], packet[17], packet[18], packet[19])
    }

    fn protocol(&self, packet: &[u8]) -> u8 {
        packet[9]
    }

    /// Whether the transport header is in this packet: not a later fragment.
    fn first_fragment(&self, packet: &[u8]) -> bool {
        u16::from_be_bytes([packet[6], packet[7]]) & 0x1fff == 0
    }

    fn payload(&self) -> std::ops::Range<usize> {
        self.len..self.end
    }

    /// Writes the new addresses, the header's checksum and, in a first fragment, the TCP or
    /// UDP checksum where the packet holds it; false when both addresses stay.
    fn rewrite(&self, packet: &mut [u8], source: Ipv4Addr, destination: Ipv4Addr) -> bool {
        let old: [u8; 8] = packet[12..20].try_into().unwrap_or_default();
        let mut new = [0u8; 8];
        new[..4].copy_from_slice(&source.octets());
        new[4..].copy_from_slice(&destination.octets());
        if old == new {
            return false;
        }
        packet[12..20].copy_from_slice(&new);
        let ip = adjust(u16::from_be_bytes([packet[10], packet[11]]), &old, &new);
        packet[10..12].copy_from_slice(&ip.to_be_bytes());
        if !self.first_fragment(packet) {
            return true;
        }
        let at = match self.protocol(packet) {
            TCP => self.len + 16,
            UDP => self.len + 6,
            _ => return true,
        };
        // Only where the packet holds it: bytes past its total length are not its own.
        let Some(field) = packet.get(at..at + 2).filter(|_| at + 2 <= self.end) else {
            return true;
        };
        let checksum = u16::from_be_bytes([field[0], field[1]]);
        if self.protocol(packet) == UDP && checksum == 0 {
            return true;
        }
        let mut updated = adjust(checksum, &old, &new);
        if self.protocol(packet) == UDP && updated == 0 {
            updated = 0xffff;
        }
        packet[at..at + 2].copy_from_slice(&updated.to_be_bytes());
        true
    }
}

/// `checksum` after the 16-bit words `old` became `new` (RFC 1624, eq. 3: HC' = ~(~HC + ~m + m')).
fn adjust(checksum: u16, old: &[u8], new: &[u8]) -> u16 {
    let word = |b: &[u8]| u16::from_be_bytes([b[0], b.get(1).copied().unwrap_or(0)]);
    let mut sum = u32::from(!checksum);
    for (o, n) in old.chunks(2).zip(new.chunks(2)) {
        sum += u32::from(!word(o)) + u32::from(word(n));
    }
    !fold(sum)
}

/// A 32-bit ones' complement sum folded into 16 bits.
fn fold(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    u16::try_from(sum).unwrap_or(u16::MAX)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The ones' complement checksum of `bytes` (an odd last byte padded with zero).
    fn checksum(bytes: &[u8]) -> u16 {
        let sum = bytes
            .chunks(2)
            .map(|c| u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
            .sum();
        !fold(sum)
    }

    fn pseudo(packet: &[u8], len: usize) -> Vec<u8> {
        let mut p = packet[12..20].to_vec();
        p.extend([0, packet[9]]);
        p.extend(u16::try_from(len).expect("short").to_be_bytes());
        p
    }

    /// An IPv4 packet of `protocol` from `src` to `dst` around `transport` (whose checksum, if
    /// it has one, is filled in), fragment offset `offset` (in 8-byte units).
    fn packet(protocol: u8, src: [u8; 4], dst: [u8; 4], transport: &[u8], offset: u16) -> Vec<u8> {
        let total = 20 + transport.len();
        let mut p = vec![0x45, 0];
        p.extend(u16::try_from(total).expect("short").to_be_bytes());
        p.extend([0x12, 0x34]);
        p.extend(offset.to_be_bytes());
        p.extend([64, protocol, 0, 0]);
        p.extend(src);
        p.extend(dst);
        p.extend(transport);
        let ip = checksum(&p[..20]);
        p[10..12].copy_from_slice(&ip.to_be_bytes());
        if offset == 0 {
            fill_transport_checksum(&mut p);
        }
        p
    }

    fn fill_transport_checksum(p: &mut [u8]) {
        let at = match p[9] {
            TCP => 36,
            UDP => 26,
            ICMP => 22,
            _ => return,
        };
        if p[9] == UDP && p[at..at + 2] == [0xde, 0xad] {
            // The marker for "no checksum".
            p[at..at + 2].copy_from_slice(&[0, 0]);
            return;
        }
        p[at..at + 2].copy_from_slice(&[0, 0]);
        let mut covered = if p[9] == ICMP {
            Vec::new()
        } else {
            pseudo(p, p.len() - 20)
        };
        covered.extend(&p[20..]);
        let sum = match checksum(&covered) {
            // UDP sends a sum of zero as 0xffff: zero means none.
            0 if p[9] == UDP => 0xffff,
            sum => sum,
        };
        p[at..at + 2].copy_from_slice(&sum.to_be_bytes());
    }

    fn tcp(payload: &[u8]) -> Vec<u8> {
        let mut t = vec![
            0x04, 0xd2, 0x00, 0x50, 0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x18, 0xff, 0xff,
        ];
        t.extend([0, 0, 0, 0]);
        t.extend(payload);
        t
    }

    fn udp(payload: &[u8], no_checksum: bool) -> Vec<u8> {
        let len = u16::try_from(8 + payload.len()).expect("short");
        let mut u = vec![0x30, 0x39, 0x00, 0x35];
        u.extend(len.to_be_bytes());
        u.extend(if no_checksum { [0xde, 0xad] } else { [0, 0] });
        u.extend(payload);
        u
    }

    /// Whether every checksum `p` carries is right: the IPv4 header's, the transport's of a
    /// whole unfragmented packet, and those of the packet an ICMP error quotes in full.
    fn valid(p: &[u8]) -> bool {
        if checksum(&p[..20]) != 0 {
            return false;
        }
        let flags = u16::from_be_bytes([p[6], p[7]]);
        if flags & 0x3fff != 0 {
            return true;
        }
        let body = &p[20..];
        match p[9] {
            ICMP => {
                checksum(body) == 0
                    && (!is_icmp_error(body[0]) || body.len() < 28 || valid(&body[8..]))
            }
            UDP if body[6..8] == [0, 0] => true,
            TCP | UDP => {
                let mut covered = pseudo(p, body.len());
                covered.extend(body);
                checksum(&covered) == 0
            }
            _ => true,
        }
    }

    fn net(s: &str) -> Ipv4Net {
        s.parse().expect("net")
    }

    /// Ours: 10.0/16 (10.201/16 external); the peer addresses us as 10.81/16 (10.82/16), and we
    /// address it as 10.83/16, its real range being 10.0/16 too.
    fn ours() -> Translation {
        let rewrite = |a: &str, b: &str| Rewrite::new(net(a), net(b)).expect("same length");
        Translation {
            source: vec![
                rewrite("10.0.0.0/16", "10.81.0.0/16"),
                rewrite("10.201.0.0/16", "10.82.0.0/16"),
            ],
            destination: vec![rewrite("10.83.0.0/16", "10.0.0.0/16")],
        }
    }

    /// The translation that undoes `t` (not the peer's: the way back to the original bytes).
    fn inverse(t: &Translation) -> Translation {
        let flip = |rs: &[Rewrite]| {
            rs.iter()
                .map(|r| Rewrite::new(r.to, r.from).expect("same length"))
                .collect()
        };
        Translation {
            source: flip(&t.source),
            destination: flip(&t.destination),
        }
    }

    #[test]
    fn tcp_and_udp_take_the_receivers_addresses_with_valid_checksums() {
        for mut p in [
            packet(TCP, [10, 0, 3, 7], [10, 83, 1, 2], &tcp(b"hello, peer"), 0),
            packet(
                UDP,
                [10, 0, 3, 7],
                [10, 83, 1, 2],
                &udp(b"odd length", false),
                0,
            ),
        ] {
            assert!(valid(&p));
            assert_eq!(ours().apply(&mut p), Outcome::Translated);
            assert_eq!(p[12..20], [10, 81, 3, 7, 10, 0, 1, 2]);
            assert!(valid(&p), "{p:?}");
        }
    }

    #[test]
    fn a_udp_datagram_without_a_checksum_keeps_none() {
        let mut p = packet(UDP, [10, 0, 3, 7], [10, 83, 1, 2], &udp(b"x", true), 0);
        assert_eq!(ours().apply(&mut p), Outcome::Translated);
        assert_eq!(p[26..28], [0, 0]);
        assert!(valid(&p));
    }

    #[test]
    fn a_udp_checksum_never_becomes_zero() {
        // Some payload makes the updated checksum 0, which would read as "none": it must be
        // sent as 0xffff instead.
        let mut seen_ffff = false;
        for v in 0..=u16::MAX {
            let mut p = packet(
                UDP,
                [10, 0, 3, 7],
                [10, 83, 1, 2],
                &udp(&v.to_be_bytes(), false),
                0,
            );
            if p[26..28] == [0, 0] {
                continue;
            }
            ours().apply(&mut p);
            assert_ne!(p[26..28], [0, 0], "payload {v}");
            assert!(valid(&p), "payload {v}");
            seen_ffff |= p[26..28] == [0xff, 0xff];
        }
        assert!(seen_ffff, "no payload reached the case");
    }

    #[test]
    fn a_later_fragment_changes_its_header_only() {
        let payload = tcp(b"the middle of a datagram");
        let mut p = packet(TCP, [10, 0, 3, 7], [10, 83, 1, 2], &payload, 185);
        assert_eq!(ours().apply(&mut p), Outcome::Translated);
        assert_eq!(p[12..20], [10, 81, 3, 7, 10, 0, 1, 2]);
        assert_eq!(&p[20..], &payload[..]);
        assert!(valid(&p));
    }

    #[test]
    fn an_echo_request_changes_its_header_only() {
        let echo = [8, 0, 0, 0, 0x12, 0x34, 0, 1, 0xaa, 0xbb];
        let mut p = packet(ICMP, [10, 0, 3, 7], [10, 83, 1, 2], &echo, 0);
        let body = p[20..].to_vec();
        assert_eq!(ours().apply(&mut p), Outcome::Translated);
        assert_eq!(p[20..], body[..]);
        assert!(valid(&p));
    }

    #[test]
    fn an_icmp_error_quotes_the_peers_packet_as_the_peer_sent_it() {
        // The peer's pod 10.0.0.10 sent a datagram to us as it addresses us (10.81.0.20); it
        // arrived as 10.83.0.10 -> 10.0.0.20, and our pod answers "port unreachable".
        let arrived = packet(
            UDP,
            [10, 83, 0, 10],
            [10, 0, 0, 20],
            &udp(b"anyone?", false),
            0,
        );
        let mut error = vec![3, 3, 0, 0, 0, 0, 0, 0];
        error.extend(&arrived);
        let mut p = packet(ICMP, [10, 0, 0, 20], [10, 83, 0, 10], &error, 0);
        assert!(valid(&p));
        assert_eq!(ours().apply(&mut p), Outcome::Translated);
        assert_eq!(p[12..20], [10, 81, 0, 20, 10, 0, 0, 10]);
        let quoted = &p[28..];
        assert_eq!(quoted[12..20], [10, 0, 0, 10, 10, 81, 0, 20]);
        assert!(valid(&p), "{p:?}");
        let sent = packet(
            UDP,
            [10, 0, 0, 10],
            [10, 81, 0, 20],
            &udp(b"anyone?", false),
            0,
        );
        assert_eq!(quoted, &sent[..], "what the peer's pod sent, byte for byte");
    }

    #[test]
    fn an_icmp_error_quoting_a_cut_packet_stays_valid() {
        let arrived = packet(TCP, [10, 83, 0, 10], [10, 0, 0, 20], &tcp(&[7; 100]), 0);
        let mut error = vec![11, 0, 0, 0, 0, 0, 0, 0];
        error.extend(&arrived[..28]);
        let mut p = packet(ICMP, [10, 0, 0, 20], [10, 83, 0, 10], &error, 0);
        assert_eq!(ours().apply(&mut p), Outcome::Translated);
        assert_eq!(p[28 + 12..28 + 20], [10, 0, 0, 10, 10, 81, 0, 20]);
        assert_eq!(checksum(&p[20..]), 0, "the ICMP checksum");
        assert_eq!(checksum(&p[28..48]), 0, "the quoted header's checksum");
    }

    #[test]
    fn what_is_not_ours_or_not_ipv4_passes_untouched() {
        let mut elsewhere = packet(TCP, [192, 168, 1, 1], [172, 16, 0, 1], &tcp(b""), 0);
        let before = elsewhere.clone();
        assert_eq!(ours().apply(&mut elsewhere), Outcome::Untouched);
        assert_eq!(elsewhere, before);
        let mut v6 = vec![0x60; 48];
        assert_eq!(ours().apply(&mut v6), Outcome::Untouched);
        assert_eq!(ours().apply(&mut []), Outcome::Untouched);
    }

    #[test]
    fn a_header_that_does_not_describe_the_packet_is_malformed_and_left_alone() {
        let good = packet(TCP, [10, 0, 3, 7], [10, 83, 1, 2], &tcp(b"abc"), 0);
        let mut longer = good.clone();
        longer[3] += 1; // a total length past the end
        let mut short_header = good.clone();
        short_header[0] = 0x44; // IHL 16 bytes
        let mut cut = good[..19].to_vec();
        for p in [&mut longer, &mut short_header, &mut cut] {
            let before = p.clone();
            assert_eq!(ours().apply(p), Outcome::Malformed);
            assert_eq!(*p, before);
        }
    }

    #[test]
    fn rewrites_keep_the_size_of_a_network() {
        assert!(Rewrite::new(net("10.0.0.0/16"), net("10.81.0.0/24")).is_none());
        let r = Rewrite::new(net("10.0.7.9/16"), net("10.81.0.0/16")).expect("same length");
        assert_eq!(
            r.apply(Ipv4Addr::new(10, 0, 3, 7)),
            Some(Ipv4Addr::new(10, 81, 3, 7))
        );
        assert_eq!(r.apply(Ipv4Addr::new(10, 1, 3, 7)), None);
    }

    proptest! {
        /// Any TCP, UDP or ICMP packet from one of our ranges or to one of the peer's keeps
        /// valid checksums, and the inverse translation gives back the original bytes.
        #[test]
        fn checksums_stay_valid_and_the_inverse_restores_every_byte(
            protocol in prop::sample::select(vec![TCP, UDP, ICMP]),
            src in prop::sample::select(vec![[10u8, 0], [10, 201], [192, 0]]),
            // Not 10.0/16: the inverse would take an untranslated destination there for one
            // it had translated.
            dst in prop::sample::select(vec![[10u8, 83], [10, 82], [172, 16]]),
            hosts in any::<[u8; 4]>(),
            payload in prop::collection::vec(any::<u8>(), 0..200),
        ) {
            let transport = match protocol {
                TCP => tcp(&payload),
                UDP => udp(&payload, false),
                _ => [vec![8, 0, 0, 0, 1, 2, 3, 4], payload.clone()].concat(),
            };
            let original = packet(
                protocol,
                [src[0], src[1], hosts[0], hosts[1]],
                [dst[0], dst[1], hosts[2], hosts[3]],
                &transport,
                0,
            );
            let mut p = original.clone();
            let outcome = ours().apply(&mut p);
            prop_assert!(valid(&p));
            prop_assert_eq!(outcome == Outcome::Translated, p != original);
            inverse(&ours()).apply(&mut p);
            // 0xffff and 0 are one value in ones' complement: a UDP checksum may come back
            // as the other spelling of the same sum, never as "none".
            if protocol == UDP && p[26..28] != original[26..28] {
                prop_assert!(p[26..28] == [0xff, 0xff] || original[26..28] == [0xff, 0xff]);
                p[26..28].copy_from_slice(&original[26..28]);
            }
            prop_assert_eq!(p, original);
        }
    }
}
