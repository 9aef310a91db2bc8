//! [`ClusterState`]: what the singleton service knows of the pods, folded
//! from their reports and published as a snapshot.
//!
//! Per round the service asks each pod for its report (`?since=SEQ&epoch=E`)
//! and, when `metricsPath` is set, its vLLM metrics. Each answer goes to
//! [`ClusterState::accept_pull`] (failures count at once, good bodies wait
//! in an inbox), [`ClusterState::fold_step`] folds them in steps of bounded
//! work as the service's time budget allows, and
//! [`ClusterState::publish_some`] publishes a bounded part of what changed.
//! Folding rules:
//! - a full report replaces the pod's blocks; a delta applies `stored` then
//!   `removed`. Each stored segment carries its blocks' tier (protocol v1's
//!   `tier`: GPU, CPU or disk), which the index keeps per (block, pod); a
//!   block whose tier changed comes again in `stored` and moves there;
//!   a delta that does not continue the last `seq` of the same
//!   epoch (pod restart, missed report) drops the pod's blocks and asks for
//!   a full resync next tick;
//! - a report is folded in steps ([`FOLD_STEP_BLOCKS`] blocks stored,
//!   removed or dropped each, a dropped root's subtree at once): parse,
//!   drop the pod's
//!   blocks (full or discontinuous), store, remove, then the pod's record.
//!   Publications between steps show the pod's blocks part-way: a resync
//!   happens when the index is already wrong for that pod (restart, gap);
//! - queue: vLLM's `num_requests_waiting` when scraped, else the report's
//!   `queueDepth`; load: the report's `gpuUtilization`, else vLLM's
//!   `kv_cache_usage_perc`; adapters: both sources together;
//! - health: the reported health (1.0 until a pod reports one), times the
//!   staleness factor of [`crate::staleness`], so a silent pod is excluded
//!   after about three missed reports and recovers on its next good one;
//! - failures (unreachable, HTTP status, malformed, wrong pod) are counted
//!   per pod; [`ClusterState::record_failure`] and the report/metrics paths
//!   return a [`Transition`] only when the pod's state changes, so logs say
//!   it once;
//! - report fallback (precise mode): a report endpoint answering 404 is no
//!   failure but a pod that serves no report (stock vLLM). From the first
//!   404 its reported blocks, queue, load and health are forgotten and its
//!   blocks are the router's decisions, as in approximate mode (per-pod
//!   LRU, no expiry); each 404 keeps it fresh. Its next report (asked
//!   `since=0`) replaces those blocks and makes it precise again;
//! - vLLM's cache configuration (`vllm:cache_config_info` on its metrics
//!   page): its `block_size` must be `blockSizeTokens` for precise mode to
//!   match the pod's blocks (the bridge keys none of another size), and
//!   without prefix caching no prompt is a hit. Either is said once, as a
//!   [`Transition`], when the page first shows it and again when it
//!   changes;
//! - cache room: a pod's size and use are its report's `kvCapacityBlocks`
//!   and `residentBlocks`, else vLLM's `num_gpu_blocks` and the index's
//!   count ([`ClusterState::kv_capacity_blocks`],
//!   [`ClusterState::resident_blocks`]); the blocks its reports remove and
//!   later store again are its regretted evictions
//!   ([`crate::index::ghosts`]);
//! - pod list: [`ClusterState::set_pods`] for the configured list,
//!   [`ClusterState::replace_pods`] for a discovered one
//!   ([`crate::discovery`]), validated by the rules of `pods`. A pod whose
//!   id or address changed is a new pod: the old one's blocks are dropped.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::config::{Config, ConfigError, IndexMode, PodConfig};
use crate::index::{holders, DecisionRecorder, EvictionGhosts, PrefixTree};
use crate::replica::Peers;
use crate::report::{parse_report, parse_vllm_metrics, PodReport, Tier};
use crate::snapshot::{KvRoom, PodTable, PublishedPod, SlotLoad, SnapshotPublisher};
use crate::staleness::Staleness;

/// Most blocks held by pending decisions (precise mode), all pods together.
const PENDING_BLOCKS: usize = 262_144;

/// Changed buckets per publication step: about 1 ms of Envoy's main
/// thread (each is a shared-data write of ~9 µs in Envoy 1.40's V8 at a
/// million blocks); the service takes steps while its time budget lasts,
/// so a large resync is published over several ticks.
pub const PUBLISH_BUCKETS: usize = 64;

/// Blocks stored or removed per [`ClusterState::fold_step`]: well under a
/// millisecond of Envoy's main thread, even where each new block's table
/// entry lands on a page not touched before (a page fault each).
pub const FOLD_STEP_BLOCKS: usize = 512;

/// How the 503 Envoy answers itself starts when it could not reach the
/// upstream (connection refused, or closed or reset before the response
/// headers): no answer from the pod.
pub const ENVOY_UNREACHABLE: &[u8] = b"upstream connect error";

/// Why a pull failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// No answer (connection failure, timeout, call refused).
    Unreachable,
    /// An HTTP status other than 200.
    Status(u32),
    /// A body that is not a valid report or metrics page.
    Malformed(String),
    /// A body larger than `maxReportBytes`, left unread.
    TooLarge { size: usize, limit: usize },
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Unreachable => f.write_str("unreachable or timed out"),
            Failure::Status(code) => write!(f, "answered HTTP {code}"),
            Failure::Malformed(why) => write!(f, "sent a malformed answer: {why}"),
            Failure::TooLarge { size, limit } => write!(
                f,
                "answered {size} bytes, more than maxReportBytes ({limit}); the body was not read"
            ),
        }
    }
}

impl Failure {
    /// Short label for the failure counter.
    pub fn kind(&self) -> &'static str {
        match self {
            Failure::Unreachable => "unreachable",
            Failure::Status(_) => "status",
            Failure::Malformed(_) => "malformed",
            Failure::TooLarge { .. } => "too_large",
        }
    }
}

/// An answer waiting in the inbox.
#[derive(Debug, Clone)]
struct Accepted {
    pod: String,
    page: Page,
    inflight: u32,
}

/// What an accepted answer carries.
#[derive(Debug, Clone)]
enum Page {
    Report(Vec<u8>),
    Metrics(Vec<u8>),
    /// The report endpoint answered 404: the pod serves no report (stock
    /// vLLM), see [`ClusterState::serve_without_reports`].
    NoReport,
}

