//! The `kvroute-config` binary: the demo's bootstrap byte for byte, a
//! user's pods (host names resolved, or refused naming the pod), plugin
//! errors naming the field, an absolute wasm path, the `cluster` section
//! (STRICT_DNS or EDS pods, kvroute's membership of them), Envoy validating
//! what it prints, and an Envoy started from its output routing to a
//! kvroute-sim pod, named statically or as a DNS cluster's member.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use kvroute_integration::harness::{
    filler_text, free_port, poll, repo_root, start_sim_in_process, validate_envoy_config,
    wasm_path, write_eds, Envoy,
};
use kvroute_integration::http;
use serde_json::{json, Value};

/// A scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "kvroute-config-{name}-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    /// Writes `deployment` (as YAML) and returns its path.
    fn deployment(&self, deployment: &Value) -> PathBuf {
        let path = self.0.join("deployment.yaml");
        std::fs::write(&path, serde_yaml::to_string(deployment).unwrap()).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn kvroute_config(args: &[&str], file: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute-config"))
        .arg("render")
        .args(args)
        .arg(file)
        .current_dir(repo_root())
        .output()
        .expect("kvroute-config runs")
}

fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "kvroute-config failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout.clone()).unwrap()
}

fn refusal(output: &Output) -> String {
    assert_eq!(output.status.code(), Some(1), "kvroute-config must refuse");
    assert!(output.stdout.is_empty());
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The plugin JSON embedded in a rendered bootstrap: the native filter's
/// `filter_config`, or the wasm service's `configuration`.
fn embedded_plugin(bootstrap: &str) -> Value {
    let parsed: Value = serde_yaml::from_str(bootstrap).unwrap();
    let filter = &parsed["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"][0]["typed_config"];
    let value = filter["filter_config"]["value"]
        .as_str()
        .or_else(|| {
            parsed["bootstrap_extensions"][0]["typed_config"]["config"]["configuration"]["value"]
                .as_str()
        })
        .unwrap();
    serde_json::from_str(value).unwrap()
}

fn user_deployment(pods: Value, wasm: &Path) -> Value {
    json!({
        "kvroute": {"models": {"llama": {"baseModel": "llama"}}, "pods": pods},
        "envoy": {"wasm": wasm, "listenPort": free_port(), "adminPort": free_port()},
    })
}

#[test]
fn demo_file_renders_envoy_yaml_byte_for_byte() {
    let rendered = stdout(&kvroute_config(&[], Path::new("envoy/demo.kvroute.yaml")));
    let shipped = std::fs::read_to_string(repo_root().join("envoy/envoy.yaml")).unwrap();
    assert!(
        rendered == shipped,
        "kvroute-config's rendering differs from envoy/envoy.yaml"
    );
}

#[test]
fn host_names_become_ip_literals_and_the_wasm_path_absolute() {
    let scratch = Scratch::new("resolve");
    let file = scratch.deployment(&json!({
        "kvroute": {"pods": [{"id": "vllm-0", "address": "localhost:8000", "reportAddress": "localhost:9000"}]},
        "envoy": {"module": "wasm", "wasm": "build/kvroute.wasm"},
    }));
    let output = kvroute_config(&[], &file);
    let bootstrap = stdout(&output);
    let plugin = embedded_plugin(&bootstrap);
    assert_eq!(plugin["pods"][0]["address"], "127.0.0.1:8000");
    assert_eq!(plugin["pods"][0]["reportAddress"], "127.0.0.1:9000");
    assert!(bootstrap.contains(r#"socket_address: {address: "127.0.0.1", port_value: 8000}"#));
    let wasm = scratch.0.canonicalize().unwrap().join("build/kvroute.wasm");
    assert!(
        bootstrap.contains(&format!("filename: \"{}\"", wasm.display())),
        "{bootstrap}"
    );
    // The module is not there: a warning, not a refusal.
    assert!(String::from_utf8_lossy(&output.stderr).contains("does not exist here"));
}

#[test]
fn an_unresolvable_host_is_refused_naming_the_pod() {
    let scratch = Scratch::new("unresolvable");
    let file = scratch.deployment(&user_deployment(
        json!([{"id": "vllm-0", "address": "10.0.0.1:8000"}, {"id": "vllm-1", "address": "no-such-pod.invalid:8000"}]),
        &wasm_path(),
    ));
    let error = refusal(&kvroute_config(&[], &file));
    assert!(
        error.contains(
            r#"kvroute.pods[1].address (pod "vllm-1"): cannot resolve "no-such-pod.invalid:8000""#
        ),
        "{error}"
    );
}

#[test]
fn istio_refuses_static_pods_naming_the_field() {
    let scratch = Scratch::new("istio-pods");
    let mut deployment = user_deployment(
        json!([{"id": "vllm-0", "address": "10.0.0.10:8000"}]),
        &wasm_path(),
    );
    deployment["istio"] =
        json!({"namespace": "inference", "service": {"name": "vllm", "port": 8000}});
    let error = refusal(&kvroute_config(
        &["--istio"],
        &scratch.deployment(&deployment),
    ));
    assert!(
        error.contains("kvroute.pods: not on Istio (the pods are the members of outbound|8000||vllm.inference.svc.cluster.local)"),
        "{error}"
    );
}

/// A deployment whose pods are the members of a `cluster` section.
fn cluster_deployment(cluster: Value) -> Value {
    json!({
        "kvroute": {"models": {"llama": {"baseModel": "llama"}}},
        "cluster": cluster,
        "envoy": {"wasm": wasm_path(), "listenPort": free_port(), "adminPort": free_port()},
    })
}

#[test]
fn a_cluster_section_becomes_the_pods_cluster_and_kvroutes_membership() {
    let scratch = Scratch::new("cluster");
    let mut deployment = cluster_deployment(
        json!({"dns": ["vllm.default.svc:8000", "vllm-b.default.svc:8000"], "reportPort": 8100, "metricsPort": 8000}),
    );
    let admin_port = deployment["envoy"]["adminPort"].clone();
    let bootstrap = stdout(&kvroute_config(&[], &scratch.deployment(&deployment)));
    assert_eq!(
        embedded_plugin(&bootstrap)["membership"],
        json!({"cluster": "kvroute_pods", "adminCluster": "kvroute_admin", "reportPort": 8100, "metricsPort": 8000})
    );
    let parsed: Value = serde_yaml::from_str(&bootstrap).unwrap();
    let clusters = parsed["static_resources"]["clusters"].as_array().unwrap();
    let cluster = |name: &str| {
        clusters
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no {name}"))
    };
    let pods = cluster("kvroute_pods");
    assert_eq!(pods["type"], "STRICT_DNS");
    let endpoint = |i: usize| {
        &pods["load_assignment"]["endpoints"][0]["lb_endpoints"][i]["endpoint"]["address"]
            ["socket_address"]
    };
    assert_eq!(
        endpoint(0)["address"],
        "vllm.default.svc",
        "not resolved here"
    );
    assert_eq!(endpoint(1)["address"], "vllm-b.default.svc");
    assert!(pods["load_balancing_policy"].is_object(), "override-host");
    let admin = &cluster("kvroute_admin")["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
        ["endpoint"]["address"]["socket_address"];
    assert_eq!(admin["address"], "127.0.0.1");
    assert_eq!(admin["port_value"], admin_port);
    // No static addresses for other paths: the pods' cluster balances them.
    assert!(clusters.iter().all(|c| c["name"] != "kvroute_passthrough"));
    let routes = &parsed["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["route_config"]["virtual_hosts"][0]["routes"];
    assert_eq!(routes[2]["route"]["cluster"], "kvroute_pods");

    deployment["cluster"] = json!({"eds": {"path": "eds/pods.yaml"}});
    let bootstrap = stdout(&kvroute_config(&[], &scratch.deployment(&deployment)));
    let parsed: Value = serde_yaml::from_str(&bootstrap).unwrap();
    let pods = &parsed["static_resources"]["clusters"][0];
    assert_eq!(pods["type"], "EDS");
    assert!(pods.get("load_assignment").is_none(), "{pods}");
    let eds = scratch.0.canonicalize().unwrap().join("eds/pods.yaml");
    assert_eq!(
        pods["eds_cluster_config"]["eds_config"]["path_config_source"]["path"],
        eds.display().to_string(),
        "relative to the deployment file, absolute"
    );
    assert_eq!(parsed["node"]["id"], "kvroute", "EDS needs a node");
}

#[test]
fn cluster_errors_name_the_field() {
    let scratch = Scratch::new("cluster-errors");
    let refused = |deployment: Value, expected: &str| {
        let error = refusal(&kvroute_config(&[], &scratch.deployment(&deployment)));
        assert!(error.contains(expected), "expected {expected:?}: {error}");
    };
    refused(
        cluster_deployment(json!({})),
        "cluster: needs `dns` (a list of host:port) or `eds`",
    );
    refused(
        cluster_deployment(json!({"dns": ["a:1"], "eds": {"path": "x"}})),
        "cluster: `dns` or `eds`, not both",
    );
    refused(
        cluster_deployment(json!({"dns": []})),
        "cluster.dns: must name at least one host:port",
    );
    refused(
        cluster_deployment(json!({"dns": ["vllm:8000", "vllm"]})),
        "cluster.dns[1]: ",
    );
    refused(
        cluster_deployment(json!({"dns": ["vllm:8000"], "reportPort": 0})),
        "cluster.reportPort: must be a port 1-65535",
    );
    refused(
        cluster_deployment(json!({"dsn": ["vllm:8000"]})),
        "unknown field `dsn`",
    );
    let mut with_pods = cluster_deployment(json!({"dns": ["vllm:8000"]}));
    with_pods["kvroute"]["pods"] = json!([{"id": "vllm-0", "address": "10.0.0.1:8000"}]);
    refused(
        with_pods,
        "kvroute.pods: not with `cluster` (the pods are the members of kvroute_pods)",
    );
    let mut original_dst = cluster_deployment(json!({"dns": ["vllm:8000"]}));
    original_dst["kvroute"]["upstreamMode"] = json!("originalDst");
    refused(
        original_dst,
        "kvroute.upstreamMode: must be \"overrideHost\" with `cluster`",
    );
    let mut membership = user_deployment(json!([]), &wasm_path());
    membership["kvroute"] = json!({"membership": {"cluster": "kvroute_pods"}});
    refused(
        membership,
        "kvroute.membership: set the deployment's `cluster` instead",
    );
}

#[test]
fn plugin_errors_name_the_field() {
    let scratch = Scratch::new("plugin-error");
    let mut deployment = user_deployment(
        json!([{"id": "vllm-0", "address": "10.0.0.1:8000"}]),
        &wasm_path(),
    );
    deployment["kvroute"]["cachWeight"] = json!(0.5);
    let error = refusal(&kvroute_config(&[], &scratch.deployment(&deployment)));
    assert!(
        error.contains("kvroute: invalid kvroute configuration: `cachWeight` is rejected"),
        "{error}"
    );
    let mut deployment = user_deployment(
        json!([{"id": "vllm-0", "address": "10.0.0.1:8000"}]),
        &wasm_path(),
    );
    deployment["envoy"]["listenPrt"] = json!(80);
    let error = refusal(&kvroute_config(&[], &scratch.deployment(&deployment)));
    assert!(error.contains("unknown field `listenPrt`"), "{error}");
    // Tier credits out of order are refused naming the field; in order
    // they reach the rendered plugin.
    let mut deployment = user_deployment(
        json!([{"id": "vllm-0", "address": "10.0.0.1:8000"}]),
        &wasm_path(),
    );
    deployment["kvroute"]["tierCredits"] = json!({"cpu": 0.5, "disk": 0.8});
    let error = refusal(&kvroute_config(&[], &scratch.deployment(&deployment)));
    assert!(
        error.contains("`tierCredits.disk` must be at most tierCredits.cpu"),
        "{error}"
    );
    deployment["kvroute"]["tierCredits"] = json!({"cpu": 0.95, "disk": 0.3});
    let rendered = stdout(&kvroute_config(&[], &scratch.deployment(&deployment)));
    assert_eq!(
        embedded_plugin(&rendered)["tierCredits"],
        json!({"cpu": 0.95, "disk": 0.3})
    );
}

/// A user's pods in both upstream modes, and a `cluster` section's DNS and
/// EDS pods, as Envoy 1.40 checks them.
#[test]
fn envoy_validates_the_rendering_of_a_users_pods() {
    let scratch = Scratch::new("validate");
    let mut cases = Vec::new();
    for mode in ["overrideHost", "originalDst"] {
        let mut deployment = user_deployment(
            json!([{"id": "vllm-0", "address": "10.0.0.10:8000"}, {"id": "vllm-1", "address": "[fd00::11]:8000"}]),
            &wasm_path(),
        );
        deployment["kvroute"]["upstreamMode"] = json!(mode);
        cases.push((mode, deployment));
    }
    cases.push((
        "dns",
        cluster_deployment(json!({"dns": ["localhost:8000"], "reportPort": 8100})),
    ));
    // Envoy refuses a missing EDS file, even when validating.
    write_eds(&scratch.0.join("eds.json"), &["10.0.0.10:8000".into()]).unwrap();
    cases.push((
        "eds",
        cluster_deployment(json!({"eds": {"path": "eds.json"}})),
    ));
    for (case, mut deployment) in cases {
        deployment["envoy"]["listenAddress"] = json!("0.0.0.0");
        let bootstrap = stdout(&kvroute_config(&[], &scratch.deployment(&deployment)));
        let config = scratch.0.join("envoy.yaml");
        std::fs::write(&config, &bootstrap).unwrap();
        let (valid, log) = validate_envoy_config(&config);
        assert!(valid, "{case}: {log}");
    }
}

#[test]
fn envoy_started_from_the_output_routes_to_a_sim_pod() {
    let scratch = Scratch::new("route");
    let port = free_port();
    // The deployment names the pod by host name; the sim, which hashes
    // like the router, reads the same plugin JSON with the IP kvroute
    // parses (it takes no host names with override-host).
    let plugin = |address: String| {
        json!({
            "podReportIntervalMs": 200,
            "decisionHeaders": true,
            "pods": [{"id": "pod-0", "address": address}],
        })
    };
    let sim_config = scratch.0.join("kvroute.json");
    std::fs::write(&sim_config, plugin(format!("127.0.0.1:{port}")).to_string()).unwrap();
    let sim = start_sim_in_process(&sim_config, "pod-0", port);
    let (listen, admin) = (free_port(), free_port());
    let file = scratch.deployment(&json!({
        "kvroute": plugin(format!("localhost:{port}")),
        "envoy": {"wasm": wasm_path(), "listenAddress": "127.0.0.1", "listenPort": listen, "adminPort": admin},
    }));
    let bootstrap = stdout(&kvroute_config(&[], &file));
    let envoy = Envoy::start(&scratch.0, &bootstrap, listen, admin).expect("envoy starts");
    // Until the report service's first publication kvroute answers 503.
    let body =
        json!({"model": "sim-model", "prompt": "hello from kvroute-config", "max_tokens": 4});
    let deadline = Instant::now() + Duration::from_secs(20);
    let response = loop {
        let response = http::post_json(&envoy.listen, "/v1/completions", &body.to_string())
            .expect("request through envoy");
        if response.status == 200 || Instant::now() > deadline {
            break response;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(response.status, 200, "{}\n{}", response.body, envoy.log());
    assert_eq!(response.header("x-kvroute-pod"), Some("pod-0"));
    let stats: Value = http::get(&sim, "/admin/stats").unwrap().json().unwrap();
    assert!(stats["requests"].as_u64().unwrap() >= 1, "{stats}");
}

/// Polls `probe` every 50 ms until it answers, at most 20 s.
fn wait_for<T>(what: &str, probe: impl FnMut() -> Option<T>) -> T {
    poll(
        what,
        Duration::from_secs(20),
        Duration::from_millis(50),
        probe,
    )
}

#[test]
fn envoy_started_from_a_dns_cluster_routes_to_its_member_and_reuses_its_cache() {
    let scratch = Scratch::new("dns-route");
    let port = free_port();
    let plugin = json!({"podReportIntervalMs": 200, "decisionHeaders": true});
    let (listen, admin) = (free_port(), free_port());
    let file = scratch.deployment(&json!({
        "kvroute": plugin,
        // Envoy resolves the name; kvroute-config does not.
        "cluster": {"dns": [format!("localhost:{port}")]},
        "envoy": {"wasm": wasm_path(), "listenAddress": "127.0.0.1", "listenPort": listen, "adminPort": admin},
    }));
    let bootstrap = stdout(&kvroute_config(&[], &file));
    // The sim hashes like the router: the rendered plugin JSON, and the id
    // membership gives a member (its resolved IP:port).
    let member = format!("127.0.0.1:{port}");
    let sim_config = scratch.0.join("kvroute.json");
    std::fs::write(&sim_config, embedded_plugin(&bootstrap).to_string()).unwrap();
    let sim = start_sim_in_process(&sim_config, &member, port);
    let envoy = Envoy::start(&scratch.0, &bootstrap, listen, admin).expect("envoy starts");
    let context = filler_text("dns cluster", 8 * 1024);
    let complete = |question: &str| {
        let body = json!({"model": "sim-model", "prompt": format!("{context} {question}"), "max_tokens": 4});
        http::post_json(&envoy.listen, "/v1/completions", &body.to_string())
            .expect("request through envoy")
    };
    // Until the service has read the member and published, kvroute
    // answers 503.
    let first = wait_for("a routed request", || {
        Some(complete("first question")).filter(|r| r.status != 503)
    });
    assert_eq!(first.status, 200, "{}\n{}", first.body, envoy.log());
    assert_eq!(first.header("x-kvroute-pod"), Some(member.as_str()));
    let stats: Value = http::get(&sim, "/admin/stats").unwrap().json().unwrap();
    assert_eq!(stats["requests"], 1, "{stats}");
    // The member's report (pulled at its resolved address) brings the
    // first prompt's 128 blocks into kvroute's index.
    wait_for("the member's report in the index", || {
        envoy
            .metric("epp_prefix_tree_nodes", &[])
            .filter(|&blocks| blocks >= 128.0)
    });
    let second = complete("second question");
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(second.header("x-kvroute-pod"), Some(member.as_str()));
    let matched: f64 = second
        .header("x-kvroute-cache-match")
        .and_then(|m| m.parse().ok())
        .expect("x-kvroute-cache-match");
    assert!(matched > 0.5, "cache match {matched}");
    let stats: Value = http::get(&sim, "/admin/stats").unwrap().json().unwrap();
    assert_eq!(stats["requests"], 2, "{stats}");
}

#[test]
fn the_native_module_is_the_default_and_the_wasm_build_one_flag_away() {
    let scratch = Scratch::new("module");
    let file = scratch.deployment(&user_deployment(
        json!([{"id": "vllm-0", "address": "10.0.0.1:8000"}]),
        &wasm_path(),
    ));
    let native = kvroute_config(&[], &file);
    let bootstrap = stdout(&native);
    assert!(bootstrap.contains("envoy.filters.http.dynamic_modules"));
    assert!(!bootstrap.contains("envoy.filters.http.wasm"));
    assert!(
        !bootstrap.contains("bootstrap_extensions"),
        "no singleton service"
    );
    assert_eq!(embedded_plugin(&bootstrap)["pods"][0]["id"], "vllm-0");
    assert!(String::from_utf8_lossy(&native.stderr).contains("ENVOY_DYNAMIC_MODULES_SEARCH_PATH"));
    let wasm = stdout(&kvroute_config(&["--module", "wasm"], &file));
    assert!(wasm.contains("envoy.filters.http.wasm"));
    assert!(wasm.contains("envoy.bootstrap.wasm"));
    assert!(!wasm.contains("envoy.filters.http.dynamic_modules"));
    assert_eq!(embedded_plugin(&wasm)["pods"][0]["id"], "vllm-0");
}
