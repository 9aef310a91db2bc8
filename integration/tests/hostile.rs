//! Issue 11 in real Envoy 1.40: the singleton report service survives
//! whatever a pod sends, and every request shape on a route path is routed
//! or answered deliberately.
//!
//! The hostile-pod tests each start three `kvroute-sim` pods, a hostile pod
//! (`kvroute_integration::hostile`, configured as a fourth pod) and Envoy —
//! or, for the pod killed mid-report, four sims — and let the hostile
//! answers happen for a few report ticks. Then a healthy sim holding a
//! prefix of its own is killed with SIGKILL, and the service must still
//! work: the victim's `epp_pod_health_score` drops below the exclusion
//! threshold within a bounded time, no request (its prefix or cold) goes to
//! it any more, the surviving pods keep being routed to, a prefix warmed on
//! a survivor is routed to it (the index still follows reports), and
//! Envoy's log has no `panicked`. On a frozen service the first check fails,
//! with the log's panic line in the message.
//!
//! Run serially (`--test-threads=1`): each test owns the machine.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use ::http as http_crate;
use kvroute_integration::harness::{filler_text as text, Cluster, ClusterSpec};
use kvroute_integration::hostile::{Behaviour, HostilePod};
use kvroute_integration::http;
use serde_json::{json, Value};

const SIM: &str = env!("CARGO_BIN_EXE_kvroute-sim");

/// Percent (`healthExclusionThreshold` 0.3 on the percent gauge).
const EXCLUSION_THRESHOLD: f64 = 30.0;

/// Ticks every 200 ms, pulls time out after 300 ms: a silent pod is
/// excluded about a second after its last good report.
fn config() -> Value {
    json!({
        "podReportIntervalMs": 200,
        "reportTimeoutMs": 300,
        "models": {"sim-model": {"baseModel": "sim-model"}}
    })
}

fn start(sims: usize, config: Value, extra_pods: &[&HostilePod]) -> Cluster {
    let mut spec = ClusterSpec::new(sims, config);
    spec.extra_pods = extra_pods
        .iter()
        .map(|pod| json!({"id": pod.id, "address": pod.address}))
        .collect();
    Cluster::start(SIM.as_ref(), spec).expect("cluster starts")
}

fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens})
}

/// A response from any of the clients here.
trait Answer {
    fn status(&self) -> u16;
    fn header(&self, name: &str) -> Option<&str>;
    fn body(&self) -> &str;
}

impl Answer for http::Response {
    fn status(&self) -> u16 {
        self.status
    }
    fn header(&self, name: &str) -> Option<&str> {
        http::Response::header(self, name)
    }
    fn body(&self) -> &str {
        &self.body
    }
}

