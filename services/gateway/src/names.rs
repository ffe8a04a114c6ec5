//! Names and numbers the data plane derives for one peer: the interface name, the connection
//! mark and the routing table. All are pure functions of stable inputs, so a restarted gateway
//! finds (and replaces) exactly what its previous run created.

use trellis_api::ClusterId;

/// Linux interface names are at most 15 bytes (IFNAMSIZ - 1).
const IFNAME_MAX: usize = 15;
/// Hex digits of the pair hash in an interface name.
const HASH_DIGITS: usize = 8;

/// Priority of the rule dispatching a marked packet to bucket 0 of the peer rules; bucket `b`'s
/// is at this plus `b`, all below the main table's 32766. Every priority we use lies in
/// [`SKIP_PRIORITY`]..=[`PAST_RULES_PRIORITY`], so a restart finds and removes whatever a
/// previous run left there. Before ADR 0033 the peer rules themselves lived at this priority;
/// a restart removes those too.
pub const RULE_PRIORITY: u32 = 1784;

/// Priority of the rule sending packets without a peer's mark past all of ours, to the no-op
/// at [`PAST_RULES_PRIORITY`]: without it every packet the node routes walks them.
pub const SKIP_PRIORITY: u32 = RULE_PRIORITY - 1;

/// How many buckets the peer rules are spread over, by the low bits of their slot: a marked
/// packet walks the dispatch rules and one bucket, not every peer's rule.
pub const RULE_BUCKETS: u32 = 16;

/// Priority of the first bucket of peer rules; bucket `b` is at this plus `b`. Above every
/// dispatch rule's (`goto` only jumps forwards).
pub const BUCKET_PRIORITY: u32 = RULE_PRIORITY + RULE_BUCKETS;

/// Priority of the no-op rule the skip rule jumps to (`goto` needs a rule to land on).
pub const PAST_RULES_PRIORITY: u32 = BUCKET_PRIORITY + RULE_BUCKETS;

/// Mask of the mark bits we use: the high half, leaving the low 16 bits to kube-proxy and CNIs
/// (kube-proxy uses 0x4000 and 0x8000).
pub const MARK_MASK: u32 = 0xffff_0000;

/// Checks an interface name prefix (1-7 of a-z, 0-9, '-').
pub fn validate_prefix(prefix: &str) -> Result<(), String> {
    let max = IFNAME_MAX - HASH_DIGITS;
    if prefix.is_empty() || prefix.len() > max {
        return Err(format!("{prefix:?} must be 1 to {max} characters"));
    }
    if !prefix
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(format!("{prefix:?} may only hold a-z, 0-9 and '-'"));
    }
    Ok(())
}

/// FNV-1a, 64 bits: stable across Rust versions and platforms, unlike `DefaultHasher`.
fn fnv1a(parts: &[&str]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            hash ^= u64::from(b'/');
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        for b in part.bytes() {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// The interface of the tunnel from `local` to `remote`: the prefix and 8 hex digits of a hash
/// of the pair. The pair (not just the remote) goes into the hash because the lab runs several
/// clusters on one host, and userspace WireGuard names must be host-unique (spike, pitfall 3).
pub fn interface_name(prefix: &str, local: &ClusterId, remote: &ClusterId) -> String {
    let hash = fnv1a(&[local.as_str(), remote.as_str()]);
    let short = (hash >> 32) as u32 ^ (hash as u32);
    format!("{prefix}{short:08x}")
}

/// The connection mark of a peer: its slot in the high 16 bits (slots are unique per peer, so
/// marks are too).
pub fn mark(slot: u16) -> u32 {
    u32::from(slot) << 16
}

/// The routing table of a peer (holding only `default dev <its interface>`): its slot number.
pub fn table(slot: u16) -> u32 {
    u32::from(slot)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> ClusterId {
        ClusterId::parse("cluster_id", s).expect("valid")
    }

    #[test]
    fn names_are_short_stable_and_distinct() {
        let a = interface_name("tg", &id("a"), &id("c"));
        assert_eq!(a.len(), 10);
        assert_eq!(a, interface_name("tg", &id("a"), &id("c")));
        assert_ne!(a, interface_name("tg", &id("c"), &id("a")));
        assert_ne!(a, interface_name("tg", &id("a"), &id("b")));
        assert!(interface_name("trellis", &id("x"), &id("y")).len() <= IFNAME_MAX);
    }

    #[test]
    fn marks_stay_out_of_the_low_bits() {
        assert_eq!(mark(51841), 0xca81_0000);
        assert_eq!(mark(65535) & !MARK_MASK, 0);
        assert_eq!(table(51841), 51841);
    }
}
