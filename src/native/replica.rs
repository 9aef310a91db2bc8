//! The replica listener over the dynamic-module ABI:
//! [`crate::gateway::replica`] decides, this file hands it the host. Envoy
//! creates it for the dynamic-module filter whose `filter_name` is
//! [`REPLICA_FILTER_NAME`], on the replica listener only (the template's
//! `replicas` section), with the same plugin JSON as the routing filter.
//!
//! **Finding the routing filter's state.** The two are separate filter
//! configs on separate listeners, created in either order, each possibly
//! re-created on its own (a listener update through LDS creates the new
//! config before it destroys the old one). They meet in a process-wide
//! registry of [`ReplicaChannel`]s keyed by what both hold and what makes
//! them one channel: `replicas.path` and `replicas.secret` (the listener
//! checks pulls against the secret the routing filter's service pulls its
//! peers with). The routing config attaches its [`Shared`] when it is
//! created and detaches it when destroyed; the replica config looks the
//! channel up once and reads its current state on every call, so it
//! serves whichever routing config is live — the newest one while an old
//! one drains — and answers 503 ("not started its log yet") while there
//! is none. Two routing filters of one Envoy that replicate need
//! different secrets (each replica listener then serves its own).
//!
//! **Answering held pulls.** A held pull is answered from the worker's
//! tick, every [`TICK_MS`], as under proxy-wasm, through the request's own
//! filter scheduler (as the routing filter answers its waiting requests):
//! a module thread commits the tick to one live request of each worker
//! holding pulls ([`super::workers`]). Waking held pulls directly on every
//! logged decision and in-flight change was the alternative: it would
//! answer each peer once per routed request under load (and each answer
//! brings the next pull), where the tick bounds it to 200 answers a second
//! per peer and adds at most 5 ms to the convergence lag, whose p99
//! target is 50 ms and whose larger part is the routing workers' decision
//! batches (`docs/native.md`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwapOption;

use super::filter::{now_ms, FilterHandle, NativeStream, EVENT_TICK};
use super::shared::Shared;
use super::workers::{Ticker, WorkerState, Workers};
use crate::config::ReplicasConfig;
use crate::gateway::host::ReplicaHost;
use crate::gateway::replica::{loads_by_pod, ReplicaServer, TICK_MS};
use crate::replica::{LogHead, PodInflight};

/// The `filter_name` of the replica listener's filter (the routing filter
/// is `kvroute`).
pub const REPLICA_FILTER_NAME: &[u8] = b"kvroute-replica";

/// Where a routing filter's state meets the replica listener of the same
/// Envoy (see the module documentation).
pub struct ReplicaChannel {
    path: String,
    secret: String,
    /// The live routing configs of the channel, oldest first.
    routing: Mutex<Vec<Arc<Shared>>>,
    /// The newest of them.
    current: ArcSwapOption<Shared>,
}

/// Every channel some config holds.
static CHANNELS: Mutex<Vec<Arc<ReplicaChannel>>> = Mutex::new(Vec::new());

/// The channel of `replicas` (created on first use; shared by the configs
/// that name the same path and secret).
pub fn channel(replicas: &ReplicasConfig) -> Arc<ReplicaChannel> {
    let mut channels = CHANNELS.lock().unwrap_or_else(|e| e.into_inner());
    // Channels no config holds any more go (bounded by the live configs).
    channels.retain(|channel| Arc::strong_count(channel) > 1);
    if let Some(channel) = channels
        .iter()
        .find(|c| c.path == replicas.path && c.secret == replicas.secret)
    {
        return channel.clone();
    }
    let channel = Arc::new(ReplicaChannel {
        path: replicas.path.clone(),
        secret: replicas.secret.clone(),
        routing: Mutex::new(Vec::new()),
        current: ArcSwapOption::empty(),
    });
    channels.push(channel.clone());
    channel
}

impl ReplicaChannel {
    fn update(&self, change: impl FnOnce(&mut Vec<Arc<Shared>>)) {
        let mut routing = self.routing.lock().unwrap_or_else(|e| e.into_inner());
        change(&mut routing);
        self.current.store(routing.last().cloned());
    }

    /// A routing config was created with this channel.
    pub fn attach(&self, shared: Arc<Shared>) {
        self.update(|routing| routing.push(shared));
    }

    /// A routing config is destroyed: the channel serves the newest one
    /// left, if any.
    pub fn detach(&self, shared: &Arc<Shared>) {
        self.update(|routing| routing.retain(|s| !Arc::ptr_eq(s, shared)));
    }

    /// The live routing filter's state.
    pub fn shared(&self) -> Option<Arc<Shared>> {
        self.current.load_full()
    }
}

/// A worker's side of the replica listener: the channel and its live
/// calls.
pub struct NativeReplica {
    /// `None` without `replicas` (the server refuses every call then).
    channel: Option<Arc<ReplicaChannel>>,
    filters: HashMap<u32, FilterHandle>,
}

