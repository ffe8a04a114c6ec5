//! The engine's TUN offloads (ADR 0030) with real traffic between two namespaces, each with an
//! engine whose one peer is the other (root only; skipped loudly elsewhere, never in CI).
//!
//! Over the tunnel, in both directions where it matters: TCP over IPv4 and IPv6 (the kernel
//! hands the engine TSO super-packets, which it splits; the receiving engine coalesces them
//! again), UDP datagrams of every size up to the largest (those over the tunnel's MTU leave
//! the sender as IP fragments), UDP sent with segmentation offload (a USO super-packet), and
//! ICMP echoes, plain, fragmented and with IPv4 options. Every byte is checked, and so is
//! every checksum: the receiving kernels count a bad TCP, UDP or ICMP checksum and a failed
//! reassembly, and those counters must stay at zero. The interfaces' own packet counters show
//! that super-packets were really read and written. The same traffic must cross the engines
//! with the offloads turned off ([`Options::tun_offload`]), packet by packet. What the kernel
//! answers while the engine writes into a TUN (an echo reply) leaves from the receiving thread
//! without waking the TUN thread.

use std::io::{Read as _, Write as _};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use trellis_gateway::dataplane::engine::translate::{Rewrite, Translation};
use trellis_gateway::dataplane::engine::{BUSY_POLL_US, Engine, Options, PeerConfig};
use trellis_gateway::keys::KeyPair;
use trellis_netlab::netns::{Namespaces, can_run, exec, in_netns, ip};

const UNDERLAY: [&str; 2] = ["192.168.78.1", "192.168.78.2"];
const INNER: [&str; 2] = ["10.98.0.1", "10.98.0.2"];
const INNER6: [&str; 2] = ["fd98::1", "fd98::2"];
const MTU: usize = 1420;
const DEADLINE: Duration = Duration::from_secs(30);

/// Two namespaces joined by a veth pair, an engine in each with the other as its peer.
struct Pair {
    _namespaces: Namespaces,
    ns: [String; 2],
    dev: [String; 2],
    engines: Vec<Arc<Engine>>,
}

/// Both sides' one address when they translate (the same on both: their real ranges overlap),
/// and how each side addresses the other: side 0 reaches side 1 at `VIEWS[1]`, side 1 sees side
/// 0 at `VIEWS[0]`.
const REAL: &str = "10.98.0.1";
const VIEWS: [&str; 2] = ["10.81.0.1", "10.83.0.1"];

/// What side `i` of a translating pair rewrites on its way out: its real range to how the
/// other side addresses it, the other side's range as it addresses it to the real one.
fn translation(i: usize) -> Translation {
    let net = |s: &str| format!("{s}/24").parse::<ipnet::Ipv4Net>().expect("net");
    let rewrite = |from: &str, to: &str| Rewrite::new(net(from), net(to)).expect("same length");
    Translation {
        source: vec![rewrite(REAL, VIEWS[i])],
        destination: vec![rewrite(VIEWS[1 - i], REAL)],
    }
}

impl Pair {
    fn up(tag: &str, options: Options) -> Self {
        Self::build(tag, options, false)
    }

    /// A pair whose engines translate what they send (ADR 0032's stateless wire convention):
    /// both sides have the same address, [`REAL`], and nothing in either kernel translates.
    fn translated(tag: &str, options: Options) -> Self {
        Self::build(tag, options, true)
    }

