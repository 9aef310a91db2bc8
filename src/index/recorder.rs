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
//! it was made: [`DecisionRecorder::expire`] drops, pod by pod, every block
//! not touched by a later decision. A block touched again lives on, so a
//! system prompt shared by many pending conversations stays.

use std::collections::VecDeque;

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
        self.pop_touched_until(u64::MAX)
    }

    /// The least recently used block, if last touched at or before `stamp`.
    fn pop_touched_until(&mut self, stamp: u64) -> Option<u64> {
        while let Some(&(hash, touched)) = self.order.front() {
            if touched > stamp {
                return None;
            }
            self.order.pop_front();
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
    /// With an expiry: its length, and per decision (expires at ms, clock
    /// after it), oldest first.
    ttl_ms: Option<u64>,
    deadlines: VecDeque<(u64, u64)>,
}

impl DecisionRecorder {
    pub fn new(tree: PrefixTree, pod_capacity: usize) -> DecisionRecorder {
        DecisionRecorder {
            tree,
            pods: Vec::new(),
            pod_capacity: pod_capacity.max(1),
            clock: 0,
            ttl_ms: None,
            deadlines: VecDeque::new(),
        }
    }

    /// A recorder whose decisions count for `ttl_ms` after they were made
    /// ([`DecisionRecorder::record_at`], [`DecisionRecorder::expire`]).
    pub fn with_expiry(tree: PrefixTree, pod_capacity: usize, ttl_ms: u64) -> DecisionRecorder {
        DecisionRecorder {
            ttl_ms: Some(ttl_ms),
            ..DecisionRecorder::new(tree, pod_capacity)
        }
    }

    /// Records a decision made at `now_ms`, to expire `ttl_ms` later.
    pub fn record_at(&mut self, pod: usize, chain: &[u64], now_ms: u64) {
        self.record(pod, chain);
        if let Some(ttl) = self.ttl_ms {
            self.deadlines
                .push_back((now_ms.saturating_add(ttl), self.clock));
        }
    }

    /// Drops what only decisions that expired by `now_ms` kept.
    pub fn expire(&mut self, now_ms: u64) {
        let mut cutoff = None;
        while let Some(&(expires, clock)) = self.deadlines.front() {
            if expires > now_ms {
                break;
            }
            cutoff = Some(clock);
            self.deadlines.pop_front();
        }
        let Some(cutoff) = cutoff else { return };
        for (pod, lru) in self.pods.iter_mut().enumerate() {
            while let Some(hash) = lru.pop_touched_until(cutoff) {
                self.tree.remove_blocks(pod, &[hash]);
            }
        }
    }

    /// Records that `pod` was sent a request whose prompt is `chain`.
    pub fn record(&mut self, pod: usize, chain: &[u64]) {
        if pod >= MAX_PODS {
            return;
        }
        if self.pods.len() <= pod {
            self.pods.resize_with(pod + 1, PodLru::default);
        }
        let Some(lru) = self.pods.get_mut(pod) else {
            return;
        };
        let stored = self.tree.insert_chain(pod, None, chain).stored;
        for &hash in chain.get(..stored).unwrap_or_default().iter().rev() {
            self.clock += 1;
            lru.touch(hash, self.clock);
        }
        while lru.stamps.len() > self.pod_capacity {
            match lru.pop_oldest() {
                Some(hash) => self.tree.remove_blocks(pod, &[hash]),
                None => break,
            }
        }
    }

    /// Forgets a pod (it left the pod list).
    pub fn drop_pod(&mut self, pod: usize) {
        self.tree.drop_pod(pod);
        if let Some(lru) = self.pods.get_mut(pod) {
            *lru = PodLru::default();
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
        recorder.record_at(0, &[1, 2, 10], 0);
        recorder.record_at(0, &[1, 2, 20], 600);
        recorder.record_at(1, &[1, 2], 700);
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
