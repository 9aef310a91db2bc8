//! Spread: a shared prefix gets holders in proportion to the sessions it
//! starts.
//!
//! The balance ([`super::balance`]) moves a request off the pods caching
//! its prefix only when another pod answers it clearly sooner. That is
//! right for one request and wrong for the sessions that branch from a
//! shared prefix (a system prompt, a document): each session's later
//! turns follow its history, so the prefix's first holder collects every
//! session and the pool's other pods stay empty.
//!
//! **Session starts.** An arrival whose longest match ends at a block an
//! earlier arrival's match also ended at is a session start from that
//! prefix `P`. A chat with an assistant message is a later turn and is
//! never counted; a completion's later turn matches to where its own
//! previous prompt ended, a block nobody else's match ended at. Every
//! worker counts the gateway's starts, its own and the others' from the
//! feed ([`crate::scoring::feed`]). With `n(P)` the recent starts at `P`
//! and `N` in all (decayed over `balance.learningWindow` starts per pod),
//! `pods` the pool and `scored` the pods a decision scores:
//!
//! ```text
//! share(P)   = n(P) / (N + pods)              one start per pod as prior
//! holders(P) = min(n(P), share(P) × scored)
//! ```
//!
//! **Copies.** While fewer pods than `holders(P)` cache all of `P` and
//! the holders are hot (they carry more than their share of the open
//! streams), a start at `P` goes to a pod without it: among those with no
//! more prefill queued than the least queued plus this request's own, the
//! one that carried the fewest streams over recent decisions
//! ([`super::occupancy`]), then the seed's score. Copies are bounded:
//! `Σ ⌈share(P) × scored⌉ ≤ scored + prefixes` per window.
//!
//! **Sessions that continue** (within the window a later turn went past
//! `P`): the holders compete on what they carry, not on one request's
//! predicted TTFT ([`keep_holders_together`]), and a start may also go to
//! a pod without `P` that, even with this session, carries fewer streams
//! than every holder does now. That is the point where the move lowers
//! the most loaded pod's load: no margin, and at most one copy per pod.
//! Single-shot starts (matches that end at `P`) are decided per request.
//! O(1) per arrival, bounded by [`REMEMBERED`] blocks of each kind.
//!
//! Measured reasons (`kvroute-replay` and real Envoy, in
//! integration/results/costmodel.md):
//! - the rule itself: multi-turn TTFT p90 66 → 37 ms at 4 pods and
//!   117 → 40 at 8 (ring hash 37 and 45), 88 → 98.9 % of the bound at 8
//!   ("The multi-turn herd", "Spread on main");
//! - only while the holders are hot: an idle holder answers at once
//!   (`long_shared_prefix_goes_to_the_pod_that_holds_it`);
//! - targets not behind another pod's whole request: long context at 4
//!   pods p50 2.2 → 1.4 s ("Spread on main");
//! - targets by streams carried over time: ranked by predicted TTFT, an
//!   agent went to a pod running eight while another idled (4 of 6
//!   real-Envoy agentic runs); by one report's load, LoRA's top tenant
//!   reached 1.4× fair ("A copy goes where fewer streams were carried");
//!   without streams, approximate multi-turn reached 86 % of the bound
//!   ("Streams");
//! - holders compete on what they carry: the mixed pool's multi-turn p90
//!   86–91 → 59–63 ms ("Sessions that continue");
//! - fewer carried, for continuing sessions only: agentic at 4 pods 1.33
//!   → 1.17× fair, long context at 8 pods 94.5 → 97.5 % of the bound;
//!   applied to every start it took shared prefix to 78.8 % ("Where fewer
//!   are carried");
//! - starts counted over the scored pods, not the pool: Mooncake at 1,024
//!   pods 85.6 → 97.9 % of the bound ("Spread on main");
//! - counted across workers and replicas: per worker, the first 8 starts
//!   of a run went to one pod (docs/replicas.md).
//!
//! Known loss: a copy's cache room is not priced, so at 8 pods long
//! context's head copies evict sessions' histories (issue 50).

use std::collections::VecDeque;

use hashbrown::{HashMap, HashSet};

use super::balance::Verdict;
use super::Candidate;

/// Blocks remembered, of each kind: match ends seen once, and branch
/// points with their session starts (8 and 40 bytes).
pub const REMEMBERED: usize = 4096;

