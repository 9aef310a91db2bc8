//! The prefix index: which pods hold which chained blocks.
//!
//! Every structure here answers one question through [`PrefixLookup`]: for a
//! request's block chain `h[0..n)`, how many blocks from the start does each
//! pod hold consecutively? A block's holders are a sparse set of pod slots
//! ([`holders`]: most blocks live on one to a few of up to 1,024 pods), and
//! the answer, [`PrefixMatch`], lists only the pods that hold something.
//!
//! Two implementations:
//! - [`PrefixTree`] (the service's and each worker's own index): a tree with
//!   a parent link per node, global LRU eviction of leaves and per-pod
//!   subtree pruning. Lookup walks the chain once: O(n) hash probes.
//! - [`crate::snapshot::SnapshotIndex`] (the filter's view of the published
//!   index in Envoy shared data): holder sets per block hash, looked up by
//!   bisection ([`match_by_bisection`]) in O(k · log n) probes, k = number of
//!   distinct match lengths, because every probe copies a shared-data bucket.
//!
//! Both rely on the invariant the tree maintains: a pod holds a block only
//! if it holds the block's parent, so holder sets shrink along a chain.

pub mod holders;
mod recent;
mod recorder;
mod tree;

pub use holders::Holder;
pub use recent::RecentDecisions;
pub use recorder::DecisionRecorder;
pub use tree::{InsertOutcome, PrefixTree};

use crate::config::MAX_PODS;

/// Per pod slot, the number of leading blocks of a chain the pod holds:
/// only the pods holding at least one, ordered by slot.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrefixMatch {
    /// (slot, blocks > 0), ordered by slot.
    entries: Vec<(u16, u32)>,
}

impl PrefixMatch {
    /// From (slot, blocks) pairs in any order (a slot's largest count wins).
    fn from_unordered(mut entries: Vec<(u16, u32)>) -> PrefixMatch {
        entries.retain(|&(slot, blocks)| blocks > 0 && usize::from(slot) < MAX_PODS);
        entries.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        entries.dedup_by_key(|e| e.0);
        PrefixMatch { entries }
    }

    /// Matched blocks of pod slot `pod`.
    pub fn blocks(&self, pod: usize) -> u32 {
        let Ok(slot) = u16::try_from(pod) else {
            return 0;
        };
        self.entries
            .binary_search_by_key(&slot, |e| e.0)
            .ok()
            .and_then(|at| self.entries.get(at))
            .map_or(0, |e| e.1)
    }

    /// Raises `pod`'s match to at least `blocks`.
    pub fn raise(&mut self, pod: usize, blocks: u32) {
        if blocks == 0 || pod >= MAX_PODS {
            return;
        }
        let slot = pod as u16;
        match self.entries.binary_search_by_key(&slot, |e| e.0) {
            Ok(at) => {
                if let Some(entry) = self.entries.get_mut(at) {
                    entry.1 = entry.1.max(blocks);
                }
            }
            Err(at) => self.entries.insert(at, (slot, blocks)),
        }
    }

    /// Per pod, the larger of two matches (e.g. published index and a
    /// worker's own recent decisions).
    pub fn merge(&mut self, other: &PrefixMatch) {
        if other.entries.is_empty() {
            return;
        }
        let mut all = std::mem::take(&mut self.entries);
        all.extend_from_slice(&other.entries);
        *self = PrefixMatch::from_unordered(all);
    }

    /// (pod slot, matched blocks) of every pod holding at least one block,
    /// ordered by slot.
    pub fn iter(&self) -> impl Iterator<Item = (usize, u32)> + '_ {
        self.entries
            .iter()
            .map(|&(slot, blocks)| (usize::from(slot), blocks))
    }

    /// Pods holding at least one block.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The longest match of any pod.
    pub fn longest(&self) -> u32 {
        self.entries.iter().map(|e| e.1).max().unwrap_or(0)
    }
}

/// Collects (slot, blocks) pairs while a lookup runs.
#[derive(Default)]
struct MatchBuilder(Vec<(u16, u32)>);

impl MatchBuilder {
    /// Every pod of `pods` holds `blocks` leading blocks.
    fn set_all(&mut self, pods: &[Holder], blocks: u32) {
        if blocks > 0 {
            self.0
                .extend(pods.iter().map(|h| (h.slot() as u16, blocks)));
        }
    }

