//! The state every worker shares, in process memory: one snapshot of the
//! index, the in-flight loads, the ejections and the decisions on their
//! way to the report service.
//!
//! The snapshot keeps [`crate::snapshot`]'s layout — the pod table and the
//! index buckets, each bucket `(hash, holders)` entries encoded as the
//! service publishes them — but each value is an immutable `Arc` swapped
//! atomically ([`arc_swap`]) instead of a shared-data key: the service
//! writes a changed bucket once, and a request's lookup reads the buckets
//! it bisects through in place (an atomic load each), with no copy.
//! Under proxy-wasm every `get_shared_data` copied the value into the
//! worker's VM, which is why the index is split into ~256-byte buckets;
//! here the split only keeps a publication's writes proportional to what
//! changed. A reader that loads a new table before all of its buckets
//! sees what a proxy-wasm reader sees: buckets are written before the
//! table that counts on them. A new generation of the pod table whose
//! members did not change is the table the publication before last
//! replaced, brought to the new numbers in place
//! ([`PodTable::apply_state`], the binary state a proxy-wasm reader
//! applies too) once no reader holds it any more: at 1,024 pods a copy
//! would clone 2,048 strings, and a table is published up to every few ms.
//!
//! In-flight loads are three atomics per pod slot (requests, queued
//! prefill tokens, open streams), added to by every worker and read by every decision: each
//! decision sees every request routed before it, on any worker, and a
//! release is seen at once (proxy-wasm defers releases to a tick).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::{ArcSwap, ArcSwapOption};

use crate::config::PassiveHealthConfig;
use crate::ejection::{Ejection, Ejections};
use crate::replica::log::LOG_DECISIONS;
use crate::replica::LogHead;
use crate::snapshot::{
    clamped_add, InflightChange, InflightCount, PodTable, PublishedPod, SlotLoad,
};

/// The published index buckets and pod table.
pub struct Snapshot {
    table: ArcSwapOption<PodTable>,
    /// The table the last publication replaced (the service's only).
    retired: Mutex<Option<Arc<PodTable>>>,
    buckets: Box<[ArcSwap<Vec<u8>>]>,
}

impl Snapshot {
    /// `buckets` as the service's publisher counts them (a power of two).
    pub fn new(buckets: u32) -> Snapshot {
        let empty = Arc::new(Vec::new());
        Snapshot {
            table: ArcSwapOption::empty(),
            retired: Mutex::new(None),
            buckets: (0..buckets.max(1))
                .map(|_| ArcSwap::new(empty.clone()))
                .collect(),
        }
    }

    pub fn table(&self) -> Option<Arc<PodTable>> {
        self.table.load_full()
    }

    /// Publishes a generation of `table` ([`crate::gateway::host::ServiceHost::publish_table`]):
    /// unless its members changed, the retired table brought to `state`
    /// when no reader holds it, else a copy.
    pub fn publish_table(&self, table: &PodTable, state: &[u8], members_changed: bool) {
        let mut retired = self.retired.lock().unwrap_or_else(|e| e.into_inner());
        let mut next = retired.take().filter(|_| !members_changed);
        let in_place = next
            .as_mut()
            .and_then(Arc::get_mut)
            .is_some_and(|old| old.apply_state(state).is_ok());
        let next = match next {
            Some(next) if in_place => next,
            _ => Arc::new(table.clone()),
        };
        *retired = self.table.swap(Some(next));
    }

    /// One bucket's entries (`None` outside the index).
    pub fn bucket(&self, bucket: u32) -> Option<Arc<Vec<u8>>> {
        self.buckets
            .get(usize::try_from(bucket).ok()?)
            .map(|value| value.load_full())
    }

    /// Replaces one bucket; a bucket outside the index is refused.
    pub fn write_bucket(&self, bucket: u32, value: Vec<u8>) -> bool {
        match usize::try_from(bucket)
            .ok()
            .and_then(|b| self.buckets.get(b))
        {
            Some(slot) => {
                slot.store(Arc::new(value));
                true
            }
            None => false,
        }
    }
}

/// In-flight loads per pod slot ([`SlotLoad`]), one atomic per field.
pub struct Inflight {
    requests: Box<[AtomicU32]>,
    prefill_tokens: Box<[AtomicU32]>,
    prefill_attention: Box<[AtomicU32]>,
    streams: Box<[AtomicU32]>,
    /// Streams ever opened, wrapping ([`InflightCount::opened`]).
    opened: Box<[AtomicU32]>,
}

fn add(counter: &AtomicU32, delta: i64) {
    if delta == 0 {
        return;
    }
    let _ = counter.fetch_update(Ordering::AcqRel, Ordering::Acquire, |value| {
        Some(clamped_add(value, delta))
    });
}

