//! Sessions whose connection dropped, kept for `server.resume_grace_s` so that a new connection
//! presenting the session's resume token carries on where the old one stopped (docs/protocol.md,
//! "Resume"). A parked session runs nothing: its reply, if one was running, goes on in the
//! batcher, which keeps the reply's token ids, so on resume the new session rebuilds the reply's
//! text (and its deltas, with the same indexes) from them. What is parked is therefore plain
//! data behind a lock, taken once; no actor is needed to hold it.
//!
//! A client often comes back before the server has noticed that its old connection is dead (a
//! phone that changed networks leaves no FIN; the heartbeat finds it only after
//! `server.client_timeout_s`). So live sessions are registered under their token too, and a
//! resume that finds one tells it to park at once (`Takeover`) and then takes it.
//!
//! Bounded: at most `server.max_connections` sessions are parked (past that a dropped session
//! simply ends, as without resuming), and expired entries go whenever one is parked. A token is
//! 244 random bits (two v4 UUIDs), only ever sent to the session's own client, and a resume
//! must also come from the same client identity (tenant, kind, key, widget prompt).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use crate::engine::RequestId;
use crate::server::gate::tenants::Identity;
use crate::server::ws::protocol::ServerFrame;
use crate::tokenizer::Message;

/// A reply that was running when the connection dropped.
#[derive(Debug, Clone)]
pub struct ParkedReply {
    pub client_id: String,
    pub request: RequestId,
    /// Where the conversation is cut when the reply ends, and the messages that follow the cut.
    pub replace_from: usize,
    pub new_messages: Vec<Message>,
    pub stop: Vec<String>,
    /// A paced reply's window.
    pub window: Option<usize>,
    /// A `cancel` had been sent: after this many of the reply's tokens (later ones were never
    /// shown), with the last delta heard, if it said.
    pub cancelled_at: Option<usize>,
    pub heard: Option<usize>,
    /// A reply that may call the widget's functions: its turn's request and the calls the turn
    /// made before it.
    pub calling: Option<(Box<crate::server::request::ValidRequest>, usize)>,
    /// The oldest turns its prompt left out.
    pub dropped: Option<crate::server::request::overflow::Dropped>,
}

/// A reply that called one of the widget's functions, waiting for the client's `tool_result`.
#[derive(Debug, Clone)]
pub struct ToolWait {
    pub client_id: String,
    pub call_id: String,
    pub name: String,
    /// The turn's request: the reply goes on with it.
    pub chat: Box<crate::server::request::ValidRequest>,
    /// Calls the turn has made, this one included.
    pub made: usize,
    /// When the model is told the function did not answer.
    pub deadline: Instant,
}

/// The last reply that ended, as it was sent: a client whose connection dropped before it read
/// the end gets the rest on resume.
#[derive(Debug, Clone)]
pub struct LastReply {
    pub client_id: String,
    pub started: Option<ServerFrame>,
    pub deltas: Vec<String>,
    pub end: ServerFrame,
}

#[derive(Debug)]
pub struct ParkedSession {
    pub id: uuid::Uuid,
    pub identity: Identity,
    pub conversation: Vec<Message>,
    /// User turns the overflow policy dropped before `conversation`'s first.
    pub dropped_turns: usize,
    pub reply: Option<ParkedReply>,
    pub last: Option<LastReply>,
    /// A turn whose prompt was being built when the connection dropped: it starts on resume.
    pub preparing: Option<(crate::server::request::ValidRequest, usize)>,
    /// Its place under the connection caps while its reply still runs: a parked session with a
    /// running reply counts as a connection until it is resumed or expires.
    pub permit: Option<crate::server::gate::admission::Permit>,
    pub expires: Instant,
    /// A call waiting for its result.
    pub tool_wait: Option<ToolWait>,
}

/// Tells a live session that a new connection resumes it: it parks and closes its connection.
/// Answers whether it parked.
#[derive(actix::Message)]
#[rtype(result = "bool")]
pub struct Takeover;

enum Entry {
    Live {
        identity: Identity,
        to: actix::Recipient<Takeover>,
    },
    Parked(Box<ParkedSession>),
}

/// What a token finds.
pub enum Found {
    Parked(Box<ParkedSession>),
    /// A session still connected: send it `Takeover`, then take again.
    Live(actix::Recipient<Takeover>),
    Nothing,
}

