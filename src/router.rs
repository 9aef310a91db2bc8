//! [`Router`]: one request body in, one routing outcome out — everything the
//! HTTP filter decides, without any host call.
//!
//! 1. Bodies larger than `maxBodyBytes`, not JSON, without a prompt or with
//!    wrong types are *bad*; `onBadRequest` routes them by load alone (cache
//!    score 0) or rejects them with 400.
//! 2. The model is resolved through `models`; an unknown one follows
//!    `onUnknownModel` (route by load alone, or 404).
//! 3. The prompt is hashed into its block chain and looked up in the index
//!    view; each pod's cache match = the share of the whole prompt its
//!    matched blocks cover ([`Coverage`]).
//! 4. Candidates: the published pods, queue = reported queue + requests
//!    routed to the pod since its report (the in-flight counters; in
//!    approximate mode, those not answered yet: [`SlotLoad::requests`]), so a
//!    burst between two reports spreads instead of piling on the hot pod;
//!    and the streams open there ([`SlotLoad::streams`]), what spread and
//!    exact ties read.
//! 5. [`ScoringPolicy::decide`] picks; with every pod excluded,
//!    `onNoEligiblePod` hands the request back to wait in the gateway
//!    ([`Outcome::NoEligiblePod`], the default), answers 503 with
//!    `retry-after`, or uses `fallbackPod`. The routed request lists its
//!    [`Destination`]s: the winner, then the other eligible pods by
//!    composite, where Envoy retries after a connection failure.
//! 6. Under `"wait"`, a request whose chosen pod caches fewer of its blocks
//!    than a pod excluded at `maxQueue` is handed back too, *holding out*
//!    for that pod ([`HoldOut`]), for at most `affinityWaitMs` × the share
//!    of the prompt it would save ([`Router::hold_bound_ms`]) in all; the
//!    wait queue then offers the room to the next waiting request
//!    ([`crate::queueing`]). A request leaving the wait queue for room
//!    ([`Attempt::Waiting`]) is scored without balance; one the gateway
//!    can hold no longer ([`Attempt::PastWaitLimit`]) with it.
//!
//! Every candidate carries its predicted TTFT ([`TtftModel`], from the
//! view): balance ([`crate::scoring::balance`]) takes the cache term from
//! a pod another clearly beats, and the routed request carries the winner's
//! and the runner-up's predictions for the explain and route logs. With a
//! TTFT target (SLO mode, [`crate::scoring::slo`]) the cheapest pod in time
//! wins, and a request no pod serves in time holds out in the wait queue
//! while waiting can still help.
//!
//! A snapshot the service stopped refreshing ([`Staleness`]) is not
//! trusted for cache: the request is routed by load, with each pod's health
//! decayed from its last report as the service would have done.

use crate::chat_template::PromptRenderer;
use crate::config::{BadRequestPolicy, Config, NoPodPolicy, TierCredits};
use crate::hashing::{BlockHasher, Coverage};
use crate::index::{PrefixLookup, PrefixMatch, TierBlocks};
use crate::scoring::factors::CachedPrefix;
use crate::scoring::occupancy::Occupancy;
use crate::scoring::slo::{self, SloChoice};
use crate::scoring::spread::{self, PrefixDemand};
use crate::scoring::ttft::{attention, TtftModel, Work};
use crate::scoring::{Balancing, Candidate, Decision, Exclusion, Pool, ScoringPolicy};
use crate::snapshot::{PodTable, SlotLoad};
use crate::staleness::Staleness;

/// The router's view of the cluster for one request.
pub struct ClusterView<'a> {
    pub table: &'a PodTable,
    pub index: &'a dyn PrefixLookup,
    /// In-flight requests and their queued prefill per pod slot.
    pub inflight: &'a [SlotLoad],
    /// The predicted-TTFT model this router learned ([`TtftModel`]).
    pub ttft: &'a TtftModel,
    /// What its arrivals found on each pod ([`Occupancy`]).
    pub occupancy: &'a Occupancy,
    /// The sessions this router's recent arrivals started per prefix
    /// ([`PrefixDemand`]; the host records each [`Routed`]).
    pub prefix_demand: &'a PrefixDemand,
    /// Now, on the clock of `table.published_at_ms`.
    pub now_ms: u64,
}

/// A pod a request may be sent to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    pub slot: usize,
    pub pod_id: String,
    pub address: String,
}

/// A request sent to a pod.
#[derive(Debug, Clone)]
pub struct Routed {
    /// Index into the pod table.
    pub pod: usize,
    pub slot: usize,
    pub pod_id: String,
    pub address: String,
    /// Client-facing model name (empty when the body could not be parsed).
    pub model: String,
    pub adapter: Option<String>,
    /// The chosen pod will have to load the adapter.
    pub adapter_load_triggered: bool,
    pub chain: Vec<u64>,
    /// The block its longest cached match (any pod's) ended at, and
    /// whether it continues a conversation, for [`PrefixDemand::record`].
    pub match_end: Option<u64>,
    pub follows_up: Option<bool>,
    pub matched_blocks: u32,
    /// Those blocks by the tier the pod holds them in.
    pub matched_tiers: TierBlocks,
    /// Every pod's match (what the explain line shows per candidate).
    pub matches: PrefixMatch,
    /// The cache factor: the matched share of the prompt, credited by
    /// tier ([`CachedPrefix`]).
    pub cache_match: f64,
    pub composite: f64,
    /// Prompt tokens expected to be served from the pod's cache.
    pub predicted_cached_tokens: u64,
    /// Prompt tokens the pod is expected to prefill (not cached there):
    /// counted in the pod's [`SlotLoad::prefill_tokens`] until the first
    /// response byte.
    pub prefill_tokens: u32,
    /// Their attention, counted in [`SlotLoad::prefill_attention`] as they
    /// are.
    pub prefill_attention: u32,
    /// Prefill ahead of its first token there: the pod's queued prefill,
    /// and its own, `prefill_tokens` plus the reload of its prefix cached
    /// outside GPU memory, in prefill tokens, with their attention (what
    /// [`TtftModel::observe`] learns from).
    pub work: Work,
    /// Blocks of the pod's cache the request's prefill is expected to
    /// evict: its uncached tokens beyond the room there
    /// ([`crate::scoring::balance`]), in blocks.
    pub predicted_evicted_blocks: u64,
    /// Predicted TTFT on the chosen pod and on the runner-up (if any).
    pub predicted_ttft_ms: f64,
    pub runner_up_ttft_ms: Option<f64>,
    /// The answer is streamed ([`RoutingRequest::streamed`]).
    pub streamed: bool,
    /// Why cache-aware routing was skipped, for a bad or unknown request.
    pub degraded: Option<String>,
    /// Sent to `fallbackPod` because every pod was excluded.
    pub fallback: bool,
    /// The snapshot was stale: routed by load with self-decayed health.
    pub stale_snapshot: bool,
    /// Where Envoy may send it, in order: the chosen pod, then the other
    /// eligible pods best first (override-host retries take them in turn);
    /// `fallbackPod` alone when it is a fallback.
    pub destinations: Vec<Destination>,
    pub decision: Decision,
}

