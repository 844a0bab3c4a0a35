//! Constrained decoding: a response format (a JSON Schema, any JSON object, a regular expression
//! or a Lark grammar) compiled into a per-sequence token mask that the core applies to a row of
//! logits before sampling, advanced with each sampled token.
//!
//! The grammar engine is `llguidance` (the one llama.cpp, vLLM, SGLang and mistral.rs use: an
//! Earley parser over a lazy lexer, masks in tens of microseconds); only its tokenizer side is
//! ours. `Grammars` builds its token trie from our own tokenizer's vocabulary (the byte-level
//! bytes each token stands for; special tokens behind llguidance's 0xFF marker, so no text a
//! grammar allows can be a control token), one per loaded model, and compiles formats. Compiling
//! takes milliseconds for a large schema, so it runs where a request's prompt is built (the
//! blocking pool), never on an I/O thread or in the batcher's step; compiled grammars are kept by
//! content hash *within one cache partition* (the request's principal): a grammar another
//! principal compiled is never found, so compile time cannot tell anyone what someone else sent.
//! `Constraint` is one sequence's matcher; the core computes the next step's masks on a second
//! thread while the forward pass runs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use toktrie::{SimpleVob, TokRxInfo, TokTrie, TokenizerEnv};

use crate::tokenizer::TextTokenizer;

/// What a reply must be, as a request gives it (OpenAI's `response_format`, and two extensions
/// the peers offer: a regular expression and a Lark grammar).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ResponseFormat {
    /// Free text (no constraint).
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid against a schema.
    JsonSchema { json_schema: JsonSchemaFormat },
    /// Text the whole of which matches a regular expression (extension).
    Regex { regex: String },
    /// Text a Lark grammar derives (llguidance's Lark dialect; extension).
    Lark { lark: String },
}

/// OpenAI's `response_format.json_schema`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct JsonSchemaFormat {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<Value>,
    /// Accepted for compatibility: the schema is always enforced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// Longest `json_schema.name` (OpenAI's limit).
pub const MAX_SCHEMA_NAME_CHARS: usize = 64;

impl ResponseFormat {
    /// Whether it constrains anything.
    pub fn is_text(&self) -> bool {
        matches!(self, ResponseFormat::Text)
    }

    /// Checks what can be checked without compiling: the name, and the size of the whole format
    /// against `max_bytes` (its JSON). Returns a message for the `response_format` field.
    pub fn check(&self, max_bytes: usize) -> Result<(), String> {
        let n = serde_json::to_string(self).map(|s| s.len()).unwrap_or(0);
        if n > max_bytes {
            return Err(format!(
                "must be at most {max_bytes} bytes of JSON (limits.max_schema_bytes). Given: {n}"
            ));
        }
        if let ResponseFormat::JsonSchema { json_schema: s } = self {
            let name = &s.name;
            let ok = (1..=MAX_SCHEMA_NAME_CHARS).contains(&name.chars().count())
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
            if !ok {
                return Err(format!(
                    "json_schema.name must be 1 to {MAX_SCHEMA_NAME_CHARS} characters of a-z, A-Z, 0-9, _ and -. Given: {name:?}"
                ));
            }
            if let Some(v) = &s.schema {
                if !v.is_object() && !v.is_boolean() {
                    return Err("json_schema.schema must be a JSON Schema object".into());
                }
            }
        }
        Ok(())
    }

    /// The grammar llguidance compiles. JSON is compact by default (`", "` and `": "` between
    /// items, no other whitespace): a small model offered free whitespace may spend its whole
    /// reply on newlines. A schema's own `x-guidance` options take precedence.
    fn grammar(&self) -> Option<TopLevelGrammar> {
        let json = |mut schema: Value| {
            if let Some(o) = schema.as_object_mut() {
                o.entry("x-guidance").or_insert_with(|| {
                    serde_json::json!({
                        "whitespace_flexible": false,
                        "item_separator": ", ",
                        "key_separator": ": ",
                    })
                });
            }
            TopLevelGrammar::from_json_schema(schema)
        };
        Some(match self {
            ResponseFormat::Text => return None,
            ResponseFormat::JsonObject => json(serde_json::json!({"type": "object"})),
            ResponseFormat::JsonSchema { json_schema } => match &json_schema.schema {
                Some(Value::Bool(true)) | None => json(serde_json::json!({})),
                Some(s) => json(s.clone()),
            },
            ResponseFormat::Regex { regex } => TopLevelGrammar::from_regex(regex),
            ResponseFormat::Lark { lark } => TopLevelGrammar::from_lark(lark.clone()),
        })
    }
}

