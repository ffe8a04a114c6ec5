//! Connection handoff between replicas: the active tells its standbys, every
//! `--handoff-interval`, which connections a peer opened through it, and each standby enters
//! them in its own connection tracking, translation included. The standby that takes over
//! then continues those connections from whichever side speaks first.
//!
//! Why it is needed: the gateway translates a peer's connections where they arrive (DNAT to
//! our real range, SNAT to how we see the peer; `dataplane::nft`), and the reply direction is
//! translated back only because conntrack remembers the connection. A new active that has
//! never seen a connection learns it from its first packet. From the tunnel side, the rules
//! translate it as the old active did. From our side, the packet (our pod answering the peer)
//! looks exactly like a connection our pod opens, which is not translated here: it would leave
//! untranslated, the peer's gateway would see a second connection clash with the first, and
//! the peer's pod would get a reset. Our own pods' connections need nothing: they are
//! translated by the peer, and whichever side speaks first, they leave here as they are.
//!
//! What travels: the original tuple, zone, mark and the two translated addresses of every
//! tracked IPv4 TCP (established) or UDP connection that carries a peer's mark and was
//! translated (read from `/proc/net/nf_conntrack`), in authenticated datagrams on the
//! heartbeat socket, the whole set each time, cut into parts. A standby applies a set only
//! once it holds every part of it: it inserts what is new (`conntrack -I` with the zone, mark
//! and NAT addresses) and deletes what the active no longer tracks. A connection opened less
//! than one interval before the active dies is not handed off.
//!
//! Layout (big-endian): `"TGFL"`, version (1), length of the replica ID, the ID, epoch (u64),
//! sent time (i64 nanoseconds), set number (u32), part (u16), parts (u16), count (u16), then
//! `count` entries of [`ENTRY`] bytes (protocol, zone, mark, source, destination, source port,
//! destination port, new source, new destination), then the 32-byte tag (the heartbeat key).

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use ring::hmac;

use super::heartbeat::{MAX_ID, MAX_SKEW_NANOS, Refusal};

/// The first bytes of every handoff datagram.
pub const MAGIC: &[u8; 4] = b"TGFL";
const VERSION: u8 = 1;
const TAG: usize = 32;
/// One connection on the wire.
pub const ENTRY: usize = 1 + 2 + 4 + 4 * 4 + 2 * 2;
/// Connections per datagram: a datagram stays under 1,280 bytes (no fragmentation anywhere).
pub const PER_PART: usize = 40;
/// The largest handoff datagram.
pub const MAX_LEN: usize = 4 + 1 + 1 + MAX_ID + 8 + 8 + 4 + 2 + 2 + 2 + PER_PART * ENTRY + TAG;
/// The most parts a set may have (the most connections handed off: 40 × 4,096).
pub const MAX_PARTS: u16 = 4096;

/// A transport protocol whose connections are handed off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    fn number(self) -> u8 {
        match self {
            Self::Tcp => 6,
            Self::Udp => 17,
        }
    }

    fn from_number(n: u8) -> Option<Self> {
        match n {
            6 => Some(Self::Tcp),
            17 => Some(Self::Udp),
            _ => None,
        }
    }

    /// The name `conntrack -p` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
        }
    }
}

/// One translated connection a peer opened: its original tuple as it arrived from the tunnel,
/// and the addresses it was translated to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Flow {
    pub proto: Proto,
    pub zone: u16,
    pub mark: u32,
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
    /// The source after SNAT (how we see the peer's pod).
    pub new_src: Ipv4Addr,
    /// The destination after DNAT (our pod's real address).
    pub new_dst: Ipv4Addr,
}

