//! Prometheus metrics through Envoy's stats. proxy-wasm metrics are
//! integers, so ratios and scores are recorded in percent (0–100) and
//! labels are encoded in the name (`epp_queue_depth.pod.<id>`), turned into
//! Prometheus labels by the `stats_tags` regexes shipped in `envoy/`.
//! Label values have `.` replaced by `_` so the regexes can split them.
//! A metric the host refuses is skipped: metrics never fail a request.
//!
//! Updates are batched per VM rather than one host call per metric per
//! request: counter increments (and the summed gauge's deltas) are added
//! up per metric, a gauge keeps its last value, histogram samples are kept
//! in order (the ABI records one sample per call). [`flush`] hands them to
//! the host: every root's tick (25 ms), a filter worker's request end when
//! nothing else is in flight (after the response, off its latency), and
//! whenever [`FLUSH_SAMPLES`] samples are pending. So nothing is lost, and
//! Envoy's stats lag the requests by at most one tick.

use std::cell::RefCell;
use std::collections::HashMap;

use super::host::{self, MetricKind};
use crate::config::Config;
use crate::queueing::WaitRejection;

/// Pending histogram samples that trigger a flush (bounds the batch).
const FLUSH_SAMPLES: usize = 512;

/// Metric updates not yet handed to the host, by metric id.
#[derive(Default)]
struct Batch {
    increments: HashMap<u32, i64>,
    gauges: HashMap<u32, u64>,
    samples: Vec<(u32, u64)>,
}

thread_local! {
    // One VM per thread; metric ids are per VM.
    static IDS: RefCell<HashMap<String, u32>> = RefCell::new(HashMap::new());
    static BATCH: RefCell<Batch> = RefCell::new(Batch::default());
}

fn id(kind: MetricKind, name: &str) -> Option<u32> {
    IDS.with(|ids| {
        if let Some(id) = ids.borrow().get(name) {
            return Some(*id);
        }
        let id = host::define_metric(kind, name).ok()?;
        ids.borrow_mut().insert(name.to_string(), id);
        Some(id)
    })
}

/// `base.label.value` with the value made tag-safe.
pub fn labelled(base: &str, label: &str, value: &str) -> String {
    format!("{base}.{label}.{}", value.replace('.', "_"))
}

pub fn increment(name: &str) {
    add(MetricKind::Counter, name, 1);
}

pub fn gauge(name: &str, value: u64) {
    if let Some(id) = id(MetricKind::Gauge, name) {
        BATCH.with(|batch| batch.borrow_mut().gauges.insert(id, value));
    }
}

/// Adds `delta` to a gauge that every worker moves (a sum over workers).
pub fn gauge_add(name: &str, delta: i64) {
    add(MetricKind::Gauge, name, delta);
}

fn add(kind: MetricKind, name: &str, delta: i64) {
    if let Some(id) = id(kind, name) {
        BATCH.with(|batch| *batch.borrow_mut().increments.entry(id).or_default() += delta);
    }
}

pub fn histogram(name: &str, value: u64) {
    let Some(id) = id(MetricKind::Histogram, name) else {
        return;
    };
    let full = BATCH.with(|batch| {
        let samples = &mut batch.borrow_mut().samples;
        samples.push((id, value));
        samples.len() >= FLUSH_SAMPLES
    });
    if full {
        flush();
    }
}

/// Hands every pending update to the host.
pub fn flush() {
    let batch = BATCH.with(|batch| std::mem::take(&mut *batch.borrow_mut()));
    for (id, delta) in batch.increments {
        if delta != 0 {
            let _ = host::increment_metric(id, delta);
        }
    }
    for (id, value) in batch.gauges.into_iter().chain(batch.samples) {
        let _ = host::record_metric(id, value);
    }
}

/// Defines every kvroute metric at 0, so `rate()` and alerts work from
/// startup instead of from a metric's first increment. Labelled series are
/// defined for the label values known from the configuration: statuses
/// kvroute answers, configured models, adapters and pods.
pub fn export_from_zero(config: &Config) {
    for name in [
        "epp_cache_predictions_checked_total",
        "epp_stale_cache_routing_total",
        "epp_degraded_routing_total",
        "epp_fallback_routing_total",
        "epp_snapshot_stale_total",
        "epp_failovers_total",
    ] {
        let _ = id(MetricKind::Counter, name);
    }
    for status in ["400", "404", "405", "503"] {
        let _ = id(
            MetricKind::Counter,
            &labelled("epp_requests_rejected_total", "status", status),
        );
    }
    for reason in WaitRejection::ALL {
        let _ = id(
            MetricKind::Counter,
            &labelled("epp_wait_rejected_total", "reason", reason.name()),
        );
    }
    for (model, target) in &config.models {
        let _ = id(
            MetricKind::Counter,
            &labelled("epp_routing_decisions_total", "model", model),
        );
        if let Some(adapter) = &target.adapter {
            let _ = id(
                MetricKind::Counter,
                &labelled("epp_adapter_loads_triggered_total", "adapter", adapter),
            );
        }
    }
    for pod in &config.pods {
        export_pod_from_zero(&pod.id);
    }
    for name in [
        "epp_candidate_pods",
        "epp_snapshot_age_ms",
        "epp_snapshot_generation",
        "epp_prefix_tree_nodes",
        "epp_index_memory_bytes",
        "epp_waiting_requests",
    ] {
        let _ = id(MetricKind::Gauge, name);
    }
    for name in [
        "epp_cache_match_ratio",
        "epp_composite_score",
        "epp_scoring_latency_us",
        "epp_wait_time_ms",
        "epp_service_busy_us",
        "epp_ttft_prediction_error_percent",
    ] {
        let _ = id(MetricKind::Histogram, name);
    }
}

/// A pod's series, defined at 0 (configured or discovered pods).
pub fn export_pod_from_zero(pod: &str) {
    for counter in ["epp_report_failures_total", "epp_passive_ejections_total"] {
        let _ = id(MetricKind::Counter, &labelled(counter, "pod", pod));
    }
    for gauge in [
        "epp_queue_depth",
        "epp_pod_health_score",
        "epp_pod_load",
        "epp_pod_report_fallback",
    ] {
        let _ = id(MetricKind::Gauge, &labelled(gauge, "pod", pod));
    }
}

/// A [0, 1] value in percent.
pub fn percent(value: f64) -> u64 {
    (value.clamp(0.0, 1.0) * 100.0).round() as u64
}
