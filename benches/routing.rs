//! Lookup + scoring of a 4096-token prompt (256 blocks of 16 tokens, i.e.
//! 16 KiB of text in 64-byte blocks) against an index of ~1,000,000 blocks
//! over 64 and over 1,024 pods, side by side.
//!
//! Index shape: 16 shared system prompts of 32 blocks; each pod holds
//! conversations of 64–256 blocks (system prompt included) that branch from
//! two of the system prompts, round-robin over the pods until the index
//! holds ~1M blocks (at 1,024 pods a system prompt is held by ~128 pods:
//! holder sets past the four kept inline). The benchmarked prompt shares
//! system prompt 3 with the pods that use it, and is held fully by two pods
//! and for 180 blocks by a third.
//!
//! Benchmarks, each at 64 and 1,024 pods (`…/64`, `…/1024`):
//! - `tree_lookup`: `PrefixTree::lookup` of the 256-block chain;
//! - `snapshot_lookup`: the same through `SnapshotIndex` over the buckets a
//!   `SnapshotPublisher` built from the tree's change log, each probe a
//!   `HashMap<u32, Vec<u8>>` get + clone (the shared-data copy);
//! - `decide`: `ScoringPolicy::decide` over a slice of every pod as a
//!   ready candidate (every pod scored at 64; the candidate set at 1,024,
//!   which scans the slice for holders, O(pods));
//! - `route`: `Router::route` of the 16 KiB body through a pod table of
//!   that many pods, the snapshot index and in-flight loads (what the
//!   filter does natively: parse, hash, look up, build the candidates the
//!   set asks for, decide).
//!
//! - `prefix_demand_record_512_blocks`: `PrefixDemand::record` of a chat's
//!   later turn over a 512-block chain, 4,096 branch points remembered
//!   (the scan for the branch points its match went past).
//!
//! Afterwards it prints memory per indexed block at both sizes and the
//! median and p99 of 10,000 individually timed `route` calls.
//!
//! `prepare_*`: `Router::prepare` of a request body — JSON parse, canonical
//! prompt, block chain — for completions bodies of 16 KiB, 128 KiB and
//! 512 KiB (128k tokens) and chat bodies of 16 KiB, 128 KiB and 512 KiB
//! (8 KiB messages), with the default block layout (the whole prompt is
//! hashed); `*_chat_template`: the 16 and 128 KiB chat bodies for a model
//! with a chat template (tests/fixtures/chat_templates/wren_chatml.jinja),
//! rendered instead of put in canonical form, and `*_chat_beside_template`
//! for a model without one in that configuration (read in order for the
//! template's sake, then put in canonical form).

use std::collections::{BTreeMap, HashMap};
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvroute::config::{Config, ModelTarget};
use kvroute::hashing::BlockHasher;
use kvroute::index::{PrefixLookup, PrefixMatch, PrefixTree};
use kvroute::request::Prompt;
use kvroute::router::{ClusterView, Outcome, Router};
use kvroute::scoring::spread::{self, PrefixDemand};
use kvroute::scoring::ttft::TtftModel;
use kvroute::scoring::{Balancing, Candidate, ScoringPolicy};
use kvroute::snapshot::{
    KvRoom, PodTable, PublishedPod, SlotLoad, SnapshotIndex, SnapshotPublisher,
};

const POOLS: [usize; 2] = [64, 1024];
const INDEX_BLOCKS: usize = 1_000_000;
const SYSTEM_PROMPTS: usize = 16;
const SYSTEM_BLOCKS: usize = 32;
const BLOCK_BYTES: usize = 64;
const PROMPT_BLOCKS: usize = 256;

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

fn text(rng: &mut Rng, bytes: usize) -> Vec<u8> {
    const WORDS: [&str; 12] = [
        "the ",
        "customer ",
        "asked ",
        "about ",
        "billing ",
        "refund ",
        "policy ",
        "and ",
        "agent ",
        "replied ",
        "please ",
        "thanks ",
    ];
    let mut out = Vec::with_capacity(bytes + 16);
    while out.len() < bytes {
        out.extend_from_slice(WORDS[(rng.next() % 12) as usize].as_bytes());
    }
    out.truncate(bytes);
    out
}

struct Fixture {
    pods: usize,
    config: Config,
    hasher: BlockHasher,
    target: ModelTarget,
    prompt: Prompt,
    body: Vec<u8>,
    chain: Vec<u64>,
    tree: PrefixTree,
    publisher: SnapshotPublisher,
    store: HashMap<u32, Vec<u8>>,
    table: PodTable,
    inflight: Vec<SlotLoad>,
    attributes: BTreeMap<String, f64>,
    policy: ScoringPolicy,
    router: Router,
    /// Uncalibrated, as before any answer: predictions in tokens.
    ttft: TtftModel,
}

