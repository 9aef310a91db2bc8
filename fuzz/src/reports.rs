//! Target `reports`: pod answers folded into [`ClusterState`] and published,
//! in sequences, as the report service does tick after tick.
//!
//! The input is a list of steps separated by NUL bytes (which neither a JSON
//! report nor a metrics page contains); each step is an opcode byte and its
//! arguments. `pod` is a byte: `pod % (PODS + 1)` picks the pod (the last
//! value is an id the cluster does not know), `pod / (PODS + 1)` is its
//! in-flight count.
//!
//! | step | effect |
//! |---|---|
//! | `R` pod body | a report answer: `accept_pull` (HTTP 200), then `fold_step` until folded |
//! | `S` pod flags seq since segments | a report built from bytes (below), answered the same way |
//! | `M` pod text | a `/metrics` answer, the same way |
//! | `H` pod kind status body | any answer as the host hands it to the service: `kind` even a report, odd metrics; `status % 5`: no response, 200, Envoy's 503, 404, or 200 claiming 1000× its size |
//! | `D` pod j n [t] | a routing decision (pending in precise mode): `record_decision` of the first `n % 16 + 1` blocks of the `j`-th chain of generated reports, predicted to be prefilled `t` × 250 ms later (0 without `t`) |
//! | `B` pod k | a generated full report of `k · 16` blocks in chains of 16, up to 4080 blocks (~80 KB) and 4096 per input: reports far beyond the index bound (1024 blocks) without large seeds |
//! | `T` k | the clock advances `k · 250` ms |
//! | `P` | publish, then check |
//!
//! `S` reaches the folding rules that a byte-mutated JSON body rarely does
//! (deltas that continue, chains under held or foreign parents, removals):
//! `flags`, `seq` and `since` count from `'0'` (so `S0110-abc` is a full
//! report of pod 0, seq 1, since 0); `flags` bit 0 is `full`, bit 1 picks
//! epoch `e2` over `e1`, the rest is the queue depth; `segments`, separated by commas, are each a parent byte
//! (`-`: none) then the chain's hash bytes, or `~` then removed hash bytes.
//! Hash byte `b` is block `b` of the same universe as `B`'s blocks, so
//! reports share, extend and contradict each other's chains.
//!
//! Other opcodes are ignored; the input ends with a publication and check.
//! A new kind of pod answer is one more [`Step`] variant: its opcode in
//! [`Step::parse`], its effect in [`Harness::apply`].
//!
//! Pod answers take the service's path (`accept_pull`, then `fold_step`s
//! of [`FOLD_STEP`] blocks until the inbox is empty, with a publication and
//! check every [`PUBLISH_EVERY_STEPS`] steps). After every publication the shared-data view
//! must equal the index: each hash the reports named has, in its published
//! bucket, the union of its reported and pending holders; holders are
//! prefix-closed, the bisection lookup over the path to
//! each stored chain's last block equals the tree's lookup, and the pod table
//! survives the filter's decoding with health and load in [0, 1].

use kvroute::cluster::{ClusterState, PullAnswer, PullKind};
use kvroute::config::{Config, MAX_PODS};
use kvroute::index::{Merged, PrefixTree};
use kvroute::report::parse_report;
use kvroute::snapshot::{bucket_lookup, bucket_of, PodTable};

use crate::{fixture_config, pod_id, Report, SharedData, PODS};

const START_MS: u64 = 1_000_000;
/// Hashes remembered for the mask checks, per report and in all (every
/// publication checks them all: the bounds keep each run fast).
const CHECKED_PER_REPORT: usize = 256;
const MAX_CHECKED: usize = 4096;
/// Stored chains whose whole path is looked up, per report and in all.
const PATHS_PER_REPORT: usize = 8;
const MAX_PATHS: usize = 64;
/// Blocks per fold step (the service's are larger): chains split often.
const FOLD_STEP: usize = 7;
/// A publication and check after this many steps of one answer.
const PUBLISH_EVERY_STEPS: u32 = 16;
/// A small index, so that reports overflow it and eviction runs.
const CONFIG: &str = r#", "maxPrefixBlocks": 64, "maxIndexBlocks": 1024"#;
/// Blocks per chain of generated reports and per `B` step's `k`, and blocks
/// of generated reports per input (slow inputs slow the whole run).
const GENERATED_CHAIN: usize = 16;
const GENERATED_UNIT: usize = 16;
const GENERATED_BLOCKS: usize = 4096;

