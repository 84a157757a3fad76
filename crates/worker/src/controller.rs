//! The controller: drives one [`Source`] without polling an empty queue.

use std::any::Any;
use std::error::Error;
use std::fmt;
use std::future::Future;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::{Notify, watch};
use tokio::task::{JoinError, JoinHandle, JoinSet};
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ConfigError};
use crate::handoff::{Handed, Handoff, HandoffGate};
use crate::snapshot::{Counters, ReconcileCause, Snapshot, bump};
use crate::source::{Attempt, AttemptError, BoxError, ClaimBatch, Generation, Source, SourceError};

/// Timers further out than this are clamped; the backstop re-asks `next_work_at` long before.
const MAX_TIMER: Duration = Duration::from_secs(365 * 24 * 3600);

/// How far ahead of a due time a [precise timer](crate::Config::precise_timers) wakes on tokio's
/// wheel (whose ticks are 1 ms, rounded up, and whose driver wait rounds up again) before
/// sleeping the rest on the blocking pool.
pub const PRECISE_TIMER_LEAD: Duration = Duration::from_millis(2);

/// Sleeps until `deadline`: on tokio's wheel, or, when `precise`, on the wheel until
/// [`PRECISE_TIMER_LEAD`] before it and then with `std::thread::sleep` on the blocking pool,
/// so it ends within microseconds after `deadline` instead of about a millisecond. Never
/// before `deadline`: under tokio's paused clock the thread's sleep does not move tokio's
/// clock, so the end is waited on the wheel. Cancel-safe (dropping it leaves at most one
/// short sleep running on the blocking pool).
async fn sleep_until_due(deadline: Instant, precise: bool) {
    if precise {
        if let Some(early) = deadline.checked_sub(PRECISE_TIMER_LEAD) {
            sleep_until(early).await;
        }
        let rest = deadline.saturating_duration_since(Instant::now());
        if !rest.is_zero() {
            // A failed join (the runtime shutting down) only means the wheel waits instead.
            let _ = tokio::task::spawn_blocking(move || std::thread::sleep(rest)).await;
        }
        if Instant::now() >= deadline {
            // Not through the wheel: it would wait for its next tick even for a passed time.
            return;
        }
    }
    sleep_until(deadline).await;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Idle,
    Starting,
    Ready,
    Stopped,
}

#[derive(Debug)]
struct Shared {
    name: String,
    capacity: usize,
    counters: Counters,
    signal: Notify,
    wake_pending: AtomicBool,
    retime_pending: AtomicBool,
    reconcile_requested: AtomicBool,
    generation_changed: AtomicBool,
    generation_lost: AtomicBool,
    phase: watch::Sender<Phase>,
}

impl Shared {
    fn raise(&self, flag: &AtomicBool) {
        flag.store(true, Relaxed);
        self.signal.notify_one();
    }

    fn set_phase(&self, phase: Phase) {
        self.counters.ready.store(phase == Phase::Ready, Relaxed);
        self.phase.send_replace(phase);
    }
}

/// Drives one domain [`Source`]: startup gate, reconciliation, bounded claims, attempts, exact
/// due timers, coalesced wakes, generation changes, the reconciliation backstop, drain and
/// fail-stop.
///
/// [`run`](Controller::run) consumes the controller and hands it back only where reuse is safe
/// (a clean drain, a `check_ready` error, a `not_committed` error). After an outcome-unknown
/// error, an attempt failure or a shutdown timeout the controller is *poisoned*: it is not handed
/// back, so it can never run again, and the reason stays readable through
/// [`ControllerHandle::snapshot`].
pub struct Controller<S: Source> {
    source: Arc<S>,
    config: Config,
    shared: Arc<Shared>,
}

impl<S: Source> fmt::Debug for Controller<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Controller")
            .field("name", &self.shared.name)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<S: Source> Drop for Controller<S> {
    fn drop(&mut self) {
        // No run can follow: wake `ready()` waiters with `false`.
        self.shared.set_phase(Phase::Stopped);
    }
}

impl<S: Source> Controller<S> {
    /// Builds a controller over `source`, validating `config`.
    pub fn new(source: S, config: Config) -> Result<Self, ConfigError> {
        Controller::from_arc(Arc::new(source), config)
    }

    /// Builds a controller over a shared `source` (so producers in the process can keep a
    /// reference), validating `config`.
    pub fn from_arc(source: Arc<S>, config: Config) -> Result<Self, ConfigError> {
        config.validate()?;
        let shared = Arc::new(Shared {
            name: config.name.clone(),
            capacity: config.capacity.get(),
            counters: Counters::default(),
            signal: Notify::new(),
            wake_pending: AtomicBool::new(false),
            retime_pending: AtomicBool::new(false),
            reconcile_requested: AtomicBool::new(false),
            generation_changed: AtomicBool::new(false),
            generation_lost: AtomicBool::new(false),
            phase: watch::Sender::new(Phase::Idle),
        });
        Ok(Controller {
            source,
            config,
            shared,
        })
    }

    /// A cheap, clonable handle for wakes, reconcile requests, readiness and snapshots. It stays
    /// valid after the controller is consumed or poisoned.
    #[must_use]
    pub fn handle(&self) -> ControllerHandle {
        ControllerHandle {
            shared: self.shared.clone(),
        }
    }

    /// Shorthand for `self.handle().waker()`.
    #[must_use]
    pub fn waker(&self) -> Waker {
        self.handle().waker()
    }

    /// The source this controller drives.
    #[must_use]
    pub fn source(&self) -> &Arc<S> {
        &self.source
    }

