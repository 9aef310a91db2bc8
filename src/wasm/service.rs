//! The singleton report service (bootstrap `envoy.bootstrap.wasm`,
//! `singleton: true`, main thread).
//!
//! Every `podReportIntervalMs` a round starts: the service publishes the
//! current snapshot (so health decay shows even when nothing answers), then
//! asks each pod without a call in flight for its report and, with
//! `metricsPath`, its vLLM metrics, through `reportCluster`: an
//! ORIGINAL_DST cluster that connects to the `x-envoy-original-dst-host`
//! set on each call to the pod's address. When the last answer of a round
//! arrives the snapshot is published again, so fresh reports reach the
//! filters without waiting a whole interval. The filters' routing decisions
//! arrive on a shared queue: approximate mode's only signal, precise mode's
//! pending entries until reports confirm them.
//!
//! The main thread also serves Envoy's admin and xDS, so no callback may
//! stall it — and answers of many pods can land in one pass of Envoy's event
//! loop: the service ticks every [`TICK_MS`] (rounds start on the tick that
//! finds one due); an answer is only classified and queued when it arrives,
//! and folded within a [`FOLD_BUDGET_US`] per tick; a publication writes at
//! most [`PUBLISH_BUCKETS`] changed buckets and leaves the rest to the
//! following ticks; bodies over `maxReportBytes` are never read.
//!
//! Host behaviour: a pull that fails (connection refused, reset mid-body,
//! timeout, a body over the host's buffer limit) still calls
//! `on_http_call_response`, with no response headers. The SDK's header
//! getter panics on the host's status for that (BadArgument); this service
//! reads through [`super::host`], for which it is just "no answer".

use std::collections::HashMap;
use std::time::{Duration, Instant};

use proxy_wasm::traits::{Context, RootContext};
use serde_json::json;

use super::host::{self, Buffer, HeaderMap};
use super::logging::event;
use super::{load_config, metrics, shared};
use crate::cluster::{ClusterState, Failure, PullAnswer, PullKind, Transition, PUBLISH_BUCKETS};
use crate::config::{Config, IndexMode, PodConfig};
use crate::snapshot::{bucket_key, decode_decision, DECISION_QUEUE};

/// Housekeeping period: the longest a due round, an unfolded answer or a
/// pending publication waits.
const TICK_MS: u64 = 50;

/// Main-thread time per tick for folding answers (one fold may overrun
/// it; its size is bounded by `maxReportBytes`).
const FOLD_BUDGET_US: u64 = 5_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pull {
    Pod(PullKind),
    Discovery,
}

#[derive(Default)]
pub struct ServiceRoot {
    config: Option<Config>,
    state: Option<ClusterState>,
    /// Calls in flight: token → (pod id, what was asked).
    pending: HashMap<u32, (String, Pull)>,
    queue: Option<u32>,
    next_round_ms: u64,
    /// Changed buckets a publication left for the next tick.
    unpublished: usize,
    /// What is left of this tick's folding time.
    fold_budget_us: u64,
}

impl ServiceRoot {
    /// GETs `path` from `destination` (`host:port`, also the `:authority`)
    /// through `cluster`; an ORIGINAL_DST cluster connects to the
    /// `x-envoy-original-dst-host` set here, a static one ignores it.
    fn call(&mut self, pod: &str, cluster: &str, destination: &str, path: &str, pull: Pull) {
        let Some(config) = self.config.as_ref() else {
            return;
        };
        let headers = vec![
            (":method", "GET"),
            (":path", path),
            (":authority", destination),
            ("x-envoy-original-dst-host", destination),
        ];
        let timeout = Duration::from_millis(config.report_timeout_ms);
        match self.dispatch_http_call(cluster, headers, None, vec![], timeout) {
            Ok(token) => {
                self.pending.insert(token, (pod.to_string(), pull));
            }
            Err(status) => {
                log::error!("kvroute service: cannot call cluster {cluster:?} for {pod}: {status:?} (is the cluster defined?)");
                if pull != Pull::Discovery {
                    self.fail(pod, Failure::Unreachable);
                }
            }
        }
    }

    fn fail(&mut self, pod: &str, failure: Failure) {
        metrics::increment(&metrics::labelled("epp_report_failures_total", "pod", pod));
        if let Some(state) = self.state.as_mut() {
            log_transition(state.record_failure(pod, failure));
        }
    }

    fn inflight_of(&self, pod: &str) -> u32 {
        match self.state.as_ref().and_then(|s| s.slot(pod)) {
            Some(slot) => shared::inflight(slot + 1).get(slot).copied().unwrap_or(0),
            None => 0,
        }
    }

