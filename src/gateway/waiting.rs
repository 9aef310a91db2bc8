//! The filter's side of gateway waiting: holds paused requests in the
//! worker's [`WaitQueue`] (policy in [`crate::queueing`]) and resumes or
//! answers them from other callbacks.
//!
//! A request no pod can take ([`Outcome::NoEligiblePod`]) stays paused
//! (its body or headers callback returned [`super::host::Action::Pause`])
//! and joins its worker's queue under its host id. It leaves:
//! - **routed**, when a dispatch round places it: on the worker's tick
//!   (every [`super::filter::TICK_MS`]), when a routed request of this
//!   worker ends, and before a new request of this worker is routed (so it
//!   cannot overtake); routed with the snapshot of that moment. A round
//!   offers room to the first `affinityWindow` requests of the head class;
//!   one holding out for the pod that caches its prefix stays (policy in
//!   [`crate::queueing`]), and an arrival behind the window waits its turn
//!   without being routed;
//! - **past the limit**, when it waited `maxWaitMs` (`deadline`, on the
//!   tick) or the queue is full (`queue_full`): under `onWaitLimit:
//!   "route"` the request next in line is routed past `maxQueue` (answered
//!   503 only when no pod is healthy); under `"reject"` it is answered 503
//!   + `retry-after` (the arrival, or a lower-priority entry it displaces);
//! - **gone**, when its client disconnects (its stream ends).
//!
//! Acting on a waiting request from another callback goes through
//! [`WorkerHost::other`]: the routing header is set on it, then it is
//! resumed. A host that can answer another request only at certain times
//! (proxy-wasm: in the root's tick, see `src/wasm/filter.rs`) says so with
//! [`WorkerHost::answers_others_now`]; answers due earlier are owed until
//! the next tick.
//!
//! Every leave updates the gauge `epp_waiting_requests` (summed over
//! workers), records `epp_wait_time_ms`; routing past the limit counts
//! `epp_wait_routed_past_limit_total{reason}`, answers
//! `epp_wait_rejected_total{reason}` and `epp_requests_rejected_total`.

use std::collections::HashMap;
use std::time::Instant;

use serde_json::json;

use super::events::event;
use super::filter::{answer, deliver, internal_error, RoutedRequest, Worker};
use super::host::{HostError, Stream, WorkerHost};
use super::metrics::{Metric, MetricBatch};
use crate::config::{Config, WaitLimitPolicy};
use crate::queueing::{
    Admission, Placement, Priority, WaitPolicy, WaitQueue, WaitRejection, Waiter,
};
use crate::router::{Attempt, NoEligiblePod, Outcome, Rejected, RoutingRequest};

/// A paused request waiting for a pod.
pub struct WaitingRequest {
    request: RoutingRequest,
    request_id: String,
    /// Why no pod could take it when it arrived.
    rejected: Rejected,
}

/// An answer due to a request that left the queue when the host could not
/// answer it, sent on the next tick.
struct Owed {
    id: u32,
    request_id: String,
    rejected: Rejected,
}

/// The worker's waiting requests and what is owed to those that left.
pub struct Waiting {
    queue: WaitQueue<WaitingRequest>,
    /// Routed from the queue, taken over by their request (by id).
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

    /// Whether the tick has anything to do here.
    pub fn has_work(&self) -> bool {
        !self.queue.is_empty() || !self.owed.is_empty()
    }

    /// Why an arrival of this class must wait behind the queue without
    /// being routed ([`WaitQueue::must_queue`]): why the entry next in
    /// line waits. `None`: it may be routed.
    pub fn must_queue(&self, priority: Priority) -> Option<&str> {
        self.queue
            .head()
            .filter(|_| self.queue.must_queue(priority))
            .map(|head| head.item.rejected.message.as_str())
    }

    /// The routing of request `id`, if the queue dispatched it.
    pub fn take_dispatched(&mut self, id: u32) -> Option<RoutedRequest> {
        self.dispatched.remove(&id)
    }

