//! `make run`: 4 simulated vLLM pods and Envoy with kvroute on
//! 127.0.0.1:10000 (admin 127.0.0.1:9901), a multi-turn demo workload
//! through it, a per-pod table, the same workload under round robin on 4
//! fresh pods for comparison, then serving until Ctrl-C.
//!
//! The conversations run concurrently, each user sending a turn when the
//! last answer arrived and a short read, each turn adding a 2,048-token
//! document: a closed loop that keeps the pods' prefill engines about 60 %
//! busy when spread evenly and overloads any two of them, so that where a
//! request goes decides how long it waits. One request at a time would put every turn on the pod caching
//! the system prompt, which no pod's queue would ever argue against.

use std::path::{Path, PathBuf};

use kvroute_integration::harness::{filler_text, Cluster, ClusterSpec, Sim};
use kvroute_integration::http;
use serde_json::{json, Value};

const USERS: usize = 16;
const TURNS: usize = 5;
const TIME_SCALE: &str = "0.1";
/// A user reads an answer this long before the next turn.
const READ_MS: u64 = 150;

fn sim_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.with_file_name("kvroute-sim")
}

fn config() -> Value {
    json!({
        "podReportIntervalMs": 500,
        "decisionHeaders": true,
        "models": {"sim-model": {"baseModel": "sim-model"}}
    })
}

/// Runs the multi-turn workload: every user at once, each turn a chat
/// request with the shared system prompt and the user's whole history,
/// sent by `send` (from one thread per user).
fn workload(send: impl Fn(&Value) -> Value + Sync) {
    let system = filler_text(
        "You are the support assistant for the ACME cloud; policies",
        3072,
    );
    std::thread::scope(|scope| {
        for user in 0..USERS {
            let (send, system) = (&send, &system);
            scope.spawn(move || {
                // Users arrive over the first second.
                std::thread::sleep(std::time::Duration::from_millis(user as u64 * 60));
                let mut history = vec![
                    json!({"role": "system", "content": system}),
                    json!({"role": "user", "content": filler_text(&format!("customer {user} describes the incident"), 1536)}),
                ];
                for turn in 0..TURNS {
                    let body = json!({"model": "sim-model", "messages": history, "max_tokens": 32});
                    let answer = send(&body)["choices"][0]["message"]["content"].clone();
                    history.push(json!({"role": "assistant", "content": answer}));
                    history.push(json!({"role": "user", "content": filler_text(&format!("customer {user} follow-up {turn}"), 8192)}));
                    std::thread::sleep(std::time::Duration::from_millis(READ_MS));
                }
            });
        }
    });
}

fn post(addr: &str, body: &Value) -> Value {
    let response =
        http::post_json(addr, "/v1/chat/completions", &body.to_string()).expect("request");
    assert_eq!(response.status, 200, "{}", response.body);
    response.json().expect("JSON response")
}

struct PodRow {
    id: String,
    requests: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
    ttft_ms_sum: f64,
}

fn row(sim: &Sim) -> PodRow {
    let stats = sim.stats();
    PodRow {
        id: sim.id.clone(),
        requests: stats["requests"].as_u64().unwrap_or(0),
        prompt_tokens: stats["promptTokens"].as_u64().unwrap_or(0),
        cached_tokens: stats["cachedTokens"].as_u64().unwrap_or(0),
        ttft_ms_sum: stats["ttftMsSum"].as_f64().unwrap_or(0.0),
    }
}

fn hit_rate(rows: &[PodRow]) -> f64 {
    let prompt: u64 = rows.iter().map(|r| r.prompt_tokens).sum();
    let cached: u64 = rows.iter().map(|r| r.cached_tokens).sum();
    cached as f64 / prompt.max(1) as f64
}

fn mean_ttft(rows: &[PodRow]) -> f64 {
    let requests: u64 = rows.iter().map(|r| r.requests).sum();
    rows.iter().map(|r| r.ttft_ms_sum).sum::<f64>() / requests.max(1) as f64
}

