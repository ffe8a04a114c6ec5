//! Flags every service shares. Each flag is also read from `TRELLIS_<FLAG>`; a service's own
//! config struct embeds [`CommonConfig`] with `#[command(flatten)]`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;

// The format belongs to the logs; the flag that picks it is here, and so is the name callers
// have always used for it.
pub use crate::telemetry::LogFormat;

/// A clap value parser for `host:port` flags (another service's address): refuses what no
/// client could dial, with the reason.
pub fn address_arg(value: &str) -> Result<String, String> {
    trellis_api::address::required("value", value).map_err(|e| match e {
        trellis_error::Error::InvalidArgument { reason, .. } => reason,
        other => other.to_string(),
    })
}

/// Flags of every Trellis process with a gRPC server, stateful or not (the route agent keeps
/// no store).
#[derive(Debug, Clone, Args)]
pub struct BaseConfig {
    /// Address the plaintext gRPC server (this cluster's own callers) listens on. Defaults to
    /// --pod-ip, or 127.0.0.1 without it, and the service's own port (discovery 7101, broker
    /// 7102, forwarder 7103, ipam 7104, endpoints 7105, gateway 7106, route 7107), never to
    /// every interface: peers' pods are routed into the pod network. Port 0 picks a free one,
    /// logged at start. 0.0.0.0 only where the network around it is closed (docker-compose).
    #[arg(long, env = "TRELLIS_LISTEN", value_name = "HOST:PORT")]
    pub listen: Option<SocketAddr>,

    /// This pod's IP (in Kubernetes from the downward API, `status.podIP`): the default host
    /// of --listen, so the plaintext port is reachable from the cluster's pods (subject to the
    /// NetworkPolicies) but not on other interfaces.
    #[arg(long, env = "TRELLIS_POD_IP", value_name = "IP")]
    pub pod_ip: Option<IpAddr>,

    /// File holding this cluster's local token (16-256 printable ASCII characters; in
    /// Kubernetes Secret trellis-local-token). When set, every call on the plaintext listener
    /// except health, reflection and the cluster-facing methods must carry
    /// `authorization: Bearer <token>` (else UNAUTHENTICATED), and this service sends it to
    /// the other local services it calls. Never logged.
    #[arg(long, env = "TRELLIS_LOCAL_TOKEN_FILE", value_name = "FILE")]
    pub local_token_file: Option<PathBuf>,

    /// ID of the local cluster (letters, digits, '.', '_' and '-'; at most 128). Tags every
    /// log line and span.
    #[arg(long, env = "TRELLIS_CLUSTER_ID", value_name = "ID")]
    pub cluster_id: String,

    /// Human-readable name of the local cluster; defaults to the cluster ID.
    #[arg(long, env = "TRELLIS_CLUSTER_NAME", value_name = "NAME")]
    pub cluster_name: Option<String>,

    /// Address of the Prometheus `/metrics` HTTP listener, or `off`. Defaults to 0.0.0.0 and
    /// the service's own metrics port (discovery 9101, broker 9102, forwarder 9103, ipam 9104,
    /// endpoints 9105, gateway 9106, route agent 9107; a default port already taken only
    /// costs a warning); port 0 picks a free one, logged at start.
    #[arg(long, env = "TRELLIS_METRICS_LISTEN", value_name = "HOST:PORT|off")]
    pub metrics_listen: Option<crate::metrics::MetricsListen>,

    /// Log line format on stderr. Verbosity follows `RUST_LOG` (default `info`). Spans are
    /// exported over OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (e.g.
    /// `http://127.0.0.1:4317`).
    #[arg(long, env = "TRELLIS_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// How long in-flight requests may take to finish after SIGTERM/SIGINT before the
    /// server stops anyway, in seconds.
    #[arg(
        long,
        env = "TRELLIS_SHUTDOWN_GRACE",
        value_name = "SECONDS",
        default_value_t = 10
    )]
    pub shutdown_grace: u64,

    /// Threads the service's async runtime runs on (1-1024). Defaults to 1, except for the
    /// gateway, which uses one per core (or `TOKIO_WORKER_THREADS`). A control-plane service
    /// spends microseconds of CPU per request and mostly waits on other services; on one
    /// thread it saves the wake-ups and frees across threads that a pool costs (ADR 0015).
    #[arg(
        long,
        env = "TRELLIS_WORKER_THREADS",
        value_name = "N",
        value_parser = clap::value_parser!(u16).range(1..=1024)
    )]
    pub worker_threads: Option<u16>,
}

