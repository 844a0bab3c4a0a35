//! Renders a conversation with the model's own chat template (Jinja, as in Hugging Face's
//! `tokenizer_config.json` or GGUF's `tokenizer.chat_template`) through minijinja, with the
//! Python string methods HF templates call (`.strip()`, `.startswith()`, ...) from
//! minijinja-contrib's pycompat, and HF's `raise_exception` and `strftime_now`.

use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

use crate::error::{EngineError, Result};

/// One chat message as templates see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template with the special tokens it refers to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Wraps each message's content while rendering, to find it in the output (`render_spans`):
    /// private-use characters around a random nonce, so no real text holds them.
    open: String,
    close: String,
    /// The template strips the whitespace around content (Llama 3's `| trim`): content is
    /// stripped before it is wrapped, since the markers would shield it.
    trims_content: bool,
}

/// A piece of a rendered conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Span {
    /// Written by the template: its control tokens are special.
    Template(String),
    /// A message's content: text only.
    Content(String),
}

fn raise_exception(msg: String) -> std::result::Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(fmt: String) -> String {
    // No timezone database on purpose: templates use it for a date line ("26 Jul 2024").
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let days = secs.div_euclid(86_400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    fmt.replace("%d", &format!("{d:02}"))
        .replace("%b", MONTHS[(m - 1) as usize])
        .replace("%m", &format!("{m:02}"))
        .replace("%Y", &y.to_string())
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| EngineError::ChatTemplate(format!("cannot compile: {e}")))?;
        let nonce = format!("{:016x}", rand::random::<u64>());
        let mut t = ChatTemplate {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            open: format!("\u{E000}{nonce}\u{E001}"),
            close: format!("\u{E002}{nonce}\u{E003}"),
            trims_content: false,
        };
        // Probe: does " X " come out as " X " or as "X"?
        let probe = format!(" {}x{} ", t.open, t.close);
        if let Ok(out) = t.render(&[Message::new("user", &probe)], false) {
            t.trims_content = !out.contains(&probe) && out.contains(probe.trim());
        }
        Ok(t)
    }

    /// Renders `messages` as `render` does, cut into the template's own text and each message's
    /// content (which may hold any characters, markup of special tokens included).
    pub fn render_spans(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Vec<Span>> {
        let wrapped: Vec<Message> = messages
            .iter()
            .map(|m| {
                if m.content.contains(&self.open) || m.content.contains(&self.close) {
                    return Err(EngineError::ChatTemplate(
                        "message content holds the renderer's reserved marker".into(),
                    ));
                }
                let c = if self.trims_content {
                    m.content.trim()
                } else {
                    m.content.as_str()
                };
                Ok(Message {
                    role: m.role.clone(),
                    content: format!("{}{c}{}", self.open, self.close),
                })
            })
            .collect::<Result<_>>()?;
        let out = self.render(&wrapped, add_generation_prompt)?;
        let cut = || EngineError::ChatTemplate("the template cut a message's content".into());
        let mut spans = Vec::new();
        let mut rest = out.as_str();
        while let Some(i) = rest.find(&self.open) {
            if i > 0 {
                spans.push(Span::Template(rest[..i].to_string()));
            }
            let after = &rest[i + self.open.len()..];
            let j = after.find(&self.close).ok_or_else(cut)?;
            if after[..j].contains(&self.open) {
                return Err(EngineError::ChatTemplate(
                    "the template nests message content".into(),
                ));
            }
            if j > 0 {
                spans.push(Span::Content(after[..j].to_string()));
            }
            rest = &after[j + self.close.len()..];
        }
        if rest.contains(&self.close) {
            return Err(cut());
        }
        if !rest.is_empty() {
            spans.push(Span::Template(rest.to_string()));
        }
        Ok(spans)
    }

    /// Renders `messages`, ending with the assistant header when `add_generation_prompt`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
        t.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| EngineError::ChatTemplate(format!("cannot render: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_methods_and_exceptions() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{% if m.role not in ['user','assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}[{{ m.content.strip() }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}",
            "<s>",
            "</s>",
        )
        .unwrap();
        assert_eq!(
            t.render(&[Message::new("user", "  hi ")], true).unwrap(),
            "[hi]>"
        );
        let e = t
            .render(&[Message::new("tool", "x")], false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad role tool"), "{e}");
    }

    #[test]
    fn content_spans_come_back_whole_and_trimmed_where_the_template_trims() {
        let plain = ChatTemplate::new(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let spans = plain
            .render_spans(&[Message::new("user", " a<|im_end|>b ")], false)
            .unwrap();
        assert_eq!(
            spans,
            vec![
                Span::Template("<|im_start|>user\n".into()),
                Span::Content(" a<|im_end|>b ".into()),
                Span::Template("<|im_end|>\n".into()),
            ]
        );
        let trims = ChatTemplate::new(
            "{% for m in messages %}[{{ m.role }}]{{ m.content | trim }}<eot>{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let spans = trims
            .render_spans(&[Message::new("user", "  hi  ")], false)
            .unwrap();
        assert_eq!(spans[1], Span::Content("hi".into()));
        let text: String = spans
            .iter()
            .map(|s| match s {
                Span::Template(t) | Span::Content(t) => t.as_str(),
            })
            .collect();
        assert_eq!(
            text,
            trims
                .render(&[Message::new("user", "  hi  ")], false)
                .unwrap()
        );
    }

    #[test]
    fn strftime_now_formats_a_date() {
        let s = strftime_now("%d %b %Y".into());
        assert_eq!(s.len(), 11, "{s}");
    }
}
