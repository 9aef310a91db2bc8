//! `kvroute-replay`: an offline what-if simulator and weight tuner.
//!
//! Replays a request trace (Mooncake JSONL, or OpenAI bodies with
//! timestamps) against the routing core and simulated pods in simulated
//! time — no Envoy, no network — for kvroute and four baselines (round
//! robin, least request, random, ring hash), plus the pooled-cache and
//! infinite-cache hit-rate bounds; optionally sweeps weights and
//! `maxQueue` and recommends the best for an objective.
//!
//! - [`workload`]: the trace → per-request block chains (the core's hasher);
//! - [`engine`]: the discrete-event simulation and the policies;
//! - [`sweep`]: the grid, the weight renormalisation rule, the objective;
//! - [`load_sweep`]: every policy across offered loads (`--load-sweep`);
//! - [`heatmap`]: the sweep's PNG.

pub mod azure;
pub mod engine;
pub mod heatmap;
pub mod load_sweep;
pub mod sweep;
pub mod workload;

use std::fmt::Write as _;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Parser;
use kvroute::config::{Config, IndexMode, NoPodPolicy};
use serde_json::{json, Value};

pub use engine::{
    cache_bound, sim_pods, simulate, PodSpec, Policy, RequestOutcome, RunResult, Summary,
};
pub use sweep::{Objective, SweepSpec};
pub use workload::{Format, Request, Workload};

use crate::model::CostModel;

/// Default working set as a fraction of the pods' total KV capacity.
pub const WORKING_SET_FRACTION: f64 = 0.72;
/// Default tokens per router block when no `--config` is given: one
/// Mooncake hash id (512 tokens = 2048 bytes of text) per block.
pub const DEFAULT_BLOCK_TOKENS: usize = 512;

