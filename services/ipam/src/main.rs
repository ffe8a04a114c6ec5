//! `trellis-ipam` binary.

fn main() -> std::process::ExitCode {
    trellis_runtime::launch::<trellis_ipam::Config, _, _>("trellis-ipam", trellis_ipam::run)
}
