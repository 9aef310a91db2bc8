//! The `kvroute-config` binary: the demo's bootstrap byte for byte, a
//! user's pods (host names resolved, or refused naming the pod), plugin
//! errors naming the field, an absolute wasm path, Envoy validating what it
//! prints, and an Envoy started from its output routing to a kvroute-sim pod.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use clap::Parser;
use kvroute_integration::harness::{envoy_binary, free_port, repo_root, wasm_path, Envoy};
use kvroute_integration::http;
use kvroute_integration::sim::{run, SimOptions};
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

/// The plugin JSON embedded in a rendered bootstrap.
fn embedded_plugin(bootstrap: &str) -> Value {
    let parsed: Value = serde_yaml::from_str(bootstrap).unwrap();
    let value = parsed["bootstrap_extensions"][0]["typed_config"]["config"]["configuration"]
        ["value"]
        .as_str()
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
        "envoy": {"wasm": "build/kvroute.wasm"},
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
fn istio_refuses_host_names_naming_the_pod() {
    let scratch = Scratch::new("istio-host");
    let mut deployment = user_deployment(
        json!([{"id": "vllm-0", "address": "localhost:8000"}]),
        &wasm_path(),
    );
    deployment["istio"] =
        json!({"namespace": "inference", "service": {"name": "vllm", "port": 8000}});
    let error = refusal(&kvroute_config(
        &["--istio"],
        &scratch.deployment(&deployment),
    ));
    assert!(
        error
            .contains(r#"kvroute.pods[0].address (pod "vllm-0"): "localhost:8000" is a host name"#),
        "{error}"
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
}

/// A user's pods in both upstream modes, as Envoy 1.40 checks them.
#[test]
fn envoy_validates_the_rendering_of_a_users_pods() {
    let scratch = Scratch::new("validate");
    for mode in ["overrideHost", "originalDst"] {
        let mut deployment = user_deployment(
            json!([{"id": "vllm-0", "address": "10.0.0.10:8000"}, {"id": "vllm-1", "address": "[fd00::11]:8000"}]),
            &wasm_path(),
        );
        deployment["kvroute"]["upstreamMode"] = json!(mode);
        deployment["envoy"]["listenAddress"] = json!("0.0.0.0");
        let bootstrap = stdout(&kvroute_config(&[], &scratch.deployment(&deployment)));
        let config = scratch.0.join("envoy.yaml");
        std::fs::write(&config, &bootstrap).unwrap();
        let output = Command::new(envoy_binary().expect("envoy (make envoy)"))
            .args([
                "--mode",
                "validate",
                "--disable-hot-restart",
                "-l",
                "error",
                "-c",
            ])
            .arg(&config)
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&output.stdout).to_string()
            + &String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success() && log.contains("OK"),
            "{mode}: {log}"
        );
    }
}

/// Starts a kvroute-sim pod on `port` in this process (its server, on its
/// own runtime; it ends with the test process) and returns its address
/// once it answers `/health`.
fn start_sim(config: &Path, pod_id: &str, port: u16) -> String {
    let options = SimOptions::parse_from([
        "kvroute-sim",
        "--pod-id",
        pod_id,
        "--port",
        &port.to_string(),
        "--time-scale",
        "0.02",
        "--config",
        config.to_str().unwrap(),
    ]);
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(run(options)).expect("sim serves");
    });
    let address = format!("127.0.0.1:{port}");
    assert!(http::wait_ready(
        &address,
        "/health",
        Duration::from_secs(20)
    ));
    address
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
    let sim = start_sim(&sim_config, "pod-0", port);
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
