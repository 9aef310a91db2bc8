//! Pod reports: kvroute's report protocol v1 and vLLM's Prometheus metrics.
//!
//! Protocol v1 (the contract with pods;
//! `GET {reportPath}?since=SEQ&epoch=E&wait=MS`):
//!
//! ```json
//! {"version": 1, "podId": "pod-a", "epoch": "3f9c...", "seq": 42, "since": 40, "full": false,
//!  "stored":  [{"parent": "9a1b2c3d4e5f6071" | null, "hashes": ["0123456789abcdef", ...],
//!              "tier": "cpu"}],
//!  "removed": ["fedcba9876543210", ...],
//!  "queueDepth": 3, "running": 4, "gpuUtilization": 0.55, "health": 1.0,
//!  "adapters": ["billing-lora"], "kvCapacityBlocks": 1975, "residentBlocks": 1210}
//! ```
//!
//! - Block hashes are 16 lowercase hex digits (JSON numbers cannot carry
//!   64 bits), computed with kvroute's chained hashing of the same config.
//! - `epoch` identifies the pod process; `seq` counts its cache events.
//!   A delta (`full: false`) carries the events after `since`, which must
//!   equal the router's last `seq` of the same epoch; otherwise the router
//!   drops the pod's blocks and asks for `since=0`, which pods answer with
//!   `full: true`: all blocks they hold, as chains in parent-first order.
//! - `stored` segments are chains: each hash's parent is the previous hash,
//!   the first one's is `parent` (null: the prompt's first block).
//! - `tier` (optional, per segment): where the pod keeps those blocks, the
//!   fastest medium it holds each in: `gpu` (absent: a pod that sends none
//!   is all-GPU), `cpu` (host memory: vLLM's CPU offloading, LMCache) or
//!   `disk` (local or shared storage). A block whose best tier changes (its
//!   GPU copy evicted while a CPU copy stays, or reloaded to the GPU) comes
//!   again in `stored` with its new tier; `removed` means no copy is left.
//!   Routers that do not know tiers treat every tier as cached.
//! - `queueDepth` (waiting requests) and `health` in [0, 1] are required;
//!   `gpuUtilization` in [0, 1], `running` and `adapters` are optional.
//! - `kvCapacityBlocks` (optional, ≥ 1): how many blocks of
//!   `blockSizeTokens` tokens the pod's GPU cache holds (vLLM's
//!   `num_gpu_blocks`); `residentBlocks` (optional, ≤ `kvCapacityBlocks`
//!   when both are sent): how many of them hold a cached block now, in use
//!   or free for reuse. A pod that sends neither is sized from vLLM's
//!   `/metrics` (`metricsPath`), else not at all. What the router does with
//!   them: docs/design.md, "Cache room".
//! - Unknown fields are ignored, so pods may add their own.
//! - Long-poll (`wait`, optional for pods): a pod that supports it holds
//!   the request while it has no event after `since` of the epoch asked and
//!   answers as soon as it has one, or with an empty delta when `wait` ms
//!   end; it answers at once when it already has events or owes a full
//!   resync. kvroute asks `wait` = `podReportIntervalMs` with a call
//!   timeout of `wait + reportTimeoutMs`, keeps one call pending per pod,
//!   and polls a pod that ignores `wait` (answers at once with nothing
//!   new) on the interval instead: see [`crate::polling`].

use serde::Deserialize;

/// Where a pod keeps a block: the fastest medium it holds it in. Ordered
/// fastest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Tier {
    /// GPU memory: a prefix hit costs nothing.
    #[default]
    Gpu,
    /// Host memory: a hit costs a reload over PCIe.
    Cpu,
    /// Local or shared storage: a slower reload.
    Disk,
}

impl Tier {
    /// Every tier, fastest first.
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Disk];

    /// The protocol's name (`gpu`, `cpu`, `disk`).
    pub fn name(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Cpu => "cpu",
            Tier::Disk => "disk",
        }
    }

    /// The tier named `name` in a report.
    pub fn parse(name: &str) -> Option<Tier> {
        Tier::ALL.into_iter().find(|tier| tier.name() == name)
    }

    /// Position in [`Tier::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// One chain segment of stored blocks, all in one tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredChain {
    pub parent: Option<u64>,
    pub hashes: Vec<u64>,
    pub tier: Tier,
}

