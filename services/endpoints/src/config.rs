//! Command-line flags of `trellis-endpoints` (each also `TRELLIS_<FLAG>`).

use std::time::Duration;

use clap::Parser;
use trellis_runtime::CommonConfig;
use trellis_runtime::client::Timeouts;
use trellis_runtime::config::address_arg;
use trellis_runtime::config::{HasCommon, PeerTlsConfig};

fn millis_arg(value: &str) -> Result<u64, String> {
    match value.parse::<u64>() {
        Ok(0) => Err("must be at least 1".to_owned()),
        Ok(v) => Ok(v),
        Err(e) => Err(format!("{value:?} is not a number of milliseconds: {e}")),
    }
}

/// The endpoint-mapping service of one Trellis cluster: translates EndpointSlices reflected to
/// peered clusters (asking the endpoint's home IPAM for induced peers) and writes the slices
/// peers reflect to us into Kubernetes.
#[derive(Debug, Clone, Parser)]
#[command(name = "trellis-endpoints", version, about, long_about = None)]
pub struct Config {
    #[command(flatten)]
    pub common: CommonConfig,

    /// Mutual TLS towards other clusters (ADR 0014): peers push reflected slices to
    /// --peer-listen, and remote IPAMs and endpoints services are called over mutual TLS.
    #[command(flatten)]
    pub tls: PeerTlsConfig,

    /// Address of this cluster's IPAM service (cluster lookup by IP, endpoint mapping).
    #[arg(long, env = "TRELLIS_IPAM", value_name = "HOST:PORT", value_parser = address_arg)]
    pub ipam: String,

    /// Address of this cluster's discovery service (peers, and the IPAM and endpoints addresses
    /// they advertise).
    #[arg(long, env = "TRELLIS_DISCOVERY", value_name = "HOST:PORT", value_parser = address_arg)]
    pub discovery: String,

    /// Timeout of one call to a local service (IPAM, discovery), in milliseconds.
    #[arg(long, env = "TRELLIS_LOCAL_TIMEOUT", value_name = "MS", default_value_t = 5_000, value_parser = millis_arg)]
    pub local_timeout: u64,

    /// Timeout of one call to another cluster's IPAM, in milliseconds (also its connect
    /// timeout). When it expires the endpoint takes the hub path instead of the induced one.
    #[arg(long, env = "TRELLIS_REMOTE_IPAM_TIMEOUT", value_name = "MS", default_value_t = 2_000, value_parser = millis_arg)]
    pub remote_ipam_timeout: u64,

    /// Attempts of one call to another cluster's IPAM when it is unavailable (at least 1).
    #[arg(long, env = "TRELLIS_REMOTE_IPAM_ATTEMPTS", value_name = "N", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=10))]
    pub remote_ipam_attempts: u32,

    /// Timeout of one call to another cluster's endpoints service (delivering a reflected slice),
    /// in milliseconds.
    #[arg(long, env = "TRELLIS_DELIVER_TIMEOUT", value_name = "MS", default_value_t = 10_000, value_parser = millis_arg)]
    pub deliver_timeout: u64,

    /// How often the export reconciler re-delivers every export it reflected to each peer, in
    /// milliseconds: a peer that lost what we sent (its store rebuilt, a flap of its view of
    /// us) gets it back within this time.
    #[arg(long, env = "TRELLIS_EXPORT_RESEND", value_name = "MS", default_value_t = 60_000, value_parser = millis_arg)]
    pub export_resend: u64,

    /// Connect this service to Kubernetes (the in-cluster service account, `KUBECONFIG`, or
    /// --kubeconfig): export every Service named by a `ServiceExport`
    /// (multicluster.x-k8s.io/v1beta1) with its EndpointSlices, and write what peers export
    /// to us as a `ServiceImport`, a derived Service and EndpointSlices. Without it exports come
    /// only from `ExportService` and imports are only stored.
    #[arg(long, env = "TRELLIS_KUBERNETES")]
    pub kubernetes: bool,

