//! The candidate set: which pods of the pool one decision scores.
//!
//! Scoring every pod costs O(pods) per request: a candidate built per pod
//! (its match, in-flight load, queue, predicted TTFT), five scorers each,
//! balance. At 64
//! pods that is a few µs; at 1,024 it would be most of the filter's time.
//! So a pool of more than `candidates.exactUpTo` (64) pods scores a set
//! whose size does not grow with the pool, chosen to keep the decision
//! exact where it matters:
//!
//! - **the longest-match holders**: the pods holding the longest cached
//!   prefixes of the request, longest first, until `candidates.holders`
//!   (8) of them are eligible: the eligible pod with the longest match is
//!   always scored. Excluded holders met on the way stay in the set, as
//!   excluded, so the router still sees a full pod that caches more
//!   (hold-out). Holders of equal length are taken from a random
//!   start, so a prefix every pod holds (a short prompt that is all system
//!   prompt) spreads over them instead of going to the lowest slots.
//! - **the least loaded few, as power-of-d choices do**: pods drawn at
//!   random until `candidates.sampled` (8) eligible ones are in (at most 4×
//!   that many draws). Each competes with its own match, load and queue;
//!   the best of d random pods is the classic power-of-d balancer (d = 2
//!   already takes the most loaded of n bins from log n / log log n to
//!   log log n / log d over the mean), and balance ([`super::balance`])
//!   compares the holders' predicted TTFT against these samples' instead
//!   of the whole pool's.
//! - **the adapter holders**: for a LoRA request, the pods with its
//!   adapter loaded, from a random start, until `candidates.holders` are
//!   eligible.
//!
//! **Exclusions hold exactly.** Every pod in the set is checked by the same
//! rules as before (health below `healthExclusionThreshold`, queue at
//! `maxQueue`), so an excluded pod is never chosen or listed; and when the
//! set has no eligible pod, every pod of the pool is scored (O(pods), only
//! when nearly all pods are excluded), so a request waits or gets its 503
//! only when no pod in the pool can take it — as with exact scoring.
//!
//! **What the set gives up.** A pod outside it has a shorter match than the
//! eligible holders taken (or none) and was not drawn. It would have won
//! only by load, queue and health terms (at most 0.40 of the composite)
//! beating both the best holder's cache advantage and the best of the
//! drawn pods: with 8 eligible draws, the best drawn pod is among the
//! least loaded 1/9 of the pool in expectation. Measured in
//! `kvroute-replay` (docs/design.md, Candidate set): the set against
//! `exactUpTo: 1024` (every pod scored) on the shared traces at 256 and
//! 1,024 pods.
//!
//! Cost: O(h + s) candidates built and scored, s ≤ 4 × sampled drawn, h the
//! holders looked at until enough are eligible (4 × holders ranked first,
//! the rest only when most of those are full); plus O(holders of the
//! prefix) to rank them, the match list the lookup already produced.

use super::Candidate;
use crate::config::CandidatesConfig;

/// The pods one decision may score. Candidates are built on demand, so a
/// decision over a large pool builds only the set it scores.
pub trait Pool<'a> {
    /// Pods in the pool (indexes `0..len`).
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pod `index` as a candidate.
    fn candidate(&self, index: usize) -> Candidate<'a>;

    /// (index, cache match) of the pods holding a prefix of the request,
    /// in any order.
    fn holders(&self) -> Vec<(usize, f64)>;

    /// Indexes of the pods with the request's adapter loaded, in any order.
    fn adapter_holders(&self) -> Vec<usize>;
}

/// Ready candidates are a pool (tests, benchmarks, compiled-in callers).
impl<'a> Pool<'a> for [Candidate<'a>] {
    fn len(&self) -> usize {
        <[Candidate<'a>]>::len(self)
    }

    fn candidate(&self, index: usize) -> Candidate<'a> {
        self.get(index)
            .cloned()
            .unwrap_or_else(|| absent_candidate(index))
    }

    fn holders(&self) -> Vec<(usize, f64)> {
        self.iter()
            .enumerate()
            .filter(|(_, c)| c.cache_match > 0.0)
            .map(|(i, c)| (i, c.cache_match))
            .collect()
    }

    fn adapter_holders(&self) -> Vec<usize> {
        self.iter()
            .enumerate()
            .filter(|(_, c)| c.adapter_loaded)
            .map(|(i, _)| i)
            .collect()
    }
}

