//! kvroute in real Envoy 1.40 with simulated vLLM pods: one test per
//! behaviour of the design. Each test starts its own pods and Envoy on
//! loopback ports (see `kvroute_integration::harness`) and asserts on where
//! requests actually went (the sims' own counters and `x-sim-pod`, and
//! kvroute's `x-kvroute-pod`), what the clients received, and Envoy's
//! metrics. Run serially (`--test-threads=1`): each test owns the machine.

use std::net::TcpListener;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use kvroute_integration::harness::{
    filler_text as text, free_port, kvroute_module, log_event, render_envoy_config, Cluster,
    ClusterSpec, Envoy,
};
use kvroute_integration::http;
use serde_json::{json, Value};

const SIM: &str = env!("CARGO_BIN_EXE_kvroute-sim");

/// Reports every 200 ms so tests see pod changes quickly.
fn base_config() -> Value {
    json!({
        "podReportIntervalMs": 200,
        "reportTimeoutMs": 400,
        "models": {
            "sim-model": {"baseModel": "sim-model"},
            "support-billing": {"baseModel": "sim-model", "adapter": "billing-lora"}
        }
    })
}

fn start(pods: usize, config: Value, sim_args: &[&str], per_pod: Vec<Vec<&str>>) -> Cluster {
    let mut spec = ClusterSpec::new(pods, config);
    if !sim_args.is_empty() {
        spec.sim_args = sim_args.iter().map(|s| s.to_string()).collect();
    }
    spec.per_pod_args = per_pod
        .into_iter()
        .map(|args| args.into_iter().map(String::from).collect())
        .collect();
    Cluster::start(SIM.as_ref(), spec).expect("cluster starts")
}

fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens})
}

/// The pod that served a response, as the pod itself says; checks the
/// router's decision header agrees.
fn served_by(response: &http::Response) -> String {
    assert_eq!(response.status, 200, "body: {}", response.body);
    let sim = response.header("x-sim-pod").expect("x-sim-pod").to_string();
    assert_eq!(
        response.header("x-kvroute-pod"),
        Some(sim.as_str()),
        "router header vs pod"
    );
    sim
}

