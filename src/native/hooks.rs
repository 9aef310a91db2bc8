//! The event hooks Envoy calls (`envoy_dynamic_module_on_*`): each checks
//! its pointers, catches any panic ([`guard`]) and hands the event to the
//! core through [`super::config`], [`super::replica`] and
//! [`super::filter`]. One module serves two filters, by `filter_name`:
//! `kvroute` routes requests, `kvroute-replica` is the replica listener's.
//! Hooks for features kvroute does not use (per-filter callouts and
//! streams, watermarks, per-route config) exist because Envoy looks them
//! up when it loads the filter; they do nothing.

use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use super::abi::{self, EnvoyBuffer, EnvoyHeader, FilterConfigEnvoy, FilterEnvoy};
use super::config::FilterConfig;
use super::filter::{
    NativeStream, NativeWorker, EVENT_ANSWER, EVENT_DECISIONS, EVENT_RESUME, EVENT_SERVICE_TICK,
    EVENT_TICK,
};
use super::logging;
use super::replica::{ReplicaConfig, ReplicaWorker, REPLICA_FILTER_NAME};
use super::workers::{WorkerSlot, WorkerState};
use crate::gateway::filter::{RequestFilter, Worker};
use crate::gateway::host::Action;

/// The ABI version this module was written against (Envoy 1.40's; a
/// mismatch only makes Envoy log a warning).
static ABI_VERSION: &[u8] = b"v0.2.0\0";

/// The routing filter's `filter_name`.
const ROUTING_FILTER_NAME: &[u8] = b"kvroute";

/// Runs a hook's body; a panic is logged and answered with `fallback`.
fn guard<T>(hook: &str, fallback: T, body: impl FnOnce() -> Option<T>) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Some(value)) => value,
        Ok(None) => fallback,
        Err(payload) => {
            logging::panicked(hook, payload.as_ref());
            fallback
        }
    }
}

/// The filter config behind Envoy's module pointer.
enum ModuleConfig {
    Routing(Arc<FilterConfig>),
    Replica(Arc<ReplicaConfig>),
}

/// One request's filter, as the module pointer Envoy hands back.
// Boxed once per stream already (the module pointer), so the routing
// variant's size costs nothing a second box would save.
#[allow(clippy::large_enum_variant)]
enum Filter {
    Routing(RoutingFilter),
    Replica(ReplicaCall),
}

/// A request on a routing listener.
struct RoutingFilter {
    config: Arc<FilterConfig>,
    worker: usize,
    id: u32,
    state: RequestFilter,
    /// The stream-end work has run.
    ended: bool,
}

/// A call on the replica listener.
struct ReplicaCall {
    config: Arc<ReplicaConfig>,
    worker: usize,
    id: u32,
}

/// # Safety
/// `ptr` must be null or a pointer returned by the config hook and not yet
/// destroyed.
unsafe fn config_of<'a>(ptr: *const c_void) -> Option<&'a ModuleConfig> {
    (ptr as *const ModuleConfig).as_ref()
}

/// The routing filter's config behind Envoy's module pointer (`None` for
/// the replica listener's).
///
/// # Safety
/// As [`config_of`].
unsafe fn routing_config<'a>(ptr: *const c_void) -> Option<&'a FilterConfig> {
    match config_of(ptr)? {
        ModuleConfig::Routing(config) => Some(config),
        ModuleConfig::Replica(_) => None,
    }
}

/// # Safety
/// `ptr` must be null or a pointer returned by [`on_http_filter_new`] and
/// not yet destroyed; Envoy calls a filter's hooks one at a time.
unsafe fn filter_of<'a>(ptr: *const c_void) -> Option<&'a mut Filter> {
    (ptr as *mut Filter).as_mut()
}

/// The routing filter behind Envoy's module pointer (`None` for a replica
/// call, whose request is answered at its headers).
///
/// # Safety
/// As [`filter_of`].
unsafe fn routing_filter<'a>(ptr: *const c_void) -> Option<&'a mut RoutingFilter> {
    match filter_of(ptr)? {
        Filter::Routing(filter) => Some(filter),
        Filter::Replica(_) => None,
    }
}

