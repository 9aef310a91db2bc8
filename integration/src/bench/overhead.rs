//! What kvroute costs in the proxy.
//!
//! - [`overhead`]: one simulated pod answering at once (`--time-scale 0`,
//!   `max_tokens` 1), five Envoys in front of it — kvroute's native
//!   module, plain Envoy (a STATIC cluster, no filter), the wasm floor
//!   filter, kvroute.wasm and the native floor module. Closed-loop
//!   keep-alive clients ([`crate::http`]'s pool) at fixed concurrency, the
//!   five measured in alternating phases
//!   (forwards, then backwards) so drift hits all; the filter's own time
//!   from the `latencyUs` of the kvroute builds' `route` log lines. On two
//!   cores or more the load generator and the sim run on CPU 0, the Envoys
//!   on CPU 1 (`taskset`), and the saturation phases report each Envoy's
//!   CPU seconds per 1,000 requests (`/proc/<pid>/stat`). The same is
//!   checked with an independent load generator, `wrk`.
//! - [`scale`]: N pods (64 by default, up to 1,024, served 128 per
//!   `kvroute-sim` process past 64) preloaded with ~1M blocks in total;
//!   the service's ingest time, index gauges, main-thread CPU per tick
//!   (from `/proc/<envoy>/task/<main>/stat`), the main thread's stall
//!   while every pod resyncs, the filter's time at that index size; and
//!   the same folding and publication natively (exact snapshot size).

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvroute::cluster::{
    ClusterState, FoldStep, PullAnswer, PullKind, FOLD_STEP_BLOCKS, PUBLISH_BUCKETS,
};
use kvroute::config::Config;
use kvroute::hashing::BlockHasher;
use kvroute::request::Prompt;
use serde_json::{json, Value};

use super::envoy_stats::{filtered, metric};
use super::report::percentile;
use super::stack::render_baseline;
use super::workload::words;
use kvroute_config::Module;

use crate::harness::{
    floor_wasm_path, free_port, module_name, native_dir, prometheus_value, render_envoy_config,
    wasm_path, Cluster, ClusterSpec, Envoy,
};
use crate::http;
use crate::model::{KvCache, PodLoad};
use crate::sim::preload_prompt;

/// One closed-loop phase: latencies (µs) of successful requests, errors,
/// elapsed seconds.
struct Phase {
    latencies_us: Vec<f64>,
    errors: u64,
    elapsed_s: f64,
}

fn closed_loop(addr: &str, bodies: &[String], concurrency: usize, duration: Duration) -> Phase {
    closed_loop_on(addr, "/v1/completions", bodies, concurrency, duration)
}

/// [`closed_loop`] on `path`.
fn closed_loop_on(
    addr: &str,
    path: &str,
    bodies: &[String],
    concurrency: usize,
    duration: Duration,
) -> Phase {
    let stop = AtomicBool::new(false);
    let errors = AtomicU64::new(0);
    let start = Instant::now();
    let latencies = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..concurrency)
            .map(|worker| {
                let (stop, errors) = (&stop, &errors);
                scope.spawn(move || {
                    let mut out = Vec::new();
                    let mut i = worker;
                    while !stop.load(Ordering::Relaxed) {
                        let body = bodies[i % bodies.len()].as_bytes();
                        i += concurrency;
                        let t = Instant::now();
                        match http::request(
                            addr,
                            "POST",
                            path,
                            &[("content-type", "application/json")],
                            Some(body),
                            Duration::from_secs(10),
                        ) {
                            Ok(r) if r.status == 200 => out.push(t.elapsed().as_secs_f64() * 1e6),
                            _ => {
                                errors.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    out
                })
            })
            .collect();
        std::thread::sleep(duration);
        stop.store(true, Ordering::Relaxed);
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect::<Vec<f64>>()
    });
    Phase {
        latencies_us: latencies,
        errors: errors.load(Ordering::Relaxed),
        elapsed_s: start.elapsed().as_secs_f64(),
    }
}

/// `count` distinct completion bodies of exactly `size` bytes.
fn bodies(size: usize, count: usize) -> Vec<String> {
    (0..count)
        .map(|i| {
            let empty = json!({"model": "sim-model", "prompt": "", "max_tokens": 1}).to_string();
            let text = words(
                &format!("request {i} of {size}: "),
                (size as u64) << 20 | i as u64,
                size.saturating_sub(empty.len()),
            );
            let body = json!({"model": "sim-model", "prompt": text, "max_tokens": 1}).to_string();
            debug_assert_eq!(body.len(), size);
            body
        })
        .collect()
}

/// The integer `field` of each of the filter's `event` log lines in `log`
/// (`route`: `latencyUs`, `matchedBlocks`, `blocks`; `wait_end`: `waitedMs`).
pub fn event_field(log: &str, event: &str, field: &str) -> Vec<f64> {
    let key = format!("\"{field}\":");
    let tag = format!("\"event\":\"{event}\"");
    log.lines()
        .filter(|l| l.contains(&tag))
        .filter_map(|l| {
            let at = l.find(&key)? + key.len();
            let digits: String = l[at..].chars().take_while(|c| c.is_ascii_digit()).collect();
            digits.parse().ok()
        })
        .collect()
}

fn log_len(envoy: &Envoy) -> usize {
    std::fs::metadata(&envoy.log_path).map_or(0, |m| m.len() as usize)
}

fn log_since(envoy: &Envoy, offset: usize) -> String {
    std::thread::sleep(Duration::from_millis(150)); // --file-flush-interval-msec 50
    let log = envoy.log();
    log.get(offset..).unwrap_or("").to_string()
}

fn stats(values: &mut [f64]) -> Value {
    values.sort_by(f64::total_cmp);
    json!({
        "p50": percentile(values, 50.0).map(|v| v.round()),
        "p99": percentile(values, 99.0).map(|v| v.round()),
        "n": values.len(),
    })
}

/// The load generator's (and the sim's) core and the Envoys' core when
/// the machine has two: so neither side's CPU shows up in the other's.
const LOAD_CPU: usize = 0;
const ENVOY_CPU: usize = 1;

