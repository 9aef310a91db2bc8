//! The prompt text vLLM tokenizes, for base models with a configured
//! `chatTemplates` entry ([`PromptRenderer`]), so kvroute's text-mode
//! chain covers the same bytes as the tokens vLLM caches.
//!
//! - `/v1/chat/completions`: the model's chat template rendered as vLLM
//!   renders it (vLLM's `parse_chat_messages` and `build_chat_params`, then
//!   transformers 4.x `apply_chat_template(..., tokenize=False)`): jinja2
//!   with `trim_blocks` and `lstrip_blocks`, lenient undefined values,
//!   transformers' `tojson` (Python's `json.dumps`, `ensure_ascii=False`),
//!   `raise_exception`, `strftime_now`, `bos_token` / `eos_token`, and
//!   `messages`, `tools`, `documents`, `add_generation_prompt` plus the
//!   request's `chat_template_kwargs`, `reasoning_effort` and
//!   `continue_final_message`. Message content is a string (text parts
//!   joined with `"\n"`) or a list of parts, as vLLM detects the template
//!   wants ([`ContentFormat`], or `contentFormat` in the configuration);
//!   `add_special_tokens: true` puts `completionPrefix` first.
//! - `/v1/completions` with a text prompt: `completionPrefix` (the special
//!   tokens vLLM's tokenizer adds, e.g. Llama 3's `<|begin_of_text|>`) then
//!   the prompt, unless the request sets `add_special_tokens: false`.
//!   Token-ID prompts are hashed as they are.
//!
//! Other base models keep the canonical form of [`crate::request`].
//!
//! Where the text can differ from vLLM's:
//! - Values turned into text other than by printing (`{{ x }}`), `string`
//!   and `tojson` (`~`, `join`) read as minijinja writes them (`none`,
//!   `true`), not as Python does (`None`, `True`); a printed string in a
//!   list or map is quoted as Python's `repr` quotes it, but non-printable
//!   characters beyond ASCII are not escaped.
//! - `strftime_now` formats UTC time; vLLM formats its host's local time
//!   (UTC in most containers).
//! - The string content format leaves images, audio and video out; vLLM
//!   puts the model's placeholders for them first.
//! - A template using a jinja2 extension other than loop controls
//!   (`{% generation %}`) does not compile; a Python method
//!   minijinja-contrib's `pycompat` lacks, or a filter minijinja lacks,
//!   fails the render: the request is a bad request.
//! - vLLM's `--default-chat-template-kwargs`, a per-request
//!   `chat_template` (kvroute refuses it, as vLLM does unless
//!   `--trust-request-chat-template`), Mistral tokenizers and gpt-oss's
//!   Harmony are not modelled, nor are transformers 5's changes to the
//!   messages (`None` fields dropped, reasoning under `thinking` too):
//!   vLLM requires transformers < 5.

mod content_format;
mod ordered_json;
mod python;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use indexmap::IndexMap;
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, UndefinedBehavior};
use serde::Deserialize;

pub use content_format::ContentFormat;
use ordered_json::OrderedJson;

use crate::config::{ChatTemplateConfig, Config};
use crate::request::{self, ParsedRequest, Prompt, RequestError};

/// The name of the one template in a [`ChatTemplate`]'s environment.
const TEMPLATE_NAME: &str = "chat_template";

/// Appended to the final message under `continue_final_message` to find
/// where it ends in the rendered text (transformers' marker).
const CONTINUE_FINAL_MESSAGE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// `apply_chat_template` parameters transformers consumes itself: a
/// `chat_template_kwargs` entry of one of these names never reaches the
/// template.
const CONSUMED_BY_TRANSFORMERS: [&str; 16] = [
    "conversation",
    "conversations",
    "messages",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
];

/// A compiled chat template (the `template` of a `chatTemplates` entry).
#[derive(Clone, Deserialize)]
#[serde(try_from = "String")]
pub struct ChatTemplate {
    source: Arc<str>,
    environment: Arc<Environment<'static>>,
    detected_format: ContentFormat,
}

impl ChatTemplate {
    /// Compiles `source` in an environment configured as transformers'
    /// (see the module documentation); the error gives minijinja's message
    /// and the template line.
    pub fn compile(source: String) -> Result<ChatTemplate, String> {
        let detected_format = content_format::detect(&source);
        let source: Arc<str> = source.into();
        let mut environment = environment();
        environment
            .add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| format!("does not compile: {}", describe(&e)))?;
        Ok(ChatTemplate {
            source,
            environment: Arc::new(environment),
            detected_format,
        })
    }

    /// The content format vLLM's `auto` detection picks for this template.
    pub fn detected_format(&self) -> ContentFormat {
        self.detected_format
    }

    fn render(&self, context: Value) -> Result<String, Error> {
        self.environment
            .get_template(TEMPLATE_NAME)?
            .render(context)
    }
}

