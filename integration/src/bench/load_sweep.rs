//! `kvroute-bench load-sweep`: every policy (kvroute in Envoy, the peer
//! routers, Envoy's balancers) on the benchmark's trace workload at a range
//! of offered loads, to see where each one stops coping.
//!
//! A load is a share of the trace's *cache-blind capacity*
//! ([`workload::capacity`], the figure every workload of the benchmark and
//! the offline replay's load sweep offer their loads against): pods × the
//! prefill engine's throughput with no cache hit (uncached tokens per
//! second ÷ mean prompt tokens), or the sequence-slot bound if lower. At
//! load `L` the trace's timestamps are divided so that its lines arrive at
//! `L ×` capacity: the same lines at every load, only compressed in time,
//! each policy on fresh pods. Arrivals are open loop ([`super::load::run`]):
//! a request is sent at its offset whatever the earlier ones are doing, and
//! a 503 (or any other error) is recorded, not retried. TTFT percentiles are
//! over the requests answered 200, so a policy that refuses requests must
//! be read with its 503 column.
//!
//! A policy *sustains* a load while its TTFT p90 stays within a target
//! (20 s at time scale 1, scaled by the trace's time scale) and at most
//! [`MAX_ERROR_SHARE`] of its requests fail, at that load and every lower
//! one; the highest load each sustains is reported as a ratio to round
//! robin's.
//!
//! Results go to `OUT/load-sweep/`: `load-sweep.json` (rows merge by load
//! and policy when only some policies are rerun), `load-sweep.md` and
//! `load-sweep.png` (TTFT p90 against load, one line per policy).

use std::fs;
use std::path::Path;
use std::time::Instant;

use serde_json::{json, Value};

use super::report::{ms, pct, round};
use super::workload::{self, GenOptions, Workload};
use super::{plot, stack, BenchArgs};

/// Folder of the sweep's results, inside the benchmark's results folder.
pub const FOLDER: &str = "load-sweep";

/// Offered loads of a full sweep and of `--quick`.
pub const LOADS: [f64; 5] = [0.5, 1.0, 1.5, 2.0, 2.5];
pub const QUICK_LOADS: [f64; 3] = [0.5, 1.5, 2.5];

/// TTFT p90 a policy must keep to sustain a load, at time scale 1: five
/// times the 4 s uncached prefill of the trace's mean 20k-token prompt
/// (the offline load sweep's criterion; the 2 s is below one
/// uncached prefill of this trace).
pub const SUSTAIN_P90_MS_AT_SCALE_1: f64 = 20_000.0;

/// Share of failed requests (503s included) a sustained load may have.
pub const MAX_ERROR_SHARE: f64 = 0.01;

