//! proxy-wasm glue: the host traits of [`crate::gateway::host`] over
//! proxy-wasm (the build for Istio and any Envoy with V8).
//!
//! One `kvroute.wasm` serves two roots, chosen by the plugin's `root_id`
//! (readable through `plugin_root_id` already while the root is created):
//! - `service`: the singleton bootstrap service ([`service`]) pulling pod
//!   reports and publishing the snapshot to shared data;
//! - `replica`: the replica listener's filter ([`replica`]), serving this
//!   replica's decision log to its peers;
//! - anything else: the HTTP filter ([`filter`]) routing each request.
//!
//! All must use the same `vm_id` so they share data and queues.

mod filter;
mod host;
mod logging;
mod metrics;
mod replica;
mod service;
mod shared;

use proxy_wasm::traits::RootContext;

use host::Buffer;

fn root_id() -> String {
    host::property(&["plugin_root_id"])
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}

/// Called once per VM by the `proxy_wasm::main!` entry point.
pub fn start() {
    logging::install();
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        match root_id().as_str() {
            "service" => Box::new(service::ServiceRoot::default()),
            "replica" => Box::new(replica::ReplicaRoot::default()),
            _ => Box::new(filter::FilterRoot::default()),
        }
    });
}

/// The plugin configuration, validated ([`crate::gateway::load_config`]).
fn load_config(role: &str) -> Option<crate::config::Config> {
    let bytes = host::buffer(Buffer::PluginConfiguration, 0, usize::MAX)
        .ok()
        .flatten()
        .unwrap_or_default();
    crate::gateway::load_config(&bytes, role, Some(&mut metrics::WasmMetrics))
}
