//! [`RecentDecisions`]: a filter worker's own routing decisions, looked up
//! beside the published index (per pod, the longer match wins).
//!
//! - Approximate mode: decisions are the only signal. Each worker keeps its
//!   own in a [`DecisionRecorder`] (at most `OVERLAY_BLOCKS` blocks, per pod
//!   `podCapacityBlocks`), so it sees them at once, before the service has
//!   folded them from the shared queue into the published index.
//! - Precise mode: nothing is kept here. Every decision goes to the service
//!   on the decision queue, which records it as *pending* on the chosen pod
//!   and publishes its buckets at once, so all workers (this one included)
//!   match it within milliseconds, until it expires or reports take over
//!   (`ClusterState::record_decision`). What kept such memory from piling
//!   a burst onto one pod is the balance guard (`scoring::balance`).
//!
//! In both modes it also counts the worker's last `balance.shareWindow`
//! decisions per pod, and its pods' requests in flight averaged over them,
//! for the share guard ([`RecentShare`]).

use super::{DecisionRecorder, PrefixLookup, PrefixMatch, PrefixTree};
use crate::config::{Config, IndexMode};
use crate::scoring::balance::RecentShare;

/// Blocks a worker remembers of its own decisions.
pub const OVERLAY_BLOCKS: usize = 65_536;

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct RecentDecisions {
    recorder: Option<DecisionRecorder>,
    share: RecentShare,
}

impl RecentDecisions {
    pub fn new(config: &Config) -> RecentDecisions {
        let recorder = (config.mode == IndexMode::Approximate).then(|| {
            DecisionRecorder::new(
                PrefixTree::new(OVERLAY_BLOCKS.min(config.max_index_blocks)),
                config.pod_capacity_blocks,
            )
        });
        RecentDecisions {
            recorder,
            share: RecentShare::new(&config.balance),
        }
    }

    /// Records that pod `slot` was sent a request whose prompt is `chain`
    /// (its blocks in approximate mode only).
    pub fn record(&mut self, slot: usize, chain: &[u64]) {
        self.share.record(slot);
        if let Some(recorder) = &mut self.recorder {
            recorder.record(slot, chain);
        }
    }

    /// The worker's recent decisions per pod slot, for the share guard.
    pub fn decisions_per_slot(&self) -> &[u32] {
        self.share.counts()
    }

    /// Folds the requests in flight per pod slot, seen at a decision, into
    /// the share guard's averages.
    pub fn observe_inflight(&mut self, inflight: impl ExactSizeIterator<Item = u32>) {
        self.share.observe(inflight);
    }

    /// Requests in flight per pod slot, averaged over the worker's latest
    /// decisions, for the share guard.
    pub fn busy_average(&self) -> &[f64] {
        self.share.busy_average()
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