/// The busiest pod's share of the requests, as a multiple of a fair share.
fn max_share(rows: &[PodRow]) -> f64 {
    let requests: u64 = rows.iter().map(|r| r.requests).sum();
    let busiest = rows.iter().map(|r| r.requests).max().unwrap_or(0);
    busiest as f64 * rows.len() as f64 / requests.max(1) as f64
}

fn main() {
    let sim = sim_binary();
    let mut spec = ClusterSpec::new(4, config());
    spec.sim_args = vec!["--time-scale".into(), TIME_SCALE.into()];
    spec.listen_port = Some(10000);
    spec.admin_port = Some(9901);
    eprintln!("starting 4 simulated pods and Envoy with kvroute ...");
    let cluster =
        Cluster::start(&sim, spec).unwrap_or_else(|e| panic!("could not start the demo: {e}"));
    let listen = cluster.envoy.listen.clone();
    eprintln!("sending {USERS} conversations × {TURNS} turns through kvroute ...");
    workload(|body| post(&listen, body));
    let rows: Vec<PodRow> = cluster.sims.iter().map(row).collect();

    eprintln!("same workload under round robin on 4 fresh pods ...");
    let config_file = cluster.dir.join("kvroute.json");
    let fresh: Vec<Sim> = (0..4)
        .map(|i| {
            Sim::start(
                &sim,
                &format!("rr-{i}"),
                Path::new(&config_file),
                &["--time-scale".into(), TIME_SCALE.into()],
            )
        })
        .collect::<Result<_, _>>()
        .expect("round-robin pods start");
    let next = std::sync::atomic::AtomicUsize::new(0);
    workload(|body| {
        let turn = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        post(&fresh[turn % fresh.len()].address, body)
    });
    let rr_rows: Vec<PodRow> = fresh.iter().map(row).collect();
    drop(fresh);

    println!(
        "\nkvroute, {USERS} concurrent conversations × {TURNS} turns (time scale {TIME_SCALE}):\n"
    );
    println!("| pod | requests | cache hit rate | mean TTFT (ms) |");
    println!("|-----|---------:|---------------:|---------------:|");
    for r in &rows {
        println!(
            "| {} | {} | {:.1}% | {:.1} |",
            r.id,
            r.requests,
            100.0 * r.cached_tokens as f64 / r.prompt_tokens.max(1) as f64,
            r.ttft_ms_sum / r.requests.max(1) as f64
        );
    }
    println!(
        "| **all** | {} | **{:.1}%** | **{:.1}** |",
        rows.iter().map(|r| r.requests).sum::<u64>(),
        100.0 * hit_rate(&rows),
        mean_ttft(&rows)
    );
    println!("\n| router | cache hit rate | mean TTFT (ms) | max pod share |");
    println!("|--------|---------------:|---------------:|--------------:|");
    for (router, rows) in [("kvroute", &rows), ("round robin", &rr_rows)] {
        println!(
            "| {router} | {:.1}% | {:.1} | {:.2}× fair |",
            100.0 * hit_rate(rows),
            mean_ttft(rows),
            max_share(rows)
        );
    }
    println!();
    println!("kvroute is serving on http://{listen} — try:\n");
    println!(
        "  curl -s http://{listen}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"sim-model\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}],\"max_tokens\":8}}' -i"
    );
    println!(
        "\nmetrics: http://{}/stats/prometheus   (Envoy admin: http://{})",
        cluster.envoy.admin, cluster.envoy.admin
    );
    println!(
        "Envoy log (kvroute decisions as JSON lines): {}",
        cluster.envoy.log_path.display()
    );
    println!("\nCtrl-C to stop.");
    wait_for_stop_signal();
    eprintln!("stopping ...");
}

/// Blocks until Ctrl-C or SIGTERM, so the pods and Envoy are torn down (by
/// the harness's drop) either way.
fn wait_for_stop_signal() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    });
}
