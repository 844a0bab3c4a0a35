//! `llama-relay perplexity FILE`: how well the model predicts a text, and how far its predictions
//! moved from a saved reference run (llama.cpp's `llama-perplexity` with `--kl-divergence`). The
//! check every numeric change (a kernel level, a KV type, a KV shift) runs on real text, beside
//! the random-tensor proptests.
//!
//! The text is tokenized as plain text and cut into chunks of `ctx` tokens, each opening with the
//! model's BOS when it has one (what `encode_prompt` of an empty text gives). A chunk runs as one
//! sequence in pieces of at most `PIECE` tokens, with logits at every position of its second half
//! (`Logits::All`); those positions are scored, each predicting the next token with at least
//! `ctx / 2` tokens of context, as llama.cpp scores. Perplexity is `exp` of the mean negative
//! log-likelihood, reported with its standard error.
//!
//! With a `Shift` (`--shift D`), each chunk is scored as a conversation that outgrew its context
//! and dropped its oldest part: the chunk's first `keep` tokens (`--shift-keep`, standing in for
//! the system prompt the server always keeps) are followed by `D` tokens of other text (the
//! previous chunk's last `D`; the last chunk's for the first), then the rest of the chunk's
//! unscored first half; that is prefilled, the part after the dropped text is moved back by `D`
//! with the server's context shift (`KvCache::shift_slots`, `Llama::unrotate_keys`), and the
//! second half is scored on that cache. Against a reference run without the shift (the same
//! context prefilled afresh, what a re-prefill gives), the KL divergence is what the shift costs.
//!
//! The reference file keeps, for each scored position, the negative log-likelihood and the `TOP`
//! most likely tokens' log-probabilities (~2 KB a position, where the whole vocabulary would be
//! ~200 KB). KL divergence is taken over those tokens plus one bucket for the rest of the
//! vocabulary: the KL of both distributions coarsened that way, a lower bound of the full KL and
//! close to it when the top tokens carry nearly all of the reference's mass. The file names the
//! text (a hash of the chunks' token ids), the vocabulary and `ctx`; a run on anything else is
//! refused. Hand-written: no crate computes these from our engine's logits.

use std::io::{Read, Write};
use std::path::Path;

use crate::engine::{Engine, Logits, SeqChunk, StepBatch};
use crate::error::{EngineError, Result};

/// Tokens a chunk's step takes at most (a prefill piece).
pub const PIECE: usize = 512;
/// Log-probabilities kept per scored position in a reference file.
pub const TOP: usize = 256;
const MAGIC: &[u8; 8] = b"LRPPL\x00\x00\x01";

/// What one scored position left: its negative log-likelihood, the most likely tokens with their
/// log-probabilities (highest first, `TOP` of them).
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    pub nll: f64,
    pub top: Vec<(u32, f32)>,
}

/// A run over a text; `ctx`, `vocab`, `chunks` and `text_hash` name the cut it scored.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub ctx: usize,
    pub vocab: usize,
    pub chunks: usize,
    /// FNV-1a of the chunks' token ids: which text, tokenized how.
    pub text_hash: u64,
    pub scored: Vec<Scored>,
}

/// Perplexity and its standard error.
pub fn perplexity(scored: &[Scored]) -> (f64, f64) {
    let n = scored.len() as f64;
    let mean = scored.iter().map(|s| s.nll).sum::<f64>() / n;
    let var = scored.iter().map(|s| (s.nll - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    let ppl = mean.exp();
    (ppl, ppl * (var / n).sqrt())
}

/// Log-softmax of one row of logits, in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&v| (v as f64 - max).exp())
            .sum::<f64>()
            .ln();
    logits.iter().map(|&v| v as f64 - lse).collect()
}

/// One position from its log-softmax row: the next token's negative log-likelihood and the
/// `top` most likely tokens.
pub fn score(lp: &[f64], next: u32, top: usize) -> Scored {
    let mut ids: Vec<u32> = (0..lp.len() as u32).collect();
    let top = top.min(ids.len());
    let by = |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]).then(a.cmp(b));
    if top < ids.len() {
        ids.select_nth_unstable_by(top, by);
    }
    ids.truncate(top);
    ids.sort_unstable_by(by);
    Scored {
        nll: -lp[next as usize],
        top: ids
            .into_iter()
            .map(|i| (i, lp[i as usize] as f32))
            .collect(),
    }
}

