//! TunnelEndpoints: everything a gateway needs for the tunnel to one remote cluster, merged by
//! the broker from the two NetworkConfigs of a pair (docs/architecture.md).

use std::net::SocketAddr;

use ipnet::IpNet;
use trellis_error::{Error, Result};

use super::{Endpoint, NatView, NetworkSpec, WgKey, path};
use crate::convert::identity_to_pb;
use crate::ident::ClusterIdentity;
use crate::net::Family;
use crate::pb::types as pb;
use crate::wire;

/// How a remote cluster is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum PeeringKind {
    /// A direct peer (token handshake).
    Full,
    /// Introduced by a hub's Neighborhood; NetworkConfigs relayed by the hub.
    Induced,
}

impl PeeringKind {
    /// The wire enum.
    pub fn to_proto(self) -> pb::PeeringKind {
        match self {
            Self::Full => pb::PeeringKind::Full,
            Self::Induced => pb::PeeringKind::Induced,
        }
    }
}

/// The tunnel to one remote cluster. "nat" fields are views after remapping; they equal the
/// real ranges when the viewer did not remap.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TunnelEndpoint {
    pub remote: ClusterIdentity,
    pub kind: PeeringKind,
    /// The hub the NetworkConfigs went through (induced only).
    pub via: Option<ClusterIdentity>,
    /// Our real pod CIDR.
    pub local_pod_cidr: IpNet,
    /// Our real external CIDR.
    pub local_external_cidr: IpNet,
    /// How the remote addresses us (its decision on our NetworkConfig).
    pub local_nat: NatView,
    /// The remote's real pod CIDR.
    pub remote_pod_cidr: IpNet,
    /// The remote's real external CIDR.
    pub remote_external_cidr: IpNet,
    /// How we address the remote (our decision on its NetworkConfig).
    pub remote_nat: NatView,
    /// The remote gateway's WireGuard endpoint: an IP, or a DNS name the gateway resolves.
    pub remote_endpoint: Endpoint,
    pub remote_public_key: WgKey,
    /// Other places the remote gateway may be reached: where the hub that introduced an
    /// induced peer sees it (its reflexive endpoint). Written by the broker's candidate
    /// refresh, not by the merge.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remote_candidates: Vec<SocketAddr>,
    /// Both NetworkConfigs offered the stateless wire convention: each gateway translates what
    /// it sends to the other (ADR 0034).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stateless_wire: bool,
    /// Bumped by the broker on every change.
    pub generation: i64,
}

/// At most this many candidates per TunnelEndpoint.
pub const MAX_CANDIDATES: usize = 8;

impl TunnelEndpoint {
    /// The merge of the local NetworkConfig (with the remote's decision on it) and the remote
    /// NetworkConfig (with ours).
    pub fn merge(
        remote: ClusterIdentity,
        via: Option<ClusterIdentity>,
        local: (&NetworkSpec, NatView),
        theirs: (&NetworkSpec, NatView),
        generation: i64,
    ) -> Self {
        let kind = if via.is_some() {
            PeeringKind::Induced
        } else {
            PeeringKind::Full
        };
        Self {
            remote,
            kind,
            via,
            local_pod_cidr: local.0.pod_cidr,
            local_external_cidr: local.0.external_cidr,
            local_nat: local.1,
            remote_pod_cidr: theirs.0.pod_cidr,
            remote_external_cidr: theirs.0.external_cidr,
            remote_nat: theirs.1,
            remote_endpoint: theirs.0.endpoint.clone(),
            remote_public_key: theirs.0.public_key,
            remote_candidates: Vec::new(),
            stateless_wire: local.0.stateless_wire && theirs.0.stateless_wire,
            generation,
        }
    }