/// Pins every thread of process `pid` (children it starts later inherit
/// it) to `cpu` with `taskset`; false when that fails.
fn pin(pid: u32, cpu: usize) -> bool {
    std::process::Command::new("taskset")
        .args(["-a", "-p", "-c", &cpu.to_string(), &pid.to_string()])
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The Envoys [`overhead`] compares, in this order: kvroute's native
/// module, plain Envoy, the (wasm) floor filter, kvroute.wasm, the native
/// floor module.
const TARGETS: [&str; 5] = ["native", "plain", "floor", "wasm", "nativeFloor"];
/// The kvroute builds among [`TARGETS`] (their filter's own time is read
/// from their `route` lines).
const KVROUTE: [usize; 2] = [0, 3];

/// The order of the [`TARGETS`] in round `round`: forwards, then
/// backwards, so drift between rounds hits all alike.
fn round_order(round: usize) -> [usize; 5] {
    if round.is_multiple_of(2) {
        [0, 1, 2, 3, 4]
    } else {
        [4, 3, 2, 1, 0]
    }
}

/// The Envoy configuration `yaml` (kvroute's native rendering) with the
/// native floor module (`integration/native-floor`) in kvroute's place.
fn with_native_floor(yaml: String) -> String {
    let kvroute = "dynamic_module_config:\n                name: kvroute ";
    let floor = "dynamic_module_config:\n                name: kvroute_native_floor ";
    debug_assert!(yaml.contains(kvroute), "the template names the module");
    yaml.replace(kvroute, floor)
}

/// An Envoy of `yaml` in `dir` (under `cluster`'s directory).
fn start_envoy(
    cluster: &Cluster,
    name: &str,
    yaml: impl FnOnce(u16, u16) -> String,
) -> io::Result<Envoy> {
    let dir = cluster.dir.join(name);
    std::fs::create_dir_all(&dir)?;
    let (listen, admin) = (free_port(), free_port());
    Envoy::start(&dir, &yaml(listen, admin), listen, admin)
}

/// Runs the overhead measurement.
pub fn overhead(sim_binary: &Path, quick: bool) -> io::Result<Value> {
    // Defaults as users run them: no decision headers on responses.
    let plugin = json!({"podReportIntervalMs": 500, "decisionHeaders": false,
                        "models": {"sim-model": {"baseModel": "sim-model"}}});
    let mut spec = ClusterSpec::new(1, plugin);
    // A cache that holds every body's blocks (32 bodies of up to 752
    // blocks), as a real pod would: the requests then change nothing, and
    // what is measured is the proxy's per-request cost, not index churn
    // (the scale benchmark's churn phase measures that).
    spec.sim_args = vec![
        "--time-scale".into(),
        "0".into(),
        "--max-batch".into(),
        "4096".into(),
        "--kv-blocks".into(),
        "65536".into(),
    ];
    // Before anything starts: the sim inherits the load generator's core.
    let pinned = std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2)
        && pin(std::process::id(), LOAD_CPU);
    // The cluster's Envoy runs the native module (KVROUTE_MODULE unset).
    let cluster = Cluster::start(sim_binary, spec)?;
    let pod = [cluster.sims[0].address.clone()];
    let plain = start_envoy(&cluster, "plain", |listen, admin| {
        render_baseline("ROUND_ROBIN", listen, admin, &pod)
    })?;
    // kvroute's Envoy with the floor filter in kvroute's place: what any
    // body-routing wasm filter costs.
    let floor_wasm = floor_wasm_path();
    let kvroute_wasm = wasm_path();
    for (path, make) in [
        (&floor_wasm, "make wasm-floor"),
        (&kvroute_wasm, "make wasm"),
    ] {
        if !path.exists() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} is missing (run `{make}`)", path.display()),
            ));
        }
    }
    let floor = start_envoy(&cluster, "floor", |listen, admin| {
        render_envoy_config(
            Module::Wasm(&floor_wasm),
            listen,
            admin,
            &cluster.config,
            &pod,
        )
    })?;
    let wasm = start_envoy(&cluster, "wasm", |listen, admin| {
        render_envoy_config(
            Module::Wasm(&kvroute_wasm),
            listen,
            admin,
            &cluster.config,
            &pod,
        )
    })?;
    // And the native floor module in kvroute's place: what any
    // body-routing dynamic module costs.
    let native_floor_so = native_dir().join("libkvroute_native_floor.so");
    if !native_floor_so.exists() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "{} is missing (run `make native-floor`)",
                native_floor_so.display()
            ),
        ));
    }
    let native_floor = start_envoy(&cluster, "native-floor", |listen, admin| {
        with_native_floor(render_envoy_config(
            Module::Native,
            listen,
            admin,
            &cluster.config,
            &pod,
        ))
    })?;
    std::thread::sleep(Duration::from_secs(2));
    // Every phase measures these, in `round_order`.
    let targets = [&cluster.envoy, &plain, &floor, &wasm, &native_floor];
    let pinned = pinned && targets.iter().all(|e| pin(e.pid(), ENVOY_CPU));
    let (rounds, phase) = if quick {
        (2, Duration::from_secs(2))
    } else {
        (3, Duration::from_secs(3))
    };
    let by_target = |values: [Value; 5]| -> Value {
        TARGETS
            .iter()
            .zip(values)
            .map(|(name, v)| (name.to_string(), v))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let mut latency = Vec::new();
    for (size, concurrency) in [1024usize, 16 * 1024, 128 * 1024, 512 * 1024]
        .into_iter()
        .flat_map(|s| [(s, 1usize), (s, 8)])
    {
        let set = bodies(size, 32);
        for envoy in targets {
            closed_loop(&envoy.listen, &set, concurrency, Duration::from_millis(700));
        }
        let mut latencies: [Vec<f64>; 5] = Default::default();
        let mut errors = [0u64; 5];
        let mut filter: [Vec<f64>; 5] = Default::default();
        for round in 0..rounds {
            for which in round_order(round) {
                let envoy = targets[which];
                let offset = KVROUTE.contains(&which).then(|| log_len(envoy));
                let p = closed_loop(&envoy.listen, &set, concurrency, phase);
                latencies[which].extend(p.latencies_us);
                errors[which] += p.errors;
                if let Some(offset) = offset {
                    filter[which].extend(event_field(
                        &log_since(envoy, offset),
                        "route",
                        "latencyUs",
                    ));
                }
            }
        }
        let us = latencies.map(|mut l| stats(&mut l));
        let added = |which: usize| match (
            us[which]["p50"].as_f64(),
            us[which]["p99"].as_f64(),
            us[1]["p50"].as_f64(),
            us[1]["p99"].as_f64(),
        ) {
            (Some(a), Some(b), Some(c), Some(d)) => json!({"p50": a - c, "p99": b - d}),
            _ => Value::Null,
        };
        let entry = json!({
            "bodyBytes": size,
            "concurrency": concurrency,
            "us": by_target(us.clone()),
            "addedUs": {"native": added(0), "floor": added(2), "wasm": added(3), "nativeFloor": added(4)},
            "filterUs": {"native": stats(&mut filter[0]), "wasm": stats(&mut filter[3])},
            "errors": by_target(errors.map(|e| json!(e))),
        });
        eprintln!("overhead latency: {entry}");
        latency.push(entry);
    }
    let mut saturation = Vec::new();
    let sat_concurrency = 32;
    for size in [1024usize, 16 * 1024] {
        let set = bodies(size, 32);
        // (requests, seconds, Envoy CPU seconds) per target.
        let mut sums = [(0usize, 0.0f64, 0.0f64); 5];
        // The kvroute builds' main threads (the report service) on their own.
        let mut main_thread_s = [0.0f64; 5];
        for round in 0..rounds {
            for which in round_order(round) {
                let pid = targets[which].pid();
                let cpu_before = process_cpu_s(pid).unwrap_or(0.0);
                let main_before = thread_cpu_s(pid, pid).unwrap_or(0.0);
                let p = closed_loop(&targets[which].listen, &set, sat_concurrency, phase);
                let cpu = process_cpu_s(pid).unwrap_or(0.0) - cpu_before;
                main_thread_s[which] += thread_cpu_s(pid, pid).unwrap_or(0.0) - main_before;
                sums[which].0 += p.latencies_us.len();
                sums[which].1 += p.elapsed_s;
                sums[which].2 += cpu;
            }
        }
        let rps = sums.map(|(n, t, _)| n as f64 / t);
        // CPU seconds per 1,000 requests, to 4 decimals.
        let per_1000 = |cpu: f64, n: usize| (cpu * 1000.0 / n.max(1) as f64 * 1e4).round() / 1e4;
        let cpu = [0, 1, 2, 3, 4].map(|i| json!(per_1000(sums[i].2, sums[i].0)));
        let ratio = |which: usize| json!((rps[which] / rps[1] * 1000.0).round() / 1000.0);
        let cpu_ratio = |which: usize| {
            let (a, b) = (
                per_1000(sums[which].2, sums[which].0),
                per_1000(sums[1].2, sums[1].0),
            );
            json!((a / b * 100.0).round() / 100.0)
        };
        let entry = json!({
            "bodyBytes": size,
            "concurrency": sat_concurrency,
            "rps": by_target(rps.map(|r| json!(r.round()))),
            "ratioToPlain": {"native": ratio(0), "floor": ratio(2), "wasm": ratio(3), "nativeFloor": ratio(4)},
            "envoyCpuSPer1000": by_target(cpu),
            "cpuRatioToPlain": {"native": cpu_ratio(0), "floor": cpu_ratio(2), "wasm": cpu_ratio(3), "nativeFloor": cpu_ratio(4)},
            "mainThreadCpuSPer1000": {"native": per_1000(main_thread_s[0], sums[0].0), "wasm": per_1000(main_thread_s[3], sums[3].0)},
        });
        eprintln!("overhead saturation: {entry}");
        saturation.push(entry);
    }
    let wrk = wrk_check(&targets, pinned, if quick { 5 } else { 9 });
    Ok(json!({
        "method": format!("one kvroute-sim (--time-scale 0, max_tokens 1, a cache holding every body) behind five Envoy 1.40 (--concurrency 2): kvroute's native module, plain (STATIC cluster, no filter), floor (kvroute's Envoy with integration/floor-filter, a wasm filter, in kvroute's place: pause, buffer, read the body, set one header), kvroute.wasm and nativeFloor (the same with integration/native-floor, a dynamic module doing the same); closed-loop keep-alive clients {}, {rounds} alternating rounds of {} s per side; added = kvroute (or floor) − plain percentile; Envoy CPU from /proc/<pid>/stat over the saturation phases", if pinned { format!("and the sim pinned to CPU {LOAD_CPU}, the Envoys to CPU {ENVOY_CPU} (taskset)") } else { "and the sim unpinned, sharing the cores with the Envoys".into() }, phase.as_secs()),
        "latency": latency,
        "saturation": saturation,
        "wrk": wrk,
    }))
}

