//! One policy's stack for one run: pods with empty caches (fresh simulated
//! pods, or the real vLLM pods of [`super::engine`] reset) and a router in
//! front of them: Envoy with kvroute (the harness's [`Cluster`]), Envoy
//! with a built-in load balancer (`envoy/baseline.template.yaml`), or a
//! peer router ([`super::peers`]).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::engine::{RunPods, VllmEngine};
use super::peers::{self, Peer};
use super::workload::Workload;
use crate::harness::{
    free_port, wait_pods_published, Bridge, BridgePorts, Cluster, ClusterSpec, Envoy, Sim,
};

/// Policies in report order: kvroute, the peers, Envoy's balancers.
pub const POLICIES: [&str; 11] = [
    "kvroute-precise",
    TIER_BLIND,
    "kvroute-approx",
    "smg-cache-aware",
    "smg-power-of-two",
    "vllm-router-cache-aware",
    "vllm-router-consistent-hash",
    "round-robin",
    "least-request",
    "random",
    "ring-hash",
];

/// kvroute precise crediting a block in any tier as a GPU block
/// (`tierCredits` 1, 1): run only with pods' CPU tiers (`--cpu-tier`).
pub const TIER_BLIND: &str = "kvroute-tier-blind";

/// Envoy's version (`make envoy` pins it).
pub const ENVOY_VERSION: &str = "1.40.0";

/// Report interval of the kvroute runs.
pub const REPORT_INTERVAL_MS: u64 = 200;

/// A running stack; everything stops on drop.
pub enum Stack {
    /// kvroute in Envoy; in stock-vLLM mode, precise with the pods'
    /// bridges.
    Kvroute {
        cluster: Box<Cluster>,
        bridges: Vec<Bridge>,
        /// Replicated gateways: Envoy's round robin spreading each request
        /// over the kvroute Envoys (`--replicas`).
        front: Option<Front>,
        /// Real vLLM pods (the cluster's sims otherwise).
        vllm: Option<RunPods>,
    },
    Baseline {
        pods: RunPods,
        envoy: Envoy,
        dir: PathBuf,
    },
    Peer {
        pods: RunPods,
        router: peers::Running,
        peer: &'static Peer,
        dir: PathBuf,
    },
}

/// The balancer in front of replicated kvroute Envoys.
pub struct Front {
    envoy: Envoy,
    dir: PathBuf,
}

impl Drop for Front {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Stack {
    /// Where clients send requests.
    pub fn listen(&self) -> &str {
        match self {
            Stack::Peer { router, .. } => &router.listen,
            Stack::Kvroute {
                front: Some(front), ..
            } => &front.envoy.listen,
            _ => &self.envoy().expect("an Envoy stack").listen,
        }
    }

    /// The Envoy in front of the pods (`None` for a peer router; the first
    /// replica of a replicated gateway).
    pub fn envoy(&self) -> Option<&Envoy> {
        self.envoys().into_iter().next()
    }

    /// Every Envoy routing to the pods (the replicas of a replicated
    /// gateway; not the balancer in front of them).
    pub fn envoys(&self) -> Vec<&Envoy> {
        match self {
            Stack::Kvroute { cluster, .. } => cluster.replicas().collect(),
            Stack::Baseline { envoy, .. } => vec![envoy],
            Stack::Peer { .. } => Vec::new(),
        }
    }

    /// Each pod's figures since the run started ([`RunPods::stats`]).
    pub fn pod_stats(&self) -> Vec<Value> {
        match self {
            Stack::Kvroute {
                vllm: Some(pods), ..
            }
            | Stack::Baseline { pods, .. }
            | Stack::Peer { pods, .. } => pods.stats(),
            Stack::Kvroute { cluster, .. } => cluster.sims.iter().map(Sim::stats).collect(),
        }
    }

    /// The first pod's address.
    pub fn first_pod(&self) -> String {
        match self {
            Stack::Kvroute {
                vllm: None,
                cluster,
                ..
            } => cluster.sims[0].address.clone(),
            Stack::Kvroute {
                vllm: Some(pods), ..
            }
            | Stack::Baseline { pods, .. }
            | Stack::Peer { pods, .. } => pods.addresses()[0].clone(),
        }
    }

