//! The crash matrix: proves a durable-critical family's lifecycle across every crash point.
//!
//! For each required [`CrashPoint`] the matrix runs one *cell*, labelled
//! `<family label>/<point>` (e.g. `bulk/postgres/after-claim`):
//!
//! 1. **construct**: builds one store fixture, calls [`CrashFamily::new_worker`] twice with that
//!    exact fixture (the first worker gets a [`Faults`] hook armed at the point, the second an
//!    unarmed one), and requires two distinct workers (`Arc::ptr_eq` false) that are both bound
//!    to that fixture ([`CrashFamily::worker_fixture`]).
//! 2. **crash**: runs [`CrashFamily::crash`] with the first worker, on a runtime of its own (the
//!    first worker is also built there). The moment the armed point fires, the callback and
//!    every task it spawned through its [`CrashContext`] are aborted, and then the crash runtime
//!    is shut down, so tasks spawned any other way (plain `tokio::spawn`) die too, as in a killed
//!    process: nothing of the crashed worker runs during restart. A callback that finishes
//!    without reaching the point fails the cell, naming the point; so does a callback that
//!    returns a [`Crash`] while the hook the matrix armed never fired (a forged crash).
//! 3. **restart**: runs [`CrashFamily::restart`] with the second worker (restart and drain).
//! 4. **recover**: runs [`CrashFamily::recover`] with the same fixture: the domain's own
//!    assertion on persisted state.
//!
//! Every phase runs on the cell's own multi-threaded runtime while the matrix waits on its own
//! thread, so a phase deadline holds even when a callback ignores cancellation or blocks a thread;
//! a timed-out phase fails the cell with its name and the matrix goes on to the next cell.
//!
//! Set `NEXUSCRM_CRASH_FILTER` to a substring of cell labels to run only those cells; a filter
//! that selects nothing fails the run.
//!
//! # What the matrix proves, and what it does not
//!
//! It proves that concrete lifecycle objects were created and passed in the required sequence:
//! one fixture, two distinct workers bound to it, a crash that really fired at each boundary, a
//! fresh worker restarting on the same store, and the domain's assertion run on that store. It
//! cannot prove what the callbacks did with them: only each family's real store assertions
//! (rows applied exactly once, no acknowledged job lost, checked in the database) prove the
//! family's durability promise.

use std::fmt;
use std::future::Future;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nexuscrm_worker::fault::{Crash, CrashPoint, Faults};
use nexuscrm_worker::{BoxError, Declaration, Durability};
use tokio::task::AbortHandle;
use tokio_util::sync::CancellationToken;

/// A work family under test. Implemented once per family and backend.
pub trait CrashFamily: Send + Sync + 'static {
    /// The durable store fixture shared by both workers and the recovery assertion.
    type Fixture: Send + Sync + 'static;
    /// One worker "process" over the fixture.
    type Worker: Send + Sync + 'static;

    /// The label prefix of this family's cells, e.g. `bulk/postgres`.
    fn label(&self) -> String;

    /// The family's declaration; only durable-critical declarations have crash points.
    fn declaration(&self) -> Declaration;

    /// Builds a fresh, isolated store fixture (its own database, schema or file).
    fn fixture(&self) -> impl Future<Output = Result<Self::Fixture, BoxError>> + Send;

    /// Builds a worker over `fixture`, threading `faults` through its real code paths.
    fn new_worker(
        &self,
        fixture: &Arc<Self::Fixture>,
        faults: Faults,
    ) -> impl Future<Output = Result<Arc<Self::Worker>, BoxError>> + Send;

    /// The fixture `worker` is bound to (the matrix checks it is the one it passed).
    fn worker_fixture<'a>(&self, worker: &'a Self::Worker) -> &'a Arc<Self::Fixture>;

    /// Drives `worker` (accepting work first if the point needs it) until the armed point fires.
    /// Spawn background tasks with [`CrashContext::spawn`] so the crash can kill them.
    fn crash(
        &self,
        point: CrashPoint,
        worker: Arc<Self::Worker>,
        ctx: CrashContext,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Restarts on the second worker and drains the accepted work.
    fn restart(
        &self,
        point: CrashPoint,
        worker: Arc<Self::Worker>,
        ctx: CrashContext,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// The domain's recovery assertion on persisted state.
    fn recover(
        &self,
        point: CrashPoint,
        fixture: Arc<Self::Fixture>,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;
}

/// Handed to the crash and restart callbacks: the worker's fault hook, a cancellation token, and
/// a spawner whose tasks die with the "process".
#[derive(Clone, Debug)]
pub struct CrashContext {
    faults: Faults,
    cancel: CancellationToken,
    tasks: Arc<Mutex<Vec<AbortHandle>>>,
}

impl CrashContext {
    fn new(faults: Faults) -> Self {
        CrashContext {
            faults,
            cancel: CancellationToken::new(),
            tasks: Arc::default(),
        }
    }

    /// The fault hook of this phase's worker.
    #[must_use]
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// Cancelled when the phase must stop (deadline, crash, or end of the phase).
    #[must_use]
    pub fn cancel(&self) -> &CancellationToken {
        &self.cancel
    }

    /// Spawns a task that belongs to this worker process: it is aborted when the crash fires
    /// or the phase ends.
    pub fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let handle = tokio::spawn(fut);
        self.tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(handle.abort_handle());
        handle
    }

    fn kill(&self) {
        self.cancel.cancel();
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            t.abort();
        }
    }
}

