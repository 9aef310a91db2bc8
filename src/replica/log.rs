//! A replica's own decision log, as its peers pull it.
//!
//! The service appends every decision of its own filters that it recorded
//! (new blocks for a pod: precise mode's pending entries, approximate
//! mode's and report-fallback pods' decision-derived blocks) to a
//! [`ReplicaLog`], the first byte of each streamed answer its filters saw
//! and each session start they routed (what every replica's TTFT model
//! learns from and prefix-demand count takes, [`crate::scoring::feed`]);
//! entries learnt from peers are never
//! logged again, so nothing echoes between replicas. The log is bounded
//! twice: at most [`LOG_DECISIONS`] entries and at most `max_blocks` hashes in all, the
//! oldest dropped first, so a replica's memory does not grow with its
//! traffic or its peers.
//!
//! The log is served by whichever part of the host answers peers (in the
//! wasm build an HTTP filter on a worker, reading what the service wrote to
//! shared data): it is stored as one value per decision, keyed by
//! `seq % LOG_DECISIONS` ([`ReplicaLog::append`] returns what to write),
//! plus a [`LogHead`] naming the replica and the seqs held. A reader builds
//! an answer from the head and those values ([`answer`]); a value
//! overwritten between the two reads carries another seq, which the reader
//! sees, and answers in full instead.

use std::collections::VecDeque;

use super::wire::{FirstByte, LoggedDecision, LoggedStart, PodInflight, ReplicaAnswer};
use crate::scoring::feed::{decode_match_end, encode_match_end, MATCH_END_BYTES};

/// Most decisions a log holds.
pub const LOG_DECISIONS: u64 = 4096;

/// Most hashes a log holds (1 MiB of them): a peer catching up gets them
/// in one answer of about 2.5 MB of JSON, within the default
/// `maxReportBytes` (4 MiB). Precise mode needs only the decisions of the
/// last `pendingDecisionMs`; approximate mode's catch-up is the newest
/// 131,072 blocks routed, the ones its per-pod LRU would keep longest.
pub const LOG_BLOCKS: usize = 131_072;

/// Bytes of an encoded [`LogHead`].
const HEAD_BYTES: usize = 24;

/// Estimated JSON bytes of a decision besides its chain, and per hash: what
/// an answer's size bound counts.
const DECISION_JSON_BYTES: usize = 96;
const HASH_JSON_BYTES: usize = 19;
const FIRST_BYTE_JSON_BYTES: usize = 110;
const PREDICTED_TTFT_JSON_BYTES: usize = 28;
const SESSION_START_JSON_BYTES: usize = 48;

/// Estimated JSON bytes of an entry in an answer.
fn json_bytes(entry: &LoggedDecision) -> usize {
    DECISION_JSON_BYTES
        + entry.chain.len() * HASH_JSON_BYTES
        + match (entry.first_byte, entry.session_start) {
            (Some(_), _) => FIRST_BYTE_JSON_BYTES,
            (None, Some(_)) => SESSION_START_JSON_BYTES,
            (None, None) if entry.predicted_ttft_ms != 0 => PREDICTED_TTFT_JSON_BYTES,
            (None, None) => 0,
        }
}

/// What a log holds: its replica's id, and decisions `first..=last`
/// (`first > last`: none yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogHead {
    pub replica: u64,
    pub first: u64,
    pub last: u64,
}

impl LogHead {
    pub fn encode(&self) -> Vec<u8> {
        [self.replica, self.first, self.last]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()
    }

    pub fn decode(bytes: &[u8]) -> Option<LogHead> {
        if bytes.len() != HEAD_BYTES {
            return None;
        }
        let word = |i: usize| {
            bytes
                .get(i * 8..i * 8 + 8)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes)
        };
        Some(LogHead {
            replica: word(0)?,
            first: word(1)?,
            last: word(2)?,
        })
    }

    /// The replica id as the wire carries it.
    pub fn replica_id(&self) -> String {
        format!("{:016x}", self.replica)
    }

    /// Whether a peer that last saw `since` of `epoch` has something to
    /// get: a long-poll answers at once when it has.
    pub fn has_news(&self, since: u64, epoch: Option<&str>) -> bool {
        epoch != Some(self.replica_id().as_str()) || since < self.last
    }
}

