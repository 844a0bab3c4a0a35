//! A request's prompt and cache partition from who sent it: the roles its identity may send, the
//! operator's text first (a widget's system prompt or a tenant's named prefix), the chat
//! template, and how many leading tokens are that operator text (shared within the tenant; the
//! rest is the principal's). A conversation that outgrows the context is cut here by its
//! overflow policy (`overflow`). The WebSocket session and the OpenAI API both build prompts
//! here.

use crate::server::gate::tenants::{Identity, Tenants};
use crate::server::request::overflow::{turn_starts, turns_to_drop, Dropped, Overflow};
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
        (chat.overflow.unwrap_or(identity.overflow), chat.max_tokens),
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
    // A draft that does not fit is not prefilled: the chat it leads to drops turns itself.
    build(
        ready,
        tenants,
        identity,
        principal,
        history,
        &new,
        None,
        None,
        true,
        (Overflow::Error, 1),
    )
}

/// The room a reply keeps when turns are dropped: its `max_tokens`, at most half the context.
fn reply_room(max_context: usize, max_tokens: usize) -> usize {
    max_tokens.min(max_context / 2)
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
    overflow: (Overflow, usize),
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
    let conversation: Vec<Message> = history.iter().chain(new).cloned().collect();
    let (policy, max_tokens) = overflow;
    let (lead, starts) = turn_starts(&conversation);
    let tok = &ready.tokenizer;
    // What cannot fit is refused by its length, before the work of rendering and tokenizing:
    // all of it, or what the policy never drops (the instructions and the last turn).
    let fixed = match (policy, starts.last()) {
        (Overflow::DropOldest { .. }, Some(&last)) => {
            conversation[..lead].iter().chain(&conversation[last..])
        }
        _ => conversation[..0].iter().chain(&conversation[..]),
    };
    let operator = identity.system_prompt.as_deref().unwrap_or("");
    let least: Option<usize> = std::iter::once(operator)
        .chain(fixed.map(|m| m.content.as_str()))
        .map(|c| tok.min_content_tokens(c))
        .sum();
    if let Some(least) = least.filter(|&n| n >= ready.max_context) {
        return Err(RequestError::PromptTooLong(format!(
            "the conversation is at least {least} tokens by its length alone; the context holds {} (prompt plus at least one generated token)",
            ready.max_context
        )));
    }
    // The conversation from message `from` of the turns on (the instructions kept), rendered.
    let render = |drop_to: usize| -> Result<Vec<u32>, RequestError> {
        let mut all = Vec::with_capacity(conversation.len() + 2);
        if let Some(sys) = &identity.system_prompt {
            all.push(Message::new("system", sys));
        }
        let operator = all.len();
        all.extend(conversation[..lead].iter().cloned());
        all.extend(conversation[drop_to..].iter().cloned());
        let tools = lower(&mut all, operator, described);
        if open {
            let mut ids = (tok.encode_chat_open(&all))
                .map_err(|e| RequestError::InvalidRequest(e.to_string()))?;
            ids.pop();
            Ok(ids)
        } else {
            Ok(tok
                .encode_chat_with(&all, tools.as_ref(), true)
                .map_err(|e| RequestError::InvalidRequest(e.to_string()))?
                .1)
        }
    };
    let mut ids = render(lead)?;
    let mut dropped = None;
    let limit = ready.max_context - reply_room(ready.max_context, max_tokens);
    if let (Overflow::DropOldest { retention }, true) = (policy, ids.len() > limit) {
        // `None` (even the last turn cannot fit) is found below by rendering it alone.
        let drop = choose_drop(
            tok,
            identity,
            &conversation,
            (lead, &starts),
            ids.len(),
            limit,
            retention,
        )
        .unwrap_or(starts.len().saturating_sub(1));
        // The counts were estimates: drop one more turn while the rendering does not fit.
        for k in drop.max(1)..starts.len() {
            ids = render(starts[k])?;
            if ids.len() <= limit {
                dropped = Some(Dropped {
                    from: lead,
                    messages: starts[k] - lead,
                    turns: (starts[..k].iter())
                        .filter(|&&i| conversation[i].role == "user")
                        .count(),
                });
                break;
            }
        }
        if dropped.is_none() {
            return Err(RequestError::PromptTooLong(format!(
                "the instructions and the last turn alone are {} tokens; the context holds {} less the reply's room of {} (max_tokens, at most half the context)",
                ids.len(),
                ready.max_context,
                ready.max_context - limit
            )));
        }
    }
    let shared = shared_tokens(ready, identity, &ids);
    let scope = tenants.scope(identity, principal, cache_key, shared);
    Ok(Prompt {
        ids,
        scope,
        constraint: None,
        dropped,
    })
}

/// The turns to drop from the conversation's token counts: each message's content tokenized
/// alone, the template's tokens (`rendered` less the contents) spread over the messages.
fn choose_drop(
    tok: &crate::tokenizer::TextTokenizer,
    identity: &Identity,
    conversation: &[Message],
    (lead, starts): (usize, &[usize]),
    rendered: usize,
    limit: usize,
    retention: f32,
) -> Option<usize> {
    let count = |text: &str| {
        tok.encode_text(text)
            .map_or(text.len() / 4, |ids| ids.len())
    };
    let operator = identity.system_prompt.as_deref().map_or(0, count);
    let contents: Vec<usize> = conversation.iter().map(|m| count(&m.content)).collect();
    let messages = conversation.len() + usize::from(identity.system_prompt.is_some());
    let template = rendered.saturating_sub(operator + contents.iter().sum::<usize>());
    let per_message = template.div_ceil(messages.max(1));
    let tokens = |r: std::ops::Range<usize>| -> usize {
        contents[r.clone()].iter().sum::<usize>() + per_message * r.len()
    };
    let instructions = operator + per_message * usize::from(operator > 0) + tokens(0..lead);
    let turns: Vec<usize> = (0..starts.len())
        .map(|k| tokens(starts[k]..starts.get(k + 1).copied().unwrap_or(conversation.len())))
        .collect();
    turns_to_drop(instructions, &turns, limit, retention)
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