    fn build(tag: &str, options: Options, translated: bool) -> Self {
        let pid = std::process::id();
        let ns = [0, 1].map(|i| format!("eo{tag}{i}{pid}"));
        let dev = [0, 1].map(|i| format!("eot{tag}{i}"));
        let mut namespaces = Namespaces::default();
        for n in &ns {
            namespaces.add(n).expect("namespace");
            ip(&["-n", n, "link", "set", "lo", "up"]).expect("lo up");
        }
        let veth = [format!("eov{tag}a"), format!("eov{tag}b")];
        ip(&[
            "link", "add", &veth[0], "netns", &ns[0], "type", "veth", "peer", &veth[1], "netns",
            &ns[1],
        ])
        .expect("veth");
        for i in 0..2 {
            let addr = format!("{}/24", UNDERLAY[i]);
            ip(&["-n", &ns[i], "addr", "add", &addr, "dev", &veth[i]]).expect("underlay address");
            ip(&["-n", &ns[i], "link", "set", &veth[i], "up"]).expect("veth up");
        }
        let keys = [KeyPair::generate(), KeyPair::generate()];
        let mut engines = Vec::new();
        for i in 0..2 {
            let private = keys[i].private_bytes();
            let config = PeerConfig {
                public_key: *keys[1 - i].public().as_bytes(),
                endpoint: format!("{}:51820", UNDERLAY[1 - i])
                    .parse()
                    .expect("endpoint"),
                allowed_ips: if translated {
                    // What arrives comes from the other side as this side addresses it.
                    vec![format!("{}/24", VIEWS[1 - i]).parse().expect("net")]
                } else {
                    vec![
                        format!("{}/32", INNER[1 - i]).parse().expect("net"),
                        format!("{}/128", INNER6[1 - i]).parse().expect("net"),
                    ]
                },
                keepalive: 0,
                candidates: Vec::new(),
                relay_via: None,
                relayable: false,
                translation: translated.then(|| translation(i)),
            };
            let name = dev[i].clone();
            let engine = in_netns(&ns[i], move || {
                let engine = Engine::start_with(51820, private, options)?;
                engine.add_peer(&name, &config)?;
                Ok::<_, std::io::Error>(Arc::new(engine))
            })
            .expect("engine");
            engines.push(engine);
            if translated {
                let real = format!("{REAL}/32");
                ip(&["-n", &ns[i], "addr", "add", &real, "dev", &dev[i]]).expect("real address");
            } else {
                let (v4, v6) = (format!("{}/24", INNER[i]), format!("{}/64", INNER6[i]));
                ip(&["-n", &ns[i], "addr", "add", &v4, "dev", &dev[i]]).expect("inner address");
                ip(&["-n", &ns[i], "addr", "add", &v6, "dev", &dev[i], "nodad"]).expect("inner v6");
            }
            ip(&[
                "-n",
                &ns[i],
                "link",
                "set",
                &dev[i],
                "mtu",
                &MTU.to_string(),
                "up",
            ])
            .expect("tunnel up");
            if translated {
                let view = format!("{}/24", VIEWS[1 - i])
                    .parse::<ipnet::Ipv4Net>()
                    .expect("net")
                    .trunc()
                    .to_string();
                ip(&["-n", &ns[i], "route", "add", &view, "dev", &dev[i]]).expect("route");
            }
        }
        let pair = Self {
            _namespaces: namespaces,
            ns,
            dev,
            engines,
        };
        let until = Instant::now() + DEADLINE;
        let other = if translated { VIEWS[1] } else { INNER[1] };
        while !pair.ping(&["-c", "1", "-W", "1", other]) {
            assert!(Instant::now() < until, "no answer through the tunnel");
        }
        pair
    }

    fn ping(&self, args: &[&str]) -> bool {
        exec(&self.ns[0], "ping", args)
            .map(|o| o.status.success())
            .unwrap_or(false)
    }

    /// A counter of the tunnel interface of side `i` (`tx_packets`: what the kernel handed the
    /// engine; `rx_packets`: what the engine wrote).
    fn tun_counter(&self, i: usize, name: &str) -> u64 {
        let path = format!("/sys/class/net/{}/statistics/{name}", self.dev[i]);
        let out = exec(&self.ns[i], "cat", &[&path]).expect("cat");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{path} in {}: {out:?}", self.ns[i]))
    }