/// The key (within [`LOG_DECISIONS`]) a decision's value is stored under.
pub fn log_slot(seq: u64) -> u64 {
    seq % LOG_DECISIONS
}

/// See the module documentation.
pub struct ReplicaLog {
    head: LogHead,
    /// Chain length of each decision held, oldest first.
    lengths: VecDeque<usize>,
    blocks: usize,
    max_blocks: usize,
}

impl ReplicaLog {
    pub fn new(replica: u64, max_blocks: usize) -> ReplicaLog {
        ReplicaLog {
            head: LogHead {
                replica,
                first: 1,
                last: 0,
            },
            lengths: VecDeque::new(),
            blocks: 0,
            max_blocks: max_blocks.max(1),
        }
    }

    pub fn head(&self) -> LogHead {
        self.head
    }

    /// Logs a decision; returns its seq and the value to store under
    /// [`log_slot`] of it (then store [`ReplicaLog::head`]).
    pub fn append(
        &mut self,
        pod: &str,
        chain: &[u64],
        predicted_ttft_ms: u32,
        at_ms: u64,
    ) -> (u64, Vec<u8>) {
        self.append_entry(pod, chain, predicted_ttft_ms, None, None, at_ms)
    }

    /// Logs the first byte of a streamed answer from `pod`, as
    /// [`ReplicaLog::append`] does a decision.
    pub fn append_first_byte(
        &mut self,
        pod: &str,
        first_byte: FirstByte,
        at_ms: u64,
    ) -> (u64, Vec<u8>) {
        self.append_entry(pod, &[], 0, Some(first_byte), None, at_ms)
    }

    /// Logs a session start routed to `pod`, as [`ReplicaLog::append`]
    /// does a decision.
    pub fn append_start(&mut self, pod: &str, start: LoggedStart, at_ms: u64) -> (u64, Vec<u8>) {
        self.append_entry(pod, &[], 0, None, Some(start), at_ms)
    }

    fn append_entry(
        &mut self,
        pod: &str,
        chain: &[u64],
        predicted_ttft_ms: u32,
        first_byte: Option<FirstByte>,
        session_start: Option<LoggedStart>,
        at_ms: u64,
    ) -> (u64, Vec<u8>) {
        self.head.last += 1;
        self.lengths.push_back(chain.len());
        self.blocks += chain.len();
        while self.lengths.len() > 1
            && (self.lengths.len() as u64 > LOG_DECISIONS || self.blocks > self.max_blocks)
        {
            self.blocks -= self.lengths.pop_front().unwrap_or(0);
            self.head.first += 1;
        }
        let seq = self.head.last;
        let entry = LoggedDecision {
            seq,
            pod: pod.to_string(),
            at_ms,
            chain: chain.to_vec(),
            predicted_ttft_ms,
            first_byte,
            session_start,
        };
        (seq, encode_decision(&entry))
    }
}

/// A log entry as stored: seq, time, pod id length and bytes, chain length
/// and hashes, then a first byte's work (u32) and TTFT (f32) if it is one,
/// a session start's match end ([`encode_match_end`]) if it is one, else
/// the decision's predicted TTFT (u32), little-endian.
pub fn encode_decision(entry: &LoggedDecision) -> Vec<u8> {
    let LoggedDecision {
        seq,
        pod,
        at_ms,
        chain,
        predicted_ttft_ms,
        first_byte,
        session_start,
    } = entry;
    // Pod ids are at most 255 bytes (configuration rules); the cut is
    // only a guard on the length field.
    let pod = pod.as_bytes();
    let pod = pod.get(..usize::from(u16::MAX)).unwrap_or(pod);
    let mut bytes = Vec::with_capacity(22 + pod.len() + chain.len() * 8);
    bytes.extend_from_slice(&seq.to_le_bytes());
    bytes.extend_from_slice(&at_ms.to_le_bytes());
    bytes.extend_from_slice(&(pod.len() as u16).to_le_bytes());
    bytes.extend_from_slice(pod);
    bytes.extend_from_slice(&(chain.len() as u32).to_le_bytes());
    for hash in chain {
        bytes.extend_from_slice(&hash.to_le_bytes());
    }
    match (first_byte, session_start) {
        (Some(first_byte), _) => {
            bytes.extend_from_slice(&first_byte.work_tokens.to_le_bytes());
            bytes.extend_from_slice(&first_byte.own_tokens.to_le_bytes());
            bytes.extend_from_slice(&first_byte.ttft_ms.to_le_bytes());
            bytes.extend_from_slice(&first_byte.attention.to_le_bytes());
            bytes.extend_from_slice(&first_byte.own_attention.to_le_bytes());
        }
        (None, Some(start)) => encode_match_end(start.match_end, &mut bytes),
        (None, None) => bytes.extend_from_slice(&predicted_ttft_ms.to_le_bytes()),
    }
    bytes
}

