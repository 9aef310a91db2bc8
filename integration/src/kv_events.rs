//! kvroute-sim's `--kv-events`: the simulated pod publishes its cache as
//! stock vLLM does, so kvroute-vllm-bridge can be tested against it: ZMQ
//! PUB messages `[topic, seq, EventBatch]` (see `kvroute_vllm_bridge::wire`)
//! and a ROUTER replay socket answering a start seq with the buffered
//! `(seq, payload)` frames and seq −1.
//!
//! Each cache change becomes one batch: the cache's logged events since
//! the last batch, stored blocks grouped into chains as vLLM groups a
//! request's new blocks. With a CPU tier (`--cpu-kv-blocks`) a block the
//! GPU evicts to it is published as vLLM's offloading connector publishes
//! it by default (a `CPU` store per vLLM block, named by hash only), then
//! its `GPU` removal; a reload as a `GPU` store, then its `CPU` removal. The sim's coarse blocks (past `coarseAfterBlocks`)
//! are published as the vLLM blocks they span, removed tail first. Token-ID
//! prompts are published, and with `--tokenizer` text and chat prompts too,
//! as the tokens of the text vLLM would tokenize ([`crate::tokenizer`]);
//! without it the sim caches text prompts as kvroute's text blocks, which
//! vLLM never publishes. vLLM's block hashes
//! are opaque to consumers, so the sim publishes its own opaque ones (not
//! kvroute's keys), and the bridge has to derive kvroute's keys from the
//! token IDs as it must with vLLM.
//!
//! Faults for the bridge's tests: batches left off the PUB socket (still
//! buffered for replay: a gap, or past `buffer_steps` an overrun), batches
//! numbered but neither sent nor buffered (a hole: vLLM's publisher loses a
//! batch so when its send raises, after taking its number), batches sent
//! late (a lagging subscription: replays see them first), garbage frames,
//! and `AllBlocksCleared`.
//!
//! Both sockets bind `tcp://` or `ipc://` endpoints, as vLLM binds them.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvroute::hashing::BlockLayout;
use kvroute::report::Tier;
use kvroute::report_log::BlockEvent;
use kvroute_vllm_bridge::wire::{encode_batch, KvEvent, Shape};
use rmpv::Value as Msgpack;
use tokio::sync::mpsc;
use tokio::time::Instant;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::model::KvCache;

/// Where and how to publish.
#[derive(Debug, Clone)]
pub struct PublisherOptions {
    /// PUB endpoint to bind, e.g. `tcp://127.0.0.1:5557` or
    /// `ipc:///run/kvroute/kv-events.sock`.
    pub endpoint: String,
    /// ROUTER endpoint to bind for replays (`tcp://` or `ipc://`).
    pub replay_endpoint: Option<String>,
    pub topic: String,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    pub buffer_steps: usize,
    pub shape: Shape,
    /// Publish `extra_keys` in the typed form proposed upstream (tagged
    /// structs, in `shape`) instead of vLLM's raw tuples.
    pub typed_extra_keys: bool,
    /// The sim's token layout (uncapped): its blocks of `block_size`
    /// tokens (vLLM's) and, past `coarse_after`, its coarse ones, each
    /// published as the `coarse_factor` vLLM blocks it spans.
    pub layout: BlockLayout,
}

/// A block's tokens (one vLLM block's, or a coarse block's several),
/// adapter and (a prompt's first block only) `cache_salt`, kept from its
/// admission until its removal is published, and the tier it is published
/// in (`None`: not yet).
struct BlockTokens {
    tokens: Vec<u32>,
    lora_name: Option<String>,
    salt: Option<String>,
    tier: Option<Tier>,
}

/// vLLM's `medium` of a tier (`MEDIUM_GPU`, `MEDIUM_CPU`, `MEDIUM_STORAGE`).
fn medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Gpu => "GPU",
        Tier::Cpu => "CPU",
        Tier::Disk => "STORAGE",
    }
}

