//! Chained block hashing of prompts.
//!
//! A prompt is cut into fixed-size blocks: `blockSizeBytes` bytes of its
//! canonical text (text mode) or `blockSizeTokens` token IDs, each as 4
//! little-endian bytes (token mode). Block `i`'s identifier is
//!
//! ```text
//! h[0] = xxh64(block[0], seed)        seed = xxh64("kvroute/v1" 0 mode 0 hashSeed 0 baseModel 0 adapter, 0)
//! h[i] = xxh64(block[i], h[i-1])
//! ```
//!
//! so each hash covers the block's whole prefix, and two models (or a base
//! model and one of its LoRA adapters) never share a block. A trailing
//! partial block is not hashed (an engine cannot reuse it either), and at
//! most `maxPrefixBlocks` blocks are hashed so a huge prompt costs bounded
//! work: O(min(len, maxPrefixBlocks · blockSize)) bytes hashed.

use xxhash_rust::xxh64::xxh64;

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

    pub fn value(&self) -> u64 {
        self.0
    }
}

/// Hashes whole `block_size`-byte blocks of `bytes`, at most `max_blocks`.
pub fn hash_bytes(
    seed: &ChainSeed,
    bytes: &[u8],
    block_size: usize,
    max_blocks: usize,
) -> Vec<u64> {
    let mut chain = Vec::with_capacity((bytes.len() / block_size).min(max_blocks));
    let mut previous = seed.0;
    for block in bytes.chunks_exact(block_size).take(max_blocks) {
        previous = xxh64(block, previous);
        chain.push(previous);
    }
    chain
}

/// Hashes whole blocks of `block_size` token IDs, at most `max_blocks`.
pub fn hash_tokens(
    seed: &ChainSeed,
    tokens: &[u32],
    block_size: usize,
    max_blocks: usize,
) -> Vec<u64> {
    let whole = tokens.len() / block_size * block_size;
    let capped = whole.min(max_blocks.saturating_mul(block_size));
    continue_token_chain(seed.0, tokens.get(..capped).unwrap_or_default(), block_size)
}

/// Continues a token chain after the block whose hash is `previous` (the
/// seed's value for a prompt's first block): the hashes of the whole
/// `block_size`-token blocks of `tokens`. The vLLM bridge derives kvroute's
/// keys this way from the token IDs of stored blocks and their parent's key.
pub fn continue_token_chain(previous: u64, tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut chain = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut previous = previous;
    let mut block_bytes = Vec::with_capacity(block_size * 4);
    for block in tokens.chunks_exact(block_size.max(1)) {
        block_bytes.clear();
        for token in block {
            block_bytes.extend_from_slice(&token.to_le_bytes());
        }
        previous = xxh64(&block_bytes, previous);
        chain.push(previous);
    }
    chain
}

/// Hashes prompts the way one configuration says: block sizes, cap and
/// secret. The simulated pods build the same hasher from the same config.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    secret: String,
    block_size_bytes: usize,
    block_size_tokens: usize,
    max_blocks: usize,
}

impl BlockHasher {
    pub fn from_config(config: &Config) -> BlockHasher {
        BlockHasher {
            secret: config.hash_seed.clone(),
            block_size_bytes: config.block_size_bytes,
            block_size_tokens: config.block_size_tokens,
            max_blocks: config.max_prefix_blocks,
        }
    }

    /// The block chain of `prompt` for a request that needs `target`.
    pub fn chain(&self, target: &ModelTarget, prompt: &Prompt) -> Vec<u64> {
        let adapter = target.adapter.as_deref();
        match prompt {
            Prompt::Text(bytes) => {
                let seed =
                    ChainSeed::new(&self.secret, &target.base_model, adapter, BlockMode::Text);
                hash_bytes(&seed, bytes, self.block_size_bytes, self.max_blocks)
            }
            Prompt::Tokens(tokens) => {
                let seed =
                    ChainSeed::new(&self.secret, &target.base_model, adapter, BlockMode::Tokens);
                hash_tokens(&seed, tokens, self.block_size_tokens, self.max_blocks)
            }
        }
    }

    /// Tokens in one block of `prompt`'s kind, counting a text block as
    /// `blockSizeBytes / 4` tokens (the simulator's tokenizer).
    pub fn tokens_per_block(&self, prompt: &Prompt) -> u64 {
        match prompt {
            Prompt::Text(_) => (self.block_size_bytes / BYTES_PER_TOKEN) as u64,
            Prompt::Tokens(_) => self.block_size_tokens as u64,
        }
    }
}

/// Bytes per token of the simulated tokenizer (and the estimate used for
/// text-mode predictions).
pub const BYTES_PER_TOKEN: usize = 4;

#[cfg(test)]
mod tests {
    use super::*;

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
        let chain = hash_bytes(&seed, b"abcdefghijklmnopqrstuvwxyz0123456789", 8, 256);
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
            2,
            256,
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
        let a = hash_bytes(&seed, b"AAAABBBBCCCC", 4, 256);
        let b = hash_bytes(&seed, b"XAAABBBBCCCC", 4, 256);
        assert!(
            a.iter().zip(&b).all(|(x, y)| x != y),
            "a change in block 0 changes every later hash"
        );
        let c = hash_bytes(&seed, b"AAAABBBBDDDD", 4, 256);
        assert_eq!(a[..2], c[..2]);
        assert_ne!(a[2], c[2]);
    }

    #[test]
    fn partial_blocks_and_cap() {
        let seed = ChainSeed::new("", "m", None, BlockMode::Text);
        assert_eq!(hash_bytes(&seed, b"abc", 4, 256).len(), 0);
        assert_eq!(hash_bytes(&seed, b"abcdefg", 4, 256).len(), 1);
        assert_eq!(hash_bytes(&seed, &[7u8; 4000], 4, 256).len(), 256);
        assert_eq!(hash_tokens(&seed, &[1; 33], 16, 256).len(), 2);
    }

    #[test]
    fn seed_separates_models_adapters_secrets_and_modes() {
        let seeds = [
            ChainSeed::new("", "m", None, BlockMode::Text),
            ChainSeed::new("", "m2", None, BlockMode::Text),
            ChainSeed::new("", "m", Some("lora"), BlockMode::Text),
            ChainSeed::new("s", "m", None, BlockMode::Text),
            ChainSeed::new("", "m", None, BlockMode::Tokens),
        ];
        for (i, a) in seeds.iter().enumerate() {
            for b in &seeds[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }
}
