//! What the gateway's nftables tables and policy rules cost a forwarded packet, for one peer
//! and for a hub's (ADR 0033).

use std::fmt::Write as _;

use super::document::opening;
use super::format::num;
use super::inputs::Inputs;
use crate::results::GatewayRulesResult;

pub(super) fn gateway_rules_section(md: &mut String, inputs: &Inputs) {
    md.push_str("## The gateway's rules: one peer against a hub's\n\n");
    let Some(p) = opening::<GatewayRulesResult>(md, inputs, "gateway-rules") else {
        return;
    };
    let d = &p.doc;
    let _ = writeln!(
        md,
        "Ping RTT through a router holding the gateway's rules, {} rounds of {} pings every {} ms \
         per configuration, in turns.\n",
        d.parameters.rounds, d.parameters.pings_per_round, d.parameters.ping_interval_ms
    );
    md.push_str("| configuration | peers | policy rules | pings | median ms | p90 ms |\n");
    md.push_str("|---|---|---|---|---|---|\n");
    let ms = |v: Option<f64>| v.map_or_else(|| "n/a".into(), |x| num(x, 3));
    for v in &d.variants {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} |",
            v.name,
            v.peers,
            v.policy_rules,
            v.samples,
            ms(v.median_ms),
            ms(v.p90_ms)
        );
    }
    let _ = writeln!(
        md,
        "\nOver plain routing: one peer's rules {} ms, the hub's {} ms; the hub over one peer {} \
         ms, of which its nftables tables {} ms.\n",
        ms(d.one_peer_over_bare_ms),
        ms(d.hub_over_bare_ms),
        ms(d.hub_over_one_peer_ms),
        ms(d.hub_tables_over_one_peer_ms)
    );
    if d.stateless_sketch_over_bare_ms.is_some() {
        let _ = writeln!(
            md,
            "The sketch of a stateless wire convention (ADR 0032: no connection tracking, the \
             sender's translation as stateless rewrites on the way out) costs {} ms over plain \
             routing, where the rules as they are cost {} ms.\n",
            ms(d.stateless_sketch_over_bare_ms),
            ms(d.one_peer_over_bare_ms)
        );
    }
}
