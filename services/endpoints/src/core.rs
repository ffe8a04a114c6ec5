//! The endpoints service's domain logic.
//!
//! Source side ([`Endpoints::reflect`], [`Endpoints::unreflect`]): translate every address of a
//! slice for a target cluster following DESIGN.md "Endpoint reflection" and Listing 6.6 of the
//! thesis, remember which addresses hold an allocation in our external CIDR for that target, and
//! release those that disappear. Target side ([`Endpoints::apply`], [`Endpoints::delete`]):
//! store what a peer reflected to us (generation-checked) and, with Kubernetes access, write it.
//! Store writes are compare-and-swap on the record's own revision, retried on contention.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use futures::stream::{self, StreamExt as _, TryStreamExt as _};
use ipnet::IpNet;
use tokio::sync::{Mutex, OnceCell};
use trellis_api::pb::endpoints as epb;
use trellis_api::pb::ipam as ipb;
use trellis_api::pb::types::{self as tpb, ForeignCluster};
use trellis_api::peers::is_networked_full_peer;
use trellis_api::{ClusterId, ClusterIdentity, convert};
use trellis_error::{Error, Result};
use trellis_store::retry::Contention;
use trellis_store::{Compare, Op, SharedStore, Txn};

use crate::kube::KubeWriter;
use crate::model::{AddressType, Slice};
use crate::records::{
    OUTGOING_PREFIX, OutgoingRecord, REFLECTED_PREFIX, ReflectedRecord, decode, encode,
    outgoing_key, outgoing_target_prefix, reflected_key, reflected_source_prefix,
};
use crate::remote::{Clients, local_error};

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

impl Path {
    pub fn to_pb(self) -> epb::TranslationPath {
        match self {
            Self::LocalNat => epb::TranslationPath::LocalNat,
            Self::Induced => epb::TranslationPath::Induced,
            Self::HubExternal => epb::TranslationPath::HubExternal,
            Self::TargetHome => epb::TranslationPath::TargetHome,
            Self::Untranslated => epb::TranslationPath::Untranslated,
        }
    }
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

/// The answer of [`Endpoints::reflect`].
#[derive(Debug, Clone)]
pub struct Reflected {
    pub slice: Slice,
    pub translations: Vec<Translation>,
    pub generation: i64,
    pub delivered: bool,
}

/// The answer of [`Endpoints::unreflect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unreflected {
    pub unreflected: bool,
    pub released: u32,
    pub delivered: bool,
}

/// The answer of [`Endpoints::apply`] (target side), and of a delivery (source side).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// Whether the offered generation is now held (new, or an idempotent re-send).
    pub applied: bool,
    /// The generation held after the call: the offered one, or the higher one that refused it.
    pub held: i64,
    /// The Kubernetes object written for it, with Kubernetes access.
    pub object_name: Option<String>,
}

/// Whether the induced path to one home cluster can be used, decided once per reflection.
#[derive(Debug, Clone)]
enum Route {
    /// The home cluster's IPAM knows how the target addresses it.
    Induced(trellis_api::pb::ipam::ipam_client::IpamClient<trellis_runtime::client::TracedChannel>),
    /// Hub path, with the reason (empty when the home cluster simply has no induced peering
    /// with the target).
    Hub(String),
}

/// The endpoints service of one cluster.
#[derive(Debug)]
pub struct Endpoints {
    pub(crate) store: SharedStore,
    local: ClusterIdentity,
    pub(crate) clients: Clients,
    writer: Option<KubeWriter>,
    pod_cidr: OnceCell<IpNet>,
    /// Wakes the export reconciler ([`crate::exports`]) when an export changes.
    pub(crate) exports_changed: tokio::sync::Notify,
    /// Wakes the import side ([`crate::imports`]) when an import changes.
    pub(crate) imports_changed: tokio::sync::Notify,
    /// Whether imports are written with unreachable endpoints marked not ready (set when the
    /// whole Kubernetes import side runs, [`crate::imports`]).
    mark_readiness: bool,
}

fn unchanged(key: impl Into<String>, revision: i64) -> Compare {
    Compare::ModRevision {
        key: key.into(),
        revision,
    }
}

