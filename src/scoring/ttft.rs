//! The predicted-TTFT model: how long a request would wait for its first
//! token on each pod, learned online from what the pods answer.
//!
//! ```text
//! work(pod)      = queued(pod) + uncached(pod)                          tokens
//! ttft(pod)      = overhead(pod) + work(pod) × time_per_token(pod)      ms
//! ```
//!
//! - `queued(pod)`: the prompt tokens still to prefill there, the uncached
//!   tokens of every request routed to it (all workers) from the decision
//!   until its first response byte ([`crate::snapshot::SlotLoad`]); a
//!   prefill engine works through them before it reaches this request.
//! - `uncached(pod)`: this request's own prompt tokens the pod does not
//!   cache (the re-prefill a cache miss costs).
//!   A prefix the pod holds outside GPU memory adds its reload, in prefill
//!   tokens (`tierCredits`, [`super::factors::CachedPrefix`]).
//! - `time_per_token` and `overhead`, per pod: an exponentially weighted
//!   least-squares line through the pod's last `balance.learningWindow`
//!   answers, `(work at the decision, observed TTFT)`: what the pod did
//!   with the work it was given. No speed is configured: a pod twice as
//!   fast shows half the slope within a few answers, so a mixed pool gets
//!   load in proportion to speed. The overhead (scheduling, sampling, the
//!   network and the proxy) is the line's intercept.
//!
//! Until a pod's own answers spread enough to fit a line (a steady load
//! gives work within a few per cent of its mean), its slope is its mean
//! TTFT less the pool's overhead over its mean work; a pod with no answer
//! yet takes the pool's line; a pool with no answer at all predicts in
//! tokens (overhead 0, one unit a token), which orders the pods the same
//! way while they are alike.
//!
//! **Its error is its margin.** Each answer is first predicted, and the
//! relative error `|predicted − actual| / actual` is averaged over the same
//! window, starting from a prior of [`PRIOR_ERROR`] worth
//! [`PRIOR_ERROR_SAMPLES`] answers (an uncalibrated model is trusted only
//! for a factor of two). Two predictions are told apart only when their
//! error bands do not overlap, `fast × (1 + e) < slow × (1 − e)`
//! ([`TtftModel::clearly_faster`]): so the cache is moved off a pod only
//! when another pod is faster by more than the model's own error.
//!
//! Every worker of every replica learns from the same answers, the
//! gateway's whole stream of first bytes ([`super::answers`]), so their
//! lines and errors agree; the queued tokens are already every worker's
//! and every replica's. Only the busy share ([`TtftModel::busy`]) is
//! each worker's own: a time average of the same shared queues.

/// Relative error assumed before the model has answers to measure it on:
/// a third, so that an uncalibrated model tells two pods apart only when
/// one has twice the other's work, `(1 + ⅓) / (1 − ⅓) = 2` (what the
/// prefill guard's ratio of 2 was measured to need, see docs/design.md).
pub const PRIOR_ERROR: f64 = 1.0 / 3.0;

/// How many answers the prior error weighs.
pub const PRIOR_ERROR_SAMPLES: f64 = 4.0;

/// Default `balance.learningWindow`: answers per pod a fit remembers.
pub const DEFAULT_LEARNING_WINDOW: u32 = 64;

/// Least relative spread of the work (standard deviation over mean) for a
/// slope of the pod's own: below it, noise in the TTFTs decides the slope.
const MIN_RELATIVE_SPREAD: f64 = 0.1;

/// Fewest (weighted) answers a fit is used on.
const MIN_SAMPLES: f64 = 2.0;

/// Exponentially weighted sums of `(work, ttft)` pairs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Fit {
    weight: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

/// A fitted line: `ttft = overhead_ms + work × ms_per_token`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Line {
    pub overhead_ms: f64,
    pub ms_per_token: f64,
}

impl Line {
    /// Before any answer: tokens as the unit of time.
    pub const UNCALIBRATED: Line = Line {
        overhead_ms: 0.0,
        ms_per_token: 1.0,
    };

    pub fn predict(&self, work_tokens: f64) -> f64 {
        self.overhead_ms + work_tokens.max(0.0) * self.ms_per_token
    }

    /// Prefill tokens per second this line implies.
    pub fn tokens_per_s(&self) -> f64 {
        1000.0 / self.ms_per_token.max(f64::MIN_POSITIVE)
    }
}

impl Fit {
    fn add(&mut self, decay: f64, x: f64, y: f64) {
        self.weight = self.weight * decay + 1.0;
        self.x = self.x * decay + x;
        self.y = self.y * decay + y;
        self.xx = self.xx * decay + x * x;
        self.xy = self.xy * decay + x * y;
    }

