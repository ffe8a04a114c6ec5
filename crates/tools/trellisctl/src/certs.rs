//! `trellisctl certs`: the cluster's CA in a `--tls-dir` directory, where the services make and
//! renew their own certificates (ADR 0026). `init` creates the CA before any service starts
//! (what the first service would do); `rotate-ca` moves the cluster to a new CA while it is
//! peered (ADR 0027):
//!
//! 1. the next CA, and a certificate of it signed by the current one (the cross certificate),
//!    replace the current CA in the directory;
//! 2. every service finds its certificate no longer chains to the CA and issues a new one at
//!    its next check (`--tls-reload`), which it serves followed by the cross certificate: peers
//!    still pinning the old CA verify through it, so nothing fails meanwhile. The command waits
//!    until every service's certificate in the directory is of the new CA;
//! 3. the broker announces the new CA to every full peer (Broker.AnnounceCa), which pins it in
//!    place of the old one; the command retries peers that did not answer until `--wait`
//!    passes. From then on the old CA is refused by every peer that pinned the new one.
//!
//! Run again after an interruption, or after a peer did not answer, it goes on from where the
//! directory is: a move not yet announced to every peer is finished, never followed by
//! another (peers pinning the old CA verify only the cross certificate of the next one).

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;
use trellis_api::pb::discovery::GetIdentityRequest;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::peering::AnnounceCaRequest;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_runtime::tls::{ManagedTls, PeerTls, announced, rotate_ca};

use crate::cli::{CertsAction, CertsArgs, CertsDirArgs, Globals, RotateCaArgs};
use crate::error::CtlError;
use crate::output::Report;
use crate::service::Service;
use crate::table::Table;

/// What `certs init` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InitView {
    pub dir: String,
    pub cluster_id: String,
    /// SHA-256 fingerprint of the CA certificate.
    pub ca_sha256: String,
    /// What a join command pins (`peer --ca-cert-hash`).
    pub ca_cert_hash: String,
}

/// One peer's answer to the announcement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeerPinView {
    pub cluster_id: String,
    pub pinned: bool,
    pub error: Option<String>,
}

/// What `certs rotate-ca` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RotationView {
    pub dir: String,
    pub previous_ca_sha256: String,
    pub ca_sha256: String,
    /// The services whose certificates are now of the new CA.
    pub services: Vec<String>,
    pub peers: Vec<PeerPinView>,
}

/// What `certs` printed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum CertsOutput {
    Init(InitView),
    Rotated(RotationView),
}

impl Report for CertsOutput {
    fn table(&self) -> String {
        match self {
            Self::Init(v) => format!(
                "the CA of {} in {}\nsha256: {}\njoin hash: {}\n",
                v.cluster_id, v.dir, v.ca_sha256, v.ca_cert_hash
            ),
            Self::Rotated(v) => {
                let mut out = format!(
                    "moved to a new CA in {}: {} (was {})\nservices on the new CA: {}\n",
                    v.dir,
                    v.ca_sha256,
                    v.previous_ca_sha256,
                    v.services.join(", ")
                );
                let mut table = Table::new(&["PEER", "PINS THE NEW CA", "ERROR"]);
                for p in &v.peers {
                    table.row([
                        p.cluster_id.clone(),
                        if p.pinned { "yes" } else { "no" }.into(),
                        p.error.clone().unwrap_or_default(),
                    ]);
                }
                if table.is_empty() {
                    out.push_str("no full peers to tell\n");
                } else {
                    out.push_str(&table.render());
                }
                out
            }
        }
    }
}

/// The cluster ID: `--cluster-id`, or what the local discovery service says.
async fn cluster_id(globals: &Globals, args: &CertsDirArgs) -> Result<String, CtlError> {
    if let Some(id) = &args.cluster_id {
        return Ok(id.clone());
    }
    let target = globals.target(Service::Discovery);
    let reply = DiscoveryClient::new(globals.connect(&target).await?)
        .get_identity(GetIdentityRequest {})
        .await
        .map_err(|s| CtlError::rpc(&target, "GetIdentity", &s))?
        .into_inner();
    reply
        .identity
        .map(|i| i.cluster_id)
        .filter(|id| !id.is_empty())
        .ok_or_else(|| CtlError::Failed("discovery reports no cluster ID".into()))
}

/// Runs `certs`.
pub async fn run(globals: &Globals, args: &CertsArgs) -> Result<CertsOutput, CtlError> {
    match &args.action {
        CertsAction::Init(dir) => init(globals, dir).await.map(CertsOutput::Init),
        CertsAction::RotateCa(rotate) => rotate_ca_cmd(globals, rotate)
            .await
            .map(CertsOutput::Rotated),
    }
}