    /// With --kubernetes: the kubeconfig file to use instead of the in-cluster service account
    /// or `KUBECONFIG` (its current context).
    #[arg(
        long,
        env = "TRELLIS_KUBECONFIG",
        value_name = "FILE",
        requires = "kubernetes"
    )]
    pub kubeconfig: Option<std::path::PathBuf>,

    /// Serve `clusterset.local` DNS for the Services this cluster imports on this address, UDP
    /// and TCP (e.g. 0.0.0.0:53, what the cluster DNS forwards the zone to); off without it.
    #[arg(long, env = "TRELLIS_DNS_LISTEN", value_name = "HOST:PORT")]
    pub dns_listen: Option<std::net::SocketAddr>,

    /// The zone --dns-listen answers for.
    #[arg(long, env = "TRELLIS_DNS_DOMAIN", value_name = "DOMAIN", default_value = "clusterset.local", value_parser = dns_domain_arg)]
    pub dns_domain: hickory_proto::rr::Name,

    /// TTL of the DNS answers (and of cached negative answers), in seconds: how long a
    /// resolver may keep an answer after the import changed.
    #[arg(
        long,
        env = "TRELLIS_DNS_TTL",
        value_name = "SECONDS",
        default_value_t = 5
    )]
    pub dns_ttl: u32,
}

fn dns_domain_arg(value: &str) -> Result<hickory_proto::rr::Name, String> {
    let mut name = hickory_proto::rr::Name::from_ascii(value)
        .map_err(|e| format!("{value:?} is not a domain name: {e}"))?;
    if name.is_root() {
        return Err("the zone cannot be the root".to_owned());
    }
    name.set_fqdn(true);
    Ok(name)
}

impl HasCommon for Config {
    fn common(&self) -> &CommonConfig {
        &self.common
    }
}

impl Config {
    /// The Kubernetes client --kubernetes asks for: from --kubeconfig, else inferred
    /// (in-cluster service account or `KUBECONFIG`).
    pub async fn kube_client(&self) -> anyhow::Result<kube::Client> {
        use anyhow::Context as _;
        let config = match &self.kubeconfig {
            Some(path) => {
                let file = kube::config::Kubeconfig::read_from(path)
                    .with_context(|| format!("reading --kubeconfig {}", path.display()))?;
                kube::Config::from_custom_kubeconfig(
                    file,
                    &kube::config::KubeConfigOptions::default(),
                )
                .await
                .with_context(|| format!("using --kubeconfig {}", path.display()))?
            }
            None => kube::Config::infer()
                .await
                .context("no in-cluster service account and no usable KUBECONFIG")?,
        };
        Ok(kube::Client::try_from(config)?)
    }

    /// Timeouts of the local IPAM and discovery channels.
    pub fn local_timeouts(&self) -> Timeouts {
        Timeouts {
            connect: Duration::from_millis(self.local_timeout),
            request: Duration::from_millis(self.local_timeout),
        }
    }

    /// Timeouts of remote IPAM channels: one budget for connecting and for the call, so a dead
    /// home cluster costs at most `attempts` times this.
    pub fn remote_ipam_timeouts(&self) -> Timeouts {
        Timeouts {
            connect: Duration::from_millis(self.remote_ipam_timeout),
            request: Duration::from_millis(self.remote_ipam_timeout),
        }
    }

    /// Timeouts of the channels to other clusters' endpoints services.
    pub fn deliver_timeouts(&self) -> Timeouts {
        Timeouts {
            connect: Duration::from_millis(self.deliver_timeout.min(3_000)),
            request: Duration::from_millis(self.deliver_timeout),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Vec<&'static str> {
        vec![
            "trellis-endpoints",
            "--store",
            "memory://",
            "--cluster-id",
            "b",
            "--ipam",
            "127.0.0.1:7104",
            "--discovery",
            "127.0.0.1:7101",
        ]
    }

    #[test]
    fn defaults() {
        let c = Config::try_parse_from(base()).expect("parses");
        assert_eq!(c.remote_ipam_attempts, 2);
        assert_eq!(
            c.remote_ipam_timeouts().request,
            Duration::from_millis(2_000)
        );
        assert!(!c.kubernetes);
    }

    #[test]
    fn rejects_bad_addresses_and_zero_timeouts() {
        let mut args = base();
        args[6] = "http://127.0.0.1:7104";
        assert!(Config::try_parse_from(args).is_err());
        let mut args = base();
        args.extend(["--remote-ipam-timeout", "0"]);
        assert!(Config::try_parse_from(args).is_err());
        let mut args = base();
        args.extend(["--remote-ipam-attempts", "0"]);
        assert!(Config::try_parse_from(args).is_err());
    }
}
