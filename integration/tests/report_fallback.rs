//! Precise mode with a stock vLLM pod, in real Envoy 1.40: a pod whose
//! report endpoint answers 404 (`kvroute-sim --no-report`) while its
//! `/metrics` works is routed as in approximate mode — its blocks are
//! kvroute's own decisions — with one log line saying so, and becomes
//! precise again when it serves reports (its report's blocks replacing the
//! decisions'). A pod whose vLLM states another block size than
//! `blockSizeTokens` in its `/metrics` (`kvroute-sim --metrics-block-size`)
//! is warned about once. A pod's cache size and use, from its reports,
//! reach its gauges, and the blocks its reports remove (and store again)
//! its eviction counts; the evictions kvroute predicts for a placement
//! are the ones the pod then reports.
//! Run serially (`--test-threads=1`).

use std::time::Duration;

use kvroute_integration::harness::{filler_text as text, poll, Cluster, ClusterSpec};
use kvroute_integration::http;
use serde_json::{json, Value};

const SIM: &str = env!("CARGO_BIN_EXE_kvroute-sim");

const INTERVAL_MS: u64 = 500;

/// The pod without a report endpoint.
const STOCK: usize = 2;

fn completion(prompt: &str) -> Value {
    json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4})
}

fn prompt(seed: &str, question: &str) -> String {
    format!("{} {question}", text(seed, 16 * 1024))
}

/// kvroute's JSON log events named `name` about `pod`.
fn events(log: &str, name: &str, pod: &str) -> Vec<Value> {
    log.lines()
        .filter_map(|line| line.find('{').map(|at| &line[at..]))
        .filter_map(|json| serde_json::from_str::<Value>(json).ok())
        .filter(|event| event["event"] == name && event["pod"] == pod)
        .collect()
}

fn wait_for(what: &str, mut probe: impl FnMut() -> bool) {
    poll(
        what,
        Duration::from_secs(10),
        Duration::from_millis(20),
        || probe().then_some(()),
    );
}

/// (pod that served it, kvroute's cache match) of a request through Envoy.
fn route(cluster: &Cluster, prompt: &str) -> (String, f64) {
    let r = cluster.post("/v1/completions", &completion(prompt));
    assert_eq!(r.status, 200, "{}", r.body);
    let pod = r.header("x-sim-pod").expect("x-sim-pod").to_string();
    assert_eq!(r.header("x-kvroute-pod"), Some(pod.as_str()));
    let matched = r
        .header("x-kvroute-cache-match")
        .and_then(|m| m.parse().ok());
    (pod, matched.expect("x-kvroute-cache-match"))
}

fn gauge(cluster: &Cluster, name: &str, pod: &str) -> Option<f64> {
    cluster.envoy.metric(name, &[("pod", pod)])
}

