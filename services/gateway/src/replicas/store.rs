//! The election's side of the store: the members and the active record read, this replica
//! registered, and the roamed endpoints shared. Every call is bounded by [`STORE_TIMEOUT`]:
//! the loop must go on deciding from heartbeats while the store is away, and a store outage
//! is only logged (the data plane goes on as it is).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use trellis_error::{Error, Result};
use trellis_store::{Compare, Op, SharedStore, Txn};

use super::Replicas;
use super::election::{Change, Election, Leader};
use crate::records::{self, ActiveRecord, MemberRecord, RoamedRecord, decode, encode};

/// How long one store operation of the election may take: the loop must not wait on a store
/// that went away (heartbeats go on meanwhile, on their own task).
const STORE_TIMEOUT: Duration = Duration::from_secs(1);

pub(super) async fn timed<T>(
    what: &str,
    op: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(STORE_TIMEOUT, op).await.map_err(|_| {
        Error::Unavailable(format!(
            "{what}: no answer from the store in {STORE_TIMEOUT:?}"
        ))
    })?
}

/// The active record and its revision.
pub async fn read_active(store: &SharedStore) -> Result<Option<(ActiveRecord, i64)>> {
    let Some(kv) = store.get(records::ACTIVE_KEY).await? else {
        return Ok(None);
    };
    Ok(Some((
        decode(records::ACTIVE_KEY, &kv.value)?,
        kv.mod_revision,
    )))
}

/// Writes `record` as the active one if the record is still the one read at `revision`
/// (`None`: if there is none). The record's new revision when it was written.
pub async fn claim(
    store: &SharedStore,
    revision: Option<i64>,
    record: &ActiveRecord,
) -> Result<Option<i64>> {
    let compare = match revision {
        Some(revision) => Compare::mod_revision(records::ACTIVE_KEY, revision),
        None => Compare::absent(records::ACTIVE_KEY),
    };
    let outcome = store
        .txn(
            Txn::new()
                .when(compare)
                .then(Op::put(records::ACTIVE_KEY, encode(record)?)),
        )
        .await?;
    Ok(outcome.succeeded.then_some(outcome.revision))
}

/// Every registered replica.
pub async fn members(store: &SharedStore) -> Result<Vec<MemberRecord>> {
    let listing = store.list(records::MEMBERS_PREFIX).await?;
    listing
        .kvs
        .iter()
        .map(|kv| decode(&kv.key, &kv.value))
        .collect()
}

impl Replicas {
    /// Reads the members and the active record; registers this replica when it is missing.
    pub(super) async fn sync(&self, election: &mut Election, registered: &mut bool) {
        let store = &self.store;
        match timed("listing the replicas", members(store)).await {
            Ok(list) => {
                let me = &self.settings.replica;
                for other in list.iter().filter(|m| &m.replica != me) {
                    if other.public_key != self.settings.public_key
                        && let Some(held) = self.odd_key.admit()
                    {
                        tracing::error!(held_back = held, replica = %other.replica, "a gateway replica registered with another public key: replicas share the key of their store, so it is not one of ours or its store differs; it never becomes active here");
                    }
                }
                let targets: std::collections::BTreeMap<String, SocketAddr> = list
                    .iter()
                    .filter(|m| &m.replica != me && m.public_key == self.settings.public_key)
                    .map(|m| (m.replica.clone(), m.heartbeat))
                    .collect();
                if let Ok(mut t) = self.targets.lock() {
                    *t = targets;
                }
                let mine = list.iter().find(|m| &m.replica == me);
                if !*registered || mine.is_none_or(|m| m.heartbeat != self.advertised) {
                    let member = self.member();
                    let written = match encode(&member) {
                        Ok(value) => timed("registering this replica", async {
                            store
                                .put(&records::member_key(me), value)
                                .await
                                .map_err(Error::from)
                        })
                        .await
                        .map(drop),
                        Err(err) => Err(err),
                    };
                    match written {
                        Ok(()) => *registered = true,
                        Err(err) => self.store_unavailable("registering this replica", &err),
                    }
                }
            }
            Err(err) => self.store_unavailable("listing the replicas", &err),
        }
        match timed("reading the active record", read_active(store)).await {
            Ok(record) => {
                let leader = record.as_ref().map(|(r, _)| Leader {
                    replica: r.replica.clone(),
                    epoch: r.epoch,
                });
                if election.on_record(leader, Instant::now()) == Some(Change::StepDown) {
                    self.stepped_down(election, "read");
                }
                if let Some((record, revision)) = record {
                    self.moved(revision, Instant::now());
                    self.publish(election, Some(record));
                }
            }
            Err(err) => self.store_unavailable("reading the active record", &err),
        }
        self.share_roamed(election).await;
    }

    /// The active writes where it hears roamed peers when that changed; a standby reads it
    /// and points its peers there.
    async fn share_roamed(&self, election: &Election) {
        use base64::Engine as _;
        let Some(engine) = self.engine.get() else {
            return;
        };
        let b64 = base64::engine::general_purpose::STANDARD;
        if let Some(epoch) = election.active() {
            let endpoints: std::collections::BTreeMap<String, SocketAddr> = engine
                .roamed()
                .into_iter()
                .map(|(key, at)| (b64.encode(key), at))
                .collect();
            if self.roamed.lock().ok().and_then(|r| r.clone()).as_ref() == Some(&endpoints) {
                return;
            }
            let record = RoamedRecord {
                epoch,
                endpoints: endpoints.clone(),
            };
            let written = match encode(&record) {
                Ok(value) => timed("sharing the roamed endpoints", async {
                    self.store
                        .put(records::ROAMED_KEY, value)
                        .await
                        .map_err(Error::from)
                })
                .await
                .map(drop),
                Err(err) => Err(err),
            };
            match written {
                Ok(()) => {
                    if let Ok(mut r) = self.roamed.lock() {
                        *r = Some(endpoints);
                    }
                }
                Err(err) => self.store_unavailable("sharing the roamed endpoints", &err),
            }
            return;
        }
        let read = timed("reading the roamed endpoints", async {
            match self.store.get(records::ROAMED_KEY).await? {
                Some(kv) => Ok(Some(decode::<RoamedRecord>(
                    records::ROAMED_KEY,
                    &kv.value,
                )?)),
                None => Ok(None),
            }
        })
        .await;
        match read {
            Ok(record) => {
                let endpoints = record.map(|r| r.endpoints).unwrap_or_default();
                let roamed: Vec<([u8; 32], SocketAddr)> = endpoints
                    .iter()
                    .filter_map(|(key, at)| {
                        let bytes: [u8; 32] = b64.decode(key).ok()?.try_into().ok()?;
                        Some((bytes, *at))
                    })
                    .collect();
                engine.follow_roamed(&roamed);
                if let Ok(mut r) = self.roamed.lock() {
                    *r = None;
                }
            }
            Err(err) => self.store_unavailable("reading the roamed endpoints", &err),
        }
    }

    pub(super) fn store_unavailable(&self, what: &str, err: &Error) {
        if let Some(held) = self.store_down.admit() {
            tracing::warn!(what, error = %err, held_back = held, "the store is unreachable; the data plane goes on as it is");
        }
    }
}
