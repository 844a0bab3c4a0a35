//! Function tools, as every dialect shares them: the validated declarations and choice (`Tools`),
//! the generic format a model without a tool-calling template is told to use (a system turn that
//! describes the functions; each call a JSON object `{"name": ..., "arguments": {...}}` on its own
//! line), the grammar that makes every call valid (a Lark grammar over llguidance's `%json`, so
//! the arguments follow the function's JSON Schema), and `CallParser`, which turns the reply's
//! text, as it streams, into calls (name first, then argument fragments).
//!
//! Written here because the format is ours: llguidance constrains, but which text is a call and
//! how it streams as OpenAI's `tool_calls` deltas is the gateway's contract. With `auto` the
//! grammar lets the reply be either text that does not start with `{` or calls (the pattern of
//! llguidance's own tool-calling example), so a plain answer stays free.

use serde_json::{json, Value};

use crate::engine::constraint::ResponseFormat;

/// Most functions one request may declare.
pub const MAX_TOOLS: usize = 64;

/// Longest function name (OpenAI's limit), of `a-z A-Z 0-9 _ -`.
pub const MAX_TOOL_NAME_CHARS: usize = 64;

/// A declared function.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: String,
    /// A JSON Schema of the arguments object.
    pub parameters: Value,
}

/// Whether and which function the model must call.
#[derive(Debug, Clone, PartialEq)]
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
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// Several calls in one reply (one per line).
    pub parallel: bool,
}

