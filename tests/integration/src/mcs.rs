//! The driver of the MCS conformance module (`tests/mcs_conformance.rs`): the fixture and the
//! checks of the Multi-Cluster Services API conformance suite (kubernetes-sigs/mcs-api
//! `conformance/`, v0.5.0), reproduced against Trellis.
//!
//! A [`Clusterset`] is two clusters in process, each with its own **fake** Kubernetes API
//! server (`trellis_testkit::FakeApiServer`: the real HTTP protocol, no controllers), its
//! endpoints service on a real etcd serving `clusterset.local` DNS, peered with each other
//! (full peers, tunnels up). Cluster 0 is the exporting cluster, as in the suite.
//!
//! What the suite's fixtures do through Kubernetes controllers, the driver does by hand, and
//! says so: the fake has no Deployment or StatefulSet controller and no EndpointSlice
//! controller, so [`Clusterset::deploy`] writes the `hello` Service and the EndpointSlice the
//! EndpointSlice controller would write for its pods (managed by `endpointslice-controller.k8s.io`,
//! pod IPs in the cluster's pod CIDR). Every wait uses the suite's budget ([`IMPORT_BUDGET`],
//! [`SLICE_BUDGET`], [`HOLD`]).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use serde_json::{Value, json};
use trellis_testkit::{Etcd, FakeApiServer};

use crate::cluster::{InProcessCluster, Options};
use crate::dns::{Dig, Over, dig, serving_flags};
use crate::peering::{eventually, host_at, peer, tunnel_to};

/// The suite's budget for a ServiceImport (or a ServiceExport condition) to appear or go.
pub const IMPORT_BUDGET: Duration = Duration::from_secs(20);
/// The suite's budget for an MCS EndpointSlice to appear (60 s at HEAD, 20 s at v0.5.0).
pub const SLICE_BUDGET: Duration = Duration::from_secs(60);
/// How long the suite holds a presence or absence.
pub const HOLD: Duration = Duration::from_secs(5);
/// The suite's poll of the API.
const POLL: Duration = Duration::from_millis(100);
/// The MCS API version the suite speaks.
pub const MCS: &str = "multicluster.x-k8s.io/v1beta1";
/// The exported Service's name in every spec.
pub const HELLO: &str = "hello";

/// One member cluster.
pub struct Member {
    pub id: String,
    pub api: FakeApiServer,
    _etcd: Etcd,
    pub cluster: InProcessCluster,
    /// Its `clusterset.local` DNS server.
    pub dns: SocketAddr,
    /// Its pod CIDR (distinct per member, as the suite's clusters have).
    pub pods: IpNet,
    client: kube::Client,
}

impl std::fmt::Debug for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Member")
            .field("id", &self.id)
            .field("dns", &self.dns)
            .finish_non_exhaustive()
    }
}

/// Two peered members and the spec's namespace.
#[derive(Debug)]
pub struct Clusterset {
    pub members: Vec<Member>,
    pub namespace: String,
    dig: PathBuf,
}

/// The suite's `hello` Service: ports tcp/42 and udp/42, ClientIP affinity with a 10 s
/// timeout, PreferDualStack, a `dummy-svc` label and annotation.
pub fn hello_service() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": HELLO, "labels": {"dummy-svc": "dummy"},
                     "annotations": {"dummy-svc": "dummy"}},
        "spec": {
            "selector": {"app": "hello"},
            "ports": [{"name": "tcp", "port": 42, "protocol": "TCP"},
                      {"name": "udp", "port": 42, "protocol": "UDP"}],
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 10}},
            "ipFamilyPolicy": "PreferDualStack",
        }
    })
}

/// The suite's `hello` ServiceExport (a `dummy-svcexport` label and annotation, empty spec).
pub fn hello_export() -> Value {
    json!({
        "apiVersion": MCS, "kind": "ServiceExport",
        "metadata": {"name": HELLO, "labels": {"dummy-svcexport": "dummy"},
                     "annotations": {"dummy-svcexport": "dummy"}},
        "spec": {}
    })
}

