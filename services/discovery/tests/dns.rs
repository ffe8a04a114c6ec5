//! DNS-SRV discovery against a real DNS server on loopback: hickory-server, in process, on UDP
//! and TCP, answering from a zone the test edits while the discovery service runs. The resolver
//! must find clusters, pick up new records on refresh, and drop clusters whose records go, but
//! keep them when the DNS server merely does not answer.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::str::FromStr as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser as _;
use hickory_proto::op::{Header, ResponseCode};
use hickory_proto::rr::rdata::{A, SRV};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use hickory_server::ServerFuture;
use hickory_server::authority::MessageResponseBuilder;
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use tokio::net::{TcpListener, UdpSocket};
use trellis_api::ClusterId;
use trellis_api::peers::Condition;
use trellis_discovery::records::{Mechanism, Source, Status};
use trellis_discovery::{Config, Started, dns, start};
use trellis_runtime::Shutdown;

const DOMAIN: &str = "clusters.test";

/// The zone: (lowercase name, type) -> records.
type Zone = Arc<Mutex<BTreeMap<(String, RecordType), Vec<Record>>>>;

#[derive(Clone)]
struct Handler {
    zone: Zone,
}

#[async_trait::async_trait]
impl RequestHandler for Handler {
    async fn handle_request<R: ResponseHandler>(
        &self,
        request: &Request,
        mut response: R,
    ) -> ResponseInfo {
        let mut header = Header::response_from_request(request.header());
        header.set_authoritative(true);
        let builder = MessageResponseBuilder::from_message_request(request);
        let answers = match request.request_info() {
            Ok(info) => {
                let name = info.query.name().to_string().to_lowercase();
                let zone = self.zone.lock().expect("zone lock");
                let exists = zone.keys().any(|(n, _)| *n == name);
                if !exists {
                    header.set_response_code(ResponseCode::NXDomain);
                }
                zone.get(&(name, info.query.query_type()))
                    .cloned()
                    .unwrap_or_default()
            }
            Err(_) => {
                header.set_response_code(ResponseCode::FormErr);
                Vec::new()
            }
        };
        let message = builder.build(header, answers.iter(), [], [], []);
        match response.send_response(message).await {
            Ok(info) => info,
            Err(_) => {
                let mut h = Header::new();
                h.set_response_code(ResponseCode::ServFail);
                h.into()
            }
        }
    }
}

/// A DNS server on 127.0.0.1 (UDP and TCP on the same free port).
struct DnsServer {
    addr: SocketAddr,
    zone: Zone,
    server: ServerFuture<Handler>,
}

impl DnsServer {
    async fn start() -> Self {
        let zone: Zone = Arc::default();
        for _ in 0..10 {
            let port = trellis_testkit::free_port();
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
            let (Ok(udp), Ok(tcp)) = (UdpSocket::bind(addr).await, TcpListener::bind(addr).await)
            else {
                continue;
            };
            let mut server = ServerFuture::new(Handler { zone: zone.clone() });
            server.register_socket(udp);
            server.register_listener(tcp, Duration::from_secs(5));
            return Self { addr, zone, server };
        }
        panic!("no free loopback port for the DNS server");
    }

    /// Publishes `_trellis._tcp.<DOMAIN>` -> `<host>.<DOMAIN>:port` and `<host>` -> 127.0.0.1.
    fn publish(&self, host: &str, port: u16) {
        let srv_name = Name::from_str(&format!("_trellis._tcp.{DOMAIN}.")).expect("name");
        let target = Name::from_str(&format!("{host}.{DOMAIN}.")).expect("name");
        let mut zone = self.zone.lock().expect("zone lock");
        zone.entry((srv_name.to_string(), RecordType::SRV))
            .or_default()
            .push(Record::from_rdata(
                srv_name,
                0,
                RData::SRV(SRV::new(10, 10, port, target.clone())),
            ));
        zone.insert(
            (target.to_string(), RecordType::A),
            vec![Record::from_rdata(
                target,
                0,
                RData::A(A(Ipv4Addr::LOCALHOST)),
            )],
        );
    }

    /// Removes the SRV record pointing at `host` (the last one removes the name: NXDOMAIN).
    fn unpublish(&self, host: &str) {
        let srv_name = format!("_trellis._tcp.{DOMAIN}.");
        let target = format!("{host}.{DOMAIN}.");
        let mut zone = self.zone.lock().expect("zone lock");
        let key = (srv_name, RecordType::SRV);
        if let Some(records) = zone.get_mut(&key) {
            records.retain(|r| match r.data() {
                RData::SRV(srv) => srv.target().to_string() != target,
                _ => true,
            });
            if records.is_empty() {
                zone.remove(&key);
            }
        }
    }
}

