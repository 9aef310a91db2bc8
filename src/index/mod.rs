//! The prefix index: which pods hold which chained blocks.
//!
//! Every structure here answers one question through [`PrefixLookup`]: for a
//! request's block chain `h[0..n)`, how many blocks from the start does each
//! pod hold consecutively? Pod sets are 64-bit masks (bit `i` = pod slot `i`).
//!
//! Two implementations:
//! - [`PrefixTree`] (the service's and each worker's own index): a tree with
//!   a parent link per node, global LRU eviction of leaves and per-pod
//!   subtree pruning. Lookup walks the chain once: O(n) hash probes.
//! - [`crate::snapshot::SnapshotIndex`] (the filter's view of the published
//!   index in Envoy shared data): masks per block hash, looked up by
//!   bisection ([`match_by_bisection`]) in O(k · log n) probes, k = number of
//!   distinct match lengths, because every probe copies a shared-data bucket.
//!
//! Both rely on the invariant the tree maintains: a pod is in a block's mask
//! only if it is in the parent's mask, so masks shrink along a chain.

mod recent;
mod recorder;
mod tree;

pub use recent::RecentDecisions;
pub use recorder::DecisionRecorder;
pub use tree::{InsertOutcome, PrefixTree};

use crate::config::MAX_PODS;

/// A set of pod slots.
pub type PodMask = u64;

/// The bit of pod slot `pod`.
pub fn pod_bit(pod: usize) -> PodMask {
    // A slot past MAX_PODS (only from corrupt input) holds nothing.
    u32::try_from(pod)
        .ok()
        .and_then(|pod| 1u64.checked_shl(pod))
        .unwrap_or(0)
}

/// Per pod slot, the number of leading blocks of a chain the pod holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixMatch {
    blocks: [u32; MAX_PODS],
}

impl Default for PrefixMatch {
    fn default() -> Self {
        PrefixMatch {
            blocks: [0; MAX_PODS],
        }
    }
}

impl PrefixMatch {
    /// Matched blocks of pod slot `pod`.
    pub fn blocks(&self, pod: usize) -> u32 {
        self.blocks.get(pod).copied().unwrap_or(0)
    }

    /// Raises `pod`'s match to at least `blocks`.
    pub fn raise(&mut self, pod: usize, blocks: u32) {
        if let Some(held) = self.blocks.get_mut(pod) {
            *held = (*held).max(blocks);
        }
    }

    /// Per pod, the larger of two matches (e.g. published index and a
    /// worker's own recent decisions).
    pub fn merge(&mut self, other: &PrefixMatch) {
        for (held, other) in self.blocks.iter_mut().zip(&other.blocks) {
            *held = (*held).max(*other);
        }
    }

    /// Sets every pod in `pods` to `blocks`.
    fn set_all(&mut self, pods: PodMask, blocks: u32) {
        let mut rest = pods;
        while rest != 0 {
            if let Some(held) = self.blocks.get_mut(rest.trailing_zeros() as usize) {
                *held = blocks;
            }
            rest &= rest - 1;
        }
    }
}

/// Something that knows per-pod consecutive prefix matches.
pub trait PrefixLookup {
    fn lookup(&self, chain: &[u64]) -> PrefixMatch;
}

/// Two views merged: per pod the longer match (the published index and a
/// worker's own recent decisions in approximate mode).
pub struct Merged<'a>(pub &'a dyn PrefixLookup, pub &'a dyn PrefixLookup);

impl PrefixLookup for Merged<'_> {
    fn lookup(&self, chain: &[u64]) -> PrefixMatch {
        let mut matched = self.0.lookup(chain);
        matched.merge(&self.1.lookup(chain));
        matched
    }
}

/// Per-pod match lengths from `mask_at(i)`, the set of pods holding the
/// consecutive prefix `h[0..=i]`, which must shrink (or stay) as `i` grows.
/// Each distinct match length costs O(log n) probes instead of one probe per
/// block.
pub fn match_by_bisection(n: usize, mut mask_at: impl FnMut(usize) -> PodMask) -> PrefixMatch {
    let mut result = PrefixMatch::default();
    if n == 0 {
        return result;
    }
    let first = mask_at(0);
    if first == 0 {
        return result;
    }
    // Intersected like every probe, so non-monotone input (a torn read)
    // never credits a pod missing from the first block.
    let last = if n == 1 {
        first
    } else {
        mask_at(n - 1) & first
    };
    result.set_all(last, n as u32);
    if first != last {
        bisect(0, first, n - 1, last, &mut mask_at, &mut result);
    }
    result
}

/// Pods in `mask_lo` (holding `h[..=lo]`) but not in `mask_hi` (holding
/// `h[..=hi]`) end their match somewhere in `lo+1..=hi`.
fn bisect(
    lo: usize,
    mask_lo: PodMask,
    hi: usize,
    mask_hi: PodMask,
    mask_at: &mut impl FnMut(usize) -> PodMask,
    result: &mut PrefixMatch,
) {
    if mask_lo == mask_hi {
        return;
    }
    if hi == lo + 1 {
        result.set_all(mask_lo & !mask_hi, hi as u32);
        return;
    }
    let mid = lo + (hi - lo) / 2;
    // Intersect in case the published masks were not monotone (a torn read
    // of two buckets from different publishes): keeps the recursion sound.
    let mask_mid = mask_at(mid) & mask_lo;
    bisect(lo, mask_lo, mid, mask_mid | mask_hi, mask_at, result);
    bisect(mid, mask_mid | mask_hi, hi, mask_hi, mask_at, result);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn linear(masks: &[PodMask]) -> PrefixMatch {
        let mut result = PrefixMatch::default();
        let mut running = !0u64;
        for (i, mask) in masks.iter().enumerate() {
            let next = running & mask;
            result.set_all(running & !next, i as u32);
            running = next;
        }
        result.set_all(running, masks.len() as u32);
        result
    }

    #[test]
    fn bisection_matches_linear_walk_on_monotone_masks() {
        let masks = [0b1111, 0b1111, 0b1011, 0b1011, 0b0011, 0b0001, 0b0001, 0];
        let mut probes = 0;
        let got = match_by_bisection(masks.len(), |i| {
            probes += 1;
            masks[i]
        });
        assert_eq!(got, linear(&masks));
        assert_eq!(got.blocks(0), 7);
        assert_eq!(got.blocks(1), 5);
        assert_eq!(got.blocks(3), 4);
        assert_eq!(got.blocks(2), 2);
        assert!(probes < masks.len() + 2);
    }

    #[test]
    fn bisection_probes_logarithmically_for_one_holder() {
        let masks: Vec<PodMask> = (0..256).map(|i| if i < 200 { 1 } else { 0 }).collect();
        let mut probes = 0;
        let got = match_by_bisection(256, |i| {
            probes += 1;
            masks[i]
        });
        assert_eq!(got.blocks(0), 200);
        assert!(probes <= 12, "{probes} probes");
    }
}
