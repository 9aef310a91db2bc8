//! The `kvroute-sim` server: a simulated vLLM pod speaking the OpenAI API,
//! vLLM's `/metrics` and kvroute's report protocol v1, with fault injection
//! under `/admin`. The cache, cost model and prefill engine live in
//! [`crate::model`]; this module adds time (tokio, sleeping until the times
//! the model computes), the sequence slots and their queue, and HTTP.
//!
//! A request waits for one of `--max-batch` sequence slots (FIFO), then its
//! prefill is scheduled on the pod's [`crate::model::PrefillEngine`] (FIFO,
//! one prefill at a time); its first token comes after its prefill plus the
//! per-request overhead, the rest one per decode step, holding the slot
//! until the last. `queueDepth` / `vllm:num_requests_waiting` counts
//! requests waiting for a slot or for their prefill to start; `running`
//! those in prefill or decode.
//!
//! Endpoints:
//! - `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE),
//!   `GET /v1/models` (vLLM's order and shape: [`served_models`]),
//!   `GET /health`, `GET /metrics`;
//! - `GET {reportPath}?since=SEQ&epoch=E&wait=MS` (`/kvroute/v1/report` by
//!   default): with `wait`, a request for this epoch whose `since` is the
//!   cache's current `seq` is held until the cache logs an event or `wait`
//!   (at most [`MAX_REPORT_WAIT_MS`]) ends; at most [`REPORT_WAITERS`] are
//!   held at once, others answer at once, as do the report faults and a sim
//!   started with `--no-long-poll`;
//! - `POST /admin/fault`, `GET /admin/stats`, `POST /admin/reset-stats`;
//! - with `--kv-events`, vLLM's ZMQ KV events too ([`crate::kv_events`]).
//!
//! Every response carries `x-sim-pod: <pod id>`.
//!
//! `--pods N` serves N such pods from one process (a listener, cache, slots
//! and report log each, one runtime), so a 2-core machine runs a pool of
//! 1,024 pods behind one Envoy.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Query, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::{Json, Router};
use clap::Parser;
use kvroute::chat_template::PromptRenderer;
use kvroute::config::{Config, ModelTarget};
use kvroute::hashing::BlockLayout;
use kvroute::report_log::{new_epoch, random_u64};
use kvroute::request::Prompt;
use kvroute_vllm_bridge::wire::Shape;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};

use crate::kv_events::{Publisher, PublisherOptions};
use crate::model::{
    AdapterSlots, Admission, CostModel, KvCache, PodLoad, PodModel, DEFAULT_LOG_EVENTS,
};
use crate::tokenizer::SimTokenizer;

/// Longest `wait` the report endpoint honours.
pub const MAX_REPORT_WAIT_MS: u64 = 60_000;

/// Report requests held at once (the router keeps one pending per pod).
pub const REPORT_WAITERS: usize = 4;

/// The context length `/v1/models` states for the base model.
pub const MAX_MODEL_LEN: u32 = 8192;

/// Command-line options of `kvroute-sim`.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvroute-sim", about = "A simulated vLLM pod for kvroute tests")]
pub struct SimOptions {
    /// Port to listen on (0: any free port; the startup line says which).
    /// With `--pods N`, pod i listens on `port + i` (each on any free port
    /// when 0).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Simulated pods this process serves, each on its own listener with
    /// its own cache, slots and report log, all on one runtime: how a
    /// 2-core machine runs hundreds of pods behind one Envoy. Not with
    /// `--kv-events` or `--tokenizer`.
    #[arg(long, default_value_t = 1)]
    pub pods: usize,
    /// The index of this process's first pod in `{i}` of `--pod-id` (pods
    /// of one pool served by several processes).
    #[arg(long, default_value_t = 0)]
    pub first_index: usize,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Pod id in reports and `x-sim-pod` (default: `sim-<port>`); `{i}`
    /// and `{port}` in it are replaced by the pod's index and port (with
    /// `--pods`, e.g. `pod-{i}`).
    #[arg(long)]
    pub pod_id: Option<String>,
    /// The kvroute configuration JSON the router uses (hashing, models).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// KV cache capacity in blocks.
    #[arg(long, default_value_t = 4096)]
    pub kv_blocks: usize,
    /// A CPU tier of this many blocks (0: none): blocks the GPU evicts move
    /// there, and a hit on one costs a reload (see [`crate::model`]);
    /// reports and `--kv-events` give each block's tier.
    #[arg(long, default_value_t = 0)]
    pub cpu_kv_blocks: usize,
    /// GB/s of reloads from the CPU tier (PCIe 4.0 x16 as DMA reaches it).
    #[arg(long, default_value_t = crate::model::PCIE_GBPS)]
    pub cpu_reload_gbps: f64,
    /// Sequence slots (vLLM's `max_num_seqs`): requests admitted at once,
    /// from prefill to their last token; the rest wait in a FIFO queue.
    #[arg(long, default_value_t = 64)]
    pub max_batch: usize,
    /// Multiplies every simulated duration.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Prefill speed as a multiple of the cost model's (0.5: a GPU half as
    /// fast at prefill), for mixed pools.
    #[arg(long, default_value_t = 1.0)]
    pub prefill_speed: f64,
    /// LoRA adapter slots.
    #[arg(long, default_value_t = 4)]
    pub max_loras: usize,
    /// Adapters loaded at start (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub preload_adapters: Vec<String>,
    /// `name=rank` of an adapter (repeatable or comma-separated; default rank 16).
    #[arg(long, value_delimiter = ',', value_parser = parse_rank)]
    pub adapter_rank: Vec<(String, u32)>,
    /// Model names the pod serves, listed by `/v1/models` in vLLM's order
    /// ([`served_models`]; default: the config's models, or `sim-model`).
    #[arg(long, value_delimiter = ',')]
    pub served_model: Vec<String>,
    /// Bound of the report event log (block events).
    #[arg(long, default_value_t = DEFAULT_LOG_EVENTS)]
    pub log_events: usize,
    /// Fill the cache at start with this many synthetic prompts (see
    /// [`preload_prompt`]), for benchmarks that need a large index.
    #[arg(long, default_value_t = 0)]
    pub preload_prompts: usize,
    /// Size of each preloaded prompt in bytes.
    #[arg(long, default_value_t = 16384)]
    pub preload_prompt_bytes: usize,
    /// Ignore the report endpoint's `wait` (a pod without long-poll).
    #[arg(long)]
    pub no_long_poll: bool,
    /// Serve no report endpoint (404), like stock vLLM; the `report` fault
    /// `ok` turns it on.
    #[arg(long)]
    pub no_report: bool,
    /// The `block_size` `/metrics` states in `vllm:cache_config_info`
    /// (default: the config's `blockSizeTokens`, which the pod caches
    /// in): a pod whose vLLM says it runs with another block size, as
    /// vLLM's CPU build runs with 32 where kvroute's default is 16.
    #[arg(long)]
    pub metrics_block_size: Option<usize>,
    /// Also publish the cache as vLLM's KV events on this ZMQ PUB endpoint
    /// (bound: e.g. `tcp://127.0.0.1:5557` or `ipc:///tmp/kv-events.sock`;
    /// token-ID prompts only, see [`crate::kv_events`]).
    #[arg(long)]
    pub kv_events: Option<String>,
    /// vLLM's replay endpoint (ZMQ ROUTER) for `--kv-events`.
    #[arg(long)]
    pub kv_replay: Option<String>,
    /// vLLM's `topic` for `--kv-events`.
    #[arg(long, default_value = "")]
    pub kv_topic: String,
    /// Batches the replay socket keeps (vLLM's `buffer_steps`).
    #[arg(long, default_value_t = 10_000)]
    pub kv_replay_buffer: usize,
    /// msgspec's struct shape of the events: `map` (vLLM from mid-2026)
    /// or `array` (older vLLM's positional arrays).
    #[arg(long, default_value = "map", value_parser = parse_shape)]
    pub kv_events_format: Shape,
    /// Publish `extra_keys` (adapter, `cache_salt`) in the typed form
    /// proposed upstream (vLLM PR 55488: `LoRAKey`, `CacheSaltKey` tagged
    /// structs) instead of vLLM's raw tuples: a vLLM the bridge does not
    /// know yet.
    #[arg(long)]
    pub kv_typed_extra_keys: bool,
    /// Tokenize text and chat prompts as vLLM does, with this tokenizer
    /// (`cl100k_base`), and cache token blocks of `blockSizeTokens`
    /// ([`crate::tokenizer`]); with `--kv-events` they are published.
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// Write `--tokenizer`'s vocabulary as a Hugging Face `tokenizer.json`
    /// to this file (for kvroute-vllm-bridge's `--tokenizer`) and exit.
    #[arg(long, requires = "tokenizer")]
    pub write_tokenizer_json: Option<PathBuf>,
}