impl Flow {
    /// The `conntrack` arguments that insert this connection.
    pub fn insert_args(&self) -> Vec<String> {
        let mut args = self.tuple_args("-I");
        args.extend(["--mark".into(), self.mark.to_string()]);
        if self.proto == Proto::Tcp {
            args.extend(["--state".into(), "ESTABLISHED".into()]);
        }
        // Long enough to outlive any takeover; the first packet after one sets the usual
        // timeout again.
        args.extend(["-t".into(), "86400".into()]);
        if self.new_src != self.src {
            args.extend(["--src-nat".into(), self.new_src.to_string()]);
        }
        if self.new_dst != self.dst {
            args.extend(["--dst-nat".into(), self.new_dst.to_string()]);
        }
        args
    }

    /// The `conntrack` arguments that delete this connection.
    pub fn delete_args(&self) -> Vec<String> {
        self.tuple_args("-D")
    }

    fn tuple_args(&self, verb: &str) -> Vec<String> {
        let mut args = vec![
            verb.to_owned(),
            "-p".into(),
            self.proto.name().into(),
            "-s".into(),
            self.src.to_string(),
            "-d".into(),
            self.dst.to_string(),
            "--sport".into(),
            self.sport.to_string(),
            "--dport".into(),
            self.dport.to_string(),
        ];
        if self.zone != 0 {
            args.extend(["-w".into(), self.zone.to_string()]);
        }
        args
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.proto.number());
        out.extend_from_slice(&self.zone.to_be_bytes());
        out.extend_from_slice(&self.mark.to_be_bytes());
        for ip in [self.src, self.dst] {
            out.extend_from_slice(&ip.octets());
        }
        out.extend_from_slice(&self.sport.to_be_bytes());
        out.extend_from_slice(&self.dport.to_be_bytes());
        for ip in [self.new_src, self.new_dst] {
            out.extend_from_slice(&ip.octets());
        }
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let ip = |at: usize| -> Option<Ipv4Addr> {
            let b: [u8; 4] = bytes.get(at..at + 4)?.try_into().ok()?;
            Some(Ipv4Addr::from(b))
        };
        let u16_at = |at: usize| -> Option<u16> {
            Some(u16::from_be_bytes(bytes.get(at..at + 2)?.try_into().ok()?))
        };
        Some(Self {
            proto: Proto::from_number(*bytes.first()?)?,
            zone: u16_at(1)?,
            mark: u32::from_be_bytes(bytes.get(3..7)?.try_into().ok()?),
            src: ip(7)?,
            dst: ip(11)?,
            sport: u16_at(15)?,
            dport: u16_at(17)?,
            new_src: ip(19)?,
            new_dst: ip(23)?,
        })
    }
}

/// The connections of a conntrack table (`/proc/net/nf_conntrack`) to hand off: IPv4, TCP
/// established or UDP, with a mark under `mask` (a peer opened them: the data plane marks
/// those), translated, with their ports unchanged (the prefix maps keep ports; a connection
/// whose port a clash changed is left out). Lines it does not understand are skipped.
pub fn parse(table: &str, mask: u32) -> Vec<Flow> {
    table.lines().filter_map(|l| parse_line(l, mask)).collect()
}

fn parse_line(line: &str, mask: u32) -> Option<Flow> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    if fields.first() != Some(&"ipv4") {
        return None;
    }
    let proto = match *fields.get(2)? {
        "tcp" => Proto::Tcp,
        "udp" => Proto::Udp,
        _ => return None,
    };
    if proto == Proto::Tcp && fields.get(5) != Some(&"ESTABLISHED") {
        return None;
    }
    let mut addrs: Vec<Ipv4Addr> = Vec::new();
    let mut ports: Vec<u16> = Vec::new();
    let (mut mark, mut zone) = (0u32, 0u16);
    for field in &fields {
        let Some((key, value)) = field.split_once('=') else {
            continue;
        };
        match key {
            "src" | "dst" => addrs.push(value.parse().ok()?),
            "sport" | "dport" => ports.push(value.parse().ok()?),
            "mark" => mark = value.parse().ok()?,
            "zone" => zone = value.parse().ok()?,
            _ => {}
        }
    }
    let [src, dst, reply_src, reply_dst] = addrs[..] else {
        return None;
    };
    let [sport, dport, reply_sport, reply_dport] = ports[..] else {
        return None;
    };
    let translated = reply_src != dst || reply_dst != src;
    let ports_kept = reply_sport == dport && reply_dport == sport;
    (mark & mask != 0 && translated && ports_kept).then_some(Flow {
        proto,
        zone,
        mark,
        src,
        dst,
        sport,
        dport,
        new_src: reply_dst,
        new_dst: reply_src,
    })
}

