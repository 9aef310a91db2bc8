//! The HTTP filter's host over the dynamic-module ABI: a request
//! ([`NativeStream`]) and a worker ([`NativeWorker`]) as
//! [`crate::gateway::host`] asks for them.
//!
//! Host behaviour this relies on (Envoy 1.40, checked by the real-Envoy
//! suites run against this build):
//! - the request headers hook returning StopIteration, then each body
//!   chunk StopIterationAndBuffer, holds the request and buffers its body;
//!   at `end_of_stream` the complete body is the buffered chunks plus the
//!   chunk of that call (unless Envoy hands the buffered body itself,
//!   `received_buffered_request_body`); at the trailers it is the buffered
//!   body alone;
//! - Envoy may run this filter's own hooks *inside* a callback that
//!   answers locally (the local reply goes through the response hooks) or
//!   resumes a request: so no such callback is made while the worker is
//!   held. The current request's local reply is sent after the hook
//!   releases its worker ([`NativeStream::take_reply`]); another request
//!   (a waiting one) is resumed or answered on its own worker thread,
//!   later, through its filter scheduler (`EVENT_RESUME`, `EVENT_ANSWER`),
//!   as proxy-wasm defers both until the current callback returns;
//! - the upstream's address and attempt count are attributes; the
//!   response flags are not, so a failed last attempt is read from the
//!   response code details Envoy sets (`upstream_reset_before_response_started{…}`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::abi::{self, EnvoyBuffer, FilterEnvoy, ModuleBuffer, ModuleHeader, SchedulerPtr};
use super::metrics::NativeMetrics;
use super::shared::Shared;
use crate::config::PassiveHealthConfig;
use crate::ejection::{Ejection, RoutableTable};
use crate::gateway::host::{HostError, HostResult, Stream, WorkerHost};
use crate::gateway::metrics::MetricSink;
use crate::index::PrefixLookup;
use crate::snapshot::{InflightChange, PodTable, PublishedPod, SlotLoad, SnapshotIndex};

/// A filter scheduler event: run the worker's tick.
pub const EVENT_TICK: u64 = 1;
/// Resume this (waiting) request.
pub const EVENT_RESUME: u64 = 2;
/// Send this request the local reply kept for it.
pub const EVENT_ANSWER: u64 = 3;
/// Config scheduler events (main thread): the service's tick, decisions.
pub const EVENT_SERVICE_TICK: u64 = 1;
pub const EVENT_DECISIONS: u64 = 2;

/// Wall-clock milliseconds since the Unix epoch (the service's clock too).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A local reply, kept until it can be sent.
pub struct Reply {
    status: u32,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    /// Sends it on `filter`'s stream (Envoy may run this filter's
    /// response hooks inside: the worker must not be held).
    pub fn send(&self, filter: FilterEnvoy) {
        let mut headers: Vec<ModuleHeader> = self
            .headers
            .iter()
            .map(|(name, value)| ModuleHeader::of(name, value))
            .collect();
        // SAFETY: `filter` is the live stream of the current hook; the
        // headers and body outlive the call, Envoy copies them.
        unsafe {
            abi::envoy_dynamic_module_callback_http_send_response(
                filter,
                self.status,
                headers.as_mut_ptr(),
                headers.len(),
                ModuleBuffer::of(&self.body),
                ModuleBuffer::of(b"kvroute"),
            );
        }
    }
}

/// A live request of a worker, as the worker's registry keeps it.
pub struct FilterHandle {
    envoy: usize,
    /// Created when first needed (a waiting request, the worker's ticker).
    scheduler: Option<usize>,
    /// A local reply for it, sent on [`EVENT_ANSWER`].
    reply: Option<Reply>,
}

impl FilterHandle {
    pub fn new(envoy: FilterEnvoy) -> FilterHandle {
        FilterHandle {
            envoy: envoy as usize,
            scheduler: None,
            reply: None,
        }
    }

    /// Its scheduler (created on this worker's thread).
    pub fn scheduler(&mut self) -> SchedulerPtr {
        let envoy = self.envoy;
        *self.scheduler.get_or_insert_with(|| {
            // SAFETY: the filter is alive (registered until destroyed).
            unsafe {
                abi::envoy_dynamic_module_callback_http_filter_scheduler_new(envoy as FilterEnvoy)
                    as usize
            }
        }) as SchedulerPtr
    }

