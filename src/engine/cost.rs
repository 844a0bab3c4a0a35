//! How long a step takes, from its shape, learned online from measured steps: the scheduler sizes
//! prefill chunks with it so that a step carrying decodes stays under the inter-token target
//! (Sarathi-Serve's stall-free batching sets its chunk budget from such a target; here the budget
//! follows the measured machine and model instead of a fixed token count).
//!
//! The model is linear in six features: a constant (weights read, launch and sampling
//! overhead), the step's tokens (the matmuls), its attention work (for each token, the
//! positions it attends to: a chunk of `n` tokens starting at position `p` has `n * p + n(n+1)/2`)
//! in two parts, that of decodes (with their drafts) and short prompt runs, and that of prompt
//! runs of `attn_amx::MIN_TOKENS` or more (on CPUs with AMX these run on the tile units, several
//! times cheaper a position than a decode row: one weight for both made a long prompt's chunks
//! beside streaming replies far too small), the positions such runs see (on the tile units each
//! KV head's positions are packed for the step unless the packs are kept from the step before,
//! `model::tile_packs`: work that grows with the context however short the chunk; where packs
//! are kept its weight fits to about zero), and its rows of logits (the LM head: one per decode,
//! one per speculative draft, one for a prompt's last chunk), so that a draft, which needs its
//! logits, is priced above a prompt token.
//! The weights are fit by exponentially weighted least squares with a ridge toward priors, so the
//! first predictions are sensible and a few dozen steps adapt them to the machine. Pure code.

use crate::model::kernels::attn_amx::MIN_TOKENS;

/// What the cost model sees of a step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepShape {
    /// Tokens in the step (prefill chunks and decodes).
    pub tokens: usize,
    /// Sum over the step's tokens of the positions each attends to.
    pub attention: f64,
    /// The part of `attention` from prompt runs of `attn_amx::MIN_TOKENS` tokens or more.
    pub chunk_attention: f64,
    /// The positions those runs see, each run counted once.
    pub chunk_context: f64,
    /// Rows whose logits the step computes.
    pub logits: usize,
}

impl StepShape {
    /// Adds a prompt's run of `n` tokens starting at position `start` (a prefill chunk).
    pub fn add_run(&mut self, start: usize, n: usize) {
        self.add_decode(start, n);
        if n >= MIN_TOKENS {
            self.chunk_attention += attention_of(start, n);
            self.chunk_context += (start + n) as f64;
        }
    }

    /// This shape with a prompt's run of `n` tokens at `start` added.
    pub fn with_run(mut self, start: usize, n: usize) -> Self {
        self.add_run(start, n);
        self
    }

    /// Adds a reply's decode at position `start`: `n` tokens, its last sampled one and its drafts
    /// (`Logits::Decode`: attention as a one-token decode's, however many).
    pub fn add_decode(&mut self, start: usize, n: usize) {
        self.tokens += n;
        self.attention += attention_of(start, n);
    }

    /// This shape with a decode of `n` tokens at `start` added.
    pub fn with_decode(mut self, start: usize, n: usize) -> Self {
        self.add_decode(start, n);
        self
    }

    /// Adds `rows` rows of logits (a decode's, its drafts', a prompt's last token's).
    pub fn add_logits(&mut self, rows: usize) {
        self.logits += rows;
    }

    /// This shape with `rows` rows of logits added.
    pub fn with_logits(mut self, rows: usize) -> Self {
        self.add_logits(rows);
        self
    }

    fn features(&self) -> [f64; N] {
        [
            1.0,
            self.tokens as f64 / 100.0,
            (self.attention - self.chunk_attention) / 1e5,
            self.chunk_attention / 1e5,
            self.chunk_context / 1e4,
            self.logits as f64 / 10.0,
        ]
    }
}

/// Positions attended by `n` tokens at positions `start..start + n` (each sees itself and all
/// before it).
pub fn attention_of(start: usize, n: usize) -> f64 {
    let (p, n) = (start as f64, n as f64);
    n * p + n * (n + 1.0) / 2.0
}

/// Features of a step.
const N: usize = 6;

/// A step's predicted time in seconds, and what a measured step teaches it.
pub trait CostModel: Send {
    fn predict(&self, s: &StepShape) -> f64;
    fn observe(&mut self, s: &StepShape, seconds: f64);
}

