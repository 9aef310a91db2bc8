//! The Istio manifests: envoy/istio/kvroute.yaml is the rendering of
//! envoy/istio/deployment.yaml (`KVROUTE_BLESS=1` rewrites it), the filter
//! and the report service carry the same plugin JSON, the mode that would
//! bypass the mesh is refused, and the Envoy pieces, put together the way
//! Istio's merge and patches would, are a configuration Envoy 1.40 accepts
//! (an override-host policy on a cluster that also has Istio's `lb_policy`)
//! and runs: kvroute's membership of the mesh cluster, read through
//! `kvroute_admin`, routes to the cluster's member.

use kvroute_config::{istio, Deployment, Target};
use kvroute_integration::harness::{
    assert_committed_rendering, free_port, repo_root, start_sim_in_process, validate_envoy_config,
    wasm_path, Envoy,
};
use kvroute_integration::http;
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
    assert_committed_rendering(
        "envoy/istio/kvroute.yaml",
        &istio::render(&example()).unwrap(),
        "-p kvroute-config --test istio",
    );
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

/// The mesh's cluster of the example's Service, as Istio names it.
const MESH_CLUSTER: &str = "outbound|8000||vllm.inference.svc.cluster.local";

#[test]
fn membership_is_of_the_mesh_cluster_through_the_gateways_admin() {
    let documents = documents(&istio::render(&example()).unwrap());
    let (bootstrap, _) = pieces(&documents);
    let json = bootstrap["bootstrap_extensions"][0]["typed_config"]["config"]["configuration"]
        ["value"]
        .as_str()
        .unwrap();
    let plugin: Value = serde_json::from_str(json).unwrap();
    assert_eq!(
        plugin["membership"],
        json!({"cluster": MESH_CLUSTER, "adminCluster": "kvroute_admin", "reportPort": 8100, "metricsPort": 8000})
    );
    assert!(plugin.get("pods").is_none());
    let admin = &bootstrap["static_resources"]["clusters"][1];
    assert_eq!(admin["name"], "kvroute_admin");
    assert_eq!(
        admin["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            ["socket_address"],
        json!({"address": "127.0.0.1", "port_value": 15000}),
        "Istio's admin address"
    );
}

/// Three gateway pods share their decisions: the replica listener in the
/// bootstrap override, the replicas found through a headless Service.
#[test]
fn gateway_replicas_find_each_other_through_a_headless_service() {
    let documents = documents(&istio::render(&example()).unwrap());
    let deployment = find(&documents, "Deployment");
    assert_eq!(deployment["spec"]["replicas"], 3);
    let ports = &deployment["spec"]["template"]["spec"]["containers"][0]["ports"];
    assert_eq!(
        ports[1],
        json!({"containerPort": 9902, "name": "kvroute-replica"})
    );
    let headless = documents
        .iter()
        .find(|d| d["kind"] == "Service" && d["metadata"]["name"] == "kvroute-replicas")
        .expect("the headless Service");
    assert_eq!(headless["spec"]["clusterIP"], "None");
    assert_eq!(headless["spec"]["ports"][0]["port"], 9902);
    let (bootstrap, _) = pieces(&documents);
    let listener = &bootstrap["static_resources"]["listeners"][0];
    assert_eq!(listener["name"], "kvroute_replica");
    assert_eq!(
        listener["address"]["socket_address"],
        json!({"address": "0.0.0.0", "port_value": 9902})
    );
    let replicas = bootstrap["static_resources"]["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "kvroute_replicas")
        .expect("kvroute_replicas");
    assert_eq!(
        replicas["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            ["socket_address"],
        json!({"address": "kvroute-replicas.inference.svc.cluster.local", "port_value": 9902})
    );
    let json = bootstrap["bootstrap_extensions"][0]["typed_config"]["config"]["configuration"]
        ["value"]
        .as_str()
        .unwrap();
    let plugin: Value = serde_json::from_str(json).unwrap();
    assert_eq!(plugin["replicas"]["cluster"], "kvroute_replicas");
}

/// A stand-in for the gateway's Envoy: the bootstrap override's pieces as
/// Istio's agent merges them, a listener on `listen_port` with the
/// patched-in filter and buffer limit, and the mesh cluster as Istio
/// generates it (`lb_policy` set; STATIC with `members` here, EDS there)
/// with the CLUSTER patch merged in. The admin is on `admin_port` (Istio's
/// is 15000: `kvroute_admin` is pointed there) and the module where `make
/// wasm` leaves it.
fn merged_gateway(
    deployment: &Deployment,
    members: &[u16],
    listen_port: u16,
    admin_port: u16,
) -> String {
    let documents = documents(&istio::render(deployment).unwrap());
    let (mut bootstrap, patches) = pieces(&documents);
    let (filter, listener_patch, cluster_patch) = (
        &patches[0]["patch"]["value"],
        &patches[1]["patch"]["value"],
        &patches[2]["patch"]["value"],
    );
    let endpoints: Vec<Value> = members
        .iter()
        .map(|port| json!({"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}))
        .collect();
    let mut mesh_cluster = json!({
        "name": MESH_CLUSTER,
        "type": "STATIC",
        "lb_policy": "LEAST_REQUEST",
        "connect_timeout": "10s",
        "load_assignment": {"cluster_name": MESH_CLUSTER, "endpoints": [{"lb_endpoints": endpoints}]},
    });
    mesh_cluster
        .as_object_mut()
        .unwrap()
        .extend(cluster_patch.as_object().unwrap().clone());
    let mut listener = json!({
        "name": "0.0.0.0_8080",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "outbound_0.0.0.0_8080",
                "route_config": {"virtual_hosts": [{"name": "vllm", "domains": ["*"], "routes": [
                    {"match": {"prefix": "/"}, "route": {"cluster": MESH_CLUSTER}},
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
    let clusters = bootstrap["static_resources"]["clusters"]
        .as_array_mut()
        .unwrap();
    let admin_cluster = clusters
        .iter_mut()
        .find(|c| c["name"] == "kvroute_admin")
        .expect("kvroute_admin");
    admin_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        ["socket_address"]["port_value"] = json!(admin_port);
    clusters.push(mesh_cluster);
    // The bootstrap's own listeners (the replica listener) beside the
    // gateway's, on free ports here.
    let mut listeners = vec![listener];
    for mut own in bootstrap["static_resources"]["listeners"]
        .as_array()
        .cloned()
        .unwrap_or_default()
    {
        own["address"]["socket_address"] =
            json!({"address": "127.0.0.1", "port_value": free_port()});
        listeners.push(own);
    }
    bootstrap["static_resources"]["listeners"] = json!(listeners);
    bootstrap["admin"] =
        json!({"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}});
    bootstrap.to_string().replace(
        &format!("{}/kvroute.wasm", istio::WASM_MOUNT),
        &wasm_path().display().to_string(),
    )
}

#[test]
fn envoy_accepts_the_pieces_as_istio_merges_them() {
    let text = merged_gateway(&example(), &[8000, 8001], free_port(), free_port());
    let config = std::env::temp_dir().join(format!("kvroute-istio-pieces-{}.json", free_port()));
    std::fs::write(&config, text).unwrap();
    let output = validate_envoy_config(&config);
    let _ = std::fs::remove_file(&config);
    assert!(output.0, "{}", output.1);
}

/// The merged gateway running: kvroute's pods are the mesh cluster's
/// members (a name with `|`s, read from the admin through kvroute_admin),
/// and a request is routed to one.
#[test]
fn the_merged_gateway_routes_to_the_mesh_clusters_member() {
    let dir = std::env::temp_dir().join(format!("kvroute-istio-run-{}", free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut deployment = example();
    // The sim serves its report and metrics on its own port.
    let membership = deployment.plugin["membership"].as_object_mut().unwrap();
    membership.remove("reportPort");
    membership.remove("metricsPort");
    deployment.plugin["podReportIntervalMs"] = json!(200);
    deployment.plugin["decisionHeaders"] = json!(true);
    let port = free_port();
    let member = format!("127.0.0.1:{port}");
    let sim_config = dir.join("kvroute.json");
    std::fs::write(&sim_config, deployment.plugin.to_string()).unwrap();
    let sim = start_sim_in_process(&sim_config, &member, port);
    let (listen, admin) = (free_port(), free_port());
    let config = merged_gateway(&deployment, &[port], listen, admin);
    let envoy = Envoy::start(&dir, &config, listen, admin).expect("envoy starts");
    let body = json!({"model": "llama-3.1-8b", "prompt": "hello through the mesh cluster", "max_tokens": 4});
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    // Until the service has read the members and published: 503.
    let response = loop {
        let response = http::post_json(&envoy.listen, "/v1/completions", &body.to_string())
            .expect("request through envoy");
        if response.status != 503 || std::time::Instant::now() > deadline {
            break response;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let log = envoy.log();
    drop(envoy);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(response.status, 200, "{}\n{log}", response.body);
    assert_eq!(response.header("x-kvroute-pod"), Some(member.as_str()));
    let stats: Value = http::get(&sim, "/admin/stats").unwrap().json().unwrap();
    assert_eq!(stats["requests"], 1, "{stats}");
}
