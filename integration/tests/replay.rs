//! `kvroute-replay` end to end on small traces generated here: determinism,
//! bad input, kvroute vs round robin, and the Mooncake → OpenAI body path
//! the real-Envoy benchmark uses.

use std::path::PathBuf;

use clap::Parser;
use kvroute_integration::replay::{self, Policy, ReplayArgs, Workload};
use kvroute_integration::trace::{self, TraceRequest};

/// A scratch directory removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("kvroute-replay-test-{}-{test}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A shared-prefix workload: 12 "system prompts" of 6 blocks, each with
/// several conversations that grow by a block per turn, interleaved.
fn synthetic_trace(requests: usize) -> Vec<TraceRequest> {
    let mut out = Vec::new();
    let mut conversations: Vec<Vec<u64>> = (0..36)
        .map(|c| (0..6).map(|b| (c % 12) as u64 * 100 + b).collect())
        .collect();
    let mut state = 0x1234_5678u64;
    for i in 0..requests {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let c = (state % conversations.len() as u64) as usize;
        let ids = &mut conversations[c];
        ids.push(10_000 + i as u64);
        if ids.len() > 14 {
            ids.truncate(6); // a new conversation under the same system prompt
        }
        out.push(TraceRequest {
            line: i + 1,
            timestamp_ms: i as f64 * 40.0,
            input_length: ids.len() as u64 * 512 - 37,
            output_length: 1 + state % 40,
            hash_ids: ids.clone(),
        });
    }
    out
}

fn mooncake_jsonl(requests: &[TraceRequest]) -> String {
    requests
        .iter()
        .map(|r| {
            format!(
                "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": {}, \"hash_ids\": {:?}}}\n",
                r.timestamp_ms, r.input_length, r.output_length, r.hash_ids
            )
        })
        .collect()
}

fn args(extra: &[&str]) -> ReplayArgs {
    let mut all = vec!["kvroute-replay"];
    all.extend_from_slice(extra);
    ReplayArgs::try_parse_from(all).expect("arguments parse")
}

#[test]
fn same_trace_and_seed_give_the_same_numbers() {
    let scratch = Scratch::new("determinism");
    let path = scratch.file("determinism.jsonl", &mooncake_jsonl(&synthetic_trace(400)));
    let path = path.to_str().unwrap();
    let run = |jobs: &str| {
        let a = args(&[
            "--trace",
            path,
            "--pods",
            "4",
            "--speedup",
            "3",
            "--report-interval-ms",
            "500",
            "--sweep",
            "w_cache=0.5:0.7:0.1,maxQueue=4,20",
            "--jobs",
            jobs,
        ]);
        let mut sink = Vec::new();
        let report = replay::run(&a, &mut sink).expect("replay runs");
        replay::results_json(&a, &report)
    };
    let first = run("1");
    assert_eq!(first, run("1"));
    assert_eq!(first, run("2"), "the sweep's threads do not change results");
    assert_eq!(first["requests"], 400);
    assert_eq!(first["policies"].as_array().unwrap().len(), 5);
    assert_eq!(first["sweep"]["points"].as_array().unwrap().len(), 6);
    let random = |seed: &str| {
        let a = args(&[
            "--trace",
            path,
            "--pods",
            "4",
            "--policies",
            "random",
            "--seed",
            seed,
        ]);
        replay::results_json(&a, &replay::run(&a, &mut Vec::new()).unwrap())["policies"][0]
            ["podShares"]
            .clone()
    };
    assert_eq!(random("7"), random("7"));
    assert_ne!(
        random("7"),
        random("8"),
        "the seed drives the random baseline"
    );
}

