//! The published snapshot: how the service hands the index and pod states
//! to every worker through Envoy shared data.
//!
//! Every `get_shared_data` copies the whole value, so nothing a request reads
//! is large:
//!
//! | key                     | value                                          | read per request |
//! |-------------------------|------------------------------------------------|------------------|
//! | `kvroute/pods`          | JSON [`PodTable`]: generation, bucket count, per pod id, address, queue, load, health, adapters, attributes | only when the generation changes |
//! | `kvroute/generation`    | the table's generation, 8 bytes LE             | once |
//! | `kvroute/idx/{b:x}`     | bucket `b`: sorted `(hash u64 LE, pod mask u64 LE)` pairs, 16 B each | O(k log n) buckets |
//! | `kvroute/workers`       | how many workers claimed an in-flight key, u32 LE | only when the generation changes |
//! | `kvroute/inflight/{w}`  | worker `w`'s in-flight load ([`SlotLoad`]): its nonce (u64 LE), then per pod slot the requests routed and not finished (u32 LE) and their prompt tokens still to prefill (u32 LE); written only by that worker | every other worker's, once |
//!
//! A block hash lives in bucket `hash & (buckets − 1)`, `buckets` a power of
//! two ≈ `maxIndexBlocks / 16`, so a bucket holds ~16 entries (~256 B) at a
//! full index and a request with k distinct match lengths copies about
//! k · log2(n) · 256 B. Masks are the tree's prefix-closed masks, so
//! [`match_by_bisection`] applies. The publisher mirrors the buckets and
//! re-encodes only the ones touched since the last tick.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::index::{match_by_bisection, PodMask, PrefixLookup, PrefixMatch};

pub const POD_TABLE_KEY: &str = "kvroute/pods";
pub const GENERATION_KEY: &str = "kvroute/generation";
pub const WORKERS_KEY: &str = "kvroute/workers";
/// Shared queue carrying approximate-mode decisions from filters to the service.
pub const DECISION_QUEUE: &str = "kvroute/decisions";

const ENTRY_BYTES: usize = 16;

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

/// Encodes sorted `(hash, mask)` entries.
pub fn encode_bucket(entries: &[(u64, PodMask)]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(entries.len() * ENTRY_BYTES);
    for (hash, mask) in entries {
        bytes.extend_from_slice(&hash.to_le_bytes());
        bytes.extend_from_slice(&mask.to_le_bytes());
    }
    bytes
}

/// The mask of `hash` in an encoded bucket (binary search).
pub fn bucket_lookup(bytes: &[u8], hash: u64) -> Option<PodMask> {
    let entries = bytes.len() / ENTRY_BYTES;
    let word = |i: usize, offset: usize| le_u64(bytes, i * ENTRY_BYTES + offset);
    let (mut lo, mut hi) = (0, entries);
    while lo < hi {
        let mid = (lo + hi) / 2;
        match word(mid, 0)?.cmp(&hash) {
            std::cmp::Ordering::Less => lo = mid + 1,
            std::cmp::Ordering::Greater => hi = mid,
            std::cmp::Ordering::Equal => return word(mid, 8),
        }
    }
    None
}

/// The little-endian u64 at byte `at`, if the bytes are there.
fn le_u64(bytes: &[u8], at: usize) -> Option<u64> {
    let word = bytes.get(at..at.checked_add(8)?)?;
    Some(u64::from_le_bytes(word.try_into().ok()?))
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
                return 0;
            };
            (self.fetch)(bucket_of(hash, self.buckets))
                .and_then(|bytes| bucket_lookup((*bytes).as_ref(), hash))
                .unwrap_or(0)
        })
    }
}

/// The service's mirror of all buckets, re-encoding only dirty ones.
#[derive(Debug, Clone)]
pub struct SnapshotPublisher {
    buckets: Vec<Vec<(u64, PodMask)>>,
    dirty: Vec<u32>,
    is_dirty: Vec<bool>,
}

impl SnapshotPublisher {
    /// `buckets` is rounded up to a power of two.
    pub fn new(buckets: u32) -> SnapshotPublisher {
        let buckets = buckets.max(1).next_power_of_two();
        SnapshotPublisher {
            buckets: vec![Vec::new(); buckets as usize],
            dirty: Vec::new(),
            is_dirty: vec![false; buckets as usize],
        }
    }

