//! `trellisctl`: the operator CLI of Trellis, over the gRPC APIs of one cluster's services.
//!
//! - [`cli`]: flags and subcommands (clap), validated before anything is sent;
//! - [`service`]: the services of a cluster and where each is expected; [`connect`]: eager
//!   connects, connection failures in words;
//! - [`error`]: the failures and their exit codes (2 usage, 1 everything else);
//! - [`output`], [`table`], [`units`], [`names`]: JSON documents from our own serde structs, and
//!   their fixed-width table forms;
//! - one module per command: [`token`], [`peering`] (`peer`, `unpeer`), [`status`], [`diagnose`],
//!   [`ipam`],
//!   [`endpoints`] (with [`slice_file`] for `endpoints reflect --file`); [`identity`] holds the
//!   views they share.
//!
//! [`run`] is the whole program; `main.rs` only calls it.

pub mod certs;
pub mod cli;
pub mod connect;
pub mod diagnose;
pub mod endpoints;
pub mod error;
pub mod identity;
pub mod ipam;
pub mod names;
pub mod output;
pub mod peering;
pub mod service;
pub mod slice_file;
pub mod status;
pub mod table;
pub mod token;
pub mod units;

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::SystemTime;

use clap::Parser as _;

use crate::cli::{Cli, Command, EndpointsAction, IpamAction};
use crate::error::CtlError;
use crate::output::emit;

/// Parses `args` (program name first), runs the command, prints its result on stdout and any
/// error on stderr as `error: ...`, and returns the exit code: 0 success, 1 failure, 2 usage.
pub fn run<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(err) => {
            // --help and --version are "errors" with exit code 0; usage errors exit 2.
            let _ = err.print();
            return ExitCode::from(u8::try_from(err.exit_code()).unwrap_or(2));
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(execute(&cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::from(err.exit_code())
        }
    }
}

/// Runs one parsed command.
pub async fn execute(cli: &Cli) -> Result<(), CtlError> {
    let globals = &cli.globals;
    let format = globals.output;
    match &cli.command {
        Command::Token(args) => emit(&token::run(globals, args).await?, format),
        Command::Peer(args) => emit(&peering::peer(globals, args).await?, format),
        Command::Unpeer(args) => emit(&peering::unpeer(globals, args).await?, format),
        Command::Status(args) => {
            let mut view = Box::pin(status::run(globals, SystemTime::now())).await;
            if !args.all {
                view.hide_withdrawn();
            }
            emit(&view, format)?;
            if view.nothing_answered() {
                return Err(CtlError::Failed(
                    "no service of the cluster answered; check the addresses (--discovery, \
                     --broker, --forwarder, --ipam, --endpoints, --gateway or TRELLIS_*)"
                        .into(),
                ));
            }
            Ok(())
        }
        Command::Diagnose(args) => {
            let view = Box::pin(diagnose::run(
                globals,
                args.tls_dir.as_deref(),
                SystemTime::now(),
            ))
            .await;
            emit(&view, format)?;
            if !view.healthy {
                return Err(CtlError::Failed(format!(
                    "{} problem{} found",
                    view.findings.len(),
                    if view.findings.len() == 1 { "" } else { "s" }
                )));
            }
            Ok(())
        }
        Command::Certs(args) => {
            let output = certs::run(globals, args).await?;
            emit(&output, format)?;
            if let certs::CertsOutput::Rotated(view) = &output {
                let waiting = view.peers.iter().filter(|p| !p.pinned).count();
                if waiting > 0 {
                    return Err(CtlError::Failed(format!(
                        "{waiting} peer{} do not pin the new CA yet (they verify through the \
                         cross certificate meanwhile); run the command again to go on",
                        if waiting == 1 { "" } else { "s" }
                    )));
                }
            }
            Ok(())
        }
        Command::Ipam(args) => match &args.action {
            None => emit(&ipam::list(globals).await?, format),
            Some(IpamAction::Map(map)) => emit(&ipam::map(globals, map).await?, format),
        },
        Command::Endpoints(args) => match &args.action {
            None => emit(&endpoints::list(globals, args).await?, format),
            Some(EndpointsAction::Reflect(reflect)) => {
                emit(&endpoints::reflect(globals, reflect).await?, format)
            }
        },
        Command::Export(args) => emit(&endpoints::export(globals, args).await?, format),
        Command::Unexport(args) => emit(&endpoints::unexport(globals, args).await?, format),
    }
}
