//! Function tools, as every dialect shares them (chat completions, Realtime, and the functions an
//! operator declares for a widget or a named prefix): each dialect's shape read by one parser
//! (`Tools::parse`), the validated declarations and choice (`Tools`), how a call is written
//! (`CallSyntax`), the grammar that makes every call valid (a Lark grammar over llguidance's
//! `%json`, so the arguments follow the function's JSON Schema), how a conversation holding
//! calls and results is given to the template (`lower`), and `CallParser`, which turns the
//! reply's text, as it streams, into calls (name first, then argument fragments).
//!
//! Two formats. A model whose chat template takes `tools` (Llama 3.1 and later) is given them
//! through its template, and calls as the template writes them (probed at load:
//! `ChatTemplate::call_syntax`, for Llama 3.1 `{"name": "f", "parameters": {...}}`, one call a
//! message), results as `tool` messages. Any other model (the default SmolLM2) gets the generic
//! format: the functions described in the system turn, each call a JSON object
//! `{"name": ..., "arguments": {...}}` on its own line, results as user turns. Operators'
//! widget and prefix functions always use the generic format, since their description is the
//! operator's pinned text, shared by every visitor.
//!
//! Written here because the format is the gateway's contract: llguidance constrains, but which
//! text is a call and how it streams as OpenAI's `tool_calls` deltas is ours. With `auto` the
//! grammar lets the reply be either text that does not start as a call does or calls (the
//! pattern of llguidance's own tool-calling example), so a plain answer stays free.

use std::sync::Arc;

use serde_json::{json, Value};

use crate::engine::constraint::ResponseFormat;
use crate::server::request::{Field, RequestError, ValidRequest};
use crate::tokenizer::{CallSyntax, Message};

/// Most functions one request may declare.
pub const MAX_TOOLS: usize = 64;

/// Longest function name (OpenAI's limit), of `a-z A-Z 0-9 _ -`.
pub const MAX_TOOL_NAME_CHARS: usize = 64;

/// A declared function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tool {
    pub name: String,
    pub description: String,
    /// A JSON Schema of the arguments object.
    pub parameters: Value,
}

/// Whether and which function the model must call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Never: the functions are not offered.
    None,
    /// Text or calls, as the model chooses.
    Auto,
    /// At least one call.
    Required,
    /// One call of this function.
    Named(String),
}

/// The functions of a request and how they may be called.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tools {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// Several calls in one reply (one per line), but for a named function (one call).
    pub parallel: bool,
    /// How a call is written: the generic format, or the model's template's (`native`).
    pub syntax: CallSyntax,
    /// The functions go to the template (`syntax` is its own), not into the system turn.
    pub native: bool,
}

/// The generic call format: `{"name": "f", "arguments": {...}}`, one call a line.
pub fn generic_syntax() -> CallSyntax {
    CallSyntax {
        prefix: "{\"name\": \"".into(),
        middle: "\", \"arguments\": ".into(),
        suffix: "}".into(),
        separator: Some("\n".into()),
    }
}

/// A call as `syntax` writes it, its arguments JSON text.
pub fn write_call(syntax: &CallSyntax, name: &str, arguments: &str) -> String {
    format!(
        "{}{name}{}{arguments}{}",
        syntax.prefix, syntax.middle, syntax.suffix
    )
}

/// Whether `name` is a valid function name.
pub fn valid_name(name: &str) -> bool {
    (1..=MAX_TOOL_NAME_CHARS).contains(&name.chars().count())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// How a dialect writes a function tool and a named choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Chat Completions: `{"type": "function", "function": {"name", "description",
    /// "parameters"}}`, a named choice `{"type": "function", "function": {"name"}}`.
    Nested,
    /// Realtime (and Responses): `{"type": "function", "name", "description", "parameters"}`,
    /// a named choice `{"type": "function", "name"}`.
    Flat,
}

fn bad(param: &str, reason: impl std::fmt::Display) -> RequestError {
    RequestError::invalid(Field::Wire(param.into()), reason)
}