async fn init(globals: &Globals, args: &CertsDirArgs) -> Result<InitView, CtlError> {
    let id = cluster_id(globals, args).await?;
    // The service name only names the service's own subdirectory, which init does not touch.
    let managed = ManagedTls::new(&args.tls_dir, &id, "trellisctl", Duration::from_secs(3600));
    let ca = managed
        .ca()
        .map_err(|e| CtlError::Failed(format!("--tls-dir {}: {e:#}", args.tls_dir.display())))?;
    let hash = trellis_runtime::tls::CaCertHash::of_pem(ca.cert_pem())
        .map_err(|e| CtlError::Failed(format!("the CA's hash: {e}")))?;
    Ok(InitView {
        dir: args.tls_dir.display().to_string(),
        cluster_id: id,
        ca_sha256: ca.fingerprint(),
        ca_cert_hash: hash.to_string(),
    })
}

/// The services with a certificate in `dir` (every subdirectory holding one), and which of
/// them are not yet of the CA `ca_pem`.
fn services_behind(dir: &Path, id: &str, ca_pem: &str) -> (Vec<String>, Vec<String>) {
    let mut all = Vec::new();
    let mut behind = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (all, behind);
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let (cert, key) = (entry.path().join("cert.pem"), entry.path().join("key.pem"));
        if name.starts_with("ca") || !cert.exists() {
            continue;
        }
        let current = match (
            std::fs::read_to_string(&cert),
            std::fs::read_to_string(&key),
        ) {
            (Ok(cert), Ok(key)) => PeerTls::new(id, ca_pem, &cert, &key).is_ok(),
            _ => false,
        };
        if !current {
            behind.push(name.clone());
        }
        all.push(name);
    }
    all.sort();
    behind.sort();
    (all, behind)
}

async fn rotate_ca_cmd(globals: &Globals, args: &RotateCaArgs) -> Result<RotationView, CtlError> {
    let dir = &args.dir.tls_dir;
    let shown = dir.display().to_string();
    let id = cluster_id(globals, &args.dir).await?;
    let rotation =
        rotate_ca(dir, &id).map_err(|e| CtlError::Failed(format!("--tls-dir {shown}: {e:#}")))?;
    eprintln!(
        "certs: {} {id} to a new CA ({}); waiting for its services to issue certificates of it",
        if rotation.resumed {
            "going on with moving"
        } else {
            "moved"
        },
        rotation.current
    );
    let deadline = Instant::now() + args.wait;
    let ca_pem = std::fs::read_to_string(dir.join("ca").join("ca.pem"))
        .map_err(|e| CtlError::Failed(format!("--tls-dir {shown}: cannot read ca/ca.pem: {e}")))?;
    let services = loop {
        let (all, behind) = services_behind(dir, &id, &ca_pem);
        if behind.is_empty() {
            break all;
        }
        if Instant::now() > deadline {
            return Err(CtlError::Failed(format!(
                "after {:?}, still on the old CA: {} (is each running, with --tls-dir {shown}?); \
                 nothing was announced to the peers; run the command again to go on",
                args.wait,
                behind.join(", ")
            )));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    // A service swaps its certificate in right after writing it; this covers the swap.
    tokio::time::sleep(Duration::from_millis(500)).await;
    eprintln!(
        "certs: {} serve certificates of the new CA; announcing it to the peers",
        services.join(", ")
    );
    let target = globals.target(Service::Broker);
    let mut broker = BrokerClient::new(globals.connect(&target).await?);
    loop {
        let reply = broker
            .announce_ca(AnnounceCaRequest {})
            .await
            .map_err(|s| CtlError::rpc(&target, "AnnounceCa", &s))?
            .into_inner();
        let peers: Vec<PeerPinView> = reply
            .peers
            .iter()
            .map(|p| PeerPinView {
                cluster_id: p
                    .peer
                    .as_ref()
                    .map(|i| i.cluster_id.clone())
                    .unwrap_or_default(),
                pinned: p.pinned,
                error: (!p.error.is_empty()).then(|| p.error.clone()),
            })
            .collect();
        let done = peers.iter().all(|p| p.pinned) || Instant::now() > deadline;
        if done || reply.ca_sha256 != rotation.current {
            if reply.ca_sha256 != rotation.current {
                return Err(CtlError::Failed(format!(
                    "the broker announced CA {}, not the new {}: is it running with --tls-dir \
                     {shown}? Run the command again once it is",
                    reply.ca_sha256, rotation.current
                )));
            }
            if peers.iter().all(|p| p.pinned) {
                announced(dir).map_err(|e| CtlError::Failed(format!("{e:#}")))?;
            }
            return Ok(RotationView {
                dir: shown,
                previous_ca_sha256: rotation.previous,
                ca_sha256: rotation.current,
                services,
                peers,
            });
        }
        let waiting: Vec<&str> = peers
            .iter()
            .filter(|p| !p.pinned)
            .map(|p| p.cluster_id.as_str())
            .collect();
        eprintln!(
            "certs: waiting for {} to pin the new CA",
            waiting.join(", ")
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
