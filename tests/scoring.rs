//! The scoring design's numbers, asserted on real `ScoringPolicy` decisions.
//!
//! Every test goes through `ScoringPolicy::decide` and reads the per-factor
//! values and composites from the returned explanation (`Decision.scored`),
//! so the arithmetic below is the arithmetic the router actually performs.

use std::collections::BTreeMap;

use kvroute::config::{BalanceConfig, Config, Weights};
use kvroute::scoring::occupancy::Occupancy;
use kvroute::scoring::spread::Demand;
use kvroute::scoring::ttft::{TtftModel, Work};
use kvroute::scoring::{
    Balancing, Candidate, Decision, DecisionContext, Exclusion, ScoredPod, Scorer, ScoringPolicy,
};
use kvroute::snapshot::SlotLoad;
use proptest::prelude::*;

static NO_ATTRIBUTES: BTreeMap<String, f64> = BTreeMap::new();

/// Tolerance for comparing composites computed in f64.
const EPS: f64 = 1e-9;

/// A pod described by the five built-in inputs.
#[derive(Debug, Clone, Copy)]
struct Pod {
    cache: f64,
    load: f64,
    queue: u32,
    health: f64,
    adapter: bool,
}

/// An idle, healthy, cold pod.
const IDLE: Pod = Pod {
    cache: 0.0,
    load: 0.0,
    queue: 0,
    health: 1.0,
    adapter: false,
};

const IDS: [&str; 64] = [
    "p0", "p1", "p2", "p3", "p4", "p5", "p6", "p7", "p8", "p9", "p10", "p11", "p12", "p13", "p14",
    "p15", "p16", "p17", "p18", "p19", "p20", "p21", "p22", "p23", "p24", "p25", "p26", "p27",
    "p28", "p29", "p30", "p31", "p32", "p33", "p34", "p35", "p36", "p37", "p38", "p39", "p40",
    "p41", "p42", "p43", "p44", "p45", "p46", "p47", "p48", "p49", "p50", "p51", "p52", "p53",
    "p54", "p55", "p56", "p57", "p58", "p59", "p60", "p61", "p62", "p63",
];

fn candidates(pods: &[Pod]) -> Vec<Candidate<'static>> {
    pods.iter()
        .enumerate()
        .map(|(slot, p)| Candidate {
            cache_match: p.cache,
            load: p.load,
            queue: p.queue,
            health: p.health,
            adapter_loaded: p.adapter,
            ..Candidate::idle(slot, IDS[slot], &NO_ATTRIBUTES)
        })
        .collect()
}

fn default_policy() -> ScoringPolicy {
    ScoringPolicy::from_config(&Config::default())
}

fn decide(policy: &ScoringPolicy, pods: &[Pod], needs_adapter: bool) -> Decision {
    policy.decide(
        &candidates(pods),
        needs_adapter,
        0,
        Some(Balancing::with_error(0.0)),
    )
}

/// The scored entry of candidate `index` (panics if it was excluded).
fn scored(decision: &Decision, index: usize) -> &ScoredPod {
    decision
        .scored
        .iter()
        .find(|s| s.index == index)
        .unwrap_or_else(|| panic!("candidate {index} not scored: {decision:?}"))
}

fn composite(decision: &Decision, index: usize) -> f64 {
    scored(decision, index).composite
}

/// Position of a scorer in `Decision.scored[..].factors`.
fn factor_index(policy: &ScoringPolicy, name: &str) -> usize {
    policy
        .scorer_names()
        .iter()
        .position(|n| *n == name)
        .unwrap_or_else(|| panic!("no scorer {name:?} in {:?}", policy.scorer_names()))
}

