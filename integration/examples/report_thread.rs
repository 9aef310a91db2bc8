//! Issue 26's question: pull pod reports on Envoy's main thread (the
//! config scheduler and HTTP callouts through Envoy's clusters, what the
//! native module does) or on a thread of the module's own? This runs the
//! second: kvroute's own [`ReportService`] on one thread, with a minimal
//! blocking HTTP/1.1 client per pod (keep-alive, long-poll), against the
//! same 4 pods and load as `integration/tests/long_poll.rs`'s
//! `measure_main_thread_cpu` (idle for 20 s, then 16 sequential fresh
//! 4 KiB prompts a second sent to the pods), and prints the CPU of the
//! service thread and the HTTP threads — to set beside that test's Envoy
//! main-thread CPU for the native module.
//!
//!     cargo build --release -p kvroute-integration --bin kvroute-sim
//!     cargo run --release -p kvroute-integration --example report_thread

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use kvroute::gateway::host::{HostError, HostResult, ServiceHost};
use kvroute::gateway::metrics::{Metric, MetricSink};
use kvroute::gateway::service::{ReportService, TICK_MS};
use kvroute::replica::LogHead;
use kvroute::snapshot::{InflightCount, PodTable, SlotLoad};
use kvroute_integration::harness::{filler_text, free_port, Sim};
use kvroute_integration::http;
use serde_json::json;

/// CPU seconds thread `tid` of this process has used.
fn thread_cpu_s(tid: i32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

fn gettid() -> i32 {
    std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|p| p.file_name()?.to_str()?.parse().ok())
        .unwrap_or(0)
}

/// One GET over a kept-alive connection: (status, body), `None` on failure.
fn get(
    stream: &mut Option<BufReader<TcpStream>>,
    address: &str,
    path: &str,
    timeout: Duration,
) -> Option<(String, Vec<u8>)> {
    if stream.is_none() {
        let s = TcpStream::connect(address).ok()?;
        *stream = Some(BufReader::new(s));
    }
    let reader = stream.as_mut()?;
    reader.get_ref().set_read_timeout(Some(timeout)).ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nhost: {address}\r\n\r\n");
    if reader.get_mut().write_all(request.as_bytes()).is_err() {
        *stream = None;
        return None;
    }
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let status = line.split_whitespace().nth(1)?.to_string();
    let (mut length, mut chunked) = (0usize, false);
    loop {
        line.clear();
        reader.read_line(&mut line).ok()?;
        let header = line.trim_end().to_ascii_lowercase();
        if header.is_empty() {
            break;
        }
        if let Some(v) = header.strip_prefix("content-length:") {
            length = v.trim().parse().ok()?;
        }
        if header.starts_with("transfer-encoding:") && header.contains("chunked") {
            chunked = true;
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            line.clear();
            reader.read_line(&mut line).ok()?;
            let size = usize::from_str_radix(line.trim(), 16).ok()?;
            let mut chunk = vec![0; size + 2];
            reader.read_exact(&mut chunk).ok()?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    } else {
        body.resize(length, 0);
        reader.read_exact(&mut body).ok()?;
    }
    Some((status, body))
}

/// A call for an HTTP thread, and its answer for the service thread.
struct Call {
    token: u64,
    path: String,
    timeout: Duration,
}

struct Answer {
    token: u64,
    reply: Option<(String, Vec<u8>)>,
}

/// The service's host on a module thread: each call goes to the thread of
/// its pod's address; the snapshot is kept in memory.
struct ThreadHost {
    next: u64,
    lanes: HashMap<String, Sender<Call>>,
    answers: Sender<Answer>,
    tids: std::sync::Arc<std::sync::Mutex<Vec<i32>>>,
    buckets: HashMap<u32, Vec<u8>>,
}

impl MetricSink for ThreadHost {
    fn define(&mut self, _: Metric, _: &str) {}
    fn add(&mut self, _: Metric, _: &str, _: i64) {}
    fn set(&mut self, _: Metric, _: &str, _: u64) {}
    fn record(&mut self, _: Metric, _: u64) {}
}

impl ServiceHost for ThreadHost {
    fn now_ms(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }

    fn dispatch_call(
        &mut self,
        _cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u64,
    ) -> HostResult<u64> {
        let value = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        };
        let (Some(address), Some(path)) = (value("x-envoy-original-dst-host"), value(":path"))
        else {
            return Err(HostError("no destination".into()));
        };
        self.next += 1;
        let token = self.next;
        let answers = self.answers.clone();
        let tids = self.tids.clone();
        let lane = self.lanes.entry(address.clone()).or_insert_with(|| {
            let (calls, incoming): (Sender<Call>, Receiver<Call>) = mpsc::channel();
            std::thread::spawn(move || {
                tids.lock().unwrap().push(gettid());
                let mut stream = None;
                for call in incoming {
                    let reply = get(&mut stream, &address, &call.path, call.timeout);
                    if reply.is_none() {
                        stream = None;
                    }
                    let _ = answers.send(Answer {
                        token: call.token,
                        reply,
                    });
                }
            });
            calls
        });
        lane.send(Call {
            token,
            path,
            timeout: Duration::from_millis(timeout_ms),
        })
        .map_err(|_| HostError("lane closed".into()))?;
        Ok(token)
    }

    fn write_bucket(&mut self, bucket: u32, value: Vec<u8>) {
        self.buckets.insert(bucket, value);
    }

    fn publish_table(&mut self, _table: &PodTable, _state: &[u8], _members_changed: bool) {}

    fn inflight_of(&mut self, _slot: usize) -> InflightCount {
        InflightCount::default()
    }

    // The measurement configures no `replicas`: nothing is logged or
    // received.
    fn store_replica_log(&mut self, _slot: u64, _value: Vec<u8>, _head: LogHead) {}

    fn publish_peer_loads(&mut self, _loads: Vec<SlotLoad>) {}

    fn publish_feed(&mut self, _feed: Vec<u8>) {}

    fn metric_sink(&mut self) -> &mut dyn MetricSink {
        self
    }
}

