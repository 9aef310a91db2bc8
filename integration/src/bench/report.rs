//! Figures of one run and the results document (JSON + markdown).

use serde_json::{json, Value};

use super::load::Outcome;
use super::workload::Workload;

/// Nearest-rank percentile of sorted values (`p` in 0..=100).
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

pub(super) fn sorted(values: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    v
}

/// `n` evenly spaced quantiles of `sorted` (for CDF plots).
fn quantiles(sorted: &[f64], n: usize) -> Vec<f64> {
    if sorted.is_empty() {
        return Vec::new();
    }
    (1..=n)
        .map(|i| percentile(sorted, 100.0 * i as f64 / n as f64).unwrap_or(0.0))
        .map(|v| (v * 100.0).round() / 100.0)
        .collect()
}

pub(super) fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

/// The figures of one policy on one workload. `pod_stats` are the sims'
/// `/admin/stats` after the run (fresh sims: no deltas needed).
pub fn policy_figures(
    policy: &str,
    workload: &Workload,
    outcomes: &[Outcome],
    wall_s: f64,
    pod_stats: &[Value],
    filter_latency_us: &[f64],
) -> Value {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok()).collect();
    let ttft = sorted(ok.iter().filter_map(|o| o.ttft_ms));
    let e2e = sorted(ok.iter().filter_map(|o| o.e2e_ms));
    let cached: u64 = pod_stats
        .iter()
        .map(|s| s["cachedTokens"].as_u64().unwrap_or(0))
        .sum();
    let cached_cpu: u64 = pod_stats
        .iter()
        .map(|s| s["cachedTokensCpu"].as_u64().unwrap_or(0))
        .sum();
    let prompt: u64 = pod_stats
        .iter()
        .map(|s| s["promptTokens"].as_u64().unwrap_or(0))
        .sum();
    let usage_cached: u64 = ok.iter().filter_map(|o| o.cached_tokens).sum();
    let usage_prompt: u64 = ok.iter().filter_map(|o| o.prompt_tokens).sum();
    let per_pod: Vec<u64> = pod_stats
        .iter()
        .map(|s| s["requests"].as_u64().unwrap_or(0))
        .collect();
    let total: u64 = per_pod.iter().sum();
    // Prefill: the prompt tokens each pod computed (not cached in any
    // tier), where the prefill engines' time went.
    let prefilled: Vec<u64> = pod_stats
        .iter()
        .map(|s| s["prefillTokens"].as_u64().unwrap_or(0))
        .collect();
    let all_prefilled = prefilled.iter().sum::<u64>().max(1) as f64;
    let prefill_percent = |tokens: u64| round(100.0 * tokens as f64 / all_prefilled, 1);
    let fast_pods = workload.fast_pods();
    let max_share = if total == 0 {
        0.0
    } else {
        *per_pod.iter().max().unwrap_or(&0) as f64 / total as f64
    };
    let first = outcomes
        .iter()
        .map(|o| o.sent_s)
        .fold(f64::INFINITY, f64::min);
    let last = ok.iter().map(|o| o.end_s).fold(0.0, f64::max);
    let span = (last - first).max(1e-3);
    let mut error_kinds: Vec<String> = outcomes
        .iter()
        .filter_map(|o| o.error.clone())
        .map(|e| e.chars().take(60).collect())
        .collect();
    error_kinds.sort();
    error_kinds.dedup();
    error_kinds.truncate(5);
    let filter = sorted(filter_latency_us.iter().copied());
    // A session's request on another pod than its session's previous one
    // (multi-turn users, agents, groups, tenants): affinity lost.
    let mut last_pod: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
    let (mut follow_ups, mut moved) = (0usize, 0usize);
    for o in &ok {
        let (Some(pod), Some(request)) = (o.pod.as_deref(), workload.requests.get(o.index)) else {
            continue;
        };
        if let Some(previous) = last_pod.insert(&request.session, pod) {
            follow_ups += 1;
            moved += usize::from(previous != pod);
        }
    }
    let mut row = json!({
        "policy": policy,
        "requests": outcomes.len(),
        "completed": ok.len(),
        "errors": outcomes.len() - ok.len(),
        "http503": outcomes.iter().filter(|o| o.status == 503).count(),
        "errorKinds": error_kinds,
        "hitRate": round(cached as f64 / prompt.max(1) as f64, 4),
        "cpuHitRate": round(cached_cpu as f64 / prompt.max(1) as f64, 4),
        "hitRateUsage": round(usage_cached as f64 / usage_prompt.max(1) as f64, 4),
        "cachedTokens": cached,
        "promptTokens": prompt,
        "ttftMs": {"p50": percentile(&ttft, 50.0).map(|v| round(v, 2)), "p90": percentile(&ttft, 90.0).map(|v| round(v, 2)),
                   "p99": percentile(&ttft, 99.0).map(|v| round(v, 2)),
                   "mean": round(ttft.iter().sum::<f64>() / ttft.len().max(1) as f64, 2)},
        "e2eMs": {"p50": percentile(&e2e, 50.0).map(|v| round(v, 2)), "p99": percentile(&e2e, 99.0).map(|v| round(v, 2))},
        "completedPerS": round(ok.len() as f64 / span, 2),
        "wallS": round(wall_s, 1),
        "perPodRequests": per_pod,
        "prefillPerPod": prefilled.iter().map(|&t| prefill_percent(t)).collect::<Vec<_>>(),
        "maxPodShare": round(max_share, 4),
        "maxShareOverFair": round(max_share * workload.pods as f64, 3),
        "maxQueueSeen": pod_stats.iter().map(|s| s["maxQueueSeen"].as_u64().unwrap_or(0)).max(),
        "sessionMoves": round(moved as f64 / follow_ups.max(1) as f64, 4),
        "filterLatencyUs": {"p50": percentile(&filter, 50.0), "p99": percentile(&filter, 99.0), "samples": filter.len()},
        "ttftQuantilesMs": quantiles(&ttft, 100),
    });
    if !fast_pods.is_empty() {
        let fast: u64 = fast_pods.iter().filter_map(|&pod| prefilled.get(pod)).sum();
        row["fastPodsPrefillPercent"] = json!(prefill_percent(fast));
    }
    row
}

