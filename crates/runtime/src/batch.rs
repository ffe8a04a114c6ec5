//! Batch RPCs: many unary calls to one server carried by one call (ADR 0012).
//!
//! At a hub much of the cost of an induced tunnel was per call, not per NetworkConfig: the
//! HTTP/2 stream, the socket writes and the task per request (a profile of the forwarder at 100
//! leaves: 21 % of its CPU in system calls, 10 % in HTTP/2 connection handling). A [`Batcher`]
//! sends a caller's request at once when nothing was sent to that server lately, so an idle
//! system sees no added latency. Under load, batches to one server are spaced: one leaves
//! [`SPACING`] after the previous one left (sooner when [`FILL`] requests wait), once the
//! [`IN_FLIGHT`] ones before it are answered, carrying every request that arrived meanwhile.
//! The server side ([`serve`]) handles every item as the unary call would, concurrently, and
//! answers each with its own result.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;
use tonic::{Code, Status};
use tracing::Instrument;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::forwarder_client::ForwarderClient;
use trellis_api::pb::peering::{
    RelayBatchRequest, RelayRequest, RelayResponse, RelayResult, SubmitNetworkConfigBatchRequest,
    SubmitNetworkConfigRequest, SubmitNetworkConfigResponse, SubmitNetworkConfigResult,
    relay_result, submit_network_config_result,
};
use trellis_api::pb::types::ItemError;
use trellis_error::Error;

use crate::client::TracedChannel;

/// The most items a batch carries; servers refuse larger ones (`InvalidArgument`).
pub const MAX_ITEMS: usize = 256;

/// Batches in flight to one server before further requests wait for the next one. One, so
/// that requests arriving under load leave together; an item whose answer waits on a third
/// party is bounded by its server (a forwarder answers a relay still being delivered after a
/// second as PENDING), so it does not hold the next batch back for long.
pub const IN_FLIGHT: usize = 1;

/// The least time between two batches to one server, unless [`FILL`] requests wait. Without
/// it, a server that answers fast is sent a batch of whatever arrived during one round trip:
/// during the 100-leaf induced storm 45 % of the hub forwarder's calls carried a single
/// NetworkConfig, while 43 % of its profile samples were gRPC, HTTP/2, socket I/O and
/// parking, work done per call. With 100 ms its calls fell from about 3,400 to 2,100 (ADR
/// 0012). A NetworkConfig sent during a storm waits at most that long per hop; one sent to a
/// quiet server does not wait.
pub const SPACING: Duration = Duration::from_millis(100);

/// Requests waiting for a server that send their batch before [`SPACING`] has passed.
pub const FILL: usize = 64;

/// One batch call: the results of `requests`, in order, or the error of the whole call.
pub type SendBatch<Req, Resp> = Box<
    dyn Fn(Vec<Req>) -> BoxFuture<'static, Result<Vec<Result<Resp, Status>>, Status>> + Send + Sync,
>;

/// One unary call, for a lone request and for servers without the batch RPC.
pub type SendOne<Req, Resp> =
    Box<dyn Fn(Req) -> BoxFuture<'static, Result<Resp, Status>> + Send + Sync>;

type Waiting<Req, Resp> = (Req, oneshot::Sender<Result<Resp, Status>>);

struct Queue<Req, Resp> {
    waiting: VecDeque<Waiting<Req, Resp>>,
    in_flight: usize,
    /// When the last batch (or lone request) left for the server.
    last_sent: Option<Instant>,
}

struct Inner<Req, Resp> {
    queue: Mutex<Queue<Req, Resp>>,
    /// [`FILL`] requests wait: the sender need not wait for [`SPACING`] to pass.
    filled: Notify,
    batch: SendBatch<Req, Resp>,
    one: SendOne<Req, Resp>,
    /// The least time between two batches ([`SPACING`] unless made [`Batcher::unspaced`]).
    spacing: Duration,
    /// The server answered the batch RPC UNIMPLEMENTED (an older version): unary from then on.
    unary_only: AtomicBool,
}

/// Coalesces calls to one server into batch calls; cheap to clone (clones share the queue).
pub struct Batcher<Req, Resp> {
    inner: Arc<Inner<Req, Resp>>,
}

