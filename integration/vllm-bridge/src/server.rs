//! The bridge's HTTP side: report protocol v1 at the report path (deltas,
//! `full: true` resyncs, long-poll `wait`, answered like kvroute-sim
//! answers), `/metrics` in Prometheus text format and `/health`.
//!
//! The bridge knows the pod's cache, not its load: reports carry
//! `queueDepth: 0` and `health: 1` and no `gpuUtilization`, so kvroute's
//! load for the pod comes from vLLM's own `/metrics` (`metricsPath`).
//! They carry the cache's use, `residentBlocks` (vLLM's blocks with a GPU
//! copy, as its events tell), and its size, `kvCapacityBlocks`, once
//! known ([`crate::capacity`]); the use is capped at the size, as a block
//! vLLM's events left out of a removal would otherwise hold the report
//! back.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};

use kvroute::report::Tier;

use crate::bridge::Bridge;

/// Longest `wait` honoured, as kvroute-sim.
pub const MAX_REPORT_WAIT_MS: u64 = 60_000;

/// The bridge's HTTP routes.
pub fn app(bridge: Arc<Bridge>, report_path: &str) -> Router {
    Router::new()
        .route(report_path, get(report))
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "ok" }))
        .with_state(bridge)
}

async fn report(
    State(bridge): State<Arc<Bridge>>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let since = query.get("since").and_then(|s| s.parse::<u64>().ok());
    let epoch = query.get("epoch").cloned();
    let wait = query.get("wait").and_then(|w| w.parse::<u64>().ok());
    if let (Some(wait), Some(since), Some(asked)) = (wait, since, epoch.as_deref()) {
        // Held while the asked epoch is current and has nothing after `since`.
        let mut changed = bridge.changed.subscribe();
        let wait = Duration::from_millis(wait.min(MAX_REPORT_WAIT_MS));
        let _ = tokio::time::timeout(
            wait,
            changed.wait_for(|(epoch, seq)| epoch != asked || *seq != since),
        )
        .await;
    }
    let state = bridge.lock();
    let mut body = state
        .blocks
        .report_body(&bridge.pod_id, &state.epoch, since, epoch.as_deref());
    let resident = state.blocks.resident_blocks() as u64;
    drop(state);
    body.insert("queueDepth".into(), json!(0));
    body.insert("health".into(), json!(1.0));
    let capacity = bridge.capacity.blocks();
    if let Some(capacity) = capacity {
        body.insert("kvCapacityBlocks".into(), json!(capacity));
    }
    body.insert(
        "residentBlocks".into(),
        json!(capacity.map_or(resident, |c| resident.min(c))),
    );
    (
        [(header::CONTENT_TYPE, "application/json")],
        Value::Object(body).to_string(),
    )
        .into_response()
}

