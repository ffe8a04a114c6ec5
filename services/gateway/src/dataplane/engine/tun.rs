//! A peer's TUN interface, opened with the kernel's offloads where it has them (ADR 0030).
//!
//! With offloads on, every packet crosses the interface behind a virtio-net header, and the
//! interface tells the kernel that it takes TCP segmentation (IPv4 and IPv6) and, where the
//! kernel has it (6.2 and later), UDP segmentation. The kernel's stack then hands the engine
//! super-packets of up to 64 KiB instead of one packet per read; [`Reader`] splits them into
//! segments of the size the kernel chose, with their checksums. The other way, [`Writer`]
//! gathers the packets decrypted for one peer and coalesces those of one flow into
//! super-packets again before writing them (GRO), so the kernel's stack sees a few large
//! packets instead of many small ones. The splitting and coalescing are `tun-rs`'s. A kernel
//! that refuses the offloads gets the interface without them: one packet per read and write.

use std::io;
use std::os::fd::{AsRawFd as _, RawFd};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use tun_rs::{DeviceBuilder, GROTable, IDEAL_BATCH_SIZE, SyncDevice, VIRTIO_NET_HDR_LEN};

use super::drops::DropReason;
use super::peers::Peer;
use super::{BUF, Shared};

/// Room before every packet in the readers' and writers' buffers: the virtio-net header.
const OFFSET: usize = VIRTIO_NET_HDR_LEN;

/// The most packets a [`Writer`] gathers before it writes them.
pub(super) const WRITE_BATCH: usize = IDEAL_BATCH_SIZE;

pub(super) struct Tun {
    device: SyncDevice,
    offloaded: bool,
}

/// What one read from a TUN gave.
pub(super) enum Read {
    /// This many packets, in the reader.
    Packets(usize),
    /// Nothing more to read now.
    Empty,
    /// A super-packet that could not be split (its virtio-net header does not describe it),
    /// dropped.
    Malformed(io::Error),
}

impl Tun {
    /// Opens the interface `name`, with the offloads when `offload` and the kernel takes them.
    pub(super) fn open(name: &str, offload: bool) -> io::Result<Self> {
        let open = |offload: bool| {
            DeviceBuilder::new()
                .name(name)
                .multi_queue(true)
                .offload(offload)
                // Bringing it up, its addresses and its routes are the gateway's reconciler's.
                .inherit_enable_state()
                .build_sync()
        };
        let device = match open(offload) {
            Ok(device) => device,
            Err(err) if offload => {
                tracing::warn!(interface = name, error = %err, "the kernel refused the tun offloads; one packet per read and write");
                open(false)?
            }
            Err(err) => return Err(err),
        };
        device.set_nonblocking(true)?;
        let offloaded = device.tcp_gso();
        tracing::debug!(
            interface = name,
            offloaded,
            udp_segmentation = device.udp_gso(),
            "tun interface open"
        );
        Ok(Self { device, offloaded })
    }

    /// Whether the interface carries super-packets.
    pub(super) fn offloaded(&self) -> bool {
        self.offloaded
    }

    pub(super) fn fd(&self) -> RawFd {
        self.device.as_raw_fd()
    }

    /// Reads the next packet, or the next super-packet split into its segments, into `reader`.
    pub(super) fn read(&self, reader: &mut Reader) -> Read {
        let Reader { raw, bufs, sizes } = reader;
        // The splitting parses what the kernel's stack made of a pod's packets: a panic in it
        // must cost that packet, not the engine's thread.
        let read = std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.device.recv_multiple(raw, bufs, sizes, OFFSET)
        }));
        match read {
            Ok(Ok(n)) => Read::Packets(n),
            // The descriptor's own errors (EAGAIN above all) carry an OS code; the splitting's
            // refusals do not.
            Ok(Err(err)) if err.raw_os_error().is_some() => Read::Empty,
            Ok(Err(err)) => Read::Malformed(err),
            Err(_) => Read::Malformed(io::Error::other("splitting the super-packet panicked")),
        }
    }

    /// Writes the packets in `bufs` (each after [`OFFSET`] bytes of room), coalescing those of
    /// one flow when offloaded.
    fn write(&self, gro: &mut GROTable, bufs: &mut [Vec<u8>]) -> io::Result<usize> {
        // The coalescing parses packets a peer sent: a panic in it must cost those packets,
        // not the engine's thread.
        std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.device.send_multiple(gro, bufs, OFFSET)
        }))
        .unwrap_or_else(|_| Err(io::Error::other("coalescing the packets panicked")))
    }
}

