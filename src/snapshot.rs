//! The published snapshot: how the service hands the index and pod states
//! to every worker through Envoy shared data.
//!
//! Every `get_shared_data` copies the whole value, so nothing a request reads
//! is large:
//!
//! | key                     | value                                          | read per request |
//! |-------------------------|------------------------------------------------|------------------|
//! | `kvroute/pods`          | JSON [`PodTable`]: generation, members digest, bucket count, per pod id, address, queue, load, health, adapters, attributes | only when the members digest changes |
//! | `kvroute/podstate`      | binary: generation, publication time, members digest, then per pod (in the JSON's order) queue, in-flight at report, last report, load, health, reported health ([`PodTable::encode_state`], 40 B a pod) | when the generation changes |
//! | `kvroute/generation`    | the table's generation, 8 bytes LE             | once |
//! | `kvroute/idx/{b:x}`     | bucket `b`: entry count (u32 LE), then per block ordered by hash its hash (u64 LE) and holders (4 × u16 LE, [`encode_bucket`]), 16 B each, then the holder lists of blocks with more than four | O(k log n) buckets |
//! | `kvroute/workers`       | how many workers claimed an in-flight key, u32 LE | only when the generation changes |
//! | `kvroute/inflight/{w}`  | worker `w`'s in-flight load ([`SlotLoad`]): its nonce (u64 LE), then per pod slot the requests routed and not finished (u32 LE), their prompt tokens still to prefill (u32 LE) and the streams open (u32 LE); written only by that worker | every other worker's, once |
//!
//! A block hash lives in bucket `hash & (buckets − 1)`, `buckets` a power of
//! two ≈ `maxIndexBlocks / 16`, so a bucket holds ~16 entries (~256 B) at a
//! full index and a request with k distinct match lengths copies about
//! k · log2(n) · 256 B. Holder sets are the tree's prefix-closed sets, so
//! [`match_by_bisection`] applies. An entry stays 16 bytes whatever the
//! pool's size: up to four holders inline (the 64-bit mask's 8 bytes), a
//! block held by more pods pointing into the bucket's tail (2 bytes per
//! holder). The publisher mirrors the buckets and re-encodes only the ones
//! touched since the last tick.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::index::holders::{CompactSet, Holder, HolderArena, INLINE};
use crate::index::{match_by_bisection, PrefixLookup, PrefixMatch};
use crate::scoring::feed::{Answer, SessionStart};

pub const POD_TABLE_KEY: &str = "kvroute/pods";
/// The pod table's numbers of every generation ([`PodTable::encode_state`]).
pub const POD_STATE_KEY: &str = "kvroute/podstate";
pub const GENERATION_KEY: &str = "kvroute/generation";
pub const WORKERS_KEY: &str = "kvroute/workers";
/// Shared queue carrying approximate-mode decisions from filters to the service.
pub const DECISION_QUEUE: &str = "kvroute/decisions";

const ENTRY_BYTES: usize = 16;
const COUNT_BYTES: usize = 4;

/// The first holder field of an entry whose holders are in the bucket's
/// tail: then the second is their count and the last two their offset (in
/// holders) into the tail, as a u32.
const OVERFLOW_ENTRY: u16 = 0xFFFE;
/// An unused inline holder field.
const EMPTY_FIELD: u16 = 0xFFFF;

/// The shared-data key of worker `worker`'s in-flight counts.
pub fn inflight_key(worker: u32) -> String {
    format!("kvroute/inflight/{worker}")
}

/// The shared-data key of bucket `bucket`.
pub fn bucket_key(bucket: u32) -> String {
    format!("kvroute/idx/{bucket:x}")
}

/// The bucket of `hash` among `buckets` (a power of two).
pub fn bucket_of(hash: u64, buckets: u32) -> u32 {
    (hash & u64::from(buckets.saturating_sub(1))) as u32
}

/// Encodes `(hash, holders)` entries ordered by hash: the entry count,
/// 16 bytes per entry (hash, then up to four holders, unused fields
/// 0xFFFF, or a reference into the tail), then the tail's holder lists.
pub fn encode_bucket<'a>(entries: impl ExactSizeIterator<Item = (u64, &'a [Holder])>) -> Vec<u8> {
    let count = entries.len();
    let mut bytes = Vec::with_capacity(COUNT_BYTES + count * ENTRY_BYTES);
    bytes.extend_from_slice(&u32::try_from(count).unwrap_or(u32::MAX).to_le_bytes());
    let mut tail: Vec<u16> = Vec::new();
    for (hash, holders) in entries {
        bytes.extend_from_slice(&hash.to_le_bytes());
        let fields: [u16; INLINE] = if holders.len() > INLINE {
            let offset = tail.len() as u32;
            tail.extend(holders.iter().map(|h| h.bits()));
            [
                OVERFLOW_ENTRY,
                holders.len() as u16,
                offset as u16,
                (offset >> 16) as u16,
            ]
        } else {
            let mut fields = [EMPTY_FIELD; INLINE];
            for (field, holder) in fields.iter_mut().zip(holders) {
                *field = holder.bits();
            }
            fields
        };
        for field in fields {
            bytes.extend_from_slice(&field.to_le_bytes());
        }
    }
    for holder in tail {
        bytes.extend_from_slice(&holder.to_le_bytes());
    }
    bytes
}

