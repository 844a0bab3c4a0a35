//! Seals on the assistant's messages, so that a conversation can move to another replica: the
//! client keeps its transcript, and a `restore` frame on a replica that does not know the
//! conversation (its own drained or died) rebuilds it. User text is the client's own to send,
//! but an assistant message is the model's words: a client that may not send assistant messages
//! (a widget, `tenants.client_roles`) must not get to write them through a restore. Each `done`
//! therefore carries a seal of the reply as the conversation recorded it, an HMAC-SHA256 under
//! `server.conversation_secret` (the same on every replica) bound to who the client is (tenant,
//! kind, widget or key); `restore` takes an assistant message from such a client only with its
//! seal. Written here because it is a dozen lines over the `hmac` and `sha2` crates.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Seals and checks assistant messages under one secret.
pub struct Sealer {
    key: Vec<u8>,
}

/// What every seal starts with, so that a seal of this kind is never one of anything else.
const DOMAIN: &[u8] = b"llama-relay assistant message v1\0";

impl Sealer {
    /// `secret` empty: a random key for this process (restores then work on this replica only).
    pub fn new(secret: &str) -> Self {
        let key = if secret.is_empty() {
            (0..32).map(|_| rand::random::<u8>()).collect()
        } else {
            secret.as_bytes().to_vec()
        };
        Sealer { key }
    }

    fn mac(&self, scope: &str, content: &str) -> [u8; 32] {
        let mut m = Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes any key length");
        m.update(DOMAIN);
        m.update(&(scope.len() as u64).to_le_bytes());
        m.update(scope.as_bytes());
        m.update(content.as_bytes());
        m.finalize().into_bytes().into()
    }

    /// The seal of assistant message `content` for the client `scope` names (hex).
    pub fn seal(&self, scope: &str, content: &str) -> String {
        self.mac(scope, content)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Whether `seal` is `content`'s for `scope` (in constant time).
    pub fn verify(&self, scope: &str, content: &str, seal: &str) -> bool {
        let Some(given) = from_hex(seal) else {
            return false;
        };
        bool::from(given.ct_eq(&self.mac(scope, content)))
    }
}

fn from_hex(s: &str) -> Option<[u8; 32]> {
    let b = s.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in b.chunks(2).enumerate() {
        let hex = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(hex, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seal_verifies_only_its_content_scope_and_secret() {
        let a = Sealer::new("replica secret, the same everywhere");
        let s = a.seal("acme/widget/help", "Your order ships today.");
        assert_eq!(s.len(), 64);
        assert!(a.verify("acme/widget/help", "Your order ships today.", &s));
        // Another replica with the same secret accepts it.
        let b = Sealer::new("replica secret, the same everywhere");
        assert!(b.verify("acme/widget/help", "Your order ships today.", &s));
        // Changed text, another client, another secret, a malformed seal: refused.
        assert!(!a.verify("acme/widget/help", "Your order ships today!", &s));
        assert!(!a.verify("acme/widget/other", "Your order ships today.", &s));
        assert!(!Sealer::new("another").verify("acme/widget/help", "Your order ships today.", &s));
        assert!(!a.verify("acme/widget/help", "Your order ships today.", &s[..62]));
        assert!(!a.verify(
            "acme/widget/help",
            "Your order ships today.",
            &"zz".repeat(32)
        ));
        // The scope's length is sealed too: moving text between scope and content changes it.
        assert!(!a.verify("acme/widget/helpY", "our order ships today.", &s));
        // Without a secret each process has its own key.
        let (x, y) = (Sealer::new(""), Sealer::new(""));
        assert!(!y.verify("s", "c", &x.seal("s", "c")));
    }
}
