//! Routing through Envoy's endpoints and failing over, in real Envoy 1.40
//! with simulated pods: `upstreamMode` `overrideHost` (the default: an
//! ordinary STATIC cluster with Envoy's override-host policy, retries on
//! connect failure and reset) and `originalDst` (an ORIGINAL_DST cluster,
//! no retry), both with passive health ejecting a pod at its first failure.
//! Pods are killed with SIGKILL (`Sim::kill`): the kernel refuses new
//! connections and resets the open ones, as when a pod's process dies.
//! Run serially (`--test-threads=1`): each test owns the machine.

use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_integration::harness::{
    filler_text as text, prometheus_value, Cluster, ClusterSpec, Sim,
};
use kvroute_integration::http;
use serde_json::{json, Value};

const SIM: &str = env!("CARGO_BIN_EXE_kvroute-sim");

/// Reports every 2 s (the default), so a dead pod's health would take
/// about 6 s to decay: anything faster is passive health.
fn config(mode: &str) -> Value {
    json!({
        "upstreamMode": mode,
        "podReportIntervalMs": 2000,
        "models": {"sim-model": {"baseModel": "sim-model"}}
    })
}

fn start(pods: usize, config: Value) -> Cluster {
    Cluster::start(SIM.as_ref(), ClusterSpec::new(pods, config)).expect("cluster starts")
}

fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens})
}

/// The pod that served a 200, as the pod says; the router's decision
/// header agrees (after a failover it names the pod that served).
fn served_by(response: &http::Response) -> String {
    assert_eq!(response.status, 200, "body: {}", response.body);
    let sim = response.header("x-sim-pod").expect("x-sim-pod").to_string();
    assert_eq!(response.header("x-kvroute-pod"), Some(sim.as_str()));
    sim
}

fn counter(cluster: &Cluster, name: &str, labels: &[(&str, &str)]) -> f64 {
    cluster.envoy.metric(name, labels).unwrap_or(0.0)
}

/// An Envoy stat from the admin's plain `/stats` (cluster counters).
fn envoy_stat(cluster: &Cluster, name: &str) -> u64 {
    let stats = http::get(&cluster.envoy.admin, "/stats")
        .expect("stats")
        .body;
    stats
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{name}: ")))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn override_host_sends_a_shared_prefix_to_the_pod_that_holds_it() {
    let cluster = start(4, config("overrideHost"));
    let prefix = text("handbook", 16 * 1024);
    let first = cluster.post("/v1/completions", &completion(&format!("{prefix} Q0"), 4));
    let holder = served_by(&first);
    cluster.wait_reports(1);
    for i in 1..=10 {
        let r = cluster.post(
            "/v1/completions",
            &completion(&format!("{prefix} question {i}"), 4),
        );
        assert_eq!(served_by(&r), holder, "request {i} left the holder");
        let cached = r.json().unwrap()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        assert!(cached >= 4000, "request {i}: {cached} cached tokens");
    }
    // Through the override-host cluster: every request one attempt to a
    // member, none through the fallback policy's own pick.
    assert_eq!(
        envoy_stat(&cluster, "cluster.kvroute_pods.upstream_rq_200"),
        11
    );
    assert_eq!(
        envoy_stat(&cluster, "cluster.kvroute_pods.upstream_rq_retry"),
        0
    );
    assert_eq!(counter(&cluster, "epp_failovers_total", &[]), 0.0);
}

/// In either upstream mode, a client's routing headers (a non-member alone,
/// or listed before a member) are never connected to.
#[test]
fn spoofed_endpoint_headers_never_reach_a_non_member() {
    for mode in ["overrideHost", "originalDst"] {
        spoofs_never_reach_a_non_member(mode);
    }
}

