//! The Linux reconciler: makes the current network namespace match a set of [`PeerPlan`]s.
//!
//! Per peer: a WireGuard interface (a TUN of the userspace engine, or a kernel device; MTU: the underlay's minus 80, up, rp_filter off), main-table routes for the peer's
//! NAT'ed CIDRs, a table holding `default dev <interface>`, and an `ip rule fwmark <mark> lookup
//! <table>`; for all peers together, the `ip trellis` nftables table. Everything is derived
//! from the plans, so applying the same plans twice changes nothing, and a start first removes
//! whatever a previous run left (rules at our priority, our table, our kernel interfaces: they
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

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use ipnet::IpNet;
use trellis_api::ClusterId;
use trellis_api::model::Endpoint;
use trellis_runtime::metrics::Labels;
use trellis_runtime::metrics::prometheus_client::metrics::family::Family;
use trellis_runtime::metrics::prometheus_client::metrics::gauge::Gauge;

use super::PeerPlan;
use super::cmd::{self, ip};
use super::engine::Engine;
use super::wireguard::{Device, DeviceSpec, Flavor, PeerStats};
use super::{guard, nft};
use crate::keys::KeyPair;
use crate::mappings::HubMapping;
use crate::names::{MARK_MASK, RULE_PRIORITY};

/// How long a stats read may take before the tunnel is reported DOWN.
const STATS_TIMEOUT: Duration = Duration::from_secs(3);

/// How long to wait for a removed interface to disappear before creating one of the same name.
const LINK_GONE_TIMEOUT: Duration = Duration::from_secs(3);

/// How long resolving a peer's endpoint name may take before this pass gives up on that peer
/// (the reconciler's next pass retries).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

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
    peers: BTreeMap<ClusterId, (PeerPlan, SocketAddr)>,
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

