//! proxy-wasm glue: thin host adapters over the routing core.
//!
//! One `kvroute.wasm` serves two roots, chosen by the plugin's `root_id`
//! (readable through `plugin_root_id` already while the root is created):
//! - `service`: the singleton bootstrap service ([`service`]) pulling pod
//!   reports and publishing the snapshot to shared data;
//! - anything else: the HTTP filter ([`filter`]) routing each request.
//!
//! Both must use the same `vm_id` so they share data and queues.

mod filter;
mod host;
mod logging;
mod metrics;
mod service;
mod shared;

use proxy_wasm::traits::RootContext;

fn root_id() -> String {
    host::property(&["plugin_root_id"])
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}

/// Called once per VM by the `proxy_wasm::main!` entry point.
pub fn start() {
    logging::install();
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        if root_id() == "service" {
            Box::new(service::ServiceRoot::default())
        } else {
            Box::new(filter::FilterRoot::default())
        }
    });
}

/// Reads and validates the plugin configuration, logging the error (which
/// names the field) so Envoy's refusal is explained.
fn load_config(bytes: Option<Vec<u8>>, role: &str) -> Option<crate::config::Config> {
    match crate::config::Config::parse(&bytes.unwrap_or_default()) {
        Ok(config) => {
            logging::apply_level(config.log_level);
            metrics::export_from_zero(&config);
            Some(config)
        }
        Err(error) => {
            log::error!("kvroute {role}: {error}");
            None
        }
    }
}