struct Guard(Shutdown);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

async fn discovery(id: &str, extra: &[&str]) -> (Started, Guard) {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let mut args = vec![
        "trellis-discovery",
        "--store",
        "memory://",
        "--insecure-plaintext-peering",
        "--cluster-id",
        id,
        "--listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    let shutdown = Shutdown::new();
    let started = start(
        Config::try_parse_from(args).expect("config"),
        shutdown.clone(),
    )
    .await
    .expect("starts");
    (started, Guard(shutdown))
}

/// Polls until cluster `id` on `home` has Discovered = `want` (None: no record).
async fn wait_discovered(home: &Started, id: &str, want: Option<Status>) {
    let id = ClusterId::parse("cluster_id", id).expect("id");
    trellis_testkit::eventually_eq(
        &format!("{id}: Discovered"),
        Duration::from_secs(20),
        want,
        || async {
            home.core
                .get(&id)
                .await
                .ok()
                .and_then(|(r, _)| r.condition(Condition::Discovered).map(|c| c.status))
        },
    )
    .await;
}

#[tokio::test]
async fn srv_records_are_found_refreshed_and_dropped() {
    let dns_server = DnsServer::start().await;
    let (r1, _g1) = discovery("remote-1", &[]).await;
    let (r2, _g2) = discovery("remote-2", &[]).await;
    dns_server.publish("r1", r1.addr.port());

    let nameserver = dns_server.addr.to_string();
    let (home, _g) = discovery(
        "home",
        &[
            "--dns-domains",
            DOMAIN,
            "--dns-nameserver",
            &nameserver,
            "--dns-refresh",
            "1",
        ],
    )
    .await;
    wait_discovered(&home, "remote-1", Some(Status::True)).await;
    let (record, _) = home
        .core
        .get(&ClusterId::parse("cluster_id", "remote-1").expect("id"))
        .await
        .expect("remote-1 recorded");
    assert_eq!(record.source, Source::DnsSrv);
    assert_eq!(record.discovery_address, r1.addr.to_string());
    assert!(record.found_by.contains(&Mechanism::DnsSrv));
    assert!(!record.is(Condition::Peered), "discovery never peers");

    // A record added later is found on a refresh.
    dns_server.publish("r2", r2.addr.port());
    wait_discovered(&home, "remote-2", Some(Status::True)).await;

    // A record removed is noticed: Discovered=False, the other stays.
    dns_server.unpublish("r1");
    wait_discovered(&home, "remote-1", Some(Status::False)).await;
    let (record, _) = home
        .core
        .get(&ClusterId::parse("cluster_id", "remote-1").expect("id"))
        .await
        .expect("record kept");
    assert_eq!(
        record
            .condition(Condition::Discovered)
            .map(|c| c.reason.as_str()),
        Some("SrvRecordRemoved")
    );
    wait_discovered(&home, "remote-2", Some(Status::True)).await;

    // The last record gone (NXDOMAIN) drops remote-2 too.
    dns_server.unpublish("r2");
    wait_discovered(&home, "remote-2", Some(Status::False)).await;
    drop(dns_server.server);
}

#[tokio::test]
async fn an_unanswering_dns_server_drops_nothing() {
    let mut dns_server = DnsServer::start().await;
    let (r1, _g1) = discovery("remote-1", &[]).await;
    dns_server.publish("r1", r1.addr.port());
    let (home, _g) = discovery("home", &[]).await;
    let settings = dns::DnsSettings {
        domains: vec![DOMAIN.into()],
        nameserver: Some(dns_server.addr),
        refresh: Duration::from_secs(1),
    };
    let resolver = dns::resolver(&settings).expect("resolver");
    let round = dns::refresh(&home.core, &resolver, &settings.domains)
        .await
        .expect("refresh");
    assert!(round.complete);
    assert_eq!(round.found.len(), 1);
    wait_discovered(&home, "remote-1", Some(Status::True)).await;

    dns_server
        .server
        .shutdown_gracefully()
        .await
        .expect("dns stops");
    let round = dns::refresh(&home.core, &resolver, &settings.domains)
        .await
        .expect("refresh");
    assert!(!round.complete, "a timeout is not an answer");
    wait_discovered(&home, "remote-1", Some(Status::True)).await;
}
