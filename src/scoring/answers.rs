//! The answers every TTFT model of a gateway learns from: one stream per
//! gateway, so that every worker's and every replica's [`TtftModel`]
//! learns from the same answers and predicts alike.
//!
//! ```text
//! worker's first byte ──batch──▶ service ──▶ AnswerFeed ──▶ every worker's FeedReader ──▶ TtftModel
//!                                   │  ▲
//!                      replica log ─┘  └─ peers' first bytes (replica channel)
//! ```
//!
//! A worker that sees a streamed answer's first byte measures the model's
//! error on it (the metric, once per answer) and hands `(pod, work, ttft)`
//! to the service with its decisions; the service appends it to the
//! [`AnswerFeed`] (and to the replica log, for the peers), and appends the
//! peers' answers as they arrive. Every worker reads the feed at most once
//! per worker tick and learns each answer once ([`FeedReader`]).
//!
//! Why: a model learns from its answers only. Per worker, each of `W`
//! workers over `R` replicas fits its lines to `1/(W·R)` of the answers,
//! and the replicas' balance decisions differ by their models' noise.
//! Measured (`kvroute-bench replicas multi-turn`, native, 4 pods, one
//! replica): at `--concurrency 6` instead of 2, one run of two lost 1.7
//! points of hit rate and took 1.5× the TTFT p90 — the failure 3 replicas
//! of 2 workers showed in 2 runs of 3.
//!
//! The feed is bounded ([`FEED_ANSWERS`]): a worker idle for longer than
//! the feed holds skips what it missed (its model learns from the newest
//! answers on). Published whole, 14 bytes an answer: at most 14 KiB,
//! read at most every worker tick.

use std::collections::VecDeque;

use super::ttft::{TtftModel, Work};

/// Answers the feed holds: a worker reading every tick (25 ms) misses none
/// below 40,000 answers a second.
pub const FEED_ANSWERS: usize = 1024;

/// Bytes of the feed's header (the first answer's seq) and of one answer.
const HEADER_BYTES: usize = 8;
const ANSWER_BYTES: usize = 14;

/// One streamed answer's first byte: `work_tokens` of prefill, of which
/// `own_tokens` its own ([`Work`]), took `ttft_ms` on pod `slot`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Answer {
    pub slot: u16,
    pub work_tokens: u32,
    pub own_tokens: u32,
    pub ttft_ms: f32,
}

impl Answer {
    pub fn new(slot: usize, work: Work, ttft_ms: f64) -> Answer {
        let tokens = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
        Answer {
            slot: u16::try_from(slot).unwrap_or(u16::MAX),
            work_tokens: tokens(work.tokens),
            own_tokens: tokens(work.own_tokens),
            ttft_ms: ttft_ms as f32,
        }
    }

    pub fn work(&self) -> Work {
        Work {
            tokens: u64::from(self.work_tokens),
            own_tokens: u64::from(self.own_tokens.min(self.work_tokens)),
        }
    }

    pub fn encode_into(&self, bytes: &mut Vec<u8>) {
        bytes.extend_from_slice(&self.slot.to_le_bytes());
        bytes.extend_from_slice(&self.work_tokens.to_le_bytes());
        bytes.extend_from_slice(&self.own_tokens.to_le_bytes());
        bytes.extend_from_slice(&self.ttft_ms.to_le_bytes());
    }

    /// The answer at the start of `bytes` (at least [`ANSWER_BYTES`]).
    pub fn decode(bytes: &[u8]) -> Option<Answer> {
        Some(Answer {
            slot: u16::from_le_bytes(bytes.get(..2)?.try_into().ok()?),
            work_tokens: u32::from_le_bytes(bytes.get(2..6)?.try_into().ok()?),
            own_tokens: u32::from_le_bytes(bytes.get(6..10)?.try_into().ok()?),
            ttft_ms: f32::from_le_bytes(bytes.get(10..14)?.try_into().ok()?),
        })
    }

    /// Bytes of an encoded answer.
    pub const BYTES: usize = ANSWER_BYTES;
}

/// The service's side: the newest [`FEED_ANSWERS`] answers with their seqs.
#[derive(Debug, Default)]
pub struct AnswerFeed {
    /// Seq of `answers[0]` (seqs start at 1).
    first: u64,
    answers: VecDeque<Answer>,
    /// Answers were pushed since the last [`AnswerFeed::take_unpublished`].
    unpublished: bool,
}

impl AnswerFeed {
    pub fn push(&mut self, answer: Answer) {
        if self.first == 0 {
            self.first = 1;
        }
        self.unpublished = true;
        self.answers.push_back(answer);
        if self.answers.len() > FEED_ANSWERS {
            self.answers.pop_front();
            self.first += 1;
        }
    }

    /// The feed to publish when answers came since the last call: the
    /// service publishes once per tick, not per answer (≤ 14 KiB copied
    /// per publication).
    pub fn take_unpublished(&mut self) -> Option<Vec<u8>> {
        std::mem::take(&mut self.unpublished).then(|| self.encode())
    }

    /// The feed as the hosts publish it: the first answer's seq, then the
    /// answers oldest first.
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(HEADER_BYTES + self.answers.len() * ANSWER_BYTES);
        bytes.extend_from_slice(&self.first.to_le_bytes());
        for answer in &self.answers {
            answer.encode_into(&mut bytes);
        }
        bytes
    }
}

/// A worker's side: which answers of the feed its model learnt.
#[derive(Debug, Default)]
pub struct FeedReader {
    /// Seq of the next answer to learn.
    next: u64,
}

