//! A model's vocabulary, to decode vLLM's token blocks back to the bytes
//! of the text they were tokenized from (the filter hashes text prompts as
//! bytes).
//!
//! Loaded from the model's Hugging Face `tokenizer.json`, which must be
//! byte-level BPE (Llama 3, Qwen 2/3, GPT-2 and its kin): there every
//! prompt byte is one symbol of GPT-2's byte-level alphabet (printable
//! Latin-1 bytes stand for themselves, the 68 others for U+0100… in byte
//! order, so a space is `Ġ`, a newline `Ċ`), and `model.vocab` maps each
//! token's symbols to its id. Reversing the alphabet gives each token's
//! bytes; a multi-byte UTF-8 character split across tokens comes back
//! whole once they are concatenated. Added tokens (`added_tokens`: the
//! chat template's `<|im_start|>`, special ones included) were matched
//! literally in the text, so they decode to their `content`.
//!
//! Other tokenizers are refused: SentencePiece-style ones (a Metaspace
//! decoder, or BPE with `byte_fallback`: `▁` for spaces, a prefix space
//! added, `<0xNN>` byte pieces), WordPiece and Unigram, and a byte-level
//! pre-tokenizer that adds a prefix space: their decoding does not give
//! back the exact bytes. A normalizer (Qwen's NFC) is accepted: the keys
//! then hold the normalized text, which only an already normalized prompt
//! matches (a miss otherwise, never a wrong match).

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use serde::Deserialize;

/// Token ids beyond this are a broken file (vocabularies are dense from 0
/// and well under it), not a table to allocate.
const MAX_TOKEN_ID: u32 = 1 << 24;

/// The parts of `tokenizer.json` decoding depends on; the rest is ignored.
#[derive(Deserialize)]
struct TokenizerJson {
    model: Model,
    #[serde(default)]
    added_tokens: Vec<AddedToken>,
    decoder: Option<Component>,
    pre_tokenizer: Option<Component>,
}

#[derive(Deserialize)]
struct Model {
    #[serde(rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    byte_fallback: bool,
    /// A map for BPE, a list for Unigram: read once the kind is known.
    #[serde(default)]
    vocab: serde_json::Value,
}

#[derive(Deserialize)]
struct AddedToken {
    id: u32,
    content: String,
}

/// A decoder or pre-tokenizer: its kind, and its parts if a `Sequence`.
#[derive(Deserialize)]
struct Component {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    decoders: Vec<Component>,
    #[serde(default)]
    pretokenizers: Vec<Component>,
    #[serde(default)]
    add_prefix_space: bool,
}

impl Component {
    /// This component and those of its sequence, depth first.
    fn flattened(&self) -> Vec<&Component> {
        std::iter::once(self)
            .chain(
                self.decoders
                    .iter()
                    .chain(&self.pretokenizers)
                    .flat_map(Component::flattened),
            )
            .collect()
    }
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .decoders
            .iter()
            .chain(&self.pretokenizers)
            .map(Component::to_string)
            .collect();
        if parts.is_empty() {
            write!(f, "{}", self.kind)
        } else {
            write!(f, "{}[{}]", self.kind, parts.join(", "))
        }
    }
}

/// GPT-2's byte-level alphabet (Hugging Face's ByteLevel): the symbol
/// each byte is written as (see the module documentation).
pub fn byte_level_symbols() -> [char; 256] {
    let printable = |byte: &u8| matches!(byte, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
    let mut symbols = ['\0'; 256];
    for byte in (0..=255u8).filter(printable) {
        symbols[usize::from(byte)] = char::from(byte);
    }
    let others = (0..=255u8).filter(|byte| !printable(byte));
    for (byte, symbol) in others.zip('\u{100}'..) {
        symbols[usize::from(byte)] = symbol;
    }
    symbols
}

/// The alphabet reversed: entry `c` is the byte that symbol `c` stands for
/// (every symbol is below U+0144).
fn byte_level_alphabet() -> [Option<u8>; 0x144] {
    let mut bytes = [None; 0x144];
    for (byte, symbol) in (0..=255u8).zip(byte_level_symbols()) {
        bytes[symbol as usize] = Some(byte);
    }
    bytes
}

/// Token ids to the bytes they stand for (see the module documentation).
pub struct Vocabulary {
    /// Every token's bytes, back to back.
    bytes: Vec<u8>,
    /// By token id: its range in `bytes` (`None`: no such token).
    tokens: Vec<Option<(u32, u32)>>,
}

impl fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let known = self.tokens.iter().flatten().count();
        write!(f, "Vocabulary({known} tokens)")
    }
}

