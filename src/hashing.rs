//! Chained block hashing of prompts.
//!
//! A prompt is cut into blocks of its canonical text (text mode, sizes in
//! bytes) or of its token IDs, each as 4 little-endian bytes (token mode,
//! sizes in tokens). Block `i`'s identifier is
//!
//! ```text
//! h[0] = xxh64(block[0], seed)        seed = xxh64("kvroute/v1" 0 mode 0 hashSeed 0 baseModel 0 adapter, 0)
//! h[i] = xxh64(block[i], h[i-1])
//! ```
//!
//! so each hash covers the block's whole prefix, and two models (or a base
//! model and one of its LoRA adapters) never share a block.
//!
//! **Block layout** ([`BlockLayout`]): the first `coarseAfterBlocks` blocks
//! are `blockSize` long (64 bytes or 16 tokens: vLLM's block), later ones
//! `blockSize × coarseBlockFactor` (1 KiB or 256 tokens by default):
//!
//! ```text
//! |64|64|64| … 256 fine blocks (16 KiB) … |  1 KiB  |  1 KiB  | … up to maxPrefixBlocks
//! ```
//!
//! Short prompts, and the system prompts and tool definitions that open long
//! ones, are matched block by block; past 16 KiB a match is resolved to
//! 1 KiB, at most 1/16 of what it already covers. That keeps a 128k-token
//! prompt at ~750 blocks instead of 8,192, and so its lookups, its pending
//! decision and the pods' reports 11× smaller. The defaults (2,048 blocks)
//! cover 1.77 MiB of text (~460k tokens) or 462,848 tokens. A trailing
//! partial block is not hashed (an engine cannot reuse it either).
//! Hashing is O(min(len, covered(maxPrefixBlocks))) bytes.
//!
//! The vLLM bridge rebuilds the same chains from a pod's engine blocks, one
//! at a time: [`TokenChainCursor`] from their tokens, [`TextChainCursor`]
//! from their tokens decoded to bytes.

use xxhash_rust::xxh64::{xxh64, Xxh64};

use crate::config::{Config, ModelTarget};
use crate::request::Prompt;

/// What the chain is seeded with: everything that must match for two pods'
/// KV blocks to be interchangeable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainSeed(u64);

/// The two block modes, domain-separated in the seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockMode {
    Text,
    Tokens,
}

impl ChainSeed {
    pub fn new(
        secret: &str,
        base_model: &str,
        adapter: Option<&str>,
        mode: BlockMode,
    ) -> ChainSeed {
        let mode = match mode {
            BlockMode::Text => "text",
            BlockMode::Tokens => "tokens",
        };
        let mut material = Vec::with_capacity(32 + secret.len() + base_model.len());
        for part in [
            "kvroute/v1",
            mode,
            secret,
            base_model,
            adapter.unwrap_or(""),
        ] {
            material.extend_from_slice(part.as_bytes());
            material.push(0);
        }
        ChainSeed(xxh64(&material, 0))
    }

    /// The seed of requests carrying vLLM's `cache_salt` `salt` (`None`:
    /// this seed): vLLM never shares a salted block with another salt's.
    pub fn salted(self, salt: Option<&str>) -> ChainSeed {
        match salt {
            Some(salt) => ChainSeed(xxh64(&[b"cache_salt\0", salt.as_bytes()].concat(), self.0)),
            None => self,
        }
    }

    pub fn value(&self) -> u64 {
        self.0
    }
}

/// Where a prompt's blocks end, in the prompt's units (bytes or tokens):
/// see the module documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLayout {
    pub block_size: usize,
    pub coarse_after: usize,
    pub coarse_factor: usize,
    pub max_blocks: usize,
}

impl BlockLayout {
    /// The configured layout of text prompts (sizes in bytes).
    pub fn text(config: &Config) -> BlockLayout {
        BlockLayout::configured(config, config.block_size_bytes)
    }

