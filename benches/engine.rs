//! Engine benchmark on the default model (or `--model PATH`): prompt processing speed, single-stream
//! decode, and batched decode at 1, 4, 8, 16 and 32 sequences (aggregate tokens/s and step
//! latency), with peak RSS. Medians over repeated runs.
//!
//!     cargo bench --bench engine -- [--threads 2] [--model PATH] [--reps 5] [--no-malloc-tuning]
//!                                   [--weights auto|keep|f32] [--kv f16|f32|q8_0] [--no-cpu-layers]
//!                                   [--device cpu|cuda|cuda:N]
//!     cargo bench --bench engine -- --compare-malloc     # prompt speed with and without malloc tuning
//!     cargo bench --bench engine -- --prompt-only --touch-cache   # the prompts after every KV
//!                                   # block was written once (no first-touch page faults)
//!     cargo bench --bench engine -- --kernels            # the Q8_0 matmul kernels alone, GFLOP/s
//!     cargo bench --bench engine -- --kernels-k          # Q4_K / Q6_K: ours against candle's
//!     cargo bench --bench engine -- --roof [--threads 2]  # this machine's roof, and the engine's
//!                                   # prefill, decode and projection kernels as shares of it
//!     cargo bench --bench engine -- --decode-only 16 [--context 128]   # one batch size, many steps
//!     cargo bench --bench engine -- --chunk 44 --context 464   # a cache-hit turn's prefill step
//!     cargo bench --bench engine -- --chunk 27 --context 433 --seqs 10   # ten such turns in one step
//!     cargo bench --bench engine -- --chunk 12 --context 5000 --decodes 8  # a long prompt's chunk
//!                                   # beside 8 streams: alone, the decodes alone, one step
//!     cargo bench --bench engine -- --attention 64 --context 1000 [--chunk 1] [--device cuda:0]
//!                                   # one layer's attention alone, each implementation the
//!                                   # device has (fast: CPU only; generic: any device;
//!                                   # ATTENTION_FAST_ONLY=1: the fast one alone;
//!                                   # --evict: the caches flushed before each call, so
//!                                   # the K/V rows come from DRAM as in a step)
//!
//! Never run it while something else uses the cores (a build, the tests): on two cores a second
//! busy process cuts the numbers several-fold.

use std::time::Instant;

use llama_relay::engine::{Engine, EngineOptions, Logits, SeqChunk, StepBatch};
use llama_relay::settings::apply_process_settings;

struct Args {
    threads: usize,
    model: Option<String>,
    reps: usize,
    malloc_tuning: bool,
    compare_malloc: bool,
    prompt_only: bool,
    touch_cache: bool,
    evict: bool,
    kernels: bool,
    kernels_k: bool,
    roof: bool,
    attention: Option<usize>,
    decode_only: Option<usize>,
    context: usize,
    chunk: Option<usize>,
    seqs: usize,
    decodes: usize,
    kv: llama_relay::kv_cache::KvDtype,
    no_cpu_layers: bool,
    weights: llama_relay::model::loader::WeightMode,
    device: candle_core::Device,
}

