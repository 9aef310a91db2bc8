//! Starts the real `kvroute-sim` binary and talks to it over TCP.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvroute::cluster::ClusterState;
use kvroute::config::Config;
use kvroute::hashing::BlockHasher;
use kvroute::index::PrefixLookup;
use kvroute::report::{parse_report, Tier};
use kvroute::request::parse_request;
use kvroute::router::Router;
use kvroute_integration::http::{self, get, post_json, post_sse};

struct Sim {
    child: Child,
    addr: String,
}

impl Sim {
    fn start(args: &[&str]) -> Sim {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-sim"))
            .args(["--port", "0"])
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("kvroute-sim starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("startup line");
        let addr = line
            .trim()
            .rsplit(' ')
            .next()
            .expect("address in the startup line")
            .to_string();
        assert!(line.starts_with("kvroute-sim "), "{line:?}");
        Sim { child, addr }
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const CONFIG: &str = r#"{
    "pods": [{"id": "sim-a", "address": "127.0.0.1:1"}],
    "models": {"m": {"baseModel": "base"}, "m-lora": {"baseModel": "base", "adapter": "billing"}}
}"#;

#[test]
fn sim_serves_caches_streams_and_reports() {
    let config_path =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvroute-sim-test-config.json");
    std::fs::write(&config_path, CONFIG).unwrap();
    let sim = Sim::start(&[
        "--pod-id",
        "sim-a",
        "--time-scale",
        "0.05",
        "--config",
        config_path.to_str().unwrap(),
        "--kv-blocks",
        "1000",
    ]);
    let addr = sim.addr.as_str();
    let config = Config::parse(CONFIG.as_bytes()).unwrap();
    let mut cluster = ClusterState::new(&config, 0);

    let health = get(addr, "/health").unwrap();
    assert_eq!(health.status, 200);
    assert_eq!(health.header("x-sim-pod"), Some("sim-a"));
    let models = get(addr, "/v1/models").unwrap().json().unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["m", "m-lora"]);

    // Empty full report to start with.
    let first = get(addr, "/kvroute/v1/report?since=0").unwrap();
    let r = parse_report(first.body.as_bytes()).unwrap();
    assert!(r.full && r.stored.is_empty());
    assert_eq!((r.pod_id.as_str(), r.seq), ("sim-a", 0));
    cluster
        .apply_report("sim-a", first.body.as_bytes(), 0, 0)
        .0
        .unwrap();
    let epoch = r.epoch.clone();

    // Two identical completions: the second hits the cache.
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(30); // 1350 bytes
    let body = format!(r#"{{"model":"m","prompt":"{prompt}","max_tokens":4}}"#);
    let a = post_json(addr, "/v1/completions", &body).unwrap();
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.header("x-sim-pod"), Some("sim-a"));
    let a = a.json().unwrap();
    assert_eq!(a["object"], "text_completion");
    assert_eq!(a["choices"][0]["text"], " tok0 tok1 tok2 tok3");
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    assert_eq!(a["usage"]["prompt_tokens"], 1350 / 4);
    assert_eq!(a["usage"]["completion_tokens"], 4);
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let b = post_json(addr, "/v1/completions", &body)
        .unwrap()
        .json()
        .unwrap();
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, (1350 / 64) * 16, "{b}");

    // since=0 is always a full report; it carries the prompt's blocks.
    let chain = BlockHasher::from_config(&config).chain(
        &config.resolve_model("m").unwrap(),
        &parse_request(body.as_bytes(), false).unwrap().prompt,
        None,
    );
    assert_eq!(chain.len(), 1350 / 64);
    let query = cluster.report_query("sim-a", "/kvroute/v1/report").unwrap();
    assert_eq!(query, format!("/kvroute/v1/report?since=0&epoch={epoch}"));
    let full = get(addr, &query).unwrap();
    let r = parse_report(full.body.as_bytes()).unwrap();
    assert!(
        r.full && r.since == 0 && r.seq == chain.len() as u64,
        "{}",
        full.body
    );
    cluster
        .apply_report("sim-a", full.body.as_bytes(), 1, 0)
        .0
        .unwrap();
    assert_eq!(
        cluster.index().lookup(&chain).blocks(0) as usize,
        chain.len()
    );

