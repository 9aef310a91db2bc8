//! How old information loses weight, for the service and the filters alike.
//!
//! - **Pod health decay**: a pod's reported health is multiplied by a
//!   factor that is 1 while its last good answer is younger than
//!   `podReportIntervalMs + reportTimeoutMs` (the grace), then falls
//!   linearly to 0 over three more intervals: a silent pod is excluded
//!   after about three missed reports at the default threshold. A pod
//!   nobody polls (approximate mode without `metricsPath`) never decays.
//! - **Snapshot staleness**: the service stamps every publication with its
//!   time. A snapshot older than the grace plus two intervals means the
//!   service stopped publishing (it cannot have: a publication happens every
//!   interval); filters then decay health themselves from each pod's last
//!   report time, exactly as the service would have, and route by load.

use crate::config::{Config, IndexMode};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Staleness {
    polled: bool,
    interval_ms: u64,
    grace_ms: u64,
}

impl Staleness {
    pub fn from_config(config: &Config) -> Staleness {
        Staleness {
            polled: config.mode == IndexMode::Precise || config.metrics_path.is_some(),
            interval_ms: config.pod_report_interval_ms,
            grace_ms: config
                .pod_report_interval_ms
                .saturating_add(config.report_timeout_ms),
        }
    }

    /// The factor on the reported health of a pod whose last good answer
    /// is `age_ms` old.
    pub fn health_factor(&self, age_ms: u64) -> f64 {
        if !self.polled {
            return 1.0;
        }
        let overdue = age_ms.saturating_sub(self.grace_ms) as f64;
        let span = self.interval_ms.saturating_mul(3).max(1) as f64;
        (1.0 - overdue / span).max(0.0)
    }

    /// Age past which a published snapshot is stale.
    pub fn snapshot_stale_after_ms(&self) -> u64 {
        self.grace_ms
            .saturating_add(self.interval_ms.saturating_mul(2))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_decays_after_the_grace_over_three_intervals() {
        let config = Config {
            pod_report_interval_ms: 1000,
            report_timeout_ms: 500,
            ..Config::default()
        };
        let staleness = Staleness::from_config(&config);
        assert_eq!(staleness.health_factor(1500), 1.0);
        assert!((staleness.health_factor(3000) - 0.5).abs() < 1e-9);
        assert_eq!(staleness.health_factor(4500), 0.0);
        assert_eq!(staleness.snapshot_stale_after_ms(), 3500);
        let unpolled = Staleness::from_config(&Config {
            mode: IndexMode::Approximate,
            ..config
        });
        assert_eq!(unpolled.health_factor(u64::MAX), 1.0);
    }
}