impl TryFrom<String> for ChatTemplate {
    type Error = String;

    fn try_from(source: String) -> Result<Self, Self::Error> {
        ChatTemplate::compile(source)
    }
}

impl PartialEq for ChatTemplate {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

/// The environment Hugging Face templates expect (transformers'
/// `_compile_jinja_template`), with Python's text forms.
fn environment() -> Environment<'static> {
    let mut environment = Environment::new();
    let mut syntax = SyntaxConfig::builder();
    syntax.trim_blocks(true).lstrip_blocks(true);
    // Only custom delimiters can fail to build.
    if let Ok(syntax) = syntax.build() {
        environment.set_syntax(syntax);
    }
    environment.set_undefined_behavior(UndefinedBehavior::Lenient);
    environment.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    environment.set_formatter(|out, _state, value| {
        // Strings, nearly all that is printed, go out without a copy.
        let text = match value.as_str() {
            Some(text) if value.kind() == ValueKind::String => Cow::Borrowed(text),
            _ => {
                let mut text = String::new();
                python::write_str(value, &mut text);
                Cow::Owned(text)
            }
        };
        out.write_str(&text).map_err(Error::from)
    });
    environment.add_test("iterable", python::is_iterable);
    environment.add_test("sequence", python::is_sequence);
    environment.add_filter("tojson", tojson);
    environment.add_filter("string", |value: &Value| {
        let mut text = String::new();
        python::write_str(value, &mut text);
        text
    });
    environment.add_function(
        "raise_exception",
        |message: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        },
    );
    environment.add_function("strftime_now", |format: String| {
        python::strftime(&format, unix_now())
    });
    environment
}

/// Seconds since the Unix epoch (WASI's clock in Envoy).
fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// transformers' `tojson`: Python's `json.dumps` with `ensure_ascii`
/// off by default.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(indent) if indent.is_none() => None,
        Some(indent) if indent.is_integer() => {
            Some(" ".repeat(usize::try_from(indent.as_i64().unwrap_or(0)).unwrap_or(0)))
        }
        Some(indent) => Some(indent.as_str().unwrap_or_default().to_string()),
    };
    let separators = match kwargs.get::<Option<Value>>("separators")? {
        Some(pair) if !pair.is_none() => {
            let item = pair.get_item_by_index(0)?;
            let key = pair.get_item_by_index(1)?;
            match (item.as_str(), key.as_str()) {
                (Some(item), Some(key)) => Some((item.to_string(), key.to_string())),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson separators must be two strings",
                    ))
                }
            }
        }
        _ => None,
    };
    let truthy = |name| -> Result<bool, Error> {
        Ok(kwargs
            .get::<Option<Value>>(name)?
            .is_some_and(|v| v.is_true()))
    };
    let options = python::JsonOptions {
        ensure_ascii: truthy("ensure_ascii")?,
        indent,
        separators,
        sort_keys: truthy("sort_keys")?,
    };
    kwargs.assert_all_used()?;
    python::json_dumps(value, &options)
}

/// An error as a client reads it: minijinja's message and the template
/// line.
fn describe(error: &Error) -> String {
    let message = match error.detail() {
        Some(detail) => format!("{}: {detail}", error.kind()),
        None => error.kind().to_string(),
    };
    match error.line() {
        Some(line) => format!("{message} (template line {line})"),
        None => message,
    }
}

/// Turns request bodies into the prompt to hash, rendering the chat
/// templates of the configuration (see the module documentation). Built
/// once per configuration; the router and kvroute-sim both use it.
#[derive(Debug, Clone, Default)]
pub struct PromptRenderer {
    /// Client-facing model name → its base model and that model's
    /// template (with no `models`, every name is its own base model).
    by_model: BTreeMap<String, Arc<BaseModelTemplate>>,
}

#[derive(Debug)]
struct BaseModelTemplate {
    base_model: String,
    settings: ChatTemplateConfig,
}

