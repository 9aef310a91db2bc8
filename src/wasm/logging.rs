//! JSON-line logs through the host's logger. Each line is one JSON object
//! with `level`, `event` and the event's fields (`requestId` when there is
//! a request), so log pipelines can parse them.

use crate::config::LogLevel;

pub fn apply_level(level: LogLevel) {
    log::set_max_level(match level {
        LogLevel::Error => log::LevelFilter::Error,
        LogLevel::Warn => log::LevelFilter::Warn,
        LogLevel::Info => log::LevelFilter::Info,
        LogLevel::Debug => log::LevelFilter::Debug,
        LogLevel::Trace => log::LevelFilter::Trace,
    });
}

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
