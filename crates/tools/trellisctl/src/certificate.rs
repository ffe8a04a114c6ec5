//! The expiry (`notAfter`) of a PEM certificate, for `diagnose`.
//!
//! Only the few DER elements in front of the validity are walked (RFC 5280 §4.1): a full X.509
//! parser would add a crate (and a second `nom`, ADR 0014) for one date. Anything unexpected
//! is an error naming what was wrong, never a panic.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;

/// One DER element: tag and contents, and what follows it.
fn element(input: &[u8]) -> Result<(u8, &[u8], &[u8]), String> {
    let (&tag, rest) = input.split_first().ok_or("truncated DER")?;
    let (&first, rest) = rest.split_first().ok_or("truncated DER length")?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return Err("unsupported DER length".into());
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    if rest.len() < len {
        return Err("truncated DER contents".into());
    }
    Ok((tag, &rest[..len], &rest[len..]))
}

/// The DER of the first `CERTIFICATE` block in `pem`.
fn der(pem: &str) -> Result<Vec<u8>, String> {
    let begin = "-----BEGIN CERTIFICATE-----";
    let start = pem.find(begin).ok_or("no PEM certificate")? + begin.len();
    let end = pem[start..]
        .find("-----END CERTIFICATE-----")
        .ok_or("unterminated PEM certificate")?;
    let body: String = pem[start..start + end]
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    base64::engine::general_purpose::STANDARD
        .decode(body)
        .map_err(|e| format!("bad base64 in the PEM certificate: {e}"))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// UTCTime (`YYMMDDHHMMSSZ`, tag 0x17) or GeneralizedTime (`YYYYMMDDHHMMSSZ`, tag 0x18).
fn time(tag: u8, contents: &[u8]) -> Result<SystemTime, String> {
    let text = std::str::from_utf8(contents).map_err(|_| "time is not ASCII")?;
    let digits = text.strip_suffix('Z').ok_or("time is not in UTC")?;
    let (year, rest) = match (tag, digits.len()) {
        (0x17, 12) => {
            let yy: i64 = digits[..2].parse().map_err(|_| "bad year")?;
            // RFC 5280: 50-99 are 19xx, 00-49 are 20xx.
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, &digits[2..])
        }
        (0x18, 14) => (digits[..4].parse().map_err(|_| "bad year")?, &digits[4..]),
        _ => return Err(format!("unsupported time {text:?}")),
    };
    let field = |i: usize| -> Result<i64, String> {
        rest.get(i..i + 2)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bad time {text:?}"))
    };
    let (month, day, hour, minute, second) =
        (field(0)?, field(2)?, field(4)?, field(6)?, field(8)?);
    if !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return Err(format!("bad time {text:?}"));
    }
    let secs = days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second;
    let secs = u64::try_from(secs).map_err(|_| format!("time {text:?} is before 1970"))?;
    Ok(UNIX_EPOCH + Duration::from_secs(secs))
}

/// When the first certificate in `pem` stops being valid.
pub fn not_after(pem: &str) -> Result<SystemTime, String> {
    let der = der(pem)?;
    let (tag, certificate, _) = element(&der)?;
    if tag != 0x30 {
        return Err("not a certificate".into());
    }
    let (tag, tbs, _) = element(certificate)?;
    if tag != 0x30 {
        return Err("not a certificate".into());
    }
    let mut rest = tbs;
    // [0] EXPLICIT version, optional.
    if rest.first() == Some(&0xa0) {
        rest = element(rest)?.2;
    }
    // serialNumber, signature, issuer.
    for _ in 0..3 {
        rest = element(rest)?.2;
    }
    let (tag, validity, _) = element(rest)?;
    if tag != 0x30 {
        return Err("no validity in the certificate".into());
    }
    let (_, _, after_not_before) = element(validity)?;
    let (tag, contents, _) = element(after_not_before)?;
    time(tag, contents)
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_runtime::tls::{ClusterCa, IssueOptions};

    #[test]
    fn reads_the_expiry_of_a_certificate_we_issued() {
        let ca = ClusterCa::generate("hub").expect("ca");
        let wanted = UNIX_EPOCH + Duration::from_secs(4_102_444_800); // 2100-01-01
        let issued = ca
            .issue_with(&IssueOptions {
                service: "broker".into(),
                cluster_id: "hub".into(),
                not_before: UNIX_EPOCH + Duration::from_secs(1_700_000_000),
                not_after: wanted,
            })
            .expect("issued");
        assert_eq!(not_after(&issued.cert_pem).expect("parsed"), wanted);
        // The CA's own certificate parses too, and is valid today.
        assert!(not_after(ca.cert_pem()).expect("ca parsed") > SystemTime::now());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for pem in [
            "",
            "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----",
            "-----BEGIN CERTIFICATE-----\nMAA=\n-----END CERTIFICATE-----",
            "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----",
        ] {
            assert!(not_after(pem).is_err(), "{pem:?}");
        }
    }

    #[test]
    fn both_asn1_time_forms() {
        assert_eq!(
            time(0x17, b"491231235959Z").expect("utc"),
            UNIX_EPOCH + Duration::from_secs(2_524_607_999)
        );
        assert_eq!(
            time(0x18, b"19700101000000Z").expect("generalized"),
            UNIX_EPOCH
        );
        assert!(time(0x17, b"701301000000Z").is_err());
    }
}
