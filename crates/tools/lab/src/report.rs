//! What the lab shows and writes: the summary table, the NAT views, ready-to-paste grpcurl
//! commands, and the topology file the lab writes for other tools.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;
use serde::Serialize;

use crate::mesh::{Kind, Snapshot};
use crate::plan::{ClusterPlan, Role};

/// Labs bigger than this get no per-pair NAT table (it would have clusters² rows).
const NAT_TABLE_MAX_CLUSTERS: usize = 10;

/// Lays out rows under a header, columns padded to their widest cell.
pub(crate) fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<&str>| {
        let text: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", text.join("  ").trim_end());
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
    out
}

fn count(snapshot: &Snapshot, id: &str, kind: Kind) -> usize {
    snapshot.tunnels.get(id).map_or(0, |ts| {
        ts.iter()
            .filter(|t| {
                let k = trellis_api::pb::types::PeeringKind::try_from(t.kind).ok();
                matches!(
                    (k, kind),
                    (Some(trellis_api::pb::types::PeeringKind::Full), Kind::Full)
                        | (
                            Some(trellis_api::pb::types::PeeringKind::Induced),
                            Kind::Induced
                        )
                )
            })
            .count()
    })
}

/// One row per cluster: role, CIDRs, tunnels by kind, where its services listen.
pub fn summary(clusters: &[ClusterPlan], snapshot: &Snapshot) -> String {
    let rows: Vec<Vec<String>> = clusters
        .iter()
        .map(|c| {
            let full = count(snapshot, &c.id, Kind::Full);
            let induced = count(snapshot, &c.id, Kind::Induced);
            vec![
                c.id.clone(),
                format!("{:?}", c.role).to_lowercase(),
                c.pod_cidr.to_string(),
                c.external_cidr.to_string(),
                full.to_string(),
                induced.to_string(),
                format!(
                    "{}:{}-{}",
                    c.ports.discovery.ip(),
                    c.ports.discovery.port(),
                    c.ports.gateway.port()
                ),
            ]
        })
        .collect();
    table(
        &[
            "CLUSTER",
            "ROLE",
            "POD CIDR",
            "EXTERNAL CIDR",
            "FULL",
            "INDUCED",
            "SERVICES (discovery..gateway)",
        ],
        &rows,
    )
}

/// Who sees whom at which pod CIDR: one row per tunnel, or a note for big labs.
pub fn nat_views(clusters: &[ClusterPlan], snapshot: &Snapshot) -> String {
    if clusters.len() > NAT_TABLE_MAX_CLUSTERS {
        return format!(
            "(NAT views of {} clusters omitted; see the topology file or \
             `trellisctl --broker ADDR status`)\n",
            clusters.len()
        );
    }
    let mut rows = Vec::new();
    for c in clusters {
        for t in snapshot.tunnels.get(&c.id).into_iter().flatten() {
            let remote = t.remote.as_ref().map_or("?", |r| r.cluster_id.as_str());
            let kind =
                trellis_api::pb::types::PeeringKind::try_from(t.kind).map_or("?".to_owned(), |k| {
                    k.as_str_name()
                        .trim_start_matches("PEERING_KIND_")
                        .to_lowercase()
                });
            rows.push(vec![
                c.id.clone(),
                remote.to_owned(),
                kind,
                t.remote_pod_cidr.clone(),
                t.remote_pod_cidr_nat.clone(),
                t.local_pod_cidr_nat.clone(),
            ]);
        }
    }
    table(
        &[
            "CLUSTER",
            "REMOTE",
            "KIND",
            "REMOTE POD CIDR",
            "SEEN HERE AS",
            "REMOTE SEES US AS",
        ],
        &rows,
    )
}

/// A pod address in `cluster` for examples: host .10 of its pod CIDR.
pub fn example_pod_ip(cluster: &ClusterPlan) -> std::net::Ipv4Addr {
    let base = u32::from(cluster.pod_cidr.network());
    std::net::Ipv4Addr::from(base + 10)
}

