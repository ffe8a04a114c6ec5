//! What `deploy/` gives an operator's Prometheus and Grafana, checked with Prometheus's own
//! `promtool` (Debian's `prometheus` package; CI fails without it, elsewhere the tests are
//! skipped loudly):
//!
//! - the alerting rules (`deploy/prometheus/trellis-alerts.yaml`) load, and their unit tests
//!   (`trellis-alerts.test.yaml`) pass. Certificates: a 7-day certificate with 5 days left is
//!   quiet, one with less than a quarter of its lifetime left warns after 10 minutes, one with
//!   less than a tenth is critical at once; a CA 20 days from expiry warns, 3 days is critical,
//!   a year is quiet. The gateway: a tunnel of the active replica down for 5 minutes is
//!   critical while the standby's tunnels (no handshakes, as a standby should have) stay quiet;
//!   a gateway with no active replica is critical after a minute; a standby that is not warm
//!   warns; decrypted packets the host refuses warn while forged datagrams dropped do not. The
//!   services: store errors warn but a compacted watch does not; internal errors warn but
//!   invalid arguments do not; a remap pool 95 % used warns, one 10 % used does not;
//! - every query of the Grafana dashboard (`deploy/grafana/trellis.json`) is valid PromQL: each
//!   is loaded by `promtool` as a recording rule.

use std::path::{Path, PathBuf};
use std::process::Command;

use trellis_testkit::require_tool;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

fn promtool(args: &[&str], dir: &Path) -> (bool, String) {
    let promtool = require_tool("promtool").expect("checked by the caller");
    let out = Command::new(promtool)
        .args(args)
        .current_dir(dir)
        .output()
        .expect("promtool runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn the_alerting_rules_load_and_their_unit_tests_pass() {
    if require_tool("promtool").is_none() {
        return;
    }
    let dir = deploy().join("prometheus");
    let (ok, text) = promtool(&["check", "rules", "trellis-alerts.yaml"], &dir);
    assert!(ok, "promtool check rules: {text}");
    assert!(text.contains("11 rules found"), "{text}");
    let (ok, text) = promtool(&["test", "rules", "trellis-alerts.test.yaml"], &dir);
    assert!(ok, "promtool test rules: {text}");
}

#[test]
fn every_dashboard_query_is_valid_promql() {
    if require_tool("promtool").is_none() {
        return;
    }
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(deploy().join("grafana/trellis.json")).expect("dashboard"),
    )
    .expect("the dashboard is JSON");
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let mut queries = 0;
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("a query");
            rules.push_str(&format!(
                "      - record: dashboard:panel_{}_{}\n        expr: {}\n",
                panel["id"],
                target["refId"].as_str().unwrap_or("A"),
                serde_json::Value::from(expr)
            ));
            queries += 1;
        }
    }
    assert!(queries > 16, "only {queries} queries in the dashboard");
    assert!(
        rules.contains("trellis_tls_certificate_expiry_timestamp_seconds"),
        "no panel shows certificate expiry"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("dashboard.yaml"), &rules).expect("written");
    let (ok, text) = promtool(&["check", "rules", "dashboard.yaml"], dir.path());
    assert!(ok, "a dashboard query is not valid PromQL: {text}\n{rules}");
    assert!(text.contains(&format!("{queries} rules found")), "{text}");
}
