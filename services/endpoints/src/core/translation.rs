//! Translating a slice's addresses for one target cluster (docs/architecture.md, endpoint
//! reflection): local NAT, the target's own address, the induced path through
//! the home cluster's IPAM, or the hub path through our external CIDR. The route to each home
//! cluster is decided once per reflection; an induced mapping that fails falls back to the
//! hub path, which still gives the target an address it can use.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use futures::stream::{self, StreamExt as _, TryStreamExt as _};
use tokio::sync::{Mutex, OnceCell};
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};

use super::{Endpoints, advertised};
use crate::model::{AddressType, Slice};
use crate::remote::ipam::{MappingPath, RemoteIpam};

/// Addresses translated concurrently within one slice: enough to hide loopback and LAN round
/// trips, few enough not to flood the local IPAM.
const TRANSLATE_CONCURRENCY: usize = 16;

/// How an address was translated (the proto's TranslationPath).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    LocalNat,
    Induced,
    HubExternal,
    TargetHome,
    Untranslated,
}

/// The translation of one address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Translation {
    pub original: String,
    pub translated: String,
    pub path: Path,
    /// Where the endpoint runs; `None` for untranslated names.
    pub home: Option<ClusterIdentity>,
    pub detail: String,
}

/// Whether the induced path to one home cluster can be used, decided once per reflection.
#[derive(Debug, Clone)]
enum Route {
    /// The home cluster's IPAM knows how the target addresses it.
    Induced(Box<RemoteIpam>),
    /// Hub path, with the reason (empty when the home cluster simply has no induced peering
    /// with the target).
    Hub(String),
}

fn parse_ip(field: &str, what: &str, value: &str) -> Result<IpAddr> {
    value
        .parse()
        .map_err(|_| Error::Internal(format!("{what} answered {value:?} for {field}, not an IP")))
}

impl Endpoints {
    /// Translates every address of `slice` for `target`, a few addresses at a time; the route
    /// to each home cluster is decided once.
    pub(super) async fn translate(
        &self,
        target: &ClusterIdentity,
        slice: &Slice,
    ) -> Result<(Slice, Vec<Translation>)> {
        let routes: Mutex<HashMap<ClusterId, Arc<OnceCell<Route>>>> = Mutex::new(HashMap::new());
        let mut jobs = Vec::new();
        for (e, endpoint) in slice.endpoints.iter().enumerate() {
            for (a, address) in endpoint.addresses.iter().enumerate() {
                jobs.push((e, a, address.clone()));
            }
        }
        let translations: Vec<Translation> =
            stream::iter(jobs.into_iter().map(|(e, a, address)| {
                let routes = &routes;
                async move {
                    if slice.address_type == AddressType::Fqdn {
                        return Ok(Translation {
                            original: address.clone(),
                            translated: address,
                            path: Path::Untranslated,
                            home: None,
                            detail: String::new(),
                        });
                    }
                    let field = format!("slice.endpoints[{e}].addresses[{a}]");
                    let ip = trellis_api::wire::ip(&field, &address)?;
                    self.translate_ip(target, &field, ip, routes).await
                }
            }))
            .buffered(TRANSLATE_CONCURRENCY)
            .try_collect()
            .await?;
        let mut translated = slice.clone();
        let mut next = translations.iter();
        for endpoint in &mut translated.endpoints {
            for address in &mut endpoint.addresses {
                if let Some(t) = next.next() {
                    address.clone_from(&t.translated);
                }
            }
        }
        Ok((translated, translations))
    }

    /// One address.
    async fn translate_ip(
        &self,
        target: &ClusterIdentity,
        field: &str,
        ip: IpAddr,
        routes: &Mutex<HashMap<ClusterId, Arc<OnceCell<Route>>>>,
    ) -> Result<Translation> {
        let Some(home) = self.clients.owner_of(field, ip).await? else {
            let pod_cidr = self.pod_cidr().await?;
            if !pod_cidr.contains(&ip) {
                return Err(Error::FailedPrecondition(format!(
                    "{field}: {ip} is neither in the local pod CIDR {pod_cidr} nor in any peer's pod CIDR as we address it"
                )));
            }
            return self
                .map_locally(target, field, ip, Some(self.local.clone()), String::new())
                .await;
        };
        if home.id == target.id {
            return self
                .map_locally(target, field, ip, Some(home), String::new())
                .await;
        }
        let cell = {
            let mut map = routes.lock().await;
            map.entry(home.id.clone()).or_default().clone()
        };
        let route = cell
            .get_or_try_init(|| self.route_to(&home, target))
            .await?
            .clone();
        let detail = match route {
            Route::Hub(detail) => detail,
            Route::Induced(remote) => {
                match self.map_induced(&remote, &home, target, field, ip).await {
                    Ok(translated) => {
                        return Ok(Translation {
                            original: ip.to_string(),
                            translated: translated.to_string(),
                            path: Path::Induced,
                            home: Some(home),
                            detail: String::new(),
                        });
                    }
                    Err(InducedFailure::Fatal(err)) => return Err(err),
                    Err(InducedFailure::Fallback(detail)) => {
                        tracing::warn!(home.id = %home.id, endpoint.ip = %ip, detail, "induced mapping failed, using the hub path");
                        detail
                    }
                }
            }
        };
        self.map_locally(target, field, ip, Some(home), detail)
            .await
    }

