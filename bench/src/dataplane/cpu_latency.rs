//! The kernel's CPU latency limit (`/dev/cpu_dma_latency`, the PM QoS interface): how long an
//! idle CPU may take to wake. With no limit, an idle vCPU of a virtual machine halts, and waking
//! it costs a VM exit and entry; with a limit below the halt state's exit latency, the kernel
//! polls on idle CPUs instead (every core then burns while idle). Each wake-up of a gateway's
//! threads after an idle gap pays this, so `dataplane-bench` records the limit a run had and can
//! hold one for the run (`--cpu-latency-us`), as a low-latency node tuning would.

use std::fs::{File, OpenOptions};
use std::io::{Read as _, Write as _};

use anyhow::Context as _;

use crate::results::CpuLatencyLimit;

const DEVICE: &str = "/dev/cpu_dma_latency";

/// The kernel's value for "no limit" (2,000 s).
const NO_LIMIT_US: i32 = 2_000_000_000;

/// A limit held for as long as this lives: the kernel drops the request when the file closes,
/// so a benchmark killed midway leaves nothing behind.
#[derive(Debug)]
pub struct Hold {
    _file: File,
}

/// Asks the kernel to keep every CPU's wake-up latency at or under `us` microseconds.
pub fn hold(us: u32) -> anyhow::Result<Hold> {
    let value = i32::try_from(us).context("--cpu-latency-us is out of range")?;
    let mut file = OpenOptions::new()
        .write(true)
        .open(DEVICE)
        .with_context(|| format!("opening {DEVICE} (needs root)"))?;
    file.write_all(&value.to_ne_bytes())
        .with_context(|| format!("writing a {us} µs limit to {DEVICE}"))?;
    Ok(Hold { _file: file })
}

/// The limit in force, or `None` when it cannot be read (not root, no such device).
pub fn limit() -> Option<CpuLatencyLimit> {
    let mut bytes = [0u8; 4];
    File::open(DEVICE).ok()?.read_exact(&mut bytes).ok()?;
    Some(decode(i32::from_ne_bytes(bytes)))
}

fn decode(value: i32) -> CpuLatencyLimit {
    match u32::try_from(value) {
        Ok(us) if value < NO_LIMIT_US => CpuLatencyLimit::Microseconds(us),
        _ => CpuLatencyLimit::None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_default_reads_as_no_limit_and_a_limit_as_itself() {
        assert_eq!(decode(NO_LIMIT_US), CpuLatencyLimit::None);
        assert_eq!(decode(0), CpuLatencyLimit::Microseconds(0));
        assert_eq!(decode(20), CpuLatencyLimit::Microseconds(20));
        assert_eq!(decode(-1), CpuLatencyLimit::None);
    }

    /// The kernel keeps the smallest limit anyone holds, so another holder may lower what is
    /// read but never raise it above ours.
    #[test]
    fn a_held_limit_is_in_force_until_it_is_dropped() {
        if !trellis_netlab::netns::can_run("a_held_limit_is_in_force_until_it_is_dropped", &[]) {
            return;
        }
        let held = hold(7).expect("holds a limit");
        match limit() {
            Some(CpuLatencyLimit::Microseconds(us)) => assert!(us <= 7, "{us} µs in force"),
            other => panic!("a held 7 µs limit reads as {other:?}"),
        }
        drop(held);
        assert!(limit().is_some(), "the limit is still readable");
        assert!(
            hold(u32::MAX).is_err(),
            "a limit the device cannot take is refused"
        );
    }
}