/// The workload's parameters as JSON.
pub fn workload_json(workload: &Workload) -> Value {
    let tokens: u64 = workload.requests.iter().map(|r| r.prompt_tokens).sum();
    json!({
        "name": workload.name,
        "description": workload.description,
        "requests": workload.requests.len(),
        "meanPromptTokens": tokens / workload.requests.len().max(1) as u64,
        "pods": workload.pods,
        "maxBatch": workload.max_batch,
        "timeScale": workload.time_scale,
        "kvBlocksPerPod": workload.kv_blocks,
        "cpuKvBlocksPerPod": workload.cpu_kv_blocks,
        "uniqueBlocks": workload.unique_blocks,
        "workingSetBlocks": workload.working_set_blocks,
        "workingSetShare": round(workload.working_set_blocks as f64 / (workload.kv_blocks * workload.pods) as f64, 3),
        "capacityRps": round(workload.capacity_rps, 2),
        "offeredRps": round(workload.offered_rps, 2),
        "offeredLoad": round(workload.offered_rps / workload.capacity_rps, 3),
        "closedLoopAgents": workload.agents,
        "stockVllm": workload.stock_vllm,
        "tokenizer": workload.stock_vllm.then_some(&workload.tokenizer),
        "prefillSpeeds": workload.prefill_speeds,
        "fastPods": workload.fast_pods(),
        "plugin": workload.plugin,
        "bounds": {"pooledLru": round(workload.bounds.pooled, 4), "infinite": round(workload.bounds.infinite, 4)},
    })
}

/// Router CPU seconds per 1,000 requests; for an Envoy, with its main
/// thread's part (kvroute's report service) in brackets.
fn router_cpu(r: &Value) -> String {
    let Some(total) = r["routerCpuSPer1k"].as_f64() else {
        return "–".into();
    };
    match r["routerMainThreadCpuSPer1k"].as_f64() {
        Some(main) => format!("{total:.2} [{main:.2}]"),
        None => format!("{total:.2}"),
    }
}

pub(super) fn ms(v: &Value) -> String {
    match v.as_f64() {
        Some(x) if x >= 100.0 => format!("{x:.0}"),
        Some(x) => format!("{x:.1}"),
        None => "–".into(),
    }
}

pub(super) fn pct(v: f64) -> String {
    format!("{:.1}%", v * 100.0)
}

