//! The report service, written once for every host: it pulls pod reports
//! through Envoy's clusters, folds them into [`ClusterState`] and
//! publishes the snapshot the filters route on.
//!
//! Every `podReportIntervalMs` a round starts: the service publishes the
//! current snapshot (so health decay shows even when nothing answers), then
//! asks each pod without a metrics call in flight for its vLLM metrics
//! (with `metricsPath`) and pulls the pod list (with `discovery`, or with
//! `membership` Envoy's own admin `/clusters` for the serving cluster,
//! through `membership.adminCluster`; [`crate::discovery`] parses either
//! and [`ClusterState::replace_pods`] reconciles). Report calls follow
//! [`crate::polling`] per pod instead: precise mode keeps one long-poll
//! (`?since=SEQ&epoch=E&wait=W`) pending per pod and sends the next one as
//! soon as the previous answer is folded, or polls on the interval a pod
//! that ignores `wait`. Every call goes through `reportCluster`: an
//! ORIGINAL_DST cluster that connects to the `x-envoy-original-dst-host`
//! set on each call to the pod's address. After folding answers the
//! snapshot is published at once (at most every [`PUBLISH_GAP_MS`], else
//! on the next tick), so a pod's new blocks reach the filters milliseconds
//! after the pod stored them. The filters' routing decisions arrive in
//! batches per worker ([`ReportService::on_decisions`]): approximate
//! mode's only signal, precise mode's pending entries until reports
//! confirm them.
//!
//! The service runs on Envoy's main thread, which also serves admin and
//! xDS, so no callback may stall it — and answers of many pods can land in
//! one pass of Envoy's event loop. The service ticks every [`TICK_MS`]
//! (a replicated gateway's every [`PEER_CALL_GAP_MS`]; rounds start on the
//! tick that finds one due) and spends at most [`TICK_BUDGET_US`] per
//! [`TICK_MS`] folding answers (at most [`FOLD_SHARE_US`]
//! of it) and writing changed buckets, over all its callbacks until the
//! next tick: an answer is only classified and queued when it arrives;
//! folding goes in steps of [`FOLD_STEP_BLOCKS`] blocks (a 16k-block full
//! report takes several, over ticks if need be); changed buckets are
//! written in steps of [`PUBLISH_BUCKETS`], the rest left to the following
//! ticks; bodies over `maxReportBytes` are never read. A step may overrun
//! the budget by its own length (parsing one body is one step).
//! Work per pod is spread the same way, so a pool of 1,024 pods costs no
//! callback 1,024 of anything: a tick starts at most [`CALLS_PER_TICK`]
//! pulls within [`CALL_BUDGET_US`] (per [`TICK_MS`]; scanning the pods
//! from where the last tick stopped), an answer's callback asks only the
//! pods it folded again, at most [`RESYNC_CALLS`] `since=0` calls are in
//! flight, per-pod gauges and new pods' series go out within
//! [`GAUGE_BUDGET_US`] per [`TICK_MS`], and the
//! pod table is brought to each generation's numbers in place: the host
//! gets its binary state ([`PodTable::encode_state`]) every generation,
//! the whole table only when its members changed
//! ([`ServiceHost::publish_table`]).
//! A report answer that changed no block is published with the next round
//! (its pod's queue and load with it), not with a table of its own: 64
//! idle pods answer 64 long-polls a second. Metrics answers are published
//! as they come (their queue and load are what they are for). Per-pod
//! gauges are set once per round, each only when its value changed.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use serde_json::json;

use super::events::event;
use super::host::ServiceHost;
use super::metrics::{export_peer_from_zero, export_pod_from_zero, percent, Metric, MetricBatch};
use crate::cluster::{
    ClusterState, Failure, FoldStep, PullAnswer, PullKind, Transition, ENVOY_UNREACHABLE,
    FOLD_STEP_BLOCKS, PUBLISH_BUCKETS,
};
use crate::config::{Config, IndexMode, PodConfig};
use crate::discovery;
use crate::polling::{Cadence, CadenceChange, ReportPolling, LONG_POLL_RECHECK_MS};
use crate::replica::{PeerState, ReplicaSync, PEER_CALL_GAP_MS, REPLICA_KEY_HEADER};
use crate::scoring::feed::{Feed, FeedRecord};
use crate::snapshot::{decode_batch, BatchRecord, InflightCount, PodTable};

/// Housekeeping period: the longest a due round, an unfolded answer or a
/// pending publication waits.
pub const TICK_MS: u64 = 25;

/// Main-thread time per [`TICK_MS`] for folding answers and writing
/// changed buckets (a step may overrun it: parsing one body, bounded by
/// `maxReportBytes`, is one step); a shorter tick gets its share of it.
const TICK_BUDGET_US: u64 = 3_000;

/// The part of [`TICK_BUDGET_US`] folding may take; the rest is left to
/// writing, so that folding cannot starve publication. Folding first lets
/// a bucket collect a tick's changes before it is written once.
const FOLD_SHARE_US: u64 = 1_500;

/// Least time between two publications triggered by answers (folds closer
/// together are published together, by the next answer or tick).
const PUBLISH_GAP_MS: u64 = 5;

/// Pulls started per [`TICK_MS`] (report calls that are due, a round's
/// metrics calls), at most: at 1,024 pods a round's calls go out over 16
/// ticks or more instead of ~1,024 dispatches in one callback. A pod whose
/// answer was just folded is asked again at once, outside this bound (one
/// call per answer). A shorter tick gets its share, as of every bound
/// here.
const CALLS_PER_TICK: usize = 64;

/// Main-thread time per [`TICK_MS`] for starting pulls: with what a
/// dispatch costs (averaged as calls go out), fewer than
/// [`CALLS_PER_TICK`] start when each costs more than 15 µs.
const CALL_BUDGET_US: u64 = 1_000;

/// Main-thread time per [`TICK_MS`] for per-pod gauges (defining a pod's
/// series costs Envoy tens of µs each; setting one, a few).
const GAUGE_BUDGET_US: u64 = 1_000;

/// Report calls asking for everything (`since=0`: a pod not yet known, or
/// resyncing) in flight at once. Full reports are the large answers and
/// their folding is paced by the tick budget anyway; this bounds how many
/// wait in memory (the wasm host grows its heap for as many up front).
pub const RESYNC_CALLS: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pull {
    Pod(PullKind),
    Discovery,
    /// A peer replica's log ([`crate::replica`]).
    Peer,
    /// The members of `replicas.cluster`, from Envoy's admin.
    PeerDiscovery,
}

/// See the module documentation.
pub struct ReportService<H: ServiceHost> {
    pub host: H,
    /// Shared, not cloned, by callbacks that need it beside `&mut self`.
    config: Option<Arc<Config>>,
    state: Option<ClusterState>,
    /// Calls in flight: token → (pod id, what was asked).
    pending: HashMap<u64, (String, Pull)>,
    /// Calls Envoy answered itself, without an answer from the pod (no
    /// response, or its own 503 `upstream connect error`), taken as failed
    /// at the next tick instead of at once: when Envoy shuts down it ends
    /// every call still out so, after its event loop has stopped, and no
    /// tick comes then. A shutdown blames no pod; an unreachable pod counts
    /// one tick later.
    unanswered: Vec<u64>,
    /// A pod call in flight: token → the streams this gateway had opened
    /// on the pod when it went out ([`InflightCount::opened`]).
    opened_at_call: HashMap<u64, u32>,
    /// When each pod's next report call goes out.
    polling: Option<ReportPolling>,
    next_round_ms: u64,
    /// What is left of this tick's folding and writing time, and of
    /// folding's part of it.
    budget_us: u64,
    fold_budget_us: u64,
    /// Answers were folded since the last publication.
    folds_unpublished: bool,
    last_publish_ms: u64,
    metrics: MetricBatch,
    /// Replicated gateways: this replica's log and its peers.
    replicas: Option<ReplicaSync>,
    /// The streamed answers' first bytes and the session starts every
    /// worker learns from ([`crate::scoring::feed`]): this replica's and
    /// its peers', published once per tick.
    feed: Feed,
    /// The members digest of the last table handed to the host whole.
    members_published: Option<u64>,
    /// Pulls this tick may still start ([`CALLS_PER_TICK`],
    /// [`CALL_BUDGET_US`]).
    calls_left: usize,
    /// What starting a pull costs the main thread, µs (moving average).
    dispatch_us: f64,
    /// Where the next tick's scan for due report calls starts, so every
    /// pod gets its turn.
    poll_cursor: usize,
    /// Pods with a `since=0` report call in flight ([`RESYNC_CALLS`]).
    resyncs: HashSet<String>,
    /// This round's metrics calls not yet sent.
    metrics_due: VecDeque<PodConfig>,
    /// The round's table whose per-pod gauges are being exported, and the
    /// next pod's index.
    gauges: Option<(PodTable, usize)>,
    /// New pods whose series are not defined yet.
    zero_due: VecDeque<String>,
}

