//! The hub's relay (ADR 0025) refuses what it must and holds a flood to its pair's rate, with
//! real datagrams in a network namespace (root only; skipped loudly elsewhere, never in CI).
//!
//! The engine is the hub. Its peers are boringtun sessions driven by the test over real UDP
//! sockets, each at its own 127/8 address: `one`, `two` and `three` are full peers it relays
//! for, `induced` one it does not (a peer that is not a full peer of the hub: a pair with it
//! was never introduced by this hub). Every peer completes a handshake first, so the hub knows
//! where each one is. A relayed datagram is built here from the wire format: type 0x80, three
//! zero bytes, the sender's and the receiver's key tags (first 8 bytes of the public key), then
//! whatever the sender wants delivered (the hub reads none of it).

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use common::{Peer, Setup, dropped, setup, socket};
use trellis_gateway::dataplane::engine::{DropReason, RelayPolicy};
use trellis_netlab::netns::can_run;

fn tag(key: &[u8; 32]) -> [u8; 8] {
    key[..8].try_into().expect("8 bytes")
}

fn relayed(from: &Peer, to: &[u8; 32], payload: &[u8]) -> Vec<u8> {
    let mut d = vec![0x80, 0, 0, 0];
    d.extend_from_slice(&tag(&from.public));
    d.extend_from_slice(&tag(to));
    d.extend_from_slice(payload);
    d
}

/// A peer with a completed handshake, so the hub has heard it where it is.
fn peer(s: &Setup, dev: &str, last_octet: u8, relayable: bool) -> Peer {
    let mut p = Peer::add_at(s, dev, Ipv4Addr::new(127, 0, 0, last_octet), relayable);
    assert!(
        p.handshake(s.engine_addr, common::DEADLINE),
        "{dev}: no handshake with the hub"
    );
    p
}

/// Everything `peer` receives within `window`, handshake chatter left out.
fn received(peer: &Peer, window: Duration) -> Vec<Vec<u8>> {
    let until = std::time::Instant::now() + window;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 2048];
    while std::time::Instant::now() < until {
        if let Ok((n, _)) = peer.socket.recv_from(&mut buf)
            && buf[0] == 0x80
        {
            got.push(buf[..n].to_vec());
        }
    }
    got
}

fn send(from: &Peer, datagram: &[u8], hub: SocketAddr) {
    from.socket.send_to(datagram, hub).expect("send");
}

#[test]
fn the_relay_forwards_only_introduced_pairs_from_where_they_are_and_holds_a_flood_to_its_rate() {
    let test = "the_relay_forwards_only_introduced_pairs_from_where_they_are_and_holds_a_flood_to_its_rate";
    if !can_run(test, &[]) {
        return;
    }
    let s = setup("y");
    let hub = s.engine_addr;
    let one = peer(&s, "rly1", 11, true);
    let two = peer(&s, "rly2", 12, true);
    let three = peer(&s, "rly3", 13, true);
    let induced = peer(&s, "rly4", 14, false);
    let quiet = Duration::from_millis(300);

    // A pair the hub introduced: delivered, unchanged.
    let datagram = relayed(&one, &two.public, b"sealed for two");
    send(&one, &datagram, hub);
    assert_eq!(
        received(&two, quiet),
        vec![datagram],
        "one -> two is relayed"
    );

    // Refused, and counted: to a peer that is no full peer of the hub, to a key the hub does
    // not know, from a peer that is not where the hub heard it, and everything with the relay
    // off. Nobody receives anything.
    let refused_before = dropped(&s.engine, DropReason::RelayRefused);
    send(&one, &relayed(&one, &induced.public, b"x"), hub);
    send(&one, &relayed(&one, &[9; 32], b"x"), hub);
    send(&induced, &relayed(&induced, &two.public, b"x"), hub);
    let forger = socket(&s.ns, Ipv4Addr::new(127, 0, 0, 99));
    forger
        .send_to(&relayed(&one, &two.public, b"forged"), hub)
        .expect("send");
    s.engine.set_relay_policy(RelayPolicy {
        enabled: false,
        ..RelayPolicy::default()
    });
    send(&one, &relayed(&one, &two.public, b"relay off"), hub);
    for p in [&two, &induced] {
        assert!(received(p, quiet).is_empty(), "a refused datagram arrived");
    }
    assert_eq!(
        dropped(&s.engine, DropReason::RelayRefused) - refused_before,
        5,
        "every refusal is counted"
    );

    // A flood from one to two, far over its pair's rate, while three sends to two: one's
    // datagrams beyond the burst are dropped and counted, three's all arrive.
    s.engine.set_relay_policy(RelayPolicy {
        enabled: true,
        rate: 100.0,
        burst: 20.0,
    });
    let limited_before = dropped(&s.engine, DropReason::RelayRateLimited);
    for i in 0..1000u32 {
        send(&one, &relayed(&one, &two.public, &i.to_be_bytes()), hub);
        if i % 100 == 0 {
            send(&three, &relayed(&three, &two.public, b"from three"), hub);
        }
    }
    let got = received(&two, Duration::from_millis(500));
    let from_three = got.iter().filter(|d| d.ends_with(b"from three")).count();
    let from_one = got.len() - from_three;
    assert_eq!(from_three, 10, "the other pair is untouched by the flood");
    assert!(
        from_one <= 40,
        "one's flood got through beyond its burst and rate: {from_one} of 1000"
    );
    assert!(
        dropped(&s.engine, DropReason::RelayRateLimited) - limited_before >= 900,
        "the flood's drops are counted: {:?}",
        s.engine.dropped()
    );
}