/// `routed` split into the ranges that may be routed and those overlapping one of the node's
/// own networks (`own`: `(interface, network)`), each refused one with the network it overlaps.
pub fn refuse(
    routed: &[IpNet],
    own: &[(String, IpNet)],
) -> (Vec<IpNet>, Vec<(IpNet, String, IpNet)>) {
    let mut kept = Vec::new();
    let mut refused = Vec::new();
    for net in routed {
        match own
            .iter()
            .find(|(_, mine)| trellis_api::net::overlaps(*net, *mine))
        {
            Some((interface, mine)) => refused.push((*net, interface.clone(), *mine)),
            None => kept.push(*net),
        }
    }
    (kept, refused)
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

    /// The networks of the node's addresses, but our tunnel devices'.
    async fn own_networks(&self) -> anyhow::Result<Vec<(String, IpNet)>> {
        let text = ip(&["-j", "addr", "show"]).await?;
        Ok(trellis_api::net::address_networks(&text)
            .map_err(anyhow::Error::msg)?
            .into_iter()
            .filter(|(interface, _)| !is_ours(&self.prefix, interface))
            .collect())
    }

    /// Records the ranges of peer `id` refused in this configuration, warning once per change.
    fn record_refused(
        &mut self,
        id: &ClusterId,
        interface: &str,
        refused: &[(IpNet, String, IpNet)],
    ) {
        let now: BTreeSet<IpNet> = refused.iter().map(|(net, _, _)| *net).collect();
        let before = self.refused.get(id).cloned().unwrap_or_default();
        for (net, own_interface, network) in refused {
            if !before.contains(net) {
                tracing::warn!(
                    peer = %id,
                    interface,
                    prefix = %net,
                    node_interface = %own_interface,
                    node_network = %network,
                    "refusing to route a peer's range that overlaps a network of this node; \
                     reserve the node network in the IPAM (--reserved) so the peer is remapped"
                );
            }
        }
        self.refused_metric
            .get_or_create(&peer_labels(id))
            .set(i64::try_from(now.len()).unwrap_or(i64::MAX));
        if now.is_empty() {
            self.refused.remove(id);
        } else {
            self.refused.insert(id.clone(), now);
        }
    }

    async fn remove_stale(&self) -> anyhow::Result<()> {
        let rules = current_rules().await?;
        for (mark, table) in &rules {
            delete_rule(*mark, *table).await?;
        }
        cmd::run("nft", &["-f", "-"], Some(&nft::script(&[], &[]))).await?;
        cmd::run("nft", &["-f", "-"], Some(&guard_script(&[], &[]))).await?;
        let links = ip(&["-o", "link", "show"]).await?;
        let mut removed = 0;
        for name in links.lines().filter_map(link_name) {
            if is_ours(&self.prefix, name) {
                ip(&["link", "delete", "dev", name]).await?;
                removed += 1;
            }
        }
        tracing::info!(
            rules = rules.len(),
            interfaces = removed,
            "removed data plane state left by a previous run"
        );
        Ok(())
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
        let mut results = BTreeMap::new();
        for plan in plans {
            let id = plan.endpoint.remote.id.clone();
            let result = self.apply_peer(plan).await.map_err(|e| format!("{e:#}"));
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
            let rules: BTreeSet<(u32, u32)> = plans.iter().map(|p| (p.mark(), p.table())).collect();
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

    /// Once the NAT table without them is applied, flushes the connections DNAT'ed to the
    /// destinations of hub-path mappings that went; one whose flush failed is tried again on
    /// the next pass.
    async fn flush_removed_mappings(&mut self, plans: &[PeerPlan], hub: &[HubMapping]) {
        let current: BTreeSet<IpAddr> = if plans.is_empty() {
            BTreeSet::new()
        } else {
            super::hub_snat(hub).into_iter().map(|(d, _)| d).collect()
        };
        let gone: Vec<IpAddr> = self.hub_targets.difference(&current).copied().collect();
        let mut kept = current;
        for target in gone {
            if let Err(err) = self.flush_dnat(target).await {
                tracing::warn!(%target, error = format!("{err:#}"), "could not flush the connections of a removed hub-path mapping; retrying on the next pass");
                kept.insert(target);
            }
        }
        self.hub_targets = kept;
    }

    /// Deletes every connection conntrack tracks as DNAT'ed to `target` (a hub-path mapping's
    /// destination that went). Such a connection keeps its translation after its mapping and
    /// its destination's peer are gone, so an established one (which the tunnel guard lets
    /// through) followed it into the tunnel of whichever peer holds that range next. Without
    /// the `conntrack` tool this only warns.
    pub async fn flush_dnat(&self, target: IpAddr) -> anyhow::Result<()> {
        let target = target.to_string();
        match cmd::run("conntrack", &["-D", "--dst-nat", &target], None).await {
            Ok(_) => {
                tracing::info!(%target, "flushed the connections of a removed hub-path mapping");
                Ok(())
            }
            // conntrack exits 1 when nothing matched.
            Err(err) if format!("{err:#}").contains("0 flow entries") => Ok(()),
            Err(err) if format!("{err:#}").starts_with("cannot run conntrack") => {
                tracing::warn!(%target, error = format!("{err:#}"), "conntrack is not installed: the connections of a removed hub-path mapping are not flushed");
                Ok(())
            }
            Err(err) => Err(err),
        }
    }

    /// Deletes every connection conntrack tracks under `mark` (a freed peer's), so none of
    /// its replies follows the tunnel of the next peer with that mark. Without the `conntrack`
    /// tool this only warns: the port's quarantine is then all that protects the next holder.
    pub async fn flush_connections(&self, mark: u32) -> anyhow::Result<()> {
        let selector = format!("{mark:#x}/{MARK_MASK:#x}");
        match cmd::run("conntrack", &["-D", "--mark", &selector], None).await {
            Ok(_) => Ok(()),
            // conntrack exits 1 when nothing matched.
            Err(err) if format!("{err:#}").contains("0 flow entries") => Ok(()),
            Err(err) if format!("{err:#}").starts_with("cannot run conntrack") => {
                tracing::warn!(mark = %selector, error = format!("{err:#}"), "conntrack is not installed: the connections of a removed peer are not flushed, only its port's quarantine keeps them from the next peer");
                Ok(())
            }
            Err(err) => Err(err),
        }
    }

    async fn apply_peer(&mut self, plan: &PeerPlan) -> anyhow::Result<()> {
        let id = &plan.endpoint.remote.id;
        let mut created = false;
        let device = match self.devices.get(id) {
            Some(d) if d.name() == plan.interface => d.clone(),
            _ => {
                created = true;
                if let Some(old) = self.devices.remove(id) {
                    remove_device(old).await;
                }
                let (flavor, name) = (self.flavor.clone(), plan.interface.clone());
                let device = tokio::task::spawn_blocking(move || Device::create(&flavor, &name))
                    .await
                    .context("device creation task")??;
                let device = Arc::new(device);
                tracing::info!(peer = %id, interface = %plan.interface, slot = plan.slot, listen_port = plan.listen_port, "created wireguard interface");
                self.devices.insert(id.clone(), device.clone());
                device
            }
        };
        let peer_endpoint = resolve(&plan.endpoint.remote_endpoint).await?;
        let done = (plan.clone(), peer_endpoint);
        if !created && self.applied.peers.get(id) == Some(&done) {
            return Ok(());
        }
        // Whatever fails below leaves the peer to be configured again by the next pass.
        self.applied.peers.remove(id);
        let spec = DeviceSpec {
            name: plan.interface.clone(),
            listen_port: plan.listen_port,
            peer_key: plan.endpoint.remote_public_key,
            peer_endpoint,
            allowed_ips: plan.allowed_ips(),
            keepalive: self.keepalive,
            mtu: self.mtu,
        };
        let (key, configured) = (self.key.clone(), device.clone());
        let result = tokio::task::spawn_blocking(move || configured.configure(&key, &spec))
            .await
            .context("device configuration task")?;
        if let Err(err) = result {
            // A device that cannot be configured (or whose control channel broke, or whose
            // peer changed its key) is rebuilt on the next pass. Our own handle goes first:
            // the interface disappears only with the last one, and the removal waits for that.
            drop(device);
            if let Some(old) = self.devices.remove(id) {
                remove_device(old).await;
            }
            return Err(err).context("configuring the wireguard device");
        }
        let name = plan.interface.as_str();
        // The tunnels carry IPv4 only: without this, the kernel's IPv6 link-local chatter
        // (router solicitations, MLD reports) goes through the tunnel and the peer drops it,
        // counted as `source_not_allowed`. Best effort (read-only /proc/sys in a container).
        let ipv6 = format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6");
        if let Err(err) = tokio::fs::write(&ipv6, "1").await {
            tracing::debug!(interface = name, error = %err, "could not disable ipv6 on the tunnel");
        }
        ip(&[
            "link",
            "set",
            "dev",
            name,
            "mtu",
            &self.mtu.to_string(),
            "up",
        ])
        .await?;
        cmd::sysctl(&format!("conf/{name}/rp_filter"), "0").await?;
        let own = self.own_networks().await?;
        let (routed, refused) = refuse(&plan.routed(), &own);
        self.record_refused(id, name, &refused);
        let routed = if self.active { routed } else { Vec::new() };
        for net in &routed {
            ip(&["route", "replace", &net.to_string(), "dev", name]).await?;
        }
        // Routes of an earlier version of this peer's TunnelEndpoint (its NAT view changed).
        let listed = ip(&["-o", "-4", "route", "show", "dev", name]).await?;
        for stale in listed
            .lines()
            .filter_map(|l| l.split_whitespace().next()?.parse::<IpNet>().ok())
            .filter(|n| !routed.contains(n))
        {
            ip(&["route", "del", &stale.to_string(), "dev", name]).await?;
        }
        let table = plan.table().to_string();
        ip(&["route", "replace", "default", "dev", name, "table", &table]).await?;
        // The engine starts a handshake itself when it adds a peer.
        if created
            && matches!(self.flavor, Flavor::Kernel)
            && let Some(target) = routed.first()
        {
            kick_handshake(name, *target).await;
        }
        self.applied.peers.insert(id.clone(), done);
        *self.configurations.entry(id.clone()).or_default() += 1;
        Ok(())
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

    /// Whether this replica routes and sends ([`Linux::set_active`]).
    pub fn is_active(&self) -> bool {
        self.active
    }

    /// Makes this replica the cluster's active gateway, or a standby. Taking over changes only
    /// what a standby holds back, all prepared beforehand: the engine sends a handshake to
    /// every peer at once, and the peers' ranges are routed into their tunnels (one `ip -batch`
    /// for all). Stepping down removes those routes and silences the engine.
    pub async fn set_active(&mut self, active: bool) -> anyhow::Result<()> {
        self.active = active;
        if let Some(engine) = self.engine() {
            engine.set_standby(!active);
        }
        if active {
            // A connection that began on the previous active continues here from its middle:
            // conntrack picks it up from any packet (tcp_loose), and must not drop or leave
            // untranslated the packets whose window it has not seen yet.
            for (knob, value) in [
                ("nf_conntrack_tcp_loose", "1"),
                ("nf_conntrack_tcp_be_liberal", "1"),
            ] {
                let path = format!("/proc/sys/net/netfilter/{knob}");
                if let Err(err) = tokio::fs::write(&path, value).await {
                    tracing::warn!(knob, error = %err, "could not set a conntrack knob for taking over connections mid-flow");
                }
            }
        }
        let mut batch = String::new();
        for (id, (plan, _)) in &self.applied.peers {
            let refused = self.refused.get(id);
            for net in plan.routed() {
                if refused.is_some_and(|r| r.contains(&net)) {
                    continue;
                }
                let verb = if active { "replace" } else { "del" };
                let _ = writeln!(batch, "route {verb} {net} dev {}", plan.interface);
            }
        }
        if batch.is_empty() {
            return Ok(());
        }
        match cmd::run("ip", &["-force", "-batch", "-"], Some(&batch)).await {
            Ok(_) => Ok(()),
            Err(err) if active => Err(err).context("routing the peers' ranges into their tunnels"),
            // A route already gone is what stepping down wants.
            Err(err) => {
                tracing::debug!(
                    error = format!("{err:#}"),
                    "some tunnel routes were already gone"
                );
                Ok(())
            }
        }
    }

    /// Removes every tunnel, rule and the nftables table (graceful stop).
    pub async fn clear(&mut self) {
        let _ = self.apply(&[], &[], Pass::Repair).await;
    }
}

/// Makes our policy rules (at [`RULE_PRIORITY`]) exactly `want`: `(mark, table)` each.
async fn sync_rules(want: &BTreeSet<(u32, u32)>) -> anyhow::Result<()> {
    let have = current_rules().await?;
    for (mark, table) in have.difference(want) {
        delete_rule(*mark, *table).await?;
    }
    for (mark, table) in want.difference(&have) {
        rule("add", *mark, *table).await?;
    }
    Ok(())
}

/// The tunnel guard table ([`guard`]) for `plans`, as an nftables script.
fn guard_script(plans: &[PeerPlan], hub: &[HubMapping]) -> String {
    let guards: Vec<guard::TunnelGuard> = plans.iter().map(|p| p.guard(hub)).collect();
    guard::script(&guards)
}

/// The socket address WireGuard sends to: the endpoint's IP, or its DNS name resolved now (on
/// every pass, so a name that moves to another address is followed). Of several addresses the
/// lowest IPv4 one is taken (else the lowest IPv6), so an unchanged answer in another order does
/// not reconfigure the device.
async fn resolve(endpoint: &Endpoint) -> anyhow::Result<SocketAddr> {
    if let Some(addr) = endpoint.socket_addr() {
        return Ok(addr);
    }
    let target = endpoint.to_string();
    let found = tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host(target.clone()))
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "resolving the remote endpoint {target}: no answer in {RESOLVE_TIMEOUT:?}"
            )
        })?
        .with_context(|| format!("resolving the remote endpoint {target}"))?;
    let chosen = pick(found).with_context(|| {
        format!("resolving the remote endpoint {target}: the name has no address")
    })?;
    tracing::debug!(endpoint = %target, address = %chosen, "resolved the remote endpoint");
    Ok(chosen)
}