/// The holders of `hash` in an encoded bucket (binary search), ordered by
/// slot; `None` when the block is not there. Fields that are no holder
/// (a corrupt value) are left out.
pub fn bucket_lookup(bytes: &[u8], hash: u64) -> Option<Vec<Holder>> {
    let count = le_u32(bytes, 0)? as usize;
    let entry = |i: usize| COUNT_BYTES + i * ENTRY_BYTES;
    let (mut lo, mut hi) = (0, count);
    while lo < hi {
        let mid = (lo + hi) / 2;
        match le_u64(bytes, entry(mid))?.cmp(&hash) {
            std::cmp::Ordering::Less => lo = mid + 1,
            std::cmp::Ordering::Greater => hi = mid,
            std::cmp::Ordering::Equal => {
                let field = |k: usize| le_u16(bytes, entry(mid) + 8 + 2 * k);
                let mut holders: Vec<Holder> = if field(0)? == OVERFLOW_ENTRY {
                    let len = usize::from(field(1)?);
                    let offset = u32::from(field(2)?) | u32::from(field(3)?) << 16;
                    let start = entry(count).checked_add(2 * offset as usize)?;
                    let list = bytes.get(start..start.checked_add(2 * len)?)?;
                    list.chunks_exact(2)
                        .filter_map(|b| {
                            b.try_into()
                                .ok()
                                .map(u16::from_le_bytes)
                                .and_then(Holder::from_bits)
                        })
                        .collect()
                } else {
                    (0..INLINE)
                        .filter_map(|k| field(k).and_then(Holder::from_bits))
                        .collect()
                };
                // Ordered as the publisher writes them; a corrupt value
                // must not break the merges that rely on it.
                if !holders.is_sorted_by_key(|h| h.slot()) {
                    holders.sort_by_key(|h| h.slot());
                    holders.dedup_by_key(|h| h.slot());
                }
                return Some(holders);
            }
        }
    }
    None
}

/// The little-endian u64 at byte `at`, if the bytes are there.
fn le_u64(bytes: &[u8], at: usize) -> Option<u64> {
    let word = bytes.get(at..at.checked_add(8)?)?;
    Some(u64::from_le_bytes(word.try_into().ok()?))
}

fn le_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let word = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(word.try_into().ok()?))
}

fn le_u16(bytes: &[u8], at: usize) -> Option<u16> {
    let word = bytes.get(at..at.checked_add(2)?)?;
    Some(u16::from_le_bytes(word.try_into().ok()?))
}

/// The filter's view of the published index: bucket values fetched on demand
/// through `fetch` (a copy out of Envoy shared data under proxy-wasm, a
/// reference into the in-process snapshot in the native module, a map in
/// tests).
pub struct SnapshotIndex<F> {
    pub buckets: u32,
    pub fetch: F,
}

impl<F, B> PrefixLookup for SnapshotIndex<F>
where
    F: Fn(u32) -> Option<B>,
    B: std::ops::Deref,
    B::Target: AsRef<[u8]>,
{
    fn lookup(&self, chain: &[u64]) -> PrefixMatch {
        match_by_bisection(chain.len(), |i| {
            let Some(&hash) = chain.get(i) else {
                return Vec::new();
            };
            (self.fetch)(bucket_of(hash, self.buckets))
                .and_then(|bytes| bucket_lookup((*bytes).as_ref(), hash))
                .unwrap_or_default()
        })
    }
}

/// The service's mirror of all buckets, re-encoding only dirty ones.
#[derive(Debug, Clone)]
pub struct SnapshotPublisher {
    /// Per bucket, (hash, holders) ordered by hash.
    buckets: Vec<Vec<(u64, CompactSet)>>,
    arena: HolderArena,
    dirty: Vec<u32>,
    is_dirty: Vec<bool>,
}

impl SnapshotPublisher {
    /// `buckets` is rounded up to a power of two.
    pub fn new(buckets: u32) -> SnapshotPublisher {
        let buckets = buckets.max(1).next_power_of_two();
        SnapshotPublisher {
            buckets: vec![Vec::new(); buckets as usize],
            arena: HolderArena::default(),
            dirty: Vec::new(),
            is_dirty: vec![false; buckets as usize],
        }
    }

    pub fn bucket_count(&self) -> u32 {
        self.buckets.len() as u32
    }

    /// Brings the entries of `hashes` to what `holders_of(hash, out)` puts
    /// in `out` now (ordered by slot; empty: the block is gone).
    pub fn apply(&mut self, hashes: &[u64], mut holders_of: impl FnMut(u64, &mut Vec<Holder>)) {
        let count = self.bucket_count();
        let mut holders = Vec::new();
        for &hash in hashes {
            holders.clear();
            holders_of(hash, &mut holders);
            let b = bucket_of(hash, count);
            let (Some(bucket), Some(is_dirty)) = (
                self.buckets.get_mut(b as usize),
                self.is_dirty.get_mut(b as usize),
            ) else {
                continue; // bucket_of is always below the count
            };
            match bucket.binary_search_by_key(&hash, |e| e.0) {
                Ok(at) if holders.is_empty() => {
                    let (_, mut set) = bucket.remove(at);
                    set.clear(&mut self.arena);
                }
                Ok(at) => {
                    let Some(entry) = bucket.get_mut(at) else {
                        continue;
                    };
                    if entry.1.holders(&self.arena) == holders.as_slice() {
                        continue;
                    }
                    entry.1.assign(&mut self.arena, &holders);
                }
                Err(_) if holders.is_empty() => continue,
                Err(at) => {
                    let mut set = CompactSet::EMPTY;
                    set.assign(&mut self.arena, &holders);
                    bucket.insert(at, (hash, set));
                }
            }
            if !*is_dirty {
                *is_dirty = true;
                self.dirty.push(b);
            }
        }
    }

    /// Applies `tree`'s changes since it was last asked (a tree with a
    /// change log that alone makes the index).
    pub fn apply_tree(&mut self, tree: &mut crate::index::PrefixTree) {
        let changes = tree.take_changes();
        self.apply(&changes, |hash, out| {
            out.extend_from_slice(tree.holders(hash).unwrap_or_default())
        });
    }

