//! One pod's cached blocks as kvroute sees them, built from vLLM's events.
//!
//! vLLM's block hashes are opaque, so each stored block gets the kvroute
//! chain key of token mode instead, computed from the event's `token_ids`
//! and the parent's kvroute key (the prompt's first block: the chain seed
//! of the base model and the adapter, `lora_name`), exactly as the filter
//! hashes a token-ID prompt. That needs `blockSizeTokens` = vLLM's
//! `block_size`; a block of another size, or whose parent is unknown (it
//! was stored before the bridge's history starts), is left out and
//! counted: under-reporting costs a cache hit, never a stale route.
//! Past the first `coarseAfterBlocks` blocks the filter hashes coarse
//! blocks (`coarseBlockFactor` vLLM blocks each); the bridge does not key
//! those yet, so with the default layout it reports a prompt's first
//! 4,096 tokens (counted as `past_fine_blocks`).
//!
//! The vLLM → kvroute mapping is kept so `BlockRemoved` can be applied.
//! Several vLLM blocks may carry one kvroute key (vLLM also hashes
//! `cache_salt` and multimodal keys; a hash may also sit in two media), so
//! keys are reference-counted: stored on the first, removed with the last.
//! Changes go to a [`ReportLog`] that protocol v1 reports are built from.

use std::collections::HashMap;

use kvroute::hashing::{continue_token_chain, BlockMode, ChainSeed};
use kvroute::report::StoredChain;
use kvroute::report_log::{chain_segments, ReportLog};
use serde_json::{Map, Value};

use crate::wire::KvEvent;

/// What must match the filter's token-mode hashing.
#[derive(Debug, Clone)]
pub struct Hashing {
    pub secret: String,
    pub base_model: String,
    pub block_size_tokens: usize,
    /// Blocks of a chain the bridge keys: the filter's blocks of
    /// `blockSizeTokens` (`coarseAfterBlocks`, or all with uniform blocks).
    pub fine_blocks: usize,
    /// Adapter names by vLLM's `lora_id`, for older vLLM whose events
    /// carry no `lora_name`.
    pub lora_ids: HashMap<i64, String>,
}

#[derive(Debug, Clone, Copy)]
struct Mapped {
    key: u64,
    /// Blocks in its chain, itself included.
    depth: usize,
    /// How many times vLLM stored this hash without removing it.
    refs: u32,
}

#[derive(Debug, Clone, Copy)]
struct Key {
    parent: Option<u64>,
    refs: u32,
}

/// Why blocks of an event were left out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Skipped {
    /// The parent block is not known.
    pub unknown_parent: u64,
    /// `block_size` differs from `blockSizeTokens`, or `token_ids` does not
    /// cover the blocks.
    pub wrong_size: u64,
    /// An adapter given only as a `lora_id` not in `--lora-id` (no name to
    /// seed with).
    pub unnamed_adapter: u64,
    /// Past the fine blocks, where the filter's blocks are coarse.
    pub past_fine_blocks: u64,
}

/// The pod's blocks, keyed by kvroute chain keys (see the module docs).
pub struct PodBlocks {
    hashing: Hashing,
    /// Chain seeds per adapter (`None`: the base model).
    seeds: HashMap<Option<String>, u64>,
    vllm: HashMap<u64, Mapped>,
    keys: HashMap<u64, Key>,
    log: ReportLog,
    pub skipped: Skipped,
}

impl PodBlocks {
    pub fn new(hashing: Hashing, max_log: usize) -> PodBlocks {
        PodBlocks {
            hashing,
            seeds: HashMap::new(),
            vllm: HashMap::new(),
            keys: HashMap::new(),
            log: ReportLog::new(max_log),
            skipped: Skipped::default(),
        }
    }

    /// Blocks held (kvroute keys).
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether kvroute key `key` is held.
    pub fn contains(&self, key: u64) -> bool {
        self.keys.contains_key(&key)
    }

    pub fn seq(&self) -> u64 {
        self.log.seq()
    }

    fn seed(&mut self, adapter: Option<&str>) -> u64 {
        let hashing = &self.hashing;
        *self
            .seeds
            .entry(adapter.map(str::to_string))
            .or_insert_with(|| {
                ChainSeed::new(
                    &hashing.secret,
                    &hashing.base_model,
                    adapter,
                    BlockMode::Tokens,
                )
                .value()
            })
    }

