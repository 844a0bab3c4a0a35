//! What the fuzz targets (`fuzz/`, coverage-guided with libFuzzer) run on each input, here so
//! that `cargo test` replays the same functions over the saved corpus and every crash the fuzzer
//! ever found (`tests/integration/fuzz_corpus.rs`). Each harness panics when an invariant breaks:
//! - `client_frame`: any bytes as a WebSocket frame and as an OpenAI request body, parsed and
//!   validated with the shipped limits: an error or a value within the limits, never a panic.
//! - `chat_template`: arbitrary messages rendered with the chat template and tokenized: content
//!   adds no special token (markup in content stays text), the ids decode to the rendered text,
//!   and the length pre-check's lower bound holds.
//! - `detokenizer`: arbitrary token ids and stop strings through `ReplyText` (the incremental
//!   detokenizer and the stop-string scanner): the pieces sent concatenate to what it says it
//!   sent, never contain a stop string, and without stop strings equal decoding all ids at once.

use crate::protocol::{ChatParams, ClientFrame, Limits};
use crate::sampler::SamplingParams;
use crate::server::openai::wire::{ChatRequest, CompletionRequest};
use crate::server::reply::ReplyText;
use crate::tokenizer::{Message, TextTokenizer};

/// The shipped limits and sampling defaults (config/default.toml).
fn shipped() -> &'static (Limits, SamplingParams, usize) {
    static S: std::sync::OnceLock<(Limits, SamplingParams, usize)> = std::sync::OnceLock::new();
    S.get_or_init(|| {
        let s = crate::settings::Settings::load(None).expect("the shipped settings load");
        let c = s.session_config();
        (c.limits, c.sampling, c.default_max_tokens)
    })
}

pub fn client_frame(data: &[u8]) {
    let (limits, sampling, max_tokens) = shipped();
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(ClientFrame::Chat {
        id,
        messages,
        params,
    }) = serde_json::from_str::<ClientFrame>(text)
    {
        if let Ok(v) = limits.validate_chat(id, messages, params, sampling, *max_tokens) {
            assert!(v.max_tokens >= 1 && v.max_tokens <= limits.max_tokens);
            assert!(!v.messages.is_empty() && v.messages.len() <= limits.max_messages);
            assert!(v.stop.len() <= limits.max_stop_strings);
        }
    }
    if let Ok(r) = serde_json::from_str::<ChatRequest>(text) {
        if let Ok(v) = r.validate("x".into(), limits, sampling, *max_tokens) {
            assert!(v.chat.max_tokens >= 1 && v.chat.max_tokens <= limits.max_tokens);
        }
    }
    if let Ok(r) = serde_json::from_str::<CompletionRequest>(text) {
        let _ = r.validate("x".into(), limits, sampling);
    }
    let _ = serde_json::from_str::<ChatParams>(text);
}

/// Splits fuzz bytes into messages: each starts with a role byte (user, assistant, system) and
/// runs to the next 0xFF byte; content is the bytes as (lossy) UTF-8.
pub fn messages_of(data: &[u8]) -> Vec<Message> {
    data.split(|&b| b == 0xFF)
        .filter_map(|m| {
            let (&r, rest) = m.split_first()?;
            let role = ["user", "assistant", "system"][r as usize % 3];
            Some(Message::new(role, &String::from_utf8_lossy(rest)))
        })
        .take(16)
        .collect()
}

pub fn chat_template(tok: &TextTokenizer, data: &[u8]) {
    let messages = messages_of(data);
    if messages.is_empty() {
        return;
    }
    for m in &messages {
        // The length pre-check never refuses what would fit.
        if let (Some(least), Ok(ids)) = (
            tok.min_content_tokens(&m.content),
            tok.encode_text(&m.content),
        ) {
            assert!(
                ids.len() >= least,
                "{} tokens, but at least {least} by length",
                ids.len()
            );
        }
    }
    let Ok((text, ids)) = tok.encode_chat(&messages, true) else {
        return;
    };
    // The same conversation with every content empty: the template's own special tokens.
    let empty: Vec<Message> = (messages.iter())
        .map(|m| Message::new(&m.role, ""))
        .collect();
    let (_, template_ids) = tok.encode_chat(&empty, true).expect("the template renders");
    let specials = |ids: &[u32]| {
        let added = tok.inner().get_added_vocabulary();
        ids.iter()
            .filter(|&&id| added.simple_id_to_token(id).is_some())
            .count()
    };
    assert_eq!(
        specials(&ids),
        specials(&template_ids),
        "content added special tokens: {messages:?}"
    );
    let decoded = tok.decode(&ids, false).expect("ids decode");
    assert_eq!(decoded, text, "the ids do not decode to the rendered text");
}

/// Fuzz bytes as token ids (little-endian u32, reduced into the vocabulary) after up to two stop
/// strings (a length byte, then that many bytes each, lossy UTF-8).
pub fn detokenizer(tok: &TextTokenizer, data: &[u8]) {
    let mut rest = data;
    let mut stop = Vec::new();
    if let Some((&n, r)) = rest.split_first() {
        rest = r;
        for _ in 0..(n % 3) {
            let Some((&len, r)) = rest.split_first() else {
                break;
            };
            let len = (len as usize % 8).min(r.len());
            let s = String::from_utf8_lossy(&r[..len]).into_owned();
            rest = &r[len..];
            if !s.is_empty() {
                stop.push(s);
            }
        }
    }
    let vocab = tok.vocab_size().max(1) as u32;
    let ids: Vec<u32> = rest
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) % vocab)
        .take(256)
        .collect();
    let mut reply = ReplyText::new(stop.clone());
    let mut out = String::new();
    for &id in &ids {
        out.push_str(&reply.push(tok, id));
    }
    out.push_str(&reply.finish(tok));
    assert_eq!(out, reply.sent(), "sent pieces differ from the record");
    for s in &stop {
        assert!(
            !out.contains(s.as_str()),
            "stop string {s:?} was sent: {out:?}"
        );
    }
    if stop.is_empty() {
        let all = tok.decode(&ids, true).expect("ids decode");
        assert_eq!(
            out, all,
            "incremental text differs from decoding all at once"
        );
    }
}