fn parse_shape(text: &str) -> Result<Shape, String> {
    match text {
        "map" => Ok(Shape::Map),
        "array" => Ok(Shape::Positional),
        _ => Err(format!("expected map or array, got {text:?}")),
    }
}

/// The `i`-th synthetic prompt a pod preloads: distinct per pod and index
/// from the first block on, so a benchmark can ask for exactly what one pod
/// holds.
pub fn preload_prompt(pod_id: &str, i: usize, bytes: usize) -> String {
    let mut text = format!("[{pod_id}/{i}] ");
    let mut word = 0u64;
    while text.len() < bytes {
        text.push_str(&format!("preloaded context {pod_id} {i} {word}. "));
        word += 1;
    }
    text.truncate(bytes);
    text
}

/// One entry of `/v1/models`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedModel {
    pub id: String,
    /// vLLM's `root`: a base model's path (here its `baseModel`), or an
    /// adapter's (here its adapter name).
    pub root: String,
    /// The base model a LoRA adapter applies to (`None`: a base model).
    pub parent: Option<String>,
    /// What a request naming `id` runs.
    pub target: ModelTarget,
}

/// What the pod serves, in vLLM's order (`show_available_models`): the
/// base model's served names first, the one named as the model itself
/// before aliases, then the LoRA adapters, each with `parent` set to the
/// base model's first name. The names are `names` (`--served-model`), else
/// the config's models, else `sim-model`; an adapter's base model that no
/// name serves directly is served anyway, first, as vLLM always serves
/// its base model. Routers that register a worker for the first listed
/// model (SGLang's gateway) thus see the base model.
pub fn served_models(names: &[String], config: &Config) -> Vec<ServedModel> {
    let entries: Vec<(String, ModelTarget)> = if !names.is_empty() {
        names
            .iter()
            .map(|name| {
                let target = config.resolve_model(name).unwrap_or_else(|| ModelTarget {
                    base_model: name.clone(),
                    adapter: None,
                });
                (name.clone(), target)
            })
            .collect()
    } else if !config.models.is_empty() {
        config
            .models
            .iter()
            .map(|(name, target)| (name.clone(), target.clone()))
            .collect()
    } else {
        let name = "sim-model".to_string();
        vec![(
            name.clone(),
            ModelTarget {
                base_model: name,
                adapter: None,
            },
        )]
    };
    let (mut bases, adapters): (Vec<_>, Vec<_>) =
        entries.into_iter().partition(|(_, t)| t.adapter.is_none());
    // Stable: each base model's own name before its aliases.
    bases.sort_by_key(|(name, target)| *name != target.base_model);
    for (_, target) in &adapters {
        if !bases.iter().any(|(_, t)| t.base_model == target.base_model) {
            let base = ModelTarget {
                base_model: target.base_model.clone(),
                adapter: None,
            };
            bases.push((target.base_model.clone(), base));
        }
    }
    let parent = |base_model: &str| {
        bases
            .iter()
            .find(|(_, t)| t.base_model == base_model)
            .map(|(name, _)| name.clone())
    };
    let adapters: Vec<ServedModel> = adapters
        .iter()
        .map(|(name, target)| ServedModel {
            id: name.clone(),
            root: target.adapter.clone().unwrap_or_default(),
            parent: parent(&target.base_model),
            target: target.clone(),
        })
        .collect();
    bases
        .into_iter()
        .map(|(name, target)| ServedModel {
            id: name,
            root: target.base_model.clone(),
            parent: None,
            target,
        })
        .chain(adapters)
        .collect()
}