impl<Req, Resp> Clone for Batcher<Req, Resp> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<Req, Resp> std::fmt::Debug for Batcher<Req, Resp> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("unary_only", &self.inner.unary_only.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl<Req: Send + 'static, Resp: Send + 'static> Batcher<Req, Resp> {
    /// A batcher sending through `batch`, and through `one` for lone requests.
    pub fn new(batch: SendBatch<Req, Resp>, one: SendOne<Req, Resp>) -> Self {
        Self::spaced(batch, one, SPACING)
    }

    /// A batcher whose next batch leaves as soon as the previous one is answered, carrying what
    /// arrived meanwhile: for a service of the same cluster, whose answers take no network
    /// round trip, so that waiting to fill a batch would cost more than it saves.
    pub fn unspaced(batch: SendBatch<Req, Resp>, one: SendOne<Req, Resp>) -> Self {
        Self::spaced(batch, one, Duration::ZERO)
    }

    fn spaced(batch: SendBatch<Req, Resp>, one: SendOne<Req, Resp>, spacing: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                queue: Mutex::new(Queue {
                    waiting: VecDeque::new(),
                    in_flight: 0,
                    last_sent: None,
                }),
                filled: Notify::new(),
                batch,
                one,
                spacing,
                unary_only: AtomicBool::new(false),
            }),
        }
    }

    /// Sends `request` (alone or with others) and returns its own result.
    pub async fn call(&self, request: Req) -> Result<Resp, Status> {
        if self.inner.unary_only.load(Ordering::Relaxed) {
            return (self.inner.one)(request).await;
        }
        let (tx, rx) = oneshot::channel();
        let start = {
            let mut queue = self
                .inner
                .queue
                .lock()
                .map_err(|_| Status::internal("the batch queue is poisoned"))?;
            queue.waiting.push_back((request, tx));
            let start = queue.in_flight < IN_FLIGHT;
            if start {
                queue.in_flight += 1;
            } else if queue.waiting.len() == FILL {
                // A stored permit at worst sends one later batch early.
                self.inner.filled.notify_one();
            }
            start
        };
        if start {
            // The sender runs in the caller's span and under its subscriber (the lab gives each
            // cluster its own): a batch is traced under the request that opened it.
            crate::telemetry::spawn(send_while_waiting(self.inner.clone()).in_current_span());
        }
        rx.await
            .map_err(|_| Status::unavailable("the batch carrying this request was dropped"))?
    }
}

/// Sends what waits, one batch at a time, until nothing does.
async fn send_while_waiting<Req: Send + 'static, Resp: Send + 'static>(
    inner: Arc<Inner<Req, Resp>>,
) {
    loop {
        let due = {
            let Ok(queue) = inner.queue.lock() else {
                return;
            };
            queue
                .last_sent
                .map(|last| last + inner.spacing)
                .filter(|due| *due > Instant::now() && queue.waiting.len() < FILL)
        };
        if let Some(due) = due {
            tokio::select! {
                () = tokio::time::sleep_until(due) => {}
                () = inner.filled.notified() => {}
            }
        }
        let taken: Vec<Waiting<Req, Resp>> = {
            let Ok(mut queue) = inner.queue.lock() else {
                return;
            };
            if queue.waiting.is_empty() {
                queue.in_flight -= 1;
                return;
            }
            queue.last_sent = Some(Instant::now());
            let n = queue.waiting.len().min(MAX_ITEMS);
            queue.waiting.drain(..n).collect()
        };
        let (requests, replies): (Vec<Req>, Vec<_>) = taken.into_iter().unzip();
        if requests.len() == 1 || inner.unary_only.load(Ordering::Relaxed) {
            // A lone request (or an old server) goes as the unary call: same cost, and its
            // span and metrics name the method.
            let calls = requests.into_iter().map(|r| (inner.one)(r));
            for (reply, result) in replies
                .into_iter()
                .zip(futures::future::join_all(calls).await)
            {
                let _ = reply.send(result);
            }
            continue;
        }
        let n = requests.len();
        let results = match (inner.batch)(requests).await {
            Ok(results) if results.len() == n => results,
            Ok(results) => {
                let status = Status::internal(format!(
                    "a batch of {n} requests was answered with {} results",
                    results.len()
                ));
                (0..n).map(|_| Err(status.clone())).collect()
            }
            Err(status) => {
                if status.code() == Code::Unimplemented {
                    // These requests fail once (their callers retry them); later ones go unary.
                    tracing::info!(error = %status.message(), "the server has no batch rpc: calling it once per request");
                    inner.unary_only.store(true, Ordering::Relaxed);
                }
                (0..n).map(|_| Err(status.clone())).collect()
            }
        };
        for (reply, result) in replies.into_iter().zip(results) {
            let _ = reply.send(result);
        }
    }
}

