//! `kvroute-bench`: kvroute against the cache-aware routers users would
//! pick instead (SGLang Model Gateway, vLLM's router) and Envoy's built-in
//! balancers, on the same simulated pods, in one run.
//!
//! - [`workload`]: the six workloads (shared-prefix groups, multi-turn
//!   chat, LoRA multi-tenant, Mooncake trace replay, closed-loop agentic
//!   tool loops, long-context coding sessions), KV sizing and the offline bounds (pooled LRU, infinite
//!   cache);
//! - [`stack`]: fresh pods + a router per policy (kvroute precise /
//!   approximate in Envoy, the [`peers`], Envoy's round robin, least
//!   request, random, ring hash);
//! - [`load`]: the streaming load generator (open and closed loop);
//! - [`load_sweep`]: every policy on the trace at offered loads from 0.5× to
//!   2.5× of the cache-blind capacity, and the highest load each sustains;
//! - [`fairness`]: each router's added latency on an idle system;
//! - [`overhead`]: proxy overhead and the 1M-block scale figures;
//! - [`envoy_stats`]: kvroute's metrics as Envoy's admin page shows them
//!   (stale routings, the TTFT model's error, the replicas' lag);
//! - [`replicas`]: kvroute as N Envoys behind one round robin, against one;
//! - [`report`], [`plot`]: results.json, README.md and the PNG charts.
//!
//! ```text
//! kvroute-bench [all|workload NAME..|load-sweep|fairness|overhead|filter-time|scale|replicas NAME..|render] [--quick] [--out DIR]
//! ```
//! Results merge into `DIR/results.json` (a later `workload lora` replaces
//! only that workload, `workload lora --policies P` only P's row there), and
//! README.md and the charts are re-rendered from it. The load sweep has its
//! own folder, `DIR/load-sweep/` (`load-sweep --policies P` replaces P's
//! rows there).

pub mod engine;
pub mod envoy_stats;
pub mod fairness;
pub mod load;
pub mod load_sweep;
pub mod overhead;
pub mod peers;
pub mod plot;
pub mod replicas;
pub mod report;
pub mod stack;
pub mod workload;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::{json, Value};

use crate::harness::repo_root;
use load::Limits;
use workload::{GenOptions, WORKLOADS};

