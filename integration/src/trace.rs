//! Request traces shared by the offline replay (`kvroute-replay`) and the
//! real-Envoy benchmark, so both can be fed the same request sequence.
//!
//! A Mooncake trace is JSONL, one request per line:
//! `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
//! "hash_ids": [ints]}`. Each hash id stands for one 512-token block of the
//! prompt; requests sharing leading ids share that prefix.
//!
//! [`prompt_text`] turns a line into a concrete prompt for the simulator's
//! 4-bytes-per-token tokenizer:
//! - each hash id expands to a fixed 2048-byte (512-token) chunk of
//!   lowercase words derived from the id alone (so equal ids give equal
//!   text); a chunk starts with `#<id as 16 hex digits> `, so chunks of
//!   different ids already differ in their first 64-byte block;
//! - the chunks are concatenated and cut to `input_length × 4` bytes (in
//!   Mooncake the last id usually covers a partial block);
//! - tokens of `input_length` beyond `len(hash_ids) × 512` are filler
//!   unique to the line (derived from the line number).
//!
//! The text is ASCII without quotes or backslashes, so it embeds in JSON
//! unchanged and its byte length is exactly `input_length × 4`.

use std::fmt;
use std::path::Path;

use serde_json::{json, Map, Value};

/// Tokens per Mooncake hash id.
pub const TRACE_BLOCK_TOKENS: usize = 512;
/// Bytes per token of the simulated tokenizer (`kvroute::hashing::BYTES_PER_TOKEN`).
pub const BYTES_PER_TOKEN: usize = kvroute::hashing::BYTES_PER_TOKEN;
/// Bytes of the text chunk of one hash id.
pub const CHUNK_BYTES: usize = TRACE_BLOCK_TOKENS * BYTES_PER_TOKEN;

/// One line of a Mooncake trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRequest {
    /// 1-based line number in the trace file (also seeds the unique filler).
    pub line: usize,
    /// Arrival time in milliseconds from the trace start.
    pub timestamp_ms: f64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Output tokens.
    pub output_length: u64,
    /// Ids of the prompt's 512-token blocks, in order.
    pub hash_ids: Vec<u64>,
}

/// A trace that could not be read: the line (1-based, 0 for the file
/// itself) and the field at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceError {
    pub line: usize,
    pub field: String,
    pub message: String,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.field, self.message)
        } else {
            write!(
                f,
                "line {}: field `{}`: {}",
                self.line, self.field, self.message
            )
        }
    }
}

impl std::error::Error for TraceError {}

impl TraceError {
    pub fn new(line: usize, field: impl Into<String>, message: impl Into<String>) -> TraceError {
        TraceError {
            line,
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Reads a Mooncake trace file. Blank lines are skipped; any other line
/// that is not a valid request is an error naming its line and field.
pub fn read_mooncake(path: impl AsRef<Path>) -> Result<Vec<TraceRequest>, TraceError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path)
        .map_err(|e| TraceError::new(0, path.display().to_string(), e.to_string()))?;
    parse_mooncake(&text)
}

/// Parses Mooncake JSONL text (see [`read_mooncake`]).
pub fn parse_mooncake(text: &str) -> Result<Vec<TraceRequest>, TraceError> {
    let mut requests = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        requests.push(parse_mooncake_line(i + 1, raw)?);
    }
    Ok(requests)
}