/// `weight × factor` of one scorer for one candidate.
fn term(
    policy: &ScoringPolicy,
    config: &Config,
    decision: &Decision,
    index: usize,
    name: &str,
) -> f64 {
    let w = &config.weights;
    let weight = match name {
        "cache" => w.cache,
        "load" => w.load,
        "queue" => w.queue,
        "health" => w.health,
        "adapter" => w.adapter,
        other => panic!("unknown built-in {other}"),
    };
    weight * scored(decision, index).factors[factor_index(policy, name)]
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn default_scorers_are_the_five_factors_in_order() {
    assert_eq!(
        default_policy().scorer_names(),
        ["cache", "load", "queue", "health", "adapter"]
    );
    assert_eq!(default_policy().max_queue(), 20);
}

#[test]
fn hot_pod_at_80_percent_load_beats_an_idle_cold_pod() {
    let config = Config::default();
    let policy = ScoringPolicy::from_config(&config);
    let hot = Pod {
        cache: 1.0,
        load: 0.8,
        ..IDLE
    };
    let cold = IDLE;
    let d = decide(&policy, &[hot, cold], false);
    let hot_part = term(&policy, &config, &d, 0, "cache") + term(&policy, &config, &d, 0, "load");
    let cold_part = term(&policy, &config, &d, 1, "cache") + term(&policy, &config, &d, 1, "load");
    assert!(
        close(hot_part, 0.64),
        "hot cache+load = 0.60·1 + 0.20·0.2 = 0.64, got {hot_part}"
    );
    assert!(
        close(cold_part, 0.20),
        "cold cache+load = 0.60·0 + 0.20·1 = 0.20, got {cold_part}"
    );
    // Queue, health and adapter are equal (0.10 + 0.05 + 0.05 = 0.20 each).
    assert!(close(composite(&d, 0), 0.84), "{d:?}");
    assert!(close(composite(&d, 1), 0.40), "{d:?}");
    assert_eq!(d.chosen, Some(0));
    assert_eq!(d.winner().map(|w| w.index), Some(0));
}

#[test]
fn each_queued_request_costs_0_005_of_composite() {
    let policy = default_policy();
    let qi = factor_index(&policy, "queue");
    for q in 0..19u32 {
        let a = Pod { queue: q, ..IDLE };
        let b = Pod {
            queue: q + 1,
            ..IDLE
        };
        let d = decide(&policy, &[a, b], false);
        let diff = composite(&d, 0) - composite(&d, 1);
        assert!(
            close(diff, 0.005),
            "queue {q} vs {}: composite diff {diff}, expected 0.10/20",
            q + 1
        );
        let queue_diff = scored(&d, 0).factors[qi] - scored(&d, 1).factors[qi];
        assert!(
            close(queue_diff, 0.05),
            "queue score diff {queue_diff}, expected 1/20"
        );
        assert_eq!(
            d.chosen,
            Some(0),
            "the shorter queue wins when all else is equal"
        );
    }
}

#[test]
fn maximum_health_penalty_is_0_035_and_below_0_3_is_excluded() {
    let policy = default_policy();
    let sick = Pod {
        health: 0.3,
        ..IDLE
    };
    let d = decide(&policy, &[IDLE, sick], false);
    let diff = composite(&d, 0) - composite(&d, 1);
    assert!(
        close(diff, 0.035),
        "health 1.0 vs 0.3: composite diff {diff}, expected 0.05·0.7"
    );
    assert!(
        d.excluded.is_empty(),
        "0.3 is at the threshold, still eligible: {d:?}"
    );

    let sicker = Pod {
        health: 0.29,
        ..IDLE
    };
    let d = decide(&policy, &[IDLE, sicker], false);
    assert_eq!(d.excluded, vec![(1, Exclusion::Unhealthy { health: 0.29 })]);
    assert_eq!(d.scored.len(), 1);
    assert_eq!(d.chosen, Some(0));
}

#[test]
fn full_queues_are_excluded_and_all_excluded_means_no_choice() {
    let policy = default_policy();
    let nearly_full = Pod { queue: 19, ..IDLE };
    let full = Pod { queue: 20, ..IDLE };
    let over = Pod { queue: 500, ..IDLE };
    let d = decide(&policy, &[nearly_full, full, over], false);
    assert_eq!(d.chosen, Some(0));
    assert_eq!(
        d.excluded,
        vec![
            (1, Exclusion::QueueFull { queue: 20 }),
            (2, Exclusion::QueueFull { queue: 500 })
        ]
    );

    let dead = Pod {
        health: 0.0,
        ..IDLE
    };
    let d = decide(&policy, &[full, dead, over], false);
    assert_eq!(d.chosen, None);
    assert!(d.winner().is_none());
    assert!(d.scored.is_empty());
    assert_eq!(d.excluded.len(), 3);
    assert_eq!(d.excluded[1], (1, Exclusion::Unhealthy { health: 0.0 }));

    let d = decide(&policy, &[], false);
    assert_eq!(d.chosen, None, "no pods at all");
    assert!(d.ranked().is_empty());
}

/// The failover order: the chosen pod, then the other eligible pods by
/// composite; excluded pods are never in it.
#[test]
fn ranked_lists_the_winner_then_the_runners_up_best_first() {
    let policy = default_policy();
    let holder = Pod { cache: 0.9, ..IDLE };
    let partial = Pod { cache: 0.4, ..IDLE };
    let busy = Pod { load: 0.9, ..IDLE };
    let full = Pod { queue: 20, ..IDLE };
    let d = decide(&policy, &[busy, full, partial, IDLE, holder], false);
    assert_eq!(d.chosen, Some(4));
    assert_eq!(d.ranked(), vec![4, 2, 3, 0]);
}

#[test]
fn decide_explains_every_candidate() {
    let policy = default_policy();
    let pods = [
        Pod { cache: 0.5, ..IDLE },
        Pod {
            health: 0.1,
            ..IDLE
        },
        Pod { queue: 25, ..IDLE },
        Pod {
            load: 0.3,
            queue: 3,
            ..IDLE
        },
    ];
    let d = decide(&policy, &pods, false);
    let mut seen: Vec<usize> = d
        .scored
        .iter()
        .map(|s| s.index)
        .chain(d.excluded.iter().map(|e| e.0))
        .collect();
    seen.sort_unstable();
    assert_eq!(
        seen,
        [0, 1, 2, 3],
        "each candidate is either scored or excluded, once"
    );
    assert_eq!(
        d.excluded,
        vec![
            (1, Exclusion::Unhealthy { health: 0.1 }),
            (2, Exclusion::QueueFull { queue: 25 })
        ]
    );
    for s in &d.scored {
        assert_eq!(s.factors.len(), 5);
        let recomputed: f64 = [0.60, 0.20, 0.10, 0.05, 0.05]
            .iter()
            .zip(&s.factors)
            .map(|(w, f)| w * f)
            .sum();
        assert!(close(recomputed, s.composite), "{s:?}");
    }
    assert_eq!(
        Exclusion::QueueFull { queue: 25 }.to_string(),
        "queue 25 at maxQueue"
    );
    assert!(Exclusion::Unhealthy { health: 0.1 }
        .to_string()
        .contains("0.10"));
}

/// The design document's "counterintuitive case": A at 80% utilisation with
/// an empty queue against B at 40% utilisation with 10 queued, equal cache.
///
/// The document says A wins. Its own default weights say otherwise: on the
/// load and queue terms (everything else is equal)
///
/// ```text
/// A = 0.20·(1−0.8) + 0.10·(1−0/20)  = 0.04 + 0.10 = 0.14
/// B = 0.20·(1−0.4) + 0.10·(1−10/20) = 0.12 + 0.05 = 0.17
/// ```
///
/// so B wins at the defaults. A wins only when the operator makes the queue
/// dominate (load 0.10, queue 0.20: A = 0.02 + 0.20 = 0.22, B = 0.06 + 0.10 =
/// 0.16), or with default weights and a tighter `maxQueue`: B's queue term is
/// 0.10·(1 − 10/m), below A's 0.02 advantage on load+queue exactly when
/// m < 12.5, so A wins for maxQueue ≤ 12 and B wins for maxQueue ≥ 13
/// (and for maxQueue ≤ 10 B is simply excluded).
#[test]
fn counterintuitive_case_follows_the_arithmetic_not_the_design_claim() {
    let a = Pod {
        cache: 0.5,
        load: 0.8,
        queue: 0,
        ..IDLE
    };
    let b = Pod {
        cache: 0.5,
        load: 0.4,
        queue: 10,
        ..IDLE
    };
    let load_queue = |policy: &ScoringPolicy, config: &Config, d: &Decision, i: usize| {
        term(policy, config, d, i, "load") + term(policy, config, d, i, "queue")
    };

    // Defaults: B wins, 0.17 against 0.14.
    let config = Config::default();
    let policy = ScoringPolicy::from_config(&config);
    let d = decide(&policy, &[a, b], false);
    let (sa, sb) = (
        load_queue(&policy, &config, &d, 0),
        load_queue(&policy, &config, &d, 1),
    );
    assert!(
        close(sa, 0.14),
        "A load+queue = 0.2·0.2 + 0.1·1 = 0.14, got {sa}"
    );
    assert!(
        close(sb, 0.17),
        "B load+queue = 0.2·0.6 + 0.1·0.5 = 0.17, got {sb}"
    );
    assert_eq!(
        d.chosen,
        Some(1),
        "at default weights B (0.17) beats A (0.14): {d:?}"
    );

    // Queue-dominant weights: A wins, 0.22 against 0.16.
    let config = Config {
        weights: Weights {
            cache: 0.60,
            load: 0.10,
            queue: 0.20,
            health: 0.05,
            adapter: 0.05,
        },
        ..Config::default()
    };
    let mut valid = config.clone();
    valid.pods = vec![kvroute::config::PodConfig {
        id: "a".into(),
        address: "127.0.0.1:9001".into(),
        report_address: None,
        metrics_address: None,
        attributes: BTreeMap::new(),
    }];
    valid
        .validate()
        .expect("queue-dominant weights are a valid configuration");
    let policy = ScoringPolicy::from_config(&config);
    let d = decide(&policy, &[a, b], false);
    let (sa, sb) = (
        load_queue(&policy, &config, &d, 0),
        load_queue(&policy, &config, &d, 1),
    );
    assert!(
        close(sa, 0.22),
        "A load+queue = 0.1·0.2 + 0.2·1 = 0.22, got {sa}"
    );
    assert!(
        close(sb, 0.16),
        "B load+queue = 0.1·0.6 + 0.2·0.5 = 0.16, got {sb}"
    );
    assert_eq!(
        d.chosen,
        Some(0),
        "queue-dominant weights: A (0.22) beats B (0.16)"
    );

    // Default weights, tighter maxQueue: A wins up to 12, B from 13.
    for max_queue in 11..=30u32 {
        let config = Config {
            max_queue,
            ..Config::default()
        };
        let policy = ScoringPolicy::from_config(&config);
        let d = decide(&policy, &[a, b], false);
        let (sa, sb) = (
            load_queue(&policy, &config, &d, 0),
            load_queue(&policy, &config, &d, 1),
        );
        let expected_b = 0.12 + 0.10 * (1.0 - 10.0 / f64::from(max_queue));
        assert!(
            close(sa, 0.14) && close(sb, expected_b),
            "maxQueue {max_queue}: A {sa}, B {sb}"
        );
        let expected = if max_queue <= 12 { 0 } else { 1 };
        assert_eq!(
            d.chosen,
            Some(expected),
            "maxQueue {max_queue}: A = 0.14, B = 0.12 + 0.1·(1 − 10/{max_queue}) = {expected_b:.4}"
        );
    }
    // maxQueue 12: B = 0.12 + 0.1/6 ≈ 0.1367 < 0.14.
    // maxQueue 10: B's queue is full, it is not even a candidate.
    let config = Config {
        max_queue: 10,
        ..Config::default()
    };
    let d = decide(&ScoringPolicy::from_config(&config), &[a, b], false);
    assert_eq!(d.chosen, Some(0));
    assert_eq!(d.excluded, vec![(1, Exclusion::QueueFull { queue: 10 })]);
}

#[test]
fn exact_ties_go_to_the_higher_load_score_then_the_higher_queue_score_then_fewer_streams() {
    let policy = default_policy();
    // 0.6·0.1 + 0.2·0.5 = 0.16 = 0.6·0 + 0.2·0.8: same composite, B less loaded.
    let a = Pod {
        cache: 0.1,
        load: 0.5,
        ..IDLE
    };
    let b = Pod {
        cache: 0.0,
        load: 0.2,
        ..IDLE
    };
    for tie_breaker in 0..8 {
        let d = policy.decide(
            &candidates(&[a, b]),
            false,
            tie_breaker,
            Some(Balancing::with_error(0.0)),
        );
        assert!((composite(&d, 0) - composite(&d, 1)).abs() < EPS, "{d:?}");
        assert_eq!(
            d.chosen,
            Some(1),
            "tie → higher load score (tie breaker {tie_breaker})"
        );
        let d = policy.decide(
            &candidates(&[b, a]),
            false,
            tie_breaker,
            Some(Balancing::with_error(0.0)),
        );
        assert_eq!(d.chosen, Some(0), "order does not matter");
    }
    // 0.1·(1−1/20) + 0.05·1 = 0.145 = 0.1·1 + 0.05·0.9: same composite and
    // load, D has the shorter queue.
    let c = Pod { queue: 1, ..IDLE };
    let d_pod = Pod {
        health: 0.9,
        ..IDLE
    };
    for tie_breaker in 0..8 {
        let d = policy.decide(
            &candidates(&[c, d_pod]),
            false,
            tie_breaker,
            Some(Balancing::with_error(0.0)),
        );
        assert!((composite(&d, 0) - composite(&d, 1)).abs() < EPS, "{d:?}");
        assert_eq!(
            d.chosen,
            Some(1),
            "tie → higher queue score (tie breaker {tie_breaker})"
        );
    }
    // Same composite, load and queue (approximate mode's fresh pods): the
    // pod with fewer streams open, not the rotation.
    let mut idle = candidates(&[IDLE, IDLE, IDLE]);
    idle[0].streams = 8;
    idle[1].streams = 3;
    idle[2].streams = 5;
    for tie_breaker in 0..8 {
        let d = policy.decide(&idle, false, tie_breaker, Some(Balancing::with_error(0.0)));
        assert_eq!(d.chosen, Some(1), "tie → fewer streams ({tie_breaker})");
    }
}

#[test]
fn identical_pods_share_traffic_evenly_through_the_tie_breaker() {
    let policy = default_policy();
    let pod = Pod {
        cache: 0.25,
        load: 0.3,
        queue: 2,
        health: 0.9,
        adapter: false,
    };
    for n_pods in [2usize, 3, 5, 8, 64] {
        let pods = vec![pod; n_pods];
        let cands = candidates(&pods);
        let rounds = 40 * n_pods as u64;
        let mut counts = vec![0u64; n_pods];
        for tie_breaker in 0..rounds {
            let d = policy.decide(&cands, false, tie_breaker, Some(Balancing::with_error(0.0)));
            counts[d.chosen.expect("eligible")] += 1;
        }
        assert!(counts.iter().all(|&c| c == 40), "{n_pods} pods: {counts:?}");
    }
    // With an excluded pod among them, the others still share evenly.
    let pods = [pod, Pod { queue: 20, ..pod }, pod];
    let cands = candidates(&pods);
    let mut counts = [0u32; 3];
    for tie_breaker in 0..100 {
        counts[policy
            .decide(&cands, false, tie_breaker, Some(Balancing::with_error(0.0)))
            .chosen
            .unwrap()] += 1;
    }
    assert_eq!(counts, [50, 0, 50]);
}

#[test]
fn cold_start_goes_to_the_least_loaded_pod() {
    let policy = default_policy();
    let loads = [0.7, 0.35, 0.9, 0.1, 0.5];
    let pods: Vec<Pod> = loads.iter().map(|&load| Pod { load, ..IDLE }).collect();
    for tie_breaker in 0..5 {
        let d = policy.decide(
            &candidates(&pods),
            false,
            tie_breaker,
            Some(Balancing::with_error(0.0)),
        );
        assert_eq!(d.chosen, Some(3), "no cache anywhere: least loaded wins");
        let ci = factor_index(&policy, "cache");
        assert!(d.scored.iter().all(|s| s.factors[ci] == 0.0));
    }
}

#[test]
fn adapter_affinity() {
    let policy = default_policy();
    let ai = factor_index(&policy, "adapter");
    let with = Pod {
        adapter: true,
        ..IDLE
    };
    let pods = [IDLE, IDLE, with, IDLE];
    for tie_breaker in 0..8 {
        let d = policy.decide(
            &candidates(&pods),
            true,
            tie_breaker,
            Some(Balancing::with_error(0.0)),
        );
        assert_eq!(d.chosen, Some(2), "the pod with the adapter loaded wins");
        assert!(close(composite(&d, 2) - composite(&d, 0), 0.05));
        assert_eq!(scored(&d, 0).factors[ai], 0.0);
        assert_eq!(scored(&d, 2).factors[ai], 1.0);
    }
    // No adapter needed: the factor is 1 for everyone, so no bias.
    let d = decide(&policy, &pods, false);
    assert!(d.scored.iter().all(|s| s.factors[ai] == 1.0), "{d:?}");
    let c0 = composite(&d, 0);
    assert!(d.scored.iter().all(|s| close(s.composite, c0)));
}

fn cost_config() -> Config {
    Config::parse(
        br#"{
            "weights": {"cache": 0.5, "load": 0.2, "queue": 0.1, "health": 0.05, "adapter": 0.05},
            "attributeScorers": [{"name": "cost", "weight": 0.1, "attribute": "costPerHour",
                                  "prefer": "lower", "cacheMatchWindow": 0.2}],
            "pods": [{"id": "cheap", "address": "10.0.0.1:8000", "attributes": {"costPerHour": 2.0}},
                     {"id": "pricey", "address": "10.0.0.2:8000", "attributes": {"costPerHour": 10.0}}]
        }"#,
    )
    .expect("valid cost configuration")
}

