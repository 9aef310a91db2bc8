//! The report service over proxy-wasm: the singleton bootstrap service
//! (`envoy.bootstrap.wasm`, `singleton: true`, main thread) running
//! [`crate::gateway::service`], publishing to Envoy shared data and
//! taking the filters' decisions from a shared queue.
//!
//! Host behaviour: a pull that fails (connection refused, reset mid-body,
//! timeout, a body over the host's buffer limit) still calls
//! `on_http_call_response`, with no response headers. The SDK's header
//! getter panics on the host's status for that (BadArgument); this service
//! reads through [`super::host`], for which it is just "no answer".
//!
//! Shutdown: after its event loop stopped, Envoy ends every call still
//! out (its own 503, or no headers) before it calls the root's `on_done`;
//! the service holds such answers for a tick that never comes
//! ([`crate::gateway::service`]).

use std::time::Duration;

use proxy_wasm::traits::{Context, RootContext};

use super::host::{self, Buffer, HeaderMap};
use super::metrics::WasmMetrics;
use super::{load_config, shared};
use crate::config::Config;
use crate::gateway::host::{HostError, HostResult, ServiceHost};
use crate::gateway::metrics::MetricSink;
use crate::gateway::service::{tick_period_ms, ReportService};
use crate::replica::LogHead;
use crate::snapshot::{bucket_key, InflightCount, PodTable, SlotLoad, DECISION_QUEUE};

/// Answers (body and parse) the heap is grown for up front.
const RESERVED_BODIES: usize = 8;

/// The VM's side of the service: shared data and HTTP calls.
#[derive(Default)]
struct WasmService {
    metrics: WasmMetrics,
}

impl ServiceHost for WasmService {
    fn now_ms(&self) -> u64 {
        host::now_ms()
    }

    fn dispatch_call(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u64,
    ) -> HostResult<u64> {
        // Through the SDK, whose dispatcher must register the call's token
        // to route its response back to this root context. Envoy's
        // `httpCall` answers only Ok, BadArgument (unknown cluster, bad
        // headers) or InternalFailure, which that function returns as
        // errors.
        let timeout = Duration::from_millis(timeout_ms);
        proxy_wasm::hostcalls::dispatch_http_call(cluster, headers.to_vec(), None, vec![], timeout)
            .map(u64::from)
            .map_err(|status| HostError(format!("{status:?}")))
    }

    fn write_bucket(&mut self, bucket: u32, value: Vec<u8>) {
        shared::set(&bucket_key(bucket), &value);
    }

    fn publish_table(&mut self, table: &PodTable, state: &[u8], members_changed: bool) {
        shared::publish_table(table, state, members_changed);
    }

    fn inflight_of(&mut self, slot: usize) -> InflightCount {
        shared::inflight_count(slot)
    }

    fn metric_sink(&mut self) -> &mut dyn MetricSink {
        &mut self.metrics
    }

    fn store_replica_log(&mut self, slot: u64, value: Vec<u8>, head: LogHead) {
        shared::store_replica_log(slot, &value, &head);
    }

    fn publish_peer_loads(&mut self, loads: Vec<SlotLoad>) {
        shared::publish_peer_loads(&loads);
    }

    fn publish_feed(&mut self, feed: Vec<u8>) {
        shared::publish_feed(&feed);
    }
}

pub struct ServiceRoot {
    service: ReportService<WasmService>,
    queue: Option<u32>,
}

impl Default for ServiceRoot {
    fn default() -> ServiceRoot {
        ServiceRoot {
            service: ReportService::new(WasmService::default()),
            queue: None,
        }
    }
}

/// Grows the VM's memory once, at configuration, by what the service's
/// heap holds besides the index (which reserves its own): the snapshot
/// mirror (16 bytes a block) and answers being folded (a few bodies of
/// `maxReportBytes` and their parse). Envoy's V8 copies the whole linear
/// memory when it grows past its reservation: ~100 ms at 66 MB, measured
/// in the middle of a resync. The allocator keeps what is freed here for
/// later allocations.
fn heap_reservation(config: &Config) -> usize {
    config
        .max_index_blocks
        .saturating_mul(16)
        .saturating_add(config.max_report_bytes.saturating_mul(RESERVED_BODIES))
}

/// The body of the current HTTP call response (empty if the host has none).
fn call_body(size: usize) -> Vec<u8> {
    host::buffer(Buffer::CallResponseBody, 0, size)
        .ok()
        .flatten()
        .unwrap_or_default()
}

impl Context for ServiceRoot {
    /// The VM is being torn down (Envoy shutting down, after it ended
    /// the calls still out).
    fn on_done(&mut self) -> bool {
        self.service.shut_down();
        true
    }

    fn on_http_call_response(
        &mut self,
        token_id: u32,
        _num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        // No headers: the call failed (see the module documentation).
        let status = host::header(HeaderMap::CallResponse, ":status")
            .ok()
            .flatten()
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned());
        self.service
            .on_call_response(u64::from(token_id), status.as_deref(), body_size, call_body);
    }
}

impl RootContext for ServiceRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let Some(config) = load_config("service") else {
            return false;
        };
        if let Err(status) = host::set_tick_period_ms(tick_period_ms(&config)) {
            log::error!("kvroute service: cannot set the tick period: {status}");
            return false;
        }
        let reservation = heap_reservation(&config);
        if self.service.configure(config) {
            // After the index took its own reservation.
            drop(std::hint::black_box(Vec::<u8>::with_capacity(reservation)));
        }
        true
    }

    fn on_tick(&mut self) {
        if self.queue.is_none() {
            self.queue = host::register_queue(DECISION_QUEUE).ok();
        }
        self.service.on_tick();
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        let mut messages = Vec::new();
        while let Ok(Some(message)) = host::dequeue(queue_id) {
            messages.push(message);
        }
        self.service.on_decisions(messages);
    }
}