/// The lowest IPv4 address of `found`, else the lowest IPv6 one.
fn pick(found: impl IntoIterator<Item = SocketAddr>) -> Option<SocketAddr> {
    found.into_iter().min_by_key(|a| (a.is_ipv6(), *a))
}

/// Makes a new device handshake now. A restarted gateway's devices have no session, while its
/// peers still hold the old one: they keep encrypting with it and only re-handshake after
/// sending unanswered for 15 s (KEEPALIVE_TIMEOUT + REKEY_TIMEOUT), or when our persistent
/// keepalive first fires (boringtun waits a whole interval; the kernel sends one at
/// configuration). Any packet routed into the device starts a handshake, so we send one empty UDP
/// datagram to the discard port of the peer's routed range, with TTL 1: whatever the peer's
/// gateway does with it after decrypting (drop it for a source outside our AllowedIPs, or NAT it),
/// it is never forwarded. Best effort: a failure only means the slow path.
async fn kick_handshake(interface: &str, target: IpNet) {
    let sent = async {
        let socket = tokio::net::UdpSocket::bind((std::net::Ipv4Addr::UNSPECIFIED, 0)).await?;
        socket.set_ttl(1)?;
        socket.send_to(&[], (target.network(), 9)).await
    };
    match sent.await {
        Ok(_) => tracing::debug!(interface, %target, "handshake kicked"),
        Err(err) => tracing::debug!(interface, %target, error = %err, "could not kick a handshake"),
    }
}