/// The same comparison through an independent load generator, `wrk`
/// (Debian's package, `make wrk`), pinned to the load core while the
/// Envoys run on theirs: one POST body repeated (1 and 16 KiB), 32
/// connections for the rate and Envoy's CPU per request, one connection
/// for the latency, `rounds` interleaved rounds ([`round_order`]). Each
/// round's figures are also taken as ratios to plain Envoy's in the same
/// round, and the medians of those ratios reported: on a shared machine
/// a round's rate swings by tens of percent, for every Envoy alike.
/// `Null` without `wrk`.
fn wrk_check(targets: &[&Envoy; 5], pinned: bool, rounds: usize) -> Value {
    if std::process::Command::new("wrk")
        .arg("--version")
        .output()
        .is_err()
    {
        return json!({"unavailable": "wrk is not installed (make wrk)"});
    }
    let dir = std::env::temp_dir().join(format!("kvroute-wrk-{}", std::process::id()));
    if std::fs::create_dir_all(&dir).is_err() {
        return Value::Null;
    }
    let seconds = 2;
    let mut rows = Vec::new();
    for size in [1024usize, 16 * 1024] {
        let body = bodies(size, 1).pop().unwrap_or_default();
        let script = dir.join(format!("post-{size}.lua"));
        let lua = format!(
            "wrk.method = \"POST\"\nwrk.headers[\"content-type\"] = \"application/json\"\nwrk.body = {}\n",
            serde_json::to_string(&body).unwrap_or_default()
        );
        if std::fs::write(&script, lua).is_err() {
            continue;
        }
        // (req/s, Envoy CPU ms per request, p50 µs, p99 µs)
        let run = |envoy: &Envoy, connections: usize| -> Option<[f64; 4]> {
            let pid = envoy.pid();
            let cpu_before = process_cpu_s(pid)?;
            let mut command = std::process::Command::new("taskset");
            command.args(["-c", &LOAD_CPU.to_string(), "wrk"]);
            let output = command
                .args([
                    "-t1",
                    &format!("-c{connections}"),
                    &format!("-d{seconds}s"),
                    "--latency",
                    "-s",
                ])
                .arg(&script)
                .arg(format!("http://{}/v1/completions", envoy.listen))
                .output()
                .ok()?;
            let cpu = process_cpu_s(pid)? - cpu_before;
            let text = String::from_utf8_lossy(&output.stdout).to_string();
            let rps: f64 = text
                .lines()
                .find_map(|l| l.strip_prefix("Requests/sec:"))?
                .trim()
                .parse()
                .ok()?;
            let quantile = |q: &str| {
                text.lines()
                    .find_map(|l| l.trim().strip_prefix(q))
                    .and_then(|v| wrk_us(v.trim()))
            };
            Some([
                rps,
                cpu * 1000.0 / (rps * seconds as f64).max(1.0),
                quantile("50%")?,
                quantile("99%")?,
            ])
        };
        for envoy in targets {
            let _ = run(envoy, 32); // warm-up
        }
        // Per target, per round: the loaded run, then the one-client run.
        let mut loaded: [Vec<Option<[f64; 4]>>; 5] = Default::default();
        let mut single: [Vec<Option<[f64; 4]>>; 5] = Default::default();
        for round in 0..rounds {
            for which in round_order(round) {
                loaded[which].push(run(targets[which], 32));
                single[which].push(run(targets[which], 1));
            }
        }
        let median = |values: Vec<f64>| {
            let mut values = values;
            values.sort_by(f64::total_cmp);
            values.get(values.len() / 2).copied()
        };
        // The median over rounds of `f(target's round, plain's round)`.
        let over_rounds = |runs: &[Vec<Option<[f64; 4]>>; 5],
                           which: usize,
                           f: &dyn Fn([f64; 4], [f64; 4]) -> f64| {
            median(
                runs[which]
                    .iter()
                    .zip(&runs[1])
                    .filter_map(|(r, p)| Some(f((*r)?, (*p)?)))
                    .collect(),
            )
        };
        let round2 = |v: Option<f64>, scale: f64| v.map(|v| (v * scale).round() / scale);
        let mut row = serde_json::Map::new();
        row.insert("bodyBytes".into(), json!(size));
        for (which, name) in TARGETS.iter().enumerate() {
            row.insert(
                name.to_string(),
                json!({
                    "rps": round2(over_rounds(&loaded, which, &|r, _| r[0]), 1.0),
                    "cpuSPer1000": round2(over_rounds(&loaded, which, &|r, _| r[1]), 1e4),
                    "p50UsOneClient": round2(over_rounds(&single, which, &|r, _| r[2]), 1.0),
                    "rpsRatioToPlain": round2(over_rounds(&loaded, which, &|r, p| r[0] / p[0]), 1e3),
                    "cpuRatioToPlain": round2(over_rounds(&loaded, which, &|r, p| r[1] / p[1]), 100.0),
                    "addedP50UsOneClient": round2(over_rounds(&single, which, &|r, p| r[2] - p[2]), 1.0),
                    "addedP99UsOneClient": round2(over_rounds(&single, which, &|r, p| r[3] - p[3]), 1.0),
                }),
            );
        }
        eprintln!("overhead wrk: {}", Value::Object(row.clone()));
        rows.push(Value::Object(row));
    }
    let _ = std::fs::remove_dir_all(&dir);
    json!({"method": format!("wrk -t1 -c32 -d{seconds}s (rate, Envoy CPU per request) and -c1 (latency) per Envoy, {rounds} interleaved rounds, medians over rounds (ratios and added latency: of each round's figure against plain's in the same round), {}", if pinned { format!("wrk on CPU {LOAD_CPU}, the Envoys on CPU {ENVOY_CPU}") } else { "unpinned".into() }), "rows": rows})
}

