//! Balance: when the cache term yields to load, decided by predicted TTFT.
//!
//! Affinity alone concentrates: conversations sharing a system prompt all
//! match the first pod that cached it, and a pod holding a long history
//! keeps it while other sessions' prefills pile up in front of it. The
//! cache is worth keeping only while the pod caching it still answers
//! sooner than a pod that must prefill the prompt again. So before
//! scoring, every candidate gets its predicted TTFT ([`super::ttft`]:
//! queued prefill ahead plus its own uncached tokens, over the pod's
//! learned rate, plus overhead; a miss's re-prefill is in its own uncached
//! tokens), and a [`Balance`] policy says which candidates lose their cache
//! term for this decision. The five-factor score then decides as the seed
//! designed it: a pod that lost its cache term competes on load, queue,
//! health and adapter only.
//!
//! [`FastestWithinError`] (the default) compares, per candidate,
//!
//! ```text
//! cost(pod) = ttft(pod) + ρ/(1 − ρ) × copy(pod) × time_per_token(pod)
//!                       + evicted(pod) × reuse(pod) × time_per_token(pod) / (1 − ρ)
//! copy(pod)    = uncached(pod) − min over the candidates of uncached
//! evicted(pod) = max(0, uncached(pod) − free(pod))
//! ρ            = busy(pod), the share of decisions that found prefill queued there
//! ```
//!
//! the request's own predicted TTFT plus what the prompt's copy costs the
//! requests after it: its extra prefill (the tokens the best-cached pod
//! would not prefill) delays every request in the pod's system while it
//! runs, `ρ/(1 − ρ)` of them on average (an M/M/1 queue's mean number in
//! the system; arrivals see time averages, so the decisions' share is the
//! pod's busy share). An idle pool copies freely, a busy pod keeps its
//! caches, a saturated one never takes a copy. A pod loses its cache term
//! when another pod's cost is lower by more than the model's own error
//! ([`TtftModel::clearly_faster`]). A pod that keeps it is never clearly
//! worse than the best, so the cache decides among pods that answer alike,
//! and load decides where the cache would only make the request wait.
//! What each earlier guard did falls out of the one test: a burst on a pod
//! that cached a shared prompt leaves it once that pod's queued prefill
//! outgrows a copy of the prompt (the in-flight lead); a long history,
//! whose copy is long, stays where it is (the share guard's
//! `spillTokens`); a new long session leaves a pod busy prefilling others'
//! long turns (the prefill guard). No threshold: the margin is the measured
//! error, the rate and the busy share are learned. O(pods).
//!
//! **Cache room.** A prompt stored on a pod whose cache is full pushes
//! out as many blocks as it adds beyond the free room (`free`: the pod's
//! reported capacity less its reported resident blocks, less the prefill
//! queued there, which will be stored first). Each evicted block that is
//! needed again is prefilled again on that pod: its requester waits for
//! it, and `ρ/(1 − ρ)` others wait behind it, so `1/(1 − ρ)` requests in
//! all. The chance it is needed again, `reuse`, is the pod's measured
//! share of its recent evictions that came back
//! ([`crate::index::ghosts`]): a pod evicting stale blocks costs nothing
//! to fill, a pod thrashing its sessions' histories costs their
//! re-prefill. Only pods whose reports state their use are priced (the
//! bridge and kvroute-sim send it); for pods routed on decisions the room
//! would be kvroute's own guess ([`crate::cluster`]).
//!
//! **Among the pods caching none of the prompt** the same cost decides
//! which may take it: one whose cost is clearly above the cheapest of
//! them (beyond the same error) is *outpaced* and not chosen; the five
//! factors decide among the rest, and a pod caching any of the prompt is
//! never outpaced. The seed's load and queue factors see neither a pod's
//! speed nor the prefill queued behind it.
//!
//! **Requests past the gateway's wait** (`onWaitLimit: "route"`) are
//! balanced too; requests leaving the wait queue for room are not (they
//! take a pod only once it drained below `maxQueue`, see
//! [`crate::router::Attempt`]).
//!
//! Measured reasons, side by side with the alternatives
//! (integration/results/costmodel.md):
//! - the copy weighted by `ρ/(1 − ρ)`: 97 % of the pooled bound on the
//!   Azure trace at half its physical limit, against 90 % not counting
//!   it and 95 % counting it in full ("Both shared traces");
//! - outpacing: the fast pods of a mixed pool did 83–85 % of the
//!   prefill instead of 56–60 %, at a cost of request concentration
//!   ("A prompt cached nowhere");
//! - balancing past the wait's limit: 96 → 100 % of the bound on the
//!   Mooncake trace at 0.9× its limit, p99 382 → 227 s ("Past the
//!   limits, balanced");
//! - cache room priced: agentic at 8 pods 96.0 → 96.7 % of the bound
//!   (p90 179 → 157 ms), the mixed pool's trace 95.6 → 99.0 % and
//!   multi-turn 96.6 → 97.9 %, six-seed medians; the steps back are
//!   tails (the trace at 4 pods p99 410 → 439 ms, its p90 210 → 194);
//!   `1/(1 − ρ)` against 1 re-prefill per reused eviction: 96.7 against
//!   96.3 % on agentic-8 ("Cache room priced").

