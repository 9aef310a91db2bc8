//! Passive health: pods ejected after an upstream failure a filter saw.
//!
//! Report pulls notice a dead pod only once missed reports decay its health
//! (about three report intervals). A filter sees the failure at once: Envoy
//! could not connect to the pod, or the connection was reset before the
//! response started. Such a pod is *ejected*:
//! - excluded from routing (its health reads 0) from that moment, on every
//!   worker: the ejections live in one shared-data value
//!   ([`EJECTIONS_KEY`]) that filters update by compare-and-swap and read
//!   with each decision;
//! - for `passiveHealth.ejectionMs`; an ejection that starts less than the
//!   previous one's length after it ended lasts twice as long, at most
//!   `passiveHealth.maxEjectionMs`, so a pod that keeps failing is tried
//!   less and less often;
//! - until its time is over **and** the pod has answered a pull since it
//!   was ejected (its `lastReportMs` in the pod table): a dead pod stays out
//!   until it answers again, a revived one is back on its next good report.
//!
//! Which pods failed ([`UpstreamOutcome::failed`]): Envoy retries only after
//! a connection failure or a reset (the route's retry policy), and the
//! override-host policy takes the listed pods in order, one per attempt. So
//! after `n` attempts the first `n − 1` listed pods failed, and the last
//! attempt's pod (`upstream.address`) failed too when the response flags
//! say the connection failed, terminated or was reset (`UF`, `UC`, `UR`).
//! With ORIGINAL_DST the list is the chosen pod alone and there is one
//! attempt. Circuit-breaker overflows (`UO`) and timeouts are not the pod's
//! death and eject nothing.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::config::PassiveHealthConfig;
use crate::snapshot::{PodTable, PublishedPod};

/// Shared-data key of the encoded [`Ejections`].
pub const EJECTIONS_KEY: &str = "kvroute/ejections";

/// Envoy's response flags (the `response.flags` attribute, legacy bits)
/// that mean the upstream connection failed, terminated or was reset.
pub const UPSTREAM_FAILURE_FLAGS: u64 =
    UPSTREAM_REMOTE_RESET | UPSTREAM_CONNECTION_FAILURE | UPSTREAM_CONNECTION_TERMINATION;
/// `UR`: the upstream reset the stream.
const UPSTREAM_REMOTE_RESET: u64 = 0x10;
/// `UF`: the connection to the upstream could not be established.
const UPSTREAM_CONNECTION_FAILURE: u64 = 0x20;
/// `UC`: the upstream connection closed under the stream.
const UPSTREAM_CONNECTION_TERMINATION: u64 = 0x40;

/// One pod's latest ejection (ms since the Unix epoch).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ejection {
    pub pod: String,
    pub since_ms: u64,
    pub until_ms: u64,
}

impl Ejection {
    pub fn duration_ms(&self) -> u64 {
        self.until_ms.saturating_sub(self.since_ms)
    }

    /// Whether `pod` is still out at `now_ms` (see the module documentation).
    fn excludes(&self, pod: &PublishedPod, now_ms: u64) -> bool {
        now_ms < self.until_ms || pod.last_report_ms <= self.since_ms
    }
}

/// Every pod's latest ejection, as shared by the filters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ejections {
    entries: Vec<Ejection>,
}

