//! Turns a row of logits into a token: penalties, temperature, top-k, top-p, min-p, and a seeded
//! draw per output token (same seed, same output): an exponential race keyed by the request's
//! seed, the token's place in the reply and each candidate's id, so a draw depends on neither the
//! order near-equal tokens sort in nor the step the row was computed in. Pure code over
//! `&mut [f32]`, no tensors, tested alone.
//!
//! Written here rather than taken from candle-transformers' `LogitsProcessor` because that one has
//! no min-p and no penalties. The order follows vLLM / HF: penalties, then temperature, then the
//! truncations, then sampling.

use std::collections::HashMap;

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
    /// The request's random stream (its seed, scattered): the draw for output token `n` is
    /// keyed by it and `n` (`draw_key`), so a token's draw depends on nothing else.
    stream: u64,
    /// Tokens drawn so far.
    drawn: u64,
    /// Occurrences of each token in the output so far.
    counts: HashMap<u32, u32>,
    /// Distinct prompt tokens (repetition penalty only).
    prompt: Vec<u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let stream = mix(params.seed.unwrap_or_else(rand::random));
        let mut p: Vec<u32> = if params.repetition_penalty != 1.0 {
            prompt.to_vec()
        } else {
            Vec::new()
        };
        p.sort_unstable();
        p.dedup();
        Sampler {
            params,
            stream,
            drawn: 0,
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

    /// `sample` without the bookkeeping: penalties, temperature, truncation and the seeded
    /// draw over `logits` (modified in place). It reads the sampler only, so the engine prepares
    /// a step's rows on all threads and then `draw`s each in order.
    pub fn prepare(&self, logits: &mut [f32]) -> Prepared {
        self.apply_penalties(logits);
        sanitize(logits);
        let p = &self.params;
        if p.temperature < MIN_TEMPERATURE {
            return Prepared(argmax(logits));
        }
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        if !max.is_finite() {
            // Nothing possible (every logit NaN or -inf): the first token, as greedy would.
            return Prepared(argmax(logits));
        }
        let Kept { idx, probs } = kept(weigh(logits, max, p.temperature), p, true);
        Prepared(race(&idx, &probs, self.draw_key()))
    }

    /// Takes the token of a row `prepare` made: the next output token draws with the next key.
    pub fn draw(&mut self, prepared: Prepared) -> u32 {
        self.drawn += 1;
        prepared.0
    }

    /// The key of the next draw: the request's stream and the draw's number, scattered.
    fn draw_key(&self) -> u64 {
        mix(self.stream ^ mix(self.drawn.wrapping_add(1).wrapping_mul(GOLDEN)))
    }
}

/// A row's token, from `Sampler::prepare`, for `Sampler::draw`.
#[derive(Debug)]
pub struct Prepared(u32);

/// The token an exponential race picks among `idx` with weights `w` (each > 0, any order, need
/// not sum to 1): token `i` draws `E_i ~ Exp(1)` from `key` and its own id, and the largest
/// `w_i / E_i` wins, which is token `i` with probability `w_i / sum(w)` (the race vLLM's sampler
/// runs as `probs / exponential()`). Unlike walking a cumulative sum in sorted order, the winner
/// does not depend on the order of the list: two near-equal tokens that swap places (the same
/// logits computed in another step shape differ in the last bits) change nothing, where the
/// walk then lands on a different token whenever the draw falls in either one's interval; and
/// nudging the weights changes the winner only if the best two scores were that close.
fn race(idx: &[u32], w: &[f32], key: u64) -> u32 {
    let mut best = (f64::NEG_INFINITY, u32::MAX);
    for (&i, &w) in idx.iter().zip(w) {
        let h = mix(key.wrapping_add(u64::from(i).wrapping_add(1).wrapping_mul(GOLDEN)));
        // Uniform in (0, 1) on 52 bits, so 1 - u is never rounded away and E > 0.
        let u = ((h >> 12) as f64 + 0.5) * (1.0 / (1u64 << 52) as f64);
        let score = f64::from(w) / -u.ln();
        if score > best.0 || (score == best.0 && i < best.1) {
            best = (score, i);
        }
    }
    best.1
}