/// A report being folded, step by step (see the module documentation).
#[derive(Debug)]
struct ReportFold {
    pod: String,
    slot: usize,
    inflight: u32,
    report: PodReport,
    /// Whether the report applies (full, or a delta continuing our `seq`);
    /// a delta that does not is a resync.
    applies: bool,
    /// The pod served no report before this one (fallback ends).
    ends_fallback: bool,
    phase: FoldPhase,
    summary: ReportSummary,
    /// The pod's roots when the drop began ([`PrefixTree::roots_of`]).
    roots: Vec<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FoldPhase {
    /// Dropping the pod's blocks: removing its roots (listed in
    /// [`ReportFold::roots`]) from this one on.
    Drop(usize),
    /// Storing `report.stored[chain]` from hash `offset` on.
    Store {
        chain: usize,
        offset: usize,
    },
    /// Removing `report.removed` from `offset` on.
    Remove(usize),
    Done,
}

/// What one [`ClusterState::fold_step`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum FoldStep {
    /// Part of a report; the next step goes on with it.
    Partial,
    /// An answer folded to its end.
    Done(Folded),
}

/// What folding one accepted answer did.
#[derive(Debug, Clone, PartialEq)]
pub struct Folded {
    pub pod: String,
    pub kind: PullKind,
    /// The report's summary (`None` for metrics, and for a report endpoint
    /// the pod does not serve), or why it was refused.
    pub result: Result<Option<ReportSummary>, Failure>,
    /// In order; a metrics page can bring several (recovered, and what its
    /// cache configuration says).
    pub transitions: Vec<Transition>,
}

/// What a pull asks a pod for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullKind {
    /// The report protocol v1 endpoint.
    Report,
    /// vLLM's Prometheus `/metrics`.
    Metrics,
}

impl PullKind {
    fn index(self) -> usize {
        match self {
            PullKind::Report => 0,
            PullKind::Metrics => 1,
        }
    }

    /// Log field value.
    pub fn name(self) -> &'static str {
        match self {
            PullKind::Report => "report",
            PullKind::Metrics => "metrics",
        }
    }
}

/// How the host answered a pull: the HTTP status (`None`: no response —
/// connection failure, reset mid-body, timeout) and the body's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullAnswer<'a> {
    pub status: Option<&'a str>,
    pub body_size: usize,
}

/// A change of a pod's reporting state or of what its vLLM states, to
/// log once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    Failing {
        pod: String,
        kind: PullKind,
        failure: Failure,
    },
    Recovered {
        pod: String,
        kind: PullKind,
    },
    /// The report endpoint answers 404: the pod is routed as in
    /// approximate mode (blocks from decisions, load from metrics). Ends a
    /// failing state of its reports, if any: the pod answers.
    ReportFallback {
        pod: String,
    },
    /// A pod in fallback served a report: precise again (which ends a
    /// failing state of its reports too).
    ReportPrecise {
        pod: String,
    },
    /// Precise mode: the pod's vLLM caches blocks of `block_size` tokens,
    /// not `blockSizeTokens`, so none of its blocks can be matched (the
    /// bridge skips them all, and token-ID prompts hash in other blocks):
    /// the pod is routed without cache affinity. Said again only when
    /// vLLM's block size changes.
    BlockSizeMismatch {
        pod: String,
        block_size: u32,
        block_size_tokens: usize,
    },
    /// A pod of a [`Transition::BlockSizeMismatch`] now caches blocks of
    /// `blockSizeTokens` (vLLM restarted with that `--block-size`).
    BlockSizeMatches {
        pod: String,
        block_size: u32,
    },
    /// The pod's vLLM runs without prefix caching: it reuses no prefix, so
    /// no routing makes a hit there.
    PrefixCachingDisabled {
        pod: String,
    },
    /// A pod of a [`Transition::PrefixCachingDisabled`] caches prefixes.
    PrefixCachingEnabled {
        pod: String,
    },
}

/// What one report did to the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReportSummary {
    pub full: bool,
    pub stored: usize,
    pub removed: usize,
    pub orphaned: usize,
    /// The delta did not continue our sequence: blocks dropped, full resync requested.
    pub resync: bool,
}

impl ReportSummary {
    /// Whether the report changed the pod's index (a report that did not
    /// came without events: see [`crate::polling`]).
    pub fn changed_index(&self) -> bool {
        self.stored + self.removed + self.orphaned > 0 || self.resync
    }
}

#[derive(Debug, Clone)]
struct PodRecord {
    config: PodConfig,
    slot: usize,
    epoch: Option<String>,
    seq: u64,
    report_queue: u32,
    metrics_queue: Option<u32>,
    report_load: Option<f64>,
    metrics_load: Option<f64>,
    reported_health: f64,
    report_adapters: Vec<String>,
    metrics_adapters: Vec<String>,
    last_success_ms: u64,
    /// Requests in flight as each kind of pull ([`PullKind::index`]) read
    /// the pod: its queue counts requests in flight beyond the count of
    /// the pull it came from.
    inflight_at_pull: [u32; 2],
    /// Why each kind of pull fails, if it does ([`PullKind::index`]): one
    /// kind failing and the other succeeding is one steady state, not a
    /// failure and a recovery on every round.
    failing: [Option<Failure>; 2],
    failures: u64,
    /// Precise mode: the report endpoint answered 404, so the index holds
    /// the pod's decisions instead of its reports.
    without_reports: bool,
    /// vLLM's `block_size`, `num_gpu_blocks` and `enable_prefix_caching`
    /// as the pod's last metrics page stated them (`None`: not stated).
    vllm_block_size: Option<u32>,
    metrics_capacity_blocks: Option<u64>,
    prefix_caching: Option<bool>,
    /// `kvCapacityBlocks` and `residentBlocks` of the pod's last report.
    report_capacity_blocks: Option<u64>,
    report_resident_blocks: Option<u64>,
}

impl PodRecord {
    /// A good answer: the pod is fresh again.
    fn succeeded(&mut self, kind: PullKind, now_ms: u64, inflight: u32) -> Option<Transition> {
        self.last_success_ms = now_ms;
        if let Some(at) = self.inflight_at_pull.get_mut(kind.index()) {
            *at = inflight;
        }
        let failing = self.failing.get_mut(kind.index())?;
        failing.take().map(|_| Transition::Recovered {
            pod: self.config.id.clone(),
            kind,
        })
    }
}