pub struct Parked {
    max: usize,
    sessions: Mutex<HashMap<String, Entry>>,
}

/// A fresh resume token.
pub fn new_token() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

impl Parked {
    pub fn new(max: usize) -> Self {
        Parked {
            max,
            sessions: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A connected session's token, so that a resume can reach it.
    pub fn register(&self, token: String, identity: Identity, to: actix::Recipient<Takeover>) {
        self.lock().insert(token, Entry::Live { identity, to });
    }

    /// A session that ends without parking.
    pub fn unregister(&self, token: &str) {
        let mut map = self.lock();
        if matches!(map.get(token), Some(Entry::Live { .. })) {
            map.remove(token);
        }
    }

    /// Forgets sessions whose grace ended (their connection places go with them).
    pub fn sweep(&self, now: Instant) {
        self.lock()
            .retain(|_, e| !matches!(e, Entry::Parked(p) if p.expires <= now));
    }

    /// Parks a session under its token; false (and the token forgotten) when the registry is
    /// full.
    pub fn park(&self, token: String, s: ParkedSession, now: Instant) -> bool {
        self.sweep(now);
        let mut map = self.lock();
        let parked = map
            .values()
            .filter(|e| matches!(e, Entry::Parked(_)))
            .count();
        if parked >= self.max {
            map.remove(&token);
            return false;
        }
        map.insert(token, Entry::Parked(Box::new(s)));
        true
    }

    /// What `token` finds for `identity`: a parked session (taken: only once), a live one, or
    /// nothing (unknown, expired, or another identity's, which stays for its owner).
    pub fn take(&self, token: &str, identity: &Identity, now: Instant) -> Found {
        let mut map = self.lock();
        match map.get(token) {
            Some(Entry::Parked(p)) if p.expires > now && p.identity == *identity => {
                match map.remove(token) {
                    Some(Entry::Parked(p)) => Found::Parked(p),
                    _ => Found::Nothing,
                }
            }
            Some(Entry::Parked(p)) if p.expires <= now => {
                map.remove(token);
                Found::Nothing
            }
            Some(Entry::Live { identity: i, to }) if i == identity => Found::Live(to.clone()),
            _ => Found::Nothing,
        }
    }

    /// Sessions parked now (expired ones included until the next park).
    pub fn len(&self) -> usize {
        let map = self.lock();
        map.values()
            .filter(|e| matches!(e, Entry::Parked(_)))
            .count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::gate::tenants::Tenants;
    use std::time::Duration;

    fn session(identity: Identity, expires: Instant) -> ParkedSession {
        ParkedSession {
            id: uuid::Uuid::new_v4(),
            identity,
            conversation: vec![Message::new("user", "hi")],
            dropped_turns: 0,
            reply: None,
            last: None,
            preparing: None,
            permit: None,
            expires,
            tool_wait: None,
        }
    }

    #[test]
    fn a_token_is_taken_once_by_its_own_identity_before_it_expires() {
        let tenants = Tenants::new(&[]).unwrap();
        let anon = tenants.anonymous();
        let mut other = anon.clone();
        other.tenant = "acme".into();
        let now = Instant::now();
        let later = now + Duration::from_secs(60);
        let p = Parked::new(2);
        assert_ne!(new_token(), new_token());
        assert!(p.park("t1".into(), session(anon.clone(), later), now));
        let parked = |f: Found| matches!(f, Found::Parked(_));
        assert!(!parked(p.take("t1", &other, now)), "another identity");
        assert!(parked(p.take("t1", &anon, now)));
        assert!(!parked(p.take("t1", &anon, now)), "taken once");
        assert!(p.park("t2".into(), session(anon.clone(), later), now));
        assert!(!parked(p.take("t2", &anon, later)), "expired");
        // Full: a third is refused; expired ones make room.
        assert!(p.park("a".into(), session(anon.clone(), later), now));
        assert!(p.park("b".into(), session(anon.clone(), later), now));
        assert!(!p.park("c".into(), session(anon.clone(), later), now));
        assert!(p.park(
            "c".into(),
            session(anon.clone(), later + Duration::from_secs(1)),
            later
        ));
        assert_eq!(p.len(), 1);
    }
}
