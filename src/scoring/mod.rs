//! Scoring: pick one pod for a request.
//!
//! Every pod that is not excluded gets a composite score
//!
//! ```text
//! composite = Σ weight_s · score_s(pod)      each score_s ∈ [0, 1], Σ weight_s = 1
//! default:    0.60·cache + 0.20·(1−load) + 0.10·(1−min(queue/maxQueue, 1))
//!           + 0.05·health + 0.05·adapterLoaded
//! ```
//!
//! Exclusions: `health < healthExclusionThreshold` (default 0.3) or
//! `queue ≥ maxQueue` (default 20). Among the others, a pod predicted to
//! answer clearly later than another ([`ttft`], [`balance`]) loses its
//! cache match for the decision (not for a request leaving the gateway's
//! wait queue, see [`crate::router::Attempt`]). The highest composite wins; exact ties
//! (within 1e-9) go to the higher load score, then the higher queue score,
//! then the fewer streams open (requests routed there whose answer has not
//! ended), then rotate by a caller-supplied tie breaker so equal pods share
//! traffic evenly. With no cache anywhere the cache term is 0 for all and
//! the load and queue terms decide: a cold start goes to the least-loaded
//! pod. In approximate mode no report carries a load and a request leaves
//! the queue at its first byte, so fresh pods tie on both and the streams
//! decide (measured below, [`PickOrder`]). A copy [`spread`] buys goes to
//! the pod that carried the fewest streams over recent decisions first,
//! the composite deciding only among those alike.
//!
//! Each factor is a [`Scorer`] (one per file: [`factors`], [`attribute`]);
//! compiled-in scorers implement the same trait. Which pods are scored is
//! [`candidates`]' choice: every pod of a pool of up to
//! `candidates.exactUpTo` (64), else a set of bounded size (the longest
//! holders, the adapter holders, power-of-d draws) with the exclusions
//! exact. Cost: O(candidates × scorers), candidates ≤ 64 by default.

pub mod attribute;
pub mod balance;
pub mod candidates;
pub mod factors;
pub mod feed;
pub mod occupancy;
pub mod slo;
pub mod spread;
pub mod ttft;

use std::collections::BTreeMap;

pub use candidates::Pool;

use crate::config::{CandidatesConfig, Config, ConfigError};
use balance::Verdict;

const TIE_EPSILON: f64 = 1e-9;

/// What the router knows of one pod when deciding.
#[derive(Debug, Clone)]
pub struct Candidate<'a> {
    /// Pod slot (index in the pod table).
    pub slot: usize,
    pub id: &'a str,
    /// Consecutive matched blocks / blocks in the request, in [0, 1].
    pub cache_match: f64,
    /// Prompt tokens those blocks cover.
    pub cached_tokens: u64,
    /// The rest of the prompt's tokens: what the pod would prefill.
    pub uncached_tokens: u64,
    /// Requests routed to the pod whose stream has not ended, answering
    /// or not (all workers and replicas): what the pod carries.
    pub streams: u32,
    /// The streams open there averaged over recent decisions: what the
    /// pod carries over time ([`occupancy::Occupancy::carried`]).
    pub carried: f64,
    /// Their prompt tokens still to prefill ([`crate::snapshot::SlotLoad`]).
    pub queued_prefill: u64,
    /// The prefill ahead of the request's first token there, its own and
    /// queued, with their attention ([`ttft::Work`]).
    pub work: ttft::Work,
    /// Time to first token predicted for the request there ([`ttft`]).
    pub predicted_ttft_ms: f64,
    /// The pod's learned prefill time per token of a request's own
    /// ([`ttft::TtftModel::estimate`]).
    pub prefill_ms_per_token: f64,
    /// Its learned time per token counted queued ahead.
    pub queued_ms_per_token: f64,
    /// The chance a request arriving at the pod finds prefill queued
    /// ([`occupancy::Occupancy::busy`]).
    pub busy: f64,
    /// Utilisation in [0, 1].
    pub load: f64,
    /// Requests waiting (reported plus routed since the report).
    pub queue: u32,
    /// Health in [0, 1].
    pub health: f64,
    /// The request's LoRA adapter is loaded on the pod.
    pub adapter_loaded: bool,
    pub attributes: &'a BTreeMap<String, f64>,
    /// Tokens of room left in the pod's cache once its queued prefill is
    /// stored; `None` when its capacity is unknown ([`balance`]).
    pub free_tokens: Option<u64>,
    /// The chance a block the pod evicts is prefilled again
    /// ([`crate::snapshot::KvRoom::reuse_share`]).
    pub reuse_share: f64,
}

