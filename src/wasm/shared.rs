//! Envoy shared data access for the snapshot (layout: [`crate::snapshot`]),
//! the in-flight loads and the passive-health ejections
//! ([`crate::ejection`]). Every read copies the value into the VM, so
//! callers read only what a request needs and cache the pod table per
//! generation and the ejections per CAS token.
//!
//! In-flight loads (requests, their queued prefill and open streams per
//! pod, see [`SlotLoad`]) are kept per worker VM, with no compare-and-swap on the
//! request path: each VM claims an index `w` once (a CAS increment of
//! `kvroute/workers`), keeps its own loads locally and writes them whole
//! to `kvroute/inflight/{w}` whenever they grow — one plain write, as no
//! one else writes that key. A reader adds every other worker's key to its
//! own loads. So a decision sees every request another worker routed
//! before that decision started, as the single CAS-updated counter did: a
//! herd spreads across workers just as fast. A release (a request's first
//! byte or its end) is not written on its own: it goes with the worker's
//! next growth or its next tick ([`publish_releases`]), so other workers
//! count a pod busier for up to one tick, which costs no herd guarantee
//! and saves two writes per request.
//! The staleness accepted is in the worker count only: it is re-read when
//! the pod table's generation changes, so a worker VM started later is
//! counted by the others from their next table (the service publishes one
//! at least every `podReportIntervalMs`); Envoy starts its workers before
//! it serves, and the first decision of each worker reads the count.
//! The key `kvroute/workers` is created by a plain write (a write to an
//! absent key ignores the CAS token), so two VMs configuring at once may
//! claim the same index: each value carries its writer's random nonce, and
//! a VM that finds another's nonce under its key (checked with the worker
//! count) claims a new index. A VM's index outlives its plugin roots, so a
//! configuration reload in the same VM reuses it.

use std::cell::RefCell;
use std::sync::Arc;

use super::host::{self, Status};
use crate::config::PassiveHealthConfig;
use crate::ejection::{Ejection, Ejections, RoutableTable, EJECTIONS_KEY};
use crate::replica::LogHead;
use crate::snapshot::{
    add_inflight, add_inflight_count, bucket_key, encode_inflight, inflight_key, inflight_nonce,
    state_members_digest, InflightChange, InflightCount, PodTable, PublishedPod, SlotLoad,
    GENERATION_KEY, POD_STATE_KEY, POD_TABLE_KEY, WORKERS_KEY,
};

/// Retries of a compare-and-swap update under contention.
const CAS_ATTEMPTS: usize = 32;

/// A value and its CAS token; a failed read is an absent value.
pub fn get(key: &str) -> (Option<Vec<u8>>, u32) {
    host::shared_get(key).unwrap_or((None, 0))
}

pub fn set(key: &str, value: &[u8]) {
    if let Err(status) = host::shared_set(key, value, 0) {
        log::warn!("kvroute: writing shared data {key} failed: {status}");
    }
}

/// Shared-data keys of the replica channel ([`crate::replica`]): the log's
/// head and its values (written by the service, read by the replica
/// listener), and the live peers' loads per pod slot (written by the
/// service in the in-flight encoding, added by every routing decision).
const REPLICA_HEAD_KEY: &str = "kvroute/replica/head";
const PEER_LOADS_KEY: &str = "kvroute/inflight/peers";

fn replica_log_key(slot: u64) -> String {
    format!("kvroute/replica/log/{slot}")
}

pub fn store_replica_log(slot: u64, value: &[u8], head: &LogHead) {
    if !value.is_empty() {
        set(&replica_log_key(slot), value);
    }
    set(REPLICA_HEAD_KEY, &head.encode());
}

pub fn replica_head() -> Option<LogHead> {
    get(REPLICA_HEAD_KEY)
        .0
        .and_then(|bytes| LogHead::decode(&bytes))
}

pub fn replica_log(slot: u64) -> Option<Vec<u8>> {
    get(&replica_log_key(slot)).0
}

pub fn publish_peer_loads(loads: &[SlotLoad]) {
    set(PEER_LOADS_KEY, &encode_inflight(0, loads, &[]));
}

/// The live peer replicas' loads added to `total` (routing decisions only:
/// the replica listener serves this replica's own).
pub fn add_peer_loads(total: &mut Vec<SlotLoad>) {
    if let Some(bytes) = get(PEER_LOADS_KEY).0 {
        add_inflight(total, &bytes);
    }
}

/// The service's feed ([`crate::scoring::feed`]).
const FEED_KEY: &str = "kvroute/feed";

pub fn publish_feed(feed: &[u8]) {
    set(FEED_KEY, feed);
}

pub fn feed() -> Option<Vec<u8>> {
    get(FEED_KEY).0
}

/// One index bucket, as [`crate::snapshot::SnapshotIndex`] fetches it.
pub fn bucket(bucket: u32) -> Option<Vec<u8>> {
    get(&bucket_key(bucket)).0
}

/// The published pod table, re-read only when its generation changed, and
/// the same table as routing sees it, without the ejected pods.
#[derive(Default)]
pub struct TableCache {
    cached: Option<Arc<PodTable>>,
    /// The shared ejections and the CAS token they were read at.
    ejections: (u32, Ejections),
    routable: RoutableTable,
}