fn build(pods: usize) -> Fixture {
    let started = Instant::now();
    let pod_list: Vec<serde_json::Value> = (0..pods)
        .map(|i| {
            serde_json::json!({"id": format!("pod-{i}"),
                               "address": format!("10.{}.{}.1:8000", i / 250, i % 250)})
        })
        .collect();
    let config = Config::parse(
        serde_json::json!({"pods": pod_list, "models": {"m": {"baseModel": "llama-3-8b"}}})
            .to_string()
            .as_bytes(),
    )
    .expect("config");
    let hasher = BlockHasher::from_config(&config);
    let target = ModelTarget {
        base_model: "llama-3-8b".into(),
        adapter: None,
    };
    let mut rng = Rng(0x00c0_ffee);
    let system_texts: Vec<Vec<u8>> = (0..SYSTEM_PROMPTS)
        .map(|_| text(&mut rng, SYSTEM_BLOCKS * BLOCK_BYTES))
        .collect();
    let system_chains: Vec<Vec<u64>> = system_texts
        .iter()
        .map(|t| hasher.chain(&target, &Prompt::Text(t.clone()), None))
        .collect();

    let mut tree = PrefixTree::with_change_log(INDEX_BLOCKS);
    let mut chain_buf = Vec::with_capacity(PROMPT_BLOCKS);
    let mut pod = 0;
    loop {
        let total = rng.range(64, 256) as usize;
        if tree.len() + total + 2 * PROMPT_BLOCKS > INDEX_BLOCKS {
            break;
        }
        let system = if rng.next().is_multiple_of(2) {
            pod % SYSTEM_PROMPTS
        } else {
            (pod + 5) % SYSTEM_PROMPTS
        };
        chain_buf.clear();
        chain_buf.extend_from_slice(&system_chains[system]);
        // Conversation blocks: chained hashes are uniformly random u64s.
        chain_buf.extend((SYSTEM_BLOCKS..total).map(|_| rng.next()));
        tree.insert_chain(pod, None, &chain_buf);
        pod = (pod + 1) % pods;
    }

    // The benchmarked prompt: system prompt 3 + 14 KiB of conversation.
    let mut prompt_text = system_texts[3].clone();
    prompt_text.extend(text(
        &mut rng,
        (PROMPT_BLOCKS - SYSTEM_BLOCKS) * BLOCK_BYTES,
    ));
    assert_eq!(prompt_text.len(), 16 * 1024);
    let body = serde_json::json!({
        "model": "m", "max_tokens": 16,
        "prompt": String::from_utf8(prompt_text.clone()).expect("ASCII"),
    })
    .to_string()
    .into_bytes();
    let prompt = Prompt::Text(prompt_text);
    let chain = hasher.chain(&target, &prompt, None);
    assert_eq!(chain.len(), PROMPT_BLOCKS);
    tree.insert_chain(7, None, &chain);
    tree.insert_chain(23, None, &chain);
    tree.insert_chain(40, None, &chain[..180]);
    assert_eq!(tree.evictions(), 0);

    let mut publisher = SnapshotPublisher::new(config.snapshot_buckets());
    publisher.apply_tree(&mut tree);
    let store: HashMap<u32, Vec<u8>> = publisher.take_dirty(usize::MAX).into_iter().collect();

    let table = PodTable {
        generation: 1,
        published_at_ms: 0,
        buckets: publisher.bucket_count(),
        pods: config
            .pods
            .iter()
            .enumerate()
            .map(|(slot, pod)| PublishedPod {
                slot,
                id: pod.id.clone(),
                address: pod.address.clone(),
                queue: rng.range(0, 22) as u32,
                load: rng.range(5, 95) as f64 / 100.0,
                health: rng.range(25, 100) as f64 / 100.0,
                reported_health: 1.0,
                last_report_ms: 0,
                adapters: Vec::new(),
                attributes: BTreeMap::new(),
                inflight_at_report: 0,
                // Warm caches: every decision prices its evictions.
                kv_room: KvRoom {
                    free_blocks: Some(rng.range(0, 2_000)),
                    reuse_share: rng.range(0, 100) as f64 / 100.0,
                },
            })
            .collect(),
        ..PodTable::default()
    };
    let inflight: Vec<SlotLoad> = (0..pods)
        .map(|_| {
            let requests = rng.range(0, 8) as u32;
            SlotLoad {
                requests,
                prefill_tokens: rng.range(0, 4096) as u32,
                prefill_attention: 0,
                streams: requests,
            }
        })
        .collect();
    let policy = ScoringPolicy::from_config(&config);
    let router = Router::new(config.clone());
    eprintln!(
        "fixture: {} blocks over {pods} pods, built in {:.2} s",
        tree.len(),
        started.elapsed().as_secs_f64()
    );
    Fixture {
        pods,
        config,
        hasher,
        target,
        prompt,
        body,
        chain,
        tree,
        publisher,
        store,
        table,
        inflight,
        attributes: BTreeMap::new(),
        policy,
        router,
        ttft: TtftModel::new(64),
    }
}

