//! What one router instance (a proxy worker, or the offline replay's
//! filter) learns as it routes, and the one place it is read and written:
//! - its own decisions not in the published index yet
//!   ([`RecentDecisions`], approximate mode: the next request of a burst
//!   sees where the last one went);
//! - the predicted-TTFT model ([`TtftModel`]), from answers' first bytes
//!   (the host feeds those);
//! - what arrivals find on each pod ([`Occupancy`]): how often prefill is
//!   queued there, and the streams it carries;
//! - the sessions started per prefix ([`PrefixDemand`]), over the last
//!   `learningWindow` starts per pod.
//!
//! [`RouterMemory::route`] routes a prepared request with all four and
//! records a routed one, so the proxy and the replay decide and learn by
//! the same code. What a host does with the decision after (the decision
//! batch for the report service, logs, metrics) stays with the host.

use crate::config::Config;
use crate::index::{Merged, PrefixLookup, RecentDecisions};
use crate::router::{Attempt, ClusterView, Outcome, Router, RoutingRequest};
use crate::scoring::occupancy::Occupancy;
use crate::scoring::spread::PrefixDemand;
use crate::scoring::ttft::TtftModel;
use crate::snapshot::{PodTable, SlotLoad};

/// The cluster as the host last saw it published.
pub struct Published<'a> {
    pub table: &'a PodTable,
    /// The published index of `table`'s generation.
    pub index: &'a dyn PrefixLookup,
    /// In-flight requests and their queued prefill per pod slot.
    pub inflight: &'a [SlotLoad],
    /// Now, on the clock of `table.published_at_ms`.
    pub now_ms: u64,
}

/// See the module documentation.
#[derive(Debug)]
pub struct RouterMemory {
    pub recent: RecentDecisions,
    pub ttft: TtftModel,
    pub occupancy: Occupancy,
    pub prefix_demand: PrefixDemand,
}

impl RouterMemory {
    pub fn new(config: &Config) -> RouterMemory {
        RouterMemory {
            recent: RecentDecisions::new(config),
            ttft: TtftModel::new(config.balance.learning_window),
            occupancy: Occupancy::new(config.balance.learning_window),
            prefix_demand: PrefixDemand::default(),
        }
    }

    /// The horizon session starts are counted over in a pool of `pods`:
    /// the TTFT model's window per pod.
    fn start_window(&self, pods: usize) -> f64 {
        f64::from(self.ttft.window()) * pods as f64
    }

    /// Routes `request` with what this router learnt (`tie_breaker`: see
    /// [`Router::route_prepared`]) and records where it went.
    pub fn route(
        &mut self,
        router: &Router,
        request: RoutingRequest,
        published: Published<'_>,
        tie_breaker: u64,
        attempt: Attempt,
    ) -> Outcome {
        // Arrivals see time averages: how often each pod has prefill
        // queued, and how many streams it carries.
        if attempt == Attempt::Arrival {
            self.occupancy.observe(published.inflight);
        }
        let view = ClusterView {
            table: published.table,
            index: &Merged(published.index, &self.recent),
            inflight: published.inflight,
            ttft: &self.ttft,
            occupancy: &self.occupancy,
            prefix_demand: &self.prefix_demand,
            now_ms: published.now_ms,
        };
        let outcome = router.route_prepared(request, &view, tie_breaker, attempt);
        if let Outcome::Routed(routed) = &outcome {
            self.recent.record(routed.slot, &routed.chain);
            let window = self.start_window(published.table.pods.len());
            self.prefix_demand
                .record(&routed.chain, routed.match_end, routed.follows_up, window);
        }
        outcome
    }

    /// A session start another worker or replica routed, whose match
    /// ended at block hash `match_end`, in a pool of `pods`.
    pub fn record_start(&mut self, match_end: Option<u64>, pods: usize) {
        let window = self.start_window(pods);
        self.prefix_demand.record(&[], match_end, None, window);
    }
}