/// A response read by the raw HTTP/1.1 or the HTTP/2 client.
struct Raw {
    status: u16,
    /// Names lowercased.
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer for Raw {
    fn status(&self) -> u16 {
        self.status
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    fn body(&self) -> &str {
        &self.body
    }
}

/// The pod that served a response, as the pod itself says; checks the
/// router's decision header agrees.
fn served_by(response: &impl Answer, what: &str) -> String {
    assert_eq!(response.status(), 200, "{what}: body {}", response.body());
    let pod = response
        .header("x-sim-pod")
        .unwrap_or_else(|| panic!("{what}: no x-sim-pod"))
        .to_string();
    assert_eq!(
        response.header("x-kvroute-pod"),
        Some(pod.as_str()),
        "{what}: router header vs pod"
    );
    pod
}

fn cached_tokens(body: &str) -> u64 {
    serde_json::from_str::<Value>(body).unwrap_or(Value::Null)["usage"]["prompt_tokens_details"]
        ["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// What Envoy's log says about panics, for failure messages.
fn diagnosis(cluster: &Cluster) -> String {
    let log = cluster.envoy.log();
    match log.lines().find(|l| l.contains("panicked")) {
        Some(line) => format!("Envoy's log has a panic: {line}"),
        None => "no `panicked` in Envoy's log".to_string(),
    }
}

fn health(cluster: &Cluster, pod: &str) -> Option<f64> {
    cluster
        .envoy
        .metric("epp_pod_health_score", &[("pod", pod)])
}

/// How long a killed pod may take to fall below the threshold: its last
/// good report (≤ 1 interval old), the grace of interval + timeout, the
/// linear decay over three intervals, and 2 s of slack for a busy machine.
fn decay_bound(cluster: &Cluster) -> Duration {
    let interval = cluster.config["podReportIntervalMs"].as_u64().unwrap();
    let timeout = cluster.config["reportTimeoutMs"].as_u64().unwrap();
    Duration::from_millis(5 * interval + timeout + 2000)
}

/// Waits until the hostile pod has been pulled `ticks` times (by `pulls`),
/// for at most `limit`; returns the count. The service of today's code dies
/// at the first hostile answer and pulls no more, which the checks after
/// this catch by behaviour.
fn let_hostile_ticks_pass(
    hostile: &HostilePod,
    pulls: impl Fn(&HostilePod) -> u64,
    ticks: u64,
    limit: Duration,
) -> u64 {
    let deadline = Instant::now() + limit;
    while pulls(hostile) < ticks && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let n = pulls(hostile);
    assert!(n >= 1, "the hostile pod was never pulled in {limit:?}");
    n
}

fn report_requests(cluster: &Cluster, pod: usize) -> u64 {
    cluster.sims[pod].stats()["reportRequests"]
        .as_u64()
        .unwrap_or(0)
}

/// Warms a prefix directly on sim `pod` (not through Envoy), then waits up
/// to `limit` until the service has pulled that pod twice since (the first
/// of those reports carries the prefix) and one more interval for the
/// publication. Returns the prefix and whether the pulls happened.
fn warm_directly(cluster: &Cluster, pod: usize, limit: Duration) -> (String, bool) {
    let id = &cluster.sims[pod].id;
    let prefix = text(&format!("held by {id}"), 8 * 1024);
    let pulls = report_requests(cluster, pod);
    let warm = http::post_json(
        &cluster.sims[pod].address,
        "/v1/completions",
        &completion(&format!("{prefix} warm"), 1).to_string(),
    )
    .expect("warm a pod directly");
    assert_eq!(warm.status, 200, "warming {id}: {}", warm.body);
    let deadline = Instant::now() + limit;
    while report_requests(cluster, pod) < pulls + 2 {
        if Instant::now() > deadline {
            return (prefix, false);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cluster.wait_reports(1);
    (prefix, true)
}

/// After the hostile answers: `victim` (holding a prefix of its own) is
/// killed with SIGKILL, and within [`decay_bound`] its health drops below
/// the threshold; afterwards no request (its prefix or cold) goes to it or
/// to `also_dead`, every request is answered 200, each pod in `survivors`
/// keeps getting traffic, the index still follows reports (a prefix warmed
/// on the first survivor is routed to it), and Envoy logged no panic.
fn kill_and_check(cluster: &mut Cluster, victim: usize, also_dead: &[&str], survivors: &[&str]) {
    let victim_id = cluster.sims[victim].id.clone();
    let before = health(cluster, &victim_id);
    assert!(
        before.is_some_and(|h| h >= EXCLUSION_THRESHOLD),
        "{victim_id} is eligible before the kill: health {before:?}"
    );
    // So that the cache pulls requests toward the victim (when the service
    // still folds reports; a frozen one is caught just below).
    let (prefix, _) = warm_directly(cluster, victim, Duration::from_secs(2));

    cluster.sims[victim].kill();
    let killed = Instant::now();
    let bound = decay_bound(cluster);
    let mut last = health(cluster, &victim_id);
    while last.is_none_or(|h| h >= EXCLUSION_THRESHOLD) {
        assert!(
            killed.elapsed() < bound,
            "{victim_id} was killed {:?} ago but its epp_pod_health_score is still {last:?} \
             (threshold {EXCLUSION_THRESHOLD}): the report service stopped publishing; {}",
            killed.elapsed(),
            diagnosis(cluster)
        );
        std::thread::sleep(Duration::from_millis(50));
        last = health(cluster, &victim_id);
    }
    eprintln!(
        "{victim_id}: health {last:?} {:?} after SIGKILL",
        killed.elapsed()
    );

    let mut per_pod = std::collections::BTreeMap::<String, u32>::new();
    for i in 0..16 {
        let prompt = if i % 4 == 0 {
            format!("{prefix} after kill {i}")
        } else {
            text(&format!("cold after kill {i}"), 512)
        };
        let r = cluster.post("/v1/completions", &completion(&prompt, 1));
        let what = format!("request {i} after killing {victim_id}");
        let pod = served_by(&r, &what);
        assert_ne!(pod, victim_id, "{what} went to the killed pod");
        assert!(
            !also_dead.contains(&pod.as_str()),
            "{what} went to dead pod {pod}"
        );
        *per_pod.entry(pod).or_default() += 1;
    }
    for survivor in survivors {
        assert!(
            per_pod.get(*survivor).copied().unwrap_or(0) > 0,
            "surviving pod {survivor} got no traffic: {per_pod:?}"
        );
    }

    // The index still changes: a prefix warmed on a survivor is routed to it.
    let holder = cluster.pod_index(survivors[0]);
    let (prefix, pulled) = warm_directly(cluster, holder, Duration::from_secs(5));
    assert!(
        pulled,
        "{} was not pulled twice in 5 s: the report service stopped pulling; {}",
        survivors[0],
        diagnosis(cluster)
    );
    let r = cluster.post(
        "/v1/completions",
        &completion(&format!("{prefix} question"), 1),
    );
    assert_eq!(
        served_by(&r, "request for the survivor's prefix"),
        survivors[0],
        "the prefix {} reported is routed elsewhere: the index no longer follows reports",
        survivors[0]
    );

    let ready = http::get(&cluster.envoy.admin, "/ready").map(|r| r.status);
    assert_eq!(ready.ok(), Some(200), "Envoy stays up");
    let log = cluster.envoy.log();
    assert!(
        !log.contains("panicked"),
        "Envoy's log has a panic: {}",
        diagnosis(cluster)
    );
}

/// Tests 1–4: three sims and `hostile`; the hostile behaviour for a few
/// ticks, then [`kill_and_check`] on pod-0.
fn service_survives(behaviour: Behaviour, config: Value, pulls: impl Fn(&HostilePod) -> u64) {
    let hostile = HostilePod::start("hostile", behaviour).expect("hostile pod starts");
    let mut cluster = start(3, config, &[&hostile]);
    let n = let_hostile_ticks_pass(&hostile, pulls, 3, Duration::from_secs(6));
    eprintln!("{behaviour:?}: hostile pod pulled {n} times");
    kill_and_check(&mut cluster, 0, &[], &["pod-1", "pod-2"]);
}

#[test]
fn report_cut_off_mid_body_does_not_stop_the_service() {
    service_survives(Behaviour::CutOffReport, config(), HostilePod::report_pulls);
}

#[test]
fn report_trickled_past_the_timeout_does_not_stop_the_service() {
    service_survives(
        Behaviour::TrickleReport {
            every: Duration::from_secs(1),
        },
        config(),
        HostilePod::report_pulls,
    );
}

#[test]
fn oversized_report_does_not_stop_the_service() {
    service_survives(
        // A full resync just over 32 MiB.
        Behaviour::OversizedReport {
            bytes: 34 * 1024 * 1024,
        },
        config(),
        HostilePod::report_pulls,
    );
}

#[test]
fn metrics_line_closing_before_it_opens_does_not_stop_the_service() {
    let mut config = config();
    config["metricsPath"] = json!("/metrics");
    service_survives(Behaviour::BadMetrics, config, HostilePod::metrics_pulls);
}

/// The precondition of the next test: `{"report": "stall"}` sends the
/// report's headers and half its body, then holds the rest.
#[test]
fn sim_stall_fault_sends_half_a_report_and_holds_the_rest() {
    let dir = std::env::temp_dir().join(format!("kvroute-stall-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config_file = dir.join("kvroute.json");
    std::fs::write(
        &config_file,
        json!({"pods": [{"id": "pod-0", "address": "127.0.0.1:1"}]}).to_string(),
    )
    .unwrap();
    let sim = kvroute_integration::harness::Sim::start(SIM.as_ref(), "pod-0", &config_file, &[])
        .expect("sim starts");
    let _ = std::fs::remove_dir_all(&dir);
    sim.fault(json!({"report": "stall"}));
    let mut stream = TcpStream::connect(&sim.address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_millis(1000)))
        .unwrap();
    stream
        .write_all(b"GET /kvroute/v1/report?since=0 HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    let silence = loop {
        match stream.read(&mut buf) {
            Ok(0) => panic!("closed: {}", String::from_utf8_lossy(&received)),
            Ok(n) => received.extend_from_slice(&buf[..n]),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(
            silence.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
        "{silence}"
    );
    let text = String::from_utf8_lossy(&received);
    let (head, body) = text.split_once("\r\n\r\n").expect("a response head");
    let length: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length: ")
                .map(str::to_string)
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("content-length in {head}"));
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body.len(), length / 2, "{head}\n{body}");
}

#[test]
fn pod_killed_mid_report_does_not_stop_the_service() {
    // Pulls may take 2 s, so the stalled report is still being received
    // when its pod dies.
    let mut config = config();
    config["reportTimeoutMs"] = json!(2000);
    let mut cluster = start(4, config, &[]);
    let before = report_requests(&cluster, 0);
    // Headers and half the report now, the rest in 5 s.
    cluster.sims[0].fault(json!({"report": "stall"}));
    let deadline = Instant::now() + Duration::from_secs(3);
    while report_requests(&cluster, 0) <= before {
        assert!(Instant::now() < deadline, "pod-0 was not pulled in 3 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The half report is on the wire; the pull is waiting for the rest.
    std::thread::sleep(Duration::from_millis(150));
    cluster.sims[0].kill();
    // A few ticks with pod-0 gone mid-report.
    cluster.wait_reports(3);
    kill_and_check(&mut cluster, 1, &["pod-0"], &["pod-2", "pod-3"]);
    let dead = health(&cluster, "pod-0");
    assert!(
        dead.is_some_and(|h| h < EXCLUSION_THRESHOLD),
        "pod-0, killed mid-report, still has health {dead:?}"
    );
}

// ---------------------------------------------------------------------------
// Request shapes.

/// Three sims; a 16 KiB prefix routed once through Envoy, whose pod (the
/// holder) has reported it. Returns the cluster, the prefix and the holder.
fn warmed_cluster() -> (Cluster, String, String) {
    let cluster = start(3, config(), &[]);
    let prefix = text("trailers policy", 16 * 1024);
    let first = cluster.post("/v1/completions", &completion(&format!("{prefix} Q0"), 4));
    let holder = served_by(&first, "warm-up request");
    cluster.wait_reports(3);
    (cluster, prefix, holder)
}

/// POSTs `body` to `path` over HTTP/2 with prior knowledge (h2c), in two
/// DATA frames followed by a trailers frame.
fn h2_post_with_trailers(address: &str, path: &str, body: &[u8]) -> Result<Raw, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let address = address.to_string();
    let path = path.to_string();
    let body = bytes::Bytes::copy_from_slice(body);
    runtime.block_on(async move {
        let exchange = async {
            let tcp = tokio::net::TcpStream::connect(&address)
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let (client, connection) = h2::client::handshake(tcp)
                .await
                .map_err(|e| format!("h2 handshake: {e}"))?;
            tokio::spawn(async move {
                let _ = connection.await;
            });
            let mut client = client.ready().await.map_err(|e| format!("ready: {e}"))?;
            let request = http_crate::Request::builder()
                .method("POST")
                .uri(format!("http://{address}{path}"))
                .header("content-type", "application/json")
                .body(())
                .map_err(|e| e.to_string())?;
            let (response, mut stream) = client
                .send_request(request, false)
                .map_err(|e| format!("send request: {e}"))?;
            let half = body.len() / 2;
            stream
                .send_data(body.slice(..half), false)
                .map_err(|e| format!("data: {e}"))?;
            stream
                .send_data(body.slice(half..), false)
                .map_err(|e| format!("data: {e}"))?;
            let mut trailers = http_crate::HeaderMap::new();
            trailers.insert(
                "x-client-checksum",
                http_crate::HeaderValue::from_static("4c9b"),
            );
            stream
                .send_trailers(trailers)
                .map_err(|e| format!("trailers: {e}"))?;
            let response = response.await.map_err(|e| format!("response: {e}"))?;
            let (parts, mut body) = response.into_parts();
            let mut bytes = Vec::new();
            while let Some(chunk) = body.data().await {
                let chunk = chunk.map_err(|e| format!("response body: {e}"))?;
                let _ = body.flow_control().release_capacity(chunk.len());
                bytes.extend_from_slice(&chunk);
            }
            let headers = parts
                .headers
                .iter()
                .map(|(k, v)| {
                    (
                        k.as_str().to_string(),
                        String::from_utf8_lossy(v.as_bytes()).into_owned(),
                    )
                })
                .collect();
            Ok(Raw {
                status: parts.status.as_u16(),
                headers,
                body: String::from_utf8_lossy(&bytes).into_owned(),
            })
        };
        tokio::time::timeout(Duration::from_secs(20), exchange)
            .await
            .map_err(|_| "no HTTP/2 answer in 20 s".to_string())?
    })
}

#[test]
fn http2_request_with_trailers_is_routed_by_cache() {
    let (cluster, prefix, holder) = warmed_cluster();
    for i in 0..3 {
        let body = completion(&format!("{prefix} h2 question {i}"), 4).to_string();
        let r = h2_post_with_trailers(&cluster.envoy.listen, "/v1/completions", body.as_bytes())
            .expect("HTTP/2 exchange with Envoy");
        assert_eq!(
            served_by(&r, &format!("HTTP/2 request {i} with trailers")),
            holder,
            "HTTP/2 request {i} with trailers left the pod holding its prefix"
        );
        let cached = cached_tokens(&r.body);
        assert!(cached >= 4000, "pod served {cached} cached tokens");
    }
}

/// A raw HTTP/1.1 exchange: writes `request` as is and reads the answer
/// (the request says `connection: close`).
fn raw_http1(address: &str, request: &[u8]) -> Raw {
    let mut stream = TcpStream::connect(address).expect("connect to Envoy");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    stream.write_all(request).expect("write request");
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).expect("status line");
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("header line");
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let get = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if let Some(length) = get("content-length").and_then(|l| l.parse::<usize>().ok()) {
        body.resize(length, 0);
        reader.read_exact(&mut body).expect("body");
    } else if get("transfer-encoding").is_some_and(|t| t.contains("chunked")) {
        loop {
            let mut size = String::new();
            reader.read_line(&mut size).expect("chunk size");
            let size = usize::from_str_radix(size.trim(), 16).expect("hex chunk size");
            if size == 0 {
                break;
            }
            let mut chunk = vec![0u8; size + 2];
            reader.read_exact(&mut chunk).expect("chunk");
            body.extend_from_slice(&chunk[..size]);
        }
    } else {
        let _ = reader.read_to_end(&mut body);
    }
    Raw {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

#[test]
fn http1_chunked_request_with_trailers_is_routed_by_cache() {
    let (cluster, prefix, holder) = warmed_cluster();
    for i in 0..3 {
        let body = completion(&format!("{prefix} chunked question {i}"), 4).to_string();
        let mut request = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
             transfer-encoding: chunked\r\ntrailer: x-client-checksum\r\nconnection: close\r\n\r\n",
            cluster.envoy.listen
        )
        .into_bytes();
        for chunk in body.as_bytes().chunks(5000) {
            request.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
            request.extend_from_slice(chunk);
            request.extend_from_slice(b"\r\n");
        }
        request.extend_from_slice(b"0\r\nx-client-checksum: 4c9b\r\n\r\n");
        let r = raw_http1(&cluster.envoy.listen, &request);
        assert_eq!(
            served_by(&r, &format!("chunked request {i} with trailers")),
            holder,
            "chunked request {i} with trailers left the pod holding its prefix"
        );
        let cached = cached_tokens(&r.body);
        assert!(cached >= 4000, "pod served {cached} cached tokens");
    }
}

#[test]
fn non_post_methods_on_route_paths_get_405_with_an_openai_error() {
    let cluster = start(2, config(), &[]);
    let chat =
        json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    for (method, path, body) in [
        ("GET", "/v1/chat/completions", None),
        ("PUT", "/v1/chat/completions", Some(chat.as_bytes())),
        ("DELETE", "/v1/chat/completions", None),
        ("GET", "/v1/completions", None),
    ] {
        let what = format!("{method} {path}");
        let r = http::request(
            &cluster.envoy.listen,
            method,
            path,
            &[("content-type", "application/json")],
            body,
            Duration::from_secs(10),
        )
        .expect("answer");
        assert_eq!(r.status, 405, "{what}: {}", r.body);
        let allow = r.header("allow").unwrap_or("");
        assert!(
            allow.split(',').any(|m| m.trim() == "POST"),
            "{what}: allow header {allow:?}"
        );
        let json = r
            .json()
            .unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {}", r.body));
        let error = &json["error"];
        assert_eq!(error["type"], "MethodNotAllowedError", "{what}: {json}");
        assert_eq!(error["code"], 405, "{what}: {json}");
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{what}: {json}"
        );
    }
    let reached: u64 = cluster.sims.iter().map(|s| s.requests()).sum();
    assert_eq!(reached, 0, "405s are answered by kvroute, not by a pod");
    // POST on the same path is still routed.
    let r = cluster.post(
        "/v1/chat/completions",
        &json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    served_by(&r, "POST after the 405s");
}
