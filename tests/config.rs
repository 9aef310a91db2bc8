//! `Config::parse`: defaults, one test per validation rule (each error names
//! the offending field), the model map of the customer-support example, and
//! how model targets separate block chains.

use kvroute::config::{
    BadRequestPolicy, Config, IndexMode, LogLevel, ModelTarget, NoPodPolicy, PassiveHealthConfig,
    TierCredits, UpstreamMode, WaitLimitPolicy, Weights,
};
use kvroute::hashing::BlockHasher;
use kvroute::request::Prompt;

const PODS: &str = r#""pods": [{"id": "a", "address": "127.0.0.1:9001"}, {"id": "b", "address": "10.0.0.2:9002"}]"#;

/// A configuration with two valid pods plus `extra` top-level fields.
fn with_pods(extra: &str) -> String {
    if extra.is_empty() {
        format!("{{{PODS}}}")
    } else {
        format!("{{{PODS}, {extra}}}")
    }
}

fn parse(json: &str) -> Result<Config, kvroute::config::ConfigError> {
    Config::parse(json.as_bytes())
}

/// Parsing `json` fails, naming `field`.
#[track_caller]
fn rejects(json: &str, field: &str) -> String {
    match parse(json) {
        Ok(config) => panic!("accepted {json}: {config:?}"),
        Err(err) => {
            assert_eq!(err.field, field, "{json} → {err}");
            let message = err.to_string();
            assert!(
                message.contains(field),
                "the message names the field: {message}"
            );
            message
        }
    }
}