    /// The kernel's counters of side `i` that a bad checksum or a failed reassembly moves.
    fn error_counters(&self, i: usize) -> Vec<(String, u64)> {
        let mut found = Vec::new();
        let snmp = exec(&self.ns[i], "cat", &["/proc/net/snmp"]).expect("snmp");
        let snmp = String::from_utf8_lossy(&snmp.stdout).into_owned();
        let lines: Vec<&str> = snmp.lines().collect();
        for pair in lines.chunks(2) {
            let [names, values] = pair else { continue };
            let proto = names.split(':').next().unwrap_or_default();
            for (name, value) in names
                .split_whitespace()
                .zip(values.split_whitespace())
                .skip(1)
            {
                if matches!(
                    name,
                    "InCsumErrors" | "InHdrErrors" | "ReasmFails" | "InErrors"
                ) {
                    found.push((format!("{proto}.{name}"), value.parse().unwrap_or(u64::MAX)));
                }
            }
        }
        let snmp6 = exec(&self.ns[i], "cat", &["/proc/net/snmp6"]).expect("snmp6");
        for line in String::from_utf8_lossy(&snmp6.stdout).lines() {
            let mut words = line.split_whitespace();
            if let (Some(name), Some(value)) = (words.next(), words.next())
                && (name.ends_with("InCsumErrors")
                    || name.ends_with("InHdrErrors")
                    || name.ends_with("ReasmFails")
                    || name.ends_with("InErrors"))
            {
                found.push((name.to_owned(), value.parse().unwrap_or(u64::MAX)));
            }
        }
        found
    }
}

/// The byte at position `i` of a test stream: not periodic at any packet size.
fn byte(i: usize) -> u8 {
    (i as u32).wrapping_mul(2_654_435_761).rotate_right(13) as u8
}

/// Sends `len` bytes over TCP from side `from` to the other side at `to`; checks every byte.
/// Returns the address the receiver saw the connection come from.
fn tcp_send(pair: &Pair, from: usize, to: IpAddr, len: usize) -> IpAddr {
    let at = SocketAddr::new(to, 5201);
    // Any address of the receiver's: under translation `to` is only how the sender sees it.
    let any = SocketAddr::new(unspecified(to), 5201);
    let listener = in_netns(&pair.ns[1 - from], move || TcpListener::bind(any)).expect("listen");
    let server = std::thread::spawn(move || {
        let (mut conn, seen) = listener.accept().expect("accept");
        conn.set_read_timeout(Some(DEADLINE)).expect("timeout");
        let mut got = vec![0u8; len];
        conn.read_exact(&mut got)
            .expect("the receiver reads everything");
        (seen.ip(), (0..len).find(|&i| got[i] != byte(i)))
    });
    let mut conn = in_netns(&pair.ns[from], move || {
        TcpStream::connect_timeout(&at, DEADLINE)
    })
    .expect("connect through the tunnel");
    let sent: Vec<u8> = (0..len).map(byte).collect();
    conn.write_all(&sent).expect("the sender sends everything");
    let (seen, changed) = server.join().expect("receiver");
    assert_eq!(
        changed, None,
        "the first byte that changed on the way from side {from} to {to}"
    );
    seen
}

/// The unspecified address of `ip`'s family.
fn unspecified(ip: IpAddr) -> IpAddr {
    if ip.is_ipv4() {
        IpAddr::from([0u8; 4])
    } else {
        IpAddr::from([0u16; 8])
    }
}

