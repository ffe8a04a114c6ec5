//! The broker's domain operations: the token handshake, peering and unpeering, and receiving
//! NetworkConfigs and their statuses. Sending NetworkConfigs and deriving TunnelEndpoints is
//! the reconciler's job ([`crate::reconcile`]); operations here store what they learn and wake
//! it.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;
use trellis_api::convert::{addresses_to_pb, identity_to_pb};
use trellis_api::model::{Addresses, NatView, NetworkSpec, WgKey};
use trellis_api::net::AllowedRanges;
use trellis_api::pb::discovery::{
    GetForeignClusterRequest, GetIdentityRequest, ListForeignClustersRequest, UpdatePeeringRequest,
};
use trellis_api::pb::gateway::GetGatewayInfoRequest;
use trellis_api::pb::ipam::{
    FreeSubnetsPerClusterRequest, GetSubnetsPerClusterRequest, SetLocalNatRequest,
};
use trellis_api::pb::peering::{HandshakeRequest, NotifyUnpeerRequest};
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_store::retry::Contention;
use trellis_store::{Compare, Op, SharedStore, Txn};

use crate::peering_id::PeeringId;
use crate::records::{
    Decision, IN_PREFIX, IncomingNc, OUT_PREFIX, OutgoingNc, PendingNotify, TUNNELS_PREFIX,
    TokenRecord, TunnelRecord, decode, encode, in_key, notify_key, out_key, peering_key,
};
use crate::remote::Clients;
use crate::token;
use trellis_api::peers::{PEERED_REASON, Peers, UNPEERED_REASON};
use trellis_runtime::foreign_clusters::{self, ForeignClusters};
use trellis_runtime::tls::{CaCertHash, Caller, PinnedCa};

/// A NetworkConfig received from a remote, validated.
#[derive(Debug, Clone)]
pub struct Received {
    pub origin: ClusterIdentity,
    pub via: Option<ClusterIdentity>,
    pub spec: NetworkSpec,
    pub generation: i64,
    /// The generation of our NetworkConfig the origin holds (0: none).
    pub held_generation: i64,
}

/// The answer to a received NetworkConfig.
#[derive(Debug, Clone)]
pub struct Answer {
    /// False when a higher generation is already held.
    pub accepted: bool,
    pub generation: i64,
    pub decision: Decision,
    /// The generation of our own NetworkConfig towards the origin (0: none yet), told to the
    /// origin with the decision (ADR 0012).
    pub receiver_generation: i64,
}

/// The broker of one cluster.
#[derive(Debug)]
pub struct Broker {
    identity: ClusterIdentity,
    store: SharedStore,
    clients: Clients,
    initial_token: Option<String>,
    /// The reconciler's two lanes (full peers, induced peers): what each must look at next
    /// and how to wake it (in memory only: a restart runs a full pass anyway).
    lanes: [LaneState; 2],
    /// One lock per remote, held while a peering with it starts or ends and while its
    /// unpeering notice is acted on, so a notice is never sent about (or rolled forward over)
    /// a peering that was started again in between.
    peering_locks: Mutex<HashMap<ClusterId, Arc<tokio::sync::Mutex<()>>>>,
    /// Where a peer's ranges, and its views of ours, may lie (`--allowed-remote-cidrs`).
    allowed: AllowedRanges,
    /// The local discovery service's records as its watch last delivered them (kept by the
    /// reconciler's watch): what each received NetworkConfig is checked against first.
    foreign_clusters: ForeignClusters,
    /// Our gateway's WireGuard public key as last read, which no remote may announce as its own.
    own_key: Mutex<Option<WgKey>>,
}

/// The remotes a reconciliation pass looks at: all of them, or only those something happened
/// to since the last pass.
#[derive(Debug, Default)]
pub struct Dirty {
    pub all: bool,
    pub ids: BTreeSet<ClusterId>,
}

/// Which of the reconciler's two lanes works on a remote. Full peers (direct NetworkConfig
/// exchange, the hub of induced peerings) and induced peers (relayed through a hub) are
/// reconciled by separate loops, so the handshake-to-tunnel path of a full peering never
/// waits behind a pass over hundreds of induced exchanges, each waiting on a relay through
/// the hub (ADR 0015).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lane {
    Full,
    Induced,
}

impl Lane {
    pub const ALL: [Lane; 2] = [Lane::Full, Lane::Induced];

    /// The lane of an exchange relayed through `via` (none: a direct one).
    pub fn of_via<T>(via: Option<&T>) -> Self {
        if via.is_some() {
            Lane::Induced
        } else {
            Lane::Full
        }
    }

    /// The lane of a remote routed as `route`.
    pub fn of_route(route: &trellis_api::peers::Route) -> Self {
        match route {
            trellis_api::peers::Route::Direct { .. } => Lane::Full,
            trellis_api::peers::Route::Relayed { .. } => Lane::Induced,
        }
    }

    /// The other lane.
    pub fn other(self) -> Self {
        match self {
            Lane::Full => Lane::Induced,
            Lane::Induced => Lane::Full,
        }
    }

    fn index(self) -> usize {
        match self {
            Lane::Full => 0,
            Lane::Induced => 1,
        }
    }
}

/// One lane's pending work and its wake-up.
#[derive(Debug)]
struct LaneState {
    dirty: Mutex<Dirty>,
    wake: Arc<Notify>,
}

impl LaneState {
    fn new() -> Self {
        Self {
            dirty: Mutex::new(Dirty {
                all: true,
                ids: BTreeSet::new(),
            }),
            wake: Arc::new(Notify::new()),
        }
    }
}

fn local(context: &str) -> impl Fn(tonic::Status) -> Error + '_ {
    move |status| Error::from(status).context(context)
}