    fn means(&self) -> Option<(f64, f64)> {
        (self.weight > 0.0).then(|| (self.x / self.weight, self.y / self.weight))
    }

    /// Its own least-squares line, when the work spread enough to fit one
    /// and the slope is positive.
    fn line(&self) -> Option<Line> {
        if self.weight < MIN_SAMPLES {
            return None;
        }
        let (mx, my) = self.means()?;
        let var = self.xx / self.weight - mx * mx;
        let cov = self.xy / self.weight - mx * my;
        if var <= (MIN_RELATIVE_SPREAD * mx).powi(2) || cov <= 0.0 {
            return None;
        }
        let slope = cov / var;
        let intercept = my - slope * mx;
        Some(if intercept >= 0.0 {
            Line {
                overhead_ms: intercept,
                ms_per_token: slope,
            }
        } else {
            // A negative overhead is noise: the line through the origin
            // and the means.
            Line {
                overhead_ms: 0.0,
                ms_per_token: my / mx.max(1.0),
            }
        })
    }

    /// The line through the means with `overhead_ms` as intercept.
    fn through_means(&self, overhead_ms: f64) -> Option<Line> {
        let (mx, my) = self.means()?;
        let overhead_ms = overhead_ms.min(my);
        Some(Line {
            overhead_ms,
            ms_per_token: ((my - overhead_ms) / mx.max(1.0)).max(f64::MIN_POSITIVE),
        })
    }
}

/// What one answer taught the model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observation {
    /// What the model predicted for it, before learning from it.
    pub predicted_ms: f64,
    pub actual_ms: f64,
    /// `|predicted − actual| / actual`.
    pub relative_error: f64,
}

/// See the module documentation. One per filter worker, each learning
/// every answer of the gateway ([`super::answers`]), and one in the
/// replay; indexed by pod slot.
#[derive(Debug, Clone)]
pub struct TtftModel {
    decay: f64,
    pods: Vec<Fit>,
    /// Per pod, the share of decisions that found prefill queued there.
    busy: Vec<f64>,
    /// [`TtftModel::pool_overhead`] as of the last answer.
    overhead_ms: f64,
    pool: Fit,
    /// Weighted sum and weight of relative errors (prior included).
    error: (f64, f64),
}

impl TtftModel {
    /// A model remembering about `window` answers per pod.
    pub fn new(window: u32) -> TtftModel {
        TtftModel {
            decay: 1.0 - 1.0 / f64::from(window.max(1)),
            pods: Vec::new(),
            busy: Vec::new(),
            overhead_ms: 0.0,
            pool: Fit::default(),
            error: (PRIOR_ERROR * PRIOR_ERROR_SAMPLES, PRIOR_ERROR_SAMPLES),
        }
    }

    /// The pool's line: every pod's answers together.
    fn pool_line(&self) -> Option<Line> {
        self.pool.line().or_else(|| {
            self.pool
                .through_means(0.0)
                .filter(|_| self.pool.weight > 0.0)
        })
    }

    /// The pool's overhead: the pods' own intercepts, weighted by their
    /// answers (pods of different speeds share one overhead but not one
    /// slope), else the pool's line's.
    fn pool_overhead(&self) -> f64 {
        let (sum, weight) = self
            .pods
            .iter()
            .filter_map(|fit| fit.line().map(|line| (line.overhead_ms, fit.weight)))
            .fold((0.0, 0.0), |(s, w), (o, fw)| (s + o * fw, w + fw));
        if weight > 0.0 {
            sum / weight
        } else {
            self.pool_line().map_or(0.0, |l| l.overhead_ms)
        }
    }

    /// The line of pod `slot` (see the module documentation).
    pub fn line(&self, slot: usize) -> Line {
        match self.pods.get(slot).filter(|fit| fit.weight > 0.0) {
            Some(fit) => fit
                .line()
                .or_else(|| self.shrunk_line(fit))
                .unwrap_or(Line::UNCALIBRATED),
            None => self.pool_line().unwrap_or(Line::UNCALIBRATED),
        }
    }

