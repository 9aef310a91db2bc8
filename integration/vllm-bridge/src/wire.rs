//! vLLM's KV-cache event wire format (`vllm/distributed/kv_events.py`):
//! decoding what the bridge receives, and encoding for publishers that
//! speak it (kvroute-sim's `--kv-events`).
//!
//! A ZMQ message is `[topic, seq (8-byte big-endian), payload]`; the payload
//! is a msgspec-encoded `EventBatch` `{ts, events, data_parallel_rank}`.
//! msgspec structs come in two shapes: positional arrays (`array_like`,
//! older vLLM: `[ts, events, rank]`, events `[tag, field, ...]`) and maps
//! keyed by field name (newer vLLM; events carry their tag under `type`).
//! Both decode here; fields a struct omits (msgspec's `omit_defaults`) read
//! as their default and fields added after the ones known here are ignored,
//! so a newer vLLM with more trailing fields still decodes.

use rmpv::Value;

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// `block_hashes` (a chain, parent first) were stored; `token_ids` are
    /// the tokens of all of them, `block_size` per block.
    Stored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: usize,
        lora_id: Option<i64>,
        medium: Option<String>,
        lora_name: Option<String>,
        /// Newer vLLM's `extra_keys`, one entry per block as sent: the
        /// tuple of what else went into its hash (LoRA name, multimodal
        /// keys, the first block's `cache_salt`, prompt-embedding keys), or
        /// nil (`None`). Not interpreted here: an entry of another shape
        /// refuses its block only ([`crate::blocks`]); a field that is not
        /// a list gives every block that value. Empty when the event has
        /// none.
        extra_keys: Vec<Option<Value>>,
    },
    Removed {
        block_hashes: Vec<u64>,
        medium: Option<String>,
    },
    AllCleared,
}

/// One decoded `EventBatch`. Events of a kind this bridge does not know
/// are counted in `unknown`, not fatal: a newer vLLM may add kinds.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
    pub unknown: usize,
}

/// msgspec's two struct shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// `array_like=True`: `[tag, field, ...]`.
    Positional,
    /// Field-name maps, the tag under `type`.
    Map,
}

/// The fields of one struct, by name or by position.
struct Fields<'a> {
    names: &'static [&'static str],
    positional: Option<&'a [Value]>,
    map: Option<&'a [(Value, Value)]>,
}

impl<'a> Fields<'a> {
    /// The field `name`; `Nil` when absent (an omitted default).
    fn get(&self, name: &str) -> &'a Value {
        static NIL: Value = Value::Nil;
        if let Some(values) = self.positional {
            let index = self.names.iter().position(|n| *n == name);
            return index.and_then(|i| values.get(i)).unwrap_or(&NIL);
        }
        self.map
            .and_then(|m| m.iter().find(|(k, _)| k.as_str() == Some(name)))
            .map_or(&NIL, |(_, v)| v)
    }
}

const BATCH_FIELDS: &[&str] = &["ts", "events", "data_parallel_rank"];
// Positional events start with their tag, so field i is at i + 1.
const STORED_FIELDS: &[&str] = &[
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
];
const REMOVED_FIELDS: &[&str] = &["type", "block_hashes", "medium"];

fn fields<'a>(value: &'a Value, names: &'static [&'static str]) -> Result<Fields<'a>, String> {
    match value {
        Value::Array(values) => Ok(Fields {
            names,
            positional: Some(values),
            map: None,
        }),
        Value::Map(map) => Ok(Fields {
            names,
            positional: None,
            map: Some(map),
        }),
        other => Err(format!("expected an array or a map, got {other}")),
    }
}

/// A block hash: a 64-bit int (vLLM's default; negative values are the
/// same 64 bits), or bytes (`ExternalBlockHash` may be `bytes`), folded to
/// 64 bits. Either way an opaque id.
fn block_hash(value: &Value, field: &str) -> Result<u64, String> {
    if let Some(unsigned) = value.as_u64() {
        return Ok(unsigned);
    }
    if let Some(signed) = value.as_i64() {
        return Ok(signed as u64);
    }
    if let Some(bytes) = value.as_slice() {
        return Ok(xxhash_rust::xxh64::xxh64(bytes, 0));
    }
    Err(format!("`{field}`: {value} is not a block hash"))
}

fn hashes(value: &Value, field: &str) -> Result<Vec<u64>, String> {
    value
        .as_array()
        .ok_or_else(|| format!("`{field}` is not a list"))?
        .iter()
        .map(|h| block_hash(h, field))
        .collect()
}

fn optional_string(value: &Value, field: &str) -> Result<Option<String>, String> {
    match value {
        Value::Nil => Ok(None),
        Value::String(s) => s
            .as_str()
            .map(|s| Some(s.to_string()))
            .ok_or_else(|| format!("`{field}` is not UTF-8")),
        other => Err(format!("`{field}`: {other} is not a string")),
    }
}

/// `extra_keys` per block, as sent (see [`KvEvent::Stored`]).
fn extra_keys(value: &Value, blocks: usize) -> Vec<Option<Value>> {
    match value {
        Value::Nil => Vec::new(),
        Value::Array(entries) => entries
            .iter()
            .map(|keys| (!keys.is_nil()).then(|| keys.clone()))
            .collect(),
        other => vec![Some(other.clone()); blocks],
    }
}