    /// The configured layout of token-ID prompts (sizes in tokens).
    pub fn tokens(config: &Config) -> BlockLayout {
        BlockLayout::configured(config, config.block_size_tokens)
    }

    fn configured(config: &Config, block_size: usize) -> BlockLayout {
        BlockLayout {
            block_size,
            coarse_after: config.coarse_after_blocks,
            coarse_factor: config.coarse_block_factor,
            max_blocks: config.max_prefix_blocks,
        }
    }

    fn coarse_size(&self) -> usize {
        self.block_size.saturating_mul(self.coarse_factor)
    }

    /// Units covered by the first `blocks` blocks.
    pub fn covered(&self, blocks: usize) -> u64 {
        let fine = blocks.min(self.coarse_after);
        let coarse = blocks - fine;
        (fine as u64).saturating_mul(self.block_size as u64)
            + (coarse as u64).saturating_mul(self.coarse_size() as u64)
    }

    /// The same layout without its cap: what a pod caches (every full block
    /// of the prompt, as vLLM does), of which the router sees the first
    /// `max_blocks`.
    pub fn uncapped(&self) -> BlockLayout {
        BlockLayout {
            max_blocks: usize::MAX,
            ..*self
        }
    }

    /// The prompt's whole blocks, in order, at most `max_blocks`.
    pub fn blocks<'a, T>(&self, units: &'a [T]) -> impl Iterator<Item = &'a [T]> + 'a {
        let split = units
            .len()
            .min(self.coarse_after.saturating_mul(self.block_size));
        let (fine, coarse) = units.split_at(split);
        fine.chunks_exact(self.block_size.max(1))
            .chain(coarse.chunks_exact(self.coarse_size().max(1)))
            .take(self.max_blocks)
    }
}

/// Hashes the whole blocks of `bytes` laid out by `layout`.
pub fn hash_bytes(seed: &ChainSeed, bytes: &[u8], layout: &BlockLayout) -> Vec<u64> {
    let mut previous = seed.0;
    layout
        .blocks(bytes)
        .map(|block| {
            previous = xxh64(block, previous);
            previous
        })
        .collect()
}

/// Hashes the whole blocks of `tokens` laid out by `layout`.
pub fn hash_tokens(seed: &ChainSeed, tokens: &[u32], layout: &BlockLayout) -> Vec<u64> {
    chain_token_blocks(seed.0, layout.blocks(tokens))
}

/// The streamed end of a chain, shared by the cursors below: the last
/// completed block's hash and the block being hashed after it.
#[derive(Clone)]
struct ChainLink {
    /// The last completed block's hash (the seed's value before the first).
    previous: u64,
    /// Whether any block was completed yet (`previous` is not the seed).
    started: bool,
    /// The block being streamed, seeded with `previous`.
    partial: Xxh64,
}

impl ChainLink {
    fn new(seed: &ChainSeed) -> ChainLink {
        ChainLink {
            previous: seed.0,
            started: false,
            partial: Xxh64::new(seed.0),
        }
    }

    fn update(&mut self, bytes: &[u8]) {
        self.partial.update(bytes);
    }

    /// Ends the block streamed so far: its hash and its parent's.
    fn complete(&mut self) -> (u64, Option<u64>) {
        let key = self.partial.digest();
        let parent = self.started.then_some(self.previous);
        self.previous = key;
        self.started = true;
        self.partial = Xxh64::new(key);
        (key, parent)
    }
}

/// A token chain fed one engine block (`layout.block_size` tokens) at a
/// time, as the vLLM bridge learns a pod's blocks from its events: each
/// engine block of the fine part completes one of the layout's blocks;
/// past it, every `coarse_factor`-th completes a coarse block, whose
/// hash is streamed over the engine blocks in between. So the keys are
/// exactly [`hash_tokens`]'s for the same tokens. Cloned to branch: a
/// cursor is what a block's children continue from.
#[derive(Clone)]
pub struct TokenChainCursor {
    link: ChainLink,
    /// Engine blocks fed so far.
    engine_blocks: usize,
}