/// Command line of `kvroute-bench`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "kvroute-bench",
    about = "Benchmark kvroute against peer routers and Envoy's built-in load balancers on simulated vLLM pods"
)]
pub struct BenchArgs {
    /// all | workload | load-sweep | fairness | overhead | filter-time |
    /// scale | render
    /// (re-render README.md and the charts from results.json and
    /// load-sweep/load-sweep.json)
    #[arg(default_value = "all")]
    pub command: String,
    /// Workload names for `workload` (shared-prefix, multi-turn, lora, trace,
    /// agentic, long-context).
    pub names: Vec<String>,
    /// Smaller workloads and shorter phases (a few minutes in all).
    #[arg(long)]
    pub quick: bool,
    /// Results folder (default: integration/results in the repository).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Policies to run (default: all ten).
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<String>,
    /// Offered load as a share of the cache-blind cluster capacity.
    #[arg(long, default_value_t = 0.7)]
    pub load: f64,
    /// Offered loads of `load-sweep` (default 0.5,1,1.5,2,2.5; quick
    /// 0.5,1.5,2.5).
    #[arg(long, value_delimiter = ',')]
    pub loads: Vec<f64>,
    /// TTFT p90 a policy must keep to sustain a load in `load-sweep`
    /// (default: 20 s × the trace workload's time scale).
    #[arg(long)]
    pub sustain_p90_ms: Option<f64>,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Trace replay speedup (default: the one offering `--load`).
    #[arg(long)]
    pub speedup: Option<f64>,
    /// Mooncake trace file (default: ../shared/traces/mooncake_synthetic_trace.jsonl
    /// next to the repository, or $KVROUTE_TRACE).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Trace lines replayed (default 1000, quick 300).
    #[arg(long)]
    pub trace_requests: Option<usize>,
    /// First trace line replayed, 0-based (default: the last N lines, the
    /// trace's steady state).
    #[arg(long)]
    pub trace_offset: Option<usize>,
    /// JSON merged into the kvroute plugin configuration of every workload
    /// (e.g. '{"maxQueue": 4}'); recorded in the results.
    #[arg(long)]
    pub kvroute_config: Option<String>,
    /// Copy each run's router log (kvroute's decision events, every
    /// replica's; a peer's own log) to DIR/WORKLOAD-POLICY.log (load
    /// sweep: DIR/load-sweep-LOAD-POLICY.log; replicas:
    /// DIR/WORKLOAD-POLICY-xN-runR.log), for decision analysis, and the
    /// requests as the client saw them beside it (`.requests.csv`: session,
    /// send time, TTFT, pod, cached tokens).
    #[arg(long)]
    pub keep_logs: Option<PathBuf>,
    /// The kvroute-sim binary (default: next to this one).
    #[arg(long)]
    pub sim: Option<PathBuf>,
    /// Real vLLM pods of `--engine vllm` (2 by default). Pods of `scale`
    /// (1 to 1,024): the run's figures go to
    /// DIR/scale/pods-N.json and DIR/scale/README.md compares the pool
    /// sizes run; without it, 64 pods into results.json as before.
    #[arg(long)]
    pub pods: Option<usize>,
    /// Stock-vLLM mode: the pods tokenize prompts (a real byte-level BPE)
    /// and publish vLLM's KV events instead of serving kvroute's report,
    /// kvroute precise reads them through one kvroute-vllm-bridge per pod
    /// (next to this binary), and chat prompts are rendered with a chat
    /// template. Results go to DIR/stock-vllm/ (see --out).
    #[arg(long)]
    pub stock_vllm: bool,
    /// Per pod, its prefill speed as a multiple of the cost model's (e.g.
    /// `1,1,0.5,0.5`: two fast and two half-speed pods); pods past the
    /// list run at 1. The offered load stays a share of full-speed pods'
    /// capacity (two half-speed pods of four: 0.75 of it).
    #[arg(long, value_delimiter = ',')]
    pub prefill_speeds: Vec<f64>,
    /// `replicas`: the numbers of kvroute Envoys to compare behind one
    /// round-robin Envoy (default 1,3).
    #[arg(long, value_delimiter = ',')]
    pub replicas: Vec<usize>,
    /// `replicas`: how many times each side runs.
    #[arg(long, default_value_t = 1)]
    pub runs: usize,
    /// The pods: `sim` (kvroute-sim) or `vllm`, real vLLM on this
    /// machine's CPUs (`make vllm`; `--pods` of them, 2 by default, each
    /// pinned to a core), the workloads tokenized and rendered as the tiny
    /// model does, at the time scale measured on the pods. With
    /// `--stand-in` the sim runs those very workloads (the model's
    /// tokenizer and template, the measured time scale) for the
    /// comparison. Results go to DIR/real-vllm/ (with `--stand-in`:
    /// DIR/real-vllm/sim/).
    #[arg(long, default_value = "sim", value_parser = ["sim", "vllm"])]
    pub engine: String,
    /// With `--engine sim`: the real-vLLM workloads on sims, at this time
    /// scale (the one `--engine vllm` measured and recorded).
    #[arg(long)]
    pub stand_in: Option<f64>,
    /// With `--engine vllm`: run at this time scale instead of measuring
    /// one, so that runs of separate invocations offer the same load (the
    /// measurement varies by ~8 % between invocations, and the offered
    /// load with it).
    #[arg(long, conflicts_with = "stand_in")]
    pub time_scale: Option<f64>,
    /// Pods with a CPU KV tier: each workload's GPU cache shrunk so its
    /// working set is 1.5× the pods' GPU blocks, with a CPU tier as large
    /// again (`kvroute-sim --cpu-kv-blocks`), and kvroute-tier-blind
    /// (every tier credited as GPU) among the default policies.
    #[arg(long)]
    pub cpu_tier: bool,
}

fn default_trace() -> PathBuf {
    if let Ok(path) = std::env::var("KVROUTE_TRACE") {
        return PathBuf::from(path);
    }
    let beside = repo_root().join("../shared/traces/mooncake_synthetic_trace.jsonl");
    if beside.exists() {
        return beside;
    }
    PathBuf::from("/work/shared/traces/mooncake_synthetic_trace.jsonl")
}

