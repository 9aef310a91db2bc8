//! The floor of a body-routing Envoy dynamic module, `kvroute-bench
//! overhead`'s native reference (the native twin of
//! `integration/floor-filter`). It does only what any filter that routes on
//! the request body must do in Envoy 1.40: stop at the request headers,
//! let Envoy buffer the body (`StopIterationAndBuffer`), copy the complete
//! body out of Envoy, set one routing header and continue. It does none of
//! kvroute's work (parsing, hashing, lookups, scoring, in-flight
//! accounting, metrics, logs, response hooks). So Envoy with this module
//! against plain Envoy is the cost no native body-routing filter avoids,
//! and kvroute's native module against this one is kvroute's own.
//!
//! Loaded as `dynamic_module_config.name: kvroute_native_floor` from
//! `ENVOY_DYNAMIC_MODULES_SEARCH_PATH` (`make native-floor`). Its FFI is
//! the handful of ABI symbols it needs, declared as kvroute's
//! `src/native/abi.rs` declares them (Envoy 1.40, ABI v0.2.0); the hooks
//! it does not use exist because Envoy looks them up when it loads an HTTP
//! filter module.

// The hooks are Envoy's to call, with its own pointers, never Rust's.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::{c_char, c_void};

/// `envoy_dynamic_module_type_envoy_buffer` / `…_module_buffer`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Buffer {
    ptr: *const u8,
    length: usize,
}

const EMPTY: Buffer = Buffer {
    ptr: std::ptr::null(),
    length: 0,
};

const REQUEST_HEADER: u32 = 0;
const RECEIVED_REQUEST_BODY: u32 = 0;
const BUFFERED_REQUEST_BODY: u32 = 1;
const CONTINUE: u32 = 0;
const HEADERS_STOP_ITERATION: u32 = 1;
const BODY_STOP_ITERATION_AND_BUFFER: u32 = 1;

extern "C" {
    fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter: *mut c_void,
        body_type: u32,
    ) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: *mut c_void,
        body_type: u32,
        result: *mut Buffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_received_buffered_request_body(
        filter: *mut c_void,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_set_header(
        filter: *mut c_void,
        header_type: u32,
        key: Buffer,
        value: Buffer,
    ) -> bool;
}

/// Not null: Envoy takes null for a refused config or filter. Neither
/// holds any state.
static STATELESS: u8 = 0;

fn stateless() -> *const c_void {
    std::ptr::addr_of!(STATELESS) as *const c_void
}

