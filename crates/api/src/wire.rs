//! Parsing of request strings into domain values. Every helper takes the request field's name
//! so that a failure is an [`Error::InvalidArgument`] a user can act on ("invalid pod_cidr:
//! \"10.0.0.5/16\" has host bits set; the network is 10.0.0.0/16").

use std::net::IpAddr;

use ipnet::IpNet;
use trellis_error::{Error, Result};

use crate::net::Family;

/// Longest accepted textual CIDR or IP (an IPv6 CIDR is at most 43 characters).
const MAX_ADDR_TEXT_LEN: usize = 64;

fn check_text<'a>(field: &str, value: &'a str) -> Result<&'a str> {
    if value.is_empty() {
        return Err(Error::invalid(field, "is required"));
    }
    if value.len() > MAX_ADDR_TEXT_LEN {
        return Err(Error::invalid(
            field,
            format!(
                "is {} bytes long; an address is at most {MAX_ADDR_TEXT_LEN}",
                value.len()
            ),
        ));
    }
    Ok(value)
}

/// Parses a network in CIDR notation. Host bits must be zero: a typo like `10.0.0.5/16` is an
/// error rather than silently becoming `10.0.0.0/16`.
pub fn cidr(field: &str, value: &str) -> Result<IpNet> {
    let value = check_text(field, value)?;
    let net: IpNet = value.parse().map_err(|_| {
        Error::invalid(
            field,
            format!("{value:?} is not a CIDR (expected e.g. \"10.0.0.0/16\")"),
        )
    })?;
    if net.trunc() != net {
        return Err(Error::invalid(
            field,
            format!(
                "{value:?} has host bits set; the network is {}",
                net.trunc()
            ),
        ));
    }
    Ok(net)
}

/// Parses an optional CIDR: empty means absent.
pub fn optional_cidr(field: &str, value: &str) -> Result<Option<IpNet>> {
    if value.is_empty() {
        Ok(None)
    } else {
        cidr(field, value).map(Some)
    }
}

/// Parses a single IP address.
pub fn ip(field: &str, value: &str) -> Result<IpAddr> {
    let value = check_text(field, value)?;
    value.parse().map_err(|_| {
        Error::invalid(
            field,
            format!("{value:?} is not an IP address (expected e.g. \"10.0.3.7\")"),
        )
    })
}

/// Requires a network of the configured family.
pub fn require_family_net(field: &str, net: IpNet, family: Family) -> Result<IpNet> {
    let got = Family::of_net(net);
    if got == family {
        Ok(net)
    } else {
        Err(Error::invalid(
            field,
            format!("{net} is {got} but this cluster is configured for {family}"),
        ))
    }
}

/// Requires an address of the configured family.
pub fn require_family_ip(field: &str, ip: IpAddr, family: Family) -> Result<IpAddr> {
    let got = Family::of_ip(ip);
    if got == family {
        Ok(ip)
    } else {
        Err(Error::invalid(
            field,
            format!("{ip} is {got} but this cluster is configured for {family}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(r: Result<impl std::fmt::Debug>) -> (String, String) {
        match r {
            Err(Error::InvalidArgument { field, reason }) => (field, reason),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn cidr_errors_name_the_field_and_explain() {
        let (field, why) = reason(cidr("pod_cidr", "10.0.0.5/16"));
        assert_eq!(field, "pod_cidr");
        assert!(why.contains("the network is 10.0.0.0/16"), "{why}");
        let (_, why) = reason(cidr("pod_cidr", "10.0.0.0/33"));
        assert!(why.contains("is not a CIDR"), "{why}");
        let (_, why) = reason(cidr("pod_cidr", ""));
        assert_eq!(why, "is required");
        let (_, why) = reason(cidr("pod_cidr", &"1".repeat(1000)));
        assert!(why.contains("at most 64"), "{why}");
    }

    #[test]
    fn ip_and_family_checks() {
        assert!(ip("ip", "10.0.0.1").is_ok());
        let (field, _) = reason(ip("ip", "10.0.0.1/32"));
        assert_eq!(field, "ip");
        let v6 = cidr("pod_cidr", "fd00::/64").expect("valid v6");
        let (_, why) = reason(require_family_net("pod_cidr", v6, Family::V4));
        assert!(
            why.contains("IPv6 but this cluster is configured for IPv4"),
            "{why}"
        );
    }

    #[test]
    fn optional_cidr_treats_empty_as_absent() {
        assert_eq!(optional_cidr("external_cidr", "").ok(), Some(None));
        assert!(optional_cidr("external_cidr", "x").is_err());
    }
}
