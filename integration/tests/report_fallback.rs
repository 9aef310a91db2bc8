//! Precise mode with a stock vLLM pod, in real Envoy 1.40: a pod whose
//! report endpoint answers 404 (`kvroute-sim --no-report`) while its
//! `/metrics` works is routed as in approximate mode — its blocks are
//! kvroute's own decisions — with one log line saying so, and becomes
//! precise again when it serves reports (its report's blocks replacing the
//! decisions'). Run serially (`--test-threads=1`).

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
