//! The step-time policy under a fixed cost model: chunks sized to the target, chat turns ahead
//! of long prefills, drafts taking only what the target leaves, paused replies, missed targets.

use super::*;

/// A cost model that knows the machine: 1 ms a token, 1 us per attended position.
struct FixedCost;

impl CostModel for FixedCost {
    fn predict(&self, s: &StepShape) -> f64 {
        0.001 * s.tokens as f64 + 1e-6 * s.attention
    }
    fn observe(&mut self, _: &StepShape, _: f64) {}
}

fn timed(blocks: usize, step_tokens: usize, target_ms: u64, max_running: usize) -> Scheduler {
    let cfg = SchedulerConfig {
        max_running,
        max_waiting: 64,
        step_tokens,
        itl_target: Some(std::time::Duration::from_millis(target_ms)),
        ttft_target: None,
    };
    Scheduler::with_cost(cfg, kv_manager(blocks, false, (0, 0)), Box::new(FixedCost))
}

#[test]
fn the_planning_margin_covers_all_but_the_slowest_steps_of_the_target_size() {
    let mut s = timed(64, 512, 100, 4);
    // 40 ms predicted: half the planned 80 ms step.
    let shape = StepShape::default().with_run(0, 40);
    let predicted = FixedCost.predict(&shape);
    for _ in 0..7 {
        s.observe_step(&shape, 2.0 * predicted);
    }
    assert_eq!(s.safety(), 1.0, "too few steps to judge");
    // A full window: three steps in 64 ran 1.3x their prediction, one 1.6x; the rest on time.
    for i in 0..ERROR_WINDOW {
        let slow = match i {
            10 | 30 | 40 => 1.3,
            25 => 1.6,
            _ => 1.0,
        };
        s.observe_step(&shape, slow * predicted);
    }
    assert!((s.safety() - 1.3).abs() < 1e-9, "{}", s.safety());
    // Two slow steps in the window set no margin of their own.
    for i in 0..ERROR_WINDOW {
        let slow = if i % 32 == 5 { 1.6 } else { 1.0 };
        s.observe_step(&shape, slow * predicted);
    }
    assert!((s.safety() - 1.0).abs() < 1e-9, "{}", s.safety());
    // Steps far under the target (10 ms of a planned 80) do not count, however late.
    let small = StepShape::default().with_run(0, 10);
    for _ in 0..ERROR_WINDOW {
        s.observe_step(&small, 3.0 * FixedCost.predict(&small));
    }
    assert!((s.safety() - 1.0).abs() < 1e-9, "{}", s.safety());
}

#[test]
fn while_a_reply_streams_a_long_prompt_takes_chunks_that_shrink_as_its_context_grows() {
    let mut s = timed(2048, 512, 50, 4);
    s.add(id(1), vec![1; 8], 4000, scope(0)).unwrap();
    step(&mut s); // request 1 prefills, then decodes every step
    s.add(id(2), vec![2; 3000], 3001, scope(0)).unwrap();
    let mut chunks = Vec::new();
    while s.get(id(2)).is_some_and(|r| r.computed < 3000) {
        let out = step(&mut s);
        assert_eq!(
            out.entries[0],
            Entry {
                id: id(1),
                sample: true
            },
            "the decode comes first"
        );
        assert!(
            FixedCost.predict(&out.shape) <= 0.050 + 1e-9,
            "{:?}",
            out.shape
        );
        chunks.push(out.batch.seqs[1].tokens.len());
    }
    assert!(chunks.windows(2).all(|w| w[1] <= w[0]), "{chunks:?}");
    assert!(chunks[0] > 3 * chunks[chunks.len() - 2], "{chunks:?}");
    assert_eq!(s.stats().itl_misses, 0);
}

