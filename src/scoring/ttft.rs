//! The predicted-TTFT model: how long a request would wait for its first
//! token on each pod, learned online from what the pods answer.
//!
//! ```text
//! ttft(pod) = overhead(pod) + queued(pod) × time_per_queued_unit(pod)
//!                           + uncached(pod) × time_per_unit(pod)         ms
//! units(tokens, attention) = tokens + attention × 1024 / span
//! attention(own, prompt)   = own × (prompt − own/2) / 1024   (token pairs / 1,024)
//! ```
//!
//! Prefill work is counted in units: a token of prefill is one unit for
//! its linear layers, plus its attention over the prompt before it, which
//! grows with the prompt. `span` is the context length at which a token's
//! attention costs as much as its linear work: a property of the model
//! and the engine (~30k tokens for an 8B model on a GPU by FLOPs, a few
//! hundred for the real-vLLM bench's tiny model on CPU), never
//! configured. The model keeps one set of lines per span of [`SPANS`]
//! (∞, 16k … 64 tokens), each fed every answer in its own units, and
//! predicts with the span whose lines have predicted the answers best,
//! each answer predicted before any line learns from it. On an engine
//! whose prefill is linear (the simulator) the ∞ span wins and the model
//! is the token line it was.
//! Measured on real vLLM (`kvroute-bench --engine vllm`, docs/
//! benchmarks.md, "Real vLLM"): the median error on agentic's long
//! histories 52 / 46 % (precise / approximate) in tokens against 21 / 26 %
//! with the spans, multi-turn 20 / 26 → 13 / 13 %, shared prefix 16 / 14
//! → 14 / 13 %; the pods' span reads 64–256 tokens. In the replay suite
//! the simulator's linear prefill keeps ∞, and the model's error and the
//! routing are unchanged but for the noisiest cells.
//!
//! - `queued(pod)`: the prompt tokens still to prefill there, the uncached
//!   tokens of every request routed to it (all workers) from the decision
//!   until its first response byte, and their attention
//!   ([`crate::snapshot::SlotLoad`]), in units; a prefill engine works
//!   through them before it reaches this request.
//! - `uncached(pod)`: this request's own prompt tokens the pod does not
//!   cache (the re-prefill a cache miss costs) and their attention, in
//!   units. A prefix the pod holds outside GPU memory adds its reload, in
//!   prefill tokens (`tierCredits`, [`super::factors::CachedPrefix`]).
//! - `overhead`, `time_per_unit` and `time_per_queued_unit`, per pod:
//!   fitted to the pod's last `balance.learningWindow` answers, `(queued,
//!   uncached at the decision, observed TTFT)`, exponentially weighted, by
//!   least *relative* squares: what the pod did with the work it was
//!   given. No speed is configured: a pod twice as fast shows half the
//!   slopes within a few answers, so a mixed pool gets load in proportion
//!   to speed. The overhead (scheduling, sampling, the network and the
//!   proxy) is the intercept.
//! - Why two slopes: a request's own uncached tokens are known exactly,
//!   but `queued` counts the prefill in progress in full until its first
//!   token, part of which is done. Fitted as one slope over `work`, that
//!   error in the queued count flattened the line (least squares against
//!   a noisy variable), raised its intercept and put the model's median
//!   error at 24 % precise and 51 % approximate on the trace workload
//!   (`kvroute-replay --bench-workload trace --pods 4 --out`: against the
//!   exact FIFO backlog rebuilt from the per-request CSV, the router's
//!   queued count is 1.0–1.3× the true one, and the same fit on the true
//!   backlog has no error). With a slope each, the queued one learns what
//!   a counted token is worth and the own one stays exact.
//! - Why relative squares: an answer's noise grows with its TTFT, and the
//!   model's error is measured, and used as the margin, relative. Fitted
//!   by absolute squares the few long prefills decide the line and the
//!   many cache hits are off by half; by relative squares with one slope
//!   the hits are right and the long prefills, which the balance
//!   compares, off by 46 %. With both: 0.7 % (precise) and 0.3 %
//!   (approximate) over all answers, 4.0 % and 1.2 % over those above
//!   100 ms (same replay, offline refit).
//! - Until a pod's answers spread in both counts (a light load queues
//!   nothing: no queued slope to read), its line is the one-slope fit
//!   below, the queued tokens priced as its own.
//!
//! The one-slope fit: until a pod's own answers spread enough to fit a
//! line by least squares over `work` (a steady load
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
//! and every replica's.

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

