//! `clusterset.local` DNS asked with a real resolver client (Debian's `dig`), over UDP and TCP:
//! hub B and leaves A and C in process with their endpoints services, C's serving the zone
//! (`--dns-listen`). A Service A exports becomes a name at C that answers the addresses C uses
//! to reach A's ready pods directly (the induced peering), with SRV records whose targets
//! resolve too; an unexported name is NXDOMAIN, a name outside the zone is refused, and
//! garbage datagrams do not stop the server answering.

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use ipnet::IpNet;
use trellis_api::pb::endpoints::UnexportServiceRequest;
use trellis_integration::cluster::{InProcessCluster, Options};
use trellis_integration::dns::{Over, dig, serving_flags};
use trellis_integration::peering::{eventually, host_at, peer, tunnel_to};
use trellis_testkit::exports::export_request;

const LIMIT: Duration = Duration::from_secs(60);
const NAME: &str = "web.shop.svc.clusterset.local.";

/// Sends `n` A queries for [`NAME`] to `server` without waiting, then counts the answers that
/// arrive within a second of the last; returns (sent, answered).
fn flood(server: SocketAddr, n: u16) -> (usize, usize) {
    use hickory_proto::op::{Message, MessageType, OpCode, Query};
    use hickory_proto::rr::{Name, RecordType};
    let socket = UdpSocket::bind("127.0.0.1:0").expect("binds");
    socket
        .set_read_timeout(Some(Duration::from_millis(1000)))
        .expect("timeout");
    let name = Name::from_ascii(NAME).expect("name");
    let mut sent = 0;
    for id in 0..n {
        let mut query = Message::new();
        query
            .set_id(id)
            .set_message_type(MessageType::Query)
            .set_op_code(OpCode::Query)
            .set_recursion_desired(true)
            .add_query(Query::query(name.clone(), RecordType::A));
        let bytes = query.to_vec().expect("encodes");
        if socket.send_to(&bytes, server).is_ok() {
            sent += 1;
        }
    }
    let mut answered = 0;
    let mut buf = [0u8; 4096];
    while socket.recv_from(&mut buf).is_ok() {
        answered += 1;
    }
    (sent, answered)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exported_service_resolves_at_an_induced_consumer_by_name_and_goes_with_its_export() {
    let Some(dig_bin) = trellis_testkit::require_tool("dig") else {
        return;
    };
    let dns = SocketAddr::from(([127, 0, 0, 1], trellis_testkit::free_port()));
    let b = InProcessCluster::start_with_endpoints("hub-b", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("b starts");
    let a = InProcessCluster::start_with_endpoints("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    let c = InProcessCluster::start_with(
        "leaf-c",
        "10.0.0.0/16",
        "10.201.0.0/16",
        Options {
            endpoints: true,
            endpoints_flags: serving_flags(dns),
            ..Options::default()
        },
    )
    .await
    .expect("c starts");
    peer(&a, &b).await;
    peer(&c, &b).await;
    let c_to_a = eventually("C's induced tunnel to A", LIMIT, || tunnel_to(&c, "leaf-a")).await;
    // And A's to C: the hub translates A's export for C directly only once A holds its side of
    // the induced peering; before that it takes the hub path until the next resend.
    eventually("A's induced tunnel to C", LIMIT, || tunnel_to(&a, "leaf-c")).await;
    let c_view_a: IpNet = c_to_a.remote_pod_cidr_nat.parse().expect("cidr");
    let ask_over = |name: &str, qtype: &str, over: Over| {
        let (bin, name, qtype) = (dig_bin.clone(), name.to_owned(), qtype.to_owned());
        async move {
            tokio::task::spawn_blocking(move || dig(&bin, None, dns, &name, &qtype, over))
                .await
                .expect("dig task")
        }
    };
    let ask = |name: &str, qtype: &str, tcp: bool| {
        ask_over(name, qtype, if tcp { Over::Tcp } else { Over::Udp })
    };

    // Nothing exported yet: the name does not exist, and the negative answer carries the SOA.
    let nothing = eventually("C's zone is built", LIMIT, || async {
        let d = ask(NAME, "A", false).await;
        (d.status != "SERVFAIL").then_some(d)
    })
    .await;
    assert_eq!(nothing.status, "NXDOMAIN", "{nothing:?}");
    assert_eq!(nothing.authority, ["SOA"], "{nothing:?}");

    // A exports two pods, one not ready: C answers the ready one, at its direct view of A.
    let mut a_mapper = a.endpoints().await.expect("connects");
    a_mapper
        .export_service(export_request(
            "shop",
            "web",
            &[("10.0.0.7".into(), true), ("10.0.0.8".into(), false)],
        ))
        .await
        .expect("exports");
    let pod = host_at(c_view_a, 7);
    trellis_testkit::eventually_eq(
        "the name answers A's ready pod as C reaches it",
        LIMIT,
        vec![pod.clone()],
        || async { ask(NAME, "A", false).await.answers },
    )
    .await;
    let over_tcp = ask(NAME, "A", true).await;
    assert_eq!(
        (over_tcp.status.as_str(), over_tcp.answers.clone()),
        ("NOERROR", vec![pod.clone()])
    );
    let upper = ask("WEB.SHOP.svc.ClusterSet.Local.", "A", false).await;
    assert_eq!(
        upper.answers,
        vec![pod.clone()],
        "names are case-insensitive"
    );

    // SRV: the port, and a target that resolves to the pod.
    let target = format!("{}.leaf-a.{NAME}", pod.replace('.', "-"));
    let srv = ask(NAME, "SRV", false).await;
    assert_eq!(srv.answers, vec![format!("0 100 8080 {target}")], "{srv:?}");
    let named = ask(&format!("_http._tcp.{NAME}"), "SRV", true).await;
    assert_eq!(named.answers, srv.answers);
    assert_eq!(ask(&target, "A", false).await.answers, vec![pod.clone()]);

    // An IPv4-only service has no AAAA (NODATA, not NXDOMAIN); other zones are refused.
    let aaaa = ask(NAME, "AAAA", false).await;
    assert_eq!(
        (aaaa.status.as_str(), aaaa.answers.len()),
        ("NOERROR", 0),
        "{aaaa:?}"
    );
    assert_eq!(
        ask("db.shop.svc.clusterset.local.", "A", false)
            .await
            .status,
        "NXDOMAIN"
    );
    assert_eq!(
        ask("web.shop.svc.cluster.local.", "A", false).await.status,
        "REFUSED"
    );

    // Garbage and an oversized datagram are dropped or refused; the server keeps answering.
    let socket = UdpSocket::bind("127.0.0.1:0").expect("binds");
    for datagram in [vec![0xffu8; 3], vec![0x42; 12], vec![0u8; 65_000]] {
        let _ = socket.send_to(&datagram, dns);
    }
    assert_eq!(ask(NAME, "A", false).await.answers, vec![pod.clone()]);

    // A flood: 20,000 queries as fast as one socket sends them, no waiting for answers. The
    // server answers what it can (the rest is dropped), and afterwards answers as before.
    let (sent, answered) = tokio::task::spawn_blocking(move || flood(dns, 20_000))
        .await
        .expect("flood task");
    eprintln!("measured: flood of {sent} queries, {answered} answers received");
    assert!(answered > 0, "no answer during the flood");
    assert_eq!(ask(NAME, "A", false).await.answers, vec![pod.clone()]);
    assert_eq!(ask(NAME, "SRV", true).await.status, "NOERROR");

    // The pod that was not ready becomes ready: both answer.
    a_mapper
        .export_service(export_request(
            "shop",
            "web",
            &[("10.0.0.7".into(), true), ("10.0.0.8".into(), true)],
        ))
        .await
        .expect("exports");
    let mut both = vec![pod.clone(), host_at(c_view_a, 8)];
    both.sort();
    trellis_testkit::eventually_eq("the name follows readiness", LIMIT, both, || async {
        ask(NAME, "A", false).await.answers
    })
    .await;

    // Scaled to 150 pods: the UDP answer (1232 bytes at most) is truncated, and a resolver
    // that asks again over TCP gets them all.
    let many: Vec<(String, bool)> = (10..160).map(|h| (format!("10.0.0.{h}"), true)).collect();
    a_mapper
        .export_service(export_request("shop", "web", &many))
        .await
        .expect("exports");
    let mut all: Vec<String> = (10..160).map(|h| host_at(c_view_a, h)).collect();
    all.sort();
    trellis_testkit::eventually_eq("150 pods answer", LIMIT, all, || async {
        ask(NAME, "A", false).await.answers
    })
    .await;
    let truncated = ask_over(NAME, "A", Over::UdpOnly).await;
    assert!(
        truncated.flags.split(' ').any(|f| f == "tc"),
        "{truncated:?}"
    );
    assert!(truncated.answers.len() < 150, "{truncated:?}");

    // Unexported: the name goes.
    a_mapper
        .unexport_service(UnexportServiceRequest {
            namespace: "shop".into(),
            name: "web".into(),
        })
        .await
        .expect("unexports");
    trellis_testkit::eventually_eq(
        "the name goes with the export",
        LIMIT,
        "NXDOMAIN".to_owned(),
        || async { ask(NAME, "A", false).await.status },
    )
    .await;
}

/// The same answers, then kill -9 of the consumer's endpoints service (the DNS server with it)
/// while a resolver keeps asking: every answer it gets is the right one or none, answers resume
/// once the service is back, and an export withdrawn while it was down is gone from the zone
/// it rebuilds (nothing stale), all with real processes on real etcds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_resume_after_kill_9_of_the_dns_and_nothing_stale_is_answered() {
    use trellis_integration::processes::{Options as ProcessOptions, ProcessCluster, Service};
    let (Some(dig_bin), Some(_)) = (
        trellis_testkit::require_tool("dig"),
        trellis_testkit::require_tool("etcd"),
    ) else {
        return;
    };
    let dns = SocketAddr::from(([127, 0, 0, 1], trellis_testkit::free_port()));
    let consumer = ProcessOptions {
        endpoints_flags: serving_flags(dns),
        ..ProcessOptions::default()
    };
    let (b, a, c) = tokio::join!(
        ProcessCluster::start("hub-b", "10.0.0.0/16", "10.201.0.0/16"),
        ProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16"),
        ProcessCluster::start_with("leaf-c", "10.0.0.0/16", "10.201.0.0/16", consumer),
    );
    let (b, a, mut c) = (
        b.expect("b starts").expect("etcd"),
        a.expect("a starts").expect("etcd"),
        c.expect("c starts").expect("etcd"),
    );
    peer(&a, &b).await;
    peer(&c, &b).await;
    let c_to_a = eventually("C's induced tunnel to A", LIMIT, || tunnel_to(&c, "leaf-a")).await;
    // And A's to C: the hub translates A's export for C directly only once A holds its side of
    // the induced peering; before that it takes the hub path until the next resend.
    eventually("A's induced tunnel to C", LIMIT, || tunnel_to(&a, "leaf-c")).await;
    let pod = host_at(c_to_a.remote_pod_cidr_nat.parse().expect("cidr"), 7);
    let ask = || {
        let bin = dig_bin.clone();
        async move {
            tokio::task::spawn_blocking(move || dig(&bin, None, dns, NAME, "A", Over::Udp))
                .await
                .expect("dig task")
        }
    };
    let mut a_mapper = a.endpoints().await.expect("connects");
    a_mapper
        .export_service(export_request("shop", "web", &[("10.0.0.7".into(), true)]))
        .await
        .expect("exports");
    trellis_testkit::eventually_eq("C answers A's pod", LIMIT, vec![pod.clone()], || async {
        ask().await.answers
    })
    .await;

    // A resolver asking every 100 ms through the kill and the restart.
    let stop = trellis_runtime::Shutdown::new();
    let asking = {
        let (stop, bin) = (stop.clone(), dig_bin.clone());
        tokio::spawn(async move {
            let mut seen = Vec::new();
            while !stop.is_cancelled() {
                let bin = bin.clone();
                let d =
                    tokio::task::spawn_blocking(move || dig(&bin, None, dns, NAME, "A", Over::Udp))
                        .await
                        .expect("dig task");
                seen.push((d.status, d.answers));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            seen
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    c.kill9(Service::Endpoints).expect("kill -9");
    tokio::time::sleep(Duration::from_secs(2)).await;
    c.restart(Service::Endpoints).await.expect("restarts");
    trellis_testkit::eventually_eq("answers resume", LIMIT, vec![pod.clone()], || async {
        ask().await.answers
    })
    .await;
    stop.cancel();
    let seen = asking.await.expect("the resolver task");
    let unanswered = seen
        .iter()
        .filter(|(status, _)| status == "NO ANSWER")
        .count();
    assert!(unanswered > 0, "the kill was not seen: {seen:?}");
    for (status, answers) in &seen {
        assert!(
            status == "NO ANSWER"
                || status == "SERVFAIL"
                || (status == "NOERROR" && *answers == [pod.clone()]),
            "a wrong answer around the restart: {status} {answers:?}"
        );
    }

    // Withdrawn while C's DNS is down: after the restart the name is gone, not answered from
    // what the dead process knew.
    c.kill9(Service::Endpoints).expect("kill -9");
    a_mapper
        .unexport_service(UnexportServiceRequest {
            namespace: "shop".into(),
            name: "web".into(),
        })
        .await
        .expect("unexports");
    c.restart(Service::Endpoints).await.expect("restarts");
    trellis_testkit::eventually_eq(
        "the withdrawn name is gone after the restart",
        LIMIT,
        "NXDOMAIN".to_owned(),
        || async { ask().await.status },
    )
    .await;
}

/// On the Kubernetes path, in dual-stack clusters: a Service exported with both families gets a
/// clusterset IP per family in every cluster (the derived Service asks for both), in order in
/// the ServiceImport's `ips` and `ipFamilies`, and the name answers each: A the IPv4 one, AAAA
/// the IPv6 one (asked with dig; the API servers are fakes, dual-stack).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dual_stack_import_has_a_clusterset_ip_per_family_answered_as_a_and_aaaa() {
    use trellis_integration::mcs::{
        Clusterset, clusterset_ips, deployment, hello_export, hello_service,
    };
    let Some(set) = Clusterset::start_dual_stack().await else {
        return;
    };
    let stored = set.deploy(0, hello_service(), &deployment(1)).await;
    assert_eq!(
        stored["spec"]["ipFamilies"],
        serde_json::json!(["IPv4", "IPv6"]),
        "the exported Service is dual-stack: {stored:#}"
    );
    set.export(0, hello_export()).await;
    for i in 0..2 {
        let import = set
            .await_import(i, "one clusterset IP per family", |imp| {
                imp["spec"]["ips"]
                    .as_array()
                    .is_some_and(|ips| ips.len() == 2)
            })
            .await;
        assert_eq!(
            import["spec"]["ipFamilies"],
            serde_json::json!(["IPv4", "IPv6"]),
            "{import:#}"
        );
        let ips = clusterset_ips(&import);
        assert!(ips[0].parse::<std::net::Ipv4Addr>().is_ok(), "{ips:?}");
        assert!(ips[1].parse::<std::net::Ipv6Addr>().is_ok(), "{ips:?}");
        set.await_answers(i, &set.fqdn(), "A", &ips[..1]).await;
        set.await_answers(i, &set.fqdn(), "AAAA", &ips[1..]).await;
    }
}
