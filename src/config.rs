//! Plugin configuration: the `plugin_configuration` JSON shared by the HTTP
//! filter and the singleton report service.
//!
//! Parsing is strict (`deny_unknown_fields`) and [`Config::parse`] validates
//! every rule after deserialisation, so a typo or an out-of-range value makes
//! Envoy refuse the plugin with a message that names the field and the rule.
//! Defaults are the ones of the design: weights cache 0.60, load 0.20,
//! queue 0.10, health 0.05, adapter 0.05; `maxQueue` 20; health exclusion
//! below 0.3; 64-byte text blocks, 16-token blocks; at most 256 blocks hashed
//! per request; reports pulled every 2000 ms; with no eligible pod a
//! request waits in the gateway (at most 256 per worker, at most 30 s),
//! holding out for the pod caching its prefix for up to two thirds of
//! that (offered room in windows of 32); the choice reaches Envoy through
//! the override-host policy (`x-gateway-destination-endpoint`, the chosen
//! pod then the runners-up); a pod seen failing upstream is ejected for
//! 1 s, doubling while it keeps failing, at most 30 s.

use std::collections::{BTreeMap, HashSet};
use std::fmt;

use serde::Deserialize;

use crate::chat_template::{ChatTemplate, ContentFormat};

/// Most pods one router can track (`maxPods` at most): a holder in the
/// index and the shared-data snapshot names its pod in 10 bits
/// ([`crate::index::holders`]).
pub const MAX_PODS: usize = 1024;

/// Largest `maxIndexBlocks`: ~77 bytes per block (tree + snapshot mirror)
/// make it about 1.3 GB of the service's memory.
pub const MAX_INDEX_BLOCKS: usize = 16 * 1024 * 1024;

/// Longest block (bytes or tokens), coarse ones included: a block is hashed
/// from one buffer, and a longer one would resolve matches too coarsely to
/// be of use.
pub const MAX_BLOCK_UNITS: usize = 64 * 1024;

/// Tolerance on "weights sum to 1.0".
const WEIGHT_SUM_TOLERANCE: f64 = 1e-6;

/// A configuration error: the JSON path of the offending field and the rule
/// it breaks.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub field: String,
    pub rule: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid kvroute configuration: `{}` {}",
            self.field, self.rule
        )
    }
}

impl std::error::Error for ConfigError {}

fn invalid(field: impl Into<String>, rule: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        rule: rule.into(),
    }
}

/// Weights of the five built-in scoring factors.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default, rename_all = "camelCase")]
pub struct Weights {
    pub cache: f64,
    pub load: f64,
    pub queue: f64,
    pub health: f64,
    pub adapter: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            cache: 0.60,
            load: 0.20,
            queue: 0.10,
            health: 0.05,
            adapter: 0.05,
        }
    }
}

/// `tierCredits`: what a prompt block a pod holds outside GPU memory is
/// worth to the cache factor, as a share of the same block in GPU memory
/// (1). A hit in tier *t* saves the prefill but costs a reload, so it is
/// worth `1 − r` of a GPU hit, `r` = reload time over prefill time per
/// token; the predicted TTFT counts the reload as `r` of a prefill
/// ([`crate::scoring::factors::CachedPrefix`]). Defaults from the measured
/// costs of docs/tiers.md: a CPU hit is worth 0.84–0.98 of a GPU hit over
/// PCIe 4 or 5 for 7–70B models on an H100 (0.976 in kvroute-sim), local
/// NVMe 0.4–0.9, network storage 0.5 down to nothing: 0.9 and 0.5, inside
/// those ranges. 1 and 1: tier-blind (every tier counts as GPU).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default, rename_all = "camelCase")]
pub struct TierCredits {
    /// A block in host memory (vLLM's `CPU` medium).
    pub cpu: f64,
    /// A block on local or shared storage.
    pub disk: f64,
}

impl Default for TierCredits {
    fn default() -> Self {
        TierCredits {
            cpu: 0.9,
            disk: 0.5,
        }
    }
}

impl TierCredits {
    /// Every tier worth a GPU block: today's tier-blind routing.
    pub const BLIND: TierCredits = TierCredits {
        cpu: 1.0,
        disk: 1.0,
    };

    /// The credit of a block held in `tier`.
    pub fn of(&self, tier: crate::report::Tier) -> f64 {
        match tier {
            crate::report::Tier::Gpu => 1.0,
            crate::report::Tier::Cpu => self.cpu,
            crate::report::Tier::Disk => self.disk,
        }
    }
}

/// Balance ([`crate::scoring::balance`]): a pod loses its cache term when
/// another is predicted to answer clearly sooner ([`crate::scoring::ttft`]:
/// queued and own uncached prefill over the pod's learned rate, plus
/// overhead, told apart beyond the model's own measured error). Nothing to
/// tune: the rate, the overhead and the margin are learned.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default, rename_all = "camelCase")]
pub struct BalanceConfig {
    /// `false`: the five-factor score alone (the cache term always counts).
    pub enabled: bool,
    /// Answers per pod the TTFT model remembers (exponential forgetting).
    pub learning_window: u32,
    /// SLO mode ([`crate::scoring::slo`]): a TTFT target in ms, for every
    /// model (a number) or per client-facing model name (an object);
    /// `x-kvroute-ttft-target-ms` sets it per request. `None`: off.
    pub ttft_target_ms: Option<TtftTarget>,
}