/// Compiled grammars kept per loaded model.
const CACHED_GRAMMARS: usize = 128;

/// The tokenizer side of llguidance for one loaded model, and its compiled grammars.
pub struct Grammars {
    /// Why not, for a tokenizer the grammar engine cannot use (then only free text is served).
    factory: Result<ParserFactory, String>,
    cache: Mutex<Cache>,
    /// Grammars compiled (not found in the cache) since start.
    compiled: AtomicU64,
    /// Where compile times and cache hits are counted (the server's metrics).
    metrics: Option<(prometheus::Histogram, prometheus::IntCounter)>,
}

/// Compiled grammars' matchers at their start (the first mask computed) by (partition, format) hash, with when each was last used
/// (`clock` counts uses), so the least recently used goes first.
#[derive(Default)]
struct Cache {
    clock: u64,
    matchers: HashMap<[u8; 32], (u64, Matcher)>,
}

/// Our tokenizer as llguidance sees it: the trie of every id's bytes, and message-content
/// tokenization (special-token text stays text) for the few strings it tokenizes itself.
struct VocabEnv {
    trie: TokTrie,
    tokenizer: Arc<TextTokenizer>,
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        (self.tokenizer)
            .encode_text(&String::from_utf8_lossy(s))
            .unwrap_or_default()
    }
}

impl Grammars {
    /// The trie of `tokenizer`'s vocabulary, over the model's `vocab` logits (ids past the
    /// tokenizer's own, padding, are never allowed), ending on the tokenizer's end-of-turn ids.
    /// A tokenizer the grammar engine cannot use leaves a server that serves free text only
    /// (logged, and said in each refusal).
    pub fn new(tokenizer: Arc<TextTokenizer>, vocab: usize) -> Self {
        let factory = Self::factory(tokenizer, vocab).map_err(|e| {
            tracing::warn!(error = %e, "response formats are off: the grammar engine cannot use this tokenizer");
            format!("this model's tokenizer cannot be constrained: {e}")
        });
        Grammars {
            factory,
            cache: Mutex::new(Cache::default()),
            compiled: AtomicU64::new(0),
            metrics: None,
        }
    }

    /// Counts compile times into `compile` and cache hits into `hits`.
    pub fn with_metrics(
        mut self,
        compile: prometheus::Histogram,
        hits: prometheus::IntCounter,
    ) -> Self {
        self.metrics = Some((compile, hits));
        self
    }

