//! kvroute-sim's `--tokenizer`: a real byte-level BPE tokenizer, so the
//! sim caches what stock vLLM caches: token blocks of the prompt text as
//! vLLM tokenizes it (the rendered chat template for chat, the completions
//! prompt after the tokenizer's added prefix), not kvroute's text blocks.
//!
//! The vocabulary is OpenAI's `cl100k_base` as the `tiktoken-rs` crate
//! ships it (the base Llama 3's tokenizer extends): 100,256 byte-level
//! tokens plus 5 special ones, which text spells literally (as Hugging
//! Face tokenizers parse added tokens in any text they encode). Decoding a
//! token list gives back the exact bytes encoded, which is what the vLLM
//! bridge relies on to map token blocks back to kvroute's text blocks.
//!
//! [`SimTokenizer::tokenizer_json`] writes the vocabulary as a Hugging Face
//! `tokenizer.json` (BPE model, ByteLevel decoder, added tokens), the file
//! the bridge takes with `--tokenizer` for a real model. It carries no
//! merges: it is for decoding, which needs only the vocabulary.
//!
//! A model's own `tokenizer.json` is the other kind (a path instead of a
//! name): Hugging Face's `tokenizers`, the library vLLM's fast tokenizers
//! run, so a sim (or the bench's accounting) tokenizes exactly as a real
//! vLLM pod serving that model does.

use std::path::Path;

use kvroute::request::Prompt;
use kvroute_vllm_bridge::vocab::Vocabulary;
use serde_json::{json, Map, Value};
use tiktoken_rs::CoreBPE;

/// A tokenizer the sim can run (see the module documentation).
pub struct SimTokenizer {
    name: String,
    kind: Kind,
}

enum Kind {
    Tiktoken(CoreBPE),
    /// A model's `tokenizer.json`: its encoder, and the bridge's exact
    /// byte-level decoder of the same file.
    Model {
        json: Vec<u8>,
        encoder: Box<tokenizers::Tokenizer>,
        decoder: Vocabulary,
    },
}

/// The tokenizers `--tokenizer` accepts by name (else: a `tokenizer.json`).
pub const TOKENIZERS: [&str; 1] = ["cl100k_base"];

impl SimTokenizer {
    /// The tokenizer called `name` (one of [`TOKENIZERS`]), or a model's
    /// byte-level BPE `tokenizer.json` at the path `name`.
    pub fn named(name: &str) -> Result<SimTokenizer, String> {
        let kind = match name {
            "cl100k_base" => {
                Kind::Tiktoken(tiktoken_rs::cl100k_base().map_err(|e| format!("cl100k_base: {e}"))?)
            }
            path if Path::new(path).is_file() => {
                let json = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
                let encoder = tokenizers::Tokenizer::from_bytes(&json)
                    .map_err(|e| format!("{path}: not a tokenizer.json: {e}"))?;
                let decoder = Vocabulary::from_json(&json).map_err(|e| format!("{path}: {e}"))?;
                Kind::Model {
                    json,
                    encoder: Box::new(encoder),
                    decoder,
                }
            }
            other => {
                return Err(format!(
                    "unknown tokenizer {other:?} (known: {}, or a tokenizer.json file)",
                    TOKENIZERS.join(", ")
                ))
            }
        };
        Ok(SimTokenizer {
            name: name.to_string(),
            kind,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The prompt vLLM caches: a text prompt's tokens (the text being what
    /// vLLM tokenizes: the rendered chat template, or the completions
    /// prompt after its added prefix); token IDs as given.
    pub fn tokenize(&self, prompt: Prompt) -> Prompt {
        match prompt {
            Prompt::Text(text) => Prompt::Tokens(self.encode(&String::from_utf8_lossy(&text))),
            tokens => tokens,
        }
    }

    /// `text`'s token IDs, special tokens spelled in it included.
    /// A model's tokenizer adds no special tokens of its own here (its
    /// post-processor's BOS): the text already spells them, as vLLM's
    /// rendered chat prompt does and kvroute's `completionPrefix` does.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match &self.kind {
            Kind::Tiktoken(bpe) => bpe.encode_with_special_tokens(text),
            Kind::Model { encoder, .. } => encoder
                .encode(text, false)
                .map(|encoding| encoding.get_ids().to_vec())
                .unwrap_or_default(),
        }
    }

    /// The bytes of `tokens` (`None`: an ID outside the vocabulary).
    pub fn decode(&self, tokens: &[u32]) -> Option<Vec<u8>> {
        match &self.kind {
            Kind::Tiktoken(bpe) => bpe.decode_bytes(tokens).ok(),
            Kind::Model { decoder, .. } => {
                let mut bytes = Vec::new();
                decoder.decode(tokens, &mut bytes).ok().map(|()| bytes)
            }
        }
    }

    /// The vocabulary as a Hugging Face `tokenizer.json` (see the module
    /// documentation); a model's is its own file.
    pub fn tokenizer_json(&self) -> Value {
        let bpe = match &self.kind {
            Kind::Tiktoken(bpe) => bpe,
            Kind::Model { json, .. } => return serde_json::from_slice(json).unwrap_or(Value::Null),
        };
        let symbols = kvroute_vllm_bridge::vocab::byte_level_symbols();
        let byte_level =
            |bytes: &[u8]| -> String { bytes.iter().map(|&b| symbols[usize::from(b)]).collect() };
        let specials = bpe.special_tokens();
        let mut special_ids: Vec<(u32, &str)> = specials
            .iter()
            .map(|&text| (self.encode(text)[0], text))
            .collect();
        special_ids.sort();
        let mut vocab = Map::new();
        let mut id = 0u32;
        while let Some(bytes) = self.decode(&[id]) {
            if special_ids.iter().all(|(special, _)| *special != id) {
                vocab.insert(byte_level(&bytes), json!(id));
            }
            id += 1;
        }
        let added: Vec<Value> = special_ids
            .iter()
            .map(|(id, content)| {
                json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false,
                              "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true,
                        "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false,
                      "vocab": vocab, "merges": []},
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoding_gives_back_the_exact_bytes_special_tokens_included() {
        let tokenizer = SimTokenizer::named("cl100k_base").unwrap();
        let text = "<|im_start|>user\nHé, ça va? 数字 123\t<|endoftext|> 🚀<|im_end|>\n";
        let tokens = tokenizer.encode(text);
        assert!(tokens.contains(&100257), "<|endoftext|> is one token");
        assert_eq!(tokenizer.decode(&tokens).unwrap(), text.as_bytes());
        assert!(SimTokenizer::named("gpt-9").is_err());
    }

    /// What `--write-tokenizer-json` writes is what the bridge decodes with.
    #[test]
    fn the_bridge_decodes_the_exported_vocabulary_exactly() {
        let tokenizer = SimTokenizer::named("cl100k_base").unwrap();
        let json = tokenizer.tokenizer_json().to_string();
        let vocabulary = kvroute_vllm_bridge::vocab::Vocabulary::from_json(json.as_bytes())
            .expect("a byte-level BPE tokenizer.json");
        let text = "<|endoftext|><|im_start|>system\nTools: {\"name\": \"grep\"}\n\tÜber 数字 🚀 <|endofprompt|>";
        let tokens = tokenizer.encode(text);
        let mut decoded = Vec::new();
        vocabulary
            .decode(&tokens, &mut decoded)
            .expect("every id known");
        assert_eq!(decoded, text.as_bytes());
    }
}
