//! What kvroute needs from its host, as traits: one per request
//! ([`Stream`]), one per worker ([`WorkerHost`]) and one for the report
//! service ([`ServiceHost`]). `src/wasm/` implements them over proxy-wasm,
//! `src/native/` over Envoy's dynamic-module ABI; everything that decides
//! is in [`super`], written once.
//!
//! Every call returns the host's refusal instead of failing: a request the
//! host cannot serve is answered or passed through, never a crash.

use std::ops::Deref;

use crate::config::PassiveHealthConfig;
use crate::ejection::Ejection;
use crate::index::PrefixLookup;
use crate::replica::{LogHead, PodInflight};
use crate::snapshot::{InflightChange, InflightCount, PodTable, PublishedPod, SlotLoad};

use super::metrics::MetricSink;

/// A host call that failed, as the host described it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostError(pub String);

impl std::fmt::Display for HostError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

pub type HostResult<T> = Result<T, HostError>;

/// What a filter callback tells the host to do with the request or
/// response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    /// Hold it here (the request: until kvroute resumes or answers it).
    Pause,
}

/// One request as the host lets kvroute act on it: the request of the
/// current callback, or (through [`WorkerHost::other`]) a waiting request
/// of the same worker.
pub trait Stream {
    /// A request header's value (`None`: absent). An error means the host
    /// could not read the headers at all.
    fn request_header(&mut self, name: &str) -> HostResult<Option<Vec<u8>>>;
    fn remove_request_header(&mut self, name: &str) -> HostResult<()>;
    fn set_request_header(&mut self, name: &str, value: &str) -> HostResult<()>;
    /// The buffered request body, at most `max` bytes of it.
    fn request_body(&mut self, max: usize) -> Vec<u8>;
    /// A response header's value as text ("" when absent).
    fn response_header(&mut self, name: &str) -> String;
    fn set_response_header(&mut self, name: &str, value: &str) -> HostResult<()>;
    /// This callback's chunk of the response body (`size` bytes).
    fn response_chunk(&mut self, size: usize) -> Vec<u8>;
    /// The host of the last upstream attempt (`ip:port`).
    fn upstream_host(&mut self) -> Option<String>;
    /// Upstream attempts so far (1 without retries).
    fn upstream_attempts(&mut self) -> Option<u64>;
    /// Envoy's response flags, as [`crate::ejection::UpstreamOutcome`]
    /// reads them.
    fn response_flags(&mut self) -> Option<u64>;
    /// Answers the request locally. The host may send it after the
    /// current callback returns.
    fn send_response(
        &mut self,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> HostResult<()>;
    /// Resumes the paused request (after the current callback returns).
    fn resume(&mut self) -> HostResult<()>;
    /// Makes this the request the following host calls act on again,
    /// after calls on other requests (proxy-wasm's effective context).
    fn reactivate(&mut self) -> HostResult<()>;
}

/// A worker's view of the shared state and its own services.
pub trait WorkerHost {
    /// The published pod table as the host shares it.
    type Table: Deref<Target = PodTable> + Clone;
    /// A waiting request of this worker, to act on from another callback.
    type Other<'a>: Stream
    where
        Self: 'a;

