//! Prometheus metrics through Envoy's stats. proxy-wasm metrics are
//! integers, so ratios and scores are recorded in percent (0–100) and
//! labels are encoded in the name (`epp_queue_depth.pod.<id>`), turned into
//! Prometheus labels by the `stats_tags` regexes shipped in `envoy/`.
//! Label values have `.` replaced by `_` so the regexes can split them.
//! A metric the host refuses is skipped: metrics never fail a request.

use std::cell::RefCell;
use std::collections::HashMap;

use super::host::{self, MetricKind};

thread_local! {
    // One VM per thread; metric ids are per VM.
    static IDS: RefCell<HashMap<String, u32>> = RefCell::new(HashMap::new());
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
    if let Some(id) = id(MetricKind::Counter, name) {
        let _ = host::increment_metric(id, 1);
    }
}

pub fn gauge(name: &str, value: u64) {
    if let Some(id) = id(MetricKind::Gauge, name) {
        let _ = host::record_metric(id, value);
    }
}

pub fn histogram(name: &str, value: u64) {
    if let Some(id) = id(MetricKind::Histogram, name) {
        let _ = host::record_metric(id, value);
    }
}

/// A [0, 1] value in percent.
pub fn percent(value: f64) -> u64 {
    (value.clamp(0.0, 1.0) * 100.0).round() as u64
}
