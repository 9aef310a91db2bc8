//! A hostile pod for the real-Envoy tests of the report service: a tiny
//! raw-TCP HTTP/1.1 server on 127.0.0.1 (std threads, one per connection)
//! that answers kvroute's report pulls and vLLM `/metrics` scrapes with one
//! chosen misbehaviour, and inference POSTs like a trivial pod (so it is
//! harmless wherever the router sends traffic). Every response closes its
//! connection; the server stops when dropped.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// What the hostile pod does with a pull.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// The report's headers announce a `content-length` far larger than what
    /// follows: a fragment of a report, then the connection closes.
    CutOffReport,
    /// A valid report trickled one byte per `every` (give a `reportTimeoutMs`
    /// much shorter than the whole body takes).
    TrickleReport { every: Duration },
    /// A valid-looking full report (one chain of distinct hashes) of at least
    /// `bytes` bytes, sent at full speed.
    OversizedReport { bytes: usize },
    /// A valid (empty, healthy) report, and a vLLM `/metrics` page with a
    /// line `}{` among real series (configure `metricsPath: "/metrics"`).
    BadMetrics,
}

#[derive(Default)]
struct Counters {
    report_pulls: AtomicU64,
    metrics_pulls: AtomicU64,
    inference: AtomicU64,
    other: AtomicU64,
}

/// The running server; stops (and stops its connection threads) on drop.
pub struct HostilePod {
    pub id: String,
    pub address: String,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
}