/// Fewest answers the two-slope fit is used on: twice its three terms.
const SPLIT_MIN_SAMPLES: f64 = 6.0;

/// The spans the model chooses among, in tokens (module documentation):
/// attention not counted, then halving from 16k to 64, past the 128–512
/// the real-vLLM bench's CPU model reads in the router's tokens (bytes /
/// 4, about half its tokenizer's count). Each costs one set of lines per
/// pod (120 bytes).
pub const SPANS: [f64; 10] = [
    f64::INFINITY,
    16384.0,
    8192.0,
    4096.0,
    2048.0,
    1024.0,
    512.0,
    256.0,
    128.0,
    64.0,
];

/// Token pairs in a unit of attention.
const PAIRS_PER_ATTENTION: f64 = 1024.0;

/// The attention a prefill of `own` tokens at the end of a `prompt`-token
/// prompt computes, in units of 1,024 token pairs: each of its tokens
/// attends to every token before it.
pub fn attention(own: u64, prompt: u64) -> u64 {
    let before = prompt.saturating_sub(own);
    // Σ over its tokens of (tokens before + its position) ≈ own × (before + own/2).
    let pairs = u128::from(own) * (u128::from(before) * 2 + u128::from(own)) / 2;
    u64::try_from(pairs / PAIRS_PER_ATTENTION as u128).unwrap_or(u64::MAX)
}

/// Exponentially weighted sums of `(work, ttft)` pairs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Fit {
    weight: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

/// A fitted line: `ttft = overhead_ms + queued × ms_per_queued_token +
/// own × ms_per_token`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Line {
    pub overhead_ms: f64,
    /// Per token of the request's own prefill.
    pub ms_per_token: f64,
    /// Per token counted queued ahead of it.
    pub ms_per_queued_token: f64,
}

impl Line {
    /// Before any answer: tokens as the unit of time.
    pub const UNCALIBRATED: Line = Line::one_slope(0.0, 1.0);

    /// Queued tokens priced as the request's own.
    const fn one_slope(overhead_ms: f64, ms_per_token: f64) -> Line {
        Line {
            overhead_ms,
            ms_per_token,
            ms_per_queued_token: ms_per_token,
        }
    }

    /// With `queued` tokens ahead and `own` of the request's own.
    pub fn predict(&self, queued: f64, own: f64) -> f64 {
        self.overhead_ms
            + queued.max(0.0) * self.ms_per_queued_token
            + own.max(0.0) * self.ms_per_token
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
            Line::one_slope(intercept, slope)
        } else {
            // A negative overhead is noise: the line through the origin
            // and the means.
            Line::one_slope(0.0, my / mx.max(1.0))
        })
    }

    /// The line through the means with `overhead_ms` as intercept.
    fn through_means(&self, overhead_ms: f64) -> Option<Line> {
        let (mx, my) = self.means()?;
        let overhead_ms = overhead_ms.min(my);
        Some(Line::one_slope(
            overhead_ms,
            ((my - overhead_ms) / mx.max(1.0)).max(f64::MIN_POSITIVE),
        ))
    }
}

/// Exponentially weighted sums of `(queued, own, ttft)` answers, each
/// weighted `1/ttft²` (least relative squares), for the two-slope line.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct SplitFit {
    /// Answers (unweighted, decayed).
    count: f64,
    w: f64,
    q: f64,
    o: f64,
    y: f64,
    qq: f64,
    oo: f64,
    qo: f64,
    qy: f64,
    oy: f64,
}

impl SplitFit {
    fn add(&mut self, decay: f64, queued: f64, own: f64, ttft: f64) {
        let w = 1.0 / (ttft * ttft);
        let sums = [
            (&mut self.w, w),
            (&mut self.q, w * queued),
            (&mut self.o, w * own),
            (&mut self.y, w * ttft),
            (&mut self.qq, w * queued * queued),
            (&mut self.oo, w * own * own),
            (&mut self.qo, w * queued * own),
            (&mut self.qy, w * queued * ttft),
            (&mut self.oy, w * own * ttft),
        ];
        for (sum, value) in sums {
            *sum = *sum * decay + value;
        }
        self.count = self.count * decay + 1.0;
    }