/// Flags common to all Trellis services that keep state: [`BaseConfig`] (reachable through
/// `Deref`, so `common.listen` works) plus the store.
#[derive(Debug, Clone, Args)]
pub struct CommonConfig {
    #[command(flatten)]
    pub base: BaseConfig,

    /// Where this service keeps its state: `etcd://HOST:PORT[,HOST:PORT...]/PREFIX` (its own
    /// etcd in production; PREFIX isolates services sharing one), the same with `etcds://` for
    /// etcd over TLS (see --store-ca-cert), or `memory://` (lost on exit; for the lab and
    /// tests).
    #[arg(long, env = "TRELLIS_STORE", value_name = "URL")]
    pub store: String,

    #[command(flatten)]
    pub store_auth: StoreAuthConfig,
}

impl std::ops::Deref for CommonConfig {
    type Target = BaseConfig;

    fn deref(&self) -> &BaseConfig {
        &self.base
    }
}

/// Credentials for the service's etcd: TLS (production etcds require client certificates) and
/// etcd's user/password authentication. None of them is needed for `memory://` or a plaintext
/// `etcd://` without authentication.
#[derive(Debug, Clone, Default, Args)]
pub struct StoreAuthConfig {
    /// The CA certificate (PEM) that signed etcd's server certificate. Required with
    /// `etcds://`, refused without it.
    #[arg(long, env = "TRELLIS_STORE_CA_CERT", value_name = "FILE")]
    pub store_ca_cert: Option<PathBuf>,

    /// Client certificate (PEM) to present to etcd (for etcd's `--client-cert-auth`).
    #[arg(
        long,
        env = "TRELLIS_STORE_CERT",
        value_name = "FILE",
        requires_all = ["store_key", "store_ca_cert"]
    )]
    pub store_cert: Option<PathBuf>,

    /// Private key (PEM) of --store-cert. Never logged.
    #[arg(
        long,
        env = "TRELLIS_STORE_KEY",
        value_name = "FILE",
        requires = "store_cert"
    )]
    pub store_key: Option<PathBuf>,

    /// etcd user name, when etcd's authentication is enabled (with --store-password).
    #[arg(
        long,
        env = "TRELLIS_STORE_USER",
        value_name = "NAME",
        requires = "store_password"
    )]
    pub store_user: Option<String>,

    /// Password of --store-user. Prefer the environment variable (TRELLIS_STORE_PASSWORD, e.g.
    /// from a Secret) to the flag, which other users of the host can read. Never logged.
    #[arg(
        long,
        env = "TRELLIS_STORE_PASSWORD",
        value_name = "PASSWORD",
        hide_env_values = true,
        requires = "store_user"
    )]
    pub store_password: Option<Secret>,
}

/// A value that never appears in `Debug` output or logs.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    /// The secret itself.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl StoreAuthConfig {
    /// Reads the files the flags name; an unreadable file is an error naming its flag.
    pub fn load(&self) -> anyhow::Result<trellis_store::EtcdAuth> {
        let read = |flag: &str, path: &PathBuf| {
            std::fs::read(path).with_context(|| format!("{flag}: cannot read {}", path.display()))
        };
        let tls = match &self.store_ca_cert {
            None => None,
            Some(ca) => Some(trellis_store::EtcdTls {
                ca_pem: read("--store-ca-cert", ca)?,
                identity: match (&self.store_cert, &self.store_key) {
                    (Some(cert), Some(key)) => {
                        Some((read("--store-cert", cert)?, read("--store-key", key)?))
                    }
                    _ => None,
                },
            }),
        };
        let user = match (&self.store_user, &self.store_password) {
            (Some(user), Some(password)) => Some((user.clone(), password.expose().to_owned())),
            _ => None,
        };
        Ok(trellis_store::EtcdAuth { tls, user })
    }
}

