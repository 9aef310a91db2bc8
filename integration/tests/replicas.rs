//! Replicated gateways in real Envoy 1.40: several kvroute Envoys over the
//! same simulated pods, each serving its decision log on its replica
//! listener and pulling the others' (kvroute's `replicas`). Asserts that a
//! decision made on one replica is followed on another, that the channel
//! is no client surface, that a hostile peer is counted and ignored, and
//! that a replica killed under load leaves the others routing.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use kvroute::replica::wire::loads_digest;
use kvroute::replica::{parse_answer, AnswerLimits, REPLICA_KEY_HEADER};
use kvroute_integration::harness::{filler_text as text, poll, Cluster, ClusterSpec};
use kvroute_integration::http;
use serde_json::{json, Value};

const SIM: &str = env!("CARGO_BIN_EXE_kvroute-sim");

/// Approximate mode: a replica learns where a prompt went only from the
/// replica that routed it, so following is the channel's doing.
fn config() -> Value {
    json!({
        "mode": "approximate",
        "podReportIntervalMs": 200,
        "reportTimeoutMs": 400,
        "decisionHeaders": true,
    })
}

fn start(replicas: usize, config: Value) -> Cluster {
    let mut spec = ClusterSpec::new(4, config);
    spec.replicas = replicas;
    Cluster::start(SIM.as_ref(), spec).expect("cluster starts")
}

fn completion(prompt: &str) -> String {
    json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2}).to_string()
}

fn post(listen: &str, prompt: &str) -> http::Response {
    let response = http::post_json(listen, "/v1/completions", &completion(prompt)).expect("post");
    assert_eq!(response.status, 200, "{}", response.body);
    response
}

fn secret(cluster: &Cluster) -> String {
    cluster.config["replicas"]["secret"]
        .as_str()
        .expect("a secret")
        .to_string()
}

fn pull(address: &str, path: &str, key: Option<&str>) -> http::Response {
    let headers: Vec<(&str, &str)> = key.map(|k| (REPLICA_KEY_HEADER, k)).into_iter().collect();
    http::request(address, "GET", path, &headers, None, Duration::from_secs(5)).expect("call")
}

#[test]
fn a_decision_on_one_replica_is_followed_on_another() {
    let cluster = start(2, config());
    let (a, b) = (&cluster.envoy, &cluster.other_replicas[0]);
    all_converged(&cluster);
    // Six conversations opened on replica a, each continued on replica b:
    // b never saw them, yet sends each to the pod a chose, with its cache.
    for i in 0..6 {
        let opening = text(&format!("conversation {i}"), 8 * 1024);
        let first = post(&a.listen, &opening);
        let pod = first
            .header("x-kvroute-pod")
            .expect("decision header")
            .to_string();
        let started = Instant::now();
        poll(
            "replica b receives the decision",
            Duration::from_secs(5),
            Duration::from_millis(5),
            || {
                let received = b.metric("epp_replica_decisions_received_total", &[])?;
                (received >= f64::from(i + 1)).then_some(())
            },
        );
        let converged_in = started.elapsed();
        // a's request has ended by now: b counts it in flight on a's pod
        // until a's release reaches it (a's next tick, ≤ 25 ms, then its
        // replica listener's, 5 ms), as it would a busy pod's own request.
        std::thread::sleep(Duration::from_millis(150));
        let second = post(&b.listen, &format!("{opening} and the next turn"));
        let matched: f64 = second
            .header("x-kvroute-cache-match")
            .and_then(|m| m.parse().ok())
            .unwrap_or(0.0);
        assert_eq!(
            second.header("x-kvroute-pod"),
            Some(pod.as_str()),
            "conversation {i}"
        );
        assert!(matched > 0.9, "conversation {i}: b matched {matched}");
        assert!(
            converged_in < Duration::from_secs(1),
            "received in {converged_in:?}"
        );
    }
    // The lag is measured on b, and a logged what b received.
    let received = b
        .metric("epp_replica_decisions_received_total", &[])
        .unwrap_or(0.0);
    assert!(received >= 6.0, "b received {received}");
    assert!(
        a.metric("epp_replica_decisions_logged_total", &[])
            .unwrap_or(0.0)
            >= 6.0
    );
    assert!(b.prometheus().contains("epp_replica_lag_ms_count"));
    // Each replica found itself among the peers and follows the other.
    let listeners = &cluster.replica_listeners;
    assert_eq!(
        a.metric(
            "epp_replica_peer_state",
            &[("peer", &listeners[1].replace('.', "_"))]
        ),
        Some(1.0),
        "live"
    );
    assert_eq!(
        a.metric(
            "epp_replica_peer_state",
            &[("peer", &listeners[0].replace('.', "_"))]
        ),
        Some(3.0),
        "itself"
    );
}

