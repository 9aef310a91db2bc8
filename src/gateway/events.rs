//! kvroute's log lines, the same for every host: each is one JSON object
//! with `event` and the event's fields (`requestId` when there is a
//! request), so log pipelines can parse them. They go through the `log`
//! crate; each host installs the logger that hands them to Envoy (and
//! narrows `log::max_level` to the plugin's `logLevel`).

use crate::config::LogLevel;

/// Logs `fields` (a JSON object) with `event` added, at `level`.
pub fn event(level: log::Level, event: &str, mut fields: serde_json::Value) {
    if !log::log_enabled!(level) {
        return;
    }
    if let Some(object) = fields.as_object_mut() {
        object.insert("event".into(), event.into());
    }
    log::log!(level, "{fields}");
}

/// Logs `record`, a struct whose `event` field names it, at `level`: the
/// per-request lines, serialized as they are, without building a JSON
/// value first (measured natively at 16 KiB: building and printing the
/// `route` line's value cost about as much CPU as the request's lookups
/// and scoring).
pub fn record(level: log::Level, record: &impl serde::Serialize) {
    if !log::log_enabled!(level) {
        return;
    }
    if let Ok(line) = serde_json::to_string(record) {
        log::log!(level, "{line}");
    }
}

/// The `log` filter for the plugin's `logLevel`.
pub fn level_filter(level: LogLevel) -> log::LevelFilter {
    match level {
        LogLevel::Error => log::LevelFilter::Error,
        LogLevel::Warn => log::LevelFilter::Warn,
        LogLevel::Info => log::LevelFilter::Info,
        LogLevel::Debug => log::LevelFilter::Debug,
        LogLevel::Trace => log::LevelFilter::Trace,
    }
}
