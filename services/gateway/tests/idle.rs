//! A gateway that has no desired set yet (its broker not answering, or none given) waits
//! without working: its reconciliation loop must sleep until a change or the next resync. It
//! used to leave its repair timer in the past once the first resync interval had passed, and
//! then turned as fast as it could: one core of the gateway's node burnt while its broker was
//! away (found in the hub-on-etcd benchmark, where the hub's gateway took 23 of the hub's 44
//! CPU-seconds without doing anything).

// Tests spawn plainly: there is no service subscriber to keep (services/clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::time::Duration;

use clap::Parser;
use trellis_gateway::Config;
use trellis_runtime::Shutdown;

/// This process's CPU time (user + system), from /proc/self/stat, in seconds.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // The fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the name and state.
    let ticks: f64 =
        fields[11].parse::<f64>().expect("utime") + fields[12].parse::<f64>().expect("stime");
    // /proc counts in USER_HZ, which Linux fixes at 100 for user space.
    ticks / 100.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_without_its_desired_set_sleeps_between_resyncs() {
    let config = Config::try_parse_from([
        "trellis-gateway",
        "--listen",
        "127.0.0.1:0",
        "--store",
        "memory://",
        "--cluster-id",
        "a",
        "--dataplane",
        "none",
        "--resync-interval",
        "1",
    ])
    .expect("config parses");
    let shutdown = Shutdown::new();
    let _started = trellis_gateway::start(config, shutdown.clone())
        .await
        .expect("starts");
    // Past the first resync deadline, then two seconds of nothing to do.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = cpu_seconds();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let spent = cpu_seconds() - before;
    shutdown.cancel();
    // A spinning loop spends about a core (two seconds here); waiting costs next to nothing.
    assert!(
        spent < 0.4,
        "the gateway spent {spent:.2} CPU-seconds in 2 s with nothing to do"
    );
}
