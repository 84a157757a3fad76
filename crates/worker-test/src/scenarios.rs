//! Conformance scenarios that any adapter runs against its real store.
//!
//! An adapter implements [`ScenarioAdapter`] (a fresh source over an isolated store, its real
//! producer path, a way to read completions from the store, and a way to block its store). Each
//! scenario wraps the adapter's source in [`Counted`], which counts every Source call and can
//! steer attempts (fail, panic, hold until cancelled, ignore cancellation), drives a real
//! [`Controller`], and checks the protocol's call budgets and the snapshot against the counts.
//!
//! [`run_all`] runs every scenario and returns a [`ScenarioReport`]; adapters call it once per
//! dialect. Scenarios use tokio time, so they run on a paused clock for in-memory adapters and on
//! real time (with small bounds) for database adapters.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use nexuscrm_worker::{
    Attempt, AttemptError, BoxError, ClaimBatch, Config, Controller, Generation, RunErrorKind,
    Snapshot, Source, SourceError,
};
use tokio::time::{Instant, sleep, timeout};
use tokio_util::sync::CancellationToken;

/// What a store-backed family provides to run the scenarios.
pub trait ScenarioAdapter: Send + Sync + 'static {
    /// The family's source.
    type Source: Source;

    /// A label, e.g. `bulk/postgres`.
    fn label(&self) -> String;

    /// A fresh source over an empty, isolated store (its own database, schema or file).
    fn source(&self) -> impl Future<Output = Result<Self::Source, BoxError>> + Send;

    /// Accepts `n` immediately-eligible work items through the real producer path.
    fn submit(
        &self,
        source: &Self::Source,
        n: usize,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Accepts one work item that becomes eligible at `at`.
    fn submit_due(
        &self,
        source: &Self::Source,
        at: SystemTime,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Work items durably completed, read from the store.
    fn completed(
        &self,
        source: &Self::Source,
    ) -> impl Future<Output = Result<u64, BoxError>> + Send;

    /// Blocks the store (for example, holds its tables' locks from another connection) until the
    /// returned guard is dropped, so that Source operations block.
    fn block(
        &self,
        source: &Self::Source,
    ) -> impl Future<Output = Result<Box<dyn Any + Send>, BoxError>> + Send;

    /// Changes the generation cursor as a producer in another process would; `Ok(false)` when
    /// the source has no generation probe.
    fn bump_generation(
        &self,
        source: &Self::Source,
    ) -> impl Future<Output = Result<bool, BoxError>> + Send;

    /// Breaks the generation probe (for example, terminates the LISTEN connection); `Ok(false)`
    /// when the source has no generation probe. By default `Ok(false)`.
    fn break_generation(
        &self,
        source: &Self::Source,
    ) -> impl Future<Output = Result<bool, BoxError>> + Send {
        let _ = source;
        async { Ok(false) }
    }

    /// The controller config for scenarios (the clock in particular). By default
    /// `Config::new(label)`.
    fn config(&self) -> Config {
        Config::new(self.label().replace('/', "-"))
    }
}

/// Per-operation call counts recorded by [`Counted`].
#[derive(Debug, Default)]
pub struct Counts {
    /// `check_ready` calls.
    pub check_ready: AtomicU64,
    /// `reconcile` calls.
    pub reconcile: AtomicU64,
    /// `claim` calls.
    pub claim: AtomicU64,
    /// `next_work_at` calls.
    pub next_work_at: AtomicU64,
    /// `generation` plus `generation_changed` calls.
    pub generation: AtomicU64,
    /// Largest capacity ever asked of `claim`.
    pub max_capacity: AtomicUsize,
    /// Attempts handed out by `claim`.
    pub attempts: AtomicU64,
    /// Attempts that returned.
    pub finished: AtomicU64,
    /// Attempts running now.
    pub in_flight: AtomicUsize,
    /// Most attempts running at once.
    pub max_in_flight: AtomicUsize,
    /// `claim` calls that returned an error.
    pub claim_errors: AtomicU64,
    /// The number of attempts each successful `claim` returned, in call order.
    batches: Mutex<Vec<usize>>,
}

/// How [`Counted`] steers attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Steer {
    /// Run the real attempt.
    Pass,
    /// The n-th attempt (from 1) returns `Err` instead of running; others pass.
    FailNth(u64),
    /// The n-th attempt (from 1) panics instead of running; others pass.
    PanicNth(u64),
    /// Wait for cancellation, then run the real attempt with the cancelled token (it releases).
    HoldUntilCancel,
    /// Ignore cancellation: sleep this long, then run the real attempt.
    IgnoreCancel(Duration),
}

