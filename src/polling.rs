//! [`ReportPolling`]: when the report service asks each pod for its report,
//! long-poll or interval polling, decided per pod. Host-agnostic, so the
//! offline replay runs the same decisions as the service in Envoy.
//!
//! - **Long-poll** (`reportLongPoll`, default on): the query carries
//!   `wait=W`, W = `podReportIntervalMs`; a pod that supports it holds the
//!   request until it has events after `since` (answers at once if it
//!   already has) or W ends (an empty delta). The service keeps exactly one
//!   report call pending per pod: the next one goes out as soon as the
//!   previous answer is folded, but not sooner than [`MIN_CALL_GAP_MS`]
//!   after the previous call was sent, so the index trails a pod's cache by
//!   the pod's answer latency plus one fold (a busy pod's, by up to the
//!   gap), not by an interval. A silent pod still answers every W, so
//!   health staleness works unchanged. The call timeout is W +
//!   `reportTimeoutMs`: a held call is never a timeout.
//! - **A pod that ignores `wait`** answers at once. An answer that changed
//!   nothing in the index (no block stored or removed, no resync) and came
//!   back in less than W / [`EARLY_DIVISOR`] is *early idle*;
//!   [`EARLY_IDLE_LIMIT`] of them in a row switch the pod to interval
//!   polling. One is tolerated: a pod answers a first query, or one after
//!   its restart, at once by design. So an ignoring pod costs at most a
//!   couple of quick calls, never a loop.
//! - **Interval polling** (the fallback, and `reportLongPoll: false`): one
//!   call per `podReportIntervalMs` without `wait`, the next one interval
//!   after the previous was sent (and never before its answer is folded).
//!   Every [`LONG_POLL_RECHECK_MS`] a fallen-back pod gets one call with
//!   `wait` again (a probe); an answer that is not early idle puts it back
//!   on long-poll.
//! - **A failed call** (no answer, timeout, bad status, malformed body)
//!   makes the next call wait until one interval after the failed one was
//!   sent, in either mode, so an unreachable pod is never asked in a loop.
//! - **One call per pod**: [`ReportPolling::next_call`] answers `None`
//!   while a pod's call is in flight or its answer waits unfolded (it would
//!   ask for the same `since`); [`ReportPolling::failed`] or
//!   [`ReportPolling::folded`] end the call.
//!
//! A busy pod that supports long-poll answers every call at once (it always
//! has events): its calls then go out every [`MIN_CALL_GAP_MS`] at most,
//! each answer carrying the events of the gap coalesced, and slower when
//! the service's per-tick fold budget runs out (no new call while an
//! answer waits unfolded). This bounds the main thread's work per pod
//! to at most 1000 / [`MIN_CALL_GAP_MS`] calls, folds and publications a
//! second.

use std::collections::HashMap;

use crate::config::Config;

/// An answer faster than wait / this, that changed nothing, is early idle.
pub const EARLY_DIVISOR: u64 = 2;

/// Early idle answers in a row that switch a pod to interval polling.
pub const EARLY_IDLE_LIMIT: u32 = 2;

/// Least time between two long-poll calls to one pod: a pod with events
/// all the time is asked at most this often.
pub const MIN_CALL_GAP_MS: u64 = 20;

/// How often a pod polled on the interval is probed with `wait` again.
pub const LONG_POLL_RECHECK_MS: u64 = 30_000;

/// One report call to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportCall {
    /// The `wait` to ask for (`None`: a plain interval poll).
    pub wait_ms: Option<u64>,
    /// The call's timeout: `reportTimeoutMs`, plus the wait when there is one.
    pub timeout_ms: u64,
}

impl ReportCall {
    /// `query` (a report path with `?since=…`, see
    /// [`crate::cluster::ClusterState::report_query`]) with the `wait`.
    pub fn path(&self, query: &str) -> String {
        match self.wait_ms {
            Some(wait) => {
                let separator = if query.contains('?') { '&' } else { '?' };
                format!("{query}{separator}wait={wait}")
            }
            None => query.to_string(),
        }
    }
}