    fn commit(&mut self, event: u64) -> HostResult<()> {
        let scheduler = self.scheduler();
        if scheduler.is_null() {
            return Err(HostError("Envoy gave no filter scheduler".into()));
        }
        // SAFETY: a scheduler of this live filter; deleted only with it.
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_scheduler_commit(scheduler, event)
        };
        Ok(())
    }

    /// The scheduler to delete when the filter goes.
    pub fn take_scheduler(&mut self) -> Option<SchedulerPtr> {
        self.scheduler.take().map(|s| s as SchedulerPtr)
    }

    pub fn take_reply(&mut self) -> Option<Reply> {
        self.reply.take()
    }
}

/// Copies Envoy's body chunks of `body_type`, at most `max` bytes, after
/// `into`.
fn read_chunks(filter: FilterEnvoy, body_type: u32, max: usize, into: &mut Vec<u8>) {
    // SAFETY: `filter` is the live stream; the vector has room for the
    // count Envoy gave; each chunk is checked before it is read.
    unsafe {
        let count = abi::envoy_dynamic_module_callback_http_get_body_chunks_size(filter, body_type);
        if count == 0 {
            return;
        }
        let mut chunks = vec![EnvoyBuffer::EMPTY; count];
        if !abi::envoy_dynamic_module_callback_http_get_body_chunks(
            filter,
            body_type,
            chunks.as_mut_ptr(),
        ) {
            return;
        }
        // One allocation for the whole body, not one per doubling.
        let size: usize = chunks.iter().map(|chunk| chunk.length).sum();
        into.reserve(size.min(max.saturating_sub(into.len())));
        for chunk in chunks {
            let room = max.saturating_sub(into.len());
            if room == 0 {
                break;
            }
            if let Some(bytes) = chunk.bytes() {
                into.extend_from_slice(bytes.get(..room).unwrap_or(bytes));
            }
        }
    }
}

fn header(filter: FilterEnvoy, header_type: u32, name: &str) -> Option<Vec<u8>> {
    let mut value = EnvoyBuffer::EMPTY;
    // SAFETY: `filter` is a live stream; the value is copied before the
    // hook returns.
    unsafe {
        abi::envoy_dynamic_module_callback_http_get_header(
            filter,
            header_type,
            ModuleBuffer::of(name.as_bytes()),
            &mut value,
            0,
            std::ptr::null_mut(),
        )
        .then(|| value.bytes().map(<[u8]>::to_vec))
        .flatten()
    }
}

fn set_header(
    filter: FilterEnvoy,
    header_type: u32,
    name: &str,
    value: Option<&str>,
) -> HostResult<()> {
    let value = value.map_or(
        ModuleBuffer {
            ptr: std::ptr::null(),
            length: 0,
        },
        |v| ModuleBuffer::of(v.as_bytes()),
    );
    // SAFETY: `filter` is a live stream; Envoy copies name and value.
    let done = unsafe {
        abi::envoy_dynamic_module_callback_http_set_header(
            filter,
            header_type,
            ModuleBuffer::of(name.as_bytes()),
            value,
        )
    };
    done.then_some(())
        .ok_or_else(|| HostError(format!("Envoy refused to set {name}")))
}

/// Maps Envoy's response code details of a failed last attempt to the
/// response flags [`crate::ejection::UpstreamOutcome`] reads (`UF`, `UC`,
/// `UR`).
fn flags_from_details(details: &str) -> u64 {
    if !details.starts_with("upstream_reset_before_response_started") {
        return 0;
    }
    if details.contains("connection_failure") || details.contains("connect") {
        0x20
    } else if details.contains("connection_termination") {
        0x40
    } else {
        0x10
    }
}

/// One request as the core acts on it: the current hook's, or a waiting
/// one of the same worker (`waiting`), which is resumed or answered
/// through its scheduler.
pub struct NativeStream<'a> {
    envoy: FilterEnvoy,
    /// Inside a body hook: the chunk of that call is readable.
    in_body_hook: bool,
    waiting: Option<&'a mut FilterHandle>,
    reply: Option<Reply>,
}