fn parse() -> Args {
    let mut a = Args {
        threads: 2,
        model: None,
        reps: 5,
        malloc_tuning: true,
        compare_malloc: false,
        prompt_only: false,
        touch_cache: false,
        evict: false,
        kernels: false,
        kernels_k: false,
        roof: false,
        attention: None,
        decode_only: None,
        context: 128,
        chunk: None,
        seqs: 1,
        decodes: 0,
        // The server's default (`engine.kv_dtype` in config/default.toml).
        kv: llama_relay::kv_cache::KvDtype::F16,
        no_cpu_layers: false,
        weights: llama_relay::model::loader::WeightMode::Auto,
        device: candle_core::Device::Cpu,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--threads" => a.threads = it.next().and_then(|v| v.parse().ok()).expect("--threads N"),
            "--model" => a.model = it.next(),
            "--reps" => a.reps = it.next().and_then(|v| v.parse().ok()).expect("--reps N"),
            "--no-malloc-tuning" => a.malloc_tuning = false,
            "--compare-malloc" => a.compare_malloc = true,
            "--prompt-only" => a.prompt_only = true,
            "--touch-cache" => a.touch_cache = true,
            "--evict" => a.evict = true,
            "--kernels" => a.kernels = true,
            "--kernels-k" => a.kernels_k = true,
            "--roof" => a.roof = true,
            "--attention" => {
                a.attention = Some(
                    it.next()
                        .and_then(|v| v.parse().ok())
                        .expect("--attention SEQS"),
                )
            }
            "--kv" => {
                a.kv = it
                    .next()
                    .as_deref()
                    .and_then(llama_relay::kv_cache::KvDtype::parse)
                    .expect("--kv f16|f32|q8_0")
            }
            "--no-cpu-layers" => a.no_cpu_layers = true,
            "--device" => {
                let d = it.next().expect("--device cpu|cuda|cuda:N");
                a.device =
                    llama_relay::settings::parse_device(&d).unwrap_or_else(|e| panic!("{e}"));
            }
            "--chunk" => a.chunk = Some(it.next().and_then(|v| v.parse().ok()).expect("--chunk N")),
            "--seqs" => a.seqs = it.next().and_then(|v| v.parse().ok()).expect("--seqs N"),
            "--decodes" => a.decodes = it.next().and_then(|v| v.parse().ok()).expect("--decodes N"),
            "--context" => a.context = it.next().and_then(|v| v.parse().ok()).expect("--context N"),
            "--weights" => {
                use llama_relay::model::loader::WeightMode;
                a.weights = match it.next().as_deref() {
                    Some("auto") => WeightMode::Auto,
                    Some("keep") => WeightMode::Keep,
                    Some("f32") => WeightMode::F32,
                    other => panic!("--weights auto|keep|f32, not {other:?}"),
                }
            }
            "--decode-only" => {
                a.decode_only = Some(
                    it.next()
                        .and_then(|v| v.parse().ok())
                        .expect("--decode-only N"),
                )
            }
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Median seconds of `f` over `reps` calls (at least 3) after one warm-up call.
fn median_time(reps: usize, f: impl Fn()) -> f64 {
    f();
    median(
        (0..reps.max(3))
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn rss_mib(field: &str) -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

/// Deterministic ordinary token ids (no special tokens) for synthetic prompts.
fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (200 + (x >> 33) as usize % (vocab - 400)) as u32
        })
        .collect()
}

fn prefill_once(e: &mut Engine, prompt: &[u32]) -> f64 {
    let mut table = Vec::new();
    assert!(e
        .pool
        .ensure_capacity(&mut table, prompt.len(), e.cache.block_size()));
    let batch = StepBatch {
        seqs: vec![SeqChunk {
            tokens: prompt.to_vec(),
            start_pos: 0,
            block_table: table.clone(),
            logits: Logits::Last,
        }],
    };
    let t = Instant::now();
    e.model.forward(&batch, &e.cache).unwrap();
    let s = t.elapsed().as_secs_f64();
    e.pool.release(&table);
    s
}

/// A chunk step beside `decodes` one-token rows (each after 400 cached positions, as chat replies
/// streaming while a long prompt prefills): the chunk alone, the decodes alone and both in one
/// step, alternating, each the median of `10 * reps`. Whether a mixed step costs the sum of its
/// parts is what the stall-free scheduler's cost model assumes.
fn mixed_step(e: &mut Engine, chunk: &StepBatch, decodes: usize, reps: usize) {
    const CTX: usize = 400;
    let tables = prefilled(e, decodes, CTX, 1, 1000);
    let dec = decode_rows(&tables, CTX);
    let both = StepBatch {
        seqs: dec.seqs.iter().chain(&chunk.seqs).cloned().collect(),
    };
    let mut times = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..10 * reps.max(1) {
        for (k, b) in [chunk, &dec, &both].into_iter().enumerate() {
            let t = Instant::now();
            let logits = e.model.forward(b, &e.cache).unwrap().unwrap();
            let _ = logits.argmax(1).unwrap().to_vec1::<u32>().unwrap();
            times[k].push(t.elapsed().as_secs_f64());
        }
    }
    let p90 = |t: &Vec<f64>| {
        let mut t = t.clone();
        t.sort_by(f64::total_cmp);
        t[t.len() * 9 / 10] * 1e3
    };
    let spread = times.each_ref().map(p90);
    let [c, d, m] = times.map(|t| median(t) * 1e3);
    let (n, ctx) = (chunk.seqs[0].tokens.len(), chunk.seqs[0].start_pos);
    println!(
        "{n}-token chunk after {ctx} cached: {c:.1} ms (p90 {:.1}) | {decodes} decodes after \
         {CTX}: {d:.1} ms (p90 {:.1}) | both in one step: {m:.1} ms (p90 {:.1}), {:.2}x the sum",
        spread[0],
        spread[1],
        spread[2],
        m / (c + d)
    );
    for t in &tables {
        e.pool.release(t);
    }
}

/// `n` sequences with `ctx`-token prompts (seeds from `seed`) prefilled in one step, each with room
/// for `room` more tokens: their block tables, for `e.pool.release` after.
fn prefilled(e: &mut Engine, n: usize, ctx: usize, room: usize, seed: u64) -> Vec<Vec<u32>> {
    let vocab = e.model.config().vocab_size;
    let bs = e.cache.block_size();
    let tables: Vec<Vec<u32>> = (0..n)
        .map(|_| {
            let mut t = Vec::new();
            assert!(
                e.pool.ensure_capacity(&mut t, ctx + room, bs),
                "cache too small"
            );
            t
        })
        .collect();
    // In steps of at most ~4,096 tokens (a whole 16 x 4,000 step would hold gigabytes of
    // activations).
    let per_step = (4096 / ctx.max(1)).max(1);
    for (c, group) in tables.chunks(per_step).enumerate() {
        let prompts: Vec<Vec<u32>> = (0..group.len())
            .map(|i| tokens(ctx, seed + (c * per_step + i) as u64, vocab))
            .collect();
        for from in (0..ctx).step_by(4096) {
            let len = 4096.min(ctx - from);
            let batch = StepBatch {
                seqs: (group.iter().zip(&prompts))
                    .map(|(t, prompt)| SeqChunk {
                        tokens: prompt[from..from + len].to_vec(),
                        start_pos: from,
                        block_table: t.clone(),
                        logits: Logits::None,
                    })
                    .collect(),
            };
            e.model.forward(&batch, &e.cache).unwrap();
        }
    }
    tables
}

/// One decode row per table, each the token `300 + i` at position `pos`.
fn decode_rows(tables: &[Vec<u32>], pos: usize) -> StepBatch {
    StepBatch {
        seqs: (tables.iter().enumerate())
            .map(|(i, t)| SeqChunk {
                tokens: vec![300 + i as u32],
                start_pos: pos,
                block_table: t.clone(),
                logits: Logits::Last,
            })
            .collect(),
    }
}

/// `n` sequences with `ctx`-token prompts, then `steps` decode steps over all of them at once.
/// Returns the median step time.
fn decode_batch(e: &mut Engine, n: usize, ctx: usize, steps: usize) -> f64 {
    let tables = prefilled(e, n, ctx, steps + 1, 0);
    // A first pass untimed: the KV cache's pages become resident as they are first written
    // (2 MiB pages zeroed on the first touch), a cost a warm server no longer pays; the timed
    // pass writes the same slots again.
    for s in 0..steps {
        let step = decode_rows(&tables, ctx + s);
        e.model.forward(&step, &e.cache).unwrap();
    }
    let mut times = Vec::new();
    for s in 0..steps {
        let step = decode_rows(&tables, ctx + s);
        let t = Instant::now();
        let logits = e.model.forward(&step, &e.cache).unwrap().unwrap();
        // Sampling needs the logits on the host: include that copy.
        let _ = logits.argmax(1).unwrap().to_vec1::<u32>().unwrap();
        times.push(t.elapsed().as_secs_f64());
    }
    for t in &tables {
        e.pool.release(t);
    }
    median(times)
}

/// The Q8_0 kernels alone on SmolLM2-135M's projection shapes (QKV stacked, O, gate+up stacked,
/// down, lm_head), random weights: row-at-a-time tiles (`q8_0`) against the 8-row repacked layout
/// (`q8_0x8`), Q4_1 in its 8-row layout (`q4_1x8`), and the dense path (dequantize, then F32 gemm), in GFLOP/s (2*m*n*k per call),
/// median of reps.
fn kernels(reps: usize) {
    use llama_relay::model::kernels::{
        q8_0,
        q8_0x8::{Repacked, RowGroups},
    };
    let shapes = [
        ("qkv", 960, 576),
        ("o", 576, 576),
        ("gate_up", 3072, 576),
        ("down", 576, 1536),
        ("lm_head", 49152, 576),
    ];
    println!(
        "shape        m   q8_0 GFLOP/s   q8_0x8 GFLOP/s   q4_1x8 GFLOP/s   dequant+gemm GFLOP/s"
    );
    for (name, n, k) in shapes {
        let wf: Vec<f32> = tokens(n * k, 7, 1 << 20)
            .iter()
            .map(|&t| (t as f32 / (1 << 19) as f32) - 1.0)
            .collect();
        let bytes = q8_0::to_gguf_bytes(&wf, n, k);
        let rp = Repacked::from_q8_0(&bytes, n, k);
        let wt =
            candle_core::Tensor::from_vec(wf.clone(), (n, k), &candle_core::Device::Cpu).unwrap();
        let q41 =
            candle_core::quantized::QTensor::quantize(&wt, candle_core::quantized::GgmlDType::Q4_1)
                .unwrap();
        let rp4 =
            llama_relay::model::kernels::q4_1x8::Repacked::from_q4_1(&q41.data().unwrap(), n, k);
        for m in [1usize, 4, 16, 32, 64, 128, 256, 512] {
            let x: Vec<f32> = wf[..m * k].to_vec();
            let flop = 2.0 * (m * n * k) as f64 / 1e9;
            let a = median_time(reps, || {
                std::hint::black_box(q8_0::matmul(&x, m, k, &bytes, n));
            });
            let b = median_time(reps, || {
                std::hint::black_box(rp.matmul(&x, m));
            });
            let b4 = median_time(reps, || {
                std::hint::black_box(rp4.matmul(&x, m));
            });
            let xt = candle_core::Tensor::from_vec(x.clone(), (m, k), &candle_core::Device::Cpu)
                .unwrap();
            let c = median_time(reps, || {
                let dense = candle_core::Tensor::from_vec(
                    rp.dequantize(),
                    (n, k),
                    &candle_core::Device::Cpu,
                )
                .unwrap();
                std::hint::black_box(xt.matmul(&dense.t().unwrap()).unwrap());
            });
            println!(
                "{name:<10} {m:>3}   {:>12.1}   {:>14.1}   {:>14.1}   {:>16.1}",
                flop / a,
                flop / b,
                flop / b4,
                flop / c
            );
        }
    }
}

/// The K-quant kernels alone (Llama 3 GGUFs are mostly Q4_K + Q6_K) on Llama 3.2 1B's attention
/// output (2048 x 2048) and MLP down (2048 x 8192) shapes, random weights: our repacked kernels
/// (`Packed`: Q4_K as Q4_1 blocks, Q6_K as 8-bit quants with 16-value scales) against candle's
/// `QMatMul` on the same `QTensor` (candle 0.11 has its own repacked x86 tiles for Q4_K, and for
/// Q6_K from 2 rows). GFLOP/s (2*m*n*k per call), and at one row the GB/s of our weight bytes.
fn kernels_k(reps: usize) {
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Device, Module, Tensor};
    use llama_relay::model::linear::Packed;
    println!("type  shape         m   ours GFLOP/s   candle GFLOP/s   ours GB/s (weights)");
    for dtype in [GgmlDType::Q4K, GgmlDType::Q6K] {
        for (name, n, k) in [
            ("o", 2048, 2048),
            ("down", 2048, 8192),
            ("gate_up", 16384, 2048),
        ] {
            let wf: Vec<f32> = tokens(n * k, 7, 1 << 20)
                .iter()
                .map(|&t| (t as f32 / (1 << 19) as f32) - 1.0)
                .collect();
            let wt = Tensor::from_vec(wf.clone(), (n, k), &Device::Cpu).unwrap();
            let q = std::sync::Arc::new(QTensor::quantize(&wt, dtype).unwrap());
            let ours = Packed::from_qtensor(&q)
                .unwrap()
                .expect("a repacked K-quant");
            let bytes_per_value = match dtype {
                GgmlDType::Q4K => 0.59375, // nibble, a byte of scale and of minimum per 32, f32 d and dmin per 256
                _ => 1.25,                 // i8 + two f32 scales per 32
            };
            let theirs = QMatMul::from_arc(q).unwrap();
            for m in [1usize, 4, 16, 32, 64] {
                let x: Vec<f32> = wf[..m * k].to_vec();
                let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
                let flop = 2.0 * (m * n * k) as f64 / 1e9;
                let a = median_time(reps, || {
                    std::hint::black_box(ours.matmul(&x, m));
                });
                let b = median_time(reps, || {
                    std::hint::black_box(theirs.forward(&xt).unwrap());
                });
                let gbs = if m == 1 {
                    format!("{:>10.1}", (n * k) as f64 * bytes_per_value / a / 1e9)
                } else {
                    String::new()
                };
                println!(
                    "{:<5} {name:<10} {m:>4}   {:>12.1}   {:>14.1}   {gbs:>19}",
                    format!("{dtype:?}"),
                    flop / a,
                    flop / b
                );
            }
        }
    }
}

