//! DNS-SRV discovery: every refresh interval, look up `_trellis._tcp.<domain>` for each
//! configured domain, resolve each SRV target to an address, ask the discovery service there
//! who it is, and record it (Discovered=True). Clusters whose SRV record disappeared are marked
//! no longer found (Discovered=False, reason SrvRecordRemoved).
//!
//! A lookup that fails for another reason than "no such records" (timeout, SERVFAIL) makes the
//! round incomplete: nothing is dropped on a transient DNS failure, only on an answer.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hickory_resolver::TokioResolver;
use hickory_resolver::config::{NameServerConfigGroup, ResolverConfig, ResolverOpts};
use hickory_resolver::name_server::TokioConnectionProvider;
use trellis_error::{Error, Result};
use trellis_runtime::{Shutdown, timer};

use crate::core::Discovery;
use crate::records::Mechanism;
use crate::remote;

/// The SRV service label every Trellis discovery endpoint is published under.
pub const SRV_PREFIX: &str = "_trellis._tcp";

/// What DNS-SRV discovery looks up, where, and how often.
#[derive(Debug, Clone)]
pub struct DnsSettings {
    /// Search domains, e.g. `clusters.example.com`.
    pub domains: Vec<String>,
    /// The DNS server to ask; `None` uses the system's (`/etc/resolv.conf`).
    pub nameserver: Option<SocketAddr>,
    /// Time between two lookups.
    pub refresh: Duration,
}

/// What one refresh found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Round {
    /// Discovery addresses the SRV records point at and that answered GetIdentity.
    pub found: BTreeSet<String>,
    /// Whether every lookup got an answer (only then are missing clusters dropped).
    pub complete: bool,
}

/// Builds the resolver: the configured server over UDP and TCP, or the system's.
pub fn resolver(settings: &DnsSettings) -> Result<TokioResolver> {
    let provider = TokioConnectionProvider::default();
    let mut builder = match settings.nameserver {
        Some(server) => {
            let group = NameServerConfigGroup::from_ips_clear(&[server.ip()], server.port(), true);
            TokioResolver::builder_with_config(
                ResolverConfig::from_parts(None, vec![], group),
                provider,
            )
        }
        None => TokioResolver::builder(provider).map_err(|e| {
            Error::FailedPrecondition(format!("cannot read the system DNS configuration: {e}"))
        })?,
    };
    let options: &mut ResolverOpts = builder.options_mut();
    options.timeout = Duration::from_secs(2);
    options.attempts = 2;
    Ok(builder.build())
}

/// Runs DNS-SRV discovery until `shutdown`.
pub async fn run(core: Arc<Discovery>, settings: DnsSettings, shutdown: Shutdown) {
    let resolver = match resolver(&settings) {
        Ok(r) => r,
        Err(err) => {
            tracing::error!(error = %err, "dns-srv discovery disabled");
            return;
        }
    };
    loop {
        match refresh(&core, &resolver, &settings.domains).await {
            Ok(round) => tracing::debug!(
                found = round.found.len(),
                complete = round.complete,
                "dns-srv refresh done"
            ),
            Err(err) => tracing::warn!(error = %err, "dns-srv refresh failed"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = timer::period(settings.refresh) => {}
        }
    }
}

/// One refresh: look up, record what answers, drop what is gone.
pub async fn refresh(
    core: &Discovery,
    resolver: &TokioResolver,
    domains: &[String],
) -> Result<Round> {
    // Every refresh is a fresh view of DNS: a record removed at the server must not live on in
    // our cache until its TTL runs out.
    resolver.clear_cache();
    let mut round = Round {
        found: BTreeSet::new(),
        complete: true,
    };
    for domain in domains {
        let name = format!("{SRV_PREFIX}.{}.", domain.trim_end_matches('.'));
        let answer = match resolver.srv_lookup(name.as_str()).await {
            Ok(answer) => answer,
            Err(err) if err.is_no_records_found() || err.is_nx_domain() => continue,
            Err(err) => {
                tracing::warn!(%name, error = %err, "srv lookup failed; keeping what it found before");
                round.complete = false;
                continue;
            }
        };
        for srv in answer.iter() {
            let target = srv.target().to_utf8();
            let ip = match resolver.lookup_ip(target.as_str()).await {
                Ok(ips) => ips.iter().next(),
                Err(err) => {
                    tracing::warn!(%target, error = %err, "cannot resolve srv target");
                    None
                }
            };
            let Some(ip) = ip else {
                round.complete = false;
                continue;
            };
            let address = SocketAddr::new(ip, srv.port()).to_string();
            match remote::get_identity(core.tls(), core.metrics(), "srv target", &address).await {
                Ok((identity, _)) if identity.id == core.identity().id => {}
                Ok((identity, addresses)) => {
                    core.discovered(&identity, &addresses, Mechanism::DnsSrv, &address)
                        .await?;
                    round.found.insert(address);
                }
                Err(err) => {
                    // Still listed: unreachable is not gone. Keep it as found so it is not
                    // dropped, but do not refresh it either.
                    tracing::warn!(%address, error = %err, "srv target does not answer GetIdentity");
                    round.found.insert(address);
                }
            }
        }
    }
    if round.complete {
        core.lost(Mechanism::DnsSrv, &round.found, "SrvRecordRemoved")
            .await?;
    }
    Ok(round)
}