fn cost_candidates<'a>(
    config: &'a Config,
    cheap_cache: f64,
    pricey_cache: f64,
) -> Vec<Candidate<'a>> {
    let cache = [cheap_cache, pricey_cache];
    config
        .pods
        .iter()
        .enumerate()
        .map(|(slot, pod)| Candidate {
            cache_match: cache[slot],
            load: 0.3,
            queue: 1,
            ..Candidate::idle(slot, &pod.id, &pod.attributes)
        })
        .collect()
}

#[test]
fn attribute_scorer_prefers_the_cheap_pod_within_the_cache_window() {
    let config = cost_config();
    let policy = ScoringPolicy::from_config(&config);
    assert_eq!(
        policy.scorer_names(),
        ["cache", "load", "queue", "health", "adapter", "cost"]
    );
    let cost = factor_index(&policy, "cost");

    // Cheap pod 0.15 behind the best: within the window, cheaper → it wins.
    // cheap 0.5·0.85 + 0.1·1 = 0.525 > pricey 0.5·1.0 + 0.1·0 = 0.5.
    let d = policy.decide(
        &cost_candidates(&config, 0.85, 1.0),
        false,
        0,
        Some(Balancing::with_error(0.0)),
    );
    assert_eq!(scored(&d, 0).factors[cost], 1.0);
    assert_eq!(scored(&d, 1).factors[cost], 0.0);
    assert!(close(composite(&d, 0) - composite(&d, 1), 0.025), "{d:?}");
    assert_eq!(
        d.chosen,
        Some(0),
        "cheap pod within 0.2 of the best cache match wins"
    );

    // Cheap pod 0.3 behind: outside the window it earns no cost score, and
    // the pricey pod, alone in the window, earns the full 0.1.
    let d = policy.decide(
        &cost_candidates(&config, 0.7, 1.0),
        false,
        0,
        Some(Balancing::with_error(0.0)),
    );
    assert_eq!(scored(&d, 0).factors[cost], 0.0);
    assert_eq!(scored(&d, 1).factors[cost], 1.0);
    assert_eq!(
        d.chosen,
        Some(1),
        "expensive hot pod wins when the cheap one is > 0.2 behind"
    );

    // Both cold: both in the window, cheap wins on cost alone.
    let d = policy.decide(
        &cost_candidates(&config, 0.0, 0.0),
        false,
        0,
        Some(Balancing::with_error(0.0)),
    );
    assert_eq!(d.chosen, Some(0));

    // A pod without the attribute scores 0 on it.
    let mut no_attr = cost_candidates(&config, 0.9, 0.9);
    no_attr[0].attributes = &NO_ATTRIBUTES;
    let d = policy.decide(&no_attr, false, 0, Some(Balancing::with_error(0.0)));
    assert_eq!(scored(&d, 0).factors[cost], 0.0);
    assert_eq!(
        scored(&d, 1).factors[cost],
        1.0,
        "alone with the attribute: min = max → 1"
    );
    assert_eq!(d.chosen, Some(1));
}