    /// Applies one event.
    pub fn apply(&mut self, event: &KvEvent) {
        match event {
            KvEvent::Stored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                lora_name,
                ..
            } => {
                let blocks = block_hashes.len() as u64;
                if *block_size != self.hashing.block_size_tokens
                    || token_ids.len() != block_hashes.len() * block_size
                {
                    self.skipped.wrong_size += blocks;
                    return;
                }
                let adapter = match (lora_name, lora_id) {
                    (Some(name), _) => Some(name.clone()),
                    (None, Some(id)) if *id > 0 => match self.hashing.lora_ids.get(id) {
                        Some(name) => Some(name.clone()),
                        None => {
                            self.skipped.unnamed_adapter += blocks;
                            return;
                        }
                    },
                    (None, _) => None,
                };
                let parent = match parent_block_hash {
                    None => None,
                    Some(hash) => match self.vllm.get(hash) {
                        Some(mapped) => Some((mapped.key, mapped.depth)),
                        None => {
                            self.skipped.unknown_parent += blocks;
                            return;
                        }
                    },
                };
                let (previous, parent_depth) = match parent {
                    Some(found) => found,
                    None => (self.seed(adapter.as_deref()), 0),
                };
                let keyed = self
                    .hashing
                    .fine_blocks
                    .saturating_sub(parent_depth)
                    .min(block_hashes.len());
                self.skipped.past_fine_blocks += (block_hashes.len() - keyed) as u64;
                let keys =
                    continue_token_chain(previous, &token_ids[..keyed * block_size], *block_size);
                let mut parent = parent.map(|(key, _)| key);
                for (depth, (&hash, key)) in (parent_depth + 1..).zip(block_hashes.iter().zip(keys))
                {
                    self.vllm
                        .entry(hash)
                        .and_modify(|m| m.refs += 1)
                        .or_insert(Mapped {
                            key,
                            depth,
                            refs: 1,
                        });
                    let entry = self.keys.entry(key).or_insert(Key { parent, refs: 0 });
                    entry.refs += 1;
                    if entry.refs == 1 {
                        self.log.push(key, parent, true);
                    }
                    parent = Some(key);
                }
            }
            KvEvent::Removed { block_hashes, .. } => {
                for hash in block_hashes {
                    let Some(mapped) = self.vllm.get_mut(hash) else {
                        continue;
                    };
                    mapped.refs -= 1;
                    let key = mapped.key;
                    if mapped.refs == 0 {
                        self.vllm.remove(hash);
                    }
                    if let Some(held) = self.keys.get_mut(&key) {
                        held.refs -= 1;
                        if held.refs == 0 {
                            let parent = held.parent;
                            self.keys.remove(&key);
                            self.log.push(key, parent, false);
                        }
                    }
                }
            }
            KvEvent::AllCleared => self.clear(),
        }
    }

    /// Drops every block (each logged as removed, so a router following
    /// this epoch's deltas drops them too).
    pub fn clear(&mut self) {
        for (key, held) in self.keys.drain() {
            self.log.push(key, held.parent, false);
        }
        self.vllm.clear();
    }

    /// Every block held, as parent-first chains.
    pub fn held(&self) -> Vec<StoredChain> {
        let nodes: Vec<(u64, Option<u64>)> =
            self.keys.iter().map(|(&k, h)| (k, h.parent)).collect();
        chain_segments(&nodes)
    }

    /// The block part of the report answering `?since=…&epoch=…`.
    pub fn report_body(
        &self,
        pod_id: &str,
        epoch: &str,
        since: Option<u64>,
        asked_epoch: Option<&str>,
    ) -> Map<String, Value> {
        self.log
            .report_body(pod_id, epoch, since, asked_epoch, || self.held())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute::hashing::{hash_tokens, BlockLayout};

    fn uniform(size: usize) -> BlockLayout {
        BlockLayout {
            block_size: size,
            coarse_after: usize::MAX,
            coarse_factor: 1,
            max_blocks: 256,
        }
    }

    fn blocks() -> PodBlocks {
        PodBlocks::new(
            Hashing {
                secret: "s".into(),
                base_model: "m".into(),
                block_size_tokens: 2,
                fine_blocks: 3,
                lora_ids: HashMap::from([(7, "a".to_string())]),
            },
            100,
        )
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], lora: Option<&str>) -> KvEvent {
        KvEvent::Stored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: 2,
            lora_id: lora.map(|_| 1),
            medium: None,
            lora_name: lora.map(str::to_string),
        }
    }

    #[test]
    fn keys_are_the_filters_token_chain() {
        let mut pod = blocks();
        pod.apply(&stored(&[10], None, &[1, 2], None));
        pod.apply(&stored(&[11, 12], Some(10), &[3, 4, 5, 6], None));
        pod.apply(&stored(&[20], None, &[1, 2], Some("a")));
        let seed = ChainSeed::new("s", "m", None, BlockMode::Tokens);
        for key in hash_tokens(&seed, &[1, 2, 3, 4, 5, 6], &uniform(2)) {
            assert!(pod.contains(key));
        }
        let adapter = ChainSeed::new("s", "m", Some("a"), BlockMode::Tokens);
        assert!(pod.contains(hash_tokens(&adapter, &[1, 2], &uniform(2))[0]));
        assert_eq!(pod.len(), 4);
        // Older vLLM: the adapter only as `lora_id`, named by `--lora-id`.
        pod.apply(&KvEvent::Stored {
            block_hashes: vec![21],
            parent_block_hash: Some(20),
            token_ids: vec![3, 4],
            block_size: 2,
            lora_id: Some(7),
            medium: None,
            lora_name: None,
        });
        pod.apply(&KvEvent::Stored {
            block_hashes: vec![22],
            parent_block_hash: None,
            token_ids: vec![3, 4],
            block_size: 2,
            lora_id: Some(7),
            medium: None,
            lora_name: None,
        });
        assert!(pod.contains(hash_tokens(&adapter, &[1, 2, 3, 4], &uniform(2))[1]));
        assert!(pod.contains(hash_tokens(&adapter, &[3, 4], &uniform(2))[0]));
    }

    #[test]
    fn a_key_stays_while_any_vllm_block_holds_it() {
        let mut pod = blocks();
        // Same tokens, two vLLM hashes (e.g. two cache_salts).
        pod.apply(&stored(&[10], None, &[1, 2], None));
        pod.apply(&stored(&[30], None, &[1, 2], None));
        assert_eq!(pod.len(), 1);
        pod.apply(&KvEvent::Removed {
            block_hashes: vec![10, 99],
            medium: None,
        });
        assert_eq!(pod.len(), 1);
        pod.apply(&KvEvent::Removed {
            block_hashes: vec![30],
            medium: None,
        });
        assert!(pod.is_empty());
    }

    #[test]
    fn unmappable_blocks_are_left_out_and_counted() {
        let mut pod = blocks();
        pod.apply(&stored(&[11], Some(404), &[3, 4], None));
        pod.apply(&KvEvent::Stored {
            block_hashes: vec![12],
            parent_block_hash: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 4,
            lora_id: None,
            medium: None,
            lora_name: None,
        });
        pod.apply(&KvEvent::Stored {
            block_hashes: vec![13],
            parent_block_hash: None,
            token_ids: vec![1, 2],
            block_size: 2,
            lora_id: Some(3),
            medium: None,
            lora_name: None,
        });
        assert!(pod.is_empty());
        // Three fine blocks are keyed; the fourth is where coarse ones begin.
        pod.apply(&stored(
            &[14, 15, 16, 17],
            None,
            &[1, 2, 3, 4, 5, 6, 7, 8],
            None,
        ));
        assert_eq!(pod.len(), 3);
        pod.apply(&KvEvent::Removed {
            block_hashes: vec![14, 15, 16, 17],
            medium: None,
        });
        assert!(pod.is_empty());
        assert_eq!(
            pod.skipped,
            Skipped {
                unknown_parent: 1,
                wrong_size: 1,
                unnamed_adapter: 1,
                past_fine_blocks: 1,
            }
        );
        pod.apply(&stored(&[10], None, &[1, 2], None));
        pod.apply(&KvEvent::AllCleared);
        assert!(pod.is_empty());
        // 3 stored and 3 removed fine blocks, then one stored and cleared.
        assert_eq!(pod.seq(), 8);
    }
}
