//! The simulated pod's model: KV-cache LRU with its report event log, LoRA
//! adapter slots, the latency cost model and the prefill engine. Pure (no
//! I/O, no clock, no async: times are [`Duration`]s since an epoch the
//! caller picks), so the live `kvroute-sim` server and the offline replay
//! simulator share exactly the same cache, costs and prefill queueing.
//!
//! KV cache: block hash → parent hash, bounded to `capacity` GPU blocks with
//! least-recently-used eviction. A request's chain is touched leaf-first
//! (reverse order), so every block is more recent than all its
//! continuations, and eviction always takes a leaf: a block is only present
//! while its parent is. Every insertion and eviction is an event in a
//! bounded log with sequence numbers, from which protocol v1 reports (see
//! `kvroute::report`) are built: coalesced deltas, or full resyncs.
//!
//! CPU tier (optional, [`KvCache::with_cpu_tier`]): a block evicted from the
//! GPU moves to a bounded pool in host memory instead of going, as KV
//! offloading (vLLM's offloading connector, LMCache) keeps it, and the
//! pool evicts least recently offloaded first (leaves first again, as they
//! leave the GPU first). A later request whose prefix reaches it reloads it
//! to the GPU: a hit that saves the prefill but costs a transfer. The pool
//! holds only what the GPU dropped (a victim cache: vLLM's connector also
//! copies blocks the GPU still holds, which adds nothing a request could
//! use). Moves between tiers are logged as stores in the new tier
//! (protocol v1's `tier`).
//!
//! Latency (defaults: an 8B-class model on one GPU, all × `time_scale`),
//! vLLM-like: prefill is compute-bound and shares the GPU, decode is cheap
//! per sequence under continuous batching.
//! - A request first waits for one of the pod's `max_batch` sequence slots
//!   (vLLM's `max_num_seqs`), which it holds until its last token.
//! - With a slot (and its LoRA adapter loaded, if it needed a load), it joins
//!   the pod's single [`PrefillEngine`], which computes prefills one after
//!   another, first come first served, at 0.9 s per 4096 *uncached* prompt
//!   tokens: its prefill starts when the previous one is done. Its cached
//!   prefix is counted against the cache plus the prefills scheduled before
//!   it (they are done by the time it starts), so a request queued behind
//!   another with the same prefix reuses it.
//! - The fixed 45 ms per request (prefix lookup, scheduling, sampling) is
//!   latency, not engine time: it overlaps with other requests' prefills and
//!   is added after the request's own prefill. A full cache hit on an idle
//!   pod thus costs 45 ms and keeps the engine free.
//! - A cached prefix on the CPU tier is reloaded first, at PCIe speed:
//!   [`KV_BYTES_PER_TOKEN`] (an 8B model's K and V, 128 KiB a token) over
//!   [`PCIE_GBPS`] (25 GB/s, PCIe 4.0 x16 as DMA achieves it), 5.2 µs a
//!   token against prefill's 220 µs: 2.4 % of recomputing it. A reload is
//!   a transfer, not GPU compute: it delays its own request only, and a
//!   pod's reloads share its link, one after another.
//! - `TTFT = slot wait + adapter load + reload + prefill-engine wait + own
//!   prefill (uncached tokens × 0.9 s / 4096) + 45 ms`; then one more token every
//!   20 ms, concurrently with everything else (decode never contends). The
//!   first output token is produced by prefill, so a request of `n` output
//!   tokens ends `(n - 1) × decode` after its first token.
//!
//! Under load, uncached prefill work queues on the engine and delays every
//! request behind it; a cache hit removes that work for everyone.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use kvroute::config::{Config, ModelTarget};
use kvroute::hashing::{BlockHasher, Coverage, BYTES_PER_TOKEN};
use kvroute::report::Tier;
use kvroute::report_log::{chain_segments, BlockEvent, ReportLog};
use kvroute::request::Prompt;
use serde_json::{json, Value};

/// Default bound of the report event log (block events).
pub const DEFAULT_LOG_EVENTS: usize = 100_000;

/// KV bytes a token occupies in an 8B-class model (Llama 3.1 8B: 32 layers
/// × 8 KV heads × 128 dims × K and V × 2 bytes): what a CPU-tier reload
/// moves per token.
pub const KV_BYTES_PER_TOKEN: f64 = 131_072.0;

/// GB/s a reload from host memory reaches: PCIe 4.0 x16 as DMA achieves it
/// (32 GB/s raw; vLLM's offloading connector moves 0.5-2 MB blocks by DMA).
pub const PCIE_GBPS: f64 = 25.0;

/// Prompt tokens as the simulated tokenizer counts them: bytes / 4 for
/// text, the token count for token IDs.
pub fn prompt_tokens(prompt: &Prompt) -> u64 {
    match prompt {
        Prompt::Text(bytes) => (bytes.len() / BYTES_PER_TOKEN) as u64,
        Prompt::Tokens(tokens) => tokens.len() as u64,
    }
}

/// Latency parameters. Durations are the unscaled (real GPU) values; every
/// method applies `time_scale`.
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    /// Prefill seconds per uncached prompt token.
    pub prefill_s_per_token: f64,
    /// Fixed per-request prefill overhead (prefix lookup, scheduling):
    /// what a full cache hit still costs.
    pub lookup_overhead_s: f64,
    /// Seconds per output token after the first.
    pub decode_s_per_token: f64,
    /// Adapter load seconds at rank 16 and rank 64 (linear in between and
    /// beyond, at least 10 ms).
    pub adapter_load_rank16_s: f64,
    pub adapter_load_rank64_s: f64,
    /// Seconds to reload one cached token from the CPU tier.
    pub reload_s_per_token: f64,
    /// Multiplies every duration (tests use e.g. 0.05).
    pub time_scale: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel::gpu_8b(1.0)
    }
}

impl CostModel {
    /// An 8B-class model on one GPU: 0.9 s per 4096 prefill tokens, 45 ms
    /// overhead, 20 ms per decoded token, LoRA loads of 200 ms (rank 16) and
    /// 800 ms (rank 64), CPU-tier reloads at [`PCIE_GBPS`].
    pub fn gpu_8b(time_scale: f64) -> CostModel {
        CostModel {
            prefill_s_per_token: 0.9 / 4096.0,
            lookup_overhead_s: 0.045,
            decode_s_per_token: 0.020,
            adapter_load_rank16_s: 0.2,
            adapter_load_rank64_s: 0.8,
            reload_s_per_token: KV_BYTES_PER_TOKEN / (PCIE_GBPS * 1e9),
            time_scale,
        }
    }

    /// This model with CPU-tier reloads at `gbps` GB/s.
    pub fn with_reload_gbps(self, gbps: f64) -> CostModel {
        CostModel {
            reload_s_per_token: KV_BYTES_PER_TOKEN / (gbps.max(1e-3) * 1e9),
            ..self
        }
    }

