//! OpenAI's request and response bodies, parsed into the request seam (`GenerateParams` and
//! messages, validated by `Limits::validate` into a `ValidRequest`, as every dialect's request
//! is), so one definition of every limit serves all. Pure: no actix, no engine.
//!
//! Fields follow OpenAI's API reference. Fields that would change what a reply means and that
//! this server does not do (tools, audio, logit bias, several prompts in one completion
//! request) are refused with 400 naming the field; unknown fields are ignored, as
//! OpenAI's server does.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::sampler::{SamplingOverrides, SamplingParams, MAX_TOP_LOGPROBS};
use crate::server::request::tools::{spaced, valid_name, Shape, Tools};
use crate::server::request::{Field, GenerateParams, Limits, RequestError, ValidRequest};
use crate::tokenizer::Message;

/// Most choices (`n`) one request may ask for: each is a running sequence.
pub const MAX_CHOICES: usize = 8;

/// `max_tokens` of a completion request that gives none (OpenAI's default for `/v1/completions`).
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Sampling and limit fields both endpoints take.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonFields {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    /// OpenAI's temperature, top_p, seed, presence and frequency penalties, and this server's
    /// top_k, min_p and repetition_penalty.
    #[serde(flatten)]
    pub sampling: SamplingOverrides,
    pub n: Option<i64>,
    pub stop: Option<OneOrMany>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    pub prompt_cache_key: Option<String>,
    pub logit_bias: Option<Map<String, Value>>,
    // This server's extras.
    pub ignore_eos: Option<bool>,
    pub priority: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ApiMessage>,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub response_format: Option<Value>,
    pub modalities: Option<Vec<String>>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// The Responses API's `truncation`: `auto` drops whole oldest turns when the conversation
    /// outgrows the context (`limits.overflow_retention` of the room kept), `disabled` (the
    /// default, as OpenAI's) refuses it.
    pub truncation: Option<String>,
    #[serde(flatten)]
    pub common: CommonFields,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ApiMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Option<PromptField>,
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
    #[serde(flatten)]
    pub common: CommonFields,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

/// A completion's prompt: text to tokenize, or token ids as given.
#[derive(Debug, Clone, PartialEq)]
pub enum RawPrompt {
    Text(String),
    Ids(Vec<u32>),
}

/// What both endpoints validate to.
#[derive(Debug, Clone)]
pub struct ValidApi {
    /// The validated request (`id` is the response id).
    pub chat: ValidRequest,
    /// OpenAI's end-user id: it splits an API key's cache (`ValidRequest::partition`).
    pub user: Option<String>,
    /// Choices; the first is the request, the rest fork from its prefill.
    pub n: usize,
    /// Alternatives per token when log-probabilities are asked for.
    pub logprobs: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
}

/// A field only OpenAI's API has, and what is wrong with it.
fn bad(param: &str, reason: impl std::fmt::Display) -> RequestError {
    RequestError::invalid(Field::Wire(param.into()), reason)
}

/// Refuses fields whose meaning this server does not serve (present and not null).
fn refuse_unsupported(other: &Map<String, Value>, fields: &[&str]) -> Result<(), RequestError> {
    for f in fields {
        match other.get(*f) {
            None | Some(Value::Null) => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(Value::String(s)) if *f == "tool_choice" && s == "none" => {}
            Some(_) => {
                return Err(bad(
                    f,
                    "is not supported by this server (text generation only: no tools, functions, audio or predicted outputs)",
                ))
            }
        }
    }
    Ok(())
}

fn non_negative(param: &str, v: Option<i64>) -> Result<Option<usize>, RequestError> {
    match v {
        Some(x) if x < 0 => Err(bad(param, format!("must be 0 or more. Given: {x}"))),
        Some(x) => Ok(Some(x as usize)),
        None => Ok(None),
    }
}

impl CommonFields {
    /// The fields every endpoint checks the same way, as a `ValidRequest` over `messages`.
    #[allow(clippy::too_many_arguments)]
    fn validate(
        &self,
        id: String,
        messages: Vec<Message>,
        max_tokens: Option<i64>,
        logprobs: Option<usize>,
        response_format: Option<Value>,
        limits: &Limits,
        defaults: &SamplingParams,
        default_max_tokens: usize,
    ) -> Result<ValidApi, RequestError> {
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(bad("logit_bias", "is not supported by this server"));
        }
        let n = non_negative("n", self.n)?.unwrap_or(1);
        if n == 0 || n > MAX_CHOICES {
            return Err(bad(
                "n",
                format!("must be between 1 and {MAX_CHOICES}. Given: {n}"),
            ));
        }
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(bad(
                "stream_options",
                "is only allowed when `stream` is true",
            ));
        }
        let max_tokens = match max_tokens {
            Some(x) if x <= 0 => {
                return Err(bad(
                    "max_tokens",
                    format!("must be between 1 and {}. Given: {x}", limits.max_tokens),
                ))
            }
            Some(x) => Some(x as usize),
            None => None,
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(OneOrMany::One(s)) => vec![s.clone()],
            Some(OneOrMany::Many(v)) => v.clone(),
        };
        let params = GenerateParams {
            sampling: self.sampling.clone(),
            max_tokens,
            stop,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            cache_key: self.prompt_cache_key.clone(),
            priority: self.priority.clone(),
            window: None,
            response_format,
            overflow: None,
            retention_ratio: None,
        };
        let chat = limits.validate(id, messages, params, defaults, default_max_tokens)?;
        Ok(ValidApi {
            chat,
            user: self.user.clone(),
            n,
            logprobs,
            stream,
            include_usage: (self.stream_options.as_ref())
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
        })
    }
}

