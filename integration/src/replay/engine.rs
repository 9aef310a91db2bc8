//! The discrete-event simulation: requests arrive at trace times, a policy
//! picks a pod, each pod runs the simulated pod's model ([`KvCache`],
//! [`CostModel`] and [`PrefillEngine`] from [`crate::model`]) with
//! `max_batch` sequence slots and a FIFO queue, in simulated microseconds
//! (no sleeping).
//!
//! Pods behave like `kvroute-sim`: a request waits for a sequence slot; on
//! getting one its cached prefix is counted against the cache and the
//! prefills already scheduled (as [`crate::model::PodModel::admit`] does)
//! and its prefill is scheduled on the pod's single FIFO prefill engine
//! ([`PrefillEngine::schedule`]: it starts when the previous prefill is
//! done and takes `CostModel::prefill_compute(uncached tokens)`); at the
//! end of prefill its blocks enter the cache, its first token follows the
//! per-request overhead (TTFT = slot wait + engine wait + own prefill +
//! overhead); it keeps the slot for `(output_tokens − 1) × decode step`
//! more, decoding concurrently with everything else.
//!
//! The kvroute policy runs the routing core for real on the router's view:
//! a [`ClusterState`] fed the pods' protocol v1 reports (precise mode) or
//! the router's own decisions (approximate mode). Report calls follow the
//! service's own [`ReportPolling`]: long-poll by default (a pod holds the
//! call until its cache logs an event, then answers [`REPORT_LATENCY_US`]
//! later, or answers empty when the wait ends; the next call goes out
//! once the answer is folded, at most every `MIN_CALL_GAP_MS`), interval
//! polling with `reportLongPoll: false` (each call answered
//! [`REPORT_LATENCY_US`] after it was sent). Every answer is folded and
//! published at once (the service publishes within 5 ms of it, or on
//! its next 50 ms tick); on its 50 ms tick the service sends the calls
//! that are due, and every interval a round publishes too. The published
//! snapshot
//! is read through [`SnapshotIndex`] exactly
//! like the filter (plus, in approximate mode, the worker's overlay of its
//! own decisions); queue = reported waiting + routed since the report;
//! [`ScoringPolicy::decide`] picks. With every pod excluded, under
//! `onNoEligiblePod: "reject"` the 503 is retried by the client after
//! `retryAfterSeconds`; under `"wait"` the request waits in the gateway's
//! [`WaitQueue`] (the proxy's own policy, one queue as for one worker) and
//! is routed again when a request ends or a report arrives — the moments
//! the router's view of a pod's queue changes — in the queue's order; a
//! request a full queue sends on, or one held past `maxWaitMs`, goes to a
//! pod past `maxQueue` (`onWaitLimit: "route"`), or gets the 503 and is
//! retried (`"reject"`, or no healthy pod; deadlines are checked at those
//! same moments).
//!
//! Same workload, configuration and seed → same numbers: no wall clock,
//! no hash-order iteration, ties broken by sequence numbers.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::Duration;

use kvroute::cluster::{ClusterState, PUBLISH_BUCKETS};
use kvroute::config::{Config, IndexMode, PodConfig, TierCredits};
use kvroute::config::{NoPodPolicy, WaitLimitPolicy};
use kvroute::memory::{Published, RouterMemory};
use kvroute::polling::ReportPolling;
use kvroute::queueing::{Admission, Placement, Priority, WaitPolicy, WaitQueue};
use kvroute::router::{Attempt, Outcome, Router, RoutingRequest};
use kvroute::scoring::ttft::Work;
use kvroute::snapshot::{PodTable, SlotLoad, SnapshotIndex};
use xxhash_rust::xxh64::xxh64;

use super::workload::{Request, Workload};
use crate::model::{CostModel, KvCache, PodLoad, PrefillEngine, DEFAULT_LOG_EVENTS};

/// The report service's tick: due report calls go out on it (or on an
/// answer), a round (publication) on the first tick it is due.
const SERVICE_TICK_US: u64 = 50_000;

/// How long a simulated pod takes to answer a report call once it has
/// something to say (build, send, Envoy, fold): a few ms on loopback.
pub const REPORT_LATENCY_US: u64 = 2_000;

/// The simulated pods: alike but for their prefill speed.
#[derive(Debug, Clone, PartialEq)]
pub struct PodSpec {
    pub count: usize,
    /// KV cache capacity per pod, in blocks.
    pub kv_blocks: usize,
    /// CPU-tier blocks per pod (0: none; see [`KvCache::with_cpu_tier`]).
    pub cpu_kv_blocks: usize,
    /// Sequence slots per pod (requests admitted at once, prefill to last
    /// token).
    pub max_batch: usize,
    pub cost: CostModel,
    /// Per pod, its prefill speed as a multiple of `cost`'s (a mixed pool:
    /// `[1, 1, 0.5, 0.5]`); pods past the list, or all when it is empty,
    /// run at 1.
    pub prefill_speeds: Vec<f64>,
}

impl PodSpec {
    /// The cost model of pod `pod` ([`PodSpec::prefill_speeds`]).
    pub fn cost_of(&self, pod: usize) -> CostModel {
        let speed = self.prefill_speeds.get(pod).copied().unwrap_or(1.0);
        CostModel {
            prefill_s_per_token: self.cost.prefill_s_per_token / speed,
            ..self.cost.clone()
        }
    }
}

/// Who picks the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Policy {
    Kvroute,
    /// kvroute crediting a block in any tier as a GPU block
    /// (`tierCredits` 1, 1): what it did before it knew tiers.
    KvrouteTierBlind,
    RoundRobin,
    LeastRequest,
    Random,
    RingHash,
}

