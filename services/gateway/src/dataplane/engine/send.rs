//! The TUN thread and the socket's sending side: the thread waits on every TUN (`mio`,
//! edge-triggered), encrypts what a TUN holds (super-packets split into their segments) with
//! the peer's session and sends it, on the batched socket in GSO sends ([`GsoBatch`]), else
//! one datagram per call. A receiving thread drains a TUN the same way ([`Shared::drain_tun`])
//! when the kernel answered what it wrote there; the sending buffers ([`Outbound`]) are one set
//! behind a lock, held for a whole drain. Everything else that sends (handshakes, replies,
//! timers) goes through [`Shared::send`] too. This is the other direction's hot path: the loop,
//! the drains and the sends stay together here.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd as _;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use defguard_boringtun::noise::TunnResult;
use mio::{Events, Poll};
use nix::poll::{PollFd, PollFlags, PollTimeout};
use quinn_udp::{Transmit, UdpSocketState};

use super::drops::DropReason;
use super::gso::{DATA_OVERHEAD, GsoBatch, HANDSHAKE_INIT_LEN};
use super::peers::Peer;
use super::relay::Route;
use super::translate::Outcome;
use super::tun::{Read, Reader};
use super::{BUF, Shared, TICK, WAKER};

/// How long a sender waits for room in the socket's send buffer before it drops the datagram.
const SEND_WAIT: Duration = Duration::from_millis(100);

impl Shared {
    /// `to` as the socket addresses it (IPv4 peers as mapped IPv6 on a dual-stack socket).
    fn socket_addr(&self, to: SocketAddr) -> SocketAddr {
        match (self.dual_stack, to) {
            (true, SocketAddr::V4(v4)) => {
                SocketAddr::new(IpAddr::V6(v4.ip().to_ipv6_mapped()), v4.port())
            }
            _ => to,
        }
    }

    pub(super) fn send(&self, datagram: &[u8], to: SocketAddr) {
        self.send_segments(datagram, datagram.len(), to);
    }

    /// Sends `contents`, consecutive datagrams of `segment` bytes (the last may be shorter),
    /// to `to`: one UDP GSO send on the batched socket, one send per datagram otherwise.
    fn send_segments(&self, contents: &[u8], segment: usize, to: SocketAddr) {
        let to = self.socket_addr(to);
        let Some(state) = &self.batched else {
            for datagram in contents.chunks(segment.max(1)) {
                if let Err(err) = self.socket.send_to(datagram, to) {
                    tracing::trace!(%to, error = %err, "sending a wireguard datagram failed");
                }
            }
            return;
        };
        let transmit = |contents: &[u8], segment: Option<usize>| {
            let transmit = Transmit {
                destination: to,
                ecn: None,
                contents,
                segment_size: segment,
                src_ip: None,
            };
            // The socket is non-blocking (recvmmsg must not wait for a full batch); a full
            // send buffer waits here, as a blocking send would, so TCP inside the tunnel sees
            // back-pressure rather than loss.
            let deadline = Instant::now() + SEND_WAIT;
            loop {
                match state.try_send((&self.socket).into(), &transmit) {
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                        if Instant::now() >= deadline {
                            return Err(err);
                        }
                        let mut fds = [PollFd::new(self.socket.as_fd(), PollFlags::POLLOUT)];
                        let _ = nix::poll::poll(&mut fds, PollTimeout::from(10u8));
                    }
                    other => return other,
                }
            }
        };
        let segment_size = (contents.len() > segment).then_some(segment);
        match transmit(contents, segment_size) {
            Ok(()) => {}
            // A device without segmentation offload refuses GSO sends (quinn-udp then turns GSO
            // off for good): send this batch one datagram at a time.
            Err(err) if segment_size.is_some() && state.max_gso_segments() <= 1 => {
                tracing::debug!(error = %err, "udp segmentation offload refused; sending datagrams singly");
                for datagram in contents.chunks(segment) {
                    if let Err(err) = transmit(datagram, None) {
                        tracing::trace!(%to, error = %err, "sending a wireguard datagram failed");
                    }
                }
            }
            Err(err) => {
                tracing::trace!(%to, error = %err, "sending wireguard datagrams failed");
            }
        }
    }

    /// The most datagrams one GSO send may carry.
    fn gso_segments(&self) -> usize {
        self.batched
            .as_ref()
            .map_or(1, UdpSocketState::max_gso_segments)
            .max(1)
    }

    /// Calls `each` with every packet `peer`'s TUN has to read now, super-packets split into
    /// their segments and each translated when the peer has a translation; a super-packet that
    /// cannot be split, or an IPv4 packet whose header cannot be translated, is dropped and
    /// counted. Returns how many packets there were.
    fn read_all(&self, peer: &Peer, reader: &mut Reader, mut each: impl FnMut(&[u8])) -> usize {
        let translation = peer.translation();
        let mut read = 0;
        // Edge-triggered: read until the TUN says it is empty.
        loop {
            match peer.tun.read(reader) {
                Read::Packets(n) => {
                    for i in 0..n {
                        let packet = reader.packet_mut(i);
                        if let Some(translation) = &translation
                            && translation.apply(packet) == Outcome::Malformed
                        {
                            tracing::debug!(interface = %peer.name, "dropped a packet whose header cannot be translated");
                            self.count(DropReason::TunRead);
                            continue;
                        }
                        each(packet);
                    }
                    read += n;
                }
                Read::Empty => return read,
                Read::Malformed(err) => {
                    tracing::debug!(interface = %peer.name, error = %err, "dropped a super-packet from the tun interface");
                    self.count(DropReason::TunRead);
                }
            }
        }
    }

    /// Marks `peer`'s direct path as owing an answer when the first packet of a drain is read,
    /// before it goes (marked after, an answer faster than this thread would be overwritten by
    /// the mark). A drain that finds the TUN empty sends nothing and so owes nothing: the
    /// receiving thread drains every TUN it writes to.
    fn owe_answer(&self, peer: &Peer, marked: &mut bool) {
        if !*marked {
            *marked = true;
            self.sent_data(peer);
        }
    }

    /// Everything a TUN has to read, encrypted into `batch` and sent to the peer in GSO
    /// batches.
    fn drain_batched(&self, peer: &Peer, reader: &mut Reader, batch: &mut GsoBatch) -> usize {
        let to = peer.endpoint();
        let max_segments = self.gso_segments();
        let mut send = |to: SocketAddr, contents: &[u8], segment: usize| {
            self.send_segments(contents, segment, to)
        };
        let kept = peer.has_relay().then(|| self.now_ms());
        // Only a peer with a relay is ever asked for an answer.
        let mut marked = kept.is_none();
        let read = self.read_all(peer, reader, |packet| {
            self.owe_answer(peer, &mut marked);
            let room = (packet.len() + DATA_OVERHEAD).max(HANDSHAKE_INIT_LEN);
            let slot = batch.slot(to, room, max_segments, &mut send);
            let result = peer.tunn().encapsulate(packet, slot);
            match result {
                TunnResult::WriteToNetwork(datagram) => {
                    if let Some(now) = kept {
                        peer.keep_sent(now, datagram);
                    }
                    let len = datagram.len();
                    batch.commit(len, &mut send);
                }
                TunnResult::Err(err) => {
                    tracing::trace!(interface = %peer.name, error = ?err, "could not encapsulate")
                }
                _ => {}
            }
        });
        batch.flush(&mut send);
        read
    }

    /// Everything a TUN has to read: encrypt each packet and send it to the peer (one datagram
    /// per call: the per-datagram socket, and a peer relayed through its hub).
    fn drain(&self, peer: &Peer, reader: &mut Reader, dst: &mut [u8]) -> usize {
        let route = self.route(peer);
        let direct = matches!(route, Route::Direct(_));
        let kept = (direct && peer.has_relay()).then(|| self.now_ms());
        let mut marked = kept.is_none();
        self.read_all(peer, reader, |packet| {
            self.owe_answer(peer, &mut marked);
            let result = peer.tunn().encapsulate(packet, dst);
            match result {
                TunnResult::WriteToNetwork(datagram) => {
                    if let Some(now) = kept {
                        peer.keep_sent(now, datagram);
                    }
                    match &route {
                        Route::Direct(to) => self.send(datagram, *to),
                        Route::Relayed(hub, header) => self.send_wrapped(header, datagram, *hub),
                    }
                }
                TunnResult::Err(err) => {
                    tracing::trace!(interface = %peer.name, error = ?err, "could not encapsulate")
                }
                _ => {}
            }
        })
    }
}

