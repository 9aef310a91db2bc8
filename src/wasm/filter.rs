//! The HTTP filter over proxy-wasm: [`crate::gateway::filter`] decides,
//! this file hands it the host.
//!
//! Host behaviour this relies on:
//! - `on_http_request_headers` returning `Pause` holds the headers until
//!   a later callback continues (needs `allow_on_headers_stop_iteration:
//!   true` in the PluginConfig, or the request hangs);
//! - while paused, `body_size` is the total buffered so far; the request
//!   is routed once complete — at the body's `end_of_stream`, or at the
//!   trailers when the request has them (HTTP/2, or HTTP/1 chunked with
//!   `enable_trailers`), where the buffered body is still readable;
//! - `on_http_response_headers` runs for the pod's response and for
//!   Envoy's own 503 after a failed connection, with `response.flags`,
//!   `upstream.address` (the last attempt's host) and
//!   `upstream.request_attempt_count` readable;
//! - `on_log` runs once at the end of every stream (also after local
//!   replies and client resets): the in-flight count is released there.
//!
//! Waiting requests (Envoy 1.40, proxy-wasm ABI 0.2.1), verified in real
//! Envoy by `integration/tests/waiting.rs`:
//! - `proxy_set_effective_context(http_context_id)` returns Ok for a
//!   paused request, from the root context's `on_tick` and from another
//!   request's callback (`on_log`, a new request's body callback), and
//!   makes the following host calls act on that request until the
//!   callback returns: `proxy_replace_header_map_value` on its request
//!   headers (the routing header, which the cluster then follows),
//!   `proxy_continue_stream(0)` (resumes it), and
//!   `proxy_send_local_response` (the 503 with `retry-after` arrives).
//! - A client that resets its connection while its request is paused:
//!   `on_log` runs for the request's context (within milliseconds), which
//!   removes it from the queue.
//! - Probed once by hand (a throwaway build logging the statuses on the
//!   tick after a request's `on_log`): `proxy_set_effective_context` of a
//!   request that ended returns BadArgument (2), as does an id never used;
//!   the effective context then stays the root, where
//!   `proxy_replace_header_map_value` on request headers returns
//!   BadArgument but `proxy_continue_stream(0)` returns **Ok** (a no-op).
//!   So a failed `set_effective_context` must stop there: the entry is
//!   dropped as gone.
//!
//! From Envoy's and proxy-wasm-cpp-host's source, consistent with the
//! tests: Envoy defers the resumption and the local reply until the
//! current VM callback returns (`addAfterVmCallAction`), so no callback
//! of the resumed request runs inside ours; `continueStream` forgets the
//! request's headers, so the routing header is set before it; a local
//! reply sets the VM's "stop next iteration" flag, which forces the
//! *current* HTTP callback's result to stop iteration (reset after each
//! callback). Hence a request is answered from another context only in
//! the root tick ([`WorkerHost::answers_others_now`]): answers due inside
//! an HTTP callback (a displaced entry, a failed re-route) are owed until
//! the next tick.
//!
//! The per-worker state is the VM's: the snapshot and in-flight loads in
//! shared data ([`shared`]), decisions to the service on a shared queue.
//! Every host call goes through [`super::host`], which returns the host's
//! status instead of panicking.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};

use super::host::{self, Buffer, HeaderMap, Headers, Status};
use super::metrics::WasmMetrics;
use super::{load_config, shared};
use crate::config::PassiveHealthConfig;
use crate::ejection::Ejection;
use crate::gateway::filter::{RequestFilter, Worker, TICK_MS};
use crate::gateway::host::{self as gateway, HostError, HostResult, Stream, WorkerHost};
use crate::gateway::metrics::MetricSink;
use crate::index::PrefixLookup;
use crate::snapshot::{
    InflightChange, PodTable, PublishedPod, SlotLoad, SnapshotIndex, DECISION_QUEUE,
};

fn error(status: Status) -> HostError {
    HostError(status.to_string())
}