/// See the module documentation.
pub struct ClusterState {
    config: Config,
    /// Good answers not folded yet, oldest first (at most one per pull in
    /// flight, each within `maxReportBytes`).
    inbox: VecDeque<Accepted>,
    /// The report being folded, taken from the inbox's front.
    folding: Option<ReportFold>,
    staleness: Staleness,
    /// Ordered by slot.
    pods: Vec<PodRecord>,
    /// Pod id → position in `pods` (a pool has up to 1,024 pods, and every
    /// answer looks its pod up).
    positions: HashMap<String, usize>,
    index: DecisionRecorder,
    /// Precise mode: the filters' decisions not yet confirmed by reports,
    /// each counting for matching until it expires.
    pending: Option<DecisionRecorder>,
    /// The blocks pods evicted (their reports' removals; for pods routed
    /// on decisions, the recorder's), to count those stored again
    /// (regretted evictions) and each pod's reuse share.
    ghosts: EvictionGhosts,
    /// Blocks the recorder evicted from pods routed on decisions, per
    /// slot, not yet taken ([`ClusterState::take_decided_evictions`]).
    decided_evictions: HashMap<usize, u64>,
    publisher: SnapshotPublisher,
    generation: u64,
    /// The table [`ClusterState::next_table`] keeps, and whether its
    /// members (not its numbers) changed since it was built.
    table: Option<PodTable>,
    members_changed: bool,
    /// Whether a report must name the pod's id (`podId`): not with
    /// `membership`, where a pod is known by its address alone.
    check_report_pod_id: bool,
}

/// What [`ClusterState::set_pods`] changed, by pod id: a pod whose address
/// changed under the same id left and came back (its blocks dropped).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodSetChange {
    pub added: Vec<String>,
    pub removed: Vec<String>,
}

impl PodSetChange {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty()
    }
}

impl ClusterState {
    pub fn new(config: &Config, now_ms: u64) -> ClusterState {
        let tree = PrefixTree::with_change_log(config.max_index_blocks);
        let mut state = ClusterState {
            config: config.clone(),
            inbox: VecDeque::new(),
            folding: None,
            staleness: Staleness::from_config(config),
            pods: Vec::new(),
            positions: HashMap::new(),
            index: DecisionRecorder::new(tree, config.pod_capacity_blocks),
            ghosts: EvictionGhosts::default(),
            decided_evictions: HashMap::new(),
            pending: (config.mode == IndexMode::Precise).then(|| {
                DecisionRecorder::with_expiry(
                    PrefixTree::with_change_log(config.max_index_blocks.min(PENDING_BLOCKS)),
                    config.pod_capacity_blocks,
                    config.pending_decision_ttl_ms(),
                )
            }),
            publisher: SnapshotPublisher::new(config.snapshot_buckets()),
            generation: 0,
            table: None,
            members_changed: true,
            check_report_pod_id: config.membership.is_none(),
        };
        state.set_pods(&config.pods, now_ms);
        state
    }

    /// Replaces the pod list with a discovered one (`discovery` or
    /// `membership`, see [`crate::discovery`]) if it obeys the rules of the
    /// configuration's `pods`; else the list stays as it was.
    pub fn replace_pods(
        &mut self,
        pods: &[PodConfig],
        now_ms: u64,
    ) -> Result<PodSetChange, ConfigError> {
        self.config.validate_pods(pods)?;
        Ok(self.set_pods(pods, now_ms))
    }

    /// Replaces the pod list (static config or discovery). Pods keep their
    /// slot and state while their id and address stay; a pod that left has
    /// its blocks dropped and its slot reused.
    pub fn set_pods(&mut self, pods: &[PodConfig], now_ms: u64) -> PodSetChange {
        // O(pods): a discovered list of 1,024 pods is reconciled every
        // round, and is most often the same list.
        let unchanged = pods.len() == self.pods.len()
            && pods
                .iter()
                .all(|pod| self.record(&pod.id).is_some_and(|r| r.config == *pod));
        if unchanged {
            return PodSetChange::default();
        }
        let wanted: HashMap<&str, &str> = pods
            .iter()
            .map(|p| (p.id.as_str(), p.address.as_str()))
            .collect();
        let (kept, gone): (Vec<PodRecord>, Vec<PodRecord>) = std::mem::take(&mut self.pods)
            .into_iter()
            .partition(|r| wanted.get(r.config.id.as_str()) == Some(&r.config.address.as_str()));
        self.members_changed = true;
        let mut change = PodSetChange::default();
        for record in &gone {
            change.removed.push(record.config.id.clone());
            self.index.drop_pod(record.slot);
            if let Some(pending) = &mut self.pending {
                pending.drop_pod(record.slot);
            }
            self.ghosts.forget_pod(record.slot);
            self.decided_evictions.remove(&record.slot);
        }
        let mut records = kept;
        let mut position: HashMap<String, usize> = records
            .iter()
            .enumerate()
            .map(|(i, r)| (r.config.id.clone(), i))
            .collect();
        let used: HashSet<usize> = records.iter().map(|r| r.slot).collect();
        let mut free_slots = (0..crate::config::MAX_PODS).filter(|s| !used.contains(s));
        for pod in pods.iter().take(self.config.max_pods) {
            if let Some(record) = position.get(&pod.id).and_then(|&i| records.get_mut(i)) {
                record.config = pod.clone();
                continue;
            }
            // Always found: at most maxPods ≤ MAX_PODS pods are taken.
            let Some(slot) = free_slots.next() else {
                break;
            };
            change.added.push(pod.id.clone());
            position.insert(pod.id.clone(), records.len());
            records.push(PodRecord {
                config: pod.clone(),
                slot,
                epoch: None,
                seq: 0,
                report_queue: 0,
                metrics_queue: None,
                report_load: None,
                metrics_load: None,
                reported_health: 1.0,
                report_adapters: Vec::new(),
                metrics_adapters: Vec::new(),
                last_success_ms: now_ms,
                inflight_at_pull: [0; 2],
                failing: [None, None],
                failures: 0,
                without_reports: false,
                vllm_block_size: None,
                metrics_capacity_blocks: None,
                report_capacity_blocks: None,
                report_resident_blocks: None,
                prefix_caching: None,
            });
        }
        records.sort_by_key(|r| r.slot);
        self.positions = records
            .iter()
            .enumerate()
            .map(|(i, r)| (r.config.id.clone(), i))
            .collect();
        self.pods = records;
        let share = self.config.pod_index_share(self.pods.len());
        self.index.tree_mut().set_max_pod_blocks(share);
        change
    }

    /// Ids and addresses of the current pods, in slot order.
    pub fn pods(&self) -> impl Iterator<Item = &PodConfig> {
        self.pods.iter().map(|r| &r.config)
    }

    /// The pod `pod_id`, if in the list.
    pub fn pod(&self, pod_id: &str) -> Option<&PodConfig> {
        self.record(pod_id).map(|r| &r.config)
    }

