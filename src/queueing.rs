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
//!   ([`WaitPolicy::max_waiting`]). An arrival when the queue is full
//!   displaces the *newest* entry of the lowest class strictly below its
//!   own (that entry is answered `queue_full`); with no such entry the
//!   arrival itself is refused (`queue_full`). So sheddable traffic is the
//!   first dropped, and memory is bounded whatever the load.
//! - **Deadline.** An entry that has waited `maxWaitMs`
//!   ([`WaitPolicy::max_wait_ms`]) is answered (`deadline`). Within a class
//!   entries are in arrival order, so only each class's head is checked.
//! - **Dispatch** ([`WaitQueue::dispatch`]), run when capacity may have
//!   freed (a request on this worker ended, or a periodic tick): the head
//!   (highest class, oldest) is routed again; if it is placed the next head
//!   is tried, and the first head that cannot be placed ends the round.
//!   Exclusions do not depend on the request (health and queue are per
//!   pod), so when the head cannot be placed no later entry could be
//!   either: nobody overtakes the head.
//! - **Leaving.** [`WaitQueue::remove`] frees the place of a request whose
//!   client went away.
//!
//! Costs: admit O(1) (a displacement pops the tail of a class), dispatch
//! O(1) per placed entry, expiry O(expired + classes), removal O(n) with
//! n ≤ `maxWaitingRequests`.
//!
//! The module is host-agnostic (no proxy-wasm), so the offline replay can
//! apply the same policy.

use std::collections::VecDeque;

use crate::config::Config;

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

/// Why a waiting (or arriving) request was answered instead of routed.
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
}

impl WaitPolicy {
    pub fn from_config(config: &Config) -> WaitPolicy {
        WaitPolicy {
            max_waiting: config.max_waiting_requests,
            max_wait_ms: config.max_wait_ms,
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
    pub item: T,
}

impl<T> Waiter<T> {
    /// How long it has waited at `now_ms`.
    pub fn waited_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.since_ms)
    }
}

/// What [`WaitQueue::admit`] did with an arrival.
#[derive(Debug, PartialEq)]
pub enum Admission<T> {
    /// Waiting now.
    Queued,
    /// Waiting now, in place of this lower-class entry (to be answered
    /// [`WaitRejection::QueueFull`]).
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
}

/// See the module documentation.
#[derive(Debug)]
pub struct WaitQueue<T> {
    policy: WaitPolicy,
    critical: VecDeque<Waiter<T>>,
    standard: VecDeque<Waiter<T>>,
    sheddable: VecDeque<Waiter<T>>,
}