    /// Its line, when the answers spread in both counts, apart from each
    /// other, and every term comes out non-negative.
    fn line(&self) -> Option<Line> {
        if self.count < SPLIT_MIN_SAMPLES || self.w <= 0.0 {
            return None;
        }
        let mean = |sum: f64| sum / self.w;
        let (mq, mo, my) = (mean(self.q), mean(self.o), mean(self.y));
        let vqq = mean(self.qq) - mq * mq;
        let voo = mean(self.oo) - mo * mo;
        let vqo = mean(self.qo) - mq * mo;
        let cqy = mean(self.qy) - mq * my;
        let coy = mean(self.oy) - mo * my;
        let spread = |var: f64, m: f64| var > (MIN_RELATIVE_SPREAD * m).powi(2);
        let det = vqq * voo - vqo * vqo;
        // Nearly collinear counts cannot be told apart.
        if !spread(vqq, mq) || !spread(voo, mo) || det <= 0.01 * vqq * voo {
            return None;
        }
        let per_queued = (cqy * voo - coy * vqo) / det;
        let per_own = (coy * vqq - cqy * vqo) / det;
        let overhead = my - per_queued * mq - per_own * mo;
        (per_queued >= 0.0 && per_own > 0.0 && overhead >= 0.0).then_some(Line {
            overhead_ms: overhead,
            ms_per_token: per_own,
            ms_per_queued_token: per_queued,
        })
    }
}

/// One pod's (or the pool's) answers, in both fits.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Fits {
    one_slope: Fit,
    split: SplitFit,
}

impl Fits {
    fn add(&mut self, decay: f64, (queued, own): (f64, f64), ttft_ms: f64) {
        self.one_slope.add(decay, queued + own, ttft_ms);
        self.split.add(decay, queued, own, ttft_ms);
    }

    fn answered(&self) -> bool {
        self.one_slope.weight > 0.0
    }

    /// The two-slope line, else the one-slope line.
    fn line(&self) -> Option<Line> {
        self.split.line().or_else(|| self.one_slope.line())
    }
}

/// The prefill a request's first token waited for, as counted at its
/// decision: `tokens` in all, of which `own_tokens` its own (uncached,
/// plus a reload), the rest queued ahead of it; and their [`attention`],
/// of which `own_attention` its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Work {
    pub tokens: u64,
    pub own_tokens: u64,
    pub attention: u64,
    pub own_attention: u64,
}

impl Work {
    /// Tokens only (attention 0).
    pub fn new(queued: u64, own_tokens: u64) -> Work {
        Work {
            tokens: queued.saturating_add(own_tokens),
            own_tokens,
            ..Work::default()
        }
    }

    /// With `queued_attention` ahead and `own_attention` of its own.
    pub fn with_attention(self, queued_attention: u64, own_attention: u64) -> Work {
        Work {
            attention: queued_attention.saturating_add(own_attention),
            own_attention,
            ..self
        }
    }

    /// The tokens queued ahead.
    pub fn queued(&self) -> u64 {
        self.tokens.saturating_sub(self.own_tokens)
    }

    /// `(queued, own)` in units of `span` (module documentation).
    pub fn units(&self, span: f64) -> (f64, f64) {
        let per_attention = PAIRS_PER_ATTENTION / span;
        let queued_attention = self.attention.saturating_sub(self.own_attention);
        (
            self.queued() as f64 + queued_attention as f64 * per_attention,
            self.own_tokens as f64 + self.own_attention as f64 * per_attention,
        )
    }
}

/// A TTFT the model can measure against: a positive time.
fn is_time(ttft_ms: f64) -> bool {
    ttft_ms.is_finite() && ttft_ms > 0.0
}

/// What the model expects of one request on one pod
/// ([`TtftModel::estimate`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    pub ttft_ms: f64,
    pub ms_per_token: f64,
    pub ms_per_queued_token: f64,
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

/// One span's lines: every pod's and the pool's, and their error.
#[derive(Debug, Clone)]
struct SpanLines {
    span: f64,
    pods: Vec<Fits>,
    /// [`SpanLines::pool_overhead`] as of the last answer.
    overhead_ms: f64,
    pool: Fits,
    /// Weighted sum and weight of relative errors (prior included).
    error: (f64, f64),
}

