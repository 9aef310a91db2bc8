//! The event hooks Envoy calls (`envoy_dynamic_module_on_*`): each checks
//! its pointers, catches any panic ([`guard`]) and hands the event to the
//! core through [`super::config`] and [`super::filter`]. Hooks for
//! features kvroute does not use (per-filter callouts and streams,
//! watermarks, per-route config) exist because Envoy looks them up when it
//! loads the filter; they do nothing.

use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::abi::{self, EnvoyBuffer, EnvoyHeader, FilterConfigEnvoy, FilterEnvoy};
use super::config::FilterConfig;
use super::filter::{
    FilterHandle, NativeStream, Reply, EVENT_ANSWER, EVENT_DECISIONS, EVENT_RESUME,
    EVENT_SERVICE_TICK, EVENT_TICK,
};
use super::logging;
use crate::gateway::filter::{RequestFilter, Worker};
use crate::gateway::host::Action;

use super::filter::NativeWorker;

/// The ABI version this module was written against (Envoy 1.40's; a
/// mismatch only makes Envoy log a warning).
static ABI_VERSION: &[u8] = b"v0.2.0\0";

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

/// One request's filter, as the module pointer Envoy hands back.
struct Filter {
    config: Arc<FilterConfig>,
    worker: usize,
    id: u32,
    state: RequestFilter,
    /// The stream-end work has run.
    ended: bool,
}

/// The filter config behind Envoy's module pointer.
///
/// # Safety
/// `ptr` must be null or a pointer returned by the config hook and not yet
/// destroyed.
unsafe fn config_of<'a>(ptr: *const c_void) -> Option<&'a FilterConfig> {
    (ptr as *const FilterConfig).as_ref()
}

/// # Safety
/// `ptr` must be null or a pointer returned by [`on_http_filter_new`] and
/// not yet destroyed; Envoy calls a filter's hooks one at a time.
unsafe fn filter_of<'a>(ptr: *const c_void) -> Option<&'a mut Filter> {
    (ptr as *mut Filter).as_mut()
}

