//! kvroute: a KV-cache-aware router for LLM inference that runs inside Envoy
//! as a proxy-wasm filter.
//!
//! The routing core (everything but `wasm`) is host-agnostic: it imports
//! nothing from proxy-wasm, so it is tested and benchmarked natively and
//! reused by the simulated pods and tools.

pub mod config;
pub mod hashing;
pub mod index;
pub mod report;
pub mod request;
pub mod scoring;
pub mod snapshot;
