//! [`Peers`]: the other replicas a replica pulls, and what each has sent
//! that still counts.
//!
//! Per peer address (from `replicas.peers`, or the members of
//! `replicas.cluster` as Envoy knows them), one long-poll is kept pending,
//! as for a pod's report: `?since=SEQ&epoch=REPLICA&loads=DIGEST&wait=MS`,
//! where REPLICA, SEQ and the loads' DIGEST are what the peer last
//! answered ([`Peers::query`]).
//! An answer ([`Peers::accept`]):
//! - naming this replica's own id is this replica (a peer list holds
//!   every replica, this one included): the address is marked
//!   [`PeerState::Myself`] and no longer asked;
//! - is checked whole ([`super::wire::parse_answer`]); a delta must
//!   continue the seq asked. A bad answer is a failure, counted and
//!   ignored, as a hostile pod's report is;
//! - hands its decisions to the caller, each stamped with the local time
//!   it was made at (now − its age on the sender's clock), to be recorded
//!   as the replica's own would be;
//! - replaces the peer's in-flight loads, which count for routing while
//!   the peer answered within `ttl` (two report intervals plus the report
//!   timeout: a live peer answers a long-poll at least once an interval).
//!   A peer that dies or is cut off thus stops counting within `ttl`; its
//!   pending decisions expire as the replica's own do.
//!
//! A replica is *converged* once every peer has answered it (its first
//! answer is the peer's whole log, `full`) or failed: until then it routes
//! on what it has. Nothing waits on a peer: answers arrive as the host
//! delivers them, and a slow peer delays only its own decisions.

use std::collections::BTreeMap;

use super::wire::{loads_digest, parse_answer, AnswerLimits, LoggedDecision, PodInflight};

/// Most peer addresses followed.
pub const MAX_PEERS: usize = 64;

/// Where a peer stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerState {
    /// Asked, never answered yet.
    Syncing,
    /// Answered; its decisions and loads count.
    Live,
    /// Its last call failed (unreachable, bad status, bad answer).
    Failing,
    /// This replica itself.
    Myself,
}

impl PeerState {
    pub fn name(self) -> &'static str {
        match self {
            PeerState::Syncing => "syncing",
            PeerState::Live => "live",
            PeerState::Failing => "failing",
            PeerState::Myself => "self",
        }
    }

    /// The value of `epp_replica_peer_state`: 0 syncing, 1 live, 2
    /// failing, 3 this replica itself.
    pub fn code(self) -> u64 {
        match self {
            PeerState::Syncing => 0,
            PeerState::Live => 1,
            PeerState::Failing => 2,
            PeerState::Myself => 3,
        }
    }

    /// Every state, for gauges defined from zero.
    pub const ALL: [PeerState; 4] = [
        PeerState::Syncing,
        PeerState::Live,
        PeerState::Failing,
        PeerState::Myself,
    ];
}

#[derive(Debug, Clone)]
struct Peer {
    replica: Option<String>,
    seq: u64,
    state: PeerState,
    last_answer_ms: Option<u64>,
    inflight: Vec<PodInflight>,
}

/// A peer's state changed (logged once, not per call).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerTransition {
    pub address: String,
    pub from: PeerState,
    pub to: PeerState,
    /// The peer's replica id, when it changed (a new or restarted replica).
    pub replica: Option<String>,
}

/// What a good answer brought.
#[derive(Debug, Clone, Default)]
pub struct Received {
    /// Each decision, with the local time it was made at.
    pub decisions: Vec<(LoggedDecision, u64)>,
    pub full: bool,
    pub transition: Option<PeerTransition>,
}

/// See the module documentation.
pub struct Peers {
    own: String,
    peers: BTreeMap<String, Peer>,
    ttl_ms: u64,
    limits: AnswerLimits,
}

impl Peers {
    /// `own`: this replica's id, as its log serves it.
    pub fn new(own: String, ttl_ms: u64, limits: AnswerLimits) -> Peers {
        Peers {
            own,
            peers: BTreeMap::new(),
            ttl_ms,
            limits,
        }
    }

    /// Follows exactly `addresses` (at most [`MAX_PEERS`]): new ones start
    /// syncing, gone ones are forgotten with their loads.
    pub fn set_addresses(&mut self, addresses: &[String]) {
        let keep: Vec<&String> = addresses.iter().take(MAX_PEERS).collect();
        self.peers.retain(|address, _| keep.contains(&address));
        for address in keep {
            self.peers.entry(address.clone()).or_insert(Peer {
                replica: None,
                seq: 0,
                state: PeerState::Syncing,
                last_answer_ms: None,
                inflight: Vec::new(),
            });
        }
    }

    /// The addresses to pull (not this replica's own).
    pub fn to_pull(&self) -> impl Iterator<Item = &str> {
        self.peers
            .iter()
            .filter(|(_, p)| p.state != PeerState::Myself)
            .map(|(address, _)| address.as_str())
    }

    /// Every followed address and its state.
    pub fn states(&self) -> impl Iterator<Item = (&str, PeerState)> {
        self.peers.iter().map(|(a, p)| (a.as_str(), p.state))
    }