impl PromptRenderer {
    pub fn new(config: &Config) -> PromptRenderer {
        let by_base_model: BTreeMap<&str, Arc<BaseModelTemplate>> = config
            .chat_templates
            .iter()
            .map(|(base_model, settings)| {
                let template = BaseModelTemplate {
                    base_model: base_model.clone(),
                    settings: settings.clone(),
                };
                (base_model.as_str(), Arc::new(template))
            })
            .collect();
        let by_model = if config.models.is_empty() {
            by_base_model
                .into_iter()
                .map(|(base_model, template)| (base_model.to_string(), template))
                .collect()
        } else {
            config
                .models
                .iter()
                .filter_map(|(name, target)| {
                    let template = by_base_model.get(target.base_model.as_str())?;
                    Some((name.clone(), Arc::clone(template)))
                })
                .collect()
        };
        PromptRenderer { by_model }
    }

    /// Parses a request body (`chat`: `/v1/chat/completions`) into what
    /// routing needs, its prompt the text vLLM tokenizes when the model's
    /// base model has a template, else [`crate::request::parse_request`]'s
    /// canonical form.
    pub fn prompt(&self, body: &[u8], chat: bool) -> Result<ParsedRequest, RequestError> {
        if self.by_model.is_empty() {
            return request::parse_request(body, chat);
        }
        if chat {
            // Parsed once, in order, as the template reads it.
            let (request, envelope) = ordered_envelope(body)?;
            let messages = request.get_attr("messages").ok();
            let prompt = match self.by_model.get(&envelope.model) {
                Some(model) => Prompt::Text(model.render_chat(&request)?.into_bytes()),
                None => {
                    let json = messages.as_ref().and_then(to_json);
                    request::canonical_messages(json.as_ref())?
                }
            };
            let roles: Vec<Value> = messages
                .and_then(|m| m.try_iter().ok())
                .into_iter()
                .flatten()
                .filter_map(|m| m.get_attr("role").ok())
                .collect();
            let follows_up = request::follows_up(roles.iter().filter_map(Value::as_str));
            return Ok(envelope.with_chat(prompt, follows_up));
        }
        let (mut object, envelope) = request::parse_envelope(body)?;
        let Some(model) = self.by_model.get(&envelope.model) else {
            return request::with_canonical_prompt(object, envelope, chat);
        };
        let adds_special_tokens = match object.get("add_special_tokens") {
            None | Some(serde_json::Value::Null) => true,
            Some(serde_json::Value::Bool(adds)) => *adds,
            Some(_) => {
                return Err(RequestError(
                    "`add_special_tokens` must be a boolean".into(),
                ))
            }
        };
        let prompt = match request::canonical_prompt(object.remove("prompt"))? {
            Prompt::Text(text) if adds_special_tokens => {
                let prefix = model.settings.completion_prefix.as_bytes();
                Prompt::Text([prefix, &text].concat())
            }
            prompt => prompt,
        };
        Ok(envelope.with_prompt(prompt))
    }
}

impl BaseModelTemplate {
    /// The chat request's rendered prompt.
    fn render_chat(&self, request: &Value) -> Result<String, RequestError> {
        let settings = &self.settings;
        let format = settings
            .content_format
            .unwrap_or_else(|| settings.template.detected_format());
        let chat = ChatRequest::read(request, format)?;
        let mut rendered = settings
            .template
            .render(chat.context(settings))
            .map_err(|e| {
                RequestError(format!(
                    "the chat template of {:?} failed: {}",
                    self.base_model,
                    describe(&e)
                ))
            })?;
        if let Some(final_message) = &chat.continued_message {
            rendered = cut_after_final_message(rendered, final_message).map_err(|rule| {
                RequestError(format!(
                    "the chat template of {:?} failed: {rule}",
                    self.base_model
                ))
            })?;
        }
        if chat.add_special_tokens {
            rendered.insert_str(0, &settings.completion_prefix);
        }
        Ok(rendered)
    }
}

/// The body read in order, and its envelope (the same checks and errors
/// as [`request::parse_request`]'s).
fn ordered_envelope(body: &[u8]) -> Result<(Value, request::Envelope), RequestError> {
    if body.is_empty() {
        return Err(RequestError("request body is empty".into()));
    }
    let OrderedJson(request) = serde_json::from_slice(body)
        .map_err(|e| RequestError(format!("request body is not valid JSON: {e}")))?;
    if request.kind() != ValueKind::Map {
        return Err(RequestError("request body must be a JSON object".into()));
    }
    let fields: Vec<(&str, serde_json::Value)> = request::ENVELOPE_FIELDS
        .into_iter()
        .filter_map(|name| Some((name, to_json(&request.get_attr(name).ok()?)?)))
        .collect();
    let envelope = request::envelope(|name| {
        fields
            .iter()
            .find(|(field, _)| *field == name)
            .map(|(_, value)| value)
    })?;
    Ok((request, envelope))
}