/// UDP datagrams of `sizes` from side 0 to side 1 at `to`, echoed; every byte checked, and the
/// echo must come back from `to`. Returns the addresses side 1 saw them come from.
fn udp_echo(pair: &Pair, to: IpAddr, sizes: &[usize]) -> Vec<IpAddr> {
    let at = SocketAddr::new(to, 5301);
    let any = SocketAddr::new(unspecified(to), 5301);
    let server = in_netns(&pair.ns[1], move || UdpSocket::bind(any)).expect("bind");
    server
        .set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    let client = in_netns(&pair.ns[0], move || {
        UdpSocket::bind(SocketAddr::new(unspecified(to), 0))
    })
    .expect("bind");
    client
        .set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    let mut buf = vec![0u8; 65536];
    let mut seen = Vec::new();
    for &size in sizes {
        let datagram: Vec<u8> = (0..size).map(|i| byte(i + size)).collect();
        // A datagram (or one of its fragments) may be lost on a loaded machine; a few tries.
        let echoed = (0..5).any(|_| {
            client.send_to(&datagram, at).expect("send");
            let Ok((n, from)) = server.recv_from(&mut buf) else {
                return false;
            };
            assert_eq!(
                &buf[..n],
                &datagram[..],
                "a {size}-byte datagram changed on the way"
            );
            if !seen.contains(&from.ip()) {
                seen.push(from.ip());
            }
            server.send_to(&buf[..n], from).expect("echo");
            matches!(client.recv_from(&mut buf), Ok((n, back)) if buf[..n] == datagram[..] && back == at)
        });
        assert!(
            echoed,
            "a {size}-byte datagram to {to} never came back intact"
        );
    }
    seen
}

/// One UDP segmentation-offload send of `segments` datagrams of `segment` bytes from side 0
/// (the kernel hands the TUN a USO super-packet where it can); each must arrive intact.
fn udp_segmented(pair: &Pair, to: IpAddr, segment: usize, segments: usize) {
    let at = SocketAddr::new(to, 5302);
    let server = in_netns(&pair.ns[1], move || UdpSocket::bind(at)).expect("bind");
    server
        .set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    let client = in_netns(&pair.ns[0], || UdpSocket::bind("0.0.0.0:0")).expect("bind");
    let state = quinn_udp::UdpSocketState::new((&client).into()).expect("udp state");
    let contents: Vec<u8> = (0..segment * segments).map(byte).collect();
    let mut buf = vec![0u8; 65536];
    let mut arrived = vec![false; segments];
    for _ in 0..5 {
        let transmit = quinn_udp::Transmit {
            destination: at,
            ecn: None,
            contents: &contents,
            segment_size: Some(segment),
            src_ip: None,
        };
        state
            .try_send((&client).into(), &transmit)
            .expect("gso send");
        while let Ok((n, _)) = server.recv_from(&mut buf) {
            assert_eq!(n, segment, "a segment arrived with another size");
            let i = (0..segments)
                .find(|&i| contents[i * segment..(i + 1) * segment] == buf[..n])
                .expect("a segment arrived that was never sent");
            arrived[i] = true;
        }
        if arrived.iter().all(|a| *a) {
            return;
        }
    }
    panic!("segments of a UDP GSO send never arrived: {arrived:?}");
}

/// Everything this file sends, over `pair`; whether the TUNs carried super-packets, as the
/// interfaces counted them during the first IPv4 transfer: (packets the kernel handed side
/// 0's engine, packets side 1's engine wrote, the TCP segments of that transfer at least).
fn all_traffic(pair: &Pair) -> (u64, u64, u64) {
    let len = 8 << 20;
    let before = (
        pair.tun_counter(0, "tx_packets"),
        pair.tun_counter(1, "rx_packets"),
    );
    tcp_send(pair, 0, INNER[1].parse().expect("ip"), len);
    let read = pair.tun_counter(0, "tx_packets") - before.0;
    let written = pair.tun_counter(1, "rx_packets") - before.1;
    // IPv4 and TCP headers, and TCP's timestamps option.
    let segments = (len / (MTU - 20 - 20 - 12)) as u64;
    tcp_send(pair, 1, INNER[0].parse().expect("ip"), len);
    tcp_send(pair, 0, INNER6[1].parse().expect("ip"), 2 << 20);
    tcp_send(pair, 1, INNER6[0].parse().expect("ip"), 2 << 20);
    let sizes = [
        1, 100, 1000, 1372, 1373, 1392, 1393, 1500, 3000, 8972, 30_000, 65_507,
    ];
    udp_echo(pair, INNER[1].parse().expect("ip"), &sizes);
    udp_echo(
        pair,
        INNER6[1].parse().expect("ip"),
        &[1, 1232, 1400, 3000, 65_000],
    );
    udp_segmented(pair, INNER[1].parse().expect("ip"), 1200, 16);
    for args in [
        vec!["-c", "2", "-W", "2", INNER[1]],
        vec!["-c", "2", "-W", "2", "-s", "4000", INNER[1]],
        vec!["-c", "2", "-W", "2", "-s", "20000", INNER[1]],
        vec!["-c", "2", "-W", "2", "-R", INNER[1]],
        vec!["-c", "2", "-W", "2", "-6", INNER6[1]],
        vec!["-c", "2", "-W", "2", "-6", "-s", "5000", INNER6[1]],
    ] {
        assert!(pair.ping(&args), "ping {args:?} through the tunnel failed");
    }
    for i in 0..2 {
        let bad: Vec<_> = pair
            .error_counters(i)
            .into_iter()
            .filter(|(_, v)| *v != 0)
            .collect();
        assert!(bad.is_empty(), "side {i}'s kernel counted errors: {bad:?}");
    }
    (read, written, segments)
}

