//! The gateway's port to the local IPAM: its external-CIDR endpoint mappings, polled with
//! `Ipam.ListEndpointMappings` every `--mappings-interval` (a list of at most one entry per
//! reflected third-cluster endpoint; a watch RPC would save little), converted to
//! [`Mappings`] here and published only when they changed. A failed poll keeps the last known
//! set: an IPAM restart must not tear down the DNAT of live hub-path connections.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use tokio::sync::watch;
use trellis_api::ClusterId;
use trellis_api::pb::ipam as ipam_pb;
use trellis_runtime::client::{Timeouts, local_channel};
use trellis_runtime::local_auth::LocalToken;
use trellis_runtime::metrics::Metrics;
use trellis_runtime::{Shutdown, timer};

use crate::mappings::{HubMapping, Mappings};

/// Converts a `ListEndpointMappings` answer, skipping (and logging) malformed entries.
pub fn from_proto(response: &ipam_pb::ListEndpointMappingsResponse) -> Mappings {
    let mut out: Mappings = response
        .mappings
        .iter()
        .filter_map(|m| {
            let parsed = (|| {
                let destination: IpAddr = m.ip.parse().ok()?;
                let external_ip: IpAddr = m.external_ip.parse().ok()?;
                let clusters = m
                    .cluster_ids
                    .iter()
                    .map(|id| ClusterId::parse("cluster_ids", id).ok())
                    .collect::<Option<BTreeSet<_>>>()?;
                Some(HubMapping {
                    external_ip,
                    destination,
                    clusters,
                })
            })();
            if parsed.is_none() {
                tracing::warn!(ip = %m.ip, external_ip = %m.external_ip, "ignoring a malformed endpoint mapping");
            }
            parsed
        })
        .collect();
    out.sort();
    out
}

/// Polls the IPAM at `ipam` until `shutdown`, publishing changed sets on `mappings`.
pub async fn run(
    ipam: String,
    local_token: LocalToken,
    metrics: Metrics,
    interval: Duration,
    mappings: watch::Sender<Option<Mappings>>,
    shutdown: Shutdown,
) {
    let channel = match local_channel("ipam", &ipam, Timeouts::default(), &local_token, &metrics) {
        Ok(c) => c,
        Err(err) => {
            tracing::error!(error = %err, "cannot follow the IPAM's endpoint mappings");
            return;
        }
    };
    let mut client = ipam_pb::ipam_client::IpamClient::new(channel);
    let mut failing = false;
    loop {
        let answer = tokio::select! {
            answer = client.list_endpoint_mappings(ipam_pb::ListEndpointMappingsRequest {}) => answer,
            () = shutdown.cancelled() => return,
        };
        match answer {
            Ok(response) => {
                if failing {
                    tracing::info!(ipam = %ipam, "endpoint mappings readable again");
                    failing = false;
                }
                let set = from_proto(response.get_ref());
                mappings.send_if_modified(|current| {
                    if current.as_ref() == Some(&set) {
                        return false;
                    }
                    tracing::info!(mappings = set.len(), "hub-path endpoint mappings changed");
                    *current = Some(set);
                    true
                });
            }
            Err(status) => {
                if !failing {
                    tracing::warn!(ipam = %ipam, code = ?status.code(), message = status.message(), "cannot list endpoint mappings; keeping the last known set");
                    failing = true;
                }
            }
        }
        tokio::select! {
            () = timer::period(interval) => {},
            () = shutdown.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converts_sorted_and_skips_malformed_entries() {
        let response = ipam_pb::ListEndpointMappingsResponse {
            mappings: vec![
                ipam_pb::EndpointMapping {
                    ip: "10.83.0.10".into(),
                    external_ip: "10.202.0.9".into(),
                    cluster_ids: vec!["a".into()],
                },
                ipam_pb::EndpointMapping {
                    ip: "10.83.0.7".into(),
                    external_ip: "10.202.0.3".into(),
                    cluster_ids: vec!["a".into(), "d".into()],
                },
                ipam_pb::EndpointMapping {
                    ip: "not-an-ip".into(),
                    external_ip: "10.202.0.4".into(),
                    cluster_ids: vec![],
                },
            ],
        };
        let m = from_proto(&response);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].external_ip.to_string(), "10.202.0.3");
        assert_eq!(m[0].clusters.len(), 2);
        assert_eq!(m[1].destination.to_string(), "10.83.0.10");
    }
}
