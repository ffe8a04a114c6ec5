//! Store URLs: `memory://`, `etcd://host:port[,host:port...][/prefix]` and the same with
//! `etcds://` for etcd over TLS.

use std::fmt;
use std::str::FromStr;

use crate::error::StoreError;

/// etcd's registered client port, used when an endpoint names none.
const DEFAULT_ETCD_PORT: u16 = 2379;

/// A parsed store URL: which backend, and where.
///
/// Implements [`FromStr`] so command-line flags can be validated when they are parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// `memory://`: a fresh in-memory store.
    Memory,
    /// `etcd://h1:2379,h2:2379/prefix`, or `etcds://…` over TLS.
    Etcd {
        /// `host:port` per endpoint (IPv6 hosts in brackets), in the order given.
        endpoints: Vec<String>,
        /// The key prefix without surrounding slashes (`"ipam"`, `"a/b"`), or `""` for none.
        prefix: String,
        /// `etcds://`: connect over TLS (see [`crate::EtcdAuth`]).
        tls: bool,
    },
}

impl StoreUrl {
    /// Parses a store URL; the error names what is wrong with it.
    pub fn parse(url: &str) -> Result<Self, StoreError> {
        let invalid = |reason: String| StoreError::InvalidUrl(format!("{url:?}: {reason}"));
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(invalid(
                "missing scheme; expected memory://, etcd://host:port[,host:port...][/prefix] or \
                 etcds://… (TLS)"
                    .into(),
            ));
        };
        if scheme.eq_ignore_ascii_case("memory") {
            return if rest.is_empty() {
                Ok(Self::Memory)
            } else {
                Err(invalid(format!(
                    "memory:// takes no host or path, got {rest:?}"
                )))
            };
        }
        let tls = scheme.eq_ignore_ascii_case("etcds");
        if !tls && !scheme.eq_ignore_ascii_case("etcd") {
            return Err(invalid(format!(
                "unknown scheme {scheme:?}; expected \"memory\", \"etcd\" or \"etcds\""
            )));
        }
        if rest.contains(['?', '#']) {
            return Err(invalid(
                "query strings and fragments are not supported".into(),
            ));
        }
        if rest.chars().any(char::is_whitespace) {
            return Err(invalid("whitespace is not allowed".into()));
        }
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        if authority.contains('@') {
            return Err(invalid("credentials in the url are not supported".into()));
        }
        if authority.is_empty() {
            return Err(invalid("no etcd endpoints given".into()));
        }
        let endpoints = authority
            .split(',')
            .enumerate()
            .map(|(i, endpoint)| parse_endpoint(endpoint, i + 1).map_err(&invalid))
            .collect::<Result<Vec<_>, _>>()?;
        let prefix = path.trim_matches('/');
        if prefix.split('/').any(str::is_empty) && !prefix.is_empty() {
            return Err(invalid(format!(
                "prefix {prefix:?} has an empty path segment"
            )));
        }
        Ok(Self::Etcd {
            endpoints,
            prefix: prefix.to_owned(),
            tls,
        })
    }
}

/// One `host[:port]`, normalised to `host:port`; `position` is 1-based, for the message.
fn parse_endpoint(endpoint: &str, position: usize) -> Result<String, String> {
    if endpoint.is_empty() {
        return Err(format!("endpoint {position} is empty"));
    }
    let (host, port) = if let Some(bracketed) = endpoint.strip_prefix('[') {
        let Some((host, after)) = bracketed.split_once(']') else {
            return Err(format!("endpoint {endpoint:?} has an unclosed '['"));
        };
        let port = match after {
            "" => None,
            _ => match after.strip_prefix(':') {
                Some(port) => Some(port),
                None => return Err(format!("endpoint {endpoint:?} has junk after ']'")),
            },
        };
        (host, port)
    } else {
        match endpoint.split_once(':') {
            Some((_, port)) if port.contains(':') => {
                return Err(format!(
                    "endpoint {endpoint:?}: put IPv6 addresses in brackets, like [::1]:2379"
                ));
            }
            Some((host, port)) => (host, Some(port)),
            None => (endpoint, None),
        }
    };
    if host.is_empty() {
        return Err(format!("endpoint {endpoint:?} has no host"));
    }
    let port = match port {
        None => DEFAULT_ETCD_PORT,
        Some(port) => match port.parse::<u16>() {
            Ok(0) | Err(_) => {
                return Err(format!(
                    "endpoint {endpoint:?} has invalid port {port:?} (expected 1-65535)"
                ));
            }
            Ok(port) => port,
        },
    };
    let host = if endpoint.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    Ok(format!("{host}:{port}"))
}