/// Paged attention alone, SmolLM2-135M's shapes (9 query heads, 3 KV heads, 64 wide) on one layer:
/// `seqs` sequences, each `q_len` new tokens after `ctx` cached ones, scattered over a cache of 30
/// layers' worth of blocks. Time per call and the K/V bytes it reads per second. The same rows are
/// read by every call, so they stay in the last-level cache unless `evict`: then a buffer twice
/// the size of this machine's caches is read, untimed, before each call, and the rows come from
/// DRAM, as in a step, where the layer's weights pass through the caches in between.
#[allow(clippy::too_many_arguments)]
fn attention(
    seqs: usize,
    ctx: usize,
    q_len: usize,
    kv: llama_relay::kv_cache::KvDtype,
    reps: usize,
    evict: bool,
    dev: &candle_core::Device,
) {
    use candle_core::Tensor;
    use llama_relay::kv_cache::{KvCache, KvCacheSpec};
    use llama_relay::model::attention::{paged_attention, AttentionImpl, AttnDims};
    use llama_relay::model::batch::SeqMeta;
    let (h, kvh, hd, bs) = (9, 3, 64, 16);
    let blocks_per_seq = (ctx + q_len).div_ceil(bs);
    // Spread each sequence's blocks over a cache 30x the working set, in a shuffled order.
    let total_blocks = blocks_per_seq * seqs * 30;
    let mut order: Vec<u32> = (0..total_blocks as u32).collect();
    let mut r = 12345u64;
    for i in (1..order.len()).rev() {
        r = r
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        order.swap(i, (r >> 33) as usize % (i + 1));
    }
    // A one-layer cache as the server makes it (huge pages where the kernel allows), filled with
    // random rows.
    let shape = llama_relay::kv_cache::KvShape {
        layers: 1,
        kv_dim: kvh * hd,
        heads: kvh,
    };
    let spec = KvCacheSpec {
        block_size: bs,
        num_blocks: total_blocks,
    };
    let cache = KvCache::new(shape, spec, kv, dev).unwrap();
    let slots = total_blocks * bs;
    for from in (0..slots).step_by(1 << 16) {
        let n = (1 << 16).min(slots - from);
        let ids: Vec<u32> = (from as u32..(from + n) as u32).collect();
        let rows = || Tensor::randn(0f32, 1.0, (n, kvh * hd), dev).unwrap();
        let index = cache.slot_index(&ids).unwrap();
        cache.write(0, &index, &rows(), &rows()).unwrap();
    }
    let layer = cache.layer(0).unwrap();
    let q = Tensor::randn(0f32, 1.0, (seqs * q_len, h * hd), dev).unwrap();
    let metas: Vec<SeqMeta> = (0..seqs)
        .map(|i| SeqMeta {
            q_start: i * q_len,
            q_len,
            start_pos: ctx,
            block_table: order[i * blocks_per_seq * 30..][..blocks_per_seq].to_vec(),
            exact: false,
            more: false,
        })
        .collect();
    let dims = AttnDims {
        num_heads: h,
        num_kv_heads: kvh,
        head_dim: hd,
        block_size: bs,
    };
    let bytes = (seqs * (ctx + q_len) * KvCacheSpec::bytes_per_token(shape, kv)) as f64;
    let imps: &[AttentionImpl] = if !dev.is_cpu() {
        &[AttentionImpl::Generic]
    } else if std::env::var_os("ATTENTION_FAST_ONLY").is_some() {
        // For profiling the kernel alone (`perf record`).
        &[AttentionImpl::FastCpu]
    } else {
        &[AttentionImpl::FastCpu, AttentionImpl::Generic]
    };
    for &imp in imps {
        let once = || {
            let o = paged_attention(imp, &q, &layer, &metas, dims).unwrap();
            // Wait for the device: reading one value back ends the queued work.
            let _ = o
                .narrow(0, 0, 1)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
        };
        // From a pool thread, as the model's forward runs: a call from outside would pay for
        // waking the pool each time.
        let t = rayon::scope(|_| {
            once();
            median(
                (0..20 * reps.max(1))
                    .map(|_| {
                        if evict {
                            flush_caches();
                        }
                        let t = Instant::now();
                        once();
                        t.elapsed().as_secs_f64()
                    })
                    .collect(),
            )
        });
        println!(
            "attention {imp:?} on {dev:?}, {seqs} seqs x {q_len} tokens after {ctx}, {}: {:.1} us per layer, {:.1} GB/s of K/V, x30 layers = {:.2} ms",
            kv.name(),
            t * 1e6,
            bytes / t / 1e9,
            t * 30e3
        );
    }
}