impl Policy {
    pub const ALL: [Policy; 6] = [
        Policy::Kvroute,
        Policy::KvrouteTierBlind,
        Policy::RoundRobin,
        Policy::LeastRequest,
        Policy::Random,
        Policy::RingHash,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Kvroute => "kvroute",
            Policy::KvrouteTierBlind => "kvroute_tier_blind",
            Policy::RoundRobin => "round_robin",
            Policy::LeastRequest => "least_request",
            Policy::Random => "random",
            Policy::RingHash => "ring_hash",
        }
    }

    /// kvroute's router, whatever its credits.
    pub fn is_kvroute(self) -> bool {
        matches!(self, Policy::Kvroute | Policy::KvrouteTierBlind)
    }

    pub fn parse(name: &str) -> Result<Policy, String> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| {
                format!(
                    "unknown policy {name:?} (known: {})",
                    Policy::ALL.map(Policy::name).join(", ")
                )
            })
    }
}

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestOutcome {
    pub line: usize,
    /// The request's session (what ring hash keys on): a conversation, an
    /// agent, or the trace's first block.
    pub session_key: u64,
    pub pod: usize,
    pub arrival_us: u64,
    /// Arrival (first try) to first token.
    pub ttft_us: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Of `cached_tokens`, those reloaded from the CPU tier.
    pub reload_tokens: u64,
    /// 503s the router answered before routing it.
    pub rejections: u32,
    /// Arrival (first try) to being sent to its pod: gateway waiting and
    /// 503 retries (0 for the cache-blind policies, which never hold a
    /// request: their queueing is on the pods, inside TTFT).
    pub wait_us: u64,
    /// Prompt tokens its pod prefilled for it.
    pub prefilled_tokens: u64,
    /// kvroute: the TTFT model's prediction for it (from being sent to
    /// its first token), made as its first token arrived and before the
    /// model learned from it ([`kvroute::scoring::ttft::Observation`]).
    pub predicted_ttft_us: Option<u64>,
    /// kvroute: what the router expected its pod to prefill for it, and
    /// the work the prediction counts (that plus the prefill queued
    /// ahead), at the decision: set against `prefilled_tokens` and the
    /// TTFT they tell where the model's error comes from.
    pub routed_prefill_tokens: u64,
    pub work_tokens: u64,
}

/// The numbers of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub requests: usize,
    /// Σ cached prompt tokens / Σ prompt tokens.
    pub hit_rate: f64,
    /// Of `hit_rate`, the share reloaded from the CPU tier.
    pub cpu_hit_rate: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub ttft_mean_ms: f64,
    /// Largest fraction of the requests one pod got.
    pub max_pod_share: f64,
    pub pod_shares: Vec<f64>,
    /// 503s answered (each followed by a retry).
    pub rejections: u64,
    /// [`RequestOutcome::wait_us`] percentiles.
    pub wait_p50_ms: f64,
    pub wait_p99_ms: f64,
    /// Per pod, its share of the prompt tokens prefilled.
    pub prefill_shares: Vec<f64>,
    /// Median of `|predicted − actual| / actual` TTFT (from being sent),
    /// over the requests kvroute predicted.
    pub prediction_error_p50: Option<f64>,
}

impl Summary {
    pub fn of(outcomes: &[RequestOutcome], pods: usize) -> Summary {
        let n = outcomes.len();
        let prompt: u64 = outcomes.iter().map(|o| o.prompt_tokens).sum();
        let cached: u64 = outcomes.iter().map(|o| o.cached_tokens).sum();
        let reloaded: u64 = outcomes.iter().map(|o| o.reload_tokens).sum();
        let share = |tokens: u64| tokens as f64 / prompt.max(1) as f64;
        let sorted = |value: fn(&RequestOutcome) -> u64| {
            let mut values: Vec<u64> = outcomes.iter().map(value).collect();
            values.sort_unstable();
            values
        };
        let ttft = sorted(|o| o.ttft_us);
        let wait = sorted(|o| o.wait_us);
        let mut counts = vec![0usize; pods];
        for o in outcomes {
            counts[o.pod] += 1;
        }
        let pod_shares: Vec<f64> = counts.iter().map(|&c| c as f64 / n.max(1) as f64).collect();
        let mut prefilled = vec![0u64; pods];
        for o in outcomes {
            prefilled[o.pod] += o.prefilled_tokens;
        }
        let all_prefilled = prefilled.iter().sum::<u64>().max(1) as f64;
        let mut errors: Vec<f64> = outcomes
            .iter()
            .filter_map(|o| {
                let actual = o.ttft_us.saturating_sub(o.wait_us).max(1) as f64;
                o.predicted_ttft_us
                    .map(|p| (p as f64 - actual).abs() / actual)
            })
            .collect();
        errors.sort_by(f64::total_cmp);
        Summary {
            requests: n,
            hit_rate: share(cached),
            cpu_hit_rate: share(reloaded),
            ttft_p50_ms: percentile(&ttft, 0.50) as f64 / 1000.0,
            ttft_p90_ms: percentile(&ttft, 0.90) as f64 / 1000.0,
            ttft_p99_ms: percentile(&ttft, 0.99) as f64 / 1000.0,
            ttft_mean_ms: ttft.iter().sum::<u64>() as f64 / n.max(1) as f64 / 1000.0,
            max_pod_share: pod_shares.iter().copied().fold(0.0, f64::max),
            pod_shares,
            rejections: outcomes.iter().map(|o| u64::from(o.rejections)).sum(),
            wait_p50_ms: percentile(&wait, 0.50) as f64 / 1000.0,
            wait_p99_ms: percentile(&wait, 0.99) as f64 / 1000.0,
            prefill_shares: prefilled
                .iter()
                .map(|&t| t as f64 / all_prefilled)
                .collect(),
            prediction_error_p50: errors.get(errors.len() / 2).copied(),
        }
    }
}

/// Nearest-rank percentile of sorted values (0 when empty).
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// One policy's run.
#[derive(Debug, Clone)]
pub struct RunResult {
    pub policy: Policy,
    pub outcomes: Vec<RequestOutcome>,
    pub summary: Summary,
}

/// Token-weighted hit rate of one LRU cache of `capacity` blocks (`None`:
/// unbounded) seeing every request in arrival order, stored at once: the
/// pooled-cache bound (capacity = pods × kv-blocks) and the infinite-cache
/// bound.
pub fn cache_bound(workload: &Workload, capacity: Option<usize>) -> f64 {
    let mut cache = KvCache::new(capacity.unwrap_or(usize::MAX), 1);
    let (mut cached, mut prompt) = (0u64, 0u64);
    for r in &workload.requests {
        cached += r.coverage.tokens(cache.cached_prefix(&r.chain) as u32);
        prompt += r.prompt_tokens;
        cache.insert_chain(&r.chain);
    }
    if prompt == 0 {
        0.0
    } else {
        cached as f64 / prompt as f64
    }
}

