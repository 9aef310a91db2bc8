//! kvroute's metrics, the same for every host: the catalogue ([`Metric`]:
//! name, kind, label) and the per-worker [`MetricBatch`] that adds updates
//! up between flushes.
//!
//! Updates are batched rather than handed to the host one by one: counter
//! increments (and the summed gauge's deltas) are added up per series, a
//! gauge keeps its last value, histogram samples are kept in order (both
//! hosts record one sample per call). The owner flushes the batch to its
//! host's [`MetricSink`] on its tick (25 ms), when a worker's request ends
//! with nothing else in flight on it (after the response, off its
//! latency), and whenever [`FLUSH_SAMPLES`] samples are pending. So nothing
//! is lost, and Envoy's stats lag the requests by at most one tick.
//! Measured reason (proxy-wasm): each host call costs Envoy a few µs, most
//! of kvroute's CPU per request before batching. The native host's calls
//! are cheaper, but a labelled update still resolves its series by name in
//! Envoy's symbol table, so it batches the same way.
//!
//! Ratios and scores are recorded in percent (0–100): proxy-wasm metrics
//! are integers, and the native build keeps the same series.

use std::collections::HashMap;

use crate::config::Config;
use crate::queueing::WaitRejection;
use crate::report::Tier;

/// Pending histogram samples that trigger a flush (bounds the batch).
pub const FLUSH_SAMPLES: usize = 512;

/// How Envoy keeps a metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

macro_rules! catalogue {
    ($($variant:ident = ($name:literal, $kind:ident, $label:expr),)*) => {
        /// Every kvroute metric (see docs/operations.md for what each means).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Metric { $($variant,)* }

        impl Metric {
            pub const ALL: &'static [Metric] = &[$(Metric::$variant,)*];

            /// The Prometheus name.
            pub fn name(self) -> &'static str {
                match self { $(Metric::$variant => $name,)* }
            }

            pub fn kind(self) -> MetricKind {
                match self { $(Metric::$variant => MetricKind::$kind,)* }
            }

            /// The label, for a labelled metric.
            pub fn label(self) -> Option<&'static str> {
                match self { $(Metric::$variant => $label,)* }
            }
        }
    };
}

catalogue! {
    CachePredictionsChecked = ("epp_cache_predictions_checked_total", Counter, None),
    StaleCacheRouting = ("epp_stale_cache_routing_total", Counter, None),
    DegradedRouting = ("epp_degraded_routing_total", Counter, None),
    FallbackRouting = ("epp_fallback_routing_total", Counter, None),
    PrefixSpread = ("epp_prefix_spread_total", Counter, None),
    SnapshotStale = ("epp_snapshot_stale_total", Counter, None),
    Failovers = ("epp_failovers_total", Counter, None),
    RequestsRejected = ("epp_requests_rejected_total", Counter, Some("status")),
    WaitRejected = ("epp_wait_rejected_total", Counter, Some("reason")),
    WaitRoutedPastLimit = ("epp_wait_routed_past_limit_total", Counter, Some("reason")),
    RoutingDecisions = ("epp_routing_decisions_total", Counter, Some("model")),
    AdapterLoadsTriggered = ("epp_adapter_loads_triggered_total", Counter, Some("adapter")),
    CacheMatchedBlocks = ("epp_cache_matched_blocks_total", Counter, Some("tier")),
    ReportFailures = ("epp_report_failures_total", Counter, Some("pod")),
    PassiveEjections = ("epp_passive_ejections_total", Counter, Some("pod")),
    CandidatePods = ("epp_candidate_pods", Gauge, None),
    SnapshotAgeMs = ("epp_snapshot_age_ms", Gauge, None),
    SnapshotGeneration = ("epp_snapshot_generation", Gauge, None),
    PrefixTreeNodes = ("epp_prefix_tree_nodes", Gauge, None),
    IndexMemoryBytes = ("epp_index_memory_bytes", Gauge, None),
    WaitingRequests = ("epp_waiting_requests", Gauge, None),
    QueueDepth = ("epp_queue_depth", Gauge, Some("pod")),
    PodHealthScore = ("epp_pod_health_score", Gauge, Some("pod")),
    PodLoad = ("epp_pod_load", Gauge, Some("pod")),
    PodReportFallback = ("epp_pod_report_fallback", Gauge, Some("pod")),
    PodBlockSizeMismatch = ("epp_pod_block_size_mismatch", Gauge, Some("pod")),
    PodKvCapacityBlocks = ("epp_pod_kv_capacity_blocks", Gauge, Some("pod")),
    PodKvResidentBlocks = ("epp_pod_kv_resident_blocks", Gauge, Some("pod")),
    PodKvRemovedBlocks = ("epp_pod_kv_removed_blocks_total", Counter, Some("pod")),
    PodKvEvictionsRegretted = ("epp_pod_kv_evictions_regretted_total", Counter, Some("pod")),
    PodKvEvictionsPredicted = ("epp_pod_kv_evictions_predicted_total", Counter, Some("pod")),
    CacheMatchRatio = ("epp_cache_match_ratio", Histogram, None),
    CompositeScore = ("epp_composite_score", Histogram, None),
    ScoringLatencyUs = ("epp_scoring_latency_us", Histogram, None),
    WaitTimeMs = ("epp_wait_time_ms", Histogram, None),
    ServiceBusyUs = ("epp_service_busy_us", Histogram, None),
    TtftPredictionErrorPercent = ("epp_ttft_prediction_error_percent", Histogram, None),
    ReplicaLagMs = ("epp_replica_lag_ms", Histogram, None),
    ReplicaConverged = ("epp_replica_converged", Gauge, None),
    ReplicaDecisionsLogged = ("epp_replica_decisions_logged_total", Counter, None),
    ReplicaDecisionsReceived = ("epp_replica_decisions_received_total", Counter, None),
    ReplicaPeerState = ("epp_replica_peer_state", Gauge, Some("peer")),
    ReplicaPullFailures = ("epp_replica_pull_failures_total", Counter, Some("peer")),
}