/// What one engine block did to a [`TokenChainCursor`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainStep {
    /// It completed the layout's block with this hash, whose parent (in the
    /// chain, `None` for the first) is `parent`.
    Completed { key: u64, parent: Option<u64> },
    /// It lies inside a coarse block still incomplete.
    Inside,
    /// It lies past `max_blocks`, where the router does not look.
    PastCap,
}

impl TokenChainCursor {
    pub fn new(seed: &ChainSeed) -> TokenChainCursor {
        TokenChainCursor {
            link: ChainLink::new(seed),
            engine_blocks: 0,
        }
    }

    /// Feeds the next engine block's tokens (`layout.block_size` of them).
    pub fn push(&mut self, tokens: &[u32], layout: &BlockLayout) -> ChainStep {
        let depth = self.engine_blocks;
        self.engine_blocks += 1;
        let coarse_factor = layout.coarse_factor.max(1);
        let (block, last_part) = if depth < layout.coarse_after {
            (depth, true)
        } else {
            let past = depth - layout.coarse_after;
            (
                layout.coarse_after + past / coarse_factor,
                past % coarse_factor == coarse_factor - 1,
            )
        };
        if block >= layout.max_blocks {
            return ChainStep::PastCap;
        }
        for token in tokens {
            self.link.update(&token.to_le_bytes());
        }
        if !last_part {
            return ChainStep::Inside;
        }
        let (key, parent) = self.link.complete();
        ChainStep::Completed { key, parent }
    }
}

/// A text chain fed the bytes of one engine block at a time, as the vLLM
/// bridge decodes a pod's token blocks: engine blocks do not fall on the
/// layout's byte boundaries, so one may complete none, one or several of
/// the layout's blocks (fine ones of `block_size` bytes, coarse ones past
/// `coarse_after`), each streamed over whatever engine blocks it spans.
/// The keys are exactly [`hash_bytes`]'s for the concatenated bytes. A
/// cursor keeps no text, only the streaming hash and two counters; it is
/// cloned to branch as [`TokenChainCursor`] is.
#[derive(Clone)]
pub struct TextChainCursor {
    link: ChainLink,
    /// The layout's blocks completed so far.
    blocks: usize,
    /// Bytes of the block being streamed fed so far.
    filled: usize,
}

/// What one engine block's bytes did to a [`TextChainCursor`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextStep {
    /// The blocks they completed, in order, as `(key, parent)` (`parent`:
    /// `None` for the chain's first block).
    pub completed: Vec<(u64, Option<u64>)>,
    /// How many of the bytes (the last ones) lie past `max_blocks`, where
    /// the router does not look.
    pub past_cap: usize,
}

impl TextChainCursor {
    pub fn new(seed: &ChainSeed) -> TextChainCursor {
        TextChainCursor {
            link: ChainLink::new(seed),
            blocks: 0,
            filled: 0,
        }
    }

    /// Feeds the next engine block's bytes (any number of them).
    pub fn push(&mut self, mut bytes: &[u8], layout: &BlockLayout) -> TextStep {
        let mut completed = Vec::new();
        while !bytes.is_empty() && self.blocks < layout.max_blocks {
            let size = if self.blocks < layout.coarse_after {
                layout.block_size
            } else {
                layout.coarse_size()
            }
            .max(1);
            let (part, rest) = bytes.split_at((size - self.filled).min(bytes.len()));
            self.link.update(part);
            self.filled += part.len();
            bytes = rest;
            if self.filled == size {
                completed.push(self.link.complete());
                self.blocks += 1;
                self.filled = 0;
            }
        }
        TextStep {
            completed,
            past_cap: bytes.len(),
        }
    }
}

