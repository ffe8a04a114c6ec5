//! The Linux reconciler: makes the current network namespace match a set of [`PeerPlan`]s.
//!
//! Per peer: a WireGuard interface (a TUN of the userspace engine, or a kernel device; MTU: the
//! underlay's minus 80, up, rp_filter off), main-table routes for the peer's NAT'ed CIDRs, a
//! table holding `default dev <interface>`, and an `ip rule fwmark <mark> lookup <table>`; for
//! all peers together, the `ip trellis` nftables table. Everything is derived from the plans,
//! so applying the same plans twice changes nothing, and a start first removes whatever a
//! previous run left (rules at our priority, our table, our kernel interfaces: they
//! all outlive a SIGKILLed process, spike pitfall 7).
//!
//! A pass is either a [`Pass::Changes`] pass, which configures only the peers whose plan (or
//! resolved endpoint) differs from what was last applied and rewrites the nftables tables and
//! policy rules only when their content changed, or a [`Pass::Repair`] pass, which re-applies
//! everything and so repairs what someone changed underneath. With hundreds of peers a
//! TunnelEndpoint change used to re-run about five `ip` processes for every peer (issue 17).
//!
//! Routes are not cleaned separately: the kernel deletes a route with the interface it points
//! to.
//!
//! A peer's range that overlaps a network of the node itself (the gateway runs on the host
//! network: its node network, a bridge, the overlay) is never routed: `ip route replace` of
//! that prefix would replace the node's connected route, and a longer one would shadow part of
//! it, so the node would lose its own network. Such a range is refused (logged once, counted by
//! `trellis_gateway_refused_routes`); the IPAM's `--reserved` is what remaps the peer instead.
//!
//! This module holds the reconciler's state, its start and the pass itself ([`Linux::apply`]);
//! the rest is cut by what it configures:
//!
//! - `peers`: one peer's tunnel (its device created, configured and removed, its endpoint
//!   resolved, its routes and table);
//! - `routes`: which of a peer's ranges may be routed ([`refuse`]), and the switch between
//!   active and standby, which routes them or not;
//! - `rules`: our policy-routing rules, and what a previous run left (rules, tables,
//!   interfaces) removed at start;
//! - `conntrack`: the connections flushed when a hub-path mapping or a peer goes.

mod conntrack;
mod peers;
mod routes;
mod rules;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use trellis_api::ClusterId;
use trellis_api::model::{PeeringKind, WgKey};
use trellis_runtime::metrics::Labels;
use trellis_runtime::metrics::prometheus_client::metrics::family::Family;
use trellis_runtime::metrics::prometheus_client::metrics::gauge::Gauge;

use self::peers::remove_device;
pub use self::routes::refuse;
use self::rules::sync_rules;
pub use self::rules::{Action, PolicyRule, policy_rules};
use super::PeerPlan;
use super::cmd;
use super::engine::Engine;
use super::wireguard::{Device, Flavor, PeerStats};
use super::{guard, nft};
use crate::keys::KeyPair;
use crate::mappings::HubMapping;

/// How long a stats read may take before the tunnel is reported DOWN.
const STATS_TIMEOUT: Duration = Duration::from_secs(3);

/// What a pass applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// What changed since the last pass (a TunnelEndpoint or hub mapping changed).
    Changes,
    /// Everything, checking the namespace against the plans (periodic, after failures).
    Repair,
}

/// What earlier passes applied, so that a [`Pass::Changes`] pass applies only what changed.
#[derive(Debug, Default)]
struct Applied {
    /// Per peer, the plan and resolved endpoint its device and routes were configured with.
    peers: BTreeMap<ClusterId, (PeerPlan, SocketAddr, Option<WgKey>)>,
    /// The nftables scripts last applied in full.
    nat: Option<String>,
    guard: Option<String>,
    /// `(mark, table)` of the policy rules last synced.
    rules: Option<BTreeSet<(u32, u32)>>,
}

