//! The five built-in factors of the composite score, each in [0, 1]:
//! cache match ratio, `1 − load`, `1 − min(queue / maxQueue, 1)`, health,
//! and adapter loaded (1 when the request needs no adapter, so requests
//! for a base model are not biased).

use super::{Candidate, DecisionContext, Scorer};

/// `cacheMatchRatio`: consecutive cached blocks / blocks in the request.
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
