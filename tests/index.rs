//! The prefix index against a naive model, the published snapshot against
//! the tree, the memory bound under a flood, the approximate-mode recorder's
//! per-pod bound, and `ClusterState`'s report folding and staleness.

use std::collections::{BTreeSet, HashMap};

use kvroute::cluster::{ClusterState, Failure, FoldStep, Folded, PullAnswer, PullKind, Transition};
use kvroute::config::{Config, PodConfig};
use kvroute::index::{
    DecisionRecorder, Holder, InsertOutcome, PrefixLookup, PrefixMatch, PrefixTree,
};
use kvroute::report::hash_to_hex;
use kvroute::snapshot::{SlotLoad, SnapshotIndex, SnapshotPublisher};
use proptest::prelude::*;

/// Hashes of the model universe are 1..=UNIVERSE.
const UNIVERSE: u64 = 40;

/// Pod slots the model exercises (1023 checks the top slot; 0-2, 63 and
/// 64 sets inline and past the inline four).
const PODS: [usize; 6] = [0, 1, 2, 63, 64, 1023];

/// A forest over hashes 1..=40: `parent[h]` is `None` for a root or a smaller
/// hash, so every hash has exactly one chain from its root (as chained
/// hashing guarantees for real block hashes).
#[derive(Debug, Clone)]
struct Universe {
    parent: Vec<Option<u64>>, // indexed by hash; [0] unused
}

impl Universe {
    fn from_seeds(seeds: &[u32]) -> Universe {
        let mut parent = vec![None; UNIVERSE as usize + 1];
        for h in 2..=UNIVERSE {
            let r = seeds[h as usize - 2];
            // About one hash in eight starts a new tree.
            parent[h as usize] = if r.is_multiple_of(8) {
                None
            } else {
                Some(1 + u64::from(r) % (h - 1))
            };
        }
        Universe { parent }
    }

    /// The chain from `h`'s root down to `h`.
    fn path(&self, h: u64) -> Vec<u64> {
        let mut path = vec![h];
        let mut at = h;
        while let Some(p) = self.parent[at as usize] {
            path.push(p);
            at = p;
        }
        path.reverse();
        path
    }

    fn is_descendant_or_self(&self, mut h: u64, ancestor: u64) -> bool {
        loop {
            if h == ancestor {
                return true;
            }
            match self.parent[h as usize] {
                Some(p) => h = p,
                None => return false,
            }
        }
    }
}

/// The naive model: per pod, the set of hashes it holds.
#[derive(Debug, Default, Clone)]
struct Model {
    held: HashMap<usize, BTreeSet<u64>>,
}

impl Model {
    fn holds(&self, pod: usize, h: u64) -> bool {
        self.held.get(&pod).is_some_and(|s| s.contains(&h))
    }

    fn insert(&mut self, pod: usize, parent: Option<u64>, hashes: &[u64]) -> InsertOutcome {
        if let Some(p) = parent {
            if !self.holds(pod, p) {
                return InsertOutcome {
                    stored: 0,
                    orphaned: hashes.len(),
                };
            }
        }
        self.held
            .entry(pod)
            .or_default()
            .extend(hashes.iter().copied());
        InsertOutcome {
            stored: hashes.len(),
            orphaned: 0,
        }
    }

    fn remove(&mut self, universe: &Universe, pod: usize, hashes: &[u64]) {
        if let Some(set) = self.held.get_mut(&pod) {
            for &h in hashes {
                set.retain(|&x| !universe.is_descendant_or_self(x, h));
            }
        }
    }

    fn drop_pod(&mut self, pod: usize) {
        self.held.remove(&pod);
    }

    /// The pods holding `h`, in slot order.
    fn pods(&self, h: u64) -> Vec<usize> {
        PODS.iter().copied().filter(|&p| self.holds(p, h)).collect()
    }

    fn len(&self) -> usize {
        self.held.values().flatten().collect::<BTreeSet<_>>().len()
    }

