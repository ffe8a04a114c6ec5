//! The pure part of remapping: does a network conflict with what is in use, and which network
//! of a given size is the first free one in the pools. No I/O, so it can be property-tested.

use ipnet::IpNet;
use trellis_api::net::{Family, net_bounds, net_from_u128, overlaps};

/// Whether `net` shares an address with any of `used`.
pub fn conflicts(net: IpNet, used: &[IpNet]) -> bool {
    used.iter().any(|u| overlaps(net, *u))
}

/// The first network of `prefix_len` (and `family`) inside `pools`, in pool order, that
/// overlaps none of `used`. The used ranges are merged into disjoint ones in address order and
/// swept once per pool, jumping past each blocking range: O(u log u) for u used ranges. (Scanning
/// every used range for each candidate was O(u²) per allocation; a leaf allocating for 254
/// peers spent most of its IPAM time there.)
pub fn first_free(
    family: Family,
    prefix_len: u8,
    pools: &[IpNet],
    used: &[IpNet],
) -> Option<IpNet> {
    if prefix_len > family.bits() {
        return None;
    }
    let host_bits = family.bits() - prefix_len;
    let host_max: u128 = if host_bits >= 128 {
        u128::MAX
    } else {
        (1u128 << host_bits) - 1
    };
    let mut blocked: Vec<(u128, u128)> = used
        .iter()
        .filter(|u| Family::of_net(**u) == family)
        .map(|u| net_bounds(*u))
        .collect();
    blocked.sort_unstable();
    let mut merged: Vec<(u128, u128)> = Vec::with_capacity(blocked.len());
    for (b0, b1) in blocked {
        match merged.last_mut() {
            Some(last) if b0 <= last.1.saturating_add(1) => last.1 = last.1.max(b1),
            _ => merged.push((b0, b1)),
        }
    }

    for pool in pools {
        if Family::of_net(*pool) != family || pool.prefix_len() > prefix_len {
            continue;
        }
        let (pool_start, pool_end) = net_bounds(*pool);
        // The pool start is aligned to the pool's (coarser or equal) prefix, hence to ours.
        let mut start = pool_start;
        // The first merged range that does not end before the candidate.
        let mut next = merged.partition_point(|(_, b1)| *b1 < start);
        loop {
            let end = start.checked_add(host_max)?;
            if end > pool_end {
                break;
            }
            while merged.get(next).is_some_and(|(_, b1)| *b1 < start) {
                next += 1;
            }
            match merged.get(next).filter(|(b0, _)| *b0 <= end) {
                None => return net_from_u128(family, start, prefix_len),
                Some((_, blocked_end)) => {
                    // Next aligned candidate after the blocking range.
                    let Some(after) = blocked_end.checked_add(1) else {
                        break;
                    };
                    let Some(aligned) = after.checked_add(host_max).map(|v| v & !host_max) else {
                        break;
                    };
                    start = aligned;
                }
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn net(s: &str) -> IpNet {
        s.parse().expect("test network")
    }

    #[test]
    fn skips_used_ranges_and_keeps_the_prefix_length() {
        let pools = [net("10.0.0.0/8")];
        let used = [net("10.0.0.0/16"), net("10.1.0.0/17")];
        assert_eq!(
            first_free(Family::V4, 16, &pools, &used),
            Some(net("10.2.0.0/16"))
        );
        assert_eq!(
            first_free(Family::V4, 17, &pools, &used),
            Some(net("10.1.128.0/17"))
        );
    }

    #[test]
    fn moves_to_the_next_pool_and_reports_exhaustion() {
        let pools = [net("10.0.0.0/15"), net("192.168.0.0/16")];
        let used = [net("10.0.0.0/16"), net("10.1.0.0/16")];
        assert_eq!(
            first_free(Family::V4, 16, &pools, &used),
            Some(net("192.168.0.0/16"))
        );
        let used = [net("10.0.0.0/15"), net("192.168.0.0/16")];
        assert_eq!(first_free(Family::V4, 16, &pools, &used), None);
        // A pool smaller than the wanted network can never hold it.
        assert_eq!(first_free(Family::V4, 8, &[net("10.0.0.0/9")], &[]), None);
    }

    #[test]
    fn ignores_other_families_and_handles_the_whole_space() {
        assert_eq!(first_free(Family::V6, 64, &[net("10.0.0.0/8")], &[]), None);
        assert_eq!(
            first_free(Family::V6, 0, &[net("::/0")], &[]),
            Some(net("::/0"))
        );
        assert_eq!(
            first_free(Family::V6, 64, &[net("fd00::/48")], &[net("fd00::/64")]),
            Some(net("fd00:0:0:1::/64"))
        );
    }

    /// The first free candidate in address order, by trying every aligned one: what
    /// `first_free` must find, however it gets there.
    fn first_free_by_trying_each(prefix: u8, pool: IpNet, used: &[IpNet]) -> Option<IpNet> {
        let size = 1u32 << (32 - prefix);
        let (mut start, end) = match (pool.network(), pool.broadcast()) {
            (std::net::IpAddr::V4(a), std::net::IpAddr::V4(b)) => (u32::from(a), u32::from(b)),
            _ => return None,
        };
        while start <= end {
            let candidate = IpNet::new(std::net::Ipv4Addr::from(start).into(), prefix).ok()?;
            if !conflicts(candidate, used) {
                return Some(candidate);
            }
            start = start.checked_add(size)?;
        }
        None
    }

    proptest! {
        #[test]
        fn result_is_the_first_free_candidate(
            // Dense in the first /12 of the pool, so gaps between used ranges are small.
            used_raw in proptest::collection::vec((0u32..=15, 0u32..=255, 16u8..=24), 0..200),
            prefix in 16u8..=24,
        ) {
            let pool = net("10.0.0.0/8");
            let used: Vec<IpNet> = used_raw
                .iter()
                .map(|(b, c, p)| IpNet::new(std::net::Ipv4Addr::new(10, *b as u8, *c as u8, 0).into(), *p)
                    .expect("valid").trunc())
                .collect();
            prop_assert_eq!(
                first_free(Family::V4, prefix, &[pool], &used),
                first_free_by_trying_each(prefix, pool, &used)
            );
        }

        #[test]
        fn result_is_free_in_a_pool_and_sized(
            used_raw in proptest::collection::vec((0u32..=255, 8u8..=24), 0..24),
            prefix in 8u8..=24,
        ) {
            let pools = [net("10.0.0.0/8")];
            let used: Vec<IpNet> = used_raw
                .iter()
                .map(|(b, p)| IpNet::new(std::net::Ipv4Addr::new(10, *b as u8, 0, 0).into(), *p)
                    .expect("valid").trunc())
                .collect();
            match first_free(Family::V4, prefix, &pools, &used) {
                Some(found) => {
                    prop_assert_eq!(found.prefix_len(), prefix);
                    prop_assert!(pools[0].contains(&found));
                    prop_assert!(!conflicts(found, &used));
                }
                None => {
                    // Exhaustion must be real: every aligned candidate conflicts.
                    let size = 1u32 << (32 - prefix);
                    let mut start = u32::from(std::net::Ipv4Addr::new(10, 0, 0, 0));
                    let end = u32::from(std::net::Ipv4Addr::new(10, 255, 255, 255));
                    while start <= end {
                        let cand = IpNet::new(std::net::Ipv4Addr::from(start).into(), prefix).expect("valid");
                        prop_assert!(conflicts(cand, &used), "{} was free", cand);
                        match start.checked_add(size) { Some(s) => start = s, None => break }
                    }
                }
            }
        }
    }
}