/// Command-line options of `kvroute-replay`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "kvroute-replay",
    about = "Replays a request trace against kvroute's routing core and simulated pods, offline"
)]
pub struct ReplayArgs {
    /// The trace (JSONL).
    #[arg(long)]
    pub trace: PathBuf,
    /// `mooncake` ({"timestamp","input_length","output_length","hash_ids"} per line),
    /// `openai` ({"timestamp", "path"?, "body": {...}} per line) or `azure`
    /// (the Azure LLM inference trace's CSV: TIMESTAMP,ContextTokens,GeneratedTokens;
    /// conversations rebuilt as in `kvroute_integration::replay::azure`).
    #[arg(long, default_value = "mooncake", value_parser = parse_format)]
    pub format: Format,
    /// Number of simulated pods.
    #[arg(long, default_value_t = 8)]
    pub pods: usize,
    /// KV cache capacity per pod in router blocks (default: sized so the
    /// trace's working set is 72% of the pods' total capacity).
    #[arg(long)]
    pub kv_blocks: Option<usize>,
    /// Sequence slots per pod (vLLM's `max_num_seqs`; the rest queue, FIFO).
    #[arg(long, default_value_t = 64)]
    pub max_batch: usize,
    /// CPU-tier blocks per pod, as `kvroute-sim --cpu-kv-blocks` (0: none).
    #[arg(long, default_value_t = 0)]
    pub cpu_kv_blocks: usize,
    /// GB/s of CPU-tier reloads, as `kvroute-sim --cpu-reload-gbps`.
    #[arg(long, default_value_t = crate::model::PCIE_GBPS)]
    pub cpu_reload_gbps: f64,
    /// Divides every trace timestamp.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Replays this many copies of the trace at once, each with its own
    /// blocks (see `Workload::replicated`): with `--pods` N× as many, the
    /// load per pod and the heat of each prefix stay the same.
    #[arg(long, default_value_t = 1)]
    pub replicate: usize,
    /// Multiplies every pod duration (prefill, decode), like `kvroute-sim
    /// --time-scale`: a benchmark running its pods at 0.05 replays with the
    /// same value.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// The router's report interval (default: the config's podReportIntervalMs).
    #[arg(long)]
    pub report_interval_ms: Option<u64>,
    /// Poll reports on the interval only (`reportLongPoll: false`); by
    /// default the router long-polls (see `kvroute::polling`).
    #[arg(long)]
    pub interval_reports: bool,
    /// `precise` (pods report their caches) or `approximate` (the router
    /// records its decisions); default: the config's mode.
    #[arg(long, value_parser = parse_mode)]
    pub mode: Option<IndexMode>,
    /// Policies to run, comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = Policy::parse,
          default_value = "kvroute,round_robin,least_request,random,ring_hash")]
    pub policies: Vec<Policy>,
    /// Seed of the random baseline.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Grid to evaluate, e.g. `w_cache=0.4:0.8:0.1,maxQueue=8,20,40`.
    #[arg(long)]
    pub sweep: Option<String>,
    /// What the sweep optimises: ttft_p99, ttft_p50 or hit_rate.
    #[arg(long, default_value = "ttft_p99", value_parser = Objective::parse)]
    pub objective: Objective,
    /// Directory for results.json, router-config.json, per-request CSVs and
    /// the sweep heatmap.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// kvroute configuration JSON (weights, hashing, maxQueue, ...); its
    /// pods are replaced by the simulated ones.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Tokens per router block (blockSizeTokens; blockSizeBytes = 4×).
    /// Default: the config's (without --config the filter's, but 512 for
    /// a Mooncake trace: one hash id).
    #[arg(long)]
    pub block_tokens: Option<usize>,
    /// Override maxPrefixBlocks.
    #[arg(long)]
    pub max_prefix_blocks: Option<usize>,
    /// Every pod excluded: `wait` in the gateway (maxWaitingRequests,
    /// maxWaitMs of the config) or `reject` (503, the client retries after
    /// retryAfterSeconds). Default: the config's `onNoEligiblePod` (the
    /// filter's default, `wait`).
    #[arg(long, value_parser = parse_no_pod)]
    pub on_no_eligible_pod: Option<NoPodPolicy>,
    /// Per pod, its prefill speed as a multiple of the cost model's
    /// (comma-separated, e.g. `1,1,0.5,0.5` for two fast and two
    /// half-speed pods); pods past the list run at 1.
    #[arg(long, value_delimiter = ',')]
    pub prefill_speeds: Vec<f64>,
    /// Model name of Mooncake requests.
    #[arg(long, default_value = workload::DEFAULT_MODEL)]
    pub model: String,
    /// Offered loads to sweep, as shares of the trace's cache-blind
    /// capacity (e.g. `0.5,1,1.5,2,2.5`): every policy at each, instead of
    /// one run at `--speedup`; writes load-sweep.json and load-sweep.png to
    /// `--out`.
    #[arg(long, value_delimiter = ',')]
    pub load_sweep: Vec<f64>,
    /// The TTFT p90 (ms, at time scale 1) a policy must keep to sustain a
    /// load in `--load-sweep`.
    #[arg(long, default_value_t = load_sweep::SUSTAINED_P90_MS)]
    pub sustain_p90_ms: f64,
    /// Threads for --sweep (results do not depend on it).
    #[arg(long, default_value_t = 1)]
    pub jobs: usize,
    /// Replay the real-Envoy benchmark's workload of this name instead
    /// (shared-prefix, multi-turn, lora, trace, agentic, long-context; the
    /// trace workload reads `--trace`): its requests, pods, cache sizes
    /// and time scale, open loop at the planned arrival times (a closed
    /// loop's turns arrive as planned with every prefix cached, not when
    /// the previous answer ends; adapters are not modelled).
    #[arg(long)]
    pub bench_workload: Option<String>,
    /// With `--bench-workload`: its pods with a CPU KV tier, as
    /// `kvroute-bench --cpu-tier` runs them.
    #[arg(long)]
    pub cpu_tier: bool,
    /// Also write the Mooncake trace as OpenAI JSONL (the bodies the
    /// real-Envoy benchmark sends) to this file.
    #[arg(long)]
    pub emit_openai: Option<PathBuf>,
}

fn parse_format(text: &str) -> Result<Format, String> {
    match text {
        "mooncake" => Ok(Format::Mooncake),
        "openai" => Ok(Format::OpenAi),
        "azure" => Ok(Format::AzureConv),
        other => Err(format!(
            "unknown format {other:?} (mooncake, openai or azure)"
        )),
    }
}

fn parse_no_pod(text: &str) -> Result<NoPodPolicy, String> {
    match text {
        "reject" => Ok(NoPodPolicy::Reject),
        "wait" => Ok(NoPodPolicy::Wait),
        other => Err(format!("unknown policy {other:?} (reject or wait)")),
    }
}

fn parse_mode(text: &str) -> Result<IndexMode, String> {
    match text {
        "precise" => Ok(IndexMode::Precise),
        "approximate" => Ok(IndexMode::Approximate),
        other => Err(format!("unknown mode {other:?} (precise or approximate)")),
    }
}

fn mode_name(mode: IndexMode) -> &'static str {
    match mode {
        IndexMode::Precise => "precise",
        IndexMode::Approximate => "approximate",
    }
}