#[test]
fn defaults() {
    let config = parse(&with_pods("")).expect("two pods are enough");
    assert_eq!(
        config.weights,
        Weights {
            cache: 0.60,
            load: 0.20,
            queue: 0.10,
            health: 0.05,
            adapter: 0.05
        }
    );
    assert!(config.attribute_scorers.is_empty());
    assert_eq!(config.max_queue, 20);
    assert_eq!(config.health_exclusion_threshold, 0.3);
    assert_eq!(
        (config.block_size_bytes, config.block_size_tokens),
        (64, 16)
    );
    assert_eq!(
        (
            config.coarse_after_blocks,
            config.coarse_block_factor,
            config.max_prefix_blocks
        ),
        (256, 16, 2048)
    );
    assert_eq!(config.hash_seed, "");
    assert_eq!(config.mode, IndexMode::Precise);
    assert_eq!(config.max_index_blocks, 1_000_000);
    assert_eq!(config.pod_capacity_blocks, 32_768);
    assert_eq!(
        (config.pod_report_interval_ms, config.report_timeout_ms),
        (2000, 1000)
    );
    assert_eq!(
        config.route_paths,
        ["/v1/completions", "/v1/chat/completions"]
    );
    assert_eq!(config.max_body_bytes, 8 << 20);
    assert_eq!(config.on_bad_request, BadRequestPolicy::Route);
    assert_eq!(config.on_unknown_model, BadRequestPolicy::Route);
    assert_eq!(config.on_no_eligible_pod, NoPodPolicy::Wait);
    assert_eq!(
        (config.max_waiting_requests, config.max_wait_ms),
        (256, 30_000)
    );
    assert_eq!(
        (config.affinity_wait_bound_ms(), config.affinity_window),
        (20_000, 32)
    );
    assert_eq!(config.fallback_pod, None);
    assert_eq!(config.retry_after_seconds, 1);
    assert_eq!(config.upstream_mode, UpstreamMode::OverrideHost);
    assert_eq!(
        config.passive_health,
        PassiveHealthConfig {
            ejection_ms: 1000,
            max_ejection_ms: 30_000
        }
    );
    assert!(!config.decision_headers);
    assert_eq!(config.log_level, LogLevel::Info);
    assert_eq!(config.report_cluster, "kvroute_reports");
    assert_eq!(config.report_path, "/kvroute/v1/report");
    assert_eq!(config.metrics_path, None);
    assert!(config.models.is_empty());
    assert_eq!(config.pods.len(), 2);
    assert!(config.pods[0].attributes.is_empty());
    // Everything but the pods is the Default value.
    assert_eq!(
        Config {
            pods: Vec::new(),
            ..config.clone()
        },
        Config::default()
    );
    assert_eq!(
        config.snapshot_buckets(),
        65_536,
        "1M blocks / 16 per bucket, rounded up to 2^16"
    );
    // Partial weights keep the other defaults (and must still sum to 1).
    let config = parse(&with_pods(r#""weights": {"cache": 0.5, "load": 0.3}"#)).unwrap();
    assert_eq!(
        (
            config.weights.cache,
            config.weights.load,
            config.weights.queue
        ),
        (0.5, 0.3, 0.1)
    );
}

#[test]
fn empty_configuration_is_all_defaults_but_needs_pods() {
    // Empty input means the defaults, which list no pods: rejected.
    rejects("", "pods");
    rejects("  \n", "pods");
    rejects("{}", "pods");
    assert_eq!(Config::default().validate().unwrap_err().field, "pods");
    // Discovery instead of a static pod list is enough.
    let config = parse(r#"{"discovery": {"cluster": "disco", "path": "/pods"}}"#).unwrap();
    assert!(config.pods.is_empty());
    assert_eq!(config.discovery.unwrap().cluster, "disco");
}

#[test]
fn weights_must_sum_to_one() {
    let message = rejects(&with_pods(r#""weights": {"cache": 0.8}"#), "weights");
    assert!(message.contains("1.2"), "{message}");
    rejects(&with_pods(r#""weights": {"cache": 0.5}"#), "weights");
    rejects(&with_pods(r#""weights": {"cache": 0.6000011}"#), "weights");
    parse(&with_pods(r#""weights": {"cache": 0.6000009}"#)).expect("within 1e-6");
    // Each weight is in [0, 1], named individually.
    rejects(
        &with_pods(r#""weights": {"cache": 0.8, "load": -0.2}"#),
        "weights.load",
    );
    rejects(
        &with_pods(
            r#""weights": {"cache": 1.2, "load": 0, "queue": 0, "health": 0, "adapter": -0.2}"#,
        ),
        "weights.cache",
    );
    // Attribute scorer weights count towards the sum.
    let scorer = r#""attributeScorers": [{"name": "cost", "weight": 0.1, "attribute": "costPerHour", "prefer": "lower"}]"#;
    rejects(&with_pods(scorer), "weights");
    parse(&with_pods(&format!(
        r#"{scorer}, "weights": {{"cache": 0.5}}"#
    )))
    .expect("0.5+0.2+0.1+0.05+0.05+0.1 = 1");
}

#[test]
fn attribute_scorer_rules() {
    let make = |scorers: &str| {
        with_pods(&format!(
            r#""weights": {{"cache": 0.4}}, "attributeScorers": [{scorers}]"#
        ))
    };
    let ok = r#"{"name": "cost", "weight": 0.2, "attribute": "costPerHour", "prefer": "lower", "cacheMatchWindow": 0.2}"#;
    let config = parse(&make(ok)).unwrap();
    assert_eq!(config.attribute_scorers[0].cache_match_window, Some(0.2));
    rejects(
        &make(r#"{"name": "cost", "weight": 1.5, "attribute": "c", "prefer": "lower"}"#),
        "attributeScorers[0].weight",
    );
    rejects(
        &make(r#"{"name": "", "weight": 0.2, "attribute": "c", "prefer": "lower"}"#),
        "attributeScorers[0].name",
    );
    rejects(
        &make(
            r#"{"name": "x", "weight": 0.1, "attribute": "c", "prefer": "lower"}, {"name": "x", "weight": 0.1, "attribute": "d", "prefer": "higher"}"#,
        ),
        "attributeScorers[1].name",
    );
    rejects(
        &make(r#"{"name": "x", "weight": 0.2, "attribute": "", "prefer": "lower"}"#),
        "attributeScorers[0].attribute",
    );
    rejects(
        &make(
            r#"{"name": "x", "weight": 0.2, "attribute": "c", "prefer": "lower", "cacheMatchWindow": 2}"#,
        ),
        "attributeScorers[0].cacheMatchWindow",
    );
    // A missing required field is named with its path.
    rejects(
        &make(r#"{"name": "x", "weight": 0.2, "attribute": "c"}"#),
        "attributeScorers[0].prefer",
    );
}

#[test]
fn unknown_fields_are_named() {
    rejects(&with_pods(r#""cachWeight": 0.6"#), "cachWeight");
    rejects(&with_pods(r#""weights": {"cach": 0.6}"#), "weights.cach");
    rejects(
        r#"{"pods": [{"id": "a", "address": "127.0.0.1:1", "weight": 2}]}"#,
        "pods[0].weight",
    );
    rejects(
        &with_pods(r#""models": {"m": {"baseModel": "x", "lora": "y"}}"#),
        "models.m.lora",
    );
}

#[test]
fn every_numeric_rule_names_its_field() {
    rejects(&with_pods(r#""maxQueue": 0"#), "maxQueue");
    parse(&with_pods(r#""maxQueue": 1"#)).unwrap();
    rejects(
        &with_pods(r#""healthExclusionThreshold": 1.5"#),
        "healthExclusionThreshold",
    );
    rejects(
        &with_pods(r#""healthExclusionThreshold": -0.1"#),
        "healthExclusionThreshold",
    );
    rejects(&with_pods(r#""blockSizeBytes": 0"#), "blockSizeBytes");
    rejects(&with_pods(r#""blockSizeTokens": 0"#), "blockSizeTokens");
    rejects(&with_pods(r#""maxPrefixBlocks": 0"#), "maxPrefixBlocks");
    rejects(
        &with_pods(r#""podReportIntervalMs": 0"#),
        "podReportIntervalMs",
    );
    rejects(&with_pods(r#""reportTimeoutMs": 0"#), "reportTimeoutMs");
    assert!(parse(&with_pods("")).unwrap().report_long_poll);
    assert!(
        !parse(&with_pods(r#""reportLongPoll": false"#))
            .unwrap()
            .report_long_poll
    );
    rejects(&with_pods(r#""reportLongPoll": "no""#), "reportLongPoll");
    rejects(&with_pods(r#""podCapacityBlocks": 0"#), "podCapacityBlocks");
    rejects(&with_pods(r#""maxBodyBytes": 0"#), "maxBodyBytes");
    rejects(&with_pods(r#""coarseBlockFactor": 0"#), "coarseBlockFactor");
    // 64 bytes × 1024 = 64 KiB blocks are the longest.
    parse(&with_pods(r#""coarseBlockFactor": 1024"#)).unwrap();
    rejects(
        &with_pods(r#""coarseBlockFactor": 1025"#),
        "coarseBlockFactor",
    );
    rejects(&with_pods(r#""maxIndexBlocks": 2047"#), "maxIndexBlocks");
    parse(&with_pods(r#""maxIndexBlocks": 2048"#)).unwrap();
    // Bounded above (memory), and never an overflowing bucket count.
    rejects(
        &with_pods(r#""maxIndexBlocks": 34359738384"#),
        "maxIndexBlocks",
    );
    let largest = parse(&with_pods(r#""maxIndexBlocks": 16777216"#)).unwrap();
    assert_eq!(largest.snapshot_buckets(), 1 << 20);
    rejects(
        &with_pods(r#""routePaths": ["/v1/completions", "v1/chat"]"#),
        "routePaths[1]",
    );
    rejects(&with_pods(r#""reportCluster": """#), "reportCluster");
    rejects(&with_pods(r#""reportPath": "report""#), "reportPath");
    rejects(&with_pods(r#""metricsPath": "metrics""#), "metricsPath");
    parse(&with_pods(r#""metricsPath": "/metrics""#)).unwrap();
}

#[test]
fn pod_rules() {
    rejects(
        r#"{"pods": [{"id": "a", "address": "127.0.0.1:9001"}, {"id": "a", "address": "127.0.0.1:9002"}]}"#,
        "pods[1].id",
    );
    rejects(
        r#"{"pods": [{"id": "a", "address": "127.0.0.1:9001"}, {"id": "b", "address": "127.0.0.1:9001"}]}"#,
        "pods[1].address",
    );
    rejects(
        r#"{"pods": [{"id": "", "address": "127.0.0.1:9001"}]}"#,
        "pods[0].id",
    );
    let long = "x".repeat(256);
    rejects(
        &format!(r#"{{"pods": [{{"id": "{long}", "address": "127.0.0.1:9001"}}]}}"#),
        "pods[0].id",
    );
    for bad in [
        "localhost",
        "1.2.3.4:0",
        "host:99999",
        ":80",
        "host:",
        "ho st:80",
        "::1:80",
        "[zz]:80",
        "host:-1",
    ] {
        let message = rejects(
            &format!(
                r#"{{"pods": [{{"id": "a", "address": "10.0.0.1:1"}}, {{"id": "b", "address": "{bad}"}}]}}"#
            ),
            "pods[1].address",
        );
        assert!(
            message.contains(bad),
            "the message quotes the address: {message}"
        );
    }
    for good in ["[::1]:80", "1.2.3.4:65535", "[fd00::5]:8000"] {
        parse(&format!(
            r#"{{"pods": [{{"id": "a", "address": "{good}"}}]}}"#
        ))
        .unwrap_or_else(|e| panic!("{good} is a valid address: {e}"));
    }
    // Host names (and IP literals Envoy prints differently) never match an
    // override-host endpoint; an ORIGINAL_DST cluster never resolves a host
    // name either (Envoy counts original_dst_host_invalid and answers 503),
    // though it takes any IP literal.
    for name in [
        "localhost:8000",
        "vllm-0.vllm.svc.cluster.local:8000",
        "[::0001]:80",
    ] {
        let pods = format!(r#""pods": [{{"id": "a", "address": "{name}"}}]"#);
        let message = rejects(&format!("{{{pods}}}"), "pods[0].address");
        assert!(message.contains(name), "{message}");
    }
    for name in ["localhost:8000", "vllm-0.vllm.svc.cluster.local:8000"] {
        let pods = format!(r#""pods": [{{"id": "a", "address": "{name}"}}]"#);
        let message = rejects(
            &format!(r#"{{{pods}, "upstreamMode": "originalDst"}}"#),
            "pods[0].address",
        );
        assert!(message.contains("ORIGINAL_DST"), "{message}");
    }
    parse(r#"{"pods": [{"id": "a", "address": "[::0001]:80"}], "upstreamMode": "originalDst"}"#)
        .expect("ORIGINAL_DST takes any IP literal");
    // A sidecar's report address (e.g. kvroute-vllm-bridge) and a metrics
    // port are pulled through the ORIGINAL_DST report cluster: IP literals.
    let config = parse(
        r#"{"pods": [{"id": "a", "address": "10.0.0.1:8000", "reportAddress": "10.0.0.1:8081"}]}"#,
    )
    .expect("reportAddress");
    assert_eq!(
        config.pods[0].report_address.as_deref(),
        Some("10.0.0.1:8081")
    );
    for field in ["reportAddress", "metricsAddress"] {
        rejects(
            &format!(
                r#"{{"pods": [{{"id": "a", "address": "10.0.0.1:8000", "{field}": "vllm-0-bridge:8081"}}]}}"#
            ),
            &format!("pods[0].{field}"),
        );
    }
    rejects(
        &with_pods(
            r#""discovery": {"cluster": "kvroute_reports", "path": "/pods", "authority": "registry:80"}"#,
        ),
        "discovery.authority",
    );
    let message = rejects(
        r#"{"pods": [{"id": "a", "address": "10.0.0.1:8000", "reportAddress": "bridge"}]}"#,
        "pods[0].reportAddress",
    );
    assert!(message.contains("bridge"), "{message}");
    // Up to maxPods pods (default and ceiling 1,024).
    let many: Vec<String> = (0..1025)
        .map(|i| {
            format!(
                r#"{{"id": "p{i}", "address": "10.0.{}.{}:8000"}}"#,
                i / 200,
                i % 200
            )
        })
        .collect();
    let message = rejects(&format!(r#"{{"pods": [{}]}}"#, many.join(",")), "pods");
    assert!(
        message.contains("maxPods = 1024") && message.contains("got 1025"),
        "{message}"
    );
    let config = parse(&format!(r#"{{"pods": [{}]}}"#, many[..1024].join(",")))
        .expect("1,024 pods, the ceiling");
    assert_eq!((config.pods.len(), config.max_pods), (1024, 1024));
    let message = rejects(
        &format!(r#"{{"maxPods": 64, "pods": [{}]}}"#, many[..65].join(",")),
        "pods",
    );
    assert!(
        message.contains("maxPods = 64") && message.contains("got 65"),
        "{message}"
    );
    for max_pods in [0, 1025] {
        let message = rejects(&with_pods(&format!(r#""maxPods": {max_pods}"#)), "maxPods");
        assert!(message.contains("must be 1 to 1024"), "{message}");
    }
    // The candidate set of a large pool.
    for (json, field) in [
        (r#"{"holders": 0}"#, "candidates.holders"),
        (r#"{"sampled": 0}"#, "candidates.sampled"),
        (r#"{"exactUpTo": 1025}"#, "candidates.exactUpTo"),
        (r#"{"sample": 4}"#, "candidates.sample"),
    ] {
        rejects(&with_pods(&format!(r#""candidates": {json}"#)), field);
    }
    let config = parse(&with_pods(r#""candidates": {"exactUpTo": 1024}"#)).unwrap();
    assert_eq!(
        (
            config.candidates.exact_up_to,
            config.candidates.holders,
            config.candidates.sampled
        ),
        (1024, 8, 8)
    );
    // Attributes are numeric.
    let config = parse(
        r#"{"pods": [{"id": "a", "address": "10.0.0.1:1", "attributes": {"costPerHour": 2.5}}]}"#,
    )
    .unwrap();
    assert_eq!(config.pods[0].attributes["costPerHour"], 2.5);
}

#[test]
fn upstream_mode_and_passive_health() {
    let config = parse(&with_pods(
        r#""upstreamMode": "originalDst", "passiveHealth": {"ejectionMs": 250}"#,
    ))
    .unwrap();
    assert_eq!(config.upstream_mode, UpstreamMode::OriginalDst);
    assert_eq!(
        config.passive_health,
        PassiveHealthConfig {
            ejection_ms: 250,
            max_ejection_ms: 30_000
        }
    );
    rejects(&with_pods(r#""upstreamMode": "eds""#), "upstreamMode");
    rejects(
        &with_pods(r#""passiveHealth": {"ejectionMs": 0}"#),
        "passiveHealth.ejectionMs",
    );
    rejects(
        &with_pods(r#""passiveHealth": {"ejectionMs": 5000, "maxEjectionMs": 1000}"#),
        "passiveHealth.maxEjectionMs",
    );
    rejects(
        &with_pods(r#""passiveHealth": {"ejectMs": 5}"#),
        "passiveHealth.ejectMs",
    );
}

#[test]
fn no_eligible_pod_policy() {
    rejects(
        &with_pods(r#""onNoEligiblePod": "fallback""#),
        "fallbackPod",
    );
    rejects(
        &with_pods(r#""onNoEligiblePod": "fallback", "fallbackPod": "zz""#),
        "fallbackPod",
    );
    let config = parse(&with_pods(
        r#""onNoEligiblePod": "fallback", "fallbackPod": "b""#,
    ))
    .unwrap();
    assert_eq!(
        (config.on_no_eligible_pod, config.fallback_pod.as_deref()),
        (NoPodPolicy::Fallback, Some("b"))
    );
    let config = parse(&with_pods(
        r#""onBadRequest": "reject", "mode": "approximate", "logLevel": "debug""#,
    ))
    .unwrap();
    assert_eq!(config.on_bad_request, BadRequestPolicy::Reject);
    assert_eq!(config.mode, IndexMode::Approximate);
    assert_eq!(config.log_level, LogLevel::Debug);
}

#[test]
fn route_log_sampling_defaults_to_every_request() {
    assert_eq!(parse(&with_pods("")).unwrap().route_log_sample, 1);
    let config = parse(&with_pods(r#""routeLogSample": 100"#)).unwrap();
    assert_eq!(config.route_log_sample, 100);
    rejects(&with_pods(r#""routeLogSample": -1"#), "routeLogSample");
    rejects(&with_pods(r#""routeLogSample": 0.5"#), "routeLogSample");
}

#[test]
fn prediction_checks_default_to_one_answer_in_eight() {
    assert_eq!(parse(&with_pods("")).unwrap().prediction_check_sample, 8);
    let config = parse(&with_pods(r#""predictionCheckSample": 1"#)).unwrap();
    assert_eq!(config.prediction_check_sample, 1);
    rejects(
        &with_pods(r#""predictionCheckSample": -1"#),
        "predictionCheckSample",
    );
    rejects(
        &with_pods(r#""predictionCheckSample": "all""#),
        "predictionCheckSample",
    );
}

#[test]
fn waiting_in_the_gateway_is_bounded() {
    let config = parse(&with_pods(
        r#""onNoEligiblePod": "wait", "maxWaitingRequests": 8, "maxWaitMs": 500"#,
    ))
    .unwrap();
    assert_eq!(
        (
            config.on_no_eligible_pod,
            config.max_waiting_requests,
            config.max_wait_ms
        ),
        (NoPodPolicy::Wait, 8, 500)
    );
    let reject = parse(&with_pods(r#""onNoEligiblePod": "reject""#)).unwrap();
    assert_eq!(reject.on_no_eligible_pod, NoPodPolicy::Reject);
    // Past the wait's limits a request goes to a pod unless told to 503.
    assert_eq!(config.on_wait_limit, WaitLimitPolicy::Route);
    let shed = parse(&with_pods(r#""onWaitLimit": "reject""#)).unwrap();
    assert_eq!(shed.on_wait_limit, WaitLimitPolicy::Reject);
    rejects(&with_pods(r#""onWaitLimit": "drop""#), "onWaitLimit");
    rejects(
        &with_pods(r#""maxWaitingRequests": 0"#),
        "maxWaitingRequests",
    );
    rejects(&with_pods(r#""maxWaitMs": 0"#), "maxWaitMs");
    // Holding out defaults to two thirds of the deadline.
    assert_eq!(config.affinity_wait_bound_ms(), 333);
    let affine = parse(&with_pods(r#""affinityWaitMs": 0, "affinityWindow": 1"#)).unwrap();
    assert_eq!(
        (affine.affinity_wait_bound_ms(), affine.affinity_window),
        (0, 1)
    );
    rejects(&with_pods(r#""affinityWindow": 0"#), "affinityWindow");
    // Holding out must end before the deadline.
    rejects(
        &with_pods(r#""maxWaitMs": 20000, "affinityWaitMs": 20000"#),
        "affinityWaitMs",
    );
}

#[test]
fn malformed_json_and_type_errors_are_rejected() {
    rejects("{", "<configuration>");
    rejects("42", "<configuration>");
    rejects(r#""pods""#, "<configuration>");
    // Type errors name the field's path.
    let err = parse(&with_pods(r#""maxQueue": "twenty""#)).unwrap_err();
    assert_eq!(err.field, "maxQueue", "{err}");
    let err = parse(&with_pods(r#""weights": {"cache": "high"}"#)).unwrap_err();
    assert_eq!(err.field, "weights.cache", "{err}");
    let err = parse(&with_pods(r#""mode": "exact""#)).unwrap_err();
    assert_eq!(err.field, "mode", "{err}");
    assert!(err.rule.contains("exact"), "{err}");
    // A JSON array is not an object, even though serde could read it as one.
    rejects("[]", "<configuration>");
    assert_eq!(Config::parse(b"\xff").unwrap_err().field, "<configuration>");
}

const CUSTOMER_SUPPORT: &str = r#"{
    "pods": [{"id": "a", "address": "127.0.0.1:9001"}],
    "models": {
        "customer-support-v3": {"baseModel": "llama-3-8b"},
        "customer-support-v3-enterprise": {"baseModel": "llama-3-8b", "adapter": "enterprise-lora"},
        "customer-support-v3-billing": {"baseModel": "llama-3-8b", "adapter": "billing-lora"},
        "enterprise-alias": {"baseModel": "llama-3-8b", "adapter": "enterprise-lora"},
        "llama-3-8b": {"baseModel": "llama-3-8b"}
    }
}"#;

fn target(base: &str, adapter: Option<&str>) -> ModelTarget {
    ModelTarget {
        base_model: base.into(),
        adapter: adapter.map(str::to_string),
    }
}

#[test]
fn customer_support_models_resolve() {
    let config = parse(CUSTOMER_SUPPORT).expect("the example is valid");
    assert_eq!(
        config.resolve_model("customer-support-v3"),
        Some(target("llama-3-8b", None))
    );
    assert_eq!(
        config.resolve_model("customer-support-v3-enterprise"),
        Some(target("llama-3-8b", Some("enterprise-lora")))
    );
    assert_eq!(
        config.resolve_model("customer-support-v3-billing"),
        Some(target("llama-3-8b", Some("billing-lora")))
    );
    assert_eq!(
        config.resolve_model("customer-support-v4"),
        None,
        "unknown when models are configured"
    );
    // Without a model map every name is its own base model.
    let plain = parse(&with_pods("")).unwrap();
    assert_eq!(
        plain.resolve_model("anything"),
        Some(target("anything", None))
    );
    // An empty base model is rejected, naming the model.
    rejects(
        &with_pods(r#""models": {"m": {"baseModel": ""}}"#),
        "models.m.baseModel",
    );
    rejects(
        &with_pods(r#""models": {"m": {"adapter": "x"}}"#),
        "models.m.baseModel",
    );
}

#[test]
fn chains_separate_adapters_and_share_aliases() {
    let config = parse(CUSTOMER_SUPPORT).unwrap();
    let hasher = BlockHasher::from_config(&config);
    let text: Vec<u8> = (0..1024u32)
        .map(|i| b"You are a helpful support agent. "[i as usize % 33])
        .collect();
    let prompt = Prompt::Text(text);
    let chain = |model: &str| hasher.chain(&config.resolve_model(model).unwrap(), &prompt, None);
    let base = chain("customer-support-v3");
    let enterprise = chain("customer-support-v3-enterprise");
    let billing = chain("customer-support-v3-billing");
    assert_eq!(base.len(), 16, "1024 bytes / 64-byte blocks");
    // Base model and each adapter never share a block.
    for (x, y) in [
        (&base, &enterprise),
        (&base, &billing),
        (&enterprise, &billing),
    ] {
        assert!(
            x.iter().all(|h| !y.contains(h)),
            "chains of different targets share a block"
        );
    }
    // Two client names for the same base + adapter share the whole chain.
    assert_eq!(chain("enterprise-alias"), enterprise);
    assert_eq!(chain("llama-3-8b"), base);
    // The secret seed separates deployments.
    let mut seeded = config.clone();
    seeded.hash_seed = "s3cret".into();
    let other = BlockHasher::from_config(&seeded).chain(&target("llama-3-8b", None), &prompt, None);
    assert!(other.iter().all(|h| !base.contains(h)));
    // Token prompts: 16-token blocks.
    let tokens = Prompt::Tokens((0..100).collect());
    assert_eq!(
        hasher
            .chain(&target("llama-3-8b", None), &tokens, None)
            .len(),
        6
    );
    // A 64-byte text block counts as 16 tokens; a token block is 16 tokens.
    assert_eq!(hasher.coverage(&prompt).tokens(1), 16);
    assert_eq!(hasher.coverage(&tokens).tokens(6), 96);
}

#[test]
fn membership_names_the_serving_cluster_and_stands_alone() {
    let config = parse(r#"{"membership": {"cluster": "kvroute_pods", "reportPort": 8081}}"#)
        .expect("membership instead of pods");
    let membership = config.membership.unwrap();
    assert_eq!(
        (
            membership.cluster.as_str(),
            membership.admin_cluster.as_str()
        ),
        ("kvroute_pods", "kvroute_admin")
    );
    assert_eq!(
        (membership.report_port, membership.metrics_port),
        (Some(8081), None)
    );
    rejects(r#"{"membership": {}}"#, "membership.cluster");
    rejects(r#"{"membership": {"cluster": ""}}"#, "membership.cluster");
    rejects(
        r#"{"membership": {"cluster": "p", "adminCluster": ""}}"#,
        "membership.adminCluster",
    );
    rejects(
        r#"{"membership": {"cluster": "p", "reportPort": 0}}"#,
        "membership.reportPort",
    );
    rejects(
        r#"{"membership": {"cluster": "p", "metricsPort": 70000}}"#,
        "membership.metricsPort",
    );
    let message = rejects(
        r#"{"membership": {"cluster": "p", "reportpath": "/r"}}"#,
        "membership.reportpath",
    );
    assert!(message.contains("unknown field"), "{message}");
    let message = rejects(
        &with_pods(r#""membership": {"cluster": "p"}"#),
        "membership",
    );
    assert!(message.contains("`pods`"), "{message}");
    let message = rejects(
        r#"{"membership": {"cluster": "p"}, "discovery": {"cluster": "d", "path": "/pods"}}"#,
        "membership",
    );
    assert!(message.contains("`discovery`"), "{message}");
}

#[test]
fn replicas_name_their_peers_and_a_long_secret() {
    const SECRET: &str = "0123456789abcdef0123456789abcdef";
    let config = parse(&with_pods(&format!(
        r#""replicas": {{"peers": ["10.0.0.1:9902", "10.0.0.2:9902"], "secret": "{SECRET}"}}"#
    )))
    .expect("static peers");
    let replicas = config.replicas.expect("replicas");
    assert_eq!(replicas.path, "/kvroute/v1/replica");
    assert_eq!(replicas.admin_cluster, "kvroute_admin");
    let config = parse(&with_pods(&format!(
        r#""replicas": {{"cluster": "kvroute_replicas", "secret": "{SECRET}"}}"#
    )))
    .expect("a cluster of replicas");
    assert_eq!(
        config.replicas.and_then(|r| r.cluster).as_deref(),
        Some("kvroute_replicas")
    );
    rejects(
        &with_pods(&format!(r#""replicas": {{"secret": "{SECRET}"}}"#)),
        "replicas",
    );
    rejects(
        &with_pods(&format!(
            r#""replicas": {{"peers": ["10.0.0.1:9902"], "cluster": "r", "secret": "{SECRET}"}}"#
        )),
        "replicas.cluster",
    );
    rejects(
        &with_pods(&format!(
            r#""replicas": {{"peers": ["gateway-0:9902"], "secret": "{SECRET}"}}"#
        )),
        "replicas.peers[0]",
    );
    let short = rejects(
        &with_pods(r#""replicas": {"peers": ["10.0.0.1:9902"], "secret": "short"}"#),
        "replicas.secret",
    );
    assert!(short.contains("at least 32"), "{short}");
    rejects(
        &with_pods(r#""replicas": {"peers": ["10.0.0.1:9902"]}"#),
        "replicas.secret",
    );
    rejects(
        &with_pods(&format!(
            r#""replicas": {{"peers": ["10.0.0.1:9902"], "secret": "{SECRET}", "path": "log"}}"#
        )),
        "replicas.path",
    );
    let many: Vec<String> = (0..65).map(|i| format!("\"10.0.1.{i}:9902\"")).collect();
    rejects(
        &with_pods(&format!(
            r#""replicas": {{"peers": [{}], "secret": "{SECRET}"}}"#,
            many.join(",")
        )),
        "replicas.peers",
    );
}

#[test]
fn a_metrics_address_is_an_ip_and_port() {
    let config = parse(
        r#"{"pods": [{"id": "a", "address": "10.0.0.1:8000", "metricsAddress": "10.0.0.1:9090"}]}"#,
    )
    .expect("metricsAddress");
    assert_eq!(
        config.pods[0].metrics_address.as_deref(),
        Some("10.0.0.1:9090")
    );
    rejects(
        r#"{"pods": [{"id": "a", "address": "10.0.0.1:8000", "metricsAddress": "10.0.0.1"}]}"#,
        "pods[0].metricsAddress",
    );
}

#[test]
fn chat_templates_belong_to_a_base_model_and_compile() {
    let models = r#""models": {"chat": {"baseModel": "llama-3-8b"}, "billing": {"baseModel": "llama-3-8b", "adapter": "b"}}"#;
    let config = parse(&with_pods(&format!(
        r#"{models}, "chatTemplates": {{"llama-3-8b": {{"template": "{{{{ bos_token }}}}{{% for m in messages %}}{{{{ m.content }}}}{{% endfor %}}", "bosToken": "<s>", "completionPrefix": "<s>"}}}}"#
    )))
    .expect("a template of a configured base model");
    let entry = &config.chat_templates["llama-3-8b"];
    assert_eq!(
        (
            entry.bos_token.as_deref(),
            entry.eos_token.as_deref(),
            entry.completion_prefix.as_str(),
            entry.content_format
        ),
        (Some("<s>"), None, "<s>", None)
    );
    assert!(parse(&with_pods("")).unwrap().chat_templates.is_empty());
    // Without `models`, every requested name is its own base model.
    parse(&with_pods(
        r#""chatTemplates": {"any-name": {"template": "x"}}"#,
    ))
    .expect("any base model name");

    let message = rejects(
        &with_pods(&format!(
            r#"{models}, "chatTemplates": {{"chat": {{"template": "x"}}}}"#
        )),
        "chatTemplates.chat",
    );
    assert!(message.contains("baseModel"), "{message}");
    let message = rejects(
        &with_pods(
            r#""chatTemplates": {"m": {"template": "line 1\n{% for m in messages %}\n{{ m.content }"}}"#,
        ),
        "chatTemplates.m.template",
    );
    assert!(
        message.contains("does not compile: syntax error") && message.contains("(template line 3)"),
        "{message}"
    );
    rejects(
        &with_pods(r#""chatTemplates": {"m": {"template": "x", "bosTokn": "<s>"}}"#),
        "chatTemplates.m.bosTokn",
    );
    rejects(
        &with_pods(r#""chatTemplates": {"m": {}}"#),
        "chatTemplates.m.template",
    );
    let message = rejects(
        &with_pods(r#""chatTemplates": {"m": {"template": "x", "contentFormat": "parts"}}"#),
        "chatTemplates.m.contentFormat",
    );
    assert!(message.contains("parts"), "{message}");
}

#[test]
fn balance_is_the_ttft_model_with_three_parameters() {
    let config = parse(&with_pods("")).unwrap();
    assert!(config.balance.enabled);
    assert_eq!(config.balance.learning_window, 64);
    let set = parse(&with_pods(
        r#""balance": {"enabled": false, "learningWindow": 16}"#,
    ))
    .unwrap();
    assert_eq!(
        (set.balance.enabled, set.balance.learning_window),
        (false, 16)
    );
    rejects(
        &with_pods(r#""balance": {"learningWindow": 0}"#),
        "balance.learningWindow",
    );
    rejects(
        &with_pods(r#""balance": {"learningWindow": 65537}"#),
        "balance.learningWindow",
    );
    // SLO mode: one target, or one per model.
    assert_eq!(config.balance.ttft_target_ms, None);
    let all = parse(&with_pods(r#""balance": {"ttftTargetMs": 500}"#)).unwrap();
    let all = all.balance.ttft_target_ms.unwrap();
    assert_eq!(
        (all.of("chat"), all.of("other")),
        (Some(500.0), Some(500.0))
    );
    let per_model = parse(&with_pods(
        r#""balance": {"ttftTargetMs": {"chat": 300, "batch": 5000}}"#,
    ))
    .unwrap();
    let per_model = per_model.balance.ttft_target_ms.unwrap();
    assert_eq!(
        (per_model.of("chat"), per_model.of("other")),
        (Some(300.0), None)
    );
    rejects(
        &with_pods(r#""balance": {"ttftTargetMs": 0}"#),
        "balance.ttftTargetMs",
    );
    rejects(
        &with_pods(r#""balance": {"ttftTargetMs": {"chat": -1}}"#),
        "balance.ttftTargetMs.chat",
    );
}

#[test]
fn every_removed_balance_key_is_refused_naming_its_replacement() {
    for key in [
        "absThreshold",
        "relThreshold",
        "shareWindow",
        "maxShare",
        "spillTokens",
        "busyAverageDecisions",
        "prefillSlackTokens",
        "prefillRatio",
    ] {
        let message = rejects(
            &with_pods(&format!(r#""balance": {{"{key}": 1}}"#)),
            &format!("balance.{key}"),
        );
        assert!(message.contains("was removed"), "{message}");
        assert!(message.contains("balance.enabled"), "{message}");
    }
    // Even `null`, which turned the prefill guard off.
    rejects(
        &with_pods(r#""balance": {"prefillSlackTokens": null}"#),
        "balance.prefillSlackTokens",
    );
}

#[test]
fn tier_credits_default_from_reload_costs_and_must_be_ordered_in_unit_range() {
    let config = parse(&with_pods("")).unwrap();
    assert_eq!(
        (config.tier_credits.cpu, config.tier_credits.disk),
        (0.9, 0.5)
    );
    let blind = parse(&with_pods(r#""tierCredits": {"cpu": 1.0, "disk": 1.0}"#)).unwrap();
    assert_eq!(blind.tier_credits, TierCredits::BLIND);
    let partial = parse(&with_pods(r#""tierCredits": {"disk": 0.2}"#)).unwrap();
    assert_eq!(
        (partial.tier_credits.cpu, partial.tier_credits.disk),
        (0.9, 0.2)
    );
    rejects(
        &with_pods(r#""tierCredits": {"cpu": 1.5}"#),
        "tierCredits.cpu",
    );
    rejects(
        &with_pods(r#""tierCredits": {"disk": -0.1}"#),
        "tierCredits.disk",
    );
    let message = rejects(
        &with_pods(r#""tierCredits": {"cpu": 0.4, "disk": 0.6}"#),
        "tierCredits.disk",
    );
    assert!(message.contains("at most tierCredits.cpu"), "{message}");
    rejects(
        &with_pods(r#""tierCredits": {"gpu": 1.0}"#),
        "tierCredits.gpu",
    );
}