impl ChatRequest {
    /// Checks the request; `id` becomes the response's id, `syntax` how the model's template
    /// writes a function call (`None`: the generic format).
    pub fn validate(
        self,
        id: String,
        limits: &Limits,
        defaults: &SamplingParams,
        default_max_tokens: usize,
        syntax: Option<&crate::tokenizer::CallSyntax>,
    ) -> Result<ValidApi, RequestError> {
        refuse_unsupported(
            &self.other,
            &[
                "functions",
                "function_call",
                "audio",
                "prediction",
                "web_search_options",
            ],
        )?;
        let response_format = self.response_format;
        if let Some(m) = self.modalities.iter().flatten().find(|m| *m != "text") {
            return Err(bad(
                "modalities",
                format!("may only hold \"text\". Given: {m:?}"),
            ));
        }
        let tools = Tools::parse(
            self.tools.as_deref(),
            self.tool_choice.as_ref(),
            self.parallel_tool_calls,
            limits.max_schema_bytes,
            Shape::Nested,
        )?
        .map(|t| t.for_template(syntax));
        if tools.as_ref().is_some_and(Tools::active)
            && (response_format.as_ref())
                .is_some_and(|f| f.get("type").and_then(Value::as_str) != Some("text"))
        {
            return Err(bad(
                "response_format",
                "cannot be combined with tools this server may call (a tool_choice other than \"none\")",
            ));
        }
        let mut calls = std::collections::HashMap::new();
        let messages = self
            .messages
            .into_iter()
            .enumerate()
            .map(|(i, m)| m.into_message(i, &mut calls))
            .collect::<Result<Vec<_>, _>>()?;
        let logprobs = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (true, k) => Some(non_negative("top_logprobs", k)?.unwrap_or(0)),
            (false, None | Some(0)) => None,
            (false, Some(_)) => {
                return Err(bad("top_logprobs", "needs `logprobs` set to true"));
            }
        };
        check_alternatives("top_logprobs", logprobs)?;
        let max_tokens = self.max_completion_tokens.or(self.common.max_tokens);
        let mut api = self.common.validate(
            id,
            messages,
            max_tokens,
            logprobs,
            response_format,
            limits,
            defaults,
            default_max_tokens,
        )?;
        if let Some(t) = tools {
            std::sync::Arc::new(t).apply(&mut api.chat);
        }
        // As OpenAI's chat completions: a request that does not fit is refused unless it asks
        // for truncation (sessions, which keep their conversation, follow `limits.overflow`).
        let overflow = match self.truncation.as_deref() {
            None | Some("disabled") => Some("error"),
            Some("auto") => Some("drop_oldest"),
            Some(other) => {
                return Err(bad(
                    "truncation",
                    format!("must be auto or disabled. Given: {other:?}"),
                ))
            }
        };
        api.chat.overflow = limits.overflow(overflow, None)?;
        Ok(api)
    }
}

