//! The benchmark's five workloads as concrete request sequences (seeded, so
//! every policy gets exactly the same requests at the same offsets, or, in
//! the closed-loop agentic workload, the same turns in the same order per
//! agent), the per-pod KV sizing, the arrival rate, and the two offline
//! cache bounds.
//!
//! Every request is streamed (`"stream": true` with usage) and carries an
//! `x-session-id` (group, user, tenant, agent, or the trace line's first
//! hash id) for the session-hashing policies.

use std::collections::HashSet;
use std::path::Path;

use kvroute::chat_template::PromptRenderer;
use kvroute::config::Config;
use kvroute::hashing::{BlockHasher, Coverage};
use kvroute::request::ParsedRequest;
use serde_json::{json, Value};

use crate::model::{prompt_tokens, CostModel, KvCache};
use crate::sim::token_text;
use crate::tokenizer::SimTokenizer;
use crate::trace;

/// Names accepted by `kvroute-bench workload NAME`, in report order.
pub const WORKLOADS: [&str; 6] = [
    "shared-prefix",
    "multi-turn",
    "lora",
    "trace",
    "agentic",
    "long-context",
];

/// The working set (see [`knee`]) is this share of the cluster's KV blocks.
pub const WORKING_SET_SHARE: f64 = 0.72;

/// One request of a workload.
#[derive(Debug, Clone)]
pub struct BenchRequest {
    /// Arrival offset from the start of the run, seconds (closed loop: the
    /// offset planned with every prefix cached, which orders the bounds).
    pub at_s: f64,
    /// Closed loop: the request (index) whose completion sends this one.
    pub follows: Option<usize>,
    pub path: &'static str,
    /// The JSON body as sent.
    pub body: String,
    /// `x-session-id` (session-hashing key).
    pub session: String,
    /// Block chain the pods compute for this prompt (every full block; the
    /// router matches its first `maxPrefixBlocks`).
    pub chain: Vec<u64>,
    /// Prompt tokens (simulated tokenizer) and how blocks cover them.
    pub prompt_tokens: u64,
    pub coverage: Coverage,
    pub output_tokens: u64,
    /// It continues a conversation ([`kvroute::request::ParsedRequest::follows_up`]).
    pub follows_up: Option<bool>,
}

impl BenchRequest {
    /// Tokens a cache holding the first `blocks` blocks saves.
    pub fn cached_tokens(&self, blocks: usize) -> u64 {
        self.coverage.tokens(blocks as u32)
    }
}

/// Offline bounds over the request sequence (token-weighted hit rates).
#[derive(Debug, Clone, Copy, Default)]
pub struct Bounds {
    /// One LRU cache with all pods' blocks pooled.
    pub pooled: f64,
    /// An unbounded cache.
    pub infinite: f64,
}

/// A workload, ready to run.
#[derive(Debug, Clone)]
pub struct Workload {
    pub name: String,
    pub description: String,
    /// kvroute configuration without `pods` and mode (models, block sizes).
    pub plugin: Value,
    pub requests: Vec<BenchRequest>,
    pub pods: usize,
    pub max_batch: usize,
    pub max_loras: usize,
    pub time_scale: f64,
    /// Per-pod KV cache, blocks.
    pub kv_blocks: usize,
    /// Per-pod CPU tier, blocks (`kvroute-sim --cpu-kv-blocks`; 0: none).
    pub cpu_kv_blocks: usize,
    /// The working set: smallest pooled LRU reaching 99% of the infinite
    /// cache's hits.
    pub working_set_blocks: usize,
    pub unique_blocks: usize,
    /// Cache-blind capacity estimate (requests/s) and the offered rate
    /// (closed loop: the planned rate with every prefix cached).
    pub capacity_rps: f64,
    pub offered_rps: f64,
    /// Closed loop: the number of agents (each with one turn in flight).
    pub agents: Option<usize>,
    pub bounds: Bounds,
    /// Stock-vLLM mode (see [`GenOptions::stock_vllm`]), and the pods'
    /// tokenizer then.
    pub stock_vllm: bool,
    pub tokenizer: String,
    /// Per pod, its prefill speed ([`GenOptions::prefill_speeds`]).
    pub prefill_speeds: Vec<f64>,
}

impl Workload {
    /// In a mixed pool, the pods whose prefill speed is the highest (pods
    /// past [`Workload::prefill_speeds`] run at 1); empty when every pod
    /// runs at one speed.
    pub fn fast_pods(&self) -> Vec<usize> {
        let speed = |pod: usize| self.prefill_speeds.get(pod).copied().unwrap_or(1.0);
        let fastest = (0..self.pods).map(speed).fold(0.0, f64::max);
        if (0..self.pods).all(|pod| speed(pod) == fastest) {
            return Vec::new();
        }
        (0..self.pods)
            .filter(|&pod| speed(pod) == fastest)
            .collect()
    }
}