#[test]
fn a_chat_turn_goes_ahead_of_a_long_prompt_still_prefilling() {
    // No time target: the long prompt takes whole token budgets; a short prompt arriving
    // while it prefills goes into the next step first, whole, and the long one takes the
    // rest of the budget, in order.
    let mut s = sched(4096, 4, 64);
    s.add(id(1), vec![1; 1000], 1001, scope(0)).unwrap();
    assert_eq!(entries(&step(&mut s)), [(1, false)]);
    s.add(id(2), vec![2; 20], 40, scope(1)).unwrap();
    let out = step(&mut s);
    assert_eq!(entries(&out), [(2, true), (1, false)]);
    let lens: Vec<usize> = out.batch.seqs.iter().map(|q| q.tokens.len()).collect();
    assert_eq!(lens, [20, 44]);
    // It decodes from then on beside the long prefill; a prompt longer than a step's budget
    // waits its turn behind the running one, as before.
    s.add(id(3), vec![3; 100], 101, scope(2)).unwrap();
    let out = step(&mut s);
    assert_eq!(entries(&out), [(2, true), (1, false)]);
    assert_eq!(out.batch.num_tokens(), 64);
    // A second long prompt queued ahead does not hold a short one back.
    let mut s = sched(4096, 4, 64);
    s.add(id(1), vec![1; 1000], 1001, scope(0)).unwrap();
    step(&mut s);
    s.add(id(2), vec![2; 1000], 1001, scope(1)).unwrap();
    s.add(id(3), vec![3; 20], 40, scope(2)).unwrap();
    assert_eq!(entries(&step(&mut s)), [(3, true), (1, false)]);
    // With no long prompt running, arrival order holds.
    let mut s = sched(4096, 4, 64);
    s.add(id(1), vec![1; 60], 61, scope(0)).unwrap();
    s.add(id(2), vec![2; 20], 40, scope(1)).unwrap();
    assert_eq!(entries(&step(&mut s)), [(1, true), (2, false)]);
}

#[test]
fn beside_decodes_a_chat_turn_goes_whole_ahead_of_a_long_prefill_cut_to_the_target() {
    let mut s = timed(4096, 512, 50, 8);
    s.add(id(1), vec![1; 8], 4000, scope(0)).unwrap();
    step(&mut s); // request 1 decodes every step from here
    s.add(id(2), vec![2; 3000], 3001, scope(1)).unwrap();
    step(&mut s);
    s.add(id(3), vec![3; 200], 201, scope(2)).unwrap();
    let out = step(&mut s);
    assert_eq!(out.entries[0].id, id(1), "the decode first");
    assert_eq!(
        out.entries[1],
        Entry {
            id: id(3),
            sample: true
        }
    );
    assert_eq!(out.batch.seqs[1].tokens.len(), 200, "the turn goes whole");
    assert_eq!(started(&out), [(3, 0)]);
}

#[test]
fn a_chat_turn_cut_beside_a_long_prefill_is_not_starved_by_it() {
    // A long prompt deep into its prefill (a token there costs ~3 ms: its attention), 22
    // replies decoding (~22 ms of the 40 ms plan). Two turns arrive: the first goes whole
    // (~16 ms), which leaves the long prompt no token; the second is admitted with the
    // sliver left, cut. From then on the turn's rest must go before the long prefill's
    // chunk, cut to the target every step: admitted after it, it used to wait out the
    // whole long prefill.
    let mut s = timed(16384, 512, 50, 64);
    s.add(id(1), vec![1; 20000], 20001, scope(0)).unwrap();
    for _ in 0..4 {
        step(&mut s);
    }
    for i in 10..32 {
        s.add(id(i), vec![2; 4], 10_000, scope(i)).unwrap();
    }
    while (10..32).any(|i| s.get(id(i)).is_none_or(|r| r.computed < 4)) {
        step(&mut s);
    }
    assert!(s.get(id(1)).unwrap().computed >= 2000);
    s.add(id(100), vec![3; 16], 1000, scope(100)).unwrap();
    s.add(id(101), vec![4; 16], 1000, scope(101)).unwrap();
    let out = step(&mut s);
    let first = out.entries.iter().find(|e| e.id == id(100));
    assert!(first.unwrap().sample, "the first turn goes whole");
    let cut = s.get(id(101)).unwrap();
    assert!(
        cut.started && cut.computed > 0 && cut.computed < 16,
        "the second turn is admitted cut: {} of 16",
        cut.computed
    );
    let mut steps = 0;
    while s.get(id(101)).unwrap().computed < 16 {
        let out = step(&mut s);
        steps += 1;
        assert!(steps <= 2, "the turn's rest within two steps");
        let order: Vec<u64> = (out.entries.iter())
            .filter(|e| e.id == id(1) || e.id == id(101))
            .map(|e| e.id.0)
            .collect();
        assert_eq!(
            order.first(),
            Some(&101),
            "the turn's rest first: {order:?}"
        );
    }
    // The long prompt goes on in what the turns leave.
    let before = s.get(id(1)).unwrap().computed;
    step(&mut s);
    assert!(s.get(id(1)).unwrap().computed > before);
}

