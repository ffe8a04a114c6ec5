//! One peer's tunnel: its device (a TUN of the engine, or a kernel device) created,
//! configured and brought up, its endpoint resolved on every pass, its routes and its table.
//! A pass that finds the peer's plan and resolved endpoint unchanged configures nothing; a
//! device that fails is removed, so the next pass builds it anew.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use ipnet::IpNet;
use trellis_api::model::{Endpoint, PeeringKind, WgKey};

use super::Linux;
use super::routes::refuse;
use crate::dataplane::PeerPlan;
use crate::dataplane::cmd::{self, ip};
use crate::dataplane::wireguard::{Device, DeviceSpec, Flavor};

/// How long to wait for a removed interface to disappear before creating one of the same name.
const LINK_GONE_TIMEOUT: Duration = Duration::from_secs(3);

/// How long resolving a peer's endpoint name may take before this pass gives up on that peer
/// (the reconciler's next pass retries).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

impl Linux {
    pub(super) async fn apply_peer(
        &mut self,
        plan: &PeerPlan,
        relay_via: Option<WgKey>,
    ) -> anyhow::Result<()> {
        let id = &plan.endpoint.remote.id;
        let mut created = false;
        let device = match self.devices.get(id) {
            Some(d) if d.name() == plan.interface => d.clone(),
            _ => {
                created = true;
                if let Some(old) = self.devices.remove(id) {
                    remove_device(old).await;
                }
                let (flavor, name) = (self.flavor.clone(), plan.interface.clone());
                let device = tokio::task::spawn_blocking(move || Device::create(&flavor, &name))
                    .await
                    .context("device creation task")??;
                let device = Arc::new(device);
                tracing::info!(peer = %id, interface = %plan.interface, slot = plan.slot, listen_port = plan.listen_port, "created wireguard interface");
                self.devices.insert(id.clone(), device.clone());
                device
            }
        };
        let peer_endpoint = resolve(&plan.endpoint.remote_endpoint).await?;
        let done = (plan.clone(), peer_endpoint, relay_via);
        if !created && self.applied.peers.get(id) == Some(&done) {
            return Ok(());
        }
        // Whatever fails below leaves the peer to be configured again by the next pass.
        self.applied.peers.remove(id);
        let spec = DeviceSpec {
            name: plan.interface.clone(),
            listen_port: plan.listen_port,
            peer_key: plan.endpoint.remote_public_key,
            peer_endpoint,
            peer_candidates: plan.endpoint.remote_candidates.clone(),
            relay_via,
            relayable: plan.endpoint.kind == PeeringKind::Full,
            allowed_ips: plan.allowed_ips(),
            keepalive: self.keepalive,
            mtu: self.mtu,
            translation: plan.translation(),
        };
        let (key, configured) = (self.key.clone(), device.clone());
        let result = tokio::task::spawn_blocking(move || configured.configure(&key, &spec))
            .await
            .context("device configuration task")?;
        if let Err(err) = result {
            // A device that cannot be configured (or whose control channel broke, or whose
            // peer changed its key) is rebuilt on the next pass. Our own handle goes first:
            // the interface disappears only with the last one, and the removal waits for that.
            drop(device);
            if let Some(old) = self.devices.remove(id) {
                remove_device(old).await;
            }
            return Err(err).context("configuring the wireguard device");
        }
        let name = plan.interface.as_str();
        // The tunnels carry IPv4 only: without this, the kernel's IPv6 link-local chatter
        // (router solicitations, MLD reports) goes through the tunnel and the peer drops it,
        // counted as `source_not_allowed`. Best effort (read-only /proc/sys in a container).
        let ipv6 = format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6");
        if let Err(err) = tokio::fs::write(&ipv6, "1").await {
            tracing::debug!(interface = name, error = %err, "could not disable ipv6 on the tunnel");
        }
        ip(&[
            "link",
            "set",
            "dev",
            name,
            "mtu",
            &self.mtu.to_string(),
            "up",
        ])
        .await?;
        cmd::sysctl(&format!("conf/{name}/rp_filter"), "0").await?;
        let own = self.own_networks().await?;
        let (routed, refused) = refuse(&plan.routed(), &own);
        self.record_refused(id, name, &refused);
        let routed = if self.active { routed } else { Vec::new() };
        for net in &routed {
            ip(&["route", "replace", &net.to_string(), "dev", name]).await?;
        }
        // Routes of an earlier version of this peer's TunnelEndpoint (its NAT view changed).
        let listed = ip(&["-o", "-4", "route", "show", "dev", name]).await?;
        for stale in listed
            .lines()
            .filter_map(|l| l.split_whitespace().next()?.parse::<IpNet>().ok())
            .filter(|n| !routed.contains(n))
        {
            ip(&["route", "del", &stale.to_string(), "dev", name]).await?;
        }
        let table = plan.table().to_string();
        ip(&["route", "replace", "default", "dev", name, "table", &table]).await?;
        // The engine starts a handshake itself when it adds a peer.
        if created
            && matches!(self.flavor, Flavor::Kernel)
            && let Some(target) = routed.first()
        {
            kick_handshake(name, *target).await;
        }
        self.applied.peers.insert(id.clone(), done);
        *self.configurations.entry(id.clone()).or_default() += 1;
        Ok(())
    }
}