/// Runs the sweep and writes `out/load-sweep/`; returns its document.
pub fn run(
    args: &BenchArgs,
    opts: &GenOptions,
    policies: &[String],
    sim: &Path,
    out: &Path,
    command: &str,
) -> Result<Value, String> {
    let dir = out.join(FOLDER);
    fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let loads = match (args.loads.is_empty(), args.quick) {
        (false, _) => args.loads.clone(),
        (true, true) => QUICK_LOADS.to_vec(),
        (true, false) => LOADS.to_vec(),
    };
    if loads.iter().any(|l| !(l.is_finite() && *l > 0.0)) {
        return Err(format!("--loads {loads:?}: every load must be positive"));
    }
    let workloads: Vec<Workload> = loads
        .iter()
        .map(|&load| {
            workload::build(
                "trace",
                &GenOptions {
                    load,
                    speedup: None,
                    ..opts.clone()
                },
            )
        })
        .collect::<Result<_, _>>()?;
    let first = &workloads[0];
    // What every load shares; the per-load figures are under "loads".
    let mut shared = super::report::workload_json(first);
    if let Some(fields) = shared.as_object_mut() {
        for field in ["description", "offeredRps", "offeredLoad"] {
            fields.remove(field);
        }
    }
    let mut doc = json!({
        "command": command,
        "reruns": [],
        "date": super::shell("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        "host": super::host(),
        "quick": args.quick,
        "workload": shared,
        "sustainP90Ms": args.sustain_p90_ms.unwrap_or(SUSTAIN_P90_MS_AT_SCALE_1 * first.time_scale),
        "maxErrorShare": MAX_ERROR_SHARE,
        "loads": workloads.iter().zip(&loads).map(|(w, load)| json!({
            "load": load,
            "offeredRps": round(w.offered_rps, 2),
            "trace": w.description,
        })).collect::<Vec<_>>(),
        "rows": [],
    });
    // `--policies P` reruns P's rows of the stored sweep of the same
    // requests and keeps the others.
    let path = dir.join("load-sweep.json");
    let stored: Option<Value> = fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    if let Some(stored) = stored.filter(|s| {
        !args.policies.is_empty()
            && s["quick"] == doc["quick"]
            && s["workload"]["requests"] == doc["workload"]["requests"]
    }) {
        let mut reruns = stored["reruns"].as_array().cloned().unwrap_or_default();
        reruns.push(json!(command));
        doc["command"] = stored["command"].clone();
        doc["reruns"] = Value::Array(reruns);
        doc["rows"] = json!(stored["rows"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| !policies.iter().any(|p| r["policy"] == p.as_str()))
            .collect::<Vec<_>>());
    }
    let started = Instant::now();
    for (w, &load) in workloads.iter().zip(&loads) {
        eprintln!(
            "== load sweep {load}× of {:.1} req/s: {:.1} req/s offered, {} trace requests",
            w.capacity_rps,
            w.offered_rps,
            w.requests.len()
        );
        for policy in policies {
            let kept_log = args
                .keep_logs
                .as_ref()
                .map(|d| d.join(format!("load-sweep-{load}-{policy}.log")));
            let mut row = super::run_policy(policy, w, sim, None, kept_log.as_deref(), None)?;
            super::print_row(&row, started);
            row["load"] = json!(load);
            // 100 quantiles per row would dwarf the rest of the document.
            if let Some(fields) = row.as_object_mut() {
                fields.remove("ttftQuantilesMs");
            }
            let rows = doc["rows"].as_array_mut().expect("rows");
            rows.retain(|r| !(r["policy"] == policy.as_str() && r["load"] == load));
            rows.push(row);
            write(&dir, &mut doc)?;
        }
    }
    eprintln!("load sweep: results in {}", dir.display());
    Ok(doc)
}

/// Re-renders `dir`'s Markdown and chart from its JSON, if there is one.
pub fn render(dir: &Path) -> Result<(), String> {
    let Ok(text) = fs::read_to_string(dir.join("load-sweep.json")) else {
        return Ok(());
    };
    let mut doc: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    write(dir, &mut doc)
}

/// Sorts the rows (by load, then report order), recomputes the sustained
/// loads and writes the JSON, the Markdown and the chart.
fn write(dir: &Path, doc: &mut Value) -> Result<(), String> {
    let rank = |r: &Value| stack::POLICIES.iter().position(|p| r["policy"] == *p);
    if let Some(rows) = doc["rows"].as_array_mut() {
        rows.sort_by(|a, b| {
            load_of(a)
                .total_cmp(&load_of(b))
                .then(rank(a).cmp(&rank(b)))
        });
    }
    doc["sustained"] = sustained_json(doc);
    let text = serde_json::to_string_pretty(doc).map_err(|e| e.to_string())?;
    fs::write(dir.join("load-sweep.json"), text + "\n").map_err(|e| e.to_string())?;
    fs::write(dir.join("load-sweep.md"), markdown(doc)).map_err(|e| e.to_string())?;
    let target = doc["sustainP90Ms"].as_f64().unwrap_or(0.0);
    plot::ttft_p90_by_load(&dir.join("load-sweep.png"), rows(doc), target)
        .map_err(|e| e.to_string())
}

fn rows(doc: &Value) -> &[Value] {
    doc["rows"].as_array().map_or(&[], Vec::as_slice)
}

fn load_of(row: &Value) -> f64 {
    row["load"].as_f64().unwrap_or(0.0)
}

fn measured(row: &Value) -> bool {
    row.get("unavailable").is_none()
}

/// Whether `row` keeps TTFT p90 within `target_ms` with at most
/// [`MAX_ERROR_SHARE`] of its requests failed.
fn within(row: &Value, target_ms: f64) -> bool {
    let requests = row["requests"].as_f64().unwrap_or(0.0).max(1.0);
    let failed = row["errors"].as_f64().unwrap_or(0.0) / requests;
    row["ttftMs"]["p90"]
        .as_f64()
        .is_some_and(|p90| p90 <= target_ms)
        && failed <= MAX_ERROR_SHARE
}

/// The highest load `policy` sustains (within the target at it and at
/// every lower load), if any.
pub fn sustained(rows: &[Value], policy: &str, target_ms: f64) -> Option<f64> {
    let mut points: Vec<&Value> = rows
        .iter()
        .filter(|r| r["policy"] == policy && measured(r))
        .collect();
    points.sort_by(|a, b| load_of(a).total_cmp(&load_of(b)));
    points
        .into_iter()
        .take_while(|r| within(r, target_ms))
        .last()
        .map(load_of)
}

/// Per measured policy: the highest load sustained and its ratio to round
/// robin's.
fn sustained_json(doc: &Value) -> Value {
    let target = doc["sustainP90Ms"].as_f64().unwrap_or(0.0);
    let rows = rows(doc);
    let baseline = sustained(rows, "round-robin", target);
    let out: Vec<Value> = stack::POLICIES
        .iter()
        .filter(|p| rows.iter().any(|r| r["policy"] == **p && measured(r)))
        .map(|p| {
            let load = sustained(rows, p, target);
            let ratio = match (load, baseline) {
                (Some(l), Some(b)) => Some(round(l / b, 2)),
                _ => None,
            };
            json!({"policy": p, "load": load, "ratioToRoundRobin": ratio})
        })
        .collect();
    Value::Array(out)
}

fn times(v: &Value) -> String {
    v.as_f64().map_or("–".into(), |x| format!("{x:.2}×"))
}

/// The sweep's Markdown: method, sustained loads, kvroute against the best
/// other policy per load, the chart and every row.
pub fn markdown(doc: &Value) -> String {
    let w = &doc["workload"];
    let target = doc["sustainP90Ms"].as_f64().unwrap_or(0.0);
    let pooled = w["bounds"]["pooledLru"].as_f64().unwrap_or(0.0);
    let mut command = doc["command"].as_str().unwrap_or("").to_string();
    for rerun in doc["reruns"].as_array().into_iter().flatten() {
        command.push_str(&format!("`, then `{}", rerun.as_str().unwrap_or("")));
    }
    let mut out = format!(
        "# kvroute-bench load sweep (real Envoy)\n\n\
         Produced by `{command}` on {} ({}). Raw figures: `load-sweep.json`.\n\n\
         The benchmark's trace workload ({} Mooncake lines, mean prompt {} tokens) on {} \
         kvroute-sim pods × {} sequence slots, time scale {}, KV cache {} blocks per pod \
         (pooled-cache bound {}), each policy on fresh pods with the same requests. Offered \
         load = a share of the cache-blind capacity, {:.1} req/s: pods × the prefill engine's \
         throughput with no cache hit (4,096 / (0.9 × time scale) tokens/s ÷ mean prompt \
         tokens), or the slot bound if lower, the figure the offline replay's load sweep uses. \
         At each load the trace's timestamps are divided to arrive at that rate, open loop: a \
         request is sent at its offset whatever earlier ones are doing; a 503 or any other \
         error is counted and not retried. TTFT (client-side, first server-sent event) is over \
         the requests answered 200. Gateway waits: requests kvroute held because every pod was \
         at `maxQueue` (its `wait_end` log events, also `epp_wait_time_ms`), with how long \
         they waited; the peers and Envoy's balancers export no such figure (their queueing is \
         inside TTFT).\n\n",
        doc["date"].as_str().unwrap_or("?"),
        doc["host"].as_str().unwrap_or("?"),
        w["requests"],
        w["meanPromptTokens"],
        w["pods"],
        w["maxBatch"],
        w["timeScale"],
        w["kvBlocksPerPod"],
        pct(pooled),
        w["capacityRps"].as_f64().unwrap_or(0.0),
    );
    out.push_str(&format!(
        "## Highest load sustained\n\nSustained: TTFT p90 ≤ {} ms (20 s at time scale 1 × {}) \
         and at most {:.0}% of requests failed, at that load and every lower one.\n\n\
         | policy | highest load sustained | ratio to round robin's |\n|---|---:|---:|\n",
        ms(&json!(target)),
        w["timeScale"],
        MAX_ERROR_SHARE * 100.0,
    ));
    for s in doc["sustained"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "| {} | {} | {} |\n",
            s["policy"].as_str().unwrap_or(""),
            s["load"]
                .as_f64()
                .map_or("none".into(), |l| format!("{l:.1}×")),
            times(&s["ratioToRoundRobin"]),
        ));
    }
    out.push_str("\n![TTFT p90 vs offered load](load-sweep.png)\n\n");
    out.push_str(&versus_markdown(rows(doc)));
    out.push_str(
        "## Every load and policy\n\n\
         | load | policy | hit rate | of pooled bound | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | 503s | other errors | gateway waits · p50 / p90 / max ms | max pod share (× fair) | done req/s |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|\n",
    );
    for r in rows(doc) {
        let policy = r["policy"].as_str().unwrap_or("");
        let load = load_of(r);
        if let Some(reason) = r["unavailable"].as_str() {
            out.push_str(&format!(
                "| {load:.1}× | {policy} | *unavailable: {}* | | | | | | | | | |\n",
                reason.replace('|', "/")
            ));
            continue;
        }
        let hit = r["hitRate"].as_f64().unwrap_or(0.0);
        let http503 = r["http503"].as_u64().unwrap_or(0);
        let waits = &r["gatewayWaitMs"];
        let waits = match waits["requests"].as_u64() {
            Some(0) => "0".into(),
            Some(n) => format!(
                "{n} · {} / {} / {}",
                ms(&waits["p50"]),
                ms(&waits["p90"]),
                ms(&waits["max"])
            ),
            None => "–".into(),
        };
        out.push_str(&format!(
            "| {load:.1}× | {policy} | {} | {} | {} | {} | {} | {http503} | {} | {waits} | {} ({:.2}×) | {:.1} |\n",
            pct(hit),
            if pooled > 0.0 { pct(hit / pooled) } else { "–".into() },
            ms(&r["ttftMs"]["p50"]),
            ms(&r["ttftMs"]["p90"]),
            ms(&r["ttftMs"]["p99"]),
            r["errors"].as_u64().unwrap_or(0).saturating_sub(http503),
            pct(r["maxPodShare"].as_f64().unwrap_or(0.0)),
            r["maxShareOverFair"].as_f64().unwrap_or(0.0),
            r["completedPerS"].as_f64().unwrap_or(0.0),
        ));
    }
    let kinds: Vec<String> = rows(doc)
        .iter()
        .flat_map(|r| r["errorKinds"].as_array().cloned().unwrap_or_default())
        .filter_map(|k| k.as_str().map(String::from))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if !kinds.is_empty() {
        out.push_str("\nErrors seen (first 60 characters of each kind):\n\n");
        for kind in kinds {
            out.push_str(&format!("- `{kind}`\n"));
        }
    }
    out
}

