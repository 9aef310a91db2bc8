//! Host calls that hand every status back instead of panicking.
//!
//! The SDK's `hostcalls` panic on any status they do not expect (0.2.5:
//! `unexpected status: 2` from `get_http_call_response_header` after a
//! failed pull), and a panic aborts the VM: Envoy never reloads the
//! singleton service, so one hostile pod froze routing. This module
//! declares the ABI imports kvroute uses and returns `Result<_, Status>`
//! for every status, so the glue decides what a failure means.
//!
//! Reasoned exception: HTTP calls still go through
//! `proxy_wasm::hostcalls::dispatch_http_call`, because the SDK's
//! dispatcher must register the call's token to route its response back to
//! this root context. Envoy's `httpCall` answers only Ok, BadArgument
//! (unknown cluster, bad headers) or InternalFailure, all of which that
//! function returns as errors.
//!
//! Memory returned by the host is allocated through the SDK's exported
//! `proxy_on_memory_allocate`, so it is owned by this VM's allocator and
//! taken over with `Vec::from_raw_parts`, as the SDK does.

use std::fmt;
use std::ptr::{null, null_mut};

/// A proxy-wasm status other than Ok.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status(pub u32);

impl Status {
    pub const CAS_MISMATCH: Status = Status(8);
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.0 {
            1 => "NotFound",
            2 => "BadArgument",
            3 => "SerializationFailure",
            4 => "ParseFailure",
            6 => "InvalidMemoryAccess",
            7 => "Empty",
            8 => "CasMismatch",
            10 => "InternalFailure",
            12 => "Unimplemented",
            _ => "status",
        };
        write!(f, "{name} ({})", self.0)
    }
}

pub type HostResult<T> = Result<T, Status>;

/// Header maps (proxy-wasm `MapType`).
#[derive(Debug, Clone, Copy)]
#[repr(u32)]
pub enum HeaderMap {
    Request = 0,
    Response = 2,
    CallResponse = 6,
}

/// Buffers (proxy-wasm `BufferType`).
#[derive(Debug, Clone, Copy)]
#[repr(u32)]
pub enum Buffer {
    RequestBody = 0,
    ResponseBody = 1,
    CallResponseBody = 4,
    PluginConfiguration = 7,
}