impl HostilePod {
    /// Binds a free loopback port and serves `behaviour` in the background.
    pub fn start(id: &str, behaviour: Behaviour) -> io::Result<HostilePod> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let address = listener.local_addr()?.to_string();
        listener.set_nonblocking(true)?;
        let counters = Arc::new(Counters::default());
        let stop = Arc::new(AtomicBool::new(false));
        let server = Server {
            id: id.to_string(),
            behaviour,
            counters: counters.clone(),
            stop: stop.clone(),
            big: Arc::new(OnceLock::new()),
        };
        std::thread::spawn(move || {
            while !server.stop.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let server = server.clone();
                        std::thread::spawn(move || {
                            let _ = server.serve(stream);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok(HostilePod {
            id: id.to_string(),
            address,
            counters,
            stop,
        })
    }

    /// Report pulls received (`GET /kvroute/v1/report...`).
    pub fn report_pulls(&self) -> u64 {
        self.counters.report_pulls.load(Ordering::SeqCst)
    }

    /// `/metrics` scrapes received.
    pub fn metrics_pulls(&self) -> u64 {
        self.counters.metrics_pulls.load(Ordering::SeqCst)
    }

    /// Inference POSTs answered.
    pub fn inference_requests(&self) -> u64 {
        self.counters.inference.load(Ordering::SeqCst)
    }

    /// Anything else (answered 404).
    pub fn other_requests(&self) -> u64 {
        self.counters.other.load(Ordering::SeqCst)
    }
}

impl Drop for HostilePod {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

#[derive(Clone)]
struct Server {
    id: String,
    behaviour: Behaviour,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
    /// The oversized report, built on first use.
    big: Arc<OnceLock<Vec<u8>>>,
}

struct Request {
    method: String,
    path: String,
}

impl Server {
    fn serve(&self, stream: TcpStream) -> io::Result<()> {
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        stream.set_write_timeout(Some(Duration::from_secs(10)))?;
        let mut reader = BufReader::new(stream.try_clone()?);
        let request = read_request(&mut reader)?;
        let mut stream = stream;
        let path = request.path.split('?').next().unwrap_or("");
        if request.method == "GET" && path.ends_with("/kvroute/v1/report") {
            self.counters.report_pulls.fetch_add(1, Ordering::SeqCst);
            self.report(&mut stream)
        } else if request.method == "GET" && path == "/metrics" {
            self.counters.metrics_pulls.fetch_add(1, Ordering::SeqCst);
            let page = if self.behaviour == Behaviour::BadMetrics {
                BAD_METRICS
            } else {
                GOOD_METRICS
            };
            respond(
                &mut stream,
                &self.id,
                "text/plain; version=0.0.4",
                page.as_bytes(),
            )
        } else if request.method == "POST" && path.starts_with("/v1/") {
            self.counters.inference.fetch_add(1, Ordering::SeqCst);
            let body = format!(
                r#"{{"id":"cmpl-hostile","object":"text_completion","model":"sim-model","choices":[{{"index":0,"text":"ok","finish_reason":"stop"}}],"usage":{{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2,"prompt_tokens_details":{{"cached_tokens":0}}}},"pod":"{}"}}"#,
                self.id
            );
            respond(&mut stream, &self.id, "application/json", body.as_bytes())
        } else {
            self.counters.other.fetch_add(1, Ordering::SeqCst);
            write!(
                stream,
                "HTTP/1.1 404 Not Found\r\nx-sim-pod: {}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                self.id
            )
        }
    }

    fn report(&self, stream: &mut TcpStream) -> io::Result<()> {
        match self.behaviour {
            Behaviour::CutOffReport => {
                let report = small_report(&self.id);
                write!(
                    stream,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                    report.len() + 100_000
                )?;
                stream.write_all(&report.as_bytes()[..report.len() / 2])?;
                stream.flush()?;
                // Let the fragment arrive before the close.
                std::thread::sleep(Duration::from_millis(20));
                stream.shutdown(Shutdown::Both)
            }
            Behaviour::TrickleReport { every } => {
                let report = small_report(&self.id);
                write!(
                    stream,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                    report.len()
                )?;
                stream.flush()?;
                for byte in report.as_bytes() {
                    if self.stop.load(Ordering::SeqCst) {
                        break;
                    }
                    // Fails once Envoy has reset the stream.
                    stream.write_all(std::slice::from_ref(byte))?;
                    stream.flush()?;
                    std::thread::sleep(every);
                }
                Ok(())
            }
            Behaviour::OversizedReport { bytes } => {
                let id = self.id.clone();
                let report = self.big.get_or_init(|| big_report(&id, bytes));
                write!(
                    stream,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    report.len()
                )?;
                stream.write_all(report)?;
                stream.flush()
            }
            Behaviour::BadMetrics => respond(
                stream,
                &self.id,
                "application/json",
                small_report(&self.id).as_bytes(),
            ),
        }
    }
}

/// An empty, healthy full report (valid protocol v1).
fn small_report(id: &str) -> String {
    format!(
        r#"{{"version":1,"podId":"{id}","epoch":"hostile","seq":0,"since":0,"full":true,"stored":[],"removed":[],"queueDepth":0,"running":0,"gpuUtilization":0.0,"health":1.0,"adapters":[]}}"#
    )
}

/// A full report of one chain of distinct hashes, at least `bytes` long.
fn big_report(id: &str, bytes: usize) -> Vec<u8> {
    let count = bytes / 19 + 1;
    let mut out = Vec::with_capacity(bytes + 512);
    out.extend_from_slice(
        format!(
            r#"{{"version":1,"podId":"{id}","epoch":"hostile-big","seq":{count},"since":0,"full":true,"stored":[{{"parent":null,"hashes":["#
        )
        .as_bytes(),
    );
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in 0..count {
        if i > 0 {
            out.push(b',');
        }
        h = h
            .wrapping_mul(0x5851_f42d_4c95_7f2d)
            .wrapping_add(1_442_695_040_888_963_407);
        out.extend_from_slice(format!("\"{h:016x}\"").as_bytes());
    }
    out.extend_from_slice(
        br#"]}],"removed":[],"queueDepth":0,"running":0,"gpuUtilization":0.0,"health":1.0,"adapters":[]}"#,
    );
    out
}

const GOOD_METRICS: &str = "\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name=\"sim-model\"} 0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name=\"sim-model\"} 0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name=\"sim-model\"} 0.1
";

/// Real series, then a line whose last `}` precedes its first `{`.
const BAD_METRICS: &str = "\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name=\"sim-model\"} 0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name=\"sim-model\"} 0
}{
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name=\"sim-model\"} 0.1
";

fn respond(stream: &mut TcpStream, id: &str, content_type: &str, body: &[u8]) -> io::Result<()> {
    write!(
        stream,
        "HTTP/1.1 200 OK\r\nx-sim-pod: {id}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )?;
    stream.write_all(body)?;
    stream.flush()
}

fn read_line(reader: &mut impl BufRead) -> io::Result<String> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed"));
    }
    Ok(line.trim_end_matches(['\r', '\n']).to_string())
}

/// Reads one request: its head, then its body (`content-length` or chunked,
/// trailers included), so closing afterwards never resets unread input.
fn read_request(reader: &mut impl BufRead) -> io::Result<Request> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let line = read_line(reader)?;
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let path = parts.next().unwrap_or("").to_string();
    let (mut length, mut chunked) = (0usize, false);
    loop {
        let line = read_line(reader)?;
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
            if name == "content-length" {
                length = value.parse().unwrap_or(0);
            } else if name == "transfer-encoding" && value.to_ascii_lowercase().contains("chunked")
            {
                chunked = true;
            }
        }
    }
    if chunked {
        loop {
            if Instant::now() > deadline {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "slow body"));
            }
            let size_line = read_line(reader)?;
            let size = usize::from_str_radix(size_line.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad chunk size"))?;
            if size == 0 {
                while !read_line(reader)?.is_empty() {}
                break;
            }
            let mut chunk = vec![0u8; size + 2];
            reader.read_exact(&mut chunk)?;
        }
    } else if length > 0 {
        io::copy(&mut reader.take(length as u64), &mut io::sink())?;
    }
    Ok(Request { method, path })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends `request` and reads the head and whatever body arrives before
    /// the close (or `limit`, or a 2 s silence).
    fn exchange(address: &str, request: &str, limit: usize) -> (String, Vec<u8>) {
        let mut stream = TcpStream::connect(address).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        let mut reader = BufReader::new(stream);
        let mut head = String::new();
        loop {
            let line = read_line(&mut reader).unwrap();
            if line.is_empty() {
                break;
            }
            head.push_str(&line);
            head.push('\n');
        }
        let mut body = Vec::new();
        let mut buf = [0u8; 65536];
        while body.len() < limit {
            match reader.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => body.extend_from_slice(&buf[..n]),
            }
        }
        (head, body)
    }

    fn content_length(head: &str) -> usize {
        head.lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .and_then(|v| v.parse().ok())
            .expect("content-length")
    }

    const REPORT: &str = "GET /kvroute/v1/report?since=0 HTTP/1.1\r\nhost: x\r\n\r\n";

    #[test]
    fn cut_off_report_closes_short_of_its_length() {
        let pod = HostilePod::start("h", Behaviour::CutOffReport).unwrap();
        let (head, body) = exchange(&pod.address, REPORT, usize::MAX);
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(!body.is_empty() && body.len() + 100_000 <= content_length(&head));
        assert_eq!(pod.report_pulls(), 1);
    }

    #[test]
    fn trickled_report_arrives_a_byte_at_a_time() {
        let every = Duration::from_millis(100);
        let pod = HostilePod::start("h", Behaviour::TrickleReport { every }).unwrap();
        let started = Instant::now();
        let (head, body) = exchange(&pod.address, REPORT, 4);
        assert!(content_length(&head) > 100, "{head}");
        assert_eq!(body.len(), 4);
        assert!(started.elapsed() >= every * 3, "{:?}", started.elapsed());
    }

    #[test]
    fn oversized_report_is_a_valid_full_report() {
        // Small enough to parse here; the tests use 34 MiB.
        let pod = HostilePod::start("h", Behaviour::OversizedReport { bytes: 1 << 20 }).unwrap();
        let (head, body) = exchange(&pod.address, REPORT, usize::MAX);
        assert_eq!(body.len(), content_length(&head));
        assert!(body.len() >= 1 << 20);
        let report = kvroute::report::parse_report(&body).expect("valid report");
        assert!(report.full);
        assert_eq!(report.pod_id, "h");
        let hashes: usize = report.stored.iter().map(|c| c.hashes.len()).sum();
        assert!(hashes > (1 << 20) / 20, "{hashes} hashes");
        let big = big_report("h", 34 << 20);
        assert!(big.len() > 32 << 20);
    }

    #[test]
    fn bad_metrics_pod_reports_well_and_scrapes_badly() {
        let pod = HostilePod::start("h", Behaviour::BadMetrics).unwrap();
        let (_, report) = exchange(&pod.address, REPORT, usize::MAX);
        kvroute::report::parse_report(&report).expect("valid report");
        let (head, metrics) = exchange(
            &pod.address,
            "GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n",
            usize::MAX,
        );
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let metrics = String::from_utf8(metrics).unwrap();
        assert!(metrics.lines().any(|l| l == "}{"), "{metrics}");
        assert_eq!(pod.metrics_pulls(), 1);
    }

    #[test]
    fn inference_is_answered_like_a_pod() {
        let pod = HostilePod::start("h", Behaviour::CutOffReport).unwrap();
        let body = r#"{"model":"sim-model","prompt":"hi"}"#;
        let request = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let (head, answer) = exchange(&pod.address, &request, usize::MAX);
        assert!(head.contains("x-sim-pod: h"), "{head}");
        let answer: serde_json::Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!(answer["choices"][0]["text"], "ok");
        assert_eq!(pod.inference_requests(), 1);
    }
}
