//! Fuzz harnesses over kvroute's host-agnostic routing core, one module per
//! libFuzzer target in `fuzz_targets/` (built and run by `make fuzz` and the
//! `fuzz-smoke` step of `make test`; seeds in `corpus/<target>/`).
//!
//! Each harness checks what must hold for every input, not only "no panic":
//! - [`route`]: a request body against a published snapshot; the decision
//!   names a published pod and the snapshot answers like the service's tree;
//! - [`reports`]: a sequence of pod answers folded and published; after every
//!   publication the shared-data view equals the tree and the pod table
//!   survives the filter's decoding;
//! - [`metrics`]: vLLM `/metrics` pages;
//! - [`config`]: `plugin_configuration` values; an accepted one can be used.
//!
//! The fixtures below (a few pods, Envoy's shared data as a map) are shared by
//! the harnesses that need a cluster.

pub mod config;
pub mod metrics;
pub mod reports;
pub mod route;

use std::collections::HashMap;

use kvroute::cluster::Publication;
use kvroute::config::Config;
use kvroute::index::PrefixLookup;
use kvroute::report::hash_to_hex;
use kvroute::snapshot::{PodTable, SnapshotIndex};

/// Number of fixture pods: `pod-{i}` at `10.0.0.{i+1}:8000`, attribute
/// `costPerHour` = i.
pub const PODS: usize = 3;

/// A valid configuration with [`PODS`] pods and `metricsPath` set, plus
/// `extra` top-level fields (a JSON fragment starting with a comma, or
/// empty).
pub fn fixture_config(extra: &str) -> Config {
    let pods: Vec<String> = (0..PODS)
        .map(|i| {
            format!(
                r#"{{"id": "{}", "address": "10.0.0.{}:8000", "attributes": {{"costPerHour": {i}}}}}"#,
                pod_id(i),
                i + 1
            )
        })
        .collect();
    let text = format!(
        r#"{{"pods": [{}], "metricsPath": "/metrics"{extra}}}"#,
        pods.join(", ")
    );
    Config::parse(text.as_bytes()).expect("fixture configuration is valid")
}

pub fn pod_id(index: usize) -> String {
    format!("pod-{index}")
}

/// What the filters see: the last pod table and every bucket value written
/// so far, as Envoy's shared data holds them.
#[derive(Default)]
pub struct SharedData {
    pub table: PodTable,
    buckets: HashMap<u32, Vec<u8>>,
}

impl SharedData {
    /// Writes one publication, as the service does each tick.
    pub fn write(&mut self, publication: Publication) {
        self.table = publication.table;
        self.buckets.extend(publication.buckets);
    }

    pub fn bucket(&self, bucket: u32) -> Option<&[u8]> {
        self.buckets.get(&bucket).map(Vec::as_slice)
    }

    /// The filter's view of the published index.
    pub fn index(&self) -> SnapshotIndex<impl Fn(u32) -> Option<Vec<u8>> + '_> {
        SnapshotIndex {
            buckets: self.table.buckets,
            fetch: |b| self.buckets.get(&b).cloned(),
        }
    }

    /// Asserts that the published index answers `chain` (a path of the tree)
    /// like the service's tree.
    /// The snapshot answers like the index it was published from.
    pub fn assert_lookup_matches(&self, index: &dyn PrefixLookup, chain: &[u64]) {
        assert_eq!(
            self.index().lookup(chain),
            index.lookup(chain),
            "snapshot and tree disagree on chain {chain:x?}"
        );
    }
}

/// A protocol v1 report as a pod sends it.
pub struct Report<'a> {
    pub pod: &'a str,
    pub epoch: &'a str,
    pub seq: u64,
    pub since: u64,
    pub full: bool,
    /// (parent, hashes) chain segments.
    pub stored: Vec<(Option<u64>, &'a [u64])>,
    pub removed: Vec<u64>,
    pub queue: u32,
}

impl<'a> Report<'a> {
    /// A full report (epoch `e1`, seq 1) holding `chains`, each from the
    /// prompt's first block.
    pub fn full(pod: &'a str, chains: &[&'a [u64]], queue: u32) -> Report<'a> {
        Report {
            pod,
            epoch: "e1",
            seq: 1,
            since: 0,
            full: true,
            stored: chains.iter().map(|&chain| (None, chain)).collect(),
            removed: Vec::new(),
            queue,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let hex =
            |hashes: &[u64]| -> Vec<String> { hashes.iter().map(|&h| hash_to_hex(h)).collect() };
        let stored: Vec<serde_json::Value> = self
            .stored
            .iter()
            .map(|(parent, hashes)| {
                serde_json::json!({"parent": parent.map(hash_to_hex), "hashes": hex(hashes)})
            })
            .collect();
        serde_json::to_vec(&serde_json::json!({
            "version": 1, "podId": self.pod, "epoch": self.epoch, "seq": self.seq,
            "since": self.since, "full": self.full, "stored": stored,
            "removed": hex(&self.removed), "queueDepth": self.queue, "health": 1.0,
        }))
        .expect("report serialises")
    }
}
