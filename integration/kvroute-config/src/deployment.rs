//! The deployment file kvroute-config reads (YAML, or JSON, which is YAML):
//! the kvroute plugin configuration plus where Envoy listens, where
//! kvroute.wasm is, and for Istio which Service the gateway fronts.
//! Loading checks everything a wrong value would otherwise only reveal at
//! Envoy's start (or never): the plugin JSON goes through kvroute's own
//! parser, pod addresses become the IP literals Envoy matches, the wasm
//! path becomes absolute.

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::envoy::{pod_addresses, EnvoyBootstrap};
use crate::istio::IstioSettings;

/// A deployment file that cannot be rendered, with the file and the field.
#[derive(Debug)]
pub struct Error(pub String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

/// The file as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct DeploymentFile {
    /// The plugin configuration inline, or the path of its JSON file
    /// (relative to the deployment file).
    kvroute: Value,
    #[serde(default)]
    envoy: EnvoySettings,
    #[serde(default)]
    istio: Option<IstioSettings>,
}

/// The `envoy` section.
#[derive(Deserialize, Clone, Debug)]
#[serde(deny_unknown_fields, default, rename_all = "camelCase")]
pub struct EnvoySettings {
    /// kvroute.wasm; relative to the deployment file, rendered absolute.
    pub wasm: PathBuf,
    pub listen_address: String,
    pub listen_port: u16,
    pub admin_port: u16,
    /// Where non-inference paths (`/v1/models`, `/health`) go; empty: the pods.
    pub passthrough: Vec<String>,
}

impl Default for EnvoySettings {
    fn default() -> Self {
        EnvoySettings {
            wasm: PathBuf::from("kvroute.wasm"),
            listen_address: "0.0.0.0".into(),
            listen_port: 10000,
            admin_port: 9901,
            passthrough: Vec::new(),
        }
    }
}

/// What the output is for, which decides what a host name in an address
/// becomes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Target {
    /// A plain Envoy: host names are resolved here, now.
    Envoy,
    /// Istio: pod IPs are the cluster's, so a host name is refused (this
    /// machine's resolver knows nothing of them).
    Istio,
}

/// A loaded, checked deployment.
#[derive(Debug)]
pub struct Deployment {
    /// The plugin JSON, addresses as IP literals; kvroute's parser accepts it.
    pub plugin: Value,
    pub envoy: EnvoySettings,
    pub istio: Option<IstioSettings>,
}

impl Deployment {
    /// Reads, resolves and validates `path` for `target`.
    pub fn load(path: &Path, target: Target) -> Result<Deployment, Error> {
        let at = |what: String| Error(format!("{}: {what}", path.display()));
        let text = std::fs::read_to_string(path).map_err(|e| at(e.to_string()))?;
        let file: DeploymentFile = serde_yaml::from_str(&text).map_err(|e| at(e.to_string()))?;
        let base = path.parent().unwrap_or(Path::new("."));
        let mut plugin = match file.kvroute {
            Value::Object(_) => file.kvroute,
            Value::String(json_path) => {
                let json_path = base.join(json_path);
                let json = std::fs::read_to_string(&json_path)
                    .map_err(|e| at(format!("kvroute: {}: {e}", json_path.display())))?;
                serde_json::from_str(&json)
                    .map_err(|e| at(format!("kvroute: {}: {e}", json_path.display())))?
            }
            _ => {
                return Err(at(
                    "kvroute: must be the plugin configuration (an object) or the path of its JSON file".into(),
                ))
            }
        };
        resolve_plugin_addresses(&mut plugin, target).map_err(at)?;
        let text = plugin.to_string();
        kvroute::config::Config::parse(text.as_bytes()).map_err(|e| at(format!("kvroute: {e}")))?;
        let mut envoy = file.envoy;
        envoy.wasm = absolute(&base.join(&envoy.wasm));
        for (i, address) in envoy.passthrough.iter_mut().enumerate() {
            *address = ip_literal(address, target)
                .map_err(|e| at(format!("envoy.passthrough[{i}]: {e}")))?;
        }
        if target == Target::Istio && file.istio.is_none() {
            return Err(at(
                "istio: the section is required for the Istio manifests".into()
            ));
        }
        Ok(Deployment {
            plugin,
            envoy,
            istio: file.istio,
        })
    }

