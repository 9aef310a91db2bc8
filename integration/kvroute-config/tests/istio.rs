//! The Istio manifests: envoy/istio/kvroute.yaml is the rendering of
//! envoy/istio/deployment.yaml (`KVROUTE_BLESS=1` rewrites it), the filter
//! and the report service carry the same plugin JSON, the mode that would
//! bypass the mesh is refused, and the Envoy pieces, put together the way
//! Istio's merge and patches would, are a configuration Envoy 1.40 accepts
//! (an override-host policy on a cluster that also has Istio's `lb_policy`).

use std::path::Path;
use std::process::Command;

use kvroute_config::{istio, Deployment, Target};
use kvroute_integration::harness::{envoy_binary, free_port, repo_root, wasm_path};
use serde_json::{json, Value};

fn example() -> Deployment {
    Deployment::load(
        &repo_root().join("envoy/istio/deployment.yaml"),
        Target::Istio,
    )
    .expect("envoy/istio/deployment.yaml loads")
}

fn documents(manifests: &str) -> Vec<Value> {
    manifests
        .split("\n---\n")
        .skip(1)
        .map(|d| serde_yaml::from_str(d).unwrap())
        .collect()
}

fn find<'a>(documents: &'a [Value], kind: &str) -> &'a Value {
    documents
        .iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
}

/// The ConfigMap's bootstrap override and the EnvoyFilter's patches.
fn pieces(documents: &[Value]) -> (Value, Vec<Value>) {
    let data = &find(documents, "ConfigMap")["data"]["custom_bootstrap.json"];
    let bootstrap = serde_json::from_str(data.as_str().unwrap()).unwrap();
    let patches = find(documents, "EnvoyFilter")["spec"]["configPatches"]
        .as_array()
        .unwrap()
        .clone();
    (bootstrap, patches)
}

#[test]
fn example_manifests_are_the_rendering() {
    let path = repo_root().join("envoy/istio/kvroute.yaml");
    let expected = istio::render(&example()).unwrap();
    if std::env::var_os("KVROUTE_BLESS").is_some() {
        std::fs::write(&path, &expected).unwrap();
    }
    let actual = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(actual == expected, "envoy/istio/kvroute.yaml is stale: run `KVROUTE_BLESS=1 cargo test -p kvroute-config --test istio`");
}

#[test]
fn filter_and_service_carry_the_same_plugin_json() {
    let deployment = example();
    let documents = documents(&istio::render(&deployment).unwrap());
    let (bootstrap, patches) = pieces(&documents);
    let service = &bootstrap["bootstrap_extensions"][0]["typed_config"]["config"];
    let filter = &patches[0]["patch"]["value"]["typed_config"]["config"];
    assert_eq!(service["configuration"], filter["configuration"]);
    assert_eq!(
        service["vm_config"], filter["vm_config"],
        "one vm_id and module: shared data"
    );
    let json = service["configuration"]["value"].as_str().unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(json).unwrap(),
        deployment.plugin
    );
    kvroute::config::Config::parse(json.as_bytes()).expect("kvroute parses it");
}

#[test]
fn original_dst_is_refused_on_istio() {
    let mut deployment = example();
    deployment.plugin["upstreamMode"] = json!("originalDst");
    let error = istio::render(&deployment).unwrap_err().to_string();
    assert!(
        error.contains("kvroute.upstreamMode: must be \"overrideHost\" on Istio"),
        "{error}"
    );
}

/// A stand-in for the gateway's Envoy: the bootstrap override's pieces as
/// Istio's agent merges them, a listener with the patched-in filter and
/// buffer limit, and the mesh cluster as Istio generates it (`lb_policy`
/// set; STATIC here, EDS there) with the CLUSTER patch merged in.
#[test]
fn envoy_accepts_the_pieces_as_istio_merges_them() {
    let documents = documents(&istio::render(&example()).unwrap());
    let (mut bootstrap, patches) = pieces(&documents);
    let (filter, listener_patch, cluster_patch) = (
        &patches[0]["patch"]["value"],
        &patches[1]["patch"]["value"],
        &patches[2]["patch"]["value"],
    );
    let mut mesh_cluster = json!({
        "name": "outbound|8000||vllm.inference.svc.cluster.local",
        "type": "STATIC",
        "lb_policy": "LEAST_REQUEST",
        "connect_timeout": "10s",
        "load_assignment": {"cluster_name": "outbound|8000||vllm.inference.svc.cluster.local", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "10.0.0.10", "port_value": 8000}}}},
            {"endpoint": {"address": {"socket_address": {"address": "10.0.0.11", "port_value": 8000}}}},
        ]}]},
    });
    mesh_cluster
        .as_object_mut()
        .unwrap()
        .extend(cluster_patch.as_object().unwrap().clone());
    let mut listener = json!({
        "name": "0.0.0.0_8080",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": free_port()}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "outbound_0.0.0.0_8080",
                "route_config": {"virtual_hosts": [{"name": "vllm", "domains": ["*"], "routes": [
                    {"match": {"prefix": "/"}, "route": {"cluster": "outbound|8000||vllm.inference.svc.cluster.local"}},
                ]}]},
                "http_filters": [filter, {"name": "envoy.filters.http.router", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
            },
        }]}],
    });
    listener
        .as_object_mut()
        .unwrap()
        .extend(listener_patch.as_object().unwrap().clone());
    bootstrap["static_resources"]["clusters"]
        .as_array_mut()
        .unwrap()
        .push(mesh_cluster);
    bootstrap["static_resources"]["listeners"] = json!([listener]);
    bootstrap["admin"] =
        json!({"address": {"socket_address": {"address": "127.0.0.1", "port_value": free_port()}}});
    let text = bootstrap.to_string().replace(
        &format!("{}/kvroute.wasm", istio::WASM_MOUNT),
        &wasm_path().display().to_string(),
    );
    let config = std::env::temp_dir().join(format!("kvroute-istio-pieces-{}.json", free_port()));
    std::fs::write(&config, text).unwrap();
    let output = validate(&config);
    let _ = std::fs::remove_file(&config);
    assert!(output.0, "{}", output.1);
}

fn validate(config: &Path) -> (bool, String) {
    let output = Command::new(envoy_binary().expect("envoy (make envoy)"))
        .args([
            "--mode",
            "validate",
            "--disable-hot-restart",
            "-l",
            "error",
            "-c",
        ])
        .arg(config)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    (output.status.success() && log.contains("OK"), log)
}