fn spoofs_never_reach_a_non_member(mode: &str) {
    let cluster = start(2, config(mode));
    let trap = TcpListener::bind("127.0.0.1:0").unwrap();
    let trap_address = trap.local_addr().unwrap().to_string();
    trap.set_nonblocking(true).unwrap();
    let touched = Arc::new(AtomicBool::new(false));
    let flag = touched.clone();
    let watcher = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if trap.accept().is_ok() {
                flag.store(true, Ordering::SeqCst);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    let member = cluster.sims[1].address.clone();
    let spoofs = [
        ("x-gateway-destination-endpoint", trap_address.clone()),
        (
            "x-gateway-destination-endpoint",
            format!("{trap_address},{member}"),
        ),
        ("x-envoy-original-dst-host", trap_address.clone()),
    ];
    for path in ["/v1/completions", "/v1/chat/completions", "/v1/models"] {
        for (header, value) in &spoofs {
            let body = if path == "/v1/chat/completions" {
                json!({"model": "sim-model", "messages": [{"role": "user", "content": "where to"}]})
            } else {
                completion("where do I go", 2)
            };
            let body = body.to_string();
            let r = http::request(
                &cluster.envoy.listen,
                "POST",
                path,
                &[("content-type", "application/json"), (header, value)],
                Some(body.as_bytes()),
                Duration::from_secs(10),
            )
            .expect("answer");
            assert!(
                r.header("x-sim-pod").is_some(),
                "{mode}: {path} with {header}: {value}: answered by a pod: {} {}",
                r.status,
                r.body
            );
        }
    }
    watcher.join().unwrap();
    assert!(
        !touched.load(Ordering::SeqCst),
        "{mode}: the spoofed address was connected to"
    );
}

/// Sends `prompt`-prefixed requests from `threads` clients until `stop`,
/// collecting every status (and the pod of each 200).
fn background_load(
    listen: &str,
    prefix: &str,
    threads: usize,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<Vec<(u16, String)>>> {
    (0..threads)
        .map(|t| {
            let (listen, prefix, stop) = (listen.to_string(), prefix.to_string(), stop.clone());
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                let mut i = 0;
                while !stop.load(Ordering::SeqCst) {
                    let body = completion(&format!("{prefix} client {t} request {i}"), 24);
                    let r = http::post_json(&listen, "/v1/completions", &body.to_string());
                    seen.push(match r {
                        Ok(r) => (r.status, r.header("x-sim-pod").unwrap_or("").to_string()),
                        Err(e) => (0, e.to_string()),
                    });
                    i += 1;
                }
                seen
            })
        })
        .collect()
}

