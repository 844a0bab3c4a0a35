//! A request's prompt and cache partition from who sent it: the roles its identity may send, the
//! operator's text first (a widget's system prompt or a tenant's named prefix), the chat
//! template, and how many leading tokens are that operator text (shared within the tenant; the
//! rest is the principal's). The WebSocket session and the OpenAI API both build prompts here.

use crate::server::gate::tenants::{Identity, Tenants};
use crate::server::request::tools::{lower, Tools};
use crate::server::request::Prompt;
use crate::server::request::{Field, RequestError, ValidRequest};
use crate::server::state::Ready;
use crate::tokenizer::Message;

/// Checks that `identity` may send the roles of the request's messages, renders operator text,
/// `history` and the request's messages with the chat template (generation prompt added, the
/// request's functions described: `tools::lower`), derives the cache scope and compiles the
/// response format's grammar:
/// `principal` names the principal for clients without an API key (a session's id, or a fresh
/// id per HTTP request); the request's `cache_key` is a partition inside an API key's principal.
pub fn chat_prompt(
    ready: &Ready,
    tenants: &Tenants,
    identity: &Identity,
    principal: &uuid::Uuid,
    history: &[Message],
    chat: &ValidRequest,
) -> Result<Prompt, RequestError> {
    let mut prompt = build(
        ready,
        tenants,
        identity,
        principal,
        history,
        &chat.messages,
        chat.cache_key.as_deref(),
        chat.described.as_deref(),
        false,
    )?;
    // Compiled within the request's principal: a grammar cached for another is never found.
    prompt.constraint = (ready.grammars)
        .compile(&chat.format, prompt.scope.principal.0)
        .map_err(|e| RequestError::invalid(Field::ResponseFormat, e))?;
    Ok(prompt)
}

/// The prompt of a draft: `history` and a user message holding `text` so far, rendered up to
/// the end of that text (what the template adds after a message is left out, and the text's
/// last token too: the next characters typed may join it).
pub fn draft_prompt(
    ready: &Ready,
    tenants: &Tenants,
    identity: &Identity,
    principal: &uuid::Uuid,
    history: &[Message],
    text: &str,
) -> Result<Prompt, RequestError> {
    let new = [Message::new("user", text)];
    build(
        ready, tenants, identity, principal, history, &new, None, None, true,
    )
}

#[allow(clippy::too_many_arguments)]
fn build(
    ready: &Ready,
    tenants: &Tenants,
    identity: &Identity,
    principal: &uuid::Uuid,
    history: &[Message],
    new: &[Message],
    cache_key: Option<&str>,
    described: Option<&Tools>,
    open: bool,
) -> Result<Prompt, RequestError> {
    // Functions' descriptions are written where a system prompt is (the system turn, or the
    // template's place for tools): only a client that may send system text may declare them.
    if described.is_some_and(|t| !t.tools.is_empty()) && !identity.roles.allows("system") {
        return Err(RequestError::invalid(
            Field::Wire("tools".into()),
            format!(
                "declares functions, whose descriptions are system text: this client may send only {} messages",
                identity.roles.names()
            ),
        ));
    }
    for (i, m) in new.iter().enumerate() {
        // A function's result is the client's turn, as a user message is.
        let role = if m.role == "tool" { "user" } else { &m.role };
        identity.roles.check(i, role)?;
    }
    let mut all = Vec::with_capacity(history.len() + new.len() + 2);
    if let Some(sys) = &identity.system_prompt {
        all.push(Message::new("system", sys));
    }
    let lead = all.len();
    all.extend(history.iter().cloned());
    all.extend(new.iter().cloned());
    let tools = lower(&mut all, lead, described);
    // What cannot fit is refused by its length, before the work of rendering and tokenizing.
    let tok = &ready.tokenizer;
    let least: Option<usize> = (all.iter())
        .map(|m| tok.min_content_tokens(&m.content))
        .sum();
    if let Some(least) = least.filter(|&n| n >= ready.max_context) {
        return Err(RequestError::PromptTooLong(format!(
            "the conversation is at least {least} tokens by its length alone; the context holds {} (prompt plus at least one generated token)",
            ready.max_context
        )));
    }
    let ids = if open {
        let mut ids = (ready.tokenizer.encode_chat_open(&all))
            .map_err(|e| RequestError::InvalidRequest(e.to_string()))?;
        ids.pop();
        ids
    } else {
        ready
            .tokenizer
            .encode_chat_with(&all, tools.as_ref(), true)
            .map_err(|e| RequestError::InvalidRequest(e.to_string()))?
            .1
    };
    let shared = shared_tokens(ready, identity, &ids);
    let scope = tenants.scope(identity, principal, cache_key, shared);
    Ok(Prompt {
        ids,
        scope,
        constraint: None,
    })
}

/// The leading prompt tokens that are operator text: those equal to the operator prompt rendered
/// alone.
fn shared_tokens(ready: &Ready, identity: &Identity, prompt: &[u32]) -> usize {
    let Some(op) = (identity.system_prompt.as_ref()).and_then(|sys| ready.operator_tokens.get(sys))
    else {
        return 0;
    };
    op.iter().zip(prompt).take_while(|(a, b)| a == b).count()
}
