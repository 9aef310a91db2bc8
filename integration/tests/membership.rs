//! `membership` in real Envoy 1.40: the pods are whatever Envoy has in the
//! serving cluster, here `kvroute_pods` fed by filesystem EDS (the file is
//! replaced by a rename, as Envoy watches it) under the override-host
//! policy, so kvroute's choice must be a member to be reached at all — the
//! production combination. Envoy runs what kvroute-config renders for a
//! deployment file with `cluster: {eds: {path}}`. kvroute-sims are named by
//! their address, as kvroute names membership pods. Run serially
//! (`--test-threads=1`).

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvroute_config::{Deployment, Target};
use kvroute_integration::harness::{
    filler_text as text, free_port, free_port_range, module_name, poll, start_sims, wasm_path,
    write_eds, Envoy, Process, Sim,
};
use kvroute_integration::http;
use serde_json::{json, Value};

const SIM: &str = env!("CARGO_BIN_EXE_kvroute-sim");

/// Rounds (membership, metrics, publication) every 500 ms.
const INTERVAL_MS: u64 = 500;

/// A prompt prefix of 16 KiB: 256 blocks of 64 bytes.
const PREFIX_BYTES: usize = 16 * 1024;
const PREFIX_BLOCKS: f64 = 256.0;

struct Membership {
    sims: Vec<Sim>,
    envoy: Envoy,
    eds: PathBuf,
    dir: PathBuf,
    /// The process serving every sim, when they share one.
    _pool: Option<Process>,
}

