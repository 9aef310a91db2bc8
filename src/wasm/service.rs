//! The singleton report service (bootstrap `envoy.bootstrap.wasm`,
//! `singleton: true`, main thread).
//!
//! Every `podReportIntervalMs` a round starts: the service publishes the
//! current snapshot (so health decay shows even when nothing answers), then
//! asks each pod without a metrics call in flight for its vLLM metrics
//! (with `metricsPath`) and pulls the pod list (with `discovery`, or with
//! `membership` Envoy's own admin `/clusters` for the serving cluster,
//! through `membership.adminCluster`; [`crate::discovery`] parses either
//! and [`ClusterState::replace_pods`] reconciles). Report
//! calls follow [`crate::polling`] per pod instead: precise mode keeps one
//! long-poll (`?since=SEQ&epoch=E&wait=W`) pending per pod and sends the
//! next one as soon as the previous answer is folded, or polls on the
//! interval a pod that ignores `wait`. Every call goes through
//! `reportCluster`: an ORIGINAL_DST cluster that connects to the
//! `x-envoy-original-dst-host` set on each call to the pod's address.
//! After folding answers the snapshot is published at once (at most every
//! [`PUBLISH_GAP_MS`], else on the next tick), so a pod's new blocks reach
//! the filters milliseconds after the pod stored them. The filters' routing
//! decisions arrive on a shared queue, batched per worker: approximate
//! mode's only signal, precise mode's pending entries until reports
//! confirm them.
//!
//! The main thread also serves Envoy's admin and xDS, so no callback may
//! stall it — and answers of many pods can land in one pass of Envoy's event
//! loop. The service ticks every [`TICK_MS`] (rounds start on the tick that
//! finds one due) and spends at most [`TICK_BUDGET_US`] per tick folding
//! answers (at most [`FOLD_SHARE_US`] of it) and writing changed buckets,
//! over all its callbacks until the next tick: an answer is only
//! classified and queued when it arrives; folding goes in steps of
//! [`FOLD_STEP_BLOCKS`] blocks (a 16k-block full report takes several,
//! over ticks if need be); changed buckets are written in steps of
//! [`PUBLISH_BUCKETS`], the rest left to the following ticks; bodies over
//! `maxReportBytes` are never read. A step may overrun the budget by its
//! own length (parsing one body is one step).
//! Work per pod is spread the same way, so a pool of 1,024 pods costs no
//! callback 1,024 of anything: a tick starts at most [`CALLS_PER_TICK`]
//! pulls within [`CALL_BUDGET_US`] (scanning the pods from where the last
//! tick stopped), an answer's callback asks only the pods it folded again,
//! at most [`RESYNC_CALLS`] `since=0` calls are in flight, per-pod gauges
//! and new pods' series go out within [`GAUGE_BUDGET_US`] a tick, and the
//! pod table is brought to each generation's numbers in place (its JSON
//! written only when the pods change).
//! A report answer that changed no block is published with the next round
//! (its pod's queue and load with it), not with a table of its own: 64
//! idle pods answer 64 long-polls a second. Metrics answers are published
//! as they come (their queue and load are what they are for). Per-pod
//! gauges are set once per round.
//!
//! Host behaviour: a pull that fails (connection refused, reset mid-body,
//! timeout, a body over the host's buffer limit) still calls
//! `on_http_call_response`, with no response headers. The SDK's header
//! getter panics on the host's status for that (BadArgument); this service
//! reads through [`super::host`], for which it is just "no answer".

use std::collections::{HashMap, HashSet, VecDeque};
use std::rc::Rc;
use std::time::{Duration, Instant};

use proxy_wasm::traits::{Context, RootContext};
use serde_json::json;

use super::host::{self, Buffer, HeaderMap};
use super::logging::event;
use super::{load_config, metrics, shared};
use crate::cluster::{
    ClusterState, Failure, FoldStep, PullAnswer, PullKind, Transition, FOLD_STEP_BLOCKS,
    PUBLISH_BUCKETS,
};
use crate::config::{Config, IndexMode, PodConfig};
use crate::discovery;
use crate::polling::{Cadence, CadenceChange, ReportPolling, LONG_POLL_RECHECK_MS};
use crate::snapshot::{bucket_key, decode_decisions, PodTable, DECISION_QUEUE};

