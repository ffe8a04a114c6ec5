//! What every Trellis service binary shares, so that a service's `main.rs` stays a few lines:
//!
//! - [`config`]: the common flags (`--listen`, `--store`, `--cluster-id`, ...) with their
//!   `TRELLIS_*` environment variables;
//! - [`telemetry`]: logs through `tracing`, spans exported over OTLP with the resource
//!   attributes docs/architecture.md lists;
//! - [`propagation`]: W3C trace context carried across gRPC, server and client side;
//! - [`bootstrap`]: the one start-up sequence of a service (listeners, identity, store,
//!   cluster-facing listener, supervised tasks), ending in one generic [`Started`];
//! - [`server`]: a gRPC server that always serves health and reflection (v1 and v1alpha,
//!   built once per process: [`reflection`]);
//! - [`client`]: channels to other services with timeouts and trace propagation;
//! - [`retry`]: the one retry policy: the waits after a failure (one, or per key), which
//!   failures are worth another attempt, and a call retried while they are; [`resync`]: when a
//!   reconciler's periodic pass over everything is due;
//! - [`batch`]: many unary calls to one server carried by one batch call, client and server
//!   side;
//! - [`foreign_clusters`]: a watch-fed copy of the local discovery service's ForeignClusters,
//!   for the checks made on every relayed or received NetworkConfig;
//! - [`cmd`]: running `ip` and `nft` for the processes that program the kernel (gateway,
//!   route agent);
//! - [`shutdown`]: SIGTERM/SIGINT to a cancellation token, graceful drain; [`supervise`]: a
//!   background task or thread that fails fails the service, so that it is restarted;
//! - [`metrics`]: Prometheus metrics on `--metrics-listen`, gRPC server metrics for free;
//! - [`launch()`]: the `main` of every service binary;
//! - [`tls`], [`peer`]: mutual TLS between clusters and the authorization of cluster-facing
//!   RPCs (ADR 0014);
//! - [`local_auth`]: the local token this cluster's own callers present on the plaintext
//!   listener (ADR 0020);
//! - [`admission`]: the one tower service both of those checks run in; [`log_limit`]: the
//!   warnings any remote party can trigger, one per period;
//! - [`allocator`]: mimalloc (v2) as the global allocator of every binary linking this crate,
//!   [`allocator::tune`], its options for a long-running service, and
//!   [`allocator::small_pages`], which keeps a service's heap off transparent huge pages.
//!
//! The domain error type and its gRPC table are re-exported from `trellis-error`.
//!
//! The modules form layers, each using only modules listed before it (`tests/layering.rs`
//! fails on an import cycle):
//!
//! 1. none of the others (or only `shutdown`): `shutdown`, `supervise`, `telemetry`, `retry`, `resync`,
//!    `log_limit`, `admission`, `exposition`, `reflection`, `cmd`, `allocator`;
//! 2. `metrics`, `local_auth`, then `propagation`;
//! 3. `client`, then what builds on its channels: `tls`, `batch`, `foreign_clusters`;
//! 4. `config` (its flags load the TLS material, so it sits above `tls`) and `peer`;
//! 5. `server` and `launch`, which put the rest together, and `bootstrap`, the start-up
//!    sequence on top of the server.
//!
//! Logs sit at the bottom so that everything can log: [`telemetry`] owns the log format its
//! flag selects ([`config::LogFormat`] is a re-export).

pub mod admission;
pub mod allocator;
pub mod batch;
pub mod bootstrap;
pub mod client;
pub mod cmd;
pub mod config;
pub mod exposition;
pub mod foreign_clusters;
pub mod launch;
pub mod local_auth;
pub mod log_limit;
pub mod metrics;
pub mod peer;
pub mod propagation;
pub mod reflection;
pub mod resync;
pub mod retry;
pub mod server;
pub mod shutdown;
pub mod supervise;
pub mod telemetry;
pub mod timer;
pub mod tls;

pub use bootstrap::{Bootstrap, Opened, Service, Started};
pub use config::CommonConfig;
pub use launch::launch;
pub use shutdown::Shutdown;
pub use trellis_error::{Error, Result};
