//! The command line of `trellisctl`: global flags (each also a `TRELLIS_*` environment variable)
//! and the subcommands. Values are validated here, so a typo is a usage error (exit code 2)
//! before any service is called.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use trellis_runtime::config::ports;

use tonic::service::interceptor::InterceptedService;
use trellis_runtime::client::TracedChannel;
use trellis_runtime::local_auth::LocalToken;
use trellis_runtime::metrics::MeteredChannel;
use trellis_runtime::propagation::TraceInterceptor;
use trellis_runtime::tls::ToolTls;

use crate::error::CtlError;
use crate::service::{Service, Target};

/// Operator CLI of Trellis: peers clusters and shows what the local cluster's services know.
///
/// Every command talks to the gRPC services of ONE cluster (the local one), found at the
/// addresses given by the global flags (defaults: the services' default ports on 127.0.0.1). Output is a
/// human-readable table, or one JSON document with `--output json`. Exit codes: 0 success, 1 a
/// service failed or could not be reached, 2 bad usage.
#[derive(Debug, Clone, Parser)]
#[command(name = "trellisctl", version, about, long_about, max_term_width = 100)]
pub struct Cli {
    #[command(flatten)]
    pub globals: Globals,

    #[command(subcommand)]
    pub command: Command,
}

/// Flags accepted before or after any subcommand.
#[derive(Debug, Clone, Args)]
pub struct Globals {
    /// Address of the local discovery service (trellis-discovery).
    #[arg(long, global = true, env = "TRELLIS_DISCOVERY", value_name = "HOST:PORT",
          default_value_t = local(ports::DISCOVERY), value_parser = address_arg)]
    pub discovery: String,

    /// Address of the local peering broker (trellis-broker).
    #[arg(long, global = true, env = "TRELLIS_BROKER", value_name = "HOST:PORT",
          default_value_t = local(ports::BROKER), value_parser = address_arg)]
    pub broker: String,

    /// Address of the local forwarder (trellis-forwarder); `status` checks its health.
    #[arg(long, global = true, env = "TRELLIS_FORWARDER", value_name = "HOST:PORT",
          default_value_t = local(ports::FORWARDER), value_parser = address_arg)]
    pub forwarder: String,

    /// Address of the local IPAM (trellis-ipam).
    #[arg(long, global = true, env = "TRELLIS_IPAM", value_name = "HOST:PORT",
          default_value_t = local(ports::IPAM), value_parser = address_arg)]
    pub ipam: String,

    /// Address of the local endpoints service (trellis-endpoints).
    #[arg(long, global = true, env = "TRELLIS_ENDPOINTS", value_name = "HOST:PORT",
          default_value_t = local(ports::ENDPOINTS), value_parser = address_arg)]
    pub endpoints: String,

    /// Address of the local gateway's gRPC API (trellis-gateway), not its WireGuard port.
    #[arg(long, global = true, env = "TRELLIS_GATEWAY", value_name = "HOST:PORT",
          default_value_t = local(ports::GATEWAY), value_parser = address_arg)]
    pub gateway: String,

    /// Output format: `table` for people, `json` for scripts (one JSON document on stdout).
    #[arg(long, short = 'o', global = true, env = "TRELLIS_OUTPUT", value_enum,
          default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,

    /// Seconds to wait for a service: to connect, and again for each call (fractions allowed,
    /// e.g. 0.5).
    #[arg(long, global = true, env = "TRELLIS_TIMEOUT", value_name = "SECONDS",
          default_value = "10", value_parser = timeout_arg)]
    pub timeout: Duration,

    /// Talk TLS to the services (their `--peer-listen` addresses, ADR 0014): FILE is the CA
    /// certificate (PEM) of the cluster they belong to, which their certificates must chain to.
    /// The environment variables are `TRELLISCTL_TLS_*`, not the services' `TRELLIS_TLS_*`, so
    /// trellisctl run next to a service does not switch to TLS towards plaintext listeners.
    #[arg(
        long,
        global = true,
        env = "TRELLISCTL_TLS_CA_CERT",
        value_name = "FILE"
    )]
    pub tls_ca_cert: Option<PathBuf>,

    /// With --tls-ca-cert: present this certificate (PEM), e.g. a peered cluster's, for methods
    /// that take only verified callers.
    #[arg(long, global = true, env = "TRELLISCTL_TLS_CERT", value_name = "FILE",
          requires_all = ["tls_ca_cert", "tls_key"])]
    pub tls_cert: Option<PathBuf>,

    /// The private key (PEM) of --tls-cert. Never printed.
    #[arg(
        long,
        global = true,
        env = "TRELLISCTL_TLS_KEY",
        value_name = "FILE",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,

    /// File holding the cluster's local token (`authorization: Bearer`), for services started
    /// with --local-token-file: sent on plaintext connections only, never over --tls-ca-cert
    /// (another cluster's listener). Same variable as the services', so trellisctl run in a
    /// service's container authenticates as it.
    #[arg(
        long,
        global = true,
        env = "TRELLIS_LOCAL_TOKEN_FILE",
        value_name = "FILE"
    )]
    pub local_token_file: Option<PathBuf>,
}