    /// The wire form; `revision` is the store revision of the record.
    pub fn to_proto(&self, revision: i64) -> pb::TunnelEndpoint {
        pb::TunnelEndpoint {
            remote: Some(identity_to_pb(&self.remote)),
            kind: self.kind.to_proto().into(),
            local_pod_cidr: self.local_pod_cidr.to_string(),
            local_pod_cidr_nat: self.local_nat.pod_cidr_nat.to_string(),
            local_external_cidr: self.local_external_cidr.to_string(),
            local_external_cidr_nat: self.local_nat.external_cidr_nat.to_string(),
            remote_pod_cidr: self.remote_pod_cidr.to_string(),
            remote_pod_cidr_nat: self.remote_nat.pod_cidr_nat.to_string(),
            remote_external_cidr: self.remote_external_cidr.to_string(),
            remote_external_cidr_nat: self.remote_nat.external_cidr_nat.to_string(),
            remote_endpoint: self.remote_endpoint.to_string(),
            remote_public_key: self.remote_public_key.to_string(),
            via: self.via.as_ref().map(identity_to_pb),
            generation: self.generation,
            revision,
            update_time: None,
            remote_candidates: self
                .remote_candidates
                .iter()
                .map(ToString::to_string)
                .collect(),
            stateless_wire: self.stateless_wire,
        }
    }

    /// Validates a TunnelEndpoint received over gRPC (the gateway's input).
    pub fn from_proto(prefix: &str, te: &pb::TunnelEndpoint) -> Result<Self> {
        let identity =
            |field: &str, c: Option<&pb::ClusterIdentity>| -> Result<Option<ClusterIdentity>> {
                c.filter(|c| !c.cluster_id.is_empty())
                    .map(|c| {
                        ClusterIdentity::parse(
                            &path(&path(prefix, field), "cluster_id"),
                            &c.cluster_id,
                            &path(&path(prefix, field), "cluster_name"),
                            &c.cluster_name,
                        )
                    })
                    .transpose()
            };
        let remote = identity("remote", te.remote.as_ref())?
            .ok_or_else(|| Error::invalid(path(prefix, "remote"), "is required"))?;
        let via = identity("via", te.via.as_ref())?;
        let kind = match (pb::PeeringKind::try_from(te.kind), &via) {
            (Ok(pb::PeeringKind::Full), None) => PeeringKind::Full,
            (Ok(pb::PeeringKind::Induced), Some(_)) => PeeringKind::Induced,
            (Ok(pb::PeeringKind::Full), Some(_)) => {
                return Err(Error::invalid(
                    path(prefix, "via"),
                    "must be unset for a FULL peering",
                ));
            }
            (Ok(pb::PeeringKind::Induced), None) => {
                return Err(Error::invalid(
                    path(prefix, "via"),
                    "is required for an INDUCED peering",
                ));
            }
            _ => {
                return Err(Error::invalid(
                    path(prefix, "kind"),
                    "must be FULL or INDUCED",
                ));
            }
        };
        let cidr = |field: &str, text: &str| wire::cidr(&path(prefix, field), text);
        let local_pod_cidr = cidr("local_pod_cidr", &te.local_pod_cidr)?;
        let family = Family::of_net(local_pod_cidr);
        let same_size = |field: &str, text: &str, real: IpNet| -> Result<IpNet> {
            let view = wire::require_family_net(&path(prefix, field), cidr(field, text)?, family)?;
            if view.prefix_len() != real.prefix_len() {
                return Err(Error::invalid(
                    path(prefix, field),
                    format!("{view} cannot stand for {real}: a remap keeps the prefix length"),
                ));
            }
            Ok(view)
        };
        let local_external_cidr = wire::require_family_net(
            &path(prefix, "local_external_cidr"),
            cidr("local_external_cidr", &te.local_external_cidr)?,
            family,
        )?;
        let remote_pod_cidr = wire::require_family_net(
            &path(prefix, "remote_pod_cidr"),
            cidr("remote_pod_cidr", &te.remote_pod_cidr)?,
            family,
        )?;
        let remote_external_cidr = wire::require_family_net(
            &path(prefix, "remote_external_cidr"),
            cidr("remote_external_cidr", &te.remote_external_cidr)?,
            family,
        )?;
        let local_nat = NatView {
            pod_cidr_nat: same_size("local_pod_cidr_nat", &te.local_pod_cidr_nat, local_pod_cidr)?,
            external_cidr_nat: same_size(
                "local_external_cidr_nat",
                &te.local_external_cidr_nat,
                local_external_cidr,
            )?,
        };
        let remote_nat = NatView {
            pod_cidr_nat: same_size(
                "remote_pod_cidr_nat",
                &te.remote_pod_cidr_nat,
                remote_pod_cidr,
            )?,
            external_cidr_nat: same_size(
                "remote_external_cidr_nat",
                &te.remote_external_cidr_nat,
                remote_external_cidr,
            )?,
        };
        let remote_endpoint =
            Endpoint::parse(&path(prefix, "remote_endpoint"), &te.remote_endpoint)?;
        let remote_public_key =
            WgKey::parse(&path(prefix, "remote_public_key"), &te.remote_public_key)?;
        let remote_candidates =
            candidates(&path(prefix, "remote_candidates"), &te.remote_candidates)?;
        Ok(Self {
            remote,
            kind,
            via,
            local_pod_cidr,
            local_external_cidr,
            local_nat,
            remote_pod_cidr,
            remote_external_cidr,
            remote_nat,
            remote_endpoint,
            remote_public_key,
            remote_candidates,
            stateless_wire: te.stateless_wire,
            generation: te.generation,
        })
    }
}

