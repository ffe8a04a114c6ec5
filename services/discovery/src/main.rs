//! `trellis-discovery` binary.

fn main() -> std::process::ExitCode {
    trellis_runtime::launch::<trellis_discovery::Config, _, _>(
        "trellis-discovery",
        trellis_discovery::run,
    )
}