    /// The router's processes (the Envoys or the peer), whose CPU time is
    /// counted.
    pub fn router_pids(&self) -> Vec<u32> {
        match self {
            Stack::Peer { router, .. } => vec![router.pid()],
            _ => self.envoys().iter().map(|e| e.pid()).collect(),
        }
    }

    /// The router's log (Envoy's, with kvroute's decisions, or the peer's).
    pub fn log_path(&self) -> &Path {
        match self {
            Stack::Peer { router, .. } => &router.log_path,
            _ => &self.envoy().expect("an Envoy stack").log_path,
        }
    }

    /// The router's name, version and flags, for the results.
    pub fn router(&self) -> Value {
        match self {
            Stack::Peer { router, peer, .. } => router.describe(peer),
            _ => json!({
                "router": "envoy",
                "version": ENVOY_VERSION,
                "command": "envoy --concurrency 2 --disable-hot-restart -l warning --component-log-level wasm:info,dynamic_modules:info",
                "path": "client → Envoy → pods",
                "kvrouteBuild": crate::harness::module_name(),
            }),
        }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if let Stack::Baseline { dir, .. } | Stack::Peer { dir, .. } = self {
            let _ = fs::remove_dir_all(dir);
        }
    }
}

/// Flags of every sim of `workload`: in stock-vLLM mode, tokenizing as
/// vLLM does and, like stock vLLM, serving no kvroute report.
pub fn sim_args(workload: &Workload) -> Vec<String> {
    let stock_vllm = ["--tokenizer", &workload.tokenizer, "--no-report"];
    let stock_vllm = stock_vllm.iter().filter(|_| workload.stock_vllm);
    stock_vllm
        .map(|s| s.to_string())
        .chain([
            "--time-scale".into(),
            workload.time_scale.to_string(),
            "--kv-blocks".into(),
            workload.kv_blocks.to_string(),
            "--cpu-kv-blocks".into(),
            workload.cpu_kv_blocks.to_string(),
            "--max-batch".into(),
            workload.max_batch.to_string(),
            "--max-loras".into(),
            workload.max_loras.to_string(),
        ])
        .collect()
}

/// The kvroute plugin configuration of `policy` for `workload`.
pub fn kvroute_config(workload: &Workload, policy: &str) -> Value {
    let approximate = policy == "kvroute-approx";
    let mut config = workload.plugin.clone();
    if policy == TIER_BLIND {
        config["tierCredits"] = json!({"cpu": 1.0, "disk": 1.0});
    }
    config["podReportIntervalMs"] = json!(REPORT_INTERVAL_MS);
    config["reportTimeoutMs"] = json!(2 * REPORT_INTERVAL_MS);
    config["decisionHeaders"] = json!(true);
    if approximate {
        config["mode"] = json!("approximate");
        config["podCapacityBlocks"] = json!(workload.kv_blocks);
    }
    config
}

/// Why a stack did not start: a policy that cannot run here (a peer not
/// installed or not starting; its row says why) or a failure of our own.
#[derive(Debug)]
pub enum StartError {
    Unavailable(String),
    Failed(io::Error),
}

impl From<io::Error> for StartError {
    fn from(e: io::Error) -> StartError {
        StartError::Failed(e)
    }
}

/// Starts `policy`'s stack for `workload`, on `vllm`'s pods when given;
/// kvroute as `replicas` Envoys behind a round-robin Envoy when given (1
/// included: the same hop).
pub fn start(
    policy: &str,
    workload: &Workload,
    sim_binary: &Path,
    vllm: Option<&VllmEngine>,
    replicas: Option<usize>,
) -> Result<Stack, StartError> {
    let pod_args = sim_args(workload);
    if let (true, Some(engine)) = (policy.starts_with("kvroute"), vllm) {
        return start_kvroute_on_vllm(policy, workload, sim_binary, engine);
    }
    if policy.starts_with("kvroute") {
        let approximate = policy == "kvroute-approx";
        let mut spec = ClusterSpec::new(workload.pods, kvroute_config(workload, policy));
        spec.sim_args = pod_args;
        spec.replicas = replicas.unwrap_or(1);
        spec.per_pod_args = (0..workload.pods)
            .map(|i| speed_args(workload, i))
            .collect();
        let mut bridges = Vec::new();
        let cluster = if !workload.stock_vllm || approximate {
            Box::new(Cluster::start(sim_binary, spec)?)
        } else {
            // Stock vLLM: reports come from one bridge per pod.
            let ports: Vec<BridgePorts> = (0..workload.pods).map(|_| BridgePorts::free()).collect();
            for (args, ports) in spec.per_pod_args.iter_mut().zip(&ports) {
                args.extend(ports.sim_args());
            }
            spec.report_addresses = ports.iter().map(|p| Some(p.listen.clone())).collect();
            let cluster = Box::new(Cluster::start(sim_binary, spec)?);
            bridges = start_bridges(workload, &cluster, &ports, sim_binary)?;
            cluster
        };
        let front = match replicas {
            Some(_) => {
                let listens: Vec<String> = cluster.replicas().map(|e| e.listen.clone()).collect();
                Some(start_front(&listens)?)
            }
            None => None,
        };
        return Ok(Stack::Kvroute {
            cluster,
            bridges,
            front,
            vllm: None,
        });
    }
    let peer = peers::peer(policy);
    let lb = lb_policy(policy);
    if peer.is_none() && lb.is_none() {
        return Err(io::Error::other(format!("unknown policy {policy:?}")).into());
    }
    let dir = std::env::temp_dir().join(format!(
        "kvroute-bench-{}-{}",
        std::process::id(),
        free_port()
    ));
    fs::create_dir_all(&dir)?;
    let pods = match vllm {
        Some(engine) => RunPods::vllm(engine, workload)?,
        None => RunPods::Sims(start_pods(workload, sim_binary, &dir, &pod_args)?),
    };
    let addresses = pods.addresses();
    if let Some(peer) = peer {
        let model = workload
            .requests
            .first()
            .and_then(|r| serde_json::from_str::<Value>(&r.body).ok())
            .and_then(|b| b["model"].as_str().map(String::from))
            .unwrap_or_else(|| "sim-model".into());
        let router = match peers::start(peer, &addresses, &model, &dir) {
            Ok(router) => router,
            Err(reason) => {
                let _ = fs::remove_dir_all(&dir);
                return Err(StartError::Unavailable(reason));
            }
        };
        // The readiness probe's request is not part of the run.
        pods.reset_stats();
        return Ok(Stack::Peer {
            pods,
            router,
            peer,
            dir,
        });
    }
    let (listen, admin) = (free_port(), free_port());
    let yaml = render_baseline(lb.expect("a baseline"), listen, admin, &addresses);
    let envoy = Envoy::start(&dir, &yaml, listen, admin)?;
    Ok(Stack::Baseline { pods, envoy, dir })
}

/// kvroute in Envoy on the engine's real vLLM pods: precise through one
/// kvroute-vllm-bridge per pod (the binary next to `sim_binary`, decoding
/// with the model's tokenizer), approximate on its own decisions.
fn start_kvroute_on_vllm(
    policy: &str,
    workload: &Workload,
    sim_binary: &Path,
    engine: &VllmEngine,
) -> Result<Stack, StartError> {
    let pods = RunPods::vllm(engine, workload)?;
    let precise = policy != "kvroute-approx";
    let mut config = kvroute_config(workload, policy);
    // A pod's load and queue come from vLLM's own metrics, as docs/vllm.md
    // sets them up (the bridge reports only the cache).
    config["metricsPath"] = json!(crate::vllm::METRICS_PATH);
    if !precise {
        config["podCapacityBlocks"] = json!(super::engine::vllm_blocks(workload));
    }
    let ports: Vec<BridgePorts> = pods
        .vllm_pods()
        .iter()
        .map(|pod| BridgePorts {
            events: pod.events.clone(),
            replay: pod.replay.clone(),
            listen: format!("127.0.0.1:{}", free_port()),
        })
        .collect();
    let mut spec = ClusterSpec::new(0, config);
    spec.extra_pods = pods
        .vllm_pods()
        .iter()
        .zip(&ports)
        .map(|(pod, ports)| {
            let mut entry = json!({"id": pod.id, "address": pod.address});
            if precise {
                entry["reportAddress"] = json!(ports.listen);
            }
            entry
        })
        .collect();
    let cluster = Box::new(Cluster::start(sim_binary, spec)?);
    let mut bridges = Vec::new();
    if precise {
        let bridge_binary = sim_binary.with_file_name("kvroute-vllm-bridge");
        let config_file = cluster.dir.join("kvroute.json");
        let flags = [
            "--topic".to_string(),
            "kv".into(),
            "--tokenizer".into(),
            workload.tokenizer.clone(),
        ];
        for (pod, ports) in pods.vllm_pods().iter().zip(&ports) {
            let flags = [flags.as_slice(), &vllm_metrics_flag(&pod.address)].concat();
            bridges.push(Bridge::start(
                &bridge_binary,
                &pod.id,
                ports,
                &config_file,
                super::engine::WORKLOAD_MODEL,
                &flags,
            )?);
        }
    }
    let ids: Vec<&str> = pods.vllm_pods().iter().map(|p| p.id.as_str()).collect();
    wait_pods_published(&cluster.envoy, &ids, std::time::Duration::from_secs(30))?;
    pods.reset_stats();
    Ok(Stack::Kvroute {
        cluster,
        bridges,
        front: None,
        vllm: Some(pods),
    })
}

/// Envoy's round robin over `replicas` (their listeners): each request to
/// the next replica, as a Kubernetes Service or a cloud balancer spreads
/// connections' requests.
fn start_front(replicas: &[String]) -> io::Result<Front> {
    let dir = std::env::temp_dir().join(format!(
        "kvroute-bench-front-{}-{}",
        std::process::id(),
        free_port()
    ));
    fs::create_dir_all(&dir)?;
    let (listen, admin) = (free_port(), free_port());
    let yaml = render_baseline("ROUND_ROBIN", listen, admin, replicas);
    let envoy = Envoy::start(&dir, &yaml, listen, admin)?;
    Ok(Front { envoy, dir })
}

/// The bridge's flag naming the metrics page of the pod at `address`,
/// where it reads the pod's cache size.
fn vllm_metrics_flag(address: &str) -> [String; 2] {
    ["--vllm-metrics".into(), format!("http://{address}/metrics")]
}

/// One kvroute-vllm-bridge per pod of `cluster` (the binary next to
/// `sim_binary`), decoding tokens with the sims' vocabulary (written by
/// `kvroute-sim --write-tokenizer-json`).
fn start_bridges(
    workload: &Workload,
    cluster: &Cluster,
    ports: &[BridgePorts],
    sim_binary: &Path,
) -> io::Result<Vec<Bridge>> {
    let bridge_binary = sim_binary.with_file_name("kvroute-vllm-bridge");
    let vocabulary = cluster.dir.join("tokenizer.json");
    let written = std::process::Command::new(sim_binary)
        .args(["--tokenizer", &workload.tokenizer, "--write-tokenizer-json"])
        .arg(&vocabulary)
        .status()?;
    if !written.success() {
        return Err(io::Error::other(
            "kvroute-sim could not write tokenizer.json",
        ));
    }
    let base_model = workload.plugin["models"]
        .as_object()
        .and_then(|models| models.values().next())
        .and_then(|model| model["baseModel"].as_str())
        .unwrap_or("sim-model")
        .to_string();
    let config_file = cluster.dir.join("kvroute.json");
    let tokenizer = ["--tokenizer".to_string(), vocabulary.display().to_string()];
    ports
        .iter()
        .zip(&cluster.sims)
        .map(|(ports, sim)| {
            let flags = [tokenizer.as_slice(), &vllm_metrics_flag(&sim.address)].concat();
            Bridge::start(
                &bridge_binary,
                &sim.id,
                ports,
                &config_file,
                &base_model,
                &flags,
            )
        })
        .collect()
}

/// `workload.pods` fresh sims, hashing with the workload's configuration.
fn start_pods(
    workload: &Workload,
    sim_binary: &Path,
    dir: &Path,
    args: &[String],
) -> io::Result<Vec<Sim>> {
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
    ports
        .iter()
        .enumerate()
        .map(|(i, port)| {
            let mut args = args.to_vec();
            args.extend(speed_args(workload, i));
            Sim::start_on(sim_binary, &format!("pod-{i}"), *port, &config_file, &args)
        })
        .collect()
}

/// Pod `pod`'s `--prefill-speed`, in a mixed pool ([`Workload::prefill_speeds`]).
fn speed_args(workload: &Workload, pod: usize) -> Vec<String> {
    workload
        .prefill_speeds
        .get(pod)
        .map(|speed| vec!["--prefill-speed".into(), speed.to_string()])
        .unwrap_or_default()
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
