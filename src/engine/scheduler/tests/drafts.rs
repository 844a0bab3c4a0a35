//! Which drafts a step runs under a fixed cost model: chances against costs, the step-time
//! target, prompts waiting for prefill.

use super::*;

/// 10 ms a step plus 2 ms a token, no attention term.
struct Fixed;

impl CostModel for Fixed {
    fn predict(&self, s: &StepShape) -> f64 {
        0.010 + 0.002 * s.tokens as f64
    }
    fn observe(&mut self, _: &StepShape, _: f64) {}
}

/// `n` requests decoding (each prefilled and one token sampled), under `Fixed`.
fn running_decodes(n: usize, itl_ms: Option<u64>) -> (Scheduler, Vec<RequestId>) {
    let cfg = SchedulerConfig {
        max_running: 64,
        max_waiting: 64,
        step_tokens: 512,
        itl_target: itl_ms.map(std::time::Duration::from_millis),
        ttft_target: None,
    };
    let mut s = Scheduler::with_cost(cfg, kv_manager(1024, false, (0, 0)), Box::new(Fixed));
    let ids: Vec<RequestId> = (0..n as u64).map(id).collect();
    for r in &ids {
        s.add(*r, vec![3; 8], 100, scope(0)).unwrap();
    }
    step(&mut s);
    (s, ids)
}

/// The drafts each decode keeps after trimming, with `p` for all of `n` decodes proposing
/// four, under the fixed cost model (`Fixed`: 10 ms a step plus 2 ms a token, no attention
/// term).
fn kept(n: usize, p: f64, itl_ms: Option<u64>) -> Vec<usize> {
    let (mut s, ids) = running_decodes(n, itl_ms);
    for id in &ids {
        s.set_drafts(*id, vec![1, 2, 3, 4], p);
    }
    s.trim_drafts(&[]);
    ids.iter()
        .map(|id| s.get(*id).expect("running").drafts.len())
        .collect()
}

#[test]
fn drafts_run_while_their_chance_pays_for_their_cost() {
    // One stream, a 12 ms step: a draft costs 2 ms, so it pays while its chance is at least
    // GAIN (1.25) times the step's tokens over its time times 2 ms: 1.25 * 1/12 * 2 = 0.21 for
    // the first.
    assert_eq!(kept(1, 0.9, None), vec![4]);
    // p = 0.5: chances 0.5, 0.25; the second is not worth it (1.25 * 1.5/14 * 2 = 0.27).
    assert_eq!(kept(1, 0.5, None), vec![1]);
    assert_eq!(kept(1, 0.1, None), vec![0]);
    // Sixteen streams, a 42 ms step: a draft must be kept with chance 1.25 * 16/42 * 2 = 0.95
    // or more: at p = 0.9 none runs; at p = 0.99 four first drafts do, before the step's
    // growing rate (16 + 0.99 m tokens in 42 + 2 m ms) makes the fifth not worth it.
    assert_eq!(kept(16, 0.9, None), vec![0; 16]);
    let certain = kept(16, 0.99, None);
    assert_eq!(certain.iter().sum::<usize>(), 4, "{certain:?}");
    assert!(certain.iter().all(|&k| k <= 1), "{certain:?}");
}

#[test]
fn drafts_keep_the_step_under_its_time_target_and_give_way_to_prompts() {
    // A 20 ms target planned at 80%: 16 ms, so two drafts (10 + 2 + 2 * 2 = 16 ms) where four
    // would pay.
    assert_eq!(kept(1, 0.99, Some(20)), vec![2]);
    // A prompt waiting for prefill: no drafts.
    let (mut s, ids) = running_decodes(1, None);
    s.add(id(99), vec![5; 40], 200, scope(0)).unwrap();
    s.set_drafts(ids[0], vec![1, 2, 3], 0.99);
    s.trim_drafts(&[]);
    assert!(s.get(ids[0]).unwrap().drafts.is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
    /// Random drafts run and kept in part, with prefix caching (so a kept partial block that
    /// was registered is copied, not rewritten), cancels and new requests: after every step the
    /// manager's invariants hold, each request's tokens are exactly what it kept, a request's
    /// next decode starts where its kept tokens end, and everything returns to the pool.
    #[test]
    fn drafts_kept_in_part_leave_exactly_the_kept_tokens(
        ops in proptest::collection::vec((0u8..4, 0usize..6, 0usize..7), 1..80),
    ) {
        let mut s = caching(24, 16, 24);
        let mut next = 0u64;
        // Each request's tokens as the model "kept" them.
        let mut want: std::collections::HashMap<u64, Vec<u32>> = Default::default();
        for (op, a, b) in ops {
            match op {
                0 => {
                    let prompt: Vec<u32> = (0..3 + a as u32).collect();
                    if s.add(id(next), prompt.clone(), 40, scope(0)).is_ok() {
                        want.insert(next, prompt);
                    }
                    next += 1;
                }
                1 => {
                    let r = a as u64 % next.max(1);
                    s.remove(id(r));
                    want.remove(&r);
                }
                _ => {
                    for (&r, _) in want.iter() {
                        s.set_drafts(id(r), (0..a as u32).map(|t| 100 + t).collect(), 1.0);
                    }
                    let Some(out) = s.schedule() else { continue };
                    let drafted: std::collections::HashMap<RequestId, Vec<u32>> =
                        out.drafted.iter().cloned().collect();
                    for d in drafted.values() {
                        prop_assert!(!d.is_empty() && d.len() <= a);
                    }
                    for e in out.entries.iter().filter(|e| e.sample) {
                        let w = want.get_mut(&e.id.0).expect("a live request samples");
                        if let Some(d) = drafted.get(&e.id) {
                            let kept = b.min(d.len());
                            s.resolve_drafts(e.id, kept);
                            w.extend_from_slice(&d[..kept]);
                        }
                        let r = s.get(e.id).expect("running");
                        prop_assert_eq!(r.computed, r.tokens.len(), "only kept tokens are computed");
                        if w.len() >= 30 {
                            s.finish(e.id, lease(e.id.0 % 3));
                            want.remove(&e.id.0);
                        } else {
                            s.append(e.id, 7);
                            w.push(7);
                            prop_assert_eq!(&s.get(e.id).unwrap().tokens, &*w);
                        }
                    }
                    prop_assert!(s.kv().check().is_ok(), "{:?}", s.kv().check());
                }
            }
        }
        for n in 0..next { s.remove(id(n)); }
        for k in 0..3 { s.drop_lease(LeaseKey(k)); }
        prop_assert!(s.kv().check().is_ok());
        prop_assert_eq!(s.kv().pool().used_count(), 0);
    }
}
