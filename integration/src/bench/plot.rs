//! PNG charts of the results (plotters, text in DejaVu Sans embedded from
//! the `dejavu` crate): hit rate and TTFT p50 by policy (kvroute, the peer
//! routers, Envoy's balancers), TTFT CDFs, one panel per workload, and
//! the load sweep's TTFT p90 against offered load.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::FontStyle;
use serde_json::Value;

use super::stack::POLICIES;
use super::workload::WORKLOADS;

/// One colour per policy of [`POLICIES`]: kvroute blues, peers reds and
/// purples, Envoy's balancers greens and yellows.
pub const COLORS: [RGBColor; 10] = [
    RGBColor(0, 114, 178),
    RGBColor(86, 180, 233),
    RGBColor(200, 30, 30),
    RGBColor(240, 130, 120),
    RGBColor(120, 50, 160),
    RGBColor(190, 150, 220),
    RGBColor(213, 94, 0),
    RGBColor(230, 159, 0),
    RGBColor(204, 121, 167),
    RGBColor(0, 158, 115),
];
const POOLED: RGBColor = RGBColor(70, 70, 70);
const INFINITE: RGBColor = RGBColor(170, 170, 170);

/// Registers DejaVu Sans as `sans-serif` (once per process).
pub fn fonts() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
    });
}

type Error = Box<dyn std::error::Error>;

/// One panel: its title and its bars (label, value, color).
type Panel = (String, Vec<(String, f64, RGBColor)>);

/// The measured row of policy `name` (unavailable rows have no figures).
fn policy_of<'a>(w: &'a Value, name: &str) -> Option<&'a Value> {
    w["policies"]
        .as_array()?
        .iter()
        .find(|p| p["policy"] == name && p.get("unavailable").is_none())
}

/// Canvas size and panel grid: one panel per workload, two per row.
const SIZE: (u32, u32) = (1600, 1500);
const GRID: (usize, usize) = (3, 2);

fn present(workloads: &Value) -> Vec<(&'static str, &Value)> {
    WORKLOADS
        .iter()
        .filter_map(|n| workloads.get(*n).map(|w| (*n, w)))
        .collect()
}

/// A bar chart per workload: one bar per (label, value, color).
fn bars(
    path: &Path,
    title: &str,
    y_desc: &str,
    panels: &[Panel],
    format: &dyn Fn(f64) -> String,
) -> Result<(), Error> {
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 26))?;
    let cells = root.split_evenly(GRID);
    for (area, (name, values)) in cells.iter().zip(panels) {
        // Headroom above the tallest bar keeps its value label clear of the
        // legend (one line per bar).
        let top = values.iter().map(|v| v.1).fold(0.0, f64::max).max(1e-9) * 2.6;
        let mut chart = ChartBuilder::on(area)
            .caption(name, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(10)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..values.len() as f64, 0f64..top)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_desc(y_desc)
            .y_label_formatter(&|v| format(*v))
            .label_style(("sans-serif", 14))
            .draw()?;
        for (i, (label, value, color)) in values.iter().enumerate() {
            let x = i as f64;
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(x + 0.12, 0.0), (x + 0.88, *value)],
                    color.filled(),
                )))?
                .label(label.clone())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled())
                });
            chart.draw_series(std::iter::once(Text::new(
                format(*value),
                (x + 0.14, *value + top * 0.06),
                ("sans-serif", 13),
            )))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .label_font(("sans-serif", 12))
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// Hit rate by policy, with the two bounds.
pub fn hit_rate(path: &Path, workloads: &Value) -> Result<(), Error> {
    fonts();
    let panels: Vec<Panel> = present(workloads)
        .into_iter()
        .map(|(name, w)| {
            let mut values: Vec<(String, f64, RGBColor)> = POLICIES
                .iter()
                .zip(COLORS)
                .filter_map(|(p, c)| {
                    policy_of(w, p)
                        .map(|r| (p.to_string(), r["hitRate"].as_f64().unwrap_or(0.0), c))
                })
                .collect();
            values.push((
                "pooled LRU bound".into(),
                w["bounds"]["pooledLru"].as_f64().unwrap_or(0.0),
                POOLED,
            ));
            values.push((
                "infinite cache".into(),
                w["bounds"]["infinite"].as_f64().unwrap_or(0.0),
                INFINITE,
            ));
            (name.to_string(), values)
        })
        .collect();
    bars(
        path,
        "Token-weighted prefix cache hit rate",
        "hit rate",
        &panels,
        &|v| format!("{:.0}%", v * 100.0),
    )
}

