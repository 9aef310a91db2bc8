//! [`EvictionGhosts`]: which of a pod's evictions it later regrets.
//!
//! A pod evicts to make room, and an eviction costs nothing unless the
//! block is needed again: then the pod prefills it a second time. How
//! often that happens, per pod, is what pricing a placement's evictions
//! needs (issue 50), and what the dashboard shows beside the evictions
//! themselves. So, as ARC's ghost lists do, the blocks a pod's reports
//! remove are remembered for a while by hash alone, and a block the pod's
//! reports store again while remembered counts as a *regretted* eviction:
//! `epp_pod_kv_evictions_regretted_total` over
//! `epp_pod_kv_removed_blocks_total` is the share of its evictions the pod
//! paid for with a second prefill. Read from the reports alone, it counts
//! what the pod did, whoever sent the request, and no race with the
//! decision that sent it.
//!
//! Memory is bounded by sampling, as SHARDS samples a cache's reuse
//! (Waldspurger et al., FAST '15): only blocks whose hash is 0 modulo
//! [`SAMPLE_ONE_IN`] are remembered (chained xxHash64 values are uniform),
//! [`REMEMBERED`] of them over all pods, the oldest forgotten first, and
//! each counted one stands for [`SAMPLE_ONE_IN`] blocks. That covers the
//! last ~500 k evictions of the pool in ~2.5 MB. A block a pod evicts
//! again replaces its earlier entry. O(1) per reported block.
//!
//! **The reuse share** ([`EvictionGhosts::reuse_share`]) is what pricing
//! a placement reads (`scoring::balance`): of a pod's recent sampled
//! evictions, the share it stored again, `(regretted + ½) / (evicted + 1)`
//! (even odds before its first eviction). Both counts halve each time the
//! evictions reach [`REUSE_WINDOW`] samples, so the share follows the pod's
//! last ~1,000–2,000 evicted blocks: 128–256 samples put a share's
//! standard error at 3–4.5 points, and a pod whose mix of sessions
//! changes is read within a few turnovers of a small cache. A regret is
//! counted when the block comes back, after its eviction, so the share
//! lags the pod's evictions by about one reuse interval.

use std::collections::VecDeque;

use hashbrown::HashMap;

/// One block in this many is remembered.
pub const SAMPLE_ONE_IN: u64 = 8;

/// Sampled evictions remembered over all pods.
pub const REMEMBERED: usize = 65_536;

/// A pod's reuse share covers about this many of its last sampled
/// evictions (see the module documentation).
pub const REUSE_WINDOW: f64 = 256.0;

/// See the module documentation.
#[derive(Debug, Clone, Default)]
pub struct EvictionGhosts {
    /// Sampled evicted block → (pod slot, eviction stamp).
    evicted: HashMap<u64, (usize, u64)>,
    /// (block, stamp), oldest first; an entry whose stamp is not the
    /// block's in `evicted` is stale and skipped.
    order: VecDeque<(u64, u64)>,
    stamp: u64,
    /// Regretted evictions per pod slot not yet taken, in blocks.
    regretted: HashMap<usize, u64>,
    /// Per pod slot, its recent evictions and regrets, in samples.
    reuse: HashMap<usize, Reuse>,
}

/// Decayed sample counts behind [`EvictionGhosts::reuse_share`].
#[derive(Debug, Clone, Copy, Default)]
struct Reuse {
    evicted: f64,
    regretted: f64,
}

fn sampled(hash: u64) -> bool {
    hash.is_multiple_of(SAMPLE_ONE_IN)
}

impl EvictionGhosts {
    /// Pod `slot`'s report removed `hashes`.
    pub fn evicted(&mut self, slot: usize, hashes: &[u64]) {
        for &hash in hashes.iter().filter(|&&h| sampled(h)) {
            self.stamp += 1;
            self.evicted.insert(hash, (slot, self.stamp));
            self.order.push_back((hash, self.stamp));
            let reuse = self.reuse.entry(slot).or_default();
            reuse.evicted += 1.0;
            if reuse.evicted >= REUSE_WINDOW {
                reuse.evicted /= 2.0;
                reuse.regretted /= 2.0;
            }
        }
        while self.evicted.len() > REMEMBERED {
            let Some((hash, stamp)) = self.order.pop_front() else {
                break;
            };
            if self.evicted.get(&hash).is_some_and(|&(_, s)| s == stamp) {
                self.evicted.remove(&hash);
            }
        }
        if self.order.len() > 2 * self.evicted.len() + 64 {
            let evicted = &self.evicted;
            self.order
                .retain(|(hash, stamp)| evicted.get(hash).is_some_and(|&(_, s)| s == *stamp));
        }
    }

    /// Pod `slot`'s report stored `hashes` in GPU memory: each sampled one
    /// it evicted while remembered is an eviction regretted, counted once.
    pub fn stored(&mut self, slot: usize, hashes: &[u64]) {
        if self.evicted.is_empty() {
            return;
        }
        for &hash in hashes.iter().filter(|&&h| sampled(h)) {
            if self.evicted.get(&hash).is_some_and(|&(s, _)| s == slot) {
                self.evicted.remove(&hash);
                *self.regretted.entry(slot).or_default() += SAMPLE_ONE_IN;
                self.reuse.entry(slot).or_default().regretted += 1.0;
            }
        }
    }

