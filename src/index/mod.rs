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

pub mod ghosts;
pub mod holders;
mod recent;
mod recorder;
mod tree;

pub use ghosts::EvictionGhosts;
pub use holders::Holder;
pub use recent::RecentDecisions;
pub use recorder::DecisionRecorder;
pub use tree::{InsertOutcome, PrefixTree};

use crate::config::MAX_PODS;
use crate::report::Tier;

/// One pod's matched blocks by the tier it holds them in (serialised as
/// `{"gpu": …, "cpu": …, "disk": …}` in the explain and route logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct TierBlocks {
    pub gpu: u32,
    pub cpu: u32,
    pub disk: u32,
}

impl TierBlocks {
    /// Blocks matched in any tier.
    pub fn total(&self) -> u32 {
        self.gpu + self.cpu + self.disk
    }

    /// The blocks of `tier`.
    pub fn of(&self, tier: Tier) -> u32 {
        match tier {
            Tier::Gpu => self.gpu,
            Tier::Cpu => self.cpu,
            Tier::Disk => self.disk,
        }
    }
}

/// A pod's leading-block runs: `runs[t]` = how many blocks from the start
/// it holds, each in tier `Tier::ALL[t]` or a faster one (so the last is
/// its whole match). A block counts in the slowest tier of it and the
/// blocks before it: the engine reloads the prefix up to it anyway, and a
/// pod's chain leaves the GPU tail first, so that is where it is (see
/// docs/tiers.md).
type Runs = [u32; 3];

/// Per pod slot, the number of leading blocks of a chain the pod holds,
/// and in which tiers: only the pods holding at least one, ordered by
/// slot.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrefixMatch {
    /// (slot, runs with a whole match > 0), ordered by slot.
    entries: Vec<(u16, Runs)>,
}

/// `runs` made consistent: each run within the slower tier's.
fn nested(runs: Runs) -> Runs {
    let [gpu, fast, blocks] = runs;
    let fast = fast.min(blocks);
    [gpu.min(fast), fast, blocks]
}

/// Runs (nested) as blocks per tier.
fn tier_blocks(runs: Runs) -> TierBlocks {
    let [gpu, fast, blocks] = runs;
    TierBlocks {
        gpu,
        cpu: fast.saturating_sub(gpu),
        disk: blocks.saturating_sub(fast),
    }
}

fn max_runs(a: Runs, b: Runs) -> Runs {
    let [a0, a1, a2] = a;
    let [b0, b1, b2] = b;
    [a0.max(b0), a1.max(b1), a2.max(b2)]
}

impl PrefixMatch {
    /// From (slot, runs) pairs in any order (a slot's entries are merged
    /// run by run, the longer each).
    fn from_unordered(mut entries: Vec<(u16, Runs)>) -> PrefixMatch {
        entries.retain(|&(slot, runs)| runs[2] > 0 && usize::from(slot) < MAX_PODS);
        entries.sort_unstable_by_key(|e| e.0);
        entries.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same {
                kept.1 = max_runs(kept.1, later.1);
            }
            same
        });
        for entry in &mut entries {
            entry.1 = nested(entry.1);
        }
        PrefixMatch { entries }
    }

    fn runs(&self, pod: usize) -> Runs {
        let Ok(slot) = u16::try_from(pod) else {
            return Runs::default();
        };
        self.entries
            .binary_search_by_key(&slot, |e| e.0)
            .ok()
            .and_then(|at| self.entries.get(at))
            .map_or(Runs::default(), |e| e.1)
    }

    /// Matched blocks of pod slot `pod`, in any tier.
    pub fn blocks(&self, pod: usize) -> u32 {
        self.runs(pod)[2]
    }

    /// Matched blocks of pod slot `pod` by tier.
    pub fn tiers(&self, pod: usize) -> TierBlocks {
        tier_blocks(self.runs(pod))
    }

    /// Raises `pod`'s match to at least `blocks` held in GPU memory.
    pub fn raise(&mut self, pod: usize, blocks: u32) {
        if blocks == 0 || pod >= MAX_PODS {
            return;
        }
        let slot = pod as u16;
        match self.entries.binary_search_by_key(&slot, |e| e.0) {
            Ok(at) => {
                if let Some(entry) = self.entries.get_mut(at) {
                    entry.1 = max_runs(entry.1, [blocks; 3]);
                }
            }
            Err(at) => self.entries.insert(at, (slot, [blocks; 3])),
        }
    }

    /// Per pod, the larger of two matches (e.g. published index and a
    /// worker's own recent decisions), tier by tier.
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
            .map(|&(slot, runs)| (usize::from(slot), runs[2]))
    }

    /// (pod slot, matched blocks by tier) of every pod holding at least
    /// one block, ordered by slot.
    pub fn iter_tiers(&self) -> impl Iterator<Item = (usize, TierBlocks)> + '_ {
        self.entries
            .iter()
            .map(|&(slot, runs)| (usize::from(slot), tier_blocks(runs)))
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
        self.entries.iter().map(|e| e.1[2]).max().unwrap_or(0)
    }
}