impl ApiMessage {
    /// One of OpenAI's message forms as a chat template message: `developer` is the system role
    /// by its newer name; content is a string or text parts, joined.
    ///
    /// An assistant message's `tool_calls` become its calls (`Message::calls`, written as the
    /// model writes them where the prompt is built; `calls` keeps each call's id and name), a
    /// `tool` message the named function's result (`Tools::result_message`).
    fn into_message(
        self,
        i: usize,
        calls: &mut std::collections::HashMap<String, String>,
    ) -> Result<Message, RequestError> {
        let role = match self.role.as_str() {
            "developer" => "system".to_string(),
            "function" => return Err(bad(
                &format!("messages[{i}].role"),
                "\"function\" is the deprecated form: send \"tool\" messages with a tool_call_id",
            )),
            _ => self.role.clone(),
        };
        let tool_calls = match self.other.get("tool_calls") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) if role == "assistant" => a.clone(),
            Some(_) => {
                return Err(bad(
                    &format!("messages[{i}].tool_calls"),
                    "must be a list, on an assistant message",
                ))
            }
        };
        if !tool_calls.is_empty() {
            let mut written = Vec::new();
            for (j, c) in tool_calls.iter().enumerate() {
                let at = |f: &str| format!("messages[{i}].tool_calls[{j}].{f}");
                let id = c
                    .get("id")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty());
                let id = id.ok_or_else(|| bad(&at("id"), "is required"))?;
                let f = c.get("function");
                let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
                let name = name
                    .filter(|n| valid_name(n))
                    .ok_or_else(|| bad(&at("function.name"), "must be a function name"))?;
                let args = f.and_then(|f| f.get("arguments")).and_then(Value::as_str);
                let args: Value = args
                    .and_then(|a| serde_json::from_str(a).ok())
                    .filter(Value::is_object)
                    .ok_or_else(|| {
                        bad(
                            &at("function.arguments"),
                            "must be a JSON object, as a string",
                        )
                    })?;
                calls.insert(id.to_string(), name.to_string());
                written.push((name.to_string(), spaced(&args)));
            }
            return Ok(Message {
                calls: written,
                ..Message::new(&role, "")
            });
        }
        let content = match self.content {
            None => String::new(),
            Some(Content::Text(s)) => s,
            Some(Content::Parts(parts)) => {
                let mut s = String::new();
                for (j, p) in parts.into_iter().enumerate() {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => s.push_str(&t),
                        ("text", None) => {
                            return Err(bad(
                                &format!("messages[{i}].content[{j}].text"),
                                "is required for a text part",
                            ))
                        }
                        (kind, _) => {
                            return Err(bad(
                                &format!("messages[{i}].content[{j}].type"),
                                format!(
                                "must be \"text\": this server reads text only. Given: {kind:?}"
                            ),
                            ))
                        }
                    }
                }
                s
            }
        };
        if role == "tool" {
            let id = self.other.get("tool_call_id").and_then(Value::as_str);
            let name = id.and_then(|id| calls.get(id)).ok_or_else(|| {
                bad(
                    &format!("messages[{i}].tool_call_id"),
                    "must name a call of an earlier assistant message",
                )
            })?;
            return Ok(Tools::result_message(name, &content));
        }
        Ok(Message::new(&role, &content))
    }
}