    fn factory(tokenizer: Arc<TextTokenizer>, vocab: usize) -> anyhow::Result<ParserFactory> {
        let eos = tokenizer.eos_ids().to_vec();
        anyhow::ensure!(!eos.is_empty(), "the tokenizer names no end-of-turn token");
        let n = vocab.max(tokenizer.vocab_size());
        let special: HashMap<u32, String> = (tokenizer.inner().get_added_tokens_decoder())
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (id, t.content))
            .collect();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| match special.get(&id) {
                Some(text) => [&[TokTrie::SPECIAL_TOKEN_MARKER][..], text.as_bytes()].concat(),
                None if (id as usize) < tokenizer.vocab_size() => tokenizer.token_bytes(id),
                None => Vec::new(),
            })
            .collect();
        let info = TokRxInfo::new(n as u32, eos[0]);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: toktrie::TokEnv = Arc::new(VocabEnv { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        // A fifth and a quarter of llguidance's defaults: a mask that spends all its fuel takes
        // tens of milliseconds, not hundreds, in a step every reply shares (a hostile regex,
        // measured: 250 ms -> 44 ms), while the 32-schema validity test still compiles.
        let limits = factory.limits_mut();
        limits.initial_lexer_fuel = 200_000;
        limits.step_lexer_fuel = 50_000;
        Ok(factory)
    }

    /// The constraint of `format` for a request of `partition` (its principal), compiled or
    /// found among this partition's; `None` for free text. An error is the format's fault and
    /// says why (for the `response_format` field).
    pub fn compile(
        &self,
        format: &ResponseFormat,
        partition: u64,
    ) -> Result<Option<Constraint>, String> {
        let Some(grammar) = format.grammar() else {
            return Ok(None);
        };
        let factory = self.factory.as_ref().map_err(Clone::clone)?;
        let key: [u8; 32] = {
            let mut h = Sha256::new();
            h.update(partition.to_le_bytes());
            h.update(serde_json::to_vec(format).unwrap_or_default());
            h.finalize().into()
        };
        let cached = {
            let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            c.clock += 1;
            let now = c.clock;
            c.matchers.get_mut(&key).map(|(used, m)| {
                *used = now;
                m.deep_clone()
            })
        };
        let matcher = match cached {
            Some(m) => {
                if let Some((_, hits)) = &self.metrics {
                    hits.inc();
                }
                m
            }
            None => {
                let t = std::time::Instant::now();
                let p = (factory.create_parser(grammar)).map_err(|e| first_line(&e))?;
                let mut m = Matcher::new(Ok(p));
                if let Some(e) = m.get_error() {
                    return Err(e);
                }
                // The first mask here, not in the batcher's step: it spends the grammar's
                // initial fuel (a format that exhausts it is refused before it runs, and never
                // stalls a step other replies share), and the lexer states it builds are kept
                // with the cached copy.
                m.compute_mask().map_err(|e| first_line(&e))?;
                self.compiled.fetch_add(1, Ordering::Relaxed);
                if let Some((compile, _)) = &self.metrics {
                    compile.observe(t.elapsed().as_secs_f64());
                }
                let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
                if c.matchers.len() >= CACHED_GRAMMARS {
                    let oldest = (c.matchers.iter()).min_by_key(|(_, (used, _))| *used);
                    if let Some(old) = oldest.map(|(k, _)| *k) {
                        c.matchers.remove(&old);
                    }
                }
                let now = c.clock;
                c.matchers.insert(key, (now, m.deep_clone()));
                m
            }
        };
        let vocab = factory.tok_env().tok_trie().vocab_size();
        Ok(Some(Constraint { matcher, vocab }))
    }
}

impl Grammars {
    /// Grammars compiled since start (a request whose grammar was cached compiles none).
    pub fn compiled(&self) -> u64 {
        self.compiled.load(Ordering::Relaxed)
    }
}

fn first_line(e: &anyhow::Error) -> String {
    let s = e.to_string();
    s.lines()
        .next()
        .unwrap_or("the grammar does not compile")
        .to_string()
}

/// One sequence's grammar state.
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

/// The tokens a constraint allows next.
pub struct Mask(SimpleVob);