impl<'a> Candidate<'a> {
    /// Pod `slot` healthy, idle and caching nothing, before any answer
    /// (every prediction 0): the base the routing benchmark and the tests
    /// set their fields over.
    pub fn idle(slot: usize, id: &'a str, attributes: &'a BTreeMap<String, f64>) -> Candidate<'a> {
        Candidate {
            slot,
            id,
            cache_match: 0.0,
            cached_tokens: 0,
            uncached_tokens: 0,
            streams: 0,
            carried: 0.0,
            queued_prefill: 0,
            work: ttft::Work::default(),
            predicted_ttft_ms: 0.0,
            prefill_ms_per_token: 0.0,
            queued_ms_per_token: 0.0,
            busy: 0.0,
            load: 0.0,
            queue: 0,
            health: 1.0,
            adapter_loaded: false,
            attributes,
            free_tokens: None,
            reuse_share: 0.5,
        }
    }

    /// Tokens of the pod's cache a placement there evicts: its uncached
    /// tokens beyond the free room; 0 when the room is unknown.
    pub fn evicted_tokens(&self) -> u64 {
        self.free_tokens
            .map_or(0, |free| self.uncached_tokens.saturating_sub(free))
    }
}

/// Facts about the whole decision a scorer may need.
#[derive(Debug, Clone, Copy)]
pub struct DecisionContext<'a> {
    pub candidates: &'a [Candidate<'a>],
    /// The request asks for a LoRA adapter.
    pub needs_adapter: bool,
    /// Best cache match among the candidates.
    pub best_cache_match: f64,
}

/// One term of the composite score.
pub trait Scorer: std::fmt::Debug + Send + Sync {
    fn name(&self) -> &str;
    fn weight(&self) -> f64;
    /// The pod's score in [0, 1] (values outside are clamped).
    fn score(&self, candidate: &Candidate<'_>, context: &DecisionContext<'_>) -> f64;
}

/// Why a pod cannot take the request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Exclusion {
    Unhealthy { health: f64 },
    QueueFull { queue: u32 },
}

impl std::fmt::Display for Exclusion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exclusion::Unhealthy { health } => write!(f, "health {health:.2} below threshold"),
            Exclusion::QueueFull { queue } => write!(f, "queue {queue} at maxQueue"),
        }
    }
}

/// A candidate's per-scorer values and composite.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredPod {
    /// Index into the pool given to [`ScoringPolicy::decide`].
    pub index: usize,
    /// One value per scorer, in [`ScoringPolicy::scorer_names`] order.
    pub factors: Vec<f64>,
    pub composite: f64,
    /// The candidate's predicted TTFT ([`Candidate::predicted_ttft_ms`]).
    pub predicted_ttft_ms: f64,
    /// It lost its cache term to a clearly faster pod ([`balance`]).
    pub cache_withheld: bool,
    /// Caching none of the prompt, it was clearly slower than another pod
    /// caching none, and could not be chosen ([`balance`]).
    pub outpaced: bool,
}

/// A decision and its explanation, over the pods it scored (the whole
/// pool, or the candidate set of a large one).
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Pool index of the chosen pod, `None` when every pod was excluded.
    pub chosen: Option<usize>,
    pub scored: Vec<ScoredPod>,
    /// Pods of the set that cannot take requests, with the reason (every
    /// excluded pod of the pool when none can).
    pub excluded: Vec<(usize, Exclusion)>,
    /// The chosen pod did not cache the request's shared prefix, which
    /// had fewer holders than its sessions need ([`spread`]).
    pub spread: bool,
}

/// What balances one decision (arrivals only, with `balance.enabled`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Balancing {
    /// The TTFT model's relative error ([`ttft::TtftModel::error`]).
    pub error: f64,
    /// The request starts a session from a shared prefix: what its
    /// sessions ask of the pool ([`spread::PrefixDemand`]).
    pub demand: Option<spread::Demand>,
}

impl Balancing {
    /// Balanced by predicted TTFT, no prefix shared.
    pub fn with_error(error: f64) -> Balancing {
        Balancing {
            error,
            demand: None,
        }
    }
}