    /// Whether the next report call of `pod_id` asks for everything
    /// (`since=0`: no report of a known epoch folded yet).
    pub fn needs_resync(&self, pod_id: &str) -> bool {
        self.record(pod_id).is_none_or(|r| r.epoch.is_none())
    }

    /// Slot (holder and in-flight counter) of `pod_id`.
    pub fn slot(&self, pod_id: &str) -> Option<usize> {
        self.record(pod_id).map(|r| r.slot)
    }

    /// Id of the pod at `slot`.
    pub fn pod_id(&self, slot: usize) -> Option<&str> {
        let i = self.pods.binary_search_by_key(&slot, |r| r.slot).ok()?;
        self.pods.get(i).map(|r| r.config.id.as_str())
    }

    /// Path and query of the next report request for `pod_id`.
    pub fn report_query(&self, pod_id: &str, report_path: &str) -> Option<String> {
        let record = self.record(pod_id)?;
        Some(match &record.epoch {
            Some(epoch) => format!("{report_path}?since={}&epoch={epoch}", record.seq),
            None => format!("{report_path}?since=0"),
        })
    }

    /// Takes the answer to a pull of `pod_id`, as the host delivered it:
    /// a failure is recorded at once; a good body is queued for
    /// [`ClusterState::fold_step`], so the service can spread folding over
    /// its ticks. `body(n)` reads the first `n` bytes of the body and is
    /// called only when the answer is worth reading (a 200 within
    /// `maxReportBytes`, or the start of an error page). `inflight` is the
    /// pod's in-flight count now, when its report was made (the new queue
    /// baseline).
    pub fn accept_pull(
        &mut self,
        pod_id: &str,
        kind: PullKind,
        answer: PullAnswer<'_>,
        body: impl FnOnce(usize) -> Vec<u8>,
        inflight: u32,
    ) -> (Result<(), Failure>, Option<Transition>) {
        let limit = self.config.max_report_bytes;
        let body_size = answer.body_size;
        let failure = match answer.status {
            None => Failure::Unreachable,
            Some("200") if body_size > limit => Failure::TooLarge {
                size: body_size,
                limit,
            },
            Some("200") => {
                let body = body(body_size);
                let page = match kind {
                    PullKind::Report => Page::Report(body),
                    PullKind::Metrics => Page::Metrics(body),
                };
                self.inbox.push_back(Accepted {
                    pod: pod_id.to_string(),
                    page,
                    inflight,
                });
                return (Ok(()), None);
            }
            Some("404") if kind == PullKind::Report => {
                self.inbox.push_back(Accepted {
                    pod: pod_id.to_string(),
                    page: Page::NoReport,
                    inflight,
                });
                return (Ok(()), None);
            }
            // Envoy answers 503 itself when the pod cannot be reached.
            Some("503") if body(body_size.min(64)).starts_with(ENVOY_UNREACHABLE) => {
                Failure::Unreachable
            }
            Some(code) => Failure::Status(code.parse().unwrap_or(0)),
        };
        let transition = self.record_failure(pod_id, kind, failure.clone());
        (Err(failure), transition)
    }

    /// One bounded step of folding the oldest accepted answer: at most
    /// `max_blocks` blocks stored, removed or dropped (a dropped root's
    /// subtree at once), or parsing one body (bounded by `maxReportBytes`).
    /// `None` when nothing waits.
    pub fn fold_step(&mut self, now_ms: u64, max_blocks: usize) -> Option<FoldStep> {
        if let Some(mut fold) = self.folding.take() {
            self.advance(&mut fold, max_blocks);
            if fold.phase != FoldPhase::Done {
                self.folding = Some(fold);
                return Some(FoldStep::Partial);
            }
            let (pod, kind) = (fold.pod.clone(), PullKind::Report);
            let (result, transition) = self.finish_report(fold, now_ms);
            return Some(FoldStep::Done(Folded {
                pod,
                kind,
                result: result.map(Some),
                transitions: transition.into_iter().collect(),
            }));
        }
        let accepted = self.inbox.pop_front()?;
        let (pod, inflight) = (accepted.pod, accepted.inflight);
        let (kind, result, transitions) = match accepted.page {
            Page::Report(body) => match self.begin_report(&pod, &body, inflight) {
                Ok(fold) => {
                    self.folding = Some(fold);
                    return Some(FoldStep::Partial);
                }
                Err(failure) => {
                    let transition = self.record_failure(&pod, PullKind::Report, failure.clone());
                    (PullKind::Report, Err(failure), Vec::from_iter(transition))
                }
            },
            Page::NoReport => {
                let transition = self.serve_without_reports(&pod, now_ms);
                (PullKind::Report, Ok(None), Vec::from_iter(transition))
            }
            Page::Metrics(body) => {
                let (result, transitions) = self.apply_metrics(&pod, &body, now_ms, inflight);
                (PullKind::Metrics, result.map(|()| None), transitions)
            }
        };
        Some(FoldStep::Done(Folded {
            pod,
            kind,
            result,
            transitions,
        }))
    }

    /// The pod's report endpoint answered 404 (precise mode; stock vLLM
    /// serves none): the pod answers, so it is fresh, and it is routed as
    /// in approximate mode until it serves a report — its blocks are the
    /// router's decisions ([`ClusterState::record_decision`]), its queue
    /// and load its vLLM metrics. Entering the fallback forgets what its
    /// reports said, blocks included (nothing would keep them true), at
    /// once: like a pod leaving the list, once per change of state.
    fn serve_without_reports(&mut self, pod_id: &str, now_ms: u64) -> Option<Transition> {
        let record = self.record_mut(pod_id)?;
        record.last_success_ms = now_ms;
        let was_failing = record
            .failing
            .get_mut(PullKind::Report.index())
            .and_then(Option::take)
            .is_some();
        if record.without_reports {
            return was_failing.then(|| Transition::Recovered {
                pod: pod_id.to_string(),
                kind: PullKind::Report,
            });
        }
        record.without_reports = true;
        (record.epoch, record.seq) = (None, 0);
        record.report_queue = 0;
        record.report_load = None;
        record.reported_health = 1.0;
        record.report_adapters.clear();
        (record.report_capacity_blocks, record.report_resident_blocks) = (None, None);
        let slot = record.slot;
        self.members_changed = true;
        self.index.drop_pod(slot);
        Some(Transition::ReportFallback {
            pod: pod_id.to_string(),
        })
    }

    /// Whether `pod_id` serves no report and is routed on decisions.
    pub fn in_report_fallback(&self, pod_id: &str) -> bool {
        self.record(pod_id).is_some_and(|r| r.without_reports)
    }