/// A request answered by the router itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejected {
    pub status: u32,
    /// OpenAI error `type`.
    pub kind: &'static str,
    pub message: String,
    pub retry_after: Option<u32>,
}

impl Rejected {
    /// The answer to `method` (not POST) on a route path: inference
    /// endpoints take only POST, as vLLM's do.
    pub fn method_not_allowed(method: &str) -> Rejected {
        Rejected {
            status: 405,
            kind: "MethodNotAllowedError",
            message: format!("method {method:?} is not allowed here; use POST"),
            retry_after: None,
        }
    }

    /// Response headers: JSON, `retry-after` when set, `allow` on a 405.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut headers = vec![("content-type", "application/json".to_string())];
        if let Some(seconds) = self.retry_after {
            headers.push(("retry-after", seconds.to_string()));
        }
        if self.status == 405 {
            headers.push(("allow", "POST".to_string()));
        }
        headers
    }

    /// OpenAI-style error body.
    pub fn body(&self) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "error": {"message": self.message, "type": self.kind, "code": self.status}
        }))
        .unwrap_or_default()
    }
}

#[derive(Debug, Clone)]
pub enum Outcome {
    Routed(Box<Routed>),
    Rejected(Rejected),
    /// Every pod is excluded and `onNoEligiblePod` is `"wait"`: the caller
    /// holds the request ([`crate::queueing`]) and routes it again later.
    NoEligiblePod(Box<NoEligiblePod>),
}

/// Whether a request is routed as it arrives or again from the wait queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    Arrival,
    /// Leaving the wait queue ([`crate::queueing`]) after holding out for
    /// a full pod for `holding_ms` (0 if it never did).
    Waiting {
        holding_ms: u64,
    },
    /// The gateway can hold it no longer (it waited `maxWaitMs`, or the
    /// queue is full) and `onWaitLimit` is `"route"`: any healthy pod may
    /// take it, at `maxQueue` or not, and it holds out for none.
    PastWaitLimit,
}

impl Attempt {
    fn holding_ms(self) -> u64 {
        match self {
            Attempt::Arrival | Attempt::PastWaitLimit => 0,
            Attempt::Waiting { holding_ms } => holding_ms,
        }
    }
}

/// A request no pod can take now, ready to be routed again.
#[derive(Debug, Clone)]
pub struct NoEligiblePod {
    pub request: RoutingRequest,
    /// The answer if it cannot wait (queue full, deadline).
    pub rejected: Rejected,
    /// `Some` when a pod could take it but it holds out for a full pod
    /// that caches more of its prefix (`affinityWaitMs`); `None` when every
    /// pod is excluded.
    pub holding_out: Option<HoldOut>,
}

/// Why a request that could be routed waits instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HoldOut {
    /// The full pod caching the most of its prefix.
    pub pod_id: String,
    /// Blocks of the prompt cached there.
    pub held_blocks: u32,
    /// Blocks cached on the pod the router would send it to now.
    pub offered_blocks: u32,
}

/// Exclusions a 503's message names (the rest are counted).
const NAMED_EXCLUSIONS: usize = 8;

/// The pod table as the pool one decision scores: a pod becomes a
/// [`Candidate`] only if [`crate::scoring::candidates`] asks for it.
struct TablePool<'v, 'a> {
    view: &'v ClusterView<'a>,
    matches: &'v PrefixMatch,
    coverage: Coverage,
    credits: &'v TierCredits,
    adapter: Option<&'v str>,
    stale_snapshot: bool,
    staleness: &'v Staleness,
    /// Tokens in a cache block (`blockSizeTokens`).
    block_tokens: u64,
}

impl TablePool<'_, '_> {
    /// Pod slot `slot`'s cached prefix of the request, credited by tier.
    fn cached_prefix(&self, slot: usize) -> CachedPrefix {
        CachedPrefix::of(&self.coverage, self.matches.tiers(slot), self.credits)
    }
}

impl<'a> Pool<'a> for TablePool<'_, 'a> {
    fn len(&self) -> usize {
        self.view.table.pods.len()
    }

    fn candidate(&self, index: usize) -> Candidate<'a> {
        let view = self.view;
        let table: &'a PodTable = view.table;
        let Some(pod) = table.pods.get(index) else {
            return [].candidate(index);
        };
        let cached = self.cached_prefix(pod.slot);
        let load = view.inflight.get(pod.slot).copied().unwrap_or_default();
        let inflight = load.requests;
        let uncached_tokens = self
            .coverage
            .prompt_tokens()
            .saturating_sub(cached.cached_tokens);
        let queued_prefill = u64::from(load.prefill_tokens);
        // A prefix cached outside GPU memory is reloaded before the prefill.
        let own = uncached_tokens.saturating_add(cached.reload_tokens);
        let work = Work::new(queued_prefill, own).with_attention(
            u64::from(load.prefill_attention),
            attention(uncached_tokens, self.coverage.prompt_tokens()),
        );
        let estimate = view.ttft.estimate(pod.slot, work);
        Candidate {
            slot: pod.slot,
            id: &pod.id,
            cache_match: cached.cache_match,
            cached_tokens: cached.cached_tokens,
            uncached_tokens,
            streams: load.streams,
            carried: view.occupancy.carried(pod.slot),
            queued_prefill,
            work,
            predicted_ttft_ms: estimate.ttft_ms,
            prefill_ms_per_token: estimate.ms_per_token,
            queued_ms_per_token: estimate.ms_per_queued_token,
            busy: view.occupancy.busy(pod.slot),
            health: if self.stale_snapshot {
                let age = view.now_ms.saturating_sub(pod.last_report_ms);
                pod.reported_health * self.staleness.health_factor(age)
            } else {
                pod.health
            },
            load: pod.load,
            queue: pod
                .queue
                .saturating_add(inflight.saturating_sub(pod.inflight_at_report)),
            adapter_loaded: self
                .adapter
                .is_some_and(|a| pod.adapters.iter().any(|loaded| loaded == a)),
            attributes: &pod.attributes,
            free_tokens: pod.kv_room.free_blocks.map(|blocks| {
                blocks
                    .saturating_mul(self.block_tokens)
                    .saturating_sub(queued_prefill)
            }),
            reuse_share: pod.kv_room.reuse_share,
        }
    }

    fn holders(&self) -> Vec<(usize, f64)> {
        self.matches
            .iter_tiers()
            .filter_map(|(slot, tiers)| {
                let index = self.view.table.index_of_slot(slot)?;
                let cached = CachedPrefix::of(&self.coverage, tiers, self.credits);
                Some((index, cached.cache_match))
            })
            .collect()
    }

    fn adapter_holders(&self) -> Vec<usize> {
        self.adapter.map_or_else(Vec::new, |adapter| {
            self.view
                .table
                .adapter_holders(adapter)
                .iter()
                .map(|&i| i as usize)
                .collect()
        })
    }
}

