//! Busy polling: a hot thread that has just handled packets asks for more without sleeping,
//! for a short window, before it blocks again; the time it spends so is capped by a budget.
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
//!
//! Unbounded, a window costs a whole core whenever packets come a little further apart than it
//! (each one reopens it just before it would close). The budget bounds that: each thread may
//! poll for a share of the time that passes (a token bucket holding one second's share), and
//! sleeps at once while the share is spent, until it holds a whole window's worth again.
//! Sparse request/response traffic, whose latency the polling is for, stays far below it; a
//! steady stream that would keep a thread polling forever falls back to sleeping after its
//! first second's share (ADR 0032).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::Shared;

/// The window ADR 0032 measured, in microseconds, and the one to start from when turning busy
/// polling on: the guest halt-polling window Linux uses on KVM (`guest_halt_poll_ns`, 200 µs).
/// The engine polls not at all unless asked ([`Options::busy_poll`](super::Options::busy_poll));
/// the gateway's own default is its `--busy-poll-us`.
pub const BUSY_POLL_US: u64 = 200;

/// The share of the time, in percent, a hot thread may spend polling when nothing else is
/// said ([`Options::busy_poll_budget_percent`](super::Options::busy_poll_budget_percent)).
pub const BUSY_POLL_BUDGET_PERCENT: u8 = 1;

/// How much of its share a thread may save up: one second's worth.
const BUDGET_HORIZON: Duration = Duration::from_secs(1);

/// One thread's polling window and budget.
pub(super) struct BusyPoll<'a> {
    window: Duration,
    until: Instant,
    /// The share of elapsed time that may be spent polling, 0.0–1.0.
    share: f64,
    /// Polling time that may still be spent, in nanoseconds: at most one horizon's share, below
    /// zero after a slice that overran it (the debt is paid before the next spin).
    tokens_ns: i64,
    cap_ns: i64,
    refilled: Instant,
    /// When the last `spin` that said yes was: what passed since is charged.
    spinning_since: Option<Instant>,
    /// Where the time spent polling is counted, in nanoseconds.
    spent_ns: &'a AtomicU64,
}

impl<'a> BusyPoll<'a> {
    /// A window of `window` after each packet, polling for at most `budget_percent` of the time
    /// (100 or more: no cap; 0: never); a zero window never spins. Time spent polling is added
    /// to `spent_ns`.
    pub(super) fn new(window: Duration, budget_percent: u8, spent_ns: &'a AtomicU64) -> Self {
        let now = Instant::now();
        let share = f64::from(budget_percent.min(100)) / 100.0;
        let cap_ns = nanos(BUDGET_HORIZON.mul_f64(share));
        Self {
            window,
            until: now,
            share,
            tokens_ns: cap_ns,
            cap_ns,
            refilled: now,
            spinning_since: None,
            spent_ns,
        }
    }

    /// The thread just handled packets: poll for the whole window before sleeping.
    pub(super) fn handled(&mut self) {
        if !self.window.is_zero() {
            self.until = Instant::now() + self.window;
        }
    }

    /// Whether the thread should ask again without sleeping; when so, it first yields the CPU
    /// to whatever else is runnable there. The time since the previous yes is charged to the
    /// budget, whatever the thread did with it.
    pub(super) fn spin(&mut self) -> bool {
        if self.window.is_zero() {
            return false;
        }
        let now = Instant::now();
        let polling = self.spinning_since.is_some();
        self.charge(now);
        if now >= self.until || !self.allows(now, polling) {
            return false;
        }
        self.spinning_since = Some(now);
        std::thread::yield_now();
        true
    }

    fn charge(&mut self, now: Instant) {
        if let Some(since) = self.spinning_since.take() {
            let spent = nanos(now.saturating_duration_since(since));
            self.tokens_ns = self.tokens_ns.saturating_sub(spent);
            self.spent_ns
                .fetch_add(spent.unsigned_abs(), Ordering::Relaxed);
        }
    }

