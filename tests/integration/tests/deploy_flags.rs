//! The deployment files only configure what the binaries accept.
//!
//! `docker-compose.yml` and every kustomize overlay (rendered with `kubectl kustomize`) are read,
//! and every container that runs a Trellis binary is compared with that binary's real `--help`:
//! each `--flag` in its arguments and each `TRELLIS_*` variable in its environment (including the
//! ConfigMaps it pulls in with `envFrom`) must be a flag of that binary, no other variable may be
//! set on it except the runtime's `OTEL_*` and `RUST_LOG`, its required flags must all be given,
//! and the values must pass the binary's own argument parser (`<binary> <flags> --help` exits 2
//! on a bad value). The peering scripts' `trellisctl` calls are checked the same way (flags,
//! subcommands, `TRELLIS_*` variables).
//!
//! Beyond flags, the wiring: an address of a local service (`TRELLIS_IPAM`, `TRELLIS_ADVERTISE_*`,
//! ...) must name a service of the same cluster running that binary on the port it listens on
//! (for the `TRELLIS_ADVERTISE_*` addresses other clusters use: its `--peer-listen` port, when it
//! has one);
//! every service has its own etcd; every cluster runs the six binaries; probes hit the gRPC
//! port. The node path (ADR 0016): every overlay runs `trellis-route` as a DaemonSet on the host
//! network with NET_ADMIN and without `privileged`, its node name and IP from the downward API;
//! a gateway on the host network is pinned to a labelled node by a nodeSelector and learns its
//! node the same way (a gateway in its own pod network needs a LoadBalancer publishing exactly
//! its WireGuard port range).
//!
//! Needs the binaries (`cargo build --workspace --bins`, which `make test` runs first), a Python
//! with PyYAML (scripts/setup.sh's `.tools/venv`, to read YAML) and `kubectl` (for the overlays).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};
use serde_json::Value;
use trellis_testkit::{in_ci, require_tool, workspace_root};

/// The six services: binary, default port, gRPC service (whose health the readiness probe asks).
const SERVICES: [(&str, u16, &str); 6] = [
    ("trellis-discovery", 7101, "trellis.discovery.v1.Discovery"),
    ("trellis-broker", 7102, "trellis.peering.v1.Broker"),
    ("trellis-forwarder", 7103, "trellis.peering.v1.Forwarder"),
    ("trellis-ipam", 7104, "trellis.ipam.v1.Ipam"),
    (
        "trellis-endpoints",
        7105,
        "trellis.endpoints.v1.EndpointMapper",
    ),
    ("trellis-gateway", 7106, "trellis.gateway.v1.Gateway"),
];

/// The node agents (a DaemonSet each, one per node, not one per cluster): binary, default port,
/// gRPC service.
const AGENTS: [(&str, u16, &str); 1] = [("trellis-route", 7107, "trellis.route.v1.Route")];

/// The operator CLI the peering scripts run.
const CTL: &str = "trellisctl";

/// Variables a service reads that are not flags (the runtime's telemetry and log filter).
fn is_runtime_variable(name: &str) -> bool {
    name.starts_with("OTEL_") || name == "RUST_LOG" || name == "RUST_BACKTRACE"
}

fn default_port(binary: &str) -> Option<u16> {
    SERVICES
        .iter()
        .chain(&AGENTS)
        .find(|(b, _, _)| *b == binary)
        .map(|(_, port, _)| *port)
}

fn grpc_service(binary: &str) -> Option<&'static str> {
    SERVICES
        .iter()
        .chain(&AGENTS)
        .find(|(b, _, _)| *b == binary)
        .map(|(_, _, service)| *service)
}

/// The binary an address variable points at: `TRELLIS_IPAM` and `TRELLIS_ADVERTISE_IPAM` ->
/// `trellis-ipam`. `None` for variables that are not service addresses.
fn address_target(variable: &str) -> Option<String> {
    let service = variable
        .strip_prefix("TRELLIS_ADVERTISE_")
        .or_else(|| variable.strip_prefix("TRELLIS_"))?
        .to_ascii_lowercase();
    let binary = format!("trellis-{service}");
    default_port(&binary).map(|_| binary)
}

// --- what a binary accepts ---------------------------------------------------------------------

/// A command line as its `--help` describes it.
#[derive(Debug, Default)]
struct Cli {
    /// Long and short flags: `--store`, `-h`.
    flags: BTreeSet<String>,
    /// The flags that take a value (`--store <URL>`), as opposed to switches (`--mdns`).
    takes_value: BTreeSet<String>,
    /// `TRELLIS_STORE` -> `--store`.
    env: BTreeMap<String, String>,
    /// Flags the usage line lists, i.e. required ones.
    required: Vec<String>,
    /// Subcommands (`token`, `peer`, ...), for trellisctl.
    subcommands: BTreeSet<String>,
}

impl Cli {
    /// Reads clap's help output.
    fn parse(help: &str) -> Self {
        let mut cli = Cli::default();
        let mut section = "";
        let mut in_usage = false;
        let mut current: Option<String> = None;
        for line in help.lines() {
            let trimmed = line.trim();
            let indent = line.len() - line.trim_start().len();
            if let Some(usage) = trimmed.strip_prefix("Usage:") {
                in_usage = true;
                cli.add_required(usage);
                continue;
            }
            if in_usage {
                if trimmed.is_empty() {
                    in_usage = false;
                } else {
                    cli.add_required(trimmed);
                }
                continue;
            }
            if indent == 0 && trimmed.ends_with(':') {
                section = trimmed;
                current = None;
                continue;
            }
            if (1..=6).contains(&indent) {
                // An entry's first line: the signature, then (short help) two spaces and text.
                let signature = trimmed.split("  ").next().unwrap_or_default();
                if section == "Commands:" {
                    if let Some(name) = signature.split_whitespace().next() {
                        cli.subcommands.insert(name.to_owned());
                    }
                } else if trimmed.starts_with('-') {
                    current = None;
                    for word in signature.split([' ', ',']).filter(|w| !w.is_empty()) {
                        if word.starts_with('-') {
                            let flag = word.split('=').next().unwrap_or(word).to_owned();
                            cli.flags.insert(flag.clone());
                            if flag.starts_with("--") {
                                current = Some(flag);
                            }
                        } else if word.starts_with('<')
                            && let Some(flag) = &current
                        {
                            cli.takes_value.insert(flag.clone());
                        }
                    }
                }
            }
            let mut rest = line;
            while let Some(at) = rest.find("[env: ") {
                rest = &rest[at + "[env: ".len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                if let Some(flag) = &current {
                    cli.env.insert(name, flag.clone());
                }
            }
        }
        cli
    }

    fn add_required(&mut self, usage: &str) {
        self.required.extend(
            usage
                .split_whitespace()
                .filter(|w| w.starts_with("--"))
                .map(str::to_owned),
        );
    }
}

/// The `--help` of every binary (and trellisctl subcommand) the files use, read once.
#[derive(Default)]
struct Clis {
    known: BTreeMap<(String, Vec<String>), Cli>,
}

impl Clis {
    fn get(&mut self, binary: &str, subcommand: &[String]) -> anyhow::Result<&Cli> {
        let key = (binary.to_owned(), subcommand.to_vec());
        if !self.known.contains_key(&key) {
            let mut args = subcommand.to_vec();
            args.push("--help".to_owned());
            let output = run_binary(binary, &args)?;
            if !output.status.success() {
                bail!(
                    "`{binary} {}` failed ({}): {}",
                    args.join(" "),
                    output.status,
                    String::from_utf8_lossy(&output.stderr)
                );
            }
            let cli = Cli::parse(&String::from_utf8(output.stdout)?);
            if cli.flags.is_empty() {
                bail!("`{binary} {}` lists no flags", args.join(" "));
            }
            self.known.insert(key.clone(), cli);
        }
        Ok(&self.known[&key])
    }
}

/// Runs a workspace binary with `args` and an empty environment (so that no `TRELLIS_*`
/// variable of the test's own environment leaks into it).
fn run_binary(binary: &str, args: &[String]) -> anyhow::Result<std::process::Output> {
    let path = trellis_integration::bin_path(binary)?;
    Command::new(&path)
        .args(args)
        .env_clear()
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", path.display()))
}

// --- one container's command line --------------------------------------------------------------

/// A container that runs a Trellis binary.
#[derive(Debug)]
struct Launch {
    /// Where it is defined, for messages.
    origin: String,
    binary: String,
    args: Vec<String>,
    /// Environment: name -> value (`None` when not known statically: secrets, field refs).
    env: BTreeMap<String, Option<String>>,
}

impl Launch {
    fn arg_flags(&self) -> BTreeSet<String> {
        self.args
            .iter()
            .filter(|a| a.starts_with('-'))
            .map(|a| a.split('=').next().unwrap_or(a).to_owned())
            .collect()
    }

