//! Asking a DNS server with Debian's `dig`, as a resolver in a pod would: the response code,
//! the answer section's record data, the authority section's record types and the header's
//! flags, parsed from `dig +noall +comments +answer +authority`.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

/// The endpoints service flags that serve `clusterset.local` on `addr` with a 1 s TTL, so a
/// test's resolver never holds an answer for long.
pub fn serving_flags(addr: SocketAddr) -> Vec<String> {
    vec![
        "--dns-listen".into(),
        addr.to_string(),
        "--dns-ttl".into(),
        "1".into(),
    ]
}

/// One answer as `dig` printed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dig {
    /// The response code (`NOERROR`, `NXDOMAIN`, ...; `NO ANSWER` when none came).
    pub status: String,
    /// The answer section's record data, sorted (`10.0.0.7`, `0 100 8080 target.`).
    pub answers: Vec<String>,
    /// The authority section's record types (the SOA of a negative answer).
    pub authority: Vec<String>,
    /// The header's flags (`qr aa`, `qr aa tc` when truncated).
    pub flags: String,
}

/// How `dig` asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Over {
    /// UDP, again over TCP when the answer is truncated (what resolvers do).
    Udp,
    Tcp,
    /// UDP only, a truncated answer kept as it is.
    UdpOnly,
}

/// Asks `server` for `name` `qtype` with the `dig` at `dig`, from network namespace `netns`
/// when given (`ip netns exec`).
pub fn dig(
    dig: &Path,
    netns: Option<&str>,
    server: SocketAddr,
    name: &str,
    qtype: &str,
    over: Over,
) -> Dig {
    let mut command = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(dig);
            c
        }
        None => Command::new(dig),
    };
    command.args([
        &format!("@{}", server.ip()),
        "-p",
        &server.port().to_string(),
        "+tries=1",
        "+time=2",
        "+noall",
        "+comments",
        "+answer",
        "+authority",
        name,
        qtype,
    ]);
    match over {
        Over::Udp => {}
        Over::Tcp => {
            command.arg("+tcp");
        }
        Over::UdpOnly => {
            command.arg("+ignore");
        }
    }
    let output = command.output().expect("dig runs");
    parse(&String::from_utf8_lossy(&output.stdout))
}

fn header_field(text: &str, field: &str, end: char) -> Option<String> {
    text.lines()
        .find_map(|l| l.split(field).nth(1))
        .and_then(|rest| rest.split(end).next())
        .map(str::to_owned)
}

fn parse(text: &str) -> Dig {
    let mut answers = Vec::new();
    let mut authority = Vec::new();
    let mut section = "";
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix(";; ") {
            section = rest.split(' ').next().unwrap_or("");
            continue;
        }
        if line.is_empty() || line.starts_with(';') {
            continue;
        }
        // name ttl class type rdata...
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 5 {
            continue;
        }
        match section {
            "ANSWER" => answers.push(fields[4..].join(" ")),
            "AUTHORITY" => authority.push(fields[3].to_owned()),
            _ => {}
        }
    }
    answers.sort();
    Dig {
        status: header_field(text, "status: ", ',').unwrap_or_else(|| "NO ANSWER".to_owned()),
        answers,
        authority,
        flags: header_field(text, "flags: ", ';').unwrap_or_default(),
    }
}