    fn publish(&mut self) {
        let now = host::now_ms();
        let Some(state) = self.state.as_mut() else {
            return;
        };
        let publication = state.publish_some(now, PUBLISH_BUCKETS);
        for (bucket, value) in &publication.buckets {
            shared::set(&bucket_key(*bucket), value);
        }
        shared::publish_table(&publication.table);
        self.unpublished = publication.unpublished_buckets;
        metrics::gauge("epp_prefix_tree_nodes", state.index().len() as u64);
        metrics::gauge("epp_index_memory_bytes", state.memory_bytes() as u64);
        for pod in &publication.table.pods {
            metrics::gauge(
                &metrics::labelled("epp_queue_depth", "pod", &pod.id),
                u64::from(pod.queue),
            );
            metrics::gauge(
                &metrics::labelled("epp_pod_health_score", "pod", &pod.id),
                metrics::percent(pod.health),
            );
            metrics::gauge(
                &metrics::labelled("epp_pod_load", "pod", &pod.id),
                metrics::percent(pod.load),
            );
        }
        // Last: once it moves, the whole table above is visible.
        metrics::gauge("epp_snapshot_generation", publication.table.generation);
        if log::log_enabled!(log::Level::Trace) {
            event(
                log::Level::Trace,
                "publish",
                json!({"generation": publication.table.generation, "bucketsWritten": publication.buckets.len(),
                       "bucketsPending": publication.unpublished_buckets, "indexBlocks": state.index().len()}),
            );
        }
    }

    fn apply_discovery(&mut self, body: &[u8]) -> Result<(), String> {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct PodList {
            pods: Vec<PodConfig>,
        }
        let list: PodList =
            serde_json::from_slice(body).map_err(|e| format!("malformed pod list: {e}"))?;
        let mut candidate = self.config.clone().ok_or("not configured")?;
        candidate.pods = list.pods;
        candidate.validate().map_err(|e| e.to_string())?;
        for pod in &candidate.pods {
            metrics::export_pod_from_zero(&pod.id);
        }
        if let Some(state) = self.state.as_mut() {
            state.set_pods(&candidate.pods, host::now_ms());
        }
        Ok(())
    }

    fn on_discovery_answer(&mut self, status: Option<String>, body_size: usize) {
        let limit = self.config.as_ref().map_or(0, |c| c.max_report_bytes);
        let outcome = match status.as_deref() {
            None => Err(Failure::Unreachable.to_string()),
            Some("200") if body_size > limit => Err(Failure::TooLarge {
                size: body_size,
                limit,
            }
            .to_string()),
            Some("200") => self.apply_discovery(&call_body(body_size)),
            Some(code) => Err(format!("answered HTTP {code}")),
        };
        if let Err(error) = outcome {
            log::warn!("kvroute service: pod discovery ignored: {error}");
        }
    }

    fn start_round(&mut self, config: &Config) {
        self.publish();
        let busy: Vec<String> = self.pending.values().map(|(pod, _)| pod.clone()).collect();
        let Some(state) = self.state.as_ref() else {
            return;
        };
        // A pod whose last answer is not folded yet would be asked for the
        // same `since` again.
        let pods: Vec<PodConfig> = state
            .pods()
            .filter(|p| !busy.contains(&p.id) && !state.has_unfolded(&p.id))
            .cloned()
            .collect();
        for pod in &pods {
            if config.mode == IndexMode::Precise {
                let query = self
                    .state
                    .as_ref()
                    .and_then(|s| s.report_query(&pod.id, &config.report_path))
                    .unwrap_or_else(|| config.report_path.clone());
                let pull = Pull::Pod(PullKind::Report);
                self.call(&pod.id, &config.report_cluster, &pod.address, &query, pull);
            }
            if let Some(path) = &config.metrics_path {
                let pull = Pull::Pod(PullKind::Metrics);
                self.call(&pod.id, &config.report_cluster, &pod.address, path, pull);
            }
        }
        if let Some(discovery) = &config.discovery {
            if !self
                .pending
                .values()
                .any(|(_, pull)| *pull == Pull::Discovery)
            {
                let destination = discovery.authority.as_deref().unwrap_or(&discovery.cluster);
                self.call(
                    "discovery",
                    &discovery.cluster,
                    destination,
                    &discovery.path,
                    Pull::Discovery,
                );
            }
        }
    }

    fn round_done(&mut self) {
        if self.pending.is_empty() && self.state.as_ref().is_some_and(|s| s.unfolded() == 0) {
            self.publish();
        }
    }