/// A wrk latency (`612.00us`, `1.20ms`) in µs.
fn wrk_us(value: &str) -> Option<f64> {
    let (number, scale) = if let Some(n) = value.strip_suffix("us") {
        (n, 1.0)
    } else if let Some(n) = value.strip_suffix("ms") {
        (n, 1e3)
    } else if let Some(n) = value.strip_suffix('s') {
        (n, 1e6)
    } else {
        return None;
    };
    number.parse::<f64>().ok().map(|n| n * scale)
}

/// The prompt forms [`filter_time`] measures: endpoint, and whether the
/// model has a chat template (stock-vLLM mode's text keys).
const FILTER_TIME_FORMS: [(&str, &str, bool); 3] = [
    ("completions", "/v1/completions", false),
    ("chat", "/v1/chat/completions", false),
    ("chat, templated", "/v1/chat/completions", true),
];

/// `count` distinct request bodies of about `size` bytes for `path`: a
/// completions prompt, or a chat of a system prompt, a user turn, an
/// assistant answer and a user turn.
fn bodies_for(path: &str, size: usize, count: usize) -> Vec<String> {
    if !path.contains("chat") {
        return bodies(size, count);
    }
    (0..count)
        .map(|i| {
            let text = |part: u64, share: usize| {
                words(
                    &format!("{part} "),
                    (size as u64) << 20 | (i as u64) << 4 | part,
                    size * share / 8,
                )
            };
            json!({"model": "sim-model", "max_tokens": 1, "messages": [
                {"role": "system", "content": text(0, 4)},
                {"role": "user", "content": text(1, 2)},
                {"role": "assistant", "content": text(2, 1)},
                {"role": "user", "content": text(3, 1)},
            ]})
            .to_string()
        })
        .collect()
}

/// The filter's own time (`latencyUs` of its `route` lines) per prompt
/// form and body size, one client at a time: completions, chat in
/// kvroute's canonical form, and chat rendered through a chat template
/// (what stock-vLLM mode adds to a request). Two Envoys, one configured
/// with the template, measured in alternating rounds.
pub fn filter_time(sim_binary: &Path, quick: bool) -> io::Result<Value> {
    let start = |templated: bool| {
        let mut plugin = json!({"podReportIntervalMs": 500, "decisionHeaders": false,
                                "models": {"sim-model": {"baseModel": "sim-model"}}});
        if templated {
            plugin["chatTemplates"] =
                json!({"sim-model": {"template": super::workload::STOCK_VLLM_CHAT_TEMPLATE}});
        }
        let mut spec = ClusterSpec::new(1, plugin);
        spec.sim_args = [
            "--time-scale",
            "0",
            "--max-batch",
            "4096",
            "--kv-blocks",
            "65536",
        ]
        .map(String::from)
        .to_vec();
        Cluster::start(sim_binary, spec)
    };
    let clusters = [start(false)?, start(true)?];
    let (rounds, phase) = if quick {
        (2, Duration::from_secs(2))
    } else {
        (3, Duration::from_secs(4))
    };
    let mut rows = Vec::new();
    for size in [16 * 1024usize, 128 * 1024, 512 * 1024] {
        for (form, path, templated) in FILTER_TIME_FORMS {
            let envoy = &clusters[usize::from(templated)].envoy;
            let set = bodies_for(path, size, 32);
            closed_loop_on(&envoy.listen, path, &set, 1, Duration::from_millis(500));
            let mut filter = Vec::new();
            let mut errors = 0;
            for _ in 0..rounds {
                let offset = log_len(envoy);
                let p = closed_loop_on(&envoy.listen, path, &set, 1, phase);
                errors += p.errors;
                filter.extend(event_field(&log_since(envoy, offset), "route", "latencyUs"));
            }
            let entry = json!({"form": form, "bodyBytes": size, "filterUs": stats(&mut filter),
                               "errors": errors});
            eprintln!("filter time: {entry}");
            rows.push(entry);
        }
    }
    Ok(json!({
        "method": format!("one kvroute-sim (--time-scale 0) behind two Envoy 1.40 with kvroute, one with a chat template for the model (integration/src/bench/chat_template.jinja); one client, {rounds} rounds of {} s per form and size; 32 distinct bodies each (chat: system prompt 1/2, user 1/4, assistant 1/8, user 1/8 of the size); the filter's own time from the `latencyUs` of its `route` lines", phase.as_secs()),
        "rows": rows,
    }))
}

/// The filter-time section of the results document.
pub fn filter_time_markdown(f: &Value) -> String {
    let mut out = String::from("## The filter's own time by prompt form\n\n");
    out.push_str(&format!("{}.\n\n", f["method"].as_str().unwrap_or("")));
    out.push_str("| body | form | p50 µs | p99 µs | requests |\n|---:|---|---:|---:|---:|\n");
    for row in f["rows"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "| {} KiB | {} | {} | {} | {} |\n",
            row["bodyBytes"].as_u64().unwrap_or(0) / 1024,
            row["form"].as_str().unwrap_or(""),
            row["filterUs"]["p50"],
            row["filterUs"]["p99"],
            row["filterUs"]["n"],
        ));
    }
    out
}

/// The overhead section of the results document.
pub fn overhead_markdown(o: &Value) -> String {
    let mut out = String::from("## Overhead\n\n");
    out.push_str(&format!("{}.\n\n", o["method"].as_str().unwrap_or("")));
    out.push_str("| body | concurrency | plain p50 / p99 µs | native added p50 / p99 µs | native floor added p50 / p99 µs | wasm added p50 / p99 µs | floor added p50 / p99 µs | filter's own time p50 / p99 µs, native / wasm (`latencyUs`) |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for l in o["latency"].as_array().into_iter().flatten() {
        let pair = |v: &Value| format!("{} / {}", v["p50"], v["p99"]);
        out.push_str(&format!(
            "| {} KiB | {} | {} | {} | {} | {} | {} | {} · {} |\n",
            l["bodyBytes"].as_u64().unwrap_or(0) / 1024,
            l["concurrency"],
            pair(&l["us"]["plain"]),
            pair(&l["addedUs"]["native"]),
            pair(&l["addedUs"]["nativeFloor"]),
            pair(&l["addedUs"]["wasm"]),
            pair(&l["addedUs"]["floor"]),
            pair(&l["filterUs"]["native"]),
            pair(&l["filterUs"]["wasm"]),
        ));
    }
    out.push_str("\n| body | concurrency | plain req/s | native req/s (ratio) | native floor req/s (ratio) | wasm req/s (ratio) | floor req/s (ratio) | Envoy CPU-s per 1,000 requests: plain / native / native floor / wasm / floor | CPU ratio to plain: native / native floor / wasm / floor |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for s in o["saturation"].as_array().into_iter().flatten() {
        let with_ratio = |name: &str| {
            format!(
                "{} ({:.1}%)",
                s["rps"][name],
                s["ratioToPlain"][name].as_f64().unwrap_or(0.0) * 100.0
            )
        };
        out.push_str(&format!(
            "| {} KiB | {} | {} | {} | {} | {} | {} | {} / {} / {} / {} / {} | {}× / {}× / {}× / {}× |\n",
            s["bodyBytes"].as_u64().unwrap_or(0) / 1024,
            s["concurrency"],
            s["rps"]["plain"],
            with_ratio("native"),
            with_ratio("nativeFloor"),
            with_ratio("wasm"),
            with_ratio("floor"),
            s["envoyCpuSPer1000"]["plain"],
            s["envoyCpuSPer1000"]["native"],
            s["envoyCpuSPer1000"]["nativeFloor"],
            s["envoyCpuSPer1000"]["wasm"],
            s["envoyCpuSPer1000"]["floor"],
            s["cpuRatioToPlain"]["native"],
            s["cpuRatioToPlain"]["nativeFloor"],
            s["cpuRatioToPlain"]["wasm"],
            s["cpuRatioToPlain"]["floor"],
        ));
    }
    if let Some(rows) = o["wrk"]["rows"].as_array() {
        out.push_str(&format!("\nIndependent check: {}.\n\n| body | Envoy | req/s (c32) | ratio to plain | Envoy CPU-s per 1,000 | CPU ratio to plain | p50 µs (c1) | added p50 / p99 µs (c1) |\n|---:|---|---:|---:|---:|---:|---:|---:|\n", o["wrk"]["method"].as_str().unwrap_or("")));
        for row in rows {
            for name in TARGETS {
                let r = &row[name];
                out.push_str(&format!(
                    "| {} KiB | {name} | {} | {} | {} | {}× | {} | {} / {} |\n",
                    row["bodyBytes"].as_u64().unwrap_or(0) / 1024,
                    r["rps"],
                    r["rpsRatioToPlain"],
                    r["cpuSPer1000"],
                    r["cpuRatioToPlain"],
                    r["p50UsOneClient"],
                    r["addedP50UsOneClient"],
                    r["addedP99UsOneClient"],
                ));
            }
        }
    }
    out.push('\n');
    out
}