/// Everything one invocation produced.
#[derive(Debug, Clone)]
pub struct Report {
    pub config: Config,
    pub pods: PodSpec,
    pub requests: usize,
    pub unique_blocks: usize,
    pub kv_blocks_derived: bool,
    pub runs: Vec<RunResult>,
    pub pooled_bound: f64,
    pub infinite_bound: f64,
    pub sweep: Option<SweepReport>,
    /// The markdown printed to stdout.
    pub markdown: String,
}

/// The sweep part of a [`Report`].
#[derive(Debug, Clone)]
pub struct SweepReport {
    pub spec: SweepSpec,
    pub objective: Objective,
    pub results: Vec<sweep::SweepResult>,
    pub best: usize,
}

/// The default per-pod KV capacity: the working set is
/// [`WORKING_SET_FRACTION`] of the pods' total capacity.
pub fn default_kv_blocks(unique_blocks: usize, pods: usize) -> usize {
    ((unique_blocks as f64 / (pods as f64 * WORKING_SET_FRACTION)).ceil() as usize).max(1)
}

/// The router configuration of a replay: `--config` (or the defaults with
/// 512-token blocks) with the command-line overrides and the simulated pods.
pub fn router_config(args: &ReplayArgs) -> Result<Config, String> {
    let mut config = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read --config {}: {e}", path.display()))?;
            serde_json::from_str::<Config>(&text)
                .map_err(|e| format!("invalid kvroute configuration {}: {e}", path.display()))?
        }
        // The filter's defaults, but for a Mooncake trace's blocks: one
        // hash id is 512 tokens, so a smaller block would only split ids.
        None if args.format == Format::Mooncake => Config {
            block_size_tokens: DEFAULT_BLOCK_TOKENS,
            block_size_bytes: DEFAULT_BLOCK_TOKENS * kvroute::hashing::BYTES_PER_TOKEN,
            ..Config::default()
        },
        None => Config::default(),
    };
    if let Some(tokens) = args.block_tokens {
        config.block_size_tokens = tokens;
        config.block_size_bytes = tokens * kvroute::hashing::BYTES_PER_TOKEN;
    }
    if let Some(blocks) = args.max_prefix_blocks {
        config.max_prefix_blocks = blocks;
    }
    if let Some(mode) = args.mode {
        config.mode = mode;
    }
    if let Some(ms) = args.report_interval_ms {
        config.pod_report_interval_ms = ms;
    }
    if args.interval_reports {
        config.report_long_poll = false;
    }
    if args.pods == 0 || args.pods > kvroute::config::MAX_PODS {
        return Err(format!(
            "--pods must be between 1 and {}",
            kvroute::config::MAX_PODS
        ));
    }
    config.pods = sim_pods(args.pods);
    config.discovery = None;
    config.fallback_pod = None;
    if let Some(policy) = args.on_no_eligible_pod {
        config.on_no_eligible_pod = policy;
    }
    config.validate().map_err(|e| e.to_string())?;
    Ok(config)
}