/// Chains `blocks` of token IDs, each as 4 little-endian bytes a token.
fn chain_token_blocks<'a>(mut previous: u64, blocks: impl Iterator<Item = &'a [u32]>) -> Vec<u64> {
    let mut block_bytes = Vec::new();
    blocks
        .map(|block| {
            block_bytes.clear();
            for token in block {
                block_bytes.extend_from_slice(&token.to_le_bytes());
            }
            previous = xxh64(&block_bytes, previous);
            previous
        })
        .collect()
}

/// Hashes prompts the way one configuration says: block layouts and
/// secret. The simulated pods build the same hasher from the same config.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    secret: String,
    text: BlockLayout,
    tokens: BlockLayout,
}

impl BlockHasher {
    pub fn from_config(config: &Config) -> BlockHasher {
        BlockHasher {
            secret: config.hash_seed.clone(),
            text: BlockLayout::text(config),
            tokens: BlockLayout::tokens(config),
        }
    }

    /// The same hasher without the router's cap: what a pod caches. Its
    /// chains start with the capped ones.
    pub fn uncapped(&self) -> BlockHasher {
        BlockHasher {
            secret: self.secret.clone(),
            text: self.text.uncapped(),
            tokens: self.tokens.uncapped(),
        }
    }

    /// The layout of `prompt`'s kind.
    pub fn layout(&self, prompt: &Prompt) -> &BlockLayout {
        match prompt {
            Prompt::Text(_) => &self.text,
            Prompt::Tokens(_) => &self.tokens,
        }
    }

    /// The block chain of `prompt` for a request that needs `target`, with
    /// vLLM's `cache_salt` `salt`.
    pub fn chain(&self, target: &ModelTarget, prompt: &Prompt, salt: Option<&str>) -> Vec<u64> {
        let adapter = target.adapter.as_deref();
        let seed =
            |mode| ChainSeed::new(&self.secret, &target.base_model, adapter, mode).salted(salt);
        match prompt {
            Prompt::Text(bytes) => hash_bytes(&seed(BlockMode::Text), bytes, &self.text),
            Prompt::Tokens(tokens) => hash_tokens(&seed(BlockMode::Tokens), tokens, &self.tokens),
        }
    }

    /// How much of `prompt` its first blocks cover.
    pub fn coverage(&self, prompt: &Prompt) -> Coverage {
        Coverage {
            layout: *self.layout(prompt),
            prompt_units: prompt.len() as u64,
            units_per_token: match prompt {
                Prompt::Text(_) => BYTES_PER_TOKEN as u64,
                Prompt::Tokens(_) => 1,
            },
        }
    }
}

/// How much of one prompt a matched chain prefix covers: the true share of
/// the whole prompt (partial tail and unhashed rest included) and its
/// tokens, counting a text token as [`BYTES_PER_TOKEN`] bytes (the
/// simulator's tokenizer, and the estimate for predictions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coverage {
    layout: BlockLayout,
    prompt_units: u64,
    units_per_token: u64,
}

impl Coverage {
    /// A prompt routed by load alone: nothing to cover.
    pub const NONE: Coverage = Coverage {
        layout: BlockLayout {
            block_size: 1,
            coarse_after: 0,
            coarse_factor: 1,
            max_blocks: 0,
        },
        prompt_units: 0,
        units_per_token: 1,
    };

    /// Share of the whole prompt the first `blocks` blocks cover.
    pub fn fraction(&self, blocks: u32) -> f64 {
        if self.prompt_units == 0 {
            return 0.0;
        }
        self.units(blocks) as f64 / self.prompt_units as f64
    }

    /// Prompt tokens the first `blocks` blocks cover.
    pub fn tokens(&self, blocks: u32) -> u64 {
        self.units(blocks) / self.units_per_token.max(1)
    }

    /// Tokens of the whole prompt.
    pub fn prompt_tokens(&self) -> u64 {
        self.prompt_units / self.units_per_token.max(1)
    }

    fn units(&self, blocks: u32) -> u64 {
        self.layout.covered(blocks as usize).min(self.prompt_units)
    }
}