/// A value read from JSON as JSON again; `None` when undefined (absent).
fn to_json(value: &Value) -> Option<serde_json::Value> {
    Some(match value.kind() {
        ValueKind::Undefined => return None,
        ValueKind::None => serde_json::Value::Null,
        ValueKind::Bool => serde_json::Value::Bool(value.is_true()),
        ValueKind::String => serde_json::Value::from(value.as_str().unwrap_or_default()),
        ValueKind::Number => {
            if let Ok(n) = u64::try_from(value.clone()) {
                serde_json::Value::from(n)
            } else if let Ok(n) = i64::try_from(value.clone()) {
                serde_json::Value::from(n)
            } else {
                serde_json::Value::from(f64::try_from(value.clone()).unwrap_or(f64::NAN))
            }
        }
        ValueKind::Seq => serde_json::Value::Array(
            value
                .try_iter()
                .into_iter()
                .flatten()
                .filter_map(|item| to_json(&item))
                .collect(),
        ),
        ValueKind::Map => serde_json::Value::Object(
            value
                .try_iter()
                .into_iter()
                .flatten()
                .filter_map(|key| {
                    let item = to_json(&value.get_item(&key).ok()?)?;
                    Some((key.as_str()?.to_string(), item))
                })
                .collect(),
        ),
        _ => return None,
    })
}

/// transformers' cut after the message `continue_final_message` continues:
/// at its marker, or before the whitespace the template put in front of
/// a marker it trimmed.
fn cut_after_final_message(mut rendered: String, final_message: &str) -> Result<String, String> {
    let tag = CONTINUE_FINAL_MESSAGE_TAG.trim_end();
    let Some(at) = rendered
        .rfind(tag)
        .filter(|_| rendered.contains(python::strip(final_message)))
    else {
        return Err("continue_final_message is set but the final message does not appear in the chat after applying the chat template".into());
    };
    let keeps_spacing = rendered
        .get(at..)
        .is_some_and(|rest| rest.starts_with(CONTINUE_FINAL_MESSAGE_TAG));
    rendered.truncate(at);
    if !keeps_spacing {
        let kept = rendered.trim_end_matches(python::is_space).len();
        rendered.truncate(kept);
    }
    Ok(rendered)
}

/// What a chat request gives the template, as vLLM passes it on.
struct ChatRequest {
    messages: Vec<Value>,
    tools: Value,
    documents: Value,
    add_generation_prompt: bool,
    add_special_tokens: bool,
    /// `continue_final_message`: the final message's text (its marker is
    /// appended in `messages`).
    continued_message: Option<String>,
    reasoning_effort: Option<Value>,
    /// `chat_template_kwargs`.
    kwargs: Value,
}

impl ChatRequest {
    fn read(request: &Value, format: ContentFormat) -> Result<ChatRequest, RequestError> {
        if given(request, "chat_template").is_some() {
            return Err(RequestError(
                "`chat_template` is refused: kvroute renders the configured chat template (as vLLM refuses a request's own without --trust-request-chat-template)".into(),
            ));
        }
        let kwargs = match given(request, "chat_template_kwargs") {
            None => empty_map(),
            Some(kwargs) if kwargs.kind() == ValueKind::Map => kwargs,
            Some(_) => {
                return Err(RequestError(
                    "`chat_template_kwargs` must be an object".into(),
                ))
            }
        };
        if given(&kwargs, "chat_template").is_some() {
            return Err(RequestError(
                "`chat_template_kwargs.chat_template` is refused: kvroute renders the configured chat template".into(),
            ));
        }
        let add_generation_prompt = flag(request, "add_generation_prompt", true)?;
        let continue_final_message = flag(request, "continue_final_message", false)?;
        if add_generation_prompt && continue_final_message {
            return Err(RequestError(
                "`continue_final_message` and `add_generation_prompt` are not compatible (set `add_generation_prompt: false`)".into(),
            ));
        }
        let messages = match given(request, "messages") {
            Some(list) if list.kind() == ValueKind::Seq && list.len() > Some(0) => list,
            None => return Err(RequestError("`messages` is missing".into())),
            Some(_) => return Err(RequestError("`messages` must be a non-empty list".into())),
        };
        let mut messages = messages
            .try_iter()
            .map_err(|e| RequestError(e.to_string()))?
            .enumerate()
            .map(|(i, message)| conversation_message(i, &message, format))
            .collect::<Result<Vec<Value>, RequestError>>()?;
        let continued_message = if continue_final_message {
            Some(mark_final_message(&mut messages)?)
        } else {
            None
        };
        let tools = match given(&kwargs, "tools").filter(is_set) {
            Some(tools) => tools,
            None => match given(request, "tools") {
                None => Value::from(()),
                Some(tools) => tool_dicts(&tools)?,
            },
        };
        let documents = given(request, "documents")
            .or_else(|| given(&kwargs, "documents").filter(is_set))
            .unwrap_or(Value::from(()));
        Ok(ChatRequest {
            messages,
            tools,
            documents,
            add_generation_prompt,
            add_special_tokens: flag(request, "add_special_tokens", false)?,
            continued_message,
            reasoning_effort: given(request, "reasoning_effort"),
            kwargs,
        })
    }