impl FromStr for StoreUrl {
    type Err = StoreError;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        Self::parse(url)
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Memory => f.write_str("memory://"),
            Self::Etcd {
                endpoints,
                prefix,
                tls,
            } => {
                let scheme = if *tls { "etcds" } else { "etcd" };
                write!(f, "{scheme}://{}", endpoints.join(","))?;
                if !prefix.is_empty() {
                    write!(f, "/{prefix}")?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn etcd(endpoints: &[&str], prefix: &str) -> StoreUrl {
        StoreUrl::Etcd {
            endpoints: endpoints.iter().map(|e| (*e).to_owned()).collect(),
            prefix: prefix.to_owned(),
            tls: false,
        }
    }

    fn error(url: &str) -> String {
        match StoreUrl::parse(url) {
            Err(StoreError::InvalidUrl(reason)) => reason,
            other => panic!("{url:?} should be an invalid url, got {other:?}"),
        }
    }

    #[test]
    fn memory() {
        assert_eq!(StoreUrl::parse("memory://"), Ok(StoreUrl::Memory));
        assert!(error("memory://x").contains("takes no host or path"));
    }

    #[test]
    fn etcd_endpoints_and_prefix() {
        assert_eq!(
            StoreUrl::parse("etcd://h1:2379,h2:2380/ipam"),
            Ok(etcd(&["h1:2379", "h2:2380"], "ipam"))
        );
        assert_eq!(
            StoreUrl::parse("etcd://10.0.0.1:1/a/b/"),
            Ok(etcd(&["10.0.0.1:1"], "a/b"))
        );
    }

    #[test]
    fn etcds_is_etcd_over_tls() {
        let url = StoreUrl::parse("etcds://h1:2379/ipam").expect("parses");
        assert_eq!(
            url,
            StoreUrl::Etcd {
                endpoints: vec!["h1:2379".into()],
                prefix: "ipam".into(),
                tls: true,
            }
        );
        assert_eq!(url.to_string(), "etcds://h1:2379/ipam");
    }

    #[test]
    fn etcd_without_prefix() {
        assert_eq!(StoreUrl::parse("etcd://h:1"), Ok(etcd(&["h:1"], "")));
        assert_eq!(StoreUrl::parse("etcd://h:1/"), Ok(etcd(&["h:1"], "")));
    }

    #[test]
    fn port_defaults_to_2379() {
        assert_eq!(
            StoreUrl::parse("etcd://etcd-0/x"),
            Ok(etcd(&["etcd-0:2379"], "x"))
        );
    }

    #[test]
    fn ipv6_endpoints() {
        assert_eq!(
            StoreUrl::parse("etcd://[::1]:2400,[fd00::2]/p"),
            Ok(etcd(&["[::1]:2400", "[fd00::2]:2379"], "p"))
        );
        assert!(error("etcd://::1:2379").contains("brackets"));
        assert!(error("etcd://[::1:2379").contains("unclosed"));
        assert!(error("etcd://[::1]x").contains("junk"));
    }

    #[test]
    fn bad_scheme() {
        assert!(error("redis://h:1").contains("unknown scheme \"redis\""));
        assert!(error("h1:2379").contains("missing scheme"));
        assert!(error("").contains("missing scheme"));
    }

    #[test]
    fn empty_endpoint_list() {
        assert!(error("etcd://").contains("no etcd endpoints"));
        assert!(error("etcd:///prefix").contains("no etcd endpoints"));
    }

    #[test]
    fn empty_endpoint_in_list() {
        assert!(error("etcd://a:1,,b:2").contains("endpoint 2 is empty"));
        assert!(error("etcd://a:1,").contains("endpoint 2 is empty"));
    }

    #[test]
    fn bad_port() {
        for url in [
            "etcd://h:abc",
            "etcd://h:",
            "etcd://h:0",
            "etcd://h:65536",
            "etcd://h:-1",
        ] {
            assert!(error(url).contains("invalid port"), "{url}");
        }
    }

    #[test]
    fn missing_host() {
        assert!(error("etcd://:2379").contains("no host"));
    }

    #[test]
    fn rejects_what_it_would_silently_ignore() {
        assert!(error("etcd://h:1/p?x=1").contains("query"));
        assert!(error("etcd://u:pw@h:1").contains("credentials"));
        assert!(error("etcd://h:1/a//b").contains("empty path segment"));
        assert!(error("etcd://h:1/a b").contains("whitespace"));
    }

    #[test]
    fn errors_quote_the_url() {
        assert!(error("etcd://h:x").starts_with("\"etcd://h:x\": "));
    }

    #[test]
    fn display_round_trips() {
        for url in ["memory://", "etcd://h1:2379,[::1]:2379/a/b", "etcd://h:1"] {
            let parsed: StoreUrl = url.parse().expect("valid url");
            assert_eq!(parsed.to_string(), url);
        }
    }
}