impl Tools {
    /// A dialect's `tools`, `tool_choice` and `parallel_tool_calls`, checked (the fields named as
    /// the dialect names them, `tools[2].function.name` or `tools[2].name`); `None` without
    /// tools. At most `MAX_TOOLS` functions of valid, distinct names, all within `max_bytes` of
    /// JSON (`limits.max_schema_bytes`); a named choice names a declared function.
    pub fn parse(
        tools: Option<&[Value]>,
        choice: Option<&Value>,
        parallel: Option<bool>,
        max_bytes: usize,
        shape: Shape,
    ) -> Result<Option<Tools>, RequestError> {
        let Some(list) = tools.filter(|t| !t.is_empty()) else {
            return match choice {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) if s == "none" || s == "auto" => Ok(None),
                Some(_) => Err(bad("tool_choice", "needs `tools`")),
            };
        };
        if list.len() > MAX_TOOLS {
            return Err(bad(
                "tools",
                format!(
                    "must hold at most {MAX_TOOLS} functions. Given: {}",
                    list.len()
                ),
            ));
        }
        let n = serde_json::to_string(list).map_or(0, |s| s.len());
        if n > max_bytes {
            return Err(bad(
                "tools",
                format!(
                    "must be at most {max_bytes} bytes of JSON (limits.max_schema_bytes). Given: {n}"
                ),
            ));
        }
        let inner = match shape {
            Shape::Nested => "function.",
            Shape::Flat => "",
        };
        let mut out: Vec<Tool> = Vec::new();
        for (i, t) in list.iter().enumerate() {
            let at = |f: &str| format!("tools[{i}].{inner}{f}");
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad(&format!("tools[{i}].type"), "must be \"function\""));
            }
            let f = match shape {
                Shape::Nested => t.get("function").filter(|f| f.is_object()),
                Shape::Flat => Some(t),
            };
            let f = f.ok_or_else(|| bad(&format!("tools[{i}].function"), "is required"))?;
            let name = f.get("name").and_then(Value::as_str).unwrap_or("");
            if !valid_name(name) {
                return Err(bad(
                    &at("name"),
                    format!("must be 1 to {MAX_TOOL_NAME_CHARS} characters of a-z, A-Z, 0-9, _ and -. Given: {name:?}"),
                ));
            }
            if out.iter().any(|o| o.name == name) {
                return Err(bad(&at("name"), format!("{name:?} is declared twice")));
            }
            let description = match f.get("description") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(_) => return Err(bad(&at("description"), "must be a string")),
            };
            let parameters = match f.get("parameters") {
                None | Some(Value::Null) => {
                    json!({"type": "object", "properties": {}, "additionalProperties": false})
                }
                Some(p) if p.is_object() => p.clone(),
                Some(_) => return Err(bad(&at("parameters"), "must be a JSON Schema object")),
            };
            out.push(Tool {
                name: name.into(),
                description,
                parameters,
            });
        }
        let named = match shape {
            Shape::Nested => "{\"type\": \"function\", \"function\": {\"name\": ...}}",
            Shape::Flat => "{\"type\": \"function\", \"name\": ...}",
        };
        let choice = match choice {
            None | Some(Value::Null) => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => {
                    return Err(bad(
                        "tool_choice",
                        format!("must be none, auto, required or {named}. Given: {other:?}"),
                    ))
                }
            },
            Some(v) => {
                let f = match shape {
                    Shape::Nested => v.get("function"),
                    Shape::Flat => Some(v),
                };
                let name = (v.get("type").and_then(Value::as_str) == Some("function"))
                    .then(|| f.and_then(|f| f.get("name")).and_then(Value::as_str))
                    .flatten();
                let name = name.ok_or_else(|| {
                    bad(
                        "tool_choice",
                        format!("must be none, auto, required or {named}"),
                    )
                })?;
                if !out.iter().any(|t| t.name == name) {
                    return Err(bad(
                        &format!("tool_choice.{inner}name"),
                        format!("{name:?} is not one of the declared tools"),
                    ));
                }
                ToolChoice::Named(name.into())
            }
        };
        let parallel = parallel.unwrap_or(true);
        Ok(Some(Tools {
            tools: out,
            choice,
            parallel,
            syntax: generic_syntax(),
            native: false,
        }))
    }

    /// The functions for a model whose template writes calls as `syntax` (`None`: it takes no
    /// tools, and they keep the generic format). A template without a separator takes one call
    /// a message.
    pub fn for_template(self, syntax: Option<&CallSyntax>) -> Tools {
        match syntax {
            Some(s) => Tools {
                parallel: self.parallel && s.separator.is_some(),
                syntax: s.clone(),
                native: true,
                ..self
            },
            None => self,
        }
    }

    /// Offers the functions to a validated request: described to the model where its prompt is
    /// built (`lower`), and when the reply may call them (`active`), the grammar that makes
    /// every call valid. With `none` the functions are still described, so the conversation's
    /// prefix stays the one its other turns cached.
    pub fn apply(self: &Arc<Self>, chat: &mut ValidRequest) {
        if self.tools.is_empty() {
            return;
        }
        chat.described = Some(self.clone());
        self.constrain(chat);
    }

    /// Makes the reply able to call these functions (when `active`), already described to the
    /// model (`apply`, or a widget's operator text): their grammar, and the reply parsed into
    /// calls.
    pub fn constrain(self: &Arc<Self>, chat: &mut ValidRequest) {
        if self.active() {
            chat.format = self.format();
            chat.tools = Some(self.clone());
        }
    }

    /// The message that gives a function's result to the model (a `tool` message; `lower`
    /// writes it for the template). Its content is text, as any content is, so a result can
    /// never forge the template's special tokens.
    pub fn result_message(name: &str, content: &str) -> Message {
        Message {
            name: Some(name.into()),
            ..Message::new("tool", content)
        }
    }

    /// The functions as a template takes them (chat completions' shape; an empty description
    /// left out, as a client that sends none writes it).
    pub fn template_json(&self) -> Value {
        Value::Array(
            (self.tools.iter())
                .map(|t| {
                    let mut f = serde_json::Map::new();
                    f.insert("name".into(), json!(t.name));
                    if !t.description.is_empty() {
                        f.insert("description".into(), json!(t.description));
                    }
                    f.insert("parameters".into(), t.parameters.clone());
                    json!({"type": "function", "function": f})
                })
                .collect(),
        )
    }

    /// Whether the reply may call anything.
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None && !self.tools.is_empty()
    }

    /// The functions the reply may call.
    fn callable(&self) -> impl Iterator<Item = &Tool> {
        self.tools.iter().filter(move |t| match &self.choice {
            ToolChoice::Named(n) => &t.name == n,
            _ => true,
        })
    }

    /// The system text that tells the model the functions and the format. The same whatever
    /// the choice (the grammar enforces `required` and a named function), so that a
    /// conversation whose turns choose differently keeps its cached prefix.
    pub fn system_text(&self) -> String {
        let mut s = String::from("You can call these functions:\n");
        for t in &self.tools {
            let d =
                json!({"name": t.name, "description": t.description, "parameters": t.parameters});
            s.push_str(&spaced(&d));
            s.push('\n');
        }
        s.push_str(
            "To call a function, reply with only a JSON object {\"name\": <function name>, \"arguments\": <its arguments as a JSON object>}",
        );
        if self.parallel {
            s.push_str(", one per line to call several");
        }
        s.push_str(". If no function is needed, answer in plain text.");
        s
    }

    /// The grammar of the reply (a Lark grammar over `%json`): only calls, or with `auto` also
    /// text that does not start as a call does.
    pub fn format(&self) -> ResponseFormat {
        let lit = |s: &str| Value::String(s.into()).to_string();
        let mut rules = Vec::new();
        for (i, t) in self.callable().enumerate() {
            let mut args = t.parameters.clone();
            if let Some(o) = args.as_object_mut() {
                o.insert(
                    "x-guidance".into(),
                    json!({"whitespace_flexible": false, "item_separator": ", ",
                        "key_separator": ": "}),
                );
            }
            let name = format!("{}{}{}", self.syntax.prefix, t.name, self.syntax.middle);
            let suffix = match self.syntax.suffix.as_str() {
                "" => String::new(),
                s => format!(" {}", lit(s)),
            };
            rules.push(format!("call_{i}: {} %json {args}{suffix}", lit(&name)));
        }
        let alts: Vec<String> = (0..rules.len()).map(|i| format!("call_{i}")).collect();
        let calls = match (&self.syntax.separator, &self.choice) {
            (Some(sep), c) if self.parallel && !matches!(c, ToolChoice::Named(_)) => {
                format!("calls: call ({} call)*", lit(sep))
            }
            _ => "calls: call".into(),
        };
        let start = match self.choice {
            ToolChoice::Auto => format!("start: TEXT | calls\n{}", text_rule(&self.syntax)),
            _ => "start: calls".into(),
        };
        ResponseFormat::Lark {
            lark: format!(
                "{start}\n{calls}\ncall: {}\n{}\n",
                alts.join(" | "),
                rules.join("\n")
            ),
        }
    }

    /// The grammar of a reply that may not call (a turn out of calls, whose model was told how
    /// to write one): text that does not start as a call does, as `auto`'s text.
    pub fn text_only(&self) -> ResponseFormat {
        ResponseFormat::Lark {
            lark: format!("start: TEXT\n{}\n", text_rule(&self.syntax)),
        }
    }

    /// The choice a reply takes after a call's result: a turn that had to call (`required`)
    /// has, and may go on in text.
    pub fn after_call(self: &Arc<Self>) -> Arc<Tools> {
        match self.choice {
            ToolChoice::Required => Arc::new(Tools {
                choice: ToolChoice::Auto,
                ..(**self).clone()
            }),
            _ => self.clone(),
        }
    }

    /// The text a call takes in the reply (what the model writes, so that a conversation that
    /// sends it back finds it cached).
    pub fn call_text(&self, name: &str, arguments: &Value) -> String {
        write_call(&self.syntax, name, &spaced(arguments))
    }
}

