//! kvroute's own FFI over Envoy's dynamic-module ABI
//! (`source/extensions/dynamic_modules/abi/abi.h` of envoyproxy/envoy):
//! only the types and callbacks kvroute uses. The hooks Envoy calls are in
//! [`super::hooks`].
//!
//! Checked against Envoy 1.40.0 (the PyPI build, 9e5580933739): every
//! callback below is exported by the binary (`nm -D envoy`; the test
//! `integration/tests/native.rs` asserts the module imports nothing else
//! from Envoy), every hook kvroute exports is one Envoy looks up (`strings
//! envoy | grep envoy_dynamic_module_on_`). The signatures are the header's;
//! from 1.38 on, a symbol's signature does not change once released (a
//! module built for 1.X loads on 1.(X+1)). A buffer passed by value (`{ptr,
//! length}`) is two registers, as a `(ptr, length)` pair is, in the x86-64
//! and AArch64 C ABIs. C enums are `int`: `u32` here.
//!
//! Nothing here is called with a pointer that did not come from Envoy for
//! the same object, or from this module's own live data; the callers in
//! [`super`] check every pointer and length Envoy hands back.

#![allow(non_camel_case_types)]

use std::ffi::c_void;

/// `envoy_dynamic_module_type_envoy_buffer`: memory Envoy owns.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl EnvoyBuffer {
    pub const EMPTY: EnvoyBuffer = EnvoyBuffer {
        ptr: std::ptr::null(),
        length: 0,
    };

    /// The bytes, if the pointer is set (a null buffer reads as none).
    ///
    /// # Safety
    /// Envoy guarantees the memory for the current hook; the slice must
    /// not outlive it.
    pub unsafe fn bytes<'a>(self) -> Option<&'a [u8]> {
        (!self.ptr.is_null()).then(|| std::slice::from_raw_parts(self.ptr, self.length))
    }
}

/// `envoy_dynamic_module_type_module_buffer`: memory this module owns,
/// valid for the call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ModuleBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl ModuleBuffer {
    pub fn of(bytes: &[u8]) -> ModuleBuffer {
        ModuleBuffer {
            ptr: bytes.as_ptr(),
            length: bytes.len(),
        }
    }
}

/// `envoy_dynamic_module_type_module_http_header`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ModuleHeader {
    pub key_ptr: *const u8,
    pub key_length: usize,
    pub value_ptr: *const u8,
    pub value_length: usize,
}

impl ModuleHeader {
    pub fn of(key: &str, value: &str) -> ModuleHeader {
        ModuleHeader {
            key_ptr: key.as_ptr(),
            key_length: key.len(),
            value_ptr: value.as_ptr(),
            value_length: value.len(),
        }
    }
}

/// `envoy_dynamic_module_type_envoy_http_header`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EnvoyHeader {
    pub key_ptr: *const u8,
    pub key_length: usize,
    pub value_ptr: *const u8,
    pub value_length: usize,
}

pub type FilterConfigEnvoy = *mut c_void;
pub type FilterEnvoy = *mut c_void;
pub type SchedulerPtr = *mut c_void;

// `envoy_dynamic_module_type_http_header_type`
pub const REQUEST_HEADER: u32 = 0;
pub const RESPONSE_HEADER: u32 = 2;

// `envoy_dynamic_module_type_http_body_type`
pub const RECEIVED_REQUEST_BODY: u32 = 0;
pub const BUFFERED_REQUEST_BODY: u32 = 1;
pub const RECEIVED_RESPONSE_BODY: u32 = 2;

// `envoy_dynamic_module_type_log_level`
pub const LOG_TRACE: u32 = 0;
pub const LOG_DEBUG: u32 = 1;
pub const LOG_INFO: u32 = 2;
pub const LOG_WARN: u32 = 3;
pub const LOG_ERROR: u32 = 4;
pub const LOG_CRITICAL: u32 = 5;

// `envoy_dynamic_module_type_http_callout_init_result`
pub const CALLOUT_INIT_SUCCESS: u32 = 0;
// `envoy_dynamic_module_type_http_callout_result`
pub const CALLOUT_SUCCESS: u32 = 0;

// `envoy_dynamic_module_type_metrics_result`
pub const METRICS_SUCCESS: u32 = 0;

// `envoy_dynamic_module_type_attribute_id`
pub const ATTRIBUTE_RESPONSE_CODE_DETAILS: u32 = 16;
pub const ATTRIBUTE_UPSTREAM_ADDRESS: u32 = 41;
pub const ATTRIBUTE_UPSTREAM_REQUEST_ATTEMPT_COUNT: u32 = 53;

// Filter statuses (`envoy_dynamic_module_type_on_http_filter_*_status`).
pub const HEADERS_CONTINUE: u32 = 0;
pub const HEADERS_STOP_ITERATION: u32 = 1;
pub const BODY_CONTINUE: u32 = 0;
pub const BODY_STOP_ITERATION_AND_BUFFER: u32 = 1;
pub const TRAILERS_CONTINUE: u32 = 0;
pub const TRAILERS_STOP_ITERATION: u32 = 1;

extern "C" {
    pub fn envoy_dynamic_module_callback_log(level: u32, message: ModuleBuffer);
    pub fn envoy_dynamic_module_callback_log_enabled(level: u32) -> bool;
    pub fn envoy_dynamic_module_callback_get_concurrency() -> u32;

    pub fn envoy_dynamic_module_callback_http_filter_get_worker_index(filter: FilterEnvoy) -> u32;
    pub fn envoy_dynamic_module_callback_http_get_header(
        filter: FilterEnvoy,
        header_type: u32,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_set_header(
        filter: FilterEnvoy,
        header_type: u32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter: FilterEnvoy,
        body_type: u32,
    ) -> usize;
    pub fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: FilterEnvoy,
        body_type: u32,
        result: *mut EnvoyBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_received_buffered_request_body(
        filter: FilterEnvoy,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_send_response(
        filter: FilterEnvoy,
        status: u32,
        headers: *mut ModuleHeader,
        headers_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
    pub fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: FilterEnvoy);
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: FilterEnvoy,
        attribute: u32,
        result: *mut EnvoyBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_int(
        filter: FilterEnvoy,
        attribute: u32,
        result: *mut u64,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_new(
        filter: FilterEnvoy,
    ) -> SchedulerPtr;
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_commit(
        scheduler: SchedulerPtr,
        event: u64,
    );
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: SchedulerPtr);

    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
        config: FilterConfigEnvoy,
    ) -> SchedulerPtr;
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler: SchedulerPtr,
        event: u64,
    );
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
        scheduler: SchedulerPtr,
    );
    pub fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config: FilterConfigEnvoy,
        callout_id: *mut u64,
        cluster: ModuleBuffer,
        headers: *mut ModuleHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> u32;

    pub fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: FilterConfigEnvoy,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id: *mut usize,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: FilterConfigEnvoy,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id: *mut usize,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_define_histogram(
        config: FilterConfigEnvoy,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id: *mut usize,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: FilterConfigEnvoy,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_gauge(
        config: FilterConfigEnvoy,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
        config: FilterConfigEnvoy,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        config: FilterConfigEnvoy,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
        config: FilterConfigEnvoy,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
}
