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
//! worker (its filter scheduler) when the worker has waiting requests or
//! batches to flush. The ticker is joined when Envoy destroys the config.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::abi::{self, FilterConfigEnvoy, ModuleBuffer, ModuleHeader, SchedulerPtr};
use super::filter::{NativeWorker, EVENT_SERVICE_TICK, EVENT_TICK};
use super::metrics::NativeMetrics;
use super::shared::{DecisionInbox, Inflight, ReplicaShare, Shared, SharedEjections, Snapshot};
use crate::config::MAX_PODS;
use crate::gateway::filter::{Worker, TICK_MS};
use crate::gateway::host::{HostError, HostResult, ServiceHost};
use crate::gateway::metrics::MetricSink;
use crate::gateway::service::{tick_period_ms, ReportService};
use crate::replica::LogHead;
use crate::snapshot::{PodTable, SlotLoad};

/// One Envoy worker's state.
pub struct WorkerSlot {
    pub worker: Mutex<Worker<NativeWorker>>,
    /// The scheduler of a live request of this worker that receives the
    /// worker's tick, and that request's id. Held while committing, so the
    /// request cannot delete it meanwhile.
    pub ticker: Mutex<Option<(u32, usize)>>,
    /// The worker has waiting requests or batches (set after each hook).
    pub has_work: AtomicBool,
}

impl WorkerSlot {
    pub fn lock(&self) -> MutexGuard<'_, Worker<NativeWorker>> {
        // A panic caught in a hook leaves the worker usable: each field is
        // consistent on its own.
        self.worker.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn ticker(&self) -> MutexGuard<'_, Option<(u32, usize)>> {
        self.ticker.lock().unwrap_or_else(|e| e.into_inner())
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

    fn publish_table(&mut self, table: PodTable) {
        self.shared.snapshot.publish_table(table);
    }

    fn inflight_of(&mut self, slot: usize) -> u32 {
        self.shared.inflight.requests(slot)
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
}

/// The module's side of one HTTP filter configuration.
pub struct FilterConfig {
    pub shared: Arc<Shared>,
    pub workers: Arc<[WorkerSlot]>,
    pub service: Mutex<ReportService<NativeService>>,
    /// Wakes the service on the main thread.
    scheduler: usize,
    ticker: Mutex<Option<(Sender<()>, JoinHandle<()>)>>,
    next_id: AtomicU32,
}

impl FilterConfig {
    /// Builds the configuration Envoy created as `envoy` (main thread):
    /// `None` when the plugin JSON is invalid (the error is logged).
    pub fn new(envoy: FilterConfigEnvoy, bytes: &[u8]) -> Option<FilterConfig> {
        let mut metrics = NativeMetrics::define_all(envoy);
        let config = crate::gateway::load_config(bytes, "filter", &mut metrics)?;
        // SAFETY: both on the main thread, during the config's creation.
        let (workers, scheduler) = unsafe {
            (
                abi::envoy_dynamic_module_callback_get_concurrency().max(1),
                abi::envoy_dynamic_module_callback_http_filter_config_scheduler_new(envoy),
            )
        };
        let shared = Arc::new(Shared {
            snapshot: Snapshot::new(config.snapshot_buckets()),
            inflight: Inflight::new(MAX_PODS),
            ejections: SharedEjections::default(),
            decisions: DecisionInbox::default(),
            replica: ReplicaShare::default(),
        });
        let workers: Arc<[WorkerSlot]> = (0..workers)
            .map(|_| WorkerSlot {
                worker: Mutex::new(Worker::new(
                    config.clone(),
                    NativeWorker::new(shared.clone(), metrics.clone(), scheduler),
                )),
                ticker: Mutex::new(None),
                has_work: AtomicBool::new(false),
            })
            .collect();
        let period = Duration::from_millis(tick_period_ms(&config).max(1));
        let mut service = ReportService::new(NativeService {
            config: envoy as usize,
            shared: shared.clone(),
            metrics,
        });
        service.configure(config);
        let ticker = (!scheduler.is_null())
            .then(|| start_ticker(workers.clone(), scheduler as usize, period))
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
            next_id: AtomicU32::new(1),
        })
    }

    /// The worker slot of Envoy worker `index` (the last one if Envoy
    /// reports more workers than it said it had).
    pub fn slot(&self, index: usize) -> Option<&WorkerSlot> {
        self.workers.get(index).or_else(|| self.workers.last())
    }

    pub fn next_id(&self) -> u32 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn service(&self) -> MutexGuard<'_, ReportService<NativeService>> {
        self.service.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops the ticker and the config scheduler (Envoy is destroying the
    /// config, on the main thread).
    pub fn shut_down(&self) {
        let ticker = self.ticker.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some((stop, thread)) = ticker {
            drop(stop);
            let _ = thread.join();
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

/// Starts the ticker thread (see the module documentation); it ends when
/// the returned sender is dropped.
fn start_ticker(
    workers: Arc<[WorkerSlot]>,
    service_scheduler: usize,
    period: Duration,
) -> Option<(Sender<()>, JoinHandle<()>)> {
    let (stop, stopped) = mpsc::channel::<()>();
    let worker_period = Duration::from_millis(TICK_MS);
    let thread = std::thread::Builder::new()
        .name("kvroute-ticker".into())
        .spawn(move || {
            let mut last_worker_tick = Instant::now();
            loop {
                match stopped.recv_timeout(period) {
                    Err(RecvTimeoutError::Timeout) => {}
                    _ => return,
                }
                // SAFETY: the config scheduler is deleted only after this
                // thread is joined.
                unsafe {
                    abi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                        service_scheduler as SchedulerPtr,
                        EVENT_SERVICE_TICK,
                    );
                }
                if last_worker_tick.elapsed() < worker_period {
                    continue;
                }
                last_worker_tick = Instant::now();
                for slot in workers.iter() {
                    if !slot.has_work.load(Ordering::Acquire) {
                        continue;
                    }
                    let ticker = slot.ticker();
                    if let Some((_, scheduler)) = *ticker {
                        // SAFETY: the scheduler's request deletes it only
                        // after clearing the ticker, under this lock.
                        unsafe {
                            abi::envoy_dynamic_module_callback_http_filter_scheduler_commit(
                                scheduler as SchedulerPtr,
                                EVENT_TICK,
                            );
                        }
                    }
                }
            }
        })
        .ok()?;
    Some((stop, thread))
}
