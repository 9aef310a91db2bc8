//! The HTTP filter: routes each OpenAI request to a pod.
//!
//! Host behaviour this relies on:
//! - `on_http_request_headers` returning `Pause` holds the headers until
//!   a later callback continues (needs `allow_on_headers_stop_iteration:
//!   true` in the PluginConfig, or the request hangs);
//! - while paused, `body_size` is the total buffered so far; we act once
//!   the request is complete — at the body's `end_of_stream`, or at the
//!   trailers when the request has them (HTTP/2, or HTTP/1 chunked with
//!   `enable_trailers`), where the buffered body is still readable — and
//!   set the routing header before continuing: `upstreamMode`
//!   `overrideHost` sets `x-gateway-destination-endpoint` to the
//!   destinations, comma-separated, which Envoy's override-host policy
//!   takes one per attempt (only addresses of the cluster's members, the
//!   fallback policy after the list); `originalDst` sets
//!   `x-envoy-original-dst-host`, which the ORIGINAL_DST cluster connects to;
//! - `on_http_response_headers` runs for the pod's response and for
//!   Envoy's own 503 after a failed connection, with `response.flags`,
//!   `upstream.address` (the last attempt's host) and
//!   `upstream.request_attempt_count` readable: what passive health
//!   ([`crate::ejection`]) learns from, and which pod is serving;
//! - `on_log` runs once at the end of every stream (also after local
//!   replies and client resets): the in-flight count is released there.
//!
//! A request no pod can take stays paused and waits in the worker's queue
//! until a pod can (see [`waiting`], which also lists the host behaviour
//! that resuming and answering it from other contexts relies on).
//!
//! Per-request work that need not be on the request's path is batched per
//! worker: the routing decisions for the service (one shared-queue message
//! per batch) and the metrics ([`metrics`]) are flushed on the root tick
//! ([`TICK_MS`]), when a request ends with nothing else in flight on the
//! worker (after its response), or when [`FLUSH_DECISIONS`] decisions
//! piled up. Other workers therefore learn of a decision when its request
//! ends or at most one tick later (its own worker at once, through
//! [`RecentDecisions`]). In-flight counts are published at once when they
//! grow, and their releases with the next growth or flush
//! ([`shared::adjust_inflight`]).
//!
//! Every host call goes through [`super::host`], which returns the host's
//! status instead of panicking: a request the host cannot serve is answered
//! or passed through, never a VM abort.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use serde_json::json;

use super::host::{self, Buffer, HeaderMap};
use super::logging::event;
use super::{load_config, metrics, shared};
use crate::config::UpstreamMode;
use crate::ejection::UpstreamOutcome;
use crate::index::{Merged, RecentDecisions};
use crate::queueing::{Priority, PRIORITY_HEADER};
use crate::router::{
    Attempt, ClusterView, Destination, Outcome, Rejected, Routed, Router, RoutingRequest,
};
use crate::scoring::ttft::TtftModel;
use crate::snapshot::{push_decision, SnapshotIndex, DECISION_QUEUE};
use crate::usage::CachedTokensScanner;

mod waiting;

/// A request's own TTFT target in ms (SLO mode, [`crate::scoring::slo`]):
/// the client's claim, as the priority header is; set or strip it at the
/// edge when clients are not trusted. Not a number, or not positive:
/// ignored.
const TTFT_TARGET_HEADER: &str = "x-kvroute-ttft-target-ms";

/// Where an ORIGINAL_DST cluster connects (`upstreamMode` `originalDst`).
const ORIGINAL_DST_HEADER: &str = "x-envoy-original-dst-host";
/// The override-host policy's source in `envoy/envoy.template.yaml`, the
/// Gateway API Inference Extension's header (`upstreamMode` `overrideHost`).
const OVERRIDE_HOST_HEADER: &str = "x-gateway-destination-endpoint";