/// The service's tick period for `config`: a replicated gateway's ticks at
/// the peer pull gap, since a pull answered sooner than the gap after it
/// was sent waits for the next tick (a busy peer answers every pull within
/// its listener's 5 ms tick): at [`TICK_MS`] that alone was 25 ms of lag.
pub fn tick_period_ms(config: &Config) -> u64 {
    let period = config.pod_report_interval_ms.min(TICK_MS);
    if config.replicas.is_some() {
        period.min(PEER_CALL_GAP_MS)
    } else {
        period
    }
}

/// This tick's share of a bound per [`TICK_MS`] (`budget_us`, e.g.
/// [`TICK_BUDGET_US`]): the same main-thread share whatever the tick
/// period.
fn tick_budget_us(config: &Config, budget_us: u64) -> u64 {
    budget_us * tick_period_ms(config) / TICK_MS
}

impl<H: ServiceHost> ReportService<H> {
    pub fn new(host: H) -> ReportService<H> {
        ReportService {
            host,
            config: None,
            state: None,
            pending: HashMap::new(),
            unanswered: Vec::new(),
            opened_at_call: HashMap::new(),
            polling: None,
            next_round_ms: 0,
            budget_us: TICK_BUDGET_US,
            fold_budget_us: FOLD_SHARE_US,
            folds_unpublished: false,
            last_publish_ms: 0,
            metrics: MetricBatch::default(),
            replicas: None,
            feed: Feed::default(),
            members_published: None,
            calls_left: CALLS_PER_TICK,
            dispatch_us: 0.0,
            poll_cursor: 0,
            resyncs: HashSet::new(),
            metrics_due: VecDeque::new(),
            gauges: None,
            zero_due: VecDeque::new(),
        }
    }

    /// Takes a (validated) configuration. A new configuration starts a new
    /// view of the pods; the same one again changes nothing (proxy-wasm
    /// may configure a root more than once). True when a view started.
    pub fn configure(&mut self, config: Config) -> bool {
        if self.config.as_deref() == Some(&config) {
            return false;
        }
        let now = self.host.now_ms();
        self.state = Some(ClusterState::new(&config, now));
        self.polling = Some(ReportPolling::new(&config));
        // A random id per replica process (and configuration): its log's
        // epoch, how its peers tell a restart, and how it recognises its
        // own address among the replicas.
        let replica = super::random_u64();
        self.replicas = ReplicaSync::new(&config, replica);
        if let Some(sync) = &self.replicas {
            self.host.store_replica_log(0, Vec::new(), sync.head());
        }
        self.config = Some(Arc::new(config));
        self.feed = Feed::default();
        self.next_round_ms = 0;
        // The new view's calls, table and gauges start afresh.
        self.members_published = None;
        self.resyncs.clear();
        self.metrics_due.clear();
        self.gauges = None;
        true
    }

    /// Records a callback's main-thread time in `epp_service_busy_us`: the
    /// service's share of any stall of Envoy's main thread (admin, xDS,
    /// stats flushes wait behind it).
    fn busy(&mut self, started: Instant) {
        self.metrics
            .histogram(Metric::ServiceBusyUs, started.elapsed().as_micros() as u64);
    }

    /// The tick ([`tick_period_ms`]): the calls Envoy answered without
    /// their pod since the last one ([`ReportService::unanswered`]),
    /// folding, a round when one is due or what is left to publish, then
    /// the metrics.
    pub fn on_tick(&mut self) {
        let started = Instant::now();
        for token in std::mem::take(&mut self.unanswered) {
            self.take_answer(token, None, 0, |_| Vec::new());
        }
        if let Some(config) = self.config.clone() {
            self.budget_us = tick_budget_us(&config, TICK_BUDGET_US);
            self.fold_budget_us = tick_budget_us(&config, FOLD_SHARE_US);
            // Pulls get this tick's share of their bounds too.
            let most = (tick_budget_us(&config, CALLS_PER_TICK as u64) as usize).max(1);
            let affordable =
                tick_budget_us(&config, CALL_BUDGET_US) as f64 / self.dispatch_us.max(1.0);
            self.calls_left = (affordable as usize).clamp(most.min(4), most);
            self.fold();
            let now = self.host.now_ms();
            if now >= self.next_round_ms {
                self.next_round_ms = now.saturating_add(config.pod_report_interval_ms);
                self.start_round(&config);
            } else if self.folds_unpublished {
                self.publish(false);
            } else {
                // A resync's rest; pending decisions expire on time, not
                // at the next round.
                self.write_buckets(now);
            }
            self.poll_reports(&config, None);
            self.send_metrics(&config);
            self.pull_peers(&config);
            self.export_gauges(&config);
            if let Some(feed) = self.feed.take_unpublished() {
                self.host.publish_feed(feed);
            }
            self.metrics.flush(self.host.metric_sink());
        }
        self.busy(started);
    }

    /// Batches of decisions, answers and session starts from the filters
    /// ([`crate::snapshot::BatchRecord`]): decisions recorded, and their
    /// buckets written at once (no new pod table), so every worker matches
    /// them within milliseconds instead of at the next report; answers and
    /// starts go to the feed every worker learns from (published on the
    /// next tick). All go to the replica log when replicated.
    pub fn on_decisions(&mut self, messages: impl IntoIterator<Item = Vec<u8>>) {
        let started = Instant::now();
        if let Some(state) = self.state.as_mut() {
            let now = self.host.now_ms();
            for message in messages {
                let Some(records) = decode_batch(&message) else {
                    log::warn!(
                        "kvroute service: malformed decision message ({} bytes)",
                        message.len()
                    );
                    continue;
                };
                for record in records {
                    let logged = match record {
                        BatchRecord::Decision {
                            slot,
                            chain,
                            predicted_ttft_ms,
                        } => {
                            let recorded =
                                state.record_decision(slot, &chain, now, predicted_ttft_ms);
                            match (recorded, self.replicas.as_mut()) {
                                (Some(pod), Some(sync)) => {
                                    Some(sync.log_decision(pod, &chain, predicted_ttft_ms, now))
                                }
                                _ => None,
                            }
                        }
                        BatchRecord::Answer(answer) => {
                            self.feed.push(FeedRecord::Answer(answer));
                            let pod = state.pod_id(usize::from(answer.slot));
                            match (pod, self.replicas.as_mut()) {
                                (Some(pod), Some(sync)) => Some(sync.log_answer(pod, &answer, now)),
                                _ => None,
                            }
                        }
                        BatchRecord::Start { slot, start } => {
                            self.feed.push(FeedRecord::Start(start));
                            match (state.pod_id(slot), self.replicas.as_mut()) {
                                (Some(pod), Some(sync)) => Some(sync.log_start(pod, &start, now)),
                                _ => None,
                            }
                        }
                    };
                    if let (Some((seq, value)), Some(sync)) = (logged, self.replicas.as_ref()) {
                        self.host.store_replica_log(seq, value, sync.head());
                        self.metrics.increment(Metric::ReplicaDecisionsLogged);
                    }
                }
            }
            self.write_buckets(now);
        }
        self.busy(started);
    }