impl Drop for Membership {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- envoy log ---\n{}", self.envoy.log());
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Membership {
    /// `pods` sims; the EDS file lists the first `members`; kvroute's
    /// membership is of `cluster` (the rendering's is `kvroute_pods`, the
    /// pods' cluster; another name is a misconfiguration).
    fn start(pods: usize, members: usize, cluster: &str) -> Membership {
        Membership::start_with(pods, members, cluster, false)
    }

    /// [`Membership::start`]; with `pool`, every sim in one `kvroute-sim
    /// --pods` process.
    fn start_with(pods: usize, members: usize, cluster: &str, pool: bool) -> Membership {
        let dir = std::env::temp_dir().join(format!(
            "kvroute-membership-{}-{}",
            std::process::id(),
            free_port()
        ));
        fs::create_dir_all(&dir).unwrap();
        let eds = dir.join("kvroute_pods.eds.json");
        let (listen, admin) = (free_port(), free_port());
        let deployment_file = dir.join("deployment.json");
        let deployment = json!({
            "kvroute": {
                "podReportIntervalMs": INTERVAL_MS,
                "decisionHeaders": true,
                "models": {"sim-model": {"baseModel": "sim-model"}}
            },
            "cluster": {"eds": {"path": eds}},
            "envoy": {"module": module_name(), "wasm": wasm_path(), "listenAddress": "127.0.0.1", "listenPort": listen, "adminPort": admin},
        });
        fs::write(&deployment_file, deployment.to_string()).unwrap();
        let mut deployment =
            Deployment::load(&deployment_file, Target::Envoy).expect("the deployment loads");
        deployment.plugin["membership"]["cluster"] = json!(cluster);
        let config = deployment.plugin.clone();
        let config_file = dir.join("kvroute.json");
        fs::write(&config_file, config.to_string()).unwrap();
        let args = ["--time-scale".to_string(), "0.02".to_string()];
        let (sims, pool): (Vec<Sim>, _) = if pool {
            let base = free_port_range(pods);
            let ports: Vec<u16> = (0..pods as u16).map(|i| base + i).collect();
            let (process, sims) = start_sims(
                SIM.as_ref(),
                "127.0.0.1:{port}",
                0,
                &ports,
                &config_file,
                &args,
            )
            .expect("sims");
            (sims, Some(process))
        } else {
            let sims = (0..pods)
                .map(|_| {
                    let port = free_port();
                    let id = format!("127.0.0.1:{port}");
                    Sim::start_on(SIM.as_ref(), &id, port, &config_file, &args).expect("sim")
                })
                .collect();
            (sims, None)
        };
        let addresses: Vec<String> = sims[..members].iter().map(|s| s.address.clone()).collect();
        write_eds(&eds, &addresses).unwrap();
        let yaml = deployment.envoy_bootstrap();
        let envoy = Envoy::start(&dir, &yaml, listen, admin).expect("envoy starts");
        let cluster = Membership {
            sims,
            envoy,
            eds,
            dir,
            _pool: pool,
        };
        let published = if cluster_name_is_pods(&config) {
            members
        } else {
            0
        };
        for sim in &cluster.sims[..published] {
            cluster.wait_for(&format!("{} published", sim.id), || {
                cluster
                    .envoy
                    .metric("epp_pod_health_score", &[("pod", &label(&sim.id))])
            });
        }
        cluster
    }

    fn set_members(&self, members: &[usize]) -> Instant {
        let addresses: Vec<String> = members
            .iter()
            .map(|&i| self.sims[i].address.clone())
            .collect();
        write_eds(&self.eds, &addresses).unwrap();
        Instant::now()
    }

    /// Polls `probe` every 10 ms until it answers, at most 10 s.
    fn wait_for<T>(&self, what: &str, probe: impl FnMut() -> Option<T>) -> T {
        poll(
            what,
            Duration::from_secs(10),
            Duration::from_millis(10),
            probe,
        )
    }

    /// Waits for the `pods_changed` line that adds and removes these pods
    /// (by sim index); returns when it was seen.
    fn wait_pods_changed(&self, added: &[usize], removed: &[usize]) -> Instant {
        let ids = |indices: &[usize]| -> Vec<String> {
            indices.iter().map(|&i| self.sims[i].id.clone()).collect()
        };
        let (added, removed) = (ids(added), ids(removed));
        self.wait_for("pods_changed", || {
            events(&self.envoy.log(), "pods_changed")
                .iter()
                .any(|e| e["added"] == json!(added) && e["removed"] == json!(removed))
                .then(Instant::now)
        })
    }

    /// Blocks in kvroute's index (published once per round).
    fn index_blocks(&self) -> f64 {
        self.envoy
            .metric("epp_prefix_tree_nodes", &[])
            .unwrap_or(0.0)
    }

    /// Waits until the index holds at least `blocks` (or, with `below`,
    /// fewer than `blocks`).
    fn wait_index(&self, blocks: f64, below: bool) -> f64 {
        self.wait_for(
            &format!("index {} {blocks}", if below { "<" } else { ">=" }),
            || {
                let now = self.index_blocks();
                ((now < blocks) == below).then_some(now)
            },
        )
    }

    /// Sends `prompt` to sim `i` directly, past Envoy: the pod caches it
    /// and reports it; kvroute routed nothing.
    fn prime(&self, i: usize, prompt: &str) {
        let r = http::post_json(
            &self.sims[i].address,
            "/v1/completions",
            &completion(prompt).to_string(),
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }

    /// A request through Envoy: (pod that served it, kvroute's cache match).
    fn route(&self, prompt: &str) -> (String, f64) {
        let r = http::post_json(
            &self.envoy.listen,
            "/v1/completions",
            &completion(prompt).to_string(),
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let pod = r.header("x-sim-pod").expect("x-sim-pod").to_string();
        assert_eq!(r.header("x-kvroute-pod"), Some(pod.as_str()), "no failover");
        let matched = r
            .header("x-kvroute-cache-match")
            .and_then(|m| m.parse().ok());
        (pod, matched.expect("x-kvroute-cache-match"))
    }

    /// An Envoy stat from the admin's plain `/stats`.
    fn envoy_stat(&self, name: &str) -> u64 {
        let stats = http::get(&self.envoy.admin, "/stats").unwrap().body;
        stats
            .lines()
            .find_map(|line| line.strip_prefix(&format!("{name}: ")))
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or(0)
    }
}

fn cluster_name_is_pods(config: &Value) -> bool {
    config["membership"]["cluster"] == "kvroute_pods"
}

fn completion(prompt: &str) -> Value {
    json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4})
}

/// A pod id as a metric label (`.` is `_` there).
fn label(id: &str) -> String {
    id.replace('.', "_")
}

/// kvroute's JSON log events named `name`.
fn events(log: &str, name: &str) -> Vec<Value> {
    log.lines()
        .filter_map(|line| line.find('{').map(|at| &line[at..]))
        .filter_map(|json| serde_json::from_str::<Value>(json).ok())
        .filter(|event| event["event"] == name)
        .collect()
}

fn prompt(seed: &str, question: &str) -> String {
    format!("{} {question}", text(seed, PREFIX_BYTES))
}

#[test]
fn kvroute_follows_eds_as_pods_are_added_removed_and_replaced() {
    // Sims 0 and 1 are members; 2 and 3 come later.
    let cluster = Membership::start(4, 2, "kvroute_pods");
    let ms = |since: Instant, at: Instant| at.duration_since(since).as_millis();
    let mut timings = Vec::new();

    // Added: sim 2 holds a prefix (sent to it directly) before it is a
    // member; once EDS lists it, kvroute has its report and routes that
    // prefix to it.
    cluster.prime(2, &prompt("pod two", "q0"));
    let before = cluster.index_blocks();
    let changed = cluster.set_members(&[0, 1, 2]);
    let known = cluster.wait_pods_changed(&[2], &[]);
    timings.push(("add: pods_changed", ms(changed, known)));
    cluster.wait_index(before + PREFIX_BLOCKS, false);
    timings.push((
        "add: its blocks in the index gauge",
        ms(changed, Instant::now()),
    ));
    for i in 1..=5 {
        let (pod, matched) = cluster.route(&prompt("pod two", &format!("q{i}")));
        assert_eq!(pod, cluster.sims[2].id, "follow-up {i} on the new member");
        assert!(matched > 0.9, "follow-up {i}: cache match {matched}");
    }

    // Removed: sim 1 holds a prefix kvroute knows; after EDS drops it,
    // kvroute drops its blocks and sends it nothing, the prefix included.
    let before = cluster.index_blocks();
    cluster.prime(1, &prompt("pod one", "q0"));
    let with_one = cluster.wait_index(before + PREFIX_BLOCKS, false);
    let one_served = cluster.sims[1].requests();
    let changed = cluster.set_members(&[0, 2]);
    let known = cluster.wait_pods_changed(&[], &[1]);
    timings.push(("remove: pods_changed", ms(changed, known)));
    let without_one = cluster.wait_index(with_one - PREFIX_BLOCKS + 1.0, true);
    assert!(
        with_one - without_one >= PREFIX_BLOCKS,
        "its blocks left the index: {with_one} -> {without_one}"
    );
    for i in 1..=5 {
        let (pod, _) = cluster.route(&prompt("pod one", &format!("q{i}")));
        assert_ne!(pod, cluster.sims[1].id, "request {i} went to a removed pod");
    }
    assert_eq!(cluster.sims[1].requests(), one_served, "no traffic to it");

    // Replaced in one update: sim 0 (holding a prefix) out, sim 3 (empty)
    // in. Sim 0's blocks leave the index; sim 3 is routed to.
    let before = cluster.index_blocks();
    cluster.prime(0, &prompt("pod zero", "q0"));
    let with_zero = cluster.wait_index(before + PREFIX_BLOCKS, false);
    let zero_served = cluster.sims[0].requests();
    let changed = cluster.set_members(&[3, 2]);
    let known = cluster.wait_pods_changed(&[3], &[0]);
    timings.push(("replace: pods_changed", ms(changed, known)));
    let without_zero = cluster.wait_index(with_zero - PREFIX_BLOCKS + 1.0, true);
    assert!(
        with_zero - without_zero >= PREFIX_BLOCKS,
        "the replaced pod's blocks left the index: {with_zero} -> {without_zero}"
    );
    cluster.prime(3, &prompt("pod three", "q0"));
    cluster.wait_index(without_zero + PREFIX_BLOCKS, false);
    let (pod, matched) = cluster.route(&prompt("pod three", "q1"));
    assert_eq!(pod, cluster.sims[3].id, "the replacement is routed to");
    assert!(matched > 0.9, "cache match {matched}");
    let (pod, _) = cluster.route(&prompt("pod zero", "q1"));
    assert_ne!(pod, cluster.sims[0].id);
    assert_eq!(cluster.sims[0].requests(), zero_served, "no traffic to it");

    // Envoy agrees: two members, every request one attempt to a member.
    assert_eq!(
        cluster.envoy_stat("cluster.kvroute_pods.membership_total"),
        2
    );
    assert_eq!(
        cluster.envoy_stat("cluster.kvroute_pods.upstream_rq_retry"),
        0
    );
    eprintln!("from the EDS file's rename, ms: {timings:?}");
}

#[test]
fn a_membership_cluster_envoy_does_not_have_is_reported_not_an_empty_pod_set() {
    let cluster = Membership::start(1, 1, "no_such_cluster");
    cluster.wait_for("the warning", || {
        cluster
            .envoy
            .log()
            .contains("pod discovery ignored: Envoy has no cluster \"no_such_cluster\"")
            .then_some(())
    });
    std::thread::sleep(Duration::from_millis(3 * INTERVAL_MS));
    assert!(events(&cluster.envoy.log(), "pods_changed").is_empty());
    let id = label(&cluster.sims[0].id);
    assert_eq!(
        cluster
            .envoy
            .metric("epp_pod_health_score", &[("pod", &id)]),
        None
    );
}

/// A pool at the ceiling: EDS lists 1,024 endpoints at once (one
/// kvroute-sim process serving them all), and kvroute's pods become those
/// members within one report round of the file's rename, each published,
/// routed to, and asked for its report.
#[test]
fn a_membership_of_1024_endpoints_reconciles_within_one_round() {
    const PODS: usize = 1024;
    let cluster = Membership::start_with(PODS, 0, "kvroute_pods", true);
    std::thread::sleep(Duration::from_millis(2 * INTERVAL_MS));
    let all: Vec<usize> = (0..PODS).collect();
    let changed = cluster.set_members(&all);
    let known = cluster.wait_for("pods_changed adding every endpoint", || {
        events(&cluster.envoy.log(), "pods_changed")
            .iter()
            .any(|e| e["added"].as_array().map(Vec::len) == Some(PODS))
            .then(Instant::now)
    });
    let reconciled_ms = known.duration_since(changed).as_millis();
    // Every member published (its gauges go out 64 pods a tick).
    let published = cluster.wait_for("every member's health gauge", || {
        let page = cluster.envoy.prometheus();
        let count = page
            .lines()
            .filter(|l| l.starts_with("epp_pod_health_score{"))
            .count();
        (count >= PODS).then(Instant::now)
    });
    let published_ms = published.duration_since(changed).as_millis();
    eprintln!(
        "1,024 EDS endpoints: pods_changed {reconciled_ms} ms, every pod's gauges {published_ms} ms after the rename ({INTERVAL_MS} ms rounds)"
    );
    // Envoy's side of the rename takes a few ms; a round starts within
    // INTERVAL_MS of it; reading, parsing and reconciling 1,024 hosts
    // (~0.8 MB of admin JSON) takes a few ms more.
    assert!(
        reconciled_ms <= u128::from(INTERVAL_MS) + 250,
        "reconciled {reconciled_ms} ms after the rename, more than one {INTERVAL_MS} ms round"
    );
    assert_eq!(
        cluster.envoy_stat("cluster.kvroute_pods.membership_total"),
        PODS as u64
    );
    // Requests reach members, and every member gets its long-poll.
    for i in 0..8 {
        let (pod, _) = cluster.route(&prompt("pool", &format!("q{i}")));
        assert!(cluster.sims.iter().any(|s| s.id == pod), "{pod}");
    }
    let asked = cluster.wait_for("a report call to every member", || {
        let asked = cluster
            .sims
            .iter()
            .filter(|s| s.stats()["reportRequests"].as_u64().unwrap_or(0) > 0)
            .count();
        (asked == PODS).then_some(asked)
    });
    assert_eq!(asked, PODS);
}