#[test]
fn the_replica_channel_is_not_a_client_surface() {
    let cluster = start(2, config());
    let key = secret(&cluster);
    let path = "/kvroute/v1/replica?since=0";
    post(&cluster.envoy.listen, &text("a decision to log", 4096));
    // The public listener has no replica log, even with the secret.
    let public = pull(&cluster.envoy.listen, path, Some(&key));
    assert!(
        public.status != 200
            || serde_json::from_str::<Value>(&public.body)
                .map_or(true, |v| v.get("replica").is_none()),
        "the public listener served the log: {}",
        public.body
    );
    let listener = &cluster.replica_listeners[0];
    assert_eq!(pull(listener, path, None).status, 401);
    assert_eq!(
        pull(listener, path, Some("not-the-secret-not-the-secret-!!")).status,
        401
    );
    assert_eq!(pull(listener, "/elsewhere", Some(&key)).status, 404);
    let bad = pull(listener, "/kvroute/v1/replica?since=x", Some(&key));
    assert_eq!(bad.status, 400, "{}", bad.body);
    let post = http::request(
        listener,
        "POST",
        path,
        &[(REPLICA_KEY_HEADER, &key)],
        Some(b"{}"),
        Duration::from_secs(5),
    )
    .expect("call");
    assert_eq!(post.status, 405);
    // With the secret, on the replica listener: the log, whole.
    let log = pull(listener, path, Some(&key));
    assert_eq!(log.status, 200, "{}", log.body);
    let answer: Value = serde_json::from_str(&log.body).expect("json");
    assert_eq!(answer["full"], true);
    assert!(!answer["decisions"]
        .as_array()
        .expect("decisions")
        .is_empty());
    // A long-poll with nothing new (no decision since, the same loads) is
    // held, then answered empty.
    let limits = AnswerLimits {
        max_chain: 2048,
        max_pods: 64,
    };
    let parsed = parse_answer(log.body.as_bytes(), limits).expect("a valid answer");
    let started = Instant::now();
    let idle = pull(
        listener,
        &format!(
            "/kvroute/v1/replica?since={}&epoch={}&loads={:x}&wait=300",
            parsed.seq,
            parsed.replica,
            loads_digest(&parsed.inflight)
        ),
        Some(&key),
    );
    assert!(started.elapsed() >= Duration::from_millis(250), "held");
    let idle: Value = serde_json::from_str(&idle.body).expect("json");
    assert_eq!(
        (idle["full"].clone(), idle["decisions"].clone()),
        (json!(false), json!([]))
    );
}