    /// Whether an accepted answer of `pod_id` waits to be folded, or is
    /// being folded (a new report pull would ask for the same `since`).
    pub fn has_unfolded(&self, pod_id: &str) -> bool {
        self.folding.as_ref().is_some_and(|f| f.pod == pod_id)
            || self.inbox.iter().any(|a| a.pod == pod_id)
    }

    /// Accepted answers not yet folded to their end.
    pub fn unfolded(&self) -> usize {
        self.inbox.len() + usize::from(self.folding.is_some())
    }

    /// Folds a report body from `pod_id` at once (all its steps).
    /// `inflight` is the pod's current in-flight count (the new queue
    /// baseline).
    pub fn apply_report(
        &mut self,
        pod_id: &str,
        body: &[u8],
        now_ms: u64,
        inflight: u32,
    ) -> (Result<ReportSummary, Failure>, Option<Transition>) {
        match self.begin_report(pod_id, body, inflight) {
            Ok(mut fold) => {
                while fold.phase != FoldPhase::Done {
                    self.advance(&mut fold, usize::MAX);
                }
                self.finish_report(fold, now_ms)
            }
            Err(failure) => {
                let transition = self.record_failure(pod_id, PullKind::Report, failure.clone());
                (Err(failure), transition)
            }
        }
    }

    /// Parses and checks a report; the fold starts with dropping the pod's
    /// blocks when the report replaces them.
    fn begin_report(
        &mut self,
        pod_id: &str,
        body: &[u8],
        inflight: u32,
    ) -> Result<ReportFold, Failure> {
        let report = parse_report(body).map_err(Failure::Malformed)?;
        if self.check_report_pod_id && report.pod_id != pod_id {
            return Err(Failure::Malformed(format!(
                "`podId` is {:?}, expected {pod_id:?}",
                report.pod_id
            )));
        }
        let record = self
            .record_mut(pod_id)
            .ok_or_else(|| Failure::Malformed("unknown pod".into()))?;
        // Back from the fallback: its epoch was forgotten, so this report
        // replaces its decisions' blocks (the drop below); decisions from
        // now on are pending ones again.
        let ends_fallback = std::mem::take(&mut record.without_reports);
        let continues =
            record.epoch.as_deref() == Some(report.epoch.as_str()) && report.since == record.seq;
        let applies = report.full || continues;
        let summary = ReportSummary {
            full: report.full,
            resync: !applies,
            ..ReportSummary::default()
        };
        let phase = if report.full || !continues {
            FoldPhase::Drop(0)
        } else {
            FoldPhase::Store {
                chain: 0,
                offset: 0,
            }
        };
        let slot = record.slot;
        if ends_fallback {
            // The decisions' recency, so that no later eviction of the
            // recorder touches what the reports now own.
            self.index.forget_recency(slot);
        }
        Ok(ReportFold {
            pod: pod_id.to_string(),
            slot,
            inflight,
            report,
            applies,
            ends_fallback,
            phase,
            summary,
            roots: Vec::new(),
        })
    }

    /// Applies up to `max_blocks` blocks of `fold` to the index.
    fn advance(&mut self, fold: &mut ReportFold, max_blocks: usize) {
        let tree = self.index.tree_mut();
        let mut budget = max_blocks;
        while budget > 0 {
            fold.phase = match fold.phase {
                FoldPhase::Drop(from) => {
                    if from == 0 {
                        fold.roots = tree.roots_of(fold.slot);
                    }
                    // Root by root (a root's subtree at once) until the
                    // pod lost the budget's worth of blocks.
                    let held = tree.pod_block_count(fold.slot);
                    let mut next = from;
                    while let Some(root) = fold.roots.get(next) {
                        if held - tree.pod_block_count(fold.slot) >= budget {
                            break;
                        }
                        tree.remove_blocks(fold.slot, std::slice::from_ref(root));
                        next += 1;
                    }
                    budget = budget.saturating_sub((held - tree.pod_block_count(fold.slot)).max(1));
                    if next < fold.roots.len() {
                        budget = 0;
                        FoldPhase::Drop(next)
                    } else if fold.applies {
                        FoldPhase::Store {
                            chain: 0,
                            offset: 0,
                        }
                    } else {
                        FoldPhase::Done
                    }
                }
                FoldPhase::Store { chain, offset } => {
                    let Some(stored) = fold.report.stored.get(chain) else {
                        fold.phase = FoldPhase::Remove(0);
                        continue;
                    };
                    let rest = stored.hashes.get(offset..).unwrap_or_default();
                    let part = rest.get(..budget).unwrap_or(rest);
                    // A chain split across steps continues from its last
                    // stored block.
                    let parent = match offset.checked_sub(1) {
                        None => stored.parent,
                        Some(last) => stored.hashes.get(last).copied(),
                    };
                    let outcome = tree.insert_chain_in(fold.slot, parent, part, stored.tier);
                    if stored.tier == Tier::Gpu {
                        self.ghosts.stored(fold.slot, part);
                    }
                    fold.summary.stored += outcome.stored;
                    fold.summary.orphaned += outcome.orphaned;
                    budget -= part.len().min(budget);
                    if part.len() < rest.len() {
                        FoldPhase::Store {
                            chain,
                            offset: offset + part.len(),
                        }
                    } else {
                        FoldPhase::Store {
                            chain: chain + 1,
                            offset: 0,
                        }
                    }
                }
                FoldPhase::Remove(offset) => {
                    let rest = fold.report.removed.get(offset..).unwrap_or_default();
                    let part = rest.get(..budget).unwrap_or(rest);
                    tree.remove_blocks(fold.slot, part);
                    self.ghosts.evicted(fold.slot, part);
                    fold.summary.removed += part.len();
                    budget -= part.len().min(budget);
                    if part.len() < rest.len() {
                        FoldPhase::Remove(offset + part.len())
                    } else {
                        FoldPhase::Done
                    }
                }
                FoldPhase::Done => break,
            };
        }
    }

