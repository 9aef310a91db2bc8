//! The cache-aware routers users would pick instead of kvroute, run as more
//! benchmark policies: SGLang Model Gateway (`smg`) and vLLM's router
//! (`vllm-router`), both Rust binaries in PyPI wheels that `make bench`
//! installs, pinned, into the project's `.venv`. Each fronts the same
//! kvroute-sim pods directly (no Envoy in between), with its own defaults;
//! the only flags given are the worker URLs, the policy, the ports
//! (listener and Prometheus, both free ports) and the address 127.0.0.1.
//! `KVROUTE_BENCH_SMG_FLAGS` / `KVROUTE_BENCH_VLLM_ROUTER_FLAGS` append
//! flags (whitespace-separated) for tuning experiments; the command line
//! in the results shows them.
//!
//! vllm-router's `kv_aware` policy is left out: it needs vLLM's ZMQ KV
//! events, which kvroute-sim does not emit. Its `consistent_hash` hashes
//! the `x-session-id` header first (then `x-user-id`, …, the body's
//! `user`, finally the body), so it gets the same key as Envoy's ring hash.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::{free_port, repo_root, Process};
use crate::http;

/// One peer policy: which router, which of its policies.
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    /// Policy name in the benchmark.
    pub policy: &'static str,
    /// PyPI package (and its pinned version, which `make bench` installs).
    pub package: &'static str,
    pub version: &'static str,
    /// The router's own name of the policy (`--policy`).
    pub router_policy: &'static str,
}

/// The peer policies, in report order.
pub const PEERS: [Peer; 4] = [
    Peer {
        policy: "smg-cache-aware",
        package: "smg",
        version: "1.13.0",
        router_policy: "cache_aware",
    },
    Peer {
        policy: "smg-power-of-two",
        package: "smg",
        version: "1.13.0",
        router_policy: "power_of_two",
    },
    Peer {
        policy: "vllm-router-cache-aware",
        package: "vllm-router",
        version: "0.1.17",
        router_policy: "cache_aware",
    },
    Peer {
        policy: "vllm-router-consistent-hash",
        package: "vllm-router",
        version: "0.1.17",
        router_policy: "consistent_hash",
    },
];

/// The defaults each router runs with, as its `--help` states them.
pub fn defaults(package: &str) -> &'static str {
    match package {
        "smg" => {
            "cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5, \
                  max_tree_size 67,108,864 chars, eviction every 60 s, worker warm-up 60 s \
                  (share 0.25), selection accounting TTL 0 (off), overlap decay 0, \
                  power_of_two load metric expected_wait, load monitor every 10 s, \
                  worker overload protection on (8 waiting, 0.8 KV usage), retries 5, \
                  health checks every 60 s"
        }
        "vllm-router" => {
            "cache_threshold 0.3, balance_abs_threshold 64, \
                          balance_rel_threshold 1.5, max_tree_size 33,554,432 chars per \
                          worker, eviction every 120 s, consistent_hash key: x-session-id \
                          header first, queue 100, health checks every 60 s"
        }
        _ => "",
    }
}

/// The peer named `policy`.
pub fn peer(policy: &str) -> Option<&'static Peer> {
    PEERS.iter().find(|p| p.policy == policy)
}

/// The router's executable in `.venv/bin`.
fn binary(peer: &Peer) -> PathBuf {
    repo_root().join(".venv/bin").join(peer.package)
}

/// The version pip installed into `.venv` (from its `.dist-info` folder).
pub fn installed_version(package: &str) -> Option<String> {
    let prefix = format!("{}-", package.replace('-', "_"));
    for lib in fs::read_dir(repo_root().join(".venv/lib")).ok()?.flatten() {
        for entry in fs::read_dir(lib.path().join("site-packages"))
            .ok()?
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(rest) = name.strip_prefix(&prefix) {
                if let Some(version) = rest.strip_suffix(".dist-info") {
                    return Some(version.to_string());
                }
            }
        }
    }
    None
}

/// A running peer router; stops on drop.
pub struct Running {
    pub listen: String,
    /// The command line it was started with.
    pub command: String,
    pub version: String,
    /// Its stdout and stderr.
    pub log_path: PathBuf,
    process: Process,
}