impl Mask {
    /// Sets every logit the mask forbids to minus infinity (ids past the mask included).
    pub fn apply(&self, logits: &mut [f32]) {
        for (i, l) in logits.iter_mut().enumerate() {
            if i >= self.0.len() || !self.0.is_allowed(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }
}

impl Constraint {
    /// The tokens allowed next; once the grammar is complete, only end-of-turn ids. An error
    /// (the parser's limits reached) says why.
    pub fn mask(&mut self) -> Result<Mask, String> {
        let m = (self.matcher.compute_mask_or_eos()).map_err(|e| first_line(&e))?;
        if m.is_zero() {
            return Err("the grammar allows no token here".into());
        }
        Ok(Mask(m))
    }

    /// Advances past `token`, sampled under this constraint's mask.
    pub fn accept(&mut self, token: u32) -> Result<(), String> {
        if (token as usize) >= self.vocab {
            return Err(format!("token {token} is outside the grammar's vocabulary"));
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| first_line(&e))
    }

    /// How many of `drafts` the grammar allows in a row from here (the state is unchanged).
    pub fn valid_prefix(&mut self, drafts: &[u32]) -> usize {
        if drafts.iter().any(|&t| t as usize >= self.vocab) || self.matcher.is_stopped() {
            return 0;
        }
        self.matcher.validate_tokens(drafts).unwrap_or(0)
    }

    /// The masks of the rows of a decode that runs `drafts` after its last token: the first is
    /// `mask()`, each next one the mask after the drafts before it, as far as the grammar
    /// allows them (a draft it forbids, a draft after it is complete, or a mask it cannot give,
    /// ends the list). The state is
    /// as before: the tokens the rows sample are `accept`ed after, one by one.
    pub fn masks_along(&mut self, drafts: &[u32]) -> Result<Vec<Mask>, String> {
        let mut masks = vec![self.mask()?];
        // Only drafts each mask allows are consumed, and none once the grammar is complete (the
        // row that completes it ends the reply): a token it refuses (an end-of-turn id after
        // its end, which the end's mask still allows) puts the matcher into an error state that
        // no rollback leaves.
        let mut consumed = 0;
        for &d in drafts {
            if self.is_complete() || !masks.last().is_some_and(|m| m.allows(d)) {
                break;
            }
            self.accept(d)?;
            consumed += 1;
            match self.mask() {
                Ok(m) => masks.push(m),
                Err(_) => break,
            }
        }
        if consumed > 0 {
            (self.matcher.rollback(consumed)).map_err(|e| first_line(&e))?;
        }
        Ok(masks)
    }

    /// The grammar is complete and allows nothing more than ending.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// An independent copy in the same state (a fork of the sequence).
    pub fn fork(&self) -> Constraint {
        Constraint {
            matcher: self.matcher.deep_clone(),
            vocab: self.vocab,
        }
    }
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        self.fork()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// Llama 3's tokenizer (the tiny fixture's), ending turns on `<|eot_id|>` and
    /// `<|end_of_text|>`, built once.
    fn grammars() -> (Arc<TextTokenizer>, Grammars) {
        static TOK: std::sync::OnceLock<Arc<TextTokenizer>> = std::sync::OnceLock::new();
        let tok = TOK.get_or_init(|| {
            use std::io::Read;
            let root = Path::new(env!("CARGO_MANIFEST_DIR"));
            let xz = std::fs::read(root.join("tests/fixtures/llama3-tiny/tokenizer.json.xz"));
            let mut json = Vec::new();
            xz2::read::XzDecoder::new(&xz.unwrap()[..])
                .read_to_end(&mut json)
                .unwrap();
            let dir = root.join("target/tmp/constraint-tests");
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join(format!("tokenizer-{}.json", std::process::id()));
            std::fs::write(&path, json).unwrap();
            let t = TextTokenizer::from_hf_files(&dir, &path, &[EOT, END]).unwrap();
            let _ = std::fs::remove_file(&path);
            Arc::new(t)
        });
        let g = Grammars::new(tok.clone(), tok.vocab_size());
        (tok.clone(), g)
    }

    const EOT: u32 = 128009;
    const END: u32 = 128001;

    fn regex(r: &str) -> ResponseFormat {
        ResponseFormat::Regex { regex: r.into() }
    }

    /// Greedy decoding over made-up logits that prefer `want`'s tokens, masked at each step:
    /// the text it ends with.
    fn decode(tok: &TextTokenizer, c: &mut Constraint, prefer: &[u32]) -> (String, bool) {
        let mut out = Vec::new();
        for step in 0..64 {
            let mut logits = vec![0.0f32; tok.vocab_size()];
            if let Some(&t) = prefer.get(step) {
                logits[t as usize] = 10.0;
            }
            let mask = c.mask().unwrap();
            mask.apply(&mut logits);
            let t = crate::sampler::argmax(&logits);
            assert!(mask.allows(t));
            if tok.eos_ids().contains(&t) {
                return (tok.decode(&out, false).unwrap(), true);
            }
            c.accept(t).unwrap();
            out.push(t);
            if c.is_complete() {
                return (tok.decode(&out, false).unwrap(), true);
            }
        }
        (tok.decode(&out, false).unwrap(), false)
    }

    #[test]
    fn masks_along_drafts_are_the_masks_of_accepting_them_one_by_one() {
        let (tok, g) = grammars();
        let format = regex("ORD-[0-9]{4} shipped");
        let mut c = g.compile(&format, 1).unwrap().unwrap();
        let ids = tok.encode_text("ORD-1234 shipped").unwrap();
        assert!(ids.len() >= 3, "{ids:?}");
        let allowed = |m: &Mask| {
            (0..tok.vocab_size() as u32)
                .filter(|&t| m.allows(t))
                .collect::<Vec<_>>()
        };
        // One by one, on a copy.
        let mut walk = c.fork();
        let mut want = Vec::new();
        for &t in &ids {
            want.push(allowed(&walk.mask().unwrap()));
            walk.accept(t).unwrap();
        }
        want.push(allowed(&walk.mask().unwrap()));
        // Along all the drafts: a mask a row, the last after every draft; the state unchanged.
        let masks = c.masks_along(&ids).unwrap();
        assert_eq!(masks.iter().map(allowed).collect::<Vec<_>>(), want);
        assert_eq!(c.valid_prefix(&ids), ids.len());
        assert_eq!(allowed(&c.mask().unwrap()), want[0]);
        // A draft the grammar forbids ends the masks (and the valid prefix) there.
        let mut wrong = ids.clone();
        wrong[1] = tok.encode_text("x").unwrap()[0];
        assert_eq!(c.masks_along(&wrong).unwrap().len(), 2);
        assert_eq!(c.valid_prefix(&wrong), 1);
        // Still at the start: the right drafts are accepted one by one afterwards.
        for &t in &ids {
            c.accept(t).unwrap();
        }
        assert!(c.is_complete() || c.mask().unwrap().allows(tok.eos_ids()[0]));
    }

    /// Drafts that run past the grammar's end (an n-gram draft copies an earlier reply: its last
    /// words, its end-of-turn id, what followed): the masks stop where the grammar ended and the
    /// state stays usable. The end-of-turn id after the end, allowed by the end's mask, once
    /// put the matcher into its error state ("parser stopped in consume_token"), and the reply
    /// failed on its next mask.
    #[test]
    fn drafts_past_the_grammars_end_leave_it_usable() {
        let (tok, g) = grammars();
        let format = regex("(yes|no)");
        let yes = tok.encode_text("yes").unwrap();
        let more = tok.encode_text(" and more").unwrap();
        for eot in [EOT, END] {
            let mut c = g.compile(&format, 1).unwrap().unwrap();
            let mut drafts = yes.clone();
            drafts.push(eot);
            drafts.extend(&more);
            let masks = c.masks_along(&drafts).unwrap();
            assert!(masks.len() <= yes.len() + 2, "{} masks", masks.len());
            // The state is the start's: the reply takes its tokens one by one.
            assert!(!c.is_complete());
            c.mask().unwrap();
            for &t in &yes {
                c.accept(t).unwrap();
            }
            assert!(c.is_complete() || c.mask().unwrap().allows(eot));
            // Twice over: the first walk left nothing behind.
            let mut c = g.compile(&format, 1).unwrap().unwrap();
            c.masks_along(&drafts).unwrap();
            c.masks_along(&drafts).unwrap();
            assert_eq!(c.valid_prefix(&yes), yes.len());
        }
    }

    #[test]
    fn the_trie_holds_each_tokens_bytes_and_hides_control_tokens() {
        let (tok, g) = grammars();
        let env = g.factory.as_ref().unwrap().tok_env().clone();
        let trie = env.tok_trie();
        assert_eq!(trie.vocab_size(), tok.vocab_size());
        for id in [100u32, 1000, 20000, 128000 - 1] {
            assert_eq!(trie.token(id), &tok.token_bytes(id)[..], "token {id}");
        }
        // Control tokens sit behind the 0xFF marker: no grammar's text spells them.
        let eot = trie.token(EOT);
        assert_eq!(eot[0], TokTrie::SPECIAL_TOKEN_MARKER);
        assert_eq!(&eot[1..], b"<|eot_id|>");
        let mut c = g.compile(&regex("<\\|eot_id\\|>"), 1).unwrap().unwrap();
        assert!(
            !c.mask().unwrap().allows(EOT),
            "the text may not be the control token"
        );
    }

    #[test]
    fn a_mask_allows_only_what_the_grammar_can_continue_with() {
        let (tok, g) = grammars();
        let mut c = g.compile(&regex("(yes|no)"), 1).unwrap().unwrap();
        // The model prefers "maybe": the mask leaves it no way there.
        let maybe = tok.encode_text("maybe").unwrap();
        let (text, ended) = decode(&tok, &mut c, &maybe);
        assert!(ended && (text == "yes" || text == "no"), "{text:?}");
        // Before anything, an end-of-turn id is not allowed; after a full match, nothing else is.
        let mut c = g.compile(&regex("(yes|no)"), 1).unwrap().unwrap();
        let m = c.mask().unwrap();
        assert!(!m.allows(EOT) && !m.allows(END));
        let yes = tok.encode_text("yes").unwrap();
        for &t in &yes {
            c.accept(t).unwrap();
        }
        assert!(c.is_complete());
        let m = c.mask().unwrap();
        assert!(m.allows(EOT) && m.allows(END) && !m.allows(yes[0]));
        // Ids past the mask (a model's padded vocabulary) are never allowed.
        let mut row = vec![1.0f32; tok.vocab_size() + 8];
        m.apply(&mut row);
        assert!(row[tok.vocab_size()..]
            .iter()
            .all(|l| *l == f32::NEG_INFINITY));
        assert_eq!(row[EOT as usize], 1.0);
    }

    /// The reference a mask is checked against, for a finite language (`words`): after `text`,
    /// a token is allowed iff `text` and its bytes begin some word, and an end-of-turn id iff
    /// `text` is a word; a control token never. Seeded walks compare every mask over the whole
    /// vocabulary with it (equal where the model has a choice; where the grammar forces the next
    /// text, llguidance allows only its canonical token, so there a subset), then take a random
    /// allowed token.
    #[test]
    fn masks_match_a_reference_walk_of_finite_languages() {
        use rand::{Rng, SeedableRng};
        let (tok, g) = grammars();
        let env = g.factory.as_ref().unwrap().tok_env().clone();
        let trie = env.tok_trie();
        let vocab = tok.vocab_size() as u32;
        let mut ids = Vec::new();
        for kind in ["order", "refund", "ticket"] {
            for n in 0..100 {
                ids.push(format!("{kind}-{n:02}"));
            }
        }
        let enums = ["open", "pending", "closed", "on hold"];
        let schema = ResponseFormat::JsonSchema {
            json_schema: serde_json::from_value(
                serde_json::json!({"name": "s", "schema": {"enum": enums}}),
            )
            .unwrap(),
        };
        let cases: Vec<(ResponseFormat, Vec<String>)> = vec![
            (regex("(order|refund|ticket)-[0-9]{2}"), ids),
            (schema, enums.iter().map(|e| format!("\"{e}\"")).collect()),
            (
                regex("a{1,3}b?"),
                ["a", "aa", "aaa", "ab", "aab", "aaab"]
                    .map(String::from)
                    .to_vec(),
            ),
        ];
        let mut rng = rand::rngs::StdRng::seed_from_u64(35);
        let (mut forced_states, mut free_states) = (0, 0);
        for (format, words) in &cases {
            let mut starts = std::collections::HashSet::new();
            for w in words {
                for i in 1..=w.len() {
                    starts.insert(w.as_bytes()[..i].to_vec());
                }
            }
            for walk in 0..4 {
                let mut c = g.compile(format, walk).unwrap().unwrap();
                let mut text = Vec::<u8>::new();
                loop {
                    let m = c.mask().unwrap();
                    let done = words.iter().any(|w| w.as_bytes() == &text[..]);
                    // The next byte is forced: every word that goes on from here has it.
                    let next: std::collections::HashSet<u8> = (words.iter())
                        .filter(|w| w.len() > text.len() && w.as_bytes().starts_with(&text))
                        .map(|w| w.as_bytes()[text.len()])
                        .collect();
                    let forced = !done && next.len() == 1;
                    forced_states += usize::from(forced);
                    let mut allowed = Vec::new();
                    for id in 0..vocab {
                        let bytes = trie.token(id);
                        let want = if id == EOT || id == END {
                            done
                        } else if bytes.first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER)
                            || bytes.is_empty()
                        {
                            false
                        } else {
                            starts.contains(&[&text[..], bytes].concat())
                        };
                        // Where the grammar forces text, llguidance allows only that text's
                        // own first token (its fast-forward): a subset of the reference.
                        let ok = if forced {
                            !m.allows(id) || want
                        } else {
                            m.allows(id) == want
                        };
                        assert!(
                            ok,
                            "{format:?} after {:?}: token {id} {:?} allowed {}, reference {want}",
                            String::from_utf8_lossy(&text),
                            String::from_utf8_lossy(bytes),
                            m.allows(id)
                        );
                        if m.allows(id) {
                            allowed.push(id);
                        }
                    }
                    assert!(!allowed.is_empty());
                    free_states += usize::from(!forced);
                    let t = allowed[rng.random_range(0..allowed.len())];
                    if t == EOT || t == END {
                        break;
                    }
                    c.accept(t).unwrap();
                    text.extend_from_slice(trie.token(t));
                }
                assert!(words.iter().any(|w| w.as_bytes() == &text[..]));
            }
        }
        // Both kinds of state were compared.
        assert!(
            forced_states > 0 && free_states > 10,
            "{forced_states} {free_states}"
        );
    }

    #[test]
    fn json_schema_output_is_compact_and_valid() {
        let (tok, g) = grammars();
        let f: ResponseFormat = serde_json::from_value(serde_json::json!({
            "type": "json_schema",
            "json_schema": {"name": "t", "schema": {
                "type": "object",
                "properties": {
                    "state": {"enum": ["open", "closed"]},
                    "n": {"type": "integer", "minimum": 1, "maximum": 5},
                },
                "required": ["state", "n"],
                "additionalProperties": false,
            }},
        }))
        .unwrap();
        let mut c = g.compile(&f, 1).unwrap().unwrap();
        // The model would rather write prose.
        let prose = tok.encode_text("Sure! Here is the ticket").unwrap();
        let (text, ended) = decode(&tok, &mut c, &prose);
        assert!(ended, "{text:?}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(
            ["open", "closed"].contains(&v["state"].as_str().unwrap()),
            "{v}"
        );
        assert!((1..=5).contains(&v["n"].as_i64().unwrap()), "{v}");
        assert!(
            !text.contains('\n') && text.contains("\": "),
            "compact: {text:?}"
        );
    }

    #[test]
    fn a_fork_goes_its_own_way() {
        let (tok, g) = grammars();
        let mut a = g.compile(&regex("(ab|cd)"), 1).unwrap().unwrap();
        let mut b = a.fork();
        let t = |s: &str| tok.encode_text(s).unwrap()[0];
        a.accept(t("a")).unwrap();
        assert!(!b.mask().unwrap().allows(t("b")), "b did not take a");
        b.accept(t("c")).unwrap();
        assert!(a.mask().unwrap().allows(t("b")));
        assert!(
            a.accept(t("d")).is_err(),
            "a grammar refuses a token its mask forbids"
        );
    }

    /// Compiling takes time a visitor can measure: a grammar compiled for one principal is never
    /// found by another, so nobody learns from a fast reply that someone else sent that schema.
    #[test]
    fn compiled_grammars_are_kept_per_principal() {
        let (_, g) = grammars();
        let f = ResponseFormat::JsonObject;
        g.compile(&f, 1).unwrap();
        assert_eq!(g.compiled(), 1);
        g.compile(&f, 1).unwrap();
        assert_eq!(g.compiled(), 1, "the same principal finds its own");
        g.compile(&f, 2).unwrap();
        assert_eq!(g.compiled(), 2, "another principal compiles its own");
        assert!(g.compile(&ResponseFormat::Text, 1).unwrap().is_none());
    }

    #[test]
    fn the_cache_forgets_the_least_recently_used() {
        let (_, g) = grammars();
        let f = |i: usize| regex(&format!("x{i}"));
        for i in 0..CACHED_GRAMMARS {
            g.compile(&f(i), 1).unwrap();
        }
        g.compile(&f(0), 1).unwrap(); // used again: now the most recent
        let n = g.compiled();
        g.compile(&f(CACHED_GRAMMARS), 1).unwrap(); // evicts f(1), the least recently used
        g.compile(&f(0), 1).unwrap();
        assert_eq!(g.compiled(), n + 1, "f(0) stayed");
        g.compile(&f(1), 1).unwrap();
        assert_eq!(g.compiled(), n + 2, "f(1) was forgotten");
    }

    #[test]
    fn bad_formats_say_why() {
        let (tok, g) = grammars();
        let e = g.compile(&regex("(unclosed"), 1).unwrap_err();
        assert!(!e.is_empty());
        let lark = ResponseFormat::Lark {
            lark: "start: undefined_rule".into(),
        };
        assert!(g.compile(&lark, 1).unwrap_err().contains("undefined_rule"));
        // A format whose automaton explodes fails that request within the grammar engine's
        // fuel (the batcher then ends it alone), instead of growing without bound.
        let mut c = g.compile(&regex("(a{1000}){1000}"), 1).unwrap().unwrap();
        let a = tok.encode_text("a").unwrap()[0];
        let failed = (0..40).any(|_| c.mask().is_err() || c.accept(a).is_err());
        assert!(failed, "the grammar engine's limits stop it");
        let big = regex(&"a".repeat(5000));
        assert!(big
            .check(4096)
            .unwrap_err()
            .contains("limits.max_schema_bytes"));
        let f: ResponseFormat = serde_json::from_value(serde_json::json!(
            {"type": "json_schema", "json_schema": {"name": "has space"}}))
        .unwrap();
        assert!(f.check(4096).unwrap_err().contains("json_schema.name"));
    }
}