/// What one session start's prefix asks of the pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Demand {
    /// Recent session starts at the prefix.
    pub starts: f64,
    /// Their share of all recent session starts.
    pub share: f64,
    /// Pods caching the whole prefix.
    pub holders: usize,
    /// A later turn of a session from the prefix was seen within the
    /// window: its sessions continue where they start.
    pub continues: bool,
}

impl Demand {
    /// Whether the prefix needs another holder among `pods`, its holders
    /// `hot` or not (module documentation).
    pub fn wants_holder(&self, pods: usize, hot: bool) -> bool {
        hot && (self.holders as f64) < self.starts.min(self.share * pods as f64)
    }
}

/// The pods of `pods` (a decision's eligible ones) a session start may go
/// to when its prefix wants another holder among the `scored` pods and
/// its holders (`holds`, [`holding`]) are hot, or, for sessions that
/// continue, those that would carry fewer than every holder; `None` when
/// neither applies (module documentation).
pub fn targets(
    pods: &[Candidate<'_>],
    holds: &[bool],
    demand: Demand,
    scored: usize,
) -> Option<Vec<bool>> {
    let streams = |holding: bool| -> f64 {
        pods.iter()
            .zip(holds)
            .filter(|&(_, &h)| h == holding)
            .map(|(pod, _)| f64::from(pod.streams))
            .sum()
    };
    let holders = holds.iter().filter(|&&h| h).count() as f64;
    let (held, elsewhere) = (streams(true), streams(false));
    let hot = held > 0.0 && held / (held + elsewhere) > holders / pods.len() as f64;
    let wanted = demand.wants_holder(scored, hot);
    if !wanted && !demand.continues {
        return None;
    }
    // Sessions that continue: a pod that, even with this one, carries
    // fewer streams than every holder does now.
    let least_held = pods
        .iter()
        .zip(holds)
        .filter(|&(_, &h)| h)
        .map(|(pod, _)| pod.streams)
        .min();
    let carries_less = |pod: &Candidate<'_>| {
        demand.continues && least_held.is_some_and(|held| pod.streams.saturating_add(1) < held)
    };
    // Not behind another pod's whole request.
    let least_queued = pods
        .iter()
        .zip(holds)
        .filter(|&(_, &h)| !h)
        .map(|(pod, _)| pod.queued_prefill)
        .min()?;
    let to: Vec<bool> = pods
        .iter()
        .zip(holds)
        .map(|(pod, &h)| {
            !h && pod.queued_prefill <= least_queued + pod.uncached_tokens
                && (wanted || carries_less(pod))
        })
        .collect();
    to.contains(&true).then_some(to)
}

/// A session start from a prefix whose sessions continue: if the balance
/// let any of its holders (`holds`, [`holding`]) keep its cache term, all
/// of them keep it, so the seed's load and queue terms (then the streams)
/// choose among them by what each carries, not by which answers this one
/// request sooner (module documentation). `verdicts` align with `holds`.
pub fn keep_holders_together(holds: &[bool], demand: Demand, verdicts: &mut [Verdict]) {
    if !demand.continues {
        return;
    }
    let a_holder_kept = holds
        .iter()
        .zip(verdicts.iter())
        .any(|(&holds, verdict)| holds && !verdict.cache_withheld);
    if a_holder_kept {
        for (_, verdict) in holds.iter().zip(verdicts.iter_mut()).filter(|(&h, _)| h) {
            verdict.cache_withheld = false;
        }
    }
}

