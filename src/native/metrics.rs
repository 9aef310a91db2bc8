//! The metric sink over the dynamic-module ABI: every kvroute metric is
//! defined when the filter config is created (Envoy freezes definitions
//! after that), with its label as an Envoy tag, so Prometheus shows
//! `epp_queue_depth{pod="pod-0"}` as under proxy-wasm (where the label is
//! encoded in the name and extracted by `stats_tags`), with the same
//! values ([`label_value`]). Updates go through
//! the config-level callbacks, usable from any thread and outside a
//! request; the batching is the core's ([`crate::gateway::metrics`]).

use super::abi::{self, FilterConfigEnvoy, ModuleBuffer};
use crate::gateway::metrics::{label_value, Metric, MetricKind, MetricSink};

/// Metric ids as Envoy defined them, by [`Metric`] (position in
/// [`Metric::ALL`]).
#[derive(Debug, Clone)]
pub struct NativeMetrics {
    config: usize,
    ids: Vec<Option<usize>>,
}

fn position(metric: Metric) -> usize {
    Metric::ALL
        .iter()
        .position(|m| *m == metric)
        .unwrap_or(usize::MAX)
}

impl NativeMetrics {
    /// Defines every metric on `config` (during its creation, on the main
    /// thread). A metric Envoy refuses is skipped when updated.
    pub fn define_all(config: FilterConfigEnvoy) -> NativeMetrics {
        let ids = Metric::ALL
            .iter()
            .map(|metric| {
                let name = metric.name();
                let label = metric.label().unwrap_or("");
                let mut labels = [ModuleBuffer::of(label.as_bytes())];
                let labels_length = usize::from(metric.label().is_some());
                let mut id = 0usize;
                let define = match metric.kind() {
                    MetricKind::Counter => {
                        abi::envoy_dynamic_module_callback_http_filter_config_define_counter
                    }
                    MetricKind::Gauge => {
                        abi::envoy_dynamic_module_callback_http_filter_config_define_gauge
                    }
                    MetricKind::Histogram => {
                        abi::envoy_dynamic_module_callback_http_filter_config_define_histogram
                    }
                };
                // SAFETY: `config` is the config being created; the name
                // and label outlive the call.
                let result = unsafe {
                    define(
                        config,
                        ModuleBuffer::of(name.as_bytes()),
                        labels.as_mut_ptr(),
                        labels_length,
                        &mut id,
                    )
                };
                if result != abi::METRICS_SUCCESS {
                    log::warn!("kvroute: Envoy refused to define metric {name} ({result})");
                }
                (result == abi::METRICS_SUCCESS).then_some(id)
            })
            .collect();
        NativeMetrics {
            config: config as usize,
            ids,
        }
    }

    /// Calls `update` with the metric's id and label values.
    fn with(
        &self,
        metric: Metric,
        label: &str,
        update: impl FnOnce(FilterConfigEnvoy, usize, *mut ModuleBuffer, usize),
    ) {
        let Some(Some(id)) = self.ids.get(position(metric)) else {
            return;
        };
        let label = label_value(label);
        let mut values = [ModuleBuffer::of(label.as_bytes())];
        let length = usize::from(metric.label().is_some());
        update(
            self.config as FilterConfigEnvoy,
            *id,
            values.as_mut_ptr(),
            length,
        );
    }
}

impl MetricSink for NativeMetrics {
    fn define(&mut self, metric: Metric, label: &str) {
        // A series exists once updated: counters by 0, gauges at 0 (a
        // summed gauge by 0). Histograms show on their first sample.
        match metric.kind() {
            MetricKind::Counter => self.add(metric, label, 0),
            MetricKind::Gauge if metric == Metric::WaitingRequests => {
                self.with(metric, label, |config, id, values, length| unsafe {
                    abi::envoy_dynamic_module_callback_http_filter_config_increment_gauge(
                        config, id, values, length, 0,
                    );
                })
            }
            MetricKind::Gauge => self.set(metric, label, 0),
            MetricKind::Histogram => {}
        }
    }

    fn add(&mut self, metric: Metric, label: &str, delta: i64) {
        // SAFETY (all updates): the config outlives its workers and
        // service, the only holders of this sink; the label outlives the
        // call.
        self.with(metric, label, |config, id, values, length| unsafe {
            match (metric.kind(), delta < 0) {
                (MetricKind::Gauge, true) => {
                    abi::envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
                        config,
                        id,
                        values,
                        length,
                        delta.unsigned_abs(),
                    );
                }
                (MetricKind::Gauge, false) => {
                    abi::envoy_dynamic_module_callback_http_filter_config_increment_gauge(
                        config,
                        id,
                        values,
                        length,
                        delta.unsigned_abs(),
                    );
                }
                _ => {
                    abi::envoy_dynamic_module_callback_http_filter_config_increment_counter(
                        config,
                        id,
                        values,
                        length,
                        delta.unsigned_abs(),
                    );
                }
            }
        });
    }

    fn set(&mut self, metric: Metric, label: &str, value: u64) {
        self.with(metric, label, |config, id, values, length| unsafe {
            abi::envoy_dynamic_module_callback_http_filter_config_set_gauge(
                config, id, values, length, value,
            );
        });
    }

    fn record(&mut self, metric: Metric, value: u64) {
        self.with(metric, "", |config, id, values, length| unsafe {
            abi::envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
                config, id, values, length, value,
            );
        });
    }
}
