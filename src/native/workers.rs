//! One state per Envoy worker, and the ticker that wakes it: what both of
//! the module's filter roles share (the routing filter's
//! [`crate::gateway::filter::Worker`], the replica listener's
//! [`crate::gateway::replica::ReplicaServer`]).
//!
//! Envoy runs a worker's filters on that worker's thread only, and gives a
//! module no timer per worker: a worker is woken through the filter
//! scheduler of one of its live requests, its *tick target*
//! (`scheduler_commit` from the ticker thread runs
//! `on_http_filter_scheduled` on the worker). Each worker's state sits in
//! a mutex that only its own thread takes (uncontended); the ticker reads
//! only the tick target and a flag saying whether the worker has work.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::abi::{self, FilterEnvoy, SchedulerPtr};
use super::filter::FilterHandle;

/// What a worker slot needs of the state it holds.
pub trait WorkerState {
    /// The worker's live requests, by id.
    fn filters(&mut self) -> &mut HashMap<u32, FilterHandle>;
    /// Whether the worker wants its tick (waiting requests, held pulls,
    /// batches to flush).
    fn has_work(&self) -> bool;
}

/// One Envoy worker's state.
pub struct WorkerSlot<W> {
    worker: Mutex<W>,
    /// The scheduler of a live request of this worker that receives the
    /// worker's tick, and that request's id. Held while committing, so the
    /// request cannot delete it meanwhile.
    ticker: Mutex<Option<(u32, usize)>>,
    /// The worker has work (set after each hook).
    has_work: AtomicBool,
}

impl<W: WorkerState> WorkerSlot<W> {
    pub fn lock(&self) -> MutexGuard<'_, W> {
        // A panic caught in a hook leaves the worker usable: each field is
        // consistent on its own.
        self.worker.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn ticker(&self) -> MutexGuard<'_, Option<(u32, usize)>> {
        self.ticker.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records whether `worker` (this slot's, locked) wants its tick.
    pub fn note_work(&self, worker: &W) {
        self.has_work.store(worker.has_work(), Ordering::Release);
    }

    /// A request of this worker starts: registered as `id`, and made the
    /// tick target if there is none.
    fn attach(&self, id: u32, envoy: FilterEnvoy) {
        let needs_ticker = self.ticker().is_none();
        let scheduler = {
            let mut worker = self.lock();
            let mut handle = FilterHandle::new(envoy);
            let scheduler = needs_ticker.then(|| handle.scheduler() as usize);
            worker.filters().insert(id, handle);
            scheduler
        };
        if let Some(scheduler) = scheduler.filter(|s| *s != 0) {
            self.ticker().get_or_insert((id, scheduler));
        }
    }

    /// Request `id` is destroyed: `end` runs on the worker, the request is
    /// forgotten, the tick target passes to another live request, and the
    /// request's scheduler is deleted.
    pub fn detach(&self, id: u32, end: impl FnOnce(&mut W)) {
        let was_ticker = self.ticker().is_some_and(|(target, _)| target == id);
        let (own, successor) = {
            let mut worker = self.lock();
            end(&mut worker);
            let own = worker
                .filters()
                .remove(&id)
                .and_then(|mut handle| handle.take_scheduler());
            let successor = was_ticker
                .then(|| {
                    let (id, handle) = worker.filters().iter_mut().next()?;
                    Some((*id, handle.scheduler() as usize)).filter(|(_, s)| *s != 0)
                })
                .flatten();
            self.note_work(&worker);
            (own, successor)
        };
        if was_ticker {
            *self.ticker() = successor;
        }
        if let Some(scheduler) = own {
            // SAFETY: its request is being destroyed and the ticker no
            // longer names it.
            unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler) };
        }
    }

    /// Sends request `id` the local reply kept for it (its own scheduled
    /// hook, on `envoy`, with the worker released: Envoy may run this
    /// module's response hooks inside).
    pub fn answer(&self, id: u32, envoy: FilterEnvoy) {
        let reply = self
            .lock()
            .filters()
            .get_mut(&id)
            .and_then(FilterHandle::take_reply);
        if let Some(reply) = reply {
            reply.send(envoy);
        }
    }

    /// Commits `event` to the tick target, when the worker has work (any
    /// thread).
    fn tick(&self, event: u64) {
        if !self.has_work.load(Ordering::Acquire) {
            return;
        }
        let ticker = self.ticker();
        if let Some((_, scheduler)) = *ticker {
            // SAFETY: the scheduler's request deletes it only after
            // clearing the tick target, under this lock.
            unsafe {
                abi::envoy_dynamic_module_callback_http_filter_scheduler_commit(
                    scheduler as SchedulerPtr,
                    event,
                );
            }
        }
    }
}

/// One slot per Envoy worker, and request ids.
pub struct Workers<W> {
    slots: Arc<[WorkerSlot<W>]>,
    next_id: AtomicU32,
}

impl<W: WorkerState> Workers<W> {
    /// A slot per Envoy worker (`concurrency`, at least one).
    pub fn new(concurrency: u32, mut state: impl FnMut() -> W) -> Workers<W> {
        Workers {
            slots: (0..concurrency.max(1))
                .map(|_| WorkerSlot {
                    worker: Mutex::new(state()),
                    ticker: Mutex::new(None),
                    has_work: AtomicBool::new(false),
                })
                .collect(),
            next_id: AtomicU32::new(1),
        }
    }

    /// The slot of Envoy worker `index` (the last one if Envoy reports
    /// more workers than it said it had).
    pub fn slot(&self, index: usize) -> Option<&WorkerSlot<W>> {
        self.slots.get(index).or_else(|| self.slots.last())
    }

    /// A request starts on Envoy worker `index`: its id, once registered
    /// with the worker ([`WorkerSlot::attach`]).
    pub fn attach(&self, index: usize, envoy: FilterEnvoy) -> Option<u32> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.slot(index)?.attach(id, envoy);
        Some(id)
    }
}

impl<W: WorkerState + Send + 'static> Workers<W> {
    /// What the ticker needs: `event` committed to every worker with work.
    pub fn ticks(&self, event: u64) -> impl Fn() + Send + 'static {
        let slots = self.slots.clone();
        move || slots.iter().for_each(|slot| slot.tick(event))
    }
}

/// A module thread that only commits events: it calls `tick` every
/// `period` until stopped (the config is destroyed).
pub struct Ticker {
    stop: Sender<()>,
    thread: JoinHandle<()>,
}

impl Ticker {
    pub fn start(
        name: &str,
        period: Duration,
        mut tick: impl FnMut() + Send + 'static,
    ) -> Option<Ticker> {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || loop {
                match stopped.recv_timeout(period) {
                    Err(RecvTimeoutError::Timeout) => tick(),
                    _ => return,
                }
            })
            .ok()?;
        Some(Ticker { stop, thread })
    }

    /// Stops and joins the thread: nothing is committed after this.
    pub fn stop(self) {
        drop(self.stop);
        let _ = self.thread.join();
    }
}
