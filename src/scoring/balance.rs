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
//! copy(pod) = uncached(pod) − min over the candidates of uncached
//! ρ         = busy(pod), the share of decisions that found prefill queued there
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
//! How the copy is counted, measured with `kvroute-replay` side by side
//! (integration/results/costmodel.md): on the Azure conversation trace at
//! half its physical limit, not counting it kept 90 % of the pooled bound
//! (TTFT p90 2.8 s), counting it in full 95 % (1.4 s), weighted by `ρ`
//! 94 % (1.4 s), by `ρ/(1 − ρ)` 97 % (0.91 s, p99 2.6 s, against ring
//! hash's 1.8 s and 7.0 s); on the benchmark's multi-turn shape, where an
//! idle pool gains by copying the shared system prompt, 87 % with the
//! full copy, 96 % with either weight.
//!
//! Requests leaving the gateway's wait queue are not balanced (see
//! [`crate::router::Attempt`]): they take a pod only once it drained below
//! `maxQueue`, so the queue balances already.

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

/// Which candidates lose their cache term for a decision.
pub trait Balance: std::fmt::Debug + Send + Sync {
    fn name(&self) -> &'static str;
    /// Per candidate, `true` when it must not keep its cache term, given
    /// each candidate's predictions (`predicted_ttft_ms`,
    /// `prefill_ms_per_token`, `busy`) and the model's relative `error`.
    fn withhold(&self, candidates: &[Candidate<'_>], error: f64) -> Vec<bool>;
}

/// See the module documentation.
#[derive(Debug, Clone, Copy, Default)]
pub struct FastestWithinError;

impl Balance for FastestWithinError {
    fn name(&self) -> &'static str {
        "fastestWithinError"
    }

    fn withhold(&self, candidates: &[Candidate<'_>], error: f64) -> Vec<bool> {
        let least_uncached = candidates
            .iter()
            .map(|c| c.uncached_tokens)
            .min()
            .unwrap_or(0);
        let cost = |c: &Candidate<'_>| {
            let copy = c.uncached_tokens.saturating_sub(least_uncached) as f64;
            c.predicted_ttft_ms + requests_delayed(c.busy) * copy * c.prefill_ms_per_token
        };
        let cheapest = candidates.iter().map(cost).fold(f64::INFINITY, f64::min);
        candidates
            .iter()
            .map(|c| c.cache_match > 0.0 && TtftModel::clearly_faster(cheapest, cost(c), error))
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
            slot,
            id: "p",
            cache_match: cached as f64 / 10_000.0,
            cached_tokens: cached,
            uncached_tokens: uncached,
            streams: 0,
            queued_prefill: queued,
            predicted_ttft_ms: 10.0 + 0.1 * (queued + uncached) as f64,
            prefill_ms_per_token: 0.1,
            queued_ms_per_token: 0.1,
            busy,
            load: 0.0,
            queue: 0,
            health: 1.0,
            adapter_loaded: true,
            attributes: &NONE,
        }
    }

    #[test]
    fn the_cache_yields_only_to_a_clearly_cheaper_pod() {
        let balance = FastestWithinError;
        // Cached pod: 10 + 0.1 × (20,000 + 1,000) = 2,110 ms; idle pod:
        // 10 + 1,000 = 1,010 ms plus its copy (9,000 tokens, 900 ms) for
        // each request it delays, ρ/(1 − ρ): none when idle.
        let idle_pool = [pod(0, 9_000, 20_000, 1.0), pod(1, 0, 0, 0.0)];
        assert_eq!(balance.withhold(&idle_pool, 0.1), [true, false]);
        // Busy half the time, one request delayed: 1,910 against 2,110
        // is within a 10 % error, and the cache stays.
        let busy_pool = [pod(0, 9_000, 20_000, 1.0), pod(1, 0, 0, 0.5)];
        assert_eq!(balance.withhold(&busy_pool, 0.1), [false, false]);
        // With no error it moves.
        assert_eq!(balance.withhold(&busy_pool, 0.0), [true, false]);
        // A saturated pod never takes the copy.
        let saturated = [pod(0, 9_000, 20_000, 1.0), pod(1, 0, 0, 1.0)];
        assert_eq!(balance.withhold(&saturated, 0.0), [false, false]);
        // A short queue: the cache pod is the fastest.
        let short = [pod(0, 9_000, 2_000, 1.0), pod(1, 0, 0, 0.0)];
        assert_eq!(balance.withhold(&short, 0.1), [false, false]);
        // A model whose error is 100 % trusts no difference.
        assert_eq!(balance.withhold(&idle_pool, 1.0), [false, false]);
        assert!(balance.withhold(&[], 0.1).is_empty());
    }
}
