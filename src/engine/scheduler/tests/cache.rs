//! Blocks the scheduler asks the KV manager for: prefix sharing, leases across turns and
//! their caps, pinned operator prefixes.

use super::*;

#[test]
fn a_second_sequence_reuses_the_first_ones_full_blocks() {
    let mut s = caching(16, 64, 64);
    let prompt: Vec<u32> = (0..10).collect();
    s.add(id(1), prompt.clone(), 12, scope(7)).unwrap();
    step(&mut s); // prefill 10 tokens: blocks 0-1 full
    step(&mut s); // decode; registers the full blocks
    s.add(id(2), prompt.clone(), 12, scope(7)).unwrap();
    s.add(id(3), prompt.clone(), 12, scope(8)).unwrap(); // another tenant
    let out = step(&mut s);
    // Tenant 8 has nothing running, tenant 7 has request 1: 8 goes first.
    assert_eq!(started(&out), vec![(3, 0), (2, 8)]);
    let b2 = &out.batch.seqs[2];
    assert_eq!(
        (b2.start_pos, b2.tokens.len()),
        (8, 2),
        "only the unshared tail is computed"
    );
    assert_eq!(
        s.get(id(1)).unwrap().blocks.table()[..2],
        s.get(id(2)).unwrap().blocks.table()[..2]
    );
    assert_ne!(
        s.get(id(1)).unwrap().blocks.table()[0],
        s.get(id(3)).unwrap().blocks.table()[0]
    );
    let st = s.stats();
    assert_eq!((st.prefix_queried, st.prefix_hits), (30, 8));
    // Ending request 2 frees only its own blocks; request 1 keeps the shared ones.
    let used = s.kv().pool().used_count();
    s.remove(id(2));
    assert_eq!(s.kv().pool().used_count(), used - 1);
    s.remove(id(1));
    s.remove(id(3));
    assert_eq!(s.kv().pool().used_count(), 0);
    // The prompt's blocks are still cached for the next request.
    s.add(id(4), prompt, 12, scope(7)).unwrap();
    assert_eq!(started(&step(&mut s)), vec![(4, 8)]);
}

#[test]
fn a_lease_keeps_a_conversation_for_the_next_turn_and_hands_it_over() {
    let mut s = caching(16, 64, 64);
    let turn1: Vec<u32> = (0..10).collect();
    s.add(id(1), turn1.clone(), 13, scope(0)).unwrap();
    step(&mut s);
    step(&mut s);
    step(&mut s); // 10 prompt + 3 generated; 12 computed
    s.finish(id(1), lease(42));
    assert_eq!(
        s.kv().held_blocks().leased,
        3,
        "12 computed tokens: 3 full blocks kept"
    );
    assert_eq!(s.kv().pool().used_count(), 3);
    // Turn 2 extends turn 1: it starts from the leased blocks, and the lease is handed over.
    let mut turn2 = s_tokens(&turn1, 3);
    turn2.extend([50, 51, 52]);
    s.add(id(2), turn2, 20, scope(0)).unwrap();
    s.set_lease(id(2), LeaseKey(42), false);
    assert_eq!(started(&step(&mut s)), vec![(2, 12)]);
    assert_eq!(s.kv().held_blocks().leased, 0);
    s.finish(id(2), None);
    s.drop_lease(LeaseKey(42));
    assert_eq!(s.kv().pool().used_count(), 0);
}

#[test]
fn a_lease_keeps_its_partly_filled_block_and_the_next_turn_continues_it() {
    let mut s = caching(16, 64, 64);
    let turn1: Vec<u32> = (0..12).collect();
    s.add(id(1), turn1.clone(), 15, scope(0)).unwrap();
    step(&mut s);
    step(&mut s);
    step(&mut s); // 12 prompt + 3 generated; 14 computed: 3 full blocks and 2 tokens
    s.finish(id(1), lease(42));
    assert_eq!(
        s.kv().held_blocks().leased,
        4,
        "3 full blocks and the partial one"
    );
    assert_eq!(s.kv().pool().used_count(), 4);
    // Turn 2 continues exactly: all 14 computed tokens are reused, the partial block included.
    let mut turn2 = s_tokens(&turn1, 3);
    turn2.extend([50, 51, 52]);
    s.add(id(2), turn2.clone(), 20, scope(0)).unwrap();
    s.set_lease(id(2), LeaseKey(42), false);
    assert_eq!(started(&step(&mut s)), vec![(2, 14)]);
    assert_eq!(s.kv().held_blocks().leased, 0);
    assert_eq!(
        s.kv().pool().used_count(),
        5,
        "the partial block was continued, not copied"
    );
    s.kv().pool().check().unwrap();
    s.finish(id(2), lease(42));
    // Turn 3 diverges inside the partial block (an edited turn): the full blocks are reused
    // and the common slot is copied into a fresh block, and the block the lease held is
    // freed.
    let mut turn3 = turn2[..13].to_vec();
    turn3.extend([90, 91, 92, 93]);
    s.add(id(3), turn3, 20, scope(0)).unwrap();
    s.set_lease(id(3), LeaseKey(42), false);
    let out = step(&mut s);
    assert_eq!(started(&out), vec![(3, 13)]);
    assert_eq!(out.copies.len(), 1);
    assert_eq!(out.copies[0].slots, 1);
    s.finish(id(3), None);
    s.drop_lease(LeaseKey(42));
    assert_eq!(s.kv().pool().used_count(), 0);
    s.kv().pool().check().unwrap();
}