/// A [`Source`] wrapper that counts every call and steers attempts.
pub struct Counted<S> {
    inner: S,
    counts: Arc<Counts>,
    steer: Arc<Mutex<Steer>>,
}

impl<S> fmt::Debug for Counted<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Counted")
            .field("counts", &self.counts)
            .finish_non_exhaustive()
    }
}

impl<S: Source> Counted<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        Counted {
            inner,
            counts: Arc::default(),
            steer: Arc::new(Mutex::new(Steer::Pass)),
        }
    }

    /// The shared counts.
    #[must_use]
    pub fn counts(&self) -> Arc<Counts> {
        self.counts.clone()
    }

    /// The wrapped source.
    #[must_use]
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// A handle that changes how later attempts are steered.
    #[must_use]
    pub fn steering(&self) -> Arc<Mutex<Steer>> {
        self.steer.clone()
    }
}

impl Counts {
    fn n(c: &AtomicU64) -> u64 {
        c.load(SeqCst)
    }

    /// The number of attempts each successful `claim` returned, in call order.
    #[must_use]
    pub fn batches(&self) -> Vec<usize> {
        self.batches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Successful `claim` calls that returned no attempt.
    #[must_use]
    pub fn empty_claims(&self) -> u64 {
        self.batches().iter().filter(|&&n| n == 0).count() as u64
    }

    /// Checks the controller's snapshot against these counts.
    ///
    /// # Errors
    ///
    /// The first counter that disagrees.
    pub fn agrees_with(&self, snap: &Snapshot) -> Result<(), String> {
        let pairs = [
            (
                "check_ready",
                snap.check_ready_calls,
                Counts::n(&self.check_ready),
            ),
            (
                "reconcile",
                snap.reconciles.total(),
                Counts::n(&self.reconcile),
            ),
            ("claim", snap.claim_calls, Counts::n(&self.claim)),
            (
                "next_work_at",
                snap.next_work_at_calls,
                Counts::n(&self.next_work_at),
            ),
            (
                "generation",
                snap.generation_probes,
                Counts::n(&self.generation),
            ),
            (
                "attempts claimed",
                snap.attempts_claimed,
                Counts::n(&self.attempts),
            ),
            (
                "attempts completed",
                snap.attempts_completed,
                Counts::n(&self.finished),
            ),
        ];
        for (what, snapshot, counted) in pairs {
            if snapshot != counted {
                return Err(format!(
                    "snapshot {what} = {snapshot}, but the source counted {counted}"
                ));
            }
        }
        Ok(())
    }
}

impl<S: Source> Source for Counted<S> {
    type Attempt = CountedAttempt<S::Attempt>;

    async fn check_ready(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        self.counts.check_ready.fetch_add(1, SeqCst);
        self.inner.check_ready(cancel).await
    }

    async fn reconcile(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        self.counts.reconcile.fetch_add(1, SeqCst);
        self.inner.reconcile(cancel).await
    }

