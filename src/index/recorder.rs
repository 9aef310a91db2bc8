//! [`DecisionRecorder`]: the approximate mode's index.
//!
//! Without pod reports the router assumes a pod caches what it was sent:
//! each decision (pod, chain) is inserted into a [`PrefixTree`], and each pod
//! keeps an LRU of its blocks bounded by `podCapacityBlocks` (its KV cache
//! size), evicting through [`PrefixTree::remove_blocks`]. Blocks are touched
//! leaf first, so a pod's shared prefixes (system prompts) are always more
//! recent than the conversations under them and are evicted last.
//!
//! The per-pod LRU is lazy: a map hash → last-use stamp plus a FIFO of
//! (hash, stamp); a FIFO entry whose stamp is stale is skipped. The FIFO is
//! compacted when it grows past twice the map. O(1) amortised per block.
//!
//! With an expiry ([`DecisionRecorder::with_expiry`], precise mode's
//! pending decisions) each decision also counts only until `ttl_ms` after
//! the pod is expected to have prefilled it (the decision's predicted
//! TTFT, [`DecisionRecorder::record_at`]): until then no report can show
//! the blocks, and forgetting them sends the next request of that prefix
//! elsewhere to prefill it again. Measured on the shared Mooncake trace
//! (`kvroute-replay`, 64 and 256 pods): long prompts queued behind others
//! reach their first byte 8–15 s after the decision, and a fixed 5 s from
//! the decision kept 92.7 / 92.5 % of the pooled bound where holding to
//! the predicted TTFT keeps 98.8 / 99.7 % (docs/design.md). A block's
//! deadline is the latest of the decisions touching it, so a system
//! prompt shared by many pending conversations stays.
//! [`DecisionRecorder::expire`] pops a min-heap of deadlines with one live
//! entry per block (a block touched since its entry was pushed is pushed
//! again with its new deadline): O(log blocks) per expired block.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use hashbrown::HashMap;

use super::{PrefixLookup, PrefixMatch, PrefixTree};
use crate::config::MAX_PODS;

#[derive(Debug, Clone, Default)]
struct PodLru {
    stamps: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
}

impl PodLru {
    fn touch(&mut self, hash: u64, stamp: u64) {
        self.stamps.insert(hash, stamp);
        self.order.push_back((hash, stamp));
        if self.order.len() > 2 * self.stamps.len() + 64 {
            let stamps = &self.stamps;
            self.order.retain(|(h, s)| stamps.get(h) == Some(s));
        }
    }

    fn pop_oldest(&mut self) -> Option<u64> {
        while let Some((hash, touched)) = self.order.pop_front() {
            if self.stamps.get(&hash) == Some(&touched) {
                self.stamps.remove(&hash);
                return Some(hash);
            }
        }
        None
    }
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct DecisionRecorder {
    tree: PrefixTree,
    /// Per pod slot, grown to the highest slot recorded.
    pods: Vec<PodLru>,
    pod_capacity: usize,
    clock: u64,
    expiry: Option<Expiry>,
}

/// Pending decisions' deadlines: per pod slot, each block's (the latest of
/// the decisions touching it), and a min-heap of (deadline, slot, block)
/// holding at least one entry per live block; entries of forgotten blocks
/// are skipped when due, and dropped when they outnumber the live ones.
#[derive(Debug, Clone)]
struct Expiry {
    ttl_ms: u64,
    deadlines: Vec<HashMap<u64, u64>>,
    live: usize,
    queue: BinaryHeap<Reverse<(u64, usize, u64)>>,
}

impl Expiry {
    fn extend(&mut self, pod: usize, hash: u64, until_ms: u64) {
        if self.deadlines.len() <= pod {
            self.deadlines.resize_with(pod + 1, HashMap::new);
        }
        let Some(deadlines) = self.deadlines.get_mut(pod) else {
            return;
        };
        match deadlines.get_mut(&hash) {
            // Its queue entry is due earlier and pushes it again then.
            Some(deadline) => *deadline = (*deadline).max(until_ms),
            None => {
                deadlines.insert(hash, until_ms);
                self.live += 1;
                self.queue.push(Reverse((until_ms, pod, hash)));
                if self.queue.len() > 2 * self.live + 64 {
                    let deadlines = &self.deadlines;
                    self.queue.retain(|Reverse((due, pod, hash))| {
                        deadlines.get(*pod).and_then(|d| d.get(hash)) >= Some(due)
                    });
                }
            }
        }
    }

    fn forget(&mut self, pod: usize, hash: u64) {
        if let Some(deadlines) = self.deadlines.get_mut(pod) {
            if deadlines.remove(&hash).is_some() {
                self.live -= 1;
            }
        }
    }