/// The data plane of this namespace.
#[derive(Debug)]
pub struct Linux {
    flavor: Flavor,
    key: KeyPair,
    keepalive: u16,
    prefix: String,
    /// MTU of every tunnel device.
    mtu: u32,
    devices: BTreeMap<ClusterId, Arc<Device>>,
    applied: Applied,
    /// How often each peer's device and routes were configured since start (a metric).
    configurations: BTreeMap<ClusterId, u64>,
    /// Per peer, its routed ranges refused for overlapping a network of the node.
    refused: BTreeMap<ClusterId, BTreeSet<IpNet>>,
    /// How many each peer has refused (`trellis_gateway_refused_routes{peer}`).
    refused_metric: Family<Labels, Gauge>,
    /// The hub-path destinations (DNAT targets) of the NAT table last applied: a mapping
    /// that goes has its connections flushed (see [`Linux::flush_dnat`]).
    hub_targets: BTreeSet<IpAddr>,
    /// Whether this replica is the cluster's active gateway: only the active routes the peers'
    /// ranges into its tunnels (a standby's node reaches them through the overlay, like any
    /// other node) and lets its engine send.
    active: bool,
}

/// The peer's label of the refusal gauge.
fn peer_labels(id: &ClusterId) -> Labels {
    vec![("peer", id.to_string())]
}

impl Linux {
    /// Prepares the namespace (forwarding on, reverse-path filtering off) and removes what a
    /// previous run left. Every tunnel device gets MTU `mtu`.
    pub async fn start(
        flavor: Flavor,
        key: KeyPair,
        keepalive: u16,
        prefix: String,
        mtu: u32,
    ) -> anyhow::Result<Self> {
        cmd::sysctl("ip_forward", "1").await?;
        // Replies leave through a tunnel chosen by fwmark, and packets arrive from a tunnel
        // with sources that the main table routes elsewhere: strict or loose rp_filter would
        // drop both. The effective value is the max of `all` and the interface's.
        cmd::sysctl("conf/all/rp_filter", "0").await?;
        cmd::sysctl("conf/default/rp_filter", "0").await?;
        let this = Self {
            flavor,
            key,
            keepalive,
            prefix,
            mtu,
            devices: BTreeMap::new(),
            applied: Applied::default(),
            configurations: BTreeMap::new(),
            refused: BTreeMap::new(),
            refused_metric: Family::default(),
            hub_targets: BTreeSet::new(),
            active: false,
        };
        if let Some(engine) = this.engine() {
            engine.set_standby(true);
        }
        this.remove_stale().await?;
        Ok(this)
    }

    /// The gauge family counting each peer's refused routes (register it in the service's
    /// registry; clones share).
    pub fn refused_metric(&self) -> Family<Labels, Gauge> {
        self.refused_metric.clone()
    }

