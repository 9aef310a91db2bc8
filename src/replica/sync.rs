//! [`ReplicaSync`]: the service's side of the replica channel, host-free,
//! so that each host's glue only makes the calls and stores the values.
//!
//! - A decision of this replica's filters that the service recorded
//!   ([`crate::cluster::ClusterState::record_decision`]) is logged
//!   ([`ReplicaSync::log_decision`]): the host stores the value under its
//!   slot and the new [`LogHead`], where the replica listener serves them.
//! - [`ReplicaSync::calls`] names the peer pulls due now: one long-poll
//!   pending per peer, the next sent as soon as the previous answer is
//!   taken, at most one per [`PEER_CALL_GAP_MS`].
//! - [`ReplicaSync::answered`] takes a pull's answer: a good one records
//!   the peer's decisions in the cluster state, hands over its answers'
//!   first bytes and its session starts (for the gateway's feed,
//!   [`crate::scoring::feed`]) and replaces its loads; a
//!   bad one (no answer, a status, too large, malformed) is counted.
//! - [`ReplicaSync::loads`] is what the live peers have in flight, per pod
//!   slot, for the filters to add to their own; [`ReplicaSync::take_lags`]
//!   the convergence lag of each peer decision made visible since the last
//!   publication (decision on its replica → published here), for the
//!   histogram.

use super::log::{LogHead, ReplicaLog};
use super::peers::{PeerState, PeerTransition, Peers};
use super::wire::{AnswerLimits, FirstByte, LoggedStart};
use crate::cluster::{ClusterState, Failure};
use crate::config::{Config, ReplicasConfig, MAX_PODS};
use crate::polling::ReportPolling;
use crate::scoring::feed::{Answer, FeedRecord, SessionStart};
use crate::snapshot::SlotLoad;

/// Least time between two pulls of one peer: a peer that always has news
/// (a busy replica) is asked at most this often, each answer carrying
/// everything since. 5 ms keeps the lag well under a report interval at
/// ≤ 200 calls a second per peer.
pub const PEER_CALL_GAP_MS: u64 = 5;

/// One pull to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerCall {
    pub address: String,
    /// Path and query, `wait` included.
    pub path: String,
    pub timeout_ms: u64,
}

/// What one answer did.
#[derive(Debug, Clone, Default)]
pub struct PeerOutcome {
    /// Peer decisions recorded.
    pub recorded: usize,
    /// For the gateway's feed ([`crate::scoring::feed`]): the peer's
    /// answers' first bytes on pods this replica knows, by local slot, and
    /// its session starts (origin 0).
    pub feed: Vec<FeedRecord>,
    /// Why the answer was refused, if it was.
    pub error: Option<String>,
    /// The failure's counter label, if it failed.
    pub failure_kind: Option<&'static str>,
    pub transition: Option<PeerTransition>,
}

/// See the module documentation.
pub struct ReplicaSync {
    config: ReplicasConfig,
    log: ReplicaLog,
    peers: Peers,
    polling: ReportPolling,
    max_answer_bytes: usize,
    /// Decision times (their replica's clock) of peer decisions recorded
    /// and not yet published.
    unpublished: Vec<u64>,
}

impl ReplicaSync {
    /// `None` without `replicas` in the configuration. `replica`: this
    /// replica's random id.
    pub fn new(config: &Config, replica: u64) -> Option<ReplicaSync> {
        let replicas = config.replicas.clone()?;
        let log = ReplicaLog::new(replica, config.max_index_blocks.min(super::log::LOG_BLOCKS));
        let mut peers = Peers::new(
            log.head().replica_id(),
            config.pending_decision_ttl_ms(),
            AnswerLimits {
                max_chain: config.max_prefix_blocks,
                max_pods: MAX_PODS,
            },
        );
        peers.set_addresses(&replicas.peers);
        Some(ReplicaSync {
            config: replicas,
            log,
            peers,
            polling: ReportPolling::long_polls(config, PEER_CALL_GAP_MS),
            max_answer_bytes: config.max_report_bytes,
            unpublished: Vec::new(),
        })
    }

