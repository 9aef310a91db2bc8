//! The native module against the Envoy binary it targets: Envoy 1.40
//! resolves a module's symbols when it loads it, so a callback Envoy lacks
//! fails the load (and one whose hook Envoy looks up is missing fails the
//! filter config). Both are checked here with `nm`, before any suite runs
//! the module (`make native` builds `target/native/libkvroute.so`).

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use kvroute_integration::harness::{envoy_binary, native_dir};

/// Dynamic symbols of `object`: `defined` ones, or the undefined ones.
fn dynamic_symbols(object: &Path, defined: bool) -> BTreeSet<String> {
    let filter = if defined {
        "--defined-only"
    } else {
        "--undefined-only"
    };
    let output = Command::new("nm")
        .args(["-D", filter])
        .arg(object)
        .output()
        .expect("nm (binutils) runs");
    assert!(
        output.status.success(),
        "nm {}: {}",
        object.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().last().map(String::from))
        .collect()
}

fn module() -> std::path::PathBuf {
    let module = native_dir().join("libkvroute.so");
    assert!(
        module.exists(),
        "{} is missing (run `make native`)",
        module.display()
    );
    module
}

#[test]
fn every_callback_the_module_imports_is_exported_by_envoy() {
    let envoy = envoy_binary().expect("Envoy (make envoy)");
    let imported: BTreeSet<String> = dynamic_symbols(&module(), false)
        .into_iter()
        .filter(|s| s.starts_with("envoy_dynamic_module_callback_"))
        .collect();
    assert!(
        imported.len() > 10,
        "the module imports Envoy's callbacks: {imported:?}"
    );
    let exported = dynamic_symbols(&envoy, true);
    let missing: Vec<&String> = imported.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "callbacks {} does not export: {missing:?}",
        envoy.display()
    );
}

#[test]
fn every_http_filter_hook_envoy_looks_up_is_exported_by_the_module() {
    let envoy = envoy_binary().expect("Envoy (make envoy)");
    let output = Command::new("strings")
        .arg(&envoy)
        .output()
        .expect("strings (binutils) runs");
    let looked_up: BTreeSet<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| {
            l.starts_with("envoy_dynamic_module_on_http_filter")
                || *l == "envoy_dynamic_module_on_program_init"
        })
        .filter(|l| l.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .map(String::from)
        .collect();
    assert!(
        looked_up.len() > 20,
        "Envoy's HTTP filter hooks: {looked_up:?}"
    );
    let exported = dynamic_symbols(&module(), true);
    let missing: Vec<&String> = looked_up.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "hooks Envoy looks up that the module lacks: {missing:?}"
    );
}