    /// The template's variables: the special tokens, then the request's
    /// `chat_template_kwargs` (vLLM drops `null` and `"auto"` ones), then
    /// what vLLM and transformers set themselves.
    fn context(&self, settings: &ChatTemplateConfig) -> Value {
        let mut context: IndexMap<Value, Value> = IndexMap::new();
        for (name, token) in [
            ("bos_token", &settings.bos_token),
            ("eos_token", &settings.eos_token),
        ] {
            if let Some(token) = token {
                context.insert(Value::from(name), Value::from(token.as_str()));
            }
        }
        for name in self.kwargs.try_iter().into_iter().flatten() {
            let value = self.kwargs.get_item(&name).unwrap_or_default();
            let consumed = name
                .as_str()
                .is_some_and(|name| CONSUMED_BY_TRANSFORMERS.contains(&name));
            if is_set(&value) && !consumed {
                context.insert(name, value);
            }
        }
        if let Some(effort) = &self.reasoning_effort {
            // vLLM derives it unless the request's kwargs name it at all.
            let named = self
                .kwargs
                .get_attr("enable_thinking")
                .is_ok_and(|v| !v.is_undefined());
            if !named {
                context.insert(
                    Value::from("enable_thinking"),
                    Value::from(effort.as_str() != Some("none")),
                );
            }
            context.insert(Value::from("reasoning_effort"), effort.clone());
        }
        context.insert(Value::from("messages"), Value::from(self.messages.clone()));
        context.insert(Value::from("tools"), self.tools.clone());
        context.insert(Value::from("documents"), self.documents.clone());
        context.insert(
            Value::from("add_generation_prompt"),
            Value::from(self.add_generation_prompt),
        );
        Value::from(context)
    }
}

/// `object[name]` unless absent or `null`.
fn given(object: &Value, name: &str) -> Option<Value> {
    object
        .get_attr(name)
        .ok()
        .filter(|v| !v.is_undefined() && !v.is_none())
}

/// Not a value vLLM's `merge_kwargs` drops (`None`, `"auto"`).
fn is_set(value: &Value) -> bool {
    !value.is_none() && !value.is_undefined() && value.as_str() != Some("auto")
}

fn flag(request: &Value, name: &str, default: bool) -> Result<bool, RequestError> {
    match given(request, name) {
        None => Ok(default),
        Some(value) if value.kind() == ValueKind::Bool => Ok(value.is_true()),
        Some(_) => Err(RequestError(format!("`{name}` must be a boolean"))),
    }
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::from(
        entries
            .into_iter()
            .map(|(key, value)| (Value::from(key), value))
            .collect::<IndexMap<Value, Value>>(),
    )
}