/// The rule of text that is not a call: its first character is not the one calls start with.
fn text_rule(syntax: &CallSyntax) -> String {
    let first = syntax.prefix.chars().next().unwrap_or('{');
    let esc = match first {
        '\\' | ']' | '^' | '-' | '/' => format!("\\{first}"),
        '\n' => "\\n".into(),
        c => c.to_string(),
    };
    format!("TEXT: /[^{esc}](.|\\n)*/")
}

/// Writes a conversation for the template, as `described` (the request's functions) tells:
/// calls (`Message::calls`) as the model writes them, and with native tools results stay `tool`
/// messages and the functions are returned for the template; otherwise results become user
/// turns and the functions are described in the conversation's system turn (the first message,
/// added where the conversation has none). `lead` messages (the operator's) are left as they are.
pub fn lower(messages: &mut Vec<Message>, lead: usize, described: Option<&Tools>) -> Option<Value> {
    let native = described.filter(|t| t.native);
    let generic = generic_syntax();
    let syntax = native.map_or(&generic, |t| &t.syntax);
    for m in messages.iter_mut() {
        if !m.calls.is_empty() {
            let sep = syntax.separator.as_deref().unwrap_or("\n");
            let calls: Vec<String> = (m.calls.drain(..))
                .map(|(name, args)| write_call(syntax, &name, &args))
                .collect();
            m.content = calls.join(sep);
        }
        if m.role == "tool" && native.is_none() {
            let name = m.name.take().unwrap_or_default();
            *m = Message::new(
                "user",
                &format!("The function {name} returned:\n{}", m.content),
            );
        }
    }
    match (native, described) {
        (Some(t), _) => Some(t.template_json()),
        (None, Some(t)) if !t.tools.is_empty() => {
            let text = t.system_text();
            match messages.get_mut(lead) {
                Some(m) if m.role == "system" => m.content = format!("{}\n\n{text}", m.content),
                _ => messages.insert(lead.min(messages.len()), Message::new("system", &text)),
            }
            None
        }
        _ => None,
    }
}