impl NativeStream<'_> {
    pub fn current(envoy: FilterEnvoy, in_body_hook: bool) -> NativeStream<'static> {
        NativeStream {
            envoy,
            in_body_hook,
            waiting: None,
            reply: None,
        }
    }

    /// The waiting request `id` among a worker's live `filters`: resumed
    /// or answered through its own scheduler.
    pub fn waiting(filters: &mut HashMap<u32, FilterHandle>, id: u32) -> Option<NativeStream<'_>> {
        let handle = filters.get_mut(&id)?;
        Some(NativeStream {
            envoy: handle.envoy as FilterEnvoy,
            in_body_hook: false,
            waiting: Some(handle),
            reply: None,
        })
    }

    /// The current request's local reply, to send once the worker is free.
    pub fn take_reply(&mut self) -> Option<Reply> {
        self.reply.take()
    }
}

impl Stream for NativeStream<'_> {
    fn request_header(&mut self, name: &str) -> HostResult<Option<Vec<u8>>> {
        Ok(header(self.envoy, abi::REQUEST_HEADER, name))
    }

    fn remove_request_header(&mut self, name: &str) -> HostResult<()> {
        set_header(self.envoy, abi::REQUEST_HEADER, name, None)
    }

    fn set_request_header(&mut self, name: &str, value: &str) -> HostResult<()> {
        set_header(self.envoy, abi::REQUEST_HEADER, name, Some(value))
    }

    fn request_body(&mut self, max: usize) -> Vec<u8> {
        let mut body = Vec::new();
        read_chunks(self.envoy, abi::BUFFERED_REQUEST_BODY, max, &mut body);
        // SAFETY: a plain query of the live stream.
        let received_is_buffered = unsafe {
            abi::envoy_dynamic_module_callback_http_received_buffered_request_body(self.envoy)
        };
        if self.in_body_hook && !received_is_buffered {
            read_chunks(self.envoy, abi::RECEIVED_REQUEST_BODY, max, &mut body);
        }
        body
    }

    fn response_header(&mut self, name: &str) -> String {
        header(self.envoy, abi::RESPONSE_HEADER, name)
            .and_then(|bytes| String::from_utf8(bytes).ok())
            .unwrap_or_default()
    }

    fn set_response_header(&mut self, name: &str, value: &str) -> HostResult<()> {
        set_header(self.envoy, abi::RESPONSE_HEADER, name, Some(value))
    }

    fn response_chunk(&mut self, size: usize) -> Vec<u8> {
        let mut chunk = Vec::new();
        read_chunks(self.envoy, abi::RECEIVED_RESPONSE_BODY, size, &mut chunk);
        chunk
    }

    fn upstream_host(&mut self) -> Option<String> {
        let mut value = EnvoyBuffer::EMPTY;
        // SAFETY: the live stream; the value is copied at once.
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_get_attribute_string(
                self.envoy,
                abi::ATTRIBUTE_UPSTREAM_ADDRESS,
                &mut value,
            )
            .then(|| {
                value
                    .bytes()
                    .map(|b| String::from_utf8_lossy(b).into_owned())
            })
            .flatten()
        }
    }

    fn upstream_attempts(&mut self) -> Option<u64> {
        let mut value = 0u64;
        // SAFETY: the live stream.
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_get_attribute_int(
                self.envoy,
                abi::ATTRIBUTE_UPSTREAM_REQUEST_ATTEMPT_COUNT,
                &mut value,
            )
        }
        .then_some(value)
    }

    fn response_flags(&mut self) -> Option<u64> {
        let mut value = EnvoyBuffer::EMPTY;
        // SAFETY: the live stream; the value is read at once.
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_get_attribute_string(
                self.envoy,
                abi::ATTRIBUTE_RESPONSE_CODE_DETAILS,
                &mut value,
            )
            .then(|| {
                value
                    .bytes()
                    .map(|b| flags_from_details(&String::from_utf8_lossy(b)))
            })
            .flatten()
        }
    }

    fn send_response(
        &mut self,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> HostResult<()> {
        let reply = Reply {
            status,
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            body: body.to_vec(),
        };
        match self.waiting.as_deref_mut() {
            Some(handle) => {
                handle.reply = Some(reply);
                handle.commit(EVENT_ANSWER)
            }
            None => {
                self.reply = Some(reply);
                Ok(())
            }
        }
    }

    fn resume(&mut self) -> HostResult<()> {
        match self.waiting.as_deref_mut() {
            Some(handle) => handle.commit(EVENT_RESUME),
            // The current request resumes by its hook's status.
            None => Ok(()),
        }
    }

    fn reactivate(&mut self) -> HostResult<()> {
        Ok(())
    }
}