impl Ejections {
    /// Decodes the shared value; absent or malformed reads as no ejection
    /// (a broken value must not exclude pods forever).
    pub fn decode(bytes: &[u8]) -> Ejections {
        Ejections {
            entries: serde_json::from_slice(bytes).unwrap_or_default(),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        // Strings and integers always serialise.
        serde_json::to_vec(&self.entries).unwrap_or_default()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Records that a request failed to reach `pod` at `now_ms` and returns
    /// the new ejection, or `None` when the pod is already out. Entries of
    /// pods that left `table`, and entries over long enough that they could
    /// no longer lengthen an ejection, are dropped.
    pub fn eject(
        &mut self,
        pod: &PublishedPod,
        table: &PodTable,
        now_ms: u64,
        policy: &PassiveHealthConfig,
    ) -> Option<Ejection> {
        let previous = self.entries.iter().position(|e| e.pod == pod.id);
        let duration_ms = match previous.and_then(|at| self.entries.get(at)) {
            Some(last) if last.excludes(pod, now_ms) => return None,
            Some(last) if now_ms.saturating_sub(last.until_ms) < last.duration_ms() => last
                .duration_ms()
                .saturating_mul(2)
                .min(policy.max_ejection_ms)
                .max(policy.ejection_ms),
            _ => policy.ejection_ms,
        };
        let ejection = Ejection {
            pod: pod.id.clone(),
            since_ms: now_ms,
            until_ms: now_ms.saturating_add(duration_ms),
        };
        self.entries.retain(|e| {
            e.pod != pod.id
                && table.pods.iter().any(|p| {
                    p.id == e.pod
                        && (e.excludes(p, now_ms)
                            || now_ms.saturating_sub(e.until_ms) < e.duration_ms())
                })
        });
        self.entries.push(ejection.clone());
        Some(ejection)
    }

    /// Slots of the pods of `table` that are out at `now_ms`.
    pub fn ejected_slots(&self, table: &PodTable, now_ms: u64) -> Vec<usize> {
        table
            .pods
            .iter()
            .filter(|pod| {
                self.entries
                    .iter()
                    .any(|e| e.pod == pod.id && e.excludes(pod, now_ms))
            })
            .map(|pod| pod.slot)
            .collect()
    }
}

/// `table` with the pods in `slots` at health 0 (reported and decayed, so
/// a filter routing on a stale snapshot excludes them too).
pub fn without_pods(table: &PodTable, slots: &[usize]) -> PodTable {
    let mut table = table.clone();
    for pod in table.pods.iter_mut().filter(|p| slots.contains(&p.slot)) {
        pod.health = 0.0;
        pod.reported_health = 0.0;
    }
    table
}

/// The published table as routing sees it ([`without_pods`] of the pods
/// ejected now), rebuilt only when the ejected set or the table's
/// generation changes.
#[derive(Debug, Default)]
pub struct RoutableTable {
    cached: Option<(Vec<usize>, Arc<PodTable>)>,
}

impl RoutableTable {
    /// `table` with the pods `ejections` hold out at `now_ms` at health 0.
    pub fn of(
        &mut self,
        table: &Arc<PodTable>,
        ejections: &Ejections,
        now_ms: u64,
    ) -> Arc<PodTable> {
        let slots = ejections.ejected_slots(table, now_ms);
        if slots.is_empty() {
            return table.clone();
        }
        if let Some((cached_slots, routable)) = &self.cached {
            if *cached_slots == slots && routable.generation == table.generation {
                return routable.clone();
            }
        }
        let routable = Arc::new(without_pods(table, &slots));
        self.cached = Some((slots, routable.clone()));
        routable
    }
}

/// What the filter learns of a routed request's upstream attempts when the
/// response (Envoy's or the pod's) starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpstreamOutcome<'a> {
    /// `upstream.request_attempt_count`.
    pub attempts: u64,
    /// `upstream.address`: the host of the last attempt.
    pub last_host: Option<&'a str>,
    /// `response.flags`.
    pub flags: u64,
}

impl<'a> UpstreamOutcome<'a> {
    fn last_failed(&self) -> bool {
        self.flags & UPSTREAM_FAILURE_FLAGS != 0
    }

