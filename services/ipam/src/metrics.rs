//! The IPAM's Prometheus metrics (issue 19), read from the store at every scrape:
//! - `trellis_ipam_pool_addresses{pool,state}`: per remap pool (`--pool`), the addresses the
//!   remote clusters' ranges as we address them (pod and external, NAT'ed or not) occupy
//!   (`used`) and the rest (`free`); `trellis_ipam_pool_ranges{pool}` counts those ranges;
//! - `trellis_ipam_external_addresses{state}`: the addresses of our external CIDR handed out to
//!   remote endpoints (`used`, what `ListEndpointMappings` returns) and still free.
//!
//! Gauges are floats: an IPv6 pool holds more addresses than an integer gauge can count.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use ipnet::IpNet;
use trellis_api::net::net_bounds;
use trellis_runtime::metrics::prometheus_client::metrics::{family::Family, gauge::Gauge};
use trellis_runtime::metrics::{Labels, Metrics};

use crate::core::Ipam;
use crate::core::endpoints::usable_hosts;

type FloatGauge = Gauge<f64, AtomicU64>;

/// Addresses `a` and `b` share.
fn shared(a: IpNet, b: IpNet) -> f64 {
    let ((a0, a1), (b0, b1)) = (net_bounds(a), net_bounds(b));
    let (lo, hi) = (a0.max(b0), a1.min(b1));
    if lo > hi { 0.0 } else { (hi - lo) as f64 + 1.0 }
}

fn size(net: IpNet) -> f64 {
    let (lo, hi) = net_bounds(net);
    (hi - lo) as f64 + 1.0
}

/// Registers the IPAM gauges of `core` on `metrics`.
pub fn register(metrics: &Metrics, core: &Arc<Ipam>) {
    let pool_addresses: Family<Labels, FloatGauge> = Family::default();
    let pool_ranges: Family<Labels, Gauge> = Family::default();
    let external: Family<Labels, FloatGauge> = Family::default();
    metrics.register(
        "trellis_ipam_pool_addresses",
        "Addresses of each remap pool occupied by remote clusters' ranges (used) and not (free)",
        pool_addresses.clone(),
    );
    metrics.register(
        "trellis_ipam_pool_ranges",
        "Remote clusters' ranges (as we address them) inside each remap pool",
        pool_ranges.clone(),
    );
    metrics.register(
        "trellis_ipam_external_addresses",
        "Addresses of the external CIDR handed out to remote endpoints (used) and still free",
        external.clone(),
    );
    let core = core.clone();
    metrics.on_scrape(move || {
        let (core, pool_addresses, pool_ranges, external) = (
            core.clone(),
            pool_addresses.clone(),
            pool_ranges.clone(),
            external.clone(),
        );
        async move {
            // A store that does not answer leaves the last values (the scrape still succeeds).
            let (Ok(clusters), Ok(mappings)) = (
                core.list_clusters().await,
                core.list_endpoint_mappings().await,
            ) else {
                return;
            };
            let ranges: Vec<IpNet> = clusters
                .iter()
                .filter_map(|c| c.remote.as_ref())
                .flat_map(|v| [v.pod_cidr_nat, v.external_cidr_nat])
                .collect();
            for pool in &core.local().pools {
                let inside: Vec<IpNet> = ranges
                    .iter()
                    .copied()
                    .filter(|r| shared(*r, *pool) > 0.0)
                    .collect();
                // A fold from +0: `sum()` of no floats is -0, which would be exposed as such.
                let used = inside.iter().fold(0.0, |n, r| n + shared(*r, *pool));
                let label = pool.to_string();
                pool_addresses
                    .get_or_create(&vec![("pool", label.clone()), ("state", "used".into())])
                    .set(used);
                pool_addresses
                    .get_or_create(&vec![("pool", label.clone()), ("state", "free".into())])
                    .set((size(*pool) - used).max(0.0));
                pool_ranges
                    .get_or_create(&vec![("pool", label)])
                    .set(i64::try_from(inside.len()).unwrap_or(i64::MAX));
            }
            let (first, last) = usable_hosts(core.local().ranges.external_cidr);
            let usable = (last - first) as f64 + 1.0;
            let used = mappings.len() as f64;
            external
                .get_or_create(&vec![("state", "used".into())])
                .set(used);
            external
                .get_or_create(&vec![("state", "free".into())])
                .set((usable - used).max(0.0));
        }
    });
}
