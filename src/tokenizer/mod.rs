//! Text in and out of the model: the tokenizer (from `tokenizer.json` or GGUF metadata), the chat
//! template, the end-of-turn ids, and the incremental detokenizer for streaming.
//!
//! Message content is text, never control: `encode_chat` finds special tokens (`<|im_start|>`,
//! `<|start_header_id|>`, `<|eot_id|>`, ...) only in what the chat template itself writes, and
//! tokenizes the text between them (the template's and every message's content together) with a
//! tokenizer that knows no added tokens at all, so a visitor who types
//! `<|im_end|><|im_start|>system` gets those characters as ordinary text tokens and cannot open
//! a turn of another role, while every other prompt has the ids transformers gives the whole
//! rendering. (transformers' `split_special_tokens` and llama.cpp's `parse_special` make the
//! same split for a whole string; here it is per span of the rendered prompt.)

pub mod chat_template;
pub mod detokenizer;
pub mod gguf;

use std::path::Path;

use candle_core::quantized::gguf_file::Content;
use serde_json::Value;

pub use chat_template::{CallSyntax, ChatTemplate, Message};
pub use detokenizer::IncrementalDecoder;

use crate::error::{EngineError, Result};
use crate::files::{md_str, read_json};

/// Token texts that end a turn in the chat formats we serve, looked up in GGUF vocabularies
/// (llama.cpp does the same: a GGUF names one EOS id, Llama 3 ends turns on several).
const END_OF_TURN_TOKENS: &[&str] = &[
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|im_end|>",
    "<|endoftext|>",
];

/// A tokenizer with the model's conventions around it.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    /// The same model and pre-tokenizer without the added vocabulary: message content.
    text_only: tokenizers::Tokenizer,
    /// Prepend BOS to plain prompts (GGUF `add_bos_token`; HF folders do it in the post-processor).
    add_bos: Option<u32>,
    eos_ids: Vec<u32>,
    template: Option<ChatTemplate>,
    /// Ids in all, added tokens included (tokenizers recounts by cloning the vocabulary).
    vocab_size: usize,
    /// The most bytes of text one token of content can stand for (`min_content_tokens`).
    max_token_bytes: usize,
}

fn token_string(v: Option<&Value>) -> Option<String> {
    match v {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).map(String::from),
        _ => None,
    }
}

/// The texts of the tokenizer's special tokens.
fn special_texts(t: &tokenizers::Tokenizer) -> Vec<String> {
    (t.get_added_tokens_decoder().values())
        .filter(|a| a.special)
        .map(|a| a.content.clone())
        .collect()
}

fn chat_template_source(v: Option<&Value>) -> Option<String> {
    match v {
        Some(Value::String(s)) => Some(s.clone()),
        // Newer configs hold a list of named templates; "default" is the chat one.
        Some(Value::Array(a)) => a
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| a.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(String::from),
        _ => None,
    }
}

impl TextTokenizer {
    /// From a Hugging Face folder: `tokenizer.json` and (optional) `tokenizer_config.json`.
    /// `model_eos` are the end-of-turn ids from config.json / generation_config.json.
    pub fn from_hf_dir(dir: &Path, model_eos: &[u32]) -> Result<Self> {
        Self::from_hf_files(dir, &dir.join("tokenizer.json"), model_eos)
    }

    /// As `from_hf_dir`, with the `tokenizer.json` taken from `path`.
    pub fn from_hf_files(dir: &Path, path: &Path, model_eos: &[u32]) -> Result<Self> {
        let path = path.to_path_buf();
        if !path.exists() {
            return Err(EngineError::ModelNotFound { path });
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| EngineError::Tokenizer(format!("{}: {e}", path.display())))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = if cfg_path.exists() {
            read_json(&cfg_path)?
        } else {
            Value::Null
        };
        let bos = token_string(cfg.get("bos_token")).unwrap_or_default();
        let eos = token_string(cfg.get("eos_token")).unwrap_or_default();
        let mut eos_ids = model_eos.to_vec();
        if eos_ids.is_empty() {
            eos_ids.extend(inner.token_to_id(&eos));
        }
        let template = match chat_template_source(cfg.get("chat_template")) {
            Some(src) => Some(ChatTemplate::new(&src, &bos, &eos, &special_texts(&inner))?),
            None => None,
        };
        Ok(TextTokenizer::assemble(inner, None, eos_ids, template))
    }

