//! Gateway waiting: what happens to a request no pod can take right now.
//!
//! When every pod is excluded (effective queue ≥ `maxQueue`, or health below
//! `healthExclusionThreshold`) and `onNoEligiblePod` is `"wait"`, the
//! request is not answered 503 at once: it waits in a [`WaitQueue`] (one
//! per proxy worker) and is routed again, with what is known then, when
//! capacity may have freed. Answering at once makes clients retry: arrival
//! order is lost, retries land wherever a slot frees, cache affinity
//! vanishes and the queues stay full — a collapse the router itself causes.
//!
//! The policy, for entries identified by a caller id (the proxy's request
//! context id):
//! - **Order.** Three [`Priority`] classes, `critical` before `standard`
//!   before `sheddable`; FIFO inside a class. A class is served only when
//!   every higher class is empty.
//! - **Bound.** At most `maxWaitingRequests` entries
//!   ([`WaitPolicy::max_waiting`]), so memory is bounded whatever the
//!   load. An arrival when the queue is full, under `onWaitLimit: "route"`
//!   ([`WaitPolicy::on_limit`]), joins it and the entry next in line (the
//!   head of the highest class) leaves for a pod past `maxQueue`: the
//!   order of service is kept and nothing is refused. Under `"reject"` it
//!   displaces the *newest* entry of the lowest class strictly below its
//!   own (that entry is answered `queue_full`); with no such entry the
//!   arrival itself is refused (`queue_full`), so sheddable traffic is the
//!   first dropped.
//! - **Deadline.** An entry that has waited `maxWaitMs`
//!   ([`WaitPolicy::max_wait_ms`]) leaves (`deadline`): for a pod past
//!   `maxQueue`, or with a 503. Within a class entries are in arrival
//!   order, so only each class's head is checked.
//! - **Dispatch** ([`WaitQueue::dispatch`]), run when capacity may have
//!   freed (a request on this worker ended, or a periodic tick): the first
//!   `affinityWindow` entries ([`WaitPolicy::window`]) of the highest
//!   non-empty class are offered, oldest first, to the caller, which
//!   routes each again with what is known now:
//!   - *placed* (or *gone*): it leaves, the next entry is offered;
//!   - *no pod can take it* ([`Placement::Wait`]): the round ends.
//!     Exclusions do not depend on the request (health and queue are per
//!     pod), so no later entry could be placed either;
//!   - *holding out* ([`Placement::HoldingOut`]): a pod has room, but a
//!     full pod caches more of its prompt
//!     ([`crate::router::HoldOut`]): it stays, the next entry is offered.
//!
//!   So when a pod frees, the oldest entry in the window that wants *that*
//!   pod takes it: cache-affine dispatch, in the manner of delay
//!   scheduling (Zaharia et al., EuroSys 2010). Sending the head to
//!   whichever pod freed first throws its cache away under saturation:
//!   prefill work grows, queues stay full and hits vanish for good (on
//!   the Mooncake trace at 2× cache-blind capacity, 35 % of the
//!   pooled-cache bound instead of 95 %). An entry holds out for at most
//!   the router's bound ([`crate::router::Router::hold_bound_ms`]),
//!   counted from the first time it declined a pod with room
//!   ([`Waiter::holding_ms`]), not from its arrival: under saturation
//!   every entry waits long before it is offered any room, and a bound on
//!   its age would expire unused. Past the bound it takes any pod, so
//!   nobody starves. A lower class is offered room only when every higher
//!   class is empty: classes stay strict, and within a class an entry is
//!   overtaken only by younger ones that want a pod it declined.
//! - **Arrivals** are routed at once only where a round would have
//!   offered them room: when no higher class waits, fewer than
//!   `affinityWindow` entries of their class do, and the last round did
//!   not end, in their class or a higher one, because no pod could take
//!   an entry ([`WaitQueue::must_queue`]); otherwise they join the queue
//!   behind the others. The host runs a round just before it routes an
//!   arrival, but a report can free room between the two (the report
//!   service publishes on another thread): the entry that waited for that
//!   room takes it at the next round, not the arrival.
//! - **Leaving.** [`WaitQueue::remove`] frees the place of a request whose
//!   client went away.
//!
//! Costs: admit O(1) (a displacement pops the tail of a class); a dispatch
//! round offers at most `affinityWindow` entries that stay plus those
//! placed, and removes each placed one in O(`affinityWindow`); expiry
//! O(expired + classes), removal O(n) with n ≤ `maxWaitingRequests`.
//!
//! The module is host-agnostic (no proxy-wasm), so the offline replay can
//! apply the same policy.