/// KL(reference || this run) at one position: over the reference's top tokens and one bucket for
/// the rest of the vocabulary. `this` is the run's full log-softmax row.
pub fn kl_divergence(reference: &[(u32, f32)], this: &[f64]) -> f64 {
    let (mut kl, mut p_top, mut q_top) = (0.0, 0.0, 0.0);
    for &(id, lp) in reference {
        let (lp, lq) = (lp as f64, this[id as usize]);
        let p = lp.exp();
        kl += p * (lp - lq);
        p_top += p;
        q_top += lq.exp();
    }
    let (p_rest, q_rest) = ((1.0 - p_top).max(0.0), (1.0 - q_top).max(1e-30));
    if p_rest > 1e-12 {
        kl += p_rest * (p_rest.ln() - q_rest.ln());
    }
    kl.max(0.0)
}

fn fnv1a(h: u64, ids: &[u32]) -> u64 {
    ids.iter()
        .flat_map(|t| t.to_le_bytes())
        .fold(h, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// The chunks of `ctx` tokens a text makes: `prefix` (BOS or nothing) then the text's next
/// tokens, at most `max_chunks` of them.
pub fn chunks(
    text: &[u32],
    prefix: &[u32],
    ctx: usize,
    max_chunks: Option<usize>,
) -> Vec<Vec<u32>> {
    let body = ctx - prefix.len();
    text.chunks_exact(body)
        .take(max_chunks.unwrap_or(usize::MAX))
        .map(|c| [prefix, c].concat())
        .collect()
}

/// A text cut for scoring: its chunks and what names the cut (see `Run`).
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    pub chunks: Vec<Vec<u32>>,
    pub ctx: usize,
    pub vocab: usize,
    /// FNV-1a of the chunks' token ids.
    pub text_hash: u64,
}

/// Cuts `text` into chunks of `ctx` tokens for this model (see the module doc), refusing a `ctx`
/// outside 16..=the model's context or longer than the text.
pub fn prepare(
    engine: &Engine,
    text: &[u32],
    ctx: usize,
    max_chunks: Option<usize>,
) -> Result<Prepared> {
    let limit = engine.model.max_positions();
    if !(16..=limit).contains(&ctx) {
        return Err(EngineError::InvalidSetting {
            key: "--ctx".into(),
            value: ctx.to_string(),
            allowed: format!("from 16 to the model's context, {limit}"),
        });
    }
    let prefix = engine.tokenizer.encode_prompt("")?;
    let all = chunks(text, &prefix, ctx, max_chunks);
    if all.is_empty() {
        return Err(EngineError::InvalidSetting {
            key: "--ctx".into(),
            value: ctx.to_string(),
            allowed: format!(
                "at most the text's length: it has {} tokens, a chunk takes {}",
                text.len(),
                ctx - prefix.len()
            ),
        });
    }
    let text_hash = all.iter().fold(0xcbf2_9ce4_8422_2325, |h, c| fnv1a(h, c));
    Ok(Prepared {
        chunks: all,
        ctx,
        vocab: engine.model.config().vocab_size,
        text_hash,
    })
}

/// A scored chunk's context shifted back (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shift {
    /// Tokens of other text dropped after the head.
    pub dropped: usize,
    /// The chunk's first tokens, kept where they are (at least its BOS).
    pub keep: usize,
}