fn now_nanos() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// The generation of a new version of a reflection: above the previous one and at least the
/// wall clock in milliseconds, like the broker's NetworkConfig generations (ADR 0012). A
/// reflection recorded again from nothing (the exporter's or hub's endpoints store lost, the
/// reflection withdrawn and made again) thus starts above every generation a consumer still
/// holds from before, as long as the clock did not step back by more than the time between the
/// two; [`Endpoints::reflect_as`] renumbers above what the consumer holds when it did.
pub(crate) fn next_generation(previous: Option<i64>) -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 2));
    previous.map_or(1, |p| p.saturating_add(1)).max(now)
}

fn advertised(fc: &ForeignCluster) -> Option<&tpb::ServiceAddresses> {
    fc.full
        .as_ref()
        .and_then(|f| f.addresses.as_ref())
        .or_else(|| fc.induced.as_ref().and_then(|i| i.addresses.as_ref()))
}

fn parse_ip(field: &str, what: &str, value: &str) -> Result<IpAddr> {
    value
        .parse()
        .map_err(|_| Error::Internal(format!("{what} answered {value:?} for {field}, not an IP")))
}

impl Endpoints {
    pub fn new(
        store: SharedStore,
        local: ClusterIdentity,
        clients: Clients,
        writer: Option<KubeWriter>,
    ) -> Self {
        Self {
            store,
            local,
            clients,
            writer,
            pod_cidr: OnceCell::new(),
            exports_changed: tokio::sync::Notify::new(),
            imports_changed: tokio::sync::Notify::new(),
            mark_readiness: false,
        }
    }

    /// With the Kubernetes import side: imports are written with the endpoints this cluster
    /// cannot reach marked not ready ([`crate::imports::Reachability`]).
    pub fn with_readiness_marking(mut self) -> Self {
        self.mark_readiness = true;
        self
    }

    /// The EndpointSlice writer, with Kubernetes access.
    pub(crate) fn writer(&self) -> Option<&KubeWriter> {
        self.writer.as_ref()
    }

    /// This cluster's identity.
    pub fn local(&self) -> &ClusterIdentity {
        &self.local
    }

    /// The local pod CIDR, asked once from the local IPAM (it cannot change under a store).
    pub(crate) async fn pod_cidr(&self) -> Result<IpNet> {
        self.pod_cidr
            .get_or_try_init(|| async {
                let subnets = self
                    .clients
                    .ipam()
                    .get_local_subnets(ipb::GetLocalSubnetsRequest {})
                    .await
                    .map_err(|s| local_error("ipam", s))?
                    .into_inner();
                subnets.pod_cidr.parse::<IpNet>().map_err(|_| {
                    Error::Internal(format!(
                        "local ipam answered pod CIDR {:?}",
                        subnets.pod_cidr
                    ))
                })
            })
            .await
            .copied()
    }

    /// The target's record, required to be a networked full peer.
    async fn full_peer(
        &self,
        id: &ClusterId,
        refusal: fn(String) -> Error,
    ) -> Result<ForeignCluster> {
        match self.clients.foreign_cluster(id).await? {
            Some(fc) if is_networked_full_peer(&fc) => Ok(fc),
            Some(_) => Err(refusal(format!(
                "cluster {id} is not a full peer with networking established"
            ))),
            None => Err(refusal(format!("cluster {id} is not a known peer"))),
        }
    }

    // ---- source side ----

    /// Translates `slice` for `target` and records the reflection; with `deliver`, pushes it
    /// to the target's endpoints service.
    #[tracing::instrument(skip(self, slice), fields(target.id = %target.id, slice.namespace = %slice.namespace, slice.name = %slice.name))]
    pub async fn reflect(
        &self,
        target: &ClusterIdentity,
        slice: Slice,
        deliver: bool,
    ) -> Result<Reflected> {
        self.reflect_as(target, slice, deliver, None).await
    }