impl<T> WaitQueue<T> {
    pub fn new(policy: WaitPolicy) -> WaitQueue<T> {
        WaitQueue {
            policy,
            critical: VecDeque::new(),
            standard: VecDeque::new(),
            sheddable: VecDeque::new(),
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

    /// The highest non-empty class.
    fn head_class(&mut self) -> Option<&mut VecDeque<Waiter<T>>> {
        Priority::ALL
            .into_iter()
            .find(|p| !self.class_is_empty(*p))
            .map(|p| self.class(p))
    }

    fn class_is_empty(&self, priority: Priority) -> bool {
        match priority {
            Priority::Critical => self.critical.is_empty(),
            Priority::Standard => self.standard.is_empty(),
            Priority::Sheddable => self.sheddable.is_empty(),
        }
    }

    /// Adds request `id` of class `priority`, arriving at `now_ms`.
    pub fn admit(&mut self, id: u32, priority: Priority, now_ms: u64, item: T) -> Admission<T> {
        let waiter = Waiter {
            id,
            priority,
            since_ms: now_ms,
            item,
        };
        if self.len() < self.policy.max_waiting {
            self.class(priority).push_back(waiter);
            return Admission::Queued;
        }
        let victim_class = Priority::ALL
            .into_iter()
            .rev()
            .take_while(|p| *p > priority)
            .find(|p| !self.class_is_empty(*p));
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
    /// `now_ms`, to be answered [`WaitRejection::Deadline`].
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

    /// Offers the heads, in order, to `place` until one must wait (see the
    /// module documentation); returns how many were placed.
    pub fn dispatch(&mut self, mut place: impl FnMut(&Waiter<T>) -> Placement) -> usize {
        let mut placed = 0;
        while let Some(class) = self.head_class() {
            let Some(head) = class.front() else { break };
            match place(head) {
                Placement::Wait => break,
                outcome => {
                    class.pop_front();
                    if outcome == Placement::Placed {
                        placed += 1;
                    }
                }
            }
        }
        placed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(max_waiting: usize, max_wait_ms: u64) -> WaitQueue<&'static str> {
        WaitQueue::new(WaitPolicy {
            max_waiting,
            max_wait_ms,
        })
    }

    /// Dispatches with room for `room` requests; returns their items.
    fn dispatch(q: &mut WaitQueue<&'static str>, room: usize) -> Vec<&'static str> {
        let mut order = Vec::new();
        q.dispatch(|w| {
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
                q.admit(id as u32, Priority::Standard, id as u64, item),
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
        q.admit(1, Priority::Sheddable, 0, "shed-1");
        q.admit(2, Priority::Standard, 1, "std-2");
        q.admit(3, Priority::Critical, 2, "crit-3");
        q.admit(4, Priority::Standard, 3, "std-4");
        q.admit(5, Priority::Critical, 4, "crit-5");
        assert_eq!(
            dispatch(&mut q, 10),
            vec!["crit-3", "crit-5", "std-2", "std-4", "shed-1"]
        );
    }

    #[test]
    fn gone_entries_leave_without_counting_and_do_not_stop_the_round() {
        let mut q = queue(8, 1000);
        q.admit(1, Priority::Standard, 0, "gone");
        q.admit(2, Priority::Standard, 1, "live");
        let placed = q.dispatch(|w| {
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
        q.admit(1, Priority::Sheddable, 0, "shed-old");
        q.admit(2, Priority::Sheddable, 1, "shed-new");
        q.admit(3, Priority::Standard, 2, "std");
        // Full: a sheddable arrival has nothing below it.
        assert_eq!(
            q.admit(4, Priority::Sheddable, 3, "shed-late"),
            Admission::Refused("shed-late")
        );
        // A standard arrival displaces the newest sheddable entry.
        match q.admit(5, Priority::Standard, 4, "std-2") {
            Admission::Displaced(victim) => assert_eq!((victim.id, victim.item), (2, "shed-new")),
            other => panic!("{other:?}"),
        }
        // A critical arrival displaces the last sheddable one, then standard.
        assert!(matches!(
            q.admit(6, Priority::Critical, 5, "crit"),
            Admission::Displaced(Waiter { id: 1, .. })
        ));
        assert!(matches!(
            q.admit(7, Priority::Critical, 6, "crit-2"),
            Admission::Displaced(Waiter { id: 5, .. })
        ));
        assert_eq!(
            q.admit(8, Priority::Standard, 7, "std-3"),
            Admission::Refused("std-3")
        );
        assert_eq!(q.len(), 3);
        assert_eq!(dispatch(&mut q, 10), vec!["crit", "crit-2", "std"]);
    }

    #[test]
    fn entries_expire_at_max_wait_in_every_class() {
        let mut q = queue(8, 100);
        q.admit(1, Priority::Standard, 0, "std-0");
        q.admit(2, Priority::Sheddable, 10, "shed-10");
        q.admit(3, Priority::Standard, 50, "std-50");
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
        q.admit(1, Priority::Standard, 0, "a");
        q.admit(2, Priority::Critical, 0, "b");
        assert_eq!(q.remove(1).map(|w| w.item), Some("a"));
        assert_eq!(q.remove(1), None);
        assert_eq!(q.admit(3, Priority::Standard, 1, "c"), Admission::Queued);
        assert_eq!(dispatch(&mut q, 10), vec!["b", "c"]);
    }

    #[test]
    fn priority_header_values() {
        assert_eq!(Priority::from_header(" Critical "), Priority::Critical);
        assert_eq!(Priority::from_header("sheddable"), Priority::Sheddable);
        assert_eq!(Priority::from_header(""), Priority::Standard);
        assert_eq!(Priority::from_header("urgent!!"), Priority::Standard);
    }
}