/// What sending needs besides the socket: the buffers a TUN is read into and encrypted from.
/// One per engine, behind a lock: whichever thread drains a TUN holds it for the whole drain,
/// so the packets of one TUN leave in the order they were read.
pub(super) struct Outbound {
    reader: Reader,
    batch: GsoBatch,
    dst: Vec<u8>,
}

impl Outbound {
    pub(super) fn new() -> Self {
        Self {
            reader: Reader::new(),
            batch: GsoBatch::new(),
            dst: vec![0u8; BUF],
        }
    }
}

impl Shared {
    /// Everything `peer`'s TUN holds now: encrypted and sent (how many packets is returned),
    /// or dropped by a standby.
    pub(super) fn drain_tun(&self, peer: &Peer, out: &mut Outbound) -> usize {
        let Outbound { reader, batch, dst } = out;
        if self.standby.load(Ordering::Relaxed) {
            // Nothing leaves a standby: what the kernel routed into the TUN is dropped.
            while !matches!(peer.tun.read(reader), Read::Empty) {}
            0
        } else if self.batched.is_some() && !self.relayed(peer) {
            self.drain_batched(peer, reader, batch)
        } else {
            self.drain(peer, reader, dst)
        }
    }
}

pub(super) fn tun_loop(shared: &Shared, mut poll: Poll) {
    let mut events = Events::with_capacity(256);
    let mut busy = shared.busy_poll();
    while !shared.stop.load(Ordering::Relaxed) {
        // Within the busy-polling window, epoll is asked without waiting, and the socket is
        // read too: a reply arriving now is handled here, on a running vCPU, rather than after
        // the receiving thread wakes (ADR 0032).
        let spinning = busy.spin();
        if spinning && shared.receive_while_polling() {
            busy.handled();
        }
        let timeout = spinning.then_some(Duration::ZERO);
        if let Err(err) = poll.poll(&mut events, timeout) {
            if err.kind() != io::ErrorKind::Interrupted {
                tracing::warn!(error = %err, "waiting for the tun interfaces failed");
                std::thread::sleep(TICK);
            }
            continue;
        }
        for event in &events {
            if event.token() == WAKER {
                continue;
            }
            let Ok(index) = u32::try_from(event.token().0) else {
                continue;
            };
            if let Some(peer) = shared.peer(index) {
                let mut out = shared.outbound.lock().unwrap_or_else(|e| e.into_inner());
                shared.drain_tun(&peer, &mut out);
                // The window opens once what was read has left: a reply can only come back
                // after that, and a window opened before the encrypting and sending would
                // close that much sooner on it.
                busy.handled();
            }
        }
    }
}