/// One pod of the `hello` workload: its host number in the member's pod CIDR and, for a
/// StatefulSet's, its hostname.
#[derive(Debug, Clone)]
pub struct Pod {
    pub host: u32,
    pub hostname: Option<String>,
}

/// `n` Deployment pods (no hostnames).
pub fn deployment(n: u32) -> Vec<Pod> {
    (1..=n)
        .map(|i| Pod {
            host: 10 + i,
            hostname: None,
        })
        .collect()
}

/// `n` pods of StatefulSet `hello-ss` (hostnames `hello-ss-0`, ...).
pub fn stateful_set(n: u32) -> Vec<Pod> {
    (0..n)
        .map(|i| Pod {
            host: 20 + i,
            hostname: Some(format!("hello-ss-{i}")),
        })
        .collect()
}

async fn member(index: usize, dual_stack: bool) -> Option<Member> {
    let etcd = Etcd::start_or_skip()?;
    let api = if dual_stack {
        FakeApiServer::start_dual_stack().await
    } else {
        FakeApiServer::start().await
    }
    .expect("fake api server");
    let id = format!("cluster-{index}");
    let dns = SocketAddr::from(([127, 0, 0, 1], trellis_testkit::free_port()));
    let pods = format!("10.{}.0.0/16", 10 + index * 10);
    let options = Options {
        endpoints: true,
        endpoints_store: Some(etcd.url(&format!("/{id}/endpoints"))),
        kubeconfig: Some(api.kubeconfig()),
        endpoints_flags: serving_flags(dns),
        ..Options::default()
    };
    let external = format!("10.{}.0.0/16", 200 + index);
    let cluster = InProcessCluster::start_with(&id, &pods, &external, options)
        .await
        .expect("cluster starts");
    let client = kube::Client::try_from(kube::Config::new(api.url().parse().expect("url")))
        .expect("kube client");
    Some(Member {
        id,
        api,
        _etcd: etcd,
        cluster,
        dns,
        pods: pods.parse().expect("cidr"),
        client,
    })
}

impl Clusterset {
    /// Two members, peered both ways with their tunnels up, and a fresh namespace; `None`
    /// (skipped loudly) without etcd or `dig`.
    pub async fn start() -> Option<Self> {
        Self::start_with(false).await
    }

    /// [`Self::start`] with dual-stack API servers (a Service asking for both families gets an
    /// IPv6 cluster IP too; the pods stay IPv4).
    pub async fn start_dual_stack() -> Option<Self> {
        Self::start_with(true).await
    }

    async fn start_with(dual_stack: bool) -> Option<Self> {
        let dig = trellis_testkit::require_tool("dig")?;
        // The suite's random namespace; the clock's nanoseconds are random enough here.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let namespace = format!("mcs-conformance-{nanos}");
        // The suite creates the namespace on every cluster; the fake has every namespace.
        let c0 = member(0, dual_stack).await?;
        let c1 = member(1, dual_stack).await?;
        peer(&c0.cluster, &c1.cluster).await;
        let limit = Duration::from_secs(60);
        eventually("cluster-0's tunnel to cluster-1", limit, || {
            tunnel_to(&c0.cluster, "cluster-1")
        })
        .await;
        eventually("cluster-1's tunnel to cluster-0", limit, || {
            tunnel_to(&c1.cluster, "cluster-0")
        })
        .await;
        Some(Self {
            members: vec![c0, c1],
            namespace,
            dig,
        })
    }

    /// Member `i`.
    pub fn member(&self, i: usize) -> &Member {
        &self.members[i]
    }

    /// The address of `pod` in member `i`.
    pub fn pod_ip(&self, i: usize, pod: &Pod) -> String {
        host_at(self.members[i].pods, pod.host)
    }