impl Running {
    pub fn pid(&self) -> u32 {
        self.process.child.id()
    }

    /// The router's version, command line and defaults, for the results.
    pub fn describe(&self, peer: &Peer) -> Value {
        json!({
            "router": peer.package,
            "version": self.version,
            "command": self.command,
            "defaults": defaults(peer.package),
            "path": "client → router → pods (no Envoy)",
        })
    }
}

/// Starts `peer` in front of `pods` (host:port), logging to `dir`; returns
/// once it has answered a one-token completion for `model`. The error says
/// why the peer is unavailable (not installed, wrong version, no start).
pub fn start(peer: &Peer, pods: &[String], model: &str, dir: &Path) -> Result<Running, String> {
    let program = binary(peer);
    if !program.exists() {
        return Err(format!(
            "{} not installed ({} missing; `make bench` installs {}=={})",
            peer.package,
            program.display(),
            peer.package,
            peer.version
        ));
    }
    let version = installed_version(peer.package).unwrap_or_else(|| "unknown".into());
    if version != peer.version {
        return Err(format!(
            "{} {version} installed, the benchmark pins {}",
            peer.package, peer.version
        ));
    }
    let (port, metrics_port) = (free_port(), free_port());
    let mut args: Vec<String> = Vec::new();
    if peer.package == "smg" {
        args.push("launch".into());
    }
    args.push("--worker-urls".into());
    args.extend(pods.iter().map(|p| format!("http://{p}")));
    for (flag, value) in [
        ("--policy", peer.router_policy.to_string()),
        ("--host", "127.0.0.1".into()),
        ("--port", port.to_string()),
        ("--prometheus-port", metrics_port.to_string()),
    ] {
        args.push(flag.into());
        args.push(value);
    }
    let tuning = format!(
        "KVROUTE_BENCH_{}_FLAGS",
        peer.package.to_ascii_uppercase().replace('-', "_")
    );
    if let Ok(extra) = std::env::var(&tuning) {
        args.extend(extra.split_whitespace().map(String::from));
    }
    let log_path = dir.join(format!("{}.log", peer.policy));
    let log = fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    let err_log = log.try_clone().map_err(|e| e.to_string())?;
    let child = Command::new(&program)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err_log)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", program.display()))?;
    let mut running = Running {
        listen: format!("127.0.0.1:{port}"),
        command: std::iter::once(peer.package.to_string())
            .chain(args)
            .collect::<Vec<_>>()
            .join(" "),
        version,
        log_path: log_path.clone(),
        process: Process {
            child,
            name: peer.policy.into(),
        },
    };
    // Ready (both answer `/readiness` once their workers are registered),
    // then a one-token completion of the workload's model.
    let mut deadline = Instant::now() + Duration::from_secs(60);
    let mut last = None;
    let mut ready = false;
    let probe = json!({"model": model, "prompt": "ping", "max_tokens": 1}).to_string();
    while Instant::now() < deadline {
        if let Ok(Some(status)) = running.process.child.try_wait() {
            return Err(format!(
                "{} exited ({status}): {}",
                peer.package,
                log_tail(&log_path)
            ));
        }
        if !ready {
            ready = http::get(&running.listen, "/readiness").is_ok_and(|r| r.status == 200);
            if ready {
                deadline = Instant::now() + Duration::from_secs(15);
            } else {
                std::thread::sleep(Duration::from_millis(100));
            }
            continue;
        }
        match http::post_json(&running.listen, "/v1/completions", &probe) {
            Ok(r) if r.status == 200 => return Ok(running),
            Ok(r) => {
                last = Some(format!(
                    "HTTP {}: {}",
                    r.status,
                    r.body.chars().take(200).collect::<String>()
                ))
            }
            Err(e) => last = Some(e.to_string()),
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Err(match (ready, last) {
        (true, Some(answer)) => format!(
            "{} answers a completion for {model} with {answer}",
            peer.package
        ),
        _ => format!(
            "{} not ready in 60 s: {}",
            peer.package,
            log_tail(&log_path)
        ),
    })
}

/// The last lines of a log, ANSI colours stripped, on one line.
fn log_tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(3)..].join(" | ");
    let mut plain = String::with_capacity(tail.len());
    let mut chars = tail.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    plain.chars().take(400).collect()
}
