//! OpenAI-style request bodies → what routing needs: the model name and the
//! prompt in canonical form.
//!
//! Canonical form (shared with the simulated pods, which hash the same way):
//! - `/v1/completions`: `prompt` as a string → its UTF-8 bytes (text mode);
//!   a list of strings → the first string (a batch is routed as one);
//!   a list of token IDs → those IDs (token mode); a list of token lists →
//!   the first list.
//! - `/v1/chat/completions`: for each message in order, its `role`, the byte
//!   0x1F, the text of its content (a string, or the `text` of each
//!   `{"type": "text"}` part in order, parts separated by 0x1F), then 0x1E.
//!   Non-text parts (images, audio) do not contribute.
//!
//! A base model with a chat template in the configuration is hashed as the
//! text vLLM tokenizes instead ([`crate::chat_template::PromptRenderer`],
//! which reads every body the router and the simulated pods see).
//!
//! vLLM's `cache_salt` (a string, either endpoint) is kept apart: vLLM
//! hashes it into a prompt's first block, so requests with different
//! salts never share cache, and kvroute seeds their chains apart too
//! ([`crate::hashing::ChainSeed::salted`]). An empty salt is no salt, as in
//! vLLM.

use serde_json::Value;

/// A prompt ready to be hashed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(Vec<u8>),
    Tokens(Vec<u32>),
}

impl Prompt {
    /// Prompt length in its own unit (bytes or tokens).
    pub fn len(&self) -> usize {
        match self {
            Prompt::Text(bytes) => bytes.len(),
            Prompt::Tokens(tokens) => tokens.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The routing-relevant content of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedRequest {
    pub model: String,
    pub prompt: Prompt,
    pub stream: bool,
    /// vLLM's `cache_salt` (`None`: absent or empty).
    pub cache_salt: Option<String>,
    /// Whether the answer will carry `usage` (with vLLM's
    /// `cached_tokens`): always unless streamed, and a streamed one only
    /// with `stream_options.include_usage` (or `continuous_usage_stats`).
    pub answer_reports_usage: bool,
    /// A chat whose messages include an assistant turn continues a
    /// conversation; one without opens it. A completion says neither
    /// (`None`).
    pub follows_up: Option<bool>,
}

/// Why a body could not be used for cache-aware routing. The message is
/// returned to clients in reject mode, so it names the offending field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestError(pub String);

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

const UNIT_SEPARATOR: u8 = 0x1f;
const RECORD_SEPARATOR: u8 = 0x1e;

/// Parses a request body. `chat` selects the `messages` form.
pub fn parse_request(body: &[u8], chat: bool) -> Result<ParsedRequest, RequestError> {
    let (object, envelope) = parse_envelope(body)?;
    with_canonical_prompt(object, envelope, chat)
}

/// The request of a parsed body with its prompt in canonical form.
pub(crate) fn with_canonical_prompt(
    mut object: serde_json::Map<String, Value>,
    envelope: Envelope,
    chat: bool,
) -> Result<ParsedRequest, RequestError> {
    if chat {
        let messages = object.get("messages");
        let prompt = canonical_messages(messages)?;
        let roles = messages
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|m| m.get("role").and_then(Value::as_str));
        return Ok(envelope.with_chat(prompt, follows_up(roles)));
    }
    // Taken out of the parsed body: a 512 KiB prompt is not copied.
    Ok(envelope.with_prompt(canonical_prompt(object.remove("prompt"))?))
}

/// Whether a chat with messages of these roles continues a conversation
/// ([`ParsedRequest::follows_up`]).
pub(crate) fn follows_up<'a>(mut roles: impl Iterator<Item = &'a str>) -> bool {
    roles.any(|role| role == "assistant")
}

/// What routing reads from every request but its prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Envelope {
    pub model: String,
    pub stream: bool,
    pub cache_salt: Option<String>,
    pub answer_reports_usage: bool,
}

impl Envelope {
    /// A completion's request.
    pub fn with_prompt(self, prompt: Prompt) -> ParsedRequest {
        ParsedRequest {
            model: self.model,
            prompt,
            stream: self.stream,
            cache_salt: self.cache_salt,
            answer_reports_usage: self.answer_reports_usage,
            follows_up: None,
        }
    }