impl Decision {
    /// The chosen pod's scores.
    pub fn winner(&self) -> Option<&ScoredPod> {
        let chosen = self.chosen?;
        self.scored.iter().find(|s| s.index == chosen)
    }

    /// The best-scored eligible pod after the winner.
    pub fn runner_up(&self) -> Option<&ScoredPod> {
        let second = *self.ranked().get(1)?;
        self.scored.iter().find(|s| s.index == second)
    }

    /// Pool indexes to try in order: the chosen pod, then the other
    /// eligible pods scored, by composite, highest first (ties in index
    /// order).
    /// Empty when every pod was excluded.
    pub fn ranked(&self) -> Vec<usize> {
        let Some(chosen) = self.chosen else {
            return Vec::new();
        };
        let mut runners_up: Vec<&ScoredPod> =
            self.scored.iter().filter(|s| s.index != chosen).collect();
        runners_up.sort_by(|a, b| b.composite.total_cmp(&a.composite));
        std::iter::once(chosen)
            .chain(runners_up.into_iter().map(|s| s.index))
            .collect()
    }
}

/// The configured scorers, weights and exclusion rules.
#[derive(Debug)]
pub struct ScoringPolicy {
    scorers: Vec<Box<dyn Scorer>>,
    /// `None`: `balance.enabled` is false (the five factors alone).
    balance: Option<Box<dyn balance::Balance>>,
    candidates: CandidatesConfig,
    max_queue: u32,
    health_threshold: f64,
}

impl ScoringPolicy {
    /// The five built-in factors and the configured attribute scorers.
    /// Weights were validated with the configuration.
    pub fn from_config(config: &Config) -> ScoringPolicy {
        let w = &config.weights;
        let mut scorers: Vec<Box<dyn Scorer>> = vec![
            Box::new(factors::CacheScorer { weight: w.cache }),
            Box::new(factors::LoadScorer { weight: w.load }),
            Box::new(factors::QueueScorer {
                weight: w.queue,
                max_queue: config.max_queue,
            }),
            Box::new(factors::HealthScorer { weight: w.health }),
            Box::new(factors::AdapterScorer { weight: w.adapter }),
        ];
        for scorer in &config.attribute_scorers {
            scorers.push(Box::new(attribute::AttributeScorer::from_config(scorer)));
        }
        ScoringPolicy {
            scorers,
            balance: config
                .balance
                .enabled
                .then(|| Box::new(balance::FastestWithinError) as Box<dyn balance::Balance>),
            candidates: config.candidates.clone(),
            max_queue: config.max_queue,
            health_threshold: config.health_exclusion_threshold,
        }
    }

    /// A policy with compiled-in scorers; their weights must sum to 1.0.
    pub fn with_scorers(
        scorers: Vec<Box<dyn Scorer>>,
        max_queue: u32,
        health_threshold: f64,
    ) -> Result<ScoringPolicy, ConfigError> {
        let sum: f64 = scorers.iter().map(|s| s.weight()).sum();
        if (sum - 1.0).abs() > 1e-6 || scorers.iter().any(|s| !(0.0..=1.0).contains(&s.weight())) {
            return Err(ConfigError {
                field: "scorers".into(),
                rule: format!("weights must each be in [0, 1] and sum to 1.0 (got {sum:.6})"),
            });
        }
        Ok(ScoringPolicy {
            scorers,
            balance: Some(Box::new(balance::FastestWithinError)),
            candidates: CandidatesConfig::default(),
            max_queue,
            health_threshold,
        })
    }

    pub fn scorer_names(&self) -> Vec<&str> {
        self.scorers.iter().map(|s| s.name()).collect()
    }

    pub fn max_queue(&self) -> u32 {
        self.max_queue
    }

    /// Why `candidate` cannot take requests, if it cannot.
    pub fn exclusion(&self, candidate: &Candidate<'_>) -> Option<Exclusion> {
        self.exclusion_within(candidate, QueueLimit::Enforced)
    }

    fn exclusion_within(&self, candidate: &Candidate<'_>, limit: QueueLimit) -> Option<Exclusion> {
        if candidate.health.is_nan() || candidate.health < self.health_threshold {
            Some(Exclusion::Unhealthy {
                health: candidate.health,
            })
        } else if limit == QueueLimit::Enforced && candidate.queue >= self.max_queue {
            Some(Exclusion::QueueFull {
                queue: candidate.queue,
            })
        } else {
            None
        }
    }