/// Housekeeping period: the longest a due round, an unfolded answer or a
/// pending publication waits.
const TICK_MS: u64 = 25;

/// Main-thread time per tick for folding answers and writing changed
/// buckets (a step may overrun it: parsing one body, bounded by
/// `maxReportBytes`, is one step).
const TICK_BUDGET_US: u64 = 3_000;

/// The part of [`TICK_BUDGET_US`] folding may take; the rest is left to
/// writing, so that folding cannot starve publication. Folding first lets
/// a bucket collect a tick's changes before it is written once.
const FOLD_SHARE_US: u64 = 1_500;

/// Answers (body and parse) the heap is grown for up front.
const RESERVED_BODIES: usize = 8;

/// Least time between two publications triggered by answers (folds closer
/// together are published together, by the next answer or tick).
const PUBLISH_GAP_MS: u64 = 5;

/// Pulls started per tick (report calls that are due, a round's metrics
/// calls), at most: at 1,024 pods a round's calls go out over 16 ticks or
/// more instead of ~1,024 dispatches in one callback. A pod whose answer
/// was just folded is asked again at once, outside this bound (one call
/// per answer).
const CALLS_PER_TICK: usize = 64;

/// Main-thread time per tick for starting pulls: with what a dispatch
/// costs (averaged as calls go out), fewer than [`CALLS_PER_TICK`] start
/// when each costs more than 15 µs.
const CALL_BUDGET_US: f64 = 1_000.0;

/// Main-thread time per tick for per-pod gauges (defining a pod's series
/// costs Envoy tens of µs each; setting one, a few).
const GAUGE_BUDGET_US: u64 = 1_000;

/// Report calls asking for everything (`since=0`: a pod not yet known, or
/// resyncing) in flight at once. Full reports are the large answers and
/// their folding is paced by the tick budget anyway; this bounds how many
/// wait in memory (the heap reserved for [`RESERVED_BODIES`]).
const RESYNC_CALLS: usize = RESERVED_BODIES;

/// Records a service callback's main-thread time in
/// `epp_service_busy_us` when dropped: the service's share of any stall of
/// Envoy's main thread (admin, xDS, stats flushes wait behind it).
struct Busy(Instant);

