//! Rotary position embedding on CPU, half-split (Hugging Face) layout, for a flat step batch.
//!
//! candle-nn's CPU `rope_thd` walks heads in its innermost loop (strided) and parallelizes over
//! the batch dimension only, which is 1 for a step batch: it took ~15% of a 16-token prefill here.
//! This version parallelizes over tokens and runs the contiguous half-rows in the inner loop.

use crate::model::team;

/// Tokens per parallel task (below that a step runs on one thread).
const TOKENS_PER_TASK: usize = 8;

/// `x`: `[tokens, heads * d]`; `cos`, `sin`: `[tokens, d / 2]` (each token's position).
pub fn rope_half(x: &[f32], heads: usize, d: usize, cos: &[f32], sin: &[f32]) -> Vec<f32> {
    let half = d / 2;
    let row = heads * d;
    assert_eq!(x.len() % row, 0);
    let tokens = x.len() / row;
    assert_eq!(cos.len(), tokens * half);
    assert_eq!(sin.len(), tokens * half);
    let mut out = vec![0f32; x.len()];
    team::chunks_mut(&mut out, row, TOKENS_PER_TASK, |t, o| {
        let xr = &x[t * row..][..row];
        let (c, s) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        for (oh, xh) in o.chunks_exact_mut(d).zip(xr.chunks_exact(d)) {
            let (x1, x2) = xh.split_at(half);
            let (o1, o2) = oh.split_at_mut(half);
            for i in 0..half {
                o1[i] = x1[i] * c[i] - x2[i] * s[i];
                o2[i] = x2[i] * c[i] + x1[i] * s[i];
            }
        }
    });
    out
}

/// `rope_half` in place on `heads * d` values at `offset` in each row of `x` (rows `stride` apart):
/// the CPU layer path rotates Q and K where the stacked QKV projection put them.
#[allow(clippy::too_many_arguments)]
pub fn rope_half_in_place(
    x: &mut [f32],
    stride: usize,
    offset: usize,
    heads: usize,
    d: usize,
    cos: &[f32],
    sin: &[f32],
) {
    let half = d / 2;
    assert!(offset + heads * d <= stride && x.len().is_multiple_of(stride));
    let tokens = x.len() / stride;
    assert_eq!(cos.len(), tokens * half);
    assert_eq!(sin.len(), tokens * half);
    let rotate = |t: usize, row: &mut [f32]| {
        let (c, s) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        for h in row[offset..offset + heads * d].chunks_exact_mut(d) {
            let (x1, x2) = h.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (x1[i], x2[i]);
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    };
    if tokens < 2 * TOKENS_PER_TASK {
        x.chunks_exact_mut(stride)
            .enumerate()
            .for_each(|(t, r)| rotate(t, r));
    } else {
        team::chunks_mut(x, stride, TOKENS_PER_TASK, rotate);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn matches_candle_rope_thd() {
        let dev = Device::Cpu;
        let (t, h, d) = (11, 3, 16);
        let x = Tensor::randn(0f32, 1.0, (t, h * d), &dev).unwrap();
        let cos = Tensor::randn(0f32, 1.0, (t, d / 2), &dev).unwrap();
        let sin = Tensor::randn(0f32, 1.0, (t, d / 2), &dev).unwrap();
        let want = candle_nn::rotary_emb::rope_thd(&x.reshape((1, t, h, d)).unwrap(), &cos, &sin)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let v = |a: &Tensor| a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let got = rope_half(&v(&x), h, d, &v(&cos), &v(&sin));
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        // In place, inside wider rows (Q's heads at offset 5 of 60), on enough tokens to go parallel.
        for t in [t, 40] {
            let (x, cos, sin) = (
                super::super::test_data::lcg(1, t * h * d),
                super::super::test_data::lcg(2, t * d / 2),
                super::super::test_data::lcg(3, t * d / 2),
            );
            let want = rope_half(&x, h, d, &cos, &sin);
            let stride = h * d + 12;
            let mut wide = vec![7f32; t * stride];
            for (w, xr) in wide.chunks_exact_mut(stride).zip(x.chunks_exact(h * d)) {
                w[5..5 + h * d].copy_from_slice(xr);
            }
            rope_half_in_place(&mut wide, stride, 5, h, d, &cos, &sin);
            for (w, wr) in wide.chunks_exact(stride).zip(want.chunks_exact(h * d)) {
                assert_eq!(&w[5..5 + h * d], wr);
                assert!(w[..5].iter().chain(&w[5 + h * d..]).all(|&v| v == 7.0));
            }
        }
    }
}
