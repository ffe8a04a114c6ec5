//! The connectivity check of a `--dataplane netns` lab: every `reach` pair pinged from its pod's
//! namespace, summed up as a cluster × cluster matrix an operator can read at a glance, with
//! every failing pair spelled out underneath. `trellis-lab up` runs it until every pair answers;
//! `trellis-lab check` runs it once against a lab that is up.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use futures::StreamExt as _;
use serde::Deserialize;

use crate::config::CheckConfig;
use crate::report::{Reach, table};

/// Pings in flight at once (each is a short-lived `ip netns exec ping`).
const PING_CONCURRENCY: usize = 16;

/// One pair's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub reach: Reach,
    pub answered: bool,
}

/// One ping (one second to answer) from `reach.from_pod` to `reach.address`.
async fn ping_once(reach: &Reach) -> bool {
    let (ns, address) = (reach.from_pod.clone(), reach.address.clone());
    tokio::task::spawn_blocking(move || {
        trellis_netlab::netns::exec(&ns, "ping", &["-n", "-q", "-c", "1", "-W", "1", &address])
            .is_ok_and(|out| out.status.success())
    })
    .await
    .unwrap_or(false)
}

/// Pings every pair; a pair that does not answer is retried until `bound` has passed since the
/// call (so a tunnel still handshaking gets its chance).
pub async fn ping_all(pairs: &[Reach], bound: Duration) -> Vec<Outcome> {
    let started = Instant::now();
    futures::stream::iter(pairs.iter().cloned().map(|reach| async move {
        loop {
            if ping_once(&reach).await {
                return Outcome {
                    reach,
                    answered: true,
                };
            }
            if started.elapsed() >= bound {
                return Outcome {
                    reach,
                    answered: false,
                };
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }))
    .buffered(PING_CONCURRENCY)
    .collect()
    .await
}

/// How many pairs answered.
pub fn answered(outcomes: &[Outcome]) -> usize {
    outcomes.iter().filter(|o| o.answered).count()
}

/// The matrix: a row per source cluster, a column per destination, each cell `answered/pairs`
/// (`-` on the diagonal); clusters in the order given.
pub fn matrix(clusters: &[String], outcomes: &[Outcome]) -> String {
    let mut cells: BTreeMap<(&str, &str), (usize, usize)> = BTreeMap::new();
    for o in outcomes {
        let cell = cells
            .entry((o.reach.from.as_str(), o.reach.to.as_str()))
            .or_default();
        cell.0 += usize::from(o.answered);
        cell.1 += 1;
    }
    let mut header = vec!["FROM \\ TO"];
    header.extend(clusters.iter().map(String::as_str));
    let rows: Vec<Vec<String>> =
        clusters
            .iter()
            .map(|from| {
                let mut row = vec![from.clone()];
                row.extend(clusters.iter().map(
                    |to| match cells.get(&(from.as_str(), to.as_str())) {
                        _ if from == to => "-".to_owned(),
                        Some((ok, all)) if ok == all => format!("{ok}/{all}"),
                        Some((ok, all)) => format!("{ok}/{all} FAIL"),
                        None => "no pods".to_owned(),
                    },
                ));
                row
            })
            .collect();
    table(&header, &rows)
}

/// One line per pair that did not answer.
pub fn failures(outcomes: &[Outcome]) -> String {
    let mut out = String::new();
    for o in outcomes.iter().filter(|o| !o.answered) {
        let r = &o.reach;
        let _ = writeln!(
            out,
            "FAIL {} pod in {} -> {} {} at {}: no answer",
            r.from, r.from_pod, r.to, r.to_pod, r.address
        );
    }
    out
}

/// The parts of the topology file the check reads.
#[derive(Debug, Deserialize)]
struct TopologyFile {
    clusters: Vec<ClusterId>,
    #[serde(default)]
    reach: Vec<Reach>,
}

#[derive(Debug, Deserialize)]
struct ClusterId {
    id: String,
}

/// `trellis-lab check`: pings every pair of the topology file once (retrying for
/// `--timeout`), prints the matrix and the failures; an error when any pair failed.
pub async fn run(config: &CheckConfig, out: &mut dyn Write) -> anyhow::Result<()> {
    let path = &config.topology_file;
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the topology file {}", path.display()))?;
    let file: TopologyFile = serde_json::from_str(&text)
        .with_context(|| format!("parsing the topology file {}", path.display()))?;
    if file.reach.is_empty() {
        bail!(
            "{} lists no pod pairs: it was not written by `trellis-lab up --dataplane netns`, \
             or that lab has not finished forming its mesh",
            path.display()
        );
    }
    let missing = trellis_netlab::missing_prerequisites(&["ip", "ping"]);
    if !missing.is_empty() {
        bail!(
            "the check enters the pods' network namespaces and needs {}",
            missing.join(", ")
        );
    }
    let outcomes = ping_all(&file.reach, config.timeout()).await;
    let ids: Vec<String> = file.clusters.into_iter().map(|c| c.id).collect();
    writeln!(out, "{}", report(&ids, &outcomes))?;
    out.flush()?;
    let ok = answered(&outcomes);
    if ok != outcomes.len() {
        bail!(
            "{} of {} pod pairs did not answer",
            outcomes.len() - ok,
            outcomes.len()
        );
    }
    Ok(())
}

/// The matrix, then the failures or a line saying there are none.
pub fn report(clusters: &[String], outcomes: &[Outcome]) -> String {
    let mut text = format!(
        "pod pairs that answered a ping (rows ping columns):\n{}",
        matrix(clusters, outcomes)
    );
    let ok = answered(outcomes);
    if ok == outcomes.len() {
        let _ = writeln!(text, "all {ok} pod pairs answered");
    } else {
        text.push_str(&failures(outcomes));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(from: &str, to: &str, pod: usize, answered: bool) -> Outcome {
        Outcome {
            reach: Reach {
                from: from.into(),
                from_pod: format!("ns-{from}-p{pod}"),
                to: to.into(),
                to_pod: format!("pod-{pod}"),
                address: format!("10.9.{pod}.10"),
            },
            answered,
        }
    }

    #[test]
    fn the_matrix_counts_answered_pairs_per_cluster_pair_and_names_every_failure() {
        let ids = vec!["hub".to_owned(), "leaf-1".to_owned()];
        let outcomes = vec![
            outcome("hub", "leaf-1", 0, true),
            outcome("hub", "leaf-1", 1, true),
            outcome("leaf-1", "hub", 0, true),
            outcome("leaf-1", "hub", 1, false),
        ];
        let text = report(&ids, &outcomes);
        let rows: Vec<Vec<&str>> = text
            .lines()
            .skip(1)
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(rows[1], ["hub", "-", "2/2"], "{text}");
        assert_eq!(rows[2], ["leaf-1", "1/2", "FAIL", "-"], "{text}");
        assert!(
            text.contains("FAIL leaf-1 pod in ns-leaf-1-p1 -> hub pod-1 at 10.9.1.10"),
            "{text}"
        );
        assert!(!text.contains("all 4"), "{text}");
        let all_ok: Vec<Outcome> = outcomes
            .into_iter()
            .map(|o| Outcome {
                answered: true,
                ..o
            })
            .collect();
        assert!(report(&ids, &all_ok).contains("all 4 pod pairs answered"));
    }
}