impl Busy {
    fn start() -> Busy {
        Busy(Instant::now())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        metrics::histogram("epp_service_busy_us", self.0.elapsed().as_micros() as u64);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pull {
    Pod(PullKind),
    Discovery,
}

#[derive(Default)]
pub struct ServiceRoot {
    /// Shared, not cloned, by callbacks that need it beside `&mut self`.
    config: Option<Rc<Config>>,
    state: Option<ClusterState>,
    /// Calls in flight: token → (pod id, what was asked).
    pending: HashMap<u32, (String, Pull)>,
    /// When each pod's next report call goes out.
    polling: Option<ReportPolling>,
    queue: Option<u32>,
    next_round_ms: u64,
    /// What is left of this tick's folding and writing time, and what
    /// folding took of it.
    budget_us: u64,
    folding_us: u64,
    /// Answers were folded since the last publication.
    folds_unpublished: bool,
    last_publish_ms: u64,
    /// The members digest of the JSON pod table last written.
    members_written: Option<u64>,
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

impl ServiceRoot {
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
        let headers = vec![
            (":method", "GET"),
            (":path", path),
            (":authority", destination),
            ("x-envoy-original-dst-host", destination),
        ];
        let timeout = Duration::from_millis(timeout_ms);
        let started = Instant::now();
        let dispatched = self.dispatch_http_call(cluster, headers, None, vec![], timeout);
        let spent = started.elapsed().as_secs_f64() * 1e6;
        self.dispatch_us += (spent - self.dispatch_us) / 16.0;
        match dispatched {
            Ok(token) => {
                self.pending.insert(token, (pod.to_string(), pull));
            }
            Err(status) => {
                log::error!("kvroute service: cannot call cluster {cluster:?} for {pod}: {status:?} (is the cluster defined?)");
                if pull == Pull::Pod(PullKind::Report) {
                    self.resyncs.remove(pod);
                    if let Some(polling) = self.polling.as_mut() {
                        polling.failed(pod, host::now_ms());
                    }
                }
                if let Pull::Pod(kind) = pull {
                    self.fail(pod, kind, Failure::Unreachable);
                }
            }
        }
    }

    fn fail(&mut self, pod: &str, kind: PullKind, failure: Failure) {
        count_failure(pod);
        if let Some(state) = self.state.as_mut() {
            log_transition(state.record_failure(pod, kind, failure));
        }
    }

    fn inflight_of(&self, pod: &str) -> u32 {
        match self.state.as_ref().and_then(|s| s.slot(pod)) {
            Some(slot) => shared::inflight(slot + 1)
                .get(slot)
                .map_or(0, |l| l.requests),
            None => 0,
        }
    }

    /// Writes changed buckets while this tick's budget lasts, then a new
    /// pod table (after the buckets it counts on), which it returns.
    /// Returns a copy of the table when `copy` (the round's, for its
    /// gauges).
    fn publish(&mut self, copy: bool) -> Option<PodTable> {
        let now = host::now_ms();
        (self.last_publish_ms, self.folds_unpublished) = (now, false);
        let written = self.write_buckets(now);
        let state = self.state.as_mut()?;
        let table = state.next_table(now);
        let members_changed = self.members_written != Some(table.members_digest);
        shared::publish_table(table, members_changed);
        self.members_written = Some(table.members_digest);
        let generation = table.generation;
        let copy = copy.then(|| table.clone());
        // Last: once it moves, the whole table above is visible.
        metrics::gauge("epp_snapshot_generation", generation);
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
            for (bucket, value) in &buckets {
                shared::set(&bucket_key(*bucket), value);
            }
            written += buckets.len();
            let spent = started.elapsed().as_micros() as u64;
            self.budget_us = self.budget_us.saturating_sub(spent.max(1));
            if buckets.len() < PUBLISH_BUCKETS {
                break;
            }
        }
        written
    }

    /// New pods' series at 0, the index gauges, and the per-pod gauges of
    /// this round's table, while [`GAUGE_BUDGET_US`] lasts (at least one
    /// pod a tick); the rest go on at the next tick.
    fn export_gauges(&mut self) {
        let started = Instant::now();
        let within = || started.elapsed().as_micros() < u128::from(GAUGE_BUDGET_US);
        while let Some(pod) = self.zero_due.pop_front() {
            metrics::export_pod_from_zero(&pod);
            if !within() {
                return;
            }
        }
        let (Some((table, next)), Some(state)) = (self.gauges.as_mut(), self.state.as_ref()) else {
            return;
        };
        if *next == 0 {
            metrics::gauge("epp_prefix_tree_nodes", state.index().len() as u64);
            metrics::gauge("epp_index_memory_bytes", state.memory_bytes() as u64);
        }
        while let Some(pod) = table.pods.get(*next) {
            metrics::gauge_changed(
                &metrics::labelled("epp_queue_depth", "pod", &pod.id),
                u64::from(pod.queue),
            );
            metrics::gauge_changed(
                &metrics::labelled("epp_pod_health_score", "pod", &pod.id),
                metrics::percent(pod.health),
            );
            metrics::gauge_changed(
                &metrics::labelled("epp_pod_load", "pod", &pod.id),
                metrics::percent(pod.load),
            );
            metrics::gauge_changed(
                &metrics::labelled("epp_pod_report_fallback", "pod", &pod.id),
                u64::from(state.in_report_fallback(&pod.id)),
            );
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
        let (Some(state), Some(polling)) = (self.state.as_mut(), self.polling.as_mut()) else {
            return Err("not configured".into());
        };
        let change = state
            .replace_pods(&pods, host::now_ms())
            .map_err(|e| e.to_string())?;
        if change.is_empty() {
            return Ok(());
        }
        polling.retain(state.pods().map(|p| p.id.as_str()));
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

    fn on_discovery_answer(&mut self, status: Option<String>, body_size: usize) {
        let limit = self.config.as_ref().map_or(0, |c| c.max_report_bytes);
        let outcome = match status.as_deref() {
            None => Err(Failure::Unreachable.to_string()),
            Some("200") if body_size > limit => Err(Failure::TooLarge {
                size: body_size,
                limit,
            }
            .to_string()),
            Some("200") => self.apply_discovery(&call_body(body_size)),
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
            // skipped this round.
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
        let now = host::now_ms();
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
        let now = host::now_ms();
        let polling = &mut self.polling;
        while self.budget_us > 0 && self.folding_us < FOLD_SHARE_US {
            let started = Instant::now();
            let Some(step) = state.fold_step(now, FOLD_STEP_BLOCKS) else {
                break;
            };
            let spent = started.elapsed().as_micros() as u64;
            self.budget_us = self.budget_us.saturating_sub(spent.max(1));
            self.folding_us += spent.max(1);
            let FoldStep::Done(folded) = step else {
                continue;
            };
            log_transition(folded.transition);
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
                    event(
                        log::Level::Trace,
                        "report",
                        json!({"pod": folded.pod, "full": summary.full, "stored": summary.stored, "removed": summary.removed,
                               "orphaned": summary.orphaned, "resync": summary.resync}),
                    );
                }
                // Metrics: the pod's queue and load changed.
                Ok(None) => self.folds_unpublished = true,
                Err(_) => count_failure(&folded.pod),
            }
        }
        reported
    }
}

/// Grows the VM's memory once, at configuration, by what the service's
/// heap holds besides the index (which reserves its own): the snapshot
/// mirror (16 bytes a block) and answers being folded (a few bodies of
/// `maxReportBytes` and their parse). Envoy's V8 copies the whole linear
/// memory when it grows past its reservation: ~100 ms at 66 MB, measured
/// in the middle of a resync. The allocator keeps what is freed here for
/// later allocations.
fn reserve_heap(config: &Config) {
    let bytes = config
        .max_index_blocks
        .saturating_mul(16)
        .saturating_add(config.max_report_bytes.saturating_mul(RESERVED_BODIES));
    drop(std::hint::black_box(Vec::<u8>::with_capacity(bytes)));
}

/// A failed pull of `pod` (any kind), for `epp_report_failures_total`.
fn count_failure(pod: &str) {
    metrics::increment(&metrics::labelled("epp_report_failures_total", "pod", pod));
}

/// The body of the current HTTP call response (empty if the host has none).
fn call_body(size: usize) -> Vec<u8> {
    host::buffer(Buffer::CallResponseBody, 0, size)
        .ok()
        .flatten()
        .unwrap_or_default()
}

impl Context for ServiceRoot {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        _num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let _busy = Busy::start();
        let Some((pod, pull)) = self.pending.remove(&token_id) else {
            return;
        };
        // No headers: the call failed (see the module documentation).
        let status = host::header(HeaderMap::CallResponse, ":status")
            .ok()
            .flatten()
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned());
        let kind = match pull {
            Pull::Discovery => return self.on_discovery_answer(status, body_size),
            Pull::Pod(kind) => kind,
        };
        let now = host::now_ms();
        let inflight = self.inflight_of(&pod);
        let (Some(state), Some(polling)) = (self.state.as_mut(), self.polling.as_mut()) else {
            return;
        };
        if kind == PullKind::Report {
            polling.answered(&pod, now);
            self.resyncs.remove(&pod);
        }
        let answer = PullAnswer {
            status: status.as_deref(),
            body_size,
        };
        let (result, transition) = state.accept_pull(&pod, kind, answer, call_body, inflight);
        log_transition(transition);
        if result.is_err() {
            if kind == PullKind::Report {
                polling.failed(&pod, now);
            }
            count_failure(&pod);
        }
        let reported = self.fold();
        if self.folds_unpublished && now.saturating_sub(self.last_publish_ms) >= PUBLISH_GAP_MS {
            self.publish(false);
        }
        if let Some(config) = self.config.clone() {
            self.poll_reports(&config, Some(&reported));
        }
    }
}

