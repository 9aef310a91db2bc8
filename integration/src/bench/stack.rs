//! One policy's stack for one run: fresh simulated pods (empty caches) and
//! an Envoy in front of them, either kvroute (the harness's
//! [`Cluster`]) or a built-in load balancer (`envoy/baseline.template.yaml`).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::workload::Workload;
use crate::harness::{free_port, Cluster, ClusterSpec, Envoy, Sim};

/// Policies in report order.
pub const POLICIES: [&str; 6] = [
    "kvroute-precise",
    "kvroute-approx",
    "round-robin",
    "least-request",
    "random",
    "ring-hash",
];

/// Report interval of the kvroute runs.
pub const REPORT_INTERVAL_MS: u64 = 200;

/// A running stack; everything stops on drop.
pub enum Stack {
    Kvroute(Box<Cluster>),
    Baseline {
        sims: Vec<Sim>,
        envoy: Envoy,
        dir: PathBuf,
    },
}

impl Stack {
    pub fn listen(&self) -> &str {
        &self.envoy().listen
    }

    pub fn envoy(&self) -> &Envoy {
        match self {
            Stack::Kvroute(c) => &c.envoy,
            Stack::Baseline { envoy, .. } => envoy,
        }
    }

    pub fn sims(&self) -> &[Sim] {
        match self {
            Stack::Kvroute(c) => &c.sims,
            Stack::Baseline { sims, .. } => sims,
        }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if let Stack::Baseline { dir, .. } = self {
            let _ = fs::remove_dir_all(dir);
        }
    }
}

/// Flags of every sim of `workload`.
pub fn sim_args(workload: &Workload) -> Vec<String> {
    vec![
        "--time-scale".into(),
        workload.time_scale.to_string(),
        "--kv-blocks".into(),
        workload.kv_blocks.to_string(),
        "--max-batch".into(),
        workload.max_batch.to_string(),
        "--max-loras".into(),
        workload.max_loras.to_string(),
    ]
}

/// The kvroute plugin configuration of `policy` for `workload`.
pub fn kvroute_config(workload: &Workload, approximate: bool) -> Value {
    let mut config = workload.plugin.clone();
    config["podReportIntervalMs"] = json!(REPORT_INTERVAL_MS);
    config["reportTimeoutMs"] = json!(2 * REPORT_INTERVAL_MS);
    config["decisionHeaders"] = json!(true);
    if approximate {
        config["mode"] = json!("approximate");
        config["podCapacityBlocks"] = json!(workload.kv_blocks);
    }
    config
}

/// Starts `policy`'s stack for `workload`.
pub fn start(policy: &str, workload: &Workload, sim_binary: &Path) -> io::Result<Stack> {
    match policy {
        "kvroute-precise" | "kvroute-approx" => {
            let mut spec = ClusterSpec::new(
                workload.pods,
                kvroute_config(workload, policy == "kvroute-approx"),
            );
            spec.sim_args = sim_args(workload);
            Ok(Stack::Kvroute(Box::new(Cluster::start(sim_binary, spec)?)))
        }
        _ => {
            let lb = lb_policy(policy)
                .ok_or_else(|| io::Error::other(format!("unknown policy {policy:?}")))?;
            let dir = std::env::temp_dir().join(format!(
                "kvroute-bench-{}-{}",
                std::process::id(),
                free_port()
            ));
            fs::create_dir_all(&dir)?;
            let ports: Vec<u16> = (0..workload.pods).map(|_| free_port()).collect();
            let mut config = workload.plugin.clone();
            config["pods"] = Value::Array(
                ports
                    .iter()
                    .enumerate()
                    .map(|(i, p)| json!({"id": format!("pod-{i}"), "address": format!("127.0.0.1:{p}")}))
                    .collect(),
            );
            let config_file = dir.join("kvroute.json");
            fs::write(&config_file, config.to_string())?;
            let mut sims = Vec::new();
            for (i, port) in ports.iter().enumerate() {
                sims.push(Sim::start_on(
                    sim_binary,
                    &format!("pod-{i}"),
                    *port,
                    &config_file,
                    &sim_args(workload),
                )?);
            }
            let addresses: Vec<String> = sims.iter().map(|s| s.address.clone()).collect();
            let (listen, admin) = (free_port(), free_port());
            let yaml = render_baseline(lb, listen, admin, &addresses);
            let envoy = Envoy::start(&dir, &yaml, listen, admin)?;
            Ok(Stack::Baseline { sims, envoy, dir })
        }
    }
}

/// Envoy's `lb_policy` for a baseline policy name.
pub fn lb_policy(policy: &str) -> Option<&'static str> {
    Some(match policy {
        "round-robin" => "ROUND_ROBIN",
        "least-request" => "LEAST_REQUEST",
        "random" => "RANDOM",
        "ring-hash" => "RING_HASH",
        _ => return None,
    })
}

/// Fills `envoy/baseline.template.yaml`.
pub fn render_baseline(
    lb_policy: &str,
    listen_port: u16,
    admin_port: u16,
    pods: &[String],
) -> String {
    let template = include_str!("../../../envoy/baseline.template.yaml");
    let endpoints: Vec<String> = pods
        .iter()
        .map(|address| {
            let (host, port) = address.rsplit_once(':').expect("host:port");
            format!("        - endpoint: {{address: {{socket_address: {{address: {host}, port_value: {port}}}}}}}")
        })
        .collect();
    let hash_policy = if lb_policy == "RING_HASH" {
        "                  hash_policy:\n                  - header: {header_name: x-session-id}"
    } else {
        ""
    };
    template
        .replace("{{listen_port}}", &listen_port.to_string())
        .replace("{{admin_port}}", &admin_port.to_string())
        .replace("{{lb_policy}}", lb_policy)
        .replace("{{hash_policy}}", hash_policy)
        .replace("{{endpoints}}", &endpoints.join("\n"))
}
