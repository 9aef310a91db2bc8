//! `--sweep`: the kvroute policy over a grid of weights and `maxQueue`,
//! ranked by an objective.
//!
//! Spec: `w_cache=0.4:0.8:0.1,maxQueue=8,20,40` — one or two parameters,
//! each a comma list of values and/or inclusive `start:end:step` ranges; a
//! token with `=` starts the next parameter. Parameters:
//! - `w_cache`: the cache weight. The other weights (load, queue, health,
//!   adapter and any attribute scorers) keep their proportions and are
//!   scaled to sum to `1 − w_cache` (with the defaults 0.2/0.1/0.05/0.05,
//!   `w_cache = 0.8` gives load 0.1, queue 0.05, health 0.025, adapter 0.025);
//! - `maxQueue`: the queue-exclusion threshold (an integer ≥ 1).

use std::fmt;

use kvroute::config::Config;

use super::engine::{simulate, PodSpec, Policy, Summary};
use super::workload::Workload;

/// A swept parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param {
    WCache,
    MaxQueue,
}

impl Param {
    pub fn name(self) -> &'static str {
        match self {
            Param::WCache => "w_cache",
            Param::MaxQueue => "maxQueue",
        }
    }

    fn parse(name: &str) -> Result<Param, String> {
        match name.trim() {
            "w_cache" => Ok(Param::WCache),
            "maxQueue" | "max_queue" => Ok(Param::MaxQueue),
            other => Err(format!(
                "unknown sweep parameter {other:?} (known: w_cache, maxQueue)"
            )),
        }
    }

    /// A value as printed in tables.
    pub fn format(self, value: f64) -> String {
        match self {
            Param::WCache => format!("{value:.2}"),
            Param::MaxQueue => format!("{value:.0}"),
        }
    }
}

/// One swept parameter and its values.
#[derive(Debug, Clone, PartialEq)]
pub struct Axis {
    pub param: Param,
    pub values: Vec<f64>,
}

/// A parsed `--sweep` spec: one or two axes.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepSpec {
    pub axes: Vec<Axis>,
}

impl SweepSpec {
    pub fn parse(spec: &str) -> Result<SweepSpec, String> {
        let mut axes: Vec<Axis> = Vec::new();
        for token in spec.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let values = match token.split_once('=') {
                Some((name, values)) => {
                    let param = Param::parse(name)?;
                    if axes.iter().any(|a| a.param == param) {
                        return Err(format!("sweep parameter {} given twice", param.name()));
                    }
                    axes.push(Axis {
                        param,
                        values: Vec::new(),
                    });
                    values
                }
                None => token,
            };
            let axis = axes
                .last_mut()
                .ok_or_else(|| format!("sweep value {token:?} comes before any `name=`"))?;
            axis.values.extend(parse_values(values)?);
        }
        if axes.is_empty() || axes.len() > 2 {
            return Err(
                "a sweep needs one or two parameters, e.g. w_cache=0.4:0.8:0.1,maxQueue=8,20,40"
                    .into(),
            );
        }
        for axis in &mut axes {
            if axis.values.is_empty() {
                return Err(format!(
                    "sweep parameter {} has no values",
                    axis.param.name()
                ));
            }
            for &v in &axis.values {
                match axis.param {
                    Param::WCache if !(0.0..=1.0).contains(&v) => {
                        return Err(format!("w_cache value {v} is outside [0, 1]"))
                    }
                    Param::MaxQueue if v < 1.0 || v.fract() != 0.0 || v > f64::from(u32::MAX) => {
                        return Err(format!("maxQueue value {v} is not an integer >= 1"))
                    }
                    _ => {}
                }
            }
            axis.values.dedup();
        }
        Ok(SweepSpec { axes })
    }

    /// Every grid point, the first axis varying slowest.
    pub fn points(&self) -> Vec<Point> {
        let second: Vec<Option<f64>> = match self.axes.get(1) {
            Some(axis) => axis.values.iter().copied().map(Some).collect(),
            None => vec![None],
        };
        let mut points = Vec::new();
        for &x in &self.axes[0].values {
            for &y in &second {
                let mut point = Point::default();
                point.set(self.axes[0].param, x);
                if let (Some(axis), Some(y)) = (self.axes.get(1), y) {
                    point.set(axis.param, y);
                }
                points.push(point);
            }
        }
        points
    }
}