/// Bytes of a stored first byte: work, own tokens, TTFT, attention, own
/// attention.
const FIRST_BYTE_BYTES: usize = 20;

/// The stored entry, `None` if the bytes are not one.
pub fn decode_decision(mut bytes: &[u8]) -> Option<LoggedDecision> {
    let mut take = |n: usize| {
        let (part, rest) = bytes.split_at_checked(n)?;
        bytes = rest;
        Some(part)
    };
    let u64_of = |b: &[u8]| b.try_into().ok().map(u64::from_le_bytes);
    let seq = u64_of(take(8)?)?;
    let at_ms = u64_of(take(8)?)?;
    let pod_len = usize::from(u16::from_le_bytes(take(2)?.try_into().ok()?));
    let pod = String::from_utf8(take(pod_len)?.to_vec()).ok()?;
    let chain_len = usize::try_from(u32::from_le_bytes(take(4)?.try_into().ok()?)).ok()?;
    let hashes = take(chain_len.checked_mul(8)?)?;
    let chain = hashes.chunks_exact(8).map(u64_of).collect::<Option<_>>()?;
    let (predicted_ttft_ms, first_byte, session_start) = match bytes.len() {
        4 => (u32::from_le_bytes(bytes.try_into().ok()?), None, None),
        FIRST_BYTE_BYTES => (
            0,
            Some(FirstByte {
                work_tokens: u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?),
                own_tokens: u32::from_le_bytes(bytes.get(4..8)?.try_into().ok()?),
                ttft_ms: f32::from_le_bytes(bytes.get(8..12)?.try_into().ok()?),
                attention: u32::from_le_bytes(bytes.get(12..16)?.try_into().ok()?),
                own_attention: u32::from_le_bytes(bytes.get(16..)?.try_into().ok()?),
            }),
            None,
        ),
        MATCH_END_BYTES => (
            0,
            None,
            Some(LoggedStart {
                match_end: decode_match_end(bytes)?,
            }),
        ),
        _ => return None,
    };
    Some(LoggedDecision {
        seq,
        pod,
        at_ms,
        chain,
        predicted_ttft_ms,
        first_byte,
        session_start,
    })
}