    /// The validated configuration.
    #[must_use]
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Runs the controller until `cancel` fires or a stopping error occurs.
    ///
    /// Protocol: `check_ready`, then the optional generation cursor, then one `reconcile`, then
    /// Ready, then claim turns. A claim asks for at most the free capacity; `ClaimBatch::more`
    /// continues at once (or as soon as capacity frees); a terminal batch asks `next_work_at` once
    /// and arms one exact timer for a strictly-future answer. Wakes offer a claim turn; reconcile
    /// requests, generation changes and the backstop reconcile before the next claim turn.
    ///
    /// Returns `Ok(self)` after a clean drain. Returns an error that hands the controller back
    /// ([`RunError::into_controller`]) for a `check_ready` error or a `not_committed` Source
    /// error. Every other error poisons the controller.
    ///
    /// # Cancel safety
    ///
    /// Cancel through `cancel`, not by dropping this future. Cancellation stops new claims,
    /// cancels attempts and waits at most the shutdown timeout for attempts and any in-flight
    /// Source operation, which is never dropped mid-await. If this future is dropped anyway,
    /// in-flight attempts and Source operations are cancelled and left running to completion on
    /// their tasks (never aborted), and the controller is poisoned.
    pub async fn run(self, cancel: CancellationToken) -> Result<Self, RunError<S>> {
        bump(&self.shared.counters.runs);
        self.shared.set_phase(Phase::Starting);
        let mut run = Run::new(&self, &cancel);
        run.drive().await;
        run.drain().await;
        let end = run.finish();
        // Idle: the controller may be handed back and run again. A poisoned controller is
        // dropped below, which moves the phase to Stopped for good.
        self.shared.set_phase(Phase::Idle);
        match end {
            End::Clean => Ok(self),
            End::Reusable(kind, op, error) => Err(RunError {
                kind,
                name: self.shared.name.clone(),
                op,
                message: error.to_string(),
                error: Some(Box::new(error)),
                in_flight: 0,
                controller: Some(self),
            }),
            End::Poisoned(failure, in_flight) => {
                let message = failure.message;
                let reason = if in_flight > 0 && failure.kind != RunErrorKind::ShutdownTimeout {
                    format!(
                        "{message}; {in_flight} attempt(s) still in flight after the shutdown bound"
                    )
                } else {
                    message.clone()
                };
                let _ = self.shared.counters.poisoned.set(reason);
                log_event!(error, controller = %self.shared.name, reason = %message, "controller poisoned");
                Err(RunError {
                    kind: failure.kind,
                    name: self.shared.name.clone(),
                    op: failure.op,
                    message,
                    error: failure.error,
                    in_flight,
                    controller: None,
                })
            }
        }
    }
}

/// A clonable handle to a controller: wakes, reconcile requests, readiness and snapshots.
#[derive(Clone)]
pub struct ControllerHandle {
    shared: Arc<Shared>,
}

impl fmt::Debug for ControllerHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ControllerHandle")
            .field("name", &self.shared.name)
            .finish_non_exhaustive()
    }
}

impl ControllerHandle {
    /// A waker for producers in this process.
    #[must_use]
    pub fn waker(&self) -> Waker {
        Waker {
            shared: self.shared.clone(),
        }
    }

    /// Asks for a reconciliation before the next claim turn.
    ///
    /// Requests coalesce: any number made before the reconciliation starts cause one. A request
    /// made while a reconciliation is running causes one more after it.
    pub fn request_reconcile(&self) {
        self.shared.raise(&self.shared.reconcile_requested);
    }

    /// A point-in-time copy of the counters (lock-free reads of atomics).
    #[must_use]
    pub fn snapshot(&self) -> Snapshot {
        self.shared
            .counters
            .snapshot(&self.shared.name, self.shared.capacity)
    }

    /// Whether the controller has been poisoned (it can never run again).
    #[must_use]
    pub fn is_poisoned(&self) -> bool {
        self.shared.counters.poisoned.get().is_some()
    }

    /// Why the controller was poisoned, if it was.
    #[must_use]
    pub fn poison_reason(&self) -> Option<String> {
        self.shared.counters.poisoned.get().cloned()
    }

    /// Waits until a run reports Ready, returning `true`; returns `false` once no run can follow
    /// (the controller was poisoned or dropped). Called between two runs of a handed-back
    /// controller, it waits for the next run.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub async fn ready(&self) -> bool {
        let mut rx = self.shared.phase.subscribe();
        match rx
            .wait_for(|p| matches!(p, Phase::Ready | Phase::Stopped))
            .await
        {
            Ok(p) => *p == Phase::Ready,
            Err(_) => false,
        }
    }
}

/// Process-local claim hint, built on [`tokio::sync::Notify`] semantics.
///
/// If [`wake`](Waker::wake) is called any number of times before the controller's next claim
/// turn begins, a single turn results: like `notify_one()`, only a single permit is stored. A
/// wake never causes a reconciliation and is not a delivery guarantee: reconciliation and the due
/// timer carry correctness.
#[derive(Clone)]
pub struct Waker {
    shared: Arc<Shared>,
}

impl fmt::Debug for Waker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Waker")
            .field("controller", &self.shared.name)
            .finish()
    }
}

impl Waker {
    /// Offers the controller one claim turn (coalesced with any turn already pending).
    pub fn wake(&self) {
        let c = &self.shared.counters;
        bump(&c.wakes_received);
        if self.shared.wake_pending.swap(true, Relaxed) {
            bump(&c.wakes_coalesced);
        } else {
            self.shared.signal.notify_one();
        }
    }

    /// Tells the controller that the next work time may have moved (an attempt just committed a
    /// new due time, say): it re-reads [`Source::next_work_at`] and re-arms its timer, without
    /// a claim. Coalesced; a pending claim turn satisfies it.
    pub fn retime(&self) {
        bump(&self.shared.counters.retimes_received);
        if !self.shared.retime_pending.swap(true, Relaxed) {
            self.shared.signal.notify_one();
        }
    }
}

