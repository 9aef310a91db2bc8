//! The shared filter config: what Envoy creates once per HTTP filter
//! configuration on the main thread and every worker's filters share. It
//! owns the state in process memory ([`Shared`]), one [`Worker`] per
//! Envoy worker, and the report service — no bootstrap singleton.
//!
//! Threads: the service runs on Envoy's main thread, woken through the
//! config scheduler (its tick, and decision batches from the workers) and
//! calling pods through the config's HTTP callouts — Envoy's clusters,
//! connection pools, TLS and stats, as under proxy-wasm. Each worker's
//! state is used on that worker's thread only (a mutex nobody else takes,
//! uncontended). A module thread, the ticker, only commits events: every
//! [`crate::gateway::service::TICK_MS`] the service's tick to the main
//! thread, and every [`TICK_MS`] a worker's tick to a live request of that
//! worker (its filter scheduler, [`super::workers`]) when the worker has
//! waiting requests or batches to flush. The ticker is joined when Envoy
//! destroys the config. With `replicas`, the config attaches its state to
//! the replica channel ([`super::replica`]) the replica listener of the
//! same Envoy serves from.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;

use super::abi::{self, FilterConfigEnvoy, ModuleBuffer, ModuleHeader, SchedulerPtr};
use super::filter::{FilterHandle, NativeWorker, EVENT_SERVICE_TICK, EVENT_TICK};
use super::metrics::NativeMetrics;
use super::replica::{self, ReplicaChannel};
use super::shared::{DecisionInbox, Inflight, ReplicaShare, Shared, SharedEjections, Snapshot};
use super::workers::{Ticker, WorkerState, Workers};
use crate::config::MAX_PODS;
use crate::gateway::filter::{Worker, TICK_MS};
use crate::gateway::host::{HostError, HostResult, ServiceHost};
use crate::gateway::metrics::MetricSink;
use crate::gateway::service::{tick_period_ms, ReportService};
use crate::replica::LogHead;
use crate::snapshot::{InflightCount, PodTable, SlotLoad};

impl WorkerState for Worker<NativeWorker> {
    fn filters(&mut self) -> &mut HashMap<u32, FilterHandle> {
        &mut self.host.filters
    }

    fn has_work(&self) -> bool {
        Worker::has_work(self)
    }
}

/// The service's host: callouts from the config, the in-process snapshot.
pub struct NativeService {
    config: usize,
    shared: Arc<Shared>,
    metrics: NativeMetrics,
}

impl ServiceHost for NativeService {
    fn now_ms(&self) -> u64 {
        super::filter::now_ms()
    }

    fn dispatch_call(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u64,
    ) -> HostResult<u64> {
        let mut headers: Vec<ModuleHeader> = headers
            .iter()
            .map(|(name, value)| ModuleHeader::of(name, value))
            .collect();
        let mut id = 0u64;
        // SAFETY: called on the main thread while the config lives; Envoy
        // copies the cluster name and headers.
        let result = unsafe {
            abi::envoy_dynamic_module_callback_http_filter_config_http_callout(
                self.config as FilterConfigEnvoy,
                &mut id,
                ModuleBuffer::of(cluster.as_bytes()),
                headers.as_mut_ptr(),
                headers.len(),
                ModuleBuffer::of(&[]),
                timeout_ms,
            )
        };
        match result {
            abi::CALLOUT_INIT_SUCCESS => Ok(id),
            1 => Err(HostError("missing required headers".into())),
            2 => Err(HostError("ClusterNotFound".into())),
            code => Err(HostError(format!("callout refused ({code})"))),
        }
    }

    fn write_bucket(&mut self, bucket: u32, value: Vec<u8>) {
        if !self.shared.snapshot.write_bucket(bucket, value) {
            log::error!("kvroute service: bucket {bucket} is outside the snapshot");
        }
    }

    fn publish_table(&mut self, table: &PodTable, state: &[u8], members_changed: bool) {
        self.shared
            .snapshot
            .publish_table(table, state, members_changed);
    }

    fn inflight_of(&mut self, slot: usize) -> InflightCount {
        self.shared.inflight.count(slot)
    }

    fn metric_sink(&mut self) -> &mut dyn MetricSink {
        &mut self.metrics
    }

    fn store_replica_log(&mut self, slot: u64, value: Vec<u8>, head: LogHead) {
        self.shared.replica.store(slot, value, head);
    }