    /// The answer to call `token`: `status` is `None` when the call failed
    /// (connection refused, reset, timeout, a body over the host's buffer
    /// limit); `read_body` reads at most its argument's bytes of the body,
    /// only when the body will be used.
    pub fn on_call_response(
        &mut self,
        token: u64,
        status: Option<&str>,
        body_size: usize,
        read_body: impl FnOnce(usize) -> Vec<u8>,
    ) {
        let started = Instant::now();
        self.call_response(token, status, body_size, read_body);
        self.busy(started);
    }

    /// Holds an answer Envoy made without the pod until the next tick (see
    /// [`ReportService::unanswered`]); takes any other at once.
    fn call_response(
        &mut self,
        token: u64,
        status: Option<&str>,
        body_size: usize,
        read_body: impl FnOnce(usize) -> Vec<u8>,
    ) {
        if !self.pending.contains_key(&token) {
            return;
        }
        match status {
            None => self.unanswered.push(token),
            Some("503") => {
                let head = read_body(body_size.min(ENVOY_UNREACHABLE.len()));
                if head.starts_with(ENVOY_UNREACHABLE) {
                    self.unanswered.push(token);
                } else {
                    // The pod's own 503: only its page's start is read.
                    self.take_answer(token, status, body_size, |_| head);
                }
            }
            Some(_) => self.take_answer(token, status, body_size, read_body),
        }
    }

    /// Envoy is done with the service: shutting down (every call still out
    /// was held, [`ReportService::unanswered`], and is dropped with it) or
    /// replacing its configuration. Says so once.
    pub fn shut_down(&mut self) {
        event(
            log::Level::Info,
            "service_stopping",
            json!({"callsInFlight": self.pending.len(),
                   "detail": "Envoy is stopping or replacing this configuration: calls in flight end unanswered and count against no pod"}),
        );
    }

    /// Takes the answer to call `token` (as [`ReportService::on_call_response`]
    /// describes its arguments).
    fn take_answer(
        &mut self,
        token: u64,
        status: Option<&str>,
        body_size: usize,
        read_body: impl FnOnce(usize) -> Vec<u8>,
    ) {
        let Some((pod, pull)) = self.pending.remove(&token) else {
            return;
        };
        let opened_at_call = self.opened_at_call.remove(&token);
        let kind = match pull {
            Pull::Discovery => return self.on_discovery_answer(status, body_size, read_body),
            Pull::Peer => return self.on_peer_answer(&pod, status, body_size, read_body),
            Pull::PeerDiscovery => return self.on_peer_discovery(status, body_size, read_body),
            Pull::Pod(kind) => kind,
        };
        let now = self.host.now_ms();
        // vLLM renders its metrics at some instant after the scrape went
        // out (milliseconds later), so requests sent to it since may be
        // missing from its queue: they count as sent after the scrape.
        // Counted from the answer's arrival, they would be in neither. A
        // report call is held until the pod has news, and answered then:
        // counted from its answer.
        let count = self.inflight_of(&pod);
        let sent_since_call = opened_at_call.map_or(0, |at| count.opened.wrapping_sub(at));
        let inflight = count.requests.saturating_sub(sent_since_call);
        let (Some(state), Some(polling)) = (self.state.as_mut(), self.polling.as_mut()) else {
            return;
        };
        if kind == PullKind::Report {
            polling.answered(&pod, now);
            self.resyncs.remove(&pod);
        }
        let answer = PullAnswer { status, body_size };
        let (result, transition) = state.accept_pull(&pod, kind, answer, read_body, inflight);
        log_transitions(transition);
        if result.is_err() {
            if kind == PullKind::Report {
                polling.failed(&pod, now);
            }
            count_failure(&mut self.metrics, &pod);
        }
        let reported = self.fold();
        if self.folds_unpublished && now.saturating_sub(self.last_publish_ms) >= PUBLISH_GAP_MS {
            self.publish(false);
        }
        if let Some(config) = self.config.clone() {
            self.poll_reports(&config, Some(&reported));
        }
    }

    /// GETs `path` from `destination` (`host:port`, also the `:authority`)
    /// through `cluster`; an ORIGINAL_DST cluster connects to the
    /// `x-envoy-original-dst-host` set here, a static one ignores it.
    fn call(
        &mut self,
        pod: &str,
        cluster: &str,
        destination: &str,
        path: &str,
        pull: Pull,
        timeout_ms: u64,
    ) {
        let mut headers = vec![
            (":method", "GET"),
            (":path", path),
            (":authority", destination),
            ("x-envoy-original-dst-host", destination),
        ];
        let secret = self.replicas.as_ref().map(|r| r.config().secret.clone());
        if let (Pull::Peer, Some(secret)) = (pull, &secret) {
            headers.push((REPLICA_KEY_HEADER, secret));
        }
        let opened = (pull == Pull::Pod(PullKind::Metrics))
            .then(|| self.state.as_ref().and_then(|s| s.slot(pod)))
            .flatten()
            .map(|slot| self.host.inflight_of(slot).opened);
        let started = Instant::now();
        let dispatched = self.host.dispatch_call(cluster, &headers, timeout_ms);
        let spent = started.elapsed().as_secs_f64() * 1e6;
        self.dispatch_us += (spent - self.dispatch_us) / 16.0;
        match dispatched {
            Ok(token) => {
                self.pending.insert(token, (pod.to_string(), pull));
                if let Some(opened) = opened {
                    self.opened_at_call.insert(token, opened);
                }
            }
            Err(error) => {
                log::error!("kvroute service: cannot call cluster {cluster:?} for {pod}: {error} (is the cluster defined?)");
                if pull == Pull::Pod(PullKind::Report) {
                    self.resyncs.remove(pod);
                    if let Some(polling) = self.polling.as_mut() {
                        polling.failed(pod, self.host.now_ms());
                    }
                }
                if let Pull::Pod(kind) = pull {
                    count_failure(&mut self.metrics, pod);
                    if let Some(state) = self.state.as_mut() {
                        log_transitions(state.record_failure(pod, kind, Failure::Unreachable));
                    }
                }
                if pull == Pull::Peer {
                    self.peer_answer(pod, None, 0, |_| Vec::new());
                }
            }
        }
    }

    /// Requests in flight on `pod` over every worker and every live peer
    /// replica, as the filters count them, and the streams this replica's
    /// workers opened there (the peers' reach it late anyway, through the
    /// replica channel).
    fn inflight_of(&mut self, pod: &str) -> InflightCount {
        let Some(slot) = self.state.as_ref().and_then(|s| s.slot(pod)) else {
            return InflightCount::default();
        };
        let peers = match (&self.replicas, &self.state) {
            (Some(sync), Some(state)) => sync
                .loads(state, self.host.now_ms())
                .get(slot)
                .map_or(0, |l| l.requests),
            _ => 0,
        };
        let own = self.host.inflight_of(slot);
        InflightCount {
            requests: own.requests.saturating_add(peers),
            ..own
        }
    }