/// Knobs shared by the generators.
#[derive(Debug, Clone)]
pub struct GenOptions {
    pub quick: bool,
    pub seed: u64,
    /// Offered load as a share of the cache-blind capacity.
    pub load: f64,
    pub pods: usize,
    pub trace_path: std::path::PathBuf,
    /// Overrides the trace's computed speedup.
    pub speedup: Option<f64>,
    /// Trace requests (first N lines); `None`: 1000, quick 300.
    pub trace_requests: Option<usize>,
    /// First trace line replayed (0-based); `None`: the last N lines.
    pub trace_offset: Option<usize>,
    /// Merged into every workload's plugin configuration.
    pub plugin_extra: Value,
    /// Stock-vLLM mode ([`STOCK_VLLM_TOKENIZER`]): pods tokenize prompts
    /// as vLLM does and publish KV events, kvroute's precise mode reads
    /// them through kvroute-vllm-bridge, and chat prompts are the chat
    /// template's rendering ([`STOCK_VLLM_CHAT_TEMPLATE`]).
    pub stock_vllm: bool,
    /// Per pod, its prefill speed as a multiple of the cost model's
    /// (`kvroute-sim --prefill-speed`); empty: all 1.
    pub prefill_speeds: Vec<f64>,
    /// Pods with a CPU KV tier ([`CPU_TIER_WORKING_SET`]).
    pub cpu_tier: bool,
    /// Stock-vLLM mode: the pods' tokenizer ([`SimTokenizer::named`]: a
    /// model's `tokenizer.json` on real vLLM); `None`:
    /// [`STOCK_VLLM_TOKENIZER`].
    pub tokenizer: Option<String>,
    /// Every workload's time scale, instead of its own: on real vLLM, the
    /// pods' measured prefill time per token over the cost model's
    /// ([`crate::bench::engine`]).
    pub time_scale: Option<f64>,
}

impl GenOptions {
    /// The tokenizer stock-vLLM pods run.
    pub fn pod_tokenizer(&self) -> &str {
        self.tokenizer.as_deref().unwrap_or(STOCK_VLLM_TOKENIZER)
    }

    /// `own`, a workload's time scale, unless every workload's is set.
    fn time_scale(&self, own: f64) -> f64 {
        self.time_scale.unwrap_or(own)
    }
}

/// With a CPU tier ([`GenOptions::cpu_tier`]), the working set is this
/// multiple of the pods' GPU blocks, and the CPU tier is as large as the
/// GPU cache: the working set overflows the GPU into the CPU tier and
/// fits both (0.75 of GPU + CPU).
pub const CPU_TIER_WORKING_SET: f64 = 1.5;

/// The tokenizer of the pods in stock-vLLM mode (`kvroute-sim --tokenizer`).
pub const STOCK_VLLM_TOKENIZER: &str = "cl100k_base";

/// The chat template of every base model in stock-vLLM mode.
pub const STOCK_VLLM_CHAT_TEMPLATE: &str = include_str!("chat_template.jinja");

/// splitmix64: a small seeded generator.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Exponential with the given mean.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -(1.0 - self.unit()).ln() * mean
    }

    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            items.swap(i, j);
        }
    }
}

/// `bytes` bytes of lowercase words, starting with `header`, seeded.
/// Per owner (user, agent), `turns` texts of a length drawn from `rng` in
/// `tokens`, each headed by `label(owner, turn)` and distinct per `tag`.
fn turn_texts(
    rng: &mut Rng,
    owners: u64,
    turns: u64,
    tokens: (u64, u64),
    tag: u64,
    label: impl Fn(u64, u64) -> String,
) -> Vec<Vec<String>> {
    (0..owners)
        .map(|o| {
            (0..turns)
                .map(|t| {
                    let length = rng.range(tokens.0, tokens.1) as usize;
                    words(&label(o, t), (o << 16) | t | tag << 60, length * 4)
                })
                .collect()
        })
        .collect()
}

pub fn words(header: &str, seed: u64, bytes: usize) -> String {
    const LETTERS: &[u8] = b"abcdefghijklmnopqrstuvwxyz";
    let mut rng = Rng::new(seed);
    let mut out = String::with_capacity(bytes + 16);
    out.push_str(header);
    while out.len() < bytes {
        let len = rng.range(2, 9);
        for _ in 0..len {
            out.push(LETTERS[(rng.next_u64() % 26) as usize] as char);
        }
        out.push(' ');
    }
    out.truncate(bytes);
    out
}

/// A draft request before hashing and timing.
struct Draft {
    path: &'static str,
    body: Value,
    session: String,
    output_tokens: u64,
    follows: Option<usize>,
}

fn stream_fields(body: &mut Value) {
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
}

/// `plugin` with `--kvroute-config` merged in, and in stock-vLLM mode the
/// chat template of each base model: what the router and the pods run
/// with, so also what the requests are hashed with.
fn with_extra(plugin: &Value, opts: &GenOptions) -> Value {
    let mut plugin = plugin.clone();
    if opts.stock_vllm {
        let templates: serde_json::Map<String, Value> = plugin["models"]
            .as_object()
            .into_iter()
            .flat_map(|models| models.values())
            .filter_map(|model| model["baseModel"].as_str())
            .map(|base| {
                (
                    base.to_string(),
                    json!({"template": STOCK_VLLM_CHAT_TEMPLATE}),
                )
            })
            .collect();
        plugin["chatTemplates"] = Value::Object(templates);
    }
    if let (Some(target), Some(extra)) = (plugin.as_object_mut(), opts.plugin_extra.as_object()) {
        for (k, v) in extra {
            target.insert(k.clone(), v.clone());
        }
    }
    plugin
}

