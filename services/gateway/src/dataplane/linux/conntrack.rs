//! Connections flushed from connection tracking when what they were translated for goes: a
//! hub-path mapping (its DNAT'ed connections would otherwise follow it into the tunnel of
//! whichever peer holds that range next) or a peer (its replies would follow the next peer
//! with its mark). Without the `conntrack` tool these only warn.

use std::collections::BTreeSet;
use std::net::IpAddr;

use super::Linux;
use crate::dataplane::PeerPlan;
use crate::dataplane::cmd;
use crate::mappings::HubMapping;
use crate::names::MARK_MASK;

impl Linux {
    /// Once the NAT table without them is applied, flushes the connections DNAT'ed to the
    /// destinations of hub-path mappings that went; one whose flush failed is tried again on
    /// the next pass.
    pub(super) async fn flush_removed_mappings(&mut self, plans: &[PeerPlan], hub: &[HubMapping]) {
        let current: BTreeSet<IpAddr> = if plans.is_empty() {
            BTreeSet::new()
        } else {
            crate::dataplane::hub_snat(hub)
                .into_iter()
                .map(|(d, _)| d)
                .collect()
        };
        let gone: Vec<IpAddr> = self.hub_targets.difference(&current).copied().collect();
        let mut kept = current;
        for target in gone {
            if let Err(err) = self.flush_dnat(target).await {
                tracing::warn!(%target, error = format!("{err:#}"), "could not flush the connections of a removed hub-path mapping; retrying on the next pass");
                kept.insert(target);
            }
        }
        self.hub_targets = kept;
    }

    /// Deletes every connection conntrack tracks as DNAT'ed to `target` (a hub-path mapping's
    /// destination that went). Such a connection keeps its translation after its mapping and
    /// its destination's peer are gone, so an established one (which the tunnel guard lets
    /// through) followed it into the tunnel of whichever peer holds that range next. Without
    /// the `conntrack` tool this only warns.
    pub async fn flush_dnat(&self, target: IpAddr) -> anyhow::Result<()> {
        let target = target.to_string();
        match cmd::run("conntrack", &["-D", "--dst-nat", &target], None).await {
            Ok(_) => {
                tracing::info!(%target, "flushed the connections of a removed hub-path mapping");
                Ok(())
            }
            // conntrack exits 1 when nothing matched.
            Err(err) if format!("{err:#}").contains("0 flow entries") => Ok(()),
            Err(err) if format!("{err:#}").starts_with("cannot run conntrack") => {
                tracing::warn!(%target, error = format!("{err:#}"), "conntrack is not installed: the connections of a removed hub-path mapping are not flushed");
                Ok(())
            }
            Err(err) => Err(err),
        }
    }

    /// Deletes every connection conntrack tracks under `mark` (a freed peer's), so none of
    /// its replies follows the tunnel of the next peer with that mark. Without the `conntrack`
    /// tool this only warns: the port's quarantine is then all that protects the next holder.
    pub async fn flush_connections(&self, mark: u32) -> anyhow::Result<()> {
        let selector = format!("{mark:#x}/{MARK_MASK:#x}");
        match cmd::run("conntrack", &["-D", "--mark", &selector], None).await {
            Ok(_) => Ok(()),
            // conntrack exits 1 when nothing matched.
            Err(err) if format!("{err:#}").contains("0 flow entries") => Ok(()),
            Err(err) if format!("{err:#}").starts_with("cannot run conntrack") => {
                tracing::warn!(mark = %selector, error = format!("{err:#}"), "conntrack is not installed: the connections of a removed peer are not flushed, only its port's quarantine keeps them from the next peer");
                Ok(())
            }
            Err(err) => Err(err),
        }
    }
}
