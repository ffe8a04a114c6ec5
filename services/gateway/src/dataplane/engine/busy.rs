//! Busy polling: a hot thread that has just handled packets asks for more without sleeping,
//! for a short window, before it blocks again.
//!
//! A round trip through two gateways wakes four engine threads (each side's TUN thread on the
//! way out, each side's receiving thread on the way in). On a virtual machine an idle vCPU
//! halts, and waking a thread on a halted vCPU costs an exit to the hypervisor and a turn of
//! the host's scheduler: tens to hundreds of microseconds, four times per round trip, where the
//! kernel's own path through a veth wakes nobody. A thread that keeps polling for a while after
//! its last packet keeps its vCPU running, so the next wake-up (its own, or another thread's
//! placed on that vCPU) is cheap. This is what the guest kernel's halt polling does for a whole
//! vCPU; doing it here costs CPU only while this engine carries traffic, never at idle. Each
//! spin yields the CPU, so anything else runnable on it (the pods' processes, the other
//! direction's thread) goes first.

use std::time::{Duration, Instant};

/// The window ADR 0032 measured, in microseconds, and the one to start from when turning busy
/// polling on: the guest halt-polling window Linux uses on KVM (`guest_halt_poll_ns`, 200 µs).
/// Busy polling is off unless asked for ([`Options::busy_poll`](super::Options::busy_poll)).
pub const BUSY_POLL_US: u64 = 200;

/// One thread's polling window.
pub(super) struct BusyPoll {
    window: Duration,
    until: Instant,
}

impl BusyPoll {
    /// A window of `window` after each packet; zero never spins.
    pub(super) fn new(window: Duration) -> Self {
        Self {
            window,
            until: Instant::now(),
        }
    }

    /// The thread just handled packets: poll for the whole window before sleeping.
    pub(super) fn handled(&mut self) {
        if !self.window.is_zero() {
            self.until = Instant::now() + self.window;
        }
    }

    /// Whether the thread should ask again without sleeping; when so, it first yields the CPU
    /// to whatever else is runnable there.
    pub(super) fn spin(&self) -> bool {
        if self.window.is_zero() || Instant::now() >= self.until {
            return false;
        }
        std::thread::yield_now();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zero_window_never_spins() {
        let mut busy = BusyPoll::new(Duration::ZERO);
        busy.handled();
        assert!(!busy.spin());
    }

    #[test]
    fn the_window_opens_on_packets_and_closes_after_it() {
        let mut busy = BusyPoll::new(Duration::from_millis(50));
        assert!(!busy.spin(), "no packet yet: sleep");
        busy.handled();
        assert!(busy.spin(), "just handled a packet: poll again");
        std::thread::sleep(Duration::from_millis(60));
        assert!(!busy.spin(), "the window passed: sleep");
    }
}