/// grpcurl commands that work against this lab as printed.
pub fn grpcurl_commands(clusters: &[ClusterPlan]) -> String {
    let hub = &clusters[0];
    let leaf = clusters
        .iter()
        .find(|c| c.role == Role::Leaf)
        .unwrap_or(hub);
    let other = clusters
        .iter()
        .filter(|c| c.role == Role::Leaf)
        .nth(1)
        .unwrap_or(hub);
    let pod = example_pod_ip(leaf);
    let mut out = String::new();
    let _ = writeln!(out, "# every service serves reflection:");
    let _ = writeln!(out, "grpcurl -plaintext {} list", hub.ports.ipam);
    let _ = writeln!(out, "# the hub's ForeignClusters (its leaves, full peers):");
    let _ = writeln!(
        out,
        "grpcurl -plaintext {} trellis.discovery.v1.Discovery/ListForeignClusters",
        hub.ports.discovery
    );
    let _ = writeln!(
        out,
        "# {}'s tunnels (to the hub, and induced ones to the other leaves):",
        leaf.id
    );
    let _ = writeln!(
        out,
        "grpcurl -plaintext {} trellis.peering.v1.Broker/ListTunnelEndpoints",
        leaf.ports.broker
    );
    let _ = writeln!(out, "# how {} maps the other clusters' CIDRs:", leaf.id);
    let _ = writeln!(
        out,
        "grpcurl -plaintext {} trellis.ipam.v1.Ipam/ListClusterSubnets",
        leaf.ports.ipam
    );
    let _ = writeln!(
        out,
        "# the address {} uses for {}'s pod {pod}:",
        other.id, leaf.id
    );
    let _ = writeln!(
        out,
        "grpcurl -plaintext -d '{{\"cluster_id\": \"{}\", \"ip\": \"{pod}\"}}' {} trellis.ipam.v1.Ipam/MapEndpointIp",
        other.id, leaf.ports.ipam
    );
    let _ = writeln!(
        out,
        "# export that pod from {} and resolve it by name at {}'s clusterset DNS (needs dig):",
        leaf.id, other.id
    );
    let _ = writeln!(
        out,
        "trellisctl --endpoints {} export web --namespace shop --port 8080 --endpoint {pod}",
        leaf.ports.endpoints
    );
    let _ = writeln!(
        out,
        "dig @{} -p {} +short web.shop.svc.clusterset.local",
        other.dns.ip(),
        other.dns.port()
    );
    out
}

/// The topology file (`--topology-file`, see the README); fields may be added, none
/// renamed.
#[derive(Debug, Serialize)]
pub struct Topology {
    pub clusters: Vec<TopologyCluster>,
    pub reach: Vec<Reach>,
    /// Whether the mesh was complete when the file was written.
    pub converged: bool,
}

/// One cluster in the topology file.
#[derive(Debug, Serialize)]
pub struct TopologyCluster {
    pub id: String,
    pub name: String,
    pub role: Role,
    pub pod_cidr: String,
    pub external_cidr: String,
    /// Where each service listens, and `dns`: where the cluster's `clusterset.local` DNS
    /// answers (UDP and TCP; with `--dataplane netns`, an address its pods reach).
    pub services: std::collections::BTreeMap<&'static str, String>,
    /// The mutual-TLS peer listeners of the cluster-facing services (none in plaintext).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub peer_services: std::collections::BTreeMap<&'static str, String>,
    /// Each service's Prometheus `/metrics` listener.
    pub metrics: std::collections::BTreeMap<&'static str, String>,
    /// The TunnelEndpoints its broker lists (after convergence).
    pub tunnels: Vec<TopologyTunnel>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gateway_netns: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_netns: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_ip: Option<String>,
    /// With `--dataplane netns`: the cluster's node namespaces (the gateway on one of them).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<TopologyNode>,
    /// With `--dataplane netns`: one pod per node.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<TopologyPod>,
    /// With `--dataplane netns`: every gateway replica (ADR 0023).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gateways: Vec<TopologyGateway>,
    /// With `--nat`: the router in front of the cluster's gateway (ADR 0025).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nat: Option<TopologyNat>,
}

