//! Child processes tied to this one: they get SIGKILL when this process dies, however it
//! dies (a `SIGKILL`, the OOM killer, a CI job's timeout), so a lab or a test killed hard
//! leaves no service or etcd running.
//!
//! Linux sends a child its parent-death signal when the *thread* that forked it exits, not the
//! process: children forked from a short-lived thread (tokio's blocking pool lets idle threads
//! go after seconds) would be killed at once. So every tied child is forked by one thread that
//! lives as long as the process.

use std::io;
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command};
use std::sync::OnceLock;
use std::sync::mpsc;

type Request = (Command, mpsc::Sender<io::Result<Child>>);

/// Starts `command` so that it is killed when this process dies.
#[allow(unsafe_code)]
pub fn spawn_tied(mut command: Command) -> io::Result<Child> {
    static SPAWNER: OnceLock<mpsc::Sender<Request>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("tied-spawner".into())
            .spawn(move || {
                // Never returns while the process lives: the senders are in a static.
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("the spawner thread starts");
        tx
    });
    let parent = std::process::id();
    // SAFETY: the closure runs in the forked child before exec and only makes two
    // async-signal-safe system calls (prctl, getppid).
    unsafe {
        command.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(io::Error::from)?;
            // The parent may have died between fork and prctl: then no signal comes.
            if u32::try_from(nix::unistd::getppid().as_raw()).ok() != Some(parent) {
                return Err(io::Error::other("the parent died while this child started"));
            }
            Ok(())
        });
    }
    let (reply, answer) = mpsc::channel();
    spawner
        .send((command, reply))
        .map_err(|_| io::Error::other("the spawner thread is gone"))?;
    answer
        .recv()
        .map_err(|_| io::Error::other("the spawner thread is gone"))?
}
