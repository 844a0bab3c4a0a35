//! Stop strings over streamed text: what can be sent now, and whether a stop string matched.
//! Text that could still turn into a stop string is held back until it cannot. Pure code.

/// The result of scanning the unsent tail of a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scan {
    /// Bytes of the tail that may be sent.
    pub send: usize,
    /// A stop string starts at `send`: the reply ends there.
    pub stopped: bool,
}

/// Scans `tail` (text not yet sent) for `stops`.
pub fn scan(tail: &str, stops: &[String]) -> Scan {
    let first = stops.iter().filter_map(|s| tail.find(s.as_str())).min();
    if let Some(p) = first {
        return Scan {
            send: p,
            stopped: true,
        };
    }
    // Hold back the longest suffix that is a proper prefix of some stop string.
    let mut hold = 0;
    for s in stops {
        for (i, _) in tail.char_indices() {
            let suffix = &tail[i..];
            if suffix.len() > hold && s.len() > suffix.len() && s.starts_with(suffix) {
                hold = suffix.len();
            }
        }
    }
    Scan {
        send: tail.len() - hold,
        stopped: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn sends_everything_without_stops() {
        assert_eq!(
            scan("hello", &[]),
            Scan {
                send: 5,
                stopped: false
            }
        );
    }

    #[test]
    fn finds_the_earliest_stop() {
        assert_eq!(
            scan("abc\n\nUser: x END", &stops(&["END", "User:"])),
            Scan {
                send: 5,
                stopped: true
            }
        );
    }

    #[test]
    fn holds_back_a_possible_start_of_a_stop() {
        assert_eq!(
            scan("hello Us", &stops(&["User:"])),
            Scan {
                send: 6,
                stopped: false
            }
        );
        assert_eq!(
            scan("hello U", &stops(&["User:"])),
            Scan {
                send: 6,
                stopped: false
            }
        );
        assert_eq!(
            scan("hello", &stops(&["User:"])),
            Scan {
                send: 5,
                stopped: false
            }
        );
        // Multi-byte characters are never split.
        assert_eq!(
            scan("날씨", &stops(&["씨앗"])),
            Scan {
                send: 3,
                stopped: false
            }
        );
    }
}
