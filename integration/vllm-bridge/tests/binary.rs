//! The `kvroute-vllm-bridge` binary as deployed: started with its flags
//! while its pod is not up yet, it serves `/health`, `/metrics` and an
//! empty full report that kvroute's parser accepts; with `--tokenizer`,
//! it takes a byte-level BPE one and refuses to start with another; with
//! `--vllm-metrics`, its reports carry the size vLLM's metrics page states.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The body of `GET path` from `addr` (HTTP/1.1, connection closed).
fn get(addr: &str, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    Some(response.split_once("\r\n\r\n")?.1.to_string())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_binary_serves_before_its_pod_is_up() {
    let listen = format!("127.0.0.1:{}", free_port());
    let events = format!("tcp://127.0.0.1:{}", free_port());
    let _bridge = Killed(
        Command::new(env!("CARGO_BIN_EXE_kvroute-vllm-bridge"))
            .args(["--events", &events, "--listen", &listen])
            .args(["--pod-id", "vllm-0", "--base-model", "m"])
            .stdout(Stdio::null())
            .spawn()
            .expect("bridge starts"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(&listen, "/health").is_none() {
        assert!(Instant::now() < deadline, "no /health");
        std::thread::sleep(Duration::from_millis(20));
    }
    let report = get(&listen, "/kvroute/v1/report?since=0").expect("report");
    let report = kvroute::report::parse_report(report.as_bytes()).expect("valid report");
    assert!(report.full && report.stored.is_empty());
    assert_eq!(report.pod_id, "vllm-0");
    let metrics = get(&listen, "/metrics").expect("metrics");
    assert!(metrics.contains("\nkvbridge_blocks 0\n"), "{metrics}");
    assert!(
        metrics.contains("\nkvbridge_connects_total 0\n"),
        "{metrics}"
    );
}

#[test]
fn the_binary_takes_a_byte_level_tokenizer_and_refuses_others() {
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/");
    let listen = format!("127.0.0.1:{}", free_port());
    let events = format!("tcp://127.0.0.1:{}", free_port());
    let bridge = |tokenizer: &str| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_kvroute-vllm-bridge"));
        command
            .args(["--events", &events, "--listen", &listen])
            .args(["--pod-id", "vllm-0", "--base-model", "m"])
            .args(["--tokenizer", &format!("{data}{tokenizer}")]);
        command
    };
    let refused = bridge("metaspace.tokenizer.json")
        .output()
        .expect("bridge runs");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("metaspace.tokenizer.json: decoder is Metaspace (SentencePiece style"),
        "{stderr}"
    );
    let _bridge = Killed(
        bridge("byte-level-bpe.tokenizer.json")
            .stdout(Stdio::null())
            .spawn()
            .expect("bridge starts"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let metrics = loop {
        if let Some(metrics) = get(&listen, "/metrics") {
            break metrics;
        }
        assert!(Instant::now() < deadline, "no /metrics");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(metrics.contains("\nkvbridge_text_blocks 0\n"), "{metrics}");
    assert!(
        metrics.contains("\nkvbridge_blocks_skipped_unknown_token_total 0\n"),
        "{metrics}"
    );
}

/// Serves `page` to every request on a free port, as vLLM's `/metrics`.
fn serve_metrics(page: &'static str) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
    let addr = listener.local_addr().expect("bound").to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut request = [0u8; 4096];
            let _ = stream.read(&mut request);
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{page}",
                page.len()
            );
        }
    });
    format!("http://{addr}/metrics")
}

#[test]
fn reports_carry_the_cache_size_vllm_states() {
    let listen = format!("127.0.0.1:{}", free_port());
    let events = format!("tcp://127.0.0.1:{}", free_port());
    let metrics = serve_metrics(
        "vllm:cache_config_info{block_size=\"32\",enable_prefix_caching=\"True\",num_gpu_blocks=\"1975\"} 1.0\n",
    );
    let _bridge = Killed(
        Command::new(env!("CARGO_BIN_EXE_kvroute-vllm-bridge"))
            .args(["--events", &events, "--listen", &listen])
            .args(["--pod-id", "vllm-0", "--base-model", "m"])
            .args(["--vllm-metrics", &metrics])
            .stdout(Stdio::null())
            .spawn()
            .expect("bridge starts"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(body) = get(&listen, "/kvroute/v1/report?since=0") {
            let report = kvroute::report::parse_report(body.as_bytes()).expect("valid report");
            if report.kv_capacity_blocks.is_some() {
                assert_eq!(report.kv_capacity_blocks, Some(1975));
                assert_eq!(report.resident_blocks, Some(0), "nothing stored yet");
                break;
            }
        }
        assert!(Instant::now() < deadline, "no kvCapacityBlocks");
        std::thread::sleep(Duration::from_millis(20));
    }
    let page = get(&listen, "/metrics").expect("metrics");
    assert!(
        page.contains("\nkvbridge_kv_capacity_blocks 1975\n"),
        "{page}"
    );
}

#[test]
fn the_binary_refuses_an_endpoint_it_cannot_connect_to() {
    let refused = |flag: &str, endpoint: &str| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_kvroute-vllm-bridge"));
        command.args(["--pod-id", "vllm-0", "--base-model", "m"]);
        command.args(["--listen", "127.0.0.1:0"]);
        match flag {
            "--events" => command.args(["--events", endpoint]),
            _ => command.args(["--events", "ipc:///tmp/kv.sock", flag, endpoint]),
        };
        let output = command.output().expect("bridge runs");
        assert_eq!(output.status.code(), Some(2), "{flag} {endpoint}");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    // vLLM's own endpoint, copied as is: where it binds.
    let stderr = refused("--events", "tcp://*:5557");
    assert!(
        stderr.contains("--events tcp://*:5557: `*` is where vLLM binds"),
        "{stderr}"
    );
    let stderr = refused("--vllm-metrics", "localhost:8000/metrics");
    assert!(stderr.contains("must be an http:// URL"), "{stderr}");
    let stderr = refused("--replay", "inproc://kv");
    assert!(
        stderr.contains("--replay inproc://kv: Unknown transport type inproc"),
        "{stderr}"
    );
}