fn read_file(flag: &str, path: &std::path::Path) -> Result<String, CtlError> {
    std::fs::read_to_string(path)
        .map_err(|e| CtlError::Usage(format!("{flag}: cannot read {}: {e}", path.display())))
}

/// A connected channel as the commands call through it: traced, with `token` when given.
pub fn traced(channel: tonic::transport::Channel, token: LocalToken) -> TracedChannel {
    InterceptedService::new(
        MeteredChannel::unmetered(channel),
        TraceInterceptor::with_local_token(token),
    )
}

impl Globals {
    /// Whether the flags ask for TLS (`--tls-ca-cert`).
    pub fn has_tls(&self) -> bool {
        self.tls_ca_cert.is_some()
    }

    /// The TLS setup the flags ask for, read from the files (a usage error names the flag).
    pub fn tls(&self) -> Result<Option<ToolTls>, CtlError> {
        let Some(ca) = &self.tls_ca_cert else {
            return Ok(None);
        };
        let ca = read_file("--tls-ca-cert", ca)?;
        let identity = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                Some((read_file("--tls-cert", cert)?, read_file("--tls-key", key)?))
            }
            _ => None,
        };
        ToolTls::new(
            &ca,
            identity.as_ref().map(|(c, k)| (c.as_str(), k.as_str())),
        )
        .map(Some)
        .map_err(|e| CtlError::Usage(format!("TLS flags: {e}")))
    }

    /// Connects to `target` as the flags say (plaintext, with the local token when given; or
    /// TLS).
    pub async fn connect(&self, target: &Target) -> Result<TracedChannel, CtlError> {
        let tls = self.tls()?;
        let token = match (&tls, &self.local_token_file) {
            (None, Some(path)) => LocalToken::from_file(path).map_err(|e| {
                CtlError::Usage(format!("--local-token-file {}: {e:#}", path.display()))
            })?,
            _ => LocalToken::off(),
        };
        let channel = crate::connect::connect(target, tls.as_ref(), self.timeout).await?;
        Ok(traced(channel, token))
    }

    /// Where `service` listens, as configured.
    pub fn target(&self, service: Service) -> Target {
        let address = match service {
            Service::Discovery => &self.discovery,
            Service::Broker => &self.broker,
            Service::Forwarder => &self.forwarder,
            Service::Ipam => &self.ipam,
            Service::Endpoints => &self.endpoints,
            Service::Gateway => &self.gateway,
        };
        Target {
            service,
            address: address.clone(),
        }
    }
}

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Aligned columns.
    Table,
    /// One pretty-printed JSON document.
    Json,
}

