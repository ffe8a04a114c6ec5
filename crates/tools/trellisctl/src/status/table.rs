//! The table form of `status`: one section per service answer, and a section that could not
//! be read says why in place of its rows.

use trellis_api::pb::gateway::WireguardMode;

use super::{
    ForeignClusterView, LocalIdentityView, ReplicaView, StatusView, TunnelEndpointView, TunnelView,
};
use crate::identity::id_or_empty;
use crate::names;
use crate::output::Report;
use crate::table::{Table, fields, section};
use crate::units::{ago, bytes, millis_text};

impl ReplicaView {
    /// One line: who this replica is, and who is active.
    fn describe(&self) -> String {
        let role = if self.active {
            format!("active, epoch {}", self.epoch)
        } else if self.active_replica.is_empty() {
            "standby, no active known".to_owned()
        } else {
            format!(
                "standby{}, active: {} (epoch {})",
                if self.warm { "" } else { ", NOT warm" },
                self.active_replica,
                self.epoch
            )
        };
        let peers: Vec<String> = self
            .peers
            .iter()
            .map(|p| {
                format!(
                    "{} {}{} heard {} ms ago",
                    p.replica,
                    if p.active { "active" } else { "standby" },
                    if p.warm { "" } else { " NOT warm" },
                    p.since_heartbeat_ms
                )
            })
            .collect();
        if peers.is_empty() {
            format!("{} ({role})", self.replica)
        } else {
            format!("{} ({role}); {}", self.replica, peers.join("; "))
        }
    }
}

fn real_to_view(real: &str, view: &str) -> String {
    if real.is_empty() && view.is_empty() {
        String::new()
    } else if real == view {
        format!("{real} (as is)")
    } else {
        format!("{real} -> {view}")
    }
}

impl StatusView {
    fn body<T>(&self, section: &str, rows: Option<&T>, render: impl Fn(&T) -> String) -> String {
        match (rows, self.problem(section)) {
            (Some(rows), _) => render(rows),
            (None, Some(problem)) => format!("  unavailable: {}\n", problem.error),
            (None, None) => "  unavailable\n".into(),
        }
    }

    fn services_table(&self) -> String {
        let mut t = Table::new(&["SERVICE", "ADDRESS", "HEALTH", "DETAIL"]);
        for s in &self.services {
            t.row([
                s.service.name().to_owned(),
                s.address.clone(),
                s.health.clone(),
                s.error.clone().unwrap_or_default(),
            ]);
        }
        t.render()
    }

    fn identity_block(identity: &LocalIdentityView) -> String {
        let mut pairs = vec![
            ("cluster id", identity.cluster_id.clone()),
            ("cluster name", identity.cluster_name.clone()),
            (
                "peering",
                if identity.plaintext_peering {
                    "PLAINTEXT (--insecure-plaintext-peering: anyone who reaches the ports can \
                     claim to be any peer)"
                        .to_owned()
                } else {
                    "mutual TLS".to_owned()
                },
            ),
        ];
        pairs.extend(
            identity
                .addresses
                .pairs()
                .into_iter()
                .filter(|(_, v)| !v.is_empty())
                .map(|(k, v)| (k, format!("{v} (advertised)"))),
        );
        fields(&pairs)
    }

    fn foreign_table(rows: &[ForeignClusterView]) -> String {
        if rows.is_empty() {
            return "  (none)\n".into();
        }
        let mut t = Table::new(&[
            "CLUSTER",
            "NAME",
            "KIND",
            "ORIGIN",
            "SOURCE",
            "PEERED",
            "PINNED CA",
            "CONDITIONS",
        ]);
        for fc in rows {
            let conditions: Vec<String> = fc
                .conditions
                .iter()
                .map(|c| format!("{}={}", c.kind, c.status))
                .collect();
            t.row([
                fc.cluster_id.clone(),
                fc.cluster_name.clone(),
                fc.kind.clone(),
                id_or_empty(fc.origin.as_ref()),
                fc.discovery_source.clone(),
                if fc.peered { "yes" } else { "no" }.into(),
                // Enough of the fingerprint to tell two CAs apart at a glance.
                fc.pinned_ca_sha256
                    .as_deref()
                    .map_or_else(String::new, |f| f.chars().take(16).collect()),
                conditions.join(","),
            ]);
        }
        t.render()
    }