/// Where a host writes metric updates. `label` is the label's value (""
/// for a metric without a label). A host that refuses an update skips it:
/// metrics never fail a request.
pub trait MetricSink {
    /// Creates the series at 0 (so `rate()` and alerts work from startup).
    fn define(&mut self, metric: Metric, label: &str);
    /// Adds `delta` to a counter or a gauge summed over workers.
    fn add(&mut self, metric: Metric, label: &str, delta: i64);
    fn set(&mut self, metric: Metric, label: &str, value: u64);
    fn record(&mut self, metric: Metric, value: u64);
}

/// Metric updates not yet handed to the host (see the module documentation).
#[derive(Debug, Default)]
pub struct MetricBatch {
    increments: HashMap<Metric, HashMap<String, i64>>,
    gauges: HashMap<Metric, HashMap<String, u64>>,
    samples: Vec<(Metric, u64)>,
    /// What [`MetricBatch::gauge_changed`] last set, per series.
    last_set: HashMap<Metric, HashMap<String, u64>>,
}

impl MetricBatch {
    pub fn increment(&mut self, metric: Metric) {
        self.add(metric, "", 1);
    }

    pub fn increment_labelled(&mut self, metric: Metric, label: &str) {
        self.add(metric, label, 1);
    }

    /// Adds `delta` (a counter, or a gauge every worker moves).
    pub fn add(&mut self, metric: Metric, label: &str, delta: i64) {
        let series = self.increments.entry(metric).or_default();
        match series.get_mut(label) {
            Some(total) => *total += delta,
            None => {
                series.insert(label.to_string(), delta);
            }
        }
    }

    pub fn gauge(&mut self, metric: Metric, value: u64) {
        self.gauge_labelled(metric, "", value);
    }

    pub fn gauge_labelled(&mut self, metric: Metric, label: &str, value: u64) {
        let series = self.gauges.entry(metric).or_default();
        match series.get_mut(label) {
            Some(last) => *last = value,
            None => {
                series.insert(label.to_string(), value);
            }
        }
    }

    /// [`MetricBatch::gauge_labelled`] for a gauge only this batch sets
    /// (the service's per-pod gauges), skipped when unchanged since this
    /// function last set it: a round sets six gauges per pod, 6,144 at
    /// 1,024 pods, most unchanged.
    pub fn gauge_changed(&mut self, metric: Metric, label: &str, value: u64) {
        let last = self.last_set.entry(metric).or_default();
        match last.get_mut(label) {
            Some(last) if *last == value => return,
            Some(last) => *last = value,
            None => {
                last.insert(label.to_string(), value);
            }
        }
        self.gauge_labelled(metric, label, value);
    }

    /// Forgets what [`MetricBatch::gauge_changed`] set under `label` (a pod
    /// that left): set again, it is sent whatever its value.
    pub fn forget_changed(&mut self, label: &str) {
        for series in self.last_set.values_mut() {
            series.remove(label);
        }
    }

    pub fn histogram(&mut self, metric: Metric, value: u64) {
        self.samples.push((metric, value));
    }

    /// Whether [`FLUSH_SAMPLES`] samples are pending: the owner flushes.
    pub fn full(&self) -> bool {
        self.samples.len() >= FLUSH_SAMPLES
    }

    pub fn is_empty(&self) -> bool {
        self.increments.is_empty() && self.gauges.is_empty() && self.samples.is_empty()
    }

    /// Hands every pending update to `sink`.
    pub fn flush(&mut self, sink: &mut dyn MetricSink) {
        for (metric, series) in self.increments.drain() {
            for (label, delta) in series {
                if delta != 0 {
                    sink.add(metric, &label, delta);
                }
            }
        }
        for (metric, series) in self.gauges.drain() {
            for (label, value) in series {
                sink.set(metric, &label, value);
            }
        }
        for (metric, value) in self.samples.drain(..) {
            sink.record(metric, value);
        }
    }
}