    /// Per pod: leading hashes of `chain` it holds consecutively.
    fn lookup(&self, chain: &[u64]) -> PrefixMatch {
        let mut m = PrefixMatch::default();
        for &pod in &PODS {
            let n = chain.iter().take_while(|&&h| self.holds(pod, h)).count();
            m.raise(pod, n as u32);
        }
        m
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Pod stores the path to `node` from depth `from` on (parent = the
    /// block before), cut `cut` blocks short of `node`.
    Insert {
        pod: usize,
        node: u64,
        from: usize,
        cut: usize,
    },
    Remove {
        pod: usize,
        hashes: Vec<u64>,
    },
    Drop {
        pod: usize,
    },
    /// A lookup of the path to `node`, with `tail` appended.
    Lookup {
        node: u64,
        tail: Vec<u64>,
    },
    /// Publish the change log into the snapshot (snapshot tests only).
    Publish,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let pod = prop::sample::select(PODS.to_vec());
    let hash = 1..=UNIVERSE;
    prop_oneof![
        6 => (pod.clone(), hash.clone(), 0usize..6, 0usize..3)
            .prop_map(|(pod, node, from, cut)| Op::Insert { pod, node, from, cut }),
        2 => (pod.clone(), prop::collection::vec(hash.clone(), 1..3))
            .prop_map(|(pod, hashes)| Op::Remove { pod, hashes }),
        1 => pod.prop_map(|pod| Op::Drop { pod }),
        2 => (hash.clone(), prop::collection::vec(hash, 0..3)).prop_map(|(node, tail)| Op::Lookup { node, tail }),
        1 => Just(Op::Publish),
    ]
}

fn universe_strategy() -> impl Strategy<Value = Universe> {
    prop::collection::vec(any::<u32>(), UNIVERSE as usize - 1)
        .prop_map(|s| Universe::from_seeds(&s))
}

/// The (parent, hashes) an insert op stands for.
fn insert_args(universe: &Universe, node: u64, from: usize, cut: usize) -> (Option<u64>, Vec<u64>) {
    let path = universe.path(node);
    let from = from.min(path.len() - 1);
    let end = path.len().saturating_sub(cut).max(from);
    let parent = if from == 0 {
        None
    } else {
        Some(path[from - 1])
    };
    (parent, path[from..end].to_vec())
}

fn assert_tree_matches_model(
    tree: &PrefixTree,
    model: &Model,
    universe: &Universe,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(tree.len(), model.len());
    for h in 1..=UNIVERSE {
        let expected = model.pods(h);
        prop_assert_eq!(tree.pods(h), expected.clone(), "holders of {}", h);
        prop_assert_eq!(
            tree.holders(h).is_some(),
            !expected.is_empty(),
            "{} indexed",
            h
        );
        if !expected.is_empty() {
            prop_assert_eq!(
                tree.parent(h),
                universe.parent[h as usize],
                "parent of {}",
                h
            );
        }
        let path = universe.path(h);
        prop_assert_eq!(
            tree.lookup(&path),
            model.lookup(&path),
            "lookup of path to {}",
            h
        );
    }
    for &pod in &PODS {
        let held = model.held.get(&pod).map_or(0, BTreeSet::len);
        prop_assert_eq!(tree.pod_block_count(pod), held, "blocks of pod {}", pod);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        // No regression files: the tests also run as wasm.
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Random insert/remove/drop/lookup sequences on a tree agree with the
    /// model after every step (no eviction: the bound is far away).
    #[test]
    fn tree_agrees_with_the_naive_model(
        universe in universe_strategy(),
        ops in prop::collection::vec(op_strategy(), 1..60),
    ) {
        let mut tree = PrefixTree::new(1_000);
        let mut model = Model::default();
        for op in &ops {
            match op {
                &Op::Insert { pod, node, from, cut } => {
                    let (parent, hashes) = insert_args(&universe, node, from, cut);
                    let got = tree.insert_chain(pod, parent, &hashes);
                    let want = model.insert(pod, parent, &hashes);
                    prop_assert_eq!(got, want, "{:?} → parent {:?} hashes {:?}", op, parent, hashes);
                }
                Op::Remove { pod, hashes } => {
                    tree.remove_blocks(*pod, hashes);
                    model.remove(&universe, *pod, hashes);
                }
                &Op::Drop { pod } => {
                    tree.drop_pod(pod);
                    model.drop_pod(pod);
                }
                Op::Lookup { node, tail } => {
                    let mut chain = universe.path(*node);
                    chain.extend(tail);
                    prop_assert_eq!(tree.lookup(&chain), model.lookup(&chain), "lookup {:?}", chain);
                }
                Op::Publish => {}
            }
            assert_tree_matches_model(&tree, &model, &universe)?;
        }
        prop_assert_eq!(tree.evictions(), 0);
        // Arbitrary hash sequences (not paths) count leading held hashes too.
        for start in 1..=UNIVERSE {
            let chain: Vec<u64> = (0..5).map(|k| 1 + (start + 7 * k) % UNIVERSE).collect();
            prop_assert_eq!(tree.lookup(&chain), model.lookup(&chain));
        }
    }

    /// The snapshot published from the tree's change log answers every lookup
    /// like the tree, whenever it was last published.
    #[test]
    fn snapshot_agrees_with_the_tree(
        universe in universe_strategy(),
        ops in prop::collection::vec(op_strategy(), 1..60),
        bucket_bits in 0u32..5,
    ) {
        let buckets = 1u32 << bucket_bits;
        let mut tree = PrefixTree::with_change_log(1_000);
        let mut publisher = SnapshotPublisher::new(buckets);
        let mut store: HashMap<u32, Vec<u8>> = HashMap::new();
        let mut published = PrefixTree::new(1_000); // the tree as of the last publish
        let mut publish = |tree: &mut PrefixTree, published: &mut PrefixTree, store: &mut HashMap<u32, Vec<u8>>| {
            publisher.apply_tree(tree);
            for (bucket, bytes) in publisher.take_dirty(usize::MAX) {
                store.insert(bucket, bytes);
            }
            *published = strip_log(tree);
        };
        for op in &ops {
            match op {
                &Op::Insert { pod, node, from, cut } => {
                    let (parent, hashes) = insert_args(&universe, node, from, cut);
                    tree.insert_chain(pod, parent, &hashes);
                }
                Op::Remove { pod, hashes } => tree.remove_blocks(*pod, hashes),
                &Op::Drop { pod } => tree.drop_pod(pod),
                Op::Lookup { node, tail } => {
                    // Bisection needs a real chain (each block the child of
                    // the previous one): extend the path only with hashes
                    // outside the universe, i.e. blocks never stored.
                    let mut chain = universe.path(*node);
                    chain.extend(tail.iter().map(|h| h + 1_000));
                    let snapshot = SnapshotIndex { buckets, fetch: |b| store.get(&b).cloned() };
                    prop_assert_eq!(snapshot.lookup(&chain), published.lookup(&chain), "stale snapshot {:?}", chain);
                }
                Op::Publish => publish(&mut tree, &mut published, &mut store),
            }
        }
        publish(&mut tree, &mut published, &mut store);
        let snapshot = SnapshotIndex { buckets, fetch: |b| store.get(&b).cloned() };
        for h in 1..=UNIVERSE {
            let path = universe.path(h);
            prop_assert_eq!(snapshot.lookup(&path), tree.lookup(&path), "path to {}", h);
            let mut longer = path.clone();
            longer.push(1_000 + h);
            prop_assert_eq!(snapshot.lookup(&longer), tree.lookup(&longer));
            for p in 0..path.len() {
                prop_assert_eq!(snapshot.lookup(&path[..p]), tree.lookup(&path[..p]));
            }
        }
        prop_assert!(publisher.take_dirty(usize::MAX).is_empty());
    }
}

/// A copy of `tree` for comparing against later (the change log is not
/// part of the answer).
fn strip_log(tree: &PrefixTree) -> PrefixTree {
    let mut copy = tree.clone();
    copy.take_changes();
    copy
}

#[test]
fn snapshot_buckets_absent_from_the_store_read_as_empty() {
    let mut tree = PrefixTree::with_change_log(100);
    tree.insert_chain(5, None, &[11, 12, 13]);
    let mut publisher = SnapshotPublisher::new(4);
    publisher.apply_tree(&mut tree);
    let store: HashMap<u32, Vec<u8>> = publisher.take_dirty(usize::MAX).into_iter().collect();
    let snapshot = SnapshotIndex {
        buckets: 4,
        fetch: |b| store.get(&b).cloned(),
    };
    assert_eq!(snapshot.lookup(&[11, 12, 13]).blocks(5), 3);
    let empty = SnapshotIndex {
        buckets: 4,
        fetch: |_| None::<Vec<u8>>,
    };
    assert_eq!(empty.lookup(&[11, 12, 13]), PrefixMatch::default());
}

/// splitmix64: a deterministic stream of well-mixed u64s.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Bytes per indexed block the bound allows: 40-byte nodes in a doubling
/// `Vec` plus a 4-byte-slot hash table with control bytes measure ≈ 59 B per
/// block at 50 000 blocks; 64 B × 1.25 slack is the asserted ceiling.
const BOUND_BYTES_PER_BLOCK: f64 = 64.0 * 1.25;

#[test]
fn memory_stays_bounded_under_a_flood_of_unique_prefixes() {
    // Holder sets are sparse: the bound is the same at 64 and 1,024 pods.
    for pods in [64, 1024] {
        flood(pods);
    }
}

fn flood(pods: u64) {
    const MAX: usize = 50_000;
    const CHAINS: usize = 200_000;
    let mut tree = PrefixTree::new(MAX);
    let mut rng = Rng(0x5eed);
    let mut recent: Vec<(usize, Vec<u64>)> = Vec::new();
    let mut peak_bytes = 0;
    for i in 0..CHAINS {
        let len = 1 + rng.below(8) as usize;
        let chain: Vec<u64> = (0..len).map(|_| rng.next()).collect();
        let pod = rng.below(pods) as usize;
        let outcome = tree.insert_chain(pod, None, &chain);
        assert_eq!(
            outcome,
            InsertOutcome {
                stored: len,
                orphaned: 0
            },
            "chain {i}"
        );
        assert!(tree.len() <= MAX, "len {} after chain {i}", tree.len());
        if i % 1000 == 0 {
            peak_bytes = peak_bytes.max(tree.memory_bytes());
        }
        if i >= CHAINS - 1000 {
            recent.push((pod, chain));
        }
    }
    peak_bytes = peak_bytes.max(tree.memory_bytes());
    let bound = (BOUND_BYTES_PER_BLOCK * MAX as f64) as usize;
    assert!(
        peak_bytes <= bound,
        "{pods} pods: memory {peak_bytes} B > {bound} B (= 64 B × 1.25 × {MAX} blocks); {:.1} B/block",
        peak_bytes as f64 / MAX as f64
    );
    assert!(
        tree.len() > MAX * 9 / 10,
        "the index stays nearly full: {}",
        tree.len()
    );
    assert!(tree.evictions() > 0);
    assert!(
        tree.evictions() as usize >= CHAINS * 4 - MAX,
        "evictions {}",
        tree.evictions()
    );
    // Recency: the last 1000 chains (≈ 4 500 blocks) are still fully indexed.
    for (pod, chain) in &recent {
        assert_eq!(tree.lookup(chain).blocks(*pod) as usize, chain.len());
    }
}

#[test]
fn eviction_keeps_shared_prefixes_of_recent_conversations() {
    // 8 system prompts of 4 blocks; 50 000 conversations of 4 blocks under
    // them into a 5 000-block index: the system prompts, interior nodes with
    // live children, survive, and recent conversations are fully matched.
    let mut tree = PrefixTree::new(5_000);
    let mut rng = Rng(7);
    let systems: Vec<Vec<u64>> = (0..8)
        .map(|_| (0..4).map(|_| rng.next()).collect())
        .collect();
    for s in &systems {
        tree.insert_chain(0, None, s);
    }
    let mut last = Vec::new();
    for _ in 0..50_000 {
        let s = &systems[rng.below(8) as usize];
        let conversation: Vec<u64> = (0..4).map(|_| rng.next()).collect();
        tree.insert_chain(0, None, s);
        let outcome = tree.insert_chain(0, Some(s[3]), &conversation);
        assert_eq!(outcome.stored, 4);
        last.push([s.clone(), conversation].concat());
        if last.len() > 100 {
            last.remove(0);
        }
        assert!(tree.len() <= 5_000);
    }
    for s in &systems {
        assert_eq!(tree.lookup(s).blocks(0), 4, "system prompt evicted");
    }
    for chain in &last {
        assert_eq!(tree.lookup(chain).blocks(0), 8);
    }
}

#[test]
fn decision_recorder_keeps_each_pod_within_its_capacity() {
    const CAPACITY: usize = 300;
    let mut recorder = DecisionRecorder::new(PrefixTree::new(100_000), CAPACITY);
    let mut rng = Rng(42);
    let system: Vec<Vec<u64>> = (0..4)
        .map(|_| (0..8).map(|_| rng.next()).collect())
        .collect();
    for i in 0..20_000 {
        let pod = rng.below(6) as usize;
        let mut chain = system[pod % 4].clone();
        let tail = rng.below(40) as usize;
        chain.extend((0..tail).map(|_| rng.next()));
        recorder.record(pod, &chain);
        if i % 97 == 0 {
            for p in 0..6 {
                let held = recorder.tree().pod_block_count(p);
                assert!(
                    held <= CAPACITY,
                    "pod {p} holds {held} > {CAPACITY} after {i} decisions"
                );
            }
        }
        assert_eq!(
            recorder.lookup(&chain).blocks(pod) as usize,
            chain.len().min(CAPACITY)
        );
    }
    for p in 0..6 {
        let held = recorder.tree().pod_block_count(p);
        assert!(held <= CAPACITY && held > CAPACITY / 2, "pod {p}: {held}");
        // The shared system prompt, touched on every decision, is never evicted.
        assert_eq!(recorder.lookup(&system[p % 4]).blocks(p), 8);
    }
    // Six pods × 300 blocks at most, plus nothing leaked in the tree.
    assert!(recorder.tree().len() <= 6 * CAPACITY);
    // A prompt longer than the capacity keeps its first CAPACITY blocks.
    let huge: Vec<u64> = (0..1_000).map(|_| rng.next()).collect();
    recorder.record(9, &huge);
    assert_eq!(recorder.lookup(&huge).blocks(9) as usize, CAPACITY);
    assert_eq!(recorder.tree().pod_block_count(9), CAPACITY);
    recorder.drop_pod(9);
    assert_eq!(recorder.tree().pod_block_count(9), 0);
}

// ---------------------------------------------------------------- cluster

fn cluster_config() -> Config {
    Config::parse(
        br#"{"pods": [{"id": "a", "address": "127.0.0.1:9001"},
                      {"id": "b", "address": "127.0.0.1:9002"}],
             "maxIndexBlocks": 4096}"#,
    )
    .expect("valid config")
}

/// Folds the oldest accepted answer to its end, as the service does over
/// its steps.
fn fold_next(cluster: &mut ClusterState, now_ms: u64) -> Option<Folded> {
    loop {
        if let FoldStep::Done(folded) = cluster.fold_step(now_ms, 64)? {
            return Some(folded);
        }
    }
}

fn answer(status: Option<&str>, body_size: usize) -> PullAnswer<'_> {
    PullAnswer { status, body_size }
}