    /// A flag's value, from the arguments (`--x v`, `--x=v`) or else its variable.
    fn value(&self, cli: &Cli, flag: &str) -> Option<String> {
        let mut args = self.args.iter();
        while let Some(arg) = args.next() {
            if arg == flag {
                return args.next().cloned();
            }
            if let Some(value) = arg.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
                return Some(value.to_owned());
            }
        }
        cli.env
            .iter()
            .filter(|(_, f)| *f == flag)
            .find_map(|(name, _)| self.env.get(name).cloned().flatten())
    }
}

/// Checks one launch against its binary: flags, variables, required flags, values.
fn check_launch(launch: &Launch, clis: &mut Clis, problems: &mut Vec<String>) {
    let origin = &launch.origin;
    let binary = &launch.binary;
    let cli = match clis.get(binary, &[]) {
        Ok(cli) => cli,
        Err(err) => {
            problems.push(format!("{origin}: {err:#}"));
            return;
        }
    };
    let arg_flags = launch.arg_flags();
    for flag in &arg_flags {
        if !cli.flags.contains(flag) {
            problems.push(format!("{origin}: {binary} has no flag {flag}"));
        }
    }
    for name in launch.env.keys() {
        if name.starts_with("TRELLIS_") {
            if !cli.env.contains_key(name) {
                problems.push(format!(
                    "{origin}: {name} is not read by {binary} (no flag of it has that variable)"
                ));
            }
        } else if !is_runtime_variable(name) {
            problems.push(format!(
                "{origin}: {name} is set on {binary}, which reads only TRELLIS_<FLAG>, OTEL_* and RUST_LOG"
            ));
        }
    }
    for flag in &cli.required {
        let by_env = cli.env.iter().any(|(name, f)| {
            f == flag
                && launch
                    .env
                    .get(name)
                    .is_some_and(|v| v.as_ref().is_none_or(|v| !v.is_empty()))
        });
        if !arg_flags.contains(flag) && !by_env {
            problems.push(format!(
                "{origin}: {binary} requires {flag}, which is not set"
            ));
        }
    }
    // The values, through the binary's own parser: flags before `--help` are parsed (and a bad
    // value is exit code 2) before the help is printed.
    let mut argv = launch.args.clone();
    for (name, value) in &launch.env {
        let (Some(flag), Some(value)) = (cli.env.get(name), value) else {
            continue;
        };
        if value.is_empty() || arg_flags.contains(flag) {
            continue;
        }
        if cli.takes_value.contains(flag) {
            argv.push(format!("{flag}={value}"));
        } else {
            match value.to_ascii_lowercase().as_str() {
                "true" | "1" | "yes" | "on" => argv.push(flag.clone()),
                "false" | "0" | "no" | "off" => {}
                _ => problems.push(format!("{origin}: {name}={value:?} is not a boolean")),
            }
        }
    }
    argv.push("--help".to_owned());
    match run_binary(binary, &argv) {
        Ok(output) if output.status.success() => {}
        Ok(output) => problems.push(format!(
            "{origin}: {binary} refuses its configuration: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )),
        Err(err) => problems.push(format!("{origin}: {err:#}")),
    }
}

/// Checks the `trellisctl` calls of a shell script: subcommands and flags, and that every
/// `TRELLIS_*` variable the script's container or the script itself (`export TRELLIS_X=...`,
/// `TRELLIS_X=... trellisctl`) sets is read by one of the calls. Returns how many calls it
/// checked.
fn check_script(
    origin: &str,
    script: &str,
    env: &BTreeMap<String, Option<String>>,
    clis: &mut Clis,
    problems: &mut Vec<String>,
) -> usize {
    let mut calls = 0;
    // Every TRELLIS_* variable set for the calls, and whether one of them reads it.
    let mut variables: BTreeMap<String, bool> = env
        .keys()
        .filter(|name| name.starts_with("TRELLIS_"))
        .map(|name| (name.clone(), false))
        .collect();
    for word in script.split_whitespace() {
        if let Some((name, _)) = word.split_once('=')
            && name.starts_with("TRELLIS_")
        {
            variables.insert(name.to_owned(), false);
        }
    }
    let top = match clis.get(CTL, &[]) {
        Ok(cli) => cli.subcommands.clone(),
        Err(err) => {
            problems.push(format!("{origin}: {err:#}"));
            return 0;
        }
    };
    for line in script.lines() {
        // Words without shell punctuation around them: `$(trellisctl ... token);` has the
        // words `trellisctl` and `token`.
        let words: Vec<&str> = line
            .split_whitespace()
            .map(|w| {
                let w = w.rsplit(['(', '`', '/']).next().unwrap_or(w);
                w.trim_end_matches([')', ';', '`', '&', '|'])
            })
            .collect();
        let Some(at) = words.iter().position(|w| *w == CTL) else {
            continue;
        };
        calls += 1;
        let after = &words[at + 1..];
        let Some(subcommand) = after.iter().find(|w| top.contains(**w)) else {
            problems.push(format!(
                "{origin}: `{}` names no {CTL} subcommand ({})",
                line.trim(),
                top.iter().cloned().collect::<Vec<_>>().join(", ")
            ));
            continue;
        };
        let cli = match clis.get(CTL, &[(*subcommand).to_owned()]) {
            Ok(cli) => cli,
            Err(err) => {
                problems.push(format!("{origin}: {err:#}"));
                continue;
            }
        };
        for flag in after.iter().filter(|w| w.starts_with('-')) {
            let flag = flag.split('=').next().unwrap_or(flag);
            if !cli.flags.contains(flag) {
                problems.push(format!("{origin}: `{CTL} {subcommand}` has no flag {flag}"));
            }
        }
        for (name, read) in &mut variables {
            *read |= cli.env.contains_key(name);
        }
    }
    for (name, read) in variables {
        if !read {
            problems.push(format!(
                "{origin}: {name} is set but no {CTL} call of the script reads it"
            ));
        }
    }
    calls
}

// --- reading YAML ------------------------------------------------------------------------------

/// A Python that can `import yaml` (scripts/setup.sh's venv has PyYAML, which
/// kubernetes-validate needs), or `None` after a loud skip outside CI.
fn yaml_python() -> Option<PathBuf> {
    let venv = workspace_root().join(".tools/venv/bin/python");
    let candidates = [Some(venv), trellis_testkit::tool_path("python3")];
    for python in candidates.into_iter().flatten() {
        let ok = Command::new(&python)
            .args(["-c", "import yaml"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Some(python);
        }
    }
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("<unnamed test>");
    assert!(
        !in_ci(),
        "no Python with PyYAML (test {test}); scripts/setup.sh installs one in .tools/venv"
    );
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED: {test}: no Python with PyYAML in .tools/venv or on PATH (scripts/setup.sh installs it)"
    );
    None
}

/// The documents of a YAML stream, as JSON values (merge keys `<<` resolved).
fn yaml_documents(python: &Path, yaml: &[u8]) -> anyhow::Result<Vec<Value>> {
    let mut child = Command::new(python)
        .args([
            "-c",
            "import json, sys, yaml\n\
             json.dump([d for d in yaml.safe_load_all(sys.stdin) if d is not None], sys.stdout)",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting python")?;
    child
        .stdin
        .take()
        .context("python stdin")?
        .write_all(yaml)?;
    let output = child.wait_with_output()?;
    if !output.status.success() {
        bail!(
            "python could not read the YAML: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(serde_json::from_slice(&output.stdout)?)
}

fn scalar(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

fn strings(value: Option<&Value>) -> Vec<String> {
    match value {
        Some(Value::Array(items)) => items.iter().filter_map(scalar).collect(),
        Some(Value::String(s)) => s.split_whitespace().map(str::to_owned).collect(),
        _ => Vec::new(),
    }
}

/// What a container's command line is.
enum Argv {
    /// A Trellis binary with its arguments.
    Binary(String, Vec<String>),
    /// `sh -c SCRIPT`.
    Script(String),
    /// Something else (etcd, Jaeger).
    Other,
}

fn classify(argv: &[String]) -> Argv {
    let Some(first) = argv.first() else {
        return Argv::Other;
    };
    let name = first.rsplit('/').next().unwrap_or(first);
    if default_port(name).is_some() || name == CTL {
        return Argv::Binary(name.to_owned(), argv[1..].to_vec());
    }
    if matches!(name, "sh" | "bash") && argv.get(1).is_some_and(|a| a == "-c") {
        return Argv::Script(argv.get(2).cloned().unwrap_or_default());
    }
    Argv::Other
}

/// `host:port` -> (host, port).
fn host_port(address: &str) -> Option<(&str, u16)> {
    let (host, port) = address.rsplit_once(':')?;
    Some((host, port.parse().ok()?))
}

/// The `host:port`s of an `etcd://h1:p1,h2:p2/prefix` (or `etcds://`) store URL.
fn etcd_endpoints(url: &str) -> Option<Vec<String>> {
    let rest = url
        .strip_prefix("etcds://")
        .or_else(|| url.strip_prefix("etcd://"))?;
    let hosts = rest.split('/').next().unwrap_or_default();
    Some(hosts.split(',').map(str::to_owned).collect())
}

/// The port an address variable must reach on `launch`: an address given to other clusters
/// (`TRELLIS_ADVERTISE_*`) is the mutual-TLS `--peer-listen` port when the service has one
/// (ADR 0014); any other address its `--listen` port.
fn reached_port(variable: &str, launch: &Launch, clis: &mut Clis) -> Option<u16> {
    if variable.starts_with("TRELLIS_ADVERTISE_")
        && let Ok(cli) = clis.get(&launch.binary, &[])
        && let Some(peer) = launch.value(cli, "--peer-listen")
    {
        return host_port(&peer).map(|(_, port)| port);
    }
    listen_port(launch, clis)
}

/// The port a launched service listens on.
fn listen_port(launch: &Launch, clis: &mut Clis) -> Option<u16> {
    let cli = clis.get(&launch.binary, &[]).ok()?;
    match launch.value(cli, "--listen") {
        Some(listen) => host_port(&listen).map(|(_, port)| port),
        None => default_port(&launch.binary),
    }
}

fn report(what: &str, checked: &[String], problems: &[String]) {
    assert!(
        problems.is_empty(),
        "{what}: {} problem(s):\n  - {}",
        problems.len(),
        problems.join("\n  - ")
    );
    eprintln!("{what}: checked {}", checked.join(", "));
}

// --- docker-compose.yml ------------------------------------------------------------------------

#[test]
fn compose_services_use_only_flags_their_binaries_accept() -> anyhow::Result<()> {
    let Some(python) = yaml_python() else {
        return Ok(());
    };
    let path = workspace_root().join("docker-compose.yml");
    let compose = yaml_documents(&python, &std::fs::read(&path)?)?
        .into_iter()
        .next()
        .context("docker-compose.yml is empty")?;
    let services = compose
        .get("services")
        .and_then(Value::as_object)
        .context("docker-compose.yml has no services")?;

    let mut clis = Clis::default();
    let mut problems = Vec::new();
    let mut launches = Vec::new();
    let mut scripts = 0;
    for (name, service) in services {
        let origin = format!("docker-compose.yml services.{name}");
        let mut argv = strings(service.get("entrypoint"));
        argv.extend(strings(service.get("command")));
        let env = compose_environment(service.get("environment"));
        let image = service.get("image").and_then(Value::as_str).unwrap_or("");
        match classify(&argv) {
            Argv::Binary(binary, args) => launches.push((
                name.clone(),
                Launch {
                    origin,
                    binary,
                    args,
                    env,
                },
            )),
            Argv::Script(script) => {
                scripts += check_script(&origin, &script, &env, &mut clis, &mut problems);
            }
            Argv::Other if image.starts_with("trellis") => problems.push(format!(
                "{origin}: runs the Trellis image without naming a binary (command: {argv:?})"
            )),
            Argv::Other => {}
        }
    }
    for (_, launch) in &launches {
        check_launch(launch, &mut clis, &mut problems);
    }
    check_compose_wiring(services, &launches, &mut clis, &mut problems);
    if scripts == 0 {
        problems.push(format!("no service runs {CTL} (the peering job)"));
    }
    report(
        "docker-compose.yml",
        &[
            format!("{} service containers", launches.len()),
            format!("{scripts} {CTL} calls"),
        ],
        &problems,
    );
    Ok(())
}

/// A compose `environment`, as a map or as a `NAME=value` list.
fn compose_environment(value: Option<&Value>) -> BTreeMap<String, Option<String>> {
    match value {
        Some(Value::Object(map)) => map.iter().map(|(k, v)| (k.clone(), scalar(v))).collect(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_str)
            .map(|item| match item.split_once('=') {
                Some((k, v)) => (k.to_owned(), Some(v.to_owned())),
                None => (item.to_owned(), None),
            })
            .collect(),
        _ => BTreeMap::new(),
    }
}

/// Addresses name services of the same cluster on their ports; one etcd per service; every
/// cluster runs the six binaries; traces go to a service of the file.
fn check_compose_wiring(
    services: &serde_json::Map<String, Value>,
    launches: &[(String, Launch)],
    clis: &mut Clis,
    problems: &mut Vec<String>,
) {
    let cluster_of = |launch: &Launch| {
        launch
            .env
            .get("TRELLIS_CLUSTER_ID")
            .cloned()
            .flatten()
            .unwrap_or_default()
    };
    let by_name: BTreeMap<&str, &Launch> = launches
        .iter()
        .map(|(name, launch)| (name.as_str(), launch))
        .collect();
    let mut per_cluster: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    let mut etcd_users: BTreeMap<String, &str> = BTreeMap::new();
    for (_, launch) in launches.iter().filter(|(_, l)| l.binary != CTL) {
        let origin = &launch.origin;
        let cluster = cluster_of(launch);
        per_cluster
            .entry(cluster.clone())
            .or_default()
            .push(&launch.binary);
        for (variable, value) in &launch.env {
            let Some(value) = value else { continue };
            if let Some(target) = address_target(variable) {
                let Some((host, port)) = host_port(value) else {
                    problems.push(format!("{origin}: {variable}={value} is not host:port"));
                    continue;
                };
                match by_name.get(host) {
                    None => problems.push(format!(
                        "{origin}: {variable}={value}: no service {host} runs a Trellis binary"
                    )),
                    Some(other) if other.binary != target => problems.push(format!(
                        "{origin}: {variable}={value}: {host} runs {}, not {target}",
                        other.binary
                    )),
                    Some(other) if cluster_of(other) != cluster => problems.push(format!(
                        "{origin}: {variable}={value}: {host} belongs to cluster {:?}, not {cluster:?}",
                        cluster_of(other)
                    )),
                    Some(other) => {
                        let listens = reached_port(variable, other, clis);
                        if listens != Some(port) {
                            problems.push(format!(
                                "{origin}: {variable}={value}: {host} listens on {listens:?}"
                            ));
                        }
                    }
                }
            } else if variable == "TRELLIS_STORE" {
                match etcd_endpoints(value) {
                    Some(endpoints) => {
                        for endpoint in endpoints {
                            let host = host_port(&endpoint).map(|(h, _)| h).unwrap_or_default();
                            if !services.contains_key(host) {
                                problems.push(format!(
                                    "{origin}: TRELLIS_STORE names {endpoint}, not a service of the file"
                                ));
                            }
                            if let Some(user) = etcd_users.insert(endpoint.clone(), origin) {
                                problems.push(format!(
                                    "{origin}: shares etcd {endpoint} with {user} (one etcd per service)"
                                ));
                            }
                        }
                    }
                    None => problems.push(format!(
                        "{origin}: TRELLIS_STORE={value} is not an etcd:// or etcds:// URL"
                    )),
                }
            } else if variable == "OTEL_EXPORTER_OTLP_ENDPOINT" && !value.is_empty() {
                let host = value
                    .split("://")
                    .nth(1)
                    .and_then(|rest| rest.split([':', '/']).next())
                    .unwrap_or_default();
                if !services.contains_key(host) {
                    problems.push(format!(
                        "{origin}: {variable}={value} is not a service of the file"
                    ));
                }
            }
        }
    }
    check_six_per_cluster(
        "docker-compose.yml",
        per_cluster
            .into_iter()
            .map(|(c, b)| (c, b.into_iter().map(str::to_owned).collect())),
        problems,
    );
}

/// Every cluster runs each of the six binaries exactly once.
fn check_six_per_cluster(
    what: &str,
    clusters: impl Iterator<Item = (String, Vec<String>)>,
    problems: &mut Vec<String>,
) {
    let mut any = false;
    for (cluster, mut binaries) in clusters {
        any = true;
        // The node agents run per node, beside the six.
        binaries.retain(|b| !AGENTS.iter().any(|(agent, _, _)| agent == b));
        binaries.sort();
        let mut want: Vec<String> = SERVICES.iter().map(|(b, _, _)| (*b).to_owned()).collect();
        want.sort();
        if binaries != want {
            problems.push(format!(
                "{what}: cluster {cluster:?} runs {binaries:?}, want each of {want:?} once"
            ));
        }
    }
    if !any {
        problems.push(format!("{what}: no cluster runs a Trellis service"));
    }
}

// --- kustomize overlays ------------------------------------------------------------------------

#[test]
fn kustomize_overlays_use_only_flags_their_binaries_accept() -> anyhow::Result<()> {
    let Some(python) = yaml_python() else {
        return Ok(());
    };
    let Some(kubectl) = require_tool("kubectl") else {
        return Ok(());
    };
    let overlays_dir = workspace_root().join("deploy/kustomize/overlays");
    let mut overlays: Vec<PathBuf> = std::fs::read_dir(&overlays_dir)
        .with_context(|| format!("reading {}", overlays_dir.display()))?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    overlays.retain(|p| p.join("kustomization.yaml").exists());
    overlays.sort();
    assert!(
        !overlays.is_empty(),
        "no overlays in {}",
        overlays_dir.display()
    );

    let mut clis = Clis::default();
    let mut problems = Vec::new();
    let mut checked = Vec::new();
    for overlay in &overlays {
        let name = overlay
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_owned();
        let output = Command::new(&kubectl)
            .arg("kustomize")
            .arg(overlay)
            .output()
            .context("running kubectl kustomize")?;
        if !output.status.success() {
            problems.push(format!(
                "overlays/{name}: kubectl kustomize failed: {}",
                String::from_utf8_lossy(&output.stderr)
            ));
            continue;
        }
        let rendered = Rendered::new(yaml_documents(&python, &output.stdout)?);
        let (launches, scripts) = rendered.check(&name, &mut clis, &mut problems);
        checked.push(format!(
            "overlays/{name} ({launches} service containers, {scripts} {CTL} calls)"
        ));
    }
    report("kustomize", &checked, &problems);
    Ok(())
}

/// One rendered overlay.
struct Rendered {
    objects: Vec<Value>,
}

/// A workload's pod template with where it comes from.
struct Pod<'a> {
    origin: String,
    labels: BTreeMap<String, String>,
    spec: &'a Value,
}

impl Rendered {
    fn new(objects: Vec<Value>) -> Self {
        Self { objects }
    }

    fn of_kind(&self, kind: &str) -> impl Iterator<Item = &Value> + '_ {
        let kind = kind.to_owned();
        self.objects
            .iter()
            .filter(move |o| o.get("kind").and_then(Value::as_str) == Some(kind.as_str()))
    }

    fn named(&self, kind: &str, name: &str) -> Option<&Value> {
        self.of_kind(kind)
            .find(|o| o.pointer("/metadata/name").and_then(Value::as_str) == Some(name))
    }

    fn namespace(&self) -> String {
        self.objects
            .iter()
            .find_map(|o| o.pointer("/metadata/namespace").and_then(Value::as_str))
            .unwrap_or("default")
            .to_owned()
    }

    /// The pod templates of every workload.
    fn pods(&self) -> Vec<Pod<'_>> {
        let mut pods = Vec::new();
        for object in &self.objects {
            let kind = object.get("kind").and_then(Value::as_str).unwrap_or("");
            let template = match kind {
                "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "Job" => {
                    object.pointer("/spec/template")
                }
                "CronJob" => object.pointer("/spec/jobTemplate/spec/template"),
                "Pod" => Some(object),
                _ => None,
            };
            let Some(template) = template else { continue };
            let Some(spec) = template.get("spec") else {
                continue;
            };
            let name = object
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or("?");
            let labels = template
                .pointer("/metadata/labels")
                .and_then(Value::as_object)
                .map(|m| {
                    m.iter()
                        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                        .collect()
                })
                .unwrap_or_default();
            pods.push(Pod {
                origin: format!("{kind}/{name}"),
                labels,
                spec,
            });
        }
        pods
    }

    /// A ConfigMap's (or Secret's string) data.
    fn data(&self, kind: &str, name: &str) -> Option<BTreeMap<String, Option<String>>> {
        let object = self.named(kind, name)?;
        let mut data = BTreeMap::new();
        for field in ["data", "stringData", "binaryData"] {
            if let Some(map) = object.get(field).and_then(Value::as_object) {
                for (key, value) in map {
                    let known = (kind == "ConfigMap" || field == "stringData")
                        .then(|| scalar(value))
                        .flatten();
                    data.insert(key.clone(), known);
                }
            }
        }
        Some(data)
    }

    /// A container's environment: `env` (values, ConfigMap keys) and `envFrom`.
    fn environment(
        &self,
        origin: &str,
        container: &Value,
        problems: &mut Vec<String>,
    ) -> BTreeMap<String, Option<String>> {
        let mut env = BTreeMap::new();
        for source in container
            .get("envFrom")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let prefix = source.get("prefix").and_then(Value::as_str).unwrap_or("");
            for (field, kind) in [("configMapRef", "ConfigMap"), ("secretRef", "Secret")] {
                let Some(reference) = source.get(field) else {
                    continue;
                };
                let name = reference.get("name").and_then(Value::as_str).unwrap_or("");
                match self.data(kind, name) {
                    Some(data) => env.extend(data.into_iter().map(|(k, v)| (format!("{prefix}{k}"), v))),
                    None => problems.push(format!(
                        "{origin}: envFrom {kind} {name:?} is not in the overlay, so its variables cannot be checked"
                    )),
                }
            }
        }
        for var in container
            .get("env")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let Some(name) = var.get("name").and_then(Value::as_str) else {
                continue;
            };
            let value = match var.get("value") {
                Some(value) => scalar(value),
                None => var.pointer("/valueFrom/configMapKeyRef").and_then(|r| {
                    let cm = self.data("ConfigMap", r.get("name")?.as_str()?)?;
                    cm.get(r.get("key")?.as_str()?).cloned().flatten()
                }),
            };
            env.insert(name.to_owned(), value);
        }
        env
    }

    /// A Service named by an in-cluster address host of this overlay: `svc`, `svc.ns`,
    /// `svc.ns.svc`, `svc.ns.svc.cluster.local`. `None` for hosts outside the overlay.
    fn service_for_host(&self, host: &str) -> Option<&Value> {
        let namespace = self.namespace();
        let mut parts = host.trim_end_matches('.').splitn(2, '.');
        let name = parts.next()?;
        match parts.next() {
            None => {}
            Some(rest)
                if rest == namespace
                    || rest == format!("{namespace}.svc")
                    || rest == format!("{namespace}.svc.cluster.local") => {}
            Some(_) => return None,
        }
        self.named("Service", name)
    }

    /// Checks every container running a Trellis binary or a trellisctl script. Returns the
    /// number of service containers and of trellisctl calls checked.
    fn check(&self, overlay: &str, clis: &mut Clis, problems: &mut Vec<String>) -> (usize, usize) {
        let pods = self.pods();
        let mut launches: Vec<(Launch, &Pod<'_>, &Value)> = Vec::new();
        let mut scripts = 0;
        for pod in &pods {
            let containers = ["initContainers", "containers"]
                .iter()
                .filter_map(|field| pod.spec.get(*field).and_then(Value::as_array))
                .flatten();
            for container in containers {
                let cname = container.get("name").and_then(Value::as_str).unwrap_or("?");
                let origin = format!("overlays/{overlay} {} container {cname}", pod.origin);
                let mut argv = strings(container.get("command"));
                argv.extend(strings(container.get("args")));
                let env = self.environment(&origin, container, problems);
                let image = container.get("image").and_then(Value::as_str).unwrap_or("");
                match classify(&argv) {
                    Argv::Binary(binary, args) => launches.push((
                        Launch {
                            origin,
                            binary,
                            args,
                            env,
                        },
                        pod,
                        container,
                    )),
                    Argv::Script(script) => {
                        scripts += check_script(&origin, &script, &env, clis, problems);
                    }
                    Argv::Other if image.starts_with("trellis") => problems.push(format!(
                        "{origin}: runs the Trellis image without naming a binary (command: {argv:?})"
                    )),
                    Argv::Other => {}
                }
            }
        }
        for (launch, _, _) in &launches {
            check_launch(launch, clis, problems);
        }

        let services: Vec<&(Launch, &Pod<'_>, &Value)> = launches
            .iter()
            .filter(|(l, _, _)| l.binary != CTL)
            .collect();
        let mut clusters: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut etcd_users: BTreeMap<String, String> = BTreeMap::new();
        for (launch, pod, container) in &services {
            let origin = &launch.origin;
            let cluster = launch
                .env
                .get("TRELLIS_CLUSTER_ID")
                .cloned()
                .flatten()
                .unwrap_or_default();
            clusters
                .entry(cluster)
                .or_default()
                .push(launch.binary.clone());
            let port = listen_port(launch, clis);
            self.check_probes(origin, &launch.binary, port, container, problems);
            for (variable, value) in &launch.env {
                let Some(value) = value else { continue };
                if let Some(target) = address_target(variable) {
                    self.check_address(origin, variable, value, &target, &services, clis, problems);
                } else if variable == "TRELLIS_STORE" {
                    self.check_store(origin, value, &mut etcd_users, problems);
                }
            }
            if launch.binary == "trellis-gateway" {
                if host_network(pod.spec) {
                    check_gateway_on_node(origin, pod.spec, container, problems);
                } else {
                    self.check_wireguard_service(launch, pod, clis, problems);
                }
            }
            if launch.binary == "trellis-route" {
                let kind = pod.origin.split('/').next().unwrap_or_default();
                check_route_agent(origin, kind, pod.spec, container, problems);
            }
        }
        if !services.iter().any(|(l, _, _)| l.binary == "trellis-route") {
            problems.push(format!(
                "overlays/{overlay}: no trellis-route: pods on nodes other than the gateway's cannot reach remote clusters"
            ));
        }
        if clusters.len() > 1 {
            problems.push(format!(
                "overlays/{overlay}: services disagree on TRELLIS_CLUSTER_ID: {:?}",
                clusters.keys().collect::<Vec<_>>()
            ));
        }
        check_six_per_cluster(
            &format!("overlays/{overlay}"),
            clusters.into_iter(),
            problems,
        );
        (services.len(), scripts)
    }

    /// gRPC probes ask the port the service listens on, readiness its own gRPC service.
    fn check_probes(
        &self,
        origin: &str,
        binary: &str,
        port: Option<u16>,
        container: &Value,
        problems: &mut Vec<String>,
    ) {
        let mut any = false;
        for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
            let Some(grpc) = container.get(probe).and_then(|p| p.get("grpc")) else {
                continue;
            };
            any = true;
            let probed = grpc.get("port").and_then(Value::as_u64);
            if probed != port.map(u64::from) {
                problems.push(format!(
                    "{origin}: {probe} probes port {probed:?}, the service listens on {port:?}"
                ));
            }
            if let Some(service) = grpc.get("service").and_then(Value::as_str)
                && Some(service) != grpc_service(binary)
            {
                problems.push(format!(
                    "{origin}: {probe} asks health of {service:?}, {binary} serves {:?}",
                    grpc_service(binary)
                ));
            }
        }
        if !any {
            problems.push(format!("{origin}: no gRPC health probe"));
        }
    }

    /// An address variable names a Service of the overlay, on a port that reaches the pods of
    /// the right binary on the port they listen on. External names are not checked.
    #[expect(
        clippy::too_many_arguments,
        reason = "the address and what it must reach"
    )]
    fn check_address(
        &self,
        origin: &str,
        variable: &str,
        value: &str,
        target: &str,
        services: &[&(Launch, &Pod<'_>, &Value)],
        clis: &mut Clis,
        problems: &mut Vec<String>,
    ) {
        let Some((host, port)) = host_port(value) else {
            problems.push(format!("{origin}: {variable}={value} is not host:port"));
            return;
        };
        let Some(service) = self.service_for_host(host) else {
            if !host.contains('.') {
                problems.push(format!(
                    "{origin}: {variable}={value}: no Service {host} in the overlay"
                ));
            }
            return;
        };
        let selector: BTreeMap<String, String> = service
            .pointer("/spec/selector")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                    .collect()
            })
            .unwrap_or_default();
        let selected: Vec<_> = services
            .iter()
            .filter(|(_, pod, _)| {
                !selector.is_empty() && selector.iter().all(|(k, v)| pod.labels.get(k) == Some(v))
            })
            .collect();
        let [(other, _, container)] = selected.as_slice() else {
            problems.push(format!(
                "{origin}: {variable}={value}: Service {host} selects {} Trellis workloads, want the one running {target}",
                selected.len()
            ));
            return;
        };
        if other.binary != target {
            problems.push(format!(
                "{origin}: {variable}={value}: Service {host} selects {}, not {target}",
                other.binary
            ));
            return;
        }
        let Some(service_port) = service
            .pointer("/spec/ports")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .find(|p| p.get("port").and_then(Value::as_u64) == Some(u64::from(port)))
        else {
            problems.push(format!(
                "{origin}: {variable}={value}: Service {host} has no port {port}"
            ));
            return;
        };
        let target_port = match service_port.get("targetPort") {
            None => Some(u64::from(port)),
            Some(Value::Number(n)) => n.as_u64(),
            Some(Value::String(name)) => container
                .get("ports")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .find(|p| p.get("name").and_then(Value::as_str) == Some(name))
                .and_then(|p| p.get("containerPort").and_then(Value::as_u64)),
            Some(_) => None,
        };
        let listens = reached_port(variable, other, clis).map(u64::from);
        if target_port != listens {
            problems.push(format!(
                "{origin}: {variable}={value}: Service {host} port {port} goes to {target_port:?}, {target} listens on {listens:?}"
            ));
        }
    }

    /// The store is this overlay's etcd StatefulSet members (or a Service), used by no other
    /// service.
    fn check_store(
        &self,
        origin: &str,
        value: &str,
        etcd_users: &mut BTreeMap<String, String>,
        problems: &mut Vec<String>,
    ) {
        let Some(endpoints) = etcd_endpoints(value) else {
            problems.push(format!(
                "{origin}: TRELLIS_STORE={value} is not an etcd:// or etcds:// URL"
            ));
            return;
        };
        for endpoint in endpoints {
            let host = host_port(&endpoint).map(|(h, _)| h).unwrap_or_default();
            let resolves = self.service_for_host(host).is_some()
                || host.split_once('.').is_some_and(|(pod, governing)| {
                    self.of_kind("StatefulSet").any(|sts| {
                        let name = sts.pointer("/metadata/name").and_then(Value::as_str);
                        let service = sts.pointer("/spec/serviceName").and_then(Value::as_str);
                        let replicas = sts.pointer("/spec/replicas").and_then(Value::as_u64);
                        let ordinal = name.and_then(|n| {
                            pod.strip_prefix(n)?.strip_prefix('-')?.parse::<u64>().ok()
                        });
                        service == Some(governing)
                            && self.named("Service", governing).is_some()
                            && ordinal.is_some_and(|o| o < replicas.unwrap_or(1))
                    })
                });
            if !resolves {
                problems.push(format!(
                    "{origin}: TRELLIS_STORE names {endpoint}, which is no Service or StatefulSet member of the overlay"
                ));
            }
            if let Some(user) = etcd_users.insert(endpoint.clone(), origin.to_owned()) {
                problems.push(format!(
                    "{origin}: shares etcd {endpoint} with {user} (one etcd per service)"
                ));
            }
        }
    }

    /// The gateway's WireGuard ports are exactly the UDP ports of a LoadBalancer Service that
    /// selects it.
    fn check_wireguard_service(
        &self,
        gateway: &Launch,
        pod: &Pod<'_>,
        clis: &mut Clis,
        problems: &mut Vec<String>,
    ) {
        let origin = &gateway.origin;
        let Ok(cli) = clis.get(&gateway.binary, &[]) else {
            return;
        };
        let Some(range) = gateway.value(cli, "--wireguard-ports") else {
            problems.push(format!(
                "{origin}: set TRELLIS_WIREGUARD_PORTS explicitly, to match the LoadBalancer's ports"
            ));
            return;
        };
        let Some((first, last)) = range.split_once('-').and_then(|(a, b)| {
            Some((a.trim().parse::<u64>().ok()?, b.trim().parse::<u64>().ok()?))
        }) else {
            return; // check_launch reports the bad value
        };
        let want: BTreeSet<u64> = (first..=last).collect();
        let balancers: Vec<BTreeSet<u64>> = self
            .of_kind("Service")
            .filter(|s| s.pointer("/spec/type").and_then(Value::as_str) == Some("LoadBalancer"))
            .filter(|s| {
                let selector = s.pointer("/spec/selector").and_then(Value::as_object);
                selector.is_some_and(|sel| {
                    !sel.is_empty()
                        && sel
                            .iter()
                            .all(|(k, v)| pod.labels.get(k).map(String::as_str) == v.as_str())
                })
            })
            .map(|s| {
                s.pointer("/spec/ports")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter(|p| p.get("protocol").and_then(Value::as_str) == Some("UDP"))
                    .filter_map(|p| p.get("port").and_then(Value::as_u64))
                    .collect()
            })
            .collect();
        if !balancers.contains(&want) {
            problems.push(format!(
                "{origin}: TRELLIS_WIREGUARD_PORTS={range}, but no LoadBalancer Service selecting the gateway publishes exactly those UDP ports (found {balancers:?})"
            ));
        }
    }
}