/// Per-phase deadlines. Defaults: construct 30 s, crash 60 s, restart 120 s, recover 30 s.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    /// Fixture and both workers.
    pub construct: Duration,
    /// The crash callback, until the point fires.
    pub crash: Duration,
    /// Restart and drain.
    pub restart: Duration,
    /// The recovery assertion.
    pub recover: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            construct: Duration::from_secs(30),
            crash: Duration::from_secs(60),
            restart: Duration::from_secs(120),
            recover: Duration::from_secs(30),
        }
    }
}

/// A matrix phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Fixture and worker construction.
    Construct,
    /// The crash callback.
    Crash,
    /// Restart and drain.
    Restart,
    /// The recovery assertion.
    Recover,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Construct => "construct",
            Phase::Crash => "crash",
            Phase::Restart => "restart",
            Phase::Recover => "recover",
        })
    }
}

/// The outcome of one cell.
#[derive(Debug, Clone)]
pub struct Cell {
    /// `<family label>/<point>`.
    pub label: String,
    /// The crash point.
    pub point: CrashPoint,
    /// `None` when the cell passed; otherwise the failing phase and why.
    pub failure: Option<(Phase, String)>,
    /// Time spent in each phase that ran.
    pub timings: Vec<(Phase, Duration)>,
}

impl Cell {
    /// Whether the cell passed.
    #[must_use]
    pub fn passed(&self) -> bool {
        self.failure.is_none()
    }
}

/// The matrix report: one row per cell.
#[derive(Debug, Clone)]
pub struct Report {
    /// The family label.
    pub family: String,
    /// The cells that ran.
    pub cells: Vec<Cell>,
    /// Why the whole run is invalid (no cell selected, declaration has no points), if it is.
    pub invalid: Option<String>,
}

impl Report {
    /// Whether every selected cell passed and at least one ran.
    #[must_use]
    pub fn passed(&self) -> bool {
        self.invalid.is_none() && !self.cells.is_empty() && self.cells.iter().all(Cell::passed)
    }

    /// The failing cell for `point`, if any.
    #[must_use]
    pub fn cell(&self, point: CrashPoint) -> Option<&Cell> {
        self.cells.iter().find(|c| c.point == point)
    }

    /// Panics with the whole report unless it [`passed`](Report::passed).
    ///
    /// # Panics
    ///
    /// When any cell failed or none ran.
    #[track_caller]
    pub fn assert_passed(&self) {
        assert!(self.passed(), "crash matrix failed:\n{self}");
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "crash matrix for {}", self.family)?;
        if let Some(why) = &self.invalid {
            writeln!(f, "  INVALID: {why}")?;
        }
        for c in &self.cells {
            let total: Duration = c.timings.iter().map(|t| t.1).sum();
            match &c.failure {
                None => writeln!(f, "  PASS {:<40} {:>8.1?}", c.label, total)?,
                Some((phase, why)) => {
                    writeln!(f, "  FAIL {:<40} {:>8.1?}  [{phase}] {why}", c.label, total)?
                }
            }
        }
        let passed = self.cells.iter().filter(|c| c.passed()).count();
        write!(f, "  {passed} of {} cells passed", self.cells.len())
    }
}

/// Runs a [`CrashFamily`] through every crash point its declaration requires.
#[derive(Debug)]
pub struct CrashMatrix<F> {
    family: Arc<F>,
    deadlines: Deadlines,
    filter: Option<String>,
}

/// The environment variable that filters cells by label substring.
pub const FILTER_ENV: &str = "NEXUSCRM_CRASH_FILTER";

impl<F: CrashFamily> CrashMatrix<F> {
    /// A matrix over `family` with default deadlines, filtered by `NEXUSCRM_CRASH_FILTER`.
    #[must_use]
    pub fn new(family: F) -> Self {
        CrashMatrix {
            family: Arc::new(family),
            deadlines: Deadlines::default(),
            filter: std::env::var(FILTER_ENV).ok().filter(|s| !s.is_empty()),
        }
    }