fn sim_binary(args: &BenchArgs) -> PathBuf {
    args.sim.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(|d| d.join("kvroute-sim")))
            .unwrap_or_else(|| repo_root().join("target/release/kvroute-sim"))
    })
}

pub(crate) fn shell(cmd: &str, args: &[&str]) -> String {
    std::process::Command::new(cmd)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

pub(crate) fn host() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cores} cores, {cpu}")
}

/// Runs `kvroute-bench`; returns the results document.
pub fn run(args: &BenchArgs) -> Result<Value, String> {
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| repo_root().join("integration/results"));
    if let Some(scale) = args.time_scale {
        if args.engine != "vllm" {
            return Err("--time-scale is for --engine vllm (the sim's is --stand-in)".into());
        }
        if !(scale.is_finite() && scale > 0.0) {
            return Err(format!("--time-scale must be above 0 (got {scale})"));
        }
    }
    let real_vllm = args.engine == "vllm" || args.stand_in.is_some();
    let out = if args.stand_in.is_some() {
        out.join("real-vllm/sim")
    } else if real_vllm {
        out.join("real-vllm")
    } else if args.stock_vllm {
        out.join("stock-vllm")
    } else {
        out
    };
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let sim = sim_binary(args);
    if !sim.exists() {
        return Err(format!(
            "{} not found: build it with `cargo build --release -p kvroute-integration --bin kvroute-sim`",
            sim.display()
        ));
    }
    let results_path = out.join("results.json");
    let mut results: Value = std::fs::read_to_string(&results_path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_else(|| json!({}));
    if !results["workloads"].is_object() {
        results["workloads"] = json!({});
    }
    let every_workload = || WORKLOADS.iter().map(|s| s.to_string()).collect();
    let (workloads, sweep, fairness, overhead, scale): (Vec<String>, bool, bool, bool, bool) =
        match args.command.as_str() {
            "all" => (every_workload(), true, true, true, true),
            "workload" => {
                if args.names.is_empty() {
                    return Err(format!("workload needs a name: {}", WORKLOADS.join(", ")));
                }
                (args.names.clone(), false, false, false, false)
            }
            "load-sweep" => (Vec::new(), true, false, false, false),
            "fairness" => (Vec::new(), false, true, false, false),
            "overhead" => (Vec::new(), false, false, true, false),
            "filter-time" => (Vec::new(), false, false, false, false),
            "scale" => (Vec::new(), false, false, false, true),
            "render" | "replicas" => (Vec::new(), false, false, false, false),
            other => {
                return Err(format!(
                    "unknown command {other:?}: all | workload NAME.. | load-sweep | fairness | overhead | filter-time | scale | replicas NAME.. | render"
                ))
            }
        };
    let policies: Vec<String> = if args.policies.is_empty() {
        stack::POLICIES
            .iter()
            .filter(|p| args.cpu_tier || **p != stack::TIER_BLIND)
            .map(|s| s.to_string())
            .collect()
    } else {
        args.policies.clone()
    };
    let vllm = (args.engine == "vllm")
        .then(|| engine::VllmEngine::new(args.pods.unwrap_or(2)))
        .transpose()
        .map_err(|e| format!("--engine vllm: {e}"))?;
    let mut opts = GenOptions {
        quick: args.quick,
        seed: args.seed,
        load: args.load,
        pods: if real_vllm { args.pods.unwrap_or(2) } else { 4 },
        trace_path: args.trace.clone().unwrap_or_else(default_trace),
        speedup: args.speedup,
        trace_requests: args.trace_requests,
        trace_offset: args.trace_offset,
        plugin_extra: match &args.kvroute_config {
            Some(text) => {
                serde_json::from_str(text).map_err(|e| format!("--kvroute-config: {e}"))?
            }
            None => json!({}),
        },
        stock_vllm: args.stock_vllm,
        prefill_speeds: args.prefill_speeds.clone(),
        cpu_tier: args.cpu_tier,
        tokenizer: None,
        time_scale: None,
    };
    if args.keep_logs.is_some() {
        // The TTFT model's `ttft_prediction` events are DEBUG: the plugin's
        // `logLevel` lets them through (and `run_policy` Envoy's level).
        if let Some(extra) = opts.plugin_extra.as_object_mut() {
            extra.entry("logLevel").or_insert(json!("debug"));
        }
    }
    if real_vllm && !matches!(args.command.as_str(), "workload" | "render") {
        return Err(format!(
            "--engine vllm and --stand-in run `workload NAME..` (and `render`), not {:?}: \
             the load sweep, fairness, overhead, scale and replica runs are the simulator's",
            args.command
        ));
    }
    if real_vllm && args.command == "workload" {
        let install = match &vllm {
            Some(engine) => engine.install.clone(),
            None => crate::vllm::Install::find().map_err(|e| e.to_string())?,
        };
        let extra = engine::plugin_extra(&install).map_err(|e| e.to_string())?;
        for (k, v) in extra.as_object().into_iter().flatten() {
            opts.plugin_extra[k] = v.clone();
        }
        opts.stock_vllm = true;
        opts.tokenizer = Some(install.tokenizer().display().to_string());
        opts.time_scale = match (&vllm, args.stand_in.or(args.time_scale)) {
            (Some(engine), None) => Some(
                engine
                    .calibrate()
                    .map_err(|e| format!("calibration: {e}"))?,
            ),
            (_, scale) => scale,
        };
        results["engine"] = match &vllm {
            Some(engine) => engine.describe(),
            None => json!({"engine": "sim", "standsInFor": "vllm"}),
        };
        results["engine"]["timeScale"] = json!(opts.time_scale);
        if vllm.is_some() && args.time_scale.is_some() {
            results["engine"]["timeScaleGiven"] = json!(true);
        }
    }
    let command = std::iter::once("kvroute-bench".to_string())
        .chain(std::env::args().skip(1))
        .collect::<Vec<_>>()
        .join(" ");
    if args.command == "render" {
        write_results(&out, &mut results)?;
        load_sweep::render(&out.join(load_sweep::FOLDER))?;
        return Ok(results);
    }
    if args.command == "load-sweep" {
        return load_sweep::run(args, &opts, &policies, &sim, &out, &command);
    }
    if args.command == "replicas" {
        let policies: Vec<String> = if args.policies.is_empty() {
            vec!["kvroute-precise".into(), "kvroute-approx".into()]
        } else {
            args.policies.clone()
        };
        return replicas::run(args, &opts, &policies, &sim, &out, &command);
    }
    if args.command == "all" {
        results["command"] = json!(command);
        results["reruns"] = json!([]);
    } else {
        let mut reruns = results["reruns"].as_array().cloned().unwrap_or_default();
        reruns.push(json!(command));
        results["reruns"] = Value::Array(reruns);
    }
    results["date"] = json!(shell("date", &["-u", "+%Y-%m-%d %H:%M UTC"]));
    results["host"] = json!(host());
    results["quick"] = json!(args.quick);
    let started = Instant::now();
    if args.command == "filter-time" {
        results["filterTime"] =
            overhead::filter_time(&sim, args.quick).map_err(|e| format!("filter-time: {e}"))?;
        write_results(&out, &mut results)?;
        return Ok(results);
    }
    if fairness {
        results["fairness"] = fairness::idle_latency(&sim, &policies, args.quick);
        write_results(&out, &mut results)?;
    }
    for name in &workloads {
        let w = workload::build(name, &opts)?;
        let mut entry = report::workload_json(&w);
        eprintln!(
            "== {name}: {} requests, {:.1} req/s offered, kv {} blocks/pod, bounds pooled {:.3} infinite {:.3}",
            w.requests.len(),
            w.offered_rps,
            w.kv_blocks,
            w.bounds.pooled,
            w.bounds.infinite
        );
        let mut rows = Vec::new();
        for policy in &policies {
            let kept_log = args
                .keep_logs
                .as_ref()
                .map(|dir| dir.join(format!("{name}-{policy}.log")));
            let row = run_policy(policy, &w, &sim, vllm.as_ref(), kept_log.as_deref(), None)?;
            print_row(&row, started);
            rows.push(row);
        }
        // `workload NAME --policies P,Q` reruns those rows and keeps the
        // workload's others (in report order).
        if args.command == "workload" && !args.policies.is_empty() {
            let kept = results["workloads"][name.as_str()]["policies"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            for old in kept {
                if !rows.iter().any(|r| r["policy"] == old["policy"]) {
                    rows.push(old);
                }
            }
            let rank = |r: &Value| stack::POLICIES.iter().position(|p| r["policy"] == *p);
            rows.sort_by_key(rank);
        }
        entry["policies"] = Value::Array(rows);
        results["workloads"][name.as_str()] = entry;
        write_results(&out, &mut results)?;
    }
    if sweep {
        load_sweep::run(args, &opts, &policies, &sim, &out, &command)?;
    }
    if overhead {
        let o = overhead::overhead(&sim, args.quick).map_err(|e| format!("overhead: {e}"))?;
        results["overhead"] = o;
        write_results(&out, &mut results)?;
    }
    if scale {
        let pods = args.pods.unwrap_or(64);
        if !(1..=kvroute::config::MAX_PODS).contains(&pods) {
            return Err(format!("--pods must be 1 to {}", kvroute::config::MAX_PODS));
        }
        let s = overhead::scale(&sim, args.quick, pods).map_err(|e| format!("scale: {e}"))?;
        if args.pods.is_some() {
            overhead::write_scale(&out.join("scale"), &s, &command)
                .map_err(|e| format!("scale: {e}"))?;
        } else {
            results["scale"] = s;
            write_results(&out, &mut results)?;
        }
    }
    eprintln!(
        "done in {:.0} s; results in {}",
        started.elapsed().as_secs_f64(),
        out.display()
    );
    Ok(results)
}

/// One line per request as the client saw it, in request order: what
/// `--keep-logs` keeps beside the router's log, so a run's tail can be
/// read request by request (which session, when, which pod, how long).
fn requests_csv(requests: &[workload::BenchRequest], outcomes: &[load::Outcome]) -> String {
    let mut csv = String::from(
        "request,session,follows_up,sent_s,ttft_ms,e2e_ms,status,pod,prompt_tokens,cached_tokens,error\n",
    );
    let ms = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.3}"));
    let count = |v: Option<u64>| v.map_or(String::new(), |v| v.to_string());
    for o in outcomes {
        let request = requests.get(o.index);
        let follows_up = match request.and_then(|r| r.follows_up) {
            Some(true) => "later",
            Some(false) => "start",
            None => "",
        };
        csv.push_str(&format!(
            "{},{},{follows_up},{:.3},{},{},{},{},{},{},{}\n",
            o.index,
            request.map_or("", |r| r.session.as_str()),
            o.sent_s,
            ms(o.ttft_ms),
            ms(o.e2e_ms),
            o.status,
            o.pod.as_deref().unwrap_or(""),
            count(o.prompt_tokens),
            count(o.cached_tokens),
            o.error.as_deref().unwrap_or("").replace([',', '\n'], ";"),
        ));
    }
    csv
}

