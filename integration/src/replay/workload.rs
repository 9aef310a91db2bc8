//! A trace turned into what the simulation needs: per request its arrival
//! time, token counts and block chain, hashed once with the routing core's
//! own [`PromptRenderer`] and [`BlockHasher`] (the pods hash with the same
//! configuration, so one chain serves the router and the pod).

use std::collections::HashSet;
use std::path::Path;

use kvroute::chat_template::PromptRenderer;
use kvroute::config::{Config, ModelTarget};
use kvroute::hashing::{BlockHasher, Coverage};
use kvroute::request::Prompt;
use serde_json::Value;

use crate::model::prompt_tokens;
use crate::trace::{self, timestamp_field, TraceError, TraceRequest};

/// One request ready to be replayed.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// 1-based line in the trace file.
    pub line: usize,
    /// Arrival in simulated microseconds (trace time / speedup).
    pub arrival_us: u64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// The prompt's block chain as the pods cache it: every full block (the
    /// router matches the first `maxPrefixBlocks`).
    pub chain: Vec<u64>,
    /// How blocks cover the prompt's tokens (text blocks count 4 bytes a
    /// token, as the pods do).
    pub coverage: Coverage,
    /// The router can read the body (within `maxBodyBytes`): else it routes
    /// by load alone, as the filter does.
    pub routable: bool,
    /// Key of the ring-hash baseline: the first Mooncake hash id (Mooncake
    /// has no session id), or the first block hash for OpenAI bodies.
    pub session_key: u64,
    /// As the filter reads it from a chat body
    /// ([`kvroute::request::ParsedRequest::follows_up`]; `None` for
    /// completions and token traces).
    pub follows_up: Option<bool>,
}

/// The requests of a trace in arrival order.
#[derive(Debug, Clone)]
pub struct Workload {
    pub requests: Vec<Request>,
    /// Lines that were out of timestamp order (the replay sorts them, stably).
    pub reordered: usize,
}

/// Input trace formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Mooncake,
    OpenAi,
    /// The Azure LLM inference trace's CSV ([`super::azure`]).
    AzureConv,
}

/// The model name Mooncake requests are sent as.
pub const DEFAULT_MODEL: &str = "mooncake";

