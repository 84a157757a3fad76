//! A reference durable-critical family over an in-memory "durable" store.
//!
//! It shows how a family writes `new_worker`, the crash callback, restart and the recovery
//! assertion, and it is the honest adapter the kit's self-tests run through the
//! [`CrashMatrix`](crate::CrashMatrix). The store outlives every worker (it plays the database);
//! a worker is a process: its controller, its attempts and its fault hook.
//!
//! The lifecycle has every boundary of [`CrashPoint`]: idempotent acceptance, a fenced claim
//! with a claim token and lease, a heartbeat that detects an expired lease, an ownership (fence)
//! check, and one transactional effect + disposition. `next_work_at` answers the earliest lease
//! expiry, so a crashed worker's job is rescued exactly when its lease ends.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use nexuscrm_worker::fault::{CrashPoint, Faults};
use nexuscrm_worker::{
    Attempt, AttemptError, BoxError, ClaimBatch, Clock, Config, Controller, Declaration,
    Durability, Effect, Generation, Source, SourceError, SystemClock,
};
use tokio::sync::{Notify, OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::matrix::{CrashContext, CrashFamily};

/// The family's declaration.
pub const DECLARATION: Declaration =
    Declaration::new_const("memory", Durability::DurableCritical, Effect::Transactional);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JobState {
    Pending,
    Running { token: u64, lease_until: Instant },
    Done,
}

#[derive(Debug)]
struct Job {
    key: String,
    state: JobState,
    effects: u32,
    run_at: Instant,
}

#[derive(Debug, Default)]
struct StoreState {
    jobs: Vec<Job>,
    by_key: HashMap<String, usize>,
    owner: u64,
    next_token: u64,
    next_generation: u64,
}

/// The "durable" store: it survives every worker.
#[derive(Debug)]
pub struct MemoryStore {
    state: Mutex<StoreState>,
    lease: Duration,
    changed: Notify,
    gate: Arc<RwLock<()>>,
    generation: AtomicU64,
    generation_broken: AtomicBool,
    attempts_broken: AtomicBool,
    held_by_another: AtomicBool,
    generation_notify: Notify,
}

impl MemoryStore {
    /// An empty store whose claims lease jobs for `lease`.
    #[must_use]
    pub fn new(lease: Duration) -> Self {
        MemoryStore {
            state: Mutex::default(),
            lease,
            changed: Notify::new(),
            gate: Arc::new(RwLock::new(())),
            generation: AtomicU64::new(0),
            generation_broken: AtomicBool::new(false),
            attempts_broken: AtomicBool::new(false),
            held_by_another: AtomicBool::new(false),
            generation_notify: Notify::new(),
        }
    }

    /// Blocks every Source operation until the guard is dropped (like a table lock held by
    /// another connection).
    pub async fn block(&self) -> OwnedRwLockWriteGuard<()> {
        self.gate.clone().write_owned().await
    }

    /// While `true`, pending jobs are held by "another replica" (row locks a claim skips):
    /// claims pass them over while `next_work_at` still reports them due.
    pub fn hold_pending(&self, held: bool) {
        self.held_by_another.store(held, SeqCst);
    }

    /// Makes every attempt's effect fail, as a store error would (`false` heals it).
    pub fn break_attempts(&self, broken: bool) {
        self.attempts_broken.store(broken, SeqCst);
    }

    /// Bumps the generation cursor, as a producer in another process would.
    pub fn bump_generation(&self) {
        self.generation.fetch_add(1, SeqCst);
        self.generation_notify.notify_waiters();
    }

    /// Makes the next generation wait fail (a lost LISTEN connection).
    pub fn break_generation(&self) {
        self.generation_broken.store(true, SeqCst);
        self.generation_notify.notify_waiters();
    }

    /// Jobs that reached their terminal state.
    #[must_use]
    pub fn completed(&self) -> u64 {
        self.lock()
            .jobs
            .iter()
            .filter(|j| j.state == JobState::Done)
            .count() as u64
    }

    async fn enter(
        &self,
        cancel: &CancellationToken,
    ) -> Result<OwnedRwLockReadGuard<()>, SourceError> {
        tokio::select! {
            biased;
            g = self.gate.clone().read_owned() => Ok(g),
            () = cancel.cancelled() => Err(SourceError::not_committed(
                "cancelled while waiting for the store; nothing was written",
            )),
        }
    }

    fn lock(&self) -> MutexGuard<'_, StoreState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `(key, done, effects applied)` for every accepted job.
    #[must_use]
    pub fn jobs(&self) -> Vec<(String, bool, u32)> {
        self.lock()
            .jobs
            .iter()
            .map(|j| (j.key.clone(), j.state == JobState::Done, j.effects))
            .collect()
    }

    /// Waits until every accepted job is done and at least `n` were accepted.
    pub async fn wait_all_done(&self, n: usize) {
        loop {
            let notified = self.changed.notified();
            {
                let s = self.lock();
                if s.jobs.len() >= n && s.jobs.iter().all(|j| j.state == JobState::Done) {
                    return;
                }
            }
            notified.await;
        }
    }
}

/// One worker process over a [`MemoryStore`].
#[derive(Debug)]
pub struct MemoryWorker {
    store: Arc<MemoryStore>,
    faults: Faults,
    generation: u64,
}

impl MemoryWorker {
    /// Builds a worker with the next deployment generation.
    #[must_use]
    pub fn new(store: &Arc<MemoryStore>, faults: Faults) -> Self {
        let generation = {
            let mut s = store.lock();
            s.next_generation += 1;
            s.next_generation
        };
        MemoryWorker {
            store: store.clone(),
            faults,
            generation,
        }
    }

    /// The store this worker is bound to.
    #[must_use]
    pub fn store(&self) -> &Arc<MemoryStore> {
        &self.store
    }

    /// Takes ownership of the family for this worker's generation; an older generation can
    /// never take it back.
    ///
    /// # Errors
    ///
    /// A newer generation owns the family, or an injected crash.
    pub fn take_ownership(&self) -> Result<(), BoxError> {
        {
            let mut s = self.store.lock();
            if s.owner > self.generation {
                return Err(format!(
                    "generation {} cannot take ownership back from {}",
                    self.generation, s.owner
                )
                .into());
            }
            s.owner = self.generation;
        }
        // The transfer is half done: the new owner is recorded, nothing claimed yet.
        self.faults.hit(CrashPoint::OwnershipTransfer)?;
        Ok(())
    }

    /// Accepts a job idempotently; returns after "commit".
    ///
    /// # Errors
    ///
    /// An injected crash.
    pub fn submit(&self, key: &str) -> Result<(), BoxError> {
        self.submit_at(key, Instant::now())
    }

    /// Accepts a job that becomes eligible at `run_at`, idempotently.
    ///
    /// # Errors
    ///
    /// An injected crash.
    pub fn submit_at(&self, key: &str, run_at: Instant) -> Result<(), BoxError> {
        self.faults.hit(CrashPoint::BeforeAcceptance)?;
        {
            let mut s = self.store.lock();
            if !s.by_key.contains_key(key) {
                let idx = s.jobs.len();
                s.jobs.push(Job {
                    key: key.to_owned(),
                    state: JobState::Pending,
                    effects: 0,
                    run_at,
                });
                s.by_key.insert(key.to_owned(), idx);
            }
        }
        self.faults.hit(CrashPoint::AfterAcceptance)?;
        Ok(())
    }

    /// A controller over this worker.
    ///
    /// # Errors
    ///
    /// Never with the built-in config.
    pub fn controller(self: &Arc<Self>) -> Result<Controller<MemorySource>, BoxError> {
        let config = Config::new("memory")
            .capacity(NonZeroUsize::new(2).expect("2"))
            .shutdown_timeout(Duration::from_secs(5));
        Ok(Controller::new(
            MemorySource {
                worker: self.clone(),
            },
            config,
        )?)
    }
}

/// The family's [`Source`].
#[derive(Debug)]
pub struct MemorySource {
    worker: Arc<MemoryWorker>,
}

fn crash_source(e: impl Into<BoxError>) -> SourceError {
    SourceError::new(e)
}

impl Source for MemorySource {
    type Attempt = MemoryAttempt;

    async fn check_ready(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        self.worker.store.enter(&cancel).await.map(drop)
    }

    async fn reconcile(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        self.worker.store.enter(&cancel).await.map(drop)
    }

    async fn claim(
        &self,
        capacity: NonZeroUsize,
        cancel: CancellationToken,
    ) -> Result<ClaimBatch<MemoryAttempt>, SourceError> {
        let _gate = self.worker.store.enter(&cancel).await?;
        let w = &self.worker;
        let now = Instant::now();
        let mut claimed = Vec::new();
        {
            let mut s = w.store.lock();
            if s.owner != w.generation {
                // Fenced out: claims nothing.
                return Ok(ClaimBatch::empty());
            }
            let lease = w.store.lease;
            for i in 0..s.jobs.len() {
                if claimed.len() == capacity.get() {
                    break;
                }
                let eligible = match s.jobs[i].state {
                    JobState::Pending => {
                        s.jobs[i].run_at <= now && !w.store.held_by_another.load(SeqCst)
                    }
                    JobState::Running { lease_until, .. } => lease_until <= now,
                    JobState::Done => false,
                };
                if eligible {
                    s.next_token += 1;
                    let token = s.next_token;
                    s.jobs[i].state = JobState::Running {
                        token,
                        lease_until: now + lease,
                    };
                    claimed.push(MemoryAttempt {
                        worker: w.clone(),
                        idx: i,
                        token,
                    });
                }
            }
        }
        // The claim "committed"; a crash here leaves leased jobs behind.
        w.faults.hit(CrashPoint::AfterClaim).map_err(crash_source)?;
        Ok(if claimed.len() == capacity.get() {
            ClaimBatch::more(claimed)
        } else {
            ClaimBatch::done(claimed)
        })
    }

    async fn next_work_at(
        &self,
        cancel: CancellationToken,
    ) -> Result<Option<SystemTime>, SourceError> {
        let _gate = self.worker.store.enter(&cancel).await?;
        let s = self.worker.store.lock();
        let now = Instant::now();
        // The earliest future run_at of a pending job, or lease expiry of a running one.
        let earliest = s
            .jobs
            .iter()
            .filter_map(|j| match j.state {
                JobState::Running { lease_until, .. } => Some(lease_until),
                JobState::Pending => Some(j.run_at),
                JobState::Done => None,
            })
            .min();
        Ok(earliest.map(|at| SystemClock.now() + at.saturating_duration_since(now)))
    }

    async fn generation(&self, _: CancellationToken) -> Result<Option<Generation>, SourceError> {
        let store = &self.worker.store;
        if store.generation_broken.swap(false, SeqCst) {
            return Err(SourceError::new("generation read failed"));
        }
        Ok(Some(Generation(store.generation.load(SeqCst))))
    }

    async fn generation_changed(
        &self,
        seen: Generation,
        cancel: CancellationToken,
    ) -> Result<Generation, SourceError> {
        let store = &self.worker.store;
        loop {
            let notified = store.generation_notify.notified();
            if store.generation_broken.swap(false, SeqCst) {
                return Err(SourceError::new("generation probe connection lost"));
            }
            let now = Generation(store.generation.load(SeqCst));
            if now != seen {
                return Ok(now);
            }
            tokio::select! {
                () = notified => {}
                () = cancel.cancelled() => return Ok(seen),
            }
        }
    }
}

/// One claimed job.
#[derive(Debug)]
pub struct MemoryAttempt {
    worker: Arc<MemoryWorker>,
    idx: usize,
    token: u64,
}

impl MemoryAttempt {
    fn holds_lease(&self, s: &StoreState) -> bool {
        matches!(
            s.jobs[self.idx].state,
            JobState::Running { token, lease_until } if token == self.token && lease_until > Instant::now()
        )
    }
}

impl Attempt for MemoryAttempt {
    async fn run(self, _cancel: CancellationToken) -> Result<(), AttemptError> {
        let w = &self.worker;
        let f = &w.faults;
        f.hit(CrashPoint::BeforeEffect).map_err(AttemptError::new)?;
        // Heartbeat: extend the lease only while we still hold it.
        f.hit(CrashPoint::DuringHeartbeat)
            .map_err(AttemptError::new)?;
        {
            let mut s = w.store.lock();
            let held = self.holds_lease(&s);
            drop(s);
            f.hit(CrashPoint::LeaseExpiry).map_err(AttemptError::new)?;
            if !held {
                return Ok(()); // Lost the lease: the new holder owns the job.
            }
            s = w.store.lock();
            let lease = w.store.lease;
            s.jobs[self.idx].state = JobState::Running {
                token: self.token,
                lease_until: Instant::now() + lease,
            };
        }
        f.hit(CrashPoint::BeforeDisposition)
            .map_err(AttemptError::new)?;
        if w.store.attempts_broken.load(SeqCst) {
            // The "transaction" fails: nothing applied, the job returns to pending.
            let mut s = w.store.lock();
            if self.holds_lease(&s) {
                s.jobs[self.idx].state = JobState::Pending;
            }
            return Err(AttemptError::new("injected store error: rolled back"));
        }
        {
            // Effect and disposition in one "transaction", fenced by token and generation.
            let mut s = w.store.lock();
            if s.owner != w.generation || !self.holds_lease(&s) {
                return Ok(());
            }
            s.jobs[self.idx].effects += 1;
            s.jobs[self.idx].state = JobState::Done;
        }
        w.store.changed.notify_waiters();
        f.hit(CrashPoint::AfterEffect).map_err(AttemptError::new)?;
        f.hit(CrashPoint::AfterDisposition)
            .map_err(AttemptError::new)?;
        Ok(())
    }
}

/// The job keys every cell submits.
pub const KEYS: [&str; 3] = ["job-a", "job-b", "job-c"];

/// The reference [`CrashFamily`].
#[derive(Debug, Clone)]
pub struct MemoryFamily {
    lease: Duration,
}

impl Default for MemoryFamily {
    fn default() -> Self {
        MemoryFamily {
            lease: Duration::from_millis(200),
        }
    }
}

impl MemoryFamily {
    /// Submits every key and drains with a controller until all are done.
    async fn drive(worker: Arc<MemoryWorker>, ctx: CrashContext) -> Result<(), BoxError> {
        worker.take_ownership()?;
        for key in KEYS {
            worker.submit(key)?;
        }
        let controller = worker.controller()?;
        let cancel = ctx.cancel().child_token();
        let run = ctx.spawn(controller.run(cancel.clone()));
        worker.store.wait_all_done(KEYS.len()).await;
        cancel.cancel();
        match run.await? {
            Ok(_) => Ok(()),
            Err(e) => Err(e.to_string().into()),
        }
    }
}

impl CrashFamily for MemoryFamily {
    type Fixture = MemoryStore;
    type Worker = MemoryWorker;

    fn label(&self) -> String {
        "memory/in-process".into()
    }

    fn declaration(&self) -> Declaration {
        DECLARATION
    }

    async fn fixture(&self) -> Result<MemoryStore, BoxError> {
        Ok(MemoryStore::new(self.lease))
    }

    async fn new_worker(
        &self,
        fixture: &Arc<MemoryStore>,
        faults: Faults,
    ) -> Result<Arc<MemoryWorker>, BoxError> {
        Ok(Arc::new(MemoryWorker::new(fixture, faults)))
    }

    fn worker_fixture<'a>(&self, worker: &'a MemoryWorker) -> &'a Arc<MemoryStore> {
        worker.store()
    }

    async fn crash(
        &self,
        _point: CrashPoint,
        worker: Arc<MemoryWorker>,
        ctx: CrashContext,
    ) -> Result<(), BoxError> {
        MemoryFamily::drive(worker, ctx).await
    }

    async fn restart(
        &self,
        _point: CrashPoint,
        worker: Arc<MemoryWorker>,
        ctx: CrashContext,
    ) -> Result<(), BoxError> {
        // A new deployment generation restarts, re-submits what the producer never saw
        // acknowledged (idempotently), and drains.
        MemoryFamily::drive(worker, ctx).await
    }

    async fn recover(&self, point: CrashPoint, fixture: Arc<MemoryStore>) -> Result<(), BoxError> {
        let jobs = fixture.jobs();
        if jobs.len() != KEYS.len() {
            return Err(format!(
                "after {point}: {} jobs accepted, want {}",
                jobs.len(),
                KEYS.len()
            )
            .into());
        }
        for (key, done, effects) in jobs {
            if !done {
                return Err(format!("after {point}: {key} is not terminal").into());
            }
            if effects != 1 {
                return Err(format!("after {point}: {key} applied {effects} times").into());
            }
        }
        Ok(())
    }
}