/// Validates candidate endpoints: each a unicast `ip:port` with a port, at most
/// [`MAX_CANDIDATES`].
pub fn candidates(field: &str, texts: &[String]) -> Result<Vec<SocketAddr>> {
    if texts.len() > MAX_CANDIDATES {
        return Err(Error::invalid(
            field,
            format!("{} candidates, at most {MAX_CANDIDATES}", texts.len()),
        ));
    }
    texts
        .iter()
        .enumerate()
        .map(|(i, text)| candidate(&format!("{field}[{i}]"), text))
        .collect()
}

/// One candidate endpoint: a unicast `ip:port` with a port.
pub fn candidate(field: &str, text: &str) -> Result<SocketAddr> {
    let addr: SocketAddr = text
        .parse()
        .map_err(|_| Error::invalid(field, format!("{text:?} is not ip:port")))?;
    let ip = addr.ip();
    if addr.port() == 0 || ip.is_unspecified() || ip.is_multicast() || ip.is_loopback() {
        return Err(Error::invalid(
            field,
            format!("{text:?} is not a unicast address with a port"),
        ));
    }
    if let std::net::IpAddr::V4(v4) = ip
        && v4.is_broadcast()
    {
        return Err(Error::invalid(
            field,
            format!("{text:?} is a broadcast address"),
        ));
    }
    Ok(addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(pod: &str, ext: &str, endpoint: &str, key: u8) -> NetworkSpec {
        NetworkSpec {
            pod_cidr: pod.parse().expect("net"),
            external_cidr: ext.parse().expect("net"),
            endpoint: endpoint.parse().expect("addr"),
            public_key: WgKey::from_bytes([key; 32]),
            stateless_wire: false,
        }
    }

    fn view(pod: &str, ext: &str) -> NatView {
        NatView {
            pod_cidr_nat: pod.parse().expect("net"),
            external_cidr_nat: ext.parse().expect("net"),
        }
    }

    fn identity(id: &str) -> ClusterIdentity {
        ClusterIdentity::parse("cluster_id", id, "cluster_name", id).expect("valid")
    }

    /// Leaves A and C with the same pod CIDR, as A sees the pair.
    fn a_to_c() -> TunnelEndpoint {
        let ours = spec("10.0.0.0/16", "10.201.0.0/16", "192.0.2.1:51840", 1);
        let theirs = spec("10.0.0.0/16", "10.201.0.0/16", "192.0.2.3:51840", 3);
        TunnelEndpoint::merge(
            identity("c"),
            Some(identity("b")),
            // C remapped us to 10.81/16; we remapped C to 10.83/16.
            (&ours, view("10.81.0.0/16", "10.82.0.0/16")),
            (&theirs, view("10.83.0.0/16", "10.84.0.0/16")),
            1,
        )
    }

    #[test]
    fn merge_takes_each_side_from_the_right_network_config() {
        let te = a_to_c();
        assert_eq!(te.kind, PeeringKind::Induced);
        assert_eq!(te.local_nat.pod_cidr_nat.to_string(), "10.81.0.0/16");
        assert_eq!(te.remote_nat.pod_cidr_nat.to_string(), "10.83.0.0/16");
        assert_eq!(te.remote_endpoint.to_string(), "192.0.2.3:51840");
        assert_eq!(te.remote_public_key, WgKey::from_bytes([3; 32]));
    }

    /// The stateless wire convention needs both sides: a tunnel uses it only when both
    /// NetworkConfigs offered it, never on one side's word.
    #[test]
    fn a_tunnel_is_stateless_only_when_both_sides_offered_it() {
        for (ours, theirs) in [(false, false), (true, false), (false, true), (true, true)] {
            let mut local = spec("10.0.0.0/16", "10.201.0.0/16", "192.0.2.1:51840", 1);
            let mut remote = spec("10.0.0.0/16", "10.201.0.0/16", "192.0.2.3:51840", 3);
            local.stateless_wire = ours;
            remote.stateless_wire = theirs;
            let te = TunnelEndpoint::merge(
                identity("c"),
                None,
                (&local, view("10.81.0.0/16", "10.82.0.0/16")),
                (&remote, view("10.83.0.0/16", "10.84.0.0/16")),
                1,
            );
            assert_eq!(te.stateless_wire, ours && theirs, "{ours} {theirs}");
        }
    }

    /// A record stored before the convention existed reads as not stateless, and one that
    /// does not use it is stored as before.
    #[test]
    fn records_without_the_convention_are_stored_as_before() {
        let te = a_to_c();
        let json = serde_json::to_value(&te).expect("json");
        assert!(json.get("stateless_wire").is_none(), "{json}");
        let back: TunnelEndpoint = serde_json::from_value(json).expect("reads");
        assert!(!back.stateless_wire);
        let stateless = TunnelEndpoint {
            stateless_wire: true,
            ..te
        };
        let json = serde_json::to_value(&stateless).expect("json");
        assert_eq!(json["stateless_wire"], serde_json::json!(true));
    }

    #[test]
    fn proto_round_trip_preserves_everything() {
        let mut te = a_to_c();
        te.remote_candidates = vec!["198.51.100.3:40002".parse().expect("addr")];
        te.stateless_wire = true;
        let wire = te.to_proto(42);
        assert_eq!(wire.revision, 42);
        assert_eq!(
            TunnelEndpoint::from_proto("tunnel_endpoint", &wire).expect("valid"),
            te
        );
    }

    #[test]
    fn inconsistent_records_are_refused_naming_the_field() {
        type Spoil = fn(&mut pb::TunnelEndpoint);
        let cases: [(&str, Spoil); 9] = [
            ("te.remote_candidates[0]", |t| {
                t.remote_candidates = vec!["gw.example:51840".into()]
            }),
            ("te.remote_candidates[1]", |t| {
                t.remote_candidates = vec!["192.0.2.3:1".into(), "192.0.2.3:0".into()]
            }),
            ("te.remote_candidates[0]", |t| {
                t.remote_candidates = vec!["0.0.0.0:51840".into()]
            }),
            ("te.remote_candidates", |t| {
                t.remote_candidates = vec!["192.0.2.3:51840".into(); MAX_CANDIDATES + 1]
            }),
            ("te.via", |t| t.via = None),
            ("te.kind", |t| t.kind = 0),
            ("te.remote_pod_cidr_nat", |t| {
                t.remote_pod_cidr_nat = "10.83.0.0/24".into()
            }),
            ("te.remote_external_cidr", |t| {
                t.remote_external_cidr = "fd00::/64".into()
            }),
            ("te.remote_public_key", |t| {
                t.remote_public_key = String::new()
            }),
        ];
        for (field, spoil) in cases {
            let mut wire = a_to_c().to_proto(1);
            spoil(&mut wire);
            match TunnelEndpoint::from_proto("te", &wire) {
                Err(Error::InvalidArgument { field: got, .. }) => assert_eq!(got, field),
                other => panic!("{field}: {other:?}"),
            }
        }
    }
}
