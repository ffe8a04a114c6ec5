//! Our policy-routing rules (one per peer at [`RULE_PRIORITY`], its connection mark to its
//! table), made exactly what the plans want on every pass; and, at start, the removal of what
//! a previous run left: rules, nftables tables and interfaces all outlive a SIGKILLed process.

use std::collections::BTreeSet;

use super::{Linux, guard_script};
use crate::dataplane::cmd::{self, ip};
use crate::dataplane::nft;
use crate::names::{MARK_MASK, RULE_PRIORITY};

impl Linux {
    pub(super) async fn remove_stale(&self) -> anyhow::Result<()> {
        let rules = current_rules().await?;
        for (mark, table) in &rules {
            delete_rule(*mark, *table).await?;
        }
        cmd::run("nft", &["-f", "-"], Some(&nft::script(&[], &[]))).await?;
        cmd::run("nft", &["-f", "-"], Some(&guard_script(&[], &[]))).await?;
        let links = ip(&["-o", "link", "show"]).await?;
        let mut removed = 0;
        for name in links.lines().filter_map(link_name) {
            if is_ours(&self.prefix, name) {
                ip(&["link", "delete", "dev", name]).await?;
                removed += 1;
            }
        }
        tracing::info!(
            rules = rules.len(),
            interfaces = removed,
            "removed data plane state left by a previous run"
        );
        Ok(())
    }
}

/// Makes our policy rules (at [`RULE_PRIORITY`]) exactly `want`: `(mark, table)` each.
pub(super) async fn sync_rules(want: &BTreeSet<(u32, u32)>) -> anyhow::Result<()> {
    let have = current_rules().await?;
    for (mark, table) in have.difference(want) {
        delete_rule(*mark, *table).await?;
    }
    for (mark, table) in want.difference(&have) {
        rule("add", *mark, *table).await?;
    }
    Ok(())
}

/// Our rules: `(mark, table)` of every rule at [`RULE_PRIORITY`].
async fn current_rules() -> anyhow::Result<BTreeSet<(u32, u32)>> {
    let text = ip(&["-4", "rule", "show", "pref", &RULE_PRIORITY.to_string()]).await?;
    Ok(text.lines().filter_map(parse_rule).collect())
}

async fn delete_rule(mark: u32, table: u32) -> anyhow::Result<()> {
    rule("del", mark, table).await
}

/// `ip rule add|del` of our rule sending `mark` to `table`.
async fn rule(op: &str, mark: u32, table: u32) -> anyhow::Result<()> {
    ip(&[
        "rule",
        op,
        "pref",
        &RULE_PRIORITY.to_string(),
        "fwmark",
        &format!("{mark:#x}/{MARK_MASK:#x}"),
        "lookup",
        &table.to_string(),
    ])
    .await
    .map(drop)
}

/// `1784: from all fwmark 0xca810000/0xffff0000 lookup 51841` → `(0xca810000, 51841)`.
fn parse_rule(line: &str) -> Option<(u32, u32)> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let after = |key: &str| {
        words
            .iter()
            .position(|w| *w == key)
            .and_then(|i| words.get(i + 1))
    };
    let mark = after("fwmark")?.split('/').next()?;
    let mark = u32::from_str_radix(mark.trim_start_matches("0x"), 16).ok()?;
    let table = after("lookup")?.parse().ok()?;
    Some((mark, table))
}

/// The interface name of an `ip -o link show` line (`3: tg01234567: <...`, or `name@peer`).
fn link_name(line: &str) -> Option<&str> {
    let name = line.split(':').nth(1)?.trim();
    Some(name.split('@').next().unwrap_or(name))
}

/// Whether `name` has the shape of our interface names (prefix + 8 hex digits).
pub(super) fn is_ours(prefix: &str, name: &str) -> bool {
    name.strip_prefix(prefix)
        .is_some_and(|rest| rest.len() == 8 && rest.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rules_and_link_names() {
        assert_eq!(
            parse_rule("1784:\tfrom all fwmark 0xca810000/0xffff0000 lookup 51841"),
            Some((0xca81_0000, 51841))
        );
        assert_eq!(parse_rule("0:\tfrom all lookup local"), None);
        assert_eq!(
            link_name("7: tg0a1b2c3d: <POINTOPOINT,NOARP,UP> mtu 1420"),
            Some("tg0a1b2c3d")
        );
        assert_eq!(link_name("2: veth0@if3: <BROADCAST>"), Some("veth0"));
        assert!(is_ours("tg", "tg0a1b2c3d"));
        assert!(!is_ours("tg", "tg0a1b2c3"));
        assert!(!is_ours("tg", "eth0"));
    }
}