/// JSON with `", "` between items and `": "` after keys, as the grammar writes it (and as
/// Python's `json.dumps` does).
pub fn spaced(v: &Value) -> String {
    crate::tokenizer::chat_template::python_json(v, None)
}

/// What a piece of the reply's text is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Plain text (an `auto` reply that calls nothing).
    Text(String),
    /// Call `index` begins: its function's name.
    CallStart { index: usize, name: String },
    /// More of call `index`'s arguments (JSON text).
    Arguments { index: usize, text: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing yet: the first character decides (a call starts as the syntax's prefix does).
    Start,
    Text,
    /// Inside a call's head (prefix, name, middle), before its arguments.
    Head,
    /// Inside the arguments: JSON nesting depth, in a string, after a backslash.
    Arguments {
        depth: usize,
        string: bool,
        escape: bool,
    },
    /// After the arguments: this many characters of the suffix still to come.
    Tail(usize),
    /// Between calls (the separator), until the next call's first character.
    Between,
}

/// Splits a reply's text, fed as it streams, into text and calls.
#[derive(Debug, Clone)]
pub struct CallParser {
    state: State,
    /// The current call's head so far (`{"name": "f", "arguments": `).
    head: String,
    calls: usize,
    /// Whether the reply can only be calls (`required` or a named function).
    forced: bool,
    syntax: CallSyntax,
}

impl CallParser {
    pub fn new(tools: &Tools) -> Self {
        CallParser {
            state: State::Start,
            head: String::new(),
            calls: 0,
            forced: tools.choice != ToolChoice::Auto,
            syntax: tools.syntax.clone(),
        }
    }

    /// Calls begun so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    fn starts_call(&self, c: char) -> bool {
        self.syntax.prefix.starts_with(c)
    }

    /// The pieces `text` (the next part of the reply) makes.
    pub fn feed(&mut self, text: &str) -> Vec<Piece> {
        let mut out: Vec<Piece> = Vec::new();
        let push = |out: &mut Vec<Piece>, p: Piece| match (out.last_mut(), p) {
            (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
            (
                Some(Piece::Arguments { index: i, text: a }),
                Piece::Arguments { index: j, text: b },
            ) if *i == j => a.push_str(&b),
            (_, p) => out.push(p),
        };
        for c in text.chars() {
            match self.state {
                State::Start if self.starts_call(c) || (self.forced && c.is_whitespace()) => {
                    if self.starts_call(c) {
                        self.state = State::Head;
                        self.head = c.to_string();
                    }
                }
                State::Start | State::Text => {
                    self.state = State::Text;
                    push(&mut out, Piece::Text(c.to_string()));
                }
                State::Head => {
                    self.head.push(c);
                    if let Some(name) = head_name(&self.head, &self.syntax) {
                        push(
                            &mut out,
                            Piece::CallStart {
                                index: self.calls,
                                name,
                            },
                        );
                        self.calls += 1;
                        self.state = State::Arguments {
                            depth: 0,
                            string: false,
                            escape: false,
                        };
                    }
                }
                State::Arguments { .. } => self.arguments_char(c, &mut out, push),
                State::Tail(n) => {
                    self.state = if n > 1 {
                        State::Tail(n - 1)
                    } else {
                        State::Between
                    };
                }
                State::Between => {
                    if self.starts_call(c) {
                        self.state = State::Head;
                        self.head = c.to_string();
                    }
                }
            }
        }
        out
    }

    fn arguments_char(&mut self, c: char, out: &mut Vec<Piece>, push: fn(&mut Vec<Piece>, Piece)) {
        let State::Arguments {
            mut depth,
            mut string,
            mut escape,
        } = self.state
        else {
            return;
        };
        if string {
            if escape {
                escape = false;
            } else if c == '\\' {
                escape = true;
            } else if c == '"' {
                string = false;
            }
        } else {
            match c {
                '"' => string = true,
                '{' | '[' => depth += 1,
                '}' | ']' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        push(
            out,
            Piece::Arguments {
                index: self.calls - 1,
                text: c.to_string(),
            },
        );
        self.state = if depth == 0 && !string && !c.is_whitespace() {
            match self.syntax.suffix.chars().count() {
                0 => State::Between,
                n => State::Tail(n),
            }
        } else {
            State::Arguments {
                depth,
                string,
                escape,
            }
        };
    }
}

/// The function name of a complete call head (prefix, name, middle), or `None` while it is not
/// complete.
fn head_name(head: &str, syntax: &CallSyntax) -> Option<String> {
    let name = head
        .strip_prefix(syntax.prefix.as_str())?
        .strip_suffix(syntax.middle.as_str())?;
    valid_name(name).then(|| name.to_string())
}

/// A whole reply's calls: (name, arguments as JSON text), and its text outside calls.
pub fn parse_reply(tools: &Tools, text: &str) -> (String, Vec<(String, String)>) {
    let mut p = CallParser::new(tools);
    let (mut plain, mut calls) = (String::new(), Vec::<(String, String)>::new());
    for piece in p.feed(text) {
        match piece {
            Piece::Text(t) => plain.push_str(&t),
            Piece::CallStart { name, .. } => calls.push((name, String::new())),
            Piece::Arguments { index, text } => calls[index].1.push_str(&text),
        }
    }
    (plain, calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: ToolChoice, parallel: bool) -> Tools {
        Tools {
            tools: vec![
                Tool {
                    name: "order_status".into(),
                    description: "Looks up an order.".into(),
                    parameters: json!({"type": "object", "properties": {"order": {"type": "string"}}, "required": ["order"]}),
                },
                Tool {
                    name: "handover".into(),
                    description: "Hands the chat to a human.".into(),
                    parameters: json!({"type": "object", "properties": {}}),
                },
            ],
            choice,
            parallel,
            syntax: generic_syntax(),
            native: false,
        }
    }

    /// The pieces of `reply` fed one character at a time, and the parser after it.
    fn fed_by_char(t: &Tools, reply: &str) -> (Vec<Piece>, CallParser) {
        let mut p = CallParser::new(t);
        let mut pieces = Vec::new();
        for c in reply.chars() {
            pieces.extend(p.feed(&c.to_string()));
        }
        (pieces, p)
    }

    #[test]
    fn calls_stream_name_first_then_their_arguments() {
        let t = tools(ToolChoice::Required, true);
        let reply = "{\"name\": \"order_status\", \"arguments\": {\"order\": \"A-1 {\\\"x\\\"}\"}}\n{\"name\": \"handover\", \"arguments\": {}}";
        // Fed one character at a time, and whole: the same calls.
        let (pieces, p) = fed_by_char(&t, reply);
        assert_eq!(
            pieces[0],
            Piece::CallStart {
                index: 0,
                name: "order_status".into()
            }
        );
        let (text, calls) = parse_reply(&t, reply);
        assert_eq!(text, "");
        assert_eq!(
            calls,
            vec![
                (
                    "order_status".to_string(),
                    "{\"order\": \"A-1 {\\\"x\\\"}\"}".to_string()
                ),
                ("handover".to_string(), "{}".to_string()),
            ]
        );
        let args: String = (pieces.iter())
            .filter_map(|p| match p {
                Piece::Arguments { index: 0, text } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(args, calls[0].1);
        assert_eq!(p.calls(), 2);
    }

    #[test]
    fn an_auto_reply_that_calls_nothing_is_text() {
        let t = tools(ToolChoice::Auto, false);
        assert_eq!(
            parse_reply(&t, "Your order ships {soon}."),
            ("Your order ships {soon}.".to_string(), vec![])
        );
        let (text, calls) = parse_reply(&t, "{\"name\": \"handover\", \"arguments\": {}}");
        assert_eq!((text.as_str(), calls.len()), ("", 1));
    }

    #[test]
    fn a_call_written_back_is_the_text_the_model_wrote() {
        let args = json!({"order": "A-1", "items": [1, 2]});
        assert_eq!(
            tools(ToolChoice::Required, false).call_text("order_status", &args),
            "{\"name\": \"order_status\", \"arguments\": {\"order\": \"A-1\", \"items\": [1, 2]}}"
        );
        let t = tools(ToolChoice::Required, false);
        let (_, calls) = parse_reply(&t, &t.call_text("order_status", &args));
        assert_eq!(serde_json::from_str::<Value>(&calls[0].1).unwrap(), args);
    }

    #[test]
    fn declarations_are_bounded_and_named_in_each_dialects_shape() {
        let f = |name: &str| json!({"type": "function", "name": name});
        let field = |r: Result<Option<Tools>, RequestError>| match r {
            Err(RequestError::InvalidParam { field, reason }) => {
                (field.name(crate::server::request::Dialect::OpenAi), reason)
            }
            other => panic!("refused: {other:?}"),
        };
        // More functions, or more bytes, than the limits: refused before any grammar is built.
        let many: Vec<Value> = (0..=MAX_TOOLS).map(|i| f(&format!("f{i}"))).collect();
        let (k, why) = field(Tools::parse(Some(&many), None, None, 1 << 20, Shape::Flat));
        assert_eq!(k, "tools");
        assert!(why.contains("at most 64"), "{why}");
        let big = vec![json!({"type": "function", "name": "f",
            "description": "x".repeat(600)})];
        let (k, why) = field(Tools::parse(Some(&big), None, None, 512, Shape::Flat));
        assert_eq!(k, "tools");
        assert!(why.contains("limits.max_schema_bytes"), "{why}");
        // The same mistake, named as each shape writes it.
        let flat = vec![f("ok"), f("bad name")];
        let (k, _) = field(Tools::parse(Some(&flat), None, None, 4096, Shape::Flat));
        assert_eq!(k, "tools[1].name");
        let nested = vec![json!({"type": "function", "function": {"name": "bad name"}})];
        let (k, _) = field(Tools::parse(Some(&nested), None, None, 4096, Shape::Nested));
        assert_eq!(k, "tools[0].function.name");
        let choice = json!({"type": "function", "name": "nope"});
        let (k, _) = field(Tools::parse(
            Some(&flat[..1]),
            Some(&choice),
            None,
            4096,
            Shape::Flat,
        ));
        assert_eq!(k, "tool_choice.name");
    }

    #[test]
    fn the_grammar_offers_only_the_chosen_functions() {
        let named = tools(ToolChoice::Named("handover".into()), false);
        let ResponseFormat::Lark { lark } = named.format() else {
            panic!("a Lark grammar")
        };
        assert!(lark.contains("\\\"handover\\\"") && !lark.contains("order_status"));
        assert!(lark.starts_with("start: calls\ncalls: call\ncall: call_0\n"));
        let auto = tools(ToolChoice::Auto, true);
        let ResponseFormat::Lark { lark } = auto.format() else {
            panic!("a Lark grammar")
        };
        assert!(lark.contains("TEXT | calls") && lark.contains("(\"\\n\" call)*"));
        // The system turn is the same whatever the choice: a conversation keeps its prefix.
        let none = tools(ToolChoice::None, true);
        assert_eq!(
            named.system_text(),
            tools(ToolChoice::Required, false).system_text()
        );
        assert_eq!(none.system_text(), auto.system_text());
        assert!(named.system_text().contains("order_status"));
    }

    /// Llama 3.1's call format, as `ChatTemplate::call_syntax` finds it.
    fn llama31() -> CallSyntax {
        CallSyntax {
            prefix: "{\"name\": \"".into(),
            middle: "\", \"parameters\": ".into(),
            suffix: "}".into(),
            separator: None,
        }
    }

    #[test]
    fn a_templates_own_call_format_is_the_grammar_and_the_parse() {
        let t = tools(ToolChoice::Auto, true).for_template(Some(&llama31()));
        assert!(t.native && !t.parallel, "one call a message");
        let ResponseFormat::Lark { lark } = t.format() else {
            panic!("a Lark grammar")
        };
        assert!(lark.contains("\\\"parameters\\\": ") && !lark.contains("arguments"));
        assert!(lark.contains("calls: call\n") && lark.contains("TEXT: /[^{]"));
        let call = t.call_text("order_status", &json!({"order": "A-1"}));
        assert_eq!(
            call,
            "{\"name\": \"order_status\", \"parameters\": {\"order\": \"A-1\"}}"
        );
        assert_eq!(
            parse_reply(&t, &call),
            (
                String::new(),
                vec![("order_status".into(), "{\"order\": \"A-1\"}".into())]
            )
        );
        assert_eq!(parse_reply(&t, "Soon {maybe}.").0, "Soon {maybe}.");
        // Without a template that takes tools, the generic format stays.
        assert_eq!(
            tools(ToolChoice::Auto, true).for_template(None).syntax,
            generic_syntax()
        );
    }

    #[test]
    fn calls_wrapped_in_markup_stream_name_first_whatever_the_syntax() {
        // A Hermes-style template: markup around each call, calls a line apart.
        let hermes = CallSyntax {
            prefix: "<tool_call>\n{\"name\": \"".into(),
            middle: "\", \"arguments\": ".into(),
            suffix: "}\n</tool_call>".into(),
            separator: Some("\n".into()),
        };
        let t = tools(ToolChoice::Required, true).for_template(Some(&hermes));
        assert!(t.parallel);
        let reply = format!(
            "{}\n{}",
            t.call_text("order_status", &json!({"order": "}</tool_call>"})),
            t.call_text("handover", &json!({}))
        );
        let (pieces, _) = fed_by_char(&t, &reply);
        assert_eq!(
            pieces[0],
            Piece::CallStart {
                index: 0,
                name: "order_status".into()
            }
        );
        assert_eq!(
            parse_reply(&t, &reply).1,
            vec![
                (
                    "order_status".to_string(),
                    "{\"order\": \"}</tool_call>\"}".to_string()
                ),
                ("handover".to_string(), "{}".to_string()),
            ]
        );
        let ResponseFormat::Lark { lark } = t.format() else {
            panic!("a Lark grammar")
        };
        assert!(lark.contains("calls: call (\"\\n\" call)*"), "{lark}");
    }

    #[test]
    fn a_conversation_is_written_for_the_format_its_functions_take() {
        let conversation = || {
            vec![
                Message::new("system", "Operator text."),
                Message::new("user", "Where is A-1?"),
                Message {
                    calls: vec![("order_status".into(), "{\"order\": \"A-1\"}".into())],
                    ..Message::new("assistant", "")
                },
                Tools::result_message("order_status", "shipped"),
            ]
        };
        // Generic: the functions in the conversation's system turn (after the operator's lead
        // message), the call as the model writes it, the result a user turn.
        let generic = tools(ToolChoice::Auto, true);
        let mut m = conversation();
        assert_eq!(lower(&mut m, 1, Some(&generic)), None);
        assert_eq!((m[1].role.as_str(), m.len()), ("system", 5));
        assert_eq!(m[1].content, generic.system_text());
        assert_eq!(
            m[3].content,
            "{\"name\": \"order_status\", \"arguments\": {\"order\": \"A-1\"}}"
        );
        assert_eq!(
            (m[4].role.as_str(), m[4].content.as_str()),
            ("user", "The function order_status returned:\nshipped")
        );
        assert!(m.iter().all(|m| m.calls.is_empty()));
        // Native: the functions go to the template, the result stays a `tool` message.
        let native = tools(ToolChoice::Auto, true).for_template(Some(&llama31()));
        let mut m = conversation();
        let given = lower(&mut m, 1, Some(&native)).expect("the template's tools");
        assert_eq!(given[0]["function"]["name"], "order_status");
        assert_eq!(
            given[1]["function"]["description"],
            "Hands the chat to a human."
        );
        assert_eq!(m.len(), 4);
        assert_eq!(
            m[2].content,
            "{\"name\": \"order_status\", \"parameters\": {\"order\": \"A-1\"}}"
        );
        assert_eq!(
            (m[3].role.as_str(), m[3].name.as_deref()),
            ("tool", Some("order_status"))
        );
        // No functions this turn: calls and results in the history still read as text.
        let mut m = conversation();
        assert_eq!(lower(&mut m, 1, None), None);
        assert_eq!((m.len(), m[3].role.as_str()), (4, "user"));
    }
}