    /// From a tokenizer.json given separately (for GGUF files whose own tokenizer we cannot build).
    pub fn from_file_with_gguf(path: &Path, c: &Content, model_eos: &[u32]) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| EngineError::Tokenizer(format!("{}: {e}", path.display())))?;
        Self::finish_gguf(inner, c, model_eos)
    }

    /// From GGUF metadata.
    pub fn from_gguf(c: &Content, model_eos: &[u32]) -> Result<Self> {
        Self::finish_gguf(gguf::tokenizer_from_gguf(c)?, c, model_eos)
    }

    fn finish_gguf(inner: tokenizers::Tokenizer, c: &Content, model_eos: &[u32]) -> Result<Self> {
        let id = |k: &str| c.metadata.get(k).and_then(|v| v.to_u32().ok());
        let bos_id = id("tokenizer.ggml.bos_token_id");
        let add_bos = c
            .metadata
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(true);
        let mut eos_ids = model_eos.to_vec();
        for t in END_OF_TURN_TOKENS {
            if let Some(i) = inner
                .get_added_vocabulary()
                .token_to_id(t, inner.get_model())
            {
                if !eos_ids.contains(&i) {
                    eos_ids.push(i);
                }
            }
        }
        let text = |i: Option<u32>| i.and_then(|i| inner.id_to_token(i)).unwrap_or_default();
        let template = match md_str(c, "tokenizer.chat_template") {
            Some(src) => Some(ChatTemplate::new(
                src,
                &text(bos_id),
                &text(id("tokenizer.ggml.eos_token_id")),
                &special_texts(&inner),
            )?),
            None => None,
        };
        Ok(TextTokenizer::assemble(
            inner,
            if add_bos { bos_id } else { None },
            eos_ids,
            template,
        ))
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Ids that end a generation.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// How the chat template writes a function call, when it takes `tools`.
    pub fn call_syntax(&self) -> Option<&CallSyntax> {
        self.template.as_ref().and_then(ChatTemplate::call_syntax)
    }

    /// Tokenizes raw text with the model's special-token conventions (BOS where the model wants it).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        let mut ids = enc.get_ids().to_vec();
        if let Some(bos) = self.add_bos {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// Tokenizes text as it is: special tokens written in it are recognised, nothing is added.
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        ids_of(&self.inner, text)
    }

    /// Tokenizes message content: special-token text in it stays text.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        ids_of(&self.text_only, text)
    }

    /// Renders the conversation with the chat template and tokenizes it: the template's own text
    /// with its special tokens (it writes BOS itself, so nothing is added, as transformers'
    /// `apply_chat_template` does), each message's content as plain text (`encode_text`).
    pub fn encode_chat(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<(String, Vec<u32>)> {
        self.encode_chat_with(messages, None, add_generation_prompt)
    }

    /// As `encode_chat`, with `tools` (chat completions' shape) for a template that takes them
    /// (`call_syntax`).
    pub fn encode_chat_with(
        &self,
        messages: &[Message],
        tools: Option<&Value>,
        add_generation_prompt: bool,
    ) -> Result<(String, Vec<u32>)> {
        let t = self
            .template
            .as_ref()
            .ok_or_else(|| EngineError::ChatTemplate("the model has no chat template".into()))?;
        let spans = t.render_spans(messages, tools, add_generation_prompt)?;
        let text: String = (spans.iter())
            .map(|s| match s {
                chat_template::Span::Template(s) | chat_template::Span::Content(s) => s.as_str(),
            })
            .collect();
        Ok((text, self.encode_spans(&spans)?))
    }

    /// The ids of rendered spans: the special tokens the template wrote (found in its own text
    /// only), and between them the text, template's and content's together, tokenized as text.
    /// The same ids as tokenizing the whole rendering (as transformers does) wherever content
    /// spells no special token, and content never makes one.
    fn encode_spans(&self, spans: &[chat_template::Span]) -> Result<Vec<u32>> {
        use tokenizers::{OffsetReferential, OffsetType};
        let mut ids = Vec::new();
        let mut run = String::new();
        for span in spans {
            match span {
                chat_template::Span::Content(s) => run.push_str(s),
                chat_template::Span::Template(s) => {
                    let added = self.inner.get_added_vocabulary();
                    let split = added.extract_and_normalize(self.inner.get_normalizer(), s);
                    for (_, (a, b), tokens) in
                        split.get_splits(OffsetReferential::Original, OffsetType::Byte)
                    {
                        match tokens {
                            Some(t) => {
                                ids.extend(self.encode_text(&std::mem::take(&mut run))?);
                                ids.extend(t.iter().map(|t| t.id));
                            }
                            None => run.push_str(&s[a..b]),
                        }
                    }
                }
            }
        }
        ids.extend(self.encode_text(&run)?);
        Ok(ids)
    }

    /// The token ids of `messages` rendered with the chat template up to the end of the last
    /// message's content, leaving out what the template adds after it: the prompt of a
    /// conversation whose last message is still being written (a draft).
    pub fn encode_chat_open(&self, messages: &[Message]) -> Result<Vec<u32>> {
        let t = self
            .template
            .as_ref()
            .ok_or_else(|| EngineError::ChatTemplate("the model has no chat template".into()))?;
        let spans = t.render_spans(messages, None, false)?;
        let last = spans
            .iter()
            .rposition(|s| matches!(s, chat_template::Span::Content(_)))
            .map_or(0, |i| i + 1);
        self.encode_spans(&spans[..last])
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))
    }

    /// The bytes token `id` stands for (OpenAI's logprobs `bytes`): a byte-level BPE token's
    /// characters mapped back to bytes (one token can hold part of a character), an added token's
    /// own text, otherwise the token decoded alone.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let byte_level = matches!(
            self.inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        );
        // An added token's text (a lookup, not `get_added_tokens_decoder`, which clones the map).
        if let Some(t) = self.inner.get_added_vocabulary().simple_id_to_token(id) {
            return t.into_bytes();
        }
        if let (true, Some(t)) = (byte_level, self.inner.id_to_token(id)) {
            if let Some(b) = t.chars().map(byte_level_byte).collect::<Option<Vec<u8>>>() {
                return b;
            }
        }
        self.decode(&[id], false).unwrap_or_default().into_bytes()
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// A lower bound on the tokens `text` takes as message content, from its length alone: no
    /// token stands for more than `max_token_bytes` bytes. `None` when the tokenizer normalizes
    /// text (a normalizer may shorten it first, so length bounds nothing).
    pub fn min_content_tokens(&self, text: &str) -> Option<usize> {
        if self.text_only.get_normalizer().is_some() {
            return None;
        }
        Some(text.len().div_ceil(self.max_token_bytes.max(1)))
    }

    fn assemble(
        inner: tokenizers::Tokenizer,
        add_bos: Option<u32>,
        eos_ids: Vec<u32>,
        template: Option<ChatTemplate>,
    ) -> Self {
        let vocab = inner.get_vocab(true);
        // A token's string is at least as long as the text it stands for: a byte-level token
        // has one character per byte, a SentencePiece one writes a space as three bytes and a
        // byte as `<0xNN>`.
        let max_token_bytes = (vocab.keys().map(String::len).max()).unwrap_or(1);
        TextTokenizer {
            text_only: text_only(&inner),
            vocab_size: vocab.len(),
            max_token_bytes,
            inner,
            add_bos,
            eos_ids,
            template,
        }
    }
}

/// `text` through `t` with nothing added.
fn ids_of(t: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    let enc = t
        .encode(text, false)
        .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
    Ok(enc.get_ids().to_vec())
}

/// `inner`'s model, normalizer and pre-tokenizer without its added vocabulary: no string can
/// become a special (or any added) token through it.
fn text_only(inner: &tokenizers::Tokenizer) -> tokenizers::Tokenizer {
    let mut t = tokenizers::Tokenizer::new(inner.get_model().clone());
    t.with_normalizer(inner.get_normalizer().cloned());
    t.with_pre_tokenizer(inner.get_pre_tokenizer().cloned());
    t.with_decoder(inner.get_decoder().cloned());
    t
}

/// The byte a GPT-2 byte-level character stands for: printable Latin-1 bytes are themselves,
/// the other 68 are the characters from U+0100 on, in byte order.
fn byte_level_byte(c: char) -> Option<u8> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    let c = c as u32;
    if c < 0x100 {
        return (printable(c)).then_some(c as u8);
    }
    let n = (c - 0x100) as usize;
    (0u32..256)
        .filter(|&b| !printable(b))
        .nth(n)
        .map(|b| b as u8)
}
