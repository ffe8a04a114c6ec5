//! `trellis-gateway` binary.

fn main() -> std::process::ExitCode {
    trellis_runtime::launch::<trellis_gateway::Config, _, _>(
        "trellis-gateway",
        trellis_gateway::run,
    )
}
