//! Free loopback ports for servers started by tests.

use std::net::{Ipv4Addr, TcpListener};

/// A port on 127.0.0.1 that was free a moment ago (the OS picked it and it was released).
///
/// Another process may grab it before the caller binds it; servers started on it should be
/// retried on a fresh port if binding fails.
///
/// # Panics
///
/// If no loopback port can be bound at all, which no test could survive anyway.
pub fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .unwrap_or_else(|err| panic!("cannot bind a loopback port: {err}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_bindable() {
        let port = free_port();
        assert_ne!(port, 0);
        TcpListener::bind((Ipv4Addr::LOCALHOST, port)).expect("port is free");
    }
}