use std::collections::VecDeque;

use crate::config::{Config, WaitLimitPolicy};

/// Request header naming a request's [`Priority`].
pub const PRIORITY_HEADER: &str = "x-kvroute-priority";

/// Priority class of a waiting request, as Kubernetes' Gateway API
/// Inference Extension names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum Priority {
    /// Served first, displaces lower classes when the queue is full.
    Critical,
    #[default]
    Standard,
    /// Served last, the first dropped when the queue is full.
    Sheddable,
}

impl Priority {
    /// Every class, highest first.
    pub const ALL: [Priority; 3] = [Priority::Critical, Priority::Standard, Priority::Sheddable];

    /// The class named by a [`PRIORITY_HEADER`] value; absent or unknown
    /// values are `standard`.
    pub fn from_header(value: &str) -> Priority {
        match value.trim().to_ascii_lowercase().as_str() {
            "critical" => Priority::Critical,
            "sheddable" => Priority::Sheddable,
            _ => Priority::Standard,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Priority::Critical => "critical",
            Priority::Standard => "standard",
            Priority::Sheddable => "sheddable",
        }
    }
}

/// Why a waiting (or arriving) request left the queue unrouted: for a pod
/// past `maxQueue`, or with a 503 (`onWaitLimit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitRejection {
    /// It waited `maxWaitMs`.
    Deadline,
    /// The queue was full (it arrived, or was displaced by a higher class).
    QueueFull,
}

impl WaitRejection {
    pub const ALL: [WaitRejection; 2] = [WaitRejection::Deadline, WaitRejection::QueueFull];

    /// Metric label value.
    pub fn name(self) -> &'static str {
        match self {
            WaitRejection::Deadline => "deadline",
            WaitRejection::QueueFull => "queue_full",
        }
    }
}

/// The bounds of a [`WaitQueue`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitPolicy {
    /// Most entries held (`maxWaitingRequests`).
    pub max_waiting: usize,
    /// Longest wait before the request is answered (`maxWaitMs`).
    pub max_wait_ms: u64,
    /// Entries of the head class a dispatch round offers room to
    /// (`affinityWindow`).
    pub window: usize,
    /// What leaves a full queue (`onWaitLimit`): `Route`, the entry next
    /// in line, to a pod past `maxQueue`; `Reject`, the newest entry of a
    /// lower class than the arrival, or the arrival, with a 503.
    pub on_limit: WaitLimitPolicy,
}

impl WaitPolicy {
    pub fn from_config(config: &Config) -> WaitPolicy {
        WaitPolicy {
            max_waiting: config.max_waiting_requests,
            max_wait_ms: config.max_wait_ms,
            window: config.affinity_window,
            on_limit: config.on_wait_limit,
        }
    }
}

/// One waiting request.
#[derive(Debug, Clone, PartialEq)]
pub struct Waiter<T> {
    pub id: u32,
    pub priority: Priority,
    /// When it joined the queue.
    pub since_ms: u64,
    /// When it first held out for a busier pod (declined a pod with room).
    pub holding_since_ms: Option<u64>,
    pub item: T,
}

impl<T> Waiter<T> {
    /// How long it has waited at `now_ms`.
    pub fn waited_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.since_ms)
    }

    /// How long it has held out for a busier pod at `now_ms` (0 if never).
    pub fn holding_ms(&self, now_ms: u64) -> u64 {
        self.holding_since_ms
            .map_or(0, |since| now_ms.saturating_sub(since))
    }
}