/// Defines every kvroute series at 0, so `rate()` and alerts work from
/// startup instead of from a metric's first increment. Labelled series
/// are defined for the label values known from the configuration:
/// statuses kvroute answers, configured models, adapters and pods.
pub fn export_from_zero(config: &Config, sink: &mut dyn MetricSink) {
    for metric in Metric::ALL.iter().filter(|m| m.label().is_none()) {
        sink.define(*metric, "");
    }
    for status in ["400", "404", "405", "503"] {
        sink.define(Metric::RequestsRejected, status);
    }
    for reason in WaitRejection::ALL {
        sink.define(Metric::WaitRejected, reason.name());
        sink.define(Metric::WaitRoutedPastLimit, reason.name());
    }
    for tier in Tier::ALL {
        sink.define(Metric::CacheMatchedBlocks, tier.name());
    }
    for (model, target) in &config.models {
        sink.define(Metric::RoutingDecisions, model);
        if let Some(adapter) = &target.adapter {
            sink.define(Metric::AdapterLoadsTriggered, adapter);
        }
    }
    for pod in &config.pods {
        export_pod_from_zero(pod.id.as_str(), sink);
    }
    for peer in config.replicas.iter().flat_map(|r| &r.peers) {
        export_peer_from_zero(peer, sink);
    }
}

/// A replica peer's series, defined at 0 (configured or discovered peers).
pub fn export_peer_from_zero(peer: &str, sink: &mut dyn MetricSink) {
    sink.define(Metric::ReplicaPeerState, peer);
    sink.define(Metric::ReplicaPullFailures, peer);
}

/// A pod's series, defined at 0 (configured or discovered pods).
pub fn export_pod_from_zero(pod: &str, sink: &mut dyn MetricSink) {
    for metric in [
        Metric::ReportFailures,
        Metric::PassiveEjections,
        Metric::QueueDepth,
        Metric::PodHealthScore,
        Metric::PodLoad,
        Metric::PodReportFallback,
        Metric::PodBlockSizeMismatch,
        Metric::PodKvCapacityBlocks,
        Metric::PodKvResidentBlocks,
        Metric::PodKvRemovedBlocks,
        Metric::PodKvEvictionsRegretted,
        Metric::PodKvEvictionsPredicted,
    ] {
        sink.define(metric, pod);
    }
}

/// A label value as both hosts export it: `.` replaced by `_`. The
/// proxy-wasm build encodes labels in metric names, which Envoy's
/// `stats_tags` regexes split at dots; the native build, whose labels are
/// Envoy tags, exports the same values so dashboards and alerts see the
/// same series whichever build runs.
pub fn label_value(value: &str) -> std::borrow::Cow<'_, str> {
    if value.contains('.') {
        value.replace('.', "_").into()
    } else {
        value.into()
    }
}

/// A [0, 1] value in percent.
pub fn percent(value: f64) -> u64 {
    (value.clamp(0.0, 1.0) * 100.0).round() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorded(Vec<String>);

    impl MetricSink for Recorded {
        fn define(&mut self, metric: Metric, label: &str) {
            self.0.push(format!("define {} {label}", metric.name()));
        }
        fn add(&mut self, metric: Metric, label: &str, delta: i64) {
            self.0
                .push(format!("add {} {label} {delta}", metric.name()));
        }
        fn set(&mut self, metric: Metric, label: &str, value: u64) {
            self.0
                .push(format!("set {} {label} {value}", metric.name()));
        }
        fn record(&mut self, metric: Metric, value: u64) {
            self.0.push(format!("record {} {value}", metric.name()));
        }
    }

    #[test]
    fn a_batch_adds_counters_keeps_the_last_gauge_and_every_sample() {
        let mut batch = MetricBatch::default();
        batch.increment_labelled(Metric::RoutingDecisions, "m");
        batch.increment_labelled(Metric::RoutingDecisions, "m");
        batch.add(Metric::WaitingRequests, "", 3);
        batch.add(Metric::WaitingRequests, "", -3);
        batch.gauge(Metric::CandidatePods, 4);
        batch.gauge(Metric::CandidatePods, 2);
        batch.histogram(Metric::ScoringLatencyUs, 10);
        assert!(!batch.full());
        batch.histogram(Metric::ScoringLatencyUs, 20);
        let mut sink = Recorded::default();
        batch.flush(&mut sink);
        assert!(batch.is_empty());
        let mut lines = sink.0;
        lines.sort();
        assert_eq!(
            lines,
            [
                "add epp_routing_decisions_total m 2",
                "record epp_scoring_latency_us 10",
                "record epp_scoring_latency_us 20",
                "set epp_candidate_pods  2",
            ],
            "a summed gauge that came back to its value is not written"
        );
    }

    #[test]
    fn every_metric_has_a_distinct_name() {
        let mut names: Vec<&str> = Metric::ALL.iter().map(|m| m.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), Metric::ALL.len());
    }
}