/// Hashes drafts the way the pods will: text blocks, or in stock-vLLM
/// mode the token blocks of the text as the pods tokenize it.
fn finish(
    drafts: Vec<Draft>,
    plugin: &Value,
    times: &[f64],
    opts: &GenOptions,
) -> Vec<BenchRequest> {
    let pods = PodView::new(plugin, opts);
    let hasher = BlockHasher::from_config(&pods.config).uncapped();
    drafts
        .into_iter()
        .zip(times)
        .map(|(mut d, &at_s)| {
            stream_fields(&mut d.body);
            let body = d.body.to_string();
            let parsed = pods.parse(&body, d.path);
            let target = pods
                .config
                .resolve_model(&parsed.model)
                .expect("generated model is configured");
            let chain = hasher.chain(&target, &parsed.prompt, parsed.cache_salt.as_deref());
            BenchRequest {
                at_s,
                path: d.path,
                body,
                follows: d.follows,
                session: d.session,
                chain,
                prompt_tokens: prompt_tokens(&parsed.prompt),
                coverage: hasher.coverage(&parsed.prompt),
                output_tokens: d.output_tokens,
                follows_up: parsed.follows_up,
            }
        })
        .collect()
}

/// The plugin JSON as a validated [`Config`] (with a placeholder pod).
pub fn parse_plugin(plugin: &Value) -> Config {
    let mut value = plugin.clone();
    value["pods"] = json!([{"id": "pod-0", "address": "127.0.0.1:1"}]);
    Config::parse(value.to_string().as_bytes()).expect("benchmark plugin config is valid")
}

/// Cache-blind, uncontended time of one request on a pod (how long it
/// holds its sequence slot when nothing queues).
fn service_s(cost: &CostModel, tokens: u64, output: u64) -> f64 {
    (cost.prefill(tokens) + cost.generation_after_first(output)).as_secs_f64()
}

/// Poisson arrival offsets at `rate` per second.
fn poisson(rng: &mut Rng, n: usize, rate: f64) -> Vec<f64> {
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            t += rng.exp(1.0 / rate);
            t
        })
        .collect()
}

/// Cache-blind capacity (requests/s) of the cluster for these (prompt
/// tokens, output tokens) pairs: per pod, the prefill engine's throughput
/// with no cache hits (uncached tokens per second ÷ mean prompt tokens), or
/// the sequence-slot bound (slots ÷ mean uncontended request time) if lower.
pub fn capacity(pairs: &[(u64, u64)], time_scale: f64, pods: usize, max_batch: usize) -> f64 {
    let cost = CostModel::gpu_8b(time_scale);
    let n = pairs.len().max(1) as f64;
    let mean_tokens = pairs.iter().map(|&(t, _)| t as f64).sum::<f64>() / n;
    let prefill_bound = cost.prefill_tokens_per_s() / mean_tokens.max(1.0);
    let mean_service = pairs
        .iter()
        .map(|&(t, o)| service_s(&cost, t, o))
        .sum::<f64>()
        / n;
    let slot_bound = max_batch as f64 / mean_service;
    pods as f64 * prefill_bound.min(slot_bound)
}

/// Sequence slots per pod in every workload: vLLM's `max_num_seqs` is 256
/// by default; 64 is still far above what 70% of the prefill-bound capacity
/// keeps busy (a few to ~15 sequences per pod here), so slots never bind and
/// prefill compute is the bottleneck, as on a real GPU.
pub const MAX_BATCH: usize = 64;

/// Each draft's (prompt tokens, output tokens) as the pods count them.
fn token_pairs(drafts: &[Draft], plugin: &Value, opts: &GenOptions) -> Vec<(u64, u64)> {
    let pods = PodView::new(&with_extra(plugin, opts), opts);
    drafts
        .iter()
        .map(|d| {
            let parsed = pods.parse(&d.body.to_string(), d.path);
            (prompt_tokens(&parsed.prompt), d.output_tokens)
        })
        .collect()
}

/// A request as the pods see it: the chat template rendered (where one is
/// configured) and, in stock-vLLM mode, the text tokenized, so capacity,
/// chains and bounds count what the pods count.
struct PodView {
    config: Config,
    prompts: PromptRenderer,
    tokenizer: Option<SimTokenizer>,
}

impl PodView {
    fn new(plugin: &Value, opts: &GenOptions) -> PodView {
        let config = parse_plugin(plugin);
        PodView {
            prompts: PromptRenderer::new(&config),
            tokenizer: opts
                .stock_vllm
                .then(|| SimTokenizer::named(opts.pod_tokenizer()).expect("a known tokenizer")),
            config,
        }
    }

    fn parse(&self, body: &str, path: &str) -> ParsedRequest {
        let mut parsed = self
            .prompts
            .prompt(body.as_bytes(), path.contains("chat"))
            .expect("generated body parses");
        if let Some(tokenizer) = &self.tokenizer {
            parsed.prompt = tokenizer.tokenize(parsed.prompt);
        }
        parsed
    }
}

/// Builds workload `name`.
pub fn build(name: &str, opts: &GenOptions) -> Result<Workload, String> {
    match name {
        "shared-prefix" => Ok(shared_prefix(opts)),
        "multi-turn" => Ok(multi_turn(opts)),
        "lora" => Ok(lora(opts)),
        "trace" => trace_replay(opts),
        "agentic" => Ok(agentic(opts)),
        "long-context" => Ok(long_context(opts)),
        other => Err(format!(
            "unknown workload {other:?} (one of {})",
            WORKLOADS.join(", ")
        )),
    }
}

fn base_plugin() -> Value {
    json!({"models": {"sim-model": {"baseModel": "sim-model"}}})
}

