//! The HTTP filter's life of a request, written once for every host.
//!
//! 1. Request headers: strip the routing headers a client could use to
//!    choose a pod (`x-envoy-original-dst-host`,
//!    `x-gateway-destination-endpoint`), whatever the mode; pass paths
//!    kvroute does not route; refuse a method other than POST; pause until
//!    the body is complete (at its end, or at the trailers).
//! 2. Route the buffered body ([`crate::router::Router`]) with the current
//!    snapshot, and set the routing header: `upstreamMode` `overrideHost`
//!    lists the destinations, comma-separated, for Envoy's override-host
//!    policy (one per attempt); `originalDst` names the chosen pod for an
//!    ORIGINAL_DST cluster. The request counts in flight on its pod, and a
//!    session start (not a chat's later turn) goes to the service, whose
//!    feed counts it for every worker ([`crate::scoring::feed`]). A
//!    request no pod can take waits in the worker's queue ([`super::waiting`]).
//! 3. Response headers: learn which listed pods Envoy failed to reach
//!    (ejected for every worker, [`crate::ejection`]) and which pod serves
//!    (after a failover it takes over the in-flight count), and add the
//!    decision headers when asked.
//! 4. Response body: the first byte ends the queued-prefill count and, for
//!    a streamed answer, measures the TTFT model's error and goes to the
//!    service, whose feed teaches every worker's model
//!    ([`crate::scoring::feed`]); a sampled answer's
//!    `usage.cached_tokens` checks the cache prediction.
//! 5. Stream end: the in-flight count is released, waiting requests get a
//!    dispatch round, and an idle worker flushes its batches.
//!
//! Per-request work that need not be on the request's path is batched per
//! worker: the routing decisions for the service and the metrics
//! ([`super::metrics`]) are flushed on the worker's tick ([`TICK_MS`]),
//! when a request ends with nothing else in flight on the worker (after
//! its response), or when [`FLUSH_DECISIONS`] decisions piled up. Other
//! workers therefore learn of a decision when its request ends or at most
//! one tick later (its own worker at once in approximate mode, through
//! [`RecentDecisions`]; in precise mode when the service has folded the
//! batch, see there).
//! Measured reason (proxy-wasm, Envoy 1.40): each host call costs Envoy a
//! few µs, most of kvroute's CPU per request; a shared-queue message per
//! decision woke the service once per request.

use std::time::Instant;

use serde::Serialize;
use serde_json::json;

use super::events::{self, event};
use super::host::{Action, HostError, Stream, WorkerHost};
use super::metrics::{percent, Metric, MetricBatch};
use super::waiting::{self, Waiting};
use crate::config::{Config, IndexMode, UpstreamMode};
use crate::ejection::UpstreamOutcome;
use crate::index::TierBlocks;
use crate::memory::{Published, RouterMemory};
use crate::queueing::{Priority, PRIORITY_HEADER};
use crate::report::Tier;
use crate::router::{Attempt, Destination, Outcome, Rejected, Routed, Router, RoutingRequest};
use crate::scoring::feed::{Answer, FeedReader, FeedRecord, SessionStart};
use crate::scoring::spread::PrefixDemand;
use crate::scoring::ttft::{TtftModel, Work};
use crate::snapshot::{push_answer, push_decision, push_start, InflightChange, SlotLoad};
use crate::usage::CachedTokensScanner;

/// Where an ORIGINAL_DST cluster connects (`upstreamMode` `originalDst`).
pub const ORIGINAL_DST_HEADER: &str = "x-envoy-original-dst-host";
/// The override-host policy's source in `envoy/envoy.template.yaml`, the
/// Gateway API Inference Extension's header (`upstreamMode` `overrideHost`).
pub const OVERRIDE_HOST_HEADER: &str = "x-gateway-destination-endpoint";
/// A request's own TTFT target in ms (SLO mode, [`crate::scoring::slo`]):
/// the client's claim, as the priority header is; set or strip it at the
/// edge when clients are not trusted. Not a number, or not positive:
/// ignored.
pub const TTFT_TARGET_HEADER: &str = "x-kvroute-ttft-target-ms";

/// Period of a worker's tick: the flush of the batched decisions and
/// metrics ([`Worker::flush`]), and the wait queue's deadlines, owed
/// answers and a dispatch round (a pod's queue falls when its report
/// arrives, not only when a request of this worker ends).
pub const TICK_MS: u64 = 25;

/// Decisions batched before they are sent at once (bounds the batch, and
/// how late the other workers learn of a burst's decisions).
pub const FLUSH_DECISIONS: usize = 64;

/// A counter that picks one event in every `every` (none for 0).
#[derive(Default)]
struct Sample(u64);

impl Sample {
    fn next(&mut self, every: u32) -> bool {
        self.0 = self.0.wrapping_add(1);
        every > 0 && self.0.is_multiple_of(u64::from(every))
    }
}