/// The NAT router in front of a `--nat` cluster's gateway.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct TopologyNat {
    /// `none`, `one-to-one`, `easy` or `hard`.
    pub kind: String,
    /// The router's namespace (absent for `none`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub netns: Option<String>,
    /// The address the gateway advertises (its private one behind a router).
    pub private_ip: String,
    /// Where the rest of the fabric sees it.
    pub public_ip: String,
}

/// A gateway replica of a `--dataplane netns` cluster.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct TopologyGateway {
    /// The node it runs on.
    pub node: String,
    pub netns: String,
    /// Its gRPC address, inside `netns`.
    pub address: String,
    pub pid: Option<u32>,
    /// Whether it was the active one when the file was written.
    pub active_at_start: bool,
}

/// A node of a `--dataplane netns` cluster.
#[derive(Debug, Serialize)]
pub struct TopologyNode {
    pub name: String,
    pub netns: String,
    /// Its address on the cluster's node network.
    pub ip: String,
    /// Whether the gateway (and the services) run on it.
    pub gateway: bool,
}

/// A pod of a `--dataplane netns` cluster.
#[derive(Debug, Serialize)]
pub struct TopologyPod {
    pub name: String,
    /// The node it runs on.
    pub node: String,
    pub netns: String,
    pub ip: String,
}

/// One tunnel in the topology file.
#[derive(Debug, Serialize)]
pub struct TopologyTunnel {
    pub remote: String,
    pub kind: String,
    pub remote_pod_cidr_nat: String,
    pub local_pod_cidr_nat: String,
}

/// The pod in namespace `from_pod` of cluster `from` reaches the pod `to_pod` of cluster `to`
/// at `address` (data plane only; every ordered pair of pods in different clusters).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Reach {
    pub from: String,
    pub from_pod: String,
    pub to: String,
    pub to_pod: String,
    pub address: String,
}

impl Topology {
    /// The topology of `clusters`; tunnels from `snapshot` when there is one.
    pub fn new(clusters: &[ClusterPlan], snapshot: Option<&Snapshot>, converged: bool) -> Self {
        let clusters = clusters
            .iter()
            .map(|c| TopologyCluster {
                id: c.id.clone(),
                name: c.id.clone(),
                role: c.role,
                pod_cidr: c.pod_cidr.to_string(),
                external_cidr: c.external_cidr.to_string(),
                services: c
                    .ports
                    .named()
                    .into_iter()
                    .chain([("dns", c.dns)])
                    .map(|(name, addr)| (name, addr.to_string()))
                    .collect(),
                peer_services: c
                    .peer
                    .iter()
                    .flat_map(|p| p.named())
                    .map(|(name, addr)| (name, addr.to_string()))
                    .collect(),
                metrics: c
                    .metrics
                    .named()
                    .into_iter()
                    .map(|(name, addr)| (name, addr.to_string()))
                    .collect(),
                tunnels: snapshot
                    .and_then(|s| s.tunnels.get(&c.id))
                    .into_iter()
                    .flatten()
                    .map(|t| TopologyTunnel {
                        remote: t
                            .remote
                            .as_ref()
                            .map(|r| r.cluster_id.clone())
                            .unwrap_or_default(),
                        kind: trellis_api::pb::types::PeeringKind::try_from(t.kind).map_or(
                            String::new(),
                            |k| {
                                k.as_str_name()
                                    .trim_start_matches("PEERING_KIND_")
                                    .to_lowercase()
                            },
                        ),
                        remote_pod_cidr_nat: t.remote_pod_cidr_nat.clone(),
                        local_pod_cidr_nat: t.local_pod_cidr_nat.clone(),
                    })
                    .collect(),
                gateway_netns: None,
                pod_netns: None,
                pod_ip: None,
                nodes: Vec::new(),
                pods: Vec::new(),
                gateways: Vec::new(),
                nat: None,
            })
            .collect();
        Self {
            clusters,
            reach: Vec::new(),
            converged,
        }
    }

