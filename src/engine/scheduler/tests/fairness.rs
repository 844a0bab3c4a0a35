//! Between tenants: turns for free slots, a newcomer taking a slot, over-share holds,
//! principals within a tenant, quotas, and a seeded proptest of max-min fairness.

use super::*;

/// A request of tenant `t`, principal `p`.
fn party(t: u64, p: u64) -> CacheScope {
    CacheScope {
        tenant: Salt(t),
        principal: Salt(p),
        shared_tokens: 0,
    }
}

/// The requests admitted (started) in a step, in order.
fn admitted(out: &Scheduled) -> Vec<u64> {
    out.started.iter().map(|s| s.id.0).collect()
}

#[test]
fn tenants_take_turns_for_free_running_slots() {
    let cfg = SchedulerConfig {
        max_running: 2,
        max_waiting: 16,
        step_tokens: 64,
        itl_target: None,
        ttft_target: None,
    };
    let mut s = new_sched(64, cfg, false, (0, 0));
    // Tenant 1 floods first (ids 1-6, six principals); tenant 2 comes later (ids 10, 11).
    for i in 1..=6 {
        s.add(id(i), vec![1; 4], 8, party(1, 100 + i)).unwrap();
    }
    s.add(id(10), vec![2; 4], 8, party(2, 200)).unwrap();
    s.add(id(11), vec![2; 4], 8, party(2, 200)).unwrap();
    assert_eq!(
        admitted(&step(&mut s)),
        vec![1, 10],
        "one each, not 1 and 2"
    );
    // Tenant 2 has one running, tenant 1 one: the next free slot goes by queue order among
    // equals, then to whoever has fewer running.
    s.finish(id(1), None);
    assert_eq!(admitted(&step(&mut s)), vec![2]);
    s.finish(id(10), None);
    assert_eq!(
        admitted(&step(&mut s)),
        vec![11],
        "tenant 2 has none running now"
    );
    s.finish(id(2), None);
    s.finish(id(11), None);
    assert_eq!(admitted(&step(&mut s)), vec![3, 4]);
}

#[test]
fn a_tenant_with_nothing_running_takes_a_slot_from_the_one_with_most() {
    let mut s = sched(64, 3, 64);
    for i in 1..=3 {
        s.add(id(i), vec![1; 4], 16, party(1, i)).unwrap();
    }
    assert_eq!(admitted(&step(&mut s)), vec![1, 2, 3]);
    step(&mut s);
    // Tenant 2 arrives with every slot taken by tenant 1: tenant 1's latest admission
    // goes back to the queue and tenant 2's request runs in this very step.
    s.add(id(10), vec![2; 4], 16, party(2, 10)).unwrap();
    let out = step(&mut s);
    assert_eq!(out.preempted, vec![id(3)]);
    assert_eq!(admitted(&out), vec![10]);
    assert_eq!(s.stats().preemptions, 1);
    // Nothing more to take: tenant 2 has one running, tenant 1 two; request 3 waits for a
    // free slot and then resumes (it had started: it recomputes what it had).
    let out = step(&mut s);
    assert!(out.preempted.is_empty());
    s.finish(id(1), None);
    let out = step(&mut s);
    assert!(entries(&out).contains(&(3, true)), "{:?}", entries(&out));
    // One request per tenant: nobody is preempted for a newcomer of a tenant that runs one.
    s.add(id(11), vec![2; 4], 16, party(2, 11)).unwrap();
    assert!(step(&mut s).preempted.is_empty());
}

#[test]
fn a_tenant_over_its_share_sits_out_the_step_that_admits_a_newcomer_tenant() {
    let mut s = sched(64, 4, 64);
    for i in 1..=3 {
        s.add(id(i), vec![1; 4], 32, party(1, i)).unwrap();
    }
    assert_eq!(admitted(&step(&mut s)), vec![1, 2, 3]);
    assert_eq!(
        entries(&step(&mut s)),
        vec![(1, true), (2, true), (3, true)]
    );
    // Tenant 2 arrives with a slot free; tenant 1 runs three, over its share (4 slots over
    // 2 tenants): the newcomer's prompt runs alone, and everyone decodes in the next step.
    s.add(id(10), vec![2; 4], 16, party(2, 10)).unwrap();
    assert_eq!(entries(&step(&mut s)), vec![(10, true)]);
    assert_eq!(s.stats().holds, 1);
    // Tenant 3 arrives right after a held step: it takes tenant 1's latest slot (turns),
    // but no two held steps in a row: everyone else decodes beside its prompt.
    s.add(id(20), vec![3; 4], 16, party(3, 20)).unwrap();
    let out = step(&mut s);
    assert_eq!(out.preempted, vec![id(3)]);
    assert_eq!(
        entries(&out),
        vec![(1, true), (2, true), (10, true), (20, true)]
    );
    assert_eq!(s.stats().holds, 1);
    // A newcomer principal of tenant 1 itself holds nothing (one tenant, no shares).
    let mut s = sched(64, 4, 64);
    for i in 1..=3 {
        s.add(id(i), vec![1; 4], 32, party(1, i)).unwrap();
    }
    step(&mut s);
    s.add(id(4), vec![1; 4], 16, party(1, 4)).unwrap();
    assert_eq!(
        entries(&step(&mut s)),
        vec![(1, true), (2, true), (3, true), (4, true)]
    );
    // Within its share (8 slots over 2 tenants) tenant 1 is not held either.
    let mut s = sched(64, 8, 64);
    for i in 1..=3 {
        s.add(id(i), vec![1; 4], 32, party(1, i)).unwrap();
    }
    step(&mut s);
    s.add(id(10), vec![2; 4], 16, party(2, 10)).unwrap();
    assert_eq!(
        entries(&step(&mut s)),
        vec![(1, true), (2, true), (3, true), (10, true)]
    );
    assert_eq!(s.stats().holds, 0);
}