#[test]
fn a_malformed_line_names_its_line_and_field() {
    let mut text = mooncake_jsonl(&synthetic_trace(5));
    text.push_str("{\"timestamp\": 900, \"input_length\": \"lots\", \"output_length\": 3, \"hash_ids\": [1]}\n");
    let scratch = Scratch::new("bad");
    let path = scratch.file("bad.jsonl", &text);
    let err = replay::run(&args(&["--trace", path.to_str().unwrap()]), &mut Vec::new())
        .expect_err("a bad line is an error, not dropped");
    assert!(
        err.contains("line 6") && err.contains("input_length"),
        "{err}"
    );

    let text = "{\"timestamp\": 0, \"body\": {\"model\": \"m\", \"prompt\": \"hi\"}}\n{\"timestamp\": 1, \"body\": {\"model\": \"m\"}}\n";
    let path = scratch.file("bad-openai.jsonl", text);
    let err = replay::run(
        &args(&["--trace", path.to_str().unwrap(), "--format", "openai"]),
        &mut Vec::new(),
    )
    .expect_err("a body without a prompt is an error");
    assert!(err.contains("line 2") && err.contains("prompt"), "{err}");

    let err = replay::run(
        &args(&["--trace", "/nonexistent/trace.jsonl"]),
        &mut Vec::new(),
    )
    .expect_err("a missing file is an error");
    assert!(err.contains("/nonexistent/trace.jsonl"), "{err}");
}

#[test]
fn kvroute_beats_round_robin_on_hit_rate() {
    let scratch = Scratch::new("shared-prefix");
    let path = scratch.file(
        "shared-prefix.jsonl",
        &mooncake_jsonl(&synthetic_trace(600)),
    );
    let a = args(&[
        "--trace",
        path.to_str().unwrap(),
        "--pods",
        "4",
        // Pods fast enough for 25 req/s of up to 7k-token prompts (~70% of
        // the cache-blind prefill capacity), not overloaded.
        "--time-scale",
        "0.1",
        "--policies",
        "kvroute,round_robin",
    ]);
    let report = replay::run(&a, &mut Vec::new()).unwrap();
    let hit = |p: Policy| {
        report
            .runs
            .iter()
            .find(|r| r.policy == p)
            .unwrap()
            .summary
            .hit_rate
    };
    let (kvroute, round_robin) = (hit(Policy::Kvroute), hit(Policy::RoundRobin));
    assert!(
        kvroute > round_robin + 0.1,
        "kvroute {kvroute:.3} vs round robin {round_robin:.3}"
    );
    assert!(kvroute <= report.infinite_bound + 1e-9);
    assert!(report.pooled_bound <= report.infinite_bound + 1e-9);
    assert!(report.markdown.contains("| kvroute |"));
}

/// The OpenAI bodies `trace::completions_body` builds (what the real-Envoy
/// benchmark sends) replay to exactly the same chains and numbers as the
/// Mooncake trace itself.
#[test]
fn openai_bodies_replay_like_the_mooncake_trace() {
    let requests = synthetic_trace(120);
    let scratch = Scratch::new("agree");
    let mooncake = scratch.file("agree.jsonl", &mooncake_jsonl(&requests));
    let openai_path = scratch.0.join("agree-openai.jsonl");
    let base = ["--pods", "3", "--block-tokens", "128"];
    let mut a = vec![
        "--trace",
        mooncake.to_str().unwrap(),
        "--emit-openai",
        openai_path.to_str().unwrap(),
    ];
    a.extend_from_slice(&base);
    let from_mooncake = replay::run(&args(&a), &mut Vec::new()).unwrap();
    let mut b = vec![
        "--trace",
        openai_path.to_str().unwrap(),
        "--format",
        "openai",
    ];
    b.extend_from_slice(&base);
    let from_openai = replay::run(&args(&b), &mut Vec::new()).unwrap();
    assert_eq!(from_mooncake.unique_blocks, from_openai.unique_blocks);
    for (x, y) in from_mooncake.runs.iter().zip(&from_openai.runs) {
        if x.policy == Policy::RingHash {
            continue; // keyed by hash id vs first block hash
        }
        assert_eq!(x.summary, y.summary, "{}", x.policy.name());
    }
    let config = replay::router_config(&args(&[
        "--trace",
        "unused",
        "--pods",
        "3",
        "--block-tokens",
        "128",
    ]))
    .unwrap();
    let text = std::fs::read_to_string(&openai_path).unwrap();
    let w1 = Workload::from_mooncake(&requests, &config, "mooncake", 1.0);
    let w2 = Workload::from_openai(&text, &config, 1.0).unwrap();
    for (x, y) in w1.requests.iter().zip(&w2.requests) {
        assert_eq!(
            (&x.chain, x.prompt_tokens, x.output_tokens),
            (&y.chain, y.prompt_tokens, y.output_tokens)
        );
    }
    assert_eq!(
        trace::prompt_text(&requests[0]).len(),
        requests[0].input_length as usize * 4
    );
}

