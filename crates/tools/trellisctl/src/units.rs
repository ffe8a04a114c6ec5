//! Times, ages, byte counts and durations in the forms the output uses: RFC 3339 UTC timestamps
//! (`2025-01-02T03:04:05Z`), ages ("12s ago"), binary byte units ("1.5 KiB") and milliseconds.

use std::time::{SystemTime, UNIX_EPOCH};

/// A protobuf timestamp as RFC 3339 in UTC, to the second; `None` when unset or out of range.
pub fn rfc3339(ts: Option<&prost_types::Timestamp>) -> Option<String> {
    let ts = ts?;
    // Years 0000-9999 only.
    if !(-62_167_219_200..=253_402_300_799).contains(&ts.seconds) {
        return None;
    }
    let days = ts.seconds.div_euclid(86_400);
    let secs_of_day = ts.seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    Some(format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs_of_day / 3600,
        secs_of_day % 3600 / 60,
        secs_of_day % 60
    ))
}

/// Proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Whole seconds from `ts` to `now` (0 when `ts` is in the future); `None` when unset.
pub fn age_seconds(ts: Option<&prost_types::Timestamp>, now: SystemTime) -> Option<u64> {
    let ts = ts?;
    let now = i64::try_from(now.duration_since(UNIX_EPOCH).ok()?.as_secs()).ok()?;
    Some(u64::try_from(now.saturating_sub(ts.seconds)).unwrap_or(0))
}

/// "12s ago", "4m ago", "3h ago", "2d ago"; "never" for `None`.
pub fn ago(seconds: Option<u64>) -> String {
    seconds.map_or_else(|| "never".into(), |s| format!("{} ago", span(s)))
}

/// "12s", "4m", "3h", "2d": a duration to its largest whole unit.
pub fn duration(d: std::time::Duration) -> String {
    span(d.as_secs())
}

fn span(s: u64) -> String {
    match s {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m", s / 60),
        s if s < 86_400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

/// "0 B", "512 B", "1.5 KiB", "3.0 MiB".
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    #[allow(clippy::cast_precision_loss)] // one decimal is shown
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// A protobuf duration in milliseconds; `None` when unset or negative.
pub fn millis(d: Option<&prost_types::Duration>) -> Option<f64> {
    let d = d?;
    if d.seconds < 0 || d.nanos < 0 {
        return None;
    }
    #[allow(clippy::cast_precision_loss)] // latencies are far below 2^53 ms
    Some(d.seconds as f64 * 1000.0 + f64::from(d.nanos) / 1_000_000.0)
}

/// "1.25 ms", or "-" for `None`.
pub fn millis_text(ms: Option<f64>) -> String {
    ms.map_or_else(|| "-".into(), |ms| format!("{ms:.2} ms"))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn ts(seconds: i64) -> prost_types::Timestamp {
        prost_types::Timestamp { seconds, nanos: 0 }
    }

    #[test]
    fn rfc3339_in_utc() {
        assert_eq!(
            rfc3339(Some(&ts(0))).as_deref(),
            Some("1970-01-01T00:00:00Z")
        );
        assert_eq!(
            rfc3339(Some(&ts(1_709_251_199))).as_deref(),
            Some("2024-02-29T23:59:59Z")
        );
        assert_eq!(
            rfc3339(Some(&ts(-86_400))).as_deref(),
            Some("1969-12-31T00:00:00Z")
        );
        assert_eq!(rfc3339(None), None);
        assert_eq!(rfc3339(Some(&ts(i64::MAX))), None);
    }

    #[test]
    fn ages() {
        let now = UNIX_EPOCH + Duration::from_secs(10_000);
        assert_eq!(age_seconds(Some(&ts(9_988)), now), Some(12));
        assert_eq!(age_seconds(Some(&ts(20_000)), now), Some(0));
        assert_eq!(ago(Some(12)), "12s ago");
        assert_eq!(ago(Some(125)), "2m ago");
        assert_eq!(ago(Some(7_200)), "2h ago");
        assert_eq!(ago(Some(172_800)), "2d ago");
        assert_eq!(ago(None), "never");
    }

    #[test]
    fn byte_units() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 * 1024 * 1024), "3.0 MiB");
    }

    #[test]
    fn durations() {
        let d = prost_types::Duration {
            seconds: 0,
            nanos: 1_250_000,
        };
        assert_eq!(millis(Some(&d)), Some(1.25));
        assert_eq!(millis_text(millis(Some(&d))), "1.25 ms");
        assert_eq!(millis_text(None), "-");
    }
}