    /// [`Self::reflect`] for the export reconciler, which owns the reflection: with `home`, every
    /// address must run in that cluster (an export carries only its exporter's endpoints; a
    /// peer cannot have us pass on addresses of another cluster, ours included).
    pub(crate) async fn reflect_as(
        &self,
        target: &ClusterIdentity,
        slice: Slice,
        deliver: bool,
        home: Option<&ClusterId>,
    ) -> Result<Reflected> {
        let export = home.is_some();
        if target.id == self.local.id {
            return Err(Error::invalid(
                "target.cluster_id",
                "is this cluster; a slice is reflected to a peer",
            ));
        }
        let peer = self
            .full_peer(&target.id, Error::FailedPrecondition)
            .await?;
        let key = outgoing_key(&target.id, &slice.namespace, &slice.name);
        let mut contention = Contention::on(&self.store, "recording a reflection");
        let (reflected, released) = loop {
            let previous = match self.store.get(&key).await? {
                Some(kv) => Some((decode::<OutgoingRecord>(&key, &kv.value)?, kv.mod_revision)),
                None => None,
            };
            let (translated, translations) = self.translate(target, &slice).await?;
            if let Some(home) = home
                && let Some(t) = translations
                    .iter()
                    .find(|t| t.home.as_ref().is_none_or(|h| h.id != *home))
            {
                return Err(Error::PermissionDenied(format!(
                    "{} does not run in cluster {home}, whose export this is",
                    t.original
                )));
            }
            let hub_external: BTreeSet<String> = translations
                .iter()
                .filter(|t| t.path == Path::HubExternal)
                .map(|t| t.original.clone())
                .collect();
            let (generation, revision, dropped) = match &previous {
                Some((rec, revision)) => (
                    next_generation(Some(rec.generation)),
                    *revision,
                    rec.hub_external
                        .difference(&hub_external)
                        .cloned()
                        .collect(),
                ),
                None => (next_generation(None), 0, Vec::new()),
            };
            let record = OutgoingRecord {
                target: target.clone(),
                generation,
                hub_external,
                export,
            };
            let committed = self
                .store
                .txn(Txn {
                    compares: vec![unchanged(&key, revision)],
                    success: vec![Op::put(&key, encode(&record)?)],
                    failure: vec![],
                })
                .await?;
            if committed.succeeded {
                break (
                    Reflected {
                        slice: translated,
                        translations,
                        generation,
                        delivered: false,
                    },
                    dropped,
                );
            }
            contention.lost().await?;
        };
        let released = self.release(&target.id, &key, released).await?;
        tracing::info!(
            generation = reflected.generation,
            addresses = reflected.translations.len(),
            released,
            "reflected endpoint slice"
        );
        let mut reflected = reflected;
        if deliver {
            let mut answer = self
                .deliver_apply(&target.id, &peer, &reflected.slice, reflected.generation)
                .await?;
            if !answer.applied {
                // The target holds a higher generation of this slice: ours started again below
                // it (our store lost while the clock is behind the one that numbered the
                // target's copy). Renumber above it and deliver once more.
                tracing::warn!(
                    held = answer.held,
                    offered = reflected.generation,
                    "target holds a higher generation of the slice; renumbering above it"
                );
                reflected.generation = self.renumber(&key, answer.held).await?;
                answer = self
                    .deliver_apply(&target.id, &peer, &reflected.slice, reflected.generation)
                    .await?;
            }
            if !answer.applied {
                return Err(Error::Aborted(format!(
                    "cluster {} holds generation {} of {}/{}, above ours {}, after renumbering",
                    target.id,
                    answer.held,
                    reflected.slice.namespace,
                    reflected.slice.name,
                    reflected.generation
                )));
            }
            reflected.delivered = true;
        }
        Ok(reflected)
    }

    /// Delivers an earlier translation of a reflection again, unchanged and with the same
    /// generation (the export reconciler's resend): a target that still holds it answers
    /// without writing anything; one that lost it stores it again. `applied = false` when the
    /// target holds a higher generation (then reflect again, which renumbers).
    pub(crate) async fn redeliver(
        &self,
        target: &ClusterIdentity,
        translated: &Slice,
        generation: i64,
    ) -> Result<Applied> {
        let peer = self
            .full_peer(&target.id, Error::FailedPrecondition)
            .await?;
        self.deliver_apply(&target.id, &peer, translated, generation)
            .await
    }