impl TableCache {
    /// The current table with the pods ejected at `now_ms` at health 0.
    pub fn routable(&mut self, now_ms: u64) -> Option<Arc<PodTable>> {
        let table = self.current()?;
        let (bytes, cas) = get(EJECTIONS_KEY);
        if cas != self.ejections.0 {
            self.ejections = (cas, Ejections::decode(&bytes.unwrap_or_default()));
        }
        Some(self.routable.of(&table, &self.ejections.1, now_ms))
    }

    /// The current table: per new generation its numbers from
    /// `kvroute/podstate` applied to the cached table in place, the JSON
    /// table decoded only when the members digest moved (see
    /// [`crate::snapshot`]).
    pub fn current(&mut self) -> Option<Arc<PodTable>> {
        let generation = get(GENERATION_KEY)
            .0
            .and_then(|bytes| bytes.try_into().ok())
            .map(u64::from_le_bytes)?;
        if let Some(table) = &self.cached {
            if table.generation == generation {
                return Some(table.clone());
            }
        }
        refresh_inflight();
        let state = get(POD_STATE_KEY).0.unwrap_or_default();
        let members = state_members_digest(&state);
        if let Some(cached) = self.cached.as_mut() {
            if Some(cached.members_digest) == members
                && Arc::make_mut(cached).apply_state(&state).is_ok()
            {
                return Some(cached.clone());
            }
        }
        let bytes = get(POD_TABLE_KEY).0?;
        match PodTable::decode(&bytes) {
            Ok(mut table) => {
                // Written before the state: a state of other members is
                // that of a publication in between, and the JSON's own
                // numbers stand.
                let _ = table.apply_state(&state);
                let table = Arc::new(table);
                self.cached = Some(table.clone());
                Some(table)
            }
            Err(error) => {
                log::error!("kvroute filter: {error}");
                None
            }
        }
    }
}

/// Publishes a pod table, after its buckets, so a reader of the new
/// generation finds the buckets already there: its numbers (`state`)
/// always, the JSON table only when `members_changed` (the members digest
/// moved since the last one written).
pub fn publish_table(table: &PodTable, state: &[u8], members_changed: bool) {
    if members_changed {
        set(POD_TABLE_KEY, &table.encode());
    }
    set(POD_STATE_KEY, state);
    set(GENERATION_KEY, &table.generation.to_le_bytes());
}

/// This VM's in-flight loads and the key it publishes them under.
struct Inflight {
    worker: u32,
    nonce: u64,
    loads: Vec<SlotLoad>,
    /// Streams opened per slot, ever ([`InflightCount::opened`]).
    opened: Vec<u32>,
    /// Releases not yet published.
    released: bool,
    /// How many workers claimed a key, as last read.
    workers: u32,
}

thread_local! {
    // One VM per thread: the VM's loads, shared by its plugin roots.
    static INFLIGHT: RefCell<Option<Inflight>> = const { RefCell::new(None) };
}

fn workers() -> u32 {
    get(WORKERS_KEY)
        .0
        .and_then(|bytes| bytes.try_into().ok())
        .map_or(0, u32::from_le_bytes)
}

/// The worker count, at least enough to include `worker` (whose claim the
/// published count may not show yet).
fn workers_including(worker: u32) -> u32 {
    workers().max(worker.saturating_add(1))
}

/// A new worker index (see the module documentation for the race on
/// creating the key).
fn claim_index() -> Option<u32> {
    create_if_absent(WORKERS_KEY, &0u32.to_le_bytes());
    update(WORKERS_KEY, |bytes| {
        let claimed = bytes.try_into().map_or(0, u32::from_le_bytes);
        Some((claimed.saturating_add(1).to_le_bytes().to_vec(), claimed))
    })
}

impl Inflight {
    fn publish(&mut self) {
        set(
            &inflight_key(self.worker),
            &encode_inflight(self.nonce, &self.loads, &self.opened),
        );
        self.released = false;
    }
}

/// Gives this VM its own in-flight key (once; later plugin roots of the
/// VM share it). False when no index could be claimed.
pub fn claim_inflight() -> bool {
    INFLIGHT.with(|cell| {
        let mut cell = cell.borrow_mut();
        if cell.is_some() {
            return true;
        }
        let Some(worker) = claim_index() else {
            return false;
        };
        // WASI's random source: VMs configured at the same instant differ.
        let nonce = crate::gateway::random_u64();
        let mut inflight = Inflight {
            worker,
            nonce,
            loads: Vec::new(),
            opened: Vec::new(),
            released: false,
            workers: workers_including(worker),
        };
        inflight.publish();
        *cell = Some(inflight);
        true
    })
}