/// Pod slots and addresses of the simulated pods in a router config.
pub fn sim_pods(count: usize) -> Vec<PodConfig> {
    (0..count)
        .map(|i| PodConfig {
            id: format!("pod-{i}"),
            address: format!("10.0.{}.{}:8000", i / 250, i % 250 + 1),
            report_address: None,
            metrics_address: None,
            attributes: Default::default(),
        })
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// A pod finished a prefill: blocks enter its cache.
    PrefillDone,
    /// A request's first token reaches the router: its queued prefill is
    /// released, and kvroute's TTFT model learns from it.
    FirstToken,
    /// A pod's prefill engine starts a request's prefill.
    PrefillStart,
    /// A request's last token: its slot frees.
    Finish,
    /// A pod answers report call number `request` (kvroute, precise mode).
    ReportAnswer,
    /// The report service's tick (kvroute only).
    Tick,
    /// A request reaches the router (first try or retry).
    Arrival,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Event {
    time_us: u64,
    kind: Kind,
    seq: u64,
    request: usize,
    pod: usize,
}

struct Pod {
    cache: KvCache,
    engine: PrefillEngine,
    /// Requests holding a sequence slot.
    slots_used: usize,
    /// Requests waiting for a slot.
    waiting: VecDeque<usize>,
    /// Requests holding a slot whose prefill has not started.
    prefill_queued: usize,
    /// Sent and before their first token.
    awaiting_answer: u32,
    /// Routed and not finished (the filter's in-flight counter).
    inflight: u32,
    /// Their prompt tokens the router expected to be prefilled here, until
    /// each one's first token (the filter's queued prefill).
    queued_prefill: u32,
    /// Their attention, counted alike (the filter's queued attention).
    queued_attention: u32,
    /// The report call this pod has not answered yet.
    report_call: Option<HeldCall>,
}

/// A report call a pod has not answered.
#[derive(Debug, Clone, Copy)]
struct HeldCall {
    id: usize,
    /// Waiting for a cache event (long-poll), not yet scheduled to answer.
    waiting: bool,
}

impl Pod {
    fn new(kv_blocks: usize, cpu_kv_blocks: usize, log_events: usize) -> Pod {
        Pod {
            cache: KvCache::new(kv_blocks, log_events).with_cpu_tier(cpu_kv_blocks),
            engine: PrefillEngine::new(),
            slots_used: 0,
            waiting: VecDeque::new(),
            prefill_queued: 0,
            awaiting_answer: 0,
            inflight: 0,
            queued_prefill: 0,
            queued_attention: 0,
            report_call: None,
        }
    }

    /// What the filter's in-flight value says of this pod: in approximate
    /// mode a request stops counting at its first token
    /// ([`SlotLoad::requests`]).
    fn slot_load(&self, mode: IndexMode) -> SlotLoad {
        SlotLoad {
            requests: match mode {
                IndexMode::Approximate => self.awaiting_answer,
                IndexMode::Precise => self.inflight,
            },
            prefill_tokens: self.queued_prefill,
            prefill_attention: self.queued_attention,
            streams: self.inflight,
        }
    }

    /// In prefill or decode (as `kvroute-sim` reports `running`).
    fn running(&self) -> usize {
        self.slots_used - self.prefill_queued
    }

    /// As `kvroute-sim` reports it: queue = waiting for a slot or for the
    /// prefill to start.
    fn load(&self, max_batch: usize) -> PodLoad {
        PodLoad {
            queue_depth: (self.waiting.len() + self.prefill_queued) as u32,
            running: self.running() as u32,
            gpu_utilization: (self.running() as f64 / max_batch as f64).clamp(0.0, 1.0),
            health: 1.0,
            adapters: Vec::new(),
        }
    }
}

/// Runs `policy` over `workload`. `config` is the router's configuration
/// (its pods are the simulated pods, see [`sim_pods`]); `seed` drives the
/// random baseline.
pub fn simulate(
    workload: &Workload,
    spec: &PodSpec,
    policy: Policy,
    config: &Config,
    seed: u64,
) -> RunResult {
    Simulation::new(workload, spec, policy, config, seed).run()
}

struct Simulation<'a> {
    requests: &'a [Request],
    spec: &'a PodSpec,
    policy: Policy,
    pods: Vec<Pod>,
    events: BinaryHeap<Reverse<Event>>,
    seq: u64,
    outcomes: Vec<RequestOutcome>,
    /// Arrivals (first tries and retries) not yet handled.
    pending_arrivals: usize,
    chooser: Chooser<'a>,
    retry_after_us: u64,
    interval_us: u64,
    /// When the service's next round (publication) is due.
    next_round_us: u64,
    /// Report calls sent so far (call ids).
    report_calls: usize,
    /// Requests waiting in the gateway (kvroute under `"wait"`).
    gateway: Option<WaitQueue<usize>>,
    /// Per request, the prefill tokens and their attention counted on its
    /// pod until its first token.
    queued_prefill: Vec<(u32, u32)>,
    /// Per request routed by kvroute: when it was sent and the prefill
    /// work ahead of it (what the TTFT model learns from).
    sent: Vec<Option<(u64, Work)>>,
}

enum Chooser<'a> {
    Kvroute(Box<KvrouteView<'a>>),
    RoundRobin(usize),
    LeastRequest,
    Random(u64),
    RingHash(Vec<(u64, usize)>),
}