/// Our rules: `(mark, table)` of every rule at [`RULE_PRIORITY`].
async fn current_rules() -> anyhow::Result<BTreeSet<(u32, u32)>> {
    let text = ip(&["-4", "rule", "show", "pref", &RULE_PRIORITY.to_string()]).await?;
    Ok(text.lines().filter_map(parse_rule).collect())
}

async fn delete_rule(mark: u32, table: u32) -> anyhow::Result<()> {
    rule("del", mark, table).await
}

/// `ip rule add|del` of our rule sending `mark` to `table`.
async fn rule(op: &str, mark: u32, table: u32) -> anyhow::Result<()> {
    ip(&[
        "rule",
        op,
        "pref",
        &RULE_PRIORITY.to_string(),
        "fwmark",
        &format!("{mark:#x}/{MARK_MASK:#x}"),
        "lookup",
        &table.to_string(),
    ])
    .await
    .map(drop)
}

/// `1784: from all fwmark 0xca810000/0xffff0000 lookup 51841` → `(0xca810000, 51841)`.
fn parse_rule(line: &str) -> Option<(u32, u32)> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let after = |key: &str| {
        words
            .iter()
            .position(|w| *w == key)
            .and_then(|i| words.get(i + 1))
    };
    let mark = after("fwmark")?.split('/').next()?;
    let mark = u32::from_str_radix(mark.trim_start_matches("0x"), 16).ok()?;
    let table = after("lookup")?.parse().ok()?;
    Some((mark, table))
}