/// One policy on one workload, on fresh pods (or `vllm`'s, reset); a policy that cannot run
/// here (a peer not installed or not starting) gives a row saying why.
/// `kept_log`: where to copy the router's log (and the requests' CSV,
/// [`requests_csv`], beside it).
fn run_policy(
    policy: &str,
    w: &workload::Workload,
    sim: &Path,
    vllm: Option<&engine::VllmEngine>,
    kept_log: Option<&Path>,
    replicas: Option<usize>,
) -> Result<Value, String> {
    let stack = match stack::start(policy, w, sim, vllm, replicas) {
        Ok(stack) => stack,
        Err(stack::StartError::Unavailable(reason)) => {
            return Ok(json!({"policy": policy, "unavailable": reason}))
        }
        Err(stack::StartError::Failed(e)) => return Err(format!("{policy}: {e}")),
    };
    if kept_log.is_some() {
        // The TTFT model's prediction of each answer (`ttft_prediction`, a
        // DEBUG event) goes into the kept log for its error analysis.
        for envoy in stack.envoys() {
            let path = format!("/logging?{}=debug", crate::harness::log_component());
            let timeout = crate::http::DEFAULT_TIMEOUT;
            let _ = crate::http::request(&envoy.admin, "POST", &path, &[], None, timeout);
        }
    }
    let log_offsets: Vec<usize> = stack
        .envoys()
        .iter()
        .map(|e| std::fs::metadata(&e.log_path).map_or(0, |m| m.len() as usize))
        .collect();
    let last = w.requests.last().map_or(0.0, |r| r.at_s);
    // Closed loop: the planned offsets assume every prefix cached; a
    // cache-blind router takes several times longer.
    let window = if w.agents.is_some() {
        last * 10.0 + 60.0
    } else {
        last * 1.5 + 30.0
    };
    let limits = Limits {
        max_in_flight: 2000,
        request_timeout: Duration::from_secs(120),
        max_send_window: Duration::from_secs_f64(window),
    };
    let pids = stack.router_pids();
    // Summed over the router's processes (every replica).
    let total = |read: &dyn Fn(u32) -> Option<f64>| -> Option<f64> {
        pids.iter().map(|&pid| read(pid)).sum()
    };
    let cpu = || total(&|pid| overhead::process_cpu_s(pid));
    // Envoy's main thread runs kvroute's report service.
    let main_thread = || {
        stack
            .envoy()
            .and_then(|_| total(&|pid| overhead::thread_cpu_s(pid, pid)))
    };
    let (cpu_before, main_before) = (cpu(), main_thread());
    let (outcomes, wall) = load::run(stack.listen(), &w.requests, limits);
    let cpu_s = cpu().zip(cpu_before).map(|(after, before)| after - before);
    let main_thread_s = main_thread()
        .zip(main_before)
        .map(|(after, before)| after - before);
    std::thread::sleep(Duration::from_millis(200));
    let stats = stack.pod_stats();
    let log = if policy.starts_with("kvroute") {
        stack
            .envoys()
            .iter()
            .zip(&log_offsets)
            .map(|(envoy, &offset)| envoy.log().get(offset..).unwrap_or("").to_string())
            .collect::<Vec<_>>()
            .join("\n")
    } else {
        String::new()
    };
    if let Some(kept) = kept_log {
        if let Some(dir) = kept.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        // kvroute: this run's lines of every replica's Envoy.
        let kept_result = if log.is_empty() {
            std::fs::copy(stack.log_path(), kept).map(|_| ())
        } else {
            std::fs::write(kept, &log)
        };
        kept_result.map_err(|e| format!("{}: {e}", kept.display()))?;
        let requests = kept.with_extension("requests.csv");
        std::fs::write(&requests, requests_csv(&w.requests, &outcomes))
            .map_err(|e| format!("{}: {e}", requests.display()))?;
    }
    let filter = overhead::event_field(&log, "route", "latencyUs");
    let mut row = report::policy_figures(policy, w, &outcomes, wall, &stats, &filter);
    // What kvroute's index knew at decision time: the share of each
    // prompt's blocks it matched on the chosen pod (the pods' hit rate
    // is what was actually cached by then).
    let matched: f64 = overhead::event_field(&log, "route", "matchedBlocks")
        .iter()
        .sum();
    let blocks: f64 = overhead::event_field(&log, "route", "blocks").iter().sum();
    if blocks > 0.0 {
        row["indexMatchShare"] = json!((matched / blocks * 1e4).round() / 1e4);
    }
    // Requests kvroute held in its gateway wait queue (every pod at
    // maxQueue), with how long each waited, whatever the outcome (routed,
    // 503 at the deadline or a full queue, client gone).
    if policy.starts_with("kvroute") {
        // Decisions whose pod served under half the cached tokens kvroute
        // predicted (it had evicted blocks the index still listed), of the
        // decisions checked (one answer in `predictionCheckSample`); all
        // decisions log a `route` line by default.
        let metric = |name| {
            stack
                .envoys()
                .iter()
                .map(|envoy| envoy_stats::metric(envoy, name))
                .sum::<Option<f64>>()
        };
        let stale = metric("epp_stale_cache_routing_total");
        let checked = metric("epp_cache_predictions_checked_total");
        let decisions = overhead::event_field(&log, "route", "blocks").len();
        if let (Some(stale), Some(checked)) = (stale, checked.filter(|c| *c > 0.0)) {
            row["staleRouting"] = json!({
                "decisions": decisions,
                "checked": checked,
                "stale": stale,
                "share": (stale / checked * 1e4).round() / 1e4,
            });
        }
        // The TTFT model's error on the answers it predicted (percent of
        // the actual TTFT), once Envoy's stats flush (every 1 s) has
        // brought the last samples to its admin page.
        std::thread::sleep(Duration::from_millis(1200));
        let errors = envoy_stats::histogram(&stack.envoys(), "epp_ttft_prediction_error_percent");
        row["ttftModelErrorP50"] =
            json!(envoy_stats::histogram_quantile(0.5, &errors).map(|p| report::round(p, 1)));
        let waited =
            report::sorted(overhead::event_field(&log, "wait_end", "waitedMs").into_iter());
        row["gatewayWaitMs"] = json!({
            "requests": waited.len(),
            "p50": report::percentile(&waited, 50.0),
            "p90": report::percentile(&waited, 90.0),
            "max": waited.last(),
        });
    }
    if stack.envoys().len() > 1 {
        row["replicaLagMs"] = replicas::lag(&stack.envoys());
    }
    row["router"] = stack.router();
    row["routerCpuS"] = json!(cpu_s.map(|s| (s * 100.0).round() / 100.0));
    let completed = row["completed"].as_f64().unwrap_or(0.0).max(1.0);
    let per_1k = |s: f64| (s * 1000.0 / completed * 100.0).round() / 100.0;
    row["routerCpuSPer1k"] = json!(cpu_s.map(per_1k));
    row["routerMainThreadCpuSPer1k"] = json!(main_thread_s.map(per_1k));
    Ok(row)
}