/// Collects (slot, runs) pairs while a lookup runs.
#[derive(Default)]
struct MatchBuilder {
    entries: Vec<(u16, Runs)>,
    /// Pods that met a block outside GPU memory, ordered by slot: the
    /// first block index of a tier slower than GPU, and of one slower
    /// than CPU (`u32::MAX`: none yet).
    demoted: Vec<(u16, [u32; 2])>,
}

impl MatchBuilder {
    /// Every pod of `pods` holds `blocks` leading blocks.
    fn set_all(&mut self, pods: &[Holder], blocks: u32) {
        if blocks == 0 {
            return;
        }
        for holder in pods {
            let slot = holder.slot() as u16;
            let [past_gpu, past_cpu] = match self.demoted.binary_search_by_key(&slot, |d| d.0) {
                Ok(at) => self.demoted.get(at).map_or([u32::MAX; 2], |d| d.1),
                Err(_) => [u32::MAX; 2],
            };
            self.entries
                .push((slot, [past_gpu.min(blocks), past_cpu.min(blocks), blocks]));
        }
    }

    /// Block `index` of the chain is held by `holder` (in its tier).
    fn held_at(&mut self, holder: Holder, index: u32) {
        let tier = holder.tier();
        if tier == Tier::Gpu {
            return;
        }
        let slot = holder.slot() as u16;
        let at = match self.demoted.binary_search_by_key(&slot, |d| d.0) {
            Ok(at) => at,
            Err(at) => {
                self.demoted.insert(at, (slot, [u32::MAX; 2]));
                at
            }
        };
        if let Some((_, [past_gpu, past_cpu])) = self.demoted.get_mut(at) {
            *past_gpu = (*past_gpu).min(index);
            if tier == Tier::Disk {
                *past_cpu = (*past_cpu).min(index);
            }
        }
    }

    fn finish(self) -> PrefixMatch {
        PrefixMatch::from_unordered(self.entries)
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
///
/// Tiers: a pod's GPU run (and, if any holder is on disk, its GPU-or-CPU
/// run) is bisected the same way over the holders of those tiers, each
/// block fetched at most once more. A pod's chain leaves the GPU tail
/// first, so its last matched block, which the first bisection probes,
/// shows whether it holds anything outside GPU memory: an index without
/// tiers costs no probe and no copy more.
pub fn match_by_bisection(
    n: usize,
    mut holders_at: impl FnMut(usize) -> Vec<Holder>,
) -> PrefixMatch {
    let mut slowest = Tier::Gpu;
    let all = bisect_lengths(n, &mut |i: usize| {
        let set = holders_at(i);
        for holder in &set {
            slowest = slowest.max(holder.tier());
        }
        set
    });
    if slowest == Tier::Gpu {
        return all;
    }
    let mut probed: Vec<(usize, Vec<Holder>)> = Vec::new();
    let mut within = |tier: Tier| {
        bisect_lengths(n, &mut |i: usize| {
            let set = match probed.iter().find(|(at, _)| *at == i) {
                Some((_, set)) => set.clone(),
                None => {
                    let set = holders_at(i);
                    probed.push((i, set.clone()));
                    set
                }
            };
            set.into_iter().filter(|h| h.tier() <= tier).collect()
        })
    };
    let gpu = within(Tier::Gpu);
    let fast = if slowest == Tier::Disk {
        within(Tier::Cpu)
    } else {
        all.clone()
    };
    PrefixMatch::from_unordered(
        all.entries
            .iter()
            .map(|&(slot, runs)| {
                let pod = usize::from(slot);
                (slot, [gpu.blocks(pod), fast.blocks(pod), runs[2]])
            })
            .collect(),
    )
}

/// [`match_by_bisection`] over the holders as given (tiers ignored).
fn bisect_lengths(n: usize, holders_at: &mut impl FnMut(usize) -> Vec<Holder>) -> PrefixMatch {
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
        bisect((0, &first), (n - 1, &last), holders_at, &mut result);
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
