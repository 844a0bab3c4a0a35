//! The native dialect's dispatch: a client frame, read against what the session holds (`View`),
//! becomes what the session does (`Action`) or the refusal it sends (`Refused`). Pure, as the
//! Realtime dialect's `Realtime::handle`: no actor, no socket, no model, so it is unit-tested
//! below and fuzzed (`fuzz_harness::native`) exactly as a connection runs it; the session actor
//! (`session/frames.rs`) only carries the action out. The rules here are the protocol's
//! (docs/protocol.md): which reply a `cancel` or an `ack` names and its delta indices, what
//! `regenerate` and `edit` replace, when `restore` and `reset` may come, where a `draft` waits.
//! A turn's messages and parameters are validated by the request seam when the session starts
//! it (`Limits::validate`, the same call for the Realtime dialect's turns).

use crate::server::gate::tenants::Roles;
use crate::server::request::{Field, GenerateParams, Limits, RequestError};
use crate::server::ws::protocol::{validate_restore, ClientFrame};
use crate::tokenizer::Message;

/// What the session holds when a frame arrives.
pub struct View<'a> {
    pub limits: &'a Limits,
    /// Roles this client may send.
    pub roles: Roles,
    /// Whether a seal was given for this assistant text to this client (`ws::seal`).
    pub seal_verifies: &'a dyn Fn(&str, &str) -> bool,
    pub conversation: &'a [Message],
    /// The reply in flight.
    pub running: Option<Running<'a>>,
    /// The id of the last reply that ended (an `ack` in flight for it is no error).
    pub last_reply: Option<&'a str>,
    /// A turn whose prompt is being built, not yet submitted.
    pub preparing: bool,
    /// The call a reply waits on (`running` names that reply meanwhile): its `call_id`.
    pub tool_call: Option<&'a str>,
    /// User turns the overflow policy dropped before `conversation`'s first.
    pub dropped_turns: usize,
}

/// The reply in flight, as the dispatch needs it.
#[derive(Debug, Clone, Copy)]
pub struct Running<'a> {
    pub id: &'a str,
    /// Deltas sent so far (indices `0..deltas`).
    pub deltas: usize,
    /// A paced reply (`params.window`): it takes `ack`s.
    pub paced: bool,
}

/// What the session does for a frame.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Carry on the session `token` names (the first frame of a connection).
    Resume {
        token: String,
        id: Option<String>,
        after_index: Option<usize>,
    },
    /// Prefill the user's next message so far now (nothing runs or is being prepared)...
    Draft(String),
    /// ...or once the reply in flight ends (the latest draft only).
    DraftLater(String),
    /// The paced reply's client has shown its deltas through this index.
    Ack(usize),
    /// Start a turn: its reply replaces the conversation from `replace_from` on with `messages`
    /// and the reply. `ends_draft`: the user sent what they were typing (a `chat`).
    Turn {
        id: String,
        messages: Vec<Message>,
        params: Box<GenerateParams>,
        replace_from: usize,
        ends_draft: bool,
    },
    /// Cancel the reply in flight; with `heard`, the conversation keeps its deltas through it.
    Cancel { heard: Option<usize> },
    /// Take this transcript as the conversation (checked: limits, roles, seals).
    Restore(Vec<Message>),
    /// The waiting call's result (its content as text): the reply goes on from it.
    ToolResult(String),
    /// Forget the conversation and its KV lease.
    Reset,
    /// Nothing to do (an `ack` for a reply that just ended).
    Nothing,
}

/// A frame refused: the error to send, with the request id it names.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    pub id: Option<String>,
    pub error: RequestError,
}

impl Refused {
    fn new(id: Option<&str>, error: RequestError) -> Self {
        Refused {
            id: id.map(String::from),
            error,
        }
    }
}

/// A text frame as a client frame.
pub fn parse(text: &str) -> Result<ClientFrame, RequestError> {
    serde_json::from_str(text)
        .map_err(|e| RequestError::InvalidRequest(format!("malformed frame: {e}")))
}

fn no_running_request(id: &str) -> Refused {
    Refused::new(
        Some(id),
        RequestError::InvalidRequest("`id` names no running request".into()),
    )
}

/// A delta index past the deltas sent.
fn past_the_deltas(field: &str, index: usize, id: &str, deltas: usize) -> Refused {
    let e = RequestError::invalid(
        Field::Wire(field.into()),
        format!("is {index}; {deltas} deltas of `{id}` were sent (indexes from 0)"),
    );
    Refused::new(Some(id), e)
}