/// `balance.ttftTargetMs`: one target, or one per model.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum TtftTarget {
    All(f64),
    PerModel(BTreeMap<String, f64>),
}

impl TtftTarget {
    /// The target of requests for `model`, if it has one.
    pub fn of(&self, model: &str) -> Option<f64> {
        match self {
            TtftTarget::All(ms) => Some(*ms),
            TtftTarget::PerModel(models) => models.get(model).copied(),
        }
    }
}

impl Default for BalanceConfig {
    fn default() -> Self {
        BalanceConfig {
            enabled: true,
            learning_window: crate::scoring::ttft::DEFAULT_LEARNING_WINDOW,
            ttft_target_ms: None,
        }
    }
}

/// Which pods a decision scores in a large pool
/// ([`crate::scoring::candidates`]): every pod up to `exactUpTo` pods;
/// past that, the pods holding the longest matches and the request's
/// adapter until `holders` of each are eligible, and `sampled` eligible
/// pods drawn at random (power-of-d choices).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default, rename_all = "camelCase")]
pub struct CandidatesConfig {
    pub exact_up_to: usize,
    pub holders: usize,
    pub sampled: usize,
}

impl Default for CandidatesConfig {
    fn default() -> Self {
        CandidatesConfig {
            exact_up_to: 64,
            holders: 8,
            sampled: 8,
        }
    }
}

/// Longest `balance.learningWindow`.
pub const MAX_LEARNING_WINDOW: u32 = 65_536;

/// Keys of earlier releases that the predicted-TTFT model replaced, and
/// what replaces them: refused with an error naming it, never ignored.
const REMOVED_KEYS: [(&str, &str); 8] = [
    ("balance.absThreshold", "the predicted-TTFT balance (`balance.enabled`), which moves a request off a pod only when another answers clearly sooner"),
    ("balance.relThreshold", "the predicted-TTFT balance (`balance.enabled`), which moves a request off a pod only when another answers clearly sooner"),
    ("balance.shareWindow", "the predicted-TTFT balance (`balance.enabled`); the model remembers `balance.learningWindow` answers per pod"),
    ("balance.maxShare", "the predicted-TTFT balance (`balance.enabled`), whose margin is the model's own measured error"),
    ("balance.spillTokens", "the predicted-TTFT balance (`balance.enabled`), which counts a move's re-prefill in the TTFT it predicts"),
    ("balance.busyAverageDecisions", "the predicted-TTFT balance (`balance.enabled`); the model remembers `balance.learningWindow` answers per pod"),
    ("balance.prefillSlackTokens", "the predicted-TTFT balance (`balance.enabled`), whose margin is the model's own measured error"),
    ("balance.prefillRatio", "the predicted-TTFT balance (`balance.enabled`), whose margin is the model's own measured error"),
];

/// Which way a numeric pod attribute is preferred.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum Preference {
    Lower,
    Higher,
}

/// A config-declared scorer over a numeric pod attribute (for example
/// `costPerHour`, preferring lower). The attribute is min-max normalised
/// across the candidates of one decision. With `cacheMatchWindow` set, only
/// candidates whose cache match is within that distance of the best
/// candidate's match earn the score ("prefer the cheap pod when its cache
/// match is within 20 points of the best": `cacheMatchWindow: 0.2`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AttributeScorerConfig {
    pub name: String,
    pub weight: f64,
    pub attribute: String,
    pub prefer: Preference,
    #[serde(default)]
    pub cache_match_window: Option<f64>,
}

/// One upstream inference pod.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PodConfig {
    pub id: String,
    /// `host:port` the request is sent to, and where its report (unless
    /// `reportAddress`) and vLLM metrics are pulled.
    pub address: String,
    /// `host:port` to pull the pod's report from instead of `address`: a
    /// sidecar serving it, such as kvroute-vllm-bridge beside stock vLLM.
    #[serde(default)]
    pub report_address: Option<String>,
    /// `host:port` to pull the pod's vLLM metrics from instead of
    /// `address` (a metrics port of its own).
    #[serde(default)]
    pub metrics_address: Option<String>,
    /// Numeric attributes for attribute scorers (e.g. `costPerHour`).
    #[serde(default)]
    pub attributes: BTreeMap<String, f64>,
}

/// What a client-facing model name (an InferenceModel) needs from a pod.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ModelTarget {
    pub base_model: String,
    #[serde(default)]
    pub adapter: Option<String>,
}

/// A base model's chat template and special tokens: what kvroute needs to
/// hash the text vLLM tokenizes ([`crate::chat_template`]).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ChatTemplateConfig {
    /// The model's chat template (`chat_template` of its
    /// `tokenizer_config.json`, or vLLM's `--chat-template`), compiled.
    pub template: ChatTemplate,
    #[serde(default)]
    pub bos_token: Option<String>,
    #[serde(default)]
    pub eos_token: Option<String>,
    /// The text of the special tokens vLLM's tokenizer puts before a
    /// `/v1/completions` text prompt (Llama 3: `<|begin_of_text|>`).
    #[serde(default)]
    pub completion_prefix: String,
    /// vLLM's `--chat-template-content-format`; `None`: detected from the
    /// template as vLLM's `auto` does.
    #[serde(default)]
    pub content_format: Option<ContentFormat>,
}