/// What stopped a run. `#[non_exhaustive]`: match with a wildcard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RunErrorKind {
    /// `check_ready` failed. Not poisoned; the controller is handed back.
    NotReady,
    /// `reconcile`, `claim` or an attempt ([`AttemptError::not_committed`]) failed with a proven
    /// not-committed error. Not poisoned.
    ///
    /// [`AttemptError::not_committed`]: crate::AttemptError::not_committed
    NotCommitted,
    /// A newer deployment generation fenced the source out ([`SourceError::superseded`]):
    /// nothing committed, so the controller is handed back and not poisoned, but restarting it
    /// would only be fenced out again: the process should stop (the Runtime Worker exits 1).
    Superseded,
    /// `reconcile` or `claim` failed and a durable transition may have committed. Poisoned.
    OutcomeUnknown,
    /// The source broke the protocol (too many attempts, an empty batch asking for more).
    /// Poisoned.
    ContractViolation,
    /// An attempt returned `Err`. Poisoned.
    AttemptFailed,
    /// An attempt panicked. Poisoned.
    AttemptPanicked,
    /// A Source operation panicked. Poisoned.
    SourcePanicked,
    /// Attempts or a Source operation outlived the shutdown bound. Poisoned: they may still be
    /// executing, so the process must be replaced.
    ShutdownTimeout,
    /// The `run` future was dropped while running. Poisoned.
    Dropped,
}

impl RunErrorKind {
    /// Whether this kind leaves the controller poisoned.
    #[must_use]
    pub fn poisons(self) -> bool {
        !matches!(
            self,
            RunErrorKind::NotReady | RunErrorKind::NotCommitted | RunErrorKind::Superseded
        )
    }
}

/// Why [`Controller::run`] stopped with an error.
///
/// Opaque; inspect with [`kind`](RunError::kind), [`is_poisoned`](RunError::is_poisoned),
/// [`in_flight`](RunError::in_flight) and [`Error::source`].
pub struct RunError<S: Source> {
    kind: RunErrorKind,
    name: String,
    op: Option<&'static str>,
    message: String,
    error: Option<BoxError>,
    in_flight: usize,
    controller: Option<Controller<S>>,
}

impl<S: Source> RunError<S> {
    /// What stopped the run.
    #[must_use]
    pub fn kind(&self) -> RunErrorKind {
        self.kind
    }

    /// Whether the controller is poisoned (and so not handed back).
    #[must_use]
    pub fn is_poisoned(&self) -> bool {
        self.controller.is_none()
    }

    /// Whether a durable transition may have committed before the error.
    #[must_use]
    pub fn is_outcome_unknown(&self) -> bool {
        self.kind == RunErrorKind::OutcomeUnknown
    }

    /// Whether a newer deployment generation fenced the source out (see
    /// [`RunErrorKind::Superseded`]).
    #[must_use]
    pub fn is_superseded(&self) -> bool {
        self.kind == RunErrorKind::Superseded
    }

    /// The Source operation involved (`check_ready`, `reconcile`, `claim`, `next_work_at`,
    /// `generation`), if any.
    #[must_use]
    pub fn operation(&self) -> Option<&'static str> {
        self.op
    }

    /// Attempts still executing when `run` returned (past the shutdown bound). The supervisor
    /// must end the process before replacing the controller.
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// The controller, when reuse is safe (`NotReady`, `NotCommitted`, `Superseded`); `None`
    /// when poisoned.
    #[must_use]
    pub fn into_controller(self) -> Option<Controller<S>> {
        self.controller
    }
}

impl<S: Source> fmt::Debug for RunError<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunError")
            .field("kind", &self.kind)
            .field("controller", &self.name)
            .field("op", &self.op)
            .field("message", &self.message)
            .field("in_flight", &self.in_flight)
            .field("poisoned", &self.is_poisoned())
            .finish()
    }
}

impl<S: Source> fmt::Display for RunError<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "controller `{}`: {}", self.name, self.message)?;
        if self.in_flight > 0 && self.kind != RunErrorKind::ShutdownTimeout {
            write!(f, "; {} attempt(s) still in flight", self.in_flight)?;
        }
        if self.is_poisoned() {
            f.write_str(" (poisoned: the process must be replaced)")?;
        }
        Ok(())
    }
}