    /// Writes changed buckets while this tick's budget lasts, then a new
    /// generation of the pod table (after the buckets it counts on): its
    /// numbers, and the whole table when its members changed. Returns a
    /// copy of the table when `copy` (the round's, for its gauges).
    fn publish(&mut self, copy: bool) -> Option<PodTable> {
        let now = self.host.now_ms();
        (self.last_publish_ms, self.folds_unpublished) = (now, false);
        let written = self.write_buckets(now);
        let state = self.state.as_mut()?;
        let table = state.next_table(now);
        let members_changed = self.members_published != Some(table.members_digest);
        self.host
            .publish_table(table, &table.encode_state(), members_changed);
        self.members_published = Some(table.members_digest);
        let generation = table.generation;
        let copy = copy.then(|| table.clone());
        // Last: once it moves, the whole table above is visible.
        self.metrics.gauge(Metric::SnapshotGeneration, generation);
        if let Some(sync) = self.replicas.as_mut() {
            for lag in sync.take_lags(now) {
                self.metrics.histogram(Metric::ReplicaLagMs, lag);
            }
            self.host.publish_peer_loads(sync.loads(state, now));
            self.metrics
                .gauge(Metric::ReplicaConverged, u64::from(sync.converged()));
            for (peer, peer_state) in sync.peer_states() {
                self.metrics
                    .gauge_labelled(Metric::ReplicaPeerState, peer, peer_state.code());
            }
        }
        if log::log_enabled!(log::Level::Trace) {
            event(
                log::Level::Trace,
                "publish",
                json!({"generation": generation, "bucketsWritten": written,
                       "bucketsPending": state.unpublished_buckets(), "indexBlocks": state.index().len()}),
            );
        }
        copy
    }

    /// Writes changed buckets (reports folded, decisions recorded or
    /// expired at `now`) in steps while this tick's budget lasts; returns
    /// how many.
    fn write_buckets(&mut self, now: u64) -> usize {
        let Some(state) = self.state.as_mut() else {
            return 0;
        };
        let mut written = 0;
        while self.budget_us > 0 {
            let started = Instant::now();
            let buckets = state.publish_buckets(now, PUBLISH_BUCKETS);
            let count = buckets.len();
            for (bucket, value) in buckets {
                self.host.write_bucket(bucket, value);
            }
            written += count;
            let spent = started.elapsed().as_micros() as u64;
            self.budget_us = self.budget_us.saturating_sub(spent.max(1));
            if count < PUBLISH_BUCKETS {
                break;
            }
        }
        written
    }

    /// New pods' series at 0, the index gauges, and the per-pod gauges of
    /// this round's table, while [`GAUGE_BUDGET_US`] lasts (at least one
    /// pod a tick); the rest go on at the next tick. A per-pod gauge is
    /// set only when its value changed: a round sets six gauges per pod,
    /// 6,144 at 1,024 pods, most unchanged.
    fn export_gauges(&mut self, config: &Config) {
        let started = Instant::now();
        let budget = tick_budget_us(config, GAUGE_BUDGET_US);
        let within = || started.elapsed().as_micros() < u128::from(budget);
        while let Some(pod) = self.zero_due.pop_front() {
            export_pod_from_zero(&pod, self.host.metric_sink());
            if !within() {
                return;
            }
        }
        let (Some((table, next)), Some(state)) = (self.gauges.as_mut(), self.state.as_ref()) else {
            return;
        };
        let metrics = &mut self.metrics;
        if *next == 0 {
            metrics.gauge(Metric::PrefixTreeNodes, state.index().len() as u64);
            metrics.gauge(Metric::IndexMemoryBytes, state.memory_bytes() as u64);
        }
        while let Some(pod) = table.pods.get(*next) {
            let fallback = u64::from(state.in_report_fallback(&pod.id));
            let mismatch = u64::from(state.block_size_mismatch(&pod.id).is_some());
            let capacity = state.kv_capacity_blocks(&pod.id).unwrap_or(0);
            let resident = state.resident_blocks(&pod.id).unwrap_or(0);
            for (metric, value) in [
                (Metric::QueueDepth, u64::from(pod.queue)),
                (Metric::PodHealthScore, percent(pod.health)),
                (Metric::PodLoad, percent(pod.load)),
                (Metric::PodReportFallback, fallback),
                (Metric::PodBlockSizeMismatch, mismatch),
                (Metric::PodKvCapacityBlocks, capacity),
                (Metric::PodKvResidentBlocks, resident),
            ] {
                metrics.gauge_changed(metric, &pod.id, value);
            }
            *next += 1;
            if !within() {
                break;
            }
        }
        if *next >= table.pods.len() {
            self.gauges = None;
        }
    }

    /// A discovered pod list (`discovery`'s or Envoy's membership),
    /// reconciled by the core; new pods' series start at 0.
    fn apply_discovery(&mut self, body: &[u8]) -> Result<(), String> {
        let config = self.config.clone().ok_or("not configured")?;
        let pods = match &config.membership {
            Some(membership) => discovery::parse_cluster_members(body, membership)?,
            None => discovery::parse_pod_list(body)?,
        };
        let now = self.host.now_ms();
        let (Some(state), Some(polling)) = (self.state.as_mut(), self.polling.as_mut()) else {
            return Err("not configured".into());
        };
        let change = state.replace_pods(&pods, now).map_err(|e| e.to_string())?;
        if change.is_empty() {
            return Ok(());
        }
        polling.retain(state.pods().map(|p| p.id.as_str()));
        for pod in &change.removed {
            self.metrics.forget_changed(pod);
        }
        // Defining a pod's series costs Envoy tens of µs each (stat names,
        // tag regexes): a membership of 1,024 new pods has them defined
        // over the next ticks, with the gauges.
        self.zero_due.extend(change.added.iter().cloned());
        event(
            log::Level::Info,
            "pods_changed",
            json!({"added": change.added, "removed": change.removed, "pods": pods.len()}),
        );
        Ok(())
    }

    fn on_discovery_answer(
        &mut self,
        status: Option<&str>,
        body_size: usize,
        read_body: impl FnOnce(usize) -> Vec<u8>,
    ) {
        let limit = self.config.as_ref().map_or(0, |c| c.max_report_bytes);
        let outcome = match status {
            None => Err(Failure::Unreachable.to_string()),
            Some("200") if body_size > limit => Err(Failure::TooLarge {
                size: body_size,
                limit,
            }
            .to_string()),
            Some("200") => self.apply_discovery(&read_body(body_size)),
            Some(code) => Err(format!("answered HTTP {code}")),
        };
        if let Err(error) = outcome {
            log::warn!("kvroute service: pod discovery ignored: {error}");
        }
    }

    fn start_round(&mut self, config: &Config) {
        if let Some(table) = self.publish(true) {
            // An export the last round did not finish goes on where it
            // stopped, with this round's numbers.
            let next = self.gauges.as_ref().map_or(0, |(_, next)| *next);
            self.gauges = Some((table, next));
        }
        if let (Some(_), Some(state)) = (&config.metrics_path, self.state.as_ref()) {
            // A pod whose last metrics are not answered or folded yet is
            // skipped this round; the others' calls go out over the next
            // ticks ([`ReportService::send_metrics`]).
            let metrics = Pull::Pod(PullKind::Metrics);
            let pending: HashSet<&str> = self
                .pending
                .values()
                .filter(|(_, pull)| *pull == metrics)
                .map(|(pod, _)| pod.as_str())
                .collect();
            self.metrics_due = state
                .pods()
                .filter(|p| !pending.contains(p.id.as_str()) && !state.has_unfolded(&p.id))
                .cloned()
                .collect();
        }
        let discovery_pending = self
            .pending
            .values()
            .any(|(_, pull)| *pull == Pull::Discovery);
        if let (Some(discovery), false) = (&config.discovery, discovery_pending) {
            let destination = discovery.authority.as_deref().unwrap_or(&discovery.cluster);
            self.call(
                "discovery",
                &discovery.cluster,
                destination,
                &discovery.path,
                Pull::Discovery,
                config.report_timeout_ms,
            );
        }
        let peers_pending = self
            .pending
            .values()
            .any(|(_, pull)| *pull == Pull::PeerDiscovery);
        let replicas_cluster = config.replicas.as_ref().and_then(|r| {
            r.cluster
                .as_ref()
                .map(|cluster| (cluster.clone(), r.admin_cluster.clone()))
        });
        if let (Some((cluster, admin)), false) = (replicas_cluster, peers_pending) {
            self.call(
                "replicas",
                &admin,
                &admin,
                &discovery::membership_path(&cluster),
                Pull::PeerDiscovery,
                config.report_timeout_ms,
            );
        }
        if let (Some(membership), false) = (&config.membership, discovery_pending) {
            // Envoy's admin, through a cluster whose endpoint it is.
            self.call(
                "membership",
                &membership.admin_cluster,
                &membership.admin_cluster,
                &discovery::membership_path(&membership.cluster),
                Pull::Discovery,
                config.report_timeout_ms,
            );
        }
    }