#[test]
fn a_turn_that_waits_a_step_for_room_keeps_its_leased_partial_block() {
    let cfg = SchedulerConfig {
        max_running: 4,
        max_waiting: 4,
        step_tokens: 16,
        itl_target: None,
        ttft_target: None,
    };
    let mut s = new_sched(32, cfg, true, (64, 64));
    let turn1: Vec<u32> = (0..12).collect();
    s.add(id(1), turn1.clone(), 15, scope(0)).unwrap();
    step(&mut s);
    step(&mut s);
    step(&mut s); // 14 computed: 3 full blocks and 2 tokens
    s.finish(id(1), lease(42));
    // A prompt that fills the next step's budget, then turn 2.
    s.add(id(2), (100..140).collect(), 41, scope(1)).unwrap();
    let mut turn2 = s_tokens(&turn1, 3);
    turn2.extend([50, 51, 52]);
    s.add(id(3), turn2, 20, scope(0)).unwrap();
    s.set_lease(id(3), LeaseKey(42), false);
    assert_eq!(started(&step(&mut s)), vec![(2, 0)]);
    assert_eq!(s.kv().held_blocks().leased, 4, "the lease is still whole");
    // Request 2 has more than a step left: turn 2, short by what it needs to prefill (4 tokens
    // past its cached 14), goes ahead of its next chunk, from all 14 tokens.
    assert_eq!(started(&step(&mut s)), vec![(3, 14)]);
    s.kv().check().unwrap();
}

/// Turn 1's tokens as the scheduler generated them in the test above (7 sampled thrice).
fn s_tokens(prompt: &[u32], generated: usize) -> Vec<u32> {
    let mut t = prompt.to_vec();
    t.extend(std::iter::repeat_n(7, generated));
    t
}

#[test]
fn leases_are_capped_and_dropped_before_anything_is_preempted() {
    // Per-session cap: 8 tokens = 2 blocks.
    let mut s = caching(8, 8, 8);
    s.add(id(1), (0..12).collect(), 13, scope(0)).unwrap();
    step(&mut s);
    s.finish(id(1), lease(1));
    assert_eq!(s.kv().held_blocks().leased, 2);
    // A second lease pushes the total over 8 tokens: the oldest goes.
    s.add(id(2), (100..112).collect(), 13, scope(0)).unwrap();
    step(&mut s);
    s.finish(id(2), lease(2));
    assert_eq!(s.kv().held_blocks().leased, 2);
    // A request needing the whole pool drops the lease instead of failing.
    s.add(id(3), (200..231).collect(), 32, scope(0)).unwrap();
    let out = step(&mut s);
    assert_eq!(entries(&out), vec![(3, true)]);
    assert!(out.preempted.is_empty());
    assert_eq!(s.kv().held_blocks().leased, 0);
}

#[test]
fn pinned_prefixes_are_prefilled_once_and_kept() {
    let mut s = caching(16, 0, 0);
    let sys: Vec<u32> = (0..9).collect();
    s.add_pinned(id(99), sys.clone(), crate::kv_cache::Salt(5));
    let out = s.schedule().unwrap();
    assert_eq!(
        entries(&out),
        vec![(99, false)],
        "no token is sampled for a pin"
    );
    assert!(s.schedule().is_none());
    assert_eq!(
        s.kv().held_blocks().pinned,
        3,
        "two full blocks kept, and the partly filled one"
    );
    let mut prompt = sys.clone();
    prompt.extend([40, 41]);
    s.add(id(1), prompt.clone(), 14, scope(5)).unwrap();
    let out = step(&mut s);
    // The pin's partly filled block is copied into a fresh one: all 9 tokens are cached.
    assert_eq!(started(&out), vec![(1, 9)]);
    let table = &out.batch.seqs[0].block_table;
    assert_eq!(out.copies.len(), 1);
    assert_eq!(out.copies[0].dst, table[2]);
    assert_eq!(out.copies[0].slots, 1);
    assert_eq!(out.batch.seqs[0].tokens, vec![40, 41]);
    // A prompt that leaves the pin inside its last block, or another tenant, copies nothing.
    s.finish(id(1), None);
    let mut other = sys[..8].to_vec();
    other.extend([50, 51, 52]);
    s.add(id(2), other, 14, scope(5)).unwrap();
    let out = step(&mut s);
    assert_eq!((started(&out), out.copies.len()), (vec![(2, 8)], 0));
    s.finish(id(2), None);
    s.add(id(3), prompt, 14, scope(6)).unwrap();
    let out = step(&mut s);
    assert_eq!((started(&out), out.copies.len()), (vec![(3, 0)], 0));
}

#[test]
fn principals_share_the_pinned_prefix_and_nothing_they_sent() {
    let mut s = caching(32, 0, 0);
    let tenant = Salt(5);
    let sys: Vec<u32> = (0..9).collect(); // two full blocks of operator text, then one token
    s.add_pinned(id(99), sys.clone(), tenant);
    s.schedule().unwrap();
    let scope = |p| CacheScope {
        tenant,
        principal: Salt(p),
        shared_tokens: sys.len(),
    };
    let mut prompt = sys.clone();
    prompt.extend(40..60); // 29 tokens: 7 full blocks
    s.add(id(1), prompt.clone(), 30, scope(1)).unwrap();
    assert_eq!(started(&step(&mut s)), vec![(1, 9)], "the pin is shared");
    step(&mut s); // registers request 1's full blocks
    s.finish(id(1), None);
    // Another principal, the same text: only the operator blocks.
    s.add(id(2), prompt.clone(), 30, scope(2)).unwrap();
    assert_eq!(started(&step(&mut s)), vec![(2, 9)]);
    s.finish(id(2), None);
    // The same principal again: its own blocks too (all but the last token's).
    s.add(id(3), prompt.clone(), 30, scope(1)).unwrap();
    assert_eq!(started(&step(&mut s)), vec![(3, 28)]);
    s.finish(id(3), None);
    assert_eq!(s.kv().pool().used_count(), s.kv().held_blocks().pinned);
}