/// Per-worker state shared by the worker's requests.
pub struct Worker<H: WorkerHost> {
    pub host: H,
    router: Router,
    /// Decisions, answers' first bytes and session starts not yet sent to
    /// the service ([`crate::snapshot::BatchRecord`]), and how many.
    decisions: (Vec<u8>, usize),
    /// Requests decided, from a random start: the seed of each decision's
    /// draws (a large pool's sampled candidates, [`crate::scoring::candidates`])
    /// and the rotation among pods that score alike. Counted from zero,
    /// every worker of every replica drew the same samples and made the
    /// same tie picks at the same count: power-of-d choices assume
    /// independent draws, and three replicas' six workers all sent their
    /// first cold start to the second pod of four.
    requests: u64,
    /// Requests routed, for sampling the `route` log (`routeLogSample`).
    routed: Sample,
    /// Routed requests whose answer carries `usage`, for sampling the
    /// prediction check (`predictionCheckSample`).
    usage_answers: Sample,
    /// Requests waiting for a pod ([`super::waiting`]).
    pub(super) waiting: Waiting,
    pub(super) metrics: MetricBatch,
    /// What this worker learnt ([`RouterMemory`]): its decisions not yet
    /// published; the predicted-TTFT model, learned from every streamed
    /// answer of every worker and replica through the service's feed
    /// ([`crate::scoring::feed`]) and from the prefill queued per pod over
    /// every worker and replica ([`WorkerHost::inflight`]); the sessions
    /// started per prefix, this worker's as it routes them and every
    /// other worker's and replica's from the feed.
    memory: RouterMemory,
    /// Which records of the feed this worker took, and when to read it
    /// next.
    feed: FeedReader,
    next_feed_read_ms: u64,
    /// This worker's origin on the feed (never 0, a peer replica's): its
    /// own session starts are counted as routed, and skipped there.
    origin: u64,
}

/// A routed request, as its filter keeps it.
pub struct RoutedRequest {
    /// The pod serving it: the chosen one until a failover moves it.
    slot: usize,
    pod_id: String,
    /// The destinations given to Envoy, in order.
    listed: Vec<Destination>,
    composite: f64,
    cache_match: f64,
    predicted_cached_tokens: u64,
    /// What it adds to `slot`'s in-flight load now: one request, one
    /// stream and its uncached prompt tokens as queued prefill until its
    /// first response byte; then the stream, and the request unless
    /// `uncounted_when_answered`.
    load: SlotLoad,
    /// It stops counting in `slot`'s requests at its first response byte,
    /// not its end: in approximate mode no report says how many requests a
    /// pod queues, and a pod streaming many answers is not a full one.
    uncounted_when_answered: bool,
    /// What the TTFT model learns from at the first byte, while it is
    /// still to come: when the request was sent and the prefill work ahead
    /// of its first token. `None` for an answer that does not stream (its
    /// first byte comes after its last token) or after a failover.
    ttft: Option<(Instant, Work)>,
}

impl RoutedRequest {
    /// The in-flight change when this request leaves its pod.
    fn release(&self) -> InflightChange {
        InflightChange::between(self.slot, self.load, SlotLoad::default())
    }

    /// Its load once answering: the stream, and the request unless
    /// `uncounted_when_answered`.
    fn answering_load(&self) -> SlotLoad {
        SlotLoad {
            requests: if self.uncounted_when_answered {
                0
            } else {
                self.load.requests
            },
            prefill_tokens: 0,
            prefill_attention: 0,
            streams: self.load.streams,
        }
    }

    /// Whether its first response byte changes its load.
    fn answer_changes_load(&self) -> bool {
        self.answering_load() != self.load
    }

    /// Its first response byte: the pod has prefilled its prompt. The
    /// in-flight change, `None` when there is none.
    fn answered(&mut self) -> Option<InflightChange> {
        let answering = self.answering_load();
        let before = std::mem::replace(&mut self.load, answering);
        (before != self.load).then(|| InflightChange::between(self.slot, before, self.load))
    }
}

impl<H: WorkerHost> Worker<H> {
    pub fn new(config: Config, host: H) -> Worker<H> {
        Worker {
            host,
            waiting: Waiting::new(&config),
            memory: RouterMemory::new(&config),
            feed: FeedReader::default(),
            next_feed_read_ms: 0,
            origin: super::random_u64() | 1,
            router: Router::new(config),
            decisions: (Vec::new(), 0),
            requests: super::random_u64(),
            routed: Sample::default(),
            usage_answers: Sample::default(),
            metrics: MetricBatch::default(),
        }
    }

    pub fn config(&self) -> &Config {
        self.router.config()
    }

    /// What this worker's TTFT model learnt.
    pub fn ttft_model(&self) -> &TtftModel {
        &self.memory.ttft
    }

    /// The session starts this worker counted.
    pub fn prefix_demand(&self) -> &PrefixDemand {
        &self.memory.prefix_demand
    }

