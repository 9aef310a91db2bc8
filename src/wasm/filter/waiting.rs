//! The filter's side of gateway waiting: holds paused requests in the
//! worker's [`WaitQueue`] (policy in [`crate::queueing`]) and resumes or
//! answers them from other callbacks.
//!
//! A request no pod can take ([`Outcome::NoEligiblePod`]) stays paused
//! (its body or headers callback returned `Pause`) and joins the queue of
//! the worker's root context under its HTTP context id. It leaves:
//! - **routed**, when a dispatch round places it: on the root tick (every
//!   [`super::TICK_MS`]), when a routed request of this worker ends (`on_log`),
//!   and before a new request of this worker is routed (so it cannot
//!   overtake); routed with the snapshot of that moment. A round offers
//!   room to the first `affinityWindow` requests of the head class; one
//!   holding out for the pod that caches its prefix stays (policy in
//!   [`crate::queueing`]), and an arrival behind the window waits its turn
//!   without being routed;
//! - **answered** 503 + `retry-after` when it waited `maxWaitMs`
//!   (`deadline`, on the tick), or when the queue is full (`queue_full`:
//!   the arrival, or a lower-priority entry it displaces);
//! - **gone**, when its client disconnects (`on_log` runs for its context).
//!
//! Host behaviour this relies on (Envoy 1.40, proxy-wasm ABI 0.2.1).
//! Verified in real Envoy by `integration/tests/waiting.rs`:
//! - `proxy_set_effective_context(http_context_id)` returns Ok for a
//!   paused request, from the root context's `on_tick` and from another
//!   request's callback (`on_log`, a new request's body callback), and
//!   makes the following host calls act on that request until the
//!   callback returns: `proxy_replace_header_map_value` on its request
//!   headers (the routing header, which the cluster then follows),
//!   `proxy_continue_stream(0)` (resumes it), and
//!   `proxy_send_local_response` (the 503 with `retry-after` arrives).
//! - A client that resets its connection while its request is paused:
//!   `on_log` runs for the request's context (within milliseconds), which
//!   removes it from the queue.
//! - Probed once by hand (a throwaway build logging the statuses on the
//!   tick after a request's `on_log`): `proxy_set_effective_context` of a
//!   request that ended returns BadArgument (2), as does an id never used;
//!   the effective context then stays the root, where
//!   `proxy_replace_header_map_value` on request headers returns
//!   BadArgument but `proxy_continue_stream(0)` returns **Ok** (a no-op).
//!   So a failed `set_effective_context` must stop there: the entry is
//!   dropped as gone.
//!
//! From Envoy's and proxy-wasm-cpp-host's source, consistent with the
//! tests: Envoy defers the resumption and the local reply until the
//! current VM callback returns (`addAfterVmCallAction`), so no callback
//! of the resumed request runs inside ours; `continueStream` forgets the
//! request's headers, so the routing header is set before it; a local
//! reply sets the VM's "stop next iteration" flag, which forces the
//! *current* HTTP callback's result to stop iteration (reset after each
//! callback). Hence a request is answered from another context only in
//! the root tick: answers due inside an HTTP callback (a displaced
//! entry, a failed re-route) are owed until the next tick.
//!
//! Every leave updates the gauge `epp_waiting_requests` (summed over
//! workers), records `epp_wait_time_ms`; answers count
//! `epp_wait_rejected_total{reason}` and `epp_requests_rejected_total`.

use std::collections::HashMap;
use std::time::Instant;

use serde_json::json;

use super::{answer, deliver, RoutedRequest, Worker};
use crate::config::Config;
use crate::queueing::{
    Admission, Placement, Priority, WaitPolicy, WaitQueue, WaitRejection, Waiter,
};
use crate::router::{Attempt, NoEligiblePod, Outcome, Rejected, RoutingRequest};
use crate::wasm::host;
use crate::wasm::logging::event;
use crate::wasm::metrics;

/// A paused request waiting for a pod.
pub struct WaitingRequest {
    request: RoutingRequest,
    request_id: String,
    /// Why no pod could take it when it arrived.
    rejected: Rejected,
}

/// An answer due to a request that left the queue inside another
/// request's callback, sent on the next tick.
struct Owed {
    context_id: u32,
    request_id: String,
    rejected: Rejected,
}