fn hexes(hashes: &[u64]) -> String {
    hashes
        .iter()
        .map(|h| format!("\"{}\"", hash_to_hex(*h)))
        .collect::<Vec<_>>()
        .join(",")
}

#[allow(clippy::too_many_arguments)]
fn report(
    pod: &str,
    epoch: &str,
    seq: u64,
    since: u64,
    full: bool,
    stored: &[(Option<u64>, &[u64])],
    removed: &[u64],
    health: f64,
) -> Vec<u8> {
    let stored: Vec<String> = stored
        .iter()
        .map(|(parent, hashes)| {
            let parent = parent.map_or("null".to_string(), |p| format!("\"{}\"", hash_to_hex(p)));
            format!(r#"{{"parent":{parent},"hashes":[{}]}}"#, hexes(hashes))
        })
        .collect();
    format!(
        r#"{{"version":1,"podId":"{pod}","epoch":"{epoch}","seq":{seq},"since":{since},"full":{full},
            "stored":[{}],"removed":[{}],"queueDepth":3,"gpuUtilization":0.25,"health":{health},
            "adapters":["billing-lora"]}}"#,
        stored.join(","),
        hexes(removed)
    )
    .into_bytes()
}

/// A filter's view: shared-data buckets kept up to date from publications.
struct SharedData {
    buckets: u32,
    store: HashMap<u32, Vec<u8>>,
}

impl SharedData {
    fn publish(&mut self, cluster: &mut ClusterState, now_ms: u64) -> kvroute::snapshot::PodTable {
        let publication = cluster.publish(now_ms);
        self.buckets = publication.table.buckets;
        for (bucket, bytes) in publication.buckets {
            self.store.insert(bucket, bytes);
        }
        publication.table
    }

    fn lookup(&self, chain: &[u64]) -> PrefixMatch {
        SnapshotIndex {
            buckets: self.buckets,
            fetch: |b| self.store.get(&b).cloned(),
        }
        .lookup(chain)
    }
}

fn slot_of(table: &kvroute::snapshot::PodTable, id: &str) -> usize {
    table
        .pods
        .iter()
        .find(|p| p.id == id)
        .expect("pod published")
        .slot
}

#[test]
fn cluster_folds_full_reports_and_deltas_into_the_published_index() {
    let config = cluster_config();
    let mut cluster = ClusterState::new(&config, 0);
    let mut shared = SharedData {
        buckets: 0,
        store: HashMap::new(),
    };
    let chain: Vec<u64> = (1..=10u64)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect();
    assert_eq!(
        cluster.report_query("a", "/r").as_deref(),
        Some("/r?since=0")
    );

    // Full report: a holds the first 6 blocks, b the first 3.
    let body = report(
        "a",
        "e1",
        5,
        0,
        true,
        &[(None, &chain[..4]), (Some(chain[3]), &chain[4..6])],
        &[],
        1.0,
    );
    let (summary, transition) = cluster.apply_report("a", &body, 100, 0);
    let summary = summary.expect("report accepted");
    assert!(
        summary.full && summary.stored == 6 && summary.orphaned == 0 && !summary.resync,
        "{summary:?}"
    );
    assert_eq!(transition, None);
    let body = report("b", "eb", 1, 0, true, &[(None, &chain[..3])], &[], 1.0);
    cluster
        .apply_report("b", &body, 100, 0)
        .0
        .expect("report accepted");
    let table = shared.publish(&mut cluster, 100);
    let (a, b) = (slot_of(&table, "a"), slot_of(&table, "b"));
    assert_ne!(a, b);
    let m = shared.lookup(&chain);
    assert_eq!((m.blocks(a), m.blocks(b)), (6, 3));
    assert_eq!(m, cluster.index().lookup(&chain));
    let pa = table.pods.iter().find(|p| p.id == "a").unwrap();
    assert_eq!((pa.queue, pa.load, pa.health), (3, 0.25, 1.0));
    assert_eq!(pa.adapters, vec!["billing-lora".to_string()]);
    assert_eq!(
        cluster.report_query("a", "/r").as_deref(),
        Some("/r?since=5&epoch=e1")
    );

    // Delta continuing seq 5: store 7..8 under 6, then evict block 5 (index 4).
    let body = report(
        "a",
        "e1",
        7,
        5,
        false,
        &[(Some(chain[5]), &chain[6..8])],
        &[chain[4]],
        1.0,
    );
    let summary = cluster
        .apply_report("a", &body, 2100, 0)
        .0
        .expect("delta accepted");
    assert!(
        !summary.full && summary.stored == 2 && summary.removed == 1 && !summary.resync,
        "{summary:?}"
    );
    let table = shared.publish(&mut cluster, 2100);
    assert_eq!(
        shared.lookup(&chain).blocks(a),
        4,
        "removing block 4 cuts a's match to 4"
    );
    assert_eq!(shared.lookup(&chain).blocks(b), 3);
    assert_eq!(table.generation, 2);
    // A delta storing under a block a no longer holds is refused as orphans.
    let body = report(
        "a",
        "e1",
        8,
        7,
        false,
        &[(Some(chain[7]), &chain[8..9])],
        &[],
        1.0,
    );
    let summary = cluster.apply_report("a", &body, 2200, 0).0.unwrap();
    assert_eq!((summary.stored, summary.orphaned), (0, 1));
    shared.publish(&mut cluster, 2200);
    assert_eq!(shared.lookup(&chain).blocks(a), 4);

    // A delta that does not continue seq 8: resync, a's blocks dropped.
    let body = report(
        "a",
        "e1",
        12,
        10,
        false,
        &[(Some(chain[3]), &chain[4..5])],
        &[],
        1.0,
    );
    let summary = cluster
        .apply_report("a", &body, 2300, 0)
        .0
        .expect("answered");
    assert!(summary.resync, "{summary:?}");
    assert_eq!(
        cluster.report_query("a", "/r").as_deref(),
        Some("/r?since=0")
    );
    shared.publish(&mut cluster, 2300);
    assert_eq!(
        shared.lookup(&chain).blocks(a),
        0,
        "a's blocks dropped until its full resync"
    );
    assert_eq!(shared.lookup(&chain).blocks(b), 3, "b untouched");
    assert_eq!(cluster.index().pod_block_count(a), 0);

    // A new epoch (pod restarted) with a delta is also a resync.
    let body = report("b", "eb2", 2, 1, false, &[], &[], 1.0);
    assert!(cluster.apply_report("b", &body, 2400, 0).0.unwrap().resync);
    // The full resync restores a.
    let body = report("a", "e2", 1, 0, true, &[(None, &chain)], &[], 1.0);
    cluster.apply_report("a", &body, 2500, 0).0.unwrap();
    shared.publish(&mut cluster, 2500);
    let m = shared.lookup(&chain);
    assert_eq!((m.blocks(a), m.blocks(b)), (10, 0));

    // A full report replaces (does not add to) what a held.
    let body = report("a", "e2", 2, 0, true, &[(None, &chain[..2])], &[], 1.0);
    cluster.apply_report("a", &body, 2600, 0).0.unwrap();
    shared.publish(&mut cluster, 2600);
    assert_eq!(shared.lookup(&chain).blocks(a), 2);
    assert_eq!(cluster.index().len(), 2);
}

