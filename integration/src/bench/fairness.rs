//! Fairness checks of the comparison: what each router adds on an idle
//! system. Per policy, fresh pods answering at once (`--time-scale 0`), then
//! tiny streamed completions one at a time, alternately straight to a pod
//! and through the router, over the same keep-alive client; added latency =
//! median TTFT through the router − median TTFT direct. A fixed stall (e.g.
//! ~40 ms of delayed ACKs) shows here as a constant offset.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use super::report::percentile;
use super::stack::{self, StartError};
use super::workload::{Bounds, Workload, MAX_BATCH};
use crate::http;

/// An empty workload: pods answering at once, a small cache.
fn idle_workload() -> Workload {
    Workload {
        name: "idle".into(),
        description: "tiny streamed completions, one at a time".into(),
        plugin: json!({"models": {"sim-model": {"baseModel": "sim-model"}}}),
        requests: Vec::new(),
        pods: 4,
        max_batch: MAX_BATCH,
        max_loras: 4,
        time_scale: 0.0,
        kv_blocks: 4096,
        cpu_kv_blocks: 0,
        working_set_blocks: 0,
        unique_blocks: 0,
        capacity_rps: 0.0,
        offered_rps: 0.0,
        agents: None,
        bounds: Bounds::default(),
        stock_vllm: false,
        tokenizer: String::new(),
        prefill_speeds: Vec::new(),
    }
}

/// TTFT (ms) of one tiny streamed completion to `addr`.
fn tiny_ttft(addr: &str, i: usize) -> Option<f64> {
    let body = json!({"model": "sim-model", "prompt": format!("ping {i}"), "max_tokens": 1,
                      "stream": true, "stream_options": {"include_usage": true}})
    .to_string();
    let r = http::stream_request(
        addr,
        "POST",
        "/v1/completions",
        &[
            ("content-type", "application/json"),
            ("x-session-id", &format!("idle-{i}")),
        ],
        Some(body.as_bytes()),
        Duration::from_secs(10),
    )
    .ok()?;
    (r.status == 200 && r.done)
        .then(|| r.first_event_after())
        .flatten()
        .map(|d| d.as_secs_f64() * 1000.0)
}

fn summary(mut values: Vec<f64>) -> Value {
    values.sort_by(f64::total_cmp);
    let round = |v: Option<f64>| v.map(|v| (v * 1000.0).round() / 1000.0);
    json!({"p50": round(percentile(&values, 50.0)), "p90": round(percentile(&values, 90.0)), "n": values.len()})
}

/// Added idle latency of every policy's router.
pub fn idle_latency(sim: &Path, policies: &[String], quick: bool) -> Value {
    let n = if quick { 60 } else { 200 };
    let w = idle_workload();
    let mut rows = Vec::new();
    for policy in policies {
        let stack = match stack::start(policy, &w, sim, None, None) {
            Ok(stack) => stack,
            Err(StartError::Unavailable(reason)) => {
                rows.push(json!({"policy": policy, "unavailable": reason}));
                continue;
            }
            Err(StartError::Failed(e)) => {
                rows.push(json!({"policy": policy, "unavailable": format!("did not start: {e}")}));
                continue;
            }
        };
        let pod = stack.first_pod();
        // Warm both paths' connections first.
        for i in 0..5 {
            tiny_ttft(&pod, i);
            tiny_ttft(stack.listen(), i);
        }
        let (mut direct, mut routed) = (Vec::new(), Vec::new());
        for i in 0..n {
            direct.extend(tiny_ttft(&pod, i));
            routed.extend(tiny_ttft(stack.listen(), i));
        }
        let (d, r) = (summary(direct), summary(routed));
        let added = match (r["p50"].as_f64(), d["p50"].as_f64()) {
            (Some(r), Some(d)) => json!(((r - d) * 1000.0).round() / 1000.0),
            _ => Value::Null,
        };
        let row = json!({
            "policy": policy,
            "directTtftMs": d,
            "routedTtftMs": r,
            "addedMs": added,
            "router": stack.router(),
        });
        eprintln!("fairness: {row}");
        rows.push(row);
    }
    json!({
        "method": format!("per policy: 4 fresh kvroute-sim pods at --time-scale 0, {n} tiny streamed completions (max_tokens 1) one at a time, alternately direct to pod-0 and through the router, one keep-alive client; added = median TTFT through the router − median TTFT direct"),
        "idle": rows,
    })
}