impl<S: Source> Error for RunError<S> {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.error.as_deref().map(|e| e as &(dyn Error + 'static))
    }
}

struct Failure {
    kind: RunErrorKind,
    op: Option<&'static str>,
    message: String,
    error: Option<BoxError>,
}

enum End {
    Clean,
    Reusable(RunErrorKind, Option<&'static str>, SourceError),
    Poisoned(Failure, usize),
}

enum OpFailure {
    Panicked(String),
    Abandoned,
}

/// A finished claim: the slots it reserved, when it was issued, and its answer.
type ClaimDone<A> = (NonZeroUsize, Instant, Result<ClaimBatch<A>, SourceError>);

/// The state of one `run`.
struct Run<S: Source> {
    source: Arc<S>,
    config: Config,
    shared: Arc<Shared>,
    stop: CancellationToken,
    attempts: JoinSet<Result<Handed<S::Attempt>, AttemptError>>,
    /// The successor-handoff offer: open only under a standing continuation, with no
    /// reconciliation asked for, while not stopping, and only when the config turns it on.
    gate: Arc<HandoffGate>,
    /// A terminal answer came while other claims or begun handoffs were outstanding: the
    /// `next_work_at` read waits for the last of them (a `more` answer cancels it).
    read_pending: bool,
    /// Claims in flight, each answering with the slots it reserved and when it was issued.
    claims: JoinSet<ClaimDone<S::Attempt>>,
    /// Slots asked by the claims in flight: attempts plus these never exceed the capacity.
    reserved: usize,
    /// The latest claim answer asked for continuation (`more`) and no terminal answer came
    /// since: the authority under which another claim may start beside one in flight.
    continuation: bool,
    deadline: Option<Instant>,
    failure: Option<Failure>,
    reusable: Option<(RunErrorKind, &'static str, SourceError)>,
    abandoned: usize,
    claim_pending: bool,
    /// When the latest claim began (the controller's clock): a due time after it fell due while
    /// or after that claim read the store, so claiming again is not an empty replay.
    claim_started: Option<SystemTime>,
    /// When the latest claim began (tokio time), for the claim cooldown.
    claim_began: Option<Instant>,
    /// The pending claim turn exists only because a `next_work_at` answer fell due during the
    /// latest claim (no wake, timer, reconciliation or continuation asked for it).
    due_reclaim_pending: bool,
    /// The latest claim was such a re-claim: if its own answer is again already due, it is
    /// suppressed instead of re-claimed (at most one immediate re-claim per answer).
    claim_was_due_reclaim: bool,
    backstop_due: bool,
    timer: Option<Instant>,
    /// The armed timer's deadline is the due time itself (not capped at the longest sleep).
    timer_is_due: bool,
    /// The due time of a timer that fired and whose claim has not been issued yet.
    fired_due: Option<Instant>,
    next_backstop: Instant,
    probe: Option<JoinHandle<()>>,
    rng: u64,
    finished: bool,
}

impl<S: Source> Run<S> {
    fn new(c: &Controller<S>, cancel: &CancellationToken) -> Self {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
            ^ (Arc::as_ptr(&c.shared) as u64);
        let mut run = Run {
            source: c.source.clone(),
            config: c.config.clone(),
            shared: c.shared.clone(),
            stop: cancel.child_token(),
            attempts: JoinSet::new(),
            gate: Arc::new(HandoffGate::new(c.config.clock.clone())),
            read_pending: false,
            claims: JoinSet::new(),
            reserved: 0,
            continuation: false,
            deadline: None,
            failure: None,
            reusable: None,
            abandoned: 0,
            claim_pending: false,
            claim_started: None,
            claim_began: None,
            due_reclaim_pending: false,
            claim_was_due_reclaim: false,
            backstop_due: false,
            timer: None,
            timer_is_due: false,
            fired_due: None,
            next_backstop: Instant::now(),
            probe: None,
            rng: seed | 1,
            finished: false,
        };
        run.next_backstop = run.backstop_after_now();
        run
    }

    fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    fn backstop_after_now(&mut self) -> Instant {
        let jitter = self.config.reconcile_jitter.as_nanos() as u64;
        let minus = if jitter == 0 {
            0
        } else {
            // xorshift64: cheap, dependency-free jitter.
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            self.rng % (jitter + 1)
        };
        Instant::now() + (self.config.reconcile_interval - Duration::from_nanos(minus))
    }

    fn begin_stop(&mut self) {
        self.gate.set_open(false);
        self.stop.cancel();
        if self.deadline.is_none() {
            self.deadline = Some(Instant::now() + self.config.shutdown_timeout);
        }
    }

    /// The Source broke the contract (`op` names the operation): fail closed.
    fn violation(&mut self, op: &'static str, message: String) {
        self.fail(RunErrorKind::ContractViolation, Some(op), message, None);
    }

    fn fail(
        &mut self,
        kind: RunErrorKind,
        op: Option<&'static str>,
        message: String,
        error: Option<BoxError>,
    ) {
        if self.failure.is_none() {
            self.failure = Some(Failure {
                kind,
                op,
                message,
                error,
            });
        }
        self.begin_stop();
    }

    fn fail_op(&mut self, op: &'static str, failure: OpFailure) {
        match failure {
            OpFailure::Panicked(msg) => self.fail(
                RunErrorKind::SourcePanicked,
                Some(op),
                format!("source operation `{op}` panicked: {msg}"),
                None,
            ),
            OpFailure::Abandoned => self.fail(
                RunErrorKind::ShutdownTimeout,
                Some(op),
                format!(
                    "source operation `{op}` did not return within the shutdown bound of {:?} \
                     after cancellation; it may still be running",
                    self.config.shutdown_timeout
                ),
                None,
            ),
        }
    }

    /// A `reconcile` or `claim` error: not-committed stops reusably, anything else poisons.
    fn mutating_error(&mut self, op: &'static str, error: SourceError) {
        if error.is_not_committed() {
            let kind = if error.is_superseded() {
                RunErrorKind::Superseded
            } else {
                RunErrorKind::NotCommitted
            };
            // Interrupted by our own stop with nothing committed: a clean stop, not an error
            // (unless a newer owner fenced us out: that must be said even during a stop).
            let report = !self.stop.is_cancelled() || kind == RunErrorKind::Superseded;
            if report && self.reusable.is_none() && self.failure.is_none() {
                log_event!(warn, controller = %self.shared.name, op, error = %error, "controller stopped: {:?}", kind);
                self.reusable = Some((kind, op, error));
            }
            self.begin_stop();
        } else {
            let cancelled = if self.stop.is_cancelled() {
                " during cancellation"
            } else {
                ""
            };
            self.fail(
                RunErrorKind::OutcomeUnknown,
                Some(op),
                format!("`{op}` failed{cancelled} and its durable outcome is unknown: {error}"),
                Some(Box::new(error)),
            );
        }
    }

    fn sync_in_flight(&self) {
        self.counters()
            .in_flight
            .store(self.attempts.len() + self.abandoned, Relaxed);
    }