/// A hub's forwarder's `Relay`, batched through `RelayBatch`.
pub type Relayer = Batcher<RelayRequest, RelayResponse>;

/// A broker's `SubmitNetworkConfig`, batched through `SubmitNetworkConfigBatch`.
pub type Submitter = Batcher<SubmitNetworkConfigRequest, SubmitNetworkConfigResponse>;

/// The [`Relayer`] over `channel` (a remote forwarder's).
pub fn relayer(channel: TracedChannel) -> Relayer {
    let one = ForwarderClient::new(channel.clone());
    let batch = ForwarderClient::new(channel);
    Batcher::new(
        Box::new(move |requests| {
            let mut client = batch.clone();
            Box::pin(async move {
                let results = client
                    .relay_batch(RelayBatchRequest { requests })
                    .await?
                    .into_inner()
                    .results;
                Ok(unpack(results, |r| match r.result {
                    Some(relay_result::Result::Response(response)) => Some(Ok(response)),
                    Some(relay_result::Result::Error(error)) => Some(Err(error)),
                    None => None,
                }))
            })
        }),
        Box::new(move |request| {
            let mut client = one.clone();
            Box::pin(async move { Ok(client.relay(request).await?.into_inner()) })
        }),
    )
}

/// The [`Submitter`] over `channel` (a remote broker's).
pub fn submitter(channel: TracedChannel) -> Submitter {
    let one = BrokerClient::new(channel.clone());
    let batch = BrokerClient::new(channel);
    Batcher::new(
        Box::new(move |requests| {
            let mut client = batch.clone();
            Box::pin(async move {
                let results = client
                    .submit_network_config_batch(SubmitNetworkConfigBatchRequest { requests })
                    .await?
                    .into_inner()
                    .results;
                Ok(unpack(results, |r| match r.result {
                    Some(submit_network_config_result::Result::Response(response)) => {
                        Some(Ok(response))
                    }
                    Some(submit_network_config_result::Result::Error(error)) => Some(Err(error)),
                    None => None,
                }))
            })
        }),
        Box::new(move |request| {
            let mut client = one.clone();
            Box::pin(async move { Ok(client.submit_network_config(request).await?.into_inner()) })
        }),
    )
}

/// A RelayBatch response's results, from each item's outcome (server side).
pub fn relay_results(results: Vec<Result<RelayResponse, Status>>) -> Vec<RelayResult> {
    results
        .into_iter()
        .map(|r| RelayResult {
            result: Some(match r {
                Ok(response) => relay_result::Result::Response(response),
                Err(status) => relay_result::Result::Error(to_item_error(&status)),
            }),
        })
        .collect()
}

/// A SubmitNetworkConfigBatch response's results, from each item's outcome (server side).
pub fn submit_results(
    results: Vec<Result<SubmitNetworkConfigResponse, Status>>,
) -> Vec<SubmitNetworkConfigResult> {
    results
        .into_iter()
        .map(|r| SubmitNetworkConfigResult {
            result: Some(match r {
                Ok(response) => submit_network_config_result::Result::Response(response),
                Err(status) => submit_network_config_result::Result::Error(to_item_error(&status)),
            }),
        })
        .collect()
}

/// The per-item results of a batch response; `split` opens one result's `oneof`.
fn unpack<R, T>(
    results: Vec<R>,
    split: impl Fn(R) -> Option<Result<T, ItemError>>,
) -> Vec<Result<T, Status>> {
    results
        .into_iter()
        .map(|r| match split(r) {
            Some(Ok(response)) => Ok(response),
            Some(Err(error)) => Err(from_item_error(error)),
            None => Err(missing_result()),
        })
        .collect()
}

/// Batchers by (address, expected cluster), one per remote server, as the channels are.
pub struct Batchers<Req, Resp> {
    cache: Mutex<HashMap<(String, String), Batcher<Req, Resp>>>,
}

impl<Req, Resp> Default for Batchers<Req, Resp> {
    fn default() -> Self {
        Self {
            cache: Mutex::new(HashMap::new()),
        }
    }
}

impl<Req, Resp> std::fmt::Debug for Batchers<Req, Resp> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.cache.lock().map_or(0, |c| c.len());
        f.debug_struct("Batchers").field("servers", &n).finish()
    }
}

