//! The deployment file kvroute-config reads (YAML, or JSON, which is YAML):
//! the kvroute plugin configuration plus where Envoy listens, which kvroute
//! build it runs (the native module by default, or kvroute.wasm and where
//! it is), and for Istio which Service the gateway fronts.
//! Loading checks everything a wrong value would otherwise only reveal at
//! Envoy's start (or never): the plugin JSON goes through kvroute's own
//! parser, pod addresses become the IP literals Envoy matches, the wasm
//! path becomes absolute. With a `cluster` section (and always on Istio)
//! the pods are the serving cluster's members: loading writes the plugin's
//! `membership`.

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::envoy::{pod_addresses, EnvoyBootstrap, Module, PodEndpoints, DEFAULT_REPLICA_PORT};
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
    cluster: Option<ClusterSection>,
    #[serde(default)]
    envoy: EnvoySettings,
    #[serde(default)]
    istio: Option<IstioSettings>,
    #[serde(default)]
    replicas: Option<ReplicasSection>,
}

/// The `replicas` section: this Envoy is one replica of a gateway, serving
/// its decision log on the replica listener at `port` and pulling the
/// others' (the plugin's `replicas` holds the shared secret, and the peers
/// when they are listed). With `dns` the replicas are the names'
/// addresses (a headless Service): a STRICT_DNS cluster
/// `kvroute_replicas`, written as the plugin's `replicas.cluster`.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ReplicasSection {
    #[serde(default)]
    port: Option<u16>,
    #[serde(default)]
    dns: Vec<String>,
}

/// The `cluster` section: the pods are the members of the serving cluster
/// (`kvroute_pods`, or on Istio the mesh's cluster of `istio.service`),
/// which kvroute reads from Envoy's admin every round (its `membership`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ClusterSection {
    /// `host:port` names for a STRICT_DNS cluster (Envoy re-resolves them).
    #[serde(default)]
    dns: Option<Vec<String>>,
    /// A filesystem EDS cluster.
    #[serde(default)]
    eds: Option<EdsSource>,
    /// Each member's report endpoint is its IP at this port (a sidecar such
    /// as kvroute-vllm-bridge); default: the member's own port.
    #[serde(default)]
    report_port: Option<u16>,
    /// Each member's vLLM `/metrics` port; default: the member's own port.
    #[serde(default)]
    metrics_port: Option<u16>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EdsSource {
    /// The EDS file; relative to the deployment file, rendered absolute.
    path: PathBuf,
}

/// Which kvroute build a plain Envoy runs (Istio's proxy runs the wasm
/// build: it does not enable dynamic modules).
#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum ModuleKind {
    /// The dynamic module `libkvroute.so` (`make native`): Envoy needs
    /// `ENVOY_DYNAMIC_MODULES_SEARCH_PATH` set to its directory.
    #[default]
    Native,
    /// kvroute.wasm (`make wasm`), at `envoy.wasm`.
    Wasm,
}

/// The `envoy` section.
#[derive(Deserialize, Clone, Debug)]
#[serde(deny_unknown_fields, default, rename_all = "camelCase")]
pub struct EnvoySettings {
    /// `native` (the default) or `wasm`.
    pub module: ModuleKind,
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
            module: ModuleKind::Native,
            wasm: PathBuf::from("kvroute.wasm"),
            listen_address: "0.0.0.0".into(),
            listen_port: 10000,
            admin_port: 9901,
            passthrough: Vec::new(),
        }
    }
}

/// What the output is for, which decides where the pods come from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Target {
    /// A plain Envoy: kvroute's `pods` (host names resolved here, now) or
    /// the members of the `cluster` section's `kvroute_pods`.
    Envoy,
    /// Istio: the members of the mesh's cluster of `istio.service` (this
    /// machine's resolver knows nothing of the cluster's names).
    Istio,
}

/// A loaded, checked deployment.
#[derive(Debug)]
pub struct Deployment {
    /// The plugin JSON, addresses as IP literals, `membership` written from
    /// the `cluster` section; kvroute's parser accepts it.
    pub plugin: Value,
    /// The override-host pod cluster's endpoints.
    pub pods: PodEndpoints,
    pub envoy: EnvoySettings,
    pub istio: Option<IstioSettings>,
    /// The replica listener's port, and the replicas' DNS names.
    pub replica_port: u16,
    pub replica_dns: Vec<String>,
}

