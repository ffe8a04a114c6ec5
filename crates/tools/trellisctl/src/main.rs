//! `trellisctl` binary: everything happens in [`trellisctl::run`].

fn main() -> std::process::ExitCode {
    trellisctl::run(std::env::args_os())
}
