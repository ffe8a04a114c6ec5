//! The reference tunnels `dataplane-bench` compares Trellis's data plane with, each between two
//! gateway namespaces built by the same [`Topology`] code as Trellis's clusters (pod namespace,
//! gateway namespace, uplink on a bridge), configured by hand with `wg set` and plain routes:
//! Debian's `wireguard-go` (the userspace WireGuard the WireGuard authors maintain) and
//! `gotatun` (crate `gotatun-cli`), the device of GotaTun (Mullvad's continuation of
//! boringtun, the other crypto core a Rust engine could build on). Both speak the same
//! configuration protocol, so one harness runs either. **Root only.**
//!
//! The two sites get distinct pod CIDRs (10.1.0.0/16 and 10.2.0.0/16): the reference is the
//! tunnel alone, without Trellis's remapping NAT, so the comparison charges Trellis for its NAT.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use trellis_netlab::netns::{exec, ip};
use trellis_netlab::{Site, Topology};

/// The UDP port both devices listen on (each in its own namespace).
const PORT: u16 = 51820;
/// The tunnel MTU Trellis's gateways use too.
const MTU: &str = "1420";

/// A userspace WireGuard run as a reference: a process per gateway that makes its TUN and
/// takes its configuration from `wg set`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reference {
    WireguardGo,
    GotaTun,
}

impl Reference {
    /// The name the results and the report use.
    pub fn name(self) -> &'static str {
        match self {
            Reference::WireguardGo => "wireguard-go",
            Reference::GotaTun => "gotatun",
        }
    }

    /// The program to run (on `PATH`).
    pub fn program(self) -> &'static str {
        match self {
            Reference::WireguardGo => "wireguard-go",
            // The `gotatun-cli` crate's executable.
            Reference::GotaTun => "gotatun",
        }
    }

    /// A prefix for the interfaces, so both pairs can be up at once.
    fn prefix(self) -> &'static str {
        match self {
            Reference::WireguardGo => "wg",
            Reference::GotaTun => "gt",
        }
    }

    /// The arguments that run the device for interface `name` in the foreground.
    pub fn args(self, name: &str) -> Vec<String> {
        match self {
            Reference::WireguardGo => vec!["-f".into(), name.into()],
            // Dropping privileges would leave it unable to reconfigure the interface.
            Reference::GotaTun => {
                vec!["-f".into(), "--disable-drop-privileges".into(), name.into()]
            }
        }
    }

    /// The first line of `<program> --version` (e.g. `wireguard-go v0.0.20220316`).
    pub fn version(self) -> anyhow::Result<String> {
        let out = Command::new(self.program())
            .arg("--version")
            .output()
            .with_context(|| format!("running {} --version", self.program()))?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .map_or_else(
                || format!("{} (unknown version)", self.program()),
                |l| l.trim().to_owned(),
            ))
    }
}

/// Two gateway namespaces joined by a reference tunnel; the processes are killed and the
/// namespaces deleted on drop.
#[derive(Debug)]
pub struct ReferencePair {
    pub reference: Reference,
    // Dropped first: the processes must be gone before the namespaces are deleted.
    devices: Vec<Device>,
    /// Sites 0 and 1; the tunnel carries pod 0 ↔ pod 1.
    pub topology: Topology,
}

#[derive(Debug)]
struct Device {
    ns: String,
    name: String,
    process: Child,
    key_file: PathBuf,
}

impl Drop for Device {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
        let _ = ip(&["-n", &self.ns, "link", "del", &self.name]);
        // The control socket's path is host-wide (not per namespace) and outlives a killed
        // process.
        let _ = std::fs::remove_file(format!("/var/run/wireguard/{}.sock", self.name));
        let _ = std::fs::remove_file(&self.key_file);
    }
}

