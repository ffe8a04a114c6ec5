//! Scraping a service's `/metrics` and parsing it with a real Prometheus text parser (the
//! Python `prometheus_client` parser, through scripts/parse-metrics.py), so tests check the
//! format with a parser not written for them.

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

fn scrape_over(mut stream: TcpStream, addr: &str) -> String {
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("response");
    let (head, body) = response.split_once("\r\n\r\n").expect("http response");
    assert!(head.starts_with("HTTP/1.1 200"), "{addr}: {head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain"),
        "{addr}: {head}"
    );
    body.to_owned()
}

/// Parses `text` with the Prometheus parser; panics with the parser's error when it refuses.
pub fn parse(python: &Path, text: &str) -> Vec<Sample> {
    let mut child = Command::new(python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/parse-metrics.py"))
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
