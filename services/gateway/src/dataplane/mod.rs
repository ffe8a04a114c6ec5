//! The data plane: what one peer's tunnel needs ([`PeerPlan`]), and the Linux reconciler that
//! makes the network namespace match a set of plans ([`linux::Linux`]). Root only.
//!
//! - [`wireguard`]: one WireGuard device per peer (userspace boringtun or kernel);
//! - [`nft`]: the `ip trellis` nftables table (double NAT, connection marks);
//! - [`cmd`]: `ip`/`nft` invocations and sysctls;
//! - [`linux`]: the reconciler tying them together, with routes and policy-routing rules.

pub mod cmd;
pub mod linux;
pub mod nft;
pub mod wireguard;

use std::path::Path;

use ipnet::IpNet;
use trellis_api::model::TunnelEndpoint;
use trellis_api::pb::gateway::WireguardMode;

use crate::config::DataplaneFlag;
use crate::names;

/// The data plane actually in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Control plane only.
    None,
    Userspace,
    Kernel,
}

impl Mode {
    /// Resolves `--dataplane`: `auto` is kernel when the wireguard module is loaded (the
    /// kernel does not autoload it for netlink in every setup), userspace otherwise.
    pub fn resolve(flag: DataplaneFlag) -> Self {
        match flag {
            DataplaneFlag::None => Self::None,
            DataplaneFlag::Userspace => Self::Userspace,
            DataplaneFlag::Kernel => Self::Kernel,
            DataplaneFlag::Auto if Path::new("/sys/module/wireguard").exists() => Self::Kernel,
            DataplaneFlag::Auto => Self::Userspace,
        }
    }

    /// The wire enum.
    pub fn to_proto(self) -> WireguardMode {
        match self {
            Self::None => WireguardMode::None,
            Self::Userspace => WireguardMode::Userspace,
            Self::Kernel => WireguardMode::Kernel,
        }
    }
}

/// Everything needed to build the tunnel to one peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerPlan {
    pub endpoint: TunnelEndpoint,
    /// Our listen port for this peer.
    pub port: u16,
    pub interface: String,
}

fn dedup(nets: impl IntoIterator<Item = IpNet>) -> Vec<IpNet> {
    let mut out: Vec<IpNet> = Vec::new();
    for n in nets {
        if !out.contains(&n) {
            out.push(n);
        }
    }
    out
}

impl PeerPlan {
    /// The CIDRs routed into the peer's interface: the peer's ranges as we address them.
    pub fn routed(&self) -> Vec<IpNet> {
        let te = &self.endpoint;
        dedup([te.remote_nat.pod_cidr_nat, te.remote_nat.external_cidr_nat])
    }

    /// WireGuard AllowedIPs: the routed CIDRs (our packets to the peer carry those
    /// destinations), plus the peer's *real* ranges: NAT happens on ingress at the receiver,
    /// so packets from the peer arrive with its real source addresses, and the replies we
    /// send back through the tunnel (after conntrack un-NATs them) go to those real addresses.
    /// With one interface per peer, overlapping real ranges of different peers never meet in
    /// one cryptokey routing table.
    pub fn allowed_ips(&self) -> Vec<IpNet> {
        let te = &self.endpoint;
        dedup(
            self.routed()
                .into_iter()
                .chain([te.remote_pod_cidr, te.remote_external_cidr]),
        )
    }

    /// The peer's connection mark.
    pub fn mark(&self) -> u32 {
        names::mark(self.port)
    }

    /// The peer's policy-routing table.
    pub fn table(&self) -> u32 {
        names::table(self.port)
    }

    /// The peer's part of the nftables table.
    pub fn nat(&self) -> nft::PeerNat {
        let te = &self.endpoint;
        nft::PeerNat {
            interface: self.interface.clone(),
            mark: self.mark(),
            dnat: vec![
                (te.local_nat.pod_cidr_nat, te.local_pod_cidr),
                (te.local_nat.external_cidr_nat, te.local_external_cidr),
            ],
            snat: vec![
                (te.remote_pod_cidr, te.remote_nat.pod_cidr_nat),
                (te.remote_external_cidr, te.remote_nat.external_cidr_nat),
            ],
        }
    }
}
