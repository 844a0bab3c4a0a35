//! The scheduler's tests: hand-built steps with exact orders, a fixed cost model for the
//! step-time policy, and seeded proptests of the invariants. This file holds the helpers, the
//! step recipe's own tests and the invariants; `fairness`, `cache` and `budget` the rest.

use super::*;
use crate::engine::cost::StepShape;
use crate::kv_cache::manager::{KvConfig, LeaseKey};
use crate::kv_cache::BlockPool;
use crate::kv_cache::CacheScope;
use proptest::prelude::*;

mod budget;
mod cache;
mod deadline;
mod drafts;
mod fairness;

/// One partition for every block (these tests are about scheduling, not principals).
fn scope(salt: u64) -> CacheScope {
    CacheScope::private(Salt(salt))
}

/// A scheduler over `blocks` blocks of 4 tokens; `caching`: prefix caching with leases of
/// `lease` tokens per session and in all.
fn new_sched(
    blocks: usize,
    cfg: SchedulerConfig,
    caching: bool,
    lease: (usize, usize),
) -> Scheduler {
    Scheduler::new(cfg, kv_manager(blocks, caching, lease))
}

/// The KV manager of `new_sched`.
fn kv_manager(blocks: usize, caching: bool, lease: (usize, usize)) -> KvManager {
    let kv = KvConfig {
        block_size: 4,
        prefix_caching: caching,
        lease_tokens_per_session: lease.0,
        lease_tokens_total: lease.1,
        context_shift: false,
    };
    KvManager::new(kv, BlockPool::new(blocks))
}

fn caching(blocks: usize, lease_per_session: usize, lease_total: usize) -> Scheduler {
    let cfg = SchedulerConfig {
        max_running: 4,
        max_waiting: 4,
        step_tokens: 64,
        itl_target: None,
        ttft_target: None,
    };
    new_sched(blocks, cfg, true, (lease_per_session, lease_total))
}

fn sched(blocks: usize, max_running: usize, step_tokens: usize) -> Scheduler {
    let cfg = SchedulerConfig {
        max_running,
        max_waiting: 4,
        step_tokens,
        itl_target: None,
        ttft_target: None,
    };
    new_sched(blocks, cfg, false, (0, 0))
}

fn id(n: u64) -> RequestId {
    RequestId(n)
}

fn lease(n: u64) -> Option<LeaseKey> {
    Some(LeaseKey(n))
}

/// A step's entries as (request, sampled).
fn entries(out: &Scheduled) -> Vec<(u64, bool)> {
    out.entries.iter().map(|e| (e.id.0, e.sample)).collect()
}

/// A step's started requests as (request, cached tokens).
fn started(out: &Scheduled) -> Vec<(u64, usize)> {
    out.started
        .iter()
        .map(|s| (s.id.0, s.cached_tokens))
        .collect()
}

/// Runs a step and feeds back a token for every sampled entry.
fn step(s: &mut Scheduler) -> Scheduled {
    let out = s.schedule().expect("work");
    for e in &out.entries {
        if e.sample {
            s.append(e.id, 7);
        }
    }
    out
}

#[test]
fn decodes_first_then_prefill_chunks_within_budget() {
    let mut s = sched(32, 4, 8);
    s.add(id(1), vec![1; 5], 20, scope(0)).unwrap();
    let a = step(&mut s);
    assert_eq!(entries(&a), vec![(1, true)]);
    assert_eq!(started(&a), vec![(1, 0)]);
    s.add(id(2), vec![2; 20], 30, scope(0)).unwrap();
    let b = step(&mut s);
    // Request 1 decodes (1 token), request 2 prefills 7 tokens (budget 8).
    assert_eq!(entries(&b), vec![(1, true), (2, false)]);
    assert_eq!(b.batch.seqs[1].tokens.len(), 7);
    let c = step(&mut s);
    assert_eq!(c.batch.seqs[1].start_pos, 7);
    assert_eq!(c.batch.num_tokens(), 8);
}