    /// Path and query of the next pull of `address`.
    pub fn query(&self, address: &str, path: &str) -> Option<String> {
        let peer = self.peers.get(address)?;
        Some(match &peer.replica {
            Some(replica) => format!(
                "{path}?since={}&epoch={replica}&loads={:x}",
                peer.seq,
                loads_digest(&peer.inflight)
            ),
            None => format!("{path}?since=0"),
        })
    }

    /// Takes `address`'s answer at local time `now_ms`; an error says what
    /// was wrong with it (the peer is then failing).
    pub fn accept(
        &mut self,
        address: &str,
        body: &[u8],
        now_ms: u64,
    ) -> Result<Received, (String, Option<PeerTransition>)> {
        let answer = match parse_answer(body, self.limits) {
            Ok(answer) => answer,
            Err(why) => return Err((why, self.failed(address))),
        };
        let own = answer.replica == self.own;
        let Some(peer) = self.peers.get_mut(address) else {
            return Ok(Received::default());
        };
        let from = peer.state;
        if own {
            peer.state = PeerState::Myself;
            peer.inflight.clear();
            return Ok(Received {
                transition: Some(PeerTransition {
                    address: address.to_string(),
                    from,
                    to: PeerState::Myself,
                    replica: None,
                }),
                ..Received::default()
            });
        }
        let same_replica = peer.replica.as_deref() == Some(answer.replica.as_str());
        if !answer.full && (!same_replica || answer.since != peer.seq) {
            let why = format!(
                "a delta since {} does not continue the seq asked ({} of {})",
                answer.since,
                peer.seq,
                peer.replica.as_deref().unwrap_or("no replica yet")
            );
            return Err((why, self.failed(address)));
        }
        peer.seq = answer.seq;
        peer.state = PeerState::Live;
        peer.last_answer_ms = Some(now_ms);
        peer.inflight = answer.inflight;
        let decisions = answer
            .decisions
            .into_iter()
            .map(|d| {
                let age = answer.sent_at_ms.saturating_sub(d.at_ms);
                let at = now_ms.saturating_sub(age);
                (d, at)
            })
            .collect();
        let transition = (from != PeerState::Live || !same_replica).then(|| PeerTransition {
            address: address.to_string(),
            from,
            to: PeerState::Live,
            replica: (!same_replica).then(|| answer.replica.clone()),
        });
        peer.replica = Some(answer.replica);
        Ok(Received {
            decisions,
            full: answer.full,
            transition,
        })
    }

    /// `address`'s call failed (no answer, a bad status, a bad answer).
    pub fn failed(&mut self, address: &str) -> Option<PeerTransition> {
        let peer = self.peers.get_mut(address)?;
        if peer.state == PeerState::Myself || peer.state == PeerState::Failing {
            return None;
        }
        let from = peer.state;
        peer.state = PeerState::Failing;
        Some(PeerTransition {
            address: address.to_string(),
            from,
            to: PeerState::Failing,
            replica: None,
        })
    }

    /// The in-flight loads of every peer that answered within the ttl.
    pub fn loads(&self, now_ms: u64) -> impl Iterator<Item = &PodInflight> {
        self.peers
            .values()
            .filter(move |p| {
                p.state != PeerState::Myself
                    && p.last_answer_ms
                        .is_some_and(|at| now_ms.saturating_sub(at) <= self.ttl_ms)
            })
            .flat_map(|p| &p.inflight)
    }

    /// Whether every peer has answered (its whole log came first) or
    /// failed: nothing is left to catch up from.
    pub fn converged(&self) -> bool {
        self.peers.values().all(|p| p.state != PeerState::Syncing)
    }
}

#[cfg(test)]
mod tests {
    use super::super::wire::{encode_answer, ReplicaAnswer};
    use super::*;
    use crate::snapshot::SlotLoad;

    const LIMITS: AnswerLimits = AnswerLimits {
        max_chain: 2048,
        max_pods: 64,
    };

    fn peers() -> Peers {
        let mut peers = Peers::new("0000000000000aaa".into(), 1000, LIMITS);
        peers.set_addresses(&["10.0.0.1:9902".into(), "10.0.0.2:9902".into()]);
        peers
    }

    fn answer(replica: &str, since: u64, seq: u64, full: bool) -> Vec<u8> {
        encode_answer(&ReplicaAnswer {
            replica: replica.into(),
            seq,
            since,
            full,
            sent_at_ms: 10_000,
            decisions: (since + 1..=seq)
                .map(|s| LoggedDecision {
                    seq: s,
                    pod: "pod-a".into(),
                    at_ms: 10_000 - 5,
                    chain: vec![s],
                    predicted_ttft_ms: 0,
                    first_byte: None,
                    session_start: None,
                })
                .collect(),
            inflight: vec![PodInflight {
                pod: "pod-a".into(),
                load: SlotLoad {
                    requests: 2,
                    prefill_tokens: 300,
                    prefill_attention: 0,
                    streams: 1,
                },
            }],
        })
    }