fn cached_tokens(response: &http::Response) -> u64 {
    response.json().expect("json")["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

fn requests_per_pod(cluster: &Cluster) -> Vec<u64> {
    cluster.sims.iter().map(|s| s.requests()).collect()
}

#[test]
fn long_shared_prefix_goes_to_the_pod_that_holds_it() {
    let cluster = start(4, base_config(), &[], vec![]);
    let prefix = text("policy", 16 * 1024);
    let first = cluster.post("/v1/completions", &completion(&format!("{prefix} Q0"), 4));
    let holder = served_by(&first);
    cluster.wait_reports(2);
    for i in 1..=10 {
        let r = cluster.post(
            "/v1/completions",
            &completion(&format!("{prefix} question {i}"), 4),
        );
        assert_eq!(
            served_by(&r),
            holder,
            "request {i} left the pod holding the prefix"
        );
        assert!(
            cached_tokens(&r) >= 4000,
            "pod served {} cached tokens",
            cached_tokens(&r)
        );
    }
    let decisions = cluster
        .envoy
        .metric("epp_routing_decisions_total", &[("model", "sim-model")]);
    assert_eq!(decisions, Some(11.0));
}

/// Sends `prompt` to pod `pod` directly (not through Envoy).
fn warm_directly(cluster: &Cluster, pod: usize, prompt: &str) {
    let warm = http::post_json(
        &cluster.sims[pod].address,
        "/v1/completions",
        &completion(prompt, 1).to_string(),
    )
    .expect("warm a pod directly");
    assert_eq!(warm.status, 200, "warming pod {pod}: {}", warm.body);
}

/// The `route` log line of the request routed to `pod` last (waiting for
/// Envoy to write it).
fn last_route_line(cluster: &Cluster, pod: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let found = cluster
            .envoy
            .log()
            .lines()
            .rev()
            .filter_map(kvroute_integration::harness::log_event)
            .find(|e| e["event"] == "route" && e["pod"] == pod);
        if let Some(route) = found {
            return route;
        }
        assert!(Instant::now() < deadline, "no route line for {pod}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Offload tiers end to end: pods with a small GPU cache and a CPU tier
/// (kvroute-sim `--cpu-kv-blocks`), whose protocol-v1 reports carry each
/// block's tier. `gpu` holds prefix P in GPU memory; `cpu` held P too,
/// until a longer prompt pushed most of it into its CPU tier; `cpu-only`
/// holds prefix R that way, and nobody else holds R. P goes to `gpu`,
/// R to `cpu-only` (a CPU hit beats none), each route line and the
/// explain metric split the match by tier, and R is served from the CPU
/// tier.
#[test]
fn a_gpu_hit_beats_a_cpu_hit_which_beats_none() {
    let mut config = base_config();
    config["decisionHeaders"] = json!(true);
    // 100 GPU blocks of 16 tokens: a 4 KiB prompt is 64 of them.
    let cluster = start(
        3,
        config,
        &["--kv-blocks", "100", "--cpu-kv-blocks", "400"],
        vec![],
    );
    let ids: Vec<String> = cluster.sims.iter().map(|s| s.id.clone()).collect();
    let prefix = text("tiered prefix", 4 * 1024);
    let other = text("cpu only prefix", 4 * 1024);
    warm_directly(&cluster, 0, &format!("{prefix} warm"));
    for (pod, prompt) in [(1, &prefix), (2, &other)] {
        warm_directly(&cluster, pod, &format!("{prompt} warm"));
        // 96 more blocks: the GPU keeps the first few of the prompt's.
        warm_directly(&cluster, pod, &text(&format!("evict {pod}"), 6 * 1024));
        let cpu_blocks = cluster.sims[pod].stats()["kvCpuBlocks"].as_u64();
        assert!(
            cpu_blocks >= Some(50),
            "pod {pod} offloaded {cpu_blocks:?} blocks"
        );
    }
    cluster.wait_reports(3);

    let r = cluster.post(
        "/v1/completions",
        &completion(&format!("{prefix} question"), 1),
    );
    assert_eq!(served_by(&r), ids[0], "the GPU holder");
    let route = last_route_line(&cluster, &ids[0]);
    assert_eq!(route["matchedTiers"]["cpu"], 0, "{route}");
    assert!(route["matchedTiers"]["gpu"].as_u64() >= Some(60), "{route}");

    let r = cluster.post(
        "/v1/completions",
        &completion(&format!("{other} question"), 1),
    );
    assert_eq!(
        served_by(&r),
        ids[2],
        "the CPU holder, over pods holding nothing"
    );
    let route = last_route_line(&cluster, &ids[2]);
    let cpu = route["matchedTiers"]["cpu"].as_u64().unwrap_or(0);
    assert!(cpu >= 50, "{route}");
    // Credited at 0.9 a CPU block: below a whole GPU match, far above none.
    let cache_match: f64 = r.header("x-kvroute-cache-match").unwrap().parse().unwrap();
    assert!((0.5..0.95).contains(&cache_match), "{cache_match}");
    assert!(cluster.sims[2].stats()["cachedTokensCpu"].as_u64() >= Some(800));
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let blocks = |tier| {
            cluster
                .envoy
                .metric("epp_cache_matched_blocks_total", &[("tier", tier)])
        };
        if blocks("cpu") >= Some(cpu as f64) && blocks("gpu") >= Some(60.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "gpu {:?} cpu {:?}",
            blocks("gpu"),
            blocks("cpu")
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `routeLogSample` thins the INFO `route` lines only: with 0 no routed
/// request logs one, other INFO lines still appear, and every decision is
/// still counted (the worker's metric batch reaches Envoy within a tick).
#[test]
fn route_log_sample_zero_silences_route_lines_but_not_the_counts() {
    let mut config = base_config();
    config["routeLogSample"] = json!(0);
    let cluster = start(2, config, &[], vec![]);
    for i in 0..6 {
        let r = cluster.post("/v1/completions", &completion(&format!("sampled {i}"), 1));
        assert_eq!(r.status, 200);
    }
    let r = http::get(&cluster.envoy.listen, "/v1/completions").expect("response");
    assert_eq!(r.status, 405);
    let deadline = Instant::now() + Duration::from_secs(2);
    let decisions = loop {
        let decisions = cluster
            .envoy
            .metric("epp_routing_decisions_total", &[("model", "sim-model")]);
        let log = cluster.envoy.log();
        let settled = decisions == Some(6.0) && log.contains("\"event\":\"reject\"");
        if settled || Instant::now() > deadline {
            assert!(
                !log.contains("\"event\":\"route\""),
                "a route line was logged"
            );
            break decisions;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(decisions, Some(6.0));
    assert!(cluster.envoy.log().contains("\"event\":\"reject\""));
}

/// Precise mode's pending decisions: a follow-up 0.2 s after its
/// predecessor, sharing a fresh 5 KB prefix, lands where the predecessor
/// went — though the 2 s report interval means no report has said so, and
/// the follow-up may reach the other Envoy worker.
#[test]
fn follow_up_before_any_report_finds_its_predecessors_pod() {
    let mut config = base_config();
    config["podReportIntervalMs"] = json!(2000);
    config["reportTimeoutMs"] = json!(1000);
    let cluster = start(4, config, &[], vec![]);
    cluster.wait_reports(1);
    let mut hits = 0;
    for i in 0..12 {
        let prefix = text(&format!("fresh context {i}"), 5 * 1024);
        let first = cluster.post(
            "/v1/completions",
            &completion(&format!("{prefix} first"), 2),
        );
        let holder = served_by(&first);
        std::thread::sleep(Duration::from_millis(200));
        let follow_up = cluster.post(
            "/v1/completions",
            &completion(&format!("{prefix} follow-up"), 2),
        );
        if served_by(&follow_up) == holder && cached_tokens(&follow_up) >= 1024 {
            hits += 1;
        }
    }
    assert!(
        hits >= 11,
        "only {hits} of 12 follow-ups hit their predecessor's cache"
    );
    // Nothing expired early or piled up: the pending entries stay in the index.
    assert!(
        cluster
            .envoy
            .metric("epp_prefix_tree_nodes", &[])
            .unwrap_or(0.0)
            > 0.0
    );
}

#[test]
fn multi_turn_conversations_stick_to_their_pod() {
    // Pods 10× slower than the harness default, so the 16 openings are all
    // in flight together: at time scale 0.02 a request finishes in ~10 ms,
    // about as long as a loaded machine takes to send all 16, and their
    // prefill queues together on the pods.
    let cluster = start(4, base_config(), &["--time-scale", "0.2"], vec![]);
    let system = text("system prompt", 2048);
    let conversations = 16;
    let mut histories: Vec<Vec<Value>> = (0..conversations)
        .map(|c| {
            vec![
                json!({"role": "system", "content": system}),
                json!({"role": "user", "content": text(&format!("user {c} opening"), 1024)}),
            ]
        })
        .collect();
    let mut first_pod = vec![String::new(); conversations];
    let (mut later_turns, mut stuck) = (0, 0);
    for turn in 1..=5 {
        // The conversations open together (concurrent users sharing the
        // system prompt); later turns come one at a time.
        let responses: Vec<http::Response> = if turn == 1 {
            let bodies = histories.iter().map(
                |history| json!({"model": "sim-model", "messages": history, "max_tokens": 16}),
            );
            post_together(&cluster, "/v1/chat/completions", bodies)
        } else {
            histories
                .iter()
                .map(|history| {
                    let body = json!({"model": "sim-model", "messages": history, "max_tokens": 16});
                    cluster.post("/v1/chat/completions", &body)
                })
                .collect()
        };
        for (c, r) in responses.iter().enumerate() {
            let pod = served_by(r);
            if turn == 1 {
                first_pod[c] = pod;
            } else {
                later_turns += 1;
                stuck += usize::from(pod == first_pod[c]);
            }
            let answer = r.json().unwrap()["choices"][0]["message"]["content"].clone();
            histories[c].push(json!({"role": "assistant", "content": answer}));
            histories[c].push(
                json!({"role": "user", "content": text(&format!("user {c} turn {turn}"), 256)}),
            );
        }
        // Users think between turns; the pods report meanwhile.
        cluster.wait_reports(2);
    }
    let share = stuck as f64 / later_turns as f64;
    assert!(
        share >= 0.9,
        "only {stuck}/{later_turns} later turns on the turn-1 pod"
    );
    // Opened together, they spread (balance) instead of all following the
    // pod that cached the system prompt first.
    let distinct: std::collections::HashSet<_> = first_pod.iter().collect();
    assert!(
        distinct.len() >= 3,
        "conversations collapsed onto {distinct:?}"
    );
    // All 16 are in flight together: each opening's 256 uncached tokens
    // queue on its pod, and before any streamed answer (the model's prior
    // error, a factor of two) a pod that must prefill a whole opening
    // (768 tokens) takes the next one once the holder's queue is twice
    // that: at most a few more openings than the least busy pod.
    let openings = |pod: &str| first_pod.iter().filter(|p| *p == pod).count();
    let per_pod: Vec<usize> = (0..4).map(|i| openings(&format!("pod-{i}"))).collect();
    let busiest = per_pod.iter().copied().max().unwrap_or(0);
    let least = per_pod.iter().copied().min().unwrap_or(0);
    assert!(
        busiest <= least + 7,
        "openings per pod {per_pod:?}: {first_pod:?}"
    );
}

/// Conversations on one system prompt opening together once one pod
/// holds it: each opening alone is answered sooner by that holder (a
/// 1,000-token copy against 128 tokens of its own), so the holder took
/// the sessions until its queue outgrew the copy, and their later turns
/// followed them there. The holder is hot (more than its share of the
/// streams open), so the prompt is copied (`src/scoring/spread.rs`) and
/// each conversation's next turn follows its own opening. (Questions sent
/// one at a time to an idle holder are not spread:
/// `long_shared_prefix_goes_to_the_pod_that_holds_it`.)
#[test]
fn conversations_opening_together_spread_a_hot_system_prompt() {
    spread_a_hot_system_prompt("precise");
}

/// The same in approximate mode, where no report says what a pod carries:
/// the streams open on each pod, counted by every worker, do.
#[test]
fn approximate_mode_spreads_a_hot_system_prompt_by_the_streams_open() {
    spread_a_hot_system_prompt("approximate");
}

fn spread_a_hot_system_prompt(mode: &str) {
    let mut config = base_config();
    config["mode"] = json!(mode);
    let cluster = start(4, config, &["--time-scale", "0.2"], vec![]);
    let first_pod = open_together(&cluster, 16);
    let distinct: std::collections::HashSet<_> = first_pod.iter().collect();
    assert!(distinct.len() >= 3, "openings on {distinct:?}");
    let spread = cluster
        .envoy
        .metric("epp_prefix_spread_total", &[])
        .unwrap_or(0.0);
    assert!(spread >= 1.0, "{spread} spread decisions");
    let route = cluster
        .envoy
        .log()
        .lines()
        .filter_map(kvroute_integration::harness::log_event)
        .find(|e| e["event"] == "route" && e["spread"] == true);
    assert!(route.is_some(), "no route line says spread");
    cluster.wait_reports(2);
    for (c, pod) in first_pod.iter().enumerate() {
        let mut history = opening(c);
        history.push(json!({"role": "assistant", "content": "ok"}));
        history.push(json!({"role": "user", "content": "and then?"}));
        assert_eq!(
            &served_by(&send_turns(&cluster, &history)),
            pod,
            "conversation {c}'s turn 2"
        );
    }
    // Later turns never spread, whatever the router saw of them.
    assert_eq!(
        cluster.envoy.metric("epp_prefix_spread_total", &[]),
        Some(spread)
    );
}

/// Opens conversation 0 on the shared system prompt, waits for its pod to
/// report it, then opens `conversations` more at once; their pods.
fn open_together(cluster: &Cluster, conversations: usize) -> Vec<String> {
    let first = served_by(&send_turns(cluster, &opening(0)));
    cluster.wait_reports(2);
    let bodies = (1..=conversations)
        .map(|c| json!({"model": "sim-model", "messages": opening(c), "max_tokens": 4}));
    let mut pods = vec![first];
    pods.extend(
        post_together(cluster, "/v1/chat/completions", bodies)
            .iter()
            .map(served_by),
    );
    pods
}

/// Posts `bodies` to `path` at once (one thread each, released together);
/// their responses in order.
fn post_together(
    cluster: &Cluster,
    path: &'static str,
    bodies: impl Iterator<Item = Value>,
) -> Vec<http::Response> {
    let bodies: Vec<Value> = bodies.collect();
    let start_together = Arc::new(Barrier::new(bodies.len()));
    let handles: Vec<_> = bodies
        .into_iter()
        .map(|body| {
            let listen = cluster.envoy.listen.clone();
            let start_together = start_together.clone();
            std::thread::spawn(move || {
                start_together.wait();
                http::post_json(&listen, path, &body.to_string()).expect("response")
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Conversation `c`'s first turn on the shared system prompt.
fn opening(c: usize) -> Vec<Value> {
    vec![
        json!({"role": "system", "content": text("system prompt", 4096)}),
        json!({"role": "user", "content": text(&format!("user {c} opening"), 512)}),
    ]
}

fn send_turns(cluster: &Cluster, history: &[Value]) -> http::Response {
    let body = json!({"model": "sim-model", "messages": history, "max_tokens": 4});
    cluster.post("/v1/chat/completions", &body)
}

#[test]
fn long_conversations_follow_their_own_history_past_a_shared_head() {
    // 8 conversations share a 24 KiB head (system prompt, tool definitions)
    // and each carries 40 KiB of its own history: past the head only that
    // history tells them apart. Every turn 2 must follow its turn 1, with
    // the whole turn-1 prompt cached (not just the 4k tokens of the head).
    let cluster = start(4, base_config(), &[], vec![]);
    let head = text("shared head", 24 * 1024);
    let mut histories: Vec<Vec<Value>> = (0..8)
        .map(|c| {
            vec![
                json!({"role": "system", "content": head}),
                json!({"role": "user", "content": text(&format!("conversation {c} history"), 40 * 1024)}),
            ]
        })
        .collect();
    let send = |history: &[Value]| {
        let body = json!({"model": "sim-model", "messages": history, "max_tokens": 4});
        cluster.post("/v1/chat/completions", &body)
    };
    let first: Vec<(String, u64)> = histories
        .iter()
        .map(|history| {
            let r = send(history);
            let prompt_tokens = r.json().unwrap()["usage"]["prompt_tokens"]
                .as_u64()
                .unwrap();
            (served_by(&r), prompt_tokens)
        })
        .collect();
    cluster.wait_reports(2);
    for (c, history) in histories.iter_mut().enumerate() {
        history.push(json!({"role": "assistant", "content": "ok"}));
        history.push(json!({"role": "user", "content": "and then?"}));
        let r = send(history);
        let pod = served_by(&r);
        let cached = r.json().unwrap()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        let matched: f64 = r
            .header("x-kvroute-cache-match")
            .and_then(|v| v.parse().ok())
            .expect("x-kvroute-cache-match");
        let (turn1_pod, turn1_tokens) = &first[c];
        assert_eq!(&pod, turn1_pod, "conversation {c}'s turn 2");
        // Everything turn 1 computed but its last partial 1 KiB block.
        assert!(
            cached + 256 >= *turn1_tokens,
            "conversation {c}: {cached} of turn 1's {turn1_tokens} tokens cached"
        );
        assert!(matched > 0.95, "conversation {c}: cache match {matched}");
    }
}

/// The pod a new session sharing a 32 KiB head goes to while the head's
/// holder prefills two 48 KiB tool outputs of other sessions, and the
/// holder, under `config`.
fn new_session_while_the_holder_prefills(config: Value) -> (String, String) {
    // Time scale 0.5: each 12k-token output takes ~1.4 s to prefill, and
    // the pod prefills them one after the other.
    let cluster = start(4, config, &["--time-scale", "0.5"], vec![]);
    let head = text("coding agent head", 32 * 1024);
    let holder =
        served_by(&cluster.post("/v1/completions", &completion(&format!("{head} warm"), 1)));
    cluster.wait_reports(2);
    let listen = cluster.envoy.listen.clone();
    let long_turns: Vec<_> = (0..2)
        .map(|i| {
            let body = completion(
                &format!("{head} {}", text(&format!("tool output {i}"), 48 * 1024)),
                1,
            );
            let listen = listen.clone();
            let turn = std::thread::spawn(move || {
                http::post_json(&listen, "/v1/completions", &body.to_string()).expect("response")
            });
            std::thread::sleep(Duration::from_millis(100));
            turn
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let new_session = served_by(&cluster.post(
        "/v1/completions",
        &completion(&format!("{head} {}", text("new session task", 2 * 1024)), 1),
    ));
    for turn in long_turns {
        assert_eq!(
            served_by(&turn.join().unwrap()),
            holder,
            "the long turns follow the head"
        );
    }
    (new_session, holder)
}

#[test]
fn a_new_session_leaves_a_pod_busy_prefilling_long_turns() {
    // Waiting behind ~24.6k queued tokens plus its own 512 on the holder
    // against prefilling 8.7k on an idle pod: the prefill guard moves it.
    let (new_session, holder) = new_session_while_the_holder_prefills(base_config());
    assert_ne!(
        new_session, holder,
        "the new session waits behind the holder's prefills"
    );
    // With balance off it follows its head.
    let mut off = base_config();
    off["balance"] = json!({"enabled": false});
    let (new_session, holder) = new_session_while_the_holder_prefills(off);
    assert_eq!(
        new_session, holder,
        "without balance the head's holder keeps it"
    );
}

#[test]
fn thundering_herd_spreads_and_never_queues_past_max_queue() {
    // Slow pods (time scale 0.5, 4 concurrent) so 50 requests are all in
    // flight at once; maxQueue 20. Each asks a 1,024-token question of a
    // 2,048-token document: the prefill queued on the document's holder
    // grows by a question per request, until a pod prefilling the whole
    // prompt is clearly sooner (balance: predicted TTFT).
    let cluster = start(
        4,
        base_config(),
        &["--time-scale", "0.5", "--max-batch", "4"],
        vec![],
    );
    let prefix = text("hot document", 8 * 1024);
    let warm = cluster.post("/v1/completions", &completion(&format!("{prefix} warm"), 1));
    let hot = served_by(&warm);
    cluster.wait_reports(2);
    for sim in &cluster.sims {
        sim.reset_stats();
    }
    let listen = cluster.envoy.listen.clone();
    let handles: Vec<_> = (0..50)
        .map(|i| {
            let listen = listen.clone();
            let question = text(&format!("question {i}"), 4 * 1024);
            let body = completion(&format!("{prefix} {question}"), 48).to_string();
            std::thread::spawn(move || {
                http::post_json(&listen, "/v1/completions", &body).expect("response")
            })
        })
        .collect();
    let responses: Vec<http::Response> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(
        responses.iter().all(|r| r.status == 200),
        "every herd request is served"
    );
    let per_pod = requests_per_pod(&cluster);
    let hot_index = cluster.pod_index(&hot);
    // maxQueue bounds what waits on a pod (the sim's waiting queue, as its
    // reports count it), not what a pod serves: with 4 running beside 20
    // waiting, a pod may serve 24 of the herd and still never queue past 20.
    for (i, sim) in cluster.sims.iter().enumerate() {
        let max_queue_seen = sim.stats()["maxQueueSeen"].as_u64().unwrap();
        assert!(
            max_queue_seen <= 20,
            "pod {i} queued {max_queue_seen} > maxQueue (20): {per_pod:?}"
        );
    }
    // Affinity yields to balance: the holder keeps a share, and the spill
    // reaches every other pod. Within maxQueue a burst may leave a holder
    // 1.6x its fair share: every pod is busy at every arrival (busy share
    // near 1), so copying the document elsewhere counts as delaying all
    // that is queued there (native's faster decisions show it more often
    // than wasm's; see integration/results/costmodel.md, max pod share).
    assert!(
        per_pod[hot_index] >= 5,
        "hot pod took only {} of 50: {per_pod:?}",
        per_pod[hot_index]
    );
    let others: Vec<u64> = per_pod
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != hot_index)
        .map(|(_, n)| *n)
        .collect();
    assert!(
        others.iter().all(|&n| n > 0),
        "spill must reach every other pod: {per_pod:?}"
    );
    // The spilled requests warmed the others: the prefix is cached there now.
    for (i, sim) in cluster
        .sims
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != hot_index)
    {
        assert!(
            sim.stats()["kvBlocks"].as_u64().unwrap() > 0,
            "pod {i} not warmed"
        );
    }
}

#[test]
fn unhealthy_pod_gets_nothing_and_degraded_pod_loses_ties() {
    let cluster = start(4, base_config(), &[], vec![]);
    cluster.sims[0].fault(json!({"health": 0.2}));
    cluster.sims[1].fault(json!({"health": 0.7}));
    cluster.wait_reports(3);
    for i in 0..24 {
        let r = cluster.post(
            "/v1/completions",
            &completion(&text(&format!("cold {i}"), 512), 2),
        );
        served_by(&r);
    }
    let per_pod = requests_per_pod(&cluster);
    assert_eq!(per_pod[0], 0, "pod at health 0.2 is excluded: {per_pod:?}");
    assert_eq!(
        per_pod[1], 0,
        "pod at health 0.7 loses every tie: {per_pod:?}"
    );
    assert!(
        per_pod[2] > 0 && per_pod[3] > 0,
        "ties spread over the healthy pods: {per_pod:?}"
    );
    assert_eq!(
        cluster
            .envoy
            .metric("epp_pod_health_score", &[("pod", "pod-0")]),
        Some(20.0)
    );
}

#[test]
fn adapter_affinity_breaks_ties() {
    let cluster = start(
        4,
        base_config(),
        &[],
        vec![
            vec![],
            vec![],
            vec!["--preload-adapters", "billing-lora"],
            vec![],
        ],
    );
    cluster.wait_reports(2);
    for i in 0..6 {
        let body = json!({"model": "support-billing", "prompt": text(&format!("invoice {i}"), 512), "max_tokens": 2});
        let r = cluster.post("/v1/completions", &body);
        assert_eq!(served_by(&r), "pod-2", "request {i}");
    }
    assert_eq!(
        cluster.sims[2].stats()["adapterLoads"].as_u64(),
        Some(0),
        "no adapter load was needed"
    );
    assert_eq!(
        cluster.envoy.metric(
            "epp_adapter_loads_triggered_total",
            &[("adapter", "billing-lora")]
        ),
        Some(0.0),
        "no load was triggered (the counter is exported from zero)"
    );
}

#[test]
fn cold_start_goes_to_the_least_loaded_pod() {
    let cluster = start(4, base_config(), &[], vec![]);
    for (i, load) in [0.9, 0.5, 0.2, 0.7].iter().enumerate() {
        cluster.sims[i].fault(json!({"gpuUtilization": load}));
    }
    cluster.wait_reports(2);
    let r = cluster.post("/v1/completions", &completion(&text("never seen", 1024), 2));
    assert_eq!(served_by(&r), "pod-2");
}

/// Where a prompt cached nowhere goes while the least loaded pod by its
/// reports (pod-0, 20 % against 60 %) prefills a 12k-token request, under
/// `config`.
fn cold_prompt_while_the_least_loaded_pod_prefills(config: Value) -> String {
    // Time scale 0.5: the long prompt takes ~1.4 s to prefill.
    let cluster = start(2, config, &["--time-scale", "0.5"], vec![]);
    let probe = completion(&text("short question", 2 * 1024), 1);
    while_the_least_loaded_pod_prefills(&cluster, [0.2, 0.6], &probe)
}

/// Which pod serves `probe` sent while the less loaded of two pods, as
/// `loads` are reported, prefills a 12k-token request (~1.4 s at time
/// scale 0.5).
fn while_the_least_loaded_pod_prefills(
    cluster: &Cluster,
    loads: [f64; 2],
    probe: &Value,
) -> String {
    for (sim, load) in cluster.sims.iter().zip(loads) {
        sim.fault(json!({ "gpuUtilization": load }));
    }
    cluster.wait_reports(2);
    let listen = cluster.envoy.listen.clone();
    let long = completion(&text("long document", 48 * 1024), 1);
    let long = std::thread::spawn(move || {
        http::post_json(&listen, "/v1/completions", &long.to_string()).expect("response")
    });
    std::thread::sleep(Duration::from_millis(300));
    let served = served_by(&cluster.post("/v1/completions", probe));
    let least_loaded = if loads[0] < loads[1] {
        "pod-0"
    } else {
        "pod-1"
    };
    assert_eq!(
        served_by(&long.join().unwrap()),
        least_loaded,
        "the long prompt went to the least loaded pod"
    );
    served
}

#[test]
fn a_prompt_cached_nowhere_goes_where_it_is_answered_soonest() {
    // Behind ~12k queued tokens on pod-0 against its own 512 on an idle
    // pod-1: pod-0 is outpaced, whatever its reported load.
    let cold = cold_prompt_while_the_least_loaded_pod_prefills(base_config());
    assert_eq!(cold, "pod-1", "it waits behind the long prefill");
    // With balance off the five factors alone pick the least loaded pod.
    let mut off = base_config();
    off["balance"] = json!({"enabled": false});
    let cold = cold_prompt_while_the_least_loaded_pod_prefills(off);
    assert_eq!(cold, "pod-0", "without balance the reported load decides");
}

/// Two pods at time scale 0.5 behind one Envoy worker: what a worker
/// learns of continuing sessions is its own.
fn one_worker_pair() -> Cluster {
    let mut spec = ClusterSpec::new(2, base_config());
    spec.sim_args = vec!["--time-scale".into(), "0.5".into()];
    spec.envoy_workers = 1;
    Cluster::start(SIM.as_ref(), spec).expect("cluster starts")
}

/// Where a session start from a system prompt both pods hold goes while
/// pod-1, reporting the lower load, prefills a long prompt and pod-0
/// (load 0.6) idles; `later_turn` first shows the prompt's sessions
/// continue.
fn session_start_while_the_less_loaded_holder_prefills(later_turn: bool) -> String {
    let cluster = one_worker_pair();
    let system = text("shared system prompt", 4 * 1024);
    // Both pods hold it, as after spread's copies.
    for sim in &cluster.sims {
        http::post_json(
            &sim.address,
            "/v1/completions",
            &completion(&system, 1).to_string(),
        )
        .expect("warm");
    }
    cluster.wait_reports(2);
    let task = |name: &str| format!("{system} {}", text(name, 512));
    // Two sessions start from it: a branch point.
    cluster.post("/v1/completions", &completion(&task("task one"), 1));
    cluster.post("/v1/completions", &completion(&task("task two"), 1));
    if later_turn {
        cluster.wait_reports(2);
        let next = format!("{} {}", task("task one"), text("tool output", 512));
        cluster.post("/v1/completions", &completion(&next, 1));
    }
    let probe = completion(&task("task three"), 1);
    while_the_least_loaded_pod_prefills(&cluster, [0.6, 0.1], &probe)
}

#[test]
fn a_session_start_goes_to_the_holder_that_carries_less_once_sessions_continue() {
    // No later turn seen: this one request decides, and pod-0 answers it
    // at once while pod-1 prefills ~12k tokens.
    let start = session_start_while_the_less_loaded_holder_prefills(false);
    assert_eq!(start, "pod-0", "by this request's predicted TTFT");
    // The prompt's sessions continue: both holders keep their cache term
    // and the reported load decides where the session will live.
    let start = session_start_while_the_less_loaded_holder_prefills(true);
    assert_eq!(start, "pod-1", "by what each holder carries");
}

/// Where a third session start from a system prompt only pod-0 holds goes
/// while pod-0 streams the answers of `carried` of its sessions' later
/// turns and pod-1 carries none.
fn session_start_while_the_holder_carries(carried: usize) -> String {
    let cluster = one_worker_pair();
    let system = text("shared system prompt", 4 * 1024);
    http::post_json(
        &cluster.sims[0].address,
        "/v1/completions",
        &completion(&system, 1).to_string(),
    )
    .expect("warm pod-0");
    cluster.wait_reports(2);
    // Other traffic: the prompt starts a small share of the sessions, so
    // its one holder is as many as the share asks for.
    for other in 0..6 {
        cluster.post(
            "/v1/completions",
            &completion(&text(&format!("other {other}"), 512), 1),
        );
    }
    let task = |name: &str| format!("{system} {}", text(name, 512));
    // Two sessions start from it (a branch point) and continue.
    let sessions = ["task one", "task two"].map(task);
    for session in &sessions {
        assert_eq!(
            served_by(&cluster.post("/v1/completions", &completion(session, 1))),
            "pod-0"
        );
    }
    cluster.wait_reports(2);
    // Their next turns, answered slowly (100 tokens, 1 s at this scale).
    let streaming: Vec<_> = sessions
        .iter()
        .take(carried)
        .map(|session| {
            let (listen, body) = (
                cluster.envoy.listen.clone(),
                completion(&format!("{session} {}", text("tool output", 512)), 100),
            );
            std::thread::spawn(move || {
                http::post_json(&listen, "/v1/completions", &body.to_string()).expect("turn 2")
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let probe = cluster.post("/v1/completions", &completion(&task("task three"), 1));
    for turn in streaming {
        assert_eq!(
            served_by(&turn.join().unwrap()),
            "pod-0",
            "a later turn follows its history"
        );
    }
    served_by(&probe)
}

#[test]
fn a_session_start_goes_where_fewer_sessions_are_carried() {
    // One session more on the holder: the start keeps its cache there.
    assert_eq!(session_start_while_the_holder_carries(1), "pod-0");
    // Two more: pod-1, even with this one, carries fewer than pod-0 does.
    assert_eq!(session_start_while_the_holder_carries(2), "pod-1");
}

/// A copy of a hot prompt is bought for the requests that will follow it,
/// so it goes to the pod that carried fewer streams over recent arrivals,
/// not to the one whose report reads the lowest load at that instant.
/// Measured in the LoRA workload: by the report, the top tenant was copied
/// onto the pod already serving the second and fifth (1.4× fair).
#[test]
fn a_copy_goes_where_fewer_streams_were_carried_not_where_one_report_reads_least() {
    // Three pods at time scale 0.5 (100 answer tokens: ~1 s), one worker.
    let mut spec = ClusterSpec::new(3, base_config());
    spec.sim_args = vec!["--time-scale".into(), "0.5".into()];
    spec.envoy_workers = 1;
    let cluster = Cluster::start(SIM.as_ref(), spec).expect("cluster starts");
    let system = text("hot system prompt", 4 * 1024);
    warm_directly(&cluster, 0, &system);
    // pod-1 reports the least load throughout.
    for (sim, load) in cluster.sims.iter().zip([0.5, 0.1, 0.5]) {
        sim.fault(json!({ "gpuUtilization": load }));
    }
    cluster.wait_reports(2);
    let streaming = |prompt: String| {
        let (listen, body) = (
            cluster.envoy.listen.clone(),
            json!({"model": "sim-model", "prompt": prompt, "max_tokens": 100, "stream": true}),
        );
        std::thread::spawn(move || {
            http::post_sse(&listen, "/v1/completions", &body.to_string()).expect("answer")
        })
    };
    // Two prompts cached nowhere go to pod-1 by its load, and stream there.
    let mut open = Vec::new();
    for other in ["other one", "other two"] {
        open.push(("pod-1", streaming(text(other, 512))));
        std::thread::sleep(Duration::from_millis(150));
    }
    // Three sessions start from the prompt on its holder, and stream: the
    // holder carries more than its share, and the fourth start asks for a
    // second holder (the prompt's starts counted from the second: 3 of 5
    // starts, a share of 3 / (5 + 3 pods) × 3 pods > 1 holder).
    let session = |name: &str| format!("{system} {}", text(name, 512));
    for name in ["task one", "task two", "task three"] {
        open.push(("pod-0", streaming(session(name))));
        std::thread::sleep(Duration::from_millis(150));
    }
    let copy = cluster.post("/v1/completions", &completion(&session("task four"), 1));
    for (pod, answer) in open {
        let answer = answer.join().unwrap();
        assert_eq!(answer.status, 200);
        assert_eq!(
            answer.header("x-sim-pod"),
            Some(pod),
            "where the setup went"
        );
    }
    assert_eq!(
        cluster.envoy.metric("epp_prefix_spread_total", &[]),
        Some(1.0),
        "one copy bought"
    );
    // pod-1 reports less load, but carried two streams; pod-2 none.
    assert_eq!(served_by(&copy), "pod-2");
}

/// The design's case A (80 % utilisation, 0 queued) vs B (40 %, 10 queued).
/// With the default weights the formula prefers B (load+queue terms 0.17 vs
/// 0.14, see tests/scoring.rs); an operator who wants queue to dominate
/// raises its weight, and then A wins. This test runs that configuration.
#[test]
fn queue_beats_utilization_when_queue_weight_dominates() {
    let mut config = base_config();
    config["weights"] =
        json!({"cache": 0.6, "load": 0.1, "queue": 0.2, "health": 0.05, "adapter": 0.05});
    let cluster = start(4, config, &[], vec![]);
    cluster.sims[0].fault(json!({"gpuUtilization": 0.8, "queueDepth": 0}));
    cluster.sims[1].fault(json!({"gpuUtilization": 0.4, "queueDepth": 10}));
    cluster.sims[2].fault(json!({"gpuUtilization": 0.9, "queueDepth": 15}));
    cluster.sims[3].fault(json!({"gpuUtilization": 0.9, "queueDepth": 15}));
    cluster.wait_reports(2);
    let r = cluster.post("/v1/completions", &completion(&text("fresh", 512), 2));
    assert_eq!(served_by(&r), "pod-0");
}

#[test]
fn pod_crash_mid_stream() {
    let cluster = start(4, base_config(), &["--time-scale", "0.2"], vec![]);
    let prompt = text("streamed story", 4096);
    let warm = cluster.post("/v1/completions", &completion(&prompt, 1));
    let victim = served_by(&warm);
    cluster.wait_reports(2);
    let victim_index = cluster.pod_index(&victim);
    let listen = cluster.envoy.listen.clone();
    let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 400, "stream": true})
        .to_string();
    let stream = std::thread::spawn(move || {
        http::post_sse(&listen, "/v1/completions", &body).expect("stream starts")
    });
    std::thread::sleep(Duration::from_millis(300));
    let _ = http::post_json(
        &cluster.sims[victim_index].address,
        "/admin/fault",
        r#"{"crash": true}"#,
    );
    let broken = stream.join().unwrap();
    assert_eq!(broken.header("x-kvroute-pod"), Some(victim.as_str()));
    assert!(!broken.done, "the client must not see a complete stream");
    assert!(
        !broken.events.is_empty(),
        "some events arrived before the crash"
    );
    // Once the missed reports decay its health, traffic goes elsewhere.
    std::thread::sleep(Duration::from_millis(2000));
    for i in 0..5 {
        let r = cluster.post(
            "/v1/completions",
            &completion(&format!("{prompt} again {i}"), 2),
        );
        assert_ne!(served_by(&r), victim, "request {i} went to the crashed pod");
    }
    let ready = http::get(&cluster.envoy.admin, "/ready")
        .map(|r| r.status)
        .ok();
    assert_eq!(ready, Some(200), "Envoy stays up");
}

#[test]
fn failing_reports_decay_health_and_recover() {
    let cluster = start(4, base_config(), &[], vec![]);
    let prefix = text("pinned", 8192);
    let r = cluster.post("/v1/completions", &completion(&format!("{prefix} 0"), 1));
    let pinned = served_by(&r);
    let index = cluster.pod_index(&pinned);
    cluster.wait_reports(2);
    for mode in ["error", "garbage", "slow"] {
        cluster.sims[index].fault(json!({"report": mode}));
        std::thread::sleep(Duration::from_millis(2500));
        let r = cluster.post(
            "/v1/completions",
            &completion(&format!("{prefix} during {mode}"), 1),
        );
        assert_ne!(
            served_by(&r),
            pinned,
            "report {mode}: traffic must move off the stale pod"
        );
        cluster.sims[index].fault(json!({"report": "ok"}));
        // `slow` answers after 5 s: wait for a fresh report to land.
        let deadline = Instant::now() + Duration::from_secs(8);
        loop {
            let r = cluster.post(
                "/v1/completions",
                &completion(&format!("{prefix} after {mode}"), 1),
            );
            if served_by(&r) == pinned {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "report {mode}: pod never recovered"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let failures = cluster
        .envoy
        .metric("epp_report_failures_total", &[("pod", pinned.as_str())]);
    assert!(
        failures.unwrap_or(0.0) >= 3.0,
        "failures counted: {failures:?}"
    );
    let log = cluster.envoy.log();
    let failing_lines = log.matches("pod_report_failing").count();
    assert!(
        (3..=6).contains(&failing_lines),
        "logged once per state change, got {failing_lines}"
    );
}

#[test]
fn unreported_eviction_counts_as_stale_routing() {
    // Every answer checked (the default samples one in eight).
    let mut config = base_config();
    config["predictionCheckSample"] = json!(1);
    let cluster = start(4, config, &[], vec![]);
    let checked = |cluster: &Cluster| {
        cluster
            .envoy
            .metric("epp_cache_predictions_checked_total", &[])
            .unwrap_or(0.0)
    };
    let prefix = text("evicted", 8192);
    let r = cluster.post("/v1/completions", &completion(&format!("{prefix} 0"), 1));
    let holder = served_by(&r);
    cluster.wait_reports(2);
    cluster.sims[cluster.pod_index(&holder)].fault(json!({"evictAll": true, "silent": true}));
    let before = cluster
        .envoy
        .metric("epp_stale_cache_routing_total", &[])
        .unwrap_or(0.0);
    let checked_before = checked(&cluster);
    let r = cluster.post("/v1/completions", &completion(&format!("{prefix} 1"), 1));
    assert_eq!(
        served_by(&r),
        holder,
        "the router still believes the pod holds the prefix"
    );
    assert_eq!(cached_tokens(&r), 0);
    let after = cluster
        .envoy
        .metric("epp_stale_cache_routing_total", &[])
        .unwrap_or(0.0);
    assert_eq!(after, before + 1.0);
    assert_eq!(checked(&cluster), checked_before + 1.0);
}

fn refused(config: Value) -> String {
    let dir = std::env::temp_dir().join(format!("kvroute-refuse-{}", free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    let (listen, admin) = (free_port(), free_port());
    let yaml = render_envoy_config(
        kvroute_module(),
        listen,
        admin,
        &config,
        &["127.0.0.1:9".to_string()],
    );
    let error = Envoy::start(&dir, &yaml, listen, admin)
        .err()
        .expect("Envoy must refuse the configuration");
    let _ = std::fs::remove_dir_all(&dir);
    error.to_string()
}

#[test]
fn invalid_plugin_configuration_is_refused_naming_the_field() {
    let pods = json!([{"id": "a", "address": "127.0.0.1:9"}]);
    let log = refused(
        json!({"pods": pods, "weights": {"cache": 0.8, "load": 0.2, "queue": 0.1, "health": 0.05, "adapter": 0.05}}),
    );
    assert!(log.contains("`weights` must sum to 1.0"), "{log}");
    assert!(log.contains("1.200000"), "{log}");
    let log = refused(json!({"pods": pods, "cachWeight": 0.5}));
    assert!(log.contains("cachWeight"), "{log}");
}

#[test]
fn malformed_bodies_get_defined_answers() {
    let mut config = base_config();
    config["onBadRequest"] = json!("reject");
    config["maxBodyBytes"] = json!(1 << 20);
    let cluster = start(2, config, &[], vec![]);
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"{not json".to_vec(), "not valid JSON"),
        (vec![0xff, 0x00, 0x13, 0x37, 0x80], "not valid JSON"),
        (Vec::new(), "empty"),
        (br#"{"model":"sim-model"}"#.to_vec(), "`prompt` is missing"),
        (
            br#"{"model":"sim-model","prompt":{"a":1}}"#.to_vec(),
            "`prompt` must be",
        ),
        (
            format!(
                r#"{{"model":"sim-model","prompt":"{}"}}"#,
                "x".repeat(2 << 20)
            )
            .into_bytes(),
            "exceeds maxBodyBytes",
        ),
    ];
    for (body, expected) in cases {
        let r = http::request(
            &cluster.envoy.listen,
            "POST",
            "/v1/completions",
            &[("content-type", "application/json")],
            Some(&body),
            Duration::from_secs(30),
        )
        .expect("answer");
        assert_eq!(r.status, 400, "{expected}: {}", r.body);
        let message = r.json().expect("OpenAI-style JSON error")["error"]["message"]
            .as_str()
            .unwrap_or("")
            .to_string();
        assert!(
            message.contains(expected),
            "expected {expected:?} in {message:?}"
        );
    }
    // onUnknownModel defaults to "route": the pod answers for itself.
    let unknown = cluster.post("/v1/completions", &json!({"model": "nope", "prompt": "hi"}));
    assert_eq!(unknown.status, 404, "{}", unknown.body);
    assert!(
        unknown.header("x-sim-pod").is_some(),
        "routed by load to a pod"
    );
    let r = cluster.post("/v1/completions", &completion("all good after that", 2));
    served_by(&r);
    assert_eq!(
        requests_per_pod(&cluster).iter().sum::<u64>(),
        2,
        "rejected bodies never reached a pod"
    );
}

#[test]
fn streamed_response_arrives_incrementally() {
    let cluster = start(2, base_config(), &["--time-scale", "0.25"], vec![]);
    let body = json!({"model": "sim-model", "prompt": text("stream", 1024), "max_tokens": 60, "stream": true,
                      "stream_options": {"include_usage": true}});
    let r = http::post_sse(&cluster.envoy.listen, "/v1/completions", &body.to_string())
        .expect("stream");
    assert_eq!(r.status, 200);
    assert!(r.done, "stream ends with [DONE]");
    let first = r.events.first().unwrap().at - r.sent;
    let last = r.events.last().unwrap().at - r.sent;
    assert!(r.events.len() >= 60, "{} events", r.events.len());
    assert!(
        first * 3 < last,
        "first event at {first:?}, last at {last:?}: the stream was buffered"
    );
}

#[test]
fn approximate_mode_follows_its_own_decisions_without_reports() {
    let mut config = base_config();
    config["mode"] = json!("approximate");
    let cluster = start(4, config, &[], vec![]);
    let prefix = text("approximate", 8192);
    let first = cluster.post("/v1/completions", &completion(&format!("{prefix} 0"), 1));
    let chosen = served_by(&first);
    // The decision travels worker → shared queue → service → snapshot.
    cluster.wait_reports(2);
    for i in 1..=8 {
        let r = cluster.post("/v1/completions", &completion(&format!("{prefix} {i}"), 1));
        assert_eq!(served_by(&r), chosen, "request {i}");
        assert!(cached_tokens(&r) > 0);
    }
    let reports: u64 = cluster
        .sims
        .iter()
        .map(|s| s.stats()["reportRequests"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(reports, 0, "approximate mode pulls no reports");
}

#[test]
fn no_eligible_pod_answers_503_with_retry_after() {
    // At once under "reject"; the default "wait" is tested in waiting.rs.
    let mut config = base_config();
    config["onNoEligiblePod"] = json!("reject");
    let cluster = start(2, config, &[], vec![]);
    for sim in &cluster.sims {
        sim.fault(json!({"health": 0.1}));
    }
    cluster.wait_reports(3);
    let r = cluster.post("/v1/completions", &completion("anyone?", 2));
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.header("retry-after"), Some("1"));
    let error = &r.json().expect("OpenAI-style error")["error"];
    assert_eq!(error["type"], "ServiceUnavailableError");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("pod-0 health 0.10 below threshold"),
        "{error}"
    );
    assert_eq!(requests_per_pod(&cluster), vec![0, 0]);
    assert_eq!(
        cluster
            .envoy
            .metric("epp_requests_rejected_total", &[("status", "503")]),
        Some(1.0)
    );
}

#[test]
fn vllm_metrics_supply_load_when_pods_send_no_reports() {
    let mut config = base_config();
    config["mode"] = json!("approximate");
    config["metricsPath"] = json!("/metrics");
    let cluster = start(4, config, &[], vec![]);
    for (i, load) in [0.7, 0.9, 0.6, 0.2].iter().enumerate() {
        cluster.sims[i].fault(json!({"gpuUtilization": load, "queueDepth": 1}));
    }
    cluster.wait_reports(3);
    let r = cluster.post(
        "/v1/completions",
        &completion(&text("cold metrics", 512), 2),
    );
    assert_eq!(
        served_by(&r),
        "pod-3",
        "least loaded by vllm:kv_cache_usage_perc"
    );
    assert_eq!(
        cluster.envoy.metric("epp_pod_load", &[("pod", "pod-1")]),
        Some(90.0)
    );
    assert_eq!(
        cluster.envoy.metric("epp_queue_depth", &[("pod", "pod-1")]),
        Some(1.0)
    );
}

/// A one-route HTTP server answering every request with the current
/// `body` (JSON), for 30 s.
fn serve_json(body: Arc<std::sync::Mutex<String>>) -> String {
    use std::io::{Read, Write};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            match listener.accept() {
                Ok((mut stream, _)) => {
                    stream.set_nonblocking(false).unwrap();
                    let mut request = [0u8; 4096];
                    let _ = stream.read(&mut request);
                    let body = body.lock().unwrap().clone();
                    let _ = write!(
                        stream,
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    });
    address
}

#[test]
fn discovery_replaces_the_static_pod_list() {
    let pod_list = Arc::new(std::sync::Mutex::new(String::from("not yet")));
    let server = serve_json(pod_list.clone());
    let mut config = base_config();
    // Reached through the reports' ORIGINAL_DST cluster.
    config["discovery"] =
        json!({"cluster": "kvroute_reports", "path": "/pods", "authority": server});
    let cluster = start(4, config, &[], vec![]);
    // Until discovery answers with a valid list the static pods stay.
    let kept: Vec<Value> = cluster.sims[2..]
        .iter()
        .map(|s| json!({"id": s.id, "address": s.address}))
        .collect();
    *pod_list.lock().unwrap() = json!({ "pods": kept }).to_string();
    cluster.wait_reports(3);
    for i in 0..12 {
        let r = cluster.post(
            "/v1/completions",
            &completion(&text(&format!("discovered {i}"), 512), 2),
        );
        let pod = served_by(&r);
        assert!(
            pod == "pod-2" || pod == "pod-3",
            "request {i} went to {pod}, which discovery removed"
        );
    }
    let per_pod = requests_per_pod(&cluster);
    assert!(per_pod[2] > 0 && per_pod[3] > 0, "{per_pod:?}");
}

/// Clients cannot create metric series: model names outside `models` are
/// counted as `other`, unparseable bodies as `invalid`.
#[test]
fn random_model_names_do_not_grow_the_stats() {
    let cluster = start(2, base_config(), &[], vec![]);
    let series = |cluster: &Cluster| {
        cluster
            .envoy
            .prometheus()
            .lines()
            .filter(|l| l.starts_with("epp_") && !l.contains("_bucket{"))
            .count()
    };
    // One of each kind first, so their series exist.
    cluster.post(
        "/v1/completions",
        &json!({"model": "warm-up", "prompt": "hi", "max_tokens": 1}),
    );
    let bad = http::post_json(&cluster.envoy.listen, "/v1/completions", "not json").unwrap();
    // Routed by load (the default), so the pod itself answers its 400.
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert!(
        bad.header("x-sim-pod").is_some(),
        "the bad body reached a pod"
    );
    std::thread::sleep(Duration::from_millis(1200)); // a stats flush
    let before = series(&cluster);
    let listen = cluster.envoy.listen.clone();
    const CLIENTS: usize = 8;
    const NAMES_PER_CLIENT: usize = 1250;
    let handles: Vec<_> = (0..CLIENTS)
        .map(|t| {
            let listen = listen.clone();
            std::thread::spawn(move || {
                for i in 0..NAMES_PER_CLIENT {
                    let model = format!("random {t}-{i} {:x}", (t * 7919 + i) as u64 * 104_729);
                    let body = json!({"model": model, "prompt": "hi", "max_tokens": 1});
                    let r = http::post_json(&listen, "/v1/completions", &body.to_string()).unwrap();
                    // Routed by load; the pod does not serve that model.
                    assert_eq!(r.status, 404, "{}", r.body);
                    assert!(r.header("x-sim-pod").is_some(), "{}", r.body);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    std::thread::sleep(Duration::from_millis(1200));
    let names = CLIENTS * NAMES_PER_CLIENT;
    assert_eq!(
        series(&cluster),
        before,
        "{names} random model names added series"
    );
    assert_eq!(
        cluster
            .envoy
            .metric("epp_routing_decisions_total", &[("model", "other")]),
        Some(names as f64 + 1.0)
    );
    assert_eq!(
        cluster
            .envoy
            .metric("epp_routing_decisions_total", &[("model", "invalid")]),
        Some(1.0)
    );
}

/// A graceful stop (SIGTERM, as Kubernetes stops a pod's containers) while
/// the service holds a long-poll report call on every pod: Envoy cancels
/// the calls as it shuts down (its own 503, "connection termination"),
/// which says nothing about the pods. No `pod_report_failing` in the log;
/// one `service_stopping` line instead, logged as the module is torn down
/// (after Envoy closed its log file: on stderr).
#[test]
fn a_graceful_stop_blames_no_pod() {
    let mut cluster = start(3, base_config(), &[], vec![]);
    cluster.wait_reports(2);
    let status = cluster.envoy.terminate().expect("envoy stops");
    let log = cluster.envoy.log();
    assert!(status.success(), "envoy exited with {status}:\n{log}");
    assert!(!log.contains("pod_report_failing"), "{log}");
    let stopping: Vec<_> = log
        .lines()
        .filter_map(log_event)
        .filter(|event| event["event"] == "service_stopping")
        .collect();
    assert_eq!(stopping.len(), 1, "{log}");
    // A long poll per pod (one may be between its answer and the next).
    let calls = stopping[0]["callsInFlight"].as_u64();
    assert!(calls.is_some_and(|n| (1..=3).contains(&n)), "{log}");
}