impl CompletionRequest {
    /// Checks the request; the prompt comes back apart (it is tokenized raw, not through the
    /// chat template). The prompt's length is checked as one message's.
    pub fn validate(
        self,
        id: String,
        limits: &Limits,
        defaults: &SamplingParams,
    ) -> Result<(ValidApi, RawPrompt), RequestError> {
        if self.echo.unwrap_or(false) {
            return Err(bad("echo", "is not supported by this server"));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(bad("suffix", "is not supported by this server"));
        }
        let n = self.common.n.unwrap_or(1);
        if self.best_of.is_some_and(|b| b != n) {
            return Err(bad(
                "best_of",
                "is not supported by this server (it may only equal `n`)",
            ));
        }
        let prompt = match self.prompt {
            None => return Err(bad("prompt", "is required")),
            Some(PromptField::Text(s)) => RawPrompt::Text(s),
            Some(PromptField::Ids(v)) => RawPrompt::Ids(v),
            Some(PromptField::Texts(mut v)) if v.len() == 1 => RawPrompt::Text(v.remove(0)),
            Some(PromptField::IdLists(mut v)) if v.len() == 1 => RawPrompt::Ids(v.remove(0)),
            Some(PromptField::Texts(v)) => return Err(several(v.len())),
            Some(PromptField::IdLists(v)) => return Err(several(v.len())),
        };
        let chars = match &prompt {
            RawPrompt::Text(s) => s.chars().count(),
            RawPrompt::Ids(v) => v.len(),
        };
        if chars == 0 {
            return Err(bad("prompt", "must not be empty"));
        }
        if chars > limits.max_message_chars {
            return Err(bad(
                "prompt",
                format!(
                    "must be at most {} characters (limits.max_message_chars). Given: {chars}",
                    limits.max_message_chars
                ),
            ));
        }
        let logprobs = non_negative("logprobs", self.logprobs)?;
        check_alternatives("logprobs", logprobs)?;
        // The prompt stands in as one user message for the shared checks.
        let stand_in = vec![Message::new("user", "")];
        let v = self.common.validate(
            id,
            stand_in,
            self.common.max_tokens,
            logprobs,
            None,
            limits,
            defaults,
            COMPLETIONS_DEFAULT_MAX_TOKENS,
        )?;
        Ok((v, prompt))
    }
}

/// Alternatives per token: at most `MAX_TOP_LOGPROBS`.
fn check_alternatives(param: &str, k: Option<usize>) -> Result<(), RequestError> {
    match k {
        Some(k) if k > MAX_TOP_LOGPROBS => Err(bad(
            param,
            format!("must be between 0 and {MAX_TOP_LOGPROBS}. Given: {k}"),
        )),
        _ => Ok(()),
    }
}

fn several(n: usize) -> RequestError {
    bad(
        "prompt",
        format!("holds {n} prompts; this server takes one prompt per request"),
    )
}

// ---- responses ----

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct ApiUsage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
    pub completion_tokens_details: CompletionTokensDetails,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

/// OpenAI's breakdown of the completion's tokens. Its prediction counts (OpenAI's Predicted
/// Outputs) count this server's speculative drafts: those kept, and those run and rejected.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct CompletionTokensDetails {
    pub reasoning_tokens: usize,
    pub accepted_prediction_tokens: usize,
    pub rejected_prediction_tokens: usize,
}

/// One token's entry in a chat choice's `logprobs.content`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// A completion choice's `logprobs` (the legacy shape).
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<Map<String, Value>>,
    pub text_offset: Vec<usize>,
}

