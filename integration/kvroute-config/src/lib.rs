//! kvroute-config: one deployment file in, a complete Envoy bootstrap (or
//! the Istio manifests) out. The library is the one renderer of
//! `envoy/envoy.template.yaml`; the integration harness, `make run` and the
//! benchmarks render through it too.

pub mod deployment;
pub mod envoy;
pub mod istio;

pub use deployment::{Deployment, EnvoySettings, Error, ModuleKind, Target};
pub use envoy::{EnvoyBootstrap, Module, PodEndpoints, DEFAULT_REPLICA_PORT};