/// One part of a set, as sent and received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub replica: String,
    pub epoch: u64,
    pub sent_nanos: i64,
    pub set: u32,
    pub part: u16,
    pub parts: u16,
    pub flows: Vec<Flow>,
}

/// The datagrams of set number `set` holding `flows` (at least one, so an empty set is told
/// too), each tagged with `key`.
pub fn encode(
    replica: &str,
    epoch: u64,
    set: u32,
    sent_nanos: i64,
    flows: &[Flow],
    key: &hmac::Key,
) -> Vec<Vec<u8>> {
    let chunks: Vec<&[Flow]> = if flows.is_empty() {
        vec![&[]]
    } else {
        flows
            .chunks(PER_PART)
            .take(usize::from(MAX_PARTS))
            .collect()
    };
    let parts = u16::try_from(chunks.len()).unwrap_or(MAX_PARTS);
    let id = replica.as_bytes();
    let id = id.get(..MAX_ID).unwrap_or(id);
    chunks
        .iter()
        .zip(0u16..)
        .map(|(chunk, part)| {
            let mut out = Vec::with_capacity(MAX_LEN);
            out.extend_from_slice(MAGIC);
            out.push(VERSION);
            out.push(u8::try_from(id.len()).unwrap_or(0));
            out.extend_from_slice(id);
            out.extend_from_slice(&epoch.to_be_bytes());
            out.extend_from_slice(&sent_nanos.to_be_bytes());
            out.extend_from_slice(&set.to_be_bytes());
            out.extend_from_slice(&part.to_be_bytes());
            out.extend_from_slice(&parts.to_be_bytes());
            out.extend_from_slice(&u16::try_from(chunk.len()).unwrap_or(0).to_be_bytes());
            for flow in *chunk {
                flow.encode(&mut out);
            }
            let tag = hmac::sign(key, &out);
            out.extend_from_slice(tag.as_ref());
            out
        })
        .collect()
}

/// Parses and authenticates one handoff datagram. Never panics on any input.
pub fn decode(datagram: &[u8], key: &hmac::Key) -> Result<Part, Refusal> {
    if datagram.len() < 4 + 2 + 8 + 8 + 10 + TAG || datagram.len() > MAX_LEN {
        return Err(Refusal::Malformed);
    }
    let (body, tag) = datagram.split_at(datagram.len() - TAG);
    let (magic, rest) = body.split_at(4);
    let [version, id_len, rest @ ..] = rest else {
        return Err(Refusal::Malformed);
    };
    if magic != MAGIC || *version != VERSION || rest.len() < usize::from(*id_len) + 26 {
        return Err(Refusal::Malformed);
    }
    hmac::verify(key, body, tag).map_err(|_| Refusal::Tag)?;
    let (id, rest) = rest.split_at(usize::from(*id_len));
    let replica = std::str::from_utf8(id).map_err(|_| Refusal::Malformed)?;
    if trellis_api::ident::dns_label("replica", replica).is_err() {
        return Err(Refusal::Malformed);
    }
    let (header, entries) = rest.split_at(26);
    let be = |from: usize, len: usize| -> Result<&[u8], Refusal> {
        header.get(from..from + len).ok_or(Refusal::Malformed)
    };
    let epoch = u64::from_be_bytes(be(0, 8)?.try_into().map_err(|_| Refusal::Malformed)?);
    let sent_nanos = i64::from_be_bytes(be(8, 8)?.try_into().map_err(|_| Refusal::Malformed)?);
    let set = u32::from_be_bytes(be(16, 4)?.try_into().map_err(|_| Refusal::Malformed)?);
    let part = u16::from_be_bytes(be(20, 2)?.try_into().map_err(|_| Refusal::Malformed)?);
    let parts = u16::from_be_bytes(be(22, 2)?.try_into().map_err(|_| Refusal::Malformed)?);
    let count = u16::from_be_bytes(be(24, 2)?.try_into().map_err(|_| Refusal::Malformed)?);
    if parts == 0
        || parts > MAX_PARTS
        || part >= parts
        || usize::from(count) > PER_PART
        || entries.len() != usize::from(count) * ENTRY
    {
        return Err(Refusal::Malformed);
    }
    let flows = entries
        .chunks(ENTRY)
        .map(Flow::decode)
        .collect::<Option<Vec<Flow>>>()
        .ok_or(Refusal::Malformed)?;
    Ok(Part {
        replica: replica.to_owned(),
        epoch,
        sent_nanos,
        set,
        part,
        parts,
        flows,
    })
}

