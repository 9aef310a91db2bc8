//! The operations artifacts in `envoy/observability/` against a real
//! Prometheus scraping a real Envoy running kvroute.
//!
//! 1. `promtool check rules` / `promtool test rules` on the alert rules and
//!    their unit tests.
//! 2. A cluster (4 simulated pods, Envoy + kvroute) and a Prometheus
//!    (Debian's `prometheus` package; `KVROUTE_PROMETHEUS` / `KVROUTE_PROMTOOL`
//!    override the binaries) scraping Envoy's `/stats/prometheus` every
//!    second, with `alerts.yaml` loaded as its rule file.
//! 3. A workload that makes every kvroute series exist *and move* while
//!    Prometheus watches: an adapter load, a silent eviction (stale cache
//!    routing), failing reports on one pod, a pod reporting health 0.2 and
//!    another a queue of 7, multi-turn chat conversations. Each counter is
//!    created before a second event increments it, so `rate()` sees it grow.
//! 4. Every dashboard panel's PromQL (`targets[].expr` in
//!    `grafana-dashboard.json`) and every alert's expression (as loaded by
//!    Prometheus, `/api/v1/rules`) evaluated through `/api/v1/query`:
//!    non-empty, finite, carrying the labels the legend shows, and the values
//!    the workload implies.
//!
//! Grafana variables are substituted as Grafana would: `$__rate_interval` by
//! `1m` (the workload happened within the last minute; the scrape interval
//! is 1 s), `$instance` by the value the dashboard's `instance` variable
//! query (`label_values(epp_pod_health_score, instance)`) returns, escaped
//! as a regex.
//!
//! The test fails (it does not skip) when the Prometheus binaries are
//! missing: `make observability` installs them.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvroute_integration::harness::{
    filler_text as text, free_port, log_component, log_event, repo_root, Cluster, ClusterSpec,
    Process,
};
use kvroute_integration::http;
use serde_json::{json, Value};

const SIM: &str = env!("CARGO_BIN_EXE_kvroute-sim");
const JOB: &str = "kvroute-envoy";
/// What `$__rate_interval` becomes.
const RATE_INTERVAL: &str = "1m";
/// The queue depth one pod reports (must show up in the queue panel).
const QUEUE: f64 = 7.0;
/// The health one pod reports (below the exclusion threshold).
const SICK_HEALTH: f64 = 0.2;

fn observability() -> PathBuf {
    repo_root().join("envoy/observability")
}

/// A Prometheus binary from `$var` or `PATH`; panics with the fix if absent.
fn binary(name: &str, var: &str) -> PathBuf {
    if let Ok(path) = std::env::var(var) {
        return PathBuf::from(path);
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "`{name}` not found on PATH (nor ${var}): this test needs a real Prometheus. \
             Install it with `make observability` (apt-get install -y prometheus)."
        )
    })
}

fn run(program: &Path, args: &[&str], dir: &Path) -> String {
    let output = Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", program.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "{} {args:?} failed:\n{text}",
        program.display()
    );
    text
}

