//! The global allocator of every binary that links this crate: every service, the lab,
//! `trellisctl`, the benchmarks and the tests.
//!
//! mimalloc rather than glibc's malloc: in a profile of the 255-cluster in-process mesh,
//! glibc's allocator (free-list consolidation and chunk unlinking above all) took about a
//! quarter of the CPU; the services allocate and free many small, short-lived buffers per RPC
//! (prost messages, HTTP/2 frames, store records) from many threads. ADR 0015 has the
//! measurements.
//!
//! [`tune`] lengthens how long mimalloc keeps freed memory before returning it to the kernel.
//! Its default (10 ms) returns memory between two bursts of a busy service, which then faults
//! it back in, a transparent huge page (2 MiB zeroed by the kernel) at a time: the hub's
//! forwarder took about 3,000 page faults during a 100-leaf induced mesh against about 430 with
//! a one-second delay, and the hub's CPU per induced tunnel fell by about 9 % (ADR 0015).
//!
//! [`small_pages`] turns transparent huge pages off for a service process. mimalloc asks the
//! kernel for them, and a service's heap of tens of megabytes then grows and stays resident
//! 2 MiB at a time: the hub's five services at 100 leaves peaked at 196,220–208,584 KiB
//! together with them and 140,300–149,952 KiB without, their CPU no higher (ADR 0015). Not for
//! the gateway (`launch` leaves its data-plane services alone), whose userspace tunnels move
//! every packet through its heap (its tunnel throughput was 1–6 % lower without them), nor for
//! the lab, whose hundreds of clusters share one heap of over a gigabyte (a fifth slower
//! without them).

use std::ffi::{c_int, c_long};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in mimalloc 2's `mi_option_t` (libmimalloc-sys names only some of
/// the options); the test below checks it against the option the environment sets.
const PURGE_DELAY_OPTION: c_int = 15;
/// How long freed memory stays with the process before it is purged (returned to the kernel).
const PURGE_DELAY_MS: c_long = 1000;
/// The environment variable through which mimalloc reads the same option; when an operator
/// sets it, their value stands.
const PURGE_DELAY_ENV: &str = "MIMALLOC_PURGE_DELAY";
/// The environment variable through which mimalloc reads whether it may use transparent huge
/// pages; when an operator sets it, mimalloc follows it and [`small_pages`] does nothing.
const ALLOW_THP_ENV: &str = "MIMALLOC_ALLOW_THP";

/// Sets the allocator's options for a long-running service (see the module doc). Called once,
/// first thing, by every process that runs services: [`crate::launch()`], the lab, and the
/// in-process clusters of the tests and benchmarks. Calling it again changes nothing.
pub fn tune() {
    if std::env::var_os(PURGE_DELAY_ENV).is_none() {
        set_option(PURGE_DELAY_OPTION, PURGE_DELAY_MS);
    }
}

/// Turns transparent huge pages off for this process (see the module doc), unless the
/// environment says whether mimalloc may use them. Called by [`crate::launch()`] for every
/// service but the data plane's, before the service's heap grows.
pub fn small_pages() -> nix::Result<()> {
    if std::env::var_os(ALLOW_THP_ENV).is_some() {
        return Ok(());
    }
    nix::sys::prctl::set_thp_disable(true)
}

#[allow(unsafe_code)]
fn set_option(option: c_int, value: c_long) {
    // SAFETY: `mi_option_set` takes two integers and writes one entry of mimalloc's option
    // table, which mimalloc reads with relaxed loads whenever it decides to purge; an index
    // out of range is ignored (it logs an error). No memory is handed over.
    unsafe { libmimalloc_sys::mi_option_set(option, value) }
}

#[cfg(test)]
#[allow(unsafe_code)]
fn option(option: c_int) -> c_long {
    // SAFETY: as for `set_option`, reading one entry.
    unsafe { libmimalloc_sys::mi_option_get(option) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Set in the child process of the test below.
    const CHILD: &str = "TRELLIS_ALLOCATOR_TEST_CHILD";

    /// The option index really is the purge delay: a child process started with mimalloc's
    /// environment variable for it reads that value at the index; `tune` leaves it alone.
    #[test]
    fn the_purge_delay_option_is_the_one_its_environment_variable_sets() {
        if std::env::var_os(CHILD).is_some() {
            tune();
            assert_eq!(option(PURGE_DELAY_OPTION), 1234);
            return;
        }
        let status = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "--exact",
                "allocator::tests::the_purge_delay_option_is_the_one_its_environment_variable_sets",
            ])
            .env(CHILD, "1")
            .env(PURGE_DELAY_ENV, "1234")
            .status()
            .expect("the test binary runs");
        assert!(status.success(), "the child process failed: {status}");
    }

    /// In child processes: the flag is per process and inherited, and the test binary's other
    /// tests should keep the kernel's default.
    #[test]
    fn small_pages_turns_huge_pages_off_unless_the_environment_decides() {
        if let Some(expected) = std::env::var_os(CHILD) {
            small_pages().expect("prctl");
            assert_eq!(
                nix::sys::prctl::get_thp_disable().expect("prctl"),
                expected == "off"
            );
            return;
        }
        for (expected, env) in [("off", None), ("kept", Some("1"))] {
            let mut child =
                std::process::Command::new(std::env::current_exe().expect("test binary"));
            child
                .args([
                    "--exact",
                    "allocator::tests::small_pages_turns_huge_pages_off_unless_the_environment_decides",
                ])
                .env(CHILD, expected)
                .env_remove(ALLOW_THP_ENV);
            if let Some(value) = env {
                child.env(ALLOW_THP_ENV, value);
            }
            let status = child.status().expect("the test binary runs");
            assert!(status.success(), "the child ({expected}) failed: {status}");
        }
    }

    #[test]
    fn tune_sets_the_purge_delay_unless_the_environment_does() {
        if std::env::var_os(PURGE_DELAY_ENV).is_some() {
            return;
        }
        tune();
        assert_eq!(option(PURGE_DELAY_OPTION), PURGE_DELAY_MS);
    }
}