    /// Makes the namespace match `plans` (see [`Pass`] for how much is checked). Returns, per
    /// peer, `Ok` or why its tunnel is not configured (one broken peer does not stop the others).
    pub async fn apply(
        &mut self,
        plans: &[PeerPlan],
        hub: &[HubMapping],
        pass: Pass,
    ) -> BTreeMap<ClusterId, Result<(), String>> {
        if pass == Pass::Repair {
            self.applied = Applied::default();
        }
        // An induced peer is relayed, when it must be, through the hub that introduced it: a
        // full peer of ours, whose key finds its session in the engine.
        let hubs: BTreeMap<ClusterId, WgKey> = plans
            .iter()
            .filter(|p| p.endpoint.kind == PeeringKind::Full)
            .map(|p| (p.endpoint.remote.id.clone(), p.endpoint.remote_public_key))
            .collect();
        let mut results = BTreeMap::new();
        for plan in plans {
            let id = plan.endpoint.remote.id.clone();
            let relay_via = plan
                .endpoint
                .via
                .as_ref()
                .and_then(|hub| hubs.get(&hub.id))
                .copied();
            let result = self
                .apply_peer(plan, relay_via)
                .await
                .map_err(|e| format!("{e:#}"));
            if let Err(err) = &result {
                tracing::warn!(peer = %id, interface = %plan.interface, error = %err, "tunnel not configured");
            }
            results.insert(id, result);
        }
        // Rules and NAT for every planned peer (a peer whose device failed just matches no
        // packets until it is fixed), then the devices of peers no longer planned.
        let mut refused = Vec::new();
        let applied = &mut self.applied;
        let shared = async {
            let nats: Vec<nft::PeerNat> = plans.iter().map(|p| p.nat(hub)).collect();
            let snat = if plans.is_empty() {
                Vec::new()
            } else {
                super::hub_snat(hub)
            };
            let script = nft::script(&nats, &snat);
            if applied.nat.as_ref() == Some(&script) {
                // Unchanged since it was applied in full.
            } else if let Err(err) = cmd::run("nft", &["-f", "-"], Some(&script)).await {
                applied.nat = None;
                // One peer's rules must not keep every other peer's out: apply those nft takes.
                tracing::warn!(
                    error = format!("{err:#}"),
                    "nftables refused the rules of every peer together; checking each peer alone"
                );
                let (accepted, bad) = nft::isolate(&nats, &snat, |script| async move {
                    cmd::run("nft", &["-c", "-f", "-"], Some(&script))
                        .await
                        .map(drop)
                })
                .await;
                cmd::run("nft", &["-f", "-"], Some(&nft::script(&accepted, &snat))).await?;
                refused = bad;
            } else {
                applied.nat = Some(script);
            }
            let guard = guard_script(plans, hub);
            if applied.guard.as_ref() != Some(&guard) {
                applied.guard = None;
                cmd::run("nft", &["-f", "-"], Some(&guard)).await?;
                applied.guard = Some(guard);
            }
            // A stateless peer's replies find its tunnel by their destination: no mark, no rule.
            let rules: BTreeSet<(u32, u32)> = plans
                .iter()
                .filter(|p| !p.stateless)
                .map(|p| (p.mark(), p.table()))
                .collect();
            if applied.rules.as_ref() != Some(&rules) {
                applied.rules = None;
                sync_rules(&rules).await?;
                applied.rules = Some(rules);
            }
            anyhow::Ok(())
        };
        let shared = shared.await;
        if shared.is_ok() {
            self.flush_removed_mappings(plans, hub).await;
        }
        for (interface, reason) in refused {
            if let Some(plan) = plans.iter().find(|p| p.interface == interface) {
                tracing::warn!(peer = %plan.endpoint.remote.id, interface = %interface, error = %reason, "nftables refused this peer's NAT rules; the other peers keep theirs");
                results.insert(
                    plan.endpoint.remote.id.clone(),
                    Err(format!("nftables refused this peer's NAT rules: {reason}")),
                );
            }
        }
        if let Err(err) = shared {
            let err = format!("{err:#}");
            tracing::warn!(error = %err, "nftables or policy rules not applied");
            for result in results.values_mut() {
                if result.is_ok() {
                    *result = Err(err.clone());
                }
            }
        }
        let planned: BTreeSet<&ClusterId> = plans.iter().map(|p| &p.endpoint.remote.id).collect();
        let gone: Vec<ClusterId> = self
            .devices
            .keys()
            .filter(|id| !planned.contains(id))
            .cloned()
            .collect();
        for id in gone {
            self.applied.peers.remove(&id);
            self.configurations.remove(&id);
            self.refused.remove(&id);
            self.refused_metric.remove(&peer_labels(&id));
            if let Some(device) = self.devices.remove(&id) {
                tracing::info!(peer = %id, interface = device.name(), "removing tunnel");
                remove_device(device).await;
            }
        }
        results
    }

    /// How many times the tunnel to `id` was configured (device, routes) since start.
    pub fn configurations(&self, id: &ClusterId) -> u64 {
        self.configurations.get(id).copied().unwrap_or(0)
    }

    /// The counters of the peer's device; `None` when it has no device.
    pub async fn stats(&self, id: &ClusterId) -> Option<anyhow::Result<PeerStats>> {
        let device = self.devices.get(id)?.clone();
        let read = tokio::time::timeout(
            STATS_TIMEOUT,
            tokio::task::spawn_blocking(move || device.stats()),
        )
        .await;
        Some(match read {
            Ok(Ok(Ok(stats))) => Ok(stats),
            Ok(Ok(Err(err))) => Err(anyhow::anyhow!("reading the device: {err}")),
            Ok(Err(err)) => Err(anyhow::anyhow!("stats task: {err}")),
            Err(_) => Err(anyhow::anyhow!(
                "the device did not answer within {STATS_TIMEOUT:?}"
            )),
        })
    }

    /// The userspace engine, if that is the flavor.
    pub fn engine(&self) -> Option<Arc<Engine>> {
        match &self.flavor {
            Flavor::Userspace(engine) => Some(engine.clone()),
            Flavor::Kernel => None,
        }
    }

    /// Removes every tunnel, rule and the nftables table (graceful stop).
    pub async fn clear(&mut self) {
        let _ = self.apply(&[], &[], Pass::Repair).await;
    }
}

/// The tunnel guard table ([`guard`]) for `plans`, as an nftables script.
fn guard_script(plans: &[PeerPlan], hub: &[HubMapping]) -> String {
    let guards: Vec<guard::TunnelGuard> = plans.iter().map(|p| p.guard(hub)).collect();
    guard::script(&guards)
}
