//! mDNS discovery (enabled by `--mdns`): announce our discovery service as
//! `<cluster_id>._trellis._tcp.local.` and browse for the others on the local network. A
//! resolved announcement is confirmed with GetIdentity and recorded (Discovered=True); a
//! removed one (goodbye packet or expiry) marks the cluster no longer found by mDNS.
//!
//! Which announcement points where is kept in memory only: after a restart the browse finds
//! everything again, and records of clusters no longer announced age out on the next removal.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use mdns_sd::{IfKind, ServiceDaemon, ServiceEvent, ServiceInfo};
use tokio::sync::mpsc;
use trellis_error::{Error, Result};
use trellis_runtime::Shutdown;

use crate::core::Discovery;
use crate::records::Mechanism;
use crate::remote;

/// The mDNS service type of Trellis discovery endpoints.
pub const SERVICE_TYPE: &str = "_trellis._tcp.local.";

/// What mDNS discovery announces and where.
#[derive(Debug, Clone)]
pub struct MdnsSettings {
    /// The port our discovery service listens on (announced).
    pub port: u16,
    /// The address to announce; `None` announces every address of the enabled interfaces.
    pub ip: Option<IpAddr>,
    /// Interfaces to use; empty = all.
    pub interfaces: Vec<String>,
}

fn mdns_error(e: mdns_sd::Error) -> Error {
    Error::Unavailable(format!("mdns: {e}"))
}

/// Starts the daemon, announces us and browses until `shutdown`.
pub async fn run(core: Arc<Discovery>, settings: MdnsSettings, shutdown: Shutdown) {
    if let Err(err) = serve(core, settings, shutdown).await {
        tracing::error!(error = %err, "mdns discovery stopped");
    }
}

async fn serve(core: Arc<Discovery>, settings: MdnsSettings, shutdown: Shutdown) -> Result<()> {
    let daemon = ServiceDaemon::new().map_err(mdns_error)?;
    if !settings.interfaces.is_empty() {
        daemon.disable_interface(IfKind::All).map_err(mdns_error)?;
        for name in &settings.interfaces {
            daemon
                .enable_interface(IfKind::Name(name.clone()))
                .map_err(mdns_error)?;
        }
    }
    let id = core.identity().id.to_string();
    let host = format!("{id}.local.");
    let properties = [("cluster_id", id.as_str())];
    let info = match settings.ip {
        Some(ip) => ServiceInfo::new(SERVICE_TYPE, &id, &host, ip, settings.port, &properties[..]),
        None => ServiceInfo::new(SERVICE_TYPE, &id, &host, "", settings.port, &properties[..])
            .map(ServiceInfo::enable_addr_auto),
    }
    .map_err(mdns_error)?;
    let own = info.get_fullname().to_owned();
    daemon.register(info).map_err(mdns_error)?;
    let browse = daemon.browse(SERVICE_TYPE).map_err(mdns_error)?;
    tracing::info!(service = %own, "announcing and browsing over mdns");

    // The daemon's channel is blocking; bridge it to the runtime.
    let (tx, mut rx) = mpsc::channel(64);
    let stop = shutdown.clone();
    tokio::task::spawn_blocking(move || {
        while !stop.is_cancelled() {
            match browse.recv_timeout(Duration::from_millis(250)) {
                Ok(event) => {
                    if tx.blocking_send(event).is_err() {
                        return;
                    }
                }
                Err(flume_error) if flume_error.to_string().contains("disconnected") => return,
                Err(_) => {}
            }
        }
    });

    let mut announced: BTreeMap<String, String> = BTreeMap::new();
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => break,
            event = rx.recv() => match event {
                Some(event) => event,
                None => break,
            },
        };
        match event {
            ServiceEvent::ServiceResolved(info) if info.get_fullname() != own => {
                let Some(ip) = pick_address(info.get_addresses().iter().copied()) else {
                    continue;
                };
                let address = SocketAddr::new(ip, info.get_port()).to_string();
                match remote::get_identity(
                    core.tls(),
                    core.metrics(),
                    "mdns announcement",
                    &address,
                )
                .await
                {
                    Ok((identity, _)) if identity.id == core.identity().id => {}
                    Ok((identity, addresses)) => {
                        match core
                            .discovered(&identity, &addresses, Mechanism::Mdns, &address)
                            .await
                        {
                            Ok(_) => {
                                announced.insert(info.get_fullname().to_owned(), address);
                            }
                            Err(err) => {
                                tracing::warn!(%address, error = %err, "cannot record mdns finding")
                            }
                        }
                    }
                    Err(err) => {
                        tracing::warn!(%address, error = %err, "mdns announcement does not answer GetIdentity")
                    }
                }
            }
            ServiceEvent::ServiceRemoved(_, fullname) if announced.remove(&fullname).is_some() => {
                let still = announced.values().cloned().collect();
                if let Err(err) = core
                    .lost(Mechanism::Mdns, &still, "MdnsAnnouncementRemoved")
                    .await
                {
                    tracing::warn!(error = %err, "cannot record mdns removal");
                }
            }
            _ => {}
        }
    }
    // Say goodbye so the others notice at once rather than at expiry.
    let _ = daemon.unregister(&own);
    trellis_runtime::timer::period(Duration::from_millis(200)).await;
    let _ = daemon.shutdown();
    Ok(())
}

/// Prefers IPv4 (simplest to reach), then any; skips loopback and link-local IPv6, which are
/// not usable from another host without a scope.
fn pick_address(addrs: impl Iterator<Item = IpAddr>) -> Option<IpAddr> {
    let mut usable: Vec<IpAddr> = addrs
        .filter(|ip| !ip.is_loopback())
        .filter(|ip| match ip {
            IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) != 0xfe80,
            IpAddr::V4(_) => true,
        })
        .collect();
    usable.sort_by_key(|ip| (ip.is_ipv6(), *ip));
    usable.into_iter().next()
}