fn parse_values(text: &str) -> Result<Vec<f64>, String> {
    let number = |s: &str| -> Result<f64, String> {
        s.trim()
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite())
            .ok_or_else(|| format!("sweep value {s:?} is not a number"))
    };
    let parts: Vec<&str> = text.split(':').collect();
    match parts.as_slice() {
        [single] => Ok(vec![number(single)?]),
        [start, end, step] => {
            let (start, end, step) = (number(start)?, number(end)?, number(step)?);
            if step <= 0.0 || end < start {
                return Err(format!(
                    "sweep range {text:?} needs start <= end and a positive step"
                ));
            }
            let count = ((end - start) / step + 1e-9).floor() as usize + 1;
            if count > 1000 {
                return Err(format!("sweep range {text:?} has more than 1000 values"));
            }
            // Rounded to 1e-9 so 0.4 + 3 × 0.1 prints and compares as 0.7.
            Ok((0..count)
                .map(|i| ((start + i as f64 * step) * 1e9).round() / 1e9)
                .collect())
        }
        _ => Err(format!(
            "sweep value {text:?} must be a number or start:end:step"
        )),
    }
}

/// One grid point (unset parameters keep the base configuration's value).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Point {
    pub w_cache: Option<f64>,
    pub max_queue: Option<u32>,
}

impl Point {
    fn set(&mut self, param: Param, value: f64) {
        match param {
            Param::WCache => self.w_cache = Some(value),
            Param::MaxQueue => self.max_queue = Some(value as u32),
        }
    }

    pub fn get(&self, param: Param) -> Option<f64> {
        match param {
            Param::WCache => self.w_cache,
            Param::MaxQueue => self.max_queue.map(f64::from),
        }
    }

    /// `base` with this point's values; see the module documentation for
    /// how the other weights are rescaled.
    pub fn apply(&self, base: &Config) -> Result<Config, String> {
        let mut config = base.clone();
        if let Some(max_queue) = self.max_queue {
            config.max_queue = max_queue;
        }
        if let Some(cache) = self.w_cache {
            let w = &mut config.weights;
            let others = w.load
                + w.queue
                + w.health
                + w.adapter
                + config
                    .attribute_scorers
                    .iter()
                    .map(|s| s.weight)
                    .sum::<f64>();
            if others <= 0.0 && cache < 1.0 {
                return Err(format!(
                    "w_cache={cache}: the other weights are all 0, nothing to rescale"
                ));
            }
            let scale = if others > 0.0 {
                (1.0 - cache) / others
            } else {
                0.0
            };
            w.cache = cache;
            w.load *= scale;
            w.queue *= scale;
            w.health *= scale;
            w.adapter *= scale;
            for scorer in &mut config.attribute_scorers {
                scorer.weight *= scale;
            }
        }
        config.validate().map_err(|e| e.to_string())?;
        Ok(config)
    }
}

/// What the sweep optimises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Objective {
    TtftP99,
    TtftP50,
    HitRate,
}