/// Where block residency comes from.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum IndexMode {
    /// Pods report the blocks they store and evict (report protocol v1).
    #[default]
    Precise,
    /// No block reports: the router records its own decisions as "this pod
    /// now holds these blocks", bounded by a per-pod LRU.
    Approximate,
}

/// What to do with a request the router cannot understand.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum BadRequestPolicy {
    /// Route by load alone (cache score 0).
    #[default]
    Route,
    /// Answer with an OpenAI-style JSON error.
    Reject,
}

/// What to do when every pod is excluded.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum NoPodPolicy {
    /// Hold the request in the gateway until a pod can take it, at most
    /// `maxWaitMs`, at most `maxWaitingRequests` per worker
    /// ([`crate::queueing`]); then as `onWaitLimit` says.
    #[default]
    Wait,
    /// 503 with `retry-after` at once.
    Reject,
    /// Send to `fallbackPod` anyway.
    Fallback,
}

/// What becomes of a waiting request the gateway cannot hold any longer:
/// it waited `maxWaitMs`, or the queue is full.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum WaitLimitPolicy {
    /// To the healthy pod the score prefers, past `maxQueue`: the pod
    /// queues it, as vLLM queues any request. A 503 only when no pod is
    /// healthy.
    #[default]
    Route,
    /// 503 with `retry-after`.
    Reject,
}

/// How the filter hands its choice to Envoy.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum UpstreamMode {
    /// `x-gateway-destination-endpoint` = the chosen pod, then the other
    /// eligible pods best first, for a cluster with Envoy's override-host
    /// load-balancing policy: a retry after a connection failure goes to
    /// the next pod, and only the cluster's members can be reached.
    #[default]
    OverrideHost,
    /// `x-envoy-original-dst-host` = the chosen pod, for an ORIGINAL_DST
    /// cluster: one pod, no failover.
    OriginalDst,
}

/// Passive health ([`crate::ejection`]): a pod an upstream request failed
/// to reach is ejected for `ejectionMs`, doubled for each ejection that
/// follows the previous one within its length, at most `maxEjectionMs`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default, rename_all = "camelCase")]
pub struct PassiveHealthConfig {
    pub ejection_ms: u64,
    pub max_ejection_ms: u64,
}

impl Default for PassiveHealthConfig {
    fn default() -> Self {
        PassiveHealthConfig {
            ejection_ms: 1000,
            max_ejection_ms: 30_000,
        }
    }
}

/// Log verbosity of the plugin.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default, PartialOrd, Ord)]
#[serde(rename_all = "camelCase")]
pub enum LogLevel {
    Error,
    Warn,
    #[default]
    Info,
    Debug,
    Trace,
}

/// Optional pod discovery: `GET path` through an Envoy cluster, answering
/// `{"pods": [{"id": .., "address": .., "attributes": {..}}]}`. `authority`
/// (`host:port`) is sent as `:authority` and `x-envoy-original-dst-host`, so
/// an ORIGINAL_DST cluster such as `kvroute_reports` reaches it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DiscoveryConfig {
    pub cluster: String,
    pub path: String,
    #[serde(default)]
    pub authority: Option<String>,
}

/// Pods from Envoy's own membership of `cluster` (whatever EDS, DNS or
/// Istio put there): the service reads Envoy's admin `/clusters` for that
/// cluster through `adminCluster`, a cluster whose endpoint is Envoy's
/// admin address. Each member is a pod whose id and address are the
/// endpoint's `IP:port`; its report and metrics are pulled from the same
/// IP at `reportPort` / `metricsPort` when set (a sidecar such as
/// kvroute-vllm-bridge), else at the endpoint's port.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MembershipConfig {
    pub cluster: String,
    #[serde(default = "default_admin_cluster")]
    pub admin_cluster: String,
    #[serde(default)]
    pub report_port: Option<u16>,
    #[serde(default)]
    pub metrics_port: Option<u16>,
}

fn default_admin_cluster() -> String {
    "kvroute_admin".into()
}

/// Replicated gateways ([`crate::replica`]): every kvroute Envoy in front of
/// the same pods serves its decision log on its replica listener and pulls
/// the others'. The replicas are `peers` (each one's replica listener,
/// `IP:port`, this replica's own included), or the members of `cluster`
/// as Envoy knows them (a headless Service by DNS, EDS), read from
/// Envoy's admin through `adminCluster` as `membership` reads pods. Pulls
/// go through `reportCluster`. Every call carries `secret`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ReplicasConfig {
    #[serde(default)]
    pub peers: Vec<String>,
    #[serde(default)]
    pub cluster: Option<String>,
    #[serde(default = "default_admin_cluster")]
    pub admin_cluster: String,
    /// The shared secret: at least [`MIN_REPLICA_SECRET_BYTES`] bytes.
    pub secret: String,
    /// Where each replica serves its log on its replica listener.
    #[serde(default = "default_replica_path")]
    pub path: String,
}

fn default_replica_path() -> String {
    "/kvroute/v1/replica".into()
}

/// Shortest replica secret accepted (128 bits of hex).
pub const MIN_REPLICA_SECRET_BYTES: usize = 32;