/// Whether a part sent at `sent` may be taken at `now`: near our clock (a recorded set
/// replayed later is refused).
pub fn fresh(sent: i64, now: i64) -> bool {
    (sent - now).abs() <= MAX_SKEW_NANOS
}

/// Collects the parts of one set at a time: a part of a newer set (or another sender's)
/// starts over, and a set is handed out once every part of it is in.
#[derive(Debug, Default)]
pub struct Assembler {
    current: Option<(String, u32)>,
    parts: BTreeMap<u16, Vec<Flow>>,
    expected: u16,
}

impl Assembler {
    /// Takes `part`; the whole set once it is complete.
    pub fn take(&mut self, part: Part) -> Option<BTreeSet<Flow>> {
        let id = (part.replica.clone(), part.set);
        if self.current.as_ref() != Some(&id) {
            self.current = Some(id);
            self.parts.clear();
            self.expected = part.parts;
        }
        if part.parts != self.expected {
            return None;
        }
        self.parts.insert(part.part, part.flows);
        if self.parts.len() < usize::from(self.expected) {
            return None;
        }
        let set = std::mem::take(&mut self.parts)
            .into_values()
            .flatten()
            .collect();
        self.current = None;
        Some(set)
    }
}

/// What a standby must do to hold `wanted` when it holds `held`: insert, then delete.
pub fn diff(held: &BTreeSet<Flow>, wanted: &BTreeSet<Flow>) -> (Vec<Flow>, Vec<Flow>) {
    (
        wanted.difference(held).copied().collect(),
        held.difference(wanted).copied().collect(),
    )
}

/// Whether `conntrack -I` failed only because the connection is tracked already: this replica
/// was the active (its node keeps its entries across a restart) or saw a packet of it. The
/// tool says so in words that changed between versions.
pub fn already_tracked(error: &str) -> bool {
    error.contains("File exists") || error.contains("Such conntrack exists")
}

#[cfg(test)]
mod tests {
    use super::*;

    const MASK: u32 = 0xffff_0000;

    #[test]
    fn an_entry_tracked_already_is_held_not_an_error() {
        // conntrack-tools 1.4.7, as logged by a standby restarted on the old active's node.
        assert!(already_tracked(
            "conntrack -I -p tcp ... failed (exit status: 1): conntrack v1.4.7 \
             (conntrack-tools): Operation failed: Such conntrack exists, try -U to update"
        ));
        assert!(already_tracked("Operation failed: File exists"));
        assert!(!already_tracked(
            "conntrack v1.4.7 (conntrack-tools): Operation failed: invalid parameters"
        ));
    }

