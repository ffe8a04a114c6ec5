//! The one start-up sequence every service runs, so a service's `start` keeps only what is its
//! own (its core, its routes, its background tasks):
//!
//! 1. [`Bootstrap::open`]: the cluster's identity ([`BaseConfig::identity`], one spelling of
//!    its flags), the gRPC and `/metrics` listeners from the base flags with the local token
//!    read once, then the store; bound before the store, because the metrics registry the
//!    listeners bring is what the store and every channel record into ([`Bootstrap::bind`]
//!    alone for a service without a store);
//!    and mutual TLS for other clusters when the flags ask for it;
//! 2. [`Bootstrap::local_channel`]: channels to the cluster's other services, counted in this
//!    service's metrics;
//! 3. [`Bootstrap::cluster_facing`]: the mutual-TLS listener, its trust sync and certificate
//!    reloader (ADR 0014), and which methods other clusters may call on the plaintext port;
//! 4. [`Bootstrap::spawn`]: background tasks, always spawned the runtime's way and supervised
//!    with the server;
//! 5. [`Bootstrap::serve`]: serving, returning one generic [`Started`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio::task::JoinHandle;
use tonic::service::Routes;
use trellis_api::ClusterIdentity;

use crate::client::{Timeouts, TracedChannel};
use crate::config::{BaseConfig, CommonConfig, PeerTlsConfig, ports};
use crate::local_auth::LocalToken;
use crate::metrics::Metrics;
use crate::peer::{Authz, PeerMethods};
use crate::server::{GrpcServer, PeerListener};
use crate::shutdown::Shutdown;
use crate::supervise::Fault;
use crate::tls::{ExpiryCollector, PeerTls};

impl BaseConfig {
    /// The local cluster's identity from `--cluster-id` and `--cluster-name`; errors name
    /// the flag.
    pub fn identity(&self) -> anyhow::Result<ClusterIdentity> {
        Ok(ClusterIdentity::parse(
            "--cluster-id",
            &self.cluster_id,
            "--cluster-name",
            self.cluster_name(),
        )?)
    }
}

/// What the start-up sequence needs to know of a service: its name and default ports.
#[derive(Debug, Clone, Copy)]
pub struct Service {
    /// For messages (`discovery`, `broker`, ...).
    pub name: &'static str,
    /// The plaintext gRPC port when `--listen` does not give one.
    pub port: u16,
    /// The `/metrics` port when `--metrics-listen` does not give one.
    pub metrics_port: u16,
}

impl Service {
    pub const DISCOVERY: Self = Self::new("discovery", ports::DISCOVERY, ports::DISCOVERY_METRICS);
    pub const BROKER: Self = Self::new("broker", ports::BROKER, ports::BROKER_METRICS);
    pub const FORWARDER: Self = Self::new("forwarder", ports::FORWARDER, ports::FORWARDER_METRICS);
    pub const IPAM: Self = Self::new("ipam", ports::IPAM, ports::IPAM_METRICS);
    pub const ENDPOINTS: Self = Self::new("endpoints", ports::ENDPOINTS, ports::ENDPOINTS_METRICS);
    pub const GATEWAY: Self = Self::new("gateway", ports::GATEWAY, ports::GATEWAY_METRICS);
    pub const ROUTE: Self = Self::new("route", ports::ROUTE, ports::ROUTE_METRICS);

    const fn new(name: &'static str, port: u16, metrics_port: u16) -> Self {
        Self {
            name,
            port,
            metrics_port,
        }
    }
}

/// What a stateful service opens at start: its cluster's identity, its store, and mutual TLS
/// for other clusters when its `--tls-*` flags ask for it.
#[derive(Debug)]
pub struct Opened {
    pub identity: ClusterIdentity,
    pub store: trellis_store::SharedStore,
    pub tls: Option<PeerTls>,
}