impl Broker {
    pub fn new(
        identity: ClusterIdentity,
        store: SharedStore,
        clients: Clients,
        initial_token: Option<String>,
    ) -> Self {
        Self {
            identity,
            store,
            clients,
            initial_token,
            lanes: [LaneState::new(), LaneState::new()],
            peering_locks: Mutex::new(HashMap::new()),
            allowed: AllowedRanges::default(),
            foreign_clusters: ForeignClusters::new(),
            own_key: Mutex::new(None),
        }
    }

    /// Replaces the default ranges peers may use.
    #[must_use]
    pub fn with_allowed_remote_ranges(mut self, allowed: AllowedRanges) -> Self {
        self.allowed = allowed;
        self
    }

    /// Refuses a peer's spec whose ranges lie outside the allowed space.
    pub fn check_remote_spec(&self, prefix: &str, spec: &NetworkSpec) -> Result<()> {
        self.allowed
            .check(&format!("{prefix}.pod_cidr"), spec.pod_cidr)?;
        self.allowed
            .check(&format!("{prefix}.external_cidr"), spec.external_cidr)
    }

    /// Refuses a peer's decision about us whose views lie outside the allowed space.
    pub fn check_remote_decision(&self, prefix: &str, decision: &Decision) -> Result<()> {
        if let Some(view) = decision.view() {
            self.allowed
                .check(&format!("{prefix}.pod_cidr_nat"), view.pod_cidr_nat)?;
            self.allowed.check(
                &format!("{prefix}.external_cidr_nat"),
                view.external_cidr_nat,
            )?;
        }
        Ok(())
    }