fn parse_rank(text: &str) -> Result<(String, u32), String> {
    let (name, rank) = text
        .split_once('=')
        .ok_or_else(|| format!("expected name=rank, got {text:?}"))?;
    let rank = rank
        .parse()
        .map_err(|_| format!("rank of {name:?} is not a number"))?;
    Ok((name.to_string(), rank))
}

/// How the report endpoint misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReportMode {
    Ok,
    Error,
    Slow,
    Garbage,
    /// Headers and the first half of the real report, then nothing for 5 s
    /// (the rest after that): a pod that dies or hangs mid-body.
    Stall,
    /// 404, as stock vLLM answers a report request.
    NotFound,
}

impl ReportMode {
    fn name(self) -> &'static str {
        match self {
            ReportMode::Ok => "ok",
            ReportMode::Error => "error",
            ReportMode::Slow => "slow",
            ReportMode::Garbage => "garbage",
            ReportMode::Stall => "stall",
            ReportMode::NotFound => "notFound",
        }
    }
}

#[derive(Debug, Clone)]
struct Faults {
    error_rate: f64,
    report: ReportMode,
    health: Option<f64>,
    gpu_utilization: Option<f64>,
    queue_depth: Option<u32>,
    /// How long `/metrics` holds a page after rendering it (vLLM renders
    /// its gauges when scraped, then sends the page).
    metrics_delay_ms: u64,
}

impl Faults {
    fn json(&self, hang: bool, engine_stall: bool) -> Value {
        json!({
            "hang": hang,
            "engineStall": engine_stall,
            "errorRate": self.error_rate,
            "report": self.report.name(),
            "health": self.health,
            "gpuUtilization": self.gpu_utilization,
            "queueDepth": self.queue_depth,
            "metricsDelayMs": self.metrics_delay_ms,
        })
    }
}

#[derive(Debug, Clone, Default)]
struct Stats {
    requests: u64,
    /// Of `cached_tokens`, those reloaded from the CPU tier.
    reloaded_tokens: u64,
    /// Report endpoint calls.
    report_requests: u64,
    /// Reports answered with `full: true` (a first report, a resync).
    full_reports: u64,
    completed: u64,
    errors: u64,
    cached_tokens: u64,
    prompt_tokens: u64,
    /// Prompt tokens prefilled (computed, not cached in either tier).
    prefill_tokens: u64,
    max_queue_seen: u32,
    ttft_ms_sum: f64,
    adapter_loads_at_reset: u64,
}

struct Inner {
    pod: PodModel,
    stats: Stats,
    /// Lifetime counters for `/metrics` (never reset).
    query_tokens_total: u64,
    /// GPU prefix-cache hits (vLLM's local ones).
    hit_tokens_total: u64,
    /// CPU-tier hits (vLLM's external ones, through its KV connector).
    external_hit_tokens_total: u64,
    /// Waiting for a slot, or holding one with the prefill not started.
    waiting: u32,
    /// In prefill or decode.
    running: u32,
    /// KV blocks the running requests' prompts occupy: vLLM's
    /// `kv_cache_usage_perc` counts these, not cached blocks of finished
    /// requests (those are free, reusable until evicted).
    running_blocks: usize,
    faults: Faults,
    rng: u64,
}

struct Sim {
    pod_id: String,
    epoch: String,
    config: Config,
    /// The router's own reading of request bodies (chat templates
    /// included), so the pod caches the prompt the router hashed.
    prompts: PromptRenderer,
    served: Vec<ServedModel>,
    max_batch: usize,
    cost: CostModel,
    slots: Arc<Semaphore>,
    /// The prefill engine's epoch.
    origin: Instant,
    hang: watch::Sender<bool>,
    /// The engine stalls: completions are held, reports and metrics answer
    /// (vLLM's API server stays up while its engine is stuck).
    engine_stall: watch::Sender<bool>,
    /// The cache's `seq`, for report requests waiting for an event.
    cache_seq: watch::Sender<u64>,
    report_waiters: Semaphore,
    long_poll: bool,
    /// `--metrics-block-size`, else `blockSizeTokens`.
    metrics_block_size: usize,
    /// `--kv-events`: the vLLM-style event publisher.
    kv_events: Option<Arc<Publisher>>,
    /// `--tokenizer`: text prompts are cached as vLLM's token blocks.
    tokenizer: Option<SimTokenizer>,
    next_id: AtomicU64,
    inner: Mutex<Inner>,
}

impl Sim {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What a request for model `name` runs: a configured model, or a
    /// base model the pod serves for its adapters.
    fn target(&self, name: &str) -> Option<ModelTarget> {
        self.config.resolve_model(name).or_else(|| {
            self.served
                .iter()
                .find(|model| model.id == name)
                .map(|model| model.target.clone())
        })
    }

    /// Now, on the prefill engine's clock.
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    /// A time on the prefill engine's clock, for `sleep_until`.
    fn at(&self, time: Duration) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.origin + time)
    }

    /// Wakes the report requests waiting for a cache event (call after
    /// changing the cache, with the lock held).
    fn cache_changed(&self, inner: &Inner) {
        self.cache_seq.send_replace(inner.pod.cache.seq());
        if let Some(publisher) = &self.kv_events {
            publisher.publish(&inner.pod.cache, false);
        }
    }

    fn load(&self, inner: &Inner) -> PodLoad {
        PodLoad {
            queue_depth: inner.faults.queue_depth.unwrap_or(inner.waiting),
            running: inner.running,
            gpu_utilization: inner
                .faults
                .gpu_utilization
                .unwrap_or(inner.running as f64 / self.max_batch as f64)
                .clamp(0.0, 1.0),
            health: inner.faults.health.unwrap_or(1.0),
            adapters: inner.pod.adapters.loaded().to_vec(),
        }
    }
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// Loads the kvroute configuration: the file when given (validated like the
/// router does), else all defaults.
pub fn load_config(path: Option<&std::path::Path>) -> Result<Config, String> {
    match path {
        None => Ok(Config::default()),
        Some(path) => {
            let bytes =
                std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            Config::parse(&bytes).map_err(|e| e.to_string())
        }
    }
}

