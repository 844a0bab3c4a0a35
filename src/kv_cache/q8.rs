//! The Q8 KV cache format (`engine.kv_dtype = "q8_0"`): each head's row of a token's K or V is
//! `head_dim` 8-bit codes and one F16 scale, the value `(code - 128) * scale`, where the scale is the
//! row's largest magnitude over 127 (llama.cpp's `q8_0` cache and ggml's Q8_0 quantization, with a
//! block of one head row instead of 32 values: 64 codes share a scale, so a token costs 1.03 bytes
//! per value against F16's 2).
//!
//! Codes are stored as `u8` offset by 128 rather than as `i8` because candle has no signed byte
//! type; the offset also makes the generic path's dequantization one affine op. Scales sit in a
//! tensor of their own (`[layers, slots, heads]` F16) beside the codes (`[layers, slots, kv_dim]`
//! U8), so that every device gathers and scatters both with candle's ordinary ops.
//!
//! Two implementations of quantizing: `quantize_rows` over plain slices for the CPU (the step's
//! K/V rows are already there), and `quantize` with candle ops for every device. They give the
//! same bits (same formulas in the same order; a test holds them to it), so a CPU run and a GPU run
//! write the same cache.

use candle_core::{DType, Tensor};
use half::f16;

use crate::error::Result;

/// The largest code magnitude: codes run over -127..=127 (128 + that in storage).
const QMAX: f32 = 127.0;

/// A row's scale as stored: its largest magnitude over 127, rounded to F16.
#[inline]
fn scale_of(row: &[f32]) -> f16 {
    let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
    f16::from_f32(amax * (1.0 / QMAX))
}

/// A value's stored code under scale `s` (the F16 scale read back as F32). A zero scale gives
/// code 128 (value 0) whatever the row held: a row of values below F16's smallest scale.
#[inline]
fn code_of(x: f32, s: f32) -> u8 {
    let q = (x / s.max(f32::MIN_POSITIVE)).round().clamp(-QMAX, QMAX);
    (q + 128.0) as u8
}

/// Quantizes rows of `heads * head_dim` values (`x.len()` a multiple of `head_dim`): the codes,
/// `x.len()` of them, and one scale per head row, in order.
pub fn quantize_rows(x: &[f32], head_dim: usize) -> (Vec<u8>, Vec<f16>) {
    let mut codes = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / head_dim);
    for head in x.chunks_exact(head_dim) {
        let s = scale_of(head);
        let sf = s.to_f32();
        codes.extend(head.iter().map(|&v| code_of(v, sf)));
        scales.push(s);
    }
    (codes, scales)
}

/// The values of codes and their head rows' scales (`codes.len() == scales.len() * head_dim`).
pub fn dequantize_rows(codes: &[u8], scales: &[f16], head_dim: usize) -> Vec<f32> {
    codes
        .chunks_exact(head_dim)
        .zip(scales)
        .flat_map(|(c, s)| {
            let s = s.to_f32();
            c.iter().map(move |&q| (q as f32 - 128.0) * s)
        })
        .collect()
}

/// `quantize_rows` with candle ops, on any device: `x` is `[n, heads * head_dim]` (any float
/// type); returns the codes `[n, heads * head_dim]` U8 and the scales `[n, heads]` F16.
pub fn quantize(x: &Tensor, heads: usize) -> Result<(Tensor, Tensor)> {
    let (n, width) = x.dims2()?;
    let x = x.to_dtype(DType::F32)?.reshape((n, heads, width / heads))?;
    let scales = x.abs()?.max_keepdim(2)?.affine(1.0 / QMAX as f64, 0.0)?;
    let scales = scales.to_dtype(DType::F16)?;
    let s = scales
        .to_dtype(DType::F32)?
        .clamp(f32::MIN_POSITIVE, f32::INFINITY)?;
    let codes = x
        .broadcast_div(&s)?
        .round()?
        .clamp(-QMAX, QMAX)?
        .affine(1.0, 128.0)?
        .to_dtype(DType::U8)?
        .reshape((n, width))?;
    Ok((codes, scales.reshape((n, heads))?))
}