#[allow(clippy::too_many_arguments)]
fn assemble(
    name: &str,
    description: String,
    plugin: Value,
    requests: Vec<BenchRequest>,
    opts: &GenOptions,
    max_batch: usize,
    max_loras: usize,
    time_scale: f64,
    capacity_rps: f64,
    offered_rps: f64,
    agents: Option<usize>,
) -> Workload {
    let plugin = with_extra(&plugin, opts);
    let unique_blocks = unique_blocks(&requests);
    let working_set_blocks = knee(&requests, unique_blocks);
    let longest = requests.iter().map(|r| r.chain.len()).max().unwrap_or(1);
    let share = if opts.cpu_tier {
        CPU_TIER_WORKING_SET
    } else {
        WORKING_SET_SHARE
    };
    let total = (working_set_blocks as f64 / share).ceil() as usize;
    let kv_blocks = total.div_ceil(opts.pods).max(longest + 1);
    let cpu_kv_blocks = if opts.cpu_tier { kv_blocks } else { 0 };
    let bounds = Bounds {
        pooled: lru_hit_rate(&requests, kv_blocks * opts.pods),
        infinite: infinite_hit_rate(&requests),
    };
    Workload {
        name: name.to_string(),
        description,
        plugin,
        requests,
        pods: opts.pods,
        max_batch,
        max_loras,
        time_scale,
        kv_blocks,
        cpu_kv_blocks,
        working_set_blocks,
        unique_blocks,
        capacity_rps,
        offered_rps,
        agents,
        bounds,
        stock_vllm: opts.stock_vllm,
        tokenizer: opts.pod_tokenizer().to_string(),
        prefill_speeds: opts.prefill_speeds.clone(),
    }
}

/// 1. llm-d's shared-prefix profile: groups × prompts, a 2048-token system
///    prompt per group, a 256-token question, 256 output tokens, in random
///    order, Poisson arrivals.
fn shared_prefix(opts: &GenOptions) -> Workload {
    let (groups, prompts) = if opts.quick { (16, 16) } else { (32, 32) };
    let (time_scale, max_batch) = (opts.time_scale(0.15), MAX_BATCH);
    let mut rng = Rng::new(opts.seed ^ 1);
    let system: Vec<String> = (0..groups)
        .map(|g| words(&format!("group {g} system prompt. "), 1000 + g, 2048 * 4))
        .collect();
    let mut order: Vec<(u64, u64)> = (0..groups)
        .flat_map(|g| (0..prompts).map(move |p| (g, p)))
        .collect();
    rng.shuffle(&mut order);
    let drafts: Vec<Draft> = order
        .iter()
        .map(|&(g, p)| {
            let question = words(
                &format!(" question {g}-{p}: "),
                (g << 32) | p | 1 << 60,
                256 * 4,
            );
            Draft {
                path: "/v1/completions",
                body: json!({"model": "sim-model", "prompt": format!("{}{}", system[g as usize], question),
                             "max_tokens": 256, "temperature": 0}),
                session: format!("group-{g}"),
                output_tokens: 256,
                follows: None,
            }
        })
        .collect();
    let plugin = base_plugin();
    let cap = capacity(
        &token_pairs(&drafts, &plugin, opts),
        time_scale,
        opts.pods,
        max_batch,
    );
    let rate = cap * opts.load;
    let times = poisson(&mut rng, drafts.len(), rate);
    let requests = finish(drafts, &with_extra(&plugin, opts), &times, opts);
    assemble(
        "shared-prefix",
        format!("{groups} groups × {prompts} prompts, 2,048-token system prompt per group, 256-token question, 256 output tokens; random order, Poisson arrivals"),
        plugin,
        requests,
        opts,
        max_batch,
        4,
        time_scale,
        cap,
        rate,
        None,
    )
}

