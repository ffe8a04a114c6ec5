//! [`FakeApiServer`]: a small **fake** of the Kubernetes API server for tests, speaking the real
//! HTTP/JSON protocol on a loopback port, so the kube client and kube-runtime watchers run
//! unmodified against it (ADR 0019). Nothing here is a Kubernetes API server: it stores JSON
//! objects per (group/version, resource, namespace, name) and implements the verbs and the
//! concurrency rules Trellis relies on:
//!
//! - GET one object; LIST (one namespace or all) with `labelSelector` (`k=v`, `k==v`, `k!=v`,
//!   `k`, `!k`; set-based selectors are refused with 400);
//! - POST (409 `AlreadyExists`), PUT with `metadata.resourceVersion` (409 `Conflict` on a
//!   mismatch, 404 when absent), PUT on `/status` (only `status` changes; a PUT of the object
//!   keeps the stored `status`, a POST drops it, as for resources with a status subresource),
//!   DELETE with `preconditions` (`uid`, `resourceVersion`; 409 on a mismatch);
//! - WATCH (`?watch=true&resourceVersion=N`): chunked JSON lines `ADDED`/`MODIFIED`/`DELETED`
//!   from the history after N (all objects as `ADDED` when N is empty or 0), then live ones;
//!   an N older than the compacted history answers an `ERROR` event with a 410 `Expired`
//!   Status; `timeoutSeconds` ends the stream;
//! - one monotonic resourceVersion for every object, `uid`, `creationTimestamp`, `generation`;
//! - a core `Service` created without `spec.clusterIP` (and not `ExternalName` or headless
//!   `None`) gets one, with `spec.clusterIPs` and `spec.ipFamilies`, from `10.96.0.0/12`, as the
//!   real API server's allocator does: never reused, so a Service deleted and created again gets
//!   another IP. In a dual-stack fake ([`FakeApiServer::start_dual_stack`]) a Service asking for
//!   both families gets an IPv6 one too. A PUT that leaves them out keeps the assigned ones; one
//!   that changes them is refused with 422 (the field is immutable).
//!
//! Not modelled: authentication and authorization, admission (defaulting, validation, webhooks),
//! field selectors (400), server-side apply and PATCH (405), discovery (`/api`, `/apis`: 404;
//! kube's typed `Api` never asks), paging (`limit` is ignored, everything is one page),
//! bookmarks, finalizers and garbage collection (owner references), namespace lifecycle (any
//! namespace exists), generateName, CRD registration (any group and resource is accepted).

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use futures::StreamExt as _;
use http::StatusCode;
use serde_json::{Value, json};
use tokio::sync::broadcast;
use tokio_stream::wrappers::TcpListenerStream;

/// Events kept for watches resuming from an older resourceVersion.
const HISTORY: usize = 10_000;

/// Where Services get their cluster IPs: `10.96.0.0/12`, kubeadm's default service CIDR.
const SERVICE_CIDR: &str = "10.96.0.0/12";
const FIRST_SERVICE_IP: u32 = u32::from_be_bytes([10, 96, 0, 1]);
const SERVICE_IPS: u32 = 1 << 20;
/// A dual-stack cluster's IPv6 cluster IPs: `fd00:10:96::/108`.
const FIRST_SERVICE_IP6: u128 = 0xfd00_0010_0096_0000_0000_0000_0000_0000;

/// (group/version, resource, namespace or "", name).
type Key = (String, String, String, String);

#[derive(Debug, Clone)]
struct Event {
    rv: u64,
    kind: &'static str,
    key: Key,
    object: Value,
}

#[derive(Debug, Default)]
struct State {
    rv: u64,
    uid: u64,
    objects: BTreeMap<Key, Value>,
    history: VecDeque<Event>,
    /// Watches from a resourceVersion below this answer 410.
    floor: u64,
    requests: u64,
    /// Cluster IPs handed out so far.
    service_ips: u32,
    /// A dual-stack cluster: a Service asking for both families gets an IPv6 cluster IP too.
    dual_stack: bool,
}

/// Whether `target` is the core Services resource (not its `/status`).
fn is_service(target: &Target) -> bool {
    target.gv == "v1" && target.resource == "services" && !target.status
}

/// The cluster IP of a Service object, when it has one set.
fn cluster_ip(object: &Value) -> Option<&str> {
    object
        .pointer("/spec/clusterIP")
        .and_then(Value::as_str)
        .filter(|ip| !ip.is_empty())
}