/// A pod's cache size and use: its report's, else vLLM's metrics page for
/// the size and the index's count for the use; a pod routed on decisions
/// is sized by `podCapacityBlocks`.
#[test]
fn a_pods_cache_size_and_use_come_from_its_report_else_what_the_router_knows() {
    let mut cluster = ClusterState::new(&cluster_config(), 0);
    let chain: Vec<u64> = (1..=6u64).map(|i| i * 0x1000_0001).collect();
    let sized = |body: Vec<u8>| {
        let text = String::from_utf8(body).expect("utf-8");
        text.replacen(
            "\"health\"",
            "\"kvCapacityBlocks\":1975,\"residentBlocks\":1210,\"health\"",
            1,
        )
        .into_bytes()
    };
    let body = sized(report("a", "e", 1, 0, true, &[(None, &chain)], &[], 1.0));
    cluster.apply_report("a", &body, 10, 0).0.expect("accepted");
    let body = report("b", "e", 1, 0, true, &[(None, &chain[..4])], &[], 1.0);
    cluster.apply_report("b", &body, 10, 0).0.expect("accepted");
    assert_eq!(cluster.kv_capacity_blocks("a"), Some(1975));
    assert_eq!(cluster.resident_blocks("a"), Some(1210));
    // b sends neither: unsized (no metrics page yet), its use the index's.
    assert_eq!(cluster.kv_capacity_blocks("b"), None);
    assert_eq!(cluster.resident_blocks("b"), Some(4));
    let page = b"vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"577\"} 1.0\n";
    cluster.apply_metrics("b", page, 20, 0).0.expect("accepted");
    cluster.apply_metrics("a", page, 20, 0).0.expect("accepted");
    assert_eq!(cluster.kv_capacity_blocks("b"), Some(577));
    assert_eq!(
        cluster.kv_capacity_blocks("a"),
        Some(1975),
        "the report's first"
    );
    // The room placements are priced on: only a pod that reports its use
    // has it (b's use would be the index's count of its keys).
    let rooms: Vec<Option<u64>> = cluster
        .next_table(20)
        .pods
        .iter()
        .map(|p| p.kv_room.free_blocks)
        .collect();
    assert_eq!(rooms, [Some(1975 - 1210), None]);
    // A later report without them: the router's own knowledge again.
    let body = report("a", "e", 2, 1, false, &[], &[chain[5]], 1.0);
    cluster.apply_report("a", &body, 30, 0).0.expect("accepted");
    assert_eq!(cluster.kv_capacity_blocks("a"), Some(577));
    assert_eq!(cluster.resident_blocks("a"), Some(5));
    // A use above the size is refused, naming both.
    let body = sized(report("a", "e", 3, 2, false, &[], &[], 1.0));
    let body = String::from_utf8(body).unwrap().replace("1210", "2000");
    let (result, _) = cluster.apply_report("a", body.as_bytes(), 40, 0);
    let error = format!("{:?}", result.expect_err("refused"));
    assert!(
        error.contains("`residentBlocks` 2000 exceeds `kvCapacityBlocks` 1975"),
        "{error}"
    );
    // Approximate mode: every pod is sized by podCapacityBlocks.
    let approximate = Config::parse(
        br#"{"pods": [{"id": "a", "address": "127.0.0.1:9001"}],
             "mode": "approximate", "podCapacityBlocks": 3000}"#,
    )
    .expect("valid config");
    let mut cluster = ClusterState::new(&approximate, 0);
    assert_eq!(cluster.kv_capacity_blocks("a"), Some(3000));
    assert_eq!(cluster.resident_blocks("a"), Some(0));
    // Its room is kvroute's guess, not priced.
    assert_eq!(cluster.next_table(0).pods[0].kv_room.free_blocks, None);
}

#[test]
fn cluster_health_decays_with_staleness_and_recovers() {
    // podReportIntervalMs 2000 + reportTimeoutMs 1000: full health for 3 s
    // after the last good answer, then linear to 0 over 3 intervals (6 s):
    // below the 0.3 exclusion threshold once the report is > 7.2 s old,
    // i.e. between the 3rd and 4th missed interval.
    let config = cluster_config();
    assert_eq!(
        (config.pod_report_interval_ms, config.report_timeout_ms),
        (2000, 1000)
    );
    let mut cluster = ClusterState::new(&config, 0);
    let t0 = 10_000;
    let body = report("a", "e1", 1, 0, true, &[], &[], 1.0);
    cluster.apply_report("a", &body, t0, 0).0.unwrap();
    assert_eq!(cluster.health("a", t0), 1.0);
    assert_eq!(
        cluster.health("a", t0 + 3000),
        1.0,
        "within the grace period"
    );
    let mut last = 1.0;
    for age in (3500..=9000).step_by(500) {
        let h = cluster.health("a", t0 + age);
        assert!(h < last, "health decreases: {h} at {age} ms");
        last = h;
    }
    let h = cluster.health("a", t0 + 6000);
    assert!((h - 0.5).abs() < 1e-9, "age 6 s: 1 − 3/6 = 0.5, got {h}");
    assert!(
        cluster.health("a", t0 + 7000) > 0.3,
        "age 7 s: 1 − 4/6 ≈ 0.33"
    );
    assert!(
        cluster.health("a", t0 + 7300) < 0.3,
        "age 7.3 s: 1 − 4.3/6 ≈ 0.28"
    );
    assert_eq!(cluster.health("a", t0 + 9000), 0.0);
    assert_eq!(cluster.health("a", t0 + 900_000), 0.0);
    let table = cluster.publish(t0 + 8000);
    let published = table
        .table
        .pods
        .iter()
        .find(|p| p.id == "a")
        .unwrap()
        .health;
    assert!(
        published < 0.3,
        "the published health carries the decay: {published}"
    );
    assert_eq!(cluster.health("nobody", t0), 0.0);

    // Failures while stale: a transition on the first, not on repeats.
    assert!(matches!(
        cluster.record_failure("a", PullKind::Report, Failure::Unreachable),
        Some(Transition::Failing { ref pod, failure: Failure::Unreachable, .. }) if pod == "a"
    ));
    assert_eq!(
        cluster.record_failure("a", PullKind::Report, Failure::Unreachable),
        None
    );
    assert_eq!(
        cluster.record_failure("a", PullKind::Report, Failure::Status(503)),
        Some(Transition::Failing {
            pod: "a".into(),
            kind: PullKind::Report,
            failure: Failure::Status(503)
        }),
        "a different kind of failure is a state change"
    );
    assert_eq!(
        cluster.record_failure("a", PullKind::Report, Failure::Status(500)),
        None,
        "same kind"
    );
    // A malformed report is a failure too.
    let (result, transition) = cluster.apply_report("a", b"{not json", t0 + 8500, 0);
    assert!(matches!(result, Err(Failure::Malformed(_))));
    assert!(matches!(transition, Some(Transition::Failing { .. })));
    let wrong_pod = report("b", "e1", 2, 1, false, &[], &[], 1.0);
    let (result, transition) = cluster.apply_report("a", &wrong_pod, t0 + 8600, 0);
    assert!(matches!(result, Err(Failure::Malformed(ref why)) if why.contains("podId")));
    assert_eq!(transition, None, "still malformed: no new transition");
    assert_eq!(cluster.failures("a"), 6);
    assert_eq!(
        cluster.record_failure("nobody", PullKind::Report, Failure::Unreachable),
        None
    );

    // The next good report restores health and says "recovered" once.
    let t1 = t0 + 20_000;
    let body = report("a", "e1", 2, 1, false, &[], &[], 0.9);
    let (result, transition) = cluster.apply_report("a", &body, t1, 0);
    assert!(result.is_ok());
    assert_eq!(
        transition,
        Some(Transition::Recovered {
            pod: "a".into(),
            kind: PullKind::Report
        })
    );
    assert!(
        (cluster.health("a", t1) - 0.9).abs() < 1e-12,
        "reported health"
    );
    assert!((cluster.health("a", t1 + 3000) - 0.9).abs() < 1e-12);
    let body = report("a", "e1", 3, 2, false, &[], &[], 1.0);
    assert_eq!(cluster.apply_report("a", &body, t1 + 2000, 0).1, None);
    // b never reported: it decays from its creation time.
    assert_eq!(cluster.health("b", 3000), 1.0);
    assert!(cluster.health("b", t1) < 0.3);
}

