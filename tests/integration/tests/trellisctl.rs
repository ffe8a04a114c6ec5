//! The built `trellisctl` binary against a real topology: a hub and two leaves with identical pod
//! CIDRs, in process with memory stores (the endpoints service only on the hub, except in the
//! export test: hub and leaf-a). Every step goes
//! through the CLI as an operator would type it: `token`, `peer`, `status --output json` until
//! the induced mesh shows, `ipam`, `ipam map`, `endpoints` and `endpoints reflect`, `export` / `unexport` with the
//! peer's import listed by `endpoints` and bad input refused naming the field, `unpeer`, and
//! the errors (unreachable service, gRPC error, usage); and the TLS flags against a peer
//! listener. Needs `cargo build --bins` first.

use std::net::SocketAddr;
use std::process::Output;
use std::time::Duration;

use ipnet::IpNet;
use serde_json::Value;
use trellis_api::peers::Condition;
use trellis_integration::cluster::InProcessCluster;
use trellis_testkit::eventually;

const LIMIT: Duration = Duration::from_secs(60);

/// Environment variables trellisctl reads; cleared so the caller's shell cannot leak in.
const TRELLIS_ENV: &[&str] = &[
    "TRELLIS_DISCOVERY",
    "TRELLIS_BROKER",
    "TRELLIS_FORWARDER",
    "TRELLIS_IPAM",
    "TRELLIS_ENDPOINTS",
    "TRELLIS_GATEWAY",
    "TRELLIS_OUTPUT",
    "TRELLIS_TIMEOUT",
    "TRELLIS_REMOTE_BROKER",
    "TRELLIS_PEER_TOKEN",
    "TRELLISCTL_TLS_CA_CERT",
    "TRELLISCTL_TLS_CERT",
    "TRELLISCTL_TLS_KEY",
];

/// Runs the built binary with `args`.
async fn ctl(args: &[&str]) -> Output {
    let binary = trellis_integration::bin_path("trellisctl").expect("trellisctl is built");
    let mut command = tokio::process::Command::new(binary);
    for var in TRELLIS_ENV {
        command.env_remove(var);
    }
    command.args(args).output().await.expect("trellisctl runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `args` and expects success; returns stdout.
async fn ok(args: &[&str]) -> String {
    let out = ctl(args).await;
    assert!(
        out.status.success(),
        "trellisctl {args:?} exited with {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Runs `args` with `--output json` and expects success and one JSON document.
async fn json(args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["--output", "json"]);
    let stdout = ok(&all).await;
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{stdout}"))
}

/// The global flags pointing trellisctl at `cluster`; its endpoints service at `endpoints`.
fn flags(cluster: &InProcessCluster, endpoints: SocketAddr) -> Vec<String> {
    let s = &cluster.services;
    [
        ("--discovery", s.discovery),
        ("--broker", s.broker),
        ("--forwarder", s.forwarder),
        ("--ipam", s.ipam),
        ("--endpoints", endpoints),
        ("--gateway", s.gateway),
    ]
    .iter()
    .flat_map(|(flag, addr)| [(*flag).to_owned(), addr.to_string()])
    .chain(["--timeout".to_owned(), "5".to_owned()])
    .collect()
}

fn with<'a>(flags: &'a [String], args: &[&'a str]) -> Vec<&'a str> {
    args.iter()
        .copied()
        .chain(flags.iter().map(String::as_str))
        .collect()
}

/// Polls `status --output json` until `check` accepts it.
async fn status_until(flags: &[String], what: &str, check: impl Fn(&Value) -> bool) -> Value {
    eventually(what, LIMIT, || async {
        let status = json(&with(flags, &["status"])).await;
        if check(&status) {
            Ok(status)
        } else {
            Err(format!("status\n{status:#}"))
        }
    })
    .await
}

/// The item of a JSON array whose `key` (a string, or an identity's `cluster_id`) is `id`.
fn find<'a>(list: &'a Value, key: &str, id: &str) -> Option<&'a Value> {
    list.as_array()?
        .iter()
        .find(|item| item[key] == id || item[key]["cluster_id"] == id)
}

fn foreign<'a>(status: &'a Value, id: &str) -> Option<&'a Value> {
    find(&status["foreign_clusters"], "cluster_id", id)
}