    /// Requests waiting on this worker.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether the tick has anything to do: waiting requests, owed
    /// answers, or batches to flush.
    pub fn has_work(&self) -> bool {
        self.waiting.has_work() || self.decisions.1 > 0 || !self.metrics.is_empty()
    }

    /// The worker's tick ([`TICK_MS`]): the wait queue, then the batches.
    pub fn on_tick(&mut self) {
        let now_ms = self.host.now_ms();
        if let Some(table) = self.host.routable_table(now_ms) {
            self.learn_from_feed(now_ms, table.pods.len());
        }
        waiting::on_tick(self);
        self.flush();
    }

    /// Hands the batched decisions to the service, the metrics to Envoy
    /// and the in-flight releases to the other workers.
    pub fn flush(&mut self) {
        self.send_decisions();
        self.flush_metrics();
        self.host.publish_releases();
    }

    pub(super) fn flush_metrics(&mut self) {
        self.metrics.flush(self.host.metric_sink());
    }

    /// Flushes the metrics when their sample batch is full.
    pub(super) fn bound_metrics(&mut self) {
        if self.metrics.full() {
            self.flush_metrics();
        }
    }

    /// Whether the next routed request logs its `route` line: one in
    /// `routeLogSample` (0: none).
    fn sample_route_log(&mut self) -> bool {
        let every = self.router.config().route_log_sample;
        self.routed.next(every)
    }

    /// Whether the answer of a request routed now, one that carries
    /// `usage`, has its `cached_tokens` checked: one in
    /// `predictionCheckSample` (0: none).
    fn sample_prediction_check(&mut self) -> bool {
        let every = self.router.config().prediction_check_sample;
        self.usage_answers.next(every)
    }

    /// What [`deliver`] needs of the router for a routed request: its
    /// model label, the upstream mode, how it counts in flight and whether
    /// to log its route.
    pub(super) fn delivery(&mut self, routed: &Routed) -> Delivery {
        let config = self.router.config();
        Delivery {
            model_label: self.router.model_label(&routed.model).to_string(),
            mode: config.upstream_mode,
            uncounted_when_answered: config.mode == IndexMode::Approximate,
            log_route: self.sample_route_log(),
        }
    }

    /// Routes a prepared request with the current snapshot; a routed one
    /// is recorded as this worker's decision.
    pub(super) fn decide(
        &mut self,
        request: RoutingRequest,
        request_id: &str,
        attempt: Attempt,
    ) -> Outcome {
        self.requests = self.requests.wrapping_add(1);
        let tie_breaker = self.requests;
        let now_ms = self.host.now_ms();
        let Some(table) = self.host.routable_table(now_ms) else {
            return Outcome::Rejected(Rejected {
                status: 503,
                kind: "ServiceUnavailableError",
                message: "kvroute has no pod state yet (the report service has not published)"
                    .into(),
                retry_after: Some(1),
            });
        };
        self.learn_from_feed(now_ms, table.pods.len());
        let inflight = self.host.inflight(table.slots());
        let outcome = {
            let index = self.host.index(&table);
            let published = Published {
                table: &table,
                index: &index,
                inflight: &inflight,
                now_ms,
            };
            self.memory
                .route(&self.router, request, published, tie_breaker, attempt)
        };
        let Outcome::Routed(routed) = &outcome else {
            return outcome;
        };
        if routed.stale_snapshot {
            self.metrics.increment(Metric::SnapshotStale);
            self.metrics.gauge(
                Metric::SnapshotAgeMs,
                now_ms.saturating_sub(table.published_at_ms),
            );
        }
        if log::log_enabled!(log::Level::Debug) {
            event(
                log::Level::Debug,
                "candidates",
                json!({"requestId": request_id, "explanation": serde_json::from_str::<serde_json::Value>(&self.router.explain(&table, routed)).unwrap_or_default()}),
            );
        }
        if log::log_enabled!(log::Level::Trace) {
            event(
                log::Level::Trace,
                "block_walk",
                json!({"requestId": request_id, "blocks": routed.chain.len(), "matchedBlocks": routed.matched_blocks,
                       "chain": routed.chain.iter().take(8).map(|h| crate::report::hash_to_hex(*h)).collect::<Vec<_>>()}),
            );
        }
        let batched = self.decisions.1;
        if routed.follows_up != Some(true) {
            let start = SessionStart {
                origin: self.origin,
                match_end: routed.match_end,
            };
            push_start(&mut self.decisions.0, routed.slot, &start);
            self.decisions.1 += 1;
        }
        if !routed.chain.is_empty() {
            push_decision(
                &mut self.decisions.0,
                routed.slot,
                &routed.chain,
                self.memory
                    .ttft
                    .prefilled_after_ms(routed.predicted_ttft_ms),
            );
            self.decisions.1 += 1;
        }
        // Replicated: the peers learn a decision from the service's log,
        // so it goes there at once (one queue message per request, about
        // a µs), not with the next tick or batch.
        if self.decisions.1 >= FLUSH_DECISIONS
            || (self.decisions.1 > batched && self.config().replicas.is_some())
        {
            self.send_decisions();
        }
        outcome
    }

