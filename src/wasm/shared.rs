//! Envoy shared data access for the snapshot (layout: [`crate::snapshot`])
//! and the passive-health ejections ([`crate::ejection`]). Every read
//! copies the value into the VM, so callers read only what a request needs
//! and cache the pod table per generation and the ejections per CAS token.

use std::rc::Rc;

use super::host::{self, Status};
use crate::config::PassiveHealthConfig;
use crate::ejection::{without_pods, Ejection, Ejections, EJECTIONS_KEY};
use crate::snapshot::{
    bucket_key, decode_inflight, encode_inflight, PodTable, PublishedPod, GENERATION_KEY,
    INFLIGHT_KEY, POD_TABLE_KEY,
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

/// One index bucket, as [`crate::snapshot::SnapshotIndex`] fetches it.
pub fn bucket(bucket: u32) -> Option<Vec<u8>> {
    get(&bucket_key(bucket)).0
}

/// The published pod table, re-read only when its generation changed, and
/// the same table as routing sees it, without the ejected pods.
#[derive(Default)]
pub struct TableCache {
    cached: Option<Rc<PodTable>>,
    /// The shared ejections and the CAS token they were read at.
    ejections: (u32, Ejections),
    /// The cached table with the pods in these slots ejected.
    routable: Option<(Vec<usize>, Rc<PodTable>)>,
}

impl TableCache {
    /// The current table with the pods ejected at `now_ms` at health 0.
    pub fn routable(&mut self, now_ms: u64) -> Option<Rc<PodTable>> {
        let table = self.current()?;
        let (bytes, cas) = get(EJECTIONS_KEY);
        if cas != self.ejections.0 {
            self.ejections = (cas, Ejections::decode(&bytes.unwrap_or_default()));
        }
        let slots = self.ejections.1.ejected_slots(&table, now_ms);
        if slots.is_empty() {
            return Some(table);
        }
        if let Some((cached_slots, routable)) = &self.routable {
            if *cached_slots == slots && routable.generation == table.generation {
                return Some(routable.clone());
            }
        }
        let routable = Rc::new(without_pods(&table, &slots));
        self.routable = Some((slots, routable.clone()));
        Some(routable)
    }

    pub fn current(&mut self) -> Option<Rc<PodTable>> {
        let generation = get(GENERATION_KEY)
            .0
            .and_then(|bytes| bytes.try_into().ok())
            .map(u64::from_le_bytes)?;
        if let Some(table) = &self.cached {
            if table.generation == generation {
                return Some(table.clone());
            }
        }
        let bytes = get(POD_TABLE_KEY).0?;
        match PodTable::decode(&bytes) {
            Ok(table) => {
                let table = Rc::new(table);
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

/// Publishes a pod table (after its buckets, so a reader of the new
/// generation finds the buckets already there).
pub fn publish_table(table: &PodTable) {
    set(POD_TABLE_KEY, &table.encode());
    set(GENERATION_KEY, &table.generation.to_le_bytes());
}

/// In-flight requests per pod slot.
pub fn inflight(slots: usize) -> Vec<u32> {
    decode_inflight(&get(INFLIGHT_KEY).0.unwrap_or_default(), slots)
}

/// Adds `delta` to pod `slot`'s in-flight count, atomically across workers.
pub fn adjust_inflight(slot: usize, delta: i64) -> bool {
    update(INFLIGHT_KEY, |bytes| {
        let mut counts = decode_inflight(bytes, slot + 1);
        if let Some(count) = counts.get_mut(slot) {
            *count = (i64::from(*count) + delta).clamp(0, i64::from(u32::MAX)) as u32;
        }
        Some((encode_inflight(&counts), ()))
    })
    .is_some()
}

/// Creates the ejections value if it is absent, so that every later
/// update is a compare-and-swap (a write to an absent key is not).
pub fn init_ejections() {
    if get(EJECTIONS_KEY).0.is_none() {
        set(EJECTIONS_KEY, &Ejections::default().encode());
    }
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
