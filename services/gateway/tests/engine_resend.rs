//! A leaf's engine moves a peer to the hub's relay without losing a datagram (ADR 0025), with
//! real datagrams in a network namespace (root only; skipped loudly elsewhere, never in CI).
//!
//! The engine is leaf A. Its peers are boringtun sessions driven by the test over real UDP
//! sockets: `hub`, and `c`, an induced peer relayed through `hub` when its direct path fails.
//! A socket in the namespace sends a numbered datagram into C's TUN every 10 ms; the test plays
//! C (answering directly while its path lives) and the hub (unwrapping what the engine relays
//! to C and handing it to C's session). Then C's direct path dies silently: C hears nothing
//! and says nothing. The engine must notice, move C to the relay, and resend through the hub
//! what the dead path swallowed, so C ends up with every number, whether C answers with data
//! of its own (a two-way stream) or only with WireGuard's handshakes (a one-way one).

mod common;

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use common::{Peer, Setup, dropped, setup};
use defguard_boringtun::noise::TunnResult;
use trellis_gateway::dataplane::engine::{ANSWER_WITHIN, ASK_EVERY, DropReason, SUSPECT_AFTER};
use trellis_netlab::netns::{can_run, in_netns, ip};

const EVERY: Duration = Duration::from_millis(10);

/// A relay header from the key `from` to the key `to` (tags: first 8 bytes).
fn wrap(from: &[u8; 32], to: &[u8; 32], datagram: &[u8]) -> Vec<u8> {
    let mut d = vec![0x80, 0, 0, 0];
    d.extend_from_slice(&from[..8]);
    d.extend_from_slice(&to[..8]);
    d.extend_from_slice(datagram);
    d
}

/// The hub at 127.0.0.`octet` and C, relayed through it, at the next address: both added to
/// the engine as `r{tag}h` and `r{tag}c` and through their handshakes.
fn hub_and_c(s: &Setup, tag: &str, octet: u8) -> (Peer, Peer) {
    let mut hub = Peer::add_at(
        s,
        &format!("r{tag}h"),
        Ipv4Addr::new(127, 0, 0, octet),
        false,
    );
    assert!(
        hub.handshake(s.engine_addr, common::DEADLINE),
        "no handshake with the hub"
    );
    let mut c = Peer::add_relayed(
        s,
        &format!("r{tag}c"),
        Ipv4Addr::new(127, 0, 0, octet + 1),
        false,
        Some(hub.public),
    );
    assert!(
        c.handshake(s.engine_addr, common::DEADLINE),
        "no handshake with C"
    );
    (hub, c)
}

/// The test's side of everything: C, the hub, and the numbered datagrams C received.
struct World {
    s: Setup,
    hub: Peer,
    c: Peer,
    c_index: u32,
    sender: UdpSocket,
    sent: u32,
    got: BTreeSet<u32>,
    /// Whether C's direct path lives: C reads and answers its socket.
    direct: bool,
    /// Whether C answers data with data of its own (a two-way stream); without, only
    /// WireGuard's own messages answer the engine (a one-way stream).
    answers: bool,
    /// Handshake initiations C received directly: the engine asking the path for an answer.
    questions: u32,
    /// How often a numbered datagram goes.
    every: Duration,
}

impl World {
    /// An engine with the hub at 127.0.0.`octet` and C at the next address, both through their
    /// handshakes, and a sender of numbered datagrams every `every` into C's TUN.
    fn new(tag: &str, octet: u8, every: Duration) -> Self {
        let s = setup(tag);
        let (hub, c) = hub_and_c(&s, tag, octet);
        let c_dev = c.dev.clone();
        for socket in [&hub.socket, &c.socket] {
            // Both are drained each round without waiting (a read timeout rounds up to the
            // kernel's tick, too slow for a burst).
            socket.set_nonblocking(true).expect("non-blocking");
            // The resend arrives as one burst (the engine's own socket asks for as much).
            socket2::SockRef::from(socket)
                .set_recv_buffer_size(4 << 20)
                .expect("receive buffer");
        }
        let ns = s.ns.clone();
        ip(&["-n", &ns, "route", "add", "10.201.0.0/24", "dev", &c_dev]).expect("route");
        ip(&["-n", &ns, "addr", "add", "10.202.0.1/32", "dev", "lo"]).expect("source address");
        let sender = in_netns(&ns, || UdpSocket::bind("10.202.0.1:0")).expect("sender");
        let c_index = c.index;
        Self {
            s,
            hub,
            c,
            c_index,
            sender,
            sent: 0,
            got: BTreeSet::new(),
            direct: true,
            answers: true,
            questions: 0,
            every,
        }
    }