/// Runs one invocation: prints the markdown report to `stdout` and writes
/// the `--out` files.
pub fn run(args: &ReplayArgs, stdout: &mut dyn Write) -> Result<Report, String> {
    if let Some(name) = &args.bench_workload {
        let report = run_bench_workload(args, name, stdout)?;
        if let Some(dir) = &args.out {
            write_outputs(dir, args, &report)
                .map_err(|e| format!("--out {}: {e}", dir.display()))?;
        }
        return Ok(report);
    }
    let started = Instant::now();
    if !(args.speedup.is_finite() && args.speedup > 0.0) {
        return Err("--speedup must be a positive number".into());
    }
    if !(args.time_scale.is_finite() && args.time_scale > 0.0) {
        return Err("--time-scale must be a positive number".into());
    }
    if args.max_batch == 0 {
        return Err("--max-batch must be >= 1".into());
    }
    if args
        .prefill_speeds
        .iter()
        .any(|s| !(s.is_finite() && *s > 0.0))
    {
        return Err("--prefill-speeds must be positive numbers".into());
    }
    let sweep_spec = args.sweep.as_deref().map(SweepSpec::parse).transpose()?;
    let mut config = router_config(args)?;
    if let Some(path) = &args.emit_openai {
        emit_openai(args.format, &args.trace, path, &args.model)?;
    }
    let workload = Workload::load(&args.trace, args.format, &config, &args.model, args.speedup)
        .map_err(|e| format!("{}: {e}", args.trace.display()))?
        .replicated(args.replicate);
    let unique_blocks = workload.unique_blocks();
    let kv_blocks = args
        .kv_blocks
        .unwrap_or_else(|| default_kv_blocks(unique_blocks, args.pods));
    if kv_blocks == 0 {
        return Err("--kv-blocks must be >= 1".into());
    }
    config.pod_capacity_blocks = kv_blocks;
    config.validate().map_err(|e| e.to_string())?;
    if !(args.cpu_reload_gbps.is_finite() && args.cpu_reload_gbps > 0.0) {
        return Err("--cpu-reload-gbps must be a positive number".into());
    }
    let pods = PodSpec {
        count: args.pods,
        kv_blocks,
        cpu_kv_blocks: args.cpu_kv_blocks,
        max_batch: args.max_batch,
        cost: CostModel::gpu_8b(args.time_scale).with_reload_gbps(args.cpu_reload_gbps),
        prefill_speeds: args.prefill_speeds.clone(),
    };
    let pooled_bound = cache_bound(&workload, Some(kv_blocks * args.pods));
    let infinite_bound = cache_bound(&workload, None);
    if !args.load_sweep.is_empty() {
        if args.load_sweep.iter().any(|l| !(l.is_finite() && *l > 0.0)) {
            return Err("--load-sweep loads must be positive numbers".into());
        }
        let target_ms = args.sustain_p90_ms * args.time_scale;
        let unscaled = Workload::load(&args.trace, args.format, &config, &args.model, 1.0)
            .map_err(|e| format!("{}: {e}", args.trace.display()))?
            .replicated(args.replicate);
        let points = load_sweep::run(
            &unscaled,
            &pods,
            &args.policies,
            &config,
            args.seed,
            &args.load_sweep,
            args.time_scale,
        );
        let markdown = format!(
            "## kvroute-replay load sweep: {}

{} pods × {kv_blocks} blocks, cache-blind capacity {:.2} req/s, pooled-cache bound {}

{}",
            args.trace.display(),
            args.pods,
            load_sweep::cache_blind_rps(&unscaled, &pods, args.time_scale),
            pct(pooled_bound),
            load_sweep::markdown(&points, pooled_bound, target_ms)
        );
        stdout
            .write_all(markdown.as_bytes())
            .map_err(|e| e.to_string())?;
        if let Some(dir) = &args.out {
            std::fs::create_dir_all(dir).map_err(|e| format!("--out {}: {e}", dir.display()))?;
            let json = load_sweep::json(&points, pooled_bound, target_ms);
            std::fs::write(dir.join("load-sweep.json"), format!("{json:#}\n"))
                .map_err(|e| format!("--out {}: {e}", dir.display()))?;
            std::fs::write(dir.join("load-sweep.md"), &markdown)
                .map_err(|e| format!("--out {}: {e}", dir.display()))?;
            load_sweep::chart(
                &points,
                &dir.join("load-sweep.png"),
                "TTFT p90 vs offered load (replay)",
            )?;
        }
        return Ok(Report {
            config,
            pods,
            requests: workload.requests.len(),
            unique_blocks,
            kv_blocks_derived: args.kv_blocks.is_none(),
            runs: Vec::new(),
            pooled_bound,
            infinite_bound,
            sweep: None,
            markdown,
        });
    }
    let runs: Vec<RunResult> = args
        .policies
        .iter()
        .map(|&policy| simulate(&workload, &pods, policy, &config, args.seed))
        .collect();
    let sweep = match sweep_spec {
        Some(spec) => {
            let (results, best) = sweep::run_sweep(
                &workload,
                &pods,
                &config,
                &spec,
                args.objective,
                args.seed,
                args.jobs,
            )?;
            Some(SweepReport {
                spec,
                objective: args.objective,
                results,
                best,
            })
        }
        None => None,
    };
    let mut report = Report {
        config,
        pods,
        requests: workload.requests.len(),
        unique_blocks,
        kv_blocks_derived: args.kv_blocks.is_none(),
        runs,
        pooled_bound,
        infinite_bound,
        sweep,
        markdown: String::new(),
    };
    report.markdown = markdown(args, &report, &workload);
    stdout
        .write_all(report.markdown.as_bytes())
        .map_err(|e| e.to_string())?;
    if let Some(dir) = &args.out {
        write_outputs(dir, args, &report).map_err(|e| format!("--out {}: {e}", dir.display()))?;
        writeln!(stdout, "\nWrote results to {}", dir.display()).map_err(|e| e.to_string())?;
    }
    writeln!(
        stdout,
        "\nReplayed {} requests × {} runs in {:.2} s.",
        report.requests,
        report.runs.len() + report.sweep.as_ref().map_or(0, |s| s.results.len()),
        started.elapsed().as_secs_f64()
    )
    .map_err(|e| e.to_string())?;
    Ok(report)
}