    const TABLE: &str = "\
ipv4     2 tcp      6 431999 ESTABLISHED src=10.0.0.10 dst=10.83.0.10 sport=40000 dport=5000 src=10.0.0.10 dst=10.81.0.10 sport=5000 dport=40000 [ASSURED] mark=3398500352 zone=51841 use=2
ipv4     2 tcp      6 431999 ESTABLISHED src=10.0.0.11 dst=10.83.0.10 sport=40001 dport=5000 src=10.0.0.10 dst=10.81.0.11 sport=5000 dport=40001 [ASSURED] mark=0 zone=51841 use=2
ipv4     2 tcp      6 118 TIME_WAIT src=10.0.0.12 dst=10.83.0.10 sport=40002 dport=5000 src=10.0.0.10 dst=10.81.0.12 sport=5000 dport=40002 [ASSURED] mark=3398500352 zone=51841 use=2
ipv4     2 udp      17 29 src=10.0.0.13 dst=10.83.0.10 sport=7000 dport=7001 src=10.0.0.10 dst=10.81.0.13 sport=7001 dport=7000 mark=3398500352 use=1
ipv4     2 udp      17 29 src=10.81.0.5 dst=10.0.0.10 sport=7000 dport=7001 [UNREPLIED] src=10.0.0.10 dst=10.81.0.5 sport=7001 dport=7000 mark=3398500352 zone=3 use=1
ipv4     2 tcp      6 431999 ESTABLISHED src=10.0.0.14 dst=10.83.0.10 sport=40003 dport=5000 src=10.0.0.10 dst=10.81.0.14 sport=5000 dport=1024 [ASSURED] mark=3398500352 zone=51841 use=2
ipv4     2 icmp     1 29 src=10.0.0.15 dst=10.83.0.10 type=8 code=0 id=1 src=10.0.0.10 dst=10.81.0.15 type=0 code=0 id=1 mark=3398500352 use=1
ipv6     10 tcp      6 431999 ESTABLISHED src=fd00::1 dst=fd00::2 sport=1 dport=2 src=fd00::2 dst=fd00::1 sport=2 dport=1 mark=3398500352 use=2
garbage line src=1.2.3.4
";

    fn flow(n: u8) -> Flow {
        Flow {
            proto: if n.is_multiple_of(2) {
                Proto::Tcp
            } else {
                Proto::Udp
            },
            zone: u16::from(n),
            mark: 0xca81_0000,
            src: Ipv4Addr::new(10, 0, 0, n),
            dst: Ipv4Addr::new(10, 83, 0, 10),
            sport: 40_000 + u16::from(n),
            dport: 5000,
            new_src: Ipv4Addr::new(10, 81, 0, n),
            new_dst: Ipv4Addr::new(10, 0, 0, 10),
        }
    }

    #[test]
    fn only_translated_marked_established_or_udp_connections_with_their_ports_are_handed_off() {
        let flows = parse(TABLE, MASK);
        assert_eq!(
            flows,
            vec![
                Flow {
                    proto: Proto::Tcp,
                    zone: 51841,
                    mark: 3_398_500_352,
                    src: "10.0.0.10".parse().expect("ip"),
                    dst: "10.83.0.10".parse().expect("ip"),
                    sport: 40000,
                    dport: 5000,
                    new_src: "10.81.0.10".parse().expect("ip"),
                    new_dst: "10.0.0.10".parse().expect("ip"),
                },
                Flow {
                    proto: Proto::Udp,
                    zone: 0,
                    mark: 3_398_500_352,
                    src: "10.0.0.13".parse().expect("ip"),
                    dst: "10.83.0.10".parse().expect("ip"),
                    sport: 7000,
                    dport: 7001,
                    new_src: "10.81.0.13".parse().expect("ip"),
                    new_dst: "10.0.0.10".parse().expect("ip"),
                },
            ],
            "unmarked, closing, untranslated, port-changed, ICMP, IPv6 and garbage are left out"
        );
    }

    #[test]
    fn the_conntrack_arguments_carry_zone_mark_state_and_both_translations() {
        let f = parse(TABLE, MASK)[0];
        assert_eq!(
            f.insert_args().join(" "),
            "-I -p tcp -s 10.0.0.10 -d 10.83.0.10 --sport 40000 --dport 5000 -w 51841 \
             --mark 3398500352 --state ESTABLISHED -t 86400 --src-nat 10.81.0.10 \
             --dst-nat 10.0.0.10"
        );
        assert_eq!(
            f.delete_args().join(" "),
            "-D -p tcp -s 10.0.0.10 -d 10.83.0.10 --sport 40000 --dport 5000 -w 51841"
        );
    }

