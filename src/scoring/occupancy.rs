//! Occupancy: what the arrivals find on each pod, averaged over time.
//!
//! Each arrival reads every pod's in-flight load ([`SlotLoad`], all
//! workers and replicas) and folds two things into per-pod averages,
//! exponentially weighted over the last `balance.learningWindow`
//! arrivals (each arrival observes every pod):
//! - **busy**: whether the pod had prefill queued. Arrivals see time
//!   averages, so this is the chance that a request arriving there waits
//!   behind work added now: what a copy of a prompt there costs the
//!   requests after it ([`super::balance`]'s `ρ`);
//! - **carried**: the streams open on it. The streams open now are what a
//!   pod carries at one instant, this is what it carries over time:
//!   spread places its copies by it ([`super::ScoringPolicy::decide`]).
//!
//! Both are each worker's own, time averages of the same shared loads, so
//! the workers' averages agree within their sampling. O(pods) per arrival.

use crate::snapshot::SlotLoad;

/// See the module documentation; indexed by pod slot. `Default` averages
/// over one decision (the last arrival's loads).
#[derive(Debug, Clone, Default)]
pub struct Occupancy {
    decay: f64,
    /// Per pod, the share of arrivals that found prefill queued there.
    busy: Vec<f64>,
    /// Per pod, the streams open there as arrivals found them, averaged.
    carried: Vec<f64>,
}

impl Occupancy {
    /// Averages over about `window` arrivals.
    pub fn new(window: u32) -> Occupancy {
        Occupancy {
            decay: 1.0 - 1.0 / f64::from(window.max(1)),
            ..Occupancy::default()
        }
    }

    /// Folds what an arrival finds per pod slot, its prefill queued and
    /// its streams open.
    pub fn observe(&mut self, loads: &[SlotLoad]) {
        for averages in [&mut self.busy, &mut self.carried] {
            if averages.len() < loads.len() {
                averages.resize(loads.len(), 0.0);
            }
        }
        let weight = 1.0 - self.decay;
        for ((busy, carried), load) in self.busy.iter_mut().zip(&mut self.carried).zip(loads) {
            let queued = if load.prefill_tokens > 0 { 1.0 } else { 0.0 };
            *busy += weight * (queued - *busy);
            *carried += weight * (f64::from(load.streams) - *carried);
        }
    }

    /// The share of recent arrivals that found prefill queued on pod
    /// `slot`.
    pub fn busy(&self, slot: usize) -> f64 {
        self.busy.get(slot).copied().unwrap_or(0.0)
    }

    /// The streams open on pod `slot`, averaged over recent arrivals.
    pub fn carried(&self, slot: usize) -> f64 {
        self.carried.get(slot).copied().unwrap_or(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn averages_what_the_arrivals_found() {
        let mut occupancy = Occupancy::new(64);
        // Every other arrival found prefill queued and four streams open
        // on both pods.
        for i in 0..256u32 {
            let load = SlotLoad {
                prefill_tokens: 100 * (i % 2),
                prefill_attention: 0,
                streams: 4 * (i % 2),
                ..SlotLoad::default()
            };
            occupancy.observe(&[load, load]);
        }
        assert!(
            (occupancy.busy(1) - 0.5).abs() < 0.02,
            "{}",
            occupancy.busy(1)
        );
        assert!(
            (occupancy.carried(1) - 2.0).abs() < 0.1,
            "{}",
            occupancy.carried(1)
        );
        assert_eq!((occupancy.busy(2), occupancy.carried(2)), (0.0, 0.0));
    }
}