/// Every pod of the fixture as a ready candidate.
fn candidates<'a>(f: &'a Fixture, matched: &PrefixMatch, blocks: usize) -> Vec<Candidate<'a>> {
    f.table
        .pods
        .iter()
        .map(|pod| Candidate {
            cache_match: f64::from(matched.blocks(pod.slot)) / blocks.max(1) as f64,
            load: pod.load,
            queue: pod.queue,
            health: pod.health,
            ..Candidate::idle(pod.slot, &pod.id, &f.attributes)
        })
        .collect()
}

/// `Router::route` of the fixture's body over its table and `index`.
fn route(f: &Fixture, index: &dyn PrefixLookup, tie_breaker: u64) -> Outcome {
    let view = ClusterView {
        table: &f.table,
        index,
        inflight: &f.inflight,
        ttft: &f.ttft,
        occupancy: &Default::default(),
        prefix_demand: &Default::default(),
        now_ms: 0,
    };
    f.router
        .route(black_box(&f.body), false, &view, tie_breaker)
}

fn routing(c: &mut Criterion) {
    let fixtures: Vec<Fixture> = POOLS.into_iter().map(build).collect();
    let mut group = c.benchmark_group("routing");
    group
        .sample_size(60)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    let mut tie = 0u64;
    for f in &fixtures {
        let snapshot = SnapshotIndex {
            buckets: f.publisher.bucket_count(),
            fetch: |b: u32| f.store.get(&b).cloned(),
        };
        // Sanity: both indexes agree and the full holders win on cache.
        let m = f.tree.lookup(&f.chain);
        assert_eq!(m, snapshot.lookup(&f.chain));
        assert_eq!((m.blocks(7), m.blocks(23), m.blocks(40)), (256, 256, 180));
        let Outcome::Routed(routed) = route(f, &snapshot, 0) else {
            panic!("not routed");
        };
        eprintln!(
            "{} pods: sample decision {} ({} candidates scored, cache match {:.2}); pods matching the system prompt: {}",
            f.pods,
            routed.pod_id,
            routed.decision.scored.len(),
            routed.cache_match,
            m.iter().filter(|&(_, b)| b >= SYSTEM_BLOCKS as u32).count()
        );
        let pods = f.pods;
        group.bench_with_input(BenchmarkId::new("tree_lookup", pods), f, |b, f| {
            b.iter(|| f.tree.lookup(black_box(&f.chain)))
        });
        group.bench_with_input(BenchmarkId::new("snapshot_lookup", pods), f, |b, f| {
            b.iter(|| snapshot.lookup(black_box(&f.chain)))
        });
        let cands = candidates(f, &m, f.chain.len());
        group.bench_with_input(BenchmarkId::new("decide", pods), &cands, |b, cands| {
            b.iter(|| {
                tie += 1;
                f.policy.decide(
                    black_box(cands),
                    false,
                    tie,
                    Some(Balancing::with_error(0.1)),
                )
            })
        });
        group.bench_with_input(BenchmarkId::new("route", pods), f, |b, f| {
            b.iter(|| {
                tie += 1;
                route(f, &snapshot, tie)
            })
        });
    }
    let f = &fixtures[0];
    group.bench_function("hash_16KiB", |b| {
        b.iter(|| f.hasher.chain(&f.target, black_box(&f.prompt), None))
    });
    // A token-ID prompt of the same 16 KiB (4096 IDs, 256 blocks of 16):
    // the chain the vLLM bridge derives from vLLM's events.
    let tokens = Prompt::Tokens((0..4096u32).map(|i| i * 31 % 50_000).collect());
    group.bench_function("hash_4096_tokens", |b| {
        b.iter(|| f.hasher.chain(&f.target, black_box(&tokens), None))
    });
    // Recording a routed request's session start or later turn: a chat's
    // later turn over a 512-block chain whose match ends at its 500th
    // block, with the branch points remembered full (`spread::REMEMBERED`).
    let mut demand = PrefixDemand::default();
    for end in 0..spread::REMEMBERED as u64 {
        demand.record(&[], Some(end), None, 1e6);
        demand.record(&[], Some(end), None, 1e6);
    }
    let chain: Vec<u64> = (0..512u64).map(|i| i << 32).collect();
    group.bench_function("prefix_demand_record_512_blocks", |b| {
        b.iter(|| demand.record(black_box(&chain), Some(chain[499]), Some(true), 1e6))
    });
    group.finish();

    for f in &fixtures {
        // Memory per indexed block.
        let blocks = f.tree.len();
        let shared_bytes: usize = f.store.values().map(Vec::len).sum();
        println!(
            "memory at {} pods: PrefixTree {:.1} B/block ({} B for {blocks} blocks); SnapshotPublisher mirror {:.1} B/block ({} B); \
             shared-data bucket values {:.1} B/block over {} buckets",
            f.pods,
            f.tree.memory_bytes() as f64 / blocks as f64,
            f.tree.memory_bytes(),
            f.publisher.memory_bytes() as f64 / blocks as f64,
            f.publisher.memory_bytes(),
            shared_bytes as f64 / blocks as f64,
            f.config.snapshot_buckets(),
        );
        // Latency distribution of the filter's native path, timed one by one.
        let snapshot = SnapshotIndex {
            buckets: f.publisher.bucket_count(),
            fetch: |b: u32| f.store.get(&b).cloned(),
        };
        let (median, p99, max) = latency(10_000, |i| {
            black_box(route(f, &snapshot, i));
        });
        println!(
            "route at {} pods: 10000 iterations, median {median:.2} µs, p99 {p99:.2} µs, max {max:.2} µs",
            f.pods
        );
    }
}

