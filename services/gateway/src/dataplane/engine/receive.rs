//! The receiving thread: datagrams from the socket (one per call, or batched with GRO),
//! demultiplexed to their peer by the WireGuard message itself, checked, decrypted by the
//! peer's session and written into its TUN. This is one direction's hot path: the loops, the
//! demultiplexer and the session call stay together here.

use std::io::{self, IoSliceMut};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd as _;
use std::sync::TryLockError;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use defguard_boringtun::noise::handshake::parse_handshake_anon;
use defguard_boringtun::noise::{Packet, TunnResult};
use nix::poll::{PollFd, PollFlags, PollTimeout};
use quinn_udp::{RecvMeta, UdpSocketState};

use super::drops::DropReason;
use super::handshakes::HANDSHAKE_RATE_LIMIT;
use super::resend::DATA;
use super::tun::{WRITE_BATCH, Writer};
use super::{BUF, Engine, RECV_TIMEOUT, Shared, relay};

impl Shared {
    /// One datagram from the socket. Handshake initiations and responses go to the handshake
    /// thread (dropped when its queue is full); data and cookie replies are handled here.
    pub(super) fn receive(&self, from: SocketAddr, datagram: &[u8], sink: &mut Sink) {
        if self.standby.load(Ordering::Relaxed) {
            return self.count(DropReason::Standby);
        }
        let handshake = match relay::parse(datagram) {
            // Relayed to us: its WireGuard message decides; relayed onwards: the hub forwards.
            Some((_, receiver, inner)) if receiver == self.tag => {
                matches!(inner.first(), Some(1 | 2))
            }
            Some(_) => false,
            None => matches!(datagram.first(), Some(1 | 2)),
        };
        if handshake {
            if self
                .handshake_queue
                .try_send((from, datagram.to_vec()))
                .is_err()
            {
                self.count(DropReason::RateLimited);
            }
            return;
        }
        self.handle(from, datagram, sink);
    }

    /// One datagram: a relayed one forwarded or unwrapped, then checked, given to its peer's
    /// session.
    pub(super) fn handle(&self, from: SocketAddr, datagram: &[u8], sink: &mut Sink) {
        if datagram.first() != Some(&relay::TYPE) {
            return self.handle_message(from, datagram, sink, None);
        }
        match relay::parse(datagram) {
            Some((sender, receiver, inner)) if receiver == self.tag => {
                self.handle_message(from, inner, sink, Some(sender));
            }
            Some((sender, receiver, _)) => self.forward(from, sender, receiver, datagram),
            None => self.count(DropReason::Malformed),
        }
    }

