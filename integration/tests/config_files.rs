//! The shipped configuration files stay true: envoy/envoy.yaml is
//! kvroute-config's rendering of envoy/demo.kvroute.yaml, Envoy 1.40
//! validates that rendering (loading the native module and its
//! configuration) and the same with kvroute.wasm, and the plugin JSON
//! parses. `KVROUTE_BLESS=1` rewrites envoy/envoy.yaml.

use kvroute_config::{Deployment, Target};
use kvroute_integration::harness::{
    assert_committed_rendering, repo_root, validate_envoy_config, wasm_path,
};

fn demo() -> Deployment {
    Deployment::load(&repo_root().join("envoy/demo.kvroute.yaml"), Target::Envoy)
        .expect("envoy/demo.kvroute.yaml loads")
}

#[test]
fn envoy_yaml_is_the_rendered_demo_file() {
    assert_committed_rendering(
        "envoy/envoy.yaml",
        &demo().envoy_bootstrap(),
        "-p kvroute-integration --test config_files",
    );
}

#[test]
fn plugin_json_is_valid() {
    let bytes = std::fs::read(repo_root().join("envoy/kvroute.json")).unwrap();
    let config = kvroute::config::Config::parse(&bytes).expect("envoy/kvroute.json");
    assert_eq!(config.pods.len(), 4);
}

/// The demo's rendering, as shipped (the native module, found through
/// `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`, which the harness sets to where
/// `make native` leaves it).
#[test]
fn envoy_validates_the_rendered_demo_file() {
    validates(demo(), "native");
}

/// The demo's rendering with kvroute.wasm where `make wasm` leaves it (the
/// shipped file names the path docker-compose would mount it at).
#[test]
fn envoy_validates_the_rendered_demo_file_with_the_wasm_build() {
    let mut deployment = demo();
    deployment.set_wasm(&wasm_path());
    validates(deployment, "wasm");
}

fn validates(deployment: Deployment, build: &str) {
    let dir = std::env::temp_dir().join(format!(
        "kvroute-config-files-{build}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("envoy.yaml");
    std::fs::write(&config, deployment.envoy_bootstrap()).unwrap();
    let (valid, log) = validate_envoy_config(&config);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(valid, "envoy --mode validate ({build}) failed:\n{log}");
}
