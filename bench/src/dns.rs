//! A DNS load generator and its peer: what the exports benchmark measures of `clusterset.local`
//! (issue 38). Queries are built and parsed with hickory-proto and sent over UDP from
//! `clients` tasks, each with its own socket and one query in flight (a resolver without a
//! cache, as a pod asking its cluster DNS with `cache` off would); the peer is Debian's
//! dnsmasq answering one name from its command line, put under the same load in the same run.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};
use tokio::net::UdpSocket;

use crate::Recorder;
use crate::results::DnsLoad;

/// How long one query waits for its answer before it counts as lost.
const QUERY_TIMEOUT: Duration = Duration::from_secs(1);

fn query(name: &Name, id: u16) -> anyhow::Result<Vec<u8>> {
    let mut message = Message::new();
    message
        .set_id(id)
        .set_message_type(MessageType::Query)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(true)
        .add_query(Query::query(name.clone(), RecordType::A));
    Ok(message.to_vec()?)
}

/// Asks `server` for `name` A once over `socket`: the addresses answered, `None` when no
/// answer with our ID came within [`QUERY_TIMEOUT`] or the answer was not NOERROR.
async fn ask(
    socket: &UdpSocket,
    server: SocketAddr,
    name: &Name,
    id: u16,
) -> anyhow::Result<Option<Vec<std::net::Ipv4Addr>>> {
    socket.send_to(&query(name, id)?, server).await?;
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + QUERY_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(received) = tokio::time::timeout(left, socket.recv_from(&mut buf)).await else {
            return Ok(None);
        };
        let (n, _) = received?;
        let Ok(answer) = Message::from_vec(&buf[..n]) else {
            continue;
        };
        if answer.id() != id {
            // A late answer to an earlier query.
            continue;
        }
        if answer.response_code() != ResponseCode::NoError {
            return Ok(None);
        }
        return Ok(Some(
            answer
                .answers()
                .iter()
                .filter_map(|r| match r.data() {
                    RData::A(a) => Some(a.0),
                    _ => None,
                })
                .collect(),
        ));
    }
}

/// The A addresses `server` answers for `name` now (empty for NXDOMAIN, SERVFAIL or no
/// answer).
pub async fn resolve(server: SocketAddr, name: &str) -> anyhow::Result<Vec<std::net::Ipv4Addr>> {
    let socket = UdpSocket::bind("127.0.0.1:0").await?;
    let name = Name::from_ascii(name)?;
    Ok(ask(&socket, server, &name, rand_id())
        .await?
        .unwrap_or_default())
}

fn rand_id() -> u16 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    (nanos % u32::from(u16::MAX)) as u16
}

/// `clients` tasks ask `server` for `name` A back to back for `seconds`: queries per second
/// answered (NOERROR with an address) and their latency.
pub async fn load(
    label: &str,
    server: SocketAddr,
    name: &str,
    clients: usize,
    seconds: f64,
) -> anyhow::Result<DnsLoad> {
    let name = Name::from_ascii(name)?;
    let duration = Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(clients);
    for client in 0..clients {
        let name = name.clone();
        tasks.push(tokio::spawn(async move {
            let socket = UdpSocket::bind("127.0.0.1:0").await?;
            let mut recorder = Recorder::new();
            let (mut sent, mut lost) = (0u64, 0u64);
            let mut id = u16::try_from(client % 1000).unwrap_or(0).wrapping_mul(61);
            while started.elapsed() < duration {
                id = id.wrapping_add(1);
                let asked = Instant::now();
                sent += 1;
                match ask(&socket, server, &name, id).await? {
                    Some(addresses) if !addresses.is_empty() => recorder.record(asked.elapsed()),
                    _ => lost += 1,
                }
            }
            anyhow::Ok((recorder, sent, lost))
        }));
    }
    let mut recorder = Recorder::new();
    let (mut sent, mut lost) = (0, 0);
    for task in tasks {
        let (r, s, l) = task.await??;
        recorder.merge(&r);
        sent += s;
        lost += l;
    }
    let latency = recorder.summary(started.elapsed());
    eprintln!(
        "dns load on {label}: {:.0} answered queries/s, p50 {:.3} ms, p99 {:.3} ms, {lost} of {sent} unanswered",
        latency.ops_per_second, latency.p50_ms, latency.p99_ms
    );
    Ok(DnsLoad {
        server: label.to_owned(),
        clients,
        seconds,
        sent,
        unanswered: lost,
        latency,
    })
}

/// dnsmasq answering `name` A with `address`, on a loopback port; stopped on drop.
#[derive(Debug)]
pub struct Dnsmasq {
    child: Child,
    pub addr: SocketAddr,
    pub version: String,
}

impl Dnsmasq {
    /// Starts it; `None` (said on stderr) without a `dnsmasq` binary.
    pub async fn start(name: &str, address: std::net::Ipv4Addr) -> anyhow::Result<Option<Self>> {
        let Some(bin) = trellis_testkit::tool_path("dnsmasq") else {
            eprintln!(
                "dns peer: no dnsmasq (scripts/setup.sh installs dnsmasq-base); not measured"
            );
            return Ok(None);
        };
        let port = trellis_testkit::free_port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let version = Command::new(&bin)
            .arg("--version")
            .output()
            .map(|o| {
                // "Dnsmasq version 2.90  Copyright ..." -> "dnsmasq 2.90"
                let text = String::from_utf8_lossy(&o.stdout);
                let number = text.split_whitespace().nth(2).unwrap_or("?");
                format!("dnsmasq {number}")
            })
            .unwrap_or_else(|_| "dnsmasq".to_owned());
        let child = Command::new(&bin)
            .args([
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
                "--listen-address=127.0.0.1",
                "--pid-file=",
                "--log-facility=/dev/null",
            ])
            .arg(format!("--port={port}"))
            .arg(format!(
                "--address=/{}/{address}",
                name.trim_end_matches('.')
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting dnsmasq")?;
        let peer = Self {
            child,
            addr,
            version,
        };
        let started = Instant::now();
        while resolve(addr, name).await?.is_empty() {
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(10),
                "dnsmasq did not answer {name} at {addr}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Some(peer))
    }
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