/// The answer to a peer that last saw `since` of `epoch`, from the log
/// `head` and `read(seq)` (the stored value of that seq): the decisions
/// after `since` when the log still holds them all, else all it holds
/// (`full`). At most about `max_bytes` of JSON: a delta stops early (its
/// `seq` says where, and the peer continues from there), a full answer
/// keeps the newest decisions.
pub fn answer(
    head: LogHead,
    since: u64,
    epoch: Option<&str>,
    read: impl Fn(u64) -> Option<Vec<u8>>,
    inflight: Vec<PodInflight>,
    now_ms: u64,
    max_bytes: usize,
) -> ReplicaAnswer {
    let read_seq = |seq: u64| {
        read(log_slot(seq))
            .and_then(|bytes| decode_decision(&bytes))
            .filter(|d| d.seq == seq)
    };
    let continues = epoch == Some(head.replica_id().as_str())
        && since.saturating_add(1) >= head.first
        && since <= head.last;
    if continues {
        let mut decisions = Vec::new();
        let mut bytes = 0;
        let mut complete = true;
        for seq in since + 1..=head.last {
            let Some(decision) = read_seq(seq) else {
                complete = false;
                break;
            };
            bytes += json_bytes(&decision);
            if bytes > max_bytes && !decisions.is_empty() {
                break;
            }
            decisions.push(decision);
        }
        if complete {
            return ReplicaAnswer {
                replica: head.replica_id(),
                seq: decisions.last().map_or(since, |d| d.seq),
                since,
                full: false,
                sent_at_ms: now_ms,
                decisions,
                inflight,
            };
        }
    }
    let mut decisions = Vec::new();
    let mut bytes = 0;
    for seq in (head.first..=head.last).rev() {
        let Some(decision) = read_seq(seq) else {
            break;
        };
        bytes += json_bytes(&decision);
        if bytes > max_bytes && !decisions.is_empty() {
            break;
        }
        decisions.push(decision);
    }
    decisions.reverse();
    ReplicaAnswer {
        replica: head.replica_id(),
        seq: head.last,
        since: 0,
        full: true,
        sent_at_ms: now_ms,
        decisions,
        inflight,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct Store {
        log: ReplicaLog,
        values: HashMap<u64, Vec<u8>>,
    }

    impl Store {
        fn new(max_blocks: usize) -> Store {
            Store {
                log: ReplicaLog::new(0xabc, max_blocks),
                values: HashMap::new(),
            }
        }

        fn append(&mut self, pod: &str, chain: &[u64]) -> u64 {
            let (seq, value) = self.log.append(pod, chain, 0, 1000 + seq_time(chain));
            self.values.insert(log_slot(seq), value);
            seq
        }

        fn answer(&self, since: u64, epoch: Option<&str>, max_bytes: usize) -> ReplicaAnswer {
            answer(
                self.log.head(),
                since,
                epoch,
                |slot| self.values.get(&slot).cloned(),
                Vec::new(),
                5000,
                max_bytes,
            )
        }
    }

    fn seq_time(chain: &[u64]) -> u64 {
        chain.len() as u64
    }

    fn seqs(answer: &ReplicaAnswer) -> Vec<u64> {
        answer.decisions.iter().map(|d| d.seq).collect()
    }

    #[test]
    fn a_decision_round_trips_and_garbage_does_not_decode() {
        let entry =
            |chain: Vec<u64>, predicted_ttft_ms, first_byte, session_start| LoggedDecision {
                seq: 7,
                pod: "10.0.0.1:8000".into(),
                at_ms: 123,
                chain,
                predicted_ttft_ms,
                first_byte,
                session_start,
            };
        let decision = entry(vec![1, 2, u64::MAX], 8_500, None, None);
        let answered = entry(
            Vec::new(),
            0,
            Some(FirstByte {
                work_tokens: 900,
                own_tokens: 300,
                attention: 4000,
                own_attention: 1000,
                ttft_ms: 31.25,
            }),
            None,
        );
        let start = |match_end| entry(Vec::new(), 0, None, Some(LoggedStart { match_end }));
        for entry in [decision, answered, start(Some(u64::MAX)), start(None)] {
            let bytes = encode_decision(&entry);
            assert_eq!(decode_decision(&bytes), Some(entry));
            assert_eq!(decode_decision(&bytes[..bytes.len() - 1]), None);
            let mut longer = bytes.clone();
            longer.push(0);
            assert_eq!(decode_decision(&longer), None);
        }
        assert_eq!(decode_decision(&[]), None);
    }

    #[test]
    fn a_peer_gets_the_decisions_after_what_it_saw() {
        let mut store = Store::new(1000);
        for i in 1..=5 {
            store.append("pod-a", &[i, i + 1]);
        }
        let epoch = store.log.head().replica_id();
        let delta = store.answer(3, Some(&epoch), usize::MAX);
        assert!(!delta.full);
        assert_eq!((delta.since, delta.seq), (3, 5));
        assert_eq!(seqs(&delta), vec![4, 5]);
        let idle = store.answer(5, Some(&epoch), usize::MAX);
        assert!(!idle.full && idle.decisions.is_empty() && idle.seq == 5);
        assert!(!store.log.head().has_news(5, Some(&epoch)));
        assert!(store.log.head().has_news(4, Some(&epoch)));
        assert!(store.log.head().has_news(5, Some("another replica")));
    }

    #[test]
    fn a_new_peer_or_another_epoch_gets_everything_held() {
        let mut store = Store::new(1000);
        for i in 1..=3 {
            store.append("pod-a", &[i]);
        }
        for (since, epoch) in [(0, None), (2, Some("0000000000000001")), (9, None)] {
            let full = store.answer(since, epoch, usize::MAX);
            assert!(full.full);
            assert_eq!(seqs(&full), vec![1, 2, 3]);
            assert_eq!(full.seq, 3);
        }
    }

    #[test]
    fn the_log_is_bounded_and_a_peer_behind_it_gets_a_full_answer() {
        let mut store = Store::new(10);
        for i in 1..=8 {
            store.append("pod-a", &[i, i, i]);
        }
        let head = store.log.head();
        assert_eq!(
            (head.first, head.last),
            (6, 8),
            "at most 10 blocks: 3 decisions of 3"
        );
        let epoch = head.replica_id();
        let behind = store.answer(2, Some(&epoch), usize::MAX);
        assert!(behind.full);
        assert_eq!(seqs(&behind), vec![6, 7, 8]);
        let just_in = store.answer(5, Some(&epoch), usize::MAX);
        assert!(!just_in.full);
        assert_eq!(seqs(&just_in), vec![6, 7, 8]);
    }

    #[test]
    fn the_log_is_bounded_by_count_too() {
        let mut store = Store::new(usize::MAX);
        for i in 0..LOG_DECISIONS + 10 {
            store.append("pod-a", &[i]);
        }
        let head = store.log.head();
        assert_eq!(head.last - head.first + 1, LOG_DECISIONS);
        // Every held seq reads back as itself, though slots were reused.
        let full = store.answer(0, None, usize::MAX);
        assert_eq!(full.decisions.len() as u64, LOG_DECISIONS);
    }

    #[test]
    fn an_overwritten_value_makes_the_answer_full() {
        let mut store = Store::new(usize::MAX);
        for i in 1..=4 {
            store.append("pod-a", &[i]);
        }
        let epoch = store.log.head().replica_id();
        // Seq 3's slot now holds another seq (a writer raced the reader).
        store.values.insert(
            log_slot(3),
            encode_decision(&LoggedDecision {
                seq: 3 + LOG_DECISIONS,
                pod: "pod-a".into(),
                at_ms: 0,
                chain: vec![9],
                predicted_ttft_ms: 0,
                first_byte: None,
                session_start: None,
            }),
        );
        let answer = store.answer(1, Some(&epoch), usize::MAX);
        assert!(answer.full);
        assert_eq!(seqs(&answer), vec![4], "only what reads back intact");
    }

    #[test]
    fn answers_are_bounded_in_bytes() {
        let mut store = Store::new(usize::MAX);
        let chain: Vec<u64> = (0..100).collect();
        for _ in 0..10 {
            store.append("pod-a", &chain);
        }
        let per_decision = DECISION_JSON_BYTES + 100 * HASH_JSON_BYTES;
        let epoch = store.log.head().replica_id();
        let delta = store.answer(0, Some(&epoch), 3 * per_decision);
        assert!(!delta.full);
        assert_eq!(seqs(&delta), vec![1, 2, 3]);
        assert_eq!(delta.seq, 3, "the peer continues from 3");
        let full = store.answer(0, None, 3 * per_decision);
        assert!(full.full);
        assert_eq!(seqs(&full), vec![8, 9, 10], "the newest");
        // One decision is always sent, even over the bound.
        assert_eq!(seqs(&store.answer(0, Some(&epoch), 1)), vec![1]);
        assert_eq!(seqs(&store.answer(0, None, 1)), vec![10]);
    }
}
