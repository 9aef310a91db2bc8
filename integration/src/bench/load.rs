//! The load generator, a client as real OpenAI clients are: async requests
//! over [`crate::http`]'s keep-alive connection pool, streamed, timed at
//! the client (time to the first server-sent event, time to the last).
//!
//! Two modes, per request: open loop (sent at its offset, whatever the
//! earlier ones are doing) and closed loop (an agent's next turn, sent the
//! moment the turn it [`follows`](BenchRequest::follows) completes). Bounded
//! in flight and in time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

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
    /// Per-request timeout (whole stream).
    pub request_timeout: Duration,
    /// No request is sent after this much time.
    pub max_send_window: Duration,
}

/// Sends `requests` to `addr`: open-loop requests at their offsets, each
/// closed-loop one when its predecessor completes (failed or not: the agent
/// goes on). Returns one outcome per request (in request order) and the
/// wall time of the run.
pub fn run(addr: &str, requests: &[BenchRequest], limits: Limits) -> (Vec<Outcome>, f64) {
    let requests: Arc<[BenchRequest]> = requests.into();
    let addr: Arc<str> = addr.into();
    let mut followers: Vec<Vec<usize>> = vec![Vec::new(); requests.len()];
    for (index, request) in requests.iter().enumerate() {
        if let Some(previous) = request.follows {
            followers[previous].push(index);
        }
    }
    http::runtime().block_on(async move {
        let start = Instant::now();
        let in_flight = Arc::new(AtomicUsize::new(0));
        let (done, mut finished) = mpsc::unbounded_channel::<Outcome>();
        let launch = |index: usize, due: Instant| {
            let (requests, addr, in_flight, done) = (
                requests.clone(),
                addr.clone(),
                in_flight.clone(),
                done.clone(),
            );
            tokio::spawn(async move {
                tokio::time::sleep_until(due.into()).await;
                let at = start.elapsed().as_secs_f64();
                let skipped = if start.elapsed() > limits.max_send_window {
                    Some("not sent: run time bound reached")
                } else if in_flight.load(Ordering::SeqCst) >= limits.max_in_flight {
                    Some("not sent: in-flight bound reached")
                } else {
                    None
                };
                let outcome = match skipped {
                    Some(reason) => Outcome {
                        index,
                        sent_s: at,
                        end_s: at,
                        error: Some(reason.into()),
                        ..Outcome::default()
                    },
                    None => {
                        in_flight.fetch_add(1, Ordering::SeqCst);
                        let outcome = send_one(
                            &addr,
                            index,
                            &requests[index],
                            start,
                            limits.request_timeout,
                        )
                        .await;
                        in_flight.fetch_sub(1, Ordering::SeqCst);
                        outcome
                    }
                };
                let _ = done.send(outcome);
            });
        };
        for (index, request) in requests.iter().enumerate() {
            if request.follows.is_none() {
                launch(index, start + Duration::from_secs_f64(request.at_s));
            }
        }
        let mut outcomes = Vec::with_capacity(requests.len());
        while outcomes.len() < requests.len() {
            let Some(outcome) = finished.recv().await else {
                break;
            };
            for &next in &followers[outcome.index] {
                launch(next, Instant::now());
            }
            outcomes.push(outcome);
        }
        outcomes.sort_by_key(|o| o.index);
        (outcomes, start.elapsed().as_secs_f64())
    })
}

async fn send_one(
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
    let result = http::stream(
        addr,
        "POST",
        request.path,
        &[
            ("content-type", "application/json"),
            ("x-session-id", &request.session),
        ],
        Some(request.body.clone().into_bytes()),
        timeout,
    )
    .await;
    outcome.end_s = start.elapsed().as_secs_f64();
    let response = match result {
        Ok(r) => r,
        Err(e) => {
            outcome.error = Some(format!("request failed: {e}"));
            return outcome;
        }
    };
    outcome.status = response.status;
    // A sim names itself; on real vLLM, kvroute's decision names the pod.
    outcome.pod = response
        .header("x-sim-pod")
        .or(response.header("x-kvroute-pod"))
        .map(String::from);
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