// ------------------------------------------------- regressions

/// With non-monotone masks (a torn read of buckets from two publishes) a pod
/// of the last block that does not hold `h[0]` must not be credited with the
/// whole chain: the last mask is intersected with the first.
#[test]
fn bisection_never_credits_a_pod_missing_from_the_first_block() {
    let sets = |slots: &[&[usize]]| -> Vec<Vec<Holder>> {
        slots
            .iter()
            .map(|s| s.iter().filter_map(|&p| Holder::new(p)).collect())
            .collect()
    };
    let torn = sets(&[&[0], &[1]]);
    let m = kvroute::index::match_by_bisection(torn.len(), |i| torn[i].clone());
    assert_eq!(
        (m.blocks(0), m.blocks(1)),
        (1, 0),
        "pod 1 does not hold h[0]"
    );
    let torn = sets(&[&[0], &[0], &[0, 1], &[0, 1], &[0, 1]]);
    let m = kvroute::index::match_by_bisection(torn.len(), |i| torn[i].clone());
    assert_eq!((m.blocks(0), m.blocks(1)), (5, 0));
}

/// A chain reported with the wrong parent (here `parent: null` for a block
/// indexed as a child) is refused, so the pod is never in a node without its
/// parent: `drop_pod` forgets everything and the snapshot agrees with the
/// tree.
#[test]
fn drop_pod_forgets_blocks_stored_under_a_mismatched_parent() {
    let mut tree = PrefixTree::with_change_log(100);
    tree.insert_chain(0, None, &[1, 2, 3]);
    tree.insert_chain(1, None, &[2, 3]); // 2 is indexed under 1, which pod 1 lacks
    tree.drop_pod(1);
    assert_eq!(
        tree.pod_block_count(1),
        0,
        "drop_pod left pod 1 in blocks 2 and 3"
    );

    let mut tree = PrefixTree::with_change_log(100);
    tree.insert_chain(0, None, &[10, 11]);
    tree.insert_chain(1, None, &[11, 12, 13]);
    let mut publisher = SnapshotPublisher::new(4);
    publisher.apply_tree(&mut tree);
    let store: HashMap<u32, Vec<u8>> = publisher.take_dirty(usize::MAX).into_iter().collect();
    let snapshot = SnapshotIndex {
        buckets: 4,
        fetch: |b| store.get(&b).cloned(),
    };
    let chain = [10, 11, 12, 13];
    assert_eq!(
        snapshot.lookup(&chain),
        tree.lookup(&chain),
        "tree says 0 blocks for pod 1, snapshot 4"
    );
}

#[test]
fn pulls_are_classified_before_the_body_is_read() {
    let mut config = cluster_config();
    config.max_report_bytes = 1000;
    let mut cluster = ClusterState::new(&config, 0);
    let unread = |_: usize| -> Vec<u8> { panic!("the body must not be read") };

    // No response at all: the pod died mid-body, timed out or refused.
    let (result, transition) =
        cluster.accept_pull("a", PullKind::Report, answer(None, 0), unread, 0);
    assert_eq!(result, Err(Failure::Unreachable));
    assert!(matches!(transition, Some(Transition::Failing { .. })));

    // Too large: refused unread, named, a state change of its own.
    let (result, transition) =
        cluster.accept_pull("a", PullKind::Report, answer(Some("200"), 5000), unread, 0);
    assert_eq!(
        result,
        Err(Failure::TooLarge {
            size: 5000,
            limit: 1000
        })
    );
    let Some(Transition::Failing { failure, .. }) = transition else {
        panic!("a new failure kind is logged once");
    };
    assert!(
        failure.to_string().contains("maxReportBytes (1000)"),
        "{failure}"
    );

    // Envoy's own 503 for an unreachable pod reads only the page's start.
    let page = b"upstream connect error or disconnect/reset before headers. reset reason: x";
    let (result, _) = cluster.accept_pull(
        "a",
        PullKind::Metrics,
        answer(Some("503"), page.len()),
        |n| {
            assert_eq!(n, 64);
            page[..n].to_vec()
        },
        0,
    );
    assert_eq!(result, Err(Failure::Unreachable));
    // A metrics page that is missing is a failure (a missing report is a
    // fallback, see the stock vLLM test).
    let (result, _) = cluster.accept_pull(
        "a",
        PullKind::Metrics,
        answer(Some("404"), 2),
        |_| b"no".to_vec(),
        0,
    );
    assert_eq!(result, Err(Failure::Status(404)));
    assert_eq!(cluster.unfolded(), 0, "failures are not queued");
    assert_eq!(fold_next(&mut cluster, 10), None);

    // Good bodies wait in order; a report folds, a `}{` metrics page is malformed.
    let body = report("a", "e1", 1, 0, true, &[(None, &[7, 8])], &[], 1.0);
    let size = body.len();
    let (result, transition) = cluster.accept_pull(
        "a",
        PullKind::Report,
        answer(Some("200"), size),
        |_| body,
        3,
    );
    assert_eq!((result, transition), (Ok(()), None));
    let (result, _) = cluster.accept_pull(
        "b",
        PullKind::Metrics,
        answer(Some("200"), 3),
        |_| b"}{\n".to_vec(),
        0,
    );
    assert_eq!(result, Ok(()));
    assert!(cluster.has_unfolded("a") && cluster.has_unfolded("b"));
    assert_eq!(cluster.unfolded(), 2);

    let folded = fold_next(&mut cluster, 50).unwrap();
    assert_eq!((folded.pod.as_str(), folded.kind), ("a", PullKind::Report));
    assert_eq!(folded.result.unwrap().unwrap().stored, 2);
    assert!(matches!(
        folded.transitions.as_slice(),
        [Transition::Recovered { .. }]
    ));
    let folded = fold_next(&mut cluster, 60).unwrap();
    assert_eq!(folded.pod, "b");
    assert!(matches!(folded.result, Err(Failure::Malformed(why)) if why.contains("unclosed")));
    assert_eq!(fold_next(&mut cluster, 70), None);
    assert!(!cluster.has_unfolded("a"));
}

#[test]
fn one_pod_holds_at_most_its_share_of_the_index() {
    // Two pods, 4096 blocks: each may hold 2 × 4096 / 2 = 4096 by default;
    // with maxPodIndexBlocks 100 a flood of 1000 stops at 100.
    let mut config = cluster_config();
    assert_eq!(config.pod_index_share(2), 4096);
    assert_eq!(config.pod_index_share(8), 1024);
    config.max_pod_index_blocks = Some(100);
    let mut cluster = ClusterState::new(&config, 0);
    let flood: Vec<u64> = (1..=1000).collect();
    let body = report("a", "e1", 1, 0, true, &[(None, &flood)], &[], 1.0);
    let summary = cluster.apply_report("a", &body, 10, 0).0.unwrap();
    assert_eq!((summary.stored, summary.orphaned), (100, 900));
    let slot = cluster.slot("a").unwrap();
    assert_eq!(cluster.index().pod_block_count(slot), 100);
    // The other pod is unaffected.
    let body = report("b", "e1", 1, 0, true, &[(None, &flood[..50])], &[], 1.0);
    assert_eq!(
        cluster.apply_report("b", &body, 10, 0).0.unwrap().stored,
        50
    );
}