/// The markdown of the workload section.
pub fn workload_markdown(w: &Value) -> String {
    let mut out = String::new();
    let pooled = w["bounds"]["pooledLru"].as_f64().unwrap_or(0.0);
    let infinite = w["bounds"]["infinite"].as_f64().unwrap_or(0.0);
    let offered = match w["closedLoopAgents"].as_u64() {
        Some(agents) => format!(
            "closed loop, {agents} turns in flight (one per agent): no fixed rate; planned {:.1} req/s with every prefix cached",
            w["offeredRps"].as_f64().unwrap_or(0.0)
        ),
        None => format!(
            "offered {:.1} req/s = {:.0}% of the cache-blind capacity",
            w["offeredRps"].as_f64().unwrap_or(0.0),
            w["offeredLoad"].as_f64().unwrap_or(0.0) * 100.0
        ),
    };
    let stock_vllm = if w["stockVllm"].as_bool().unwrap_or(false) {
        format!(
            " Stock-vLLM mode: the pods tokenize prompts ({}; chat through a chat template) and publish vLLM's KV events, kvroute precise reads them through one kvroute-vllm-bridge per pod; blocks are {}-token blocks.",
            w["tokenizer"].as_str().unwrap_or("cl100k_base"),
            w["plugin"]["blockSizeTokens"].as_u64().unwrap_or(16)
        )
    } else {
        String::new()
    };
    out.push_str(&format!(
        "### {}\n\n{}.{stock_vllm}\n\n{} requests, mean prompt {} tokens; {} pods × {} sequence slots, time scale {}; \
         KV cache {} blocks per pod (working set {} blocks = {:.0}% of the cluster's {} blocks); \
         {offered} (cache-blind capacity {:.1} req/s).\n\n",
        w["name"].as_str().unwrap_or(""),
        w["description"].as_str().unwrap_or(""),
        w["requests"],
        w["meanPromptTokens"],
        w["pods"],
        w["maxBatch"],
        w["timeScale"],
        w["kvBlocksPerPod"],
        w["workingSetBlocks"],
        w["workingSetShare"].as_f64().unwrap_or(0.0) * 100.0,
        w["kvBlocksPerPod"].as_u64().unwrap_or(0) * w["pods"].as_u64().unwrap_or(0),
        w["capacityRps"].as_f64().unwrap_or(0.0),
    ));
    out.push_str("| policy | hit rate | of pooled bound | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | E2E p50 ms | E2E p99 ms | done req/s | errors | max pod share (× fair) | prefill per pod % | session moves | router CPU s / 1k req [Envoy main thread] | TTFT model error p50 |\n");
    out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|\n");
    for r in w["policies"].as_array().into_iter().flatten() {
        if let Some(reason) = r["unavailable"].as_str() {
            out.push_str(&format!(
                "| {} | *unavailable: {}* | | | | | | | | | | | | | |\n",
                r["policy"].as_str().unwrap_or(""),
                reason.replace('|', "/")
            ));
            continue;
        }
        let hit = r["hitRate"].as_f64().unwrap_or(0.0);
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {} | {} ({:.2}×) | {} | {} | {} | {} |\n",
            r["policy"].as_str().unwrap_or(""),
            pct(hit),
            if pooled > 0.0 {
                pct(hit / pooled)
            } else {
                "–".into()
            },
            ms(&r["ttftMs"]["p50"]),
            ms(&r["ttftMs"]["p90"]),
            ms(&r["ttftMs"]["p99"]),
            ms(&r["e2eMs"]["p50"]),
            ms(&r["e2eMs"]["p99"]),
            r["completedPerS"].as_f64().unwrap_or(0.0),
            r["errors"],
            pct(r["maxPodShare"].as_f64().unwrap_or(0.0)),
            r["maxShareOverFair"].as_f64().unwrap_or(0.0),
            prefill_per_pod(r),
            pct(r["sessionMoves"].as_f64().unwrap_or(0.0)),
            router_cpu(r),
            r["ttftModelErrorP50"]
                .as_f64()
                .map_or("–".into(), |p| format!("{p:.1}%")),
        ));
    }
    out.push_str(&format!(
        "| *bound: pooled LRU ({} blocks)* | {} | 100% | | | | | | | | | | | | |\n",
        w["kvBlocksPerPod"].as_u64().unwrap_or(0) * w["pods"].as_u64().unwrap_or(0),
        pct(pooled)
    ));
    out.push_str(&format!(
        "| *bound: infinite cache* | {} | {} | | | | | | | | | | | | |\n\n",
        pct(infinite),
        if pooled > 0.0 {
            pct(infinite / pooled)
        } else {
            "–".into()
        }
    ));
    let stale: Vec<String> = w["policies"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| {
            let stale = &r["staleRouting"];
            // Earlier runs checked every decision.
            let checked = stale["checked"]
                .as_f64()
                .or_else(|| stale["decisions"].as_f64())?;
            Some(format!(
                "{} {} of {} checked of {} decisions ({})",
                r["policy"].as_str()?,
                stale["stale"].as_f64()?,
                checked,
                stale["decisions"].as_u64()?,
                pct(stale["share"].as_f64()?)
            ))
        })
        .collect();
    if !stale.is_empty() {
        out.push_str(&format!(
            "Stale routing (the pod served under half the cached tokens kvroute predicted), of the decisions checked: {}.\n\n",
            stale.join("; ")
        ));
    }
    out.push_str(&fast_pods_markdown(w));
    out
}

