//! Attribute scorer: prefers pods by a numeric attribute from the pod list
//! (e.g. `costPerHour`, lower is better).
//!
//! Among the candidates that carry the attribute and, when
//! `cacheMatchWindow = w` is set, whose cache match is within `w` of the best
//! candidate's, the value is min-max normalised: the preferred end scores 1,
//! the other end 0, all equal → 1. Everyone else scores 0. With the window,
//! a cheap pod wins only when it gives up little cache: "prefer the cheap pod
//! when its cache match is within 20 points of the best" is
//! `{"attribute": "costPerHour", "prefer": "lower", "cacheMatchWindow": 0.2}`.

use super::{Candidate, DecisionContext, Scorer};
use crate::config::{AttributeScorerConfig, Preference};

#[derive(Debug)]
pub struct AttributeScorer {
    name: String,
    weight: f64,
    attribute: String,
    prefer: Preference,
    cache_match_window: Option<f64>,
}

impl AttributeScorer {
    pub fn from_config(config: &AttributeScorerConfig) -> AttributeScorer {
        AttributeScorer {
            name: config.name.clone(),
            weight: config.weight,
            attribute: config.attribute.clone(),
            prefer: config.prefer,
            cache_match_window: config.cache_match_window,
        }
    }

    fn in_window(&self, candidate: &Candidate<'_>, context: &DecisionContext<'_>) -> bool {
        self.cache_match_window
            .is_none_or(|w| context.best_cache_match - candidate.cache_match <= w + 1e-9)
    }

    fn value(&self, candidate: &Candidate<'_>, context: &DecisionContext<'_>) -> Option<f64> {
        if !self.in_window(candidate, context) {
            return None;
        }
        candidate
            .attributes
            .get(&self.attribute)
            .copied()
            .filter(|v| v.is_finite())
    }
}

impl Scorer for AttributeScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn weight(&self) -> f64 {
        self.weight
    }

    fn score(&self, candidate: &Candidate<'_>, context: &DecisionContext<'_>) -> f64 {
        let Some(value) = self.value(candidate, context) else {
            return 0.0;
        };
        let (min, max) = context
            .candidates
            .iter()
            .filter_map(|c| self.value(c, context))
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            });
        if max - min < 1e-12 {
            return 1.0;
        }
        match self.prefer {
            Preference::Lower => (max - value) / (max - min),
            Preference::Higher => (value - min) / (max - min),
        }
    }
}