/// Period of the root's tick: the flush of the batched decisions and
/// metrics ([`Worker::flush`]), and the wait queue's deadlines, owed
/// answers and a dispatch round (a pod's queue falls when its report
/// arrives, not only when a request of this worker ends).
const TICK_MS: u64 = 25;

/// Decisions batched before they are sent at once (bounds the batch, and
/// how late the other workers learn of a burst's decisions).
const FLUSH_DECISIONS: usize = 64;

/// Per-worker state shared by the worker's requests.
struct Worker {
    router: Router,
    tables: shared::TableCache,
    /// Approximate mode: this worker's own decisions, seen at once.
    recent: RecentDecisions,
    decision_queue: Option<u32>,
    /// Decisions not yet sent to the service, and how many.
    decisions: (Vec<u8>, usize),
    requests: u64,
    /// Requests routed, for sampling the `route` log (`routeLogSample`).
    routed: Sample,
    /// Routed requests whose answer carries `usage`, for sampling the
    /// prediction check (`predictionCheckSample`).
    usage_answers: Sample,
    /// Requests waiting for a pod ([`waiting`]).
    waiting: waiting::Waiting,
    /// The predicted-TTFT model, learned from this worker's streamed
    /// answers ([`RoutedRequest::first_byte`]).
    ttft: TtftModel,
}

#[derive(Default)]
pub struct FilterRoot {
    worker: Option<Rc<RefCell<Worker>>>,
}

impl Context for FilterRoot {}

impl RootContext for FilterRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let configuration = host::buffer(Buffer::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten();
        let Some(config) = load_config(configuration, "filter") else {
            return false;
        };
        shared::init_ejections();
        if !shared::claim_inflight() {
            log::error!("kvroute filter: cannot claim an in-flight key in shared data");
            return false;
        }
        // Flushes the batches and runs the wait queue.
        if let Err(status) = host::set_tick_period_ms(TICK_MS) {
            log::error!("kvroute filter: cannot start the tick: {status}");
            return false;
        }
        self.worker = Some(Rc::new(RefCell::new(Worker {
            recent: RecentDecisions::new(&config),
            waiting: waiting::Waiting::new(&config),
            ttft: TtftModel::new(config.balance.learning_window),
            router: Router::new(config),
            tables: shared::TableCache::default(),
            decision_queue: None,
            decisions: (Vec::new(), 0),
            requests: 0,
            routed: Sample::default(),
            usage_answers: Sample::default(),
        })));
        true
    }

    fn on_tick(&mut self) {
        if let Some(worker) = &self.worker {
            let mut worker = worker.borrow_mut();
            waiting::on_tick(&mut worker);
            worker.flush();
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Never `None`: the SDK's dispatcher panics on it.
        Some(Box::new(RequestContext {
            context_id,
            worker: self.worker.clone(),
            chat: None,
            request_id: String::new(),
            priority: String::new(),
            ttft_target_ms: None,
            checks_prediction: false,
            routed: None,
            scanner: CachedTokensScanner::default(),
            response_ok: false,
        }))
    }
}

struct RoutedRequest {
    /// The pod serving it: the chosen one until a failover moves it.
    slot: usize,
    pod_id: String,
    /// The destinations given to Envoy, in order.
    listed: Vec<Destination>,
    composite: f64,
    cache_match: f64,
    predicted_cached_tokens: u64,
    /// Prompt tokens counted as queued prefill on `slot` until the first
    /// response byte (0 after it).
    queued_prefill: u32,
    /// What the TTFT model learns from at the first byte, while it is
    /// still to come: when it was sent and the prefill work ahead of it.
    /// `None` for an answer that does not stream (its
    /// first byte is its last token) or after a failover.
    ttft: Option<(Instant, u64)>,
}

impl RoutedRequest {
    /// The in-flight change when this request leaves its pod.
    fn release(&self) -> (usize, i64, i64) {
        (self.slot, -1, -i64::from(self.queued_prefill))
    }
}