    /// Wall-clock milliseconds since the Unix epoch (the service's clock).
    fn now_ms(&self) -> u64;
    /// The current pod table (`None` before the service published one).
    fn current_table(&mut self) -> Option<Self::Table>;
    /// The current table with the pods ejected at `now_ms` at health 0.
    fn routable_table(&mut self, now_ms: u64) -> Option<Self::Table>;
    /// The published index of `table`'s generation.
    fn index<'a>(&'a self, table: &'a PodTable) -> impl PrefixLookup + 'a;
    /// In-flight load per pod slot over every worker and every live peer
    /// replica ([`ServiceHost::publish_peer_loads`]), at least `slots`.
    fn inflight(&mut self, slots: usize) -> Vec<SlotLoad>;
    /// Adds each change to this worker's in-flight loads.
    fn adjust_inflight(&mut self, changes: &[InflightChange]);
    /// Makes this worker's pending in-flight releases visible to the
    /// others (a host that publishes them at once has none).
    fn publish_releases(&mut self);
    /// Whether this worker has no request in flight.
    fn idle(&self) -> bool;
    /// Ejects `pod` for every worker; `None` when it was already out.
    fn eject(
        &mut self,
        pod: &PublishedPod,
        table: &PodTable,
        now_ms: u64,
        policy: &PassiveHealthConfig,
    ) -> Option<Ejection>;
    /// Hands a batch of decisions, answers and session starts
    /// ([`crate::snapshot::BatchRecord`]) to the report service.
    fn send_decisions(&mut self, batch: &[u8]);
    /// The service's feed as last published
    /// ([`ServiceHost::publish_feed`]), `None` before the first.
    fn feed(&mut self) -> Option<Vec<u8>>;
    fn metric_sink(&mut self) -> &mut dyn MetricSink;
    /// The waiting request `id` of this worker (`None`: it is gone).
    fn other(&mut self, id: u32) -> Option<Self::Other<'_>>;
    /// Whether answers to other requests may be sent now (proxy-wasm: only
    /// in the root's tick; they are owed until then).
    fn answers_others_now(&self) -> bool;
}

/// The report service's host: HTTP calls through Envoy's clusters and the
/// published snapshot.
pub trait ServiceHost {
    fn now_ms(&self) -> u64;
    /// GETs through `cluster` with `headers`; the token names the answer.
    fn dispatch_call(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u64,
    ) -> HostResult<u64>;
    /// Publishes one index bucket's encoded value.
    fn write_bucket(&mut self, bucket: u32, value: Vec<u8>);
    /// Publishes a generation of the pod table, after the buckets it
    /// counts on. `state` is its numbers ([`PodTable::encode_state`]);
    /// `members_changed` says whether anything else of it (pods, slots,
    /// addresses, adapters, attributes, buckets: its `members_digest`)
    /// changed since the last publication. When it did not, a host brings
    /// the table it published last to `state` in place, without copying
    /// the table's strings (1,024 pods' ids and addresses).
    fn publish_table(&mut self, table: &PodTable, state: &[u8], members_changed: bool);
    /// Requests in flight on pod `slot` and streams ever opened there, over
    /// every worker.
    fn inflight_of(&mut self, slot: usize) -> InflightCount;
    fn metric_sink(&mut self) -> &mut dyn MetricSink;
    /// Stores one value of this replica's decision log under `slot`, then
    /// the log's `head`: what the replica listener serves peers
    /// ([`crate::replica`]).
    fn store_replica_log(&mut self, slot: u64, value: Vec<u8>, head: LogHead);
    /// Publishes what the live peer replicas have in flight, per pod slot:
    /// the filters add it to their own loads ([`WorkerHost::inflight`]).
    fn publish_peer_loads(&mut self, loads: Vec<SlotLoad>);
    /// Publishes the feed ([`crate::scoring::feed::Feed`]) every worker
    /// learns from ([`WorkerHost::feed`]).
    fn publish_feed(&mut self, feed: Vec<u8>);
}

/// The replica listener's host ([`super::replica`]): this replica's log
/// as the service stored it, and its own loads in flight.
pub trait ReplicaHost {
    /// A held pull of this worker, to answer from the tick.
    type Other<'a>: Stream
    where
        Self: 'a;

    fn now_ms(&self) -> u64;
    /// The log's head (`None` before the service started it).
    fn replica_head(&self) -> Option<LogHead>;
    /// The log value stored under `slot` ([`crate::replica::log::log_slot`]).
    fn replica_log(&self, slot: u64) -> Option<Vec<u8>>;
    /// This replica's own requests in flight per pod (every worker's, not
    /// the peers'), see [`super::replica::loads_by_pod`].
    fn own_inflight(&mut self) -> Vec<PodInflight>;
    /// The held pull `id` of this worker (`None`: its peer hung up).
    fn other(&mut self, id: u32) -> Option<Self::Other<'_>>;
}
