//! A gateway's WireGuard endpoint as it travels between clusters: an IP address or a DNS name,
//! and a UDP port (`192.0.2.10:51840`, `[2001:db8::a]:51840`, `gw.hub.example:51840`).
//!
//! A name is carried as it is, never resolved on the way: the gateway that uses the endpoint
//! resolves it when it configures the tunnel (and again on every later pass), so a name whose
//! address changes is followed and a name that does not resolve yet is retried, not refused.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use trellis_error::{Error, Result};

/// Longest accepted DNS name (RFC 1035), without a trailing dot.
const MAX_NAME_LEN: usize = 253;

/// The host part of an endpoint.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EndpointHost {
    Ip(IpAddr),
    /// A DNS name, lowercased, without a trailing dot.
    Name(String),
}

impl EndpointHost {
    /// Validates `value` (an IP literal or a DNS name) as the content of field `field`.
    pub fn parse(field: &str, value: &str) -> Result<Self> {
        if value.is_empty() {
            return Err(Error::invalid(field, "is required"));
        }
        if let Ok(ip) = value.parse::<IpAddr>() {
            if ip.is_unspecified() || ip.is_multicast() {
                return Err(Error::invalid(
                    field,
                    format!("{ip} cannot be reached: unspecified or multicast address"),
                ));
            }
            return Ok(Self::Ip(ip));
        }
        let name = value
            .strip_suffix('.')
            .unwrap_or(value)
            .to_ascii_lowercase();
        if !is_dns_name(&name) {
            return Err(Error::invalid(
                field,
                format!(
                    "{:?} is neither an IP address nor a DNS name (letters, digits and '-' in \
                     dot-separated labels of 1-63, at most {MAX_NAME_LEN} in all)",
                    clip(value)
                ),
            ));
        }
        Ok(Self::Name(name))
    }

    /// The IP address, when the host is one.
    pub fn ip(&self) -> Option<IpAddr> {
        match self {
            Self::Ip(ip) => Some(*ip),
            Self::Name(_) => None,
        }
    }
}

impl fmt::Display for EndpointHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ip(ip) => ip.fmt(f),
            Self::Name(name) => f.write_str(name),
        }
    }
}

impl From<IpAddr> for EndpointHost {
    fn from(ip: IpAddr) -> Self {
        Self::Ip(ip)
    }
}

/// A WireGuard endpoint: host and UDP port (never 0).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Endpoint {
    host: EndpointHost,
    port: u16,
}

impl Endpoint {
    /// An endpoint of `host` and `port`; `None` for port 0.
    pub fn new(host: EndpointHost, port: u16) -> Option<Self> {
        (port != 0).then_some(Self { host, port })
    }

    /// Validates `value` ("host:port") as the content of field `field`.
    pub fn parse(field: &str, value: &str) -> Result<Self> {
        if value.is_empty() {
            return Err(Error::invalid(field, "is required"));
        }
        let bad = || {
            Error::invalid(
                field,
                format!(
                    "{:?} is not \"host:port\" (e.g. \"192.0.2.10:51840\", \
                     \"[2001:db8::a]:51840\", \"gw.example:51840\")",
                    clip(value)
                ),
            )
        };
        if let Ok(addr) = value.parse::<SocketAddr>() {
            let host = EndpointHost::parse(field, &addr.ip().to_string())?;
            return Self::new(host, addr.port()).ok_or_else(|| {
                Error::invalid(field, format!("{value} cannot be reached: port 0"))
            });
        }
        let (host, port) = value.rsplit_once(':').ok_or_else(bad)?;
        // An IPv6 literal must be bracketed; a bare one would have parsed as a name here.
        if host.contains(':') || host.starts_with('[') {
            return Err(bad());
        }
        let port = port.parse::<u16>().map_err(|_| bad())?;
        let host = EndpointHost::parse(field, host)?;
        Self::new(host, port)
            .ok_or_else(|| Error::invalid(field, format!("{value} cannot be reached: port 0")))
    }

    /// The host.
    pub fn host(&self) -> &EndpointHost {
        &self.host
    }

    /// The UDP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The socket address, when the host is an IP address (no lookup).
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        self.host.ip().map(|ip| SocketAddr::new(ip, self.port))
    }
}

impl From<SocketAddr> for Endpoint {
    /// Port 0 is kept as given: only [`Endpoint::parse`] checks wire input.
    fn from(addr: SocketAddr) -> Self {
        Self {
            host: EndpointHost::Ip(addr.ip()),
            port: addr.port(),
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            EndpointHost::Ip(ip) => SocketAddr::new(*ip, self.port).fmt(f),
            EndpointHost::Name(name) => write!(f, "{name}:{}", self.port),
        }
    }
}

