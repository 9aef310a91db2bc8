//! Load sweep: every policy at a range of offered loads, to see where each
//! one stops coping.
//!
//! A load is a share of the trace's *cache-blind capacity*: the request rate
//! at which pods that never hit their caches would keep their prefill
//! engines (or sequence slots) just busy ([`crate::bench::workload::capacity`],
//! the figure the real-Envoy benchmark offers its loads against). At load
//! `L` the trace's timestamps are divided so that it arrives at `L ×`
//! capacity. Per load and policy: hit rate (and its share of the
//! pooled-cache bound), TTFT p50/p90/p99, 503s answered, the wait before
//! a request is sent to a pod (gateway waiting and retries, p50/p99) and
//! max pod share.
//! A policy *sustains* a load while its TTFT p90 stays within the target
//! (2 s at time scale 1, scaled with `--time-scale`); the highest load each
//! sustains is reported as a ratio to round robin's.

use std::fmt::Write as _;
use std::path::Path;

use kvroute::config::Config;
use plotters::prelude::*;
use serde_json::{json, Value};

use super::engine::{simulate, PodSpec, Policy, Summary};
use super::workload::Workload;
use crate::bench::plot::{fonts, COLORS};
use crate::bench::workload::capacity;

/// TTFT p90 a policy must keep to sustain a load, at time scale 1.
pub const SUSTAINED_P90_MS: f64 = 2000.0;

/// One policy at one load.
#[derive(Debug, Clone)]
pub struct LoadPoint {
    /// Offered load, as a share of the cache-blind capacity.
    pub load: f64,
    /// What the trace's timestamps were divided by.
    pub speedup: f64,
    pub policy: Policy,
    pub summary: Summary,
}

/// Requests per second the cluster serves with no cache hit.
pub fn cache_blind_rps(workload: &Workload, pods: &PodSpec, time_scale: f64) -> f64 {
    let pairs: Vec<(u64, u64)> = workload
        .requests
        .iter()
        .map(|r| (r.prompt_tokens, r.output_tokens.max(1)))
        .collect();
    let mean_speed = (0..pods.count)
        .map(|pod| pods.prefill_speeds.get(pod).copied().unwrap_or(1.0))
        .sum::<f64>()
        / pods.count.max(1) as f64;
    capacity(&pairs, time_scale, pods.count, pods.max_batch) * mean_speed
}

/// The trace's own request rate (requests per second of trace time).
fn native_rps(workload: &Workload) -> f64 {
    let first = workload.requests.first().map_or(0, |r| r.arrival_us);
    let last = workload.requests.last().map_or(0, |r| r.arrival_us);
    workload.requests.len() as f64 / ((last - first).max(1) as f64 / 1e6)
}

/// Runs every policy at every load. `workload` is the trace at speedup 1.
pub fn run(
    workload: &Workload,
    pods: &PodSpec,
    policies: &[Policy],
    config: &Config,
    seed: u64,
    loads: &[f64],
    time_scale: f64,
) -> Vec<LoadPoint> {
    let capacity = cache_blind_rps(workload, pods, time_scale);
    let native = native_rps(workload);
    let mut points = Vec::new();
    for &load in loads {
        let speedup = capacity * load / native;
        let mut scaled = workload.clone();
        for r in &mut scaled.requests {
            r.arrival_us = (r.arrival_us as f64 / speedup) as u64;
        }
        for &policy in policies {
            let run = simulate(&scaled, pods, policy, config, seed);
            points.push(LoadPoint {
                load,
                speedup,
                policy,
                summary: run.summary,
            });
        }
    }
    points
}

/// The highest load `policy` sustains (TTFT p90 within `target_ms` at it
/// and at every lower load), if any.
pub fn sustained(points: &[LoadPoint], policy: Policy, target_ms: f64) -> Option<f64> {
    let mut best = None;
    let mut loads: Vec<&LoadPoint> = points.iter().filter(|p| p.policy == policy).collect();
    loads.sort_by(|a, b| a.load.total_cmp(&b.load));
    for point in loads {
        if point.summary.ttft_p90_ms > target_ms {
            break;
        }
        best = Some(point.load);
    }
    best
}

fn policies_of(points: &[LoadPoint]) -> Vec<Policy> {
    let mut policies: Vec<Policy> = points.iter().map(|p| p.policy).collect();
    policies.sort();
    policies.dedup();
    policies
}