/// The whole plugin configuration.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default, rename_all = "camelCase")]
pub struct Config {
    pub weights: Weights,
    /// What a cached block outside GPU memory is worth ([`TierCredits`]).
    pub tier_credits: TierCredits,
    pub attribute_scorers: Vec<AttributeScorerConfig>,
    pub max_queue: u32,
    pub balance: BalanceConfig,
    /// Which pods a decision scores in a large pool.
    pub candidates: CandidatesConfig,
    pub health_exclusion_threshold: f64,
    pub block_size_bytes: usize,
    pub block_size_tokens: usize,
    /// Blocks of the block size before coarse blocks begin
    /// ([`crate::hashing::BlockLayout`]).
    pub coarse_after_blocks: usize,
    /// A coarse block is this many blocks long (1: all blocks alike).
    pub coarse_block_factor: usize,
    /// Most blocks of a prompt the router hashes and matches.
    pub max_prefix_blocks: usize,
    /// Secret mixed into the first block's seed so outsiders cannot predict
    /// block hashes. Pods must hash with the same value.
    pub hash_seed: String,
    pub mode: IndexMode,
    /// Bound of the router's prefix index (least-recently-used eviction).
    pub max_index_blocks: usize,
    /// Per-pod bound in approximate mode (the pod's KV capacity in blocks).
    pub pod_capacity_blocks: usize,
    /// Most blocks one pod may hold in the index; `None`: twice its fair
    /// share, `2 × maxIndexBlocks / pods` (at most `maxIndexBlocks`).
    pub max_pod_index_blocks: Option<usize>,
    /// Largest report or metrics body the service reads; a larger one is a
    /// failed pull (`too_large`).
    pub max_report_bytes: usize,
    /// Precise mode: how long a routing decision counts as "the pod holds
    /// this prompt" before a report says so; `None`: two report intervals
    /// plus the report timeout.
    pub pending_decision_ms: Option<u64>,
    pub pod_report_interval_ms: u64,
    /// A report older than this many intervals starts decaying the pod's health.
    pub report_timeout_ms: u64,
    /// Most pods in the pool (`pods`, or what `discovery` or `membership`
    /// find), at most [`MAX_PODS`]. A list longer than this is refused (a
    /// discovered one ignored with a warning, the pods staying as they
    /// were). What the service and the filters keep grows with the pods in
    /// use, not with this ceiling.
    pub max_pods: usize,
    /// Long-poll pods for their reports (`wait` = `podReportIntervalMs`),
    /// falling back to interval polling for pods that ignore it; see
    /// [`crate::polling`].
    pub report_long_poll: bool,
    pub pods: Vec<PodConfig>,
    pub models: BTreeMap<String, ModelTarget>,
    /// Base model → the chat template its pods render; such a model's
    /// prompts are hashed as the text vLLM tokenizes.
    pub chat_templates: BTreeMap<String, ChatTemplateConfig>,
    /// Request paths kvroute routes; others pass through untouched.
    pub route_paths: Vec<String>,
    pub max_body_bytes: usize,
    pub on_bad_request: BadRequestPolicy,
    pub on_unknown_model: BadRequestPolicy,
    pub on_no_eligible_pod: NoPodPolicy,
    /// Most requests waiting for a pod, per proxy worker (`"wait"`).
    pub max_waiting_requests: usize,
    /// Longest a request waits in the gateway for a pod below `maxQueue`
    /// (`"wait"`).
    pub max_wait_ms: u64,
    /// A waiting request past `maxWaitMs`, or one a full queue cannot
    /// hold: routed past `maxQueue`, or answered 503.
    pub on_wait_limit: WaitLimitPolicy,
    /// How long a request may hold out for a full pod that caches its
    /// whole prompt rather than go to a pod with room that caches none
    /// (`"wait"`; 0: never); less cache to gain, proportionally less (see
    /// [`crate::router::Router::hold_bound_ms`] and [`crate::queueing`]).
    /// `None`: two thirds of `maxWaitMs`.
    pub affinity_wait_ms: Option<u64>,
    /// Waiting requests of the head class a dispatch round looks at, in
    /// order, for one that wants a pod with room.
    pub affinity_window: usize,
    pub fallback_pod: Option<String>,
    pub retry_after_seconds: u32,
    /// How the chosen pod reaches Envoy (and which cluster type it needs).
    pub upstream_mode: UpstreamMode,
    pub passive_health: PassiveHealthConfig,
    /// Adds `x-kvroute-pod`, `x-kvroute-score`, `x-kvroute-cache-match`.
    pub decision_headers: bool,
    pub log_level: LogLevel,
    /// One routed request in this many logs its INFO `route` line (1: every
    /// one; 0: none), so a busy proxy need not format and write a line per
    /// request.
    pub route_log_sample: u32,
    /// One routed request in this many whose answer carries `usage` has its
    /// `cached_tokens` compared with the prediction (1: every one; 0:
    /// none): a streamed answer is read chunk by chunk until its usage
    /// arrives, a host call per chunk.
    pub prediction_check_sample: u32,
    /// Envoy cluster the service reaches pods through (report and metrics).
    pub report_cluster: String,
    pub report_path: String,
    /// vLLM Prometheus endpoint to scrape each tick; `None` disables it.
    pub metrics_path: Option<String>,
    pub discovery: Option<DiscoveryConfig>,
    pub membership: Option<MembershipConfig>,
    pub replicas: Option<ReplicasConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            weights: Weights::default(),
            tier_credits: TierCredits::default(),
            attribute_scorers: Vec::new(),
            max_queue: 20,
            balance: BalanceConfig::default(),
            candidates: CandidatesConfig::default(),
            health_exclusion_threshold: 0.3,
            block_size_bytes: 64,
            block_size_tokens: 16,
            coarse_after_blocks: 256,
            coarse_block_factor: 16,
            max_prefix_blocks: 2048,
            hash_seed: String::new(),
            mode: IndexMode::Precise,
            max_index_blocks: 1_000_000,
            pod_capacity_blocks: 32_768,
            max_pod_index_blocks: None,
            max_report_bytes: 4 * 1024 * 1024,
            pending_decision_ms: None,
            pod_report_interval_ms: 2000,
            report_timeout_ms: 1000,
            report_long_poll: true,
            max_pods: MAX_PODS,
            pods: Vec::new(),
            models: BTreeMap::new(),
            chat_templates: BTreeMap::new(),
            route_paths: vec!["/v1/completions".into(), "/v1/chat/completions".into()],
            max_body_bytes: 8 * 1024 * 1024,
            on_bad_request: BadRequestPolicy::Route,
            on_unknown_model: BadRequestPolicy::Route,
            on_no_eligible_pod: NoPodPolicy::Wait,
            max_waiting_requests: 256,
            max_wait_ms: 30_000,
            on_wait_limit: WaitLimitPolicy::Route,
            affinity_wait_ms: None,
            affinity_window: 32,
            fallback_pod: None,
            retry_after_seconds: 1,
            upstream_mode: UpstreamMode::OverrideHost,
            passive_health: PassiveHealthConfig::default(),
            decision_headers: false,
            log_level: LogLevel::Info,
            route_log_sample: 1,
            prediction_check_sample: 8,
            report_cluster: "kvroute_reports".into(),
            report_path: "/kvroute/v1/report".into(),
            metrics_path: None,
            discovery: None,
            membership: None,
            replicas: None,
        }
    }
}