impl State {
    /// Gives a new Service its cluster IP, as the API server's allocator does; headless
    /// (`None`) and `ExternalName` Services get none. `Some` is the refusal to answer.
    fn assign_cluster_ip(&mut self, object: &mut Value) -> Option<Response> {
        if object.pointer("/spec/type").and_then(Value::as_str) == Some("ExternalName")
            || cluster_ip(object).is_some()
        {
            return None;
        }
        if self.service_ips >= SERVICE_IPS - 2 {
            return Some(status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                format!("the fake API server's service CIDR {SERVICE_CIDR} is exhausted"),
            ));
        }
        let ip = std::net::Ipv4Addr::from(FIRST_SERVICE_IP + self.service_ips).to_string();
        self.service_ips += 1;
        if !object["spec"].is_object() {
            object["spec"] = json!({});
        }
        let policy = object
            .pointer("/spec/ipFamilyPolicy")
            .and_then(Value::as_str)
            .unwrap_or("SingleStack");
        let (ips, families) = if self.dual_stack && policy != "SingleStack" {
            let v6 = std::net::Ipv6Addr::from(FIRST_SERVICE_IP6 + u128::from(self.service_ips));
            (json!([ip, v6.to_string()]), json!(["IPv4", "IPv6"]))
        } else {
            (json!([ip]), json!(["IPv4"]))
        };
        object["spec"]["clusterIP"] = json!(ip);
        object["spec"]["clusterIPs"] = ips;
        object["spec"]["ipFamilies"] = families;
        if object.pointer("/spec/ipFamilyPolicy").is_none() {
            object["spec"]["ipFamilyPolicy"] = json!("SingleStack");
        }
        None
    }
}

/// A PUT of a Service keeps the cluster IPs the API server assigned (when the update leaves
/// them out) and refuses to change them (`Some`: the refusal to answer).
fn keep_cluster_ip(stored: &Value, object: &mut Value) -> Option<Response> {
    // Nothing assigned, nothing to keep.
    let held = cluster_ip(stored)?;
    match cluster_ip(object) {
        None => {
            if !object["spec"].is_object() {
                object["spec"] = json!({});
            }
            object["spec"]["clusterIP"] = stored["spec"]["clusterIP"].clone();
            object["spec"]["clusterIPs"] = stored["spec"]["clusterIPs"].clone();
            None
        }
        Some(given) if given == held => {
            if object
                .pointer("/spec/clusterIPs")
                .is_none_or(Value::is_null)
            {
                object["spec"]["clusterIPs"] = stored["spec"]["clusterIPs"].clone();
            }
            None
        }
        Some(given) => Some(status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            format!("spec.clusterIP: Invalid value: \"{given}\": field is immutable"),
        )),
    }
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    events: broadcast::Sender<Event>,
}

/// A fake Kubernetes API server on `127.0.0.1` (see the module documentation for what it does
/// and does not model). Stopped when dropped.
#[derive(Debug)]
pub struct FakeApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    dir: tempfile::TempDir,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

fn status(code: StatusCode, reason: &str, message: impl Into<String>) -> Response {
    let body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message.into(),
        "reason": reason,
        "code": code.as_u16(),
    });
    json_response(code, &body)
}

fn json_response(code: StatusCode, body: &Value) -> Response {
    Response::builder()
        .status(code)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap_or_default()
}

/// The parsed path of a request.
#[derive(Debug)]
struct Target {
    gv: String,
    resource: String,
    /// `None`: all namespaces (or a cluster-scoped resource).
    namespace: Option<String>,
    name: Option<String>,
    status: bool,
}

fn parse_path(path: &str) -> Option<Target> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (gv, rest) = match parts.as_slice() {
        ["api", v, rest @ ..] => ((*v).to_owned(), rest),
        ["apis", g, v, rest @ ..] => (format!("{g}/{v}"), rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some((*ns).to_owned()), rest),
        _ => (None, rest),
    };
    let (resource, name, status) = match rest {
        [resource] => (*resource, None, false),
        [resource, name] => (*resource, Some((*name).to_owned()), false),
        [resource, name, "status"] => (*resource, Some((*name).to_owned()), true),
        _ => return None,
    };
    Some(Target {
        gv,
        resource: resource.to_owned(),
        namespace,
        name,
        status,
    })
}