    fn on_attempt_done(
        &mut self,
        done: Result<Result<Handed<S::Attempt>, AttemptError>, JoinError>,
    ) {
        bump(&self.counters().attempts_completed);
        self.sync_in_flight();
        match done {
            Ok(Ok(handed)) => self.on_handed(handed),
            Ok(Err(e)) if e.is_not_committed() => {
                bump(&self.counters().attempts_failed);
                // Proven not committed: the item is still leased and returns when its lease
                // ends. Stop (the store is failing) without poisoning.
                if self.reusable.is_none() && self.failure.is_none() {
                    log_event!(warn, controller = %self.shared.name, error = %e, "controller stopped: an attempt's write did not commit");
                    self.reusable = Some((
                        RunErrorKind::NotCommitted,
                        "attempt",
                        SourceError::not_committed(e.into_inner()),
                    ));
                }
                self.begin_stop();
            }
            Ok(Err(e)) => {
                bump(&self.counters().attempts_failed);
                self.fail(
                    RunErrorKind::AttemptFailed,
                    None,
                    format!("attempt failed: {e}"),
                    Some(Box::new(e)),
                );
            }
            Err(e) => {
                bump(&self.counters().attempts_failed);
                let msg = join_error_message(e);
                self.fail(
                    RunErrorKind::AttemptPanicked,
                    None,
                    format!("attempt panicked: {msg}"),
                    None,
                );
            }
        }
    }

    /// An attempt's handoff answer: nothing, or the successor its disposition claimed for the
    /// slot it freed (a claim answer, under the same rules).
    fn on_handed(&mut self, handed: Handed<S::Attempt>) {
        let Handed { began, batch } = handed;
        let Some(began) = began else {
            if batch.is_some() {
                // Fail closed: run none of them; their leases return them to the queue.
                drop(batch);
                self.violation(
                    "handoff",
                    "an attempt returned a successor without a granted handoff".into(),
                );
            }
            return;
        };
        self.gate.answered();
        bump(&self.counters().handoffs);
        let Some(batch) = batch else {
            // Begun, but nothing claimed and nothing said about the queue (the source could
            // not take a successor just now): not an answer. The slot is free, and under a
            // standing continuation the controller's own claim refills it.
            bump(&self.counters().handoffs_declined);
            return;
        };
        let (attempts, more) = batch.into_parts();
        if attempts.len() > 1 {
            let n = attempts.len();
            drop(attempts);
            return self.violation(
                "handoff",
                format!("a handoff returned {n} successors for the one slot it frees"),
            );
        }
        if more && attempts.is_empty() {
            return self.violation(
                "handoff",
                "a handoff returned no successor but requested continuation".into(),
            );
        }
        if attempts.is_empty() {
            bump(&self.counters().handoffs_empty);
        }
        self.counters()
            .attempts_handed
            .fetch_add(attempts.len() as u64, Relaxed);
        for attempt in attempts {
            self.spawn_attempt(attempt);
        }
        self.sync_in_flight();
        if self.claim_started.is_none_or(|c| c < began) {
            self.claim_started = Some(began);
        }
        self.claim_was_due_reclaim = false;
        self.answer(more);
    }

    /// A claim or handoff answer's continuation flag: `more` keeps the continuation standing;
    /// a terminal answer ends it at once and asks for one `next_work_at` read once nothing is
    /// outstanding (returns whether that is now).
    fn answer(&mut self, more: bool) -> bool {
        if more {
            self.continuation = true;
            self.claim_pending = true;
            self.claim_was_due_reclaim = false;
            self.read_pending = false;
            false
        } else {
            // The latest answer is terminal: it supersedes an earlier continuation.
            self.continuation = false;
            self.claim_pending = false;
            self.gate.set_open(false);
            self.read_pending = !self.stop.is_cancelled();
            self.read_pending && self.is_idle()
        }
    }

    /// No claim is in flight: neither a claim of ours nor a begun handoff.
    fn is_idle(&self) -> bool {
        self.claims.is_empty() && self.gate.outstanding() == 0
    }

    fn spawn_attempt(&mut self, attempt: S::Attempt) {
        // After cancellation the token is already cancelled: the attempt releases its claim.
        let timed = Timed {
            shared: self.shared.clone(),
            began: Instant::now(),
        };
        let token = self.stop.clone();
        let handoff = if self.config.successor_handoff {
            Handoff::offered(self.gate.clone())
        } else {
            Handoff::refused()
        };
        let run = traced!(
            attempt.run_handing_off(handoff, token),
            "attempt",
            family = %self.shared.name
        );
        self.attempts.spawn(async move {
            let _timed = timed;
            run.await
        });
    }

    /// Runs one Source operation on its own task and awaits it to completion, processing attempt
    /// completions meanwhile. Gives up (leaving the task running) only past the shutdown bound.
    async fn op<T: Send + 'static>(
        &mut self,
        fut: impl Future<Output = Result<T, SourceError>> + Send + 'static,
    ) -> Result<Result<T, SourceError>, OpFailure> {
        let mut handle = tokio::spawn(fut);
        loop {
            let deadline = self.deadline;
            tokio::select! {
                biased;
                r = &mut handle => {
                    return r.map_err(|e| OpFailure::Panicked(join_error_message(e)));
                }
                Some(done) = self.attempts.join_next(), if !self.attempts.is_empty() => {
                    self.on_attempt_done(done);
                }
                () = self.stop.cancelled(), if deadline.is_none() => self.begin_stop(),
                () = sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                    return Err(OpFailure::Abandoned);
                }
            }
        }
    }

    async fn drive(&mut self) {
        // 1. Source readiness.
        bump(&self.counters().check_ready_calls);
        let src = self.source.clone();
        let token = self.stop.clone();
        match self.op(async move { src.check_ready(token).await }).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                // Read-only: an error caused by our own cancellation is a clean stop.
                if !self.stop.is_cancelled() {
                    self.reusable = Some((RunErrorKind::NotReady, "check_ready", e));
                }
                return;
            }
            Err(f) => return self.fail_op("check_ready", f),
        }
        if self.stop.is_cancelled() {
            return;
        }