/// (median, p99, max) in µs of `n` individually timed calls.
fn latency(n: u64, mut run: impl FnMut(u64)) -> (f64, f64, f64) {
    let mut samples: Vec<f64> = (0..n)
        .map(|i| {
            let start = Instant::now();
            run(i);
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    (at(0.5), at(0.99), samples[samples.len() - 1])
}

/// Request bodies of about `bytes` bytes for `model`: a completions prompt,
/// or chat messages of 8 KiB each.
fn body(model: &str, bytes: usize, chat: bool) -> Vec<u8> {
    let mut rng = Rng(bytes as u64);
    let text = |rng: &mut Rng, n: usize| String::from_utf8(self::text(rng, n)).expect("ASCII");
    let value = if chat {
        let messages: Vec<serde_json::Value> = (0..bytes / 8192)
            .map(|i| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                serde_json::json!({"role": role, "content": text(&mut rng, 8192)})
            })
            .collect();
        serde_json::json!({"model": model, "messages": messages, "max_tokens": 16})
    } else {
        serde_json::json!({"model": model, "prompt": text(&mut rng, bytes), "max_tokens": 16})
    };
    value.to_string().into_bytes()
}

fn prepare(c: &mut Criterion) {
    let plain = Config::parse(
        br#"{"pods": [{"id": "a", "address": "127.0.0.1:1"}], "models": {"m": {"baseModel": "m"}}}"#,
    )
    .expect("config");
    let templated = serde_json::json!({
        "pods": [{"id": "a", "address": "127.0.0.1:1"}],
        "models": {"m": {"baseModel": "m"}, "templated": {"baseModel": "templated"}},
        "chatTemplates": {"templated": {
            "template": include_str!("../tests/fixtures/chat_templates/wren_chatml.jinja"),
            "eosToken": "<|im_end|>",
        }},
    });
    let templated = Config::parse(templated.to_string().as_bytes()).expect("config");
    let (plain, templated) = (Router::new(plain), Router::new(templated));
    let mut group = c.benchmark_group("prepare");
    group
        .sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for (name, router, model, bytes, chat) in [
        ("prepare_16KiB", &plain, "m", 16 * 1024, false),
        ("prepare_128KiB", &plain, "m", 128 * 1024, false),
        ("prepare_512KiB", &plain, "m", 512 * 1024, false),
        ("prepare_16KiB_chat", &plain, "m", 16 * 1024, true),
        (
            "prepare_16KiB_chat_template",
            &templated,
            "templated",
            16 * 1024,
            true,
        ),
        (
            "prepare_16KiB_chat_beside_template",
            &templated,
            "m",
            16 * 1024,
            true,
        ),
        ("prepare_128KiB_chat", &plain, "m", 128 * 1024, true),
        (
            "prepare_128KiB_chat_template",
            &templated,
            "templated",
            128 * 1024,
            true,
        ),
        (
            "prepare_128KiB_chat_beside_template",
            &templated,
            "m",
            128 * 1024,
            true,
        ),
        ("prepare_512KiB_chat", &plain, "m", 512 * 1024, true),
    ] {
        let body = body(model, bytes, chat);
        let blocks = router.prepare(&body, chat).expect("prepares").chain.len();
        eprintln!("{name}: {} body bytes, {blocks} blocks", body.len());
        group.bench_function(name, |b| b.iter(|| router.prepare(black_box(&body), chat)));
    }
    group.finish();
}

criterion_group!(benches, routing, prepare);
criterion_main!(benches);
