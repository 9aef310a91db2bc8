//! Report long-poll (report protocol v1 `wait`) in real Envoy 1.40 with
//! simulated pods: at the default 2 s `podReportIntervalMs`, a follow-up
//! that shares a fresh long prefix with a request finished 0.2 s earlier
//! lands on the pod that computed it only because that pod's report arrived
//! within milliseconds (pending decisions expire at once here, so reports
//! are the only signal); interval polling alone misses most of them; a pod
//! that ignores `wait` (`kvroute-sim --no-long-poll`) is polled on the
//! interval, without spinning, and still routed to by cache. Run serially
//! (`--test-threads=1`).

use std::time::{Duration, Instant};

use kvroute_integration::bench::overhead::thread_cpu_s;
use kvroute_integration::harness::{filler_text as text, Cluster, ClusterSpec};
use kvroute_integration::http;
use serde_json::{json, Value};

const SIM: &str = env!("CARGO_BIN_EXE_kvroute-sim");

/// Follow-up pairs per run.
const PAIRS: usize = 12;

fn start(config: Value, per_pod_args: Vec<Vec<String>>) -> Cluster {
    let mut spec = ClusterSpec::new(4, config);
    spec.per_pod_args = per_pod_args;
    Cluster::start(SIM.as_ref(), spec).expect("cluster starts")
}

fn completion(prompt: &str) -> Value {
    json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4})
}

/// The pod that served a response, as the pod says; the router's decision
/// header must agree.
fn served_by(response: &http::Response) -> String {
    assert_eq!(response.status, 200, "body: {}", response.body);
    let pod = response.header("x-sim-pod").expect("x-sim-pod").to_string();
    assert_eq!(response.header("x-kvroute-pod"), Some(pod.as_str()));
    pod
}

fn report_requests(cluster: &Cluster) -> Vec<u64> {
    cluster
        .sims
        .iter()
        .map(|s| s.stats()["reportRequests"].as_u64().unwrap_or(0))
        .collect()
}

/// Report calls each pod received over `span` of idleness.
fn idle_report_requests(cluster: &Cluster, span: Duration) -> Vec<u64> {
    let before = report_requests(cluster);
    std::thread::sleep(span);
    report_requests(cluster)
        .iter()
        .zip(&before)
        .map(|(after, before)| after - before)
        .collect()
}

/// [`PAIRS`] times: a request with a fresh 16 KiB prefix, then 0.2 s after
/// it finished a follow-up sharing that prefix. Returns how many follow-ups
/// landed on the first request's pod.
fn follow_up_hits(cluster: &Cluster) -> usize {
    (0..PAIRS)
        .filter(|i| {
            let prefix = text(&format!("fresh context {i}"), 16 * 1024);
            let first = served_by(
                &cluster.post("/v1/completions", &completion(&format!("{prefix} first"))),
            );
            std::thread::sleep(Duration::from_millis(200));
            let follow_up = served_by(&cluster.post(
                "/v1/completions",
                &completion(&format!("{prefix} follow-up")),
            ));
            follow_up == first
        })
        .count()
}

#[test]
fn follow_up_finds_its_prefix_within_milliseconds_with_long_poll() {
    // Default podReportIntervalMs (2000), and the router's own decisions
    // expire at once: only long-poll can explain a hit.
    let cluster = start(json!({"pendingDecisionMs": 1}), vec![]);
    let before = report_requests(&cluster);
    let started = Instant::now();
    let hits = follow_up_hits(&cluster);
    let elapsed = started.elapsed();
    eprintln!("long-poll: {hits}/{PAIRS} follow-ups hit");
    assert!(hits >= PAIRS - 1, "only {hits}/{PAIRS} follow-ups hit");
    // One call per pod per cache event or per 2 s wait, never a loop: each
    // pair makes at most two events on one pod (its two prefills).
    let calls: u64 = report_requests(&cluster)
        .iter()
        .zip(&before)
        .map(|(after, before)| after - before)
        .sum();
    let bound = 2 * PAIRS as u64 + 4 * (elapsed.as_millis() as u64 / 2000 + 2);
    assert!(
        calls <= bound,
        "{calls} report calls in {elapsed:?} (bound {bound})"
    );
    eprintln!("long-poll: {calls} report calls in {elapsed:?} over 4 pods");
    let idle = idle_report_requests(&cluster, Duration::from_secs(4));
    eprintln!("long-poll: idle report calls per pod in 4 s: {idle:?}");
    assert!(
        idle.iter().all(|&n| (1..=3).contains(&n)),
        "{idle:?} in 4 s"
    );
    assert!(!cluster
        .envoy
        .log()
        .contains("pod_report_long_poll_unsupported"));
}