#[test]
fn every_kind_of_traffic_crosses_offloaded_tuns_intact_in_super_packets() {
    if !can_run(
        "every_kind_of_traffic_crosses_offloaded_tuns_intact_in_super_packets",
        &["ip", "ping"],
    ) {
        return;
    }
    // With busy polling on and no budget (ADR 0032): its threads' polling paths carry every
    // kind of traffic here too.
    let options = Options {
        busy_poll: Duration::from_micros(BUSY_POLL_US),
        busy_poll_budget_percent: 100,
        ..Options::default()
    };
    let pair = Pair::up("on", options);
    let (read, written, segments) = all_traffic(&pair);
    eprintln!(
        "measured: {segments} segments at least: {read} read from the tun, {written} written"
    );
    assert!(
        read * 2 < segments,
        "the kernel handed the engine {read} packets for {segments} segments: no super-packets"
    );
    assert!(
        written * 2 < segments,
        "the engine wrote {written} packets for {segments} segments: nothing coalesced"
    );
}

#[test]
fn without_offloads_the_same_traffic_crosses_packet_by_packet() {
    if !can_run(
        "without_offloads_the_same_traffic_crosses_packet_by_packet",
        &["ip", "ping"],
    ) {
        return;
    }
    let options = Options {
        tun_offload: false,
        ..Options::default()
    };
    let pair = Pair::up("off", options);
    let (read, written, segments) = all_traffic(&pair);
    eprintln!(
        "measured: {segments} segments at least: {read} read from the tun, {written} written"
    );
    assert!(
        read >= segments && written >= segments,
        "without offloads every segment is its own packet: {read} read, {written} written, {segments} segments"
    );
}

/// With busy polling on, side 0's TUN thread keeps polling after it sends an echo request,
/// and reads the socket too: the reply that comes back within its window is received there,
/// on a running vCPU, not after the receiving thread's wake-up. Off (the engine's default), it
/// never is.
#[test]
fn replies_within_the_polling_window_are_received_by_the_polling_tun_thread() {
    if !can_run(
        "replies_within_the_polling_window_are_received_by_the_polling_tun_thread",
        &["ip", "ping"],
    ) {
        return;
    }
    let echoes = |pair: &Pair| {
        let before = pair.engines[0].received_while_polling();
        assert!(
            pair.ping(&["-c", "20", "-i", "0.05", "-W", "1", INNER[1]]),
            "echoes through the tunnel went unanswered"
        );
        pair.engines[0].received_while_polling() - before
    };
    // A window far longer than a round trip, so a debug build on a loaded machine is inside it.
    let polling = Pair::up(
        "bp",
        Options {
            busy_poll: Duration::from_millis(20),
            busy_poll_budget_percent: 100,
            ..Options::default()
        },
    );
    let received = echoes(&polling);
    drop(polling);
    let idle = Pair::up("nb", Options::default());
    let received_idle = echoes(&idle);
    eprintln!(
        "measured: {received} of 20 echo replies received by the polling tun thread; \
         {received_idle} without busy polling"
    );
    // The receiving thread is woken for each reply too, and now and then it may get there first.
    assert!(
        received >= 5,
        "only {received} of 20 echo replies were received by the polling tun thread"
    );
    assert_eq!(
        received_idle, 0,
        "without busy polling the tun thread never receives"
    );
}