/// The socket address WireGuard sends to: the endpoint's IP, or its DNS name resolved now (on
/// every pass, so a name that moves to another address is followed). Of several addresses the
/// lowest IPv4 one is taken (else the lowest IPv6), so an unchanged answer in another order does
/// not reconfigure the device.
async fn resolve(endpoint: &Endpoint) -> anyhow::Result<SocketAddr> {
    if let Some(addr) = endpoint.socket_addr() {
        return Ok(addr);
    }
    let target = endpoint.to_string();
    let found = tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host(target.clone()))
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "resolving the remote endpoint {target}: no answer in {RESOLVE_TIMEOUT:?}"
            )
        })?
        .with_context(|| format!("resolving the remote endpoint {target}"))?;
    let chosen = pick(found).with_context(|| {
        format!("resolving the remote endpoint {target}: the name has no address")
    })?;
    tracing::debug!(endpoint = %target, address = %chosen, "resolved the remote endpoint");
    Ok(chosen)
}

/// The lowest IPv4 address of `found`, else the lowest IPv6 one.
fn pick(found: impl IntoIterator<Item = SocketAddr>) -> Option<SocketAddr> {
    found.into_iter().min_by_key(|a| (a.is_ipv6(), *a))
}

/// Makes a new device handshake now. A restarted gateway's devices have no session, while its
/// peers still hold the old one: they keep encrypting with it and only re-handshake after
/// sending unanswered for 15 s (KEEPALIVE_TIMEOUT + REKEY_TIMEOUT), or when our persistent
/// keepalive first fires (boringtun waits a whole interval; the kernel sends one at
/// configuration). Any packet routed into the device starts a handshake, so we send one empty UDP
/// datagram to the discard port of the peer's routed range, with TTL 1: whatever the peer's
/// gateway does with it after decrypting (drop it for a source outside our AllowedIPs, or NAT it),
/// it is never forwarded. Best effort: a failure only means the slow path.
async fn kick_handshake(interface: &str, target: IpNet) {
    let sent = async {
        let socket = tokio::net::UdpSocket::bind((std::net::Ipv4Addr::UNSPECIFIED, 0)).await?;
        socket.set_ttl(1)?;
        socket.send_to(&[], (target.network(), 9)).await
    };
    match sent.await {
        Ok(_) => tracing::debug!(interface, %target, "handshake kicked"),
        Err(err) => tracing::debug!(interface, %target, error = %err, "could not kick a handshake"),
    }
}

/// Drops a device off the async workers (stopping boringtun's threads or deleting the kernel
/// link blocks), then waits until its interface is gone so a new one can take the name.
pub(super) async fn remove_device(device: Arc<Device>) {
    let name = device.name().to_owned();
    let _ = tokio::task::spawn_blocking(move || drop(device)).await;
    let path = format!("/sys/class/net/{name}");
    let deadline = tokio::time::Instant::now() + LINK_GONE_TIMEOUT;
    while tokio::fs::try_exists(&path).await.unwrap_or(false) {
        if tokio::time::Instant::now() > deadline {
            tracing::warn!(interface = %name, "interface still present after removal");
            return;
        }
        trellis_runtime::timer::period(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn endpoints_resolve_to_what_wireguard_sends_to() {
        let ip = Endpoint::parse("e", "192.0.2.1:51840").expect("ip");
        assert_eq!(
            resolve(&ip).await.expect("no lookup"),
            "192.0.2.1:51840".parse::<SocketAddr>().expect("addr")
        );
        // `localhost` resolves from /etc/hosts, without a DNS server.
        let name = Endpoint::parse("e", "localhost:51841").expect("name");
        let addr = resolve(&name).await.expect("resolves");
        assert!(addr.ip().is_loopback(), "{addr}");
        assert_eq!(addr.port(), 51841);
        // RFC 6761: `.invalid` never resolves; the error names the endpoint.
        let nowhere = Endpoint::parse("e", "nowhere.invalid:51840").expect("name");
        let err = resolve(&nowhere).await.expect_err("does not resolve");
        assert!(
            format!("{err:#}").contains("resolving the remote endpoint nowhere.invalid:51840"),
            "{err:#}"
        );
    }

    #[test]
    fn of_several_addresses_the_lowest_ipv4_one_is_used() {
        let addrs: Vec<SocketAddr> = ["[2001:db8::1]:1", "192.0.2.9:1", "192.0.2.3:1"]
            .iter()
            .map(|a| a.parse().expect("addr"))
            .collect();
        assert_eq!(pick(addrs.clone()), Some(addrs[2]));
        assert_eq!(pick(addrs[..1].to_vec()), Some(addrs[0]));
        assert_eq!(pick(Vec::new()), None);
    }
}