    /// C's session takes `datagram` (from the engine, directly or unwrapped by the hub);
    /// `reply_via_hub` says which way C's answers go.
    fn c_takes(&mut self, datagram: &[u8], reply_via_hub: bool) {
        let mut out = vec![0u8; 65536];
        match self.c.tunn.decapsulate(None, datagram, &mut out) {
            TunnResult::WriteToTunnelV4(inner, _) => {
                if inner.len() >= 32 && inner[9] == 17 {
                    let n = u32::from_be_bytes(inner[28..32].try_into().expect("4 bytes"));
                    self.got.insert(n);
                }
                if !reply_via_hub && self.answers {
                    // C's own data: the engine hears C on the direct path.
                    self.c.send_data(self.s.engine_addr);
                }
            }
            TunnResult::WriteToNetwork(reply) => {
                let reply = reply.to_vec();
                if reply_via_hub {
                    let wrapped = wrap(&self.c.public, &self.s.engine_public, &reply);
                    self.hub
                        .socket
                        .send_to(&wrapped, self.s.engine_addr)
                        .expect("relay");
                } else {
                    self.c
                        .socket
                        .send_to(&reply, self.s.engine_addr)
                        .expect("reply");
                }
            }
            _ => {}
        }
    }

    /// Sends the next numbered datagram when due and serves both sockets for `for_`.
    fn run(&mut self, for_: Duration, sending: bool) {
        let until = Instant::now() + for_;
        let mut next = Instant::now();
        let mut buf = vec![0u8; 65536];
        let to: SocketAddr = (Ipv4Addr::new(10, 201, 0, 1), 9).into();
        while Instant::now() < until {
            if sending && Instant::now() >= next {
                let mut payload = self.sent.to_be_bytes().to_vec();
                payload.resize(100, 0);
                self.sender.send_to(&payload, to).expect("send");
                self.sent += 1;
                next += self.every;
            }
            let mut idle = true;
            while let Ok((n, _)) = self.c.socket.recv_from(&mut buf) {
                idle = false;
                if self.direct {
                    self.questions += u32::from(buf[0] == 1);
                    let datagram = buf[..n].to_vec();
                    self.c_takes(&datagram, false);
                }
            }
            if self.direct {
                let mut out = vec![0u8; 256];
                if let TunnResult::WriteToNetwork(p) = self.c.tunn.update_timers(&mut out) {
                    self.c.socket.send_to(p, self.s.engine_addr).expect("timer");
                }
            }
            while let Ok((n, _)) = self.hub.socket.recv_from(&mut buf) {
                idle = false;
                let datagram = buf[..n].to_vec();
                if datagram[0] == 0x80
                    && datagram.len() > 20
                    && datagram[12..20] == self.c.public[..8]
                {
                    self.c_takes(&datagram[20..], true);
                } else {
                    // The hub's own session with the engine.
                    let mut out = vec![0u8; 65536];
                    if let TunnResult::WriteToNetwork(reply) =
                        self.hub.tunn.decapsulate(None, &datagram, &mut out)
                    {
                        self.hub
                            .socket
                            .send_to(reply, self.s.engine_addr)
                            .expect("hub reply");
                    }
                }
            }
            if idle {
                std::thread::sleep(Duration::from_micros(500));
            }
        }
    }

    /// Kills C's direct path silently while numbers keep coming, waits (at most `limit`) for
    /// the engine to move C to the relay, then serves a while on the relay and the stragglers:
    /// how long the move took, and how many numbers had gone before the cut.
    fn cut(&mut self, limit: Duration) -> (Duration, u32) {
        self.direct = false;
        let cut_at = self.sent;
        let started = Instant::now();
        while !self.relayed() {
            assert!(started.elapsed() < limit, "C never moved to the relay");
            self.run(Duration::from_millis(50), true);
        }
        let switched_in = started.elapsed();
        self.run(Duration::from_secs(1), true);
        self.run(Duration::from_millis(500), false);
        (switched_in, cut_at)
    }

    /// Sends numbers C does not answer until the engine asks C's direct path for an answer.
    fn until_asked(&mut self) {
        let started = Instant::now();
        while self.questions == 0 {
            assert!(
                started.elapsed() < ASK_EVERY,
                "the engine never asked C's path about data C did not answer"
            );
            self.run(Duration::from_millis(20), true);
        }
    }