/// Parses one Mooncake line; `line` is its 1-based number.
pub fn parse_mooncake_line(line: usize, text: &str) -> Result<TraceRequest, TraceError> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| TraceError::new(line, "<line>", format!("is not valid JSON: {e}")))?;
    let object = value
        .as_object()
        .ok_or_else(|| TraceError::new(line, "<line>", "must be a JSON object"))?;
    let timestamp_ms = timestamp_field(line, object)?;
    let input_length = count_field(line, object, "input_length")?;
    let output_length = count_field(line, object, "output_length")?;
    let hash_ids = match object.get("hash_ids") {
        None => return Err(TraceError::new(line, "hash_ids", "is missing")),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(j, item)| {
                item.as_u64().ok_or_else(|| {
                    TraceError::new(
                        line,
                        format!("hash_ids[{j}]"),
                        format!("must be a non-negative integer, got {item}"),
                    )
                })
            })
            .collect::<Result<Vec<u64>, TraceError>>()?,
        Some(other) => {
            return Err(TraceError::new(
                line,
                "hash_ids",
                format!("must be a list of integers, got {other}"),
            ))
        }
    };
    let covered = input_length.div_ceil(TRACE_BLOCK_TOKENS as u64);
    if hash_ids.len() as u64 > covered {
        return Err(TraceError::new(
            line,
            "hash_ids",
            format!(
                "has {} ids but input_length {input_length} covers only {covered} blocks of {TRACE_BLOCK_TOKENS} tokens",
                hash_ids.len()
            ),
        ));
    }
    Ok(TraceRequest {
        line,
        timestamp_ms,
        input_length,
        output_length,
        hash_ids,
    })
}

/// The `timestamp` field: a finite, non-negative number of milliseconds.
pub fn timestamp_field(line: usize, object: &Map<String, Value>) -> Result<f64, TraceError> {
    match object.get("timestamp") {
        None => Err(TraceError::new(line, "timestamp", "is missing")),
        Some(v) => v
            .as_f64()
            .filter(|t| t.is_finite() && *t >= 0.0)
            .ok_or_else(|| {
                TraceError::new(
                    line,
                    "timestamp",
                    format!("must be a non-negative number of milliseconds, got {v}"),
                )
            }),
    }
}

fn count_field(line: usize, object: &Map<String, Value>, name: &str) -> Result<u64, TraceError> {
    match object.get(name) {
        None => Err(TraceError::new(line, name, "is missing")),
        Some(v) => v.as_u64().ok_or_else(|| {
            TraceError::new(
                line,
                name,
                format!("must be a non-negative integer, got {v}"),
            )
        }),
    }
}

/// splitmix64: the seeded generator behind chunk and filler text.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// 26 letters and 6 spaces: 5 random bits pick one (words of ~4 letters).
const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz      ";

/// Appends `len` bytes of text: `header`, then seeded random words.
fn generate(out: &mut Vec<u8>, header: &[u8], seed: u64, len: usize) {
    let start = out.len();
    out.extend_from_slice(&header[..header.len().min(len)]);
    let mut state = seed;
    while out.len() - start < len {
        let mut bits = splitmix(&mut state);
        for _ in 0..12 {
            if out.len() - start == len {
                break;
            }
            out.push(ALPHABET[(bits & 31) as usize]);
            bits >>= 5;
        }
    }
}

const CHUNK_DOMAIN: u64 = 0x6b76_726f_7574_6531; // "kvroute1"
const FILLER_DOMAIN: u64 = 0x6669_6c6c_6572_3031; // "filler01"

/// The 2048-byte text chunk of hash id `id`.
pub fn chunk_text(id: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(CHUNK_BYTES);
    let header = format!("#{id:016x} ");
    generate(&mut out, header.as_bytes(), id ^ CHUNK_DOMAIN, CHUNK_BYTES);
    out
}

/// The full prompt text of `request`: `input_length × 4` ASCII bytes.
pub fn prompt_text(request: &TraceRequest) -> String {
    let len = (request.input_length as usize).saturating_mul(BYTES_PER_TOKEN);
    let mut out = Vec::with_capacity(len);
    for &id in &request.hash_ids {
        if out.len() >= len {
            break;
        }
        let want = (len - out.len()).min(CHUNK_BYTES);
        let header = format!("#{id:016x} ");
        generate(&mut out, header.as_bytes(), id ^ CHUNK_DOMAIN, want);
    }
    if out.len() < len {
        let header = format!("#filler-line-{} ", request.line);
        let seed = (request.line as u64).wrapping_mul(0x2545_f491_4f6c_dd1d) ^ FILLER_DOMAIN;
        let want = len - out.len();
        generate(&mut out, header.as_bytes(), seed, want);
    }
    String::from_utf8(out).expect("generated text is ASCII")
}