    /// `hello.<ns>.svc.clusterset.local.`
    pub fn fqdn(&self) -> String {
        format!("{HELLO}.{}.svc.clusterset.local.", self.namespace)
    }

    async fn create(&self, i: usize, gv: &str, plural: &str, mut object: Value) -> Value {
        object["metadata"]["namespace"] = json!(self.namespace);
        let kind = object["kind"].as_str().unwrap_or_default().to_owned();
        let (group, version) = gv.split_once('/').unwrap_or(("", gv));
        let resource = kube::api::ApiResource {
            group: group.to_owned(),
            version: version.to_owned(),
            api_version: gv.to_owned(),
            kind,
            plural: plural.to_owned(),
        };
        let api: kube::Api<kube::api::DynamicObject> =
            kube::Api::namespaced_with(self.members[i].client.clone(), &self.namespace, &resource);
        let object: kube::api::DynamicObject = serde_json::from_value(object).expect("an object");
        let created = api
            .create(&kube::api::PostParams::default(), &object)
            .await
            .unwrap_or_else(|e| panic!("creating a {plural} in member {i}: {e}"));
        serde_json::to_value(created).expect("json")
    }

    async fn delete(&self, i: usize, gv: &str, plural: &str, name: &str) {
        let (group, version) = gv.split_once('/').unwrap_or(("", gv));
        let resource = kube::api::ApiResource {
            group: group.to_owned(),
            version: version.to_owned(),
            api_version: gv.to_owned(),
            kind: String::new(),
            plural: plural.to_owned(),
        };
        let api: kube::Api<kube::api::DynamicObject> =
            kube::Api::namespaced_with(self.members[i].client.clone(), &self.namespace, &resource);
        api.delete(name, &kube::api::DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("deleting {plural}/{name} in member {i}: {e}"));
    }