/// A model that never learns: the weights it was made with (tests that need a step policy that
/// does not depend on this machine's speed).
#[derive(Debug, Clone)]
pub struct FixedCost(pub LinearCost);

impl CostModel for FixedCost {
    fn predict(&self, s: &StepShape) -> f64 {
        self.0.predict(s)
    }

    fn observe(&mut self, _: &StepShape, _: f64) {}
}

/// Least squares over the features with exponential forgetting and a ridge toward priors.
#[derive(Debug, Clone)]
pub struct LinearCost {
    /// Weighted sums of x x^T and x y over the observations.
    xx: [[f64; N]; N],
    xy: [f64; N],
    prior: [f64; N],
    /// Each old observation's weight is multiplied by this at every new one.
    decay: f64,
    /// The ridge's weight, in observations.
    ridge: f64,
    theta: [f64; N],
}

impl Default for LinearCost {
    /// Priors for a small model on two CPU cores: 3 ms a step, 1 ms a token, 0.3 us per attended
    /// position (decode or chunk), 1 us per position a long run sees, 0.5 ms a row of logits.
    fn default() -> Self {
        LinearCost::new([0.003, 0.1, 0.03, 0.03, 0.01, 0.005])
    }
}

impl LinearCost {
    /// `prior`: seconds for the constant, per 100 tokens, per 100,000 attended positions of
    /// decodes and short runs, per 100,000 of long runs, per 10,000 positions long runs see, per
    /// 10 rows of logits.
    pub fn new(prior: [f64; N]) -> Self {
        LinearCost {
            xx: [[0.0; N]; N],
            xy: [0.0; N],
            prior,
            decay: 0.99,
            ridge: 0.05,
            theta: prior,
        }
    }

    /// The current weights (as `new`'s priors).
    pub fn weights(&self) -> [f64; N] {
        self.theta
    }

    fn solve(&mut self) {
        let mut a = self.xx;
        let mut b = self.xy;
        for i in 0..N {
            a[i][i] += self.ridge;
            b[i] += self.ridge * self.prior[i];
        }
        // A negative weight would let a bigger step look cheaper, and cutting one to zero after
        // the fit leaves the others fit to it (every prediction off the same way: measured
        // 25% high once kept tile packs made the context's own weight worthless). So a feature
        // whose weight comes out negative is held at zero and the rest fit again, until none is
        // (non-negative least squares by elimination, at most `N` solves).
        let mut held = [false; N];
        for _ in 0..N {
            let (mut a, mut b) = (a, b);
            for i in (0..N).filter(|&i| held[i]) {
                a[i] = [0.0; N];
                a[i][i] = 1.0;
                b[i] = 0.0;
                for (r, row) in a.iter_mut().enumerate() {
                    if r != i {
                        row[i] = 0.0;
                    }
                }
            }
            let Some(t) = solve(a, b) else { return };
            let worst = (0..N)
                .filter(|&i| t[i] < 0.0)
                .min_by(|&i, &j| t[i].total_cmp(&t[j]));
            match worst {
                Some(i) => held[i] = true,
                None => {
                    self.theta = t;
                    return;
                }
            }
        }
    }
}

impl CostModel for LinearCost {
    fn predict(&self, s: &StepShape) -> f64 {
        let x = s.features();
        (0..N).map(|i| self.theta[i] * x[i]).sum()
    }

    fn observe(&mut self, s: &StepShape, seconds: f64) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let x = s.features();
        for i in 0..N {
            for j in 0..N {
                self.xx[i][j] = self.xx[i][j] * self.decay + x[i] * x[j];
            }
            self.xy[i] = self.xy[i] * self.decay + x[i] * seconds;
        }
        self.solve();
    }
}

