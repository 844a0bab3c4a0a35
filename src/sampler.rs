//! Turns a row of logits into a token: penalties, temperature, top-k, top-p, min-p, and a seeded
//! RNG per request (same seed, same output). Pure code over `&mut [f32]`, no tensors, tested alone.
//!
//! Written here rather than taken from candle-transformers' `LogitsProcessor` because that one has
//! no min-p and no penalties. The order follows vLLM / HF: penalties, then temperature, then the
//! truncations, then sampling.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling settings of one request (validated at the edge).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    /// 1 = off (HF style: divides positive logits, multiplies negative ones, over prompt + output).
    pub repetition_penalty: f32,
    /// OpenAI style, over the output: minus this once a token has appeared.
    pub presence_penalty: f32,
    /// OpenAI style, over the output: minus this per occurrence.
    pub frequency_penalty: f32,
    /// `None` = a random seed.
    pub seed: Option<u64>,
    /// May run speculative drafts where the server speculates (it never changes the tokens; a
    /// client may opt out, e.g. to compare timings).
    pub speculate: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            speculate: true,
        }
    }
}

/// The sampling settings as a request or the config file gives them, each optional (absent: the
/// level below decides). The one spelling of the knobs: the native `params`, OpenAI's bodies and
/// Realtime's `session` / `response` flatten it into their own shapes, and the config file's
/// `[sampling]` section is one. A new knob is a field here, in `SamplingParams` and in `check`.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingOverrides {
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Any 64-bit integer (OpenAI's seed is signed): a negative one is taken as its bits.
    #[serde(default, deserialize_with = "any_64_bit_integer")]
    pub seed: Option<u64>,
    /// This server's: `false` keeps the request from speculative drafts.
    pub speculate: Option<bool>,
}

/// Reads an optional signed or unsigned 64-bit integer as its 64 bits.
fn any_64_bit_integer<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    struct Bits;
    impl serde::de::Visitor<'_> for Bits {
        type Value = u64;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a 64-bit integer")
        }
        fn visit_u64<E>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }
        fn visit_i64<E>(self, v: i64) -> Result<u64, E> {
            Ok(v as u64)
        }
    }
    struct Optional;
    impl<'de> serde::de::Visitor<'de> for Optional {
        type Value = Option<u64>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a 64-bit integer or null")
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(Bits).map(Some)
        }
    }
    d.deserialize_option(Optional)
}

impl SamplingOverrides {
    /// The field names, as the wire and the config file spell them.
    pub const FIELDS: [&'static str; 9] = [
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "speculate",
    ];