    fn forget_pod(&mut self, pod: usize) {
        if let Some(deadlines) = self.deadlines.get_mut(pod) {
            self.live -= deadlines.len();
            *deadlines = HashMap::new();
        }
    }
}

impl DecisionRecorder {
    pub fn new(tree: PrefixTree, pod_capacity: usize) -> DecisionRecorder {
        DecisionRecorder {
            tree,
            pods: Vec::new(),
            pod_capacity: pod_capacity.max(1),
            clock: 0,
            expiry: None,
        }
    }

    /// A recorder whose decisions count until `ttl_ms` after the pod is
    /// expected to have prefilled them ([`DecisionRecorder::record_at`],
    /// [`DecisionRecorder::expire`]).
    pub fn with_expiry(tree: PrefixTree, pod_capacity: usize, ttl_ms: u64) -> DecisionRecorder {
        DecisionRecorder {
            expiry: Some(Expiry {
                ttl_ms,
                deadlines: Vec::new(),
                live: 0,
                queue: BinaryHeap::new(),
            }),
            ..DecisionRecorder::new(tree, pod_capacity)
        }
    }

    /// Records a decision made at `now_ms` whose prompt the pod is expected
    /// to have prefilled `prefill_ms` later: it counts until `ttl_ms` after
    /// that.
    pub fn record_at(&mut self, pod: usize, chain: &[u64], now_ms: u64, prefill_ms: u64) {
        let stored = self.record(pod, chain);
        if let Some(expiry) = &mut self.expiry {
            let until = now_ms
                .saturating_add(prefill_ms)
                .saturating_add(expiry.ttl_ms);
            for &hash in chain.get(..stored).unwrap_or_default() {
                expiry.extend(pod, hash, until);
            }
        }
    }

    /// Drops what only decisions that expired by `now_ms` kept.
    pub fn expire(&mut self, now_ms: u64) {
        let Some(expiry) = &mut self.expiry else {
            return;
        };
        while let Some(&Reverse((due, pod, hash))) = expiry.queue.peek() {
            if due > now_ms {
                break;
            }
            expiry.queue.pop();
            let Some(&deadline) = expiry.deadlines.get(pod).and_then(|d| d.get(&hash)) else {
                continue; // evicted for capacity since
            };
            if deadline > now_ms {
                expiry.queue.push(Reverse((deadline, pod, hash)));
                continue;
            }
            expiry.forget(pod, hash);
            if let Some(lru) = self.pods.get_mut(pod) {
                lru.stamps.remove(&hash);
            }
            self.tree.remove_blocks(pod, &[hash]);
        }
    }

    /// Records that `pod` was sent a request whose prompt is `chain`;
    /// returns how many of its blocks are stored.
    pub fn record(&mut self, pod: usize, chain: &[u64]) -> usize {
        self.record_evicting(pod, chain, &mut Vec::new())
    }

    /// [`DecisionRecorder::record`], adding to `evicted` the blocks it
    /// dropped from the pod for its capacity.
    pub fn record_evicting(&mut self, pod: usize, chain: &[u64], evicted: &mut Vec<u64>) -> usize {
        if pod >= MAX_PODS {
            return 0;
        }
        if self.pods.len() <= pod {
            self.pods.resize_with(pod + 1, PodLru::default);
        }
        let Some(lru) = self.pods.get_mut(pod) else {
            return 0;
        };
        let stored = self.tree.insert_chain(pod, None, chain).stored;
        for &hash in chain.get(..stored).unwrap_or_default().iter().rev() {
            self.clock += 1;
            lru.touch(hash, self.clock);
        }
        while lru.stamps.len() > self.pod_capacity {
            match lru.pop_oldest() {
                Some(hash) => {
                    self.tree.remove_blocks(pod, &[hash]);
                    evicted.push(hash);
                    if let Some(expiry) = &mut self.expiry {
                        expiry.forget(pod, hash);
                    }
                }
                None => break,
            }
        }
        stored
    }

    /// Forgets a pod (it left the pod list).
    pub fn drop_pod(&mut self, pod: usize) {
        self.tree.drop_pod(pod);
        if let Some(lru) = self.pods.get_mut(pod) {
            *lru = PodLru::default();
        }
        if let Some(expiry) = &mut self.expiry {
            expiry.forget_pod(pod);
        }
    }

    /// Forgets which of `pod`'s blocks were used when, leaving the tree
    /// alone: its blocks now come from elsewhere (reports), and an eviction
    /// here must not remove them.
    pub fn forget_recency(&mut self, pod: usize) {
        if let Some(lru) = self.pods.get_mut(pod) {
            *lru = PodLru::default();
        }
    }

