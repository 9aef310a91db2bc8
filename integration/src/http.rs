//! A tiny std-only HTTP/1.1 client for tests and harnesses: one request per
//! connection (`Connection: close`), `Content-Length` or chunked bodies, and
//! a streaming reader that returns each server-sent event with its arrival
//! time.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Connect, read and write timeout of the convenience functions.
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
    let mut reader = send(addr, method, path, headers, body, timeout)?;
    let (status, headers) = read_head(&mut reader)?;
    let mut body = Vec::new();
    if method.eq_ignore_ascii_case("HEAD") || status == 204 || status == 304 {
        // No body.
    } else if is_chunked(&headers) {
        while let Some(chunk) = read_chunk(&mut reader)? {
            body.extend_from_slice(&chunk);
        }
    } else if let Some(length) = header(&headers, "content-length") {
        let length: usize = length
            .trim()
            .parse()
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad content-length"))?;
        body.resize(length, 0);
        reader.read_exact(&mut body)?;
    } else {
        reader.read_to_end(&mut body)?;
    }
    Ok(Response {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
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
    let sent = Instant::now();
    let mut reader = send(addr, method, path, headers, body, timeout)?;
    let (status, headers) = read_head(&mut reader)?;
    let mut response = SseResponse {
        status,
        headers,
        sent,
        events: Vec::new(),
        done: false,
        error: None,
        rest: String::new(),
    };
    let chunked = is_chunked(&response.headers);
    let mut remaining =
        header(&response.headers, "content-length").and_then(|l| l.trim().parse::<usize>().ok());
    let mut pending: Vec<u8> = Vec::new();
    loop {
        let piece = if chunked {
            read_chunk(&mut reader)
        } else if remaining == Some(0) {
            Ok(None)
        } else {
            let mut buf = [0u8; 8192];
            let want = remaining.map_or(buf.len(), |r| r.min(buf.len()));
            match reader.read(&mut buf[..want]) {
                Ok(0) => Ok(None),
                Ok(n) => {
                    remaining = remaining.map(|r| r - n);
                    Ok(Some(buf[..n].to_vec()))
                }
                Err(e) => Err(e),
            }
        };
        let piece = match piece {
            Ok(Some(piece)) => piece,
            Ok(None) => break,
            Err(e) => {
                response.error = Some(e.to_string());
                break;
            }
        };
        let at = Instant::now();
        pending.extend_from_slice(&piece);
        while let Some((end, skip)) = event_end(&pending) {
            let raw: Vec<u8> = pending.drain(..end + skip).take(end).collect();
            if let Some(data) = event_data(&String::from_utf8_lossy(&raw)) {
                if data == "[DONE]" {
                    response.done = true;
                }
                response.events.push(SseEvent { data, at });
            }
        }
    }
    response.rest = String::from_utf8_lossy(&pending).into_owned();
    Ok(response)
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

fn connect(addr: &str, timeout: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{addr} resolves to nothing"),
    );
    for socket in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&socket, timeout) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn send(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
    timeout: Duration,
) -> io::Result<BufReader<TcpStream>> {
    let mut stream = connect(addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.set_nodelay(true)?;
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        head.push_str(&format!("host: {addr}\r\n"));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(body) = body {
        head.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    head.push_str("connection: close\r\n\r\n");
    let mut message = head.into_bytes();
    if let Some(body) = body {
        message.extend_from_slice(body);
    }
    stream.write_all(&message)?;
    stream.flush()?;
    Ok(BufReader::new(stream))
}

fn read_line(reader: &mut impl BufRead) -> io::Result<String> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed",
        ));
    }
    Ok(line.trim_end_matches(['\r', '\n']).to_string())
}

fn read_head(reader: &mut impl BufRead) -> io::Result<(u16, Vec<(String, String)>)> {
    let status_line = read_line(reader)?;
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("bad status line {status_line:?}"),
            )
        })?;
    let mut headers = Vec::new();
    loop {
        let line = read_line(reader)?;
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    Ok((status, headers))
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    header(headers, "transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked"))
}

/// One chunk of a chunked body; `None` after the last (zero) chunk.
fn read_chunk(reader: &mut impl BufRead) -> io::Result<Option<Vec<u8>>> {
    let line = read_line(reader)?;
    let size_text = line.split(';').next().unwrap_or("").trim();
    let size = usize::from_str_radix(size_text, 16).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad chunk size {line:?}"),
        )
    })?;
    if size == 0 {
        // Trailers until the blank line; a close right away is fine too.
        while let Ok(line) = read_line(reader) {
            if line.is_empty() {
                break;
            }
        }
        return Ok(None);
    }
    let mut chunk = vec![0u8; size];
    reader.read_exact(&mut chunk)?;
    let mut crlf = [0u8; 2];
    reader.read_exact(&mut crlf)?;
    Ok(Some(chunk))
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

    #[test]
    fn reads_chunked_bodies() {
        let mut raw: &[u8] = b"4\r\nWiki\r\n5;x=y\r\npedia\r\n0\r\n\r\n";
        let mut out = Vec::new();
        while let Some(c) = read_chunk(&mut raw).unwrap() {
            out.extend(c);
        }
        assert_eq!(out, b"Wikipedia");
    }
}