fn read(counters: &[AtomicU32], slot: usize) -> u32 {
    counters.get(slot).map_or(0, |c| c.load(Ordering::Acquire))
}

impl Inflight {
    pub fn new(slots: usize) -> Inflight {
        let counters = || (0..slots).map(|_| AtomicU32::new(0)).collect();
        Inflight {
            requests: counters(),
            prefill_tokens: counters(),
            prefill_attention: counters(),
            streams: counters(),
            opened: counters(),
        }
    }

    /// Applies each change; a slot outside the pool is ignored.
    pub fn adjust(&self, changes: &[InflightChange]) {
        for change in changes {
            for (counters, delta) in [
                (&self.requests, change.requests),
                (&self.prefill_tokens, change.prefill_tokens),
                (&self.prefill_attention, change.prefill_attention),
                (&self.streams, change.streams),
            ] {
                if let Some(counter) = counters.get(change.slot) {
                    add(counter, delta);
                }
            }
            if let (Some(opened), streams @ 1..) = (self.opened.get(change.slot), change.opened()) {
                opened.fetch_add(streams, Ordering::AcqRel);
            }
        }
    }

    /// The loads of the first `slots` slots (at least `slots` entries).
    pub fn loads(&self, slots: usize) -> Vec<SlotLoad> {
        (0..slots)
            .map(|slot| SlotLoad {
                requests: read(&self.requests, slot),
                prefill_tokens: read(&self.prefill_tokens, slot),
                prefill_attention: read(&self.prefill_attention, slot),
                streams: read(&self.streams, slot),
            })
            .collect()
    }

    pub fn count(&self, slot: usize) -> InflightCount {
        InflightCount {
            requests: read(&self.requests, slot),
            opened: read(&self.opened, slot),
        }
    }
}

/// Passive-health ejections, read by every decision and replaced whole by
/// a filter that ejects a pod.
#[derive(Default)]
pub struct SharedEjections {
    current: ArcSwap<Ejections>,
    writer: Mutex<()>,
}

impl SharedEjections {
    pub fn load(&self) -> Arc<Ejections> {
        self.current.load_full()
    }

    /// Ejects `pod` for every worker ([`Ejections::eject`]); `None` when it
    /// was already out.
    pub fn eject(
        &self,
        pod: &PublishedPod,
        table: &PodTable,
        now_ms: u64,
        policy: &PassiveHealthConfig,
    ) -> Option<Ejection> {
        let _writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let mut next = Ejections::clone(&self.current.load());
        let ejection = next.eject(pod, table, now_ms, policy)?;
        self.current.store(Arc::new(next));
        Some(ejection)
    }
}

/// Decision batches from the workers, waiting for the main thread.
#[derive(Default)]
pub struct DecisionInbox {
    batches: Mutex<Vec<Vec<u8>>>,
}

impl DecisionInbox {
    /// Adds a batch; true when the inbox was empty (the service must be
    /// woken).
    pub fn push(&self, batch: &[u8]) -> bool {
        let mut batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
        batches.push(batch.to_vec());
        batches.len() == 1
    }