/// The subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Print this cluster's peering token (a secret), read from the broker. The table output is
    /// the token alone, so `TOKEN=$(trellisctl token)` works; `--output json` adds its creation
    /// time.
    Token(TokenArgs),

    /// Peer this cluster with a remote one (Broker.Peer): the local broker performs the token
    /// handshake with the remote broker, then the NetworkConfig exchange starts.
    Peer(PeerArgs),

    /// Tear down the full peering with a cluster (Broker.Unpeer). Succeeds, saying so, when
    /// there was no peering.
    Unpeer(UnpeerArgs),

    /// Show this cluster: service health, identity, ForeignClusters (full and induced, with
    /// origin and conditions), the broker's TunnelEndpoints with their NAT views, and the
    /// gateway's tunnels (state, last handshake, traffic, latency). A service that cannot be
    /// reached is reported in the output and its section left empty; the command fails (exit
    /// code 1) only when no service answers at all.
    Status(StatusArgs),

    /// Check this cluster and its peers and say what is wrong, each finding with what to do:
    /// a local service unreachable or not serving; a peer's advertised service unreachable; a
    /// peered ForeignCluster without a TunnelEndpoint; a TunnelEndpoint the gateway has not
    /// applied (no tunnel, or an older generation); a tunnel without a WireGuard handshake for
    /// more than 3 minutes; NAT views that disagree with the peer's IPAM; a remap pool or the
    /// external CIDR at least 90% used; a pinned peer CA certificate expiring within 30 days;
    /// other clusters served in plaintext; with --tls-dir, this cluster's own CA expiring
    /// within 30 days, a service certificate with less than a quarter of its lifetime left (its
    /// renewal is overdue) or still of the CA before a move, and a move to a new CA not yet
    /// announced to every peer. Exit code 0 only when nothing was found, 1 otherwise.
    Diagnose(DiagnoseArgs),

    /// Show the IPAM: local subnets, how every remote cluster is addressed (and addresses us),
    /// and the external-CIDR endpoint mappings. `ipam map` translates one endpoint IP.
    Ipam(IpamArgs),

    /// List the Services this cluster exports (ListExports) and the EndpointSlices other
    /// clusters reflected to this one (ListReflectedSlices); `endpoints reflect` translates a
    /// local slice for a target cluster.
    Endpoints(EndpointsArgs),

    /// Export a Service of this cluster to every peer (EndpointMapper.ExportService): its
    /// endpoints are reflected, translated for each peer, within seconds. Running it again with
    /// other endpoints or ports replaces the export.
    Export(ExportArgs),

    /// Stop exporting a Service (EndpointMapper.UnexportService): every peer loses it. Succeeds,
    /// saying so, when it was not exported.
    Unexport(UnexportArgs),

    /// The cluster's CA in the directory its services share (--tls-dir): create it, or move
    /// the cluster to a new one while it is peered.
    Certs(CertsArgs),
}

/// Arguments of `certs`.
#[derive(Debug, Clone, Args)]
pub struct CertsArgs {
    #[command(subcommand)]
    pub action: CertsAction,
}

/// What `certs` does.
#[derive(Debug, Clone, Subcommand)]
pub enum CertsAction {
    /// Create the cluster's CA in DIR/ca/ unless there is one (what the first service to start
    /// would do), and print its fingerprint and the hash a join command pins.
    Init(CertsDirArgs),

    /// Move the cluster to a new CA while it is peered, without interrupting anything: the
    /// new CA replaces the current one in DIR (with a certificate of it signed by the current
    /// one, which the services serve so that peers still pinning the old CA verify them); once
    /// every service in DIR has a certificate of the new CA, the broker announces it to every
    /// full peer (Broker.AnnounceCa), which pins it in place of the old one. Waits, with
    /// progress on stderr, up to --wait; run it again to go on after an interruption or a
    /// peer that did not answer. Exit code 1 while a peer does not pin the new CA.
    RotateCa(RotateCaArgs),
}

/// The directory of `certs`.
#[derive(Debug, Clone, Args)]
pub struct CertsDirArgs {
    /// The directory the cluster's services share (their --tls-dir).
    #[arg(long, env = "TRELLIS_TLS_DIR", value_name = "DIR")]
    pub tls_dir: std::path::PathBuf,

    /// The cluster's ID (what its CA names); default: what the local discovery service says.
    #[arg(long, env = "TRELLIS_CLUSTER_ID", value_name = "ID")]
    pub cluster_id: Option<String>,
}

/// Arguments of `certs rotate-ca`.
#[derive(Debug, Clone, Args)]
pub struct RotateCaArgs {
    #[command(flatten)]
    pub dir: CertsDirArgs,

    /// How long to wait for the services to move to the new CA and the peers to pin it, as a
    /// number with a unit (`90s`, `10m`; default 5m).
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = ttl_arg)]
    pub wait: Duration,
}

