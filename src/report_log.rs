//! The pod side of report protocol v1 (see [`crate::report`]): a bounded
//! log of block events with sequence numbers, from which a pod builds the
//! report body: coalesced deltas after `since`, or a full resync of the
//! blocks it holds when the log no longer reaches back to `since`. A block
//! that changes tier is logged as stored again, in its new tier: the last
//! event of a hash wins, so a delta carries each block once, in its
//! current tier. Segments are written with `tier` only when it is not
//! `gpu`, so a pod without tiers sends exactly what it sent before.
//!
//! Shared by everything that serves reports (kvroute-sim and its offline
//! replay, and kvroute-vllm-bridge), so they answer `since`/`epoch` the same
//! way. Nothing here runs in the filter.

use std::collections::{HashMap, HashSet, VecDeque};

use serde_json::{json, Map, Value};

use crate::report::{hash_to_hex, StoredChain, Tier};

/// Random 64 bits from the process's hash keys, the clock and the pid: a
/// restarted pod never repeats its epoch (the simulator seeds with it too).
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::time::{SystemTime, UNIX_EPOCH};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    hasher.write_u32(std::process::id());
    hasher.finish()
}

/// A fresh report epoch: 16 hex digits of [`random_u64`].
pub fn new_epoch() -> String {
    format!("{:016x}", random_u64())
}

/// One logged change: `hash` (child of `parent`) stored (or moved) in
/// `tier`, or removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockEvent {
    pub hash: u64,
    pub parent: Option<u64>,
    pub stored: bool,
    /// The tier it is held in now (stored events).
    pub tier: Tier,
}

/// Changes after some sequence number, coalesced: each hash at most once
/// (its last event wins), `stored` in parent-first chains.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LogDelta {
    pub stored: Vec<StoredChain>,
    pub removed: Vec<u64>,
}

/// The bounded event log (see the module documentation).
#[derive(Debug, Clone)]
pub struct ReportLog {
    /// Events `floor + 1 ..= seq`, oldest first.
    log: VecDeque<BlockEvent>,
    seq: u64,
    floor: u64,
    max_log: usize,
}

impl ReportLog {
    /// An empty log keeping at most `max_log` events.
    pub fn new(max_log: usize) -> ReportLog {
        ReportLog {
            log: VecDeque::new(),
            seq: 0,
            floor: 0,
            max_log: max_log.max(1),
        }
    }

    /// The last event's sequence number (0: none yet).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The oldest `since` a delta can still be built from.
    pub fn oldest_since(&self) -> u64 {
        self.floor
    }

    /// Logs that `hash` (child of `parent`) is now held in `tier`.
    pub fn stored(&mut self, hash: u64, parent: Option<u64>, tier: Tier) {
        self.push(BlockEvent {
            hash,
            parent,
            stored: true,
            tier,
        });
    }

    /// Logs that `hash` (child of `parent`) is no longer held at all.
    pub fn removed(&mut self, hash: u64, parent: Option<u64>) {
        self.push(BlockEvent {
            hash,
            parent,
            stored: false,
            tier: Tier::Gpu,
        });
    }

    fn push(&mut self, event: BlockEvent) {
        self.log.push_back(event);
        self.seq += 1;
        while self.log.len() > self.max_log {
            self.log.pop_front();
            self.floor += 1;
        }
    }

    /// The events after `since`, oldest first (`None` as for
    /// [`ReportLog::delta`]): for a pod that also publishes its events one
    /// by one.
    pub fn events_after(&self, since: u64) -> Option<impl Iterator<Item = &BlockEvent>> {
        if since < self.floor || since > self.seq {
            return None;
        }
        let start = usize::try_from(since - self.floor).ok()?;
        Some(self.log.range(start..))
    }

    /// The coalesced changes after `since`, or `None` when events after
    /// `since` were already dropped (or `since` is in the future).
    pub fn delta(&self, since: u64) -> Option<LogDelta> {
        let events: Vec<&BlockEvent> = self.events_after(since)?.collect();
        // Last event per hash wins; keep the order of those last events.
        let mut last: HashMap<u64, usize> = HashMap::new();
        for (i, event) in events.iter().enumerate() {
            last.insert(event.hash, i);
        }
        let mut stored = Vec::new();
        let mut removed = Vec::new();
        for (i, event) in events.iter().enumerate() {
            if last.get(&event.hash) != Some(&i) {
                continue;
            }
            if event.stored {
                stored.push((event.hash, event.parent, event.tier));
            } else {
                removed.push(event.hash);
            }
        }
        Some(LogDelta {
            stored: chain_segments(&stored),
            removed,
        })
    }

    /// The block part of the report answering `?since=…&epoch=…` (version,
    /// podId, epoch, seq, since, full, stored, removed): a delta when
    /// `asked_epoch` is `epoch` and `since` is a retained, non-zero
    /// sequence number, else a full resync of `held()` (every block held,
    /// as parent-first chains). The caller adds the load fields.
    pub fn report_body(
        &self,
        pod_id: &str,
        epoch: &str,
        since: Option<u64>,
        asked_epoch: Option<&str>,
        held: impl FnOnce() -> Vec<StoredChain>,
    ) -> Map<String, Value> {
        let delta = match (since, asked_epoch) {
            (Some(since), Some(asked)) if since > 0 && asked == epoch => {
                self.delta(since).map(|d| (since, d))
            }
            _ => None,
        };
        let (full, since, stored, removed) = match delta {
            Some((since, delta)) => (false, since, delta.stored, delta.removed),
            None => (true, 0, held(), Vec::new()),
        };
        let stored: Vec<Value> = stored
            .iter()
            .map(|s| {
                let mut segment = Map::new();
                segment.insert("parent".into(), json!(s.parent.map(hash_to_hex)));
                let hashes: Vec<String> = s.hashes.iter().map(|&h| hash_to_hex(h)).collect();
                segment.insert("hashes".into(), json!(hashes));
                if s.tier != Tier::Gpu {
                    segment.insert("tier".into(), json!(s.tier.name()));
                }
                Value::Object(segment)
            })
            .collect();
        let mut body = Map::new();
        body.insert("version".into(), json!(1));
        body.insert("podId".into(), json!(pod_id));
        body.insert("epoch".into(), json!(epoch));
        body.insert("seq".into(), json!(self.seq));
        body.insert("since".into(), json!(since));
        body.insert("full".into(), json!(full));
        body.insert("stored".into(), Value::Array(stored));
        body.insert(
            "removed".into(),
            json!(removed.iter().map(|&h| hash_to_hex(h)).collect::<Vec<_>>()),
        );
        body
    }
}