    /// Overrides the per-phase deadlines.
    #[must_use]
    pub fn deadlines(mut self, deadlines: Deadlines) -> Self {
        self.deadlines = deadlines;
        self
    }

    /// Overrides the label filter (`None`: every cell).
    #[must_use]
    pub fn filter(mut self, filter: Option<&str>) -> Self {
        self.filter = filter.map(str::to_owned);
        self
    }

    /// Runs only the given points (for focused tests), still subject to the filter.
    pub fn run_points(&self, points: &[CrashPoint]) -> Report {
        let family = self.family.label();
        let declaration = self.family.declaration();
        let required = CrashPoint::required_for(&declaration);
        let mut report = Report {
            family: family.clone(),
            cells: Vec::new(),
            invalid: None,
        };
        if declaration.durability() != Durability::DurableCritical {
            report.invalid = Some(format!(
                "{declaration} is not durable-critical: the crash matrix has no points for it"
            ));
            return report;
        }
        for &point in points.iter().filter(|p| required.contains(p)) {
            let label = format!("{family}/{point}");
            if let Some(f) = &self.filter
                && !label.contains(f.as_str())
            {
                continue;
            }
            report.cells.push(self.run_cell(point, label));
        }
        if report.cells.is_empty() {
            report.invalid = Some(match &self.filter {
                Some(f) => format!("the filter {f:?} ({FILTER_ENV}) selected no cell"),
                None => "no cell ran".into(),
            });
        }
        report
    }

    /// Runs every required point.
    pub fn run(&self) -> Report {
        self.run_points(&CrashPoint::ALL)
    }