/// The interface name of an `ip -o link show` line (`3: tg01234567: <...`, or `name@peer`).
fn link_name(line: &str) -> Option<&str> {
    let name = line.split(':').nth(1)?.trim();
    Some(name.split('@').next().unwrap_or(name))
}

/// Whether `name` has the shape of our interface names (prefix + 8 hex digits).
fn is_ours(prefix: &str, name: &str) -> bool {
    name.strip_prefix(prefix)
        .is_some_and(|rest| rest.len() == 8 && rest.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Drops a device off the async workers (stopping boringtun's threads or deleting the kernel
/// link blocks), then waits until its interface is gone so a new one can take the name.
async fn remove_device(device: Arc<Device>) {
    let name = device.name().to_owned();
    let _ = tokio::task::spawn_blocking(move || drop(device)).await;
    let path = format!("/sys/class/net/{name}");
    let deadline = tokio::time::Instant::now() + LINK_GONE_TIMEOUT;
    while tokio::fs::try_exists(&path).await.unwrap_or(false) {
        if tokio::time::Instant::now() > deadline {
            tracing::warn!(interface = %name, "interface still present after removal");
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_overlapping_a_network_of_the_node_are_refused() {
        let net = |s: &str| s.parse::<IpNet>().expect("net");
        let own = vec![
            ("node".to_owned(), net("10.9.0.0/16")),
            ("pod".to_owned(), net("10.0.0.0/24")),
        ];
        let (kept, refused) = refuse(
            &[
                net("10.9.0.0/16"),
                net("10.81.0.0/16"),
                net("10.9.128.0/20"),
                net("10.0.0.0/8"),
            ],
            &own,
        );
        assert_eq!(kept, [net("10.81.0.0/16")]);
        let refused: Vec<String> = refused
            .iter()
            .map(|(p, i, n)| format!("{p} {i} {n}"))
            .collect();
        assert_eq!(
            refused,
            [
                "10.9.0.0/16 node 10.9.0.0/16",
                "10.9.128.0/20 node 10.9.0.0/16",
                "10.0.0.0/8 node 10.9.0.0/16"
            ]
        );
    }

    #[test]
    fn parses_rules_and_link_names() {
        assert_eq!(
            parse_rule("1784:\tfrom all fwmark 0xca810000/0xffff0000 lookup 51841"),
            Some((0xca81_0000, 51841))
        );
        assert_eq!(parse_rule("0:\tfrom all lookup local"), None);
        assert_eq!(
            link_name("7: tg0a1b2c3d: <POINTOPOINT,NOARP,UP> mtu 1420"),
            Some("tg0a1b2c3d")
        );
        assert_eq!(link_name("2: veth0@if3: <BROADCAST>"), Some("veth0"));
        assert!(is_ours("tg", "tg0a1b2c3d"));
        assert!(!is_ours("tg", "tg0a1b2c3"));
        assert!(!is_ours("tg", "eth0"));
    }

    #[tokio::test]
    async fn endpoints_resolve_to_what_wireguard_sends_to() {
        let ip = Endpoint::parse("e", "192.0.2.1:51840").expect("ip");
        assert_eq!(
            resolve(&ip).await.expect("no lookup"),
            "192.0.2.1:51840".parse::<SocketAddr>().expect("addr")
        );
        // `localhost` resolves from /etc/hosts, without a DNS server.
        let name = Endpoint::parse("e", "localhost:51841").expect("name");
        let addr = resolve(&name).await.expect("resolves");
        assert!(addr.ip().is_loopback(), "{addr}");
        assert_eq!(addr.port(), 51841);
        // RFC 6761: `.invalid` never resolves; the error names the endpoint.
        let nowhere = Endpoint::parse("e", "nowhere.invalid:51840").expect("name");
        let err = resolve(&nowhere).await.expect_err("does not resolve");
        assert!(
            format!("{err:#}").contains("resolving the remote endpoint nowhere.invalid:51840"),
            "{err:#}"
        );
    }

    #[test]
    fn of_several_addresses_the_lowest_ipv4_one_is_used() {
        let addrs: Vec<SocketAddr> = ["[2001:db8::1]:1", "192.0.2.9:1", "192.0.2.3:1"]
            .iter()
            .map(|a| a.parse().expect("addr"))
            .collect();
        assert_eq!(pick(addrs.clone()), Some(addrs[2]));
        assert_eq!(pick(addrs[..1].to_vec()), Some(addrs[0]));
        assert_eq!(pick(Vec::new()), None);
    }
}