    /// A chat's request ([`ParsedRequest::follows_up`]).
    pub fn with_chat(self, prompt: Prompt, follows_up: bool) -> ParsedRequest {
        ParsedRequest {
            follows_up: Some(follows_up),
            ..self.with_prompt(prompt)
        }
    }
}

/// The body as a JSON object, and its [`Envelope`].
pub(crate) fn parse_envelope(
    body: &[u8],
) -> Result<(serde_json::Map<String, Value>, Envelope), RequestError> {
    if body.is_empty() {
        return Err(RequestError("request body is empty".into()));
    }
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| RequestError(format!("request body is not valid JSON: {e}")))?;
    let Value::Object(object) = value else {
        return Err(RequestError("request body must be a JSON object".into()));
    };
    let envelope = envelope(|name| object.get(name))?;
    Ok((object, envelope))
}

/// The fields an [`Envelope`] is read from.
pub(crate) const ENVELOPE_FIELDS: [&str; 4] = ["model", "stream", "cache_salt", "stream_options"];

/// The envelope of a body whose top-level fields `field` returns.
pub(crate) fn envelope<'a>(
    field: impl Fn(&str) -> Option<&'a Value>,
) -> Result<Envelope, RequestError> {
    let model = match field("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        Some(_) => return Err(RequestError("`model` must be a non-empty string".into())),
        None => return Err(RequestError("`model` is missing".into())),
    };
    let stream = match field("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(RequestError("`stream` must be a boolean".into())),
    };
    let cache_salt = match field("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(salt)) => Some(salt.clone()).filter(|s| !s.is_empty()),
        Some(_) => return Err(RequestError("`cache_salt` must be a string".into())),
    };
    let stream_option = |name: &str| {
        field("stream_options")
            .and_then(|o| o.get(name))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    };
    let answer_reports_usage =
        !stream || stream_option("include_usage") || stream_option("continuous_usage_stats");
    Ok(Envelope {
        model,
        stream,
        cache_salt,
        answer_reports_usage,
    })
}

pub(crate) fn canonical_prompt(prompt: Option<Value>) -> Result<Prompt, RequestError> {
    match prompt {
        None => Err(RequestError("`prompt` is missing".into())),
        Some(Value::String(text)) => Ok(Prompt::Text(text.into_bytes())),
        Some(Value::Array(mut items)) => match items.first_mut() {
            None => Err(RequestError("`prompt` is an empty list".into())),
            Some(Value::String(text)) => Ok(Prompt::Text(std::mem::take(text).into_bytes())),
            Some(Value::Number(_)) => token_ids(&items).map(Prompt::Tokens),
            Some(Value::Array(first)) => token_ids(first).map(Prompt::Tokens),
            Some(_) => Err(RequestError(
                "`prompt` must be a string, a list of strings or a list of token IDs".into(),
            )),
        },
        Some(_) => Err(RequestError(
            "`prompt` must be a string, a list of strings or a list of token IDs".into(),
        )),
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, RequestError> {
    items
        .iter()
        .map(|item| {
            item.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    RequestError("`prompt` token IDs must be integers in 0..2^32".into())
                })
        })
        .collect()
}