    fn endpoints_table(rows: &[TunnelEndpointView]) -> String {
        if rows.is_empty() {
            return "  (none)\n".into();
        }
        let mut t = Table::new(&[
            "REMOTE",
            "KIND",
            "VIA",
            "ENDPOINT",
            "REMOTE POD (REAL -> OUR VIEW)",
            "REMOTE EXTERNAL (REAL -> OUR VIEW)",
            "THEIR VIEW OF OUR POD / EXTERNAL",
            "TRANSLATED BY",
            "GEN",
        ]);
        for te in rows {
            t.row([
                id_or_empty(te.remote.as_ref()),
                te.kind.clone(),
                id_or_empty(te.via.as_ref()),
                te.remote_endpoint.clone(),
                real_to_view(&te.remote_pod_cidr, &te.remote_pod_cidr_nat),
                real_to_view(&te.remote_external_cidr, &te.remote_external_cidr_nat),
                format!("{} / {}", te.local_pod_cidr_nat, te.local_external_cidr_nat),
                if te.stateless_wire {
                    "sender"
                } else {
                    "receiver"
                }
                .to_owned(),
                te.generation.to_string(),
            ]);
        }
        t.render()
    }

    fn tunnels_table(&self, rows: &[TunnelView]) -> String {
        let mut out = String::new();
        if let Some(gw) = &self.gateway {
            out.push_str(&fields(&[
                ("wireguard mode", gw.mode.clone()),
                ("endpoint", gw.endpoint.clone()),
                ("public key", gw.public_key.clone()),
                (
                    "replica",
                    gw.replica
                        .as_ref()
                        .map_or_else(|| "unknown".to_owned(), ReplicaView::describe),
                ),
            ]));
            if gw.mode == names::wireguard_mode(WireguardMode::None as i32) {
                out.push_str(
                    "  note: no data plane (--dataplane none): states come from the desired \
                     state only, no handshakes or traffic\n",
                );
            }
        } else if let Some(problem) = self.problem("gateway") {
            out.push_str(&format!("  gateway info unavailable: {}\n", problem.error));
        }
        if rows.is_empty() {
            out.push_str("  (no tunnels)\n");
            return out;
        }
        let mut t = Table::new(&[
            "REMOTE",
            "KIND",
            "STATE",
            "PATH",
            "LAST HANDSHAKE",
            "RX",
            "TX",
            "LATENCY",
            "INTERFACE",
            "ENDPOINT",
            "DETAIL",
        ]);
        for tun in rows {
            t.row([
                id_or_empty(tun.remote.as_ref()),
                tun.kind.clone(),
                tun.state.clone(),
                tun.path.clone(),
                ago(tun.last_handshake_age_seconds),
                bytes(tun.rx_bytes),
                bytes(tun.tx_bytes),
                millis_text(tun.latency_ms),
                tun.interface_name.clone(),
                tun.remote_endpoint.clone(),
                tun.message.clone(),
            ]);
        }
        out.push_str(&t.render());
        out
    }
}

impl Report for StatusView {
    fn table(&self) -> String {
        let parts = [
            section("Services", &self.services_table()),
            section(
                "Cluster (discovery)",
                &self.body("identity", self.identity.as_ref(), Self::identity_block),
            ),
            section(
                "Foreign clusters (discovery)",
                &self.body("foreign_clusters", self.foreign_clusters.as_ref(), |r| {
                    Self::foreign_table(r)
                }),
            ),
            section(
                "Tunnel endpoints (broker)",
                &self.body("tunnel_endpoints", self.tunnel_endpoints.as_ref(), |r| {
                    Self::endpoints_table(r)
                }),
            ),
            section(
                "Tunnels (gateway)",
                &self.body("tunnels", self.tunnels.as_ref(), |r| self.tunnels_table(r)),
            ),
        ];
        parts.join("\n")
    }
}