    /// The pod's record after its report's blocks are in.
    fn finish_report(
        &mut self,
        fold: ReportFold,
        now_ms: u64,
    ) -> (Result<ReportSummary, Failure>, Option<Transition>) {
        // The pod may have left (discovery) while its report was folded.
        let Some(record) = self.record_mut(&fold.pod).filter(|r| r.slot == fold.slot) else {
            return (Err(Failure::Malformed("unknown pod".into())), None);
        };
        let report = fold.report;
        if fold.applies {
            record.epoch = Some(report.epoch);
            record.seq = report.seq;
        } else {
            record.epoch = None;
            record.seq = 0;
        }
        record.report_queue = report.queue_depth;
        record.report_load = report.gpu_utilization;
        record.reported_health = report.health;
        record.report_capacity_blocks = report.kv_capacity_blocks;
        record.report_resident_blocks = report.resident_blocks;
        let adapters_changed = record.report_adapters != report.adapters;
        record.report_adapters = report.adapters;
        let transition = record.succeeded(PullKind::Report, now_ms, fold.inflight);
        self.members_changed |= adapters_changed;
        let transition = if fold.ends_fallback {
            Some(Transition::ReportPrecise { pod: fold.pod })
        } else {
            transition
        };
        (Ok(fold.summary), transition)
    }

    /// Folds a vLLM `/metrics` page from `pod_id`: the transitions are a
    /// recovery of its metrics pulls, then what its cache configuration
    /// newly says (see the module documentation).
    pub fn apply_metrics(
        &mut self,
        pod_id: &str,
        text: &[u8],
        now_ms: u64,
        inflight: u32,
    ) -> (Result<(), Failure>, Vec<Transition>) {
        let parsed = std::str::from_utf8(text)
            .map_err(|_| "metrics page is not UTF-8".to_string())
            .and_then(parse_vllm_metrics);
        let metrics = match parsed {
            Ok(metrics) => metrics,
            Err(why) => {
                let failure = Failure::Malformed(why);
                let transition = self.record_failure(pod_id, PullKind::Metrics, failure.clone());
                return (Err(failure), Vec::from_iter(transition));
            }
        };
        let (mismatch, block_size_tokens) =
            (self.block_size_check(), self.config.block_size_tokens);
        let Some(record) = self.record_mut(pod_id) else {
            return (Err(Failure::Malformed("unknown pod".into())), Vec::new());
        };
        record.metrics_queue = metrics.waiting.map(|w| w.max(0.0).round() as u32);
        record.metrics_load = metrics.kv_cache_usage.map(|u| u.clamp(0.0, 1.0));
        // (non-finite samples never get here: they read as not reported)
        let adapters = metrics.running_adapters.unwrap_or_default();
        let adapters_changed = record.metrics_adapters != adapters;
        record.metrics_adapters = adapters;
        let mut transitions = Vec::from_iter(record.succeeded(PullKind::Metrics, now_ms, inflight));
        let pod = || pod_id.to_string();
        let mismatched = mismatch(record.vllm_block_size);
        record.vllm_block_size = metrics.block_size;
        match (mismatched, mismatch(record.vllm_block_size)) {
            (before, Some(block_size)) if before != Some(block_size) => {
                transitions.push(Transition::BlockSizeMismatch {
                    pod: pod(),
                    block_size,
                    block_size_tokens,
                });
            }
            (Some(_), None) => {
                // Said only when vLLM states the right size, not when its
                // page stops stating one.
                if let Some(block_size) = record.vllm_block_size {
                    transitions.push(Transition::BlockSizeMatches {
                        pod: pod(),
                        block_size,
                    });
                }
            }
            _ => {}
        }
        match (record.prefix_caching, metrics.enable_prefix_caching) {
            (before, Some(false)) if before != Some(false) => {
                transitions.push(Transition::PrefixCachingDisabled { pod: pod() });
            }
            (Some(false), Some(true)) => {
                transitions.push(Transition::PrefixCachingEnabled { pod: pod() });
            }
            _ => {}
        }
        record.prefix_caching = metrics.enable_prefix_caching;
        record.metrics_capacity_blocks = metrics.num_gpu_blocks;
        self.members_changed |= adapters_changed;
        (Ok(()), transitions)
    }

    /// Which vLLM block size is a mismatch: one other than
    /// `blockSizeTokens`, in precise mode only (approximate mode matches
    /// kvroute's own decisions, whatever vLLM's block size).
    fn block_size_check(&self) -> impl Fn(Option<u32>) -> Option<u32> {
        let tokens = self.config.block_size_tokens;
        let precise = self.config.mode == IndexMode::Precise;
        move |size| size.filter(|&size| precise && usize::try_from(size) != Ok(tokens))
    }

    /// vLLM's block size of `pod_id` when it is a mismatch (see
    /// [`Transition::BlockSizeMismatch`]).
    pub fn block_size_mismatch(&self, pod_id: &str) -> Option<u32> {
        self.block_size_check()(self.record(pod_id)?.vllm_block_size)
    }

    /// `pod_id`'s KV cache in blocks: its report's `kvCapacityBlocks`,
    /// else vLLM's `num_gpu_blocks` from its metrics page, else, for a pod
    /// whose blocks are the router's decisions (approximate mode, report
    /// fallback), `podCapacityBlocks`, the bound of its recorded blocks.
    pub fn kv_capacity_blocks(&self, pod_id: &str) -> Option<u64> {
        self.capacity_of(self.record(pod_id)?)
    }

    fn capacity_of(&self, record: &PodRecord) -> Option<u64> {
        record
            .report_capacity_blocks
            .or(record.metrics_capacity_blocks)
            .or_else(|| {
                self.decided(record)
                    .then_some(self.config.pod_capacity_blocks as u64)
            })
    }

    /// The pod's blocks are kvroute's decisions (approximate mode, report
    /// fallback), not its reports'.
    fn decided(&self, record: &PodRecord) -> bool {
        self.config.mode == IndexMode::Approximate || record.without_reports
    }

    fn resident_of(&self, record: &PodRecord) -> u64 {
        record
            .report_resident_blocks
            .unwrap_or_else(|| self.index.tree().pod_block_count(record.slot) as u64)
    }

    /// What a placement on the pod would evict, as [`KvRoom`] publishes
    /// it: its cache's free blocks and its reuse share. Only a pod whose
    /// reports state its use (`residentBlocks`) has its room measured:
    /// otherwise the use would be kvroute's count of its keys (past
    /// `coarseAfterBlocks` a key stands for several blocks) and, for a
    /// pod routed on decisions, its evictions the recorder's guesses;
    /// pricing those moved approximate mode's long-context runs backwards
    /// (integration/results/costmodel.md, "Cache room priced").
    fn room_of(&self, record: &PodRecord) -> KvRoom {
        let used = record
            .report_resident_blocks
            .filter(|_| !self.decided(record));
        KvRoom {
            free_blocks: self
                .capacity_of(record)
                .zip(used)
                .map(|(capacity, used)| capacity.saturating_sub(used)),
            reuse_share: self.ghosts.reuse_share(record.slot),
        }
    }

