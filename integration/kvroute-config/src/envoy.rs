//! The Envoy bootstrap: `envoy/envoy.template.yaml` filled in. This is the
//! only renderer of the template; the CLI, the test harness, `make run` and
//! the benchmarks all come through [`EnvoyBootstrap::render`].

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The template, compiled in so the binary renders without a checkout.
pub const TEMPLATE: &str = include_str!("../../../envoy/envoy.template.yaml");

/// Where the override-host `kvroute_pods` cluster gets its endpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodEndpoints {
    /// STATIC: the plugin's `pods` (IP literals), fixed at rendering.
    Plugin,
    /// STRICT_DNS: `host:port` names Envoy resolves and keeps re-resolving.
    Dns(Vec<String>),
    /// Filesystem EDS: the file Envoy watches (an absolute path).
    Eds(PathBuf),
}

/// Which kvroute build Envoy runs (the template's `native` or `wasm`
/// section).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Module<'a> {
    /// `libkvroute.so`, loaded by name from the directory in Envoy's
    /// `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`.
    Native,
    /// kvroute.wasm as Envoy will open it (an absolute path: Envoy
    /// resolves a relative one against its working directory).
    Wasm(&'a Path),
}

/// Everything the template's `{{...}}` placeholders take.
pub struct EnvoyBootstrap<'a> {
    pub module: Module<'a>,
    /// Address the kvroute listener binds (`0.0.0.0` to serve others).
    pub listen_address: &'a str,
    pub listen_port: u16,
    /// The admin interface always binds 127.0.0.1: it can stop Envoy.
    pub admin_port: u16,
    /// The kvroute plugin JSON shared by the filter and the service: its
    /// `upstreamMode` picks the template's section (`overrideHost` when
    /// absent, as in kvroute) and, with `membership`, the cluster that
    /// reaches this Envoy's admin is added. Rendered as given (not
    /// validated here, so tests can hand Envoy a configuration it must
    /// refuse).
    pub plugin: &'a Value,
    /// The override-host pod cluster's endpoints.
    pub pods: &'a PodEndpoints,
    /// `host:port` IP literals non-inference paths are balanced over; none:
    /// the pods' cluster balances them (override-host without kvroute's
    /// header is its fallback policy).
    pub passthrough: &'a [String],
    /// The replica listener's port (rendered with the plugin's `replicas`).
    pub replica_port: u16,
    /// `host:port` names of the replicas' `kvroute_replicas` cluster (a
    /// headless Service's name), when the replicas are found by DNS.
    pub replica_dns: &'a [String],
}

/// The replica listener's port when none is given.
pub const DEFAULT_REPLICA_PORT: u16 = 9902;

impl EnvoyBootstrap<'_> {
    pub fn render(&self) -> String {
        let mode = self.plugin["upstreamMode"]
            .as_str()
            .unwrap_or("overrideHost");
        let passthrough_to_pods = self.passthrough.is_empty() && mode == "overrideHost";
        let (pods_section, listed, eds_path) = match self.pods {
            PodEndpoints::Plugin => ("staticPods", pod_addresses(self.plugin), None),
            PodEndpoints::Dns(names) => ("dnsPods", names.clone(), None),
            PodEndpoints::Eds(path) => ("edsPods", Vec::new(), Some(path)),
        };
        let (module, wasm) = match self.module {
            Module::Native => ("native", Path::new("")),
            Module::Wasm(path) => ("wasm", path),
        };
        let mut sections = vec![module, mode, pods_section];
        if eds_path.is_none() {
            sections.push("listedPods");
        }
        let replicas = self.plugin.get("replicas");
        if self.plugin.get("membership").is_some()
            || replicas.is_some_and(|r| r.get("cluster").is_some())
        {
            sections.push("adminCluster");
        }
        if replicas.is_some() {
            sections.push("replicas");
        }
        if !self.replica_dns.is_empty() {
            sections.push("replicaDns");
        }
        if !passthrough_to_pods {
            sections.push("passthrough");
        }
        keep_sections(TEMPLATE, &sections)
            .replace("{{wasm}}", &wasm.display().to_string())
            .replace("{{listen_address}}", self.listen_address)
            .replace("{{listen_port}}", &self.listen_port.to_string())
            .replace("{{admin_port}}", &self.admin_port.to_string())
            // Single-quoted YAML scalar: a quote is written twice.
            .replace(
                "{{plugin_config}}",
                &self.plugin.to_string().replace('\'', "''"),
            )
            .replace("{{pod_endpoints}}", &lb_endpoints(&listed))
            .replace(
                "{{eds_path}}",
                &eds_path
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
            )
            .replace(
                "{{passthrough_cluster}}",
                if passthrough_to_pods {
                    "kvroute_pods"
                } else {
                    "kvroute_passthrough"
                },
            )
            .replace("{{passthrough_endpoints}}", &lb_endpoints(self.passthrough))
            .replace("{{replica_port}}", &self.replica_port.to_string())
            .replace("{{replica_endpoints}}", &lb_endpoints(self.replica_dns))
    }
}

/// The `address` of each of the plugin's `pods`, in order.
pub fn pod_addresses(plugin: &Value) -> Vec<String> {
    plugin["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["address"].as_str().map(String::from))
        .collect()
}

/// The template without its marker lines and without the sections
/// (`# {{#name}}` … `# {{/name}}`, nested or not) whose name is not in
/// `enabled`: a line is kept when every section around it is enabled.
fn keep_sections(template: &str, enabled: &[&str]) -> String {
    let mut open: Vec<bool> = Vec::new();
    let mut out = String::with_capacity(template.len());
    for line in template.lines() {
        let marker = line.trim_start().strip_prefix("# {{");
        if let Some(opened) = marker.and_then(|m| m.strip_prefix('#')) {
            open.push(enabled.contains(&opened.trim_end_matches("}}")));
        } else if marker.is_some_and(|m| m.starts_with('/')) {
            open.pop();
        } else if open.iter().all(|&kept| kept) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// `lb_endpoints` entries for `host:port` addresses (`[]` for none).
fn lb_endpoints(addresses: &[String]) -> String {
    if addresses.is_empty() {
        return "          []".into();
    }
    addresses
        .iter()
        .map(|address| {
            let (host, port) = address.rsplit_once(':').expect("host:port");
            let host = host.trim_start_matches('[').trim_end_matches(']');
            format!("        - endpoint: {{address: {{socket_address: {{address: \"{host}\", port_value: {port}}}}}}}")
        })
        .collect::<Vec<_>>()
        .join("\n")
}