/// Reads a 128 MiB buffer (made once), so that what an earlier call left in the caches (up to
/// 32 MiB of last-level cache on the machines this runs on) is gone.
fn flush_caches() {
    static BUF: std::sync::OnceLock<Vec<u64>> = std::sync::OnceLock::new();
    let buf = BUF.get_or_init(|| (0..16u64 << 20).collect());
    let sum = buf.iter().step_by(8).fold(0u64, |a, &x| a.wrapping_add(x));
    std::hint::black_box(sum);
}

/// This machine's roof (`kernels::roof`), then the engine's work as shares of it: a 512-token
/// prefill and a 16-sequence decode step against the 8-bit peak (2 operations per weight and
/// token, the projections' and LM head's work; attention and the rest are extra time), one
/// stream's decode step against the read bandwidth (the model file's bytes: every weight read
/// once a step), and each projection's kernel alone (Q4_1 8-row layout, the default model's
/// weights) at 1, 16 and 512 rows, its weights read from memory as they are in a step.
fn roof(e: &mut Engine, threads: usize, reps: usize, model_bytes: u64) {
    use llama_relay::model::kernels::{
        amx, cpu::Isa, prompt_form, q4_1x8, q8_0x8::RowGroups, roof::Roof,
    };
    let isa = Isa::best();
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    let show = |r: &Roof, when: &str| {
        println!(
            "roof {when}, {} threads, {}: int8 {:.0} GOP/s (256-bit) / {} (512-bit) | f32 {:.0} GFLOP/s (256-bit) / {} (512-bit) | read {:.1} GB/s{}{}",
            r.threads,
            r.isa,
            r.int8_256,
            opt(r.int8_512),
            r.f32_256,
            opt(r.f32_512),
            r.read_gbs,
            r.bf16_512
                .map_or(String::new(), |b| format!(" | bf16 {b:.0} GFLOP/s (512-bit)")),
            r.amx_bf16
                .map_or(String::new(), |a| format!(" | tile units (AMX): bf16 {a:.0} GFLOP/s"))
        );
    };
    let first = Roof::measure(isa, threads, reps);
    show(&first, "before the steps");
    let c = e.model.config().clone();
    let kv = c.num_kv_heads * c.head_dim;
    let (h, i) = (c.hidden_size, c.intermediate_size);
    let shapes = [
        ("qkv", h + 2 * kv, h),
        ("o", h, c.num_heads * c.head_dim),
        ("gate_up", 2 * i, h),
        ("down", h, i),
        ("lm_head", c.vocab_size, h),
    ];
    let per_layer: usize = shapes[..4].iter().map(|(_, n, k)| n * k).sum();
    let weights = c.num_layers * per_layer + c.vocab_size * h;
    let ops_per_token = 2.0 * weights as f64;
    let vocab = c.vocab_size;
    let prompt = tokens(512, 1, vocab);
    // One prefill untimed first: the first after the load (or after the roof's streaming reads)
    // pays for growing the heap and faulting in its activations (as `decode_batch` touches its
    // pages first).
    prefill_once(e, &prompt);
    let prefill = median((0..reps.max(3)).map(|_| prefill_once(e, &prompt)).collect());
    let one = decode_batch(e, 1, 128, 20);
    let sixteen = decode_batch(e, 16, 128, 20);
    // Measured again after the steps; every share below is against the higher of each peak.
    let again = Roof::measure(isa, threads, reps);
    show(&again, "after them");
    let r = first.best_of(&again);
    let int8 = r.int8();
    println!(
        "prefill 512 tokens: {:.0} ms, {:.0} GOP/s = {:.0}% of int8",
        prefill * 1e3,
        512.0 * ops_per_token / prefill / 1e9,
        100.0 * 512.0 * ops_per_token / prefill / 1e9 / int8
    );
    println!(
        "decode 1 sequence (context 128): {:.2} ms, {:.1} GB/s of the model's {:.1} MB = {:.0}% of read",
        one * 1e3,
        model_bytes as f64 / one / 1e9,
        model_bytes as f64 / 1e6,
        100.0 * model_bytes as f64 / one / 1e9 / r.read_gbs
    );
    println!(
        "decode 16 sequences (context 128): {:.2} ms, {:.0} GOP/s = {:.0}% of int8",
        sixteen * 1e3,
        16.0 * ops_per_token / sixteen / 1e9,
        100.0 * 16.0 * ops_per_token / sixteen / 1e9 / int8
    );
    // Each part of those steps (`model::profile`): milliseconds a step, share of the step, and
    // against the roof its part is bound by: the projections' 8-bit operations (or at one row
    // their weight bytes), attention's K/V bytes read, or in a prefill from an empty cache its
    // products (each row against the positions it sees: `4 d` operations a head and position)
    // against the peak of the form it runs on (`kernels::prompt_form`: the tile units' bf16, AVX-512
    // BF16 where it measures faster, else F32).
    let attn_ops_per_pos = 4.0 * c.num_layers as f64 * (c.num_heads * c.head_dim) as f64;
    let (attn_peak, attn_unit) = match (prompt_form(isa), r.amx_bf16, r.bf16_512) {
        ("amx", Some(a), _) => (a, "amx"),
        ("bf16", _, Some(b)) => (b, "bf16"),
        _ => (r.f32(), "f32"),
    };
    let layers = c.num_layers as f64;
    let kv_bytes_per_pos = 2.0 * layers * kv as f64 * 2.0; // K and V, F16
    let parts_of = |e: &mut Engine,
                    label: &str,
                    rows: usize,
                    lm_rows: usize,
                    ctx: f64,
                    mut run: Box<dyn FnMut(&mut Engine) -> usize>| {
        use llama_relay::model::profile::{self, Part};
        profile::enable(true);
        let t = Instant::now();
        let steps = run(e);
        let step = t.elapsed().as_secs_f64() / steps as f64;
        let parts = profile::take();
        profile::enable(false);
        println!("{label}: {:.2} ms a step while timed", step * 1e3);
        println!("  part                        ms    share   roof");
        let mut covered = 0.0;
        for (part, d) in parts {
            let ms = d.as_secs_f64() * 1e3 / steps as f64;
            if part != Part::Quantize {
                covered += ms;
            }
            let shape = match part {
                Part::Qkv => Some(shapes[0]),
                Part::O => Some(shapes[1]),
                Part::GateUp => Some(shapes[2]),
                Part::Down => Some(shapes[3]),
                Part::LmHead => Some(shapes[4]),
                _ => None,
            };
            let secs = ms / 1e3;
            let roof = match (part, shape) {
                (Part::LmHead, Some((_, n, k))) if lm_rows == 1 => format!(
                    "{:.0}% read",
                    100.0 * (n * k) as f64 * 34.0 / 32.0 / secs / 1e9 / r.read_gbs
                ),
                (Part::LmHead, Some((_, n, k))) => format!(
                    "{:.0}% int8",
                    100.0 * 2.0 * (lm_rows * n * k) as f64 / secs / 1e9 / int8
                ),
                (_, Some((_, n, k))) if rows == 1 => format!(
                    "{:.0}% read",
                    100.0 * layers * (n * k) as f64 * 20.0 / 32.0 / secs / 1e9 / r.read_gbs
                ),
                (_, Some((_, n, k))) if rows >= amx::AMX_MIN_ROWS && r.amx_bf16.is_some() => {
                    format!(
                        "{:.0}% amx",
                        100.0 * layers * 2.0 * (rows * n * k) as f64
                            / secs
                            / 1e9
                            / r.amx_bf16.unwrap_or(f64::MAX)
                    )
                }
                (_, Some((_, n, k))) => format!(
                    "{:.0}% int8",
                    100.0 * layers * 2.0 * (rows * n * k) as f64 / secs / 1e9 / int8
                ),
                (Part::Attention, _) if ctx > 0.0 => format!(
                    "{:.0}% read",
                    100.0 * ctx * kv_bytes_per_pos / secs / 1e9 / r.read_gbs
                ),
                (Part::Attention, _) if rows > 1 => {
                    let seen = (rows * (rows + 1) / 2) as f64;
                    format!(
                        "{:.0}% {attn_unit}",
                        100.0 * seen * attn_ops_per_pos / secs / 1e9 / attn_peak
                    )
                }
                _ => String::new(),
            };
            println!(
                "  {:<25} {ms:>7.3} {:>6.1}%   {roof}",
                part.name(),
                100.0 * ms / (step * 1e3)
            );
        }
        println!(
            "  {:<25} {:>7.3} {:>6.1}%",
            "outside the parts",
            step * 1e3 - covered,
            100.0 * (1.0 - covered / (step * 1e3))
        );
    };
    let p512 = prompt.clone();
    parts_of(
        e,
        "prefill 512 tokens, by part",
        512,
        1,
        0.0,
        Box::new(move |e| {
            for _ in 0..3 {
                prefill_once(e, &p512);
            }
            3
        }),
    );
    for seqs in [1usize, 4, 16] {
        let (ctx0, steps) = (128, 20);
        let tables = prefilled(e, seqs, ctx0, steps + 1, 0);
        // First touch of the steps' KV pages, untimed (as in `decode_batch`).
        for s in 0..steps {
            e.model
                .forward(&decode_rows(&tables, ctx0 + s), &e.cache)
                .unwrap();
        }
        let t2 = tables.clone();
        parts_of(
            e,
            &format!("decode {seqs} sequence(s), context 128-148, by part"),
            seqs,
            seqs,
            seqs as f64 * (ctx0 as f64 + steps as f64 / 2.0),
            Box::new(move |e| {
                for s in 0..steps {
                    let logits = e
                        .model
                        .forward(&decode_rows(&t2, ctx0 + s), &e.cache)
                        .unwrap()
                        .unwrap();
                    let _ = logits.argmax(1).unwrap().to_vec1::<u32>().unwrap();
                }
                steps
            }),
        );
        for t in &tables {
            e.pool.release(t);
        }
    }
    // A step of a burst of chat turns, as the chat workload's first turns run: two turns of 27
    // tokens after a shared 430-token prompt beside 8 replies decoding after it.
    {
        let (ctx0, turn, turns, decodes) = (430, 27, 2, 8);
        let tables = prefilled(e, turns + decodes, ctx0, turn, 2000);
        let batch = StepBatch {
            seqs: (tables.iter().enumerate())
                .map(|(i, t)| SeqChunk {
                    tokens: if i < turns {
                        tokens(turn, 3000 + i as u64, vocab)
                    } else {
                        vec![300 + i as u32]
                    },
                    start_pos: ctx0,
                    block_table: t.clone(),
                    logits: Logits::Last,
                })
                .collect(),
        };
        // First touch of the step's KV pages, untimed.
        e.model.forward(&batch, &e.cache).unwrap();
        let steps = 5;
        parts_of(
            e,
            &format!(
                "a chat burst's step ({turns} turns of {turn} tokens and {decodes} decodes after \
                 {ctx0} cached), by part"
            ),
            turns * turn + decodes,
            turns + decodes,
            ((turns + decodes) * ctx0) as f64,
            Box::new(move |e| {
                for _ in 0..steps {
                    let logits = e.model.forward(&batch, &e.cache).unwrap().unwrap();
                    let _ = logits.argmax(1).unwrap().to_vec1::<u32>().unwrap();
                }
                steps
            }),
        );
        for t in &tables {
            e.pool.release(t);
        }
    }
    println!("kernel (q4_1x8, cold)  rows   ms    GOP/s  % int8     GB/s  % read");
    for (name, n, k) in shapes {
        let (wf, data) = q4_1_matrix(n, k);
        // 20 bytes a row and 32 values: f16 scale and minimum, 16 bytes of nibbles.
        let bytes = (n * k / 32 * 20) as f64;
        // As in a step, the weights come from memory, not from a cache: copies of the matrix
        // that together pass 256 MB (eight times the last-level cache), called one after another
        // (the threads stay busy as in a step).
        let copies: Vec<q4_1x8::Repacked> = (0..((256e6 / bytes).ceil() as usize).clamp(2, 1024))
            .map(|_| q4_1x8::Repacked::from_q4_1(&data, n, k))
            .collect();
        for m in [1usize, 16, 512] {
            let x: Vec<f32> = (0..m * k).map(|j| wf[j % wf.len()]).collect();
            // Called from a pool thread as the engine's step calls it (`Llama::forward`): from
            // outside the pool each call would add a wake-up and a sleep on a latch.
            let t = rayon::scope(|_| {
                median_time(reps, || {
                    for rp in &copies {
                        std::hint::black_box(rp.matmul(&x, m));
                    }
                })
            }) / copies.len() as f64;
            let gops = 2.0 * (m * n * k) as f64 / t / 1e9;
            println!(
                "{name:<10} {n:>5}x{k:<5} {m:>3} {:>9.3} {gops:>8.0} {:>6.0}% {:>8.1} {:>6.0}%",
                t * 1e3,
                100.0 * gops / int8,
                bytes / t / 1e9,
                100.0 * bytes / t / 1e9 / r.read_gbs
            );
        }
    }
    let Some((amx_t, peak)) = isa.amx().zip(r.amx_bf16) else {
        return;
    };
    println!("kernel (amx bf16, cold) rows   ms   GFLOP/s  % amx  against q4_1x8");
    for (name, n, k) in shapes {
        let (wf, data) = q4_1_matrix(n, k);
        let q41 = q4_1x8::Repacked::from_q4_1(&data, n, k);
        let copies: Vec<amx::Tiles> = (0..((256e6 / (n * k * 2) as f64).ceil() as usize)
            .clamp(2, 1024))
            .map(|_| amx::Tiles::from_f32(&wf, n, k))
            .collect();
        for m in [16usize, 32, 64, 128, 512] {
            let x: Vec<f32> = (0..m * k).map(|j| wf[j % wf.len()]).collect();
            let t = rayon::scope(|_| {
                median_time(reps, || {
                    for c in &copies {
                        std::hint::black_box(c.matmul(amx_t, &x, m));
                    }
                })
            }) / copies.len() as f64;
            let hot = rayon::scope(|_| {
                median_time(reps, || {
                    std::hint::black_box(q41.matmul(&x, m));
                })
            });
            let gflops = 2.0 * (m * n * k) as f64 / t / 1e9;
            println!(
                "{name:<10} {n:>5}x{k:<5} {m:>4} {:>8.3} {gflops:>9.0} {:>5.0}%  {:.2}x (q4_1x8 hot {:.3} ms)",
                t * 1e3,
                100.0 * gflops / peak,
                hot / t,
                hot * 1e3
            );
        }
    }
}