    /// Moves the generation of the reflection at `key` above `held` (what the target holds);
    /// returns the new generation.
    async fn renumber(&self, key: &str, held: i64) -> Result<i64> {
        let mut contention = Contention::on(&self.store, "renumbering a reflection");
        loop {
            let Some(kv) = self.store.get(key).await? else {
                return Err(Error::Aborted(format!(
                    "reflection {key} was withdrawn while it was being delivered"
                )));
            };
            let mut record: OutgoingRecord = decode(key, &kv.value)?;
            record.generation = next_generation(Some(record.generation.max(held)));
            let committed = self
                .store
                .txn(Txn {
                    compares: vec![unchanged(key, kv.mod_revision)],
                    success: vec![Op::put(key, encode(&record)?)],
                    failure: vec![],
                })
                .await?;
            if committed.succeeded {
                return Ok(record.generation);
            }
            contention.lost().await?;
        }
    }

    /// Stops reflecting `namespace/name` to `target`.
    #[tracing::instrument(skip(self), fields(target.id = %target.id))]
    pub async fn unreflect(
        &self,
        target: &ClusterIdentity,
        namespace: &str,
        name: &str,
        deliver: bool,
    ) -> Result<Unreflected> {
        let key = outgoing_key(&target.id, namespace, name);
        let mut contention = Contention::on(&self.store, "forgetting a reflection");
        let held = loop {
            let Some(kv) = self.store.get(&key).await? else {
                break None;
            };
            let rec: OutgoingRecord = decode(&key, &kv.value)?;
            let committed = self
                .store
                .txn(Txn {
                    compares: vec![unchanged(&key, kv.mod_revision)],
                    success: vec![Op::delete(&key)],
                    failure: vec![],
                })
                .await?;
            if committed.succeeded {
                break Some(rec);
            }
            contention.lost().await?;
        };
        let released = match &held {
            Some(rec) => {
                self.release(&target.id, &key, rec.hub_external.iter().cloned().collect())
                    .await?
            }
            None => 0,
        };
        let mut delivered = false;
        if deliver {
            let peer = self
                .full_peer(&target.id, Error::FailedPrecondition)
                .await?;
            let address = advertised(&peer)
                .map(|a| a.endpoints.clone())
                .unwrap_or_default();
            if address.is_empty() {
                return Err(Error::FailedPrecondition(format!(
                    "cluster {} advertises no endpoints service address",
                    target.id
                )));
            }
            self.clients
                .remote_endpoints(&target.id, &address)?
                .delete_reflected_slice(epb::DeleteReflectedSliceRequest {
                    source: Some(convert::identity_to_pb(&self.local)),
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                })
                .await
                .map_err(|s| remote_error(&target.id, s))?;
            delivered = true;
        }
        tracing::info!(
            unreflected = held.is_some(),
            released,
            "stopped reflecting endpoint slice"
        );
        Ok(Unreflected {
            unreflected: held.is_some(),
            released,
            delivered,
        })
    }

    /// Releases the external-CIDR allocations of `originals` for `target`, except those another
    /// reflection to the same target (other than `own_key`) still uses: the IPAM holds one
    /// allocation per (address, target), not per slice. Returns how many addresses went back
    /// to the pool.
    ///
    /// Known race: a concurrent reflection of another slice that starts using one of these
    /// addresses between our listing and the unmap loses its allocation; its next
    /// re-reflection maps it again.
    async fn release(
        &self,
        target: &ClusterId,
        own_key: &str,
        originals: Vec<String>,
    ) -> Result<u32> {
        if originals.is_empty() {
            return Ok(0);
        }
        let prefix = outgoing_target_prefix(target);
        let mut still_used = BTreeSet::new();
        for kv in self.store.list(&prefix).await?.kvs {
            if kv.key != own_key {
                let rec: OutgoingRecord = decode(&kv.key, &kv.value)?;
                still_used.extend(rec.hub_external);
            }
        }
        let mut released = 0;
        for ip in originals.into_iter().filter(|ip| !still_used.contains(ip)) {
            let answer = self
                .clients
                .ipam()
                .unmap_endpoint_ip(ipb::UnmapEndpointIpRequest {
                    cluster_id: target.to_string(),
                    ip: ip.clone(),
                })
                .await
                .map_err(|s| local_error("ipam", s))?
                .into_inner();
            tracing::info!(endpoint.ip = %ip, target.id = %target, returned_to_pool = answer.released, "released hub-path endpoint mapping");
            // The IPAM keeps the address while another target still uses it.
            if answer.released {
                released += 1;
            }
        }
        Ok(released)
    }