/// OpenAI's error body.
pub fn error_body(
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> serde_json::Value {
    serde_json::json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::request::Dialect;

    fn limits() -> Limits {
        Limits::for_tests()
    }

    fn chat(body: Value) -> Result<ValidApi, RequestError> {
        let r: ChatRequest = serde_json::from_value(body).unwrap();
        r.validate(
            "chatcmpl-1".into(),
            &limits(),
            &SamplingParams::default(),
            64,
            None,
        )
    }

    fn err(body: Value) -> (String, String) {
        match chat(body).unwrap_err() {
            RequestError::InvalidParam { field, reason } => (field.name(Dialect::OpenAi), reason),
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn chat_requests_validate_into_the_websocket_request() {
        let v = chat(serde_json::json!({
            "model": "m", "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}
            ],
            "max_completion_tokens": 9, "max_tokens": 99, "stop": "x", "n": 3, "seed": -1,
            "logprobs": true, "top_logprobs": 2, "stream": true,
            "stream_options": {"include_usage": true}, "store": false, "metadata": {"a": "b"},
            "response_format": {"type": "text"}, "tools": [], "tool_choice": "none"
        }))
        .unwrap();
        assert_eq!(v.chat.messages[0], Message::new("system", "be brief"));
        assert_eq!(v.chat.messages[1].content, "hi there");
        assert_eq!(v.chat.max_tokens, 9);
        assert_eq!(v.chat.stop, vec!["x".to_string()]);
        assert_eq!(v.chat.sampling.seed, Some(u64::MAX));
        assert_eq!(
            (v.n, v.logprobs, v.stream, v.include_usage),
            (3, Some(2), true, true)
        );
    }

    #[test]
    fn refusals_name_the_openai_field() {
        let m = serde_json::json!([{"role": "user", "content": "hi"}]);
        let cases = [
            (
                serde_json::json!({"messages": m, "tools": [{"type": "function"}]}),
                "tools[0].function",
            ),
            (
                serde_json::json!({"messages": m, "functions": [{"name": "f"}]}),
                "functions",
            ),
            (
                serde_json::json!({"messages": m, "response_format": {"type": "yaml"}}),
                "response_format",
            ),
            (serde_json::json!({"messages": m, "n": 9}), "n"),
            (
                serde_json::json!({"messages": m, "logprobs": true, "top_logprobs": 21}),
                "top_logprobs",
            ),
            (
                serde_json::json!({"messages": m, "top_logprobs": 2}),
                "top_logprobs",
            ),
            (
                serde_json::json!({"messages": m, "max_tokens": 9000}),
                "max_tokens",
            ),
            (
                serde_json::json!({"messages": m, "max_tokens": 0}),
                "max_tokens",
            ),
            (
                serde_json::json!({"messages": m, "temperature": 3}),
                "temperature",
            ),
            (
                serde_json::json!({"messages": m, "stop": ["a", "b", "c", "d", "e"]}),
                "stop",
            ),
            (
                serde_json::json!({"messages": m, "stream_options": {"include_usage": true}}),
                "stream_options",
            ),
            (
                serde_json::json!({"messages": m, "logit_bias": {"1": 5}}),
                "logit_bias",
            ),
            (
                serde_json::json!({"messages": m, "modalities": ["text", "audio"]}),
                "modalities",
            ),
            (
                serde_json::json!({"messages": [{"role": "tool", "content": "x"}]}),
                "messages[0].tool_call_id",
            ),
            (
                serde_json::json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                "messages[0].content[0].type",
            ),
            (
                serde_json::json!({"messages": [{"role": "user", "content": "x".repeat(101)}]}),
                "messages[0].content",
            ),
            (
                serde_json::json!({"messages": m, "prompt_cache_key": "k".repeat(65)}),
                "prompt_cache_key",
            ),
        ];
        for (body, want) in cases {
            let (param, reason) = err(body.clone());
            assert_eq!(param, want, "{body}: {reason}");
        }
    }

    #[test]
    fn completions_take_one_prompt() {
        let v = |b: Value| {
            let r: CompletionRequest = serde_json::from_value(b).unwrap();
            r.validate("cmpl-1".into(), &limits(), &SamplingParams::default())
        };
        let (ok, p) =
            v(serde_json::json!({"model": "m", "prompt": ["Once"], "logprobs": 3})).unwrap();
        assert_eq!(p, RawPrompt::Text("Once".into()));
        assert_eq!(
            (ok.chat.max_tokens, ok.logprobs),
            (COMPLETIONS_DEFAULT_MAX_TOKENS, Some(3))
        );
        let (_, p) = v(serde_json::json!({"prompt": [1, 2, 3]})).unwrap();
        assert_eq!(p, RawPrompt::Ids(vec![1, 2, 3]));
        for (body, want) in [
            (serde_json::json!({"prompt": ["a", "b"]}), "prompt"),
            (serde_json::json!({"prompt": ""}), "prompt"),
            (serde_json::json!({}), "prompt"),
            (serde_json::json!({"prompt": "a", "echo": true}), "echo"),
            (serde_json::json!({"prompt": "a", "best_of": 3}), "best_of"),
            (
                serde_json::json!({"prompt": "a", "logprobs": 21}),
                "logprobs",
            ),
        ] {
            match v(body.clone()).unwrap_err() {
                RequestError::InvalidParam { field, .. } => {
                    assert_eq!(field.name(Dialect::OpenAi), want, "{body}")
                }
                e => panic!("{body}: {e:?}"),
            }
        }
    }
}