/// Flags of `diagnose`.
#[derive(Debug, Clone, Default, Args)]
pub struct DiagnoseArgs {
    /// The directory this cluster's services share (their --tls-dir): also check the
    /// certificates Trellis made there.
    #[arg(long, env = "TRELLIS_TLS_DIR", value_name = "DIR")]
    pub tls_dir: Option<std::path::PathBuf>,
}

/// Flags of `status`.
#[derive(Debug, Clone, Default, Args)]
pub struct StatusArgs {
    /// Also show withdrawn ForeignClusters (tombstones kept until discovery's
    /// --tombstone-retention has passed); hidden by default.
    #[arg(long)]
    pub all: bool,
}

/// Arguments of `export`.
#[derive(Debug, Clone, Args)]
pub struct ExportArgs {
    /// Name of the Service (a DNS label).
    #[arg(value_name = "NAME")]
    pub name: String,

    /// Namespace of the Service (a DNS label).
    #[arg(long, short = 'n', value_name = "NS")]
    pub namespace: String,

    /// A TCP port the Service exposes (1-65535); repeat for several. Checked by the endpoints
    /// service, which names the offending `ports[i].port`.
    #[arg(
        long = "port",
        value_name = "PORT",
        required = true,
        allow_negative_numbers = true
    )]
    pub ports: Vec<i64>,

    /// An endpoint's IP, a pod of this cluster as it addresses it; repeat for several. Checked
    /// by the endpoints service, which names the offending `endpoints[i].address`.
    // `id`: the global `--endpoints` (the endpoints service's address) owns the id "endpoints".
    #[arg(long = "endpoint", id = "endpoint", value_name = "IP")]
    pub addresses: Vec<String>,
}

/// Arguments of `unexport`.
#[derive(Debug, Clone, Args)]
pub struct UnexportArgs {
    /// Name of the Service.
    #[arg(value_name = "NAME")]
    pub name: String,

    /// Namespace of the Service.
    #[arg(long, short = 'n', value_name = "NS")]
    pub namespace: String,
}

/// Flags of `token`.
#[derive(Debug, Clone, Args)]
pub struct TokenArgs {
    /// Replace the token with a new random one (Broker.RotateToken) and print the new one.
    /// Existing peerings are unaffected; only new handshakes need the new token.
    #[arg(long)]
    pub rotate: bool,

    /// With --rotate: seconds during which the previous token is still accepted (default 0:
    /// invalid at once).
    #[arg(long, value_name = "SECONDS", requires = "rotate", default_value_t = 0)]
    pub grace: u64,

    /// Create a join token (Broker.CreateJoinToken: accepted until --ttl passes or it is
    /// revoked) and print the whole command a new cluster runs to join this one with it:
    /// `trellisctl peer --remote-broker ADDR --token TOKEN --ca-cert-hash sha256:HEX`, with the
    /// broker address this cluster advertises and, with mutual TLS, the hash that pins its CA
    /// at first contact. Each call creates a new token.
    #[arg(long, conflicts_with = "rotate")]
    pub join: bool,

    /// With --join: how long the join token is accepted, as a number with a unit: `90s`,
    /// `30m`, `1h`, `7d` (1 second to 365 days; default 24h).
    #[arg(long, value_name = "DURATION", requires = "join", value_parser = ttl_arg)]
    pub ttl: Option<Duration>,

    /// With --join: what the join token is for, shown by --list (e.g. the joining cluster).
    #[arg(long, value_name = "TEXT", requires = "join")]
    pub description: Option<String>,

    /// List the join tokens (Broker.ListJoinTokens): id, when each expires, what it is for.
    /// Secrets are never shown again.
    #[arg(long, conflicts_with_all = ["rotate", "join", "revoke"])]
    pub list: bool,

    /// Revoke the join token with this id (the part before the dot; Broker.RevokeJoinToken):
    /// refused at every handshake from now on. Existing peerings are unaffected.
    #[arg(long, value_name = "ID", conflicts_with_all = ["rotate", "join"])]
    pub revoke: Option<String>,
}