/// A Prometheus server in a temp dir, killed (and its dir removed) on drop.
struct Prometheus {
    address: String,
    dir: PathBuf,
    process: Option<Process>,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        drop(self.process.take());
        if std::thread::panicking() {
            let log = fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default();
            eprintln!("--- prometheus log ---\n{log}");
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Prometheus {
    /// Scrapes `envoy_admin`'s `/stats/prometheus` every second and loads
    /// `alerts.yaml`, evaluated every second.
    fn start(promtool: &Path, envoy_admin: &str) -> Prometheus {
        let dir = std::env::temp_dir().join(format!(
            "kvroute-prometheus-{}-{}",
            std::process::id(),
            free_port()
        ));
        fs::create_dir_all(dir.join("data")).unwrap();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n- {rules}\n\
             scrape_configs:\n- job_name: {JOB}\n  metrics_path: /stats/prometheus\n  \
             static_configs:\n  - targets: ['{envoy_admin}']\n",
            rules = observability().join("alerts.yaml").display()
        );
        let config_path = dir.join("prometheus.yml");
        fs::write(&config_path, config).unwrap();
        run(
            promtool,
            &["check", "config", config_path.to_str().unwrap()],
            &dir,
        );
        let address = format!("127.0.0.1:{}", free_port());
        let log = fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new(binary("prometheus", "KVROUTE_PROMETHEUS"))
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={address}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        let prometheus = Prometheus {
            address,
            dir,
            process: Some(Process {
                child,
                name: "prometheus".into(),
            }),
        };
        assert!(
            http::wait_ready(&prometheus.address, "/-/ready", Duration::from_secs(30)),
            "prometheus not ready in 30 s"
        );
        prometheus
    }

    /// `POST /api/v1/query` (instant, now); panics unless `success`.
    fn query(&self, promql: &str) -> Value {
        let body = format!("query={}", form_encode(promql));
        let response = http::request(
            &self.address,
            "POST",
            "/api/v1/query",
            &[("content-type", "application/x-www-form-urlencoded")],
            Some(body.as_bytes()),
            http::DEFAULT_TIMEOUT,
        )
        .expect("prometheus query");
        let parsed: Value = serde_json::from_str(&response.body).unwrap_or(Value::Null);
        assert_eq!(
            parsed["status"], "success",
            "query {promql:?} answered {}: {}",
            response.status, response.body
        );
        parsed["data"].clone()
    }

    /// The instant vector `promql` returns (panics on another result type).
    fn vector(&self, promql: &str) -> Vec<Sample> {
        let data = self.query(promql);
        assert_eq!(data["resultType"], "vector", "{promql}: {data}");
        data["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| Sample {
                labels: s["metric"].clone(),
                value: s["value"][1].as_str().unwrap().parse().unwrap(),
            })
            .collect()
    }

    /// `GET path` as JSON `data`.
    fn get(&self, path: &str) -> Value {
        let response = http::get(&self.address, path).expect("prometheus api");
        let parsed: Value = serde_json::from_str(&response.body).unwrap_or(Value::Null);
        assert_eq!(parsed["status"], "success", "{path}: {}", response.body);
        parsed["data"].clone()
    }

