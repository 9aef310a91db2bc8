//! The request lifecycle both hosts run ([`kvroute::gateway`]), against a
//! host kept in memory: what the filter asks of its host is exactly what
//! `src/wasm/` and `src/native/` provide, so these tests pin the core's
//! side of that contract (routing header, in-flight counts, the decision
//! batch, metrics, waiting requests resumed or answered through
//! [`WorkerHost::other`]). The real-Envoy suites run both hosts.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute::config::{Config, IndexMode, PassiveHealthConfig};
use kvroute::ejection::Ejection;
use kvroute::gateway::filter::{RequestFilter, Worker, OVERRIDE_HOST_HEADER};
use kvroute::gateway::host::{Action, HostResult, Stream, WorkerHost};
use kvroute::gateway::metrics::{Metric, MetricSink};
use kvroute::index::PrefixLookup;
use kvroute::scoring::feed::{Feed, FeedRecord, SessionStart};
use kvroute::scoring::ttft::TtftModel;
use kvroute::snapshot::{
    decode_batch, BatchRecord, InflightChange, PodTable, PublishedPod, SlotLoad, SnapshotIndex,
};

/// A request: its headers and body, and what the filter did to it.
#[derive(Default)]
struct FakeStream {
    headers: HashMap<String, String>,
    body: Vec<u8>,
    replies: Vec<u32>,
    resumed: bool,
}

impl Stream for FakeStream {
    fn request_header(&mut self, name: &str) -> HostResult<Option<Vec<u8>>> {
        Ok(self.headers.get(name).map(|v| v.clone().into_bytes()))
    }
    fn remove_request_header(&mut self, name: &str) -> HostResult<()> {
        self.headers.remove(name);
        Ok(())
    }
    fn set_request_header(&mut self, name: &str, value: &str) -> HostResult<()> {
        self.headers.insert(name.into(), value.into());
        Ok(())
    }
    fn request_body(&mut self, max: usize) -> Vec<u8> {
        self.body.iter().take(max).copied().collect()
    }
    fn response_header(&mut self, _: &str) -> String {
        "200".into()
    }
    fn set_response_header(&mut self, _: &str, _: &str) -> HostResult<()> {
        Ok(())
    }
    fn response_chunk(&mut self, _: usize) -> Vec<u8> {
        Vec::new()
    }
    fn upstream_host(&mut self) -> Option<String> {
        None
    }
    fn upstream_attempts(&mut self) -> Option<u64> {
        Some(1)
    }
    fn response_flags(&mut self) -> Option<u64> {
        Some(0)
    }
    fn send_response(&mut self, status: u32, _: &[(&str, &str)], _: &[u8]) -> HostResult<()> {
        self.replies.push(status);
        Ok(())
    }
    fn resume(&mut self) -> HostResult<()> {
        self.resumed = true;
        Ok(())
    }
    fn reactivate(&mut self) -> HostResult<()> {
        Ok(())
    }
}

/// A worker's host in memory: one table, no index entries.
#[derive(Default)]
struct FakeWorker {
    table: Option<Arc<PodTable>>,
    inflight: Vec<SlotLoad>,
    waiting: HashMap<u32, FakeStream>,
    decisions: Vec<Vec<u8>>,
    metrics: Vec<(Metric, String, i64)>,
    samples: Vec<(Metric, u64)>,
    feed: Option<Vec<u8>>,
    /// Milliseconds past 1 s.
    clock_ms: u64,
}

impl MetricSink for FakeWorker {
    fn define(&mut self, _: Metric, _: &str) {}
    fn add(&mut self, metric: Metric, label: &str, delta: i64) {
        self.metrics.push((metric, label.into(), delta));
    }
    fn set(&mut self, _: Metric, _: &str, _: u64) {}
    fn record(&mut self, metric: Metric, value: u64) {
        self.samples.push((metric, value));
    }
}

impl WorkerHost for FakeWorker {
    type Table = Arc<PodTable>;
    type Other<'a> = &'a mut FakeStream;

