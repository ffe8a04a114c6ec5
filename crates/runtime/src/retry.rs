//! The one retry policy (ADR 0024): how long a loop waits after a failure, and whether a
//! failure is worth another attempt at all.
//!
//! - [`RetryPolicy`]: the timing, as a value: the first wait, the longest one, the random
//!   jitter added to each (a fraction of the wait, so that many clients of one restarted server
//!   do not retry in lockstep) and, for a bounded call, how many attempts in all;
//! - [`Backoff`]: the waits of one retried thing in a row, doubling from `initial` up to `max`;
//!   a success resets it;
//! - [`KeyedBackoff`]: the same per key (a peer, a remote cluster) for a reconciler that
//!   retries many things on one loop: each key backs off on its own, so one that keeps failing
//!   never delays another;
//! - [`Retryable`] and [`Class`]: the one classification of failures, for the domain
//!   [`Error`] and for a [`tonic::Status`] alike;
//! - [`retry`]: a call made again while it fails transiently, within the policy's attempts,
//!   until shutdown.
//!
//! Periodic work (a resync, a poll) is not a retry and keeps its own interval
//! ([`crate::resync`]); only waits after a failure come from here.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use rand::Rng as _;
use tokio::time::Instant;
use tonic::Code;
use trellis_error::Error;

use crate::Shutdown;

/// The timing of a retry loop. A value, so a loop's policy is one constant (or one flag group)
/// rather than a hand-written doubling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// The wait after the first failure; each further failure in a row doubles it.
    pub initial: Duration,
    /// The longest wait (before jitter).
    pub max: Duration,
    /// Up to this fraction of each wait is added at random (0 = none, at most 1).
    pub jitter: f64,
    /// Attempts in all (the first included) after which [`retry`] gives up; `None`: never.
    /// Only bounded calls stop: a loop that follows a dependency for the life of the service
    /// ([`Backoff`], [`KeyedBackoff`]) retries forever and ignores it.
    pub max_attempts: Option<u32>,
}

impl RetryPolicy {
    /// The jitter every policy starts with: a quarter of the wait.
    pub const JITTER: f64 = 0.25;

    /// The workspace's default: 200 ms doubling up to 10 s, unbounded.
    pub const DEFAULT: Self =
        Self::exponential(Duration::from_millis(200), Duration::from_secs(10));