#[test]
fn a_pod_without_a_report_endpoint_keeps_cache_affinity_from_decisions() {
    let config = json!({
        "podReportIntervalMs": INTERVAL_MS,
        "metricsPath": "/metrics",
        // Pending decisions end long before the follow-ups: what kvroute
        // remembers of the stock pod is its fallback's.
        "pendingDecisionMs": 200,
        "models": {"sim-model": {"baseModel": "sim-model"}}
    });
    let mut spec = ClusterSpec::new(3, config);
    spec.per_pod_args = vec![vec![], vec![], vec!["--no-report".into()]];
    let cluster = Cluster::start(SIM.as_ref(), spec).expect("cluster starts");
    let stock = cluster.sims[STOCK].id.clone();
    wait_for("the fallback gauge", || {
        gauge(&cluster, "epp_pod_report_fallback", &stock) == Some(1.0)
    });
    assert_eq!(
        gauge(&cluster, "epp_pod_report_fallback", "pod-0"),
        Some(0.0)
    );

    // The first request can only go to the stock pod: the others are full
    // (their metrics say so).
    for sim in &cluster.sims[..STOCK] {
        sim.fault(json!({"queueDepth": 20}));
    }
    wait_for("pods 0 and 1 full", || {
        ["pod-0", "pod-1"]
            .iter()
            .all(|pod| gauge(&cluster, "epp_queue_depth", pod) == Some(20.0))
    });
    let (pod, _) = route(&cluster, &prompt("handbook", "q0"));
    assert_eq!(pod, stock);
    for sim in &cluster.sims[..STOCK] {
        sim.fault(json!({"queueDepth": null}));
    }
    wait_for("pods 0 and 1 free", || {
        ["pod-0", "pod-1"]
            .iter()
            .all(|pod| gauge(&cluster, "epp_queue_depth", pod) == Some(0.0))
    });

    // Follow-ups sharing the prefix go back to it, on kvroute's memory of
    // the decision (the pod reports nothing; pending decisions expired).
    for i in 1..=5 {
        let (pod, matched) = route(&cluster, &prompt("handbook", &format!("q{i}")));
        assert_eq!(pod, stock, "follow-up {i}");
        assert!(matched > 0.9, "follow-up {i}: cache match {matched}");
    }
    let log = cluster.envoy.log();
    assert_eq!(
        events(&log, "pod_report_fallback", &stock).len(),
        1,
        "{log}"
    );
    assert!(
        events(&log, "pod_report_failing", &stock).is_empty(),
        "{log}"
    );
    assert_eq!(
        cluster
            .envoy
            .metric("epp_report_failures_total", &[("pod", &stock)]),
        Some(0.0),
        "a missing report is no failure"
    );

    // The pod empties its cache, caches another prefix directly, and starts
    // serving reports: precise again, its index the report's.
    let sim = &cluster.sims[STOCK];
    sim.fault(json!({"evictAll": true}));
    let direct = http::post_json(
        &sim.address,
        "/v1/completions",
        &completion(&prompt("manual", "q0")).to_string(),
    )
    .unwrap();
    assert_eq!(direct.status, 200);
    sim.fault(json!({"report": "ok"}));
    wait_for("precise again", || {
        !events(&cluster.envoy.log(), "pod_report_precise", &stock).is_empty()
    });
    wait_for("the fallback gauge at 0", || {
        gauge(&cluster, "epp_pod_report_fallback", &stock) == Some(0.0)
    });
    let (_, matched) = route(&cluster, &prompt("handbook", "q9"));
    assert_eq!(matched, 0.0, "the decisions' blocks were replaced");
    let (pod, matched) = route(&cluster, &prompt("manual", "q1"));
    assert_eq!(pod, stock, "the report's prefix");
    assert!(matched > 0.9, "cache match {matched}");
    let log = cluster.envoy.log();
    assert_eq!(events(&log, "pod_report_fallback", &stock).len(), 1);
    assert_eq!(events(&log, "pod_report_precise", &stock).len(), 1);
}

/// vLLM's CPU build runs with blocks of 32 tokens where kvroute's default
/// `blockSizeTokens` is 16, and precise routing then finds none of that
/// pod's blocks. kvroute says so once, in a warning naming both sizes and
/// the fix, and in the pod's gauge; a pod whose vLLM states 16 gets
/// neither. Both pods' cache sizes (`num_gpu_blocks`) are exported.
#[test]
fn a_pod_whose_vllm_block_size_is_not_block_size_tokens_is_warned_about_once() {
    let config = json!({
        "podReportIntervalMs": INTERVAL_MS,
        "metricsPath": "/metrics",
        "models": {"sim-model": {"baseModel": "sim-model"}}
    });
    let mut spec = ClusterSpec::new(2, config);
    spec.per_pod_args = vec![vec![], vec!["--metrics-block-size".into(), "32".into()]];
    let cluster = Cluster::start(SIM.as_ref(), spec).expect("cluster starts");
    let (agrees, cpu) = (cluster.sims[0].id.clone(), cluster.sims[1].id.clone());
    wait_for("the mismatch gauge", || {
        gauge(&cluster, "epp_pod_block_size_mismatch", &cpu) == Some(1.0)
    });
    // Three more rounds of metrics: still said once.
    std::thread::sleep(Duration::from_millis(3 * INTERVAL_MS));
    let log = cluster.envoy.log();
    let warnings = events(&log, "pod_block_size_mismatch", &cpu);
    assert_eq!(warnings.len(), 1, "{log}");
    let warning = &warnings[0];
    assert_eq!(
        (&warning["blockSize"], &warning["blockSizeTokens"]),
        (&json!(32), &json!(16))
    );
    let detail = warning["detail"].as_str().expect("a detail");
    assert!(detail.contains("Set blockSizeTokens to 32"), "{detail}");
    assert!(
        log.lines()
            .any(|line| line.contains("pod_block_size_mismatch") && line.contains("[warning]")),
        "a warning: {log}"
    );
    assert!(
        events(&log, "pod_block_size_mismatch", &agrees).is_empty(),
        "{log}"
    );
    assert_eq!(
        gauge(&cluster, "epp_pod_block_size_mismatch", &agrees),
        Some(0.0)
    );
    for pod in [&agrees, &cpu] {
        // The sims cache with prefix caching, 4,096 blocks by default.
        assert!(
            events(&log, "pod_prefix_caching_disabled", pod).is_empty(),
            "{log}"
        );
        assert_eq!(
            gauge(&cluster, "epp_pod_kv_capacity_blocks", pod),
            Some(4096.0)
        );
    }
}

