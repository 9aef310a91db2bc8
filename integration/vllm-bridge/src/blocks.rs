//! One pod's cached blocks as kvroute sees them, built from vLLM's events.
//!
//! vLLM's block hashes are opaque, so each stored block gets the kvroute
//! chain key of token mode instead, computed from the event's `token_ids`
//! and the parent's chain (the prompt's first block: the chain seed of the
//! base model and the adapter, `lora_name`), exactly as the filter hashes a
//! token-ID prompt. That needs `blockSizeTokens` = vLLM's `block_size`; a
//! block of another size, or whose parent is unknown (it was stored before
//! the bridge's history starts), is left out and counted: under-reporting
//! costs a cache hit, never a stale route. Another size leaves out every
//! block, so the bridge logs it as an error naming both sizes.
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
//! Extra keys of a shape vLLM does not send today (the typed form proposed
//! upstream, a salt that is not a string, a salt past a chain's first
//! block, more or fewer entries than blocks) are refused for that block,
//! counted apart and described for the log; the rest of the batch applies.
//! A refused block takes the blocks after it in its event along (their
//! chain continues it). Older vLLM publishes no `extra_keys`: its salted
//! blocks are keyed as unsalted ones.
//!
//! **Text keys** (with a tokenizer, `--tokenizer`). The filter hashes text
//! and chat prompts as bytes, in blocks of `blockSizeBytes` (text mode).
//! Each stored block's tokens are decoded to the bytes they were tokenized
//! from ([`Vocabulary`]) and fed to a [`TextChainCursor`] that continues
//! its parent's text chain (a first block's: the text-mode seed of the same
//! base model, adapter and salt). vLLM's token blocks do not fall on byte
//! boundaries, so a block completes the text blocks whose last byte it
//! holds: none, one or several, each keyed exactly as the filter keys that
//! text. They go with that vLLM block, as a coarse key does, alongside its
//! token key. A token id the vocabulary lacks leaves its block and every
//! block after it without text keys (counted); their token keys stay.
//!
//! The vLLM → kvroute mapping is kept so `BlockRemoved` can be applied.
//! Several vLLM blocks may carry one kvroute key (vLLM also hashes
//! `cache_salt` and multimodal keys), so keys are reference-counted:
//! stored on the first, removed with the last. Changes go to a
//! [`ReportLog`] that protocol v1 reports are built from.
//!
//! **Tiers.** With KV offloading (vLLM's offloading connector, LMCache)
//! vLLM keeps copies of a block in several media (`GPU`, `CPU`, storage)
//! and reports each copy's store and removal with its `medium`. Copies are
//! counted per medium, for each vLLM block and for each kvroute key (over
//! the vLLM blocks carrying it): a block in two media counts once in each,
//! and a removal from one leaves the other. A key is reported in the
//! fastest tier holding a copy ([`Tier`]: GPU, CPU, disk); when that
//! changes (the GPU copy evicted while a CPU copy stays, or a CPU copy
//! reloaded to the GPU) it is logged as stored again, in its new tier.
//! A copy named by hash only (vLLM's offloading connector without
//! self-describing events publishes no token ids) is a copy of a block
//! keyed before; one of a block never keyed is counted and left out. A
//! self-describing copy (token ids, parent) is keyed like a GPU store.
//! `medium` names, in any case: none or `GPU`; names holding `CPU` (vLLM,
//! SGLang's `CPU_TIER1`/`CPU_TIER2`, LMCache's CPU backend); names holding
//! `DISK`, or `STORAGE` (vLLM's storage tier). Another name is refused,
//! counted and logged. `AllBlocksCleared` drops every medium: vLLM sends it
//! on a prefix-cache reset, and dropping copies that may survive costs
//! hits, never a stale route. LMCache publishes stores but no removals,
//! in its chunk size (256 tokens by default): such chunks are left out by
//! size unless it equals `blockSizeTokens`, and should be, since their
//! eviction would never be seen.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kvroute::hashing::{
    BlockLayout, BlockMode, ChainSeed, ChainStep, TextChainCursor, TokenChainCursor,
};
use kvroute::report::{StoredChain, Tier};
use kvroute::report_log::{chain_segments, ReportLog};
use rmpv::Value as Msgpack;
use serde_json::{Map, Value};

use crate::vocab::Vocabulary;
use crate::wire::KvEvent;

/// What must match the filter's hashing.
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
    /// Text-mode keys too (`None`: token keys only).
    pub text: Option<TextHashing>,
}

/// What text-mode keys need: the filter's text layout and the model's
/// vocabulary.
#[derive(Debug, Clone)]
pub struct TextHashing {
    /// `blockSizeBytes`, `coarseAfterBlocks`, `coarseBlockFactor`,
    /// `maxPrefixBlocks`.
    pub layout: BlockLayout,
    pub vocabulary: Arc<Vocabulary>,
}

/// A chain in both modes, up to and including a vLLM block: what its
/// children continue.
#[derive(Clone)]
struct Chains {
    tokens: TokenChainCursor,
    /// `None`: no tokenizer, or a token id it lacks in this block or before.
    text: Option<TextChainCursor>,
}

/// A base model's or adapter's chain seeds.
struct Seeds {
    tokens: ChainSeed,
    text: ChainSeed,
}

#[derive(Clone)]
struct Mapped {
    /// The kvroute key this vLLM block completed (`None`: inside a coarse
    /// block, or past the cap).
    key: Option<u64>,
    /// The text-mode keys it completed, in chain order.
    text_keys: Vec<u64>,
    chain: Chains,
    /// The vLLM block it continues (`None`: it opens a chain).
    parent: Option<u64>,
    /// How many times vLLM stored this hash in each medium without
    /// removing it.
    copies: Copies,
}

/// Copies of a block per tier (vLLM's `medium`), indexed by
/// [`Tier::index`]: a block in two media counts once in each, and a
/// removal from one leaves the other.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Copies([u32; 3]);

