//! Replicated gateways: several kvroute Envoys in front of the same pods
//! converge on what decides a request.
//!
//! Pod reports already converge every replica's *confirmed* index. What a
//! replica knows alone is what it decided itself: its pending decisions
//! (precise mode), its decision-derived blocks (approximate mode, and pods
//! in report fallback), and its requests in flight with their queued
//! prefill. Behind a balancer that spreads requests, each replica would
//! decide on a third of that truth (measured: 3 replicas cost 2.3× the
//! TTFT p90 of one in precise mode, 3.8× in approximate mode).
//!
//! ```text
//!            ┌──────── replica A ────────┐          ┌──────── replica B ────────┐
//!  request ─▶│ filter ─ decision ─▶ log  │◀─ pull ──│ service (peers)           │
//!            │                     (seq) │  since,  │   record as its own ──▶   │
//!            │ service (peers) ◀─────────│─ epoch ─▶│ log ◀─ decision ─ filter  │◀─ request
//!            └───────────────────────────┘  wait    └───────────────────────────┘
//! ```
//!
//! Each replica serves its own decision [`log`] on a listener of its own
//! (never the public one), and pulls every peer's with one long-poll
//! pending per peer ([`peers`]), in the shape of report protocol v1
//! ([`wire`]): `?since=SEQ&epoch=REPLICA&wait=MS`, answered at once when
//! the log has decisions after SEQ, else when one is logged or MS ends.
//! Each answer also carries the sender's in-flight loads per pod. A
//! replica records a peer's decisions exactly as its own filters' (the
//! same expiry and bounds) and adds the live peers' loads to its own.
//!
//! Why pull over long-poll: it is the report protocol's machinery, which
//! already keeps one call pending per pod, bounds what it reads, counts
//! bad answers and decides delta or full resync by `since`/`epoch` — a
//! restarted replica catches up from each peer's whole log, a peer that
//! fell behind gets it again, and a dead peer simply stops answering. No
//! broker: Envoy's filters cannot reach Redis or NATS without another
//! dependency to run, and one broker is one more point of failure. Pods as
//! the source of truth for their own queue would cover load but not the
//! decisions' blocks (approximate mode, and stock vLLM without the bridge,
//! has no report to carry them). Peers are found as pods are: a static
//! list, or the members of an Envoy cluster (a headless Service by DNS, or
//! EDS) read from Envoy's admin, this replica included, which recognises
//! itself by the id in its own answer.
//!
//! The channel is not a client surface: it is served only on the replica
//! listener, every call carries the shared secret ([`REPLICA_KEY_HEADER`]),
//! answers are bounded in bytes and in every list, and a bad answer is
//! counted and ignored.

pub mod log;
pub mod peers;
pub mod serve;
pub mod sync;
pub mod wire;

pub use log::{LogHead, ReplicaLog};
pub use peers::{PeerState, PeerTransition, Peers, Received};
pub use serve::{parse_log_request, LogRequest, Refusal};
pub use sync::{PeerCall, PeerOutcome, ReplicaSync, PEER_CALL_GAP_MS};
pub use wire::{
    encode_answer, parse_answer, AnswerLimits, LoggedDecision, PodInflight, ReplicaAnswer,
    REPLICA_KEY_HEADER,
};

/// Compares a presented secret with the configured one in time that does
/// not depend on where they differ (only on their lengths).
pub fn secret_matches(presented: &[u8], secret: &[u8]) -> bool {
    subtle::ConstantTimeEq::ct_eq(presented, secret).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_secret_matches() {
        let secret = b"a-long-shared-secret";
        assert!(secret_matches(secret, secret));
        assert!(!secret_matches(b"a-long-shared-secreT", secret));
        assert!(!secret_matches(b"a-long-shared-secret!", secret));
        assert!(!secret_matches(b"a-long-shared", secret));
        assert!(!secret_matches(b"", secret));
    }
}