    /// Time to reload `tokens` cached tokens from the CPU tier.
    pub fn reload(&self, tokens: u64) -> Duration {
        self.scaled(tokens as f64 * self.reload_s_per_token)
    }

    fn scaled(&self, seconds: f64) -> Duration {
        Duration::from_secs_f64((seconds * self.time_scale).max(0.0))
    }

    /// Uncontended prefill latency of a prompt with `uncached_tokens` tokens
    /// to compute: overhead + tokens × per-token cost
    /// ([`CostModel::lookup_overhead`] + [`CostModel::prefill_compute`]).
    pub fn prefill(&self, uncached_tokens: u64) -> Duration {
        self.scaled(self.lookup_overhead_s + uncached_tokens as f64 * self.prefill_s_per_token)
    }

    /// Prefill-engine time of `uncached_tokens` tokens (tokens × per-token
    /// cost): what a request occupies the pod's [`PrefillEngine`] for.
    pub fn prefill_compute(&self, uncached_tokens: u64) -> Duration {
        self.scaled(uncached_tokens as f64 * self.prefill_s_per_token)
    }

    /// The fixed per-request overhead (latency only, not engine time).
    pub fn lookup_overhead(&self) -> Duration {
        self.scaled(self.lookup_overhead_s)
    }

    /// Uncached prompt tokens one pod's prefill engine computes per second.
    pub fn prefill_tokens_per_s(&self) -> f64 {
        1.0 / (self.prefill_s_per_token * self.time_scale)
    }

    /// Time to decode `tokens` tokens.
    pub fn decode(&self, tokens: u64) -> Duration {
        self.scaled(tokens as f64 * self.decode_s_per_token)
    }

    /// Time per decoded token.
    pub fn decode_step(&self) -> Duration {
        self.decode(1)
    }

    /// Time to load an adapter of `rank`.
    pub fn adapter_load(&self, rank: u32) -> Duration {
        let slope = (self.adapter_load_rank64_s - self.adapter_load_rank16_s) / 48.0;
        let seconds = self.adapter_load_rank16_s + (rank as f64 - 16.0) * slope;
        self.scaled(seconds.max(0.01))
    }

    /// Time to first token without contention: queue wait (already real
    /// time) + adapter load + prefill of the uncached tokens.
    pub fn ttft(
        &self,
        queue_wait: Duration,
        adapter_load: Duration,
        uncached_tokens: u64,
    ) -> Duration {
        queue_wait + adapter_load + self.prefill(uncached_tokens)
    }

    /// Time from first token to last for `output_tokens` tokens.
    pub fn generation_after_first(&self, output_tokens: u64) -> Duration {
        self.decode(output_tokens.saturating_sub(1))
    }
}

/// One chain segment of a report: `hashes[0]`'s parent is `parent`, each
/// later hash's parent is the previous one.
pub type Segment = kvroute::report::StoredChain;

/// What [`KvCache::insert_chain`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InsertOutcome {
    /// Blocks that were not cached before.
    pub inserted: usize,
    /// Blocks evicted to make room (from the last tier: gone).
    pub evicted: usize,
    /// Blocks the GPU evicted to the CPU tier.
    pub offloaded: usize,
    /// Blocks of the chain moved back from the CPU tier to the GPU.
    pub reloaded: usize,
}

/// Cache changes after some sequence number, coalesced: each hash at most
/// once, `stored` in parent-first segments.
pub type CacheDelta = kvroute::report_log::LogDelta;

#[derive(Debug, Clone, Copy)]
struct Block {
    parent: Option<u64>,
    /// Its key in `order` (GPU) or `cpu_order` (CPU); 0: not yet in either.
    tick: u64,
    tier: Tier,
}

/// The pod's KV cache (see the module documentation).
#[derive(Debug, Clone)]
pub struct KvCache {
    /// GPU blocks.
    capacity: usize,
    /// Blocks the CPU tier keeps (0: no CPU tier).
    cpu_capacity: usize,
    blocks: HashMap<u64, Block>,
    /// GPU blocks: recency tick → hash; the first is the least recently used.
    order: BTreeMap<u64, u64>,
    /// CPU blocks: offload tick → hash; the first is the longest offloaded.
    cpu_order: BTreeMap<u64, u64>,
    tick: u64,
    log: ReportLog,
    /// Evictions not yet logged (silent eviction storm).
    silent: Vec<(u64, Option<u64>)>,
}

impl KvCache {
    /// An empty cache of `capacity` blocks keeping at most `max_log` events.
    pub fn new(capacity: usize, max_log: usize) -> KvCache {
        KvCache {
            capacity: capacity.max(1),
            cpu_capacity: 0,
            blocks: HashMap::new(),
            order: BTreeMap::new(),
            cpu_order: BTreeMap::new(),
            tick: 0,
            log: ReportLog::new(max_log),
            silent: Vec::new(),
        }
    }

    /// This cache with a CPU tier of `blocks` (0: none).
    pub fn with_cpu_tier(mut self, blocks: usize) -> KvCache {
        self.cpu_capacity = blocks;
        self
    }

    /// GPU blocks it keeps.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// CPU-tier blocks it keeps (0: no CPU tier).
    pub fn cpu_capacity(&self) -> usize {
        self.cpu_capacity
    }

