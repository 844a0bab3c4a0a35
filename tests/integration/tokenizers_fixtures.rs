//! Tokenizers against the fixture ids: the Llama 3 tokenizers of the tiny models (tokenizer.json)
//! and the SmolLM2 tokenizer built from GGUF metadata.

use llama_relay::default_model::ensure_default_model;
use llama_relay::model::loader::read_gguf;
use llama_relay::tokenizer::TextTokenizer;

use crate::common::*;

fn check_cases(tok: &TextTokenizer, cases: &serde_json::Value, what: &str) {
    let cases = cases.as_array().unwrap();
    assert!(cases.len() >= 6);
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        assert_eq!(tok.encode_raw(text).unwrap(), want, "{what} {name}: ids");
        assert_eq!(
            tok.encode_prompt(text).unwrap(),
            ids(&c["ids_add_special_tokens"]),
            "{what} {name}: ids with special tokens"
        );
        assert_eq!(
            tok.decode(&want, false).unwrap(),
            c["decode"].as_str().unwrap(),
            "{what} {name}: decode"
        );
        assert_eq!(
            tok.decode(&want, true).unwrap(),
            c["decode_skip_special_tokens"].as_str().unwrap(),
            "{what} {name}: decode skipping special tokens"
        );
    }
}

#[test]
fn llama3_tokenizers_match_fixture() {
    for which in [Tiny::Tied, Tiny::Untied] {
        let tok = TextTokenizer::from_hf_dir(which.dir(), &[]).unwrap();
        check_cases(
            &tok,
            &which.expected()["tokenizer_cases"],
            &format!("{which:?}"),
        );
    }
}

#[test]
fn llama3_chat_prompt_ids_match_fixture() {
    for which in [Tiny::Tied, Tiny::Untied] {
        let exp = which.expected();
        let tok = TextTokenizer::from_hf_dir(which.dir(), &[]).unwrap();
        let msgs: Vec<llama_relay::tokenizer::Message> =
            serde_json::from_value(exp["chat"]["messages"].clone()).unwrap();
        let (text, got) = tok.encode_chat(&msgs, true).unwrap();
        assert_eq!(
            text,
            exp["chat"]["prompt_text"].as_str().unwrap(),
            "{which:?}"
        );
        assert_eq!(
            got,
            ids(&exp["chat"]["prompt_ids"]),
            "{which:?}: one BOS, from the template"
        );
    }
}

#[test]
fn smollm2_gguf_tokenizer_matches_fixture() {
    let path = ensure_default_model().unwrap();
    let (content, _) = read_gguf(&path).unwrap();
    let tok = TextTokenizer::from_gguf(&content, &[]).unwrap();
    let fx = read_json(&fixtures().join("smollm2/tokenizer.json"));
    check_cases(&tok, &fx["cases"], "smollm2");
    // The chat template from the GGUF renders the reference prompt (with its default system prompt).
    let gen = read_json(&fixtures().join("smollm2/generation.json"));
    let msgs: Vec<llama_relay::tokenizer::Message> =
        serde_json::from_value(gen["messages"].clone()).unwrap();
    let (text, got) = tok.encode_chat(&msgs, true).unwrap();
    assert_eq!(text, gen["prompt_text"].as_str().unwrap());
    assert_eq!(got, ids(&gen["prompt_ids"]));
    assert!(tok.eos_ids().contains(&2), "<|im_end|> ends a turn");
}

/// Turn N+1 rendered with the chat template starts with exactly turn N's prompt plus its reply
/// tokens (end-of-turn included) for the SmolLM2 and Llama 3 templates, so a session's cached
/// conversation is reused token for token. (The server never assumes it: lookups compare tokens.)
#[test]
fn chat_templates_extend_the_previous_turn_token_for_token() {
    let smol = {
        let path = ensure_default_model().unwrap();
        let (content, _) = read_gguf(&path).unwrap();
        TextTokenizer::from_gguf(&content, &[]).unwrap()
    };
    let llama = TextTokenizer::from_hf_dir(Tiny::Tied.dir(), &[]).unwrap();
    for (name, tok, eot) in [("smollm2", &smol, 2u32), ("llama3", &llama, 128009u32)] {
        let reply = "The capital of France is Paris.";
        let mut turn = vec![
            llama_relay::tokenizer::Message::new("system", "You are brief."),
            llama_relay::tokenizer::Message::new("user", "What is the capital of France?"),
        ];
        let (_, p1) = tok.encode_chat(&turn, true).unwrap();
        // What the model generated: the reply's tokens and the end-of-turn token.
        let mut generated = tok.encode_raw(reply).unwrap();
        generated.push(eot);
        turn.push(llama_relay::tokenizer::Message::new("assistant", reply));
        turn.push(llama_relay::tokenizer::Message::new(
            "user",
            "And of Germany?",
        ));
        let (_, p2) = tok.encode_chat(&turn, true).unwrap();
        let mut computed = p1.clone();
        computed.extend(&generated);
        assert!(
            p2.starts_with(&computed),
            "{name}: turn 2 does not extend turn 1\n{p1:?}\n{generated:?}\n{p2:?}"
        );
    }
}