/// A compiled-in scorer: prefers even pod slots.
#[derive(Debug)]
struct EvenSlot {
    weight: f64,
}

impl Scorer for EvenSlot {
    fn name(&self) -> &str {
        "even-slot"
    }
    fn weight(&self) -> f64 {
        self.weight
    }
    fn score(&self, candidate: &Candidate<'_>, context: &DecisionContext<'_>) -> f64 {
        assert!(!context.candidates.is_empty());
        if candidate.slot.is_multiple_of(2) {
            // Out of range on purpose: the policy clamps into [0, 1].
            7.0
        } else {
            -3.0
        }
    }
}

#[test]
fn compiled_in_scorers_through_the_trait() {
    use kvroute::scoring::factors::{CacheScorer, LoadScorer};
    let policy = ScoringPolicy::with_scorers(
        vec![
            Box::new(CacheScorer { weight: 0.5 }),
            Box::new(LoadScorer { weight: 0.2 }),
            Box::new(EvenSlot { weight: 0.3 }),
        ],
        20,
        0.3,
    )
    .expect("weights sum to 1");
    assert_eq!(policy.scorer_names(), ["cache", "load", "even-slot"]);
    let pods = [
        Pod {
            cache: 0.2,
            load: 0.0,
            ..IDLE
        },
        Pod {
            cache: 0.6,
            load: 0.0,
            ..IDLE
        },
        Pod {
            cache: 0.4,
            load: 0.5,
            ..IDLE
        },
    ];
    let d = decide(&policy, &pods, false);
    // 0: 0.1 + 0.2 + 0.3 = 0.6; 1: 0.3 + 0.2 + 0 = 0.5; 2: 0.2 + 0.1 + 0.3 = 0.6.
    assert_eq!(scored(&d, 0).factors[2], 1.0, "clamped from 7");
    assert_eq!(scored(&d, 1).factors[2], 0.0, "clamped from -3");
    assert!(
        close(composite(&d, 0), 0.6)
            && close(composite(&d, 1), 0.5)
            && close(composite(&d, 2), 0.6)
    );
    assert_eq!(d.chosen, Some(0), "tie between 0 and 2 → higher load score");

    for bad in [0.2, 0.31, 0.0, 1.0] {
        let err = ScoringPolicy::with_scorers(
            vec![
                Box::new(CacheScorer { weight: 0.5 }),
                Box::new(EvenSlot { weight: bad }),
            ],
            20,
            0.3,
        )
        .expect_err("weights not summing to 1 are rejected");
        assert_eq!(err.field, "scorers", "{err}");
    }
    let err = ScoringPolicy::with_scorers(
        vec![
            Box::new(CacheScorer { weight: 1.5 }),
            Box::new(EvenSlot { weight: -0.5 }),
        ],
        20,
        0.3,
    )
    .expect_err("sum 1 but out-of-range weights are rejected");
    assert_eq!(err.field, "scorers");
}

// ---------------------------------------------------------------- properties

fn pod_strategy() -> impl Strategy<Value = Pod> {
    (
        0.0..=1.0f64,
        0.0..=1.0f64,
        0u32..30,
        0.0..=1.0f64,
        any::<bool>(),
    )
        .prop_map(|(cache, load, queue, health, adapter)| Pod {
            cache,
            load,
            queue,
            health,
            adapter,
        })
}

