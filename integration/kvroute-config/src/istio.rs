//! The Istio manifests (Istio 1.28, Gateway API v1): a gateway Deployment
//! the mesh injects (Istio's "manual deployment" of a Gateway, because only
//! that path lets the pod mount a custom bootstrap and kvroute.wasm), its
//! Service, a Gateway and an HTTPRoute to the vLLM Service, a ConfigMap
//! with the bootstrap override (the report service, stats settings, the
//! `kvroute_reports` cluster and `kvroute_admin`, which reaches the
//! gateway's own admin), an EnvoyFilter inserting the kvroute filter and
//! switching the mesh's own cluster of the vLLM Service to the override-host
//! policy (so mTLS and the mesh's endpoints stay), and a DestinationRule
//! for the retry budget. kvroute's pods are that cluster's members (its
//! `membership`, written by [`Deployment::load`]).
//!
//! Every Envoy piece is taken from the plain bootstrap this crate renders
//! from `envoy/envoy.template.yaml`, so the filter, the service, the stats
//! settings and the override-host policy exist once, in the template.

use serde::Deserialize;
use serde_json::{json, Value};

use crate::deployment::{Deployment, Error};

/// Where kvroute.wasm is mounted in the gateway pod (from the ConfigMap
/// `<gateway>-wasm`).
pub const WASM_MOUNT: &str = "/etc/kvroute/wasm";
/// Where the bootstrap override is mounted; Istio's agent reads the file
/// named by `ISTIO_BOOTSTRAP_OVERRIDE` and merges it into its bootstrap
/// (singular fields replace, repeated ones append).
const BOOTSTRAP_MOUNT: &str = "/etc/istio/custom-bootstrap";
const BOOTSTRAP_FILE: &str = "custom_bootstrap.json";
/// The gateway's Envoy admin port: Istio's bootstrap template binds the
/// admin to `{{ .localhost }}:{{ .config.ProxyAdminPort }}` (127.0.0.1,
/// ::1 on IPv6-only pods), ProxyAdminPort being 15000 unless the mesh
/// config changes it; Istio's own `prometheus_stats` cluster reaches it the
/// same way.
pub const ISTIO_ADMIN_PORT: u16 = 15000;

/// The `istio` section of the deployment file.
#[derive(Deserialize, Clone, Debug)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct IstioSettings {
    /// Namespace of the gateway and of everything rendered.
    pub namespace: String,
    /// Name of the Gateway, its Deployment and Service (and the prefix of
    /// the ConfigMaps and the EnvoyFilter).
    #[serde(default = "default_gateway")]
    pub gateway: String,
    /// Port the Gateway listens on (unprivileged: the injected gateway
    /// runs as non-root).
    #[serde(default = "default_port")]
    pub port: u16,
    /// The vLLM pods' Service: the HTTPRoute's backend, whose mesh cluster
    /// gets the override-host policy.
    pub service: ServiceRef,
    /// Gateway pods (the Deployment's replicas). With the plugin's
    /// `replicas` they share their decisions over the replica listener,
    /// found through the headless Service `<gateway>-replicas`.
    #[serde(default = "default_replicas")]
    pub replicas: u32,
}

fn default_replicas() -> u32 {
    1
}

#[derive(Deserialize, Clone, Debug)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ServiceRef {
    pub name: String,
    /// Defaults to the gateway's namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    pub port: u16,
}

impl IstioSettings {
    /// The mesh's outbound cluster of the vLLM Service as Istio names it:
    /// the serving cluster, whose members are kvroute's pods.
    pub fn mesh_cluster(&self) -> String {
        format!("outbound|{}||{}", self.service.port, self.service_host())
    }

    /// The headless Service of the gateway's pods, as `replicas.dns` (its
    /// name resolves to every gateway pod).
    pub fn replicas_service(&self, port: u16) -> String {
        format!(
            "{}-replicas.{}.svc.cluster.local:{port}",
            self.gateway, self.namespace
        )
    }

    fn service_host(&self) -> String {
        let namespace = self.service.namespace.as_deref().unwrap_or(&self.namespace);
        format!("{}.{namespace}.svc.cluster.local", self.service.name)
    }
}

fn default_gateway() -> String {
    "kvroute".into()
}

fn default_port() -> u16 {
    8080
}

/// The pieces of the plain bootstrap the manifests reuse.
struct EnvoyPieces {
    service: Value,
    filter: Value,
    stats_flush_interval: Value,
    stats_config: Value,
    reports_cluster: Value,
    admin_cluster: Value,
    override_host_policy: Value,
    buffer_limit: Value,
    /// With the plugin's `replicas`: the replica listener and the cluster
    /// of the replicas.
    replica_listener: Option<Value>,
    replicas_cluster: Option<Value>,
}