/// 2^64 over the golden ratio: SplitMix64's increment.
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's finalizer: a bijection on 64 bits that scatters nearby inputs.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `logits` (finite maximum `max`) turned in place into each token's unnormalized probability
/// at temperature `t`: `exp((l - max) / t)`, 1 for the most likely token, 0 for impossible ones.
fn weigh(logits: &mut [f32], max: f32, t: f32) -> &[f32] {
    let inv_t = 1.0 / t;
    for l in logits.iter_mut() {
        *l = exp_nonpositive((*l - max) * inv_t);
    }
    logits
}

/// `exp(x)` for `x <= 0`, within 3e-7 of libm's relative to the result, exactly 1 at 0 and 0
/// below -87.3 (and at -inf): `x = n ln 2 + f` (`n` an integer, `|f| <= ln 2 / 2`, `n ln 2`
/// taken off in two parts so `f` keeps its bits), `2^n` into the exponent bits and `e^f` by its
/// Taylor polynomial of degree 6 (error 1.2e-7). Branch-free plain arithmetic, so a loop of it
/// vectorizes on any x86-64 and rounds the same everywhere; libm's `expf` is a call per value,
/// and 49,152 of them were half of a sampled row's time (~120 us).
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    // Adding 1.5 * 2^23 rounds to an integer, which then sits in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    // ln 2 in a part with few bits (n times it is exact) and the rest.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let xc = if x < -87.3 { -87.3 } else { x };
    let shifted = xc * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let f = (xc - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + f * (1.0
            + f * (0.5 + f * (1.0 / 6.0 + f * (1.0 / 24.0 + f * (1.0 / 120.0 + f / 720.0)))));
    // n is in [-126, 0]: 2^n is the float with biased exponent n + 127.
    let biased = (shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32 + 127) as u32;
    let v = f32::from_bits(biased << 23) * p;
    if x < -87.3 {
        0.0
    } else {
        v
    }
}

/// The sum of `w` in sixteen interleaved lanes, added up in a fixed order: the same value on
/// every machine, and a loop the compiler vectorizes (one running sum is a chain of 49,152
/// dependent adds).
fn lane_sum(w: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = w.chunks_exact(16);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    for (a, &x) in acc.iter_mut().zip(chunks.remainder()) {
        *a += x;
    }
    acc.iter().sum()
}

/// The tokens sampling may pick, most likely first, and their probabilities (normalized over
/// the whole vocabulary, or over the top-k, before top-p and min-p cut the list).
#[derive(Debug, PartialEq)]
struct Kept {
    idx: Vec<u32>,
    probs: Vec<f32>,
}