    /// These values where given, `base`'s elsewhere (not yet checked: see `SamplingParams::check`).
    pub fn over(&self, base: &SamplingParams) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature.unwrap_or(base.temperature),
            top_k: self.top_k.unwrap_or(base.top_k),
            top_p: self.top_p.unwrap_or(base.top_p),
            min_p: self.min_p.unwrap_or(base.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(base.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(base.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(base.frequency_penalty),
            seed: self.seed.or(base.seed),
            speculate: self.speculate.unwrap_or(base.speculate),
        }
    }

    /// `top`'s values where it has them, these elsewhere (a Realtime response over its session).
    pub fn under(&self, top: &SamplingOverrides) -> SamplingOverrides {
        SamplingOverrides {
            temperature: top.temperature.or(self.temperature),
            top_k: top.top_k.or(self.top_k),
            top_p: top.top_p.or(self.top_p),
            min_p: top.min_p.or(self.min_p),
            repetition_penalty: top.repetition_penalty.or(self.repetition_penalty),
            presence_penalty: top.presence_penalty.or(self.presence_penalty),
            frequency_penalty: top.frequency_penalty.or(self.frequency_penalty),
            seed: top.seed.or(self.seed),
            speculate: top.speculate.or(self.speculate),
        }
    }
}

/// A sampling setting outside its range: the field (as `SamplingParams` names it), what is
/// allowed, and the value given.
#[derive(Debug, Clone, PartialEq)]
pub struct OutOfRange {
    pub field: &'static str,
    pub allowed: &'static str,
    pub given: String,
}

impl SamplingParams {
    /// The one definition of every setting's range: the wire (`params.*`), the config file
    /// (`sampling.*`) and the `generate` command all check with it.
    pub fn check(&self) -> Result<(), OutOfRange> {
        fn within(v: f32, lo: f32, hi: f32, lo_open: bool) -> bool {
            v.is_finite() && (if lo_open { v > lo } else { v >= lo }) && v <= hi
        }
        let f32s = [
            (
                "temperature",
                self.temperature,
                0.0,
                2.0,
                false,
                "between 0 and 2",
            ),
            ("top_p", self.top_p, 0.0, 1.0, true, "in (0, 1]"),
            ("min_p", self.min_p, 0.0, 1.0, false, "between 0 and 1"),
            (
                "repetition_penalty",
                self.repetition_penalty,
                0.0,
                2.0,
                true,
                "in (0, 2]",
            ),
            (
                "presence_penalty",
                self.presence_penalty,
                -2.0,
                2.0,
                false,
                "between -2 and 2",
            ),
            (
                "frequency_penalty",
                self.frequency_penalty,
                -2.0,
                2.0,
                false,
                "between -2 and 2",
            ),
        ];
        for (field, v, lo, hi, lo_open, allowed) in f32s {
            if !within(v, lo, hi, lo_open) {
                return Err(OutOfRange {
                    field,
                    allowed,
                    given: v.to_string(),
                });
            }
        }
        if self.top_k > MAX_TOP_K {
            return Err(OutOfRange {
                field: "top_k",
                allowed: "between 0 (off) and 1000",
                given: self.top_k.to_string(),
            });
        }
        Ok(())
    }
}

/// The largest `top_k` accepted.
pub const MAX_TOP_K: usize = 1000;

/// Per-request sampling state.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Occurrences of each token in the output so far.
    counts: HashMap<u32, u32>,
    /// Distinct prompt tokens (repetition penalty only).
    prompt: Vec<u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        let mut p: Vec<u32> = if params.repetition_penalty != 1.0 {
            prompt.to_vec()
        } else {
            Vec::new()
        };
        p.sort_unstable();
        p.dedup();
        Sampler {
            params,
            rng,
            counts: HashMap::new(),
            prompt: p,
        }
    }

    /// Records an output token (for penalties).
    pub fn observe(&mut self, token: u32) {
        *self.counts.entry(token).or_default() += 1;
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let rp = p.repetition_penalty;
            let mut penalize = |t: u32| {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / rp } else { *l * rp };
                }
            };
            for &t in &self.prompt {
                penalize(t);
            }
            for &t in self.counts.keys() {
                if self.prompt.binary_search(&t).is_err() {
                    penalize(t);
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in &self.counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
    }

    /// Picks the next token from `logits` (modified in place). Non-finite logits never break
    /// it: NaN counts as impossible, +inf as the most likely value there is.
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        let prepared = self.prepare(logits);
        self.draw(prepared)
    }

    /// `sample`'s work up to the random draw: penalties, temperature and truncation over
    /// `logits` (modified in place). It reads the sampler only, so the engine prepares a step's
    /// rows on all threads and then draws each in order.
    pub fn prepare(&self, logits: &mut [f32]) -> Prepared {
        self.apply_penalties(logits);
        sanitize(logits);
        let p = &self.params;
        if p.temperature < MIN_TEMPERATURE {
            return Prepared(Choice::Token(argmax(logits)));
        }
        // Candidates sorted by logit, cut to top-k.
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]);
        if p.top_k > 0 && p.top_k < idx.len() {
            idx.select_nth_unstable_by(p.top_k - 1, by_logit);
            idx.truncate(p.top_k);
        }
        idx.sort_unstable_by(by_logit);
        let inv_t = 1.0 / p.temperature;
        let max = logits[idx[0] as usize];
        let mut probs: Vec<f32> = idx
            .iter()
            .map(|&i| ((logits[i as usize] - max) * inv_t).exp())
            .collect();
        let sum: f32 = probs.iter().sum();
        if !max.is_finite() || !sum.is_finite() || sum <= 0.0 {
            // Nothing possible (every logit NaN or -inf): the first token, as greedy would.
            return Prepared(Choice::Token(argmax(logits)));
        }
        probs.iter_mut().for_each(|x| *x /= sum);
        // top-p: smallest prefix whose mass reaches top_p (at least one token).
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, &pr) in probs.iter().enumerate() {
                acc += pr;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        // min-p: drop tokens below min_p times the top probability.
        if p.min_p > 0.0 {
            let floor = p.min_p * probs[0];
            keep = keep.min(probs.iter().take_while(|&&x| x >= floor).count().max(1));
        }
        idx.truncate(keep);
        probs.truncate(keep);
        Prepared(Choice::Draw { idx, probs })
    }

    /// The token of a row `prepare` made: the seeded random draw where it is one.
    pub fn draw(&mut self, prepared: Prepared) -> u32 {
        let (idx, probs) = match prepared.0 {
            Choice::Token(t) => return t,
            Choice::Draw { idx, probs } => (idx, probs),
        };
        let total: f32 = probs.iter().sum();
        let mut r = self.rng.random::<f32>() * total;
        for (i, &pr) in probs.iter().enumerate() {
            if r < pr {
                return idx[i];
            }
            r -= pr;
        }
        idx[probs.len() - 1]
    }
}

/// A row ready for `Sampler::draw`.
#[derive(Debug)]
pub struct Prepared(Choice);