/// See the module documentation.
#[derive(Debug)]
pub struct Router {
    config: Config,
    prompts: PromptRenderer,
    hasher: BlockHasher,
    policy: ScoringPolicy,
    staleness: Staleness,
}

/// A request reduced to what routing needs: parsed, model resolved, hashed.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingRequest {
    /// Client-facing model name (empty when the body could not be parsed).
    pub model: String,
    pub adapter: Option<String>,
    /// The prompt's block chain; empty when routing by load alone.
    pub chain: Vec<u64>,
    /// How much of the whole prompt a matched prefix covers (the cache
    /// match and the predicted cached tokens).
    pub coverage: Coverage,
    /// Why cache-aware routing is skipped, for a bad or unknown request.
    pub degraded: Option<String>,
    /// The answer carries `usage`, so the prediction can be checked
    /// against its `cached_tokens` (see [`crate::request::ParsedRequest`]).
    pub answer_reports_usage: bool,
    /// The answer is streamed: its first byte is its first token, so its
    /// TTFT teaches the [`TtftModel`] (an unstreamed answer's first byte
    /// comes after its last token).
    pub streamed: bool,
    /// SLO mode's target ([`crate::scoring::slo`]), if any.
    pub ttft_target_ms: Option<f64>,
    /// It continues a conversation ([`crate::request::ParsedRequest::follows_up`]).
    pub follows_up: Option<bool>,
}

impl RoutingRequest {
    /// A request routed by load alone.
    pub fn by_load(model: String, degraded: String) -> RoutingRequest {
        RoutingRequest {
            model,
            adapter: None,
            chain: Vec::new(),
            coverage: Coverage::NONE,
            degraded: Some(degraded),
            // Routed by load, nothing is predicted.
            answer_reports_usage: false,
            streamed: false,
            ttft_target_ms: None,
            follows_up: None,
        }
    }
}

