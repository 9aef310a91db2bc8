//! SLO mode: a time-to-first-token target per model (`balance.ttftTargetMs`)
//! or per request (`x-kvroute-ttft-target-ms`).
//!
//! Among the pods predicted ([`super::ttft`]) to answer within the target,
//! the one cheapest for the cluster: the fewest uncached prompt tokens, the
//! least new prefill work (ties: the higher composite). A request no pod
//! can serve in time waits in the gateway's queue for one (it *holds out*,
//! [`crate::queueing`]), as long as waiting can still help: once even an
//! empty queue on the best pod (its overhead and the request's own
//! prefill) would miss the target, counted from its first refusal, it goes
//! to the pod predicted soonest. So a request is never dropped for its
//! target, and waits at most about the target. Before the model has any
//! answer its predictions are in tokens, not ms: the target is not
//! applied. O(pods scored).

use super::{Candidate, Decision, Pool, ScoredPod};

/// What SLO mode makes of a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SloChoice {
    /// Route to this candidate.
    Route(usize),
    /// No pod is predicted in time yet; waiting can still help: hold out
    /// for this candidate, predicted soonest.
    Wait(usize),
}

/// See the module documentation, over the pods `decision` scored (pool
/// indexes into `pool`). `waited_ms`: how long the request has already
/// held out for its target. `None` when every pod was excluded.
pub fn place<'a, P: Pool<'a> + ?Sized>(
    decision: &Decision,
    pool: &P,
    target_ms: f64,
    waited_ms: f64,
) -> Option<SloChoice> {
    let scored: Vec<(&ScoredPod, Candidate<'a>)> = decision
        .scored
        .iter()
        .map(|s| (s, pool.candidate(s.index)))
        .collect();
    let in_time = scored
        .iter()
        .filter(|(s, _)| waited_ms + s.predicted_ttft_ms <= target_ms)
        .min_by(|(a, ca), (b, cb)| {
            ca.uncached_tokens
                .cmp(&cb.uncached_tokens)
                .then(b.composite.total_cmp(&a.composite))
        });
    if let Some((s, _)) = in_time {
        return Some(SloChoice::Route(s.index));
    }
    let (soonest, _) = scored
        .iter()
        .min_by(|(a, _), (b, _)| a.predicted_ttft_ms.total_cmp(&b.predicted_ttft_ms))?;
    // The best any pod could do once its queue drained.
    let unqueued = scored
        .iter()
        .map(|(s, c)| s.predicted_ttft_ms - c.queued_prefill as f64 * c.queued_ms_per_token)
        .fold(f64::INFINITY, f64::min);
    Some(if waited_ms + unqueued > target_ms {
        SloChoice::Route(soonest.index)
    } else {
        SloChoice::Wait(soonest.index)
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    static NONE: BTreeMap<String, f64> = BTreeMap::new();

    /// A 4,000-token prompt with `cached` of it and `queued` tokens ahead,
    /// at 0.1 ms a token plus 10 ms.
    fn pod(slot: usize, cached: u64, queued: u64) -> (Candidate<'static>, ScoredPod) {
        let uncached = 4_000 - cached;
        let predicted = 10.0 + 0.1 * (queued + uncached) as f64;
        let candidate = Candidate {
            cache_match: cached as f64 / 4_000.0,
            cached_tokens: cached,
            uncached_tokens: uncached,
            queued_prefill: queued,
            predicted_ttft_ms: predicted,
            prefill_ms_per_token: 0.1,
            queued_ms_per_token: 0.1,
            adapter_loaded: true,
            ..Candidate::idle(slot, "p", &NONE)
        };
        let scored = ScoredPod {
            index: slot,
            factors: Vec::new(),
            composite: 0.5 + cached as f64 / 10_000.0,
            predicted_ttft_ms: predicted,
            cache_withheld: false,
            outpaced: false,
        };
        (candidate, scored)
    }

    fn decide(pods: &[(Candidate<'static>, ScoredPod)]) -> (Vec<Candidate<'static>>, Decision) {
        let decision = Decision {
            chosen: Some(0),
            scored: pods.iter().map(|(_, s)| s.clone()).collect(),
            excluded: Vec::new(),
            spread: false,
        };
        (pods.iter().map(|(c, _)| c.clone()).collect(), decision)
    }

    #[test]
    fn the_cheapest_pod_in_time_the_soonest_when_waiting_cannot_help() {
        // 0: all cached, 3,000 queued (310 ms); 1: half cached, idle
        // (210 ms); 2: nothing cached, idle (410 ms).
        let (candidates, decision) =
            decide(&[pod(0, 4_000, 3_000), pod(1, 2_000, 0), pod(2, 0, 0)]);
        // 350 ms: pods 0 and 1 are in time, 0 prefills nothing.
        assert_eq!(
            place(&decision, &candidates, 350.0, 0.0),
            Some(SloChoice::Route(0))
        );
        // 250 ms: only pod 1.
        assert_eq!(
            place(&decision, &candidates, 250.0, 0.0),
            Some(SloChoice::Route(1))
        );
        // 150 ms: none now, but pod 0 once drained (10 ms): wait for the
        // soonest, pod 1.
        assert_eq!(
            place(&decision, &candidates, 150.0, 0.0),
            Some(SloChoice::Wait(1))
        );
        // Having held out 145 ms, not even a drained pod is in time: go.
        assert_eq!(
            place(&decision, &candidates, 150.0, 145.0),
            Some(SloChoice::Route(1))
        );
        let empty = Decision {
            chosen: None,
            scored: Vec::new(),
            excluded: Vec::new(),
            spread: false,
        };
        assert_eq!(place(&empty, &[][..], 150.0, 0.0), None);
    }
}