    fn finish(self) -> PrefixMatch {
        PrefixMatch::from_unordered(self.0)
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

/// Per-pod match lengths from `holders_at(i)`, the pods holding the
/// consecutive prefix `h[0..=i]` (ordered by slot), which must shrink (or
/// stay) as `i` grows. Each distinct match length costs O(log n) probes
/// instead of one probe per block; a probe whose set is as large as the
/// one it must lie within is taken as equal to it, so sets are compared
/// element by element only where a pod's match ends.
pub fn match_by_bisection(
    n: usize,
    mut holders_at: impl FnMut(usize) -> Vec<Holder>,
) -> PrefixMatch {
    let mut result = MatchBuilder::default();
    if n == 0 {
        return result.finish();
    }
    let first = holders_at(0);
    if first.is_empty() {
        return result.finish();
    }
    // Intersected like every probe, so non-monotone input (a torn read)
    // never credits a pod missing from the first block.
    let last = if n == 1 {
        first.clone()
    } else {
        holders::intersection(&holders_at(n - 1), &first)
    };
    result.set_all(&last, n as u32);
    if first.len() != last.len() {
        bisect((0, &first), (n - 1, &last), &mut holders_at, &mut result);
    }
    result.finish()
}

/// Pods in `lo`'s set (holding `h[..=lo]`) but not in `hi`'s (holding
/// `h[..=hi]`, a subset) end their match somewhere in `lo+1..=hi`.
fn bisect(
    (lo, set_lo): (usize, &[Holder]),
    (hi, set_hi): (usize, &[Holder]),
    holders_at: &mut impl FnMut(usize) -> Vec<Holder>,
    result: &mut MatchBuilder,
) {
    if set_lo.len() == set_hi.len() {
        return;
    }
    if hi == lo + 1 {
        result.set_all(&holders::difference(set_lo, set_hi), hi as u32);
        return;
    }
    let mid = lo + (hi - lo) / 2;
    // Intersect in case the published sets were not monotone (a torn read
    // of two buckets from different publishes), and keep `hi`'s pods in:
    // keeps the recursion sound.
    let set_mid = holders::union(&holders::intersection(&holders_at(mid), set_lo), set_hi);
    bisect((lo, set_lo), (mid, &set_mid), holders_at, result);
    bisect((mid, &set_mid), (hi, set_hi), holders_at, result);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The holders of a 64-bit mask (bit i = slot i), for compact tests.
    fn set(mask: u64) -> Vec<Holder> {
        (0..64)
            .filter(|i| mask >> i & 1 == 1)
            .filter_map(Holder::new)
            .collect()
    }

    fn linear(masks: &[u64]) -> PrefixMatch {
        let mut result = PrefixMatch::default();
        let mut running = !0u64;
        for (i, mask) in masks.iter().enumerate() {
            let next = running & mask;
            for holder in set(running & !next) {
                result.raise(holder.slot(), i as u32);
            }
            running = next;
        }
        for holder in set(running) {
            result.raise(holder.slot(), masks.len() as u32);
        }
        result
    }

    #[test]
    fn bisection_matches_linear_walk_on_monotone_masks() {
        let masks = [0b1111, 0b1111, 0b1011, 0b1011, 0b0011, 0b0001, 0b0001, 0];
        let mut probes = 0;
        let got = match_by_bisection(masks.len(), |i| {
            probes += 1;
            set(masks[i])
        });
        assert_eq!(got, linear(&masks));
        assert_eq!(got.blocks(0), 7);
        assert_eq!(got.blocks(1), 5);
        assert_eq!(got.blocks(3), 4);
        assert_eq!(got.blocks(2), 2);
        assert_eq!((got.len(), got.longest()), (4, 7));
        assert!(probes < masks.len() + 2);
    }

    #[test]
    fn bisection_probes_logarithmically_for_one_holder() {
        let masks: Vec<u64> = (0..256).map(|i| if i < 200 { 1 } else { 0 }).collect();
        let mut probes = 0;
        let got = match_by_bisection(256, |i| {
            probes += 1;
            set(masks[i])
        });
        assert_eq!(got.blocks(0), 200);
        assert!(probes <= 12, "{probes} probes");
    }

    #[test]
    fn a_match_lists_only_pods_that_hold_something() {
        let mut m = PrefixMatch::default();
        m.raise(1023, 5);
        m.raise(7, 0);
        m.raise(2, 3);
        m.raise(1023, 4);
        m.raise(MAX_PODS, 9);
        assert_eq!(m.iter().collect::<Vec<_>>(), [(2, 3), (1023, 5)]);
        let mut other = PrefixMatch::default();
        other.raise(2, 8);
        other.raise(500, 1);
        m.merge(&other);
        assert_eq!(m.iter().collect::<Vec<_>>(), [(2, 8), (500, 1), (1023, 5)]);
        assert_eq!((m.blocks(7), m.blocks(2), m.longest()), (0, 8, 8));
        assert_eq!(PrefixMatch::default(), {
            let mut zero = PrefixMatch::default();
            zero.raise(3, 0);
            zero
        });
    }
}
