//! Native glue: kvroute as an Envoy dynamic module (`libkvroute.so`), the
//! host traits of [`crate::gateway::host`] over Envoy's dynamic-module ABI.
//!
//! Envoy loads the module by name from `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`
//! (`lib<name>.so`) for an `envoy.filters.http.dynamic_modules` filter
//! whose `filter_config` is the plugin JSON. The filter config Envoy
//! creates on its main thread is [`config::FilterConfig`]: it owns the
//! index snapshot every worker reads in place ([`shared`]), one worker
//! state per Envoy worker ([`filter`]) and the report service. Compared
//! with the proxy-wasm build there is no V8 boundary and no copy: a
//! request reads the buckets it bisects through where the service wrote
//! them, and in-flight counts are atomics.
//!
//! ABI boundary: every hook ([`hooks`]) catches a panic (the `native`
//! cargo profile builds with `panic = "unwind"` so it can; the wasm build
//! aborts instead) and answers Envoy with a neutral value (pass the
//! request through, no filter), logging the panic at critical. Every
//! pointer and length Envoy hands over is checked for null before use.

// The unit tests link without Envoy: nothing calls its callbacks there.
#![cfg_attr(test, allow(dead_code))]

mod abi;
mod config;
mod filter;
#[cfg(not(test))]
mod hooks;
mod logging;
mod metrics;
mod replica;
mod shared;
mod workers;