/// 2. Multi-turn chat: conversations of `rounds` rounds over a shared
///    1,000-token system prompt, questions of 100–200 tokens, 100-token
///    answers (the simulator's deterministic output, appended to the
///    history). A fixed number of conversations is active at once; each
///    Poisson arrival is the next round of an active conversation whose
///    previous round has had time to finish.
fn multi_turn(opts: &GenOptions) -> Workload {
    let (users, rounds) = if opts.quick { (48, 4) } else { (128, 6) };
    let (time_scale, max_batch) = (opts.time_scale(0.3), MAX_BATCH);
    let answer_tokens = 100u64;
    let mut rng = Rng::new(opts.seed ^ 2);
    let system = words("You are a helpful assistant. ", 7, 1000 * 4);
    let answer: String = (0..answer_tokens).map(token_text).collect();
    // Conversation texts first (independent of timing).
    let questions = turn_texts(&mut rng, users, rounds, (100, 200), 2, |u, r| {
        format!("user {u} round {r}: ")
    });
    let body = |u: usize, r: usize| -> Value {
        let mut messages = vec![json!({"role": "system", "content": system})];
        for (i, q) in questions[u].iter().enumerate().take(r + 1) {
            messages.push(json!({"role": "user", "content": q}));
            if i < r {
                messages.push(json!({"role": "assistant", "content": answer}));
            }
        }
        json!({"model": "sim-model", "messages": messages, "max_tokens": answer_tokens, "temperature": 0})
    };
    let plugin = base_plugin();
    // Capacity from all rounds of all users.
    let all: Vec<Draft> = (0..users as usize)
        .flat_map(|u| (0..rounds as usize).map(move |r| (u, r)))
        .map(|(u, r)| Draft {
            path: "/v1/chat/completions",
            body: body(u, r),
            session: String::new(),
            output_tokens: answer_tokens,
            follows: None,
        })
        .collect();
    let cap = capacity(
        &token_pairs(&all, &plugin, opts),
        time_scale,
        opts.pods,
        max_batch,
    );
    let rate = cap * opts.load;
    let cost = CostModel::gpu_8b(time_scale);
    // A round may only start 1.2× its cache-blind latency after the last;
    // enough conversations are active to offer `rate` with that gap.
    let min_gap = 1.2 * service_s(&cost, 2500, answer_tokens);
    let active = ((rate * min_gap * 1.5).ceil() as usize).clamp(4, users as usize);
    let total = (users * rounds) as usize;
    let mut next_user = 0usize;
    let mut live: Vec<(usize, usize, f64)> = Vec::new(); // (user, next round, last sent)
    let mut drafts = Vec::with_capacity(total);
    let mut times = Vec::with_capacity(total);
    let mut t = 0.0;
    while drafts.len() < total {
        while live.len() < active && next_user < users as usize {
            live.push((next_user, 0, f64::NEG_INFINITY));
            next_user += 1;
        }
        t += rng.exp(1.0 / rate);
        let eligible: Vec<usize> = (0..live.len())
            .filter(|&i| t - live[i].2 >= min_gap)
            .collect();
        let pick = if eligible.is_empty() {
            // Nobody is ready: the one waiting longest goes, a bit later.
            let i = (0..live.len())
                .min_by(|&a, &b| live[a].2.total_cmp(&live[b].2))
                .expect("a live conversation");
            t = t.max(live[i].2 + min_gap);
            i
        } else {
            eligible[(rng.next_u64() % eligible.len() as u64) as usize]
        };
        let (u, r, _) = live[pick];
        drafts.push(Draft {
            path: "/v1/chat/completions",
            body: body(u, r),
            session: format!("user-{u}"),
            output_tokens: answer_tokens,
            follows: None,
        });
        times.push(t);
        if r + 1 == rounds as usize {
            live.swap_remove(pick);
        } else {
            live[pick] = (u, r + 1, t);
        }
    }
    let offered = total as f64 / t;
    let requests = finish(drafts, &with_extra(&plugin, opts), &times, opts);
    assemble(
        "multi-turn",
        format!("{users} users × {rounds} rounds ({active} conversations active at once, ≥ {min_gap:.2} s between a user's rounds), shared 1,000-token system prompt, 100–200-token questions, 100-token answers kept in the history; chat API"),
        plugin,
        requests,
        opts,
        max_batch,
        4,
        time_scale,
        cap,
        offered,
        None,
    )
}

/// 3. LoRA multi-tenant: 10 tenants, each its own adapter on the same base
///    model, Zipf(1.0) popularity, a 1,536-token tenant system prompt, a
///    128-token question, 64 output tokens; 4 adapter slots per pod.
fn lora(opts: &GenOptions) -> Workload {
    let tenants = 10u64;
    let n = if opts.quick { 300 } else { 800 };
    let (time_scale, max_batch) = (opts.time_scale(0.3), MAX_BATCH);
    let mut rng = Rng::new(opts.seed ^ 3);
    let weights: Vec<f64> = (1..=tenants).map(|k| 1.0 / k as f64).collect();
    let sum: f64 = weights.iter().sum();
    let system: Vec<String> = (0..tenants)
        .map(|k| words(&format!("tenant {k} instructions. "), 3000 + k, 1536 * 4))
        .collect();
    let mut models = serde_json::Map::new();
    // Each tenant asks for its adapter by the adapter's name, as vLLM
    // serves it (`--lora-modules lora-k=DIR`, and its KV events'
    // `lora_name`); `make vllm` builds these for `--engine vllm`.
    for k in 0..tenants as usize {
        let adapter = crate::vllm::adapter(k);
        models.insert(
            adapter.clone(),
            json!({"baseModel": "sim-model", "adapter": adapter}),
        );
    }
    let plugin = json!({"models": models});
    let drafts: Vec<Draft> = (0..n)
        .map(|i| {
            let mut x = rng.unit() * sum;
            let mut k = 0;
            while k + 1 < tenants as usize && x >= weights[k] {
                x -= weights[k];
                k += 1;
            }
            let question = words(&format!(" ticket {i}: "), i | 3 << 60, 128 * 4);
            Draft {
                path: "/v1/completions",
                body: json!({"model": crate::vllm::adapter(k), "prompt": format!("{}{}", system[k], question),
                             "max_tokens": 64, "temperature": 0}),
                session: format!("tenant-{k}"),
                output_tokens: 64,
                follows: None,
            }
        })
        .collect();
    let cap = capacity(
        &token_pairs(&drafts, &plugin, opts),
        time_scale,
        opts.pods,
        max_batch,
    );
    let rate = cap * opts.load;
    let times = poisson(&mut rng, drafts.len(), rate);
    let requests = finish(drafts, &with_extra(&plugin, opts), &times, opts);
    assemble(
        "lora",
        format!("{n} requests over 10 tenants (adapters lora-0..9 of sim-model), Zipf(1.0) popularity (top tenant {:.0}%), 1,536-token tenant system prompt, 128-token question, 64 output tokens, 4 adapter slots per pod", 100.0 / sum),
        plugin,
        requests,
        opts,
        max_batch,
        4,
        time_scale,
        cap,
        rate,
        None,
    )
}

