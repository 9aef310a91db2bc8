//! The logger over the dynamic-module ABI: kvroute's JSON lines
//! ([`crate::gateway::events`]) go to Envoy's log under its
//! `dynamic_modules` component, whose level (`--component-log-level
//! dynamic_modules:info`, or `POST /logging?dynamic_modules=debug` on the
//! admin port) filters them as Envoy's `wasm` level filters the wasm
//! build's. A line below that level is not even formatted.

use super::abi::{self, ModuleBuffer};

struct EnvoyLogger;

static LOGGER: EnvoyLogger = EnvoyLogger;

fn envoy_level(level: log::Level) -> u32 {
    match level {
        log::Level::Trace => abi::LOG_TRACE,
        log::Level::Debug => abi::LOG_DEBUG,
        log::Level::Info => abi::LOG_INFO,
        log::Level::Warn => abi::LOG_WARN,
        log::Level::Error => abi::LOG_ERROR,
    }
}

impl log::Log for EnvoyLogger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        // SAFETY: a plain query, any thread.
        metadata.level() <= log::max_level()
            && unsafe {
                abi::envoy_dynamic_module_callback_log_enabled(envoy_level(metadata.level()))
            }
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            emit(envoy_level(record.level()), &record.args().to_string());
        }
    }

    fn flush(&self) {}
}

/// Hands one line to Envoy's log.
pub fn emit(level: u32, message: &str) {
    // SAFETY: the message outlives the call, Envoy copies it.
    unsafe {
        abi::envoy_dynamic_module_callback_log(level, ModuleBuffer::of(message.as_bytes()));
    }
}

/// Installs the logger (once per process; everything passes until a
/// plugin's `logLevel` narrows it).
pub fn install() {
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Trace);
    }
}

/// Logs a panic caught at the ABI boundary, at critical.
pub fn panicked(hook: &str, payload: &(dyn std::any::Any + Send)) {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    emit(
        abi::LOG_CRITICAL,
        &format!("kvroute: panic in {hook} caught at the ABI boundary: {what}"),
    );
}