    pub fn tree(&self) -> &PrefixTree {
        &self.tree
    }

    pub fn tree_mut(&mut self) -> &mut PrefixTree {
        &mut self.tree
    }
}

impl PrefixLookup for DecisionRecorder {
    fn lookup(&self, chain: &[u64]) -> PrefixMatch {
        self.tree.lookup(chain)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_pod_capacity_evicts_old_conversations_not_the_shared_prefix() {
        let mut recorder = DecisionRecorder::new(PrefixTree::new(1000), 4);
        recorder.record(0, &[1, 2, 10]);
        recorder.record(0, &[1, 2, 20]);
        recorder.record(0, &[1, 2, 30]); // 5 blocks > 4: conversation 10 goes
        assert_eq!(recorder.lookup(&[1, 2, 10]).blocks(0), 2);
        assert_eq!(recorder.lookup(&[1, 2, 30]).blocks(0), 3);
        assert_eq!(recorder.tree().pod_block_count(0), 4);
    }

    #[test]
    fn decisions_expire_unless_touched_again() {
        let mut recorder = DecisionRecorder::with_expiry(PrefixTree::new(1000), 100, 1000);
        recorder.record_at(0, &[1, 2, 10], 0, 0);
        recorder.record_at(0, &[1, 2, 20], 600, 0);
        recorder.record_at(1, &[1, 2], 700, 0);
        recorder.expire(999);
        assert_eq!(recorder.lookup(&[1, 2, 10]).blocks(0), 3, "not expired yet");
        recorder.expire(1000);
        // The first conversation is gone; the shared prefix lives on in the
        // second, pod 1's decision is untouched.
        assert_eq!(recorder.lookup(&[1, 2, 10]).blocks(0), 2);
        assert_eq!(recorder.lookup(&[1, 2, 20]).blocks(0), 3);
        assert_eq!(recorder.lookup(&[1, 2]).blocks(1), 2);
        recorder.expire(1700);
        assert_eq!(recorder.tree().pod_block_count(0), 0);
        assert_eq!(recorder.tree().pod_block_count(1), 0);
        assert!(recorder.tree().is_empty());
    }

    #[test]
    fn a_decision_counts_until_its_prompt_is_expected_prefilled_plus_the_ttl() {
        let mut recorder = DecisionRecorder::with_expiry(PrefixTree::new(1000), 100, 1000);
        // Queued for 9 s: held to 10 s, past the 1 s and 1.5 s of the
        // later, quicker decisions on the same prefix.
        recorder.record_at(0, &[1, 2, 10], 0, 9000);
        recorder.record_at(0, &[1, 2, 20], 500, 0);
        recorder.record_at(1, &[1, 2], 500, 0);
        recorder.expire(1500);
        assert_eq!(
            recorder.lookup(&[1, 2, 20]).blocks(0),
            2,
            "its own block expired"
        );
        assert_eq!(recorder.lookup(&[1, 2]).blocks(1), 0);
        assert_eq!(recorder.lookup(&[1, 2, 10]).blocks(0), 3, "still queued");
        recorder.expire(9999);
        assert_eq!(recorder.lookup(&[1, 2, 10]).blocks(0), 3);
        recorder.expire(10_000);
        assert!(recorder.tree().is_empty());
    }

    #[test]
    fn expired_and_evicted_blocks_leave_no_deadlines_behind() {
        let mut recorder = DecisionRecorder::with_expiry(PrefixTree::new(100_000), 4, 1000);
        for i in 0..10_000u64 {
            recorder.record_at((i % 3) as usize, &[i, i + 1_000_000], i, i % 7 * 100);
            recorder.expire(i);
        }
        let expiry = recorder.expiry.as_ref().expect("with expiry");
        assert!(expiry.live <= 3 * 4);
        assert!(expiry.queue.len() <= 2 * expiry.live + 64);
        recorder.expire(u64::MAX);
        let expiry = recorder.expiry.as_ref().expect("with expiry");
        assert_eq!((expiry.live, expiry.queue.len()), (0, 0));
        assert!(recorder.tree().is_empty());
    }

    #[test]
    fn pods_are_bounded_independently() {
        let mut recorder = DecisionRecorder::new(PrefixTree::new(1000), 2);
        recorder.record(0, &[1, 2]);
        recorder.record(1, &[1, 2]);
        recorder.record(1, &[3, 4]);
        assert_eq!(recorder.lookup(&[1, 2]).blocks(0), 2);
        assert_eq!(recorder.lookup(&[1, 2]).blocks(1), 0);
        assert_eq!(recorder.lookup(&[3, 4]).blocks(1), 2);
    }
}
