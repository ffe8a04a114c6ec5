//! Helpers shared by tests across the Trellis workspace.
//!
//! - [`tool_path`] / [`require_tool`]: find external tools (etcd, grpcurl, ...) on `PATH` or in
//!   the workspace's `.tools/bin`, and skip a test loudly without them (or fail it in CI);
//! - [`free_port`]: a loopback port nobody listens on;
//! - [`Etcd`]: a real single-node etcd process in a temporary directory;
//! - [`FakeApiServer`]: a fake Kubernetes API server speaking the real HTTP/JSON protocol
//!   (ADR 0019 says what it does not model);
//! - [`rng::Rng`]: seeded randomness for property and chaos tests, the seed printed and
//!   replayable;
//! - [`wireguard::Forger`]: forged WireGuard handshake initiations naming a key the sender does
//!   not hold, for tests of a gateway under hostile handshakes;
//! - [`SilentRelay`]: a TCP relay a test turns silent (swallows everything, closes nothing), to
//!   play a crashed node or a dropping partition on loopback;
//! - [`spawn_tied`]: a child process killed when this process dies, however it dies;
//! - [`eventually()`] / [`eventually_eq`] (and [`within`] / [`within_eq`], which return the
//!   timeout instead of panicking): the one poller every test waits with;
//! - [`Service`]: the Trellis services a lab or a test starts as processes;
//! - [`exports::export_request`]: the service export the endpoint tests send;
//! - [`peering`]: one cluster peering with another ([`peering::peer`]), a discovery service told
//!   of a full peer ([`peering::full_peering`]).
//!
//! This is a dev-dependency: its helpers panic with a clear message where a test should fail.

mod etcd;
mod etcd_tls;
mod eventually;
pub mod exports;
mod kube_fake;
pub mod peering;
mod ports;
pub mod rng;
mod service;
mod silent;
mod tied;
mod tools;
pub mod wireguard;

pub use etcd::Etcd;
pub use etcd_tls::EtcdTlsFiles;
pub use eventually::{Observation, POLL, TimedOut, eventually, eventually_eq, within, within_eq};
pub use kube_fake::FakeApiServer;
pub use ports::free_port;
pub use service::{PLAINTEXT_PEERING, Service};
pub use silent::SilentRelay;
pub use tied::spawn_tied;
pub use tools::{in_ci, require_tool, tool_path, workspace_root};