    fn run_cell(&self, point: CrashPoint, label: String) -> Cell {
        let mut cell = Cell {
            label,
            point,
            failure: None,
            timings: Vec::new(),
        };
        let build = || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
        };
        // The crashed "process" gets a runtime of its own: shutting it down after the crash
        // ends every task it spawned, however it spawned them.
        let (rt, crash_rt) = match (build(), build()) {
            (Ok(rt), Ok(crash_rt)) => (rt, crash_rt),
            (Err(e), _) | (_, Err(e)) => {
                cell.failure = Some((Phase::Construct, format!("cannot build a runtime: {e}")));
                return cell;
            }
        };
        let result = self.phases(&rt, crash_rt, point, &mut cell);
        if let Err(failure) = result {
            cell.failure = Some(failure);
        }
        // Never wait for a stuck callback: leave its threads behind.
        rt.shutdown_background();
        cell
    }

    fn phases(
        &self,
        rt: &tokio::runtime::Runtime,
        crash_rt: tokio::runtime::Runtime,
        point: CrashPoint,
        cell: &mut Cell,
    ) -> Result<(), (Phase, String)> {
        let fam = self.family.clone();
        let crash_faults = Faults::new();
        let restart_faults = Faults::new();

        // 1. Construct, in this order: the fixture, the worker that will crash (on the crash
        // runtime, so its pools and tasks die with it), the restart worker.
        let fixture = timed(
            cell,
            Phase::Construct,
            rt,
            self.deadlines.construct,
            async move {
                Ok(Arc::new(
                    fam.fixture().await.map_err(|e| format!("fixture: {e}"))?,
                ))
            },
        )?;
        let (fam, cf, fx) = (self.family.clone(), crash_faults.clone(), fixture.clone());
        let first = timed(
            cell,
            Phase::Construct,
            &crash_rt,
            self.deadlines.construct,
            async move {
                fam.new_worker(&fx, cf)
                    .await
                    .map_err(|e| format!("new_worker (first): {e}"))
            },
        )?;
        let (fam, rf, fx) = (self.family.clone(), restart_faults.clone(), fixture.clone());
        let second = timed(
            cell,
            Phase::Construct,
            rt,
            self.deadlines.construct,
            async move {
                fam.new_worker(&fx, rf)
                    .await
                    .map_err(|e| format!("new_worker (second): {e}"))
            },
        )?;
        if Arc::ptr_eq(&first, &second) {
            return Err((
                Phase::Construct,
                "new_worker returned the same worker twice: a restart needs a fresh worker".into(),
            ));
        }
        for (which, w) in [("first", &first), ("second", &second)] {
            if !Arc::ptr_eq(self.family.worker_fixture(w), &fixture) {
                return Err((
                    Phase::Construct,
                    format!("the {which} worker is not bound to the fixture the matrix passed"),
                ));
            }
        }

        // 2. Crash.
        crash_faults.arm(point);
        let fam = self.family.clone();
        let ctx = CrashContext::new(crash_faults.clone());
        let watch = crash_faults.clone();
        let crash_ctx = ctx.clone();
        let outcome = timed(
            cell,
            Phase::Crash,
            &crash_rt,
            self.deadlines.crash,
            async move {
                let mut task = tokio::spawn({
                    let ctx = crash_ctx.clone();
                    async move { fam.crash(point, first, ctx).await }
                });
                tokio::select! {
                    fired = watch.crashed() => {
                        // Kill the "process": the callback and everything it spawned.
                        task.abort();
                        crash_ctx.kill();
                        Ok(Some(fired))
                    }
                    done = &mut task => {
                        crash_ctx.kill();
                        match done {
                            Ok(Ok(())) => Ok(None),
                            Ok(Err(e)) => match Crash::find(&*e) {
                                Some(c) => Ok(Some(c.point())),
                                None => Err(format!("the crash callback failed: {e}")),
                            },
                            Err(e) if e.is_panic() => Err(format!(
                                "the crash callback panicked: {}",
                                panic_text(e.into_panic())
                            )),
                            Err(e) => Err(format!("the crash callback was cancelled: {e}")),
                        }
                    }
                }
            },
        );
        if outcome.is_err() {
            ctx.kill();
        }
        // The crash ends the process: every task on its runtime, including any the callback
        // spawned with plain `tokio::spawn` instead of `CrashContext::spawn`, is dropped before
        // the restart begins (bounded, so a thread stuck in blocking code cannot hang us).
        crash_rt.shutdown_timeout(self.deadlines.crash);
        let outcome = outcome?;
        // The crash must be the one the matrix armed: an error that merely carries a `Crash`
        // (from a private hook of the adapter's) while the armed hook never fired is forged.
        if outcome.is_some() && crash_faults.fired() != Some(point) {
            return Err((
                Phase::Crash,
                format!(
                    "the crash callback reported a crash, but the hook the matrix armed at {point} \
                     never fired (fired: {:?}): the crash did not happen where the matrix put it",
                    crash_faults.fired()
                ),
            ));
        }
        match outcome {
            Some(p) if p == point => {}
            Some(p) => {
                return Err((
                    Phase::Crash,
                    format!("the crash fired at {p}, not at the armed point {point}"),
                ));
            }
            None => {
                return Err((
                    Phase::Crash,
                    format!(
                        "the crash at {point} never fired: the callback returned without reaching \
                         the armed point ({} hit(s))",
                        crash_faults.hits(point)
                    ),
                ));
            }
        }

        // 3. Restart on the fresh worker.
        let fam = self.family.clone();
        let ctx = CrashContext::new(restart_faults);
        let restart_ctx = ctx.clone();
        let restarted = timed(
            cell,
            Phase::Restart,
            rt,
            self.deadlines.restart,
            async move {
                let r = fam.restart(point, second, restart_ctx.clone()).await;
                restart_ctx.kill();
                r.map_err(|e| format!("restart failed: {e}"))
            },
        );
        ctx.kill();
        restarted?;

        // 4. Recovery assertion on the same fixture.
        let fam = self.family.clone();
        timed(
            cell,
            Phase::Recover,
            rt,
            self.deadlines.recover,
            async move {
                fam.recover(point, fixture)
                    .await
                    .map_err(|e| format!("recovery assertion failed: {e}"))
            },
        )?;
        Ok(())
    }
}

/// Runs `fut` on `rt` and waits for it from this thread with a deadline that holds even if the
/// future blocks its runtime thread or ignores cancellation.
fn timed<T: Send + 'static>(
    cell: &mut Cell,
    phase: Phase,
    rt: &tokio::runtime::Runtime,
    deadline: Duration,
    fut: impl Future<Output = Result<T, String>> + Send + 'static,
) -> Result<T, (Phase, String)> {
    let (tx, rx) = mpsc::channel();
    let started = Instant::now();
    let inner = rt.spawn(fut);
    let abort = inner.abort_handle();
    rt.spawn(async move {
        let r = match inner.await {
            Ok(r) => r,
            Err(e) if e.is_panic() => Err(format!("panicked: {}", panic_text(e.into_panic()))),
            Err(e) => Err(format!("cancelled: {e}")),
        };
        let _ = tx.send(r);
    });
    let waited = rx.recv_timeout(deadline);
    cell.timings.push((phase, started.elapsed()));
    match waited {
        Ok(r) => r.map_err(|e| (phase, e)),
        Err(mpsc::RecvTimeoutError::Timeout) => {
            abort.abort();
            Err((
                phase,
                format!(
                    "timed out after {deadline:?} (the callback ignored cancellation or blocked)"
                ),
            ))
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            Err((phase, "the phase task vanished without a result".into()))
        }
    }
}

fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}
