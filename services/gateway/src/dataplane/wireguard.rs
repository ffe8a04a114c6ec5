//! One WireGuard device per peer, userspace or kernel.
//!
//! **Userspace** devices are boringtun's `DeviceHandle`, driven over a private UAPI socket
//! pair instead of the `/var/run/wireguard/<name>.sock` listener that `defguard_wireguard_rs`'s
//! `WGApi<Userspace>` uses. The spike (docs/research/0001) found that path fragile: the
//! listener variant also registers signalfds for SIGTERM/SIGINT that steal the process's
//! shutdown signal (pitfall 1; the only workaround was `dup2` over the descriptors, which needs
//! `unsafe`), its socket names are host-global (pitfall 3), a stale socket file survives
//! SIGKILL (pitfall 7), and its stats read can hang (pitfall 2). With `uapi_fd` set, boringtun
//! registers neither the listener nor the signal handlers, and we own both ends of the
//! channel, with read timeouts.
//!
//! **Kernel** devices go through `defguard_wireguard_rs`'s `WGApi<Kernel>` (netlink).
//!
//! Every call here blocks (UAPI round trips, netlink): callers run them in `spawn_blocking`.

use std::fmt;
use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::os::fd::IntoRawFd as _;
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use defguard_boringtun::device::{DeviceConfig, DeviceHandle};
use defguard_wireguard_rs::host::Host;
use defguard_wireguard_rs::key::Key;
use defguard_wireguard_rs::net::IpAddrMask;
use defguard_wireguard_rs::peer::Peer;
use defguard_wireguard_rs::{InterfaceConfiguration, Kernel, WGApi, WireguardInterfaceApi};
use ipnet::IpNet;
use trellis_api::model::WgKey;

use crate::keys::{KeyPair, hex};

/// How long one UAPI round trip may take. boringtun answers in microseconds; a device whose
/// threads died never answers (pitfall 2), and must not hang the caller.
const UAPI_TIMEOUT: Duration = Duration::from_secs(2);

/// WireGuard's worst-case overhead: outer IPv6 40 + UDP 8 + WireGuard header 16 + auth tag 16.
/// A tunnel's MTU is the underlay's minus this, so a full tunnel packet never fragments on the
/// underlay whichever family carries it (1420 on a 1500-byte underlay). The tun default is
/// 1500 (pitfall 6); the spike measured 434 vs 368 Mbit/s with 1420.
pub const OVERHEAD: u32 = 80;

/// The tunnel MTU over an underlay of `underlay_mtu` bytes.
pub fn tunnel_mtu(underlay_mtu: u32) -> u32 {
    underlay_mtu.saturating_sub(OVERHEAD)
}

/// Which implementation drives a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    Userspace,
    Kernel,
}

/// What a device should be configured with.
#[derive(Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    pub name: String,
    pub listen_port: u16,
    pub peer_key: WgKey,
    pub peer_endpoint: SocketAddr,
    pub allowed_ips: Vec<IpNet>,
    pub keepalive: u16,
    pub mtu: u32,
}

impl fmt::Debug for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceSpec")
            .field("name", &self.name)
            .field("listen_port", &self.listen_port)
            .field("peer_endpoint", &self.peer_endpoint)
            .field("allowed_ips", &self.allowed_ips)
            .field("mtu", &self.mtu)
            .finish_non_exhaustive()
    }
}

/// Counters of the one peer of a device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerStats {
    pub last_handshake: Option<SystemTime>,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    /// Packets the device delivered (decrypted, from the peer) and took to send (towards the
    /// peer), from the interface's counters: WireGuard's own interface counts bytes only.
    /// `None` when the interface's counters cannot be read.
    pub rx_packets: Option<u64>,
    pub tx_packets: Option<u64>,
    pub endpoint: Option<SocketAddr>,
}

enum Inner {
    Userspace {
        /// `None` only while dropping, so the device stops before its channel closes.
        handle: Option<DeviceHandle>,
        api: UnixStream,
    },
    Kernel(WGApi<Kernel>),
}