// --- the node path (ADR 0016) -------------------------------------------------------------------

fn host_network(spec: &Value) -> bool {
    spec.get("hostNetwork").and_then(Value::as_bool) == Some(true)
}

/// The downward-API field a container's variable comes from (`spec.nodeName`, ...).
fn field_ref<'a>(container: &'a Value, variable: &str) -> Option<&'a str> {
    container
        .get("env")
        .and_then(Value::as_array)?
        .iter()
        .find(|v| v.get("name").and_then(Value::as_str) == Some(variable))?
        .pointer("/valueFrom/fieldRef/fieldPath")
        .and_then(Value::as_str)
}

/// Node name and IP from the downward API, and cluster DNS from the host network.
fn check_node_identity(origin: &str, spec: &Value, container: &Value, problems: &mut Vec<String>) {
    for (variable, field) in [
        ("TRELLIS_NODE_NAME", "spec.nodeName"),
        ("TRELLIS_NODE_IP", "status.hostIP"),
    ] {
        if field_ref(container, variable) != Some(field) {
            problems.push(format!(
                "{origin}: {variable} must come from the downward API's {field}"
            ));
        }
    }
    if spec.get("dnsPolicy").and_then(Value::as_str) != Some("ClusterFirstWithHostNet") {
        problems.push(format!(
            "{origin}: on the host network, dnsPolicy must be ClusterFirstWithHostNet to resolve Service names"
        ));
    }
}