impl FeedReader {
    /// Teaches `model` the answers of `feed` it has not learnt; returns
    /// how many. A feed that is not one teaches nothing.
    pub fn read(&mut self, feed: &[u8], model: &mut TtftModel) -> usize {
        let (Some(first), Some(answers)) = (
            feed.get(..HEADER_BYTES)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes),
            feed.get(HEADER_BYTES..),
        ) else {
            return 0;
        };
        let answers = answers.chunks_exact(ANSWER_BYTES);
        let end = first + answers.len() as u64;
        // A new service (Envoy's main thread restarted the feed): from its start.
        if self.next > end {
            self.next = first;
        }
        let skip = self.next.saturating_sub(first) as usize;
        let mut learnt = 0;
        for answer in answers.skip(skip).filter_map(Answer::decode) {
            if model
                .observe(
                    usize::from(answer.slot),
                    answer.work(),
                    f64::from(answer.ttft_ms),
                )
                .is_some()
            {
                learnt += 1;
            }
        }
        self.next = end;
        learnt
    }
}

/// The share of the gateway's streamed answers that are one worker's
/// own: the share of the gateway's traffic its arrivals are, which
/// per-worker counts ([`super::spread::PrefixDemand`]) are read through.
/// Both counts decay alike over about `window` of the feed's answers; one
/// answer of its own is the prior, so a worker that has seen no answer
/// reads as seeing everything (the replay's single router, or a gateway
/// that streams nothing).
#[derive(Debug, Clone, Copy)]
pub struct TrafficShare {
    own: f64,
    all: f64,
    decay: f64,
}

impl TrafficShare {
    pub fn new(window: f64) -> TrafficShare {
        TrafficShare {
            own: 0.0,
            all: 0.0,
            decay: 1.0 - 1.0 / window.max(1.0),
        }
    }

    /// One of this worker's answers (it reaches the feed later).
    pub fn own_answer(&mut self) {
        self.own += 1.0;
    }

    /// `count` answers read off the feed, every worker's and replica's.
    pub fn feed_answers(&mut self, count: usize) {
        let decay = self.decay.powf(count as f64);
        self.own *= decay;
        self.all = self.all * decay + count as f64;
    }

    /// Own answers over all, in (0, 1].
    pub fn share(&self) -> f64 {
        ((self.own + 1.0) / (self.all + 1.0)).clamp(f64::MIN_POSITIVE, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workers_share_of_the_answers() {
        let mut traffic = TrafficShare::new(1024.0);
        assert_eq!(traffic.share(), 1.0, "no answer yet: all of them");
        // One worker of six: its own answer, then the feed's six.
        for _ in 0..200 {
            traffic.own_answer();
            traffic.feed_answers(6);
        }
        assert!(
            (traffic.share() - 1.0 / 6.0).abs() < 0.01,
            "{}",
            traffic.share()
        );
        // Alone, it converges back to all of them.
        for _ in 0..5000 {
            traffic.own_answer();
            traffic.feed_answers(1);
        }
        assert!(traffic.share() > 0.99, "{}", traffic.share());
    }

    #[test]
    fn every_reader_learns_each_answer_once() {
        let mut feed = AnswerFeed::default();
        let (mut a, mut b) = (FeedReader::default(), FeedReader::default());
        let (mut model_a, mut model_b) = (TtftModel::new(64), TtftModel::new(64));
        // Empty and garbage feeds teach nothing.
        assert_eq!(a.read(&[], &mut model_a), 0);
        assert_eq!(a.read(&feed.encode(), &mut model_a), 0);
        assert_eq!(feed.take_unpublished(), None, "nothing pushed yet");
        for i in 0..10u64 {
            feed.push(Answer::new(
                0,
                Work::new(0, 100 + i * 300),
                10.0 + 0.1 * (100 + i * 300) as f64,
            ));
        }
        assert_eq!(feed.take_unpublished(), Some(feed.encode()));
        assert_eq!(feed.take_unpublished(), None, "published once");
        assert_eq!(a.read(&feed.encode(), &mut model_a), 10);
        assert_eq!(a.read(&feed.encode(), &mut model_a), 0);
        for i in 0..5u64 {
            feed.push(Answer::new(
                1,
                Work::new(0, 500 + i * 200),
                20.0 + 0.2 * (500 + i * 200) as f64,
            ));
        }
        assert_eq!(a.read(&feed.encode(), &mut model_a), 5);
        // A reader that starts later learns everything held, in the same
        // order: the two models agree exactly.
        assert_eq!(b.read(&feed.encode(), &mut model_b), 15);
        assert_eq!(model_a.line(0), model_b.line(0));
        assert_eq!(model_a.line(1), model_b.line(1));
        assert!(
            (model_a.line(0).ms_per_token - 0.1).abs() < 1e-3,
            "{:?}",
            model_a.line(0)
        );
    }

    #[test]
    fn the_feed_is_bounded_and_a_late_reader_skips_what_it_missed() {
        let mut feed = AnswerFeed::default();
        let mut reader = FeedReader::default();
        let mut model = TtftModel::new(64);
        feed.push(Answer::new(0, Work::new(0, 100), 20.0));
        assert_eq!(reader.read(&feed.encode(), &mut model), 1);
        for _ in 0..FEED_ANSWERS + 10 {
            feed.push(Answer::new(0, Work::new(0, 100), 20.0));
        }
        let bytes = feed.encode();
        assert_eq!(bytes.len(), HEADER_BYTES + FEED_ANSWERS * ANSWER_BYTES);
        assert_eq!(reader.read(&bytes, &mut model), FEED_ANSWERS);
        // A restarted service's feed starts over: the reader follows it.
        let mut restarted = AnswerFeed::default();
        restarted.push(Answer::new(0, Work::new(0, 100), 20.0));
        assert_eq!(reader.read(&restarted.encode(), &mut model), 1);
    }
}