    fn now_ms(&self) -> u64 {
        1_000 + self.clock_ms
    }
    fn current_table(&mut self) -> Option<Arc<PodTable>> {
        self.table.clone()
    }
    fn routable_table(&mut self, _: u64) -> Option<Arc<PodTable>> {
        self.table.clone()
    }
    fn index<'a>(&'a self, table: &'a PodTable) -> impl PrefixLookup + 'a {
        SnapshotIndex {
            buckets: table.buckets,
            fetch: |_| None::<Vec<u8>>,
        }
    }
    fn inflight(&mut self, slots: usize) -> Vec<SlotLoad> {
        let mut loads = self.inflight.clone();
        loads.resize(slots.max(loads.len()), SlotLoad::default());
        loads
    }
    fn adjust_inflight(&mut self, changes: &[InflightChange]) {
        for change in changes {
            if self.inflight.len() <= change.slot {
                self.inflight.resize(change.slot + 1, SlotLoad::default());
            }
            change.apply(&mut self.inflight[change.slot]);
        }
    }
    fn publish_releases(&mut self) {}
    fn idle(&self) -> bool {
        self.inflight.iter().all(|l| l.streams == 0)
    }
    fn eject(
        &mut self,
        _: &PublishedPod,
        _: &PodTable,
        _: u64,
        _: &PassiveHealthConfig,
    ) -> Option<Ejection> {
        None
    }
    fn send_decisions(&mut self, batch: &[u8]) {
        self.decisions.push(batch.to_vec());
    }
    fn feed(&mut self) -> Option<Vec<u8>> {
        self.feed.clone()
    }
    fn metric_sink(&mut self) -> &mut dyn MetricSink {
        self
    }
    fn other(&mut self, id: u32) -> Option<&mut FakeStream> {
        self.waiting.get_mut(&id)
    }
    fn answers_others_now(&self) -> bool {
        true
    }
}

impl Stream for &mut FakeStream {
    fn request_header(&mut self, name: &str) -> HostResult<Option<Vec<u8>>> {
        (**self).request_header(name)
    }
    fn remove_request_header(&mut self, name: &str) -> HostResult<()> {
        (**self).remove_request_header(name)
    }
    fn set_request_header(&mut self, name: &str, value: &str) -> HostResult<()> {
        (**self).set_request_header(name, value)
    }
    fn request_body(&mut self, max: usize) -> Vec<u8> {
        (**self).request_body(max)
    }
    fn response_header(&mut self, name: &str) -> String {
        (**self).response_header(name)
    }
    fn set_response_header(&mut self, name: &str, value: &str) -> HostResult<()> {
        (**self).set_response_header(name, value)
    }
    fn response_chunk(&mut self, size: usize) -> Vec<u8> {
        (**self).response_chunk(size)
    }
    fn upstream_host(&mut self) -> Option<String> {
        (**self).upstream_host()
    }
    fn upstream_attempts(&mut self) -> Option<u64> {
        (**self).upstream_attempts()
    }
    fn response_flags(&mut self) -> Option<u64> {
        (**self).response_flags()
    }
    fn send_response(
        &mut self,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> HostResult<()> {
        (**self).send_response(status, headers, body)
    }
    fn resume(&mut self) -> HostResult<()> {
        (**self).resume()
    }
    fn reactivate(&mut self) -> HostResult<()> {
        (**self).reactivate()
    }
}

fn config() -> Config {
    Config::parse(
        br#"{"models": {"m": {"baseModel": "m"}}, "maxQueue": 1,
             "pods": [{"id": "a", "address": "10.0.0.1:8000"}, {"id": "b", "address": "10.0.0.2:8000"}]}"#,
    )
    .unwrap()
}

fn table(queue: u32) -> Arc<PodTable> {
    let pod = |slot: usize, id: &str| PublishedPod {
        slot,
        id: id.into(),
        address: format!("10.0.0.{}:8000", slot + 1),
        queue,
        load: 0.0,
        health: 1.0,
        reported_health: 1.0,
        last_report_ms: 1_000,
        adapters: Vec::new(),
        attributes: Default::default(),
        inflight_at_report: 0,
        kv_room: Default::default(),
    };
    Arc::new(PodTable {
        generation: 1,
        published_at_ms: 1_000,
        buckets: 4,
        pods: vec![pod(0, "a"), pod(1, "b")],
        ..PodTable::default()
    })
}