    /// One WireGuard message: check it, find its peer, let the peer's session handle it.
    /// `relayed` names the sender's tag when it came through a hub.
    fn handle_message(
        &self,
        from: SocketAddr,
        datagram: &[u8],
        sink: &mut Sink,
        relayed: Option<u64>,
    ) {
        let Sink { dst, writer } = sink;
        let handshake = matches!(datagram.first(), Some(1 | 2));
        let load = if handshake {
            self.handshakes.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            0
        };
        let packet = match self.limiter.verify_packet(Some(from.ip()), datagram, dst) {
            Ok(packet) => packet,
            Err(TunnResult::WriteToNetwork(cookie)) => {
                match relayed {
                    Some(sender) => {
                        self.send_wrapped(&relay::header(self.tag, sender), cookie, from);
                    }
                    None => self.send(cookie, from),
                }
                return;
            }
            Err(TunnResult::Err(err)) => return self.count(DropReason::of(&err)),
            Err(_) => return self.count(DropReason::Other),
        };
        // Under load, a source with a valid cookie still gets only its share of our
        // Diffie-Hellman work.
        if load > HANDSHAKE_RATE_LIMIT
            && !self
                .sources
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .allow(from.ip(), Instant::now())
        {
            return self.count(DropReason::RateLimited);
        }
        let cookie_reply = matches!(packet, Packet::PacketCookieReply(_));
        let peer = match &packet {
            Packet::HandshakeInit(init) => {
                match parse_handshake_anon(&self.secret, &self.public, init) {
                    Ok(half) => self.peer_by_key(&half.peer_static_public),
                    Err(_) => return self.count(DropReason::Decrypt),
                }
            }
            Packet::HandshakeResponse(p) => self.peer(p.receiver_idx >> 8),
            Packet::PacketCookieReply(p) => self.peer(p.receiver_idx >> 8),
            Packet::PacketData(p) => self.peer(p.receiver_idx >> 8),
        };
        let Some(peer) = peer else {
            return self.count(DropReason::UnknownPeer);
        };
        if let Some(sender) = relayed
            && !self.came_through_its_hub(&peer, sender, from)
        {
            return self.count(DropReason::RelayRefused);
        }
        // A peer we relay that is heard directly gets a keepalive back on that path, so that
        // it hears us directly too and both ends leave the relay (the route as the timer
        // thread last saw it: this runs for every datagram).
        let was_relayed = relayed.is_none() && peer.was_relayed.load(Ordering::Relaxed);
        // Answers go back the way the message came.
        let answer = |packet: &[u8]| {
            if relayed.is_none() || !self.send_through_hub(&peer, packet) {
                self.send(packet, from);
            }
        };
        let mut tunn = peer.tunn();
        let result = tunn.decapsulate(Some(from.ip()), datagram, dst);
        // Only an authenticated message moves the peer's endpoint (WireGuard's roaming): data, a
        // keepalive, a handshake this session completed. A cookie reply authenticates nobody,
        // and neither does anything answered with one.
        let authenticated = !cookie_reply
            && match &result {
                TunnResult::Err(_) => false,
                TunnResult::WriteToNetwork(reply) => reply.first() != Some(&3),
                _ => true,
            };
        match result {
            TunnResult::Done => {}
            TunnResult::Err(err) => {
                drop(tunn);
                let reason = match DropReason::of(&err) {
                    DropReason::Replay if relayed.is_some() => DropReason::RelayDuplicate,
                    reason => reason,
                };
                return self.count(reason);
            }
            TunnResult::WriteToNetwork(reply) => {
                answer(reply);
                // Packets queued while the session was being established go out now.
                let mut queued = [0u8; BUF];
                while let TunnResult::WriteToNetwork(packet) =
                    tunn.decapsulate(None, &[], &mut queued)
                {
                    answer(packet);
                }
            }
            TunnResult::WriteToTunnelV4(inner, source) => {
                drop(tunn);
                if !peer.allows(IpAddr::V4(source)) {
                    return self.count(DropReason::SourceNotAllowed);
                }
                writer.push(self, &peer, inner);
            }
            TunnResult::WriteToTunnelV6(inner, source) => {
                drop(tunn);
                if !peer.allows(IpAddr::V6(source)) {
                    return self.count(DropReason::SourceNotAllowed);
                }
                writer.push(self, &peer, inner);
            }
        }
        if !authenticated {
            return;
        }
        if relayed.is_some() {
            // The peer sends through the hub: it found its direct path dead, so we follow.
            peer.relayed_rx_ms.store(self.now_ms(), Ordering::Relaxed);
            return;
        }
        // The peer is where this came from. A read lock first: this runs for every datagram,
        // and the endpoint almost never changes.
        if peer.endpoint() != from {
            *peer.endpoint.write().unwrap_or_else(|e| e.into_inner()) = from;
        }
        peer.direct_rx_ms.store(self.now_ms(), Ordering::Relaxed);
        if peer.unanswered_ms.load(Ordering::Relaxed) != 0 {
            peer.unanswered_ms.store(0, Ordering::Relaxed);
        }
        if datagram.first() == Some(&DATA) && peer.asked_ms.load(Ordering::Relaxed) != 0 {
            // The peer's own data after a question: the path carries both ways, so the next
            // question need not wait out ASK_EVERY (that is for streams only a handshake
            // answers).
            peer.asked_ms.store(0, Ordering::Relaxed);
        }
        if !peer.confirmed.load(Ordering::Relaxed) {
            peer.confirmed.store(true, Ordering::Relaxed);
        }
        if was_relayed {
            peer.greet.store(true, Ordering::Relaxed);
        }
    }
}