    /// Sends this round's metrics calls while this tick's call budget lasts.
    fn send_metrics(&mut self, config: &Config) {
        let Some(path) = &config.metrics_path else {
            return;
        };
        while self.calls_left > 0 {
            let Some(pod) = self.metrics_due.pop_front() else {
                break;
            };
            self.calls_left -= 1;
            self.call(
                &pod.id,
                &config.report_cluster,
                pod.metrics_address.as_deref().unwrap_or(&pod.address),
                path,
                Pull::Pod(PullKind::Metrics),
                config.report_timeout_ms,
            );
        }
    }

    /// Sends the report calls [`ReportPolling`] finds due (precise mode):
    /// for `pods` only (their answers were just folded), or, on a tick,
    /// for every pod from where the last tick's scan stopped, while the
    /// tick's call budget lasts. At most [`RESYNC_CALLS`] `since=0` calls
    /// are in flight.
    fn poll_reports(&mut self, config: &Config, pods: Option<&[String]>) {
        if config.mode != IndexMode::Precise {
            return;
        }
        let now = self.host.now_ms();
        let (Some(state), Some(polling)) = (self.state.as_ref(), self.polling.as_mut()) else {
            return;
        };
        // The whole list only for a tick's scan.
        let all: Vec<&PodConfig> = match pods {
            Some(_) => Vec::new(),
            None => state.pods().collect(),
        };
        let count = all.len();
        let (start, scan) = match pods {
            Some(pods) => (0, pods.len()),
            None => (self.poll_cursor % count.max(1), count),
        };
        let mut calls: Vec<(PodConfig, String, u64, bool)> = Vec::new();
        let mut resyncs = self.resyncs.len();
        let mut scanned = 0;
        while scanned < scan {
            let pod = match pods {
                Some(pods) => pods.get(scanned).and_then(|id| state.pod(id)),
                None => all.get((start + scanned) % count).copied(),
            };
            scanned += 1;
            let Some(pod) = pod else {
                continue;
            };
            let resync = state.needs_resync(&pod.id);
            if resync && resyncs >= RESYNC_CALLS {
                continue;
            }
            let Some(call) = polling.next_call(&pod.id, now) else {
                continue;
            };
            let query = state
                .report_query(&pod.id, &config.report_path)
                .unwrap_or_else(|| config.report_path.clone());
            resyncs += usize::from(resync);
            calls.push((pod.clone(), call.path(&query), call.timeout_ms, resync));
            if pods.is_none() && calls.len() >= self.calls_left {
                break;
            }
        }
        if pods.is_none() {
            self.poll_cursor = (start + scanned) % count.max(1);
            self.calls_left = self.calls_left.saturating_sub(calls.len());
        }
        for (pod, path, timeout, resync) in &calls {
            if *resync {
                self.resyncs.insert(pod.id.clone());
            }
            self.call(
                &pod.id,
                &config.report_cluster,
                pod.report_address.as_deref().unwrap_or(&pod.address),
                path,
                Pull::Pod(PullKind::Report),
                *timeout,
            );
        }
    }

    /// Sends the peer pulls [`ReplicaSync`] finds due.
    fn pull_peers(&mut self, config: &Config) {
        let now = self.host.now_ms();
        let Some(sync) = self.replicas.as_mut() else {
            return;
        };
        for call in sync.calls(now) {
            self.call(
                &call.address,
                &config.report_cluster,
                &call.address,
                &call.path,
                Pull::Peer,
                call.timeout_ms,
            );
        }
    }

    fn on_peer_answer(
        &mut self,
        peer: &str,
        status: Option<&str>,
        body_size: usize,
        read_body: impl FnOnce(usize) -> Vec<u8>,
    ) {
        self.peer_answer(peer, status, body_size, read_body);
        let now = self.host.now_ms();
        if self.folds_unpublished && now.saturating_sub(self.last_publish_ms) >= PUBLISH_GAP_MS {
            self.publish(false);
        }
        if let Some(config) = self.config.clone() {
            self.pull_peers(&config);
        }
    }

    /// Takes a peer's answer (or its failure): its decisions recorded, its
    /// loads replaced, a bad answer counted and logged once per change.
    fn peer_answer(
        &mut self,
        peer: &str,
        status: Option<&str>,
        body_size: usize,
        read_body: impl FnOnce(usize) -> Vec<u8>,
    ) {
        let now = self.host.now_ms();
        let (Some(sync), Some(state)) = (self.replicas.as_mut(), self.state.as_mut()) else {
            return;
        };
        let outcome = sync.answered(peer, status, body_size, read_body, state, now);
        // The peer's loads count at once (one write), not with the next
        // publication: they are what its answers are for between decisions.
        self.host.publish_peer_loads(sync.loads(state, now));
        for record in outcome.feed {
            self.feed.push(record);
        }
        if outcome.recorded > 0 {
            self.metrics.add(
                Metric::ReplicaDecisionsReceived,
                "",
                outcome.recorded as i64,
            );
            self.folds_unpublished = true;
        }
        if outcome.failure_kind.is_some() {
            self.metrics
                .increment_labelled(Metric::ReplicaPullFailures, peer);
        }
        if let Some(transition) = outcome.transition {
            let level = match transition.to {
                PeerState::Failing => log::Level::Warn,
                _ => log::Level::Info,
            };
            event(
                level,
                "replica_peer",
                json!({"peer": peer, "from": transition.from.name(), "state": transition.to.name(),
                       "replica": transition.replica, "error": outcome.error}),
            );
            self.folds_unpublished = true;
        }
    }

    /// The members of `replicas.cluster` as Envoy knows them: the peers.
    fn on_peer_discovery(
        &mut self,
        status: Option<&str>,
        body_size: usize,
        read_body: impl FnOnce(usize) -> Vec<u8>,
    ) {
        let Some(config) = self.config.clone() else {
            return;
        };
        let Some(cluster) = config.replicas.as_ref().and_then(|r| r.cluster.clone()) else {
            return;
        };
        let outcome = match status {
            Some("200") if body_size <= config.max_report_bytes => {
                discovery::cluster_member_addresses(&read_body(body_size), &cluster)
            }
            Some("200") => Err(Failure::TooLarge {
                size: body_size,
                limit: config.max_report_bytes,
            }
            .to_string()),
            Some(code) => Err(format!("answered HTTP {code}")),
            None => Err(Failure::Unreachable.to_string()),
        };
        match (outcome, self.replicas.as_mut()) {
            (Ok(addresses), Some(sync)) => {
                let known: Vec<String> = sync.peer_states().map(|(a, _)| a.to_string()).collect();
                sync.set_peers(&addresses);
                for added in addresses.iter().filter(|a| !known.contains(a)) {
                    export_peer_from_zero(added, self.host.metric_sink());
                }
            }
            (Err(error), _) => log::warn!("kvroute service: replica discovery ignored: {error}"),
            _ => {}
        }
    }

