//! Free loopback ports for servers started by tests.
//!
//! Ports are taken below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`,
//! 32768-60999 by default). Outgoing connections take their source ports from that range, so a
//! server restarted on its old port (an etcd after kill -9, as the chaos tests do) could find it
//! held by some client's connection for as long as that connection lives. Below the range only
//! servers started by tests compete for ports, and each pick is checked by binding it.

use std::net::{Ipv4Addr, TcpListener};
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
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return port;
        }
    }
    // Everything below the range is taken: the kernel's pick, as before.
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .unwrap_or_else(|err| panic!("cannot bind a loopback port: {err}"))
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
}