/// vLLM's message as the template sees it (`_parse_chat_message_content`
/// and `_postprocess_messages`): `role`, `content`, then per role
/// `tool_calls` (arguments parsed from their JSON text) and `reasoning`
/// (with `reasoning_content`), or `tool_call_id`; then `name`, `task`, and
/// a developer message's `tools`. Other fields are dropped.
fn conversation_message(
    index: usize,
    message: &Value,
    format: ContentFormat,
) -> Result<Value, RequestError> {
    let at = |field: &str| format!("messages[{index}].{field}");
    if message.kind() != ValueKind::Map {
        return Err(RequestError(format!(
            "`messages[{index}]` must be an object"
        )));
    }
    let role = given(message, "role")
        .filter(|role| role.kind() == ValueKind::String)
        .ok_or_else(|| RequestError(format!("`{}` must be a string", at("role"))))?;
    let parts = match given(message, "content") {
        None => Vec::new(),
        Some(text) if text.kind() == ValueKind::String => vec![Part::Text(text)],
        Some(parts) if parts.kind() == ValueKind::Seq => parts
            .try_iter()
            .into_iter()
            .flatten()
            .enumerate()
            .filter_map(|(j, part)| content_part(&part).transpose().map(|p| (j, p)))
            .map(|(j, part)| {
                part.map_err(|rule| RequestError(format!("`{}[{j}]` {rule}", at("content"))))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(RequestError(format!(
                "`{}` must be a string or a list of parts",
                at("content")
            )))
        }
    };
    let role_name = role.as_str().unwrap_or_default().to_string();
    let content = match format {
        ContentFormat::String => join_texts(&parts),
        ContentFormat::Openai if role_name == "tool" && parts.iter().all(Part::is_text) => {
            join_texts(&parts)
        }
        ContentFormat::Openai => Value::from(parts.iter().map(Part::as_dict).collect::<Vec<_>>()),
    };
    let mut fields = vec![("role", role), ("content", content)];
    match role_name.as_str() {
        "assistant" => {
            if let Some(calls) = given(message, "tool_calls") {
                let calls: Vec<Value> = calls
                    .try_iter()
                    .map_err(|_| RequestError(format!("`{}` must be a list", at("tool_calls"))))?
                    .map(|call| tool_call(&call))
                    .collect();
                if !calls.is_empty() {
                    fields.push(("tool_calls", Value::from(calls)));
                }
            }
            let reasoning =
                given(message, "reasoning").or_else(|| given(message, "reasoning_content"));
            if let Some(reasoning) = reasoning {
                fields.push(("reasoning", reasoning.clone()));
                fields.push(("reasoning_content", reasoning));
            }
        }
        "tool" => {
            if let Ok(id) = message.get_attr("tool_call_id") {
                if !id.is_undefined() {
                    fields.push(("tool_call_id", id));
                }
            }
        }
        _ => {}
    }
    for name in ["name", "task"] {
        if let Some(value) = given(message, name).filter(|v| v.kind() == ValueKind::String) {
            fields.push((name, value));
        }
    }
    if role_name == "developer" {
        fields.push(("tools", given(message, "tools").unwrap_or(Value::from(()))));
    }
    Ok(map(fields))
}

/// One content part as vLLM keeps it.
enum Part {
    Text(Value),
    /// An image, audio or video: `{"type": <modality>}` in the openai
    /// format, nothing in the string format.
    Media(&'static str),
    ToolReference(Value),
}

impl Part {
    fn is_text(&self) -> bool {
        matches!(self, Part::Text(_))
    }

    fn as_dict(&self) -> Value {
        match self {
            Part::Text(text) => map(vec![("type", Value::from("text")), ("text", text.clone())]),
            Part::Media(modality) => map(vec![("type", Value::from(*modality))]),
            Part::ToolReference(name) => map(vec![
                ("type", Value::from("tool_reference")),
                ("name", name.clone()),
            ]),
        }
    }
}

/// The texts of the parts (tool references by name) joined with `"\n"`.
fn join_texts(parts: &[Part]) -> Value {
    let mut texts = parts.iter().filter_map(|part| match part {
        Part::Text(text) | Part::ToolReference(text) => Some(text),
        Part::Media(_) => None,
    });
    match (texts.next(), texts.clone().next()) {
        // One text (a string content): the value itself, not a copy.
        (Some(text), None) => text.clone(),
        (first, _) => {
            let texts: Vec<&str> = first
                .into_iter()
                .chain(texts)
                .filter_map(Value::as_str)
                .collect();
            Value::from(texts.join("\n"))
        }
    }
}

/// vLLM's reading of one content part (`_parse_chat_message_content_part`);
/// `None` for a text part without text, which vLLM skips.
fn content_part(part: &Value) -> Result<Option<Part>, String> {
    if part.kind() == ValueKind::String {
        return Ok(Some(Part::Text(part.clone())));
    }
    let kind = given(part, "type");
    let kind = match &kind {
        Some(kind) => kind
            .as_str()
            .ok_or_else(|| "has an invalid `type`".to_string())?,
        // Without a type, vLLM takes a part by its media field.
        None => [
            ("image_url", "image_url"),
            ("image_pil", "image_pil"),
            ("image_embeds", "image_embeds"),
            ("audio_embeds", "audio_embeds"),
            ("prompt_embeds", "prompt_embeds"),
            ("audio_url", "audio_url"),
            ("input_audio", "input_audio"),
            ("video_url", "video_url"),
            ("tool_reference", "tool_reference"),
        ]
        .into_iter()
        .find(|(field, _)| given(part, field).is_some())
        .map(|(_, kind)| kind)
        .ok_or_else(|| "has no `type`".to_string())?,
    };
    let text = |field: &str| match given(part, field) {
        None => Ok(None),
        Some(text) if text.kind() == ValueKind::String => Ok(Some(Part::Text(text))),
        Some(_) => Err(format!("`{field}` must be a string")),
    };
    match kind {
        "text" | "input_text" | "output_text" => text("text"),
        "refusal" => text("refusal"),
        "thinking" => text("thinking"),
        // vLLM's inline placeholder for prompt embeddings.
        "prompt_embeds" => Ok(Some(Part::Text(Value::from("<prompt_embeds>")))),
        "tool_reference" => Ok(given(part, "name")
            .filter(|name| name.kind() == ValueKind::String)
            .map(Part::ToolReference)),
        "image_url" | "input_image" | "image_pil" | "image_embeds" => {
            Ok(Some(Part::Media("image")))
        }
        "audio_url" | "input_audio" | "audio_embeds" => Ok(Some(Part::Media("audio"))),
        "video_url" => Ok(Some(Part::Media("video"))),
        other => Err(format!("has an unsupported type {other:?}")),
    }
}

/// A tool call as vLLM's request model keeps it (`id`, `function` with
/// `arguments` and `name`, `type`; nothing else), its `arguments` parsed
/// from their JSON text (`{}` when that is not JSON), as vLLM hands them to
/// templates.
fn tool_call(call: &Value) -> Value {
    let function = given(call, "function").unwrap_or_default();
    let arguments = match given(&function, "arguments") {
        Some(text) if text.kind() == ValueKind::String => {
            serde_json::from_str::<OrderedJson>(text.as_str().unwrap_or_default())
                .map_or_else(|_| empty_map(), |OrderedJson(value)| value)
        }
        Some(value) if matches!(value.kind(), ValueKind::Map | ValueKind::Seq) => value,
        _ => empty_map(),
    };
    let mut function_fields = vec![("arguments", arguments)];
    function_fields.extend(given(&function, "name").map(|name| ("name", name)));
    let mut fields: Vec<(&str, Value)> =
        given(call, "id").map(|id| ("id", id)).into_iter().collect();
    fields.push(("function", map(function_fields)));
    fields.extend(given(call, "type").map(|kind| ("type", kind)));
    map(fields)
}

fn empty_map() -> Value {
    map(Vec::new())
}

/// The request's `tools` as vLLM dumps its tool models: `type` and
/// `function` (`name`, `description`, `parameters`, `null` when absent,
/// `defer_loading` when set, then the function's other fields in order),
/// and the tool's `defer_loading` when set.
fn tool_dicts(tools: &Value) -> Result<Value, RequestError> {
    if tools.kind() != ValueKind::Seq {
        return Err(RequestError("`tools` must be a list".into()));
    }
    let declared = ["name", "description", "parameters", "defer_loading"];
    let dumped = tools
        .try_iter()
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, tool)| {
            let function = given(&tool, "function")
                .filter(|f| f.kind() == ValueKind::Map)
                .ok_or_else(|| RequestError(format!("`tools[{i}].function` must be an object")))?;
            let name = given(&function, "name")
                .filter(|n| n.kind() == ValueKind::String)
                .ok_or_else(|| {
                    RequestError(format!("`tools[{i}].function.name` must be a string"))
                })?;
            let kind = given(&tool, "type").unwrap_or(Value::from("function"));
            if kind.as_str() != Some("function") {
                return Err(RequestError(format!(
                    "`tools[{i}].type` must be \"function\""
                )));
            }
            let defer_loading = given(&tool, "defer_loading");
            let mut fields = vec![
                ("name", name),
                (
                    "description",
                    given(&function, "description").unwrap_or(Value::from(())),
                ),
                (
                    "parameters",
                    given(&function, "parameters").unwrap_or(Value::from(())),
                ),
            ];
            if let Some(defer) = given(&function, "defer_loading").or(defer_loading.clone()) {
                fields.push(("defer_loading", defer));
            }
            let mut function_dump: IndexMap<Value, Value> = fields
                .into_iter()
                .map(|(key, value)| (Value::from(key), value))
                .collect();
            for key in function.try_iter().into_iter().flatten() {
                if !key.as_str().is_some_and(|k| declared.contains(&k)) {
                    let value = function.get_item(&key).unwrap_or_default();
                    function_dump.insert(key, value);
                }
            }
            let mut dump = vec![("type", kind), ("function", Value::from(function_dump))];
            dump.extend(defer_loading.map(|defer| ("defer_loading", defer)));
            Ok(map(dump))
        })
        .collect::<Result<Vec<Value>, RequestError>>()?;
    Ok(Value::from(dumped))
}

