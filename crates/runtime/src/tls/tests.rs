//! Real TLS handshakes over loopback: the peer listener's accept loop on one side, a rustls
//! client (or a tonic channel) on the other.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls::CertificateError;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{PrivateKeyDer, ServerName, UnixTime};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected as _;

use super::pem::parse_certs;
use super::verification::{algorithms, provider};
use super::verifiers::PeerServerVerifier;
use super::*;
use crate::client::Timeouts;
use crate::metrics::Metrics;

struct Cluster {
    ca: ClusterCa,
    tls: PeerTls,
}

fn cluster(id: &str, service: &str) -> Cluster {
    let ca = ClusterCa::generate(id).expect("CA");
    let cert = ca.issue(service).expect("cert");
    let tls = PeerTls::new(id, ca.cert_pem(), &cert.cert_pem, cert.key_pem()).expect("tls");
    Cluster { ca, tls }
}

fn pin(on: &Cluster, peer: &Cluster) {
    on.tls
        .trust()
        .pin(PinnedCa::from_pem(peer.tls.cluster_id(), peer.ca.cert_pem()).expect("pinnable"));
}

/// A peer listener on loopback; yields what it accepted.
async fn listen(server: &PeerTls) -> (SocketAddr, ReceiverStream<io::Result<PeerStream>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let addr = listener.local_addr().expect("addr");
    (addr, incoming(listener, server).expect("incoming"))
}

/// Connects with `config`; the connection counts as established once a byte went through
/// both ways (TLS 1.3 reports a refused client certificate only on the first read).
async fn exchange(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    accepted: &mut ReceiverStream<io::Result<PeerStream>>,
) -> std::result::Result<PeerConnectInfo, String> {
    let tcp = TcpStream::connect(addr).await.expect("tcp");
    let name = ServerName::try_from("127.0.0.1").expect("name");
    let connecting = tokio_rustls::TlsConnector::from(config).connect(name, tcp);
    let mut client = match connecting.await {
        Ok(c) => c,
        Err(e) => return Err(format!("client handshake: {e}")),
    };
    let server = tokio::time::timeout(Duration::from_secs(2), accepted.next()).await;
    let Ok(Some(Ok(mut server))) = server else {
        let mut buf = [0u8; 1];
        let read = client.read(&mut buf).await;
        return Err(format!("server refused (client read: {read:?})"));
    };
    client.write_all(b"p").await.map_err(|e| e.to_string())?;
    client.flush().await.map_err(|e| e.to_string())?;
    let mut buf = [0u8; 1];
    server
        .read_exact(&mut buf)
        .await
        .map_err(|e| e.to_string())?;
    server.write_all(b"q").await.map_err(|e| e.to_string())?;
    server.flush().await.map_err(|e| e.to_string())?;
    client
        .read_exact(&mut buf)
        .await
        .map_err(|e| e.to_string())?;
    Ok(server.connect_info())
}

#[tokio::test]
async fn a_pinned_peer_is_accepted_and_known_by_its_cluster_id() {
    let hub = cluster("hub", "broker");
    let leaf = cluster("leaf-a", "forwarder");
    pin(&hub, &leaf);
    pin(&leaf, &hub);
    let (addr, mut accepted) = listen(&hub.tls).await;
    let info = exchange(
        addr,
        leaf.tls.client_config(Some("hub")).expect("config"),
        &mut accepted,
    )
    .await
    .expect("accepted");
    let peer = info.peer.expect("verified");
    assert_eq!(peer.cluster_id, "leaf-a");
    assert_eq!(peer.service, "forwarder");
    assert_eq!(
        peer.ca_fingerprint,
        fingerprint(&parse_certs("ca", leaf.ca.cert_pem()).expect("pem")[0])
    );
}

#[tokio::test]
async fn a_certificate_from_an_unpinned_ca_is_refused() {
    let hub = cluster("hub", "broker");
    let leaf = cluster("leaf-a", "broker");
    let stranger = cluster("stranger", "broker");
    pin(&hub, &leaf);
    pin(&stranger, &hub);
    let (addr, mut accepted) = listen(&hub.tls).await;
    let refused = exchange(
        addr,
        stranger.tls.client_config(Some("hub")).expect("config"),
        &mut accepted,
    )
    .await;
    assert!(refused.is_err(), "{refused:?}");
}

