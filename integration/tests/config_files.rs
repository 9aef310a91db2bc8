//! The shipped configuration files stay true: envoy/envoy.yaml is
//! kvroute-config's rendering of envoy/demo.kvroute.yaml, Envoy 1.40
//! validates that rendering (loading kvroute.wasm and its configuration),
//! and the plugin JSON parses. `KVROUTE_BLESS=1` rewrites envoy/envoy.yaml.

use std::process::Command;

use kvroute_config::{Deployment, Target};
use kvroute_integration::harness::{envoy_binary, repo_root, wasm_path};

fn demo() -> Deployment {
    Deployment::load(&repo_root().join("envoy/demo.kvroute.yaml"), Target::Envoy)
        .expect("envoy/demo.kvroute.yaml loads")
}

#[test]
fn envoy_yaml_is_the_rendered_demo_file() {
    let path = repo_root().join("envoy/envoy.yaml");
    let expected = demo().envoy_bootstrap();
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

/// The demo's rendering with the module where `make wasm` leaves it (the
/// shipped file names the path docker-compose mounts it at).
#[test]
fn envoy_validates_the_rendered_demo_file() {
    let mut deployment = demo();
    deployment.set_wasm(&wasm_path());
    let dir = std::env::temp_dir().join(format!("kvroute-config-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("envoy.yaml");
    std::fs::write(&config, deployment.envoy_bootstrap()).unwrap();
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
        .expect("envoy runs");
    let _ = std::fs::remove_dir_all(&dir);
    let log = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "envoy --mode validate failed:\n{log}"
    );
    assert!(log.contains("OK"), "{log}");
}
