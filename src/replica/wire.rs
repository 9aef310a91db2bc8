//! The replica channel's wire format: what one replica answers a peer that
//! pulls its log (`GET {replicas.path}?since=SEQ&epoch=E&wait=MS`, header
//! [`REPLICA_KEY_HEADER`]), in the shape of report protocol v1:
//!
//! ```json
//! {"version": 1, "replica": "5e0c9a1f2b3d4e6f", "seq": 42, "since": 40, "full": false,
//!  "sentAtMs": 1764680000123,
//!  "decisions": [{"seq": 41, "pod": "pod-a", "atMs": 1764680000101,
//!                 "chain": ["0123456789abcdef", "..."], "predictedTtftMs": 850},
//!                {"seq": 42, "pod": "pod-b", "atMs": 1764680000110,
//!                 "firstByte": {"workTokens": 1500, "ownTokens": 500, "ttftMs": 42.5,
//!                               "attention": 2100, "ownAttention": 900}},
//!                {"seq": 43, "pod": "pod-b", "atMs": 1764680000115,
//!                 "sessionStart": {"matchEnd": "0123456789abcdef"}}],
//!  "inflight": [{"pod": "pod-a", "requests": 3, "prefillTokens": 1024,
//!   "prefillAttention": 4096, "streams": 5}]}
//! ```
//!
//! - `replica` names the replica process (a random id drawn at start) and
//!   doubles as the log's epoch; `seq` counts its log's entries.
//! - An entry is one of three, never two at once: a routing decision
//!   (`chain`); the first byte of one's streamed answer (`firstByte`: the
//!   prefill work at its decision, of which `ownTokens` its own, at most
//!   `workTokens`, their attention and its own in units of 1,024 token
//!   pairs, [`crate::scoring::ttft::attention`], and the TTFT it took, what
//!   every replica's TTFT model learns from); or a session start routed to `pod` (`sessionStart`,
//!   with the block its longest cached match ended at, `matchEnd`, absent
//!   when nothing was cached anywhere; what every replica's prefix-demand
//!   count takes, [`crate::scoring::feed`]). A replica that predates
//!   `sessionStart` refuses answers that carry it, as it does `streams`
//!   below. A decision's
//!   `predictedTtftMs` (optional, 0 when absent) is when its pod is
//!   predicted to have prefilled the chain: its pending entry counts until
//!   `pendingDecisionMs` after that, on every replica
//!   ([`crate::index::DecisionRecorder`]).
//! - A delta (`full: false`) carries the decisions after `since` of the
//!   same replica; `full: true` carries every decision the log still holds
//!   (a new peer, another epoch, or a `since` older than the log).
//! - `atMs` is the decision's wall-clock time on its replica (Unix ms) and
//!   `sentAtMs` the answer's, so a receiver learns a decision's age on the
//!   sender's clock (`sentAtMs − atMs`) without trusting clock agreement.
//! - `inflight` is the sender's own requests in flight per pod (state, not
//!   events: each answer replaces the last), with their prompt tokens still
//!   to prefill (and their attention) and the streams open (`streams`: answering or not; absent,
//!   as from a replica that predates it, it reads as `requests`; such a
//!   replica refuses answers that carry it, so a rollout's mixed replicas
//!   do not share state until it ends). The attention fields read 0 when
//!   absent; a replica that predates them refuses answers that carry them.
//! - Hashes are 16 lowercase hex digits, as in report protocol v1.
//!
//! Parsing is strict and bounded ([`AnswerLimits`]): a peer is as untrusted
//! as a pod, so a malformed answer is refused whole, naming what is wrong,
//! and counted by the service.

use serde::{Deserialize, Serialize};

use crate::report::hash_to_hex;
use crate::scoring::feed::Answer;
use crate::scoring::ttft::Work;
use crate::snapshot::SlotLoad;

/// The request header carrying the replicas' shared secret.
pub const REPLICA_KEY_HEADER: &str = "x-kvroute-replica-key";