    /// Folds accepted answers in steps while this tick's budget lasts; a
    /// fold that is not done goes on at the next tick. Answers that changed
    /// blocks are published soon after (see the module documentation).
    /// Returns the pods whose report answers were folded (their next call
    /// may be due).
    fn fold(&mut self) -> Vec<String> {
        let mut reported = Vec::new();
        let Some(state) = self.state.as_mut() else {
            return reported;
        };
        let now = self.host.now_ms();
        let polling = &mut self.polling;
        while self.budget_us > 0 && self.fold_budget_us > 0 {
            let started = Instant::now();
            let Some(step) = state.fold_step(now, FOLD_STEP_BLOCKS) else {
                break;
            };
            let spent = started.elapsed().as_micros() as u64;
            self.budget_us = self.budget_us.saturating_sub(spent.max(1));
            self.fold_budget_us = self.fold_budget_us.saturating_sub(spent.max(1));
            let FoldStep::Done(folded) = step else {
                continue;
            };
            log_transitions(folded.transitions);
            if let (PullKind::Report, Some(polling)) = (folded.kind, polling.as_mut()) {
                match &folded.result {
                    Ok(Some(summary)) => {
                        log_cadence(polling.folded(&folded.pod, now, summary.changed_index()));
                    }
                    _ => polling.failed(&folded.pod, now),
                }
                reported.push(folded.pod.clone());
            }
            match folded.result {
                Ok(Some(summary)) => {
                    self.folds_unpublished |= summary.changed_index();
                    if summary.removed > 0 {
                        let removed = i64::try_from(summary.removed).unwrap_or(i64::MAX);
                        self.metrics
                            .add(Metric::PodKvRemovedBlocks, &folded.pod, removed);
                    }
                    event(
                        log::Level::Trace,
                        "report",
                        json!({"pod": folded.pod, "full": summary.full, "stored": summary.stored, "removed": summary.removed,
                               "orphaned": summary.orphaned, "resync": summary.resync}),
                    );
                }
                // Metrics: the pod's queue and load changed.
                Ok(None) => self.folds_unpublished = true,
                Err(_) => count_failure(&mut self.metrics, &folded.pod),
            }
        }
        let evictions = [
            (Metric::PodKvRemovedBlocks, state.take_decided_evictions()),
            (
                Metric::PodKvEvictionsRegretted,
                state.take_regretted_evictions(),
            ),
        ];
        for (metric, counts) in evictions {
            for (pod, blocks) in counts {
                let blocks = i64::try_from(blocks).unwrap_or(i64::MAX);
                self.metrics.add(metric, &pod, blocks);
            }
        }
        reported
    }
}

/// A failed pull of `pod` (any kind), for `epp_report_failures_total`.
fn count_failure(metrics: &mut MetricBatch, pod: &str) {
    metrics.increment_labelled(Metric::ReportFailures, pod);
}

fn log_cadence(change: Option<CadenceChange>) {
    match change {
        Some(CadenceChange {
            pod,
            cadence: Cadence::Interval,
        }) => event(
            log::Level::Warn,
            "pod_report_long_poll_unsupported",
            json!({"pod": pod, "detail": "answers `wait` at once with nothing new: polled every podReportIntervalMs",
                   "longPollRecheckMs": LONG_POLL_RECHECK_MS}),
        ),
        Some(CadenceChange {
            pod,
            cadence: Cadence::LongPoll,
        }) => event(
            log::Level::Info,
            "pod_report_long_poll",
            json!({"pod": pod}),
        ),
        None => {}
    }
}

fn log_transitions(transitions: impl IntoIterator<Item = Transition>) {
    for transition in transitions {
        log_transition(transition);
    }
}

