//! `trellis-lab` binary.

fn main() -> std::process::ExitCode {
    trellis_lab::main()
}
