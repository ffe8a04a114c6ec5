//! The datagrams of one UDP GSO send, encrypted in place: the TUN thread writes each
//! datagram straight into the batch, so batching costs no copy, and the batch keeps the
//! kernel's rule (one destination, one segment size, only the last datagram shorter).

use std::net::SocketAddr;

use super::BUF;

/// What WireGuard adds to a data packet: type, receiver index, counter, AEAD tag.
pub(super) const DATA_OVERHEAD: usize = 32;

/// The largest datagram `encapsulate` can write for a short packet: a handshake initiation
/// (when the session is not up yet, the packet is queued and an initiation goes out instead).
pub(super) const HANDSHAKE_INIT_LEN: usize = 148;

/// The most UDP payload one GSO send carries. The kernel refuses more than 64 KiB of payload
/// in one send (and more than 64 segments on older kernels, which `quinn-udp` reports).
const GSO_BYTES: usize = 65_000;

/// Encrypted datagrams waiting to leave in one UDP GSO send: consecutive datagrams for one
/// destination, all of one size but the last, which may be shorter (the kernel's rule). The
/// engine encrypts straight into [`GsoBatch::slot`], so a batch costs no copy.
pub(crate) struct GsoBatch {
    buf: Vec<u8>,
    /// Bytes of complete datagrams.
    len: usize,
    /// The size of every datagram but the last.
    segment: usize,
    count: usize,
    to: Option<SocketAddr>,
    /// A shorter datagram ended the batch: nothing may follow it.
    closed: bool,
}

impl GsoBatch {
    pub(crate) fn new() -> Self {
        Self {
            buf: vec![0u8; GSO_BYTES + BUF + HANDSHAKE_INIT_LEN + DATA_OVERHEAD],
            len: 0,
            segment: 0,
            count: 0,
            to: None,
            closed: false,
        }
    }

    /// Room for at most `room` bytes for `to`, after the batch so far, which is sent first
    /// if the new datagram cannot join it (another destination, no room, no segment left).
    pub(crate) fn slot(
        &mut self,
        to: SocketAddr,
        room: usize,
        max_segments: usize,
        send: &mut impl FnMut(SocketAddr, &[u8], usize),
    ) -> &mut [u8] {
        if self.count > 0
            && (self.to != Some(to)
                || self.closed
                || self.count >= max_segments
                || self.len + room > GSO_BYTES)
        {
            self.flush(send);
        }
        self.to = Some(to);
        let end = (self.len + room).min(self.buf.len());
        self.buf.get_mut(self.len..end).unwrap_or_default()
    }

    /// The last slot now holds a `len`-byte datagram.
    pub(crate) fn commit(&mut self, len: usize, send: &mut impl FnMut(SocketAddr, &[u8], usize)) {
        if self.count == 0 {
            self.segment = len;
        } else if len > self.segment || self.closed {
            // It cannot join (only the last datagram may differ, and only by being shorter):
            // send the batch without it, then start the next batch with it.
            let (Some(to), start) = (self.to, self.len) else {
                return;
            };
            if let Some(batch) = self.buf.get(..start) {
                send(to, batch, self.segment);
            }
            self.buf.copy_within(start..start + len, 0);
            self.len = 0;
            self.count = 0;
            self.closed = false;
            self.segment = len;
        } else if len < self.segment {
            self.closed = true;
        }
        self.len += len;
        self.count += 1;
    }

    /// Sends what the batch holds.
    pub(crate) fn flush(&mut self, send: &mut impl FnMut(SocketAddr, &[u8], usize)) {
        if let (Some(to), true) = (self.to, self.count > 0)
            && let Some(batch) = self.buf.get(..self.len)
        {
            send(to, batch, self.segment);
        }
        self.len = 0;
        self.count = 0;
        self.closed = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `datagrams` (destination, size) through a [`GsoBatch`] the way the TUN thread
    /// does; returns the sends: (destination, contents, segment size).
    fn batched(
        datagrams: &[(SocketAddr, usize)],
        max_segments: usize,
    ) -> Vec<(SocketAddr, Vec<u8>, usize)> {
        let mut sends = Vec::new();
        let mut send = |to: SocketAddr, contents: &[u8], segment: usize| {
            sends.push((to, contents.to_vec(), segment));
        };
        let mut batch = GsoBatch::new();
        for (n, (to, len)) in datagrams.iter().enumerate() {
            let slot = batch.slot(*to, len + DATA_OVERHEAD, max_segments, &mut send);
            // Each datagram's bytes name it, so reordering or loss shows.
            let fill = (n % 251) as u8;
            slot.get_mut(..*len).expect("room").fill(fill);
            batch.commit(*len, &mut send);
        }
        batch.flush(&mut send);
        sends
    }

    #[test]
    fn gso_batches_hold_one_destination_and_one_segment_size_in_order() {
        let a: SocketAddr = "192.0.2.1:51820".parse().expect("addr");
        let b: SocketAddr = "192.0.2.2:51820".parse().expect("addr");
        let c: SocketAddr = "[2001:db8::3]:51820".parse().expect("addr");
        // Interleaved peers, runs of one size, shorter tails, a larger datagram after a run,
        // handshake-sized datagrams, and runs longer than a GSO send may carry.
        let mut input = Vec::new();
        for round in 0..40 {
            for (to, len) in [(a, 1452), (a, 1452), (b, 1452), (a, 1452), (c, 148)] {
                input.push((to, len));
            }
            input.extend(std::iter::repeat_n((b, 1452), 3 + round % 7));
            input.push((b, 600));
            input.push((b, 1452));
            input.extend(std::iter::repeat_n((c, 1000), 70));
            input.push((a, 92));
            input.push((a, 1452));
        }
        for max_segments in [1, 2, 64] {
            let sends = batched(&input, max_segments);
            let mut out = Vec::new();
            for (to, contents, segment) in &sends {
                assert!(
                    contents.len() <= GSO_BYTES,
                    "{} bytes in one send",
                    contents.len()
                );
                let datagrams: Vec<&[u8]> = contents.chunks(*segment).collect();
                assert!(datagrams.len() <= max_segments, "too many segments");
                // Every datagram but the last is `segment` long, so the kernel splits the
                // send exactly where the datagrams were.
                for d in &datagrams[..datagrams.len() - 1] {
                    assert_eq!(d.len(), *segment);
                }
                out.extend(datagrams.iter().map(|d| (*to, d.to_vec())));
            }
            assert_eq!(
                out.len(),
                input.len(),
                "datagrams sent, {max_segments} segments"
            );
            for (n, ((to, len), (sent_to, bytes))) in input.iter().zip(&out).enumerate() {
                assert_eq!(sent_to, to, "datagram {n} went to another destination");
                assert_eq!(bytes.len(), *len, "datagram {n} changed size");
                assert!(
                    bytes.iter().all(|x| *x == (n % 251) as u8),
                    "datagram {n} mixed"
                );
            }
            if max_segments == 64 {
                assert!(
                    sends.len() < input.len() / 4,
                    "runs were not batched: {}",
                    sends.len()
                );
            }
        }
    }
}