/// Top-k, top-p and min-p over the weights `w` (`weigh`'s), most likely first (ties: the lower
/// token id first; impossible tokens, weight 0, never listed), or in token id order when only
/// the temperature applies. With `prune`, only tokens that can survive top-p and min-p are sorted: the
/// vocabulary is 49,152 tokens for SmolLM2, and sorting all of them cost ~2.3 ms a token, a
/// share of every decode step; pruned, the kept list is the same
/// (`pruning_keeps_the_same_tokens_and_probabilities`).
fn kept(w: &[f32], p: &SamplingParams, prune: bool) -> Kept {
    let by = |a: &u32, b: &u32| w[*b as usize].total_cmp(&w[*a as usize]).then(a.cmp(b));
    let (mut idx, sum): (Vec<u32>, f32) = if p.top_k > 0 && p.top_k < w.len() {
        // Top-k, then the softmax over those k (HF's order).
        let mut idx: Vec<u32> = (0..w.len() as u32).collect();
        idx.select_nth_unstable_by(p.top_k - 1, by);
        idx.truncate(p.top_k);
        idx.retain(|&i| w[i as usize] > 0.0);
        idx.sort_unstable_by(by);
        let sum = idx.iter().map(|&i| w[i as usize]).sum();
        (idx, sum)
    } else {
        let sum = lane_sum(w);
        let floor = if prune { prune_floor(w, p, sum) } else { 0.0 };
        // (At least the smallest positive float: impossible tokens, weight 0, are never listed.)
        let floor = floor.max(f32::from_bits(1));
        let mut idx: Vec<u32> = Vec::new();
        for (i, &x) in w.iter().enumerate() {
            if x >= floor {
                idx.push(i as u32);
            }
        }
        // Without top-p and min-p nothing depends on the order: token id order, no sort.
        if p.top_p < 1.0 || p.min_p > 0.0 {
            idx.sort_unstable_by(by);
        }
        (idx, sum)
    };
    let mut probs: Vec<f32> = idx.iter().map(|&i| w[i as usize] / sum).collect();
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
    Kept { idx, probs }
}