/// `--bench-workload`: the benchmark's workload `name` replayed offline,
/// every policy side by side, as a Markdown table.
fn run_bench_workload(
    args: &ReplayArgs,
    name: &str,
    stdout: &mut dyn Write,
) -> Result<Report, String> {
    let options = crate::bench::workload::GenOptions {
        quick: false,
        seed: args.seed,
        load: 0.7,
        pods: args.pods,
        trace_path: args.trace.clone(),
        speedup: None,
        trace_requests: None,
        trace_offset: None,
        plugin_extra: json!({}),
        stock_vllm: false,
        prefill_speeds: args.prefill_speeds.clone(),
        cpu_tier: args.cpu_tier,
        tokenizer: None,
        time_scale: None,
    };
    let bench = crate::bench::workload::build(name, &options)?;
    let mut plugin = bench.plugin.clone();
    if let Some(path) = &args.config {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read --config {}: {e}", path.display()))?;
        let extra: Value =
            serde_json::from_str(&text).map_err(|e| format!("--config {}: {e}", path.display()))?;
        if let (Some(target), Some(extra)) = (plugin.as_object_mut(), extra.as_object()) {
            target.extend(extra.clone());
        }
    }
    plugin["pods"] = serde_json::to_value(
        sim_pods(bench.pods)
            .iter()
            .map(|p| json!({"id": p.id, "address": p.address}))
            .collect::<Vec<_>>(),
    )
    .map_err(|e| e.to_string())?;
    plugin["podCapacityBlocks"] = json!(bench.kv_blocks);
    if let Some(ms) = args.report_interval_ms {
        plugin["podReportIntervalMs"] = json!(ms);
    }
    if let Some(mode) = args.mode {
        plugin["mode"] = json!(mode_name(mode));
    }
    let config = Config::parse(plugin.to_string().as_bytes()).map_err(|e| e.to_string())?;
    let workload = Workload {
        requests: bench
            .requests
            .iter()
            .enumerate()
            .map(|(i, r)| Request {
                line: i + 1,
                arrival_us: (r.at_s * 1e6 / args.speedup) as u64,
                prompt_tokens: r.prompt_tokens,
                output_tokens: r.output_tokens.max(1),
                chain: r.chain.clone(),
                coverage: r.coverage,
                routable: true,
                session_key: xxhash_rust::xxh64::xxh64(r.session.as_bytes(), 0),
                follows_up: r.follows_up,
            })
            .collect(),
        reordered: 0,
    };
    let pods = PodSpec {
        count: bench.pods,
        kv_blocks: bench.kv_blocks,
        cpu_kv_blocks: bench.cpu_kv_blocks,
        max_batch: bench.max_batch,
        cost: CostModel::gpu_8b(bench.time_scale).with_reload_gbps(args.cpu_reload_gbps),
        prefill_speeds: args.prefill_speeds.clone(),
    };
    let runs: Vec<RunResult> = args
        .policies
        .iter()
        .map(|&policy| simulate(&workload, &pods, policy, &config, args.seed))
        .collect();
    let pooled_bound = bench.bounds.pooled;
    let mut markdown = format!(
        "## kvroute-replay: bench workload {name} (open loop, time scale {}, speedup {})\n\n{}\n\n{} pods × {} GPU KV blocks + {} CPU KV blocks, working set {} blocks\n\n| policy | hit rate (GPU + CPU) | CPU hit rate | of pooled bound | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | max pod share (× fair) | prefill per pod % | TTFT model error p50 |\n|---|---:|---:|---:|---:|---:|---:|---:|---|---:|\n",
        bench.time_scale,
        args.speedup,
        bench.description,
        bench.pods,
        bench.kv_blocks,
        bench.cpu_kv_blocks,
        bench.working_set_blocks
    );
    for run in &runs {
        let m = &run.summary;
        let _ = writeln!(
            markdown,
            "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.2}× | {} | {} |",
            run.policy.name(),
            pct(m.hit_rate),
            pct(m.cpu_hit_rate),
            pct(m.hit_rate / pooled_bound.max(1e-9)),
            m.ttft_p50_ms,
            m.ttft_p90_ms,
            m.ttft_p99_ms,
            m.max_pod_share * bench.pods as f64,
            m.prefill_shares
                .iter()
                .map(|&share| format!("{:.0}", share * 100.0))
                .collect::<Vec<_>>()
                .join("/"),
            m.prediction_error_p50.map_or("–".into(), pct)
        );
    }
    stdout
        .write_all(markdown.as_bytes())
        .map_err(|e| e.to_string())?;
    Ok(Report {
        config,
        requests: workload.requests.len(),
        unique_blocks: workload.unique_blocks(),
        pods,
        kv_blocks_derived: false,
        runs,
        pooled_bound,
        infinite_bound: bench.bounds.infinite,
        sweep: None,
        markdown,
    })
}