impl BlockTokens {
    /// vLLM's `extra_keys` of each of the `vllm_blocks` this block spans:
    /// the adapter's name in every one, the salt in the first; nil for a
    /// block with neither. `typed`: each key as the tagged struct of the
    /// typed form proposed upstream (`LoRAKey`, `CacheSaltKey`) instead.
    fn extra_keys(&self, vllm_blocks: usize, typed: Option<Shape>) -> Vec<Option<Msgpack>> {
        let key = |tag: &str, field: &str, value: &str| match typed {
            None => Msgpack::from(value),
            Some(Shape::Map) => Msgpack::Map(vec![
                ("type".into(), tag.into()),
                (field.into(), value.into()),
            ]),
            Some(Shape::Positional) => Msgpack::Array(vec![tag.into(), value.into()]),
        };
        (0..vllm_blocks)
            .map(|i| {
                let adapter = self.lora_name.as_deref().map(|n| key("LoRAKey", "name", n));
                let salt = self.salt.as_deref().filter(|_| i == 0);
                let salt = salt.map(|s| key("CacheSaltKey", "salt", s));
                let keys: Vec<Msgpack> = adapter.into_iter().chain(salt).collect();
                (!keys.is_empty()).then_some(Msgpack::Array(keys))
            })
            .collect()
    }
}

struct State {
    /// The cache `seq` published up to.
    published: u64,
    blocks: HashMap<u64, BlockTokens>,
    next_seq: i64,
    buffer: VecDeque<(i64, Bytes)>,
    /// Batches still to leave off the PUB socket.
    drop_next: u64,
    /// Batches still to lose (numbered, never buffered nor sent).
    lose_next: u64,
    /// How long after it is buffered a batch reaches the PUB socket.
    lag: Duration,
}

/// The pod's publisher (see the module documentation).
pub struct Publisher {
    options: PublisherOptions,
    state: Mutex<State>,
    /// Messages for the PUB socket, each with when to send it.
    outgoing: mpsc::UnboundedSender<(Instant, ZmqMessage)>,
}

/// The opaque hash published for the vLLM block `from_end` blocks before
/// the end of kvroute block `key` (0: its last, the one its children
/// name as parent).
fn vllm_hash(key: u64, from_end: usize) -> u64 {
    let material = [key.to_le_bytes(), (from_end as u64).to_le_bytes()].concat();
    xxhash_rust::xxh64::xxh64(&material, 0x766c_6c6d)
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

fn message(frames: Vec<Bytes>) -> ZmqMessage {
    frames.try_into().expect("at least one frame")
}

/// Binds `socket` to `endpoint`. An `ipc://` socket file left by a pod
/// killed before it could unbind is removed first, as libzmq (vLLM's
/// pyzmq) does: a restarted pod binds the same path again.
async fn bind(socket: &mut impl Socket, endpoint: &str) -> Result<(), String> {
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(format!("cannot remove the old socket file {path}: {e}"));
            }
            _ => {}
        }
    }
    socket
        .bind(endpoint)
        .await
        .map(|_| ())
        .map_err(|e| format!("cannot bind {endpoint}: {e}"))
}

