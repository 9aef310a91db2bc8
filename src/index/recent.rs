//! [`RecentDecisions`]: a filter worker's own routing decisions, looked up
//! beside the published index (per pod, the longer match wins).
//!
//! - Approximate mode: decisions are the only signal. Each worker keeps its
//!   own in a [`DecisionRecorder`] (at most `OVERLAY_BLOCKS` blocks, per pod
//!   `podCapacityBlocks`), so it sees them at once, before the service has
//!   folded them from the shared queue into the published index.
//! - Precise mode: nothing is kept here. Every decision goes to the service
//!   on the decision queue, which records it as *pending* on the chosen pod
//!   and publishes its buckets when it folds the batch, so all workers
//!   (this one included) match it until it expires or reports take over
//!   (`ClusterState::record_decision`). That is up to two ticks after the
//!   decision (the worker sends its batch on its tick, the service folds
//!   it on its own), where the replay publishes at once. Kept here for
//!   those 50 ms as well (an expiring [`DecisionRecorder`]), a worker's
//!   next session start saw the copy of a system prompt it had just sent
//!   instead of buying another on the same pod (three within 32 ms in a
//!   real-Envoy multi-turn run), but TTFT did not move (`kvroute-bench
//!   workload multi-turn agentic`, three runs each way alternating: p90
//!   and p99 within the runs' spread) while the filter's time per request
//!   went from 50–74 to 119–227 µs (p50): recording every chain, expiring
//!   it block by block. What keeps such memory from piling a burst onto
//!   one pod is balance (`scoring::balance`).

use super::{DecisionRecorder, PrefixLookup, PrefixMatch, PrefixTree};
use crate::config::{Config, IndexMode};

/// Blocks a worker remembers of its own decisions.
pub const OVERLAY_BLOCKS: usize = 65_536;

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct RecentDecisions {
    recorder: Option<DecisionRecorder>,
}

impl RecentDecisions {
    pub fn new(config: &Config) -> RecentDecisions {
        let recorder = (config.mode == IndexMode::Approximate).then(|| {
            DecisionRecorder::new(
                PrefixTree::new(OVERLAY_BLOCKS.min(config.max_index_blocks)),
                config.pod_capacity_blocks,
            )
        });
        RecentDecisions { recorder }
    }

    /// Records that pod `slot` was sent a request whose prompt is `chain`
    /// (its blocks in approximate mode only).
    pub fn record(&mut self, slot: usize, chain: &[u64]) {
        if let Some(recorder) = &mut self.recorder {
            recorder.record(slot, chain);
        }
    }
}

impl PrefixLookup for RecentDecisions {
    fn lookup(&self, chain: &[u64]) -> PrefixMatch {
        self.recorder
            .as_ref()
            .map_or_else(PrefixMatch::default, |recorder| recorder.lookup(chain))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(mode: IndexMode) -> Config {
        Config {
            mode,
            ..Config::default()
        }
    }

    #[test]
    fn approximate_mode_remembers_decisions() {
        let mut recent = RecentDecisions::new(&config(IndexMode::Approximate));
        recent.record(1, &[5, 6, 7]);
        assert_eq!(recent.lookup(&[5, 6, 7]).blocks(1), 3);
    }

    #[test]
    fn precise_mode_trusts_reports_only() {
        let mut recent = RecentDecisions::new(&config(IndexMode::Precise));
        recent.record(1, &[5, 6, 7]);
        assert_eq!(recent.lookup(&[5, 6, 7]).blocks(1), 0);
    }
}