fn request(prompt: &str) -> FakeStream {
    let mut stream = FakeStream::default();
    for (name, value) in [
        (":path", "/v1/completions"),
        (":method", "POST"),
        (OVERRIDE_HOST_HEADER, "6.6.6.6:1"),
    ] {
        stream.headers.insert(name.into(), value.into());
    }
    stream.body = format!(r#"{{"model": "m", "prompt": "{prompt}"}}"#).into_bytes();
    stream
}

/// A fresh worker over two idle pods, with the default configuration.
fn idle_worker() -> Worker<FakeWorker> {
    let host = FakeWorker {
        table: Some(table(0)),
        ..FakeWorker::default()
    };
    Worker::new(config(), host)
}

#[test]
fn a_request_is_routed_counted_in_flight_and_released() {
    let mut worker = idle_worker();
    let mut stream = request(&"a shared prefix ".repeat(40));
    let mut filter = RequestFilter::new(1);
    assert_eq!(
        filter.on_request_headers(&mut worker, &mut stream, false),
        Action::Pause
    );
    assert_eq!(
        filter.on_request_body(&mut worker, &mut stream, usize::MAX, true),
        Action::Continue
    );
    let listed = stream.headers[OVERRIDE_HOST_HEADER].clone();
    assert!(
        listed.starts_with("10.0.0."),
        "a client's header is replaced: {listed}"
    );
    assert_eq!(
        listed.split(',').count(),
        2,
        "the winner, then the runner-up"
    );
    assert_eq!(
        worker.host.inflight.iter().map(|l| l.requests).sum::<u32>(),
        1
    );
    filter.on_stream_end(&mut worker);
    assert!(worker.host.idle(), "released at the stream's end");
    // An idle worker flushes: the decision batch (the decision, and the
    // session start it is) and the metrics.
    let records = decode_batch(&worker.host.decisions.concat()).unwrap();
    assert!(
        matches!(
            records.as_slice(),
            [BatchRecord::Start { slot: s, .. }, BatchRecord::Decision { slot, .. }] if s == slot
        ),
        "{records:?}"
    );
    assert!(worker
        .host
        .metrics
        .contains(&(Metric::RoutingDecisions, "m".into(), 1)));
}

#[test]
fn workers_deciding_in_parallel_do_not_pick_alike_among_equal_pods() {
    // Fresh workers (one per Envoy thread and replica), each routing its
    // first request over two idle pods nobody caches: each rotates its
    // ties from its own random start, so they do not all pick one pod
    // (they did, counting from zero alike: a false failure here is 2⁻²³).
    let first_pick = || {
        let mut worker = idle_worker();
        let mut stream = request(&"a new system prompt ".repeat(40));
        let mut filter = RequestFilter::new(1);
        filter.on_request_headers(&mut worker, &mut stream, false);
        filter.on_request_body(&mut worker, &mut stream, usize::MAX, true);
        let listed = stream.headers[OVERRIDE_HOST_HEADER].clone();
        listed.split(',').next().unwrap_or_default().to_string()
    };
    let picks: std::collections::BTreeSet<String> = (0..24).map(|_| first_pick()).collect();
    assert_eq!(picks.len(), 2, "{picks:?}");
}

#[test]
fn a_waiting_request_is_resumed_through_its_host_when_a_pod_frees() {
    let mut config_json: serde_json::Value = serde_json::from_str(
        r#"{"models": {"m": {"baseModel": "m"}}, "maxQueue": 1, "onNoEligiblePod": "wait",
            "pods": [{"id": "a", "address": "10.0.0.1:8000"}, {"id": "b", "address": "10.0.0.2:8000"}]}"#,
    )
    .unwrap();
    config_json["maxWaitMs"] = 30_000.into();
    let config = Config::parse(config_json.to_string().as_bytes()).unwrap();
    // Both pods at maxQueue: nobody can take the request.
    let host = FakeWorker {
        table: Some(table(1)),
        ..FakeWorker::default()
    };
    let mut worker = Worker::new(config, host);
    let mut filter = RequestFilter::new(7);
    let mut stream = request("wait for me");
    filter.on_request_headers(&mut worker, &mut stream, false);
    assert_eq!(
        filter.on_request_body(&mut worker, &mut stream, usize::MAX, true),
        Action::Pause
    );
    assert_eq!(worker.waiting(), 1);
    assert!(stream.replies.is_empty(), "it waits, unanswered");
    // The host keeps the paused request; a pod frees; the tick places it.
    worker.host.waiting.insert(7, stream);
    worker.host.table = Some(table(0));
    worker.on_tick();
    assert_eq!(worker.waiting(), 0);
    let waited = &worker.host.waiting[&7];
    assert!(waited.resumed, "resumed through WorkerHost::other");
    assert!(waited.headers[OVERRIDE_HOST_HEADER].starts_with("10.0.0."));
    assert!(waited.replies.is_empty());
}