/// A gateway on the host network runs on the labelled node (a nodeSelector), knows that node,
/// and resolves Service names.
fn check_gateway_on_node(
    origin: &str,
    spec: &Value,
    container: &Value,
    problems: &mut Vec<String>,
) {
    let selector = spec.get("nodeSelector").and_then(Value::as_object);
    if selector.is_none_or(serde_json::Map::is_empty) {
        problems.push(format!(
            "{origin}: a gateway on the host network needs a nodeSelector naming the gateway node's label"
        ));
    }
    check_node_identity(origin, spec, container, problems);
}

/// The route agent: a DaemonSet on the host network, NET_ADMIN but not privileged, no host PID,
/// its node from the downward API, and its sysctl directory mounted from the host.
fn check_route_agent(
    origin: &str,
    kind: &str,
    spec: &Value,
    container: &Value,
    problems: &mut Vec<String>,
) {
    if kind != "DaemonSet" {
        problems.push(format!(
            "{origin}: trellis-route must run on every node (a DaemonSet), not as a {kind}"
        ));
    }
    if !host_network(spec) {
        problems.push(format!(
            "{origin}: trellis-route programs the node: it needs hostNetwork"
        ));
    }
    if spec.get("hostPID").and_then(Value::as_bool) == Some(true) {
        problems.push(format!("{origin}: trellis-route needs no hostPID"));
    }
    let security = container.get("securityContext");
    let flag = |name: &str| security.and_then(|s| s.get(name)).and_then(Value::as_bool);
    if flag("privileged") == Some(true) {
        problems.push(format!("{origin}: trellis-route must not be privileged"));
    }
    if flag("allowPrivilegeEscalation") != Some(false) {
        problems.push(format!(
            "{origin}: trellis-route must set allowPrivilegeEscalation: false"
        ));
    }
    let caps = |list: &str| -> Vec<&str> {
        security
            .and_then(|s| s.pointer(&format!("/capabilities/{list}")))
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect()
    };
    let added = caps("add");
    if !added.contains(&"NET_ADMIN") {
        problems.push(format!("{origin}: trellis-route needs NET_ADMIN"));
    }
    if let Some(extra) = added.iter().find(|c| !["NET_ADMIN", "NET_RAW"].contains(c)) {
        problems.push(format!(
            "{origin}: trellis-route adds {extra}; it needs NET_ADMIN only"
        ));
    }
    if !caps("drop").contains(&"ALL") {
        problems.push(format!(
            "{origin}: trellis-route should drop ALL capabilities before adding NET_ADMIN"
        ));
    }
    check_node_identity(origin, spec, container, problems);
    // Its sysctls: /proc/sys is read-only without `privileged`, so the directory it names must be
    // a mount of the host's /proc/sys/net.
    let dir = container
        .get("env")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|v| v.get("name").and_then(Value::as_str) == Some("TRELLIS_PROC_SYS_NET"))
        .and_then(|v| v.get("value"))
        .and_then(Value::as_str);
    let mounted_from_host = dir.is_some_and(|dir| {
        container
            .get("volumeMounts")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|m| m.get("mountPath").and_then(Value::as_str) == Some(dir))
            .filter_map(|m| m.get("name").and_then(Value::as_str))
            .any(|volume| {
                spec.get("volumes")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter(|v| v.get("name").and_then(Value::as_str) == Some(volume))
                    .any(|v| {
                        v.pointer("/hostPath/path").and_then(Value::as_str) == Some("/proc/sys/net")
                    })
            })
    });
    if !mounted_from_host {
        problems.push(format!(
            "{origin}: TRELLIS_PROC_SYS_NET must name a mount of the host's /proc/sys/net (found {dir:?})"
        ));
    }
}

