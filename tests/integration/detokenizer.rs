//! The streaming detokenizer emits complete UTF-8 only, and its pieces add up to the full decode.

use llama_relay::tokenizer::{IncrementalDecoder, TextTokenizer};

use crate::common::*;

#[test]
fn deltas_concatenate_to_the_full_decode_for_korean_emoji_and_code() {
    let tok = TextTokenizer::from_hf_dir(Tiny::Tied.dir(), &[]).unwrap();
    let exp = Tiny::Tied.expected();
    let mut all = Vec::new();
    for c in exp["tokenizer_cases"].as_array().unwrap() {
        all.extend(ids(&c["ids"]));
    }
    // Also a stream that starts mid-conversation with special tokens in it.
    all.extend(ids(&exp["chat"]["prompt_ids"]));
    for skip_special in [false, true] {
        let mut d = IncrementalDecoder::new(skip_special);
        let mut text = String::new();
        let mut pieces = 0;
        for &id in &all {
            if let Some(piece) = d.push(&tok, id).unwrap() {
                assert!(
                    !piece.contains('\u{FFFD}'),
                    "incomplete character emitted: {piece:?}"
                );
                text.push_str(&piece);
                pieces += 1;
            }
        }
        if let Some(rest) = d.finish(&tok).unwrap() {
            text.push_str(&rest);
        }
        assert_eq!(text, tok.decode(&all, skip_special).unwrap());
        assert!(
            pieces > all.len() / 2,
            "streams as it goes ({pieces} pieces)"
        );
    }
}

#[test]
fn an_emoji_split_over_tokens_waits_for_its_last_byte() {
    let tok = TextTokenizer::from_hf_dir(Tiny::Tied.dir(), &[]).unwrap();
    let crab = tok.encode_raw("🦀").unwrap();
    assert!(
        crab.len() > 1,
        "the crab takes several byte tokens: {crab:?}"
    );
    let mut d = IncrementalDecoder::new(true);
    for &id in &crab[..crab.len() - 1] {
        assert_eq!(d.push(&tok, id).unwrap(), None);
    }
    assert_eq!(
        d.push(&tok, *crab.last().unwrap()).unwrap().as_deref(),
        Some("🦀")
    );
}
