//! Scraping a service's `/metrics` and parsing it with real Prometheus parsers (the Python
//! `prometheus_client` parsers for the text format and OpenMetrics, through
//! scripts/parse-metrics.py) and `promtool`, so tests check the format with tools not written
//! for them.

use std::collections::BTreeMap;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use trellis_testkit::{in_ci, workspace_root};

/// One parsed sample.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Sample {
    pub family: String,
    pub name: String,
    /// The family's type as the parser read it (`counter`, `gauge`, `histogram`, `unknown`...).
    #[serde(rename = "type")]
    pub kind: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl Sample {
    /// Whether the sample has label `name` set to `value`.
    pub fn has(&self, name: &str, value: &str) -> bool {
        self.labels.get(name).map(String::as_str) == Some(value)
    }
}

/// The venv's Python with `prometheus_client`, or `None` (a loud skip outside CI).
pub fn parser_python() -> Option<PathBuf> {
    let python = workspace_root().join(".tools/venv/bin/python");
    let ok = Command::new(&python)
        .args(["-c", "import prometheus_client.parser"])
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        return Some(python);
    }
    assert!(
        !in_ci(),
        "python prometheus_client is missing; scripts/setup.sh installs it"
    );
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED: python prometheus_client is missing; run scripts/setup.sh"
    );
    None
}

/// `GET /metrics` over HTTP/1.1: the body, after checking the status and content type.
pub fn scrape(addr: &str) -> String {
    let stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    scrape_over(stream, addr)
}

/// [`scrape`] from inside network namespace `ns`.
pub fn scrape_in(ns: &str, addr: SocketAddr) -> String {
    let stream = trellis_netlab::netns::in_netns(ns, move || TcpStream::connect(addr))
        .unwrap_or_else(|e| panic!("connect {addr} in {ns}: {e}"));
    scrape_over(stream, &addr.to_string())
}

fn scrape_over(stream: TcpStream, addr: &str) -> String {
    let (content_type, body) = request(stream, addr, None);
    assert!(
        content_type.starts_with("text/plain"),
        "{addr}: {content_type}"
    );
    body
}

/// `GET /metrics` with `Accept: accept`: the response's content type (lowercase) and body.
pub fn scrape_accepting(addr: &str, accept: &str) -> (String, String) {
    let stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    request(stream, addr, Some(accept))
}

fn request(mut stream: TcpStream, addr: &str, accept: Option<&str>) -> (String, String) {
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n{accept}Connection: close\r\n\r\n"
    )
    .expect("request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("response");
    let (head, body) = response.split_once("\r\n\r\n").expect("http response");
    assert!(head.starts_with("HTTP/1.1 200"), "{addr}: {head}");
    let content_type = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("content-type"))
        .map(|(_, value)| value.trim().to_ascii_lowercase())
        .unwrap_or_else(|| panic!("{addr}: no content type in {head}"));
    (content_type, body.to_owned())
}

/// Checks `text` (the classic text format) with Prometheus's own `promtool check metrics`,
/// panicking with what it reports; `false` (a loud skip outside CI) without promtool.
pub fn promtool_check(text: &str) -> bool {
    let Some(promtool) = trellis_testkit::require_tool("promtool") else {
        return false;
    };
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("promtool output");
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    true
}

/// Parses `text` (the text format) with the Prometheus parser; panics with the parser's error
/// when it refuses.
pub fn parse(python: &Path, text: &str) -> Vec<Sample> {
    parse_with(python, text, false)
}

/// Parses `text` with the OpenMetrics parser.
pub fn parse_openmetrics(python: &Path, text: &str) -> Vec<Sample> {
    parse_with(python, text, true)
}

fn parse_with(python: &Path, text: &str, openmetrics: bool) -> Vec<Sample> {
    let mut child = Command::new(python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/parse-metrics.py"))
        .args(openmetrics.then_some("--openmetrics"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("parser runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("parser output");
    assert!(
        out.status.success(),
        "the Prometheus parser rejected the scrape: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("sample json"))
        .collect()
}