impl Config {
    /// Parses and validates a `plugin_configuration` value. Empty input means
    /// all defaults (which still needs pods or discovery to be useful).
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        let text = std::str::from_utf8(bytes)
            .map_err(|_| invalid("<configuration>", "is not valid UTF-8"))?;
        let config: Config = if text.trim().is_empty() {
            Config::default()
        } else if !text.trim_start().starts_with('{') {
            return Err(invalid("<configuration>", "must be a JSON object"));
        } else {
            refuse_removed_keys(text)?;
            let mut deserializer = serde_json::Deserializer::from_str(text);
            serde_path_to_error::deserialize(&mut deserializer).map_err(|e| serde_error(&e))?
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks every rule serde cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let w = &self.weights;
        let named = [
            ("weights.cache", w.cache),
            ("weights.load", w.load),
            ("weights.queue", w.queue),
            ("weights.health", w.health),
            ("weights.adapter", w.adapter),
        ];
        let mut sum = 0.0;
        for (field, value) in named {
            check_unit(field, value)?;
            sum += value;
        }
        let mut scorer_names = HashSet::new();
        for (i, s) in self.attribute_scorers.iter().enumerate() {
            let at = |f: &str| format!("attributeScorers[{i}].{f}");
            check_unit(&at("weight"), s.weight)?;
            if s.name.is_empty() || !scorer_names.insert(s.name.as_str()) {
                return Err(invalid(at("name"), "must be non-empty and unique"));
            }
            if s.attribute.is_empty() {
                return Err(invalid(at("attribute"), "must be non-empty"));
            }
            if let Some(window) = s.cache_match_window {
                check_unit(&at("cacheMatchWindow"), window)?;
            }
            sum += s.weight;
        }
        if (sum - 1.0).abs() > WEIGHT_SUM_TOLERANCE {
            return Err(invalid(
                "weights",
                format!("must sum to 1.0 together with attributeScorers weights (got {sum:.6})"),
            ));
        }
        let credits = &self.tier_credits;
        check_unit("tierCredits.cpu", credits.cpu)?;
        check_unit("tierCredits.disk", credits.disk)?;
        if credits.disk > credits.cpu {
            return Err(invalid(
                "tierCredits.disk",
                format!(
                    "must be at most tierCredits.cpu (got disk {} > cpu {}): a disk reload is no faster than one from host memory",
                    credits.disk, credits.cpu
                ),
            ));
        }
        if self.max_queue < 1 {
            return Err(invalid("maxQueue", "must be >= 1"));
        }
        let targets: Vec<(String, f64)> = match &self.balance.ttft_target_ms {
            None => Vec::new(),
            Some(TtftTarget::All(ms)) => vec![("balance.ttftTargetMs".into(), *ms)],
            Some(TtftTarget::PerModel(models)) => models
                .iter()
                .map(|(model, ms)| (format!("balance.ttftTargetMs.{model}"), *ms))
                .collect(),
        };
        for (field, ms) in targets {
            if !(ms.is_finite() && ms > 0.0) {
                return Err(invalid(
                    field,
                    format!("must be a positive number of ms (got {ms})"),
                ));
            }
        }
        let window = self.balance.learning_window;
        if !(1..=MAX_LEARNING_WINDOW).contains(&window) {
            return Err(invalid(
                "balance.learningWindow",
                format!("must be 1 to {MAX_LEARNING_WINDOW} answers (got {window})"),
            ));
        }
        positive("candidates.holders", self.candidates.holders as u64)?;
        positive("candidates.sampled", self.candidates.sampled as u64)?;
        if self.candidates.exact_up_to > MAX_PODS {
            return Err(invalid(
                "candidates.exactUpTo",
                format!(
                    "must be at most {MAX_PODS} (got {}; {MAX_PODS} scores every pod)",
                    self.candidates.exact_up_to
                ),
            ));
        }
        check_unit("healthExclusionThreshold", self.health_exclusion_threshold)?;
        positive("blockSizeBytes", self.block_size_bytes as u64)?;
        positive("blockSizeTokens", self.block_size_tokens as u64)?;
        positive("maxPrefixBlocks", self.max_prefix_blocks as u64)?;
        positive("coarseBlockFactor", self.coarse_block_factor as u64)?;
        for (field, size) in [
            ("blockSizeBytes", self.block_size_bytes),
            ("blockSizeTokens", self.block_size_tokens),
        ] {
            if size.saturating_mul(self.coarse_block_factor) > MAX_BLOCK_UNITS {
                return Err(invalid(
                    "coarseBlockFactor",
                    format!("{field} × coarseBlockFactor must be at most {MAX_BLOCK_UNITS}"),
                ));
            }
        }
        positive("podReportIntervalMs", self.pod_report_interval_ms)?;
        positive("reportTimeoutMs", self.report_timeout_ms)?;
        positive("podCapacityBlocks", self.pod_capacity_blocks as u64)?;
        positive("maxBodyBytes", self.max_body_bytes as u64)?;
        positive("maxReportBytes", self.max_report_bytes as u64)?;
        positive("maxWaitingRequests", self.max_waiting_requests as u64)?;
        positive("maxWaitMs", self.max_wait_ms)?;
        positive("affinityWindow", self.affinity_window as u64)?;
        if self
            .affinity_wait_ms
            .is_some_and(|ms| ms >= self.max_wait_ms)
        {
            return Err(invalid(
                "affinityWaitMs",
                "must be less than maxWaitMs (a request holding out must still get a pod before its deadline)",
            ));
        }
        if let Some(ms) = self.pending_decision_ms {
            positive("pendingDecisionMs", ms)?;
        }
        positive("passiveHealth.ejectionMs", self.passive_health.ejection_ms)?;
        if self.passive_health.max_ejection_ms < self.passive_health.ejection_ms {
            return Err(invalid(
                "passiveHealth.maxEjectionMs",
                "must be >= passiveHealth.ejectionMs",
            ));
        }
        if let Some(blocks) = self.max_pod_index_blocks {
            positive("maxPodIndexBlocks", blocks as u64)?;
        }
        if self.max_index_blocks > MAX_INDEX_BLOCKS {
            return Err(invalid(
                "maxIndexBlocks",
                format!("must be at most {MAX_INDEX_BLOCKS} (about 77 bytes of memory per block)"),
            ));
        }
        if self.max_index_blocks < self.max_prefix_blocks {
            return Err(invalid(
                "maxIndexBlocks",
                "must be >= maxPrefixBlocks (the index must hold at least one whole prompt)",
            ));
        }
        if !(1..=MAX_PODS).contains(&self.max_pods) {
            return Err(invalid(
                "maxPods",
                format!("must be 1 to {MAX_PODS} (got {})", self.max_pods),
            ));
        }
        self.validate_pods(&self.pods)?;
        if self.pods.is_empty() && self.discovery.is_none() && self.membership.is_none() {
            return Err(invalid(
                "pods",
                "must list at least one pod (or configure discovery or membership)",
            ));
        }
        if let Some(authority) = self.discovery.as_ref().and_then(|d| d.authority.as_deref()) {
            validate_address(authority)
                .and_then(|()| validate_original_dst_address(authority))
                .map_err(|rule| invalid("discovery.authority", rule))?;
        }
        if let Some(membership) = &self.membership {
            validate_membership(membership)?;
            if !self.pods.is_empty() {
                return Err(invalid(
                    "membership",
                    "cannot be combined with `pods`: the pods are the cluster's members",
                ));
            }
            if self.discovery.is_some() {
                return Err(invalid(
                    "membership",
                    "cannot be combined with `discovery`: choose one source of pods",
                ));
            }
        }
        for (name, target) in &self.models {
            if target.base_model.is_empty() {
                return Err(invalid(
                    format!("models.{name}.baseModel"),
                    "must be non-empty",
                ));
            }
        }
        for base_model in self.chat_templates.keys() {
            // With no `models`, every requested name is its own base model.
            if !self.models.is_empty() && !self.models.values().any(|t| &t.base_model == base_model)
            {
                return Err(invalid(
                    format!("chatTemplates.{base_model}"),
                    "must be the baseModel of an entry in `models`",
                ));
            }
        }
        for (i, path) in self.route_paths.iter().enumerate() {
            if !path.starts_with('/') {
                return Err(invalid(format!("routePaths[{i}]"), "must start with '/'"));
            }
        }
        if self.on_no_eligible_pod == NoPodPolicy::Fallback && self.fallback_pod.is_none() {
            return Err(invalid(
                "fallbackPod",
                "is required when onNoEligiblePod is \"fallback\"",
            ));
        }
        if self.report_cluster.is_empty() {
            return Err(invalid("reportCluster", "must be non-empty"));
        }
        if !self.report_path.starts_with('/') {
            return Err(invalid("reportPath", "must start with '/'"));
        }
        if let Some(path) = &self.metrics_path {
            if !path.starts_with('/') {
                return Err(invalid("metricsPath", "must start with '/'"));
            }
        }
        if let Some(replicas) = &self.replicas {
            validate_replicas(replicas)?;
        }
        Ok(())
    }