    /// Waits doubling from `initial` up to `max`, with [`Self::JITTER`], never giving up.
    pub const fn exponential(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            jitter: Self::JITTER,
            max_attempts: None,
        }
    }

    /// The same wait after every failure (plus jitter).
    pub const fn fixed(wait: Duration) -> Self {
        Self::exponential(wait, wait)
    }

    /// Gives [`retry`] up after `attempts` attempts in all, the first included.
    #[must_use]
    pub const fn with_max_attempts(self, attempts: u32) -> Self {
        Self {
            max_attempts: Some(attempts),
            ..self
        }
    }

    /// Another jitter fraction: 0 (or less) for none, at most 1 (more counts as 1).
    #[must_use]
    pub const fn with_jitter(self, fraction: f64) -> Self {
        Self {
            jitter: fraction,
            ..self
        }
    }

    /// A [`Backoff`] following this policy.
    pub fn backoff(&self) -> Backoff {
        Backoff::from_policy(*self)
    }

    /// The wait after `failures` consecutive failures (1 = the first; 0 counts as 1), jitter
    /// included: `initial` doubled per further failure, at most `max`.
    pub fn delay_after(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(31);
        self.jittered(self.initial.saturating_mul(1 << doublings).min(self.max))
    }

    /// Whether [`retry`] stops after `attempts` attempts.
    pub fn gives_up_after(&self, attempts: u32) -> bool {
        self.max_attempts.is_some_and(|max| attempts >= max)
    }

    /// `base` plus up to the jitter fraction of it, at random.
    fn jittered(&self, base: Duration) -> Duration {
        // NaN and negative fractions mean none; more than the whole wait is clamped.
        let fraction = if self.jitter > 0.0 {
            self.jitter.min(1.0)
        } else {
            return base;
        };
        let drawn = rand::rng().random_range(0.0..=fraction);
        base.saturating_add(
            Duration::try_from_secs_f64(base.as_secs_f64() * drawn).unwrap_or_default(),
        )
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// The waits of one retried thing (a watch that broke, a dependency that does not answer):
/// each [`Self::next_delay`] is the policy's wait after one more failure; a success resets it.
#[derive(Debug, Clone)]
pub struct Backoff {
    policy: RetryPolicy,
    failures: u32,
}

impl Backoff {
    /// [`RetryPolicy::exponential`]: starts at `initial`, never waits longer than `max` (plus
    /// jitter).
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self::from_policy(RetryPolicy::exponential(initial, max))
    }

    /// Follows `policy`.
    pub fn from_policy(policy: RetryPolicy) -> Self {
        Self {
            policy,
            failures: 0,
        }
    }

    /// The policy it follows.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// How long to wait before the next attempt; doubles the one after.
    pub fn next_delay(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.policy.delay_after(self.failures)
    }

    /// The wait after `failures` consecutive failures (1 = the first), as [`Self::next_delay`]
    /// would give it: for callers that persist a failure count with each retried item (a
    /// relay record) instead of keeping one `Backoff` alive per item.
    pub fn after_failures(&self, failures: u32) -> Duration {
        self.policy.delay_after(failures)
    }

    /// After a success: the next failure waits `initial` again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// Waits [`Self::next_delay`]: the pause before the next attempt of a loop that retries by
    /// itself (a watch to re-open). Race it with the shutdown.
    pub async fn wait(&mut self) {
        wait(self.next_delay()).await;
    }
}

/// Waits `delay`, a wait this module computed ([`Backoff::next_delay`],
/// [`RetryPolicy::delay_after`]) that the caller wanted to log first. A service waits before a
/// retry only through here or [`Backoff::wait`] (`services/clippy.toml` refuses a bare sleep).
pub async fn wait(delay: Duration) {
    tokio::time::sleep(delay).await;
}

/// When each key (a peer, a remote cluster) is due again after its failures, for a reconciler
/// that retries many keys on one loop. Each key backs off on its own: one backoff shared by
/// all would hold back a key that failed once behind the many that keep failing. Only keys
/// that failed are held; a success forgets the key.
#[derive(Debug, Clone)]
pub struct KeyedBackoff<K> {
    policy: RetryPolicy,
    keys: BTreeMap<K, Due>,
}

/// One key's failures in a row and when it is due again.
#[derive(Debug, Clone, Copy)]
struct Due {
    failures: u32,
    at: Instant,
}

impl<K: Ord> KeyedBackoff<K> {
    /// Nothing failed yet; every key backs off by `policy`.
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            policy,
            keys: BTreeMap::new(),
        }
    }

    /// The policy every key follows.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// Counts a failure of `key` at `now`: it is due again after the policy's wait for its
    /// failures in a row, which this returns.
    pub fn failed(&mut self, key: K, now: Instant) -> u32 {
        let failures = self.failures(&key).saturating_add(1);
        let at = now + self.policy.delay_after(failures);
        self.keys.insert(key, Due { failures, at });
        failures
    }

    /// Wants `key` again at once without counting a failure (its count starts over): for an
    /// answer that says what to do differently next time rather than that the call failed.
    pub fn retry_now(&mut self, key: K, now: Instant) {
        self.keys.insert(
            key,
            Due {
                failures: 0,
                at: now,
            },
        );
    }

    /// After a success, or when the key no longer matters: forgets it, so its next failure
    /// waits `initial` again. Whether it was held.
    pub fn reset(&mut self, key: &K) -> bool {
        self.keys.remove(key).is_some()
    }

    /// Forgets every key `keep` says no to (keys that no longer exist).
    pub fn retain(&mut self, mut keep: impl FnMut(&K) -> bool) {
        self.keys.retain(|key, _| keep(key));
    }

    /// `key`'s failures in a row (0 when it is not held).
    pub fn failures(&self, key: &K) -> u32 {
        self.keys.get(key).map_or(0, |due| due.failures)
    }

    /// When `key` is due again, if it is held.
    pub fn due_at(&self, key: &K) -> Option<Instant> {
        self.keys.get(key).map(|due| due.at)
    }

    /// Whether `key` is held and due at `now`.
    pub fn is_due(&self, key: &K, now: Instant) -> bool {
        self.due_at(key).is_some_and(|at| at <= now)
    }

    /// The held keys due at `now`.
    pub fn due(&self, now: Instant) -> impl Iterator<Item = &K> {
        self.keys
            .iter()
            .filter(move |(_, due)| due.at <= now)
            .map(|(key, _)| key)
    }

    /// The earliest time a held key is due: when the loop must wake up next.
    pub fn next_due(&self) -> Option<Instant> {
        self.keys.values().map(|due| due.at).min()
    }

    /// Every held key.
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.keys.keys()
    }
}

