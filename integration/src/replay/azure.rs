//! The Azure LLM inference trace (2023, conversation service) as replay
//! requests: `TIMESTAMP,ContextTokens,GeneratedTokens` per line.
//!
//! The trace has real arrival times and lengths but no content and no
//! session ids, so its conversations are rebuilt by one rule, stated here
//! because every figure on this trace rests on it: a request *continues*
//! the open conversation whose history (its last prompt plus the answer to
//! it) is the longest that still fits in the request's context, among
//! conversations whose last turn arrived within [`CONVERSATION_WINDOW_MS`]
//! (a user's think time); each conversation is continued at most once per
//! turn; a request no conversation fits starts a new one. Each
//! conversation's tokens are its own (ids drawn from its number and the
//! position), so a continuation shares exactly its history with the turn
//! before it, and different conversations share nothing. On the whole
//! trace: 19,366 requests, 7,756 conversations, 54 % of prompt tokens in a
//! history (the infinite-cache bound), a median new message of 474 tokens.
//!
//! Prompts are token-ID prompts, hashed in `blockSizeTokens` blocks as the
//! filter hashes a `/v1/completions` token prompt.

use std::path::Path;

use kvroute::config::{Config, ModelTarget};
use kvroute::hashing::BlockHasher;
use kvroute::request::Prompt;
use xxhash_rust::xxh64::xxh64;

use super::workload::{Request, Workload};
use crate::trace::TraceError;

/// How long after a conversation's last turn a request may still continue
/// it (10 minutes).
pub const CONVERSATION_WINDOW_MS: f64 = 600_000.0;

/// One line of the trace.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Line {
    line: usize,
    /// Since the first line's timestamp.
    at_ms: f64,
    context: u64,
    generated: u64,
}

/// An open conversation: when its last turn arrived and how long its
/// history is (that prompt plus its answer).
#[derive(Debug, Clone, Copy)]
struct Open {
    id: u64,
    last_ms: f64,
    history: u64,
}

/// Reads the trace at `path` as requests for `model`, hashed with `config`.
pub fn load(
    path: &Path,
    config: &Config,
    model: &str,
    speedup: f64,
) -> Result<Workload, TraceError> {
    from_csv(&read(path)?, config, model, speedup)
}

/// The trace's text.
pub fn read(path: &Path) -> Result<String, TraceError> {
    std::fs::read_to_string(path)
        .map_err(|e| TraceError::new(0, path.display().to_string(), e.to_string()))
}

/// See the module documentation.
pub fn from_csv(
    text: &str,
    config: &Config,
    model: &str,
    speedup: f64,
) -> Result<Workload, TraceError> {
    let hasher = BlockHasher::from_config(config).uncapped();
    let target = ModelTarget {
        base_model: model.to_string(),
        adapter: None,
    };
    let requests = turns(text)?
        .into_iter()
        .map(|turn| {
            let prompt = Prompt::Tokens(turn.tokens());
            Request {
                line: turn.line,
                arrival_us: (turn.at_ms * 1000.0 / speedup).round() as u64,
                prompt_tokens: turn.context,
                output_tokens: turn.generated.max(1),
                chain: hasher.chain(&target, &prompt, None),
                coverage: hasher.coverage(&prompt),
                // A token prompt's body is ~6 bytes a token.
                routable: (turn.context as usize).saturating_mul(6) + 128 <= config.max_body_bytes,
                session_key: turn.conversation,
                follows_up: None,
            }
        })
        .collect();
    Ok(Workload::sorted(requests))
}

/// The trace as OpenAI JSONL lines (`{"timestamp", "path", "body"}` with
/// token-ID prompts), for `--emit-openai`: what a client would send.
pub fn openai_lines(text: &str, model: &str) -> Result<Vec<serde_json::Value>, TraceError> {
    Ok(turns(text)?
        .into_iter()
        .map(|turn| {
            serde_json::json!({
                "timestamp": turn.at_ms,
                "path": "/v1/completions",
                "body": {"model": model, "prompt": turn.tokens(), "max_tokens": turn.generated.max(1)},
            })
        })
        .collect())
}

/// One request of the trace in its conversation.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Turn {
    line: usize,
    at_ms: f64,
    context: u64,
    generated: u64,
    conversation: u64,
}

impl Turn {
    /// Its prompt: the conversation's first `context` tokens.
    fn tokens(&self) -> Vec<u32> {
        (0..self.context)
            .map(|position| conversation_token(self.conversation, position))
            .collect()
    }
}

