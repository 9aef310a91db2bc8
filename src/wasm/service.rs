//! The singleton report service (bootstrap `envoy.bootstrap.wasm`,
//! `singleton: true`, main thread).
//!
//! Every `podReportIntervalMs` it publishes the current snapshot (so health
//! decay shows even when nothing answers), then asks each pod without a
//! call in flight for its report and, with `metricsPath`, its vLLM metrics,
//! through `reportCluster`: an ORIGINAL_DST cluster that connects to the
//! `x-envoy-original-dst-host` set on each call to the pod's address. When
//! the last answer of a round arrives the snapshot is published again, so
//! fresh reports reach the filters without waiting a whole interval.
//! Approximate-mode decisions arrive on a shared queue.

use std::collections::HashMap;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, RootContext};
use serde_json::json;

use super::logging::event;
use super::{load_config, metrics, shared};
use crate::cluster::{ClusterState, Failure, Transition};
use crate::config::{Config, IndexMode, PodConfig};
use crate::snapshot::{bucket_key, decode_decision, DECISION_QUEUE};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pull {
    Report,
    Metrics,
    Discovery,
}

#[derive(Default)]
pub struct ServiceRoot {
    config: Option<Config>,
    state: Option<ClusterState>,
    /// Calls in flight: token → (pod id, what was asked).
    pending: HashMap<u32, (String, Pull)>,
    queue: Option<u32>,
}

impl ServiceRoot {
    fn now_ms(&self) -> u64 {
        self.get_current_time()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }

    /// GETs `path` from `destination` (`host:port`, also the `:authority`)
    /// through `cluster`; an ORIGINAL_DST cluster connects to the
    /// `x-envoy-original-dst-host` set here, a static one ignores it.
    fn call(&mut self, pod: &str, cluster: &str, destination: &str, path: &str, pull: Pull) {
        let config = self.config.as_ref().expect("configured");
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
                let failure = Failure::Unreachable;
                log::error!("kvroute service: cannot call cluster {cluster:?} for {pod}: {status:?} (is the cluster defined?)");
                self.fail(pod, failure);
            }
        }
    }

    fn fail(&mut self, pod: &str, failure: Failure) {
        metrics::increment(&metrics::labelled("epp_report_failures_total", "pod", pod));
        if let Some(state) = self.state.as_mut() {
            let transition = state.record_failure(pod, failure);
            log_transition(transition);
        }
    }

    fn inflight_of(&self, pod: &str) -> u32 {
        match self.state.as_ref().and_then(|s| s.slot(pod)) {
            Some(slot) => shared::inflight(slot + 1)[slot],
            None => 0,
        }
    }

    fn publish(&mut self) {
        let now = self.now_ms();
        let Some(state) = self.state.as_mut() else {
            return;
        };
        let publication = state.publish(now);
        for (bucket, value) in &publication.buckets {
            shared::set(&bucket_key(*bucket), value);
        }
        shared::publish_table(&publication.table);
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
        if log::log_enabled!(log::Level::Trace) {
            event(
                log::Level::Trace,
                "publish",
                json!({"generation": publication.table.generation, "bucketsWritten": publication.buckets.len(),
                       "indexBlocks": state.index().len()}),
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
        let mut candidate = self.config.clone().expect("configured");
        candidate.pods = list.pods;
        candidate.validate().map_err(|e| e.to_string())?;
        let now = self.now_ms();
        if let Some(state) = self.state.as_mut() {
            state.set_pods(&candidate.pods, now);
        }
        Ok(())
    }
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
        let status = self.get_http_call_response_header(":status");
        let body = self
            .get_http_call_response_body(0, body_size)
            .unwrap_or_default();
        let now = self.now_ms();
        match status.as_deref() {
            Some("200") => {}
            Some(code) => {
                // Envoy answers 503 itself when the pod cannot be reached.
                let code = code.parse().unwrap_or(0);
                let failure = if code == 503 && body.starts_with(b"upstream connect error") {
                    Failure::Unreachable
                } else {
                    Failure::Status(code)
                };
                if pull == Pull::Discovery {
                    log::warn!("kvroute service: pod discovery failed: {failure}");
                } else {
                    self.fail(&pod, failure);
                }
                return self.round_done();
            }
            None => {
                if pull != Pull::Discovery {
                    self.fail(&pod, Failure::Unreachable);
                }
                return self.round_done();
            }
        }
        let inflight = self.inflight_of(&pod);
        let Some(state) = self.state.as_mut() else {
            return;
        };
        match pull {
            Pull::Report => {
                let (result, transition) = state.apply_report(&pod, &body, now, inflight);
                log_transition(transition);
                match result {
                    Ok(summary) => event(
                        log::Level::Trace,
                        "report",
                        json!({"pod": pod, "full": summary.full, "stored": summary.stored, "removed": summary.removed,
                               "orphaned": summary.orphaned, "resync": summary.resync}),
                    ),
                    Err(_) => metrics::increment(&metrics::labelled(
                        "epp_report_failures_total",
                        "pod",
                        &pod,
                    )),
                }
            }
            Pull::Metrics => {
                let (result, transition) = state.apply_metrics(&pod, &body, now, inflight);
                log_transition(transition);
                if result.is_err() {
                    metrics::increment(&metrics::labelled(
                        "epp_report_failures_total",
                        "pod",
                        &pod,
                    ));
                }
            }
            Pull::Discovery => {
                if let Err(error) = self.apply_discovery(&body) {
                    log::warn!("kvroute service: pod discovery ignored: {error}");
                }
            }
        }
        self.round_done();
    }
}