/// 4. Mooncake trace replay: the first N lines of the trace, each hash id a
///    fixed 512-token text chunk ([`trace::prompt_text`]); arrival times
///    divided by `speedup` (by default the speedup that offers the target
///    load). Blocks are 2,048 bytes (one Mooncake block) so every prompt
///    (up to 256k tokens) is hashed whole.
fn trace_replay(opts: &GenOptions) -> Result<Workload, String> {
    let lines = trace::read_mooncake(&opts.trace_path)
        .map_err(|e| format!("{}: {e}", opts.trace_path.display()))?;
    let n = opts
        .trace_requests
        .unwrap_or(if opts.quick { 300 } else { 1000 })
        .min(lines.len());
    // Default window: the last n lines (the trace's steady state; its first
    // lines are cold, every prefix new).
    let from = opts
        .trace_offset
        .unwrap_or(lines.len() - n)
        .min(lines.len() - n);
    let lines = &lines[from..from + n];
    // 20k-token prompts: a fast time scale keeps the run to about a minute
    // per policy at 70% of the prefill-bound capacity.
    let (time_scale, max_batch) = (opts.time_scale(0.03), MAX_BATCH);
    let plugin = json!({
        "models": {"sim-model": {"baseModel": "sim-model"}},
        "blockSizeBytes": trace::CHUNK_BYTES,
        "maxPrefixBlocks": 512,
    });
    let drafts: Vec<Draft> = lines
        .iter()
        .map(|line| Draft {
            path: "/v1/completions",
            body: trace::completions_body(line, "sim-model", true),
            session: format!(
                "h{}",
                line.hash_ids.first().copied().unwrap_or(line.line as u64)
            ),
            output_tokens: line.output_length.max(1),
            follows: None,
        })
        .collect();
    let cap = capacity(
        &token_pairs(&drafts, &plugin, opts),
        time_scale,
        opts.pods,
        max_batch,
    );
    let first = lines.first().map_or(0.0, |l| l.timestamp_ms) / 1000.0;
    let span = (lines.last().map_or(0.0, |l| l.timestamp_ms) / 1000.0 - first).max(1e-3);
    let native = n as f64 / span;
    let speedup = opts.speedup.unwrap_or(cap * opts.load / native);
    let times: Vec<f64> = lines
        .iter()
        .map(|l| (l.timestamp_ms / 1000.0 - first) / speedup)
        .collect();
    let offered = n as f64 / (span / speedup);
    let requests = finish(drafts, &with_extra(&plugin, opts), &times, opts);
    Ok(assemble(
        "trace",
        format!(
            "lines {}–{} of {} (Mooncake format; {:.0} s of trace at {speedup:.1}× speed), 512-token chunk per hash id, 2,048-byte blocks",
            from + 1,
            from + n,
            file_name(&opts.trace_path),
            span
        ),
        plugin,
        requests,
        opts,
        max_batch,
        4,
        time_scale,
        cap,
        offered,
        None,
    ))
}

/// Closed-loop tool-calling sessions: session `a` opens with a shared head
/// (`heads[a % heads.len()]`: system prompt, tool definitions) and its own
/// task; each later turn appends the model's answer and the next tool
/// result. Each session starts within the first second and sends turn
/// `t + 1` when turn `t` completes.
struct ToolLoop {
    heads: Vec<String>,
    tasks: Vec<String>,
    tools: Vec<Vec<String>>,
    answer_tokens: u64,
}

impl ToolLoop {
    fn body(&self, a: usize, turn: usize) -> Value {
        let answer: String = (0..self.answer_tokens).map(token_text).collect();
        let mut messages = vec![
            json!({"role": "system", "content": self.heads[a % self.heads.len()]}),
            json!({"role": "user", "content": self.tasks[a]}),
        ];
        for tool in &self.tools[a][..turn] {
            messages.push(json!({"role": "assistant", "content": answer}));
            messages.push(json!({"role": "user", "content": tool}));
        }
        json!({"model": "sim-model", "messages": messages, "max_tokens": self.answer_tokens, "temperature": 0})
    }

    /// Tokens turn `turn` of session `a` adds to its history.
    fn new_tokens(&self, a: usize, turn: usize) -> u64 {
        let bytes = match turn {
            0 => self.heads[a % self.heads.len()].len() + self.tasks[a].len(),
            _ => self.tools[a][turn - 1].len(),
        };
        bytes as u64 / 4 + if turn == 0 { 0 } else { self.answer_tokens }
    }

    /// The drafts and their planned times: each turn's cached-case time
    /// after the last (only its new tokens prefilled). The plan orders the
    /// requests for the bounds and estimates the offered rate; the run
    /// itself is closed-loop.
    fn drafts(&self, rng: &mut Rng, cost: &CostModel) -> (Vec<Draft>, Vec<f64>) {
        let (sessions, turns) = (self.tasks.len(), self.tools.first().map_or(0, Vec::len));
        let mut planned: Vec<(f64, usize, usize)> = Vec::with_capacity(sessions * turns);
        for a in 0..sessions {
            let mut t = rng.unit();
            for turn in 0..turns {
                planned.push((t, a, turn));
                t += service_s(cost, self.new_tokens(a, turn), self.answer_tokens);
            }
        }
        planned.sort_by(|x, y| x.0.total_cmp(&y.0));
        let mut index_of = vec![vec![0usize; turns]; sessions];
        for (i, &(_, a, turn)) in planned.iter().enumerate() {
            index_of[a][turn] = i;
        }
        let drafts = planned
            .iter()
            .map(|&(_, a, turn)| Draft {
                path: "/v1/chat/completions",
                body: self.body(a, turn),
                session: format!("agent-{a}"),
                output_tokens: self.answer_tokens,
                follows: (turn > 0).then(|| index_of[a][turn - 1]),
            })
            .collect();
        (drafts, planned.iter().map(|p| p.0).collect())
    }

