//! Chat templates rendered as vLLM renders them: every request of
//! `fixtures/chat_templates/requests.json` through each of three templates
//! must give exactly the text (or the error) Python's jinja2 gave in
//! `expected.json` (written by `fixtures/chat_templates/generate.py`,
//! which follows vLLM and transformers); then the completions prefix, the
//! requests of models without a template, and the router's use of both.

use kvroute::chat_template::{ContentFormat, PromptRenderer};
use kvroute::config::{Config, ModelTarget};
use kvroute::hashing::BlockHasher;
use kvroute::request::{parse_request, Prompt};
use kvroute::router::Router;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};

const REQUESTS: &str = include_str!("fixtures/chat_templates/requests.json");
const EXPECTED: &str = include_str!("fixtures/chat_templates/expected.json");

/// Base model, template, bosToken, eosToken, completionPrefix (as in
/// generate.py).
const TEMPLATES: [(&str, &str, Option<&str>, &str, &str); 3] = [
    (
        "wren",
        include_str!("fixtures/chat_templates/wren_chatml.jinja"),
        None,
        "<|im_end|>",
        "",
    ),
    (
        "llama",
        include_str!("fixtures/chat_templates/llama_like.jinja"),
        Some("<|begin_of_text|>"),
        "<|eot_id|>",
        "<|begin_of_text|>",
    ),
    (
        "strict",
        include_str!("fixtures/chat_templates/strict_turns.jinja"),
        Some("<s>"),
        "</s>",
        "<s>",
    ),
];

/// A configuration with the three templates and `extra` top-level fields.
fn config_with(extra: Value) -> Config {
    let mut templates = serde_json::Map::new();
    for (base, source, bos, eos, prefix) in TEMPLATES {
        let mut entry = json!({"template": source, "eosToken": eos, "completionPrefix": prefix});
        if let Some(bos) = bos {
            entry["bosToken"] = json!(bos);
        }
        templates.insert(base.to_string(), entry);
    }
    let mut config = json!({
        "pods": [{"id": "a", "address": "127.0.0.1:9001"}],
        "chatTemplates": templates,
    });
    if let (Some(config), Value::Object(extra)) = (config.as_object_mut(), extra) {
        config.extend(extra);
    }
    Config::parse(config.to_string().as_bytes()).expect("the test configuration is valid")
}

fn config() -> Config {
    config_with(json!({}))
}

/// Where two texts first differ, to read a failure.
fn first_difference(a: &[u8], b: &[u8]) -> String {
    let at = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let around = |s: &[u8]| {
        String::from_utf8_lossy(&s[at.saturating_sub(40)..(at + 40).min(s.len())]).into_owned()
    };
    format!("at byte {at}: {:?} vs {:?}", around(a), around(b))
}

/// One request of requests.json, its body as written (key order matters
/// to templates).
#[derive(Deserialize)]
struct Case<'a> {
    name: String,
    #[serde(borrow)]
    body: &'a RawValue,
}