#[test]
fn a_large_change_is_published_over_several_calls() {
    let config = cluster_config();
    let mut cluster = ClusterState::new(&config, 0);
    let chain: Vec<u64> = (1..=2000u64)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect();
    let body = report("a", "e1", 1, 0, true, &[(None, &chain)], &[], 1.0);
    cluster.apply_report("a", &body, 10, 0).0.unwrap();
    let mut shared = SharedData {
        buckets: 0,
        store: HashMap::new(),
    };
    let mut calls = 0;
    loop {
        let publication = cluster.publish_some(20, 64);
        assert!(publication.buckets.len() <= 64);
        shared.buckets = publication.table.buckets;
        shared.store.extend(publication.buckets);
        calls += 1;
        if publication.unpublished_buckets == 0 {
            break;
        }
    }
    assert!(calls > 1, "256 changed buckets take several calls of 64");
    let a = cluster.slot("a").unwrap();
    assert_eq!(shared.lookup(&chain).blocks(a), 2000);
}

proptest! {
    /// Folding in steps of any size ends where folding at once does: the
    /// same blocks per pod, the same summary, the same pod record, and
    /// other pods untouched (a full resync drops in steps too).
    #[test]
    fn a_report_folded_in_steps_ends_where_one_fold_does(
        step in 1usize..300,
        chains in prop::collection::vec(1usize..400, 1..5),
        removed in 0usize..200,
    ) {
        let config = cluster_config();
        let mut at_once = ClusterState::new(&config, 0);
        let mut stepped = ClusterState::new(&config, 0);
        // Before: both pods hold a first chain, pod a a second one too.
        let old_a: Vec<u64> = (1..=500).collect();
        let old_b: Vec<u64> = (1..=100).chain(10_001..10_050).collect();
        for cluster in [&mut at_once, &mut stepped] {
            let body = report("a", "e1", 1, 0, true, &[(None, &old_a), (None, &[90_001, 90_002])], &[], 1.0);
            cluster.apply_report("a", &body, 5, 0).0.unwrap();
            let body = report("b", "e1", 1, 0, true, &[(None, &old_b)], &[], 1.0);
            cluster.apply_report("b", &body, 5, 0).0.unwrap();
        }
        // A full resync of a (new blocks, some chains continuing the first),
        // then a delta that stores and removes.
        let mut next = 20_000u64;
        let mut stored: Vec<(Option<u64>, Vec<u64>)> = Vec::new();
        for (i, len) in chains.iter().enumerate() {
            let parent = if i % 2 == 1 { Some(old_a[i * 7]) } else { None };
            let hashes: Vec<u64> = (next..next + *len as u64).collect();
            next += *len as u64;
            stored.push((parent, hashes));
        }
        let shared: Vec<(Option<u64>, &[u64])> = stored.iter().map(|(p, h)| (*p, h.as_slice())).collect();
        let full = report("a", "e2", 7, 0, true, &shared, &[], 0.5);
        let gone: Vec<u64> = (20_000..20_000 + removed as u64).collect();
        let delta = report("a", "e2", 8, 7, false, &[(None, &[77_001, 77_002, 77_003])], &gone, 0.75);
        let mut summaries_at_once = Vec::new();
        let mut summaries_stepped = Vec::new();
        for body in [full, delta] {
            summaries_at_once.push(at_once.apply_report("a", &body, 10, 2).0.unwrap());
            let size = body.len();
            stepped.accept_pull("a", PullKind::Report, answer(Some("200"), size), |_| body, 2).0.unwrap();
            let folded = loop {
                match stepped.fold_step(10, step).unwrap() {
                    FoldStep::Partial => prop_assert!(stepped.has_unfolded("a")),
                    FoldStep::Done(folded) => break folded,
                }
            };
            prop_assert!(!stepped.has_unfolded("a"));
            summaries_stepped.push(folded.result.unwrap().unwrap());
        }
        prop_assert_eq!(summaries_at_once, summaries_stepped);
        let every = (1..=600).chain(10_001..10_050).chain(20_000..next).chain(77_001..77_004).chain(90_001..90_003);
        for hash in every {
            prop_assert_eq!(at_once.index().pods(hash), stepped.index().pods(hash), "block {}", hash);
        }
        prop_assert_eq!(at_once.index().len(), stepped.index().len());
        prop_assert_eq!(at_once.report_query("a", "/r"), stepped.report_query("a", "/r"));
        prop_assert_eq!(at_once.pod_table(10).pods, stepped.pod_table(10).pods);
    }
}

/// Accepts a report-endpoint answer `status` from `pod` and folds it.
fn report_answer(
    cluster: &mut ClusterState,
    pod: &str,
    status: &str,
    body: Vec<u8>,
    now: u64,
) -> Folded {
    let size = body.len();
    let (result, transition) = cluster.accept_pull(
        pod,
        PullKind::Report,
        answer(Some(status), size),
        |_| body,
        0,
    );
    assert_eq!((result, transition), (Ok(()), None), "{status} is queued");
    fold_next(cluster, now).expect("folded")
}

#[test]
fn a_pod_without_a_report_endpoint_is_routed_on_decisions_until_it_serves_reports() {
    // Stock vLLM in precise mode: the report endpoint answers 404 every
    // round, /metrics answers 200.
    let mut cluster = ClusterState::new(&cluster_config(), 0);
    let a = cluster.slot("a").unwrap();
    let b = cluster.slot("b").unwrap();
    // What a's reports said first: blocks 1-3, queue 3, health 0.5.
    let folded = report_answer(
        &mut cluster,
        "a",
        "200",
        report("a", "e1", 3, 0, true, &[(None, &[1, 2, 3])], &[], 0.5),
        0,
    );
    assert!(folded.result.is_ok());
    assert_eq!(cluster.index().lookup(&[1, 2, 3]).blocks(a), 3);
    let metrics = b"vllm:num_requests_waiting 2\nvllm:kv_cache_usage_perc 0.5\n";
    let mut transitions = Vec::new();
    for round in 1..=5u64 {
        let now = round * 2000;
        let folded = report_answer(&mut cluster, "a", "404", b"Not Found".to_vec(), now);
        assert_eq!((folded.kind, &folded.result), (PullKind::Report, &Ok(None)));
        transitions.extend(folded.transitions);
        cluster.apply_metrics("a", metrics, now, 0).0.unwrap();
        // Routed to a: the decision is a's block, with no expiry.
        cluster.record_decision(a, &[10, 11, 12 + round], now, 0);
        // b reports: its decisions are pending ones, which expire.
        cluster.record_decision(b, &[20, 21], now, 0);
    }
    assert_eq!(
        transitions,
        vec![Transition::ReportFallback { pod: "a".into() }],
        "one fallback, then silence"
    );
    assert!(cluster.in_report_fallback("a") && !cluster.in_report_fallback("b"));
    assert_eq!(cluster.failures("a"), 0, "a missing report is no failure");
    // The reported blocks are gone; the decisions are a's, held long
    // after pending decisions would have expired.
    let now = 60_000;
    let table = cluster.publish(now).table;
    assert_eq!(cluster.index().lookup(&[1, 2, 3]).blocks(a), 0);
    assert_eq!(cluster.index().lookup(&[10, 11, 15]).blocks(a), 3);
    assert_eq!(cluster.index().lookup(&[10, 11, 13]).blocks(a), 3);
    assert_eq!(cluster.index().lookup(&[20, 21]).blocks(b), 0);
    assert_eq!(
        cluster.pending().unwrap().lookup(&[20, 21]).blocks(b),
        0,
        "expired"
    );
    // Queue and load from vLLM's metrics, health no longer the report's;
    // every 404 kept the pod fresh.
    let published = &table.pods[slot_of(&table, "a")];
    assert_eq!(
        (published.queue, published.load, published.reported_health),
        (2, 0.5, 1.0)
    );
    assert_eq!(published.last_report_ms, 10_000);
    // Since its epoch was forgotten, the pod is asked for everything.
    assert_eq!(cluster.report_query("a", "/r").unwrap(), "/r?since=0");

    // It serves reports again: precise, and the report's blocks replace
    // the decisions' (10, 11, 12 kept because the pod holds them).
    let body = report(
        "a",
        "e2",
        7,
        0,
        true,
        &[(None, &[10, 11, 12]), (None, &[30])],
        &[],
        1.0,
    );
    let folded = report_answer(&mut cluster, "a", "200", body, now);
    assert_eq!(
        folded.transitions,
        [Transition::ReportPrecise { pod: "a".into() }]
    );
    assert!(!cluster.in_report_fallback("a"));
    assert_eq!(cluster.index().lookup(&[10, 11, 12]).blocks(a), 3);
    assert_eq!(
        cluster.index().lookup(&[10, 11, 15]).blocks(a),
        2,
        "not the pod's"
    );
    assert_eq!(cluster.index().lookup(&[30]).blocks(a), 1);
    // Decisions are pending again, and the decisions' recency is gone: a's
    // reported blocks are never evicted by the recorder.
    cluster.record_decision(a, &[40], now, 0);
    assert_eq!(cluster.pending().unwrap().lookup(&[40]).blocks(a), 1);
    assert_eq!(cluster.index().lookup(&[40]).blocks(a), 0);
    // A chain a's report holds whole needs no pending entry; one it holds
    // in part is pending whole (pending blocks stay prefix-closed).
    cluster.record_decision(a, &[10, 11, 12], now, 0);
    assert_eq!(
        cluster.pending().unwrap().lookup(&[10, 11, 12]).blocks(a),
        0
    );
    cluster.record_decision(a, &[10, 11, 12, 13], now, 0);
    assert_eq!(
        cluster
            .pending()
            .unwrap()
            .lookup(&[10, 11, 12, 13])
            .blocks(a),
        4
    );
    // A failing pull, then a 404 again: failing, then one fallback that
    // also ends the failure.
    let (_, failing) =
        cluster.accept_pull("a", PullKind::Report, answer(None, 0), |_| Vec::new(), 0);
    assert!(matches!(failing, Some(Transition::Failing { .. })));
    let folded = report_answer(&mut cluster, "a", "404", Vec::new(), now + 2000);
    assert_eq!(
        folded.transitions,
        [Transition::ReportFallback { pod: "a".into() }]
    );
    assert_eq!(cluster.index().lookup(&[10, 11, 12]).blocks(a), 0);
    assert_eq!(cluster.report_query("a", "/r").unwrap(), "/r?since=0");
}