/// One step of the input (see the module documentation).
enum Step<'a> {
    Report {
        pod: Pod,
        body: &'a [u8],
    },
    Generated {
        pod: Pod,
        blocks: usize,
    },
    Built {
        pod: Pod,
        flags: u8,
        seq: u8,
        since: u8,
        segments: &'a [u8],
    },
    Metrics {
        pod: Pod,
        text: &'a [u8],
    },
    Answer {
        pod: Pod,
        kind: PullKind,
        status: u8,
        body: &'a [u8],
    },
    Decision {
        pod: Pod,
        first: usize,
        blocks: usize,
        predicted_ttft_ms: u32,
    },
    Tick(u64),
    Publish,
}

struct Pod {
    id: String,
    inflight: u32,
}

impl Pod {
    fn from_byte(byte: u8) -> Pod {
        let choices = PODS as u8 + 1;
        Pod {
            id: pod_id(usize::from(byte % choices)),
            inflight: u32::from(byte / choices),
        }
    }
}

impl<'a> Step<'a> {
    fn parse(step: &'a [u8]) -> Option<Step<'a>> {
        let (&op, args) = step.split_first()?;
        Some(match op {
            b'R' => {
                let (&pod, body) = args.split_first()?;
                Step::Report {
                    pod: Pod::from_byte(pod),
                    body,
                }
            }
            b'M' => {
                let (&pod, text) = args.split_first()?;
                Step::Metrics {
                    pod: Pod::from_byte(pod),
                    text,
                }
            }
            b'B' => {
                let &[pod, k, ..] = args else {
                    return None;
                };
                Step::Generated {
                    pod: Pod::from_byte(pod),
                    blocks: usize::from(k) * GENERATED_UNIT,
                }
            }
            b'S' => {
                let &[pod, flags, seq, since, ref segments @ ..] = args else {
                    return None;
                };
                // Counted from '0': readable seeds, and no NUL separator.
                let digit = |b: u8| b.wrapping_sub(b'0');
                Step::Built {
                    pod: Pod::from_byte(pod),
                    flags: digit(flags),
                    seq: digit(seq),
                    since: digit(since),
                    segments,
                }
            }
            b'H' => {
                let &[pod, kind, status, ref body @ ..] = args else {
                    return None;
                };
                Step::Answer {
                    pod: Pod::from_byte(pod),
                    kind: if kind % 2 == 0 {
                        PullKind::Report
                    } else {
                        PullKind::Metrics
                    },
                    status: status % 5,
                    body,
                }
            }
            b'D' => {
                let &[pod, chain, length, ref ttft @ ..] = args else {
                    return None;
                };
                Step::Decision {
                    pod: Pod::from_byte(pod),
                    first: usize::from(chain) * GENERATED_CHAIN,
                    blocks: usize::from(length) % GENERATED_CHAIN + 1,
                    predicted_ttft_ms: ttft.first().map_or(0, |&t| u32::from(t) * 250),
                }
            }
            b'T' => Step::Tick(u64::from(*args.first()?) * 250),
            b'P' => Step::Publish,
            _ => return None,
        })
    }
}

/// Block `i` of the hash universe of `B` and `S` steps.
fn block(i: usize) -> u64 {
    (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// A full report of `blocks` blocks in chains of [`GENERATED_CHAIN`].
fn generated_report(pod: &str, blocks: usize) -> Vec<u8> {
    let hashes: Vec<u64> = (0..blocks).map(block).collect();
    let chains: Vec<&[u64]> = hashes.chunks(GENERATED_CHAIN).collect();
    Report::full(pod, &chains, 0).encode()
}

/// The report of an `S` step (see the module documentation).
fn built_report(pod: &str, flags: u8, seq: u8, since: u8, segments: &[u8]) -> Vec<u8> {
    let mut removed = Vec::new();
    let chains: Vec<(Option<u64>, Vec<u64>)> = segments
        .split(|&b| b == b',')
        .filter_map(|segment| {
            let (&head, bytes) = segment.split_first()?;
            let hashes = bytes.iter().map(|&b| block(usize::from(b))).collect();
            match head {
                b'~' => {
                    removed = hashes;
                    None
                }
                b'-' => Some((None, hashes)),
                parent => Some((Some(block(usize::from(parent))), hashes)),
            }
        })
        .collect();
    Report {
        pod,
        epoch: if flags & 2 == 0 { "e1" } else { "e2" },
        seq: u64::from(seq),
        since: u64::from(since),
        full: flags & 1 == 1,
        stored: chains.iter().map(|(p, h)| (*p, h.as_slice())).collect(),
        removed,
        queue: u32::from(flags >> 2),
    }
    .encode()
}

struct Harness {
    config: Config,
    state: ClusterState,
    shared: SharedData,
    now_ms: u64,
    /// Hashes named by the reports, for the mask checks.
    named: Vec<u64>,
    /// Last blocks of stored chains, for the path lookups.
    tails: Vec<u64>,
    /// Blocks that `B` steps may still generate.
    generated_budget: usize,
}

impl Harness {
    fn new() -> Harness {
        let config = fixture_config(CONFIG);
        Harness {
            state: ClusterState::new(&config, START_MS),
            config,
            shared: SharedData::default(),
            now_ms: START_MS,
            named: Vec::new(),
            tails: Vec::new(),
            generated_budget: GENERATED_BLOCKS,
        }
    }

    fn apply(&mut self, step: Step<'_>) {
        match step {
            Step::Report { pod, body } => self.report(&pod, body),
            Step::Generated { pod, blocks } => {
                let blocks = blocks.min(self.generated_budget);
                self.generated_budget -= blocks;
                self.report(&pod, &generated_report(&pod.id, blocks));
            }
            Step::Built {
                pod,
                flags,
                seq,
                since,
                segments,
            } => self.report(&pod, &built_report(&pod.id, flags, seq, since, segments)),
            Step::Metrics { pod, text } => self.answer(&pod, PullKind::Metrics, Some("200"), text),
            Step::Answer {
                pod,
                kind,
                status,
                body,
            } => {
                self.remember(body);
                let (code, size) = match status {
                    0 => (None, body.len()),
                    1 => (Some("200"), body.len()),
                    2 => (Some("503"), body.len()),
                    3 => (Some("404"), body.len()),
                    _ => (Some("200"), body.len().saturating_mul(1000)),
                };
                self.answer_claiming(&pod, kind, code, size, body)
            }
            Step::Decision {
                pod,
                first,
                blocks,
                predicted_ttft_ms,
            } => {
                let chain: Vec<u64> = (first..first + blocks).map(block).collect();
                self.named.extend(
                    chain
                        .iter()
                        .take(MAX_CHECKED.saturating_sub(self.named.len())),
                );
                if let Some(slot) = self.state.slot(&pod.id) {
                    self.state
                        .record_decision(slot, &chain, self.now_ms, predicted_ttft_ms);
                }
            }
            Step::Tick(ms) => self.now_ms += ms,
            Step::Publish => self.publish_and_check(),
        }
    }

    fn report(&mut self, pod: &Pod, body: &[u8]) {
        self.remember(body);
        self.answer(pod, PullKind::Report, Some("200"), body);
    }

    /// An answer as the service takes it: classified, queued, folded.
    fn answer(&mut self, pod: &Pod, kind: PullKind, status: Option<&str>, body: &[u8]) {
        self.answer_claiming(pod, kind, status, body.len(), body);
    }

    fn answer_claiming(
        &mut self,
        pod: &Pod,
        kind: PullKind,
        status: Option<&str>,
        body_size: usize,
        body: &[u8],
    ) {
        let answer = PullAnswer { status, body_size };
        // The host hands over at most what it has.
        let read = |n: usize| body.get(..n.min(body.len())).unwrap_or_default().to_vec();
        let _ = self
            .state
            .accept_pull(&pod.id, kind, answer, read, pod.inflight);
        // Small steps, published part-way now and then: the shared view
        // must equal the index between any two steps.
        let mut steps = 0u32;
        while self.state.fold_step(self.now_ms, FOLD_STEP).is_some() {
            steps += 1;
            if steps.is_multiple_of(PUBLISH_EVERY_STEPS) {
                self.publish_and_check();
            }
        }
        assert_eq!(self.state.unfolded(), 0);
    }

    fn remember(&mut self, body: &[u8]) {
        let Ok(report) = parse_report(body) else {
            return;
        };
        let room = MAX_CHECKED.saturating_sub(self.named.len());
        let named = report
            .stored
            .iter()
            .flat_map(|chain| chain.parent.iter().chain(&chain.hashes))
            .chain(&report.removed)
            .take(room.min(CHECKED_PER_REPORT));
        self.named.extend(named);
        let room = MAX_PATHS.saturating_sub(self.tails.len());
        let tails = report.stored.iter().filter_map(|c| c.hashes.last());
        self.tails.extend(tails.take(room.min(PATHS_PER_REPORT)));
    }

    fn publish_and_check(&mut self) {
        let previous = self.shared.table.generation;
        self.shared.write(self.state.publish(self.now_ms));
        let table = &self.shared.table;
        assert!(table.generation > previous, "generation did not advance");
        assert_eq!(table.buckets, self.config.snapshot_buckets());
        check_pods(table);
        let tree = self.state.index();
        let pending = self.state.pending();
        for &hash in &self.named {
            let published: Vec<usize> = self
                .shared
                .bucket(bucket_of(hash, table.buckets))
                .and_then(|bytes| bucket_lookup(bytes, hash))
                .unwrap_or_default()
                .iter()
                .map(|h| h.slot())
                .collect();
            let reported = tree.pods(hash);
            let mut expected = reported.clone();
            expected.extend(pending.map(|p| p.pods(hash)).unwrap_or_default());
            expected.sort_unstable();
            expected.dedup();
            assert_eq!(
                published, expected,
                "block {hash:016x}: published holders differ"
            );
            if let Some(parent) = tree.parent(hash) {
                let parents = tree.pods(parent);
                assert!(
                    reported.iter().all(|pod| parents.contains(pod)),
                    "block {hash:016x}: holders not prefix-closed"
                );
            }
        }
        // Reported and pending holders are both prefix-closed, so the union's
        // match is the longer of the two — where the two trees agree on the
        // path (real chained hashes always do; `S` steps may contradict the
        // decisions' chains).
        let empty = PrefixTree::new(1);
        let pending = pending.unwrap_or(&empty);
        let index = Merged(tree, pending);
        for &tail in &self.tails {
            let path = path_to(tree, tail);
            let agree = path
                .iter()
                .all(|&h| pending.holders(h).is_none() || pending.parent(h) == tree.parent(h));
            if agree {
                self.shared.assert_lookup_matches(&index, &path);
            }
        }
    }
}

/// The pod table the filters decode: every configured pod once, in a valid
/// slot, with health and load in [0, 1].
fn check_pods(table: &PodTable) {
    let mut ids: Vec<&str> = table.pods.iter().map(|p| p.id.as_str()).collect();
    ids.sort_unstable();
    let expected: Vec<String> = (0..PODS).map(pod_id).collect();
    assert_eq!(ids, expected, "published pods");
    let mut slots = std::collections::HashSet::new();
    for pod in &table.pods {
        assert!(
            pod.slot < MAX_PODS && slots.insert(pod.slot),
            "slot {}",
            pod.slot
        );
        assert!(
            (0.0..=1.0).contains(&pod.health),
            "{} health {}",
            pod.id,
            pod.health
        );
        assert!(
            (0.0..=1.0).contains(&pod.load),
            "{} load {}",
            pod.id,
            pod.load
        );
    }
    assert_eq!(
        PodTable::decode(&table.encode()).as_ref(),
        Ok(table),
        "the pod table does not survive encoding"
    );
}

/// The chain from the root to `hash` (a path of the tree).
fn path_to(tree: &PrefixTree, hash: u64) -> Vec<u64> {
    let mut path = vec![hash];
    while let Some(parent) = tree.parent(*path.last().expect("non-empty")) {
        path.push(parent);
        assert!(path.len() <= tree.len(), "cycle in the tree's parent links");
    }
    path.reverse();
    path
}

pub fn run(data: &[u8]) {
    let mut harness = Harness::new();
    for step in data.split(|&b| b == 0).filter_map(Step::parse) {
        harness.apply(step);
    }
    harness.publish_and_check();
}