/// What a receiving thread decrypts into: a scratch buffer, and the packets gathered for a
/// TUN interface ([`Writer`]).
pub(super) struct Sink {
    dst: Vec<u8>,
    writer: Writer,
}

impl Sink {
    /// A sink gathering at most `batch` packets before writing them.
    pub(super) fn new(batch: usize) -> Self {
        Self {
            dst: vec![0; BUF],
            writer: Writer::new(batch),
        }
    }

    /// Writes what was gathered, then sends what the kernel answered at once.
    ///
    /// What the kernel's stack answers while a packet is written into a TUN (an ICMP echo
    /// reply, a TCP acknowledgement, anything a pod answers in the same softirq) is in the TUN
    /// when the write returns. Waking the TUN thread for it would cost a wake-up on another
    /// vCPU, the dearest step of a round trip on a virtual machine; this thread is awake, so it
    /// sends the answer itself, unless the TUN thread is draining already (it then takes this
    /// TUN in turn: epoll told it too).
    pub(super) fn flush(&mut self, shared: &Shared) {
        self.writer.flush(shared);
        for peer in self.writer.take_written() {
            let mut out = match shared.outbound.try_lock() {
                Ok(out) => out,
                Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
                Err(TryLockError::WouldBlock) => continue,
            };
            let sent = shared.drain_tun(&peer, &mut out);
            shared.answered.fetch_add(sent as u64, Ordering::Relaxed);
        }
    }
}

impl Engine {
    /// Packets the receiving threads sent themselves so far, because the kernel had answered
    /// what they wrote into a TUN before the write returned ([`Sink::flush`]).
    pub fn answered_at_once(&self) -> u64 {
        self.shared.answered.load(Ordering::Relaxed)
    }
}

/// Canonical form of a datagram's source: IPv4 peers reach a dual-stack socket as mapped
/// IPv6 addresses.
fn canonical(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => addr,
        },
        v4 => v4,
    }
}

