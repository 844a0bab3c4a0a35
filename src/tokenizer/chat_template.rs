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
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
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
    fn strftime_now_formats_a_date() {
        let s = strftime_now("%d %b %Y".into());
        assert_eq!(s.len(), 11, "{s}");
    }
}
