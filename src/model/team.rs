//! One persistent team of threads for a step's parallel loops.
//!
//! A step runs a few hundred parallel loops (every projection, norm, rope, attention, SiLU and
//! activation quantizer of every layer), each a few to a few hundred microseconds. With a
//! fork-join pool (rayon) the idle worker sleeps between them, and every loop pays a wake-up:
//! on a 2-core KVM guest a condvar wake-up took 5.6 us at the median and 29 / 68 us at p90 / p99,
//! against 0.3 us for a thread that spins (docs/performance.md, "One team of threads for a
//! step"). Rayon offers no way to keep its workers spinning, so this module is written by hand:
//! the design is llama.cpp's ggml threadpool (workers poll a shared job and spin a while before
//! they sleep), reduced to what a step needs.
//!
//! - The team is the calling thread plus `size() - 1` workers, started on first use; `size()`
//!   is rayon's global pool size, which `settings` sets from the operator's `threads`.
//! - `run(tasks, f)` publishes one job; the caller and the workers claim task indices from one
//!   counter until none are left, and the caller returns when every task has finished. Which
//!   thread runs a task never changes what it computes, so results are the same bits as a
//!   serial loop's.
//! - A worker spins for `SPIN` after its last job, then parks until the next job unparks it.
//! - A call from inside a task, or while another thread holds the team (tests call kernels from
//!   many threads), runs its tasks serially on the caller instead of waiting.
//! - A panic in a task is caught, the job still completes, and the caller panics afterwards.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Mutex, OnceLock};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

/// How long a worker spins for the next job before it parks: longer than the gaps between a
/// step's loops (a few microseconds). Serving did not tell 20, 100 and 500 us apart
/// (docs/performance.md, "One team of threads for a step").
const SPIN: Duration = Duration::from_micros(100);

/// One published loop.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    tasks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
}

impl Job<'_> {
    /// Claims and runs tasks until none are left.
    fn work(&self) {
        loop {
            let t = self.next.fetch_add(1, Relaxed);
            if t >= self.tasks {
                return;
            }
            if catch_unwind(AssertUnwindSafe(|| (self.f)(t))).is_err() {
                self.panicked.store(true, Relaxed);
            }
            self.done.fetch_add(1, Release);
        }
    }
}

/// What the caller and the workers share.
struct Shared {
    /// The job being run, null between jobs. It lives on the caller's stack: the caller clears
    /// it and then waits for `users` to reach zero before it returns.
    job: AtomicPtr<Job<'static>>,
    /// Bumped at each publish; workers spin on it.
    seq: AtomicU64,
    /// Workers between reading `job` and leaving it.
    users: AtomicUsize,
    /// Per worker: parked (or about to park), so a publish must unpark it.
    sleeping: Vec<AtomicBool>,
}

struct Team {
    shared: &'static Shared,
    threads: Vec<Thread>,
    /// Held by the thread whose job is published.
    lock: Mutex<()>,
}

thread_local! {
    /// Set on the team's workers and on a caller while its job runs: a nested `run` is serial.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

fn team() -> &'static Team {
    static TEAM: OnceLock<Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let workers = rayon::current_num_threads().max(1) - 1;
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            job: AtomicPtr::new(ptr::null_mut()),
            seq: AtomicU64::new(0),
            users: AtomicUsize::new(0),
            sleeping: (0..workers).map(|_| AtomicBool::new(false)).collect(),
        }));
        let threads = (0..workers)
            .map(|i| {
                thread::Builder::new()
                    .name(format!("llama-relay-team-{}", i + 1))
                    .spawn(move || worker(shared, i))
                    .expect("starting a team thread")
                    .thread()
                    .clone()
            })
            .collect();
        Team {
            shared,
            threads,
            lock: Mutex::new(()),
        }
    })
}