/// Longest pod id a peer may name (ids are addresses or configured names).
const MAX_POD_ID_BYTES: usize = 256;

/// Longest replica id a peer may send.
const MAX_REPLICA_ID_BYTES: usize = 64;

/// One entry of a replica's log as it logs and serves it: a routing
/// decision (its `chain`), or the first byte of one's streamed answer
/// (`first_byte`, with an empty chain), which every replica's TTFT model
/// learns from ([`crate::scoring::feed`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LoggedDecision {
    pub seq: u64,
    /// The pod's id (slots differ between replicas).
    pub pod: String,
    /// Wall-clock time of the decision (or answer) on its replica, Unix ms.
    pub at_ms: u64,
    pub chain: Vec<u64>,
    /// A decision's predicted TTFT on its pod (0 for a first byte).
    pub predicted_ttft_ms: u32,
    pub first_byte: Option<FirstByte>,
    pub session_start: Option<LoggedStart>,
}

/// A session start a replica routed: its longest cached match ended at
/// block `match_end` (`None`: nothing cached anywhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoggedStart {
    pub match_end: Option<u64>,
}

/// A streamed answer's first byte: `work_tokens` of prefill at its
/// decision, of which `own_tokens` its own (the rest queued ahead), with
/// `attention` and `own_attention` ([`Work`]), took `ttft_ms`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FirstByte {
    pub work_tokens: u32,
    pub own_tokens: u32,
    pub attention: u32,
    pub own_attention: u32,
    pub ttft_ms: f32,
}

impl FirstByte {
    /// What a replica sends of one of its answers.
    pub fn of(answer: &Answer) -> FirstByte {
        FirstByte {
            work_tokens: answer.work_tokens,
            own_tokens: answer.own_tokens,
            attention: answer.attention,
            own_attention: answer.own_attention,
            ttft_ms: answer.ttft_ms,
        }
    }

    /// The answer it stands for, from pod `slot` of the receiver.
    pub fn answer(self, slot: usize) -> Answer {
        let work = Work {
            tokens: self.work_tokens.into(),
            own_tokens: self.own_tokens.into(),
            attention: self.attention.into(),
            own_attention: self.own_attention.into(),
        };
        Answer::new(slot, work, self.ttft_ms.into())
    }
}

/// Longest TTFT a peer may report: an hour (anything longer is not a
/// measurement the model should learn from).
const MAX_TTFT_MS: f32 = 3_600_000.0;

/// A replica's own requests in flight to one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInflight {
    pub pod: String,
    pub load: SlotLoad,
}

/// One answer of a replica's log.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaAnswer {
    pub replica: String,
    pub seq: u64,
    pub since: u64,
    pub full: bool,
    pub sent_at_ms: u64,
    pub decisions: Vec<LoggedDecision>,
    pub inflight: Vec<PodInflight>,
}

