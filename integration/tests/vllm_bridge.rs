//! kvroute-vllm-bridge against kvroute-sim in `--kv-events` mode, over
//! real ZMQ and HTTP sockets: the bridge's report must hold exactly the
//! blocks the sim's cache holds (the sim's own protocol v1 report is the
//! truth), through evictions, `AllBlocksCleared`, gaps with replay, gaps
//! beyond the replay buffer, a bridge restart, a pod restart and garbage
//! frames. Never a block the pod does not hold. Then in real Envoy:
//! kvroute's precise mode fed only by bridges routes to the pod holding a
//! prompt's prefix, the adapter's chains apart from the base model's:
//! token-ID prompts, and on pods tokenizing as vLLM does (`--tokenizer`),
//! text and chat prompts through their text keys.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvroute::config::Config;
use kvroute::hashing::{hash_bytes, hash_tokens, BlockLayout, BlockMode, ChainSeed};
use kvroute::report::{parse_report, Tier};
use kvroute_integration::bench::workload::STOCK_VLLM_CHAT_TEMPLATE;
use kvroute_integration::harness::{
    free_port, prometheus_value, BridgePorts, Cluster, ClusterSpec, Sim,
};
use kvroute_integration::http;
use kvroute_integration::tokenizer::SimTokenizer;
use kvroute_vllm_bridge::{start, Options, Running};
use serde_json::json;

const SIM: &str = env!("CARGO_BIN_EXE_kvroute-sim");

/// 16-token blocks, coarse ones of 2 past the 4th (so short prompts cross
/// into them); `m` and its adapter `m-lora` (vLLM's `lora_name` `lora-a`).
fn config_file(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).expect("temp dir");
    let file = dir.join("kvroute.json");
    let config = json!({
        "blockSizeTokens": 16,
        "coarseAfterBlocks": 4,
        "coarseBlockFactor": 2,
        "pods": [{"id": "pod-0", "address": "127.0.0.1:1"}],
        "models": {
            "m": {"baseModel": "m"},
            "m-lora": {"baseModel": "m", "adapter": "lora-a"},
        },
    });
    std::fs::write(&file, config.to_string()).expect("config written");
    file
}

/// A sim publishing KV events, and the ports it publishes on.
struct Pod {
    sim: Sim,
    port: u16,
    events: String,
    replay: String,
    args: Vec<String>,
    config: PathBuf,
}

impl Pod {
    /// A sim publishing on loopback TCP ports.
    fn start(config: &Path, extra: &[&str]) -> Pod {
        let events = format!("tcp://127.0.0.1:{}", free_port());
        let replay = format!("tcp://127.0.0.1:{}", free_port());
        Pod::start_on(config, extra, events, replay)
    }

    /// A sim binding its sockets in `dir`, as vLLM binds `ipc://` endpoints.
    fn start_ipc(config: &Path, dir: &Path, extra: &[&str]) -> Pod {
        let events = format!("ipc://{}", dir.join("kv-events.sock").display());
        let replay = format!("ipc://{}", dir.join("kv-replay.sock").display());
        Pod::start_on(config, extra, events, replay)
    }

    fn start_on(config: &Path, extra: &[&str], events: String, replay: String) -> Pod {
        let mut args: Vec<String> = [
            "--kv-events",
            &events,
            "--kv-replay",
            &replay,
            "--time-scale",
            "0.01",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        let port = free_port();
        let sim = Sim::start_on(Path::new(SIM), "pod-0", port, config, &args).expect("sim starts");
        Pod {
            sim,
            port,
            events,
            replay,
            args,
            config: config.to_path_buf(),
        }
    }

    /// Kills the sim and starts it again on the same ports (a pod restart).
    fn restart(&mut self) {
        self.sim.kill();
        self.sim = Sim::start_on(Path::new(SIM), "pod-0", self.port, &self.config, &self.args)
            .expect("sim restarts");
    }

    /// A token-ID completion of `tokens` (max 1 output token).
    fn complete(&self, model: &str, tokens: &[u32]) {
        self.complete_salted(model, tokens, None);
    }

    /// [`Pod::complete`] with vLLM's `cache_salt`.
    fn complete_salted(&self, model: &str, tokens: &[u32], salt: Option<&str>) {
        let body = json!({"model": model, "prompt": tokens, "max_tokens": 1, "cache_salt": salt});
        let r = http::post_json(&self.sim.address, "/v1/completions", &body.to_string())
            .expect("completion");
        assert_eq!(r.status, 200, "{}", r.body);
    }

    /// The blocks the sim's cache holds (its own full report).
    fn blocks(&self) -> BTreeSet<u64> {
        report_blocks(&self.sim.address).1
    }
}

/// Each block of a full report from `address`, with its tier.
fn report_tiers(address: &str) -> BTreeMap<u64, Tier> {
    let r = http::get(address, "/kvroute/v1/report").expect("report");
    let report = parse_report(r.body.as_bytes()).expect("valid report");
    report
        .stored
        .iter()
        .flat_map(|c| c.hashes.iter().map(move |&h| (h, c.tier)))
        .collect()
}

/// `(epoch, blocks)` of a full report from `address`.
fn report_blocks(address: &str) -> (String, BTreeSet<u64>) {
    let r = http::get(address, "/kvroute/v1/report").expect("report");
    assert_eq!(r.status, 200, "{}", r.body);
    let report = parse_report(r.body.as_bytes()).expect("valid report");
    assert!(report.full);
    let blocks = report
        .stored
        .iter()
        .flat_map(|c| c.hashes.iter().copied())
        .collect();
    (report.epoch, blocks)
}

fn bridge(pod: &Pod, listen: &str, config: &Path) -> Running {
    bridge_decoding(pod, listen, config, None)
}

/// [`bridge`] with `--tokenizer`: text keys too.
fn bridge_decoding(pod: &Pod, listen: &str, config: &Path, tokenizer: Option<&Path>) -> Running {
    bridge_probing(pod, listen, config, tokenizer, 100)
}

/// [`bridge_decoding`] asking the replay socket every `probe_ms`.
fn bridge_probing(
    pod: &Pod,
    listen: &str,
    config: &Path,
    tokenizer: Option<&Path>,
    probe_ms: u64,
) -> Running {
    http::runtime()
        .block_on(start(Options {
            events: pod.events.clone(),
            replay: Some(pod.replay.clone()),
            topic: String::new(),
            listen: listen.to_string(),
            pod_id: "pod-0".into(),
            config: Some(config.to_path_buf()),
            base_model: "m".into(),
            lora_id: Vec::new(),
            tokenizer: tokenizer.map(Path::to_path_buf),
            probe_ms,
            log_events: 100_000,
            kv_capacity_blocks: None,
            vllm_metrics: None,
        }))
        .expect("bridge starts")
}

fn counter(running: &Running, name: &str) -> f64 {
    let text = http::get(&running.addr.to_string(), "/metrics")
        .expect("metrics")
        .body;
    prometheus_value(&text, name, &[]).unwrap_or_else(|| panic!("{name} in\n{text}"))
}

/// Waits until the bridge reports exactly the sim's blocks (events take a
/// moment to arrive: until then it may lag); returns them.
fn converged(pod: &Pod, running: &Running) -> BTreeSet<u64> {
    converged_to(running, || pod.blocks())
}

/// Waits until the bridge reports exactly `truth()`; returns it.
fn converged_to(running: &Running, truth: impl Fn() -> BTreeSet<u64>) -> BTreeSet<u64> {
    eventually_equal(
        truth,
        || report_blocks(&running.addr.to_string()).1,
        |truth, bridged| {
            format!(
                "bridge has {} blocks the sim has not (stale) and misses {} of its {}",
                bridged.difference(truth).count(),
                truth.difference(bridged).count(),
                truth.len()
            )
        },
    )
}

/// Waits until `bridged()` is `truth()` (events take a moment to arrive:
/// until then the bridge may lag); returns it, or fails with `describe`.
fn eventually_equal<T: PartialEq>(
    truth: impl Fn() -> T,
    bridged: impl Fn() -> T,
    describe: impl Fn(&T, &T) -> String,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (truth, bridged) = (truth(), bridged());
        if bridged == truth {
            return truth;
        }
        assert!(Instant::now() < deadline, "{}", describe(&truth, &bridged));
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A prompt of `blocks` 16-token blocks, distinct per `seed`, plus a
/// partial block (never cached).
fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16 + 5).map(|i| seed * 100_000 + i).collect()
}