/// Groups `(hash, parent, tier)` nodes into parent-first chains: a
/// depth-first walk from the nodes whose parent is not among them, a chain
/// running on while each node continues the previous one in its tier.
pub fn chain_segments(nodes: &[(u64, Option<u64>, Tier)]) -> Vec<StoredChain> {
    let present: HashSet<u64> = nodes.iter().map(|n| n.0).collect();
    let mut children: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut parent_of: HashMap<u64, (Option<u64>, Tier)> = HashMap::new();
    let mut roots = Vec::new();
    for &(hash, parent, tier) in nodes {
        parent_of.insert(hash, (parent, tier));
        match parent {
            Some(p) if present.contains(&p) && p != hash => {
                children.entry(p).or_default().push(hash)
            }
            _ => roots.push(hash),
        }
    }
    let mut out: Vec<StoredChain> = Vec::new();
    let mut visited = HashSet::new();
    for root in roots {
        let mut stack = vec![root];
        while let Some(hash) = stack.pop() {
            if !visited.insert(hash) {
                continue;
            }
            let (parent, tier) = parent_of.get(&hash).copied().unwrap_or_default();
            match out.last_mut() {
                Some(chain)
                    if parent.is_some()
                        && chain.hashes.last().copied() == parent
                        && chain.tier == tier =>
                {
                    chain.hashes.push(hash)
                }
                _ => out.push(StoredChain {
                    parent,
                    hashes: vec![hash],
                    tier,
                }),
            }
            if let Some(kids) = children.get(&hash) {
                // Reversed so the first child is visited first.
                stack.extend(kids.iter().rev());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_coalesces_and_full_resyncs_past_the_floor() {
        let mut log = ReportLog::new(3);
        log.stored(1, None, Tier::Gpu);
        log.stored(2, Some(1), Tier::Gpu);
        log.removed(2, Some(1));
        let delta = log.delta(0).expect("retained");
        assert_eq!(
            delta.stored,
            vec![StoredChain {
                parent: None,
                hashes: vec![1],
                tier: Tier::Gpu,
            }]
        );
        assert_eq!(delta.removed, vec![2]);
        log.stored(3, Some(1), Tier::Gpu);
        assert_eq!(log.oldest_since(), 1);
        assert!(log.delta(0).is_none());
        let body = log.report_body("p", "E", Some(0), Some("E"), Vec::new);
        assert_eq!(body.get("full"), Some(&json!(true)));
        let body = log.report_body("p", "E", Some(2), Some("E"), Vec::new);
        assert_eq!(body.get("full"), Some(&json!(false)));
        assert_eq!(body.get("seq"), Some(&json!(4)));
        let body = log.report_body("p", "E", Some(2), Some("other"), Vec::new);
        assert_eq!(body.get("full"), Some(&json!(true)));
    }

    #[test]
    fn a_tier_change_is_a_store_in_the_new_tier_and_segments_split_by_tier() {
        let mut log = ReportLog::new(100);
        for (hash, parent) in [(1, None), (2, Some(1)), (3, Some(2)), (4, Some(3))] {
            log.stored(hash, parent, Tier::Gpu);
        }
        let since = log.seq();
        // The tail moves to host memory (GPU copies evicted), then 4 goes.
        log.stored(4, Some(3), Tier::Cpu);
        log.stored(3, Some(2), Tier::Cpu);
        log.removed(4, Some(3));
        let delta = log.delta(since).expect("retained");
        assert_eq!(
            delta.stored,
            vec![StoredChain {
                parent: Some(2),
                hashes: vec![3],
                tier: Tier::Cpu,
            }]
        );
        assert_eq!(delta.removed, vec![4]);
        let nodes = [
            (1, None, Tier::Gpu),
            (2, Some(1), Tier::Gpu),
            (3, Some(2), Tier::Cpu),
            (5, Some(3), Tier::Cpu),
            (6, Some(2), Tier::Gpu),
        ];
        let segment = |parent, hashes: &[u64], tier| StoredChain {
            parent,
            hashes: hashes.to_vec(),
            tier,
        };
        assert_eq!(
            chain_segments(&nodes),
            [
                segment(None, &[1, 2], Tier::Gpu),
                segment(Some(2), &[3, 5], Tier::Cpu),
                segment(Some(2), &[6], Tier::Gpu),
            ]
        );
        // On the wire, `tier` only when not gpu.
        let body = log.report_body("p", "E", Some(since), Some("E"), Vec::new);
        assert_eq!(body["stored"][0]["tier"], json!("cpu"));
        let full = log.report_body("p", "E", None, None, || chain_segments(&nodes[..2]));
        assert!(full["stored"][0].get("tier").is_none(), "{full:?}");
    }
}
