//! `trellis-broker` binary.

fn main() -> std::process::ExitCode {
    trellis_runtime::launch::<trellis_broker::Config, _, _>("trellis-broker", trellis_broker::run)
}
