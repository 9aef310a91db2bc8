//! `kvroute-bench replicas NAME.. [--replicas 1,3] [--runs R]`: kvroute as
//! N Envoys over the same pods behind one Envoy round robin that spreads
//! each request to the next replica, as a Kubernetes Service or a cloud
//! balancer does. N = 1 stands behind the same front, so both sides pay
//! the same hop. Every N and policy runs on fresh pods with the same seeded
//! requests, side by side in one run, R times (p99 is noisy on 2 cores).
//!
//! Results: `DIR/replicas/replicas.json` and `replicas.md`, each row's
//! figures and, for N > 1, its ratios to N = 1 of the same run (hit rate,
//! TTFT p50/p90/p99), and the replicas' convergence lag (decision on one
//! replica → visible on another, `epp_replica_lag_ms`).

use std::fmt::Write as _;
use std::fs;
use std::path::Path;
use std::time::Instant;

use serde_json::{json, Value};

use super::envoy_stats;
use super::workload::{self, GenOptions};
use super::{print_row, run_policy, BenchArgs};
use crate::harness::Envoy;

/// The folder under the results directory.
pub const FOLDER: &str = "replicas";

/// Runs the replicas comparison.
pub fn run(
    args: &BenchArgs,
    opts: &GenOptions,
    policies: &[String],
    sim: &Path,
    out: &Path,
    command: &str,
) -> Result<Value, String> {
    if args.names.is_empty() {
        return Err("replicas needs workload names (e.g. agentic multi-turn)".into());
    }
    let counts = if args.replicas.is_empty() {
        vec![1, 3]
    } else {
        args.replicas.clone()
    };
    if counts.contains(&0) {
        return Err("--replicas counts must be at least 1".into());
    }
    let dir = out.join(FOLDER);
    fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut doc = json!({
        "command": command,
        "date": super::shell("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        "host": super::host(),
        "quick": args.quick,
        "replicas": counts,
        "runs": args.runs,
        "rows": [],
    });
    let started = Instant::now();
    for name in &args.names {
        let w = workload::build(name, opts)?;
        eprintln!(
            "== replicas {counts:?} on {name}: {} requests, {:.1} req/s offered",
            w.requests.len(),
            w.offered_rps
        );
        for run in 1..=args.runs.max(1) {
            for policy in policies {
                for &replicas in &counts {
                    let kept_log = args
                        .keep_logs
                        .as_ref()
                        .map(|dir| dir.join(format!("{name}-{policy}-x{replicas}-run{run}.log")));
                    let mut row =
                        run_policy(policy, &w, sim, None, kept_log.as_deref(), Some(replicas))?;
                    eprint!("   ×{replicas} run {run}: ");
                    print_row(&row, started);
                    row["workload"] = json!(name);
                    row["replicas"] = json!(replicas);
                    row["run"] = json!(run);
                    if let Some(fields) = row.as_object_mut() {
                        fields.remove("ttftQuantilesMs");
                    }
                    doc["rows"].as_array_mut().expect("rows").push(row);
                    write(&dir, &mut doc)?;
                }
            }
        }
    }
    eprintln!("replicas: results in {}", dir.display());
    Ok(doc)
}

/// Adds each row's ratios to the single replica's row of the same
/// workload, policy and run, then writes the JSON and the Markdown.
fn write(dir: &Path, doc: &mut Value) -> Result<(), String> {
    let rows = doc["rows"].as_array().cloned().unwrap_or_default();
    let single = |row: &Value| {
        rows.iter().find(|r| {
            r["replicas"] == 1
                && r["workload"] == row["workload"]
                && r["policy"] == row["policy"]
                && r["run"] == row["run"]
        })
    };
    let ratios: Vec<Value> = rows
        .iter()
        .map(|row| match single(row) {
            Some(one) if row["replicas"] != 1 => {
                let ratio = |f: &dyn Fn(&Value) -> Option<f64>| {
                    f(row)
                        .zip(f(one))
                        .filter(|(_, base)| *base > 0.0)
                        .map(|(value, base)| (value / base * 1000.0).round() / 1000.0)
                };
                json!({
                    "hitRate": ratio(&|r| r["hitRate"].as_f64()),
                    "ttftP50": ratio(&|r| r["ttftMs"]["p50"].as_f64()),
                    "ttftP90": ratio(&|r| r["ttftMs"]["p90"].as_f64()),
                    "ttftP99": ratio(&|r| r["ttftMs"]["p99"].as_f64()),
                })
            }
            _ => Value::Null,
        })
        .collect();
    if let Some(rows) = doc["rows"].as_array_mut() {
        for (row, ratio) in rows.iter_mut().zip(ratios) {
            row["vsOneReplica"] = ratio;
        }
    }
    let text = serde_json::to_string_pretty(doc).map_err(|e| e.to_string())?;
    fs::write(dir.join("replicas.json"), text + "\n").map_err(|e| e.to_string())?;
    fs::write(dir.join("replicas.md"), markdown(doc)).map_err(|e| e.to_string())
}

fn markdown(doc: &Value) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Replicated gateways\n\n`{}` ({}; {}).\n\nEach row: kvroute as N Envoys behind one Envoy round robin (per request), fresh pods, the same seeded requests. Ratios are to N = 1 of the same run.\n",
        doc["command"].as_str().unwrap_or(""),
        doc["date"].as_str().unwrap_or(""),
        doc["host"].as_str().unwrap_or("")
    );
    md.push_str("| workload | policy | run | N | hit rate | TTFT p50 / p90 / p99 ms | max pod share | lag p50 / p99 ms | vs N = 1: hit · p50 · p90 · p99 |\n|---|---|---|---|---|---|---|---|---|\n");
    let text = |v: &Value| match v {
        Value::Null => "–".to_string(),
        v => v.to_string(),
    };
    for row in doc["rows"].as_array().into_iter().flatten() {
        let ratio = &row["vsOneReplica"];
        let vs = if ratio.is_null() {
            "–".to_string()
        } else {
            format!(
                "{} · {} · {} · {}",
                text(&ratio["hitRate"]),
                text(&ratio["ttftP50"]),
                text(&ratio["ttftP90"]),
                text(&ratio["ttftP99"])
            )
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {:.1} % | {} / {} / {} | {} | {} / {} | {} |",
            row["workload"].as_str().unwrap_or(""),
            row["policy"].as_str().unwrap_or(""),
            row["run"],
            row["replicas"],
            row["hitRate"].as_f64().unwrap_or(0.0) * 100.0,
            text(&row["ttftMs"]["p50"]),
            text(&row["ttftMs"]["p90"]),
            text(&row["ttftMs"]["p99"]),
            text(&row["maxShareOverFair"]),
            text(&row["replicaLagMs"]["p50"]),
            text(&row["replicaLagMs"]["p99"]),
            vs
        );
    }
    md
}

/// The convergence lag over every replica (decision on one → published on
/// another): how many, and the bucket bound each quantile falls within
/// (Envoy keeps a histogram's buckets, not its samples).
pub fn lag(envoys: &[&Envoy]) -> Value {
    let cumulative = envoy_stats::histogram(envoys, "epp_replica_lag_ms");
    let count = cumulative.last().map_or(0.0, |&(_, n)| n);
    let within = |q: f64| {
        cumulative
            .iter()
            .find(|(_, n)| count > 0.0 && *n >= q * count)
            .map(|(bound, _)| *bound)
            .filter(|bound| bound.is_finite())
    };
    json!({"count": count, "p50": within(0.5), "p90": within(0.9), "p99": within(0.99)})
}