#[tokio::test]
async fn an_expired_certificate_is_refused() {
    let hub = cluster("hub", "broker");
    let leaf = cluster("leaf-a", "broker");
    pin(&hub, &leaf);
    pin(&leaf, &hub);
    let now = SystemTime::now();
    let expired = leaf
        .ca
        .issue_with(&IssueOptions {
            service: "broker".into(),
            cluster_id: "leaf-a".into(),
            not_before: now - Duration::from_secs(7200),
            not_after: now - Duration::from_secs(3600),
        })
        .expect("issues");
    // PeerTls refuses to start with it...
    let err = PeerTls::new(
        "leaf-a",
        leaf.ca.cert_pem(),
        &expired.cert_pem,
        expired.key_pem(),
    )
    .expect_err("expired");
    assert!(err.to_string().contains("tls cert"), "{err}");
    // ...and a client presenting it anyway is refused by the server.
    let chain = parse_certs("cert", &expired.cert_pem).expect("pem");
    let key = PrivateKeyDer::from_pem_slice(expired.key_pem().as_bytes()).expect("key");
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("tls13")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PeerServerVerifier {
            trust: None,
            expected: None,
            pin: None,
            algorithms: algorithms(),
        }))
        .with_client_auth_cert(chain, key)
        .expect("client auth");
    let (addr, mut accepted) = listen(&hub.tls).await;
    let refused = exchange(addr, Arc::new(config), &mut accepted).await;
    assert!(refused.is_err(), "{refused:?}");
}