/// Appends Envoy's body chunks of `body_type` to `into`.
///
/// # Safety
/// `filter` is the live stream of the current hook.
unsafe fn read_chunks(filter: *mut c_void, body_type: u32, into: &mut Vec<u8>) {
    let count = envoy_dynamic_module_callback_http_get_body_chunks_size(filter, body_type);
    if count == 0 {
        return;
    }
    let mut chunks = vec![EMPTY; count];
    if !envoy_dynamic_module_callback_http_get_body_chunks(filter, body_type, chunks.as_mut_ptr()) {
        return;
    }
    for chunk in chunks.iter().filter(|c| !c.ptr.is_null()) {
        into.extend_from_slice(std::slice::from_raw_parts(chunk.ptr, chunk.length));
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    c"v0.2.0".as_ptr()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    _envoy: *mut c_void,
    _name: Buffer,
    _config: Buffer,
) -> *const c_void {
    stateless()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    _config: *const c_void,
    _envoy: *mut c_void,
) -> *const c_void {
    stateless()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    _envoy: *mut c_void,
    _filter: *const c_void,
    end_of_stream: bool,
) -> u32 {
    // Stopping here holds the request until its body is in.
    if end_of_stream {
        CONTINUE
    } else {
        HEADERS_STOP_ITERATION
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy: *mut c_void,
    _filter: *const c_void,
    end_of_stream: bool,
) -> u32 {
    if !end_of_stream {
        // Envoy buffers the body until its end.
        return BODY_STOP_ITERATION_AND_BUFFER;
    }
    if envoy.is_null() {
        return CONTINUE;
    }
    // The complete body: what Envoy buffered, plus this call's chunk
    // unless Envoy handed the buffered body itself (as kvroute reads it).
    let mut body = Vec::new();
    // SAFETY: Envoy's live stream of this hook; the header name and value
    // outlive the call (Envoy copies them).
    unsafe {
        read_chunks(envoy, BUFFERED_REQUEST_BODY, &mut body);
        if !envoy_dynamic_module_callback_http_received_buffered_request_body(envoy) {
            read_chunks(envoy, RECEIVED_REQUEST_BODY, &mut body);
        }
        // A router's one decision header, set before continuing.
        let name = b"x-floor-body-bytes";
        let value = body.len().to_string();
        envoy_dynamic_module_callback_http_set_header(
            envoy,
            REQUEST_HEADER,
            Buffer {
                ptr: name.as_ptr(),
                length: name.len(),
            },
            Buffer {
                ptr: value.as_ptr(),
                length: value.len(),
            },
        );
    }
    CONTINUE
}

/// Hooks that only let the stream go on.
macro_rules! continue_hooks {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {
        $(
            #[no_mangle]
            pub extern "C" fn $name($(_: $ty),*) -> u32 {
                CONTINUE
            }
        )*
    };
}

continue_hooks! {
    envoy_dynamic_module_on_http_filter_request_trailers(a: *mut c_void, b: *const c_void);
    envoy_dynamic_module_on_http_filter_response_headers(a: *mut c_void, b: *const c_void, c: bool);
    envoy_dynamic_module_on_http_filter_response_body(a: *mut c_void, b: *const c_void, c: bool);
    envoy_dynamic_module_on_http_filter_response_trailers(a: *mut c_void, b: *const c_void);
    envoy_dynamic_module_on_http_filter_local_reply(a: *mut c_void, b: *const c_void, c: u32, d: Buffer, e: bool);
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new(
    _name: Buffer,
    _config: Buffer,
) -> *const c_void {
    std::ptr::null()
}

/// Hooks with nothing to do.
macro_rules! empty_hooks {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {
        $(
            #[no_mangle]
            pub extern "C" fn $name($(_: $ty),*) {}
        )*
    };
}

empty_hooks! {
    envoy_dynamic_module_on_http_filter_config_destroy(a: *const c_void);
    envoy_dynamic_module_on_http_filter_per_route_config_destroy(a: *const c_void);
    envoy_dynamic_module_on_http_filter_stream_complete(a: *mut c_void, b: *const c_void);
    envoy_dynamic_module_on_http_filter_destroy(a: *const c_void);
    envoy_dynamic_module_on_http_filter_scheduled(a: *mut c_void, b: *const c_void, c: u64);
    envoy_dynamic_module_on_http_filter_config_scheduled(a: *mut c_void, b: *const c_void, c: u64);
    envoy_dynamic_module_on_http_filter_config_http_callout_done(a: *mut c_void, b: *const c_void, c: u64, d: u32, e: *const c_void, f: usize, g: *const Buffer, h: usize);
    envoy_dynamic_module_on_http_filter_http_callout_done(a: *mut c_void, b: *const c_void, c: u64, d: u32, e: *const c_void, f: usize, g: *const Buffer, h: usize);
    envoy_dynamic_module_on_http_filter_http_stream_headers(a: *mut c_void, b: *const c_void, c: u64, d: *const c_void, e: usize, f: bool);
    envoy_dynamic_module_on_http_filter_http_stream_data(a: *mut c_void, b: *const c_void, c: u64, d: *const Buffer, e: usize, f: bool);
    envoy_dynamic_module_on_http_filter_http_stream_trailers(a: *mut c_void, b: *const c_void, c: u64, d: *const c_void, e: usize);
    envoy_dynamic_module_on_http_filter_http_stream_complete(a: *mut c_void, b: *const c_void, c: u64);
    envoy_dynamic_module_on_http_filter_http_stream_reset(a: *mut c_void, b: *const c_void, c: u64, d: u32);
    envoy_dynamic_module_on_http_filter_config_http_stream_headers(a: *mut c_void, b: *const c_void, c: u64, d: *const c_void, e: usize, f: bool);
    envoy_dynamic_module_on_http_filter_config_http_stream_data(a: *mut c_void, b: *const c_void, c: u64, d: *const Buffer, e: usize, f: bool);
    envoy_dynamic_module_on_http_filter_config_http_stream_trailers(a: *mut c_void, b: *const c_void, c: u64, d: *const c_void, e: usize);
    envoy_dynamic_module_on_http_filter_config_http_stream_complete(a: *mut c_void, b: *const c_void, c: u64);
    envoy_dynamic_module_on_http_filter_config_http_stream_reset(a: *mut c_void, b: *const c_void, c: u64, d: u32);
    envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(a: *mut c_void, b: *const c_void);
    envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(a: *mut c_void, b: *const c_void);
}