/// Delegates to the slice: arrays and vectors of ready candidates.
macro_rules! slice_pool {
    ($($impl:tt)*) => {
        $($impl)* {
            fn len(&self) -> usize {
                self[..].len()
            }

            fn candidate(&self, index: usize) -> Candidate<'a> {
                self[..].candidate(index)
            }

            fn holders(&self) -> Vec<(usize, f64)> {
                self[..].holders()
            }

            fn adapter_holders(&self) -> Vec<usize> {
                self[..].adapter_holders()
            }
        }
    };
}

slice_pool!(impl<'a> Pool<'a> for Vec<Candidate<'a>>);
slice_pool!(impl<'a, const N: usize> Pool<'a> for [Candidate<'a>; N]);

/// What an index past a pool's end reads as: a pod no rule lets through.
fn absent_candidate<'a>(index: usize) -> Candidate<'a> {
    static NONE: std::collections::BTreeMap<String, f64> = std::collections::BTreeMap::new();
    Candidate {
        predicted_ttft_ms: f64::INFINITY,
        load: 1.0,
        queue: u32::MAX,
        health: 0.0,
        ..Candidate::idle(index, "", &NONE)
    }
}

/// How many times `holders` / `sampled` a step may look at.
const SCAN_FACTOR: usize = 4;

/// The pods of `pool` to score, with their indexes, ordered by index:
/// every pod when the pool has at most `config.exactUpTo`, else the set of
/// the module documentation. `eligible` is the exclusion rule; `seed`
/// varies per decision (the random draws and the start among equals).
pub fn select<'a, P: Pool<'a> + ?Sized>(
    pool: &P,
    config: &CandidatesConfig,
    needs_adapter: bool,
    seed: u64,
    eligible: impl Fn(&Candidate<'a>) -> bool,
) -> Vec<(usize, Candidate<'a>)> {
    let n = pool.len();
    let everyone = || (0..n).map(|i| (i, pool.candidate(i))).collect();
    if n <= config.exact_up_to {
        return everyone();
    }
    let mut rng = SplitMix(seed);
    let mut set = Set::default();
    let scan = |wanted: usize| wanted.saturating_mul(SCAN_FACTOR);

    // The longest matches first; equal ones in an order drawn per decision.
    let salt = rng.next();
    let mut holders = pool.holders();
    let order = |a: &(usize, f64), b: &(usize, f64)| {
        b.1.total_cmp(&a.1)
            .then_with(|| mix(a.0 as u64 ^ salt).cmp(&mix(b.0 as u64 ^ salt)))
    };
    // Ranked in two steps: the first few usually hold enough eligible
    // pods; the rest is sorted only when they do not (most holders full).
    let first = scan(config.holders).min(holders.len());
    if first < holders.len() {
        holders.select_nth_unstable_by(first, order);
    }
    let (head, rest) = holders.split_at_mut(first);
    head.sort_unstable_by(order);
    let found = set.take_until(head.iter().map(|h| h.0), config.holders, pool, &eligible);
    if found < config.holders && !rest.is_empty() {
        rest.sort_unstable_by(order);
        let wanted = config.holders - found;
        set.take_until(rest.iter().map(|h| h.0), wanted, pool, &eligible);
    }

    if needs_adapter {
        let adapter = pool.adapter_holders();
        let start = if adapter.is_empty() {
            0
        } else {
            rng.below(adapter.len())
        };
        let rotated = adapter
            .iter()
            .cycle()
            .skip(start)
            .take(adapter.len().min(scan(config.holders)))
            .copied();
        set.take_until(rotated, config.holders, pool, &eligible);
    }

    let draws: Vec<usize> = (0..scan(config.sampled)).map(|_| rng.below(n)).collect();
    set.take_until(draws.into_iter(), config.sampled, pool, &eligible);

    if set.eligible == 0 {
        // Nearly every pod is excluded: whether any can take the request
        // is decided over the whole pool.
        return everyone();
    }
    let mut taken = set.taken;
    taken.sort_unstable_by_key(|(i, _)| *i);
    taken
}

/// The set being built: each index once.
#[derive(Default)]
struct Set<'a> {
    taken: Vec<(usize, Candidate<'a>)>,
    eligible: usize,
}

impl<'a> Set<'a> {
    /// Adds pods from `indexes` until `wanted` eligible ones are in (pods
    /// already in count for this source too, without being added again);
    /// returns how many eligible ones it found.
    fn take_until<P: Pool<'a> + ?Sized>(
        &mut self,
        indexes: impl Iterator<Item = usize>,
        wanted: usize,
        pool: &P,
        eligible: &impl Fn(&Candidate<'a>) -> bool,
    ) -> usize {
        let mut found = 0;
        for index in indexes {
            if found >= wanted {
                break;
            }
            if let Some((_, candidate)) = self.taken.iter().find(|(i, _)| *i == index) {
                found += usize::from(eligible(candidate));
                continue;
            }
            let candidate = pool.candidate(index);
            if eligible(&candidate) {
                found += 1;
                self.eligible += 1;
            }
            self.taken.push((index, candidate));
        }
        found
    }
}

/// splitmix64: the per-decision random stream.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in `0..n` (n > 0; the modulo bias is below 2^-50 for n ≤ 1,024).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` healthy idle pods at half load.
    fn pool(n: usize) -> Vec<Candidate<'static>> {
        (0..n)
            .map(|slot| Candidate {
                load: 0.5,
                queue: 0,
                health: 1.0,
                ..absent_candidate(slot)
            })
            .collect()
    }

    fn eligible(c: &Candidate<'_>) -> bool {
        c.health >= 0.3 && c.queue < 20
    }

    fn indexes(set: &[(usize, Candidate<'_>)]) -> Vec<usize> {
        set.iter().map(|(i, _)| *i).collect()
    }

    #[test]
    fn a_small_pool_is_scored_whole() {
        let pods = pool(64);
        let set = select(&pods, &CandidatesConfig::default(), false, 1, eligible);
        assert_eq!(indexes(&set), (0..64).collect::<Vec<_>>());
    }

    #[test]
    fn a_large_pool_scores_its_longest_holders_adapter_holders_and_a_sample() {
        let mut pods = pool(1024);
        // Holders: 900 the longest (but full), then 10..20 shorter.
        pods[900].cache_match = 0.9;
        pods[900].queue = 20;
        for (i, pod) in pods.iter_mut().enumerate().skip(10).take(10) {
            pod.cache_match = 0.1 + i as f64 / 100.0;
        }
        pods[500].adapter_loaded = true;
        let config = CandidatesConfig::default();
        let set = select(&pods, &config, true, 7, eligible);
        let taken = indexes(&set);
        assert!(taken.contains(&900), "the full longest holder is listed");
        // The eight longest eligible holders: 19 down to 12.
        for i in 12..20 {
            assert!(taken.contains(&i), "holder {i} in {taken:?}");
        }
        assert!(!taken.contains(&10) && !taken.contains(&11));
        assert!(taken.contains(&500), "the adapter holder");
        let eligible_count = set.iter().filter(|(_, c)| eligible(c)).count();
        assert!(
            (8 + 1 + 8..=8 + 1 + 32).contains(&eligible_count),
            "{eligible_count}"
        );
        assert!(set.len() < 64, "flat: {} candidates", set.len());
        assert!(taken.windows(2).all(|w| w[0] < w[1]), "ordered, once each");
    }

    #[test]
    fn equal_holders_are_taken_from_a_random_start() {
        let mut pods = pool(1024);
        for pod in &mut pods {
            pod.cache_match = 0.5;
        }
        let config = CandidatesConfig::default();
        let mut seen = std::collections::HashSet::new();
        for seed in 0..64 {
            let set = select(&pods, &config, false, seed, eligible);
            assert!(set.len() <= 16);
            seen.extend(indexes(&set));
        }
        assert!(seen.len() > 400, "spread over the pool: {}", seen.len());
    }

    #[test]
    fn with_every_drawn_pod_excluded_the_whole_pool_decides() {
        let mut pods = pool(1024);
        for pod in &mut pods {
            pod.queue = 20;
        }
        pods[777].queue = 0;
        let set = select(&pods, &CandidatesConfig::default(), false, 3, eligible);
        assert_eq!(set.len(), 1024, "scored whole, so pod 777 is found");
        pods[777].queue = 20;
        let set = select(&pods, &CandidatesConfig::default(), false, 3, eligible);
        assert_eq!(set.len(), 1024, "and every exclusion is listed");
    }
}