    /// The evictions regretted since the last call ([`EvictionGhosts`]),
    /// by pod id, in blocks.
    pub fn take_regretted_evictions(&mut self) -> Vec<(String, u64)> {
        let regretted = self.ghosts.take_regretted();
        self.by_pod_id(regretted)
    }

    /// The blocks the recorder evicted from pods routed on decisions
    /// (approximate mode, report fallback) since the last call, by pod id:
    /// their evictions as far as kvroute knows, where a pod's reports'
    /// removals are its own.
    pub fn take_decided_evictions(&mut self) -> Vec<(String, u64)> {
        let evicted: Vec<(usize, u64)> = self.decided_evictions.drain().collect();
        self.by_pod_id(evicted)
    }

    fn by_pod_id(&self, counts: Vec<(usize, u64)>) -> Vec<(String, u64)> {
        counts
            .into_iter()
            .filter_map(|(slot, blocks)| Some((self.pod_id(slot)?.to_string(), blocks)))
            .collect()
    }

    /// `pod_id`'s cache blocks in use or cached: its report's
    /// `residentBlocks`, else the blocks the index lists for it (reported,
    /// or the router's decisions).
    pub fn resident_blocks(&self, pod_id: &str) -> Option<u64> {
        Some(self.resident_of(self.record(pod_id)?))
    }

    /// Counts a failed pull; a transition when that kind of pull of the
    /// pod was not already failing this way.
    pub fn record_failure(
        &mut self,
        pod_id: &str,
        kind: PullKind,
        failure: Failure,
    ) -> Option<Transition> {
        let record = self.record_mut(pod_id)?;
        record.failures += 1;
        let failing = record.failing.get_mut(kind.index())?;
        let changed = failing.as_ref().map(Failure::kind) != Some(failure.kind());
        *failing = Some(failure.clone());
        changed.then(|| Transition::Failing {
            pod: pod_id.to_string(),
            kind,
            failure,
        })
    }

    /// Failed pulls of `pod_id` so far.
    pub fn failures(&self, pod_id: &str) -> u64 {
        self.record(pod_id).map_or(0, |r| r.failures)
    }

    /// Health after staleness decay (see the module documentation).
    pub fn health(&self, pod_id: &str, now_ms: u64) -> f64 {
        self.record(pod_id)
            .map_or(0.0, |r| self.decayed_health(r, now_ms))
    }

    fn decayed_health(&self, record: &PodRecord, now_ms: u64) -> f64 {
        let age = now_ms.saturating_sub(record.last_success_ms);
        record.reported_health * self.staleness.health_factor(age)
    }

    /// A filter routed `chain` to pod `slot` at `now_ms`. Approximate mode
    /// (and a pod in report fallback): the pod now holds it, within its
    /// `podCapacityBlocks`. Precise mode: it is pending — counted as held
    /// until `pendingDecisionMs` after the pod is predicted to have
    /// prefilled it (`predicted_ttft_ms`, the router's prediction for the
    /// chosen pod; a report confirms it meanwhile, or shows the pod never
    /// kept it), and no report erases it before. A chain the pod's
    /// reports already hold whole in GPU memory is not recorded (one held
    /// in a slower tier is: the request reloads it to the GPU, and pending
    /// it counts there until the report says so): its last block says so
    /// (a pod's reported blocks are prefix-closed), one lookup instead of
    /// one per block, which is most of what the service does for a cache
    /// hit.
    ///
    /// Returns the pod's id when the decision was recorded (what a replica
    /// logs for its peers, [`crate::replica`]).
    pub fn record_decision(
        &mut self,
        slot: usize,
        chain: &[u64],
        now_ms: u64,
        predicted_ttft_ms: u32,
    ) -> Option<&str> {
        let i = self.pods.binary_search_by_key(&slot, |r| r.slot).ok()?;
        let record = self.pods.get(i)?;
        let without_reports = record.without_reports;
        match &mut self.pending {
            Some(_) if !without_reports && self.index.tree().holds_on_gpu(slot, chain) => {
                return None
            }
            Some(pending) if !without_reports => {
                pending.record_at(slot, chain, now_ms, u64::from(predicted_ttft_ms));
            }
            // Approximate mode, or a pod in report fallback: the recorder's
            // evictions are the pod's, as far as kvroute knows.
            _ => {
                let mut evicted = Vec::new();
                let stored = self.index.record_evicting(slot, chain, &mut evicted);
                self.ghosts
                    .stored(slot, chain.get(..stored).unwrap_or_default());
                self.ghosts.evicted(slot, &evicted);
                if !evicted.is_empty() {
                    *self.decided_evictions.entry(slot).or_default() += evicted.len() as u64;
                }
            }
        }
        Some(&record.config.id)
    }

    /// A peer replica routed `chain` to pod `pod_id` at local time
    /// `at_ms`: recorded as this replica's own decisions are. A pod this
    /// replica does not know (yet) is skipped: `false`.
    pub fn record_peer_decision(
        &mut self,
        pod_id: &str,
        chain: &[u64],
        at_ms: u64,
        predicted_ttft_ms: u32,
    ) -> bool {
        match self.slot(pod_id) {
            Some(slot) => {
                self.record_decision(slot, chain, at_ms, predicted_ttft_ms);
                true
            }
            None => false,
        }
    }

    /// The live peers' requests in flight, by pod slot.
    pub fn peer_loads(&self, peers: &Peers, now_ms: u64) -> Vec<SlotLoad> {
        let mut loads =
            vec![SlotLoad::default(); self.pods.iter().map(|r| r.slot + 1).max().unwrap_or(0)];
        for inflight in peers.loads(now_ms) {
            if let Some(load) = self
                .slot(&inflight.pod)
                .and_then(|slot| loads.get_mut(slot))
            {
                load.add(inflight.load);
            }
        }
        loads
    }

    pub fn index(&self) -> &PrefixTree {
        self.index.tree()
    }

    /// Precise mode's pending decisions (`None` in approximate mode).
    pub fn pending(&self) -> Option<&PrefixTree> {
        self.pending.as_ref().map(DecisionRecorder::tree)
    }

    /// Bytes held by the index, the pending decisions, the evictions
    /// remembered and the snapshot mirror.
    pub fn memory_bytes(&self) -> usize {
        self.index.tree().memory_bytes()
            + self.pending.as_ref().map_or(0, |p| p.tree().memory_bytes())
            + self.ghosts.memory_bytes()
            + self.publisher.memory_bytes()
    }

