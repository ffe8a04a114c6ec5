//! Endpoint IPs translated for a target cluster ([`Ipam::map_endpoint_ip`]: a local pod, a
//! pod of the target itself, or a third cluster's pod through our external CIDR), the
//! external-CIDR addresses the last path reserves and releases, and the way back to a pod's
//! home IP.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use trellis_api::ClusterId;
use trellis_api::net::{ip_to_u128, net_bounds, translate, u128_to_ip};
use trellis_error::{Error, Result};
use trellis_store::retry::Contention;
use trellis_store::{Op, Txn};

use super::{Ipam, Mapped, MappingPath, put, unchanged};
use crate::records::{
    ClusterRecord, EXTERNAL_PREFIX, EndpointRecord, cluster_key, decode, encode, endpoint_key,
    external_key,
};

/// Point reads of candidate external addresses before falling back to one listing.
const MAX_PROBES: u128 = 16;

fn translated(ip: IpAddr, from: IpNet, to: IpNet) -> Result<IpAddr> {
    translate(ip, from, to).ok_or_else(|| {
        Error::Internal(format!(
            "cannot translate {ip} from {from} to {to}: sizes differ"
        ))
    })
}

impl Ipam {
    /// Translates an endpoint IP for target `id` (see the proto for the three paths).
    #[tracing::instrument(skip(self), fields(cluster.id = %id))]
    pub async fn map_endpoint_ip(
        &self,
        id: &ClusterId,
        ip: IpAddr,
        induced: bool,
    ) -> Result<Mapped> {
        let local = &self.local.ranges;
        let (rec, rec_revision) = self.live_record(id).await?;
        if local.pod_cidr.contains(&ip) {
            let nat = rec.local_nat.ok_or_else(|| {
                Error::FailedPrecondition(format!(
                    "cluster {id} has not told us how it addresses our pod CIDR yet (SetLocalNat)"
                ))
            })?;
            let ip = translated(ip, local.pod_cidr, nat.pod_cidr)?;
            return Ok(Mapped {
                ip,
                path: MappingPath::LocalNat,
            });
        }
        if induced {
            return Err(Error::invalid(
                "ip",
                format!(
                    "{ip} is not in the local pod CIDR {}; an induced mapping is answered by the \
                     endpoint's home cluster",
                    local.pod_cidr
                ),
            ));
        }
        if let Some(view) = rec.remote.filter(|v| v.pod_cidr_nat.contains(&ip)) {
            let ip = translated(ip, view.pod_cidr_nat, view.pod_cidr)?;
            return Ok(Mapped {
                ip,
                path: MappingPath::Home,
            });
        }
        let external = self.map_external(id, ip, (rec, rec_revision)).await?;
        Ok(Mapped {
            ip: external,
            path: MappingPath::External,
        })
    }