/// The kvroute keys of `tokens`' whole blocks for model `m`: the sim's
/// and the filter's chain.
fn keys(config: &Path, tokens: &[u32]) -> BTreeSet<u64> {
    let config = Config::parse(&std::fs::read(config).expect("config")).expect("valid");
    let seed = ChainSeed::new(&config.hash_seed, "m", None, BlockMode::Tokens);
    let layout = BlockLayout::tokens(&config).uncapped();
    hash_tokens(&seed, tokens, &layout).into_iter().collect()
}

/// The union of `keys` of each prompt.
fn keys_of(config: &Path, prompts: &[&[u32]]) -> BTreeSet<u64> {
    prompts.iter().flat_map(|p| keys(config, p)).collect()
}

/// The first `blocks` whole blocks of `head`, then one new block (and a
/// partial one): a prompt continuing `head`'s cached prefix.
fn continuing(head: &[u32], blocks: usize, seed: u32) -> Vec<u32> {
    [&head[..blocks * 16], &prompt(seed, 1)[..]].concat()
}

/// Waits until `name` reaches `at_least`.
fn counter_reaches(running: &Running, name: &str, at_least: f64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while counter(running, name) < at_least {
        assert!(Instant::now() < deadline, "{name} stays below {at_least}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvroute-bridge-{name}-{}", std::process::id()))
}

