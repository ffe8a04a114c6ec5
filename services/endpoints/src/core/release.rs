//! Releasing hub-path allocations: an address reflected to a target through our external
//! CIDR holds an allocation in the local IPAM, one per (address, target) and not per slice, so
//! it goes back to the pool only once no reflection to that target uses it any more.

use std::collections::BTreeSet;

use trellis_api::ClusterId;
use trellis_error::Result;

use super::Endpoints;
use crate::records::{OutgoingRecord, decode, outgoing_target_prefix};

impl Endpoints {
    /// Releases the external-CIDR allocations of `originals` for `target`, except those another
    /// reflection to the same target (other than `own_key`) still uses: the IPAM holds one
    /// allocation per (address, target), not per slice. Returns how many addresses went back
    /// to the pool.
    ///
    /// Known race: a concurrent reflection of another slice that starts using one of these
    /// addresses between our listing and the unmap loses its allocation; its next
    /// re-reflection maps it again.
    pub(super) async fn release(
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
            let returned = self.clients.unmap_endpoint_ip(target, &ip).await?;
            tracing::info!(endpoint.ip = %ip, target.id = %target, returned_to_pool = returned, "released hub-path endpoint mapping");
            // The IPAM keeps the address while another target still uses it.
            if returned {
                released += 1;
            }
        }
        Ok(released)
    }
}