    /// Blocks held, both tiers.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks held on the CPU tier (of [`KvCache::len`]).
    pub fn cpu_len(&self) -> usize {
        self.cpu_order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Fraction of the GPU capacity in use.
    pub fn usage(&self) -> f64 {
        self.order.len() as f64 / self.capacity as f64
    }

    /// Whether `hash` is held, in either tier.
    pub fn contains(&self, hash: u64) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// The tier `hash` is held in.
    pub fn tier(&self, hash: u64) -> Option<Tier> {
        self.blocks.get(&hash).map(|block| block.tier)
    }

    /// The last event's sequence number (0: none yet).
    pub fn seq(&self) -> u64 {
        self.log.seq()
    }

    /// The oldest `since` a delta can still be built from.
    pub fn oldest_since(&self) -> u64 {
        self.log.oldest_since()
    }

    /// The logged events after `since` (see [`ReportLog::events_after`]).
    pub fn events_after(&self, since: u64) -> Option<impl Iterator<Item = &BlockEvent>> {
        self.log.events_after(since)
    }

    /// Leading blocks of `chain` present, in either tier (no recency change).
    pub fn cached_prefix(&self, chain: &[u64]) -> usize {
        chain
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count()
    }

    /// Stores (or refreshes) every block of `chain` on the GPU, leaf-first
    /// (blocks on the CPU tier are reloaded), then evicts least-recently-used
    /// GPU blocks down to capacity: to the CPU tier if there is one, which
    /// evicts its longest offloaded beyond its own. New blocks, moves and
    /// evictions are logged.
    pub fn insert_chain(&mut self, chain: &[u64]) -> InsertOutcome {
        let mut outcome = InsertOutcome::default();
        for (i, &hash) in chain.iter().enumerate() {
            let parent = i.checked_sub(1).map(|p| chain[p]);
            match self.blocks.get_mut(&hash) {
                None => {
                    let block = Block {
                        parent,
                        tick: 0,
                        tier: Tier::Gpu,
                    };
                    self.blocks.insert(hash, block);
                    self.log.stored(hash, parent, Tier::Gpu);
                    outcome.inserted += 1;
                }
                Some(block) if block.tier == Tier::Cpu => {
                    self.cpu_order.remove(&block.tick);
                    block.tick = 0;
                    block.tier = Tier::Gpu;
                    self.log.stored(hash, block.parent, Tier::Gpu);
                    outcome.reloaded += 1;
                }
                Some(_) => {}
            }
        }
        for &hash in chain.iter().rev() {
            self.touch(hash);
        }
        while self.order.len() > self.capacity {
            let (_, hash) = self
                .order
                .pop_first()
                .expect("the GPU holds more than none");
            if self.cpu_capacity == 0 {
                self.drop_block(hash);
                outcome.evicted += 1;
                continue;
            }
            self.tick += 1;
            let block = self.blocks.get_mut(&hash).expect("order tracks GPU blocks");
            block.tier = Tier::Cpu;
            block.tick = self.tick;
            self.cpu_order.insert(self.tick, hash);
            self.log.stored(hash, block.parent, Tier::Cpu);
            outcome.offloaded += 1;
            while self.cpu_order.len() > self.cpu_capacity {
                let (_, hash) = self.cpu_order.pop_first().expect("the CPU holds more");
                self.drop_block(hash);
                outcome.evicted += 1;
            }
        }
        outcome
    }

    /// Forgets `hash` (no longer in its tier's order), logging its removal.
    fn drop_block(&mut self, hash: u64) {
        let block = self.blocks.remove(&hash).expect("orders track blocks");
        self.log.removed(hash, block.parent);
    }

    /// Makes a GPU block the most recently used.
    fn touch(&mut self, hash: u64) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(block) = self.blocks.get_mut(&hash) {
            if block.tick != 0 {
                self.order.remove(&block.tick);
            }
            block.tick = tick;
            self.order.insert(tick, hash);
        }
    }

    /// Empties the cache. Logged as evictions unless `silent`: then the
    /// evictions are kept back until [`KvCache::flush_silent`] (the router
    /// goes on believing the blocks are there). Returns the blocks dropped.
    pub fn evict_all(&mut self, silent: bool) -> usize {
        let mut dropped: Vec<(u64, Option<u64>)> = Vec::with_capacity(self.blocks.len());
        // Leaves first (oldest first), as an engine frees them: the CPU
        // tier's (the GPU dropped them before the rest), then the GPU's.
        let cpu = std::mem::take(&mut self.cpu_order);
        let gpu = std::mem::take(&mut self.order);
        for hash in cpu.into_values().chain(gpu.into_values()) {
            let block = self.blocks.remove(&hash).expect("orders track every block");
            dropped.push((hash, block.parent));
        }
        let count = dropped.len();
        if silent {
            self.silent.extend(dropped);
        } else {
            for (hash, parent) in dropped {
                self.log.removed(hash, parent);
            }
        }
        count
    }

    /// Logs the evictions a silent storm kept back (those not stored again
    /// since). Returns how many were logged.
    pub fn flush_silent(&mut self) -> usize {
        let pending = std::mem::take(&mut self.silent);
        let mut seen = HashSet::new();
        let mut logged = 0;
        for (hash, parent) in pending {
            if self.blocks.contains_key(&hash) || !seen.insert(hash) {
                continue;
            }
            self.log.removed(hash, parent);
            logged += 1;
        }
        logged
    }

    /// Evictions held back by a silent storm.
    pub fn silent_pending(&self) -> usize {
        self.silent.len()
    }

    /// The coalesced changes after `since`, or `None` when events after
    /// `since` were already dropped from the log (or `since` is in the
    /// future).
    pub fn delta(&self, since: u64) -> Option<CacheDelta> {
        self.log.delta(since)
    }

    /// Every block held, as parent-first chain segments of one tier each.
    pub fn full(&self) -> Vec<Segment> {
        let nodes: Vec<(u64, Option<u64>, Tier)> = self
            .order
            .values()
            .rev()
            .chain(self.cpu_order.values().rev())
            .map(|&hash| {
                let block = &self.blocks[&hash];
                (hash, block.parent, block.tier)
            })
            .collect();
        chain_segments(&nodes)
    }

    /// The protocol v1 report answering `?since=…&epoch=…`: a delta when
    /// `epoch` is this pod's and `since` is a retained, non-zero sequence
    /// number, else a full resync.
    pub fn report(
        &self,
        pod_id: &str,
        epoch: &str,
        since: Option<u64>,
        asked_epoch: Option<&str>,
        load: &PodLoad,
    ) -> Value {
        let mut body = self
            .log
            .report_body(pod_id, epoch, since, asked_epoch, || self.full());
        body.insert("queueDepth".into(), json!(load.queue_depth));
        body.insert("running".into(), json!(load.running));
        body.insert("gpuUtilization".into(), json!(load.gpu_utilization));
        body.insert("health".into(), json!(load.health));
        body.insert("adapters".into(), json!(load.adapters));
        body.insert("kvCapacityBlocks".into(), json!(self.capacity));
        body.insert(
            "residentBlocks".into(),
            json!(self.len().saturating_sub(self.cpu_len())),
        );
        Value::Object(body)
    }
}

/// The load part of a report.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PodLoad {
    pub queue_depth: u32,
    pub running: u32,
    pub gpu_utilization: f64,
    pub health: f64,
    pub adapters: Vec<String>,
}

/// What [`AdapterSlots::ensure`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterUse {
    /// The adapter had to be loaded (it costs its load time).
    pub loaded_now: bool,
    pub rank: u32,
    /// The adapter evicted to make room.
    pub evicted: Option<String>,
}

/// LoRA adapter slots: at most `max` loaded, least-recently-used evicted.
#[derive(Debug, Clone)]
pub struct AdapterSlots {
    max: usize,
    /// Least recently used first.
    loaded: Vec<String>,
    ranks: HashMap<String, u32>,
    default_rank: u32,
    loads: u64,
}

impl AdapterSlots {
    pub const DEFAULT_RANK: u32 = 16;

    pub fn new(max: usize, ranks: HashMap<String, u32>) -> AdapterSlots {
        AdapterSlots {
            max: max.max(1),
            loaded: Vec::new(),
            ranks,
            default_rank: Self::DEFAULT_RANK,
            loads: 0,
        }
    }

    pub fn max(&self) -> usize {
        self.max
    }

    pub fn rank(&self, name: &str) -> u32 {
        self.ranks.get(name).copied().unwrap_or(self.default_rank)
    }

    /// Loaded adapters, least recently used first.
    pub fn loaded(&self) -> &[String] {
        &self.loaded
    }

    pub fn is_loaded(&self, name: &str) -> bool {
        self.loaded.iter().any(|a| a == name)
    }

