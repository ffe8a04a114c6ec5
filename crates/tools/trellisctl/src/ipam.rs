//! `trellisctl ipam`: the IPAM's local subnets (GetLocalSubnets), how each remote cluster is
//! addressed and addresses us (ListClusterSubnets), and the external-CIDR endpoint mappings
//! (ListEndpointMappings); `ipam map` translates one endpoint IP (MapEndpointIp).

use serde::Serialize;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::ipam::{
    ClusterSubnets, EndpointMapping, GetLocalSubnetsRequest, ListClusterSubnetsRequest,
    ListEndpointMappingsRequest, MapEndpointIpRequest,
};
use trellis_runtime::client::TracedChannel;

use crate::cli::{Globals, MapArgs};
use crate::error::CtlError;
use crate::names;
use crate::output::Report;
use crate::service::Service;
use crate::table::{Table, fields, section};

/// Everything `ipam` shows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IpamView {
    pub local: LocalSubnetsView,
    /// One entry per remote cluster, ordered by ID.
    pub clusters: Vec<ClusterSubnetsView>,
    /// Third-cluster endpoints reachable through our external CIDR (hub path).
    pub endpoint_mappings: Vec<EndpointMappingView>,
}

/// This cluster's own ranges.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LocalSubnetsView {
    pub pod_cidr: String,
    pub service_cidr: String,
    pub external_cidr: String,
    /// Ranges remaps are drawn from, in order of preference.
    pub pools: Vec<String>,
    pub reserved: Vec<String>,
}

/// What the IPAM knows about one remote cluster; empty strings are not known yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClusterSubnetsView {
    pub cluster_id: String,
    pub cluster_name: String,
    /// The remote's real pod CIDR, and how we address it (our decision).
    pub remote_pod_cidr: String,
    pub remote_pod_cidr_nat: String,
    pub remote_external_cidr: String,
    pub remote_external_cidr_nat: String,
    /// How the remote addresses our pod and external CIDRs (its decision).
    pub local_pod_cidr_nat: String,
    pub local_external_cidr_nat: String,
}

/// One hub-path endpoint mapping.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EndpointMappingView {
    pub ip: String,
    pub external_ip: String,
    pub cluster_ids: Vec<String>,
}

impl From<&ClusterSubnets> for ClusterSubnetsView {
    fn from(c: &ClusterSubnets) -> Self {
        Self {
            cluster_id: c.cluster_id.clone(),
            cluster_name: c.cluster_name.clone(),
            remote_pod_cidr: c.remote_pod_cidr.clone(),
            remote_pod_cidr_nat: c.remote_pod_cidr_nat.clone(),
            remote_external_cidr: c.remote_external_cidr.clone(),
            remote_external_cidr_nat: c.remote_external_cidr_nat.clone(),
            local_pod_cidr_nat: c.local_pod_cidr_nat.clone(),
            local_external_cidr_nat: c.local_external_cidr_nat.clone(),
        }
    }
}

impl From<&EndpointMapping> for EndpointMappingView {
    fn from(m: &EndpointMapping) -> Self {
        Self {
            ip: m.ip.clone(),
            external_ip: m.external_ip.clone(),
            cluster_ids: m.cluster_ids.clone(),
        }
    }
}

impl Report for IpamView {
    fn table(&self) -> String {
        let l = &self.local;
        let local = fields(&[
            ("pod cidr", l.pod_cidr.clone()),
            ("service cidr", l.service_cidr.clone()),
            ("external cidr", l.external_cidr.clone()),
            ("pools", l.pools.join(", ")),
            ("reserved", l.reserved.join(", ")),
        ]);

        let clusters = if self.clusters.is_empty() {
            "  (none)\n".into()
        } else {
            let mut t = Table::new(&[
                "CLUSTER",
                "NAME",
                "REMOTE POD",
                "WE USE",
                "REMOTE EXTERNAL",
                "WE USE",
                "THEY USE FOR OUR POD",
                "THEY USE FOR OUR EXTERNAL",
            ]);
            for c in &self.clusters {
                t.row([
                    c.cluster_id.clone(),
                    c.cluster_name.clone(),
                    c.remote_pod_cidr.clone(),
                    c.remote_pod_cidr_nat.clone(),
                    c.remote_external_cidr.clone(),
                    c.remote_external_cidr_nat.clone(),
                    c.local_pod_cidr_nat.clone(),
                    c.local_external_cidr_nat.clone(),
                ]);
            }
            t.render()
        };

        let mappings = if self.endpoint_mappings.is_empty() {
            "  (none)\n".into()
        } else {
            let mut t = Table::new(&["ENDPOINT IP", "EXTERNAL IP", "HANDED TO"]);
            for m in &self.endpoint_mappings {
                t.row([m.ip.clone(), m.external_ip.clone(), m.cluster_ids.join(",")]);
            }
            t.render()
        };

        [
            section("Local subnets", &local),
            section("Remote clusters", &clusters),
            section("External-CIDR endpoint mappings (hub path)", &mappings),
        ]
        .join("\n")
    }
}

/// The answer of `ipam map`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MapView {
    pub cluster_id: String,
    pub ip: String,
    pub induced: bool,
    /// The address the target cluster uses for the endpoint.
    pub mapped_ip: String,
    /// `local_nat`, `home` or `external`.
    pub path: String,
}