/// An OpenAI `/v1/completions` body for `request`: the prompt text, and
/// `max_tokens` = `output_length` (at least 1).
pub fn completions_body(request: &TraceRequest, model: &str, stream: bool) -> Value {
    json!({
        "model": model,
        "prompt": prompt_text(request),
        "max_tokens": request.output_length.max(1),
        "temperature": 0,
        "stream": stream,
    })
}

/// One line of the OpenAI JSONL trace format `kvroute-replay --format
/// openai` reads: `{"timestamp": ms, "path": "/v1/completions", "body": {..}}`.
pub fn openai_line(request: &TraceRequest, model: &str) -> Value {
    json!({
        "timestamp": request.timestamp_ms,
        "path": "/v1/completions",
        "body": completions_body(request, model, false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(line: usize, input: u64, ids: &[u64]) -> TraceRequest {
        TraceRequest {
            line,
            timestamp_ms: 0.0,
            input_length: input,
            output_length: 4,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn chunks_are_deterministic_and_distinct_in_the_first_block() {
        assert_eq!(chunk_text(7), chunk_text(7));
        assert_eq!(chunk_text(7).len(), CHUNK_BYTES);
        for (a, b) in [(0u64, 1u64), (7, 8), (1 << 40, 1)] {
            assert_ne!(chunk_text(a)[..64], chunk_text(b)[..64]);
        }
        assert!(chunk_text(3)
            .iter()
            .all(|&c| c.is_ascii_graphic() || c == b' '));
        assert!(!chunk_text(3).contains(&b'"') && !chunk_text(3).contains(&b'\\'));
    }

    #[test]
    fn shared_ids_give_shared_prefixes_and_lengths_are_exact() {
        let a = prompt_text(&request(1, 1000, &[5, 6]));
        let b = prompt_text(&request(2, 1500, &[5, 9, 10]));
        assert_eq!(a.len(), 4000);
        assert_eq!(b.len(), 6000);
        assert_eq!(a[..CHUNK_BYTES], b[..CHUNK_BYTES]);
        assert_ne!(
            a[CHUNK_BYTES..CHUNK_BYTES + 64],
            b[CHUNK_BYTES..CHUNK_BYTES + 64]
        );
        assert_eq!(&a[..CHUNK_BYTES], String::from_utf8(chunk_text(5)).unwrap());
        // Filler beyond the ids is unique per line.
        let c = prompt_text(&request(3, 600, &[5]));
        let d = prompt_text(&request(4, 600, &[5]));
        assert_eq!(c.len(), 2400);
        assert_ne!(c[CHUNK_BYTES..], d[CHUNK_BYTES..]);
    }

    #[test]
    fn malformed_lines_name_line_and_field() {
        let good =
            r#"{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}"#;
        let cases = [
            ("not json", "<line>"),
            ("[1]", "<line>"),
            (
                r#"{"input_length": 1, "output_length": 1, "hash_ids": []}"#,
                "timestamp",
            ),
            (
                r#"{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": []}"#,
                "timestamp",
            ),
            (
                r#"{"timestamp": 0, "input_length": "9", "output_length": 1, "hash_ids": []}"#,
                "input_length",
            ),
            (
                r#"{"timestamp": 0, "input_length": 9, "hash_ids": []}"#,
                "output_length",
            ),
            (
                r#"{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1, -2]}"#,
                "hash_ids[1]",
            ),
            (
                r#"{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1, 2]}"#,
                "hash_ids",
            ),
        ];
        for (bad, field) in cases {
            let text = format!("{good}\n\n{bad}\n{good}\n");
            let err = parse_mooncake(&text).unwrap_err();
            assert_eq!((err.line, err.field.as_str()), (3, field), "{bad}: {err}");
            assert!(err.to_string().starts_with("line 3: field"), "{err}");
        }
        assert_eq!(parse_mooncake(&format!("{good}\n{good}")).unwrap().len(), 2);
    }
}
