//! `trellis-forwarder` binary.

fn main() -> std::process::ExitCode {
    trellis_runtime::launch::<trellis_forwarder::Config, _, _>(
        "trellis-forwarder",
        trellis_forwarder::run,
    )
}