    /// Writes the file atomically (a reader never sees half of it).
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        let text = serde_json::to_string_pretty(self)?;
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text + "\n")
            .with_context(|| format!("writing the topology file {}", tmp.display()))?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("writing the topology file {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::plan;
    use trellis_api::pb::types::{ClusterIdentity, PeeringKind, TunnelEndpoint};

    fn snapshot() -> Snapshot {
        let mut s = Snapshot::default();
        s.tunnels.insert(
            "leaf-1".into(),
            vec![TunnelEndpoint {
                remote: Some(ClusterIdentity {
                    cluster_id: "leaf-2".into(),
                    cluster_name: "leaf-2".into(),
                }),
                kind: PeeringKind::Induced as i32,
                remote_pod_cidr: "10.0.0.0/16".into(),
                remote_pod_cidr_nat: "10.1.0.0/16".into(),
                local_pod_cidr_nat: "10.2.0.0/16".into(),
                ..Default::default()
            }],
        );
        s
    }

    #[test]
    fn the_summary_counts_tunnels_by_kind_and_aligns_columns() {
        let clusters = plan(3, true, 7100, false).expect("plan");
        let text = summary(&clusters, &snapshot());
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(lines[0].starts_with("CLUSTER  ROLE  POD CIDR"), "{text}");
        let leaf: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(
            leaf,
            [
                "leaf-1",
                "leaf",
                "10.0.0.0/16",
                "100.64.1.0/24",
                "0",
                "1",
                "127.0.0.1:7111-7116"
            ]
        );
    }

    #[test]
    fn nat_views_show_both_directions_and_are_omitted_for_big_labs() {
        let text = nat_views(&plan(3, true, 0, false).expect("plan"), &snapshot());
        assert!(
            text.lines()
                .any(|l| l.split_whitespace().collect::<Vec<_>>()
                    == [
                        "leaf-1",
                        "leaf-2",
                        "induced",
                        "10.0.0.0/16",
                        "10.1.0.0/16",
                        "10.2.0.0/16"
                    ]),
            "{text}"
        );
        assert!(
            nat_views(&plan(11, true, 0, false).expect("plan"), &snapshot()).contains("omitted")
        );
    }

    #[test]
    fn grpcurl_commands_use_the_planned_ports() {
        let text = grpcurl_commands(&plan(3, false, 7100, false).expect("plan"));
        assert!(
            text.contains("grpcurl -plaintext 127.0.0.1:7104 list"),
            "{text}"
        );
        assert!(
            text.contains(r#"-d '{"cluster_id": "leaf-2", "ip": "10.1.0.10"}' 127.0.0.1:7114"#),
            "{text}"
        );
    }

    #[test]
    fn the_topology_file_has_the_contract_fields() {
        let clusters = plan(3, true, 7100, false).expect("plan");
        let dir = tempfile_dir();
        let path = dir.join("topology.json");
        Topology::new(&clusters, Some(&snapshot()), true)
            .write(&path)
            .expect("writes");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("reads")).expect("json");
        let leaf = &v["clusters"][1];
        assert_eq!(leaf["id"], "leaf-1");
        assert_eq!(leaf["pod_cidr"], "10.0.0.0/16");
        assert_eq!(leaf["services"]["ipam"], "127.0.0.1:7114");
        assert_eq!(leaf["tunnels"][0]["kind"], "induced");
        assert!(v["reach"].as_array().is_some_and(Vec::is_empty));
        assert!(leaf.get("pod_netns").is_none());
        assert!(leaf.get("nodes").is_none() && leaf.get("pods").is_none());
        let _ = std::fs::remove_dir_all(dir);
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("trellis-lab-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        dir
    }
}