#[test]
fn drafts_run_after_the_last_token_and_only_the_kept_ones_stay() {
    let mut s = caching(16, 0, 0);
    s.add(id(1), vec![1, 2, 3, 4, 5], 40, scope(0)).unwrap();
    s.add(id(2), vec![9; 3], 40, scope(0)).unwrap();
    step(&mut s); // both prefill and sample a token: 6 and 4 tokens, 5 and 3 computed
    s.set_drafts(id(1), vec![20, 21, 22], 1.0);
    // Drafts for a request that does not decode this step are dropped with it.
    s.set_paused(id(2), true);
    s.set_drafts(id(2), vec![30], 1.0);
    let out = s.schedule().expect("work");
    assert_eq!(entries(&out), vec![(1, true)]);
    assert_eq!(out.batch.seqs[0].tokens, vec![7, 20, 21, 22]);
    assert_eq!(out.batch.seqs[0].start_pos, 5);
    assert_eq!(out.batch.seqs[0].logits, Logits::Decode);
    assert_eq!(out.drafted, vec![(id(1), vec![20, 21, 22])]);
    assert_eq!(
        s.kv().pool().used_count(),
        3 + 1,
        "9 slots: 3 blocks, and request 2's"
    );
    // The model kept one draft: its tokens gain it, the rest of the K/V is dropped.
    s.resolve_drafts(id(1), 1);
    let r = s.get(id(1)).unwrap();
    assert_eq!((r.tokens.len(), r.computed), (7, 7));
    assert_eq!(&r.tokens[5..], &[7, 20]);
    assert_eq!(s.kv().pool().used_count(), 2 + 1);
    s.append(id(1), 40);
    s.set_paused(id(2), false);
    let next = s.schedule().expect("work");
    assert_eq!(next.batch.seqs[0].tokens, vec![40]);
    assert_eq!(next.batch.seqs[0].start_pos, 7);
    assert!(next.drafted.is_empty());
    let stats = s.stats();
    assert_eq!((stats.drafted_tokens, stats.accepted_tokens), (3, 1));
    s.kv().check().unwrap();
}

#[test]
fn queue_bound_and_size_bound() {
    let mut s = sched(4, 1, 8);
    assert_eq!(
        s.add(id(9), vec![1; 3], 17, scope(0)),
        Err(AddError::TooLarge {
            tokens: 17,
            cache_tokens: 16
        })
    );
    for i in 0..4 {
        assert_eq!(s.add(id(i), vec![1; 3], 4, scope(0)), Ok(i as usize));
    }
    assert_eq!(
        s.add(id(5), vec![1], 4, scope(0)),
        Err(AddError::Overloaded { waiting: 4 })
    );
}

#[test]
fn max_running_holds_the_rest_in_the_queue() {
    let mut s = sched(32, 2, 64);
    for i in 0..3 {
        s.add(id(i), vec![1; 4], 8, scope(0)).unwrap();
    }
    let a = step(&mut s);
    assert_eq!(a.entries.len(), 2);
    assert_eq!(s.waiting_len(), 1);
    s.remove(id(0));
    let b = step(&mut s);
    assert!(entries(&b).contains(&(2, true)));
}

#[test]
fn preempts_the_most_recently_admitted_and_recomputes_it() {
    // 4 blocks of 4 tokens. Two sequences of 8 tokens fill the cache.
    let mut s = sched(4, 4, 64);
    s.add(id(1), vec![1; 7], 16, scope(0)).unwrap();
    s.add(id(2), vec![2; 7], 16, scope(0)).unwrap();
    step(&mut s); // both prefill 7, sample 1 token each -> 8 tokens, 2 blocks each
    step(&mut s); // decode: 8 computed, 9th token pending; needs a 3rd block each: none free
    let c = s.schedule().unwrap();
    assert_eq!(
        c.preempted,
        vec![id(2)],
        "the newest goes back to the queue"
    );
    assert_eq!(entries(&c), vec![(1, true)]);
    assert_eq!(s.waiting_len(), 1);
    let back = s.get(id(2)).unwrap();
    assert_eq!(back.computed, 0);
    assert_eq!(
        back.tokens.len(),
        9,
        "its generated tokens are kept and recomputed"
    );
    assert_eq!(s.stats().preemptions, 1);
}

#[test]
fn cancel_frees_blocks_in_any_phase() {
    let mut s = sched(16, 4, 4);
    s.add(id(1), vec![1; 10], 12, scope(0)).unwrap();
    step(&mut s); // mid-prefill: 4 of 10
    assert!(s.kv().pool().used_count() > 0);
    s.remove(id(1));
    assert_eq!(s.kv().pool().used_count(), 0);
    assert!(s.remove(id(1)).is_none());
    assert!(s.is_idle());
}