    /// Pod `slot` left: its evictions are forgotten (a pod taking the slot
    /// later did not make them). O(remembered).
    pub fn forget_pod(&mut self, slot: usize) {
        self.evicted.retain(|_, &mut (s, _)| s != slot);
        self.regretted.remove(&slot);
        self.reuse.remove(&slot);
    }

    /// The share of pod `slot`'s recent evictions it stored again: the
    /// chance that a block it evicts next is prefilled again.
    pub fn reuse_share(&self, slot: usize) -> f64 {
        let reuse = self.reuse.get(&slot).copied().unwrap_or_default();
        ((reuse.regretted + 0.5) / (reuse.evicted + 1.0)).min(1.0)
    }

    /// The regretted evictions counted since the last call, by pod slot,
    /// in blocks.
    pub fn take_regretted(&mut self) -> Vec<(usize, u64)> {
        self.regretted.drain().collect()
    }

    /// Heap bytes held.
    pub fn memory_bytes(&self) -> usize {
        self.evicted.capacity() * (std::mem::size_of::<(u64, (usize, u64))>() + 1)
            + self.order.capacity() * std::mem::size_of::<(u64, u64)>()
            + self.regretted.capacity() * (std::mem::size_of::<(usize, u64)>() + 1)
            + self.reuse.capacity() * (std::mem::size_of::<(usize, Reuse)>() + 1)
    }

    /// Sampled evictions remembered.
    pub fn len(&self) -> usize {
        self.evicted.len()
    }

    pub fn is_empty(&self) -> bool {
        self.evicted.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_eviction_stored_again_by_its_pod_is_regretted_once() {
        let mut ghosts = EvictionGhosts::default();
        // Hashes 8, 16 and 24 are sampled; 9 is not.
        ghosts.evicted(0, &[8, 9, 16]);
        ghosts.evicted(1, &[24]);
        assert_eq!(ghosts.len(), 3);
        // Stored by another pod: no regret.
        ghosts.stored(1, &[8, 16]);
        assert!(ghosts.take_regretted().is_empty());
        // Stored again by pod 0, which evicted them: 16 sampled blocks' worth.
        ghosts.stored(0, &[8, 9, 16]);
        assert_eq!(ghosts.take_regretted(), vec![(0, 2 * SAMPLE_ONE_IN)]);
        ghosts.stored(0, &[8, 16]);
        assert!(ghosts.take_regretted().is_empty(), "counted once");
        // A pod that leaves takes its evictions along.
        ghosts.forget_pod(1);
        ghosts.stored(1, &[24]);
        assert!(ghosts.take_regretted().is_empty());
    }

    #[test]
    fn the_reuse_share_follows_a_pods_recent_evictions() {
        let mut ghosts = EvictionGhosts::default();
        assert_eq!(ghosts.reuse_share(0), 0.5, "even odds before any eviction");
        // Pod 0 stores again 3 of every 4 blocks it evicts, pod 1 none.
        let mut next = 0u64;
        for _ in 0..400 {
            let block: Vec<u64> = (0..4)
                .map(|_| {
                    next += SAMPLE_ONE_IN;
                    next
                })
                .collect();
            ghosts.evicted(0, &block);
            ghosts.stored(0, &block[..3]);
            ghosts.evicted(1, &[next + 1]);
        }
        assert!(
            (ghosts.reuse_share(0) - 0.75).abs() < 0.02,
            "{}",
            ghosts.reuse_share(0)
        );
        assert_eq!(ghosts.reuse_share(1), 0.5, "unsampled hashes count nothing");
        // Its mix changes: now nothing comes back, and the share follows
        // within a few windows.
        for _ in 0..(2.0 * REUSE_WINDOW) as usize {
            next += SAMPLE_ONE_IN;
            ghosts.evicted(0, &[next]);
        }
        assert!(ghosts.reuse_share(0) < 0.2, "{}", ghosts.reuse_share(0));
        ghosts.forget_pod(0);
        assert_eq!(ghosts.reuse_share(0), 0.5);
    }

    #[test]
    fn memory_is_bounded_and_the_oldest_go_first() {
        let mut ghosts = EvictionGhosts::default();
        let blocks: Vec<u64> = (1..=2 * REMEMBERED as u64)
            .map(|i| i * SAMPLE_ONE_IN)
            .collect();
        for chunk in blocks.chunks(1000) {
            ghosts.evicted(0, chunk);
        }
        assert_eq!(ghosts.len(), REMEMBERED);
        assert!(ghosts.order.len() <= 2 * REMEMBERED + 1000 + 64);
        ghosts.stored(0, &blocks[..1]);
        assert!(ghosts.take_regretted().is_empty(), "the oldest forgotten");
        ghosts.stored(0, &blocks[blocks.len() - 1..]);
        assert_eq!(ghosts.take_regretted(), vec![(0, SAMPLE_ONE_IN)]);
        // The same blocks evicted again replace their entries.
        for _ in 0..3 {
            ghosts.evicted(0, &blocks[blocks.len() - 10..]);
        }
        assert_eq!(ghosts.len(), REMEMBERED);
        assert!(ghosts.order.len() <= 2 * REMEMBERED + 1000 + 64);
    }
}