async fn metrics(State(bridge): State<Arc<Bridge>>) -> Response {
    let c = &bridge.counters;
    let state = bridge.lock();
    let skipped = state.blocks.skipped;
    let held = state.blocks.len();
    let text_held = state.blocks.text_len();
    let tiers = state.blocks.tier_len();
    let resident = state.blocks.resident_blocks() as u64;
    drop(state);
    let mut text = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: u64| {
        text.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
        ));
    };
    let count = |counter: &std::sync::atomic::AtomicU64| counter.load(Ordering::Relaxed);
    metric(
        "kvbridge_resident_blocks",
        "gauge",
        "vLLM blocks held with a copy in GPU memory (residentBlocks).",
        resident,
    );
    metric(
        "kvbridge_kv_capacity_blocks",
        "gauge",
        "The pod's GPU cache in vLLM blocks (kvCapacityBlocks), 0 while not known.",
        bridge.capacity.blocks().unwrap_or(0),
    );
    metric(
        "kvbridge_batches_total",
        "counter",
        "Event batches applied.",
        count(&c.batches),
    );
    metric(
        "kvbridge_events_total",
        "counter",
        "KV events applied.",
        count(&c.events),
    );
    metric(
        "kvbridge_unknown_events_total",
        "counter",
        "Events of a kind the bridge does not know (skipped).",
        count(&c.unknown_events),
    );
    metric(
        "kvbridge_malformed_frames_total",
        "counter",
        "Frames that did not decode (skipped).",
        count(&c.malformed_frames),
    );
    metric(
        "kvbridge_gaps_total",
        "counter",
        "Sequence gaps on the subscription: a batch whose seq skips past the one after the last it delivered.",
        count(&c.gaps),
    );
    metric(
        "kvbridge_probe_ahead_total",
        "counter",
        "Batches the replay probe applied before the subscription delivered them (a race on a healthy pod, not a loss).",
        count(&c.probe_ahead),
    );
    metric(
        "kvbridge_replays_total",
        "counter",
        "Replay requests sent.",
        count(&c.replays),
    );
    metric(
        "kvbridge_replay_failures_total",
        "counter",
        "Replay requests that failed.",
        count(&c.replay_failures),
    );
    metric(
        "kvbridge_resyncs_total",
        "counter",
        "Gaps the replay buffer no longer covered (new epoch).",
        count(&c.resyncs),
    );
    metric(
        "kvbridge_publisher_restarts_total",
        "counter",
        "Sequence numbers going back (new epoch).",
        count(&c.publisher_restarts),
    );
    metric(
        "kvbridge_connects_total",
        "counter",
        "Connections to the publisher (each a new epoch).",
        count(&c.connects),
    );
    metric(
        "kvbridge_blocks_skipped_unknown_parent_total",
        "counter",
        "Stored blocks left out: parent not known.",
        skipped.unknown_parent,
    );
    metric(
        "kvbridge_blocks_skipped_block_size_total",
        "counter",
        "Stored blocks left out: block_size is not blockSizeTokens.",
        skipped.wrong_size,
    );
    metric(
        "kvbridge_blocks_skipped_unnamed_adapter_total",
        "counter",
        "Stored blocks left out: adapter without lora_name.",
        skipped.unnamed_adapter,
    );
    metric(
        "kvbridge_blocks_skipped_past_cap_total",
        "counter",
        "Stored blocks left out: past maxPrefixBlocks, where the router does not look.",
        skipped.past_cap,
    );
    metric(
        "kvbridge_blocks_skipped_extra_keys_total",
        "counter",
        "Stored blocks left out: extra keys kvroute cannot hash (multimodal, prompt embeddings).",
        skipped.extra_keys,
    );
    metric(
        "kvbridge_blocks_skipped_unknown_extra_keys_total",
        "counter",
        "Stored blocks refused: extra keys of a shape vLLM does not send today (logged), and the blocks after them in their event.",
        skipped.unknown_extra_keys,
    );
    metric(
        "kvbridge_blocks_skipped_unknown_medium_total",
        "counter",
        "Stored or removed blocks refused: a medium none of GPU, CPU, disk, storage (logged).",
        skipped.unknown_medium,
    );
    metric(
        "kvbridge_blocks_skipped_unknown_hash_total",
        "counter",
        "Copies named by hash only (no token ids, as vLLM's offloading connector publishes them) of a block not keyed.",
        skipped.unknown_hash,
    );
    metric(
        "kvbridge_blocks_skipped_unknown_token_total",
        "counter",
        "Stored blocks without text keys: a token id, theirs or an earlier one's in the chain, not in the tokenizer's vocabulary.",
        skipped.unknown_token,
    );
    metric(
        "kvbridge_blocks_skipped_text_past_cap_total",
        "counter",
        "Stored blocks without text keys: past maxPrefixBlocks of the text layout.",
        skipped.text_past_cap,
    );
    metric(
        "kvbridge_blocks",
        "gauge",
        "Blocks held (kvroute keys, token and text mode).",
        held as u64,
    );
    metric(
        "kvbridge_text_blocks",
        "gauge",
        "Text-mode keys held (with --tokenizer), of kvbridge_blocks.",
        text_held as u64,
    );
    text.push_str(
        "# HELP kvbridge_tier_blocks Blocks held (kvbridge_blocks) by the fastest tier vLLM keeps a copy in.\n\
         # TYPE kvbridge_tier_blocks gauge\n",
    );
    for tier in Tier::ALL {
        let held = tiers[tier.index()];
        text.push_str(&format!(
            "kvbridge_tier_blocks{{tier=\"{}\"}} {held}\n",
            tier.name()
        ));
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}