/// Re-reads the worker count, and claims a new index if another VM's
/// nonce is under this VM's key.
fn refresh_inflight() {
    INFLIGHT.with(|cell| {
        let mut cell = cell.borrow_mut();
        let Some(inflight) = cell.as_mut() else {
            return;
        };
        let owner = get(&inflight_key(inflight.worker)).0;
        if owner.as_deref().and_then(inflight_nonce) != Some(inflight.nonce) {
            if let Some(worker) = claim_index() {
                log::warn!(
                    "kvroute filter: in-flight key {} was claimed twice; now {worker}",
                    inflight.worker
                );
                inflight.worker = worker;
                inflight.publish();
            }
        }
        inflight.workers = workers_including(inflight.worker);
    });
}

/// In-flight load per pod slot (at least `slots` of them), over every
/// worker: this VM's own loads and every other worker's key (all of them
/// for the service, which has none).
pub fn inflight(slots: usize) -> Vec<SlotLoad> {
    INFLIGHT.with(|cell| {
        let cell = cell.borrow();
        let (own, workers) = match cell.as_ref() {
            Some(inflight) => (Some(inflight), inflight.workers),
            None => (None, workers()),
        };
        let mut total = own.map(|i| i.loads.clone()).unwrap_or_default();
        for worker in (0..workers).filter(|w| own.is_none_or(|i| i.worker != *w)) {
            if let Some(bytes) = get(&inflight_key(worker)).0 {
                add_inflight(&mut total, &bytes);
            }
        }
        if total.len() < slots {
            total.resize(slots, SlotLoad::default());
        }
        total
    })
}

/// Pod `slot`'s requests in flight and streams opened, over every
/// worker's published value (the service's VM has none of its own).
pub fn inflight_count(slot: usize) -> InflightCount {
    let mut count = InflightCount::default();
    for worker in 0..workers() {
        if let Some(bytes) = get(&inflight_key(worker)).0 {
            add_inflight_count(&mut count, &bytes, slot);
        }
    }
    count
}

/// Whether this VM has no request in flight.
pub fn idle() -> bool {
    INFLIGHT.with(|cell| {
        cell.borrow()
            .as_ref()
            .is_none_or(|i| i.loads.iter().all(|c| c.streams == 0))
    })
}

/// Applies each change to this VM's in-flight loads; publishes them (one
/// write) if any grows, and leaves releases to the next growth or tick
/// (see the module documentation).
pub fn adjust_inflight(changes: &[InflightChange]) {
    INFLIGHT.with(|cell| {
        let mut cell = cell.borrow_mut();
        let Some(inflight) = cell.as_mut() else {
            return;
        };
        for change in changes {
            if inflight.loads.len() <= change.slot {
                inflight.loads.resize(change.slot + 1, SlotLoad::default());
            }
            if let Some(load) = inflight.loads.get_mut(change.slot) {
                change.apply(load);
            }
            if let streams @ 1.. = change.opened() {
                if inflight.opened.len() <= change.slot {
                    inflight.opened.resize(change.slot + 1, 0);
                }
                if let Some(opened) = inflight.opened.get_mut(change.slot) {
                    *opened = opened.wrapping_add(streams);
                }
            }
        }
        if changes.iter().any(InflightChange::grows) {
            inflight.publish();
        } else {
            inflight.released = true;
        }
    });
}

/// Publishes this VM's releases not yet published (on the root's tick).
pub fn publish_releases() {
    INFLIGHT.with(|cell| {
        if let Some(inflight) = cell.borrow_mut().as_mut().filter(|i| i.released) {
            inflight.publish();
        }
    });
}

/// Creates `key` with `value` if it is absent, so that every later update
/// is a compare-and-swap (a write to an absent key is not).
fn create_if_absent(key: &str, value: &[u8]) {
    if get(key).0.is_none() {
        set(key, value);
    }
}

/// Creates the ejections value if it is absent ([`create_if_absent`]).
pub fn init_ejections() {
    create_if_absent(EJECTIONS_KEY, &Ejections::default().encode());
}

/// Ejects `pod` for every worker ([`Ejections::eject`]); `None` when it
/// was already out.
pub fn eject(
    pod: &PublishedPod,
    table: &PodTable,
    now_ms: u64,
    policy: &PassiveHealthConfig,
) -> Option<Ejection> {
    update(EJECTIONS_KEY, |bytes| {
        let mut ejections = Ejections::decode(bytes);
        let ejection = ejections.eject(pod, table, now_ms, policy)?;
        Some((ejections.encode(), ejection))
    })
}

/// Rewrites `key` to what `change` makes of its current value (empty when
/// absent), atomically across workers; `change` returning `None` leaves it
/// as it is. Returns what `change` returned with the write that succeeded.
fn update<T>(key: &str, mut change: impl FnMut(&[u8]) -> Option<(Vec<u8>, T)>) -> Option<T> {
    for _ in 0..CAS_ATTEMPTS {
        let (bytes, cas) = get(key);
        let (value, result) = change(&bytes.unwrap_or_default())?;
        match host::shared_set(key, &value, cas) {
            Ok(()) => return Some(result),
            Err(Status::CAS_MISMATCH) => continue,
            Err(status) => {
                log::warn!("kvroute: updating shared data {key} failed: {status}");
                return None;
            }
        }
    }
    log::warn!("kvroute: shared data {key} not updated after {CAS_ATTEMPTS} CAS attempts");
    None
}