/// Mutual TLS towards other clusters (ADR 0014), required unless plaintext is asked for. A
/// service with these flags serves its cluster-facing RPCs on `--peer-listen` over mutual TLS
/// (what discovery should advertise to peers), refuses them on the plaintext `--listen` (keep
/// that one inside the cluster), and calls other clusters over mutual TLS.
#[derive(Debug, Clone, Default, Args)]
pub struct PeerTlsConfig {
    /// Serve other clusters' calls on the plaintext --listen port and call theirs in
    /// plaintext, without mutual TLS: anyone who reaches the port can claim to be any peer.
    /// Only for a closed network (a lab, a test). Warned about at every start, shown by
    /// `trellisctl status` and `trellisctl diagnose`, and exported as
    /// trellis_insecure_plaintext_peering. Without it a service refuses to start unless
    /// --peer-listen with --tls-dir (or the three --tls-* files) is given.
    #[arg(
        long,
        env = "TRELLIS_INSECURE_PLAINTEXT_PEERING",
        conflicts_with_all = ["peer_listen", "tls_dir", "tls_ca_cert", "tls_cert", "tls_key"]
    )]
    pub insecure_plaintext_peering: bool,

    /// Address of the mutual-TLS listener for other clusters. Requires --tls-dir, or the three
    /// files --tls-ca-cert, --tls-cert and --tls-key.
    #[arg(long, env = "TRELLIS_PEER_LISTEN", value_name = "HOST:PORT")]
    pub peer_listen: Option<SocketAddr>,

    /// A directory the cluster's services share, where Trellis keeps the cluster's CA (created
    /// by the first service to start) and each service's certificate, issued from it at start
    /// and renewed when a third of --tls-cert-lifetime is left, without a restart. Instead of
    /// the three --tls-* files.
    #[arg(
        long,
        env = "TRELLIS_TLS_DIR",
        value_name = "DIR",
        requires = "peer_listen",
        conflicts_with_all = ["tls_ca_cert", "tls_cert", "tls_key"]
    )]
    pub tls_dir: Option<PathBuf>,

    /// With --tls-dir: how long each certificate Trellis issues is valid, in seconds (default
    /// 7 days; renewed when a third is left).
    #[arg(
        long,
        env = "TRELLIS_TLS_CERT_LIFETIME",
        value_name = "SECONDS",
        default_value_t = 7 * 24 * 3600,
        value_parser = clap::value_parser!(u64).range(3..)
    )]
    pub tls_cert_lifetime: u64,

    /// This cluster's CA certificate (PEM): sent to peers at the handshake, and what our own
    /// certificate must chain to.
    #[arg(
        long,
        env = "TRELLIS_TLS_CA_CERT",
        value_name = "FILE",
        requires = "peer_listen"
    )]
    pub tls_ca_cert: Option<PathBuf>,

    /// This service's certificate (PEM), issued by the cluster CA, naming
    /// `spiffe://trellis/cluster/<cluster-id>/<service>`. Re-read when it changes (renewal).
    #[arg(
        long,
        env = "TRELLIS_TLS_CERT",
        value_name = "FILE",
        requires = "peer_listen"
    )]
    pub tls_cert: Option<PathBuf>,

    /// This service's private key (PEM). Never logged.
    #[arg(
        long,
        env = "TRELLIS_TLS_KEY",
        value_name = "FILE",
        requires = "peer_listen"
    )]
    pub tls_key: Option<PathBuf>,

    /// Seconds between two checks of the certificate and key files for a renewed pair.
    #[arg(
        long,
        env = "TRELLIS_TLS_RELOAD",
        value_name = "SECONDS",
        default_value_t = 30
    )]
    pub tls_reload: u64,
}

impl PeerTlsConfig {
    /// The certificates Trellis manages for `service`, with --tls-dir.
    pub fn managed(&self, cluster_id: &str, service: &str) -> Option<crate::tls::ManagedTls> {
        self.tls_dir.as_deref().map(|dir| {
            crate::tls::ManagedTls::new(
                dir,
                cluster_id,
                service,
                Duration::from_secs(self.tls_cert_lifetime),
            )
        })
    }