/// Each pod's share of the prompt tokens prefilled, in percent, pod by pod
/// ("–" for runs that did not count them).
fn prefill_per_pod(r: &Value) -> String {
    let shares: Vec<f64> = r["prefillPerPod"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_f64)
        .collect();
    if shares.iter().all(|&share| share == 0.0) {
        return "–".into();
    }
    shares
        .iter()
        .map(|share| format!("{share:.0}"))
        .collect::<Vec<_>>()
        .join("/")
}

/// In a mixed pool, each policy's share of the prefilled tokens on the
/// pods with the highest prefill speed.
fn fast_pods_markdown(w: &Value) -> String {
    let fast: Vec<String> = w["fastPods"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|pod| pod.to_string())
        .collect();
    let shares: Vec<String> = w["policies"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| {
            Some(format!(
                "{} {:.1}%",
                r["policy"].as_str()?,
                r["fastPodsPrefillPercent"].as_f64()?
            ))
        })
        .collect();
    if fast.is_empty() || shares.is_empty() {
        return String::new();
    }
    let pods = w["pods"].as_u64().unwrap_or(0) as usize;
    let speeds: Vec<String> = (0..pods)
        .map(|pod| w["prefillSpeeds"][pod].as_f64().unwrap_or(1.0).to_string())
        .collect();
    format!(
        "Prefill tokens on the fast pods (pods {} of prefill speeds {}): {}.\n\n",
        fast.join(", "),
        speeds.join("/"),
        shares.join("; ")
    )
}

/// The whole results document.
pub fn markdown(results: &Value, command: &str) -> String {
    let mut out = String::from("# kvroute benchmark results\n\n");
    let real_vllm = results["engine"]["engine"] == "vllm";
    let pods = if real_vllm {
        "real vLLM pods (`--engine vllm`: vLLM's CPU build, each pod pinned to a core, its prefix cache reset between runs; hit rates from vLLM's own `prefix_cache_queries_total` and `prefix_cache_hits_total`)"
    } else {
        "simulated vLLM pods (`kvroute-sim`)"
    };
    let model = if real_vllm {
        format!(
            "Pods: real vLLM ({}), model `{}`, block size {}, `{}`; each workload's requests tokenized and rendered as the model does, at the time scale {} ({:.3}: their prefill time per token over the cost model's), so the offered load is the share of their *prefill* capacity the simulator's workload offers; on CPU, decode competes with prefill for the same cores, so the real load is higher.",
            results["engine"]["version"].as_str().unwrap_or("?"),
            results["engine"]["model"].as_str().unwrap_or("?"),
            results["engine"]["blockSize"],
            results["engine"]["flags"].as_str().unwrap_or(""),
            if results["engine"]["timeScaleGiven"] == true {
                "given with `--time-scale`, as an earlier run measured it on the pods"
            } else {
                "measured on the pods"
            },
            results["engine"]["timeScale"].as_f64().unwrap_or(0.0),
        )
    } else {
        "Pod model (`integration/src/model.rs`, × each workload's time scale): a request waits for \
         one of the pod's sequence slots (vLLM's `max_num_seqs`), then its prefill queues on the \
         pod's single prefill engine, FIFO, at 0.9 s per 4,096 *uncached* prompt tokens; its first \
         token follows a 45 ms per-request overhead (latency, not engine time); decode is 20 ms per \
         token per sequence, concurrent. So uncached prefill work queues and delays everyone behind \
         it, and a cache hit removes it. Cache-blind capacity = pods × the prefill engine's \
         throughput with no cache hits (4,096 / (0.9 × time scale) tokens/s ÷ mean prompt tokens), \
         or the slot bound (slots ÷ mean uncontended request time) if lower."
            .to_string()
    };
    out.push_str(&format!(
        "Produced by `{command}` on {} ({}); Envoy 1.40 with `--concurrency 2`, {pods}, all on 127.0.0.1. Raw figures: `results.json`. Every policy of a workload \
         gets the same seeded request sequence at the same offsets, against fresh pods (empty caches). \
         Hit rate: token-weighted, Σ cached_tokens / Σ prompt_tokens as the pods counted them. TTFT: \
         client-side, time to the first server-sent event, measured by a keep-alive async client \
         (reqwest's connection pool, as OpenAI SDKs keep one). kvroute runs: reports every {} ms \
         (precise) or decisions only (`\"mode\": \"approximate\"`). Peers: SGLang Model Gateway \
         (`smg`) and vLLM's router (`vllm-router`), pinned PyPI releases, front the same pods \
         **directly (no Envoy in between)** with their own defaults (versions, flags and \
         defaults under Fairness); vllm-router's `kv_aware` policy is left out: it needs vLLM's \
         ZMQ KV events, which kvroute-sim does not emit. Baselines: the same Envoy with a \
         STATIC cluster of the same pods (`envoy/baseline.template.yaml`); Envoy's ring hash and \
         vllm-router's consistent hash both key on `x-session-id` (group / user / tenant / \
         agent / first hash id). One policy runs at a time, on fresh pods.\n\n{model}\n\n",
        results["date"].as_str().unwrap_or("?"),
        results["host"].as_str().unwrap_or("?"),
        super::stack::REPORT_INTERVAL_MS,
    ));
    if let Some(rows) = results["peerComparison"]
        .as_array()
        .filter(|r| !r.is_empty())
    {
        out.push_str(&peer_markdown(rows));
    }
    if let Some(targets) = results["targets"].as_array() {
        out.push_str("## Targets\n\n| target | measured | met |\n|---|---|---|\n");
        for t in targets {
            out.push_str(&format!(
                "| {} | {} | {} |\n",
                t["target"].as_str().unwrap_or(""),
                t["measured"].as_str().unwrap_or(""),
                match t["met"].as_bool() {
                    Some(true) => "yes",
                    Some(false) => "**no**",
                    None => "–",
                }
            ));
        }
        out.push('\n');
    }
    if let Some(workloads) = results["workloads"].as_object() {
        out.push_str("## Workloads\n\n![hit rate](hit_rate.png)\n\n![TTFT p50](ttft_p50.png)\n\n![TTFT CDF](ttft_cdf.png)\n\n");
        for name in super::workload::WORKLOADS {
            if let Some(w) = workloads.get(name) {
                out.push_str(&workload_markdown(w));
            }
        }
    }
    if results["fairness"].is_object() || results["workloads"].is_object() {
        out.push_str(&fairness_markdown(results));
    }
    if let Some(o) = results.get("overhead").filter(|o| !o.is_null()) {
        out.push_str(&super::overhead::overhead_markdown(o));
    }
    if let Some(f) = results.get("filterTime").filter(|f| !f.is_null()) {
        out.push_str(&super::overhead::filter_time_markdown(f));
    }
    if let Some(s) = results.get("scale").filter(|s| !s.is_null()) {
        out.push_str(&super::overhead::scale_markdown(s));
    }
    out
}

