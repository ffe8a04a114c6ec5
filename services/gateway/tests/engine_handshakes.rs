//! A peer that drops the engine's first handshake gets it again within a tick and a new one
//! every second, not after WireGuard's own 5 s retry: a hub drops a new leaf's initiation until it has added the leaf,
//! and a hub cannot initiate to a leaf behind a NAT, so how soon the leaf tries again is how
//! soon the leaf and all its induced pairs come up. Real datagrams in a network namespace
//! (root only; skipped loudly elsewhere, never in CI).

mod common;

use std::time::{Duration, Instant};

use common::{Peer, setup};
use trellis_netlab::netns::can_run;

/// How long the peer plays a hub that does not know the engine yet: it reads and drops.
const DEAF_FOR: Duration = Duration::from_millis(2500);

#[test]
fn an_unanswered_first_handshake_is_retried_within_seconds_until_the_peer_answers() {
    if !can_run(
        "an_unanswered_first_handshake_is_retried_within_seconds_until_the_peer_answers",
        &[],
    ) {
        return;
    }
    let s = setup("hs");
    let mut hub = Peer::add(&s, "ths0");
    let added = Instant::now();

    // The engine's initiations (message type 1) the deaf peer sees, and when.
    let mut initiations = Vec::new();
    let mut distinct = std::collections::BTreeSet::new();
    let mut buf = vec![0u8; 65536];
    while added.elapsed() < DEAF_FOR {
        if let Ok((n, _)) = hub.socket.recv_from(&mut buf)
            && n >= 4
            && buf[0] == 1
        {
            initiations.push(added.elapsed());
            distinct.insert(buf[..n].to_vec());
        }
    }
    eprintln!(
        "initiations while the peer dropped them: {} ({} distinct): {initiations:?}",
        initiations.len(),
        distinct.len()
    );
    // Between new initiations (one a second), the one in flight goes again every tick: the
    // same bytes, so an answer slower than a tick still completes its handshake.
    assert!(
        initiations.len() > distinct.len(),
        "no initiation was sent again between two new ones"
    );
    assert!(
        initiations.len() >= 2,
        "the engine tried {} time(s) in {DEAF_FOR:?}: a peer that missed the first initiation \
         waits for WireGuard's 5 s retry",
        initiations.len()
    );
    let second = initiations[1];
    assert!(
        second < Duration::from_secs(1),
        "the second initiation came {second:?} after the peer was added"
    );

    // The peer now knows the engine: the next copy of the initiation completes the handshake.
    let listening = Instant::now();
    assert!(
        hub.handshake(s.engine_addr, Duration::from_secs(4)),
        "no handshake within 4 s of the peer starting to answer"
    );
    eprintln!(
        "handshake complete {:?} after the peer started answering",
        listening.elapsed()
    );

    // Heard from: no more probing initiations (WireGuard's own timers rekey after 120 s).
    let quiet = Instant::now();
    let mut more = 0;
    while quiet.elapsed() < Duration::from_millis(2500) {
        if let Ok((n, _)) = hub.socket.recv_from(&mut buf)
            && n >= 4
            && buf[0] == 1
        {
            more += 1;
        }
    }
    assert_eq!(
        more, 0,
        "the engine kept initiating to a peer that had answered"
    );
}