    /// The rules a pod list obeys, whether configured as `pods` or
    /// discovered (`discovery`, `membership`): at most `maxPods`, ids and
    /// addresses unique and well-formed, and `fallbackPod` among them.
    pub fn validate_pods(&self, pods: &[PodConfig]) -> Result<(), ConfigError> {
        if pods.len() > self.max_pods {
            return Err(invalid(
                "pods",
                format!(
                    "must list at most maxPods = {} pods (got {}; maxPods can be raised to {MAX_PODS})",
                    self.max_pods,
                    pods.len()
                ),
            ));
        }
        let mut ids = HashSet::new();
        let mut addresses = HashSet::new();
        for (i, pod) in pods.iter().enumerate() {
            if pod.id.is_empty() || pod.id.len() > 255 {
                return Err(invalid(format!("pods[{i}].id"), "must be 1 to 255 bytes"));
            }
            if !ids.insert(pod.id.as_str()) {
                return Err(invalid(
                    format!("pods[{i}].id"),
                    format!("duplicates pod id {:?}", pod.id),
                ));
            }
            validate_address(&pod.address)
                .and_then(|()| match self.upstream_mode {
                    UpstreamMode::OverrideHost => validate_endpoint_address(&pod.address),
                    UpstreamMode::OriginalDst => validate_original_dst_address(&pod.address),
                })
                .map_err(|rule| invalid(format!("pods[{i}].address"), rule))?;
            for (field, address) in [
                ("reportAddress", &pod.report_address),
                ("metricsAddress", &pod.metrics_address),
            ] {
                if let Some(address) = address {
                    validate_address(address)
                        .and_then(|()| validate_original_dst_address(address))
                        .map_err(|rule| invalid(format!("pods[{i}].{field}"), rule))?;
                }
            }
            if !addresses.insert(pod.address.as_str()) {
                return Err(invalid(
                    format!("pods[{i}].address"),
                    format!("duplicates address {:?}", pod.address),
                ));
            }
        }
        match &self.fallback_pod {
            Some(id) if !pods.is_empty() && !pods.iter().any(|p| &p.id == id) => {
                Err(invalid("fallbackPod", format!("names unknown pod {id:?}")))
            }
            _ => Ok(()),
        }
    }