fn decode_event(value: &Value) -> Result<Option<KvEvent>, String> {
    let tag = match value {
        Value::Array(values) => values.first().and_then(Value::as_str),
        Value::Map(map) => map
            .iter()
            .find(|(k, _)| k.as_str() == Some("type"))
            .and_then(|(_, v)| v.as_str()),
        _ => None,
    }
    .ok_or_else(|| format!("event without a tag: {value}"))?;
    match tag {
        "BlockStored" => {
            let f = fields(value, STORED_FIELDS)?;
            let token_ids = f
                .get("token_ids")
                .as_array()
                .ok_or("`token_ids` is not a list")?
                .iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(|| format!("`token_ids`: {t} is not a token id"))
                })
                .collect::<Result<_, _>>()?;
            let parent = match f.get("parent_block_hash") {
                Value::Nil => None,
                v => Some(block_hash(v, "parent_block_hash")?),
            };
            let block_hashes = hashes(f.get("block_hashes"), "block_hashes")?;
            Ok(Some(KvEvent::Stored {
                extra_keys: extra_keys(f.get("extra_keys"), block_hashes.len()),
                block_hashes,
                parent_block_hash: parent,
                token_ids,
                // 0 in the copies vLLM's offloading connector names by
                // hash only (no token ids).
                block_size: f
                    .get("block_size")
                    .as_u64()
                    .and_then(|b| usize::try_from(b).ok())
                    .ok_or("`block_size` is not a non-negative int")?,
                lora_id: f.get("lora_id").as_i64(),
                medium: optional_string(f.get("medium"), "medium")?,
                lora_name: optional_string(f.get("lora_name"), "lora_name")?,
            }))
        }
        "BlockRemoved" => {
            let f = fields(value, REMOVED_FIELDS)?;
            Ok(Some(KvEvent::Removed {
                block_hashes: hashes(f.get("block_hashes"), "block_hashes")?,
                medium: optional_string(f.get("medium"), "medium")?,
            }))
        }
        "AllBlocksCleared" => Ok(Some(KvEvent::AllCleared)),
        _ => Ok(None),
    }
}

/// Decodes one msgpack `EventBatch` payload; the error says what is wrong.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, String> {
    let mut reader = payload;
    let value = rmpv::decode::read_value(&mut reader).map_err(|e| format!("not msgpack: {e}"))?;
    let f = fields(&value, BATCH_FIELDS)?;
    let ts = f.get("ts").as_f64().ok_or("`ts` is not a number")?;
    let mut events = Vec::new();
    let mut unknown = 0;
    for event in f.get("events").as_array().ok_or("`events` is not a list")? {
        match decode_event(event)? {
            Some(event) => events.push(event),
            None => unknown += 1,
        }
    }
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank: f.get("data_parallel_rank").as_i64(),
        unknown,
    })
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(
        entries
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect(),
    )
}

fn optional(value: &Option<String>) -> Value {
    value.as_deref().map_or(Value::Nil, Value::from)
}

fn hash_list(hashes: &[u64]) -> Value {
    Value::Array(hashes.iter().map(|&h| Value::from(h)).collect())
}

fn encode_event(event: &KvEvent, shape: Shape) -> Value {
    let (tag, fields): (&str, Vec<(&str, Value)>) = match event {
        KvEvent::Stored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            extra_keys,
        } => (
            "BlockStored",
            [
                ("block_hashes", hash_list(block_hashes)),
                (
                    "parent_block_hash",
                    parent_block_hash.map_or(Value::Nil, Value::from),
                ),
                (
                    "token_ids",
                    Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                ),
                ("block_size", Value::from(*block_size as u64)),
                ("lora_id", lora_id.map_or(Value::Nil, Value::from)),
                ("medium", optional(medium)),
                ("lora_name", optional(lora_name)),
            ]
            .into_iter()
            // msgspec omits a default (None) field.
            .chain((!extra_keys.is_empty()).then(|| {
                let blocks = extra_keys
                    .iter()
                    .map(|keys| keys.clone().unwrap_or(Value::Nil));
                ("extra_keys", Value::Array(blocks.collect()))
            }))
            .collect(),
        ),
        KvEvent::Removed {
            block_hashes,
            medium,
        } => (
            "BlockRemoved",
            vec![
                ("block_hashes", hash_list(block_hashes)),
                ("medium", optional(medium)),
            ],
        ),
        KvEvent::AllCleared => ("AllBlocksCleared", Vec::new()),
    };
    match shape {
        Shape::Positional => Value::Array(
            std::iter::once(Value::from(tag))
                .chain(fields.into_iter().map(|(_, v)| v))
                .collect(),
        ),
        Shape::Map => map(std::iter::once(("type", Value::from(tag)))
            .chain(fields)
            .collect()),
    }
}

/// Encodes an `EventBatch` payload the way vLLM's msgspec encoder does
/// in `shape` (the fields vLLM always writes, and `extra_keys` when there
/// are any; none of the other optional ones).
pub fn encode_batch(ts: f64, events: &[KvEvent], rank: i64, shape: Shape) -> Vec<u8> {
    let events = Value::Array(events.iter().map(|e| encode_event(e, shape)).collect());
    let batch = match shape {
        Shape::Positional => Value::Array(vec![Value::F64(ts), events, Value::from(rank)]),
        Shape::Map => map(vec![
            ("ts", Value::F64(ts)),
            ("events", events),
            ("data_parallel_rank", Value::from(rank)),
        ]),
    };
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &batch);
    out
}

/// The 8-byte big-endian sequence number frame, `None` when it is not 8
/// bytes. Replay's end marker is −1.
pub fn decode_seq(frame: &[u8]) -> Option<i64> {
    Some(i64::from_be_bytes(frame.try_into().ok()?))
}