/// The memory family as a [`ScenarioAdapter`](crate::scenarios::ScenarioAdapter): every
/// conformance scenario runs against it in the kit's own tests.
#[derive(Debug, Clone, Default)]
pub struct MemoryScenarios;

impl crate::scenarios::ScenarioAdapter for MemoryScenarios {
    type Source = MemorySource;

    fn label(&self) -> String {
        "memory".into()
    }

    async fn source(&self) -> Result<MemorySource, BoxError> {
        let store = Arc::new(MemoryStore::new(Duration::from_secs(30)));
        let worker = Arc::new(MemoryWorker::new(&store, Faults::none()));
        worker.take_ownership()?;
        Ok(MemorySource { worker })
    }

    async fn submit(&self, source: &MemorySource, n: usize) -> Result<(), BoxError> {
        for _ in 0..n {
            let key = format!("item-{}", source.worker.store.lock().jobs.len());
            source.worker.submit(&key)?;
        }
        Ok(())
    }

    async fn submit_due(&self, source: &MemorySource, at: SystemTime) -> Result<(), BoxError> {
        let wait = at.duration_since(SystemClock.now()).unwrap_or_default();
        let key = format!("due-{}", source.worker.store.lock().jobs.len());
        source.worker.submit_at(&key, Instant::now() + wait)
    }