/// A metrics page with vLLM's cache configuration, as vLLM 0.32 writes
/// it (cut to a few labels, among them `mamba_block_size`, which is not
/// the block size).
fn cache_config_page(block_size: &str, gpu_blocks: &str, prefix_caching: &str) -> Vec<u8> {
    format!(
        "vllm:num_requests_waiting{{engine=\"0\"}} 0.0\n\
         vllm:cache_config_info{{_block_size_resolved=\"True\",block_size=\"{block_size}\",\
         enable_prefix_caching=\"{prefix_caching}\",engine=\"0\",mamba_block_size=\"None\",\
         num_gpu_blocks=\"{gpu_blocks}\",num_gpu_blocks_override=\"None\"}} 1.0\n"
    )
    .into_bytes()
}

/// Folds a metrics page of `pod`; its transitions.
fn metrics_transitions(cluster: &mut ClusterState, pod: &str, page: &[u8]) -> Vec<Transition> {
    let (result, transitions) = cluster.apply_metrics(pod, page, 0, 0);
    assert_eq!(result, Ok(()));
    transitions
}

#[test]
fn a_vllm_block_size_other_than_block_size_tokens_is_said_once_per_change() {
    // Precise, blockSizeTokens 16 (the defaults).
    let mut cluster = ClusterState::new(&cluster_config(), 0);
    let mismatch = |pod: &str, block_size| Transition::BlockSizeMismatch {
        pod: pod.into(),
        block_size,
        block_size_tokens: 16,
    };
    // a runs vLLM's CPU build (32), b agrees with the router.
    let cpu = cache_config_page("32", "6103", "True");
    assert_eq!(
        metrics_transitions(&mut cluster, "a", &cpu),
        [mismatch("a", 32)]
    );
    let agrees = cache_config_page("16", "577", "True");
    assert_eq!(metrics_transitions(&mut cluster, "b", &agrees), []);
    assert_eq!(
        (
            cluster.block_size_mismatch("a"),
            cluster.block_size_mismatch("b")
        ),
        (Some(32), None)
    );
    assert_eq!(
        (
            cluster.kv_capacity_blocks("a"),
            cluster.kv_capacity_blocks("b")
        ),
        (Some(6103), Some(577))
    );
    // Said once: the next rounds say nothing.
    for _ in 0..3 {
        assert_eq!(metrics_transitions(&mut cluster, "a", &cpu), []);
        assert_eq!(metrics_transitions(&mut cluster, "b", &agrees), []);
    }
    // vLLM restarted with another size: said again, then with the right
    // one: matches. An older vLLM's `None` reads as no capacity.
    let other = cache_config_page("64", "None", "True");
    assert_eq!(
        metrics_transitions(&mut cluster, "a", &other),
        [mismatch("a", 64)]
    );
    assert_eq!(cluster.kv_capacity_blocks("a"), None);
    assert_eq!(
        metrics_transitions(&mut cluster, "a", &agrees),
        [Transition::BlockSizeMatches {
            pod: "a".into(),
            block_size: 16
        }]
    );
    assert_eq!(cluster.block_size_mismatch("a"), None);
    // A page that stops stating a size says nothing (nor is it a
    // mismatch); one stating the wrong size after it is said again.
    assert_eq!(
        metrics_transitions(&mut cluster, "a", &cpu),
        [mismatch("a", 32)]
    );
    let silent = b"vllm:num_requests_waiting 0\n";
    assert_eq!(metrics_transitions(&mut cluster, "a", silent), []);
    assert_eq!(cluster.block_size_mismatch("a"), None);
    assert_eq!(
        metrics_transitions(&mut cluster, "a", &cpu),
        [mismatch("a", 32)]
    );

    // Prefix caching off: said once, and when it is on again.
    let uncached = cache_config_page("16", "577", "False");
    let disabled = Transition::PrefixCachingDisabled { pod: "b".into() };
    assert_eq!(
        metrics_transitions(&mut cluster, "b", &uncached),
        [disabled]
    );
    assert_eq!(metrics_transitions(&mut cluster, "b", &uncached), []);
    assert_eq!(
        metrics_transitions(&mut cluster, "b", &agrees),
        [Transition::PrefixCachingEnabled { pod: "b".into() }]
    );

    // A pod whose metrics failed (vLLM starting) and then answer: both
    // said, in order, through the inbox as the service folds them.
    let (_, failing) =
        cluster.accept_pull("b", PullKind::Metrics, answer(None, 0), |_| Vec::new(), 0);
    assert!(matches!(failing, Some(Transition::Failing { .. })));
    let (result, none) = cluster.accept_pull(
        "b",
        PullKind::Metrics,
        answer(Some("200"), cpu.len()),
        |_| cpu.clone(),
        0,
    );
    assert_eq!((result, none), (Ok(()), None));
    let folded = fold_next(&mut cluster, 100).expect("folded");
    assert_eq!(
        folded.transitions,
        [
            Transition::Recovered {
                pod: "b".into(),
                kind: PullKind::Metrics
            },
            mismatch("b", 32)
        ]
    );
}

#[test]
fn approximate_mode_minds_no_block_size_but_prefix_caching() {
    // Approximate mode matches kvroute's own decisions, whatever vLLM's
    // block size; without prefix caching there is still nothing to match.
    let config = Config::parse(
        br#"{"pods": [{"id": "a", "address": "127.0.0.1:9001"}], "mode": "approximate",
             "blockSizeTokens": 32}"#,
    )
    .unwrap();
    let mut cluster = ClusterState::new(&config, 0);
    let page = cache_config_page("16", "42", "False");
    assert_eq!(
        metrics_transitions(&mut cluster, "a", &page),
        [Transition::PrefixCachingDisabled { pod: "a".into() }]
    );
    assert_eq!(cluster.block_size_mismatch("a"), None);
    assert_eq!(cluster.kv_capacity_blocks("a"), Some(42));
}

fn pod(id: &str, address: &str) -> PodConfig {
    PodConfig {
        id: id.into(),
        address: address.into(),
        report_address: None,
        metrics_address: None,
        attributes: Default::default(),
    }
}