    /// The numbers sent that C never got.
    fn missing(&self) -> Vec<u32> {
        (0..self.sent).filter(|n| !self.got.contains(n)).collect()
    }

    fn relayed(&self) -> bool {
        self.s
            .engine
            .counters(self.c_index)
            .is_some_and(|c| c.relayed)
    }
}

#[test]
fn a_peer_whose_direct_path_dies_gets_every_datagram_through_the_hub() {
    let test = "a_peer_whose_direct_path_dies_gets_every_datagram_through_the_hub";
    if !can_run(test, &[]) {
        return;
    }
    let mut w = World::new("r", 21, EVERY);

    // The direct path lives: everything arrives directly, nothing is relayed.
    w.run(Duration::from_secs(1), true);
    assert!(!w.relayed(), "C is relayed while its direct path works");
    assert_eq!(
        w.got.len() as u32,
        w.sent,
        "numbers lost on a working direct path"
    );

    // A copy, through the hub, of what C already sent directly is dropped as a duplicate (what
    // a resend after a switch looks like at the receiver), and moves nothing.
    let datagram = w.c.seal_data();
    let duplicates = dropped(&w.s.engine, DropReason::RelayDuplicate);
    w.c.socket
        .send_to(&datagram, w.s.engine_addr)
        .expect("direct");
    std::thread::sleep(Duration::from_millis(50));
    let copy = wrap(&w.c.public, &w.s.engine_public, &datagram);
    w.hub.socket.send_to(&copy, w.s.engine_addr).expect("copy");
    w.run(Duration::from_millis(300), false);
    assert_eq!(
        dropped(&w.s.engine, DropReason::RelayDuplicate) - duplicates,
        1,
        "the copy is counted as a relay duplicate: {:?}",
        w.s.engine.dropped()
    );
    assert!(
        !w.relayed(),
        "a duplicate through the hub moved C to the relay"
    );

    // The direct path dies silently while numbers keep coming.
    let (switched_in, cut_at) = w.cut(Duration::from_secs(10));
    let missing = w.missing();
    let resent = w.s.engine.resent();
    eprintln!(
        "measured: relayed {switched_in:?} after the cut; {} sent ({} after the cut), {resent} resent through the hub, missing {missing:?}",
        w.sent,
        w.sent - cut_at
    );
    assert!(
        missing.is_empty(),
        "numbers lost switching to the relay: {missing:?}"
    );
    assert!(
        resent >= u64::from((w.sent - cut_at) / 2),
        "too little resent to cover the dead path: {resent}"
    );

    // C speaks through the hub from now on; an engine whose direct data to C was still being
    // answered would follow C onto the relay at once (its peer found the path dead first).
    assert!(
        w.relayed(),
        "C left the relay with its direct path still dead"
    );
}