fn emit_openai(format: Format, trace: &Path, path: &Path, model: &str) -> Result<(), String> {
    let in_trace = |e: crate::trace::TraceError| format!("{}: {e}", trace.display());
    let lines: Vec<Value> = match format {
        Format::Mooncake => crate::trace::read_mooncake(trace)
            .map_err(in_trace)?
            .iter()
            .map(|r| crate::trace::openai_line(r, model))
            .collect(),
        Format::AzureConv => {
            azure::openai_lines(&azure::read(trace).map_err(in_trace)?, model).map_err(in_trace)?
        }
        Format::OpenAi => return Err("--emit-openai needs a Mooncake or Azure trace".into()),
    };
    let file = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    for line in &lines {
        serde_json::to_writer(&mut out, line)
            .and_then(|_| out.write_all(b"\n").map_err(serde_json::Error::io))
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    out.flush().map_err(|e| format!("{}: {e}", path.display()))
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

fn markdown(args: &ReplayArgs, report: &Report, workload: &Workload) -> String {
    let c = &report.config;
    let mut s = String::new();
    let span_s = workload.span_us() as f64 / 1e6;
    let _ = writeln!(s, "## kvroute-replay: {}\n", args.trace.display());
    let _ = writeln!(
        s,
        "- requests: {} over {:.1} s of trace time (speedup {}), {} prompt tokens{}",
        report.requests,
        span_s,
        args.speedup,
        workload.prompt_tokens(),
        if workload.reordered > 0 {
            format!(
                ", {} lines out of timestamp order (sorted)",
                workload.reordered
            )
        } else {
            String::new()
        }
    );
    let _ = writeln!(
        s,
        "- pods: {} × {} KV blocks of {} tokens{}, max batch {}; cost model: 8B-class GPU (prefill 0.9 s/4096 tokens + 45 ms, decode 20 ms/token) × time scale {}",
        report.pods.count,
        report.pods.kv_blocks,
        c.block_size_tokens,
        if report.kv_blocks_derived {
            format!(
                " (derived: working set {} blocks = {:.0}% of total)",
                report.unique_blocks,
                100.0 * report.unique_blocks as f64 / (report.pods.kv_blocks * report.pods.count) as f64
            )
        } else {
            format!(" (working set {} blocks)", report.unique_blocks)
        },
        report.pods.max_batch,
        report.pods.cost.time_scale
    );
    let w = &c.weights;
    let _ = writeln!(
        s,
        "- router: {} mode, reports {} {} ms, blocks of {} bytes (max {} per prompt), weights cache {:.3} load {:.3} queue {:.3} health {:.3} adapter {:.3}, maxQueue {}, no eligible pod: {}\n",
        mode_name(c.mode),
        if c.report_long_poll { "long-polled, wait" } else { "every" },
        c.pod_report_interval_ms,
        c.block_size_bytes,
        c.max_prefix_blocks,
        w.cache,
        w.load,
        w.queue,
        w.health,
        w.adapter,
        c.max_queue,
        match c.on_no_eligible_pod {
            NoPodPolicy::Wait => format!(
                "wait (≤ {} requests, ≤ {} ms)",
                c.max_waiting_requests, c.max_wait_ms
            ),
            _ => "503 and retry".into(),
        }
    );
    let _ = writeln!(
        s,
        "| policy | hit rate | of pooled bound | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | TTFT mean (ms) | max pod share | prefill per pod | 503s | TTFT model error p50 |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|");
    for run in &report.runs {
        let m = &run.summary;
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} | {} | {} |",
            run.policy.name(),
            pct(m.hit_rate),
            pct(m.hit_rate / report.pooled_bound.max(1e-9)),
            m.ttft_p50_ms,
            m.ttft_p90_ms,
            m.ttft_p99_ms,
            m.ttft_mean_ms,
            pct(m.max_pod_share),
            m.prefill_shares
                .iter()
                .map(|&share| format!("{:.0}", share * 100.0))
                .collect::<Vec<_>>()
                .join("/"),
            m.rejections,
            m.prediction_error_p50.map_or("–".into(), pct)
        );
    }
    let _ = writeln!(
        s,
        "| pooled-cache bound | {} | 100% | – | – | – | – | – | – | – | – |",
        pct(report.pooled_bound)
    );
    let _ = writeln!(
        s,
        "| infinite-cache bound | {} | – | – | – | – | – | – | – | – | – |",
        pct(report.infinite_bound)
    );
    if let Some(sweep) = &report.sweep {
        let obj = sweep.objective;
        let _ = writeln!(
            s,
            "\n### Sweep ({} points, objective {}{})\n",
            sweep.results.len(),
            obj,
            if obj.higher_is_better() {
                ", higher is better"
            } else {
                ", lower is better"
            }
        );
        let _ = writeln!(
            s,
            "| w_cache | w_load | w_queue | maxQueue | hit rate | TTFT p50 (ms) | TTFT p99 (ms) | max pod share | 503s | |"
        );
        let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
        for (i, r) in sweep.results.iter().enumerate() {
            let (w, m) = (&r.config.weights, &r.summary);
            let _ = writeln!(
                s,
                "| {:.2} | {:.3} | {:.3} | {} | {} | {:.0} | {:.0} | {} | {} | {} |",
                w.cache,
                w.load,
                w.queue,
                r.config.max_queue,
                pct(m.hit_rate),
                m.ttft_p50_ms,
                m.ttft_p99_ms,
                pct(m.max_pod_share),
                m.rejections,
                if i == sweep.best { "**best**" } else { "" }
            );
        }
        let best = &sweep.results[sweep.best];
        let _ = writeln!(
            s,
            "\nRecommended for {obj}: {}{}",
            recommended_json(&best.config),
            match &args.out {
                Some(dir) => format!(
                    "\nHeatmap: {} (bright = better, red outline = best; cells show {obj}{})",
                    dir.join("sweep-heatmap.png").display(),
                    obj.unit()
                ),
                None => String::new(),
            }
        );
    }
    s
}

