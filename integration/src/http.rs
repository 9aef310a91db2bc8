//! The project's one HTTP client, for tests, harnesses, the demo and the
//! benchmark's load generator: reqwest (HTTP/1.1, no TLS, no proxy) on a
//! shared two-thread tokio runtime, with one keep-alive connection pool per
//! process, as an OpenAI SDK client keeps one. Sync callers use the blocking
//! functions; the load generator awaits [`stream`] on [`runtime`]. Streamed
//! answers are read as server-sent events, each stamped with its arrival
//! time.

use std::io;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tokio::runtime::Runtime;

/// Timeout (whole request, body included) of the convenience functions.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// A complete response.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Header names lowercased, in arrival order.
    pub headers: Vec<(String, String)>,
    /// The body (lossily decoded as UTF-8).
    pub body: String,
}

impl Response {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }

    /// The body parsed as JSON.
    pub fn json(&self) -> Result<serde_json::Value, serde_json::Error> {
        serde_json::from_str(&self.body)
    }
}

/// One server-sent event.
#[derive(Debug, Clone)]
pub struct SseEvent {
    /// The `data:` lines joined with `\n` (`[DONE]` for the terminator).
    pub data: String,
    /// When the bytes completing this event arrived.
    pub at: Instant,
}

impl SseEvent {
    /// The data parsed as JSON (`None` for `[DONE]` or non-JSON data).
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_str(&self.data).ok()
    }
}

/// A streamed response.
#[derive(Debug, Clone)]
pub struct SseResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// When the request was sent.
    pub sent: Instant,
    /// Events in arrival order, `[DONE]` included.
    pub events: Vec<SseEvent>,
    /// `data: [DONE]` was received.
    pub done: bool,
    /// The stream broke off (connection reset, timeout, bad framing) after
    /// the headers; the events before it are kept.
    pub error: Option<String>,
    /// Bytes of the body that were not part of a complete event (a non-SSE
    /// error body, for instance).
    pub rest: String,
}

impl SseResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }

    /// Time from sending to the first event.
    pub fn first_event_after(&self) -> Option<Duration> {
        self.events.first().map(|e| e.at - self.sent)
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// The runtime every request runs on (two worker threads: the machines
/// this runs on have two cores, shared with the pods and the router).
pub fn runtime() -> &'static Runtime {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvroute-http")
            .enable_all()
            .build()
            .expect("HTTP client runtime")
    })
}

/// The process's client and its keep-alive pool.
fn client() -> &'static reqwest::Client {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        reqwest::Client::builder()
            .no_proxy()
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(5))
            .build()
            .expect("HTTP client")
    })
}

/// `GET path`.
pub fn get(addr: &str, path: &str) -> io::Result<Response> {
    request(addr, "GET", path, &[], None, DEFAULT_TIMEOUT)
}

/// `POST path` with a JSON body.
pub fn post_json(addr: &str, path: &str, body: &str) -> io::Result<Response> {
    request(
        addr,
        "POST",
        path,
        &[("content-type", "application/json")],
        Some(body.as_bytes()),
        DEFAULT_TIMEOUT,
    )
}

/// `POST path` with a JSON body, reading the answer as a server-sent event
/// stream.
pub fn post_sse(addr: &str, path: &str, body: &str) -> io::Result<SseResponse> {
    stream_request(
        addr,
        "POST",
        path,
        &[("content-type", "application/json")],
        Some(body.as_bytes()),
        DEFAULT_TIMEOUT,
    )
}

/// Polls `GET path` until it answers 200 or `timeout` passes.
pub fn wait_ready(addr: &str, path: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(r) = request(addr, "GET", path, &[], None, Duration::from_secs(2)) {
            if r.status == 200 {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    false
}

/// Sends one request and reads the whole response.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
    timeout: Duration,
) -> io::Result<Response> {
    let builder = build(
        addr,
        method,
        path,
        headers,
        body.map(<[u8]>::to_vec),
        timeout,
    )?;
    runtime().block_on(async {
        let response = builder.send().await.map_err(io_error)?;
        let status = response.status().as_u16();
        let headers = header_pairs(&response);
        let body = response.bytes().await.map_err(io_error)?;
        Ok(Response {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    })
}

/// Sends one request and reads the response body as server-sent events,
/// stamping each event with its arrival time. Errors after the headers are
/// reported in [`SseResponse::error`].
pub fn stream_request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
    timeout: Duration,
) -> io::Result<SseResponse> {
    runtime().block_on(stream(
        addr,
        method,
        path,
        headers,
        body.map(<[u8]>::to_vec),
        timeout,
    ))
}

/// [`stream_request`] for async callers on [`runtime`].
pub async fn stream(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
    timeout: Duration,
) -> io::Result<SseResponse> {
    let builder = build(addr, method, path, headers, body, timeout)?;
    let sent = Instant::now();
    let mut response = builder.send().await.map_err(io_error)?;
    let mut out = SseResponse {
        status: response.status().as_u16(),
        headers: header_pairs(&response),
        sent,
        events: Vec::new(),
        done: false,
        error: None,
        rest: String::new(),
    };
    let mut pending: Vec<u8> = Vec::new();
    loop {
        let piece = match response.chunk().await {
            Ok(Some(piece)) => piece,
            Ok(None) => break,
            Err(e) => {
                out.error = Some(io_error(e).to_string());
                break;
            }
        };
        let at = Instant::now();
        pending.extend_from_slice(&piece);
        while let Some((end, skip)) = event_end(&pending) {
            let raw: Vec<u8> = pending.drain(..end + skip).take(end).collect();
            if let Some(data) = event_data(&String::from_utf8_lossy(&raw)) {
                if data == "[DONE]" {
                    out.done = true;
                }
                out.events.push(SseEvent { data, at });
            }
        }
    }
    out.rest = String::from_utf8_lossy(&pending).into_owned();
    Ok(out)
}

fn build(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
    timeout: Duration,
) -> io::Result<reqwest::RequestBuilder> {
    let method = reqwest::Method::from_bytes(method.as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut builder = client()
        .request(method, format!("http://{addr}{path}"))
        .timeout(timeout);
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    if let Some(body) = body {
        builder = builder.body(body);
    }
    Ok(builder)
}

fn header_pairs(response: &reqwest::Response) -> Vec<(String, String)> {
    response
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect()
}

/// A reqwest error as an `io::Error` whose text carries the whole cause
/// chain (reqwest's own text names only the URL).
fn io_error(e: reqwest::Error) -> io::Error {
    let kind = if e.is_timeout() {
        io::ErrorKind::TimedOut
    } else {
        io::ErrorKind::Other
    };
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    io::Error::new(kind, text)
}

/// Position and length of the first event separator (a blank line).
fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// The data of one event block (`None` when it has no `data:` line).
fn event_data(block: &str) -> Option<String> {
    let lines: Vec<&str> = block
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect();
    (!lines.is_empty()).then(|| lines.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sse_blocks() {
        assert_eq!(event_data("data: {\"a\":1}"), Some("{\"a\":1}".into()));
        assert_eq!(event_data(": comment"), None);
        assert_eq!(
            event_data("event: x\ndata: a\ndata: b"),
            Some("a\nb".into())
        );
        assert_eq!(event_end(b"data: x\n\ndata: y"), Some((7, 2)));
        assert_eq!(event_end(b"data: x\r\n\r\n"), Some((7, 4)));
    }
}