/// How a pod is polled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cadence {
    LongPoll,
    Interval,
}

/// A pod switched cadence (to log once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CadenceChange {
    pub pod: String,
    pub cadence: Cadence,
}

#[derive(Debug, Clone, Copy)]
struct Outstanding {
    sent_ms: u64,
    waited: bool,
    answered_ms: Option<u64>,
}

#[derive(Debug, Clone)]
struct PodPolling {
    cadence: Cadence,
    early_idle: u32,
    /// Interval cadence: when the next call carries `wait` again.
    probe_at_ms: u64,
    /// Earliest time of the next call.
    next_ms: u64,
    outstanding: Option<Outstanding>,
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct ReportPolling {
    long_poll: bool,
    interval_ms: u64,
    timeout_ms: u64,
    min_gap_ms: u64,
    pods: HashMap<String, PodPolling>,
}

impl ReportPolling {
    pub fn new(config: &Config) -> ReportPolling {
        ReportPolling {
            long_poll: config.report_long_poll,
            interval_ms: config.pod_report_interval_ms,
            timeout_ms: config.report_timeout_ms,
            min_gap_ms: MIN_CALL_GAP_MS,
            pods: HashMap::new(),
        }
    }

    /// Long-polls with `min_gap_ms` between two calls to one peer instead
    /// of [`MIN_CALL_GAP_MS`] (the replica channel, [`crate::replica`]: a
    /// peer's decisions should be seen within milliseconds).
    pub fn long_polls(config: &Config, min_gap_ms: u64) -> ReportPolling {
        ReportPolling {
            long_poll: true,
            min_gap_ms,
            ..ReportPolling::new(config)
        }
    }

    /// The wait a long-poll asks for.
    pub fn wait_ms(&self) -> u64 {
        self.interval_ms
    }

    /// The call to send to `pod` now, if one is due; it is then
    /// outstanding until [`ReportPolling::failed`] or
    /// [`ReportPolling::folded`].
    pub fn next_call(&mut self, pod: &str, now_ms: u64) -> Option<ReportCall> {
        let (long_poll, wait_ms, timeout_ms) = (self.long_poll, self.wait_ms(), self.timeout_ms);
        let state = self.pods.entry(pod.to_string()).or_insert(PodPolling {
            cadence: if long_poll {
                Cadence::LongPoll
            } else {
                Cadence::Interval
            },
            early_idle: 0,
            probe_at_ms: 0,
            next_ms: 0,
            outstanding: None,
        });
        if state.outstanding.is_some() || now_ms < state.next_ms {
            return None;
        }
        let waited =
            long_poll && (state.cadence == Cadence::LongPoll || now_ms >= state.probe_at_ms);
        state.outstanding = Some(Outstanding {
            sent_ms: now_ms,
            waited,
            answered_ms: None,
        });
        Some(ReportCall {
            wait_ms: waited.then_some(wait_ms),
            timeout_ms: if waited {
                wait_ms.saturating_add(timeout_ms)
            } else {
                timeout_ms
            },
        })
    }

    /// The answer to `pod`'s call arrived (good or not): what
    /// "early" is measured against, whenever it is folded.
    pub fn answered(&mut self, pod: &str, now_ms: u64) {
        if let Some(call) = self.outstanding_mut(pod) {
            call.answered_ms.get_or_insert(now_ms);
        }
    }

    /// `pod`'s call failed: the next one goes out one interval after this
    /// one was sent.
    pub fn failed(&mut self, pod: &str, now_ms: u64) {
        let interval = self.interval_ms;
        if let Some(state) = self.pods.get_mut(pod) {
            let sent = state.outstanding.take().map_or(now_ms, |c| c.sent_ms);
            state.next_ms = sent.saturating_add(interval);
        }
    }

