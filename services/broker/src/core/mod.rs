//! The broker's domain operations: the token handshake, peering and unpeering, and receiving
//! NetworkConfigs and their statuses. Sending NetworkConfigs and deriving TunnelEndpoints is
//! the reconciler's job ([`crate::reconcile`]); operations here store what they learn and wake
//! it.
//!
//! This file keeps the [`Broker`], its construction and the plain reads of what it stores. Its
//! operations are `impl Broker` blocks in one submodule per kind of work, so that each can be
//! read without the others:
//!
//! - `ca_moves`: a peer's CA replaced by its next one, and ours announced to the peers;
//! - [`candidates`]: NAT traversal: where a hub sees its leaves' gateways, and those
//!   reflexive endpoints written into a leaf's induced TunnelEndpoints;
//! - [`lanes`]: the reconciler's two lanes, what each must look at next and how it is woken;
//! - `view`: what the local discovery service says: our addresses and the peering view;
//! - `handshake`: starting a peering, answering a remote's handshake or sending ours;
//! - `peering`: a peering's bookkeeping (its lock, discovery record, pinned CA and ID) and
//!   its end: unpeering, the notices that tell the remote, and a remote's notice to us;
//! - [`receive`]: receiving a NetworkConfig: the checks, our NAT decision, storing it;
//! - [`statuses`]: receiving a remote's decision on our NetworkConfig, and the `via` rule for
//!   calls about a stored one.

mod ca_moves;
pub mod candidates;
mod handshake;
pub mod lanes;
mod peering;
pub mod receive;
pub mod statuses;
mod view;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use trellis_api::model::WgKey;
use trellis_api::net::AllowedRanges;
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_store::SharedStore;

use self::lanes::LaneState;
use crate::records::{
    IN_PREFIX, IncomingNc, OUT_PREFIX, OutgoingNc, TUNNELS_PREFIX, TokenRecord, TunnelRecord,
    decode, in_key, out_key,
};
use crate::remote::Ports;

/// The reconciler's resync period unless set (`--resync`'s default).
pub const DEFAULT_RESYNC: Duration = Duration::from_secs(10);
use crate::token;

/// The broker of one cluster.
#[derive(Debug)]
pub struct Broker {
    identity: ClusterIdentity,
    store: SharedStore,
    ports: Ports,
    initial_token: Option<String>,
    /// The reconciler's two lanes (full peers, induced peers): what each must look at next
    /// and how to wake it (in memory only: a restart runs a full pass anyway).
    lanes: [LaneState; 2],
    /// Two locks per remote ([`peering::RemoteLocks`]): one over its peering's state, one
    /// over what we send it about the peering (our notices, our handshakes).
    remote_locks: Mutex<HashMap<ClusterId, peering::RemoteLocks>>,
    /// Where a peer's ranges, and its views of ours, may lie (`--allowed-remote-cidrs`).
    allowed: AllowedRanges,
    /// The reconciler's resync period (`--resync`).
    resync: Duration,
    /// Our gateway's WireGuard public key as last read, which no remote may announce as its own.
    own_key: Mutex<Option<WgKey>>,
    /// Woken when a new induced TunnelEndpoint is written: its candidates are wanted now
    /// ([`candidates`]).
    candidates_due: tokio::sync::Notify,
    /// The WireGuard keys of the NetworkConfigs held, by store key, as decoded at a revision
    /// (see [`receive`]'s duplicate-key check).
    held_keys: Mutex<HashMap<String, receive::HeldKey>>,
}

/// A local service's refusal, naming what we asked it for, for the ports' methods asked for
/// different reasons.
fn local(context: &str) -> impl Fn(Error) -> Error + '_ {
    move |err| err.context(context)
}

impl Broker {
    pub fn new(
        identity: ClusterIdentity,
        store: SharedStore,
        ports: Ports,
        initial_token: Option<String>,
    ) -> Self {
        Self {
            identity,
            store,
            ports,
            initial_token,
            lanes: [LaneState::new(), LaneState::new()],
            remote_locks: Mutex::new(HashMap::new()),
            allowed: AllowedRanges::default(),
            resync: DEFAULT_RESYNC,
            own_key: Mutex::new(None),
            held_keys: Mutex::new(HashMap::new()),
            candidates_due: tokio::sync::Notify::new(),
        }
    }

    /// Replaces the default ranges peers may use.
    #[must_use]
    pub fn with_allowed_remote_ranges(mut self, allowed: AllowedRanges) -> Self {
        self.allowed = allowed;
        self
    }

    /// Sets the reconciler's resync period (the default is `--resync`'s).
    #[must_use]
    pub fn with_resync(mut self, resync: Duration) -> Self {
        self.resync = resync;
        self
    }

    /// The reconciler's resync period.
    pub fn resync(&self) -> Duration {
        self.resync
    }

    pub fn identity(&self) -> &ClusterIdentity {
        &self.identity
    }

    pub fn store(&self) -> &SharedStore {
        &self.store
    }

    /// The ports to the other services.
    pub fn ports(&self) -> &Ports {
        &self.ports
    }

    /// The token, created on first use.
    pub async fn token(&self) -> Result<TokenRecord> {
        token::current(&self.store, self.initial_token.as_deref()).await
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