    /// Loads performed by [`AdapterSlots::ensure`] so far (preloads excluded).
    pub fn loads(&self) -> u64 {
        self.loads
    }

    /// Loads `name` without counting it (start-up preload).
    pub fn preload(&mut self, name: &str) {
        self.place(name);
    }

    /// Makes `name` loaded and most recently used.
    pub fn ensure(&mut self, name: &str) -> AdapterUse {
        let loaded_now = !self.is_loaded(name);
        if loaded_now {
            self.loads += 1;
        }
        let evicted = self.place(name);
        AdapterUse {
            loaded_now,
            rank: self.rank(name),
            evicted,
        }
    }

    fn place(&mut self, name: &str) -> Option<String> {
        if let Some(at) = self.loaded.iter().position(|a| a == name) {
            let a = self.loaded.remove(at);
            self.loaded.push(a);
            return None;
        }
        let evicted = (self.loaded.len() >= self.max).then(|| self.loaded.remove(0));
        self.loaded.push(name.to_string());
        evicted
    }
}

/// When one request's prefill runs on its pod's [`PrefillEngine`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillSlot {
    /// The engine starts computing it (the previous prefill is done).
    pub start: Duration,
    /// Its prefill is done: its blocks enter the cache.
    pub end: Duration,
    /// Its first token: `end` + the per-request overhead.
    pub first_token: Duration,
}

/// One pod's prefill compute: a single engine computing prefills one after
/// another in the order they were scheduled (FIFO), at the cost model's
/// per-token rate. Times are durations since an epoch the caller picks (the
/// server's start, or simulated time zero).
///
/// It also remembers the chains of prefills scheduled and not yet finished:
/// they are done before any later prefill starts, so their blocks count as
/// cached for it ([`PrefillEngine::cached_prefix`]).
#[derive(Debug, Clone, Default)]
pub struct PrefillEngine {
    busy_until: Duration,
    pending: VecDeque<Vec<u64>>,
    /// When the pod's link is done with the reloads scheduled.
    reloads_until: Duration,
}

/// What a prefill scheduled now finds cached of its chain
/// ([`PrefillEngine::cached`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CachedPrefix {
    pub blocks: usize,
    pub tokens: u64,
    /// Of `tokens`, those on the CPU tier: reloaded before the prefill.
    pub reload_tokens: u64,
}

impl PrefillEngine {
    pub fn new() -> PrefillEngine {
        PrefillEngine::default()
    }

    /// When the last scheduled prefill is done.
    pub fn busy_until(&self) -> Duration {
        self.busy_until
    }

    /// Prefills scheduled and not yet finished.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Leading blocks of `chain` a prefill scheduled now finds cached when
    /// it starts: held by `cache`, or computed by a prefill scheduled before.
    /// (Chained hashes: a shared block means a shared prefix, so this is the
    /// longest of the two.)
    pub fn cached_prefix(&self, cache: &KvCache, chain: &[u64]) -> usize {
        cache.cached_prefix(chain).max(self.pending_prefix(chain))
    }

    /// Leading blocks of `chain` a prefill scheduled before computes.
    fn pending_prefix(&self, chain: &[u64]) -> usize {
        self.pending
            .iter()
            .map(|p| p.iter().zip(chain).take_while(|(a, b)| a == b).count())
            .max()
            .unwrap_or(0)
    }

    /// [`PrefillEngine::cached_prefix`] in tokens of the prompt `coverage`
    /// describes, with the tokens to reload: cached blocks on the CPU tier
    /// that no prefill scheduled before computes (those will be on the GPU).
    pub fn cached(&self, cache: &KvCache, chain: &[u64], coverage: &Coverage) -> CachedPrefix {
        let blocks = self.cached_prefix(cache, chain);
        let block_tokens = |i: usize| coverage.tokens(i as u32 + 1) - coverage.tokens(i as u32);
        let reload_tokens = (self.pending_prefix(chain)..blocks)
            .filter(|&i| cache.tier(chain[i]) == Some(Tier::Cpu))
            .map(block_tokens)
            .sum();
        CachedPrefix {
            blocks,
            tokens: coverage.tokens(blocks as u32),
            reload_tokens,
        }
    }

    /// Reloads `tokens` cached tokens from the CPU tier, from `ready` on
    /// (after the pod's link is done with the reloads before): when they
    /// are on the GPU. `ready` itself when there is nothing to reload.
    pub fn reload(&mut self, cost: &CostModel, ready: Duration, tokens: u64) -> Duration {
        if tokens == 0 {
            return ready;
        }
        self.reloads_until = ready.max(self.reloads_until) + cost.reload(tokens);
        self.reloads_until
    }

    /// Schedules a prefill of `uncached_tokens` tokens that can start at
    /// `ready` (slot held, adapter loaded): it starts at `ready` or when the
    /// previous prefill is done, whichever is later, and occupies the engine
    /// for [`CostModel::prefill_compute`]; its first token follows
    /// [`CostModel::lookup_overhead`] later. `chain` is pending until
    /// [`PrefillEngine::finish`].
    pub fn schedule(
        &mut self,
        cost: &CostModel,
        ready: Duration,
        uncached_tokens: u64,
        chain: &[u64],
    ) -> PrefillSlot {
        let start = ready.max(self.busy_until);
        let end = start + cost.prefill_compute(uncached_tokens);
        self.busy_until = end;
        self.pending.push_back(chain.to_vec());
        PrefillSlot {
            start,
            end,
            first_token: end + cost.lookup_overhead(),
        }
    }

    /// A scheduled prefill of `chain` is done (its blocks are now in the
    /// cache) or abandoned: it no longer counts as pending.
    pub fn finish(&mut self, chain: &[u64]) {
        if let Some(at) = self.pending.iter().position(|p| p == chain) {
            self.pending.remove(at);
        }
    }
}

/// A request admitted to prefill: what it costs before its first token.
#[derive(Debug, Clone, PartialEq)]
pub struct Admission {
    pub chain: Vec<u64>,
    pub prompt_tokens: u64,
    pub cached_blocks: usize,
    pub cached_tokens: u64,
    /// Of `cached_tokens`, those reloaded from the CPU tier.
    pub reload_tokens: u64,
    /// Adapter load time (zero when loaded already or no adapter).
    pub adapter_load: Duration,
    /// Uncontended prefill latency of the uncached tokens, overhead included
    /// ([`CostModel::prefill`]).
    pub prefill: Duration,
}

impl Admission {
    /// The prompt tokens the prefill computes: those cached in no tier (a
    /// CPU-tier hit is reloaded, not computed).
    pub fn uncached_tokens(&self) -> u64 {
        self.prompt_tokens - self.cached_tokens
    }
}

/// One simulated pod: cache, adapters, costs and prefill engine together.
#[derive(Debug, Clone)]
pub struct PodModel {
    pub cache: KvCache,
    pub adapters: AdapterSlots,
    pub cost: CostModel,
    pub hasher: BlockHasher,
    pub engine: PrefillEngine,
}