impl Deployment {
    /// Reads, resolves and validates `path` for `target`.
    pub fn load(path: &Path, target: Target) -> Result<Deployment, Error> {
        let at = |what: String| Error(format!("{}: {what}", path.display()));
        let text = std::fs::read_to_string(path).map_err(|e| at(e.to_string()))?;
        let mut file: DeploymentFile =
            serde_yaml::from_str(&text).map_err(|e| at(e.to_string()))?;
        let base = path.parent().unwrap_or(Path::new("."));
        let mut plugin = match std::mem::take(&mut file.kvroute) {
            plugin @ Value::Object(_) => plugin,
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
        let pods = pod_source(&file, &mut plugin, target, base).map_err(at)?;
        let mut replicas = file.replicas.take().unwrap_or_default();
        if target == Target::Istio && plugin.get("replicas").is_some() {
            let istio = file.istio.as_ref().ok_or_else(|| {
                at("istio: the section is required for the Istio manifests".into())
            })?;
            if !replicas.dns.is_empty() {
                return Err(at("replicas.dns: not on Istio: the replicas are the gateway's pods, found through the headless Service <gateway>-replicas".into()));
            }
            replicas.dns =
                vec![istio.replicas_service(replicas.port.unwrap_or(DEFAULT_REPLICA_PORT))];
        }
        set_replica_cluster(&mut plugin, &replicas).map_err(at)?;
        resolve_plugin_addresses(&mut plugin).map_err(at)?;
        let text = plugin.to_string();
        kvroute::config::Config::parse(text.as_bytes()).map_err(|e| at(format!("kvroute: {e}")))?;
        let mut envoy = file.envoy;
        envoy.wasm = absolute(&base.join(&envoy.wasm));
        for (i, address) in envoy.passthrough.iter_mut().enumerate() {
            *address =
                ip_literal(address).map_err(|e| at(format!("envoy.passthrough[{i}]: {e}")))?;
        }
        Ok(Deployment {
            plugin,
            pods,
            envoy,
            istio: file.istio,
            replica_port: replicas.port.unwrap_or(DEFAULT_REPLICA_PORT),
            replica_dns: replicas.dns,
        })
    }

    /// Renders the wasm build at `wasm` (a path given on the command line,
    /// relative to the working directory).
    pub fn set_wasm(&mut self, wasm: &Path) {
        self.envoy.module = ModuleKind::Wasm;
        self.envoy.wasm = absolute(wasm);
    }

    /// The complete Envoy bootstrap.
    pub fn envoy_bootstrap(&self) -> String {
        let passthrough = if self.envoy.passthrough.is_empty() {
            pod_addresses(&self.plugin)
        } else {
            self.envoy.passthrough.clone()
        };
        let module = match self.envoy.module {
            ModuleKind::Native => Module::Native,
            ModuleKind::Wasm => Module::Wasm(&self.envoy.wasm),
        };
        EnvoyBootstrap {
            module,
            listen_address: &self.envoy.listen_address,
            listen_port: self.envoy.listen_port,
            admin_port: self.envoy.admin_port,
            plugin: &self.plugin,
            pods: &self.pods,
            passthrough: &passthrough,
            replica_port: self.replica_port,
            replica_dns: &self.replica_dns,
        }
        .render()
    }
}

/// With the `replicas` section's `dns`: the plugin's replicas are the
/// members of `kvroute_replicas`.
fn set_replica_cluster(plugin: &mut Value, section: &ReplicasSection) -> Result<(), String> {
    if section.port == Some(0) {
        return Err("replicas.port: must be a port 1-65535".into());
    }
    for (i, name) in section.dns.iter().enumerate() {
        kvroute::config::validate_address(name).map_err(|e| format!("replicas.dns[{i}]: {e}"))?;
    }
    if section.dns.is_empty() {
        return Ok(());
    }
    let replicas = plugin
        .get_mut("replicas")
        .and_then(Value::as_object_mut)
        .ok_or("replicas.dns: the plugin's `replicas` (with its `secret`) is required")?;
    if replicas.contains_key("peers") || replicas.contains_key("cluster") {
        return Err("kvroute.replicas: its peers / cluster come from the deployment (replicas.dns, or the gateway's pods on Istio); leave them out".into());
    }
    replicas.insert("cluster".into(), "kvroute_replicas".into());
    Ok(())
}

/// Where the pods come from for `target`: kvroute's `pods`, or the members
/// of the `cluster` section's `kvroute_pods` (plain Envoy) or of the mesh's
/// cluster (Istio), in which case the plugin's `membership` is written.
fn pod_source(
    file: &DeploymentFile,
    plugin: &mut Value,
    target: Target,
    base: &Path,
) -> Result<PodEndpoints, String> {
    match target {
        Target::Envoy => match &file.cluster {
            Some(cluster) => {
                let pods = cluster.endpoints(base)?;
                set_membership(plugin, "kvroute_pods", cluster, "with `cluster`")?;
                Ok(pods)
            }
            None if plugin.get("membership").is_some() => Err(
                "kvroute.membership: set the deployment's `cluster` instead (kvroute-config writes membership from it, with the clusters it needs)".into(),
            ),
            None => Ok(PodEndpoints::Plugin),
        },
        Target::Istio => {
            let istio = file
                .istio
                .as_ref()
                .ok_or("istio: the section is required for the Istio manifests")?;
            let cluster = file.cluster.as_ref().unwrap_or(&ClusterSection::MESH);
            if cluster.dns.is_some() || cluster.eds.is_some() {
                return Err(format!(
                    "cluster.{}: not on Istio: the pods are the mesh's endpoints of istio.service",
                    if cluster.dns.is_some() { "dns" } else { "eds" }
                ));
            }
            if !file.envoy.passthrough.is_empty() {
                return Err(
                    "envoy.passthrough: not on Istio: the HTTPRoute sends every path to istio.service".into(),
                );
            }
            set_membership(plugin, &istio.mesh_cluster(), cluster, "on Istio")?;
            // The manifests take only the pods cluster's policy.
            Ok(PodEndpoints::Plugin)
        }
    }
}

impl ClusterSection {
    /// Istio without a `cluster` section: the mesh's members, reports and
    /// metrics at their own port.
    const MESH: ClusterSection = ClusterSection {
        dns: None,
        eds: None,
        report_port: None,
        metrics_port: None,
    };

