//! The gateway's operations: its public endpoint and key per peer, applying a desired set of
//! TunnelEndpoints (peer slots in the store, then the data plane), and tunnel status.
//!
//! Every peer holds a slot from `--wireguard-ports` (ADR 0007's allocation, quarantine and
//! release, unchanged): the slot is its connection mark and routing table. In userspace mode
//! every peer sends to the engine's one port (ADR 0022); in kernel mode (and without a data
//! plane) the slot is also the peer's own listen port.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use ipnet::IpNet;
use trellis_api::model::{Endpoint, EndpointHost, TunnelEndpoint};
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_runtime::retry::Retryable as _;
use trellis_store::SharedStore;

use crate::dataplane::engine::{DropReason, Engine};
use crate::dataplane::linux::{Linux, Pass};
use crate::dataplane::wireguard::PeerStats;
use crate::dataplane::{Mode, PeerPlan};
use crate::keys::KeyPair;
use crate::mappings::Mappings;
use crate::names;
use crate::ports::{self, PortPolicy};
use crate::replicas::{self, Replicas, View};

/// A handshake older than this means the tunnel is down: WireGuard re-handshakes every 120 s
/// while traffic flows, and gives up on a session after 180 s (REJECT_AFTER_TIME).
const HANDSHAKE_FRESH: Duration = Duration::from_secs(180);

/// The desired TunnelEndpoints, by remote cluster.
pub type Desired = BTreeMap<ClusterId, std::sync::Arc<TunnelEndpoint>>;

/// What GetGatewayInfo answers.
#[derive(Debug, Clone)]
pub struct GatewayInfo {
    pub endpoint: Endpoint,
    pub public_key: trellis_api::model::WgKey,
    pub mode: Mode,
    pub listen_port: u16,
    /// How long a port without an applied tunnel is kept after the last request for it.
    pub unused_port_grace: std::time::Duration,
    /// The data plane translates what it sends: the broker offers the stateless wire
    /// convention (ADR 0034).
    pub stateless_wire: bool,
}

/// A tunnel's lifecycle state (the proto's TunnelState).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Connecting,
    Up,
    Down,
    Error,
}

/// The status of one tunnel.
#[derive(Debug, Clone)]
pub struct TunnelStatus {
    pub plan: PeerPlan,
    pub stats: Option<PeerStats>,
    pub state: State,
    pub message: String,
    /// How many times the data plane configured this tunnel (device, routes) since start.
    pub configurations: u64,
}

/// One tunnel as last applied. A peer that got no slot has slot 0 (no port is 0) and an
/// error result: it is in the status, not in the data plane.
#[derive(Debug, Clone)]
struct Applied {
    plan: PeerPlan,
    result: std::result::Result<(), String>,
}

/// Static settings of a gateway.
#[derive(Debug, Clone)]
pub struct Settings {
    pub identity: ClusterIdentity,
    /// Where remote gateways reach us: an IP, or a DNS name they resolve.
    pub endpoint_host: EndpointHost,
    /// The port range, and when ports go back to it.
    pub ports: PortPolicy,
    /// The one UDP port of the userspace engine, which every peer sends to; `None`: each peer
    /// gets its slot as its port (kernel mode, no data plane).
    pub shared_port: Option<u16>,
    pub interface_prefix: String,
    /// The node the gateway runs on, and its address on the node network (`None`: no route
    /// agent can reach it).
    pub node_name: String,
    pub node_ip: Option<IpAddr>,
    /// MTU of every tunnel device (the underlay's minus WireGuard's overhead), announced to the
    /// route agents.
    pub tunnel_mtu: u32,
    /// The data plane translates what it sends (the userspace engine, unless
    /// `--no-stateless-wire`): offered to every peer, used with those that offer it too
    /// (ADR 0034).
    pub stateless_wire: bool,
}

/// What every node must route to the gateway node (`WatchRoutes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteSet {
    /// Every peer's ranges as we address them, sorted, without duplicates.
    pub prefixes: Vec<IpNet>,
    pub gateway_node_name: String,
    pub gateway_node_ip: Option<IpAddr>,
    pub tunnel_mtu: u32,
    /// The epoch of the active replica on `gateway_node_name` (0: none elected yet).
    pub epoch: u64,
}

