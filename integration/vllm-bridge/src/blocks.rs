//! One pod's cached blocks as kvroute sees them, built from vLLM's events.
//!
//! vLLM's block hashes are opaque, so each stored block gets the kvroute
//! chain key of token mode instead, computed from the event's `token_ids`
//! and the parent's chain (the prompt's first block: the chain seed of the
//! base model and the adapter, `lora_name`), exactly as the filter hashes a
//! token-ID prompt. That needs `blockSizeTokens` = vLLM's `block_size`; a
//! block of another size, or whose parent is unknown (it was stored before
//! the bridge's history starts), is left out and counted: under-reporting
//! costs a cache hit, never a stale route.
//!
//! The filter's layout is followed to its end ([`TokenChainCursor`]): each
//! of the first `coarseAfterBlocks` vLLM blocks is one kvroute block; past
//! them a kvroute block spans `coarseBlockFactor` vLLM blocks and is keyed
//! when vLLM stores the last of them; past `maxPrefixBlocks` kvroute blocks
//! (462,848 tokens by default), where the router does not look, blocks are
//! counted and left out. vLLM blocks inside a coarse block carry no key of
//! their own, only the chain state their children continue from. A coarse
//! key goes with the vLLM block that completed it: vLLM frees a request's
//! blocks tail first, so the blocks inside it are evicted after it.
//!
//! vLLM's `cache_salt` goes into the hash of a prompt's first block; newer
//! vLLM publishes it in that block's `extra_keys` (after the LoRA name and
//! any multimodal keys), and the bridge seeds the chain with it as the
//! filter seeds a salted request's ([`ChainSeed::salted`]). A block whose
//! extra keys hold anything else (multimodal inputs, prompt embeddings:
//! the filter hashes text and token IDs only) is left out and counted.
//! Older vLLM publishes no `extra_keys`: its salted blocks are keyed as
//! unsalted ones.
//!
//! The vLLM → kvroute mapping is kept so `BlockRemoved` can be applied.
//! Several vLLM blocks may carry one kvroute key (vLLM also hashes
//! `cache_salt` and multimodal keys; a hash may also sit in two media), so
//! keys are reference-counted: stored on the first, removed with the last.
//! Changes go to a [`ReportLog`] that protocol v1 reports are built from.

use std::collections::HashMap;

use kvroute::hashing::{BlockLayout, BlockMode, ChainSeed, ChainStep, TokenChainCursor};
use kvroute::report::StoredChain;
use kvroute::report_log::{chain_segments, ReportLog};
use rmpv::Value as Msgpack;
use serde_json::{Map, Value};

use crate::wire::KvEvent;

/// What must match the filter's token-mode hashing.
#[derive(Debug, Clone)]
pub struct Hashing {
    pub secret: String,
    pub base_model: String,
    /// The filter's token layout: `blockSizeTokens` (vLLM's `block_size`),
    /// `coarseAfterBlocks`, `coarseBlockFactor`, `maxPrefixBlocks`.
    pub layout: BlockLayout,
    /// Adapter names by vLLM's `lora_id`, for older vLLM whose events
    /// carry no `lora_name`.
    pub lora_ids: HashMap<i64, String>,
}

#[derive(Clone)]
struct Mapped {
    /// The kvroute key this vLLM block completed (`None`: inside a coarse
    /// block, or past the cap).
    key: Option<u64>,
    /// The chain up to and including this block, for its children.
    chain: TokenChainCursor,
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
    /// Past `maxPrefixBlocks`, where the router does not look.
    pub past_cap: u64,
    /// Extra keys the filter cannot hash (multimodal inputs, prompt
    /// embeddings), and the blocks after them in their event.
    pub extra_keys: u64,
}

/// The `cache_salt` in one block's vLLM `extra_keys` (`first`: the block
/// opens its chain; the salt is only hashed into such a block), after the
/// adapter (`lora_name`, or `lora_id` on older vLLM) that vLLM lists
/// first. `Err`: keys the filter cannot hash.
fn salt_in(
    extra: Option<&[Msgpack]>,
    lora_name: Option<&str>,
    lora_id: Option<i64>,
    first: bool,
) -> Result<Option<String>, ()> {
    let mut keys = extra.unwrap_or_default();
    if let Some(adapter) = keys.first() {
        let named = lora_name.is_some() && adapter.as_str() == lora_name;
        let numbered = lora_id.is_some() && adapter.as_i64() == lora_id;
        if named || numbered {
            keys = &keys[1..];
        }
    }
    match keys {
        [] => Ok(None),
        [salt] if first => salt.as_str().map(|s| Some(s.to_string())).ok_or(()),
        _ => Err(()),
    }
}