/// A running WireGuard device with one peer.
pub struct Device {
    name: String,
    inner: Mutex<Inner>,
    /// The spec last applied, to skip no-op reconfigurations (setting the listen port again
    /// re-binds the UDP socket).
    applied: Mutex<Option<DeviceSpec>>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

fn io_err(what: impl fmt::Display) -> std::io::Error {
    std::io::Error::other(what.to_string())
}

impl Device {
    /// Creates the device (link down, unconfigured).
    pub fn create(flavor: Flavor, name: &str) -> std::io::Result<Self> {
        let inner = match flavor {
            Flavor::Userspace => {
                let (ours, theirs) = UnixStream::pair()?;
                ours.set_read_timeout(Some(UAPI_TIMEOUT))?;
                ours.set_write_timeout(Some(UAPI_TIMEOUT))?;
                let config = DeviceConfig {
                    // boringtun takes ownership of the descriptor (it wraps it in a UnixStream).
                    uapi_fd: theirs.into_raw_fd(),
                    ..DeviceConfig::default()
                };
                let handle = DeviceHandle::new(name, config)
                    .map_err(|e| io_err(format!("creating userspace device {name}: {e:?}")))?;
                Inner::Userspace {
                    handle: Some(handle),
                    api: ours,
                }
            }
            Flavor::Kernel => {
                let mut api = WGApi::<Kernel>::new(name.to_owned())
                    .map_err(|e| io_err(format!("kernel wireguard api for {name}: {e}")))?;
                api.create_interface()
                    .map_err(|e| io_err(format!("creating kernel device {name}: {e}")))?;
                Inner::Kernel(api)
            }
        };
        Ok(Self {
            name: name.to_owned(),
            inner: Mutex::new(inner),
            applied: Mutex::new(None),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Applies the key, port and peer, replacing any previous peer. A no-op when `spec` is
    /// what was applied last.
    pub fn configure(&self, key: &KeyPair, spec: &DeviceSpec) -> std::io::Result<()> {
        let mut applied = self.applied.lock().map_err(|_| io_err("poisoned lock"))?;
        if applied.as_ref() == Some(spec) {
            return Ok(());
        }
        let mut inner = self.inner.lock().map_err(|_| io_err("poisoned lock"))?;
        match &mut *inner {
            Inner::Userspace { api, .. } => {
                let mut request = format!(
                    "set=1\nprivate_key={}\nlisten_port={}\nreplace_peers=true\npublic_key={}\n\
                     endpoint={}\npersistent_keepalive_interval={}\nreplace_allowed_ips=true\n",
                    key.private_hex(),
                    spec.listen_port,
                    hex(spec.peer_key.as_bytes()),
                    spec.peer_endpoint,
                    spec.keepalive,
                );
                for net in &spec.allowed_ips {
                    request.push_str(&format!("allowed_ip={net}\n"));
                }
                request.push('\n');
                let reply = uapi(api, &request)?;
                if !reply.contains("errno=0") {
                    return Err(io_err(format!(
                        "device {} refused its configuration: {}",
                        self.name,
                        reply.trim()
                    )));
                }
            }
            Inner::Kernel(api) => {
                let mut peer = Peer::new(Key::new(*spec.peer_key.as_bytes()));
                peer.endpoint = Some(spec.peer_endpoint);
                peer.persistent_keepalive_interval = (spec.keepalive > 0).then_some(spec.keepalive);
                peer.allowed_ips = spec
                    .allowed_ips
                    .iter()
                    .map(|n| IpAddrMask::new(n.addr(), n.prefix_len()))
                    .collect();
                api.configure_interface(&InterfaceConfiguration {
                    name: self.name.clone(),
                    prvkey: key.private_base64(),
                    addresses: Vec::new(),
                    port: spec.listen_port,
                    peers: vec![peer],
                    mtu: Some(spec.mtu),
                    fwmark: None,
                })
                .map_err(|e| io_err(format!("configuring kernel device {}: {e}", self.name)))?;
            }
        }
        *applied = Some(spec.clone());
        Ok(())
    }

    /// The peer's counters, in bounded time.
    pub fn stats(&self) -> std::io::Result<PeerStats> {
        let mut inner = self.inner.lock().map_err(|_| io_err("poisoned lock"))?;
        let host = match &mut *inner {
            Inner::Userspace { api, .. } => {
                let reply = uapi(api, "get=1\n\n")?;
                Host::parse_uapi(std::io::Cursor::new(reply.into_bytes()))?
            }
            Inner::Kernel(api) => api
                .read_interface_data()
                .map_err(|e| io_err(format!("reading kernel device {}: {e}", self.name)))?,
        };
        Ok(host
            .peers
            .values()
            .next()
            .map(|p| PeerStats {
                last_handshake: p.last_handshake,
                rx_bytes: p.rx_bytes,
                tx_bytes: p.tx_bytes,
                rx_packets: interface_counter(&self.name, "rx_packets"),
                tx_packets: interface_counter(&self.name, "tx_packets"),
                endpoint: p.endpoint,
            })
            .unwrap_or_default())
    }
}

/// One of the interface's counters (`/sys/class/net/NAME/statistics/COUNTER`; sysfs shows the
/// reader's own network namespace, where the gateway keeps its devices).
fn interface_counter(name: &str, counter: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/sys/class/net/{name}/statistics/{counter}"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

impl Drop for Device {
    fn drop(&mut self) {
        let Ok(inner) = self.inner.get_mut() else {
            return;
        };
        match inner {
            // Stop the device threads first: once our end of the channel closes, boringtun
            // would otherwise answer EOF events until it notices the exit.
            Inner::Userspace { handle, .. } => drop(handle.take()),
            Inner::Kernel(api) => {
                // remove_interface also tries to reset DNS and fails without a DNS backend
                // (pitfall 5); the link is deleted before that step.
                if let Err(err) = api.remove_interface() {
                    tracing::debug!(interface = %self.name, error = %err, "remove_interface reported an error");
                }
            }
        }
    }
}

/// One UAPI request and its reply (everything up to the blank line after `errno=N`).
fn uapi(stream: &mut UnixStream, request: &str) -> std::io::Result<String> {
    stream.write_all(request.as_bytes())?;
    let mut reply = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(io_err("the device closed its control channel"));
        }
        reply.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&reply);
        if let Some(at) = text.rfind("errno=")
            && text[at..].contains("\n\n")
        {
            return Ok(text.into_owned());
        }
        if reply.len() > 1 << 20 {
            return Err(io_err("oversized reply from the device"));
        }
    }
}