    #[test]
    fn a_peer_syncs_in_full_then_follows_deltas() {
        let mut peers = peers();
        assert!(!peers.converged());
        assert_eq!(
            peers.query("10.0.0.1:9902", "/log").as_deref(),
            Some("/log?since=0")
        );
        let got = peers
            .accept("10.0.0.1:9902", &answer("bbb", 0, 3, true), 500)
            .expect("good answer");
        assert!(got.full);
        assert_eq!(got.decisions.len(), 3);
        assert_eq!(got.decisions[0].1, 495, "made 5 ms before it was sent");
        let transition = got.transition.expect("joined");
        assert_eq!(
            (
                transition.from,
                transition.to,
                transition.replica.as_deref()
            ),
            (PeerState::Syncing, PeerState::Live, Some("bbb"))
        );
        assert_eq!(
            peers.query("10.0.0.1:9902", "/log").as_deref(),
            Some(format!(
                "/log?since=3&epoch=bbb&loads={:x}",
                loads_digest(&[PodInflight {
                    pod: "pod-a".into(),
                    load: SlotLoad {
                        requests: 2,
                        prefill_tokens: 300,
                        prefill_attention: 0,
                        streams: 1,
                    },
                }])
            ))
            .as_deref()
        );
        let got = peers
            .accept("10.0.0.1:9902", &answer("bbb", 3, 4, false), 600)
            .expect("delta");
        assert_eq!(got.decisions.len(), 1);
        assert!(got.transition.is_none(), "said once");
        assert!(!peers.converged(), "the other peer has not answered");
        assert!(peers.failed("10.0.0.2:9902").is_some());
        assert!(peers.failed("10.0.0.2:9902").is_none(), "said once");
        assert!(
            peers.converged(),
            "a failing peer has nothing to catch up from"
        );
    }

    #[test]
    fn its_own_answer_marks_the_replica_itself() {
        let mut peers = peers();
        let got = peers
            .accept("10.0.0.2:9902", &answer("0000000000000aaa", 0, 2, true), 0)
            .expect("good answer");
        assert!(
            got.decisions.is_empty(),
            "its own decisions are not learnt again"
        );
        assert_eq!(got.transition.map(|t| t.to), Some(PeerState::Myself));
        assert_eq!(peers.to_pull().collect::<Vec<_>>(), vec!["10.0.0.1:9902"]);
    }

    #[test]
    fn loads_count_while_the_peer_answers() {
        let mut peers = peers();
        peers
            .accept("10.0.0.1:9902", &answer("bbb", 0, 1, true), 1000)
            .expect("good");
        let loads: Vec<&PodInflight> = peers.loads(1500).collect();
        assert_eq!(loads.len(), 1);
        assert_eq!(
            (loads[0].load.requests, loads[0].load.prefill_tokens),
            (2, 300)
        );
        assert_eq!(peers.loads(2001).count(), 0, "silent past the ttl");
    }

    #[test]
    fn a_restarted_peer_is_followed_from_its_new_log() {
        let mut peers = peers();
        peers
            .accept("10.0.0.1:9902", &answer("bbb", 0, 5, true), 0)
            .expect("good");
        let got = peers
            .accept("10.0.0.1:9902", &answer("ccc", 0, 2, true), 10)
            .expect("new epoch, full");
        assert_eq!(
            got.transition.and_then(|t| t.replica).as_deref(),
            Some("ccc")
        );
        assert_eq!(
            peers.query("10.0.0.1:9902", "/log").as_deref(),
            Some(format!(
                "/log?since=2&epoch=ccc&loads={:x}",
                loads_digest(&[PodInflight {
                    pod: "pod-a".into(),
                    load: SlotLoad {
                        requests: 2,
                        prefill_tokens: 300,
                        prefill_attention: 0,
                        streams: 1,
                    },
                }])
            ))
            .as_deref()
        );
    }

    #[test]
    fn garbage_and_broken_deltas_are_failures() {
        let mut peers = peers();
        let (why, transition) = peers
            .accept("10.0.0.1:9902", b"{\"version\": 1}", 0)
            .expect_err("refused");
        assert!(why.contains("malformed replica answer"), "{why}");
        assert_eq!(transition.map(|t| t.to), Some(PeerState::Failing));
        peers
            .accept("10.0.0.1:9902", &answer("bbb", 0, 5, true), 0)
            .expect("good");
        let (why, _) = peers
            .accept("10.0.0.1:9902", &answer("bbb", 3, 6, false), 0)
            .expect_err("a gap");
        assert!(
            why.contains("does not continue the seq asked (5 of bbb)"),
            "{why}"
        );
        let (why, _) = peers
            .accept("10.0.0.1:9902", &answer("ddd", 5, 6, false), 0)
            .expect_err("another replica's delta");
        assert!(why.contains("does not continue"), "{why}");
    }

    #[test]
    fn peers_are_bounded_and_follow_the_address_list() {
        let mut peers = peers();
        let many: Vec<String> = (0..100).map(|i| format!("10.1.0.{i}:9902")).collect();
        peers.set_addresses(&many);
        assert_eq!(peers.states().count(), MAX_PEERS);
        assert!(peers.query("10.0.0.1:9902", "/log").is_none(), "forgotten");
    }
}