    async fn deliver_apply(
        &self,
        target_id: &ClusterId,
        peer: &ForeignCluster,
        slice: &Slice,
        generation: i64,
    ) -> Result<Applied> {
        let target = peer
            .identity
            .as_ref()
            .map(|i| i.cluster_id.clone())
            .unwrap_or_default();
        let address = advertised(peer)
            .map(|a| a.endpoints.clone())
            .unwrap_or_default();
        if address.is_empty() {
            return Err(Error::FailedPrecondition(format!(
                "cluster {target} advertises no endpoints service address"
            )));
        }
        let answer = self
            .clients
            .remote_endpoints(target_id, &address)?
            .apply_reflected_slice(epb::ApplyReflectedSliceRequest {
                source: Some(convert::identity_to_pb(&self.local)),
                slice: Some(slice.to_pb()),
                generation,
            })
            .await
            .map_err(|s| match s.code() {
                tonic::Code::Unavailable
                | tonic::Code::Cancelled
                | tonic::Code::DeadlineExceeded => Error::Unavailable(format!(
                    "endpoints service of cluster {target} unreachable: {}",
                    s.message()
                )),
                _ => Error::from(s).context(format!("cluster {target} refused the slice")),
            })?
            .into_inner();
        Ok(Applied {
            applied: answer.applied,
            // A target that does not say holds at least what it refused.
            held: answer.held_generation.max(generation),
            object_name: Some(answer.object_name).filter(|n| !n.is_empty()),
        })
    }