/// The worker's waiting requests and what is owed to those that left.
pub struct Waiting {
    queue: WaitQueue<WaitingRequest>,
    /// Routed from the queue, taken over by their context (by id).
    dispatched: HashMap<u32, RoutedRequest>,
    owed: Vec<Owed>,
    /// Queue length last added to `epp_waiting_requests`.
    exported_len: usize,
}

impl Waiting {
    pub fn new(config: &Config) -> Waiting {
        Waiting {
            queue: WaitQueue::new(WaitPolicy::from_config(config)),
            dispatched: HashMap::new(),
            owed: Vec::new(),
            exported_len: 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether an arrival of this class must wait behind the queue
    /// without being routed ([`WaitQueue::must_queue`]).
    pub fn must_queue(&self, priority: Priority) -> bool {
        self.queue.must_queue(priority)
    }

    /// The routing of request `context_id`, if the queue dispatched it.
    pub fn take_dispatched(&mut self, context_id: u32) -> Option<RoutedRequest> {
        self.dispatched.remove(&context_id)
    }

    /// Moves the shared gauge by this worker's change in queue length.
    fn export_len(&mut self) {
        let len = self.queue.len();
        let delta = len as i64 - self.exported_len as i64;
        if delta != 0 {
            metrics::gauge_add("epp_waiting_requests", delta);
        }
        self.exported_len = len;
    }
}

/// The 503 a waiting request gets when it cannot wait any longer.
fn rejection(reason: WaitRejection, policy: WaitPolicy, why: &Rejected) -> Rejected {
    let message = match reason {
        WaitRejection::Deadline => format!(
            "no inference pod could take the request within maxWaitMs ({} ms); {}",
            policy.max_wait_ms, why.message
        ),
        WaitRejection::QueueFull => format!(
            "kvroute's wait queue is full (maxWaitingRequests {}); {}",
            policy.max_waiting, why.message
        ),
    };
    Rejected {
        message,
        ..why.clone()
    }
}

fn log_end(waiter: &Waiter<WaitingRequest>, outcome: &str, now_ms: u64) {
    let waited_ms = waiter.waited_ms(now_ms);
    metrics::histogram("epp_wait_time_ms", waited_ms);
    event(
        log::Level::Info,
        "wait_end",
        json!({"requestId": waiter.item.request_id, "outcome": outcome, "waitedMs": waited_ms,
               "heldOutMs": waiter.holding_ms(now_ms)}),
    );
}

/// Puts request `context_id` in the queue, or returns its 503 when the
/// queue is full of requests of its class or higher.
pub fn admit(
    worker: &mut Worker,
    context_id: u32,
    priority_header: &str,
    request_id: &str,
    no_pod: NoEligiblePod,
) -> Result<(), Rejected> {
    let now_ms = host::now_ms();
    let priority = Priority::from_header(priority_header);
    let holding_out = no_pod.holding_out.map(|hold| hold.pod_id);
    let item = WaitingRequest {
        request: no_pod.request,
        request_id: request_id.to_string(),
        rejected: no_pod.rejected,
    };
    let waiting = &mut worker.waiting;
    let policy = waiting.queue.policy();
    let admission = waiting
        .queue
        .admit(context_id, priority, now_ms, holding_out.is_some(), item);
    let admitted = match admission {
        Admission::Queued => Ok(()),
        Admission::Displaced(victim) => {
            count(WaitRejection::QueueFull);
            log_end(&victim, WaitRejection::QueueFull.name(), now_ms);
            waiting.owed.push(Owed {
                context_id: victim.id,
                rejected: rejection(WaitRejection::QueueFull, policy, &victim.item.rejected),
                request_id: victim.item.request_id,
            });
            Ok(())
        }
        Admission::Refused(item) => {
            count(WaitRejection::QueueFull);
            Err(rejection(WaitRejection::QueueFull, policy, &item.rejected))
        }
    };
    if admitted.is_ok() {
        event(
            log::Level::Info,
            "wait",
            json!({"requestId": request_id, "priority": priority.name(), "waiting": waiting.queue.len(),
                   "holdingOutFor": holding_out}),
        );
    }
    waiting.export_len();
    admitted
}

fn count(reason: WaitRejection) {
    metrics::increment(&metrics::labelled(
        "epp_wait_rejected_total",
        "reason",
        reason.name(),
    ));
}

/// Request `context_id` ended: if it was waiting, its place is freed.
pub fn leave(worker: &mut Worker, context_id: u32) {
    let waiting = &mut worker.waiting;
    waiting.owed.retain(|owed| owed.context_id != context_id);
    if let Some(waiter) = waiting.queue.remove(context_id) {
        log_end(&waiter, "gone", host::now_ms());
        waiting.export_len();
    }
}

/// A dispatch round ([`WaitQueue::dispatch`]): routes waiting requests
/// while a pod can take them. Leaves the last placed request's context
/// effective.
pub fn dispatch(worker: &mut Worker) {
    if worker.waiting.queue.is_empty() {
        return;
    }
    // The queue is moved out for the round so placing can route through
    // the worker; an empty `WaitQueue` allocates nothing.
    let policy = worker.waiting.queue.policy();
    let mut queue = std::mem::replace(&mut worker.waiting.queue, WaitQueue::new(policy));
    queue.dispatch(host::now_ms(), |waiter| place(worker, waiter));
    worker.waiting.queue = queue;
    worker.waiting.export_len();
}

/// Routes one waiting request again and resumes it if a pod takes it.
fn place(worker: &mut Worker, waiter: &Waiter<WaitingRequest>) -> Placement {
    let now_ms = host::now_ms();
    if let Err(status) = host::set_effective_context(waiter.id) {
        log::warn!(
            "kvroute filter: waiting request {} is gone ({status})",
            waiter.item.request_id
        );
        log_end(waiter, "gone", now_ms);
        return Placement::Gone;
    }
    let started = Instant::now();
    let request_id = &waiter.item.request_id;
    let attempt = Attempt::Waiting {
        holding_ms: waiter.holding_ms(now_ms),
    };
    let routed = match worker.decide(waiter.item.request.clone(), request_id, attempt) {
        Outcome::NoEligiblePod(no_pod) if no_pod.holding_out.is_some() => {
            return Placement::HoldingOut
        }
        Outcome::NoEligiblePod(_) => return Placement::Wait,
        Outcome::Rejected(rejected) => Err(rejected),
        Outcome::Routed(routed) => {
            let elapsed_us = started.elapsed().as_micros() as u64;
            let model_label = worker.router.model_label(&routed.model).to_string();
            let mode = worker.router.config().upstream_mode;
            let log_route = worker.sample_route_log();
            deliver(
                &routed,
                mode,
                &model_label,
                (elapsed_us, log_route),
                request_id,
            )
        }
    };
    match routed {
        Ok(delivered) => {
            // Taken over by the request's context, which releases the
            // in-flight count in `on_log` whatever happens next.
            worker.waiting.dispatched.insert(waiter.id, delivered);
            if let Err(status) = host::continue_request() {
                log::error!("kvroute filter: cannot resume request {request_id}: {status}");
                owe(
                    worker,
                    waiter,
                    super::internal_error("cannot resume the request"),
                );
                log_end(waiter, "failed", now_ms);
                return Placement::Gone;
            }
            log_end(waiter, "routed", now_ms);
            Placement::Placed
        }
        Err(rejected) => {
            owe(worker, waiter, rejected);
            log_end(waiter, "rejected", now_ms);
            Placement::Gone
        }
    }
}

fn owe(worker: &mut Worker, waiter: &Waiter<WaitingRequest>, rejected: Rejected) {
    worker.waiting.owed.push(Owed {
        context_id: waiter.id,
        request_id: waiter.item.request_id.clone(),
        rejected,
    });
}

/// The root tick: owed answers, deadlines, then a dispatch round.
pub fn on_tick(worker: &mut Worker) {
    if worker.waiting.queue.is_empty() && worker.waiting.owed.is_empty() {
        return;
    }
    for owed in std::mem::take(&mut worker.waiting.owed) {
        if host::set_effective_context(owed.context_id).is_ok() {
            answer(&owed.request_id, &owed.rejected);
        }
    }
    let now_ms = host::now_ms();
    let policy = worker.waiting.queue.policy();
    for waiter in worker.waiting.queue.expire(now_ms) {
        count(WaitRejection::Deadline);
        log_end(&waiter, WaitRejection::Deadline.name(), now_ms);
        if host::set_effective_context(waiter.id).is_ok() {
            let rejected = rejection(WaitRejection::Deadline, policy, &waiter.item.rejected);
            answer(&waiter.item.request_id, &rejected);
        }
    }
    worker.waiting.export_len();
    dispatch(worker);
}
