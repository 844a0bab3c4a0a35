//! What a conversation that outgrows the context keeps (`limits.overflow`, per tenant or widget,
//! per request `params.overflow`, the Realtime API's `truncation`).
//!
//! `error` refuses the turn (`prompt_too_long`), as before. `drop_oldest` keeps the
//! instructions (the operator's system prompt and the conversation's leading system messages)
//! and the turn being answered, and drops whole oldest turns (a turn: a user message and what
//! follows it up to the next) until the prompt fits the context less the reply's room. It drops
//! down to `retention_ratio` of that room, not just under it, so the next turns fit without
//! dropping again and keep their cached prefix: OpenAI's Realtime `retention_ratio`, which
//! amortizes a truncation over the turns that follow. The choice is a pure function of token
//! counts (`turns_to_drop`), tested alone; `prompt::build` measures the counts and checks the
//! result exactly.

use crate::tokenizer::Message;

pub use crate::settings::DEFAULT_RETENTION;

/// What a prompt that does not fit does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Overflow {
    /// The turn is refused with `prompt_too_long`.
    Error,
    /// Whole oldest turns are dropped until the conversation after the instructions fills at
    /// most `retention` of the room left to it (0 < retention <= 1).
    DropOldest { retention: f32 },
}

// Retention ratios are finite (`check_retention`), so equality is an equivalence.
impl Eq for Overflow {}

impl Overflow {
    /// The policy a setting or parameter names: `error` or `drop_oldest` (with `retention`).
    pub fn parse(name: &str, retention: f32) -> Result<Overflow, String> {
        match name {
            "error" => Ok(Overflow::Error),
            "drop_oldest" => Ok(Overflow::DropOldest { retention }),
            other => Err(format!("must be error or drop_oldest. Given: {other:?}")),
        }
    }

    /// A retention ratio is a share of the room: above 0, at most 1.
    pub fn check_retention(r: f32) -> Result<f32, String> {
        if r.is_finite() && r > 0.0 && r <= 1.0 {
            Ok(r)
        } else {
            Err(format!("must be above 0 and at most 1. Given: {r}"))
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Overflow::Error => "error",
            Overflow::DropOldest { .. } => "drop_oldest",
        }
    }
}

/// Turns a prompt left out: messages `from..from + messages` of the conversation it was built
/// from (history and new messages together), `turns` whole turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    pub from: usize,
    pub messages: usize,
    pub turns: usize,
}

/// A conversation's shape for the policy: `lead` leading system messages (the instructions,
/// never dropped), then turns, each starting at a user message (messages before the first user
/// message belong to the first turn), given as their message ranges' starts; the last turn is
/// the one being answered.
pub fn turn_starts(messages: &[Message]) -> (usize, Vec<usize>) {
    let lead = messages.iter().take_while(|m| m.role == "system").count();
    let mut starts = Vec::new();
    for (i, m) in messages.iter().enumerate().skip(lead) {
        if i == lead || m.role == "user" {
            starts.push(i);
        }
    }
    (lead, starts)
}

/// How many of the oldest `turns` (token counts, oldest first; the last is the turn being
/// answered) to drop so that `instructions + the kept turns <= limit`, keeping at most
/// `retention` of the room after the instructions once it drops at all. `None` when the
/// instructions and the last turn alone exceed `limit`. Never drops the last turn; drops
/// nothing when all fits.
pub fn turns_to_drop(
    instructions: usize,
    turns: &[usize],
    limit: usize,
    retention: f32,
) -> Option<usize> {
    let total = instructions + turns.iter().sum::<usize>();
    if total <= limit {
        return Some(0);
    }
    let last = *turns.last()?;
    if instructions + last > limit {
        return None;
    }
    let room = limit - instructions;
    // The kept turns' target: `retention` of the room, though never less than the last turn.
    let target = ((room as f64 * f64::from(retention.clamp(0.0, 1.0))) as usize).max(last);
    let mut kept: usize = turns.iter().sum();
    let mut drop = 0;
    while kept > target && drop + 1 < turns.len() {
        kept -= turns[drop];
        drop += 1;
    }
    Some(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn m(role: &str) -> Message {
        Message::new(role, "x")
    }

    #[test]
    fn turns_start_at_user_messages_after_the_instructions() {
        let c = [
            m("system"),
            m("assistant"),
            m("user"),
            m("assistant"),
            m("user"),
            m("tool"),
            m("assistant"),
            m("user"),
        ];
        assert_eq!(turn_starts(&c), (1, vec![1, 2, 4, 7]));
        assert_eq!(turn_starts(&[m("user")]), (0, vec![0]));
        assert_eq!(turn_starts(&[m("system"), m("system")]), (2, vec![]));
    }

    #[test]
    fn drops_the_fewest_oldest_turns_down_to_the_retention_target() {
        // Fits: nothing dropped.
        assert_eq!(turns_to_drop(10, &[20, 20, 20], 70, 0.5), Some(0));
        // 10 + 60 > 65: the room is 55, half of it 27: only the last turn (20) stays.
        assert_eq!(turns_to_drop(10, &[20, 20, 20], 65, 0.5), Some(2));
        // With all the room kept, one turn is enough.
        assert_eq!(turns_to_drop(10, &[20, 20, 20], 65, 1.0), Some(1));
        // The last turn alone is over the retention target: it is kept, every other dropped.
        assert_eq!(turns_to_drop(10, &[5, 5, 50], 60, 0.1), Some(2));
        // The instructions and the last turn do not fit: nothing can.
        assert_eq!(turns_to_drop(10, &[5, 51], 60, 1.0), None);
        assert_eq!(turns_to_drop(61, &[], 60, 1.0), None);
        assert_eq!(turns_to_drop(60, &[], 60, 1.0), Some(0));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, rng_seed: proptest::test_runner::RngSeed::Fixed(36), ..ProptestConfig::default() })]

        /// Whatever it keeps fits; it keeps the last turn; once it drops, what it keeps is
        /// within the retention target (or the last turn alone), and keeping one more turn
        /// would not be.
        #[test]
        fn the_choice_fits_keeps_the_last_turn_and_honours_retention(
            instructions in 0usize..200,
            turns in proptest::collection::vec(1usize..300, 0..30),
            limit in 1usize..3000,
            retention in 0.05f32..=1.0,
        ) {
            let total = instructions + turns.iter().sum::<usize>();
            match turns_to_drop(instructions, &turns, limit, retention) {
                None => {
                    let last = turns.last().copied();
                    prop_assert!(last.is_none_or(|l| instructions + l > limit));
                    prop_assert!(last.is_some() || instructions > limit);
                }
                Some(0) if total <= limit => {}
                Some(k) => {
                    prop_assert!(total > limit);
                    prop_assert!(k < turns.len());
                    let kept: usize = turns[k..].iter().sum();
                    prop_assert!(instructions + kept <= limit);
                    let target = ((limit - instructions) as f64 * f64::from(retention)) as usize;
                    prop_assert!(kept <= target || k + 1 == turns.len());
                    if k > 0 {
                        prop_assert!(kept + turns[k - 1] > target);
                    }
                }
            }
        }
    }
}
