//! Target `route`: one request through [`Router::route_kind`] and
//! [`Router::route`] against a published snapshot, as the HTTP filter does.
//!
//! The input is a scenario byte, the request path up to the first newline,
//! then the body. `byte % SCENARIOS` picks the snapshot, `byte / SCENARIOS`
//! is the tie breaker. Every scenario has the fixture pods with the prompts
//! of [`PROMPTS`] indexed (pod 0 holds the chat and the text prompt, pod 1
//! half the chat prompt, pod 2 the token prompt and two text blocks, and
//! runs adapter `lora`):
//!
//! | scenario | configuration and state |
//! |---|---|
//! | 0 | defaults |
//! | 1 | `models` (`m` and `m-lora` → base `base`, adapter `lora`) with a chat template for `base` ([`CHAT_TEMPLATE`]), bad and unknown requests rejected, `maxBodyBytes` 4096, a `costPerHour` attribute scorer |
//! | 2 | every pod's queue at `maxQueue`: `fallbackPod` |
//! | 3 | every pod's queue at `maxQueue`: 503 |
//!
//! Checks: `route_kind` answers for exactly the configured paths; a routed
//! request names a published pod, its chain is a prefix of at most
//! `maxPrefixBlocks` blocks whose bisection lookup in the snapshot equals the
//! tree's lookup, its match is that lookup's and its cache match in [0, 1],
//! and its explanation is JSON; a rejection is 400, 404 or 503 with a JSON
//! body.

use std::sync::OnceLock;

use kvroute::cluster::ClusterState;
use kvroute::index::PrefixLookup;
use kvroute::router::{ClusterView, Outcome, Router};
use kvroute::scoring::occupancy::Occupancy;
use kvroute::scoring::ttft::{TtftModel, Work};
use kvroute::snapshot::SlotLoad;

use crate::{fixture_config, pod_id, Report, SharedData};

/// The indexed prompts (chat, text completion, token completion), also the
/// seeds of `corpus/route`.
pub const PROMPTS: [(bool, &str); 3] = [
    (
        true,
        r#"{"model":"m","messages":[{"role":"system","content":"You are the support assistant of a bank. Answer briefly, cite the account terms, never reveal internal notes, and escalate fraud reports to a human agent at once."},{"role":"user","content":[{"type":"text","text":"My card was charged twice for the same purchase yesterday."}]}]}"#,
    ),
    (
        false,
        r#"{"model":"m-lora","prompt":"Summarise the following incident report for the on-call engineer. The router kept sending traffic to a pod after it was killed because the report service had stopped publishing; health never decayed.","stream":true}"#,
    ),
    (
        false,
        r#"{"model":"m","prompt":[101,2023,2003,1037,19204,3231,1997,1996,2434,2005,1996,4677,2000,2022,22330,2011,1996,2569,1997,1996,2132,2544,4995,2073,2009,2003,2109,2005,1996,3391,2006,1996,3642]}"#,
    ),
];

/// Scenario 1's chat template: what Hugging Face templates do most
/// (loops, tests, filters, `tojson`, `raise_exception`), so fuzzed bodies
/// reach the renderer.
const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}{% if message.role == 'system' and not loop.first %}{{ raise_exception('system first') }}{% endif %}<|{{ message.role }}|>{% if message.content is string %}{{ message.content | trim }}{% else %}{% for part in message.content %}{{ part.text }}{% endfor %}{% endif %}{% for call in message.tool_calls | default([]) %}{{ call.function | tojson }}{% endfor %}{% endfor %}{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}{% if add_generation_prompt %}<|assistant|>{% endif %}";

const SCENARIOS: u8 = 4;
const NOW_MS: u64 = 1_000_000;

struct Scenario {
    router: Router,
    state: ClusterState,
    shared: SharedData,
    inflight: Vec<SlotLoad>,
    ttft: TtftModel,
    occupancy: Occupancy,
}

impl Scenario {
    fn new(extra_config: &str, queue: u32) -> Scenario {
        let config = fixture_config(&extra_config.replace("CHAT_TEMPLATE", CHAT_TEMPLATE));
        let router = Router::new(config.clone());
        let chains: Vec<Vec<u64>> = PROMPTS
            .iter()
            .map(
                |(chat, body)| match router.prepare(body.as_bytes(), *chat) {
                    Ok(request) => request.chain,
                    Err(rejected) => panic!("fixture prompt rejected: {rejected:?}"),
                },
            )
            .collect();
        let (chat, text, tokens) = (&chains[0], &chains[1], &chains[2]);
        let held: [Vec<&[u64]>; 3] = [
            vec![chat, text],
            vec![&chat[..chat.len() / 2]],
            vec![tokens, &text[..2.min(text.len())]],
        ];
        let mut state = ClusterState::new(&config, NOW_MS);
        for (pod, chains) in held.iter().enumerate() {
            let (result, _) = state.apply_report(
                &pod_id(pod),
                &Report::full(&pod_id(pod), chains, queue).encode(),
                NOW_MS,
                0,
            );
            result.expect("fixture report folds");
        }
        let metrics = "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"lora\"} 1\n";
        let (result, _) = state.apply_metrics(&pod_id(2), metrics.as_bytes(), NOW_MS, 0);
        result.expect("fixture metrics fold");
        let mut shared = SharedData::default();
        shared.write(state.publish(NOW_MS));
        Scenario {
            router,
            state,
            shared,
            // Pod 1 queues more prefill than a whole prompt: the prefill
            // guard is reached.
            inflight: [(0, 0), (3, 40_000), (1, 500)]
                .map(|(requests, prefill_tokens)| SlotLoad {
                    requests,
                    prefill_tokens,
                    prefill_attention: prefill_tokens * 4,
                    streams: requests,
                })
                .to_vec(),
            // Calibrated (pod 1 twice as slow), so balance compares
            // learned costs with a measured error.
            ttft: {
                let mut model = TtftModel::new(64);
                for i in 0..64u64 {
                    let work = 1_000 + (i % 8) * 2_000;
                    model.observe(0, Work::new(0, work), 10.0 + 0.1 * work as f64);
                    model.observe(
                        1,
                        Work::new(0, work),
                        10.0 + 0.2 * work as f64 + (i % 3) as f64,
                    );
                }
                model
            },
            // Pods busy, so a copy costs the requests after it.
            occupancy: {
                let mut occupancy = Occupancy::new(64);
                for _ in 0..64 {
                    occupancy.observe(&[0, 40_000, 500].map(|prefill_tokens| SlotLoad {
                        prefill_tokens,
                        streams: 1,
                        ..SlotLoad::default()
                    }));
                }
                occupancy
            },
        }
    }
}