impl Report for MapView {
    fn table(&self) -> String {
        format!(
            "{} is {} for {} (path {})\n",
            self.ip, self.mapped_ip, self.cluster_id, self.path
        )
    }
}

async fn client(
    globals: &Globals,
) -> Result<(IpamClient<TracedChannel>, crate::service::Target), CtlError> {
    let target = globals.target(Service::Ipam);
    let channel = globals.connect(&target).await?;
    Ok((IpamClient::new(channel), target))
}

/// Runs `ipam`.
pub async fn list(globals: &Globals) -> Result<IpamView, CtlError> {
    let (ipam, target) = client(globals).await?;
    let (mut a, mut b, mut c) = (ipam.clone(), ipam.clone(), ipam);
    let (local, clusters, mappings) = tokio::join!(
        a.get_local_subnets(GetLocalSubnetsRequest {}),
        b.list_cluster_subnets(ListClusterSubnetsRequest {}),
        c.list_endpoint_mappings(ListEndpointMappingsRequest {}),
    );
    let local = local
        .map_err(|s| CtlError::rpc(&target, "GetLocalSubnets", &s))?
        .into_inner();
    let clusters = clusters
        .map_err(|s| CtlError::rpc(&target, "ListClusterSubnets", &s))?
        .into_inner();
    let mappings = mappings
        .map_err(|s| CtlError::rpc(&target, "ListEndpointMappings", &s))?
        .into_inner();
    Ok(IpamView {
        local: LocalSubnetsView {
            pod_cidr: local.pod_cidr,
            service_cidr: local.service_cidr,
            external_cidr: local.external_cidr,
            pools: local.pools,
            reserved: local.reserved,
        },
        clusters: clusters.clusters.iter().map(Into::into).collect(),
        endpoint_mappings: mappings.mappings.iter().map(Into::into).collect(),
    })
}

/// Runs `ipam map`.
pub async fn map(globals: &Globals, args: &MapArgs) -> Result<MapView, CtlError> {
    let (mut ipam, target) = client(globals).await?;
    let reply = ipam
        .map_endpoint_ip(MapEndpointIpRequest {
            cluster_id: args.cluster_id.clone(),
            ip: args.ip.to_string(),
            induced: args.induced,
        })
        .await
        .map_err(|s| CtlError::rpc(&target, "MapEndpointIp", &s))?
        .into_inner();
    Ok(MapView {
        cluster_id: args.cluster_id.clone(),
        ip: args.ip.to_string(),
        induced: args.induced,
        mapped_ip: reply.ip,
        path: names::mapping_path(reply.path),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> IpamView {
        IpamView {
            local: LocalSubnetsView {
                pod_cidr: "10.0.0.0/16".into(),
                service_cidr: String::new(),
                external_cidr: "10.201.0.0/16".into(),
                pools: vec!["10.0.0.0/8".into(), "192.168.0.0/16".into()],
                reserved: vec![],
            },
            clusters: vec![ClusterSubnetsView::from(&ClusterSubnets {
                cluster_id: "hub".into(),
                cluster_name: "hub".into(),
                remote_pod_cidr: "10.0.0.0/16".into(),
                remote_pod_cidr_nat: "10.1.0.0/16".into(),
                remote_external_cidr: "10.202.0.0/16".into(),
                remote_external_cidr_nat: "10.202.0.0/16".into(),
                local_pod_cidr_nat: "10.2.0.0/16".into(),
                local_external_cidr_nat: String::new(),
            })],
            endpoint_mappings: vec![],
        }
    }

    #[test]
    fn table_lists_local_ranges_and_both_views_per_cluster() {
        let text = sample().table();
        assert!(text.contains("  pod cidr       10.0.0.0/16\n"), "{text}");
        assert!(text.contains("  service cidr   -\n"), "{text}");
        assert!(
            text.contains("  pools          10.0.0.0/8, 192.168.0.0/16\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "hub      hub   10.0.0.0/16  10.1.0.0/16  10.202.0.0/16    10.202.0.0/16  10.2.0.0/16           -"
            ),
            "{text}"
        );
        assert!(
            text.ends_with("External-CIDR endpoint mappings (hub path)\n  (none)\n"),
            "{text}"
        );
    }

    #[test]
    fn json_keeps_the_proto_field_names() {
        let json = serde_json::to_value(sample()).expect("json");
        assert_eq!(json["local"]["pod_cidr"], "10.0.0.0/16");
        assert_eq!(json["clusters"][0]["remote_pod_cidr_nat"], "10.1.0.0/16");
        assert_eq!(json["clusters"][0]["local_pod_cidr_nat"], "10.2.0.0/16");
        assert_eq!(json["endpoint_mappings"], serde_json::json!([]));
    }

    #[test]
    fn map_table_is_one_sentence() {
        let view = MapView {
            cluster_id: "leaf-a".into(),
            ip: "10.0.3.7".into(),
            induced: false,
            mapped_ip: "10.80.3.7".into(),
            path: "local_nat".into(),
        };
        assert_eq!(
            view.table(),
            "10.0.3.7 is 10.80.3.7 for leaf-a (path local_nat)\n"
        );
    }
}