/// The measured row of policy `name` (not an unavailable one).
fn policy<'a>(w: &'a Value, name: &str) -> Option<&'a Value> {
    w["policies"]
        .as_array()?
        .iter()
        .find(|p| p["policy"] == name && p.get("unavailable").is_none())
}

fn ratio(a: &Value, b: &Value) -> Value {
    match (a.as_f64(), b.as_f64()) {
        (Some(a), Some(b)) if b > 0.0 => json!(round(a / b, 3)),
        _ => Value::Null,
    }
}

/// Per workload: kvroute precise against the best peer (the peer with the
/// lowest TTFT p90), as ratios precise ÷ peer.
pub fn peer_comparison(results: &Value) -> Value {
    let mut rows = Vec::new();
    for name in super::workload::WORKLOADS {
        let w = &results["workloads"][name];
        let Some(precise) = policy(w, "kvroute-precise") else {
            continue;
        };
        let best = super::peers::PEERS
            .iter()
            .filter_map(|p| policy(w, p.policy))
            .filter(|r| r["ttftMs"]["p90"].is_number())
            .min_by(|a, b| {
                let p90 = |r: &Value| r["ttftMs"]["p90"].as_f64().unwrap_or(f64::INFINITY);
                p90(a).total_cmp(&p90(b))
            });
        let Some(peer) = best else {
            continue;
        };
        rows.push(json!({
            "workload": name,
            "bestPeer": peer["policy"],
            "hitRate": {"precise": precise["hitRate"], "peer": peer["hitRate"], "ratio": ratio(&precise["hitRate"], &peer["hitRate"])},
            "ttftP50": {"precise": precise["ttftMs"]["p50"], "peer": peer["ttftMs"]["p50"], "ratio": ratio(&precise["ttftMs"]["p50"], &peer["ttftMs"]["p50"])},
            "ttftP90": {"precise": precise["ttftMs"]["p90"], "peer": peer["ttftMs"]["p90"], "ratio": ratio(&precise["ttftMs"]["p90"], &peer["ttftMs"]["p90"])},
            "ttftP99": {"precise": precise["ttftMs"]["p99"], "peer": peer["ttftMs"]["p99"], "ratio": ratio(&precise["ttftMs"]["p99"], &peer["ttftMs"]["p99"])},
            "maxShareOverFair": {"precise": precise["maxShareOverFair"], "peer": peer["maxShareOverFair"]},
        }));
    }
    Value::Array(rows)
}

