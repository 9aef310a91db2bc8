//! `kvroute-bench load-sweep` end to end at its smallest: two policies
//! (kvroute in Envoy, Envoy's round robin) × two loads on the first 60
//! lines of the benchmark's trace, real Envoy and simulated pods; the
//! document, its Markdown and its chart come out complete.

use std::path::PathBuf;

use clap::Parser;
use kvroute_integration::bench::{self, BenchArgs};

const SIM: &str = env!("CARGO_BIN_EXE_kvroute-sim");

#[test]
fn load_sweep_runs_every_policy_at_every_load() {
    let out = std::env::temp_dir().join(format!("kvroute-bench-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let args = BenchArgs::parse_from([
        "kvroute-bench",
        "load-sweep",
        "--quick",
        "--policies",
        "kvroute-precise,round-robin",
        "--loads",
        "0.5,2",
        "--trace-requests",
        "60",
        "--out",
        out.to_str().unwrap(),
        "--sim",
        SIM,
        "--keep-logs",
        out.join("logs").to_str().unwrap(),
    ]);
    let doc = bench::run(&args).expect("load sweep runs");

    let loads = doc["loads"].as_array().expect("loads");
    let rate = |i: usize| loads[i]["offeredRps"].as_f64().unwrap();
    assert!(
        (rate(1) / rate(0) - 4.0).abs() < 0.05,
        "2× offers four times 0.5×: {loads:?}"
    );
    let rows = doc["rows"].as_array().expect("rows");
    let found: Vec<(f64, &str)> = rows
        .iter()
        .map(|r| (r["load"].as_f64().unwrap(), r["policy"].as_str().unwrap()))
        .collect();
    assert_eq!(
        found,
        [
            (0.5, "kvroute-precise"),
            (0.5, "round-robin"),
            (2.0, "kvroute-precise"),
            (2.0, "round-robin"),
        ],
        "one row per load and policy, in report order"
    );
    for r in rows {
        assert_eq!(r["requests"], 60, "{r}");
        assert!(r["ttftMs"]["p90"].is_number(), "{r}");
        assert!(r["http503"].is_number(), "{r}");
        assert_eq!(
            r["gatewayWaitMs"].is_object(),
            r["policy"] == "kvroute-precise",
            "only kvroute exports gateway waits: {r}"
        );
    }
    assert!(
        rows.iter()
            .filter(|r| r["load"] == 0.5)
            .all(|r| r["completed"] == 60),
        "half the capacity: everything answered"
    );
    let sustained = doc["sustained"].as_array().expect("sustained");
    assert_eq!(sustained.len(), 2, "{sustained:?}");

    let dir: PathBuf = out.join("load-sweep");
    let markdown = std::fs::read_to_string(dir.join("load-sweep.md")).expect("markdown");
    assert!(markdown.contains("## Highest load sustained"), "{markdown}");
    assert!(markdown.contains("| 2.0× | round-robin |"), "{markdown}");
    let png = std::fs::read(dir.join("load-sweep.png")).expect("chart");
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000);

    // Beside each run's router log, its requests as the client saw them.
    for policy in ["kvroute-precise", "round-robin"] {
        let csv = out.join(format!("logs/load-sweep-0.5-{policy}.requests.csv"));
        let csv = std::fs::read_to_string(&csv).expect("requests CSV");
        let mut lines = csv.lines();
        assert_eq!(
            lines.next(),
            Some("request,session,follows_up,sent_s,ttft_ms,e2e_ms,status,pod,prompt_tokens,cached_tokens,error")
        );
        let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
        assert_eq!(rows.len(), 60, "{csv}");
        for (i, row) in rows.iter().enumerate() {
            assert_eq!(row.len(), 11, "{row:?}");
            assert_eq!(row[0], i.to_string(), "in request order: {row:?}");
            assert_eq!(row[6], "200", "{row:?}");
            assert!(row[4].parse::<f64>().is_ok_and(|ms| ms > 0.0), "{row:?}");
            assert!(row[7].starts_with("pod-"), "the answering pod: {row:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&out);
}