/// Runs the model over a prepared text (see the module doc), each chunk's context shifted as
/// `shift` says; `on_position` gets each scored position's index, its entry and its full
/// log-softmax row (for the KL divergence).
pub fn run(
    engine: &mut Engine,
    text: &Prepared,
    shift: Option<Shift>,
    mut on_position: impl FnMut(usize, &Scored, &[f64]),
) -> Result<Run> {
    let (ctx, vocab) = (text.ctx, text.vocab);
    let first_scored = ctx / 2;
    let prefix = engine.tokenizer.encode_prompt("")?.len();
    if let Some(s) = shift {
        let most = ctx - prefix;
        if !(1..=most).contains(&s.dropped) {
            return Err(EngineError::InvalidSetting {
                key: "--shift".into(),
                value: s.dropped.to_string(),
                allowed: format!("from 1 to a chunk's text, {most}"),
            });
        }
        if s.keep >= first_scored {
            return Err(EngineError::InvalidSetting {
                key: "--shift-keep".into(),
                value: s.keep.to_string(),
                allowed: format!("below the first scored position, {first_scored}"),
            });
        }
    }
    let mut scored = Vec::new();
    for (c, chunk) in text.chunks.iter().enumerate() {
        let mut table = Vec::new();
        if !engine
            .pool
            .ensure_capacity(&mut table, ctx, engine.cache.block_size())
        {
            return Err(EngineError::KvCache(format!(
                "{ctx} tokens do not fit the KV cache; lower --ctx"
            )));
        }
        let result: Result<()> = (|| {
            let mut start = 0;
            if let Some(s) = shift {
                let before = &text.chunks[(c + text.chunks.len() - 1) % text.chunks.len()];
                let dropped = &before[before.len() - s.dropped..];
                let keep = s.keep.max(prefix);
                shifted_context(engine, chunk, keep, dropped, first_scored, &table)?;
                start = first_scored;
            }
            while start < ctx {
                let end = (start + PIECE).min(ctx);
                // Logits from the first scored position on, for each position but the last
                // (which has no next token in the chunk).
                let wanted = end > first_scored;
                let from = first_scored.max(start);
                let batch = StepBatch {
                    seqs: vec![SeqChunk {
                        tokens: chunk[start..end].to_vec(),
                        start_pos: start,
                        block_table: table.clone(),
                        logits: if wanted { Logits::All } else { Logits::None },
                    }],
                };
                let logits = engine.model.forward(&batch, &engine.cache)?;
                if let (true, Some(logits)) = (wanted, logits) {
                    let rows = logits.flatten_all()?.to_vec1::<f32>()?;
                    for pos in from..end.min(ctx - 1) {
                        let row = &rows[(pos - start) * vocab..(pos - start + 1) * vocab];
                        let lp = log_softmax(row);
                        let s = score(&lp, chunk[pos + 1], TOP);
                        on_position(scored.len(), &s, &lp);
                        scored.push(s);
                    }
                }
                start = end;
            }
            Ok(())
        })();
        engine.pool.release(&table);
        result?;
    }
    Ok(Run {
        ctx,
        vocab,
        chunks: text.chunks.len(),
        text_hash: text.text_hash,
        scored,
    })
}

/// Fills `table` with the K/V of `chunk[..upto]` as the context shift leaves them: the chunk's
/// first `keep` tokens, then `dropped`, then the rest up to `upto` prefilled in a scratch
/// sequence, and moved to `table` with the rest shifted back by `dropped.len()`.
fn shifted_context(
    engine: &mut Engine,
    chunk: &[u32],
    keep: usize,
    dropped: &[u32],
    upto: usize,
    table: &[u32],
) -> Result<()> {
    let bs = engine.cache.block_size();
    let long = [&chunk[..keep], dropped, &chunk[keep..upto]].concat();
    let mut scratch = Vec::new();
    if !engine.pool.ensure_capacity(&mut scratch, long.len(), bs) {
        return Err(EngineError::KvCache(
            "the shifted context does not fit the KV cache; lower --ctx or --shift".into(),
        ));
    }
    let result = (|| {
        for start in (0..long.len()).step_by(PIECE) {
            let end = (start + PIECE).min(long.len());
            let batch = StepBatch {
                seqs: vec![SeqChunk {
                    tokens: long[start..end].to_vec(),
                    start_pos: start,
                    block_table: scratch.clone(),
                    logits: Logits::None,
                }],
            };
            engine.model.forward(&batch, &engine.cache)?;
        }
        let slot = |t: &[u32], p: usize| t[p / bs] * bs as u32 + (p % bs) as u32;
        let d = dropped.len();
        let moves = [(0..keep, 0), (keep..upto, d)];
        for (positions, delta) in moves {
            let src: Vec<u32> = positions
                .clone()
                .map(|p| slot(&scratch, p + delta))
                .collect();
            let dst: Vec<u32> = positions.map(|p| slot(table, p)).collect();
            if !src.is_empty() {
                let turn = engine.model.key_rotation(delta)?;
                engine.cache.shift_slots(&src, &dst, &turn)?;
            }
        }
        Ok(())
    })();
    engine.pool.release(&scratch);
    result
}

