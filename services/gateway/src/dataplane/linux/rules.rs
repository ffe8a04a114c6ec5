//! Our policy-routing rules, made exactly what the plans want on every pass; and, at start,
//! the removal of what a previous run left: rules, nftables tables and interfaces all outlive a
//! SIGKILLed process.
//!
//! Each peer has a rule sending its connection mark to its table. The kernel walks policy rules
//! in order for every packet it routes, so a hub's 254 peer rules in one row were walked by
//! every packet through the node, and a marked reply walked them up to its own (ADR 0033).
//! While there are peer rules, they are laid out as:
//! - at [`SKIP_PRIORITY`], packets without a peer's mark (all but the replies of peers'
//!   connections) jump past every rule of ours, to a no-op at [`PAST_RULES_PRIORITY`];
//! - at [`RULE_PRIORITY`] + bucket, a rule per bucket in use sends a marked packet, by the low
//!   bits of its slot (one of [`RULE_BUCKETS`] buckets), to its bucket at [`BUCKET_PRIORITY`] +
//!   bucket, where its peer's rule is.

use std::collections::BTreeSet;

use super::{Linux, guard_script};
use crate::dataplane::cmd::{self, ip};
use crate::dataplane::nft;
use crate::names::{
    BUCKET_PRIORITY, MARK_MASK, PAST_RULES_PRIORITY, RULE_BUCKETS, RULE_PRIORITY, SKIP_PRIORITY,
};

/// One policy rule of ours, as `ip rule` shows and takes it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct PolicyRule {
    pub pref: u32,
    /// `(mark, mask)` matched, if any.
    pub fwmark: Option<(u32, u32)>,
    pub action: Action,
}

/// What a rule does with a packet it matches.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Action {
    /// Route by this table.
    Lookup(u32),
    /// Go on at the rule of this priority.
    Goto(u32),
    /// Nothing: go on with the next rule.
    Nop,
}

impl PolicyRule {
    /// The arguments after `ip rule add|del`.
    pub fn args(&self) -> Vec<String> {
        let mut args = vec!["pref".to_owned(), self.pref.to_string()];
        if let Some((mark, mask)) = self.fwmark {
            args.push("fwmark".into());
            args.push(format!("{mark:#x}/{mask:#x}"));
        }
        match self.action {
            Action::Lookup(table) => args.extend(["lookup".into(), table.to_string()]),
            Action::Goto(pref) => args.extend(["goto".into(), pref.to_string()]),
            Action::Nop => args.push("nop".into()),
        }
        args
    }

    /// `1800:\tfrom all fwmark 0xca810000/0xffff0000 lookup 51841`, `1783:\tfrom all fwmark
    /// 0/0xffff0000 goto 1816`, `1816:\tfrom all nop`; any other shape is not one of ours.
    fn parse(line: &str) -> Option<Self> {
        let (pref, rest) = line.split_once(':')?;
        let pref: u32 = pref.trim().parse().ok()?;
        let words: Vec<&str> = rest.split_whitespace().collect();
        let after = |key: &str| {
            words
                .iter()
                .position(|w| *w == key)
                .and_then(|i| words.get(i + 1))
        };
        let hex = |s: &str| u32::from_str_radix(s.trim_start_matches("0x"), 16).ok();
        let fwmark = match after("fwmark") {
            Some(m) => {
                let (mark, mask) = m.split_once('/')?;
                Some((hex(mark)?, hex(mask)?))
            }
            None => None,
        };
        let action = if let Some(table) = after("lookup") {
            Action::Lookup(table.parse().ok()?)
        } else if let Some(target) = after("goto") {
            Action::Goto(target.parse().ok()?)
        } else if words.last() == Some(&"nop") {
            Action::Nop
        } else {
            return None;
        };
        Some(Self {
            pref,
            fwmark,
            action,
        })
    }
}

/// Whether `pref` is one of the priorities we own.
fn ours(pref: u32) -> bool {
    (SKIP_PRIORITY..=PAST_RULES_PRIORITY).contains(&pref)
}

