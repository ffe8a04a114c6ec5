//! `trellis-endpoints` binary.

fn main() -> std::process::ExitCode {
    trellis_runtime::launch::<trellis_endpoints::Config, _, _>(
        "trellis-endpoints",
        trellis_endpoints::run,
    )
}