    /// The base model and adapter a client-facing model name needs, or
    /// `None` when models are configured and this one is not among them.
    /// With no `models` configured every name is its own base model.
    pub fn resolve_model(&self, requested: &str) -> Option<ModelTarget> {
        if self.models.is_empty() {
            return Some(ModelTarget {
                base_model: requested.to_string(),
                adapter: None,
            });
        }
        self.models.get(requested).cloned()
    }

    /// How long a precise-mode decision counts before a report confirms it.
    pub fn pending_decision_ttl_ms(&self) -> u64 {
        self.pending_decision_ms.unwrap_or_else(|| {
            self.pod_report_interval_ms
                .saturating_mul(2)
                .saturating_add(self.report_timeout_ms)
        })
    }

    /// How long a request may hold out for a full pod caching its whole
    /// prompt (`affinityWaitMs`): 20 s under the default `maxWaitMs`.
    pub fn affinity_wait_bound_ms(&self) -> u64 {
        self.affinity_wait_ms
            .unwrap_or(self.max_wait_ms.saturating_mul(2) / 3)
    }

    /// Most blocks one of `pods` pods may hold in the index.
    pub fn pod_index_share(&self, pods: usize) -> usize {
        self.max_pod_index_blocks.unwrap_or_else(|| {
            (self.max_index_blocks.saturating_mul(2) / pods.max(1)).min(self.max_index_blocks)
        })
    }

    /// Number of shared-data buckets the published index is spread over:
    /// about 16 blocks per bucket at full index, a power of two.
    pub fn snapshot_buckets(&self) -> u32 {
        let buckets = (self.max_index_blocks.min(MAX_INDEX_BLOCKS) / 16).max(1);
        u32::try_from(buckets)
            .unwrap_or(u32::MAX)
            .checked_next_power_of_two()
            .unwrap_or(1 << 31)
    }
}

/// Refuses the keys the predicted-TTFT model replaced ([`REMOVED_KEYS`]),
/// naming the replacement. Text that is not JSON is left to the parser.
fn refuse_removed_keys(text: &str) -> Result<(), ConfigError> {
    let Ok(value) = serde_json::from_str::<serde_json::Value>(text) else {
        return Ok(());
    };
    for (path, replacement) in REMOVED_KEYS {
        let (parent, key) = path.split_once('.').unwrap_or(("", path));
        let holder = if parent.is_empty() {
            Some(&value)
        } else {
            value.get(parent)
        };
        if holder.and_then(|h| h.get(key)).is_some() {
            return Err(invalid(
                path,
                format!("was removed; its replacement is {replacement}: delete the key"),
            ));
        }
    }
    Ok(())
}

fn check_unit(field: &str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && (0.0..=1.0).contains(&value) {
        Ok(())
    } else {
        Err(invalid(field, format!("must be in [0, 1] (got {value})")))
    }
}

