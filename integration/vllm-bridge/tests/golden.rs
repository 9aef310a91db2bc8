//! Golden frames: msgpack payloads written out byte by byte as vLLM's
//! msgspec encoder produces them (`EventBatch`, `BlockStored`,
//! `BlockRemoved`, `AllBlocksCleared`; map form of newer vLLM, positional
//! form of older vLLM with its shorter field lists, fields added by later
//! versions), decoded by the bridge; the sim's encoder, which must write
//! the very same bytes; and a stored chat's blocks, keyed with a tokenizer
//! as the filter keys the chat's text.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute::config::{Config, ModelTarget};
use kvroute::hashing::{BlockHasher, BlockLayout};
use kvroute::report::{StoredChain, Tier};
use kvroute::request::Prompt;
use kvroute_vllm_bridge::blocks::{Hashing, PodBlocks, TextHashing};
use kvroute_vllm_bridge::vocab::Vocabulary;
use kvroute_vllm_bridge::wire::{decode_batch, decode_seq, encode_batch, KvEvent, Shape};
use rmpv::Value;

/// msgpack fixstr (< 32 bytes), as msgspec writes short strings.
fn s(text: &str) -> Vec<u8> {
    assert!(text.len() < 32);
    let mut out = vec![0xa0 | text.len() as u8];
    out.extend_from_slice(text.as_bytes());
    out
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

const TS: [u8; 9] = [0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]; // float64 1.5

/// The block mapping for model `m` hashed as `config` says, text keys with
/// `text`.
fn pod_blocks(config: &Config, text: Option<TextHashing>) -> PodBlocks {
    let hashing = Hashing {
        secret: config.hash_seed.clone(),
        base_model: "m".into(),
        layout: BlockLayout::tokens(config),
        lora_ids: HashMap::new(),
        text,
    };
    PodBlocks::new(hashing, 100)
}

fn stored() -> KvEvent {
    KvEvent::Stored {
        block_hashes: vec![0xffff_ffff_ffff_fff0, 7],
        parent_block_hash: None,
        token_ids: vec![1, 2, 200, 300],
        block_size: 2,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: Vec::new(),
    }
}

fn removed() -> KvEvent {
    KvEvent::Removed {
        block_hashes: vec![7],
        medium: Some("GPU".into()),
    }
}

/// `KVEventBatch(ts=1.5, events=[BlockStored(...), BlockRemoved(...),
/// AllBlocksCleared()], data_parallel_rank=0)` in vLLM's map form: struct
/// fields in declaration order, the tag first under `type`, defaults
/// (`extra_keys=None`, `group_idx=None`, …) omitted.
fn map_form() -> Vec<u8> {
    cat(&[
        &[0x83],
        &s("ts"),
        &TS,
        &s("events"),
        &[0x93, 0x88],
        &s("type"),
        &s("BlockStored"),
        &s("block_hashes"),
        &[
            0x92, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xf0, 0x07,
        ],
        &s("parent_block_hash"),
        &[0xc0],
        &s("token_ids"),
        &[0x94, 0x01, 0x02, 0xcc, 0xc8, 0xcd, 0x01, 0x2c],
        &s("block_size"),
        &[0x02],
        &s("lora_id"),
        &[0xc0],
        &s("medium"),
        &s("GPU"),
        &s("lora_name"),
        &[0xc0],
        &[0x83],
        &s("type"),
        &s("BlockRemoved"),
        &s("block_hashes"),
        &[0x91, 0x07],
        &s("medium"),
        &s("GPU"),
        &[0x81],
        &s("type"),
        &s("AllBlocksCleared"),
        &s("data_parallel_rank"),
        &[0x00],
    ])
}

#[test]
fn map_form_decodes() {
    let batch = decode_batch(&map_form()).expect("decodes");
    assert_eq!(batch.ts, 1.5);
    assert_eq!(batch.data_parallel_rank, Some(0));
    assert_eq!(batch.events, vec![stored(), removed(), KvEvent::AllCleared]);
    assert_eq!(batch.unknown, 0);
}

#[test]
fn the_encoder_writes_vllms_bytes() {
    let events = [stored(), removed(), KvEvent::AllCleared];
    assert_eq!(encode_batch(1.5, &events, 0, Shape::Map), map_form());
    let positional = cat(&[
        &[0x93],
        &TS,
        &[0x91, 0x93],
        &s("BlockRemoved"),
        &[0x91, 0x07],
        &s("GPU"),
        &[0x00],
    ]);
    assert_eq!(
        encode_batch(1.5, &[removed()], 0, Shape::Positional),
        positional
    );
}

/// Map form from a later vLLM: fields it added (`extra_keys`,
/// `group_idx`, `kv_cache_spec_kind`) and an event kind unknown here.
#[test]
fn added_fields_and_kinds_are_tolerated() {
    let payload = cat(&[
        &[0x83],
        &s("ts"),
        &TS,
        &s("events"),
        &[0x92, 0x8b],
        &s("type"),
        &s("BlockStored"),
        &s("block_hashes"),
        &[0x91, 0x2a],
        &s("parent_block_hash"),
        &[0x07],
        &s("token_ids"),
        &[0x92, 0x05, 0x06],
        &s("block_size"),
        &[0x02],
        &s("lora_id"),
        &[0x01],
        &s("medium"),
        &s("GPU"),
        &s("lora_name"),
        &s("lora-a"),
        &s("extra_keys"),
        &[0x91, 0x91],
        &s("lora-a"),
        &s("group_idx"),
        &[0x00],
        &s("kv_cache_spec_kind"),
        &s("full_attention"),
        &[0x81],
        &s("type"),
        &s("BlockMoved"),
        &s("data_parallel_rank"),
        &[0x01],
    ]);
    let batch = decode_batch(&payload).expect("decodes");
    assert_eq!(batch.unknown, 1);
    assert_eq!(
        batch.events,
        vec![KvEvent::Stored {
            block_hashes: vec![42],
            parent_block_hash: Some(7),
            token_ids: vec![5, 6],
            block_size: 2,
            lora_id: Some(1),
            medium: Some("GPU".into()),
            lora_name: Some("lora-a".into()),
            extra_keys: vec![Some(Value::Array(vec![Value::from("lora-a")]))],
        }]
    );
}

/// A salted request's first two blocks in newer vLLM's map form: the
/// first block's `extra_keys` hold its `cache_salt`, the second's none
/// (nil); decoded, and written the same by the sim's encoder.
#[test]
fn extra_keys_carry_the_first_blocks_cache_salt() {
    let payload = cat(&[
        &[0x83],
        &s("ts"),
        &TS,
        &s("events"),
        &[0x91, 0x89],
        &s("type"),
        &s("BlockStored"),
        &s("block_hashes"),
        &[0x92, 0x0b, 0x0c],
        &s("parent_block_hash"),
        &[0xc0],
        &s("token_ids"),
        &[0x94, 0x01, 0x02, 0x03, 0x04],
        &s("block_size"),
        &[0x02],
        &s("lora_id"),
        &[0xc0],
        &s("medium"),
        &s("GPU"),
        &s("lora_name"),
        &[0xc0],
        &s("extra_keys"),
        &[0x92, 0x91],
        &s("tenant-a"),
        &[0xc0],
        &s("data_parallel_rank"),
        &[0x00],
    ]);
    let event = KvEvent::Stored {
        block_hashes: vec![11, 12],
        parent_block_hash: None,
        token_ids: vec![1, 2, 3, 4],
        block_size: 2,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: vec![Some(Value::Array(vec![Value::from("tenant-a")])), None],
    };
    assert_eq!(
        decode_batch(&payload).expect("decodes").events,
        vec![event.clone()]
    );
    assert_eq!(encode_batch(1.5, &[event], 0, Shape::Map), payload);
}

/// The typed `extra_keys` proposed upstream (a tagged struct per key, here
/// `CacheSaltKey` in map form) decode as sent: the batch is no malformed
/// frame; the block mapping refuses such a block alone.
#[test]
fn typed_extra_keys_decode_as_sent() {
    let payload = cat(&[
        &[0x83],
        &s("ts"),
        &TS,
        &s("events"),
        &[0x91, 0x87],
        &s("type"),
        &s("BlockStored"),
        &s("block_hashes"),
        &[0x91, 0x0b],
        &s("parent_block_hash"),
        &[0xc0],
        &s("token_ids"),
        &[0x92, 0x01, 0x02],
        &s("block_size"),
        &[0x02],
        &s("lora_id"),
        &[0xc0],
        &s("extra_keys"),
        &[0x91, 0x91, 0x82],
        &s("type"),
        &s("CacheSaltKey"),
        &s("salt"),
        &s("tenant-a"),
        &s("data_parallel_rank"),
        &[0x00],
    ]);
    let batch = decode_batch(&payload).expect("decodes");
    let KvEvent::Stored { extra_keys, .. } = &batch.events[0] else {
        panic!("{batch:?}");
    };
    let typed = Value::Map(vec![
        (Value::from("type"), Value::from("CacheSaltKey")),
        (Value::from("salt"), Value::from("tenant-a")),
    ]);
    assert_eq!(extra_keys, &vec![Some(Value::Array(vec![typed]))]);
    let config = Config {
        block_size_tokens: 2,
        ..Config::default()
    };
    let mut pod = pod_blocks(&config, None);
    pod.apply(&batch.events[0]);
    assert!(pod.is_empty());
    assert_eq!(pod.skipped.unknown_extra_keys, 1);
    assert!(pod
        .refusal()
        .is_some_and(|why| why.contains("CacheSaltKey")));
}

/// A copy vLLM's offloading connector publishes by default (no
/// self-describing events): `BlockStored` named by hash only, no token ids,
/// `block_size` 0, medium `CPU`, its `group_idx`; then the GPU copy's
/// removal. Decoded (a `block_size` of 0 is no malformed frame), and a
/// copy of the block stored before: the key stays, now on the CPU.
#[test]
fn an_offloaded_copy_named_by_hash_decodes_and_moves_its_block() {
    let payload = cat(&[
        &[0x83],
        &s("ts"),
        &TS,
        &s("events"),
        &[0x92, 0x89],
        &s("type"),
        &s("BlockStored"),
        &s("block_hashes"),
        &[0x91, 0x2a],
        &s("parent_block_hash"),
        &[0xc0],
        &s("token_ids"),
        &[0x90],
        &s("block_size"),
        &[0x00],
        &s("lora_id"),
        &[0xc0],
        &s("medium"),
        &s("CPU"),
        &s("lora_name"),
        &[0xc0],
        &s("group_idx"),
        &[0x00],
        &[0x83],
        &s("type"),
        &s("BlockRemoved"),
        &s("block_hashes"),
        &[0x91, 0x2a],
        &s("medium"),
        &s("GPU"),
        &s("data_parallel_rank"),
        &[0x00],
    ]);
    let batch = decode_batch(&payload).expect("decodes");
    assert_eq!(
        batch.events[0],
        KvEvent::Stored {
            block_hashes: vec![42],
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 0,
            lora_id: None,
            medium: Some("CPU".into()),
            lora_name: None,
            extra_keys: Vec::new(),
        }
    );
    let config = Config {
        block_size_tokens: 2,
        ..Config::default()
    };
    let mut pod = pod_blocks(&config, None);
    pod.apply(&KvEvent::Stored {
        block_hashes: vec![42],
        parent_block_hash: None,
        token_ids: vec![5, 6],
        block_size: 2,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: Vec::new(),
    });
    for event in &batch.events {
        pod.apply(event);
    }
    assert_eq!(pod.tier_len(), [0, 1, 0]);
    assert_eq!(pod.held()[0].tier, Tier::Cpu);
}

/// Older vLLM (`array_like=True`): `[ts, events, rank]`, events
/// `[tag, fields…]`; the oldest `BlockStored` stops at `lora_id` (no
/// `medium`, no `lora_name`); a negative int hash is the same 64 bits;
/// a later trailing field is ignored.
#[test]
fn positional_form_decodes() {
    let payload = cat(&[
        &[0x93],
        &TS,
        &[0x93, 0x96],
        &s("BlockStored"),
        &[0x92, 0xd1, 0xfc, 0x18, 0xce, 0x80, 0, 0, 0],
        &[0xc0],
        &[0x94, 0x01, 0x02, 0x03, 0x04],
        &[0x02],
        &[0xc0],
        &[0x99],
        &s("BlockStored"),
        &[0x91, 0x05],
        &[0xce, 0x80, 0, 0, 0],
        &[0x92, 0x09, 0x0a],
        &[0x02],
        &[0x03],
        &s("GPU"),
        &s("lora-a"),
        &[0xc0],
        &[0x94],
        &s("BlockRemoved"),
        &[0x91, 0x05],
        &s("GPU"),
        &[0x00],
        &[0x00],
    ]);
    let batch = decode_batch(&payload).expect("decodes");
    assert_eq!(batch.data_parallel_rank, Some(0));
    assert_eq!(
        batch.events,
        vec![
            KvEvent::Stored {
                block_hashes: vec![(-1000i64) as u64, 0x8000_0000],
                parent_block_hash: None,
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                lora_id: None,
                medium: None,
                lora_name: None,
                extra_keys: Vec::new(),
            },
            KvEvent::Stored {
                block_hashes: vec![5],
                parent_block_hash: Some(0x8000_0000),
                token_ids: vec![9, 10],
                block_size: 2,
                lora_id: Some(3),
                medium: Some("GPU".into()),
                lora_name: Some("lora-a".into()),
                extra_keys: Vec::new(),
            },
            KvEvent::Removed {
                block_hashes: vec![5],
                medium: Some("GPU".into()),
            },
        ]
    );
}

#[test]
fn malformed_payloads_are_errors_not_panics() {
    for bad in [
        &b""[..],
        b"\xc1",
        b"\x93\xcb",
        b"\x93\xa1x\x90\x00",
        b"\x93\xcb\x3f\xf8\0\0\0\0\0\0\x91\x91\xa9Unknown!!",
        b"\x93\xcb\x3f\xf8\0\0\0\0\0\0\x91\x92\xabBlockStored\xa1x",
    ] {
        assert!(decode_batch(bad).is_err(), "{bad:?}");
    }
    assert_eq!(decode_seq(&[0, 0, 0, 0, 0, 0, 1, 2]), Some(258));
    assert_eq!(decode_seq(&[0xff; 8]), Some(-1));
    assert_eq!(decode_seq(&[1, 2]), None);
}

/// Two 16-token blocks of a ChatML conversation in the tokens of
/// `tests/data/byte-level-bpe.tokenizer.json` (map form), stored by a
/// bridge given that tokenizer and kvroute's default layouts: besides the
/// token keys, its text keys are the filter's chain of the chat's text
/// (153 bytes: two 64-byte blocks, the first ending inside vLLM's first
/// block, which itself ends inside "é").
#[test]
fn a_stored_chats_text_keys_are_the_filters_chain_of_its_text() {
    let tokens: [u8; 32] = [
        31, 2, 0, 5, 6, 7, 8, 9, 10, 32, 0, 31, 3, 0, 11, 12, 13, 14, 15, 17, 18, 32, 0, 31, 4, 0,
        5, 6, 7, 8, 9, 10,
    ];
    let payload = cat(&[
        &[0x83],
        &s("ts"),
        &TS,
        &s("events"),
        &[0x91, 0x88],
        &s("type"),
        &s("BlockStored"),
        &s("block_hashes"),
        &[0x92, 0x0b, 0x0c],
        &s("parent_block_hash"),
        &[0xc0],
        &s("token_ids"),
        &[0xdc, 0x00, 0x20],
        &tokens,
        &s("block_size"),
        &[0x10],
        &s("lora_id"),
        &[0xc0],
        &s("medium"),
        &s("GPU"),
        &s("lora_name"),
        &[0xc0],
        &s("data_parallel_rank"),
        &[0x00],
    ]);
    let config = Config::default();
    let tokenizer = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/byte-level-bpe.tokenizer.json"
    );
    let text = TextHashing {
        layout: BlockLayout::text(&config),
        vocabulary: Arc::new(Vocabulary::load(tokenizer.as_ref()).expect("loads")),
    };
    let mut pod = pod_blocks(&config, Some(text));
    let events = decode_batch(&payload).expect("decodes").events;
    assert_eq!(encode_batch(1.5, &events, 0, Shape::Map), payload);
    for event in &events {
        pod.apply(event);
    }
    let text = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
                <|im_start|>user\nCafé costs 5€?<|im_end|>\n\
                <|im_start|>assistant\nYou are a helpful assistant.";
    let filter = BlockHasher::from_config(&config);
    let target = ModelTarget {
        base_model: "m".into(),
        adapter: None,
    };
    let text_keys = filter.chain(&target, &Prompt::Text(text.into()), None);
    let token_keys = filter.chain(&target, &Prompt::Tokens(tokens.map(u32::from).into()), None);
    assert_eq!((text_keys.len(), token_keys.len()), (2, 2));
    let mut held = pod.held();
    held.sort_by_key(|chain| chain.hashes[0] != text_keys[0]);
    assert_eq!(
        held,
        [
            StoredChain {
                parent: None,
                hashes: text_keys,
                tier: Tier::Gpu,
            },
            StoredChain {
                parent: None,
                hashes: token_keys,
                tier: Tier::Gpu,
            }
        ]
    );
    assert_eq!(pod.text_len(), 2);
}