/// A peer that answers every pull with 200 and garbage.
fn hostile_peer() -> (String, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address").to_string();
    let handle = std::thread::spawn(move || {
        for stream in listener.incoming().take(200) {
            let Ok(mut stream) = stream else { continue };
            let mut buffer = [0u8; 4096];
            let _ = stream.read(&mut buffer);
            let body = r#"{"version":1,"replica":"evil","seq":1,"since":0,"full":true,"sentAtMs":0,"decisions":[{"seq":1,"pod":"pod-0","atMs":0,"chain":["not hex"]}],"inflight":[]}"#;
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (address, handle)
}

#[test]
fn a_hostile_peer_is_counted_and_ignored() {
    let (evil, _server) = hostile_peer();
    let mut config = config();
    config["replicas"] = json!({"peers": [evil], "secret": "0123456789abcdef0123456789abcdef"});
    let cluster = start(1, config);
    let envoy = &cluster.envoy;
    let label = evil.replace('.', "_");
    poll(
        "the hostile peer's answers are counted",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            (envoy
                .metric("epp_replica_pull_failures_total", &[("peer", &label)])
                .unwrap_or(0.0)
                >= 2.0)
                .then_some(())
        },
    );
    assert_eq!(
        envoy.metric("epp_replica_peer_state", &[("peer", &label)]),
        Some(2.0),
        "failing"
    );
    assert_eq!(
        envoy.metric("epp_replica_decisions_received_total", &[]),
        Some(0.0)
    );
    assert_eq!(
        envoy.metric("epp_replica_converged", &[]),
        Some(1.0),
        "nothing to wait for"
    );
    // Routing goes on.
    post(&envoy.listen, &text("still routed", 2048));
    assert!(
        envoy.log().contains("replica_peer"),
        "the failure is logged"
    );
}

fn converged(envoy: &kvroute_integration::harness::Envoy) -> bool {
    envoy.metric("epp_replica_converged", &[]) == Some(1.0)
}

fn all_converged(cluster: &Cluster) {
    poll(
        "every replica converged",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || cluster.replicas().all(converged).then_some(()),
    );
}

#[test]
fn a_killed_replica_leaves_the_others_routing_and_catches_up_when_restarted() {
    let mut cluster = start(3, config());
    poll(
        "converged",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || cluster.replicas().all(converged).then_some(()),
    );
    // A conversation replica 0 opened before the kill.
    let opening = text("opened before the kill", 8 * 1024);
    let pod = post(&cluster.envoy.listen, &opening)
        .header("x-kvroute-pod")
        .expect("decision header")
        .to_string();
    let mut victim = cluster.other_replicas.remove(1);
    let victim_label = cluster.replica_listeners[2].replace('.', "_");
    victim.kill();
    // The others route on: every request answered.
    for i in 0..20 {
        let listen = if i % 2 == 0 {
            &cluster.envoy.listen
        } else {
            &cluster.other_replicas[0].listen
        };
        post(listen, &text(&format!("after the kill {i}"), 2048));
    }
    poll(
        "the dead peer is failing",
        Duration::from_secs(5),
        Duration::from_millis(20),
        || {
            (cluster
                .envoy
                .metric("epp_replica_peer_state", &[("peer", &victim_label)])
                == Some(2.0))
            .then_some(())
        },
    );
    // Back: converged within a second of being ready, with what it missed.
    let victim = victim.restart().expect("the replica restarts");
    let ready = Instant::now();
    poll(
        "the restarted replica converges",
        Duration::from_secs(5),
        Duration::from_millis(10),
        || converged(&victim).then_some(()),
    );
    let converged_in = ready.elapsed();
    assert!(
        converged_in < Duration::from_secs(1),
        "converged in {converged_in:?}"
    );
    let next = post(&victim.listen, &format!("{opening} and the next turn"));
    assert_eq!(
        next.header("x-kvroute-pod"),
        Some(pod.as_str()),
        "caught up from its peers"
    );
    cluster.other_replicas.push(victim);
}

#[test]
fn a_flood_of_unique_prompts_keeps_the_log_and_the_index_bounded() {
    let mut config = config();
    // The log holds at most maxIndexBlocks hashes: 32 prompts of 128.
    config["maxIndexBlocks"] = json!(4096);
    let cluster = start(2, config);
    for i in 0..120 {
        post(
            &cluster.envoy.listen,
            &text(&format!("unique prompt {i}"), 8 * 1024),
        );
    }
    let key = secret(&cluster);
    let log = pull(
        &cluster.replica_listeners[0],
        "/kvroute/v1/replica?since=0",
        Some(&key),
    );
    let answer = parse_answer(
        log.body.as_bytes(),
        AnswerLimits {
            max_chain: 2048,
            max_pods: 64,
        },
    )
    .expect("a valid answer");
    let hashes: usize = answer.decisions.iter().map(|d| d.chain.len()).sum();
    assert!(hashes <= 4096, "the log holds {hashes} hashes");
    // Each request logs its session start, then its decision.
    assert_eq!(answer.seq, 240, "every start and decision was logged");
    assert!(
        answer.decisions.first().is_some_and(|d| d.seq > 2 * 88),
        "the oldest dropped first"
    );
    let starts = answer
        .decisions
        .iter()
        .filter(|d| d.session_start.is_some())
        .count();
    assert_eq!(starts * 2, answer.decisions.len(), "as many starts held");
    // The peer learnt them all, within its own index's bound.
    let peer = &cluster.other_replicas[0];
    poll(
        "the peer received the flood",
        Duration::from_secs(10),
        Duration::from_millis(20),
        || (peer.metric("epp_replica_decisions_received_total", &[])? >= 120.0).then_some(()),
    );
    std::thread::sleep(Duration::from_millis(300));
    let nodes = peer
        .metric("epp_prefix_tree_nodes", &[])
        .expect("index size");
    assert!(nodes <= 4096.0, "the peer's index holds {nodes} blocks");
}

/// Every replica's TTFT model learns every replica's answers: replica b,
/// which never saw an answer, predicts in milliseconds what a learnt.
#[test]
fn answers_on_one_replica_teach_the_other_s_ttft_model() {
    let cluster = start(2, config());
    let (a, b) = (&cluster.envoy, &cluster.other_replicas[0]);
    all_converged(&cluster);
    // Streamed answers (their first byte is the first token) of varied
    // prompt sizes, all through a.
    for i in 0..12 {
        let prompt = text(&format!("streamed {i}"), 1024 * (1 + i % 6));
        let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2, "stream": true});
        let answer = http::post_sse(&a.listen, "/v1/completions", &body.to_string()).expect("post");
        assert_eq!(answer.status, 200);
    }
    let predicted = |envoy: &kvroute_integration::harness::Envoy, id: &str| {
        envoy.log().lines().find_map(|line| {
            let route: Value = serde_json::from_str(&line[line.find('{')?..]).ok()?;
            (route["event"] == "route" && route["requestId"] == id).then(|| {
                (
                    route["predictedTtftMs"].as_f64().expect("a prediction"),
                    route["blocks"].as_u64().expect("blocks"),
                )
            })
        })
    };
    // b routes a fresh prompt of ~1,000 tokens. Uncalibrated, a model
    // predicts in tokens (at least one a token); taught a's answers (pods
    // at time scale 0.02: µs a token), a few milliseconds.
    let started = Instant::now();
    let (ms, blocks) = poll(
        "b's model learnt a's answers",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            let id = format!("on-b-{}", started.elapsed().as_millis());
            let body = completion(&text(&id, 4 * 1024));
            let headers = [
                ("content-type", "application/json"),
                ("x-request-id", id.as_str()),
            ];
            let answer = http::request(
                &b.listen,
                "POST",
                "/v1/completions",
                &headers,
                Some(body.as_bytes()),
                Duration::from_secs(5),
            )
            .expect("post");
            assert_eq!(answer.status, 200);
            let (ms, blocks) = poll(
                "b's route line",
                Duration::from_secs(2),
                Duration::from_millis(20),
                || predicted(b, &id),
            );
            (ms < 100.0).then_some((ms, blocks))
        },
    );
    assert!(blocks >= 32, "a prompt of {blocks} blocks");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "learnt in {:?} ({ms} ms predicted)",
        started.elapsed()
    );
}