fn positive(field: &str, value: u64) -> Result<(), ConfigError> {
    if value > 0 {
        Ok(())
    } else {
        Err(invalid(field, "must be > 0"))
    }
}

fn validate_membership(membership: &MembershipConfig) -> Result<(), ConfigError> {
    if membership.cluster.is_empty() {
        return Err(invalid("membership.cluster", "must be non-empty"));
    }
    if membership.admin_cluster.is_empty() {
        return Err(invalid("membership.adminCluster", "must be non-empty"));
    }
    for (field, port) in [
        ("membership.reportPort", membership.report_port),
        ("membership.metricsPort", membership.metrics_port),
    ] {
        if port == Some(0) {
            return Err(invalid(field, "must be a port 1-65535"));
        }
    }
    Ok(())
}

fn validate_replicas(replicas: &ReplicasConfig) -> Result<(), ConfigError> {
    match (replicas.peers.is_empty(), &replicas.cluster) {
        (true, None) => {
            return Err(invalid(
                "replicas",
                "must list `peers` or name a `cluster` of the replicas",
            ))
        }
        (false, Some(_)) => {
            return Err(invalid(
                "replicas.cluster",
                "cannot be combined with `peers`: choose one source of replicas",
            ))
        }
        (_, Some(cluster)) if cluster.is_empty() => {
            return Err(invalid("replicas.cluster", "must be non-empty"))
        }
        _ => {}
    }
    if replicas.peers.len() > crate::replica::peers::MAX_PEERS {
        return Err(invalid(
            "replicas.peers",
            format!(
                "must list at most {} replicas (got {})",
                crate::replica::peers::MAX_PEERS,
                replicas.peers.len()
            ),
        ));
    }
    for (i, peer) in replicas.peers.iter().enumerate() {
        validate_original_dst_address(peer)
            .map_err(|rule| invalid(format!("replicas.peers[{i}]"), rule))?;
    }
    if replicas.admin_cluster.is_empty() {
        return Err(invalid("replicas.adminCluster", "must be non-empty"));
    }
    if replicas.secret.len() < MIN_REPLICA_SECRET_BYTES
        || !replicas.secret.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(invalid(
            "replicas.secret",
            format!(
                "must be at least {MIN_REPLICA_SECRET_BYTES} printable characters without spaces (e.g. `openssl rand -hex 16`)"
            ),
        ));
    }
    if !replicas.path.starts_with('/') {
        return Err(invalid("replicas.path", "must start with '/'"));
    }
    Ok(())
}

/// A valid `host:port`: non-empty host of DNS or IPv4 characters (or a
/// bracketed IPv6 literal) and a port in 1..=65535.
pub fn validate_address(address: &str) -> Result<(), String> {
    let (host, port) = address
        .rsplit_once(':')
        .ok_or_else(|| format!("must be host:port (got {address:?})"))?;
    let port_ok = port.parse::<u16>().map(|p| p > 0).unwrap_or(false);
    if !port_ok {
        return Err(format!("must end in a port 1-65535 (got {address:?})"));
    }
    let host_ok = if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        inner.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-')
    };
    if host_ok {
        Ok(())
    } else {
        Err(format!("must have a valid host (got {address:?})"))
    }
}

/// An address an ORIGINAL_DST cluster can connect to by header (the pods
/// with `upstreamMode` `"originalDst"`; every report, metrics and discovery
/// pull, through `reportCluster`): Envoy parses `x-envoy-original-dst-host`
/// as an IP and port and never resolves a name (it counts
/// `original_dst_host_invalid` and answers 503).
fn validate_original_dst_address(address: &str) -> Result<(), String> {
    address.parse::<std::net::SocketAddr>().map(drop).map_err(|_| {
        format!(
            "must be an IP literal and port: Envoy's ORIGINAL_DST cluster connects only to a resolved address, never a host name (got {address:?}; `kvroute-config render` resolves host names)"
        )
    })
}

/// An address Envoy's override-host policy can match: the endpoint's
/// resolved address as Envoy prints it (`10.0.0.5:8000`, `[fd00::5]:8000`),
/// so an IP literal in canonical form; a host name would never match and
/// every request would silently go to the fallback policy.
fn validate_endpoint_address(address: &str) -> Result<(), String> {
    match address.parse::<std::net::SocketAddr>() {
        Ok(parsed) if parsed.to_string() == address => Ok(()),
        Ok(parsed) => Err(format!(
            "must be written as Envoy prints the endpoint, {parsed} (got {address:?})"
        )),
        Err(_) => Err(format!(
            "must be an IP literal and port with upstreamMode \"overrideHost\" (Envoy matches the endpoint's resolved address; got {address:?})"
        )),
    }
}

/// Names the field from the deserialiser's path (`weights.cache`,
/// `pods[1].address`, or the unknown field itself); a missing field is named
/// in serde's message and appended to its parent's path.
fn serde_error(e: &serde_path_to_error::Error<serde_json::Error>) -> ConfigError {
    let message = e.inner().to_string();
    let path = e.path().to_string();
    let missing = message
        .strip_prefix("missing field `")
        .and_then(|rest| rest.split('`').next());
    let field = match (missing, path.as_str()) {
        (Some(name), "." | "?") => name.to_string(),
        (Some(name), parent) => format!("{parent}.{name}"),
        (None, "." | "?") => "<configuration>".to_string(),
        (None, path) => path.to_string(),
    };
    invalid(field, format!("is rejected: {message}"))
}