    /// The TLS setup of `service` (with --tls-dir, the CA and the certificate are made first
    /// when missing or due); `None` only with --insecure-plaintext-peering.
    pub fn load(
        &self,
        cluster_id: &str,
        service: &str,
    ) -> anyhow::Result<Option<crate::tls::PeerTls>> {
        if let Some(managed) = self.managed(cluster_id, service) {
            let files = managed.prepare().with_context(|| {
                format!(
                    "--tls-dir {}",
                    self.tls_dir.as_deref().unwrap_or(Path::new("")).display()
                )
            })?;
            return crate::tls::PeerTls::from_files(cluster_id, &files).map(Some);
        }
        let (Some(ca_cert), Some(cert), Some(key)) =
            (&self.tls_ca_cert, &self.tls_cert, &self.tls_key)
        else {
            if self.peer_listen.is_some() {
                anyhow::bail!(
                    "--peer-listen needs --tls-dir, or all of --tls-ca-cert, --tls-cert and --tls-key"
                );
            }
            if !self.insecure_plaintext_peering {
                anyhow::bail!(
                    "other clusters' calls need mutual TLS: give --peer-listen HOST:PORT with \
                     --tls-dir DIR (a CA and certificates made and renewed for you), or with \
                     --tls-ca-cert, --tls-cert and --tls-key; --insecure-plaintext-peering \
                     serves them in plaintext instead, where anyone who reaches the port can \
                     claim to be any peer"
                );
            }
            return Ok(None);
        };
        let files = crate::tls::TlsFiles {
            ca_cert: ca_cert.clone(),
            cert: cert.clone(),
            key: key.clone(),
        };
        crate::tls::PeerTls::from_files(cluster_id, &files).map(Some)
    }

    /// The renewal check period.
    pub fn reload_period(&self) -> Duration {
        Duration::from_secs(self.tls_reload.max(1))
    }
}

impl BaseConfig {
    /// The listen address, or `--pod-ip:default_port`, or `127.0.0.1:default_port`.
    pub fn listen_addr(&self, default_port: u16) -> SocketAddr {
        self.listen.unwrap_or(SocketAddr::new(
            self.pod_ip.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            default_port,
        ))
    }

    /// The local token of `--local-token-file` (off without the flag); an unreadable or
    /// unusable file is an error naming the flag.
    pub fn local_token(&self) -> anyhow::Result<crate::local_auth::LocalToken> {
        match &self.local_token_file {
            None => Ok(crate::local_auth::LocalToken::off()),
            Some(path) => crate::local_auth::LocalToken::from_file(path)
                .with_context(|| format!("--local-token-file {}", path.display())),
        }
    }

    /// Where `/metrics` is served: the flag, or `0.0.0.0:default_port`.
    pub fn metrics_listen(&self, default_port: u16) -> crate::metrics::MetricsListen {
        self.metrics_listen
            .unwrap_or(crate::metrics::MetricsListen::Default(SocketAddr::new(
                IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                default_port,
            )))
    }

    /// The cluster name, falling back to the ID.
    pub fn cluster_name(&self) -> &str {
        self.cluster_name.as_deref().unwrap_or(&self.cluster_id)
    }

    /// The drain deadline after a shutdown signal.
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_secs(self.shutdown_grace)
    }
}

impl CommonConfig {
    /// Opens the store `--store` names, with the credentials of the `--store-*` flags, its
    /// operations recorded in `metrics` (the service's, when served: ADR 0018). Every service
    /// opens its store through this.
    pub async fn open_store(
        &self,
        metrics: &crate::metrics::Metrics,
    ) -> anyhow::Result<trellis_store::SharedStore> {
        let auth = self.store_auth.load()?;
        let store = trellis_store::open_with(&self.store, &auth)
            .await
            .with_context(|| format!("opening store {}", self.store))?;
        Ok(metrics.meter_store(store))
    }
}

/// Access to the common part of a service's config.
pub trait HasCommon {
    /// The embedded common flags.
    fn common(&self) -> &CommonConfig;
}