/// What a failure says about trying again: the one answer every retry decision in the
/// workspace takes (see [`Retryable`] for the table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Getting an answer failed (unreachable, no answer in time, a race lost to another
    /// writer): the same call may well succeed in a moment. Retried at once, on a backoff.
    Transient,
    /// The answer was no, for a reason the rest of the system may remove (a peer that does not
    /// know us yet, a pool that is full, a history to start over from, a bug a restart may
    /// clear): a reconciler tries again on its next pass or backoff; a single call does not.
    Conditional,
    /// The answer is no and stays no for this request: malformed, not allowed, or about
    /// something that does not exist. Nothing retries it.
    Permanent,
}

/// A failure that knows its [`Class`]. The table, by domain error kind (and gRPC code, which
/// maps onto it as [`Error`]'s `From<Status>` does):
///
/// | Class | [`Error`] | gRPC code |
/// |---|---|---|
/// | transient | `Unavailable`, `DeadlineExceeded`, `Aborted` | `UNAVAILABLE`, `CANCELLED`, `DEADLINE_EXCEEDED`, `ABORTED` |
/// | conditional | `FailedPrecondition`, `ResourceExhausted`, `AlreadyExists`, `OutOfRange`, `Unauthenticated`, `Internal` | the same, and `UNKNOWN`, `UNIMPLEMENTED`, `DATA_LOSS`, `OK` (all `Internal`) |
/// | permanent | `InvalidArgument`, `PermissionDenied`, `NotFound` | the same |
///
/// `ResourceExhausted` is conditional: here it means a finite pool (subnets, ports) is used
/// up, which frees only when another peering goes, not within a call's retries; a store that
/// throttles says `Unavailable` (the etcd adapter maps it so).
pub trait Retryable {
    /// What this failure says about trying again.
    fn class(&self) -> Class;

    /// Whether the same call is worth making again after a short wait.
    fn is_transient(&self) -> bool {
        self.class() == Class::Transient
    }

    /// Whether no retry can ever succeed.
    fn is_permanent(&self) -> bool {
        self.class() == Class::Permanent
    }
}

impl Retryable for Error {
    fn class(&self) -> Class {
        match self {
            Error::Unavailable(_) | Error::DeadlineExceeded(_) | Error::Aborted(_) => {
                Class::Transient
            }
            Error::FailedPrecondition(_)
            | Error::ResourceExhausted(_)
            | Error::AlreadyExists(_)
            | Error::OutOfRange(_)
            | Error::Unauthenticated(_)
            | Error::Internal(_) => Class::Conditional,
            Error::InvalidArgument { .. } | Error::PermissionDenied(_) | Error::NotFound(_) => {
                Class::Permanent
            }
        }
    }
}