/// The metric saying whether `service` serves other clusters in plaintext, and at every start
/// the warning when it does (a plaintext fabric must never go unnoticed).
fn plaintext_peering(metrics: &Metrics, service: &'static str, plaintext: bool) {
    if plaintext {
        tracing::warn!(
            service,
            "other clusters are served and called in plaintext (--insecure-plaintext-peering): \
             anyone who reaches the cluster-facing ports can claim to be any peer"
        );
    }
    let gauge = Family::<Vec<(&'static str, &'static str)>, Gauge>::default();
    gauge
        .get_or_create(&vec![("service", service)])
        .set(i64::from(plaintext));
    metrics.register(
        PLAINTEXT_PEERING_METRIC,
        "1 when the service serves and calls other clusters without mutual TLS \
         (--insecure-plaintext-peering), else 0",
        gauge,
    );
}

/// The name of the gauge [`plaintext_peering`] registers.
pub const PLAINTEXT_PEERING_METRIC: &str = "trellis_insecure_plaintext_peering";

/// A service being started: bound, not yet serving.
#[derive(Debug)]
pub struct Bootstrap {
    service: &'static str,
    tls: Option<(PeerTls, PeerTlsConfig)>,
    server: GrpcServer,
    shutdown: Shutdown,
    grace: Duration,
    local_token: LocalToken,
    background: Vec<JoinHandle<()>>,
}

impl Bootstrap {
    /// Binds `service`'s gRPC and `/metrics` listeners from its base flags (`--listen`,
    /// `--pod-ip`, `--metrics-listen`, falling back to the service's default ports) and
    /// requires the local token of `--local-token-file` on the plaintext listener. What a
    /// service without a store (the route agent) starts with.
    pub async fn bind(
        service: Service,
        base: &BaseConfig,
        shutdown: &Shutdown,
    ) -> anyhow::Result<Self> {
        let local_token = base.local_token()?;
        let server = GrpcServer::bind(base.listen_addr(service.port))
            .await?
            .with_metrics_listener(base.metrics_listen(service.metrics_port))
            .await?
            .with_local_token(local_token.clone());
        Ok(Self {
            service: service.name,
            tls: None,
            server,
            shutdown: shutdown.clone(),
            grace: base.shutdown_grace(),
            local_token,
            background: Vec::new(),
        })
    }