// --- the checker itself ------------------------------------------------------------------------

/// The checks do fail: a misspelt variable, an unknown flag, a bad value and a missing required
/// flag are all reported (so a green run above means something).
#[test]
fn the_checker_reports_typos_unknown_flags_and_bad_values() {
    let mut clis = Clis::default();
    let env = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Some((*v).to_owned())))
            .collect()
    };
    let good = Launch {
        origin: "good".into(),
        binary: "trellis-ipam".into(),
        args: vec!["--reserved".into(), "10.250.0.0/16".into()],
        env: env(&[
            ("TRELLIS_STORE", "memory://"),
            ("TRELLIS_CLUSTER_ID", "a"),
            ("TRELLIS_POD_CIDR", "10.0.0.0/16"),
            ("TRELLIS_EXTERNAL_CIDR", "10.201.0.0/16"),
            ("RUST_LOG", "info"),
        ]),
    };
    let mut problems = Vec::new();
    check_launch(&good, &mut clis, &mut problems);
    assert_eq!(problems, Vec::<String>::new());

    let bad = Launch {
        origin: "bad".into(),
        binary: "trellis-ipam".into(),
        args: vec!["--no-such-flag".into()],
        env: env(&[
            ("TRELLIS_STORE", "memory://"),
            ("TRELLIS_CLUSTER_ID", "a"),
            ("TRELLIS_POD_CIRD", "10.0.0.0/16"),
            ("TRELLIS_EXTERNAL_CIDR", "10.201.0.5/16"),
            ("TRELIS_RESERVED", "10.250.0.0/16"),
        ]),
    };
    check_launch(&bad, &mut clis, &mut problems);
    let all = problems.join("\n");
    for expected in [
        "has no flag --no-such-flag",
        "TRELLIS_POD_CIRD is not read by trellis-ipam",
        "TRELIS_RESERVED is set on trellis-ipam",
        "requires --pod-cidr",
        "refuses its configuration",
    ] {
        assert!(
            all.contains(expected),
            "{expected:?} not reported in:\n{all}"
        );
    }

    // The node path's flags go through the binaries' own parsers too.
    for (binary, variable, value, ok) in [
        ("trellis-gateway", "TRELLIS_UNDERLAY_MTU", "1500", true),
        ("trellis-gateway", "TRELLIS_UNDERLAY_MTU", "100", false),
        (
            "trellis-gateway",
            "TRELLIS_ENDPOINT_ADDRESS",
            "gw.hub.example",
            true,
        ),
        (
            "trellis-gateway",
            "TRELLIS_ENDPOINT_ADDRESS",
            "gw_hub.example",
            false,
        ),
        ("trellis-route", "TRELLIS_UNDERLAY_MTU", "9000", true),
        ("trellis-route", "TRELLIS_UNDERLAY_MTU", "99999", false),
        ("trellis-route", "TRELLIS_VXLAN_ID", "0", false),
    ] {
        // Each binary gets what it requires, and only variables it reads.
        let mut pairs = if binary == "trellis-route" {
            vec![
                ("TRELLIS_CLUSTER_ID", "a"),
                ("TRELLIS_GATEWAY", "trellis-gateway:7106"),
                ("TRELLIS_NODE_NAME", "node-1"),
                ("TRELLIS_NODE_IP", "100.64.1.2"),
            ]
        } else {
            vec![("TRELLIS_STORE", "memory://"), ("TRELLIS_CLUSTER_ID", "a")]
        };
        pairs.push((variable, value));
        let launch = Launch {
            origin: format!("{binary} {variable}={value}"),
            binary: binary.into(),
            args: Vec::new(),
            env: env(&pairs),
        };
        let mut problems = Vec::new();
        check_launch(&launch, &mut clis, &mut problems);
        let refused = problems
            .iter()
            .any(|p| p.contains("refuses its configuration"));
        assert_eq!(refused, !ok, "{binary} {variable}={value}: {problems:?}");
        if !ok {
            let flag = format!(
                "--{}",
                variable
                    .trim_start_matches("TRELLIS_")
                    .to_ascii_lowercase()
                    .replace('_', "-")
            );
            assert!(
                problems.join("\n").contains(&flag),
                "{flag} not named: {problems:?}"
            );
        }
    }

    let mut problems = Vec::new();
    let calls = check_script(
        "script",
        "x=$(/usr/local/bin/trellisctl --broker b:1 token)\n\
         export TRELLIS_PEER_TOKN=t\n\
         TRELLIS_PEER_TOKEN=t trellisctl --broker b:1 peer --remote-brokr r:2\n\
         until trellisctl --broker b:1 tokn; do sleep 1; done",
        &BTreeMap::new(),
        &mut clis,
        &mut problems,
    );
    assert_eq!(calls, 3);
    let all = problems.join("\n");
    assert!(all.contains("has no flag --remote-brokr"), "{all}");
    assert!(all.contains("names no trellisctl subcommand"), "{all}");
    assert!(all.contains("TRELLIS_PEER_TOKN is set but no"), "{all}");
    assert_eq!(problems.len(), 3, "{all}");
}