/// The trace's lines in their conversations (see the module documentation).
fn turns(text: &str) -> Result<Vec<Turn>, TraceError> {
    let mut open: Vec<Open> = Vec::new();
    let mut conversations = 0u64;
    let mut turns = Vec::new();
    for l in parse(text)? {
        open.retain(|c| l.at_ms - c.last_ms <= CONVERSATION_WINDOW_MS);
        let fit = open
            .iter()
            .enumerate()
            .filter(|(_, c)| c.history <= l.context)
            .max_by_key(|(_, c)| (c.history, std::cmp::Reverse(c.id)))
            .map(|(i, _)| i);
        let conversation = match fit {
            Some(i) => open.swap_remove(i).id,
            None => {
                conversations += 1;
                conversations
            }
        };
        open.push(Open {
            id: conversation,
            last_ms: l.at_ms,
            history: l.context + l.generated,
        });
        turns.push(Turn {
            line: l.line,
            at_ms: l.at_ms,
            context: l.context,
            generated: l.generated,
            conversation,
        });
    }
    Ok(turns)
}

/// Token `position` of conversation `id`.
fn conversation_token(id: u64, position: u64) -> u32 {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&id.to_le_bytes());
    key[8..].copy_from_slice(&position.to_le_bytes());
    // Below 2^17: a plausible vocabulary.
    (xxh64(&key, 0x0a2e) % 131_072) as u32
}

fn parse(text: &str) -> Result<Vec<Line>, TraceError> {
    let mut lines = Vec::new();
    let mut first_ms = None;
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let raw = raw.trim();
        if raw.is_empty() || (line == 1 && raw.starts_with("TIMESTAMP")) {
            continue;
        }
        let fields: Vec<&str> = raw.split(',').collect();
        let [stamp, context, generated] = fields[..] else {
            return Err(TraceError::new(
                line,
                "<line>",
                format!(
                    "must be TIMESTAMP,ContextTokens,GeneratedTokens (got {} fields)",
                    fields.len()
                ),
            ));
        };
        let count = |field: &str, value: &str| {
            value.trim().parse::<u64>().map_err(|_| {
                TraceError::new(
                    line,
                    field,
                    format!("must be a whole number (got {value:?})"),
                )
            })
        };
        let ms = timestamp_ms(stamp).ok_or_else(|| {
            TraceError::new(
                line,
                "TIMESTAMP",
                format!("must be YYYY-MM-DD HH:MM:SS[.fraction] (got {stamp:?})"),
            )
        })?;
        let first = *first_ms.get_or_insert(ms);
        lines.push(Line {
            line,
            at_ms: (ms - first).max(0.0),
            context: count("ContextTokens", context)?,
            generated: count("GeneratedTokens", generated)?,
        });
    }
    Ok(lines)
}

/// Milliseconds since 1970 of `YYYY-MM-DD HH:MM:SS[.fraction]` (UTC).
fn timestamp_ms(stamp: &str) -> Option<f64> {
    let (date, time) = stamp.trim().split_once(' ')?;
    let mut ymd = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, d) = (ymd.next()??, ymd.next()??, ymd.next()??);
    let mut hms = time.split(':');
    let (h, min) = (
        hms.next()?.parse::<f64>().ok()?,
        hms.next()?.parse::<f64>().ok()?,
    );
    let s = hms.next()?.parse::<f64>().ok()?;
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days as f64 * 24.0 + h) * 60.0 + min) * 60_000.0 + s * 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CSV: &str = "TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.5000000,100,20
2023-11-16 18:15:47.5000000,150,10
2023-11-16 18:15:48.0000000,50,5
2023-11-16 18:30:00.0000000,400,5
";

    fn config() -> Config {
        Config {
            block_size_tokens: 16,
            ..Config::default()
        }
    }

    #[test]
    fn conversations_continue_the_longest_history_that_fits() {
        let workload = from_csv(CSV, &config(), "m", 1.0).unwrap();
        let r = &workload.requests;
        assert_eq!(r.len(), 4);
        assert_eq!(
            r.iter().map(|r| r.arrival_us).collect::<Vec<_>>(),
            [0, 1_000_000, 1_500_000, 853_500_000]
        );
        // Line 3 continues line 2 (history 120 ≤ 150): they share line 2's
        // 6 full blocks; line 4 (50 tokens) fits no history and starts anew.
        assert_eq!(r[1].session_key, r[0].session_key);
        assert_eq!((r[0].chain.len(), r[1].chain.len()), (6, 9));
        assert_eq!(r[1].chain[..6], r[0].chain[..]);
        assert_ne!(r[2].session_key, r[0].session_key);
        assert_ne!(r[2].chain[0], r[0].chain[0]);
        // 14 minutes later the conversations have closed: a new one.
        assert_ne!(r[3].session_key, r[1].session_key);
        assert_eq!((r[0].prompt_tokens, r[0].output_tokens), (100, 20));
    }

    #[test]
    fn bad_lines_are_named() {
        let bad = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,x,1\n";
        let error = from_csv(bad, &config(), "m", 1.0).unwrap_err();
        assert_eq!((error.line, error.field.as_str()), (2, "ContextTokens"));
        let short = "2023-11-16 18:15:46,1\n";
        assert_eq!(from_csv(short, &config(), "m", 1.0).unwrap_err().line, 1);
        let stamp = "yesterday,1,1\n";
        assert_eq!(
            from_csv(stamp, &config(), "m", 1.0).unwrap_err().field,
            "TIMESTAMP"
        );
    }
}