    /// `pod`'s answer was folded; `changed` says whether it stored or
    /// removed blocks or resynced. Returns the cadence change, if any.
    pub fn folded(&mut self, pod: &str, now_ms: u64, changed: bool) -> Option<CadenceChange> {
        let (interval, wait, min_gap) = (self.interval_ms, self.wait_ms(), self.min_gap_ms);
        let state = self.pods.get_mut(pod)?;
        let call = state.outstanding.take()?;
        let answered = call.answered_ms.unwrap_or(now_ms);
        let early_idle =
            call.waited && !changed && answered.saturating_sub(call.sent_ms) < wait / EARLY_DIVISOR;
        let before = state.cadence;
        if call.waited {
            state.early_idle = if early_idle {
                state.early_idle.saturating_add(1)
            } else {
                0
            };
            state.cadence = match before {
                Cadence::LongPoll if state.early_idle >= EARLY_IDLE_LIMIT => Cadence::Interval,
                Cadence::Interval if !early_idle => Cadence::LongPoll,
                cadence => cadence,
            };
        }
        state.next_ms = match state.cadence {
            Cadence::LongPoll => call.sent_ms.saturating_add(min_gap),
            Cadence::Interval => {
                if call.waited {
                    state.probe_at_ms = now_ms.saturating_add(LONG_POLL_RECHECK_MS);
                }
                call.sent_ms.saturating_add(interval)
            }
        };
        (state.cadence != before).then(|| CadenceChange {
            pod: pod.to_string(),
            cadence: state.cadence,
        })
    }

    /// How `pod` is polled (`None`: never asked yet).
    pub fn cadence(&self, pod: &str) -> Option<Cadence> {
        self.pods.get(pod).map(|s| s.cadence)
    }

    /// Forgets pods not in `pods` (after discovery changed the list).
    pub fn retain<'a>(&mut self, pods: impl Iterator<Item = &'a str>) {
        let keep: std::collections::HashSet<&str> = pods.collect();
        self.pods.retain(|id, _| keep.contains(id.as_str()));
    }