impl Retryable for tonic::Status {
    fn class(&self) -> Class {
        match self.code() {
            Code::Unavailable | Code::Cancelled | Code::DeadlineExceeded | Code::Aborted => {
                Class::Transient
            }
            Code::FailedPrecondition
            | Code::ResourceExhausted
            | Code::AlreadyExists
            | Code::OutOfRange
            | Code::Unauthenticated
            | Code::Internal
            | Code::Unknown
            | Code::Unimplemented
            | Code::DataLoss
            | Code::Ok => Class::Conditional,
            Code::InvalidArgument | Code::PermissionDenied | Code::NotFound => Class::Permanent,
        }
    }
}

/// Calls `op` until it succeeds or fails other than transiently, waiting by `policy` between
/// attempts and giving up after its `max_attempts`. A `shutdown` cuts a wait short: the last
/// failure is returned at once. Each retry is logged at debug level; the caller reports the
/// outcome.
pub async fn retry<T, E, F, Fut>(
    policy: &RetryPolicy,
    shutdown: Option<&Shutdown>,
    mut op: F,
) -> Result<T, E>
where
    E: Retryable + std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut backoff = policy.backoff();
    let mut attempt = 1;
    loop {
        let err = match op().await {
            Err(err) if err.is_transient() && !policy.gives_up_after(attempt) => err,
            done => return done,
        };
        let wait = backoff.next_delay();
        tracing::debug!(attempt, wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX), error = %err, "transient failure; retrying");
        match shutdown {
            Some(shutdown) => tokio::select! {
                () = shutdown.cancelled() => return Err(err),
                () = tokio::time::sleep(wait) => {}
            },
            None => tokio::time::sleep(wait).await,
        }
        attempt += 1;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[tokio::test(start_paused = true)]
    async fn wait_sleeps_the_next_delay_and_grows() {
        let mut backoff = Backoff::new(100 * MS, 10_000 * MS);
        let start = tokio::time::Instant::now();
        backoff.wait().await;
        let first = start.elapsed();
        assert!(within(first, 100 * MS), "{first:?}");
        let second_start = tokio::time::Instant::now();
        backoff.wait().await;
        let second = second_start.elapsed();
        assert!(within(second, 200 * MS), "{second:?}");
    }

    /// Whether `wait` is `base` plus at most a quarter of it.
    fn within(wait: Duration, base: Duration) -> bool {
        (base..=base + base / 4).contains(&wait)
    }

    #[test]
    fn doubles_up_to_the_cap_with_bounded_jitter_and_resets() {
        let mut b = Backoff::new(100 * MS, 400 * MS);
        let waits: Vec<Duration> = (0..5).map(|_| b.next_delay()).collect();
        for (wait, base) in waits.iter().zip([100, 200, 400, 400, 400]) {
            assert!(within(*wait, base * MS), "{waits:?}");
        }
        b.reset();
        assert!(within(b.next_delay(), 100 * MS));
    }

    #[test]
    fn after_failures_matches_the_sequence_and_never_overflows() {
        let b = Backoff::new(100 * MS, 400 * MS);
        for (failures, base) in [
            (0, 100),
            (1, 100),
            (2, 200),
            (3, 400),
            (4, 400),
            (u32::MAX, 400),
        ] {
            let wait = b.after_failures(failures);
            assert!(within(wait, base * MS), "{failures}: {wait:?}");
        }
        let huge = RetryPolicy::exponential(Duration::from_secs(1), Duration::MAX);
        assert!(huge.delay_after(u32::MAX) >= Duration::from_secs(1 << 31));
    }

    #[test]
    fn a_policy_is_exponential_fixed_or_jitter_free_as_asked() {
        let policy = RetryPolicy::default();
        assert_eq!(policy.initial, 200 * MS);
        assert_eq!(policy.max, Duration::from_secs(10));
        assert!((policy.jitter - 0.25).abs() < f64::EPSILON);
        assert_eq!(policy.max_attempts, None);
        assert!(!policy.gives_up_after(u32::MAX));

        let fixed = RetryPolicy::fixed(500 * MS).with_jitter(0.0);
        for failures in [1, 2, 10] {
            assert_eq!(fixed.delay_after(failures), 500 * MS);
        }
        let exact = RetryPolicy::exponential(100 * MS, 800 * MS).with_jitter(0.0);
        let waits: Vec<_> = (1..=5).map(|n| exact.delay_after(n)).collect();
        assert_eq!(waits, [100 * MS, 200 * MS, 400 * MS, 800 * MS, 800 * MS]);

        // Out-of-range fractions cannot make a wait negative or unbounded.
        for fraction in [-1.0, f64::NAN] {
            assert_eq!(exact.with_jitter(fraction).delay_after(1), 100 * MS);
        }
        assert!(exact.with_jitter(5.0).delay_after(1) <= 200 * MS);

        let bounded = policy.with_max_attempts(3);
        assert!(!bounded.gives_up_after(2));
        assert!(bounded.gives_up_after(3));
    }

    #[test]
    fn keyed_backoff_backs_each_key_off_on_its_own() {
        let now = Instant::now();
        let mut keyed =
            KeyedBackoff::new(RetryPolicy::exponential(100 * MS, Duration::from_secs(10)));
        for _ in 0..6 {
            keyed.failed("a", now);
        }
        assert_eq!(keyed.failed("c", now), 1);
        assert_eq!(keyed.failures(&"a"), 6);
        assert!(within(keyed.due_at(&"c").expect("held") - now, 100 * MS));
        assert!(within(keyed.due_at(&"a").expect("held") - now, 3200 * MS));
        assert_eq!(keyed.next_due(), keyed.due_at(&"c"));
        let soon = now + 125 * MS;
        assert_eq!(keyed.due(soon).collect::<Vec<_>>(), [&"c"]);
        assert!(keyed.is_due(&"c", soon) && !keyed.is_due(&"a", soon));
        assert!(
            !keyed.is_due(&"b", soon),
            "a key that never failed is not held"
        );
    }

    #[test]
    fn keyed_backoff_resets_on_success_and_forgets_keys() {
        let now = Instant::now();
        let mut keyed =
            KeyedBackoff::new(RetryPolicy::exponential(100 * MS, Duration::from_secs(10)));
        keyed.failed("a", now);
        keyed.failed("a", now);
        assert!(keyed.reset(&"a"));
        assert!(!keyed.reset(&"a"), "nothing left to reset");
        assert_eq!(keyed.failed("a", now), 1, "the count starts over");
        assert!(within(keyed.due_at(&"a").expect("held") - now, 100 * MS));

        keyed.failed("b", now);
        keyed.retry_now("c", now);
        assert_eq!(keyed.failures(&"c"), 0);
        assert!(keyed.is_due(&"c", now));
        keyed.retain(|key| *key != "b");
        assert_eq!(keyed.keys().collect::<Vec<_>>(), [&"a", &"c"]);
        assert_eq!(keyed.due_at(&"b"), None);
        assert_eq!(keyed.failed("b", now), 1, "a forgotten key starts over");
    }

    /// The table, row by row; a status and the error it becomes agree.
    #[test]
    fn classifies_errors_and_statuses_by_one_table() {
        use Class::{Conditional, Permanent, Transient};
        let errors = [
            (Error::Unavailable(String::new()), Transient),
            (Error::DeadlineExceeded(String::new()), Transient),
            (Error::Aborted(String::new()), Transient),
            (Error::FailedPrecondition(String::new()), Conditional),
            (Error::ResourceExhausted(String::new()), Conditional),
            (Error::AlreadyExists(String::new()), Conditional),
            (Error::OutOfRange(String::new()), Conditional),
            (Error::Unauthenticated(String::new()), Conditional),
            (Error::Internal(String::new()), Conditional),
            (Error::invalid("f", "r"), Permanent),
            (Error::PermissionDenied(String::new()), Permanent),
            (Error::NotFound(String::new()), Permanent),
        ];
        for (err, class) in errors {
            assert_eq!(err.class(), class, "{err:?}");
            assert_eq!(err.is_transient(), class == Transient, "{err:?}");
            assert_eq!(err.is_permanent(), class == Permanent, "{err:?}");
            let status = tonic::Status::from(err.clone());
            assert_eq!(status.class(), class, "{err:?} as a status");
        }
        for code in (0..=16).map(Code::from_i32) {
            let status = tonic::Status::new(code, "x");
            assert_eq!(
                status.class(),
                Error::from(status.clone()).class(),
                "{code:?}"
            );
        }
        assert!(tonic::Status::cancelled("x").is_transient());
        assert_eq!(tonic::Status::unknown("x").class(), Conditional);
    }

    /// An operation failing with each of `errors` in turn, then succeeding; counts its calls.
    fn flaky(
        errors: Vec<Error>,
        calls: &AtomicU32,
    ) -> impl FnMut() -> std::future::Ready<Result<u32, Error>> + '_ {
        move || {
            let n = calls.fetch_add(1, Ordering::Relaxed);
            std::future::ready(match errors.get(n as usize) {
                Some(err) => Err(err.clone()),
                None => Ok(n + 1),
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn retry_retries_transient_failures_until_success() {
        let calls = AtomicU32::new(0);
        let policy = RetryPolicy::exponential(100 * MS, Duration::from_secs(1));
        let errors = vec![
            Error::Unavailable("down".into()),
            Error::Aborted("raced".into()),
        ];
        let started = Instant::now();
        let done = retry(&policy, None, flaky(errors, &calls)).await;
        assert_eq!(done, Ok(3));
        let took = started.elapsed();
        assert!((300 * MS..=380 * MS).contains(&took), "{took:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn retry_gives_up_after_max_attempts() {
        let calls = AtomicU32::new(0);
        let policy = RetryPolicy::fixed(100 * MS).with_max_attempts(3);
        let errors = vec![Error::Unavailable("down".into()); 10];
        let done = retry(&policy, None, flaky(errors, &calls)).await;
        assert_eq!(done, Err(Error::Unavailable("down".into())));
        assert_eq!(calls.load(Ordering::Relaxed), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn retry_returns_a_non_transient_failure_at_once() {
        for err in [
            Error::invalid("f", "r"),
            Error::FailedPrecondition("not yet".into()),
        ] {
            let calls = AtomicU32::new(0);
            let started = Instant::now();
            let done = retry(
                &RetryPolicy::DEFAULT,
                None,
                flaky(vec![err.clone()], &calls),
            )
            .await;
            assert_eq!(done, Err(err));
            assert_eq!(calls.load(Ordering::Relaxed), 1);
            assert_eq!(started.elapsed(), Duration::ZERO);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn retry_stops_waiting_on_shutdown() {
        let calls = AtomicU32::new(0);
        let shutdown = Shutdown::new();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            stop.cancel();
        });
        let errors = vec![Error::Unavailable("down".into()); 1000];
        let started = Instant::now();
        let done = retry(
            &RetryPolicy::fixed(Duration::from_secs(1)),
            Some(&shutdown),
            flaky(errors, &calls),
        )
        .await;
        assert_eq!(done, Err(Error::Unavailable("down".into())));
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert!((4..=5).contains(&calls.load(Ordering::Relaxed)));
    }

    #[tokio::test(start_paused = true)]
    async fn retry_retries_statuses_by_code() {
        let calls = AtomicU32::new(0);
        let done = retry(&RetryPolicy::fixed(MS), None, || {
            let n = calls.fetch_add(1, Ordering::Relaxed);
            std::future::ready(match n {
                0 => Err(tonic::Status::cancelled("reset")),
                1 => Err(tonic::Status::unavailable("down")),
                _ => Err(tonic::Status::not_found("gone")),
            })
        })
        .await;
        assert_eq!(done.map_err(|s| s.code()), Err::<(), _>(Code::NotFound));
        assert_eq!(calls.load(Ordering::Relaxed), 3);
    }
}
