//! kvroute-vllm-bridge: a sidecar that subscribes to one vLLM pod's
//! KV-cache events (ZMQ, msgpack) and serves them as kvroute's report
//! protocol v1, so kvroute's precise mode works with stock vLLM.
//!
//! - [`wire`]: vLLM's event format;
//! - [`blocks`]: the pod's blocks as kvroute chain keys;
//! - [`bridge`]: the ZMQ subscription, gaps, replays and epochs;
//! - [`server`]: the report, `/metrics` and `/health`;
//! - [`vocab`]: token ids back to text bytes, for the text-mode keys;
//! - [`capacity`]: the pod's cache size.

pub mod blocks;
pub mod bridge;
pub mod capacity;
pub mod server;
pub mod vocab;
pub mod wire;

use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use tokio::net::TcpListener;

use kvroute::hashing::BlockLayout;

use crate::blocks::{Hashing, TextHashing};
use crate::bridge::{Bridge, Endpoints};
use crate::vocab::Vocabulary;

/// Command-line options of `kvroute-vllm-bridge`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "kvroute-vllm-bridge",
    about = "Serves a vLLM pod's KV-cache events as kvroute report protocol v1"
)]
pub struct Options {
    /// vLLM's KV events PUB endpoint (`endpoint` of `--kv-events-config`):
    /// `ipc://PATH` as vLLM binds it, or `tcp://HOST:PORT` (a host instead
    /// of vLLM's `*`).
    #[arg(long)]
    pub events: String,
    /// vLLM's `replay_endpoint` (`ipc://PATH` or `tcp://HOST:PORT`);
    /// without it every gap is a resync.
    #[arg(long)]
    pub replay: Option<String>,
    /// vLLM's `topic`.
    #[arg(long, default_value = "")]
    pub topic: String,
    /// Address to serve reports on.
    #[arg(long, default_value = "0.0.0.0:8081")]
    pub listen: String,
    /// The pod's id in kvroute's config (`podId` of reports).
    #[arg(long)]
    pub pod_id: String,
    /// kvroute's configuration file: `hashSeed`, the block layouts
    /// (`blockSizeTokens`, `blockSizeBytes`, `coarseAfterBlocks`,
    /// `coarseBlockFactor`, `maxPrefixBlocks`) and `reportPath` come from
    /// it (defaults without).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The model vLLM serves, as `baseModel` in kvroute's `models`.
    #[arg(long)]
    pub base_model: String,
    /// `NAME=ID`: the adapter vLLM numbers `ID` (its `lora_int_id`), for
    /// older vLLM whose events carry `lora_id` but no `lora_name`
    /// (repeatable or comma-separated).
    #[arg(long, value_delimiter = ',', value_parser = parse_lora_id)]
    pub lora_id: Vec<(String, i64)>,
    /// The served model's Hugging Face `tokenizer.json` (byte-level BPE:
    /// Llama 3, Qwen 2/3, GPT-2 style): stored blocks also get text-mode
    /// keys, their tokens decoded to text, so text and chat requests match
    /// them. Without it, only token-ID prompts do.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// How often the replay socket is asked whether the publisher is
    /// still the same (restart detection, missed batches).
    #[arg(long, default_value_t = 1000)]
    pub probe_ms: u64,
    /// Bound of the report event log (block events).
    #[arg(long, default_value_t = 100_000)]
    pub log_events: usize,
    /// The pod's GPU cache in vLLM blocks (`num_gpu_blocks` in vLLM's
    /// start-up log), reported as `kvCapacityBlocks`.
    #[arg(long, conflicts_with = "vllm_metrics")]
    pub kv_capacity_blocks: Option<u64>,
    /// vLLM's metrics page (`http://HOST:PORT/metrics`): the cache size is
    /// read from its `vllm:cache_config_info` every 10 s.
    #[arg(long)]
    pub vllm_metrics: Option<String>,
}

fn parse_lora_id(text: &str) -> Result<(String, i64), String> {
    let (name, id) = text
        .split_once('=')
        .ok_or_else(|| format!("expected NAME=ID, got {text:?}"))?;
    let id = id
        .parse()
        .map_err(|_| format!("lora id of {name:?} is not a number"))?;
    Ok((name.to_string(), id))
}

/// A running bridge: its state, the address it serves on, and its tasks
/// (stopped on drop).
pub struct Running {
    pub bridge: Arc<Bridge>,
    pub addr: std::net::SocketAddr,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// Stops the bridge and waits until its sockets are closed (the listen
    /// address is free again).
    pub async fn stop(mut self) {
        for task in std::mem::take(&mut self.tasks) {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Binds and starts following the pod (on the current tokio runtime).
pub async fn start(options: Options) -> Result<Running, String> {
    bridge::check_endpoint("--events", &options.events)?;
    if options.kv_capacity_blocks == Some(0) {
        return Err("--kv-capacity-blocks must be at least 1".into());
    }
    if let Some(url) = &options.vllm_metrics {
        if !url.starts_with("http://") {
            return Err(format!(
                "--vllm-metrics {url:?} must be an http:// URL (vLLM's /metrics)"
            ));
        }
    }
    if let Some(replay) = &options.replay {
        bridge::check_endpoint("--replay", replay)?;
    }
    let config = match &options.config {
        None => kvroute::config::Config::default(),
        Some(path) => {
            let bytes =
                std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            kvroute::config::Config::parse(&bytes).map_err(|e| e.to_string())?
        }
    };
    let text = match &options.tokenizer {
        None => None,
        Some(path) => Some(TextHashing {
            layout: BlockLayout::text(&config),
            vocabulary: Arc::new(Vocabulary::load(path)?),
        }),
    };
    let hashing = Hashing {
        secret: config.hash_seed.clone(),
        base_model: options.base_model.clone(),
        layout: BlockLayout::tokens(&config),
        lora_ids: options
            .lora_id
            .iter()
            .map(|(name, id)| (*id, name.clone()))
            .collect(),
        text,
    };
    let listener = TcpListener::bind(&options.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", options.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let bridge = Arc::new(Bridge::new(
        options.pod_id.clone(),
        hashing,
        options.log_events,
    ));
    let app = server::app(bridge.clone(), &config.report_path);
    let endpoints = Endpoints {
        events: options.events.clone(),
        replay: options.replay.clone(),
        topic: options.topic.clone(),
    };
    let follower = bridge.clone();
    let probe = std::time::Duration::from_millis(options.probe_ms.max(10));
    // Set before the first report is served.
    if let Some(blocks) = options.kv_capacity_blocks {
        bridge.capacity.set(blocks);
    }
    let mut tasks = vec![
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        }),
        tokio::spawn(async move { follower.run(endpoints, probe).await }),
    ];
    if let Some(url) = options.vllm_metrics.clone() {
        tasks.push(tokio::spawn(capacity::follow(url, bridge.capacity.clone())));
    }
    Ok(Running {
        bridge,
        addr,
        tasks,
    })
}