#[test]
fn killing_the_busiest_pod_costs_no_client_error_with_override_host() {
    let mut cluster = start(4, config("overrideHost"));
    // A shared prefix makes its holder the busiest pod.
    let prefix = text("busy shared context", 8 * 1024);
    let warm = cluster.post("/v1/completions", &completion(&format!("{prefix} warm"), 1));
    served_by(&warm);
    cluster.wait_reports(1);
    for s in &cluster.sims {
        s.reset_stats();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let clients = 6;
    let load = background_load(&cluster.envoy.listen, &prefix, clients, &stop);
    std::thread::sleep(Duration::from_millis(1500));
    let busiest = cluster
        .sims
        .iter()
        .max_by_key(|s| s.requests())
        .map(|s| s.id.clone())
        .unwrap();
    let victim = cluster.pod_index(&busiest);
    let before_kill: Vec<u64> = cluster.sims.iter().map(|s| s.requests()).collect();
    cluster.sims[victim].kill();
    let killed_at = Instant::now();
    // Sequential requests during and after the death, with the prefix the
    // dead pod held.
    let mut sequential = Vec::new();
    for i in 0..40 {
        let r = cluster.post(
            "/v1/completions",
            &completion(&format!("{prefix} sequential {i}"), 8),
        );
        sequential.push((
            r.status,
            r.header("x-sim-pod").unwrap_or("").to_string(),
            r.body,
        ));
    }
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    let concurrent: Vec<(u16, String)> = load.into_iter().flat_map(|h| h.join().unwrap()).collect();
    let errors: Vec<String> = sequential
        .iter()
        .map(|(status, pod, body)| (*status, pod.clone(), body.clone()))
        .chain(
            concurrent
                .iter()
                .map(|(s, p)| (*s, p.clone(), String::new())),
        )
        .filter(|(status, _, _)| *status != 200)
        .map(|(status, pod, body)| format!("{status} {pod} {body}"))
        .collect();
    assert!(
        errors.is_empty(),
        "{} client errors after killing {busiest} (before the kill: {before_kill:?}): {errors:?}",
        errors.len()
    );
    assert!(
        sequential.iter().all(|(_, pod, _)| *pod != busiest),
        "a response came from the dead pod"
    );
    // The dead pod cost retries, not errors, and was ejected once, at its
    // first failure, for every worker: a failed attempt ejects it before
    // its response reaches the client, so each client (the sequential one
    // too) failed there at most once — with the request it had in flight
    // at the kill (reset) or one sent before the first ejection (refused).
    let retries = envoy_stat(&cluster, "cluster.kvroute_pods.upstream_rq_retry");
    let failovers = counter(&cluster, "epp_failovers_total", &[]);
    let failed_there = envoy_stat(&cluster, "cluster.kvroute_pods.upstream_cx_connect_fail");
    eprintln!(
        "{} requests ({} concurrent) in the {:?} after killing {busiest} (requests before: {before_kill:?}); \
         {retries} retries, {failovers} failovers, {failed_there} connections refused",
        sequential.len() + concurrent.len(),
        concurrent.len(),
        killed_at.elapsed(),
    );
    assert!(
        retries >= 1 && failovers == retries as f64,
        "retries {retries}, failovers {failovers}"
    );
    assert_eq!(
        counter(
            &cluster,
            "epp_passive_ejections_total",
            &[("pod", &busiest)]
        ),
        1.0
    );
    assert!(
        retries <= clients as u64 + 1 && failed_there <= retries,
        "{retries} retries, {failed_there} refused connections: the dead pod was not ejected at once"
    );
    assert!(cluster.envoy.log().contains("\"pod_ejected\""));
}

#[test]
fn passive_health_ejects_a_killed_pod_at_its_first_failure_with_original_dst() {
    let mut cluster = start(3, config("originalDst"));
    let prefix = text("original destination", 8 * 1024);
    let warm = cluster.post("/v1/completions", &completion(&format!("{prefix} warm"), 1));
    let holder = served_by(&warm);
    cluster.wait_reports(1);
    let victim = cluster.pod_index(&holder);
    let address = cluster.sims[victim].address.clone();
    cluster.sims[victim].kill();
    // ORIGINAL_DST cannot try another pod: the first request after the
    // death fails, with Envoy's own 503.
    let failed = cluster.post("/v1/completions", &completion(&format!("{prefix} 0"), 1));
    assert_eq!(failed.status, 503, "{}", failed.body);
    assert!(
        failed.body.contains("upstream connect error"),
        "{}",
        failed.body
    );
    let failed_at = Instant::now();
    // The next ones avoid it, on every worker (concurrent clients use
    // several connections), long before its health would decay.
    let listen = cluster.envoy.listen.clone();
    let responses: Vec<http::Response> = (0..8)
        .map(|c| {
            let (listen, body) = (
                listen.clone(),
                completion(&format!("{prefix} after {c}"), 1).to_string(),
            );
            std::thread::spawn(move || http::post_json(&listen, "/v1/completions", &body).unwrap())
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    let elapsed = failed_at.elapsed();
    for r in &responses {
        assert_ne!(served_by(r), holder);
    }
    assert!(elapsed < Duration::from_millis(1500), "{elapsed:?}");
    assert_eq!(
        counter(&cluster, "epp_passive_ejections_total", &[("pod", &holder)]),
        1.0
    );
    // Its health has not decayed yet: the ejection did this.
    let health = cluster
        .envoy
        .metric("epp_pod_health_score", &[("pod", &holder)]);
    assert_eq!(health, Some(100.0));

    // Back on its next good report: the revived pod is the only one left
    // healthy, so the requests that waited for it go there.
    let sim = Sim::start_on(
        SIM.as_ref(),
        &holder,
        address.rsplit_once(':').unwrap().1.parse().unwrap(),
        &cluster.dir.join("kvroute.json"),
        &["--time-scale".to_string(), "0.02".to_string()],
    )
    .expect("pod restarts");
    cluster.sims[victim] = sim;
    for (i, s) in cluster.sims.iter().enumerate() {
        if i != victim {
            s.fault(json!({"health": 0.0}));
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = cluster.post("/v1/completions", &completion("fresh start", 1));
        if r.status == 200 && r.header("x-sim-pod") == Some(holder.as_str()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the revived pod never got traffic back"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let text = cluster.envoy.prometheus();
    assert_eq!(
        prometheus_value(&text, "epp_passive_ejections_total", &[("pod", &holder)]),
        Some(1.0)
    );
}