    /// Serialises starting, ending and notifying the peering with `remote` (in this process;
    /// the broker runs as one replica per cluster, and its Deployment is `Recreate` so that a
    /// rollout never runs two).
    async fn lock_peering(&self, remote: &ClusterId) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = self
            .peering_locks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(remote.clone())
            .or_default()
            .clone();
        lock.lock_owned().await
    }

    /// A new peering with `remote` supersedes an unpeering of it that was never acknowledged:
    /// the old notice must not end the new peering when it finally gets through.
    async fn cancel_notice(&self, remote: &ClusterId) -> Result<()> {
        if self.store.delete(&notify_key(remote)).await? {
            tracing::info!(remote.id = %remote, "a new peering cancels an undelivered unpeering notice");
        }
        Ok(())
    }

    pub fn identity(&self) -> &ClusterIdentity {
        &self.identity
    }

    pub fn store(&self) -> &SharedStore {
        &self.store
    }

    pub fn clients(&self) -> &Clients {
        &self.clients
    }

    /// Asks both lanes of the reconciler for a pass over every remote.
    pub fn wake(&self) {
        for lane in &self.lanes {
            lane.dirty
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .all = true;
            lane.wake.notify_one();
        }
    }

    /// Asks `lane` for a pass over `remote` (what changed concerns only it). A remote woken
    /// in the wrong lane (its route changed meanwhile) is handed to the other one by the pass.
    pub fn wake_for(&self, remote: &ClusterId, lane: Lane) {
        let state = &self.lanes[lane.index()];
        state
            .dirty
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .ids
            .insert(remote.clone());
        state.wake.notify_one();
    }

    /// What `lane`'s next pass must look at; resets it.
    pub fn take_dirty(&self, lane: Lane) -> Dirty {
        std::mem::take(
            &mut *self.lanes[lane.index()]
                .dirty
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    /// Notified whenever `lane` has new work.
    pub(crate) fn lane_wake(&self, lane: Lane) -> Arc<Notify> {
        self.lanes[lane.index()].wake.clone()
    }

    /// The token, created on first use.
    pub async fn token(&self) -> Result<TokenRecord> {
        token::current(&self.store, self.initial_token.as_deref()).await
    }

    /// The addresses this cluster advertises, as its discovery service knows them.
    pub async fn advertised(&self) -> Result<Addresses> {
        let answer = self
            .clients
            .discovery()
            .get_identity(GetIdentityRequest {})
            .await
            .map_err(local(
                "asking the local discovery service for our addresses",
            ))?
            .into_inner();
        trellis_api::convert::addresses_from_pb("addresses", answer.addresses.as_ref())
    }

    /// The peering view of the local discovery service.
    pub async fn peers(&self) -> Result<Peers> {
        let listing = self
            .clients
            .discovery()
            .list_foreign_clusters(ListForeignClustersRequest { kind: 0 })
            .await
            .map_err(local("listing foreign clusters"))?
            .into_inner();
        Ok(Peers::from_foreign_clusters(&listing.foreign_clusters))
    }

    /// The peering view for a pass: from the watch-fed copy of discovery's records when it is
    /// synced, otherwise [`Self::peers`]. The copy may lag discovery, so whatever is torn down
    /// or freed because a cluster is absent from it is confirmed with [`Self::peers`] first.
    pub async fn view(&self) -> Result<Peers> {
        let cached = self
            .foreign_clusters
            .with_records(|records| Peers::from_foreign_clusters(records.iter().copied()));
        match cached {
            Some(peers) => Ok(peers),
            None => self.peers().await,
        }
    }

    /// The peering view of the clusters `ids` only (unknown ones are absent): one record
    /// lookup each instead of a listing, for the checks on every received NetworkConfig.
    pub async fn peers_of(&self, ids: &[&ClusterId]) -> Result<Peers> {
        Ok(Peers::from_foreign_clusters(
            &self.foreign_clusters_of(ids).await?,
        ))
    }

    /// The discovery records of `ids` (unknown ones are absent), one lookup each.
    pub async fn foreign_clusters_of(
        &self,
        ids: &[&ClusterId],
    ) -> Result<Vec<trellis_api::pb::types::ForeignCluster>> {
        foreign_clusters::read(&self.clients.discovery_channel(), ids).await
    }

    /// The watch-fed copy of discovery's records.
    pub fn foreign_clusters(&self) -> &ForeignClusters {
        &self.foreign_clusters
    }

    /// `check` on the peering view of `ids` from the watch-fed copy (records it lacks are read
    /// from discovery) and, only if that refuses, on a view read from discovery: a copy that
    /// lags never makes a refusal.
    async fn check_peers<T>(
        &self,
        ids: &[&ClusterId],
        check: impl Fn(&Peers) -> Result<T>,
    ) -> Result<T> {
        if self.foreign_clusters.synced() {
            let cached = self
                .foreign_clusters
                .lookup(&self.clients.discovery_channel(), ids, |_| true)
                .await?;
            if let Ok(passed) = check(&Peers::from_foreign_clusters(&cached)) {
                return Ok(passed);
            }
        }
        check(&self.peers_of(ids).await?)
    }

    /// Checks a CA certificate a peer sent in the handshake (ADR 0014): with TLS on it is
    /// required, must name the peer and must not be ours. Returns what to pin.
    fn peer_ca(&self, field: &str, remote: &ClusterId, pem: &str) -> Result<Option<PinnedCa>> {
        let Some(tls) = self.clients.tls() else {
            return Ok(None);
        };
        if pem.is_empty() {
            return Err(Error::invalid(
                field,
                format!(
                    "is required: {} runs with mutual TLS between clusters",
                    self.identity.id
                ),
            ));
        }
        let ca = PinnedCa::from_pem(remote.as_str(), pem)
            .map_err(|e| Error::invalid(field, e.to_string()))?;
        let ours = PinnedCa::from_pem(self.identity.id.as_str(), tls.ca_pem())?;
        if ca.fingerprint() == ours.fingerprint() {
            return Err(Error::invalid(field, "is this cluster's own CA"));
        }
        Ok(Some(ca))
    }

    /// The re-handshake rule (ADR 0014): a handshake for an identity we are already peered
    /// with must present the CA we pinned for it, and must come over mutual TLS from a
    /// certificate of that cluster. The handshake method itself takes callers without a
    /// certificate (first contact), and a CA certificate is public (servers send it in their
    /// chain), so without both checks any holder of our token could take over the identity:
    /// replace its addresses and peering ID and cancel our unpeering notice to it. The peer
    /// itself re-handshakes over mutual TLS ([`Broker::peer`]). Re-admitting a cluster that
    /// lost its CA, its certificate or its records is an operator's decision: `Unpeer` it here,
    /// then it peers again like a new cluster.
    async fn refuse_takeover(
        &self,
        remote: &ClusterId,
        ca: &PinnedCa,
        caller: &Caller,
    ) -> Result<()> {
        let request = GetForeignClusterRequest {
            cluster_id: remote.to_string(),
        };
        let record = match self.clients.discovery().get_foreign_cluster(request).await {
            Ok(answer) => answer.into_inner().foreign_cluster,
            Err(status) if status.code() == tonic::Code::NotFound => None,
            Err(status) => return Err(local("reading the foreign cluster")(status)),
        };
        let Some(record) = record else {
            return Ok(());
        };
        let peers = Peers::from_foreign_clusters(std::slice::from_ref(&record));
        let pinned = record
            .full
            .map(|f| f.ca_certificate)
            .filter(|pem| !pem.is_empty());
        let (true, Some(pinned)) = (peers.is_full_peer(remote), pinned) else {
            return Ok(());
        };
        let pinned = PinnedCa::from_pem(remote.as_str(), &pinned)?;
        if pinned.fingerprint() != ca.fingerprint() {
            tracing::warn!(remote.id = %remote, pinned = pinned.fingerprint(), presented = ca.fingerprint(), "refused a handshake presenting another ca for a peered cluster");
            return Err(Error::PermissionDenied(format!(
                "cluster {remote} is peered with another CA; an operator must unpeer it before it \
                 can peer again with a new one"
            )));
        }
        match caller {
            Caller::Peer(peer)
                if peer.cluster_id == remote.as_str()
                    && peer.ca_fingerprint == pinned.fingerprint() =>
            {
                Ok(())
            }
            other => {
                let who = match other {
                    Caller::Peer(peer) => peer.cluster_id.clone(),
                    Caller::Anonymous | Caller::Plaintext => "no client certificate".to_owned(),
                };
                tracing::warn!(remote.id = %remote, caller = %who, "refused a handshake for a peered cluster that did not come from its certificate");
                Err(Error::PermissionDenied(format!(
                    "cluster {remote} is already peered: a new handshake for it must come over \
                     mutual TLS with its own certificate (its broker's Peer does so); if it lost \
                     its certificate or its records, an operator unpeers it here first"
                )))
            }
        }
    }

    /// Our CA certificate for the handshake (empty without TLS).
    /// The hash peers pin our CA by (`None` without TLS).
    pub fn ca_cert_hash(&self) -> Option<String> {
        self.clients
            .tls()
            .and_then(|t| t.own_ca_hash().ok())
            .map(|h| h.to_string())
    }

    /// Writes `out` over `nc/out/<remote>` if it is still at `revision`; whether it was.
    async fn replace_outgoing(&self, key: &str, revision: i64, out: &OutgoingNc) -> Result<bool> {
        let committed = self
            .store
            .txn(
                Txn::new()
                    .when(Compare::mod_revision(key, revision))
                    .then(Op::put(key, encode(out)?)),
            )
            .await?;
        Ok(committed.succeeded)
    }

    fn our_ca(&self) -> String {
        self.clients
            .tls()
            .map(|t| t.ca_pem().to_owned())
            .unwrap_or_default()
    }

    /// Pins (or, `None` on unpeering, unpins) a peer's CA in our own trust store at once; the
    /// trust sync from discovery would do it a moment later.
    fn pin(&self, remote: &ClusterId, ca: Option<PinnedCa>) {
        if let Some(tls) = self.clients.tls() {
            match ca {
                Some(ca) => {
                    tls.trust().pin(ca);
                }
                None => {
                    tls.trust().unpin(remote.as_str());
                }
            }
        }
    }

    async fn record_peering(
        &self,
        remote: &ClusterIdentity,
        addresses: Option<&Addresses>,
        peered: bool,
        reason: &str,
        ca: Option<&PinnedCa>,
    ) -> Result<()> {
        self.clients
            .discovery()
            .update_peering(UpdatePeeringRequest {
                identity: Some(identity_to_pb(remote)),
                peered,
                addresses: addresses.map(addresses_to_pb),
                outgoing_peering_enabled: peered,
                incoming_peering_enabled: peered,
                networking_enabled: peered,
                reason: reason.to_owned(),
                message: String::new(),
                expected_revision: 0,
                ca_certificate: ca.map(|c| c.pem().to_owned()).unwrap_or_default(),
            })
            .await
            .map_err(local(
                "recording the peering in the local discovery service",
            ))?;
        Ok(())
    }

    /// Answers a remote's handshake: checks the token, records the caller as a full peer,
    /// returns who we are and where our services are. `transport` is who the connection it
    /// came on authenticated (checked for a cluster we are already peered with).
    #[tracing::instrument(skip_all, fields(remote.id = %caller.id))]
    pub async fn handshake(
        &self,
        transport: &Caller,
        presented: &str,
        caller: &ClusterIdentity,
        addresses: &Addresses,
        ca_certificate: &str,
        peering_id: Option<&PeeringId>,
    ) -> Result<(ClusterIdentity, Addresses, String)> {
        let token = self.token().await?;
        if !token::accepts(&token, presented) {
            tracing::warn!(remote.id = %caller.id, "refused a handshake with a wrong or expired token");
            return Err(Error::PermissionDenied(
                "the peering token is wrong or expired".into(),
            ));
        }
        if caller.id == self.identity.id {
            return Err(Error::invalid(
                "identity.cluster_id",
                "is our own cluster ID",
            ));
        }
        if addresses.broker.is_empty() {
            return Err(Error::invalid(
                "addresses.broker",
                "is required: we must be able to reach the caller's broker",
            ));
        }
        let ca = self.peer_ca("ca_certificate", &caller.id, ca_certificate)?;
        // Without TLS nothing authenticates the caller: a re-handshake is taken as it comes
        // (plaintext trusts everyone who reaches the services; README, ADR 0014).
        if let Some(ca) = &ca {
            self.refuse_takeover(&caller.id, ca, transport).await?;
        }
        let ours = self.advertised().await?;
        let _peering = self.lock_peering(&caller.id).await;
        self.cancel_notice(&caller.id).await?;
        self.keep_peering_id(&caller.id, peering_id).await?;
        self.record_peering(
            caller,
            Some(addresses),
            true,
            "HandshakeAccepted",
            ca.as_ref(),
        )
        .await?;
        self.pin(&caller.id, ca);
        tracing::info!(remote.id = %caller.id, remote.name = %caller.name, "accepted a peering handshake");
        self.wake();
        Ok((self.identity.clone(), ours, self.our_ca()))
    }

    /// Peers with the cluster whose broker listens at `address`.
    #[tracing::instrument(skip(self, presented))]
    pub async fn peer(
        &self,
        address: &str,
        presented: &str,
        expected: Option<&ClusterId>,
        pin: Option<CaCertHash>,
    ) -> Result<(ClusterIdentity, Addresses)> {
        let ours = self.advertised().await?;
        if ours.broker.is_empty() {
            return Err(Error::FailedPrecondition(
                "the local discovery service advertises no broker address; peers could not reach us".into(),
            ));
        }
        let peered = self.peered_at(address, expected).await?;
        let mut client = match (&peered, pin) {
            // Already peered: the remote takes a new handshake only over mutual TLS from our
            // certificate (`refuse_takeover`), and the server must chain to its pinned CA.
            (Some(id), _) => self.clients.broker(address, id)?,
            (None, Some(pin)) => self.clients.pinned_handshake_broker(address, pin)?,
            (None, None) => {
                if self.clients.tls().is_some() {
                    tracing::warn!(remote = %address, "first contact is unpinned: the token goes to whoever answers at this address (pass ca_cert_hash, as `trellisctl token --join` prints it)");
                }
                self.clients.handshake_broker(address)?
            }
        };
        let peering_id = PeeringId::random();
        let answer = client
            .handshake(HandshakeRequest {
                token: presented.to_owned(),
                identity: Some(identity_to_pb(&self.identity)),
                addresses: Some(addresses_to_pb(&ours)),
                ca_certificate: self.our_ca(),
                peering_id: peering_id.to_string(),
            })
            .await
            .map_err(|status| {
                if pin.is_some() && status.message().contains("pinned CA") {
                    return Error::PermissionDenied(format!(
                        "the broker at {address} does not present a certificate of the CA \
                         pinned by ca_cert_hash; nothing was sent ({})",
                        status.message()
                    ));
                }
                if let Some(id) = &peered {
                    return Error::from(status).context(format!(
                        "handshake with {address} over mutual TLS (we are peered with {id}; a \
                         remote whose CA changed must be unpeered here first)"
                    ));
                }
                Error::from(status).context(format!("handshake with {address}"))
            })?
            .into_inner();
        let unusable = |e: Error| {
            Error::FailedPrecondition(format!(
                "the broker at {address} answered an unusable handshake: {e}"
            ))
        };
        let remote = trellis_api::convert::identity_from_pb("identity", answer.identity.as_ref())
            .map_err(unusable)?;
        let addresses =
            trellis_api::convert::addresses_from_pb("addresses", answer.addresses.as_ref())
                .map_err(unusable)?;
        if remote.id == self.identity.id {
            return Err(Error::FailedPrecondition(format!(
                "the broker at {address} is our own"
            )));
        }
        if let Some(expected) = expected.filter(|e| **e != remote.id) {
            return Err(Error::FailedPrecondition(format!(
                "the broker at {address} belongs to cluster {}, not {expected}",
                remote.id
            )));
        }
        if let Some(pin) = pin
            && CaCertHash::of_pem(&answer.ca_certificate).ok() != Some(pin)
        {
            return Err(Error::PermissionDenied(format!(
                "the broker at {address} answered with a CA other than the one ca_cert_hash pins"
            )));
        }
        let ca = self
            .peer_ca("ca_certificate", &remote.id, &answer.ca_certificate)
            .map_err(unusable)?;
        let _peering = self.lock_peering(&remote.id).await;
        self.cancel_notice(&remote.id).await?;
        self.keep_peering_id(&remote.id, Some(&peering_id)).await?;
        self.record_peering(&remote, Some(&addresses), true, PEERED_REASON, ca.as_ref())
            .await?;
        self.pin(&remote.id, ca);
        tracing::info!(remote.id = %remote.id, remote.name = %remote.name, "peered");
        self.wake();
        Ok((remote, addresses))
    }

    /// With mutual TLS on, the full peer we hold a pinned CA for that `address` reaches: the
    /// `expected` cluster, or the one advertising `address` as its broker. `None` without TLS
    /// or when we are not peered with it (first contact).
    async fn peered_at(
        &self,
        address: &str,
        expected: Option<&ClusterId>,
    ) -> Result<Option<ClusterId>> {
        let Some(tls) = self.clients.tls() else {
            return Ok(None);
        };
        let peers = self.peers().await?;
        let found = peers
            .full
            .iter()
            .find(|(id, (_, addresses, _))| match expected {
                Some(expected) => *id == expected,
                None => addresses.broker == address,
            })
            .map(|(id, _)| id.clone());
        Ok(found.filter(|id| tls.trust().get(id.as_str()).is_some()))
    }

    /// Ends the full peering with `id`: marks it unpeered (the reconciler tears down what was
    /// built on it) and tells the remote, retrying later if it is unreachable.
    #[tracing::instrument(skip(self))]
    pub async fn unpeer(&self, id: &ClusterId) -> Result<bool> {
        let _peering = self.lock_peering(id).await;
        let peers = self.peers().await?;
        let Some((remote, addresses, _)) = peers.full.get(id).cloned() else {
            return Ok(false);
        };
        // Kept to reach the remote over mutual TLS once it is unpinned.
        let ca_certificate = self
            .clients
            .tls()
            .and_then(|t| t.trust().get(id.as_str()))
            .map(|ca| ca.pem().to_owned())
            .unwrap_or_default();
        // The notice is the unpeering's intent and is written first: a crash after it is rolled
        // forward by the reconciler ([`Broker::act_on_notice`]); a crash before it leaves the
        // peering as it was.
        let peering_id = self.peering_id(id).await?;
        let pending = (!addresses.broker.is_empty()).then(|| PendingNotify {
            remote: remote.clone(),
            broker: addresses.broker.clone(),
            reason: UNPEERED_REASON.into(),
            ca_certificate,
            peering_id,
        });
        if let Some(pending) = &pending {
            self.store.put(&notify_key(id), encode(pending)?).await?;
        }
        self.end_peering(&remote).await?;
        if let Some(pending) = &pending {
            self.deliver_notify(pending).await;
        }
        tracing::info!(remote.id = %id, "unpeered");
        self.wake();
        Ok(true)
    }

    /// The ID of the current peering with `remote`, if it has one.
    async fn peering_id(&self, remote: &ClusterId) -> Result<Option<PeeringId>> {
        let key = peering_key(remote);
        match self.store.get(&key).await? {
            Some(kv) => Ok(Some(crate::records::decode(&key, &kv.value)?)),
            None => Ok(None),
        }
    }

    /// Keeps the ID of the peering with `remote` being recorded (forgets any older one when
    /// the caller sent none, so that its notices end whatever peering there is).
    async fn keep_peering_id(&self, remote: &ClusterId, id: Option<&PeeringId>) -> Result<()> {
        let key = peering_key(remote);
        match id {
            Some(id) => self.store.put(&key, encode(id)?).await.map(drop)?,
            None => self.store.delete(&key).await.map(drop)?,
        }
        Ok(())
    }

    /// Our side of ending the peering with `remote`: discovery marks it unpeered (the
    /// reconciler tears down what was built on it) and its CA is no longer trusted.
    async fn end_peering(&self, remote: &ClusterIdentity) -> Result<()> {
        self.record_peering(remote, None, false, UNPEERED_REASON, None)
            .await?;
        self.keep_peering_id(&remote.id, None).await?;
        self.pin(&remote.id, None);
        Ok(())
    }

    /// Acts on the stored unpeering notice for `remote` (the reconciler, for every notice):
    /// completes our side if it is still peered (the broker died between writing the notice
    /// and changing discovery), then delivers the notice. A notice a new peering cancelled in
    /// the meantime is gone and nothing happens. Returns whether nothing is left to do.
    pub async fn act_on_notice(&self, remote: &ClusterId) -> Result<bool> {
        let _peering = self.lock_peering(remote).await;
        let key = notify_key(remote);
        let Some(kv) = self.store.get(&key).await? else {
            return Ok(true);
        };
        let pending: PendingNotify = crate::records::decode(&key, &kv.value)?;
        if self.peers_of(&[remote]).await?.is_full_peer(remote) {
            tracing::info!(remote.id = %remote, "completing an unpeering interrupted before discovery heard of it");
            self.end_peering(&pending.remote).await?;
            self.wake();
        }
        Ok(self.deliver_notify(&pending).await)
    }

    /// Tries to deliver a pending unpeering notice; forgets it once acknowledged.
    pub async fn deliver_notify(&self, pending: &PendingNotify) -> bool {
        let sent = match self.clients.unpinned_broker(
            &pending.broker,
            &pending.remote.id,
            &pending.ca_certificate,
        ) {
            Ok(mut client) => client
                .notify_unpeer(NotifyUnpeerRequest {
                    identity: Some(identity_to_pb(&self.identity)),
                    reason: pending.reason.clone(),
                    peering_id: pending
                        .peering_id
                        .as_ref()
                        .map(ToString::to_string)
                        .unwrap_or_default(),
                })
                .await
                .map_err(Error::from),
            Err(e) => Err(e),
        };
        match sent {
            Ok(_) => {
                if let Err(err) = self.store.delete(&notify_key(&pending.remote.id)).await {
                    tracing::warn!(error = %err, "could not forget a delivered unpeering notice");
                }
                true
            }
            Err(err) => {
                tracing::warn!(remote.id = %pending.remote.id, error = %err, "unpeering notice not delivered yet");
                false
            }
        }
    }

    /// The remote `caller` unpeered us, ending the peering `ends` (`None`: whatever peering
    /// there is). A notice for an earlier peering than ours changes nothing.
    pub async fn notified_unpeer(
        &self,
        caller: &ClusterIdentity,
        reason: &str,
        ends: Option<&PeeringId>,
    ) -> Result<bool> {
        let _peering = self.lock_peering(&caller.id).await;
        let peers = self.peers().await?;
        if !peers.is_full_peer(&caller.id) {
            return Ok(false);
        }
        if let (Some(ends), Some(current)) = (ends, self.peering_id(&caller.id).await?)
            && *ends != current
        {
            tracing::warn!(remote.id = %caller.id, notice.peering_id = %ends, peering_id = %current, "ignoring an unpeering notice for an earlier peering");
            return Ok(false);
        }
        self.record_peering(
            caller,
            None,
            false,
            if reason.is_empty() {
                "RemoteUnpeered"
            } else {
                reason
            },
            None,
        )
        .await?;
        self.keep_peering_id(&caller.id, None).await?;
        self.pin(&caller.id, None);
        tracing::info!(remote.id = %caller.id, reason, "the remote unpeered us");
        self.wake();
        Ok(true)
    }

    /// Receives a NetworkConfig destined to us, decides how we address its origin, stores both.
    #[tracing::instrument(skip_all, fields(remote.id = %nc.origin.id, generation = nc.generation))]
    pub async fn receive(&self, nc: Received) -> Result<Answer> {
        self.check_remote_spec("network_config.spec", &nc.spec)?;
        let ids = match &nc.via {
            None => vec![&nc.origin.id],
            Some(hub) => vec![&hub.id, &nc.origin.id],
        };
        self.check_peers(&ids, |peers| self.may_send(peers, &nc))
            .await?;

        let ours = self.outgoing(&nc.origin.id).await?;
        let receiver_generation = ours.as_ref().map_or(0, |o| o.generation);
        let key = in_key(&nc.origin.id);
        let held = match self.store.get(&key).await? {
            Some(kv) => Some((decode::<IncomingNc>(&key, &kv.value)?, kv.mod_revision)),
            None => None,
        };
        if let Some((held, _)) = &held {
            if held.generation > nc.generation {
                return Ok(Answer {
                    accepted: false,
                    generation: held.generation,
                    decision: held.decision.clone(),
                    receiver_generation,
                });
            }
            // A pending decision (no free range when we last tried) is made again: the
            // sender re-submits exactly so that we look once more.
            if held.generation == nc.generation
                && held.spec == nc.spec
                && held.via == nc.via
                && !matches!(held.decision, Decision::Pending { .. })
            {
                return Ok(Answer {
                    accepted: true,
                    generation: held.generation,
                    decision: held.decision.clone(),
                    receiver_generation,
                });
            }
        }

        self.refuse_duplicate_key(&nc, ours.as_ref()).await?;
        let decision = self.decide(&nc).await?;
        if let Some((held, _)) = &held
            && held.generation == nc.generation
            && held.spec == nc.spec
            && held.via == nc.via
            && held.decision == decision
        {
            // Still pending for the same reason: nothing to write on each re-submission.
            return Ok(Answer {
                accepted: true,
                generation: held.generation,
                decision,
                receiver_generation,
            });
        }
        let record = IncomingNc {
            remote: nc.origin.clone(),
            via: nc.via.clone(),
            spec: nc.spec,
            generation: nc.generation,
            decision: decision.clone(),
        };
        let revision = held.as_ref().map_or(0, |(_, r)| *r);
        let committed = self
            .store
            .txn(Txn {
                compares: vec![Compare::ModRevision {
                    key: key.clone(),
                    revision,
                }],
                success: vec![Op::Put {
                    key,
                    value: encode(&record)?,
                    lease: None,
                }],
                failure: vec![],
            })
            .await?;
        if !committed.succeeded {
            return Err(Error::Aborted(format!(
                "a concurrent NetworkConfig from {} arrived; retry",
                nc.origin.id
            )));
        }
        tracing::info!(remote.id = %nc.origin.id, via = ?nc.via.as_ref().map(|v| v.id.to_string()), "received a network config");
        // A new incarnation of the remote's NC (generations are wall-clock seeded, ADR 0012)
        // may come from a remote that lost our NC (a teardown, a withdrawal, a rebuilt store):
        // forget the decision on ours so the next pass sends it again, unless the decision
        // came from this very incarnation.
        if held
            .as_ref()
            .is_none_or(|(h, _)| h.generation < nc.generation)
        {
            self.resend(&nc.origin.id, nc.generation, nc.held_generation)
                .await?;
        }
        self.wake_for(&nc.origin.id, Lane::of_via(nc.via.as_ref()));
        Ok(Answer {
            accepted: true,
            generation: nc.generation,
            decision,
            receiver_generation,
        })
    }

    /// Remembers our gateway's WireGuard public key (the reconciler, whenever it reads it).
    pub fn note_own_key(&self, key: WgKey) {
        *self.own_key.lock().unwrap_or_else(PoisonError::into_inner) = Some(key);
    }

    /// Our gateway's WireGuard public key: the one our NetworkConfig to the origin carries, the
    /// one last read, or the gateway's answer.
    async fn own_key(&self, ours: Option<&OutgoingNc>) -> Result<WgKey> {
        if let Some(out) = ours {
            return Ok(out.spec.public_key);
        }
        let known = *self.own_key.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(key) = known {
            return Ok(key);
        }
        let info = self
            .clients
            .gateway()
            .get_gateway_info(GetGatewayInfoRequest {
                cluster_id: String::new(),
            })
            .await
            .map_err(local("asking the gateway for its public key"))?
            .into_inner();
        let key = WgKey::parse("public_key", &info.public_key).map_err(|e| {
            Error::Internal(format!("the gateway answered an unusable public key: {e}"))
        })?;
        self.note_own_key(key);
        Ok(key)
    }

    /// Refuses a NetworkConfig whose WireGuard key is ours or another remote's (issue 32). The
    /// gateway's engine tells peers apart by their keys and refuses a key it already holds, so
    /// of two remotes announcing one key, the one added second (in cluster-ID order, on every
    /// pass after a restart) gets no tunnel: a peer could knock out another's tunnel by
    /// announcing its key. A key's first holder keeps it: the newcomer is refused and nothing
    /// is stored. Its own earlier NetworkConfig and refused ones do not count.
    async fn refuse_duplicate_key(&self, nc: &Received, ours: Option<&OutgoingNc>) -> Result<()> {
        let key = nc.spec.public_key;
        if key == self.own_key(ours).await? {
            tracing::warn!(remote.id = %nc.origin.id, "refused a network config announcing our own wireguard key");
            return Err(Error::invalid(
                "network_config.spec.public_key",
                format!("is the WireGuard key of {}'s own gateway", self.identity.id),
            ));
        }
        for kv in self.store.list(IN_PREFIX).await?.kvs {
            let held: IncomingNc = decode(&kv.key, &kv.value)?;
            if held.remote.id != nc.origin.id
                && held.spec.public_key == key
                && !matches!(held.decision, Decision::Rejected { .. })
            {
                tracing::warn!(remote.id = %nc.origin.id, holder = %held.remote.id, "refused a network config announcing another peer's wireguard key");
                return Err(Error::AlreadyExists(format!(
                    "network_config.spec.public_key: cluster {} already uses this WireGuard key \
                     with {}; each peer needs its own",
                    held.remote.id, self.identity.id
                )));
            }
        }
        Ok(())
    }

    /// Whether `peers` let `nc`'s origin send it to us: directly as a full peer, or through a
    /// full peer that introduced it.
    fn may_send(&self, peers: &Peers, nc: &Received) -> Result<()> {
        match &nc.via {
            None if !peers.is_full_peer(&nc.origin.id) => Err(Error::PermissionDenied(format!(
                "cluster {} is not a full peer of {}",
                nc.origin.id, self.identity.id
            ))),
            None => Ok(()),
            Some(hub) if !peers.is_full_peer(&hub.id) => Err(Error::PermissionDenied(format!(
                "the relaying hub {} is not a full peer of {}",
                hub.id, self.identity.id
            ))),
            Some(hub) if !peers.introduced_by(&nc.origin.id, &hub.id) => {
                Err(Error::FailedPrecondition(format!(
                    "cluster {} has not (yet) been introduced to us by {}; retry later",
                    nc.origin.id, hub.id
                )))
            }
            Some(_) => Ok(()),
        }
    }

    /// Clears the decision on our NC towards `remote`, so that the pass delivers it again;
    /// not when the remote's incarnation that just sent generation `theirs` holds ours: it
    /// decided on ours while its own NC was at `theirs`, or it says it holds our current
    /// generation (`held`).
    async fn resend(&self, remote: &ClusterId, theirs: i64, held: i64) -> Result<()> {
        let key = out_key(remote);
        let mut contention = Contention::on(&self.store, "re-sending our network config");
        loop {
            let Some(kv) = self.store.get(&key).await? else {
                return Ok(());
            };
            let mut out: OutgoingNc = decode(&key, &kv.value)?;
            if out.decision.is_none() {
                return Ok(());
            }
            if out.receiver_generation == theirs || held == out.generation {
                tracing::debug!(remote.id = %remote, "the remote's new network config comes from the incarnation that holds ours");
                return Ok(());
            }
            out.decision = None;
            let committed = self.replace_outgoing(&key, kv.mod_revision, &out).await?;
            if committed {
                tracing::info!(remote.id = %remote, "the remote sent a new incarnation: re-sending ours");
                return Ok(());
            }
            contention.lost().await?;
        }
    }

    /// Our NAT decision for a received spec, from the IPAM. A changed spec (a higher
    /// generation with other CIDRs) frees the old mapping first.
    async fn decide(&self, nc: &Received) -> Result<Decision> {
        let request = GetSubnetsPerClusterRequest {
            cluster_id: nc.origin.id.to_string(),
            cluster_name: nc.origin.name.clone(),
            pod_cidr: nc.spec.pod_cidr.to_string(),
            external_cidr: nc.spec.external_cidr.to_string(),
        };
        let mut ipam = self.clients.ipam();
        let answer = match ipam.get_subnets_per_cluster(request.clone()).await {
            Err(status) if status.code() == tonic::Code::FailedPrecondition => {
                tracing::info!(remote.id = %nc.origin.id, "the remote's CIDRs changed: remapping");
                ipam.free_subnets_per_cluster(FreeSubnetsPerClusterRequest {
                    cluster_id: nc.origin.id.to_string(),
                })
                .await
                .map_err(local("freeing the remote's old mapping"))?;
                ipam.get_subnets_per_cluster(request).await
            }
            other => other,
        };
        match answer {
            Ok(answer) => {
                let answer = answer.into_inner();
                let status = trellis_api::pb::types::NetworkConfigStatus {
                    pod_cidr_nat: answer.pod_cidr_nat,
                    external_cidr_nat: answer.external_cidr_nat,
                    ..Default::default()
                };
                let view = NatView::for_spec("ipam", &nc.spec, &status).map_err(|e| {
                    Error::Internal(format!("the IPAM answered an unusable mapping: {e}"))
                })?;
                Ok(Decision::Processed {
                    view,
                    observed_generation: nc.generation,
                })
            }
            // No free range to remap into passes when another peering frees one: the decision
            // waits, and the sender's re-submissions make it again (ADR 0010).
            Err(status) if status.code() == tonic::Code::ResourceExhausted => {
                tracing::warn!(remote.id = %nc.origin.id, reason = status.message(), "cannot decide on a network config yet");
                Ok(Decision::Pending {
                    message: status.message().to_owned(),
                    observed_generation: nc.generation,
                })
            }
            // The spec itself is unusable: only a new spec is worth deciding again.
            Err(status) if status.code() == tonic::Code::InvalidArgument => {
                tracing::warn!(remote.id = %nc.origin.id, reason = status.message(), "rejected a network config");
                Ok(Decision::Rejected {
                    message: status.message().to_owned(),
                    observed_generation: nc.generation,
                })
            }
            Err(status) => {
                Err(Error::from(status).context("asking the IPAM for the remote's mapping"))
            }
        }
    }

    /// Stores a remote's decision on our NetworkConfig and tells the IPAM how it addresses us.
    /// Returns false for a stale decision.
    /// `receiver_generation` is the remote's own NC generation when it decided (0: unknown).
    pub async fn decided(
        &self,
        remote: &ClusterId,
        decision: Decision,
        receiver_generation: i64,
    ) -> Result<bool> {
        self.check_remote_decision("status", &decision)?;
        let key = out_key(remote);
        let mut contention = Contention::on(&self.store, "recording a network config status");
        loop {
            let Some(kv) = self.store.get(&key).await? else {
                return Err(Error::NotFound(format!(
                    "no network config towards {remote}"
                )));
            };
            let mut out: OutgoingNc = decode(&key, &kv.value)?;
            if decision.observed_generation() != out.generation {
                return Ok(false);
            }
            let known = out.decision.as_ref() == Some(&decision);
            if known && out.receiver_generation == receiver_generation {
                return Ok(true);
            }
            if !known && let Decision::Processed { view, .. } = &decision {
                self.clients
                    .ipam()
                    .set_local_nat(SetLocalNatRequest {
                        cluster_id: remote.to_string(),
                        cluster_name: out.remote.name.clone(),
                        pod_cidr: view.pod_cidr_nat.to_string(),
                        external_cidr: view.external_cidr_nat.to_string(),
                    })
                    .await
                    .map_err(local("recording how the remote addresses us"))?;
            }
            out.decision = Some(decision.clone());
            out.receiver_generation = receiver_generation;
            let committed = self.replace_outgoing(&key, kv.mod_revision, &out).await?;
            if committed {
                tracing::info!(remote.id = %remote, generation = out.generation, "the remote decided on our network config");
                self.wake_for(remote, Lane::of_via(out.via.as_ref()));
                return Ok(true);
            }
            contention.lost().await?;
        }
    }

    /// Our NetworkConfig towards `remote`, if any.
    pub async fn outgoing(&self, remote: &ClusterId) -> Result<Option<OutgoingNc>> {
        let key = out_key(remote);
        match self.store.get(&key).await? {
            Some(kv) => Ok(Some(decode(&key, &kv.value)?)),
            None => Ok(None),
        }
    }

    /// The NetworkConfig `remote` sent us, if any.
    pub async fn incoming(&self, remote: &ClusterId) -> Result<Option<IncomingNc>> {
        let key = in_key(remote);
        match self.store.get(&key).await? {
            Some(kv) => Ok(Some(decode(&key, &kv.value)?)),
            None => Ok(None),
        }
    }

    /// The NetworkConfigs held, both directions.
    pub async fn network_configs(&self) -> Result<(Vec<OutgoingNc>, Vec<IncomingNc>)> {
        let outs = self.store.list(OUT_PREFIX).await?.kvs;
        let ins = self.store.list(IN_PREFIX).await?.kvs;
        Ok((
            outs.iter()
                .map(|kv| decode(&kv.key, &kv.value))
                .collect::<Result<_>>()?,
            ins.iter()
                .map(|kv| decode(&kv.key, &kv.value))
                .collect::<Result<_>>()?,
        ))
    }

    /// The TunnelEndpoints with their store revisions, and the listing's revision.
    pub async fn tunnels(&self) -> Result<(Vec<(TunnelRecord, i64)>, i64)> {
        let listing = self.store.list(TUNNELS_PREFIX).await?;
        let tunnels = listing
            .kvs
            .iter()
            .map(|kv| Ok((decode(&kv.key, &kv.value)?, kv.mod_revision)))
            .collect::<Result<_>>()?;
        Ok((tunnels, listing.revision))
    }
}

/// The `via` rule (ADR 0012): a call about a stored NetworkConfig may name a `via` only if it
/// is the hub the stored record was exchanged through; a direct NetworkConfig takes none. The
/// stored hub was checked to have introduced the counterpart when the record was written
/// (`receive` for ours, the route of the pass for theirs), so a peer naming itself as `via`
/// speaks for no exchange it does not relay.
pub fn check_via(
    remote: &ClusterId,
    stored: Option<&ClusterIdentity>,
    claimed: Option<&ClusterIdentity>,
) -> Result<()> {
    match (stored, claimed) {
        (None, None) => Ok(()),
        (Some(hub), Some(via)) if hub.id == via.id => Ok(()),
        (None, Some(via)) => Err(Error::PermissionDenied(format!(
            "the network config with {remote} is direct; {} does not relay it",
            via.id
        ))),
        (Some(hub), Some(via)) => Err(Error::PermissionDenied(format!(
            "the network config with {remote} is relayed by {}, not by {}",
            hub.id, via.id
        ))),
        (Some(hub), None) => Err(Error::PermissionDenied(format!(
            "the network config with {remote} is relayed by {}; only it may speak for it",
            hub.id
        ))),
    }
}