/// One line of progress on stderr for a policy's row.
pub(crate) fn print_row(row: &Value, started: Instant) {
    let policy = row["policy"].as_str().unwrap_or("");
    match row["unavailable"].as_str() {
        Some(reason) => eprintln!("   {policy:28} unavailable: {reason}"),
        None => eprintln!(
            "   {policy:28} hit {:.3}  ttft p50 {} p90 {} p99 {}  errors {} (503s {})  share {}  cpu {} s/1k  ({:.0} s elapsed)",
            row["hitRate"].as_f64().unwrap_or(0.0),
            row["ttftMs"]["p50"],
            row["ttftMs"]["p90"],
            row["ttftMs"]["p99"],
            row["errors"],
            row["http503"],
            row["maxShareOverFair"],
            row["routerCpuSPer1k"],
            started.elapsed().as_secs_f64()
        ),
    }
}

/// Writes results.json, README.md and the charts.
fn write_results(out: &Path, results: &mut Value) -> Result<(), String> {
    results["targets"] = report::targets(results);
    results["peerComparison"] = report::peer_comparison(results);
    let text = serde_json::to_string_pretty(results).map_err(|e| e.to_string())?;
    std::fs::write(out.join("results.json"), text + "\n").map_err(|e| e.to_string())?;
    let mut command = results["command"]
        .as_str()
        .unwrap_or("kvroute-bench")
        .to_string();
    for rerun in results["reruns"].as_array().into_iter().flatten() {
        command.push_str(&format!("`, then `{}", rerun.as_str().unwrap_or("")));
    }
    std::fs::write(out.join("README.md"), report::markdown(results, &command))
        .map_err(|e| e.to_string())?;
    let workloads = &results["workloads"];
    if workloads.as_object().is_some_and(|o| !o.is_empty()) {
        plot::hit_rate(&out.join("hit_rate.png"), workloads).map_err(|e| e.to_string())?;
        plot::ttft_p50(&out.join("ttft_p50.png"), workloads).map_err(|e| e.to_string())?;
        plot::ttft_cdf(&out.join("ttft_cdf.png"), workloads).map_err(|e| e.to_string())?;
    }
    Ok(())
}