/// Nanoseconds thread `tid` of `pid` has run on a CPU (`schedstat`: exact,
/// unlike `stat`'s 10 ms ticks).
fn thread_run_ns(pid: u32, tid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat")).ok()?;
    stat.split_whitespace().next()?.parse().ok()
}

/// CPU seconds (user + system) of thread `tid` of `pid`.
pub fn thread_cpu_s(pid: u32, tid: u32) -> Option<f64> {
    stat_cpu_s(&format!("/proc/{pid}/task/{tid}/stat"))
}

/// CPU seconds (user + system, all threads) of process `pid`.
pub fn process_cpu_s(pid: u32) -> Option<f64> {
    stat_cpu_s(&format!("/proc/{pid}/stat"))
}

/// User + system seconds of a `/proc/…/stat` file.
fn stat_cpu_s(path: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(path).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // After the command: state is field 3, utime 14, stime 15 (1-based).
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0) // USER_HZ
}

/// `epp_service_busy_us` since Envoy started: callbacks, how many took
/// over 10 ms, and the upper bound of the highest bucket reached.
fn service_busy(envoy: &Envoy) -> Value {
    let name = "epp_service_busy_us";
    let page = filtered(envoy, name);
    let bucket = |le: &str| prometheus_value(&page, &format!("{name}_bucket"), &[("le", le)]);
    let count = prometheus_value(&page, &format!("{name}_count"), &[]);
    let within_10ms = bucket("10000");
    let bounds = [
        "10", "25", "50", "100", "250", "500", "1000", "2500", "5000", "10000", "25000", "100000",
    ];
    let highest = bounds
        .iter()
        .find(|le| bucket(le).is_some_and(|n| Some(n) == count))
        .map_or(json!("over 100000"), |le| {
            json!(le.parse::<u64>().unwrap_or(0))
        });
    json!({
        "callbacks": count,
        "over10Ms": count.zip(within_10ms).map(|(c, w)| c - w),
        "maxAtMostUs": highest,
    })
}

/// Pods one `kvroute-sim` process serves in a scale run past 64 pods.
const PODS_PER_SIM_PROCESS: usize = 128;

