//! One prompt through the engine core, the same scheduler, KV manager and sampler the server
//! runs: chunked prefill, then decode until an end-of-turn id or the token limit. Behind the
//! `generate` command (a quick check of a model before serving it) and the model tests.

use std::time::{Duration, Instant};

use crate::engine::core::{Core, Event, Finish, Request};
use crate::engine::scheduler::{RequestId, SchedulerConfig};
use crate::engine::Engine;
use crate::error::{EngineError, Result};
use crate::kv_cache::manager::KvConfig;
use crate::kv_cache::{CacheScope, Salt};
use crate::sampler::SamplingParams;
use crate::tokenizer::TextTokenizer;

/// How to pick tokens.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_new_tokens: usize,
    /// The server's sampling settings (default: greedy).
    pub sampling: SamplingParams,
    /// Tokens per prefill step.
    pub prefill_chunk: usize,
    /// Stop at the model's end-of-turn ids.
    pub stop_at_eos: bool,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_new_tokens: 128,
            sampling: SamplingParams {
                seed: Some(299_792_458),
                ..SamplingParams::default()
            },
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
    /// Each decode step's time (the steps after the one that finished the prompt).
    pub decode_steps: Vec<Duration>,
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

/// Generates from `prompt` (token ids), calling `on_token` with the tokenizer and each new id.
/// Frees its KV blocks when done, also on error.
pub fn generate(
    engine: &mut Engine,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_token: impl FnMut(&TextTokenizer, u32) -> Result<()>,
) -> Result<GenerationStats> {
    if prompt.is_empty() {
        return Err(EngineError::InvalidBatch("the prompt is empty".into()));
    }
    let context = engine.model.max_positions();
    let total = prompt.len() + params.max_new_tokens;
    if total > context {
        return Err(EngineError::InvalidBatch(format!(
            "prompt ({} tokens) + max_new_tokens ({}) exceeds the context of {context}",
            prompt.len(),
            params.max_new_tokens,
        )));
    }
    let sched = SchedulerConfig {
        max_running: 1,
        max_waiting: 1,
        step_tokens: params.prefill_chunk.max(1),
        itl_target: None,
        ttft_target: None,
    };
    let kv = KvConfig {
        block_size: engine.cache.block_size(),
        prefix_caching: false,
        lease_tokens_per_session: 0,
        lease_tokens_total: 0,
        context_shift: false,
    };
    let mut core = Core::new(&mut *engine, sched, kv, context);
    let result = run(&mut core, prompt, params, &mut on_token);
    core.remove(RequestId(0));
    core.into_engine();
    result
}

fn run(
    core: &mut Core<&mut Engine>,
    prompt: &[u32],
    params: &GenerateParams,
    on_token: &mut impl FnMut(&TextTokenizer, u32) -> Result<()>,
) -> Result<GenerationStats> {
    let id = RequestId(0);
    let request = Request {
        id,
        prompt: prompt.to_vec(),
        sampling: params.sampling.clone(),
        max_tokens: params.max_new_tokens,
        ignore_eos: !params.stop_at_eos,
        priority: Default::default(),
        scope: CacheScope::private(Salt(0)),
        lease: None,
        shift: false,
        logprobs: None,
        forks: Vec::new(),
        quota: Default::default(),
        constraint: None,
    };
    core.add(request).map_err(|e| {
        let free = core.scheduler().kv().pool().free_count();
        EngineError::KvCache(format!("{e:?}; {free} blocks are free"))
    })?;
    let mut stats = GenerationStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut first: Option<Instant> = None;
    loop {
        let t = Instant::now();
        let Some(events) = core.step().map_err(|f| f.error)? else {
            break;
        };
        if first.is_some() {
            stats.decode_steps.push(t.elapsed());
        }
        for ev in events {
            match ev {
                Event::Token { token, .. } => {
                    if first.is_none() {
                        first = Some(Instant::now());
                        stats.prefill = t0.elapsed();
                    }
                    stats.generated.push(token);
                    on_token(&core.engine().tokenizer, token)?;
                }
                Event::Finished { reason, .. } => {
                    stats.stopped_at_eos = reason == Finish::EndOfTurn;
                }
                Event::Started { .. } | Event::Drafted { .. } => {}
                // Only a request with a grammar fails alone; this one has none.
                Event::Failed { .. } => {}
            }
        }
    }
    stats.decode = first.map(|f| f.elapsed()).unwrap_or_default();
    Ok(stats)
}

/// The warm-up's prompt, in tokens at most (the first step of a run pays its one-time costs at
/// this size already; a bigger one would only delay readiness).
const WARM_UP_TOKENS: usize = 256;

/// Runs the costs a first request would otherwise pay (first-touch pages of the step's buffers
/// and the KV cache, the thread team's start, first-use allocations in the kernels) before the
/// server reports ready, as llama.cpp's server does with an empty run at load: one prefill chunk
/// of up to `step_tokens` (at most 256) tokens, then a few decode steps. Caching is off in
/// `generate`, so the warm-up leaves no block behind and no later request can find it.
pub fn warm_up(engine: &mut Engine, step_tokens: usize) -> Result<Duration> {
    let t = Instant::now();
    let context = engine.model.max_positions();
    let decodes = 4;
    let n = step_tokens
        .clamp(1, WARM_UP_TOKENS)
        .min(context.saturating_sub(decodes + 1))
        .max(1);
    // Ordinary text's ids, not one repeated id: the kernels' speed does not depend on the values,
    // but a warm-up that reads the embedding rows a real prompt reads is a fairer one.
    let text = "The quick brown fox jumps over the lazy dog while the support team answers. ";
    let mut prompt = engine.tokenizer.encode_prompt(text)?;
    if prompt.is_empty() {
        prompt.push(0);
    }
    let prompt: Vec<u32> = prompt.iter().copied().cycle().take(n).collect();
    let params = GenerateParams {
        max_new_tokens: decodes,
        prefill_chunk: n,
        stop_at_eos: false,
        ..GenerateParams::default()
    };
    generate(engine, &prompt, &params, |_, _| Ok(()))?;
    Ok(t.elapsed())
}