/// Metric kinds (proxy-wasm `MetricType`).
#[derive(Debug, Clone, Copy)]
#[repr(u32)]
pub enum MetricKind {
    Counter = 0,
    Gauge = 1,
    Histogram = 2,
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: u32, message: *const u8, size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_get_buffer_bytes(
        kind: u32,
        start: usize,
        max_size: usize,
        data: *mut *mut u8,
        size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(map: u32, data: *mut *mut u8, size: *mut usize) -> u32;
    fn proxy_get_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        data: *mut *mut u8,
        size: *mut usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map: u32, key: *const u8, key_size: usize) -> u32;
    fn proxy_get_property(
        path: *const u8,
        path_size: usize,
        data: *mut *mut u8,
        size: *mut usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key: *const u8,
        key_size: usize,
        data: *mut *mut u8,
        size: *mut usize,
        cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_register_shared_queue(name: *const u8, name_size: usize, id: *mut u32) -> u32;
    fn proxy_resolve_shared_queue(
        vm_id: *const u8,
        vm_id_size: usize,
        name: *const u8,
        name_size: usize,
        id: *mut u32,
    ) -> u32;
    fn proxy_dequeue_shared_queue(queue: u32, data: *mut *mut u8, size: *mut usize) -> u32;
    fn proxy_enqueue_shared_queue(queue: u32, value: *const u8, size: usize) -> u32;
    #[allow(clippy::too_many_arguments)]
    fn proxy_send_local_response(
        status: u32,
        details: *const u8,
        details_size: usize,
        body: *const u8,
        body_size: usize,
        headers: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_define_metric(kind: u32, name: *const u8, name_size: usize, id: *mut u32) -> u32;
    fn proxy_increment_metric(id: u32, offset: i64) -> u32;
    fn proxy_record_metric(id: u32, value: u64) -> u32;
}

fn check(status: u32) -> HostResult<()> {
    match status {
        0 => Ok(()),
        other => Err(Status(other)),
    }
}

/// Takes ownership of a host-allocated buffer (null: none).
///
/// # Safety
/// `data`/`size` must come from a successful host call.
unsafe fn owned(data: *mut u8, size: usize) -> Option<Vec<u8>> {
    (!data.is_null()).then(|| Vec::from_raw_parts(data, size, size))
}

/// Runs a host call that returns a buffer; NotFound reads as `None`.
fn bytes_from(call: impl FnOnce(*mut *mut u8, *mut usize) -> u32) -> HostResult<Option<Vec<u8>>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    match call(&mut data, &mut size) {
        0 => Ok(unsafe { owned(data, size) }),
        1 => Ok(None),
        other => Err(Status(other)),
    }
}

pub fn log(level: u32, message: &str) {
    // Nowhere to report a failed log call.
    let _ = unsafe { proxy_log(level, message.as_ptr(), message.len()) };
}

/// Wall-clock time in milliseconds since the Unix epoch (0 if the host
/// refuses, which only makes decay look older).
pub fn now_ms() -> u64 {
    let mut nanos: u64 = 0;
    match unsafe { proxy_get_current_time_nanoseconds(&mut nanos) } {
        0 => nanos / 1_000_000,
        _ => 0,
    }
}

pub fn set_tick_period_ms(period: u64) -> HostResult<()> {
    let period = u32::try_from(period).unwrap_or(u32::MAX);
    check(unsafe { proxy_set_tick_period_milliseconds(period) })
}

/// Makes `context_id` the context of the following host calls until the
/// current callback returns (header and reply calls then act on that
/// request). BadArgument: no such context (the request is gone).
pub fn set_effective_context(context_id: u32) -> HostResult<()> {
    check(unsafe { proxy_set_effective_context(context_id) })
}

/// Resumes the paused request of the effective context (proxy-wasm
/// `StreamType::HttpRequest` = 0); Envoy runs it after the current callback.
pub fn continue_request() -> HostResult<()> {
    check(unsafe { proxy_continue_stream(0) })
}

pub fn buffer(kind: Buffer, start: usize, max_size: usize) -> HostResult<Option<Vec<u8>>> {
    bytes_from(|data, size| unsafe {
        proxy_get_buffer_bytes(kind as u32, start, max_size, data, size)
    })
}

pub fn header(map: HeaderMap, name: &str) -> HostResult<Option<Vec<u8>>> {
    bytes_from(|data, size| unsafe {
        proxy_get_header_map_value(map as u32, name.as_ptr(), name.len(), data, size)
    })
}

/// Every header of `map` in one host call (instead of one per header),
/// names as Envoy keeps them (lower case).
pub fn headers(map: HeaderMap) -> HostResult<Headers> {
    let bytes =
        bytes_from(|data, size| unsafe { proxy_get_header_map_pairs(map as u32, data, size) })?;
    Ok(Headers::decode(&bytes.unwrap_or_default()))
}

/// A header map as the ABI serialises it: a u32 count, then each pair's
/// name and value lengths (u32 each), then each name and value, each
/// followed by a NUL; all little-endian. A truncated map keeps the pairs
/// before the cut.
#[derive(Debug, Default)]
pub struct Headers(Vec<(String, Vec<u8>)>);

impl Headers {
    fn decode(bytes: &[u8]) -> Headers {
        let u32_at = |at: usize| {
            bytes
                .get(at..at + 4)
                .and_then(|b| <[u8; 4]>::try_from(b).ok())
                .map(|b| u32::from_le_bytes(b) as usize)
        };
        let count = u32_at(0).unwrap_or(0);
        let mut pairs = Vec::new();
        let mut data = 4usize.saturating_add(count.saturating_mul(8));
        for i in 0..count {
            let (Some(name_len), Some(value_len)) = (u32_at(4 + 8 * i), u32_at(8 + 8 * i)) else {
                break;
            };
            let name_end = data.saturating_add(name_len);
            let value_start = name_end.saturating_add(1);
            let value_end = value_start.saturating_add(value_len);
            let (Some(name), Some(value)) =
                (bytes.get(data..name_end), bytes.get(value_start..value_end))
            else {
                break;
            };
            pairs.push((String::from_utf8_lossy(name).into_owned(), value.to_vec()));
            data = value_end.saturating_add(1);
        }
        Headers(pairs)
    }

    /// A header's value (`None`: absent).
    pub fn get(&self, name: &str) -> Option<Vec<u8>> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }
}

/// A header as text (lossy); absent, failed or not UTF-8 reads as "".
pub fn header_text(map: HeaderMap, name: &str) -> String {
    match header(map, name) {
        Ok(Some(bytes)) => String::from_utf8(bytes).unwrap_or_default(),
        _ => String::new(),
    }
}