    /// The addresses that failed, in the order Envoy tried them, given the
    /// addresses the filter listed for it (see the module documentation).
    pub fn failed(&self, listed: &[&'a str]) -> Vec<&'a str> {
        let retried = usize::try_from(self.attempts.saturating_sub(1)).unwrap_or(usize::MAX);
        let mut failed: Vec<&'a str> = listed.iter().take(retried).copied().collect();
        if let (true, Some(last)) = (self.last_failed(), self.last_host) {
            if !failed.contains(&last) {
                failed.push(last);
            }
        }
        failed
    }

    /// The address that is serving the response, if a pod is.
    pub fn served(&self) -> Option<&'a str> {
        self.last_host
            .filter(|_| self.attempts > 0 && !self.last_failed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(id: &str, slot: usize, last_report_ms: u64) -> PublishedPod {
        PublishedPod {
            slot,
            id: id.into(),
            address: format!("10.0.0.{slot}:8000"),
            queue: 0,
            load: 0.0,
            health: 1.0,
            reported_health: 1.0,
            last_report_ms,
            adapters: Vec::new(),
            attributes: Default::default(),
            inflight_at_report: 0,
            kv_room: Default::default(),
        }
    }

    fn table(pods: Vec<PublishedPod>) -> PodTable {
        PodTable {
            pods,
            ..PodTable::default()
        }
    }

    const POLICY: PassiveHealthConfig = PassiveHealthConfig {
        ejection_ms: 1000,
        max_ejection_ms: 4000,
    };

    #[test]
    fn an_ejection_lasts_until_its_time_is_over_and_the_pod_answered() {
        let mut ejections = Ejections::default();
        let a = pod("a", 0, 100);
        let cluster = table(vec![a.clone(), pod("b", 1, 100)]);
        let ejection = ejections.eject(&a, &cluster, 500, &POLICY);
        assert_eq!(
            ejection,
            Some(Ejection {
                pod: "a".into(),
                since_ms: 500,
                until_ms: 1500
            })
        );
        assert_eq!(ejections.ejected_slots(&cluster, 501), vec![0]);
        // Every other failure while it is out is the same death.
        assert_eq!(ejections.eject(&a, &cluster, 900, &POLICY), None);
        // Time over, no answer since: still out.
        assert_eq!(ejections.ejected_slots(&cluster, 5000), vec![0]);
        assert_eq!(ejections.eject(&a, &cluster, 5000, &POLICY), None);
        // It answered during the ejection: back once the time is over.
        let answered = table(vec![pod("a", 0, 800), pod("b", 1, 800)]);
        assert_eq!(ejections.ejected_slots(&answered, 1499), vec![0]);
        assert!(ejections.ejected_slots(&answered, 1500).is_empty());
    }

    #[test]
    fn a_pod_failing_again_soon_is_ejected_twice_as_long_up_to_the_cap() {
        let mut ejections = Ejections::default();
        let mut now = 0;
        let mut durations = Vec::new();
        for _ in 0..5 {
            let cluster = table(vec![pod("a", 0, now)]);
            let pod_now = pod("a", 0, now);
            let ejection = ejections.eject(&pod_now, &cluster, now, &POLICY).unwrap();
            durations.push(ejection.duration_ms());
            // It answers, comes back, and fails right after.
            now = ejection.until_ms + 10;
            let cluster = table(vec![pod("a", 0, ejection.until_ms - 1)]);
            assert!(ejections.ejected_slots(&cluster, now).is_empty());
            now += 1;
        }
        assert_eq!(durations, vec![1000, 2000, 4000, 4000, 4000]);
        // After a long healthy spell the next ejection is short again.
        let later = now + 60_000;
        let cluster = table(vec![pod("a", 0, later - 1)]);
        let ejection = ejections
            .eject(&pod("a", 0, later - 1), &cluster, later, &POLICY)
            .unwrap();
        assert_eq!(ejection.duration_ms(), 1000);
    }

    #[test]
    fn entries_of_gone_or_long_recovered_pods_are_dropped_and_round_trip() {
        let mut ejections = Ejections::default();
        let cluster = table(vec![pod("a", 0, 0), pod("b", 1, 0), pod("c", 2, 0)]);
        ejections.eject(&pod("a", 0, 0), &cluster, 100, &POLICY);
        ejections.eject(&pod("b", 1, 0), &cluster, 100, &POLICY);
        assert_eq!(Ejections::decode(&ejections.encode()), ejections);
        // b left the cluster; a answered and has been back for long.
        let later = table(vec![pod("a", 0, 200), pod("c", 2, 200)]);
        ejections.eject(&pod("c", 2, 200), &later, 10_000, &POLICY);
        let pods: Vec<&str> = ejections.entries.iter().map(|e| e.pod.as_str()).collect();
        assert_eq!(pods, vec!["c"]);
        assert_eq!(Ejections::decode(b"not json"), Ejections::default());
        assert!(Ejections::decode(b"").is_empty());
    }

    #[test]
    fn ejected_pods_read_health_zero() {
        let cluster = table(vec![pod("a", 0, 0), pod("b", 3, 0)]);
        let out = without_pods(&cluster, &[3]);
        let health: Vec<(f64, f64)> = out
            .pods
            .iter()
            .map(|p| (p.health, p.reported_health))
            .collect();
        assert_eq!(health, vec![(1.0, 1.0), (0.0, 0.0)]);
    }

    #[test]
    fn failed_attempts_are_the_listed_pods_before_the_last_one() {
        let listed = ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"];
        // Served by the first pod.
        let first = UpstreamOutcome {
            attempts: 1,
            last_host: Some("10.0.0.1:80"),
            flags: 0,
        };
        assert!(first.failed(&listed).is_empty());
        assert_eq!(first.served(), Some("10.0.0.1:80"));
        // The first refused the connection; the retry to the second served.
        let retried = UpstreamOutcome {
            attempts: 2,
            last_host: Some("10.0.0.2:80"),
            flags: 0,
        };
        assert_eq!(retried.failed(&listed), vec!["10.0.0.1:80"]);
        assert_eq!(retried.served(), Some("10.0.0.2:80"));
        // ORIGINAL_DST: one attempt, Envoy's 503 with UF.
        let refused = UpstreamOutcome {
            attempts: 1,
            last_host: Some("10.0.0.1:80"),
            flags: UPSTREAM_CONNECTION_FAILURE,
        };
        assert_eq!(refused.failed(&listed[..1]), vec!["10.0.0.1:80"]);
        assert_eq!(refused.served(), None);
        // Retries exhausted past the list: the fallback's pick failed too.
        let exhausted = UpstreamOutcome {
            attempts: 4,
            last_host: Some("10.0.0.9:80"),
            flags: UPSTREAM_REMOTE_RESET | 0x8000,
        };
        assert_eq!(
            exhausted.failed(&listed),
            vec!["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.0.9:80"]
        );
        // A circuit-breaker overflow (UO) is not the pod's failure.
        let overflow = UpstreamOutcome {
            attempts: 1,
            last_host: Some("10.0.0.1:80"),
            flags: 0x80,
        };
        assert!(overflow.failed(&listed).is_empty());
    }
}
