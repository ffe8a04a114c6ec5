//! Formatting of the document's figures: numbers with grouped thousands, optional values, commit
//! hashes, and the line that says which run a section shows.

use std::fmt::Write as _;

use serde::Serialize;

use crate::results::{CpuLatencyLimit, Header, RunKind};

/// A number with `decimals` decimals and thin grouping of thousands (as in the earlier
/// hand-written tables: `49 788`).
pub fn num(v: f64, decimals: usize) -> String {
    if !v.is_finite() {
        return "n/a".into();
    }
    let text = format!("{:.*}", decimals, v.abs());
    let (int, frac) = text
        .split_once('.')
        .map_or((text.as_str(), None), |(i, f)| (i, Some(f)));
    let mut grouped = String::new();
    let digits: Vec<char> = int.chars().collect();
    for (i, c) in digits.iter().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) && digits.len() > 4 {
            grouped.push(' ');
        }
        grouped.push(*c);
    }
    let sign = if v < 0.0 && text.chars().any(|c| c != '0' && c != '.') {
        "-"
    } else {
        ""
    };
    match frac {
        Some(f) => format!("{sign}{grouped}.{f}"),
        None => format!("{sign}{grouped}"),
    }
}

pub(super) fn opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "—".into(), |v| num(v, decimals))
}

/// The gateways' busy-polling window and budget as a run recorded them.
pub(super) fn busy_polling(us: Option<u64>, budget_percent: Option<u8>) -> String {
    match (us, budget_percent) {
        (None, _) => "busy polling: not recorded".into(),
        (Some(0), _) | (_, Some(0)) => "busy polling: off".into(),
        // Runs from before the budget polled without one.
        (Some(us), None | Some(100..)) => format!("busy polling: {us} µs, no budget"),
        (Some(us), Some(percent)) => {
            format!("busy polling: {us} µs, at most {percent} % of the time")
        }
    }
}

/// The kernel's CPU latency limit as a run recorded it.
pub(super) fn cpu_latency(limit: Option<CpuLatencyLimit>) -> String {
    match limit {
        None => "CPU latency limit: not recorded".into(),
        Some(CpuLatencyLimit::None) => "CPU latency limit: none".into(),
        Some(CpuLatencyLimit::Microseconds(us)) => format!("CPU latency limit: {us} µs"),
    }
}

pub(super) fn opt_usize(v: Option<usize>) -> String {
    v.map_or_else(|| "—".into(), |v| num(v as f64, 0))
}

pub(super) fn short_commit(c: &str) -> String {
    let (hash, dirty) = c.split_once('+').map_or((c, ""), |(h, d)| (h, d));
    let short: String = hash.chars().take(10).collect();
    if dirty.is_empty() {
        short
    } else {
        format!("{short}+{dirty}")
    }
}

/// "Run: quick, 2026-…, commit …, `path`." for a section.
pub(super) fn run_line(path: &str, common: &Header) -> String {
    let run = common.run.clone().unwrap_or_default();
    let mut line = format!(
        "*Result: `{path}`; run: {}",
        run.kind
            .map_or("full (written before runs were labelled)", RunKind::as_str)
    );
    match &run.timestamp {
        Some(t) => {
            let _ = write!(line, ", started {t}");
        }
        None => line.push_str(", date not recorded"),
    }
    match &run.git_commit {
        Some(c) => {
            let _ = write!(line, ", commit `{}`", short_commit(c));
        }
        None => line.push_str(", commit not recorded"),
    }
    if let Some(l) = run.load_average_1m {
        let _ = write!(line, ", 1-minute load average {} at start", num(l, 2));
    }
    line.push_str(".*");
    if !run.note.is_empty() {
        let _ = write!(line, " Note: {}", run.note.trim());
    }
    line
}

/// Parameters as one line of JSON. Through a `Value`, so that the keys are ordered as they
/// were when the report read the files as untyped JSON.
pub(super) fn compact(v: &impl Serialize) -> String {
    serde_json::to_value(v)
        .and_then(|v| serde_json::to_string(&v))
        .unwrap_or_default()
}
