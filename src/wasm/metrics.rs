//! The metric sink over proxy-wasm ([`crate::gateway::metrics`] batches
//! and names them). proxy-wasm metrics are integers and carry no labels:
//! a label is encoded in the name (`epp_queue_depth.pod.<id>`), turned
//! into a Prometheus label by the `stats_tags` regexes shipped in
//! `envoy/`, with `.` replaced by `_` in the value so the regexes can
//! split it ([`catalogue::label_value`]). Metric ids are per VM, defined on first use. A metric the
//! host refuses is skipped: metrics never fail a request.

use std::cell::RefCell;
use std::collections::HashMap;

use super::host::{self, MetricKind};
use crate::gateway::metrics::{self as catalogue, Metric, MetricSink};

thread_local! {
    // One VM per thread; metric ids are per VM.
    static IDS: RefCell<HashMap<String, u32>> = RefCell::new(HashMap::new());
}

/// `base.label.value` with the value made tag-safe.
fn series(metric: Metric, value: &str) -> String {
    match metric.label() {
        Some(label) => format!(
            "{}.{label}.{}",
            metric.name(),
            catalogue::label_value(value)
        ),
        None => metric.name().to_string(),
    }
}

fn id(metric: Metric, value: &str) -> Option<u32> {
    let name = series(metric, value);
    IDS.with(|ids| {
        if let Some(id) = ids.borrow().get(&name) {
            return Some(*id);
        }
        let kind = match metric.kind() {
            catalogue::MetricKind::Counter => MetricKind::Counter,
            catalogue::MetricKind::Gauge => MetricKind::Gauge,
            catalogue::MetricKind::Histogram => MetricKind::Histogram,
        };
        let id = host::define_metric(kind, &name).ok()?;
        ids.borrow_mut().insert(name, id);
        Some(id)
    })
}

/// The VM's metrics (ids live in the VM, so the sink holds nothing).
#[derive(Default)]
pub struct WasmMetrics;

impl MetricSink for WasmMetrics {
    fn define(&mut self, metric: Metric, label: &str) {
        let _ = id(metric, label);
    }

    fn add(&mut self, metric: Metric, label: &str, delta: i64) {
        if let Some(id) = id(metric, label) {
            let _ = host::increment_metric(id, delta);
        }
    }

    fn set(&mut self, metric: Metric, label: &str, value: u64) {
        if let Some(id) = id(metric, label) {
            let _ = host::record_metric(id, value);
        }
    }

    fn record(&mut self, metric: Metric, value: u64) {
        if let Some(id) = id(metric, "") {
            let _ = host::record_metric(id, value);
        }
    }
}