    /// The closed-loop workload `name` on [`MAX_BATCH`] slots and 4 LoRA
    /// slots, described by `describe` from its requests.
    fn workload(
        &self,
        name: &str,
        rng: &mut Rng,
        opts: &GenOptions,
        time_scale: f64,
        describe: impl FnOnce(&[BenchRequest]) -> String,
    ) -> Workload {
        let (drafts, times) = self.drafts(rng, &CostModel::gpu_8b(time_scale));
        let plugin = base_plugin();
        let cap = capacity(
            &token_pairs(&drafts, &plugin, opts),
            time_scale,
            opts.pods,
            MAX_BATCH,
        );
        let span = times.last().copied().unwrap_or(1.0).max(1e-3);
        let offered = drafts.len() as f64 / span;
        let requests = finish(drafts, &with_extra(&plugin, opts), &times, opts);
        let description = describe(&requests);
        assemble(
            name,
            description,
            plugin,
            requests,
            opts,
            MAX_BATCH,
            4,
            time_scale,
            cap,
            offered,
            Some(self.tasks.len()),
        )
    }
}

/// 5. Agentic tool loops (closed loop): `agents` agents over a few shared
///    2,000-token system prompts (tool definitions), each with its own
///    200-token task; every turn appends the model's 64-token answer (the
///    simulator's deterministic output) and a 150–450-token tool result, and
///    the next turn is sent the moment the last answer completes, as an
///    agent framework does. Agents start over the first second. Tool results
///    are `user` messages (a `tool` message would need a tool call id).
fn agentic(opts: &GenOptions) -> Workload {
    let (agents, turns) = if opts.quick { (24, 8) } else { (24, 16) };
    let system_prompts = 3;
    let time_scale = opts.time_scale(0.3);
    let answer_tokens = 64u64;
    let mut rng = Rng::new(opts.seed ^ 5);
    let system: Vec<String> = (0..system_prompts)
        .map(|p| {
            words(
                &format!("agent system prompt {p}: tools and rules. "),
                5000 + p,
                2000 * 4,
            )
        })
        .collect();
    let tasks: Vec<String> = (0..agents)
        .map(|a| words(&format!("agent {a} task: "), a | 5 << 60, 200 * 4))
        .collect();
    let tools = turn_texts(&mut rng, agents, turns, (150, 450), 6, |a, t| {
        format!("tool result {a}-{t}: ")
    });
    let tool_loop = ToolLoop {
        heads: system,
        tasks,
        tools,
        answer_tokens,
    };
    tool_loop.workload("agentic", &mut rng, opts, time_scale, |_| {
        format!("{agents} agents × {turns} turns, closed loop (each agent's next turn sent the moment its last answer completes), {system_prompts} shared 2,000-token system prompts, 200-token task per agent, each turn appends the 64-token answer and a 150–450-token tool result; chat API")
    })
}

