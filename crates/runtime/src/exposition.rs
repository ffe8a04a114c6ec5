//! The two Prometheus exposition formats `/metrics` speaks, and which one a scraper gets.
//!
//! `prometheus-client` writes OpenMetrics only. Served under the classic text format's content
//! type (`text/plain; version=0.0.4`), that body is misread: OpenMetrics names a counter's
//! family without `_total` (`# TYPE grpc_server_handled counter` over samples named
//! `grpc_server_handled_total`), so a text-format parser attaches the type and help to a name
//! no sample has and stores the samples untyped, and `# EOF` and `# UNIT` mean nothing there.
//! So a scraper that asks for OpenMetrics (`Accept: application/openmetrics-text`, as
//! Prometheus does when it may) gets it as written, and every other one the same samples
//! rewritten into the text format ([`to_text`]).

use std::collections::HashMap;
use std::fmt::Write as _;

/// The content type of the OpenMetrics body.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of the classic text format.
pub const TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The exposition format a request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    OpenMetrics,
    Text,
}

impl Format {
    /// The format for a request with this `Accept` header: OpenMetrics when it is listed with
    /// a quality above zero, the text format otherwise (no header, `*/*`, `text/plain`).
    pub fn negotiate(accept: Option<&str>) -> Self {
        let wants_openmetrics = accept.is_some_and(|accept| {
            accept.split(',').any(|range| {
                let mut parts = range.split(';').map(str::trim);
                let media = parts.next().unwrap_or_default();
                let refused = parts.any(|p| {
                    p.strip_prefix("q=")
                        .and_then(|q| q.parse::<f32>().ok())
                        .is_some_and(|q| q <= 0.0)
                });
                media.eq_ignore_ascii_case("application/openmetrics-text") && !refused
            })
        });
        if wants_openmetrics {
            Self::OpenMetrics
        } else {
            Self::Text
        }
    }

    /// The `Content-Type` of a body in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Self::OpenMetrics => OPENMETRICS,
            Self::Text => TEXT,
        }
    }
}

/// `openmetrics` (as `prometheus-client` writes it) in the text format: the metadata of
/// counters and infos names their samples (`_total`, `_info`), types the text format lacks
/// become the nearest it has, and `# EOF`, `# UNIT`, `_created` samples and exemplars go.
pub fn to_text(openmetrics: &str) -> String {
    // Each family's type first: HELP comes before TYPE, and both take the text format's name.
    let kinds: HashMap<&str, &str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.split_once(' '))
        .collect();
    let text_name = |family: &str| match kinds.get(family).copied() {
        Some("counter") => format!("{family}_total"),
        Some("info") => format!("{family}_info"),
        _ => family.to_owned(),
    };
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (family, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            let kind = match kind {
                "counter" | "gauge" | "histogram" | "summary" => kind,
                "info" | "stateset" => "gauge",
                _ => "untyped",
            };
            let _ = writeln!(out, "# TYPE {} {kind}", text_name(family));
        } else if let Some(rest) = line.strip_prefix("# HELP ") {
            let (family, help) = rest.split_once(' ').unwrap_or((rest, ""));
            // OpenMetrics escapes `"` in help text; the text format only `\\` and `\n`.
            let _ = writeln!(
                out,
                "# HELP {} {}",
                text_name(family),
                help.replace("\\\"", "\"")
            );
        } else if line.starts_with('#') {
            // `# EOF`, `# UNIT`: nothing in the text format.
        } else {
            // An exemplar follows the value: look for it after the labels only.
            let labels_end = labels_end(line);
            let sample = line[labels_end..]
                .find(" # ")
                .map_or(line, |at| &line[..labels_end + at]);
            let name = sample.split(['{', ' ']).next().unwrap_or_default();
            let created = name
                .strip_suffix("_created")
                .is_some_and(|family| kinds.get(family) == Some(&"counter"));
            if !created {
                out.push_str(sample);
                out.push('\n');
            }
        }
    }
    out
}

/// Where the label set of sample `line` ends (0 without one): its closing brace, the first
/// one outside a quoted value.
fn labels_end(line: &str) -> usize {
    let Some(open) = line.find('{') else {
        return 0;
    };
    let (mut quoted, mut escaped) = (false, false);
    for (at, c) in line.char_indices().skip_while(|(at, _)| *at <= open) {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return at,
            _ => {}
        }
    }
    line.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPENMETRICS_BODY: &str = "# HELP grpc_server_handled Calls finished, with \\\"code\\\".\n\
        # TYPE grpc_server_handled counter\n\
        grpc_server_handled_total{code=\"OK\"} 3\n\
        grpc_server_handled_created{code=\"OK\"} 1.7e9\n\
        # HELP build Build facts.\n\
        # TYPE build info\n\
        build_info{version=\"1\"} 1\n\
        # HELP up_seconds Uptime.\n\
        # TYPE up_seconds gauge\n\
        # UNIT up_seconds seconds\n\
        up_seconds 12.5\n\
        # HELP rpc_seconds Latency.\n\
        # TYPE rpc_seconds histogram\n\
        rpc_seconds_sum 0.5\n\
        rpc_seconds_count 2\n\
        rpc_seconds_bucket{le=\"+Inf\",path=\"/a # {b}\"} 2 # {trace_id=\"ab\"} 0.25\n\
        # EOF\n";

    #[test]
    fn counters_and_infos_are_typed_under_their_samples_names() {
        let text = to_text(OPENMETRICS_BODY);
        assert!(
            text.contains(
                "# HELP grpc_server_handled_total Calls finished, with \"code\".\n\
                 # TYPE grpc_server_handled_total counter\n\
                 grpc_server_handled_total{code=\"OK\"} 3\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "# HELP build_info Build facts.\n# TYPE build_info gauge\nbuild_info{version=\"1\"} 1\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("# HELP up_seconds Uptime.\n# TYPE up_seconds gauge\nup_seconds 12.5\n"),
            "{text}"
        );
    }

    #[test]
    fn what_the_text_format_lacks_goes() {
        let text = to_text(OPENMETRICS_BODY);
        for gone in ["# EOF", "# UNIT", "_created", "trace_id"] {
            assert!(!text.contains(gone), "{gone} in {text}");
        }
        assert!(
            text.contains("rpc_seconds_bucket{le=\"+Inf\",path=\"/a # {b}\"} 2\n"),
            "{text}"
        );
    }

    #[test]
    fn openmetrics_only_for_those_who_ask() {
        assert_eq!(Format::negotiate(None), Format::Text);
        assert_eq!(Format::negotiate(Some("*/*")), Format::Text);
        assert_eq!(
            Format::negotiate(Some("text/plain;version=0.0.4")),
            Format::Text
        );
        assert_eq!(
            Format::negotiate(Some(
                "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                 version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
            )),
            Format::OpenMetrics
        );
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text;q=0, text/plain")),
            Format::Text
        );
        assert_eq!(Format::Text.content_type(), TEXT);
        assert_eq!(Format::OpenMetrics.content_type(), OPENMETRICS);
    }
}