    /// The external path: one address of our external CIDR per original IP, shared by all
    /// targets, returned in the target's view of our external CIDR. `target` is the target's
    /// record as the caller just read it, used for the first try.
    async fn map_external(
        &self,
        id: &ClusterId,
        ip: IpAddr,
        target: (ClusterRecord, i64),
    ) -> Result<IpAddr> {
        let local = &self.local.ranges;
        let mut contention = Contention::on(&self.store, "mapping an endpoint");
        // After losing a candidate address to another allocator, continue after it.
        let mut hint = None;
        let mut target = Some(target);
        loop {
            let (rec, rec_revision) = match target.take() {
                Some(read) => read,
                None => self.live_record(id).await?,
            };
            let nat = rec.local_nat.ok_or_else(|| {
                Error::FailedPrecondition(format!(
                    "cluster {id} has not told us how it addresses our external CIDR yet (SetLocalNat)"
                ))
            })?;
            let key = endpoint_key(ip);
            let (txn, external_ip, allocated_at) = match self.store.get(&key).await? {
                Some(kv) => {
                    let mut er: EndpointRecord = decode(&key, &kv.value)?;
                    if er.clusters.contains(id) {
                        return translated(er.external_ip, local.external_cidr, nat.external_cidr);
                    }
                    er.clusters.insert(id.clone());
                    let txn = Txn {
                        compares: vec![
                            unchanged(&key, kv.mod_revision),
                            unchanged(cluster_key(id), rec_revision),
                        ],
                        success: vec![put(&key, encode(&er)?)],
                        failure: vec![],
                    };
                    (txn, er.external_ip, None)
                }
                None => {
                    // The owner's record is guarded too: freeing it (which first marks it)
                    // must not race with a new mapping into its range.
                    // Both at once: every round trip before the commit is the caller's wait.
                    let (owner, free) =
                        tokio::join!(self.owner_of(ip), self.next_external(ip, hint));
                    let ((owner_id, owner_revision), (external_ip, offset)) = (owner?, free?);
                    let er = EndpointRecord {
                        ip,
                        external_ip,
                        clusters: BTreeSet::from([id.clone()]),
                    };
                    let txn = Txn {
                        compares: vec![
                            unchanged(&key, 0),
                            unchanged(external_key(external_ip), 0),
                            unchanged(cluster_key(id), rec_revision),
                            unchanged(cluster_key(&owner_id), owner_revision),
                        ],
                        success: vec![
                            put(&key, encode(&er)?),
                            put(external_key(external_ip), ip.to_string().into_bytes()),
                        ],
                        failure: vec![],
                    };
                    (txn, external_ip, Some(offset))
                }
            };
            if self.store.txn(txn).await?.succeeded {
                return translated(external_ip, local.external_cidr, nat.external_cidr);
            }
            match allocated_at {
                // Someone else committed meanwhile (most likely took this very address):
                // retry at once from the next address instead of waiting.
                Some(offset) => {
                    hint = Some(offset + 1);
                    contention.skip()?;
                }
                None => contention.lost().await?,
            }
        }
    }