/// Both wire shapes, base model and adapter, shared prefixes, LRU
/// evictions and AllBlocksCleared: the bridge's keys are the sim's (which
/// hashes like the filter), block for block.
#[test]
fn the_bridge_reports_exactly_the_pods_cache() {
    let dir = temp("exact");
    let config = config_file(&dir);
    for format in ["map", "array"] {
        let pod = Pod::start(
            &config,
            &["--kv-events-format", format, "--kv-blocks", "40"],
        );
        let running = bridge(&pod, "127.0.0.1:0", &config);
        let shared = prompt(1, 6);
        pod.complete("m", &shared);
        let mut longer = shared.clone();
        longer.truncate(6 * 16);
        longer.extend(prompt(2, 3));
        pod.complete("m", &longer);
        pod.complete("m-lora", &shared);
        let held = converged(&pod, &running);
        // kvroute blocks: 4 fine + 1 coarse; + 1 coarse (9 vLLM blocks,
        // the 9th inside an incomplete coarse one); + 5 for the adapter.
        assert_eq!(held.len(), 11, "{format}");
        // Past the 40-block capacity: evictions.
        for seed in 3..8 {
            pod.complete("m", &prompt(seed, 8));
        }
        converged(&pod, &running);
        pod.sim.fault(json!({"clearAll": true}));
        assert!(converged(&pod, &running).is_empty());
        pod.complete("m-lora", &prompt(9, 4));
        assert_eq!(converged(&pod, &running).len(), 4);
        assert_eq!(counter(&running, "kvbridge_malformed_frames_total"), 0.0);
        assert_eq!(counter(&running, "kvbridge_resyncs_total"), 0.0);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A pod with a CPU tier (`--cpu-kv-blocks`): blocks its GPU evicts move
/// to host memory and are published as vLLM's offloading connector does by
/// default (a `CPU` store named by hash only, then the `GPU` removal),
/// reloads as `GPU` stores and `CPU` removals. The bridge reports every
/// block in the tier the pod's own report gives it, through offloads, a
/// reload, CPU evictions and a gap replayed.
#[test]
fn the_bridge_follows_blocks_across_tiers() {
    let dir = temp("tiers");
    let config = config_file(&dir);
    let pod = Pod::start(&config, &["--kv-blocks", "8", "--cpu-kv-blocks", "12"]);
    let running = bridge(&pod, "127.0.0.1:0", &config);
    let converged = || {
        eventually_equal(
            || report_tiers(&pod.sim.address),
            || report_tiers(&running.addr.to_string()),
            |truth, bridged| format!("pod {truth:?}\nbridge {bridged:?}"),
        )
    };
    let in_tier =
        |tiers: &BTreeMap<u64, Tier>, tier| tiers.values().filter(|t| **t == tier).count();
    let a = prompt(1, 4);
    pod.complete("m", &a);
    pod.complete("m", &prompt(2, 4));
    pod.complete("m", &prompt(3, 4));
    // The GPU keeps 8 blocks: a's 4 went to the CPU tier.
    let tiers = converged();
    assert_eq!(
        (in_tier(&tiers, Tier::Gpu), in_tier(&tiers, Tier::Cpu)),
        (8, 4)
    );
    assert!(keys(&config, &a).iter().all(|k| tiers[k] == Tier::Cpu));
    // a again: reloaded to the GPU, and the least recent 4 offloaded.
    pod.complete("m", &a);
    let tiers = converged();
    assert!(keys(&config, &a).iter().all(|k| tiers[k] == Tier::Gpu));
    assert_eq!(in_tier(&tiers, Tier::Cpu), 4);
    // The pod served it from the CPU tier: 4 blocks of 16 tokens reloaded.
    assert_eq!(pod.sim.stats()["cachedTokensCpu"], 64);
    // More: the CPU tier (12) evicts its oldest; a gap is replayed.
    pod.sim.fault(json!({"kvDrop": 1}));
    for seed in 4..7 {
        pod.complete("m", &prompt(seed, 4));
    }
    let tiers = converged();
    assert_eq!(
        (in_tier(&tiers, Tier::Gpu), in_tier(&tiers, Tier::Cpu)),
        (8, 12)
    );
    let stats = pod.sim.stats();
    assert_eq!(stats["kvCpuBlocks"], 12);
    let metric = |tier: &str| {
        let text = http::get(&running.addr.to_string(), "/metrics")
            .unwrap()
            .body;
        prometheus_value(&text, "kvbridge_tier_blocks", &[("tier", tier)]).expect("tier gauge")
    };
    assert_eq!(
        (metric("gpu"), metric("cpu"), metric("disk")),
        (8.0, 12.0, 0.0)
    );
    assert_eq!(
        counter(&running, "kvbridge_blocks_skipped_unknown_hash_total"),
        0.0
    );
    assert_eq!(counter(&running, "kvbridge_resyncs_total"), 0.0);
    let _ = std::fs::remove_dir_all(dir);
}

/// Batches missing from the subscription come back by replay: same
/// epoch, nothing lost. Garbage frames are counted and passed over.
#[test]
fn gaps_are_replayed_and_garbage_is_skipped() {
    let dir = temp("gap");
    let config = config_file(&dir);
    let pod = Pod::start(&config, &[]);
    let running = bridge(&pod, "127.0.0.1:0", &config);
    pod.complete("m", &prompt(1, 2));
    converged(&pod, &running);
    let (epoch, _) = report_blocks(&running.addr.to_string());
    pod.sim.fault(json!({"kvDrop": 2}));
    for seed in 2..5 {
        pod.complete("m", &prompt(seed, 2));
    }
    assert_eq!(converged(&pod, &running).len(), 8);
    assert_eq!(report_blocks(&running.addr.to_string()).0, epoch);
    assert!(counter(&running, "kvbridge_gaps_total") >= 1.0);
    assert!(counter(&running, "kvbridge_replays_total") >= 2.0);
    assert_eq!(counter(&running, "kvbridge_resyncs_total"), 0.0);

    pod.sim.fault(json!({"kvGarbage": true}));
    pod.complete("m", &prompt(5, 2));
    assert_eq!(converged(&pod, &running).len(), 10);
    assert_eq!(counter(&running, "kvbridge_malformed_frames_total"), 3.0);
    assert_eq!(report_blocks(&running.addr.to_string()).0, epoch);
    let _ = std::fs::remove_dir_all(dir);
}

/// Only batches the subscription skips are gaps. A probe that finds
/// batches before the subscription delivers them is a race, not a loss
/// (on vLLM the subscription's copy is on its way, or waits while the
/// probe runs): here the sim sends every batch 150 ms after buffering it
/// and the bridge probes every 20 ms, so the probe applies them first and
/// counts them in `kvbridge_probe_ahead_total`, while gaps stay 0. A batch
/// left off the PUB socket is one gap, whether the probe applied it
/// first (lagging) or a replay fills it (not lagging); same epoch.
#[test]
fn only_batches_the_subscription_skips_are_gaps() {
    let dir = temp("probe-ahead");
    let config = config_file(&dir);
    let pod = Pod::start(&config, &[]);
    let running = bridge_probing(&pod, "127.0.0.1:0", &config, None, 20);
    pod.complete("m", &prompt(1, 2));
    converged(&pod, &running);
    let (epoch, _) = report_blocks(&running.addr.to_string());
    pod.sim.fault(json!({"kvLagMs": 150}));
    for seed in 2..8 {
        pod.complete("m", &prompt(seed, 2));
    }
    converged(&pod, &running);
    // The subscription's late copies arrive, as duplicates.
    std::thread::sleep(Duration::from_millis(400));
    assert!(counter(&running, "kvbridge_probe_ahead_total") >= 1.0);
    assert_eq!(counter(&running, "kvbridge_gaps_total"), 0.0);
    assert_eq!(counter(&running, "kvbridge_batches_total"), 7.0);

    pod.sim.fault(json!({"kvDrop": 1}));
    pod.complete("m", &prompt(8, 2));
    pod.complete("m", &prompt(9, 2));
    counter_reaches(&running, "kvbridge_gaps_total", 1.0);
    pod.sim.fault(json!({"kvLagMs": 0, "kvDrop": 1}));
    pod.complete("m", &prompt(10, 2));
    pod.complete("m", &prompt(11, 2));
    counter_reaches(&running, "kvbridge_gaps_total", 2.0);
    assert_eq!(converged(&pod, &running).len(), 22);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(counter(&running, "kvbridge_gaps_total"), 2.0);
    assert_eq!(counter(&running, "kvbridge_resyncs_total"), 0.0);
    assert_eq!(report_blocks(&running.addr.to_string()).0, epoch);
    let _ = std::fs::remove_dir_all(dir);
}

/// vLLM binds `ipc://` endpoints, and the recommended setup uses them to
/// keep every prompt's token ids off the network: the sim binds both
/// sockets on files, and the bridge follows them. A bridge started after
/// the pod cached a prompt rebuilds it from a replay; it then follows the
/// subscription, and a batch left off it is one gap, filled from the
/// replay socket; a pod killed and started again on the same files (its
/// stale socket files left behind) is found by the probe, and the bridge
/// reconnects to its empty cache and follows its new blocks.
#[test]
fn events_and_replays_flow_over_ipc() {
    let dir = temp("ipc");
    let config = config_file(&dir);
    let mut pod = Pod::start_ipc(&config, &dir, &[]);
    assert!(pod.events.starts_with("ipc://") && pod.replay.starts_with("ipc://"));
    let a = prompt(1, 3);
    pod.complete("m", &a);
    let running = bridge(&pod, "127.0.0.1:0", &config);
    assert_eq!(converged(&pod, &running), keys(&config, &a));
    assert_eq!(counter(&running, "kvbridge_replays_total"), 1.0);
    let (epoch, _) = report_blocks(&running.addr.to_string());
    pod.complete("m", &prompt(2, 3));
    assert_eq!(converged(&pod, &running).len(), 6);
    pod.sim.fault(json!({"kvDrop": 1}));
    pod.complete("m", &prompt(3, 3));
    pod.complete("m", &prompt(4, 3));
    assert_eq!(converged(&pod, &running).len(), 12);
    assert_eq!(report_blocks(&running.addr.to_string()).0, epoch);
    counter_reaches(&running, "kvbridge_gaps_total", 1.0);
    assert_eq!(counter(&running, "kvbridge_replay_failures_total"), 0.0);
    assert_eq!(counter(&running, "kvbridge_resyncs_total"), 0.0);

    pod.restart();
    assert!(converged(&pod, &running).is_empty());
    let b = prompt(5, 2);
    pod.complete("m", &b);
    assert_eq!(converged(&pod, &running), keys(&config, &b));
    assert_eq!(counter(&running, "kvbridge_connects_total"), 2.0);
    assert_eq!(counter(&running, "kvbridge_gaps_total"), 1.0);
    let _ = std::fs::remove_dir_all(dir);
}

/// A hole: batches vLLM numbered but never published (lost before they
/// were buffered). The bridge starts a new epoch rebuilt from the oldest
/// batch the buffer holds, not from the hole, keeping exactly the blocks
/// the buffer proves: those stored after the newest hole, and those stored
/// before it that a later batch continues (the lost batch may have removed
/// any other). Found by the subscription (the next batch arrives) and by
/// the probe alone (the next batch is also missed, then replayed).
#[test]
fn a_hole_rebuilds_from_the_oldest_buffered_batch() {
    let dir = temp("true-hole");
    let config = config_file(&dir);
    let pod = Pod::start(&config, &[]);
    let running = bridge_probing(&pod, "127.0.0.1:0", &config, None, 300);
    let a = prompt(1, 3);
    let b = prompt(2, 3);
    pod.complete("m", &a);
    pod.complete("m", &b);
    converged(&pod, &running);
    let (first_epoch, _) = report_blocks(&running.addr.to_string());
    // Batch 2 (c) is lost; batch 3 (d) continues a's prefix.
    pod.sim.fault(json!({"kvLose": 1}));
    let c = prompt(3, 3);
    pod.complete("m", &c);
    let d = continuing(&a, 3, 4);
    pod.complete("m", &d);
    assert_eq!(pod.blocks(), keys_of(&config, &[&a, &b, &c, &d]));
    // a is proven by d; b may have gone in the lost batch; c never came.
    converged_to(&running, || keys_of(&config, &[&a, &d]));
    let (second_epoch, _) = report_blocks(&running.addr.to_string());
    assert_ne!(second_epoch, first_epoch);
    assert_eq!(counter(&running, "kvbridge_resyncs_total"), 1.0);
    // Batch 4 (e) is lost and batch 5 (f, continuing b) left off the PUB
    // socket: only the probe finds the hole (batch 3, then 5).
    pod.sim.fault(json!({"kvLose": 1, "kvDrop": 1}));
    let e = prompt(5, 2);
    pod.complete("m", &e);
    let f = continuing(&b, 3, 6);
    pod.complete("m", &f);
    counter_reaches(&running, "kvbridge_resyncs_total", 2.0);
    // Past the newest hole (batch 4) only f proves anything: b again, but
    // no longer a or d.
    converged_to(&running, || keys_of(&config, &[&b, &f]));
    assert_ne!(report_blocks(&running.addr.to_string()).0, second_epoch);
    assert_eq!(counter(&running, "kvbridge_malformed_frames_total"), 0.0);
    let _ = std::fs::remove_dir_all(dir);
}

/// An overrun: more batches missed than the replay buffer keeps (3 here).
/// New epoch, rebuilt from the oldest batch still held, holding exactly
/// the blocks those batches stored and can key: a chain continuing a
/// prefix stored in a batch gone from the buffer is left out.
#[test]
fn an_overrun_rebuilds_from_the_oldest_buffered_batch() {
    let dir = temp("overrun");
    let config = config_file(&dir);
    let pod = Pod::start(&config, &["--kv-replay-buffer", "3"]);
    // No probe: the subscription finds the gap.
    let running = bridge_probing(&pod, "127.0.0.1:0", &config, None, 60_000);
    let a = prompt(1, 3);
    pod.complete("m", &a);
    pod.complete("m", &prompt(2, 3));
    converged(&pod, &running);
    let (epoch, _) = report_blocks(&running.addr.to_string());
    // Batches 2 to 5 are missed; the buffer keeps 4, 5 and 6 (g).
    pod.sim.fault(json!({"kvDrop": 4}));
    pod.complete("m", &prompt(3, 3));
    pod.complete("m", &prompt(4, 3));
    let e = prompt(5, 3);
    pod.complete("m", &e);
    let f = continuing(&e, 3, 6);
    pod.complete("m", &f);
    let g = continuing(&a, 3, 7);
    pod.complete("m", &g);
    // e and f, whole; g's new block continues a, stored in batch 0.
    converged_to(&running, || keys_of(&config, &[&e, &f]));
    assert_ne!(report_blocks(&running.addr.to_string()).0, epoch);
    assert_eq!(counter(&running, "kvbridge_resyncs_total"), 1.0);
    assert_eq!(
        counter(&running, "kvbridge_blocks_skipped_unknown_parent_total"),
        1.0
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A restarted publisher (numbering from 0 again, empty cache) that
/// publishes at once, racing the bridge's reconnect: the new epoch is
/// rebuilt from its buffer, including batches published between the
/// replay and the subscription taking effect, and holds exactly its cache.
#[test]
fn a_restarted_publisher_is_rebuilt_from_its_buffer() {
    let dir = temp("publisher-restart");
    let config = config_file(&dir);
    let mut pod = Pod::start(&config, &[]);
    let running = bridge(&pod, "127.0.0.1:0", &config);
    pod.complete("m", &prompt(1, 3));
    converged(&pod, &running);
    let (epoch, _) = report_blocks(&running.addr.to_string());
    for round in 0..3u32 {
        pod.restart();
        let head = prompt(10 + round, 3);
        pod.complete("m", &head);
        pod.complete("m", &continuing(&head, 2, 20 + round));
        pod.complete("m-lora", &head);
        let held = converged(&pod, &running);
        assert_eq!(held.len(), 3 + 1 + 3, "round {round}");
        assert_ne!(report_blocks(&running.addr.to_string()).0, epoch);
    }
    assert!(counter(&running, "kvbridge_connects_total") >= 2.0);
    let _ = std::fs::remove_dir_all(dir);
}

/// A vLLM publishing `extra_keys` in a form the bridge does not know (the
/// typed form proposed upstream: `LoRAKey` and `CacheSaltKey` structs), in
/// both wire shapes: the adapter's and the salted request's blocks are
/// refused and counted, nothing else: the base model's unsalted blocks are
/// bridged, before and after, and no frame counts as malformed.
#[test]
fn extra_keys_of_an_unknown_form_refuse_their_blocks_only() {
    let dir = temp("typed-extra-keys");
    let config = config_file(&dir);
    for format in ["map", "array"] {
        let pod = Pod::start(
            &config,
            &["--kv-typed-extra-keys", "--kv-events-format", format],
        );
        let running = bridge(&pod, "127.0.0.1:0", &config);
        let plain = prompt(1, 3);
        pod.complete("m", &plain);
        pod.complete("m-lora", &prompt(2, 3));
        pod.complete_salted("m", &prompt(3, 3), Some("tenant-a"));
        let later = prompt(4, 2);
        pod.complete("m", &later);
        assert_eq!(pod.blocks().len(), 3 + 3 + 3 + 2, "{format}");
        converged_to(&running, || keys_of(&config, &[&plain, &later]));
        assert_eq!(
            counter(&running, "kvbridge_blocks_skipped_unknown_extra_keys_total"),
            6.0,
            "{format}"
        );
        assert_eq!(counter(&running, "kvbridge_malformed_frames_total"), 0.0);
        assert_eq!(
            counter(&running, "kvbridge_blocks_skipped_extra_keys_total"),
            0.0
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A restarted bridge rebuilds from the replay buffer (new epoch); a
/// restarted pod (seq from 0, empty cache) drops every block.
#[test]
fn bridge_and_pod_restarts_leave_nothing_stale() {
    let dir = temp("restart");
    let config = config_file(&dir);
    let mut pod = Pod::start(&config, &[]);
    // Bound at once (a port picked free and bound later may be taken by
    // then); restarted on the same address.
    let running = bridge(&pod, "127.0.0.1:0", &config);
    let listen = running.addr.to_string();
    pod.complete("m", &prompt(1, 3));
    pod.complete("m-lora", &prompt(2, 3));
    let held = converged(&pod, &running);
    let (epoch, _) = report_blocks(&listen);
    http::runtime().block_on(running.stop());
    let running = bridge(&pod, &listen, &config);
    assert_eq!(converged(&pod, &running), held);
    assert_ne!(report_blocks(&listen).0, epoch);

    pod.restart();
    assert!(converged(&pod, &running).is_empty());
    assert!(counter(&running, "kvbridge_publisher_restarts_total") >= 1.0);
    pod.complete("m", &prompt(3, 2));
    assert_eq!(converged(&pod, &running).len(), 2);
    let _ = std::fs::remove_dir_all(dir);
}

/// A token-ID completion request through Envoy, with vLLM's `cache_salt`
/// when `salt` is given: the pod that served it and kvroute's cache match
/// for it.
fn routed(cluster: &Cluster, model: &str, salt: Option<&str>, tokens: &[u32]) -> (String, String) {
    let body = json!({"model": model, "prompt": tokens, "max_tokens": 2, "cache_salt": salt});
    let r = cluster.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let pod = r.header("x-sim-pod").expect("x-sim-pod").to_string();
    assert_eq!(r.header("x-kvroute-pod"), Some(pod.as_str()));
    let matched = r.header("x-kvroute-cache-match").unwrap_or("").to_string();
    (pod, matched)
}

/// Three sims publishing vLLM KV events, one bridge each, kvroute pulling
/// reports only from the bridges (`reportAddress`). A 4,608-token prefix
/// (256 fine blocks and 2 coarse ones of the default layout) is cached on
/// a pod directly (kvroute made no decision, so only the
/// bridge can tell it): 10/10 requests sharing it go to that pod, for the
/// base model, and — the same tokens cached under the LoRA adapter on
/// another pod — 10/10 adapter requests go to that one. The same tokens
/// with a `cache_salt`, cached on the third pod, take 10/10 salted
/// requests there: vLLM hashes the salt into the first block, publishes
/// it in its extra keys, and the bridge and the filter seed with it.
#[test]
fn envoy_routes_a_shared_token_prefix_to_its_holder_through_the_bridges() {
    let pods = 3;
    let zmq: Vec<(String, String)> = (0..pods)
        .map(|_| {
            (
                format!("tcp://127.0.0.1:{}", free_port()),
                format!("tcp://127.0.0.1:{}", free_port()),
            )
        })
        .collect();
    let listens: Vec<String> = (0..pods)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let config = json!({
        "podReportIntervalMs": 200,
        "reportTimeoutMs": 400,
        "blockSizeTokens": 16,
        "models": {
            "m": {"baseModel": "m"},
            "m-lora": {"baseModel": "m", "adapter": "lora-a"},
        },
    });
    let mut spec = ClusterSpec::new(pods, config);
    spec.per_pod_args = zmq
        .iter()
        .map(|(events, replay)| {
            vec![
                "--kv-events".into(),
                events.clone(),
                "--kv-replay".into(),
                replay.clone(),
            ]
        })
        .collect();
    spec.report_addresses = listens.iter().cloned().map(Some).collect();
    let cluster = Cluster::start(Path::new(SIM), spec).expect("cluster starts");
    let config_file = cluster.dir.join("kvroute.json");
    let bridges: Vec<Running> = (0..pods)
        .map(|i| {
            http::runtime()
                .block_on(start(Options {
                    events: zmq[i].0.clone(),
                    replay: Some(zmq[i].1.clone()),
                    topic: String::new(),
                    listen: listens[i].clone(),
                    pod_id: format!("pod-{i}"),
                    config: Some(config_file.clone()),
                    base_model: "m".into(),
                    lora_id: Vec::new(),
                    tokenizer: None,
                    probe_ms: 1000,
                    log_events: 100_000,
                    kv_capacity_blocks: None,
                    vllm_metrics: None,
                }))
                .expect("bridge starts")
        })
        .collect();
    let prefix: Vec<u32> = (0..4608).map(|i| 1000 + i * 7 % 50_000).collect();
    let salt = Some("tenant-a");
    for (model, salt, holder) in [("m", None, 1), ("m-lora", None, 2), ("m", salt, 0)] {
        let mut warm = prefix.clone();
        warm.extend([1, 2, 3]);
        let body = json!({"model": model, "prompt": warm, "max_tokens": 1, "cache_salt": salt});
        let r = http::post_json(
            &cluster.sims[holder].address,
            "/v1/completions",
            &body.to_string(),
        )
        .expect("warm-up");
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // Bridges have the blocks, then kvroute has the bridges' reports.
    for holder in [0, 1, 2] {
        let deadline = Instant::now() + Duration::from_secs(5);
        while report_blocks(&listens[holder]).1.len() < 258 {
            assert!(Instant::now() < deadline, "bridge {holder} lags");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    cluster.wait_reports(3);
    for (model, salt, holder) in [
        ("m", None, "pod-1"),
        ("m-lora", None, "pod-2"),
        ("m", salt, "pod-0"),
    ] {
        for i in 0..10u32 {
            let mut tokens = prefix.clone();
            tokens.extend([60_000 + i, 7, 7]);
            let (pod, matched) = routed(&cluster, model, salt, &tokens);
            assert_eq!(pod, holder, "{model} request {i} left the prefix's holder");
            // The whole prefix, coarse blocks included, known from the
            // bridge's report from the first request on
            // (no earlier decision through kvroute to remember).
            let matched: f64 = matched.parse().expect("x-kvroute-cache-match");
            assert!(matched > 0.95, "{model} request {i}: cache match {matched}");
        }
    }
    // kvroute never pulled the pods' own reports: only the bridges'.
    for sim in &cluster.sims {
        assert_eq!(sim.stats()["reportRequests"], json!(0), "{}", sim.id);
    }
    assert!(counter(&bridges[1], "kvbridge_batches_total") >= 1.0);
    assert_eq!(counter(&bridges[1], "kvbridge_malformed_frames_total"), 0.0);
}

/// Stock-vLLM mode in real Envoy: four pods tokenizing prompts as vLLM
/// does (`--tokenizer`, chat through the chat template) and serving no
/// kvroute report, one bridge each decoding their token blocks back to
/// text. A long system prompt (chat) and a long document (completions,
/// after the tokenizer's `<|endoftext|>` prefix), each cached on its own
/// pod for the base model and under the LoRA adapter, directly (so only
/// the bridges can tell kvroute): 10/10 requests sharing each go to its
/// holder, matching nearly the whole prompt.
#[test]
fn envoy_routes_text_and_chat_prefixes_to_their_holders_on_tokenizing_pods() {
    let pods = 4;
    let ports: Vec<BridgePorts> = (0..pods).map(|_| BridgePorts::free()).collect();
    let config = json!({
        "podReportIntervalMs": 200,
        "reportTimeoutMs": 400,
        "models": {
            "m": {"baseModel": "m"},
            "m-lora": {"baseModel": "m", "adapter": "lora-a"},
        },
        "chatTemplates": {"m": {
            "template": STOCK_VLLM_CHAT_TEMPLATE,
            "completionPrefix": "<|endoftext|>",
        }},
    });
    let mut spec = ClusterSpec::new(pods, config);
    spec.sim_args
        .extend(["--tokenizer", "cl100k_base", "--no-report"].map(String::from));
    spec.per_pod_args = ports.iter().map(BridgePorts::sim_args).collect();
    spec.report_addresses = ports.iter().map(|p| Some(p.listen.clone())).collect();
    let cluster = Cluster::start(Path::new(SIM), spec).expect("cluster starts");
    let vocabulary = cluster.dir.join("tokenizer.json");
    let tokenizer = SimTokenizer::named("cl100k_base").expect("tokenizer");
    std::fs::write(&vocabulary, tokenizer.tokenizer_json().to_string()).expect("written");
    let config_file = cluster.dir.join("kvroute.json");
    let _bridges: Vec<Running> = (0..pods)
        .map(|i| {
            http::runtime()
                .block_on(start(Options {
                    events: ports[i].events.clone(),
                    replay: Some(ports[i].replay.clone()),
                    topic: String::new(),
                    listen: ports[i].listen.clone(),
                    pod_id: format!("pod-{i}"),
                    config: Some(config_file.clone()),
                    base_model: "m".into(),
                    lora_id: Vec::new(),
                    tokenizer: Some(vocabulary.clone()),
                    probe_ms: 1000,
                    log_events: 100_000,
                    kv_capacity_blocks: None,
                    vllm_metrics: None,
                }))
                .expect("bridge starts")
        })
        .collect();
    // ~10 KB of varied text, distinct per endpoint.
    let long_text = |topic: &str| -> String {
        (0..160)
            .map(|i| {
                format!(
                    "{topic} rule {i}: keep function_{i} under {} lines. ",
                    i % 7 + 20
                )
            })
            .collect()
    };
    let body = |path: &str, model: &str, head: &str, question: &str| {
        let mut body = json!({"model": model, "max_tokens": 2});
        if path.contains("chat") {
            body["messages"] = json!([
                {"role": "system", "content": head},
                {"role": "user", "content": question},
            ]);
        } else {
            body["prompt"] = json!(format!("{head}\n\nQ: {question}"));
        }
        body
    };
    let cases = [
        ("/v1/chat/completions", "m", "pod-0"),
        ("/v1/chat/completions", "m-lora", "pod-1"),
        ("/v1/completions", "m", "pod-2"),
        ("/v1/completions", "m-lora", "pod-3"),
    ];
    let heads: Vec<String> = cases.iter().map(|(path, _, _)| long_text(path)).collect();
    for ((path, model, holder), head) in cases.iter().zip(&heads) {
        let sim = &cluster.sims[cluster.pod_index(holder)];
        let warm = body(path, model, head, "warm up");
        let r = http::post_json(&sim.address, path, &warm.to_string()).expect("warm-up");
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // Bridges have the blocks (token and text keys), then kvroute has the
    // bridges' reports.
    for ports in &ports {
        let deadline = Instant::now() + Duration::from_secs(5);
        while report_blocks(&ports.listen).1.len() < 200 {
            assert!(Instant::now() < deadline, "bridge at {} lags", ports.listen);
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    cluster.wait_reports(3);
    for ((path, model, holder), head) in cases.iter().zip(&heads) {
        for i in 0..10 {
            let request = body(path, model, head, &format!("question {i}?"));
            let r = cluster.post(path, &request);
            assert_eq!(r.status, 200, "{}", r.body);
            let pod = r.header("x-sim-pod").expect("x-sim-pod");
            assert_eq!(pod, *holder, "{path} {model} request {i} left the holder");
            let matched: f64 = r
                .header("x-kvroute-cache-match")
                .and_then(|m| m.parse().ok())
                .expect("x-kvroute-cache-match");
            assert!(
                matched > 0.95,
                "{path} {model} request {i}: cache match {matched}"
            );
            // The pod served the tokens the bridge said it held.
            let body: serde_json::Value = serde_json::from_str(&r.body).expect("JSON");
            let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .expect("cached_tokens");
            let prompt = body["usage"]["prompt_tokens"]
                .as_u64()
                .expect("prompt_tokens");
            assert!(
                cached * 10 > prompt * 9,
                "{path} {model}: {cached} of {prompt} cached"
            );
        }
    }
    for sim in &cluster.sims {
        assert_eq!(sim.stats()["reportRequests"], json!(0), "{}", sim.id);
    }
}

/// Long-poll: a report asked with `wait` for the current epoch and seq is
/// held until the pod stores a block, then answers the delta at once.
/// The text keys a bridge decoding with the pod's vocabulary must hold
/// for text `prompts` sent to model `m`, given the token keys the pod
/// holds (its own report): every text block of a prompt's decoded tokens
/// whose last byte lies in a token block the pod holds. Worked out from
/// byte offsets, independently of the bridge's cursor.
fn expected_text_keys(
    prompts: &[String],
    held: &BTreeSet<u64>,
    config: &Config,
    tokenizer: &SimTokenizer,
) -> BTreeSet<u64> {
    let token_layout = BlockLayout::tokens(config).uncapped();
    let text_layout = BlockLayout::text(config);
    let seed = |mode| ChainSeed::new(&config.hash_seed, "m", None, mode);
    let mut keys = BTreeSet::new();
    for prompt in prompts {
        let tokens = tokenizer.encode(prompt);
        let bytes = tokenizer.decode(&tokens).expect("known ids");
        let text_keys = hash_bytes(&seed(BlockMode::Text), &bytes, &text_layout);
        let token_keys = hash_tokens(&seed(BlockMode::Tokens), &tokens, &token_layout);
        // Byte offset where token block `i` ends.
        let block_end = |i: usize| {
            let end = token_layout.covered(i + 1) as usize;
            tokenizer.decode(&tokens[..end]).expect("known ids").len() as u64
        };
        let block_ends: Vec<u64> = (0..token_keys.len()).map(block_end).collect();
        for (j, key) in text_keys.iter().enumerate() {
            let text_end = text_layout.covered(j + 1);
            let holder = block_ends.iter().position(|&end| text_end <= end);
            if holder.is_some_and(|i| held.contains(&token_keys[i])) {
                keys.insert(*key);
            }
        }
    }
    keys
}

/// Text prompts on a tokenizing pod (`--tokenizer`, vLLM's token blocks
/// of the text) and a bridge decoding with the pod's vocabulary: the
/// bridge holds the pod's token keys plus exactly the text keys of the
/// token blocks the pod holds, through shared heads, LRU evictions, a gap
/// replayed, garbage frames, a bridge restart, AllBlocksCleared and a pod
/// restart. Never a stale text key.
#[test]
fn text_keys_follow_a_tokenizing_pods_cache() {
    let dir = temp("text");
    let config_path = config_file(&dir);
    let config = Config::parse(&std::fs::read(&config_path).expect("config")).expect("valid");
    let tokenizer = SimTokenizer::named("cl100k_base").expect("tokenizer");
    let vocabulary = dir.join("tokenizer.json");
    std::fs::write(&vocabulary, tokenizer.tokenizer_json().to_string()).expect("written");
    let mut pod = Pod::start(
        &config_path,
        &["--tokenizer", "cl100k_base", "--kv-blocks", "60"],
    );
    let running = bridge_decoding(&pod, "127.0.0.1:0", &config_path, Some(&vocabulary));
    let head = "Système: réponds brièvement. ".repeat(12);
    let mut prompts: Vec<String> = Vec::new();
    let send = |pod: &Pod, prompts: &mut Vec<String>, prompt: String| {
        let body = json!({"model": "m", "prompt": prompt, "max_tokens": 1});
        let r = http::post_json(&pod.sim.address, "/v1/completions", &body.to_string())
            .expect("completion");
        assert_eq!(r.status, 200, "{}", r.body);
        prompts.push(prompt);
    };
    for i in 0..3 {
        let details = format!("what does function {i} return? ").repeat(12);
        let question = format!("{head}question {i}: {details}");
        send(&pod, &mut prompts, question);
    }
    let truth = |prompts: &[String], pod: &Pod| {
        let held = pod.blocks();
        let text = expected_text_keys(prompts, &held, &config, &tokenizer);
        held.union(&text).copied().collect::<BTreeSet<u64>>()
    };
    let held = converged_to(&running, || truth(&prompts, &pod));
    let text_keys = held.len() - pod.blocks().len();
    // The shared head's, then each question's own.
    assert!(text_keys >= 5 + 3 * 2, "{text_keys} text keys");
    // Evictions (60 blocks hold ~4 prompts) and a gap the replay fills.
    pod.sim.fault(json!({"kvDrop": 2}));
    for i in 3..9 {
        send(
            &pod,
            &mut prompts,
            format!("{i} {}", "tool output line\n".repeat(40)),
        );
    }
    converged_to(&running, || truth(&prompts, &pod));
    assert!(counter(&running, "kvbridge_replays_total") >= 1.0);
    assert!(counter(&running, "kvbridge_text_blocks") > 0.0);
    assert_eq!(
        counter(&running, "kvbridge_blocks_skipped_unknown_token_total"),
        0.0
    );
    // Garbage frames are passed over; a restarted bridge rebuilds the text
    // keys from the replay buffer, in a new epoch.
    pod.sim.fault(json!({"kvGarbage": true}));
    send(&pod, &mut prompts, format!("{head}after the garbage"));
    converged_to(&running, || truth(&prompts, &pod));
    assert_eq!(counter(&running, "kvbridge_malformed_frames_total"), 3.0);
    let listen = running.addr.to_string();
    let (epoch, _) = report_blocks(&listen);
    http::runtime().block_on(running.stop());
    let running = bridge_decoding(&pod, &listen, &config_path, Some(&vocabulary));
    converged_to(&running, || truth(&prompts, &pod));
    assert_ne!(report_blocks(&listen).0, epoch);
    pod.sim.fault(json!({"clearAll": true}));
    assert!(converged_to(&running, || truth(&prompts, &pod)).is_empty());
    send(&pod, &mut prompts, format!("{head}after the clear"));
    assert!(!converged_to(&running, || truth(&prompts, &pod)).is_empty());
    pod.restart();
    assert!(converged_to(&running, || truth(&prompts, &pod)).is_empty());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_long_polled_report_answers_when_the_pod_stores() {
    let dir = temp("long-poll");
    let config = config_file(&dir);
    let pod = Pod::start(&config, &[]);
    let running = bridge(&pod, "127.0.0.1:0", &config);
    let address = running.addr.to_string();
    // `since` 0 always answers a full resync at once: a first event.
    pod.complete("m", &prompt(0, 1));
    converged(&pod, &running);
    let current = http::get(&address, "/kvroute/v1/report").expect("report");
    let current = parse_report(current.body.as_bytes()).expect("valid");
    let query = format!(
        "/kvroute/v1/report?since={}&epoch={}&wait=5000",
        current.seq, current.epoch
    );
    let asked = Instant::now();
    let held = std::thread::spawn(move || http::get(&address, &query).expect("long poll"));
    std::thread::sleep(Duration::from_millis(300));
    pod.complete("m", &prompt(1, 3));
    let answer = parse_report(held.join().expect("joined").body.as_bytes()).expect("valid");
    assert!(
        asked.elapsed() < Duration::from_secs(3),
        "{:?}",
        asked.elapsed()
    );
    assert!(!answer.full);
    assert_eq!(
        answer.stored.iter().map(|c| c.hashes.len()).sum::<usize>(),
        3
    );
    let _ = std::fs::remove_dir_all(dir);
}