    /// Encoded values of at most `max` buckets changed since they were
    /// last taken, oldest change first.
    pub fn take_dirty(&mut self, max: usize) -> Vec<(u32, Vec<u8>)> {
        let take = self.dirty.len().min(max);
        let taken: Vec<u32> = self.dirty.drain(..take).collect();
        let arena = &self.arena;
        taken
            .into_iter()
            .filter_map(|b| {
                *self.is_dirty.get_mut(b as usize)? = false;
                let bucket = self.buckets.get(b as usize)?;
                let entries = bucket.iter().map(|(hash, set)| (*hash, set.holders(arena)));
                Some((b, encode_bucket(entries)))
            })
            .collect()
    }

    /// Buckets changed and not yet taken.
    pub fn dirty_count(&self) -> usize {
        self.dirty.len()
    }

    /// Heap bytes of the mirror (≈ what Envoy holds for the buckets).
    pub fn memory_bytes(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<Vec<(u64, CompactSet)>>()
            + self
                .buckets
                .iter()
                .map(|b| b.capacity() * std::mem::size_of::<(u64, CompactSet)>())
                .sum::<usize>()
            + self.arena.memory_bytes()
            + self.is_dirty.capacity()
            + self.dirty.capacity() * 4
    }
}

/// One pod as the filter sees it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PublishedPod {
    /// Bit of this pod in the index masks and index into `kvroute/inflight`.
    pub slot: usize,
    pub id: String,
    pub address: String,
    pub queue: u32,
    pub load: f64,
    /// Reported health decayed by staleness.
    pub health: f64,
    /// Health as last reported, and when (ms since the Unix epoch): what a
    /// filter decays from when the snapshot itself is stale.
    pub reported_health: f64,
    pub last_report_ms: u64,
    pub adapters: Vec<String>,
    #[serde(default)]
    pub attributes: BTreeMap<String, f64>,
    /// The pod's in-flight count as the pull its queue came from read it
    /// (a report: when it arrived; a scrape of vLLM's metrics: when it
    /// went out): requests in flight beyond it are added to its queue.
    pub inflight_at_report: u32,
    /// What a placement there would evict ([`KvRoom`]).
    #[serde(default)]
    pub kv_room: KvRoom,
}

/// A pod's cache room, for pricing the evictions a placement causes
/// ([`crate::scoring::balance`]).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct KvRoom {
    /// Blocks free in its GPU cache (capacity less resident); `None`
    /// when its capacity is unknown.
    pub free_blocks: Option<u64>,
    /// The chance a block it evicts is prefilled again
    /// ([`crate::index::ghosts::EvictionGhosts::reuse_share`]).
    pub reuse_share: f64,
}

impl Default for KvRoom {
    fn default() -> KvRoom {
        KvRoom {
            free_blocks: None,
            reuse_share: 0.5,
        }
    }
}

/// Everything but the index buckets.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodTable {
    pub generation: u64,
    /// When the service published it (ms since the Unix epoch).
    pub published_at_ms: u64,
    pub buckets: u32,
    /// A digest of everything [`PodTable::encode_state`] leaves out (the
    /// pods, their slots, addresses, adapters and attributes, the bucket
    /// count): the JSON table is written only when it changes, and a
    /// state applies only to a table of the same digest.
    #[serde(default)]
    pub members_digest: u64,
    /// Ordered by slot (as the service publishes them).
    pub pods: Vec<PublishedPod>,
    /// Which pods have each adapter loaded, built on first use.
    #[serde(skip)]
    pub adapter_index: AdapterIndex,
}

impl PodTable {
    /// How many pod slots the table's pods span (the in-flight loads to
    /// read): pods are ordered by slot.
    pub fn slots(&self) -> usize {
        self.pods.last().map_or(0, |p| p.slot + 1)
    }

    pub fn encode(&self) -> Vec<u8> {
        // Plain data (strings, numbers, maps with string keys) always serialises.
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<PodTable, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("malformed pod table: {e}"))
    }

    /// What changes with every generation, in binary (a JSON table of
    /// 1,024 pods is 190 KB and 0.6 ms to decode natively, this 57 KB and
    /// a copy): generation, publication time, members digest (u64 LE
    /// each), then per pod in table order its queue and in-flight count at
    /// report (u32 LE), last report time (u64 LE), load, health and
    /// reported health (f64 LE), free KV blocks (u64 LE, `u64::MAX` for
    /// unknown) and reuse share (f64 LE).
    pub fn encode_state(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(STATE_HEADER_BYTES + self.pods.len() * POD_STATE_BYTES);
        for word in [self.generation, self.published_at_ms, self.members_digest] {
            bytes.extend_from_slice(&word.to_le_bytes());
        }
        for pod in &self.pods {
            bytes.extend_from_slice(&pod.queue.to_le_bytes());
            bytes.extend_from_slice(&pod.inflight_at_report.to_le_bytes());
            bytes.extend_from_slice(&pod.last_report_ms.to_le_bytes());
            for value in [pod.load, pod.health, pod.reported_health] {
                bytes.extend_from_slice(&value.to_le_bytes());
            }
            let free = pod.kv_room.free_blocks.unwrap_or(u64::MAX);
            bytes.extend_from_slice(&free.to_le_bytes());
            bytes.extend_from_slice(&pod.kv_room.reuse_share.to_le_bytes());
        }
        bytes
    }

    /// Brings the table to an encoded state of the same members
    /// generation; an error (table unchanged) when it is of another, or
    /// malformed.
    pub fn apply_state(&mut self, bytes: &[u8]) -> Result<(), String> {
        let members = state_members_digest(bytes).ok_or("pod state too short")?;
        if members != self.members_digest {
            return Err(format!(
                "pod state of members digest {members}, table of {}",
                self.members_digest
            ));
        }
        if bytes.len() != STATE_HEADER_BYTES + self.pods.len() * POD_STATE_BYTES {
            return Err(format!(
                "pod state of {} bytes for {} pods",
                bytes.len(),
                self.pods.len()
            ));
        }
        let word = |at: usize| le_u64(bytes, at).unwrap_or_default();
        let half = |at: usize| le_u32(bytes, at).unwrap_or_default();
        let float = |at: usize| f64::from_bits(word(at));
        self.generation = word(0);
        self.published_at_ms = word(8);
        for (i, pod) in self.pods.iter_mut().enumerate() {
            let at = STATE_HEADER_BYTES + i * POD_STATE_BYTES;
            pod.queue = half(at);
            pod.inflight_at_report = half(at + 4);
            pod.last_report_ms = word(at + 8);
            pod.load = float(at + 16);
            pod.health = float(at + 24);
            pod.reported_health = float(at + 32);
            pod.kv_room = KvRoom {
                free_blocks: Some(word(at + 40)).filter(|&free| free != u64::MAX),
                reuse_share: float(at + 48),
            };
        }
        Ok(())
    }

    /// The index in `pods` of the pod in `slot`: a binary search, as pods
    /// are ordered by slot (a table that is not falls back to a scan).
    pub fn index_of_slot(&self, slot: usize) -> Option<usize> {
        match self.pods.binary_search_by_key(&slot, |p| p.slot) {
            Ok(index) => Some(index),
            Err(_) => self.pods.iter().position(|p| p.slot == slot),
        }
    }

    /// Indexes in `pods` of the pods with `adapter` loaded.
    pub fn adapter_holders(&self, adapter: &str) -> &[u32] {
        self.adapter_index
            .0
            .get_or_init(|| {
                let mut index: HashMap<String, Vec<u32>> = HashMap::new();
                for (i, pod) in self.pods.iter().enumerate() {
                    for name in &pod.adapters {
                        index.entry(name.clone()).or_default().push(i as u32);
                    }
                }
                index
            })
            .get(adapter)
            .map_or(&[], Vec::as_slice)
    }
}