/// Appends transformers' marker to the final message's text (a string, or
/// the last part with a `text`) and returns that text.
fn mark_final_message(messages: &mut [Value]) -> Result<String, RequestError> {
    let no_text = || {
        RequestError(
            "continue_final_message is set but the final message has no text to continue".into(),
        )
    };
    let last = messages.last_mut().ok_or_else(no_text)?;
    let content = last.get_attr("content").unwrap_or_default();
    let (final_text, marked) = if let Some(text) = content.as_str() {
        (
            text.to_string(),
            Value::from(format!("{text}{CONTINUE_FINAL_MESSAGE_TAG}")),
        )
    } else {
        let mut parts: Vec<Value> = content.try_iter().map_err(|_| no_text())?.collect();
        let (index, text) = parts
            .iter()
            .enumerate()
            .rev()
            .find_map(|(i, part)| Some((i, given(part, "text")?.as_str()?.to_string())))
            .ok_or_else(no_text)?;
        if let Some(part) = parts.get_mut(index) {
            let mut fields: IndexMap<Value, Value> = part
                .try_iter()
                .into_iter()
                .flatten()
                .map(|key| {
                    let value = part.get_item(&key).unwrap_or_default();
                    (key, value)
                })
                .collect();
            fields.insert(
                Value::from("text"),
                Value::from(format!("{text}{CONTINUE_FINAL_MESSAGE_TAG}")),
            );
            *part = Value::from(fields);
        }
        (text, Value::from(parts))
    };
    let mut fields: IndexMap<Value, Value> = last
        .try_iter()
        .into_iter()
        .flatten()
        .map(|key| {
            let value = last.get_item(&key).unwrap_or_default();
            (key, value)
        })
        .collect();
    fields.insert(Value::from("content"), marked);
    *last = Value::from(fields);
    Ok(final_text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_now_formats_the_current_utc_time() {
        let template =
            ChatTemplate::compile("{{ strftime_now('%Y-%m-%d %H:%M') }}".into()).unwrap();
        let before = python::strftime("%Y-%m-%d %H:%M", unix_now());
        let rendered = template.render(empty_map()).unwrap();
        let after = python::strftime("%Y-%m-%d %H:%M", unix_now());
        assert!(rendered == before || rendered == after, "{rendered}");
    }

    #[test]
    fn compile_errors_give_the_template_line() {
        let error = ChatTemplate::compile("line one\n{% if x %}\n{{ y }".into()).unwrap_err();
        assert!(
            error.starts_with("does not compile: syntax error")
                && error.ends_with("(template line 3)"),
            "{error}"
        );
        // transformers' `{% generation %}` extension is not there.
        assert!(ChatTemplate::compile("{% generation %}x{% endgeneration %}".into()).is_err());
    }

    #[test]
    fn python_printing_and_filters() {
        let template = ChatTemplate::compile(
            "{{ none }} {{ flag }} {{ items }} {{ 3 / 2 }} {{ flag | string }} {{ items | tojson(separators=(',', ':'), sort_keys=true) }} {{ none is iterable }} {{ 'ab' is sequence }} {{ items is sequence }}"
                .into(),
        )
        .unwrap();
        let context = map(vec![
            ("flag", Value::from(false)),
            (
                "items",
                map(vec![
                    ("b", Value::from(1)),
                    ("a", Value::from(vec![Value::from(())])),
                ]),
            ),
        ]);
        assert_eq!(
            template.render(context).unwrap(),
            "None False {'b': 1, 'a': [None]} 1.5 False {\"a\":[null],\"b\":1} False True True"
        );
    }

    #[test]
    fn raise_exception_fails_the_render_with_its_message() {
        let template =
            ChatTemplate::compile("a{{ raise_exception('no system role') }}".into()).unwrap();
        let error = template.render(empty_map()).unwrap_err();
        assert_eq!(
            describe(&error),
            "invalid operation: no system role (template line 1)"
        );
    }
}