#[test]
fn a_peer_heard_through_its_hub_is_followed_onto_the_relay_at_once() {
    let test = "a_peer_heard_through_its_hub_is_followed_onto_the_relay_at_once";
    if !can_run(test, &[]) {
        return;
    }
    let s: Setup = setup("f");
    let (hub, mut c) = hub_and_c(&s, "f", 31);
    let c_index = c.index;
    let relayed = |s: &Setup| s.engine.counters(c_index).is_some_and(|c| c.relayed);
    assert!(!relayed(&s), "C is relayed though heard directly");

    // C's data through the hub: the engine routes C through the hub from then on, without
    // waiting for its own timers to find the direct path dead.
    let mut out = vec![0u8; 256];
    let TunnResult::WriteToNetwork(keepalive) = c.tunn.encapsulate(&[], &mut out) else {
        panic!("C has no session");
    };
    let wrapped = wrap(&c.public, &s.engine_public, keepalive);
    hub.socket
        .send_to(&wrapped, s.engine_addr)
        .expect("relayed");
    let started = Instant::now();
    while !relayed(&s) {
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "the engine did not follow C onto the relay"
        );
        std::thread::sleep(Duration::from_millis(5));
    }

    // C heard directly again: the engine goes back to the direct path.
    c.send_data(s.engine_addr);
    let started = Instant::now();
    while relayed(&s) {
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "the engine stayed on the relay though C speaks directly"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A one-way stream is answered only by the handshakes that ask its path for an answer, at
/// most every `ASK_EVERY`: a path that dies right after one is noticed that much later, and
/// what went into it meanwhile is still resent through the hub.
#[test]
fn a_one_way_stream_whose_path_dies_right_after_a_question_loses_nothing() {
    let test = "a_one_way_stream_whose_path_dies_right_after_a_question_loses_nothing";
    if !can_run(test, &[]) {
        return;
    }
    // Slower than the other test's numbers: the dead path swallows several seconds of them,
    // which must fit the datagrams a peer keeps for a resend.
    let mut w = World::new("w", 51, Duration::from_millis(25));
    w.answers = false;
    w.until_asked();
    // C's answer to the question reaches the engine, and the path dies.
    w.run(Duration::from_millis(100), true);
    assert!(!w.relayed(), "C is relayed though it answered");
    let (switched_in, cut_at) = w.cut(ASK_EVERY + Duration::from_secs(5));
    let missing = w.missing();
    eprintln!(
        "measured: relayed {switched_in:?} after the cut; {} sent ({} after the cut), {} resent through the hub, missing {missing:?}",
        w.sent,
        w.sent - cut_at,
        w.s.engine.resent()
    );
    assert!(
        missing.is_empty(),
        "numbers lost switching to the relay {switched_in:?} after a question: {missing:?}"
    );
}

/// A question answered, then the peer's own data again: the path is known to carry both ways,
/// so when it dies soon after, the engine asks again as soon as data goes unanswered instead of
/// waiting out `ASK_EVERY` (which is for streams nothing but a handshake answers). A TCP
/// connection's last acknowledgement is such a question's usual cause: nothing answers it.
#[test]
fn a_path_that_dies_soon_after_a_question_is_left_as_fast_as_any_once_data_answered() {
    let test = "a_path_that_dies_soon_after_a_question_is_left_as_fast_as_any_once_data_answered";
    if !can_run(test, &[]) {
        return;
    }
    let mut w = World::new("a", 61, EVERY);
    w.answers = false;
    w.until_asked();
    // C answers the question, then data with data again; the path dies well within
    // ASK_EVERY of the question.
    w.answers = true;
    w.run(Duration::from_millis(600), true);
    assert!(!w.relayed(), "C is relayed though it answers");
    let (switched_in, _) = w.cut(ASK_EVERY + Duration::from_secs(5));
    let missing = w.missing();
    eprintln!("measured: relayed {switched_in:?} after the cut, missing {missing:?}");
    let bound = SUSPECT_AFTER + ANSWER_WITHIN + Duration::from_secs(1);
    assert!(
        switched_in < bound,
        "the engine took {switched_in:?} (over {bound:?}) to leave a path that died after a question"
    );
    assert!(missing.is_empty(), "numbers lost: {missing:?}");
}

/// Only data the engine sends makes the direct path owe an answer: a peer that talks to a TUN
/// which says nothing back is never asked with a handshake, however long it pauses. (The
/// receiving thread drains the TUN it just wrote, for the kernel's answers; an empty drain
/// once marked the path as owing one, so every pause over `SUSPECT_AFTER` after C's data
/// cost a handshake, and the next real question waited `ASK_EVERY` behind it: a path that
/// died then went unnoticed for longer than the resend covers.)
#[test]
fn a_peer_heard_with_nothing_to_answer_is_never_asked_for_an_answer() {
    let test = "a_peer_heard_with_nothing_to_answer_is_never_asked_for_an_answer";
    if !can_run(test, &[]) {
        return;
    }
    let s: Setup = setup("q");
    let (_hub, mut c) = hub_and_c(&s, "q", 41);
    let c_index = c.index;
    let received = |s: &Setup| s.engine.counters(c_index).map_or(0, |k| k.rx_bytes);
    let before = received(&s);

    // C's packets go to an address nobody has: the kernel drops them and answers nothing.
    let mut initiations = 0;
    let mut buf = vec![0u8; 65536];
    for _ in 0..4 {
        c.send_data(s.engine_addr);
        let until = Instant::now() + SUSPECT_AFTER + Duration::from_millis(400);
        while Instant::now() < until {
            if let Ok((n, _)) = c.socket.recv_from(&mut buf) {
                initiations += usize::from(n > 0 && buf[0] == 1);
            }
        }
    }
    assert!(
        received(&s) > before,
        "C's packets did not reach the engine"
    );
    assert_eq!(
        initiations, 0,
        "the engine asked C's direct path for an answer though it sent C nothing"
    );
}