        // 2. The optional generation cursor.
        bump(&self.counters().generation_probes);
        let src = self.source.clone();
        let token = self.stop.clone();
        match self.op(async move { src.generation(token).await }).await {
            Ok(Ok(None)) => {}
            Ok(Ok(Some(g))) => self.start_probe(Some(g)),
            Ok(Err(_)) => {
                // Read-only: recorded as a loss; the startup reconciliation covers it.
                bump(&self.counters().generation_losses);
                self.start_probe(None);
            }
            Err(f) => return self.fail_op("generation", f),
        }
        if self.stop.is_cancelled() {
            return;
        }

        // 3. Reconcile once before Ready.
        self.reconcile(ReconcileCause::Startup).await;
        if self.stop.is_cancelled() {
            return;
        }
        self.shared.set_phase(Phase::Ready);
        log_event!(info, controller = %self.shared.name, "controller ready");

        loop {
            if self.stop.is_cancelled() {
                return;
            }
            // The handoff offer stands only under a standing continuation with no
            // reconciliation asked for; once closed, the begun handoffs only go down.
            let offer =
                self.config.successor_handoff && self.continuation && !self.reconcile_wanted();
            self.gate.set_open(offer);
            // Everything but a continuation waits for the claims in flight (ours and begun
            // handoffs): their answers decide what comes next (reconciliation before another
            // claim turn, one `next_work_at` after the last terminal answer).
            let idle = self.is_idle();
            if idle && self.read_pending {
                self.read_pending = false;
                self.next_work_at().await;
                continue;
            }
            // A reconciliation never runs beside a claim: not while handoffs may begin.
            if idle
                && !offer
                && let Some(cause) = self.take_reconcile_cause()
            {
                self.reconcile(cause).await;
                continue;
            }
            if idle && self.shared.wake_pending.swap(false, Relaxed) {
                if self.claim_pending {
                    bump(&self.counters().wakes_coalesced);
                } else {
                    self.claim_pending = true;
                }
                self.due_reclaim_pending = false;
            }
            let capacity = self.config.capacity.get();
            let free = capacity.saturating_sub(self.attempts.len() + self.reserved);
            // While attempts run, a refill waits out the cooldown so freed slots batch up.
            let cooling = match self.claim_began {
                Some(began)
                    if !self.attempts.is_empty() && !self.config.claim_cooldown.is_zero() =>
                {
                    let until = began + self.config.claim_cooldown;
                    (Instant::now() < until).then_some(until)
                }
                _ => None,
            };
            let wanted = if idle {
                self.claim_pending
            } else if self.claims.is_empty() {
                // Only begun handoffs are outstanding (claims under the standing
                // continuation): a slot they left free is refilled under the same authority.
                self.claim_pending && self.continuation && !self.reconcile_wanted()
            } else {
                // Beside a claim in flight: only under a standing continuation, below the
                // in-flight bound, with no reconciliation waiting, and for at least a fair share
                // of the capacity (so pipelining does not become a claim per freed slot).
                let share = capacity.div_ceil(self.config.claims_in_flight.get());
                self.continuation
                    && self.claims.len() < self.config.claims_in_flight.get()
                    && !self.reconcile_wanted()
                    && free >= share
            };
            if wanted && free > 0 && cooling.is_none() {
                // A claim turn ends with a `next_work_at` read, which satisfies any retime.
                self.shared.retime_pending.store(false, Relaxed);
                self.launch_claim(NonZeroUsize::new(free).expect("free > 0"));
                continue;
            }
            if idle && self.shared.retime_pending.swap(false, Relaxed) {
                // A retime is a new fact from the domain: its answer may earn one re-claim.
                self.claim_was_due_reclaim = false;
                self.next_work_at().await;
                continue;
            }
            let timer = self.timer;
            let backstop = self.next_backstop;
            let cooldown_end = cooling.filter(|_| wanted && free > 0);
            tokio::select! {
                biased;
                () = self.stop.cancelled() => return,
                Some(done) = self.claims.join_next(), if !self.claims.is_empty() => {
                    self.on_claim_done(done).await;
                }
                () = sleep_until(cooldown_end.unwrap_or_else(Instant::now)), if cooldown_end.is_some() => {}
                Some(done) = self.attempts.join_next(), if !self.attempts.is_empty() => {
                    self.on_attempt_done(done);
                    // Collect every other finished attempt so the next claim asks for all the
                    // capacity that is free now, not one slot at a time.
                    while let Some(done) = self.attempts.try_join_next() {
                        self.on_attempt_done(done);
                    }
                }
                () = self.shared.signal.notified() => {}
                () = sleep_until_due(timer.unwrap_or(backstop), self.config.precise_timers), if idle && timer.is_some() => {
                    self.timer = None;
                    if self.timer_is_due {
                        self.fired_due = timer;
                    }
                    bump(&self.counters().timers_fired);
                    self.claim_pending = true;
                    self.due_reclaim_pending = false;
                }
                () = sleep_until(backstop), if idle => self.backstop_due = true,
            }
        }
    }

    /// Whether a reconciliation is asked for (without taking the request).
    fn reconcile_wanted(&self) -> bool {
        self.backstop_due
            || self.shared.reconcile_requested.load(Relaxed)
            || self.shared.generation_changed.load(Relaxed)
            || self.shared.generation_lost.load(Relaxed)
    }

    fn take_reconcile_cause(&mut self) -> Option<ReconcileCause> {
        let requested = self.shared.reconcile_requested.swap(false, Relaxed);
        let changed = self.shared.generation_changed.swap(false, Relaxed);
        let lost = self.shared.generation_lost.swap(false, Relaxed);
        let backstop = std::mem::take(&mut self.backstop_due);
        if requested {
            Some(ReconcileCause::Requested)
        } else if changed {
            Some(ReconcileCause::GenerationChange)
        } else if lost {
            Some(ReconcileCause::GenerationLoss)
        } else if backstop {
            Some(ReconcileCause::Backstop)
        } else {
            None
        }
    }

    async fn reconcile(&mut self, cause: ReconcileCause) {
        if cause == ReconcileCause::Startup {
            // Signals raised before the startup reconciliation are satisfied by it.
            self.take_reconcile_cause();
        }
        self.counters().reconcile(cause);
        let src = self.source.clone();
        let token = self.stop.clone();
        let result = self
            .op(traced!(
                async move { src.reconcile(token).await },
                "reconcile",
                family = %self.shared.name,
                cause = ?cause
            ))
            .await;
        self.next_backstop = self.backstop_after_now();
        match result {
            Ok(Ok(())) => {
                self.claim_pending = true;
                self.due_reclaim_pending = false;
            }
            Ok(Err(e)) => self.mutating_error("reconcile", e),
            Err(f) => self.fail_op("reconcile", f),
        }
    }

    /// Starts a claim for `free` slots, reserving them until it answers.
    fn launch_claim(&mut self, free: NonZeroUsize) {
        // Wakes raised before this claim begins are satisfied by it (and make it more than a
        // due re-claim).
        let mut due_reclaim = std::mem::take(&mut self.due_reclaim_pending);
        if self.shared.wake_pending.swap(false, Relaxed) {
            bump(&self.counters().wakes_coalesced);
            due_reclaim = false;
        }
        self.claim_was_due_reclaim = due_reclaim;
        bump(&self.counters().claim_calls);
        self.claim_started = Some(self.config.clock.now());
        self.claim_began = Some(Instant::now());
        self.counters()
            .claim_capacity_asked
            .fetch_add(free.get() as u64, Relaxed);
        let src = self.source.clone();
        let token = self.stop.clone();
        let issued = Instant::now();
        if let Some(due) = self.fired_due.take() {
            self.counters()
                .due_lateness
                .record_duration(issued.saturating_duration_since(due));
        }
        self.claim_pending = false;
        self.reserved += free.get();
        let claim = traced!(
            async move { src.claim(free, token).await },
            "claim",
            family = %self.shared.name,
            capacity = free.get()
        );
        self.claims
            .spawn(async move { (free, issued, claim.await) });
    }

    /// A claim answered: run its attempts; a `more` continues, a terminal answer ends the
    /// continuation, and the last outstanding claim's terminal answer reads `next_work_at`.
    async fn on_claim_done(&mut self, done: Result<ClaimDone<S::Attempt>, JoinError>) {
        let (free, issued, result) = match done {
            Ok(done) => done,
            Err(e) => {
                return self.fail_op("claim", OpFailure::Panicked(join_error_message(e)));
            }
        };
        self.reserved = self.reserved.saturating_sub(free.get());
        self.counters().claim_latency(issued.elapsed());
        let batch: ClaimBatch<S::Attempt> = match result {
            Ok(batch) => batch,
            Err(e) => return self.mutating_error("claim", e),
        };
        let (attempts, more) = batch.into_parts();
        if attempts.len() > free.get() {
            // Fail closed: run none of them; their leases return them to the queue.
            let n = attempts.len();
            drop(attempts);
            return self.violation(
                "claim",
                format!("claim returned {n} attempts for a capacity of {free}"),
            );
        }
        if more && attempts.is_empty() {
            return self.violation(
                "claim",
                "claim returned an empty batch that requested continuation (an empty query loop)"
                    .into(),
            );
        }
        self.counters()
            .attempts_claimed
            .fetch_add(attempts.len() as u64, Relaxed);
        self.counters().claim_batch.record(attempts.len() as u64);
        self.counters().claimed_now();
        if attempts.is_empty() {
            bump(&self.counters().claims_empty);
        } else if attempts.len() == free.get() {
            bump(&self.counters().claims_full);
        }
        for attempt in attempts {
            self.spawn_attempt(attempt);
        }
        self.sync_in_flight();
        if self.answer(more) {
            self.read_pending = false;
            self.next_work_at().await;
        }
    }

    async fn next_work_at(&mut self) {
        bump(&self.counters().next_work_at_calls);
        let src = self.source.clone();
        let token = self.stop.clone();
        match self
            .op(traced!(
                async move { src.next_work_at(token).await },
                "next_work_at",
                family = %self.shared.name
            ))
            .await
        {
            Ok(Ok(Some(at))) => {
                let now = self.config.clock.now();
                match at.duration_since(now) {
                    Ok(d) if !d.is_zero() => {
                        self.timer = Some(Instant::now() + d.min(MAX_TIMER));
                        self.timer_is_due = d <= MAX_TIMER;
                        bump(&self.counters().timers_armed);
                    }
                    _ if !self.claim_was_due_reclaim
                        && self.claim_started.is_some_and(|c| at > c) =>
                    {
                        // It fell due after the latest claim read the store (a due time between
                        // that claim's snapshot and this read): a fact that fell due after the
                        // claim's snapshot is not the fact the claim declined. Claim again at
                        // once, but only once: if that re-claim's own answer is again already
                        // due (a row another replica holds, a store clock behind ours), it is
                        // suppressed below, so an always-due answer cannot become an empty
                        // query loop.
                        self.timer = None;
                        if !self.claim_pending {
                            self.claim_pending = true;
                            self.due_reclaim_pending = true;
                        }
                        bump(&self.counters().due_during_claim);
                    }
                    _ => {
                        // Already due: the claim just declined continuation, so re-arming at
                        // zero delay would be an empty query loop. Wait for a wake, a
                        // generation change or the backstop instead.
                        self.timer = None;
                        bump(&self.counters().overdue_suppressed);
                    }
                }
            }
            Ok(Ok(None)) => self.timer = None,
            Ok(Err(_)) => bump(&self.counters().next_work_at_errors),
            Err(f) => self.fail_op("next_work_at", f),
        }
    }

    fn start_probe(&mut self, seen: Option<Generation>) {
        let probe = Probe {
            source: self.source.clone(),
            shared: self.shared.clone(),
            cancel: self.stop.clone(),
            retry: self.config.generation_retry,
            max_retry: self.config.reconcile_interval,
        };
        self.probe = Some(tokio::spawn(probe.run(seen)));
    }

    /// Stops claiming, cancels attempts and waits for them within the shutdown bound.
    async fn drain(&mut self) {
        self.begin_stop();
        let deadline = self.deadline.expect("begin_stop sets the deadline");
        // Claims in flight answer first (never dropped mid-await): their attempts start with
        // the cancelled token and release what they claimed.
        while !self.claims.is_empty() {
            tokio::select! {
                biased;
                Some(done) = self.claims.join_next() => self.on_claim_done(done).await,
                Some(done) = self.attempts.join_next(), if !self.attempts.is_empty() => {
                    self.on_attempt_done(done);
                }
                () = sleep_until(deadline) => {
                    // Never abort a possibly-committing claim: leave it running and fail stop.
                    self.claims.detach_all();
                    self.reserved = 0;
                    self.fail_op("claim", OpFailure::Abandoned);
                }
            }
        }
        while !self.attempts.is_empty() {
            tokio::select! {
                biased;
                Some(done) = self.attempts.join_next() => self.on_attempt_done(done),
                () = sleep_until(deadline) => {
                    self.abandoned = self.attempts.len();
                    // Never abort a possibly-committing attempt: leave it running and report it.
                    self.attempts.detach_all();
                    self.sync_in_flight();
                }
            }
        }
        if let Some(mut probe) = self.probe.take() {
            tokio::select! {
                _ = &mut probe => {}
                // The probe is read-only, so aborting a stuck one is safe.
                () = sleep_until(deadline) => probe.abort(),
            }
        }
    }

    fn finish(&mut self) -> End {
        self.finished = true;
        if let Some(failure) = self.failure.take() {
            return End::Poisoned(failure, self.abandoned);
        }
        if self.abandoned > 0 {
            let failure = Failure {
                kind: RunErrorKind::ShutdownTimeout,
                op: None,
                message: format!(
                    "{} attempt(s) ignored cancellation beyond the shutdown bound of {:?} and may \
                     still be executing",
                    self.abandoned, self.config.shutdown_timeout
                ),
                error: None,
            };
            return End::Poisoned(failure, self.abandoned);
        }
        match self.reusable.take() {
            Some((kind, op, e)) => End::Reusable(kind, Some(op), e),
            None => End::Clean,
        }
    }
}