/// A worker's side of the shared state, and its live requests.
pub struct NativeWorker {
    shared: Arc<Shared>,
    /// This worker's live requests, by id.
    pub filters: HashMap<u32, FilterHandle>,
    routable: RoutableTable,
    /// Streams this worker counted open and has not released.
    own_streams: i64,
    metrics: NativeMetrics,
    /// Wakes the service on the main thread (config scheduler).
    service_scheduler: usize,
    /// Whether a decision batch wakes the service at once (see
    /// [`NativeWorker::new`]).
    wake_service: bool,
}

impl NativeWorker {
    /// A worker over `shared`. Its decision batches reach the service on
    /// the service's next tick (the tick takes the inbox first), or at
    /// once when `replicated` (the replica log feeds the peers, whose
    /// convergence lag counts from here). Measured reason: with requests
    /// shorter than a tick, an idle worker flushes after every request,
    /// and waking Envoy's main thread for each batch cost 23–28 µs of
    /// main-thread CPU per request at one client (two thirds of it in the
    /// kernel, the wake-up itself), 7 µs without — latency too where the
    /// main thread shares the worker's core
    /// (`integration/results/native/README.md`). The other workers see a
    /// decision at most one tick later instead, as the core documents for
    /// every batch.
    pub fn new(
        shared: Arc<Shared>,
        metrics: NativeMetrics,
        service_scheduler: SchedulerPtr,
        replicated: bool,
    ) -> NativeWorker {
        NativeWorker {
            shared,
            filters: HashMap::new(),
            routable: RoutableTable::default(),
            own_streams: 0,
            metrics,
            service_scheduler: service_scheduler as usize,
            wake_service: replicated && !service_scheduler.is_null(),
        }
    }
}

impl WorkerHost for NativeWorker {
    type Table = Arc<PodTable>;
    type Other<'a> = NativeStream<'a>;

    fn now_ms(&self) -> u64 {
        now_ms()
    }

    fn current_table(&mut self) -> Option<Arc<PodTable>> {
        self.shared.snapshot.table()
    }

    fn routable_table(&mut self, now_ms: u64) -> Option<Arc<PodTable>> {
        let table = self.shared.snapshot.table()?;
        let ejections = self.shared.ejections.load();
        Some(self.routable.of(&table, &ejections, now_ms))
    }

    fn index<'a>(&'a self, table: &'a PodTable) -> impl PrefixLookup + 'a {
        let snapshot = &self.shared.snapshot;
        SnapshotIndex {
            buckets: table.buckets,
            fetch: move |bucket| snapshot.bucket(bucket),
        }
    }

    fn inflight(&mut self, slots: usize) -> Vec<SlotLoad> {
        let mut loads = self.shared.inflight.loads(slots);
        self.shared.replica.add_peer_loads(&mut loads);
        loads
    }

    fn adjust_inflight(&mut self, changes: &[InflightChange]) {
        self.shared.inflight.adjust(changes);
        self.own_streams += changes.iter().map(|c| c.streams).sum::<i64>();
    }

    fn publish_releases(&mut self) {}

    fn idle(&self) -> bool {
        self.own_streams <= 0
    }

    fn eject(
        &mut self,
        pod: &PublishedPod,
        table: &PodTable,
        now_ms: u64,
        policy: &PassiveHealthConfig,
    ) -> Option<Ejection> {
        self.shared.ejections.eject(pod, table, now_ms, policy)
    }

    fn send_decisions(&mut self, batch: &[u8]) {
        if self.shared.decisions.push(batch) && self.wake_service {
            // SAFETY: the config scheduler lives as long as the config,
            // which outlives its workers; committing is thread-safe.
            unsafe {
                abi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                    self.service_scheduler as SchedulerPtr,
                    EVENT_DECISIONS,
                );
            }
        }
    }

    fn feed(&mut self) -> Option<Vec<u8>> {
        self.shared.feed.load().as_deref().cloned()
    }

    fn metric_sink(&mut self) -> &mut dyn MetricSink {
        &mut self.metrics
    }

    fn other(&mut self, id: u32) -> Option<NativeStream<'_>> {
        NativeStream::waiting(&mut self.filters, id)
    }

    fn answers_others_now(&self) -> bool {
        true
    }
}
