//! One WireGuard interface per peer, userspace or kernel.
//!
//! **Userspace** interfaces are TUN interfaces of our own [`Engine`],
//! which owns the gateway's one WireGuard UDP port for every peer (ADR 0022). A device here is
//! one peer of the engine; nothing is spoken over a UAPI socket any more, so the spike's
//! pitfalls of boringtun's `DeviceHandle` (stolen signals, host-global socket names, stale
//! socket files, hanging stats reads; docs/research/0001) do not arise.
//!
//! **Kernel** devices go through `defguard_wireguard_rs`'s `WGApi<Kernel>` (netlink), each with
//! its own listen port: kernel WireGuard cannot share one port between interfaces (ADR 0022
//! designs the one-port variant; it is not built yet).
//!
//! Every call here may block (netlink, TUN creation): callers run them in `spawn_blocking`.

use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use defguard_wireguard_rs::key::Key;
use defguard_wireguard_rs::net::IpAddrMask;
use defguard_wireguard_rs::peer::Peer;
use defguard_wireguard_rs::{InterfaceConfiguration, Kernel, WGApi, WireguardInterfaceApi};
use ipnet::IpNet;
use trellis_api::model::WgKey;

use super::engine::translate::Translation;
use super::engine::{Engine, PeerConfig};
use crate::keys::KeyPair;

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
#[derive(Debug, Clone)]
pub enum Flavor {
    /// A peer of the userspace engine (one UDP port for all).
    Userspace(Arc<Engine>),
    /// A kernel WireGuard interface with its own listen port.
    Kernel,
}

/// What a device should be configured with.
#[derive(Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    pub name: String,
    /// The kernel interface's listen port (userspace peers share the engine's).
    pub listen_port: u16,
    pub peer_key: WgKey,
    pub peer_endpoint: SocketAddr,
    /// Other places the peer may be reached (the userspace engine probes them until the peer
    /// answers; a kernel device has one endpoint and ignores them).
    pub peer_candidates: Vec<SocketAddr>,
    /// The hub the peer is relayed through when it cannot be reached directly, and whether we
    /// relay for it (userspace only; ADR 0025).
    pub relay_via: Option<WgKey>,
    pub relayable: bool,
    pub allowed_ips: Vec<IpNet>,
    pub keepalive: u16,
    pub mtu: u32,
    /// What the userspace engine rewrites in every packet it sends the peer (ADR 0032's
    /// stateless wire convention); a kernel device cannot, and is never given one.
    pub translation: Option<Translation>,
}

impl fmt::Debug for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceSpec")
            .field("name", &self.name)
            .field("listen_port", &self.listen_port)
            .field("peer_endpoint", &self.peer_endpoint)
            .field("peer_candidates", &self.peer_candidates)
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
    /// Whether the peer's datagrams go through a hub's relay now (userspace only).
    pub relayed: bool,
}

enum Inner {
    Userspace {
        engine: Arc<Engine>,
        /// The peer's index in the engine, once configured.
        index: Option<u32>,
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
    /// Creates the device (kernel: link down, unconfigured; userspace: the TUN interface
    /// appears with the first configuration).
    pub fn create(flavor: &Flavor, name: &str) -> std::io::Result<Self> {
        let inner = match flavor {
            Flavor::Userspace(engine) => Inner::Userspace {
                engine: engine.clone(),
                index: None,
            },
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
            Inner::Userspace { engine, index } => {
                // The engine holds our key already (one key pair for every peer).
                let _ = key;
                let config = PeerConfig {
                    public_key: *spec.peer_key.as_bytes(),
                    endpoint: spec.peer_endpoint,
                    allowed_ips: spec.allowed_ips.clone(),
                    keepalive: spec.keepalive,
                    candidates: spec.peer_candidates.clone(),
                    relay_via: spec.relay_via.map(|k| *k.as_bytes()),
                    relayable: spec.relayable,
                    translation: spec.translation.clone(),
                };
                match *index {
                    Some(i) => engine.update_peer(i, &config)?,
                    None => *index = Some(engine.add_peer(&self.name, &config)?),
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
            Inner::Userspace { engine, index } => {
                let counters = index
                    .and_then(|i| engine.counters(i))
                    .ok_or_else(|| io_err(format!("{} is not configured", self.name)))?;
                return Ok(PeerStats {
                    last_handshake: counters.last_handshake,
                    rx_bytes: counters.rx_bytes,
                    tx_bytes: counters.tx_bytes,
                    rx_packets: interface_counter(&self.name, "rx_packets"),
                    tx_packets: interface_counter(&self.name, "tx_packets"),
                    endpoint: counters.endpoint,
                    relayed: counters.relayed,
                });
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
                relayed: false,
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
            Inner::Userspace { engine, index } => {
                if let Some(i) = index.take() {
                    engine.remove_peer(i);
                }
            }
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