/// Binds, prints `kvroute-sim <pod-id> listening on <addr>` (a line per
/// pod) and serves until the process ends (SIGINT/SIGTERM exit).
pub async fn run(options: SimOptions) -> Result<(), String> {
    if !(options.cpu_reload_gbps.is_finite() && options.cpu_reload_gbps > 0.0) {
        return Err(format!(
            "--cpu-reload-gbps must be a positive number (got {})",
            options.cpu_reload_gbps
        ));
    }
    let config = load_config(options.config.as_deref())?;
    let tokenizer = options
        .tokenizer
        .as_deref()
        .map(SimTokenizer::named)
        .transpose()?;
    if let (Some(tokenizer), Some(path)) = (&tokenizer, &options.write_tokenizer_json) {
        let json = tokenizer.tokenizer_json().to_string();
        return std::fs::write(path, json).map_err(|e| format!("{}: {e}", path.display()));
    }
    if options.pods == 0 {
        return Err("--pods must be at least 1".into());
    }
    if options.pods > 1 && (options.kv_events.is_some() || tokenizer.is_some()) {
        return Err("--pods serves several pods without --kv-events or --tokenizer".into());
    }
    let mut servers = tokio::task::JoinSet::new();
    let mut tokenizer = tokenizer;
    for i in 0..options.pods {
        let port = match options.port {
            0 => 0,
            base => u16::try_from(usize::from(base) + i)
                .map_err(|_| format!("--port {base} + --pods {} passes 65535", options.pods))?,
        };
        let listener = TcpListener::bind((options.host.as_str(), port))
            .await
            .map_err(|e| format!("cannot listen on {}:{port}: {e}", options.host))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let kv_events = match &options.kv_events {
            Some(endpoint) => Some(
                Publisher::start(PublisherOptions {
                    endpoint: endpoint.clone(),
                    replay_endpoint: options.kv_replay.clone(),
                    topic: options.kv_topic.clone(),
                    buffer_steps: options.kv_replay_buffer,
                    shape: options.kv_events_format,
                    typed_extra_keys: options.kv_typed_extra_keys,
                    layout: BlockLayout::tokens(&config).uncapped(),
                })
                .await?,
            ),
            None => None,
        };
        let pod_id = pod_id(
            options.pod_id.as_deref(),
            options.first_index + i,
            addr.port(),
        );
        let pod_options = SimOptions {
            pod_id: Some(pod_id.clone()),
            ..options.clone()
        };
        let app = app(
            &pod_options,
            config.clone(),
            addr,
            kv_events,
            tokenizer.take(),
        );
        println!("kvroute-sim {pod_id} listening on {addr}");
        // TCP_NODELAY on every accepted connection, as vLLM's server does:
        // without it a client that does not batch its writes waits out ~40
        // ms delayed ACKs on small responses and SSE chunks.
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        servers.spawn(async move { axum::serve(listener, app).await.map_err(|e| e.to_string()) });
    }
    let _ = std::io::stdout().flush();
    tokio::select! {
        Some(served) = servers.join_next() => served.map_err(|e| e.to_string())?,
        _ = shutdown_signal() => Ok(()),
    }
}