    fn outstanding_mut(&mut self, pod: &str) -> Option<&mut Outstanding> {
        self.pods.get_mut(pod)?.outstanding.as_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn polling(long_poll: bool) -> ReportPolling {
        ReportPolling::new(&Config {
            pod_report_interval_ms: 2000,
            report_timeout_ms: 1000,
            report_long_poll: long_poll,
            ..Config::default()
        })
    }

    /// Sends, answers after `latency` and folds.
    fn round_trip(
        p: &mut ReportPolling,
        now: u64,
        latency: u64,
        changed: bool,
    ) -> (ReportCall, Option<CadenceChange>) {
        let call = p.next_call("a", now).expect("due");
        p.answered("a", now + latency);
        (call, p.folded("a", now + latency, changed))
    }

    #[test]
    fn long_poll_asks_again_as_soon_as_the_answer_is_folded() {
        let mut p = polling(true);
        let call = p.next_call("a", 0).unwrap();
        assert_eq!(call.wait_ms, Some(2000));
        assert_eq!(call.timeout_ms, 3000);
        assert_eq!(
            call.path("/r?since=4&epoch=e"),
            "/r?since=4&epoch=e&wait=2000"
        );
        // One call at a time: in flight, then answered but not folded.
        assert_eq!(p.next_call("a", 5), None);
        p.answered("a", 5);
        assert_eq!(p.next_call("a", 50), None);
        assert_eq!(p.folded("a", 60, true), None);
        // Early is measured at the answer, not at the (late) fold.
        assert!(p.next_call("a", 60).is_some());
        p.answered("a", 2000 + 60);
        assert_eq!(p.folded("a", 2000 + 60, false), None);
        assert_eq!(p.cadence("a"), Some(Cadence::LongPoll));
    }

    #[test]
    fn a_busy_pod_is_asked_at_most_every_gap() {
        let mut p = polling(true);
        p.next_call("a", 1000).unwrap();
        p.answered("a", 1002);
        p.folded("a", 1002, true);
        assert_eq!(p.next_call("a", 1000 + MIN_CALL_GAP_MS - 1), None);
        assert!(p.next_call("a", 1000 + MIN_CALL_GAP_MS).is_some());
    }

    #[test]
    fn a_pod_ignoring_wait_falls_back_to_the_interval_and_is_probed_again() {
        let mut p = polling(true);
        // A first answer at once that changed nothing is tolerated.
        assert_eq!(round_trip(&mut p, 0, 2, false).1, None);
        // A busy pod answering at once with events is long-polling fine.
        assert_eq!(round_trip(&mut p, 30, 2, true).1, None);
        assert_eq!(round_trip(&mut p, 60, 2, false).1, None);
        let (_, change) = round_trip(&mut p, 90, 2, false);
        assert_eq!(change.map(|c| c.cadence), Some(Cadence::Interval));
        // Now one plain call per interval after the last one was sent.
        assert_eq!(p.next_call("a", 1000), None);
        let (call, _) = round_trip(&mut p, 2090, 2, false);
        assert_eq!((call.wait_ms, call.timeout_ms), (None, 1000));
        assert_eq!(p.next_call("a", 4089), None);
        // Plain calls never count as evidence either way.
        assert_eq!(round_trip(&mut p, 4090, 2, true).1, None);
        // The probe, 30 s after the fallback: still ignoring.
        let probe_at = 92 + LONG_POLL_RECHECK_MS;
        let mut now = 6090;
        while now < probe_at {
            assert_eq!(round_trip(&mut p, now, 2, false).0.wait_ms, None);
            now += 2000;
        }
        let (call, change) = round_trip(&mut p, now, 2, false);
        assert_eq!((call.wait_ms, change), (Some(2000), None));
        // The next probe finds a pod that holds: back to long-poll.
        let next_probe = now + 2 + LONG_POLL_RECHECK_MS;
        let mut now = now + 2000;
        let call = loop {
            let call = p.next_call("a", now).unwrap();
            if call.wait_ms.is_some() {
                break call;
            }
            p.answered("a", now + 2);
            assert_eq!(p.folded("a", now + 2, false), None);
            now += 2000;
        };
        assert!(now >= next_probe);
        p.answered("a", now + 2000);
        let change = p.folded("a", now + 2000, false);
        assert_eq!(call.wait_ms, Some(2000));
        assert_eq!(change.map(|c| c.cadence), Some(Cadence::LongPoll));
        assert!(p.next_call("a", now + 4000).is_some());
    }

    #[test]
    fn a_failure_waits_an_interval_after_the_failed_call_in_any_cadence() {
        let mut p = polling(true);
        p.next_call("a", 100).unwrap();
        p.answered("a", 101);
        p.failed("a", 101);
        assert_eq!(p.next_call("a", 2099), None);
        // A long-poll that timed out (after wait + timeout) is due at once.
        let call = p.next_call("a", 2100).unwrap();
        p.answered("a", 2100 + call.timeout_ms);
        p.failed("a", 2100 + call.timeout_ms);
        assert!(p.next_call("a", 2100 + call.timeout_ms).is_some());
        // A failure is no evidence about `wait`.
        assert_eq!(p.cadence("a"), Some(Cadence::LongPoll));
    }

    #[test]
    fn without_long_poll_every_call_is_a_plain_interval_poll() {
        let mut p = polling(false);
        for i in 0..20 {
            let (call, change) = round_trip(&mut p, i * 2000, 1, false);
            assert_eq!((call.wait_ms, call.timeout_ms, change), (None, 1000, None));
            assert_eq!(p.next_call("a", i * 2000 + 1999), None);
        }
        p.retain(["b"].into_iter());
        assert_eq!(p.cadence("a"), None);
    }
}
