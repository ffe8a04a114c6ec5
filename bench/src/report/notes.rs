//! The hand-written notes: their `{{benchmark:/json/pointer}}` placeholders filled from the
//! results.

use serde_json::Value;

use super::format::num;
use super::inputs::{Inputs, Loaded};

/// Replaces `{{bench:/pointer}}` and `{{bench:/pointer|N}}` in a note with values from the
/// results; anything that cannot be resolved becomes a visible "(not measured: …)".
pub fn fill(note: &str, inputs: &Inputs) -> String {
    let mut out = String::new();
    let mut rest = note;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find("}}") else {
            out.push_str(&rest[start..]);
            return out;
        };
        out.push_str(&placeholder(after[..end].trim(), inputs));
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    out
}

fn placeholder(spec: &str, inputs: &Inputs) -> String {
    let (reference, decimals) = match spec.split_once('|') {
        Some((r, d)) => (r.trim(), d.trim().parse::<usize>().ok()),
        None => (spec, None),
    };
    let Some((name, pointer)) = reference.split_once(':') else {
        return format!("(bad placeholder `{spec}`)");
    };
    let value = inputs
        .results
        .get(name)
        .and_then(Loaded::value)
        .and_then(|v| v.pointer(pointer));
    match value {
        None => format!("(not measured: no `{reference}`)"),
        Some(Value::Number(n)) => match (n.as_f64(), decimals) {
            (Some(f), Some(d)) => num(f, d),
            (Some(f), None) if n.is_f64() => num(f, 3),
            _ => n.to_string(),
        },
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

pub(super) fn note(inputs: &Inputs, name: &str) -> String {
    inputs
        .notes
        .get(name)
        .map(|n| fill(n.trim(), inputs) + "\n\n")
        .unwrap_or_default()
}