/// Runs `callback` with the worker of `slot` and the current request of
/// `envoy`, records whether the worker wants its tick, then sends the local
/// reply the callback left, once the worker is released.
fn run<W: WorkerState>(
    slot: &WorkerSlot<W>,
    envoy: FilterEnvoy,
    in_body_hook: bool,
    callback: impl FnOnce(&mut W, &mut NativeStream<'_>) -> Action,
) -> Action {
    let (action, reply) = {
        let mut worker = slot.lock();
        let mut stream = NativeStream::current(envoy, in_body_hook);
        let action = callback(&mut worker, &mut stream);
        slot.note_work(&worker);
        (action, stream.take_reply())
    };
    if let Some(reply) = reply {
        reply.send(envoy);
    }
    action
}

impl RoutingFilter {
    fn slot(&self) -> Option<&WorkerSlot<Worker<NativeWorker>>> {
        self.config.workers.slot(self.worker)
    }

    /// Runs `callback` with this request's state, worker and stream.
    fn run(
        &mut self,
        envoy: FilterEnvoy,
        in_body_hook: bool,
        callback: impl FnOnce(
            &mut RequestFilter,
            &mut Worker<NativeWorker>,
            &mut NativeStream<'_>,
        ) -> Action,
    ) -> Option<Action> {
        if envoy.is_null() {
            return None;
        }
        let slot = self.config.workers.slot(self.worker)?;
        let state = &mut self.state;
        Some(run(slot, envoy, in_body_hook, |worker, stream| {
            callback(state, worker, stream)
        }))
    }

    /// The stream's end: the core's stream-end work, once.
    fn end(&mut self, envoy: FilterEnvoy) {
        if !std::mem::replace(&mut self.ended, true) {
            self.run(envoy, false, |state, worker, _| {
                state.on_stream_end(worker);
                Action::Continue
            });
        }
    }
}

impl ReplicaCall {
    fn slot(&self) -> Option<&WorkerSlot<ReplicaWorker>> {
        self.config.workers.slot(self.worker)
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    guard("program_init", std::ptr::null(), || {
        logging::install();
        Some(ABI_VERSION.as_ptr() as *const c_char)
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    envoy: FilterConfigEnvoy,
    name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    guard("http_filter_config_new", std::ptr::null(), || {
        if envoy.is_null() {
            return None;
        }
        // SAFETY: Envoy's buffers for this call.
        let (name, bytes) = unsafe { (name.bytes(), config.bytes()) };
        let bytes = bytes.unwrap_or_default();
        let config = match name.unwrap_or_default() {
            ROUTING_FILTER_NAME => {
                ModuleConfig::Routing(Arc::new(FilterConfig::new(envoy, bytes)?))
            }
            REPLICA_FILTER_NAME => {
                // SAFETY: on the main thread, during the config's creation.
                let concurrency = unsafe { abi::envoy_dynamic_module_callback_get_concurrency() };
                ModuleConfig::Replica(Arc::new(ReplicaConfig::new(concurrency, bytes)?))
            }
            other => {
                log::error!(
                    "kvroute: unknown filter_name {:?}: `kvroute` routes requests, `kvroute-replica` serves the replica listener",
                    String::from_utf8_lossy(other)
                );
                return None;
            }
        };
        Some(Box::into_raw(Box::new(config)) as *const c_void)
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *const c_void) {
    guard("http_filter_config_destroy", (), || {
        if config.is_null() {
            return None;
        }
        // SAFETY: the pointer `config_new` made; Envoy destroys it once.
        // Live filters keep their own count of what it points to.
        let config = unsafe { Box::from_raw(config as *mut ModuleConfig) };
        match *config {
            ModuleConfig::Routing(config) => config.shut_down(),
            ModuleConfig::Replica(config) => config.shut_down(),
        }
        Some(())
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: *const c_void,
    envoy: FilterEnvoy,
) -> *const c_void {
    guard("http_filter_new", std::ptr::null(), || {
        if envoy.is_null() {
            return None;
        }
        // SAFETY: a live config (Envoy keeps it while it creates filters).
        let config = unsafe { config_of(config) }?;
        // SAFETY: the live stream being created.
        let worker =
            unsafe { abi::envoy_dynamic_module_callback_http_filter_get_worker_index(envoy) }
                as usize;
        let filter = match config {
            ModuleConfig::Routing(config) => {
                let id = config.workers.attach(worker, envoy)?;
                Filter::Routing(RoutingFilter {
                    config: config.clone(),
                    worker,
                    id,
                    state: RequestFilter::new(id),
                    ended: false,
                })
            }
            ModuleConfig::Replica(config) => {
                let id = config.workers.attach(worker, envoy)?;
                Filter::Replica(ReplicaCall {
                    config: config.clone(),
                    worker,
                    id,
                })
            }
        };
        Some(Box::into_raw(Box::new(filter)) as *const c_void)
    })
}

fn request_status(action: Option<Action>, paused: u32, continued: u32) -> u32 {
    match action {
        Some(Action::Pause) => paused,
        _ => continued,
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy: FilterEnvoy,
    filter: *const c_void,
    end_of_stream: bool,
) -> u32 {
    guard("http_filter_request_headers", abi::HEADERS_CONTINUE, || {
        // SAFETY: Envoy's pointer for this live filter.
        let action = match unsafe { filter_of(filter) }? {
            Filter::Routing(filter) => filter.run(envoy, false, |state, worker, stream| {
                state.on_request_headers(worker, stream, end_of_stream)
            }),
            Filter::Replica(call) => {
                let id = call.id;
                let slot = call.slot().filter(|_| !envoy.is_null())?;
                Some(run(slot, envoy, false, |server, stream| {
                    server.on_request_headers(id, stream)
                }))
            }
        };
        Some(request_status(
            action,
            abi::HEADERS_STOP_ITERATION,
            abi::HEADERS_CONTINUE,
        ))
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy: FilterEnvoy,
    filter: *const c_void,
    end_of_stream: bool,
) -> u32 {
    guard("http_filter_request_body", abi::BODY_CONTINUE, || {
        // SAFETY: Envoy's pointer for this live filter.
        let action =
            unsafe { routing_filter(filter) }?.run(envoy, true, |state, worker, stream| {
                state.on_request_body(worker, stream, usize::MAX, end_of_stream)
            });
        Some(request_status(
            action,
            abi::BODY_STOP_ITERATION_AND_BUFFER,
            abi::BODY_CONTINUE,
        ))
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    envoy: FilterEnvoy,
    filter: *const c_void,
) -> u32 {
    guard(
        "http_filter_request_trailers",
        abi::TRAILERS_CONTINUE,
        || {
            // SAFETY: Envoy's pointer for this live filter.
            let action =
                unsafe { routing_filter(filter) }?.run(envoy, false, |state, worker, stream| {
                    state.on_request_trailers(worker, stream)
                });
            Some(request_status(
                action,
                abi::TRAILERS_STOP_ITERATION,
                abi::TRAILERS_CONTINUE,
            ))
        },
    )
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy: FilterEnvoy,
    filter: *const c_void,
    _end_of_stream: bool,
) -> u32 {
    guard(
        "http_filter_response_headers",
        abi::HEADERS_CONTINUE,
        || {
            // SAFETY: Envoy's pointer for this live filter.
            unsafe { routing_filter(filter) }?.run(envoy, false, |state, worker, stream| {
                state.on_response_headers(worker, stream)
            });
            Some(abi::HEADERS_CONTINUE)
        },
    )
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    envoy: FilterEnvoy,
    filter: *const c_void,
    _end_of_stream: bool,
) -> u32 {
    guard("http_filter_response_body", abi::BODY_CONTINUE, || {
        // SAFETY: Envoy's pointer for this live filter.
        let filter = unsafe { routing_filter(filter) }?;
        // Most chunks of a streamed answer need nothing: no worker is taken
        // for them.
        if !filter.state.wants_response_body() {
            return Some(abi::BODY_CONTINUE);
        }
        // Continue keeps the response streaming: nothing is buffered.
        filter.run(envoy, true, |state, worker, stream| {
            state.on_response_body(worker, stream, usize::MAX)
        });
        Some(abi::BODY_CONTINUE)
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _envoy: FilterEnvoy,
    _filter: *const c_void,
) -> u32 {
    abi::TRAILERS_CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    envoy: FilterEnvoy,
    filter: *const c_void,
) {
    guard("http_filter_stream_complete", (), || {
        // SAFETY: Envoy's pointer for this live filter.
        match unsafe { filter_of(filter) }? {
            Filter::Routing(filter) => filter.end(envoy),
            Filter::Replica(call) => call.slot()?.lock().on_stream_end(call.id),
        }
        Some(())
    });
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(filter: *const c_void) {
    guard("http_filter_destroy", (), || {
        if filter.is_null() {
            return None;
        }
        // SAFETY: the pointer `filter_new` made; Envoy destroys it once.
        let filter = unsafe { Box::from_raw(filter as *mut Filter) };
        match *filter {
            Filter::Routing(filter) => {
                let RoutingFilter {
                    config,
                    worker,
                    id,
                    mut state,
                    ended,
                } = filter;
                config.workers.slot(worker)?.detach(id, |worker| {
                    // Envoy ended the stream without its completion hook:
                    // the same cleanup, without its pointer (no host call
                    // needed).
                    if !ended {
                        state.on_stream_end(worker);
                    }
                });
            }
            Filter::Replica(call) => {
                call.slot()?
                    .detach(call.id, |server| server.on_stream_end(call.id));
            }
        }
        Some(())
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    envoy: FilterEnvoy,
    filter: *const c_void,
    event: u64,
) {
    guard("http_filter_scheduled", (), || {
        if envoy.is_null() {
            return None;
        }
        // SAFETY: Envoy's pointer for this live filter.
        match (unsafe { filter_of(filter) }?, event) {
            (Filter::Routing(filter), EVENT_TICK) => {
                filter.run(envoy, false, |_, worker, _| {
                    worker.on_tick();
                    Action::Continue
                });
            }
            // SAFETY: the live stream of this hook; no worker is held.
            (Filter::Routing(_), EVENT_RESUME) => unsafe {
                abi::envoy_dynamic_module_callback_http_filter_continue_decoding(envoy)
            },
            (Filter::Routing(filter), EVENT_ANSWER) => filter.slot()?.answer(filter.id, envoy),
            (Filter::Replica(call), EVENT_TICK) => {
                run(call.slot()?, envoy, false, |server, _| {
                    server.on_tick();
                    Action::Continue
                });
            }
            (Filter::Replica(call), EVENT_ANSWER) => call.slot()?.answer(call.id, envoy),
            _ => {}
        }
        Some(())
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _envoy: FilterConfigEnvoy,
    config: *const c_void,
    event: u64,
) {
    guard("http_filter_config_scheduled", (), || {
        // SAFETY: a live config (the hook runs on Envoy's main thread).
        let config = unsafe { routing_config(config) }?;
        match event {
            EVENT_SERVICE_TICK => {
                // The decisions the workers left for the tick first.
                let batches = config.shared.decisions.take();
                let mut service = config.service();
                if !batches.is_empty() {
                    service.on_decisions(batches);
                }
                service.on_tick();
            }
            EVENT_DECISIONS => {
                let batches = config.shared.decisions.take();
                config.service().on_decisions(batches);
            }
            _ => {}
        }
        Some(())
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _envoy: FilterConfigEnvoy,
    config: *const c_void,
    callout_id: u64,
    result: u32,
    headers: *const EnvoyHeader,
    headers_size: usize,
    body_chunks: *const EnvoyBuffer,
    body_chunks_size: usize,
) {
    guard("http_filter_config_http_callout_done", (), || {
        // SAFETY: a live config; Envoy's arrays for this call, of the
        // sizes it gives, when not null.
        let config = unsafe { routing_config(config) }?;
        let headers: &[EnvoyHeader] = if headers.is_null() {
            &[]
        } else {
            unsafe { std::slice::from_raw_parts(headers, headers_size) }
        };
        let chunks: &[EnvoyBuffer] = if body_chunks.is_null() {
            &[]
        } else {
            unsafe { std::slice::from_raw_parts(body_chunks, body_chunks_size) }
        };
        let chunks: Vec<&[u8]> = chunks
            .iter()
            .filter_map(|chunk| unsafe { chunk.bytes() })
            .collect();
        let status = (result == abi::CALLOUT_SUCCESS)
            .then(|| {
                headers.iter().find_map(|header| {
                    let key = unsafe {
                        EnvoyBuffer {
                            ptr: header.key_ptr,
                            length: header.key_length,
                        }
                        .bytes()
                    }?;
                    let value = unsafe {
                        EnvoyBuffer {
                            ptr: header.value_ptr,
                            length: header.value_length,
                        }
                        .bytes()
                    }?;
                    (key == b":status").then(|| String::from_utf8_lossy(value).into_owned())
                })
            })
            .flatten();
        let body_size = chunks.iter().map(|c| c.len()).sum();
        let read_body = |max: usize| {
            let mut body = Vec::with_capacity(max.min(body_size));
            for chunk in &chunks {
                let room = max.saturating_sub(body.len());
                body.extend_from_slice(chunk.get(..room).unwrap_or(chunk));
            }
            body
        };
        config
            .service()
            .on_call_response(callout_id, status.as_deref(), body_size, read_body);
        Some(())
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_local_reply(
    _envoy: FilterEnvoy,
    _filter: *const c_void,
    _response_code: u32,
    _details: EnvoyBuffer,
    _reset_imminent: bool,
) -> u32 {
    // `Continue`: send the local reply.
    0
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new(
    _name: EnvoyBuffer,
    _config: EnvoyBuffer,
) -> *const c_void {
    // kvroute has no per-route configuration: refused.
    std::ptr::null()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_destroy(
    _config: *const c_void,
) {
}

/// Hooks Envoy requires but kvroute does not use: per-filter callouts and
/// streams, config streams, watermarks.
macro_rules! unused_hooks {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {
        $(
            #[no_mangle]
            pub extern "C" fn $name($(_: $ty),*) {}
        )*
    };
}

unused_hooks! {
    envoy_dynamic_module_on_http_filter_http_callout_done(a: FilterEnvoy, b: *const c_void, c: u64, d: u32, e: *const EnvoyHeader, f: usize, g: *const EnvoyBuffer, h: usize);
    envoy_dynamic_module_on_http_filter_http_stream_headers(a: FilterEnvoy, b: *const c_void, c: u64, d: *const EnvoyHeader, e: usize, f: bool);
    envoy_dynamic_module_on_http_filter_http_stream_data(a: FilterEnvoy, b: *const c_void, c: u64, d: *const EnvoyBuffer, e: usize, f: bool);
    envoy_dynamic_module_on_http_filter_http_stream_trailers(a: FilterEnvoy, b: *const c_void, c: u64, d: *const EnvoyHeader, e: usize);
    envoy_dynamic_module_on_http_filter_http_stream_complete(a: FilterEnvoy, b: *const c_void, c: u64);
    envoy_dynamic_module_on_http_filter_http_stream_reset(a: FilterEnvoy, b: *const c_void, c: u64, d: u32);
    envoy_dynamic_module_on_http_filter_config_http_stream_headers(a: FilterConfigEnvoy, b: *const c_void, c: u64, d: *const EnvoyHeader, e: usize, f: bool);
    envoy_dynamic_module_on_http_filter_config_http_stream_data(a: FilterConfigEnvoy, b: *const c_void, c: u64, d: *const EnvoyBuffer, e: usize, f: bool);
    envoy_dynamic_module_on_http_filter_config_http_stream_trailers(a: FilterConfigEnvoy, b: *const c_void, c: u64, d: *const EnvoyHeader, e: usize);
    envoy_dynamic_module_on_http_filter_config_http_stream_complete(a: FilterConfigEnvoy, b: *const c_void, c: u64);
    envoy_dynamic_module_on_http_filter_config_http_stream_reset(a: FilterConfigEnvoy, b: *const c_void, c: u64, d: u32);
    envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(a: FilterEnvoy, b: *const c_void);
    envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(a: FilterEnvoy, b: *const c_void);
}
