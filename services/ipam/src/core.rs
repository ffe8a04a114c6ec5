//! The IPAM's domain logic over the store. Every operation is a read, a decision, and a
//! transaction that commits only if what was read is unchanged; on conflict it re-reads and
//! decides again. That makes several replicas on one etcd safe without a process-local lock,
//! and a process killed between two steps leaves either the old or the new state.
//!
//! This file keeps the IPAM's type, its construction and its reads; the operations are cut by
//! what they change, each an `impl Ipam` of its own:
//!
//! - `ranges`: a remote cluster's ranges both ways, how we address it (allocated from the
//!   pools, GetSubnetsPerCluster) and how it addresses us (SetLocalNat);
//! - `free`: forgetting a cluster (FreeSubnetsPerCluster), finished at start when a crash cut
//!   it short;
//! - `endpoints`: translating endpoint IPs, and the external-CIDR addresses they take.

pub(crate) mod endpoints;
mod free;
mod ranges;

use std::net::IpAddr;

use ipnet::IpNet;
use trellis_api::net::{Family, ip_to_u128};
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_store::{Compare, KeyValue, Op, SharedStore, Txn};

use self::ranges::Allocated;
use crate::records::{
    CLUSTERS_PREFIX, ClusterRecord, ENDPOINTS_PREFIX, EPOCH_KEY, EndpointRecord, LOCAL_KEY,
    QUARANTINE_PREFIX, QuarantineRecord, SUBNETS_PREFIX, cluster_key, decode, encode,
};
use crate::subnets::{LocalRanges, LocalSubnets};

/// How an endpoint IP was translated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MappingPath {
    /// A local pod, through the target's view of our pod CIDR.
    LocalNat,
    /// A pod of the target itself: its home IP.
    Home,
    /// A third cluster's pod, through our external CIDR.
    External,
}

/// The answer of [`Ipam::map_endpoint_ip`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapped {
    pub ip: IpAddr,
    pub path: MappingPath,
}

/// The IPAM of one cluster. Cheap to share behind an `Arc`; holds no state of its own beyond
/// the validated configuration.
#[derive(Debug)]
pub struct Ipam {
    store: SharedStore,
    local: LocalSubnets,
    /// Serializes this replica's range allocations, and holds the ranges they must avoid. The
    /// epoch transaction alone keeps allocations correct, across replicas too, but concurrent
    /// allocators in one process would mostly lose the epoch race to each other and retry
    /// with backoff.
    allocating: tokio::sync::Mutex<Option<Allocated>>,
    /// GetSubnetsPerCluster requests waiting for the next allocation pass (see `ranges`).
    waiting: std::sync::Mutex<Vec<ranges::Wanted>>,
}

/// A consistent view of the allocation table.
struct Snapshot {
    epoch_revision: i64,
    records: Vec<(ClusterRecord, i64)>,
    /// `(cluster ID, its quarantined ranges)` of freed clusters.
    quarantined: Vec<(String, QuarantineRecord)>,
}

fn put(key: impl Into<String>, value: Vec<u8>) -> Op {
    Op::Put {
        key: key.into(),
        value,
        lease: None,
    }
}

fn unchanged(key: impl Into<String>, revision: i64) -> Compare {
    Compare::ModRevision {
        key: key.into(),
        revision,
    }
}

impl Ipam {
    /// Opens the IPAM on `store`. The first replica records the local ranges; later ones must
    /// agree with them, because every mapping depends on them. Frees interrupted by a crash
    /// are finished here.
    pub async fn open(store: SharedStore, local: LocalSubnets) -> Result<Self> {
        let wanted = encode(&local.ranges)?;
        loop {
            if let Some(kv) = store.get(LOCAL_KEY).await? {
                let stored: LocalRanges = decode(LOCAL_KEY, &kv.value)?;
                if stored != local.ranges {
                    return Err(Error::FailedPrecondition(format!(
                        "the store holds pod CIDR {}, service CIDR {}, external CIDR {} for this \
                         cluster, but this process was started with {}, {}, {}; every mapping \
                         depends on them, so they cannot change under an existing store",
                        stored.pod_cidr,
                        fmt_opt(stored.service_cidr),
                        stored.external_cidr,
                        local.ranges.pod_cidr,
                        fmt_opt(local.ranges.service_cidr),
                        local.ranges.external_cidr,
                    )));
                }
                break;
            }
            let created = store
                .txn(Txn {
                    compares: vec![unchanged(LOCAL_KEY, 0)],
                    success: vec![put(LOCAL_KEY, wanted.clone())],
                    failure: vec![],
                })
                .await?;
            if created.succeeded {
                break;
            }
        }
        let ipam = Self {
            store,
            local,
            allocating: tokio::sync::Mutex::new(None),
            waiting: std::sync::Mutex::new(Vec::new()),
        };
        ipam.finish_interrupted_frees().await?;
        Ok(ipam)
    }