/// The node-path checks fail on a privileged route agent without the host network, a
/// Deployment, missing downward-API fields and a gateway on the host network with no node
/// selector; and pass on the base's own objects.
#[test]
fn the_node_path_checks_report_privilege_and_placement_mistakes() -> anyhow::Result<()> {
    let Some(python) = yaml_python() else {
        return Ok(());
    };
    let base = workspace_root().join("deploy/kustomize/base");
    let read = |file: &str| -> anyhow::Result<Value> {
        let docs = yaml_documents(&python, &std::fs::read(base.join(file))?)?;
        docs.into_iter()
            .find(|d| {
                matches!(
                    d.get("kind").and_then(Value::as_str),
                    Some("DaemonSet" | "Deployment")
                )
            })
            .context("no workload")
    };
    let route = read("route.yaml")?;
    let gateway = read("gateway.yaml")?;
    let spec = |w: &Value| {
        w.pointer("/spec/template/spec")
            .cloned()
            .unwrap_or_default()
    };
    let container = |s: &Value| s.pointer("/containers/0").cloned().unwrap_or_default();

    let (route_spec, gateway_spec) = (spec(&route), spec(&gateway));
    let mut problems = Vec::new();
    check_route_agent(
        "route",
        "DaemonSet",
        &route_spec,
        &container(&route_spec),
        &mut problems,
    );
    assert!(
        host_network(&gateway_spec),
        "the base gateway is on the host network"
    );
    check_gateway_on_node(
        "gateway",
        &gateway_spec,
        &container(&gateway_spec),
        &mut problems,
    );
    assert_eq!(problems, Vec::<String>::new(), "the base passes");

    let mut bad = route_spec.clone();
    bad["hostNetwork"] = Value::Bool(false);
    bad["hostPID"] = Value::Bool(true);
    bad["dnsPolicy"] = Value::String("ClusterFirst".into());
    let mut c = container(&bad);
    c["securityContext"] = serde_json::json!({
        "privileged": true,
        "capabilities": {"add": ["SYS_ADMIN"]}
    });
    c["env"] = serde_json::json!([
        {"name": "TRELLIS_NODE_NAME", "value": "node-1"},
        {"name": "TRELLIS_PROC_SYS_NET", "value": "/proc/sys/net"}
    ]);
    let mut problems = Vec::new();
    check_route_agent("route", "Deployment", &bad, &c, &mut problems);
    let all = problems.join("\n");
    for expected in [
        "a DaemonSet",
        "needs hostNetwork",
        "needs no hostPID",
        "must not be privileged",
        "allowPrivilegeEscalation: false",
        "needs NET_ADMIN",
        "adds SYS_ADMIN",
        "drop ALL",
        "TRELLIS_NODE_NAME must come from the downward API's spec.nodeName",
        "TRELLIS_NODE_IP must come from the downward API's status.hostIP",
        "ClusterFirstWithHostNet",
        "mount of the host's /proc/sys/net",
    ] {
        assert!(
            all.contains(expected),
            "{expected:?} not reported in:\n{all}"
        );
    }

    let mut bad = gateway_spec.clone();
    bad.as_object_mut().map(|o| o.remove("nodeSelector"));
    let mut problems = Vec::new();
    check_gateway_on_node("gateway", &bad, &serde_json::json!({}), &mut problems);
    let all = problems.join("\n");
    assert!(all.contains("needs a nodeSelector"), "{all}");
    assert!(all.contains("TRELLIS_NODE_IP must come from"), "{all}");
    Ok(())
}

