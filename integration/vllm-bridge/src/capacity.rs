//! The pod's GPU cache size, sent in reports as `kvCapacityBlocks`.
//!
//! vLLM's KV events say which blocks are cached, not how many fit. vLLM
//! states its size on its metrics page, as the `num_gpu_blocks` label of
//! `vllm:cache_config_info` (in its own blocks, the size of
//! `blockSizeTokens` the bridge requires), or in its start-up log. The
//! bridge takes it from `--kv-capacity-blocks`, else reads that page
//! every [`READ_INTERVAL`]: the size changes only when vLLM restarts, and
//! a read costs its API server a few milliseconds. Until a read succeeds,
//! reports carry no size and kvroute sizes the pod from its own
//! `metricsPath`, if any.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often vLLM's metrics page is read for its cache size.
pub const READ_INTERVAL: Duration = Duration::from_secs(10);

/// Longest a read may take.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// The cache size last known, in blocks (0: not known).
#[derive(Debug, Default)]
pub struct Capacity(AtomicU64);

impl Capacity {
    pub fn blocks(&self) -> Option<u64> {
        Some(self.0.load(Ordering::Relaxed)).filter(|&blocks| blocks > 0)
    }

    pub fn set(&self, blocks: u64) {
        self.0.store(blocks, Ordering::Relaxed);
    }
}

/// `num_gpu_blocks` from a vLLM metrics page, or why there is none.
pub fn parse_capacity(page: &str) -> Result<u64, String> {
    let metrics = kvroute::report::parse_vllm_metrics(page)?;
    match metrics.num_gpu_blocks {
        Some(0) | None => Err("no `vllm:cache_config_info` with a `num_gpu_blocks` above 0".into()),
        Some(blocks) => Ok(blocks),
    }
}

/// Reads `url` every [`READ_INTERVAL`] into `capacity`, logging a failure
/// once until the next success.
pub async fn follow(url: String, capacity: Arc<Capacity>) {
    let client = match reqwest::Client::builder().timeout(READ_TIMEOUT).build() {
        Ok(client) => client,
        Err(e) => {
            eprintln!("kvroute-vllm-bridge: no HTTP client for --vllm-metrics: {e}");
            return;
        }
    };
    let mut failing = false;
    loop {
        let read = async {
            let response = client.get(&url).send().await.map_err(|e| e.to_string())?;
            let status = response.status();
            if !status.is_success() {
                return Err(format!("HTTP {status}"));
            }
            parse_capacity(&response.text().await.map_err(|e| e.to_string())?)
        };
        match read.await {
            Ok(blocks) => {
                if failing || capacity.blocks() != Some(blocks) {
                    eprintln!("kvroute-vllm-bridge: {url}: the pod caches {blocks} blocks");
                }
                failing = false;
                capacity.set(blocks);
            }
            Err(why) => {
                if !failing {
                    eprintln!("kvroute-vllm-bridge: cannot read the cache size from {url}: {why}");
                }
                failing = true;
            }
        }
        tokio::time::sleep(READ_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_size_is_vllms_num_gpu_blocks() {
        let page = "# TYPE vllm:cache_config_info gauge\n\
                    vllm:cache_config_info{block_size=\"32\",enable_prefix_caching=\"True\",num_gpu_blocks=\"1975\"} 1.0\n";
        assert_eq!(parse_capacity(page), Ok(1975));
        let without_size = "vllm:num_requests_waiting 0.0\n";
        assert!(parse_capacity(without_size)
            .unwrap_err()
            .contains("num_gpu_blocks"));
        let zero = page.replace("1975", "0");
        assert!(parse_capacity(&zero).is_err());
    }
}