/// One client frame against what the session holds.
pub fn handle(frame: ClientFrame, view: &View) -> Result<Action, Refused> {
    let running = view.running.as_ref();
    match frame {
        ClientFrame::Resume {
            token,
            id,
            after_index,
        } => Ok(Action::Resume {
            token,
            id,
            after_index,
        }),
        ClientFrame::Draft { text } => {
            (view.limits)
                .check_message_chars(Field::Wire("text".into()), &text)
                .map_err(|e| Refused::new(None, e))?;
            Ok(if running.is_some() || view.preparing {
                Action::DraftLater(text)
            } else {
                Action::Draft(text)
            })
        }
        ClientFrame::Ack { id, index } => match running {
            Some(r) if r.id == id && r.paced => {
                if index >= r.deltas {
                    return Err(past_the_deltas("index", index, &id, r.deltas));
                }
                Ok(Action::Ack(index))
            }
            Some(r) if r.id == id => Err(Refused::new(
                Some(&id),
                RequestError::InvalidRequest("`ack` is for paced replies (`params.window`)".into()),
            )),
            // A reply that just ended: an ack in flight is not an error.
            _ if view.last_reply == Some(id.as_str()) => Ok(Action::Nothing),
            _ => Err(no_running_request(&id)),
        },
        ClientFrame::Chat {
            id,
            messages,
            params,
        } => Ok(Action::Turn {
            id,
            messages,
            params: Box::new(params),
            replace_from: view.conversation.len(),
            ends_draft: true,
        }),
        ClientFrame::Cancel { id, heard_index } => match running {
            Some(r) if r.id == id => {
                if let Some(h) = heard_index.filter(|&h| h >= r.deltas) {
                    return Err(past_the_deltas("heard_index", h, &id, r.deltas));
                }
                Ok(Action::Cancel { heard: heard_index })
            }
            _ => Err(no_running_request(&id)),
        },
        ClientFrame::Regenerate { id, params } => {
            let conversation = view.conversation;
            let Some(last) = conversation.iter().rposition(|m| m.role == "assistant") else {
                let e = RequestError::InvalidRequest("there is no reply to regenerate".into());
                return Err(Refused::new(Some(&id), e));
            };
            // The turn that reply answered: the messages since the reply before it.
            let start = conversation[..last]
                .iter()
                .rposition(|m| m.role == "assistant")
                .map_or(0, |i| i + 1);
            Ok(Action::Turn {
                id,
                messages: conversation[start..last].to_vec(),
                params: Box::new(params),
                replace_from: start,
                ends_draft: false,
            })
        }
        ClientFrame::Edit {
            id,
            turn,
            messages,
            params,
        } => {
            // Turns count from the session's first; those the overflow policy dropped are gone.
            let first = view.dropped_turns;
            if turn < first {
                let e = RequestError::invalid(
                    Field::Wire("turn".into()),
                    format!("is {turn}; turns before {first} were dropped when the conversation outgrew the context (limits.overflow)"),
                );
                return Err(Refused::new(Some(&id), e));
            }
            let mut users =
                (view.conversation.iter().enumerate()).filter(|(_, m)| m.role == "user");
            let Some((at, _)) = users.nth(turn - first) else {
                let n = first
                    + (view.conversation.iter())
                        .filter(|m| m.role == "user")
                        .count();
                let e = RequestError::invalid(
                    Field::Wire("turn".into()),
                    format!("is {turn}; the conversation has {n} user turns (numbered from 0)"),
                );
                return Err(Refused::new(Some(&id), e));
            };
            Ok(Action::Turn {
                id,
                messages,
                params: Box::new(params),
                replace_from: at,
                ends_draft: false,
            })
        }
        ClientFrame::ToolResult { call_id, content } => {
            if view.tool_call != Some(call_id.as_str()) {
                let e = RequestError::invalid(
                    Field::Wire("call_id".into()),
                    match view.tool_call {
                        Some(c) => format!("is {call_id:?}; the call waiting is {c:?}"),
                        None => format!("is {call_id:?}; no call is waiting for a result"),
                    },
                );
                return Err(Refused::new(running.map(|r| r.id), e));
            }
            let content = match content {
                serde_json::Value::String(s) => s,
                other => other.to_string(),
            };
            (view.limits)
                .check_message_chars(Field::Wire("content".into()), &content)
                .map_err(|e| Refused::new(running.map(|r| r.id), e))?;
            Ok(Action::ToolResult(content))
        }
        ClientFrame::Restore { messages } => restore(messages, view).map(Action::Restore),
        ClientFrame::Reset => match running {
            Some(r) => Err(Refused::new(None, RequestError::Busy(r.id.into()))),
            None => Ok(Action::Reset),
        },
    }
}