impl Vocabulary {
    /// Reads the `tokenizer.json` at `path`.
    pub fn load(path: &Path) -> Result<Vocabulary, String> {
        let json =
            std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Vocabulary::from_json(&json).map_err(|e| format!("tokenizer {}: {e}", path.display()))
    }

    /// Parses a `tokenizer.json`; the error says what was found and why it
    /// cannot be decoded to the exact bytes.
    pub fn from_json(json: &[u8]) -> Result<Vocabulary, String> {
        let tokenizer: TokenizerJson =
            serde_json::from_slice(json).map_err(|e| format!("not a tokenizer.json: {e}"))?;
        byte_level_bpe(&tokenizer)?;
        let vocab: HashMap<String, u32> = serde_json::from_value(tokenizer.model.vocab)
            .map_err(|e| format!("`model.vocab` is not a map of tokens to ids: {e}"))?;
        let alphabet = byte_level_alphabet();
        let mut vocabulary = Vocabulary {
            bytes: Vec::new(),
            tokens: Vec::new(),
        };
        for (symbols, id) in vocab {
            let bytes: Option<Vec<u8>> = symbols
                .chars()
                .map(|c| alphabet.get(c as usize).copied().flatten())
                .collect();
            // As Hugging Face's ByteLevel decoder: a token with a symbol
            // outside the alphabet (which byte-level encoding never
            // produces) stands for its own UTF-8.
            vocabulary.insert(id, bytes.as_deref().unwrap_or(symbols.as_bytes()))?;
        }
        // After the vocabulary: an added token whose id is also in
        // `model.vocab` decodes as the added one, as in Hugging Face's.
        for token in &tokenizer.added_tokens {
            vocabulary.insert(token.id, token.content.as_bytes())?;
        }
        Ok(vocabulary)
    }

    fn insert(&mut self, id: u32, bytes: &[u8]) -> Result<(), String> {
        if id >= MAX_TOKEN_ID {
            return Err(format!("token id {id} is not below {MAX_TOKEN_ID}"));
        }
        let start = self.bytes.len();
        self.bytes.extend_from_slice(bytes);
        let range = u32::try_from(start)
            .ok()
            .zip(u32::try_from(self.bytes.len()).ok())
            .ok_or("tokens of more than 4 GiB")?;
        let id = id as usize;
        if self.tokens.len() <= id {
            self.tokens.resize(id + 1, None);
        }
        self.tokens[id] = Some(range);
        Ok(())
    }

    /// Appends the bytes of `ids` to `out`; `Err`: the first id the
    /// vocabulary does not have (`out` then holds those before it).
    pub fn decode(&self, ids: &[u32], out: &mut Vec<u8>) -> Result<(), u32> {
        for &id in ids {
            let (start, end) = self.tokens.get(id as usize).copied().flatten().ok_or(id)?;
            out.extend_from_slice(&self.bytes[start as usize..end as usize]);
        }
        Ok(())
    }
}

/// `Ok` when `tokenizer` decodes to the exact bytes it was given: BPE
/// without byte fallback, a ByteLevel decoder (or none and a ByteLevel
/// pre-tokenizer), no prefix space added.
fn byte_level_bpe(tokenizer: &TokenizerJson) -> Result<(), String> {
    const WHY: &str = "only byte-level BPE (Llama 3, Qwen 2/3, GPT-2 style) decodes token ids \
                       back to the exact bytes vLLM tokenized";
    let model = &tokenizer.model;
    match model.kind.as_deref() {
        Some("BPE") => {}
        Some(kind) => {
            let lossy = lossy(kind);
            return Err(format!("model is {kind}{lossy}, not BPE: {WHY}"));
        }
        None => return Err(format!("`model.type` is missing: {WHY}")),
    }
    if model.byte_fallback {
        return Err(format!(
            "BPE with byte_fallback (SentencePiece style, as Llama 2 or Mistral: `▁` for \
             spaces, `<0xNN>` byte pieces): {WHY}"
        ));
    }
    let byte_level = |component: &Option<Component>| {
        component
            .as_ref()
            .is_some_and(|c| c.flattened().iter().any(|part| part.kind == "ByteLevel"))
    };
    match &tokenizer.decoder {
        Some(decoder) if decoder.kind != "ByteLevel" => {
            let lossy = lossy(&decoder.kind);
            return Err(format!("decoder is {decoder}{lossy}, not ByteLevel: {WHY}"));
        }
        None if !byte_level(&tokenizer.pre_tokenizer) => {
            let found = match &tokenizer.pre_tokenizer {
                Some(pre_tokenizer) => pre_tokenizer.to_string(),
                None => "none".to_string(),
            };
            return Err(format!(
                "no decoder, and the pre-tokenizer is {found}, not ByteLevel: {WHY}"
            ));
        }
        _ => {}
    }
    let prefix_space = tokenizer.pre_tokenizer.as_ref().is_some_and(|p| {
        p.flattened()
            .iter()
            .any(|part| part.kind == "ByteLevel" && part.add_prefix_space)
    });
    if prefix_space {
        return Err(
            "the ByteLevel pre-tokenizer adds a prefix space (`add_prefix_space`): decoded \
             text would start with a space the prompt does not have"
                .to_string(),
        );
    }
    Ok(())
}