impl Router {
    pub fn new(config: Config) -> Router {
        Router {
            prompts: PromptRenderer::new(&config),
            hasher: BlockHasher::from_config(&config),
            policy: ScoringPolicy::from_config(&config),
            staleness: Staleness::from_config(&config),
            config,
        }
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The `model` label of a request's metrics: a configured model name,
    /// `other` for any other name, `invalid` for a body that could not be
    /// parsed. Label values come only from the configuration, so clients
    /// cannot create metric series (Envoy never drops them).
    pub fn model_label<'a>(&self, model: &'a str) -> &'a str {
        if model.is_empty() {
            "invalid"
        } else if self.config.models.contains_key(model) {
            model
        } else {
            "other"
        }
    }

    /// Whether `path` (without query) is one kvroute routes, and if so
    /// whether it is the chat form.
    pub fn route_kind(&self, path: &str) -> Option<bool> {
        let path = path.split('?').next().unwrap_or(path);
        self.config
            .route_paths
            .iter()
            .any(|p| p == path)
            .then(|| path.ends_with("/chat/completions"))
    }

    /// Decides where `body` goes. `tie_breaker` spreads exact ties.
    pub fn route(
        &self,
        body: &[u8],
        chat: bool,
        view: &ClusterView<'_>,
        tie_breaker: u64,
    ) -> Outcome {
        match self.prepare(body, chat) {
            Ok(request) => self.route_prepared(request, view, tie_breaker, Attempt::Arrival),
            Err(rejected) => Outcome::Rejected(rejected),
        }
    }

    /// Decides where an already prepared request goes (the replay
    /// simulator hashes each trace request once and routes it many times).
    /// It may hold out for a full pod that caches more of its prefix
    /// ([`Outcome::NoEligiblePod`] with a [`HoldOut`]; see
    /// [`crate::queueing`]), for at most [`Router::hold_bound_ms`] over
    /// every `attempt`.
    pub fn route_prepared(
        &self,
        request: RoutingRequest,
        view: &ClusterView<'_>,
        tie_breaker: u64,
        attempt: Attempt,
    ) -> Outcome {
        let RoutingRequest {
            model,
            adapter,
            chain,
            coverage,
            degraded: request_degraded,
            answer_reports_usage,
            streamed,
            ttft_target_ms,
            follows_up,
        } = request;
        // A request that waits is routed again later, as it came.
        let waiting = |chain: Vec<u64>, rejected: Rejected, holding_out: Option<HoldOut>| {
            Outcome::NoEligiblePod(Box::new(NoEligiblePod {
                request: RoutingRequest {
                    model: model.clone(),
                    adapter: adapter.clone(),
                    chain,
                    coverage,
                    degraded: request_degraded.clone(),
                    answer_reports_usage,
                    streamed,
                    ttft_target_ms,
                    follows_up,
                },
                rejected,
                holding_out,
            }))
        };
        let mut degraded = request_degraded.clone();
        let snapshot_age_ms = view.now_ms.saturating_sub(view.table.published_at_ms);
        let stale_snapshot = snapshot_age_ms > self.staleness.snapshot_stale_after_ms();
        if stale_snapshot {
            degraded.get_or_insert_with(|| {
                format!(
                    "the report service's snapshot is {snapshot_age_ms} ms old: routing by load"
                )
            });
        }
        let matches = if chain.is_empty() || stale_snapshot {
            PrefixMatch::default()
        } else {
            view.index.lookup(&chain)
        };
        let pool = TablePool {
            view,
            matches: &matches,
            coverage,
            credits: &self.config.tier_credits,
            adapter: adapter.as_deref(),
            stale_snapshot,
            staleness: &self.staleness,
            block_tokens: self.config.block_size_tokens as u64,
        };
        // A request leaving the wait queue for room goes to a pod only once
        // that pod has drained below `maxQueue`, one request per freed
        // place: the queue balances the pods already, and balance would
        // only trade its cache hit for a miss on another pod that has room.
        // Past the wait's limits nothing bounds a pod's queue: balance
        // weighs the request as an arrival's (spread counts arrivals only).
        let longest = matches.longest();
        let match_end = spread::match_end(&chain, longest);
        let balancing = match attempt {
            Attempt::Arrival => Some(Balancing {
                error: view.ttft.error(),
                // Never for a conversation's later turn: it follows its
                // history, whatever this router has seen of it.
                demand: match_end
                    .filter(|_| follows_up != Some(true))
                    .and_then(|end| view.prefix_demand.demand(end, view.table.pods.len()))
                    .map(|d| spread::Demand {
                        // Counted only for a session start at a branch point.
                        holders: matches
                            .iter()
                            .filter(|&(_, blocks)| blocks == longest)
                            .count(),
                        ..d
                    }),
            }),
            Attempt::PastWaitLimit => Some(Balancing::with_error(view.ttft.error())),
            Attempt::Waiting { .. } => None,
        };
        let past_limit = attempt == Attempt::PastWaitLimit;
        let mut decision = if past_limit {
            self.policy
                .decide_past_max_queue(&pool, adapter.is_some(), tie_breaker, balancing)
        } else {
            self.policy
                .decide(&pool, adapter.is_some(), tie_breaker, balancing)
        };
        let target = ttft_target_ms.filter(|_| view.ttft.calibrated() && !past_limit);
        let waited_ms = attempt.holding_ms() as f64;
        match target.and_then(|t| slo::place(&decision, &pool, t, waited_ms)) {
            Some(SloChoice::Route(index)) => decision.chosen = Some(index),
            Some(SloChoice::Wait(soonest))
                if self.config.on_no_eligible_pod == NoPodPolicy::Wait =>
            {
                let soonest = view.table.pods.get(soonest);
                let hold = HoldOut {
                    pod_id: soonest.map_or_else(String::new, |p| p.id.clone()),
                    held_blocks: soonest.map_or(0, |p| matches.blocks(p.slot)),
                    offered_blocks: 0,
                };
                let rejected = Rejected {
                    status: 503,
                    kind: "ServiceUnavailableError",
                    message: format!(
                        "no inference pod is predicted to answer within the TTFT target of {} ms",
                        target.unwrap_or_default()
                    ),
                    retry_after: Some(self.config.retry_after_seconds),
                };
                return waiting(chain, rejected, Some(hold));
            }
            // Without gateway waiting, the soonest pod.
            Some(SloChoice::Wait(soonest)) => decision.chosen = Some(soonest),
            None => {}
        }
        let (pod, fallback) = match decision.chosen {
            Some(index) => (index, false),
            None => match self.fallback_index(view.table) {
                Some(index) => (index, true),
                None => {
                    let rejected = self.no_eligible_pod(&decision, view.table);
                    if self.config.on_no_eligible_pod != NoPodPolicy::Wait || past_limit {
                        return Outcome::Rejected(rejected);
                    }
                    return waiting(chain, rejected, None);
                }
            },
        };
        // The pool's indexes are the table's.
        let (Some(chosen), candidate) = (view.table.pods.get(pod), pool.candidate(pod)) else {
            return Outcome::Rejected(Rejected {
                status: 503,
                kind: "ServiceUnavailableError",
                message: format!("kvroute chose pod {pod}, which is not in the pod table"),
                retry_after: Some(self.config.retry_after_seconds),
            });
        };
        let matched_blocks = matches.blocks(chosen.slot);
        if !fallback && !past_limit {
            let hold = self.hold_out(&decision, view.table, &matches, matched_blocks);
            if let Some(hold) =
                hold.filter(|h| attempt.holding_ms() < self.hold_bound_ms(h, &coverage))
            {
                let rejected = self.holding_out_rejection(&hold, chain.len());
                return waiting(chain, rejected, Some(hold));
            }
        }
        let composite = decision.winner().map_or(0.0, |w| w.composite);
        let ranked = if fallback {
            vec![pod]
        } else {
            decision.ranked()
        };
        let destinations = ranked
            .into_iter()
            .filter_map(|index| view.table.pods.get(index))
            .map(|p| Destination {
                slot: p.slot,
                pod_id: p.id.clone(),
                address: p.address.clone(),
            })
            .collect();
        Outcome::Routed(Box::new(Routed {
            pod,
            slot: chosen.slot,
            pod_id: chosen.id.clone(),
            address: chosen.address.clone(),
            model,
            adapter_load_triggered: adapter
                .as_ref()
                .is_some_and(|a| !chosen.adapters.contains(a)),
            adapter,
            cache_match: candidate.cache_match,
            chain,
            match_end,
            follows_up,
            matched_blocks,
            matched_tiers: matches.tiers(chosen.slot),
            matches,
            composite,
            predicted_cached_tokens: coverage.tokens(matched_blocks),
            prefill_tokens: u32::try_from(candidate.uncached_tokens).unwrap_or(u32::MAX),
            prefill_attention: u32::try_from(candidate.work.own_attention).unwrap_or(u32::MAX),
            work: candidate.work,
            predicted_evicted_blocks: candidate
                .evicted_tokens()
                .div_ceil(self.config.block_size_tokens.max(1) as u64),
            predicted_ttft_ms: candidate.predicted_ttft_ms,
            runner_up_ttft_ms: decision.runner_up().map(|s| s.predicted_ttft_ms),
            streamed,
            degraded,
            fallback,
            stale_snapshot,
            destinations,
            decision,
        }))
    }

    /// The full pod a request routed to a pod caching `offered_blocks` of
    /// it should hold out for: the one excluded at `maxQueue` caching the
    /// most blocks, if more than offered. Only a full pod: room there
    /// comes back as its queue drains, while a pod the router passed over
    /// with room (balance, a lower composite) or for its health
    /// was passed over on purpose.
    fn hold_out(
        &self,
        decision: &Decision,
        table: &PodTable,
        matches: &PrefixMatch,
        offered_blocks: u32,
    ) -> Option<HoldOut> {
        if self.config.on_no_eligible_pod != NoPodPolicy::Wait {
            return None;
        }
        let (held_blocks, pod_id) = decision
            .excluded
            .iter()
            .filter(|(_, why)| matches!(why, Exclusion::QueueFull { .. }))
            .filter_map(|(i, _)| table.pods.get(*i))
            .map(|p| (matches.blocks(p.slot), p.id.as_str()))
            .max_by_key(|(blocks, _)| *blocks)?;
        (held_blocks > offered_blocks).then(|| HoldOut {
            pod_id: pod_id.to_string(),
            held_blocks,
            offered_blocks,
        })
    }

    /// How long a request may hold out in all for `hold`:
    /// `affinityWaitMs` × the share of the prompt cached on the full pod
    /// and not on the pod with room — the wait worth the prefill it saves,
    /// `affinityWaitMs` being the wait worth a whole prompt's.
    pub fn hold_bound_ms(&self, hold: &HoldOut, coverage: &Coverage) -> u64 {
        let saved = coverage.fraction(hold.held_blocks) - coverage.fraction(hold.offered_blocks);
        (self.config.affinity_wait_bound_ms() as f64 * saved.max(0.0)) as u64
    }

    /// The 503 of a request holding out, if it cannot wait any longer.
    fn holding_out_rejection(&self, hold: &HoldOut, blocks: usize) -> Rejected {
        Rejected {
            status: 503,
            kind: "ServiceUnavailableError",
            message: format!(
                "waiting for pod {}, which caches {} of the prompt's {blocks} blocks (the pods with room cache {})",
                hold.pod_id, hold.held_blocks, hold.offered_blocks
            ),
            retry_after: Some(self.config.retry_after_seconds),
        }
    }

    /// A request that waits behind `ahead` earlier ones without being
    /// routed ([`crate::queueing::WaitQueue::must_queue`]); the first of
    /// them waits because `why`.
    pub fn queued_behind(&self, request: RoutingRequest, ahead: usize, why: &str) -> NoEligiblePod {
        NoEligiblePod {
            request,
            rejected: Rejected {
                status: 503,
                kind: "ServiceUnavailableError",
                message: format!(
                    "{ahead} earlier requests are waiting for an inference pod; the first: {why}"
                ),
                retry_after: Some(self.config.retry_after_seconds),
            },
            holding_out: None,
        }
    }

    /// The 503 for a request no pod can take, naming the first
    /// [`NAMED_EXCLUSIONS`] exclusions (a pool has up to 1,024 pods).
    fn no_eligible_pod(&self, decision: &Decision, table: &PodTable) -> Rejected {
        let excluded = decision.excluded.len();
        let mut named: Vec<String> = decision
            .excluded
            .iter()
            .take(NAMED_EXCLUSIONS)
            .filter_map(|(i, why)| table.pods.get(*i).map(|p| format!("{} {why}", p.id)))
            .collect();
        if excluded > NAMED_EXCLUSIONS {
            named.push(format!("and {} more", excluded - NAMED_EXCLUSIONS));
        }
        Rejected {
            status: 503,
            kind: "ServiceUnavailableError",
            message: format!(
                "no inference pod can take the request ({excluded} excluded: {})",
                named.join("; ")
            ),
            retry_after: Some(self.config.retry_after_seconds),
        }
    }

    fn fallback_index(&self, table: &PodTable) -> Option<usize> {
        if self.config.on_no_eligible_pod != NoPodPolicy::Fallback {
            return None;
        }
        let id = self.config.fallback_pod.as_ref()?;
        table.pods.iter().position(|p| &p.id == id)
    }

    /// Parses the body, resolves the model and hashes the prompt, applying
    /// the bad-request and unknown-model policies.
    pub fn prepare(&self, body: &[u8], chat: bool) -> Result<RoutingRequest, Rejected> {
        let bad = |message: String| match self.config.on_bad_request {
            BadRequestPolicy::Reject => Err(Rejected {
                status: 400,
                kind: "BadRequestError",
                message,
                retry_after: None,
            }),
            BadRequestPolicy::Route => Ok(RoutingRequest::by_load(String::new(), message)),
        };
        if body.len() > self.config.max_body_bytes {
            return bad(format!(
                "request body exceeds maxBodyBytes ({} bytes)",
                self.config.max_body_bytes
            ));
        }
        let request = match self.prompts.prompt(body, chat) {
            Ok(request) => request,
            Err(e) => return bad(e.0),
        };
        match self.config.resolve_model(&request.model) {
            Some(target) => Ok(RoutingRequest {
                chain: self
                    .hasher
                    .chain(&target, &request.prompt, request.cache_salt.as_deref()),
                coverage: self.hasher.coverage(&request.prompt),
                adapter: target.adapter,
                ttft_target_ms: self
                    .config
                    .balance
                    .ttft_target_ms
                    .as_ref()
                    .and_then(|t| t.of(&request.model)),
                model: request.model,
                degraded: None,
                answer_reports_usage: request.answer_reports_usage,
                streamed: request.stream,
                follows_up: request.follows_up,
            }),
            None if self.config.on_unknown_model == BadRequestPolicy::Reject => Err(Rejected {
                status: 404,
                kind: "NotFoundError",
                message: format!("The model `{}` does not exist.", request.model),
                retry_after: None,
            }),
            None => {
                let why = format!("model {:?} is not configured", request.model);
                Ok(RoutingRequest::by_load(request.model, why))
            }
        }
    }

    /// A JSON explanation of a routed request's decision: every
    /// candidate's matched blocks by tier, factors, composite, predicted
    /// TTFT and whether it lost its cache term to a clearly faster pod,
    /// and the excluded pods with the reason.
    pub fn explain(&self, table: &PodTable, routed: &Routed) -> String {
        let decision = &routed.decision;
        let names = self.policy.scorer_names();
        let candidates: Vec<serde_json::Value> = decision
            .scored
            .iter()
            .map(|s| {
                let factors: serde_json::Map<String, serde_json::Value> = names
                    .iter()
                    .zip(&s.factors)
                    .map(|(n, v)| (n.to_string(), serde_json::json!(round4(*v))))
                    .collect();
                let matched = table
                    .pods
                    .get(s.index)
                    .map_or_else(TierBlocks::default, |p| routed.matches.tiers(p.slot));
                serde_json::json!({"pod": pod_id(table, s.index), "matchedBlocks": matched,
                                   "factors": factors, "composite": round4(s.composite),
                                   "predictedTtftMs": round4(s.predicted_ttft_ms), "cacheWithheld": s.cache_withheld, "outpaced": s.outpaced})
            })
            .collect();
        let excluded: Vec<serde_json::Value> = decision
            .excluded
            .iter()
            .map(
                |(i, why)| serde_json::json!({"pod": pod_id(table, *i), "reason": why.to_string()}),
            )
            .collect();
        serde_json::json!({"candidates": candidates, "excluded": excluded}).to_string()
    }
}

