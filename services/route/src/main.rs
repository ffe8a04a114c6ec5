//! `trellis-route` binary.

fn main() -> std::process::ExitCode {
    trellis_runtime::launch::<trellis_route::Config, _, _>("trellis-route", trellis_route::run)
}
