//! The link delays: `tc netem` on the gateways' uplinks where the kernel has it, userspace UDP
//! relays otherwise.

use std::time::Duration;

use trellis_netlab::Fabric;
use trellis_netlab::netem::{LinkDelay, set_link_delays};
use trellis_netlab::relay::{RelayedLink, Relays, relay_links};

use super::{A, B, C, Settings};
use crate::results::Emulation;

/// Adds the link delays to every link that carries a tunnel; the relays (if any) must live
/// while measuring.
pub(super) async fn emulate(
    fabric: &Fabric,
    emulation: Emulation,
    links: &[LinkDelay],
) -> anyhow::Result<Option<Relays>> {
    if emulation == Emulation::Netem {
        set_link_delays(&fabric.topology, links)?;
        return Ok(None);
    }
    let mut relayed = Vec::new();
    for l in links {
        let (Ok(y_endpoint), Ok(x_endpoint)) = (
            fabric.wireguard_endpoint(l.a, l.b).await,
            fabric.wireguard_endpoint(l.b, l.a).await,
        ) else {
            continue; // no tunnel on this link (hub path: A and C do not peer)
        };
        relayed.push(RelayedLink {
            x: l.a,
            x_endpoint,
            y: l.b,
            y_endpoint,
            rtt: l.rtt,
        });
    }
    Ok(Some(relay_links(&fabric.topology, &relayed).await?))
}

pub(super) fn delays(settings: &Settings) -> [LinkDelay; 3] {
    let hub = Duration::from_millis(settings.hub_link_ms);
    let leaf = Duration::from_millis(settings.leaf_link_ms);
    [
        LinkDelay {
            a: A,
            b: B,
            rtt: hub,
        },
        LinkDelay {
            a: C,
            b: B,
            rtt: hub,
        },
        LinkDelay {
            a: A,
            b: C,
            rtt: leaf,
        },
    ]
}