#[test]
fn a_hold_whose_newcomer_finds_no_block_runs_the_decodes_instead() {
    // 4 blocks of 4 tokens: three 3-token prompts take a block each, one stays free.
    let mut s = sched(4, 4, 64);
    for i in 1..=3 {
        s.add(id(i), vec![1; 3], 4, party(1, i)).unwrap();
    }
    assert_eq!(admitted(&step(&mut s)), vec![1, 2, 3]);
    // Tenant 2's 8-token prompt needs two blocks: it cannot run, so the step the hold
    // would have emptied runs tenant 1's decodes after all.
    s.add(id(10), vec![2; 8], 8, party(2, 10)).unwrap();
    assert_eq!(
        entries(&step(&mut s)),
        vec![(1, true), (2, true), (3, true)]
    );
    assert_eq!(s.stats().holds, 0);
    assert!(s.kv().check().is_ok());
}

#[test]
fn within_a_tenant_principals_take_turns() {
    let mut s = sched(64, 1, 64);
    // Principal 7 queues three, then principal 8 one: after 7's first, 8 goes.
    for i in 1..=3 {
        s.add(id(i), vec![1; 4], 8, party(1, 7)).unwrap();
    }
    s.add(id(4), vec![1; 4], 8, party(1, 8)).unwrap();
    assert_eq!(admitted(&step(&mut s)), vec![1]);
    s.add(id(5), vec![1; 4], 8, party(1, 7)).unwrap();
    s.finish(id(1), None);
    // 7 and 8 both have none running: queue order says 2 (principal 7).
    assert_eq!(admitted(&step(&mut s)), vec![2]);
    s.finish(id(2), None);
    assert_eq!(admitted(&step(&mut s)), vec![3]);
}

#[test]
fn a_tenant_quota_caps_its_running_and_waiting_requests() {
    let mut s = sched(64, 4, 64);
    let quota = Quota {
        max_running: Some(1),
        max_waiting: Some(2),
    };
    for i in 1..=2 {
        s.add_with(id(i), vec![1; 4], 8, party(1, i), quota)
            .unwrap();
    }
    assert_eq!(
        s.add_with(id(3), vec![1; 4], 8, party(1, 3), quota),
        Err(AddError::TenantOverloaded { waiting: 2 })
    );
    // Another tenant's requests are not counted against it.
    s.add(id(20), vec![2; 4], 8, party(2, 20)).unwrap();
    assert_eq!(
        admitted(&step(&mut s)),
        vec![1, 20],
        "tenant 1 runs one at a time"
    );
    assert_eq!(s.waiting_len(), 1);
    s.finish(id(1), None);
    assert_eq!(admitted(&step(&mut s)), vec![2]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, rng_seed: proptest::test_runner::RngSeed::Fixed(13), ..ProptestConfig::default() })]

    /// Whatever the arrival order, no tenant is admitted while another tenant with fewer
    /// running requests has one queued (and eligible), and quotas hold at every step.
    #[test]
    fn admission_is_max_min_fair_over_tenants(
        arrivals in proptest::collection::vec((0u64..3, 0u64..4), 1..24),
        finishes in proptest::collection::vec(0usize..8, 0..24),
    ) {
        let cfg = SchedulerConfig { max_running: 3, max_waiting: 64, step_tokens: 256, itl_target: None, ttft_target: None };
        let mut s = new_sched(256, cfg, false, (0, 0));
        let quota = |t: u64| Quota { max_running: (t == 0).then_some(2), max_waiting: None };
        for (n, &(t, p)) in arrivals.iter().enumerate() {
            s.add_with(id(n as u64), vec![1; 4], 8, party(t, p), quota(t)).unwrap();
        }
        let mut finishes = finishes.into_iter();
        while !s.is_idle() {
            let mut before: Vec<(RequestId, Salt, Quota)> =
                s.waiting.iter().map(|q| (q.id, q.tenant(), q.quota)).collect();
            let running_before: Vec<Salt> = s.running.iter().map(|r| r.tenant()).collect();
            let out = step(&mut s);
            let count = |v: &[Salt], t: Salt| v.iter().filter(|&&x| x == t).count();
            // Replay the step's admissions one by one against the counts at that moment.
            let mut running = running_before.clone();
            for p in &out.preempted {
                let t = s.get(*p).unwrap().tenant();
                let k = running.iter().position(|&x| x == t).unwrap();
                running.remove(k);
            }
            for a in &out.started {
                let t = s.get(a.id).unwrap().tenant();
                before.retain(|&(w, _, _)| w != a.id);
                for &(_, u, q) in &before {
                    let eligible = q.max_running.is_none_or(|m| count(&running, u) < m);
                    prop_assert!(!(eligible && count(&running, u) < count(&running, t)),
                        "admitted a tenant with {} running while one with {} waited",
                        count(&running, t), count(&running, u));
                }
                running.push(t);
            }
            let t0 = Salt(0);
            prop_assert!(count(&s.running.iter().map(|r| r.tenant()).collect::<Vec<_>>(), t0) <= 2);
            // Finish one running request (chosen by the input), or all when the input ends.
            match finishes.next() {
                Some(k) if !s.running.is_empty() => {
                    let victim = s.running[k % s.running.len()].id;
                    s.finish(victim, None);
                }
                _ => {
                    let ids: Vec<RequestId> = s.running.iter().map(|r| r.id).collect();
                    for i in ids { s.finish(i, None); }
                }
            }
        }
    }
}