#[test]
fn rendered_prompts_are_byte_identical_to_jinja2() {
    let renderer = PromptRenderer::new(&config());
    let requests: Vec<Case<'_>> = serde_json::from_str(REQUESTS).unwrap();
    let expected: Value = serde_json::from_str(EXPECTED).unwrap();
    let mut checked = 0;
    for (base, ..) in TEMPLATES {
        for Case { name, body } in &requests {
            let body = body
                .get()
                .replacen(r#""model": "m""#, &format!(r#""model": "{base}""#), 1);
            let outcome = renderer.prompt(body.as_bytes(), true);
            let want = &expected[base][name.as_str()];
            match (outcome, want["text"].as_str(), want["error"].as_str()) {
                (Ok(request), Some(text), _) => {
                    let Prompt::Text(bytes) = request.prompt else {
                        panic!("{base}/{name}: a chat prompt is text");
                    };
                    assert!(
                        bytes == text.as_bytes(),
                        "{base}/{name}: {}",
                        first_difference(&bytes, text.as_bytes())
                    );
                }
                (Err(error), None, Some(message)) => {
                    assert!(
                        error.0.contains(message) && error.0.contains(&format!("{base:?}")),
                        "{base}/{name}: the error names the template and says {message:?}: {error}"
                    );
                }
                (outcome, ..) => panic!("{base}/{name}: got {outcome:?}, want {want}"),
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 3 * requests.len());
}

#[test]
fn the_content_format_is_detected_as_vllm_does() {
    let config = config();
    let detected = |base: &str| config.chat_templates[base].template.detected_format();
    assert_eq!(detected("wren"), ContentFormat::String);
    assert_eq!(detected("llama"), ContentFormat::String);
    assert_eq!(detected("strict"), ContentFormat::Openai);
}

#[test]
fn a_configured_content_format_overrides_the_detected_one() {
    let mut config = config();
    config
        .chat_templates
        .get_mut("strict")
        .unwrap()
        .content_format = Some(ContentFormat::String);
    let body = br#"{"model": "strict", "messages": [{"role": "user", "content": "hi"}]}"#;
    // The template loops over the content: a string's characters.
    let prompt = PromptRenderer::new(&config)
        .prompt(body, true)
        .unwrap()
        .prompt;
    assert_eq!(prompt, Prompt::Text(b"<s>[INST]  [/INST]".to_vec()));
}

#[test]
fn completions_get_the_prefix_unless_special_tokens_are_off() {
    let renderer = PromptRenderer::new(&config());
    let prompt = |body: &str| renderer.prompt(body.as_bytes(), false).unwrap().prompt;
    assert_eq!(
        prompt(r#"{"model": "llama", "prompt": "Once"}"#),
        Prompt::Text(b"<|begin_of_text|>Once".to_vec())
    );
    assert_eq!(
        prompt(r#"{"model": "llama", "prompt": ["Once", "Twice"]}"#),
        Prompt::Text(b"<|begin_of_text|>Once".to_vec())
    );
    assert_eq!(
        prompt(r#"{"model": "llama", "prompt": "Once", "add_special_tokens": false}"#),
        Prompt::Text(b"Once".to_vec())
    );
    assert_eq!(
        prompt(r#"{"model": "llama", "prompt": [128000, 7]}"#),
        Prompt::Tokens(vec![128000, 7])
    );
    assert_eq!(
        prompt(r#"{"model": "wren", "prompt": "Once"}"#),
        Prompt::Text(b"Once".to_vec())
    );
    let error = renderer
        .prompt(
            br#"{"model": "llama", "prompt": "x", "add_special_tokens": 1}"#,
            false,
        )
        .unwrap_err();
    assert!(error.0.contains("`add_special_tokens`"), "{error}");
}

#[test]
fn models_without_a_template_keep_the_canonical_form() {
    let renderer = PromptRenderer::new(&config());
    for (body, chat) in [
        (
            r#"{"model": "other", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}], "cache_salt": "s"}"#,
            true,
        ),
        (
            r#"{"model": "other", "prompt": "Once", "stream": true}"#,
            false,
        ),
        (r#"{"model": "other", "prompt": [1, 2]}"#, false),
    ] {
        assert_eq!(
            renderer.prompt(body.as_bytes(), chat),
            parse_request(body.as_bytes(), chat),
            "{body}"
        );
    }
    let unconfigured = PromptRenderer::new(&Config::default());
    let body = br#"{"model": "llama", "messages": [{"role": "user", "content": "hi"}]}"#;
    assert_eq!(
        unconfigured.prompt(body, true).unwrap().prompt,
        Prompt::Text(b"user\x1fhi\x1e".to_vec())
    );
}

#[test]
fn templates_follow_models_to_their_base_model() {
    let config = config_with(json!({"models": {
        "chat": {"baseModel": "llama"},
        "billing": {"baseModel": "llama", "adapter": "billing-lora"},
        "wren": {"baseModel": "wren"},
        "strict": {"baseModel": "strict"},
        "plain": {"baseModel": "base-without-template"},
    }}));
    let renderer = PromptRenderer::new(&config);
    let body = |model: &str| {
        format!(r#"{{"model": "{model}", "messages": [{{"role": "user", "content": "hi"}}]}}"#)
    };
    let rendered = |model: &str| {
        renderer
            .prompt(body(model).as_bytes(), true)
            .unwrap()
            .prompt
    };
    assert_eq!(rendered("chat"), rendered("billing"));
    let Prompt::Text(text) = rendered("chat") else {
        panic!("text");
    };
    assert!(text.starts_with(b"<|begin_of_text|><|start_header_id|>system"));
    assert_eq!(rendered("plain"), Prompt::Text(b"user\x1fhi\x1e".to_vec()));
    assert_eq!(
        config.resolve_model("billing"),
        Some(ModelTarget {
            base_model: "llama".into(),
            adapter: Some("billing-lora".into())
        })
    );
}

#[test]
fn bodies_fail_as_they_do_without_a_template() {
    let renderer = PromptRenderer::new(&config());
    for body in [
        &b""[..],
        b"{",
        b"\xff",
        b"[1]",
        b"null",
        br#"{"model": 3, "messages": []}"#,
        br#"{"messages": []}"#,
        br#"{"model": "llama", "stream": "yes", "messages": []}"#,
        br#"{"model": "llama", "cache_salt": 1, "messages": []}"#,
        br#"{"model": "llama", "messages": [{"role": "user", "content": "x"}], "extra": [1, }"#,
    ] {
        let error = renderer.prompt(body, true).unwrap_err();
        assert_eq!(
            Err(error),
            parse_request(body, true),
            "{}",
            String::from_utf8_lossy(body)
        );
    }
    // The envelope of a templated chat request is read as any other.
    let body = br#"{"model": "wren", "model": "llama", "stream": true, "stream_options": {"include_usage": true}, "cache_salt": "s", "messages": [{"role": "user", "content": "x"}]}"#;
    let request = renderer.prompt(body, true).unwrap();
    let canonical = parse_request(body, true).unwrap();
    assert_eq!(
        (
            request.model,
            request.stream,
            request.cache_salt,
            request.answer_reports_usage
        ),
        (
            canonical.model,
            canonical.stream,
            canonical.cache_salt,
            canonical.answer_reports_usage
        )
    );
    assert_ne!(request.prompt, canonical.prompt);
}

#[test]
fn request_fields_the_renderer_reads_are_checked() {
    let renderer = PromptRenderer::new(&config());
    for (body, needle) in [
        (
            r#"{"model": "llama", "messages": []}"#,
            "`messages` must be a non-empty list",
        ),
        (r#"{"model": "llama"}"#, "`messages` is missing"),
        (
            r#"{"model": "llama", "messages": [{"role": 1}]}"#,
            "`messages[0].role`",
        ),
        (
            r#"{"model": "llama", "messages": [{"role": "user", "content": [{"type": "bogus"}]}]}"#,
            "`messages[0].content[0]` has an unsupported type",
        ),
        (
            r#"{"model": "llama", "messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}"#,
            "`chat_template` is refused",
        ),
        (
            r#"{"model": "llama", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []}"#,
            "`chat_template_kwargs` must be an object",
        ),
        (
            r#"{"model": "llama", "messages": [{"role": "user", "content": "x"}], "continue_final_message": true}"#,
            "not compatible",
        ),
        (
            r#"{"model": "llama", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}"#,
            "`tools[0].function`",
        ),
        (
            r#"{"model": "llama", "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"}"#,
            "`add_generation_prompt` must be a boolean",
        ),
    ] {
        let error = renderer.prompt(body.as_bytes(), true).unwrap_err();
        assert!(error.0.contains(needle), "{body} → {error}");
    }
}

#[test]
fn the_router_hashes_the_rendered_prompt_and_rejects_what_fails_to_render() {
    let config = config();
    let body = br#"{"model": "llama", "messages": [{"role": "user", "content": "Hello there, a prompt long enough to fill a few 64-byte blocks of text."}]}"#;
    let rendered = PromptRenderer::new(&config)
        .prompt(body, true)
        .unwrap()
        .prompt;
    let target = config.resolve_model("llama").unwrap();
    let want = BlockHasher::from_config(&config).chain(&target, &rendered, None);
    assert!(want.len() >= 3);
    let routed = Router::new(config).prepare(body, true).unwrap();
    assert_eq!(routed.chain, want);
    assert_eq!(routed.degraded, None);

    let out_of_order =
        br#"{"model": "strict", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}"#;
    let by_load = Router::new(config_with(json!({})))
        .prepare(out_of_order, true)
        .unwrap();
    assert!(by_load.chain.is_empty());
    assert!(by_load.degraded.unwrap().contains("\"strict\""));
    let rejected = Router::new(config_with(json!({"onBadRequest": "reject"})))
        .prepare(out_of_order, true)
        .unwrap_err();
    assert_eq!(rejected.status, 400);
    assert!(
        rejected
            .message
            .contains("the chat template of \"strict\" failed")
            && rejected
                .message
                .contains("Conversation roles must alternate"),
        "{}",
        rejected.message
    );
}

#[test]
fn a_rendered_chat_says_whether_it_continues_a_conversation() {
    let renderer = PromptRenderer::new(&config());
    let follows_up = |messages: Value| {
        let body = json!({"model": "llama", "messages": messages}).to_string();
        renderer.prompt(body.as_bytes(), true).unwrap().follows_up
    };
    let opening = json!([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]);
    let later = json!([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "r"}]);
    assert_eq!(follows_up(opening), Some(false));
    assert_eq!(follows_up(later), Some(true));
}
