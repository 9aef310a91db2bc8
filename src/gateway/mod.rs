//! What kvroute does inside Envoy, written once for both hosts: the HTTP
//! filter's life of a request ([`filter`]), the worker's wait queue
//! ([`waiting`]), the report service ([`service`]), the metrics
//! ([`metrics`]) and the log lines ([`events`]). Each host implements the
//! small traits of [`host`]: `src/wasm/` over proxy-wasm (Istio, any
//! Envoy with V8), `src/native/` over Envoy's dynamic-module ABI. Neither
//! glue decides anything; this module imports neither.

pub mod events;
pub mod filter;
pub mod host;
pub mod metrics;
pub mod replica;
pub mod service;
pub mod waiting;

use crate::config::Config;
use metrics::MetricSink;

/// 64 random bits from the standard library's per-instance hash keys
/// (`getrandom` natively, WASI's `random_get` in wasm): distinct for every
/// call, so for every worker, VM and replica process.
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

/// Parses and validates the plugin configuration; on success applies its
/// `logLevel` and defines every metric series at 0 in `sink` (a role that
/// exports no metric gives none), on failure logs the error (which names
/// the field) so Envoy's refusal is explained.
pub fn load_config(bytes: &[u8], role: &str, sink: Option<&mut dyn MetricSink>) -> Option<Config> {
    match Config::parse(bytes) {
        Ok(config) => {
            log::set_max_level(events::level_filter(config.log_level));
            if let Some(sink) = sink {
                metrics::export_from_zero(&config, sink);
            }
            Some(config)
        }
        Err(error) => {
            log::error!("kvroute {role}: {error}");
            None
        }
    }
}