#[tokio::test]
async fn a_peer_ca_cannot_mint_another_clusters_identity() {
    let hub = cluster("hub", "broker");
    let leaf_a = cluster("leaf-a", "broker");
    let leaf_c = cluster("leaf-c", "broker");
    pin(&hub, &leaf_a);
    pin(&hub, &leaf_c);
    // leaf-a's CA issues a certificate naming leaf-c.
    let now = SystemTime::now();
    let forged = leaf_a
        .ca
        .issue_with(&IssueOptions {
            service: "broker".into(),
            cluster_id: "leaf-c".into(),
            not_before: now - Duration::from_secs(60),
            not_after: now + Duration::from_secs(3600),
        })
        .expect("issues");
    let chain = parse_certs("cert", &forged.cert_pem).expect("pem");
    let err = verify_chain(
        hub.tls.trust(),
        &chain[0],
        &[],
        UnixTime::now(),
        webpki::KeyUsage::client_auth(),
        None,
    )
    .expect_err("forged");
    assert!(
        matches!(
            err,
            rustls::Error::InvalidCertificate(CertificateError::NotValidForName)
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn unpinning_refuses_new_connections() {
    let hub = cluster("hub", "broker");
    let leaf = cluster("leaf-a", "broker");
    pin(&hub, &leaf);
    pin(&leaf, &hub);
    let (addr, mut accepted) = listen(&hub.tls).await;
    let config = leaf.tls.client_config(Some("hub")).expect("config");
    exchange(addr, config.clone(), &mut accepted)
        .await
        .expect("accepted while pinned");
    assert!(hub.tls.trust().unpin("leaf-a"));
    let refused = exchange(addr, config.clone(), &mut accepted).await;
    assert!(refused.is_err(), "{refused:?}");
    pin(&hub, &leaf);
    exchange(addr, config, &mut accepted)
        .await
        .expect("accepted again once pinned");
}

#[tokio::test]
async fn the_client_refuses_a_server_of_another_cluster() {
    let hub = cluster("hub", "broker");
    let leaf = cluster("leaf-a", "broker");
    let other = cluster("other", "broker");
    pin(&hub, &leaf);
    pin(&leaf, &hub);
    pin(&leaf, &other);
    let (addr, mut accepted) = listen(&hub.tls).await;
    // The server is hub; the client expects "other" (whose CA it pinned too).
    let refused = exchange(
        addr,
        leaf.tls.client_config(Some("other")).expect("config"),
        &mut accepted,
    )
    .await;
    assert!(refused.is_err(), "{refused:?}");
    // Unverified first contact (the handshake) works without a client certificate.
    let info = exchange(
        addr,
        leaf.tls.handshake_client_config().expect("config"),
        &mut accepted,
    )
    .await
    .expect("first contact");
    assert!(info.peer.is_none());
}

#[tokio::test]
async fn renewal_swaps_the_certificate_for_new_connections() {
    let hub = cluster("hub", "broker");
    let leaf = cluster("leaf-a", "broker");
    pin(&hub, &leaf);
    pin(&leaf, &hub);
    let (addr, mut accepted) = listen(&hub.tls).await;
    let before = exchange(
        addr,
        leaf.tls.client_config(Some("hub")).expect("config"),
        &mut accepted,
    )
    .await
    .expect("accepted");
    let renewed = leaf.ca.issue("other-service").expect("issues");
    leaf.tls
        .renew(&renewed.cert_pem, renewed.key_pem())
        .expect("renews");
    let after = exchange(
        addr,
        leaf.tls.client_config(Some("hub")).expect("config"),
        &mut accepted,
    )
    .await
    .expect("accepted");
    assert_eq!(before.peer.expect("peer").service, "broker");
    assert_eq!(after.peer.expect("peer").service, "other-service");
    // A certificate of another CA is not taken.
    let foreign = ClusterCa::generate("leaf-a").expect("ca");
    let wrong = foreign.issue("broker").expect("issues");
    leaf.tls
        .renew(&wrong.cert_pem, wrong.key_pem())
        .expect_err("not from our CA");
}

#[tokio::test]
async fn renewed_files_are_picked_up_without_a_restart() {
    let hub = cluster("hub", "broker");
    let ca = ClusterCa::generate("leaf-a").expect("CA");
    let dir = std::env::temp_dir().join(format!("trellis-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let files = TlsFiles {
        ca_cert: dir.join("ca.pem"),
        cert: dir.join("cert.pem"),
        key: dir.join("key.pem"),
    };
    let write = |service: &str| {
        let cert = ca.issue(service).expect("issues");
        std::fs::write(&files.ca_cert, ca.cert_pem()).expect("ca");
        std::fs::write(&files.cert, &cert.cert_pem).expect("cert");
        std::fs::write(&files.key, cert.key_pem()).expect("key");
    };
    write("broker");
    let leaf = PeerTls::from_files("leaf-a", &files).expect("loads");
    assert!(!leaf.reload().expect("unchanged"));
    leaf.trust()
        .pin(PinnedCa::from_pem("hub", hub.ca.cert_pem()).expect("pin"));
    hub.tls
        .trust()
        .pin(PinnedCa::from_pem("leaf-a", ca.cert_pem()).expect("pin"));
    let (addr, mut accepted) = listen(&hub.tls).await;
    let config = || leaf.client_config(Some("hub")).expect("config");
    let before = exchange(addr, config(), &mut accepted).await.expect("ok");
    tokio::time::sleep(Duration::from_millis(20)).await;
    write("renewed");
    assert!(leaf.reload().expect("reloads"));
    let after = exchange(addr, config(), &mut accepted).await.expect("ok");
    assert_eq!(before.peer.expect("peer").service, "broker");
    assert_eq!(after.peer.expect("peer").service, "renewed");
    // A broken pair keeps the current certificate.
    tokio::time::sleep(Duration::from_millis(20)).await;
    std::fs::write(&files.key, "not a key").expect("key");
    leaf.reload().expect_err("broken");
    let still = exchange(addr, config(), &mut accepted).await.expect("ok");
    assert_eq!(still.peer.expect("peer").service, "renewed");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_tool_verifies_the_server_against_the_given_ca_and_presents_its_certificate() {
    let hub = cluster("hub", "ipam");
    let leaf = cluster("leaf-a", "broker");
    pin(&hub, &leaf);
    let (addr, mut accepted) = listen(&hub.tls).await;
    assert_eq!(ca_cluster_id(hub.ca.cert_pem()).expect("names hub"), "hub");

    // With leaf-a's certificate: the hub knows the caller as leaf-a.
    let issued = leaf.ca.issue("trellisctl").expect("cert");
    let tool = ToolTls::new(
        hub.ca.cert_pem(),
        Some((&issued.cert_pem, issued.key_pem())),
    )
    .expect("tool");
    assert_eq!(tool.cluster_id(), "hub");
    assert!(!format!("{tool:?}").contains("PRIVATE KEY"));
    let info = exchange(addr, tool.config.clone(), &mut accepted)
        .await
        .expect("accepted");
    let peer = info.peer.expect("verified");
    assert_eq!(
        (peer.cluster_id.as_str(), peer.service.as_str()),
        ("leaf-a", "trellisctl")
    );

    // Without one: anonymous, like the handshake.
    let anonymous = ToolTls::new(hub.ca.cert_pem(), None).expect("tool");
    let info = exchange(addr, anonymous.config.clone(), &mut accepted)
        .await
        .expect("accepted");
    assert!(info.peer.is_none());

    // Given another cluster's CA, the tool refuses the hub's server certificate.
    let wrong = ToolTls::new(leaf.ca.cert_pem(), None).expect("tool");
    let refused = exchange(addr, wrong.config.clone(), &mut accepted).await;
    assert!(refused.is_err(), "{refused:?}");
}

#[tokio::test]
async fn first_contact_with_a_pinned_hash_reaches_only_the_pinned_cas_servers() {
    let hub = cluster("hub", "broker");
    let other = cluster("hub", "broker");
    let leaf = cluster("leaf", "broker");
    let (addr, mut accepted) = listen(&hub.tls).await;
    let right = hub.tls.own_ca_hash().expect("hash");
    let config = leaf
        .tls
        .pinned_handshake_client_config(right)
        .expect("config");
    exchange(addr, config, &mut accepted)
        .await
        .expect("the pinned CA's server is reached");
    // Same cluster ID, another CA (a man in the middle with a certificate naming the hub).
    let (addr, mut accepted) = listen(&other.tls).await;
    let config = leaf
        .tls
        .pinned_handshake_client_config(right)
        .expect("config");
    let err = exchange(addr, config, &mut accepted)
        .await
        .expect_err("another CA is refused");
    assert!(err.contains("pinned CA"), "{err}");
}

/// A channel to another cluster (mutual TLS, the peer listener) notices a server gone silent
/// like a plaintext one does (`client.rs`): a watch through it ends instead of waiting forever.
#[tokio::test]
async fn a_watch_over_mutual_tls_through_a_network_gone_silent_ends() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    let hub = cluster("hub", "discovery");
    let leaf = cluster("leaf-a", "broker");
    pin(&hub, &leaf);
    pin(&leaf, &hub);
    let (server, accepted) = listen(&hub.tls).await;
    let (_reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health)
            .serve_with_incoming(accepted),
    );
    let relay = trellis_testkit::SilentRelay::start(server)
        .await
        .expect("a relay");
    let channel = peer_channel(
        &leaf.tls,
        "address",
        &relay.addr.to_string(),
        Some("hub"),
        Timeouts::default(),
        &Metrics::new(),
    )
    .expect("a channel");
    let mut watch = HealthClient::new(channel)
        .watch(HealthCheckRequest::default())
        .await
        .expect("the watch opens")
        .into_inner();
    assert!(
        watch.message().await.expect("a first status").is_some(),
        "the stream delivers through the relay"
    );

    relay.silence();
    let keepalive = crate::client::KEEPALIVE;
    let bound = keepalive.interval + keepalive.timeout + Duration::from_secs(5);
    let ended = tokio::time::timeout(bound, watch.message()).await;
    match ended {
        Err(_) => panic!("the watch still waits {bound:?} after the network went silent"),
        Ok(Ok(Some(message))) => panic!("a message through a silent relay: {message:?}"),
        Ok(_) => {}
    }
}

#[tokio::test]
async fn the_expiry_of_the_certificates_in_use_is_a_metric_and_follows_a_renewal() {
    let leaf = cluster("leaf-a", "broker");
    let now = SystemTime::now();
    let issue = |not_after: SystemTime| {
        leaf.ca
            .issue_with(&IssueOptions {
                service: "broker".into(),
                cluster_id: "leaf-a".into(),
                not_before: now - Duration::from_secs(60),
                not_after,
            })
            .expect("issues")
    };
    let secs = |t: SystemTime| {
        t.duration_since(SystemTime::UNIX_EPOCH)
            .expect("after the epoch")
            .as_secs()
    };
    let first_end = now + Duration::from_secs(3 * 86_400);
    let first = issue(first_end);
    leaf.tls
        .renew(&first.cert_pem, first.key_pem())
        .expect("renews");
    // What the certificate says, to the second.
    let der = parse_certs("cert", &first.cert_pem).expect("pem");
    assert_eq!(not_after(der[0].as_ref()).map(secs), Some(secs(first_end)));
    // Not a certificate: no answer, no panic.
    for garbage in [&b""[..], b"\x30\x03\x02\x01\x00", &[0xff; 64]] {
        assert_eq!(not_after(garbage), None);
    }

    let metrics = Metrics::new();
    metrics.register_collector(ExpiryCollector::new("broker", leaf.tls.clone()));
    let metric = |name: &str, text: &str, kind: &str| -> Option<u64> {
        let prefix = format!("{name}{{service=\"broker\",kind=\"{kind}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
    };
    let value = |text: &str, kind: &str| metric(EXPIRY_METRIC, text, kind);
    let text = metrics.render().await;
    assert_eq!(value(&text, "service"), Some(secs(first_end)), "{text}");
    assert_eq!(
        metric(NOT_BEFORE_METRIC, &text, "service"),
        Some(secs(now - Duration::from_secs(60))),
        "{text}"
    );
    let ca_end = value(&text, "ca").expect("the CA's expiry");
    assert!(
        ca_end > secs(now) + 300 * 86_400,
        "the CA expires soon: {ca_end}"
    );

    // A renewal shows at the next scrape.
    let second_end = now + Duration::from_secs(6 * 86_400);
    let second = issue(second_end);
    leaf.tls
        .renew(&second.cert_pem, second.key_pem())
        .expect("renews");
    let text = metrics.render().await;
    assert_eq!(value(&text, "service"), Some(secs(second_end)), "{text}");
}

#[test]
fn a_peer_that_moved_to_a_new_ca_keeps_its_open_connections_until_unpinned() {
    let store = TrustStore::default();
    let first = ClusterCa::generate("leaf-a").expect("CA");
    let (next, _) = first.next().expect("next CA");
    let pinned = |ca: &ClusterCa| PinnedCa::from_pem("leaf-a", ca.cert_pem()).expect("pin");
    store.pin(pinned(&first));
    assert!(store.admits("leaf-a", &first.fingerprint()));
    assert!(!store.admits("leaf-a", &next.fingerprint()));
    // The move: the new CA is pinned; connections authenticated by the old one stay admitted,
    // new ones must chain to the new one (the verifier sees only what is pinned).
    store.replace([pinned(&next)]);
    assert!(store.is_pinned("leaf-a", &next.fingerprint()));
    assert!(!store.is_pinned("leaf-a", &first.fingerprint()));
    assert!(store.admits("leaf-a", &first.fingerprint()));
    assert_eq!(store.snapshot().len(), 1, "one CA per peer is pinned");
    // Unpeered: nothing of it is admitted any more.
    assert!(store.unpin("leaf-a"));
    assert!(!store.admits("leaf-a", &first.fingerprint()));
    assert!(!store.admits("leaf-a", &next.fingerprint()));
    // Pinned again (a new peering): only its CA of now.
    store.pin(pinned(&next));
    assert!(!store.admits("leaf-a", &first.fingerprint()));
}
