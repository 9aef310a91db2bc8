//! The gateway's feed: what every worker of every replica learns from, so
//! that all of them predict and count alike. It carries two kinds of
//! record:
//!
//! - the first byte of each streamed answer, which every
//!   [`TtftModel`](super::ttft::TtftModel) learns its lines from;
//! - each session start (an arrival that is not a chat's later turn, with
//!   where its longest cached match ended), which every
//!   [`PrefixDemand`](super::spread::PrefixDemand) counts.
//!
//! ```text
//! worker's first byte, session start ──batch──▶ service ──▶ Feed ──▶ every worker's FeedReader ──▶ TtftModel, PrefixDemand
//!                                                  │  ▲
//!                                     replica log ─┘  └─ peers' first bytes and starts (replica channel)
//! ```
//!
//! A worker hands its records to the service with its decisions; the
//! service appends them to the [`Feed`] (and to the replica log, for the
//! peers), and appends the peers' as they arrive. Every worker reads the
//! feed at most once per worker tick and takes each record once
//! ([`FeedReader`]). A worker counts its own session starts as it routes
//! them, and skips them on the feed by their origin (a random id per
//! worker; 0 for a peer's).
//!
//! Why answers: a model learns from its answers only. Per worker, each of
//! `W` workers over `R` replicas fits its lines to `1/(W·R)` of the
//! answers, and the replicas' balance decisions differ by their models'
//! noise. Measured (`kvroute-bench replicas multi-turn`, native, 4 pods,
//! one replica): at `--concurrency 6` instead of 2, one run of two lost
//! 1.7 points of hit rate and took 1.5× the TTFT p90 — the failure 3
//! replicas of 2 workers showed in 2 runs of 3.
//!
//! Why starts: the spread rule copies a shared prefix once its session
//! starts say it needs another holder. Counted per worker and read through
//! the worker's share of the answers, a worker's first start at a prefix
//! counted only once its own second start there came, and the share was 1
//! until the first answers arrived: with three replicas of two workers, the
//! first 8 session starts of a multi-turn run (0.06–0.33 s) all went to
//! one pod, where one replica alternates two holders from the 2nd start
//! (`kvroute-bench replicas multi-turn --keep-logs`,
//! integration/results/replicas).
//!
//! The feed is bounded ([`FEED_RECORDS`]): a worker idle for longer than
//! the feed holds skips what it missed. Published whole, at most 19 bytes
//! a record (at most 19 KiB), read at most every worker tick.

use std::collections::VecDeque;

use super::ttft::Work;

/// Records the feed holds: a worker reading every tick (25 ms) misses none
/// below 40,000 records a second.
pub const FEED_RECORDS: usize = 1024;

/// Bytes of the feed's header (the first record's seq).
const HEADER_BYTES: usize = 8;
const ANSWER_RECORD: u8 = 0;
const START_RECORD: u8 = 1;

/// One streamed answer's first byte: `work_tokens` of prefill, of which
/// `own_tokens` its own, and their `attention`, of which `own_attention`
/// its own ([`Work`]), took `ttft_ms` on pod `slot`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Answer {
    pub slot: u16,
    pub work_tokens: u32,
    pub own_tokens: u32,
    pub attention: u32,
    pub own_attention: u32,
    pub ttft_ms: f32,
}

impl Answer {
    pub fn new(slot: usize, work: Work, ttft_ms: f64) -> Answer {
        let tokens = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
        Answer {
            slot: u16::try_from(slot).unwrap_or(u16::MAX),
            work_tokens: tokens(work.tokens),
            own_tokens: tokens(work.own_tokens),
            attention: tokens(work.attention),
            own_attention: tokens(work.own_attention),
            ttft_ms: ttft_ms as f32,
        }
    }

    pub fn work(&self) -> Work {
        Work {
            tokens: u64::from(self.work_tokens),
            own_tokens: u64::from(self.own_tokens.min(self.work_tokens)),
            attention: u64::from(self.attention),
            own_attention: u64::from(self.own_attention.min(self.attention)),
        }
    }

    pub fn encode_into(&self, bytes: &mut Vec<u8>) {
        bytes.extend_from_slice(&self.slot.to_le_bytes());
        bytes.extend_from_slice(&self.work_tokens.to_le_bytes());
        bytes.extend_from_slice(&self.own_tokens.to_le_bytes());
        bytes.extend_from_slice(&self.ttft_ms.to_le_bytes());
        bytes.extend_from_slice(&self.attention.to_le_bytes());
        bytes.extend_from_slice(&self.own_attention.to_le_bytes());
    }