const STATE_HEADER_BYTES: usize = 24;
const POD_STATE_BYTES: usize = 56;

/// The members digest of the table an encoded pod state belongs to.
pub fn state_members_digest(bytes: &[u8]) -> Option<u64> {
    le_u64(bytes, 16)
}

/// [`PodTable::adapter_holders`]' index: derived from the table, so it is
/// neither compared nor cloned (a clone builds its own on first use).
#[derive(Debug, Default)]
pub struct AdapterIndex(std::sync::OnceLock<HashMap<String, Vec<u32>>>);

impl Clone for AdapterIndex {
    fn clone(&self) -> Self {
        AdapterIndex::default()
    }
}

impl PartialEq for AdapterIndex {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// One pod slot's in-flight load, as a worker publishes it and a reader
/// sums it over the workers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotLoad {
    /// Requests routed to the pod and not finished; in approximate mode,
    /// where no report counts a pod's queue, those not answered yet (no
    /// response byte): a pod streaming many answers is not a full one.
    pub requests: u32,
    /// Their prompt tokens the pod had not cached at the decision, counted
    /// until each request's first response byte: the prefill queued there.
    pub prefill_tokens: u32,
    /// The attention their prefill computes, counted as `prefill_tokens`
    /// is ([`crate::scoring::ttft::attention`]).
    pub prefill_attention: u32,
    /// Requests routed to the pod whose stream has not ended, in every
    /// mode: what the pod carries, answering or not (in precise mode the
    /// same as `requests`).
    pub streams: u32,
}

impl SlotLoad {
    /// Adds `other` (saturating).
    pub fn add(&mut self, other: SlotLoad) {
        self.requests = self.requests.saturating_add(other.requests);
        self.prefill_tokens = self.prefill_tokens.saturating_add(other.prefill_tokens);
        self.prefill_attention = self
            .prefill_attention
            .saturating_add(other.prefill_attention);
        self.streams = self.streams.saturating_add(other.streams);
    }

    /// Its fields as little-endian bytes, in declaration order: the form
    /// workers publish and replicas digest.
    pub fn to_le_bytes(&self) -> [u8; SLOT_LOAD_BYTES] {
        let mut bytes = [0; SLOT_LOAD_BYTES];
        for (chunk, field) in bytes.chunks_exact_mut(4).zip([
            self.requests,
            self.prefill_tokens,
            self.prefill_attention,
            self.streams,
        ]) {
            chunk.copy_from_slice(&field.to_le_bytes());
        }
        bytes
    }

    /// The inverse of [`SlotLoad::to_le_bytes`].
    pub fn from_le_bytes(bytes: [u8; SLOT_LOAD_BYTES]) -> SlotLoad {
        let mut words = bytes
            .chunks_exact(4)
            .map(|word| word.try_into().map_or(0, u32::from_le_bytes));
        let mut next = || words.next().unwrap_or_default();
        SlotLoad {
            requests: next(),
            prefill_tokens: next(),
            prefill_attention: next(),
            streams: next(),
        }
    }
}

const SLOT_LOAD_BYTES: usize = 16;

/// A change to one pod slot's in-flight load: what a request adds when it
/// is sent, and takes back at its first byte or its end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InflightChange {
    pub slot: usize,
    pub requests: i64,
    pub prefill_tokens: i64,
    pub prefill_attention: i64,
    pub streams: i64,
}

impl InflightChange {
    /// From `from` to `to` on `slot`.
    pub fn between(slot: usize, from: SlotLoad, to: SlotLoad) -> InflightChange {
        let delta = |from: u32, to: u32| i64::from(to) - i64::from(from);
        InflightChange {
            slot,
            requests: delta(from.requests, to.requests),
            prefill_tokens: delta(from.prefill_tokens, to.prefill_tokens),
            prefill_attention: delta(from.prefill_attention, to.prefill_attention),
            streams: delta(from.streams, to.streams),
        }
    }

