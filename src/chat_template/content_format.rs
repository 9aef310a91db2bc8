//! Which form of message content a template expects, detected as vLLM's
//! `--chat-template-content-format auto` does (`_detect_content_format`
//! in `vllm/renderers/hf.py`): `"openai"` when the template loops over a
//! message's `content` (`{% for part in message['content'] %}`), where a
//! message is a loop variable over `messages` or over a variable set from
//! it (`{% set loop_messages = messages[1:] %}`); else `"string"`.
//!
//! vLLM walks jinja2's syntax tree; this reads the `{% set %}` and
//! `{% for %}` tags of the source, which is the same for the expressions
//! that count: a name, its `content` (`.content` or `['content']`),
//! slices, and filters or tests applied to those. Where vLLM's walk fails
//! (a namespace attribute or tuple assigned from `messages`), it falls back
//! to `"string"`, and so does this.

use serde::Deserialize;

/// How vLLM hands message content to the template.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum ContentFormat {
    /// A string: the text parts joined with `"\n"`.
    String,
    /// A list of parts: `{"type": "text", "text": ...}`, `{"type": "image"}`.
    Openai,
}

/// vLLM's detected content format of `source`.
pub fn detect(source: &str) -> ContentFormat {
    let tags = statement_tags(source);
    let Some(message_lists) = names_bound_to_messages(&tags) else {
        return ContentFormat::String;
    };
    let mut message_items = Vec::new();
    for tag in &tags {
        if let Tag::For { target, iter } = tag {
            if message_lists.iter().any(|list| accesses(iter, list, None)) {
                match simple_name(target) {
                    Some(name) => message_items.push(name),
                    None => return ContentFormat::String,
                }
            }
        }
    }
    let loops_over_content = tags.iter().any(|tag| {
        matches!(tag, Tag::For { iter, .. }
            if message_items.iter().any(|item| accesses(iter, item, Some("content"))))
    });
    if loops_over_content {
        ContentFormat::Openai
    } else {
        ContentFormat::String
    }
}

/// The statement tags that bind names.
enum Tag<'a> {
    Set { target: &'a str, value: &'a str },
    For { target: &'a str, iter: &'a str },
}

/// `messages` and every name set from it, transitively; `None` when one is
/// not a plain name (vLLM's walk fails there).
fn names_bound_to_messages<'a>(tags: &[Tag<'a>]) -> Option<Vec<&'a str>> {
    let mut names = vec!["messages"];
    let mut next = 0;
    while let Some(&name) = names.get(next) {
        next += 1;
        for tag in tags {
            if let Tag::Set { target, value } = tag {
                if accesses(value, name, None) {
                    let target = simple_name(target)?;
                    if !names.contains(&target) {
                        names.push(target);
                    }
                }
            }
        }
    }
    Some(names)
}

/// The `set` and `for` tags of a template, comments and raw blocks left out.
fn statement_tags(source: &str) -> Vec<Tag<'_>> {
    let mut tags = Vec::new();
    let mut rest = source;
    loop {
        let tag = rest.find("{%");
        let comment = rest.find("{#").filter(|&c| tag.is_none_or(|t| c < t));
        if let Some(comment) = comment {
            rest = after(rest.split_at(comment).1, "#}");
            continue;
        }
        let Some(tag) = tag else {
            break;
        };
        let body = rest.split_at(tag + 2).1;
        let Some(end) = tag_end(body) else {
            break;
        };
        let (inner, close) = body.split_at(end);
        rest = close.get(2..).unwrap_or("");
        let inner = inner
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+'])
            .trim();
        if inner == "raw" {
            rest = after(after(rest, "endraw"), "%}");
        } else if let Some(statement) = inner.strip_prefix("set ") {
            if let Some((target, value)) = split_assignment(statement) {
                tags.push(Tag::Set { target, value });
            }
        } else if let Some(statement) = inner.strip_prefix("for ") {
            if let Some((target, iter)) = split_top_level(statement, " in ") {
                let iter = split_top_level(iter, " if ").map_or(iter, |(iter, _)| iter);
                let iter = iter.trim();
                tags.push(Tag::For {
                    target: target.trim(),
                    iter: iter.strip_suffix(" recursive").unwrap_or(iter),
                });
            }
        }
    }
    tags
}