/// What [`WaitQueue::admit`] did with an arrival.
#[derive(Debug, PartialEq)]
pub enum Admission<T> {
    /// Waiting now.
    Queued,
    /// Waiting now, in place of this entry, which leaves the queue
    /// ([`WaitRejection::QueueFull`]): under `onWaitLimit: "route"` the
    /// entry next in line, for a pod past `maxQueue`; under `"reject"` the
    /// newest entry of a lower class, for its 503.
    Displaced(Waiter<T>),
    /// Not admitted: the queue is full of entries of its class or higher.
    Refused(T),
}

/// What the caller of [`WaitQueue::dispatch`] did with the head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Routed: it leaves the queue, the next head is tried.
    Placed,
    /// Its request no longer exists (answered or gone): it leaves the
    /// queue, the next head is tried.
    Gone,
    /// No pod can take it yet: it stays at the head, the round ends.
    Wait,
    /// A pod could take it, but it holds out for a busier pod that caches
    /// more of its prefix: it stays, the next entry in the window is tried.
    HoldingOut,
}

/// See the module documentation.
#[derive(Debug)]
pub struct WaitQueue<T> {
    policy: WaitPolicy,
    critical: VecDeque<Waiter<T>>,
    standard: VecDeque<Waiter<T>>,
    sheddable: VecDeque<Waiter<T>>,
    /// The class whose entry the last round could place nowhere
    /// ([`Placement::Wait`]), if it ended so.
    blocked: Option<Priority>,
}

impl<T> WaitQueue<T> {
    pub fn new(policy: WaitPolicy) -> WaitQueue<T> {
        WaitQueue {
            policy,
            critical: VecDeque::new(),
            standard: VecDeque::new(),
            sheddable: VecDeque::new(),
            blocked: None,
        }
    }

    pub fn policy(&self) -> WaitPolicy {
        self.policy
    }