impl Filter {
    /// Runs `callback` with this request's worker and stream, then sends
    /// the local reply it left, once the worker is released.
    fn run(
        ptr: *const c_void,
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
        let (action, reply) = {
            // SAFETY: Envoy's pointer for this live filter (see `filter_of`).
            let filter = unsafe { filter_of(ptr) }?;
            let slot = filter.config.slot(filter.worker)?;
            let mut worker = slot.lock();
            let mut stream = NativeStream::current(envoy, in_body_hook);
            let action = callback(&mut filter.state, &mut worker, &mut stream);
            slot.has_work.store(worker.has_work(), Ordering::Release);
            (action, stream.take_reply())
        };
        if let Some(reply) = reply {
            reply.send(envoy);
        }
        Some(action)
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
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    guard("http_filter_config_new", std::ptr::null(), || {
        if envoy.is_null() {
            return None;
        }
        // SAFETY: Envoy's buffer for this call.
        let bytes = unsafe { config.bytes() }.unwrap_or_default();
        let config = FilterConfig::new(envoy, bytes)?;
        Some(Arc::into_raw(Arc::new(config)) as *const c_void)
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *const c_void) {
    guard("http_filter_config_destroy", (), || {
        if config.is_null() {
            return None;
        }
        // SAFETY: the pointer `config_new` made; Envoy destroys it once.
        let config = unsafe { Arc::from_raw(config as *const FilterConfig) };
        config.shut_down();
        Some(())
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: *const c_void,
    envoy: FilterEnvoy,
) -> *const c_void {
    guard("http_filter_new", std::ptr::null(), || {
        if config.is_null() || envoy.is_null() {
            return None;
        }
        // SAFETY: a live config (Envoy keeps it while its filters live);
        // the filter holds its own count of it.
        let config = unsafe {
            Arc::increment_strong_count(config as *const FilterConfig);
            Arc::from_raw(config as *const FilterConfig)
        };
        // SAFETY: the live stream being created.
        let worker =
            unsafe { abi::envoy_dynamic_module_callback_http_filter_get_worker_index(envoy) }
                as usize;
        let id = config.next_id();
        let slot = config.slot(worker)?;
        let needs_ticker = slot.ticker().is_none();
        let scheduler = {
            let mut worker = slot.lock();
            let mut handle = FilterHandle::new(envoy);
            let scheduler = needs_ticker.then(|| handle.scheduler() as usize);
            worker.host.filters.insert(id, handle);
            scheduler
        };
        if let Some(scheduler) = scheduler.filter(|s| *s != 0) {
            slot.ticker().get_or_insert((id, scheduler));
        }
        let filter = Filter {
            config,
            worker,
            id,
            state: RequestFilter::new(id),
            ended: false,
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
        let action = Filter::run(filter, envoy, false, |state, worker, stream| {
            state.on_request_headers(worker, stream, end_of_stream)
        });
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
        let action = Filter::run(filter, envoy, true, |state, worker, stream| {
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
            let action = Filter::run(filter, envoy, false, |state, worker, stream| {
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
            Filter::run(filter, envoy, false, |state, worker, stream| {
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
        // Most chunks of a streamed answer need nothing: no worker is taken
        // for them (SAFETY: Envoy's pointer for this live filter).
        if !unsafe { filter_of(filter) }?.state.wants_response_body() {
            return Some(abi::BODY_CONTINUE);
        }
        // Continue keeps the response streaming: nothing is buffered.
        Filter::run(filter, envoy, true, |state, worker, stream| {
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

/// The stream's end: the core's stream-end work, once.
fn end_stream(ptr: *const c_void, envoy: FilterEnvoy) -> Option<()> {
    // SAFETY: Envoy's pointer for this live filter.
    let ended = unsafe { filter_of(ptr) }.map(|f| std::mem::replace(&mut f.ended, true))?;
    if !ended {
        Filter::run(ptr, envoy, false, |state, worker, _| {
            state.on_stream_end(worker);
            Action::Continue
        });
    }
    Some(())
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    envoy: FilterEnvoy,
    filter: *const c_void,
) {
    guard("http_filter_stream_complete", (), || {
        end_stream(filter, envoy)
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
        let slot = filter.config.slot(filter.worker)?;
        let was_ticker = slot.ticker().is_some_and(|(id, _)| id == filter.id);
        let (own, successor) = {
            let mut worker = slot.lock();
            if !filter.ended {
                // Envoy ended the stream without its completion hook: the
                // same cleanup, without its pointer (no host call needed).
                let mut state = filter.state;
                state.on_stream_end(&mut worker);
            }
            let own = worker
                .host
                .filters
                .remove(&filter.id)
                .and_then(|mut handle| handle.take_scheduler());
            let successor = was_ticker
                .then(|| {
                    let (id, handle) = worker.host.filters.iter_mut().next()?;
                    Some((*id, handle.scheduler() as usize)).filter(|(_, s)| *s != 0)
                })
                .flatten();
            slot.has_work.store(worker.has_work(), Ordering::Release);
            (own, successor)
        };
        if was_ticker {
            *slot.ticker() = successor;
        }
        if let Some(scheduler) = own {
            // SAFETY: its filter is being destroyed and the ticker no
            // longer names it.
            unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler) };
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
        match event {
            EVENT_TICK => {
                Filter::run(filter, envoy, false, |_, worker, _| {
                    worker.on_tick();
                    Action::Continue
                })?;
            }
            // SAFETY: the live stream of this hook; no worker is held.
            EVENT_RESUME => unsafe {
                abi::envoy_dynamic_module_callback_http_filter_continue_decoding(envoy)
            },
            EVENT_ANSWER => {
                let reply: Option<Reply> = {
                    // SAFETY: Envoy's pointer for this live filter.
                    let filter = unsafe { filter_of(filter) }?;
                    let slot = filter.config.slot(filter.worker)?;
                    let mut worker = slot.lock();
                    worker
                        .host
                        .filters
                        .get_mut(&filter.id)
                        .and_then(FilterHandle::take_reply)
                };
                if let Some(reply) = reply {
                    reply.send(envoy);
                }
            }
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
        let config = unsafe { config_of(config) }?;
        match event {
            EVENT_SERVICE_TICK => config.service().on_tick(),
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
        let config = unsafe { config_of(config) }?;
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