impl Run {
    /// Writes the run as a reference file.
    pub fn save(&self, path: &Path) -> Result<()> {
        let io = |e: std::io::Error| EngineError::Io {
            path: path.to_path_buf(),
            source: e,
        };
        let mut out = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
        let mut head = MAGIC.to_vec();
        for v in [self.ctx, self.vocab, self.chunks, self.scored.len(), TOP] {
            head.extend_from_slice(&(v as u64).to_le_bytes());
        }
        head.extend_from_slice(&self.text_hash.to_le_bytes());
        out.write_all(&head).map_err(io)?;
        for s in &self.scored {
            let mut rec = Vec::with_capacity(8 + 4 + TOP * 8);
            rec.extend_from_slice(&s.nll.to_le_bytes());
            rec.extend_from_slice(&(s.top.len() as u32).to_le_bytes());
            for &(id, lp) in &s.top {
                rec.extend_from_slice(&id.to_le_bytes());
                rec.extend_from_slice(&lp.to_le_bytes());
            }
            out.write_all(&rec).map_err(io)?;
        }
        out.flush().map_err(io)
    }

    /// Reads a reference file that `save` wrote.
    pub fn load(path: &Path) -> Result<Run> {
        let bad = |m: &str| EngineError::Config {
            path: path.to_path_buf(),
            message: format!("not a perplexity reference file: {m}"),
        };
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(|e| EngineError::Io {
                path: path.to_path_buf(),
                source: e,
            })?;
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u8]> {
            let s = bytes.get(at..at + n).ok_or_else(|| bad("it ends early"))?;
            at += n;
            Ok(s)
        };
        if take(8)? != MAGIC {
            return Err(bad("its first bytes are not this version's"));
        }
        let mut u64s = [0u64; 6];
        for v in &mut u64s {
            *v = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes"));
        }
        let [ctx, vocab, chunks, n, top, text_hash] = u64s;
        if n > (1 << 28) || top > (1 << 20) {
            return Err(bad("its counts are out of range"));
        }
        let mut scored = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let nll = f64::from_le_bytes(take(8)?.try_into().expect("8 bytes"));
            let k = u32::from_le_bytes(take(4)?.try_into().expect("4 bytes")) as usize;
            if k as u64 > top {
                return Err(bad("a position keeps more tokens than the header says"));
            }
            let rec = take(k * 8)?;
            let top = rec
                .chunks_exact(8)
                .map(|p| {
                    (
                        u32::from_le_bytes(p[..4].try_into().expect("4 bytes")),
                        f32::from_le_bytes(p[4..].try_into().expect("4 bytes")),
                    )
                })
                .collect();
            scored.push(Scored { nll, top });
        }
        if at != bytes.len() {
            return Err(bad("bytes follow its last position"));
        }
        Ok(Run {
            ctx: ctx as usize,
            vocab: vocab as usize,
            chunks: chunks as usize,
            text_hash,
            scored,
        })
    }

    /// Whether this run scored `text` as it is cut now (so the two compare position by
    /// position; the positions follow from the chunks and `ctx`).
    pub fn scored_as(&self, text: &Prepared) -> std::result::Result<(), String> {
        if self.vocab != text.vocab {
            return Err(format!("vocabulary {} against {}", self.vocab, text.vocab));
        }
        if self.ctx != text.ctx || self.chunks != text.chunks.len() {
            return Err(format!(
                "{} chunks of {} tokens against {} of {} (use the reference's --ctx and --chunks)",
                self.chunks,
                self.ctx,
                text.chunks.len(),
                text.ctx
            ));
        }
        if self.text_hash != text.text_hash {
            return Err("another text, or the same text tokenized differently".into());
        }
        Ok(())
    }
}

/// KL divergence and top-1 agreement against a reference, position by position.
#[derive(Debug, Clone, Default)]
pub struct Divergence {
    pub kl: Vec<f64>,
    pub same_top1: usize,
}