impl RootContext for ServiceRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let configuration = host::buffer(Buffer::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten();
        let Some(config) = load_config(configuration, "service") else {
            return false;
        };
        let tick = config.pod_report_interval_ms.min(TICK_MS);
        if let Err(status) = host::set_tick_period_ms(tick) {
            log::error!("kvroute service: cannot set the tick period: {status}");
            return false;
        }
        // A new configuration starts a new view; the first one only once.
        if self.config.as_deref() != Some(&config) {
            self.state = Some(ClusterState::new(&config, host::now_ms()));
            // After the index took its own reservation.
            reserve_heap(&config);
            self.polling = Some(ReportPolling::new(&config));
            self.members_written = None;
            self.config = Some(Rc::new(config));
            self.next_round_ms = 0;
        }
        true
    }

    fn on_tick(&mut self) {
        let _busy = Busy::start();
        let Some(config) = self.config.clone() else {
            return;
        };
        if self.queue.is_none() {
            self.queue = host::register_queue(DECISION_QUEUE).ok();
        }
        (self.budget_us, self.folding_us) = (TICK_BUDGET_US, 0);
        let affordable = CALL_BUDGET_US / self.dispatch_us.max(1.0);
        self.calls_left = (affordable as usize).clamp(4, CALLS_PER_TICK);
        self.fold();
        let now = host::now_ms();
        if now >= self.next_round_ms {
            self.next_round_ms = now.saturating_add(config.pod_report_interval_ms);
            self.start_round(&config);
        } else if self.folds_unpublished {
            self.publish(false);
        } else {
            // A resync's rest; pending decisions expire on time, not at
            // the next round.
            self.write_buckets(now);
        }
        self.poll_reports(&config, None);
        self.send_metrics(&config);
        self.export_gauges();
        metrics::flush();
    }

    /// Decisions from the filters: recorded, and their buckets written at
    /// once (no new pod table), so every worker matches them within
    /// milliseconds instead of at the next report.
    fn on_queue_ready(&mut self, queue_id: u32) {
        let _busy = Busy::start();
        let Some(state) = self.state.as_mut() else {
            return;
        };
        let now = host::now_ms();
        while let Ok(Some(message)) = host::dequeue(queue_id) {
            match decode_decisions(&message) {
                Some(decisions) => {
                    for (slot, chain) in decisions {
                        state.record_decision(slot, &chain, now);
                    }
                }
                None => log::warn!(
                    "kvroute service: malformed decision message ({} bytes)",
                    message.len()
                ),
            }
        }
        self.write_buckets(now);
    }
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

fn log_transition(transition: Option<Transition>) {
    match transition {
        Some(Transition::Failing { pod, kind, failure }) => event(
            log::Level::Warn,
            "pod_report_failing",
            json!({"pod": pod, "pull": kind.name(), "failure": failure.to_string()}),
        ),
        Some(Transition::Recovered { pod, kind }) => event(
            log::Level::Info,
            "pod_report_recovered",
            json!({"pod": pod, "pull": kind.name()}),
        ),
        Some(Transition::ReportFallback { pod }) => event(
            log::Level::Warn,
            "pod_report_fallback",
            json!({"pod": pod, "detail": "the report endpoint answers 404 (stock vLLM serves none): \
                   routed as in approximate mode (blocks from kvroute's decisions, load from metricsPath) until it serves reports"}),
        ),
        Some(Transition::ReportPrecise { pod }) => event(
            log::Level::Info,
            "pod_report_precise",
            json!({"pod": pod, "detail": "serves reports again: its blocks are the report's"}),
        ),
        None => {}
    }
}