/// Access to the flags [`crate::launch()`] needs (identity, logs, shutdown): every service has
/// them through [`HasCommon`]; a process without a store (the route agent) implements this
/// directly.
pub trait HasBase {
    /// The embedded base flags.
    fn base(&self) -> &BaseConfig;
}

impl<T: HasCommon> HasBase for T {
    fn base(&self) -> &BaseConfig {
        &self.common().base
    }
}

/// The services' default ports.
pub mod ports {
    pub const DISCOVERY: u16 = 7101;
    pub const BROKER: u16 = 7102;
    pub const FORWARDER: u16 = 7103;
    pub const IPAM: u16 = 7104;
    pub const ENDPOINTS: u16 = 7105;
    pub const GATEWAY: u16 = 7106;
    pub const ROUTE: u16 = 7107;
    /// Prometheus `/metrics` listeners (`--metrics-listen`), one per service.
    pub const DISCOVERY_METRICS: u16 = 9101;
    pub const BROKER_METRICS: u16 = 9102;
    pub const FORWARDER_METRICS: u16 = 9103;
    pub const IPAM_METRICS: u16 = 9104;
    pub const ENDPOINTS_METRICS: u16 = 9105;
    pub const GATEWAY_METRICS: u16 = 9106;
    pub const ROUTE_METRICS: u16 = 9107;
    /// WireGuard UDP.
    pub const WIREGUARD: u16 = 51840;
}

/// The range `--underlay-mtu` accepts (gateway and route agent): IPv6's minimum link MTU up to
/// a common jumbo frame. Below 1280 the tunnel (underlay − 80) could not carry a minimum IPv6
/// packet, and no node network has more than 9000.
pub const UNDERLAY_MTU: std::ops::RangeInclusive<u32> = 1280..=9000;

/// Parses an `--underlay-mtu` value (clap names the flag in its error).
pub fn underlay_mtu_arg(value: &str) -> Result<u32, String> {
    match value.parse::<u32>() {
        Ok(mtu) if UNDERLAY_MTU.contains(&mtu) => Ok(mtu),
        _ => Err(format!(
            "{value:?} is not an MTU in bytes between {} and {}",
            UNDERLAY_MTU.start(),
            UNDERLAY_MTU.end()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn underlay_mtus_are_range_checked() {
        assert_eq!(underlay_mtu_arg("1500"), Ok(1500));
        assert_eq!(underlay_mtu_arg("1280"), Ok(1280));
        assert_eq!(underlay_mtu_arg("9000"), Ok(9000));
        for bad in ["1279", "9001", "0", "-1", "1500b", ""] {
            let err = underlay_mtu_arg(bad).expect_err(bad);
            assert!(err.contains("between 1280 and 9000"), "{err}");
        }
    }

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        common: CommonConfig,
    }

    #[test]
    fn defaults_and_fallbacks() {
        let cli = Cli::try_parse_from(["x", "--store", "memory://", "--cluster-id", "c1"])
            .expect("parses");
        assert_eq!(cli.common.listen_addr(7104).port(), 7104);
        assert_eq!(cli.common.cluster_name(), "c1");
        assert_eq!(cli.common.log_format, LogFormat::Text);
        assert_eq!(cli.common.shutdown_grace(), Duration::from_secs(10));
        assert_eq!(cli.common.worker_threads, None);
    }

    #[test]
    fn worker_threads_are_range_checked() {
        let parse = |n: &str| {
            let flag = format!("--worker-threads={n}");
            Cli::try_parse_from(["x", "--store", "memory://", "--cluster-id", "c1", &flag])
        };
        assert_eq!(parse("4").expect("parses").common.worker_threads, Some(4));
        for bad in ["0", "1025", "-1", "two"] {
            let err = parse(bad).expect_err(bad);
            assert!(err.to_string().contains("--worker-threads"), "{err}");
        }
    }

    #[test]
    fn store_and_cluster_id_are_required() {
        let err = Cli::try_parse_from(["x", "--cluster-id", "c1"]).expect_err("store missing");
        assert!(err.to_string().contains("--store"), "{err}");
    }
}
