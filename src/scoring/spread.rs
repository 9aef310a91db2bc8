//! Spread: a shared prefix gets holders in proportion to the sessions it
//! starts.
//!
//! The balance ([`super::balance`]) moves a request off the pods caching
//! its prefix only when another pod is predicted to answer it clearly
//! sooner, re-prefill included. That is right for the request, and wrong
//! for the sessions that branch from a shared prefix (a system prompt, a
//! document, few-shot examples): each session's later turns follow its
//! history to the pod it started on, so the prefix's first holder collects
//! every session until its queue outgrows a whole copy of the prefix, and
//! the pool's other pods stay empty. Measured with `kvroute-replay
//! --bench-workload multi-turn` (128 chats of 6 rounds on one 1,000-token
//! system prompt): at 4 pods one pod never prefilled a token (TTFT p90
//! 66 ms against ring hash's 37), at 8 pods two (p90 117 against 45, 88 %
//! of the pooled bound); with unbounded caches all went to one pod.
//! Copying the system prompt once to every pod (the first decisions by
//! load) removed it: 99.5 % of the bound, p90 37 ms.
//!
//! So the router counts, per prefix, the sessions that start from it: an
//! arrival whose longest match ends at a block an earlier arrival's match
//! also ended at branches there. A conversation's later turn does not: a
//! chat says so itself (it carries an assistant message), and is never
//! counted or spread, however little of its own history this router has
//! seen yet (another worker's decision, a pod that has not reported); a
//! completion's later turn matches to where its own previous prompt
//! ended, a block nobody else's match ended at. With `n(P)` the recent
//! session starts at `P`, `N` of them in all (both decayed over
//! `balance.learningWindow` starts per pod, the TTFT model's horizon),
//! `pods` in the pool and `scored` the pods a decision scores (the pool,
//! or a large pool's candidate set), `P` needs
//!
//! ```text
//! share(P)   = n(P) / (N + pods)              one start per pod as prior
//! holders(P) = min(n(P), share(P) × scored)
//! ```
//!
//! pods: no holder starts more than its fair share of the sessions from
//! it, and there are no more holders than sessions. The prior keeps a
//! pool that has seen fewer starts than it has pods from reading a
//! handful of them as a large share.
//!
//! Every worker counts every session start of the gateway, its own as it
//! routes them and every other worker's and replica's from the gateway's
//! feed ([`crate::scoring::feed`]; the replay's single router counts its
//! own). Counted per worker, each of three replicas' six workers saw a
//! sixth of the starts: read as its own, a sixth made the prior weigh six
//! times as much (multi-turn's system prompt got its third holder at the
//! 26th start, against the 13th with one replica); read through the
//! worker's share of the answers, a worker's first start at a prefix
//! counted only with its own second one, and the share was 1 until the
//! first answers came, so the first 8 starts of a run all went to one pod
//! (`kvroute-bench replicas multi-turn --keep-logs`,
//! integration/results/replicas).
//!
//! A copy is bought only while `P`'s holders are hot: they carry more
//! than their share of the streams open on the pods scored (requests
//! routed there whose answer has not ended, counted by every worker and
//! replica, [`crate::snapshot::SlotLoad::streams`]). Idle
//! holders answer a session start at once, and so will its later turns:
//! eleven questions on one document sent one at a time went to its idle
//! holder, where the rule counting starts alone had copied the document
//! for the third (CI, `long_shared_prefix_goes_to_the_pod_that_holds_it`).
//!
//! While fewer pods cache all of `P`, a hot holder's session start at `P`
//! goes to a pod without it, among those with no more prefill queued than
//! the least queued of them plus this request's own (a copy is not sent
//! behind another pod's whole request: in the long-context burst, 16
//! sessions of 8,000-token heads opening at once, that took its TTFT p50
//! at 4 pods from 2.2 s back to 1.4 s, main 1.5 s), the one that carried
//! the fewest streams over recent decisions, then the one the seed's
//! score prefers. The copy is bought for the sessions that will follow
//! this one there, so what the pod carries over time counts: not what
//! one request's predicted TTFT says (the learned lines of idle pods
//! differ by noise, and ranking by them sent an agent to a pod already
//! running eight while another idled, 4 of 6 real-Envoy agentic runs),
//! nor one report's load (ranked by the seed's score, LoRA's top tenant
//! was copied where one running sequence fewer was reported at that
//! instant, onto the second and fifth tenants' pod: 1.4× fair in most
//! real-Envoy runs, measured in [`super`]). So one system prompt is copied to every pod,
//! three prompts of a third of the sessions each get two holders of four
//! pods, and the copies are bounded: `Σ ⌈share(P) × scored⌉ ≤ scored +
//! prefixes` per window. Exclusions hold exactly, and only arrivals
//! spread (not a request leaving the wait queue). O(1)
//! per arrival, bounded by [`REMEMBERED`] blocks of each kind. Both
//! modes: in approximate mode no report carries a load and a request
//! leaves a pod's queue at its first byte, so only the open streams tell
//! what a pod carries. Before they were counted the rule ran in precise
//! mode only: hot read requests awaiting a first token (0–3 per pod), the
//! target rotated blindly among pods tied at load 0, and the agentic
//! closed loop collapsed in 6 of 12 real-Envoy runs. With the streams
//! (costmodel.md, "Streams"): approximate multi-turn 86.0 → 98.8 % of the
//! bound and p90 110 → 37 ms at 8 pods in the replay, and in real Envoy
//! hit 0.75–0.82 → 0.84, p90 50–119 → 40–44 ms; agentic unchanged.
//!
//! **Among the holders, what each carries decides a start whose sessions
//! continue.** The balance weighs one request: a holder prefilling
//! another session's turn at the instant of a start reads clearly slower
//! than one idle at that instant though it carries six sessions, and
//! loses its cache term; the start, and every later turn of its session,
//! then go to the busier pod. In a pool of two fast and two half-speed
//! pods a slow holder read slower at every start, and the fast pods took
//! 92 % of multi-turn's prefill (TTFT p90 89 ms against ring hash's 61).
//! So for a session start from a prefix whose sessions are seen to
//! continue (within the window, a later turn went past it: a chat's later
//! turn, or a prompt whose match extends beyond it), if the balance let
//! any holder keep its cache term, every holder keeps it, and the seed's
//! load and queue terms, then the streams, choose among them, as they
//! choose spread's targets ([`keep_holders_together`]). Starts of
//! single-shot traffic (matches that end at the prefix, never past it)
//! are decided per request as before: keeping every start's holders
//! together cost the LoRA workload's TTFT p90 at 8 pods 22 → 25 ms in
//! each of three seeds. Each worker learns it from its own arrivals (the
//! feed carries starts, not chains; one later turn is enough). Measured
//! with `kvroute-replay`, three seeds, every bench workload at 4 and 8
//! pods and the mixed pool (integration/results/costmodel.md, "Sessions
//! that continue"): the mixed pool's multi-turn TTFT p90 86–91 → 59–63
//! ms (ring hash 61), p99 134–168 → 125–132, 92 → 95–97 % of the bound,
//! max share 1.8 → 1.4–1.5×, fast pods' prefill 92 → 75–80 %; same-speed
//! multi-turn at 4 pods, precise, p99 68–92 → 59–90 ms, at 8 pods within
//! 4 ms either way; agentic within its seeds' spread (at 8 pods −0.8 to
//! +0.4 points of the bound); the traces, shared prefix, LoRA, the trace
//! workload and long context unchanged.
//!
//! **A start whose sessions continue goes where fewer are carried.** The
//! share above counts a prefix's starts from its third (the second is a
//! branch point's first sight), against a prior of one start per pod, so
//! three prompts of a third of the starts each never ask for a second
//! holder at 4 pods, and the closed loops of the first holders' sessions
//! pile up: agentic put 8 of its 24 agents on one pod (1.33× fair) in
//! every real-Envoy run, and at 8 pods the first holders of long
//! context's two heads took 4 and 5 sessions before a copy was bought,
//! which the balance then moved, history and all. So a start from a
//! prefix whose sessions continue may also go to a pod without the prefix
//! that, even with this session, carries fewer streams than every holder
//! does now (among those not behind another pod's whole request; the
//! seed's score, then the streams, choose among them). The session's
//! later turns follow it, so what the pods carry decides, not this
//! request's predicted TTFT. "Fewer, even with this one" is the point at
//! which the move lowers what the most loaded of them carries, no tuned
//! margin, and each such copy adds a holder, so a prefix gets at most one
//! per pod. Single-shot starts are not affected: for every start the same
//! rule took shared prefix at 4 pods from 99.5 to 78.8 % of the bound,
//! each short session on one document paying for a copy. Measured with
//! `kvroute-replay`, six seeds, medians (integration/results/
//! costmodel.md, "Where fewer are carried"): agentic at 4 pods max share
//! 1.33 → 1.17× (worst seed 1.46–1.50 → 1.33), TTFT p90 99–101 → 90–96
//! ms; at 8 pods, precise, 93.8 → 96.0 % of the bound; long context at 8
//! pods 94.5 → 97.5 % (precise), p50 820 → 402 ms; the mixed pool's
//! agentic p90 685–726 → 243–418 ms; multi-turn, shared prefix, LoRA, the
//! trace workload and both shared traces unchanged. It costs long context
//! at 4 pods in approximate mode p90 3.1 → 3.5 s (ring hash 4.3) and
//! agentic at 8 pods in approximate mode p99 321 → 361 ms. Real Envoy:
//! agentic's max share 1.17× in all six runs (1.33 in every run before),
//! TTFT p90 and p99 as before; in the mixed pool, six runs against main's
//! eight, p90 median 121 → 113 ms (precise) and 120 → 113 (approximate),
//! p99 about as before, one approximate run of six over the KV cliff
//! (p90 394 ms; main's worst of eight 174).
//!
//! Measured side by side with the rule off (integration/results/
//! costmodel.md, "Spread on main"): `kvroute-replay`, every bench
//! workload at 4 and 8 pods: multi-turn TTFT p90 66 → 37 ms at 4 pods and
//! 117 → 40 at 8 (ring hash: 37 and 45), 96 → 99.5 % and 88 → 98.9 % of
//! the pooled bound; agentic p90 100 → 72 ms at 4 pods, p50 127 → 53 at
//! 8; LoRA at 8 pods 2.6 → 1.3× fair; long context at 4 pods p50/p90/p99
//! −7 to −14 %; shared prefix, the trace workload, approximate mode and
//! both shared traces unchanged. It loses long context at 8 pods (p50
//! 610 → 868 ms, 96.7 → 93.4 % of the bound), where a head's copy fills
//! most of a pod's cache and evicts the sessions' histories: the rule
//! prices a copy's prefill, not its cache, which the pods do not report.
//! Real Envoy: multi-turn p90 49–57 → 40–45 ms, p99 127–132 → 83–94.
//! Scoring the candidate set rather than the pool is what keeps the
//! Mooncake trace at 1,024 pods unchanged (97.9 % of the bound; with the
//! pool's size, 85.6 %: a prefix's few starts read as a share of 1,024
//! pods asked for copies the load never needed).

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