    async fn claim(
        &self,
        capacity: NonZeroUsize,
        cancel: CancellationToken,
    ) -> Result<ClaimBatch<Self::Attempt>, SourceError> {
        self.counts.claim.fetch_add(1, SeqCst);
        self.counts.max_capacity.fetch_max(capacity.get(), SeqCst);
        let (attempts, more) = match self.inner.claim(capacity, cancel).await {
            Ok(batch) => batch.into_parts(),
            Err(e) => {
                self.counts.claim_errors.fetch_add(1, SeqCst);
                return Err(e);
            }
        };
        self.counts
            .batches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(attempts.len());
        let steer = *self.steer.lock().unwrap_or_else(|e| e.into_inner());
        let wrapped: Vec<_> = attempts
            .into_iter()
            .map(|inner| {
                let nth = self.counts.attempts.fetch_add(1, SeqCst) + 1;
                CountedAttempt {
                    inner,
                    nth,
                    steer,
                    counts: self.counts.clone(),
                }
            })
            .collect();
        Ok(if more {
            ClaimBatch::more(wrapped)
        } else {
            ClaimBatch::done(wrapped)
        })
    }

    async fn next_work_at(
        &self,
        cancel: CancellationToken,
    ) -> Result<Option<SystemTime>, SourceError> {
        self.counts.next_work_at.fetch_add(1, SeqCst);
        self.inner.next_work_at(cancel).await
    }

    async fn generation(
        &self,
        cancel: CancellationToken,
    ) -> Result<Option<Generation>, SourceError> {
        self.counts.generation.fetch_add(1, SeqCst);
        self.inner.generation(cancel).await
    }

    async fn generation_changed(
        &self,
        seen: Generation,
        cancel: CancellationToken,
    ) -> Result<Generation, SourceError> {
        self.counts.generation.fetch_add(1, SeqCst);
        self.inner.generation_changed(seen, cancel).await
    }
}

/// An attempt wrapped by [`Counted`].
#[derive(Debug)]
pub struct CountedAttempt<A> {
    inner: A,
    nth: u64,
    steer: Steer,
    counts: Arc<Counts>,
}

struct Finish(Arc<Counts>);

impl Drop for Finish {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, SeqCst);
        self.0.finished.fetch_add(1, SeqCst);
    }
}

impl<A: Attempt> Attempt for CountedAttempt<A> {
    async fn run(self, cancel: CancellationToken) -> Result<(), AttemptError> {
        let now = self.counts.in_flight.fetch_add(1, SeqCst) + 1;
        self.counts.max_in_flight.fetch_max(now, SeqCst);
        let _finish = Finish(self.counts.clone());
        match self.steer {
            Steer::Pass => self.inner.run(cancel).await,
            Steer::FailNth(n) if n == self.nth => Err(AttemptError::new("steered attempt failure")),
            Steer::PanicNth(n) if n == self.nth => panic!("steered attempt panic"),
            Steer::FailNth(_) | Steer::PanicNth(_) => self.inner.run(cancel).await,
            Steer::HoldUntilCancel => {
                cancel.cancelled().await;
                self.inner.run(cancel).await
            }
            Steer::IgnoreCancel(d) => {
                sleep(d).await;
                self.inner.run(cancel).await
            }
        }
    }
}

/// One scenario's outcome.
#[derive(Debug, Clone)]
pub struct ScenarioResult {
    /// `<label>/<scenario>`.
    pub name: String,
    /// `Ok(None)`: passed; `Ok(Some(why))`: not applicable to this adapter; `Err`: failed.
    pub outcome: Result<Option<String>, String>,
}

/// Every scenario's outcome for one adapter.
#[derive(Debug, Clone)]
pub struct ScenarioReport {
    /// The results, in order.
    pub results: Vec<ScenarioResult>,
}

impl ScenarioReport {
    /// Panics with the report unless every scenario passed or was not applicable, and at least
    /// one passed.
    ///
    /// # Panics
    ///
    /// When a scenario failed or none passed.
    #[track_caller]
    pub fn assert_passed(&self) {
        let failed = self.results.iter().any(|r| r.outcome.is_err());
        let passed = self.results.iter().any(|r| matches!(r.outcome, Ok(None)));
        assert!(!failed && passed, "conformance scenarios failed:\n{self}");
    }
}

impl fmt::Display for ScenarioReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for r in &self.results {
            match &r.outcome {
                Ok(None) => writeln!(f, "  PASS {}", r.name)?,
                Ok(Some(why)) => writeln!(f, "  N/A  {} ({why})", r.name)?,
                Err(why) => writeln!(f, "  FAIL {}: {why}", r.name)?,
            }
        }
        Ok(())
    }
}