    /// The answer at the start of `bytes` (at least [`Answer::BYTES`]).
    pub fn decode(bytes: &[u8]) -> Option<Answer> {
        Some(Answer {
            slot: u16::from_le_bytes(bytes.get(..2)?.try_into().ok()?),
            work_tokens: u32::from_le_bytes(bytes.get(2..6)?.try_into().ok()?),
            own_tokens: u32::from_le_bytes(bytes.get(6..10)?.try_into().ok()?),
            ttft_ms: f32::from_le_bytes(bytes.get(10..14)?.try_into().ok()?),
            attention: u32::from_le_bytes(bytes.get(14..18)?.try_into().ok()?),
            own_attention: u32::from_le_bytes(bytes.get(18..22)?.try_into().ok()?),
        })
    }

    /// Bytes of an encoded answer.
    pub const BYTES: usize = 22;
}

/// An arrival that may start a session (not a chat's later turn), as
/// [`super::spread::PrefixDemand::record`] counts it: its longest cached
/// match ended at block hash `match_end` (`None`: nothing cached
/// anywhere). `origin` names the worker that routed it (0: a peer
/// replica's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionStart {
    pub origin: u64,
    pub match_end: Option<u64>,
}

impl SessionStart {
    /// Bytes of an encoded start: origin (u64 LE), then its match end
    /// ([`encode_match_end`]).
    pub const BYTES: usize = 8 + MATCH_END_BYTES;

    pub fn encode_into(&self, bytes: &mut Vec<u8>) {
        bytes.extend_from_slice(&self.origin.to_le_bytes());
        encode_match_end(self.match_end, bytes);
    }

    /// The start at the start of `bytes`, `None` if it is not one.
    pub fn decode(bytes: &[u8]) -> Option<SessionStart> {
        let origin = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        Some(SessionStart {
            origin,
            match_end: decode_match_end(bytes.get(8..)?)?,
        })
    }
}

/// Bytes of an encoded match end ([`encode_match_end`]).
pub const MATCH_END_BYTES: usize = 9;

/// Appends a session start's match end as the feed and the replica log
/// store it: whether a match ended (u8), and where (u64 LE, 0 when none).
pub fn encode_match_end(match_end: Option<u64>, bytes: &mut Vec<u8>) {
    bytes.push(u8::from(match_end.is_some()));
    bytes.extend_from_slice(&match_end.unwrap_or(0).to_le_bytes());
}

/// The match end at the start of `bytes` (`Some(None)`: no match), `None`
/// if the bytes are not one.
pub fn decode_match_end(bytes: &[u8]) -> Option<Option<u64>> {
    let end = u64::from_le_bytes(bytes.get(1..MATCH_END_BYTES)?.try_into().ok()?);
    match bytes.first()? {
        0 => Some(None),
        1 => Some(Some(end)),
        _ => None,
    }
}

/// One record of the feed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FeedRecord {
    Answer(Answer),
    Start(SessionStart),
}

impl FeedRecord {
    fn encode_into(&self, bytes: &mut Vec<u8>) {
        match self {
            FeedRecord::Answer(answer) => {
                bytes.push(ANSWER_RECORD);
                answer.encode_into(bytes);
            }
            FeedRecord::Start(start) => {
                bytes.push(START_RECORD);
                start.encode_into(bytes);
            }
        }
    }

    /// The record at the start of `bytes` and its length in bytes.
    fn decode(bytes: &[u8]) -> Option<(FeedRecord, usize)> {
        let (&kind, rest) = bytes.split_first()?;
        match kind {
            ANSWER_RECORD => Some((FeedRecord::Answer(Answer::decode(rest)?), 1 + Answer::BYTES)),
            START_RECORD => Some((
                FeedRecord::Start(SessionStart::decode(rest)?),
                1 + SessionStart::BYTES,
            )),
            _ => None,
        }
    }
}

/// The service's side: the newest [`FEED_RECORDS`] records with their seqs.
#[derive(Debug, Default)]
pub struct Feed {
    /// Seq of `records[0]` (seqs start at 1).
    first: u64,
    records: VecDeque<FeedRecord>,
    /// Records were pushed since the last [`Feed::take_unpublished`].
    unpublished: bool,
}

impl Feed {
    pub fn push(&mut self, record: FeedRecord) {
        if self.first == 0 {
            self.first = 1;
        }
        self.unpublished = true;
        self.records.push_back(record);
        if self.records.len() > FEED_RECORDS {
            self.records.pop_front();
            self.first += 1;
        }
    }

    /// The feed to publish when records came since the last call: the
    /// service publishes once per tick, not per record (≤ 19 KiB copied
    /// per publication).
    pub fn take_unpublished(&mut self) -> Option<Vec<u8>> {
        std::mem::take(&mut self.unpublished).then(|| self.encode())
    }

    /// The feed as the hosts publish it: the first record's seq, then the
    /// records oldest first.
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes =
            Vec::with_capacity(HEADER_BYTES + self.records.len() * (1 + SessionStart::BYTES));
        bytes.extend_from_slice(&self.first.to_le_bytes());
        for record in &self.records {
            record.encode_into(&mut bytes);
        }
        bytes
    }
}

