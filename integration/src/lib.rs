//! Integration support for kvroute: the simulated vLLM pod (`kvroute-sim`),
//! its pure cache/cost model (reused by offline replay), and a std-only
//! HTTP/1.1 client for tests and harnesses.

pub mod bench;
pub mod harness;
pub mod hostile;
pub mod http;
pub mod kv_events;
pub mod model;
pub mod replay;
pub mod sim;
pub mod tokenizer;
pub mod trace;
pub mod vllm;