impl Copies {
    /// The fastest tier holding a copy (`None`: no copy left).
    fn best(&self) -> Option<Tier> {
        Tier::ALL.into_iter().find(|tier| self.0[tier.index()] > 0)
    }

    fn add(&mut self, tier: Tier) {
        self.0[tier.index()] += 1;
    }

    /// One copy in `tier` fewer; `false` when there was none.
    fn take(&mut self, tier: Tier) -> bool {
        let copies = &mut self.0[tier.index()];
        let had = *copies > 0;
        *copies = copies.saturating_sub(1);
        had
    }

    fn in_tier(&self, tier: Tier) -> u32 {
        self.0[tier.index()]
    }
}

#[derive(Debug, Clone, Copy)]
struct Key {
    parent: Option<u64>,
    copies: Copies,
    /// A text-mode key.
    text: bool,
}

/// The kvroute keys held, counted per tier, and the log of their changes:
/// a key is reported in the fastest tier any vLLM block carrying it is in.
struct Held {
    keys: HashMap<u64, Key>,
    /// How many of `keys` are text-mode keys.
    text: usize,
    /// How many of `keys` are reported in each tier.
    by_tier: [usize; 3],
    log: ReportLog,
}

impl Held {
    /// One more vLLM block in `tier` carries `key`: stored with the first,
    /// moved when `tier` is faster than the key's.
    fn hold(&mut self, key: u64, parent: Option<u64>, text: bool, tier: Tier) {
        let held = self.keys.entry(key).or_insert(Key {
            parent,
            copies: Copies::default(),
            text,
        });
        let before = held.copies.best();
        held.copies.add(tier);
        let after = held.copies.best();
        if before.is_none() {
            self.text += usize::from(text);
        }
        self.moved(key, parent, before, after);
    }

    /// One more vLLM block in `tier` carries `key`, which is held already.
    fn hold_again(&mut self, key: u64, tier: Tier) {
        if let Some(held) = self.keys.get(&key) {
            self.hold(key, held.parent, held.text, tier);
        }
    }

    /// One vLLM block in `tier` fewer carries `key`: removed with the last,
    /// moved when that was its fastest copy.
    fn release(&mut self, key: u64, tier: Tier) {
        let Some(held) = self.keys.get_mut(&key) else {
            return;
        };
        if held.copies.in_tier(tier) == 0 {
            return;
        }
        let before = held.copies.best();
        held.copies.take(tier);
        let Key {
            parent,
            copies,
            text,
        } = *held;
        if copies.best().is_none() {
            self.keys.remove(&key);
            self.text -= usize::from(text);
        }
        self.moved(key, parent, before, copies.best());
    }

    /// Logs a key's tier going from `before` to `after` (`None`: not held).
    fn moved(&mut self, key: u64, parent: Option<u64>, before: Option<Tier>, after: Option<Tier>) {
        if before == after {
            return;
        }
        if let Some(tier) = before {
            self.by_tier[tier.index()] -= 1;
        }
        match after {
            Some(tier) => {
                self.by_tier[tier.index()] += 1;
                self.log.stored(key, parent, tier);
            }
            None => self.log.removed(key, parent),
        }
    }
}

/// Why blocks of an event were left out (of all keys, or of the text keys).
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
    /// Extra keys of a shape vLLM does not send today (logged), and the
    /// blocks after them in their event.
    pub unknown_extra_keys: u64,
    /// A `medium` none of GPU, CPU, disk or storage (logged).
    pub unknown_medium: u64,
    /// A copy named by hash only (no token ids: vLLM's offloading
    /// connector without self-describing events) of a block not keyed.
    pub unknown_hash: u64,
    /// No text keys: a token id not in the vocabulary, in the block or
    /// before it in its chain.
    pub unknown_token: u64,
    /// No text keys: wholly past the text layout's `maxPrefixBlocks`.
    pub text_past_cap: u64,
}

/// One block's vLLM `extra_keys`, as kvroute reads them. vLLM builds them
/// (`generate_block_hash_extra_keys`) in this order: the adapter's name
/// (older vLLM: its `lora_int_id`), an `(identifier, offset)` pair per
/// multimodal input in the block, on a chain's first block the
/// `cache_salt`, then prompt-embedding hashes (bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Extra {
    /// Only what kvroute seeds a chain with: the adapter, and on a chain's
    /// first block its salt.
    Seeds { salt: Option<String> },
    /// Keys the filter cannot hash: multimodal inputs, prompt embeddings.
    Unhashable,
    /// A shape vLLM does not send today (the typed form proposed upstream,
    /// a salt that is not a string, …): what is wrong, for the log.
    Unknown(String),
}

/// Reads one block's `extra_keys` (`first`: the block opens its chain, the
/// only place vLLM puts the salt).
fn read_extra(
    keys: Option<&Msgpack>,
    lora_name: Option<&str>,
    lora_id: Option<i64>,
    first: bool,
) -> Extra {
    let Some(keys) = keys else {
        return Extra::Seeds { salt: None };
    };
    let Some(mut keys) = keys.as_array().map(Vec::as_slice) else {
        return Extra::Unknown(format!("{keys} is not a tuple of keys"));
    };
    if let Some(adapter) = keys.first() {
        let named = lora_name.is_some() && adapter.as_str() == lora_name;
        let numbered = lora_id.is_some() && adapter.as_i64() == lora_id;
        if named || numbered {
            keys = &keys[1..];
        }
    }
    let mut salt = None;
    let mut unhashable = false;
    for key in keys {
        match key {
            Msgpack::Array(pair) if is_multimodal(pair) => unhashable = true,
            Msgpack::Binary(_) => unhashable = true,
            Msgpack::String(text) if first && salt.is_none() => match text.as_str() {
                Some(text) if !text.is_empty() => salt = Some(text.to_string()),
                _ => return Extra::Unknown(format!("cache_salt {key} is empty or not UTF-8")),
            },
            Msgpack::String(_) if !first => {
                return Extra::Unknown(format!(
                    "{key} in a block that opens no chain (vLLM salts only a chain's first)"
                ))
            }
            other => {
                return Extra::Unknown(format!(
                    "{other} is none of the adapter, a multimodal (identifier, offset), \
                     the cache_salt or prompt-embedding bytes"
                ))
            }
        }
    }
    if unhashable {
        Extra::Unhashable
    } else {
        Extra::Seeds { salt }
    }
}

