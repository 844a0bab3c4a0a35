//! Fixture access for the integration tests: unpacking the packed tiny Llama 3 models (see
//! tests/fixtures/pack_tiny.py), reading .npy files, comparing logits, serializing model tests;
//! and the server harness (`server`: the app on port 0 and a WebSocket client).

mod server;
pub use server::*;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};

use candle_core::{DType, Device, Tensor};
use llama_relay::engine::{Engine, EngineOptions};
use serde_json::Value;

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Held by every test that runs a model: two models on two cores at once collapse both.
pub fn model_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn read_json(path: &Path) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an id list: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Reads a little-endian f32 .npy file (format 1.0): (shape, data).
pub fn read_npy(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&b[..6], b"\x93NUMPY");
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    let header = std::str::from_utf8(&b[10..10 + hlen]).unwrap();
    assert!(
        header.contains("'<f4'") && header.contains("'fortran_order': False"),
        "{header}"
    );
    let shape_s = header
        .split("'shape': (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap();
    let shape: Vec<usize> = shape_s
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse().unwrap())
        .collect();
    let data = b[10 + hlen..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (shape, data)
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn mean_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32
}

pub fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv {
                (i, x)
            } else {
                (bi, bv)
            }
        })
        .0 as u32
}

fn xz(path: &Path) -> Vec<u8> {
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = Vec::new();
    xz2::read::XzDecoder::new(f).read_to_end(&mut out).unwrap();
    out
}

/// Writes tensors `names` from the unpacked safetensors map as one file.
fn save(all: &std::collections::HashMap<String, Tensor>, names: &[&String], path: &Path) {
    let subset: std::collections::HashMap<String, Tensor> = names
        .iter()
        .map(|n| ((*n).clone(), all[*n].clone()))
        .collect();
    candle_core::safetensors::save(&subset, path).unwrap();
}

/// The two tiny model folders, unpacked once per test run: (tied, untied).
pub fn tiny_models() -> &'static (PathBuf, PathBuf) {
    static DIRS: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    DIRS.get_or_init(|| {
        let root = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("tiny-fixtures-{}", std::process::id()));
        let (tied, untied) = (root.join("llama3-tiny"), root.join("llama3-tiny-untied"));
        std::fs::create_dir_all(&tied).unwrap();
        std::fs::create_dir_all(&untied).unwrap();
        let fx = fixtures();
        // Weights: byte planes back to interleaved BF16, then one safetensors buffer.
        let packed = xz(&fx.join("llama3-tiny-weights.shuffled.xz"));
        let n = u64::from_le_bytes(packed[..8].try_into().unwrap()) as usize;
        let (head, planes) = packed.split_at(8 + n);
        let half = planes.len() / 2;
        let mut buf = head.to_vec();
        for i in 0..half {
            buf.push(planes[i]);
            buf.push(planes[half + i]);
        }
        let all = candle_core::safetensors::load_buffer(&buf, &Device::Cpu).unwrap();
        let mut body: Vec<&String> = all.keys().filter(|k| *k != "lm_head.weight").collect();
        body.sort();
        save(&all, &body, &tied.join("model.safetensors"));
        // Untied: two shards and an index, as sharded hub downloads are.
        let (s1, s2) = (
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        );
        save(&all, &body, &untied.join(s1));
        let head_name = "lm_head.weight".to_string();
        save(&all, &[&head_name], &untied.join(s2));
        let mut map = serde_json::Map::new();
        for k in &body {
            map.insert((*k).clone(), Value::String(s1.into()));
        }
        map.insert(head_name, Value::String(s2.into()));
        let index = serde_json::json!({"metadata": {}, "weight_map": map});
        std::fs::write(
            untied.join("model.safetensors.index.json"),
            index.to_string(),
        )
        .unwrap();
        // Tokenizers.
        let tok = xz(&fx.join("llama3-tiny/tokenizer.json.xz"));
        std::fs::write(tied.join("tokenizer.json"), &tok).unwrap();
        let mut tj: Value = serde_json::from_slice(&tok).unwrap();
        let pp = read_json(&fx.join("llama3-tiny-untied/tokenizer.post_processor.json"));
        tj["post_processor"] = pp["post_processor"].clone();
        std::fs::write(untied.join("tokenizer.json"), tj.to_string()).unwrap();
        for (d, name) in [(&tied, "llama3-tiny"), (&untied, "llama3-tiny-untied")] {
            for f in [
                "config.json",
                "config.transformers-v5.json",
                "generation_config.json",
                "tokenizer_config.json",
            ] {
                std::fs::copy(fx.join(name).join(f), d.join(f)).unwrap();
            }
        }
        (tied, untied)
    })
}