    /// Whether addresses of `home` would take the induced path to `target` now (the export
    /// reconciler's check that a translation still holds).
    pub(crate) async fn induced_route(
        &self,
        home: &ClusterId,
        target: &ClusterIdentity,
    ) -> Result<bool> {
        let home = ClusterIdentity {
            id: home.clone(),
            name: String::new(),
        };
        Ok(matches!(
            self.route_to(&home, target).await?,
            Route::Induced(_)
        ))
    }

    /// Decides, once per home cluster and reflection, whether its IPAM can map for `target`.
    async fn route_to(&self, home: &ClusterIdentity, target: &ClusterIdentity) -> Result<Route> {
        let Some(fc) = self.clients.foreign_cluster(&home.id).await? else {
            return Ok(Route::Hub(format!(
                "cluster {} is not known to discovery",
                home.id
            )));
        };
        let address = advertised(&fc).map(|a| a.ipam.clone()).unwrap_or_default();
        if address.is_empty() {
            return Ok(Route::Hub(format!(
                "cluster {} advertises no IPAM address",
                home.id
            )));
        }
        let remote = match self.clients.remote_ipam(&home.id, &address) {
            Ok(remote) => remote,
            Err(err) => {
                return Ok(Route::Hub(format!(
                    "IPAM address of cluster {} unusable: {err}",
                    home.id
                )));
            }
        };
        match remote.has_mapping_for(&target.id).await {
            Ok(true) => Ok(Route::Induced(Box::new(remote))),
            Ok(false) => Ok(Route::Hub(String::new())),
            Err(err) => {
                let detail = format!(
                    "remote IPAM of cluster {} at {address} unreachable ({err}); hub path used",
                    home.id,
                );
                tracing::warn!(home.id = %home.id, detail, "remote ipam unavailable");
                Ok(Route::Hub(detail))
            }
        }
    }

    /// The induced path: the home IP, mapped by the home cluster's IPAM for the target.
    async fn map_induced(
        &self,
        remote: &RemoteIpam,
        home: &ClusterIdentity,
        target: &ClusterIdentity,
        field: &str,
        ip: IpAddr,
    ) -> std::result::Result<IpAddr, InducedFailure> {
        let home_ip = self
            .clients
            .home_pod_ip(field, &home.id, ip)
            .await
            .map_err(InducedFailure::Fatal)?;
        let answer = remote
            .map_induced(&target.id, &home_ip)
            .await
            .map_err(|err| {
                InducedFailure::Fallback(format!(
                    "remote IPAM of cluster {} could not map home IP {home_ip} ({err}); hub path used",
                    home.id,
                ))
            })?;
        if answer.path != MappingPath::LocalNat {
            // The home IPAM must map through how the target addresses it; anything else
            // would be an address the target cannot use.
            return Err(InducedFailure::Fallback(format!(
                "remote IPAM of cluster {} answered path {:?} for an induced mapping; hub path used",
                home.id, answer.path
            )));
        }
        let mapped = answer.ip.parse::<IpAddr>().map_err(|_| {
            InducedFailure::Fallback(format!(
                "remote IPAM of cluster {} answered {:?}, not an IP; hub path used",
                home.id, answer.ip
            ))
        })?;
        if mapped.is_ipv4() != ip.is_ipv4() {
            return Err(InducedFailure::Fallback(format!(
                "remote IPAM of cluster {} answered {mapped}, another address family; hub path used",
                home.id
            )));
        }
        Ok(mapped)
    }

    /// Local IPAM `MapEndpointIp(target, ip, induced=false)`: local NAT, target home or hub.
    async fn map_locally(
        &self,
        target: &ClusterIdentity,
        field: &str,
        ip: IpAddr,
        home: Option<ClusterIdentity>,
        detail: String,
    ) -> Result<Translation> {
        let answer = self.clients.map_endpoint_ip(field, &target.id, ip).await?;
        let path = match answer.path {
            MappingPath::LocalNat => Path::LocalNat,
            MappingPath::Home => Path::TargetHome,
            MappingPath::External => Path::HubExternal,
            MappingPath::Unknown(path) => {
                return Err(Error::Internal(format!(
                    "local ipam answered an unknown mapping path {path} for {ip}"
                )));
            }
        };
        let translated = parse_ip(field, "local ipam", &answer.ip)?;
        Ok(Translation {
            original: ip.to_string(),
            translated: translated.to_string(),
            path,
            home,
            detail,
        })
    }
}

/// Why the induced path could not be used for one address.
#[derive(Debug)]
enum InducedFailure {
    /// The hub path still gives a right address.
    Fallback(String),
    /// Our own state is inconsistent: fail the request.
    Fatal(Error),
}