    /// Translates every address of `slice` for `target`, a few addresses at a time; the route
    /// to each home cluster is decided once.
    async fn translate(
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

    /// One address (Listing 6.6).
    async fn translate_ip(
        &self,
        target: &ClusterIdentity,
        field: &str,
        ip: IpAddr,
        routes: &Mutex<HashMap<ClusterId, Arc<OnceCell<Route>>>>,
    ) -> Result<Translation> {
        let owner = self
            .clients
            .ipam()
            .get_cluster_identity(ipb::GetClusterIdentityRequest { ip: ip.to_string() })
            .await
            .map_err(|s| address_error(field, s))?
            .into_inner();
        if owner.cluster_id.is_empty() {
            let pod_cidr = self.pod_cidr().await?;
            if !pod_cidr.contains(&ip) {
                return Err(Error::FailedPrecondition(format!(
                    "{field}: {ip} is neither in the local pod CIDR {pod_cidr} nor in any peer's pod CIDR as we address it"
                )));
            }
            return self
                .map_locally(target, field, ip, Some(self.local.clone()), String::new())
                .await;
        }
        let home = ClusterIdentity::parse(
            "cluster_id",
            &owner.cluster_id,
            "cluster_name",
            &owner.cluster_name,
        )
        .map_err(|e| {
            Error::Internal(format!(
                "local ipam answered a malformed owner of {ip}: {e}"
            ))
        })?;
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
                match self.map_induced(remote, &home, target, field, ip).await {
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
        let answer = self
            .clients
            .remote_ipam_call(|| {
                let mut remote = remote.clone();
                let request = ipb::DoesClusterMappingExistRequest {
                    cluster_id: target.id.to_string(),
                };
                async move { remote.does_cluster_mapping_exist(request).await }
            })
            .await;
        match answer {
            Ok(answer) if answer.get_ref().exists => Ok(Route::Induced(remote)),
            Ok(_) => Ok(Route::Hub(String::new())),
            Err(status) => {
                let detail = format!(
                    "remote IPAM of cluster {} at {address} unreachable ({}: {}); hub path used",
                    home.id,
                    status.code(),
                    status.message()
                );
                tracing::warn!(home.id = %home.id, detail, "remote ipam unavailable");
                Ok(Route::Hub(detail))
            }
        }
    }

    /// The induced path: the home IP, mapped by the home cluster's IPAM for the target.
    async fn map_induced(
        &self,
        remote: trellis_api::pb::ipam::ipam_client::IpamClient<
            trellis_runtime::client::TracedChannel,
        >,
        home: &ClusterIdentity,
        target: &ClusterIdentity,
        field: &str,
        ip: IpAddr,
    ) -> std::result::Result<IpAddr, InducedFailure> {
        let home_ip = self
            .clients
            .ipam()
            .get_home_pod_ip(ipb::GetHomePodIpRequest {
                cluster_id: home.id.to_string(),
                ip: ip.to_string(),
            })
            .await
            .map_err(|s| InducedFailure::Fatal(address_error(field, s)))?
            .into_inner()
            .home_ip;
        let request = ipb::MapEndpointIpRequest {
            cluster_id: target.id.to_string(),
            ip: home_ip.clone(),
            induced: true,
        };
        let answer = self
            .clients
            .remote_ipam_call(|| {
                let mut remote = remote.clone();
                let request = request.clone();
                async move { remote.map_endpoint_ip(request).await }
            })
            .await
            .map_err(|s| {
                InducedFailure::Fallback(format!(
                    "remote IPAM of cluster {} could not map home IP {home_ip} ({}: {}); hub path used",
                    home.id,
                    s.code(),
                    s.message()
                ))
            })?
            .into_inner();
        if answer.path != i32::from(ipb::MappingPath::LocalNat) {
            // The home IPAM must map through how the target addresses it; anything else
            // would be an address the target cannot use.
            return Err(InducedFailure::Fallback(format!(
                "remote IPAM of cluster {} answered path {} for an induced mapping; hub path used",
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
        let answer = self
            .clients
            .ipam()
            .map_endpoint_ip(ipb::MapEndpointIpRequest {
                cluster_id: target.id.to_string(),
                ip: ip.to_string(),
                induced: false,
            })
            .await
            .map_err(|s| match s.code() {
                tonic::Code::NotFound => Error::FailedPrecondition(format!(
                    "{field}: the local IPAM cannot map {ip} for cluster {}: {}",
                    target.id,
                    s.message()
                )),
                _ => address_error(field, s),
            })?
            .into_inner();
        let path = match ipb::MappingPath::try_from(answer.path) {
            Ok(ipb::MappingPath::LocalNat) => Path::LocalNat,
            Ok(ipb::MappingPath::Home) => Path::TargetHome,
            Ok(ipb::MappingPath::External) => Path::HubExternal,
            _ => {
                return Err(Error::Internal(format!(
                    "local ipam answered an unknown mapping path {} for {ip}",
                    answer.path
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

    // ---- target side ----

    /// Stores (and writes into Kubernetes) a slice `source` reflected to us. Returns whether
    /// this generation is now held, the generation held, and the Kubernetes object name.
    #[tracing::instrument(skip(self, slice), fields(source.id = %source.id, slice.namespace = %slice.namespace, slice.name = %slice.name))]
    pub async fn apply(
        &self,
        source: &ClusterIdentity,
        slice: Slice,
        generation: i64,
    ) -> Result<Applied> {
        self.full_peer(&source.id, Error::PermissionDenied).await?;
        let key = reflected_key(&source.id, &slice.namespace, &slice.name);
        let mut contention = Contention::on(&self.store, "applying a reflected slice");
        loop {
            let held = match self.store.get(&key).await? {
                Some(kv) => Some((decode::<ReflectedRecord>(&key, &kv.value)?, kv.mod_revision)),
                None => None,
            };
            // A generation names one content of the slice: the one held is an idempotent
            // re-send, a lower one is stale. Neither touches Kubernetes.
            if let Some((rec, _)) = &held
                && rec.generation >= generation
            {
                let current = rec.generation == generation;
                if !current {
                    tracing::info!(
                        held = rec.generation,
                        offered = generation,
                        "ignored a stale reflected slice"
                    );
                }
                return Ok(Applied {
                    applied: current,
                    held: rec.generation,
                    object_name: rec.object_name.clone(),
                });
            }
            // Kubernetes first: if the object cannot be written (e.g. an unmanaged slice of
            // that name exists), nothing is stored.
            let object_name = match &self.writer {
                Some(writer) if self.mark_readiness => {
                    let reach = self.reachability().await?;
                    Some(writer.apply(source, &reach.mark(&slice)).await?)
                }
                Some(writer) => Some(writer.apply(source, &slice).await?),
                None => None,
            };
            let record = ReflectedRecord {
                source: source.clone(),
                slice: slice.clone(),
                generation,
                object_name: object_name.clone(),
                update_time_nanos: now_nanos(),
            };
            let revision = held.as_ref().map_or(0, |(_, r)| *r);
            let committed = self
                .store
                .txn(Txn {
                    compares: vec![unchanged(&key, revision)],
                    success: vec![Op::put(&key, encode(&record)?)],
                    failure: vec![],
                })
                .await?;
            if committed.succeeded {
                tracing::info!(
                    generation,
                    object = object_name.as_deref().unwrap_or(""),
                    endpoints = record.slice.endpoints.len(),
                    "applied reflected slice"
                );
                // An export we pass on to our other peers may have changed.
                self.exports_changed.notify_one();
                self.imports_changed.notify_one();
                return Ok(Applied {
                    applied: true,
                    held: generation,
                    object_name,
                });
            }
            contention.lost().await?;
        }
    }

    /// Deletes a slice `source` reflected to us, and its Kubernetes object.
    #[tracing::instrument(skip(self), fields(source.id = %source.id))]
    pub async fn delete(
        &self,
        source: &ClusterIdentity,
        namespace: &str,
        name: &str,
    ) -> Result<bool> {
        self.full_peer(&source.id, Error::PermissionDenied).await?;
        self.forget(source, namespace, name).await
    }

    /// Drops a slice `source` reflected to us and its Kubernetes object, whether or not
    /// `source` is still a peer (the export reconciler drops what a former peer brought).
    pub(crate) async fn forget(
        &self,
        source: &ClusterIdentity,
        namespace: &str,
        name: &str,
    ) -> Result<bool> {
        let key = reflected_key(&source.id, namespace, name);
        // Also when nothing is stored: a crash between the Kubernetes write and the store
        // commit may have left our object behind. The writer only deletes what it manages.
        if let Some(writer) = &self.writer {
            writer.delete(source, namespace, name).await?;
        }
        let mut contention = Contention::on(&self.store, "deleting a reflected slice");
        loop {
            let Some(kv) = self.store.get(&key).await? else {
                return Ok(false);
            };
            let committed = self
                .store
                .txn(Txn {
                    compares: vec![unchanged(&key, kv.mod_revision)],
                    success: vec![Op::delete(&key)],
                    failure: vec![],
                })
                .await?;
            if committed.succeeded {
                tracing::info!(source.id = %source.id, namespace, name, "deleted reflected slice");
                // An export in transit through us may have gone with it.
                self.exports_changed.notify_one();
                self.imports_changed.notify_one();
                return Ok(true);
            }
            contention.lost().await?;
        }
    }

    /// The slices reflected to us, by (source, namespace, name).
    pub async fn list(
        &self,
        source: Option<&ClusterId>,
        namespace: Option<&str>,
    ) -> Result<Vec<ReflectedRecord>> {
        let prefix = source.map_or_else(|| REFLECTED_PREFIX.to_owned(), reflected_source_prefix);
        let mut out = Vec::new();
        for kv in self.store.list(&prefix).await?.kvs {
            let rec: ReflectedRecord = decode(&kv.key, &kv.value)?;
            if namespace.is_none_or(|ns| rec.slice.namespace == ns) {
                out.push(rec);
            }
        }
        out.sort_by(|a, b| {
            (&a.source.id, &a.slice.namespace, &a.slice.name).cmp(&(
                &b.source.id,
                &b.slice.namespace,
                &b.slice.name,
            ))
        });
        Ok(out)
    }

    /// Every reflection this cluster records as source (for operators and tests).
    pub async fn outgoing(&self) -> Result<Vec<OutgoingRecord>> {
        self.store
            .list(OUTGOING_PREFIX)
            .await?
            .kvs
            .iter()
            .map(|kv| decode(&kv.key, &kv.value))
            .collect()
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

/// A failure of the local IPAM about one address: a refused address names the request field.
fn address_error(field: &str, status: tonic::Status) -> Error {
    match status.code() {
        tonic::Code::InvalidArgument => Error::invalid(field, status.message().to_owned()),
        _ => local_error("ipam", status),
    }
}

/// A failure of another cluster's endpoints service.
fn remote_error(target: &ClusterId, status: tonic::Status) -> Error {
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::DeadlineExceeded => {
            Error::Unavailable(format!(
                "endpoints service of cluster {target} unreachable: {}",
                status.message()
            ))
        }
        _ => Error::from(status).context(format!("cluster {target}")),
    }
}