impl<Req, Resp> Batchers<Req, Resp> {
    /// The batcher of `key`, made by `make` the first time.
    pub fn get_or_make(
        &self,
        key: (String, String),
        make: impl FnOnce() -> trellis_error::Result<Batcher<Req, Resp>>,
    ) -> trellis_error::Result<Batcher<Req, Resp>> {
        if let Ok(cache) = self.cache.lock()
            && let Some(found) = cache.get(&key)
        {
            return Ok(found.clone());
        }
        let made = make()?;
        Ok(match self.cache.lock() {
            // Another caller may have made one meanwhile: theirs is kept, so that every request
            // to a server queues in one place.
            Ok(mut cache) => cache.entry(key).or_insert(made).clone(),
            Err(_) => made,
        })
    }
}

/// Refuses a batch of more than [`MAX_ITEMS`] items (field `requests`).
pub fn check_len(len: usize) -> Result<(), Status> {
    if len > MAX_ITEMS {
        return Err(Error::invalid(
            "requests",
            format!("holds {len} items; at most {MAX_ITEMS} are allowed"),
        )
        .into());
    }
    Ok(())
}

/// Handles every item with `handle`, concurrently, and returns their results in order.
pub async fn serve<Req, Resp, F, Fut>(items: Vec<Req>, handle: F) -> Vec<Result<Resp, Status>>
where
    F: Fn(Req) -> Fut,
    Fut: Future<Output = Result<Resp, Status>>,
{
    use futures::StreamExt as _;
    // Not `join_all`: below 31 futures it polls every item each time any one is woken, and a
    // batch's items finish one by one as their destinations answer, so each answer re-polled
    // (and entered the span of) every item still waiting. Without that, the hub's CPU per
    // induced tunnel at 100 leaves read 0.095-0.102 ms against 0.102-0.111 ms (five pairs).
    items
        .into_iter()
        .map(handle)
        .collect::<futures::stream::FuturesOrdered<_>>()
        .collect()
        .await
}

/// A whole batch RPC on the server side: refuses more than [`MAX_ITEMS`] items, handles every
/// item with `handle` as its unary call would be, concurrently, and wraps each outcome with
/// `pack` (the response's per-item `oneof`), in order.
pub async fn serve_packed<Req, Resp, E, R, F, Fut>(
    items: Vec<Req>,
    handle: F,
    pack: impl Fn(Result<Resp, ItemError>) -> R,
) -> Result<Vec<R>, Status>
where
    F: Fn(Req) -> Fut,
    Fut: Future<Output = Result<Resp, E>>,
    Status: From<E>,
{
    check_len(items.len())?;
    let results = serve(items, |item| {
        let call = handle(item);
        async move { call.await.map_err(Status::from) }
    })
    .await;
    Ok(results
        .into_iter()
        .map(|r| pack(r.map_err(|status| to_item_error(&status))))
        .collect())
}

/// One call of a client `C` (a generated gRPC client, cheap to clone).
pub type ClientCall<C, Req, Resp> = fn(C, Req) -> BoxFuture<'static, Result<Resp, Status>>;

/// An [`Batcher::unspaced`] batcher over `client` for a service of the same cluster: `one`
/// makes the unary call, `batch` the batch call (its per-item results), and `open` opens one
/// result's `oneof` (`None` when empty).
pub fn unspaced_over<C, Req, Resp, R>(
    client: C,
    one: ClientCall<C, Req, Resp>,
    batch: ClientCall<C, Vec<Req>, Vec<R>>,
    open: fn(R) -> Option<Result<Resp, ItemError>>,
) -> Batcher<Req, Resp>
where
    C: Clone + Send + Sync + 'static,
    Req: Send + 'static,
    Resp: Send + 'static,
    R: Send + 'static,
{
    let batch_client = client.clone();
    Batcher::unspaced(
        Box::new(move |requests| {
            let call = batch(batch_client.clone(), requests);
            Box::pin(async move { Ok(unpack(call.await?, open)) })
        }),
        Box::new(move |request| one(client.clone(), request)),
    )
}

/// An item's error as it travels in a batch response.
pub fn to_item_error(status: &Status) -> ItemError {
    ItemError {
        code: status.code() as i32,
        message: status.message().to_owned(),
    }
}

/// The status an item's error stands for (an unknown code is `Unknown`).
pub fn from_item_error(error: ItemError) -> Status {
    Status::new(Code::from_i32(error.code), error.message)
}

/// A batch result whose `oneof` is empty (a server that set neither field).
pub fn missing_result() -> Status {
    Status::internal("a batch result holds neither a response nor an error")
}

#[cfg(test)]
mod tests;