    /// Sends the batched decisions to the service, which shares them with
    /// every worker.
    fn send_decisions(&mut self) {
        if self.decisions.1 == 0 {
            return;
        }
        self.host.send_decisions(&self.decisions.0);
        self.decisions.0.clear();
        self.decisions.1 = 0;
    }

    /// A streamed answer's first byte, `ttft` after the request was sent
    /// with `work` of prefill ahead of its first token: its error
    /// against this worker's model goes to
    /// `epp_ttft_prediction_error_percent` (and the DEBUG event
    /// `ttft_prediction`), and the answer to the service, whose feed
    /// teaches every worker's model ([`crate::scoring::feed`]).
    fn first_byte(
        &mut self,
        routed: &RoutedRequest,
        (sent, work): (Instant, Work),
        request_id: &str,
    ) {
        let ttft_ms = sent.elapsed().as_secs_f64() * 1000.0;
        if !(ttft_ms.is_finite() && ttft_ms > 0.0) {
            return;
        }
        // Measured once the model predicts in ms; learnt from either way.
        if let Some(error) = self.memory.ttft.relative_error(routed.slot, work, ttft_ms) {
            self.metrics.histogram(
                Metric::TtftPredictionErrorPercent,
                (error * 100.0).round() as u64,
            );
        }
        if log::log_enabled!(log::Level::Debug) {
            let predicted_ms = self.memory.ttft.predict(routed.slot, work);
            event(
                log::Level::Debug,
                "ttft_prediction",
                json!({"requestId": request_id, "pod": routed.pod_id, "workTokens": work.tokens,
                       "ownTokens": work.own_tokens, "attention": work.attention,
                       "ownAttention": work.own_attention, "spanTokens": self.memory.ttft.span(),
                       "predictedTtftMs": round_ms(predicted_ms), "ttftMs": round_ms(ttft_ms)}),
            );
        }
        push_answer(
            &mut self.decisions.0,
            &Answer::new(routed.slot, work, ttft_ms),
        );
        self.decisions.1 += 1;
        if self.decisions.1 >= FLUSH_DECISIONS {
            self.send_decisions();
        }
    }

    /// Takes the records of the service's feed not taken yet, at most once
    /// per [`TICK_MS`]: every answer teaches the model, and every other
    /// worker's and replica's session start counts in `prefix_demand`
    /// (this worker's counted as it routed them), in a pool of `pods`.
    fn learn_from_feed(&mut self, now_ms: u64, pods: usize) {
        if now_ms < self.next_feed_read_ms {
            return;
        }
        self.next_feed_read_ms = now_ms + TICK_MS;
        let Some(feed) = self.host.feed() else {
            return;
        };
        for record in self.feed.read(&feed) {
            match record {
                FeedRecord::Answer(answer) => {
                    self.memory.ttft.observe(
                        usize::from(answer.slot),
                        answer.work(),
                        f64::from(answer.ttft_ms),
                    );
                }
                FeedRecord::Start(start) if start.origin != self.origin => {
                    self.memory.record_start(start.match_end, pods);
                }
                FeedRecord::Start(_) => {}
            }
        }
    }
}

/// Milliseconds to 0.01 ms, for logs.
fn round_ms(ms: f64) -> f64 {
    (ms * 100.0).round() / 100.0
}

/// The answer when the host cannot do what kvroute needs.
pub(super) fn internal_error(message: &str) -> Rejected {
    Rejected {
        status: 503,
        kind: "ServiceUnavailableError",
        message: message.into(),
        retry_after: Some(1),
    }
}

/// Answers `stream` locally with `rejected`, counted and logged.
pub(super) fn answer(
    metrics: &mut MetricBatch,
    stream: &mut impl Stream,
    request_id: &str,
    rejected: &Rejected,
) {
    metrics.increment_labelled(Metric::RequestsRejected, &rejected.status.to_string());
    event(
        log::Level::Info,
        "reject",
        json!({"requestId": request_id, "status": rejected.status, "message": rejected.message}),
    );
    let headers = rejected.headers();
    let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    if let Err(error) = stream.send_response(rejected.status, &headers, &rejected.body()) {
        log::error!(
            "kvroute filter: local reply {} failed: {error}",
            rejected.status
        );
    }
}

/// How a routed request is handed to its pod ([`Worker::delivery`]).
pub(super) struct Delivery {
    model_label: String,
    mode: UpstreamMode,
    uncounted_when_answered: bool,
    log_route: bool,
}