/// Solves the system `a t = b` by Gaussian elimination with partial pivoting.
fn solve(mut a: [[f64; N]; N], mut b: [f64; N]) -> Option<[f64; N]> {
    for c in 0..N {
        let p = (c..N).max_by(|&i, &j| a[i][c].abs().total_cmp(&a[j][c].abs()))?;
        if a[p][c].abs() < 1e-12 {
            return None;
        }
        a.swap(c, p);
        b.swap(c, p);
        for r in c + 1..N {
            let f = a[r][c] / a[c][c];
            let pivot = a[c];
            for (x, y) in a[r].iter_mut().zip(pivot).skip(c) {
                *x -= f * y;
            }
            b[r] -= f * b[c];
        }
    }
    let mut t = [0.0; N];
    for c in (0..N).rev() {
        let s: f64 = (c + 1..N).map(|k| a[c][k] * t[k]).sum();
        t[c] = (b[c] - s) / a[c][c];
    }
    Some(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_counts_each_tokens_visible_positions() {
        assert_eq!(attention_of(0, 1), 1.0);
        assert_eq!(attention_of(0, 3), 6.0);
        assert_eq!(attention_of(10, 2), 11.0 + 12.0);
    }

    #[test]
    fn learns_a_machine_that_differs_from_its_priors() {
        // The "machine": 5 ms a step, 2 ms a token, 1 us per position a decode row attends to and
        // a quarter of that for a chunk's (as on the tile units) plus 2 us per position a chunk
        // sees (packing them), 1 ms a row of logits.
        let truth = |s: &StepShape| {
            let decode = s.attention - s.chunk_attention;
            0.005
                + 0.002 * s.tokens as f64
                + 1e-6 * decode
                + 2.5e-7 * s.chunk_attention
                + 2e-6 * s.chunk_context
                + 0.001 * s.logits as f64
        };
        let mut m = LinearCost::default();
        let shapes: Vec<StepShape> = (0..200)
            .map(|i| {
                let mut s = StepShape::default();
                for d in 0..(i % 9) {
                    // Decodes, some with drafts: a row of logits per token.
                    let n = 1 + (i + d) % 3 * (i % 2);
                    s.add_decode(100 + 37 * d + (i * 97) % 3000, n);
                    s.add_logits(n);
                }
                // A prompt's chunk in two steps of three: logits for its last token only when it
                // ends.
                if i % 3 > 0 {
                    s.add_run((i * 131) % 5000, (i * 17) % 200);
                }
                s.with_logits(i % 4 / 3)
            })
            .collect();
        for s in &shapes {
            m.observe(s, truth(s));
        }
        for s in &shapes[150..] {
            let (p, t) = (m.predict(s), truth(s));
            assert!((p - t).abs() <= 0.05 * t + 1e-4, "{p} vs {t}");
        }
    }

    /// Where the best linear fit would give a feature a negative weight (here steps cost less
    /// the more context their chunk sees, beyond what its attention costs: a machine the
    /// features do not describe), that weight is held at zero and the others fit without it:
    /// predictions stay centred on the measured times, not all off the same way.
    #[test]
    fn a_weight_that_would_be_negative_is_held_at_zero_and_the_rest_still_fit() {
        let truth = |s: &StepShape| {
            (0.01 + 0.002 * s.tokens as f64 + 2e-7 * s.chunk_attention - 1.5e-6 * s.chunk_context)
                .max(0.0)
        };
        let mut m = LinearCost::default();
        let shapes: Vec<StepShape> = (0..300)
            .map(|i| {
                let mut s = StepShape::default();
                for d in 0..8 {
                    s.add_decode(300 + 10 * d + i, 1);
                }
                s.with_run(20 * i, 20 + i % 7).with_logits(8)
            })
            .collect();
        for s in &shapes {
            m.observe(s, truth(s));
        }
        assert!(m.weights().iter().all(|&w| w >= 0.0));
        assert_eq!(m.weights()[4], 0.0, "{:?}", m.weights());
        let ratios: Vec<f64> = shapes[250..]
            .iter()
            .map(|s| m.predict(s) / truth(s))
            .collect();
        let mean = ratios.iter().sum::<f64>() / ratios.len() as f64;
        assert!(
            (mean - 1.0).abs() <= 0.03,
            "predictions {mean:.3}x the truth"
        );
    }

    #[test]
    fn ignores_nonsense_and_never_predicts_negative() {
        let mut m = LinearCost::default();
        let s = StepShape::default().with_run(0, 10);
        m.observe(&s, f64::NAN);
        m.observe(&s, -1.0);
        assert_eq!(m.weights(), LinearCost::default().weights());
        for _ in 0..50 {
            m.observe(&StepShape::default().with_run(0, 1), 0.0);
        }
        assert!(m.predict(&StepShape::default().with_run(0, 500)) >= 0.0);
    }
}