/// An echo request written into side 1's TUN is answered by side 1's kernel before the write
/// returns: the receiving thread sends the reply itself, where waking the TUN thread would cost
/// a wake-up on another vCPU (on a virtual machine, the dearest step of a round trip).
#[test]
fn replies_the_kernel_makes_at_once_leave_from_the_receiving_thread() {
    if !can_run(
        "replies_the_kernel_makes_at_once_leave_from_the_receiving_thread",
        &["ip", "ping"],
    ) {
        return;
    }
    let pair = Pair::up("rx", Options::default());
    let before = pair.engines[1].answered_at_once();
    assert!(
        pair.ping(&["-c", "20", "-i", "0.05", "-W", "1", INNER[1]]),
        "echoes through the tunnel went unanswered"
    );
    let answered = pair.engines[1].answered_at_once() - before;
    eprintln!("measured: {answered} of 20 echo replies sent by the receiving thread");
    // The TUN thread is woken for each reply too, and now and then it may take the lock first.
    assert!(
        answered >= 10,
        "only {answered} of 20 echo replies left from the receiving thread"
    );
}

/// Polling is capped by its budget: pings 50 ms apart through a 20 ms window keep each hot
/// thread polling most of the time without a cap, and with a 5 % budget side 0's threads poll
/// no longer than their saved-up second's share and 5 % of the time since the engine started.
#[test]
fn the_polling_budget_caps_the_time_the_threads_spend_polling() {
    if !can_run(
        "the_polling_budget_caps_the_time_the_threads_spend_polling",
        &["ip", "ping"],
    ) {
        return;
    }
    let polled = |tag: &str, budget_percent: u8| {
        let started = Instant::now();
        let pair = Pair::up(
            tag,
            Options {
                busy_poll: Duration::from_millis(20),
                busy_poll_budget_percent: budget_percent,
                ..Options::default()
            },
        );
        assert!(
            pair.ping(&["-c", "40", "-i", "0.05", "-W", "1", INNER[1]]),
            "echoes through the tunnel went unanswered"
        );
        (pair.engines[0].busy_polled(), started.elapsed())
    };
    let (uncapped, _) = polled("bu", 100);
    let (capped, elapsed) = polled("bc", 5);
    // Two hot threads, each with one second's share saved up and 5 % of the time since; a
    // slice that overran the share (a yield on a busy machine) is paid back, but the last one
    // of each thread may still be owed.
    let bound = 2 * (Duration::from_millis(50) + elapsed / 20) + Duration::from_millis(60);
    eprintln!(
        "measured: polled {uncapped:?} without a budget, {capped:?} with 5 % over {elapsed:?} \
         (bound {bound:?})"
    );
    assert!(
        uncapped > bound,
        "without a budget the threads polled only {uncapped:?}: the traffic does not test the cap"
    );
    assert!(
        capped <= bound,
        "with a 5 % budget the threads polled {capped:?} in {elapsed:?}"
    );
}

