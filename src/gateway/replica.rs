//! The replica listener, written once for every host: it serves this
//! replica's decision log to its peers ([`crate::replica`]) and nothing
//! else. It runs only on a listener of its own (never the public one):
//! the HTTP filter there is kvroute's in its replica role.
//!
//! A call is checked first ([`parse_log_request`]: the path, the shared
//! secret, GET, the query), and anything else is answered with its error.
//! A pull is answered at once when the log has decisions after its
//! `since` (or its `epoch` is not this replica's, or it asks no `wait`);
//! otherwise it is held, and answered on the replica worker's tick
//! ([`TICK_MS`]) as soon as a decision is logged, this replica's own loads
//! in flight differ from those the peer holds (the pull names their
//! digest), or its `wait` ends. The answer carries the log
//! ([`crate::replica::log::answer`]) and this replica's own requests in
//! flight per pod — never its peers', so nothing echoes between replicas.
//! A held pull whose peer hangs up is dropped; at most [`MAX_HELD`] are
//! held per worker (one per peer is the norm: a replica keeps one pull
//! pending per peer), more are refused with 503.

use serde_json::json;

use super::host::{Action, ReplicaHost, Stream};
use crate::config::{Config, ReplicasConfig};
use crate::replica::log::answer;
use crate::replica::wire::loads_digest;
use crate::replica::{
    encode_answer, parse_log_request, LogHead, LogRequest, PodInflight, REPLICA_KEY_HEADER,
};
use crate::snapshot::{PodTable, SlotLoad};

/// Period of the replica worker's tick while pulls are held: how late a
/// held pull learns of a new decision.
pub const TICK_MS: u64 = 5;

/// Most pulls held per worker.
pub const MAX_HELD: usize = 64;

struct HeldPull {
    id: u32,
    request: LogRequest,
    deadline_ms: u64,
}

/// Whether a pull has something to get: a decision after its `since`, or
/// loads other than those its peer holds.
fn has_news(head: Option<LogHead>, request: &LogRequest, loads: &[PodInflight]) -> bool {
    head.is_none_or(|h| h.has_news(request.since, request.epoch.as_deref()))
        || request.loads != Some(loads_digest(loads))
}

/// One worker's replica listener.
pub struct ReplicaServer<H: ReplicaHost> {
    pub host: H,
    config: Option<ReplicasConfig>,
    max_answer_bytes: usize,
    held: Vec<HeldPull>,
}

/// This replica's own loads by pod id, from a pod table and the loads per
/// slot (what the hosts' [`ReplicaHost::own_inflight`] returns).
pub fn loads_by_pod(table: &PodTable, loads: &[SlotLoad]) -> Vec<PodInflight> {
    table
        .pods
        .iter()
        .filter_map(|pod| {
            let load = *loads.get(pod.slot)?;
            (load != SlotLoad::default()).then(|| PodInflight {
                pod: pod.id.clone(),
                load,
            })
        })
        .collect()
}

impl<H: ReplicaHost> ReplicaServer<H> {
    pub fn new(config: &Config, host: H) -> ReplicaServer<H> {
        ReplicaServer {
            host,
            config: config.replicas.clone(),
            max_answer_bytes: config.max_report_bytes,
            held: Vec::new(),
        }
    }

    /// Whether pulls are held (the host ticks only then).
    pub fn has_work(&self) -> bool {
        !self.held.is_empty()
    }

    /// A call's request headers: answered, or held (paused).
    pub fn on_request_headers(&mut self, id: u32, stream: &mut impl Stream) -> Action {
        let method = stream.request_header(":method").ok().flatten();
        let path = stream.request_header(":path").ok().flatten();
        let key = stream.request_header(REPLICA_KEY_HEADER).ok().flatten();
        let text = |value: Option<Vec<u8>>| {
            String::from_utf8_lossy(&value.unwrap_or_default()).into_owned()
        };
        let Some(config) = &self.config else {
            return refuse(stream, 404, "this kvroute has no `replicas` configured");
        };
        let request = match parse_log_request(config, &text(method), &text(path), key.as_deref()) {
            Ok(request) => request,
            Err(refusal) => return refuse(stream, refusal.status, &refusal.message),
        };
        let loads = self.host.own_inflight();
        if has_news(self.host.replica_head(), &request, &loads) || request.wait_ms == 0 {
            let body = self.body(&request, loads);
            return deliver(stream, body);
        }
        if self.held.len() >= MAX_HELD {
            return refuse(
                stream,
                503,
                &format!("this worker holds {MAX_HELD} pulls already; ask again"),
            );
        }
        let deadline_ms = self.host.now_ms().saturating_add(request.wait_ms);
        self.held.push(HeldPull {
            id,
            request,
            deadline_ms,
        });
        Action::Pause
    }

    /// The tick: every held pull with something new, or at its deadline,
    /// is answered.
    pub fn on_tick(&mut self) {
        if self.held.is_empty() {
            return;
        }
        let now = self.host.now_ms();
        let head = self.host.replica_head();
        let loads = self.host.own_inflight();
        let (due, kept): (Vec<HeldPull>, Vec<HeldPull>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|pull| now >= pull.deadline_ms || has_news(head, &pull.request, &loads));
        self.held = kept;
        for pull in due {
            let body = self.body(&pull.request, loads.clone());
            if let Some(mut stream) = self.host.other(pull.id) {
                deliver(&mut stream, body);
            }
        }
    }

    /// The stream ended (answered, or the peer hung up).
    pub fn on_stream_end(&mut self, id: u32) {
        self.held.retain(|pull| pull.id != id);
    }

    /// The answer to `request`, or why there is none.
    fn body(&self, request: &LogRequest, loads: Vec<PodInflight>) -> Result<Vec<u8>, &'static str> {
        let head = self
            .host
            .replica_head()
            .ok_or("this replica has not started its log yet")?;
        Ok(encode_answer(&answer(
            head,
            request.since,
            request.epoch.as_deref(),
            |slot| self.host.replica_log(slot),
            loads,
            self.host.now_ms(),
            self.max_answer_bytes,
        )))
    }
}

fn deliver(stream: &mut impl Stream, body: Result<Vec<u8>, &'static str>) -> Action {
    match body {
        Ok(body) => {
            let headers = [("content-type", "application/json")];
            if let Err(error) = stream.send_response(200, &headers, &body) {
                log::warn!("kvroute replica: answering a peer failed: {error}");
            }
            Action::Pause
        }
        Err(why) => refuse(stream, 503, why),
    }
}

fn refuse(stream: &mut impl Stream, status: u32, message: &str) -> Action {
    let body = json!({"error": {"message": message, "code": status}}).to_string();
    let headers = [("content-type", "application/json")];
    if let Err(error) = stream.send_response(status, &headers, body.as_bytes()) {
        log::warn!("kvroute replica: refusing a call failed: {error}");
    }
    Action::Pause
}