/// The gateway of one cluster.
#[derive(Debug)]
pub struct Gateway {
    store: SharedStore,
    settings: Settings,
    keys: KeyPair,
    mode: Mode,
    dataplane: Option<tokio::sync::Mutex<Linux>>,
    /// The userspace engine (also inside `dataplane`), read without waiting for a
    /// reconciliation to finish.
    engine: Option<std::sync::Arc<Engine>>,
    applied: std::sync::Mutex<BTreeMap<ClusterId, Applied>>,
    /// Where the next new peer's port is looked for first.
    port_hint: ports::Hint,
    /// The node path's view of the last apply, for the route agents' streams.
    routes: tokio::sync::watch::Sender<RouteSet>,
    /// The replicas' election, when this gateway takes part in one (always, once started).
    replicas: Option<std::sync::Arc<Replicas>>,
    /// The election's outcome as last followed.
    view: std::sync::Mutex<View>,
    /// Whether the last pass left every desired tunnel configured (told to the other
    /// replicas: a standby that is not warm cannot take over at once).
    warm: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Gateway {
    /// A gateway over `store` with its key pair; `dataplane` is `None` exactly when `mode` is
    /// [`Mode::None`].
    pub fn new(
        store: SharedStore,
        settings: Settings,
        mode: Mode,
        keys: KeyPair,
        dataplane: Option<Linux>,
    ) -> Self {
        let routes = RouteSet {
            prefixes: Vec::new(),
            gateway_node_name: settings.node_name.clone(),
            gateway_node_ip: settings.node_ip,
            tunnel_mtu: settings.tunnel_mtu,
            epoch: 0,
        };
        Self {
            store,
            settings,
            keys,
            mode,
            engine: dataplane.as_ref().and_then(Linux::engine),
            dataplane: dataplane.map(tokio::sync::Mutex::new),
            applied: std::sync::Mutex::new(BTreeMap::new()),
            port_hint: ports::Hint::default(),
            routes: tokio::sync::watch::Sender::new(routes),
            replicas: None,
            view: std::sync::Mutex::new(View::default()),
            warm: std::sync::Arc::default(),
        }
    }

    /// This gateway as one of its cluster's replicas, following `replicas`' election.
    pub fn with_replicas(mut self, replicas: std::sync::Arc<Replicas>) -> Self {
        self.warm = replicas.warm_flag();
        self.replicas = Some(replicas);
        self
    }

    /// Follows the election's outcome: the data plane turns active or standby (the engine
    /// first, so the handshakes of a takeover leave before anything else is done), and the
    /// route agents learn the active's node under its epoch.
    pub async fn follow_view(&self, view: View) -> Result<()> {
        if let Some(engine) = &self.engine {
            engine.set_standby(!view.active);
        }
        if let Some(dp) = &self.dataplane {
            let mut dp = dp.lock().await;
            if dp.is_active() != view.active {
                dp.set_active(view.active)
                    .await
                    .map_err(|e| Error::Internal(format!("{e:#}")))?;
            }
        }
        let (name, ip) = match &view.leader {
            Some(leader) => (leader.node_name.clone(), leader.node_ip),
            None => (self.settings.node_name.clone(), self.settings.node_ip),
        };
        let epoch = view.epoch();
        self.routes.send_if_modified(|routes| {
            let changed = routes.gateway_node_name != name
                || routes.gateway_node_ip != ip
                || routes.epoch != epoch;
            routes.gateway_node_name = name;
            routes.gateway_node_ip = ip;
            routes.epoch = epoch;
            changed
        });
        if let Ok(mut current) = self.view.lock() {
            *current = view;
        }
        Ok(())
    }

    /// This replica's part in the election (a gateway built without one reports itself as
    /// its cluster's only, active replica).
    pub fn replica_status(&self) -> replicas::Status {
        match &self.replicas {
            Some(replicas) => replicas.status(),
            None => replicas::Status {
                replica: self.settings.node_name.clone(),
                view: View {
                    active: true,
                    leader: None,
                },
                warm: self.warm.load(std::sync::atomic::Ordering::Relaxed),
                peers: Vec::new(),
            },
        }
    }

    /// The routes every node needs now, then again after each change (a new subscriber sees
    /// the current set first).
    pub fn watch_routes(&self) -> tokio::sync::watch::Receiver<RouteSet> {
        self.routes.subscribe()
    }

    /// The store the gateway keeps its key and port allocations in.
    pub fn store(&self) -> &SharedStore {
        &self.store
    }

    /// The public key.
    pub fn public_key(&self) -> trellis_api::model::WgKey {
        self.keys.public()
    }

    /// The endpoint and key the peer `peer` must use (allocating its slot on first request);
    /// `None`: the base endpoint, for display.
    pub async fn info(&self, peer: Option<&ClusterId>) -> Result<GatewayInfo> {
        let slot = match peer {
            Some(id) => {
                Some(ports::allocate(&self.store, &self.settings.ports, &self.port_hint, id).await?)
            }
            None => None,
        };
        let port = self.listen_port(slot.unwrap_or(self.settings.ports.range.first()));
        // Peers that join later are told where the active replica is (those already peered
        // followed it when its handshakes reached them).
        let leader_host = self
            .view
            .lock()
            .ok()
            .and_then(|v| v.leader.clone())
            .and_then(|l| EndpointHost::parse("endpoint_host", &l.endpoint_host).ok());
        let host = leader_host.unwrap_or_else(|| self.settings.endpoint_host.clone());
        Ok(GatewayInfo {
            endpoint: Endpoint::new(host, port)
                .ok_or_else(|| trellis_error::Error::Internal("allocated port 0".into()))?,
            public_key: self.keys.public(),
            mode: self.mode,
            listen_port: port,
            unused_port_grace: self.settings.ports.unused_grace,
            stateless_wire: self.settings.stateless_wire,
        })
    }

    /// Whether the tunnel described by `te` uses the stateless wire convention: both sides
    /// offered it, and this gateway still does (one restarted with `--no-stateless-wire` must
    /// not translate on a record written before; its broker withdraws the offer, and the peer
    /// follows).
    fn stateless(&self, te: &TunnelEndpoint) -> bool {
        self.settings.stateless_wire && te.stateless_wire
    }

    /// The port the peer holding `slot` sends to.
    fn listen_port(&self, slot: u16) -> u16 {
        self.settings.shared_port.unwrap_or(slot)
    }

    /// Datagrams the userspace engine dropped at the WireGuard port, by reason (empty without
    /// the engine).
    pub fn dropped_datagrams(&self) -> Vec<(DropReason, u64)> {
        self.engine
            .as_ref()
            .map(|e| e.dropped())
            .unwrap_or_default()
    }

    /// Datagrams the userspace engine resent through a hub after a tunnel moved to the relay
    /// (`None` without the engine).
    pub fn resent_datagrams(&self) -> Option<u64> {
        self.engine.as_ref().map(|e| e.resent())
    }

    /// Receive buffers the userspace engine's TUN thread filled while it busy-polled (ADR 0032;
    /// `None` without the engine).
    pub fn received_while_polling(&self) -> Option<u64> {
        self.engine.as_ref().map(|e| e.received_while_polling())
    }

    /// Time the userspace engine's hot threads spent busy-polling (`None` without the engine).
    pub fn busy_polled(&self) -> Option<std::time::Duration> {
        self.engine.as_ref().map(|e| e.busy_polled())
    }

    /// The interface name of the tunnel to `peer`.
    pub fn interface_name(&self, peer: &ClusterId) -> String {
        names::interface_name(
            &self.settings.interface_prefix,
            &self.settings.identity.id,
            peer,
        )
    }

    /// A [`Pass::Repair`] pass of [`Gateway::apply_pass`]: everything checked and re-applied.
    pub async fn apply(&self, desired: &Desired, hub: &Mappings) -> Result<usize> {
        self.apply_pass(desired, hub, Pass::Repair).await
    }

    /// Makes ports and data plane match `desired` (with the hub-path DNAT of `hub`): first
    /// releases the slots of tunnels that are gone, then binds a slot for every desired peer,
    /// applies the data plane, and releases the slots of peers that never got a tunnel.
    /// Per-peer failures are recorded in the status and counted in the result (the caller
    /// retries sooner when there are any): a peer that cannot get a slot (the range full, or
    /// its slot in quarantine) waits with an error status while every other change, removals
    /// included, is applied. `pass` says whether the data plane applies only what changed
    /// since the last pass or checks everything.
    pub async fn apply_pass(&self, desired: &Desired, hub: &Mappings, pass: Pass) -> Result<usize> {
        // A Changes pass takes the slots of the peers applied last time, unchanged and without
        // error, from memory: at a mesh of n peers forming, the store reads and listings of
        // every peer on every change made each gateway's work grow as n² (a 255-cluster lab
        // spent about a fifth of its time there). A Repair pass checks every slot in the
        // store, and everything that a Changes pass skips.
        let previous = match pass {
            Pass::Changes => self.applied.lock().map(|a| a.clone()).unwrap_or_default(),
            Pass::Repair => BTreeMap::new(),
        };
        let removed = previous.is_empty() || previous.keys().any(|id| !desired.contains_key(id));
        // Releases first: the slot a removed peer frees may be the one a new peer waits for,
        // and a peer short of a slot must never keep a removed one's tunnel up.
        let keep: BTreeSet<ClusterId> = desired.keys().cloned().collect();
        let released = if removed {
            ports::release_tunnels_except(&self.store, &keep)
                .await?
                .len()
        } else {
            0
        };
        let mut plans = Vec::with_capacity(desired.len());
        let mut unslotted = Vec::new();
        let mut results: BTreeMap<ClusterId, std::result::Result<(), String>> = BTreeMap::new();
        for (id, te) in desired {
            if id == &self.settings.identity.id {
                tracing::warn!(peer = %id, "ignoring a tunnel endpoint for our own cluster");
                continue;
            }
            if let Some(last) = previous.get(id)
                && last.result.is_ok()
                && last.plan.endpoint == *te
            {
                plans.push(last.plan.clone());
                continue;
            }
            let slot = match ports::bind_tunnel(
                &self.store,
                &self.settings.ports,
                &self.port_hint,
                id,
            )
            .await
            {
                Ok(slot) => slot,
                // The store is in trouble, for every peer alike: change nothing, retry.
                Err(err) if err.is_transient() => return Err(err),
                Err(err) => {
                    tracing::warn!(peer = %id, error = %err, "no slot for this peer: its tunnel waits, the others are applied");
                    results.insert(id.clone(), Err(format!("no slot for this peer: {err}")));
                    unslotted.push(PeerPlan {
                        endpoint: te.clone(),
                        slot: 0,
                        listen_port: 0,
                        interface: self.interface_name(id),
                        stateless: self.stateless(te),
                    });
                    continue;
                }
            };
            plans.push(PeerPlan {
                endpoint: te.clone(),
                slot,
                listen_port: self.listen_port(slot),
                interface: self.interface_name(id),
                stateless: self.stateless(te),
            });
        }
        // The data plane's `ip` table is IPv4 only for now: an IPv6 TunnelEndpoint gets an
        // error status instead of half a tunnel.
        let (v4, v6): (Vec<PeerPlan>, Vec<PeerPlan>) = plans
            .iter()
            .cloned()
            .partition(|p| p.endpoint.local_pod_cidr.addr().is_ipv4());
        for p in &v6 {
            results.insert(
                p.endpoint.remote.id.clone(),
                Err("IPv6 tunnels are not supported by the data plane yet".into()),
            );
        }
        match &self.dataplane {
            Some(dp) => results.extend(dp.lock().await.apply(&v4, hub, pass).await),
            None => results.extend(v4.iter().map(|p| (p.endpoint.remote.id.clone(), Ok(())))),
        }
        if pass == Pass::Repair || released > 0 {
            ports::release_unused(&self.store, self.settings.ports.unused_grace).await?;
            // After the data plane removed the released peers: none of their connections is
            // marked again once flushed.
            self.flush_freed().await?;
        }
        let prefixes: BTreeSet<IpNet> = v4.iter().flat_map(PeerPlan::routed).collect();
        self.routes.send_if_modified(|routes| {
            let prefixes: Vec<IpNet> = prefixes.into_iter().collect();
            let changed = routes.prefixes != prefixes;
            routes.prefixes = prefixes;
            changed
        });
        let failed = results.values().filter(|r| r.is_err()).count();
        self.warm
            .store(failed == 0, std::sync::atomic::Ordering::Relaxed);
        let applied = plans
            .into_iter()
            .chain(unslotted)
            .map(|plan| {
                let id = plan.endpoint.remote.id.clone();
                let result = results.remove(&id).unwrap_or(Ok(()));
                (id, Applied { plan, result })
            })
            .collect();
        if let Ok(mut guard) = self.applied.lock() {
            *guard = applied;
        }
        Ok(failed)
    }

    /// Deletes from conntrack the connections of peers whose ports were freed, so that the
    /// next holder of a port (and with it of the connection mark and routing table) never
    /// gets replies of the old peer's connections. A port whose flush failed stays out of use
    /// and is tried again on the next reconciliation.
    async fn flush_freed(&self) -> Result<()> {
        for (port, revision) in ports::unflushed(&self.store).await? {
            if let Some(dp) = &self.dataplane {
                let mark = names::mark(port);
                if let Err(err) = dp.lock().await.flush_connections(mark).await {
                    tracing::warn!(
                        port,
                        mark = format!("{mark:#x}"),
                        error = format!("{err:#}"),
                        "could not flush the connections of a freed port; it stays out of use"
                    );
                    continue;
                }
            }
            ports::mark_flushed(&self.store, port, revision).await?;
        }
        Ok(())
    }

    /// Removes every tunnel from the data plane (graceful stop); ports stay allocated.
    pub async fn clear_dataplane(&self) {
        if let Some(dp) = &self.dataplane {
            dp.lock().await.clear().await;
        }
    }

    /// Status of every tunnel, by remote cluster ID.
    pub async fn tunnels(&self) -> Vec<TunnelStatus> {
        let applied: Vec<Applied> = match self.applied.lock() {
            Ok(guard) => guard.values().cloned().collect(),
            Err(_) => Vec::new(),
        };
        let mut out = Vec::with_capacity(applied.len());
        for a in applied {
            out.push(self.status_of(a).await);
        }
        out
    }

    /// Status of the tunnel to `peer`, if there is one.
    pub async fn tunnel(&self, peer: &ClusterId) -> Option<TunnelStatus> {
        let applied = self.applied.lock().ok()?.get(peer).cloned()?;
        Some(self.status_of(applied).await)
    }

    async fn status_of(&self, applied: Applied) -> TunnelStatus {
        let Applied { plan, result } = applied;
        let configurations = match &self.dataplane {
            Some(dp) => dp.lock().await.configurations(&plan.endpoint.remote.id),
            None => 0,
        };
        if let Err(message) = result {
            return TunnelStatus {
                plan,
                stats: None,
                state: State::Error,
                message,
                configurations,
            };
        }
        let Some(dp) = &self.dataplane else {
            return TunnelStatus {
                plan,
                stats: None,
                state: State::Down,
                message: "data plane disabled (--dataplane none)".into(),
                configurations,
            };
        };
        let read = dp.lock().await.stats(&plan.endpoint.remote.id).await;
        match read {
            Some(Ok(stats)) => {
                let age = stats
                    .last_handshake
                    .map(|t| SystemTime::now().duration_since(t).unwrap_or_default());
                let (state, message) = match age {
                    None => (State::Connecting, String::new()),
                    Some(age) if age <= HANDSHAKE_FRESH => (State::Up, String::new()),
                    Some(age) => (
                        State::Down,
                        format!("last handshake {} s ago", age.as_secs()),
                    ),
                };
                TunnelStatus {
                    plan,
                    stats: Some(stats),
                    state,
                    message,
                    configurations,
                }
            }
            Some(Err(err)) => TunnelStatus {
                plan,
                stats: None,
                state: State::Down,
                message: format!("{err:#}"),
                configurations,
            },
            None => TunnelStatus {
                plan,
                stats: None,
                state: State::Error,
                message: "no device (recreated on the next reconciliation)".into(),
                configurations,
            },
        }
    }
}