/// What follows the first `marker` in `text` (nothing without one).
fn after<'a>(text: &'a str, marker: &str) -> &'a str {
    text.find(marker)
        .map_or("", |at| text.split_at(at + marker.len()).1)
}

/// Where the `%}` closing a tag body is, outside string literals.
fn tag_end(body: &str) -> Option<usize> {
    let mut quote = None;
    let bytes = body.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        match quote {
            Some(q) if b == q && (i == 0 || bytes.get(i - 1) != Some(&b'\\')) => quote = None,
            Some(_) => {}
            None if b == b'\'' || b == b'"' => quote = Some(b),
            None if b == b'%' && bytes.get(i + 1) == Some(&b'}') => return Some(i),
            None => {}
        }
    }
    None
}

/// `target = value` split at its `=` (not `==`, `!=`, `<=`, `>=`).
fn split_assignment(statement: &str) -> Option<(&str, &str)> {
    let bytes = statement.as_bytes();
    let at = top_level_positions(statement).find(|&i| {
        bytes.get(i) == Some(&b'=')
            && bytes.get(i + 1) != Some(&b'=')
            && !matches!(
                i.checked_sub(1).and_then(|j| bytes.get(j)),
                Some(b'=' | b'!' | b'<' | b'>')
            )
    })?;
    let (target, value) = statement.split_at(at);
    Some((target.trim(), value.get(1..).unwrap_or("").trim()))
}

/// `text` split at the first top-level occurrence of `separator`.
fn split_top_level<'a>(text: &'a str, separator: &str) -> Option<(&'a str, &'a str)> {
    let at = top_level_positions(text).find(|&i| text.split_at(i).1.starts_with(separator))?;
    let (head, tail) = text.split_at(at);
    Some((head, tail.get(separator.len()..).unwrap_or("")))
}

/// Byte positions of `text` outside brackets and string literals.
fn top_level_positions(text: &str) -> impl Iterator<Item = usize> + '_ {
    unquoted(text)
        .filter(|&(_, c, depth)| depth == 0 && !"()[]{}".contains(c))
        .map(|(i, _, _)| i)
}

/// The characters of `text` outside string literals (the quotes dropped),
/// each with the bracket depth before it; a closer at depth 0 leaves it
/// at 0.
fn unquoted(text: &str) -> impl Iterator<Item = (usize, char, usize)> + '_ {
    let mut depth = 0usize;
    let mut quote = None;
    text.char_indices().filter_map(move |(i, c)| {
        if let Some(q) = quote {
            if c == q {
                quote = None;
            }
            return None;
        }
        let before = depth;
        match c {
            '\'' | '"' => {
                quote = Some(c);
                return None;
            }
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        Some((i, c, before))
    })
}