/// One requirement of an equality-based label selector.
#[derive(Debug)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    Absent(String),
}

fn parse_selector(text: &str) -> Result<Vec<Requirement>, String> {
    let mut out = Vec::new();
    for term in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        if term.contains(" in ") || term.contains(" notin ") || term.contains('(') {
            return Err(format!(
                "set-based selector {term:?} is not supported by the fake"
            ));
        }
        let requirement = if let Some((k, v)) = term.split_once("!=") {
            Requirement::NotEquals(k.trim().to_owned(), v.trim().to_owned())
        } else if let Some((k, v)) = term.split_once("==") {
            Requirement::Equals(k.trim().to_owned(), v.trim().to_owned())
        } else if let Some((k, v)) = term.split_once('=') {
            Requirement::Equals(k.trim().to_owned(), v.trim().to_owned())
        } else if let Some(k) = term.strip_prefix('!') {
            Requirement::Absent(k.trim().to_owned())
        } else {
            Requirement::Exists(term.to_owned())
        };
        out.push(requirement);
    }
    Ok(out)
}

fn matches(selector: &[Requirement], object: &Value) -> bool {
    let label = |k: &str| {
        object
            .pointer("/metadata/labels")
            .and_then(|l| l.get(k))
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    selector.iter().all(|r| match r {
        Requirement::Equals(k, v) => label(k).as_deref() == Some(v.as_str()),
        Requirement::NotEquals(k, v) => label(k).as_deref() != Some(v.as_str()),
        Requirement::Exists(k) => label(k).is_some(),
        Requirement::Absent(k) => label(k).is_none(),
    })
}

fn query(request: &Request) -> BTreeMap<String, String> {
    request
        .uri()
        .query()
        .map(|q| {
            q.split('&')
                .filter_map(|pair| {
                    let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                    Some((decode(k)?, decode(v)?))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Percent-decoding of one query component (`+` is a space).
fn decode(text: &str) -> Option<String> {
    let mut out = Vec::with_capacity(text.len());
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = text.get(i + 1..i + 3)?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // Civil-from-days (Howard Hinnant), enough for a creationTimestamp.
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

impl Shared {
    fn record(&self, state: &mut State, kind: &'static str, key: Key, object: Value) {
        let event = Event {
            rv: state.rv,
            kind,
            key,
            object,
        };
        state.history.push_back(event.clone());
        while state.history.len() > HISTORY {
            if let Some(old) = state.history.pop_front() {
                state.floor = old.rv;
            }
        }
        // No receiver is fine: nobody watches.
        let _ = self.events.send(event);
    }

    fn handle(self: &Arc<Self>, request: Request, body: Option<Value>) -> Response {
        let Some(target) = parse_path(request.uri().path()) else {
            return status(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!(
                    "the fake API server does not serve {}",
                    request.uri().path()
                ),
            );
        };
        let params = query(&request);
        if params.get("fieldSelector").is_some_and(|f| !f.is_empty()) {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "field selectors are not modelled by the fake",
            );
        }
        let mut state = match self.state.lock() {
            Ok(state) => state,
            Err(poisoned) => poisoned.into_inner(),
        };
        state.requests += 1;
        let method = request.method().clone();
        match (method.as_str(), &target.name) {
            ("GET", Some(name)) => {
                let key = key(&target, name);
                match state.objects.get(&key) {
                    Some(object) => json_response(StatusCode::OK, object),
                    None => not_found(&target, name),
                }
            }
            ("GET", None) => {
                let selector =
                    match parse_selector(params.get("labelSelector").map_or("", String::as_str)) {
                        Ok(s) => s,
                        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", e),
                    };
                if matches!(params.get("watch").map(String::as_str), Some("true" | "1")) {
                    drop(state);
                    return self.watch(&target, selector, &params);
                }
                let items: Vec<Value> = state
                    .objects
                    .iter()
                    .filter(|(k, v)| in_scope(&target, k) && matches(&selector, v))
                    .map(|(_, v)| v.clone())
                    .collect();
                json_response(
                    StatusCode::OK,
                    &json!({
                        "kind": "List",
                        "apiVersion": target.gv,
                        "metadata": {"resourceVersion": state.rv.to_string()},
                        "items": items,
                    }),
                )
            }
            ("POST", None) => {
                let Some(mut object) = body else {
                    return status(StatusCode::BAD_REQUEST, "BadRequest", "no JSON body");
                };
                let Some(name) = object
                    .pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
                else {
                    return status(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "Invalid",
                        "metadata.name: Required value (generateName is not modelled)",
                    );
                };
                let key = key(&target, &name);
                if state.objects.contains_key(&key) {
                    return status(
                        StatusCode::CONFLICT,
                        "AlreadyExists",
                        format!("{} \"{name}\" already exists", target.resource),
                    );
                }
                if is_service(&target)
                    && let Some(refused) = state.assign_cluster_ip(&mut object)
                {
                    return refused;
                }
                state.rv += 1;
                state.uid += 1;
                if let Some(o) = object.as_object_mut() {
                    o.remove("status");
                }
                let rv = state.rv;
                let uid = format!("00000000-fake-0000-0000-{:012}", state.uid);
                let meta = &mut object["metadata"];
                meta["resourceVersion"] = json!(rv.to_string());
                meta["uid"] = json!(uid);
                meta["creationTimestamp"] = json!(now_rfc3339());
                meta["generation"] = json!(1);
                if let Some(ns) = &target.namespace {
                    meta["namespace"] = json!(ns);
                }
                state.objects.insert(key.clone(), object.clone());
                self.record(&mut state, "ADDED", key, object.clone());
                json_response(StatusCode::CREATED, &object)
            }
            ("PUT", Some(name)) => {
                let Some(mut object) = body else {
                    return status(StatusCode::BAD_REQUEST, "BadRequest", "no JSON body");
                };
                let key = key(&target, name);
                let Some(stored) = state.objects.get(&key).cloned() else {
                    return not_found(&target, name);
                };
                let given = object
                    .pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let held = stored
                    .pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                if !given.is_empty() && given != held {
                    return status(
                        StatusCode::CONFLICT,
                        "Conflict",
                        format!(
                            "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                            target.resource
                        ),
                    );
                }
                if is_service(&target)
                    && let Some(refused) = keep_cluster_ip(&stored, &mut object)
                {
                    return refused;
                }
                let mut updated = stored.clone();
                if target.status {
                    updated["status"] = object.get("status").cloned().unwrap_or(Value::Null);
                } else {
                    if let (Some(o), Some(s)) = (object.as_object_mut(), stored.get("status")) {
                        o.insert("status".into(), s.clone());
                    } else if let Some(o) = object.as_object_mut() {
                        o.remove("status");
                    }
                    for field in ["uid", "creationTimestamp", "namespace", "name"] {
                        object["metadata"][field] = stored["metadata"][field].clone();
                    }
                    let generation = stored
                        .pointer("/metadata/generation")
                        .and_then(Value::as_i64)
                        .unwrap_or(1);
                    object["metadata"]["generation"] = json!(generation + 1);
                    updated = object;
                }
                if updated == stored {
                    return json_response(StatusCode::OK, &stored);
                }
                state.rv += 1;
                updated["metadata"]["resourceVersion"] = json!(state.rv.to_string());
                state.objects.insert(key.clone(), updated.clone());
                self.record(&mut state, "MODIFIED", key, updated.clone());
                json_response(StatusCode::OK, &updated)
            }
            ("DELETE", Some(name)) => {
                let key = key(&target, name);
                let Some(stored) = state.objects.get(&key).cloned() else {
                    return not_found(&target, name);
                };
                let pre = body
                    .as_ref()
                    .and_then(|b| b.get("preconditions"))
                    .cloned()
                    .unwrap_or(Value::Null);
                for (field, path) in [
                    ("uid", "/metadata/uid"),
                    ("resourceVersion", "/metadata/resourceVersion"),
                ] {
                    if let Some(want) = pre.get(field).and_then(Value::as_str)
                        && stored.pointer(path).and_then(Value::as_str) != Some(want)
                    {
                        return status(
                            StatusCode::CONFLICT,
                            "Conflict",
                            format!(
                                "Precondition failed: {field} in precondition: {want}, {field} in object meta: {}",
                                stored.pointer(path).and_then(Value::as_str).unwrap_or("")
                            ),
                        );
                    }
                }
                state.objects.remove(&key);
                state.rv += 1;
                let mut gone = stored;
                gone["metadata"]["resourceVersion"] = json!(state.rv.to_string());
                self.record(&mut state, "DELETED", key, gone.clone());
                json_response(StatusCode::OK, &gone)
            }
            _ => status(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                format!("{method} is not modelled by the fake API server"),
            ),
        }
    }

    fn watch(
        self: &Arc<Self>,
        target: &Target,
        selector: Vec<Requirement>,
        params: &BTreeMap<String, String>,
    ) -> Response {
        let from = params
            .get("resourceVersion")
            .filter(|v| !v.is_empty())
            .map(|v| v.parse::<u64>())
            .transpose();
        let Ok(from) = from else {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "resourceVersion is not a number",
            );
        };
        let timeout = params
            .get("timeoutSeconds")
            .and_then(|t| t.parse::<u64>().ok())
            .unwrap_or(1800);
        let (backlog, live) = {
            let state = match self.state.lock() {
                Ok(state) => state,
                Err(poisoned) => poisoned.into_inner(),
            };
            // Subscribed under the lock: no event falls between the backlog and the live feed.
            let live = self.events.subscribe();
            let backlog: Vec<Value> = match from {
                None | Some(0) => state
                    .objects
                    .iter()
                    .filter(|(k, v)| in_scope(target, k) && matches(&selector, v))
                    .map(|(_, v)| json!({"type": "ADDED", "object": v}))
                    .collect(),
                Some(n) if n < state.floor => vec![json!({
                    "type": "ERROR",
                    "object": {
                        "kind": "Status", "apiVersion": "v1", "metadata": {},
                        "status": "Failure", "reason": "Expired", "code": 410,
                        "message": format!("too old resource version: {n} ({})", state.floor),
                    }
                })],
                Some(n) => state
                    .history
                    .iter()
                    .filter(|e| {
                        e.rv > n && in_scope(target, &e.key) && matches(&selector, &e.object)
                    })
                    .map(|e| json!({"type": e.kind, "object": e.object}))
                    .collect(),
            };
            (backlog, live)
        };
        let expired = backlog.first().is_some_and(|e| e["type"] == "ERROR");
        let scope = (
            target.gv.clone(),
            target.resource.clone(),
            target.namespace.clone(),
        );
        // A watcher that fell too far behind loses its stream (and resumes from its last
        // resourceVersion, which the history serves) instead of silently missing events.
        let live = tokio_stream::wrappers::BroadcastStream::new(live)
            .take_while(|event| futures::future::ready(event.is_ok()))
            .filter_map(move |event| {
                let line = event.ok().filter(|e| {
                    e.key.0 == scope.0
                        && e.key.1 == scope.1
                        && scope.2.as_ref().is_none_or(|ns| *ns == e.key.2)
                        && matches(&selector, &e.object)
                });
                let line = line.map(|e| json!({"type": e.kind, "object": e.object}));
                async move { line }
            });
        let lines = futures::stream::iter(backlog).chain(if expired {
            futures::stream::empty().boxed()
        } else {
            live.boxed()
        });
        // timeoutSeconds bounds the whole watch, as on a real API server.
        let lines = lines
            .take_until(tokio::time::sleep(Duration::from_secs(timeout.max(1))))
            .map(|line| Ok::<_, std::io::Error>(format!("{line}\n")));
        Response::builder()
            .status(StatusCode::OK)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Body::from_stream(lines))
            .unwrap_or_default()
    }
}

fn key(target: &Target, name: &str) -> Key {
    (
        target.gv.clone(),
        target.resource.clone(),
        target.namespace.clone().unwrap_or_default(),
        name.to_owned(),
    )
}

fn in_scope(target: &Target, key: &Key) -> bool {
    key.0 == target.gv
        && key.1 == target.resource
        && target.namespace.as_ref().is_none_or(|ns| *ns == key.2)
}

fn not_found(target: &Target, name: &str) -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{} \"{name}\" not found", target.resource),
    )
}

impl FakeApiServer {
    /// Where Services get their cluster IPs (see the module documentation).
    pub const SERVICE_CIDR: &'static str = SERVICE_CIDR;

    /// Starts a fake API server on a free loopback port.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with(false).await
    }

    /// A dual-stack cluster's: a Service whose `ipFamilyPolicy` is `PreferDualStack` or
    /// `RequireDualStack` gets an IPv4 and an IPv6 cluster IP (`fd00:10:96::/108`), as a
    /// dual-stack API server gives it; others one IPv4 address.
    pub async fn start_dual_stack() -> anyhow::Result<Self> {
        Self::start_with(true).await
    }

    async fn start_with(dual_stack: bool) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the fake API server")?;
        let addr = listener.local_addr()?;
        let (events, _) = broadcast::channel(HISTORY);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                dual_stack,
                ..State::default()
            }),
            events,
        });
        let handler = {
            let shared = shared.clone();
            move |request: Request| {
                let shared = shared.clone();
                async move {
                    let (parts, body) = request.into_parts();
                    let bytes = axum::body::to_bytes(body, 64 * 1024 * 1024)
                        .await
                        .unwrap_or_default();
                    let json = if bytes.is_empty() {
                        None
                    } else {
                        match serde_json::from_slice::<Value>(&bytes) {
                            Ok(v) => Some(v),
                            Err(e) => {
                                return status(
                                    StatusCode::BAD_REQUEST,
                                    "BadRequest",
                                    format!("body is not JSON: {e}"),
                                );
                            }
                        }
                    };
                    shared.handle(Request::from_parts(parts, Body::empty()), json)
                }
            }
        };
        let router = axum::Router::new().fallback(handler);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .accept_http1(true)
                .add_routes(tonic::service::Routes::from(router))
                .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async move {
                    let _ = stopped.await;
                })
                .await;
            if let Err(e) = served {
                eprintln!("fake API server stopped: {e}");
            }
        });
        let dir = tempfile::tempdir()?;
        let this = Self {
            addr,
            shared,
            stop: Some(stop),
            dir,
        };
        std::fs::write(this.kubeconfig(), this.kubeconfig_text())?;
        Ok(this)
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A kubeconfig file pointing at it (namespace `default`, no credentials).
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    fn kubeconfig_text(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\nusers:\n- name: fake\n  user: {{}}\ncurrent-context: fake\n",
            self.url()
        )
    }

    /// The directory holding the kubeconfig (removed when the fake is dropped).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Every stored object of `resource` in `group_version` (`"v1"`, `"discovery.k8s.io/v1"`)
    /// and `namespace`, ordered by name: what a test asserts on.
    pub fn objects(&self, group_version: &str, resource: &str, namespace: &str) -> Vec<Value> {
        let state = match self.shared.state.lock() {
            Ok(state) => state,
            Err(poisoned) => poisoned.into_inner(),
        };
        state
            .objects
            .iter()
            .filter(|(k, _)| k.0 == group_version && k.1 == resource && k.2 == namespace)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// How many requests it answered (watch streams count once).
    pub fn requests(&self) -> u64 {
        match self.shared.state.lock() {
            Ok(state) => state.requests,
            Err(poisoned) => poisoned.into_inner().requests,
        }
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        match self.shared.state.lock() {
            Ok(state) => state.rv,
            Err(poisoned) => poisoned.into_inner().rv,
        }
    }

    /// Forgets the watch history: a watch resuming from an older resourceVersion gets 410.
    pub fn compact(&self) {
        let mut state = match self.shared.state.lock() {
            Ok(state) => state,
            Err(poisoned) => poisoned.into_inner(),
        };
        state.history.clear();
        state.floor = state.rv + 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_selectors() {
        let t = parse_path("/apis/discovery.k8s.io/v1/namespaces/shop/endpointslices/web-1")
            .expect("parses");
        assert_eq!(
            (t.gv.as_str(), t.resource.as_str()),
            ("discovery.k8s.io/v1", "endpointslices")
        );
        assert_eq!(t.namespace.as_deref(), Some("shop"));
        assert_eq!(t.name.as_deref(), Some("web-1"));
        let t = parse_path("/api/v1/services").expect("parses");
        assert_eq!((t.namespace, t.name), (None, None));
        let t = parse_path("/api/v1/namespaces/shop").expect("parses");
        assert_eq!(
            (t.resource.as_str(), t.name.as_deref()),
            ("namespaces", Some("shop"))
        );
        let s = parse_selector("a=b,c!=d,e,!f").expect("parses");
        let o = json!({"metadata": {"labels": {"a": "b", "e": "x"}}});
        assert!(matches(&s, &o));
        let o = json!({"metadata": {"labels": {"a": "b", "c": "d", "e": "x"}}});
        assert!(!matches(&s, &o));
        assert!(parse_selector("a in (b)").is_err());
        assert_eq!(decode("a%3Db%2Cc").as_deref(), Some("a=b,c"));
    }
}