impl Publisher {
    /// Binds the sockets and starts sending (on the current runtime).
    pub async fn start(options: PublisherOptions) -> Result<Arc<Publisher>, String> {
        let mut publisher = PubSocket::new();
        bind(&mut publisher, &options.endpoint).await?;
        let (outgoing, mut queue) = mpsc::unbounded_channel::<(Instant, ZmqMessage)>();
        tokio::spawn(async move {
            while let Some((due, message)) = queue.recv().await {
                tokio::time::sleep_until(due).await;
                let _ = publisher.send(message).await;
            }
        });
        let this = Arc::new(Publisher {
            options: options.clone(),
            state: Mutex::new(State {
                published: 0,
                blocks: HashMap::new(),
                next_seq: 0,
                buffer: VecDeque::new(),
                drop_next: 0,
                lose_next: 0,
                lag: Duration::ZERO,
            }),
            outgoing,
        });
        if let Some(endpoint) = &options.replay_endpoint {
            let mut router = RouterSocket::new();
            bind(&mut router, endpoint).await?;
            let replayer = this.clone();
            tokio::spawn(async move { replayer.serve_replays(router).await });
        }
        Ok(this)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn serve_replays(&self, mut router: RouterSocket) {
        while let Ok(request) = router.recv().await {
            let frames = request.into_vec();
            // [identity, delimiter, start seq], as vLLM expects.
            let (Some(identity), Some(start), 3) = (frames.first(), frames.get(2), frames.len())
            else {
                continue;
            };
            let Some(start) = kvroute_vllm_bridge::wire::decode_seq(start) else {
                continue;
            };
            let replies: Vec<(i64, Bytes)> = self
                .lock()
                .buffer
                .iter()
                .filter(|(seq, _)| *seq >= start)
                .cloned()
                .chain(std::iter::once((-1, Bytes::new())))
                .collect();
            for (seq, payload) in replies {
                let reply = message(vec![
                    identity.clone(),
                    Bytes::new(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ]);
                if router.send(reply).await.is_err() {
                    break;
                }
            }
        }
    }

    /// Keeps `tokens`' blocks (the admitted prompt whose kvroute chain is
    /// `chain`, with vLLM's `cache_salt` `salt`) so their stored events can
    /// carry token IDs and extra keys.
    pub fn admit(
        &self,
        chain: &[u64],
        tokens: &[u32],
        lora_name: Option<&str>,
        salt: Option<&str>,
    ) {
        let mut state = self.lock();
        for (i, (key, block)) in chain
            .iter()
            .zip(self.options.layout.blocks(tokens))
            .enumerate()
        {
            state.blocks.entry(*key).or_insert_with(|| BlockTokens {
                tokens: block.to_vec(),
                lora_name: lora_name.map(str::to_string),
                salt: salt.filter(|_| i == 0).map(str::to_string),
                tier: None,
            });
        }
    }

    /// Publishes the cache's events since the last call as one batch;
    /// with `cleared`, its removals as one `AllBlocksCleared` instead.
    pub fn publish(&self, cache: &KvCache, cleared: bool) {
        let mut state = self.lock();
        let Some(events) = cache.events_after(state.published) else {
            // The log dropped events never published (a change larger than
            // `--log-events`): they are lost, as a publisher queue overflow
            // loses them; go on from here.
            state.published = cache.seq();
            return;
        };
        let mut batch: Vec<KvEvent> = Vec::new();
        let mut removed_any = false;
        for event in events {
            if !event.stored {
                let Some(block) = state.blocks.remove(&event.hash) else {
                    continue;
                };
                removed_any = true;
                if let (Some(tier), false) = (block.tier, cleared) {
                    self.push_removed(&mut batch, event.hash, &block, tier);
                }
                continue;
            }
            let Some(block) = state.blocks.get_mut(&event.hash) else {
                continue;
            };
            let before = block.tier.replace(event.tier);
            let block = &state.blocks[&event.hash];
            match before {
                Some(tier) if tier == event.tier => {}
                // A move: the copy in the new tier, then the old one goes.
                Some(old) => {
                    if event.tier == Tier::Gpu {
                        self.push_stored(&mut batch, event, block);
                    } else {
                        self.push_copies(&mut batch, event.hash, block, event.tier);
                    }
                    self.push_removed(&mut batch, event.hash, block, old);
                }
                None => self.push_stored(&mut batch, event, block),
            }
        }
        state.published = cache.seq();
        if cleared && removed_any {
            batch.push(KvEvent::AllCleared);
        }
        // One entry per block, or none at all when no block has extra keys
        // (msgspec omits the default).
        for event in &mut batch {
            if let KvEvent::Stored { extra_keys, .. } = event {
                if extra_keys.iter().all(Option::is_none) {
                    extra_keys.clear();
                }
            }
        }
        if batch.is_empty() {
            return;
        }
        let payload = encode_batch(now(), &batch, 0, self.options.shape);
        self.send(&mut state, Bytes::from(payload));
    }

    /// Adds `block`'s store (`event`) to the batch, with its token ids:
    /// joining the previous stored chain when it continues it (a salted
    /// block opens a chain: it never continues one).
    fn push_stored(&self, batch: &mut Vec<KvEvent>, event: &BlockEvent, block: &BlockTokens) {
        let parent = event.parent.map(|parent| vllm_hash(parent, 0));
        let vllm_blocks = self.vllm_blocks(block);
        let hashes: Vec<u64> = (0..vllm_blocks)
            .rev()
            .map(|i| vllm_hash(event.hash, i))
            .collect();
        let typed = self.options.typed_extra_keys.then_some(self.options.shape);
        let extra = block.extra_keys(vllm_blocks, typed);
        let medium = Some(medium(event.tier).to_string());
        if let Some(KvEvent::Stored {
            block_hashes,
            token_ids,
            lora_name,
            extra_keys,
            medium: last_medium,
            ..
        }) = batch.last_mut()
        {
            let continues = block_hashes.last().copied() == parent && !token_ids.is_empty();
            if continues && *lora_name == block.lora_name && *last_medium == medium {
                block_hashes.extend(hashes);
                token_ids.extend_from_slice(&block.tokens);
                extra_keys.extend(extra);
                return;
            }
        }
        batch.push(KvEvent::Stored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: block.tokens.clone(),
            block_size: self.options.layout.block_size,
            lora_id: block.lora_name.as_ref().map(|_| 1),
            medium,
            lora_name: block.lora_name.clone(),
            extra_keys: extra,
        });
    }

    /// Adds copies in `tier` of the vLLM blocks of kvroute block `hash`, as
    /// vLLM's offloading connector publishes them by default: one store per
    /// block, named by hash only (no token ids, no parent, `block_size` 0).
    fn push_copies(&self, batch: &mut Vec<KvEvent>, hash: u64, block: &BlockTokens, tier: Tier) {
        for i in (0..self.vllm_blocks(block)).rev() {
            batch.push(KvEvent::Stored {
                block_hashes: vec![vllm_hash(hash, i)],
                parent_block_hash: None,
                token_ids: Vec::new(),
                block_size: 0,
                lora_id: None,
                medium: Some(medium(tier).to_string()),
                lora_name: None,
                extra_keys: Vec::new(),
            });
        }
    }

    /// Adds the removal from `tier` of kvroute block `hash`'s vLLM blocks,
    /// tail first as vLLM frees a request's blocks, joining the previous
    /// removal from the same medium.
    fn push_removed(&self, batch: &mut Vec<KvEvent>, hash: u64, block: &BlockTokens, tier: Tier) {
        let hashes = (0..self.vllm_blocks(block)).map(|i| vllm_hash(hash, i));
        let medium = Some(medium(tier).to_string());
        match batch.last_mut() {
            Some(KvEvent::Removed {
                block_hashes,
                medium: last,
            }) if *last == medium => block_hashes.extend(hashes),
            _ => batch.push(KvEvent::Removed {
                block_hashes: hashes.collect(),
                medium,
            }),
        }
    }

    /// The vLLM blocks `block` spans.
    fn vllm_blocks(&self, block: &BlockTokens) -> usize {
        block.tokens.len() / self.options.layout.block_size.max(1)
    }

    /// Numbers, buffers and (unless dropped) sends one payload.
    fn send(&self, state: &mut State, payload: Bytes) {
        let seq = state.next_seq;
        state.next_seq += 1;
        if state.lose_next > 0 {
            state.lose_next -= 1;
            return;
        }
        state.buffer.push_back((seq, payload.clone()));
        while state.buffer.len() > self.options.buffer_steps.max(1) {
            state.buffer.pop_front();
        }
        if state.drop_next > 0 {
            state.drop_next -= 1;
            return;
        }
        let due = Instant::now() + state.lag;
        let _ = self.outgoing.send((
            due,
            message(vec![
                Bytes::from(self.options.topic.clone().into_bytes()),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ]),
        ));
    }

    /// Leaves the next `batches` off the PUB socket (still replayable).
    pub fn drop_next(&self, batches: u64) {
        self.lock().drop_next += batches;
    }

    /// Loses the next `batches`: their numbers are taken, but they are
    /// neither buffered nor sent (a hole no replay fills).
    pub fn lose_next(&self, batches: u64) {
        self.lock().lose_next += batches;
    }

    /// Sends each later batch `lag` after buffering it: a subscription
    /// that lags, whose batches a replay probe finds first.
    pub fn lag(&self, lag: Duration) {
        self.lock().lag = lag;
    }

    /// Sends garbage: a one-part message, a short seq frame, and a batch
    /// that is not msgpack (numbered and buffered like a real one).
    pub fn send_garbage(&self) {
        let topic = Bytes::from(self.options.topic.clone().into_bytes());
        let mut state = self.lock();
        let due = Instant::now() + state.lag;
        let _ = self
            .outgoing
            .send((due, message(vec![Bytes::from_static(b"garbage")])));
        let _ = self.outgoing.send((
            due,
            message(vec![
                topic,
                Bytes::from_static(b"\x01\x02"),
                Bytes::from_static(b"\x92"),
            ]),
        ));
        self.send(&mut state, Bytes::from_static(b"\xc1 not msgpack"));
    }

    /// Batches published so far (the next seq).
    pub fn next_seq(&self) -> i64 {
        self.lock().next_seq
    }
}