impl<'a> Simulation<'a> {
    fn new(
        workload: &'a Workload,
        spec: &'a PodSpec,
        policy: Policy,
        config: &'a Config,
        seed: u64,
    ) -> Simulation<'a> {
        let pods = (0..spec.count)
            .map(|_| Pod::new(spec.kv_blocks, spec.cpu_kv_blocks, DEFAULT_LOG_EVENTS))
            .collect();
        let chooser = match policy {
            Policy::Kvroute => Chooser::Kvroute(Box::new(KvrouteView::new(
                config,
                spec.count,
                config.tier_credits.clone(),
            ))),
            Policy::KvrouteTierBlind => Chooser::Kvroute(Box::new(KvrouteView::new(
                config,
                spec.count,
                TierCredits::BLIND,
            ))),
            Policy::RoundRobin => Chooser::RoundRobin(0),
            Policy::LeastRequest => Chooser::LeastRequest,
            Policy::Random => Chooser::Random(seed ^ 0x5eed_0000_7a6d_0001),
            Policy::RingHash => Chooser::RingHash(ring(spec.count)),
        };
        let outcomes = workload
            .requests
            .iter()
            .map(|r| RequestOutcome {
                line: r.line,
                session_key: r.session_key,
                pod: 0,
                arrival_us: r.arrival_us,
                ttft_us: 0,
                prompt_tokens: r.prompt_tokens,
                cached_tokens: 0,
                reload_tokens: 0,
                rejections: 0,
                wait_us: 0,
                prefilled_tokens: 0,
                predicted_ttft_us: None,
                routed_prefill_tokens: 0,
                work_tokens: 0,
            })
            .collect();
        let mut sim = Simulation {
            requests: &workload.requests,
            spec,
            policy,
            pods,
            events: BinaryHeap::new(),
            seq: 0,
            outcomes,
            pending_arrivals: 0,
            chooser,
            retry_after_us: u64::from(config.retry_after_seconds.max(1)) * 1_000_000,
            interval_us: config.pod_report_interval_ms * 1000,
            next_round_us: 0,
            report_calls: 0,
            gateway: (policy.is_kvroute() && config.on_no_eligible_pod == NoPodPolicy::Wait)
                .then(|| WaitQueue::new(WaitPolicy::from_config(config))),
            queued_prefill: vec![(0, 0); workload.requests.len()],
            sent: vec![None; workload.requests.len()],
        };
        for (i, r) in workload.requests.iter().enumerate() {
            sim.push(r.arrival_us, Kind::Arrival, i, 0);
            sim.pending_arrivals += 1;
        }
        if policy.is_kvroute() && !workload.requests.is_empty() {
            sim.push(0, Kind::Tick, 0, 0);
        }
        sim
    }

    fn push(&mut self, time_us: u64, kind: Kind, request: usize, pod: usize) {
        self.seq += 1;
        self.events.push(Reverse(Event {
            time_us,
            kind,
            seq: self.seq,
            request,
            pod,
        }));
    }

    fn run(mut self) -> RunResult {
        while let Some(Reverse(event)) = self.events.pop() {
            let now = event.time_us;
            match event.kind {
                Kind::PrefillDone => {
                    let requests = self.requests;
                    let chain = &requests[event.request].chain;
                    let pod = &mut self.pods[event.pod];
                    pod.engine.finish(chain);
                    pod.cache.insert_chain(chain);
                    // A held long-poll answers now that there is an event.
                    if let Some(call) = pod.report_call.as_mut().filter(|c| c.waiting) {
                        call.waiting = false;
                        let id = call.id;
                        self.push(now + REPORT_LATENCY_US, Kind::ReportAnswer, id, event.pod);
                    }
                }
                Kind::FirstToken => {
                    let pod = &mut self.pods[event.pod];
                    let (tokens, attention) =
                        std::mem::take(&mut self.queued_prefill[event.request]);
                    pod.queued_prefill -= tokens;
                    pod.queued_attention -= attention;
                    pod.awaiting_answer -= 1;
                    if let (Some((sent, work)), Chooser::Kvroute(view)) =
                        (self.sent[event.request], &mut self.chooser)
                    {
                        let ttft_ms = (now - sent) as f64 / 1000.0;
                        if let Some(seen) = view.memory.ttft.observe(event.pod, work, ttft_ms) {
                            self.outcomes[event.request].predicted_ttft_us =
                                Some((seen.predicted_ms * 1000.0) as u64);
                        }
                    }
                    // As the filter: in approximate mode the pod's queue
                    // just shrank.
                    if matches!(&self.chooser, Chooser::Kvroute(view) if view.config.mode == IndexMode::Approximate)
                    {
                        self.dispatch_gateway(now);
                    }
                }
                Kind::PrefillStart => {
                    self.pods[event.pod].prefill_queued -= 1;
                }
                Kind::Finish => {
                    let pod = &mut self.pods[event.pod];
                    pod.slots_used -= 1;
                    pod.inflight -= 1;
                    if let Some(next) = pod.waiting.pop_front() {
                        self.start(event.pod, next, now);
                    }
                    self.dispatch_gateway(now);
                }
                Kind::ReportAnswer => {
                    let pod = &mut self.pods[event.pod];
                    if pod.report_call.is_some_and(|c| c.id == event.request) {
                        pod.report_call = None;
                        if let Chooser::Kvroute(view) = &mut self.chooser {
                            view.answer(event.pod, now, &self.pods[event.pod], self.spec.max_batch);
                            view.publish(now);
                        }
                        self.send_reports(now);
                        self.dispatch_gateway(now);
                    }
                }
                Kind::Tick => {
                    let round = now >= self.next_round_us;
                    if let Chooser::Kvroute(view) = &mut self.chooser {
                        // Pending decisions expire on the tick, as in the service.
                        if round {
                            view.publish(now);
                        } else {
                            view.publish_buckets(now / 1000);
                        }
                    }
                    if round {
                        self.next_round_us = now + self.interval_us;
                        self.dispatch_gateway(now);
                    }
                    self.send_reports(now);
                    if !self.finished() {
                        let tick = self.interval_us.min(SERVICE_TICK_US);
                        self.push(now + tick, Kind::Tick, 0, 0);
                    }
                }
                Kind::Arrival => {
                    self.pending_arrivals -= 1;
                    self.arrive(event.request, now);
                }
            }
        }
        let summary = Summary::of(&self.outcomes, self.spec.count);
        RunResult {
            policy: self.policy,
            outcomes: self.outcomes,
            summary,
        }
    }

    /// Sends the report calls the router's [`ReportPolling`] finds due: a
    /// pod answers [`REPORT_LATENCY_US`] later, unless the call waits and
    /// the pod has nothing after the call's `since`: then it holds it
    /// until its next cache event or the end of the wait.
    fn send_reports(&mut self, now: u64) {
        let finished = self.finished();
        let Chooser::Kvroute(view) = &mut self.chooser else {
            return;
        };
        if view.config.mode != IndexMode::Precise || finished {
            return;
        }
        let mut answers = Vec::new();
        for (slot, pod) in self.pods.iter_mut().enumerate() {
            let Some(call) = view.polling.next_call(&view.pod_ids[slot], now / 1000) else {
                continue;
            };
            self.report_calls += 1;
            let id = self.report_calls;
            let hold = call
                .wait_ms
                .filter(|_| view.since[slot] == Some(pod.cache.seq()));
            pod.report_call = Some(HeldCall {
                id,
                waiting: hold.is_some(),
            });
            let delay = hold.map_or(REPORT_LATENCY_US, |wait| wait * 1000);
            answers.push((now + delay, id, slot));
        }
        for (time, id, slot) in answers {
            self.push(time, Kind::ReportAnswer, id, slot);
        }
    }

    /// Every request has arrived and none waits in the gateway: later
    /// reports and ticks change nothing.
    fn finished(&self) -> bool {
        self.pending_arrivals == 0 && self.gateway.as_ref().is_none_or(|q| q.is_empty())
    }

    fn arrive(&mut self, index: usize, now: u64) {
        // Requests already waiting go first.
        self.dispatch_gateway(now);
        let behind = self
            .gateway
            .as_ref()
            .is_some_and(|q| q.must_queue(Priority::Standard));
        let mut holding_out = false;
        if !behind {
            match self.choose(index, now, Attempt::Arrival) {
                Placement::Placed => return,
                Placement::HoldingOut => holding_out = true,
                Placement::Wait | Placement::Gone => {}
            }
        }
        let Some(gateway) = &mut self.gateway else {
            self.reject(index, now);
            return;
        };
        match gateway.admit(
            index as u32,
            Priority::Standard,
            now / 1000,
            holding_out,
            index,
        ) {
            Admission::Queued => {}
            Admission::Displaced(victim) => self.wait_limit(victim.item, now),
            Admission::Refused(index) => self.wait_limit(index, now),
        }
    }

    /// The gateway can hold request `index` no longer: as `onWaitLimit`
    /// says, routed past `maxQueue` or answered 503.
    fn wait_limit(&mut self, index: usize, now: u64) {
        let route = matches!(&self.chooser, Chooser::Kvroute(view) if view.config.on_wait_limit == WaitLimitPolicy::Route);
        if !route || self.choose(index, now, Attempt::PastWaitLimit) != Placement::Placed {
            self.reject(index, now);
        }
    }

    /// A 503: the client retries after `retryAfterSeconds`.
    fn reject(&mut self, index: usize, now: u64) {
        self.outcomes[index].rejections += 1;
        self.pending_arrivals += 1;
        self.push(now + self.retry_after_us, Kind::Arrival, index, 0);
    }

    /// Gateway waiting: 503s past the deadline, then a dispatch round.
    fn dispatch_gateway(&mut self, now: u64) {
        let Some(mut gateway) = self.gateway.take() else {
            return;
        };
        // The queue keeps time in milliseconds.
        let now_ms = now / 1000;
        for waiter in gateway.expire(now_ms) {
            self.wait_limit(waiter.item, now);
        }
        gateway.dispatch(now_ms, |waiter| {
            let holding_ms = waiter.holding_ms(now_ms);
            self.choose(waiter.item, now, Attempt::Waiting { holding_ms })
        });
        self.gateway = Some(gateway);
    }

    /// Routes request `index` as `policy` does: [`Placement::Placed`] when
    /// it was sent to a pod.
    fn choose(&mut self, index: usize, now: u64, attempt: Attempt) -> Placement {
        let requests = self.requests;
        let request = &requests[index];
        let inflight: Vec<u32> = self.pods.iter().map(|p| p.inflight).collect();
        let n = self.pods.len();
        let mut prefill = (0, 0);
        let pod = match &mut self.chooser {
            Chooser::Kvroute(view) => {
                let mode = view.config.mode;
                let loads: Vec<SlotLoad> = self.pods.iter().map(|p| p.slot_load(mode)).collect();
                match view.choose(request, &loads, now / 1000, attempt) {
                    Ok((pod, counted, work)) => {
                        prefill = counted;
                        self.sent[index] = Some((now, work));
                        let outcome = &mut self.outcomes[index];
                        outcome.routed_prefill_tokens = u64::from(counted.0);
                        outcome.work_tokens = work.tokens;
                        pod
                    }
                    Err(placement) => return placement,
                }
            }
            Chooser::RoundRobin(next) => {
                let pod = *next % n;
                *next += 1;
                pod
            }
            Chooser::LeastRequest => (0..n).min_by_key(|&p| (inflight[p], p)).unwrap_or(0),
            Chooser::Random(state) => (splitmix(state) % n as u64) as usize,
            Chooser::RingHash(ring) => ring_pick(ring, request.session_key),
        };
        self.send(index, pod, prefill, now);
        Placement::Placed
    }

    /// Request `index` is sent to `pod` at `now`, counted as
    /// `prefill` (tokens, attention) queued there until its first token.
    fn send(&mut self, index: usize, pod: usize, prefill: (u32, u32), now: u64) {
        let outcome = &mut self.outcomes[index];
        outcome.pod = pod;
        outcome.wait_us = now - outcome.arrival_us;
        self.queued_prefill[index] = prefill;
        let state = &mut self.pods[pod];
        state.inflight += 1;
        state.awaiting_answer += 1;
        state.queued_prefill += prefill.0;
        state.queued_attention += prefill.1;
        if state.slots_used < self.spec.max_batch && state.waiting.is_empty() {
            self.start(pod, index, now);
        } else {
            state.waiting.push_back(index);
        }
    }

    /// `index` gets a sequence slot on `pod` at `now`: its prefill joins
    /// the pod's prefill engine.
    fn start(&mut self, pod: usize, index: usize, now: u64) {
        let requests = self.requests;
        let request = &requests[index];
        let state = &mut self.pods[pod];
        state.slots_used += 1;
        state.prefill_queued += 1;
        let cached = state
            .engine
            .cached(&state.cache, &request.chain, &request.coverage);
        let cost = &self.spec.cost_of(pod);
        let ready = state
            .engine
            .reload(cost, Duration::from_micros(now), cached.reload_tokens);
        let slot = state.engine.schedule(
            cost,
            ready,
            request.prompt_tokens - cached.tokens,
            &request.chain,
        );
        let micros = |d: Duration| d.as_micros() as u64;
        let first_token = micros(slot.first_token);
        let decode = micros(cost.generation_after_first(request.output_tokens));
        let outcome = &mut self.outcomes[index];
        outcome.cached_tokens = cached.tokens;
        outcome.reload_tokens = cached.reload_tokens;
        outcome.prefilled_tokens = request.prompt_tokens - cached.tokens;
        outcome.ttft_us = first_token - outcome.arrival_us;
        self.push(micros(slot.start), Kind::PrefillStart, index, pod);
        self.push(micros(slot.end), Kind::PrefillDone, index, pod);
        self.push(first_token, Kind::FirstToken, index, pod);
        self.push(first_token + decode, Kind::Finish, index, pod);
    }
}