impl PodModel {
    pub fn new(
        config: &Config,
        cache: KvCache,
        adapters: AdapterSlots,
        cost: CostModel,
    ) -> PodModel {
        PodModel {
            cache,
            adapters,
            cost,
            // Every full block of the prompt, as vLLM caches it; the
            // router matches the first maxPrefixBlocks of the same chain.
            hasher: BlockHasher::from_config(config).uncapped(),
            engine: PrefillEngine::new(),
        }
    }

    /// Admits a request to prefill: loads its adapter if needed and counts
    /// its cached prefix (the cache plus the prefills scheduled on the
    /// engine, see [`PrefillEngine::cached_prefix`]). The cache is not
    /// changed until [`PodModel::finish_prefill`]. `salt`: vLLM's
    /// `cache_salt`, which keeps the request's blocks apart.
    pub fn admit(
        &mut self,
        target: &ModelTarget,
        prompt: &Prompt,
        salt: Option<&str>,
    ) -> Admission {
        let adapter_load = match &target.adapter {
            Some(name) => {
                let used = self.adapters.ensure(name);
                if used.loaded_now {
                    self.cost.adapter_load(used.rank)
                } else {
                    Duration::ZERO
                }
            }
            None => Duration::ZERO,
        };
        let chain = self.hasher.chain(target, prompt, salt);
        let cached = self
            .engine
            .cached(&self.cache, &chain, &self.hasher.coverage(prompt));
        let tokens = prompt_tokens(prompt);
        Admission {
            prefill: self.cost.prefill(tokens - cached.tokens),
            chain,
            prompt_tokens: tokens,
            cached_blocks: cached.blocks,
            cached_tokens: cached.tokens,
            reload_tokens: cached.reload_tokens,
            adapter_load,
        }
    }

    /// Schedules an admitted request's prefill on the engine; `slot_at` is
    /// when it got its sequence slot (the adapter load and the reload of
    /// its prefix's CPU-tier blocks come first).
    pub fn schedule_prefill(&mut self, admission: &Admission, slot_at: Duration) -> PrefillSlot {
        let loaded = slot_at + admission.adapter_load;
        let ready = self
            .engine
            .reload(&self.cost, loaded, admission.reload_tokens);
        self.engine.schedule(
            &self.cost,
            ready,
            admission.uncached_tokens(),
            &admission.chain,
        )
    }

    /// Prefill done: the request's blocks are now cached (and no longer
    /// pending on the engine).
    pub fn finish_prefill(&mut self, admission: &Admission) -> InsertOutcome {
        self.engine.finish(&admission.chain);
        self.cache.insert_chain(&admission.chain)
    }