/// A pool of 256 pods (past the 64 of the old ceiling, and past the
/// candidate set's `exactUpTo`), with the trace replicated so each pod
/// sees the load of a 4-pod run: kvroute still finds the holders (a hit
/// rate far above round robin's) and copies share no prefix.
#[test]
fn a_replicated_trace_replays_over_a_thousand_pods() {
    let scratch = Scratch::new("replicated");
    let trace = synthetic_trace(100);
    let path = scratch.file("replicated.jsonl", &mooncake_jsonl(&trace));
    let a = args(&[
        "--trace",
        path.to_str().unwrap(),
        "--pods",
        "256",
        "--replicate",
        "64",
        "--time-scale",
        "0.1",
        "--policies",
        "kvroute,round_robin",
    ]);
    let report = replay::run(&a, &mut Vec::new()).unwrap();
    assert_eq!(report.requests, 100 * 64);
    let single = replay::run(
        &args(&[
            "--trace",
            path.to_str().unwrap(),
            "--pods",
            "4",
            "--policies",
            "round_robin",
        ]),
        &mut Vec::new(),
    )
    .unwrap();
    assert_eq!(
        report.unique_blocks,
        64 * single.unique_blocks,
        "copies share nothing"
    );
    let summary = |p: Policy| &report.runs.iter().find(|r| r.policy == p).unwrap().summary;
    let (kvroute, round_robin) = (summary(Policy::Kvroute), summary(Policy::RoundRobin));
    assert!(
        kvroute.hit_rate > round_robin.hit_rate + 0.1,
        "kvroute {:.3} vs round robin {:.3}",
        kvroute.hit_rate,
        round_robin.hit_rate
    );
    assert_eq!(kvroute.pod_shares.len(), 256);
    assert!(
        kvroute.pod_shares.iter().filter(|&&s| s > 0.0).count() > 230,
        "the pool is used"
    );
}