    /// A pod's line from answers too alike to fit one: through its means
    /// with the pool's overhead, its slope shrunk towards the pool's by
    /// precision. A slope read off `n` answers at mean work `x̄` is as
    /// precise as `n·x̄²` (TTFT noise alike); the pool's line is a prior
    /// worth [`PRIOR_ERROR_SAMPLES`] answers at the pool's mean work. So a
    /// pod whose answers were all cache hits (work near 0: TTFT is the
    /// overhead, whatever the slope) keeps the pool's rate instead of
    /// reading ~0 ms a token off them, and a pod with many answers at real
    /// work keeps its own.
    fn shrunk_line(&self, fit: &Fit) -> Option<Line> {
        let own = fit.through_means(self.overhead_ms)?;
        let (Some(pool), Some((pool_x, _))) = (self.pool_line(), self.pool.means()) else {
            return Some(own);
        };
        let (mean_x, _) = fit.means()?;
        let own_precision = fit.weight * mean_x * mean_x;
        let prior_precision = PRIOR_ERROR_SAMPLES * pool_x * pool_x;
        let total = own_precision + prior_precision;
        if total <= 0.0 {
            return Some(own);
        }
        Some(Line {
            overhead_ms: own.overhead_ms,
            ms_per_token: (own_precision * own.ms_per_token + prior_precision * pool.ms_per_token)
                / total,
        })
    }

    /// Predicted TTFT (ms) on pod `slot` with `queued` tokens ahead and
    /// `uncached` tokens of the request's own.
    pub fn predict(&self, slot: usize, queued: u64, uncached: u64) -> f64 {
        self.line(slot)
            .predict(queued.saturating_add(uncached) as f64)
    }

    /// Folds the prefill queued per pod slot, as a decision sees it, into
    /// each pod's busy share ([`TtftModel::busy`]).
    pub fn observe_queues(&mut self, queued: impl ExactSizeIterator<Item = u64>) {
        if self.busy.len() < queued.len() {
            self.busy.resize(queued.len(), 0.0);
        }
        let weight = 1.0 - self.decay;
        for (busy, tokens) in self.busy.iter_mut().zip(queued) {
            let now = if tokens > 0 { 1.0 } else { 0.0 };
            *busy += weight * (now - *busy);
        }
    }

    /// The share of recent decisions that found prefill queued on pod
    /// `slot`: the chance that a request arriving there waits behind work
    /// added now (arrivals see time averages), so what a copy of a prompt
    /// there costs the requests after it, per unit of its prefill.
    pub fn busy(&self, slot: usize) -> f64 {
        self.busy.get(slot).copied().unwrap_or(0.0)
    }

    /// When a decision predicted at `predicted_ttft_ms` is expected to
    /// have been prefilled, in ms from the decision: the prediction, or 0
    /// before the model is calibrated (its predictions are tokens then).
    pub fn prefilled_after_ms(&self, predicted_ttft_ms: f64) -> f64 {
        if self.calibrated() {
            predicted_ttft_ms
        } else {
            0.0
        }
    }

    /// Whether any answer taught the model: before, its predictions are in
    /// tokens, not ms.
    pub fn calibrated(&self) -> bool {
        self.pool.weight > 0.0
    }

    /// The model's relative error, averaged over its recent answers.
    pub fn error(&self) -> f64 {
        self.error.0 / self.error.1.max(f64::MIN_POSITIVE)
    }

    /// Whether `fast` is faster than `slow` by more than the model's error.
    pub fn clearly_faster(fast_ms: f64, slow_ms: f64, error: f64) -> bool {
        fast_ms * (1.0 + error) < slow_ms * (1.0 - error)
    }

    /// `|predicted − actual| / actual` of one answer, without learning
    /// from it (`None` for a TTFT that is not a positive time).
    pub fn relative_error(&self, slot: usize, work_tokens: u64, ttft_ms: f64) -> Option<f64> {
        self.checked(slot, work_tokens, ttft_ms)
            .map(|(_, error)| error)
    }

    /// The prediction for an answer and its relative error, `None` for a
    /// TTFT that is not a positive time.
    fn checked(&self, slot: usize, work_tokens: u64, ttft_ms: f64) -> Option<(f64, f64)> {
        if !(ttft_ms.is_finite() && ttft_ms > 0.0) {
            return None;
        }
        let predicted_ms = self.line(slot).predict(work_tokens as f64);
        Some((predicted_ms, (predicted_ms - ttft_ms).abs() / ttft_ms))
    }