    /// Polls `promql` until it returns a sample satisfying `done`.
    fn wait_for(&self, promql: &str, timeout: Duration, done: impl Fn(f64) -> bool) {
        let deadline = Instant::now() + timeout;
        loop {
            if self.vector(promql).iter().any(|s| done(s.value)) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{promql} never satisfied the condition in {timeout:?}: {:?}",
                self.vector(promql)
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

#[derive(Debug, Clone)]
struct Sample {
    labels: Value,
    value: f64,
}

impl Sample {
    fn label(&self, name: &str) -> &str {
        self.labels[name].as_str().unwrap_or("")
    }
}

fn form_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `{pod="pod-0"} 7, ...` without the scrape's `instance` and `job`.
fn show(samples: &[Sample]) -> String {
    if samples.is_empty() {
        return "(empty)".into();
    }
    samples
        .iter()
        .map(|s| {
            let labels: Vec<String> = s
                .labels
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(k, _)| *k != "instance" && *k != "job")
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            format!("{{{}}} {:.4}", labels.join(","), s.value)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The value of the sample labelled `label=value`.
fn value_of(samples: &[Sample], label: &str, value: &str) -> Option<f64> {
    samples
        .iter()
        .find(|s| s.label(label) == value)
        .map(|s| s.value)
}

fn label_values(samples: &[Sample], label: &str) -> BTreeSet<String> {
    samples.iter().map(|s| s.label(label).to_string()).collect()
}

/// The `{{label}}` names a legend format uses.
fn legend_labels(legend: &str) -> Vec<String> {
    legend
        .split("{{")
        .skip(1)
        .filter_map(|rest| rest.split_once("}}"))
        .map(|(name, _)| name.trim().to_string())
        .collect()
}

/// Splits `expr` at its top-level comparison (`inner > 16` -> (`inner`,
/// `> 16`)): outside parentheses, brackets, braces and strings, the last
/// comparison operator.
fn split_comparison(expr: &str) -> Option<(String, String)> {
    let bytes = expr.as_bytes();
    let (mut depth, mut quote, mut split) = (0i32, None::<u8>, None);
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        match quote {
            Some(_) if c == b'\\' => i += 1,
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None => match c {
                b'"' | b'\'' | b'`' => quote = Some(c),
                b'(' | b'[' | b'{' => depth += 1,
                b')' | b']' | b'}' => depth -= 1,
                b'>' | b'<' | b'=' | b'!' if depth == 0 => {
                    let two = bytes.get(i + 1) == Some(&b'=');
                    if c == b'>' || c == b'<' || two {
                        split = Some(i);
                        if two {
                            i += 1;
                        }
                    }
                }
                _ => {}
            },
        }
        i += 1;
    }
    let at = split?;
    Some((expr[..at].trim().to_string(), expr[at..].trim().to_string()))
}

fn chat(messages: &[Value]) -> Value {
    json!({"model": "sim-model", "messages": messages, "max_tokens": 16})
}

/// Sends a completion and returns the pod kvroute chose.
fn complete(cluster: &Cluster, model: &str, prompt: &str) -> (String, http::Response) {
    let r = cluster.post(
        "/v1/completions",
        &json!({"model": model, "prompt": prompt, "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{model}: {}", r.body);
    let pod = r
        .header("x-kvroute-pod")
        .expect("x-kvroute-pod")
        .to_string();
    (pod, r)
}

/// A long prompt served once, its pod told to evict everything without
/// reporting it, and the prompt sent again: one stale cache prediction.
fn stale_routing(cluster: &Cluster, seed: &str) -> String {
    let prefix = text(seed, 8192);
    let (holder, _) = complete(cluster, "sim-model", &format!("{prefix} 0"));
    cluster.wait_reports(2);
    cluster.sims[cluster.pod_index(&holder)].fault(json!({"evictAll": true, "silent": true}));
    let (again, r) = complete(cluster, "sim-model", &format!("{prefix} 1"));
    assert_eq!(again, holder, "the router still believes {holder} holds it");
    let cached = r.json().unwrap()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert_eq!(cached.unwrap_or(0), 0, "the pod had evicted the prefix");
    holder
}

/// What the workload did, for the assertions.
struct Workload {
    /// Reports health `SICK_HEALTH`; it loaded `billing-lora` first.
    sick: String,
    /// Its reports failed for a while.
    failing: String,
    /// Reports a queue of `QUEUE`.
    queued: String,
}

fn workload(cluster: &Cluster) -> Workload {
    let pods: Vec<String> = cluster.sims.iter().map(|s| s.id.clone()).collect();
    // Phase 1: create every counter kvroute only exports once used.
    let (sick, _) = complete(cluster, "support-billing", &text("invoice 0", 512));
    stale_routing(cluster, "evicted first");
    let others: Vec<&String> = pods.iter().filter(|p| **p != sick).collect();
    let (failing, queued) = (others[0].clone(), others[1].clone());
    cluster.sims[cluster.pod_index(&failing)].fault(json!({"report": "error"}));
    // Several scrapes see the counters at their first values.
    std::thread::sleep(Duration::from_millis(2500));

    // Phase 2: move them, and shape the pods.
    cluster.sims[cluster.pod_index(&failing)].fault(json!({"report": "ok"}));
    cluster.sims[cluster.pod_index(&sick)].fault(json!({"health": SICK_HEALTH}));
    cluster.sims[cluster.pod_index(&queued)].fault(json!({"queueDepth": QUEUE as u32}));
    cluster.wait_reports(3);
    // The pod holding billing-lora is excluded now: another one loads it.
    let (loader, _) = complete(cluster, "support-billing", &text("invoice 1", 512));
    assert_ne!(loader, sick, "a pod at health {SICK_HEALTH} is excluded");
    stale_routing(cluster, "evicted second");
    // Multi-turn conversations: later turns find their history cached.
    let system = text("system prompt", 2048);
    let mut histories: Vec<Vec<Value>> = (0..4)
        .map(|c| {
            vec![
                json!({"role": "system", "content": system}),
                json!({"role": "user", "content": text(&format!("user {c} opening"), 1024)}),
            ]
        })
        .collect();
    for turn in 1..=4 {
        for (c, history) in histories.iter_mut().enumerate() {
            let r = cluster.post("/v1/chat/completions", &chat(history));
            assert_eq!(r.status, 200, "{}", r.body);
            let answer = r.json().unwrap()["choices"][0]["message"]["content"].clone();
            history.push(json!({"role": "assistant", "content": answer}));
            history.push(
                json!({"role": "user", "content": text(&format!("user {c} turn {turn}"), 256)}),
            );
        }
        cluster.wait_reports(1);
    }
    // Streamed answers: the TTFT model learns from their first bytes.
    for i in 0..8 {
        let body = json!({"model": "sim-model", "prompt": text(&format!("streamed {i}"), 1024),
                          "max_tokens": 4, "stream": true});
        let r = http::post_sse(&cluster.envoy.listen, "/v1/completions", &body.to_string())
            .expect("a streamed request through envoy");
        assert_eq!(r.status, 200, "streamed request {i}");
    }
    Workload {
        sick,
        failing,
        queued,
    }
}

#[test]
fn dashboard_and_alerts_work_against_real_prometheus() {
    let promtool = binary("promtool", "KVROUTE_PROMTOOL");
    let dir = observability();
    let checked = run(&promtool, &["check", "rules", "alerts.yaml"], &dir);
    println!("{checked}");
    let tested = run(&promtool, &["test", "rules", "alerts.test.yaml"], &dir);
    println!("{tested}");

    let config = json!({
        "podReportIntervalMs": 200,
        "reportTimeoutMs": 400,
        // Debug events are produced, and shown once Envoy's logger of the
        // module (wasm or dynamic_modules) is raised (the Troubleshooting
        // steps).
        "logLevel": "debug",
        // Every answer's cached tokens checked: the stale panel's events.
        "predictionCheckSample": 1,
        "models": {
            "sim-model": {"baseModel": "sim-model"},
            "support-billing": {"baseModel": "sim-model", "adapter": "billing-lora"}
        }
    });
    // Two replicas of the gateway sharing their decisions: Prometheus
    // scrapes the first, the second routes a few requests of its own.
    let mut spec = ClusterSpec::new(4, config);
    spec.replicas = 2;
    let cluster = Cluster::start(SIM.as_ref(), spec).expect("cluster");
    let prometheus = Prometheus::start(&promtool, &cluster.envoy.admin);
    prometheus.wait_for(
        &format!("up{{job=\"{JOB}\"}}"),
        Duration::from_secs(15),
        |v| v == 1.0,
    );

    let work = workload(&cluster);
    // The replica panels: decisions made on the other replica, learnt here.
    let peer = &cluster.other_replicas[0];
    for i in 0..3 {
        let body = json!({"model": "sim-model", "prompt": text(&format!("on the other replica {i}"), 2048), "max_tokens": 2});
        let answer =
            http::post_json(&peer.listen, "/v1/completions", &body.to_string()).expect("post");
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while cluster
        .envoy
        .metric("epp_replica_decisions_received_total", &[])
        .unwrap_or(0.0)
        < 3.0
    {
        assert!(
            Instant::now() < deadline,
            "the scraped replica learnt the other's decisions"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Histograms reach /stats/prometheus on Envoy's 1 s flush, then the 1 s
    // scrape: wait until Prometheus has what Envoy has.
    let decisions = cluster
        .envoy
        .metric("epp_routing_decisions_total", &[])
        .expect("decisions");
    std::thread::sleep(Duration::from_millis(2500));
    prometheus.wait_for(
        "sum(epp_scoring_latency_us_count)",
        Duration::from_secs(10),
        |v| v == decisions,
    );

    // Envoy's own per-cluster latency, which the Troubleshooting section
    // compares with kvroute's scoring latency.
    let upstream = prometheus.vector(
        "histogram_quantile(0.99, sum by (le) (rate(envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name=\"kvroute_pods\"}[1m])))",
    );
    assert_eq!(upstream.len(), 1, "{upstream:?}");

    check_dashboard(&prometheus, &cluster, &work);
    check_alerts(&prometheus, &work);
    check_logs(&cluster);
}

fn check_dashboard(prometheus: &Prometheus, cluster: &Cluster, work: &Workload) {
    let path = observability().join("grafana-dashboard.json");
    let dashboard: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));

    // Importable: the datasource is a variable, used by every panel.
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    let ds = variables
        .iter()
        .find(|v| v["name"] == "DS_PROMETHEUS")
        .expect("DS_PROMETHEUS variable");
    assert_eq!(ds["type"], "datasource");
    assert_eq!(ds["query"], "prometheus");

    // The instance variable: its label_values() query, through the API.
    let instance = variables
        .iter()
        .find(|v| v["name"] == "instance")
        .expect("instance variable");
    let definition = instance["definition"].as_str().unwrap();
    let (metric, label) = definition
        .strip_prefix("label_values(")
        .and_then(|rest| rest.strip_suffix(')'))
        .and_then(|args| args.split_once(','))
        .map(|(m, l)| (m.trim(), l.trim()))
        .unwrap_or_else(|| panic!("unexpected variable query {definition}"));
    let values = prometheus.get(&format!(
        "/api/v1/label/{label}/values?match[]={}",
        form_encode(metric)
    ));
    assert!(
        values
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v == cluster.envoy.admin.as_str()),
        "variable {definition} = {values}, want {}",
        cluster.envoy.admin
    );
    let instance_regex = cluster.envoy.admin.replace('.', "\\\\.");

    let panels = dashboard["panels"].as_array().unwrap();
    let titles: Vec<&str> = panels
        .iter()
        .map(|p| p["title"].as_str().unwrap())
        .collect();
    assert_eq!(
        titles,
        [
            "Cache hit rate distribution",
            "Queue depth per pod",
            "Routing decision rate by model",
            "Composite score distribution",
            "Stale cache rate",
            "Scoring latency p50 / p99",
            "Pod health overview",
            "Adapter load events by adapter",
            "Replica convergence lag p50 / p99",
            "Replica peers",
            "TTFT model error p50 / p90",
            "KV cache fill per pod",
            "KV evictions per pod",
        ]
    );
    let pods: BTreeSet<String> = cluster.sims.iter().map(|s| s.id.clone()).collect();
    for panel in panels {
        let title = panel["title"].as_str().unwrap();
        assert_eq!(
            panel["datasource"]["uid"], "${DS_PROMETHEUS}",
            "{title}: datasource"
        );
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title}: no targets");
        let mut results = Vec::new();
        for target in targets {
            assert_eq!(target["datasource"]["uid"], "${DS_PROMETHEUS}", "{title}");
            let expr = target["expr"].as_str().unwrap();
            let promql = expr
                .replace("$__rate_interval", RATE_INTERVAL)
                .replace("$instance", &instance_regex);
            assert!(
                !promql.contains('$'),
                "{title}: unsubstituted variable in {promql}"
            );
            let samples = prometheus.vector(&promql);
            println!("panel {title:?}: {promql}\n  -> {}", show(&samples));
            assert!(!samples.is_empty(), "{title}: No data for {promql}");
            for sample in &samples {
                assert!(
                    sample.value.is_finite(),
                    "{title}: {promql} gave {sample:?}"
                );
                for label in legend_labels(target["legendFormat"].as_str().unwrap_or("")) {
                    assert!(
                        !sample.label(&label).is_empty(),
                        "{title}: legend label {label} missing in {sample:?}"
                    );
                }
            }
            results.push(samples);
        }
        check_panel(title, &results, &pods, work);
    }
}

/// What each panel must show after the workload.
fn check_panel(title: &str, results: &[Vec<Sample>], pods: &BTreeSet<String>, work: &Workload) {
    let first = &results[0];
    let bucket = |le: &str| value_of(first, "le", le).unwrap_or_else(|| panic!("{title}: le={le}"));
    match title {
        "Cache hit rate distribution" => {
            // Envoy's bucket bounds, cumulative; later turns matched > 50 %.
            assert!(first.len() >= 8, "{title}: {first:?}");
            assert!(bucket("+Inf") > 0.0, "{title}: {first:?}");
            assert!(
                bucket("+Inf") > bucket("50"),
                "{title}: no decision matched over 50 %: {first:?}"
            );
            assert_eq!(bucket("100"), bucket("+Inf"), "{title}: percent units");
        }
        "Composite score distribution" => {
            assert!(first.len() >= 8, "{title}: {first:?}");
            assert!(bucket("+Inf") > 0.0, "{title}: {first:?}");
            assert_eq!(bucket("100"), bucket("+Inf"), "{title}: percent units");
        }
        "Queue depth per pod" => {
            assert_eq!(&label_values(first, "pod"), pods, "{title}");
            assert_eq!(value_of(first, "pod", &work.queued), Some(QUEUE), "{title}");
        }
        "Routing decision rate by model" => {
            let models = label_values(first, "model");
            assert!(
                models.contains("sim-model") && models.contains("support-billing"),
                "{title}: {models:?}"
            );
            assert!(
                value_of(first, "model", "sim-model").unwrap() > 0.0,
                "{title}"
            );
        }
        "Stale cache rate" => {
            assert_eq!(first.len(), 1, "{title}: {first:?}");
            assert!(
                first[0].value > 0.0 && first[0].value < 1.0,
                "{title}: {first:?}"
            );
        }
        "TTFT model error p50 / p90" => {
            let (p50, p90) = (results[0][0].value, results[1][0].value);
            assert!(p50 >= 0.0 && p90 >= p50, "{title}: p50 {p50} p90 {p90}");
        }
        "KV cache fill per pod" => {
            // The sims report their size and use; the workload cached
            // prompts on some pods (not on all: a pod may have taken none).
            assert_eq!(&label_values(first, "pod"), pods, "{title}");
            assert!(
                first.iter().all(|s| (0.0..=1.0).contains(&s.value)),
                "{title}: a share of the cache: {first:?}"
            );
            assert!(first.iter().any(|s| s.value > 0.0), "{title}: {first:?}");
        }
        "KV evictions per pod" => {
            // Observed, regretted and predicted: every pod's series of each.
            for series in results {
                assert_eq!(&label_values(series, "pod"), pods, "{title}");
                assert!(series.iter().all(|s| s.value >= 0.0), "{title}: {series:?}");
            }
        }
        "Scoring latency p50 / p99" => {
            let (p50, p99) = (results[0][0].value, results[1][0].value);
            assert!(p50 > 0.0 && p99 >= p50, "{title}: p50 {p50} p99 {p99}");
        }
        "Pod health overview" => {
            assert_eq!(&label_values(first, "pod"), pods, "{title}");
            assert_eq!(
                value_of(first, "pod", &work.sick),
                Some(SICK_HEALTH * 100.0),
                "{title}: percent units"
            );
            let green = first.iter().filter(|s| s.value > 90.0).count();
            assert!(green >= 2, "{title}: healthy pods are 100: {first:?}");
        }
        "Replica convergence lag p50 / p99" => {
            let (p50, p99) = (results[0][0].value, results[1][0].value);
            assert!(p50 > 0.0 && p99 >= p50, "{title}: p50 {p50} p99 {p99}");
            assert!(p99 < 1000.0, "{title}: within a second: {p99}");
        }
        "Replica peers" => {
            let mut states: Vec<f64> = first.iter().map(|s| s.value).collect();
            states.sort_by(f64::total_cmp);
            assert_eq!(
                states,
                vec![1.0, 3.0],
                "{title}: the other live, itself: {first:?}"
            );
        }
        "Adapter load events by adapter" => {
            let loads = value_of(first, "adapter", "billing-lora");
            assert!(loads.unwrap_or(0.0) > 0.0, "{title}: {first:?}");
        }
        other => panic!("no expectation for panel {other:?}"),
    }
}

fn check_alerts(prometheus: &Prometheus, work: &Workload) {
    let source = fs::read_to_string(observability().join("alerts.yaml")).unwrap();
    let declared: BTreeSet<String> = source
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert:"))
        .map(|name| name.trim().to_string())
        .collect();
    assert_eq!(declared.len(), 9, "{declared:?}");

    // Prometheus loaded them and evaluates them without error.
    let deadline = Instant::now() + Duration::from_secs(10);
    let rules = loop {
        let groups = prometheus.get("/api/v1/rules?type=alert");
        let rules: Vec<Value> = groups["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_array().unwrap().clone())
            .collect();
        if rules.len() == declared.len() && rules.iter().all(|r| r["health"] == "ok") {
            break rules;
        }
        assert!(Instant::now() < deadline, "rules not all ok: {rules:#?}");
        std::thread::sleep(Duration::from_millis(250));
    };
    let loaded: BTreeSet<String> = rules
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(loaded, declared);

    for rule in &rules {
        let name = rule["name"].as_str().unwrap();
        let expr = rule["query"].as_str().unwrap();
        // Healthy data: the whole expression is valid, usually empty.
        let firing = prometheus.vector(expr);
        let (inner, threshold) =
            split_comparison(expr).unwrap_or_else(|| panic!("{name}: no comparison in {expr}"));
        let samples = prometheus.vector(&inner);
        println!(
            "alert {name}: {inner}  [{threshold}]\n  -> {}; over the threshold: {}",
            show(&samples),
            show(&firing)
        );
        assert!(!samples.is_empty(), "{name}: no data for {inner}");
        assert!(
            samples.iter().all(|s| s.value.is_finite()),
            "{name}: {samples:?}"
        );
        match name {
            "KvrouteCacheMatchLow" | "KvrouteScoringLatencyHigh" => {
                assert_eq!(samples.len(), 1, "{name}: one router: {samples:?}");
                assert!(!samples[0].label("instance").is_empty(), "{name}");
                assert!(samples[0].value > 0.0, "{name}: {samples:?}");
            }
            "KvrouteQueueDepthHigh" => {
                assert_eq!(samples.len(), 4, "{name}: {samples:?}");
                assert_eq!(value_of(&samples, "pod", &work.queued), Some(QUEUE));
                assert!(firing.is_empty(), "{name}: {firing:?}");
            }
            "KvrouteStaleCacheRoutingHigh" => {
                assert_eq!(samples.len(), 1, "{name}: {samples:?}");
                assert!(samples[0].value > 0.0, "{name}: {samples:?}");
            }
            "KvrouteSnapshotStale" => {
                // Exported at 0 from startup; the service never stalled.
                assert_eq!(samples.len(), 1, "{name}: one router: {samples:?}");
                assert_eq!(samples[0].value, 0.0, "{name}: {samples:?}");
                assert!(firing.is_empty(), "{name}: {firing:?}");
            }
            "KvroutePodBelowHealthExclusion" => {
                assert_eq!(samples.len(), 4, "{name}: {samples:?}");
                assert!(
                    firing.iter().any(|s| s.label("pod") == work.sick),
                    "{name}: the sick pod is below 30: {firing:?}"
                );
            }
            "KvrouteReplicaPeerFailing" => {
                assert_eq!(samples.len(), 2, "{name}: the peer and itself: {samples:?}");
                assert!(firing.is_empty(), "{name}: {firing:?}");
            }
            "KvrouteReplicaLagHigh" => {
                assert_eq!(samples.len(), 1, "{name}: one router: {samples:?}");
                assert!(samples[0].value > 0.0, "{name}: {samples:?}");
            }
            "KvrouteReportFailuresPersisting" => {
                assert!(
                    value_of(&samples, "pod", &work.failing).unwrap_or(0.0) > 0.0,
                    "{name}: {samples:?}"
                );
                assert!(
                    firing.iter().any(|s| s.label("pod") == work.failing),
                    "{name}: {firing:?}"
                );
            }
            other => panic!("no expectation for alert {other}"),
        }
    }

    // Rule evaluation on real data: the sick pod's alert is pending (its
    // `for:` has not passed yet).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let alerts = prometheus.get("/api/v1/alerts");
        let pending = alerts["alerts"].as_array().unwrap().iter().any(|a| {
            a["labels"]["alertname"] == "KvroutePodBelowHealthExclusion"
                && a["labels"]["pod"] == work.sick.as_str()
                && a["state"] == "pending"
        });
        if pending {
            break;
        }
        assert!(Instant::now() < deadline, "no pending alert: {alerts}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The log events the Troubleshooting section greps for.
fn check_logs(cluster: &Cluster) {
    let log = cluster.envoy.log();
    for needle in [
        "\"event\":\"route\"",
        "\"event\":\"cache_prediction\"",
        "\"stale\":true",
        "\"event\":\"pod_report_failing\"",
        "\"event\":\"pod_report_recovered\"",
    ] {
        assert!(log.contains(needle), "no {needle} in Envoy's log");
    }
    // A client-chosen x-request-id is the events' requestId; the JSON in
    // the line (after `wasm log <plugin> <root> <vm>: `, or the native
    // module's `[dynamic_modules] [:] `) carries the documented fields.
    let r = http::request(
        &cluster.envoy.listen,
        "POST",
        "/v1/completions",
        &[
            ("content-type", "application/json"),
            ("x-request-id", "conv-42-turn-3"),
        ],
        Some(
            json!({"model": "sim-model", "prompt": text("conversation 42", 512), "max_tokens": 2})
                .to_string()
                .as_bytes(),
        ),
        http::DEFAULT_TIMEOUT,
    )
    .expect("request");
    assert_eq!(r.status, 200, "{}", r.body);
    let deadline = Instant::now() + Duration::from_secs(5);
    let route = loop {
        let found = cluster.envoy.log().lines().find_map(|line| {
            let event = log_event(line)?;
            (event["event"] == "route" && event["requestId"] == "conv-42-turn-3").then_some(event)
        });
        if let Some(event) = found {
            break event;
        }
        assert!(
            Instant::now() < deadline,
            "no route event for conv-42-turn-3"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    println!("route event: {route}");
    for field in [
        "model",
        "pod",
        "composite",
        "cacheMatch",
        "matchedBlocks",
        "matchedTiers",
        "blocks",
        "candidates",
        "latencyUs",
    ] {
        assert!(
            !route[field].is_null(),
            "route event lacks {field}: {route}"
        );
    }
    assert_eq!(route["pod"].as_str(), r.header("x-kvroute-pod"));

    // `candidates` is a debug event: hidden at the module's component level
    // info, shown after `POST /logging?<component>=debug` on the admin port.
    assert!(!log.contains("\"event\":\"candidates\""));
    let raised = http::request(
        &cluster.envoy.admin,
        "POST",
        &format!("/logging?{}=debug", log_component()),
        &[],
        None,
        http::DEFAULT_TIMEOUT,
    )
    .expect("admin /logging");
    assert_eq!(raised.status, 200, "{}", raised.body);
    complete(cluster, "sim-model", &text("explain me", 512));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cluster.envoy.log().contains("\"event\":\"candidates\"") {
        assert!(Instant::now() < deadline, "no candidates event at debug");
        std::thread::sleep(Duration::from_millis(100));
    }
    let line = cluster
        .envoy
        .log()
        .lines()
        .find(|l| l.contains("\"event\":\"candidates\""))
        .unwrap()
        .to_string();
    println!("debug line: {line}");
}