    /// A scheduled prefill that will not finish (the client went away): its
    /// blocks will not be cached.
    pub fn abandon_prefill(&mut self, admission: &Admission) {
        self.engine.finish(&admission.chain);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute::cluster::ClusterState;
    use kvroute::config::PodConfig;
    use kvroute::index::{PrefixLookup, PrefixTree};
    use kvroute::report::parse_report;

    fn load() -> PodLoad {
        PodLoad {
            queue_depth: 2,
            running: 1,
            gpu_utilization: 0.125,
            health: 1.0,
            adapters: vec!["a".into()],
        }
    }

    fn report(cache: &KvCache, since: u64, epoch: &str) -> kvroute::report::PodReport {
        let value = cache.report("p", "E", Some(since), Some(epoch), &load());
        parse_report(value.to_string().as_bytes()).expect("report parses")
    }

    /// Folds a report into a tree the way the router does.
    fn fold(tree: &mut PrefixTree, r: &kvroute::report::PodReport) {
        if r.full {
            tree.drop_pod(0);
        }
        for chain in &r.stored {
            let outcome = tree.insert_chain(0, chain.parent, &chain.hashes);
            assert_eq!(outcome.orphaned, 0, "{:?}", r.stored);
        }
        tree.remove_blocks(0, &r.removed);
    }

    fn assert_mirrors(tree: &PrefixTree, cache: &KvCache, chains: &[Vec<u64>]) {
        assert_eq!(tree.pod_block_count(0), cache.len());
        for chain in chains {
            assert_eq!(
                tree.lookup(chain).blocks(0) as usize,
                cache.cached_prefix(chain),
                "chain {chain:?}"
            );
        }
    }

    #[test]
    fn lru_evicts_leaves_first_and_counts_prefix() {
        let mut cache = KvCache::new(5, 100);
        assert_eq!(cache.insert_chain(&[1, 2, 3]).inserted, 3);
        assert_eq!(cache.cached_prefix(&[1, 2, 3, 4]), 3);
        assert_eq!(cache.cached_prefix(&[9, 2]), 0);
        // Sharing prefix [1, 2]: only 4 and 5 are new.
        let out = cache.insert_chain(&[1, 2, 4, 5]);
        assert_eq!(
            out,
            InsertOutcome {
                inserted: 2,
                evicted: 0,
                ..InsertOutcome::default()
            }
        );
        assert_eq!(cache.len(), 5);
        // Recency, oldest first: 3, 5, 4, 2, 1 (chains are touched leaf-first),
        // so a new chain of 2 evicts 3 and 5.
        let out = cache.insert_chain(&[7, 8]);
        assert_eq!(
            out,
            InsertOutcome {
                inserted: 2,
                evicted: 2,
                ..InsertOutcome::default()
            }
        );
        assert!(!cache.contains(3));
        assert!(!cache.contains(5));
        assert!(cache.contains(1) && cache.contains(2) && cache.contains(4));
        assert_eq!(cache.cached_prefix(&[1, 2, 4, 5]), 3);
        // Invariant: every present block's parent is present.
        for seg in cache.full() {
            if let Some(p) = seg.parent {
                assert!(cache.contains(p));
            }
        }
    }

    #[test]
    fn chain_longer_than_capacity_keeps_its_prefix() {
        let mut cache = KvCache::new(3, 100);
        let out = cache.insert_chain(&[1, 2, 3, 4, 5]);
        assert_eq!(
            out,
            InsertOutcome {
                inserted: 5,
                evicted: 2,
                ..InsertOutcome::default()
            }
        );
        assert_eq!(cache.cached_prefix(&[1, 2, 3, 4, 5]), 3);
    }

    #[test]
    fn cached_tokens_and_ttft() {
        let config = Config::default(); // 64-byte text blocks = 16 tokens
        let cost = CostModel::gpu_8b(1.0);
        let mut pod = PodModel::new(
            &config,
            KvCache::new(100, 1000),
            AdapterSlots::new(2, HashMap::new()),
            cost.clone(),
        );
        let target = ModelTarget {
            base_model: "m".into(),
            adapter: None,
        };
        let prompt = Prompt::Text(vec![b'x'; 64 * 10 + 10]);
        let first = pod.admit(&target, &prompt, None);
        assert_eq!(
            (first.prompt_tokens, first.cached_tokens, first.chain.len()),
            (162, 0, 10)
        );
        assert_eq!(first.prefill, cost.prefill(162));
        pod.finish_prefill(&first);
        let second = pod.admit(&target, &prompt, None);
        assert_eq!((second.cached_blocks, second.cached_tokens), (10, 160));
        assert_eq!(second.prefill, cost.prefill(2));
        // TTFT formula.
        let expected = 0.045 + 4096.0 * 0.9 / 4096.0;
        assert!((cost.prefill(4096).as_secs_f64() - expected).abs() < 1e-9);
        let scaled = CostModel::gpu_8b(0.05);
        assert!((scaled.prefill(4096).as_secs_f64() - expected * 0.05).abs() < 1e-9);
        assert!((scaled.decode(10).as_secs_f64() - 0.2 * 0.05).abs() < 1e-9);
        let ttft = cost.ttft(Duration::from_millis(100), Duration::ZERO, 0);
        assert!((ttft.as_secs_f64() - 0.145).abs() < 1e-9);
        assert_eq!(cost.generation_after_first(1), Duration::ZERO);
        // Token prompts count tokens.
        let tokens = Prompt::Tokens((0..40).collect());
        let t = pod.admit(&target, &tokens, None);
        assert_eq!((t.prompt_tokens, t.chain.len()), (40, 2));
        pod.finish_prefill(&t);
        assert_eq!(pod.admit(&target, &tokens, None).cached_tokens, 32);
    }

    #[test]
    fn prefill_engine_is_fifo_and_shares_pending_prefixes() {
        let cost = CostModel::gpu_8b(1.0);
        let ms = |m: u64| Duration::from_millis(m);
        let mut engine = PrefillEngine::new();
        let cache = KvCache::new(100, 100);
        // 4096 uncached tokens: 900 ms on the engine, first token 45 ms later.
        let a = engine.schedule(&cost, ms(100), 4096, &[1, 2, 3]);
        assert_eq!(
            (a.start, a.end, a.first_token),
            (ms(100), ms(1000), ms(1045))
        );
        // Arrives while a computes: starts when a is done.
        let b = engine.schedule(&cost, ms(200), 2048, &[7, 8]);
        assert_eq!(
            (b.start, b.end, b.first_token),
            (ms(1000), ms(1450), ms(1495))
        );
        // A full hit takes no engine time but still waits its turn.
        let c = engine.schedule(&cost, ms(300), 0, &[7, 8]);
        assert_eq!(
            (c.start, c.end, c.first_token),
            (ms(1450), ms(1450), ms(1495))
        );
        // After an idle gap the engine starts at once.
        let d = engine.schedule(&cost, ms(5000), 0, &[9]);
        assert_eq!((d.start, d.first_token), (ms(5000), ms(5045)));
        assert_eq!(engine.busy_until(), ms(5000));
        // Pending prefills count as cached for later ones.
        assert_eq!(engine.pending(), 4);
        assert_eq!(engine.cached_prefix(&cache, &[1, 2, 4]), 2);
        assert_eq!(engine.cached_prefix(&cache, &[7, 8, 9]), 2);
        engine.finish(&[1, 2, 3]);
        engine.finish(&[7, 8]);
        assert_eq!(engine.cached_prefix(&cache, &[1, 2, 4]), 0);
        assert_eq!(
            engine.cached_prefix(&cache, &[7, 8, 9]),
            2,
            "c still pending"
        );
        engine.finish(&[7, 8]);
        engine.finish(&[9]);
        engine.finish(&[9]); // unknown: no-op
        assert_eq!(engine.pending(), 0);

        // Through the pod: the second request queues behind the first and
        // reuses its prefix.
        let config = Config::default(); // 16-token blocks
        let mut pod = PodModel::new(
            &config,
            KvCache::new(1000, 1000),
            AdapterSlots::new(2, HashMap::new()),
            cost.clone(),
        );
        let target = ModelTarget {
            base_model: "m".into(),
            adapter: None,
        };
        let prompt = Prompt::Text(vec![b'x'; 64 * 256]); // 4096 tokens
        let first = pod.admit(&target, &prompt, None);
        let s1 = pod.schedule_prefill(&first, ms(0));
        let second = pod.admit(&target, &prompt, None);
        assert_eq!(second.cached_tokens, 4096);
        let s2 = pod.schedule_prefill(&second, ms(10));
        assert_eq!(
            (s1.end, s2.start, s2.first_token),
            (ms(900), ms(900), ms(945))
        );
        pod.finish_prefill(&first);
        pod.abandon_prefill(&second);
        assert_eq!(pod.engine.pending(), 0);
        assert_eq!(pod.cache.cached_prefix(&first.chain), 256);
    }

    #[test]
    fn lora_slots_load_once_and_evict_lru() {
        let cost = CostModel::gpu_8b(1.0);
        assert!((cost.adapter_load(16).as_secs_f64() - 0.2).abs() < 1e-9);
        assert!((cost.adapter_load(64).as_secs_f64() - 0.8).abs() < 1e-9);
        let mut slots = AdapterSlots::new(2, HashMap::from([("big".to_string(), 64)]));
        slots.preload("a");
        assert_eq!(slots.loads(), 0);
        assert!(!slots.ensure("a").loaded_now);
        let b = slots.ensure("big");
        assert_eq!((b.loaded_now, b.rank, b.evicted), (true, 64, None));
        slots.ensure("a"); // a is now most recent
        let c = slots.ensure("c");
        assert_eq!(c.evicted.as_deref(), Some("big"));
        assert_eq!(slots.loaded(), ["a".to_string(), "c".to_string()]);
        assert_eq!(slots.loads(), 2);
        // Through the pod: first use costs the load, the second does not.
        let mut pod = PodModel::new(
            &Config::default(),
            KvCache::new(10, 10),
            slots,
            cost.clone(),
        );
        let target = ModelTarget {
            base_model: "m".into(),
            adapter: Some("big".into()),
        };
        let prompt = Prompt::Text(b"hello".to_vec());
        assert_eq!(
            pod.admit(&target, &prompt, None).adapter_load,
            cost.adapter_load(64)
        );
        assert_eq!(
            pod.admit(&target, &prompt, None).adapter_load,
            Duration::ZERO
        );
    }

    #[test]
    fn deltas_and_full_resync_round_trip_through_the_parser() {
        let mut cache = KvCache::new(6, 1000);
        let mut tree = PrefixTree::new(1000);
        let mut chains: Vec<Vec<u64>> = Vec::new();
        let first = cache.report("p", "E", None, None, &load());
        let r = parse_report(first.to_string().as_bytes()).unwrap();
        assert!(r.full && r.stored.is_empty() && r.seq == 0);
        assert_eq!(
            (r.queue_depth, r.running, r.gpu_utilization),
            (2, 1, Some(0.125))
        );
        assert_eq!(r.adapters, vec!["a".to_string()]);
        let mut seq = r.seq;
        // Insert overlapping chains, folding a delta after each, with churn.
        let script: Vec<Vec<u64>> = vec![
            vec![1, 2, 3],
            vec![1, 2, 4],
            vec![10, 11],
            vec![1, 2, 3, 5],
            vec![20, 21, 22, 23],
            vec![1, 2, 4],
            vec![10, 11, 12],
        ];
        for (i, chain) in script.iter().enumerate() {
            cache.insert_chain(chain);
            chains.push(chain.clone());
            if i % 2 == 1 || seq == 0 {
                let r = report(&cache, seq, "E");
                if seq == 0 {
                    assert!(r.full);
                } else {
                    assert!(!r.full);
                    assert_eq!(r.since, seq);
                }
                fold(&mut tree, &r);
                seq = r.seq;
                assert_mirrors(&tree, &cache, &chains);
            }
        }
        let r = report(&cache, seq, "E");
        fold(&mut tree, &r);
        seq = r.seq;
        assert_mirrors(&tree, &cache, &chains);
        // Steady state: re-touching cached chains logs nothing.
        cache.insert_chain(&[1, 2, 4]);
        let r = report(&cache, seq, "E");
        assert!(!r.full && r.stored.is_empty() && r.removed.is_empty());
        // A wrong epoch or since=0 gets a full resync that reproduces the cache.
        for (since, epoch) in [(seq, "other"), (0, "E")] {
            let r = report(&cache, since, epoch);
            assert!(r.full);
            assert_eq!(r.since, 0);
            let mut fresh = PrefixTree::new(1000);
            fold(&mut fresh, &r);
            assert_mirrors(&fresh, &cache, &chains);
        }
    }

    #[test]
    fn delta_coalesces_store_remove_store() {
        let mut cache = KvCache::new(2, 1000);
        let mut tree = PrefixTree::new(100);
        cache.insert_chain(&[1, 2]);
        let r = report(&cache, 0, "E");
        fold(&mut tree, &r);
        let seq = r.seq;
        cache.insert_chain(&[7, 8]); // evicts 2 then 1
        cache.insert_chain(&[1, 2]); // evicts 8 then 7, stores 1, 2 again
        let delta = cache.delta(seq).unwrap();
        let mut removed = delta.removed.clone();
        removed.sort();
        assert_eq!(removed, vec![7, 8]);
        assert_eq!(
            delta.stored,
            vec![Segment {
                parent: None,
                hashes: vec![1, 2],
                tier: Tier::Gpu,
            }]
        );
        fold(&mut tree, &report(&cache, seq, "E"));
        assert_mirrors(&tree, &cache, &[vec![1, 2], vec![7, 8]]);
    }

    #[test]
    fn log_bound_forces_full_resync() {
        let mut cache = KvCache::new(100, 4);
        cache.insert_chain(&[1, 2, 3]);
        let seq = cache.seq();
        cache.insert_chain(&[4, 5, 6]);
        assert_eq!(cache.oldest_since(), 2);
        assert!(cache.delta(1).is_none());
        assert!(cache.delta(seq).is_some());
        assert!(report(&cache, 1, "E").full);
        assert!(cache.delta(cache.seq() + 1).is_none());
    }

    #[test]
    fn silent_eviction_storm_is_logged_on_flush() {
        let mut cache = KvCache::new(10, 100);
        cache.insert_chain(&[1, 2, 3]);
        cache.insert_chain(&[4]);
        let seq = cache.seq();
        assert_eq!(cache.evict_all(true), 4);
        assert!(cache.is_empty());
        let d = cache.delta(seq).unwrap();
        assert!(d.removed.is_empty() && d.stored.is_empty());
        cache.insert_chain(&[4]); // stored again before the flush
        assert_eq!(cache.flush_silent(), 3);
        let d = cache.delta(seq).unwrap();
        let mut removed = d.removed;
        removed.sort();
        assert_eq!(removed, vec![1, 2, 3]);
        assert_eq!(d.stored.len(), 1);
        // Loud storm.
        let seq = cache.seq();
        assert_eq!(cache.evict_all(false), 1);
        assert_eq!(cache.delta(seq).unwrap().removed, vec![4]);
    }

    /// Folds a report's tiers the way a tier-aware router would.
    fn fold_tiers(tiers: &mut HashMap<u64, Tier>, r: &kvroute::report::PodReport) {
        if r.full {
            tiers.clear();
        }
        for chain in &r.stored {
            tiers.extend(chain.hashes.iter().map(|&h| (h, chain.tier)));
        }
        for hash in &r.removed {
            tiers.remove(hash);
        }
    }

    fn assert_tiers_mirror(tiers: &HashMap<u64, Tier>, cache: &KvCache) {
        assert_eq!(tiers.len(), cache.len());
        for (&hash, &tier) in tiers {
            assert_eq!(cache.tier(hash), Some(tier), "{hash:x}");
        }
    }

    /// Random overlapping chains under heavy eviction, with storms and
    /// reports at random moments: the router's fold always mirrors the pod,
    /// without a CPU tier and with one (tiers included).
    #[test]
    fn random_churn_round_trips() {
        for cpu_blocks in [0, 16] {
            random_churn(cpu_blocks);
        }
    }

    fn random_churn(cpu_blocks: usize) {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let mut cache = KvCache::new(24, 10_000).with_cpu_tier(cpu_blocks);
        let mut tree = PrefixTree::new(100_000);
        let mut tiers = HashMap::new();
        let mut seq = 0;
        let mut chains = Vec::new();
        let mut offloaded = 0;
        for _ in 0..2000 {
            match next(20) {
                0 => {
                    cache.evict_all(next(2) == 0);
                }
                1 => {
                    cache.flush_silent();
                }
                2..=5 => {
                    let r = report(&cache, seq, "E");
                    fold(&mut tree, &r);
                    fold_tiers(&mut tiers, &r);
                    seq = r.seq;
                    if cache.silent_pending() == 0 {
                        assert_mirrors(&tree, &cache, &chains);
                        assert_tiers_mirror(&tiers, &cache);
                    }
                }
                _ => {
                    // Chains from a few families sharing prefixes; a block
                    // past the split encodes (split, variant), so a hash
                    // still determines its parent, as chained hashes do.
                    let family = next(4);
                    let split = next(6);
                    let variant = next(3);
                    let len = 1 + next(12);
                    let chain: Vec<u64> = (0..len)
                        .map(|i| {
                            let branch = if i >= split {
                                (split + 1) * 4 + variant + 1
                            } else {
                                0
                            };
                            (family << 40) | (branch << 20) | (i + 1)
                        })
                        .collect();
                    offloaded += cache.insert_chain(&chain).offloaded;
                    assert!(cache.cpu_len() <= cpu_blocks);
                    chains.push(chain);
                    if chains.len() > 50 {
                        chains.remove(0);
                    }
                }
            }
        }
        cache.flush_silent();
        let r = report(&cache, seq, "E");
        fold(&mut tree, &r);
        fold_tiers(&mut tiers, &r);
        assert_mirrors(&tree, &cache, &chains);
        assert_tiers_mirror(&tiers, &cache);
        assert_eq!(offloaded > 0, cpu_blocks > 0);
    }

    #[test]
    fn a_cpu_tier_keeps_what_the_gpu_evicts_until_a_request_reloads_it() {
        let mut cache = KvCache::new(3, 100).with_cpu_tier(2);
        cache.insert_chain(&[1, 2, 3]);
        // Two more GPU blocks evict 3, then 2, to the CPU tier.
        let out = cache.insert_chain(&[7, 8]);
        assert_eq!((out.offloaded, out.evicted), (2, 0));
        assert_eq!(
            (cache.tier(3), cache.tier(2)),
            (Some(Tier::Cpu), Some(Tier::Cpu))
        );
        assert_eq!(cache.cached_prefix(&[1, 2, 3]), 3, "either tier counts");
        // One more: 1 leaves the GPU, and the CPU tier drops 3 (offloaded
        // first, a leaf).
        let out = cache.insert_chain(&[9]);
        assert_eq!((out.offloaded, out.evicted), (1, 1));
        assert_eq!(cache.tier(3), None);
        assert_eq!((cache.len(), cache.cpu_len()), (5, 2));
        assert!((cache.usage() - 1.0).abs() < 1e-9, "the GPU's 3 of 3");
        // Its size and use, in the GPU's blocks.
        let r = report(&cache, 0, "E");
        assert_eq!(
            (r.kv_capacity_blocks, r.resident_blocks),
            (Some(3), Some(3))
        );
        // The report: GPU segments, and 1-2 on the CPU.
        let cpu: Vec<Segment> = cache
            .full()
            .into_iter()
            .filter(|s| s.tier == Tier::Cpu)
            .collect();
        assert_eq!(
            cpu,
            [Segment {
                parent: None,
                hashes: vec![1, 2],
                tier: Tier::Cpu
            }]
        );
        // A request continuing 1-2 reloads them; three GPU blocks go to the
        // CPU tier, which keeps two.
        let seq = cache.seq();
        let out = cache.insert_chain(&[1, 2, 4]);
        assert_eq!(
            out,
            InsertOutcome {
                inserted: 1,
                evicted: 1,
                offloaded: 3,
                reloaded: 2
            }
        );
        assert_eq!(cache.cached_prefix(&[1, 2, 4]), 3);
        assert!([1, 2, 4].iter().all(|&h| cache.tier(h) == Some(Tier::Gpu)));
        let delta = cache.delta(seq).unwrap();
        let moved: Vec<(Vec<u64>, Tier)> = delta
            .stored
            .iter()
            .map(|s| (s.hashes.clone(), s.tier))
            .collect();
        assert!(moved.contains(&(vec![1, 2, 4], Tier::Gpu)), "{moved:?}");
        assert_eq!(delta.removed.len(), 1);
        // A storm drops both tiers.
        assert_eq!(cache.evict_all(false), 5);
        assert!(cache.is_empty() && cache.cpu_len() == 0);
    }

    #[test]
    fn a_cpu_hit_costs_a_reload_not_a_prefill() {
        let config = Config::default(); // 16-token blocks of 64 bytes
        let cost = CostModel::gpu_8b(1.0);
        let mut pod = PodModel::new(
            &config,
            KvCache::new(64, 1000).with_cpu_tier(256),
            AdapterSlots::new(1, HashMap::new()),
            cost.clone(),
        );
        let target = ModelTarget {
            base_model: "m".into(),
            adapter: None,
        };
        let prompt = |c: u8| Prompt::Text(vec![c; 64 * 64]); // 1024 tokens
        let first = pod.admit(&target, &prompt(b'a'), None);
        pod.finish_prefill(&first);
        // Another 64-block prompt pushes the first to the CPU tier.
        let other = pod.admit(&target, &prompt(b'b'), None);
        pod.finish_prefill(&other);
        assert_eq!(pod.cache.cpu_len(), 64);
        let again = pod.admit(&target, &prompt(b'a'), None);
        assert_eq!((again.cached_tokens, again.reload_tokens), (1024, 1024));
        assert_eq!(again.prefill, cost.prefill(0));
        // 1024 tokens × 128 KiB over 25 GB/s: 5.4 ms, before the prefill.
        let reload = cost.reload(1024);
        assert!((reload.as_secs_f64() - 1024.0 * 131_072.0 / 25e9).abs() < 1e-9);
        let ms = |m: u64| Duration::from_millis(m);
        let slot = pod.schedule_prefill(&again, ms(100));
        assert_eq!(slot.start, ms(100) + reload);
        // A second reload at the same time waits for the link.
        let twice = pod.schedule_prefill(&again, ms(100));
        assert_eq!(twice.start, ms(100) + reload * 2);
        // Reloaded, its blocks are on the GPU: no reload the next time.
        pod.finish_prefill(&again);
        let hot = pod.admit(&target, &prompt(b'a'), None);
        assert_eq!((hot.cached_tokens, hot.reload_tokens), (1024, 0));
        // Recomputing would have cost 1024 tokens of prefill: 44× more.
        let ratio = cost.prefill_compute(1024).as_secs_f64() / reload.as_secs_f64();
        assert!((40.0..45.0).contains(&ratio), "{ratio}");
    }

    #[test]
    fn cluster_state_follows_the_pod() {
        let config = Config {
            pods: vec![PodConfig {
                id: "p".into(),
                address: "127.0.0.1:1".into(),
                report_address: None,
                metrics_address: None,
                attributes: Default::default(),
            }],
            ..Config::default()
        };
        let mut cluster = ClusterState::new(&config, 0);
        let mut pod = PodModel::new(
            &config,
            KvCache::new(20, 1000),
            AdapterSlots::new(1, HashMap::new()),
            CostModel::default(),
        );
        let target = ModelTarget {
            base_model: "m".into(),
            adapter: None,
        };
        let mut chains = Vec::new();
        let mut since = 0;
        let mut epoch: Option<String> = None;
        for i in 0..12u8 {
            let prompt = Prompt::Text(vec![b'a' + (i % 5); 64 * (2 + i as usize % 4)]);
            let admission = pod.admit(&target, &prompt, None);
            pod.finish_prefill(&admission);
            chains.push(admission.chain.clone());
            let body = pod
                .cache
                .report("p", "E1", Some(since), epoch.as_deref(), &load())
                .to_string();
            let (summary, _) = cluster.apply_report("p", body.as_bytes(), 0, 0);
            let summary = summary.expect("report folds");
            assert!(!summary.resync && summary.orphaned == 0, "{summary:?}");
            since = pod.cache.seq();
            epoch = Some("E1".into());
            for chain in &chains {
                assert_eq!(
                    cluster.index().lookup(chain).blocks(0) as usize,
                    pod.cache.cached_prefix(chain)
                );
            }
        }
        let last = pod.admit(&target, &Prompt::Text(vec![b'a'; 64 * 2]), None);
        assert_eq!(last.cached_blocks, 2);
        assert_eq!(cluster.index().lookup(&last.chain).blocks(0), 2);
    }
}