/// The pod's blocks, keyed by kvroute chain keys (see the module docs).
pub struct PodBlocks {
    hashing: Hashing,
    /// Chain seeds per adapter (`None`: the base model).
    seeds: HashMap<Option<String>, ChainSeed>,
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

    fn chain_start(&mut self, adapter: Option<&str>, salt: Option<&str>) -> TokenChainCursor {
        let hashing = &self.hashing;
        let seed = self
            .seeds
            .entry(adapter.map(str::to_string))
            .or_insert_with(|| {
                ChainSeed::new(
                    &hashing.secret,
                    &hashing.base_model,
                    adapter,
                    BlockMode::Tokens,
                )
            });
        TokenChainCursor::new(&seed.clone().salted(salt))
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
                extra_keys,
                ..
            } => {
                let blocks = block_hashes.len() as u64;
                if *block_size != self.hashing.layout.block_size
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
                let extra = |i: usize| extra_keys.get(i).and_then(Option::as_deref);
                let first_salt = salt_in(
                    extra(0),
                    lora_name.as_deref(),
                    *lora_id,
                    parent_block_hash.is_none(),
                );
                let mut chain = match (parent_block_hash, first_salt) {
                    (_, Err(())) => {
                        self.skipped.extra_keys += blocks;
                        return;
                    }
                    (None, Ok(salt)) => self.chain_start(adapter.as_deref(), salt.as_deref()),
                    (Some(hash), Ok(_)) => match self.vllm.get(hash) {
                        Some(parent) => parent.chain.clone(),
                        None => {
                            self.skipped.unknown_parent += blocks;
                            return;
                        }
                    },
                };
                let vllm_blocks = block_hashes.iter().zip(token_ids.chunks_exact(*block_size));
                for (i, (&hash, tokens)) in vllm_blocks.enumerate() {
                    if i > 0 && salt_in(extra(i), lora_name.as_deref(), *lora_id, false).is_err() {
                        self.skipped.extra_keys += (block_hashes.len() - i) as u64;
                        break;
                    }
                    let key = match chain.push(tokens, &self.hashing.layout) {
                        ChainStep::Completed { key, parent } => {
                            let entry = self.keys.entry(key).or_insert(Key { parent, refs: 0 });
                            entry.refs += 1;
                            if entry.refs == 1 {
                                self.log.push(key, parent, true);
                            }
                            Some(key)
                        }
                        ChainStep::Inside => None,
                        ChainStep::PastCap => {
                            self.skipped.past_cap += 1;
                            None
                        }
                    };
                    self.vllm
                        .entry(hash)
                        .and_modify(|m| m.refs += 1)
                        .or_insert_with(|| Mapped {
                            key,
                            chain: chain.clone(),
                            refs: 1,
                        });
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
                    let Some(key) = key else { continue };
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

    /// 3 fine blocks of 2 tokens, then 2 coarse ones of 2 vLLM blocks.
    const LAYOUT: BlockLayout = BlockLayout {
        block_size: 2,
        coarse_after: 3,
        coarse_factor: 2,
        max_blocks: 5,
    };

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
                layout: LAYOUT,
                lora_ids: HashMap::from([(7, "a".to_string())]),
            },
            100,
        )
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], lora: Option<&str>) -> KvEvent {
        stored_with(hashes, parent, tokens, lora, Vec::new())
    }

    fn stored_with(
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        lora: Option<&str>,
        extra_keys: Vec<Option<Vec<Msgpack>>>,
    ) -> KvEvent {
        KvEvent::Stored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: 2,
            lora_id: lora.map(|_| 1),
            medium: None,
            lora_name: lora.map(str::to_string),
            extra_keys,
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
            extra_keys: Vec::new(),
        });
        pod.apply(&KvEvent::Stored {
            block_hashes: vec![22],
            parent_block_hash: None,
            token_ids: vec![3, 4],
            block_size: 2,
            lora_id: Some(7),
            medium: None,
            lora_name: None,
            extra_keys: Vec::new(),
        });
        assert!(pod.contains(hash_tokens(&adapter, &[1, 2, 3, 4], &uniform(2))[1]));
        assert!(pod.contains(hash_tokens(&adapter, &[3, 4], &uniform(2))[0]));
    }

    #[test]
    fn coarse_blocks_are_keyed_when_vllm_stores_their_last_block() {
        let mut pod = blocks();
        let tokens: Vec<u32> = (1..=14).collect();
        let seed = ChainSeed::new("s", "m", None, BlockMode::Tokens);
        let filter = hash_tokens(&seed, &tokens, &LAYOUT);
        assert_eq!(filter.len(), 5);
        // One request stores 4 blocks (3 fine, half a coarse one), the next
        // one continues it, a third branches off inside the coarse block.
        pod.apply(&stored(&[10, 11, 12, 13], None, &tokens[..8], None));
        assert_eq!(pod.len(), 3);
        pod.apply(&stored(&[14, 15, 16], Some(13), &tokens[8..14], None));
        assert_eq!(pod.len(), 5);
        for key in &filter {
            assert!(pod.contains(*key));
        }
        pod.apply(&stored(&[24], Some(13), &[99, 99], None));
        let branch = [&tokens[..8], &[99, 99]].concat();
        assert!(pod.contains(hash_tokens(&seed, &branch, &LAYOUT)[3]));
        assert_eq!(pod.len(), 6);
        // The coarse key goes with the block that completed it.
        pod.apply(&KvEvent::Removed {
            block_hashes: vec![16],
            medium: None,
        });
        assert!(!pod.contains(filter[4]) && pod.contains(filter[3]));
        pod.apply(&KvEvent::Removed {
            block_hashes: vec![15, 14],
            medium: None,
        });
        assert!(!pod.contains(filter[3]) && pod.contains(filter[2]));
        assert_eq!(pod.skipped, Skipped::default());
    }

    #[test]
    fn a_cache_salt_in_the_first_blocks_extra_keys_seeds_the_chain() {
        let mut pod = blocks();
        let keys = |strings: &[&str]| Some(strings.iter().map(|&k| Msgpack::from(k)).collect());
        let salted =
            |hashes: &[u64], lora, extra| stored_with(hashes, None, &[1, 2, 3, 4], lora, extra);
        pod.apply(&salted(&[10, 11], None, vec![keys(&["tenant-a"]), None]));
        pod.apply(&salted(
            &[20, 21],
            Some("a"),
            vec![keys(&["a", "tenant-a"]), keys(&["a"])],
        ));
        pod.apply(&stored(&[30, 31], None, &[1, 2, 3, 4], None));
        let filter = |adapter, salt| {
            let seed = ChainSeed::new("s", "m", adapter, BlockMode::Tokens).salted(salt);
            hash_tokens(&seed, &[1, 2, 3, 4], &LAYOUT)
        };
        for chain in [
            filter(None, Some("tenant-a")),
            filter(Some("a"), Some("tenant-a")),
            filter(None, None),
        ] {
            assert!(chain.iter().all(|key| pod.contains(*key)));
        }
        assert_eq!(pod.len(), 6);
        // A multimodal key (a tuple), anywhere: the filter cannot match it.
        let image = Some(vec![Msgpack::Array(vec!["img".into(), 0.into()])]);
        pod.apply(&salted(&[40, 41], None, vec![image.clone(), None]));
        pod.apply(&salted(&[50, 51], None, vec![None, image]));
        // Block 50 is block 30's key again; 51 and the whole of 40–41 are
        // left out.
        assert_eq!(pod.len(), 6);
        assert_eq!(pod.skipped.extra_keys, 3);
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
            extra_keys: Vec::new(),
        });
        pod.apply(&KvEvent::Stored {
            block_hashes: vec![13],
            parent_block_hash: None,
            token_ids: vec![1, 2],
            block_size: 2,
            lora_id: Some(3),
            medium: None,
            lora_name: None,
            extra_keys: Vec::new(),
        });
        assert!(pod.is_empty());
        // Past the 5th kvroute block (3 fine + 2 × 2 vLLM blocks) the
        // router does not look.
        let tokens: Vec<u32> = (1..=18).collect();
        pod.apply(&stored(
            &[14, 15, 16, 17, 18, 19, 20, 21, 22],
            None,
            &tokens,
            None,
        ));
        assert_eq!(pod.len(), 5);
        pod.apply(&KvEvent::Removed {
            block_hashes: vec![14, 15, 16, 17, 18, 19, 20, 21, 22],
            medium: None,
        });
        assert!(pod.is_empty());
        assert_eq!(
            pod.skipped,
            Skipped {
                unknown_parent: 1,
                wrong_size: 1,
                unnamed_adapter: 1,
                past_cap: 2,
                extra_keys: 0,
            }
        );
        pod.apply(&stored(&[10], None, &[1, 2], None));
        pod.apply(&KvEvent::AllCleared);
        assert!(pod.is_empty());
        // 5 stored and 5 removed, then one stored and cleared.
        assert_eq!(pod.seq(), 12);
    }
}