fn worker(sh: &'static Shared, i: usize) -> ! {
    INSIDE.with(|c| c.set(true));
    let mut seen = 0u64;
    loop {
        let mut idle = Instant::now();
        let mut spins = 0u32;
        loop {
            let s = sh.seq.load(Acquire);
            if s != seen {
                seen = s;
                break;
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && idle.elapsed() > SPIN {
                sh.sleeping[i].store(true, SeqCst);
                if sh.seq.load(SeqCst) == seen {
                    thread::park();
                }
                sh.sleeping[i].store(false, SeqCst);
                idle = Instant::now();
            }
        }
        sh.users.fetch_add(1, SeqCst);
        let p = sh.job.load(SeqCst);
        if !p.is_null() {
            // SAFETY: the caller keeps the job alive until `users` is zero after it cleared
            // `job`; this thread counted itself in `users` before it read `job` (both SeqCst),
            // so either it read null or the caller waits for it.
            unsafe { &*p }.work();
        }
        sh.users.fetch_sub(1, Release);
    }
}

/// Threads in the team, the caller included.
pub fn size() -> usize {
    team().threads.len() + 1
}

/// Runs `f(0..tasks)` on the team and returns when every task has finished.
pub fn run(tasks: usize, f: impl Fn(usize) + Sync) {
    let serial = || (0..tasks).for_each(&f);
    if tasks <= 1 || INSIDE.with(Cell::get) {
        return serial();
    }
    let team = team();
    if team.threads.is_empty() {
        return serial();
    }
    let Ok(held) = team.lock.try_lock() else {
        return serial();
    };
    INSIDE.with(|c| c.set(true));
    let job = Job {
        f: &f,
        tasks,
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
    };
    let sh = team.shared;
    // SAFETY (of the lifetime cast): `job` is cleared below and no worker holds it when this
    // function returns (see `Shared::job`).
    sh.job
        .store(&job as *const Job<'_> as *mut Job<'static>, SeqCst);
    sh.seq.fetch_add(1, SeqCst);
    for (asleep, t) in sh.sleeping.iter().zip(&team.threads) {
        if asleep.load(SeqCst) {
            t.unpark();
        }
    }
    job.work();
    while job.done.load(Acquire) < tasks {
        std::hint::spin_loop();
    }
    sh.job.store(ptr::null_mut(), SeqCst);
    while sh.users.load(SeqCst) != 0 {
        std::hint::spin_loop();
    }
    INSIDE.with(|c| c.set(false));
    // Released before a panic, so the lock is not poisoned for the next step.
    drop(held);
    assert!(!job.panicked.load(Relaxed), "a team task panicked");
}

/// Runs `f(i, chunk)` over `data` cut into `chunk`-long pieces (the last may be shorter),
/// `per_task` pieces to a task.
pub fn chunks_mut<T: Send>(
    data: &mut [T],
    chunk: usize,
    per_task: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    assert!(chunk > 0 && per_task > 0);
    let pieces = data.len().div_ceil(chunk);
    let (len, base) = (data.len(), SharedMut(data.as_mut_ptr()));
    run(pieces.div_ceil(per_task), |t| {
        let base = &base;
        for i in t * per_task..((t + 1) * per_task).min(pieces) {
            let start = i * chunk;
            let n = chunk.min(len - start);
            // SAFETY: pieces are disjoint ranges inside `data`, each handed to one task, and
            // `data` is borrowed mutably for the whole call.
            f(i, unsafe { base.slice(start, n) });
        }
    });
}

/// `f(0..tasks)` run on the team, its results in index order.
pub fn map<R: Send>(tasks: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let mut out: Vec<Option<R>> = (0..tasks).map(|_| None).collect();
    chunks_mut(&mut out, 1, 1, |i, slot| slot[0] = Some(f(i)));
    out.into_iter()
        .map(|r| r.expect("every task ran"))
        .collect()
}

/// Pieces of `items` a task for about four tasks a thread: an idle thread takes the next task
/// instead of waiting on one big half.
pub fn per_task(items: usize) -> usize {
    items.div_ceil(4 * size()).max(1)
}

/// A result's base pointer, shared by the tasks that write disjoint parts behind it (column
/// blocks of a matmul, attention rows, a quantizer's rows, `chunks_mut`'s pieces).
pub struct SharedMut<T>(pub *mut T);
// SAFETY: every user's tasks write disjoint elements of a `Send` type, through `slice` or the
// raw pointer, while the buffer outlives the loop.
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// # Safety
    /// `start..start + len` lies inside the allocation, and no other task touches it while the
    /// slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        // SAFETY: as the caller promises.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_once() {
        for tasks in [0, 1, 2, 3, 7, 64, 1000] {
            let hits: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
            run(tasks, |t| {
                hits[t].fetch_add(1, Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "{tasks} tasks");
        }
    }

    #[test]
    fn chunks_cover_the_slice_once_with_their_index() {
        for (len, chunk, per) in [(0, 3, 1), (10, 3, 1), (10, 3, 2), (1000, 7, 5), (64, 64, 1)] {
            let mut v = vec![0usize; len];
            chunks_mut(&mut v, chunk, per, |i, c| {
                for x in c.iter_mut() {
                    *x += i + 1;
                }
            });
            let want: Vec<usize> = (0..len).map(|j| j / chunk + 1).collect();
            assert_eq!(v, want, "len {len} chunk {chunk} per {per}");
        }
    }

    #[test]
    fn map_keeps_index_order() {
        for tasks in [0, 1, 5, 300] {
            assert_eq!(
                map(tasks, |i| i * 3),
                (0..tasks).map(|i| i * 3).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn nested_and_concurrent_calls_finish() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..50 {
                        run(8, |_| {
                            run(3, |_| {
                                total.fetch_add(1, Relaxed);
                            });
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Relaxed), 4 * 50 * 8 * 3);
    }

    #[test]
    fn a_panicking_task_panics_the_caller_after_the_others_finish() {
        let ran = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            run(16, |t| {
                ran.fetch_add(1, Relaxed);
                assert_ne!(t, 5, "task 5 fails");
            })
        }));
        assert!(r.is_err());
        assert_eq!(ran.load(Relaxed), 16);
        // The team still works afterwards.
        let after = AtomicUsize::new(0);
        run(16, |_| {
            after.fetch_add(1, Relaxed);
        });
        assert_eq!(after.load(Relaxed), 16);
    }
}