/// A validated pod report.
#[derive(Debug, Clone, PartialEq)]
pub struct PodReport {
    pub pod_id: String,
    pub epoch: String,
    pub seq: u64,
    pub since: u64,
    pub full: bool,
    pub stored: Vec<StoredChain>,
    pub removed: Vec<u64>,
    pub queue_depth: u32,
    pub running: u32,
    /// `None` when the pod does not report it: load then comes from vLLM's
    /// `vllm:kv_cache_usage_perc`.
    pub gpu_utilization: Option<f64>,
    pub health: f64,
    pub adapters: Vec<String>,
    /// `kvCapacityBlocks`: the pod's GPU cache size in blocks.
    pub kv_capacity_blocks: Option<u64>,
    /// `residentBlocks`: blocks of that cache holding a cached block.
    pub resident_blocks: Option<u64>,
}

// Hashes are borrowed from the body (hex never needs JSON escapes), so a
// large report allocates no string per hash.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireChain<'a> {
    #[serde(borrow)]
    parent: Option<&'a str>,
    #[serde(borrow)]
    hashes: Vec<&'a str>,
    #[serde(default, borrow)]
    tier: Option<&'a str>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireReport<'a> {
    version: u32,
    pod_id: String,
    epoch: String,
    seq: u64,
    #[serde(default)]
    since: u64,
    full: bool,
    #[serde(default, borrow)]
    stored: Vec<WireChain<'a>>,
    #[serde(default, borrow)]
    removed: Vec<&'a str>,
    queue_depth: u32,
    #[serde(default)]
    running: u32,
    #[serde(default)]
    gpu_utilization: Option<f64>,
    health: f64,
    #[serde(default)]
    adapters: Vec<String>,
    #[serde(default)]
    kv_capacity_blocks: Option<u64>,
    #[serde(default)]
    resident_blocks: Option<u64>,
}

/// Formats a block hash the way reports carry it.
pub fn hash_to_hex(hash: u64) -> String {
    format!("{hash:016x}")
}

fn parse_hash(text: &str, field: &str) -> Result<u64, String> {
    if text.len() != 16 {
        return Err(format!("`{field}` hash {text:?} must be 16 hex digits"));
    }
    u64::from_str_radix(text, 16).map_err(|_| format!("`{field}` hash {text:?} is not hex"))
}

fn unit_field(value: f64, field: &str) -> Result<f64, String> {
    if value.is_finite() && (0.0..=1.0).contains(&value) {
        Ok(value)
    } else {
        Err(format!("`{field}` must be in [0, 1] (got {value})"))
    }
}