    /// Moves what changed in the index and the pending decisions (expired
    /// at `now_ms`) into the snapshot mirror: a block's published mask is
    /// the pods the reports say hold it plus those it is pending on (both
    /// prefix-closed, so their union is too).
    fn mirror_changes(&mut self, now_ms: u64) {
        let mut changes = self.index.tree_mut().take_changes();
        if let Some(pending) = &mut self.pending {
            pending.expire(now_ms);
            changes.extend(pending.tree_mut().take_changes());
        }
        let (reported, pending) = (self.index.tree(), self.pending.as_ref());
        self.publisher.apply(&changes, |hash, out| {
            let held = reported.holders(hash).unwrap_or_default();
            match pending.and_then(|p| p.tree().holders(hash)) {
                Some(pending) => out.extend(holders::union(held, pending)),
                None => out.extend_from_slice(held),
            }
        });
    }

    /// At most `max_buckets` changed buckets, without a new pod table: how
    /// decisions reach every worker within milliseconds.
    pub fn publish_buckets(&mut self, now_ms: u64, max_buckets: usize) -> Vec<(u32, Vec<u8>)> {
        self.mirror_changes(now_ms);
        self.publisher.take_dirty(max_buckets)
    }

    /// The next snapshot: the pod table (always) and the index buckets that
    /// changed since the last call.
    pub fn publish(&mut self, now_ms: u64) -> Publication {
        self.publish_some(now_ms, usize::MAX)
    }

    /// Like [`ClusterState::publish`] with at most `max_buckets` changed
    /// buckets; the rest wait for the next call
    /// ([`Publication::unpublished_buckets`]), so a large resync is published
    /// over several calls instead of stalling one.
    pub fn publish_some(&mut self, now_ms: u64, max_buckets: usize) -> Publication {
        let buckets = self.publish_buckets(now_ms, max_buckets);
        Publication {
            table: self.pod_table(now_ms),
            buckets,
            unpublished_buckets: self.unpublished_buckets(),
        }
    }

    /// Changed buckets not yet taken by a publication.
    pub fn unpublished_buckets(&self) -> usize {
        self.publisher.dirty_count()
    }

    /// A new generation of the pod table, as of `now_ms` (published after
    /// the buckets it counts on).
    pub fn pod_table(&mut self, now_ms: u64) -> PodTable {
        self.next_table(now_ms).clone()
    }

    /// [`ClusterState::pod_table`] without the copy: the table kept for
    /// publication, rebuilt only when its members changed (pods, their
    /// addresses, attributes or adapters) and else brought to the new
    /// generation's numbers in place — at 1,024 pods a rebuild copies
    /// 2,048 strings, a publication happens up to every few ms.
    pub fn next_table(&mut self, now_ms: u64) -> &PodTable {
        self.generation += 1;
        let rooms: Vec<KvRoom> = self.pods.iter().map(|r| self.room_of(r)).collect();
        let (records, staleness) = (&self.pods, &self.staleness);
        let numbers = |r: &PodRecord| {
            let age = now_ms.saturating_sub(r.last_success_ms);
            let (queue, source) = match r.metrics_queue {
                Some(queue) => (queue, PullKind::Metrics),
                None => (r.report_queue, PullKind::Report),
            };
            (
                queue,
                r.report_load.or(r.metrics_load).unwrap_or(0.0),
                r.reported_health * staleness.health_factor(age),
                r.inflight_at_pull.get(source.index()).copied().unwrap_or(0),
            )
        };
        let fresh = match self.table.as_mut() {
            Some(table) if !self.members_changed && table.pods.len() == records.len() => {
                for ((pod, r), room) in table.pods.iter_mut().zip(records).zip(rooms) {
                    (pod.queue, pod.load, pod.health, pod.inflight_at_report) = numbers(r);
                    pod.reported_health = r.reported_health;
                    pod.last_report_ms = r.last_success_ms;
                    pod.kv_room = room;
                }
                None
            }
            _ => {
                let pods = records
                    .iter()
                    .zip(rooms)
                    .map(|(r, kv_room)| {
                        let (queue, load, health, inflight_at_report) = numbers(r);
                        PublishedPod {
                            slot: r.slot,
                            id: r.config.id.clone(),
                            address: r.config.address.clone(),
                            queue,
                            load,
                            health,
                            reported_health: r.reported_health,
                            last_report_ms: r.last_success_ms,
                            adapters: union(&r.report_adapters, &r.metrics_adapters),
                            attributes: r.config.attributes.clone(),
                            inflight_at_report,
                            kv_room,
                        }
                    })
                    .collect();
                let mut table = PodTable {
                    buckets: self.publisher.bucket_count(),
                    pods,
                    ..PodTable::default()
                };
                table.members_digest = members_digest(&table);
                Some(table)
            }
        };
        if fresh.is_some() {
            self.table = fresh;
            self.members_changed = false;
        }
        let generation = self.generation;
        let table = self.table.get_or_insert_with(PodTable::default);
        table.generation = generation;
        table.published_at_ms = now_ms;
        table
    }

    fn record(&self, pod_id: &str) -> Option<&PodRecord> {
        self.positions.get(pod_id).and_then(|&i| self.pods.get(i))
    }

    fn record_mut(&mut self, pod_id: &str) -> Option<&mut PodRecord> {
        self.positions
            .get(pod_id)
            .and_then(|&i| self.pods.get_mut(i))
    }
}

/// A digest of what [`PodTable::encode_state`] leaves out: pods, slots,
/// addresses, adapters, attributes, bucket count.
fn members_digest(table: &PodTable) -> u64 {
    let mut digest = xxhash_rust::xxh64::Xxh64::new(u64::from(table.buckets));
    for pod in &table.pods {
        digest.update(&(pod.slot as u64).to_le_bytes());
        for text in [&pod.id, &pod.address].into_iter().chain(&pod.adapters) {
            digest.update(text.as_bytes());
            digest.update(&[0]);
        }
        digest.update(&[1]);
        for (name, value) in &pod.attributes {
            digest.update(name.as_bytes());
            digest.update(&value.to_le_bytes());
        }
        digest.update(&[2]);
    }
    digest.digest()
}

fn union(a: &[String], b: &[String]) -> Vec<String> {
    let mut all: Vec<String> = a.iter().chain(b).cloned().collect();
    all.sort();
    all.dedup();
    all
}

/// One tick's output for shared data.
#[derive(Debug, Clone)]
pub struct Publication {
    pub table: PodTable,
    /// (bucket, encoded value) of changed buckets.
    pub buckets: Vec<(u32, Vec<u8>)>,
    /// Changed buckets left for the next publication.
    pub unpublished_buckets: usize,
}