pub(crate) fn canonical_messages(messages: Option<&Value>) -> Result<Prompt, RequestError> {
    let messages = match messages {
        None => return Err(RequestError("`messages` is missing".into())),
        Some(Value::Array(list)) if !list.is_empty() => list,
        Some(_) => return Err(RequestError("`messages` must be a non-empty list".into())),
    };
    let mut text = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        let role = message
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| RequestError(format!("`messages[{i}].role` must be a string")))?;
        text.extend_from_slice(role.as_bytes());
        text.push(UNIT_SEPARATOR);
        match message.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(content)) => text.extend_from_slice(content.as_bytes()),
            Some(Value::Array(parts)) => {
                let texts = parts
                    .iter()
                    .filter(|part| part.get("type").and_then(Value::as_str) == Some("text"))
                    .filter_map(|part| part.get("text").and_then(Value::as_str));
                for (j, part) in texts.enumerate() {
                    if j > 0 {
                        text.push(UNIT_SEPARATOR);
                    }
                    text.extend_from_slice(part.as_bytes());
                }
            }
            Some(_) => {
                return Err(RequestError(format!(
                    "`messages[{i}].content` must be a string or a list of parts"
                )))
            }
        }
        text.push(RECORD_SEPARATOR);
    }
    Ok(Prompt::Text(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_says_whether_it_continues_a_conversation() {
        let follows_up =
            |body: &str, chat| parse_request(body.as_bytes(), chat).unwrap().follows_up;
        let opening = r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"q"}]}"#;
        let later = r#"{"model":"m","messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"user","content":"r"}]}"#;
        assert_eq!(follows_up(opening, true), Some(false));
        assert_eq!(follows_up(later, true), Some(true));
        assert_eq!(follows_up(r#"{"model":"m","prompt":"q"}"#, false), None);
    }

    #[test]
    fn completions_forms() {
        let r = parse_request(br#"{"model":"m","prompt":"hello"}"#, false).unwrap();
        assert_eq!(r.prompt, Prompt::Text(b"hello".to_vec()));
        assert!(!r.stream);
        let r = parse_request(br#"{"model":"m","prompt":["a","b"],"stream":true}"#, false).unwrap();
        assert_eq!(r.prompt, Prompt::Text(b"a".to_vec()));
        assert!(r.stream);
        let r = parse_request(br#"{"model":"m","prompt":[1,2,3]}"#, false).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![1, 2, 3]));
        let r = parse_request(br#"{"model":"m","prompt":[[4,5],[6]]}"#, false).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![4, 5]));
    }

    #[test]
    fn chat_canonical_form() {
        let body = br#"{"model":"m","messages":[
            {"role":"system","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"there"}]}
        ]}"#;
        let r = parse_request(body, true).unwrap();
        assert_eq!(
            r.prompt,
            Prompt::Text(b"system\x1fbe brief\x1euser\x1fhi\x1fthere\x1e".to_vec())
        );
    }

    #[test]
    fn a_streamed_answer_reports_usage_only_when_asked() {
        let usage = |body: &[u8]| parse_request(body, false).unwrap().answer_reports_usage;
        assert!(usage(br#"{"model":"m","prompt":"x"}"#));
        assert!(!usage(br#"{"model":"m","prompt":"x","stream":true}"#));
        assert!(usage(
            br#"{"model":"m","prompt":"x","stream":true,"stream_options":{"include_usage":true}}"#
        ));
        assert!(!usage(
            br#"{"model":"m","prompt":"x","stream":true,"stream_options":{"include_usage":false}}"#
        ));
    }

    #[test]
    fn cache_salt_is_kept_apart() {
        let salt = |body: &[u8], chat| parse_request(body, chat).unwrap().cache_salt;
        assert_eq!(
            salt(br#"{"model":"m","prompt":"x","cache_salt":"t"}"#, false).as_deref(),
            Some("t")
        );
        let chat = br#"{"model":"m","messages":[{"role":"user","content":"x"}],"cache_salt":"t"}"#;
        assert_eq!(salt(chat, true).as_deref(), Some("t"));
        assert_eq!(
            salt(br#"{"model":"m","prompt":"x","cache_salt":""}"#, false),
            None
        );
        assert_eq!(salt(br#"{"model":"m","prompt":"x"}"#, false), None);
    }

    #[test]
    fn errors_name_the_field() {
        let cases: [(&[u8], bool, &str); 10] = [
            (b"", false, "empty"),
            (b"\xff\x00binary", false, "not valid JSON"),
            (b"[1]", false, "JSON object"),
            (br#"{"prompt":"x"}"#, false, "`model` is missing"),
            (br#"{"model":3,"prompt":"x"}"#, false, "`model`"),
            (br#"{"model":"m"}"#, false, "`prompt` is missing"),
            (br#"{"model":"m","prompt":[-1]}"#, false, "token IDs"),
            (
                br#"{"model":"m","messages":[{"content":"x"}]}"#,
                true,
                "messages[0].role",
            ),
            (
                br#"{"model":"m","prompt":"x","stream":"yes"}"#,
                false,
                "`stream`",
            ),
            (
                br#"{"model":"m","prompt":"x","cache_salt":1}"#,
                false,
                "`cache_salt`",
            ),
        ];
        for (body, chat, needle) in cases {
            let err = parse_request(body, chat).unwrap_err();
            assert!(
                err.0.contains(needle),
                "{:?} → {}",
                String::from_utf8_lossy(body),
                err
            );
        }
    }
}