impl Objective {
    pub fn parse(name: &str) -> Result<Objective, String> {
        match name {
            "ttft_p99" => Ok(Objective::TtftP99),
            "ttft_p50" => Ok(Objective::TtftP50),
            "hit_rate" => Ok(Objective::HitRate),
            other => Err(format!(
                "unknown objective {other:?} (known: ttft_p99, ttft_p50, hit_rate)"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Objective::TtftP99 => "ttft_p99",
            Objective::TtftP50 => "ttft_p50",
            Objective::HitRate => "hit_rate",
        }
    }

    pub fn value(self, summary: &Summary) -> f64 {
        match self {
            Objective::TtftP99 => summary.ttft_p99_ms,
            Objective::TtftP50 => summary.ttft_p50_ms,
            Objective::HitRate => summary.hit_rate,
        }
    }

    pub fn higher_is_better(self) -> bool {
        self == Objective::HitRate
    }

    /// `a` strictly better than `b`.
    pub fn better(self, a: f64, b: f64) -> bool {
        if self.higher_is_better() {
            a > b
        } else {
            a < b
        }
    }

    /// Unit of [`Objective::value`].
    pub fn unit(self) -> &'static str {
        match self {
            Objective::HitRate => "",
            _ => " (ms)",
        }
    }
}

impl fmt::Display for Objective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One evaluated grid point.
#[derive(Debug, Clone)]
pub struct SweepResult {
    pub point: Point,
    pub config: Config,
    pub summary: Summary,
}

/// Runs the kvroute policy at every point of `spec` (on `jobs` threads;
/// the results do not depend on `jobs`). The index of the best point by
/// `objective` comes back with the results (the first one on ties).
pub fn run_sweep(
    workload: &Workload,
    pods: &PodSpec,
    base: &Config,
    spec: &SweepSpec,
    objective: Objective,
    seed: u64,
    jobs: usize,
) -> Result<(Vec<SweepResult>, usize), String> {
    let configs: Vec<(Point, Config)> = spec
        .points()
        .into_iter()
        .map(|p| p.apply(base).map(|c| (p, c)))
        .collect::<Result<_, _>>()?;
    let jobs = jobs.clamp(1, configs.len().max(1));
    let mut summaries: Vec<Option<Summary>> = vec![None; configs.len()];
    std::thread::scope(|scope| {
        let chunks: Vec<_> = summaries
            .chunks_mut(configs.len().div_ceil(jobs))
            .zip(configs.chunks(configs.len().div_ceil(jobs)))
            .map(|(out, input)| {
                scope.spawn(move || {
                    for (slot, (_, config)) in out.iter_mut().zip(input) {
                        *slot =
                            Some(simulate(workload, pods, Policy::Kvroute, config, seed).summary);
                    }
                })
            })
            .collect();
        for handle in chunks {
            handle.join().expect("sweep worker panicked");
        }
    });
    let results: Vec<SweepResult> = configs
        .into_iter()
        .zip(summaries)
        .map(|((point, config), summary)| SweepResult {
            point,
            config,
            summary: summary.expect("every point ran"),
        })
        .collect();
    let mut best = 0;
    for (i, r) in results.iter().enumerate() {
        if objective.better(
            objective.value(&r.summary),
            objective.value(&results[best].summary),
        ) {
            best = i;
        }
    }
    Ok((results, best))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ranges_lists_and_pairs() {
        let spec = SweepSpec::parse("w_cache=0.4:0.8:0.1,maxQueue=8,20,40").unwrap();
        assert_eq!(spec.axes[0].values, vec![0.4, 0.5, 0.6, 0.7, 0.8]);
        assert_eq!(spec.axes[1].values, vec![8.0, 20.0, 40.0]);
        assert_eq!(spec.points().len(), 15);
        assert_eq!(spec.points()[1].max_queue, Some(20));
        let one = SweepSpec::parse("maxQueue=4").unwrap();
        assert_eq!(
            one.points(),
            vec![Point {
                w_cache: None,
                max_queue: Some(4)
            }]
        );
        for bad in [
            "",
            "x=1",
            "w_cache=2",
            "maxQueue=0.5",
            "5,w_cache=1",
            "w_cache=0.8:0.4:0.1",
            "w_cache=1,w_cache=2",
            "a=1,b=2,c=3",
        ] {
            assert!(SweepSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn other_weights_keep_their_proportions() {
        let base = Config {
            pods: super::super::engine::sim_pods(2),
            ..Config::default()
        };
        let point = Point {
            w_cache: Some(0.8),
            max_queue: Some(8),
        };
        let config = point.apply(&base).unwrap();
        let w = &config.weights;
        assert!((w.load - 0.1).abs() < 1e-12 && (w.queue - 0.05).abs() < 1e-12);
        assert!((w.health - 0.025).abs() < 1e-12 && (w.adapter - 0.025).abs() < 1e-12);
        assert_eq!(config.max_queue, 8);
    }
}