    pub fn config(&self) -> &ReplicasConfig {
        &self.config
    }

    pub fn head(&self) -> LogHead {
        self.log.head()
    }

    /// Logs a decision of this replica's own filters for `pod`; returns
    /// the value to store under [`super::log::log_slot`] of its seq.
    pub fn log_decision(
        &mut self,
        pod: &str,
        chain: &[u64],
        predicted_ttft_ms: u32,
        now_ms: u64,
    ) -> (u64, Vec<u8>) {
        self.log.append(pod, chain, predicted_ttft_ms, now_ms)
    }

    /// Logs the first byte of a streamed answer from `pod` that this
    /// replica's filters saw, as [`ReplicaSync::log_decision`] does.
    pub fn log_answer(&mut self, pod: &str, answer: &Answer, now_ms: u64) -> (u64, Vec<u8>) {
        self.log
            .append_first_byte(pod, FirstByte::of(answer), now_ms)
    }

    /// Logs a session start this replica's filters routed to `pod`, as
    /// [`ReplicaSync::log_decision`] does a decision.
    pub fn log_start(&mut self, pod: &str, start: &SessionStart, now_ms: u64) -> (u64, Vec<u8>) {
        let match_end = start.match_end;
        self.log
            .append_start(pod, LoggedStart { match_end }, now_ms)
    }

    /// Follows exactly `addresses` (a discovered list of replicas).
    pub fn set_peers(&mut self, addresses: &[String]) {
        self.peers.set_addresses(addresses);
        self.polling.retain(addresses.iter().map(String::as_str));
    }

    /// The pulls due at `now_ms`.
    pub fn calls(&mut self, now_ms: u64) -> Vec<PeerCall> {
        let path = self.config.path.clone();
        let addresses: Vec<String> = self.peers.to_pull().map(str::to_string).collect();
        addresses
            .into_iter()
            .filter_map(|address| {
                let call = self.polling.next_call(&address, now_ms)?;
                let query = self.peers.query(&address, &path)?;
                Some(PeerCall {
                    path: call.path(&query),
                    timeout_ms: call.timeout_ms,
                    address,
                })
            })
            .collect()
    }

    /// Takes `address`'s answer: `status` (`None`: no answer at all),
    /// the body's size and a reader of its first `n` bytes (called only
    /// for a 200 within `maxReportBytes`).
    pub fn answered(
        &mut self,
        address: &str,
        status: Option<&str>,
        body_size: usize,
        body: impl FnOnce(usize) -> Vec<u8>,
        state: &mut ClusterState,
        now_ms: u64,
    ) -> PeerOutcome {
        self.polling.answered(address, now_ms);
        let failure = match status {
            None => Some(Failure::Unreachable),
            Some("200") if body_size > self.max_answer_bytes => Some(Failure::TooLarge {
                size: body_size,
                limit: self.max_answer_bytes,
            }),
            Some("200") => None,
            Some(code) => Some(Failure::Status(code.parse().unwrap_or(0))),
        };
        if let Some(failure) = failure {
            self.polling.failed(address, now_ms);
            return PeerOutcome {
                error: Some(failure.to_string()),
                failure_kind: Some(failure.kind()),
                transition: self.peers.failed(address),
                ..PeerOutcome::default()
            };
        }
        match self.peers.accept(address, &body(body_size), now_ms) {
            Ok(received) => {
                let mut recorded = 0;
                let mut feed = Vec::new();
                for (decision, at) in &received.decisions {
                    if let Some(first_byte) = decision.first_byte {
                        feed.extend(
                            state
                                .slot(&decision.pod)
                                .map(|slot| FeedRecord::Answer(first_byte.answer(slot))),
                        );
                    } else if let Some(start) = decision.session_start {
                        feed.push(FeedRecord::Start(SessionStart {
                            origin: 0,
                            match_end: start.match_end,
                        }));
                    } else if state.record_peer_decision(
                        &decision.pod,
                        &decision.chain,
                        *at,
                        decision.predicted_ttft_ms,
                    ) {
                        recorded += 1;
                        self.unpublished.push(decision.at_ms);
                    }
                }
                // A peer is kvroute: it holds a pull until it has news, its
                // loads included, so a quick answer without decisions is
                // never a peer ignoring `wait`. Counted as idle, two would
                // drop the peer to interval polling: a lag of
                // `podReportIntervalMs` (2 s shipped) instead of the gap.
                self.polling.folded(address, now_ms, true);
                PeerOutcome {
                    recorded,
                    feed,
                    transition: received.transition,
                    ..PeerOutcome::default()
                }
            }
            Err((why, transition)) => {
                self.polling.failed(address, now_ms);
                PeerOutcome {
                    error: Some(Failure::Malformed(why).to_string()),
                    failure_kind: Some("malformed"),
                    transition,
                    ..PeerOutcome::default()
                }
            }
        }
    }

