//! One sequence through the engine: chunked prefill, then decode until an end-of-turn id or the
//! token limit. Behind the `generate` command (a quick check of a model before serving it) and the
//! model tests.

use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};

use crate::engine::{Engine, SeqChunk, StepBatch};
use crate::error::{EngineError, Result};
use crate::tokenizer::TextTokenizer;

/// How to pick tokens.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_new_tokens: usize,
    /// 0 = greedy.
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub seed: u64,
    /// Tokens per prefill step.
    pub prefill_chunk: usize,
    /// Stop at the model's end-of-turn ids.
    pub stop_at_eos: bool,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_new_tokens: 128,
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 299_792_458,
            prefill_chunk: 512,
            stop_at_eos: true,
        }
    }
}

/// Timings of one generation.
#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated: Vec<u32>,
    pub prefill: Duration,
    pub decode: Duration,
    pub stopped_at_eos: bool,
}

impl GenerationStats {
    pub fn prompt_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill.as_secs_f64().max(1e-9)
    }

    /// Decode speed over the tokens after the first (the first comes from the prefill step).
    pub fn decode_tokens_per_s(&self) -> f64 {
        let n = self.generated.len().saturating_sub(1);
        n as f64 / self.decode.as_secs_f64().max(1e-9)
    }
}

fn sampler(p: &GenerateParams) -> LogitsProcessor {
    let s = if p.temperature <= 0.0 {
        Sampling::ArgMax
    } else {
        match (p.top_k, p.top_p) {
            (None, None) => Sampling::All {
                temperature: p.temperature,
            },
            (Some(k), None) => Sampling::TopK {
                k,
                temperature: p.temperature,
            },
            (None, Some(tp)) => Sampling::TopP {
                p: tp,
                temperature: p.temperature,
            },
            (Some(k), Some(tp)) => Sampling::TopKThenTopP {
                k,
                p: tp,
                temperature: p.temperature,
            },
        }
    };
    LogitsProcessor::from_sampling(p.seed, s)
}

/// Generates from `prompt` (token ids), calling `on_token` with the tokenizer and each new id. Frees its KV blocks
/// when done, also on error.
pub fn generate(
    engine: &mut Engine,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_token: impl FnMut(&TextTokenizer, u32) -> Result<()>,
) -> Result<GenerationStats> {
    if prompt.is_empty() {
        return Err(EngineError::InvalidBatch("the prompt is empty".into()));
    }
    let total = prompt.len() + params.max_new_tokens;
    if total > engine.model.max_positions() {
        return Err(EngineError::InvalidBatch(format!(
            "prompt ({} tokens) + max_new_tokens ({}) exceeds the context of {}",
            prompt.len(),
            params.max_new_tokens,
            engine.model.max_positions()
        )));
    }
    let mut table = Vec::new();
    let bs = engine.cache.block_size();
    if !engine.pool.ensure_capacity(&mut table, total, bs) {
        return Err(EngineError::KvCache(format!(
            "{total} tokens need {} blocks, {} are free",
            total.div_ceil(bs),
            engine.pool.free_count()
        )));
    }
    let result = run(engine, prompt, params, &table, &mut on_token);
    engine.pool.release(&table);
    result
}

fn run(
    engine: &Engine,
    prompt: &[u32],
    params: &GenerateParams,
    table: &[u32],
    on_token: &mut impl FnMut(&TextTokenizer, u32) -> Result<()>,
) -> Result<GenerationStats> {
    let mut stats = GenerationStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let mut lp = sampler(params);
    let chunk = params.prefill_chunk.max(1);
    let t0 = Instant::now();
    let mut logits: Option<Tensor> = None;
    let mut pos = 0;
    while pos < prompt.len() {
        let end = (pos + chunk).min(prompt.len());
        let batch = StepBatch {
            seqs: vec![SeqChunk {
                tokens: prompt[pos..end].to_vec(),
                start_pos: pos,
                block_table: table.to_vec(),
                want_logits: end == prompt.len(),
            }],
        };
        logits = engine.model.forward(&batch, &engine.cache)?;
        pos = end;
    }
    let mut logits = logits.expect("the last prefill chunk asks for logits");
    stats.prefill = t0.elapsed();
    let t1 = Instant::now();
    while stats.generated.len() < params.max_new_tokens {
        let row = logits.squeeze(0)?.to_dtype(DType::F32)?;
        let next = lp.sample(&row)?;
        stats.generated.push(next);
        on_token(&engine.tokenizer, next)?;
        if params.stop_at_eos && engine.tokenizer.eos_ids().contains(&next) {
            stats.stopped_at_eos = true;
            break;
        }
        if stats.generated.len() == params.max_new_tokens {
            break;
        }
        let batch = StepBatch {
            seqs: vec![SeqChunk {
                tokens: vec![next],
                start_pos: prompt.len() + stats.generated.len() - 1,
                block_table: table.to_vec(),
                want_logits: true,
            }],
        };
        logits = engine
            .model
            .forward(&batch, &engine.cache)?
            .expect("decode asks for logits");
    }
    stats.decode = t1.elapsed();
    Ok(stats)
}