/// splitmix64 step.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Virtual nodes per pod on the hash ring.
const RING_VNODES: usize = 160;

/// A consistent-hash ring: sorted (point, pod).
fn ring(pods: usize) -> Vec<(u64, usize)> {
    let mut points: Vec<(u64, usize)> = (0..pods)
        .flat_map(|p| {
            (0..RING_VNODES).map(move |v| (xxh64(format!("pod-{p}_{v}").as_bytes(), 0), p))
        })
        .collect();
    points.sort_unstable();
    points
}

/// The pod owning `key`: the first point at or after its hash, wrapping.
fn ring_pick(ring: &[(u64, usize)], key: u64) -> usize {
    let hash = xxh64(&key.to_le_bytes(), 0);
    let at = ring.partition_point(|&(point, _)| point < hash);
    ring[at % ring.len()].1
}

/// The report epoch every simulated pod uses (no restarts).
const EPOCH: &str = "replay";

/// The router's side of the kvroute policy: the service's cluster state and
/// what it last published, the filter's overlay and scoring policy.
struct KvrouteView<'a> {
    config: &'a Config,
    cluster: ClusterState,
    router: Router,
    table: PodTable,
    /// The published index buckets (Envoy shared data).
    buckets: HashMap<u32, Vec<u8>>,
    /// Per pod, the `since` of its next report (None: never reported).
    since: Vec<Option<u64>>,
    polling: ReportPolling,
    pod_ids: Vec<String>,
    requests: u64,
    /// What the filter learns ([`RouterMemory`]); its TTFT model learns
    /// from first tokens.
    memory: RouterMemory,
}