/// Runs the 1M-block scale measurement over `pods` pods.
pub fn scale(sim_binary: &Path, quick: bool, pods: usize) -> io::Result<Value> {
    let prompt_bytes = 16384; // 256 blocks of 64 bytes
    let blocks_per_prompt = 256usize;
    let target_blocks: usize = if quick { 250_000 } else { 1_000_000 };
    let prompts = target_blocks.div_ceil(pods * blocks_per_prompt);
    let per_pod = prompts * blocks_per_prompt;
    let interval_ms = 1000u64;
    let native = native_scale(pods, prompts, prompt_bytes)?;
    eprintln!("scale native: {native}");
    let plugin = json!({
        "podReportIntervalMs": interval_ms,
        "reportTimeoutMs": 2000,
        "maxIndexBlocks": 1_048_576,
        "models": {"sim-model": {"baseModel": "sim-model"}},
    });
    let mut spec = ClusterSpec::new(pods, plugin);
    // One process per 128 pods (a 64-pod pool in one): a listener, cache
    // and report log per pod, one runtime per process.
    spec.pods_per_process = PODS_PER_SIM_PROCESS;
    spec.sim_args = vec![
        "--time-scale".into(),
        "0.01".into(),
        "--kv-blocks".into(),
        (per_pod + 2048).to_string(),
        "--preload-prompts".into(),
        prompts.to_string(),
        "--preload-prompt-bytes".into(),
        prompt_bytes.to_string(),
    ];
    let sim_args = spec.sim_args.clone();
    let started = Instant::now();
    let mut cluster = Cluster::start(sim_binary, spec)?;
    let startup_s = started.elapsed().as_secs_f64();
    let pid = cluster.envoy.pid();
    let expected = (per_pod * pods) as f64;
    let admin = cluster.envoy.admin.clone();
    let ingest_start = Instant::now();
    let mut nodes = 0.0;
    // Every pod's first report is a full one: the whole pool resyncs.
    let (mut admin_ms, mut on_cpu_ms) = probe_main_thread(&admin, pid, || {
        while ingest_start.elapsed() < Duration::from_secs(300) {
            nodes = metric(&cluster.envoy, "epp_prefix_tree_nodes").unwrap_or(0.0);
            if nodes >= expected * 0.999 {
                break;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        // The last buckets are published over the next ticks.
        std::thread::sleep(Duration::from_secs(3));
    });
    admin_ms.sort_by(f64::total_cmp);
    on_cpu_ms.sort_by(f64::total_cmp);
    let ingest_s = ingest_start.elapsed().as_secs_f64() - 3.0;
    // Cumulative since Envoy started: startup, the first ticks folding all
    // full reports, publication.
    let ingest_cpu = thread_cpu_s(pid, pid).unwrap_or(0.0);
    let memory = metric(&cluster.envoy, "epp_index_memory_bytes");
    // Envoy's resident memory with the whole index (2 workers).
    let rss = rss_bytes(pid);
    let busy = service_busy(&cluster.envoy);
    eprintln!("scale: {nodes} nodes after {ingest_s:.1} s (cluster start {startup_s:.1} s)");
    let window = Duration::from_secs(if quick { 6 } else { 15 });
    // Idle: every tick pulls 64 empty deltas and republishes the pod table.
    std::thread::sleep(Duration::from_millis(1500));
    let c0 = thread_cpu_s(pid, pid).unwrap_or(0.0);
    std::thread::sleep(window);
    let idle_cpu = thread_cpu_s(pid, pid).unwrap_or(0.0) - c0;
    // A few requests first: each worker decodes the JSON pod table once
    // per membership (190 KB at 1,024 pods, ~2 ms of wasm), which is not
    // the steady state the filter's time below is about.
    churn(
        &cluster,
        prompts,
        prompt_bytes,
        10.0,
        Duration::from_secs(1),
    );
    // Churn: half the requests hit a preloaded prompt (lookups at full
    // index), half are new 256-block prompts (256 stored + up to 256
    // evicted blocks each, folded and republished by the service).
    let offset = log_len(&cluster.envoy);
    let c1 = thread_cpu_s(pid, pid).unwrap_or(0.0);
    let rate = 20.0;
    let sent = churn(&cluster, prompts, prompt_bytes, rate, window);
    let churn_cpu = thread_cpu_s(pid, pid).unwrap_or(0.0) - c1;
    let mut filter = event_field(&log_since(&cluster.envoy, offset), "route", "latencyUs");
    // More of the filter's time at full index, past the churn's 300.
    let offset = log_len(&cluster.envoy);
    churn(&cluster, prompts, prompt_bytes, 40.0, window);
    filter.extend(event_field(
        &log_since(&cluster.envoy, offset),
        "route",
        "latencyUs",
    ));
    let ticks = window.as_secs_f64() * 1000.0 / interval_ms as f64;
    let nodes_after = metric(&cluster.envoy, "epp_prefix_tree_nodes");
    // Every sim process restarts at once (new epochs, the same caches):
    // each pod's next answer is a delta of an unknown epoch, so the
    // service drops its blocks and asks for a full report, the whole pool
    // resyncing while Envoy serves.
    let resync_start = Instant::now();
    let mut resynced = 0;
    let (mut resync_admin, mut resync_cpu) = probe_main_thread(&admin, pid, || {
        if let Err(e) = cluster.restart_sims(sim_binary, &sim_args) {
            eprintln!("scale: restarting the sims failed: {e}");
            return;
        }
        // Done when every pod has served its full report (the service
        // asks at most 8 at once) and the index holds the preloaded
        // blocks again (what churn added before the restart is gone).
        while resync_start.elapsed() < Duration::from_secs(600) {
            resynced = cluster
                .sims
                .iter()
                .filter(|s| s.stats()["fullReports"].as_u64().unwrap_or(0) > 0)
                .count();
            let nodes = metric(&cluster.envoy, "epp_prefix_tree_nodes").unwrap_or(0.0);
            if resynced == pods && nodes >= expected * 0.999 {
                break;
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        std::thread::sleep(Duration::from_secs(3));
    });
    let resync_s = resync_start.elapsed().as_secs_f64() - 3.0;
    resync_admin.sort_by(f64::total_cmp);
    resync_cpu.sort_by(f64::total_cmp);
    let resync_busy = service_busy(&cluster.envoy);
    Ok(json!({
        "module": module_name(),
        "envoyRssBytes": rss,
        "pods": pods,
        "preloadedBlocks": per_pod * pods,
        "indexNodes": nodes,
        "indexNodesAfterChurn": nodes_after,
        "indexMemoryBytes": memory,
        "clusterStartS": (startup_s * 10.0).round() / 10.0,
        "ingestS": (ingest_s * 10.0).round() / 10.0,
        "ingestMainThreadCpuS": (ingest_cpu * 100.0).round() / 100.0,
        "adminReadyDuringIngestMs": {
            "probes": admin_ms.len(),
            "p50": admin_ms.get(admin_ms.len() / 2),
            "p99": admin_ms.get(admin_ms.len() * 99 / 100),
            "max": admin_ms.last(),
            "over10Ms": admin_ms.iter().filter(|&&ms| ms > 10.0).count(),
        },
        "mainThreadOnCpuPerProbeMs": {
            "p50": on_cpu_ms.get(on_cpu_ms.len() / 2),
            "p99": on_cpu_ms.get(on_cpu_ms.len() * 99 / 100),
            "max": on_cpu_ms.last(),
            "over10Ms": on_cpu_ms.iter().filter(|&&ms| ms > 10.0).count(),
        },
        "serviceBusyDuringIngest": busy,
        "resync": {
            "s": (resync_s * 10.0).round() / 10.0,
            "podsResynced": resynced,
            "adminReadyMs": percentiles(&resync_admin),
            "mainThreadOnCpuPerProbeMs": percentiles(&resync_cpu),
            "serviceBusySinceStart": resync_busy,
        },
        "reportIntervalMs": interval_ms,
        "idle": {"windowS": window.as_secs(), "mainThreadCpuS": idle_cpu, "msPerTick": idle_cpu * 1000.0 / ticks},
        "churn": {"windowS": window.as_secs(), "requests": sent, "newBlocksPerS": rate / 2.0 * blocks_per_prompt as f64,
                  "mainThreadCpuS": churn_cpu, "msPerTick": churn_cpu * 1000.0 / ticks},
        "filterUsAtFullIndex": stats(&mut filter),
        "native": native,
        "method": "in Envoy: CPU time of Envoy's main thread (where the report service runs in either build; it also flushes stats every 1 s and serves the admin page) from /proc/<pid>/task/<pid>/stat at 10 ms resolution, divided by the ticks in the window; native: the same ClusterState code (kvroute::cluster) on the host, timed with Instant, snapshot size = bytes of all published buckets + pod table + in-flight array",
    }))
}

/// p50 / p99 / max and how many over 10 ms of sorted millisecond samples.
fn percentiles(sorted: &[f64]) -> Value {
    json!({
        "probes": sorted.len(),
        "p50": sorted.get(sorted.len() / 2),
        "p99": sorted.get(sorted.len() * 99 / 100),
        "max": sorted.last(),
        "over10Ms": sorted.iter().filter(|&&ms| ms > 10.0).count(),
    })
}

/// Runs `work` while probing Envoy's main thread every 20 ms: the admin
/// page is served on the main thread, beside the service, so its latency
/// is the longest main-thread stall as a client sees it. On this 2-core
/// machine that includes time the main thread waited for a CPU (sims
/// building full reports at once), so each probe also records the main
/// thread's own CPU time meanwhile: the stall the service and Envoy cause
/// (an upper bound: a probe held up by preemption also counts the events
/// processed while it waited). Returns (latencies, on-CPU) in ms.
fn probe_main_thread(admin: &str, pid: u32, work: impl FnOnce()) -> (Vec<f64>, Vec<f64>) {
    let working = AtomicBool::new(true);
    let started = Instant::now();
    std::thread::scope(|scope| {
        let probe = scope.spawn(|| {
            let (mut latencies, mut on_cpu) = (Vec::new(), Vec::new());
            while working.load(Ordering::Relaxed) {
                let (t, ran) = (Instant::now(), thread_run_ns(pid, pid));
                if crate::http::get(admin, "/ready").is_ok() {
                    let ms = t.elapsed().as_secs_f64() * 1000.0;
                    let cpu_ms = thread_run_ns(pid, pid)
                        .zip(ran)
                        .map_or(ms, |(after, before)| (after - before) as f64 / 1e6);
                    if ms > 10.0 {
                        let at = t.duration_since(started).as_secs_f64();
                        eprintln!("scale: /ready took {ms:.1} ms at {at:.2} s, {cpu_ms:.1} ms of it on CPU");
                    }
                    latencies.push(ms);
                    on_cpu.push(cpu_ms);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            (latencies, on_cpu)
        });
        work();
        working.store(false, Ordering::Relaxed);
        probe.join().unwrap_or_default()
    })
}

/// Sends `rate` requests/s for `window`: even ones reuse a preloaded
/// prompt, odd ones are new. Returns the number sent.
fn churn(cluster: &Cluster, prompts: usize, bytes: usize, rate: f64, window: Duration) -> usize {
    let start = Instant::now();
    let mut n = 0usize;
    std::thread::scope(|scope| {
        while start.elapsed() < window {
            let due = start + Duration::from_secs_f64(n as f64 / rate);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let prompt = if n.is_multiple_of(2) {
                let pod = &cluster.sims[(n / 2) % cluster.sims.len()].id;
                preload_prompt(pod, (n / 2 / cluster.sims.len()) % prompts, bytes)
            } else {
                preload_prompt("bench-new", n, bytes)
            };
            let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 1}).to_string();
            let addr = cluster.envoy.listen.clone();
            scope.spawn(move || {
                let _ = http::post_json(&addr, "/v1/completions", &body);
            });
            n += 1;
        }
    });
    n
}

/// The resident memory of process `pid` (`VmRSS`).
fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Folds the same preloaded caches into a native [`ClusterState`]: full
/// reports, one publication (the whole snapshot), then a churn tick.
fn native_scale(pods: usize, prompts: usize, bytes: usize) -> io::Result<Value> {
    let pod_list: Vec<Value> = (0..pods)
        .map(|i| json!({"id": format!("pod-{i}"), "address": format!("127.0.0.1:{}", 20000 + i)}))
        .collect();
    let config = Config::parse(
        json!({"maxIndexBlocks": 1_048_576, "pods": pod_list, "models": {"sim-model": {"baseModel": "sim-model"}}})
            .to_string()
            .as_bytes(),
    )
    .map_err(io::Error::other)?;
    let hasher = BlockHasher::from_config(&config);
    let target = config.resolve_model("sim-model").expect("model");
    let load = PodLoad {
        health: 1.0,
        ..PodLoad::default()
    };
    let mut caches = Vec::new();
    let mut bodies = Vec::new();
    for i in 0..pods {
        let id = format!("pod-{i}");
        let mut cache = KvCache::new(prompts * 256 + 2048, 100_000);
        for p in 0..prompts {
            let text = preload_prompt(&id, p, bytes);
            cache.insert_chain(&hasher.chain(&target, &Prompt::Text(text.into_bytes()), None));
        }
        bodies.push(cache.report(&id, "E", None, None, &load).to_string());
        caches.push(cache);
    }
    let mut state = ClusterState::new(&config, 0);
    let t = Instant::now();
    // As the service folds: accepted answers, then bounded steps.
    let mut longest_fold_s: f64 = 0.0;
    let report_bytes = bodies.first().map(String::len);
    for (i, body) in bodies.into_iter().enumerate() {
        let answer = PullAnswer {
            status: Some("200"),
            body_size: body.len(),
        };
        let pod = format!("pod-{i}");
        let _ = state.accept_pull(&pod, PullKind::Report, answer, |_| body.into_bytes(), 0);
    }
    loop {
        let step = Instant::now();
        match state.fold_step(1, FOLD_STEP_BLOCKS) {
            None => break,
            Some(FoldStep::Done(folded)) => {
                folded
                    .result
                    .map_err(|e| io::Error::other(format!("{e:?}")))?;
            }
            Some(FoldStep::Partial) => {}
        }
        longest_fold_s = longest_fold_s.max(step.elapsed().as_secs_f64());
    }
    let fold_full_s = t.elapsed().as_secs_f64();
    // What the service does after the resync: bounded publications, one
    // per tick, until nothing is pending.
    let t = Instant::now();
    let mut longest_publish_s: f64 = 0.0;
    let mut publication = state.publish_some(2, PUBLISH_BUCKETS);
    let mut all_buckets = std::mem::take(&mut publication.buckets);
    let mut publications = 1;
    while publication.unpublished_buckets > 0 {
        let step = Instant::now();
        publication = state.publish_some(2, PUBLISH_BUCKETS);
        longest_publish_s = longest_publish_s.max(step.elapsed().as_secs_f64());
        all_buckets.append(&mut publication.buckets);
        publications += 1;
    }
    publication.buckets = all_buckets;
    let publish_full_s = t.elapsed().as_secs_f64();
    let bucket_bytes: usize = publication.buckets.iter().map(|(_, v)| v.len()).sum();
    let table_bytes = publication.table.encode().len();
    let snapshot_bytes = bucket_bytes + table_bytes + 4 * pods + 8;
    let nodes = state.index().len();
    let memory = state.memory_bytes();
    // Churn tick: 5 pods each store one new 256-block prompt.
    let mut delta_bodies = Vec::new();
    for (i, cache) in caches.iter_mut().enumerate().take(5) {
        let id = format!("pod-{i}");
        let since = cache.seq();
        let text = preload_prompt("native-new", i, bytes);
        cache.insert_chain(&hasher.chain(&target, &Prompt::Text(text.into_bytes()), None));
        delta_bodies.push((
            id.clone(),
            cache
                .report(&id, "E", Some(since), Some("E"), &load)
                .to_string(),
        ));
    }
    let t = Instant::now();
    for (id, body) in &delta_bodies {
        let _ = state.apply_report(id, body.as_bytes(), 3, 0);
    }
    let p = state.publish(4);
    let churn_tick_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let idle = state.publish(5);
    let idle_publish_s = t.elapsed().as_secs_f64();
    Ok(json!({
        "indexNodes": nodes,
        "memoryBytes": memory,
        "bytesPerBlock": (memory as f64 / nodes.max(1) as f64 * 10.0).round() / 10.0,
        "snapshotBytes": snapshot_bytes,
        "snapshotBuckets": publication.buckets.len(),
        "podTableBytes": table_bytes,
        "reportBytesPerPod": report_bytes,
        "foldFullReportsMs": (fold_full_s * 1e4).round() / 10.0,
        "longestFoldStepMs": (longest_fold_s * 1e4).round() / 10.0,
        "publishFullMs": (publish_full_s * 1e4).round() / 10.0,
        "publications": publications,
        "longestPublicationMs": (longest_publish_s * 1e4).round() / 10.0,
        "churnTickMs": (churn_tick_s * 1e4).round() / 10.0,
        "churnTickBucketsWritten": p.buckets.len(),
        "idlePublishMs": (idle_publish_s * 1e4).round() / 10.0,
        "idleBucketsWritten": idle.buckets.len(),
    }))
}

/// Writes a `scale --pods N` run to `dir/pods-N.json` and re-renders
/// `dir/README.md`, the pool sizes run side by side.
pub fn write_scale(dir: &Path, run: &Value, command: &str) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut run = run.clone();
    run["command"] = json!(command);
    run["date"] = json!(String::from_utf8_lossy(
        &std::process::Command::new("date")
            .args(["-u", "+%Y-%m-%d %H:%M UTC"])
            .output()?
            .stdout
    )
    .trim());
    let pods = run["pods"].as_u64().unwrap_or(0);
    let text = serde_json::to_string_pretty(&run).map_err(io::Error::other)?;
    std::fs::write(dir.join(format!("pods-{pods}.json")), text + "\n")?;
    let mut runs: Vec<Value> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("pods-"))
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .filter_map(|t| serde_json::from_str(&t).ok())
        .collect();
    runs.sort_by_key(|r| r["pods"].as_u64());
    std::fs::write(dir.join("README.md"), scale_comparison(&runs))
}

/// One figure of a scale run.
type Figure<'a> = dyn Fn(&Value) -> Option<f64> + 'a;

/// The pool sizes of `runs` side by side, each figure also as a ratio to
/// the smallest pool's.
fn scale_comparison(runs: &[Value]) -> String {
    let per_block = |r: &Value| {
        r["indexMemoryBytes"].as_f64().unwrap_or(0.0)
            / r["indexNodes"].as_f64().unwrap_or(1.0).max(1.0)
    };
    let rows: [(&str, &Figure<'_>); 13] = [
        ("blocks indexed (`epp_prefix_tree_nodes`)", &|r| r["indexNodes"].as_f64()),
        ("index bytes per block in Envoy (`epp_index_memory_bytes` / nodes: tree, pending, mirror)", &|r| Some(per_block(r))),
        ("index bytes per block, native tree alone", &|r| r["native"]["bytesPerBlock"].as_f64()),
        ("filter's own time p50 (µs, 16 KiB prompts, `latencyUs`)", &|r| r["filterUsAtFullIndex"]["p50"].as_f64()),
        ("filter's own time p99 (µs)", &|r| r["filterUsAtFullIndex"]["p99"].as_f64()),
        ("first ingest (every pod's full report): s", &|r| r["ingestS"].as_f64()),
        ("  admin `/ready` p99 / ms", &|r| r["adminReadyDuringIngestMs"]["p99"].as_f64()),
        ("  main thread on CPU per probe p99 / ms", &|r| r["mainThreadOnCpuPerProbeMs"]["p99"].as_f64()),
        ("every pod restarted (resync while serving): s", &|r| r["resync"]["s"].as_f64()),
        ("  admin `/ready` p99 / ms", &|r| r["resync"]["adminReadyMs"]["p99"].as_f64()),
        ("  main thread on CPU per probe p99 / ms", &|r| r["resync"]["mainThreadOnCpuPerProbeMs"]["p99"].as_f64()),
        ("service tick, idle: main-thread ms per round", &|r| r["idle"]["msPerTick"].as_f64()),
        ("service tick, churn: main-thread ms per round", &|r| r["churn"]["msPerTick"].as_f64()),
    ];
    let mut out = String::from(
        "# Scale: one pool of N pods behind one Envoy, ~1M indexed blocks\n\n\
         `kvroute-bench scale --pods N` (kvroute-sim serving 128 pods per process, \
         2 Envoy workers, 1 s report interval). Ratios are to the first column.\n\n| figure |",
    );
    for r in runs {
        out.push_str(&format!(" {} pods |", r["pods"]));
    }
    out.push_str("\n|---|");
    out.push_str(&"---:|".repeat(runs.len()));
    out.push('\n');
    for (name, value) in rows {
        out.push_str(&format!("| {name} |"));
        let base = runs.first().and_then(value);
        for r in runs {
            match (value(r), base) {
                (Some(v), Some(b)) if b > 0.0 && r != &runs[0] => {
                    out.push_str(&format!(" {v:.1} ({:.2}×) |", v / b))
                }
                (Some(v), _) => out.push_str(&format!(" {v:.1} |")),
                _ => out.push_str(" – |"),
            }
        }
        out.push('\n');
    }
    for r in runs {
        out.push_str(&format!(
            "\n{} pods: `{}` ({}, {} build); service callbacks over 10 ms since start: {} of {}.\n",
            r["pods"],
            r["command"].as_str().unwrap_or(""),
            r["date"].as_str().unwrap_or(""),
            // Runs from before the native module record none: kvroute.wasm.
            r["module"].as_str().unwrap_or("wasm"),
            r["resync"]["serviceBusySinceStart"]["over10Ms"],
            r["resync"]["serviceBusySinceStart"]["callbacks"],
        ));
    }
    out.push_str(&format!(
        "\nMethod: {}.\n",
        runs.first()
            .and_then(|r| r["method"].as_str())
            .unwrap_or("")
    ));
    out
}

/// The scale section of the results document.
pub fn scale_markdown(s: &Value) -> String {
    let n = &s["native"];
    let f = |v: &Value, d: usize| v.as_f64().map_or("–".into(), |x| format!("{x:.d$}"));
    format!(
        "## Scale: {} indexed blocks over {} pods\n\n\
         | figure | value |\n|---|---:|\n\
         | blocks preloaded (64 sims, `--preload-prompts`) | {} |\n\
         | `epp_prefix_tree_nodes` after ingest | {} |\n\
         | `epp_index_memory_bytes` | {} MB |\n\
         | Envoy's resident memory after the ingest ({} build, 2 workers) | {} MB |\n\
         | sims + Envoy start until all blocks are indexed (full reports) | {} s wall; {} s Envoy main-thread CPU since its start |\n\
         | main-thread stall during that ingest: admin `/ready` latency p50 / p99 / max ({} probes, {} over 10 ms) | {} / {} / {} ms |\n\
         | of which Envoy's main thread on CPU (`schedstat`; the rest is waiting for a core) p50 / p99 / max ({} over 10 ms) | {} / {} / {} ms |\n\
         | the service's own callbacks since start (`epp_service_busy_us`): over 10 ms / all, longest at most | {} / {}, {} µs |\n\
         | service tick, idle (64 empty deltas + publish), main-thread CPU | {} ms per tick |\n\
         | service tick under churn ({} new blocks/s), main-thread CPU | {} ms per tick |\n\
         | filter's own time at full index (`latencyUs`) p50 / p99 | {} / {} µs |\n\
         | shared-data snapshot (native, exact) | {:.1} MB in {} buckets + {} B pod table |\n\
         | native: fold 64 full reports / publish everything | {} ms / {} ms |\n\
         | native: longest fold step ({} blocks, or parsing one report) / longest publication step ({} buckets) | {} ms / {} ms |\n\
         | native: churn tick (5 deltas of 256 blocks + publish) / idle publish | {} ms / {} ms |\n\
         | native: index bytes per block | {} |\n\n\
         Method: {}.\n\n",
        s["preloadedBlocks"],
        s["pods"],
        s["preloadedBlocks"],
        f(&s["indexNodes"], 0),
        f(
            &json!(s["indexMemoryBytes"].as_f64().unwrap_or(0.0) / 1e6),
            1
        ),
        s["module"].as_str().unwrap_or("?"),
        f(&json!(s["envoyRssBytes"].as_f64().unwrap_or(0.0) / 1e6), 1),
        ((s["clusterStartS"].as_f64().unwrap_or(0.0) + s["ingestS"].as_f64().unwrap_or(0.0)) * 10.0).round() / 10.0,
        s["ingestMainThreadCpuS"],
        s["adminReadyDuringIngestMs"]["probes"],
        s["adminReadyDuringIngestMs"]["over10Ms"],
        f(&s["adminReadyDuringIngestMs"]["p50"], 1),
        f(&s["adminReadyDuringIngestMs"]["p99"], 1),
        f(&s["adminReadyDuringIngestMs"]["max"], 1),
        s["mainThreadOnCpuPerProbeMs"]["over10Ms"],
        f(&s["mainThreadOnCpuPerProbeMs"]["p50"], 1),
        f(&s["mainThreadOnCpuPerProbeMs"]["p99"], 1),
        f(&s["mainThreadOnCpuPerProbeMs"]["max"], 1),
        f(&s["serviceBusyDuringIngest"]["over10Ms"], 0),
        f(&s["serviceBusyDuringIngest"]["callbacks"], 0),
        match &s["serviceBusyDuringIngest"]["maxAtMostUs"] {
            Value::String(text) => text.clone(),
            other => other.to_string(),
        },
        f(&s["idle"]["msPerTick"], 1),
        f(&s["churn"]["newBlocksPerS"], 0),
        f(&s["churn"]["msPerTick"], 1),
        s["filterUsAtFullIndex"]["p50"],
        s["filterUsAtFullIndex"]["p99"],
        n["snapshotBytes"].as_f64().unwrap_or(0.0) / 1e6,
        n["snapshotBuckets"],
        n["podTableBytes"],
        n["foldFullReportsMs"],
        n["publishFullMs"],
        FOLD_STEP_BLOCKS,
        PUBLISH_BUCKETS,
        n["longestFoldStepMs"],
        n["longestPublicationMs"],
        n["churnTickMs"],
        n["idlePublishMs"],
        n["bytesPerBlock"],
        s["method"].as_str().unwrap_or(""),
    )
}