fn main() {
    let exe = std::env::current_exe().unwrap();
    let sim = exe.parent().unwrap().parent().unwrap().join("kvroute-sim");
    let dir = std::env::temp_dir().join(format!("kvroute-report-thread-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ports: Vec<u16> = (0..4).map(|_| free_port()).collect();
    let config = json!({
        "models": {"sim-model": {"baseModel": "sim-model"}},
        "pods": ports.iter().enumerate().map(|(i, p)| json!({"id": format!("pod-{i}"), "address": format!("127.0.0.1:{p}")})).collect::<Vec<_>>(),
    });
    let config_file = dir.join("kvroute.json");
    std::fs::write(&config_file, config.to_string()).unwrap();
    let args = ["--time-scale".to_string(), "0.02".to_string()];
    let sims: Vec<Sim> = ports
        .iter()
        .enumerate()
        .map(|(i, port)| {
            Sim::start_on(&sim, &format!("pod-{i}"), *port, &config_file, &args).unwrap()
        })
        .collect();
    let parsed = kvroute::config::Config::parse(config.to_string().as_bytes()).unwrap();
    let (answers, incoming) = mpsc::channel();
    let tids = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let service_tids = tids.clone();
    // The service thread: ticks every TICK_MS, takes answers as they come.
    std::thread::spawn(move || {
        service_tids.lock().unwrap().push(gettid());
        let mut service = ReportService::new(ThreadHost {
            next: 0,
            lanes: HashMap::new(),
            answers,
            tids: service_tids.clone(),
            buckets: HashMap::new(),
        });
        service.configure(parsed);
        let mut next_tick = Instant::now();
        loop {
            let wait = next_tick.saturating_duration_since(Instant::now());
            match incoming.recv_timeout(wait) {
                Ok(Answer { token, reply }) => {
                    let status = reply.as_ref().map(|r| r.0.clone());
                    let body = reply.map(|r| r.1).unwrap_or_default();
                    service.on_call_response(token, status.as_deref(), body.len(), |max| {
                        body[..max.min(body.len())].to_vec()
                    });
                }
                Err(RecvTimeoutError::Timeout) => {
                    service.on_tick();
                    next_tick = Instant::now() + Duration::from_millis(TICK_MS);
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    });
    let cpu = || {
        tids.lock()
            .unwrap()
            .iter()
            .map(|t| thread_cpu_s(*t))
            .sum::<f64>()
    };
    let window = Duration::from_secs(20);
    std::thread::sleep(Duration::from_secs(2));
    let before = cpu();
    std::thread::sleep(window);
    let idle = cpu() - before;
    let before = cpu();
    let started = Instant::now();
    let mut sent = 0;
    while started.elapsed() < window {
        let prompt = filler_text(&format!("thread {sent}"), 4096);
        let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4}).to_string();
        let _ = http::post_json(&sims[sent % sims.len()].address, "/v1/completions", &body);
        sent += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    let loaded = cpu() - before;
    println!(
        "module thread + {} HTTP threads: idle {idle:.2} s CPU per {window:?}; {sent} requests: {loaded:.2} s CPU",
        tids.lock().unwrap().len().saturating_sub(1)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