/// Parses and validates a protocol v1 report; the error names the field.
pub fn parse_report(body: &[u8]) -> Result<PodReport, String> {
    let wire: WireReport =
        serde_json::from_slice(body).map_err(|e| format!("malformed report: {e}"))?;
    if wire.version != 1 {
        return Err(format!(
            "`version` {} is not supported (expected 1)",
            wire.version
        ));
    }
    let stored = wire
        .stored
        .iter()
        .map(|chain| {
            Ok(StoredChain {
                parent: chain
                    .parent
                    .map(|p| parse_hash(p, "stored.parent"))
                    .transpose()?,
                hashes: chain
                    .hashes
                    .iter()
                    .map(|h| parse_hash(h, "stored.hashes"))
                    .collect::<Result<_, _>>()?,
                tier: match chain.tier {
                    None => Tier::Gpu,
                    Some(name) => Tier::parse(name).ok_or_else(|| {
                        format!("`stored.tier` {name:?} is not one of gpu, cpu, disk")
                    })?,
                },
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let removed = wire
        .removed
        .iter()
        .map(|h| parse_hash(h, "removed"))
        .collect::<Result<_, _>>()?;
    if wire.kv_capacity_blocks == Some(0) {
        return Err("`kvCapacityBlocks` must be at least 1 (got 0)".into());
    }
    if let (Some(capacity), Some(resident)) = (wire.kv_capacity_blocks, wire.resident_blocks) {
        if resident > capacity {
            return Err(format!(
                "`residentBlocks` {resident} exceeds `kvCapacityBlocks` {capacity}"
            ));
        }
    }
    Ok(PodReport {
        pod_id: wire.pod_id,
        epoch: wire.epoch,
        seq: wire.seq,
        since: wire.since,
        full: wire.full,
        stored,
        removed,
        queue_depth: wire.queue_depth,
        running: wire.running,
        gpu_utilization: wire
            .gpu_utilization
            .map(|u| unit_field(u, "gpuUtilization"))
            .transpose()?,
        health: unit_field(wire.health, "health")?,
        adapters: wire.adapters,
        kv_capacity_blocks: wire.kv_capacity_blocks,
        resident_blocks: wire.resident_blocks,
    })
}

/// What kvroute reads from vLLM's `/metrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VllmMetrics {
    /// `vllm:num_requests_waiting`, summed over label sets.
    pub waiting: Option<f64>,
    /// `vllm:num_requests_running`.
    pub running: Option<f64>,
    /// `vllm:kv_cache_usage_perc` (a fraction in [0, 1] despite its name).
    pub kv_cache_usage: Option<f64>,
    /// `running_lora_adapters` of the newest `vllm:lora_requests_info` sample.
    pub running_adapters: Option<Vec<String>>,
    /// `max_lora` of the same sample.
    pub max_lora: Option<u32>,
    /// `block_size` of `vllm:cache_config_info`: the tokens per block vLLM
    /// caches and publishes events of, which precise routing needs equal
    /// to `blockSizeTokens` (vLLM's CPU build takes multiples of 32 only).
    pub block_size: Option<u32>,
    /// `num_gpu_blocks` of the same sample: the pod's KV cache, in blocks
    /// of `block_size`.
    pub num_gpu_blocks: Option<u64>,
    /// `enable_prefix_caching` of the same sample: without it vLLM reuses
    /// no prefix, so there is nothing to route on.
    pub enable_prefix_caching: Option<bool>,
}

/// Parses the Prometheus text exposition format for the metrics above.
/// Unknown lines are ignored; a malformed value line of a wanted metric is an
/// error naming the line. `vllm:cache_config_info` is read from its labels
/// alone (an info metric's value is 1): a label missing, `None` (older
/// vLLM) or unparsable reads as not reported, never as an error, as the
/// labels vary between vLLM versions.
pub fn parse_vllm_metrics(text: &str) -> Result<VllmMetrics, String> {
    let mut metrics = VllmMetrics::default();
    let mut newest_lora = f64::NEG_INFINITY;
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, rest) = match line.find('{') {
            Some(open) => {
                let unclosed = || format!("metrics line {}: unclosed label set", number + 1);
                let close = line
                    .rfind('}')
                    .filter(|&close| close > open)
                    .ok_or_else(unclosed)?;
                // `{` and `}` are one byte each, so these are char boundaries.
                match (
                    line.get(..open),
                    line.get(open + 1..close),
                    line.get(close + 1..),
                ) {
                    (Some(name), Some(labels), Some(rest)) => (name, labels, rest),
                    _ => return Err(unclosed()),
                }
            }
            None => match line.split_once(' ') {
                Some((name, rest)) => (name, "", rest),
                None => continue,
            },
        };
        let target = match name {
            "vllm:num_requests_waiting" => &mut metrics.waiting,
            "vllm:num_requests_running" => &mut metrics.running,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => &mut metrics.kv_cache_usage,
            "vllm:lora_requests_info" => {
                let Some(value) = sample_value(rest, number)? else {
                    continue;
                };
                if value >= newest_lora {
                    newest_lora = value;
                    let adapters = label(labels, "running_lora_adapters").unwrap_or_default();
                    metrics.running_adapters = Some(
                        adapters
                            .split(',')
                            .filter(|a| !a.is_empty())
                            .map(str::to_string)
                            .collect(),
                    );
                    metrics.max_lora = label(labels, "max_lora").and_then(|m| m.parse().ok());
                }
                continue;
            }
            "vllm:cache_config_info" => {
                metrics.block_size = label(labels, "block_size").and_then(|b| b.parse().ok());
                metrics.num_gpu_blocks =
                    label(labels, "num_gpu_blocks").and_then(|n| n.parse().ok());
                metrics.enable_prefix_caching =
                    match label(labels, "enable_prefix_caching").as_deref() {
                        Some("True") => Some(true),
                        Some("False") => Some(false),
                        _ => None,
                    };
                continue;
            }
            _ => continue,
        };
        if let Some(value) = sample_value(rest, number)? {
            *target = Some(target.unwrap_or(0.0) + value);
        }
    }
    Ok(metrics)
}

/// A sample's value; `None` for NaN and infinities (Prometheus allows
/// them, but no load or queue can be one), which count as not reported.
fn sample_value(rest: &str, number: usize) -> Result<Option<f64>, String> {
    let text = rest.split_whitespace().next().unwrap_or("");
    let value = text.parse::<f64>().map_err(|_| {
        format!(
            "metrics line {}: value {text:?} is not a number",
            number + 1
        )
    })?;
    Ok(value.is_finite().then_some(value))
}

/// The value of label `key` in a Prometheus label set (`a="x",b="y"`),
/// its escapes (`\\`, `\"`, `\n`) read. Matched by whole name:
/// `vllm:cache_config_info` has `mamba_block_size` beside `block_size`,
/// and values may hold commas (`running_lora_adapters="a,b"`).
fn label(labels: &str, key: &str) -> Option<String> {
    let mut rest = labels;
    loop {
        let (name, after) = rest.trim_start_matches([',', ' ']).split_once('=')?;
        let mut chars = after.trim_start().strip_prefix('"')?.chars();
        let mut value = String::new();
        loop {
            match chars.next()? {
                '"' => break,
                '\\' => match chars.next()? {
                    'n' => value.push('\n'),
                    escaped => value.push(escaped),
                },
                c => value.push(c),
            }
        }
        if name.trim() == key {
            return Some(value);
        }
        rest = chars.as_str();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_delta_report() {
        let body = br#"{"version":1,"podId":"pod-a","epoch":"e1","seq":42,"since":40,"full":false,
            "stored":[{"parent":null,"hashes":["0000000000000001","00000000000000ff"]}],
            "removed":["0000000000000010"],"queueDepth":3,"gpuUtilization":0.5,"health":1.0,
            "adapters":["billing"]}"#;
        let r = parse_report(body).unwrap();
        assert_eq!(r.stored[0].hashes, vec![1, 255]);
        assert_eq!(r.removed, vec![16]);
        assert_eq!((r.seq, r.since, r.queue_depth), (42, 40, 3));
        assert_eq!(r.adapters, vec!["billing".to_string()]);
    }

    #[test]
    fn stored_segments_carry_their_tier_gpu_when_absent() {
        let body =
            br#"{"version":1,"podId":"p","epoch":"e","seq":3,"full":true,"queueDepth":0,"health":1,
            "stored":[{"parent":null,"hashes":["0000000000000001"]},
                      {"parent":"0000000000000001","hashes":["0000000000000002"],"tier":"cpu"},
                      {"parent":"0000000000000002","hashes":["0000000000000003"],"tier":"disk"},
                      {"parent":null,"hashes":["0000000000000004"],"tier":"gpu"}]}"#;
        let tiers: Vec<Tier> = parse_report(body)
            .unwrap()
            .stored
            .iter()
            .map(|c| c.tier)
            .collect();
        assert_eq!(tiers, [Tier::Gpu, Tier::Cpu, Tier::Disk, Tier::Gpu]);
        let bad = r#"{"version":1,"podId":"p","epoch":"e","seq":1,"full":true,"queueDepth":0,"health":1,
            "stored":[{"parent":null,"hashes":["0000000000000001"],"tier":TIER}]}"#;
        let error = parse_report(bad.replace("TIER", "\"ssd\"").as_bytes()).unwrap_err();
        assert_eq!(error, "`stored.tier` \"ssd\" is not one of gpu, cpu, disk");
        // Names are lowercase, as reports write them.
        assert!(parse_report(bad.replace("TIER", "\"GPU\"").as_bytes())
            .unwrap_err()
            .contains("`stored.tier` \"GPU\""));
        let error = parse_report(bad.replace("TIER", "2").as_bytes()).unwrap_err();
        assert!(
            error.contains("malformed report") && error.contains("string"),
            "{error}"
        );
    }

    #[test]
    fn cache_size_and_use_are_optional_and_checked() {
        let base = r#"{"version":1,"podId":"p","epoch":"e","seq":1,"full":true,"queueDepth":0,"health":1 EXTRA}"#;
        let parse = |extra: &str| parse_report(base.replace("EXTRA", extra).as_bytes());
        let sized = parse(r#","kvCapacityBlocks":1975,"residentBlocks":1210"#).unwrap();
        assert_eq!(
            (sized.kv_capacity_blocks, sized.resident_blocks),
            (Some(1975), Some(1210))
        );
        let older = parse("").unwrap();
        assert_eq!(
            (older.kv_capacity_blocks, older.resident_blocks),
            (None, None)
        );
        // Either alone is kept: a pod may know its use but not its size.
        assert_eq!(
            parse(r#","residentBlocks":7"#).unwrap().resident_blocks,
            Some(7)
        );
        assert_eq!(
            parse(r#","kvCapacityBlocks":0"#).unwrap_err(),
            "`kvCapacityBlocks` must be at least 1 (got 0)"
        );
        assert_eq!(
            parse(r#","kvCapacityBlocks":10,"residentBlocks":11"#).unwrap_err(),
            "`residentBlocks` 11 exceeds `kvCapacityBlocks` 10"
        );
        let negative = parse(r#","residentBlocks":-1"#).unwrap_err();
        assert!(negative.contains("malformed report"), "{negative}");
    }

    #[test]
    fn report_errors_name_the_field() {
        let base = r#"{"version":1,"podId":"p","epoch":"e","seq":1,"full":true,"queueDepth":0,"gpuUtilization":0.1,"health":HEALTH,"removed":[REMOVED]}"#;
        let bad_health = base.replace("HEALTH", "1.5").replace("REMOVED", "");
        assert!(parse_report(bad_health.as_bytes())
            .unwrap_err()
            .contains("health"));
        let bad_hash = base.replace("HEALTH", "1").replace("REMOVED", "\"xyz\"");
        assert!(parse_report(bad_hash.as_bytes())
            .unwrap_err()
            .contains("removed"));
        assert!(parse_report(b"{").unwrap_err().contains("malformed"));
        assert!(parse_report(br#"{"version":1}"#)
            .unwrap_err()
            .contains("podId"));
    }

    #[test]
    fn parses_vllm_metrics() {
        let text = "# HELP vllm:num_requests_waiting Number of requests waiting.\n\
            vllm:num_requests_waiting{model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{model_name=\"m\"} 2.0\n\
            vllm:kv_cache_usage_perc{model_name=\"m\"} 0.42\n\
            vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"old\",waiting_lora_adapters=\"\"} 1.0e9\n\
            vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"a,b\",waiting_lora_adapters=\"\"} 1.7e9\n\
            vllm:prompt_tokens_total{model_name=\"m\"} 1234\n";
        let m = parse_vllm_metrics(text).unwrap();
        assert_eq!(m.waiting, Some(3.0));
        assert_eq!(m.running, Some(2.0));
        assert_eq!(m.kv_cache_usage, Some(0.42));
        assert_eq!(m.running_adapters, Some(vec!["a".into(), "b".into()]));
        assert_eq!(m.max_lora, Some(4));
        assert!(parse_vllm_metrics("vllm:num_requests_waiting{a=\"b\"} x\n")
            .unwrap_err()
            .contains("line 1"));
    }

    /// vLLM 0.32's line on CPU, as served (`--block-size 32`).
    const CACHE_CONFIG_0_32: &str = "vllm:cache_config_info{_block_size_resolved=\"True\",block_size=\"32\",cache_dtype=\"auto\",cache_hit_alignment_tokens=\"None\",effective_attention_block_size=\"32\",enable_mamba_shared_prefix_checkpoint=\"False\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.92\",hash_block_size=\"None\",is_attention_free=\"False\",kv_cache_dtype_skip_layers=\"[]\",kv_cache_layout=\"None\",kv_cache_max_concurrency=\"1.126953125\",kv_cache_memory_bytes=\"18907136\",kv_cache_size_tokens=\"18464\",kv_offloading_backend=\"native\",kv_offloading_size=\"None\",kv_sharing_fast_prefill=\"False\",mamba_block_size=\"None\",mamba_cache_dtype=\"auto\",mamba_cache_mode=\"none\",mamba_page_size_padded=\"None\",mamba_ssm_cache_dtype=\"float32\",num_cpu_blocks=\"None\",num_gpu_blocks=\"577\",num_gpu_blocks_override=\"None\",prefix_cache_retention_interval=\"0\",prefix_caching_hash_algo=\"sha256\",prefix_match_unit=\"None\",replayssm_buffer_len=\"16\",skip_page_size_padded=\"None\",sliding_window=\"None\",swa_bounded_replay=\"True\",use_kda_recoverssm=\"False\",use_replayssm=\"False\",user_specified_block_size=\"True\"} 1.0";

    fn cache_config(line: &str) -> (Option<u32>, Option<u64>, Option<bool>) {
        let m = parse_vllm_metrics(&format!("vllm:num_requests_waiting 1\n{line}\n")).unwrap();
        assert_eq!(m.waiting, Some(1.0), "{line}");
        (m.block_size, m.num_gpu_blocks, m.enable_prefix_caching)
    }

    #[test]
    fn reads_vllms_cache_config() {
        assert_eq!(
            cache_config(CACHE_CONFIG_0_32),
            (Some(32), Some(577), Some(true))
        );
        // The issue's line, labels in another order.
        assert_eq!(
            cache_config(
                "vllm:cache_config_info{num_gpu_blocks=\"6103\",prefix_caching_hash_algo=\"sha256\",\
                 kv_cache_size_tokens=\"195296\",block_size=\"32\",engine=\"0\",\
                 enable_prefix_caching=\"True\",_block_size_resolved=\"True\",cache_dtype=\"auto\",\
                 kv_cache_memory_bytes=\"200000000\"} 1.0"
            ),
            (Some(32), Some(6103), Some(true))
        );
        // Older vLLM: fewer labels, `None` before the engine starts.
        assert_eq!(
            cache_config(
                "vllm:cache_config_info{block_size=\"16\",enable_prefix_caching=\"False\",\
                 num_gpu_blocks=\"None\"} 1.0"
            ),
            (Some(16), None, Some(false))
        );
        assert_eq!(
            cache_config("vllm:cache_config_info{gpu_memory_utilization=\"0.9\"} 1.0"),
            (None, None, None)
        );
        // Whole label names only: neither `mamba_block_size` nor
        // `num_gpu_blocks_override` is read.
        assert_eq!(
            cache_config(
                "vllm:cache_config_info{mamba_block_size=\"64\",num_gpu_blocks_override=\"9\",\
                 enable_prefix_caching=\"true\"} 1.0"
            ),
            (None, None, None)
        );
        // Unparsable values read as not reported, never as an error.
        assert_eq!(
            cache_config(
                "vllm:cache_config_info{block_size=\"-32\",num_gpu_blocks=\"1e3\",\
                 enable_prefix_caching=\"\"} x"
            ),
            (None, None, None)
        );
        assert_eq!(
            cache_config("vllm:cache_config_info{block_size=\"32} 1"),
            (None, None, None)
        );
        assert_eq!(
            parse_vllm_metrics("vllm:num_requests_waiting 2\n")
                .unwrap()
                .block_size,
            None
        );
    }

    #[test]
    fn label_values_are_read_whole_with_their_escapes() {
        let labels = r#"a="x,b=\"y\"",b="2\\",c="line\nnext""#;
        assert_eq!(label(labels, "a").as_deref(), Some(r#"x,b="y""#));
        assert_eq!(label(labels, "b").as_deref(), Some("2\\"));
        assert_eq!(label(labels, "c").as_deref(), Some("line\nnext"));
        assert_eq!(label(labels, "d"), None);
        assert_eq!(label("", "a"), None);
        assert_eq!(label("a=\"1\",", "a").as_deref(), Some("1"));
    }

    #[test]
    fn a_closing_brace_before_the_opening_one_is_an_error() {
        let error = parse_vllm_metrics("ok 1\n}{\n").unwrap_err();
        assert!(error.contains("line 2: unclosed label set"), "{error}");
        assert!(parse_vllm_metrics("vllm:num_requests_waiting} 3 {\n").is_err());
    }

    #[test]
    fn non_finite_samples_count_as_not_reported() {
        let m = parse_vllm_metrics(
            "vllm:kv_cache_usage_perc NaN\nvllm:num_requests_waiting{a=\"b\"} +Inf\n",
        )
        .unwrap();
        assert_eq!((m.kv_cache_usage, m.waiting), (None, None));
    }
}