    fn publish_peer_loads(&mut self, loads: Vec<SlotLoad>) {
        self.shared.replica.publish_peer_loads(loads);
    }

    fn publish_feed(&mut self, feed: Vec<u8>) {
        self.shared.feed.store(Some(Arc::new(feed)));
    }
}

/// The module's side of one HTTP filter configuration.
pub struct FilterConfig {
    pub shared: Arc<Shared>,
    pub workers: Workers<Worker<NativeWorker>>,
    pub service: Mutex<ReportService<NativeService>>,
    /// Wakes the service on the main thread.
    scheduler: usize,
    ticker: Mutex<Option<Ticker>>,
    /// Where this Envoy's replica listener finds [`Self::shared`] (with
    /// `replicas` configured).
    channel: Option<Arc<ReplicaChannel>>,
}

impl FilterConfig {
    /// Builds the configuration Envoy created as `envoy` (main thread):
    /// `None` when the plugin JSON is invalid (the error is logged).
    pub fn new(envoy: FilterConfigEnvoy, bytes: &[u8]) -> Option<FilterConfig> {
        let mut metrics = NativeMetrics::define_all(envoy);
        let config = crate::gateway::load_config(bytes, "filter", Some(&mut metrics))?;
        // SAFETY: both on the main thread, during the config's creation.
        let (concurrency, scheduler) = unsafe {
            (
                abi::envoy_dynamic_module_callback_get_concurrency(),
                abi::envoy_dynamic_module_callback_http_filter_config_scheduler_new(envoy),
            )
        };
        let shared = Arc::new(Shared {
            snapshot: Snapshot::new(config.snapshot_buckets()),
            inflight: Inflight::new(MAX_PODS),
            ejections: SharedEjections::default(),
            decisions: DecisionInbox::default(),
            replica: ReplicaShare::default(),
            feed: ArcSwapOption::empty(),
        });
        let workers = Workers::new(concurrency, || {
            Worker::new(
                config.clone(),
                NativeWorker::new(
                    shared.clone(),
                    metrics.clone(),
                    scheduler,
                    config.replicas.is_some(),
                ),
            )
        });
        let period = Duration::from_millis(tick_period_ms(&config).max(1));
        let channel = config.replicas.as_ref().map(|replicas| {
            let channel = replica::channel(replicas);
            channel.attach(shared.clone());
            channel
        });
        let mut service = ReportService::new(NativeService {
            config: envoy as usize,
            shared: shared.clone(),
            metrics,
        });
        service.configure(config);
        let ticker = (!scheduler.is_null())
            .then(|| {
                // The service's tick every `period`, the workers' every
                // TICK_MS.
                let service_scheduler = scheduler as usize;
                let tick_workers = workers.ticks(EVENT_TICK);
                let worker_period = Duration::from_millis(TICK_MS);
                let mut last_worker_tick = Instant::now();
                Ticker::start("kvroute-ticker", period, move || {
                    // SAFETY: the config scheduler is deleted only after
                    // the ticker is joined.
                    unsafe {
                        abi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                            service_scheduler as SchedulerPtr,
                            EVENT_SERVICE_TICK,
                        );
                    }
                    if last_worker_tick.elapsed() >= worker_period {
                        last_worker_tick = Instant::now();
                        tick_workers();
                    }
                })
            })
            .flatten();
        if ticker.is_none() {
            log::error!("kvroute: no ticker (scheduler or thread refused): waiting requests and reports stall");
        }
        Some(FilterConfig {
            shared,
            workers,
            service: Mutex::new(service),
            scheduler: scheduler as usize,
            ticker: Mutex::new(ticker),
            channel,
        })
    }

    pub fn service(&self) -> MutexGuard<'_, ReportService<NativeService>> {
        self.service.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops the ticker and the config scheduler, and leaves the replica
    /// channel (Envoy is destroying the config, on the main thread: when
    /// it shuts down, after it ended the callouts still out, or when a
    /// new configuration replaces this one).
    pub fn shut_down(&self) {
        self.service().shut_down();
        if let Some(channel) = &self.channel {
            channel.detach(&self.shared);
        }
        if let Some(ticker) = self.ticker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            ticker.stop();
        }
        if self.scheduler != 0 {
            // SAFETY: the ticker, its only other user, has been joined.
            unsafe {
                abi::envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
                    self.scheduler as SchedulerPtr,
                );
            }
        }
    }
}
