//! How a service proves itself to etcd: TLS (server verification against a CA, and a client
//! certificate for etcd's `--client-cert-auth`) and etcd's own user/password authentication.
//! Production etcds require client certificates; the secrets here are never logged.

use std::fmt;

use etcd_client::{Certificate, Identity, TlsOptions};

/// TLS towards etcd, as PEM.
#[derive(Clone)]
pub struct EtcdTls {
    /// The CA that signed etcd's server certificate.
    pub ca_pem: Vec<u8>,
    /// The client certificate and its private key, for etcd's `--client-cert-auth`.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl EtcdTls {
    pub(super) fn client_config(&self) -> TlsOptions {
        let config = TlsOptions::new().ca_certificate(Certificate::from_pem(&self.ca_pem));
        match &self.identity {
            Some((cert, key)) => config.identity(Identity::from_pem(cert, key)),
            None => config,
        }
    }
}

impl fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdTls")
            .field("ca_pem_bytes", &self.ca_pem.len())
            .field("client_certificate", &self.identity.is_some())
            .finish()
    }
}

/// Credentials for etcd; the default is none (plaintext, no authentication).
#[derive(Clone, Default)]
pub struct EtcdAuth {
    /// TLS settings; required by, and only allowed with, `etcds://` URLs.
    pub tls: Option<EtcdTls>,
    /// etcd user and password (etcd's `auth enable`).
    pub user: Option<(String, String)>,
}

impl EtcdAuth {
    /// Whether no credential is set.
    pub fn is_empty(&self) -> bool {
        self.tls.is_none() && self.user.is_none()
    }

    /// What to check when a connection fails, naming the flags that set each credential.
    pub(super) fn hint(&self, tls: bool) -> String {
        let mut checks = Vec::new();
        if tls {
            checks.push("--store-ca-cert (the CA that signed etcd's server certificate)");
            if self.tls.as_ref().is_some_and(|t| t.identity.is_some()) {
                checks.push("--store-cert/--store-key (a client certificate etcd trusts)");
            } else {
                checks.push(
                    "--store-cert/--store-key (none given; an etcd with --client-cert-auth \
                     requires them)",
                );
            }
        }
        if self.user.is_some() {
            checks.push("--store-user/--store-password");
        }
        if checks.is_empty() {
            String::new()
        } else {
            format!("; check {}", checks.join(", "))
        }
    }
}

impl fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdAuth")
            .field("tls", &self.tls)
            .field("user", &self.user.as_ref().map(|(user, _)| user))
            .finish()
    }
}