/// `program args…` in `ns`, failing with its stderr.
fn run(ns: &str, program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = exec(ns, program, args)?;
    if !out.status.success() {
        bail!(
            "{program} {} in {ns}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

impl ReferencePair {
    /// Builds the two sites, starts one device per gateway namespace, keys and peers them,
    /// routes each pod CIDR through the tunnel, and waits until pod 0 pings pod 1.
    pub async fn up(reference: Reference, limit: Duration) -> anyhow::Result<Self> {
        let p = reference.prefix();
        let topology = Topology::build(&[
            (&format!("{p}a"), "10.1.0.0/16"),
            (&format!("{p}c"), "10.2.0.0/16"),
        ])?;
        let mut this = Self {
            reference,
            devices: Vec::new(),
            topology,
        };
        for site in this.topology.sites.clone() {
            let device = start_device(reference, &this.topology.run, &site).await?;
            this.devices.push(device);
        }
        let mut public = Vec::new();
        for d in &this.devices {
            let key = Command::new("wg")
                .arg("genkey")
                .output()
                .context("running wg genkey")?;
            if !key.status.success() {
                bail!("wg genkey failed");
            }
            std::fs::write(&d.key_file, &key.stdout)
                .with_context(|| format!("writing {}", d.key_file.display()))?;
            let key_file = d.key_file.to_str().context("temp dir path is not UTF-8")?;
            run(
                &d.ns,
                "wg",
                &[
                    "set",
                    &d.name,
                    "private-key",
                    key_file,
                    "listen-port",
                    &PORT.to_string(),
                ],
            )?;
            public.push(run(&d.ns, "wg", &["show", &d.name, "public-key"])?);
            ip(&["-n", &d.ns, "link", "set", &d.name, "mtu", MTU, "up"])?;
            run(&d.ns, "sysctl", &["-qw", "net.ipv4.ip_forward=1"])?;
        }
        for (i, d) in this.devices.iter().enumerate() {
            let other = &this.topology.sites[1 - i];
            let endpoint = format!("{}:{PORT}", other.uplink_ip);
            let cidr = other.pod_cidr.to_string();
            run(
                &d.ns,
                "wg",
                &[
                    "set",
                    &d.name,
                    "peer",
                    &public[1 - i],
                    "endpoint",
                    &endpoint,
                    "allowed-ips",
                    &cidr,
                ],
            )?;
            ip(&["-n", &d.ns, "route", "add", &cidr, "dev", &d.name])?;
        }
        let (from, to) = (this.pod_ns(0).to_owned(), this.pod_ip(1));
        let deadline = Instant::now() + limit;
        while trellis_netlab::topology::ping_rtts(&from, to, 1, 0.2)?.is_empty() {
            if Instant::now() > deadline {
                bail!(
                    "pod 0 never reached pod 1 through {} within {limit:?}",
                    reference.name()
                );
            }
        }
        Ok(this)
    }

    /// The operating-system process IDs of the two devices' processes.
    pub fn pids(&self) -> Vec<u32> {
        self.devices.iter().map(|d| d.process.id()).collect()
    }

    /// The pod namespace of site `i`.
    pub fn pod_ns(&self, i: usize) -> &str {
        &self.topology.sites[i].pod_ns
    }

    /// The pod address of site `i` (the same on both sides of the tunnel: no NAT).
    pub fn pod_ip(&self, i: usize) -> Ipv4Addr {
        self.topology.sites[i].pod_ip
    }
}

/// Starts `reference`'s device in the foreground in `site`'s gateway namespace and waits for
/// its interface and its control socket.
async fn start_device(reference: Reference, run: &str, site: &Site) -> anyhow::Result<Device> {
    // Interface names are at most 15 bytes, and the control socket is named after the
    // interface host-wide: the run ID keeps concurrent runs apart.
    let name = format!("{}{run}{}", reference.prefix(), site.index);
    let process = Command::new("ip")
        .args(["netns", "exec", &site.gw_ns, reference.program()])
        .args(reference.args(&name))
        // Older wireguard-go releases refuse to run on Linux without it.
        .env("WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", reference.program()))?;
    let device = Device {
        ns: site.gw_ns.clone(),
        name,
        process,
        key_file: std::env::temp_dir().join(format!("trellis-dpbench-{run}-{}.key", site.index)),
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while ip(&["-n", &device.ns, "link", "show", &device.name]).is_err()
        || !std::path::Path::new(&format!("/var/run/wireguard/{}.sock", device.name)).exists()
    {
        if Instant::now() > deadline {
            bail!(
                "{} made no {} in {}",
                reference.program(),
                device.name,
                device.ns
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(device)
}
