//! The filter's own time per request inside Envoy (issue 3's figure): 16 KiB
//! prompts against a published index of ~100,000 blocks over 16 pods.
//!
//!     make wasm envoy && cargo build --release -p kvroute-integration --bin kvroute-sim
//!     cargo run --release -p kvroute-integration --example filter_latency
//!
//! Each pod preloads 25 prompts of 16 KiB (256 blocks each → 6,400 blocks
//! per pod, 102,400 in all; KV capacity 16,384 blocks so nothing is evicted
//! during the run). Half the requests ask for a preloaded prompt
//! (a full 256-block match on one pod), half for fresh text (no match). The
//! per-request `latencyUs` of the filter's `route` log lines (parse, hash,
//! shared-data lookup, scoring) gives exact percentiles; Envoy's
//! `epp_scoring_latency_us` histogram is printed beside them.

use std::time::{Duration, Instant};

use kvroute_integration::harness::{prometheus_value, Cluster, ClusterSpec};
use kvroute_integration::sim::preload_prompt;
use serde_json::json;

const PODS: usize = 16;
const PROMPTS_PER_POD: usize = 25;
const PROMPT_BYTES: usize = 16 * 1024;
const REQUESTS: usize = 2000;

fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let sim = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("kvroute-sim");
    let mut spec = ClusterSpec::new(
        PODS,
        json!({"podReportIntervalMs": 500, "models": {"sim-model": {"baseModel": "sim-model"}}}),
    );
    spec.sim_args = [
        "--time-scale",
        "0",
        "--kv-blocks",
        "16384",
        "--preload-prompts",
        &PROMPTS_PER_POD.to_string(),
        "--preload-prompt-bytes",
        &PROMPT_BYTES.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let cluster = Cluster::start(&sim, spec).expect("cluster");
    let deadline = Instant::now() + Duration::from_secs(60);
    let nodes = loop {
        let nodes = cluster
            .envoy
            .metric("epp_prefix_tree_nodes", &[])
            .unwrap_or(0.0);
        if nodes >= (PODS * PROMPTS_PER_POD * PROMPT_BYTES / 64) as f64 || Instant::now() > deadline
        {
            break nodes;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    cluster.wait_reports(2);
    let log_before = cluster.envoy.log().len();
    for i in 0..REQUESTS {
        let prompt = if i % 2 == 0 {
            let pod = (i / 2) % PODS;
            let mut text = preload_prompt(
                &format!("pod-{pod}"),
                (i / 2 / PODS) % PROMPTS_PER_POD,
                PROMPT_BYTES,
            );
            text.push_str(" question");
            text
        } else {
            preload_prompt("nobody", i, PROMPT_BYTES)
        };
        let r = cluster.post(
            "/v1/completions",
            &json!({"model": "sim-model", "prompt": prompt, "max_tokens": 1}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        if i % 2 == 0 {
            assert_eq!(
                r.header("x-kvroute-cache-match"),
                Some("1.0000"),
                "preloaded prompt fully matched"
            );
        }
    }
    std::thread::sleep(Duration::from_millis(1500)); // stats flush + log flush
    let log = cluster.envoy.log();
    let mut hit = Vec::new();
    let mut miss = Vec::new();
    for line in log[log_before..]
        .lines()
        .filter(|l| l.contains("\"event\":\"route\""))
    {
        let json_part = &line[line.find('{').unwrap()..];
        let v: serde_json::Value = serde_json::from_str(json_part).unwrap();
        let us = v["latencyUs"].as_u64().unwrap();
        if v["matchedBlocks"].as_u64() == Some(256) {
            hit.push(us);
        } else {
            miss.push(us);
        }
    }
    hit.sort_unstable();
    miss.sort_unstable();
    let mut all: Vec<u64> = hit.iter().chain(&miss).copied().collect();
    all.sort_unstable();
    println!(
        "index: {nodes} blocks over {PODS} pods; {REQUESTS} requests of {PROMPT_BYTES} B prompts"
    );
    for (name, v) in [
        ("full 256-block match", &hit),
        ("no match", &miss),
        ("all", &all),
    ] {
        println!(
            "{name:>22}: n={:5} p50={:4} µs p99={:4} µs max={:5} µs",
            v.len(),
            percentile(v, 0.5),
            percentile(v, 0.99),
            v.last().unwrap()
        );
    }
    let prom = cluster.envoy.prometheus();
    let count = prometheus_value(&prom, "epp_scoring_latency_us_count", &[]);
    let sum = prometheus_value(&prom, "epp_scoring_latency_us_sum", &[]);
    println!("Envoy histogram epp_scoring_latency_us: count={count:?} sum={sum:?}");
    let stats = kvroute_integration::http::get(
        &cluster.envoy.admin,
        "/stats?filter=epp_scoring_latency_us",
    )
    .unwrap();
    println!("{}", stats.body.trim());
    let wasm = std::fs::metadata(kvroute_integration::harness::wasm_path())
        .unwrap()
        .len();
    println!("kvroute.wasm: {wasm} bytes");
}
