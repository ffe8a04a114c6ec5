//! Shutdown: SIGTERM or SIGINT cancels a token that every task of the service watches. A
//! second signal exits at once, for an operator whose graceful stop is stuck.

use tokio_util::sync::CancellationToken;

/// A clonable shutdown signal; cancelled once, observed by everyone.
pub type Shutdown = CancellationToken;

/// Returns a token cancelled on the first SIGTERM/SIGINT. Must be called inside a runtime.
pub fn on_signals() -> std::io::Result<Shutdown> {
    use tokio::signal::unix::{SignalKind, signal};

    let token = Shutdown::new();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let cancel = token.clone();
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(signal = name, "shutting down");
        cancel.cancel();
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        tracing::warn!("second signal, exiting now");
        std::process::exit(130);
    });
    Ok(token)
}