    pub fn bucket_count(&self) -> u32 {
        self.buckets.len() as u32
    }

    /// Applies index mask changes (mask 0 = block gone).
    pub fn apply(&mut self, changes: &[(u64, PodMask)]) {
        let count = self.bucket_count();
        for &(hash, mask) in changes {
            let b = bucket_of(hash, count);
            let (Some(bucket), Some(is_dirty)) = (
                self.buckets.get_mut(b as usize),
                self.is_dirty.get_mut(b as usize),
            ) else {
                continue; // bucket_of is always below the count
            };
            match bucket.binary_search_by_key(&hash, |e| e.0) {
                Ok(at) if mask == 0 => {
                    bucket.remove(at);
                }
                Ok(at) => {
                    if let Some(entry) = bucket.get_mut(at) {
                        entry.1 = mask;
                    }
                }
                Err(_) if mask == 0 => continue,
                Err(at) => bucket.insert(at, (hash, mask)),
            }
            if !*is_dirty {
                *is_dirty = true;
                self.dirty.push(b);
            }
        }
    }

    /// Encoded values of at most `max` buckets changed since they were
    /// last taken, oldest change first.
    pub fn take_dirty(&mut self, max: usize) -> Vec<(u32, Vec<u8>)> {
        let take = self.dirty.len().min(max);
        let taken: Vec<u32> = self.dirty.drain(..take).collect();
        taken
            .into_iter()
            .filter_map(|b| {
                *self.is_dirty.get_mut(b as usize)? = false;
                Some((b, encode_bucket(self.buckets.get(b as usize)?)))
            })
            .collect()
    }

    /// Buckets changed and not yet taken.
    pub fn dirty_count(&self) -> usize {
        self.dirty.len()
    }

    /// Heap bytes of the mirror (≈ what Envoy holds for the buckets).
    pub fn memory_bytes(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<Vec<(u64, PodMask)>>()
            + self
                .buckets
                .iter()
                .map(|b| b.capacity() * ENTRY_BYTES)
                .sum::<usize>()
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
    /// The pod's in-flight count when its last report arrived: requests
    /// routed since then are added to its queue.
    pub inflight_at_report: u32,
}

/// Everything but the index buckets.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodTable {
    pub generation: u64,
    /// When the service published it (ms since the Unix epoch).
    pub published_at_ms: u64,
    pub buckets: u32,
    pub pods: Vec<PublishedPod>,
}

impl PodTable {
    pub fn encode(&self) -> Vec<u8> {
        // Plain data (strings, numbers, maps with string keys) always serialises.
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<PodTable, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("malformed pod table: {e}"))
    }
}

/// One pod slot's in-flight load, as a worker publishes it and a reader
/// sums it over the workers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotLoad {
    /// Requests routed to the pod and not finished.
    pub requests: u32,
    /// Their prompt tokens the pod had not cached at the decision, counted
    /// until each request's first response byte: the prefill queued there.
    pub prefill_tokens: u32,
}

const SLOT_LOAD_BYTES: usize = 8;

/// One worker's in-flight loads as published: the nonce of the worker
/// that wrote them (so a worker can tell its key was claimed twice), then
/// each slot's [`SlotLoad`], 8 bytes.
pub fn encode_inflight(nonce: u64, loads: &[SlotLoad]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(8 + loads.len() * SLOT_LOAD_BYTES);
    bytes.extend_from_slice(&nonce.to_le_bytes());
    for load in loads {
        bytes.extend_from_slice(&load.requests.to_le_bytes());
        bytes.extend_from_slice(&load.prefill_tokens.to_le_bytes());
    }
    bytes
}

/// The nonce of an encoded worker value (`None`: too short).
pub fn inflight_nonce(bytes: &[u8]) -> Option<u64> {
    le_u64(bytes, 0)
}

/// Adds an encoded worker value's loads to `total` (grown as needed).
pub fn add_inflight(total: &mut Vec<SlotLoad>, bytes: &[u8]) {
    let loads = bytes
        .get(8..)
        .unwrap_or_default()
        .chunks_exact(SLOT_LOAD_BYTES);
    if total.len() < loads.len() {
        total.resize(loads.len(), SlotLoad::default());
    }
    let word = |bytes: &[u8]| bytes.iter().rev().fold(0, |w, &b| w << 8 | u32::from(b));
    for (sum, load) in total.iter_mut().zip(loads) {
        let (requests, prefill) = load.split_at(4);
        sum.requests = sum.requests.saturating_add(word(requests));
        sum.prefill_tokens = sum.prefill_tokens.saturating_add(word(prefill));
    }
}

