//! The body of every service's `main`: parse the config, start the Tokio runtime, telemetry
//! and signal handling, run the service, flush spans, turn an error into a message and a
//! non-zero exit code.

use std::future::Future;
use std::process::ExitCode;

use clap::Parser;

use crate::config::HasBase;
use crate::shutdown::{self, Shutdown};
use crate::telemetry::{self, ServiceIdentity};

/// Runs service `service` (e.g. `trellis-ipam`) with `run(config, shutdown)`.
pub fn launch<C, F, Fut>(service: &'static str, run: F) -> ExitCode
where
    C: Parser + HasBase,
    F: FnOnce(C, Shutdown) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    crate::allocator::tune();
    let data_plane = DATA_PLANE.contains(&service);
    // Before telemetry is up; a kernel without the flag only keeps its huge pages.
    let small_pages = (!data_plane)
        .then(crate::allocator::small_pages)
        .transpose();
    let config = C::parse();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = worker_threads(data_plane, config.base().worker_threads) {
        builder.worker_threads(threads);
    }
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("{service}: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        let common = config.base();
        let identity = ServiceIdentity {
            service,
            cluster_id: common.cluster_id.clone(),
            cluster_name: common.cluster_name().to_owned(),
        };
        let telemetry = telemetry::init(&identity, common.log_format)?;
        if let Err(err) = small_pages {
            tracing::warn!(error = %err, "cannot turn transparent huge pages off; the service uses more memory");
        }
        let shutdown = shutdown::on_signals()?;
        let result = run(config, shutdown).await;
        if let Err(err) = &result {
            tracing::error!(error = format!("{err:#}"), "service failed");
        }
        telemetry.shutdown().await;
        result
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("{service}: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// The services that move packets: the gateway, whose userspace tunnels carry every packet
/// through its heap and its threads. They keep what the control-plane services give up (ADR
/// 0015): transparent huge pages (its tunnel throughput was 1-6 % lower without them) and
/// Tokio's pool of one runtime thread per core.
const DATA_PLANE: &[&str] = &["trellis-gateway"];

/// The runtime threads of a service: `configured` (`--worker-threads`), else 1, or Tokio's
/// default (one per core, or `TOKIO_WORKER_THREADS`) for a [`DATA_PLANE`] service.
///
/// Why one: at 100 leaves the hub's five processes spent 0.069-0.085 ms of CPU per induced
/// tunnel on one thread each against 0.086-0.102 ms on a pool of two (four alternating pairs
/// on a 2-core machine), and converged sooner (ADR 0015).
fn worker_threads(data_plane: bool, configured: Option<u16>) -> Option<usize> {
    match configured {
        Some(n) => Some(usize::from(n)),
        None if data_plane => None,
        None => Some(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_plane_services_run_on_one_thread_unless_told_otherwise() {
        assert!(DATA_PLANE.contains(&"trellis-gateway"));
        for service in ["trellis-forwarder", "trellis-ipam", "trellis-route"] {
            assert!(!DATA_PLANE.contains(&service), "{service}");
        }
        assert_eq!(worker_threads(false, None), Some(1));
        assert_eq!(worker_threads(false, Some(4)), Some(4));
        assert_eq!(worker_threads(true, None), None);
        assert_eq!(worker_threads(true, Some(2)), Some(2));
    }
}