    /// What the live peers have in flight, by pod slot.
    pub fn loads(&self, state: &ClusterState, now_ms: u64) -> Vec<SlotLoad> {
        state.peer_loads(&self.peers, now_ms)
    }

    /// The lag of every peer decision recorded since the last call, as of
    /// its publication at `now_ms` (both on wall clocks: replicas' clocks
    /// are assumed to agree to a millisecond or so, as NTP keeps them).
    pub fn take_lags(&mut self, now_ms: u64) -> Vec<u64> {
        self.unpublished
            .drain(..)
            .map(|at| now_ms.saturating_sub(at))
            .collect()
    }

    /// Whether every peer has answered once (its whole log) or failed.
    pub fn converged(&self) -> bool {
        self.peers.converged()
    }

    pub fn peer_states(&self) -> impl Iterator<Item = (&str, PeerState)> {
        self.peers.states()
    }
}

#[cfg(test)]
mod tests {
    use super::super::log::{answer, log_slot};
    use super::super::wire::{encode_answer, PodInflight};
    use super::*;
    use crate::index::PrefixLookup;
    use crate::snapshot::SlotLoad;
    use std::collections::HashMap;

    fn config(peers: &[&str]) -> Config {
        let peers: Vec<String> = peers.iter().map(|p| format!("\"{p}\"")).collect();
        Config::parse(
            format!(
                r#"{{"pods": [{{"id": "a", "address": "127.0.0.1:9001"}},
                             {{"id": "b", "address": "127.0.0.1:9002"}}],
                    "mode": "approximate", "podReportIntervalMs": 200, "reportTimeoutMs": 100,
                    "replicas": {{"peers": [{}], "secret": "0123456789abcdef0123456789abcdef"}}}}"#,
                peers.join(",")
            )
            .as_bytes(),
        )
        .expect("valid")
    }

    /// Two replicas, each with its own cluster state, one pulling the other.
    #[test]
    fn a_decision_on_one_replica_is_recorded_on_the_other() {
        let config = config(&["127.0.0.1:9902", "127.0.0.1:9903"]);
        let mut one = ReplicaSync::new(&config, 1).expect("replicas");
        let mut two = ReplicaSync::new(&config, 2).expect("replicas");
        let mut state_one = ClusterState::new(&config, 0);
        let mut state_two = ClusterState::new(&config, 0);
        let mut store_one: HashMap<u64, Vec<u8>> = HashMap::new();
        // Replica one routes a chain to b.
        let b = state_one.slot("b").expect("b");
        let pod = state_one
            .record_decision(b, &[5, 6, 7], 1000, 0)
            .expect("recorded")
            .to_string();
        let (seq, value) = one.log_decision(&pod, &[5, 6, 7], 0, 1000);
        store_one.insert(log_slot(seq), value);
        // Replica two pulls both addresses; one of them is itself.
        let calls = two.calls(1000);
        assert_eq!(calls.len(), 2);
        assert!(calls
            .iter()
            .all(|c| c.path == "/kvroute/v1/replica?since=0&wait=200" && c.timeout_ms == 300));
        assert!(two.calls(1001).is_empty(), "one pull pending per peer");
        let served = |sync: &ReplicaSync, store: &HashMap<u64, Vec<u8>>| {
            encode_answer(&answer(
                sync.head(),
                0,
                None,
                |slot| store.get(&slot).cloned(),
                Vec::new(),
                1010,
                usize::MAX,
            ))
        };
        let from_one = served(&one, &store_one);
        let outcome = two.answered(
            "127.0.0.1:9902",
            Some("200"),
            from_one.len(),
            |_| from_one.clone(),
            &mut state_two,
            1012,
        );
        assert_eq!((outcome.recorded, outcome.error), (1, None));
        let b_two = state_two.slot("b").expect("b");
        assert_eq!(state_two.index().lookup(&[5, 6, 7]).blocks(b_two), 3);
        assert_eq!(two.take_lags(1015), vec![15]);
        assert!(two.take_lags(1016).is_empty());
        let from_two = served(&two, &HashMap::new());
        let outcome = two.answered(
            "127.0.0.1:9903",
            Some("200"),
            from_two.len(),
            |_| from_two.clone(),
            &mut state_two,
            1013,
        );
        assert_eq!(outcome.transition.map(|t| t.to), Some(PeerState::Myself));
        assert!(two.converged());
        // The next pull continues from seq 1 of replica one, not sooner
        // than the gap.
        assert!(two.calls(1000 + PEER_CALL_GAP_MS - 1).is_empty());
        let calls = two.calls(1000 + PEER_CALL_GAP_MS);
        assert_eq!(calls.len(), 1, "not itself");
        assert_eq!(
            calls[0].path,
            format!(
                "/kvroute/v1/replica?since=1&epoch=0000000000000001&loads={:x}&wait=200",
                super::super::wire::loads_digest(&[])
            )
        );
    }

    /// A busy peer answers every pull at once with its loads only; it stays
    /// long-polled at the gap, never falls back to the report interval.
    #[test]
    fn a_peer_answering_loads_only_is_pulled_again_after_the_gap() {
        let config = config(&["127.0.0.1:9902"]);
        let mut sync = ReplicaSync::new(&config, 1).expect("replicas");
        let peer = ReplicaSync::new(&config, 2).expect("replicas");
        let mut state = ClusterState::new(&config, 0);
        let mut now = 1000;
        for round in 0..10 {
            let calls = sync.calls(now);
            assert_eq!(calls.len(), 1, "round {round}: pulled again after the gap");
            assert!(calls[0].path.contains("wait=200"), "{}", calls[0].path);
            // The first answer is the peer's (empty) log in full, the
            // others continue it.
            let epoch = (round > 0).then(|| peer.head().replica_id());
            let body = encode_answer(&answer(
                peer.head(),
                0,
                epoch.as_deref(),
                |_| None,
                vec![super::super::PodInflight {
                    pod: "a".to_string(),
                    load: SlotLoad {
                        requests: round + 1,
                        prefill_tokens: 0,
                        prefill_attention: 0,
                        streams: 1,
                    },
                }],
                now,
                usize::MAX,
            ));
            let outcome = sync.answered(
                "127.0.0.1:9902",
                Some("200"),
                body.len(),
                |_| body.clone(),
                &mut state,
                now + 1,
            );
            assert_eq!(outcome.error, None);
            now += PEER_CALL_GAP_MS;
        }
    }

    #[test]
    fn failed_pulls_are_counted_and_retried_an_interval_later() {
        let config = config(&["127.0.0.1:9902"]);
        let mut sync = ReplicaSync::new(&config, 1).expect("replicas");
        let mut state = ClusterState::new(&config, 0);
        for (i, (status, size, kind)) in [
            (None, 0, "unreachable"),
            (Some("503"), 0, "status"),
            (Some("200"), usize::MAX, "too_large"),
            (Some("200"), 3, "malformed"),
        ]
        .into_iter()
        .enumerate()
        {
            let now = 10_000 * (i as u64 + 1);
            assert_eq!(sync.calls(now).len(), 1);
            let outcome = sync.answered(
                "127.0.0.1:9902",
                status,
                size,
                |_| b"{}x".to_vec(),
                &mut state,
                now,
            );
            assert_eq!(outcome.failure_kind, Some(kind));
            assert!(
                sync.calls(now + 199).is_empty(),
                "retried an interval later"
            );
            assert_eq!(sync.calls(now + 200).len(), 1);
            sync.answered(
                "127.0.0.1:9902",
                None,
                0,
                |_| Vec::new(),
                &mut state,
                now + 200,
            );
        }
        assert!(sync.converged(), "a failing peer is nothing to wait for");
    }

    /// A pool of 1,024 pods listed in opposite orders on two replicas, so
    /// a pod's slot differs between them and passes one byte: decisions
    /// and in-flight loads travel by pod id, and each replica counts them
    /// at its own slot for that pod; an answer naming every pod's load is
    /// within the limits.
    #[test]
    fn decisions_and_loads_past_slot_255_land_on_the_receiver_s_slot() {
        let config = |order: &mut dyn Iterator<Item = usize>| {
            let pods: Vec<serde_json::Value> = order
                .map(|i| {
                    serde_json::json!({"id": format!("pod-{i}"),
                                       "address": format!("10.0.{}.{}:8000", i / 256, i % 256)})
                })
                .collect();
            // A small index: the test needs three blocks, and the wasm
            // build of the tests runs in one linear memory.
            let json = serde_json::json!({"pods": pods, "mode": "approximate",
                "maxIndexBlocks": 8192, "podReportIntervalMs": 200, "reportTimeoutMs": 100,
                "replicas": {"peers": ["127.0.0.1:9902"], "secret": "0123456789abcdef0123456789abcdef"}});
            Config::parse(json.to_string().as_bytes()).expect("valid")
        };
        let (config_one, config_two) = (config(&mut (0..1024)), config(&mut (0..1024).rev()));
        let mut one = ReplicaSync::new(&config_one, 1).expect("replicas");
        let mut two = ReplicaSync::new(&config_two, 2).expect("replicas");
        let mut state_one = ClusterState::new(&config_one, 0);
        let mut state_two = ClusterState::new(&config_two, 0);
        assert_eq!(state_one.slot("pod-700"), Some(700));
        assert_eq!(state_two.slot("pod-700"), Some(323));
        let pod = state_one
            .record_decision(700, &[5, 6, 7], 1000, 0)
            .expect("recorded")
            .to_string();
        let (seq, value) = one.log_decision(&pod, &[5, 6, 7], 0, 1000);
        let inflight: Vec<PodInflight> = (0..1024)
            .map(|i| PodInflight {
                pod: format!("pod-{i}"),
                load: SlotLoad {
                    requests: 1,
                    prefill_tokens: i,
                    prefill_attention: 0,
                    streams: 1,
                },
            })
            .collect();
        let body = encode_answer(&answer(
            one.head(),
            0,
            None,
            |slot| (slot == log_slot(seq)).then(|| value.clone()),
            inflight,
            1010,
            usize::MAX,
        ));
        assert_eq!(two.calls(1000).len(), 1);
        let outcome = two.answered(
            "127.0.0.1:9902",
            Some("200"),
            body.len(),
            |_| body.clone(),
            &mut state_two,
            1012,
        );
        assert_eq!((outcome.recorded, outcome.error), (1, None));
        assert_eq!(state_two.index().lookup(&[5, 6, 7]).blocks(323), 3);
        let loads = two.loads(&state_two, 1012);
        assert_eq!(loads.len(), 1024);
        for i in [0u32, 3, 255, 256, 700, 1023] {
            let slot = state_two.slot(&format!("pod-{i}")).expect("known");
            assert_eq!(slot, 1023 - i as usize);
            assert_eq!((loads[slot].requests, loads[slot].prefill_tokens), (1, i));
        }
    }
}