    #[test]
    fn a_set_in_many_parts_round_trips_under_the_same_key_only() {
        let key = super::super::heartbeat::key(&[1; 32]);
        let flows: Vec<Flow> = (0..=100).map(flow).collect();
        let datagrams = encode("gw-a", 3, 9, 1_000, &flows, &key);
        assert_eq!(datagrams.len(), 3);
        let mut assembler = Assembler::default();
        let mut whole = None;
        for (i, d) in datagrams.iter().enumerate() {
            assert!(
                d.len() <= MAX_LEN && d.len() < 1280,
                "part {i}: {}",
                d.len()
            );
            let part = decode(d, &key).expect("an authentic part");
            assert_eq!(
                (part.replica.as_str(), part.epoch, part.set),
                ("gw-a", 3, 9)
            );
            whole = assembler.take(part);
            assert_eq!(whole.is_some(), i == datagrams.len() - 1);
        }
        assert_eq!(whole, Some(flows.iter().copied().collect()));
        let other = super::super::heartbeat::key(&[2; 32]);
        assert_eq!(decode(&datagrams[0], &other), Err(Refusal::Tag));
        let empty = encode("gw-a", 3, 10, 1_000, &[], &key);
        assert_eq!(empty.len(), 1, "an empty set is told too");
        let part = decode(&empty[0], &key).expect("empty part");
        assert_eq!(assembler.take(part), Some(BTreeSet::new()));
    }

    #[test]
    fn a_newer_set_starts_over_and_an_incomplete_one_is_never_applied() {
        let key = super::super::heartbeat::key(&[1; 32]);
        let flows: Vec<Flow> = (0..60).map(flow).collect();
        let old = encode("gw-a", 1, 1, 0, &flows, &key);
        let new = encode("gw-a", 1, 2, 0, &flows[..10], &key);
        let mut assembler = Assembler::default();
        assert_eq!(assembler.take(decode(&old[0], &key).expect("part")), None);
        let applied = assembler.take(decode(&new[0], &key).expect("part"));
        assert_eq!(applied, Some(flows[..10].iter().copied().collect()));
        assert_eq!(
            assembler.take(decode(&old[1], &key).expect("part")),
            None,
            "the rest of the old set alone is not a set"
        );
    }

    #[test]
    fn changed_truncated_and_oversized_datagrams_are_refused_not_a_panic() {
        let key = super::super::heartbeat::key(&[1; 32]);
        let d = encode("gw-a", 1, 1, 0, &[flow(1), flow(2)], &key).remove(0);
        for i in 0..d.len() {
            let mut bad = d.clone();
            if let Some(b) = bad.get_mut(i) {
                *b ^= 0x01;
            }
            assert!(decode(&bad, &key).is_err(), "byte {i} flipped was accepted");
        }
        for len in 0..d.len() {
            assert!(decode(d.get(..len).unwrap_or_default(), &key).is_err());
        }
        let mut long = d.clone();
        long.extend_from_slice(&[0; MAX_LEN]);
        assert_eq!(decode(&long, &key), Err(Refusal::Malformed));
    }

    #[test]
    fn a_standby_inserts_what_is_new_and_deletes_what_the_active_no_longer_tracks() {
        let held: BTreeSet<Flow> = [flow(1), flow(2)].into();
        let wanted: BTreeSet<Flow> = [flow(2), flow(3)].into();
        assert_eq!(diff(&held, &wanted), (vec![flow(3)], vec![flow(1)]));
        assert!(fresh(10, 10 + MAX_SKEW_NANOS));
        assert!(!fresh(10, 11 + MAX_SKEW_NANOS));
    }
}