/// A pod the default policy never excludes.
fn eligible_pod_strategy() -> impl Strategy<Value = Pod> {
    (pod_strategy(), 0u32..20, 0.3..=1.0f64).prop_map(|(pod, queue, health)| Pod {
        queue,
        health,
        ..pod
    })
}

/// Five non-negative weights normalised to sum 1.
fn weights_strategy() -> impl Strategy<Value = Weights> {
    prop::array::uniform5(0.0..=1.0f64)
        .prop_filter("not all zero", |w| w.iter().sum::<f64>() > 1e-3)
        .prop_map(|w| {
            let sum: f64 = w.iter().sum();
            Weights {
                cache: w[0] / sum,
                load: w[1] / sum,
                queue: w[2] / sum,
                health: w[3] / sum,
                adapter: w[4] / sum,
            }
        })
}

fn config_with(weights: Weights, max_queue: u32) -> Config {
    Config {
        weights,
        max_queue,
        pods: vec![kvroute::config::PodConfig {
            id: "a".into(),
            address: "127.0.0.1:9001".into(),
            report_address: None,
            metrics_address: None,
            attributes: BTreeMap::new(),
        }],
        ..Config::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        // No regression files: the tests also run as wasm.
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn composite_is_in_unit_interval_and_the_weighted_sum(
        pods in prop::collection::vec(pod_strategy(), 1..16),
        weights in weights_strategy(),
        max_queue in 1u32..40,
        needs_adapter in any::<bool>(),
        tie_breaker in any::<u64>(),
    ) {
        let config = config_with(weights.clone(), max_queue);
        prop_assert!(config.validate().is_ok(), "normalised weights are valid: {:?}", config.validate());
        let policy = ScoringPolicy::from_config(&config);
        let d = policy.decide(&candidates(&pods), needs_adapter, tie_breaker, Some(Balancing::with_error(0.0)));
        prop_assert_eq!(d.scored.len() + d.excluded.len(), pods.len());
        let w = [weights.cache, weights.load, weights.queue, weights.health, weights.adapter];
        for s in &d.scored {
            prop_assert!((0.0..=1.0).contains(&s.composite), "{:?}", s);
            prop_assert!(s.factors.iter().all(|f| (0.0..=1.0).contains(f)), "{:?}", s);
            let sum: f64 = w.iter().zip(&s.factors).map(|(w, f)| w * f).sum();
            prop_assert!((sum - s.composite).abs() < 1e-9);
        }
        // The winner has the highest composite (up to the tie epsilon).
        if let Some(winner) = d.winner() {
            for s in &d.scored {
                prop_assert!(winner.composite + EPS >= s.composite);
            }
        } else {
            prop_assert!(d.scored.is_empty());
        }
    }

    #[test]
    fn a_cache_advantage_of_0_65_always_wins_at_default_weights(
        hot in eligible_pod_strategy(),
        others in prop::collection::vec(pod_strategy(), 0..15),
        advantage in 0.65..=1.0f64,
        position in any::<prop::sample::Index>(),
        needs_adapter in any::<bool>(),
        tie_breaker in any::<u64>(),
    ) {
        // 0.60 · 0.65 = 0.39 exceeds the most the other factors can make up:
        // load 0.20 + queue 0.10·19/20 + health 0.05·0.7 + adapter 0.05 = 0.38.
        let hot_cache = advantage + (1.0 - advantage) * hot.cache;
        let hot = Pod { cache: hot_cache, ..hot };
        let mut pods: Vec<Pod> = others
            .into_iter()
            .map(|p| Pod { cache: p.cache.min(hot_cache - advantage), ..p })
            .collect();
        let at = position.index(pods.len() + 1);
        pods.insert(at, hot);
        let d = default_policy().decide(&candidates(&pods), needs_adapter, tie_breaker, Some(Balancing::with_error(0.0)));
        prop_assert_eq!(d.chosen, Some(at), "{:?}", d);
    }

    #[test]
    fn composite_is_monotonic_in_each_factor(
        pods in prop::collection::vec(eligible_pod_strategy(), 1..8),
        weights in weights_strategy(),
        which in any::<prop::sample::Index>(),
        factor in 0usize..5,
        amount in 0.0..=1.0f64,
        needs_adapter in any::<bool>(),
    ) {
        let policy = ScoringPolicy::from_config(&config_with(weights, 20));
        let i = which.index(pods.len());
        let before = policy.decide(&candidates(&pods), needs_adapter, 0, Some(Balancing::with_error(0.0)));
        let mut better = pods.clone();
        let p = &mut better[i];
        match factor {
            0 => p.cache += (1.0 - p.cache) * amount,
            1 => p.load -= p.load * amount,
            2 => p.queue -= (f64::from(p.queue) * amount) as u32,
            3 => p.health += (1.0 - p.health) * amount,
            _ => p.adapter = true,
        }
        let after = policy.decide(&candidates(&better), needs_adapter, 0, Some(Balancing::with_error(0.0)));
        prop_assert!(
            composite(&after, i) + 1e-12 >= composite(&before, i),
            "factor {} raised on pod {}: {} → {}", factor, i, composite(&before, i), composite(&after, i)
        );
        // Improving the winner never makes it lose.
        if before.chosen == Some(i) {
            let others_best = after.scored.iter().filter(|s| s.index != i).map(|s| s.composite).fold(0.0, f64::max);
            prop_assert!(composite(&after, i) + EPS >= others_best);
        }
    }

    #[test]
    fn weights_off_by_more_than_1e_6_are_rejected(
        w in prop::array::uniform5(0.0..=1.0f64),
        max_queue in 1u32..40,
    ) {
        let sum: f64 = w.iter().sum();
        prop_assume!((sum - 1.0).abs() > 1e-6);
        let config = config_with(
            Weights { cache: w[0], load: w[1], queue: w[2], health: w[3], adapter: w[4] },
            max_queue,
        );
        let err = config.validate().expect_err("weights must sum to 1");
        prop_assert_eq!(err.field, "weights");
    }

    #[test]
    fn weights_off_by_a_tiny_bit_are_accepted_or_rejected_at_exactly_1e_6(
        weights in weights_strategy(),
        off in -2e-6..2e-6f64,
    ) {
        prop_assume!((off.abs() - 1e-6).abs() > 1e-9);
        let mut w = weights;
        // Put the offset on the largest weight so it stays within [0, 1].
        let largest = [w.cache, w.load, w.queue, w.health, w.adapter].into_iter().fold(0.0, f64::max);
        let slot = if w.cache == largest { &mut w.cache } else if w.load == largest { &mut w.load }
            else if w.queue == largest { &mut w.queue } else if w.health == largest { &mut w.health }
            else { &mut w.adapter };
        *slot = (*slot + off).clamp(0.0, 1.0);
        let sum = w.cache + w.load + w.queue + w.health + w.adapter;
        prop_assume!(((sum - 1.0).abs() - 1e-6).abs() > 1e-9);
        let result = config_with(w, 20).validate();
        if (sum - 1.0).abs() > 1e-6 {
            prop_assert_eq!(result.map_err(|e| e.field), Err("weights".to_string()));
        } else {
            prop_assert!(result.is_ok(), "{:?}", result);
        }
    }
}

/// A model that learned pods answering in `overhead + 0.1 ms × work`
/// (pod 1 at `slow` × that per token), exactly: its error is about 0.
fn learned_model(slow: f64) -> TtftModel {
    let mut model = TtftModel::new(64);
    for i in 0..64u64 {
        let work = 1_000 + (i % 8) * 2_000;
        model.observe(0, Work::new(0, work), 10.0 + 0.1 * work as f64);
        model.observe(1, Work::new(0, work), 10.0 + 0.1 * slow * work as f64);
    }
    model
}

/// Pod `slot` for a `prompt`-token request of which it caches `cached`,
/// with `queued` tokens of prefill ahead, as the router builds it from
/// `model`.
fn ttft_pod(
    model: &TtftModel,
    slot: usize,
    prompt: u64,
    cached: u64,
    queued: u64,
) -> Candidate<'static> {
    let line = model.line(slot);
    let uncached = prompt - cached;
    Candidate {
        cache_match: cached as f64 / prompt as f64,
        cached_tokens: cached,
        uncached_tokens: uncached,
        queued_prefill: queued,
        predicted_ttft_ms: line.predict(queued as f64, uncached as f64),
        prefill_ms_per_token: line.ms_per_token,
        queued_ms_per_token: line.ms_per_queued_token,
        load: 0.3,
        // Requests waiting there, as the prefill queued suggests.
        queue: if queued > 0 { 2 } else { 0 },
        ..Candidate::idle(slot, IDS[slot], &NO_ATTRIBUTES)
    }
}