/// Which tiny model a test is about.
#[derive(Clone, Copy, Debug)]
pub enum Tiny {
    Tied,
    Untied,
}

impl Tiny {
    pub fn dir(self) -> &'static Path {
        let (t, u) = tiny_models();
        match self {
            Tiny::Tied => t,
            Tiny::Untied => u,
        }
    }

    pub fn fixture_dir(self) -> PathBuf {
        fixtures().join(match self {
            Tiny::Tied => "llama3-tiny",
            Tiny::Untied => "llama3-tiny-untied",
        })
    }

    pub fn expected(self) -> Value {
        read_json(&self.fixture_dir().join("expected.json"))
    }

    /// The model with the library's options (F32 KV cache: the fixture comparisons).
    pub fn load(self, block_size: usize) -> Engine {
        self.load_with(block_size, |_| {})
    }

    /// The model with the KV cache type the server's default configuration uses, for references
    /// that a served reply must equal token for token.
    pub fn load_as_served(self, block_size: usize) -> Engine {
        let served = llama_relay::settings::Settings::load(None)
            .unwrap()
            .engine_options()
            .unwrap()
            .kv_dtype;
        self.load_with(block_size, |o| o.kv_dtype = served)
    }

    pub fn load_with(self, block_size: usize, tweak: impl FnOnce(&mut EngineOptions)) -> Engine {
        let mut o = EngineOptions::for_model(self.dir());
        o.block_size = block_size;
        o.cache = llama_relay::engine::loaded::CacheSize::Tokens(4096);
        o.max_context = Some(2048);
        tweak(&mut o);
        Engine::load(&o).unwrap()
    }
}

/// Logits rows as vectors.
pub fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap()
}

/// Logits of a prefill step over two sequences (37 and 5 tokens) and three decode steps whose
/// tokens `next(step, logits of the step before)` picks; the sequences' blocks are released after.
pub fn two_sequence_run(
    e: &mut Engine,
    next: impl Fn(usize, &[Vec<f32>]) -> [u32; 2],
) -> Vec<Vec<f32>> {
    use llama_relay::engine::{Logits, SeqChunk, StepBatch};
    let bs = e.cache.block_size();
    let (mut t1, mut t2) = (Vec::new(), Vec::new());
    assert!(e.pool.ensure_capacity(&mut t1, 48, bs));
    assert!(e.pool.ensure_capacity(&mut t2, 48, bs));
    let seq = |tokens: Vec<u32>, start_pos: usize, table: &Vec<u32>| SeqChunk {
        tokens,
        start_pos,
        block_table: table.clone(),
        logits: Logits::Last,
    };
    let mut out = Vec::new();
    let mut step = StepBatch {
        seqs: vec![
            seq((0..37).map(|i| 100 + i * 7).collect(), 0, &t1),
            seq((0..5).map(|i| 900 + i).collect(), 0, &t2),
        ],
    };
    for s in 0..4 {
        let logits = rows(&e.model.forward(&step, &e.cache).unwrap().unwrap());
        let [a, b] = next(s, &logits);
        step = StepBatch {
            seqs: vec![seq(vec![a], 37 + s, &t1), seq(vec![b], 5 + s, &t2)],
        };
        out.extend(logits);
    }
    e.pool.release(&t1);
    e.pool.release(&t2);
    out
}