#[test]
fn chat_turns_arriving_together_beside_a_long_prefill_all_start_within_two_steps() {
    // Four replies decode (~4 ms of the 40 ms plan) beside a long prefill; four 16-token
    // turns arrive at once (~16 ms each). One a step would start the last in the fourth
    // step; as many as the target leaves room for start at once, the last one cut.
    let mut s = timed(16384, 512, 50, 64);
    s.add(id(1), vec![1; 8000], 8001, scope(0)).unwrap();
    step(&mut s);
    for i in 10..14 {
        s.add(id(i), vec![2; 4], 10_000, scope(i)).unwrap();
    }
    while (10..14).any(|i| s.get(id(i)).is_none_or(|r| r.computed < 4)) {
        step(&mut s);
    }
    for i in 100..104 {
        s.add(id(i), vec![3; 16], 1000, scope(i)).unwrap();
    }
    let first = step(&mut s);
    let turns: Vec<(u64, usize)> = (first.entries.iter().zip(&first.batch.seqs))
        .filter(|(e, _)| e.id.0 >= 100)
        .map(|(e, q)| (e.id.0, q.tokens.len()))
        .collect();
    assert!(turns.len() >= 3, "at least three start at once: {turns:?}");
    assert_eq!(turns[..2], [(100, 16), (101, 16)], "{turns:?}");
    step(&mut s);
    for i in 100..104 {
        let r = s.get(id(i)).unwrap();
        assert!(r.started, "turn {i} started within two steps");
    }
    assert!(s.get(id(1)).unwrap().computed < 8000);
}

#[test]
fn with_nothing_decoding_a_prompt_takes_the_whole_token_budget() {
    let mut s = timed(2048, 512, 50, 4);
    s.add(id(1), vec![1; 3000], 3001, scope(0)).unwrap();
    let out = step(&mut s);
    assert_eq!(out.batch.num_tokens(), 512);
    assert_eq!(s.stats().itl_misses, 0);
}

#[test]
fn beside_decodes_one_short_prompt_a_step_goes_whole_and_the_rest_fit_the_target() {
    // 20 decodes are predicted at about 20 ms; the 50 ms target plans for 40.
    let mut s = timed(4096, 512, 50, 64);
    for i in 0..20 {
        s.add(id(i), vec![1; 4], 100, scope(0)).unwrap();
    }
    step(&mut s);
    for i in 100..103 {
        s.add(id(i), vec![2; 16], 20, scope(0)).unwrap();
    }
    let out = step(&mut s);
    let prompts: Vec<usize> = out.batch.seqs[20..]
        .iter()
        .map(|q| q.tokens.len())
        .collect();
    assert_eq!(prompts[0], 16, "the first goes whole: {prompts:?}");
    assert!(prompts.iter().skip(1).all(|&n| n < 16), "{prompts:?}");
    assert!(
        FixedCost.predict(&out.shape) <= 0.040 + 1e-9,
        "{:?}",
        out.shape
    );
    assert_eq!(s.stats().itl_misses, 0);
    // Next step: the second one's rest (cut to the target) does not take the place of the
    // step's first new request: the third goes whole.
    let out = step(&mut s);
    let third = out.entries.iter().position(|e| e.id == id(102)).unwrap();
    assert_eq!(out.batch.seqs[third].tokens.len(), 16);
    let mut steps = 2;
    while (100..103).any(|i| s.get(id(i)).is_some_and(|r| r.computed < 16)) {
        step(&mut s);
        steps += 1;
        assert!(steps <= 3, "all three prompts within three steps");
    }
    // (The second step, with the rest of the second prompt fitted to the target and the
    // third whole on top, may overrun it: that is the one exemption's price.)
    assert!(s.stats().itl_misses <= 1);
}

