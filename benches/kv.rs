//! The scheduler and KV manager alone, no model: the time of one step's bookkeeping (schedule,
//! then a sampled token appended to every decoding request, with a request finishing into a lease
//! and a new one continuing another session every few steps), for caches from 1,000 to 1,000,000
//! blocks and 10 to 10,000 sessions holding leases. The per-step time must not grow with either.
//!
//!     cargo bench --bench kv [-- --steps 20000]

use std::time::Instant;

use llama_relay::engine::scheduler::{RequestId, Scheduler, SchedulerConfig};
use llama_relay::kv_cache::manager::{KvConfig, KvManager, LeaseKey};
use llama_relay::kv_cache::{BlockPool, CacheScope, Salt};

const BS: usize = 16;
/// Requests decoding at once.
const RUNNING: u64 = 8;

fn prompt(session: u64, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| i ^ (session as u32) << 8).collect()
}

fn scope(session: u64) -> CacheScope {
    CacheScope::private(Salt(session))
}

/// Runs one request to completion, leaving its blocks to `session`'s lease.
fn lease_one(s: &mut Scheduler, id: &mut u64, session: u64) {
    let r = RequestId(*id);
    *id += 1;
    s.add(r, prompt(session, 40), 48, scope(session)).unwrap();
    while s.get(r).is_some_and(|q| q.computed < 40) {
        let out = s.schedule().expect("work");
        for e in out.entries.iter().filter(|e| e.sample) {
            s.append(e.id, 1);
        }
    }
    s.finish(r, Some(LeaseKey(session)));
}

/// Nanoseconds per step, median of 3 runs of `steps` steps.
fn per_step(blocks: usize, leased: u64, steps: usize) -> f64 {
    let kv = KvConfig {
        block_size: BS,
        prefix_caching: true,
        lease_tokens_per_session: 4096,
        lease_tokens_total: usize::MAX / 2,
        context_shift: false,
    };
    let cfg = SchedulerConfig {
        max_running: 64,
        max_waiting: 64,
        step_tokens: 512,
        itl_target: None,
        ttft_target: None,
    };
    let mut s = Scheduler::new(cfg, KvManager::new(kv, BlockPool::new(blocks)));
    let mut id = 0u64;
    for session in 0..leased {
        lease_one(&mut s, &mut id, session);
    }
    assert_eq!(s.kv().leases() as u64, leased);
    // The streams: sessions above the leased ones, each continuing its own conversation.
    let mut streams: Vec<(RequestId, u64)> = Vec::new();
    let start = |s: &mut Scheduler, id: &mut u64, session: u64| {
        let r = RequestId(*id);
        *id += 1;
        s.add(r, prompt(session, 40), 40 + 64, scope(session))
            .unwrap();
        s.set_lease(r, LeaseKey(session), false);
        r
    };
    for session in leased..leased + RUNNING {
        streams.push((start(&mut s, &mut id, session), session));
    }
    let mut times = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        for step in 0..steps {
            let out = s.schedule().expect("work");
            for e in out.entries.iter().filter(|e| e.sample) {
                s.append(e.id, 7);
            }
            // Every few steps one stream ends into its lease and a new turn starts.
            if step % 16 == 0 {
                let i = step / 16 % streams.len();
                let (r, session) = streams[i];
                s.finish(r, Some(LeaseKey(session)));
                streams[i] = (start(&mut s, &mut id, session), session);
            }
        }
        times.push(t.elapsed().as_secs_f64() * 1e9 / steps as f64);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    times[1]
}

fn main() {
    let mut steps = 20_000;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--steps" => steps = it.next().and_then(|v| v.parse().ok()).expect("--steps N"),
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    println!("scheduler + KV manager, {RUNNING} decoding streams, one turn ending every 16 steps");
    for blocks in [1_000, 10_000, 100_000, 1_000_000] {
        println!(
            "blocks {blocks:>9}, leased sessions    10: {:>7.0} ns/step",
            per_step(blocks, 10, steps)
        );
    }
    for leased in [10, 100, 1_000, 10_000] {
        println!(
            "blocks   1000000, leased sessions {leased:>5}: {:>7.0} ns/step",
            per_step(1_000_000, leased, steps)
        );
    }
}
