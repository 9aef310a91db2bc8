//! The HTTP filter: routes each OpenAI request to a pod.
//!
//! Host behaviour this relies on:
//! - `on_http_request_headers` returning `Pause` holds the headers until
//!   the body callback continues (needs `allow_on_headers_stop_iteration:
//!   true` in the PluginConfig, or the request hangs);
//! - while paused, `body_size` is the total buffered so far; we act once,
//!   at `end_of_stream`, and set `x-envoy-original-dst-host` before
//!   continuing, which the ORIGINAL_DST cluster reads;
//! - `on_log` runs once at the end of every stream (also after local
//!   replies and client resets): the in-flight count is released there.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use serde_json::json;

use super::logging::event;
use super::{load_config, metrics, shared};
use crate::config::IndexMode;
use crate::index::{Merged, RecentDecisions};
use crate::router::{ClusterView, Outcome, Rejected, Routed, Router};
use crate::snapshot::{SnapshotIndex, DECISION_QUEUE};
use crate::usage::CachedTokensScanner;

const ROUTING_HEADER: &str = "x-envoy-original-dst-host";

/// Per-worker state shared by the worker's requests.
struct Worker {
    router: Router,
    tables: shared::TableCache,
    /// Approximate mode: this worker's own decisions, seen at once.
    recent: RecentDecisions,
    decision_queue: Option<u32>,
    requests: u64,
}

#[derive(Default)]
pub struct FilterRoot {
    worker: Option<Rc<RefCell<Worker>>>,
}

impl Context for FilterRoot {}

impl RootContext for FilterRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let Some(config) = load_config(self.get_plugin_configuration(), "filter") else {
            return false;
        };
        self.worker = Some(Rc::new(RefCell::new(Worker {
            recent: RecentDecisions::new(&config),
            router: Router::new(config),
            tables: shared::TableCache::default(),
            decision_queue: None,
            requests: 0,
        })));
        true
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let worker = self.worker.clone()?;
        Some(Box::new(RequestContext {
            worker,
            chat: None,
            request_id: String::new(),
            routed: None,
            scanner: CachedTokensScanner::default(),
            response_ok: false,
        }))
    }
}

struct RoutedRequest {
    slot: usize,
    pod_id: String,
    composite: f64,
    cache_match: f64,
    predicted_cached_tokens: u64,
    /// The in-flight count was raised and must be released.
    counted: bool,
}

struct RequestContext {
    worker: Rc<RefCell<Worker>>,
    /// `Some(is_chat)` for a request kvroute routes.
    chat: Option<bool>,
    request_id: String,
    routed: Option<RoutedRequest>,
    scanner: CachedTokensScanner,
    response_ok: bool,
}

impl Context for RequestContext {}