    /// The streams it opens on its slot (requests sent there, failovers
    /// included): what [`InflightCount::opened`] counts.
    pub fn opened(&self) -> u32 {
        u32::try_from(self.streams).unwrap_or(0)
    }

    /// Whether it adds to the load (what other workers must see at once).
    pub fn grows(&self) -> bool {
        self.requests > 0
            || self.prefill_tokens > 0
            || self.prefill_attention > 0
            || self.streams > 0
    }

    /// Applied to `load`, clamped at 0 and `u32::MAX`.
    pub fn apply(&self, load: &mut SlotLoad) {
        load.requests = clamped_add(load.requests, self.requests);
        load.prefill_tokens = clamped_add(load.prefill_tokens, self.prefill_tokens);
        load.prefill_attention = clamped_add(load.prefill_attention, self.prefill_attention);
        load.streams = clamped_add(load.streams, self.streams);
    }
}

/// `value + delta` clamped at 0 and `u32::MAX`: a count every host keeps
/// the same way, so a release that outruns its add never wraps.
pub fn clamped_add(value: u32, delta: i64) -> u32 {
    (i64::from(value) + delta).clamp(0, i64::from(u32::MAX)) as u32
}

/// One worker's in-flight loads as published: the nonce of the worker
/// that wrote them (so a worker can tell its key was claimed twice), then
/// per slot its [`SlotLoad`] (12 bytes) and the streams it ever opened
/// there (4 bytes, wrapping; 0 past `opened`'s end), which the report
/// service reads as a report goes out ([`InflightCount`]).
pub fn encode_inflight(nonce: u64, loads: &[SlotLoad], opened: &[u32]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(8 + loads.len() * SLOT_RECORD_BYTES);
    bytes.extend_from_slice(&nonce.to_le_bytes());
    for (slot, load) in loads.iter().enumerate() {
        bytes.extend_from_slice(&load.to_le_bytes());
        let opened = opened.get(slot).copied().unwrap_or(0);
        bytes.extend_from_slice(&opened.to_le_bytes());
    }
    bytes
}

/// Bytes per slot of [`encode_inflight`].
const SLOT_RECORD_BYTES: usize = SLOT_LOAD_BYTES + 4;

fn slot_records(bytes: &[u8]) -> std::slice::ChunksExact<'_, u8> {
    bytes
        .get(8..)
        .unwrap_or_default()
        .chunks_exact(SLOT_RECORD_BYTES)
}

/// The nonce of an encoded worker value (`None`: too short).
pub fn inflight_nonce(bytes: &[u8]) -> Option<u64> {
    le_u64(bytes, 0)
}

/// Adds an encoded worker value's loads to `total` (grown as needed).
pub fn add_inflight(total: &mut Vec<SlotLoad>, bytes: &[u8]) {
    let records = slot_records(bytes);
    if total.len() < records.len() {
        total.resize(records.len(), SlotLoad::default());
    }
    for (sum, record) in total.iter_mut().zip(records) {
        let load: Option<[u8; SLOT_LOAD_BYTES]> = record
            .get(..SLOT_LOAD_BYTES)
            .and_then(|b| b.try_into().ok());
        if let Some(load) = load {
            sum.add(SlotLoad::from_le_bytes(load));
        }
    }
}

/// Adds an encoded worker value's count for `slot` to `count`.
pub fn add_inflight_count(count: &mut InflightCount, bytes: &[u8], slot: usize) {
    let Some(record) = slot_records(bytes).nth(slot) else {
        return;
    };
    let word = |at: usize| le_u32(record, at).unwrap_or(0);
    count.requests = count.requests.saturating_add(word(0));
    count.opened = count.opened.wrapping_add(word(SLOT_LOAD_BYTES));
}

/// What the report service reads of one pod slot's in-flight load, over
/// every worker of this gateway.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InflightCount {
    /// Requests in flight ([`SlotLoad::requests`]).
    pub requests: u32,
    /// Streams ever opened (requests routed there, failovers included), a
    /// wrapping count: the difference of two readings is what was sent in
    /// between.
    pub opened: u32,
}

/// One record of a worker's batch for the service.
#[derive(Debug, Clone, PartialEq)]
pub enum BatchRecord {
    /// A routing decision: pod slot, the request's chain, and its
    /// predicted TTFT there (when the pod is expected to have prefilled
    /// the chain, what a pending decision counts from).
    Decision {
        slot: usize,
        chain: Vec<u64>,
        predicted_ttft_ms: u32,
    },
    /// A streamed answer's first byte, for every TTFT model
    /// ([`crate::scoring::feed`]).
    Answer(Answer),
    /// A session start routed to pod `slot`, for every prefix-demand
    /// count ([`crate::scoring::feed`]).
    Start { slot: usize, start: SessionStart },
}

const DECISION_RECORD: u8 = 0;
const ANSWER_RECORD: u8 = 1;
const START_RECORD: u8 = 2;

/// Appends a routing decision to a batch for the shared queue (a worker
/// sends its decisions together: one wake-up of the service per batch, not
/// per request): kind 0 (u8), pod slot (u16 LE), predicted TTFT in whole
/// ms (u32 LE), chain length (u32 LE), then the chain's hashes (8 bytes LE
/// each).
pub fn push_decision(batch: &mut Vec<u8>, slot: usize, chain: &[u64], predicted_ttft_ms: f64) {
    batch.reserve(11 + chain.len() * 8);
    batch.push(DECISION_RECORD);
    batch.extend_from_slice(&u16::try_from(slot).unwrap_or(u16::MAX).to_le_bytes());
    // `as` saturates: NaN or a negative prediction is 0, and one past u32
    // ms (49 days) is no prediction anyway.
    batch.extend_from_slice(&(predicted_ttft_ms as u32).to_le_bytes());
    batch.extend_from_slice(&u32::try_from(chain.len()).unwrap_or(u32::MAX).to_le_bytes());
    for hash in chain {
        batch.extend_from_slice(&hash.to_le_bytes());
    }
}