pub(super) fn udp_loop(shared: &Shared) {
    let mut src = vec![0u8; BUF];
    // One datagram per call: nothing to gather.
    let mut sink = Sink::new(1);
    while !shared.stop.load(Ordering::Relaxed) {
        match shared.socket.recv_from(&mut src) {
            Ok((n, from)) => {
                let datagram = src.get(..n).unwrap_or_default();
                shared.receive(canonical(from), datagram, &mut sink);
                sink.flush(shared);
            }
            Err(err)
                if matches!(
                    err.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(err) => {
                // ICMP errors for earlier sends surface here (ECONNREFUSED); nothing to do.
                tracing::trace!(error = %err, "receiving from the wireguard socket");
            }
        }
    }
}

/// The batched socket's receiving buffers and the sink they are decrypted into, held by
/// whichever thread receives: the receiving thread, or the TUN thread while it busy-polls
/// ([`Inbound::receive_once`]). One holder at a time keeps a peer's datagrams in the order the
/// socket gave them. Each of the `quinn_udp::BATCH_SIZE` buffers may hold up to 64 KiB of
/// datagrams coalesced by GRO, `stride` bytes apart.
pub(super) struct Inbound {
    bufs: Vec<Vec<u8>>,
    meta: Vec<RecvMeta>,
    sink: Sink,
}

impl Inbound {
    /// Buffers for the batched socket; none for [`Io::PerDatagram`](super::Io::PerDatagram),
    /// whose thread keeps its own.
    pub(super) fn new(batched: bool) -> Self {
        let slots = if batched { quinn_udp::BATCH_SIZE } else { 0 };
        Self {
            bufs: (0..slots).map(|_| vec![0u8; BUF]).collect(),
            meta: vec![RecvMeta::default(); slots],
            sink: Sink::new(WRITE_BATCH),
        }
    }

    /// One `recvmmsg` without waiting, and everything it returned handled, written and
    /// answered ([`Sink::flush`]): how many buffers it filled, or `WouldBlock`.
    pub(super) fn receive_once(
        &mut self,
        shared: &Shared,
        state: &UdpSocketState,
    ) -> io::Result<usize> {
        let Self { bufs, meta, sink } = self;
        let mut slices: Vec<IoSliceMut<'_>> = bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
        let n = state.recv((&shared.socket).into(), &mut slices, meta)?;
        for (meta, buf) in meta.iter().zip(&slices).take(n) {
            let from = canonical(meta.addr);
            let stride = if meta.stride == 0 {
                meta.len
            } else {
                meta.stride
            };
            let data = buf.get(..meta.len).unwrap_or_default();
            for datagram in data.chunks(stride.max(1)) {
                shared.receive(from, datagram, sink);
            }
        }
        // Nothing waits for the next datagrams: they may be a while.
        sink.flush(shared);
        Ok(n)
    }
}

impl Shared {
    /// The TUN thread, busy-polling, receives what has arrived if nobody else is receiving
    /// ([`Engine::received_while_polling`]): a reply that comes back within its window is then
    /// handled on a running vCPU instead of after the receiving thread's wake-up.
    pub(super) fn receive_while_polling(&self) -> bool {
        let Some(state) = &self.batched else {
            return false;
        };
        let mut inbound = match self.inbound.try_lock() {
            Ok(inbound) => inbound,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return false,
        };
        match inbound.receive_once(self, state) {
            Ok(n) if n > 0 => {
                self.received_while_polling
                    .fetch_add(n as u64, Ordering::Relaxed);
                true
            }
            _ => false,
        }
    }
}

impl Engine {
    /// Receive buffers the TUN thread filled while it busy-polled, each a datagram or a run
    /// of one sender's datagrams coalesced by GRO (ADR 0032).
    pub fn received_while_polling(&self) -> u64 {
        self.shared.received_while_polling.load(Ordering::Relaxed)
    }

    /// Time the hot threads have spent busy-polling, together (what polling costs in CPU).
    pub fn busy_polled(&self) -> Duration {
        Duration::from_nanos(self.shared.polled_ns.load(Ordering::Relaxed))
    }
}

/// The batched socket's receiving thread: waits in `poll(2)` without holding the buffers, so
/// the TUN thread can take a datagram while it polls, then receives what it was woken for.
pub(super) fn udp_loop_batched(shared: &Shared, state: &UdpSocketState) {
    let timeout = PollTimeout::try_from(RECV_TIMEOUT).unwrap_or(PollTimeout::NONE);
    let mut busy = shared.busy_poll();
    while !shared.stop.load(Ordering::Relaxed) {
        let received = shared
            .inbound
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .receive_once(shared, state);
        match received {
            Ok(_) => busy.handled(),
            Err(err) if err.kind() == io::ErrorKind::WouldBlock && busy.spin() => {}
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                let mut fds = [PollFd::new(shared.socket.as_fd(), PollFlags::POLLIN)];
                let _ = nix::poll::poll(&mut fds, timeout);
            }
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => {
                // ICMP errors for earlier sends surface here (ECONNREFUSED); nothing to do.
                tracing::trace!(error = %err, "receiving from the wireguard socket");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_sources_are_made_ipv4() {
        let mapped: SocketAddr = "[::ffff:192.0.2.7]:51840".parse().expect("addr");
        assert_eq!(
            canonical(mapped),
            "192.0.2.7:51840".parse::<SocketAddr>().expect("addr")
        );
        let v6: SocketAddr = "[2001:db8::1]:51840".parse().expect("addr");
        assert_eq!(canonical(v6), v6);
    }
}