impl EnvoyPieces {
    fn of(bootstrap: &str) -> Result<EnvoyPieces, Error> {
        let b: Value = serde_yaml::from_str(bootstrap)
            .map_err(|e| Error(format!("rendered bootstrap does not parse: {e}")))?;
        let listener = &b["static_resources"]["listeners"][0];
        let cluster = |name: &str| {
            b["static_resources"]["clusters"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["name"] == name))
                .cloned()
                .ok_or_else(|| Error(format!("rendered bootstrap has no cluster {name}")))
        };
        let pieces = EnvoyPieces {
            service: b["bootstrap_extensions"].clone(),
            filter: listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0]
                .clone(),
            stats_flush_interval: b["stats_flush_interval"].clone(),
            stats_config: b["stats_config"].clone(),
            reports_cluster: cluster("kvroute_reports")?,
            admin_cluster: cluster("kvroute_admin")?,
            override_host_policy: cluster("kvroute_pods")?["load_balancing_policy"].clone(),
            buffer_limit: listener["per_connection_buffer_limit_bytes"].clone(),
            replica_listener: b["static_resources"]["listeners"]
                .as_array()
                .and_then(|ls| ls.iter().find(|l| l["name"] == "kvroute_replica"))
                .cloned(),
            replicas_cluster: cluster("kvroute_replicas").ok(),
        };
        if pieces.filter["name"] != "envoy.filters.http.wasm"
            || pieces.override_host_policy.is_null()
        {
            return Err(Error(
                "rendered bootstrap lacks the kvroute filter or the override-host policy".into(),
            ));
        }
        Ok(pieces)
    }
}

/// The manifests, as one multi-document YAML stream.
pub fn render(deployment: &Deployment) -> Result<String, Error> {
    let istio = deployment
        .istio
        .as_ref()
        .ok_or_else(|| Error("istio: the section is required for the Istio manifests".into()))?;
    if deployment.plugin["upstreamMode"]
        .as_str()
        .unwrap_or("overrideHost")
        != "overrideHost"
    {
        return Err(Error(
            "kvroute.upstreamMode: must be \"overrideHost\" on Istio (an ORIGINAL_DST cluster would bypass the mesh's endpoints and mTLS)".into(),
        ));
    }
    let mut in_pod = Deployment {
        plugin: deployment.plugin.clone(),
        pods: deployment.pods.clone(),
        envoy: deployment.envoy.clone(),
        istio: None,
        replica_port: deployment.replica_port,
        replica_dns: deployment.replica_dns.clone(),
    };
    if in_pod.plugin.get("replicas").is_some() {
        // The replica listener serves the other pods, not only loopback.
        in_pod.envoy.listen_address = "0.0.0.0".into();
    }
    // Istio's proxy does not enable dynamic modules: the wasm build.
    in_pod.envoy.module = crate::deployment::ModuleKind::Wasm;
    in_pod.envoy.wasm = format!("{WASM_MOUNT}/kvroute.wasm").into();
    in_pod.envoy.admin_port = ISTIO_ADMIN_PORT;
    let pieces = EnvoyPieces::of(&in_pod.envoy_bootstrap())?;
    let documents = manifests(istio, &pieces, in_pod.replica_port);
    let mut out = String::from(
        "# kvroute on Istio 1.28 (Gateway API v1), rendered by kvroute-config; see\n\
         # docs/deployment.md, \"Istio (1.28)\". Before applying, create the\n\
         # wasm ConfigMap:\n",
    );
    out.push_str(&format!(
        "#   kubectl -n {ns} create configmap {gw}-wasm --from-file=kvroute.wasm=target/wasm32-wasip1/release/kvroute.wasm\n",
        ns = istio.namespace,
        gw = istio.gateway
    ));
    for document in documents {
        out.push_str("---\n");
        out.push_str(
            &serde_yaml::to_string(&document)
                .map_err(|e| Error(format!("cannot write a manifest: {e}")))?,
        );
    }
    Ok(out)
}