type Outcome = Result<Option<String>, String>;

fn check(cond: bool, msg: impl FnOnce() -> String) -> Result<(), String> {
    if cond { Ok(()) } else { Err(msg()) }
}

fn e(err: impl fmt::Display) -> String {
    err.to_string()
}

/// Bound on how long any single step may take before a scenario fails.
const BOUND: Duration = Duration::from_secs(10);

struct Harness<A: ScenarioAdapter> {
    source: Arc<Counted<A::Source>>,
    counts: Arc<Counts>,
}

impl<A: ScenarioAdapter> Harness<A> {
    async fn new(adapter: &A) -> Result<Self, String> {
        let source = Arc::new(Counted::new(adapter.source().await.map_err(e)?));
        Ok(Harness {
            counts: source.counts(),
            source,
        })
    }

    fn controller(&self, config: Config) -> Result<Controller<Counted<A::Source>>, String> {
        Controller::from_arc(self.source.clone(), config).map_err(e)
    }

    async fn wait_completed(&self, adapter: &A, n: u64) -> Result<(), String> {
        let deadline = Instant::now() + BOUND;
        loop {
            let done = adapter.completed(self.source.inner()).await.map_err(e)?;
            if done >= n {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "only {done} of {n} items completed within {BOUND:?}"
                ));
            }
            sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn startup_and_readiness<A: ScenarioAdapter>(a: &A) -> Outcome {
    let h = Harness::new(a).await?;
    let ctl = h.controller(a.config())?;
    let handle = ctl.handle();
    let cancel = CancellationToken::new();
    let run = tokio::spawn(ctl.run(cancel.clone()));
    let ready = timeout(BOUND, handle.ready())
        .await
        .map_err(|_| "never Ready".to_string())?;
    check(ready, || "run stopped before Ready".into())?;
    let c = &h.counts;
    check(Counts::n(&c.check_ready) == 1, || "check_ready once".into())?;
    check(Counts::n(&c.reconcile) == 1, || {
        "one startup reconcile before Ready".into()
    })?;
    // The first claim turn follows Ready.
    wait_for(|| Counts::n(&c.next_work_at) >= 1).await?;
    cancel.cancel();
    let out = run.await.map_err(e)?;
    check(out.is_ok(), || {
        format!("clean drain expected: {:?}", out.err())
    })?;
    check(Counts::n(&c.claim) == 1, || {
        format!("one claim after Ready, got {}", Counts::n(&c.claim))
    })?;
    c.agrees_with(&handle.snapshot())?;
    Ok(None)
}

async fn cancellation_of_every_operation<A: ScenarioAdapter>(a: &A) -> Outcome {
    let h = Harness::new(a).await?;
    let src = h.source.inner();
    for op in ["check_ready", "reconcile", "claim", "next_work_at"] {
        let guard = a.block(src).await.map_err(e)?;
        let cancel = CancellationToken::new();
        let started = Instant::now();
        let c2 = cancel.clone();
        let fut = async {
            match op {
                "check_ready" => src.check_ready(c2).await.map(|_| ()),
                "reconcile" => src.reconcile(c2).await,
                "claim" => src
                    .claim(NonZeroUsize::new(1).expect("1"), c2)
                    .await
                    .map(|b| drop(b.into_parts())),
                _ => src.next_work_at(c2).await.map(|_| ()),
            }
        };
        let canceller = async {
            sleep(Duration::from_millis(100)).await;
            cancel.cancel();
        };
        let (r, ()) = timeout(BOUND, async { tokio::join!(fut, canceller) })
            .await
            .map_err(|_| format!("`{op}` did not return within {BOUND:?} of cancellation"))?;
        drop(guard);
        let _ = r; // Either outcome is allowed; what matters is that it returned.
        let _ = started;
    }
    Ok(None)
}

async fn wake_coalescing<A: ScenarioAdapter>(a: &A) -> Outcome {
    let h = Harness::new(a).await?;
    let ctl = h.controller(a.config())?;
    let handle = ctl.handle();
    let cancel = CancellationToken::new();
    let run = tokio::spawn(ctl.run(cancel.clone()));
    timeout(BOUND, handle.ready())
        .await
        .map_err(|_| "never Ready".to_string())?;
    // Let the startup claim turn finish.
    wait_for(|| Counts::n(&h.counts.next_work_at) >= 1).await?;
    a.submit(h.source.inner(), 1).await.map_err(e)?;
    let waker = handle.waker();
    for _ in 0..100 {
        waker.wake();
    }
    h.wait_completed(a, 1).await?;
    sleep(Duration::from_millis(200)).await;
    cancel.cancel();
    run.await.map_err(e)?.map_err(e)?;
    let snap = handle.snapshot();
    // Reconciliations other than startup may come from the source's own generation probe
    // (it may see the new item); each is followed by one claim turn. None may come from wakes.
    let r = snap.reconciles;
    check(r.requested == 0 && r.backstop == 0, || {
        format!("a wake never reconciles: {r:?}")
    })?;
    let by_reconcile = r.total() - r.startup;
    // Wakes raised before a claim turn begins are satisfied by it, whatever caused the turn, so
    // 100 wakes add at most two turns beyond those the reconciliations caused.
    let turns = Counts::n(&h.counts.claim).saturating_sub(1);
    check(turns >= 1 && turns <= by_reconcile + 2, || {
        format!(
            "100 wakes must coalesce into at most two claim turns: {turns} turns, \
             {by_reconcile} after reconciliations"
        )
    })?;
    h.counts.agrees_with(&handle.snapshot())?;
    Ok(None)
}

async fn wait_for(mut cond: impl FnMut() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + BOUND;
    while !cond() {
        if Instant::now() > deadline {
            return Err(format!("condition not reached within {BOUND:?}"));
        }
        sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

async fn exact_due_scheduling<A: ScenarioAdapter>(a: &A) -> Outcome {
    let h = Harness::new(a).await?;
    let config = a.config();
    let ctl = h.controller(config)?;
    let handle = ctl.handle();
    let cancel = CancellationToken::new();
    let due_in = Duration::from_millis(1500);
    // Accept before start so the startup claim's next_work_at sees it.
    let wall_now = a.config().get_clock().now();
    a.submit_due(h.source.inner(), wall_now + due_in)
        .await
        .map_err(e)?;
    let started = Instant::now();
    let run = tokio::spawn(ctl.run(cancel.clone()));
    timeout(BOUND, handle.ready())
        .await
        .map_err(|_| "never Ready".to_string())?;
    h.wait_completed(a, 1).await?;
    let took = started.elapsed();
    check(took + Duration::from_millis(50) >= due_in, || {
        format!("the item ran {took:?} after start, before it was due ({due_in:?})")
    })?;
    cancel.cancel();
    run.await.map_err(e)?.map_err(e)?;
    let snap = handle.snapshot();
    check(snap.timers_fired >= 1, || {
        "the exact due timer fired".into()
    })?;
    check(Counts::n(&h.counts.claim) <= 3, || {
        format!(
            "no claim polling before the due time: {} claims",
            Counts::n(&h.counts.claim)
        )
    })?;
    h.counts.agrees_with(&snap)?;
    Ok(None)
}

async fn capacity_and_continuation<A: ScenarioAdapter>(a: &A) -> Outcome {
    let h = Harness::new(a).await?;
    a.submit(h.source.inner(), 10).await.map_err(e)?;
    let ctl = h.controller(a.config().capacity(NonZeroUsize::new(3).expect("3")))?;
    let handle = ctl.handle();
    let cancel = CancellationToken::new();
    let run = tokio::spawn(ctl.run(cancel.clone()));
    h.wait_completed(a, 10).await?;
    cancel.cancel();
    run.await.map_err(e)?.map_err(e)?;
    let c = &h.counts;
    check(c.max_capacity.load(SeqCst) <= 3, || {
        "claim asked more than capacity".into()
    })?;
    check(c.max_in_flight.load(SeqCst) <= 3, || {
        "more than 3 attempts at once".into()
    })?;
    check(Counts::n(&c.claim) >= 4, || {
        "10 items at capacity 3 need at least 4 claims".into()
    })?;
    c.agrees_with(&handle.snapshot())?;
    Ok(None)
}

async fn attempt_failure_shutdown<A: ScenarioAdapter>(a: &A, panic: bool) -> Outcome {
    let h = Harness::new(a).await?;
    *h.source
        .steering()
        .lock()
        .unwrap_or_else(|p| p.into_inner()) = if panic {
        Steer::PanicNth(1)
    } else {
        Steer::FailNth(1)
    };
    a.submit(h.source.inner(), 1).await.map_err(e)?;
    let ctl = h.controller(a.config())?;
    let handle = ctl.handle();
    let out = timeout(BOUND, ctl.run(CancellationToken::new()))
        .await
        .map_err(|_| "run did not stop after the attempt failure".to_string())?;
    let err = out
        .err()
        .ok_or("run returned Ok after an attempt failure")?;
    let want = if panic {
        RunErrorKind::AttemptPanicked
    } else {
        RunErrorKind::AttemptFailed
    };
    check(err.kind() == want, || {
        format!("kind {:?}, want {want:?}", err.kind())
    })?;
    check(err.is_poisoned() && handle.is_poisoned(), || {
        "must poison".into()
    })?;
    h.counts.agrees_with(&handle.snapshot())?;
    Ok(None)
}

async fn graceful_drain<A: ScenarioAdapter>(a: &A) -> Outcome {
    let h = Harness::new(a).await?;
    *h.source
        .steering()
        .lock()
        .unwrap_or_else(|p| p.into_inner()) = Steer::HoldUntilCancel;
    a.submit(h.source.inner(), 2).await.map_err(e)?;
    let ctl = h.controller(a.config().shutdown_timeout(BOUND))?;
    let handle = ctl.handle();
    let cancel = CancellationToken::new();
    let run = tokio::spawn(ctl.run(cancel.clone()));
    wait_for(|| h.counts.in_flight.load(SeqCst) == 2).await?;
    cancel.cancel();
    let out = timeout(BOUND, run)
        .await
        .map_err(|_| "drain overran".to_string())?;
    let ctl = out
        .map_err(e)?
        .map_err(|err| format!("drain must be clean: {err}"))?;
    check(!handle.is_poisoned(), || {
        "clean drain must not poison".into()
    })?;
    h.counts.agrees_with(&handle.snapshot())?;
    drop(ctl);
    Ok(None)
}

async fn shutdown_timeout_fail_stop<A: ScenarioAdapter>(a: &A) -> Outcome {
    let h = Harness::new(a).await?;
    *h.source
        .steering()
        .lock()
        .unwrap_or_else(|p| p.into_inner()) = Steer::IgnoreCancel(Duration::from_secs(3));
    a.submit(h.source.inner(), 1).await.map_err(e)?;
    let bound = Duration::from_millis(300);
    let ctl = h.controller(a.config().shutdown_timeout(bound))?;
    let handle = ctl.handle();
    let cancel = CancellationToken::new();
    let run = tokio::spawn(ctl.run(cancel.clone()));
    wait_for(|| h.counts.in_flight.load(SeqCst) == 1).await?;
    let stopped = Instant::now();
    cancel.cancel();
    let out = timeout(BOUND, run)
        .await
        .map_err(|_| "shutdown overran".to_string())?;
    let err = out
        .map_err(e)?
        .err()
        .ok_or("an attempt ignored cancellation: run must fail")?;
    check(err.kind() == RunErrorKind::ShutdownTimeout, || {
        format!("kind {:?}", err.kind())
    })?;
    check(err.in_flight() == 1, || {
        format!("in flight {}", err.in_flight())
    })?;
    check(stopped.elapsed() >= bound, || {
        "returned before the bound".into()
    })?;
    check(handle.is_poisoned(), || "must poison".into())?;
    // Let the stubborn attempt finish so the store is left quiet.
    wait_for(|| h.counts.in_flight.load(SeqCst) == 0).await?;
    Ok(None)
}

/// How a generation scenario signals "another process accepted work".
#[derive(Clone, Copy, PartialEq, Eq)]
enum Signal {
    /// The cursor changes: the controller must reconcile on the change.
    Change,
    /// The probe breaks: the controller must record a loss and reconcile anyway.
    Loss,
}

async fn generation_recovery<A: ScenarioAdapter>(a: &A, signal: Signal) -> Outcome {
    let h = Harness::new(a).await?;
    let config = a.config().generation_retry(Duration::from_millis(100));
    let ctl = h.controller(config)?;
    let handle = ctl.handle();
    let cancel = CancellationToken::new();
    let run = tokio::spawn(ctl.run(cancel.clone()));
    timeout(BOUND, handle.ready())
        .await
        .map_err(|_| "never Ready".to_string())?;
    wait_for(|| Counts::n(&h.counts.next_work_at) >= 1).await?;
    // Work accepted by "another process": no in-process wake. For a loss, the item is accepted
    // first and the change signal is then lost.
    let supported = match signal {
        Signal::Change => {
            a.submit(h.source.inner(), 1).await.map_err(e)?;
            a.bump_generation(h.source.inner()).await.map_err(e)?
        }
        Signal::Loss => {
            a.submit(h.source.inner(), 1).await.map_err(e)?;
            a.break_generation(h.source.inner()).await.map_err(e)?
        }
    };
    if !supported {
        cancel.cancel();
        run.await.map_err(e)?.map_err(e)?;
        return Ok(Some(match signal {
            Signal::Change => "the source has no generation probe".into(),
            Signal::Loss => "the source has no generation probe to break".into(),
        }));
    }
    h.wait_completed(a, 1).await?;
    cancel.cancel();
    run.await.map_err(e)?.map_err(e)?;
    let snap = handle.snapshot();
    match signal {
        Signal::Change => {
            check(snap.generation_changes >= 1, || {
                "the change was observed".into()
            })?;
            check(snap.reconciles.generation_change >= 1, || {
                "the change reconciled".into()
            })?;
        }
        Signal::Loss => {
            check(snap.generation_losses >= 1, || {
                "the loss was recorded".into()
            })?;
            check(snap.reconciles.generation_loss >= 1, || {
                "the loss reconciled".into()
            })?;
        }
    }
    check(snap.poisoned.is_none(), || {
        "a generation signal never poisons".into()
    })?;
    h.counts.agrees_with(&snap)?;
    Ok(None)
}

/// Runs every scenario against `adapter`.
pub async fn run_all<A: ScenarioAdapter>(adapter: &A) -> ScenarioReport {
    let label = adapter.label();
    let mut results = Vec::new();
    macro_rules! scenario {
        ($name:literal, $fut:expr) => {
            results.push(ScenarioResult {
                name: format!("{label}/{}", $name),
                outcome: $fut.await,
            });
        };
    }
    scenario!("startup-and-readiness", startup_and_readiness(adapter));
    scenario!(
        "cancellation-of-every-operation",
        cancellation_of_every_operation(adapter)
    );
    scenario!("wake-coalescing", wake_coalescing(adapter));
    scenario!("exact-due-scheduling", exact_due_scheduling(adapter));
    scenario!(
        "capacity-and-continuation",
        capacity_and_continuation(adapter)
    );
    scenario!(
        "attempt-error-shutdown",
        attempt_failure_shutdown(adapter, false)
    );
    scenario!(
        "attempt-panic-shutdown",
        attempt_failure_shutdown(adapter, true)
    );
    scenario!("graceful-drain", graceful_drain(adapter));
    scenario!(
        "shutdown-timeout-fail-stop",
        shutdown_timeout_fail_stop(adapter)
    );
    scenario!(
        "generation-change-recovery",
        generation_recovery(adapter, Signal::Change)
    );
    scenario!(
        "generation-loss-recovery",
        generation_recovery(adapter, Signal::Loss)
    );
    ScenarioReport { results }
}