impl ServiceRoot {
    fn round_done(&mut self) {
        if self.pending.is_empty() {
            self.publish();
        }
    }
}

impl RootContext for ServiceRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let Some(config) = load_config(self.get_plugin_configuration(), "service") else {
            return false;
        };
        self.set_tick_period(Duration::from_millis(config.pod_report_interval_ms));
        // A new configuration starts a new view; the first one only once.
        if self.config.as_ref() != Some(&config) {
            self.state = Some(ClusterState::new(&config, self.now_ms()));
            self.config = Some(config);
        }
        true
    }

    fn on_tick(&mut self) {
        let Some(config) = self.config.clone() else {
            return;
        };
        if self.queue.is_none() && config.mode == IndexMode::Approximate {
            self.queue = hostcalls::register_shared_queue(DECISION_QUEUE).ok();
        }
        self.publish();
        let busy: Vec<String> = self.pending.values().map(|(pod, _)| pod.clone()).collect();
        let pods: Vec<PodConfig> = self
            .state
            .as_ref()
            .map(|s| s.pods().cloned().collect())
            .unwrap_or_default();
        for pod in pods.iter().filter(|p| !busy.contains(&p.id)) {
            if config.mode == IndexMode::Precise {
                let query = self
                    .state
                    .as_ref()
                    .and_then(|s| s.report_query(&pod.id, &config.report_path))
                    .unwrap_or_else(|| config.report_path.clone());
                self.call(
                    &pod.id,
                    &config.report_cluster,
                    &pod.address,
                    &query,
                    Pull::Report,
                );
            }
            if let Some(path) = &config.metrics_path {
                self.call(
                    &pod.id,
                    &config.report_cluster,
                    &pod.address,
                    path,
                    Pull::Metrics,
                );
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

    fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(state) = self.state.as_mut() else {
            return;
        };
        while let Ok(Some(message)) = hostcalls::dequeue_shared_queue(queue_id) {
            match decode_decision(&message) {
                Some((slot, chain)) => state.record_decision(slot, &chain),
                None => log::warn!(
                    "kvroute service: malformed decision message ({} bytes)",
                    message.len()
                ),
            }
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