impl NativeReplica {
    fn shared(&self) -> Option<Arc<Shared>> {
        self.channel.as_ref()?.shared()
    }
}

impl ReplicaHost for NativeReplica {
    type Other<'a> = NativeStream<'a>;

    fn now_ms(&self) -> u64 {
        now_ms()
    }

    fn replica_head(&self) -> Option<LogHead> {
        self.shared()?.replica.head()
    }

    fn replica_log(&self, slot: u64) -> Option<Vec<u8>> {
        self.shared()?.replica.value(slot)
    }

    fn own_inflight(&mut self) -> Vec<PodInflight> {
        // Only this Envoy's requests: the peers' loads are kept apart
        // (`Shared::replica`), so nothing echoes between replicas.
        let Some(shared) = self.shared() else {
            return Vec::new();
        };
        let Some(table) = shared.snapshot.table() else {
            return Vec::new();
        };
        loads_by_pod(&table, &shared.inflight.loads(table.slots()))
    }

    fn other(&mut self, id: u32) -> Option<NativeStream<'_>> {
        NativeStream::waiting(&mut self.filters, id)
    }
}

/// One worker's replica listener.
pub type ReplicaWorker = ReplicaServer<NativeReplica>;

impl WorkerState for ReplicaWorker {
    fn filters(&mut self) -> &mut HashMap<u32, FilterHandle> {
        &mut self.host.filters
    }

    fn has_work(&self) -> bool {
        ReplicaServer::has_work(self)
    }
}

/// The module's side of the replica listener's filter configuration.
pub struct ReplicaConfig {
    pub workers: Workers<ReplicaWorker>,
    ticker: Mutex<Option<Ticker>>,
}

impl ReplicaConfig {
    /// Builds the configuration (main thread): `None` when the plugin JSON
    /// is invalid (the error is logged). It defines no metric: the routing
    /// filter's config owns them (a second definition would reset its
    /// gauges).
    pub fn new(concurrency: u32, bytes: &[u8]) -> Option<ReplicaConfig> {
        let config = crate::gateway::load_config(bytes, "replica", None)?;
        let channel = config.replicas.as_ref().map(channel);
        let workers = Workers::new(concurrency, || {
            ReplicaServer::new(
                &config,
                NativeReplica {
                    channel: channel.clone(),
                    filters: HashMap::new(),
                },
            )
        });
        let ticker = Ticker::start(
            "kvroute-replica",
            Duration::from_millis(TICK_MS),
            workers.ticks(EVENT_TICK),
        );
        if ticker.is_none() {
            log::error!("kvroute replica: no ticker (thread refused): held pulls are not answered");
        }
        Some(ReplicaConfig {
            workers,
            ticker: Mutex::new(ticker),
        })
    }

    /// Stops the ticker (Envoy is destroying the config, main thread).
    pub fn shut_down(&self) {
        if let Some(ticker) = self.ticker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            ticker.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MAX_PODS;
    use crate::native::shared::{DecisionInbox, Inflight, ReplicaShare, SharedEjections, Snapshot};

    fn shared() -> Arc<Shared> {
        Arc::new(Shared {
            snapshot: Snapshot::new(1),
            inflight: Inflight::new(MAX_PODS),
            ejections: SharedEjections::default(),
            decisions: DecisionInbox::default(),
            replica: ReplicaShare::default(),
            feed: ArcSwapOption::empty(),
        })
    }

    fn replicas(secret: &str) -> ReplicasConfig {
        ReplicasConfig {
            peers: Vec::new(),
            cluster: None,
            admin_cluster: "kvroute_admin".into(),
            secret: secret.into(),
            path: "/kvroute/v1/replica".into(),
        }
    }

    #[test]
    fn the_replica_listener_finds_the_routing_state_in_either_order_and_across_reloads() {
        let secret = "a-secret-only-this-test-uses-000";
        // The replica listener's config first: nothing to serve yet.
        let listener = channel(&replicas(secret));
        assert!(listener.shared().is_none());
        let first = shared();
        let routing = channel(&replicas(secret));
        routing.attach(first.clone());
        assert!(Arc::ptr_eq(&listener.shared().expect("attached"), &first));
        // A reload: the new routing config is created before the old one
        // is destroyed, and is served from its creation on.
        let second = shared();
        channel(&replicas(secret)).attach(second.clone());
        assert!(Arc::ptr_eq(&listener.shared().expect("newest"), &second));
        routing.detach(&first);
        assert!(Arc::ptr_eq(&listener.shared().expect("kept"), &second));
        // A newer config rejected and destroyed: the older live one again.
        let third = shared();
        routing.attach(third.clone());
        routing.detach(&third);
        assert!(Arc::ptr_eq(&listener.shared().expect("back"), &second));
        routing.detach(&second);
        assert!(listener.shared().is_none());
        // Another secret is another channel.
        let other = channel(&replicas("another-secret-of-this-test-0000"));
        other.attach(shared());
        assert!(listener.shared().is_none());
    }
}