/// One sim of `kv_blocks` blocks behind kvroute, its size reported.
fn one_sim_of(kv_blocks: u64) -> Cluster {
    let config = json!({
        "podReportIntervalMs": INTERVAL_MS,
        "models": {"sim-model": {"baseModel": "sim-model"}}
    });
    let mut spec = ClusterSpec::new(1, config);
    spec.per_pod_args = vec![vec!["--kv-blocks".into(), kv_blocks.to_string()]];
    let cluster = Cluster::start(SIM.as_ref(), spec).expect("cluster starts");
    let pod = cluster.sims[0].id.clone();
    wait_for("the reported size", || {
        gauge(&cluster, "epp_pod_kv_capacity_blocks", &pod) == Some(kv_blocks as f64)
    });
    cluster
}

/// A pod reports its cache's size and use (`kvCapacityBlocks`,
/// `residentBlocks`): with no metrics page, both reach the pod's gauges,
/// the use following the blocks the pod caches; the blocks its reports
/// remove are counted as its evictions, and those its reports store again,
/// prefilled a second time, as regretted (one pod, so the request goes
/// back to it).
#[test]
fn a_pods_reported_cache_size_and_use_reach_its_gauges() {
    let cluster = one_sim_of(3000);
    let (pod, _) = route(&cluster, &prompt("manual", "q0"));
    let sim = cluster.sims.iter().find(|s| s.id == pod).expect("a sim");
    let cached = sim.stats()["kvBlocks"].as_f64().expect("kvBlocks");
    assert!(cached > 0.0, "the sim caches the prompt");
    wait_for("the reported use", || {
        gauge(&cluster, "epp_pod_kv_resident_blocks", &pod) == Some(cached)
    });
    sim.fault(json!({"evictAll": true}));
    wait_for("the use back at 0", || {
        gauge(&cluster, "epp_pod_kv_resident_blocks", &pod) == Some(0.0)
    });
    wait_for("the evictions counted", || {
        gauge(&cluster, "epp_pod_kv_removed_blocks_total", &pod) == Some(cached)
    });
    assert_eq!(
        gauge(&cluster, "epp_pod_kv_evictions_regretted_total", &pod),
        Some(0.0)
    );
    // The same prompt again: the pod prefills what it evicted. One block
    // in 8 is sampled, so the count is a multiple of 8 near `cached`.
    route(&cluster, &prompt("manual", "q1"));
    wait_for("the regretted evictions counted", || {
        gauge(&cluster, "epp_pod_kv_evictions_regretted_total", &pod)
            .is_some_and(|regretted| regretted > 0.0 && regretted % 8.0 == 0.0)
    });
    let regretted = gauge(&cluster, "epp_pod_kv_evictions_regretted_total", &pod).unwrap();
    assert!(
        regretted <= cached + 64.0,
        "{regretted} of {cached} evicted"
    );
}

/// The evictions kvroute predicts for a placement are the ones the pod
/// makes: a prompt that fits the free room predicts none; a second one,
/// on a cache left with less room than it needs, predicts what it will
/// push out, and the pod's reports then remove as many.
#[test]
fn the_evictions_a_placement_predicts_are_the_ones_the_pod_reports() {
    // Room for one 16 KiB prompt (256 blocks of 16 tokens) and a bit.
    let cluster = one_sim_of(300);
    let pod = cluster.sims[0].id.clone();
    route(&cluster, &prompt("first", "q"));
    let first = cluster.sims[0].stats()["kvBlocks"]
        .as_f64()
        .expect("kvBlocks");
    assert!((200.0..300.0).contains(&first), "{first} blocks cached");
    assert_eq!(
        gauge(&cluster, "epp_pod_kv_evictions_predicted_total", &pod),
        Some(0.0),
        "it fit"
    );
    wait_for("the reported use", || {
        gauge(&cluster, "epp_pod_kv_resident_blocks", &pod) == Some(first)
    });
    route(&cluster, &prompt("second", "q"));
    let predicted = gauge(&cluster, "epp_pod_kv_evictions_predicted_total", &pod).unwrap();
    wait_for("the evictions reported", || {
        gauge(&cluster, "epp_pod_kv_removed_blocks_total", &pod).is_some_and(|r| r > 0.0)
    });
    std::thread::sleep(Duration::from_millis(2 * INTERVAL_MS));
    let removed = gauge(&cluster, "epp_pod_kv_removed_blocks_total", &pod).unwrap();
    assert!(
        (predicted - removed).abs() <= 2.0,
        "predicted {predicted} evictions, the pod made {removed}"
    );
}