fn log_transition(transition: Transition) {
    match transition {
        Transition::Failing { pod, kind, failure } => event(
            log::Level::Warn,
            "pod_report_failing",
            json!({"pod": pod, "pull": kind.name(), "failure": failure.to_string()}),
        ),
        Transition::Recovered { pod, kind } => event(
            log::Level::Info,
            "pod_report_recovered",
            json!({"pod": pod, "pull": kind.name()}),
        ),
        Transition::ReportFallback { pod } => event(
            log::Level::Warn,
            "pod_report_fallback",
            json!({"pod": pod, "detail": "the report endpoint answers 404 (stock vLLM serves none): \
                   routed as in approximate mode (blocks from kvroute's decisions, load from metricsPath) until it serves reports"}),
        ),
        Transition::ReportPrecise { pod } => event(
            log::Level::Info,
            "pod_report_precise",
            json!({"pod": pod, "detail": "serves reports again: its blocks are the report's"}),
        ),
        Transition::BlockSizeMismatch {
            pod,
            block_size,
            block_size_tokens,
        } => event(
            log::Level::Warn,
            "pod_block_size_mismatch",
            json!({"pod": pod, "blockSize": block_size, "blockSizeTokens": block_size_tokens,
                   "detail": format!("vLLM caches blocks of {block_size} tokens (block_size of vllm:cache_config_info), \
                   kvroute's blockSizeTokens is {block_size_tokens}: precise routing cannot match this pod's blocks \
                   (kvroute-vllm-bridge skips every one) and routes it without cache affinity. Set blockSizeTokens to \
                   {block_size} in the plugin configuration, kvroute's and the bridge's --config alike \
                   (vLLM's CPU build takes multiples of 32 only), or start vLLM with --block-size {block_size_tokens}")}),
        ),
        Transition::BlockSizeMatches { pod, block_size } => event(
            log::Level::Info,
            "pod_block_size_matches",
            json!({"pod": pod, "blockSize": block_size, "detail": "vLLM's block size is blockSizeTokens again"}),
        ),
        Transition::PrefixCachingDisabled { pod } => event(
            log::Level::Warn,
            "pod_prefix_caching_disabled",
            json!({"pod": pod, "detail": "vLLM runs without prefix caching (enable_prefix_caching of vllm:cache_config_info \
                   is False): it reuses no cached prefix, so no routing makes a cache hit there. Start vLLM with --enable-prefix-caching"}),
        ),
        Transition::PrefixCachingEnabled { pod } => event(
            log::Level::Info,
            "pod_prefix_caching_enabled",
            json!({"pod": pod}),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::host::{HostResult, ReplicaHost, Stream};
    use crate::gateway::metrics::MetricSink;
    use crate::gateway::replica::{loads_by_pod, ReplicaServer};
    use crate::index::PrefixLookup;
    use crate::replica::{LogHead, PodInflight};
    use crate::scoring::feed::{Answer as FirstByte, FeedReader, FeedRecord, SessionStart};
    use crate::scoring::ttft::{TtftModel, Work};
    use crate::snapshot::{push_answer, push_decision, push_start, SlotLoad, SnapshotIndex};
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::rc::Rc;

    /// The gauges the service set, by metric and label; other updates
    /// are dropped.
    #[derive(Clone, Default)]
    struct Gauges(Rc<RefCell<HashMap<(Metric, String), u64>>>);
    impl MetricSink for Gauges {
        fn define(&mut self, _: Metric, _: &str) {}
        fn add(&mut self, _: Metric, _: &str, _: i64) {}
        fn set(&mut self, metric: Metric, label: &str, value: u64) {
            self.0
                .borrow_mut()
                .insert((metric, label.to_string()), value);
        }
        fn record(&mut self, _: Metric, _: u64) {}
    }

    /// One replica's shared state, as a host keeps it.
    #[derive(Default)]
    struct Store {
        now: u64,
        buckets: HashMap<u32, Vec<u8>>,
        table: Option<PodTable>,
        log: HashMap<u64, Vec<u8>>,
        head: Option<LogHead>,
        calls: Vec<(u64, Vec<(String, String)>)>,
        next_token: u64,
        feed: Option<Vec<u8>>,
        inflight: InflightCount,
    }

    #[derive(Clone, Default)]
    struct FakeHost(Rc<RefCell<Store>>, Gauges);

    impl ServiceHost for FakeHost {
        fn now_ms(&self) -> u64 {
            self.0.borrow().now
        }
        fn dispatch_call(&mut self, _: &str, headers: &[(&str, &str)], _: u64) -> HostResult<u64> {
            let mut store = self.0.borrow_mut();
            store.next_token += 1;
            let token = store.next_token;
            let headers = headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect();
            store.calls.push((token, headers));
            Ok(token)
        }
        fn write_bucket(&mut self, bucket: u32, value: Vec<u8>) {
            self.0.borrow_mut().buckets.insert(bucket, value);
        }
        fn publish_table(&mut self, table: &PodTable, state: &[u8], members_changed: bool) {
            let mut store = self.0.borrow_mut();
            match store.table.as_mut() {
                Some(published) if !members_changed => {
                    published.apply_state(state).expect("a state of the table");
                }
                _ => store.table = Some(table.clone()),
            }
        }
        fn inflight_of(&mut self, _: usize) -> InflightCount {
            self.0.borrow().inflight
        }
        fn metric_sink(&mut self) -> &mut dyn MetricSink {
            &mut self.1
        }
        fn store_replica_log(&mut self, slot: u64, value: Vec<u8>, head: LogHead) {
            let mut store = self.0.borrow_mut();
            if !value.is_empty() {
                store.log.insert(slot, value);
            }
            store.head = Some(head);
        }
        fn publish_peer_loads(&mut self, _: Vec<SlotLoad>) {}
        fn publish_feed(&mut self, feed: Vec<u8>) {
            self.0.borrow_mut().feed = Some(feed);
        }
    }

    impl ReplicaHost for FakeHost {
        type Other<'a> = Answer;
        fn now_ms(&self) -> u64 {
            self.0.borrow().now
        }
        fn replica_head(&self) -> Option<LogHead> {
            self.0.borrow().head
        }
        fn replica_log(&self, slot: u64) -> Option<Vec<u8>> {
            self.0.borrow().log.get(&slot).cloned()
        }
        fn own_inflight(&mut self) -> Vec<PodInflight> {
            let store = self.0.borrow();
            store
                .table
                .as_ref()
                .map(|t| loads_by_pod(t, &[]))
                .unwrap_or_default()
        }
        fn other(&mut self, _: u32) -> Option<Answer> {
            None
        }
    }

    /// A call's request headers and its answer.
    #[derive(Default)]
    struct Answer {
        request: Vec<(String, String)>,
        status: u32,
        body: Vec<u8>,
    }

    impl Stream for Answer {
        fn request_header(&mut self, name: &str) -> HostResult<Option<Vec<u8>>> {
            Ok(self
                .request
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone().into_bytes()))
        }
        fn remove_request_header(&mut self, _: &str) -> HostResult<()> {
            Ok(())
        }
        fn set_request_header(&mut self, _: &str, _: &str) -> HostResult<()> {
            Ok(())
        }
        fn request_body(&mut self, _: usize) -> Vec<u8> {
            Vec::new()
        }
        fn response_header(&mut self, _: &str) -> String {
            String::new()
        }
        fn set_response_header(&mut self, _: &str, _: &str) -> HostResult<()> {
            Ok(())
        }
        fn response_chunk(&mut self, _: usize) -> Vec<u8> {
            Vec::new()
        }
        fn upstream_host(&mut self) -> Option<String> {
            None
        }
        fn upstream_attempts(&mut self) -> Option<u64> {
            None
        }
        fn response_flags(&mut self) -> Option<u64> {
            None
        }
        fn send_response(
            &mut self,
            status: u32,
            _: &[(&str, &str)],
            body: &[u8],
        ) -> HostResult<()> {
            self.status = status;
            self.body = body.to_vec();
            Ok(())
        }
        fn resume(&mut self) -> HostResult<()> {
            Ok(())
        }
        fn reactivate(&mut self) -> HostResult<()> {
            Ok(())
        }
    }

    fn config() -> Config {
        Config::parse(br#"{"pods": [{"id": "pod-0", "address": "127.0.0.1:9001"},
                                    {"id": "pod-1", "address": "127.0.0.1:9002"}],
                            "mode": "approximate", "podReportIntervalMs": 200, "reportTimeoutMs": 400,
                            "replicas": {"peers": ["127.0.0.1:9902", "127.0.0.1:9903"],
                                         "secret": "0123456789abcdef0123456789abcdef"}}"#)
        .expect("valid")
    }

    /// Replica a routes a chain, as a session start, and sees its answer's
    /// first byte; replica b's service pulls a's replica listener and
    /// publishes the chain for the pod a chose, and the start and the
    /// answer in its own feed.
    #[test]
    fn a_peer_decision_its_start_and_its_answer_reach_the_published_index_and_feed() {
        let (a_host, b_host) = (FakeHost::default(), FakeHost::default());
        let mut a = ReportService::new(a_host.clone());
        let mut b = ReportService::new(b_host.clone());
        assert!(a.configure(config()) && b.configure(config()));
        let mut a_listener = ReplicaServer::new(&config(), a_host.clone());
        a.on_tick();
        b.on_tick();
        for round in 0..4u64 {
            let chain: Vec<u64> = (1..=40).map(|h| h + 1000 * round).collect();
            let slot = (round % 2) as usize;
            let mut batch = Vec::new();
            let start = SessionStart {
                origin: 7,
                match_end: Some(round),
            };
            push_start(&mut batch, slot, &start);
            push_decision(&mut batch, slot, &chain, 0.0);
            let work = 500 + 300 * round;
            push_answer(
                &mut batch,
                &FirstByte::new(slot, Work::new(0, work), 20.0 + 0.1 * work as f64),
            );
            a.on_decisions([batch]);
            a_host.0.borrow_mut().now += 7;
            // b's pulls of its first peer: answered by a's listener (the
            // second is b's own address, as if it had no answer yet).
            let calls = std::mem::take(&mut b_host.0.borrow_mut().calls);
            for (token, headers) in calls.iter().filter(|(_, h)| {
                h.iter().any(|(k, _)| k == REPLICA_KEY_HEADER)
                    && h.iter().any(|(_, v)| v == "127.0.0.1:9902")
            }) {
                let mut call = Answer {
                    request: headers
                        .iter()
                        .filter(|(n, _)| n == ":path" || n == REPLICA_KEY_HEADER)
                        .cloned()
                        .collect(),
                    ..Answer::default()
                };
                call.request.push((":method".into(), "GET".into()));
                for (name, value) in call.request.iter_mut() {
                    if name == ":path" {
                        *value = value.replace("&wait=200", "");
                    }
                }
                a_listener.on_request_headers(1, &mut call);
                assert_eq!(call.status, 200, "{}", String::from_utf8_lossy(&call.body));
                let body = call.body.clone();
                b.on_call_response(*token, Some("200"), body.len(), |_| body.clone());
            }
            b_host.0.borrow_mut().now += 30;
            b.on_tick();
            let store = b_host.0.borrow();
            let table = store.table.as_ref().expect("a table");
            let index = SnapshotIndex {
                buckets: table.buckets,
                fetch: |bucket| store.buckets.get(&bucket).cloned(),
            };
            assert_eq!(index.lookup(&chain).blocks(slot), 40, "round {round}");
        }
        // Both feeds (published on the tick) hold the four answers, on the
        // same slots: every worker of either replica learns the same lines.
        // They hold the four starts too, a's from its worker, b's from a
        // peer (origin 0).
        a.on_tick();
        let read = |host: &FakeHost| {
            let mut model = TtftModel::new(64);
            let feed = host.0.borrow().feed.clone().expect("a feed");
            let mut starts = Vec::new();
            for record in FeedReader::default().read(&feed) {
                match record {
                    FeedRecord::Answer(x) => {
                        model.observe(usize::from(x.slot), x.work(), f64::from(x.ttft_ms));
                    }
                    FeedRecord::Start(start) => starts.push(start),
                }
            }
            (model.line(0), model.line(1), starts)
        };
        let ((a0, a1, a_starts), (b0, b1, b_starts)) = (read(&a_host), read(&b_host));
        assert!(a0.ms_per_token > 0.0 && a1.ms_per_token > 0.0);
        assert_eq!((a0, a1), (b0, b1));
        let start = |origin, round| SessionStart {
            origin,
            match_end: Some(round),
        };
        assert_eq!(a_starts, (0..4).map(|r| start(7, r)).collect::<Vec<_>>());
        assert_eq!(b_starts, (0..4).map(|r| start(0, r)).collect::<Vec<_>>());
    }

    /// vLLM renders its metrics before two requests sent while the scrape
    /// was out reach it: they count as sent after the scrape, so the pod's
    /// queue reads its 1 waiting plus those 2. A report folded later
    /// (queue 0, which vLLM's gauge overrides) moves nothing.
    #[test]
    fn requests_sent_while_a_scrape_is_out_count_after_it() {
        let host = FakeHost::default();
        let mut service = ReportService::new(host.clone());
        let config = Config::parse(
            br#"{"pods": [{"id": "pod-0", "address": "127.0.0.1:9001"}],
                 "podReportIntervalMs": 200, "metricsPath": "/metrics"}"#,
        )
        .expect("valid");
        assert!(service.configure(config));
        let in_flight = |requests, opened| InflightCount { requests, opened };
        host.0.borrow_mut().inflight = in_flight(3, 10);
        service.on_tick();
        let calls = std::mem::take(&mut host.0.borrow_mut().calls);
        let token = |path: &str| {
            calls
                .iter()
                .find(|(_, headers)| headers.iter().any(|(_, v)| v.starts_with(path)))
                .map(|(token, _)| *token)
                .expect(path)
        };
        // Two sent, one answered, while the scrape was out.
        host.0.borrow_mut().inflight = in_flight(4, 12);
        let metrics = b"vllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.5\n";
        service.on_call_response(token("/metrics"), Some("200"), metrics.len(), |_| {
            metrics.to_vec()
        });
        host.0.borrow_mut().inflight = in_flight(5, 13);
        let report =
            br#"{"version":1,"podId":"pod-0","epoch":"e","seq":1,"full":true,"queueDepth":0,
                         "health":1.0,"stored":[]}"#;
        service.on_call_response(
            token("/kvroute/v1/report"),
            Some("200"),
            report.len(),
            |_| report.to_vec(),
        );
        host.0.borrow_mut().now += 1_000;
        service.on_tick();
        let store = host.0.borrow();
        let pod = &store.table.as_ref().expect("a table").pods[0];
        // Its queue now reads 1 + (5 − 2) = 4: the scrape's waiting one,
        // the two sent while it was out and the one sent since.
        assert_eq!((pod.queue, pod.inflight_at_report), (1, 2), "{pod:?}");
    }

    /// Envoy ends every call still out when it shuts down, after its event
    /// loop stopped: with its own 503 (`upstream connect error`, the
    /// connection closed under the call) or no answer at all. Such a call
    /// counts against its pod at the next tick, so one no tick follows
    /// never does; the pod's own 503 counts at once.
    #[test]
    fn a_call_envoy_ends_without_its_pod_fails_at_the_next_tick() {
        let host = FakeHost::default();
        let mut service = ReportService::new(host.clone());
        let config = Config::parse(
            br#"{"pods": [{"id": "pod-0", "address": "127.0.0.1:9001"},
                          {"id": "pod-1", "address": "127.0.0.1:9002"},
                          {"id": "pod-2", "address": "127.0.0.1:9003"}],
                 "podReportIntervalMs": 200}"#,
        )
        .expect("valid");
        assert!(service.configure(config));
        service.on_tick();
        let calls = std::mem::take(&mut host.0.borrow_mut().calls);
        let token = |address: &str| {
            calls
                .iter()
                .find(|(_, headers)| headers.iter().any(|(_, v)| v == address))
                .map(|(token, _)| *token)
                .expect(address)
        };
        let envoys = b"upstream connect error or disconnect/reset before headers. reset reason: connection termination";
        service.on_call_response(token("127.0.0.1:9001"), Some("503"), envoys.len(), |n| {
            envoys[..n].to_vec()
        });
        service.on_call_response(token("127.0.0.1:9002"), None, 0, |_| Vec::new());
        let pods = b"overloaded";
        service.on_call_response(token("127.0.0.1:9003"), Some("503"), pods.len(), |n| {
            pods[..n].to_vec()
        });
        let failures = |service: &ReportService<FakeHost>| {
            let state = service.state.as_ref().expect("configured");
            ["pod-0", "pod-1", "pod-2"].map(|pod| state.failures(pod))
        };
        assert_eq!(failures(&service), [0, 0, 1]);
        service.on_tick();
        assert_eq!(failures(&service), [1, 1, 1]);
    }

    /// A pod whose vLLM caches blocks of 32 tokens while kvroute hashes 16
    /// shows in `epp_pod_block_size_mismatch` (1, the other pod 0), and
    /// both pods' cache sizes in `epp_pod_kv_capacity_blocks`.
    #[test]
    fn vllms_cache_config_reaches_the_per_pod_gauges() {
        let host = FakeHost::default();
        let mut service = ReportService::new(host.clone());
        let config = Config::parse(
            br#"{"pods": [{"id": "pod-0", "address": "127.0.0.1:9001"},
                          {"id": "pod-1", "address": "127.0.0.1:9002"}],
                 "podReportIntervalMs": 200, "metricsPath": "/metrics"}"#,
        )
        .expect("valid");
        assert!(service.configure(config));
        service.on_tick();
        let calls = std::mem::take(&mut host.0.borrow_mut().calls);
        for (pod, block_size, blocks) in [("127.0.0.1:9001", 32, 6103), ("127.0.0.1:9002", 16, 577)]
        {
            let token = calls
                .iter()
                .find(|(_, headers)| {
                    headers.iter().any(|(n, v)| n == ":path" && v == "/metrics")
                        && headers.iter().any(|(_, v)| v == pod)
                })
                .map(|(token, _)| *token)
                .expect("a metrics call");
            let page = format!(
                "vllm:cache_config_info{{block_size=\"{block_size}\",enable_prefix_caching=\"True\",\
                 num_gpu_blocks=\"{blocks}\"}} 1.0\n"
            );
            service.on_call_response(token, Some("200"), page.len(), |_| page.into_bytes());
        }
        // A later round exports the gauges (a round spans ticks when its
        // time budget runs out, as under wasm's slower clock reads).
        for _ in 0..3 {
            host.0.borrow_mut().now += 1_000;
            service.on_tick();
        }
        let gauges = host.1 .0.borrow();
        let gauge = |metric, pod: &str| gauges.get(&(metric, pod.to_string())).copied();
        assert_eq!(gauge(Metric::PodBlockSizeMismatch, "pod-0"), Some(1));
        assert_eq!(gauge(Metric::PodBlockSizeMismatch, "pod-1"), Some(0));
        assert_eq!(gauge(Metric::PodKvCapacityBlocks, "pod-0"), Some(6103));
        assert_eq!(gauge(Metric::PodKvCapacityBlocks, "pod-1"), Some(577));
    }
}
