//! Envoy shared data access for the snapshot (layout: [`crate::snapshot`]).
//! Every read copies the value into the VM, so callers read only what a
//! request needs and cache the pod table per generation.

use std::rc::Rc;

use super::host::{self, Status};
use crate::snapshot::{
    bucket_key, decode_inflight, encode_inflight, PodTable, GENERATION_KEY, INFLIGHT_KEY,
    POD_TABLE_KEY,
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

/// The published pod table, re-read only when its generation changed.
#[derive(Default)]
pub struct TableCache {
    cached: Option<Rc<PodTable>>,
}

impl TableCache {
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
    for _ in 0..CAS_ATTEMPTS {
        let (bytes, cas) = get(INFLIGHT_KEY);
        let mut counts = decode_inflight(&bytes.unwrap_or_default(), slot + 1);
        if let Some(count) = counts.get_mut(slot) {
            *count = (i64::from(*count) + delta).clamp(0, i64::from(u32::MAX)) as u32;
        }
        match host::shared_set(INFLIGHT_KEY, &encode_inflight(&counts), cas) {
            Ok(()) => return true,
            Err(Status::CAS_MISMATCH) => continue,
            Err(status) => {
                log::warn!("kvroute: updating in-flight counts failed: {status}");
                return false;
            }
        }
    }
    log::warn!(
        "kvroute: in-flight count of slot {slot} not updated after {CAS_ATTEMPTS} CAS attempts"
    );
    false
}
