//! The bridge's event side: subscribes to one vLLM pod's KV events over
//! ZMQ, keeps the sequence numbers whole with replays, and feeds
//! [`PodBlocks`].
//!
//! Rules (vLLM numbers batches 0, 1, 2, … per publisher process and keeps
//! the last `buffer_steps` of them, 10,000 by default, for replay):
//! - On every (re)connect the history is unknown (the pod may have
//!   restarted while we were away): a new epoch with no blocks, rebuilt
//!   from a replay of everything the publisher still buffers.
//! - A gap (`seq` > last + 1, or a first batch after the rebuild other
//!   than the next one) asks the replay socket for the missing batches.
//!   When they are not all there (a *hole*: a batch never published, as
//!   vLLM loses one whose send fails; or an *overrun*: more batches missed
//!   than the buffer keeps), what the pod did in them is unknown, so the
//!   bridge starts a new epoch (routers resync with `full: true`) and
//!   **rebuilds it from the oldest batch the buffer holds**, not from the
//!   gap: every batch still held is applied again in order.
//! - `seq` going back is a publisher restart: new epoch, rebuilt likewise.
//!   Batches already applied that come again right after a replay (the
//!   subscription overlaps the replay) are skipped.
//! - A malformed frame is counted and logged, never fatal.
//! - Every `probe` the bridge asks the replay socket for the batches from
//!   its last one on: the same batch back (same digest) means the same
//!   publisher, and the batches after it, not delivered by the
//!   subscription yet, are applied when they follow on without a hole (a
//!   hole: rebuilt as above); no such batch, or another one, means the pod
//!   restarted (the ZMQ subscription neither reports a lost publisher nor
//!   reconnects), and only later ones means the buffer moved past the
//!   bridge: either way it reconnects and starts over (a new epoch rebuilt
//!   from the buffer).
//!
//! Counted apart: a *gap* (`kvbridge_gaps_total`) is a batch the
//! subscription itself skipped (its `seq` jumps past the one after the
//! last it delivered), whether a replay or the probe filled it; batches
//! the probe applied before the subscription delivered them are
//! `kvbridge_probe_ahead_total`. On a healthy pod the probe is often ahead
//! (vLLM buffers a batch as it sends it, and the subscription's copy is
//! still on its way or waits while the probe runs), so that count is a
//! race, not a loss; a batch the subscription never delivers shows as a
//! gap once the next one arrives. Batches published before a new
//! subscription takes effect are replayed and are not gaps.
//!
//! What a rebuilt epoch holds: every block stored by a batch the buffer
//! still holds and not removed by a later one, whose chain the bridge can
//! key (it opens a chain, or its parent was stored in a held batch too).
//! Where the buffer itself has a hole (a batch never published), a block
//! stored before the hole is kept only if a batch after it proves it
//! present: it is stored again, or a block continuing it is stored on the
//! GPU (vLLM stores a block while the request holding it holds its whole
//! prefix). The lost batch may have removed any other one, and a removal
//! the bridge never sees would leave a stale block for good.
//!
//! What it loses: blocks stored before the oldest held batch, even those
//! the pod still caches, and blocks stored later on top of them (their
//! parent is unknown: `kvbridge_blocks_skipped_unknown_parent_total`),
//! until vLLM evicts and stores them again; the blocks the lost batch
//! stored; and before a hole, the blocks nothing proves present since.
//! A block left out costs a cache hit; a block kept without proof could
//! cost stale routes, so none is kept.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use kvroute::report_log::new_epoch;
use tokio::sync::watch;
use xxhash_rust::xxh64::xxh64;
use zeromq::{
    DealerSocket, Endpoint, Host, Socket, SocketEvent, SocketRecv, SocketSend, SubSocket,
    ZmqMessage,
};

use crate::blocks::{Hashing, PodBlocks};
use crate::capacity::Capacity;
use crate::wire::{decode_batch, decode_seq};