    /// [`Self::bind`], then the cluster's identity, the service's store (`--store`), whose
    /// operations count in this service's metrics, and the mutual-TLS setup of `tls` (the
    /// service's `--tls-*` flags; `None` for a service that never faces other clusters), kept
    /// for [`Self::cluster_facing`]: what every stateful service starts with.
    pub async fn open<'a>(
        service: Service,
        common: &CommonConfig,
        tls: impl Into<Option<&'a PeerTlsConfig>>,
        shutdown: &Shutdown,
    ) -> anyhow::Result<(Self, Opened)> {
        let tls = tls.into();
        let identity = common.identity()?;
        let mut boot = Self::bind(service, common, shutdown).await?;
        let store = common.open_store(boot.metrics()).await?;
        let tls = match tls {
            Some(config) => {
                let loaded = config.load(identity.id.as_str(), service.name)?;
                if let Some(tls) = &loaded {
                    boot.metrics()
                        .register_collector(ExpiryCollector::new(service.name, tls.clone()));
                }
                plaintext_peering(boot.metrics(), service.name, loaded.is_none());
                boot.tls = loaded.clone().map(|loaded| (loaded, config.clone()));
                loaded
            }
            None => None,
        };
        Ok((
            boot,
            Opened {
                identity,
                store,
                tls,
            },
        ))
    }

    /// A channel to another service of this cluster at `address` (named by the flag `field`
    /// in errors), sending the local token, its calls counted in this service's metrics.
    pub fn local_channel(
        &self,
        field: &str,
        address: &str,
        timeouts: Timeouts,
    ) -> anyhow::Result<TracedChannel> {
        Ok(crate::client::local_channel(
            field,
            address,
            timeouts,
            &self.local_token,
            self.metrics(),
        )?)
    }

    /// Makes the service cluster-facing for `methods` (ADR 0014). With TLS loaded
    /// ([`Self::open`]) and `--peer-listen` given: the mutual-TLS listener, a task keeping
    /// the pinned CAs equal to the full peers `discovery` reports (required then), a task
    /// reloading renewed certificate files, and authorization on. Either way, other clusters
    /// may call `methods` on the plaintext port without the local token (with TLS their
    /// handlers refuse them there).
    pub async fn cluster_facing(
        &mut self,
        discovery: Option<TracedChannel>,
        methods: PeerMethods,
    ) -> anyhow::Result<Authz> {
        let Some((tls, config)) = &self.tls else {
            self.server.set_cluster_facing(None, methods);
            return Ok(Authz::off());
        };
        let Some(listen) = config.peer_listen else {
            self.server.set_cluster_facing(None, methods);
            return Ok(Authz::off());
        };
        let Some(discovery) = discovery else {
            anyhow::bail!("--peer-listen needs --discovery (where the peers' CAs are pinned)");
        };
        let trust_sync =
            crate::peer::spawn_trust_sync(discovery, tls.trust().clone(), self.shutdown.clone());
        let reloader = match config.managed(tls.cluster_id(), self.service) {
            Some(managed) => {
                managed.spawn_renewer(tls.clone(), config.reload_period(), self.shutdown.clone())
            }
            None => tls.spawn_reloader(config.reload_period(), self.shutdown.clone()),
        };
        let peer = PeerListener::bind(listen, tls.clone(), methods).await?;
        let authz = Authz::on(tls.trust().clone());
        self.background.extend([trust_sync, reloader]);
        self.server.set_cluster_facing(Some(peer), methods);
        Ok(authz)
    }

    /// This service's metrics: register domain metrics here.
    pub fn metrics(&self) -> &Metrics {
        self.server.metrics()
    }

    /// The local token this service requires and sends (off without `--local-token-file`).
    pub fn local_token(&self) -> &LocalToken {
        &self.local_token
    }

    /// Where components report that the service can no longer do its job (see
    /// [`GrpcServer::fault`]).
    pub fn fault(&self) -> &Fault {
        self.server.fault()
    }

    /// The plaintext listener's address, as bound (the real port when 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// The mutual-TLS listener's address, once [`Self::cluster_facing`] bound one.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.server.peer_addr()
    }

    /// The shutdown every task of the service watches.
    pub fn shutdown(&self) -> &Shutdown {
        &self.shutdown
    }

    /// Spawns a background task of the service the runtime's way (under the service's own
    /// subscriber), supervised with the server: one that panics or returns before the
    /// shutdown fails the service (see [`GrpcServer::spawn`]).
    pub fn spawn<F>(&mut self, task: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.background.push(crate::telemetry::spawn(task));
    }

    /// Starts serving `routes` (whose gRPC service names are `services`, reported healthy)
    /// until the shutdown, supervising the background tasks.
    pub fn serve<C>(
        self,
        routes: Routes,
        services: &'static [&'static str],
        core: Arc<C>,
    ) -> Started<C> {
        let addr = self.addr();
        let peer_addr = self.peer_addr();
        let metrics_addr = self.server.metrics_addr();
        let task = self
            .server
            .spawn(routes, services, self.shutdown, self.grace, self.background);
        Started {
            service: self.service,
            addr,
            peer_addr,
            metrics_addr,
            core,
            task,
        }
    }
}

/// A running service.
#[derive(Debug)]
pub struct Started<C> {
    /// Which service (`discovery`, `broker`, ...), for messages.
    pub service: &'static str,
    /// The plaintext listener's address.
    pub addr: SocketAddr,
    /// The mutual-TLS listener for other clusters, when TLS is on.
    pub peer_addr: Option<SocketAddr>,
    /// The `/metrics` listener, unless `--metrics-listen off`.
    pub metrics_addr: Option<SocketAddr>,
    /// The domain core, for in-process callers (the lab, tests).
    pub core: Arc<C>,
    /// Finishes when the server and every background task have stopped.
    pub task: JoinHandle<anyhow::Result<()>>,
}

impl<C> Started<C> {
    /// Waits until the service has stopped; its error, if it failed.
    pub async fn finished(self) -> anyhow::Result<()> {
        let service = self.service;
        self.task
            .await
            .with_context(|| format!("{service} server task"))?
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        common: CommonConfig,
    }

    fn common(args: &[&str]) -> CommonConfig {
        let mut all = vec!["test", "--store", "memory://", "--metrics-listen", "off"];
        all.extend_from_slice(args);
        Flags::try_parse_from(all).expect("flags").common
    }