    /// Moves the shared gauge by this worker's change in queue length.
    fn export_len(&mut self, metrics: &mut MetricBatch) {
        let len = self.queue.len();
        let delta = len as i64 - self.exported_len as i64;
        if delta != 0 {
            metrics.add(Metric::WaitingRequests, "", delta);
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

fn log_end(metrics: &mut MetricBatch, waiter: &Waiter<WaitingRequest>, outcome: &str, now_ms: u64) {
    let waited_ms = waiter.waited_ms(now_ms);
    metrics.histogram(Metric::WaitTimeMs, waited_ms);
    event(
        log::Level::Info,
        "wait_end",
        json!({"requestId": waiter.item.request_id, "outcome": outcome, "waitedMs": waited_ms,
               "heldOutMs": waiter.holding_ms(now_ms)}),
    );
}

fn count(metrics: &mut MetricBatch, reason: WaitRejection) {
    metrics.increment_labelled(Metric::WaitRejected, reason.name());
}

/// Puts request `id` in the queue, or returns its 503 when the queue is
/// full of requests of its class or higher.
pub fn admit<H: WorkerHost>(
    worker: &mut Worker<H>,
    id: u32,
    priority: Priority,
    request_id: &str,
    no_pod: NoEligiblePod,
) -> Result<(), Rejected> {
    let now_ms = worker.host.now_ms();
    let holding_out = no_pod.holding_out.map(|hold| hold.pod_id);
    let item = WaitingRequest {
        request: no_pod.request,
        request_id: request_id.to_string(),
        rejected: no_pod.rejected,
    };
    let policy = worker.waiting.queue.policy();
    let admission = worker
        .waiting
        .queue
        .admit(id, priority, now_ms, holding_out.is_some(), item);
    let admitted = match admission {
        Admission::Queued => Ok(()),
        Admission::Displaced(leaving) => {
            past_limit(worker, leaving, WaitRejection::QueueFull);
            Ok(())
        }
        Admission::Refused(item) => {
            count(&mut worker.metrics, WaitRejection::QueueFull);
            Err(rejection(WaitRejection::QueueFull, policy, &item.rejected))
        }
    };
    if admitted.is_ok() {
        event(
            log::Level::Info,
            "wait",
            json!({"requestId": request_id, "priority": priority.name(), "waiting": worker.waiting.queue.len(),
                   "holdingOutFor": holding_out}),
        );
    }
    worker.waiting.export_len(&mut worker.metrics);
    worker.bound_metrics();
    admitted
}

/// Answers waiting request `id`, now if the host allows it, else on the
/// next tick.
fn answer_other<H: WorkerHost>(
    worker: &mut Worker<H>,
    id: u32,
    request_id: String,
    rejected: Rejected,
) {
    if !worker.host.answers_others_now() {
        worker.waiting.owed.push(Owed {
            id,
            request_id,
            rejected,
        });
        return;
    }
    if let Some(mut stream) = worker.host.other(id) {
        answer(&mut worker.metrics, &mut stream, &request_id, &rejected);
    }
}

/// Request `id` ended: if it was waiting, its place is freed.
pub fn leave<H: WorkerHost>(worker: &mut Worker<H>, id: u32) {
    worker.waiting.owed.retain(|owed| owed.id != id);
    if let Some(waiter) = worker.waiting.queue.remove(id) {
        let now_ms = worker.host.now_ms();
        log_end(&mut worker.metrics, &waiter, "gone", now_ms);
        worker.waiting.export_len(&mut worker.metrics);
    }
}

/// A dispatch round ([`WaitQueue::dispatch`]): routes waiting requests
/// while a pod can take them. May leave the host acting on the last
/// placed request ([`Stream::reactivate`] returns to the caller's).
pub fn dispatch<H: WorkerHost>(worker: &mut Worker<H>) {
    if worker.waiting.queue.is_empty() {
        return;
    }
    // A pod's queue is estimated as its report's plus this worker's
    // in-flight count less the count the report service read as the
    // report came in, which is the published one. A release not yet
    // published lowers the first and not the second: the estimate falls
    // one below the pod's queue for each, and the round sends that many
    // past `maxQueue` (proxy-wasm, whose releases wait for the next write
    // or tick: the pod queued 4 at maxQueue 2 in a CI run). Publishing
    // costs a write only while requests wait.
    worker.host.publish_releases();
    // The queue is moved out for the round so placing can route through
    // the worker; an empty `WaitQueue` allocates nothing.
    let policy = worker.waiting.queue.policy();
    let mut queue = std::mem::replace(&mut worker.waiting.queue, WaitQueue::new(policy));
    let now_ms = worker.host.now_ms();
    queue.dispatch(now_ms, |waiter| {
        let attempt = Attempt::Waiting {
            holding_ms: waiter.holding_ms(now_ms),
        };
        place(worker, waiter, attempt, "routed")
    });
    worker.waiting.queue = queue;
    worker.waiting.export_len(&mut worker.metrics);
    worker.bound_metrics();
}

/// A request the queue can hold no longer (`reason`), as `onWaitLimit`
/// says: routed past `maxQueue`, or answered 503.
fn past_limit<H: WorkerHost>(
    worker: &mut Worker<H>,
    waiter: Waiter<WaitingRequest>,
    reason: WaitRejection,
) {
    let policy = worker.waiting.queue.policy();
    if policy.on_limit == WaitLimitPolicy::Route {
        let outcome = match reason {
            WaitRejection::Deadline => "routed_past_deadline",
            WaitRejection::QueueFull => "routed_past_queue_full",
        };
        match place(worker, &waiter, Attempt::PastWaitLimit, outcome) {
            Placement::Placed => {
                worker
                    .metrics
                    .increment_labelled(Metric::WaitRoutedPastLimit, reason.name());
                return;
            }
            Placement::Gone => return,
            // No pod is healthy: the 503.
            Placement::Wait | Placement::HoldingOut => {}
        }
    }
    count(&mut worker.metrics, reason);
    log_end(
        &mut worker.metrics,
        &waiter,
        reason.name(),
        worker.host.now_ms(),
    );
    let rejected = rejection(reason, policy, &waiter.item.rejected);
    answer_other(worker, waiter.id, waiter.item.request_id, rejected);
}

/// Routes one waiting request again (`attempt`) and resumes it if a pod
/// takes it; `routed` names that outcome in its `wait_end` event.
fn place<H: WorkerHost>(
    worker: &mut Worker<H>,
    waiter: &Waiter<WaitingRequest>,
    attempt: Attempt,
    routed: &str,
) -> Placement {
    let now_ms = worker.host.now_ms();
    if worker.host.other(waiter.id).is_none() {
        log::warn!(
            "kvroute filter: waiting request {} is gone",
            waiter.item.request_id
        );
        log_end(&mut worker.metrics, waiter, "gone", now_ms);
        return Placement::Gone;
    }
    let started = Instant::now();
    let request_id = &waiter.item.request_id;
    let delivered = match worker.decide(waiter.item.request.clone(), request_id, attempt) {
        Outcome::NoEligiblePod(no_pod) if no_pod.holding_out.is_some() => {
            return Placement::HoldingOut
        }
        Outcome::NoEligiblePod(_) => return Placement::Wait,
        // Past the limit no pod is healthy: the caller answers why.
        Outcome::Rejected(_) if attempt == Attempt::PastWaitLimit => return Placement::Wait,
        Outcome::Rejected(rejected) => Err(rejected),
        Outcome::Routed(routed) => {
            let elapsed_us = started.elapsed().as_micros() as u64;
            let delivery = worker.delivery(&routed);
            match worker.host.other(waiter.id) {
                Some(mut stream) => deliver(
                    &mut worker.metrics,
                    &mut stream,
                    &routed,
                    delivery,
                    elapsed_us,
                    request_id,
                ),
                None => Err(internal_error("the waiting request is gone")),
            }
        }
    };
    match delivered {
        Ok(delivered) => {
            worker.host.adjust_inflight(&[delivered.arrival()]);
            // Taken over by the request, which releases the in-flight
            // count when its stream ends, whatever happens next.
            worker.waiting.dispatched.insert(waiter.id, delivered);
            let resumed = match worker.host.other(waiter.id) {
                Some(mut stream) => stream.resume(),
                None => Err(HostError("the request is gone".into())),
            };
            if let Err(error) = resumed {
                log::error!("kvroute filter: cannot resume request {request_id}: {error}");
                let rejected = internal_error("cannot resume the request");
                answer_other(worker, waiter.id, request_id.clone(), rejected);
                log_end(&mut worker.metrics, waiter, "failed", now_ms);
                return Placement::Gone;
            }
            log_end(&mut worker.metrics, waiter, routed, now_ms);
            Placement::Placed
        }
        Err(rejected) => {
            answer_other(worker, waiter.id, request_id.clone(), rejected);
            log_end(&mut worker.metrics, waiter, "rejected", now_ms);
            Placement::Gone
        }
    }
}

/// The tick: owed answers, deadlines, then a dispatch round.
pub fn on_tick<H: WorkerHost>(worker: &mut Worker<H>) {
    if !worker.waiting.has_work() {
        return;
    }
    for owed in std::mem::take(&mut worker.waiting.owed) {
        if let Some(mut stream) = worker.host.other(owed.id) {
            answer(
                &mut worker.metrics,
                &mut stream,
                &owed.request_id,
                &owed.rejected,
            );
        }
    }
    let now_ms = worker.host.now_ms();
    for waiter in worker.waiting.queue.expire(now_ms) {
        past_limit(worker, waiter, WaitRejection::Deadline);
    }
    worker.waiting.export_len(&mut worker.metrics);
    dispatch(worker);
}