impl<'a> KvrouteView<'a> {
    /// The router credits tiers by `credits` (the index keeps them
    /// whatever they are).
    fn new(config: &'a Config, pods: usize, credits: TierCredits) -> KvrouteView<'a> {
        KvrouteView {
            config,
            cluster: ClusterState::new(config, 0),
            router: Router::new(Config {
                tier_credits: credits,
                ..config.clone()
            }),
            table: PodTable::default(),
            buckets: HashMap::new(),
            since: vec![None; pods],
            polling: ReportPolling::new(config),
            pod_ids: config.pods.iter().map(|p| p.id.clone()).collect(),
            requests: 0,
            memory: RouterMemory::new(config),
        }
    }

    /// Pod `slot` answers its report call: the service folds it and tells
    /// its [`ReportPolling`].
    fn answer(&mut self, slot: usize, now_us: u64, pod: &Pod, max_batch: usize) {
        let now_ms = now_us / 1000;
        let id = &self.pod_ids[slot];
        let since = self.since[slot];
        let body = pod
            .cache
            .report(id, EPOCH, since, since.map(|_| EPOCH), &pod.load(max_batch))
            .to_string();
        self.polling.answered(id, now_ms);
        let (result, _) = self
            .cluster
            .apply_report(id, body.as_bytes(), now_ms, pod.inflight);
        let summary = result.expect("a simulated pod's report folds");
        self.polling.folded(id, now_ms, summary.changed_index());
        self.since[slot] = Some(pod.cache.seq());
    }

    /// The service publishes its snapshot.
    fn publish(&mut self, now_us: u64) {
        let publication = self.cluster.publish(now_us / 1000);
        for (bucket, bytes) in publication.buckets {
            self.buckets.insert(bucket, bytes);
        }
        self.table = publication.table;
    }

    /// The filter's decision for `request` (the core's own
    /// [`Router::route_prepared`] on the published view): the pod, its
    /// prefill tokens and their attention as the filter counts them, and
    /// the prefill work ahead of its first token, or
    /// why it is not routed ([`Placement::Wait`]: no pod can take it, a
    /// 503 under `"reject"`).
    fn choose(
        &mut self,
        request: &Request,
        inflight: &[SlotLoad],
        now_ms: u64,
        attempt: Attempt,
    ) -> Result<(usize, (u32, u32), Work), Placement> {
        self.requests += 1;
        if self.table.pods.is_empty() {
            return Err(Placement::Wait); // nothing published yet
        }
        let prepared = if request.routable {
            RoutingRequest {
                model: String::new(),
                adapter: None,
                // The router sees the first maxPrefixBlocks of the pods' chain.
                chain: request.chain[..request.chain.len().min(self.config.max_prefix_blocks)]
                    .to_vec(),
                coverage: request.coverage,
                degraded: None,
                answer_reports_usage: true,
                streamed: true,
                ttft_target_ms: self
                    .config
                    .balance
                    .ttft_target_ms
                    .as_ref()
                    .and_then(|t| t.of(super::workload::DEFAULT_MODEL)),
                follows_up: request.follows_up,
            }
        } else {
            RoutingRequest::by_load(String::new(), "request body exceeds maxBodyBytes".into())
        };
        let snapshot = SnapshotIndex {
            buckets: self.table.buckets,
            fetch: |b| self.buckets.get(&b).cloned(),
        };
        let published = Published {
            table: &self.table,
            index: &snapshot,
            inflight,
            // The simulated service publishes every interval and never
            // freezes, so its snapshot is never stale.
            now_ms: self.table.published_at_ms,
        };
        let routed =
            match self
                .memory
                .route(&self.router, prepared, published, self.requests, attempt)
            {
                Outcome::Routed(routed) => routed,
                Outcome::NoEligiblePod(waiting) if waiting.holding_out.is_some() => {
                    return Err(Placement::HoldingOut)
                }
                Outcome::NoEligiblePod(_) | Outcome::Rejected(_) => return Err(Placement::Wait),
            };
        // As the service does on the decision queue: recorded and its
        // buckets published at once.
        self.cluster.record_decision(
            routed.slot,
            &routed.chain,
            now_ms,
            self.memory
                .ttft
                .prefilled_after_ms(routed.predicted_ttft_ms) as u32,
        );
        self.publish_buckets(now_ms);
        Ok((
            routed.slot,
            (routed.prefill_tokens, routed.prefill_attention),
            routed.work,
        ))
    }

    /// The service writes the buckets its pending decisions changed
    /// (recorded or expired), without a new pod table.
    fn publish_buckets(&mut self, now_ms: u64) {
        for (bucket, bytes) in self.cluster.publish_buckets(now_ms, PUBLISH_BUCKETS) {
            self.buckets.insert(bucket, bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{AdapterSlots, PodModel};
    use crate::replay::workload::DEFAULT_MODEL;
    use crate::trace::{completions_body, TraceRequest};
    use kvroute::config::ModelTarget;
    use kvroute::index::Merged;
    use kvroute::request::Prompt;
    use kvroute::router::{ClusterView, Outcome, Router};

    fn trace(n: usize) -> Vec<TraceRequest> {
        (0..n)
            .map(|i| {
                let family = (i % 3) as u64;
                let mut ids: Vec<u64> = (0..4).map(|b| family * 100 + b).collect();
                ids.push(1000 + i as u64);
                TraceRequest {
                    line: i + 1,
                    timestamp_ms: i as f64 * 300.0,
                    input_length: 5 * 512 - 100,
                    output_length: 20,
                    hash_ids: ids,
                }
            })
            .collect()
    }

    fn config(mode: IndexMode) -> Config {
        let config = Config {
            block_size_bytes: 2048,
            block_size_tokens: 512,
            mode,
            pod_capacity_blocks: 12,
            pods: sim_pods(3),
            ..Config::default()
        };
        config.validate().unwrap();
        config
    }

    /// The replay's kvroute decision is `Router::route`'s on the real body
    /// with the same published view, and the replay's chain is the one the
    /// filter hashes.
    #[test]
    fn decisions_match_the_router_on_real_bodies() {
        for mode in [IndexMode::Precise, IndexMode::Approximate] {
            let config = config(mode);
            let requests = trace(30);
            let workload = Workload::from_mooncake(&requests, &config, DEFAULT_MODEL, 1.0);
            let router = Router::new(config.clone());
            let mut view = KvrouteView::new(&config, 3, config.tier_credits.clone());
            let mut pods: Vec<Pod> = (0..3).map(|_| Pod::new(12, 0, 1000)).collect();
            for (i, (r, t)) in workload.requests.iter().zip(&requests).enumerate() {
                if i % 4 == 0 {
                    let now = i as u64 * 1_000_000;
                    if mode == IndexMode::Precise {
                        for (slot, pod) in pods.iter().enumerate() {
                            view.answer(slot, now, pod, 8);
                        }
                    }
                    view.publish(now);
                }
                let inflight: Vec<SlotLoad> = pods.iter().map(|p| p.slot_load(mode)).collect();
                let body = completions_body(t, DEFAULT_MODEL, false).to_string();
                let expected = {
                    let snapshot = SnapshotIndex {
                        buckets: view.table.buckets,
                        fetch: |b| view.buckets.get(&b).cloned(),
                    };
                    let cluster = ClusterView {
                        table: &view.table,
                        index: &Merged(&snapshot, &view.memory.recent),
                        inflight: &inflight,
                        ttft: &view.memory.ttft,
                        occupancy: &view.memory.occupancy,
                        prefix_demand: &view.memory.prefix_demand,
                        now_ms: view.table.published_at_ms,
                    };
                    match router.route(body.as_bytes(), false, &cluster, view.requests + 1) {
                        Outcome::Routed(routed) => {
                            assert_eq!(routed.chain, r.chain, "request {i}");
                            Some(routed.slot)
                        }
                        Outcome::Rejected(_) | Outcome::NoEligiblePod(_) => None,
                    }
                };
                let chosen = view
                    .choose(r, &inflight, i as u64 * 1000, Attempt::Arrival)
                    .ok()
                    .map(|(pod, _, _)| pod);
                assert_eq!(chosen, expected, "{mode:?} request {i}");
                let pod = chosen.unwrap();
                pods[pod].cache.insert_chain(&r.chain);
                pods[pod].inflight += (i % 2) as u32;
            }
        }
    }

    /// Admission counts cached tokens and prefill as `PodModel::admit` does.
    #[test]
    fn admission_matches_the_pod_model() {
        let config = config(IndexMode::Precise);
        let requests = trace(6);
        let workload = Workload::from_mooncake(&requests, &config, DEFAULT_MODEL, 1.0);
        let cost = CostModel::gpu_8b(1.0);
        let mut model = PodModel::new(
            &config,
            KvCache::new(8, 100),
            AdapterSlots::new(1, Default::default()),
            cost.clone(),
        );
        let target = ModelTarget {
            base_model: DEFAULT_MODEL.into(),
            adapter: None,
        };
        for (r, t) in workload.requests.iter().zip(&requests) {
            let prompt = Prompt::Text(crate::trace::prompt_text(t).into_bytes());
            let admission = model.admit(&target, &prompt, None);
            assert_eq!(admission.chain, r.chain);
            assert_eq!(admission.prompt_tokens, r.prompt_tokens);
            let cached = r
                .coverage
                .tokens(model.cache.cached_prefix(&r.chain) as u32);
            assert_eq!(admission.cached_tokens, cached);
            assert_eq!(admission.prefill, cost.prefill(r.prompt_tokens - cached));
            model.finish_prefill(&admission);
        }
        assert!(!model.cache.is_empty());
    }

    /// The CPU tier in the replay, through the pod model's code: one pod
    /// whose GPU holds one request (5 blocks), three prefix families in
    /// turn. Without a CPU tier every request misses; with 16 blocks of it
    /// the families' prefixes come back from host memory: hits reloaded,
    /// at a fraction of the prefill.
    #[test]
    fn a_cpu_tier_turns_gpu_misses_into_reloads() {
        let config = config(IndexMode::Precise);
        let mut requests = trace(30);
        // One at a time: no prefill shares a pending one's blocks.
        for (i, r) in requests.iter_mut().enumerate() {
            r.timestamp_ms = i as f64 * 2000.0;
        }
        let workload = Workload::from_mooncake(&requests, &config, DEFAULT_MODEL, 1.0);
        let run = |cpu_kv_blocks| {
            let spec = PodSpec {
                count: 1,
                kv_blocks: 5,
                cpu_kv_blocks,
                max_batch: 8,
                cost: CostModel::gpu_8b(1.0),
                prefill_speeds: Vec::new(),
            };
            simulate(&workload, &spec, Policy::RoundRobin, &config, 1).summary
        };
        let (gpu_only, tiered) = (run(0), run(16));
        assert_eq!((gpu_only.hit_rate, gpu_only.cpu_hit_rate), (0.0, 0.0));
        // From the fourth request on, 4 of 5 blocks (2,048 of 2,460 tokens).
        assert!(tiered.hit_rate > 0.7, "{tiered:?}");
        assert_eq!(
            tiered.cpu_hit_rate, tiered.hit_rate,
            "all from the CPU tier"
        );
        // 2,048 tokens reloaded (10.7 ms) instead of prefilled (450 ms).
        let saved = gpu_only.ttft_p50_ms - tiered.ttft_p50_ms;
        assert!((400.0..460.0).contains(&saved), "{saved} ms");
    }

    /// Follow-ups sent 0.2 s after their predecessor (a fresh 4-block
    /// prefix) finished that found the prefix cached, with `long_poll` or
    /// 2 s interval reports. No report round falls between a prefill and
    /// its follow-up, so only long-poll can tell the router in time.
    fn follow_up_hits(long_poll: bool) -> usize {
        let pairs = 12u64;
        let requests: Vec<TraceRequest> = (0..pairs * 2)
            .map(|i| {
                let pair = i / 2;
                TraceRequest {
                    line: i as usize + 1,
                    // The first ends about 0.85 s after it arrives.
                    timestamp_ms: pair as f64 * 4000.0 + 100.0 + (i % 2) as f64 * 1050.0,
                    input_length: 4 * 512 - 100,
                    output_length: 20,
                    hash_ids: (0..4).map(|b| pair * 100 + b).collect(),
                }
            })
            .collect();
        let config = Config {
            report_long_poll: long_poll,
            // Reports alone: the router's own decisions expire at once.
            pending_decision_ms: Some(1),
            ..config(IndexMode::Precise)
        };
        let workload = Workload::from_mooncake(&requests, &config, DEFAULT_MODEL, 1.0);
        let spec = PodSpec {
            count: 3,
            kv_blocks: 1000,
            cpu_kv_blocks: 0,
            max_batch: 8,
            cost: CostModel::gpu_8b(1.0),
            prefill_speeds: Vec::new(),
        };
        let run = simulate(&workload, &spec, Policy::Kvroute, &config, 1);
        run.outcomes
            .iter()
            .skip(1)
            .step_by(2)
            .filter(|o| o.cached_tokens > 0)
            .count()
    }

    #[test]
    fn long_poll_reports_a_fresh_prefix_before_its_follow_up() {
        assert_eq!(follow_up_hits(true), 12);
        let interval = follow_up_hits(false);
        assert!(interval <= 6, "{interval}/12 hits with interval reports");
    }

    /// A burst far above capacity: under "reject" it is answered with 503s
    /// (then retried); under "wait" it waits in the gateway and none is
    /// refused while the queue has room; with a small queue the request
    /// next in line goes to a pod past `maxQueue` (`onWaitLimit: "route"`)
    /// or is refused and retried (`"reject"`). Every request is served in
    /// the end.
    #[test]
    fn a_burst_waits_in_the_gateway_instead_of_503s() {
        let mut requests = trace(60);
        for (i, r) in requests.iter_mut().enumerate() {
            r.timestamp_ms = i as f64 * 10.0;
        }
        let run = |policy: NoPodPolicy, max_waiting: usize, on_wait_limit: WaitLimitPolicy| {
            let config = Config {
                max_queue: 2,
                on_no_eligible_pod: policy,
                max_waiting_requests: max_waiting,
                on_wait_limit,
                pod_report_interval_ms: 200,
                ..config(IndexMode::Precise)
            };
            let workload = Workload::from_mooncake(&requests, &config, DEFAULT_MODEL, 1.0);
            let spec = PodSpec {
                count: 3,
                kv_blocks: 64,
                cpu_kv_blocks: 0,
                max_batch: 1,
                cost: CostModel::gpu_8b(1.0),
                prefill_speeds: Vec::new(),
            };
            let result = simulate(&workload, &spec, Policy::Kvroute, &config, 1);
            assert!(
                result.outcomes.iter().all(|o| o.ttft_us > 0),
                "{policy:?}: every request is served"
            );
            result.summary.rejections
        };
        let (route, reject) = (WaitLimitPolicy::Route, WaitLimitPolicy::Reject);
        assert!(run(NoPodPolicy::Reject, 256, route) > 0);
        assert_eq!(run(NoPodPolicy::Wait, 256, route), 0);
        assert_eq!(run(NoPodPolicy::Wait, 4, route), 0);
        assert!(run(NoPodPolicy::Wait, 4, reject) > 0);
    }

    /// Two fast and two half-speed pods: the slow ones prefill at half
    /// the rate, and kvroute, which learns each pod's rate, gives the fast
    /// ones more of the prefill than round robin does once queues form
    /// (measured: 60 % against 50 %; at
    /// a request every 250 ms the three families stay where they first
    /// landed, one on a fast pod: a copy costs more than a slow prefill of
    /// the tail).
    #[test]
    fn a_mixed_pool_prefills_more_on_its_fast_pods() {
        let spec = PodSpec {
            count: 4,
            kv_blocks: 64,
            cpu_kv_blocks: 0,
            max_batch: 8,
            cost: CostModel::gpu_8b(1.0),
            prefill_speeds: vec![1.0, 1.0, 0.5, 0.5],
        };
        let slow = spec.cost_of(2).prefill_compute(4096);
        assert_eq!(slow, spec.cost_of(0).prefill_compute(4096) * 2);
        assert_eq!(
            spec.cost_of(3).lookup_overhead(),
            spec.cost.lookup_overhead()
        );
        let mut requests = trace(240);
        for (i, r) in requests.iter_mut().enumerate() {
            r.timestamp_ms = i as f64 * 80.0;
        }
        let config = Config {
            pods: sim_pods(4),
            ..config(IndexMode::Precise)
        };
        let workload = Workload::from_mooncake(&requests, &config, DEFAULT_MODEL, 1.0);
        let fast_share = |policy| {
            let run = simulate(&workload, &spec, policy, &config, 1);
            run.summary.prefill_shares[0] + run.summary.prefill_shares[1]
        };
        let (kvroute, round_robin) = (fast_share(Policy::Kvroute), fast_share(Policy::RoundRobin));
        assert!(
            kvroute > round_robin + 0.05,
            "kvroute {kvroute}, round robin {round_robin}"
        );
    }

    #[test]
    fn ring_is_stable_and_spreads() {
        let ring = ring(8);
        let mut counts = [0usize; 8];
        for key in 0..8000u64 {
            counts[ring_pick(&ring, key)] += 1;
            assert_eq!(ring_pick(&ring, key), ring_pick(&ring, key));
        }
        assert!(counts.iter().all(|&c| c > 600 && c < 1500), "{counts:?}");
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 0.5), 50);
        assert_eq!(percentile(&v, 0.99), 99);
        assert_eq!(percentile(&[7], 0.99), 7);
        assert_eq!(percentile(&[], 0.5), 0);
    }
}