/// The peer comparison section.
fn peer_markdown(rows: &[Value]) -> String {
    let mut out = String::from(
        "## kvroute vs the peers\n\nPer workload, kvroute precise against the best peer (the peer \
         router with the lowest TTFT p90 on that workload). Ratios are kvroute ÷ peer: hit rate \
         above 1 and TTFT below 1 favour kvroute.\n\n\
         | workload | best peer | hit rate (kvroute / peer) | ratio | TTFT p50 ratio | TTFT p90 ratio | TTFT p99 ratio | max pod share × fair (kvroute / peer) |\n\
         |---|---|---:|---:|---:|---:|---:|---:|\n",
    );
    let num = |v: &Value| v.as_f64().map_or("–".into(), |x| format!("{x:.2}"));
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} / {} | {} | {} ({} / {} ms) | {} ({} / {} ms) | {} ({} / {} ms) | {} / {} |\n",
            r["workload"].as_str().unwrap_or(""),
            r["bestPeer"].as_str().unwrap_or(""),
            pct(r["hitRate"]["precise"].as_f64().unwrap_or(0.0)),
            pct(r["hitRate"]["peer"].as_f64().unwrap_or(0.0)),
            num(&r["hitRate"]["ratio"]),
            num(&r["ttftP50"]["ratio"]),
            ms(&r["ttftP50"]["precise"]),
            ms(&r["ttftP50"]["peer"]),
            num(&r["ttftP90"]["ratio"]),
            ms(&r["ttftP90"]["precise"]),
            ms(&r["ttftP90"]["peer"]),
            num(&r["ttftP99"]["ratio"]),
            ms(&r["ttftP99"]["precise"]),
            ms(&r["ttftP99"]["peer"]),
            num(&r["maxShareOverFair"]["precise"]),
            num(&r["maxShareOverFair"]["peer"]),
        ));
    }
    out.push('\n');
    out
}

/// Router CPU seconds per 1,000 completed requests of `policy`, over
/// every workload it ran.
fn cpu_per_1k(results: &Value, policy_name: &str) -> Option<f64> {
    let (mut cpu, mut done) = (0.0, 0.0);
    for w in results["workloads"].as_object()?.values() {
        if let Some(r) = policy(w, policy_name) {
            if let (Some(c), Some(n)) = (r["routerCpuS"].as_f64(), r["completed"].as_f64()) {
                cpu += c;
                done += n;
            }
        }
    }
    (done > 0.0).then(|| cpu * 1000.0 / done)
}

/// The fairness section: idle added latency, CPU per request, versions and
/// flags of every router.
fn fairness_markdown(results: &Value) -> String {
    let mut out = String::from("## Fairness\n\n");
    let f = &results["fairness"];
    if let Some(method) = f["method"].as_str() {
        out.push_str(&format!(
            "Idle added latency: {method}. CPU: user + system seconds of the router's process \
             (Envoy's, or the peer's) from `/proc/PID/stat` over each workload run, per 1,000 \
             completed requests, over all workloads. The pods, the load generator and the router \
             share the same 2 cores.\n\n"
        ));
    }
    out.push_str("| policy | router | idle TTFT through router p50 ms | direct p50 ms | added ms | CPU s / 1k req | command |\n|---|---|---:|---:|---:|---:|---|\n");
    let idle = f["idle"].as_array().cloned().unwrap_or_default();
    for name in super::stack::POLICIES {
        let row = idle.iter().find(|r| r["policy"] == name);
        let cpu = cpu_per_1k(results, name).map_or("–".into(), |c| format!("{c:.2}"));
        match row {
            Some(r) if r["unavailable"].is_string() => out.push_str(&format!(
                "| {name} | *unavailable: {}* | | | | {cpu} | |\n",
                r["unavailable"].as_str().unwrap_or("").replace('|', "/")
            )),
            Some(r) => out.push_str(&format!(
                "| {name} | {} {} | {:.2} | {:.2} | {:.2} | {cpu} | `{}` |\n",
                r["router"]["router"].as_str().unwrap_or(""),
                r["router"]["version"].as_str().unwrap_or(""),
                r["routedTtftMs"]["p50"].as_f64().unwrap_or(f64::NAN),
                r["directTtftMs"]["p50"].as_f64().unwrap_or(f64::NAN),
                r["addedMs"].as_f64().unwrap_or(f64::NAN),
                r["router"]["command"].as_str().unwrap_or(""),
            )),
            None if cpu != "–" => out.push_str(&format!("| {name} | | | | | {cpu} | |\n")),
            None => {}
        }
    }
    out.push('\n');
    for peer in ["smg", "vllm-router"] {
        out.push_str(&format!(
            "- {peer} defaults (from its `--help`): {}.\n",
            super::peers::defaults(peer)
        ));
    }
    out.push('\n');
    out
}