#[test]
fn a_new_session_leaves_a_pod_busy_prefilling_long_turns() {
    let policy = default_policy();
    let model = learned_model(1.0);
    assert!(model.error() < 0.05, "{}", model.error());
    // An 8,500-token first turn whose 8,000-token head pod 0 caches. With
    // 2,000 tokens queued there it answers in 260 ms against 860 ms on the
    // idle pod: affinity holds.
    let close = [
        ttft_pod(&model, 0, 8_500, 8_000, 2_000),
        ttft_pod(&model, 1, 8_500, 0, 0),
    ];
    let decision = policy.decide(&close, false, 0, Some(Balancing::with_error(model.error())));
    assert_eq!(decision.chosen, Some(0));
    assert!((decision.scored[0].predicted_ttft_ms - 260.0).abs() < 1.0);
    // Two long tool outputs queued (18,000 tokens): 1,860 ms against
    // 860 ms (the copy is free: no decision found the idle pod busy).
    let behind = [
        ttft_pod(&model, 0, 8_500, 8_000, 18_000),
        ttft_pod(&model, 1, 8_500, 0, 0),
    ];
    let decision = policy.decide(
        &behind,
        false,
        0,
        Some(Balancing::with_error(model.error())),
    );
    assert_eq!(decision.chosen, Some(1));
    assert_eq!(
        decision.scored[0].factors[0], 0.0,
        "the holder's cache term is dropped"
    );
    assert!(decision.scored[0].cache_withheld && !decision.scored[1].cache_withheld);
    // Not for a request leaving the wait queue, nor with balance off.
    assert_eq!(policy.decide(&behind, false, 0, None).chosen, Some(0));
    let off = ScoringPolicy::from_config(&Config {
        balance: BalanceConfig {
            enabled: false,
            ..BalanceConfig::default()
        },
        ..Config::default()
    });
    assert_eq!(
        off.decide(
            &behind,
            false,
            0,
            Some(Balancing::with_error(model.error()))
        )
        .chosen,
        Some(0)
    );
}

#[test]
fn a_busy_pool_counts_the_copy_it_would_make() {
    let policy = default_policy();
    let model = learned_model(1.0);
    // Every other decision found prefill queued on both pods.
    let mut occupancy = Occupancy::new(64);
    for i in 0..256u64 {
        let load = SlotLoad {
            prefill_tokens: 100 * (i % 2) as u32,
            prefill_attention: 0,
            ..SlotLoad::default()
        };
        occupancy.observe(&[load, load]);
    }
    let busy = |mut pods: [Candidate<'static>; 2]| {
        for pod in &mut pods {
            pod.busy = occupancy.busy(pod.slot);
        }
        pods
    };
    // 1,560 ms on the holder against 860 ms + the 8,000-token copy's
    // 800 ms, which the ρ/(1 − ρ) = 1 request on the pod would wait too:
    // the cache stays (idle, the pool would have moved it).
    let behind = busy([
        ttft_pod(&model, 0, 8_500, 8_000, 15_000),
        ttft_pod(&model, 1, 8_500, 0, 0),
    ]);
    assert_eq!(
        policy
            .decide(
                &behind,
                false,
                0,
                Some(Balancing::with_error(model.error()))
            )
            .chosen,
        Some(0)
    );
    // Twice the queue: 3,660 ms, the copy is worth it.
    let longer = busy([
        ttft_pod(&model, 0, 8_500, 8_000, 36_000),
        ttft_pod(&model, 1, 8_500, 0, 0),
    ]);
    assert_eq!(
        policy
            .decide(
                &longer,
                false,
                0,
                Some(Balancing::with_error(model.error()))
            )
            .chosen,
        Some(1)
    );
}

#[test]
fn a_slow_pod_is_predicted_slow() {
    let policy = default_policy();
    // Pod 1 prefills at half pod 0's speed: the same 4,000 tokens queued
    // are 410 ms there against 210 ms, so an opening cached nowhere goes
    // to the fast pod, and one cached on the slow pod stays there only
    // while the slow pod is not clearly later.
    let model = learned_model(2.0);
    assert!((model.line(1).ms_per_token - 0.2).abs() < 1e-6);
    let cold = [
        ttft_pod(&model, 0, 2_000, 0, 2_000),
        ttft_pod(&model, 1, 2_000, 0, 2_000),
    ];
    let decision = policy.decide(&cold, false, 0, Some(Balancing::with_error(model.error())));
    assert!(decision.scored[1].predicted_ttft_ms > 1.9 * decision.scored[0].predicted_ttft_ms);
    let cached_on_slow = [
        ttft_pod(&model, 0, 2_000, 0, 0),
        ttft_pod(&model, 1, 2_000, 1_800, 6_000),
    ];
    let decision = policy.decide(
        &cached_on_slow,
        false,
        0,
        Some(Balancing::with_error(model.error())),
    );
    assert_eq!(decision.chosen, Some(0), "1,250 ms against 210 ms");
}