    /// The plain Envoy's pod cluster: exactly one of `dns` and `eds`.
    fn endpoints(&self, base: &Path) -> Result<PodEndpoints, String> {
        match (&self.dns, &self.eds) {
            (Some(names), None) => {
                if names.is_empty() {
                    return Err("cluster.dns: must name at least one host:port".into());
                }
                for (i, name) in names.iter().enumerate() {
                    kvroute::config::validate_address(name)
                        .map_err(|e| format!("cluster.dns[{i}]: {e}"))?;
                }
                Ok(PodEndpoints::Dns(names.clone()))
            }
            (None, Some(eds)) => Ok(PodEndpoints::Eds(absolute(&base.join(&eds.path)))),
            (Some(_), Some(_)) => Err("cluster: `dns` or `eds`, not both".into()),
            (None, None) => {
                Err("cluster: needs `dns` (a list of host:port) or `eds` ({path: FILE})".into())
            }
        }
    }
}

/// Writes the plugin's `membership` of `cluster` (through the template's
/// `kvroute_admin`), refusing the plugin's own sources of pods; `context`
/// (`with `cluster``, `on Istio`) says why in the errors.
fn set_membership(
    plugin: &mut Value,
    cluster: &str,
    section: &ClusterSection,
    context: &str,
) -> Result<(), String> {
    let members = format!("the pods are the members of {cluster}");
    for (field, why) in [
        ("pods", members.as_str()),
        ("discovery", members.as_str()),
        ("membership", "kvroute-config writes it"),
    ] {
        if plugin.get(field).is_some() {
            return Err(format!("kvroute.{field}: not {context} ({why})"));
        }
    }
    if plugin["upstreamMode"].as_str().unwrap_or("overrideHost") != "overrideHost" {
        return Err(format!("kvroute.upstreamMode: must be \"overrideHost\" {context} (an ORIGINAL_DST cluster has no members to read)"));
    }
    let mut membership = serde_json::json!({"cluster": cluster, "adminCluster": "kvroute_admin"});
    for (field, port) in [
        ("reportPort", section.report_port),
        ("metricsPort", section.metrics_port),
    ] {
        match port {
            Some(0) => return Err(format!("cluster.{field}: must be a port 1-65535")),
            Some(port) => membership[field] = port.into(),
            None => {}
        }
    }
    plugin["membership"] = membership;
    Ok(())
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
/// report sidecars', metrics ports' and discovery's (all through the
/// ORIGINAL_DST `kvroute_reports`). Errors name the pod.
fn resolve_plugin_addresses(plugin: &mut Value) -> Result<(), String> {
    if let Some(pods) = plugin.get_mut("pods").and_then(Value::as_array_mut) {
        for (i, pod) in pods.iter_mut().enumerate() {
            let id = pod["id"].as_str().unwrap_or("?").to_string();
            for field in ["address", "reportAddress", "metricsAddress"] {
                if let Some(address) = pod.get(field).and_then(Value::as_str) {
                    let literal = ip_literal(address)
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
        let literal =
            ip_literal(authority).map_err(|e| format!("kvroute.discovery.authority: {e}"))?;
        plugin["discovery"]["authority"] = Value::String(literal);
    }
    Ok(())
}

/// `host:port` as Envoy prints the endpoint (`10.0.0.5:8000`,
/// `[fd00::5]:8000`): an IP literal kept (in canonical form), a host name
/// resolved here, now (IPv4 first, as a dual-stack pod usually registers
/// it). On Istio nothing reaches here: pods and discovery are refused
/// there, the mesh's members being the pods.
fn ip_literal(address: &str) -> Result<String, String> {
    kvroute::config::validate_address(address)?;
    if let Ok(ip) = address.parse::<SocketAddr>() {
        return Ok(ip.to_string());
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
