//! What a NetworkConfig says: the sender's network parameters (its spec) and the receiver's
//! decision on how to address them (its status).

use ipnet::IpNet;
use trellis_error::{Error, Result};

use super::{Endpoint, WgKey, path};
use crate::net::{Family, overlaps};
use crate::pb::types as pb;
use crate::wire;

/// A cluster's network parameters as sent to a peer (NetworkConfig spec).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetworkSpec {
    /// The sender's real pod CIDR.
    pub pod_cidr: IpNet,
    /// The sender's external CIDR.
    pub external_cidr: IpNet,
    /// The sender's WireGuard endpoint, as the receiver reaches it (an IP or a DNS name).
    pub endpoint: Endpoint,
    /// The sender's WireGuard public key.
    pub public_key: WgKey,
    /// The sender's gateway offers the stateless wire convention (ADR 0034).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stateless_wire: bool,
}

impl NetworkSpec {
    /// Validates a spec; `prefix` is the field path of the spec in the request
    /// (e.g. `network_config.spec`).
    pub fn from_proto(prefix: &str, spec: Option<&pb::NetworkConfigSpec>) -> Result<Self> {
        let Some(spec) = spec else {
            return Err(Error::invalid(prefix, "is required"));
        };
        Self::from_fields(spec).map_err(|e| e.under(prefix))
    }

    /// [`Self::from_proto`] of a present spec, naming fields relative to it.
    fn from_fields(spec: &pb::NetworkConfigSpec) -> Result<Self> {
        let pod_cidr = wire::cidr("pod_cidr", &spec.pod_cidr)?;
        let external_cidr = wire::require_family_net(
            "external_cidr",
            wire::cidr("external_cidr", &spec.external_cidr)?,
            Family::of_net(pod_cidr),
        )?;
        if overlaps(pod_cidr, external_cidr) {
            return Err(Error::invalid(
                "external_cidr",
                format!("{external_cidr} overlaps the pod CIDR {pod_cidr}"),
            ));
        }
        let endpoint = Endpoint::parse("endpoint", &spec.endpoint)?;
        let public_key = WgKey::parse("public_key", &spec.public_key)?;
        Ok(Self {
            pod_cidr,
            external_cidr,
            endpoint,
            public_key,
            stateless_wire: spec.stateless_wire,
        })
    }

    /// The wire form.
    pub fn to_proto(&self) -> pb::NetworkConfigSpec {
        pb::NetworkConfigSpec {
            pod_cidr: self.pod_cidr.to_string(),
            external_cidr: self.external_cidr.to_string(),
            endpoint: self.endpoint.to_string(),
            public_key: self.public_key.to_string(),
            stateless_wire: self.stateless_wire,
        }
    }
}

/// How one cluster addresses another's pod and external CIDRs (the NAT'ed views). The
/// receiver's decision on a NetworkConfig, and what the sender learns as its local NAT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NatView {
    pub pod_cidr_nat: IpNet,
    pub external_cidr_nat: IpNet,
}

impl NatView {
    /// The wire status of a processed NetworkConfig at `generation`.
    pub fn to_status(&self, generation: i64) -> pb::NetworkConfigStatus {
        pb::NetworkConfigStatus {
            pod_cidr_nat: self.pod_cidr_nat.to_string(),
            external_cidr_nat: self.external_cidr_nat.to_string(),
            state: pb::NetworkConfigState::Processed.into(),
            observed_generation: generation,
            message: String::new(),
            update_time: None,
            receiver_generation: 0,
        }
    }