/// The targets, checked against the results.
pub fn targets(results: &Value) -> Value {
    let mut out = Vec::new();
    let workloads = &results["workloads"];
    for name in [
        "shared-prefix",
        "multi-turn",
        "trace",
        "agentic",
        "long-context",
    ] {
        let w = &workloads[name];
        let pooled = w["bounds"]["pooledLru"].as_f64();
        if let (Some(pooled), Some(p), Some(rr)) = (
            pooled,
            policy(w, "kvroute-precise"),
            policy(w, "round-robin"),
        ) {
            let hit = p["hitRate"].as_f64().unwrap_or(0.0);
            let rr_hit = rr["hitRate"].as_f64().unwrap_or(0.0);
            out.push(json!({
                "target": format!("{name}: precise hit rate ≥ 95% of pooled bound, round robin far below"),
                "measured": format!("{:.1}% of bound ({} vs {}); round robin {:.1}% of bound", 100.0 * hit / pooled, pct(hit), pct(pooled), 100.0 * rr_hit / pooled),
                "met": hit >= 0.95 * pooled,
            }));
        }
    }
    let w = &workloads["shared-prefix"];
    if let (Some(p), Some(rr)) = (policy(w, "kvroute-precise"), policy(w, "round-robin")) {
        if let (Some(a), Some(b)) = (p["ttftMs"]["p50"].as_f64(), rr["ttftMs"]["p50"].as_f64()) {
            out.push(json!({
                "target": "shared-prefix: TTFT p50 ≥ 10× lower than round robin at ~70% load",
                "measured": format!("{:.1}× ({a:.1} ms vs {b:.1} ms)", b / a),
                "met": b / a >= 10.0,
            }));
        }
    }
    let w = &workloads["agentic"];
    if let Some(p90) = policy(w, "kvroute-precise").and_then(|p| p["ttftMs"]["p90"].as_f64()) {
        let best = w["policies"]
            .as_array()
            .into_iter()
            .flatten()
            // kvroute's own approximate mode is not a rival: the best
            // other router, as in the load sweep.
            .filter(|r| {
                r["policy"]
                    .as_str()
                    .is_some_and(|p| !p.starts_with("kvroute"))
            })
            .filter_map(|r| Some((r["policy"].as_str()?, r["ttftMs"]["p90"].as_f64()?)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        if let Some((other, other_p90)) = best {
            out.push(json!({
                "target": "agentic: precise TTFT p90 ≤ the best other router's",
                "measured": format!("{p90:.0} ms vs {other_p90:.0} ms ({other})"),
                "met": p90 <= other_p90,
            }));
        }
    }
    for name in super::workload::WORKLOADS {
        if let Some(p) = policy(&workloads[name], "kvroute-precise") {
            let r = p["maxShareOverFair"].as_f64().unwrap_or(0.0);
            out.push(json!({
                "target": format!("{name}: max pod share ≤ 1.3× fair share (precise)"),
                "measured": format!("{r:.2}×"),
                "met": r <= 1.3,
            }));
        }
    }
    // Issue 26's targets, on the native module (the wasm build's figures
    // beside it in the overhead table).
    let o = &results["overhead"];
    if let Some(sizes) = o["latency"].as_array() {
        for s in sizes.iter().filter(|s| s["bodyBytes"] == 16384) {
            let c = &s["concurrency"];
            let bounds: &[(&str, f64)] = if c == 1 {
                &[("p50", 50.0), ("p99", 500.0)]
            } else {
                &[("p99", 500.0)]
            };
            for &(quantile, bound_us) in bounds {
                let added = s["addedUs"]["native"][quantile]
                    .as_f64()
                    .unwrap_or(f64::NAN);
                // The floor modules' own added latency: what any
                // body-routing dynamic module (wasm filter) adds.
                let floor = s["addedUs"]["nativeFloor"][quantile]
                    .as_f64()
                    .map_or(String::new(), |us| format!(" (native floor {us:.0} µs)"));
                out.push(json!({
                    "target": format!("native: added latency ≤ {bound_us:.0} µs {quantile} at 16 KiB (concurrency {c})"),
                    "measured": format!("{added:.0} µs{floor}"),
                    "met": added <= bound_us,
                }));
            }
        }
        // The filter's own time, one client: the whole prompt is hashed.
        for (bytes, quantile, bound_us) in [(16384, "p50", 100.0), (524288, "p99", 1000.0)] {
            if let Some(us) = sizes
                .iter()
                .find(|s| s["bodyBytes"] == bytes && s["concurrency"] == 1)
                .and_then(|s| s["filterUs"]["native"][quantile].as_f64())
            {
                out.push(json!({
                    "target": format!("native: filter's own time ≤ {bound_us:.0} µs {quantile} at {} KiB", bytes / 1024),
                    "measured": format!("{us:.0} µs"),
                    "met": us <= bound_us,
                }));
            }
        }
    }
    if let Some(sat) = o["saturation"].as_array() {
        for s in sat {
            let ratio = s["ratioToPlain"]["native"].as_f64().unwrap_or(0.0);
            out.push(json!({
                "target": format!("native: saturation req/s ≥ 90% of plain Envoy ({} B bodies)", s["bodyBytes"]),
                "measured": format!("{:.1}% ({} vs {} req/s; native floor {:.1}%, wasm {:.1}%, floor filter {:.1}%)", ratio * 100.0, s["rps"]["native"], s["rps"]["plain"],
                    s["ratioToPlain"]["nativeFloor"].as_f64().unwrap_or(f64::NAN) * 100.0,
                    s["ratioToPlain"]["wasm"].as_f64().unwrap_or(f64::NAN) * 100.0, s["ratioToPlain"]["floor"].as_f64().unwrap_or(f64::NAN) * 100.0),
                "met": ratio >= 0.9,
            }));
            let cpu = s["cpuRatioToPlain"]["native"].as_f64().unwrap_or(f64::NAN);
            out.push(json!({
                "target": format!("native: Envoy CPU per request ≤ 1.2× plain Envoy's ({} B bodies)", s["bodyBytes"]),
                "measured": format!("{cpu:.2}× (native floor {}×, wasm {}×, floor filter {}×)", s["cpuRatioToPlain"]["nativeFloor"], s["cpuRatioToPlain"]["wasm"], s["cpuRatioToPlain"]["floor"]),
                "met": cpu <= 1.2,
            }));
        }
    }
    Value::Array(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[3.0], 1.0), Some(3.0));
    }

    #[test]
    fn mixed_pools_show_prefill_per_pod_and_on_the_fast_pods() {
        let w = json!({
            "name": "trace", "pods": 4, "prefillSpeeds": [1.0, 1.0, 0.5, 0.5], "fastPods": [0, 1],
            "bounds": {"pooledLru": 0.5},
            "policies": [
                {"policy": "kvroute-precise", "hitRate": 0.5, "prefillPerPod": [33.2, 29.0, 17.4, 20.4],
                 "fastPodsPrefillPercent": 62.2, "ttftModelErrorP50": 12.34},
                {"policy": "round-robin", "hitRate": 0.3, "prefillPerPod": [25.0, 25.0, 25.0, 25.0],
                 "fastPodsPrefillPercent": 50.0},
                {"policy": "smg-cache-aware", "unavailable": "not installed"},
            ],
        });
        let md = workload_markdown(&w);
        let row = |policy: &str| {
            md.lines()
                .find(|l| l.starts_with(&format!("| {policy} |")))
                .unwrap()
                .to_string()
        };
        let header = md.lines().find(|l| l.starts_with("| policy |")).unwrap();
        let columns = header.matches('|').count();
        for policy in ["kvroute-precise", "round-robin", "smg-cache-aware"] {
            assert_eq!(row(policy).matches('|').count(), columns, "{md}");
        }
        assert!(row("kvroute-precise").contains("| 33/29/17/20 |"), "{md}");
        assert!(row("kvroute-precise").ends_with("| 12.3% |"), "{md}");
        assert!(row("round-robin").ends_with("| – |"), "{md}");
        assert!(
            md.contains("Prefill tokens on the fast pods (pods 0, 1 of prefill speeds 1/1/0.5/0.5): kvroute-precise 62.2%; round-robin 50.0%."),
            "{md}"
        );
    }
}