#[test]
fn a_prefill_only_request_takes_only_what_the_target_leaves_and_reports_when_computed() {
    let mut s = timed(4096, 512, 50, 64);
    // 45 decodes are predicted over the 40 ms plan: nothing is left for a draft, not even
    // the smallest chunk an interactive prompt would get.
    for i in 0..45 {
        s.add(id(i), vec![1; 4], 100, scope(0)).unwrap();
    }
    step(&mut s);
    s.add(id(99), vec![2; 64], 64, scope(0)).unwrap();
    s.set_priority(id(99), Priority::Batch);
    s.set_prefill_only(id(99));
    let out = step(&mut s);
    assert_eq!(out.batch.seqs.len(), 45);
    assert!(out.prefilled.is_empty());
    // Beside 20 decodes (about 20 ms) it adds at most a tenth to each step, however much
    // the 40 ms plan would allow.
    for i in 0..25 {
        s.finish(id(i), None);
    }
    let mut chunks = Vec::new();
    for _ in 0..5 {
        let out = step(&mut s);
        let k = out.entries.iter().position(|e| e.id == id(99)).unwrap();
        assert!(!out.entries[k].sample, "a draft samples nothing");
        chunks.push(out.batch.seqs[k].tokens.len());
        let decodes = FixedCost.predict(&out.shape) - 0.001 * chunks[chunks.len() - 1] as f64;
        assert!(
            FixedCost.predict(&out.shape) <= decodes * 1.1 + 1e-3,
            "{:?}",
            out.shape
        );
    }
    assert!(chunks.iter().all(|&n| (1..=3).contains(&n)), "{chunks:?}");
    // With the decodes done it takes the rest at once; the last chunk samples nothing and
    // is reported.
    for i in 25..45 {
        s.finish(id(i), None);
    }
    let out = step(&mut s);
    assert_eq!(out.prefilled, vec![id(99)]);
    assert_eq!(
        out.entries,
        vec![Entry {
            id: id(99),
            sample: false
        }]
    );
    assert_eq!(s.get(id(99)).unwrap().computed, 64);
    s.finish(id(99), None);
    assert_eq!(
        s.stats().itl_misses,
        1,
        "only the step the decodes alone overran"
    );
}

#[test]
fn a_paused_reply_gives_its_slot_to_a_waiting_request_and_comes_back_when_unpaused() {
    let mut s = sched(64, 1, 64);
    s.add(id(1), vec![1; 8], 40, scope(0)).unwrap();
    step(&mut s);
    s.set_paused(id(1), true);
    assert!(
        s.schedule().is_none(),
        "a paused reply alone does not decode"
    );
    s.add(id(2), vec![2; 8], 16, scope(1)).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.preempted, vec![id(1)]);
    assert_eq!(started(&out), vec![(2, 0)]);
    // Still paused, it stays queued; acked, it comes back when a slot frees.
    s.finish(id(2), None);
    assert!(s.schedule().is_none());
    s.set_paused(id(1), false);
    let out = s.schedule().unwrap();
    assert_eq!(
        out.entries,
        vec![Entry {
            id: id(1),
            sample: true
        }]
    );
    assert_eq!(
        s.get(id(1)).unwrap().computed,
        9,
        "recomputed, then decoding"
    );
}

#[test]
fn decodes_always_run_and_a_missed_target_is_counted() {
    // 60 decodes alone are predicted at 60 ms, over the 50 ms target.
    let mut s = timed(4096, 512, 50, 64);
    for i in 0..60 {
        s.add(id(i), vec![1; 4], 100, scope(0)).unwrap();
    }
    step(&mut s);
    s.add(id(99), vec![2; 1000], 1001, scope(0)).unwrap();
    let out = step(&mut s);
    assert_eq!(out.entries.iter().filter(|e| e.sample).count(), 60);
    assert_eq!(
        out.batch.seqs[60].tokens.len(),
        MIN_CHUNK,
        "the prompt still progresses"
    );
    assert_eq!(s.stats().itl_misses, 1);
}

#[test]
fn a_turn_of_the_streams_tenant_is_not_kept_waiting_behind_its_long_prompt() {
    // The mixed workload's shape: keyless streams (one tenant, a principal each) decoding, a
    // long prompt of the same tenant prefilling deep into its context in chunks cut to the
    // target, and a stream's next turn arriving, early in the long prefill and in its last
    // step's budget of tokens (which, cut to the target deep in the context, took 35 steps
    // there: counted as a short prompt by what it had left, the tail went first and held
    // every new turn back).
    let shared = |p: u64| CacheScope {
        tenant: Salt(0),
        principal: Salt(p),
        shared_tokens: 0,
    };
    let mut s = timed(8192, 256, 100, 32);
    for p in 1..=7 {
        s.add(id(p), vec![p as u32; 40], 4000, shared(p)).unwrap();
    }
    step(&mut s);
    s.add(id(99), vec![9; 6000], 6001, shared(99)).unwrap();
    for (turn, at) in [(8, 4000), (9, 6000 - 200)] {
        while s.get(id(99)).is_some_and(|r| r.computed < at) {
            step(&mut s);
        }
        s.add(id(turn), vec![8; 60], 200, shared(turn)).unwrap();
        let out = step(&mut s);
        assert!(
            out.entries.iter().any(|e| e.id == id(turn)),
            "the turn at {at} waits: {:?}",
            entries(&out)
        );
        assert!(
            out.entries.iter().any(|e| e.id == id(99)),
            "the long prompt goes on"
        );
    }
}
