//! The five built-in factors of the composite score, each in [0, 1]:
//! cache match ratio, `1 − load`, `1 − min(queue / maxQueue, 1)`, health,
//! and adapter loaded (1 when the request needs no adapter, so requests
//! for a base model are not biased).
//!
//! The cache match credits each matched block by the tier the pod holds
//! it in ([`CachedPrefix`], `tierCredits`): a GPU block its share of the
//! prompt, a CPU or disk block that share times its credit.

use super::{Candidate, DecisionContext, Scorer};
use crate::config::TierCredits;
use crate::hashing::Coverage;
use crate::index::TierBlocks;
use crate::report::Tier;

/// A pod's cached prefix of a prompt, credited by tier.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CachedPrefix {
    /// `Σ credit(tier) × share of the prompt its blocks cover`, in [0, 1]:
    /// the cache factor.
    pub cache_match: f64,
    /// Prompt tokens cached in any tier: what the pod does not prefill.
    pub cached_tokens: u64,
    /// The reload of the tokens cached outside GPU memory, in prefill
    /// tokens: `Σ (1 − credit(tier)) × tokens` (a credit is `1 − r`, `r`
    /// the reload's time over the prefill's, docs/tiers.md). The
    /// predicted TTFT adds it to the pod's work.
    pub reload_tokens: u64,
}

impl CachedPrefix {
    /// The prefix of `matched` blocks (by tier, GPU first: the blocks
    /// leave the GPU tail first) of a prompt `coverage` describes.
    pub fn of(coverage: &Coverage, matched: TierBlocks, credits: &TierCredits) -> CachedPrefix {
        if matched.gpu == matched.total() {
            return CachedPrefix {
                cache_match: coverage.fraction(matched.gpu),
                cached_tokens: coverage.tokens(matched.gpu),
                reload_tokens: 0,
            };
        }
        let mut cache_match = 0.0;
        let mut reload = 0.0;
        let mut start = 0;
        for tier in Tier::ALL {
            let end = start + matched.of(tier);
            let credit = credits.of(tier);
            cache_match += credit * (coverage.fraction(end) - coverage.fraction(start));
            reload +=
                (1.0 - credit) * coverage.tokens(end).saturating_sub(coverage.tokens(start)) as f64;
            start = end;
        }
        CachedPrefix {
            cache_match: cache_match.clamp(0.0, 1.0),
            cached_tokens: coverage.tokens(start),
            reload_tokens: reload.round() as u64,
        }
    }
}

/// `cacheMatchRatio`: the prompt's consecutive cached blocks, credited by
/// tier ([`CachedPrefix`]), over the whole prompt.
#[derive(Debug)]
pub struct CacheScorer {
    pub weight: f64,
}

impl Scorer for CacheScorer {
    fn name(&self) -> &str {
        "cache"
    }
    fn weight(&self) -> f64 {
        self.weight
    }
    fn score(&self, candidate: &Candidate<'_>, _: &DecisionContext<'_>) -> f64 {
        candidate.cache_match
    }
}

/// `1 − load`.
#[derive(Debug)]
pub struct LoadScorer {
    pub weight: f64,
}

impl Scorer for LoadScorer {
    fn name(&self) -> &str {
        "load"
    }
    fn weight(&self) -> f64 {
        self.weight
    }
    fn score(&self, candidate: &Candidate<'_>, _: &DecisionContext<'_>) -> f64 {
        1.0 - candidate.load
    }
}

/// `1 − min(queue / maxQueue, 1)`.
pub fn queue_score(queue: u32, max_queue: u32) -> f64 {
    1.0 - (f64::from(queue) / f64::from(max_queue.max(1))).min(1.0)
}

#[derive(Debug)]
pub struct QueueScorer {
    pub weight: f64,
    pub max_queue: u32,
}

impl Scorer for QueueScorer {
    fn name(&self) -> &str {
        "queue"
    }
    fn weight(&self) -> f64 {
        self.weight
    }
    fn score(&self, candidate: &Candidate<'_>, _: &DecisionContext<'_>) -> f64 {
        queue_score(candidate.queue, self.max_queue)
    }
}

/// The pod's reported health, decayed by report staleness.
#[derive(Debug)]
pub struct HealthScorer {
    pub weight: f64,
}

impl Scorer for HealthScorer {
    fn name(&self) -> &str {
        "health"
    }
    fn weight(&self) -> f64 {
        self.weight
    }
    fn score(&self, candidate: &Candidate<'_>, _: &DecisionContext<'_>) -> f64 {
        candidate.health
    }
}

/// 1 when the adapter the request needs is loaded (or none is needed).
#[derive(Debug)]
pub struct AdapterScorer {
    pub weight: f64,
}

impl Scorer for AdapterScorer {
    fn name(&self) -> &str {
        "adapter"
    }
    fn weight(&self) -> f64 {
        self.weight
    }
    fn score(&self, candidate: &Candidate<'_>, context: &DecisionContext<'_>) -> f64 {
        if !context.needs_adapter || candidate.adapter_loaded {
            1.0
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::hashing::BlockHasher;
    use crate::request::Prompt;

    #[test]
    fn a_cached_prefix_is_credited_and_reloaded_by_tier() {
        // 100 blocks of 16 tokens; 60 cached: 20 GPU, 30 CPU, 10 disk.
        let coverage =
            BlockHasher::from_config(&Config::default()).coverage(&Prompt::Tokens(vec![7; 1600]));
        let matched = TierBlocks {
            gpu: 20,
            cpu: 30,
            disk: 10,
        };
        let prefix = CachedPrefix::of(&coverage, matched, &TierCredits::default());
        assert!((prefix.cache_match - (0.2 + 0.9 * 0.3 + 0.5 * 0.1)).abs() < 1e-9);
        assert_eq!(prefix.cached_tokens, 960);
        // A tenth of 480 CPU tokens and half of 160 disk tokens.
        assert_eq!(prefix.reload_tokens, 48 + 80);
        let blind = CachedPrefix::of(&coverage, matched, &TierCredits::BLIND);
        assert!((blind.cache_match - 0.6).abs() < 1e-9);
        assert_eq!(blind.reload_tokens, 0);
        let none = CachedPrefix::of(&coverage, TierBlocks::default(), &TierCredits::default());
        assert_eq!(
            (none.cache_match, none.cached_tokens, none.reload_tokens),
            (0.0, 0, 0)
        );
    }
}