struct RequestContext {
    /// The host's id of this request (how the wait queue names it).
    context_id: u32,
    /// `None` only if the plugin never configured (Envoy then refuses it).
    worker: Option<Rc<RefCell<Worker>>>,
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

impl Context for RequestContext {}

impl HttpContext for RequestContext {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // One host call for every header this filter reads; each host call
        // costs Envoy a few µs (measured: most of kvroute's CPU per request
        // is Envoy's side of its host calls, not the decision).
        let headers = host::headers(HeaderMap::Request);
        // Envoy connects wherever these headers say (ORIGINAL_DST: any
        // address; override-host: any member): never let a client choose,
        // whatever the mode. If the host cannot remove them, refuse; if it
        // cannot list the headers, remove both anyway.
        for header in [ORIGINAL_DST_HEADER, OVERRIDE_HOST_HEADER] {
            let present = headers.as_ref().map_or(true, |h| h.contains(header));
            if present && host::remove_header(HeaderMap::Request, header).is_err() {
                return self.reject(&internal_error(&format!("cannot strip {header}")));
            }
        }
        let headers = headers.unwrap_or_default();
        let Some(worker) = self.worker.clone() else {
            return self.reject(&internal_error("kvroute filter is not configured"));
        };
        let path = headers.text(":path");
        let Some(chat) = worker.borrow().router.route_kind(&path) else {
            return Action::Continue;
        };
        let method = headers.text(":method");
        if method != "POST" {
            return self.reject(&Rejected::method_not_allowed(&method));
        }
        self.request_id = headers.text("x-request-id");
        self.priority = headers.text(PRIORITY_HEADER);
        self.ttft_target_ms = headers
            .text(TTFT_TARGET_HEADER)
            .parse::<f64>()
            .ok()
            .filter(|ms| ms.is_finite() && *ms > 0.0);
        self.chat = Some(chat);
        if end_of_stream {
            self.route(&[])
        } else {
            Action::Pause
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.chat.is_none() {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.route_buffered(body_size)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.chat.is_none() {
            return Action::Continue;
        }
        // The body is complete and still buffered; its size is not passed
        // here, so read up to the limit.
        self.route_buffered(usize::MAX)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.response_ok = host::header_text(HeaderMap::Response, ":status") == "200";
        self.pick_up_dispatched();
        self.observe_upstream();
        let (Some(routed), Some(worker)) = (&self.routed, &self.worker) else {
            return Action::Continue;
        };
        if worker.borrow().router.config().decision_headers {
            let headers = [
                ("x-kvroute-pod", routed.pod_id.clone()),
                ("x-kvroute-score", format!("{:.4}", routed.composite)),
                (
                    "x-kvroute-cache-match",
                    format!("{:.4}", routed.cache_match),
                ),
            ];
            for (name, value) in headers {
                let _ = host::set_header(HeaderMap::Response, name, &value);
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        // The first byte of the answer: the pod has prefilled the prompt.
        if let Some(routed) = self.routed.as_mut() {
            if routed.queued_prefill > 0 {
                shared::adjust_inflight(&[(routed.slot, 0, -i64::from(routed.queued_prefill))]);
                routed.queued_prefill = 0;
            }
            if let (Some(sent), Some(worker)) = (routed.ttft.take(), &self.worker) {
                if self.response_ok {
                    first_byte(&mut worker.borrow_mut(), routed, sent, &self.request_id);
                }
            }
        }
        // Returning Continue keeps the response streaming: `body_size` is
        // this chunk only and nothing is buffered. Each chunk read is a
        // host call and a copy: none for an answer without `usage` (a
        // stream the client did not ask usage for) or outside the sample
        // (`predictionCheckSample`).
        let watching = self.response_ok
            && self.checks_prediction
            && self.scanner.found().is_none()
            && self
                .routed
                .as_ref()
                .is_some_and(|r| r.predicted_cached_tokens > 0);
        if watching {
            let chunk = host::buffer(Buffer::ResponseBody, 0, body_size)
                .ok()
                .flatten()
                .unwrap_or_default();
            if let Some(actual) = self.scanner.feed(&chunk) {
                self.check_prediction(actual);
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        let Some(worker) = self.worker.clone() else {
            return;
        };
        let mut worker = worker.borrow_mut();
        // A client that went away while waiting frees its place.
        waiting::leave(&mut worker, self.context_id);
        if self.routed.is_none() {
            self.routed = worker.waiting.take_dispatched(self.context_id);
        }
        if let Some(routed) = &self.routed {
            shared::adjust_inflight(&[routed.release()]);
            // Last: it makes the waiting requests' contexts effective.
            waiting::dispatch(&mut worker);
        }
        // Off every request's path: a worker with nothing in flight flushes
        // now, a busy one on the tick.
        if shared::idle() {
            worker.flush();
        }
    }
}

fn internal_error(message: &str) -> Rejected {
    Rejected {
        status: 503,
        kind: "ServiceUnavailableError",
        message: message.into(),
        retry_after: Some(1),
    }
}

impl RequestContext {
    /// Routes the complete, buffered body (at most `body_size` bytes).
    fn route_buffered(&mut self, body_size: usize) -> Action {
        let Some(worker) = &self.worker else {
            return Action::Continue;
        };
        // One byte past the limit is enough to know the body is too large.
        let limit = worker
            .borrow()
            .router
            .config()
            .max_body_bytes
            .saturating_add(1);
        let body = host::buffer(Buffer::RequestBody, 0, body_size.min(limit))
            .ok()
            .flatten()
            .unwrap_or_default();
        self.route(&body)
    }

    fn route(&mut self, body: &[u8]) -> Action {
        // Routed once: later callbacks of this request pass.
        let Some(chat) = self.chat.take() else {
            return Action::Continue;
        };
        let Some(worker) = self.worker.clone() else {
            return Action::Continue;
        };
        let started = Instant::now();
        let mut worker = worker.borrow_mut();
        if !worker.waiting.is_empty() {
            // Earlier requests go first: dispatch them, then come back to
            // this request's context (dispatching switched it).
            waiting::dispatch(&mut worker);
            if host::set_effective_context(self.context_id).is_err() {
                drop(worker);
                return self.reject(&internal_error("cannot return to the request context"));
            }
        }
        let priority = self.priority.clone();
        let mut prepared = worker.router.prepare(body, chat);
        if let (Ok(request), Some(ms)) = (&mut prepared, self.ttft_target_ms) {
            request.ttft_target_ms = Some(ms);
        }
        if let Ok(request) = &prepared {
            self.checks_prediction =
                request.answer_reports_usage && worker.sample_prediction_check();
        }
        let outcome = match prepared {
            // Behind earlier requests a round did not reach: it waits its turn.
            Ok(request) if worker.waiting.must_queue(Priority::from_header(&priority)) => {
                let ahead = worker.waiting.len();
                Outcome::NoEligiblePod(Box::new(worker.router.queued_behind(request, ahead)))
            }
            Ok(request) => worker.decide(request, &self.request_id, Attempt::Arrival),
            Err(rejected) => Outcome::Rejected(rejected),
        };
        let elapsed_us = started.elapsed().as_micros() as u64;
        match outcome {
            Outcome::Rejected(rejected) => {
                drop(worker);
                self.reject(&rejected)
            }
            Outcome::NoEligiblePod(no_pod) => {
                match waiting::admit(
                    &mut worker,
                    self.context_id,
                    &priority,
                    &self.request_id,
                    *no_pod,
                ) {
                    Ok(()) => Action::Pause,
                    Err(rejected) => {
                        drop(worker);
                        self.reject(&rejected)
                    }
                }
            }
            Outcome::Routed(routed) => {
                let model_label = worker.router.model_label(&routed.model).to_string();
                let mode = worker.router.config().upstream_mode;
                let log_route = worker.sample_route_log();
                drop(worker);
                let timing = (elapsed_us, log_route);
                match deliver(&routed, mode, &model_label, timing, &self.request_id) {
                    Ok(delivered) => {
                        self.routed = Some(delivered);
                        Action::Continue
                    }
                    Err(rejected) => self.reject(&rejected),
                }
            }
        }
    }

    /// Learns from the response's start which listed pods Envoy failed to
    /// reach, ejecting them for every worker, and which pod is serving: after
    /// a failover it takes over the in-flight count and the decision header.
    fn observe_upstream(&mut self) {
        let (Some(routed), Some(worker)) = (self.routed.as_mut(), self.worker.as_ref()) else {
            return;
        };
        let last_host = host::property(&["upstream", "address"])
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned());
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
            attempts: host::property_u64(&["upstream", "request_attempt_count"]).unwrap_or(1),
            last_host: last_host.as_deref(),
            flags: host::property_u64(&["response", "flags"]).unwrap_or(0),
        };
        let listed: Vec<&str> = routed.listed.iter().map(|d| d.address.as_str()).collect();
        let failed = outcome.failed(&listed);
        let served = outcome.served();
        if failed.is_empty() && served.is_none_or(|address| listed.first() == Some(&address)) {
            return;
        }
        let mut worker = worker.borrow_mut();
        let Some(table) = worker.tables.current() else {
            return;
        };
        let policy = worker.router.config().passive_health.clone();
        let now_ms = host::now_ms();
        let pod_at = |address: &str| table.pods.iter().find(|p| p.address == address);
        for pod in failed.iter().filter_map(|address| pod_at(address)) {
            if let Some(ejection) = shared::eject(pod, &table, now_ms, &policy) {
                metrics::increment(&metrics::labelled(
                    "epp_passive_ejections_total",
                    "pod",
                    &pod.id,
                ));
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
        metrics::increment("epp_failovers_total");
        event(
            log::Level::Info,
            "failover",
            json!({"requestId": self.request_id, "chosen": routed.pod_id, "servedBy": server.id, "attempts": outcome.attempts}),
        );
        let queued = i64::from(routed.queued_prefill);
        shared::adjust_inflight(&[routed.release(), (server.slot, 1, queued)]);
        routed.slot = server.slot;
        routed.pod_id = server.id.clone();
        // The cache and TTFT predictions were for the chosen pod.
        routed.predicted_cached_tokens = 0;
        routed.ttft = None;
    }

    /// Takes over the routing of a request the wait queue dispatched.
    fn pick_up_dispatched(&mut self) {
        if self.routed.is_some() {
            return;
        }
        if let Some(worker) = &self.worker {
            self.routed = worker.borrow_mut().waiting.take_dispatched(self.context_id);
        }
    }

    fn reject(&mut self, rejected: &Rejected) -> Action {
        self.chat = None;
        answer(&self.request_id, rejected);
        Action::Pause
    }

    /// Counts a checked cache prediction, and one the pod did not honour
    /// (it had evicted blocks the router still believed cached): fewer
    /// than half the predicted tokens were served from cache.
    fn check_prediction(&self, actual: u64) {
        let Some(routed) = &self.routed else { return };
        metrics::increment("epp_cache_predictions_checked_total");
        let stale = actual.saturating_mul(2) < routed.predicted_cached_tokens;
        if stale {
            metrics::increment("epp_stale_cache_routing_total");
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

fn resolve_decision_queue() -> Option<u32> {
    let vm_id = host::property(&["plugin_vm_id"])?;
    host::resolve_queue(&String::from_utf8_lossy(&vm_id), DECISION_QUEUE).ok()
}

/// Answers the effective context's request locally with `rejected`.
fn answer(request_id: &str, rejected: &Rejected) {
    metrics::increment(&metrics::labelled(
        "epp_requests_rejected_total",
        "status",
        &rejected.status.to_string(),
    ));
    event(
        log::Level::Info,
        "reject",
        json!({"requestId": request_id, "status": rejected.status, "message": rejected.message}),
    );
    let headers = rejected.headers();
    let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    if let Err(status) = host::send_response(rejected.status, &headers, &rejected.body()) {
        log::error!(
            "kvroute filter: local reply {} failed: {status}",
            rejected.status
        );
    }
}

/// A counter that picks one event in every `every` (none for 0).
#[derive(Default)]
struct Sample(u64);

impl Sample {
    fn next(&mut self, every: u32) -> bool {
        self.0 = self.0.wrapping_add(1);
        every > 0 && self.0.is_multiple_of(u64::from(every))
    }
}

impl Worker {
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

    /// Routes a prepared request with the current snapshot; a routed one
    /// is recorded as this worker's decision.
    fn decide(&mut self, request: RoutingRequest, request_id: &str, attempt: Attempt) -> Outcome {
        self.requests = self.requests.wrapping_add(1);
        let tie_breaker = self.requests;
        let now_ms = host::now_ms();
        let Some(table) = self.tables.routable(now_ms) else {
            return Outcome::Rejected(Rejected {
                status: 503,
                kind: "ServiceUnavailableError",
                message: "kvroute has no pod state yet (the report service has not published)"
                    .into(),
                retry_after: Some(1),
            });
        };
        let inflight = shared::inflight(table.pods.iter().map(|p| p.slot + 1).max().unwrap_or(0));
        let snapshot = SnapshotIndex {
            buckets: table.buckets,
            fetch: shared::bucket,
        };
        // Arrivals see time averages: how often each pod has prefill queued.
        if attempt == Attempt::Arrival {
            self.ttft
                .observe_queues(inflight.iter().map(|load| u64::from(load.prefill_tokens)));
        }
        let view = ClusterView {
            table: &table,
            index: &Merged(&snapshot, &self.recent),
            inflight: &inflight,
            ttft: &self.ttft,
            now_ms,
        };
        let outcome = self
            .router
            .route_prepared(request, &view, tie_breaker, attempt);
        let Outcome::Routed(routed) = &outcome else {
            return outcome;
        };
        if routed.stale_snapshot {
            metrics::increment("epp_snapshot_stale_total");
            metrics::gauge(
                "epp_snapshot_age_ms",
                now_ms.saturating_sub(table.published_at_ms),
            );
        }
        if log::log_enabled!(log::Level::Debug) {
            event(
                log::Level::Debug,
                "candidates",
                json!({"requestId": request_id, "explanation": serde_json::from_str::<serde_json::Value>(&self.router.explain(&table, &routed.decision)).unwrap_or_default()}),
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
        self.recent.record(routed.slot, &routed.chain);
        if !routed.chain.is_empty() {
            push_decision(&mut self.decisions.0, routed.slot, &routed.chain);
            self.decisions.1 += 1;
            if self.decisions.1 >= FLUSH_DECISIONS {
                self.send_decisions();
            }
        }
        outcome
    }

    /// Sends the batched decisions to the service, which shares them with
    /// every worker.
    fn send_decisions(&mut self) {
        if self.decisions.1 == 0 {
            return;
        }
        if self.decision_queue.is_none() {
            self.decision_queue = resolve_decision_queue();
        }
        if let Some(queue) = self.decision_queue {
            let _ = host::enqueue(queue, &self.decisions.0);
        }
        self.decisions.0.clear();
        self.decisions.1 = 0;
    }

    /// Hands the batched decisions to the service, the metrics to Envoy
    /// and the in-flight releases to the other workers.
    fn flush(&mut self) {
        self.send_decisions();
        metrics::flush();
        shared::publish_releases();
    }
}

/// Sends the effective context's request to its pod: sets the routing
/// header of `mode`, counts it in flight, records the decision's metrics
/// (under `model_label`, the decision taking `elapsed_us`) and, when
/// `log_route`, its `route` log line.
fn deliver(
    routed: &Routed,
    mode: UpstreamMode,
    model_label: &str,
    (elapsed_us, log_route): (u64, bool),
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
    if host::set_header(HeaderMap::Request, header, &addresses.join(",")).is_err() {
        return Err(internal_error("cannot set the routing header"));
    }
    shared::adjust_inflight(&[(routed.slot, 1, i64::from(routed.prefill_tokens))]);
    metrics::increment(&metrics::labelled(
        "epp_routing_decisions_total",
        "model",
        model_label,
    ));
    metrics::histogram(
        "epp_cache_match_ratio",
        metrics::percent(routed.cache_match),
    );
    metrics::histogram("epp_composite_score", metrics::percent(routed.composite));
    metrics::histogram("epp_scoring_latency_us", elapsed_us);
    metrics::gauge("epp_candidate_pods", routed.decision.scored.len() as u64);
    if routed.adapter_load_triggered {
        if let Some(adapter) = &routed.adapter {
            metrics::increment(&metrics::labelled(
                "epp_adapter_loads_triggered_total",
                "adapter",
                adapter,
            ));
        }
    }
    if let Some(reason) = &routed.degraded {
        metrics::increment("epp_degraded_routing_total");
        event(
            log::Level::Info,
            "degraded_routing",
            json!({"requestId": request_id, "reason": reason}),
        );
    }
    if routed.fallback {
        metrics::increment("epp_fallback_routing_total");
    }
    if log_route {
        event(
            log::Level::Info,
            "route",
            json!({"requestId": request_id, "model": routed.model, "pod": routed.pod_id,
               "composite": (routed.composite * 1e4).round() / 1e4, "cacheMatch": (routed.cache_match * 1e4).round() / 1e4,
               "matchedBlocks": routed.matched_blocks, "blocks": routed.chain.len(),
               "candidates": routed.decision.scored.len(), "latencyUs": elapsed_us,
               "predictedTtftMs": round_ms(routed.predicted_ttft_ms),
               "runnerUpTtftMs": routed.runner_up_ttft_ms.map(round_ms)}),
        );
    }
    Ok(RoutedRequest {
        slot: routed.slot,
        pod_id: routed.pod_id.clone(),
        listed,
        composite: routed.composite,
        cache_match: routed.cache_match,
        predicted_cached_tokens: routed.predicted_cached_tokens,
        queued_prefill: routed.prefill_tokens,
        ttft: routed
            .streamed
            .then(|| (Instant::now(), routed.work_tokens)),
    })
}

/// A streamed answer's first byte: the TTFT model learns from it, and its
/// error goes to `epp_ttft_prediction_error_percent` (and the DEBUG event
/// `ttft_prediction`). All the glue of the model is here and in `deliver`;
/// the learning is the core's ([`TtftModel::observe`]).
fn first_byte(
    worker: &mut Worker,
    routed: &RoutedRequest,
    (sent, work_tokens): (Instant, u64),
    request_id: &str,
) {
    let ttft_ms = sent.elapsed().as_secs_f64() * 1000.0;
    let Some(seen) = worker.ttft.observe(routed.slot, work_tokens, ttft_ms) else {
        return;
    };
    metrics::histogram(
        "epp_ttft_prediction_error_percent",
        (seen.relative_error * 100.0).round() as u64,
    );
    if log::log_enabled!(log::Level::Debug) {
        event(
            log::Level::Debug,
            "ttft_prediction",
            json!({"requestId": request_id, "pod": routed.pod_id, "workTokens": work_tokens,
                   "predictedTtftMs": round_ms(seen.predicted_ms), "ttftMs": round_ms(seen.actual_ms)}),
        );
    }
}

/// Milliseconds to 0.01 ms, for logs.
fn round_ms(ms: f64) -> f64 {
    (ms * 100.0).round() / 100.0
}