pub fn set_header(map: HeaderMap, name: &str, value: &str) -> HostResult<()> {
    check(unsafe {
        proxy_replace_header_map_value(
            map as u32,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        )
    })
}

pub fn remove_header(map: HeaderMap, name: &str) -> HostResult<()> {
    check(unsafe { proxy_remove_header_map_value(map as u32, name.as_ptr(), name.len()) })
}

/// A property by path segments (`["plugin_root_id"]`).
pub fn property(path: &[&str]) -> Option<Vec<u8>> {
    let serialized = path.join("\0");
    bytes_from(|data, size| unsafe {
        proxy_get_property(serialized.as_ptr(), serialized.len(), data, size)
    })
    .ok()
    .flatten()
}

/// An unsigned integer property (`["upstream", "request_attempt_count"]`),
/// which Envoy serialises as 8 bytes, little-endian.
pub fn property_u64(path: &[&str]) -> Option<u64> {
    let bytes: [u8; 8] = property(path)?.try_into().ok()?;
    Some(u64::from_le_bytes(bytes))
}

/// A shared-data value and its CAS token (`None`, 0 when absent).
pub fn shared_get(key: &str) -> HostResult<(Option<Vec<u8>>, u32)> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    let mut cas: u32 = 0;
    match unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) }
    {
        0 => Ok((unsafe { owned(data, size) }, cas)),
        1 => Ok((None, 0)),
        other => Err(Status(other)),
    }
}

/// Writes a shared-data value; `cas` 0 writes unconditionally.
pub fn shared_set(key: &str, value: &[u8], cas: u32) -> HostResult<()> {
    check(unsafe {
        proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas)
    })
}

pub fn register_queue(name: &str) -> HostResult<u32> {
    let mut id = 0;
    check(unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) }).map(|_| id)
}

pub fn resolve_queue(vm_id: &str, name: &str) -> HostResult<u32> {
    let mut id = 0;
    check(unsafe {
        proxy_resolve_shared_queue(
            vm_id.as_ptr(),
            vm_id.len(),
            name.as_ptr(),
            name.len(),
            &mut id,
        )
    })
    .map(|_| id)
}

/// The next message, `None` when the queue is empty.
pub fn dequeue(queue: u32) -> HostResult<Option<Vec<u8>>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    match unsafe { proxy_dequeue_shared_queue(queue, &mut data, &mut size) } {
        0 => Ok(unsafe { owned(data, size) }),
        7 => Ok(None),
        other => Err(Status(other)),
    }
}

pub fn enqueue(queue: u32, message: &[u8]) -> HostResult<()> {
    check(unsafe { proxy_enqueue_shared_queue(queue, message.as_ptr(), message.len()) })
}

/// proxy-wasm's header map serialisation: count, (key, value) lengths, then
/// each key and value NUL-terminated.
fn serialize_headers(headers: &[(&str, &str)]) -> Vec<u8> {
    let mut bytes = Vec::new();
    let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
    bytes.extend_from_slice(&len(headers.len()));
    for (name, value) in headers {
        bytes.extend_from_slice(&len(name.len()));
        bytes.extend_from_slice(&len(value.len()));
    }
    for (name, value) in headers {
        for part in [name, value] {
            bytes.extend_from_slice(part.as_bytes());
            bytes.push(0);
        }
    }
    bytes
}

/// Answers the current request locally.
pub fn send_response(status: u32, headers: &[(&str, &str)], body: &[u8]) -> HostResult<()> {
    let headers = serialize_headers(headers);
    check(unsafe {
        proxy_send_local_response(
            status,
            null(),
            0,
            body.as_ptr(),
            body.len(),
            headers.as_ptr(),
            headers.len(),
            -1,
        )
    })
}

pub fn define_metric(kind: MetricKind, name: &str) -> HostResult<u32> {
    let mut id = 0;
    check(unsafe { proxy_define_metric(kind as u32, name.as_ptr(), name.len(), &mut id) })
        .map(|_| id)
}

pub fn increment_metric(id: u32, offset: i64) -> HostResult<()> {
    check(unsafe { proxy_increment_metric(id, offset) })
}

pub fn record_metric(id: u32, value: u64) -> HostResult<()> {
    check(unsafe { proxy_record_metric(id, value) })
}