    #[derive(Parser)]
    struct TlsFlags {
        #[command(flatten)]
        tls: PeerTlsConfig,
    }

    fn tls(args: &[&str]) -> PeerTlsConfig {
        let mut all = vec!["test"];
        all.extend_from_slice(args);
        TlsFlags::try_parse_from(all).expect("flags").tls
    }

    #[tokio::test]
    async fn a_cluster_facing_service_without_tls_refuses_to_start_unless_plaintext_is_asked_for() {
        let flags = common(&["--cluster-id", "a", "--listen", "127.0.0.1:0"]);
        let shutdown = Shutdown::new();
        let err = Bootstrap::open(Service::BROKER, &flags, &tls(&[]), &shutdown)
            .await
            .expect_err("no TLS and no --insecure-plaintext-peering");
        let text = format!("{err:#}");
        assert!(
            text.contains("--tls-dir") && text.contains("--insecure-plaintext-peering"),
            "the error says what to give: {text}"
        );

        let plaintext = tls(&["--insecure-plaintext-peering"]);
        let (boot, opened) = Bootstrap::open(Service::BROKER, &flags, &plaintext, &shutdown)
            .await
            .expect("plaintext when asked for");
        assert!(opened.tls.is_none());
        let metrics = boot.metrics().render().await;
        assert!(
            metrics.contains(&format!(
                "{PLAINTEXT_PEERING_METRIC}{{service=\"broker\"}} 1"
            )),
            "{metrics}"
        );

        let dir = tempfile::tempdir().expect("dir");
        let dir = dir.path().to_str().expect("utf-8");
        let secure = tls(&["--peer-listen", "127.0.0.1:0", "--tls-dir", dir]);
        let (boot, opened) = Bootstrap::open(Service::BROKER, &flags, &secure, &shutdown)
            .await
            .expect("mutual TLS");
        assert!(opened.tls.is_some());
        let metrics = boot.metrics().render().await;
        assert!(
            metrics.contains(&format!(
                "{PLAINTEXT_PEERING_METRIC}{{service=\"broker\"}} 0"
            )),
            "{metrics}"
        );

        let both = TlsFlags::try_parse_from([
            "test",
            "--insecure-plaintext-peering",
            "--peer-listen",
            "127.0.0.1:0",
        ]);
        assert!(
            both.is_err(),
            "plaintext and a TLS listener at once is refused"
        );
    }

    #[test]
    fn a_bad_cluster_id_is_refused_naming_the_flag_as_users_type_it() {
        let err = common(&["--cluster-id", "no spaces"])
            .identity()
            .expect_err("refused");
        assert!(err.to_string().contains("--cluster-id"), "{err}");
        let err = common(&["--cluster-id", "a", "--cluster-name", "bad\u{7}"])
            .identity()
            .expect_err("refused");
        assert!(err.to_string().contains("--cluster-name"), "{err}");
    }

    #[tokio::test]
    async fn a_service_without_tls_has_no_peer_listener_and_a_task_that_returns_fails_it() {
        let flags = common(&["--cluster-id", "a", "--listen", "127.0.0.1:0"]);
        let shutdown = Shutdown::new();
        let (mut boot, opened) = Bootstrap::open(Service::IPAM, &flags, None, &shutdown)
            .await
            .expect("opens");
        assert_eq!(opened.identity.id.as_str(), "a");
        assert_ne!(
            boot.addr().port(),
            0,
            "the real port is known before serving"
        );
        let authz = boot
            .cluster_facing(
                None,
                PeerMethods {
                    authenticated: &[],
                    anonymous: &[],
                },
            )
            .await
            .expect("no TLS: nothing to bind");
        assert!(!authz.enabled());
        assert_eq!(boot.peer_addr(), None);
        boot.spawn(async {});
        let started = boot.serve(Routes::default(), &[], Arc::new(()));
        let err = tokio::time::timeout(Duration::from_secs(10), started.finished())
            .await
            .expect("a task that returns early fails the service at once")
            .expect_err("failed");
        let text = format!("{err:#}");
        assert!(text.contains("background task"), "{text}");
    }
}