/// The weights and maxQueue of `config` as a configuration fragment.
pub fn recommended_json(config: &Config) -> String {
    let w = &config.weights;
    let round = |v: f64| (v * 10_000.0).round() / 10_000.0;
    json!({
        "weights": {"cache": round(w.cache), "load": round(w.load), "queue": round(w.queue),
                     "health": round(w.health), "adapter": round(w.adapter)},
        "maxQueue": config.max_queue,
    })
    .to_string()
}

/// The routing-relevant configuration as kvroute JSON (without pods), so
/// the real-Envoy benchmark can run the same router.
pub fn router_config_json(config: &Config) -> Value {
    let w = &config.weights;
    json!({
        "weights": {"cache": w.cache, "load": w.load, "queue": w.queue, "health": w.health, "adapter": w.adapter},
        "maxQueue": config.max_queue,
        "healthExclusionThreshold": config.health_exclusion_threshold,
        "blockSizeBytes": config.block_size_bytes,
        "blockSizeTokens": config.block_size_tokens,
        "maxPrefixBlocks": config.max_prefix_blocks,
        "hashSeed": config.hash_seed,
        "mode": mode_name(config.mode),
        "maxIndexBlocks": config.max_index_blocks,
        "podCapacityBlocks": config.pod_capacity_blocks,
        "podReportIntervalMs": config.pod_report_interval_ms,
        "reportTimeoutMs": config.report_timeout_ms,
        "reportLongPoll": config.report_long_poll,
        "retryAfterSeconds": config.retry_after_seconds,
    })
}

fn summary_json(m: &Summary) -> Value {
    json!({
        "requests": m.requests,
        "hitRate": m.hit_rate,
        "cpuHitRate": m.cpu_hit_rate,
        "ttftP50Ms": m.ttft_p50_ms,
        "ttftP90Ms": m.ttft_p90_ms,
        "ttftP99Ms": m.ttft_p99_ms,
        "prefillShares": m.prefill_shares,
        "ttftPredictionErrorP50": m.prediction_error_p50,
        "ttftMeanMs": m.ttft_mean_ms,
        "maxPodShare": m.max_pod_share,
        "podShares": m.pod_shares,
        "rejections": m.rejections,
        "waitP50Ms": m.wait_p50_ms,
        "waitP99Ms": m.wait_p99_ms,
    })
}

