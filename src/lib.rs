//! kvroute: a KV-cache-aware router for LLM inference that runs inside Envoy,
//! as a native dynamic module (`libkvroute.so`, glue in `native`) or a
//! proxy-wasm filter (`kvroute.wasm`, glue in `wasm`).
//!
//! The routing core (everything but the `wasm` and `native` modules) is
//! host-agnostic: it imports neither host, so it is tested and benchmarked
//! natively and reused by the simulated pods and tools. What both glues
//! share — the request lifecycle, the wait queue, the report service,
//! metrics and log lines — is in [`gateway`], behind small host traits.
//!
//! No input and no host answer may panic: a panic aborts a wasm VM (Envoy
//! never reloads the singleton report service), and the native module
//! catches one only at its ABI boundary. The lints below enforce it
//! outside tests; the few exceptions are allowed where they stand, with
//! the reason.
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing,
        clippy::unreachable,
        clippy::todo,
        clippy::unimplemented
    )
)]

pub mod chat_template;
pub mod cluster;
pub mod config;
pub mod discovery;
pub mod ejection;
pub mod gateway;
pub mod hashing;
pub mod index;
pub mod memory;
pub mod polling;
pub mod queueing;
pub mod replica;
pub mod report;
pub mod report_log;
pub mod request;
pub mod router;
pub mod scoring;
pub mod snapshot;
pub mod staleness;
pub mod usage;

#[cfg(all(target_arch = "wasm32", feature = "envoy", not(test)))]
mod wasm;

#[cfg(all(not(target_arch = "wasm32"), feature = "native"))]
mod native;

#[cfg(all(target_arch = "wasm32", feature = "envoy", not(test)))]
proxy_wasm::main! {{
    wasm::start();
}}