    async fn completed(&self, source: &MemorySource) -> Result<u64, BoxError> {
        Ok(source.worker.store.completed())
    }

    async fn block(
        &self,
        source: &MemorySource,
    ) -> Result<Box<dyn std::any::Any + Send>, BoxError> {
        Ok(Box::new(source.worker.store.block().await))
    }

    async fn block_reads(
        &self,
        source: &MemorySource,
    ) -> Result<Option<Box<dyn std::any::Any + Send>>, BoxError> {
        // The gate blocks reads and writes alike.
        Ok(Some(Box::new(source.worker.store.block().await)))
    }

    async fn hold_items(
        &self,
        source: &MemorySource,
    ) -> Result<Option<Box<dyn std::any::Any + Send>>, BoxError> {
        struct Release(Arc<MemoryStore>);
        impl Drop for Release {
            fn drop(&mut self) {
                self.0.hold_pending(false);
            }
        }
        source.worker.store.hold_pending(true);
        Ok(Some(Box::new(Release(source.worker.store.clone()))))
    }

    async fn break_attempts(&self, source: &MemorySource) -> Result<bool, BoxError> {
        source.worker.store.break_attempts(true);
        Ok(true)
    }

    async fn heal_attempts(&self, source: &MemorySource) -> Result<(), BoxError> {
        source.worker.store.break_attempts(false);
        Ok(())
    }

    async fn bump_generation(&self, source: &MemorySource) -> Result<bool, BoxError> {
        source.worker.store.bump_generation();
        Ok(true)
    }

    async fn break_generation(&self, source: &MemorySource) -> Result<bool, BoxError> {
        source.worker.store.break_generation();
        Ok(true)
    }
}