/// Flags of `peer`.
#[derive(Debug, Clone, Args)]
pub struct PeerArgs {
    /// The remote cluster's broker, as reachable from THIS cluster's broker.
    #[arg(long, env = "TRELLIS_REMOTE_BROKER", value_name = "HOST:PORT", value_parser = address_arg)]
    pub remote_broker: String,

    /// The remote cluster's peering token (`trellisctl token` run against it). A secret: prefer
    /// the environment variable.
    // Tokens are base64url and may start with '-'.
    #[arg(long, env = "TRELLIS_PEER_TOKEN", value_name = "TOKEN", hide_env_values = true,
          allow_hyphen_values = true, value_parser = token_arg)]
    pub token: String,

    /// Refuse to peer unless the remote reports this cluster ID.
    #[arg(long, value_name = "ID", value_parser = cluster_id_arg)]
    pub expected_cluster_id: Option<String>,

    /// `sha256:HEX` of the remote's CA (what `trellisctl token --join` prints): the local
    /// broker then refuses, before sending the token, a remote whose certificate does not chain
    /// to that CA. Needs mutual TLS between the clusters. Without it, first contact trusts
    /// whoever answers at --remote-broker.
    #[arg(long, env = "TRELLIS_CA_CERT_HASH", value_name = "sha256:HEX", value_parser = ca_cert_hash_arg)]
    pub ca_cert_hash: Option<String>,
}

/// Arguments of `unpeer`.
#[derive(Debug, Clone, Args)]
pub struct UnpeerArgs {
    /// ID of the full peer to unpeer.
    #[arg(value_name = "CLUSTER_ID", value_parser = cluster_id_arg)]
    pub cluster_id: String,
}

/// Arguments of `ipam`.
#[derive(Debug, Clone, Args)]
pub struct IpamArgs {
    #[command(subcommand)]
    pub action: Option<IpamAction>,
}

/// What `ipam` does besides listing.
#[derive(Debug, Clone, Subcommand)]
pub enum IpamAction {
    /// Translate an endpoint IP for a target cluster (Ipam.MapEndpointIp): the address that
    /// cluster uses to reach it. May allocate an external-CIDR address (hub path).
    Map(MapArgs),
}

/// Flags of `ipam map`.
#[derive(Debug, Clone, Args)]
pub struct MapArgs {
    /// The cluster the endpoint is reflected to.
    #[arg(long, value_name = "ID", value_parser = cluster_id_arg)]
    pub cluster_id: String,

    /// The endpoint IP as this cluster addresses it.
    #[arg(long, value_name = "IP")]
    pub ip: IpAddr,

    /// Map as the endpoint's home IPAM on behalf of a hub (local pod CIDR path only).
    #[arg(long)]
    pub induced: bool,
}

/// Flags and subcommand of `endpoints`.
#[derive(Debug, Clone, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct EndpointsArgs {
    /// Only slices reflected by this source cluster.
    #[arg(long, value_name = "ID", value_parser = cluster_id_arg)]
    pub source: Option<String>,

    /// Only slices in this namespace.
    #[arg(long, value_name = "NAMESPACE")]
    pub namespace: Option<String>,

    #[command(subcommand)]
    pub action: Option<EndpointsAction>,
}

/// What `endpoints` does besides listing.
#[derive(Debug, Clone, Subcommand)]
pub enum EndpointsAction {
    /// Translate a local EndpointSlice for a target cluster (EndpointMapper.ReflectEndpointSlice)
    /// and show how each address was translated.
    Reflect(ReflectArgs),
}

/// Flags of `endpoints reflect`.
#[derive(Debug, Clone, Args)]
pub struct ReflectArgs {
    /// The target cluster (a full peer).
    #[arg(long, value_name = "ID", value_parser = cluster_id_arg)]
    pub target: String,

    /// A `discovery.k8s.io/v1` EndpointSlice in JSON (e.g. from `kubectl get endpointslice NAME
    /// -o json`); its `kubernetes.io/service-name` label names the Service. `-` reads stdin.
    #[arg(long, value_name = "PATH")]
    pub file: PathBuf,

    /// Also push the translated slice to the target's endpoints service.
    #[arg(long)]
    pub deliver: bool,
}

fn local(port: u16) -> String {
    format!("127.0.0.1:{port}")
}