impl SpanLines {
    fn new(span: f64) -> SpanLines {
        SpanLines {
            span,
            pods: Vec::new(),
            overhead_ms: 0.0,
            pool: Fits::default(),
            error: (PRIOR_ERROR * PRIOR_ERROR_SAMPLES, PRIOR_ERROR_SAMPLES),
        }
    }

    fn error(&self) -> f64 {
        self.error.0 / self.error.1.max(f64::MIN_POSITIVE)
    }

    /// The pool's line: every pod's answers together.
    fn pool_line(&self) -> Option<Line> {
        self.pool.line().or_else(|| {
            self.pool
                .one_slope
                .through_means(0.0)
                .filter(|_| self.pool.answered())
        })
    }

    /// The pool's overhead: the pods' own intercepts, weighted by their
    /// answers (pods of different speeds share one overhead but not one
    /// slope), else the pool's line's.
    fn pool_overhead(&self) -> f64 {
        let (sum, weight) = self
            .pods
            .iter()
            .map(|fits| fits.one_slope)
            .filter_map(|fit| fit.line().map(|line| (line.overhead_ms, fit.weight)))
            .fold((0.0, 0.0), |(s, w), (o, fw)| (s + o * fw, w + fw));
        if weight > 0.0 {
            sum / weight
        } else {
            self.pool_line().map_or(0.0, |l| l.overhead_ms)
        }
    }

    fn line(&self, slot: usize) -> Line {
        match self.pods.get(slot).filter(|fits| fits.answered()) {
            Some(fits) => fits
                .line()
                .or_else(|| self.shrunk_line(&fits.one_slope))
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
        let (Some(pool), Some((pool_x, _))) = (self.pool_line(), self.pool.one_slope.means())
        else {
            return Some(own);
        };
        let (mean_x, _) = fit.means()?;
        let own_precision = fit.weight * mean_x * mean_x;
        let prior_precision = PRIOR_ERROR_SAMPLES * pool_x * pool_x;
        let total = own_precision + prior_precision;
        if total <= 0.0 {
            return Some(own);
        }
        Some(Line::one_slope(
            own.overhead_ms,
            (own_precision * own.ms_per_token + prior_precision * pool.ms_per_token) / total,
        ))
    }

    fn predict(&self, slot: usize, work: Work) -> f64 {
        let (queued, own) = work.units(self.span);
        self.line(slot).predict(queued, own)
    }

    /// Learns one answer, after counting the relative error of its
    /// prediction (once it has answers: before, predictions are tokens),
    /// and returns that prediction.
    fn observe(&mut self, decay: f64, slot: usize, work: Work, ttft_ms: f64) -> f64 {
        let predicted_ms = self.predict(slot, work);
        if self.pool.answered() {
            let error = (predicted_ms - ttft_ms).abs() / ttft_ms;
            self.error.0 = self.error.0 * decay + error.min(10.0);
            self.error.1 = self.error.1 * decay + 1.0;
        }
        if self.pods.len() <= slot {
            self.pods.resize(slot + 1, Fits::default());
        }
        let units = work.units(self.span);
        if let Some(fits) = self.pods.get_mut(slot) {
            fits.add(decay, units, ttft_ms);
        }
        self.pool.add(decay, units, ttft_ms);
        self.overhead_ms = self.pool_overhead();
        predicted_ms
    }
}

/// See the module documentation. One per filter worker, each learning
/// every answer of the gateway ([`super::answers`]), and one in the
/// replay; indexed by pod slot.
#[derive(Debug, Clone)]
pub struct TtftModel {
    /// Answers remembered per pod (`balance.learningWindow`).
    window: u32,
    decay: f64,
    /// The span predicting: the lowest error (the first of [`SPANS`]
    /// until another's is lower).
    best: SpanLines,
    /// The other spans of [`SPANS`].
    others: Vec<SpanLines>,
}

impl TtftModel {
    /// A model remembering about `window` answers per pod.
    pub fn new(window: u32) -> TtftModel {
        let window = window.max(1);
        TtftModel {
            window,
            decay: 1.0 - 1.0 / f64::from(window),
            best: SpanLines::new(SPANS[0]),
            others: SPANS[1..]
                .iter()
                .map(|&span| SpanLines::new(span))
                .collect(),
        }
    }

    /// Answers remembered per pod: the horizon of everything the router
    /// learns ([`crate::memory::RouterMemory`]).
    pub fn window(&self) -> u32 {
        self.window
    }

