use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use std::time::Instant;
fn main() {
    llama_relay::settings::apply_process_settings(2, true);
    let d = Device::Cpu;
    let w = Tensor::randn(0f32, 1.0, (1536, 576), &d).unwrap();
    let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
    let qm = QMatMul::from_qtensor(q).unwrap();
    for t in [1usize, 8, 32, 128, 512] {
        let x = Tensor::randn(0f32, 1.0, (t, 576), &d).unwrap();
        let wt = w.t().unwrap();
        let mut best = (f64::MAX, f64::MAX, f64::MAX);
        for _ in 0..5 {
            let s = Instant::now();
            let _ = x.matmul(&wt).unwrap();
            let a = s.elapsed().as_secs_f64();
            let s = Instant::now();
            let _ = qm.forward(&x).unwrap();
            let b = s.elapsed().as_secs_f64();
            let s = Instant::now();
            let _ = qm.dequantize_f16().unwrap();
            let c = s.elapsed().as_secs_f64();
            best = (best.0.min(a), best.1.min(b), best.2.min(c));
        }
        let fl = 2.0 * t as f64 * 1536.0 * 576.0;
        println!(
            "t={t}: f32 gemm {:.1} GFLOP/s  q8_0 {:.1} GFLOP/s  dequant {:.2} ms",
            fl / best.0 / 1e9,
            fl / best.1 / 1e9,
            best.2 * 1e3
        );
    }
}