/// The results as JSON (deterministic: no wall-clock values).
pub fn results_json(args: &ReplayArgs, report: &Report) -> Value {
    let runs: Vec<Value> = report
        .runs
        .iter()
        .map(|r| {
            let mut v = summary_json(&r.summary);
            v["policy"] = json!(r.policy.name());
            v
        })
        .collect();
    let sweep = report.sweep.as_ref().map(|s| {
        let points: Vec<Value> = s
            .results
            .iter()
            .map(|r| {
                json!({
                    "wCache": r.point.w_cache,
                    "maxQueue": r.point.max_queue,
                    "weights": router_config_json(&r.config)["weights"].clone(),
                    "metrics": summary_json(&r.summary),
                })
            })
            .collect();
        json!({
            "spec": args.sweep,
            "objective": s.objective.name(),
            "points": points,
            "best": s.best,
            "recommended": serde_json::from_str::<Value>(&recommended_json(&s.results[s.best].config)).unwrap_or(Value::Null),
        })
    });
    json!({
        "trace": args.trace.display().to_string(),
        "format": match args.format { Format::Mooncake => "mooncake", Format::OpenAi => "openai", Format::AzureConv => "azure" },
        "requests": report.requests,
        "uniqueBlocks": report.unique_blocks,
        "pods": {
            "count": report.pods.count,
            "kvBlocks": report.pods.kv_blocks,
            "kvBlocksDerived": report.kv_blocks_derived,
            "maxBatch": report.pods.max_batch,
            "prefillSecondsPerToken": report.pods.cost.prefill_s_per_token,
            "lookupOverheadSeconds": report.pods.cost.lookup_overhead_s,
            "decodeSecondsPerToken": report.pods.cost.decode_s_per_token,
            "timeScale": report.pods.cost.time_scale,
            // `--prefill-speeds`: pods past the list run at 1.
            "prefillSpeeds": report.pods.prefill_speeds,
        },
        "speedup": args.speedup,
        "seed": args.seed,
        "routerConfig": router_config_json(&report.config),
        "policies": runs,
        "bounds": {"pooledCache": report.pooled_bound, "infiniteCache": report.infinite_bound},
        "sweep": sweep,
    })
}

fn write_outputs(dir: &Path, args: &ReplayArgs, report: &Report) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let pretty = |v: &Value| serde_json::to_string_pretty(v).expect("JSON serialises") + "\n";
    std::fs::write(
        dir.join("results.json"),
        pretty(&results_json(args, report)),
    )?;
    std::fs::write(
        dir.join("router-config.json"),
        pretty(&router_config_json(&report.config)),
    )?;
    for run in &report.runs {
        let mut csv = String::from(
            "line,session,pod,arrival_ms,ttft_ms,prompt_tokens,cached_tokens,rejections,wait_ms,prefilled_tokens,predicted_ttft_ms,routed_prefill_tokens,work_tokens\n",
        );
        for o in &run.outcomes {
            let predicted = o
                .predicted_ttft_us
                .map_or(String::new(), |us| format!("{:.3}", us as f64 / 1000.0));
            let _ = writeln!(
                csv,
                "{},{:016x},{},{:.3},{:.3},{},{},{},{:.3},{},{predicted},{},{}",
                o.line,
                o.session_key,
                o.pod,
                o.arrival_us as f64 / 1000.0,
                o.ttft_us as f64 / 1000.0,
                o.prompt_tokens,
                o.cached_tokens,
                o.rejections,
                o.wait_us as f64 / 1000.0,
                o.prefilled_tokens,
                o.routed_prefill_tokens,
                o.work_tokens,
            );
        }
        std::fs::write(dir.join(format!("requests-{}.csv", run.policy.name())), csv)?;
    }
    if let Some(sweep) = &report.sweep {
        heatmap_of(sweep)
            .render(&dir.join("sweep-heatmap.png"))
            .map_err(std::io::Error::other)?;
    }
    Ok(())
}

/// The sweep as a heatmap: columns along the first axis, rows along the
/// second (one row when there is only one).
fn heatmap_of(sweep: &SweepReport) -> heatmap::Heatmap<'static> {
    let x = &sweep.spec.axes[0];
    let y = sweep.spec.axes.get(1);
    let rows = y.map_or(1, |a| a.values.len());
    let obj = sweep.objective;
    let mut values = vec![vec![0.0; x.values.len()]; rows];
    let mut cells = vec![vec![String::new(); x.values.len()]; rows];
    let mut best = (0, 0);
    for (i, r) in sweep.results.iter().enumerate() {
        // Points are laid out first axis slowest.
        let (col, row) = (i / rows, i % rows);
        let v = obj.value(&r.summary);
        values[row][col] = v;
        cells[row][col] = if obj.higher_is_better() {
            pct(v)
        } else {
            format!("{v:.0}")
        };
        if i == sweep.best {
            best = (row, col);
        }
    }
    let title: &'static str = match obj {
        Objective::TtftP99 => "KVROUTE SWEEP: TTFT P99 (MS)",
        Objective::TtftP50 => "KVROUTE SWEEP: TTFT P50 (MS)",
        Objective::HitRate => "KVROUTE SWEEP: HIT RATE",
    };
    heatmap::Heatmap {
        title,
        x_label: x.param.name(),
        x_values: x.values.iter().map(|&v| x.param.format(v)).collect(),
        y_label: y.map_or("", |a| a.param.name()),
        y_values: match y {
            Some(a) => a.values.iter().map(|&v| a.param.format(v)).collect(),
            None => vec![String::new()],
        },
        values,
        cells,
        best,
        higher_is_better: obj.higher_is_better(),
    }
}