/// Whether `name` is a valid function name.
pub fn valid_name(name: &str) -> bool {
    (1..=MAX_TOOL_NAME_CHARS).contains(&name.chars().count())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

impl Tools {
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

    /// The system text that tells the model the functions and the format.
    pub fn system_text(&self) -> String {
        let mut s = String::from("You can call these functions:\n");
        for t in self.callable() {
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
        s.push('.');
        match &self.choice {
            ToolChoice::Auto => s.push_str(" If no function is needed, answer in plain text."),
            ToolChoice::Required => s.push_str(" You must call a function."),
            ToolChoice::Named(n) => s.push_str(&format!(" You must call {n}.")),
            ToolChoice::None => {}
        }
        s
    }

    /// The grammar of the reply (a Lark grammar over `%json`): only calls, or with `auto` also
    /// text that does not start with `{`.
    pub fn format(&self) -> ResponseFormat {
        let calls: Vec<Value> = self
            .callable()
            .map(|t| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = json!({"anyOf": calls, "x-guidance": {
            "whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}});
        let call = format!("call: %json {schema}");
        let calls = if self.parallel {
            "calls: call (\"\\n\" call)*"
        } else {
            "calls: call"
        };
        let start = match self.choice {
            ToolChoice::Auto => "start: TEXT | calls\nTEXT: /[^{](.|\\n)*/",
            _ => "start: calls",
        };
        ResponseFormat::Lark {
            lark: format!("{start}\n{calls}\n{call}\n"),
        }
    }

    /// The text a call takes in the reply (what the model writes, so that a conversation that
    /// sends it back finds it cached).
    pub fn call_text(name: &str, arguments: &Value) -> String {
        spaced(&json!({"name": name, "arguments": arguments}))
    }
}

/// JSON with `", "` between items and `": "` after keys, as the grammar writes it.
pub fn spaced(v: &Value) -> String {
    struct Spaced;
    fn comma<W: ?Sized + std::io::Write>(w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    impl serde_json::ser::Formatter for Spaced {
        fn begin_array_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            comma(w, first)
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            comma(w, first)
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
        ) -> std::io::Result<()> {
            w.write_all(b": ")
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Spaced);
    serde::Serialize::serialize(v, &mut ser).expect("a JSON value serializes");
    String::from_utf8(out).expect("JSON is UTF-8")
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
    /// Nothing yet: the first character decides (a call starts with `{`).
    Start,
    Text,
    /// Inside a call's head, before its arguments.
    Head,
    /// Inside the arguments: JSON nesting depth, in a string, after a backslash.
    Arguments {
        depth: usize,
        string: bool,
        escape: bool,
    },
    /// After the arguments, before the call's closing `}`, then between calls.
    Tail,
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
}

impl CallParser {
    pub fn new(tools: &Tools) -> Self {
        CallParser {
            state: State::Start,
            head: String::new(),
            calls: 0,
            forced: tools.choice != ToolChoice::Auto,
        }
    }

    /// Calls begun so far.
    pub fn calls(&self) -> usize {
        self.calls
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
                State::Start if c == '{' || (self.forced && c.is_whitespace()) => {
                    if c == '{' {
                        self.state = State::Head;
                        self.head = "{".into();
                    }
                }
                State::Start | State::Text => {
                    self.state = State::Text;
                    push(&mut out, Piece::Text(c.to_string()));
                }
                State::Head => {
                    if !c.is_whitespace() {
                        if let Some(name) = head_name(&self.head) {
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
                            self.arguments_char(c, &mut out, push);
                            continue;
                        }
                    }
                    self.head.push(c);
                }
                State::Arguments { .. } => self.arguments_char(c, &mut out, push),
                State::Tail => {
                    if c == '}' {
                        self.state = State::Between;
                    }
                }
                State::Between => {
                    if c == '{' {
                        self.state = State::Head;
                        self.head = "{".into();
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
            State::Tail
        } else {
            State::Arguments {
                depth,
                string,
                escape,
            }
        };
    }
}

/// The function name of a complete call head (`{"name": "f", "arguments": `), or `None` while
/// it is not complete.
fn head_name(head: &str) -> Option<String> {
    let rest = head.strip_prefix('{')?.trim_start();
    let rest = rest.strip_prefix("\"name\"")?.trim_start();
    let rest = rest.strip_prefix(':')?.trim_start();
    let rest = rest.strip_prefix('"')?;
    let (name, rest) = rest.split_once('"')?;
    let rest = rest.trim_start().strip_prefix(',')?.trim_start();
    let rest = rest.strip_prefix("\"arguments\"")?.trim_start();
    rest.strip_prefix(':')?
        .trim()
        .is_empty()
        .then(|| name.to_string())
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
        }
    }

    #[test]
    fn calls_stream_name_first_then_their_arguments() {
        let t = tools(ToolChoice::Required, true);
        let reply = "{\"name\": \"order_status\", \"arguments\": {\"order\": \"A-1 {\\\"x\\\"}\"}}\n{\"name\": \"handover\", \"arguments\": {}}";
        // Fed one character at a time, and whole: the same calls.
        let mut p = CallParser::new(&t);
        let mut pieces = Vec::new();
        for c in reply.chars() {
            pieces.extend(p.feed(&c.to_string()));
        }
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
            Tools::call_text("order_status", &args),
            "{\"name\": \"order_status\", \"arguments\": {\"order\": \"A-1\", \"items\": [1, 2]}}"
        );
        let t = tools(ToolChoice::Required, false);
        let (_, calls) = parse_reply(&t, &Tools::call_text("order_status", &args));
        assert_eq!(serde_json::from_str::<Value>(&calls[0].1).unwrap(), args);
    }

    #[test]
    fn the_grammar_offers_only_the_chosen_functions() {
        let named = tools(ToolChoice::Named("handover".into()), false);
        let ResponseFormat::Lark { lark } = named.format() else {
            panic!("a Lark grammar")
        };
        assert!(lark.contains("\"handover\"") && !lark.contains("order_status"));
        assert!(lark.starts_with("start: calls\ncalls: call\n"));
        let auto = tools(ToolChoice::Auto, true);
        let ResponseFormat::Lark { lark } = auto.format() else {
            panic!("a Lark grammar")
        };
        assert!(lark.contains("TEXT | calls") && lark.contains("(\"\\n\" call)*"));
        assert!(named.system_text().contains("You must call handover."));
        assert!(!named.system_text().contains("order_status"));
    }
}