/// The sweep as Markdown: one row per load and policy, then the sustained
/// loads.
pub fn markdown(points: &[LoadPoint], pooled_bound: f64, target_ms: f64) -> String {
    let mut out = String::from(
        "| load | policy | hit rate | % of pooled bound | TTFT p50 | TTFT p90 | TTFT p99 | 503s | wait p50 | wait p99 | max pod share | TTFT model error p50 |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for p in points {
        let s = &p.summary;
        let _ = writeln!(
            out,
            "| {:.2}× | {} | {:.1} % | {:.0} % | {} | {} | {} | {} | {} | {} | {:.1} % | {} |",
            p.load,
            p.policy.name(),
            s.hit_rate * 100.0,
            s.hit_rate / pooled_bound.max(1e-9) * 100.0,
            millis(s.ttft_p50_ms),
            millis(s.ttft_p90_ms),
            millis(s.ttft_p99_ms),
            s.rejections,
            millis(s.wait_p50_ms),
            millis(s.wait_p99_ms),
            s.max_pod_share * 100.0,
            s.prediction_error_p50
                .map_or("–".into(), |e| format!("{:.0} %", e * 100.0))
        );
    }
    let baseline = sustained(points, Policy::RoundRobin, target_ms);
    let _ = write!(
        out,
        "\nHighest load sustained with TTFT p90 ≤ {} (ratio to round robin's):\n\n| policy | load | ratio |\n|---|---:|---:|\n",
        millis(target_ms)
    );
    for policy in policies_of(points) {
        let load = sustained(points, policy, target_ms);
        let ratio = match (load, baseline) {
            (Some(l), Some(b)) if b > 0.0 => format!("{:.2}×", l / b),
            _ => "–".into(),
        };
        let load = load.map_or("none".into(), |l| format!("{l:.2}×"));
        let _ = writeln!(out, "| {} | {load} | {ratio} |", policy.name());
    }
    out
}

fn millis(ms: f64) -> String {
    if ms >= 10_000.0 {
        format!("{:.0} s", ms / 1000.0)
    } else if ms >= 1000.0 {
        format!("{:.1} s", ms / 1000.0)
    } else {
        format!("{ms:.0} ms")
    }
}

/// The sweep as JSON rows.
pub fn json(points: &[LoadPoint], pooled_bound: f64, target_ms: f64) -> Value {
    let rows: Vec<Value> = points
        .iter()
        .map(|p| {
            let s = &p.summary;
            json!({"load": p.load, "speedup": p.speedup, "policy": p.policy.name(),
                   "hitRate": s.hit_rate, "ofPooledBound": s.hit_rate / pooled_bound.max(1e-9),
                   "ttftP50Ms": s.ttft_p50_ms, "ttftP90Ms": s.ttft_p90_ms, "ttftP99Ms": s.ttft_p99_ms,
                   "rejections": s.rejections, "waitP50Ms": s.wait_p50_ms, "waitP99Ms": s.wait_p99_ms,
                   "maxPodShare": s.max_pod_share, "ttftPredictionErrorP50": s.prediction_error_p50})
        })
        .collect();
    let sustained: serde_json::Map<String, Value> = policies_of(points)
        .into_iter()
        .map(|p| (p.name().to_string(), json!(sustained(points, p, target_ms))))
        .collect();
    json!({"pooledBound": pooled_bound, "sustainedP90TargetMs": target_ms, "points": rows, "sustainedLoad": sustained})
}

/// TTFT p90 against offered load, one line per policy (log scale).
pub fn chart(points: &[LoadPoint], path: &Path, title: &str) -> Result<(), String> {
    fonts();
    let error = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| error(&e))?;
    let (lo, hi) = points.iter().fold((f64::MAX, 0.0f64), |(lo, hi), p| {
        (lo.min(p.load), hi.max(p.load))
    });
    let (ymin, ymax) = points
        .iter()
        .map(|p| p.summary.ttft_p90_ms.max(1.0))
        .fold((f64::MAX, 1.0f64), |(a, b), v| (a.min(v), b.max(v)));
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(lo..hi, (ymin * 0.8..ymax * 1.25).log_scale())
        .map_err(|e| error(&e))?;
    chart
        .configure_mesh()
        .x_desc("offered load (× cache-blind capacity)")
        .y_desc("TTFT p90 (ms)")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| error(&e))?;
    for (i, policy) in policies_of(points).into_iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let line: Vec<(f64, f64)> = points
            .iter()
            .filter(|p| p.policy == policy)
            .map(|p| (p.load, p.summary.ttft_p90_ms.max(1.0)))
            .collect();
        chart
            .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))
            .map_err(|e| error(&e))?
            .label(policy.name())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart
            .draw_series(line.into_iter().map(|p| Circle::new(p, 3, color.filled())))
            .map_err(|e| error(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| error(&e))?;
    root.present().map_err(|e| error(&e))
}
