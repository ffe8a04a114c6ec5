//! The port to the local gateway: the endpoint and WireGuard key our NetworkConfigs announce,
//! and where it sees our full peers' gateways (what a hub tells the leaves it introduced).

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use trellis_api::ClusterId;
use trellis_api::pb::gateway::gateway_client::GatewayClient;
use trellis_api::pb::gateway::{
    GetGatewayInfoBatchRequest, GetGatewayInfoRequest, GetGatewayInfoResponse, ListTunnelsRequest,
    get_gateway_info_result,
};
use trellis_api::pb::types::PeeringKind;
use trellis_error::Result;
use trellis_runtime::batch::{self, Batcher};
use trellis_runtime::client::TracedChannel;

/// The gateway's endpoint and public key as it spells them: they go into our NetworkConfigs
/// as they are, and the reconciler compares them with what it announced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayInfo {
    /// `host:port`; the port may differ per remote.
    pub endpoint: String,
    pub public_key: String,
    /// How long the gateway keeps a port without a tunnel after the last request for it
    /// (`None` from a gateway that does not say).
    pub unused_port_grace: Option<Duration>,
    /// The gateway translates what it sends itself: our NetworkConfigs offer the stateless
    /// wire convention (ADR 0034).
    pub stateless_wire: bool,
}

/// Where the gateway sees one full peer's gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observed {
    pub endpoint: SocketAddr,
    pub last_handshake: SystemTime,
}

/// Where the gateway sees each full peer.
pub type ObservedPeers = HashMap<ClusterId, Observed>;

/// An observation older than WireGuard's rekey window (180 s) is of a session that ended: the
/// NAT mapping behind it may be gone.
const FRESH: Duration = Duration::from_secs(180);

/// How long one reading of the gateway's tunnels answers every hub request: leaves ask
/// together, and the observations change at handshake pace.
const OBSERVED_TTL: Duration = Duration::from_secs(1);

/// How long one reading of the gateway's general answer (its key and the host of its endpoint,
/// the same for every remote) stands for the passes events wake: a leaf introduced to 253
/// induced peers runs hundreds of such passes within seconds.
const GENERAL_TTL: Duration = Duration::from_secs(1);

/// The local gateway.
#[derive(Debug)]
pub struct Gateway {
    channel: TracedChannel,
    /// GetGatewayInfo, batched: a pass starting many exchanges asks for their ports together.
    infos: Batcher<GetGatewayInfoRequest, GetGatewayInfoResponse>,
    /// The last reading of [`Gateway::observed`].
    observed: Recent<Arc<ObservedPeers>>,
    /// The last reading of [`Gateway::general`].
    general: Recent<GatewayInfo>,
    /// When the gateway last answered for each remote.
    asked: std::sync::Mutex<Asked>,
}

/// When the gateway last answered [`Gateway::info`] for each remote. Asking keeps the port of a
/// remote without a tunnel reserved: the gateway releases one nobody asked for during its grace
/// period (ADR 0007).
#[derive(Debug, Default)]
struct Asked {
    at: HashMap<ClusterId, Instant>,
    /// The size above which entries older than [`FORGET_ASKED`] are dropped (doubling, so that
    /// dropping costs little per answer).
    prune_above: usize,
}

/// How long an answer is remembered: far longer than any resync period.
const FORGET_ASKED: Duration = Duration::from_secs(3600);

/// The last reading of something the gateway answers, and when it was taken: callers within
/// its time to live share it (one of them reads while the others wait).
#[derive(Debug)]
struct Recent<T> {
    ttl: Duration,
    last: tokio::sync::Mutex<Option<(Instant, T)>>,
}

impl<T: Clone> Recent<T> {
    fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            last: tokio::sync::Mutex::new(None),
        }
    }

    /// The last reading while younger than the time to live (and not `fresh`), or `read`'s.
    async fn get(&self, fresh: bool, read: impl Future<Output = Result<T>>) -> Result<T> {
        let mut last = self.last.lock().await;
        if let Some((at, value)) = last.as_ref()
            && !fresh
            && at.elapsed() < self.ttl
        {
            return Ok(value.clone());
        }
        let value = read.await?;
        *last = Some((Instant::now(), value.clone()));
        Ok(value)
    }
}

