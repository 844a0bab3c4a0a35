//! Builds a `tokenizers::Tokenizer` from GGUF metadata (`tokenizer.ggml.*`).
//!
//! Written here rather than taken from candle because candle-core 0.11.1's `TokenizerFromGguf`
//! adds a prefix space for `pre = smollm` ("<|im_start|>user" becomes "Ġuser"), which changes ids.
//! We follow llama.cpp's per-`pre` regex lists instead:
//! - `llama-bpe` / `llama3`: the Llama 3 regex, then byte-level without its own regex;
//! - `gpt2` / `default` / `smollm`: byte-level with the GPT-2 regex, no prefix space (for smollm,
//!   llama.cpp also splits digits first; see the comment at the match for why we do not).
//!
//! Control tokens (type 3) become special added tokens, user-defined ones (type 4) added tokens.

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::error::{EngineError, Result};

/// The Llama 3 pre-tokenizer regex (as in Meta's tokenizer.json and llama.cpp's `llama-bpe`).
pub const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;

fn strings(c: &Content, key: &str) -> Result<Vec<String>> {
    let v = c
        .metadata
        .get(key)
        .ok_or_else(|| EngineError::Tokenizer(format!("GGUF metadata has no `{key}`")))?;
    let arr = v
        .to_vec()
        .map_err(|_| EngineError::Tokenizer(format!("`{key}` is not an array")))?;
    arr.iter()
        .map(|x| {
            x.to_string()
                .cloned()
                .map_err(|_| EngineError::Tokenizer(format!("`{key}` holds a non-string")))
        })
        .collect()
}

fn token_types(c: &Content, n: usize) -> Vec<i32> {
    let Some(Value::Array(a)) = c.metadata.get("tokenizer.ggml.token_type") else {
        return vec![1; n];
    };
    a.iter()
        .map(|v| {
            v.to_i32()
                .or_else(|_| v.to_u32().map(|x| x as i32))
                .unwrap_or(1)
        })
        .collect()
}

fn split(pattern: &str) -> Result<PreTokenizerWrapper> {
    let s = Split::new(
        SplitPattern::Regex(pattern.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| EngineError::Tokenizer(format!("bad pre-tokenizer regex: {e}")))?;
    Ok(PreTokenizerWrapper::Split(s))
}

/// Builds the tokenizer. Errors name the metadata key or the unsupported value.
pub fn tokenizer_from_gguf(c: &Content) -> Result<Tokenizer> {
    let model = crate::files::md_str(c, "tokenizer.ggml.model").unwrap_or("");
    if model != "gpt2" {
        return Err(EngineError::Tokenizer(format!(
            "GGUF tokenizer model `{model}` is not supported (only byte-level BPE, `gpt2`); \
             set model.tokenizer to a tokenizer.json for this model"
        )));
    }
    let tokens = strings(c, "tokenizer.ggml.tokens")?;
    let merges = strings(c, "tokenizer.ggml.merges")?;
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| EngineError::Tokenizer(format!("merge `{m}` has no space")))
        })
        .collect::<Result<_>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| EngineError::Tokenizer(format!("cannot build BPE: {e}")))?;
    let mut tok = Tokenizer::new(bpe);
    let pre = crate::files::md_str(c, "tokenizer.ggml.pre").unwrap_or("default");
    let pre_tok: PreTokenizerWrapper = match pre {
        // smollm: llama.cpp splits `\p{N}` first, but no multi-character token of that vocabulary
        // holds a digit, and the split changes how whitespace before a digit groups ("\n\n3"):
        // transformers' plain byte-level pre-tokenizer is the reference, so use it.
        "default" | "gpt2" | "smollm" => ByteLevel::new(false, true, true).into(),
        "llama-bpe" | "llama3" => {
            Sequence::new(vec![split(LLAMA3_PATTERN)?, ByteLevel::new(false, true, false).into()]).into()
        }
        other => {
            return Err(EngineError::Tokenizer(format!(
                "GGUF pre-tokenizer `{other}` is not supported (supported: default, gpt2, smollm, llama-bpe); \
                 set model.tokenizer to a tokenizer.json for this model"
            )))
        }
    };
    tok.with_pre_tokenizer(Some(pre_tok));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    let types = token_types(c, tokens.len());
    let special: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, &t)| t == TYPE_CONTROL)
        .map(|(s, _)| AddedToken::from(s.clone(), true))
        .collect();
    let user: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, &t)| t == TYPE_USER_DEFINED)
        .map(|(s, _)| AddedToken::from(s.clone(), false))
        .collect();
    tok.add_special_tokens(&special);
    tok.add_tokens(&user);
    Ok(tok)
}