impl<S: Source> Drop for Run<S> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // The run future was dropped mid-run: cancel everything, abort nothing, and poison.
        self.stop.cancel();
        self.abandoned = self.attempts.len();
        self.attempts.detach_all();
        self.claims.detach_all();
        self.sync_in_flight();
        let _ = self.shared.counters.poisoned.set(format!(
            "the run future was dropped while running ({} attempt(s) left in flight)",
            self.abandoned
        ));
        self.shared.set_phase(Phase::Stopped);
    }
}

/// Records an attempt's duration when the attempt's future ends, whether it returned or
/// panicked (an abandoned attempt is never dropped, so it is never timed).
struct Timed {
    shared: Arc<Shared>,
    began: Instant,
}

impl Drop for Timed {
    fn drop(&mut self) {
        self.shared
            .counters
            .attempt_duration
            .record_duration(self.began.elapsed());
    }
}

/// The generation probe task: read-only, raises change and loss flags.
struct Probe<S> {
    source: Arc<S>,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    retry: Duration,
    max_retry: Duration,
}

impl<S: Source> Probe<S> {
    async fn run(self, mut last: Option<Generation>) {
        let c = &self.shared.counters;
        let mut healthy = last.is_some();
        let mut delay = self.retry;
        if !healthy {
            self.pause(delay).await;
        }
        while !self.cancel.is_cancelled() {
            bump(&c.generation_probes);
            let result = match (healthy, last) {
                (true, Some(seen)) => {
                    self.source
                        .generation_changed(seen, self.cancel.clone())
                        .await
                }
                _ => match self.source.generation(self.cancel.clone()).await {
                    Ok(Some(g)) => Ok(g),
                    Ok(None) => Err(SourceError::new("the generation probe stopped answering")),
                    Err(e) => Err(e),
                },
            };
            if self.cancel.is_cancelled() {
                return;
            }
            match result {
                Ok(g) => {
                    match last {
                        Some(seen) if seen == g => {
                            if healthy {
                                bump(&c.generation_spurious);
                            }
                        }
                        Some(_) => {
                            bump(&c.generation_changes);
                            self.shared.raise(&self.shared.generation_changed);
                        }
                        None => {
                            // Re-established with nothing to compare against: changes may have
                            // been missed since the startup reconciliation.
                            bump(&c.generation_changes);
                            self.shared.raise(&self.shared.generation_changed);
                        }
                    }
                    last = Some(g);
                    healthy = true;
                    delay = self.retry;
                }
                Err(_) => {
                    bump(&c.generation_losses);
                    if healthy {
                        // One reconciliation per loss streak.
                        self.shared.raise(&self.shared.generation_lost);
                    }
                    healthy = false;
                    self.pause(delay).await;
                    delay = (delay * 2).min(self.max_retry);
                }
            }
        }
    }

    async fn pause(&self, delay: Duration) {
        tokio::select! {
            () = self.cancel.cancelled() => {}
            () = tokio::time::sleep(delay) => {}
        }
    }
}

fn join_error_message(e: JoinError) -> String {
    if e.is_panic() {
        panic_message(e.into_panic())
    } else {
        "the task was cancelled (runtime shutting down)".into()
    }
}

fn panic_message(payload: Box<dyn Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}