/// A worker's side: which records of the feed it took.
#[derive(Debug, Default)]
pub struct FeedReader {
    /// Seq of the next record to take.
    next: u64,
}

impl FeedReader {
    /// The records of `feed` not taken yet, oldest first. A feed that is
    /// not one has none; a malformed record ends the feed there.
    pub fn read(&mut self, feed: &[u8]) -> Vec<FeedRecord> {
        let (Some(first), Some(mut rest)) = (
            feed.get(..HEADER_BYTES)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes),
            feed.get(HEADER_BYTES..),
        ) else {
            return Vec::new();
        };
        let mut records = Vec::new();
        while let Some((record, len)) = FeedRecord::decode(rest) {
            records.push(record);
            rest = rest.get(len..).unwrap_or_default();
        }
        let end = first + records.len() as u64;
        // A new service (Envoy's main thread restarted the feed): from its start.
        if self.next > end {
            self.next = first;
        }
        let skip = self.next.saturating_sub(first) as usize;
        self.next = end;
        records.drain(..skip.min(records.len()));
        records
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scoring::ttft::TtftModel;

    fn answer(slot: usize, tokens: u64, ttft_ms: f64) -> FeedRecord {
        FeedRecord::Answer(Answer::new(slot, Work::new(0, tokens), ttft_ms))
    }

    fn start(origin: u64, match_end: Option<u64>) -> FeedRecord {
        FeedRecord::Start(SessionStart { origin, match_end })
    }

    #[test]
    fn every_reader_takes_each_record_once() {
        let mut feed = Feed::default();
        let (mut a, mut b) = (FeedReader::default(), FeedReader::default());
        // Empty and garbage feeds hold nothing.
        assert!(a.read(&[]).is_empty());
        assert!(a.read(&feed.encode()).is_empty());
        assert_eq!(feed.take_unpublished(), None, "nothing pushed yet");
        let first: Vec<FeedRecord> = (0..10u64)
            .map(|i| answer(0, 100 + i * 300, 10.0 + 0.1 * (100 + i * 300) as f64))
            .chain([start(7, None), start(0, Some(u64::MAX))])
            .collect();
        first.iter().for_each(|r| feed.push(*r));
        assert_eq!(feed.take_unpublished(), Some(feed.encode()));
        assert_eq!(feed.take_unpublished(), None, "published once");
        assert_eq!(a.read(&feed.encode()), first);
        assert!(a.read(&feed.encode()).is_empty());
        let second = [start(9, Some(42)), answer(1, 500, 120.0)];
        second.iter().for_each(|r| feed.push(*r));
        assert_eq!(a.read(&feed.encode()), second);
        // A reader that starts later takes everything held, in order.
        let all = b.read(&feed.encode());
        assert_eq!(all, [first, second.to_vec()].concat());
        // The answers survive the encoding: a model learns their line.
        let mut model = TtftModel::new(64);
        for record in &all {
            if let FeedRecord::Answer(x) = record {
                model.observe(usize::from(x.slot), x.work(), f64::from(x.ttft_ms));
            }
        }
        assert!(
            (model.line(0).ms_per_token - 0.1).abs() < 1e-3,
            "{:?}",
            model.line(0)
        );
    }

    #[test]
    fn a_malformed_record_ends_the_feed_there() {
        let mut feed = Feed::default();
        feed.push(start(3, Some(5)));
        let mut bytes = feed.encode();
        bytes.extend_from_slice(&[START_RECORD, 1, 2, 3]);
        assert_eq!(FeedReader::default().read(&bytes), [start(3, Some(5))]);
        let mut flag = feed.encode();
        flag[HEADER_BYTES + 1 + 8] = 2;
        assert!(FeedReader::default().read(&flag).is_empty(), "flag 2");
    }

    #[test]
    fn the_feed_is_bounded_and_a_late_reader_skips_what_it_missed() {
        let mut feed = Feed::default();
        let mut reader = FeedReader::default();
        feed.push(answer(0, 100, 20.0));
        assert_eq!(reader.read(&feed.encode()).len(), 1);
        for i in 0..FEED_RECORDS + 10 {
            feed.push(start(1, Some(i as u64)));
        }
        let bytes = feed.encode();
        assert_eq!(
            bytes.len(),
            HEADER_BYTES + FEED_RECORDS * (1 + SessionStart::BYTES)
        );
        let read = reader.read(&bytes);
        assert_eq!(read.len(), FEED_RECORDS);
        assert_eq!(read[0], start(1, Some(10)), "the oldest ten dropped");
        // A restarted service's feed starts over: the reader follows it.
        let mut restarted = Feed::default();
        restarted.push(answer(0, 100, 20.0));
        assert_eq!(reader.read(&restarted.encode()).len(), 1);
    }
}