use super::ttft::TtftModel;
use super::Candidate;

/// How many requests a unit of prefill added to a pod delays, on average,
/// when a share `busy` of arrivals finds it prefilling: an M/M/1 queue's
/// mean number in the system, `ρ / (1 − ρ)` (each of them waits for the
/// added work; a saturated pod, `ρ → 1`, delays without bound).
fn requests_delayed(busy: f64) -> f64 {
    let busy = busy.clamp(0.0, 1.0);
    busy / (1.0 - busy).max(1e-3)
}

/// The prefill that the request's placement on the pod makes the pod do
/// again later: its uncached tokens beyond the cache's free room evict as
/// many, of which a share `reuse_share` comes back, each re-prefilled at
/// the pod's rate, delaying its own request and `ρ/(1 − ρ)` others.
fn eviction_ms(c: &Candidate<'_>) -> f64 {
    let evicted = c.evicted_tokens() as f64;
    evicted * c.reuse_share * c.prefill_ms_per_token * (1.0 + requests_delayed(c.busy))
}

/// What the balance decides about one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Verdict {
    /// It must not keep its cache term.
    pub cache_withheld: bool,
    /// It caches none of the prompt and another pod caching none is
    /// clearly cheaper: it may not take the request.
    pub outpaced: bool,
}