fn pod_id(table: &PodTable, index: usize) -> &str {
    table.pods.get(index).map_or("", |p| p.id.as_str())
}

fn round4(value: f64) -> f64 {
    (value * 10_000.0).round() / 10_000.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ClusterState;
    use crate::index::PrefixTree;

    fn config() -> Config {
        Config::parse(
            br#"{"pods": [{"id": "a", "address": "127.0.0.1:9001"},
                          {"id": "b", "address": "127.0.0.1:9002"}]}"#,
        )
        .unwrap()
    }

    fn report(pod: &str, queue: u32, hashes: &[u64]) -> Vec<u8> {
        let hashes: Vec<String> = hashes
            .iter()
            .map(|h| format!("\"{}\"", crate::report::hash_to_hex(*h)))
            .collect();
        format!(
            r#"{{"version":1,"podId":"{pod}","epoch":"e","seq":1,"full":true,"queueDepth":{queue},
                "health":1.0,"stored":[{{"parent":null,"hashes":[{}]}}]}}"#,
            hashes.join(",")
        )
        .into_bytes()
    }

    #[test]
    fn a_stale_snapshot_routes_by_load_with_health_decayed_as_the_service_would() {
        let config = config();
        let router = Router::new(config.clone());
        let body = br#"{"model": "m", "prompt": "PROMPT"}"#;
        let prompt = "x".repeat(640);
        let body = String::from_utf8_lossy(body).replace("PROMPT", &prompt);
        let chain = router.prepare(body.as_bytes(), false).unwrap().chain;
        let mut cluster = ClusterState::new(&config, 0);
        // `a` holds the prompt but is busier; `b` holds nothing.
        cluster
            .apply_report("a", &report("a", 5, &chain), 1000, 0)
            .0
            .unwrap();
        cluster
            .apply_report("b", &report("b", 0, &[]), 1000, 0)
            .0
            .unwrap();
        let published = cluster.publish(1000).table;
        let mut tree = PrefixTree::new(1000);
        tree.insert_chain(0, None, &chain);
        let inflight = [SlotLoad::default(); 2];
        let ttft = TtftModel::new(64);
        let occupancy = Occupancy::default();
        let prefix_demand = PrefixDemand::default();
        let view = |now_ms| ClusterView {
            table: &published,
            index: &tree,
            inflight: &inflight,
            ttft: &ttft,
            occupancy: &occupancy,
            prefix_demand: &prefix_demand,
            now_ms,
        };
        let route = |now_ms| match router.route(body.as_bytes(), false, &view(now_ms), 1) {
            Outcome::Routed(routed) => routed,
            other => panic!("{other:?}"),
        };

        let fresh = route(1500);
        assert_eq!((fresh.pod_id.as_str(), fresh.stale_snapshot), ("a", false));
        assert_eq!(fresh.cache_match, 1.0);
        let order: Vec<(&str, &str)> = fresh
            .destinations
            .iter()
            .map(|d| (d.pod_id.as_str(), d.address.as_str()))
            .collect();
        assert_eq!(order, [("a", "127.0.0.1:9001"), ("b", "127.0.0.1:9002")]);

        // Stale after grace (2000 + 1000) + 2 intervals = 7000 ms.
        let stale = route(1000 + 7001);
        assert!(stale.stale_snapshot);
        assert_eq!((stale.pod_id.as_str(), stale.cache_match), ("b", 0.0));
        assert!(stale.degraded.unwrap().contains("snapshot is 7001 ms old"));
        // Reports 7001 ms old: 1 − 4001/6000 of health, as the service decays.
        let health = stale.decision.scored[0].factors[3];
        assert!((health - (1.0 - 4001.0 / 6000.0)).abs() < 1e-3, "{health}");

        // Once every report is too old, nothing is eligible: by default
        // the request comes back to wait, ready to be routed again.
        match router.route(body.as_bytes(), false, &view(1000 + 9001), 1) {
            Outcome::NoEligiblePod(waiting) => {
                assert_eq!(waiting.rejected.status, 503);
                assert_eq!(waiting.request.chain, chain);
                assert_eq!(waiting.request.degraded, None);
                assert!(matches!(
                    router.route_prepared(waiting.request, &view(1500), 2, Attempt::Arrival),
                    Outcome::Routed(_)
                ));
            }
            other => panic!("{other:?}"),
        }
        let mut reject = config.clone();
        reject.on_no_eligible_pod = NoPodPolicy::Reject;
        match Router::new(reject).route(body.as_bytes(), false, &view(1000 + 9001), 1) {
            Outcome::Rejected(rejected) => assert_eq!(rejected.status, 503),
            other => panic!("{other:?}"),
        }
    }

    /// A router over pods `a` and `b` with `a` reporting `queue_a` waiting
    /// requests and holding the first `held` blocks of a 10-block prompt;
    /// `route` routes that prompt with `inflight` and `attempt`.
    struct HoldOutCase {
        router: Router,
        table: PodTable,
        tree: PrefixTree,
        request: RoutingRequest,
    }

    impl HoldOutCase {
        fn new(config: Config, queue_a: u32, held: usize) -> HoldOutCase {
            let router = Router::new(config.clone());
            let prompt = "y".repeat(10 * 64);
            let body = format!(r#"{{"model": "m", "prompt": "{prompt}"}}"#);
            let request = router.prepare(body.as_bytes(), false).unwrap();
            assert_eq!(request.chain.len(), 10);
            let mut cluster = ClusterState::new(&config, 0);
            let held_chain = &request.chain[..held];
            cluster
                .apply_report("a", &report("a", queue_a, held_chain), 1000, 0)
                .0
                .unwrap();
            cluster
                .apply_report("b", &report("b", 0, &[]), 1000, 0)
                .0
                .unwrap();
            let mut tree = PrefixTree::new(1000);
            tree.insert_chain(0, None, held_chain);
            HoldOutCase {
                router,
                table: cluster.publish(1000).table,
                tree,
                request,
            }
        }

        /// `inflight` requests per pod, each with 1,000 tokens to prefill.
        fn route(&self, inflight: [u32; 2], attempt: Attempt) -> Outcome {
            self.route_with(inflight, attempt, &TtftModel::new(64))
        }

        fn route_with(&self, inflight: [u32; 2], attempt: Attempt, ttft: &TtftModel) -> Outcome {
            let inflight = inflight.map(|requests| SlotLoad {
                requests,
                prefill_tokens: requests * 1000,
                prefill_attention: 0,
                streams: requests,
            });
            let view = ClusterView {
                table: &self.table,
                index: &self.tree,
                inflight: &inflight,
                ttft,
                occupancy: &Occupancy::default(),
                prefix_demand: &Default::default(),
                now_ms: 1000,
            };
            self.router
                .route_prepared(self.request.clone(), &view, 1, attempt)
        }
    }

    fn routed_to(outcome: Outcome) -> String {
        match outcome {
            Outcome::Routed(routed) => routed.pod_id,
            other => panic!("{other:?}"),
        }
    }

    fn held_out(outcome: Outcome) -> HoldOut {
        match outcome {
            Outcome::NoEligiblePod(waiting) => waiting.holding_out.unwrap(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_request_holds_out_for_the_full_pod_caching_its_prefix_for_a_bounded_time() {
        // `a` caches the whole prompt but is at maxQueue; `b` has room.
        let case = HoldOutCase::new(config(), 20, 10);
        let hold = held_out(case.route([0, 0], Attempt::Arrival));
        assert_eq!(
            hold,
            HoldOut {
                pod_id: "a".into(),
                held_blocks: 10,
                offered_blocks: 0
            }
        );
        // The whole prompt to gain: two thirds of maxWaitMs (20 s).
        assert_eq!(
            case.router.hold_bound_ms(&hold, &case.request.coverage),
            20_000
        );
        let waiting = |holding_ms| Attempt::Waiting { holding_ms };
        held_out(case.route([0, 0], waiting(19_999)));
        assert_eq!(routed_to(case.route([0, 0], waiting(20_000))), "b");

        // Less to gain, less patience: 4 of 10 blocks, 8 s.
        let partial = HoldOutCase::new(config(), 20, 4);
        let hold = held_out(partial.route([0, 0], Attempt::Arrival));
        assert_eq!(
            partial
                .router
                .hold_bound_ms(&hold, &partial.request.coverage),
            8_000
        );
        assert_eq!(routed_to(partial.route([0, 0], waiting(8_000))), "b");

        // Never when the cache pod has room (it is chosen), with
        // affinityWaitMs 0, or without gateway waiting.
        assert_eq!(
            routed_to(HoldOutCase::new(config(), 0, 10).route([0, 0], Attempt::Arrival)),
            "a"
        );
        let never = Config {
            affinity_wait_ms: Some(0),
            ..config()
        };
        assert_eq!(
            routed_to(HoldOutCase::new(never, 20, 10).route([0, 0], Attempt::Arrival)),
            "b"
        );
        let reject = Config {
            on_no_eligible_pod: NoPodPolicy::Reject,
            ..config()
        };
        assert_eq!(
            routed_to(HoldOutCase::new(reject, 20, 10).route([0, 0], Attempt::Arrival)),
            "b"
        );
    }

    #[test]
    fn balance_spares_requests_leaving_the_wait_queue_for_room_only() {
        // `a` caches the 160-token prompt and has room, but 10,000 tokens
        // to prefill before it (even uncalibrated, far past the prior
        // error): an arrival goes to idle `b`, a waiting request to `a`.
        let case = HoldOutCase::new(config(), 0, 10);
        assert_eq!(routed_to(case.route([10, 0], Attempt::Arrival)), "b");
        let waiting = Attempt::Waiting { holding_ms: 0 };
        assert_eq!(routed_to(case.route([10, 0], waiting)), "a");
        // Past the wait's limits `a` is at maxQueue, where nothing bounds
        // its queue: balanced as an arrival, to `b`.
        let full = HoldOutCase::new(config(), 20, 10);
        assert_eq!(routed_to(full.route([10, 0], Attempt::PastWaitLimit)), "b");
        // With balance off the cache decides, as it does for arrivals.
        let off = Config {
            balance: crate::config::BalanceConfig {
                enabled: false,
                ..Default::default()
            },
            ..config()
        };
        let full = HoldOutCase::new(off, 20, 10);
        assert_eq!(routed_to(full.route([10, 0], Attempt::PastWaitLimit)), "a");
    }

    #[test]
    fn slo_mode_takes_the_cheapest_pod_in_time_and_holds_out_for_one() {
        // Both pods answer in 10 ms + 0.1 ms a token of prefill work.
        let mut ttft = TtftModel::new(64);
        for i in 0..32u64 {
            let work = 100 + (i % 4) * 1000;
            ttft.observe(0, Work::new(0, work), 10.0 + 0.1 * work as f64);
            ttft.observe(1, Work::new(0, work), 10.0 + 0.1 * work as f64);
        }
        let target = |ms: f64| Config {
            balance: crate::config::BalanceConfig {
                ttft_target_ms: Some(crate::config::TtftTarget::All(ms)),
                ..Default::default()
            },
            ..config()
        };
        // `a` caches the 160-token prompt with 2,000 tokens queued (210 ms);
        // `b` is idle and caches nothing (26 ms). Within 250 ms both are
        // in time and `a`, which prefills nothing, is the cheapest.
        let case = HoldOutCase::new(target(250.0), 0, 10);
        assert_eq!(
            routed_to(case.route_with([2, 0], Attempt::Arrival, &ttft)),
            "a"
        );
        // Within 100 ms only `b` is.
        let case = HoldOutCase::new(target(100.0), 0, 10);
        assert_eq!(
            routed_to(case.route_with([2, 0], Attempt::Arrival, &ttft)),
            "b"
        );
        // Within 20 ms neither, but an idle `a` would be (10 ms): it holds
        // out, until waiting cannot help any more.
        let case = HoldOutCase::new(target(20.0), 0, 10);
        let hold = held_out(case.route_with([2, 1], Attempt::Arrival, &ttft));
        assert_eq!(hold.pod_id, "b");
        let waited = Attempt::Waiting { holding_ms: 11 };
        assert_eq!(routed_to(case.route_with([2, 1], waited, &ttft)), "b");
        // An uncalibrated model predicts in tokens: no target applies.
        assert_eq!(routed_to(case.route([2, 1], Attempt::Arrival)), "a");
    }

    /// Routes a 1,280-byte prompt among idle pods `gpu` (holds it in GPU
    /// memory), `cpu` (its last 15 of 20 blocks in CPU memory) and `none`,
    /// through reports with tiers and the published snapshot.
    /// Also its explain line.
    fn route_among_tiers(credits: TierCredits, pods: &[&str]) -> (Routed, serde_json::Value) {
        let mut config = Config::parse(
            br#"{"pods": [{"id": "gpu", "address": "127.0.0.1:9001"},
                          {"id": "cpu", "address": "127.0.0.1:9002"},
                          {"id": "none", "address": "127.0.0.1:9003"}]}"#,
        )
        .unwrap();
        config.tier_credits = credits;
        let router = Router::new(config.clone());
        let body = format!(r#"{{"model": "m", "prompt": "{}"}}"#, "y".repeat(1280));
        let chain = router.prepare(body.as_bytes(), false).unwrap().chain;
        assert_eq!(chain.len(), 20);
        let hex = |hashes: &[u64]| {
            hashes
                .iter()
                .map(|h| format!("\"{}\"", crate::report::hash_to_hex(*h)))
                .collect::<Vec<_>>()
                .join(",")
        };
        let report = |pod: &str, stored: String| {
            format!(
                r#"{{"version":1,"podId":"{pod}","epoch":"e","seq":1,"full":true,"queueDepth":0,
                    "health":1.0,"stored":[{stored}]}}"#
            )
        };
        let mut cluster = ClusterState::new(&config, 0);
        let whole = format!(r#"{{"parent":null,"hashes":[{}]}}"#, hex(&chain));
        let split = format!(
            r#"{{"parent":null,"hashes":[{}]}},{{"parent":"{}","hashes":[{}],"tier":"cpu"}}"#,
            hex(&chain[..5]),
            crate::report::hash_to_hex(chain[4]),
            hex(&chain[5..])
        );
        for (pod, stored) in [("gpu", whole), ("cpu", split), ("none", String::new())] {
            let stored = if pods.contains(&pod) {
                stored
            } else {
                String::new()
            };
            cluster
                .apply_report(pod, report(pod, stored).as_bytes(), 1000, 0)
                .0
                .unwrap();
        }
        let publication = cluster.publish(1000);
        let store: std::collections::HashMap<u32, Vec<u8>> =
            publication.buckets.into_iter().collect();
        let index = crate::snapshot::SnapshotIndex {
            buckets: publication.table.buckets,
            fetch: |b| store.get(&b).cloned(),
        };
        let inflight = [SlotLoad::default(); 3];
        let ttft = TtftModel::new(64);
        let view = ClusterView {
            table: &publication.table,
            index: &index,
            inflight: &inflight,
            ttft: &ttft,
            occupancy: &Occupancy::default(),
            prefix_demand: &Default::default(),
            now_ms: 1500,
        };
        match router.route(body.as_bytes(), false, &view, 0) {
            Outcome::Routed(routed) => {
                let explained = router.explain(&publication.table, &routed);
                (*routed, serde_json::from_str(&explained).unwrap())
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_gpu_hit_beats_a_cpu_hit_which_beats_none() {
        let all = ["gpu", "cpu", "none"];
        let (routed, explained) = route_among_tiers(TierCredits::default(), &all);
        assert_eq!(routed.pod_id, "gpu");
        assert_eq!(
            routed.matched_tiers,
            TierBlocks {
                gpu: 20,
                cpu: 0,
                disk: 0
            }
        );
        assert_eq!(routed.cache_match, 1.0);
        // The CPU holder's reload is a tenth of a prefill of those 960
        // bytes' 240 tokens (the uncalibrated model predicts in tokens):
        // the GPU holder is clearly faster, and balance withholds the CPU
        // holder's cache term.
        let cpu = &routed.decision.scored[1];
        assert_eq!((cpu.predicted_ttft_ms, cpu.cache_withheld), (24.0, true));
        let matched = |pod: usize| explained["candidates"][pod]["matchedBlocks"].clone();
        assert_eq!(
            matched(0),
            serde_json::json!({"gpu": 20, "cpu": 0, "disk": 0})
        );
        assert_eq!(
            matched(1),
            serde_json::json!({"gpu": 5, "cpu": 15, "disk": 0})
        );
        assert_eq!(
            matched(2),
            serde_json::json!({"gpu": 0, "cpu": 0, "disk": 0})
        );

        let (routed, _) = route_among_tiers(TierCredits::default(), &["cpu", "none"]);
        assert_eq!(routed.pod_id, "cpu");
        assert_eq!(
            routed.matched_tiers,
            TierBlocks {
                gpu: 5,
                cpu: 15,
                disk: 0
            }
        );
        // 5 blocks on the GPU, 15 in CPU memory at 0.9: 0.25 + 0.675.
        assert!((routed.cache_match - 0.925).abs() < 1e-9);
        assert_eq!(routed.predicted_cached_tokens, 320);
        assert_eq!((routed.prefill_tokens, routed.work), (0, Work::new(0, 24)));

        // Tier-blind: the two holders tie on every factor.
        let (blind, _) = route_among_tiers(TierCredits::BLIND, &all);
        let composites: Vec<f64> = blind.decision.scored.iter().map(|s| s.composite).collect();
        assert_eq!(composites[0], composites[1]);
        assert!(composites[2] < composites[0]);
    }

    #[test]
    fn metric_labels_come_from_the_configuration_only() {
        let mut config = config();
        config.models.insert(
            "chat".into(),
            crate::config::ModelTarget {
                base_model: "llama".into(),
                adapter: None,
            },
        );
        let router = Router::new(config);
        assert_eq!(router.model_label("chat"), "chat");
        assert_eq!(router.model_label("x y"), "other");
        assert_eq!(router.model_label("unknown"), "other");
        let bad = router.prepare(b"not json", false).unwrap();
        assert_eq!(router.model_label(&bad.model), "invalid");
    }

    #[test]
    fn other_methods_get_405_naming_post() {
        let rejected = Rejected::method_not_allowed("GET");
        assert_eq!(rejected.status, 405);
        assert!(rejected.headers().contains(&("allow", "POST".to_string())));
        let body: serde_json::Value = serde_json::from_slice(&rejected.body()).unwrap();
        assert_eq!(body["error"]["type"], "MethodNotAllowedError");
        assert!(body["error"]["message"].as_str().unwrap().contains("GET"));
    }
}