/// Every rule we want for peers with these `(mark, table)`, in the order to add them (each
/// `goto` after its target): none for no peers.
pub fn policy_rules(peers: &BTreeSet<(u32, u32)>) -> Vec<PolicyRule> {
    if peers.is_empty() {
        return Vec::new();
    }
    let bucket_mask = (RULE_BUCKETS - 1) << 16;
    let mut rules = vec![PolicyRule {
        pref: PAST_RULES_PRIORITY,
        fwmark: None,
        action: Action::Nop,
    }];
    rules.extend(peers.iter().map(|(mark, table)| PolicyRule {
        pref: BUCKET_PRIORITY + ((mark & bucket_mask) >> 16),
        fwmark: Some((*mark, MARK_MASK)),
        action: Action::Lookup(*table),
    }));
    // A dispatch rule only for the buckets holding a peer: a leaf's few marked replies walk
    // a rule or two, not sixteen. Each at a priority of its own: `ip rule del` takes a mark of
    // 0 (bucket 0's) for "any mark" and would delete whichever dispatch rule came first.
    let buckets: BTreeSet<u32> = peers
        .iter()
        .map(|(mark, _)| (mark & bucket_mask) >> 16)
        .collect();
    rules.extend(buckets.into_iter().map(|b| PolicyRule {
        pref: RULE_PRIORITY + b,
        fwmark: Some((b << 16, bucket_mask)),
        action: Action::Goto(BUCKET_PRIORITY + b),
    }));
    rules.push(PolicyRule {
        pref: SKIP_PRIORITY,
        fwmark: Some((0, MARK_MASK)),
        action: Action::Goto(PAST_RULES_PRIORITY),
    });
    rules
}

impl Linux {
    pub(super) async fn remove_stale(&self) -> anyhow::Result<()> {
        let rules = sync_rules(&BTreeSet::new()).await?;
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
            rules,
            interfaces = removed,
            "removed data plane state left by a previous run"
        );
        Ok(())
    }
}

/// Makes our policy rules exactly those [`policy_rules`] wants for `want`: `(mark, table)`
/// per peer. Rules of ours that are not wanted (a previous layout's included) go first; how
/// many there were is returned.
pub(super) async fn sync_rules(want: &BTreeSet<(u32, u32)>) -> anyhow::Result<usize> {
    let have = current_rules().await?;
    let wanted = policy_rules(want);
    let unwanted: Vec<&PolicyRule> = have.iter().filter(|r| !wanted.contains(r)).collect();
    for rule in &unwanted {
        let mut args = vec!["rule".to_owned(), "del".to_owned()];
        args.extend(rule.args());
        match ip(&args.iter().map(String::as_str).collect::<Vec<_>>()).await {
            // Gone already (deleted by hand, say): what this pass wanted.
            Err(err) if format!("{err:#}").contains("No such file or directory") => {
                tracing::debug!(rule = ?rule, "policy rule already gone");
            }
            other => {
                other?;
            }
        }
    }
    for rule in wanted.iter().filter(|r| !have.contains(r)) {
        let mut args = vec!["rule".to_owned(), "add".to_owned()];
        args.extend(rule.args());
        ip(&args.iter().map(String::as_str).collect::<Vec<_>>()).await?;
    }
    Ok(unwanted.len())
}