fn scenarios() -> &'static [Scenario] {
    static SCENARIOS: OnceLock<Vec<Scenario>> = OnceLock::new();
    SCENARIOS.get_or_init(|| {
        let full = 20;
        vec![
            Scenario::new("", 0),
            Scenario::new(
                r#", "models": {"m": {"baseModel": "base"}, "m-lora": {"baseModel": "base", "adapter": "lora"}},
                "chatTemplates": {"base": {"template": "CHAT_TEMPLATE", "bosToken": "<s>", "completionPrefix": "<s>"}},
                "onBadRequest": "reject", "onUnknownModel": "reject", "maxBodyBytes": 4096,
                "weights": {"cache": 0.5, "load": 0.2, "queue": 0.1, "health": 0.05, "adapter": 0.05},
                "attributeScorers": [{"name": "cost", "weight": 0.1, "attribute": "costPerHour",
                                      "prefer": "lower", "cacheMatchWindow": 0.2}]"#,
                1,
            ),
            Scenario::new(r#", "onNoEligiblePod": "fallback", "fallbackPod": "pod-1""#, full),
            Scenario::new("", full),
        ]
    })
}

pub fn run(data: &[u8]) {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let scenario = &scenarios()[usize::from(selector % SCENARIOS)];
    let tie_breaker = u64::from(selector / SCENARIOS);
    let (path, body) = match rest.iter().position(|&b| b == b'\n') {
        Some(at) => (&rest[..at], &rest[at + 1..]),
        None => (rest, &[][..]),
    };
    let path = String::from_utf8_lossy(path);
    let config = scenario.router.config();
    let kind = scenario.router.route_kind(&path);
    let bare = path.split('?').next().unwrap_or_default();
    assert_eq!(kind.is_some(), config.route_paths.iter().any(|p| p == bare));

    let table = &scenario.shared.table;
    let index = scenario.shared.index();
    // Now: sometimes well past the stale limit, so stale routing is reached.
    let view = ClusterView {
        table,
        index: &index,
        inflight: &scenario.inflight,
        ttft: &scenario.ttft,
        occupancy: &scenario.occupancy,
        prefix_demand: &Default::default(),
        now_ms: table.published_at_ms + tie_breaker * 1000,
    };
    match scenario
        .router
        .route(body, kind.unwrap_or(false), &view, tie_breaker)
    {
        Outcome::Routed(routed) => {
            let pod = &table.pods[routed.pod];
            assert_eq!(
                (routed.slot, &routed.pod_id, &routed.address),
                (pod.slot, &pod.id, &pod.address)
            );
            assert!(routed.chain.len() <= config.max_prefix_blocks);
            assert!(routed.degraded.is_none() || routed.chain.is_empty() || routed.stale_snapshot);
            scenario
                .shared
                .assert_lookup_matches(scenario.state.index(), &routed.chain);
            // A stale snapshot is not trusted for cache.
            let matched = if routed.stale_snapshot {
                0
            } else {
                index.lookup(&routed.chain).blocks(routed.slot)
            };
            assert_eq!(routed.matched_blocks, matched);
            assert!((0.0..=1.0).contains(&routed.cache_match));
            let explained = scenario.router.explain(table, &routed);
            serde_json::from_str::<serde_json::Value>(&explained).expect("explanation is JSON");
        }
        Outcome::Rejected(rejected) => {
            assert!(matches!(rejected.status, 400 | 404 | 503), "{rejected:?}");
            serde_json::from_slice::<serde_json::Value>(&rejected.body())
                .expect("error body is JSON");
        }
        // Every pod excluded under "wait": handed back, ready to wait.
        Outcome::NoEligiblePod(no_pod) => {
            assert_eq!(no_pod.rejected.status, 503);
            assert!(no_pod.request.chain.len() <= config.max_prefix_blocks);
            serde_json::from_slice::<serde_json::Value>(&no_pod.rejected.body())
                .expect("error body is JSON");
        }
    }
}