impl Workload {
    /// Reads `path` in `format` and hashes every prompt with `config`.
    pub fn load(
        path: &Path,
        format: Format,
        config: &Config,
        model: &str,
        speedup: f64,
    ) -> Result<Workload, TraceError> {
        match format {
            Format::Mooncake => {
                let requests = trace::read_mooncake(path)?;
                Ok(Workload::from_mooncake(&requests, config, model, speedup))
            }
            Format::OpenAi => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| TraceError::new(0, path.display().to_string(), e.to_string()))?;
                Workload::from_openai(&text, config, speedup)
            }
            Format::AzureConv => super::azure::load(path, config, model, speedup),
        }
    }

    /// Mooncake requests as the text prompts of [`trace::prompt_text`].
    pub fn from_mooncake(
        requests: &[TraceRequest],
        config: &Config,
        model: &str,
        speedup: f64,
    ) -> Workload {
        let hasher = BlockHasher::from_config(config).uncapped();
        let target = ModelTarget {
            base_model: model.to_string(),
            adapter: None,
        };
        let out = requests
            .iter()
            .map(|r| {
                let prompt = Prompt::Text(trace::prompt_text(r).into_bytes());
                let chain = hasher.chain(&target, &prompt, None);
                // The completions body: the prompt plus ~100 bytes of JSON.
                let body_bytes = (r.input_length as usize).saturating_mul(4) + 128;
                Request {
                    line: r.line,
                    arrival_us: arrival_us(r.timestamp_ms, speedup),
                    prompt_tokens: r.input_length,
                    output_tokens: r.output_length.max(1),
                    routable: body_bytes <= config.max_body_bytes,
                    session_key: r.hash_ids.first().copied().unwrap_or(r.line as u64),
                    coverage: hasher.coverage(&prompt),
                    chain,
                    follows_up: None,
                }
            })
            .collect();
        Workload::sorted(out)
    }

    /// OpenAI JSONL: per line `{"timestamp": ms, "path": "/v1/completions"
    /// or "/v1/chat/completions" (optional), "body": {..}}`, or the body's
    /// fields at top level next to `timestamp`. The body is parsed by the
    /// routing core's own parser; `max_tokens` (else
    /// `max_completion_tokens`, else 16) is the output length.
    pub fn from_openai(text: &str, config: &Config, speedup: f64) -> Result<Workload, TraceError> {
        let hasher = BlockHasher::from_config(config).uncapped();
        let prompts = PromptRenderer::new(config);
        let mut out = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            if raw.trim().is_empty() {
                continue;
            }
            let line = i + 1;
            let value: Value = serde_json::from_str(raw)
                .map_err(|e| TraceError::new(line, "<line>", format!("is not valid JSON: {e}")))?;
            let object = value
                .as_object()
                .ok_or_else(|| TraceError::new(line, "<line>", "must be a JSON object"))?;
            let timestamp_ms = timestamp_field(line, object)?;
            let path = match object.get("path") {
                None => None,
                Some(Value::String(p)) => Some(p.as_str()),
                Some(other) => {
                    return Err(TraceError::new(
                        line,
                        "path",
                        format!("must be a string, got {other}"),
                    ))
                }
            };
            let (body, field) = match object.get("body") {
                Some(body @ Value::Object(_)) => (body.clone(), "body"),
                Some(other) => {
                    return Err(TraceError::new(
                        line,
                        "body",
                        format!("must be a JSON object, got {other}"),
                    ))
                }
                None => {
                    let mut flat = object.clone();
                    flat.remove("timestamp");
                    flat.remove("path");
                    (Value::Object(flat), "<line>")
                }
            };
            let chat = match path {
                Some(p) => p.ends_with("/chat/completions"),
                None => body.get("messages").is_some(),
            };
            let bytes = serde_json::to_vec(&body).expect("JSON serialises");
            let parsed = prompts.prompt(&bytes, chat).map_err(|e| {
                TraceError::new(line, field, format!("is not a valid request: {}", e.0))
            })?;
            let target = config.resolve_model(&parsed.model).ok_or_else(|| {
                TraceError::new(
                    line,
                    format!("{field}.model"),
                    format!(
                        "model {:?} is not in the configuration's models",
                        parsed.model
                    ),
                )
            })?;
            let output = ["max_tokens", "max_completion_tokens"]
                .iter()
                .find_map(|k| body.get(*k).and_then(Value::as_u64))
                .unwrap_or(16)
                .max(1);
            let chain = hasher.chain(&target, &parsed.prompt, parsed.cache_salt.as_deref());
            out.push(Request {
                line,
                arrival_us: arrival_us(timestamp_ms, speedup),
                prompt_tokens: prompt_tokens(&parsed.prompt),
                output_tokens: output,
                routable: bytes.len() <= config.max_body_bytes,
                session_key: chain.first().copied().unwrap_or(line as u64),
                coverage: hasher.coverage(&parsed.prompt),
                chain,
                follows_up: parsed.follows_up,
            });
        }
        Ok(Workload::sorted(out))
    }

    pub(crate) fn sorted(mut requests: Vec<Request>) -> Workload {
        let reordered = requests
            .windows(2)
            .filter(|w| w[1].arrival_us < w[0].arrival_us)
            .count();
        requests.sort_by_key(|r| r.arrival_us);
        Workload {
            requests,
            reordered,
        }
    }

    /// `copies` copies of the workload side by side: the same arrivals
    /// (copy c 1 µs after copy c − 1), each copy's blocks its own (every
    /// hash XORed with a per-copy constant, so prefixes are shared within a
    /// copy exactly as in the trace and never across copies). A pool of N×
    /// the pods then sees N× the load with each prefix as hot as before:
    /// the pool grows, not the hot spots.
    pub fn replicated(&self, copies: usize) -> Workload {
        let lines = self.requests.iter().map(|r| r.line).max().unwrap_or(0);
        let requests = (0..copies.max(1) as u64)
            .flat_map(|c| {
                let key = if c == 0 {
                    0
                } else {
                    xxhash_rust::xxh64::xxh64(&c.to_le_bytes(), 0x5ca1e)
                };
                self.requests.iter().map(move |r| Request {
                    line: r.line + c as usize * lines,
                    arrival_us: r.arrival_us + c,
                    chain: r.chain.iter().map(|h| h ^ key).collect(),
                    session_key: r.session_key ^ key,
                    ..r.clone()
                })
            })
            .collect();
        Workload {
            reordered: self.reordered,
            ..Workload::sorted(requests)
        }
    }

    /// Distinct blocks over all chains: the working set.
    pub fn unique_blocks(&self) -> usize {
        let mut seen = HashSet::new();
        for r in &self.requests {
            seen.extend(r.chain.iter().copied());
        }
        seen.len()
    }

    pub fn prompt_tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.prompt_tokens).sum()
    }

    /// Time of the last arrival.
    pub fn span_us(&self) -> u64 {
        self.requests.last().map_or(0, |r| r.arrival_us)
    }
}

fn arrival_us(timestamp_ms: f64, speedup: f64) -> u64 {
    (timestamp_ms * 1000.0 / speedup).round() as u64
}