/// `restore`: a session with no conversation yet takes the transcript its client kept. An
/// assistant message from a client that may not send assistant messages needs the seal its
/// `done` gave (for this client: same tenant, kind and operator text); any other role the
/// client may not send is refused as in a `chat`.
fn restore(
    messages: Vec<crate::server::ws::protocol::RestoredMessage>,
    view: &View,
) -> Result<Vec<Message>, Refused> {
    let refuse = |e| Refused::new(None, e);
    let messages = validate_restore(view.limits, messages).map_err(refuse)?;
    if let Some(r) = &view.running {
        return Err(refuse(RequestError::Busy(r.id.into())));
    }
    if !view.conversation.is_empty() || view.preparing {
        return Err(refuse(RequestError::InvalidRequest(
            "`restore` starts a conversation: send it before the first chat (or after `reset`)"
                .into(),
        )));
    }
    for (i, m) in messages.iter().enumerate() {
        if view.roles.allows(&m.role) {
            continue;
        }
        if m.role == "assistant" {
            let sealed = (m.seal.as_deref()).is_some_and(|s| (view.seal_verifies)(&m.content, s));
            if !sealed {
                return Err(refuse(RequestError::invalid(
                    Field::Seal(i),
                    "an assistant message from this client needs the seal its `done` gave, for this very text",
                )));
            }
        } else {
            view.roles.check(i, &m.role).map_err(refuse)?;
        }
    }
    Ok((messages.iter())
        .map(|m| Message::new(&m.role, &m.content))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(role: &str, content: &str) -> Message {
        Message::new(role, content)
    }

    /// A conversation of two turns: user, assistant, user, assistant.
    fn two_turns() -> Vec<Message> {
        vec![
            m("user", "a"),
            m("assistant", "b"),
            m("user", "c"),
            m("assistant", "d"),
        ]
    }

    struct Session {
        limits: Limits,
        roles: Roles,
        conversation: Vec<Message>,
        running: Option<(String, usize, bool)>,
        last_reply: Option<String>,
        preparing: bool,
        tool_call: Option<String>,
        dropped_turns: usize,
    }

    impl Session {
        fn new() -> Self {
            Session {
                limits: Limits::for_tests(),
                roles: Roles::ALL,
                conversation: Vec::new(),
                running: None,
                last_reply: None,
                preparing: false,
                tool_call: None,
                dropped_turns: 0,
            }
        }

        fn widget(mut self) -> Self {
            self.roles = Roles::parse(&["user".into()]).unwrap();
            self
        }

        fn handle(&self, frame: &str) -> Result<Action, Refused> {
            let verifies = |content: &str, seal: &str| seal == format!("{:064x}", content.len());
            let view = View {
                limits: &self.limits,
                roles: self.roles,
                seal_verifies: &verifies,
                conversation: &self.conversation,
                running: (self.running.as_ref()).map(|(id, deltas, paced)| Running {
                    id,
                    deltas: *deltas,
                    paced: *paced,
                }),
                last_reply: self.last_reply.as_deref(),
                preparing: self.preparing,
                tool_call: self.tool_call.as_deref(),
                dropped_turns: self.dropped_turns,
            };
            handle(parse(frame).map_err(|e| Refused::new(None, e))?, &view)
        }
    }

    fn refused(r: Result<Action, Refused>) -> (Option<String>, String) {
        let e = r.expect_err("refused");
        (e.id, e.error.to_string())
    }

    #[test]
    fn a_tool_result_answers_only_the_call_waiting_within_the_message_limit() {
        let mut s = Session::new();
        let frame = |c: &str, content: &str| {
            format!(r#"{{"type":"tool_result","call_id":"{c}","content":{content}}}"#)
        };
        let (_, msg) = refused(s.handle(&frame("call_1", r#""ok""#)));
        assert!(
            msg.contains("`call_id`") && msg.contains("no call is waiting"),
            "{msg}"
        );
        s.running = Some(("q1".into(), 0, false));
        s.tool_call = Some("call_1".into());
        let (id, msg) = refused(s.handle(&frame("call_2", r#""ok""#)));
        assert_eq!(id.as_deref(), Some("q1"));
        assert!(msg.contains("\"call_1\""), "{msg}");
        assert_eq!(
            s.handle(&frame("call_1", r#""shipped""#)).unwrap(),
            Action::ToolResult("shipped".into())
        );
        // Any JSON is read as its text.
        assert_eq!(
            s.handle(&frame("call_1", r#"{"eta":"Friday"}"#)).unwrap(),
            Action::ToolResult(r#"{"eta":"Friday"}"#.into())
        );
        let long = format!("\"{}\"", "x".repeat(101));
        let (_, msg) = refused(s.handle(&frame("call_1", &long)));
        assert!(msg.contains("`content`"), "{msg}");
        // The waiting reply is the one a cancel names, and it makes a chat wait its turn.
        assert_eq!(
            s.handle(r#"{"type":"cancel","id":"q1"}"#).unwrap(),
            Action::Cancel { heard: None }
        );
    }

    #[test]
    fn a_malformed_frame_is_refused_without_an_id() {
        let s = Session::new();
        let (id, msg) = refused(s.handle(r#"{"type":"chat","id":"x"}"#));
        assert_eq!(id, None);
        assert!(msg.contains("malformed frame"), "{msg}");
    }

    #[test]
    fn a_chat_appends_a_turn_and_ends_the_draft() {
        let mut s = Session::new();
        s.conversation = two_turns();
        let a = s.handle(r#"{"type":"chat","id":"t","messages":[{"role":"user","content":"e"}]}"#);
        assert_eq!(
            a.unwrap(),
            Action::Turn {
                id: "t".into(),
                messages: vec![m("user", "e")],
                params: Box::default(),
                replace_from: 4,
                ends_draft: true,
            }
        );
    }

    #[test]
    fn regenerate_replaces_the_last_reply_with_the_turn_it_answered() {
        let mut s = Session::new();
        s.conversation = two_turns();
        match s.handle(r#"{"type":"regenerate","id":"r"}"#).unwrap() {
            Action::Turn {
                messages,
                replace_from,
                ends_draft,
                ..
            } => {
                assert_eq!(messages, vec![m("user", "c")]);
                assert_eq!((replace_from, ends_draft), (2, false));
            }
            a => panic!("{a:?}"),
        }
        s.conversation.clear();
        let (id, msg) = refused(s.handle(r#"{"type":"regenerate","id":"r"}"#));
        assert_eq!(id.as_deref(), Some("r"));
        assert!(msg.contains("no reply to regenerate"), "{msg}");
    }

    /// An `edit` frame replacing user turn `turn` with "z".
    fn edit(turn: usize) -> String {
        format!(
            r#"{{"type":"edit","id":"e","turn":{turn},"messages":[{{"role":"user","content":"z"}}]}}"#
        )
    }

    #[test]
    fn edit_numbers_turns_from_the_first_even_after_the_oldest_were_dropped() {
        let mut s = Session::new();
        // Turns 0-2 were dropped: the conversation holds turns 3 and 4.
        s.conversation = two_turns();
        s.dropped_turns = 3;
        match s.handle(&edit(4)).unwrap() {
            Action::Turn { replace_from, .. } => assert_eq!(replace_from, 2),
            other => panic!("{other:?}"),
        }
        match s.handle(&edit(3)).unwrap() {
            Action::Turn { replace_from, .. } => assert_eq!(replace_from, 0),
            other => panic!("{other:?}"),
        }
        let (_, msg) = refused(s.handle(&edit(2)));
        assert!(msg.contains("`turn`") && msg.contains("dropped"), "{msg}");
        let (_, msg) = refused(s.handle(&edit(5)));
        assert!(msg.contains("has 5 user turns"), "{msg}");
    }

    #[test]
    fn edit_cuts_at_the_user_turn_it_names() {
        let mut s = Session::new();
        s.conversation = two_turns();
        match s.handle(&edit(1)).unwrap() {
            Action::Turn { replace_from, .. } => assert_eq!(replace_from, 2),
            a => panic!("{a:?}"),
        }
        match s.handle(&edit(0)).unwrap() {
            Action::Turn { replace_from, .. } => assert_eq!(replace_from, 0),
            a => panic!("{a:?}"),
        }
        let (_, msg) = refused(s.handle(&edit(2)));
        assert!(
            msg.contains("`turn`") && msg.contains("has 2 user turns"),
            "{msg}"
        );
    }

    #[test]
    fn cancel_and_ack_name_the_running_reply_and_a_delta_it_sent() {
        let mut s = Session::new();
        s.running = Some(("r".into(), 3, true));
        assert_eq!(
            s.handle(r#"{"type":"cancel","id":"r","heard_index":2}"#),
            Ok(Action::Cancel { heard: Some(2) })
        );
        let (id, msg) = refused(s.handle(r#"{"type":"cancel","id":"r","heard_index":3}"#));
        assert_eq!(id.as_deref(), Some("r"));
        assert!(
            msg.contains("heard_index") && msg.contains("is 3; 3 deltas"),
            "{msg}"
        );
        let (_, msg) = refused(s.handle(r#"{"type":"cancel","id":"other"}"#));
        assert!(msg.contains("names no running request"), "{msg}");
        assert_eq!(
            s.handle(r#"{"type":"ack","id":"r","index":1}"#),
            Ok(Action::Ack(1))
        );
        let (_, msg) = refused(s.handle(r#"{"type":"ack","id":"r","index":5}"#));
        assert!(msg.contains("`index`") && msg.contains("is 5"), "{msg}");
        // Not paced: an ack is refused; a reply that just ended: an ack in flight is nothing.
        s.running = Some(("r".into(), 3, false));
        let (_, msg) = refused(s.handle(r#"{"type":"ack","id":"r","index":1}"#));
        assert!(msg.contains("paced replies"), "{msg}");
        s.running = None;
        s.last_reply = Some("r".into());
        assert_eq!(
            s.handle(r#"{"type":"ack","id":"r","index":9}"#),
            Ok(Action::Nothing)
        );
    }

    #[test]
    fn a_draft_waits_for_the_reply_in_flight() {
        let mut s = Session::new();
        assert_eq!(
            s.handle(r#"{"type":"draft","text":"hel"}"#),
            Ok(Action::Draft("hel".into()))
        );
        s.preparing = true;
        assert_eq!(
            s.handle(r#"{"type":"draft","text":"hell"}"#),
            Ok(Action::DraftLater("hell".into()))
        );
        let long = "x".repeat(s.limits.max_message_chars + 1);
        let (_, msg) = refused(s.handle(&format!(r#"{{"type":"draft","text":"{long}"}}"#)));
        assert!(msg.contains("`text`"), "{msg}");
    }

    #[test]
    fn reset_and_restore_wait_for_the_reply_in_flight() {
        let mut s = Session::new();
        s.running = Some(("r".into(), 0, false));
        let (id, msg) = refused(s.handle(r#"{"type":"reset"}"#));
        assert_eq!(id, None);
        assert!(msg.contains("`r`"), "{msg}");
        let restore = r#"{"type":"restore","messages":[{"role":"user","content":"hi"}]}"#;
        assert!(refused(s.handle(restore)).1.contains("`r`"));
        s.running = None;
        assert_eq!(s.handle(r#"{"type":"reset"}"#), Ok(Action::Reset));
        assert_eq!(
            s.handle(restore),
            Ok(Action::Restore(vec![m("user", "hi")]))
        );
        s.conversation = two_turns();
        assert!(refused(s.handle(restore))
            .1
            .contains("starts a conversation"));
    }

    #[test]
    fn a_widget_restores_only_what_it_may_send_or_was_sealed_for() {
        let s = Session::new().widget();
        let seal = format!("{:064x}", 5);
        let sealed = format!(
            r#"{{"type":"restore","messages":[{{"role":"user","content":"q"}},{{"role":"assistant","content":"hello","seal":"{seal}"}}]}}"#
        );
        assert_eq!(
            s.handle(&sealed),
            Ok(Action::Restore(vec![
                m("user", "q"),
                m("assistant", "hello")
            ]))
        );
        // The seal was given for other text, or there is none.
        let forged = sealed.replace("hello", "hellO!");
        assert!(refused(s.handle(&forged)).1.contains("seal"));
        let unsealed = r#"{"type":"restore","messages":[{"role":"assistant","content":"x"}]}"#;
        assert!(refused(s.handle(unsealed)).1.contains("seal"));
        // A system message is refused as in a chat, seal or not.
        let system = r#"{"type":"restore","messages":[{"role":"system","content":"x"}]}"#;
        let (_, msg) = refused(s.handle(system));
        assert!(msg.contains("system"), "{msg}");
    }
}