// --- one writer per store ----------------------------------------------------------------------

/// The services whose correctness assumes a single running process per cluster: the broker
/// serialises starting, ending and notifying a peering with an in-process lock, and the
/// forwarder keeps its relays' due queue in memory. A rollout with the default RollingUpdate
/// strategy surges a second pod next to the first, so for a while two of them write the same
/// store. (The gateway is not one: its replicas share the store by design, ADR 0023.)
const SINGLE_WRITERS: [&str; 2] = ["trellis-broker", "trellis-forwarder"];

/// What makes `deployment` (running `binary`) run at most one pod at any time, as problems.
fn check_single_writer(origin: &str, deployment: &Value, problems: &mut Vec<String>) {
    let replicas = deployment.pointer("/spec/replicas").and_then(Value::as_i64);
    if replicas != Some(1) {
        problems.push(format!("{origin}: replicas is {replicas:?}, not 1"));
    }
    let strategy = deployment
        .pointer("/spec/strategy/type")
        .and_then(Value::as_str);
    if strategy != Some("Recreate") {
        problems.push(format!(
            "{origin}: strategy is {strategy:?}, not Recreate (a rolling update runs two pods \
             at once)"
        ));
    }
}

#[test]
fn single_writer_services_never_run_two_pods_during_a_rollout() -> anyhow::Result<()> {
    let Some(python) = yaml_python() else {
        return Ok(());
    };
    // This crate's own checkout (tests/integration is two levels below the root).
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .context("the workspace root")?;
    let base = root.join("deploy/kustomize/base");
    let mut problems = Vec::new();
    let mut found = BTreeSet::new();
    for entry in std::fs::read_dir(&base)? {
        let path = entry?.path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        for document in yaml_documents(&python, &std::fs::read(&path)?)? {
            if document.get("kind").and_then(Value::as_str) != Some("Deployment") {
                continue;
            }
            let runs = strings(document.pointer("/spec/template/spec/containers/0/command"));
            let Some(binary) = SINGLE_WRITERS
                .iter()
                .find(|b| runs.first().map(String::as_str) == Some(**b))
            else {
                continue;
            };
            found.insert(*binary);
            check_single_writer(
                &format!("{}: {binary}", path.display()),
                &document,
                &mut problems,
            );
        }
    }
    assert_eq!(
        found,
        SINGLE_WRITERS.into_iter().collect::<BTreeSet<_>>(),
        "the base runs each single-writer service as a Deployment"
    );
    assert_eq!(problems, Vec::<String>::new());

    // The check itself sees the default strategy.
    let mut problems = Vec::new();
    check_single_writer(
        "rolling",
        &serde_json::json!({"spec": {"replicas": 2}}),
        &mut problems,
    );
    let all = problems.join("\n");
    assert!(all.contains("replicas is Some(2)"), "{all}");
    assert!(all.contains("strategy is None, not Recreate"), "{all}");
    Ok(())
}