/// Writes `packet` behind the virtio-net header `hdr` (flags, gso type, header length, gso
/// size, checksum start, checksum offset) into side 0's tunnel interface from a packet socket
/// (`PACKET_VNET_HDR`): how a process with `CAP_NET_RAW` hands the kernel a super-packet of its
/// own making, which reaches the engine with that metadata. Whether the kernel took it.
fn inject(pair: &Pair, hdr: [u16; 6], packet: &[u8]) -> bool {
    let hex: String = packet.iter().map(|b| format!("{b:02x}")).collect();
    let script = format!(
        "import socket, struct\n\
         s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))\n\
         s.setsockopt(263, 15, 1)\n\
         h = struct.pack('=BBHHHH', {}, {}, {}, {}, {}, {})\n\
         s.sendto(h + bytes.fromhex('{hex}'), ('{}', 0x0800))\n",
        hdr[0], hdr[1], hdr[2], hdr[3], hdr[4], hdr[5], pair.dev[0]
    );
    exec(&pair.ns[0], "python3", &["-c", &script])
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// An IPv4 packet of `protocol` from side 0's inner address to side 1's with `payload` bytes
/// after a 20-byte transport header whose TCP data offset field says `data_offset` words (the
/// checksum left partial, as a super-packet's is).
fn ip4(protocol: u8, payload: usize, data_offset: u8) -> Vec<u8> {
    let total = 20 + 20 + payload;
    let mut p = vec![0u8; total];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    p[8] = 64;
    p[9] = protocol;
    let (src, dst): (std::net::Ipv4Addr, std::net::Ipv4Addr) =
        (INNER[0].parse().expect("ip"), INNER[1].parse().expect("ip"));
    p[12..16].copy_from_slice(&src.octets());
    p[16..20].copy_from_slice(&dst.octets());
    let sum: u32 = p[..20]
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    let sum = (sum & 0xffff) + (sum >> 16);
    p[10..12].copy_from_slice(&(!((sum & 0xffff) + (sum >> 16)) as u16).to_be_bytes());
    p[20..22].copy_from_slice(&40000u16.to_be_bytes());
    p[22..24].copy_from_slice(&5999u16.to_be_bytes());
    if protocol == 17 {
        p[24..26].copy_from_slice(&((total - 20) as u16).to_be_bytes());
    }
    p[32] = data_offset << 4;
    p[33] = 0x18;
    p
}

#[test]
fn super_packets_with_lying_virtio_headers_are_dropped_and_counted_and_traffic_goes_on() {
    let test =
        "super_packets_with_lying_virtio_headers_are_dropped_and_counted_and_traffic_goes_on";
    if !can_run(test, &["ip", "ping", "python3"]) {
        return;
    }
    let pair = Pair::up("bad", Options::default());
    let tun_read = || {
        pair.engines[0]
            .dropped()
            .into_iter()
            .find(|(reason, _)| reason.label() == "tun_read")
            .map_or(0, |(_, n)| n)
    };
    const NEEDS_CSUM: u16 = 1;
    const TCPV4: u16 = 1;
    const TCPV6: u16 = 4;
    // [flags, gso type, header length, gso size, checksum start, checksum offset]
    let lies: [(&str, [u16; 6], Vec<u8>); 7] = [
        (
            "a one-byte segment size: more segments than a read holds",
            [NEEDS_CSUM, TCPV4, 40, 1, 20, 16],
            ip4(6, 1000, 5),
        ),
        (
            "a TCP super-packet that is UDP",
            [NEEDS_CSUM, TCPV4, 40, 500, 20, 16],
            ip4(17, 1400, 5),
        ),
        (
            "a TCP header longer than the packet's headers",
            [NEEDS_CSUM, TCPV4, 40, 500, 20, 16],
            ip4(6, 1400, 15),
        ),
        (
            "a super-packet without a partial checksum",
            [0, TCPV4, 40, 500, 20, 16],
            ip4(6, 1400, 5),
        ),
        (
            "a checksum offset that is not TCP's",
            [NEEDS_CSUM, TCPV4, 40, 500, 20, 6],
            ip4(6, 1400, 5),
        ),
        (
            "a checksum start inside the IP header",
            [NEEDS_CSUM, TCPV4, 40, 500, 12, 16],
            ip4(6, 1400, 5),
        ),
        (
            "an IPv6 super-packet that is IPv4",
            [NEEDS_CSUM, TCPV6, 40, 500, 20, 16],
            ip4(6, 1400, 5),
        ),
    ];
    let mut counted = Vec::new();
    for (what, hdr, packet) in &lies {
        let before = tun_read();
        if !inject(&pair, *hdr, packet) {
            // The kernel refused it itself: it never reaches the engine.
            eprintln!("the kernel refused {what}");
            continue;
        }
        // Dropped and counted, or split into packets the peer's kernel judges: either way
        // no thread of the engine may stop, and the tunnel must go on carrying traffic.
        let until = Instant::now() + Duration::from_secs(1);
        while tun_read() == before && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        if tun_read() > before {
            counted.push(*what);
        } else {
            eprintln!("the engine split {what}");
        }
        assert!(
            pair.engines[0].stopped_threads().is_empty(),
            "{what} stopped an engine thread"
        );
        assert!(
            pair.ping(&["-c", "1", "-W", "2", INNER[1]]),
            "after {what}, the tunnel no longer carries a ping"
        );
    }
    eprintln!("measured: dropped and counted: {counted:?}");
    assert!(
        counted.contains(&lies[0].0),
        "a super-packet of more segments than a read holds was not dropped and counted"
    );
    tcp_send(&pair, 0, INNER[1].parse().expect("ip"), 1 << 20);
}

/// ADR 0032's stateless wire convention between two engines whose sides have the same address
/// and no rule in either kernel: each engine rewrites what it sends into the other side's
/// terms, so each side's sockets see the other at the address it uses for it. TCP in both
/// directions (super-packets split, then translated segment by segment), UDP echoes of every
/// size (fragments included), pings, and an ICMP error: a datagram to a closed port comes back
/// as "connection refused", which needs the packet the error quotes translated too. No kernel
/// counts a bad checksum.
#[test]
fn engines_that_translate_what_they_send_connect_two_sides_with_one_address() {
    if !can_run(
        "engines_that_translate_what_they_send_connect_two_sides_with_one_address",
        &["ip", "ping"],
    ) {
        return;
    }
    let pair = Pair::translated("tr", Options::default());
    let view = |i: usize| VIEWS[i].parse::<IpAddr>().expect("ip");
    for from in [0, 1] {
        let seen = tcp_send(&pair, from, view(1 - from), 4 << 20);
        assert_eq!(seen, view(from), "side {} saw side {from} as", 1 - from);
    }
    let sizes = [1, 1000, 1392, 1393, 3000, 30_000, 65_507];
    assert_eq!(udp_echo(&pair, view(1), &sizes), vec![view(0)]);
    for args in [
        vec!["-c", "2", "-W", "2", VIEWS[1]],
        vec!["-c", "2", "-W", "2", "-s", "4000", VIEWS[1]],
    ] {
        assert!(pair.ping(&args), "ping {args:?} through the tunnel failed");
    }

    // Nobody listens on side 1's port 5399: its kernel answers "port unreachable", quoting the
    // datagram as it arrived there; only with the quote translated back does side 0's kernel
    // match it to the socket and report the refusal.
    let closed = SocketAddr::new(view(1), 5399);
    let refused = in_netns(&pair.ns[0], move || {
        let socket = UdpSocket::bind("0.0.0.0:0")?;
        socket.connect(closed)?;
        socket.set_read_timeout(Some(Duration::from_millis(500)))?;
        let mut buf = [0u8; 16];
        for _ in 0..5 {
            socket.send(b"anyone?")?;
            match socket.recv(&mut buf) {
                Err(err) if err.kind() == std::io::ErrorKind::ConnectionRefused => return Ok(true),
                _ => {}
            }
        }
        Ok::<_, std::io::Error>(false)
    })
    .expect("udp");
    assert!(
        refused,
        "the port unreachable never reached the sending socket"
    );

    for i in 0..2 {
        let bad: Vec<_> = pair
            .error_counters(i)
            .into_iter()
            .filter(|(_, v)| *v != 0)
            .collect();
        assert!(bad.is_empty(), "side {i}'s kernel counted errors: {bad:?}");
    }
}