/// Our rules: those at our priorities with a shape of ours.
async fn current_rules() -> anyhow::Result<BTreeSet<PolicyRule>> {
    let text = ip(&["-4", "rule", "show"]).await?;
    Ok(text
        .lines()
        .filter_map(PolicyRule::parse)
        .filter(|r| ours(r.pref))
        .collect())
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
    fn parses_rules_as_ip_shows_them_and_link_names() {
        let rule = PolicyRule::parse("1800:\tfrom all fwmark 0xca810000/0xffff0000 lookup 51841");
        assert_eq!(
            rule,
            Some(PolicyRule {
                pref: 1800,
                fwmark: Some((0xca81_0000, 0xffff_0000)),
                action: Action::Lookup(51841)
            })
        );
        assert_eq!(
            PolicyRule::parse("1783:\tfrom all fwmark 0/0xffff0000 goto 1816")
                .map(|r| (r.fwmark, r.action)),
            Some((Some((0, 0xffff_0000)), Action::Goto(1816)))
        );
        assert_eq!(
            PolicyRule::parse("1816:\tfrom all nop").map(|r| r.action),
            Some(Action::Nop)
        );
        assert_eq!(PolicyRule::parse("0:\tfrom all lookup local"), None);
        assert_eq!(
            link_name("7: tg0a1b2c3d: <POINTOPOINT,NOARP,UP> mtu 1420"),
            Some("tg0a1b2c3d")
        );
        assert_eq!(link_name("2: veth0@if3: <BROADCAST>"), Some("veth0"));
        assert!(is_ours("tg", "tg0a1b2c3d"));
        assert!(!is_ours("tg", "tg0a1b2c3"));
        assert!(!is_ours("tg", "eth0"));
    }

    #[test]
    fn peer_rules_are_bucketed_behind_a_skip_for_unmarked_packets() {
        assert!(policy_rules(&BTreeSet::new()).is_empty());
        // One peer: the no-op, its rule, its bucket's dispatch, the skip.
        let one = policy_rules(&BTreeSet::from([(51_841 << 16, 51_841)]));
        assert_eq!(
            one.iter().map(|r| r.pref).collect::<Vec<_>>(),
            [
                PAST_RULES_PRIORITY,
                BUCKET_PRIORITY + 1,
                RULE_PRIORITY + 1,
                SKIP_PRIORITY
            ]
        );
        let peers: BTreeSet<(u32, u32)> = (51_841..=52_094).map(|s| (s << 16, s)).collect();
        let rules = policy_rules(&peers);
        // Every rule parses back from its own arguments, as `ip rule show` prints them.
        for rule in &rules {
            let line = format!("{}:\tfrom all {}", rule.pref, rule.args()[2..].join(" "));
            assert_eq!(PolicyRule::parse(&line).as_ref(), Some(rule), "{line}");
            assert!(ours(rule.pref), "{rule:?}");
        }
        // A goto comes after its target, which is a higher priority.
        for (i, rule) in rules.iter().enumerate() {
            if let Action::Goto(target) = rule.action {
                assert!(target > rule.pref);
                assert!(
                    target == PAST_RULES_PRIORITY || rules[..i].iter().any(|r| r.pref == target),
                    "{rule:?} before its target"
                );
            }
        }
        let skip = rules.last().expect("rules");
        assert_eq!(skip.pref, SKIP_PRIORITY);
        assert_eq!(skip.fwmark, Some((0, MARK_MASK)));
        // A marked packet walks at most the dispatch rules and one bucket.
        let dispatch: BTreeSet<u32> = rules
            .iter()
            .filter(|r| r.pref >= RULE_PRIORITY && r.pref < BUCKET_PRIORITY)
            .map(|r| r.pref)
            .collect();
        let mut per_bucket = std::collections::BTreeMap::new();
        for r in rules
            .iter()
            .filter(|r| matches!(r.action, Action::Lookup(_)))
        {
            *per_bucket.entry(r.pref).or_insert(0) += 1;
            let (mark, _) = r.fwmark.expect("marked");
            assert_eq!(r.pref - BUCKET_PRIORITY, (mark >> 16) % RULE_BUCKETS);
        }
        // One dispatch rule per priority: `ip rule del` finds each by its priority alone.
        assert_eq!(dispatch.len(), RULE_BUCKETS as usize);
        assert_eq!(
            rules
                .iter()
                .filter(|r| r.pref >= RULE_PRIORITY && r.pref < BUCKET_PRIORITY)
                .count(),
            dispatch.len()
        );
        assert_eq!(per_bucket.values().sum::<usize>(), 254);
        assert!(per_bucket.values().all(|n| *n <= 16), "{per_bucket:?}");
    }
}