fn address_arg(value: &str) -> Result<String, String> {
    trellis_api::address::required("value", value).map_err(|e| reason(&e))
}

fn cluster_id_arg(value: &str) -> Result<String, String> {
    trellis_api::ClusterId::parse("value", value)
        .map(|id| id.to_string())
        .map_err(|e| reason(&e))
}

fn ca_cert_hash_arg(value: &str) -> Result<String, String> {
    trellis_runtime::tls::CaCertHash::parse("value", value)
        .map(|h| h.to_string())
        .map_err(|e| reason(&e))
}

fn token_arg(value: &str) -> Result<String, String> {
    if value.trim().is_empty() {
        return Err("is empty".into());
    }
    Ok(value.trim().to_owned())
}

fn reason(error: &trellis_api::Error) -> String {
    match error {
        trellis_api::Error::InvalidArgument { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}

/// A join token's time to live: a whole number and one unit of `s`, `m`, `h`, `d`.
fn ttl_arg(value: &str) -> Result<Duration, String> {
    let value = value.trim();
    let split = value.len().saturating_sub(1);
    let (number, unit) = value.split_at(split);
    let unit_secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("{value:?} needs a unit: s, m, h or d (e.g. 1h)")),
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{value:?} is not a whole number followed by s, m, h or d"))?;
    let secs = n
        .checked_mul(unit_secs)
        .filter(|s| (1..=365 * 86_400).contains(s))
        .ok_or_else(|| format!("{value} is out of range (1 second to 365 days)"))?;
    Ok(Duration::from_secs(secs))
}

/// Whole seconds or fractions, more than 0 and at most an hour.
fn timeout_arg(value: &str) -> Result<Duration, String> {
    let seconds: f64 = value
        .parse()
        .map_err(|_| format!("{value:?} is not a number of seconds"))?;
    if !(seconds > 0.0 && seconds <= 3600.0) {
        return Err(format!(
            "{value} is out of range (more than 0, at most 3600)"
        ));
    }
    Ok(Duration::from_secs_f64(seconds))
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;

    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("trellisctl").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_are_the_design_ports_on_loopback() {
        let cli = parse(&["status"]).expect("parses");
        let g = &cli.globals;
        assert_eq!(g.discovery, "127.0.0.1:7101");
        assert_eq!(g.broker, "127.0.0.1:7102");
        assert_eq!(g.forwarder, "127.0.0.1:7103");
        assert_eq!(g.ipam, "127.0.0.1:7104");
        assert_eq!(g.endpoints, "127.0.0.1:7105");
        assert_eq!(g.gateway, "127.0.0.1:7106");
        assert_eq!(g.output, OutputFormat::Table);
        assert_eq!(g.timeout, Duration::from_secs(10));
        assert!(matches!(
            cli.command,
            Command::Status(StatusArgs { all: false })
        ));
    }

    #[test]
    fn global_flags_go_before_or_after_the_subcommand() {
        let before = parse(&["--broker", "hub:7102", "-o", "json", "token"]).expect("before");
        let after = parse(&["token", "--broker", "hub:7102", "--output", "json"]).expect("after");
        for cli in [before, after] {
            assert_eq!(cli.globals.broker, "hub:7102");
            assert_eq!(cli.globals.output, OutputFormat::Json);
            assert_eq!(cli.globals.target(Service::Broker).address, "hub:7102");
        }
    }

    #[test]
    fn peer_needs_a_remote_broker_and_a_token() {
        let cli = parse(&[
            "peer",
            "--remote-broker",
            "10.0.0.1:7102",
            "--token",
            "s3cret",
            "--expected-cluster-id",
            "hub",
        ])
        .expect("parses");
        let Command::Peer(peer) = cli.command else {
            panic!("not peer: {cli:?}");
        };
        assert_eq!(peer.remote_broker, "10.0.0.1:7102");
        assert_eq!(peer.token, "s3cret");
        assert_eq!(peer.expected_cluster_id.as_deref(), Some("hub"));

        let missing = parse(&["peer", "--remote-broker", "10.0.0.1:7102"]).expect_err("no token");
        assert_eq!(missing.kind(), ErrorKind::MissingRequiredArgument);
        assert!(missing.to_string().contains("--token"), "{missing}");
    }

    #[test]
    fn malformed_values_are_usage_errors_naming_the_flag() {
        for (args, flag) in [
            (&["status", "--broker", "http://h:1"][..], "--broker"),
            (&["status", "--gateway", "nohostport"][..], "--gateway"),
            (&["status", "--timeout", "0"][..], "--timeout"),
            (&["status", "--timeout", "soon"][..], "--timeout"),
            (&["status", "--output", "yaml"][..], "--output"),
            (&["unpeer", "bad/id"][..], "CLUSTER_ID"),
            (
                &["ipam", "map", "--cluster-id", "a", "--ip", "10.0.0.300"][..],
                "--ip",
            ),
            (&["token", "--grace", "5"][..], "--rotate"),
            (&["token", "--ttl", "1h"][..], "--join"),
            (&["token", "--join", "--ttl", "1"][..], "--ttl"),
            (&["token", "--join", "--ttl", "0s"][..], "--ttl"),
            (&["token", "--join", "--ttl", "400d"][..], "--ttl"),
            (&["token", "--join", "--ttl", "1w"][..], "--ttl"),
            (&["token", "--list", "--join"][..], "--list"),
        ] {
            let err = parse(args).expect_err("refused");
            assert_eq!(err.exit_code(), 2, "{args:?}");
            assert!(err.to_string().contains(flag), "{args:?}: {err}");
        }
    }

    #[test]
    fn join_token_lifetimes_take_a_unit() {
        for (text, secs) in [("90s", 90), ("30m", 1800), ("1h", 3600), ("7d", 604_800)] {
            let cli = parse(&["token", "--join", "--ttl", text]).expect("parses");
            let Command::Token(args) = cli.command else {
                panic!("not token");
            };
            assert_eq!(args.ttl, Some(Duration::from_secs(secs)), "{text}");
        }
    }

    #[test]
    fn subcommands_with_their_own_subcommands() {
        let cli = parse(&[
            "ipam",
            "map",
            "--cluster-id",
            "leaf-a",
            "--ip",
            "10.0.3.7",
            "--induced",
        ])
        .expect("parses");
        let Command::Ipam(IpamArgs {
            action: Some(IpamAction::Map(map)),
        }) = cli.command
        else {
            panic!("not ipam map");
        };
        assert_eq!(map.cluster_id, "leaf-a");
        assert_eq!(map.ip.to_string(), "10.0.3.7");
        assert!(map.induced);

        let cli = parse(&["ipam"]).expect("plain ipam lists");
        assert!(matches!(
            cli.command,
            Command::Ipam(IpamArgs { action: None })
        ));

        let cli = parse(&["endpoints", "--source", "hub"]).expect("list filter");
        let Command::Endpoints(e) = cli.command else {
            panic!("not endpoints");
        };
        assert_eq!(e.source.as_deref(), Some("hub"));
        assert!(e.action.is_none());

        let cli = parse(&["endpoints", "reflect", "--target", "c", "--file", "-"]).expect("ok");
        let Command::Endpoints(EndpointsArgs {
            action: Some(EndpointsAction::Reflect(r)),
            ..
        }) = cli.command
        else {
            panic!("not reflect");
        };
        assert_eq!(r.target, "c");
        assert!(!r.deliver);
    }

    #[test]
    fn timeouts_accept_fractions() {
        let cli = parse(&["status", "--timeout", "0.25"]).expect("parses");
        assert_eq!(cli.globals.timeout, Duration::from_millis(250));
    }

    #[test]
    fn help_mentions_every_flag_and_subcommand() {
        let help = parse(&["--help"]).expect_err("help is an 'error'");
        assert_eq!(help.exit_code(), 0);
        let text = help.to_string();
        for word in [
            "--discovery",
            "--broker",
            "--forwarder",
            "--ipam",
            "--endpoints",
            "--gateway",
            "--output",
            "--timeout",
            "token",
            "peer",
            "unpeer",
            "status",
            "diagnose",
            "ipam",
            "endpoints",
            "TRELLIS_BROKER",
        ] {
            assert!(text.contains(word), "help lacks {word}:\n{text}");
        }
    }
}