    // A prompt sharing the first 10 blocks: the delta carries only its new
    // blocks, continuing the shared prefix.
    let prompt2 = format!(
        "{}{}",
        &prompt[..640],
        "Pack my box with five dozen liquor jugs. ".repeat(20)
    );
    let body2 = format!(r#"{{"model":"m","prompt":"{prompt2}","max_tokens":1}}"#);
    let c = post_json(addr, "/v1/completions", &body2)
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(c["usage"]["prompt_tokens_details"]["cached_tokens"], 160);
    let chain2 = BlockHasher::from_config(&config).chain(
        &config.resolve_model("m").unwrap(),
        &parse_request(body2.as_bytes(), false).unwrap().prompt,
        None,
    );
    let query = cluster.report_query("sim-a", "/kvroute/v1/report").unwrap();
    let delta = get(addr, &query).unwrap();
    let r = parse_report(delta.body.as_bytes()).unwrap();
    assert!(!r.full, "{query} → {}", delta.body);
    assert_eq!(r.since, chain.len() as u64);
    assert_eq!(r.stored.len(), 1);
    assert_eq!(r.stored[0].parent, Some(chain[9]));
    assert_eq!(r.stored[0].hashes, chain2[10..]);
    let (summary, _) = cluster.apply_report("sim-a", delta.body.as_bytes(), 1, 0);
    assert!(!summary.unwrap().resync);
    assert_eq!(
        cluster.index().lookup(&chain2).blocks(0) as usize,
        chain2.len()
    );
    assert_eq!(
        cluster.index().lookup(&chain).blocks(0) as usize,
        chain.len()
    );
    // Nothing new: an empty delta.
    let query = cluster.report_query("sim-a", "/kvroute/v1/report").unwrap();
    let r = parse_report(get(addr, &query).unwrap().body.as_bytes()).unwrap();
    assert!(!r.full && r.stored.is_empty() && r.removed.is_empty());
    assert_eq!(r.health, 1.0);

    // Streaming chat with usage: role chunk, one chunk per token, usage, [DONE].
    let chat = r#"{"model":"m","messages":[{"role":"user","content":"hello there, how are you doing today? tell me a story please"}],
        "max_tokens":6,"stream":true,"stream_options":{"include_usage":true}}"#;
    let s = post_sse(addr, "/v1/chat/completions", chat).unwrap();
    assert_eq!(s.status, 200);
    assert!(s
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    assert!(s.done && s.error.is_none(), "{s:?}");
    assert_eq!(s.events.len(), 1 + 6 + 1 + 1, "{:?}", s.events);
    let chunks: Vec<serde_json::Value> = s.events.iter().filter_map(|e| e.json()).collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks[1..7]
        .iter()
        .map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(text, " tok0 tok1 tok2 tok3 tok4 tok5");
    assert_eq!(chunks[6]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[7]["choices"].as_array().unwrap().len(), 0);
    assert_eq!(chunks[7]["usage"]["completion_tokens"], 6);
    assert_eq!(s.events.last().unwrap().data, "[DONE]");
    // Tokens are paced (1 ms each at time scale 0.05): the sixth cannot
    // arrive before five decode steps after the request — a lower bound the
    // client's reads cannot break, however they coalesce chunks.
    assert!(s.events[6].at - s.sent >= Duration::from_millis(5));

    // Streaming completions without usage.
    let s = post_sse(
        addr,
        "/v1/completions",
        r#"{"model":"m","prompt":"abc","max_tokens":3,"stream":true}"#,
    )
    .unwrap();
    assert!(s.done);
    assert_eq!(s.events.len(), 4);
    assert_eq!(s.events[0].json().unwrap()["choices"][0]["text"], " tok0");

    // Errors: unknown model, bad body, injected failure.
    let e = post_json(addr, "/v1/completions", r#"{"model":"nope","prompt":"x"}"#).unwrap();
    assert_eq!(e.status, 404);
    assert_eq!(e.json().unwrap()["error"]["type"], "NotFoundError");
    let e = post_json(addr, "/v1/completions", r#"{"model":"m"}"#).unwrap();
    assert_eq!(e.status, 400);
    assert!(e.body.contains("prompt"));
    post_json(addr, "/admin/fault", r#"{"errorRate":1.0}"#).unwrap();
    assert_eq!(
        post_json(addr, "/v1/completions", &body).unwrap().status,
        500
    );
    post_json(addr, "/admin/fault", r#"{"errorRate":0.0}"#).unwrap();
    assert_eq!(
        post_json(addr, "/admin/fault", r#"{"bogus":1}"#)
            .unwrap()
            .status,
        400
    );

    // LoRA: loads once, shows in reports and metrics.
    let lora = r#"{"model":"m-lora","prompt":"hi","max_tokens":1}"#;
    assert_eq!(
        post_json(addr, "/v1/completions", lora).unwrap().status,
        200
    );
    assert_eq!(
        post_json(addr, "/v1/completions", lora).unwrap().status,
        200
    );
    let metrics = get(addr, "/metrics").unwrap().body;
    for name in [
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ] {
        assert!(metrics.contains(name), "{name} missing in {metrics}");
    }
    let parsed = kvroute::report::parse_vllm_metrics(&metrics).unwrap();
    assert_eq!(parsed.running_adapters, Some(vec!["billing".to_string()]));
    assert_eq!(parsed.max_lora, Some(4));

    // Overrides show in reports and metrics.
    post_json(
        addr,
        "/admin/fault",
        r#"{"health":0.2,"gpuUtilization":0.8,"queueDepth":10}"#,
    )
    .unwrap();
    let r = parse_report(get(addr, "/kvroute/v1/report").unwrap().body.as_bytes()).unwrap();
    assert_eq!(
        (r.health, r.gpu_utilization, r.queue_depth),
        (0.2, Some(0.8), 10)
    );
    assert_eq!(r.adapters, vec!["billing".to_string()]);
    let parsed = kvroute::report::parse_vllm_metrics(&get(addr, "/metrics").unwrap().body).unwrap();
    assert_eq!(
        (parsed.waiting, parsed.kv_cache_usage),
        (Some(10.0), Some(0.8))
    );
    post_json(
        addr,
        "/admin/fault",
        r#"{"health":null,"gpuUtilization":null,"queueDepth":null}"#,
    )
    .unwrap();
    let r = parse_report(get(addr, "/kvroute/v1/report").unwrap().body.as_bytes()).unwrap();
    assert_eq!((r.health, r.queue_depth), (1.0, 0));

    // Report faults.
    post_json(addr, "/admin/fault", r#"{"report":"garbage"}"#).unwrap();
    assert!(parse_report(get(addr, "/kvroute/v1/report").unwrap().body.as_bytes()).is_err());
    post_json(addr, "/admin/fault", r#"{"report":"error"}"#).unwrap();
    assert_eq!(get(addr, "/kvroute/v1/report").unwrap().status, 500);
    post_json(addr, "/admin/fault", r#"{"report":"ok"}"#).unwrap();

    // Silent eviction storm: the router keeps believing until the flush.
    let query = cluster.report_query("sim-a", "/kvroute/v1/report").unwrap();
    cluster
        .apply_report("sim-a", get(addr, &query).unwrap().body.as_bytes(), 2, 0)
        .0
        .unwrap();
    post_json(addr, "/admin/fault", r#"{"evictAll":true,"silent":true}"#).unwrap();
    let stats = get(addr, "/admin/stats").unwrap().json().unwrap();
    assert_eq!(stats["kvBlocks"], 0);
    let query = cluster.report_query("sim-a", "/kvroute/v1/report").unwrap();
    let r = parse_report(get(addr, &query).unwrap().body.as_bytes()).unwrap();
    assert!(!r.full && r.removed.is_empty());
    let c = post_json(addr, "/v1/completions", &body)
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(c["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    post_json(addr, "/admin/fault", r#"{"flushSilent":true}"#).unwrap();
    let body_r = get(addr, &query).unwrap().body;
    let r = parse_report(body_r.as_bytes()).unwrap();
    assert!(!r.full && !r.removed.is_empty());
    cluster
        .apply_report("sim-a", body_r.as_bytes(), 3, 0)
        .0
        .unwrap();
    assert_eq!(
        cluster.index().lookup(&chain).blocks(0) as usize,
        chain.len(),
        "re-stored prompt"
    );

    // Stats and reset.
    let stats = get(addr, "/admin/stats").unwrap().json().unwrap();
    assert_eq!(stats["podId"], "sim-a");
    assert_eq!(stats["requests"], 11);
    assert_eq!(stats["errors"], 3);
    assert_eq!(stats["completed"], 8);
    assert_eq!(stats["adapterLoads"], 1);
    assert!(stats["cachedTokens"].as_u64().unwrap() >= cached);
    assert!(stats["ttftMsSum"].as_f64().unwrap() > 0.0);
    post_json(addr, "/admin/reset-stats", "{}").unwrap();
    let stats = get(addr, "/admin/stats").unwrap().json().unwrap();
    assert_eq!(stats["requests"], 0);
    assert!(
        stats["kvBlocks"].as_u64().unwrap() >= chain.len() as u64,
        "reset keeps the cache"
    );

    // Hang: new requests stall until released.
    post_json(addr, "/admin/fault", r#"{"hang":true}"#).unwrap();
    let hung = http::request(
        addr,
        "GET",
        "/health",
        &[],
        None,
        Duration::from_millis(300),
    );
    assert!(hung.is_err(), "{hung:?}");
    post_json(addr, "/admin/fault", r#"{"hang":false}"#).unwrap();
    assert_eq!(get(addr, "/health").unwrap().status, 200);

    // Crash: the process exits at once.
    let mut sim = sim;
    let _ = post_json(&sim.addr.clone(), "/admin/fault", r#"{"crash":true}"#);
    let status = sim.child.wait().unwrap();
    assert_eq!(status.code(), Some(1));
}

#[test]
fn sim_caches_the_rendered_chat_prompt_the_router_hashes() {
    let config_text = r#"{
        "pods": [{"id": "sim-t", "address": "127.0.0.1:1"}],
        "models": {"m": {"baseModel": "base"}},
        "chatTemplates": {"base": {
            "template": "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
            "bosToken": "<s>"
        }}
    }"#;
    let config_path =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvroute-sim-template-config.json");
    std::fs::write(&config_path, config_text).unwrap();
    let sim = Sim::start(&[
        "--pod-id",
        "sim-t",
        "--time-scale",
        "0.05",
        "--config",
        config_path.to_str().unwrap(),
    ]);
    let config = Config::parse(config_text.as_bytes()).unwrap();
    let body = format!(
        r#"{{"model":"m","max_tokens":1,"messages":[{{"role":"system","content":"{}"}},{{"role":"user","content":"  Hello  "}}]}}"#,
        "Answer in one short sentence. ".repeat(12)
    );
    let answer = post_json(&sim.addr, "/v1/chat/completions", &body).unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
    // The router's chain of the rendered prompt (not the canonical form)
    // is what the pod now reports holding.
    let chain = Router::new(config.clone())
        .prepare(body.as_bytes(), true)
        .unwrap()
        .chain;
    let canonical = BlockHasher::from_config(&config).chain(
        &config.resolve_model("m").unwrap(),
        &parse_request(body.as_bytes(), true).unwrap().prompt,
        None,
    );
    assert!(chain.len() >= 5);
    assert_ne!(chain.first(), canonical.first());
    let mut cluster = ClusterState::new(&config, 0);
    let query = cluster.report_query("sim-t", "/kvroute/v1/report").unwrap();
    let report = get(&sim.addr, &query).unwrap();
    cluster
        .apply_report("sim-t", report.body.as_bytes(), 1, 0)
        .0
        .unwrap();
    assert_eq!(
        cluster.index().lookup(&chain).blocks(0) as usize,
        chain.len(),
        "{}",
        report.body
    );
}

#[test]
fn queue_forms_behind_max_batch() {
    let sim = Sim::start(&["--max-batch", "1", "--time-scale", "0.05"]);
    let addr = sim.addr.clone();
    let prompt = "x".repeat(4096 * 4);
    let body = format!(r#"{{"model":"any","prompt":"{prompt}","max_tokens":2}}"#);
    let threads: Vec<_> = (0..3)
        .map(|_| {
            let (addr, body) = (addr.clone(), body.clone());
            std::thread::spawn(move || post_json(&addr, "/v1/completions", &body).unwrap().status)
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), 200);
    }
    let stats = get(&addr, "/admin/stats").unwrap().json().unwrap();
    assert!(stats["maxQueueSeen"].as_u64().unwrap() >= 1, "{stats}");
    assert_eq!(stats["completed"], 3);
    assert_eq!(stats["queueDepth"], 0);
    assert_eq!(stats["running"], 0);
    assert!(get(&addr, "/v1/models").unwrap().body.contains("sim-model"));
}

/// `prefillTokens` counts what the pod computed: all of a cold prompt,
/// only the uncached tail of a repeated one; reset-stats zeroes it.
#[test]
fn prefill_tokens_count_the_uncached_part_of_each_prompt() {
    let sim = Sim::start(&["--time-scale", "0.01"]);
    // 337 tokens (4 bytes each), 21 full blocks of 16 tokens.
    let body = format!(
        r#"{{"model":"any","prompt":"{}","max_tokens":1}}"#,
        "y".repeat(1350)
    );
    let complete = || {
        let answer = post_json(&sim.addr, "/v1/completions", &body).unwrap();
        assert_eq!(answer.status, 200, "{}", answer.body);
        answer.json().unwrap()
    };
    let cold = complete();
    assert_eq!(cold["usage"]["prompt_tokens"], 337);
    assert_eq!(sim_stats(&sim.addr)["prefillTokens"], 337);
    let repeated = complete();
    assert_eq!(
        repeated["usage"]["prompt_tokens_details"]["cached_tokens"],
        21 * 16
    );
    assert_eq!(sim_stats(&sim.addr)["prefillTokens"], 337 + 1);
    post_json(&sim.addr, "/admin/reset-stats", "{}").unwrap();
    assert_eq!(sim_stats(&sim.addr)["prefillTokens"], 0);
}

/// `GET` a report, returning it and how long the answer took.
fn timed_report(addr: &str, query: &str) -> (serde_json::Value, Duration) {
    let started = std::time::Instant::now();
    let answer = get(addr, &format!("/kvroute/v1/report?{query}")).unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
    (answer.json().unwrap(), started.elapsed())
}

#[test]
fn report_wait_holds_until_an_event_or_the_wait_ends() {
    let sim = Sim::start(&["--time-scale", "0.05"]);
    let addr = sim.addr.clone();
    let completion = |text: &str| {
        let body = format!(r#"{{"model":"any","prompt":"{text}","max_tokens":1}}"#);
        assert_eq!(
            post_json(&addr, "/v1/completions", &body).unwrap().status,
            200
        );
    };
    // A cache event first: `since=0` always asks for a full report.
    completion(&"x".repeat(2048));
    let (full, _) = timed_report(&addr, "since=0");
    let (epoch, seq) = (
        full["epoch"].as_str().unwrap().to_string(),
        full["seq"].clone(),
    );
    // Nothing new: held for the whole wait, then an empty delta.
    let (idle, took) = timed_report(&addr, &format!("since={seq}&epoch={epoch}&wait=300"));
    assert!(
        took >= Duration::from_millis(290),
        "answered after {took:?}"
    );
    assert_eq!(
        (idle["full"].as_bool(), idle["seq"].clone()),
        (Some(false), seq.clone())
    );
    assert_eq!(idle["stored"], serde_json::json!([]));
    // An event while held: answered as soon as the prefill stored its blocks.
    let query = format!("since={seq}&epoch={epoch}&wait=5000");
    let held = {
        let addr = addr.clone();
        std::thread::spawn(move || timed_report(&addr, &query))
    };
    std::thread::sleep(Duration::from_millis(200));
    completion(&"y".repeat(2048));
    let (delta, took) = held.join().unwrap();
    assert!(
        took >= Duration::from_millis(200) && took < Duration::from_millis(1500),
        "answered after {took:?}"
    );
    assert_eq!(delta["full"].as_bool(), Some(false));
    assert!(!delta["stored"].as_array().unwrap().is_empty(), "{delta}");
    // Events already there, or another epoch: answered at once.
    let (_, took) = timed_report(&addr, &format!("since={seq}&epoch={epoch}&wait=5000"));
    assert!(took < Duration::from_millis(500), "answered after {took:?}");
    let (other, took) = timed_report(&addr, &format!("since={seq}&epoch=other&wait=5000"));
    assert!(took < Duration::from_millis(500) && other["full"].as_bool() == Some(true));
    // Report faults answer at once, as before.
    post_json(&addr, "/admin/fault", r#"{"report":"error"}"#).unwrap();
    let started = std::time::Instant::now();
    let seq = delta["seq"].clone();
    let failed = get(
        &addr,
        &format!("/kvroute/v1/report?since={seq}&epoch={epoch}&wait=5000"),
    );
    assert_eq!(failed.unwrap().status, 500);
    assert!(started.elapsed() < Duration::from_millis(500));

    // A pod without long-poll ignores `wait`.
    let plain = Sim::start(&["--no-long-poll"]);
    let (full, _) = timed_report(&plain.addr, "since=0");
    let query = format!(
        "since={}&epoch={}&wait=2000",
        full["seq"],
        full["epoch"].as_str().unwrap()
    );
    // (At `seq` 0 a long-polling sim would hold this too.)
    let (_, took) = timed_report(&plain.addr, &query);
    assert!(took < Duration::from_millis(500), "answered after {took:?}");
}

/// `--pods N`: one process, N pods, each with its own listener, id, cache
/// and report log.
#[test]
fn one_process_serves_many_pods() {
    let config_path =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvroute-sim-pods-config.json");
    std::fs::write(&config_path, CONFIG).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-sim"))
        .args([
            "--port",
            "0",
            "--pods",
            "40",
            "--pod-id",
            "pod-{i}",
            "--time-scale",
            "0",
        ])
        .args([
            "--preload-prompts",
            "2",
            "--preload-prompt-bytes",
            "1024",
            "--config",
        ])
        .arg(&config_path)
        .stdout(Stdio::piped())
        .spawn()
        .expect("kvroute-sim starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let pods: Vec<(String, String)> = (0..40)
        .map(|_| {
            let line = lines.next().unwrap().unwrap();
            let mut words = line.split(' ');
            assert_eq!(words.next(), Some("kvroute-sim"), "{line}");
            let id = words.next().unwrap().to_string();
            (id, words.next_back().unwrap().to_string())
        })
        .collect();
    let sim = Sim {
        child,
        addr: pods[0].1.clone(),
    };
    let mut addresses: Vec<&str> = pods.iter().map(|(_, a)| a.as_str()).collect();
    addresses.dedup();
    assert_eq!(addresses.len(), 40, "a listener each");
    for (i, (id, addr)) in pods.iter().enumerate() {
        assert_eq!(id, &format!("pod-{i}"));
        let report = parse_report(
            get(addr, "/kvroute/v1/report?since=0")
                .unwrap()
                .body
                .as_bytes(),
        )
        .unwrap();
        assert_eq!(report.pod_id, *id);
        // Its own preloaded prompts: 2 × 1 KiB = 32 blocks of 64 bytes.
        let blocks: usize = report.stored.iter().map(|c| c.hashes.len()).sum();
        assert_eq!(blocks, 32, "{id}");
    }
    // A request to one pod caches there only.
    let body = serde_json::json!({"model": "m", "prompt": "x".repeat(640), "max_tokens": 1});
    assert_eq!(
        post_json(&pods[3].1, "/v1/completions", &body.to_string())
            .unwrap()
            .status,
        200
    );
    let stats =
        |addr: &str| -> serde_json::Value { get(addr, "/admin/stats").unwrap().json().unwrap() };
    assert_eq!(stats(&pods[3].1)["requests"], 1);
    assert_eq!(stats(&pods[4].1)["requests"], 0);
    drop(sim);
}

/// `/v1/models` in vLLM's order and shape (`show_available_models`): the
/// base model's served names first (the model itself before its aliases,
/// with `max_model_len`), then the LoRA adapters with `parent` set and no
/// `max_model_len`. Routers that register a worker for the first listed
/// model (SGLang's gateway) see the base model: with `envoy/kvroute.json`'s
/// models, listed alphabetically, they used to see an alias.
#[test]
fn models_are_listed_base_model_first_as_vllm_lists_them() {
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/../envoy/kvroute.json");
    let sim = Sim::start(&["--config", shipped]);
    let models = get(&sim.addr, "/v1/models").unwrap().json().unwrap();
    assert_eq!(models["object"], "list");
    let cards = models["data"].as_array().unwrap();
    let column =
        |field: &str| -> Vec<String> { cards.iter().map(|card| card[field].to_string()).collect() };
    assert_eq!(
        column("id"),
        [
            "\"sim-model\"",
            "\"customer-support-v3\"",
            "\"customer-support-v3-billing\"",
            "\"customer-support-v3-enterprise\""
        ]
    );
    assert_eq!(
        column("parent"),
        ["null", "null", "\"sim-model\"", "\"sim-model\""]
    );
    assert_eq!(
        column("root"),
        [
            "\"sim-model\"",
            "\"sim-model\"",
            "\"billing-lora\"",
            "\"enterprise-lora\""
        ]
    );
    assert_eq!(column("max_model_len"), ["8192", "8192", "null", "null"]);
    for card in cards {
        assert_eq!(
            (&card["object"], &card["owned_by"]),
            (&"model".into(), &"vllm".into())
        );
        assert_eq!(card["permission"][0]["object"], "model_permission");
    }

    // Adapters only (the benchmark's LoRA workload): vLLM serves its base
    // model anyway, listed first, and answers requests for it.
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let config = dir.join("kvroute-sim-adapters-only.json");
    std::fs::write(
        &config,
        r#"{"pods": [{"id": "p", "address": "127.0.0.1:1"}],
            "models": {"tenant-1": {"baseModel": "sim-model", "adapter": "lora-1"},
                       "tenant-0": {"baseModel": "sim-model", "adapter": "lora-0"}}}"#,
    )
    .unwrap();
    let sim = Sim::start(&["--config", config.to_str().unwrap(), "--time-scale", "0.01"]);
    let models = get(&sim.addr, "/v1/models").unwrap().json().unwrap();
    let listed: Vec<(&str, &serde_json::Value)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|card| (card["id"].as_str().unwrap(), &card["parent"]))
        .collect();
    assert_eq!(
        listed,
        [
            ("sim-model", &serde_json::Value::Null),
            ("tenant-0", &"sim-model".into()),
            ("tenant-1", &"sim-model".into())
        ]
    );
    for model in ["sim-model", "tenant-1"] {
        let body = format!(r#"{{"model":"{model}","prompt":"hello","max_tokens":1}}"#);
        let answer = post_json(&sim.addr, "/v1/completions", &body).unwrap();
        assert_eq!(answer.status, 200, "{model}: {}", answer.body);
    }
    let unknown = r#"{"model":"other","prompt":"hello","max_tokens":1}"#;
    assert_eq!(
        post_json(&sim.addr, "/v1/completions", unknown)
            .unwrap()
            .status,
        404
    );
}

/// `--cpu-kv-blocks`: blocks the GPU evicts move to a CPU tier, reported
/// with `"tier": "cpu"` (deltas move them, the router folds them as held:
/// tiers do not reach the index yet); a request whose prefix is there is a
/// hit reloaded from host memory (`cachedTokensCpu`, vLLM's external
/// prefix-cache counters) and its blocks move back to the GPU. A reload
/// rate that is no positive number is refused, naming the flag.
#[test]
fn a_cpu_tier_keeps_evicted_blocks_and_reports_their_tier() {
    let config_path =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvroute-sim-cpu-tier-config.json");
    std::fs::write(&config_path, CONFIG).unwrap();
    let config_arg = config_path.to_str().unwrap();
    let sim = Sim::start(&[
        "--pod-id",
        "sim-a",
        "--config",
        config_arg,
        "--time-scale",
        "0.01",
        "--kv-blocks",
        "4",
        "--cpu-kv-blocks",
        "6",
    ]);
    let addr = sim.addr.as_str();
    let config = Config::parse(CONFIG.as_bytes()).unwrap();
    let mut cluster = ClusterState::new(&config, 0);
    let body = |c: char| {
        format!(
            r#"{{"model":"m","prompt":"{}","max_tokens":1}}"#,
            c.to_string().repeat(4 * 64 + 10)
        )
    };
    let chain = |c: char| {
        BlockHasher::from_config(&config).chain(
            &config.resolve_model("m").unwrap(),
            &parse_request(body(c).as_bytes(), false).unwrap().prompt,
            None,
        )
    };
    let complete = |c: char| {
        let answer = post_json(addr, "/v1/completions", &body(c)).unwrap();
        assert_eq!(answer.status, 200, "{}", answer.body);
        answer.json().unwrap()
    };
    complete('a');
    complete('b');
    // a's 4 blocks left the GPU for the CPU tier.
    let query = cluster.report_query("sim-a", "/kvroute/v1/report").unwrap();
    let full = get(addr, &query).unwrap();
    let r = parse_report(full.body.as_bytes()).unwrap();
    let tier_of = |r: &kvroute::report::PodReport, hash: u64| {
        r.stored
            .iter()
            .find(|c| c.hashes.contains(&hash))
            .map(|c| c.tier)
    };
    assert!(
        chain('a')
            .iter()
            .all(|&h| tier_of(&r, h) == Some(Tier::Cpu)),
        "{}",
        full.body
    );
    assert!(chain('b')
        .iter()
        .all(|&h| tier_of(&r, h) == Some(Tier::Gpu)));
    assert!(full.body.contains(r#""tier":"cpu""#));
    cluster
        .apply_report("sim-a", full.body.as_bytes(), 1, 0)
        .0
        .unwrap();
    assert_eq!(cluster.index().lookup(&chain('a')).blocks(0), 4);
    // a again: a hit from the CPU tier, reloaded to the GPU, whence b's 4
    // blocks go to the CPU tier.
    let again = complete('a');
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 64);
    let stats = sim_stats(addr);
    assert_eq!(
        (
            stats["cachedTokensCpu"].as_u64(),
            stats["kvCpuBlocks"].as_u64()
        ),
        (Some(64), Some(4))
    );
    // A reload is no prefill: a and b cold (66 tokens each), then a's
    // 2-token tail.
    assert_eq!(stats["prefillTokens"], 66 + 66 + 2);
    let query = cluster.report_query("sim-a", "/kvroute/v1/report").unwrap();
    let delta = get(addr, &query).unwrap();
    let r = parse_report(delta.body.as_bytes()).unwrap();
    assert!(!r.full);
    assert!(chain('a')
        .iter()
        .all(|&h| tier_of(&r, h) == Some(Tier::Gpu)));
    assert!(chain('b')
        .iter()
        .all(|&h| tier_of(&r, h) == Some(Tier::Cpu)));
    assert!(r.removed.is_empty(), "moves are no removals");
    let (summary, _) = cluster.apply_report("sim-a", delta.body.as_bytes(), 1, 0);
    assert!(!summary.unwrap().resync);
    let metrics = get(addr, "/metrics").unwrap().body;
    let lines: Vec<&str> = metrics.lines().collect();
    assert!(
        lines.contains(&"vllm:external_prefix_cache_hits_total{model_name=\"m\"} 64"),
        "{metrics}"
    );
    assert!(lines.contains(&"vllm:prefix_cache_hits_total{model_name=\"m\"} 0"));

    let refused = Command::new(env!("CARGO_BIN_EXE_kvroute-sim"))
        .args(["--port", "0", "--cpu-reload-gbps", "0"])
        .output()
        .expect("kvroute-sim runs");
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("--cpu-reload-gbps must be a positive number"),
        "{stderr}"
    );
}

fn sim_stats(addr: &str) -> serde_json::Value {
    get(addr, "/admin/stats").unwrap().json().unwrap()
}