/// What a kind of model or decoder loses of the text, for its refusal.
fn lossy(kind: &str) -> &'static str {
    match kind {
        "Metaspace" => " (SentencePiece style: spaces as `▁`, a prefix space added and stripped)",
        "WordPiece" => " (BERT style: `##` continuations, spaces between words not kept)",
        "Unigram" => " (SentencePiece's: spaces as `▁`)",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    /// Qwen 2's format: ChatML special tokens, a Split + ByteLevel
    /// pre-tokenizer, NFC.
    const BYTE_LEVEL: &[u8] = include_bytes!("../tests/data/byte-level-bpe.tokenizer.json");
    /// A SentencePiece conversion: Metaspace pre-tokenizer and decoder.
    const METASPACE: &[u8] = include_bytes!("../tests/data/metaspace.tokenizer.json");

    fn vocabulary() -> Vocabulary {
        Vocabulary::from_json(BYTE_LEVEL).expect("byte-level BPE loads")
    }

    fn decoded(ids: &[u32]) -> Result<Vec<u8>, u32> {
        let mut out = Vec::new();
        vocabulary().decode(ids, &mut out).map(|()| out)
    }

    #[test]
    fn the_alphabet_is_gpt2s_bytes_to_unicode() {
        let symbols = byte_level_symbols();
        for (symbol, byte) in [
            ('Ā', 0x00),
            ('ĉ', b'\t'),
            ('Ċ', b'\n'),
            ('Ġ', b' '),
            ('!', b'!'),
            ('~', b'~'),
            ('ġ', 0x7f),
            ('Ł', 0x9f),
            ('ł', 0xa0),
            ('¡', 0xa1),
            ('Ń', 0xad),
            ('ÿ', 0xff),
        ] {
            assert_eq!(symbols[usize::from(byte)], symbol, "{byte:#x}");
        }
        // Reversed, each byte once.
        let alphabet = byte_level_alphabet();
        assert_eq!(alphabet.iter().flatten().count(), 256);
        for (byte, symbol) in symbols.iter().enumerate() {
            assert_eq!(alphabet[*symbol as usize], Some(byte as u8));
        }
    }

    #[test]
    fn tokens_decode_to_the_bytes_they_were_tokenized_from() {
        // <|im_start|>system\nYou are a helpful assistant.<|im_end|>\n
        // <|im_start|>user\nCafé costs 5€?<|im_end|>\n<|im_start|>assistant\n
        let chat = [
            31, 2, 0, 5, 6, 7, 8, 9, 10, 32, 0, 31, 3, 0, 11, 12, 13, 14, 15, 17, 18, 32, 0, 31, 4,
            0,
        ];
        assert_eq!(
            String::from_utf8(decoded(&chat).unwrap()).unwrap(),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
             <|im_start|>user\nCafé costs 5€?<|im_end|>\n<|im_start|>assistant\n"
        );
        // A character split across tokens: each token alone is part of it.
        assert_eq!(decoded(&[12]), Ok(vec![0xc3]));
        assert_eq!(decoded(&[12, 13]), Ok("é".as_bytes().to_vec()));
        assert_eq!(decoded(&[20]), Ok(vec![0xe2, 0x82]));
        assert_eq!(decoded(&[20, 21]), decoded(&[17]));
        assert_eq!(decoded(&[20, 21]), Ok("€".as_bytes().to_vec()));
        // Whitespace and bytes that are no text at all.
        assert_eq!(
            decoded(&[19, 22, 25, 23, 24]),
            Ok(b"\t\n\n  \0\xad".to_vec())
        );
        // Added tokens, special or not, and one also in `model.vocab`.
        assert_eq!(decoded(&[33, 30]), Ok(b"<think><|endoftext|>".to_vec()));
    }

    #[test]
    fn an_unknown_id_is_an_error_naming_it() {
        let mut out = Vec::new();
        let vocabulary = vocabulary();
        assert_eq!(vocabulary.decode(&[0, 27, 1], &mut out), Err(27), "a gap");
        assert_eq!(out, b"\n");
        assert_eq!(vocabulary.decode(&[151_643], &mut out), Err(151_643));
        assert_eq!(format!("{vocabulary:?}"), "Vocabulary(30 tokens)");
    }

    /// The byte-level fixture with `edit` applied.
    fn edited(edit: impl FnOnce(&mut Value)) -> Result<Vocabulary, String> {
        let mut tokenizer: Value = serde_json::from_slice(BYTE_LEVEL).unwrap();
        edit(&mut tokenizer);
        Vocabulary::from_json(tokenizer.to_string().as_bytes())
    }

    fn refusal(result: Result<Vocabulary, String>) -> String {
        match result {
            Ok(vocabulary) => panic!("{vocabulary:?} accepted"),
            Err(e) => e,
        }
    }

    #[test]
    fn other_tokenizers_are_refused_naming_what_was_found() {
        let metaspace = refusal(Vocabulary::from_json(METASPACE));
        assert!(
            metaspace.starts_with(
                "decoder is Metaspace (SentencePiece style: spaces as `▁`, a prefix space added \
                 and stripped), not ByteLevel: only byte-level BPE"
            ),
            "{metaspace}"
        );
        // Llama 2, Mistral: SentencePiece pieces with byte fallback.
        let llama2 = refusal(edited(|t| {
            t["model"]["byte_fallback"] = json!(true);
            t["model"]["vocab"]["<0x0A>"] = json!(26);
            t["decoder"] = json!({"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]});
        }));
        assert!(llama2.starts_with("BPE with byte_fallback"), "{llama2}");
        let sequence = refusal(edited(|t| {
            t["decoder"] = json!({"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]});
        }));
        assert!(
            sequence.starts_with("decoder is Sequence[Replace, ByteFallback, Fuse], not ByteLevel"),
            "{sequence}"
        );
        let word_piece = refusal(edited(|t| {
            t["model"] = json!({"type": "WordPiece", "unk_token": "[UNK]",
                "continuing_subword_prefix": "##", "vocab": {"[UNK]": 0, "##s": 1}});
        }));
        assert!(
            word_piece.starts_with("model is WordPiece (BERT style"),
            "{word_piece}"
        );
        let unigram = refusal(edited(|t| {
            t["model"] = json!({"type": "Unigram", "unk_id": 0, "vocab": [["<unk>", 0.0]]});
        }));
        assert!(
            unigram.starts_with("model is Unigram (SentencePiece's: spaces as `▁`), not BPE"),
            "{unigram}"
        );
        let no_decoder = refusal(edited(|t| {
            t["decoder"] = Value::Null;
            t["pre_tokenizer"] = json!({"type": "Metaspace", "replacement": "▁"});
        }));
        assert!(
            no_decoder.starts_with("no decoder, and the pre-tokenizer is Metaspace"),
            "{no_decoder}"
        );
        let prefix_space = refusal(edited(|t| {
            t["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = json!(true);
        }));
        assert!(
            prefix_space.contains("adds a prefix space"),
            "{prefix_space}"
        );
        let huge_id = refusal(edited(|t| t["added_tokens"][0]["id"] = json!(1u64 << 31)));
        assert!(huge_id.contains("token id 2147483648"), "{huge_id}");
        let not_json = refusal(Vocabulary::from_json(b"{\"model\": "));
        assert!(not_json.starts_with("not a tokenizer.json"), "{not_json}");
        // GPT-2's own: no Sequence, and a decoder is not required when the
        // pre-tokenizer is ByteLevel.
        edited(|t| {
            t["pre_tokenizer"] = json!({"type": "ByteLevel", "add_prefix_space": false,
                "trim_offsets": true, "use_regex": true});
            t["decoder"] = Value::Null;
        })
        .expect("byte-level without a decoder loads");
    }
}