fn simple_name(target: &str) -> Option<&str> {
    let name = target.trim();
    let mut chars = name.chars();
    let starts_well = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    (starts_well && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')).then_some(name)
}

/// Whether `expression` is `name` (with `key`: its `key` item or
/// attribute), sliced, and filtered or tested any number of times: vLLM's
/// `_is_var_or_elems_access`.
fn accesses(expression: &str, name: &str, key: Option<&str>) -> bool {
    let mut rest = expression.trim();
    while let Some(inner) = rest.strip_prefix('(').and_then(|r| r.strip_suffix(')')) {
        rest = inner.trim();
    }
    let Some(after_name) = rest.strip_prefix(name) else {
        return false;
    };
    if continues_identifier(after_name) {
        return false;
    }
    let mut rest = after_name.trim_start();
    if let Some(key) = key {
        let subscripts = [
            format!(".{key}"),
            format!("['{key}']"),
            format!("[\"{key}\"]"),
        ];
        let Some(after_key) = subscripts
            .iter()
            .find_map(|s| rest.strip_prefix(s.as_str()))
        else {
            return false;
        };
        if continues_identifier(after_key) {
            return false;
        }
        rest = after_key.trim_start();
    }
    while rest.starts_with('[') {
        let Some(close) = closing_bracket(rest) else {
            return false;
        };
        let (subscript, tail) = rest.split_at(close);
        if !subscript.contains(':') {
            return false;
        }
        rest = tail.get(1..).unwrap_or("").trim_start();
    }
    filters_and_tests_only(rest)
}

/// Whether `rest` is nothing but `| filter(...)` and `is [not] test(...)`.
fn filters_and_tests_only(mut rest: &str) -> bool {
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            return true;
        }
        let after = if let Some(after) = rest.strip_prefix('|') {
            after
        } else if let Some(after) = rest.strip_prefix("is ") {
            let after = after.trim_start();
            after.strip_prefix("not ").unwrap_or(after)
        } else {
            return false;
        };
        let after = after.trim_start();
        let name_len = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'))
            .unwrap_or(after.len());
        if name_len == 0 {
            return false;
        }
        rest = after.split_at(name_len).1.trim_start();
        if rest.starts_with('(') {
            let Some(close) = closing_bracket(rest) else {
                return false;
            };
            rest = rest.split_at(close).1.get(1..).unwrap_or("");
        }
    }
}

/// The index of the bracket closing the one `text` opens with.
fn closing_bracket(text: &str) -> Option<usize> {
    // An unmatched closer ends the search: there is no closing bracket.
    unquoted(text)
        .find_map(|(i, c, depth)| match (c, depth) {
            (')' | ']' | '}', 0) => Some(None),
            (')' | ']' | '}', 1) => Some(Some(i)),
            _ => None,
        })
        .flatten()
}

/// Whether `rest` goes on with an identifier character (so what came
/// before it was only the start of a longer name).
fn continues_identifier(rest: &str) -> bool {
    rest.chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loops_over_content_mean_openai() {
        for template in [
            "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
            "{%- for message in messages -%}{%- for part in message.content | selectattr('type', 'equalto', 'text') %}x{% endfor %}{% endfor %}",
            "{% set loop_messages = messages[1:] %}{% set rest = loop_messages | list %}{% for m in rest if m.role != 'system' %}{% for c in m[\"content\"][1:] %}{% endfor %}{% endfor %}",
            "{% macro parts(x) %}{% endmacro %}{% for message in (messages) %}{%- for item in message.content -%}{% endfor %}{% endfor %}",
        ] {
            assert_eq!(detect(template), ContentFormat::Openai, "{template}");
        }
    }

    #[test]
    fn anything_else_is_string() {
        for template in [
            "{% for m in messages %}{{ m['content'] | trim }}{% endfor %}",
            // Not a loop over a message: a loop over some other name.
            "{% for m in other %}{% for p in m.content %}{% endfor %}{% endfor %}",
            // `messages[0]` is an item, not a slice: not a list of messages.
            "{% set first = messages[0] %}{% for p in first.content %}{% endfor %}",
            // `content_parts`, not `content`.
            "{% for m in messages %}{% for p in m.content_parts %}{% endfor %}{% endfor %}",
            // A comparison is not a filtered access.
            "{% set many = messages | length > 1 %}{% for m in many %}{% for p in m.content %}{% endfor %}{% endfor %}",
            // vLLM's walk gives up on a namespace target.
            "{% set ns.rest = messages %}{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}",
            "{# {% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %} #}",
            "{% raw %}{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}{% endraw %}",
        ] {
            assert_eq!(detect(template), ContentFormat::String, "{template}");
        }
    }
}