/// A multimodal input's key: `(identifier, offset in the block)`.
fn is_multimodal(pair: &[Msgpack]) -> bool {
    matches!(pair, [id, offset] if id.as_slice().is_some() && offset.as_u64().is_some())
}

/// The tier of vLLM's `medium`, in any case: none (older vLLM) or `GPU`;
/// names holding `CPU` (vLLM's offloading connector, SGLang's `CPU_TIER1`
/// and `CPU_TIER2`, LMCache's CPU backend); names holding `DISK`, or
/// `STORAGE` (vLLM's storage tier). `None`: a medium none of these.
fn medium_tier(medium: Option<&str>) -> Option<Tier> {
    let Some(medium) = medium else {
        return Some(Tier::Gpu);
    };
    let medium = medium.to_ascii_lowercase();
    if medium == "gpu" {
        Some(Tier::Gpu)
    } else if medium.contains("cpu") {
        Some(Tier::Cpu)
    } else if medium.contains("disk") || medium == "storage" {
        Some(Tier::Disk)
    } else {
        None
    }
}

/// The pod's blocks, keyed by kvroute chain keys (see the module docs).
pub struct PodBlocks {
    hashing: Hashing,
    /// Chain seeds per adapter (`None`: the base model).
    seeds: HashMap<Option<String>, Seeds>,
    vllm: HashMap<u64, Mapped>,
    /// Of `vllm`, the blocks with a copy on the GPU: the pod's resident
    /// blocks as far as its events tell.
    gpu_blocks: usize,
    held: Held,
    /// One block's tokens decoded (kept to reuse its allocation).
    decoded: Vec<u8>,
    /// While rebuilding past a hole ([`PodBlocks::start_proof`]): the vLLM
    /// blocks later events prove present, and where.
    proven: Option<HashSet<(u64, Tier)>>,
    /// The latest event part refused for a shape vLLM does not send today.
    refusal: Option<String>,
    /// vLLM's `block_size` in the latest event left out for its size
    /// (`None`: its `token_ids` did not cover its blocks), to log.
    size_refusal: Option<usize>,
    pub skipped: Skipped,
}

impl PodBlocks {
    pub fn new(hashing: Hashing, max_log: usize) -> PodBlocks {
        PodBlocks {
            hashing,
            seeds: HashMap::new(),
            vllm: HashMap::new(),
            gpu_blocks: 0,
            held: Held {
                keys: HashMap::new(),
                text: 0,
                by_tier: [0; 3],
                log: ReportLog::new(max_log),
            },
            decoded: Vec::new(),
            proven: None,
            refusal: None,
            size_refusal: None,
            skipped: Skipped::default(),
        }
    }

    /// Blocks held (kvroute keys, both modes).
    pub fn len(&self) -> usize {
        self.held.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.keys.is_empty()
    }

    /// vLLM's blocks held with a copy in GPU memory (`residentBlocks`):
    /// blocks in use or cached for reuse, in vLLM's block size.
    pub fn resident_blocks(&self) -> usize {
        self.gpu_blocks
    }

    /// Text-mode keys held (of [`len`](Self::len)).
    pub fn text_len(&self) -> usize {
        self.held.text
    }

    /// Keys held per tier (the fastest each is in), indexed by
    /// [`Tier::index`].
    pub fn tier_len(&self) -> [usize; 3] {
        self.held.by_tier
    }

    /// Whether kvroute key `key` is held.
    pub fn contains(&self, key: u64) -> bool {
        self.held.keys.contains_key(&key)
    }

    pub fn seq(&self) -> u64 {
        self.held.log.seq()
    }

    fn chain_start(&mut self, adapter: Option<&str>, salt: Option<&str>) -> Chains {
        let hashing = &self.hashing;
        let seeds = self
            .seeds
            .entry(adapter.map(str::to_string))
            .or_insert_with(|| {
                let seed =
                    |mode| ChainSeed::new(&hashing.secret, &hashing.base_model, adapter, mode);
                Seeds {
                    tokens: seed(BlockMode::Tokens),
                    text: seed(BlockMode::Text),
                }
            });
        Chains {
            tokens: TokenChainCursor::new(&seeds.tokens.clone().salted(salt)),
            text: hashing
                .text
                .is_some()
                .then(|| TextChainCursor::new(&seeds.text.clone().salted(salt))),
        }
    }