/// A weight below which no token survives top-p and min-p (0: keep all), with room for the
/// rounding of the sums that decide them: min-p keeps weights of at least `min_p` (the top
/// token's is 1); top-p keeps a prefix of mass `top_p`, found here by binning the weights by
/// their binary exponent and summing the bins from the top until `top_p` plus 1% of the total.
fn prune_floor(w: &[f32], p: &SamplingParams, sum: f32) -> f32 {
    let mut floor = 0.0f32;
    if p.min_p > 0.0 {
        floor = p.min_p * (1.0 - 1e-3);
    }
    let target = p.top_p + 0.01;
    if target < 1.0 {
        // Bin e: weights in [2^-e, 2^(1-e)); weights are at most 1, so e = 0 holds exactly 1.
        // Weights below 2^-24 are left out (a row's are mostly those): all of them together are
        // under 1% of the total for vocabularies under 160,000 tokens (the top token weighs 1),
        // so the bins above still reach the target whenever it is below 0.99; when they do not,
        // top-p sets no floor (a lower floor only sorts more).
        let mut mass = [0f32; 25];
        for &x in w {
            if x >= 1.0 / (1u32 << 24) as f32 {
                let e = (127 - ((x.to_bits() >> 23) & 0xff) as i32).clamp(0, 24) as usize;
                mass[e] += x;
            }
        }
        let mut acc = 0.0f32;
        for (e, &m) in mass.iter().enumerate() {
            acc += m;
            if acc >= target * sum {
                floor = floor.max(f32::from_bits(((127 - e as u32) & 0xff) << 23));
                break;
            }
        }
    }
    floor
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

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// Sorting only the tokens that can survive top-p and min-p keeps exactly the tokens, the
        /// order and the probabilities that sorting the whole vocabulary keeps, on flat and
        /// peaked rows, with impossible tokens, at any temperature and truncation.
        #[test]
        fn pruning_keeps_the_same_tokens_and_probabilities(
            vocab in 1usize..3000,
            spread in prop_oneof![Just(0.01f32), 0.1f32..40.0],
            peaks in 0usize..5,
            impossible in 0usize..4,
            temperature in 0.05f32..2.0,
            top_p in prop_oneof![Just(1.0f32), Just(0.95), 0.05f32..1.0],
            min_p in prop_oneof![Just(0.0f32), Just(0.05), 0.0f32..1.0],
            top_k in prop_oneof![3 => Just(0usize), 1 => 1usize..60],
            seed in any::<u64>(),
        ) {
            let mut x = seed;
            let mut next = || {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (x >> 40) as f32 / (1u64 << 24) as f32
            };
            let mut logits: Vec<f32> = (0..vocab).map(|_| next() * spread).collect();
            for _ in 0..peaks {
                let at = (next() * vocab as f32) as usize % vocab;
                logits[at] += spread * 2.0;
            }
            for _ in 0..impossible {
                let at = (next() * vocab as f32) as usize % vocab;
                logits[at] = f32::NEG_INFINITY;
            }
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            prop_assume!(max.is_finite());
            let p = SamplingParams { temperature, top_p, min_p, top_k, ..Default::default() };
            let w = weigh(&mut logits, max, temperature);
            let pruned = kept(w, &p, true);
            prop_assert!(!pruned.idx.is_empty());
            prop_assert_eq!(pruned, kept(w, &p, false));
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

    /// The vectorizable `exp` against libm's over [-90, 0] (every 1/4096): within 3e-7 of it
    /// relative to the result above -87.3, 0 below, exactly 1 at 0 and 0 at -inf.
    #[test]
    fn exp_nonpositive_is_libms_exp_to_the_last_bits() {
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-0.0), 1.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        let mut worst = 0f64;
        for i in 0..=(90 * 4096) {
            let x = -(i as f32) / 4096.0;
            let (got, want) = (exp_nonpositive(x), x.exp());
            if x < -87.3 {
                assert_eq!(got, 0.0, "at {x}");
                continue;
            }
            let rel = ((got as f64 - want as f64) / want as f64).abs();
            worst = worst.max(rel);
            assert!(rel < 3e-7, "at {x}: {got} against {want} ({rel:e})");
        }
        assert!(worst > 0.0, "it is not libm's own exp");
    }

    /// Each token is drawn as often as its probability says (20,000 seeded draws).
    #[test]
    fn draws_follow_the_probabilities() {
        let probs = [0.5f32, 0.3, 0.15, 0.05];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
        let mut s = Sampler::new(
            SamplingParams {
                top_p: 1.0,
                min_p: 0.0,
                ..params(1.0)
            },
            &[],
        );
        let n = 20_000;
        let mut seen = [0usize; 4];
        for _ in 0..n {
            seen[s.sample(&mut logits.clone()) as usize] += 1;
        }
        for (t, (&c, &p)) in seen.iter().zip(&probs).enumerate() {
            let f = c as f32 / n as f32;
            assert!(
                (f - p).abs() < 0.012,
                "token {t}: drawn {f}, probability {p}"
            );
        }
    }

    /// The same logits computed in another step shape differ in their last bits (up to ~5e-6
    /// on an F32 model's 128,256-token row): on a flat row that reorders near-equal tokens, and a
    /// draw must not hinge on that order, or a seeded reply changes with how its steps were
    /// batched (speculation verifies several of a request's rows in one step). 300 draws over
    /// a flat 30,000-token row, each against a copy nudged by up to 5e-6: the same tokens.
    #[test]
    fn a_draw_does_not_hinge_on_the_last_bits_of_near_equal_logits() {
        let mut x = 12345u64;
        let mut next = || {
            x = mix(x.wrapping_add(GOLDEN));
            (x >> 40) as f32 / (1u64 << 24) as f32
        };
        let row: Vec<f32> = (0..30_000).map(|_| next() * 0.05).collect();
        let nudged: Vec<f32> = row.iter().map(|&l| l + (next() - 0.5) * 1e-5).collect();
        let p = SamplingParams {
            temperature: 0.7,
            top_p: 0.95,
            min_p: 0.0,
            ..params(0.7)
        };
        let (mut a, mut b) = (Sampler::new(p.clone(), &[]), Sampler::new(p, &[]));
        let mut differ = 0;
        let mut tokens = std::collections::HashSet::new();
        for _ in 0..300 {
            let t = a.sample(&mut row.clone());
            differ += usize::from(t != b.sample(&mut nudged.clone()));
            tokens.insert(t);
        }
        assert!(tokens.len() > 250, "it samples: {} distinct", tokens.len());
        assert_eq!(differ, 0, "of 300 draws");
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