fn manifests(istio: &IstioSettings, pieces: &EnvoyPieces, replica_port: u16) -> Vec<Value> {
    let ns = &istio.namespace;
    let gw = &istio.gateway;
    let service_ns = istio.service.namespace.as_deref().unwrap_or(ns);
    let service_host = istio.service_host();
    let labels = json!({"app.kubernetes.io/name": gw});
    let mut clusters = vec![pieces.reports_cluster.clone(), pieces.admin_cluster.clone()];
    clusters.extend(pieces.replicas_cluster.clone());
    let mut static_resources = json!({"clusters": clusters});
    if let Some(listener) = &pieces.replica_listener {
        // A listener of the bootstrap, not of the mesh: the replicas'
        // channel, on every gateway pod's replica port.
        static_resources["listeners"] = json!([listener]);
    }
    let bootstrap_override = json!({
        "bootstrap_extensions": pieces.service,
        "stats_flush_interval": pieces.stats_flush_interval,
        "stats_config": pieces.stats_config,
        "static_resources": static_resources,
    });
    let mut ports = vec![json!({"containerPort": istio.port, "name": "http"})];
    if pieces.replica_listener.is_some() {
        ports.push(json!({"containerPort": replica_port, "name": "kvroute-replica"}));
    }
    let gateway_listener = json!({"portNumber": istio.port});
    let mut documents = vec![
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": format!("{gw}-bootstrap"), "namespace": ns},
            "data": {BOOTSTRAP_FILE: serde_json::to_string_pretty(&bootstrap_override).expect("JSON")},
        }),
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": gw, "namespace": ns},
            "spec": {
                "replicas": istio.replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {
                        // The gateway injection template turns the
                        // placeholder container into Istio's proxy.
                        "annotations": {
                            "inject.istio.io/templates": "gateway",
                            // Istio's stats matcher drops unlisted stats;
                            // kvroute's metrics are wasmcustom.*.
                            "proxy.istio.io/config": "{\"proxyStatsMatcher\":{\"inclusionPrefixes\":[\"wasmcustom.\"]}}",
                        },
                        "labels": merge(&labels, &json!({"sidecar.istio.io/inject": "true"})),
                    },
                    "spec": {
                        "containers": [{
                            "name": "istio-proxy",
                            "image": "auto",
                            "ports": ports,
                            "env": [{"name": "ISTIO_BOOTSTRAP_OVERRIDE", "value": format!("{BOOTSTRAP_MOUNT}/{BOOTSTRAP_FILE}")}],
                            "volumeMounts": [
                                {"name": "kvroute-bootstrap", "mountPath": BOOTSTRAP_MOUNT, "readOnly": true},
                                {"name": "kvroute-wasm", "mountPath": WASM_MOUNT, "readOnly": true},
                            ],
                        }],
                        "volumes": [
                            {"name": "kvroute-bootstrap", "configMap": {"name": format!("{gw}-bootstrap")}},
                            {"name": "kvroute-wasm", "configMap": {"name": format!("{gw}-wasm")}},
                        ],
                    },
                },
            },
        }),
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": gw, "namespace": ns},
            "spec": {
                "selector": labels,
                "ports": [{"name": "http", "port": istio.port, "targetPort": istio.port}],
            },
        }),
        json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
            "metadata": {"name": gw, "namespace": ns},
            "spec": {
                "gatewayClassName": "istio",
                // Manual deployment: Istio programs the pods behind this
                // Service instead of deploying its own.
                "addresses": [{"type": "Hostname", "value": format!("{gw}.{ns}.svc.cluster.local")}],
                "listeners": [{"name": "http", "port": istio.port, "protocol": "HTTP", "allowedRoutes": {"namespaces": {"from": "Same"}}}],
            },
        }),
        json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": gw, "namespace": ns},
            "spec": {
                "parentRefs": [{"name": gw}],
                // Every path to the vLLM Service: kvroute picks the pod on
                // its routePaths; other paths take the fallback policy.
                "rules": [{
                    "backendRefs": [{"name": istio.service.name, "namespace": service_ns, "port": istio.service.port}],
                }],
            },
        }),
        json!({
            "apiVersion": "networking.istio.io/v1alpha3", "kind": "EnvoyFilter",
            "metadata": {"name": gw, "namespace": ns},
            "spec": {
                "workloadSelector": {"labels": labels},
                "configPatches": [
                    {
                        "applyTo": "HTTP_FILTER",
                        "match": {"context": "GATEWAY", "listener": merge(&gateway_listener, &json!({
                            "filterChain": {"filter": {"name": "envoy.filters.network.http_connection_manager",
                                                       "subFilter": {"name": "envoy.filters.http.router"}}},
                        }))},
                        "patch": {"operation": "INSERT_BEFORE", "value": pieces.filter},
                    },
                    {
                        "applyTo": "LISTENER",
                        "match": {"context": "GATEWAY", "listener": gateway_listener},
                        "patch": {"operation": "MERGE", "value": {"per_connection_buffer_limit_bytes": pieces.buffer_limit}},
                    },
                    {
                        "applyTo": "CLUSTER",
                        "match": {"context": "GATEWAY", "cluster": {"service": service_host, "portNumber": istio.service.port}},
                        "patch": {"operation": "MERGE", "value": {
                            "per_connection_buffer_limit_bytes": pieces.buffer_limit,
                            "load_balancing_policy": pieces.override_host_policy,
                        }},
                    },
                ],
            },
        }),
        json!({
            "apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
            "metadata": {"name": format!("{gw}-retries"), "namespace": ns},
            "spec": {
                "host": service_host,
                // Failover is retries: Envoy's default allows 3 at a time.
                "trafficPolicy": {"connectionPool": {"http": {"maxRetries": 1024}}},
            },
        }),
    ];
    if pieces.replica_listener.is_some() {
        documents.push(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": format!("{gw}-replicas"), "namespace": ns},
            "spec": {
                // Headless: its DNS name resolves to every gateway pod, the
                // members of kvroute_replicas. Pods are listed before they
                // are ready, so a starting replica is pulled (and pulls)
                // at once.
                "clusterIP": "None",
                "publishNotReadyAddresses": true,
                "selector": labels,
                "ports": [{"name": "kvroute-replica", "port": replica_port, "targetPort": replica_port}],
            },
        }));
    }
    documents
}

/// `a` with `b`'s keys added (both objects).
fn merge(a: &Value, b: &Value) -> Value {
    let mut out = a.clone();
    if let (Some(out), Some(b)) = (out.as_object_mut(), b.as_object()) {
        out.extend(b.clone());
    }
    out
}