/// Per load: kvroute precise against the policy other than kvroute with the
/// lowest TTFT p90 (among those that failed no more requests than allowed).
fn versus_markdown(rows: &[Value]) -> String {
    let mut out = String::from(
        "## kvroute precise against the best other router\n\n\
         Per load, the policy other than kvroute's with the lowest TTFT p90 among those with \
         at most the allowed share of failed requests; ratio = kvroute ÷ that policy (below 1 \
         favours kvroute).\n\n\
         | load | kvroute precise p90 ms · 503s · hit rate | best other policy | its p90 ms · 503s · hit rate | p90 ratio |\n\
         |---:|---|---|---|---:|\n",
    );
    let mut loads: Vec<f64> = rows.iter().map(load_of).collect();
    loads.dedup();
    let summary = |r: &Value| {
        format!(
            "{} · {} · {}",
            ms(&r["ttftMs"]["p90"]),
            r["http503"],
            pct(r["hitRate"].as_f64().unwrap_or(0.0))
        )
    };
    for load in loads {
        let at: Vec<&Value> = rows
            .iter()
            .filter(|r| load_of(r) == load && measured(r))
            .collect();
        let Some(kvroute) = at.iter().find(|r| r["policy"] == "kvroute-precise") else {
            continue;
        };
        let p90 = |r: &Value| r["ttftMs"]["p90"].as_f64().unwrap_or(f64::INFINITY);
        let best = at
            .iter()
            .filter(|r| {
                !r["policy"].as_str().unwrap_or("").starts_with("kvroute")
                    && within(r, f64::INFINITY)
            })
            .min_by(|a, b| p90(a).total_cmp(&p90(b)));
        let Some(best) = best else {
            continue;
        };
        out.push_str(&format!(
            "| {load:.1}× | {} | {} | {} | {:.2} |\n",
            summary(kvroute),
            best["policy"].as_str().unwrap_or(""),
            summary(best),
            p90(kvroute) / p90(best),
        ));
    }
    out.push('\n');
    out
}