impl Gateway {
    pub(super) fn new(channel: TracedChannel) -> Self {
        let infos = batch::unspaced_over(
            GatewayClient::new(channel.clone()),
            |mut client, request| {
                Box::pin(async move { Ok(client.get_gateway_info(request).await?.into_inner()) })
            },
            |mut client, requests| {
                Box::pin(async move {
                    let batch = GetGatewayInfoBatchRequest { requests };
                    Ok(client
                        .get_gateway_info_batch(batch)
                        .await?
                        .into_inner()
                        .results)
                })
            },
            |r| match r.result? {
                get_gateway_info_result::Result::Response(response) => Some(Ok(response)),
                get_gateway_info_result::Result::Error(error) => Some(Err(error)),
            },
        );
        Self {
            channel,
            infos,
            observed: Recent::new(OBSERVED_TTL),
            general: Recent::new(GENERAL_TTL),
            asked: std::sync::Mutex::new(Asked::default()),
        }
    }

    /// Whether the gateway answered for `remote` within `window`.
    pub fn asked_within(&self, remote: &ClusterId, window: Duration) -> bool {
        self.asked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .at
            .get(remote)
            .is_some_and(|at| at.elapsed() < window)
    }

    pub(crate) fn note_asked(&self, remote: &ClusterId) {
        let mut asked = self
            .asked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        asked.at.insert(remote.clone(), now);
        if asked.at.len() > asked.prune_above {
            asked
                .at
                .retain(|_, at| now.duration_since(*at) < FORGET_ASKED);
            asked.prune_above = (2 * asked.at.len()).max(1024);
        }
    }

    /// The gateway's general answer ([`Gateway::info`] for no remote): read now when `fresh`,
    /// otherwise at most once per [`GENERAL_TTL`].
    pub async fn general(&self, fresh: bool) -> Result<GatewayInfo> {
        self.general.get(fresh, self.info(None)).await
    }

    /// The gateway's endpoint and key towards `remote`, or in general (`None`: the key and
    /// the endpoint's host are the same for every remote).
    pub async fn info(&self, remote: Option<&ClusterId>) -> Result<GatewayInfo> {
        let answer = self
            .infos
            .call(GetGatewayInfoRequest {
                cluster_id: remote.map(ToString::to_string).unwrap_or_default(),
            })
            .await?;
        if let Some(remote) = remote {
            self.note_asked(remote);
        }
        Ok(GatewayInfo {
            endpoint: answer.endpoint,
            public_key: answer.public_key,
            unused_port_grace: (answer.unused_port_grace_seconds > 0)
                .then(|| Duration::from_secs(answer.unused_port_grace_seconds.into())),
            stateless_wire: answer.stateless_wire,
        })
    }

    /// Where the gateway sees each full peer it completed a handshake with recently: the
    /// source of that peer's authenticated WireGuard packets. Read at most once a second.
    pub async fn observed(&self) -> Result<Arc<ObservedPeers>> {
        let read = async { Ok(Arc::new(self.read_observed().await?)) };
        self.observed.get(false, read).await
    }

    async fn read_observed(&self) -> Result<ObservedPeers> {
        let tunnels = GatewayClient::new(self.channel.clone())
            .list_tunnels(ListTunnelsRequest {})
            .await?
            .into_inner()
            .tunnels;
        let now = SystemTime::now();
        Ok(tunnels
            .into_iter()
            .filter(|t| t.kind == PeeringKind::Full as i32)
            .filter_map(|t| {
                let id = ClusterId::parse("remote.cluster_id", &t.remote?.cluster_id).ok()?;
                let endpoint = t.remote_endpoint.parse().ok()?;
                let last_handshake = SystemTime::try_from(t.last_handshake_time?).ok()?;
                let fresh = now.duration_since(last_handshake).unwrap_or_default() < FRESH;
                fresh.then_some((
                    id,
                    Observed {
                        endpoint,
                        last_handshake,
                    },
                ))
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    /// Readings within the time to live are shared; `fresh`, or an expired one, reads again.
    #[tokio::test]
    async fn a_recent_reading_is_shared_until_it_expires_or_a_fresh_one_is_asked_for() {
        let reads = AtomicU32::new(0);
        let read = || async { Ok(reads.fetch_add(1, Ordering::SeqCst) + 1) };
        let kept = Recent::new(Duration::from_secs(3600));
        assert_eq!(kept.get(false, read()).await.expect("read"), 1);
        assert_eq!(kept.get(false, read()).await.expect("shared"), 1);
        assert_eq!(kept.get(true, read()).await.expect("fresh"), 2);
        assert_eq!(kept.get(false, read()).await.expect("shared"), 2);
        let expired = Recent::new(Duration::ZERO);
        assert_eq!(expired.get(false, read()).await.expect("read"), 3);
        assert_eq!(expired.get(false, read()).await.expect("expired"), 4);
    }
}