/// A synthetic `[n, k]` weight matrix in [-1, 1) and its Q4_1 bytes (ggml's quantizer, via
/// candle), for the roof report's per-kernel tables.
fn q4_1_matrix(n: usize, k: usize) -> (Vec<f32>, Vec<u8>) {
    let wf: Vec<f32> = tokens(n * k, 7, 1 << 20)
        .iter()
        .map(|&t| (t as f32 / (1 << 19) as f32) - 1.0)
        .collect();
    let wt = candle_core::Tensor::from_vec(wf.clone(), (n, k), &candle_core::Device::Cpu).unwrap();
    let q = candle_core::quantized::QTensor::quantize(&wt, candle_core::quantized::GgmlDType::Q4_1)
        .unwrap();
    let data = q.data().unwrap().to_vec();
    (wf, data)
}

fn main() {
    let a = parse();
    if a.kernels_k {
        apply_process_settings(a.threads, a.malloc_tuning);
        kernels_k(a.reps);
        return;
    }
    if a.kernels {
        apply_process_settings(a.threads, a.malloc_tuning);
        kernels(a.reps);
        return;
    }
    if let Some(n) = a.attention {
        apply_process_settings(a.threads, a.malloc_tuning);
        attention(
            n,
            a.context,
            a.chunk.unwrap_or(1),
            a.kv,
            a.reps,
            a.evict,
            &a.device,
        );
        return;
    }
    if a.compare_malloc {
        let exe = std::env::current_exe().unwrap();
        for flag in [None, Some("--no-malloc-tuning")] {
            let mut c = std::process::Command::new(&exe);
            c.args([
                "--prompt-only",
                "--threads",
                &a.threads.to_string(),
                "--reps",
                &a.reps.to_string(),
            ]);
            if let Some(m) = &a.model {
                c.args(["--model", m]);
            }
            c.args(flag);
            let st = c.status().unwrap();
            assert!(st.success());
        }
        return;
    }
    apply_process_settings(a.threads, a.malloc_tuning);
    let model = a
        .model
        .clone()
        .map(Into::into)
        .unwrap_or_else(|| llama_relay::default_model::ensure_default_model().unwrap());
    let mut o = EngineOptions::for_model(model);
    o.weights = a.weights;
    o.device = a.device.clone();
    o.kv_dtype = a.kv;
    // Room for the decode table's 32 x 256 tokens, or for `--decode-only N` at `--context`.
    let decode_tokens = a.decode_only.unwrap_or(0) * (a.context + 40 * a.reps.max(1) + 32);
    o.cache = llama_relay::engine::loaded::CacheSize::Tokens((32 * 256).max(decode_tokens) + 1024);
    let mut e = Engine::load(&o).unwrap();
    if a.roof {
        let model_bytes = a.model.as_ref().map_or_else(
            || llama_relay::default_model::ensure_default_model().unwrap(),
            Into::into,
        );
        let model_bytes = std::fs::metadata(model_bytes).map_or(0, |m| m.len());
        roof(&mut e, a.threads, a.reps, model_bytes);
        return;
    }
    let vocab = e.model.config().vocab_size;
    let cpu_layers = e.model.set_cpu_layers(!a.no_cpu_layers);
    println!(
        "model {} | device {:?} | threads {} | malloc tuning {} | weights {} | KV {:?} | CPU layer path {}",
        e.info.name,
        a.device,
        a.threads,
        a.malloc_tuning,
        e.info.weight_types.join(", "),
        e.cache.dtype().name(),
        if cpu_layers { "on" } else { "off" }
    );
    prefill_once(&mut e, &tokens(64, 99, vocab)); // warm-up
    if let Some(n) = a.chunk {
        // Cache-hit turns: `--seqs` sequences, each `n` new prompt tokens after `--context` cached
        // ones, in one step.
        let ctx = a.context;
        let bs = e.cache.block_size();
        let tables: Vec<Vec<u32>> = (0..a.seqs)
            .map(|_| {
                let mut table = Vec::new();
                assert!(e.pool.ensure_capacity(&mut table, ctx + n, bs));
                table
            })
            .collect();
        let step = |len: usize, seed: u64, start_pos: usize, want_logits: bool| StepBatch {
            seqs: tables
                .iter()
                .enumerate()
                .map(|(i, table)| SeqChunk {
                    tokens: tokens(len, seed + i as u64, vocab),
                    start_pos,
                    block_table: table.clone(),
                    logits: Logits::last_if(want_logits),
                })
                .collect(),
        };
        if ctx > 0 {
            e.model.forward(&step(ctx, 1, 0, false), &e.cache).unwrap();
        }
        let turn = step(n, 100, ctx, true);
        if a.decodes > 0 {
            mixed_step(&mut e, &turn, a.decodes, a.reps);
        } else {
            let t = median(
                (0..10 * a.reps.max(1))
                    .map(|_| {
                        let t = Instant::now();
                        e.model.forward(&turn, &e.cache).unwrap();
                        t.elapsed().as_secs_f64()
                    })
                    .collect(),
            );
            println!(
                "{} seqs x {n} new tokens after {ctx} cached: {:.1} ms ({:.0} tok/s)",
                a.seqs,
                t * 1e3,
                (a.seqs * n) as f64 / t
            );
        }
        for table in &tables {
            e.pool.release(table);
        }
        return;
    }
    if let Some(n) = a.decode_only {
        // One batch size alone, many steps: for profiling a decode step (`perf record`).
        let t = decode_batch(&mut e, n, a.context, 40 * a.reps.max(1));
        println!(
            "decode {n} seqs: step {:.2} ms, {:.1} tok/s",
            t * 1e3,
            n as f64 / t
        );
        return;
    }
    if a.touch_cache {
        // Every block written once, untimed: a fresh cache block's first write faults its pages
        // in (zeroing 2 MiB pages) inside the timed prefill otherwise.
        let bs = e.cache.block_size();
        let all = e.pool.free_count() * bs;
        let t0 = Instant::now();
        for from in (0..all).step_by(2048) {
            prefill_once(&mut e, &tokens(2048.min(all - from), 7, vocab));
        }
        println!("touched the cache in {:.1} s", t0.elapsed().as_secs_f64());
    }
    for n in [100, 500] {
        let p = tokens(n, n as u64, vocab);
        let t = median((0..a.reps).map(|_| prefill_once(&mut e, &p)).collect());
        println!(
            "prompt {n:>4} tokens: {:>7.1} tok/s  ({:.1} ms, median of {})",
            n as f64 / t,
            t * 1e3,
            a.reps
        );
    }
    if a.prompt_only {
        println!("peak RSS {:.0} MiB", rss_mib("VmHWM:"));
        return;
    }
    let steps = 8 * a.reps.max(1);
    for n in [1, 4, 8, 16, 32] {
        let t = decode_batch(&mut e, n, 128, steps);
        println!(
            "decode {n:>2} seqs (context 128): step {:>6.2} ms, aggregate {:>7.1} tok/s{}",
            t * 1e3,
            n as f64 / t,
            if n == 1 { "  (single stream)" } else { "" }
        );
    }
    println!(
        "peak RSS {:.0} MiB (KV cache {:.0} MiB)",
        rss_mib("VmHWM:"),
        e.cache.bytes() as f64 / 1048576.0
    );
}
