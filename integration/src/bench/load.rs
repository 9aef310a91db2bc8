//! The open-loop load generator: each request is sent at its scheduled
//! offset on its own thread, whatever the earlier ones are doing, streamed,
//! and timed at the client (time to the first server-sent event, time to
//! the last). Bounded in flight and in time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::workload::BenchRequest;
use crate::http;

/// What happened to one request.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub index: usize,
    /// Seconds from the run's start to the send, and to the end.
    pub sent_s: f64,
    pub end_s: f64,
    pub status: u16,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    /// From the final usage chunk.
    pub cached_tokens: Option<u64>,
    pub prompt_tokens: Option<u64>,
    /// `x-sim-pod` of the answer.
    pub pod: Option<String>,
    pub error: Option<String>,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.error.is_none() && self.status == 200
    }
}

/// Limits of one run.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_in_flight: usize,
    /// Per-request read timeout.
    pub request_timeout: Duration,
    /// No request is sent after this much time.
    pub max_send_window: Duration,
}

/// Sends `requests` to `addr` at their offsets; returns one outcome per
/// request (in request order) and the wall time of the run.
pub fn run(addr: &str, requests: &[BenchRequest], limits: Limits) -> (Vec<Outcome>, f64) {
    let start = Instant::now();
    let in_flight = AtomicUsize::new(0);
    let outcomes: Mutex<Vec<Outcome>> = Mutex::new(Vec::with_capacity(requests.len()));
    std::thread::scope(|scope| {
        for (index, request) in requests.iter().enumerate() {
            let due = start + Duration::from_secs_f64(request.at_s);
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            let skipped = if start.elapsed() > limits.max_send_window {
                Some("not sent: run time bound reached")
            } else if in_flight.load(Ordering::SeqCst) >= limits.max_in_flight {
                Some("not sent: in-flight bound reached")
            } else {
                None
            };
            if let Some(reason) = skipped {
                let at = start.elapsed().as_secs_f64();
                outcomes.lock().unwrap().push(Outcome {
                    index,
                    sent_s: at,
                    end_s: at,
                    error: Some(reason.into()),
                    ..Outcome::default()
                });
                continue;
            }
            in_flight.fetch_add(1, Ordering::SeqCst);
            let (in_flight, outcomes) = (&in_flight, &outcomes);
            std::thread::Builder::new()
                .stack_size(256 * 1024)
                .spawn_scoped(scope, move || {
                    let outcome = send_one(addr, index, request, start, limits.request_timeout);
                    outcomes.lock().unwrap().push(outcome);
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                })
                .expect("spawn request thread");
        }
    });
    let mut outcomes = outcomes.into_inner().unwrap();
    outcomes.sort_by_key(|o| o.index);
    (outcomes, start.elapsed().as_secs_f64())
}

fn send_one(
    addr: &str,
    index: usize,
    request: &BenchRequest,
    start: Instant,
    timeout: Duration,
) -> Outcome {
    let mut outcome = Outcome {
        index,
        sent_s: start.elapsed().as_secs_f64(),
        ..Outcome::default()
    };
    let result = http::stream_request(
        addr,
        "POST",
        request.path,
        &[
            ("content-type", "application/json"),
            ("x-session-id", &request.session),
        ],
        Some(request.body.as_bytes()),
        timeout,
    );
    outcome.end_s = start.elapsed().as_secs_f64();
    let response = match result {
        Ok(r) => r,
        Err(e) => {
            outcome.error = Some(format!("request failed: {e}"));
            return outcome;
        }
    };
    outcome.status = response.status;
    outcome.pod = response.header("x-sim-pod").map(String::from);
    if response.status != 200 {
        outcome.error = Some(format!(
            "HTTP {}: {}",
            response.status,
            response.rest.chars().take(200).collect::<String>()
        ));
        return outcome;
    }
    outcome.ttft_ms = response
        .first_event_after()
        .map(|d| d.as_secs_f64() * 1000.0);
    outcome.e2e_ms = response
        .events
        .last()
        .map(|e| (e.at - response.sent).as_secs_f64() * 1000.0);
    for event in response.events.iter().rev() {
        if let Some(usage) = event.json().and_then(|v| v.get("usage").cloned()) {
            outcome.prompt_tokens = usage["prompt_tokens"].as_u64();
            outcome.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
            break;
        }
    }
    if let Some(e) = response.error {
        outcome.error = Some(format!("stream broke off: {e}"));
    } else if !response.done {
        outcome.error = Some("stream ended without [DONE]".into());
    }
    outcome
}