/// The gateway's replicas (ADR 0023) as deployed: at least two, never two on one node, a drain
/// or rollout takes one at a time, and the route agents follow every replica through a headless
/// Service.
#[test]
fn gateway_replicas_run_on_different_nodes_and_leave_one_up_in_a_drain() -> anyhow::Result<()> {
    let Some(python) = yaml_python() else {
        return Ok(());
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .context("the workspace root")?;
    let base = root.join("deploy/kustomize/base");
    let gateway = yaml_documents(&python, &std::fs::read(base.join("gateway.yaml"))?)?;
    let route = yaml_documents(&python, &std::fs::read(base.join("route.yaml"))?)?;
    let find = |kind: &str, name: &str| {
        gateway.iter().find(|d| {
            d.get("kind").and_then(Value::as_str) == Some(kind)
                && d.pointer("/metadata/name").and_then(Value::as_str) == Some(name)
        })
    };
    let deployment = find("Deployment", "trellis-gateway").context("the gateway Deployment")?;
    let replicas = deployment.pointer("/spec/replicas").and_then(Value::as_u64);
    assert!(replicas.is_some_and(|r| r >= 2), "replicas {replicas:?}");
    assert_eq!(
        deployment
            .pointer("/spec/strategy/rollingUpdate/maxSurge")
            .and_then(Value::as_u64),
        Some(0),
        "a rollout replaces one replica at a time"
    );
    let anti = deployment
        .pointer("/spec/template/spec/affinity/podAntiAffinity/requiredDuringSchedulingIgnoredDuringExecution/0")
        .context("required pod anti-affinity")?;
    assert_eq!(
        anti.pointer("/topologyKey").and_then(Value::as_str),
        Some("kubernetes.io/hostname")
    );
    assert_eq!(
        anti.pointer("/labelSelector/matchLabels/app.kubernetes.io~1name")
            .and_then(Value::as_str),
        Some("trellis-gateway")
    );
    let pdb = find("PodDisruptionBudget", "trellis-gateway").context("the gateway's PDB")?;
    assert_eq!(
        pdb.pointer("/spec/minAvailable").and_then(Value::as_u64),
        Some(1)
    );
    let headless = find("Service", "trellis-gateway-replicas").context("the replicas' Service")?;
    assert_eq!(
        headless.pointer("/spec/clusterIP").and_then(Value::as_str),
        Some("None"),
        "a headless Service resolves to every replica"
    );
    let agents = route
        .iter()
        .find(|d| d.get("kind").and_then(Value::as_str) == Some("DaemonSet"))
        .context("the route agents' DaemonSet")?;
    let env = agents
        .pointer("/spec/template/spec/containers/0/env")
        .and_then(Value::as_array)
        .context("env")?;
    let target = env
        .iter()
        .find(|e| e.get("name").and_then(Value::as_str) == Some("TRELLIS_GATEWAY"))
        .and_then(|e| e.get("value"))
        .and_then(Value::as_str);
    assert_eq!(target, Some("trellis-gateway-replicas:7106"));
    Ok(())
}