    /// Replaces the wasm path (a path given on the command line, relative
    /// to the working directory).
    pub fn set_wasm(&mut self, wasm: &Path) {
        self.envoy.wasm = absolute(wasm);
    }

    /// The complete Envoy bootstrap.
    pub fn envoy_bootstrap(&self) -> String {
        let passthrough = if self.envoy.passthrough.is_empty() {
            pod_addresses(&self.plugin)
        } else {
            self.envoy.passthrough.clone()
        };
        EnvoyBootstrap {
            wasm: &self.envoy.wasm,
            listen_address: &self.envoy.listen_address,
            listen_port: self.envoy.listen_port,
            admin_port: self.envoy.admin_port,
            plugin: &self.plugin,
            passthrough: &passthrough,
        }
        .render()
    }
}

/// `path` made absolute without requiring it to exist (the wasm may be
/// rendered for another machine or a container).
fn absolute(path: &Path) -> PathBuf {
    path.canonicalize()
        .or_else(|_| std::path::absolute(path))
        .unwrap_or_else(|_| path.to_path_buf())
}

/// Every address Envoy connects to by header: the pods' (override-host
/// matches endpoint IPs; ORIGINAL_DST parses the header as an IP), their
/// report sidecars' and discovery's (both through the ORIGINAL_DST
/// `kvroute_reports`). Errors name the pod.
fn resolve_plugin_addresses(plugin: &mut Value, target: Target) -> Result<(), String> {
    if let Some(pods) = plugin.get_mut("pods").and_then(Value::as_array_mut) {
        for (i, pod) in pods.iter_mut().enumerate() {
            let id = pod["id"].as_str().unwrap_or("?").to_string();
            for field in ["address", "reportAddress"] {
                if let Some(address) = pod.get(field).and_then(Value::as_str) {
                    let literal = ip_literal(address, target)
                        .map_err(|e| format!("kvroute.pods[{i}].{field} (pod {id:?}): {e}"))?;
                    pod[field] = Value::String(literal);
                }
            }
        }
    }
    if let Some(authority) = plugin
        .pointer("/discovery/authority")
        .and_then(Value::as_str)
    {
        let literal = ip_literal(authority, target)
            .map_err(|e| format!("kvroute.discovery.authority: {e}"))?;
        plugin["discovery"]["authority"] = Value::String(literal);
    }
    Ok(())
}

/// `host:port` as Envoy prints the endpoint (`10.0.0.5:8000`,
/// `[fd00::5]:8000`): an IP literal kept (in canonical form), a host name
/// resolved for [`Target::Envoy`] (IPv4 first, as a dual-stack pod
/// usually registers it) or refused for [`Target::Istio`].
fn ip_literal(address: &str, target: Target) -> Result<String, String> {
    kvroute::config::validate_address(address)?;
    if let Ok(ip) = address.parse::<SocketAddr>() {
        return Ok(ip.to_string());
    }
    if target == Target::Istio {
        return Err(format!(
            "{address:?} is a host name; the Istio manifests need the pod's IP (the mesh cluster's endpoints are pod IPs, and this machine cannot resolve the cluster's names)"
        ));
    }
    let resolved: Vec<SocketAddr> = address
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {address:?}: {e}"))?
        .collect();
    resolved
        .iter()
        .find(|a| a.is_ipv4())
        .or(resolved.first())
        .map(SocketAddr::to_string)
        .ok_or_else(|| format!("{address:?} resolves to no address"))
}