#[test]
fn an_uncalibrated_model_moves_only_for_large_differences() {
    let policy = default_policy();
    let model = TtftModel::new(64);
    assert_eq!(model.error(), kvroute::scoring::ttft::PRIOR_ERROR);
    // In tokens: 10,500 against 8,500 is within the prior's error.
    let close = [
        ttft_pod(&model, 0, 8_500, 8_000, 10_000),
        ttft_pod(&model, 1, 8_500, 0, 0),
    ];
    assert_eq!(
        policy
            .decide(&close, false, 0, Some(Balancing::with_error(model.error())))
            .chosen,
        Some(0)
    );
    // 40,500 against 8,500 is not.
    let far = [
        ttft_pod(&model, 0, 8_500, 8_000, 40_000),
        ttft_pod(&model, 1, 8_500, 0, 0),
    ];
    assert_eq!(
        policy
            .decide(&far, false, 0, Some(Balancing::with_error(model.error())))
            .chosen,
        Some(1)
    );
}

/// A pool of `health`, `queue` and cache matches per pod, as candidates
/// (each predicted by the same line: balance applies).
fn large_pool(pods: &[(f64, u32, f64)]) -> Vec<Candidate<'static>> {
    pods.iter()
        .enumerate()
        .map(|(slot, &(health, queue, cache))| Candidate {
            cache_match: cache,
            cached_tokens: (cache * 4096.0) as u64,
            uncached_tokens: ((1.0 - cache) * 4096.0) as u64,
            streams: queue,
            carried: f64::from(queue),
            queued_prefill: 0,
            // 0.1 ms a token of the prompt to prefill and of the queue's.
            predicted_ttft_ms: 10.0 + 0.1 * ((1.0 - cache) * 4096.0 + f64::from(queue) * 512.0),
            prefill_ms_per_token: 0.1,
            queued_ms_per_token: 0.1,
            busy: 0.5,
            load: f64::from(queue % 10) / 10.0,
            queue,
            health,
            adapter_loaded: slot % 97 == 0,
            ..Candidate::idle(slot, "p", &NO_ATTRIBUTES)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 64,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Past `candidates.exactUpTo` a decision scores a set of bounded size,
    /// and the exclusion rules hold exactly as when every pod is scored:
    /// the chosen pod is eligible, and a request is refused only when no
    /// pod of the pool can take it.
    #[test]
    fn a_large_pool_keeps_the_exclusions_exact(
        pods in prop::collection::vec(
            (prop_oneof![3 => Just(1.0), 1 => 0.0f64..0.6], prop_oneof![3 => 0u32..19, 2 => 20u32..40],
             prop_oneof![4 => Just(0.0), 1 => 0.0f64..1.0]),
            65..400),
        needs_adapter in any::<bool>(),
        tie_breaker in any::<u64>(),
    ) {
        let pool = large_pool(&pods);
        let set = ScoringPolicy::from_config(&Config::default());
        let exact = ScoringPolicy::from_config(&Config {
            candidates: kvroute::config::CandidatesConfig { exact_up_to: 1024, ..Default::default() },
            ..Config::default()
        });
        let d = set.decide(&pool, needs_adapter, tie_breaker, Some(Balancing::with_error(0.1)));
        let e = exact.decide(&pool, needs_adapter, tie_breaker, Some(Balancing::with_error(0.1)));
        prop_assert_eq!(e.scored.len() + e.excluded.len(), pods.len());
        prop_assert_eq!(d.chosen.is_none(), e.chosen.is_none(), "refused iff every pod is excluded");
        if let Some(chosen) = d.chosen {
            prop_assert!(set.exclusion(&pool[chosen]).is_none(), "chose an excluded pod");
            // At most `holders` eligible pods per source (longest holders,
            // adapter holders), `sampled` drawn.
            prop_assert!(d.scored.len() <= 3 * 8, "bounded: {}", d.scored.len());
            for (i, why) in &d.excluded {
                prop_assert_eq!(set.exclusion(&pool[*i]), Some(*why));
            }
            for s in &d.scored {
                prop_assert!(set.exclusion(&pool[s.index]).is_none());
            }
            // The longest match among eligible pods is always scored.
            let longest = pool.iter().enumerate()
                .filter(|(_, c)| set.exclusion(c).is_none())
                .map(|(i, c)| (c.cache_match, i))
                .fold((0.0, 0), |a, b| if b.0 > a.0 { b } else { a });
            if longest.0 > 0.0 {
                let best_scored = d.scored.iter().map(|s| pool[s.index].cache_match).fold(0.0, f64::max);
                prop_assert_eq!(best_scored, longest.0);
            }
        } else {
            prop_assert_eq!(d.excluded.len(), pods.len(), "every exclusion listed");
        }
    }
}

#[test]
fn a_session_start_from_an_under_held_prefix_goes_to_the_pod_without_it_that_carried_least() {
    let policy = default_policy();
    let model = learned_model(1.0);
    // A 1,200-token first turn on a 1,000-token system prompt that only
    // pod 0 caches; pod 2 has 500 tokens of prefill queued.
    let mut pods = [
        ttft_pod(&model, 0, 1_200, 1_000, 0),
        ttft_pod(&model, 1, 1_200, 0, 0),
        ttft_pod(&model, 2, 1_200, 0, 500),
        ttft_pod(&model, 3, 1_200, 0, 0),
    ];
    let balanced = Balancing::with_error(model.error());
    // Affinity: pod 0 answers sooner (30 ms against 130 ms).
    let decision = policy.decide(&pods, false, 0, Some(balanced));
    assert_eq!((decision.chosen, decision.spread), (Some(0), false));
    // The prompt starts 90 % of the sessions: it needs 4 holders (3.6),
    // it has 1. While that holder is idle, it answers this one at once.
    let demand = Demand {
        starts: 40.0,
        share: 0.9,
        holders: 1,
        continues: false,
    };
    let spread = Balancing {
        demand: Some(demand),
        ..balanced
    };
    let decision = policy.decide(&pods, false, 0, Some(spread));
    assert_eq!((decision.chosen, decision.spread), (Some(0), false));
    // Hot (all the requests in flight are there): a pod without it takes
    // this one. None has carried anything yet, so the seed's score
    // decides: pods 1 and 3 tie (pod 2 has requests waiting), the
    // tie-breaker picks pod 1.
    pods[0].streams = 3;
    pods[2].streams = 0;
    let decision = policy.decide(&pods, false, 0, Some(spread));
    assert_eq!((decision.chosen, decision.spread), (Some(1), true));
    // As hot with as many in flight elsewhere: no more than its share.
    pods[2].streams = 9;
    let decision = policy.decide(&pods, false, 0, Some(spread));
    assert_eq!((decision.chosen, decision.spread), (Some(0), false));
    pods[2].streams = 0;
    // The sessions' later turns will follow them there: a busier pod
    // (its reported load) yields to a less busy one, whatever its line
    // predicts for this one request.
    pods[1].load = 0.9;
    let decision = policy.decide(&pods, false, 0, Some(spread));
    assert_eq!((decision.chosen, decision.spread), (Some(3), true));
    pods[1].load = 0.3;
    // What the pods carried over recent decisions comes before one
    // report's load: pod 1 reports less now, but carried more streams.
    (pods[1].carried, pods[3].carried, pods[3].load) = (2.0, 1.0, 0.6);
    let decision = policy.decide(&pods, false, 0, Some(spread));
    assert_eq!((decision.chosen, decision.spread), (Some(3), true));
    // Only a copy is placed by it: among the pods without the prompt, a
    // request no copy is wanted for goes by the seed's score to pod 1
    // (first of the slice), not to pod 2, which carried nothing.
    assert_eq!(
        policy.decide(&pods[1..], false, 0, Some(balanced)).chosen,
        Some(0)
    );
    (pods[1].carried, pods[3].carried, pods[3].load) = (0.0, 0.0, 0.3);
    // Not behind another pod's whole request: pod 1 with more prefill
    // queued than pod 3's none plus this request's 1,200 tokens.
    pods[1].queued_prefill = 1_300;
    let decision = policy.decide(&pods, false, 0, Some(spread));
    assert_eq!((decision.chosen, decision.spread), (Some(3), true));
    pods[1].queued_prefill = 0;
    // Held by as many pods as its sessions need, or by as many as it had
    // sessions: affinity again.
    for enough in [
        Demand {
            holders: 4,
            ..demand
        },
        Demand {
            starts: 1.0,
            ..demand
        },
    ] {
        let decision = policy.decide(
            &pods,
            false,
            0,
            Some(Balancing {
                demand: Some(enough),
                ..balanced
            }),
        );
        assert_eq!((decision.chosen, decision.spread), (Some(0), false));
    }
    // The exclusions hold: a pod at maxQueue is never the one spread to.
    pods[1].queue = 20;
    let decision = policy.decide(&pods, false, 0, Some(spread));
    assert_eq!((decision.chosen, decision.spread), (Some(3), true));
    // Not for a request leaving the wait queue (no balancing at all).
    assert_eq!(policy.decide(&pods, false, 0, None).chosen, Some(0));
}

/// Balancing a session start from a prefix of `demand`, its sessions seen
/// to continue or not.
fn session_start(model: &TtftModel, demand: Demand, continues: bool) -> Balancing {
    Balancing {
        demand: Some(Demand {
            continues,
            ..demand
        }),
        ..Balancing::with_error(model.error())
    }
}

#[test]
fn a_session_start_whose_sessions_continue_goes_to_the_holder_that_carries_less() {
    let policy = default_policy();
    let model = learned_model(1.0);
    // A 1,200-token first turn on a 1,000-token system prompt that pods 0
    // and 1 cache. Pod 0 is idle now but carries six sessions (load 0.9);
    // pod 1 carries one, whose 2,000-token turn it is prefilling.
    let mut pods = [
        ttft_pod(&model, 0, 1_200, 1_000, 0),
        ttft_pod(&model, 1, 1_200, 1_000, 2_000),
        ttft_pod(&model, 2, 1_200, 0, 0),
        ttft_pod(&model, 3, 1_200, 0, 0),
    ];
    (pods[0].load, pods[0].streams) = (0.9, 6);
    (pods[1].load, pods[1].streams) = (0.1, 1);
    // Held by as many pods as its sessions need: no copy.
    let demand = Demand {
        starts: 2.0,
        share: 0.5,
        holders: 2,
        continues: false,
    };
    let start = |continues: bool| session_start(&model, demand, continues);
    // Sessions not seen to continue: this request alone counts, and pod 0
    // answers it sooner (30 ms against 230 ms).
    let decision = policy.decide(&pods, false, 0, Some(start(false)));
    assert_eq!(decision.chosen, Some(0));
    assert!(scored(&decision, 1).cache_withheld);
    // They continue: the holders keep their cache term together and the
    // later turns' pod is chosen by what it carries.
    let decision = policy.decide(&pods, false, 0, Some(start(true)));
    assert_eq!((decision.chosen, decision.spread), (Some(1), false));
    assert!(!scored(&decision, 1).cache_withheld);
    // Unless no holder keeps it: a pod without the prompt is then clearly
    // cheaper than both, and the balance's verdicts stand.
    pods[0].queued_prefill = 20_000;
    pods[0].predicted_ttft_ms = model.line(0).predict(20_000.0, 200.0);
    pods[1].queued_prefill = 20_000;
    pods[1].predicted_ttft_ms = model.line(1).predict(20_000.0, 200.0);
    let decision = policy.decide(&pods, false, 0, Some(start(true)));
    assert!(scored(&decision, 0).cache_withheld && scored(&decision, 1).cache_withheld);
    assert_eq!(decision, policy.decide(&pods, false, 0, Some(start(false))));
}

#[test]
fn a_session_start_whose_sessions_continue_goes_where_fewer_are_carried() {
    let policy = default_policy();
    let model = learned_model(1.0);
    // A 2,200-token first turn on a 2,000-token system prompt that only
    // pod 0 caches; pod 0 carries three sessions, the others one each.
    let mut pods = [
        ttft_pod(&model, 0, 2_200, 2_000, 0),
        ttft_pod(&model, 1, 2_200, 0, 0),
        ttft_pod(&model, 2, 2_200, 0, 0),
        ttft_pod(&model, 3, 2_200, 0, 0),
    ];
    pods[0].streams = 3;
    for pod in &mut pods[1..] {
        pod.streams = 1;
    }
    // A quarter of the starts: one holder is its share, so the share
    // rule asks for no copy.
    let demand = Demand {
        starts: 2.0,
        share: 0.25,
        holders: 1,
        continues: false,
    };
    let start = |continues: bool| session_start(&model, demand, continues);
    // Single-shot starts stay with the cache.
    let decision = policy.decide(&pods, false, 0, Some(start(false)));
    assert_eq!((decision.chosen, decision.spread), (Some(0), false));
    // Sessions that continue: pod 1 with this one would still carry fewer
    // (2) than the holder does now (3).
    let decision = policy.decide(&pods, false, 0, Some(start(true)));
    assert_eq!((decision.chosen, decision.spread), (Some(1), true));
    // Not when that only moves the pile: with this one, each carries 3.
    for pod in &mut pods[1..] {
        pod.streams = 2;
    }
    let decision = policy.decide(&pods, false, 0, Some(start(true)));
    assert_eq!((decision.chosen, decision.spread), (Some(0), false));
    // One pod carrying less is enough, and it is the one spread to.
    pods[3].streams = 1;
    let decision = policy.decide(&pods, false, 0, Some(start(true)));
    assert_eq!((decision.chosen, decision.spread), (Some(3), true));
}

/// Before its first answer the model predicts in tokens, not ms: no error
/// is measured against an answer's time (on real vLLM a 4,169-token first
/// prompt read as a 4,169 ms prediction of a 50 ms answer); after one
/// answer, predictions are in ms and errors are measured.
#[test]
fn an_uncalibrated_model_measures_no_error() {
    let mut model = TtftModel::new(64);
    assert_eq!(model.relative_error(0, Work::new(0, 4_169), 50.0), None);
    model.observe(0, Work::new(0, 4_000), 48.0);
    let error = model
        .relative_error(0, Work::new(0, 4_169), 50.0)
        .expect("calibrated");
    assert!(error < 0.1, "{error}");
}
