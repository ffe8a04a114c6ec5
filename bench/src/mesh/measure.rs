//! One run's measurement, once hub and leaves are up: every leaf peers with the hub, the
//! clock stops when the last induced TunnelEndpoint exists, and then what the hub holds is
//! counted and what its processes spent is read.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use trellis_api::pb::ipam::ListClusterSubnetsRequest;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::forwarder_client::ForwarderClient;
use trellis_api::pb::peering::{
    GetTokenRequest, ListNetworkConfigsRequest, ListRelaysRequest, ListTunnelEndpointsRequest,
    PeerRequest,
};
use trellis_integration::processes::Service;
use trellis_runtime::Shutdown;

use super::hub::Hub;
use super::leaves::Leaves;
use super::run::{Held, Outcome};
use super::tallies::{Tallies, follow};
use super::{HUB_ID, PEER_RETRIES, channel};
use crate::proc::{ProcUsage, usage};
use crate::results::{HubProcess, MeshRun};

fn read_usage(pids: &[(&'static str, u32)]) -> anyhow::Result<Vec<(&'static str, ProcUsage)>> {
    pids.iter()
        .map(|(s, pid)| Ok((*s, usage(*pid).with_context(|| format!("hub {s}"))?)))
        .collect()
}

pub(super) async fn measure(
    hub: &Hub,
    clusters: &Leaves,
    leaves: usize,
    timeout: Duration,
) -> anyhow::Result<Outcome> {
    // With mutual TLS, the leaves pin the hub's CA at first contact, as a join command does.
    let answer = BrokerClient::new(channel(hub.addr("broker")).await?)
        .get_token(GetTokenRequest {})
        .await?
        .into_inner();
    let (token, ca_cert_hash) = (answer.token, answer.ca_cert_hash);
    let brokers = clusters.brokers();
    let expected = leaves * (leaves - 1);
    let pids = hub.pids()?;
    let before = read_usage(&pids)?;
    let revisions_before = hub.etcd_revisions().await?;
    let counters_before = hub.counters();

    // Every broker's tunnels are followed from before the first Peer request (index
    // `brokers.len()` is the hub).
    let tallies = Arc::new(Tallies::new(brokers.len() + 1));
    let stop = Shutdown::new();
    let followers: Vec<_> = brokers
        .iter()
        .chain(std::iter::once(&hub.addr("broker")))
        .enumerate()
        .map(|(i, addr)| tokio::spawn(follow(i, *addr, tallies.clone(), stop.clone())))
        .collect();
    let result = async {
        tallies.wait_all_watching().await;
        let started = Instant::now();
        let mut peerings = Vec::new();
        for broker in &brokers {
            let mut broker = BrokerClient::new(channel(*broker).await?);
            let request = PeerRequest {
                broker_address: hub.peering_broker().to_string(),
                token: token.clone(),
                expected_cluster_id: HUB_ID.into(),
                ca_cert_hash: ca_cert_hash.clone(),
            };
            // With hundreds of clusters on two cores a leaf's own services can be too slow to
            // answer its broker in time (UNAVAILABLE); an operator would run the command again,
            // and so does the benchmark, counting it.
            peerings.push(tokio::spawn(async move {
                let mut retries = 0;
                loop {
                    match broker.peer(request.clone()).await {
                        Err(status)
                            if status.code() == tonic::Code::Unavailable
                                && retries < PEER_RETRIES =>
                        {
                            retries += 1;
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        other => return other.map(|_| retries),
                    }
                }
            }));
        }
        let mut peer_retries = 0;
        for peering in peerings {
            peer_retries += peering.await?.context("a leaf peers with the hub")?;
        }
        let mut full_tunnels_at = None;
        let mut induced_90_at = None;
        let mut induced_at = None;
        let (converged, reached) = loop {
            let (full_up, induced) = tallies.progress(leaves);
            if induced_90_at.is_none() && induced * 10 >= expected * 9 {
                induced_90_at = Some(started.elapsed());
            }
            if induced_at.is_none() && induced == expected {
                induced_at = Some(started.elapsed());
            }
            if full_tunnels_at.is_none() && full_up {
                full_tunnels_at = Some(started.elapsed());
            }
            if induced_at.is_some() && full_tunnels_at.is_some() {
                break (true, induced);
            }
            if started.elapsed() >= timeout {
                break (false, induced);
            }
            tokio::select! {
                () = tallies.changed.notified() => {}
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        };
        anyhow::Ok((
            started,
            peer_retries,
            full_tunnels_at,
            induced_90_at,
            induced_at,
            converged,
            reached,
        ))
    }
    .await;
    stop.cancel();
    for follower in followers {
        let _ = follower.await;
    }
    let (started, peer_retries, full_tunnels_at, induced_90_at, induced_at, converged, reached) =
        result?;
    let elapsed = started.elapsed();
    let after = read_usage(&pids)?;
    let counters = hub
        .counters()
        .zip(counters_before)
        .map(|(after, before)| after - before);
    let per_induced = |n: f64| (converged).then(|| n / expected as f64);
    let hub_etcd_writes = match (revisions_before, hub.etcd_revisions().await?) {
        (Some(before), Some(after)) => Some(
            after
                .iter()
                .map(|(service, rev)| {
                    let before = before.get(service).copied().unwrap_or(0);
                    ((*service).to_owned(), rev - before)
                })
                .collect::<BTreeMap<_, _>>(),
        ),
        _ => None,
    };
    let cpu_during: Vec<f64> = after
        .iter()
        .zip(&before)
        .map(|((_, a), (_, b))| a.cpu_seconds - b.cpu_seconds)
        .collect();
    let hub_cpu_seconds: Option<f64> = (!pids.is_empty()).then(|| cpu_during.iter().sum());
    // The setup ends with the last induced tunnel (full tunnels are normally up long before).
    let seconds = if converged {
        induced_at.unwrap_or(elapsed).as_secs_f64()
    } else {
        timeout.as_secs_f64()
    };
    let induced_90_seconds = induced_90_at.map(|d| d.as_secs_f64());
    let run = MeshRun {
        seconds,
        converged,
        induced_reached: reached,
        hub_cpu_seconds,
        hub_cpu_ms_per_induced_tunnel: hub_cpu_seconds
            .filter(|_| converged)
            .map(|cpu| cpu * 1000.0 / expected as f64),
        full_tunnels_seconds: full_tunnels_at.map(|d| d.as_secs_f64()),
        induced_90_seconds,
        tail_share: induced_90_seconds
            .filter(|_| converged && seconds > 0.0)
            .map(|t90| (seconds - t90) / seconds),
        open_files: std::fs::read_dir("/proc/self/fd").ok().map(Iterator::count),
        peer_retries: Some(peer_retries),
        hub_etcd_writes_per_induced_tunnel: hub_etcd_writes
            .as_ref()
            .filter(|_| converged)
            .map(|w| w.values().sum::<i64>() as f64 / expected as f64),
        hub_etcd_writes,
        hub_store_retries_per_induced_tunnel: counters.and_then(|c| per_induced(c.store_retries)),
        hub_watch_events_per_induced_tunnel: counters.and_then(|c| per_induced(c.watch_events)),
        hub_relay_retries_per_induced_tunnel: counters.and_then(|c| per_induced(c.relay_retries)),
        process_peak_rss_kib: None,
        process_cpu_seconds: None,
    };
    if !converged {
        return Ok(Outcome { run, held: None });
    }
    debug_assert_eq!(reached, expected);

    let broker = || async { anyhow::Ok(BrokerClient::new(channel(hub.addr("broker")).await?)) };
    let tunnels = broker()
        .await?
        .list_tunnel_endpoints(ListTunnelEndpointsRequest::default())
        .await?
        .into_inner()
        .tunnel_endpoints
        .len();
    let ncs = broker()
        .await?
        .list_network_configs(ListNetworkConfigsRequest::default())
        .await?
        .into_inner()
        .network_configs
        .len();
    let relays = ForwarderClient::new(channel(hub.addr("forwarder")).await?)
        .list_relays(ListRelaysRequest::default())
        .await?
        .into_inner()
        .relays
        .len();
    let ipam =
        trellis_api::pb::ipam::ipam_client::IpamClient::new(channel(hub.addr("ipam")).await?)
            .list_cluster_subnets(ListClusterSubnetsRequest {})
            .await?
            .into_inner()
            .clusters
            .len();
    let stores = match hub {
        Hub::InProcess(h) => Some(h.stores().await?),
        _ => None,
    };
    let processes = (!pids.is_empty()).then(|| {
        after
            .iter()
            .zip(&cpu_during)
            .map(|((service, u), during)| HubProcess {
                service: (*service).to_owned(),
                cpu_seconds: u.cpu_seconds,
                cpu_seconds_during_setup: *during,
                peak_rss_kib: u.peak_rss_kib,
                rss_kib: u.rss_kib,
            })
            .collect()
    });
    let etcd_keys = match hub {
        Hub::Etcd(c) => {
            let mut keys = BTreeMap::new();
            for service in Service::ALL {
                keys.insert(service.name().to_owned(), c.etcd_keys(service)?.len());
            }
            Some(keys)
        }
        _ => None,
    };
    Ok(Outcome {
        run,
        held: Some(Held {
            tunnels,
            ncs,
            relays,
            ipam,
            stores,
            processes,
            etcd_keys,
        }),
    })
}