#[test]
fn a_streamed_answers_first_byte_teaches_the_ttft_model() {
    let mut worker = idle_worker();
    let serve = |worker: &mut Worker<FakeWorker>, id: u32, stream_answer: bool| {
        let mut stream = request(&format!("request {id} ").repeat(40));
        if stream_answer {
            stream.body = format!(
                r#"{{"model": "m", "stream": true, "prompt": "{}"}}"#,
                format!("request {id} ").repeat(40)
            )
            .into_bytes();
        }
        let mut filter = RequestFilter::new(id);
        filter.on_request_headers(worker, &mut stream, false);
        filter.on_request_body(worker, &mut stream, usize::MAX, true);
        filter.on_response_headers(worker, &mut stream);
        assert!(
            filter.wants_response_body(),
            "the first byte is wanted (queued prefill, TTFT)"
        );
        filter.on_response_body(worker, &mut stream, 16);
        assert!(!filter.wants_response_body(), "nothing past the first byte");
        filter.on_response_body(worker, &mut stream, 16);
        filter.on_stream_end(worker);
    };
    let errors = |worker: &Worker<FakeWorker>| {
        worker
            .host
            .samples
            .iter()
            .filter(|(m, _)| *m == Metric::TtftPredictionErrorPercent)
            .count()
    };
    // An unstreamed answer's first byte comes after its last token.
    serve(&mut worker, 1, false);
    assert_eq!(errors(&worker), 0);
    // A streamed one's first byte is its first token; an uncalibrated
    // model predicts in tokens, so no error is measured on it yet.
    serve(&mut worker, 2, true);
    serve(&mut worker, 3, true);
    assert_eq!(errors(&worker), 0);
    // Each streamed answer goes to the service with the decisions; the
    // worker's model learns it from the service's feed, as every other
    // worker (and replica) does.
    let answers: Vec<_> = decode_batch(&worker.host.decisions.concat())
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            BatchRecord::Answer(a) => Some(a),
            _ => None,
        })
        .collect();
    assert_eq!(answers.len(), 2);
    assert!(
        !worker.ttft_model().calibrated(),
        "nothing learnt before the feed"
    );
    let mut feed = Feed::default();
    let mut direct = TtftModel::new(config().balance.learning_window);
    for answer in &answers {
        feed.push(FeedRecord::Answer(*answer));
        let slot = usize::from(answer.slot);
        direct.observe(slot, answer.work(), answer.ttft_ms.into());
    }
    let mut other = Worker::new(
        config(),
        FakeWorker {
            table: Some(table(0)),
            feed: Some(feed.encode()),
            ..FakeWorker::default()
        },
    );
    serve(&mut other, 4, false);
    assert!(other.ttft_model().calibrated());
    for slot in 0..2 {
        assert_eq!(other.ttft_model().line(slot), direct.line(slot));
    }
    // Calibrated, it measures one error per streamed answer, at its first
    // byte only.
    serve(&mut other, 5, true);
    serve(&mut other, 6, true);
    assert_eq!(errors(&other), 2);
}