    /// The span the model predicts with, in tokens.
    pub fn span(&self) -> f64 {
        self.best.span
    }

    /// The line of pod `slot`, in units of [`TtftModel::span`].
    pub fn line(&self, slot: usize) -> Line {
        self.best.line(slot)
    }

    /// Predicted TTFT (ms) of `work` on pod `slot`.
    pub fn predict(&self, slot: usize, work: Work) -> f64 {
        self.best.predict(slot, work)
    }

    /// `work` on pod `slot`: its predicted TTFT, and the pod's time per
    /// token of its own prefill and per token queued ahead, attention
    /// included (what its tokens cost on average).
    pub fn estimate(&self, slot: usize, work: Work) -> Estimate {
        let line = self.line(slot);
        let (queued, own) = work.units(self.span());
        let per = |units: f64, tokens: u64| {
            if tokens == 0 {
                1.0
            } else {
                units / tokens as f64
            }
        };
        Estimate {
            ttft_ms: line.predict(queued, own),
            ms_per_token: line.ms_per_token * per(own, work.own_tokens),
            ms_per_queued_token: line.ms_per_queued_token * per(queued, work.queued()),
        }
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
        self.best.pool.answered()
    }

    /// The model's relative error, averaged over its recent answers.
    pub fn error(&self) -> f64 {
        self.best.error()
    }

    /// Whether `fast` is faster than `slow` by more than the model's error.
    pub fn clearly_faster(fast_ms: f64, slow_ms: f64, error: f64) -> bool {
        fast_ms * (1.0 + error) < slow_ms * (1.0 - error)
    }

    /// `|predicted − actual| / actual` of one answer, without learning
    /// from it (`None` for a TTFT that is not a positive time, and before
    /// any answer: an uncalibrated prediction is in tokens, not ms).
    pub fn relative_error(&self, slot: usize, work: Work, ttft_ms: f64) -> Option<f64> {
        (is_time(ttft_ms) && self.calibrated())
            .then(|| (self.predict(slot, work) - ttft_ms).abs() / ttft_ms)
    }

