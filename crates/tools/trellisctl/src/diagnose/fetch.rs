//! What `diagnose` reads beyond `status`: the local IPAM (pools, remote records, external-CIDR
//! mappings), the raw ForeignClusters (addresses and pinned CAs), and for each peer its
//! advertised services' health and its IPAM's record of us.

use trellis_api::pb::discovery::ListForeignClustersRequest;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::ipam::{
    GetLocalSubnetsRequest, ListClusterSubnetsRequest, ListEndpointMappingsRequest,
};
use trellis_api::pb::types;

use super::{IpamState, OwnCertificate, OwnCertificates, PeerReport, advertised, fc_id};
use crate::cli::Globals;
use crate::error::CtlError;
use crate::service::{Service, Target};
use crate::status::fetch::{probe, probe_over};
use trellis_runtime::tls::ToolTls;

pub(super) async fn ipam_state(globals: &Globals) -> Result<IpamState, String> {
    let target = globals.target(Service::Ipam);
    let channel = globals.connect(&target).await.map_err(|e| e.to_string())?;
    let mut client = IpamClient::new(channel);
    let target = &target;
    let rpc =
        |name: &'static str| move |s: tonic::Status| CtlError::rpc(target, name, &s).to_string();
    let local = client
        .get_local_subnets(GetLocalSubnetsRequest {})
        .await
        .map_err(rpc("GetLocalSubnets"))?
        .into_inner();
    let clusters = client
        .list_cluster_subnets(ListClusterSubnetsRequest {})
        .await
        .map_err(rpc("ListClusterSubnets"))?
        .into_inner()
        .clusters;
    let mappings = client
        .list_endpoint_mappings(ListEndpointMappingsRequest {})
        .await
        .map_err(rpc("ListEndpointMappings"))?
        .into_inner()
        .mappings;
    Ok(IpamState {
        pools: local.pools,
        external_cidr: local.external_cidr,
        clusters,
        external_mappings: mappings.len(),
    })
}

pub(super) async fn raw_foreign_clusters(globals: &Globals) -> Option<Vec<types::ForeignCluster>> {
    let channel = globals
        .connect(&globals.target(Service::Discovery))
        .await
        .ok()?;
    DiscoveryClient::new(channel)
        .list_foreign_clusters(ListForeignClustersRequest::default())
        .await
        .ok()
        .map(|r| r.into_inner().foreign_clusters)
}

pub(super) async fn peer_report(
    globals: &Globals,
    local_id: Option<String>,
    local_tls: bool,
    fc: types::ForeignCluster,
) -> PeerReport {
    let cluster_id = fc_id(&fc);
    // A peer pinned with its CA serves other clusters over mutual TLS only. Without TLS flags
    // of our own, its services' health is read over TLS as a tool reads it (no client
    // certificate: health is served to anyone), its server checked against the CA pinned.
    let pinned = fc
        .full
        .as_ref()
        .map(|f| f.ca_certificate.clone())
        .filter(|pem| !pem.trim().is_empty());
    let over_tls = match (&pinned, globals.has_tls()) {
        (Some(pem), false) => Some(ToolTls::new(pem, None).map_err(|e| e.to_string())),
        // An induced peer of a cluster with mutual TLS: it too listens over TLS, and we pin no
        // CA for it (the peering is the hub's), so nothing here can tell its servers from
        // anyone's. Not asked; diagnose in that cluster sees it.
        (None, false) if local_tls => {
            return PeerReport {
                cluster_id,
                services: Vec::new(),
                record_of_us: None,
            };
        }
        _ => None,
    };
    let probes = advertised(&fc).into_iter().map(|(service, address)| {
        let target = Target { service, address };
        let over_tls = over_tls.clone();
        async move {
            match over_tls {
                None => probe(target, globals).await,
                Some(tls) => probe_over(target, tls, globals.timeout).await,
            }
        }
    });
    let probed = futures::future::join_all(probes).await;
    let mut record_of_us = Some(Err("the peer advertises no IPAM".to_owned()));
    if over_tls.is_some() {
        // Its records of other clusters are intra-cluster: not served over TLS.
        record_of_us = None;
    }
    let mut services = Vec::new();
    for (view, channel) in probed {
        if view.service == Service::Ipam && over_tls.is_none() {
            record_of_us = Some(match channel {
                Err(e) => Err(e.to_string()),
                Ok(channel) => IpamClient::new(channel)
                    .list_cluster_subnets(ListClusterSubnetsRequest {})
                    .await
                    .map(|r| {
                        r.into_inner()
                            .clusters
                            .into_iter()
                            .find(|c| Some(&c.cluster_id) == local_id.as_ref())
                    })
                    .map_err(|s| format!("{}: {}", crate::error::code_name(s.code()), s.message())),
            });
        }
        services.push(view);
    }
    PeerReport {
        cluster_id,
        services,
        record_of_us,
    }
}

/// What the managed directory `dir` of cluster `id` holds: the CA's end, each service's
/// certificate, and whether a move to a new CA is still to be announced.
pub(super) fn own_certificates(dir: &std::path::Path, id: &str) -> Result<OwnCertificates, String> {
    let read = |path: &std::path::Path| {
        std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
    };
    let ca_dir = dir.join("ca");
    let ca = read(&ca_dir.join("ca.pem"))?;
    let ca_not_after = trellis_runtime::tls::pem_not_after(&ca)
        .map_err(|e| format!("{}: {e}", ca_dir.join("ca.pem").display()))?;
    let entries =
        std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let mut services = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let cert_path = entry.path().join("cert.pem");
        if name.starts_with("ca") || !cert_path.exists() {
            continue;
        }
        let cert = read(&cert_path)?;
        let key = read(&entry.path().join("key.pem")).unwrap_or_default();
        let (not_before, not_after) = trellis_runtime::tls::pem_validity(&cert)
            .map_err(|e| format!("{}: {e}", cert_path.display()))?;
        services.push(OwnCertificate {
            service: name,
            not_before,
            not_after,
            of_current_ca: trellis_runtime::tls::PeerTls::new(id, &ca, &cert, &key).is_ok(),
        });
    }
    services.sort_by(|a, b| a.service.cmp(&b.service));
    Ok(OwnCertificates {
        dir: dir.display().to_string(),
        ca_not_after,
        services,
        move_unannounced: ca_dir.join("announcing").exists(),
    })
}