    /// The live remote cluster whose pod CIDR (as we address it) holds `ip`, with its
    /// record's revision, or `NotFound`. The kept allocation table names it without a
    /// listing (at a hub with n peers, a listing decodes n records for every new endpoint);
    /// its record, read to be compared at the commit, confirms it, since the table may be
    /// behind another replica's allocations and frees. Without the table, or when the record
    /// disagrees, one listing answers and is kept as the table.
    async fn owner_of(&self, ip: IpAddr) -> Result<(ClusterId, i64)> {
        let owns = |r: &ClusterRecord| {
            !r.freeing && r.remote.is_some_and(|v| v.pod_cidr_nat.contains(&ip))
        };
        if let Some(candidate) = self.kept_pod_owner(ip)
            && let Some((rec, revision)) = self.record(&candidate).await?
            && owns(&rec)
        {
            return Ok((rec.id, revision));
        }
        let snapshot = self.snapshot().await?;
        self.keep_table(&snapshot);
        snapshot
            .records
            .into_iter()
            .find(|(r, _)| owns(r))
            .map(|(r, revision)| (r.id, revision))
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "{ip} is neither in the local pod CIDR {} nor in any remote cluster's pod CIDR",
                    self.local.ranges.pod_cidr
                ))
            })
    }

    /// A free address of our external CIDR for `ip`, and its offset in the usable range.
    /// Probing starts at a hash of `ip` (or at `hint`, after losing an address to another
    /// allocator), so concurrent allocations for different endpoints start far apart and
    /// nothing shared is written besides the reservation itself. After [`MAX_PROBES`] taken
    /// addresses the reservations are listed once to find a free one or prove there is none.
    async fn next_external(&self, ip: IpAddr, hint: Option<u128>) -> Result<(IpAddr, u128)> {
        let external = self.local.ranges.external_cidr;
        let (first, last) = usable_hosts(external);
        let size = last - first + 1;
        let start = hint.unwrap_or_else(|| spread(ip_to_u128(ip))) % size;
        let family = self.family();
        let candidate = |offset: u128| {
            u128_to_ip(family, first + offset)
                .map(|ip| (ip, offset))
                .ok_or_else(|| Error::Internal(format!("offset {offset} outside {external}")))
        };
        for step in 0..MAX_PROBES.min(size) {
            let (address, offset) = candidate((start + step) % size)?;
            if self.store.get(&external_key(address)).await?.is_none() {
                return Ok((address, offset));
            }
        }
        let taken: BTreeSet<u128> = self
            .store
            .list(EXTERNAL_PREFIX)
            .await?
            .kvs
            .iter()
            .filter_map(|kv| kv.key.strip_prefix(EXTERNAL_PREFIX)?.parse::<IpAddr>().ok())
            .map(ip_to_u128)
            .collect();
        let free = (0..size)
            .map(|step| (start + step) % size)
            .find(|offset| !taken.contains(&(first + offset)))
            .ok_or_else(|| {
                Error::ResourceExhausted(format!(
                    "the external CIDR {external} has no free address left ({size} in use)"
                ))
            })?;
        candidate(free)
    }

    /// Releases what [`Ipam::map_endpoint_ip`] allocated for `id`. Returns whether the
    /// external address went back to the pool.
    #[tracing::instrument(skip(self), fields(cluster.id = %id))]
    pub async fn unmap_endpoint_ip(&self, id: &ClusterId, ip: IpAddr) -> Result<bool> {
        let key = endpoint_key(ip);
        let mut contention = Contention::on(&self.store, "unmapping an endpoint");
        loop {
            let Some(kv) = self.store.get(&key).await? else {
                return Ok(false);
            };
            let mut er: EndpointRecord = decode(&key, &kv.value)?;
            if !er.clusters.remove(id) {
                return Ok(false);
            }
            let release = er.clusters.is_empty();
            let ops = if release {
                vec![
                    Op::Delete { key: key.clone() },
                    Op::Delete {
                        key: external_key(er.external_ip),
                    },
                ]
            } else {
                vec![put(&key, encode(&er)?)]
            };
            let committed = self
                .store
                .txn(Txn {
                    compares: vec![unchanged(&key, kv.mod_revision)],
                    success: ops,
                    failure: vec![],
                })
                .await?;
            if committed.succeeded {
                return Ok(release);
            }
            contention.lost().await?;
        }
    }

    /// The real pod IP behind `ip`, an address in our view of `id`'s pod CIDR.
    pub async fn home_pod_ip(&self, id: &ClusterId, ip: IpAddr) -> Result<IpAddr> {
        let (rec, _) = self.live_record(id).await?;
        let view = rec.remote.ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "the pod CIDR of cluster {id} is not known yet (GetSubnetsPerCluster)"
            ))
        })?;
        if !view.pod_cidr_nat.contains(&ip) {
            return Err(Error::invalid(
                "ip",
                format!(
                    "{ip} is not in cluster {id}'s pod CIDR as we address it ({})",
                    view.pod_cidr_nat
                ),
            ));
        }
        translated(ip, view.pod_cidr_nat, view.pod_cidr)
    }
}

/// Scatters an address over the integers (splitmix64 of its folded bits), so that the
/// probe sequences of different endpoints start far apart.
fn spread(value: u128) -> u128 {
    let mut z = (value as u64) ^ ((value >> 64) as u64);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    u128::from(z ^ (z >> 31))
}

/// The addresses of `net` that may be handed out: for IPv4 networks larger than /31, all but
/// the network and broadcast addresses; for IPv6, all but the subnet-router anycast address.
pub(crate) fn usable_hosts(net: IpNet) -> (u128, u128) {
    let (lo, hi) = net_bounds(net);
    match net {
        IpNet::V4(v4) if v4.prefix_len() <= 30 => (lo + 1, hi - 1),
        IpNet::V6(v6) if v6.prefix_len() <= 127 => (lo + 1, hi),
        _ => (lo, hi),
    }
}