    /// Refills the budget for the time passed; whether the thread may poll on (`polling`: it
    /// is polling already) or start: a start takes a whole window's worth. Otherwise a thread
    /// past its share would poll in slivers of what a few microseconds refill, a yield and an
    /// empty read per packet that only slow it down.
    fn allows(&mut self, now: Instant, polling: bool) -> bool {
        if self.share >= 1.0 {
            return true;
        }
        let passed = now.saturating_duration_since(self.refilled);
        self.refilled = now;
        self.tokens_ns = self
            .tokens_ns
            .saturating_add(nanos(passed.mul_f64(self.share)))
            .min(self.cap_ns);
        let needed = if polling {
            0
        } else {
            nanos(self.window).min(self.cap_ns)
        };
        self.tokens_ns > 0 && self.tokens_ns >= needed
    }
}

impl Shared {
    /// A hot thread's polling, with the engine's window and budget.
    pub(super) fn busy_poll(&self) -> BusyPoll<'_> {
        BusyPoll::new(
            self.busy_poll,
            self.busy_poll_budget_percent,
            &self.polled_ns,
        )
    }
}

fn nanos(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spins until the window closes or the budget says no; how long it polled.
    fn poll_out(busy: &mut BusyPoll<'_>) -> Duration {
        let start = Instant::now();
        while busy.spin() {}
        start.elapsed()
    }

    #[test]
    fn a_zero_window_never_spins() {
        let spent = AtomicU64::new(0);
        let mut busy = BusyPoll::new(Duration::ZERO, 100, &spent);
        busy.handled();
        assert!(!busy.spin());
    }

    #[test]
    fn the_window_opens_on_packets_and_closes_after_it() {
        let spent = AtomicU64::new(0);
        let mut busy = BusyPoll::new(Duration::from_millis(50), 100, &spent);
        assert!(!busy.spin(), "no packet yet: sleep");
        busy.handled();
        assert!(busy.spin(), "just handled a packet: poll again");
        std::thread::sleep(Duration::from_millis(60));
        assert!(!busy.spin(), "the window passed: sleep");
        assert!(
            spent.load(Ordering::Relaxed) >= 60_000_000,
            "the time since the last yes is counted as polling"
        );
    }

    #[test]
    fn a_zero_budget_never_spins() {
        let spent = AtomicU64::new(0);
        let mut busy = BusyPoll::new(Duration::from_millis(50), 0, &spent);
        busy.handled();
        assert!(!busy.spin());
    }

    #[test]
    fn the_budget_ends_polling_and_refills_with_time_a_window_at_a_time() {
        let spent = AtomicU64::new(0);
        // 5 %: 50 ms to spend at first, then 5 ms for every 100 ms that pass; a 2 ms window.
        let mut busy = BusyPoll::new(Duration::from_millis(2), 5, &spent);
        // Packets all the time: every spin finds one, so only the budget ends the polling.
        let start = Instant::now();
        loop {
            busy.handled();
            if !busy.spin() {
                break;
            }
        }
        let polled = start.elapsed();
        assert!(
            polled >= Duration::from_millis(50) && polled < Duration::from_secs(5),
            "polled {polled:?} with packets all the time: the saved-up share, 50 ms"
        );
        busy.handled();
        let at_once = poll_out(&mut busy);
        assert!(
            at_once < Duration::from_micros(500),
            "polled {at_once:?} right after the share was spent: less than a window is left"
        );
        // 60 ms refill 3 ms: a whole window's worth, so the next packet polls its window.
        std::thread::sleep(Duration::from_millis(60));
        let start = Instant::now();
        busy.handled();
        poll_out(&mut busy);
        let again = start.elapsed();
        assert!(
            again >= Duration::from_millis(2) && again < Duration::from_millis(50),
            "polled {again:?} after 60 ms: the 2 ms window"
        );
        let counted = Duration::from_nanos(spent.load(Ordering::Relaxed));
        assert!(
            counted + Duration::from_millis(2) >= polled + again,
            "counted {counted:?} of {polled:?} + {again:?}"
        );
    }

    #[test]
    fn a_full_budget_polls_the_whole_window() {
        let spent = AtomicU64::new(0);
        let mut busy = BusyPoll::new(Duration::from_millis(80), 100, &spent);
        let start = Instant::now();
        busy.handled();
        poll_out(&mut busy);
        let polled = start.elapsed();
        assert!(polled >= Duration::from_millis(80), "polled {polled:?}");
    }
}