/// TTFT p50 by policy.
pub fn ttft_p50(path: &Path, workloads: &Value) -> Result<(), Error> {
    fonts();
    let panels: Vec<Panel> = present(workloads)
        .into_iter()
        .map(|(name, w)| {
            let values = POLICIES
                .iter()
                .zip(COLORS)
                .filter_map(|(p, c)| {
                    policy_of(w, p)
                        .map(|r| (p.to_string(), r["ttftMs"]["p50"].as_f64().unwrap_or(0.0), c))
                })
                .collect();
            (name.to_string(), values)
        })
        .collect();
    bars(path, "TTFT p50 (ms, client-side)", "ms", &panels, &|v| {
        format!("{v:.0}")
    })
}

/// TTFT CDFs, log-scaled time axis.
pub fn ttft_cdf(path: &Path, workloads: &Value) -> Result<(), Error> {
    fonts();
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled("TTFT CDF (client-side)", ("sans-serif", 26))?;
    let cells = root.split_evenly(GRID);
    for (area, (name, w)) in cells.iter().zip(present(workloads)) {
        let series: Vec<(&str, Vec<f64>, RGBColor)> = POLICIES
            .iter()
            .zip(COLORS)
            .filter_map(|(p, c)| {
                let q: Vec<f64> = policy_of(w, p)?["ttftQuantilesMs"]
                    .as_array()?
                    .iter()
                    .filter_map(Value::as_f64)
                    .collect();
                (!q.is_empty()).then_some((*p, q, c))
            })
            .collect();
        let lo = series
            .iter()
            .flat_map(|s| s.1.first().copied())
            .fold(f64::INFINITY, f64::min)
            .max(0.1)
            * 0.8;
        let hi = series
            .iter()
            .flat_map(|s| s.1.last().copied())
            .fold(1.0, f64::max)
            * 1.2;
        let mut chart = ChartBuilder::on(area)
            .caption(name, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d((lo.min(hi / 2.0)..hi).log_scale(), 0f64..1.0)?;
        chart
            .configure_mesh()
            .x_desc("TTFT ms (log)")
            .y_desc("fraction of requests")
            .label_style(("sans-serif", 14))
            .draw()?;
        for (policy, q, color) in series {
            let n = q.len() as f64;
            let points: Vec<(f64, f64)> = q
                .iter()
                .enumerate()
                .map(|(i, &v)| (v.max(lo), (i + 1) as f64 / n))
                .collect();
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(3)))?
                .label(policy)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(3))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .label_font(("sans-serif", 12))
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// One policy's line: its name, its (x, y) points and its colour.
type Line<'a> = (&'a str, Vec<(f64, f64)>, RGBColor);

/// Load sweep: TTFT p90 against offered load (log scale), one line per
/// policy of [`POLICIES`] in its colour, the sustain target dashed.
pub fn ttft_p90_by_load(path: &Path, rows: &[Value], target_ms: f64) -> Result<(), Error> {
    fonts();
    let series: Vec<Line> = POLICIES
        .iter()
        .zip(COLORS)
        .filter_map(|(p, c)| {
            let line: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r["policy"] == *p)
                .filter_map(|r| Some((r["load"].as_f64()?, r["ttftMs"]["p90"].as_f64()?)))
                .collect();
            (!line.is_empty()).then_some((*p, line, c))
        })
        .collect();
    let points = || series.iter().flat_map(|s| s.1.iter().copied());
    let (lo, hi) = points().fold((f64::INFINITY, 0.0f64), |(lo, hi), (x, _)| {
        (lo.min(x), hi.max(x))
    });
    let (lo, hi) = if lo < hi { (lo, hi) } else { (0.0, 1.0) };
    let (ymin, ymax) = points().fold(
        (target_ms.max(1.0), target_ms.max(1.0)),
        |(a, b), (_, y)| (a.min(y.max(1.0)), b.max(y)),
    );
    let root = BitMapBackend::new(path, (1000, 640)).into_drawing_area();
    root.fill(&WHITE)?;
    let pad = (hi - lo) * 0.04;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "TTFT p90 vs offered load (trace, real Envoy)",
            ("sans-serif", 22),
        )
        .margin(14)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(lo - pad..hi + pad, (ymin * 0.8..ymax * 1.25).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("offered load (× cache-blind capacity)")
        .y_desc("TTFT p90 ms (log)")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style(("sans-serif", 14))
        .draw()?;
    chart
        .draw_series(DashedLineSeries::new(
            [(lo - pad, target_ms), (hi + pad, target_ms)],
            8,
            6,
            POOLED.stroke_width(2),
        ))?
        .label(format!("sustain target ({target_ms:.0} ms)"))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], POOLED.stroke_width(2)));
    for (policy, line, color) in series {
        chart
            .draw_series(LineSeries::new(line.clone(), color.stroke_width(3)))?
            .label(policy)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(3))
            });
        chart.draw_series(line.into_iter().map(|p| Circle::new(p, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", 13))
        .draw()?;
    root.present()?;
    Ok(())
}