    /// Validates a decision about `spec`: each view must be a network of the same size (and
    /// family) as the range it stands for, and the two views must not overlap.
    pub fn for_spec(
        prefix: &str,
        spec: &NetworkSpec,
        status: &pb::NetworkConfigStatus,
    ) -> Result<Self> {
        let check = |field: &str, text: &str, real: IpNet| -> Result<IpNet> {
            let field = path(prefix, field);
            let view = wire::cidr(&field, text)?;
            if Family::of_net(view) != Family::of_net(real)
                || view.prefix_len() != real.prefix_len()
            {
                return Err(Error::invalid(
                    field,
                    format!(
                        "{view} cannot stand for {real}: a remap keeps family and prefix length"
                    ),
                ));
            }
            Ok(view)
        };
        let pod_cidr_nat = check("pod_cidr_nat", &status.pod_cidr_nat, spec.pod_cidr)?;
        let external_cidr_nat = check(
            "external_cidr_nat",
            &status.external_cidr_nat,
            spec.external_cidr,
        )?;
        if overlaps(pod_cidr_nat, external_cidr_nat) {
            return Err(Error::invalid(
                path(prefix, "external_cidr_nat"),
                format!("{external_cidr_nat} overlaps the pod CIDR's view {pod_cidr_nat}"),
            ));
        }
        Ok(Self {
            pod_cidr_nat,
            external_cidr_nat,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn spec_proto() -> pb::NetworkConfigSpec {
        pb::NetworkConfigSpec {
            pod_cidr: "10.0.0.0/16".into(),
            external_cidr: "10.201.0.0/16".into(),
            endpoint: "192.0.2.10:51840".into(),
            public_key: WgKey::from_bytes([3; 32]).to_string(),
            stateless_wire: true,
        }
    }

    fn field_of(err: Error) -> String {
        match err {
            Error::InvalidArgument { field, .. } => field,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn a_valid_spec_round_trips() {
        let spec = NetworkSpec::from_proto("spec", Some(&spec_proto())).expect("valid");
        assert_eq!(spec.to_proto(), spec_proto());
    }

    #[test]
    fn every_field_is_validated_under_its_path() {
        type Spoil = fn(&mut pb::NetworkConfigSpec);
        let cases: [(&str, Spoil); 6] = [
            ("network_config.spec.pod_cidr", |s| {
                s.pod_cidr = "10.0.0.1/16".into()
            }),
            ("network_config.spec.external_cidr", |s| {
                s.external_cidr = "fd00::/64".into()
            }),
            ("network_config.spec.external_cidr", |s| {
                s.external_cidr = "10.0.128.0/17".into()
            }),
            ("network_config.spec.endpoint", |s| {
                s.endpoint = "192.0.2.10".into()
            }),
            ("network_config.spec.endpoint", |s| {
                s.endpoint = "0.0.0.0:51840".into()
            }),
            ("network_config.spec.public_key", |s| {
                s.public_key = "short".into()
            }),
        ];
        for (field, spoil) in cases {
            let mut spec = spec_proto();
            spoil(&mut spec);
            let err = NetworkSpec::from_proto("network_config.spec", Some(&spec)).expect_err(field);
            assert_eq!(field_of(err), field);
        }
        let err = NetworkSpec::from_proto("network_config.spec", None).expect_err("missing");
        assert_eq!(field_of(err), "network_config.spec");
    }

    #[test]
    fn a_nat_view_must_keep_the_size() {
        let spec = NetworkSpec::from_proto("spec", Some(&spec_proto())).expect("valid");
        let mut status = pb::NetworkConfigStatus {
            pod_cidr_nat: "10.81.0.0/16".into(),
            external_cidr_nat: "10.82.0.0/16".into(),
            ..Default::default()
        };
        let view = NatView::for_spec("status", &spec, &status).expect("valid");
        assert_eq!(view.pod_cidr_nat.to_string(), "10.81.0.0/16");
        status.pod_cidr_nat = "10.81.0.0/24".into();
        let err = NatView::for_spec("status", &spec, &status).expect_err("size changed");
        assert_eq!(field_of(err), "status.pod_cidr_nat");
    }

    /// One view overlapping the other would give one address two meanings in the gateway's
    /// NAT maps (and made the one `nft -f` for every peer fail: issue 15, item 10).
    #[test]
    fn the_two_views_must_not_overlap() {
        let spec = NetworkSpec::from_proto("spec", Some(&spec_proto())).expect("valid");
        let status = pb::NetworkConfigStatus {
            pod_cidr_nat: "10.81.0.0/16".into(),
            external_cidr_nat: "10.81.0.0/16".into(),
            ..Default::default()
        };
        let err = NatView::for_spec("status", &spec, &status).expect_err("overlap");
        assert_eq!(field_of(err), "status.external_cidr_nat");
    }
}