/// Sends `stream`'s request to its pod: sets the routing header of
/// `mode` and records the decision's metrics (under `model_label`, the
/// decision taking `elapsed_us`) and, when `log_route`, its `route` log
/// line. The caller counts it in flight ([`RoutedRequest::arrival`]).
pub(super) fn deliver(
    metrics: &mut MetricBatch,
    stream: &mut impl Stream,
    routed: &Routed,
    Delivery {
        model_label,
        mode,
        uncounted_when_answered,
        log_route,
    }: Delivery,
    elapsed_us: u64,
    request_id: &str,
) -> Result<RoutedRequest, Rejected> {
    let (header, listed) = match mode {
        UpstreamMode::OverrideHost => (OVERRIDE_HOST_HEADER, routed.destinations.clone()),
        UpstreamMode::OriginalDst => (
            ORIGINAL_DST_HEADER,
            routed.destinations.iter().take(1).cloned().collect(),
        ),
    };
    let addresses: Vec<&str> = listed.iter().map(|d| d.address.as_str()).collect();
    if stream
        .set_request_header(header, &addresses.join(","))
        .is_err()
    {
        return Err(internal_error("cannot set the routing header"));
    }
    metrics.increment_labelled(Metric::RoutingDecisions, &model_label);
    metrics.histogram(Metric::CacheMatchRatio, percent(routed.cache_match));
    for tier in Tier::ALL {
        let blocks = routed.matched_tiers.of(tier);
        if blocks > 0 {
            metrics.add(Metric::CacheMatchedBlocks, tier.name(), i64::from(blocks));
        }
    }
    metrics.histogram(Metric::CompositeScore, percent(routed.composite));
    metrics.histogram(Metric::ScoringLatencyUs, elapsed_us);
    metrics.gauge(Metric::CandidatePods, routed.decision.scored.len() as u64);
    if routed.adapter_load_triggered {
        if let Some(adapter) = &routed.adapter {
            metrics.increment_labelled(Metric::AdapterLoadsTriggered, adapter);
        }
    }
    if let Some(reason) = &routed.degraded {
        metrics.increment(Metric::DegradedRouting);
        event(
            log::Level::Info,
            "degraded_routing",
            json!({"requestId": request_id, "reason": reason}),
        );
    }
    if routed.fallback {
        metrics.increment(Metric::FallbackRouting);
    }
    if routed.decision.spread {
        metrics.increment(Metric::PrefixSpread);
    }
    if routed.predicted_evicted_blocks > 0 {
        let blocks = i64::try_from(routed.predicted_evicted_blocks).unwrap_or(i64::MAX);
        metrics.add(Metric::PodKvEvictionsPredicted, &routed.pod_id, blocks);
    }
    if log_route {
        events::record(
            log::Level::Info,
            &RouteEvent {
                event: "route",
                request_id,
                model: &routed.model,
                pod: &routed.pod_id,
                composite: (routed.composite * 1e4).round() / 1e4,
                cache_match: (routed.cache_match * 1e4).round() / 1e4,
                matched_blocks: routed.matched_blocks,
                matched_tiers: routed.matched_tiers,
                blocks: routed.chain.len(),
                candidates: routed.decision.scored.len(),
                latency_us: elapsed_us,
                predicted_ttft_ms: round_ms(routed.predicted_ttft_ms),
                runner_up_ttft_ms: routed.runner_up_ttft_ms.map(round_ms),
                spread: routed.decision.spread,
            },
        );
    }
    Ok(RoutedRequest {
        slot: routed.slot,
        pod_id: routed.pod_id.clone(),
        listed,
        composite: routed.composite,
        cache_match: routed.cache_match,
        predicted_cached_tokens: routed.predicted_cached_tokens,
        load: SlotLoad {
            requests: 1,
            prefill_tokens: routed.prefill_tokens,
            prefill_attention: routed.prefill_attention,
            streams: 1,
        },
        uncounted_when_answered,
        ttft: routed.streamed.then(|| (Instant::now(), routed.work)),
    })
}

/// The `route` log line (one per request, or per `routeLogSample`).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct RouteEvent<'a> {
    event: &'static str,
    request_id: &'a str,
    model: &'a str,
    pod: &'a str,
    composite: f64,
    cache_match: f64,
    matched_blocks: u32,
    /// `matchedBlocks` by the tier the pod holds them in.
    matched_tiers: TierBlocks,
    blocks: usize,
    candidates: usize,
    latency_us: u64,
    predicted_ttft_ms: f64,
    runner_up_ttft_ms: Option<f64>,
    /// Sent to a pod without its shared prefix ([`crate::scoring::spread`]).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    spread: bool,
}

impl RoutedRequest {
    /// The in-flight change when this request is sent to its pod.
    pub(super) fn arrival(&self) -> InflightChange {
        InflightChange::between(self.slot, SlotLoad::default(), self.load)
    }
}