    pub fn take(&self) -> Vec<Vec<u8>> {
        std::mem::take(&mut *self.batches.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// The replica channel's state ([`crate::replica`]): this replica's
/// decision log as the service stores it (one value per log slot and the
/// head) for the replica listener to serve, and what the live peers have
/// in flight per pod slot, which every routing decision adds to its own.
pub struct ReplicaShare {
    head: ArcSwapOption<LogHead>,
    log: Box<[ArcSwapOption<Vec<u8>>]>,
    peer_loads: ArcSwap<Vec<SlotLoad>>,
}

impl Default for ReplicaShare {
    fn default() -> ReplicaShare {
        ReplicaShare {
            head: ArcSwapOption::empty(),
            log: (0..LOG_DECISIONS).map(|_| ArcSwapOption::empty()).collect(),
            peer_loads: ArcSwap::new(Arc::new(Vec::new())),
        }
    }
}

impl ReplicaShare {
    /// Stores a log value (none: only the head moves), then the head.
    pub fn store(&self, slot: u64, value: Vec<u8>, head: LogHead) {
        if !value.is_empty() {
            if let Some(entry) = usize::try_from(slot).ok().and_then(|s| self.log.get(s)) {
                entry.store(Some(Arc::new(value)));
            }
        }
        self.head.store(Some(Arc::new(head)));
    }

    pub fn head(&self) -> Option<LogHead> {
        self.head.load().as_deref().copied()
    }

    pub fn value(&self, slot: u64) -> Option<Vec<u8>> {
        let entry = self.log.get(usize::try_from(slot).ok()?)?;
        entry.load().as_deref().cloned()
    }

    pub fn publish_peer_loads(&self, loads: Vec<SlotLoad>) {
        self.peer_loads.store(Arc::new(loads));
    }

    /// Adds the live peers' loads to `total` (grown as needed).
    pub fn add_peer_loads(&self, total: &mut Vec<SlotLoad>) {
        let peers = self.peer_loads.load();
        if total.len() < peers.len() {
            total.resize(peers.len(), SlotLoad::default());
        }
        for (sum, &load) in total.iter_mut().zip(peers.iter()) {
            sum.add(load);
        }
    }
}

/// Everything the workers and the service share.
pub struct Shared {
    pub snapshot: Snapshot,
    pub inflight: Inflight,
    pub ejections: SharedEjections,
    pub decisions: DecisionInbox,
    pub replica: ReplicaShare,
    /// The service's feed ([`crate::scoring::feed`]).
    pub feed: ArcSwapOption<Vec<u8>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inflight_counts_clamp_and_read_per_slot() {
        let inflight = Inflight::new(4);
        let change = |slot, requests, prefill_tokens, streams| InflightChange {
            slot,
            requests,
            prefill_tokens,
            prefill_attention: prefill_tokens * 3,
            streams,
        };
        inflight.adjust(&[
            change(1, 2, 300, 2),
            change(3, 1, 10, 1),
            change(9, 1, 1, 1),
        ]);
        inflight.adjust(&[change(1, -1, -500, 0)]);
        let loads = inflight.loads(4);
        assert_eq!(
            loads[1],
            SlotLoad {
                requests: 1,
                prefill_tokens: 0,
                prefill_attention: 0,
                streams: 2,
            }
        );
        assert_eq!(loads[3].requests, 1);
        assert_eq!(inflight.loads(6).len(), 6, "slots past the pool read 0");
    }

    #[test]
    fn a_table_of_the_same_members_is_brought_to_each_generation_in_place() {
        let pod = |slot: usize| PublishedPod {
            slot,
            id: format!("pod-{slot}"),
            address: format!("10.0.{}.{}:8000", slot / 256, slot % 256),
            queue: 0,
            load: 0.0,
            health: 1.0,
            reported_health: 1.0,
            last_report_ms: 0,
            adapters: Vec::new(),
            attributes: Default::default(),
            inflight_at_report: 0,
            kv_room: Default::default(),
        };
        let mut table = PodTable {
            generation: 1,
            buckets: 4,
            members_digest: 7,
            pods: (0..1024).map(pod).collect(),
            ..PodTable::default()
        };
        let snapshot = Snapshot::new(4);
        let generation = |table: &mut PodTable, n: u64| {
            table.generation = n;
            table.pods[700].queue = n as u32;
            table.encode_state()
        };
        let state = generation(&mut table, 1);
        snapshot.publish_table(&table, &state, true);
        let first = snapshot.table().expect("published");
        let state = generation(&mut table, 2);
        snapshot.publish_table(&table, &state, false);
        // The first table is still held (`first`): the second is a copy.
        let second = snapshot.table().expect("published");
        assert_eq!(*second, table);
        let first_at = Arc::as_ptr(&first);
        drop(first);
        let state = generation(&mut table, 3);
        snapshot.publish_table(&table, &state, false);
        let third = snapshot.table().expect("published");
        assert_eq!(Arc::as_ptr(&third), first_at, "the retired table, reused");
        assert_eq!((third.generation, third.pods[700].queue), (3, 3));
        assert_eq!(*third, table);
        drop(third);
        // Members changed: the new table whole, never the retired one.
        table.members_digest = 8;
        table.pods[5].address = "10.9.9.9:8000".into();
        let state = generation(&mut table, 4);
        snapshot.publish_table(&table, &state, true);
        assert_eq!(*snapshot.table().expect("published"), table);
        // A state that does not fit the retired table is not applied.
        drop(second);
        let mut other = table.clone();
        other.members_digest = 9;
        let state = generation(&mut other, 5);
        snapshot.publish_table(&other, &state, false);
        assert_eq!(*snapshot.table().expect("published"), other);
    }

    #[test]
    fn buckets_are_replaced_whole_and_out_of_range_is_refused() {
        let snapshot = Snapshot::new(4);
        assert!(snapshot.write_bucket(2, vec![1, 2, 3]));
        assert!(!snapshot.write_bucket(4, vec![9]));
        assert_eq!(snapshot.bucket(2).as_deref(), Some(&vec![1, 2, 3]));
        assert_eq!(snapshot.bucket(0).as_deref(), Some(&vec![]));
        assert!(snapshot.bucket(7).is_none());
    }
}