fn tunnel_endpoint<'a>(status: &'a Value, remote: &str) -> Option<&'a Value> {
    find(&status["tunnel_endpoints"], "remote", remote)
}

fn is_full_peer(status: &Value, id: &str) -> bool {
    foreign(status, id).is_some_and(|fc| fc["kind"] == "full" && fc["peered"] == true)
}

/// Induced ForeignCluster introduced by `hub` and an induced TunnelEndpoint built through it.
fn is_induced_with_tunnel(status: &Value, id: &str, hub: &str) -> bool {
    foreign(status, id)
        .is_some_and(|fc| fc["kind"] == "induced" && fc["origin"]["cluster_id"] == hub)
        && tunnel_endpoint(status, id)
            .is_some_and(|te| te["kind"] == "induced" && te["via"]["cluster_id"] == hub)
}

/// A port nothing listens on.
fn dead_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
    listener.local_addr().expect("addr")
}

/// The address with `host`'s host bits in `net`.
fn at(net: &str, host: &str) -> String {
    let net: IpNet = net.parse().expect("cidr");
    let host: std::net::Ipv4Addr = host.parse().expect("ip");
    match net {
        IpNet::V4(v4) => {
            let mask = u32::from(v4.netmask());
            std::net::Ipv4Addr::from(u32::from(v4.network()) | (u32::from(host) & !mask))
                .to_string()
        }
        IpNet::V6(_) => panic!("IPv4 only"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_builds_and_inspects_an_induced_mesh_with_trellisctl() {
    let hub = InProcessCluster::start_with_endpoints("hub", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("hub starts");
    let a = InProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("leaf-a starts");
    let c = InProcessCluster::start("leaf-c", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("leaf-c starts");
    // The leaves run no endpoints service: status must still work there.
    let hub_flags = flags(&hub, hub.services.endpoints);
    let a_flags = flags(&a, dead_addr());
    let c_flags = flags(&c, dead_addr());

    // token: the table form is the token alone; JSON carries the same one.
    let token = ok(&with(&hub_flags, &["token"])).await;
    let token = token.trim_end_matches('\n');
    assert!(!token.is_empty() && !token.contains('\n'), "{token:?}");
    let token_json = json(&with(&hub_flags, &["token"])).await;
    assert_eq!(token_json["token"], token);
    assert_eq!(token_json["rotated"], false);

    // A wrong token is the broker's PERMISSION_DENIED, exit code 1.
    let hub_broker = hub.services.broker.to_string();
    let refused = ctl(&with(
        &a_flags,
        &[
            "peer",
            "--remote-broker",
            &hub_broker,
            "--token",
            "not-the-hub-token-at-all",
        ],
    ))
    .await;
    assert_eq!(refused.status.code(), Some(1));
    let stderr = text(&refused.stderr);
    assert!(
        stderr.starts_with("error: the broker at ")
            && stderr.contains("failed Peer: PERMISSION_DENIED"),
        "{stderr}"
    );

    // peer: both leaves with the hub, once in each output format.
    let peered = ok(&with(
        &a_flags,
        &["peer", "--remote-broker", &hub_broker, "--token", token],
    ))
    .await;
    assert!(peered.starts_with("peered with hub at "), "{peered}");
    // leaf-c joins with a join token: it expires, it is listed, it can be revoked.
    let join = json(&with(
        &hub_flags,
        &[
            "token",
            "--join",
            "--ttl",
            "1h",
            "--description",
            "for leaf-c",
        ],
    ))
    .await;
    let join_token = join["token"].as_str().expect("a join token").to_owned();
    assert_ne!(join_token, token);
    assert!(
        join["join"].as_str().is_some_and(
            |c| c.starts_with("trellisctl peer --remote-broker ") && c.contains(&join_token)
        ),
        "{join}"
    );
    let join_id = join["join_token_id"].as_str().expect("an id").to_owned();
    assert!(join_token.starts_with(&format!("{join_id}.")), "{join}");
    let listed = json(&with(&hub_flags, &["token", "--list"])).await;
    assert_eq!(listed["join_tokens"][0]["id"], join_id.as_str());
    assert_eq!(listed["join_tokens"][0]["description"], "for leaf-c");
    assert!(
        !listed.to_string().contains(&join_token),
        "the list shows a secret: {listed}"
    );
    let peered = json(&with(
        &c_flags,
        &[
            "peer",
            "--remote-broker",
            &hub_broker,
            "--token",
            &join_token,
        ],
    ))
    .await;
    assert_eq!(peered["identity"]["cluster_id"], "hub");
    assert_eq!(peered["addresses"]["broker"], hub_broker);
    let revoked = ok(&with(&hub_flags, &["token", "--revoke", &join_id])).await;
    assert_eq!(revoked, format!("revoked join token {join_id}\n"));
    let listed = json(&with(&hub_flags, &["token", "--list"])).await;
    assert_eq!(listed["join_tokens"], serde_json::json!([]));

    // status: the hub sees both leaves as full peers...
    let hub_status = status_until(&hub_flags, "the hub to see both leaves full", |s| {
        is_full_peer(s, "leaf-a")
            && is_full_peer(s, "leaf-c")
            && tunnel_endpoint(s, "leaf-a").is_some_and(|te| te["kind"] == "full")
            && tunnel_endpoint(s, "leaf-c").is_some_and(|te| te["kind"] == "full")
    })
    .await;
    assert_eq!(hub_status["identity"]["cluster_id"], "hub");
    assert_eq!(
        find(&hub_status["services"], "service", "endpoints").map(|s| &s["health"]),
        Some(&Value::from("serving"))
    );
    // ...and each leaf sees the other as induced, introduced by the hub, with a tunnel endpoint.
    let a_status = status_until(&a_flags, "leaf-a to see leaf-c induced", |s| {
        is_full_peer(s, "hub") && is_induced_with_tunnel(s, "leaf-c", "hub")
    })
    .await;
    status_until(&c_flags, "leaf-c to see leaf-a induced", |s| {
        is_induced_with_tunnel(s, "leaf-a", "hub")
    })
    .await;
    // Identical pod CIDRs: leaf-a addresses leaf-c through a remapped range.
    let te = tunnel_endpoint(&a_status, "leaf-c").expect("tunnel endpoint");
    assert_eq!(te["remote_pod_cidr"], "10.0.0.0/16");
    assert_ne!(te["remote_pod_cidr_nat"], "10.0.0.0/16");
    // The leaf's endpoints service is down: reported, not fatal.
    let endpoints_health = find(&a_status["services"], "service", "endpoints").expect("listed");
    assert_eq!(endpoints_health["health"], "unreachable");
    assert!(
        endpoints_health["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("connection refused")),
        "{endpoints_health}"
    );
    // The in-process gateway runs with --dataplane none and no broker feed: no tunnels, mode none.
    assert_eq!(a_status["gateway"]["mode"], "none");
    assert_eq!(a_status["tunnels"], Value::Array(vec![]));
    assert_eq!(a_status["unavailable"], Value::Array(vec![]));

    // The table form of the same.
    let table = ok(&with(&a_flags, &["status"])).await;
    for expected in [
        "Foreign clusters (discovery)",
        "leaf-c",
        "induced",
        "note: no data plane",
    ] {
        assert!(
            table.contains(expected),
            "missing {expected:?} in:\n{table}"
        );
    }

    // status with the gateway down: still exit 0, the section says why.
    let mut no_gateway = a_flags.clone();
    let dead_gateway = dead_addr().to_string();
    let at_gateway = no_gateway
        .iter()
        .position(|f| f == "--gateway")
        .expect("flag")
        + 1;
    no_gateway[at_gateway].clone_from(&dead_gateway);
    let partial = json(&with(&no_gateway, &["status"])).await;
    assert!(partial["tunnels"].is_null());
    assert!(partial["foreign_clusters"].is_array());
    assert!(
        partial["unavailable"]
            .as_array()
            .is_some_and(|u| u.iter().any(|p| {
                p["service"] == "gateway"
                    && p["error"].as_str().is_some_and(|e| {
                        e.contains(&format!("cannot reach the gateway at {dead_gateway}"))
                    })
            })),
        "{partial:#}"
    );

    // ipam: local subnets and both remote clusters, remapped.
    let ipam = json(&with(&a_flags, &["ipam"])).await;
    assert_eq!(ipam["local"]["pod_cidr"], "10.0.0.0/16");
    assert_eq!(ipam["local"]["external_cidr"], "10.201.0.0/16");
    for remote in ["hub", "leaf-c"] {
        let record = find(&ipam["clusters"], "cluster_id", remote).expect("a mapping");
        assert_eq!(record["remote_pod_cidr"], "10.0.0.0/16", "{record}");
        assert_ne!(record["remote_pod_cidr_nat"], "10.0.0.0/16", "{record}");
        assert!(
            record["local_pod_cidr_nat"]
                .as_str()
                .is_some_and(|s| !s.is_empty())
        );
    }
    // ipam map: a local pod, as the hub addresses leaf-a.
    let hub_view_of_a =
        find(&ipam["clusters"], "cluster_id", "hub").expect("hub")["local_pod_cidr_nat"]
            .as_str()
            .expect("cidr")
            .to_owned();
    let mapped = json(&with(
        &a_flags,
        &["ipam", "map", "--cluster-id", "hub", "--ip", "10.0.3.7"],
    ))
    .await;
    assert_eq!(mapped["path"], "local_nat");
    assert_eq!(mapped["mapped_ip"], at(&hub_view_of_a, "10.0.3.7"));

    // endpoints: nothing reflected to the hub; reflecting a hub pod to leaf-a uses leaf-a's
    // view of the hub.
    let listed = json(&with(&hub_flags, &["endpoints"])).await;
    assert_eq!(listed["reflected_slices"], Value::Array(vec![]));
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("slice.json");
    std::fs::write(
        &file,
        serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "web-1", "namespace": "shop",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.9.9"], "conditions": {"ready": true}}],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]
        })
        .to_string(),
    )
    .expect("writes");
    let file = file.to_str().expect("utf-8 path");
    let reflected = json(&with(
        &hub_flags,
        &["endpoints", "reflect", "--target", "leaf-a", "--file", file],
    ))
    .await;
    let hub_ipam = json(&with(&hub_flags, &["ipam"])).await;
    let a_view_of_hub =
        find(&hub_ipam["clusters"], "cluster_id", "leaf-a").expect("leaf-a")["local_pod_cidr_nat"]
            .as_str()
            .expect("cidr")
            .to_owned();
    assert_eq!(reflected["translations"][0]["path"], "local_nat");
    assert_eq!(
        reflected["translations"][0]["translated_address"],
        at(&a_view_of_hub, "10.0.9.9")
    );
    assert_eq!(reflected["delivered"], false);

    // unpeer: the hub drops leaf-c; leaf-a loses its induced peer and tunnel endpoint.
    let unpeered = json(&with(&hub_flags, &["unpeer", "leaf-c"])).await;
    assert_eq!(unpeered["unpeered"], true);
    status_until(&a_flags, "leaf-a to drop leaf-c", |s| {
        tunnel_endpoint(s, "leaf-c").is_none()
            && foreign(s, "leaf-c").is_none_or(|fc| {
                fc["conditions"].as_array().is_some_and(|cs| {
                    cs.iter().any(|c| {
                        c["type"] == Condition::Withdrawn.as_str() && c["status"] == "True"
                    })
                })
            })
    })
    .await;
    // The withdrawn record (a tombstone until discovery's --tombstone-retention passes) is
    // hidden from `status` and shown by `status --all`.
    let shown = json(&with(&a_flags, &["status"])).await;
    assert!(
        foreign(&shown, "leaf-c").is_none(),
        "status hides withdrawn records:\n{shown:#}"
    );
    let all = json(&with(&a_flags, &["status", "--all"])).await;
    assert!(
        foreign(&all, "leaf-c").is_some_and(|fc| {
            fc["conditions"].as_array().is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == Condition::Withdrawn.as_str() && c["status"] == "True")
            })
        }),
        "status --all shows the withdrawn record:\n{all:#}"
    );
    let again = ok(&with(&hub_flags, &["unpeer", "leaf-c"])).await;
    assert_eq!(again, "leaf-c was not peered; nothing to do\n");

    // An unreachable service: exit code 1 and a message naming it, the cause and the flag.
    let dead = dead_addr();
    let out = ctl(&["token", "--broker", &dead.to_string()]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    assert_eq!(
        text(&out.stderr),
        format!(
            "error: cannot reach the broker at {dead}: connection refused \
             (is trellis-broker running? set --broker)\n"
        )
    );
    // Nothing at all answers: status prints what it found, then fails.
    let dead_flags: Vec<String> = [
        "--discovery",
        "--broker",
        "--forwarder",
        "--ipam",
        "--endpoints",
        "--gateway",
    ]
    .iter()
    .flat_map(|f| [(*f).to_owned(), dead_addr().to_string()])
    .collect();
    let out = ctl(&with(&dead_flags, &["status"])).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stdout).contains("unreachable"));
    assert!(text(&out.stderr).contains("error: no service of the cluster answered"));
    // Usage errors: exit code 2, nothing sent.
    let out = ctl(&["peer", "--remote-broker", &hub_broker]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--token"));

    hub.stop().await;
    a.stop().await;
    c.stop().await;
}

/// Runs `args` expecting the endpoints service's INVALID_ARGUMENT naming `field`: exit code 1.
async fn refused(args: &[&str], field: &str) {
    let out = ctl(args).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    assert!(
        stderr.contains("INVALID_ARGUMENT") && stderr.contains(field),
        "{args:?} must be refused naming {field}: {stderr}"
    );
}

/// The slices `flags`' cluster imported, as `trellisctl endpoints -o json` lists them.
async fn imports(flags: &[String]) -> Vec<Value> {
    let listed = json(&with(flags, &["endpoints"])).await;
    listed["reflected_slices"]
        .as_array()
        .expect("reflected_slices")
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trellisctl_exports_a_service_that_the_peer_lists_as_an_import_and_unexports_it() {
    let hub = InProcessCluster::start_with_endpoints("hub", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("hub starts");
    let a = InProcessCluster::start_with_endpoints("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("leaf-a starts");
    let hub_flags = flags(&hub, hub.services.endpoints);
    let a_flags = flags(&a, a.services.endpoints);
    trellis_integration::peering::peer(&a, &hub).await;
    status_until(&a_flags, "leaf-a peered with the hub", |s| {
        is_full_peer(s, "hub")
    })
    .await;

    let exported = json(&with(
        &hub_flags,
        &[
            "export",
            "web",
            "--namespace",
            "shop",
            "--port",
            "8080",
            "--endpoint",
            "10.0.9.9",
            "--endpoint",
            "10.0.9.10",
        ],
    ))
    .await;
    assert_eq!(exported["namespace"], "shop");
    assert_eq!(exported["name"], "web");
    assert_eq!(exported["ports"][0]["port"], 8080);
    assert_eq!(exported["endpoints"][1]["address"], "10.0.9.10");

    let import = eventually("leaf-a to import shop/web", LIMIT, || async {
        imports(&a_flags)
            .await
            .into_iter()
            .find(|s| s["source"]["cluster_id"] == "hub")
    })
    .await;
    // leaf-a imported it at the addresses it uses for the hub's pods (known to the hub once it
    // translated for leaf-a).
    let hub_ipam = json(&with(&hub_flags, &["ipam"])).await;
    let a_view_of_hub =
        find(&hub_ipam["clusters"], "cluster_id", "leaf-a").expect("leaf-a")["local_pod_cidr_nat"]
            .as_str()
            .expect("cidr")
            .to_owned();
    assert_eq!(import["slice"]["namespace"], "shop");
    assert_eq!(import["slice"]["service_name"], "web");
    assert_eq!(import["slice"]["ports"][0]["port"], 8080);
    let addresses: Vec<&str> = import["slice"]["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .filter_map(|e| e["addresses"][0].as_str())
        .collect();
    assert_eq!(
        addresses,
        vec![
            at(&a_view_of_hub, "10.0.9.9").as_str(),
            at(&a_view_of_hub, "10.0.9.10").as_str()
        ]
    );
    // The exporter lists its export and where it went; both render as a table too.
    let listed = json(&with(&hub_flags, &["endpoints"])).await;
    assert_eq!(
        listed["exports"].as_array().map(Vec::len),
        Some(1),
        "{listed:#}"
    );
    assert_eq!(listed["exports"][0]["name"], "web");
    assert_eq!(listed["exports"][0]["reflected_to"][0], "leaf-a");
    assert!(
        ok(&with(&hub_flags, &["endpoints"]))
            .await
            .contains("10.0.9.10")
    );
    assert!(
        ok(&with(&a_flags, &["endpoints"]))
            .await
            .contains(&at(&a_view_of_hub, "10.0.9.10"))
    );

    // Bad input: INVALID_ARGUMENT naming the field, exit code 1, nothing stored.
    let bad: &[(&[&str], &str)] = &[
        (
            &[
                "export",
                "api",
                "-n",
                "shop",
                "--port",
                "80",
                "--endpoint",
                "192.168.7.7",
            ],
            "endpoints[0].address",
        ),
        (
            &[
                "export",
                "api",
                "-n",
                "shop",
                "--port",
                "80",
                "--endpoint",
                "10.0.9.300",
            ],
            "endpoints[0].address",
        ),
        (
            &[
                "export",
                "api",
                "-n",
                "shop",
                "--port",
                "80",
                "--endpoint",
                "not-an-ip",
            ],
            "endpoints[0].address",
        ),
        (
            &[
                "export",
                "api",
                "-n",
                "shop",
                "--port",
                "70000",
                "--endpoint",
                "10.0.9.9",
            ],
            "ports[0].port",
        ),
        (
            &[
                "export",
                "api",
                "-n",
                "shop",
                "--port",
                "0",
                "--endpoint",
                "10.0.9.9",
            ],
            "ports[0].port",
        ),
        (
            &[
                "export",
                "api",
                "-n",
                "Shop_1",
                "--port",
                "80",
                "--endpoint",
                "10.0.9.9",
            ],
            "namespace",
        ),
        (
            &[
                "export",
                "api.v1",
                "-n",
                "shop",
                "--port",
                "80",
                "--endpoint",
                "10.0.9.9",
            ],
            "name",
        ),
        (&["unexport", "web", "--namespace=Shop.x"], "namespace"),
    ];
    for (args, field) in bad {
        refused(&with(&hub_flags, args), field).await;
    }
    let listed = json(&with(&hub_flags, &["endpoints"])).await;
    assert_eq!(
        listed["exports"].as_array().map(Vec::len),
        Some(1),
        "{listed:#}"
    );
    assert_eq!(listed["exports"][0]["name"], "web");
    // A usage error (no --port) is clap's: exit code 2.
    let out = ctl(&with(&hub_flags, &["export", "api", "-n", "shop"])).await;
    assert_eq!(out.status.code(), Some(2));

    let unexported = json(&with(
        &hub_flags,
        &["unexport", "web", "--namespace", "shop"],
    ))
    .await;
    assert_eq!(unexported["unexported"], true);
    let again = ok(&with(
        &hub_flags,
        &["unexport", "web", "--namespace", "shop"],
    ))
    .await;
    assert_eq!(again, "shop/web was not exported\n");
    let listed = json(&with(&hub_flags, &["endpoints"])).await;
    assert_eq!(listed["exports"], Value::Array(vec![]));
    eventually("leaf-a to drop shop/web", LIMIT, || async {
        imports(&a_flags).await.is_empty().then_some(())
    })
    .await;

    hub.stop().await;
    a.stop().await;
}

/// Writes `contents` to `name` in `dir`; returns the path as text.
fn file(dir: &tempfile::TempDir, name: &str, contents: &str) -> String {
    let path = dir.path().join(name);
    std::fs::write(&path, contents).expect("writes");
    path.display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trellisctl_calls_a_peer_listener_over_tls_with_a_peers_certificate() {
    let hub = InProcessCluster::start_tls("hub", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("hub starts");
    let a = InProcessCluster::start_tls("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    let hub_flags = flags(&hub, hub.services.endpoints);
    let token = ok(&with(&hub_flags, &["token"])).await;
    let a_flags = flags(&a, a.services.endpoints);
    let hub_tls = hub.tls.as_ref().expect("tls");
    ok(&with(
        &a_flags,
        &[
            "peer",
            "--remote-broker",
            &hub_tls.broker.to_string(),
            "--token",
            token.trim(),
        ],
    ))
    .await;
    // How leaf-a addresses the hub's pods, once the peering is up.
    let status = status_until(&a_flags, "A's tunnel to the hub", |s| {
        tunnel_endpoint(s, "hub").is_some()
    })
    .await;
    let a_view_hub = tunnel_endpoint(&status, "hub").expect("tunnel")["remote_pod_cidr_nat"]
        .as_str()
        .expect("cidr")
        .to_owned();

    let dir = tempfile::tempdir().expect("tempdir");
    let hub_ca = file(&dir, "hub-ca.pem", hub_tls.ca.cert_pem());
    let a_ca = a.tls.as_ref().expect("tls").ca.cert_pem().to_owned();
    let a_ca = file(&dir, "a-ca.pem", &a_ca);
    let issued = a
        .tls
        .as_ref()
        .expect("tls")
        .ca
        .issue("trellisctl")
        .expect("cert");
    let a_cert = file(&dir, "a.pem", &issued.cert_pem);
    let a_key = file(&dir, "a-key.pem", issued.key_pem());
    let hub_ipam = hub_tls.ipam.to_string();
    let map = [
        "ipam",
        "map",
        "--cluster-id",
        "leaf-a",
        "--ip",
        "10.0.0.7",
        "--induced",
    ];

    // As leaf-a (a full peer of the hub), over TLS to the hub's peer listener: answered, and
    // the address is how leaf-a reaches that hub pod.
    let mut args = vec![
        "--ipam",
        &hub_ipam,
        "--tls-ca-cert",
        &hub_ca,
        "--tls-cert",
        &a_cert,
        "--tls-key",
        &a_key,
    ];
    args.extend(map);
    args.extend(["--output", "json"]);
    // The hub's IPAM pins leaf-a's CA once its trust sync sees the peering in the hub's
    // discovery (one watch event after the handshake; the IPAM may have started before
    // discovery listened): until then the TLS handshake is refused.
    let mapped: Value = eventually("trellisctl over TLS to succeed", LIMIT, || async {
        let out = ctl(&args).await;
        if out.status.success() {
            Ok(serde_json::from_slice(&out.stdout).expect("json"))
        } else {
            Err(text(&out.stderr))
        }
    })
    .await;
    assert_eq!(mapped["path"], "local_nat", "{mapped}");
    assert_eq!(mapped["mapped_ip"], at(&a_view_hub, "10.0.0.7"), "{mapped}");

    // Without a client certificate the peer listener refuses the method.
    let mut args = vec!["--ipam", &hub_ipam, "--tls-ca-cert", &hub_ca];
    args.extend(map);
    let out = ctl(&args).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("PERMISSION_DENIED"),
        "{}",
        text(&out.stderr)
    );

    // A server whose certificate does not chain to the given CA is not talked to.
    let mut args = vec![
        "--ipam",
        &hub_ipam,
        "--tls-ca-cert",
        &a_ca,
        "--tls-cert",
        &a_cert,
        "--tls-key",
        &a_key,
    ];
    args.extend(map);
    let out = ctl(&args).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("cannot reach the IPAM"), "{stderr}");

    // Plaintext to a TLS listener fails too, and a certificate needs the CA flag (usage, 2).
    let mut args = vec!["--ipam", &hub_ipam];
    args.extend(map);
    assert_eq!(ctl(&args).await.status.code(), Some(1));
    let mut args = vec![
        "--ipam",
        &hub_ipam,
        "--tls-cert",
        &a_cert,
        "--tls-key",
        &a_key,
    ];
    args.extend(map);
    assert_eq!(ctl(&args).await.status.code(), Some(2));
}