#[test]
fn every_worker_counts_every_session_start_through_the_feed() {
    // Worker a routes a session start: it goes to the service with a's
    // origin, and a counts it at once.
    let (mut a, mut b) = (idle_worker(), idle_worker());
    let mut stream = request(&"a new system prompt ".repeat(40));
    let mut filter = RequestFilter::new(1);
    filter.on_request_headers(&mut a, &mut stream, false);
    filter.on_request_body(&mut a, &mut stream, usize::MAX, true);
    filter.on_stream_end(&mut a);
    let origin = decode_batch(&a.host.decisions.concat())
        .unwrap()
        .into_iter()
        .find_map(|r| match r {
            BatchRecord::Start { start, .. } => Some(start.origin),
            _ => None,
        })
        .expect("a session start in the batch");
    assert_ne!(origin, 0, "0 is a peer replica's");
    // The feed: two of a's starts at block 77 and two of a peer's at 88,
    // as the service publishes them.
    let mut feed = Feed::default();
    for (origin, end) in [(origin, 77), (origin, 77), (0, 88), (0, 88)] {
        feed.push(FeedRecord::Start(SessionStart {
            origin,
            match_end: Some(end),
        }));
    }
    for worker in [&mut a, &mut b] {
        worker.host.feed = Some(feed.encode());
        worker.host.clock_ms += 100;
        worker.on_tick();
    }
    let starts = |worker: &Worker<FakeWorker>, end| {
        worker
            .prefix_demand()
            .demand(end, 2)
            .map(|d| d.starts.round())
    };
    // a counted its own as it routed them, not again from the feed; b
    // counts them from the feed. Both count the peer's.
    assert_eq!(starts(&a, 77), None);
    assert_eq!(starts(&b, 77), Some(2.0));
    assert_eq!(starts(&a, 88), Some(2.0));
    assert_eq!(starts(&b, 88), Some(2.0));
    // Taken once: the same feed read again adds nothing.
    b.host.clock_ms += 100;
    b.on_tick();
    assert_eq!(starts(&b, 88), Some(2.0));
}

#[test]
fn in_approximate_mode_an_answered_request_stops_counting_in_its_pods_queue() {
    // maxQueue 1: a request waiting on each pod fills the pool.
    let host = FakeWorker {
        table: Some(table(0)),
        ..FakeWorker::default()
    };
    let approximate = Config {
        mode: IndexMode::Approximate,
        ..config()
    };
    let mut worker = Worker::new(approximate, host);
    let send = |worker: &mut Worker<FakeWorker>, id: u32| {
        let mut stream = request(&format!("request {id} ").repeat(40));
        let mut filter = RequestFilter::new(id);
        filter.on_request_headers(worker, &mut stream, false);
        let action = filter.on_request_body(worker, &mut stream, usize::MAX, true);
        (filter, stream, action)
    };
    let waiting = |worker: &Worker<FakeWorker>| -> u32 {
        worker.host.inflight.iter().map(|l| l.requests).sum()
    };
    let streams = |worker: &Worker<FakeWorker>| -> u32 {
        worker.host.inflight.iter().map(|l| l.streams).sum()
    };
    let (mut first, mut first_stream, _) = send(&mut worker, 1);
    let (mut second, _, _) = send(&mut worker, 2);
    assert_eq!(waiting(&worker), 2);
    assert_eq!(
        send(&mut worker, 3).2,
        Action::Pause,
        "both pods at maxQueue"
    );
    // The first answer begins: its pod is streaming it, no longer queueing
    // it, so the pod has room while the answer goes on.
    first.on_response_headers(&mut worker, &mut first_stream);
    assert!(first.wants_response_body());
    first.on_response_body(&mut worker, &mut first_stream, 16);
    assert_eq!(waiting(&worker), 1);
    assert_eq!(streams(&worker), 2, "what the pods carry: both streams");
    assert!(!first.wants_response_body());
    let (_, _, action) = send(&mut worker, 4);
    assert_eq!(action, Action::Continue, "routed to the answering pod");
    assert_eq!(streams(&worker), 3);
    // Ends release only what still counts.
    first.on_stream_end(&mut worker);
    second.on_stream_end(&mut worker);
    assert_eq!(waiting(&worker), 1, "request 4 still waits for its answer");
    assert_eq!(streams(&worker), 1);

    // Precise mode: the pods' reports count their queues, and a request
    // counts until its end (queue = reported + routed since the report).
    let mut worker = Worker::new(
        config(),
        FakeWorker {
            table: Some(table(0)),
            ..FakeWorker::default()
        },
    );
    let (mut first, mut first_stream, _) = send(&mut worker, 1);
    first.on_response_headers(&mut worker, &mut first_stream);
    first.on_response_body(&mut worker, &mut first_stream, 16);
    assert_eq!(waiting(&worker), 1);
    first.on_stream_end(&mut worker);
    assert_eq!(waiting(&worker), 0);
}