impl HttpContext for RequestContext {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // An ORIGINAL_DST cluster connects wherever this header says: never
        // let a client choose.
        self.remove_http_request_header(ROUTING_HEADER);
        let path = self.get_http_request_header(":path").unwrap_or_default();
        let method = self.get_http_request_header(":method").unwrap_or_default();
        self.request_id = self
            .get_http_request_header("x-request-id")
            .unwrap_or_default();
        self.chat = if method == "POST" {
            self.worker.borrow().router.route_kind(&path)
        } else {
            None
        };
        match self.chat {
            Some(_) if end_of_stream => self.route(&[]),
            Some(_) => Action::Pause,
            None => Action::Continue,
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.chat.is_none() || self.routed.is_some() {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        // One byte past the limit is enough to know the body is too large.
        let limit = self.worker.borrow().router.config().max_body_bytes + 1;
        let body = self
            .get_http_request_body(0, body_size.min(limit))
            .unwrap_or_default();
        self.route(&body)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.response_ok = self.get_http_response_header(":status").as_deref() == Some("200");
        let Some(routed) = &self.routed else {
            return Action::Continue;
        };
        if self.worker.borrow().router.config().decision_headers {
            self.set_http_response_header("x-kvroute-pod", Some(&routed.pod_id));
            self.set_http_response_header(
                "x-kvroute-score",
                Some(&format!("{:.4}", routed.composite)),
            );
            self.set_http_response_header(
                "x-kvroute-cache-match",
                Some(&format!("{:.4}", routed.cache_match)),
            );
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        // Returning Continue keeps the response streaming: `body_size` is
        // this chunk only and nothing is buffered.
        let watching = self.response_ok
            && self.scanner.found().is_none()
            && self
                .routed
                .as_ref()
                .is_some_and(|r| r.predicted_cached_tokens > 0);
        if watching {
            let chunk = self
                .get_http_response_body(0, body_size)
                .unwrap_or_default();
            if let Some(actual) = self.scanner.feed(&chunk) {
                self.check_prediction(actual);
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if let Some(routed) = &self.routed {
            if routed.counted {
                shared::adjust_inflight(routed.slot, -1);
            }
        }
    }
}

impl RequestContext {
    fn route(&mut self, body: &[u8]) -> Action {
        let started = Instant::now();
        let chat = self.chat.unwrap_or(false);
        let mut worker = self.worker.borrow_mut();
        worker.requests += 1;
        let tie_breaker = worker.requests;
        let Some(table) = worker.tables.current() else {
            drop(worker);
            return self.reject(&Rejected {
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
        let view = ClusterView {
            table: &table,
            index: &Merged(&snapshot, &worker.recent),
            inflight: &inflight,
        };
        let outcome = worker.router.route(body, chat, &view, tie_breaker);
        let elapsed_us = started.elapsed().as_micros() as u64;
        match outcome {
            Outcome::Rejected(rejected) => {
                drop(worker);
                self.reject(&rejected)
            }
            Outcome::Routed(routed) => {
                if log::log_enabled!(log::Level::Debug) {
                    event(
                        log::Level::Debug,
                        "candidates",
                        json!({"requestId": self.request_id, "explanation": serde_json::from_str::<serde_json::Value>(&worker.router.explain(&table, &routed.decision)).unwrap_or_default()}),
                    );
                }
                if log::log_enabled!(log::Level::Trace) {
                    event(
                        log::Level::Trace,
                        "block_walk",
                        json!({"requestId": self.request_id, "blocks": routed.chain.len(), "matchedBlocks": routed.matched_blocks,
                               "chain": routed.chain.iter().take(8).map(|h| crate::report::hash_to_hex(*h)).collect::<Vec<_>>()}),
                    );
                }
                worker.recent.record(routed.slot, &routed.chain);
                if worker.router.config().mode == IndexMode::Approximate {
                    if worker.decision_queue.is_none() {
                        worker.decision_queue = resolve_decision_queue();
                    }
                    if let Some(queue) = worker.decision_queue {
                        let message = crate::snapshot::encode_decision(routed.slot, &routed.chain);
                        let _ = hostcalls::enqueue_shared_queue(queue, Some(&message));
                    }
                }
                drop(worker);
                self.send(&routed, elapsed_us)
            }
        }
    }

    fn send(&mut self, routed: &Routed, elapsed_us: u64) -> Action {
        self.set_http_request_header(ROUTING_HEADER, Some(&routed.address));
        let counted = shared::adjust_inflight(routed.slot, 1);
        metrics::increment(&metrics::labelled(
            "epp_routing_decisions_total",
            "model",
            &routed.model,
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
                json!({"requestId": self.request_id, "reason": reason}),
            );
        }
        if routed.fallback {
            metrics::increment("epp_fallback_routing_total");
        }
        event(
            log::Level::Info,
            "route",
            json!({"requestId": self.request_id, "model": routed.model, "pod": routed.pod_id,
                   "composite": (routed.composite * 1e4).round() / 1e4, "cacheMatch": (routed.cache_match * 1e4).round() / 1e4,
                   "matchedBlocks": routed.matched_blocks, "blocks": routed.chain.len(),
                   "candidates": routed.decision.scored.len(), "latencyUs": elapsed_us}),
        );
        self.routed = Some(RoutedRequest {
            slot: routed.slot,
            pod_id: routed.pod_id.clone(),
            composite: routed.composite,
            cache_match: routed.cache_match,
            predicted_cached_tokens: routed.predicted_cached_tokens,
            counted,
        });
        Action::Continue
    }

    fn reject(&mut self, rejected: &Rejected) -> Action {
        metrics::increment(&metrics::labelled(
            "epp_requests_rejected_total",
            "status",
            &rejected.status.to_string(),
        ));
        event(
            log::Level::Info,
            "reject",
            json!({"requestId": self.request_id, "status": rejected.status, "message": rejected.message}),
        );
        let retry_after = rejected.retry_after.map(|s| s.to_string());
        let mut headers = vec![("content-type", "application/json")];
        if let Some(seconds) = &retry_after {
            headers.push(("retry-after", seconds));
        }
        self.send_http_response(rejected.status, headers, Some(&rejected.body()));
        Action::Pause
    }

    /// Counts a cache prediction the pod did not honour (it had evicted
    /// blocks the router still believed cached): fewer than half the
    /// predicted tokens were served from cache.
    fn check_prediction(&self, actual: u64) {
        let Some(routed) = &self.routed else { return };
        let stale = actual * 2 < routed.predicted_cached_tokens;
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
    let vm_id = hostcalls::get_property(vec!["plugin_vm_id"])
        .ok()
        .flatten()?;
    hostcalls::resolve_shared_queue(&String::from_utf8_lossy(&vm_id), DECISION_QUEUE)
        .ok()
        .flatten()
}
