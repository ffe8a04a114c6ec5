//! Validation of "host:port" service addresses (types.proto conventions: no URL scheme; the host
//! is an IP literal, IPv6 in brackets, or a DNS name).

use std::net::SocketAddr;

use trellis_error::{Error, Result};

/// Longest accepted address: a full DNS name (253) plus ":65535".
const MAX_ADDRESS_LEN: usize = 253 + 6;

/// Validates a required address named `field`.
pub fn required(field: &str, value: &str) -> Result<String> {
    if value.is_empty() {
        return Err(Error::invalid(field, "is required (\"host:port\")"));
    }
    optional(field, value)
}

/// Validates an optional address: empty means "not advertised".
pub fn optional(field: &str, value: &str) -> Result<String> {
    if value.is_empty() {
        return Ok(String::new());
    }
    if value.len() > MAX_ADDRESS_LEN {
        return Err(Error::invalid(
            field,
            format!(
                "is {} bytes long; an address is at most {MAX_ADDRESS_LEN}",
                value.len()
            ),
        ));
    }
    if value.contains("://") {
        return Err(Error::invalid(
            field,
            format!("{value:?} has a URL scheme; expected \"host:port\""),
        ));
    }
    let bad = || {
        Error::invalid(
            field,
            format!(
                "{value:?} is not \"host:port\" (e.g. \"10.0.0.1:7101\", \"[fd00::1]:7101\", \"discovery.example:7101\")"
            ),
        )
    };
    if let Ok(addr) = value.parse::<SocketAddr>() {
        return if addr.port() == 0 {
            Err(bad())
        } else {
            Ok(value.to_owned())
        };
    }
    let (host, port) = value.rsplit_once(':').ok_or_else(bad)?;
    match port.parse::<u16>() {
        Ok(p) if p != 0 => {}
        _ => return Err(bad()),
    }
    if !is_dns_name(host) {
        return Err(bad());
    }
    Ok(value.to_owned())
}

/// A DNS name: dot-separated labels of letters, digits and '-', not starting or ending with
/// '-', each 1-63 bytes. A trailing dot (fully qualified) is accepted.
fn is_dns_name(host: &str) -> bool {
    let host = host.strip_suffix('.').unwrap_or(host);
    !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ips_and_names() {
        for ok in [
            "10.0.0.1:7101",
            "[fd00::1]:7101",
            "discovery.example:7101",
            "hub-1.trellis.example.:7101",
        ] {
            assert_eq!(required("a", ok).ok().as_deref(), Some(ok), "{ok}");
        }
    }

    #[test]
    fn rejects_malformed_addresses_naming_the_field() {
        for bad in [
            "10.0.0.1",
            "http://10.0.0.1:7101",
            "host:0",
            "127.0.0.1:0",
            "host:99999",
            "bad_host:7101",
            ":7101",
            "fd00::1:7101x",
            "-x.example:1",
        ] {
            match required("neighbors[0].addresses.discovery", bad) {
                Err(Error::InvalidArgument { field, .. }) => {
                    assert_eq!(field, "neighbors[0].addresses.discovery");
                }
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
        assert!(required("a", "").is_err());
        assert_eq!(optional("a", "").ok().as_deref(), Some(""));
    }
}
