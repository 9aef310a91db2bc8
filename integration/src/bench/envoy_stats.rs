//! What `kvroute-bench` reads from Envoy's admin `/stats/prometheus`: one
//! metric's series (the page filtered to it), a counter's or gauge's value,
//! and a histogram's cumulative buckets summed over Envoys (replicas) with
//! a quantile taken from them as Prometheus's `histogram_quantile` does:
//! find the first bucket whose cumulative count reaches `q × count`, then
//! interpolate linearly between its lower and upper bound (the lowest
//! bucket starts at 0; a quantile in the `+Inf` bucket is the highest
//! finite bound). Envoy keeps a histogram's buckets, not its samples.

use crate::harness::{prometheus_value, Envoy};

/// The series matching `name`, rendered alone: a full `/stats/prometheus`
/// of 64 pods is itself a stall of the main thread the probe would measure.
pub fn filtered(envoy: &Envoy, name: &str) -> String {
    crate::http::get(&envoy.admin, &format!("/stats/prometheus?filter={name}"))
        .map(|r| r.body)
        .unwrap_or_default()
}

/// Counter or gauge `name`, summed over its series.
pub fn metric(envoy: &Envoy, name: &str) -> Option<f64> {
    prometheus_value(&filtered(envoy, name), name, &[])
}

/// Histogram `name`'s cumulative buckets over every Envoy in `envoys`
/// (see [`cumulative_buckets`]).
pub fn histogram(envoys: &[&Envoy], name: &str) -> Vec<(f64, f64)> {
    let pages: Vec<String> = envoys.iter().map(|e| filtered(e, name)).collect();
    cumulative_buckets(&pages, name)
}

/// Histogram `name`'s buckets in exposition `pages`, as (upper bound,
/// cumulative count) in bound order, each bound's counts summed over the
/// pages; the last is `+Inf` (every sample) when the pages have any.
pub fn cumulative_buckets(pages: &[String], name: &str) -> Vec<(f64, f64)> {
    let series = format!("{name}_bucket{{");
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for line in pages.iter().flat_map(|page| page.lines()) {
        let Some((labels, count)) = line
            .strip_prefix(&series)
            .and_then(|rest| rest.rsplit_once("} "))
        else {
            continue;
        };
        let bound = labels.split(',').find_map(|pair| {
            pair.strip_prefix("le=\"")?
                .strip_suffix('"')?
                .parse::<f64>()
                .ok()
        });
        let (Some(bound), Ok(count)) = (bound, count.trim().parse::<f64>()) else {
            continue;
        };
        match buckets.iter_mut().find(|(b, _)| *b == bound) {
            Some(bucket) => bucket.1 += count,
            None => buckets.push((bound, count)),
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    buckets
}

/// The `q` quantile (0 < q ≤ 1) of [`cumulative_buckets`]' buckets, as
/// Prometheus's `histogram_quantile` computes it (see the module
/// documentation); `None` without samples, or without the `+Inf` bucket
/// and a finite one.
pub fn histogram_quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let &(top, count) = buckets.last()?;
    if top != f64::INFINITY || count <= 0.0 || buckets.len() < 2 {
        return None;
    }
    let rank = q * count;
    let at = buckets.iter().position(|&(_, n)| n >= rank)?;
    let (lower, below) = match at {
        0 => (0.0, 0.0),
        _ => buckets[at - 1],
    };
    let (upper, reached) = buckets[at];
    if upper == f64::INFINITY {
        return Some(lower);
    }
    Some(lower + (upper - lower) * (rank - below) / (reached - below))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAME: &str = "epp_ttft_prediction_error_percent";

    /// Envoy's exposition of the histogram (its bucket bounds from
    /// envoy/envoy.template.yaml), 100 samples.
    const PAGE: &str = "\
# TYPE epp_ttft_prediction_error_percent histogram
epp_ttft_prediction_error_percent_bucket{le=\"5\"} 10
epp_ttft_prediction_error_percent_bucket{le=\"10\"} 30
epp_ttft_prediction_error_percent_bucket{le=\"15\"} 60
epp_ttft_prediction_error_percent_bucket{le=\"20\"} 80
epp_ttft_prediction_error_percent_bucket{le=\"30\"} 90
epp_ttft_prediction_error_percent_bucket{le=\"50\"} 95
epp_ttft_prediction_error_percent_bucket{le=\"75\"} 97
epp_ttft_prediction_error_percent_bucket{le=\"100\"} 98
epp_ttft_prediction_error_percent_bucket{le=\"200\"} 99
epp_ttft_prediction_error_percent_bucket{le=\"500\"} 99
epp_ttft_prediction_error_percent_bucket{le=\"+Inf\"} 100
epp_ttft_prediction_error_percent_sum 1523
epp_ttft_prediction_error_percent_count 100
# TYPE epp_replica_lag_ms histogram
epp_replica_lag_ms_bucket{le=\"5\"} 7
epp_replica_lag_ms_bucket{le=\"+Inf\"} 7
";

    fn pages(texts: &[&str]) -> Vec<String> {
        texts.iter().map(|t| t.to_string()).collect()
    }

    #[test]
    fn quantiles_interpolate_within_their_bucket() {
        let buckets = cumulative_buckets(&pages(&[PAGE]), NAME);
        assert_eq!(buckets.len(), 11, "only the histogram's own buckets");
        assert_eq!(buckets[10], (f64::INFINITY, 100.0));
        // Rank 50 falls in (10, 15], which holds samples 31..=60: 20 of its
        // 30 samples in, two thirds of the way up.
        let p50 = histogram_quantile(0.5, &buckets).unwrap();
        assert!((p50 - (10.0 + 5.0 * 20.0 / 30.0)).abs() < 1e-9, "{p50}");
        // The lowest bucket starts at 0.
        assert_eq!(histogram_quantile(0.05, &buckets), Some(2.5));
        // A rank on a bucket's count is that bucket's upper bound.
        assert_eq!(histogram_quantile(0.9, &buckets), Some(30.0));
        // Past the highest finite bound: that bound.
        assert_eq!(histogram_quantile(0.995, &buckets), Some(500.0));
    }

    #[test]
    fn replicas_buckets_add_up() {
        // A second replica whose 100 samples are all at most 5.
        let other: String = PAGE
            .lines()
            .filter(|line| line.starts_with(&format!("{NAME}_bucket")))
            .map(|line| format!("{} 100\n", line.rsplit_once(' ').unwrap().0))
            .collect();
        let buckets = cumulative_buckets(&pages(&[PAGE, &other]), NAME);
        assert_eq!(buckets[0], (5.0, 110.0));
        assert_eq!(buckets[1], (10.0, 130.0));
        assert_eq!(buckets.last(), Some(&(f64::INFINITY, 200.0)));
        // Rank 100 of 200 falls in [0, 5], which holds 110.
        let p50 = histogram_quantile(0.5, &buckets).unwrap();
        assert!((p50 - 5.0 * 100.0 / 110.0).abs() < 1e-9, "{p50}");
    }

    #[test]
    fn no_samples_no_quantile() {
        assert_eq!(histogram_quantile(0.5, &[]), None);
        let empty = "epp_ttft_prediction_error_percent_bucket{le=\"5\"} 0\n\
                     epp_ttft_prediction_error_percent_bucket{le=\"+Inf\"} 0\n";
        let buckets = cumulative_buckets(&pages(&[empty]), NAME);
        assert_eq!(histogram_quantile(0.5, &buckets), None);
        assert_eq!(cumulative_buckets(&pages(&[""]), NAME), Vec::new());
    }
}