#[test]
fn interval_polling_alone_misses_fresh_prefixes() {
    let cluster = start(
        json!({"reportLongPoll": false, "pendingDecisionMs": 1}),
        vec![],
    );
    let hits = follow_up_hits(&cluster);
    eprintln!("interval polling: {hits}/{PAIRS} follow-ups hit");
    // Chance (1 in 4 pods) and a round falling in the 0.2 s: 2–8 of 12
    // measured, never the long-poll bar.
    assert!(
        hits < PAIRS - 1,
        "{hits}/{PAIRS} follow-ups hit without long-poll"
    );
}

#[test]
fn a_pod_ignoring_wait_is_polled_on_the_interval() {
    let no_long_poll = vec!["--no-long-poll".to_string()];
    let cluster = start(json!({"podReportIntervalMs": 200}), vec![no_long_poll]);
    // Seen after at most a couple of quick calls, and logged once.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cluster
        .envoy
        .log()
        .contains("pod_report_long_poll_unsupported")
    {
        assert!(Instant::now() < deadline, "fallback never logged");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Idle: every pod answers about once per 200 ms, the fallen-back one
    // because it is asked once per interval, the others at the end of
    // each wait.
    let idle = idle_report_requests(&cluster, Duration::from_secs(3));
    eprintln!("fallback: idle report calls per pod in 3 s: {idle:?} (pod-0 ignores wait)");
    assert!(
        idle.iter().all(|&n| (8..=20).contains(&n)),
        "{idle:?} in 3 s"
    );
    // Routing by its reports still works: a prefix computed on pod-0
    // behind Envoy's back is routed to pod-0 once reported.
    let prefix = text("warmed on pod-0", 16 * 1024);
    let warm = completion(&format!("{prefix} warm"));
    let warmed = http::post_json(
        &cluster.sims[0].address,
        "/v1/completions",
        &warm.to_string(),
    )
    .expect("direct request");
    assert_eq!(warmed.status, 200);
    std::thread::sleep(Duration::from_millis(3 * 200 + 100));
    for i in 0..4 {
        let r = cluster.post("/v1/completions", &completion(&format!("{prefix} q{i}")));
        assert_eq!(served_by(&r), "pod-0", "request {i}");
    }
    let log = cluster.envoy.log();
    assert_eq!(log.matches("pod_report_long_poll_unsupported").count(), 1);
    assert!(!log.contains("pod_report_failing"), "{log}");
    let failures = cluster
        .envoy
        .metric("epp_report_failures_total", &[("pod", "pod-0")]);
    assert_eq!(failures.unwrap_or(0.0), 0.0);
}

/// Not part of the suite (`-- --ignored --nocapture`): Envoy's main-thread
/// CPU and the report calls per pod, idle and under 16 sequential requests
/// a second with fresh prefixes, with long-poll and with interval polling.
#[test]
#[ignore]
fn measure_main_thread_cpu() {
    let window = Duration::from_secs(20);
    for long_poll in [true, false] {
        let cluster = start(json!({"reportLongPoll": long_poll}), vec![]);
        let pid = cluster.envoy.pid();
        let cpu = || thread_cpu_s(pid, pid).unwrap_or(0.0);
        let calls_per_pod_s = |before: &[u64]| {
            let after: u64 = report_requests(&cluster).iter().sum();
            (after - before.iter().sum::<u64>()) as f64 / window.as_secs_f64() / 4.0
        };
        std::thread::sleep(Duration::from_secs(2));
        let (cpu_before, calls_before) = (cpu(), report_requests(&cluster));
        std::thread::sleep(window);
        let idle_cpu = cpu() - cpu_before;
        let idle_calls = calls_per_pod_s(&calls_before);
        let (cpu_before, calls_before) = (cpu(), report_requests(&cluster));
        let started = Instant::now();
        let mut sent = 0;
        while started.elapsed() < window {
            let prompt = text(&format!("measure {long_poll} {sent}"), 4096);
            served_by(&cluster.post("/v1/completions", &completion(&prompt)));
            sent += 1;
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!(
            "reportLongPoll {long_poll}: idle {idle_cpu:.2} s main-thread CPU per {window:?}, \
             {idle_calls:.2} report calls/s/pod; {sent} requests: {:.2} s CPU, {:.2} calls/s/pod",
            cpu() - cpu_before,
            calls_per_pod_s(&calls_before),
        );
    }
}