    /// Scores the pods of `pool` ([`candidates::select`] picks which) and
    /// picks one. `tie_breaker` (any per-request varying number, e.g. a
    /// counter) spreads exact ties evenly and seeds the candidate set's
    /// draws; `balancing` applies [`balance`] and [`spread`] over the pods
    /// scored (`None`: not for this request).
    pub fn decide<'a, P: Pool<'a> + ?Sized>(
        &self,
        pool: &P,
        needs_adapter: bool,
        tie_breaker: u64,
        balancing: Option<Balancing>,
    ) -> Decision {
        self.decide_within(
            pool,
            needs_adapter,
            tie_breaker,
            balancing,
            QueueLimit::Enforced,
        )
    }

    /// [`ScoringPolicy::decide`] for a request the gateway can hold no
    /// longer (`onWaitLimit: "route"`): a pod at `maxQueue` may take it,
    /// an unhealthy one still may not.
    pub fn decide_past_max_queue<'a, P: Pool<'a> + ?Sized>(
        &self,
        pool: &P,
        needs_adapter: bool,
        tie_breaker: u64,
        balancing: Option<Balancing>,
    ) -> Decision {
        self.decide_within(
            pool,
            needs_adapter,
            tie_breaker,
            balancing,
            QueueLimit::Lifted,
        )
    }

    fn decide_within<'a, P: Pool<'a> + ?Sized>(
        &self,
        pool: &P,
        needs_adapter: bool,
        tie_breaker: u64,
        balancing: Option<Balancing>,
        limit: QueueLimit,
    ) -> Decision {
        let set = candidates::select(pool, &self.candidates, needs_adapter, tie_breaker, |c| {
            self.exclusion_within(c, limit).is_none()
        });
        let mut excluded = Vec::new();
        let mut eligible = Vec::with_capacity(set.len());
        let mut eligible_pods: Vec<Candidate<'a>> = Vec::with_capacity(set.len());
        for (index, pod) in set {
            match self.exclusion_within(&pod, limit) {
                Some(reason) => excluded.push((index, reason)),
                None => {
                    eligible.push(index);
                    eligible_pods.push(pod);
                }
            }
        }
        let balancing = balancing.filter(|_| self.balance.is_some());
        let mut verdicts = match (&self.balance, balancing) {
            (Some(balance), Some(b)) => balance.judge(&eligible_pods, b.error),
            _ => vec![Verdict::default(); eligible_pods.len()],
        };
        // A session start from a shared prefix: the pods holding it.
        let demand = balancing.and_then(|b| b.demand);
        let holds = demand.map_or_else(Vec::new, |_| spread::holding(&eligible_pods));
        if let Some(demand) = demand {
            spread::keep_holders_together(&holds, demand, &mut verdicts);
        }
        for (pod, verdict) in eligible_pods.iter_mut().zip(&verdicts) {
            if verdict.cache_withheld {
                pod.cache_match = 0.0;
            }
        }
        let context = DecisionContext {
            candidates: &eligible_pods,
            needs_adapter,
            best_cache_match: eligible_pods
                .iter()
                .map(|c| c.cache_match)
                .fold(0.0, f64::max),
        };
        let scored: Vec<ScoredPod> = eligible
            .iter()
            .zip(&eligible_pods)
            .zip(&verdicts)
            .map(|((&index, pod), verdict)| {
                let factors: Vec<f64> = self
                    .scorers
                    .iter()
                    .map(|s| unit(s.score(pod, &context)))
                    .collect();
                let composite = self
                    .scorers
                    .iter()
                    .zip(&factors)
                    .map(|(s, value)| s.weight() * value)
                    .sum::<f64>();
                ScoredPod {
                    index,
                    factors,
                    composite: unit(composite),
                    predicted_ttft_ms: pod.predicted_ttft_ms,
                    cache_withheld: verdict.cache_withheld,
                    outpaced: verdict.outpaced,
                }
            })
            .collect();
        // A session start from an under-held prefix whose holders are hot
        // goes to a pod without it ([`spread`]).
        let spread_to = demand.and_then(|demand| {
            spread::targets(
                &eligible_pods,
                &holds,
                demand,
                eligible.len() + excluded.len(),
            )
        });
        // Ties are decided on the pods' own load and queue (balance
        // changes only their cache term), then on the streams they carry;
        // a spread copy goes where fewest were carried first.
        let order: Vec<PickOrder> = eligible_pods
            .iter()
            .map(|p| PickOrder {
                carried: if spread_to.is_some() { p.carried } else { 0.0 },
                load: unit(1.0 - p.load),
                queue: factors::queue_score(p.queue, self.max_queue),
                streams: p.streams,
            })
            .collect();
        let spread_allows = |i: usize| {
            spread_to
                .as_ref()
                .is_none_or(|to| to.get(i).copied().unwrap_or(false))
        };
        // Spread's targets may all be outpaced (the cheapest pod caching
        // none of the prompt is not among them): then spread alone decides.
        let chosen = pick(&scored, &order, tie_breaker, |i| {
            spread_allows(i) && !verdicts.get(i).is_some_and(|v| v.outpaced)
        })
        .or_else(|| pick(&scored, &order, tie_breaker, spread_allows));
        Decision {
            chosen,
            scored,
            excluded,
            spread: spread_to.is_some(),
        }
    }
}

