//! Protobuf enum values as the short lower-case words the output uses ("full", "induced", "up",
//! "manual"). Unknown numbers, from a newer server, print as `unknown(N)` instead of failing.

use trellis_api::pb::endpoints::{AddressType, Protocol, TranslationPath};
use trellis_api::pb::gateway::{TunnelState, WireguardMode};
use trellis_api::pb::ipam::MappingPath;
use trellis_api::pb::types::{ConditionStatus, DiscoverySource, PeeringKind};

/// `PEERING_KIND_FULL` with prefix `PEERING_KIND_` -> `full`.
fn short(name: &str, prefix: &str) -> String {
    name.strip_prefix(prefix)
        .unwrap_or(name)
        .to_ascii_lowercase()
}

fn unknown(value: i32) -> String {
    format!("unknown({value})")
}

macro_rules! namer {
    ($(#[$doc:meta])* $fn:ident, $enum:ty, $prefix:literal) => {
        $(#[$doc])*
        pub fn $fn(value: i32) -> String {
            <$enum>::try_from(value).map_or_else(
                |_| unknown(value),
                |v| short(v.as_str_name(), $prefix),
            )
        }
    };
}

namer!(
    /// full | induced | unspecified
    kind, PeeringKind, "PEERING_KIND_"
);
namer!(
    /// manual | dns_srv | mdns | neighborhood | peering
    discovery_source, DiscoverySource, "DISCOVERY_SOURCE_"
);
namer!(
    /// configuring | connecting | up | down | error | removing
    tunnel_state, TunnelState, "TUNNEL_STATE_"
);
namer!(
    /// kernel | userspace | none
    wireguard_mode, WireguardMode, "WIREGUARD_MODE_"
);
namer!(
    /// local_nat | home | external
    mapping_path, MappingPath, "MAPPING_PATH_"
);
namer!(
    /// local_nat | induced | hub_external | target_home | untranslated
    translation_path, TranslationPath, "TRANSLATION_PATH_"
);
namer!(
    /// tcp | udp | sctp
    protocol, Protocol, "PROTOCOL_"
);

/// `True` | `False` | `Unknown`, spelled as in Kubernetes conditions.
pub fn condition_status(value: i32) -> String {
    match ConditionStatus::try_from(value) {
        Ok(ConditionStatus::True) => "True".into(),
        Ok(ConditionStatus::False) => "False".into(),
        Ok(ConditionStatus::Unknown) => "Unknown".into(),
        Ok(ConditionStatus::Unspecified) => "Unspecified".into(),
        Err(_) => unknown(value),
    }
}

/// `IPv4` | `IPv6` | `FQDN`, spelled as in Kubernetes.
pub fn address_type(value: i32) -> String {
    match AddressType::try_from(value) {
        Ok(AddressType::Ipv4) => "IPv4".into(),
        Ok(AddressType::Ipv6) => "IPv6".into(),
        Ok(AddressType::Fqdn) => "FQDN".into(),
        Ok(AddressType::Unspecified) => "unspecified".into(),
        Err(_) => unknown(value),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_lower_case_names() {
        assert_eq!(kind(PeeringKind::Full as i32), "full");
        assert_eq!(kind(PeeringKind::Induced as i32), "induced");
        assert_eq!(kind(42), "unknown(42)");
        assert_eq!(discovery_source(DiscoverySource::DnsSrv as i32), "dns_srv");
        assert_eq!(tunnel_state(TunnelState::Up as i32), "up");
        assert_eq!(wireguard_mode(WireguardMode::None as i32), "none");
        assert_eq!(mapping_path(MappingPath::LocalNat as i32), "local_nat");
        assert_eq!(
            translation_path(TranslationPath::HubExternal as i32),
            "hub_external"
        );
        assert_eq!(protocol(Protocol::Udp as i32), "udp");
        assert_eq!(condition_status(ConditionStatus::True as i32), "True");
        assert_eq!(address_type(AddressType::Ipv6 as i32), "IPv6");
    }
}