/// Appends an answer's first byte to a batch: kind 1 (u8), then the
/// answer ([`Answer::encode_into`]).
pub fn push_answer(batch: &mut Vec<u8>, answer: &Answer) {
    batch.push(ANSWER_RECORD);
    answer.encode_into(batch);
}

/// Appends a session start routed to pod `slot` to a batch: kind 2 (u8),
/// the slot (u16 LE), then the start ([`SessionStart::encode_into`]).
pub fn push_start(batch: &mut Vec<u8>, slot: usize, start: &SessionStart) {
    batch.push(START_RECORD);
    batch.extend_from_slice(&u16::try_from(slot).unwrap_or(u16::MAX).to_le_bytes());
    start.encode_into(batch);
}

/// The records of a batch, `None` if it is malformed.
pub fn decode_batch(mut bytes: &[u8]) -> Option<Vec<BatchRecord>> {
    let mut records = Vec::new();
    while let Some((&kind, rest)) = bytes.split_first() {
        match kind {
            DECISION_RECORD => {
                let slot = le_u16(rest, 0)?;
                let predicted_ttft_ms = u32::from_le_bytes(rest.get(2..6)?.try_into().ok()?);
                let len: [u8; 4] = rest.get(6..10)?.try_into().ok()?;
                let len = usize::try_from(u32::from_le_bytes(len)).ok()?;
                let hashes = rest.get(10..10 + len.checked_mul(8)?)?;
                let chain = (0..len)
                    .map(|i| le_u64(hashes, i * 8))
                    .collect::<Option<_>>()?;
                records.push(BatchRecord::Decision {
                    slot: usize::from(slot),
                    chain,
                    predicted_ttft_ms,
                });
                bytes = rest.get(10 + hashes.len()..)?;
            }
            ANSWER_RECORD => {
                records.push(BatchRecord::Answer(Answer::decode(rest)?));
                bytes = rest.get(Answer::BYTES..)?;
            }
            START_RECORD => {
                records.push(BatchRecord::Start {
                    slot: usize::from(le_u16(rest, 0)?),
                    start: SessionStart::decode(rest.get(2..)?)?,
                });
                bytes = rest.get(2 + SessionStart::BYTES..)?;
            }
            _ => return None,
        }
    }
    Some(records)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{PrefixTree, TierBlocks};
    use crate::report::Tier;
    use std::collections::HashMap;

    /// A chain of `n` block hashes spread over the buckets.
    fn spread_chain(n: u64) -> Vec<u64> {
        (1..=n)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect()
    }

    #[test]
    fn published_snapshot_answers_like_the_tree() {
        let mut tree = PrefixTree::with_change_log(10_000);
        let chain = spread_chain(64);
        tree.insert_chain(0, None, &chain);
        tree.insert_chain(1, None, &chain[..40]);
        tree.insert_chain(2, None, &chain[..3]);
        let mut publisher = SnapshotPublisher::new(64);
        publisher.apply_tree(&mut tree);
        let store: HashMap<u32, Vec<u8>> = publisher.take_dirty(usize::MAX).into_iter().collect();
        let snapshot = SnapshotIndex {
            buckets: 64,
            fetch: |b| store.get(&b).cloned(),
        };
        assert_eq!(snapshot.lookup(&chain), tree.lookup(&chain));
        assert_eq!(snapshot.lookup(&chain).blocks(1), 40);
        assert!(
            publisher.take_dirty(usize::MAX).is_empty(),
            "nothing changed since"
        );
        tree.remove_blocks(1, &[chain[10]]);
        publisher.apply_tree(&mut tree);
        assert!(!publisher.take_dirty(usize::MAX).is_empty());
    }

    #[test]
    fn the_snapshot_knows_tiers_like_the_tree_in_the_same_sixteen_bytes() {
        let mut tree = PrefixTree::with_change_log(10_000);
        let chain = spread_chain(64);
        // 0: all on the GPU; 1: 40 blocks, the last 10 in CPU memory;
        // 2: 30 blocks, 10 GPU, 12 CPU, 8 disk; 3-7: the first 3 blocks
        // (a set past four holders, in the bucket's tail), 3 of them CPU.
        tree.insert_chain(0, None, &chain);
        tree.insert_chain(1, None, &chain[..30]);
        tree.insert_chain_in(1, Some(chain[29]), &chain[30..40], Tier::Cpu);
        tree.insert_chain(2, None, &chain[..10]);
        tree.insert_chain_in(2, Some(chain[9]), &chain[10..22], Tier::Cpu);
        tree.insert_chain_in(2, Some(chain[21]), &chain[22..30], Tier::Disk);
        for pod in 3..8 {
            let tier = if pod < 6 { Tier::Cpu } else { Tier::Gpu };
            tree.insert_chain_in(pod, None, &chain[..3], tier);
        }
        let mut publisher = SnapshotPublisher::new(64);
        publisher.apply_tree(&mut tree);
        let store: HashMap<u32, Vec<u8>> = publisher.take_dirty(usize::MAX).into_iter().collect();
        let entries: usize = store
            .values()
            .map(|b| u32::from_le_bytes(b[..4].try_into().unwrap()) as usize)
            .sum();
        let bytes: usize = store.values().map(Vec::len).sum();
        assert_eq!(bytes, 64 * 4 + entries * 16 + 3 * 2 * 8, "16 B an entry");
        let snapshot = SnapshotIndex {
            buckets: 64,
            fetch: |b| store.get(&b).cloned(),
        };
        let (published, exact) = (snapshot.lookup(&chain), tree.lookup(&chain));
        assert_eq!(published, exact);
        let tiers = |gpu, cpu, disk| TierBlocks { gpu, cpu, disk };
        assert_eq!(published.tiers(0), tiers(64, 0, 0));
        assert_eq!(published.tiers(1), tiers(30, 10, 0));
        assert_eq!(published.tiers(2), tiers(10, 12, 8));
        assert_eq!(published.tiers(3), tiers(0, 3, 0));
        assert_eq!(published.tiers(7), tiers(3, 0, 0));
        // A tier change republishes the block.
        tree.insert_chain(1, None, &chain[..40]);
        publisher.apply_tree(&mut tree);
        assert_eq!(publisher.take_dirty(usize::MAX).len(), 10);
    }

    #[test]
    fn an_index_without_tiers_costs_no_probe_more() {
        let mut tree = PrefixTree::with_change_log(10_000);
        let chain = spread_chain(256);
        tree.insert_chain(0, None, &chain[..200]);
        tree.insert_chain(1, None, &chain[..50]);
        let mut publisher = SnapshotPublisher::new(64);
        publisher.apply_tree(&mut tree);
        let store: HashMap<u32, Vec<u8>> = publisher.take_dirty(usize::MAX).into_iter().collect();
        let probes = |store: &HashMap<u32, Vec<u8>>| {
            let count = std::cell::Cell::new(0);
            let snapshot = SnapshotIndex {
                buckets: 64,
                fetch: |b| {
                    count.set(count.get() + 1);
                    store.get(&b).cloned()
                },
            };
            let m = snapshot.lookup(&chain);
            (m.tiers(0), m.tiers(1), count.get())
        };
        let (zero, one, gpu_probes) = probes(&store);
        assert_eq!((zero.gpu, one.gpu), (200, 50));
        assert!(gpu_probes <= 20, "{gpu_probes} probes");
        // The same index with pod 0's last 100 blocks in the CPU tier:
        // one more bisection, over blocks mostly probed already.
        tree.insert_chain_in(0, Some(chain[99]), &chain[100..200], Tier::Cpu);
        publisher.apply_tree(&mut tree);
        let mut store = store;
        store.extend(publisher.take_dirty(usize::MAX));
        let (zero, one, tiered_probes) = probes(&store);
        assert_eq!((zero.gpu, zero.cpu, one.gpu), (100, 100, 50));
        assert!(tiered_probes <= 2 * gpu_probes, "{tiered_probes} probes");
    }

    fn holders(slots: impl IntoIterator<Item = usize>) -> Vec<Holder> {
        slots.into_iter().filter_map(Holder::new).collect()
    }

    #[test]
    fn bucket_encoding_round_trips() {
        let many = holders(0..1024);
        let entries = [
            (3u64, holders([1])),
            (10, holders([0, 5, 1023])),
            (11, holders([2, 3, 4, 6])),
            (12, many.clone()),
            (13, holders([7, 8, 9, 10, 11])),
            (u64::MAX, holders([9])),
        ];
        let bytes = encode_bucket(entries.iter().map(|(h, s)| (*h, s.as_slice())));
        // 16 bytes an entry, 2 a holder past the fourth of a block.
        assert_eq!(bytes.len(), 4 + 6 * 16 + 2 * (1024 + 5));
        for (hash, set) in &entries {
            assert_eq!(bucket_lookup(&bytes, *hash).as_ref(), Some(set));
        }
        assert_eq!(bucket_lookup(&bytes, 4), None);
        assert_eq!(bucket_lookup(&[], 4), None);
        assert_eq!(bucket_lookup(&bytes[..40], 13), None, "cut short");
        let cut = &bytes[..bytes.len() - 2];
        assert_eq!(bucket_lookup(cut, 13), None, "tail cut short");
    }

    #[test]
    fn published_entries_stay_sixteen_bytes_until_a_block_has_five_holders() {
        let mut tree = PrefixTree::with_change_log(100);
        let mut publisher = SnapshotPublisher::new(1);
        for pod in [0, 700, 1023, 5] {
            tree.insert_chain(pod, None, &[42]);
        }
        publisher.apply_tree(&mut tree);
        let (_, bytes) = publisher.take_dirty(1).pop().unwrap();
        assert_eq!(bytes.len(), 4 + 16);
        tree.insert_chain(9, None, &[42]);
        publisher.apply_tree(&mut tree);
        let (_, bytes) = publisher.take_dirty(1).pop().unwrap();
        assert_eq!(bytes.len(), 4 + 16 + 2 * 5);
        let slots: Vec<usize> = bucket_lookup(&bytes, 42)
            .unwrap()
            .iter()
            .map(|h| h.slot())
            .collect();
        assert_eq!(slots, [0, 5, 9, 700, 1023]);
        tree.drop_pod(700);
        tree.drop_pod(9);
        publisher.apply_tree(&mut tree);
        let (_, bytes) = publisher.take_dirty(1).pop().unwrap();
        assert_eq!(bytes.len(), 4 + 16);
    }

    /// A published pod in `slot`, its numbers set, one adapter loaded.
    fn published(slot: usize) -> PublishedPod {
        PublishedPod {
            slot,
            id: format!("pod-{slot}"),
            address: format!("10.0.0.{slot}:8000"),
            queue: 3,
            load: 0.25,
            health: 0.9,
            reported_health: 1.0,
            last_report_ms: 1_700_000_000_000,
            adapters: vec!["lora".into()],
            attributes: BTreeMap::new(),
            inflight_at_report: 2,
            kv_room: KvRoom::default(),
        }
    }

    #[test]
    fn the_pod_state_carries_every_generation_s_numbers() {
        let old = PodTable {
            generation: 4,
            published_at_ms: 100,
            buckets: 64,
            members_digest: 2,
            pods: vec![published(0), published(5)],
            ..PodTable::default()
        };
        let mut new = old.clone();
        new.generation = 9;
        new.published_at_ms = 200;
        new.pods[1].queue = 17;
        new.pods[1].load = 0.123_456_789;
        new.pods[0].health = 0.1;
        new.pods[0].last_report_ms += 5;
        new.pods[0].kv_room = KvRoom {
            free_blocks: Some(12),
            reuse_share: 0.8,
        };
        let state = new.encode_state();
        assert_eq!(state.len(), 24 + 2 * 56);
        assert_eq!(state_members_digest(&state), Some(2));
        let mut decoded = PodTable::decode(&old.encode()).unwrap();
        decoded.apply_state(&state).unwrap();
        assert_eq!(decoded, new, "exact, f64s included");
        let mut other = new.clone();
        other.members_digest = 3;
        assert!(decoded.apply_state(&other.encode_state()).is_err());
        assert!(decoded.apply_state(&state[..state.len() - 1]).is_err());
        assert!(decoded.apply_state(&[]).is_err());
        assert_eq!(decoded, new, "unchanged by refused states");
        assert_eq!(decoded.adapter_holders("lora"), [0, 1]);
        assert_eq!(decoded.index_of_slot(5), Some(1));
        assert_eq!(decoded.index_of_slot(4), None);
    }

    #[test]
    fn the_pod_table_carries_its_f64s_exactly() {
        // Shares such as 0.5 / 5.5 are the shortest decimal that names
        // them; a best-effort parser reads some of them one unit in the
        // last place off (what `reports` fuzzing found).
        let mut table = PodTable::default();
        for (slot, evicted) in [4.5, 10.0, 255.75].into_iter().enumerate() {
            let share = 0.5 / (evicted + 1.0);
            table.pods.push(PublishedPod {
                load: share,
                kv_room: KvRoom {
                    free_blocks: None,
                    reuse_share: share,
                },
                ..published(slot)
            });
        }
        assert_eq!(PodTable::decode(&table.encode()), Ok(table));
    }

    #[test]
    fn inflight_and_decisions_round_trip() {
        let load = |requests, prefill_tokens, streams| SlotLoad {
            requests,
            prefill_tokens,
            prefill_attention: prefill_tokens / 2,
            streams,
        };
        let a = encode_inflight(
            11,
            &[load(1, 500, 4), load(0, 0, 0), load(7, u32::MAX, 9)],
            &[5, 0, u32::MAX],
        );
        let b = encode_inflight(12, &[load(2, 100, 2)], &[3]);
        let count = |slot| {
            let mut count = InflightCount::default();
            for bytes in [&a, &b] {
                add_inflight_count(&mut count, bytes, slot);
            }
            count
        };
        let expected = |requests, opened| InflightCount { requests, opened };
        assert_eq!(count(0), expected(3, 8));
        assert_eq!(
            count(2),
            expected(7, u32::MAX),
            "a slot past a value's end adds 0"
        );
        assert_eq!(count(9), expected(0, 0));
        let mut wrapped = expected(0, u32::MAX);
        add_inflight_count(&mut wrapped, &b, 0);
        assert_eq!(wrapped.opened, 2, "opened wraps");
        assert_eq!(
            (inflight_nonce(&a), inflight_nonce(&b)),
            (Some(11), Some(12))
        );
        assert_eq!(inflight_nonce(&[1, 2]), None);
        let mut total = vec![SlotLoad::default(); 5];
        add_inflight(&mut total, &a);
        add_inflight(&mut total, &b);
        assert_eq!(
            total,
            vec![
                load(3, 600, 6),
                load(0, 0, 0),
                load(7, u32::MAX, 9),
                load(0, 0, 0),
                load(0, 0, 0)
            ],
            "summed per slot, missing slots 0"
        );
        add_inflight(&mut total, &b);
        assert_eq!(total[0], load(5, 700, 8));
        let mut grown = Vec::new();
        add_inflight(&mut grown, &a);
        add_inflight(&mut grown, &[1, 2, 3]);
        assert_eq!(
            grown,
            vec![load(1, 500, 4), load(0, 0, 0), load(7, u32::MAX, 9)],
            "grown to the longest; a short value adds nothing"
        );
        let mut batch = Vec::new();
        push_decision(&mut batch, 3, &[1, 2], 8_500.7);
        push_decision(&mut batch, 0, &[], f64::NAN);
        let answer = Answer::new(7, crate::scoring::ttft::Work::new(1000, 500), 42.5);
        push_answer(&mut batch, &answer);
        push_decision(&mut batch, 1023, &[u64::MAX], 1e12);
        let start = |match_end| SessionStart {
            origin: 0xfeed,
            match_end,
        };
        push_start(&mut batch, 2, &start(Some(9)));
        push_start(&mut batch, 5, &start(None));
        let decision = |slot, chain: &[u64], predicted_ttft_ms| BatchRecord::Decision {
            slot,
            chain: chain.to_vec(),
            predicted_ttft_ms,
        };
        assert_eq!(
            decode_batch(&batch),
            Some(vec![
                decision(3, &[1, 2], 8_500),
                decision(0, &[], 0),
                BatchRecord::Answer(answer),
                decision(1023, &[u64::MAX], u32::MAX),
                BatchRecord::Start {
                    slot: 2,
                    start: start(Some(9))
                },
                BatchRecord::Start {
                    slot: 5,
                    start: start(None)
                },
            ])
        );
        assert_eq!(decode_batch(&[]), Some(vec![]));
        assert_eq!(decode_batch(&batch[..batch.len() - 1]), None, "torn");
        assert_eq!(
            decode_batch(&[0, 1, 0, 0, 0, 0, 0, 9, 0, 0, 0, 1]),
            None,
            "short chain"
        );
        assert_eq!(decode_batch(&[0, 1]), None, "half a slot");
        assert_eq!(decode_batch(&[1, 0, 0, 1]), None, "short answer");
        assert_eq!(decode_batch(&[2, 0, 0, 1]), None, "short start");
        assert_eq!(decode_batch(&[3]), None, "unknown kind");
    }
}
