//! Controller overhead per attempt with a no-op source (batches of 64).

// A counting global allocator needs `unsafe`; the libraries themselves `forbid` it.
#![allow(unsafe_code)]
#![allow(missing_docs)] // criterion macros generate undocumented items
//!
//! Reports nanoseconds per attempt (criterion) and heap allocations per attempt (a counting
//! global allocator, printed once before the timed runs).
//!
//! Run: `cargo bench -p nexuscrm-worker --bench controller`

use std::alloc::{GlobalAlloc, Layout, System};
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant, SystemTime};

use criterion::{Criterion, criterion_group, criterion_main};
use nexuscrm_worker::{Attempt, AttemptError, ClaimBatch, Config, Controller, Source, SourceError};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const BATCH: usize = 64;

struct NoopSource {
    remaining: AtomicU64,
    done: Arc<Done>,
}

struct Done {
    count: AtomicU64,
    target: AtomicU64,
    notify: Notify,
}

struct NoopAttempt(Arc<Done>);

impl Attempt for NoopAttempt {
    async fn run(self, _cancel: CancellationToken) -> Result<(), AttemptError> {
        let n = self.0.count.fetch_add(1, Relaxed) + 1;
        if n == self.0.target.load(Relaxed) {
            self.0.notify.notify_one();
        }
        Ok(())
    }
}

impl Source for NoopSource {
    type Attempt = NoopAttempt;
    async fn check_ready(&self, _: CancellationToken) -> Result<(), SourceError> {
        Ok(())
    }
    async fn reconcile(&self, _: CancellationToken) -> Result<(), SourceError> {
        Ok(())
    }
    async fn claim(
        &self,
        capacity: NonZeroUsize,
        _: CancellationToken,
    ) -> Result<ClaimBatch<NoopAttempt>, SourceError> {
        let left = self.remaining.load(Relaxed);
        let n = (capacity.get() as u64).min(left);
        self.remaining.store(left - n, Relaxed);
        let attempts = (0..n).map(|_| NoopAttempt(self.done.clone())).collect();
        Ok(if left - n > 0 {
            ClaimBatch::more(attempts)
        } else {
            ClaimBatch::done(attempts)
        })
    }
    async fn next_work_at(&self, _: CancellationToken) -> Result<Option<SystemTime>, SourceError> {
        Ok(None)
    }
}

/// Drives `n` attempts through a fresh controller; returns (elapsed, allocations) of the drain
/// phase only (startup excluded).
fn drive(rt: &tokio::runtime::Runtime, n: u64) -> (Duration, u64) {
    rt.block_on(async {
        let done = Arc::new(Done {
            count: AtomicU64::new(0),
            target: AtomicU64::new(n),
            notify: Notify::new(),
        });
        let source = Arc::new(NoopSource {
            remaining: AtomicU64::new(0),
            done: done.clone(),
        });
        let config = Config::new("bench").capacity(NonZeroUsize::new(BATCH).unwrap());
        let controller = Controller::from_arc(source.clone(), config).unwrap();
        let handle = controller.handle();
        let cancel = CancellationToken::new();
        let task = tokio::spawn(controller.run(cancel.clone()));
        handle.ready().await;
        tokio::task::yield_now().await;
        let allocs0 = ALLOCS.load(Relaxed);
        let t0 = Instant::now();
        source.remaining.store(n, Relaxed);
        handle.waker().wake();
        done.notify.notified().await;
        let elapsed = t0.elapsed();
        let allocs = ALLOCS.load(Relaxed) - allocs0;
        cancel.cancel();
        task.await.unwrap().unwrap();
        (elapsed, allocs)
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

fn bench(c: &mut Criterion) {
    let rt = runtime();
    let n = 1_000_000;
    let (elapsed, allocs) = drive(&rt, n);
    eprintln!(
        "controller overhead: {n} attempts in batches of {BATCH}: {:.0} ns/attempt, {:.2} \
         allocations/attempt",
        elapsed.as_nanos() as f64 / n as f64,
        allocs as f64 / n as f64
    );
    let mut group = c.benchmark_group("controller");
    group.sample_size(10);
    group.throughput(criterion::Throughput::Elements(100_000));
    group.bench_function("noop_attempts_100k", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                total += drive(&rt, 100_000).0;
            }
            total
        });
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