/// Bytes per token of the simulated tokenizer (and the estimate used for
/// text-mode predictions).
pub const BYTES_PER_TOKEN: usize = 4;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Blocks of `size` all the way, at most `max`.
    fn uniform(size: usize, max: usize) -> BlockLayout {
        BlockLayout {
            block_size: size,
            coarse_after: usize::MAX,
            coarse_factor: 1,
            max_blocks: max,
        }
    }

    /// Fixed vectors, computed independently with the reference xxHash
    /// (python-xxhash): the same values must come out on the host and in
    /// wasm32 (this module's tests run under both).
    #[test]
    fn chain_matches_fixed_vectors() {
        let seed = ChainSeed::new("", "llama-3-8b", None, BlockMode::Text);
        assert_eq!(
            seed.value(),
            0x89c6_3dfd_0f7e_614a,
            "seed {:#x}",
            seed.value()
        );
        let chain = hash_bytes(
            &seed,
            b"abcdefghijklmnopqrstuvwxyz0123456789",
            &uniform(8, 256),
        );
        let expected = [
            0x85a5_244b_becd_b716,
            0xe1ad_c143_6704_99be,
            0xdec5_53a4_bf59_1a03,
            0x3b29_4c94_3db1_d1f1,
        ];
        assert_eq!(chain, expected, "{:#x?}", chain);
        let tokens = hash_tokens(
            &ChainSeed::new("", "m", None, BlockMode::Tokens),
            &[1, 2, 3, 4, 5],
            &uniform(2, 256),
        );
        assert_eq!(
            tokens,
            [0x3e83_7cb0_bde9_5b87, 0x8cf3_10b2_9895_e0fd],
            "{:#x?}",
            tokens
        );
    }

    #[test]
    fn each_block_covers_its_prefix() {
        let seed = ChainSeed::new("", "m", None, BlockMode::Text);
        let a = hash_bytes(&seed, b"AAAABBBBCCCC", &uniform(4, 256));
        let b = hash_bytes(&seed, b"XAAABBBBCCCC", &uniform(4, 256));
        assert!(
            a.iter().zip(&b).all(|(x, y)| x != y),
            "a change in block 0 changes every later hash"
        );
        let c = hash_bytes(&seed, b"AAAABBBBDDDD", &uniform(4, 256));
        assert_eq!(a[..2], c[..2]);
        assert_ne!(a[2], c[2]);
    }

    #[test]
    fn partial_blocks_and_cap() {
        let seed = ChainSeed::new("", "m", None, BlockMode::Text);
        assert_eq!(hash_bytes(&seed, b"abc", &uniform(4, 256)).len(), 0);
        assert_eq!(hash_bytes(&seed, b"abcdefg", &uniform(4, 256)).len(), 1);
        assert_eq!(hash_bytes(&seed, &[7u8; 4000], &uniform(4, 256)).len(), 256);
        assert_eq!(hash_tokens(&seed, &[1; 33], &uniform(16, 256)).len(), 2);
    }

    #[test]
    fn coarse_blocks_follow_the_fine_ones() {
        let seed = ChainSeed::new("", "m", None, BlockMode::Text);
        let layout = BlockLayout {
            block_size: 4,
            coarse_after: 2,
            coarse_factor: 3,
            max_blocks: 4,
        };
        // 8 fine bytes, then 12-byte blocks; the 6-byte tail is not hashed.
        let bytes = b"aaaabbbbccccccccccccddddddddddddeeeeee";
        let chain = hash_bytes(&seed, bytes, &layout);
        let mut expected = Vec::new();
        let mut previous = seed.value();
        for block in [&bytes[..4], &bytes[4..8], &bytes[8..20], &bytes[20..32]] {
            previous = xxh64(block, previous);
            expected.push(previous);
        }
        assert_eq!(chain, expected);
        assert_eq!(
            [0, 1, 2, 3, 4].map(|n| layout.covered(n)),
            [0, 4, 8, 20, 32]
        );
        // The router's capped chain is where the pod's whole chain starts.
        let longer = [&bytes[..], &[b'f'; 30][..]].concat();
        let whole = hash_bytes(&seed, &longer, &layout.uncapped());
        assert_eq!(whole.len(), 7);
        assert_eq!(whole[..4], hash_bytes(&seed, &longer, &layout)[..]);
    }

    #[test]
    fn a_cursor_fed_engine_blocks_yields_the_token_chain() {
        let seed = ChainSeed::new("", "m", None, BlockMode::Tokens);
        let layout = BlockLayout {
            block_size: 2,
            coarse_after: 2,
            coarse_factor: 3,
            max_blocks: 4,
        };
        // 2 fine blocks, 2 coarse ones of 3 engine blocks, then past the cap.
        let tokens: Vec<u32> = (0..22).collect();
        let mut cursor = TokenChainCursor::new(&seed);
        let steps: Vec<ChainStep> = tokens
            .chunks_exact(2)
            .map(|engine_block| cursor.push(engine_block, &layout))
            .collect();
        let chain = hash_tokens(&seed, &tokens, &layout);
        assert_eq!(chain.len(), 4);
        let completed = |i: usize| ChainStep::Completed {
            key: chain[i],
            parent: i.checked_sub(1).map(|p| chain[p]),
        };
        use ChainStep::{Inside, PastCap};
        assert_eq!(
            steps,
            [
                completed(0),
                completed(1),
                Inside,
                Inside,
                completed(2),
                Inside,
                Inside,
                completed(3),
                PastCap,
                PastCap,
                PastCap
            ]
        );
        // A clone branches: both continue from the same block.
        let mut branch = TokenChainCursor::new(&seed);
        branch.push(&[0, 1], &layout);
        let mut other = branch.clone();
        assert_eq!(branch.push(&[2, 3], &layout), completed(1));
        assert_ne!(other.push(&[9, 9], &layout), completed(1));
    }

    #[test]
    fn a_text_cursor_completes_the_blocks_its_bytes_reach() {
        let seed = ChainSeed::new("", "m", None, BlockMode::Text);
        let layout = BlockLayout {
            block_size: 4,
            coarse_after: 2,
            coarse_factor: 3,
            max_blocks: 4,
        };
        // Blocks end at bytes 4, 8, 20 and 32; the cap leaves 5 bytes out.
        let bytes: Vec<u8> = (0..37).collect();
        let chain = hash_bytes(&seed, &bytes, &layout);
        let completed = |range: std::ops::Range<usize>| -> Vec<(u64, Option<u64>)> {
            range
                .map(|i| (chain[i], i.checked_sub(1).map(|p| chain[p])))
                .collect()
        };
        let mut cursor = TextChainCursor::new(&seed);
        let mut push = |from: usize, to: usize| cursor.push(&bytes[from..to], &layout);
        let step = |range, past_cap| TextStep {
            completed: completed(range),
            past_cap,
        };
        assert_eq!(push(0, 3), step(0..0, 0), "inside the first block");
        assert_eq!(push(3, 9), step(0..2, 0), "two blocks end in one");
        assert_eq!(push(9, 9), step(2..2, 0), "no bytes");
        assert_eq!(push(9, 20), step(2..3, 0), "a coarse block ends");
        assert_eq!(push(20, 34), step(3..4, 2), "the last block, then the cap");
        assert_eq!(push(34, 37), step(4..4, 3), "wholly past the cap");
        // A clone branches: both continue from the same point.
        let mut branch = TextChainCursor::new(&seed);
        branch.push(&bytes[..6], &layout);
        let mut other = branch.clone();
        assert_eq!(branch.push(&bytes[6..8], &layout), step(1..2, 0));
        assert_ne!(other.push(b"xy", &layout), step(1..2, 0));
    }

    #[test]
    fn the_defaults_match_a_128k_token_prompt_end_to_end() {
        let hasher = BlockHasher::from_config(&Config::default());
        let target = ModelTarget {
            base_model: "m".into(),
            adapter: None,
        };
        let prompt = Prompt::Text(vec![b'x'; 512 * 1024]);
        let chain = hasher.chain(&target, &prompt, None);
        assert_eq!(chain.len(), 256 + 496, "16 KiB fine, then 1 KiB blocks");
        let coverage = hasher.coverage(&prompt);
        assert_eq!(coverage.fraction(chain.len() as u32), 1.0);
        assert_eq!(coverage.tokens(chain.len() as u32), 131_072);
        assert_eq!(coverage.tokens(256), 4096);
        // The share counts the whole prompt, the unhashed tail included.
        let short = Prompt::Text(vec![b'x'; 100]);
        assert_eq!(hasher.coverage(&short).fraction(1), 0.64);
        let tokens = Prompt::Tokens(vec![7; 300_000]);
        assert_eq!(hasher.chain(&target, &tokens, None).len(), 256 + 1155);
        assert_eq!(Coverage::NONE.fraction(3), 0.0);
    }

    #[test]
    fn seed_separates_models_adapters_secrets_and_modes() {
        let seeds = [
            ChainSeed::new("", "m", None, BlockMode::Text),
            ChainSeed::new("", "m2", None, BlockMode::Text),
            ChainSeed::new("", "m", Some("lora"), BlockMode::Text),
            ChainSeed::new("s", "m", None, BlockMode::Text),
            ChainSeed::new("", "m", None, BlockMode::Tokens),
            ChainSeed::new("", "m", None, BlockMode::Text).salted(Some("tenant-a")),
            ChainSeed::new("", "m", None, BlockMode::Text).salted(Some("tenant-b")),
            ChainSeed::new("", "m", Some("lora"), BlockMode::Text).salted(Some("lora")),
        ];
        for (i, a) in seeds.iter().enumerate() {
            for b in &seeds[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(seeds[0].clone().salted(None), seeds[0]);
    }
    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 256,
            // No regression files: the tests also run as wasm.
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// Bytes cut into engine blocks anywhere give `hash_bytes`' chain,
        /// each block with its parent, and what lies past the cap.
        #[test]
        fn a_text_cursor_yields_hash_bytes_chain_wherever_engine_blocks_end(
            bytes in prop::collection::vec(any::<u8>(), 0..400),
            cuts in prop::collection::vec(0usize..400, 0..40),
            block_size in 1usize..9,
            coarse_after in 0usize..6,
            coarse_factor in 1usize..4,
            max_blocks in 0usize..40,
        ) {
            let seed = ChainSeed::new("s", "m", Some("a"), BlockMode::Text).salted(Some("t"));
            let layout = BlockLayout { block_size, coarse_after, coarse_factor, max_blocks };
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
            cuts.extend([0, bytes.len()]);
            cuts.sort_unstable();
            let mut cursor = TextChainCursor::new(&seed);
            let (mut keys, mut parents, mut past_cap) = (Vec::new(), Vec::new(), 0);
            for engine_block in cuts.windows(2) {
                let step = cursor.push(&bytes[engine_block[0]..engine_block[1]], &layout);
                keys.extend(step.completed.iter().map(|&(key, _)| key));
                parents.extend(step.completed.iter().map(|&(_, parent)| parent));
                past_cap += step.past_cap;
            }
            let chain = hash_bytes(&seed, &bytes, &layout);
            prop_assert_eq!(&keys, &chain);
            let expected_parents: Vec<Option<u64>> = (0..chain.len())
                .map(|i| i.checked_sub(1).map(|p| chain[p]))
                .collect();
            prop_assert_eq!(parents, expected_parents);
            let capped = layout.covered(max_blocks);
            prop_assert_eq!(past_cap as u64, (bytes.len() as u64).saturating_sub(capped));
        }
    }
}