    /// Learns from one answer of pod `slot`: `work_tokens` (queued plus
    /// own uncached at the decision) took `ttft_ms` to the first byte.
    pub fn observe(&mut self, slot: usize, work_tokens: u64, ttft_ms: f64) -> Option<Observation> {
        let (predicted_ms, relative_error) = self.checked(slot, work_tokens, ttft_ms)?;
        let x = work_tokens as f64;
        // Uncalibrated predictions are in tokens, not ms: no error to learn.
        if self.pool.weight > 0.0 {
            self.error.0 = self.error.0 * self.decay + relative_error.min(10.0);
            self.error.1 = self.error.1 * self.decay + 1.0;
        }
        if self.pods.len() <= slot {
            self.pods.resize(slot + 1, Fit::default());
        }
        if let Some(fit) = self.pods.get_mut(slot) {
            fit.add(self.decay, x, ttft_ms);
        }
        self.pool.add(self.decay, x, ttft_ms);
        self.overhead_ms = self.pool_overhead();
        Some(Observation {
            predicted_ms,
            actual_ms: ttft_ms,
            relative_error,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_each_pods_rate_and_the_overhead() {
        let mut model = TtftModel::new(64);
        // Before any answer: tokens.
        assert_eq!(model.predict(0, 100, 50), 150.0);
        assert_eq!(model.error(), PRIOR_ERROR);
        // Pod 0: 45 ms + 0.2 ms/token; pod 1 half as fast.
        for i in 0..40u64 {
            let work = 500 + (i % 7) * 700;
            model.observe(0, work, 45.0 + 0.2 * work as f64);
            model.observe(1, work, 45.0 + 0.4 * work as f64);
        }
        let fast = model.line(0);
        assert!((fast.overhead_ms - 45.0).abs() < 1e-6, "{fast:?}");
        assert!((fast.ms_per_token - 0.2).abs() < 1e-9, "{fast:?}");
        assert!((model.line(1).ms_per_token - 0.4).abs() < 1e-9);
        assert!((model.predict(0, 1000, 1000) - 445.0).abs() < 1e-6);
        // A pod with no answer takes the pool's line (between the two).
        let unseen = model.line(5);
        assert!(unseen.ms_per_token > 0.2 && unseen.ms_per_token < 0.4);
        // Exact answers: the error falls from the prior towards 0.
        assert!(model.error() < 0.05, "{}", model.error());
    }

    #[test]
    fn a_steady_pod_takes_the_pools_overhead() {
        let mut model = TtftModel::new(64);
        for i in 0..20u64 {
            let work = 200 + (i % 5) * 900;
            model.observe(0, work, 10.0 + 0.1 * work as f64);
        }
        // Pod 1 always gets 1,000 tokens: no spread to fit a slope on.
        // Its slope through its means (0.3) is shrunk towards the pool's
        // by precision: halfway after 10 answers, its own after a window.
        for _ in 0..10 {
            model.observe(1, 1000, 10.0 + 0.3 * 1000.0);
        }
        let early = model.line(1);
        assert!((early.overhead_ms - 10.0).abs() < 1.0, "{early:?}");
        assert!(
            early.ms_per_token > 0.15 && early.ms_per_token < 0.25,
            "{early:?}"
        );
        for _ in 10..64 {
            model.observe(1, 1000, 10.0 + 0.3 * 1000.0);
        }
        let steady = model.line(1);
        assert!((steady.overhead_ms - 10.0).abs() < 1.0, "{steady:?}");
        // Within 10 %: the prior still weighs 4 answers at the pool's work.
        assert!((steady.ms_per_token - 0.3).abs() < 0.035, "{steady:?}");
        assert!(model.observe(1, 1000, 0.0).is_none());
        assert!(model.observe(1, 1000, f64::NAN).is_none());
    }

    #[test]
    fn a_pod_that_only_answered_hits_keeps_the_pools_rate() {
        let mut model = TtftModel::new(64);
        // The pool: 45 ms + 0.2 ms a token, over real work.
        for i in 0..40u64 {
            let work = 500 + (i % 7) * 700;
            model.observe(0, work, 45.0 + 0.2 * work as f64);
        }
        // Pod 1 answered two cache hits: 100 tokens, TTFT the overhead.
        model.observe(1, 100, 45.0);
        model.observe(1, 100, 45.0);
        // Through its means alone its slope would be ~0 (it would be
        // predicted to answer 60,000 queued tokens in 45 ms); the pool's
        // prior, worth 4 answers at ~2,600 tokens, outweighs two at 100.
        let hits_only = model.line(1);
        assert!((hits_only.ms_per_token - 0.2).abs() < 0.01, "{hits_only:?}");
        assert!(model.predict(1, 60_000, 0) > 10_000.0);
    }

    #[test]
    fn the_margin_is_the_error_band() {
        assert!(TtftModel::clearly_faster(100.0, 200.0, 0.2));
        // 100 × 1.2 = 120 against 140 × 0.8 = 112: within the error.
        assert!(!TtftModel::clearly_faster(100.0, 140.0, 0.2));
        assert!(!TtftModel::clearly_faster(1.0, 1e9, 1.0));
    }
}