#[test]
fn a_discovered_pod_list_adds_removes_and_replaces_pods_dropping_the_old_blocks() {
    let mut cluster = ClusterState::new(&cluster_config(), 0);
    for (id, blocks) in [("a", [1, 2]), ("b", [5, 6])] {
        let body = report(id, "e", 1, 0, true, &[(None, &blocks)], &[], 1.0);
        report_answer(&mut cluster, id, "200", body, 0);
    }
    let (a, b) = (cluster.slot("a").unwrap(), cluster.slot("b").unwrap());
    // Add c, remove b, keep a.
    let change = cluster
        .replace_pods(
            &[pod("a", "127.0.0.1:9001"), pod("c", "127.0.0.1:9003")],
            10,
        )
        .unwrap();
    assert_eq!(change.added, ["c"]);
    assert_eq!(change.removed, ["b"]);
    assert_eq!(cluster.slot("a"), Some(a), "a kept its slot");
    assert_eq!(
        cluster.index().lookup(&[1, 2]).blocks(a),
        2,
        "and its blocks"
    );
    assert_eq!(
        cluster.index().lookup(&[5, 6]).blocks(b),
        0,
        "b's blocks dropped"
    );
    assert_eq!(cluster.slot("c"), Some(b), "c took the free slot");
    // a replaced: same id at another address is another pod.
    let change = cluster
        .replace_pods(
            &[pod("a", "127.0.0.1:9101"), pod("c", "127.0.0.1:9003")],
            20,
        )
        .unwrap();
    assert_eq!(
        (change.added, change.removed),
        (vec!["a".to_string()], vec!["a".to_string()])
    );
    assert_eq!(
        cluster
            .index()
            .lookup(&[1, 2])
            .blocks(cluster.slot("a").unwrap()),
        0
    );
    assert_eq!(cluster.report_query("a", "/r").unwrap(), "/r?since=0");
    // The same list again changes nothing.
    let same = cluster
        .replace_pods(
            &[pod("a", "127.0.0.1:9101"), pod("c", "127.0.0.1:9003")],
            30,
        )
        .unwrap();
    assert!(same.is_empty());
    // A list that breaks the rules of `pods` is refused, naming the field;
    // the pods stay.
    let error = cluster
        .replace_pods(
            &[pod("x", "127.0.0.1:9001"), pod("y", "127.0.0.1:9001")],
            40,
        )
        .unwrap_err();
    assert_eq!(error.field, "pods[1].address");
    let too_many: Vec<PodConfig> = (0..1025)
        .map(|i| pod(&format!("p{i}"), &format!("127.0.0.1:{}", 10_000 + i)))
        .collect();
    assert_eq!(
        cluster.replace_pods(&too_many, 40).unwrap_err().field,
        "pods"
    );
    let ids: Vec<&str> = cluster.pods().map(|p| p.id.as_str()).collect();
    assert_eq!(ids, ["a", "c"], "in slot order, a in its freed slot");
    // The ceiling: 1,024 pods, each in its own slot; a pod keeps its slot
    // while others come and go.
    let change = cluster.replace_pods(&too_many[..1024], 50).unwrap();
    assert_eq!((change.added.len(), change.removed.len()), (1024, 2));
    let mut slots: Vec<usize> = (0..1024)
        .filter_map(|i| cluster.slot(&format!("p{i}")))
        .collect();
    slots.sort_unstable();
    assert_eq!(slots, (0..1024).collect::<Vec<_>>());
    let kept = cluster.slot("p700");
    let mut fewer = too_many[1..1024].to_vec();
    fewer.push(pod("q", "127.0.0.1:9999"));
    let change = cluster.replace_pods(&fewer, 60).unwrap();
    assert_eq!(
        (change.added, change.removed),
        (vec!["q".into()], vec!["p0".into()])
    );
    assert_eq!(cluster.slot("p700"), kept);
    // A 1,024-pod table is published once per generation.
    assert_eq!(cluster.pod_table(60).pods.len(), 1024);
}

#[test]
fn membership_pods_accept_a_report_under_any_pod_name() {
    // Known by address: the pod may call itself anything (a bridge run
    // with `--pod-id $(POD_NAME)`); static pods must name themselves.
    let membership =
        Config::parse(br#"{"membership": {"cluster": "kvroute_pods"}, "maxIndexBlocks": 4096}"#)
            .unwrap();
    let mut cluster = ClusterState::new(&membership, 0);
    cluster
        .replace_pods(&[pod("10.0.0.5:8000", "10.0.0.5:8000")], 0)
        .unwrap();
    let body = report("vllm-0", "e", 1, 0, true, &[(None, &[1])], &[], 1.0);
    assert!(report_answer(&mut cluster, "10.0.0.5:8000", "200", body, 0)
        .result
        .is_ok());
    let mut configured = ClusterState::new(&cluster_config(), 0);
    let body = report("vllm-0", "e", 1, 0, true, &[(None, &[1])], &[], 1.0);
    let folded = report_answer(&mut configured, "a", "200", body, 0);
    assert!(matches!(folded.result, Err(Failure::Malformed(why)) if why.contains("podId")));
}

#[test]
fn a_peer_replicas_decisions_count_as_this_replicas_own() {
    use kvroute::replica::{
        encode_answer, AnswerLimits, LoggedDecision, PodInflight, ReplicaAnswer,
    };
    let mut cluster = ClusterState::new(&cluster_config(), 0);
    let (a, b) = (cluster.slot("a").unwrap(), cluster.slot("b").unwrap());
    // This replica's own decisions: logged when recorded, not when a's
    // report already holds the chain.
    assert_eq!(cluster.record_decision(a, &[1, 2], 0, 0), Some("a"));
    let report_body = report("a", "e1", 1, 0, true, &[(None, &[7, 8])], &[], 1.0);
    assert!(report_answer(&mut cluster, "a", "200", report_body, 0)
        .result
        .is_ok());
    assert_eq!(cluster.record_decision(a, &[7, 8], 0, 0), None);

    let mut peers = kvroute::replica::Peers::new(
        "0000000000000001".into(),
        cluster_config().pending_decision_ttl_ms(),
        AnswerLimits {
            max_chain: 2048,
            max_pods: 64,
        },
    );
    peers.set_addresses(&["10.0.0.9:9902".into()]);
    let answer = ReplicaAnswer {
        replica: "0000000000000002".into(),
        seq: 2,
        since: 0,
        full: true,
        sent_at_ms: 50_000,
        decisions: vec![
            LoggedDecision {
                seq: 1,
                pod: "b".into(),
                at_ms: 49_000,
                chain: vec![30, 31, 32],
                predicted_ttft_ms: 4_000,
                first_byte: None,
                session_start: None,
            },
            LoggedDecision {
                seq: 2,
                pod: "a pod this replica does not know".into(),
                at_ms: 50_000,
                chain: vec![40],
                predicted_ttft_ms: 0,
                first_byte: None,
                session_start: None,
            },
        ],
        inflight: vec![
            PodInflight {
                pod: "b".into(),
                load: SlotLoad {
                    requests: 3,
                    prefill_tokens: 900,
                    prefill_attention: 0,
                    streams: 1,
                },
            },
            PodInflight {
                pod: "gone".into(),
                load: SlotLoad {
                    requests: 5,
                    prefill_tokens: 5,
                    prefill_attention: 0,
                    streams: 1,
                },
            },
        ],
    };
    let now = 10_000;
    let received = peers
        .accept("10.0.0.9:9902", &encode_answer(&answer), now)
        .expect("good answer");
    let recorded: Vec<bool> = received
        .decisions
        .iter()
        .map(|(d, at)| cluster.record_peer_decision(&d.pod, &d.chain, *at, d.predicted_ttft_ms))
        .collect();
    assert_eq!(recorded, vec![true, false]);
    // Pending on b, made 1 s before it was sent and predicted to be
    // prefilled 4 s after it was made: it counts until the TTL after that.
    let ttl = cluster_config().pending_decision_ttl_ms();
    cluster.publish(now);
    assert_eq!(
        cluster.pending().unwrap().lookup(&[30, 31, 32]).blocks(b),
        3
    );
    cluster.publish(now - 1000 + 4000 + ttl - 1);
    assert_eq!(
        cluster.pending().unwrap().lookup(&[30, 31, 32]).blocks(b),
        3
    );
    cluster.publish(now - 1000 + 4000 + ttl);
    assert_eq!(
        cluster.pending().unwrap().lookup(&[30, 31, 32]).blocks(b),
        0
    );
    // The peer's loads count by slot while it answers.
    let loads = cluster.peer_loads(&peers, now);
    assert_eq!((loads[b].requests, loads[b].prefill_tokens), (3, 900));
    assert_eq!(loads[a].requests, 0);
    assert!(cluster
        .peer_loads(&peers, now + ttl + 1)
        .iter()
        .all(|l| l.requests == 0));
}