/// Which candidates lose their cache term for a decision, and which may
/// not take it at all.
pub trait Balance: std::fmt::Debug + Send + Sync {
    fn name(&self) -> &'static str;
    /// One verdict per candidate, given each candidate's predictions
    /// (`predicted_ttft_ms`, `prefill_ms_per_token`, `busy`) and the
    /// model's relative `error`.
    fn judge(&self, candidates: &[Candidate<'_>], error: f64) -> Vec<Verdict>;
}

/// See the module documentation.
#[derive(Debug, Clone, Copy, Default)]
pub struct FastestWithinError;

impl Balance for FastestWithinError {
    fn name(&self) -> &'static str {
        "fastestWithinError"
    }

    fn judge(&self, candidates: &[Candidate<'_>], error: f64) -> Vec<Verdict> {
        let least_uncached = candidates
            .iter()
            .map(|c| c.uncached_tokens)
            .min()
            .unwrap_or(0);
        let costs: Vec<f64> = candidates
            .iter()
            .map(|c| {
                let copy = c.uncached_tokens.saturating_sub(least_uncached) as f64;
                c.predicted_ttft_ms
                    + requests_delayed(c.busy) * copy * c.prefill_ms_per_token
                    + eviction_ms(c)
            })
            .collect();
        let cheapest = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let cheapest_caching_none = candidates
            .iter()
            .zip(&costs)
            .filter(|(c, _)| c.cache_match <= 0.0)
            .map(|(_, &cost)| cost)
            .fold(f64::INFINITY, f64::min);
        candidates
            .iter()
            .zip(costs)
            .map(|(c, cost)| {
                if c.cache_match > 0.0 {
                    Verdict {
                        cache_withheld: TtftModel::clearly_faster(cheapest, cost, error),
                        outpaced: false,
                    }
                } else {
                    Verdict {
                        cache_withheld: false,
                        outpaced: TtftModel::clearly_faster(cheapest_caching_none, cost, error),
                    }
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    static NONE: BTreeMap<String, f64> = BTreeMap::new();

    /// A pod with `cached` of a 10,000-token prompt, `queued` tokens ahead,
    /// 0.1 ms a token, 10 ms overhead, busy `busy` of the time.
    fn pod(slot: usize, cached: u64, queued: u64, busy: f64) -> Candidate<'static> {
        let uncached = 10_000 - cached;
        Candidate {
            cache_match: cached as f64 / 10_000.0,
            cached_tokens: cached,
            uncached_tokens: uncached,
            queued_prefill: queued,
            predicted_ttft_ms: 10.0 + 0.1 * (queued + uncached) as f64,
            prefill_ms_per_token: 0.1,
            queued_ms_per_token: 0.1,
            busy,
            adapter_loaded: true,
            ..Candidate::idle(slot, "p", &NONE)
        }
    }

    fn withheld(balance: &FastestWithinError, pool: &[Candidate<'_>], error: f64) -> Vec<bool> {
        let verdicts = balance.judge(pool, error);
        verdicts.iter().map(|v| v.cache_withheld).collect()
    }

    fn outpaced(balance: &FastestWithinError, pool: &[Candidate<'_>], error: f64) -> Vec<bool> {
        let verdicts = balance.judge(pool, error);
        verdicts.iter().map(|v| v.outpaced).collect()
    }

    #[test]
    fn a_prompt_cached_nowhere_goes_to_a_pod_that_answers_it_soonest() {
        let balance = FastestWithinError;
        // Three pods without the prompt: 1,010 ms idle, 1,110 ms behind
        // 1,000 tokens (within a 10 % error), 3,010 ms behind 20,000.
        let cold = [
            pod(0, 0, 0, 0.5),
            pod(1, 0, 1_000, 0.5),
            pod(2, 0, 20_000, 0.5),
        ];
        assert_eq!(outpaced(&balance, &cold, 0.1), [false, false, true]);
        // A half-speed pod (0.2 ms a token) is outpaced by an idle one.
        let mut slow = pod(1, 0, 0, 0.5);
        slow.prefill_ms_per_token = 0.2;
        slow.predicted_ttft_ms = 10.0 + 0.2 * 10_000.0;
        assert_eq!(
            outpaced(&balance, &[pod(0, 0, 0, 0.5), slow], 0.1),
            [false, true]
        );
        // A pod caching part of the prompt is never outpaced, its cache
        // term withheld or not: the five factors weigh it as before.
        let idle_pool = [pod(0, 9_000, 20_000, 1.0), pod(1, 0, 0, 0.0)];
        assert_eq!(withheld(&balance, &idle_pool, 0.1), [true, false]);
        assert_eq!(outpaced(&balance, &idle_pool, 0.1), [false, false]);
        let short = [
            pod(0, 9_000, 2_000, 1.0),
            pod(1, 0, 0, 0.0),
            pod(2, 0, 20_000, 0.0),
        ];
        assert_eq!(outpaced(&balance, &short, 0.1), [false, false, true]);
        // A model whose error is 100 % trusts no difference.
        assert_eq!(outpaced(&balance, &cold, 1.0), [false, false, false]);
    }

    #[test]
    fn a_placement_pays_for_the_reused_blocks_it_evicts() {
        let balance = FastestWithinError;
        // Two pods caching none of a 10,000-token prompt, idle, 1,010 ms.
        // Pod 0's cache is full and brings back 90 % of what it evicts:
        // its 10,000 tokens would cost 900 ms again. Pod 1 has room.
        let mut full = pod(0, 0, 0, 0.0);
        (full.free_tokens, full.reuse_share) = (Some(0), 0.9);
        let mut roomy = pod(1, 0, 0, 0.0);
        roomy.free_tokens = Some(20_000);
        assert_eq!(
            outpaced(&balance, &[full.clone(), roomy.clone()], 0.1),
            [true, false]
        );
        // Evictions nobody needs again cost nothing.
        full.reuse_share = 0.0;
        assert_eq!(
            outpaced(&balance, &[full.clone(), roomy.clone()], 0.1),
            [false, false]
        );
        // A pod whose size is unknown is not priced.
        full.free_tokens = None;
        full.reuse_share = 1.0;
        assert_eq!(outpaced(&balance, &[full, roomy], 0.1), [false, false]);
        // The cache holder keeps its term while its own small prefill
        // evicts little; a pod with room loses to it no more than before.
        let mut holder = pod(0, 9_000, 0, 0.5);
        (holder.free_tokens, holder.reuse_share) = (Some(0), 0.9);
        let mut cold = pod(1, 0, 0, 0.5);
        cold.free_tokens = Some(0);
        cold.reuse_share = 0.9;
        // 1,000 tokens evicted on the holder (90 + 90 ms with ρ = ½),
        // 10,000 on the cold pod: the cold pod is outpaced by nobody
        // (no other pod caches none), the holder keeps its cache.
        assert_eq!(withheld(&balance, &[holder, cold], 0.1), [false, false]);
    }

    #[test]
    fn the_cache_yields_only_to_a_clearly_cheaper_pod() {
        let balance = FastestWithinError;
        // Cached pod: 10 + 0.1 × (20,000 + 1,000) = 2,110 ms; idle pod:
        // 10 + 1,000 = 1,010 ms plus its copy (9,000 tokens, 900 ms) for
        // each request it delays, ρ/(1 − ρ): none when idle.
        let idle_pool = [pod(0, 9_000, 20_000, 1.0), pod(1, 0, 0, 0.0)];
        assert_eq!(withheld(&balance, &idle_pool, 0.1), [true, false]);
        // Busy half the time, one request delayed: 1,910 against 2,110
        // is within a 10 % error, and the cache stays.
        let busy_pool = [pod(0, 9_000, 20_000, 1.0), pod(1, 0, 0, 0.5)];
        assert_eq!(withheld(&balance, &busy_pool, 0.1), [false, false]);
        // With no error it moves.
        assert_eq!(withheld(&balance, &busy_pool, 0.0), [true, false]);
        // A saturated pod never takes the copy.
        let saturated = [pod(0, 9_000, 20_000, 1.0), pod(1, 0, 0, 1.0)];
        assert_eq!(withheld(&balance, &saturated, 0.0), [false, false]);
        // A short queue: the cache pod is the fastest.
        let short = [pod(0, 9_000, 2_000, 1.0), pod(1, 0, 0, 0.0)];
        assert_eq!(withheld(&balance, &short, 0.1), [false, false]);
        // A model whose error is 100 % trusts no difference.
        assert_eq!(withheld(&balance, &idle_pool, 1.0), [false, false]);
        assert!(withheld(&balance, &[], 0.1).is_empty());
    }
}
