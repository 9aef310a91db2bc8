//! The shipped configuration files stay true: envoy/envoy.yaml is the
//! rendering of envoy/envoy.template.yaml with envoy/kvroute.json, Envoy
//! 1.40 validates it (loading kvroute.wasm and its configuration), and the
//! plugin JSON parses. `KVROUTE_BLESS=1` rewrites envoy/envoy.yaml.

use std::path::Path;
use std::process::Command;

use kvroute_integration::harness::{envoy_binary, render_envoy_config, repo_root};

fn rendered() -> String {
    let root = repo_root();
    let plugin: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("envoy/kvroute.json")).unwrap())
            .unwrap();
    let pods: Vec<String> = plugin["pods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["address"].as_str().unwrap().to_string())
        .collect();
    let wasm = Path::new("target/wasm32-wasip1/release/kvroute.wasm");
    render_envoy_config(wasm, 10000, 9901, &plugin, &pods)
}

#[test]
fn envoy_yaml_is_the_rendered_template() {
    let path = repo_root().join("envoy/envoy.yaml");
    let expected = rendered();
    if std::env::var_os("KVROUTE_BLESS").is_some() {
        std::fs::write(&path, &expected).unwrap();
    }
    let actual = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(actual == expected, "envoy/envoy.yaml is stale: run `KVROUTE_BLESS=1 cargo test -p kvroute-integration --test config_files`");
}

#[test]
fn plugin_json_is_valid() {
    let bytes = std::fs::read(repo_root().join("envoy/kvroute.json")).unwrap();
    let config = kvroute::config::Config::parse(&bytes).expect("envoy/kvroute.json");
    assert_eq!(config.pods.len(), 4);
}

#[test]
fn envoy_validates_the_shipped_config() {
    let output = Command::new(envoy_binary().expect("envoy (make envoy)"))
        .args([
            "--mode",
            "validate",
            "-c",
            "envoy/envoy.yaml",
            "--disable-hot-restart",
            "-l",
            "error",
        ])
        .current_dir(repo_root())
        .output()
        .expect("envoy runs");
    let log = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "envoy --mode validate failed:\n{log}"
    );
    assert!(log.contains("OK"), "{log}");
}