    /// Learns from one answer of pod `slot`: `work` at the decision took
    /// `ttft_ms` to the first byte. Every span's lines predict it before
    /// any learns from it; then the span with the lowest error predicts.
    pub fn observe(&mut self, slot: usize, work: Work, ttft_ms: f64) -> Option<Observation> {
        if !is_time(ttft_ms) {
            return None;
        }
        let predicted_ms = self.best.observe(self.decay, slot, work, ttft_ms);
        for lines in &mut self.others {
            lines.observe(self.decay, slot, work, ttft_ms);
        }
        let error = self.best.error();
        if let Some(better) = self
            .others
            .iter_mut()
            .filter(|lines| lines.error() < error)
            .min_by(|a, b| a.error().total_cmp(&b.error()))
        {
            std::mem::swap(&mut self.best, better);
        }
        Some(Observation {
            predicted_ms,
            actual_ms: ttft_ms,
            relative_error: (predicted_ms - ttft_ms).abs() / ttft_ms,
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
        assert_eq!(model.predict(0, Work::new(100, 50)), 150.0);
        assert_eq!(model.error(), PRIOR_ERROR);
        // Pod 0: 45 ms + 0.2 ms/token; pod 1 half as fast.
        for i in 0..40u64 {
            let work = 500 + (i % 7) * 700;
            model.observe(0, Work::new(0, work), 45.0 + 0.2 * work as f64);
            model.observe(1, Work::new(0, work), 45.0 + 0.4 * work as f64);
        }
        let fast = model.line(0);
        assert!((fast.overhead_ms - 45.0).abs() < 1e-6, "{fast:?}");
        assert!((fast.ms_per_token - 0.2).abs() < 1e-9, "{fast:?}");
        assert!((model.line(1).ms_per_token - 0.4).abs() < 1e-9);
        assert!((model.predict(0, Work::new(1000, 1000)) - 445.0).abs() < 1e-6);
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
            model.observe(0, Work::new(0, work), 10.0 + 0.1 * work as f64);
        }
        // Pod 1 always gets 1,000 tokens: no spread to fit a slope on.
        // Its slope through its means (0.3) is shrunk towards the pool's
        // by precision: halfway after 10 answers, its own after a window.
        for _ in 0..10 {
            model.observe(1, Work::new(0, 1000), 10.0 + 0.3 * 1000.0);
        }
        let early = model.line(1);
        assert!((early.overhead_ms - 10.0).abs() < 1.0, "{early:?}");
        assert!(
            early.ms_per_token > 0.15 && early.ms_per_token < 0.25,
            "{early:?}"
        );
        for _ in 10..64 {
            model.observe(1, Work::new(0, 1000), 10.0 + 0.3 * 1000.0);
        }
        let steady = model.line(1);
        assert!((steady.overhead_ms - 10.0).abs() < 1.0, "{steady:?}");
        // Within 10 %: the prior still weighs 4 answers at the pool's work.
        assert!((steady.ms_per_token - 0.3).abs() < 0.035, "{steady:?}");
        assert!(model.observe(1, Work::new(0, 1000), 0.0).is_none());
        assert!(model.observe(1, Work::new(0, 1000), f64::NAN).is_none());
    }

    #[test]
    fn a_pod_that_only_answered_hits_keeps_the_pools_rate() {
        let mut model = TtftModel::new(64);
        // The pool: 45 ms + 0.2 ms a token, over real work.
        for i in 0..40u64 {
            let work = 500 + (i % 7) * 700;
            model.observe(0, Work::new(0, work), 45.0 + 0.2 * work as f64);
        }
        // Pod 1 answered two cache hits: 100 tokens, TTFT the overhead.
        model.observe(1, Work::new(0, 100), 45.0);
        model.observe(1, Work::new(0, 100), 45.0);
        // Through its means alone its slope would be ~0 (it would be
        // predicted to answer 60,000 queued tokens in 45 ms); the pool's
        // prior, worth 4 answers at ~2,600 tokens, outweighs two at 100.
        let hits_only = model.line(1);
        assert!((hits_only.ms_per_token - 0.2).abs() < 0.01, "{hits_only:?}");
        assert!(model.predict(1, Work::new(60_000, 0)) > 10_000.0);
    }

    #[test]
    fn attention_is_own_tokens_times_the_prompt_before_them() {
        // 100 tokens after 900: 100 × (900 + 50) pairs.
        assert_eq!(attention(100, 1000), 100 * 950 / 1024);
        assert_eq!(attention(0, 1000), 0);
        // A prompt shorter than its uncached tokens reads as all uncached.
        assert_eq!(attention(2048, 1024), 2048 * 1024 / 1024);
        assert_eq!(attention(u64::MAX, u64::MAX), u64::MAX);
    }

    /// Answers of a pod whose prefill costs 0.1 ms a token plus as much
    /// again per 1,024 tokens of context before it (span 1,024), and of
    /// one whose prefill is linear: each model picks its engine's span.
    #[test]
    fn learns_the_span_its_answers_show() {
        let answers = |span: f64| {
            let mut model = TtftModel::new(64);
            for i in 0..80u64 {
                let prompt = 1000 + (i % 9) * 1500;
                let own = prompt / (1 + i % 4);
                let queued = (i % 5) * 400;
                let work = Work::new(queued, own)
                    .with_attention(attention(queued, prompt), attention(own, prompt));
                let (q, o) = work.units(span);
                model.observe(0, work, 20.0 + 0.1 * (q + o));
            }
            model
        };
        let quadratic = answers(1024.0);
        assert_eq!(quadratic.span(), 1024.0);
        assert!(quadratic.error() < 0.05, "{}", quadratic.error());
        let long = Work::new(0, 10_000).with_attention(0, attention(10_000, 10_000));
        // 10,000 units of tokens, 48,828 of attention at span 1,024.
        assert!((quadratic.predict(0, long) - 5_902.0).abs() < 60.0);
        let linear = answers(f64::INFINITY);
        assert_eq!(linear.span(), f64::INFINITY);
        assert!((linear.predict(0, long) - 1_020.0).abs() < 10.0);
    }

    #[test]
    fn the_margin_is_the_error_band() {
        assert!(TtftModel::clearly_faster(100.0, 200.0, 0.2));
        // 100 × 1.2 = 120 against 140 × 0.8 = 112: within the error.
        assert!(!TtftModel::clearly_faster(100.0, 140.0, 0.2));
        assert!(!TtftModel::clearly_faster(1.0, 1e9, 1.0));
    }
}