#[test]
fn batch_requests_take_what_interactive_ones_leave() {
    let mut s = sched(64, 1, 64);
    s.add(id(1), vec![1; 8], 16, scope(0)).unwrap();
    s.set_priority(id(1), Priority::Batch);
    s.add(id(2), vec![2; 8], 16, scope(0)).unwrap();
    // One may run: the interactive one, though it came second.
    assert_eq!(started(&step(&mut s)), vec![(2, 0)]);
    s.finish(id(2), None);
    assert_eq!(started(&step(&mut s)), vec![(1, 0)]);
    // With room for both, the batch prompt is prefilled after the interactive one.
    let mut s = sched(64, 2, 64);
    s.add(id(1), vec![1; 8], 16, scope(0)).unwrap();
    s.set_priority(id(1), Priority::Batch);
    s.add(id(2), vec![2; 8], 16, scope(0)).unwrap();
    assert_eq!(entries(&step(&mut s)), vec![(2, true), (1, true)]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
    /// Random adds (drafts among them), steps, pauses and cancels never hand out a block
    /// twice, never exceed the budget, never decode a paused request, and always end with
    /// the pool idle.
    #[test]
    fn random_workloads_return_to_idle(ops in proptest::collection::vec((0u8..5, 1usize..14, 1usize..10), 1..80), caching in any::<bool>()) {
        let cfg = SchedulerConfig { max_running: 3, max_waiting: 4, step_tokens: 6, itl_target: None, ttft_target: None };
        let mut s = new_sched(12, cfg, caching, (16, 24));
        let mut next = 0u64;
        let mut gen: std::collections::HashMap<u64, (usize, usize)> = Default::default();
        let mut paused = std::collections::HashSet::new();
        for (op, a, b) in ops {
            match op {
                0 => {
                    if s.add(id(next), vec![3; a], a + b, scope(next % 2)).is_ok() {
                        gen.insert(next, (0, b));
                    }
                    next += 1;
                }
                1 => { s.remove(id((a as u64) % next.max(1))); }
                2 => {
                    let r = (a as u64) % next.max(1);
                    // (Only a request that exists is paused.)
                    if s.get(id(r)).is_some() {
                        s.set_paused(id(r), b % 2 == 0);
                        if b % 2 == 0 { paused.insert(r); } else { paused.remove(&r); }
                    }
                }
                3 => {
                    // A draft: prefill only, with what the rest leave.
                    if s.add(id(next), vec![4; a], a, scope(next % 2)).is_ok() {
                        s.set_priority(id(next), Priority::Batch);
                        s.set_prefill_only(id(next));
                        s.set_lease(id(next), LeaseKey(next % 3), false);
                    }
                    next += 1;
                }
                _ => {
                    if let Some(out) = s.schedule() {
                        // Decodes (at most max_running = 3) never exceed the budget here.
                        prop_assert!(out.batch.num_tokens() <= 6);
                        let mut seen = std::collections::HashSet::new();
                        for c in &out.batch.seqs {
                            let first = c.start_pos / 4;
                            let last = (c.start_pos + c.tokens.len()).div_ceil(4);
                            for blk in &c.block_table[first..last] {
                                prop_assert!(seen.insert(*blk), "block written twice");
                            }
                        }
                        for e in out.entries.iter().filter(|e| e.sample) {
                            // Its prompt's last chunk samples the first token; after that
                            // a paused request does not decode.
                            prop_assert!(!paused.contains(&e.id.0) || gen[&e.id.0].0 == 0, "a paused request decoded");
                        }
                        for &p in &out.prefilled {
                            prop_assert!(!out.entries.iter().any(|e| e.id == p && e.sample));
                            s.finish(p, lease(p.0 % 3));
                        }
                        for e in &out.entries {
                            if e.sample {
                                let g = gen.get_mut(&e.id.0).unwrap();
                                g.0 += 1;
                                if g.0 >= g.1 { s.finish(e.id, lease(e.id.0 % 3)); } else { s.append(e.id, 5); }
                            }
                        }
                        prop_assert!(s.kv().check().is_ok(), "{:?}", s.kv().check());
                    }
                }
            }
        }
        for n in 0..next { s.remove(id(n)); }
        for k in 0..3 { s.drop_lease(LeaseKey(k)); }
        prop_assert!(s.kv().check().is_ok());
        prop_assert_eq!(s.kv().pool().used_count(), 0);
        prop_assert!(s.is_idle());
    }
}
