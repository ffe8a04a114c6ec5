//! Free loopback ports for servers started by tests.
//!
//! Ports are taken below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`,
//! 32768-60999 by default). Outgoing connections take their source ports from that range, so a
//! server restarted on its old port (an etcd after kill -9, as the chaos tests do) could find it
//! held by some client's connection for as long as that connection lives. Below the range only
//! servers started by tests compete for ports, and each pick is checked by binding it.
//!
//! The last [`RESERVED_MAX`] ports a process handed out stay reserved while it runs: a lock on a
//! file named after each (`trellis-test-ports/<port>` in the temporary directory), which other
//! test processes check before they pick a port and the kernel drops when the process exits.
//! A bind check alone let a port go while its server was down: an etcd killed by the chaos
//! test found its port taken by another test's server when restarted a few seconds later.
//!
//! Within one process a port is not handed out twice at all (until half the range has been):
//! a 255-cluster lab plans about 2,800 ports before it binds any, far more than the file
//! reservations it keeps, and picked duplicates of its own earlier ports.

use std::collections::{HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::net::{Ipv4Addr, TcpListener};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// The lowest port handed out (above the fixed ports of the services, 7101-9107, and of the
/// lab's default base port).
const FIRST: u16 = 20_000;

/// Where the kernel's ephemeral range starts when it cannot be read.
const EPHEMERAL_DEFAULT: u16 = 32_768;

/// A port on 127.0.0.1 that was free a moment ago and lies outside the ephemeral range.
///
/// Another test process may grab it before the caller binds it; servers started on it should
/// be retried on a fresh port if binding fails.
///
/// # Panics
///
/// If no loopback port can be bound at all, which no test could survive anyway.
pub fn free_port() -> u16 {
    let end = ephemeral_start().max(FIRST + 1_000);
    let span = u64::from(end - FIRST);
    for _ in 0..1_000 {
        let port = FIRST + u16::try_from(next_random() % span).unwrap_or(0);
        {
            let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
            let handed_out = handed_out.get_or_insert_with(HashSet::new);
            if handed_out.len() as u64 >= span / 2 {
                handed_out.clear();
            }
            if !handed_out.insert(port) {
                continue;
            }
        }
        let Some(reservation) = reserve(port) else {
            continue;
        };
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            let mut reserved = RESERVED.lock().unwrap_or_else(|e| e.into_inner());
            reserved.push_back(reservation);
            if reserved.len() > RESERVED_MAX {
                reserved.pop_front();
            }
            return port;
        }
    }
    // Everything below the range is taken: the kernel's pick, as before.
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .unwrap_or_else(|err| panic!("cannot bind a loopback port: {err}"))
}

/// Every port this process handed out (see the module doc).
static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// The reservations of the ports this process handed out last (see the module doc).
static RESERVED: Mutex<VecDeque<Option<File>>> = Mutex::new(VecDeque::new());

/// How many reservations a process holds (each an open file): enough for the servers of a
/// chaos test and their restarts, bounded for a benchmark that starts thousands of clusters.
const RESERVED_MAX: usize = 512;

/// Locks `port`'s reservation file: `None` when a test process (this one included) holds it.
/// Without a usable temporary directory every port counts as unreserved, as before.
fn reserve(port: u16) -> Option<Option<File>> {
    let dir = std::env::temp_dir().join("trellis-test-ports");
    let file = std::fs::create_dir_all(&dir).and_then(|()| {
        OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(port.to_string()))
    });
    match file {
        Ok(file) => file.try_lock().is_ok().then_some(Some(file)),
        Err(_) => Some(None),
    }
}

/// The first port of the kernel's ephemeral range.
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse().ok())
        .unwrap_or(EPHEMERAL_DEFAULT)
}

/// A per-process pseudo-random sequence (xorshift), seeded from the process ID and the clock
/// so that concurrent test processes start at different ports.
fn next_random() -> u64 {
    static STATE: AtomicU64 = AtomicU64::new(0);
    let mut x = STATE.load(Ordering::Relaxed);
    if x == 0 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        x = (u64::from(std::process::id()) << 32) ^ nanos | 1;
    }
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    STATE.store(x, Ordering::Relaxed);
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_bindable_and_below_the_ephemeral_range() {
        for _ in 0..50 {
            let port = free_port();
            assert!(
                (FIRST..ephemeral_start().max(FIRST + 1_000)).contains(&port),
                "{port} is outside the range"
            );
            TcpListener::bind((Ipv4Addr::LOCALHOST, port)).expect("port is free");
        }
    }

    #[test]
    fn thousands_of_ports_planned_before_any_is_bound_are_all_different() {
        // As many as a 255-cluster lab with mutual TLS and metrics plans.
        let mut seen = HashSet::new();
        for _ in 0..3_000 {
            let port = free_port();
            assert!(seen.insert(port), "{port} handed out twice");
        }
    }

    #[test]
    fn a_port_handed_out_is_not_handed_out_again_while_this_process_lives() {
        let port = free_port();
        // Nothing listens on it (as when its server was killed), and yet it is not free: a
        // second lock, like another process's, is refused.
        assert!(
            reserve(port).is_none(),
            "{port} is reserved until the process exits"
        );
    }
}