    /// Deploys `service` and its `pods` in member `i`: the Service, and the EndpointSlice
    /// the EndpointSlice controller would write for the pods (the fake runs no controller).
    /// Returns the Service as the API server stored it.
    pub async fn deploy(&self, i: usize, service: Value, pods: &[Pod]) -> Value {
        let created = self.create(i, "v1", "services", service).await;
        let ports: Vec<Value> = created["spec"]["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| {
                let target = p["targetPort"].as_i64().or(p["port"].as_i64());
                json!({"name": p["name"], "port": target, "protocol": p["protocol"]})
            })
            .collect();
        if created["spec"]["type"] != "ExternalName" {
            let endpoints: Vec<Value> = pods
                .iter()
                .map(|pod| {
                    let mut e = json!({
                        "addresses": [self.pod_ip(i, pod)],
                        "conditions": {"ready": true},
                        "nodeName": "node-1",
                    });
                    if let Some(h) = &pod.hostname {
                        e["hostname"] = json!(h);
                    }
                    e
                })
                .collect();
            self.create(
                i,
                "discovery.k8s.io/v1",
                "endpointslices",
                json!({
                    "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                    "metadata": {"name": "hello-k8s",
                                 "labels": {"kubernetes.io/service-name": HELLO,
                                            "endpointslice.kubernetes.io/managed-by":
                                                "endpointslice-controller.k8s.io"}},
                    "addressType": "IPv4",
                    "ports": ports,
                    "endpoints": endpoints,
                }),
            )
            .await;
        }
        created
    }

    /// Creates `export` (a ServiceExport) in member `i`.
    pub async fn export(&self, i: usize, export: Value) {
        self.create(i, MCS, "serviceexports", export).await;
    }

    /// Deletes the ServiceExport `hello` of member `i`.
    pub async fn unexport(&self, i: usize) {
        self.delete(i, MCS, "serviceexports", HELLO).await;
    }

    /// The suite's two-cluster driver, after cluster 0 deployed `service0`: exports it, waits
    /// for its ServiceImport there, waits 1.1 s (so cluster 0's ServiceExport is the older by
    /// the API's second-granularity timestamps), then deploys `service1` in cluster 1 and
    /// exports it with `export1`.
    pub async fn second_exporter(&self, export0: Value, service1: Value, export1: Value) {
        self.export(0, export0).await;
        self.await_import(0, "the ServiceImport in cluster 0", |_| true)
            .await;
        tokio::time::sleep(Duration::from_millis(1100)).await;
        self.deploy(1, service1, &deployment(1)).await;
        self.export(1, export1).await;
    }

    /// The ServiceImport `hello` in member `i`.
    pub fn import(&self, i: usize) -> Option<Value> {
        self.object(i, MCS, "serviceimports", HELLO)
    }

    /// The ServiceExport `hello` in member `i`.
    pub fn export_object(&self, i: usize) -> Option<Value> {
        self.object(i, MCS, "serviceexports", HELLO)
    }

    fn object(&self, i: usize, gv: &str, plural: &str, name: &str) -> Option<Value> {
        self.members[i]
            .api
            .objects(gv, plural, &self.namespace)
            .into_iter()
            .find(|o| o["metadata"]["name"] == name)
    }

    /// The status of condition `kind` of member `i`'s ServiceExport.
    pub fn export_condition(&self, i: usize, kind: &str) -> Option<String> {
        self.export_object(i)?["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == kind)
            .and_then(|c| c["status"].as_str())
            .map(str::to_owned)
    }

    /// Waits (the suite's 20 s) until member `i` holds a ServiceImport `verify` accepts;
    /// returns it.
    pub async fn await_import(
        &self,
        i: usize,
        what: &str,
        verify: impl Fn(&Value) -> bool,
    ) -> Value {
        let start = Instant::now();
        loop {
            let held = self.import(i);
            if let Some(import) = held.as_ref().filter(|v| verify(v)) {
                return import.clone();
            }
            assert!(
                start.elapsed() < IMPORT_BUDGET,
                "{what}: not within {IMPORT_BUDGET:?} in {}; last seen {held:#?}",
                self.members[i].id
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits (20 s) until member `i` holds no ServiceImport.
    pub async fn await_no_import(&self, i: usize, what: &str) {
        let start = Instant::now();
        while let Some(held) = self.import(i) {
            assert!(
                start.elapsed() < IMPORT_BUDGET,
                "{what}: the ServiceImport still exists in {} after {IMPORT_BUDGET:?}: {held:#?}",
                self.members[i].id
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// Holds (5 s) that member `i`'s ServiceImport exists (`present`) or does not.
    pub async fn hold_import(&self, i: usize, present: bool, what: &str) {
        let start = Instant::now();
        while start.elapsed() < HOLD {
            assert_eq!(
                self.import(i).is_some(),
                present,
                "{what}: in {} after {:?}",
                self.members[i].id,
                start.elapsed()
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits (20 s) until condition `kind` of member `i`'s ServiceExport has `status`.
    pub async fn await_condition(&self, i: usize, kind: &str, status: &str) {
        let start = Instant::now();
        loop {
            if self.export_condition(i, kind).as_deref() == Some(status) {
                return;
            }
            assert!(
                start.elapsed() < IMPORT_BUDGET,
                "condition {kind} of the ServiceExport in {} is not {status} within {IMPORT_BUDGET:?}: {:#?}",
                self.members[i].id,
                self.export_object(i)
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// Every MCS EndpointSlice of `hello` in member `i` (both MCS labels, an IPv4 address
    /// type, at least one endpoint), as the suite finds them.
    pub fn mcs_slices(&self, i: usize) -> Vec<Value> {
        self.members[i]
            .api
            .objects("discovery.k8s.io/v1", "endpointslices", &self.namespace)
            .into_iter()
            .filter(|s| {
                let labels = &s["metadata"]["labels"];
                labels["multicluster.kubernetes.io/service-name"].is_string()
                    && labels["multicluster.kubernetes.io/source-cluster"].is_string()
                    && s["addressType"] == "IPv4"
                    && s["endpoints"].as_array().is_some_and(|e| !e.is_empty())
            })
            .collect()
    }

    /// The ports of member `i`'s MCS EndpointSlices of `hello` by source cluster, as
    /// kube-proxy would match them to the ServiceImport's (derived Service's) ports by name:
    /// {cluster: [(port name, endpoint port)]}, sorted.
    pub fn slice_ports(&self, i: usize) -> BTreeMap<String, Vec<(String, i64)>> {
        let mut out: BTreeMap<String, Vec<(String, i64)>> = BTreeMap::new();
        for slice in self.mcs_slices(i) {
            let cluster = slice["metadata"]["labels"]["multicluster.kubernetes.io/source-cluster"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let ports = out.entry(cluster).or_default();
            for p in slice["ports"].as_array().into_iter().flatten() {
                ports.push((
                    p["name"].as_str().unwrap_or_default().to_owned(),
                    p["port"].as_i64().unwrap_or_default(),
                ));
            }
            ports.sort();
        }
        out
    }

    /// Waits (the suite's 60 s) until member `i` holds MCS EndpointSlices that `verify`
    /// accepts (each of them).
    pub async fn await_mcs_slices(&self, i: usize, verify: impl Fn(&Value) -> bool) -> Vec<Value> {
        let start = Instant::now();
        loop {
            let slices = self.mcs_slices(i);
            if !slices.is_empty() && slices.iter().all(&verify) {
                return slices;
            }
            assert!(
                start.elapsed() < SLICE_BUDGET,
                "no fitting MCS EndpointSlice in {} within {SLICE_BUDGET:?}: {slices:#?}",
                self.members[i].id
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// Asks member `i`'s DNS for `name` `qtype` with `dig`.
    pub async fn dig(&self, i: usize, name: &str, qtype: &str) -> Dig {
        let (bin, server) = (self.dig.clone(), self.members[i].dns);
        let (name, qtype) = (name.to_owned(), qtype.to_owned());
        tokio::task::spawn_blocking(move || dig(&bin, None, server, &name, &qtype, Over::Udp))
            .await
            .expect("dig task")
    }

    /// Asks until the answer section (sorted record data) equals `want` (the suite's DNS
    /// budget: 20 s, a probe a second).
    pub async fn await_answers(&self, i: usize, name: &str, qtype: &str, want: &[String]) {
        let mut want = want.to_vec();
        want.sort();
        let start = Instant::now();
        loop {
            let got = self.dig(i, name, qtype).await;
            if got.answers == want {
                return;
            }
            assert!(
                start.elapsed() < IMPORT_BUDGET,
                "{name} {qtype} at {}: want {want:?}, got {got:?}",
                self.members[i].id
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

/// `ports` of a ServiceImport or Service as the suite compares them: (name, protocol, port,
/// appProtocol), sorted by lower-cased name.
pub fn mcs_ports(ports: &Value) -> Vec<(String, String, i64, Option<String>)> {
    let mut out: Vec<_> = ports
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            (
                p["name"].as_str().unwrap_or_default().to_owned(),
                p["protocol"].as_str().unwrap_or("TCP").to_owned(),
                p["port"].as_i64().unwrap_or_default(),
                p["appProtocol"].as_str().map(str::to_owned),
            )
        })
        .collect();
    out.sort_by_key(|p| p.0.to_lowercase());
    out
}

/// A ServiceImport's clusterset IPs (`spec.ips`), in order.
pub fn clusterset_ips(import: &Value) -> Vec<String> {
    import["spec"]["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|ip| ip.as_str().map(str::to_owned))
        .collect()
}

/// A string map of an object (labels, annotations).
pub fn string_map(value: &Value) -> BTreeMap<String, String> {
    value
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
        .collect()
}