/// A request of this VM: the effective context's (the callback's own, or
/// one made effective by [`WasmWorker::other`]).
pub struct WasmStream {
    context_id: u32,
    /// The request headers, read in one host call when first asked: each
    /// host call costs Envoy a few µs (measured: most of kvroute's CPU per
    /// request is Envoy's side of its host calls, not the decision).
    headers: Option<Result<Headers, Status>>,
}

impl WasmStream {
    pub fn new(context_id: u32) -> WasmStream {
        WasmStream {
            context_id,
            headers: None,
        }
    }
}

impl Stream for WasmStream {
    fn request_header(&mut self, name: &str) -> HostResult<Option<Vec<u8>>> {
        let headers = self
            .headers
            .get_or_insert_with(|| host::headers(HeaderMap::Request));
        match headers {
            Ok(headers) => Ok(headers.get(name)),
            Err(status) => Err(error(*status)),
        }
    }

    fn remove_request_header(&mut self, name: &str) -> HostResult<()> {
        host::remove_header(HeaderMap::Request, name).map_err(error)
    }

    fn set_request_header(&mut self, name: &str, value: &str) -> HostResult<()> {
        host::set_header(HeaderMap::Request, name, value).map_err(error)
    }

    fn request_body(&mut self, max: usize) -> Vec<u8> {
        host::buffer(Buffer::RequestBody, 0, max)
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    fn response_header(&mut self, name: &str) -> String {
        host::header_text(HeaderMap::Response, name)
    }

    fn set_response_header(&mut self, name: &str, value: &str) -> HostResult<()> {
        host::set_header(HeaderMap::Response, name, value).map_err(error)
    }

    fn response_chunk(&mut self, size: usize) -> Vec<u8> {
        host::buffer(Buffer::ResponseBody, 0, size)
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    fn upstream_host(&mut self) -> Option<String> {
        host::property(&["upstream", "address"])
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
    }

    fn upstream_attempts(&mut self) -> Option<u64> {
        host::property_u64(&["upstream", "request_attempt_count"])
    }

    fn response_flags(&mut self) -> Option<u64> {
        host::property_u64(&["response", "flags"])
    }

    fn send_response(
        &mut self,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> HostResult<()> {
        host::send_response(status, headers, body).map_err(error)
    }

    fn resume(&mut self) -> HostResult<()> {
        host::continue_request().map_err(error)
    }

    fn reactivate(&mut self) -> HostResult<()> {
        host::set_effective_context(self.context_id).map_err(error)
    }
}

/// The VM's side of a worker: shared data, the decision queue, metrics.
#[derive(Default)]
pub struct WasmWorker {
    tables: shared::TableCache,
    decision_queue: Option<u32>,
    metrics: WasmMetrics,
    /// Inside the root's tick, where other requests may be answered.
    in_tick: bool,
}

impl WorkerHost for WasmWorker {
    type Table = Arc<PodTable>;
    type Other<'a> = WasmStream;

    fn now_ms(&self) -> u64 {
        host::now_ms()
    }

    fn current_table(&mut self) -> Option<Arc<PodTable>> {
        self.tables.current()
    }

    fn routable_table(&mut self, now_ms: u64) -> Option<Arc<PodTable>> {
        self.tables.routable(now_ms)
    }

    fn index<'a>(&'a self, table: &'a PodTable) -> impl PrefixLookup + 'a {
        SnapshotIndex {
            buckets: table.buckets,
            fetch: shared::bucket,
        }
    }

    fn inflight(&mut self, slots: usize) -> Vec<SlotLoad> {
        let mut loads = shared::inflight(slots);
        shared::add_peer_loads(&mut loads);
        loads
    }

    fn adjust_inflight(&mut self, changes: &[InflightChange]) {
        shared::adjust_inflight(changes);
    }

    fn publish_releases(&mut self) {
        shared::publish_releases();
    }

    fn idle(&self) -> bool {
        shared::idle()
    }

    fn eject(
        &mut self,
        pod: &PublishedPod,
        table: &PodTable,
        now_ms: u64,
        policy: &PassiveHealthConfig,
    ) -> Option<Ejection> {
        shared::eject(pod, table, now_ms, policy)
    }

    fn send_decisions(&mut self, batch: &[u8]) {
        if self.decision_queue.is_none() {
            self.decision_queue = host::property(&["plugin_vm_id"]).and_then(|vm_id| {
                host::resolve_queue(&String::from_utf8_lossy(&vm_id), DECISION_QUEUE).ok()
            });
        }
        if let Some(queue) = self.decision_queue {
            let _ = host::enqueue(queue, batch);
        }
    }

    fn feed(&mut self) -> Option<Vec<u8>> {
        shared::feed()
    }

    fn metric_sink(&mut self) -> &mut dyn MetricSink {
        &mut self.metrics
    }

    fn other(&mut self, id: u32) -> Option<WasmStream> {
        match host::set_effective_context(id) {
            Ok(()) => Some(WasmStream::new(id)),
            Err(status) => {
                log::debug!("kvroute filter: request {id} is gone ({status})");
                None
            }
        }
    }

    fn answers_others_now(&self) -> bool {
        self.in_tick
    }
}

type SharedWorker = Rc<RefCell<Worker<WasmWorker>>>;

#[derive(Default)]
pub struct FilterRoot {
    worker: Option<SharedWorker>,
}

impl Context for FilterRoot {}

impl RootContext for FilterRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let Some(config) = load_config("filter") else {
            return false;
        };
        shared::init_ejections();
        if !shared::claim_inflight() {
            log::error!("kvroute filter: cannot claim an in-flight key in shared data");
            return false;
        }
        // Flushes the batches and runs the wait queue.
        if let Err(status) = host::set_tick_period_ms(TICK_MS) {
            log::error!("kvroute filter: cannot start the tick: {status}");
            return false;
        }
        let worker = Worker::new(config, WasmWorker::default());
        self.worker = Some(Rc::new(RefCell::new(worker)));
        true
    }

    fn on_tick(&mut self) {
        if let Some(worker) = &self.worker {
            let mut worker = worker.borrow_mut();
            worker.host.in_tick = true;
            worker.on_tick();
            worker.host.in_tick = false;
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Never `None`: the SDK's dispatcher panics on it.
        Some(Box::new(RequestContext {
            context_id,
            worker: self.worker.clone(),
            filter: RequestFilter::new(context_id),
        }))
    }
}

struct RequestContext {
    context_id: u32,
    /// `None` only if the plugin never configured (Envoy then refuses it).
    worker: Option<SharedWorker>,
    filter: RequestFilter,
}

fn action(action: gateway::Action) -> Action {
    match action {
        gateway::Action::Continue => Action::Continue,
        gateway::Action::Pause => Action::Pause,
    }
}

impl RequestContext {
    /// Runs `callback` with the worker and this request's stream.
    fn with(
        &mut self,
        callback: impl FnOnce(
            &mut RequestFilter,
            &mut Worker<WasmWorker>,
            &mut WasmStream,
        ) -> gateway::Action,
    ) -> Action {
        let Some(worker) = self.worker.clone() else {
            return Action::Continue;
        };
        let mut stream = WasmStream::new(self.context_id);
        let result = callback(&mut self.filter, &mut worker.borrow_mut(), &mut stream);
        action(result)
    }
}

impl Context for RequestContext {}

impl HttpContext for RequestContext {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if self.worker.is_none() {
            return action(RequestFilter::unconfigured(&mut WasmStream::new(
                self.context_id,
            )));
        }
        self.with(|filter, worker, stream| filter.on_request_headers(worker, stream, end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.with(|filter, worker, stream| {
            filter.on_request_body(worker, stream, body_size, end_of_stream)
        })
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.with(|filter, worker, stream| filter.on_request_trailers(worker, stream))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.with(|filter, worker, stream| filter.on_response_headers(worker, stream))
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        // Continue keeps the response streaming: `body_size` is this
        // chunk only and nothing is buffered.
        self.with(|filter, worker, stream| filter.on_response_body(worker, stream, body_size))
    }

    fn on_log(&mut self) {
        self.with(|filter, worker, _| {
            filter.on_stream_end(worker);
            gateway::Action::Continue
        });
    }
}