/// The buffers one thread reads a TUN into.
pub(super) struct Reader {
    raw: Vec<u8>,
    bufs: Vec<Vec<u8>>,
    sizes: Vec<usize>,
}

impl Reader {
    pub(super) fn new() -> Self {
        // Allocated zeroed, so pages a small segment never reaches are never touched.
        Self {
            raw: vec![0; OFFSET + BUF],
            bufs: (0..IDEAL_BATCH_SIZE)
                .map(|_| vec![0; OFFSET + BUF])
                .collect(),
            sizes: vec![0; IDEAL_BATCH_SIZE],
        }
    }

    /// The `i`th packet of the last read, to be translated in place before it is sent.
    pub(super) fn packet_mut(&mut self, i: usize) -> &mut [u8] {
        let size = self.sizes.get(i).copied().unwrap_or_default();
        self.bufs
            .get_mut(i)
            .and_then(|buf| buf.get_mut(OFFSET..OFFSET + size))
            .unwrap_or_default()
    }
}

/// The packets decrypted for one peer, gathered so that those of one flow are written as one
/// super-packet. A packet for another peer, a full batch, or the end of what the socket held
/// writes them ([`Writer::flush`]).
pub(super) struct Writer {
    bufs: Vec<Vec<u8>>,
    used: usize,
    capacity: usize,
    peer: Option<Arc<Peer>>,
    gro: GROTable,
    /// The peers written to since [`Writer::take_written`] last asked.
    written: Vec<Arc<Peer>>,
}

impl Writer {
    /// A writer gathering at most `capacity` packets.
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            bufs: Vec::new(),
            used: 0,
            capacity: capacity.max(1),
            peer: None,
            gro: GROTable::default(),
            written: Vec::new(),
        }
    }

    /// Adds `packet` for `peer`'s interface; written now when the interface is not offloaded
    /// (nothing to coalesce) or the batch is full.
    pub(super) fn push(&mut self, shared: &Shared, peer: &Arc<Peer>, packet: &[u8]) {
        if self
            .peer
            .as_ref()
            .is_some_and(|staged| !Arc::ptr_eq(staged, peer))
        {
            self.flush(shared);
        }
        if self.used == self.bufs.len() {
            self.bufs.push(Vec::with_capacity(OFFSET + BUF));
        }
        if let Some(buf) = self.bufs.get_mut(self.used) {
            buf.clear();
            buf.resize(OFFSET, 0);
            buf.extend_from_slice(packet);
            self.used += 1;
        }
        if self.peer.is_none() {
            self.peer = Some(peer.clone());
        }
        if self.used >= self.capacity || !peer.tun.offloaded() {
            self.flush(shared);
        }
    }

    /// Writes what was gathered.
    pub(super) fn flush(&mut self, shared: &Shared) {
        let Some(peer) = self.peer.take() else {
            return;
        };
        let used = std::mem::take(&mut self.used);
        let Some(bufs) = self.bufs.get_mut(..used) else {
            return;
        };
        if let Err(err) = peer.tun.write(&mut self.gro, bufs) {
            // The interface's queue is full, or a packet it would not take: the write goes on
            // past a failed packet, so this counts writes with a failure, not packets.
            tracing::trace!(interface = %peer.name, error = %err, "writing into the tun interface failed");
            shared.count(DropReason::TunWrite);
        }
        if !self.written.iter().any(|p| Arc::ptr_eq(p, &peer)) {
            self.written.push(peer);
        }
    }

    /// The peers written to since the last call, each once.
    pub(super) fn take_written(&mut self) -> impl Iterator<Item = Arc<Peer>> + '_ {
        self.written.drain(..)
    }
}