/// One request's filter state.
pub struct RequestFilter {
    /// The host's id of this request (how the wait queue names it).
    id: u32,
    /// `Some(is_chat)` for a request kvroute routes and has not yet routed.
    chat: Option<bool>,
    request_id: String,
    /// The priority header (`PRIORITY_HEADER`), read with the others.
    priority: String,
    /// SLO mode's per-request target (`TTFT_TARGET_HEADER`), if valid.
    ttft_target_ms: Option<f64>,
    /// The answer carries `usage` and is in the sample: its
    /// `cached_tokens` checks the prediction.
    checks_prediction: bool,
    routed: Option<RoutedRequest>,
    scanner: CachedTokensScanner,
    response_ok: bool,
}

/// A header as text; absent, failed or not UTF-8 reads as "".
fn text(header: Result<Option<Vec<u8>>, HostError>) -> String {
    header
        .ok()
        .flatten()
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .unwrap_or_default()
}

impl RequestFilter {
    pub fn new(id: u32) -> RequestFilter {
        RequestFilter {
            id,
            chat: None,
            request_id: String::new(),
            priority: String::new(),
            ttft_target_ms: None,
            checks_prediction: false,
            routed: None,
            scanner: CachedTokensScanner::default(),
            response_ok: false,
        }
    }

    /// Envoy connects wherever these headers say (ORIGINAL_DST: any
    /// address; override-host: any member): never let a client choose,
    /// whatever the mode. If the host cannot remove them, refuse; if it
    /// cannot read the headers, remove both anyway. `Err`: the answer.
    fn strip_routing_headers(stream: &mut impl Stream) -> Result<(), Rejected> {
        for header in [ORIGINAL_DST_HEADER, OVERRIDE_HOST_HEADER] {
            let present = stream.request_header(header).map_or(true, |h| h.is_some());
            if present && stream.remove_request_header(header).is_err() {
                return Err(internal_error(&format!("cannot strip {header}")));
            }
        }
        Ok(())
    }

    /// The request headers of a filter whose plugin never configured
    /// (Envoy then refuses the plugin, so this is a guard): the routing
    /// headers are stripped and the request is answered 503.
    pub fn unconfigured(stream: &mut impl Stream) -> Action {
        let rejected = Self::strip_routing_headers(stream)
            .err()
            .unwrap_or_else(|| internal_error("kvroute filter is not configured"));
        let headers = rejected.headers();
        let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        let _ = stream.send_response(rejected.status, &headers, &rejected.body());
        Action::Pause
    }

    pub fn on_request_headers<H: WorkerHost>(
        &mut self,
        worker: &mut Worker<H>,
        stream: &mut impl Stream,
        end_of_stream: bool,
    ) -> Action {
        if let Err(rejected) = Self::strip_routing_headers(stream) {
            return self.reject(worker, stream, &rejected);
        }
        let path = text(stream.request_header(":path"));
        let Some(chat) = worker.router.route_kind(&path) else {
            return Action::Continue;
        };
        let method = text(stream.request_header(":method"));
        if method != "POST" {
            return self.reject(worker, stream, &Rejected::method_not_allowed(&method));
        }
        self.request_id = text(stream.request_header("x-request-id"));
        self.priority = text(stream.request_header(PRIORITY_HEADER));
        self.ttft_target_ms = text(stream.request_header(TTFT_TARGET_HEADER))
            .parse::<f64>()
            .ok()
            .filter(|ms| ms.is_finite() && *ms > 0.0);
        self.chat = Some(chat);
        if end_of_stream {
            self.route(worker, stream, &[])
        } else {
            Action::Pause
        }
    }

