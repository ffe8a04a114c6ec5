//! The DNS server's Prometheus metrics: `trellis_dns_queries_total{rcode}`, every answer by
//! response code, and `trellis_dns_zone_names`, the names the zone holds now.

use hickory_proto::op::ResponseCode;
use trellis_runtime::metrics::prometheus_client::metrics::counter::Counter;
use trellis_runtime::metrics::prometheus_client::metrics::family::Family;
use trellis_runtime::metrics::prometheus_client::metrics::gauge::Gauge;
use trellis_runtime::metrics::{Labels, Metrics};

/// Handles on the DNS metrics (cheap to clone).
#[derive(Debug, Clone, Default)]
pub struct DnsMetrics {
    queries: Family<Labels, Counter>,
    names: Gauge,
}

fn rcode_label(code: ResponseCode) -> &'static str {
    match code {
        ResponseCode::NoError => "NOERROR",
        ResponseCode::NXDomain => "NXDOMAIN",
        ResponseCode::Refused => "REFUSED",
        ResponseCode::ServFail => "SERVFAIL",
        ResponseCode::FormErr => "FORMERR",
        ResponseCode::NotImp => "NOTIMP",
        _ => "OTHER",
    }
}

impl DnsMetrics {
    /// Registers the DNS metrics on `metrics`.
    pub fn register(metrics: &Metrics) -> Self {
        let out = Self::default();
        metrics.register(
            "trellis_dns_queries",
            "DNS questions answered for the clusterset zone, by response code (NOERROR includes \
             empty answers; SERVFAIL before the first zone is built)",
            out.queries.clone(),
        );
        metrics.register(
            "trellis_dns_zone_names",
            "Names with records in the clusterset zone now",
            out.names.clone(),
        );
        out
    }

    pub(super) fn answered(&self, code: ResponseCode) {
        self.queries
            .get_or_create(&vec![("rcode", rcode_label(code).to_owned())])
            .inc();
    }

    pub(super) fn zone_built(&self, names: usize) {
        self.names.set(i64::try_from(names).unwrap_or(i64::MAX));
    }
}
