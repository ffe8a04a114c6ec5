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
    // Before telemetry is up; a kernel without the flag only keeps its huge pages.
    let small_pages = crate::allocator::small_pages(service);
    let config = C::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
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