    /// Folds accepted answers while this tick's budget lasts; a fold that
    /// is not done waits for the next tick. Returns whether any was folded.
    fn fold(&mut self) -> bool {
        let Some(state) = self.state.as_mut() else {
            return false;
        };
        let now = host::now_ms();
        let mut folded_any = false;
        while self.fold_budget_us > 0 {
            let started = Instant::now();
            let Some(folded) = state.fold_next(now) else {
                break;
            };
            let spent = started.elapsed().as_micros() as u64;
            self.fold_budget_us = self.fold_budget_us.saturating_sub(spent.max(1));
            folded_any = true;
            log_transition(folded.transition);
            match folded.result {
                Ok(Some(summary)) => event(
                    log::Level::Trace,
                    "report",
                    json!({"pod": folded.pod, "full": summary.full, "stored": summary.stored, "removed": summary.removed,
                           "orphaned": summary.orphaned, "resync": summary.resync, "foldUs": spent}),
                ),
                Ok(None) => {}
                Err(_) => metrics::increment(&metrics::labelled(
                    "epp_report_failures_total",
                    "pod",
                    &folded.pod,
                )),
            }
        }
        folded_any
    }
}

/// The body of the current HTTP call response (empty if the host has none).
fn call_body(size: usize) -> Vec<u8> {
    host::buffer(Buffer::CallResponseBody, 0, size)
        .ok()
        .flatten()
        .unwrap_or_default()
}

impl Context for ServiceRoot {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        _num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some((pod, pull)) = self.pending.remove(&token_id) else {
            return;
        };
        // No headers: the call failed (see the module documentation).
        let status = host::header(HeaderMap::CallResponse, ":status")
            .ok()
            .flatten()
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned());
        let kind = match pull {
            Pull::Discovery => {
                self.on_discovery_answer(status, body_size);
                return self.round_done();
            }
            Pull::Pod(kind) => kind,
        };
        let inflight = self.inflight_of(&pod);
        let Some(state) = self.state.as_mut() else {
            return;
        };
        let answer = PullAnswer {
            status: status.as_deref(),
            body_size,
        };
        let (result, transition) = state.accept_pull(&pod, kind, answer, call_body, inflight);
        log_transition(transition);
        if result.is_err() {
            metrics::increment(&metrics::labelled("epp_report_failures_total", "pod", &pod));
        }
        self.fold();
        self.round_done();
    }
}

impl RootContext for ServiceRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let configuration = host::buffer(Buffer::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten();
        let Some(config) = load_config(configuration, "service") else {
            return false;
        };
        let tick = config.pod_report_interval_ms.min(TICK_MS);
        if let Err(status) = host::set_tick_period_ms(tick) {
            log::error!("kvroute service: cannot set the tick period: {status}");
            return false;
        }
        // A new configuration starts a new view; the first one only once.
        if self.config.as_ref() != Some(&config) {
            self.state = Some(ClusterState::new(&config, host::now_ms()));
            self.config = Some(config);
            self.next_round_ms = 0;
        }
        true
    }

    fn on_tick(&mut self) {
        let Some(config) = self.config.clone() else {
            return;
        };
        if self.queue.is_none() {
            self.queue = host::register_queue(DECISION_QUEUE).ok();
        }
        self.fold_budget_us = FOLD_BUDGET_US;
        let folded = self.fold();
        let now = host::now_ms();
        if now >= self.next_round_ms {
            self.next_round_ms = now.saturating_add(config.pod_report_interval_ms);
            self.start_round(&config);
        } else if folded || self.unpublished > 0 {
            self.publish();
        } else if let Some(state) = self.state.as_mut() {
            // Pending decisions expire on time, not at the next round.
            for (bucket, value) in state.publish_buckets(now, PUBLISH_BUCKETS) {
                shared::set(&bucket_key(bucket), &value);
            }
        }
    }

    /// Decisions from the filters: recorded, and their buckets written at
    /// once (no new pod table), so every worker matches them within
    /// milliseconds instead of at the next report.
    fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(state) = self.state.as_mut() else {
            return;
        };
        let now = host::now_ms();
        while let Ok(Some(message)) = host::dequeue(queue_id) {
            match decode_decision(&message) {
                Some((slot, chain)) => state.record_decision(slot, &chain, now),
                None => log::warn!(
                    "kvroute service: malformed decision message ({} bytes)",
                    message.len()
                ),
            }
        }
        for (bucket, value) in state.publish_buckets(now, PUBLISH_BUCKETS) {
            shared::set(&bucket_key(bucket), &value);
        }
    }
}

fn log_transition(transition: Option<Transition>) {
    match transition {
        Some(Transition::Failing { pod, failure }) => event(
            log::Level::Warn,
            "pod_report_failing",
            json!({"pod": pod, "failure": failure.to_string()}),
        ),
        Some(Transition::Recovered { pod }) => event(
            log::Level::Info,
            "pod_report_recovered",
            json!({"pod": pod}),
        ),
        None => {}
    }
}
