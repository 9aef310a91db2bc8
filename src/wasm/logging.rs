//! The logger over proxy-wasm: kvroute's JSON lines
//! ([`crate::gateway::events`]) through the host's logger.
//!
//! The logger and the panic hook are kvroute's own, over [`super::host`]:
//! the SDK's unwrap the host's status, so a refused log line would itself
//! panic.

use super::host;

struct HostLogger;

static LOGGER: HostLogger = HostLogger;

impl log::Log for HostLogger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            host::log(host_level(record.level()), &record.args().to_string());
        }
    }

    fn flush(&self) {}
}

/// proxy-wasm's log levels: trace 0 … error 4, critical 5.
fn host_level(level: log::Level) -> u32 {
    match level {
        log::Level::Trace => 0,
        log::Level::Debug => 1,
        log::Level::Info => 2,
        log::Level::Warn => 3,
        log::Level::Error => 4,
    }
}

/// Installs the logger (everything passes until `logLevel` narrows it;
/// Envoy's `wasm` component level filters what it prints) and a panic hook
/// that logs the panic at critical before the VM aborts.
pub fn install() {
    // Fails only when already installed in this VM.
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Trace);
    std::panic::set_hook(Box::new(|info| host::log(5, &info.to_string())));
}