    /// A body chunk; `body_size` is what the host has buffered so far
    /// (`usize::MAX` when it does not say).
    pub fn on_request_body<H: WorkerHost>(
        &mut self,
        worker: &mut Worker<H>,
        stream: &mut impl Stream,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if self.chat.is_none() {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.route_buffered(worker, stream, body_size)
    }

    /// The request's trailers: the body is complete and still buffered.
    pub fn on_request_trailers<H: WorkerHost>(
        &mut self,
        worker: &mut Worker<H>,
        stream: &mut impl Stream,
    ) -> Action {
        if self.chat.is_none() {
            return Action::Continue;
        }
        self.route_buffered(worker, stream, usize::MAX)
    }

    pub fn on_response_headers<H: WorkerHost>(
        &mut self,
        worker: &mut Worker<H>,
        stream: &mut impl Stream,
    ) -> Action {
        self.response_ok = stream.response_header(":status") == "200";
        self.pick_up_dispatched(worker);
        self.observe_upstream(worker, stream);
        let Some(routed) = &self.routed else {
            return Action::Continue;
        };
        if worker.router.config().decision_headers {
            let headers = [
                ("x-kvroute-pod", routed.pod_id.clone()),
                ("x-kvroute-score", format!("{:.4}", routed.composite)),
                (
                    "x-kvroute-cache-match",
                    format!("{:.4}", routed.cache_match),
                ),
            ];
            for (name, value) in headers {
                let _ = stream.set_response_header(name, &value);
            }
        }
        Action::Continue
    }

    /// Whether [`RequestFilter::on_response_body`] has anything to do: the
    /// first byte ends the queued prefill and teaches the TTFT model, and a
    /// sampled answer is read until its `usage`. A host may skip the
    /// callback (and its costs) for every other chunk of a streamed answer.
    pub fn wants_response_body(&self) -> bool {
        self.routed
            .as_ref()
            .is_some_and(|r| r.answer_changes_load() || r.ttft.is_some() || self.watches_usage(r))
    }

    /// Whether this answer's chunks are read for `cached_tokens`.
    fn watches_usage(&self, routed: &RoutedRequest) -> bool {
        self.response_ok
            && self.checks_prediction
            && self.scanner.found().is_none()
            && routed.predicted_cached_tokens > 0
    }

    /// A response body chunk of `body_size` bytes (streamed: nothing is
    /// buffered).
    pub fn on_response_body<H: WorkerHost>(
        &mut self,
        worker: &mut Worker<H>,
        stream: &mut impl Stream,
        body_size: usize,
    ) -> Action {
        // The first byte of the answer: the pod has prefilled the prompt.
        if let Some(routed) = self.routed.as_mut() {
            if let Some(change) = routed.answered() {
                worker.host.adjust_inflight(&[change]);
                if change.requests < 0 {
                    // The pod's queue just shrank: a waiting request may fit.
                    waiting::dispatch(worker);
                }
            }
            if let Some(sent) = routed.ttft.take().filter(|_| self.response_ok) {
                worker.first_byte(routed, sent, &self.request_id);
            }
        }
        // Each chunk read is a host call and a copy: none for an answer
        // without `usage` (a stream the client did not ask usage for) or
        // outside the sample (`predictionCheckSample`).
        let watching = self.routed.as_ref().is_some_and(|r| self.watches_usage(r));
        if watching {
            let chunk = stream.response_chunk(body_size);
            if let Some(actual) = self.scanner.feed(&chunk) {
                self.check_prediction(worker, actual);
            }
        }
        Action::Continue
    }

    /// The stream ended (also after local replies and client resets).
    pub fn on_stream_end<H: WorkerHost>(&mut self, worker: &mut Worker<H>) {
        // A client that went away while waiting frees its place.
        waiting::leave(worker, self.id);
        self.pick_up_dispatched(worker);
        if let Some(routed) = self.routed.as_ref() {
            worker.host.adjust_inflight(&[routed.release()]);
            waiting::dispatch(worker);
        }
        // Off every request's path: a worker with nothing in flight flushes
        // now, a busy one on the tick.
        if worker.host.idle() {
            worker.flush();
        }
    }

    /// Routes the complete, buffered body (at most `body_size` bytes).
    fn route_buffered<H: WorkerHost>(
        &mut self,
        worker: &mut Worker<H>,
        stream: &mut impl Stream,
        body_size: usize,
    ) -> Action {
        // One byte past the limit is enough to know the body is too large.
        let limit = worker.router.config().max_body_bytes.saturating_add(1);
        let body = stream.request_body(body_size.min(limit));
        self.route(worker, stream, &body)
    }

    fn route<H: WorkerHost>(
        &mut self,
        worker: &mut Worker<H>,
        stream: &mut impl Stream,
        body: &[u8],
    ) -> Action {
        // Routed once: later callbacks of this request pass.
        let Some(chat) = self.chat.take() else {
            return Action::Continue;
        };
        let started = Instant::now();
        if !worker.waiting.is_empty() {
            // Earlier requests go first: dispatch them, then come back to
            // this request (dispatching acted on theirs).
            waiting::dispatch(worker);
            if stream.reactivate().is_err() {
                let rejected = internal_error("cannot return to the request context");
                return self.reject(worker, stream, &rejected);
            }
        }
        let priority = Priority::from_header(&self.priority);
        let mut prepared = worker.router.prepare(body, chat);
        if let (Ok(request), Some(ms)) = (&mut prepared, self.ttft_target_ms) {
            request.ttft_target_ms = Some(ms);
        }
        if let Ok(request) = &prepared {
            self.checks_prediction =
                request.answer_reports_usage && worker.sample_prediction_check();
        }
        let behind = worker.waiting.must_queue(priority).map(str::to_string);
        let outcome = match (prepared, behind) {
            // Behind earlier requests a round did not place: it waits its turn.
            (Ok(request), Some(why)) => {
                let ahead = worker.waiting.len();
                let queued = worker.router.queued_behind(request, ahead, &why);
                Outcome::NoEligiblePod(Box::new(queued))
            }
            (Ok(request), None) => worker.decide(request, &self.request_id, Attempt::Arrival),
            (Err(rejected), _) => Outcome::Rejected(rejected),
        };
        let elapsed_us = started.elapsed().as_micros() as u64;
        match outcome {
            Outcome::Rejected(rejected) => self.reject(worker, stream, &rejected),
            Outcome::NoEligiblePod(no_pod) => {
                match waiting::admit(worker, self.id, priority, &self.request_id, *no_pod) {
                    Ok(()) => Action::Pause,
                    Err(rejected) => self.reject(worker, stream, &rejected),
                }
            }
            Outcome::Routed(routed) => {
                let delivery = worker.delivery(&routed);
                let delivered = deliver(
                    &mut worker.metrics,
                    stream,
                    &routed,
                    delivery,
                    elapsed_us,
                    &self.request_id,
                );
                worker.bound_metrics();
                match delivered {
                    Ok(delivered) => {
                        worker.host.adjust_inflight(&[delivered.arrival()]);
                        self.routed = Some(delivered);
                        Action::Continue
                    }
                    Err(rejected) => self.reject(worker, stream, &rejected),
                }
            }
        }
    }

    /// Learns from the response's start which listed pods Envoy failed to
    /// reach, ejecting them for every worker, and which pod is serving: after
    /// a failover it takes over the in-flight count and the decision header.
    fn observe_upstream<H: WorkerHost>(
        &mut self,
        worker: &mut Worker<H>,
        stream: &mut impl Stream,
    ) {
        let Some(routed) = self.routed.as_mut() else {
            return;
        };
        let last_host = stream.upstream_host();
        // The common case, in one host call: the first listed pod answered
        // 200. Envoy's retries move down the list, so it served the first
        // attempt and no pod failed.
        if self.response_ok
            && last_host.is_some()
            && last_host.as_deref() == routed.listed.first().map(|d| d.address.as_str())
        {
            return;
        }
        let outcome = UpstreamOutcome {
            attempts: stream.upstream_attempts().unwrap_or(1),
            last_host: last_host.as_deref(),
            flags: stream.response_flags().unwrap_or(0),
        };
        let listed: Vec<&str> = routed.listed.iter().map(|d| d.address.as_str()).collect();
        let failed = outcome.failed(&listed);
        let served = outcome.served();
        if failed.is_empty() && served.is_none_or(|address| listed.first() == Some(&address)) {
            return;
        }
        let Some(table) = worker.host.current_table() else {
            return;
        };
        let policy = worker.router.config().passive_health.clone();
        let now_ms = worker.host.now_ms();
        let pod_at = |address: &str| table.pods.iter().find(|p| p.address == address);
        for pod in failed.iter().filter_map(|address| pod_at(address)) {
            if let Some(ejection) = worker.host.eject(pod, &table, now_ms, &policy) {
                worker
                    .metrics
                    .increment_labelled(Metric::PassiveEjections, &pod.id);
                event(
                    log::Level::Warn,
                    "pod_ejected",
                    json!({"requestId": self.request_id, "pod": pod.id, "address": pod.address,
                           "ejectionMs": ejection.duration_ms(), "attempts": outcome.attempts, "responseFlags": outcome.flags}),
                );
            }
        }
        let Some(server) = served.and_then(pod_at) else {
            return;
        };
        if server.slot == routed.slot {
            return;
        }
        worker.metrics.increment(Metric::Failovers);
        event(
            log::Level::Info,
            "failover",
            json!({"requestId": self.request_id, "chosen": routed.pod_id, "servedBy": server.id, "attempts": outcome.attempts}),
        );
        let released = routed.release();
        routed.slot = server.slot;
        worker.host.adjust_inflight(&[released, routed.arrival()]);
        routed.pod_id = server.id.clone();
        // The cache and TTFT predictions were for the chosen pod.
        routed.predicted_cached_tokens = 0;
        routed.ttft = None;
    }

    /// Takes over the routing of a request the wait queue dispatched.
    fn pick_up_dispatched<H: WorkerHost>(&mut self, worker: &mut Worker<H>) {
        if self.routed.is_none() {
            self.routed = worker.waiting.take_dispatched(self.id);
        }
    }

    fn reject<H: WorkerHost>(
        &mut self,
        worker: &mut Worker<H>,
        stream: &mut impl Stream,
        rejected: &Rejected,
    ) -> Action {
        self.chat = None;
        answer(&mut worker.metrics, stream, &self.request_id, rejected);
        Action::Pause
    }

    /// Counts a checked cache prediction, and one the pod did not honour
    /// (it had evicted blocks the router still believed cached): fewer
    /// than half the predicted tokens were served from cache.
    fn check_prediction<H: WorkerHost>(&self, worker: &mut Worker<H>, actual: u64) {
        let Some(routed) = &self.routed else { return };
        worker.metrics.increment(Metric::CachePredictionsChecked);
        let stale = actual.saturating_mul(2) < routed.predicted_cached_tokens;
        if stale {
            worker.metrics.increment(Metric::StaleCacheRouting);
        }
        event(
            if stale {
                log::Level::Info
            } else {
                log::Level::Debug
            },
            "cache_prediction",
            json!({"requestId": self.request_id, "pod": routed.pod_id, "predictedCachedTokens": routed.predicted_cached_tokens,
                   "cachedTokens": actual, "stale": stale}),
        );
    }
}