    /// Continues `chain` with one vLLM block's `tokens` decoded; the text
    /// keys they complete, now held.
    fn push_text(
        &mut self,
        chain: &mut Option<TextChainCursor>,
        tokens: &[u32],
        tier: Tier,
    ) -> Vec<u64> {
        let Some(text) = &self.hashing.text else {
            return Vec::new();
        };
        let Some(cursor) = chain else {
            self.skipped.unknown_token += 1;
            return Vec::new();
        };
        self.decoded.clear();
        if text.vocabulary.decode(tokens, &mut self.decoded).is_err() {
            *chain = None;
            self.skipped.unknown_token += 1;
            return Vec::new();
        }
        let step = cursor.push(&self.decoded, &text.layout);
        if step.past_cap > 0 && step.past_cap == self.decoded.len() {
            self.skipped.text_past_cap += 1;
        }
        step.completed
            .into_iter()
            .map(|(key, parent)| {
                self.held.hold(key, parent, true, tier);
                key
            })
            .collect()
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
                medium,
                lora_name,
                extra_keys,
            } => {
                let blocks = block_hashes.len() as u64;
                let Some(tier) = medium_tier(medium.as_deref()) else {
                    self.skipped.unknown_medium += blocks;
                    self.refusal = Some(format!(
                        "block {:016x}: medium {medium:?} is none of GPU, CPU, disk, storage",
                        block_hashes.first().copied().unwrap_or_default()
                    ));
                    return;
                };
                self.prove(block_hashes, *parent_block_hash, tier);
                if token_ids.is_empty() {
                    // Named by hash only (vLLM's offloading connector
                    // without self-describing events): copies, in `tier`,
                    // of blocks stored before.
                    for &hash in block_hashes {
                        if !self.add_copy(hash, tier) {
                            self.skipped.unknown_hash += 1;
                        }
                    }
                    return;
                }
                if *block_size != self.hashing.layout.block_size
                    || token_ids.len() != block_hashes.len() * block_size
                {
                    self.skipped.wrong_size += blocks;
                    self.size_refusal =
                        (*block_size != self.hashing.layout.block_size).then_some(*block_size);
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
                let extra = |i: usize| {
                    if !extra_keys.is_empty() && extra_keys.len() != block_hashes.len() {
                        return Extra::Unknown(format!(
                            "{} extra_keys entries for {} blocks",
                            extra_keys.len(),
                            block_hashes.len()
                        ));
                    }
                    let first = i == 0 && parent_block_hash.is_none();
                    let keys = extra_keys.get(i).and_then(Option::as_ref);
                    read_extra(keys, lora_name.as_deref(), *lora_id, first)
                };
                let salt = match extra(0) {
                    Extra::Seeds { salt } => salt,
                    refused => {
                        self.refuse(refused, block_hashes[0], blocks);
                        return;
                    }
                };
                let mut chain = match parent_block_hash {
                    None => self.chain_start(adapter.as_deref(), salt.as_deref()),
                    Some(hash) => match self.vllm.get(hash) {
                        Some(parent) => parent.chain.clone(),
                        None => {
                            self.skipped.unknown_parent += blocks;
                            return;
                        }
                    },
                };
                let mut previous = *parent_block_hash;
                let vllm_blocks = block_hashes.iter().zip(token_ids.chunks_exact(*block_size));
                for (i, (&hash, tokens)) in vllm_blocks.enumerate() {
                    if i > 0 {
                        let refused = extra(i);
                        if refused != (Extra::Seeds { salt: None }) {
                            self.refuse(refused, hash, (block_hashes.len() - i) as u64);
                            break;
                        }
                    }
                    // A hash already keyed is the same content: one more
                    // copy (in another medium, or another group).
                    if self.add_copy(hash, tier) {
                        if let Some(mapped) = self.vllm.get(&hash) {
                            chain = mapped.chain.clone();
                        }
                        previous = Some(hash);
                        continue;
                    }
                    let key = match chain.tokens.push(tokens, &self.hashing.layout) {
                        ChainStep::Completed { key, parent } => {
                            self.held.hold(key, parent, false, tier);
                            Some(key)
                        }
                        ChainStep::Inside => None,
                        ChainStep::PastCap => {
                            self.skipped.past_cap += 1;
                            None
                        }
                    };
                    let text_keys = self.push_text(&mut chain.text, tokens, tier);
                    let mut copies = Copies::default();
                    copies.add(tier);
                    self.gpu_blocks += usize::from(tier == Tier::Gpu);
                    self.vllm.insert(
                        hash,
                        Mapped {
                            key,
                            text_keys,
                            chain: chain.clone(),
                            parent: previous,
                            copies,
                        },
                    );
                    previous = Some(hash);
                }
            }
            KvEvent::Removed {
                block_hashes,
                medium,
            } => {
                let Some(tier) = medium_tier(medium.as_deref()) else {
                    self.skipped.unknown_medium += block_hashes.len() as u64;
                    self.refusal = Some(format!(
                        "removal of block {:016x}: medium {medium:?} is none of GPU, CPU, disk, storage",
                        block_hashes.first().copied().unwrap_or_default()
                    ));
                    return;
                };
                for hash in block_hashes {
                    self.release(*hash, tier);
                }
            }
            KvEvent::AllCleared => self.clear(),
        }
    }

    /// Leaves out `blocks` stored blocks from `hash` on (the rest of its
    /// event: their chain continues it) for their extra keys.
    fn refuse(&mut self, extra: Extra, hash: u64, blocks: u64) {
        match extra {
            Extra::Unknown(why) => {
                self.skipped.unknown_extra_keys += blocks;
                self.refusal = Some(format!("block {hash:016x}: {why}"));
            }
            _ => self.skipped.extra_keys += blocks,
        }
    }

    /// The latest event part refused for a shape vLLM does not send today
    /// (extra keys, medium), and why: to log.
    pub fn refusal(&self) -> Option<&str> {
        self.refusal.as_deref()
    }

    /// vLLM's `block_size` in the latest event left out for its size, when
    /// that was the reason (not `token_ids` short of its blocks): to log.
    pub fn size_refusal(&self) -> Option<usize> {
        self.size_refusal
    }

    /// Blocks refused for a shape vLLM does not send today, so far.
    pub fn refused(&self) -> u64 {
        self.skipped.unknown_extra_keys + self.skipped.unknown_medium
    }

    /// One more copy, in `tier`, of the vLLM block `hash`, if it is keyed.
    /// Its keys are held while it is (its copies count in theirs).
    fn add_copy(&mut self, hash: u64, tier: Tier) -> bool {
        let Some(mapped) = self.vllm.get_mut(&hash) else {
            return false;
        };
        self.gpu_blocks += usize::from(tier == Tier::Gpu && mapped.copies.in_tier(tier) == 0);
        mapped.copies.add(tier);
        for &key in mapped.text_keys.iter().chain(&mapped.key) {
            self.held.hold_again(key, tier);
        }
        true
    }

    /// vLLM removed the copy in `tier` of block `hash`.
    fn release(&mut self, hash: u64, tier: Tier) {
        let Some(mapped) = self.vllm.get_mut(&hash) else {
            return;
        };
        if !mapped.copies.take(tier) {
            return;
        }
        self.gpu_blocks -= usize::from(tier == Tier::Gpu && mapped.copies.in_tier(tier) == 0);
        // Tail first, as vLLM frees a request's blocks.
        for &key in mapped.text_keys.iter().rev().chain(&mapped.key) {
            self.held.release(key, tier);
        }
        if mapped.copies.best().is_none() {
            self.vllm.remove(&hash);
        }
    }

    /// Rebuilding past a hole in vLLM's event history: the events in the
    /// lost batch are unknown, so a block stored before it may have been
    /// removed in it. From now until [`PodBlocks::end_proof`], each stored
    /// block proves itself present, and its chain's ancestors too (vLLM
    /// stores a block while the request holding it holds its whole prefix).
    pub fn start_proof(&mut self) {
        self.proven = Some(HashSet::new());
    }

    /// Ends [`PodBlocks::start_proof`]: every block held but not proven
    /// since is dropped (it may have gone in the hole). Returns how many.
    pub fn end_proof(&mut self) -> usize {
        let Some(proven) = self.proven.take() else {
            return 0;
        };
        let unproven: Vec<(u64, Tier, u32)> = self
            .vllm
            .iter()
            .flat_map(|(&hash, mapped)| {
                Tier::ALL
                    .into_iter()
                    .map(move |tier| (hash, tier, mapped.copies.in_tier(tier)))
            })
            .filter(|&(hash, tier, copies)| copies > 0 && !proven.contains(&(hash, tier)))
            .collect();
        for &(hash, tier, copies) in &unproven {
            for _ in 0..copies {
                self.release(hash, tier);
            }
        }
        unproven.len()
    }

    /// Marks a chain stored in `tier` proven there (while proving), and on
    /// the GPU its ancestors too: a copy in another medium proves only
    /// itself.
    fn prove(&mut self, hashes: &[u64], parent: Option<u64>, tier: Tier) {
        let Some(proven) = &mut self.proven else {
            return;
        };
        proven.extend(hashes.iter().map(|&hash| (hash, tier)));
        if tier != Tier::Gpu {
            return;
        }
        let mut ancestor = parent;
        // Each block is marked once: the walk stops at a proven one.
        while let Some(hash) = ancestor.filter(|hash| proven.insert((*hash, Tier::Gpu))) {
            ancestor = self.vllm.get(&hash).and_then(|m| m.parent);
        }
    }

    /// Drops every block (each logged as removed, so a router following
    /// this epoch's deltas drops them too).
    pub fn clear(&mut self) {
        for (key, held) in self.held.keys.drain() {
            self.held.log.removed(key, held.parent);
        }
        self.held.text = 0;
        self.held.by_tier = [0; 3];
        self.vllm.clear();
        self.gpu_blocks = 0;
    }

    /// Every block held, as parent-first chains.
    pub fn held(&self) -> Vec<StoredChain> {
        let nodes: Vec<(u64, Option<u64>, Tier)> = self
            .held
            .keys
            .iter()
            .map(|(&k, h)| (k, h.parent, h.copies.best().unwrap_or_default()))
            .collect();
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
        self.held
            .log
            .report_body(pod_id, epoch, since, asked_epoch, || self.held())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute::hashing::{hash_bytes, hash_tokens, BlockLayout};
    use kvroute::report::parse_report;

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
                text: None,
            },
            100,
        )
    }

    /// Text blocks of 8 bytes, coarse ones of 24 after 4, 7 at most: they
    /// end at bytes 8, 16, 24, 32, 56, 80 and 104.
    const TEXT_LAYOUT: BlockLayout = BlockLayout {
        block_size: 8,
        coarse_after: 4,
        coarse_factor: 3,
        max_blocks: 7,
    };

    /// With the byte-level fixture tokenizer (see `vocab`'s tests).
    fn text_blocks() -> PodBlocks {
        let json = include_bytes!("../tests/data/byte-level-bpe.tokenizer.json");
        let mut pod = blocks();
        pod.hashing.text = Some(TextHashing {
            layout: TEXT_LAYOUT,
            vocabulary: Arc::new(Vocabulary::from_json(json).expect("fixture loads")),
        });
        pod
    }

    /// A ChatML conversation's opening in the fixture's tokens, two a vLLM
    /// block (13 blocks), and the text they were tokenized from (125
    /// bytes): the blocks end at bytes 18, 22, 28, 46, 57, 70, 75, 79, 86,
    /// 91, 102, 115 and 125.
    const CHAT: [u32; 26] = [
        31, 2, 0, 5, 6, 7, 8, 9, 10, 32, 0, 31, 3, 0, 11, 12, 13, 14, 15, 17, 18, 32, 0, 31, 4, 0,
    ];
    const CHAT_TEXT: &str = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
                             <|im_start|>user\nCafé costs 5€?<|im_end|>\n<|im_start|>assistant\n";

    fn text_seed(adapter: Option<&str>, salt: Option<&str>) -> ChainSeed {
        ChainSeed::new("s", "m", adapter, BlockMode::Text).salted(salt)
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
        let extra_keys = extra_keys.into_iter().map(|k| k.map(Msgpack::Array));
        stored_raw(hashes, parent, tokens, lora, extra_keys.collect())
    }

    /// [`stored_with`] with each block's extra keys as sent.
    fn stored_raw(
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        lora: Option<&str>,
        extra_keys: Vec<Option<Msgpack>>,
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
    fn extra_keys_of_an_unknown_shape_refuse_their_block_only() {
        let mut pod = blocks();
        let seed = ChainSeed::new("s", "m", None, BlockMode::Tokens);
        let key = |tokens: &[u32]| *hash_tokens(&seed, tokens, &LAYOUT).last().expect("a key");
        let typed_salt = Msgpack::Map(vec![
            ("type".into(), "CacheSaltKey".into()),
            ("salt".into(), "tenant-a".into()),
        ]);
        let tuple = |keys: Vec<Msgpack>| Some(Msgpack::Array(keys));
        // (case, each block's extra keys, how many blocks it keys)
        type Case = (&'static str, Vec<Option<Msgpack>>, Option<u64>);
        let cases: Vec<Case> = vec![
            // The typed form proposed upstream, as a map or positional.
            (
                "typed map",
                vec![tuple(vec![typed_salt.clone()]), None],
                None,
            ),
            (
                "typed positional",
                vec![
                    tuple(vec![tuple(vec!["CacheSaltKey".into(), "t".into()]).unwrap()]),
                    None,
                ],
                None,
            ),
            ("not a tuple", vec![Some(typed_salt), None], None),
            ("salt not a string", vec![tuple(vec![7.into()]), None], None),
            ("empty salt", vec![tuple(vec!["".into()]), None], None),
            (
                "two salts",
                vec![tuple(vec!["a".into(), "b".into()]), None],
                None,
            ),
            ("too few entries", vec![None], None),
            // Past a chain's first block vLLM puts no salt.
            ("salt inside", vec![None, tuple(vec!["t".into()])], Some(1)),
        ];
        let mut refused = 0;
        for (i, (case, extra, kept)) in cases.into_iter().enumerate() {
            let hashes = [100 + 2 * i as u64, 101 + 2 * i as u64];
            pod.apply(&stored_raw(&hashes, None, &[1, 2, 3, 4], None, extra));
            refused += 2 - kept.unwrap_or(0);
            assert_eq!(pod.skipped.unknown_extra_keys, refused, "{case}");
            assert!(
                pod.refusal().is_some_and(
                    |why| why.contains(&format!("{:016x}", hashes[kept.unwrap_or(0) as usize]))
                ),
                "{case}: {:?}",
                pod.refusal()
            );
            // Never more than the blocks the case keeps.
            assert_eq!(pod.contains(key(&[1, 2])), kept.is_some(), "{case}");
            assert!(!pod.contains(key(&[1, 2, 3, 4])), "{case}");
        }
        assert!(pod.refusal().unwrap().contains("opens no chain"));
        // The next event, with known keys, applies.
        let salted = vec![Some(vec![Msgpack::from("tenant-a")]), None];
        pod.apply(&stored_with(&[90, 91], None, &[1, 2, 3, 4], None, salted));
        let salted_seed = seed.clone().salted(Some("tenant-a"));
        assert!(hash_tokens(&salted_seed, &[1, 2, 3, 4], &LAYOUT)
            .iter()
            .all(|k| pod.contains(*k)));
        assert_eq!(pod.skipped.extra_keys, 0, "none was multimodal");
    }

    /// vLLM's offloading connector publishes a copy named by hash only.
    fn copy(hashes: &[u64], medium: &str) -> KvEvent {
        KvEvent::Stored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 0,
            lora_id: None,
            medium: Some(medium.into()),
            lora_name: None,
            extra_keys: Vec::new(),
        }
    }

    fn removed_from(hashes: &[u64], medium: &str) -> KvEvent {
        KvEvent::Removed {
            block_hashes: hashes.to_vec(),
            medium: Some(medium.into()),
        }
    }

    /// The tier the pod's report gives each key (a full report).
    fn reported_tiers(pod: &PodBlocks) -> HashMap<u64, Tier> {
        let body = Value::Object(pod.report_body("p", "E", None, None)).to_string();
        let mut body: serde_json::Map<String, Value> = serde_json::from_str(&body).unwrap();
        body.insert("queueDepth".into(), 0.into());
        body.insert("health".into(), 1.into());
        let report = parse_report(Value::Object(body).to_string().as_bytes()).expect("valid");
        report
            .stored
            .iter()
            .flat_map(|c| c.hashes.iter().map(move |&h| (h, c.tier)))
            .collect()
    }

    #[test]
    fn blocks_are_tracked_per_medium_and_reported_in_their_fastest() {
        let mut pod = blocks();
        let seed = ChainSeed::new("s", "m", None, BlockMode::Tokens);
        let keys = hash_tokens(&seed, &[1, 2, 3, 4], &LAYOUT);
        pod.apply(&stored(&[10, 11], None, &[1, 2, 3, 4], None));
        let since = pod.seq();
        // Offloaded to CPU (named by hash) and to storage (self-describing,
        // with tokens): still reported on the GPU, nothing logged.
        pod.apply(&copy(&[10], "CPU"));
        pod.apply(&copy(&[11], "CPU"));
        let mut on_disk = stored(&[10, 11], None, &[1, 2, 3, 4], None);
        if let KvEvent::Stored { medium, .. } = &mut on_disk {
            *medium = Some("STORAGE".into());
        }
        pod.apply(&on_disk);
        assert_eq!(pod.seq(), since);
        assert_eq!(pod.tier_len(), [2, 0, 0]);
        assert_eq!(
            pod.resident_blocks(),
            2,
            "copies elsewhere are not resident"
        );
        // The GPU evicts the tail: its key moves to the CPU tier (a store
        // in the new tier), the head's stays.
        pod.apply(&removed_from(&[11], "GPU"));
        assert_eq!(pod.resident_blocks(), 1);
        let tiers = reported_tiers(&pod);
        assert_eq!((tiers[&keys[0]], tiers[&keys[1]]), (Tier::Gpu, Tier::Cpu));
        let delta = pod.held.log.delta(since).unwrap();
        assert_eq!(delta.stored.len(), 1);
        assert_eq!(
            (delta.stored[0].hashes[0], delta.stored[0].tier),
            (keys[1], Tier::Cpu)
        );
        // Then the CPU copy: on disk; then the disk copy: gone.
        pod.apply(&removed_from(&[11], "CPU"));
        assert_eq!(reported_tiers(&pod)[&keys[1]], Tier::Disk);
        pod.apply(&removed_from(&[11], "STORAGE"));
        assert!(!pod.contains(keys[1]) && pod.contains(keys[0]));
        assert_eq!(pod.tier_len(), [1, 0, 0]);
        // A removal from a medium holding no copy changes nothing; a copy of
        // a block never keyed is counted; an unknown medium is refused.
        pod.apply(&removed_from(&[10], "CPU"));
        pod.apply(&removed_from(&[10], "CPU"));
        assert!(pod.contains(keys[0]));
        pod.apply(&copy(&[99], "CPU"));
        assert_eq!(pod.skipped.unknown_hash, 1);
        pod.apply(&copy(&[10], "REMOTE"));
        pod.apply(&removed_from(&[10], "tape"));
        assert_eq!(pod.skipped.unknown_medium, 2);
        assert!(pod.refusal().unwrap().contains("\"tape\""));
        assert_eq!(reported_tiers(&pod)[&keys[0]], Tier::Gpu);
        // A block offloaded and then stored again on the GPU (a reload).
        pod.apply(&removed_from(&[10], "GPU"));
        assert_eq!(reported_tiers(&pod)[&keys[0]], Tier::Disk);
        assert_eq!(pod.resident_blocks(), 0);
        pod.apply(&stored(&[10], None, &[1, 2], None));
        assert_eq!(reported_tiers(&pod)[&keys[0]], Tier::Gpu);
        assert_eq!(pod.resident_blocks(), 1);
        // Media in other spellings: SGLang's CPU tiers, LMCache's backends.
        for (medium, tier) in [("CPU_TIER2", Tier::Cpu), ("LocalDiskBackend", Tier::Disk)] {
            pod.apply(&copy(&[10], medium));
            pod.apply(&removed_from(&[10], "GPU"));
            assert_eq!(reported_tiers(&pod)[&keys[0]], tier, "{medium}");
            pod.apply(&removed_from(&[10], medium));
            pod.apply(&stored(&[10], None, &[1, 2], None));
        }
        // AllBlocksCleared drops every medium.
        pod.apply(&copy(&[10], "CPU"));
        pod.apply(&KvEvent::AllCleared);
        assert!(pod.is_empty());
        assert_eq!(pod.tier_len(), [0, 0, 0]);
        assert_eq!(pod.resident_blocks(), 0);
    }

    #[test]
    fn past_a_hole_only_blocks_proven_present_stay() {
        let mut pod = blocks();
        let seed = ChainSeed::new("s", "m", None, BlockMode::Tokens);
        let key = |tokens: &[u32]| *hash_tokens(&seed, tokens, &LAYOUT).last().expect("a key");
        // Before the hole: three chains.
        pod.apply(&stored(&[10, 11], None, &[1, 2, 3, 4], None));
        pod.apply(&stored(&[20], None, &[5, 6], None));
        pod.apply(&stored(&[30], None, &[9, 9], None));
        pod.start_proof();
        // After it: a block continuing 11 proves 11 and 10; 30 is stored
        // again; nothing proves 20.
        pod.apply(&stored(&[12], Some(11), &[7, 8], None));
        pod.apply(&stored(&[30], None, &[9, 9], None));
        assert_eq!(pod.len(), 5);
        assert_eq!(pod.end_proof(), 1);
        assert!([&[1, 2][..], &[1, 2, 3, 4], &[1, 2, 3, 4, 7, 8], &[9, 9]]
            .iter()
            .all(|tokens| pod.contains(key(tokens))));
        assert!(!pod.contains(key(&[5, 6])));
        assert_eq!(pod.len(), 4);
        // Proof is over: removals and stores as usual (30 was stored twice).
        pod.apply(&KvEvent::Removed {
            block_hashes: vec![30],
            medium: None,
        });
        assert!(pod.contains(key(&[9, 9])));
        assert_eq!(pod.end_proof(), 0);
        // Per medium: a GPU block proves its GPU ancestors, not their CPU
        // copies, and a CPU copy proves only itself.
        pod.apply(&copy(&[10, 11, 30], "CPU"));
        pod.start_proof();
        pod.apply(&stored(&[13], Some(11), &[5, 5], None));
        pod.apply(&copy(&[30], "CPU"));
        assert_eq!(
            pod.end_proof(),
            4,
            "12 and 30 on the GPU, 10 and 11 on the CPU"
        );
        assert!(!pod.contains(key(&[1, 2, 3, 4, 7, 8])));
        assert!(pod.contains(key(&[1, 2, 3, 4, 5, 5])));
        let tiers = reported_tiers(&pod);
        assert_eq!(tiers[&key(&[1, 2, 3, 4])], Tier::Gpu);
        assert_eq!(tiers[&key(&[9, 9])], Tier::Cpu);
        pod.apply(&removed_from(&[11], "GPU"));
        assert!(!pod.contains(key(&[1, 2, 3, 4])), "no CPU copy left");
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
                ..Skipped::default()
            }
        );
        pod.apply(&stored(&[10], None, &[1, 2], None));
        pod.apply(&KvEvent::AllCleared);
        assert!(pod.is_empty());
        // 5 stored and 5 removed, then one stored and cleared.
        assert_eq!(pod.seq(), 12);
    }

    #[test]
    fn text_keys_are_the_filters_text_chain_of_the_decoded_tokens() {
        let mut pod = text_blocks();
        let filter = hash_bytes(&text_seed(None, None), CHAT_TEXT.as_bytes(), &TEXT_LAYOUT);
        assert_eq!(filter.len(), 7);
        // One block at a time: a block completes the text blocks whose last
        // byte it holds (two, none, one; coarse ones past byte 32), until
        // the cap at byte 104.
        let mut text_held = Vec::new();
        for (i, tokens) in CHAT.chunks_exact(2).enumerate() {
            let parent = i.checked_sub(1).map(|p| 100 + p as u64);
            pod.apply(&stored(&[100 + i as u64], parent, tokens, None));
            text_held.push(pod.text_len());
        }
        assert_eq!(text_held, [2, 2, 3, 4, 5, 5, 5, 5, 6, 6, 6, 7, 7]);
        assert!(filter.iter().all(|key| pod.contains(*key)));
        let text_chain = StoredChain {
            parent: None,
            hashes: filter.clone(),
            tier: Tier::Gpu,
        };
        assert!(pod.held().contains(&text_chain), "each with its parent");
        // In addition to the token keys, which are as without a tokenizer.
        let tokens = hash_tokens(
            &ChainSeed::new("s", "m", None, BlockMode::Tokens),
            &CHAT,
            &LAYOUT,
        );
        assert!(tokens.iter().all(|key| pod.contains(*key)));
        assert_eq!(pod.len(), tokens.len() + filter.len());
        assert_eq!(
            pod.skipped.text_past_cap, 1,
            "the last block, from byte 115"
        );
        assert_eq!(pod.skipped.past_cap, 6, "token keys: 3 + 2 × 2 vLLM blocks");
        // Removed tail first, a block takes the text keys it completed.
        let mut text_held = Vec::new();
        for i in (0..13).rev() {
            pod.apply(&KvEvent::Removed {
                block_hashes: vec![100 + i],
                medium: None,
            });
            text_held.push(pod.text_len());
            if i == 4 {
                assert!(!pod.contains(filter[4]) && pod.contains(filter[3]));
            }
        }
        assert_eq!(text_held, [7, 6, 6, 6, 5, 5, 5, 5, 4, 3, 2, 2, 0]);
        assert!(pod.is_empty());
    }

    #[test]
    fn branches_continue_their_parents_text_chain() {
        let mut pod = text_blocks();
        // One request stores the system turn (5 blocks), a second one
        // continues it with its user turn, a third with another.
        pod.apply(&stored(&[10, 11, 12, 13, 14], None, &CHAT[..10], None));
        pod.apply(&stored(&[15, 16, 17], Some(14), &CHAT[10..16], None));
        // "\n<|im_start|>user\n\t\n\n  " (tokens 0 31 3 0 19 22 25 1)
        pod.apply(&stored(
            &[25, 26, 27, 28],
            Some(14),
            &[0, 31, 3, 0, 19, 22, 25, 1],
            None,
        ));
        let seed = text_seed(None, None);
        let first = hash_bytes(&seed, &CHAT_TEXT.as_bytes()[..79], &TEXT_LAYOUT);
        let other = [
            &CHAT_TEXT.as_bytes()[..57],
            "\n<|im_start|>user\n\t\n\n   ".as_bytes(),
        ]
        .concat();
        let other = hash_bytes(&seed, &other, &TEXT_LAYOUT);
        assert_eq!((first.len(), other.len()), (5, 6));
        assert_eq!(first[..5], other[..5]);
        assert!(first.iter().chain(&other).all(|key| pod.contains(*key)));
        assert_eq!(pod.text_len(), 6);
    }

    #[test]
    fn adapters_and_salts_seed_the_text_chain_as_the_filter_does() {
        let mut pod = text_blocks();
        let keys = |strings: &[&str]| Some(strings.iter().map(|&k| Msgpack::from(k)).collect());
        let salted = vec![keys(&["a", "tenant-a"]), keys(&["a"])];
        pod.apply(&stored_with(&[10, 11], None, &CHAT[..4], Some("a"), salted));
        pod.apply(&stored(&[20, 21], None, &CHAT[..4], None));
        pod.apply(&stored(&[30], None, &CHAT[..2], Some("a")));
        // "<|im_start|>system\nYou" (22 bytes): two text blocks each.
        let text = &CHAT_TEXT.as_bytes()[..22];
        for seed in [
            text_seed(Some("a"), Some("tenant-a")),
            text_seed(None, None),
            text_seed(Some("a"), None),
        ] {
            let chain = hash_bytes(&seed, text, &TEXT_LAYOUT);
            assert!(chain.iter().all(|key| pod.contains(*key)));
        }
        assert_eq!(pod.text_len(), 6);
    }

    #[test]
    fn a_text_key_stays_while_any_vllm_block_holds_it() {
        let mut pod = text_blocks();
        // "€" and spaces tokenized two ways ("âĤ" "¬" "Ġ" …, "âĤ¬" "ĠĠ"
        // "ĠĠ" "Ġ"): the first text block, "€" and 5 spaces, ends in the
        // last vLLM block of each.
        pod.apply(&stored(
            &[10, 11, 12, 13],
            None,
            &[20, 21, 1, 1, 1, 1, 1, 1],
            None,
        ));
        pod.apply(&stored(&[20, 21], None, &[17, 25, 25, 1], None));
        let key = hash_bytes(&text_seed(None, None), "€     ".as_bytes(), &TEXT_LAYOUT)[0];
        assert!(pod.contains(key));
        assert_eq!(pod.text_len(), 1);
        pod.apply(&KvEvent::Removed {
            block_hashes: vec![13, 12, 11, 10],
            medium: None,
        });
        assert!(pod.contains(key));
        pod.apply(&KvEvent::Removed {
            block_hashes: vec![21, 20],
            medium: None,
        });
        assert!(pod.is_empty() && pod.text_len() == 0);
    }

    #[test]
    fn an_unknown_token_leaves_its_block_and_later_ones_without_text_keys() {
        let mut pod = text_blocks();
        // "<|im_start|>system" completes two text blocks; id 27 is a gap
        // in the vocabulary.
        pod.apply(&stored(&[10, 11], None, &[31, 2, 27, 5], None));
        pod.apply(&stored(&[12], Some(11), &[6, 7], None));
        let seed = text_seed(None, None);
        let text = hash_bytes(&seed, &CHAT_TEXT.as_bytes()[..18], &TEXT_LAYOUT);
        assert!(text.iter().all(|key| pod.contains(*key)));
        assert_eq!(pod.text_len(), 2);
        assert_eq!(pod.skipped.unknown_token, 2);
        // The token keys are all there.
        let tokens = ChainSeed::new("s", "m", None, BlockMode::Tokens);
        let tokens = hash_tokens(&tokens, &[31, 2, 27, 5, 6, 7], &LAYOUT);
        assert!(tokens.iter().all(|key| pod.contains(*key)));
        assert_eq!(pod.len(), 5);
        pod.apply(&KvEvent::AllCleared);
        assert_eq!((pod.len(), pod.text_len()), (0, 0));
    }
}