/// Whether a pod at `maxQueue` is excluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QueueLimit {
    Enforced,
    Lifted,
}

/// How [`pick`] orders the pods besides their composites.
///
/// A copy [`spread`] buys goes first to the pod that carried the fewest
/// streams over recent decisions ([`occupancy::Occupancy::carried`]): it is
/// bought for the requests that will follow it there, so what the pod
/// carries over time counts, not one report's load. Ranked by the
/// composite, the LoRA workload's top tenant (34 % of its requests) got
/// its second holder where one running sequence of 64 fewer was reported
/// at that instant (load 1/64 against 2/64): the pod already serving the
/// second and fifth tenants, which then took 35 % of the requests: 1.40–
/// 1.42× fair in 4 of 6 real-Envoy runs (`kvroute-bench workload lora`,
/// both modes); by the streams carried, 1.06–1.21× in 10 of 10, TTFT alike.
/// Every other decision leaves it at 0 for every pod: for cold starts too
/// it cost the trace workload 0.9 points of the bound (replay, 4 pods).
///
/// Then, between pods whose composites tie: their load score, their queue
/// score, the fewer streams open. In approximate mode no report carries a
/// load and a request leaves the queue at its first byte, so fresh pods
/// tie on both, and only the streams tell the pod carrying eight answers
/// from an idle one: with them spread's copies and cold starts go where
/// least is carried (agentic at 8 pods, approximate, TTFT p50 162 → 57 ms
/// in the replay; LoRA 2.8 → 1.1× fair), where rotating sent them
/// blindly.
#[derive(Debug, Clone, Copy, Default)]
struct PickOrder {
    carried: f64,
    load: f64,
    queue: f64,
    streams: u32,
}

/// Of the pods `allowed` (by position in `scored`), the first in
/// [`PickOrder`] (`order` aligned with `scored`; values within
/// [`TIE_EPSILON`] tie), then rotating by `tie_breaker`.
fn pick(
    scored: &[ScoredPod],
    order: &[PickOrder],
    tie_breaker: u64,
    allowed: impl Fn(usize) -> bool,
) -> Option<usize> {
    let key = |i: usize| {
        let tie = order.get(i).copied().unwrap_or_default();
        let composite = scored.get(i).map_or(0.0, |s| s.composite);
        [
            -tie.carried,
            composite,
            tie.load,
            tie.queue,
            -f64::from(tie.streams),
        ]
    };
    let better = |a: [f64; 5], b: [f64; 5]| {
        for (x, y) in a.into_iter().zip(b) {
            if x > y + TIE_EPSILON {
                return Some(true);
            }
            if y > x + TIE_EPSILON {
                return Some(false);
            }
        }
        None
    };
    let best = (0..scored.len())
        .filter(|&i| allowed(i))
        .map(key)
        .reduce(|a, b| if better(b, a) == Some(true) { b } else { a })?;
    let ties: Vec<usize> = (0..scored.len())
        .filter(|&i| allowed(i) && better(key(i), best).is_none())
        .filter_map(|i| scored.get(i).map(|s| s.index))
        .collect();
    let turn = tie_breaker % (ties.len().max(1) as u64);
    ties.get(turn as usize).copied()
}

/// Clamps into [0, 1]; NaN counts as 0.
fn unit(value: f64) -> f64 {
    if value.is_nan() {
        0.0
    } else {
        value.clamp(0.0, 1.0)
    }
}