/// What a receiver accepts of a peer's answer.
#[derive(Debug, Clone, Copy)]
pub struct AnswerLimits {
    /// Longest chain of one decision (`maxPrefixBlocks`).
    pub max_chain: usize,
    /// Most pods named in `inflight`.
    pub max_pods: usize,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WireDecision<'a> {
    seq: u64,
    #[serde(borrow)]
    pod: &'a str,
    at_ms: u64,
    #[serde(borrow, default, skip_serializing_if = "Vec::is_empty")]
    chain: Vec<&'a str>,
    #[serde(default, skip_serializing_if = "is_zero")]
    predicted_ttft_ms: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    first_byte: Option<WireFirstByte>,
    #[serde(borrow, default, skip_serializing_if = "Option::is_none")]
    session_start: Option<WireStart<'a>>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WireStart<'a> {
    #[serde(borrow, default, skip_serializing_if = "Option::is_none")]
    match_end: Option<&'a str>,
}

fn is_zero(value: &u32) -> bool {
    *value == 0
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WireFirstByte {
    work_tokens: u32,
    own_tokens: u32,
    ttft_ms: f32,
    /// Absent from a replica that predates them.
    #[serde(default)]
    attention: u32,
    #[serde(default)]
    own_attention: u32,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WireInflight<'a> {
    #[serde(borrow)]
    pod: &'a str,
    requests: u32,
    prefill_tokens: u32,
    /// Absent from a replica that predates it.
    #[serde(default)]
    prefill_attention: u32,
    /// Absent from a replica that predates it (counted as `requests`).
    #[serde(default)]
    streams: Option<u32>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireAnswer<'a> {
    version: u32,
    #[serde(borrow)]
    replica: &'a str,
    seq: u64,
    since: u64,
    full: bool,
    sent_at_ms: u64,
    #[serde(borrow)]
    decisions: Vec<WireDecision<'a>>,
    #[serde(borrow)]
    inflight: Vec<WireInflight<'a>>,
}

/// A digest of in-flight loads, as a pull names the loads its peer last
/// sent (`loads=`): the peer answers a held pull as soon as its own loads
/// differ from them, not only when it logs a decision.
pub fn loads_digest(loads: &[PodInflight]) -> u64 {
    let mut bytes = Vec::with_capacity(loads.len() * 24);
    for load in loads {
        bytes.extend_from_slice(load.pod.as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(&load.load.to_le_bytes());
    }
    xxhash_rust::xxh64::xxh64(&bytes, 0)
}

/// The answer as JSON.
pub fn encode_answer(answer: &ReplicaAnswer) -> Vec<u8> {
    let hex: Vec<Vec<String>> = answer
        .decisions
        .iter()
        .map(|d| d.chain.iter().map(|&h| hash_to_hex(h)).collect())
        .collect();
    let match_ends: Vec<Option<String>> = answer
        .decisions
        .iter()
        .map(|d| d.session_start.and_then(|s| s.match_end).map(hash_to_hex))
        .collect();
    let wire = WireAnswer {
        version: 1,
        replica: &answer.replica,
        seq: answer.seq,
        since: answer.since,
        full: answer.full,
        sent_at_ms: answer.sent_at_ms,
        decisions: answer
            .decisions
            .iter()
            .zip(&hex)
            .zip(&match_ends)
            .map(|((d, chain), match_end)| WireDecision {
                seq: d.seq,
                pod: &d.pod,
                at_ms: d.at_ms,
                chain: chain.iter().map(String::as_str).collect(),
                predicted_ttft_ms: d.predicted_ttft_ms,
                first_byte: d.first_byte.map(|f| WireFirstByte {
                    work_tokens: f.work_tokens,
                    own_tokens: f.own_tokens,
                    ttft_ms: f.ttft_ms,
                    attention: f.attention,
                    own_attention: f.own_attention,
                }),
                session_start: d.session_start.map(|_| WireStart {
                    match_end: match_end.as_deref(),
                }),
            })
            .collect(),
        inflight: answer
            .inflight
            .iter()
            .map(|i| WireInflight {
                pod: &i.pod,
                requests: i.load.requests,
                prefill_tokens: i.load.prefill_tokens,
                prefill_attention: i.load.prefill_attention,
                streams: Some(i.load.streams),
            })
            .collect(),
    };
    // Serialising plain structs of strings and integers cannot fail.
    serde_json::to_vec(&wire).unwrap_or_default()
}

fn parse_hash(text: &str) -> Result<u64, String> {
    if text.len() != 16 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("hash {text:?} must be 16 hex digits"));
    }
    u64::from_str_radix(text, 16).map_err(|_| format!("hash {text:?} is not hex"))
}

fn check_pod_id(pod: &str, field: &str) -> Result<(), String> {
    if pod.is_empty() || pod.len() > MAX_POD_ID_BYTES {
        return Err(format!(
            "`{field}` must be a pod id of 1 to {MAX_POD_ID_BYTES} bytes"
        ));
    }
    Ok(())
}

/// Parses and validates a peer's answer; the error names what is wrong.
pub fn parse_answer(body: &[u8], limits: AnswerLimits) -> Result<ReplicaAnswer, String> {
    let wire: WireAnswer =
        serde_json::from_slice(body).map_err(|e| format!("malformed replica answer: {e}"))?;
    if wire.version != 1 {
        return Err(format!("`version` must be 1 (got {})", wire.version));
    }
    if wire.replica.is_empty() || wire.replica.len() > MAX_REPLICA_ID_BYTES {
        return Err(format!(
            "`replica` must be an id of 1 to {MAX_REPLICA_ID_BYTES} bytes"
        ));
    }
    if wire.since > wire.seq {
        return Err(format!(
            "`since` ({}) is past `seq` ({})",
            wire.since, wire.seq
        ));
    }
    if wire.inflight.len() > limits.max_pods {
        return Err(format!(
            "`inflight` names {} pods, more than the {} a pool may have",
            wire.inflight.len(),
            limits.max_pods
        ));
    }
    let mut previous = if wire.full { 0 } else { wire.since };
    let mut decisions = Vec::with_capacity(wire.decisions.len());
    for (i, d) in wire.decisions.iter().enumerate() {
        if d.seq <= previous || d.seq > wire.seq {
            return Err(format!(
                "`decisions[{i}].seq` ({}) must rise within ({previous}, {}]",
                d.seq, wire.seq
            ));
        }
        previous = d.seq;
        check_pod_id(d.pod, &format!("decisions[{i}].pod"))?;
        let session_start = match &d.session_start {
            None => None,
            Some(_) if !d.chain.is_empty() || d.predicted_ttft_ms != 0 || d.first_byte.is_some() => {
                return Err(format!(
                    "`decisions[{i}]` carries a `sessionStart` and a `chain`, `predictedTtftMs` or `firstByte`"
                ))
            }
            Some(start) => Some(LoggedStart {
                match_end: start
                    .match_end
                    .map(parse_hash)
                    .transpose()
                    .map_err(|e| format!("`decisions[{i}].sessionStart.matchEnd`: {e}"))?,
            }),
        };
        let first_byte = match &d.first_byte {
            _ if session_start.is_some() => None,
            Some(_) if !d.chain.is_empty() => {
                return Err(format!(
                    "`decisions[{i}]` carries both a `chain` and a `firstByte`"
                ))
            }
            Some(_) if d.predicted_ttft_ms != 0 => {
                return Err(format!(
                    "`decisions[{i}]` carries both a `predictedTtftMs` and a `firstByte`"
                ))
            }
            Some(f) if !(f.ttft_ms > 0.0 && f.ttft_ms <= MAX_TTFT_MS) => {
                return Err(format!(
                    "`decisions[{i}].firstByte.ttftMs` must be in (0, {MAX_TTFT_MS}] (got {})",
                    f.ttft_ms
                ))
            }
            Some(f) if f.own_tokens > f.work_tokens => {
                return Err(format!(
                    "`decisions[{i}].firstByte.ownTokens` must be at most its `workTokens` ({}, got {})",
                    f.work_tokens, f.own_tokens
                ))
            }
            Some(f) => Some(FirstByte {
                work_tokens: f.work_tokens,
                own_tokens: f.own_tokens,
                attention: f.attention,
                own_attention: f.own_attention,
                ttft_ms: f.ttft_ms,
            }),
            None if d.chain.is_empty() || d.chain.len() > limits.max_chain => {
                return Err(format!(
                    "`decisions[{i}].chain` must hold 1 to {} hashes (got {})",
                    limits.max_chain,
                    d.chain.len()
                ))
            }
            None if d.predicted_ttft_ms as f32 > MAX_TTFT_MS => {
                return Err(format!(
                    "`decisions[{i}].predictedTtftMs` must be at most {MAX_TTFT_MS} (got {})",
                    d.predicted_ttft_ms
                ))
            }
            None => None,
        };
        let chain = d
            .chain
            .iter()
            .map(|h| parse_hash(h))
            .collect::<Result<Vec<u64>, String>>()
            .map_err(|e| format!("`decisions[{i}].chain`: {e}"))?;
        decisions.push(LoggedDecision {
            seq: d.seq,
            pod: d.pod.to_string(),
            at_ms: d.at_ms,
            chain,
            predicted_ttft_ms: d.predicted_ttft_ms,
            first_byte,
            session_start,
        });
    }
    let inflight = wire
        .inflight
        .iter()
        .enumerate()
        .map(|(i, p)| {
            check_pod_id(p.pod, &format!("inflight[{i}].pod"))?;
            Ok(PodInflight {
                pod: p.pod.to_string(),
                load: SlotLoad {
                    requests: p.requests,
                    prefill_tokens: p.prefill_tokens,
                    prefill_attention: p.prefill_attention,
                    streams: p.streams.unwrap_or(p.requests),
                },
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(ReplicaAnswer {
        replica: wire.replica.to_string(),
        seq: wire.seq,
        since: wire.since,
        full: wire.full,
        sent_at_ms: wire.sent_at_ms,
        decisions,
        inflight,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: AnswerLimits = AnswerLimits {
        max_chain: 2048,
        max_pods: 64,
    };

    fn answer() -> ReplicaAnswer {
        ReplicaAnswer {
            replica: "5e0c9a1f2b3d4e6f".into(),
            seq: 44,
            since: 40,
            full: false,
            sent_at_ms: 1_764_680_000_123,
            decisions: vec![
                LoggedDecision {
                    seq: 41,
                    pod: "pod-a".into(),
                    at_ms: 1_764_680_000_101,
                    chain: vec![1, u64::MAX, 0x0123_4567_89ab_cdef],
                    predicted_ttft_ms: 850,
                    first_byte: None,
                    session_start: None,
                },
                LoggedDecision {
                    seq: 42,
                    pod: "10.0.0.7:8000".into(),
                    at_ms: 1_764_680_000_120,
                    chain: Vec::new(),
                    predicted_ttft_ms: 0,
                    first_byte: Some(FirstByte {
                        work_tokens: 1500,
                        own_tokens: 500,
                        attention: 2100,
                        own_attention: 900,
                        ttft_ms: 42.5,
                    }),
                    session_start: None,
                },
                LoggedDecision {
                    seq: 43,
                    pod: "pod-b".into(),
                    at_ms: 1_764_680_000_121,
                    chain: Vec::new(),
                    predicted_ttft_ms: 0,
                    first_byte: None,
                    session_start: Some(LoggedStart {
                        match_end: Some(0x0123_4567_89ab_cdef),
                    }),
                },
                LoggedDecision {
                    seq: 44,
                    pod: "pod-a".into(),
                    at_ms: 1_764_680_000_122,
                    chain: Vec::new(),
                    predicted_ttft_ms: 0,
                    first_byte: None,
                    session_start: Some(LoggedStart { match_end: None }),
                },
            ],
            inflight: vec![PodInflight {
                pod: "pod-a".into(),
                load: SlotLoad {
                    requests: 3,
                    prefill_tokens: 1024,
                    prefill_attention: 4096,
                    streams: 1,
                },
            }],
        }
    }

    #[test]
    fn an_answer_survives_the_wire() {
        let bytes = encode_answer(&answer());
        let text = String::from_utf8(bytes.clone()).expect("utf-8");
        assert!(
            text.contains(r#""chain":["0000000000000001","ffffffffffffffff","0123456789abcdef"]"#)
        );
        assert!(text.contains(r#""firstByte":{"workTokens":1500,"ownTokens":500,"ttftMs":42.5,"attention":2100,"ownAttention":900}"#));
        assert!(text.contains(r#""sessionStart":{"matchEnd":"0123456789abcdef"}"#));
        assert!(text.contains(r#""sessionStart":{}"#));
        assert_eq!(parse_answer(&bytes, LIMITS), Ok(answer()));
    }

    fn refused(edit: impl FnOnce(&mut serde_json::Value)) -> String {
        let mut value: serde_json::Value =
            serde_json::from_slice(&encode_answer(&answer())).expect("json");
        edit(&mut value);
        parse_answer(value.to_string().as_bytes(), LIMITS).expect_err("refused")
    }

    #[test]
    fn bad_answers_are_refused_naming_what_is_wrong() {
        assert!(refused(|v| v["version"] = 2.into()).contains("`version` must be 1"));
        assert!(refused(|v| v["replica"] = "".into()).contains("`replica`"));
        assert!(refused(|v| v["since"] = 45.into()).contains("`since` (45) is past `seq` (44)"));
        assert!(refused(|v| v["decisions"][1]["seq"] = 41.into())
            .contains("`decisions[1].seq` (41) must rise within (41, 44]"));
        assert!(refused(|v| v["decisions"][0]["seq"] = 40.into()).contains("`decisions[0].seq`"));
        assert!(refused(|v| v["decisions"][0]["chain"][1] = "xyz".into())
            .contains("`decisions[0].chain`: hash \"xyz\" must be 16 hex digits"));
        assert!(
            refused(|v| v["decisions"][0]["chain"] = serde_json::json!([]))
                .contains("`decisions[0].chain` must hold 1 to 2048 hashes (got 0)")
        );
        assert!(refused(|v| v["decisions"][0]["pod"] = "".into()).contains("`decisions[0].pod`"));
        assert!(
            refused(|v| v["decisions"][1]["chain"] = serde_json::json!(["0000000000000001"]))
                .contains("`decisions[1]` carries both a `chain` and a `firstByte`")
        );
        for bad in [0.0, -3.0, 4e6] {
            assert!(
                refused(|v| v["decisions"][1]["firstByte"]["ttftMs"] = bad.into())
                    .contains("`decisions[1].firstByte.ttftMs` must be in (0, 3600000]")
            );
        }
        assert!(
            refused(|v| v["decisions"][1]["firstByte"]["ownTokens"] = 1501.into())
                .contains("`decisions[1].firstByte.ownTokens` must be at most its `workTokens`")
        );
        assert!(
            refused(|v| v["decisions"][1]["firstByte"]["workTokens"] = (-1).into())
                .contains("malformed")
        );
        assert!(
            refused(|v| v["decisions"][1]["firstByte"]["x"] = 1.into()).contains("unknown field")
        );
        assert!(
            refused(|v| v["decisions"][2]["sessionStart"]["matchEnd"] = "12".into()).contains(
                "`decisions[2].sessionStart.matchEnd`: hash \"12\" must be 16 hex digits"
            )
        );
        assert!(
            refused(|v| v["decisions"][2]["chain"] = serde_json::json!(["0000000000000001"]))
                .contains("`decisions[2]` carries a `sessionStart` and a `chain`")
        );
        assert!(
            refused(|v| v["decisions"][3]["sessionStart"]["x"] = 1.into())
                .contains("unknown field")
        );
        assert!(refused(|v| v["inflight"][0]["requests"] = (-1).into()).contains("malformed"));
        assert!(refused(|v| v["decisions"][0]["extra"] = 1.into()).contains("unknown field"));
        let many: Vec<serde_json::Value> = (0..65)
            .map(|i| serde_json::json!({"pod": format!("p{i}"), "requests": 1, "prefillTokens": 0}))
            .collect();
        assert!(refused(|v| v["inflight"] = many.into()).contains("names 65 pods"));
        assert!(parse_answer(b"not json", LIMITS)
            .expect_err("refused")
            .contains("malformed replica answer"));
    }

    #[test]
    fn a_full_answer_may_start_anywhere() {
        let mut full = answer();
        full.full = true;
        full.since = 0;
        assert_eq!(parse_answer(&encode_answer(&full), LIMITS), Ok(full));
    }
}