/// `dequantize_rows` with candle ops: codes `[n, heads * head_dim]` U8 and scales `[n, heads]`
/// F16 to `[n, heads * head_dim]` F32.
pub fn dequantize(codes: &Tensor, scales: &Tensor) -> Result<Tensor> {
    let (n, width) = codes.dims2()?;
    let heads = scales.dim(1)?;
    let s = scales.to_dtype(DType::F32)?.reshape((n, heads, 1))?;
    Ok(codes
        .to_dtype(DType::F32)?
        .affine(1.0, -128.0)?
        .reshape((n, heads, width / heads))?
        .broadcast_mul(&s)?
        .reshape((n, width))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use proptest::prelude::*;

    /// Rows with the shapes a cache sees: magnitudes over many octaves, exact zeros, a zero row,
    /// an outlier per row (K's channels), values at half a step (rounding ties).
    fn rows(seed: u64, n: usize, width: usize) -> Vec<f32> {
        let mut x = seed | 1;
        let mut next = move || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            x
        };
        (0..n * width)
            .map(|i| {
                let r = next();
                let u = ((r >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
                let octave = ((r >> 8) % 24) as i32 - 12;
                match (i / width, i % 7) {
                    (1, _) => 0.0,
                    (_, 0) => 0.0,
                    (_, 3) => u * 40.0,
                    (_, 5) => (((r >> 16) % 255) as f32 - 127.0 + 0.5) / 127.0,
                    _ => u * 2f32.powi(octave),
                }
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// The CPU quantizer and the candle one give the same bits; every value comes back within
        /// half a step of its row's scale (the F16 scale's rounding included).
        #[test]
        fn both_quantizers_agree_and_round_to_the_nearest_step(
            seed in any::<u64>(),
            n in 1usize..6,
            heads in 1usize..4,
            hd in prop::sample::select(vec![8usize, 64, 128]),
        ) {
            let width = heads * hd;
            let x = rows(seed, n, width);
            let (codes, scales) = quantize_rows(&x, hd);
            let t = Tensor::from_vec(x.clone(), (n, width), &Device::Cpu).unwrap();
            let (tc, ts) = quantize(&t, heads).unwrap();
            prop_assert_eq!(&tc.flatten_all().unwrap().to_vec1::<u8>().unwrap(), &codes);
            let ts = ts.flatten_all().unwrap().to_vec1::<f16>().unwrap();
            prop_assert_eq!(
                ts.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
                scales.iter().map(|s| s.to_bits()).collect::<Vec<_>>()
            );
            let back = dequantize_rows(&codes, &scales, hd);
            let tb = dequantize(&tc, &Tensor::from_vec(ts, (n, heads), &Device::Cpu).unwrap())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            prop_assert_eq!(&tb, &back);
            for (h, (row, s)) in x.chunks(hd).zip(&scales).enumerate() {
                let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                let s = s.to_f32();
                // The F16 scale is amax / 127 rounded to nearest (relative 2^-11, or half the
                // subnormal spacing 2^-24); a value then lands within half a step of its code, or
                // at the end of the range where the rounded scale fell short of amax / 127.
                let err = (s - amax / 127.0).abs();
                prop_assert!(err <= amax / 127.0 * 2f32.powi(-11) + 2f32.powi(-25));
                for (i, (&v, &b)) in row.iter().zip(&back[h * hd..(h + 1) * hd]).enumerate() {
                    prop_assert!(
                        (v - b).abs() <= s * 0.5 + 127.0 * err + amax * 1e-6,
                        "head row {h} value {i}: {v} came back as {b} (scale {s})"
                    );
                }
            }
        }
    }

    #[test]
    fn a_zero_row_is_zero_codes_and_a_zero_scale() {
        let (codes, scales) = quantize_rows(&[0.0; 16], 8);
        assert_eq!(codes, vec![128; 16]);
        assert_eq!(scales, vec![f16::ZERO; 2]);
        assert_eq!(dequantize_rows(&codes, &scales, 8), vec![0.0; 16]);
    }

    #[test]
    fn the_largest_magnitude_is_exact_up_to_the_scale_rounding() {
        let mut row = vec![0.25f32; 64];
        row[9] = -3.0;
        let (codes, scales) = quantize_rows(&row, 64);
        assert_eq!(codes[9], 1, "-127 stored as 1");
        let back = dequantize_rows(&codes, &scales, 64);
        assert!((back[9] + 3.0).abs() < 3.0 * 1e-3, "{}", back[9]);
    }
}