impl Divergence {
    /// Adds one position: `reference`'s entry, this run's entry and full log-softmax row.
    pub fn add(&mut self, reference: &Scored, this: &Scored, row: &[f64]) {
        self.kl.push(kl_divergence(&reference.top, row));
        if reference.top.first().map(|t| t.0) == this.top.first().map(|t| t.0) {
            self.same_top1 += 1;
        }
    }

    /// Mean, median, 99th percentile and maximum KL divergence.
    pub fn summary(&self) -> [f64; 4] {
        let mut v = self.kl.clone();
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        [
            v.iter().sum::<f64>() / v.len() as f64,
            at(0.5),
            at(0.99),
            at(1.0),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_are_the_next_tokens_log_probability_and_the_top_in_order() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let s = score(&log_softmax(&logits), 2, 3);
        let lse = (1f64.exp() + 3f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        assert!((s.nll - (lse - 2.0)).abs() < 1e-12);
        // Ties by id.
        assert_eq!(s.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        assert!((s.top[0].1 as f64 - (3.0 - lse)).abs() < 1e-6);
        let (ppl, err) = perplexity(&[s.clone(), s.clone()]);
        assert!((ppl - s.nll.exp()).abs() < 1e-9 && err.abs() < 1e-12);
    }

    #[test]
    fn kl_is_zero_against_itself_and_exact_when_the_top_holds_the_vocabulary() {
        let p = log_softmax(&[0.5, 2.0, -1.0, 0.0]);
        let q = log_softmax(&[0.7, 1.5, -0.5, 0.1]);
        let full: Vec<(u32, f32)> = (0..4).map(|i| (i as u32, p[i] as f32)).collect();
        assert!(kl_divergence(&full, &p) < 1e-7);
        let want: f64 = (0..4).map(|i| p[i].exp() * (p[i] - q[i])).sum();
        assert!((kl_divergence(&full, &q) - want).abs() < 1e-6);
        // With two of four tokens kept, the rest is one bucket: a lower bound.
        let top2 = &full[..2];
        let coarse = kl_divergence(top2, &q);
        assert!(coarse <= want + 1e-9 && coarse > 0.0, "{coarse} vs {want}");
    }

    #[test]
    fn chunks_open_with_the_prefix_and_drop_a_short_tail() {
        let text: Vec<u32> = (10..30).collect();
        let c = chunks(&text, &[1], 8, None);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0], vec![1, 10, 11, 12, 13, 14, 15, 16]);
        assert_eq!(c[1][..2], [1, 17]);
        assert_eq!(
            chunks(&text, &[], 8, Some(1)),
            vec![(10..18).collect::<Vec<u32>>()]
        );
        assert!(chunks(&text, &[], 21, None).is_empty());
    }

    #[test]
    fn a_reference_file_reads_back_and_names_its_text() {
        let run = Run {
            ctx: 64,
            vocab: 5,
            chunks: 1,
            text_hash: 42,
            scored: vec![
                score(&log_softmax(&[0.0, 1.0, 2.0, 3.0, 4.0]), 1, TOP),
                score(&log_softmax(&[4.0, 1.0, 2.0, 3.0, 0.0]), 0, TOP),
            ],
        };
        let path = std::env::temp_dir().join(format!("llama-relay-ppl-{}.bin", std::process::id()));
        run.save(&path).unwrap();
        let back = Run::load(&path).unwrap();
        assert_eq!(back, run);
        let text = Prepared {
            chunks: vec![vec![0; 64]],
            ctx: 64,
            vocab: 5,
            text_hash: 42,
        };
        assert!(back.scored_as(&text).is_ok());
        let other = Prepared {
            text_hash: 43,
            ..text.clone()
        };
        assert!(back.scored_as(&other).unwrap_err().contains("another text"));
        let shorter = Prepared {
            ctx: 32,
            ..text.clone()
        };
        assert!(back
            .scored_as(&shorter)
            .unwrap_err()
            .contains("--ctx and --chunks"));
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        assert!(Run::load(&path)
            .unwrap_err()
            .to_string()
            .contains("ends early"));
        std::fs::write(&path, b"hello").unwrap();
        assert!(Run::load(&path)
            .unwrap_err()
            .to_string()
            .contains("not a perplexity"));
        let _ = std::fs::remove_file(&path);
    }
}