/// Appends a routing decision to a batch for the shared queue (a worker
/// sends its decisions together: one wake-up of the service per batch, not
/// per request): pod slot (1 byte), chain length (u32 LE), then the
/// chain's hashes (8 bytes LE each).
pub fn push_decision(batch: &mut Vec<u8>, slot: usize, chain: &[u64]) {
    batch.reserve(5 + chain.len() * 8);
    batch.push(slot as u8);
    batch.extend_from_slice(&u32::try_from(chain.len()).unwrap_or(u32::MAX).to_le_bytes());
    for hash in chain {
        batch.extend_from_slice(&hash.to_le_bytes());
    }
}

/// The decisions of a batch, `None` if it is malformed.
pub fn decode_decisions(mut bytes: &[u8]) -> Option<Vec<(usize, Vec<u64>)>> {
    let mut decisions = Vec::new();
    while let Some((&slot, rest)) = bytes.split_first() {
        let len: [u8; 4] = rest.get(..4)?.try_into().ok()?;
        let len = usize::try_from(u32::from_le_bytes(len)).ok()?;
        let hashes = rest.get(4..4 + len.checked_mul(8)?)?;
        let chain = (0..len)
            .map(|i| le_u64(hashes, i * 8))
            .collect::<Option<_>>()?;
        decisions.push((usize::from(slot), chain));
        bytes = rest.get(4 + hashes.len()..)?;
    }
    Some(decisions)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::PrefixTree;
    use std::collections::HashMap;

    #[test]
    fn published_snapshot_answers_like_the_tree() {
        let mut tree = PrefixTree::with_change_log(10_000);
        let chain: Vec<u64> = (1..=64u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        tree.insert_chain(0, None, &chain);
        tree.insert_chain(1, None, &chain[..40]);
        tree.insert_chain(2, None, &chain[..3]);
        let mut publisher = SnapshotPublisher::new(64);
        publisher.apply(&tree.take_changes());
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
        publisher.apply(&tree.take_changes());
        assert!(!publisher.take_dirty(usize::MAX).is_empty());
    }

    #[test]
    fn bucket_encoding_round_trips() {
        let entries = [(3u64, 1u64), (10, 6), (u64::MAX, 9)];
        let bytes = encode_bucket(&entries);
        assert_eq!(bytes.len(), 48);
        for (hash, mask) in entries {
            assert_eq!(bucket_lookup(&bytes, hash), Some(mask));
        }
        assert_eq!(bucket_lookup(&bytes, 4), None);
        assert_eq!(bucket_lookup(&[], 4), None);
    }

    #[test]
    fn inflight_and_decisions_round_trip() {
        let load = |requests, prefill_tokens| SlotLoad {
            requests,
            prefill_tokens,
        };
        let a = encode_inflight(11, &[load(1, 500), load(0, 0), load(7, u32::MAX)]);
        let b = encode_inflight(12, &[load(2, 100)]);
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
                load(3, 600),
                load(0, 0),
                load(7, u32::MAX),
                load(0, 0),
                load(0, 0)
            ],
            "summed per slot, missing slots 0"
        );
        add_inflight(&mut total, &b);
        assert_eq!(total[0], load(5, 700));
        let mut grown = Vec::new();
        add_inflight(&mut grown, &a);
        add_inflight(&mut grown, &[1, 2, 3]);
        assert_eq!(
            grown,
            vec![load(1, 500), load(0, 0), load(7, u32::MAX)],
            "grown to the longest; a short value adds nothing"
        );
        let mut batch = Vec::new();
        push_decision(&mut batch, 3, &[1, 2]);
        push_decision(&mut batch, 0, &[]);
        push_decision(&mut batch, 7, &[u64::MAX]);
        assert_eq!(
            decode_decisions(&batch),
            Some(vec![(3, vec![1, 2]), (0, vec![]), (7, vec![u64::MAX])])
        );
        assert_eq!(decode_decisions(&[]), Some(vec![]));
        assert_eq!(decode_decisions(&batch[..batch.len() - 1]), None, "torn");
        assert_eq!(decode_decisions(&[1, 9, 0, 0, 0, 1]), None, "short chain");
    }
}
