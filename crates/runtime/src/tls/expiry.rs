//! When a service's certificates stop being valid, for operators before it bites:
//! `trellis_tls_certificate_expiry_timestamp_seconds{service,kind}` on every service with
//! mutual TLS, `kind` being `service` (its own certificate, which renewal replaces) or `ca` (its
//! cluster's CA), and `trellis_tls_certificate_not_before_timestamp_seconds{service,kind}`,
//! when each became valid: with both, an alert can tell a renewal that is overdue from a short
//! lifetime (a 7-day certificate always has less than 7 days left). Read from the certificates
//! in use at every scrape, so a renewed certificate shows at once.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::gauge::ConstGauge;

use trellis_error::{Error, Result};

use super::peer_tls::PeerTls;
use super::pem::parse_certs;

/// The metrics' names.
pub const EXPIRY_METRIC: &str = "trellis_tls_certificate_expiry_timestamp_seconds";
pub const NOT_BEFORE_METRIC: &str = "trellis_tls_certificate_not_before_timestamp_seconds";

/// The end of a DER certificate's validity (`notAfter`); `None` when it is no certificate.
pub fn not_after(der: &[u8]) -> Option<SystemTime> {
    validity(der).map(|(_, end)| end)
}

/// A DER certificate's validity, `(notBefore, notAfter)`; `None` when it is no certificate.
pub fn validity(der: &[u8]) -> Option<(SystemTime, SystemTime)> {
    let (from, to) = yasna::parse_der(der, |r| {
        r.read_sequence(|r| {
            let not_after = r.next().read_sequence(|r| {
                // version [0] EXPLICIT (absent in v1), serialNumber, signature, issuer.
                r.read_optional(|r| r.read_tagged(yasna::Tag::context(0), |r| r.read_i64()))?;
                for _ in 0..3 {
                    r.next().read_der()?;
                }
                let not_after = r.next().read_sequence(|r| {
                    let time = |r: yasna::BERReader<'_, '_>| {
                        if r.lookahead_tag()? == yasna::tags::TAG_UTCTIME {
                            Ok(r.read_utctime()?.datetime().unix_timestamp())
                        } else {
                            Ok(r.read_generalized_time()?.datetime().unix_timestamp())
                        }
                    };
                    Ok((time(r.next())?, time(r.next())?))
                })?;
                // The rest of the TBSCertificate: subject, key, extensions.
                while r.read_optional(|r| r.read_der())?.is_some() {}
                Ok(not_after)
            })?;
            // signatureAlgorithm, signatureValue.
            while r.read_optional(|r| r.read_der())?.is_some() {}
            Ok(not_after)
        })
    })
    .ok()?;
    let at =
        |seconds: i64| UNIX_EPOCH.checked_add(Duration::from_secs(u64::try_from(seconds).ok()?));
    Some((at(from)?, at(to)?))
}

/// The end of the validity of the first certificate in `pem` (what `diagnose` reads of a
/// pinned peer CA); the error says what is wrong with it.
pub fn pem_not_after(pem: &str) -> Result<SystemTime> {
    pem_validity(pem).map(|(_, end)| end)
}

/// The validity of the first certificate in `pem`, `(notBefore, notAfter)`; the error says
/// what is wrong with it.
pub fn pem_validity(pem: &str) -> Result<(SystemTime, SystemTime)> {
    let certs = parse_certs("certificate", pem)?;
    certs
        .first()
        .and_then(|der| validity(der.as_ref()))
        .ok_or_else(|| Error::invalid("certificate", "is no X.509 certificate with a validity"))
}

impl PeerTls {
    /// `(kind, notAfter)` of the certificates in use: `service`, then `ca`.
    pub fn expiries(&self) -> Vec<(&'static str, SystemTime)> {
        self.validities()
            .into_iter()
            .map(|(kind, (_, end))| (kind, end))
            .collect()
    }

    /// `(kind, (notBefore, notAfter))` of the certificates in use: `service`, then `ca`.
    pub fn validities(&self) -> Vec<(&'static str, (SystemTime, SystemTime))> {
        let mut out = Vec::new();
        if let Some(leaf) = self.own_cert().current_leaf()
            && let Some(valid) = validity(&leaf)
        {
            out.push(("service", valid));
        }
        if let Some(valid) = validity(&self.own_ca_der()) {
            out.push(("ca", valid));
        }
        out
    }
}

fn epoch_seconds(at: SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// The expiry gauge of one service's certificates.
#[derive(Debug)]
pub struct ExpiryCollector {
    service: &'static str,
    tls: PeerTls,
}

impl ExpiryCollector {
    pub fn new(service: &'static str, tls: PeerTls) -> Self {
        Self { service, tls }
    }
}

impl Collector for ExpiryCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let validities = self.tls.validities();
        if validities.is_empty() {
            return Ok(());
        }
        for (name, help, end) in [
            (
                EXPIRY_METRIC,
                "When the certificate stops being valid (its notAfter), seconds since the \
                 epoch: kind=service is this service's own certificate, kind=ca its cluster's CA",
                true,
            ),
            (
                NOT_BEFORE_METRIC,
                "When the certificate became valid (its notBefore), seconds since the epoch: \
                 with the expiry, its lifetime and how much of it is left",
                false,
            ),
        ] {
            let mut family =
                encoder.encode_descriptor(name, help, None, ConstGauge::new(0i64).metric_type())?;
            for (kind, (from, to)) in &validities {
                let labels = [("service", self.service), ("kind", kind)];
                let at = if end { *to } else { *from };
                ConstGauge::new(epoch_seconds(at)).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::{ClusterCa, IssueOptions};

    #[test]
    fn reads_the_expiry_of_certificates_in_both_time_forms() {
        let ca = ClusterCa::generate("hub").expect("ca");
        // After 2049 a certificate's time is a GeneralizedTime, before it a UTCTime.
        for secs in [4_102_444_800u64, 1_800_000_000] {
            let wanted = UNIX_EPOCH + Duration::from_secs(secs);
            let issued = ca
                .issue_with(&IssueOptions {
                    service: "broker".into(),
                    cluster_id: "hub".into(),
                    not_before: UNIX_EPOCH + Duration::from_secs(1_700_000_000),
                    not_after: wanted,
                })
                .expect("issued");
            assert_eq!(pem_not_after(&issued.cert_pem).expect("parsed"), wanted);
            let der = parse_certs("certificate", &issued.cert_pem).expect("pem");
            assert_eq!(
                validity(der[0].as_ref()).expect("validity"),
                (UNIX_EPOCH + Duration::from_secs(1_700_000_000), wanted)
            );
        }
        assert!(pem_not_after(ca.cert_pem()).expect("ca parsed") > SystemTime::now());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for pem in [
            "",
            "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----",
            "-----BEGIN CERTIFICATE-----\nMAA=\n-----END CERTIFICATE-----",
            "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----",
        ] {
            assert!(pem_not_after(pem).is_err(), "{pem:?}");
        }
    }
}