/// What a user's what-if replays is what the proxy runs: without
/// `--config`, the replay's router configuration is the filter's default
/// in every field but the simulated pods, the pods' cache size and (for
/// a Mooncake trace, one hash id a block) the block size.
#[test]
fn replay_defaults_are_the_filters_defaults() {
    use kvroute::config::{Config, NoPodPolicy};
    let filter = Config::default();
    for (format, block_tokens) in [("azure", 16), ("openai", 16), ("mooncake", 512)] {
        let replayed =
            replay::router_config(&args(&["--trace", "unused", "--format", format])).unwrap();
        assert_eq!(replayed.on_no_eligible_pod, NoPodPolicy::Wait, "{format}");
        assert_eq!(replayed.balance, filter.balance, "{format}");
        assert_eq!(replayed.block_size_tokens, block_tokens, "{format}");
        let comparable = Config {
            pods: filter.pods.clone(),
            block_size_tokens: filter.block_size_tokens,
            block_size_bytes: filter.block_size_bytes,
            ..replayed
        };
        assert_eq!(comparable, filter, "{format}: a default differs");
    }
    // `--on-no-eligible-pod` still overrides it, and a `--config` value
    // is kept when the flag is absent.
    let reject = replay::router_config(&args(&[
        "--trace",
        "unused",
        "--on-no-eligible-pod",
        "reject",
    ]))
    .unwrap();
    assert_eq!(reject.on_no_eligible_pod, NoPodPolicy::Reject);
    let scratch = Scratch::new("defaults");
    let config = scratch.file("config.json", r#"{"onNoEligiblePod": "reject"}"#);
    let from_file = replay::router_config(&args(&[
        "--trace",
        "unused",
        "--config",
        config.to_str().unwrap(),
    ]))
    .unwrap();
    assert_eq!(from_file.on_no_eligible_pod, NoPodPolicy::Reject);
}

/// The Azure trace's conversations replay the same through their OpenAI
/// token-prompt bodies (`--emit-openai`), and kvroute, which follows
/// them, holds the pooled bound's hits where round robin cannot.
#[test]
fn azure_conversations_replay_through_their_openai_bodies() {
    let mut csv = String::from("TIMESTAMP,ContextTokens,GeneratedTokens\n");
    for i in 0..240u64 {
        // 24 users, each turn adding its answer and a new message.
        let turn = i / 24;
        let context = 300 + turn * 250 + (i % 24) * 3;
        let seconds = i as f64 * 0.25;
        csv.push_str(&format!(
            "2023-11-16 18:{:02}:{:010.7},{context},{}\n",
            15 + (seconds as u64) / 60,
            seconds % 60.0,
            120 + i % 5
        ));
    }
    let scratch = Scratch::new("azure");
    let trace = scratch.file("azure.csv", &csv);
    let openai = scratch.0.join("azure-openai.jsonl");
    let base = ["--pods", "3", "--policies", "kvroute,round_robin"];
    let mut a = vec![
        "--trace",
        trace.to_str().unwrap(),
        "--format",
        "azure",
        "--emit-openai",
        openai.to_str().unwrap(),
    ];
    a.extend_from_slice(&base);
    let from_csv = replay::run(&args(&a), &mut Vec::new()).unwrap();
    let mut b = vec!["--trace", openai.to_str().unwrap(), "--format", "openai"];
    b.extend_from_slice(&base);
    let from_openai = replay::run(&args(&b), &mut Vec::new()).unwrap();
    assert_eq!(from_csv.requests, 240);
    for (x, y) in from_csv.runs.iter().zip(&from_openai.runs) {
        assert_eq!(x.summary, y.summary, "{}", x.policy.name());
    }
    let hit = |policy: usize| from_csv.runs[policy].summary.hit_rate;
    assert!(from_csv.pooled_bound > 0.5, "{}", from_csv.pooled_bound);
    assert!(hit(0) >= 0.95 * from_csv.pooled_bound, "kvroute {}", hit(0));
    assert!(hit(1) < 0.8 * hit(0), "round robin {}", hit(1));
}

#[test]
fn a_bench_workload_replay_writes_its_per_request_csv() {
    let scratch = Scratch::new("bench-out");
    let out = scratch.0.join("out");
    let out_arg = out.to_str().unwrap();
    let report = replay::run(
        &args(&[
            "--trace",
            "unused",
            "--bench-workload",
            "shared-prefix",
            "--pods",
            "4",
            "--policies",
            "kvroute",
            "--out",
            out_arg,
        ]),
        &mut Vec::new(),
    )
    .unwrap();
    let csv = std::fs::read_to_string(out.join("requests-kvroute.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert_eq!(rows.len(), report.requests);
    // Once the model is calibrated each request carries its prediction
    // and the work it counted.
    for row in rows.iter().rev().take(10) {
        let fields: Vec<&str> = row.split(',').collect();
        assert_eq!(fields.len(), 13, "{row}");
        assert!(fields[10].parse::<f64>().is_ok_and(|ms| ms > 0.0), "{row}");
        assert!(fields[12].parse::<u64>().is_ok(), "{row}");
    }
    // Each row names its session: the workload's conversations, each over
    // several requests.
    let sessions: std::collections::HashSet<&str> = rows
        .iter()
        .map(|row| row.split(',').nth(1).unwrap())
        .collect();
    assert!(sessions.iter().all(|s| u64::from_str_radix(s, 16).is_ok()));
    assert!(
        sessions.len() > 1 && sessions.len() < rows.len() / 2,
        "{}",
        sessions.len()
    );
    assert!(out.join("results.json").exists());
}