#[derive(Debug)]
enum Choice {
    /// Greedy, or nothing possible: this token.
    Token(u32),
    /// A random draw among these tokens, most likely first, with their probabilities.
    Draw { idx: Vec<u32>, probs: Vec<f32> },
}

/// Temperatures below this sample greedily: dividing by them overflows the exponent (1e-45 made
/// every probability NaN).
pub const MIN_TEMPERATURE: f32 = 1e-5;

/// NaN becomes -inf (never picked), +inf the largest finite value (so softmax stays finite).
fn sanitize(logits: &mut [f32]) {
    for l in logits.iter_mut() {
        if l.is_nan() {
            *l = f32::NEG_INFINITY;
        } else if *l == f32::INFINITY {
            *l = f32::MAX;
        }
    }
}

/// Index of the largest value (the first one on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// The most alternatives `log_probs` reports per token (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A sampled token's log-probability under the model's own distribution (the log-softmax of the
/// raw logits, before penalties, temperature and truncation, as OpenAI and vLLM report it), and
/// the `top` most likely tokens with theirs, most likely first.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log-probability and the `top` best under the log-softmax of `logits`. NaN counts as
/// impossible (-inf), as in sampling.
pub fn log_probs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let clean = |x: f32| {
        if x.is_nan() {
            f32::NEG_INFINITY
        } else {
            x.min(f32::MAX)
        }
    };
    let max = logits
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| m.max(clean(x)));
    let sum: f64 = logits
        .iter()
        .map(|&x| f64::from(clean(x) - max).exp())
        .sum();
    let log_z = max + sum.ln() as f32;
    let lp = |i: u32| {
        logits
            .get(i as usize)
            .map_or(f32::NEG_INFINITY, |&x| clean(x) - log_z)
    };
    let k = top.min(MAX_TOP_LOGPROBS).min(logits.len());
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let by = |a: &u32, b: &u32| {
        clean(logits[*b as usize])
            .total_cmp(&clean(logits[*a as usize]))
            .then(a.cmp(b))
    };
    if k > 0 && k < idx.len() {
        idx.select_nth_unstable_by(k - 1, by);
    }
    idx.truncate(k);
    idx.sort_unstable_by(by);
    TokenLogprobs {
        logprob: lp(token),
        top: idx.into_iter().map(|i| (i, lp(i))).collect(),
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn overrides_name_every_field_once_and_take_any_64_bit_seed() {
        let all: SamplingOverrides = serde_json::from_str(
            r#"{"temperature":0.5,"top_k":3,"top_p":0.9,"min_p":0.1,"repetition_penalty":1.1,
                "presence_penalty":0.2,"frequency_penalty":0.3,"seed":-1}"#,
        )
        .unwrap();
        let v = serde_json::to_value(&all).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        let mut want = SamplingOverrides::FIELDS.to_vec();
        let mut got = keys.clone();
        want.sort();
        got.sort();
        assert_eq!(got, want);
        assert_eq!(all.seed, Some(u64::MAX));
        let p = all.over(&SamplingParams::default());
        assert_eq!((p.temperature, p.top_k, p.seed), (0.5, 3, Some(u64::MAX)));
        assert!(serde_json::from_str::<SamplingOverrides>(r#"{"temprature":1}"#).is_err());
        let base = SamplingOverrides {
            temperature: Some(1.0),
            top_k: Some(5),
            ..Default::default()
        };
        let top = SamplingOverrides {
            temperature: Some(0.0),
            ..Default::default()
        };
        let m = base.under(&top);
        assert_eq!((m.temperature, m.top_k), (Some(0.0), Some(5)));
        let d = SamplingOverrides::default().over(&p);
        assert_eq!(d, p, "nothing given: the base");
    }

    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// Logits with NaN and infinities, any temperature: the token is in range, never a NaN or
        /// -inf position while another exists, a +inf position whenever there is one, and below
        /// the smallest temperature the greedy choice.
        #[test]
        fn non_finite_logits_and_tiny_temperatures_are_safe(
            raw in proptest::collection::vec(prop_oneof![
                6 => -30.0f32..30.0,
                1 => Just(f32::NAN),
                1 => Just(f32::INFINITY),
                1 => Just(f32::NEG_INFINITY),
            ], 1..40),
            temperature in prop_oneof![Just(0.0f32), Just(1e-45), Just(1e-6), 0.05f32..2.0],
            top_k in 0usize..5,
            seed in any::<u64>(),
        ) {
            let params = SamplingParams { temperature, top_k, seed: Some(seed), ..Default::default() };
            let mut s = Sampler::new(params, &[]);
            let mut logits = raw.clone();
            let t = s.sample(&mut logits) as usize;
            prop_assert!(t < raw.len());
            let possible = raw.iter().any(|x| !x.is_nan() && *x != f32::NEG_INFINITY);
            if possible {
                prop_assert!(!raw[t].is_nan() && raw[t] != f32::NEG_INFINITY, "{t}: {raw:?}");
            }
            if raw.contains(&f32::INFINITY) && top_k != 1 {
                prop_assert_eq!(raw[t], f32::INFINITY, "{:?}", raw);
            }
            if temperature < MIN_TEMPERATURE {
                let mut clean = raw.clone();
                sanitize(&mut clean);
                prop_assert_eq!(t as u32, argmax(&clean));
            }
        }
    }

    #[test]
    fn log_probs_are_the_log_softmax_with_the_best_first() {
        let logits = [1.0f32, 3.0, f32::NAN, 2.0, -1.0];
        let z: f64 = [1.0f64, 3.0, 2.0, -1.0].iter().map(|x| x.exp()).sum();
        let want = |x: f64| (x - z.ln()) as f32;
        let lp = log_probs(&logits, 0, 3);
        assert!((lp.logprob - want(1.0)).abs() < 1e-6, "{lp:?}");
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 0]);
        assert!((lp.top[0].1 - want(3.0)).abs() < 1e-6);
        assert_eq!(log_probs(&logits, 2, 0).logprob, f32::NEG_INFINITY);
        assert!(log_probs(&logits, 1, 99).top.len() == 5);
        let total: f32 = log_probs(&logits, 1, 5).top.iter().map(|t| t.1.exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

    #[test]
    fn every_range_is_checked_and_named() {
        assert_eq!(SamplingParams::default().check(), Ok(()));
        type Set = fn(&mut SamplingParams);
        let cases: [(&str, Set); 8] = [
            ("temperature", |p| p.temperature = 2.5),
            ("temperature", |p| p.temperature = f32::NAN),
            ("top_p", |p| p.top_p = 0.0),
            ("min_p", |p| p.min_p = -0.1),
            ("repetition_penalty", |p| p.repetition_penalty = 0.0),
            ("presence_penalty", |p| p.presence_penalty = 2.1),
            ("frequency_penalty", |p| p.frequency_penalty = -3.0),
            ("top_k", |p| p.top_k = MAX_TOP_K + 1),
        ];
        for (field, set) in cases {
            let mut p = SamplingParams::default();
            set(&mut p);
            assert_eq!(p.check().unwrap_err().field, field);
        }
        let edges = SamplingParams {
            temperature: 2.0,
            top_p: 1.0,
            min_p: 1.0,
            repetition_penalty: 2.0,
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            top_k: MAX_TOP_K,
            ..SamplingParams::default()
        };
        assert_eq!(edges.check(), Ok(()));
    }

    fn params(t: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            seed: Some(7),
            ..Default::default()
        }
    }

    #[test]
    fn greedy_takes_the_max() {
        let mut s = Sampler::new(params(0.0), &[]);
        assert_eq!(s.sample(&mut [0.1, 3.0, 2.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = || {
            let mut s = Sampler::new(params(1.0), &[]);
            (0..20)
                .map(|_| s.sample(&mut logits.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
        assert!(
            run().iter().collect::<std::collections::HashSet<_>>().len() > 3,
            "it samples"
        );
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let logits = vec![1.0, 5.0, 4.9, 0.0];
        let mut s = Sampler::new(
            SamplingParams {
                top_k: 1,
                ..params(1.5)
            },
            &[],
        );
        let mut s2 = Sampler::new(
            SamplingParams {
                top_p: 0.01,
                ..params(1.5)
            },
            &[],
        );
        let mut s3 = Sampler::new(
            SamplingParams {
                min_p: 0.999,
                ..params(1.5)
            },
            &[],
        );
        for _ in 0..20 {
            assert_eq!(s.sample(&mut logits.clone()), 1);
            assert_eq!(s2.sample(&mut logits.clone()), 1);
            assert_eq!(s3.sample(&mut logits.clone()), 1);
        }
    }

    #[test]
    fn penalties_move_the_choice() {
        let mut s = Sampler::new(
            SamplingParams {
                presence_penalty: 1.0,
                ..params(0.0)
            },
            &[],
        );
        s.observe(1);
        assert_eq!(s.sample(&mut [0.0, 2.0, 1.5]), 2);
        let mut s = Sampler::new(
            SamplingParams {
                repetition_penalty: 2.0,
                ..params(0.0)
            },
            &[1],
        );
        assert_eq!(s.sample(&mut [0.0, 2.0, 1.5]), 2);
        let mut s = Sampler::new(
            SamplingParams {
                frequency_penalty: 0.3,
                ..params(0.0)
            },
            &[],
        );
        s.observe(1);
        s.observe(1);
        assert_eq!(s.sample(&mut [0.0, 2.0, 1.5]), 2);
    }
}