/// How long a replay may take to answer each frame.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the pod publishes.
#[derive(Debug, Clone)]
pub struct Endpoints {
    /// vLLM's `endpoint` (PUB), e.g. `ipc:///run/kvroute/kv-events.sock`
    /// or `tcp://127.0.0.1:5557`.
    pub events: String,
    /// vLLM's `replay_endpoint` (ROUTER); `None`: gaps always resync.
    pub replay: Option<String>,
    /// vLLM's `topic` (a prefix filter; empty: everything).
    pub topic: String,
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct Counters {
    pub batches: AtomicU64,
    pub events: AtomicU64,
    pub unknown_events: AtomicU64,
    pub malformed_frames: AtomicU64,
    /// Batches the subscription skipped (see the module documentation).
    pub gaps: AtomicU64,
    /// Batches the probe applied before the subscription delivered them.
    pub probe_ahead: AtomicU64,
    pub replays: AtomicU64,
    pub replay_failures: AtomicU64,
    pub resyncs: AtomicU64,
    pub publisher_restarts: AtomicU64,
    pub connects: AtomicU64,
}

/// The pod's state under one epoch.
pub struct State {
    pub epoch: String,
    pub blocks: PodBlocks,
    /// Last publisher `seq` applied (`None`: none since the epoch began).
    last_seq: Option<i64>,
    /// xxh64 of that batch's payload, to recognise it in a replay.
    last_digest: u64,
    /// After a replay up to this `seq`, subscribed batches up to it are
    /// duplicates, not a restart.
    replayed_to: Option<i64>,
}

/// One bridged pod: its state, counters, and a watch that ticks on every
/// change (for long-polled reports).
pub struct Bridge {
    pub pod_id: String,
    hashing: Hashing,
    max_log: usize,
    state: Mutex<State>,
    pub counters: Counters,
    /// The pod's cache size ([`crate::capacity`]).
    pub capacity: Arc<Capacity>,
    /// (epoch, report seq) after every change.
    pub changed: watch::Sender<(String, u64)>,
}

/// What to do with one subscribed batch.
enum Step {
    Apply,
    Duplicate,
    Gap { from: i64 },
    Restart,
}

impl Bridge {
    pub fn new(pod_id: String, hashing: Hashing, max_log: usize) -> Bridge {
        let epoch = new_epoch();
        Bridge {
            pod_id,
            state: Mutex::new(State {
                epoch: epoch.clone(),
                blocks: PodBlocks::new(hashing.clone(), max_log),
                last_seq: None,
                last_digest: 0,
                replayed_to: None,
            }),
            hashing,
            max_log,
            counters: Counters::default(),
            capacity: Arc::default(),
            changed: watch::channel((epoch, 0)).0,
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn notify(&self, state: &State) {
        self.changed
            .send_replace((state.epoch.clone(), state.blocks.seq()));
    }

    /// Forgets everything: a new epoch with no blocks.
    fn reset(&self, why: &str) {
        let mut state = self.lock();
        eprintln!(
            "kvroute-vllm-bridge {}: new epoch ({why}); dropping {} blocks",
            self.pod_id,
            state.blocks.len()
        );
        *state = State {
            epoch: new_epoch(),
            blocks: PodBlocks::new(self.hashing.clone(), self.max_log),
            last_seq: None,
            last_digest: 0,
            replayed_to: None,
        };
        self.notify(&state);
    }

    /// Decodes and applies the batch `seq`; a malformed one is counted,
    /// logged and passed over.
    fn apply(&self, state: &mut State, seq: i64, payload: &[u8]) {
        state.last_seq = Some(seq);
        state.last_digest = xxh64(payload, 0);
        match decode_batch(payload) {
            Ok(batch) => {
                self.counters.batches.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .events
                    .fetch_add(batch.events.len() as u64, Ordering::Relaxed);
                self.counters
                    .unknown_events
                    .fetch_add(batch.unknown as u64, Ordering::Relaxed);
                let refused = state.blocks.refused();
                let wrong_size = state.blocks.skipped.wrong_size;
                for event in &batch.events {
                    state.blocks.apply(event);
                }
                self.log_refused(&state.blocks, refused);
                let tokens = self.hashing.layout.block_size;
                if let Some(line) = size_error(&self.pod_id, &state.blocks, wrong_size, tokens) {
                    eprintln!("{line}");
                }
            }
            Err(e) => self.malformed(&format!("batch {seq}: {e}")),
        }
    }

    /// Logs blocks refused for a shape vLLM does not send today (extra
    /// keys, medium), whenever their count passes a power of two (a newer
    /// vLLM may send such a shape on every block: the log stays bounded).
    fn log_refused(&self, blocks: &PodBlocks, before: u64) {
        let after = blocks.refused();
        if !passed_power_of_two(before, after) {
            return;
        }
        eprintln!(
            "kvroute-vllm-bridge {}: {after} stored blocks refused so far for a shape vLLM does not send today (kvbridge_blocks_skipped_unknown_{{extra_keys,medium}}_total); the latest, {}",
            self.pod_id,
            blocks.refusal().unwrap_or("?")
        );
    }

    fn malformed(&self, what: &str) {
        self.counters
            .malformed_frames
            .fetch_add(1, Ordering::Relaxed);
        eprintln!(
            "kvroute-vllm-bridge {}: malformed frame: {what}",
            self.pod_id
        );
    }

    fn step(&self, seq: i64) -> Step {
        let mut state = self.lock();
        if let Some(to) = state.replayed_to {
            if seq <= to {
                return Step::Duplicate;
            }
            state.replayed_to = None;
        }
        match state.last_seq {
            // Nothing applied in this epoch (the buffer was empty when it
            // was rebuilt): batches before this one were published between
            // the replay and the subscription taking effect.
            None if seq > 0 => Step::Gap { from: 0 },
            None => Step::Apply,
            Some(last) if seq == last + 1 => Step::Apply,
            Some(last) if seq > last + 1 => Step::Gap { from: last + 1 },
            Some(_) => Step::Restart,
        }
    }

    /// Handles one subscribed message `[topic, seq, payload]`;
    /// `delivered` is the last `seq` this subscription delivered.
    async fn receive(
        &self,
        endpoints: &Endpoints,
        delivered: &mut Option<i64>,
        message: ZmqMessage,
    ) {
        let frames = message.into_vec();
        let (Some(seq_frame), Some(payload), 3) = (frames.get(1), frames.get(2), frames.len())
        else {
            self.malformed(&format!("{} parts, expected 3", frames.len()));
            return;
        };
        let Some(seq) = decode_seq(seq_frame).filter(|s| *s >= 0) else {
            self.malformed(&format!("sequence frame of {} bytes", seq_frame.len()));
            return;
        };
        // Counted on the subscription's own numbering, not on what the
        // bridge applied: the probe may have applied the skipped batches
        // already, and the batches before this subscription's first one
        // were published before it took effect.
        if delivered.is_some_and(|last| seq > last + 1) {
            self.counters.gaps.fetch_add(1, Ordering::Relaxed);
        }
        *delivered = Some(seq);
        match self.step(seq) {
            Step::Duplicate => return,
            Step::Apply => {}
            Step::Gap { from } => self.catch_up(endpoints, from, Some(seq)).await,
            Step::Restart => {
                self.counters
                    .publisher_restarts
                    .fetch_add(1, Ordering::Relaxed);
                self.reset("publisher restarted: seq went back");
                self.catch_up(endpoints, 0, Some(seq)).await;
            }
        }
        let mut state = self.lock();
        if state.last_seq.is_none_or(|last| seq > last) {
            self.apply(&mut state, seq, payload);
        }
        self.notify(&state);
    }

    /// Replays from `from`; `upto` is the batch that revealed the gap,
    /// which the replay must reach (else the batches before it are a hole
    /// too). If the batches from `from` are not all there (or the replay
    /// socket cannot be asked), the history has a hole: a new epoch,
    /// rebuilt from the oldest batch the buffer holds ([`Bridge::rebuild`]).
    async fn catch_up(&self, endpoints: &Endpoints, from: i64, upto: Option<i64>) {
        let frames = match &endpoints.replay {
            Some(replay) => self.replay(replay, from).await,
            None => Vec::new(),
        };
        if from > 0 && !follows_on(&frames, from, upto) {
            self.counters.resyncs.fetch_add(1, Ordering::Relaxed);
            let why = format!("batches from {from} are not all in the replay buffer");
            match &endpoints.replay {
                Some(replay) => self.rebuild(replay, &why).await,
                None => self.reset(&why),
            }
            return;
        }
        self.apply_replayed(&frames);
    }

    /// The batches from `from` the replay socket holds; none when it
    /// cannot be asked (counted and logged).
    async fn replay(&self, replay: &str, from: i64) -> Vec<(i64, Bytes)> {
        self.counters.replays.fetch_add(1, Ordering::Relaxed);
        replay_from(replay, from).await.unwrap_or_else(|e| {
            self.counters
                .replay_failures
                .fetch_add(1, Ordering::Relaxed);
            eprintln!("kvroute-vllm-bridge {}: replay failed: {e}", self.pod_id);
            Vec::new()
        })
    }

    /// A new epoch rebuilt from every batch the replay buffer still holds,
    /// oldest first. Where the buffer itself has a hole (a batch never
    /// published), the blocks stored before it are kept only if a batch
    /// after it proves them present (see the module documentation).
    async fn rebuild(&self, replay: &str, why: &str) {
        self.reset(&format!(
            "{why}; rebuilding from the oldest batch the buffer holds"
        ));
        let frames = self.replay(replay, 0).await;
        // After the newest hole in the buffer, the history is whole.
        let whole_from = frames
            .windows(2)
            .rposition(|pair| pair[1].0 != pair[0].0 + 1)
            .map_or(0, |i| i + 1);
        let mut state = self.lock();
        for (i, (seq, payload)) in frames.iter().enumerate() {
            if i == whole_from && i > 0 {
                state.blocks.start_proof();
            }
            self.apply(&mut state, *seq, payload);
        }
        let dropped = state.blocks.end_proof();
        if let Some((last, _)) = frames.last() {
            state.replayed_to = Some(*last);
        }
        self.notify(&state);
        let span = match (frames.first(), frames.last()) {
            (Some((first, _)), Some((last, _))) => format!("{first}..={last}"),
            _ => "none".into(),
        };
        let hole = match frames.get(whole_from).filter(|_| whole_from > 0) {
            Some((after, _)) => format!(
                "; {dropped} stored before the hole ending at {after} and not seen since dropped"
            ),
            None => String::new(),
        };
        eprintln!(
            "kvroute-vllm-bridge {}: rebuilt from {} buffered batches ({span}){hole}: {} blocks",
            self.pod_id,
            frames.len(),
            state.blocks.len()
        );
    }

    /// Applies replayed batches not applied yet (how many it applied); the
    /// subscription's copies of them that follow are duplicates.
    fn apply_replayed(&self, frames: &[(i64, Bytes)]) -> u64 {
        let mut state = self.lock();
        let mut applied = 0;
        for (seq, payload) in frames {
            if state.last_seq.is_none_or(|last| *seq > last) {
                self.apply(&mut state, *seq, payload);
                applied += 1;
            }
        }
        if let Some((last, _)) = frames.last() {
            state.replayed_to = Some(state.replayed_to.map_or(*last, |to| to.max(*last)));
        }
        self.notify(&state);
        applied
    }

    /// Applies batches the probe found before the subscription delivered
    /// them.
    fn apply_ahead(&self, frames: &[(i64, Bytes)]) {
        let applied = self.apply_replayed(frames);
        self.counters
            .probe_ahead
            .fetch_add(applied, Ordering::Relaxed);
    }

    /// The periodic check (see the module documentation); `false` when the
    /// publisher restarted and the subscription must start over.
    async fn probe(&self, replay: &str) -> bool {
        let (last, digest) = {
            let state = self.lock();
            (state.last_seq, state.last_digest)
        };
        let Ok(frames) = replay_from(replay, last.unwrap_or(0)).await else {
            // Unreachable: the pod is down or busy; its next answer tells.
            return true;
        };
        let Some(last) = last else {
            self.apply_ahead(&frames);
            return true;
        };
        match frames.first() {
            Some((seq, payload)) if *seq == last && xxh64(payload, 0) == digest => {
                if follows_on(&frames, last, None) {
                    self.apply_ahead(&frames);
                } else {
                    // The same publisher, with a batch missing after ours.
                    self.counters.resyncs.fetch_add(1, Ordering::Relaxed);
                    let why = format!("a batch after {last} is not in the replay buffer");
                    self.rebuild(replay, &why).await;
                }
                true
            }
            // The buffer moved past our last batch while the subscription
            // delivered nothing: a hole, as in `catch_up`.
            Some((seq, _)) if *seq > last => {
                self.counters.resyncs.fetch_add(1, Ordering::Relaxed);
                eprintln!(
                    "kvroute-vllm-bridge {}: batches after {last} were missed and are gone from the replay buffer",
                    self.pod_id
                );
                false
            }
            _ => {
                self.counters
                    .publisher_restarts
                    .fetch_add(1, Ordering::Relaxed);
                eprintln!(
                    "kvroute-vllm-bridge {}: batch {last} is no longer the one applied: the publisher restarted",
                    self.pod_id
                );
                false
            }
        }
    }

    /// Follows the pod's events until the process ends: connects (retrying
    /// while the pod is down), rebuilds from a replay, applies batches, and
    /// starts over when the connection drops.
    pub async fn run(&self, endpoints: Endpoints, probe: Duration) {
        // The last connect error logged: an `ipc://` socket is missing
        // until vLLM has loaded its model (minutes), one line is enough.
        let mut refused: Option<String> = None;
        loop {
            let mut socket = SubSocket::new();
            let mut monitor = socket.monitor();
            if let Err(e) = socket.connect(&endpoints.events).await {
                let error = e.to_string();
                if refused.as_ref() != Some(&error) {
                    eprintln!(
                        "kvroute-vllm-bridge {}: cannot connect to {}: {error} (retrying every 200 ms)",
                        self.pod_id, endpoints.events
                    );
                    refused = Some(error);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            refused = None;
            if let Err(e) = socket.subscribe(&endpoints.topic).await {
                eprintln!("kvroute-vllm-bridge {}: subscribe: {e}", self.pod_id);
                continue;
            }
            self.counters.connects.fetch_add(1, Ordering::Relaxed);
            self.reset(&format!("connected to {}", endpoints.events));
            self.catch_up(&endpoints, 0, None).await;
            let mut probes = tokio::time::interval(probe);
            probes.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            probes.tick().await;
            let mut delivered = None;
            loop {
                tokio::select! {
                    _ = probes.tick(), if endpoints.replay.is_some() => {
                        let replay = endpoints.replay.as_deref().unwrap_or_default();
                        if !self.probe(replay).await {
                            break;
                        }
                    }
                    message = socket.recv() => match message {
                        Ok(message) => self.receive(&endpoints, &mut delivered, message).await,
                        Err(e) => {
                            eprintln!("kvroute-vllm-bridge {}: receive: {e}", self.pod_id);
                            break;
                        }
                    },
                    event = monitor.next() => match event {
                        Some(SocketEvent::Disconnected(_)) | None => break,
                        Some(_) => {}
                    },
                }
            }
        }
    }
}

/// Checks an endpoint the bridge connects to (`flag` names it in the
/// error): `tcp://HOST:PORT` or `ipc://PATH`.
pub fn check_endpoint(flag: &str, endpoint: &str) -> Result<(), String> {
    match endpoint.parse::<Endpoint>() {
        Err(e) => Err(format!(
            "{flag} {endpoint}: {e}; expected tcp://HOST:PORT or ipc://PATH"
        )),
        // vLLM's own `tcp://*:PORT` copied as is.
        Ok(Endpoint::Tcp(Host::Domain(host), _)) if host == "*" => Err(format!(
            "{flag} {endpoint}: `*` is where vLLM binds, and the bridge connects: \
             give vLLM's ipc:// endpoint, or its port on the pod's address (tcp://127.0.0.1:PORT)"
        )),
        Ok(_) => Ok(()),
    }
}

/// Whether a count that went from `before` to `after` passed a power of
/// two, in (before, after] (its bit length grew): when a count of blocks
/// left out is logged, at once and then ever more rarely, as its cause
/// may recur on every block.
fn passed_power_of_two(before: u64, after: u64) -> bool {
    u64::BITS - after.leading_zeros() != u64::BITS - before.leading_zeros()
}

/// The error line for blocks left out for their size
/// (`kvbridge_blocks_skipped_block_size_total`, from `before`) when their
/// count passed a power of two: a `block_size` other than
/// `blockSizeTokens` leaves out every block of the pod, and nothing else
/// says so (precise routing just never finds the pod's blocks). vLLM's CPU
/// build runs with 32 (it refuses 16), kvroute's default is 16.
fn size_error(
    pod_id: &str,
    blocks: &PodBlocks,
    before: u64,
    block_size_tokens: usize,
) -> Option<String> {
    let after = blocks.skipped.wrong_size;
    if !passed_power_of_two(before, after) {
        return None;
    }
    let why = match blocks.size_refusal() {
        Some(size) => format!(
            "vLLM's block_size is {size} but blockSizeTokens is {block_size_tokens} (--config; 16 without), \
             so no block of this pod is keyed and kvroute routes it without cache affinity: \
             set blockSizeTokens to {size} in the plugin configuration, this bridge's --config \
             and kvroute's alike (vLLM's CPU build takes multiples of 32 only), \
             or start vLLM with --block-size {block_size_tokens}"
        ),
        None => "the latest event's token_ids do not cover its blocks".into(),
    };
    Some(format!(
        "kvroute-vllm-bridge {pod_id}: error: {after} stored blocks left out so far for their size \
         (kvbridge_blocks_skipped_block_size_total): {why}"
    ))
}

/// Whether `frames` are the batches `from`, `from + 1`, … without a hole,
/// reaching at least the one before `upto` (the batch that revealed the
/// gap) when given.
fn follows_on(frames: &[(i64, Bytes)], from: i64, upto: Option<i64>) -> bool {
    let mut next = from;
    for (seq, _) in frames {
        if *seq != next {
            return false;
        }
        next += 1;
    }
    upto.is_none_or(|upto| next >= upto)
}

/// Asks vLLM's replay socket for the batches from `start`: sends the
/// 8-byte start seq and reads `(seq, payload)` frames until seq −1.
pub async fn replay_from(endpoint: &str, start: i64) -> Result<Vec<(i64, Bytes)>, String> {
    let mut socket = DealerSocket::new();
    tokio::time::timeout(REPLAY_TIMEOUT, socket.connect(endpoint))
        .await
        .map_err(|_| format!("connect to {endpoint} timed out"))?
        .map_err(|e| format!("connect to {endpoint}: {e}"))?;
    // A ROUTER sees [identity, delimiter, body] from a REQ; a DEALER sends
    // the empty delimiter itself.
    let request: ZmqMessage = vec![Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())]
        .try_into()
        .map_err(|e| format!("{e}"))?;
    socket.send(request).await.map_err(|e| e.to_string())?;
    let mut frames = Vec::new();
    loop {
        let message = tokio::time::timeout(REPLAY_TIMEOUT, socket.recv())
            .await
            .map_err(|_| "replay stopped answering".to_string())?
            .map_err(|e| e.to_string())?;
        let parts = message.into_vec();
        let n = parts.len();
        let (Some(seq), Some(payload)) =
            (n.checked_sub(2).and_then(|i| parts.get(i)), parts.last())
        else {
            return Err(format!("replay frame of {n} parts"));
        };
        match decode_seq(seq) {
            Some(-1) => return Ok(frames),
            Some(seq) if seq >= start => frames.push((seq, payload.clone())),
            Some(seq) => return Err(format!("replay sent {seq} before the asked {start}")),
            None => return Err("replay frame without an 8-byte seq".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use kvroute::hashing::BlockLayout;

    use super::*;
    use crate::wire::KvEvent;

    /// A pod of kvroute's default token layout (blockSizeTokens 16).
    fn default_pod() -> PodBlocks {
        let layout = BlockLayout {
            block_size: 16,
            coarse_after: 256,
            coarse_factor: 16,
            max_blocks: 2048,
        };
        let hashing = Hashing {
            secret: String::new(),
            base_model: "m".into(),
            layout,
            lora_ids: HashMap::new(),
            text: None,
        };
        PodBlocks::new(hashing, 100)
    }

    /// A first stored event of `blocks` blocks of `block_size` and `tokens` tokens.
    fn stored(blocks: u64, block_size: usize, tokens: usize) -> KvEvent {
        KvEvent::Stored {
            block_hashes: (1..=blocks).collect(),
            parent_block_hash: None,
            token_ids: vec![7; tokens],
            block_size,
            lora_id: None,
            medium: None,
            lora_name: None,
            extra_keys: Vec::new(),
        }
    }

    #[test]
    fn blocks_of_another_size_are_an_error_naming_both_sizes_at_powers_of_two() {
        // vLLM's CPU build: blocks of 32.
        let (mut pod, cpu) = (default_pod(), stored(1, 32, 32));
        let mut lines = Vec::new();
        for _ in 0..5 {
            let before = pod.skipped.wrong_size;
            pod.apply(&cpu);
            lines.push(size_error("vllm-0", &pod, before, 16));
        }
        assert!(pod.is_empty());
        assert_eq!(
            lines.iter().map(Option::is_some).collect::<Vec<_>>(),
            [true, true, false, true, false],
            "the 1st, 2nd and 4th block"
        );
        let first = lines[0].as_deref().unwrap();
        assert!(
            first.starts_with("kvroute-vllm-bridge vllm-0: error: 1 stored blocks left out"),
            "{first}"
        );
        for what in [
            "vLLM's block_size is 32",
            "blockSizeTokens is 16 (--config",
            "set blockSizeTokens to 32",
            "--block-size 16",
        ] {
            assert!(first.contains(what), "{what}: {first}");
        }
        // An event of several blocks counts them all.
        let mut pod = default_pod();
        pod.apply(&stored(3, 32, 96));
        let line = size_error("vllm-0", &pod, 0, 16).expect("3 passed 1 and 2");
        assert!(line.contains(": error: 3 stored blocks"), "{line}");
        // token_ids short of their blocks are left out for size too, and
        // said to be.
        pod.apply(&stored(3, 16, 20));
        let line = size_error("vllm-0", &pod, 3, 16).expect("6 passed 4");
        assert!(
            line.ends_with("token_ids do not cover its blocks"),
            "{line}"
        );
    }
}