    /// The local configuration.
    /// The store the IPAM keeps its state in.
    pub fn store(&self) -> &SharedStore {
        &self.store
    }

    pub fn local(&self) -> &LocalSubnets {
        &self.local
    }

    /// The address family every request must use.
    pub fn family(&self) -> Family {
        self.local.family()
    }

    async fn snapshot(&self) -> Result<Snapshot> {
        let listing = self.store.list(SUBNETS_PREFIX).await?;
        let mut snapshot = Snapshot {
            epoch_revision: 0,
            records: Vec::new(),
            quarantined: Vec::new(),
        };
        for kv in listing.kvs {
            if kv.key == EPOCH_KEY {
                snapshot.epoch_revision = kv.mod_revision;
            } else if let Some(cluster) = kv.key.strip_prefix(QUARANTINE_PREFIX) {
                snapshot
                    .quarantined
                    .push((cluster.to_owned(), decode(&kv.key, &kv.value)?));
            } else if kv.key.starts_with(CLUSTERS_PREFIX) {
                snapshot
                    .records
                    .push((decode(&kv.key, &kv.value)?, kv.mod_revision));
            }
        }
        Ok(snapshot)
    }

    async fn record(&self, id: &ClusterId) -> Result<Option<(ClusterRecord, i64)>> {
        let key = cluster_key(id);
        match self.store.get(&key).await? {
            Some(kv) => Ok(Some((decode(&key, &kv.value)?, kv.mod_revision))),
            None => Ok(None),
        }
    }

    /// A record that new mappings may reference.
    async fn live_record(&self, id: &ClusterId) -> Result<(ClusterRecord, i64)> {
        match self.record(id).await? {
            Some((rec, _)) if rec.freeing => {
                Err(Error::NotFound(format!("cluster {id} is being freed")))
            }
            Some(found) => Ok(found),
            None => Err(Error::NotFound(format!("no mapping for cluster {id}"))),
        }
    }

    /// The remote cluster whose pod CIDR (as we address it) holds `ip`.
    pub async fn cluster_identity(&self, ip: IpAddr) -> Result<Option<ClusterIdentity>> {
        let snapshot = self.snapshot().await?;
        Ok(snapshot
            .records
            .into_iter()
            .map(|(r, _)| r)
            .find(|r| !r.freeing && r.remote.is_some_and(|v| v.pod_cidr_nat.contains(&ip)))
            .map(|r| ClusterIdentity {
                id: r.id,
                name: r.name,
            }))
    }

    /// Whether an induced mapping for `id` can be answered: we know how `id` addresses us.
    pub async fn mapping_exists(&self, id: &ClusterId) -> Result<bool> {
        Ok(
            matches!(self.record(id).await?, Some((rec, _)) if !rec.freeing && rec.local_nat.is_some()),
        )
    }

    /// Every remote cluster's record, by ID.
    pub async fn list_clusters(&self) -> Result<Vec<ClusterRecord>> {
        let mut records: Vec<ClusterRecord> = self
            .snapshot()
            .await?
            .records
            .into_iter()
            .map(|(r, _)| r)
            .collect();
        records.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(records)
    }

    /// Every external-CIDR endpoint mapping, by original IP.
    pub async fn list_endpoint_mappings(&self) -> Result<Vec<EndpointRecord>> {
        let kvs: Vec<KeyValue> = self.store.list(ENDPOINTS_PREFIX).await?.kvs;
        let mut out = kvs
            .iter()
            .map(|kv| decode::<EndpointRecord>(&kv.key, &kv.value))
            .collect::<Result<Vec<_>>>()?;
        out.sort_by_key(|e| ip_to_u128(e.ip));
        Ok(out)
    }
}

fn fmt_opt(net: Option<IpNet>) -> String {
    net.map_or_else(|| "(none)".to_owned(), |n| n.to_string())
}