/// 6. Coding-agent sessions with long contexts (closed loop, like
///    [`agentic`]): `sessions` sessions over two shared 8,000-token
///    system+tools heads, each with its own 500-token task; every turn
///    appends the 64-token answer and a 3,000–9,000-token tool result (a
///    file read, a test log), so a session grows to ~50k tokens (quick) or
///    ~70k–100k tokens (full). Past the head, only a session's own history
///    tells the sessions apart: a router that matches only the first
///    16 KiB (4k tokens) sees one head and scatters the turns by load.
fn long_context(opts: &GenOptions) -> Workload {
    let (sessions, turns) = if opts.quick { (8, 7) } else { (16, 12) };
    let heads = 2;
    let time_scale = opts.time_scale(0.1);
    let answer_tokens = 64u64;
    let mut rng = Rng::new(opts.seed ^ 7);
    let head: Vec<String> = (0..heads)
        .map(|h| {
            words(
                &format!("coding agent {h}: system prompt and tool definitions. "),
                7000 + h,
                8000 * 4,
            )
        })
        .collect();
    let tasks: Vec<String> = (0..sessions)
        .map(|a| words(&format!("session {a} task: "), a | 7 << 60, 500 * 4))
        .collect();
    let tools = turn_texts(&mut rng, sessions, turns, (3000, 9000), 8, |a, t| {
        format!("tool output {a}-{t}: ")
    });
    let tool_loop = ToolLoop {
        heads: head,
        tasks,
        tools,
        answer_tokens,
    };
    tool_loop.workload("long-context", &mut rng, opts, time_scale, |requests| {
        let longest = requests.iter().map(|r| r.prompt_tokens).max().unwrap_or(0);
        format!("{sessions} coding-agent sessions × {turns} turns, closed loop, 2 shared 8,000-token system+tools heads, 500-token task per session, each turn appends the 64-token answer and a 3,000–9,000-token tool result (sessions grow to {}k tokens); chat API", longest / 1000)
    })
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn unique_blocks(requests: &[BenchRequest]) -> usize {
    let mut seen = HashSet::new();
    for r in requests {
        seen.extend(r.chain.iter().copied());
    }
    seen.len()
}

fn total_tokens(requests: &[BenchRequest]) -> u64 {
    requests.iter().map(|r| r.prompt_tokens).sum::<u64>().max(1)
}

/// Cached tokens of one pooled LRU of `capacity` blocks over the sequence.
fn lru_hits(requests: &[BenchRequest], capacity: usize) -> u64 {
    let mut cache = KvCache::new(capacity, 1);
    let mut hits = 0;
    for r in requests {
        hits += r.cached_tokens(cache.cached_prefix(&r.chain));
        cache.insert_chain(&r.chain);
    }
    hits
}

/// Token-weighted hit rate of one pooled LRU of `capacity` blocks.
pub fn lru_hit_rate(requests: &[BenchRequest], capacity: usize) -> f64 {
    lru_hits(requests, capacity) as f64 / total_tokens(requests) as f64
}

fn infinite_hits(requests: &[BenchRequest]) -> u64 {
    let mut seen = HashSet::new();
    let mut hits = 0;
    for r in requests {
        let held = r.chain.iter().take_while(|h| seen.contains(*h)).count();
        hits += r.cached_tokens(held);
        seen.extend(r.chain.iter().copied());
    }
    hits
}

/// Token-weighted hit rate of an unbounded cache.
pub fn infinite_hit_rate(requests: &[BenchRequest]) -> f64 {
    infinite_hits(requests) as f64 / total_tokens(requests) as f64
}

/// The working set: the smallest pooled LRU capacity whose hits reach 99%
/// of the infinite cache's (binary search; LRU hits grow with capacity).
pub fn knee(requests: &[BenchRequest], unique: usize) -> usize {
    let goal = (infinite_hits(requests) as f64 * 0.99).ceil() as u64;
    let (mut lo, mut hi) = (1usize, unique.max(1));
    while lo < hi {
        let mid = (lo + hi) / 2;
        if lru_hits(requests, mid) >= goal {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> GenOptions {
        GenOptions {
            quick: true,
            seed: 42,
            load: 0.7,
            pods: 4,
            trace_path: std::path::PathBuf::new(),
            speedup: None,
            trace_requests: None,
            trace_offset: None,
            plugin_extra: json!({}),
            stock_vllm: false,
            prefill_speeds: Vec::new(),
            cpu_tier: false,
            tokenizer: None,
            time_scale: None,
        }
    }

    #[test]
    fn fast_pods_are_the_fastest_of_a_mixed_pool() {
        let mut w = build("shared-prefix", &opts()).unwrap();
        assert_eq!(w.fast_pods(), Vec::<usize>::new(), "one speed");
        w.prefill_speeds = vec![1.0, 1.0, 0.5, 0.5];
        assert_eq!(w.fast_pods(), [0, 1]);
        // Pods past the list run at 1.
        w.prefill_speeds = vec![0.5];
        assert_eq!(w.fast_pods(), [1, 2, 3]);
        w.prefill_speeds = vec![2.0, 2.0, 2.0, 2.0];
        assert_eq!(w.fast_pods(), Vec::<usize>::new(), "one speed");
    }

    #[test]
    fn workloads_are_deterministic_and_sized() {
        for name in [
            "shared-prefix",
            "multi-turn",
            "lora",
            "agentic",
            "long-context",
        ] {
            let a = build(name, &opts()).unwrap();
            let b = build(name, &opts()).unwrap();
            assert_eq!(a.requests.len(), b.requests.len());
            assert!(a
                .requests
                .iter()
                .zip(&b.requests)
                .all(|(x, y)| x.body == y.body && x.at_s == y.at_s));
            assert!(a.requests.windows(2).all(|w| w[0].at_s <= w[1].at_s));
            // More than one pod holds, less than all pods together.
            assert!(a.working_set_blocks > a.kv_blocks, "{name}");
            assert!(a.working_set_blocks < a.kv_blocks * a.pods, "{name}");
            assert!(a.bounds.pooled <= a.bounds.infinite + 1e-9);
            assert!(a.bounds.pooled > 0.9 * a.bounds.infinite, "{name}");
        }
    }

    #[test]
    fn agentic_turns_follow_their_predecessor() {
        let w = build("agentic", &opts()).unwrap();
        assert_eq!(w.agents, Some(24));
        let firsts = w.requests.iter().filter(|r| r.follows.is_none()).count();
        assert_eq!(firsts, 24, "one open-loop first turn per agent");
        for r in &w.requests {
            if let Some(previous) = r.follows {
                let p = &w.requests[previous];
                assert_eq!(p.session, r.session);
                assert!(p.at_s < r.at_s);
                assert_eq!(r.chain[..p.chain.len()], p.chain[..], "history grows");
            }
        }
    }

    #[test]
    fn multi_turn_rounds_extend_their_history() {
        let w = build("multi-turn", &opts()).unwrap();
        let first = w
            .requests
            .iter()
            .find(|r| r.session == "user-0")
            .expect("user 0");
        let later = w
            .requests
            .iter()
            .rfind(|r| r.session == "user-0")
            .expect("user 0");
        assert!(later.chain.len() > first.chain.len());
        assert_eq!(later.chain[..first.chain.len()], first.chain[..]);
    }
}