/// Pod `i`'s id: `template` with `{i}` and `{port}` replaced, else
/// `sim-<port>`.
fn pod_id(template: Option<&str>, i: usize, port: u16) -> String {
    match template {
        Some(template) => template
            .replace("{i}", &i.to_string())
            .replace("{port}", &port.to_string()),
        None => format!("sim-{port}"),
    }
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The router of one simulated pod listening on `addr`.
pub fn app(
    options: &SimOptions,
    config: Config,
    addr: SocketAddr,
    kv_events: Option<Arc<Publisher>>,
    tokenizer: Option<SimTokenizer>,
) -> Router {
    let pod_id = options
        .pod_id
        .clone()
        .unwrap_or_else(|| format!("sim-{}", addr.port()));
    let mut cost = CostModel::gpu_8b(options.time_scale).with_reload_gbps(options.cpu_reload_gbps);
    cost.prefill_s_per_token /= options.prefill_speed.max(f64::MIN_POSITIVE);
    let ranks: HashMap<String, u32> = options.adapter_rank.iter().cloned().collect();
    let mut adapters = AdapterSlots::new(options.max_loras, ranks);
    for name in options.preload_adapters.iter().filter(|n| !n.is_empty()) {
        adapters.preload(name);
    }
    let served = served_models(&options.served_model, &config);
    let max_batch = options.max_batch.max(1);
    let mut pod = PodModel::new(
        &config,
        KvCache::new(options.kv_blocks, options.log_events).with_cpu_tier(options.cpu_kv_blocks),
        adapters,
        cost.clone(),
    );
    if let Some(target) = served.first().map(|model| model.target.clone()) {
        for i in 0..options.preload_prompts {
            let text = preload_prompt(&pod_id, i, options.preload_prompt_bytes);
            let chain = pod
                .hasher
                .chain(&target, &Prompt::Text(text.into_bytes()), None);
            pod.cache.insert_chain(&chain);
        }
    }
    let report_path = config.report_path.clone();
    let metrics_block_size = options
        .metrics_block_size
        .unwrap_or(config.block_size_tokens);
    let seq = pod.cache.seq();
    let sim = Arc::new(Sim {
        pod_id,
        epoch: new_epoch(),
        prompts: PromptRenderer::new(&config),
        config,
        served,
        max_batch,
        cost,
        slots: Arc::new(Semaphore::new(max_batch)),
        origin: Instant::now(),
        hang: watch::channel(false).0,
        engine_stall: watch::channel(false).0,
        cache_seq: watch::channel(seq).0,
        report_waiters: Semaphore::new(REPORT_WAITERS),
        long_poll: !options.no_long_poll,
        metrics_block_size,
        kv_events,
        tokenizer,
        next_id: AtomicU64::new(1),
        inner: Mutex::new(Inner {
            pod,
            stats: Stats::default(),
            query_tokens_total: 0,
            hit_tokens_total: 0,
            external_hit_tokens_total: 0,
            waiting: 0,
            running: 0,
            running_blocks: 0,
            faults: Faults {
                error_rate: 0.0,
                report: if options.no_report {
                    ReportMode::NotFound
                } else {
                    ReportMode::Ok
                },
                health: None,
                gpu_utilization: None,
                queue_depth: None,
                metrics_delay_ms: 0,
            },
            rng: random_u64() | 1,
        }),
    });
    let mut router = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/admin/fault", post(fault))
        .route("/admin/stats", get(stats))
        .route("/admin/reset-stats", post(reset_stats));
    router = router.route(&report_path, get(report));
    if report_path != "/kvroute/v1/report" {
        router = router.route("/kvroute/v1/report", get(report));
    }
    router
        .layer(middleware::from_fn_with_state(sim.clone(), gate))
        .with_state(sim)
}

/// Holds new non-admin requests while the `hang` fault is on, and new
/// completions while `engineStall` is, and tags every response with
/// `x-sim-pod`.
async fn gate(State(sim): State<Arc<Sim>>, request: Request, next: Next) -> Response {
    let path = request.uri().path();
    if !path.starts_with("/admin/") {
        let mut hang = sim.hang.subscribe();
        let _ = hang.wait_for(|h| !*h).await;
    }
    if path.starts_with("/v1/") {
        let mut stall = sim.engine_stall.subscribe();
        let _ = stall.wait_for(|s| !*s).await;
    }
    let mut response = next.run(request).await;
    if let Ok(value) = HeaderValue::from_str(&sim.pod_id) {
        response.headers_mut().insert("x-sim-pod", value);
    }
    response
}

/// A vLLM-style JSON error.
fn error_response(status: StatusCode, message: &str, kind: &str) -> Response {
    let body = json!({
        "error": {
            "message": message,
            "type": kind,
            "param": null,
            "code": status.as_u16(),
        }
    });
    (status, Json(body)).into_response()
}

async fn completions(State(sim): State<Arc<Sim>>, body: Bytes) -> Response {
    infer(sim, body, false).await
}

async fn chat_completions(State(sim): State<Arc<Sim>>, body: Bytes) -> Response {
    infer(sim, body, true).await
}

/// Counts a waiting request while alive.
struct Waiting(Arc<Sim>);

impl Waiting {
    fn new(sim: &Arc<Sim>) -> Waiting {
        let mut inner = sim.lock();
        inner.waiting += 1;
        inner.stats.max_queue_seen = inner.stats.max_queue_seen.max(inner.waiting);
        drop(inner);
        Waiting(sim.clone())
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.lock().waiting -= 1;
    }
}

/// A running request (prefill started): holds a sequence slot and its
/// prompt's KV blocks, counted while alive.
struct Running {
    sim: Arc<Sim>,
    blocks: usize,
    _permit: OwnedSemaphorePermit,
}

impl Running {
    fn new(sim: &Arc<Sim>, permit: OwnedSemaphorePermit, blocks: usize) -> Running {
        let mut inner = sim.lock();
        inner.running += 1;
        inner.running_blocks += blocks;
        drop(inner);
        Running {
            sim: sim.clone(),
            blocks,
            _permit: permit,
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut inner = self.sim.lock();
        inner.running -= 1;
        inner.running_blocks -= self.blocks;
    }
}

/// A prefill scheduled on the engine: if the request goes away before its
/// prefill is done, its chain stops counting as pending.
struct Scheduled {
    sim: Arc<Sim>,
    admission: Option<Admission>,
}

impl Scheduled {
    /// Prefill done: the blocks enter the cache and its computed tokens
    /// count (whether or not the client waits for the first token).
    fn finish(mut self) -> Admission {
        let admission = self.admission.take().expect("finished once");
        let mut inner = self.sim.lock();
        inner.pod.finish_prefill(&admission);
        inner.stats.prefill_tokens += admission.uncached_tokens();
        self.sim.cache_changed(&inner);
        drop(inner);
        admission
    }
}

impl Drop for Scheduled {
    fn drop(&mut self) {
        if let Some(admission) = self.admission.take() {
            self.sim.lock().pod.abandon_prefill(&admission);
        }
    }
}

/// What the reply needs to say.
struct Reply {
    id: String,
    created: u64,
    model: String,
    chat: bool,
    prompt_tokens: u64,
    cached_tokens: u64,
    max_tokens: u64,
}

impl Reply {
    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.max_tokens,
            "total_tokens": self.prompt_tokens + self.max_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    fn text(&self) -> String {
        (0..self.max_tokens).map(token_text).collect()
    }

    fn full(&self) -> Value {
        let choice = if self.chat {
            json!({
                "index": 0,
                "message": {"role": "assistant", "content": self.text(), "tool_calls": []},
                "logprobs": null,
                "finish_reason": "length",
                "stop_reason": null,
            })
        } else {
            json!({
                "index": 0,
                "text": self.text(),
                "logprobs": null,
                "finish_reason": "length",
                "stop_reason": null,
            })
        };
        json!({
            "id": self.id,
            "object": if self.chat { "chat.completion" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        })
    }

    fn chunk(&self, choice: Value) -> Value {
        json!({
            "id": self.id,
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    /// The chunk carrying output token `i`.
    fn token_chunk(&self, i: u64) -> Value {
        let finish = if i + 1 == self.max_tokens {
            json!("length")
        } else {
            Value::Null
        };
        if self.chat {
            self.chunk(json!({
                "index": 0,
                "delta": {"content": token_text(i)},
                "logprobs": null,
                "finish_reason": finish,
            }))
        } else {
            self.chunk(json!({
                "index": 0,
                "text": token_text(i),
                "logprobs": null,
                "finish_reason": finish,
                "stop_reason": null,
            }))
        }
    }

    fn usage_chunk(&self) -> Value {
        json!({
            "id": self.id,
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(),
        })
    }
}

/// Deterministic filler output: token `i` is ` tok{i}`.
pub fn token_text(i: u64) -> String {
    format!(" tok{i}")
}

fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

async fn infer(sim: Arc<Sim>, body: Bytes, chat: bool) -> Response {
    sim.lock().stats.requests += 1;
    let fail = |status: StatusCode, message: &str, kind: &str| {
        sim.lock().stats.errors += 1;
        error_response(status, message, kind)
    };
    let mut parsed = match sim.prompts.prompt(&body, chat) {
        Ok(parsed) => parsed,
        Err(e) => return fail(StatusCode::BAD_REQUEST, &e.0, "BadRequestError"),
    };
    if let Some(tokenizer) = &sim.tokenizer {
        parsed.prompt = tokenizer.tokenize(parsed.prompt);
    }
    let Some(target) = sim.target(&parsed.model) else {
        let message = format!("The model `{}` does not exist.", parsed.model);
        return fail(StatusCode::NOT_FOUND, &message, "NotFoundError");
    };
    let inject = {
        let mut inner = sim.lock();
        let rate = inner.faults.error_rate;
        rate > 0.0 && next_unit(&mut inner.rng) < rate
    };
    if inject {
        return fail(
            StatusCode::INTERNAL_SERVER_ERROR,
            "simulated engine failure (fault injection)",
            "InternalServerError",
        );
    }
    let raw: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let max_tokens = raw
        .get("max_tokens")
        .and_then(Value::as_u64)
        .or_else(|| raw.get("max_completion_tokens").and_then(Value::as_u64))
        .unwrap_or(16)
        .max(1);
    let include_usage = raw
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);

    let arrived = Instant::now();
    let waiting = Waiting::new(&sim);
    let Ok(permit) = sim.slots.clone().acquire_owned().await else {
        return fail(
            StatusCode::SERVICE_UNAVAILABLE,
            "engine is shutting down",
            "ServiceUnavailableError",
        );
    };
    // A slot: load the adapter if needed, then queue on the prefill engine.
    let (admission, slot) = {
        let mut inner = sim.lock();
        let admission = inner
            .pod
            .admit(&target, &parsed.prompt, parsed.cache_salt.as_deref());
        let slot = inner.pod.schedule_prefill(&admission, sim.now());
        (admission, slot)
    };
    let blocks = admission.chain.len();
    let admission_chain = sim
        .kv_events
        .as_ref()
        .map(|_| admission.chain.clone())
        .unwrap_or_default();
    let scheduled = Scheduled {
        sim: sim.clone(),
        admission: Some(admission),
    };
    // A start already due is not slept for: the timer's millisecond tick
    // would keep the request counted waiting after it took its slot, and
    // a request the gateway sent on the freed slot meanwhile read as one
    // over `maxQueue`.
    let start = sim.at(slot.start);
    if start > tokio::time::Instant::now() {
        tokio::time::sleep_until(start).await;
    }
    drop(waiting);
    let running = Running::new(&sim, permit, blocks);
    tokio::time::sleep_until(sim.at(slot.end)).await;
    if let (Some(publisher), Prompt::Tokens(tokens)) = (&sim.kv_events, &parsed.prompt) {
        publisher.admit(
            &admission_chain,
            tokens,
            target.adapter.as_deref(),
            parsed.cache_salt.as_deref(),
        );
    }
    let admission = scheduled.finish();
    tokio::time::sleep_until(sim.at(slot.first_token)).await;
    {
        let mut inner = sim.lock();
        inner.stats.cached_tokens += admission.cached_tokens;
        inner.stats.reloaded_tokens += admission.reload_tokens;
        inner.stats.prompt_tokens += admission.prompt_tokens;
        inner.stats.ttft_ms_sum += arrived.elapsed().as_secs_f64() * 1000.0;
        inner.query_tokens_total += admission.prompt_tokens;
        inner.hit_tokens_total += admission.cached_tokens - admission.reload_tokens;
        inner.external_hit_tokens_total += admission.reload_tokens;
    }
    let n = sim.next_id.fetch_add(1, Ordering::Relaxed);
    let reply = Reply {
        id: format!(
            "{}-{}-{n}",
            if chat { "chatcmpl" } else { "cmpl" },
            sim.pod_id
        ),
        created: unix_seconds(),
        model: parsed.model,
        chat,
        prompt_tokens: admission.prompt_tokens,
        cached_tokens: admission.cached_tokens,
        max_tokens,
    };
    if !parsed.stream {
        let last = slot.first_token + sim.cost.generation_after_first(max_tokens);
        tokio::time::sleep_until(sim.at(last)).await;
        sim.lock().stats.completed += 1;
        drop(running);
        return Json(reply.full()).into_response();
    }
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let step = sim.cost.decode_step();
    let streamer = sim.clone();
    tokio::spawn(async move {
        let _running = running;
        if reply.chat {
            let role = reply.chunk(json!({
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": null,
                "finish_reason": null,
            }));
            if tx.send(sse(&role)).await.is_err() {
                return;
            }
        }
        for i in 0..reply.max_tokens {
            if i > 0 {
                tokio::time::sleep(step).await;
            }
            if tx.send(sse(&reply.token_chunk(i))).await.is_err() {
                return;
            }
        }
        if include_usage && tx.send(sse(&reply.usage_chunk())).await.is_err() {
            return;
        }
        if tx
            .send(Bytes::from_static(b"data: [DONE]\n\n"))
            .await
            .is_ok()
        {
            streamer.lock().stats.completed += 1;
        }
    });
    let mut response = Body::from_stream(ChannelStream(rx)).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// A uniform value in [0, 1) from a xorshift64 state.
fn next_unit(state: &mut u64) -> f64 {
    let mut x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// An mpsc receiver as a body stream.
struct ChannelStream(mpsc::Receiver<Bytes>);

impl futures_core::Stream for ChannelStream {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|item| item.map(Ok))
    }
}

/// vLLM's `/v1/models`: a model card per served name, base model first
/// (its `max_model_len`), then the adapters (`parent`: the base model;
/// vLLM leaves their `max_model_len` null), each with vLLM's default
/// permission.
async fn models(State(sim): State<Arc<Sim>>) -> Response {
    let created = unix_seconds();
    let data: Vec<Value> = sim
        .served
        .iter()
        .enumerate()
        .map(|(i, model)| {
            json!({
                "id": model.id,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": model.root,
                "parent": model.parent,
                "max_model_len": model.parent.is_none().then_some(MAX_MODEL_LEN),
                "permission": [{
                    "id": format!("modelperm-{}-{i}", sim.pod_id),
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": false,
                    "allow_sampling": true,
                    "allow_logprobs": true,
                    "allow_search_indices": false,
                    "allow_view": true,
                    "allow_fine_tuning": false,
                    "organization": "*",
                    "group": null,
                    "is_blocking": false,
                }],
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn metrics(State(sim): State<Arc<Sim>>) -> Response {
    let (text, delay) = render_metrics(&sim);
    tokio::time::sleep(delay).await;
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// The `/metrics` page as vLLM renders it, and how long to hold it.
fn render_metrics(sim: &Sim) -> (String, Duration) {
    let inner = sim.lock();
    let load = sim.load(&inner);
    let usage = inner
        .faults
        .gpu_utilization
        .unwrap_or(inner.running_blocks as f64 / inner.pod.cache.capacity().max(1) as f64)
        .clamp(0.0, 1.0);
    let model = sim
        .served
        .first()
        .map_or("sim-model", |model| model.id.as_str());
    let labels = format!("model_name=\"{model}\"");
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let mut text = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, sample: String| {
        text.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{sample}\n"
        ));
    };
    metric(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        format!("{{{labels}}} {:.1}", load.running),
    );
    metric(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        format!("{{{labels}}} {:.1}", load.queue_depth),
    );
    metric(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        format!("{{{labels}}} {usage}"),
    );
    metric(
        "vllm:lora_requests_info",
        "gauge",
        "Running stats on lora requests.",
        format!(
            "{{max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"\"}} {now:.3}",
            inner.pod.adapters.max(),
            load.adapters.join(",")
        ),
    );
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        format!("{{{labels}}} {:.1}", inner.query_tokens_total),
    );
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        format!("{{{labels}}} {:.1}", inner.hit_tokens_total),
    );
    // What kvroute checks against its blockSizeTokens (vLLM states some
    // thirty more labels).
    metric(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
        format!(
            "{{block_size=\"{}\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"{}\"}} 1.0",
            sim.metrics_block_size,
            inner.pod.cache.capacity()
        ),
    );
    // As vLLM with a KV connector: what the CPU tier served.
    if inner.pod.cache.cpu_capacity() > 0 {
        metric(
            "vllm:external_prefix_cache_queries_total",
            "counter",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
            format!("{{{labels}}} {:.1}", inner.query_tokens_total),
        );
        metric(
            "vllm:external_prefix_cache_hits_total",
            "counter",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
            format!("{{{labels}}} {:.1}", inner.external_hit_tokens_total),
        );
    }
    (text, Duration::from_millis(inner.faults.metrics_delay_ms))
}

async fn report(
    State(sim): State<Arc<Sim>>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let mode = {
        let mut inner = sim.lock();
        inner.stats.report_requests += 1;
        inner.faults.report
    };
    match mode {
        ReportMode::Ok | ReportMode::Stall => {}
        ReportMode::Error => {
            return error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "simulated report failure",
                "InternalServerError",
            )
        }
        ReportMode::NotFound => return StatusCode::NOT_FOUND.into_response(),
        ReportMode::Slow => tokio::time::sleep(Duration::from_secs(5)).await,
        ReportMode::Garbage => {
            return (
                [(header::CONTENT_TYPE, "application/json")],
                "<html>this is not a report {\"version\":",
            )
                .into_response()
        }
    }
    let since = query.get("since").and_then(|s| s.parse::<u64>().ok());
    let epoch = query.get("epoch").map(String::as_str);
    let wait = query.get("wait").and_then(|w| w.parse::<u64>().ok());
    if let (Some(wait), Some(since), true, ReportMode::Ok) =
        (wait, since, epoch == Some(sim.epoch.as_str()), mode)
    {
        hold_report(&sim, since, wait).await;
    }
    let mut inner = sim.lock();
    let load = sim.load(&inner);
    let body = inner
        .pod
        .cache
        .report(&sim.pod_id, &sim.epoch, since, epoch, &load);
    if body["full"] == json!(true) {
        inner.stats.full_reports += 1;
    }
    drop(inner);
    if mode == ReportMode::Stall {
        return stalled_json(body.to_string().into_bytes());
    }
    Json(body).into_response()
}

/// Long-poll: waits until the cache's `seq` is no longer `since` (there
/// are events to report, or `since` is not ours) or `wait_ms` ends. Answers
/// at once without long-poll or when [`REPORT_WAITERS`] already wait.
async fn hold_report(sim: &Sim, since: u64, wait_ms: u64) {
    if !sim.long_poll {
        return;
    }
    let Ok(_waiter) = sim.report_waiters.try_acquire() else {
        return;
    };
    let mut seq = sim.cache_seq.subscribe();
    let wait = Duration::from_millis(wait_ms.min(MAX_REPORT_WAIT_MS));
    let _ = tokio::time::timeout(wait, seq.wait_for(|seq| *seq != since)).await;
}

/// `body` as JSON with its full `content-length`, of which only the first
/// half is sent at once; the rest follows 5 s later.
fn stalled_json(body: Vec<u8>) -> Response {
    let length = body.len();
    let mut first = Bytes::from(body);
    let rest = first.split_off(length / 2);
    let (tx, rx) = mpsc::channel::<Bytes>(2);
    tokio::spawn(async move {
        if tx.send(first).await.is_ok() {
            tokio::time::sleep(Duration::from_secs(5)).await;
            let _ = tx.send(rest).await;
        }
    });
    let mut response = Body::from_stream(ChannelStream(rx)).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    response
}

fn unit_or_null(value: &Value, field: &str) -> Result<Option<f64>, String> {
    match value {
        Value::Null => Ok(None),
        v => match v.as_f64() {
            Some(x) if x.is_finite() && (0.0..=1.0).contains(&x) => Ok(Some(x)),
            _ => Err(format!("`{field}` must be a number in [0, 1] or null")),
        },
    }
}

async fn fault(State(sim): State<Arc<Sim>>, body: Bytes) -> Response {
    let value: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                &format!("invalid JSON: {e}"),
                "BadRequestError",
            )
        }
    };
    let Some(object) = value.as_object() else {
        return error_response(
            StatusCode::BAD_REQUEST,
            "expected a JSON object",
            "BadRequestError",
        );
    };
    // Validate everything first, then apply.
    let mut problems = Vec::new();
    for (key, v) in object {
        let ok = match key.as_str() {
            "crash" | "hang" | "engineStall" | "evictAll" | "silent" | "flushSilent" => {
                v.is_boolean()
            }
            "clearAll" | "kvGarbage" => v.is_boolean() && sim.kv_events.is_some(),
            "kvDrop" | "kvLose" => v.is_u64() && sim.kv_events.is_some(),
            "kvLagMs" => v.as_u64().is_some_and(|ms| ms <= 60_000) && sim.kv_events.is_some(),
            "errorRate" => v.as_f64().is_some_and(|x| (0.0..=1.0).contains(&x)),
            "report" => matches!(
                v.as_str(),
                Some("ok" | "error" | "slow" | "garbage" | "stall" | "notFound")
            ),
            "health" | "gpuUtilization" => unit_or_null(v, key).is_ok(),
            "queueDepth" => v.is_null() || v.as_u64().is_some_and(|q| q <= u32::MAX as u64),
            "metricsDelayMs" => v.as_u64().is_some_and(|ms| ms <= 60_000),
            _ => {
                problems.push(format!("unknown fault `{key}`"));
                continue;
            }
        };
        if !ok {
            problems.push(format!("invalid value for `{key}`: {v}"));
        }
    }
    if !problems.is_empty() {
        return error_response(
            StatusCode::BAD_REQUEST,
            &problems.join("; "),
            "BadRequestError",
        );
    }
    let flag = |key: &str| object.get(key).and_then(Value::as_bool);
    if flag("crash") == Some(true) {
        let _ = std::io::stdout().flush();
        std::process::exit(1);
    }
    let mut evicted = None;
    let mut flushed = None;
    {
        let mut inner = sim.lock();
        if let Some(rate) = object.get("errorRate").and_then(Value::as_f64) {
            inner.faults.error_rate = rate;
        }
        if let Some(mode) = object.get("report").and_then(Value::as_str) {
            inner.faults.report = match mode {
                "error" => ReportMode::Error,
                "slow" => ReportMode::Slow,
                "garbage" => ReportMode::Garbage,
                "stall" => ReportMode::Stall,
                "notFound" => ReportMode::NotFound,
                _ => ReportMode::Ok,
            };
        }
        if let Some(v) = object.get("health") {
            inner.faults.health = unit_or_null(v, "health").unwrap_or(None);
        }
        if let Some(v) = object.get("gpuUtilization") {
            inner.faults.gpu_utilization = unit_or_null(v, "gpuUtilization").unwrap_or(None);
        }
        if let Some(v) = object.get("queueDepth") {
            inner.faults.queue_depth = v.as_u64().map(|q| q as u32);
        }
        if let Some(ms) = object.get("metricsDelayMs").and_then(Value::as_u64) {
            inner.faults.metrics_delay_ms = ms;
        }
        if flag("evictAll") == Some(true) {
            evicted = Some(inner.pod.cache.evict_all(flag("silent") == Some(true)));
        }
        if flag("flushSilent") == Some(true) {
            flushed = Some(inner.pod.cache.flush_silent());
        }
        if let Some(publisher) = &sim.kv_events {
            if let Some(batches) = object.get("kvDrop").and_then(Value::as_u64) {
                publisher.drop_next(batches);
            }
            if let Some(batches) = object.get("kvLose").and_then(Value::as_u64) {
                publisher.lose_next(batches);
            }
            if let Some(ms) = object.get("kvLagMs").and_then(Value::as_u64) {
                publisher.lag(Duration::from_millis(ms));
            }
            if flag("kvGarbage") == Some(true) {
                publisher.send_garbage();
            }
            // vLLM's prefix-cache reset: one AllBlocksCleared.
            if flag("clearAll") == Some(true) {
                evicted = Some(inner.pod.cache.evict_all(false));
                publisher.publish(&inner.pod.cache, true);
            }
        }
        sim.cache_changed(&inner);
    }
    if let Some(hang) = flag("hang") {
        sim.hang.send_replace(hang);
    }
    if let Some(stall) = flag("engineStall") {
        sim.engine_stall.send_replace(stall);
    }
    let inner = sim.lock();
    let mut answer = inner
        .faults
        .json(*sim.hang.borrow(), *sim.engine_stall.borrow());
    answer["evicted"] = json!(evicted);
    answer["flushed"] = json!(flushed);
    answer["silentPending"] = json!(inner.pod.cache.silent_pending());
    drop(inner);
    Json(answer).into_response()
}

async fn stats(State(sim): State<Arc<Sim>>) -> Response {
    let inner = sim.lock();
    let s = &inner.stats;
    let body = json!({
        "podId": sim.pod_id,
        "epoch": sim.epoch,
        "requests": s.requests,
        "reportRequests": s.report_requests,
        "fullReports": s.full_reports,
        "completed": s.completed,
        "errors": s.errors,
        "cachedTokens": s.cached_tokens,
        "cachedTokensCpu": s.reloaded_tokens,
        "promptTokens": s.prompt_tokens,
        "prefillTokens": s.prefill_tokens,
        "queueDepth": inner.waiting,
        "running": inner.running,
        "maxQueueSeen": s.max_queue_seen,
        "kvBlocks": inner.pod.cache.len(),
        "kvCapacity": inner.pod.cache.capacity(),
        "kvCpuBlocks": inner.pod.cache.cpu_len(),
        "kvCpuCapacity": inner.pod.cache.cpu_capacity(),
        "seq": inner.pod.cache.seq(),
        "ttftMsSum": s.ttft_ms_sum,
        "adapterLoads": inner.pod.adapters.loads() - s.adapter_loads_at_reset,
        "adapters": inner.pod.adapters.loaded(),
        "faults": inner.faults.json(*sim.hang.borrow(), *sim.engine_stall.borrow()),
    });
    drop(inner);
    Json(body).into_response()
}

async fn reset_stats(State(sim): State<Arc<Sim>>) -> Response {
    let mut inner = sim.lock();
    inner.stats = Stats {
        adapter_loads_at_reset: inner.pod.adapters.loads(),
        max_queue_seen: inner.waiting,
        ..Stats::default()
    };
    drop(inner);
    Json(json!({"reset": true})).into_response()
}