impl FromStr for Endpoint {
    type Err = Error;

    fn from_str(value: &str) -> Result<Self> {
        Self::parse("endpoint", value)
    }
}

impl TryFrom<String> for Endpoint {
    type Error = Error;

    fn try_from(value: String) -> Result<Self> {
        value.parse()
    }
}

impl From<Endpoint> for String {
    fn from(endpoint: Endpoint) -> Self {
        endpoint.to_string()
    }
}

/// Dot-separated labels of ASCII letters, digits and '-' (not first or last), each 1-63 bytes,
/// at most [`MAX_NAME_LEN`] in all, and not all digits in the last label (that would be a
/// mistyped IPv4 address, e.g. "192.0.2.300").
fn is_dns_name(name: &str) -> bool {
    let labels_ok = name.split('.').all(|label| {
        !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    });
    let last_numeric = name
        .rsplit('.')
        .next()
        .is_some_and(|l| l.chars().all(|c| c.is_ascii_digit()));
    !name.is_empty() && name.len() <= MAX_NAME_LEN && labels_ok && !last_numeric
}

/// At most 64 characters of `value`, for error messages.
fn clip(value: &str) -> String {
    value.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ips_and_names_round_trip() {
        for (text, shown) in [
            ("192.0.2.10:51840", "192.0.2.10:51840"),
            ("[2001:db8::a]:51840", "[2001:db8::a]:51840"),
            ("gw.hub.example:51840", "gw.hub.example:51840"),
            ("GW.Hub.Example.:51841", "gw.hub.example:51841"),
            ("localhost:1", "localhost:1"),
        ] {
            let e = Endpoint::parse("f", text).expect(text);
            assert_eq!(e.to_string(), shown);
            assert_eq!(Endpoint::parse("f", shown).expect(shown), e);
            let json = serde_json::to_string(&e).expect("json");
            assert_eq!(serde_json::from_str::<Endpoint>(&json).expect("back"), e);
        }
        let ip = Endpoint::parse("f", "192.0.2.10:51840").expect("ip");
        assert_eq!(
            ip.socket_addr(),
            Some("192.0.2.10:51840".parse().expect("addr"))
        );
        let name = Endpoint::parse("f", "gw.example:51840").expect("name");
        assert_eq!(name.socket_addr(), None);
        assert_eq!(name.host(), &EndpointHost::Name("gw.example".into()));
    }

    #[test]
    fn a_socket_addr_stored_before_names_existed_still_reads() {
        // The store's JSON of a SocketAddr is the same string.
        let old = serde_json::to_string(&"192.0.2.10:51840".parse::<SocketAddr>().expect("a"))
            .expect("json");
        let e: Endpoint = serde_json::from_str(&old).expect("reads");
        assert_eq!(e.to_string(), "192.0.2.10:51840");
    }

    #[test]
    fn bad_endpoints_name_the_field() {
        for bad in [
            "",
            "192.0.2.10",
            "192.0.2.10:0",
            "0.0.0.0:51840",
            "[::]:51840",
            "224.0.0.1:51840",
            "gw.example:0",
            "gw.example:99999",
            "gw_hub.example:51840",
            "-gw.example:51840",
            "gw..example:51840",
            "192.0.2.300:51840",
            "2001:db8::a:51840x",
            "[gw.example]:51840",
            "http://gw.example:51840",
        ] {
            match Endpoint::parse("spec.endpoint", bad) {
                Err(Error::InvalidArgument { field, .. }) => {
                    assert_eq!(field, "spec.endpoint", "{bad:?}");
                }
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
        let long = format!("{}.example:1", "a".repeat(250));
        assert!(Endpoint::parse("f", &long).is_err());
    }

    #[test]
    fn hosts_accept_ips_and_names_and_refuse_the_rest() {
        assert_eq!(
            EndpointHost::parse("--endpoint-address", "192.0.2.1").expect("ip"),
            EndpointHost::Ip("192.0.2.1".parse().expect("ip"))
        );
        assert_eq!(
            EndpointHost::parse("--endpoint-address", "gw.example.").expect("name"),
            EndpointHost::Name("gw.example".into())
        );
        for bad in [
            "",
            "0.0.0.0",
            "gw example",
            "gw.example:51840",
            "a/b",
            "10.0.0.256",
        ] {
            let err = EndpointHost::parse("--endpoint-address", bad).expect_err(bad);
            assert!(err.to_string().contains("--endpoint-address"), "{err}");
        }
    }
}