/// Which of `pods` hold the prefix: those caching the most of it.
pub fn holding(pods: &[Candidate<'_>]) -> Vec<bool> {
    let most_cached = pods.iter().map(|p| p.cached_tokens).max().unwrap_or(0);
    pods.iter()
        .map(|p| p.cached_tokens == most_cached)
        .collect()
}

/// Session starts at one branch point, decayed to `at` (the starts clock).
#[derive(Debug, Clone, Copy)]
struct Starts {
    count: f64,
    at: u64,
    /// When a later turn of a session from it was last seen.
    continued_at: Option<u64>,
}

/// See the module documentation. One per filter worker (like the TTFT
/// model, fed every worker's and replica's starts), and one in the replay.
#[derive(Debug, Clone, Default)]
pub struct PrefixDemand {
    /// Match ends seen once, oldest first.
    seen: HashSet<u64>,
    seen_order: VecDeque<u64>,
    branches: HashMap<u64, Starts>,
    /// Decayed session starts, all prefixes (and none) together.
    total: f64,
    /// Session starts counted so far: the clock the decay runs on.
    clock: u64,
    /// Session starts averaged over: `balance.learningWindow` per pod.
    window: f64,
}

fn decay(window: f64, steps: u64) -> f64 {
    (1.0 - 1.0 / window.max(1.0)).powf(steps as f64)
}

impl PrefixDemand {
    /// An arrival routed with its longest cached match ending at block
    /// `end` (`None`: nothing cached anywhere, a session of its own), and
    /// `follows_up` as its request says
    /// ([`crate::request::ParsedRequest::follows_up`]). `chain`, its
    /// blocks, tells which branch points' sessions continue: every one its
    /// match went past (a chat's later turn continues from its match end
    /// too, however little of its history is cached). Only this worker's
    /// own arrivals give it (the feed carries starts, not chains): with
    /// several workers each sees its share of the later turns, and one is
    /// enough. O(matched blocks): 0.9 µs for a 512-block later turn, beside
    /// 23 µs to route a 16 KiB body (`make bench-micro`).
    pub fn record(
        &mut self,
        chain: &[u64],
        end: Option<u64>,
        follows_up: Option<bool>,
        window: f64,
    ) {
        self.window = window;
        self.record_continuation(chain, end, follows_up);
        if follows_up == Some(true) {
            return;
        }
        let Some(end) = end else {
            self.count_start();
            return;
        };
        let known = self.branches.contains_key(&end);
        let promoted = !known && self.seen.remove(&end);
        if !known && !promoted {
            // First time: a later turn of its own session, or a branch
            // point's first start (counted once a second one comes).
            self.seen.insert(end);
            self.seen_order.push_back(end);
            while self.seen_order.len() > REMEMBERED {
                if let Some(oldest) = self.seen_order.pop_front() {
                    self.seen.remove(&oldest);
                }
            }
            return;
        }
        if promoted {
            self.count_start();
        }
        self.count_start();
        let clock = self.clock;
        let starts = self.branches.entry(end).or_insert(Starts {
            count: if promoted { 1.0 } else { 0.0 },
            at: clock,
            continued_at: None,
        });
        starts.count = starts.count * decay(window, clock - starts.at) + 1.0;
        starts.at = clock;
        if self.branches.len() > REMEMBERED {
            // Keep the busier half.
            let mut counts: Vec<f64> = self.branches.values().map(|s| self.decayed(s)).collect();
            let middle = counts.len() / 2;
            let (_, &mut median, _) = counts.select_nth_unstable_by(middle, f64::total_cmp);
            let decayed = |s: &Starts| s.count * decay(window, clock - s.at);
            self.branches.retain(|_, s| decayed(s) > median);
        }
    }

    fn record_continuation(&mut self, chain: &[u64], end: Option<u64>, follows_up: Option<bool>) {
        if self.branches.is_empty() {
            return;
        }
        let Some(end_at) = end.and_then(|end| chain.iter().position(|&block| block == end)) else {
            return;
        };
        let passed = if follows_up == Some(true) {
            end_at + 1
        } else {
            end_at
        };
        let clock = self.clock;
        for block in chain.iter().take(passed) {
            if let Some(starts) = self.branches.get_mut(block) {
                starts.continued_at = Some(clock);
            }
        }
    }

    fn count_start(&mut self) {
        self.clock += 1;
        self.total = self.total * decay(self.window, 1) + 1.0;
    }

    fn decayed(&self, starts: &Starts) -> f64 {
        starts.count * decay(self.window, self.clock - starts.at)
    }

    /// The recent session starts at the prefix ending at `end` and their
    /// share of all, in a pool of `pods` (`None`: not a branch point).
    pub fn demand(&self, end: u64, pods: usize) -> Option<Demand> {
        let branch = self.branches.get(&end)?;
        let starts = self.decayed(branch);
        Some(Demand {
            starts,
            share: starts / (self.total + pods as f64),
            holders: 0,
            continues: branch
                .continued_at
                .is_some_and(|at| (self.clock - at) as f64 <= self.window),
        })
    }

    /// Branch points counted.
    pub fn len(&self) -> usize {
        self.branches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.branches.is_empty()
    }
}

/// The block a request's longest cached match ends at: its last block
/// held by any pod (`None` when no pod holds its first).
pub fn match_end(chain: &[u64], longest_blocks: u32) -> Option<u64> {
    let blocks = usize::try_from(longest_blocks).ok()?;
    blocks
        .checked_sub(1)
        .and_then(|last| chain.get(last))
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With the prefix's holders hot.
    fn wants(demand: &PrefixDemand, end: u64, holders: usize, pods: usize) -> bool {
        demand
            .demand(end, pods)
            .is_some_and(|d| Demand { holders, ..d }.wants_holder(pods, true))
    }

    #[test]
    fn one_system_prompt_wants_every_pod() {
        let mut demand = PrefixDemand::default();
        assert_eq!(match_end(&[10, 11, 12], 0), None);
        assert_eq!(match_end(&[10, 11, 12], 2), Some(11));
        assert_eq!(match_end(&[10, 11, 12], 9), None);
        // The first session had nothing cached; the second matched the
        // system prompt (ends at 11) first: not a branch point yet.
        demand.record(&[], None, None, 1e6);
        demand.record(&[], Some(11), None, 1e6);
        assert!(!wants(&demand, 11, 1, 4));
        // Later turns: a chat says so; a completion's ends at its own
        // history, once each.
        for turn in 0..50 {
            demand.record(&[], Some(11), Some(true), 1e6);
            demand.record(&[], Some(1_000 + turn), None, 1e6);
        }
        assert!(demand.is_empty());
        // The third session makes it one, with two starts of three: two
        // holders; then every pod.
        demand.record(&[], Some(11), Some(false), 1e6);
        assert!(wants(&demand, 11, 1, 4));
        assert!(!wants(&demand, 11, 2, 4));
        for _ in 0..100 {
            demand.record(&[], Some(11), None, 1e6);
        }
        assert!(wants(&demand, 11, 3, 4));
        assert!(!wants(&demand, 11, 4, 4));
        assert_eq!(demand.demand(99, 4), None);
        // Never while its holders are not hot.
        let d = demand.demand(11, 4).unwrap();
        assert!(!Demand { holders: 1, ..d }.wants_holder(4, false));
    }

    #[test]
    fn three_prompts_of_a_third_each_want_two_holders_of_four() {
        let mut demand = PrefixDemand::default();
        for _ in 0..40 {
            for prompt in [1, 2, 3] {
                demand.record(&[], Some(prompt), Some(false), 1e6);
            }
        }
        for prompt in [1, 2, 3] {
            assert!(wants(&demand, prompt, 1, 4));
            assert!(!wants(&demand, prompt, 2, 4));
        }
    }

    #[test]
    fn a_prefix_continues_once_a_later_turn_goes_past_it() {
        let mut demand = PrefixDemand::default();
        let continues = |demand: &PrefixDemand| demand.demand(11, 4).unwrap().continues;
        // Two sessions start at the system prompt ending at block 11.
        demand.record(&[10, 11, 20], Some(11), Some(false), 8.0);
        demand.record(&[10, 11, 30], Some(11), Some(false), 8.0);
        assert!(!continues(&demand));
        // Single-shot requests end their match there too: still not.
        demand.record(&[10, 11, 40], Some(11), None, 8.0);
        assert!(!continues(&demand));
        // A completion matching its own history past the prompt continues
        // its session; so does a chat's later turn, wherever its match ends.
        demand.record(&[10, 11, 20, 21, 22], Some(21), None, 8.0);
        assert!(continues(&demand));
        let mut chat = PrefixDemand::default();
        chat.record(&[10, 11, 20], Some(11), Some(false), 8.0);
        chat.record(&[10, 11, 30], Some(11), Some(false), 8.0);
        chat.record(&[10, 11, 30, 31], Some(11), Some(true), 8.0);
        assert!(continues(&chat));
        // Forgotten after a window of starts without one.
        for start in 0..9 {
            demand.record(&[10, 11, 50 + start], Some(11), Some(false), 8.0);
        }
        assert!(!continues(&demand));
    }

    #[test]
    fn memory_is_bounded() {
        let mut demand = PrefixDemand::default();
        for end in 0..(3 * REMEMBERED as u64) {
            demand.record(&[], Some(end), None, 1e6);
            demand.record(&[], Some(end), None, 1e6);
        }
        assert!(demand.len() <= REMEMBERED);
        assert!(demand.seen.len() <= REMEMBERED);
        assert!(demand.seen_order.len() <= REMEMBERED);
    }
}