    pub fn len(&self) -> usize {
        self.critical.len() + self.standard.len() + self.sheddable.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn class(&mut self, priority: Priority) -> &mut VecDeque<Waiter<T>> {
        match priority {
            Priority::Critical => &mut self.critical,
            Priority::Standard => &mut self.standard,
            Priority::Sheddable => &mut self.sheddable,
        }
    }

    fn class_ref(&self, priority: Priority) -> &VecDeque<Waiter<T>> {
        match priority {
            Priority::Critical => &self.critical,
            Priority::Standard => &self.standard,
            Priority::Sheddable => &self.sheddable,
        }
    }

    /// The entry next in line: the oldest of the highest class.
    pub fn head(&self) -> Option<&Waiter<T>> {
        self.head_priority().and_then(|p| self.class_ref(p).front())
    }

    /// The highest non-empty class.
    fn head_priority(&self) -> Option<Priority> {
        Priority::ALL.into_iter().find(|p| self.class_len(*p) > 0)
    }

    fn class_len(&self, priority: Priority) -> usize {
        self.class_ref(priority).len()
    }

    /// Adds request `id` of class `priority`, arriving at `now_ms`;
    /// `holding_out`: it declined a pod with room ([`Placement::HoldingOut`]).
    pub fn admit(
        &mut self,
        id: u32,
        priority: Priority,
        now_ms: u64,
        holding_out: bool,
        item: T,
    ) -> Admission<T> {
        let waiter = Waiter {
            id,
            priority,
            since_ms: now_ms,
            holding_since_ms: holding_out.then_some(now_ms),
            item,
        };
        if self.len() < self.policy.max_waiting {
            self.class(priority).push_back(waiter);
            return Admission::Queued;
        }
        if self.policy.on_limit == WaitLimitPolicy::Route {
            let next = self.head_priority().and_then(|p| self.class(p).pop_front());
            self.class(priority).push_back(waiter);
            return next.map_or(Admission::Queued, Admission::Displaced);
        }
        let victim_class = Priority::ALL
            .into_iter()
            .rev()
            .take_while(|p| *p > priority)
            .find(|p| self.class_len(*p) > 0);
        let Some(victim) = victim_class.and_then(|p| self.class(p).pop_back()) else {
            return Admission::Refused(waiter.item);
        };
        self.class(priority).push_back(waiter);
        Admission::Displaced(victim)
    }

    /// Removes request `id` (its client went away), if it is waiting.
    pub fn remove(&mut self, id: u32) -> Option<Waiter<T>> {
        Priority::ALL.into_iter().find_map(|p| {
            let class = self.class(p);
            let position = class.iter().position(|w| w.id == id)?;
            class.remove(position)
        })
    }

    /// Removes and returns every entry that has waited `maxWaitMs` at
    /// `now_ms` ([`WaitRejection::Deadline`]).
    pub fn expire(&mut self, now_ms: u64) -> Vec<Waiter<T>> {
        let max_wait_ms = self.policy.max_wait_ms;
        let mut expired = Vec::new();
        for priority in Priority::ALL {
            let class = self.class(priority);
            while class
                .front()
                .is_some_and(|w| w.waited_ms(now_ms) >= max_wait_ms)
            {
                expired.extend(class.pop_front());
            }
        }
        expired
    }

    /// Whether an arrival of class `priority` must join the queue without
    /// being routed: an entry of a higher class waits, `window` entries of
    /// its own class do (it would be past the window of a round), or the
    /// last round found no pod for a waiting entry of its class or higher
    /// (that entry goes first when room frees).
    pub fn must_queue(&self, priority: Priority) -> bool {
        Priority::ALL
            .into_iter()
            .take_while(|p| *p < priority)
            .any(|p| self.class_len(p) > 0)
            || self.class_len(priority) >= self.policy.window
            || self
                .blocked
                .is_some_and(|class| class <= priority && self.class_len(class) > 0)
    }

    /// A dispatch round at `now_ms` (see the module documentation): offers
    /// the first `window` entries of the head class, in order, to `place`;
    /// returns how many were placed.
    pub fn dispatch(
        &mut self,
        now_ms: u64,
        mut place: impl FnMut(&Waiter<T>) -> Placement,
    ) -> usize {
        let window = self.policy.window.max(1);
        let mut placed = 0;
        self.blocked = None;
        while let Some(priority) = self.head_priority() {
            let class = self.class(priority);
            let mut at = 0;
            // Whether the class emptied (the next class is offered room).
            let emptied = loop {
                let Some(waiter) = class.get_mut(at).filter(|_| at < window) else {
                    break false;
                };
                match place(waiter) {
                    Placement::Wait => {
                        self.blocked = Some(priority);
                        break false;
                    }
                    Placement::HoldingOut => {
                        waiter.holding_since_ms.get_or_insert(now_ms);
                        at += 1;
                    }
                    outcome => {
                        class.remove(at);
                        if outcome == Placement::Placed {
                            placed += 1;
                        }
                        if class.is_empty() {
                            break true;
                        }
                    }
                }
            };
            if !emptied {
                break;
            }
        }
        placed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under `onWaitLimit: "reject"`.
    fn queue(max_waiting: usize, max_wait_ms: u64) -> WaitQueue<&'static str> {
        WaitQueue::new(WaitPolicy {
            max_waiting,
            max_wait_ms,
            window: 4,
            on_limit: WaitLimitPolicy::Reject,
        })
    }

    /// Dispatches with room for `room` requests; returns their items.
    fn dispatch(q: &mut WaitQueue<&'static str>, room: usize) -> Vec<&'static str> {
        let mut order = Vec::new();
        q.dispatch(0, |w| {
            if order.len() < room {
                order.push(w.item);
                Placement::Placed
            } else {
                Placement::Wait
            }
        });
        order
    }

    #[test]
    fn dispatches_in_arrival_order_and_stops_at_the_first_that_must_wait() {
        let mut q = queue(8, 1000);
        for (id, item) in ["a", "b", "c", "d"].into_iter().enumerate() {
            assert_eq!(
                q.admit(id as u32, Priority::Standard, id as u64, false, item),
                Admission::Queued
            );
        }
        assert_eq!(dispatch(&mut q, 0), Vec::<&str>::new());
        assert_eq!(q.len(), 4);
        assert_eq!(dispatch(&mut q, 1), vec!["a"]);
        assert_eq!(dispatch(&mut q, 2), vec!["b", "c"]);
        assert_eq!(dispatch(&mut q, 5), vec!["d"]);
        assert!(q.is_empty());
    }

    #[test]
    fn higher_classes_go_first_and_fifo_holds_inside_a_class() {
        let mut q = queue(8, 1000);
        q.admit(1, Priority::Sheddable, 0, false, "shed-1");
        q.admit(2, Priority::Standard, 1, false, "std-2");
        q.admit(3, Priority::Critical, 2, false, "crit-3");
        q.admit(4, Priority::Standard, 3, false, "std-4");
        q.admit(5, Priority::Critical, 4, false, "crit-5");
        assert_eq!(
            dispatch(&mut q, 10),
            vec!["crit-3", "crit-5", "std-2", "std-4", "shed-1"]
        );
    }

    #[test]
    fn gone_entries_leave_without_counting_and_do_not_stop_the_round() {
        let mut q = queue(8, 1000);
        q.admit(1, Priority::Standard, 0, false, "gone");
        q.admit(2, Priority::Standard, 1, false, "live");
        let placed = q.dispatch(0, |w| {
            if w.item == "gone" {
                Placement::Gone
            } else {
                Placement::Placed
            }
        });
        assert_eq!((placed, q.len()), (1, 0));
    }

    #[test]
    fn a_full_queue_refuses_its_own_class_and_displaces_the_newest_lower_entry() {
        let mut q = queue(3, 1000);
        q.admit(1, Priority::Sheddable, 0, false, "shed-old");
        q.admit(2, Priority::Sheddable, 1, false, "shed-new");
        q.admit(3, Priority::Standard, 2, false, "std");
        // Full: a sheddable arrival has nothing below it.
        assert_eq!(
            q.admit(4, Priority::Sheddable, 3, false, "shed-late"),
            Admission::Refused("shed-late")
        );
        // A standard arrival displaces the newest sheddable entry.
        match q.admit(5, Priority::Standard, 4, false, "std-2") {
            Admission::Displaced(victim) => assert_eq!((victim.id, victim.item), (2, "shed-new")),
            other => panic!("{other:?}"),
        }
        // A critical arrival displaces the last sheddable one, then standard.
        assert!(matches!(
            q.admit(6, Priority::Critical, 5, false, "crit"),
            Admission::Displaced(Waiter { id: 1, .. })
        ));
        assert!(matches!(
            q.admit(7, Priority::Critical, 6, false, "crit-2"),
            Admission::Displaced(Waiter { id: 5, .. })
        ));
        assert_eq!(
            q.admit(8, Priority::Standard, 7, false, "std-3"),
            Admission::Refused("std-3")
        );
        assert_eq!(q.len(), 3);
        assert_eq!(dispatch(&mut q, 10), vec!["crit", "crit-2", "std"]);
    }

    #[test]
    fn a_full_queue_routing_past_the_limit_lets_the_next_in_line_go_and_admits_every_arrival() {
        let mut q = WaitQueue::new(WaitPolicy {
            on_limit: WaitLimitPolicy::Route,
            ..queue(3, 1000).policy()
        });
        q.admit(1, Priority::Sheddable, 0, false, "shed");
        q.admit(2, Priority::Standard, 1, false, "std-old");
        q.admit(3, Priority::Standard, 2, false, "std-new");
        // The entry a round would offer room first leaves, whatever the
        // arrival's class: order is kept, nothing is refused.
        for (id, class, item, next) in [
            (4, Priority::Sheddable, "shed-late", "std-old"),
            (5, Priority::Critical, "crit", "std-new"),
            (6, Priority::Standard, "std-late", "crit"),
        ] {
            match q.admit(id, class, 3, false, item) {
                Admission::Displaced(leaving) => assert_eq!(leaving.item, next, "{item}"),
                other => panic!("{item}: {other:?}"),
            }
        }
        assert_eq!(dispatch(&mut q, 10), vec!["std-late", "shed", "shed-late"]);
    }

    #[test]
    fn entries_expire_at_max_wait_in_every_class() {
        let mut q = queue(8, 100);
        q.admit(1, Priority::Standard, 0, false, "std-0");
        q.admit(2, Priority::Sheddable, 10, false, "shed-10");
        q.admit(3, Priority::Standard, 50, false, "std-50");
        assert!(q.expire(99).is_empty());
        let expired: Vec<_> = q.expire(110).into_iter().map(|w| w.item).collect();
        assert_eq!(expired, vec!["std-0", "shed-10"]);
        assert_eq!(q.len(), 1);
        let last = q.expire(150);
        assert_eq!(last.len(), 1);
        assert_eq!(last.first().map(|w| w.waited_ms(150)), Some(100));
        assert!(q.is_empty());
    }

    #[test]
    fn removal_frees_the_place() {
        let mut q = queue(2, 1000);
        q.admit(1, Priority::Standard, 0, false, "a");
        q.admit(2, Priority::Critical, 0, false, "b");
        assert_eq!(q.remove(1).map(|w| w.item), Some("a"));
        assert_eq!(q.remove(1), None);
        assert_eq!(
            q.admit(3, Priority::Standard, 1, false, "c"),
            Admission::Queued
        );
        assert_eq!(dispatch(&mut q, 10), vec!["b", "c"]);
    }

    /// A round where pod `free` has room for `room` requests and each
    /// item names the pod it wants ("a:1" wants pod a): the others hold
    /// out. Returns the items placed, in order.
    fn affine_round(
        q: &mut WaitQueue<&'static str>,
        now_ms: u64,
        free: &str,
        room: usize,
    ) -> Vec<&'static str> {
        let mut placed = Vec::new();
        q.dispatch(now_ms, |w| {
            if placed.len() == room {
                Placement::Wait
            } else if w.item.starts_with(free) {
                placed.push(w.item);
                Placement::Placed
            } else {
                Placement::HoldingOut
            }
        });
        placed
    }

    #[test]
    fn a_freed_pod_takes_the_oldest_entry_in_the_window_that_wants_it() {
        let mut q = queue(16, 60_000);
        for (id, item) in ["a:1", "b:2", "a:3", "b:4", "b:5", "b:6"]
            .into_iter()
            .enumerate()
        {
            q.admit(id as u32, Priority::Standard, id as u64, false, item);
        }
        // Pod b frees two places: the first two entries wanting b, not the
        // head (which holds out for a).
        assert_eq!(affine_round(&mut q, 100, "b", 2), vec!["b:2", "b:4"]);
        // Only the window (4 entries: a:1 a:3 b:5 b:6) is offered.
        assert_eq!(affine_round(&mut q, 200, "c", 9), Vec::<&str>::new());
        // The entries that declined a pod count their hold-out from the
        // first decline; the others have not started.
        let held: Vec<(&str, u64)> = q
            .standard
            .iter()
            .map(|w| (w.item, w.holding_ms(300)))
            .collect();
        assert_eq!(
            held,
            vec![("a:1", 200), ("a:3", 200), ("b:5", 100), ("b:6", 100)]
        );
        // Order is kept for what remains.
        assert_eq!(affine_round(&mut q, 300, "a", 9), vec!["a:1", "a:3"]);
        assert_eq!(dispatch(&mut q, 9), vec!["b:5", "b:6"]);
    }

    #[test]
    fn the_window_bounds_what_a_round_offers() {
        let mut q = queue(16, 60_000);
        for (id, item) in ["a:1", "a:2", "a:3", "a:4", "b:5"].into_iter().enumerate() {
            q.admit(id as u32, Priority::Standard, id as u64, false, item);
        }
        let mut offered = 0;
        q.dispatch(0, |_| {
            offered += 1;
            Placement::HoldingOut
        });
        assert_eq!(offered, 4);
        // b:5 is past the window: pod b's room goes unused until one of the
        // first four leaves.
        assert_eq!(affine_round(&mut q, 10, "b", 1), Vec::<&str>::new());
        assert_eq!(affine_round(&mut q, 20, "a", 1), vec!["a:1"]);
        assert_eq!(affine_round(&mut q, 30, "b", 1), vec!["b:5"]);
    }

    #[test]
    fn no_pod_ends_the_round_even_after_entries_held_out() {
        let mut q = queue(16, 60_000);
        for (id, item) in ["a:1", "b:2", "b:3"].into_iter().enumerate() {
            q.admit(id as u32, Priority::Standard, id as u64, false, item);
        }
        let mut offered = Vec::new();
        q.dispatch(0, |w| {
            offered.push(w.item);
            if w.item == "a:1" {
                Placement::HoldingOut
            } else {
                Placement::Wait
            }
        });
        assert_eq!(offered, vec!["a:1", "b:2"]);
        assert_eq!(q.len(), 3);
    }

    #[test]
    fn classes_stay_strict_while_a_higher_class_holds_out() {
        let mut q = queue(16, 60_000);
        q.admit(1, Priority::Critical, 0, false, "a:crit");
        q.admit(2, Priority::Standard, 1, false, "b:std");
        // Pod b has room, the critical entry wants a: the standard entry
        // that wants b is not offered it.
        assert_eq!(affine_round(&mut q, 10, "b", 5), Vec::<&str>::new());
        assert_eq!(affine_round(&mut q, 20, "a", 5), vec!["a:crit"]);
        assert_eq!(affine_round(&mut q, 30, "b", 5), vec!["b:std"]);
    }

    #[test]
    fn arrivals_are_routed_only_where_a_round_would_reach_them() {
        let mut q = queue(16, 60_000);
        assert!(!q.must_queue(Priority::Standard));
        for id in 0..3 {
            q.admit(id, Priority::Standard, 0, false, "a");
        }
        // Three standard entries, window 4: a standard arrival is in reach,
        // a critical one goes first anyway, a sheddable one waits.
        assert!(!q.must_queue(Priority::Standard));
        assert!(!q.must_queue(Priority::Critical));
        assert!(q.must_queue(Priority::Sheddable));
        q.admit(3, Priority::Standard, 0, false, "a");
        assert!(q.must_queue(Priority::Standard));
        assert!(!q.must_queue(Priority::Critical));
    }

    #[test]
    fn an_arrival_queues_behind_an_entry_the_last_round_found_no_pod_for() {
        let mut q = queue(16, 60_000);
        q.admit(1, Priority::Standard, 0, false, "a");
        assert_eq!(dispatch(&mut q, 0), Vec::<&str>::new());
        // Room may have freed since the round: the waiting entry takes it
        // first, a standard or sheddable arrival goes behind it, a
        // critical one is served before it anyway.
        assert!(q.must_queue(Priority::Standard));
        assert!(q.must_queue(Priority::Sheddable));
        assert!(!q.must_queue(Priority::Critical));
        // Holding out is not blocking: arrivals in the window are routed.
        assert_eq!(affine_round(&mut q, 10, "b", 1), Vec::<&str>::new());
        assert!(!q.must_queue(Priority::Standard));
        // Nor is an entry that left.
        dispatch(&mut q, 0);
        q.remove(1);
        assert!(!q.must_queue(Priority::Standard));
    }

    #[test]
    fn an_arrival_that_declined_a_pod_holds_out_from_its_arrival() {
        let mut q = queue(16, 60_000);
        q.admit(1, Priority::Standard, 1000, true, "a");
        q.admit(2, Priority::Standard, 1000, false, "b");
        let held: Vec<u64> = q.standard.iter().map(|w| w.holding_ms(1500)).collect();
        assert_eq!(held, vec![500, 0]);
    }

    #[test]
    fn priority_header_values() {
        assert_eq!(Priority::from_header(" Critical "), Priority::Critical);
        assert_eq!(Priority::from_header("sheddable"), Priority::Sheddable);
        assert_eq!(Priority::from_header(""), Priority::Standard);
        assert_eq!(Priority::from_header("urgent!!"), Priority::Standard);
    }
}
