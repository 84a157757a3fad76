//! A scripted [`Source`] that records every call with its (paused) time.
//!
//! Script each operation with queued [`Step`]s (falling back to a default when a queue is empty),
//! then run a controller against it and assert call budgets with [`assert_calls!`] and
//! [`ScriptedSource::assert_snapshot_agrees`].
//!
//! [`assert_calls!`]: crate::assert_calls

use std::collections::VecDeque;
use std::fmt;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use nexuscrm_worker::{
    Attempt, AttemptError, ClaimBatch, Generation, Handed, Handoff, Snapshot, Source, SourceError,
};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::clock::PausedClock;

/// A Source operation, as recorded by [`ScriptedSource`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// `check_ready`.
    CheckReady,
    /// `generation` (the cursor read).
    Generation,
    /// `generation_changed` (the change wait).
    GenerationChanged,
    /// `reconcile`.
    Reconcile,
    /// `claim`.
    Claim,
    /// `next_work_at`.
    NextWorkAt,
    /// A granted successor handoff ([`Handoff::begin`] returned `true` in an attempt planned
    /// with [`AttemptPlan::handing_off`]): a claim made by an attempt's disposition.
    Handoff,
}

impl Op {
    /// Every operation.
    pub const ALL: [Op; 7] = [
        Op::CheckReady,
        Op::Generation,
        Op::GenerationChanged,
        Op::Reconcile,
        Op::Claim,
        Op::NextWorkAt,
        Op::Handoff,
    ];

    /// The snake_case method name (`next_work_at`), as used by [`assert_calls!`](crate::assert_calls).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Op::CheckReady => "check_ready",
            Op::Generation => "generation",
            Op::GenerationChanged => "generation_changed",
            Op::Reconcile => "reconcile",
            Op::Claim => "claim",
            Op::NextWorkAt => "next_work_at",
            Op::Handoff => "handoff",
        }
    }

    /// Looks an operation up by its method name.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|o| o.name() == name)
    }
}

/// One recorded call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Call {
    /// Which operation.
    pub op: Op,
    /// When, measured from the source's creation on tokio's (paused) clock.
    pub at: Duration,
    /// The capacity asked for (claims only).
    pub capacity: Option<usize>,
}

/// What a scripted operation does when its cancellation token fires while it is delayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnCancel {
    /// Return an outcome-unknown "cancelled" error at once (a store call that was interrupted).
    Error,
    /// Return the scripted reply at once (the operation finished its commit on cancellation).
    Finish,
    /// Ignore cancellation and keep going for the whole delay.
    Ignore,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ErrKind {
    Unknown,
    NotCommitted,
    Superseded,
}

/// A scripted reply: the value or error, after an optional delay.
#[derive(Debug, Clone)]
pub struct Step<T> {
    reply: Result<T, (ErrKind, String)>,
    delay: Duration,
    on_cancel: OnCancel,
}

impl<T> Step<T> {
    /// Replies `value`.
    pub fn ok(value: T) -> Self {
        Step {
            reply: Ok(value),
            delay: Duration::ZERO,
            on_cancel: OnCancel::Error,
        }
    }

    /// Replies an outcome-unknown error.
    pub fn err(message: impl Into<String>) -> Self {
        Step {
            reply: Err((ErrKind::Unknown, message.into())),
            delay: Duration::ZERO,
            on_cancel: OnCancel::Error,
        }
    }

    /// Replies a proven not-committed error.
    pub fn not_committed(message: impl Into<String>) -> Self {
        Step {
            reply: Err((ErrKind::NotCommitted, message.into())),
            delay: Duration::ZERO,
            on_cancel: OnCancel::Error,
        }
    }

    /// Replies a "fenced out by a newer owner" error ([`SourceError::superseded`]).
    pub fn superseded(message: impl Into<String>) -> Self {
        Step {
            reply: Err((ErrKind::Superseded, message.into())),
            delay: Duration::ZERO,
            on_cancel: OnCancel::Error,
        }
    }

    /// Replies only after `delay` (of tokio time).
    #[must_use]
    pub fn after(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// What to do when cancelled during the delay (default [`OnCancel::Error`]).
    #[must_use]
    pub fn on_cancel(mut self, on_cancel: OnCancel) -> Self {
        self.on_cancel = on_cancel;
        self
    }
}

/// A relative due time for a scripted `next_work_at` answer, computed at call time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// Nothing scheduled.
    Never,
    /// Due this long after the call.
    In(Duration),
    /// Already due by this much (zero: due exactly now).
    Ago(Duration),
}

/// What one scripted attempt does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttemptPlan {
    run_for: Duration,
    outcome: Outcome,
    ignore_cancel: bool,
    hands_off: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    Err,
    NotCommitted,
    Panic,
}

impl AttemptPlan {
    /// Runs for `run_for`, then succeeds. Cancelled earlier, it releases and returns `Ok`.
    #[must_use]
    pub const fn ok(run_for: Duration) -> Self {
        AttemptPlan {
            run_for,
            outcome: Outcome::Ok,
            ignore_cancel: false,
            hands_off: false,
        }
    }

    /// Runs for `run_for`, then returns `Err`.
    #[must_use]
    pub const fn failing(run_for: Duration) -> Self {
        AttemptPlan {
            run_for,
            outcome: Outcome::Err,
            ignore_cancel: false,
            hands_off: false,
        }
    }

    /// Runs for `run_for`, then returns [`AttemptError::not_committed`]: its last write proved
    /// not to have committed.
    #[must_use]
    pub const fn not_committing(run_for: Duration) -> Self {
        AttemptPlan {
            run_for,
            outcome: Outcome::NotCommitted,
            ignore_cancel: false,
            hands_off: false,
        }
    }

    /// Runs for `run_for`, then panics.
    #[must_use]
    pub const fn panicking(run_for: Duration) -> Self {
        AttemptPlan {
            run_for,
            outcome: Outcome::Panic,
            ignore_cancel: false,
            hands_off: false,
        }
    }

    /// When it finishes, asks for the successor handoff ([`Handoff::begin`]); if granted, its
    /// disposition answers with the next queued handoff reply
    /// ([`ScriptedSource::push_handoff`]), or declines ([`Handoff::none`]) when none is queued.
    /// Refused (or cancelled), it finishes as without.
    #[must_use]
    pub const fn handing_off(mut self) -> Self {
        self.hands_off = true;
        self
    }

    /// Keeps running for the whole duration even when cancelled.
    #[must_use]
    pub const fn ignoring_cancel(mut self) -> Self {
        self.ignore_cancel = true;
        self
    }
}

/// A scripted claim answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimPlan {
    attempts: Vec<AttemptPlan>,
    more: bool,
}

impl ClaimPlan {
    /// A terminal batch.
    #[must_use]
    pub fn done(attempts: Vec<AttemptPlan>) -> Self {
        ClaimPlan {
            attempts,
            more: false,
        }
    }

    /// A batch that requests an immediate continuation.
    #[must_use]
    pub fn more(attempts: Vec<AttemptPlan>) -> Self {
        ClaimPlan {
            attempts,
            more: true,
        }
    }

    /// An empty terminal batch.
    #[must_use]
    pub fn empty() -> Self {
        ClaimPlan::done(Vec::new())
    }
}

/// A generation probe event, delivered to the next `generation_changed` wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GenEvent {
    /// The cursor changed to this value.
    Changed(u64),
    /// A spurious return with the unchanged cursor.
    Spurious,
    /// The probe failed (e.g. the LISTEN connection dropped).
    Error,
}

type ClaimFn = Arc<dyn Fn(usize) -> ClaimPlan + Send + Sync>;

struct Script {
    check_ready: VecDeque<Step<()>>,
    /// Replies of granted handoffs, and how long each disposition takes: `Some(plan)` claims
    /// it, `None` declines.
    handoff: VecDeque<(Option<ClaimPlan>, Duration)>,
    reconcile: VecDeque<Step<()>>,
    claim: VecDeque<Step<ClaimPlan>>,
    default_claim: Option<ClaimFn>,
    default_claim_delay: Duration,
    next_work_at: VecDeque<Step<Due>>,
    default_due: Due,
    generation: Option<u64>,
    generation_failures: u32,
    events: VecDeque<GenEvent>,
}

struct Inner {
    start: Instant,
    clock: Arc<PausedClock>,
    script: Mutex<Script>,
    calls: Mutex<Vec<Call>>,
    gen_notify: Notify,
    attempts_handed_out: AtomicU64,
    successors_handed_out: AtomicU64,
    attempts_started: AtomicU64,
    attempts_finished: AtomicU64,
    attempts_released: AtomicU64,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    ops_completed: AtomicU64,
    ops_dropped: AtomicU64,
    ops_cancelled: AtomicU64,
    over_capacity: AtomicU64,
    capacity_limit: AtomicUsize,
}

/// A scripted, recording [`Source`]. Clones share one script and one record (the mock and its
/// handle are the same object, cheap to clone).
#[derive(Clone)]
pub struct ScriptedSource {
    inner: Arc<Inner>,
}

impl fmt::Debug for ScriptedSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScriptedSource")
            .field(
                "calls",
                &self.inner.calls.lock().map(|c| c.len()).unwrap_or(0),
            )
            .finish_non_exhaustive()
    }
}

impl Default for ScriptedSource {
    fn default() -> Self {
        ScriptedSource::new()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ScriptedSource {
    /// A source whose every operation succeeds at once: claims return an empty terminal batch,
    /// `next_work_at` returns `None`, there is no generation probe. Must be created inside a
    /// tokio runtime (it reads tokio's clock).
    #[must_use]
    pub fn new() -> Self {
        ScriptedSource {
            inner: Arc::new(Inner {
                start: Instant::now(),
                clock: Arc::new(PausedClock::new()),
                script: Mutex::new(Script {
                    check_ready: VecDeque::new(),
                    handoff: VecDeque::new(),
                    reconcile: VecDeque::new(),
                    claim: VecDeque::new(),
                    default_claim: None,
                    default_claim_delay: Duration::ZERO,
                    next_work_at: VecDeque::new(),
                    default_due: Due::Never,
                    generation: None,
                    generation_failures: 0,
                    events: VecDeque::new(),
                }),
                calls: Mutex::new(Vec::new()),
                gen_notify: Notify::new(),
                attempts_handed_out: AtomicU64::new(0),
                successors_handed_out: AtomicU64::new(0),
                attempts_started: AtomicU64::new(0),
                attempts_finished: AtomicU64::new(0),
                attempts_released: AtomicU64::new(0),
                in_flight: AtomicUsize::new(0),
                max_in_flight: AtomicUsize::new(0),
                ops_completed: AtomicU64::new(0),
                ops_dropped: AtomicU64::new(0),
                ops_cancelled: AtomicU64::new(0),
                over_capacity: AtomicU64::new(0),
                capacity_limit: AtomicUsize::new(usize::MAX),
            }),
        }
    }

    /// The paused-time clock this source computes due times with; give it to the controller's
    /// [`Config::clock`](nexuscrm_worker::Config::clock).
    #[must_use]
    pub fn clock(&self) -> Arc<PausedClock> {
        self.inner.clock.clone()
    }

    /// Queues a `check_ready` reply.
    pub fn push_check_ready(&self, step: Step<()>) -> &Self {
        lock(&self.inner.script).check_ready.push_back(step);
        self
    }

    /// Queues a `reconcile` reply.
    pub fn push_reconcile(&self, step: Step<()>) -> &Self {
        lock(&self.inner.script).reconcile.push_back(step);
        self
    }

    /// Queues a `claim` reply.
    pub fn push_claim(&self, step: Step<ClaimPlan>) -> &Self {
        lock(&self.inner.script).claim.push_back(step);
        self
    }

    /// Queues the reply of the next granted handoff (of an attempt planned with
    /// [`AttemptPlan::handing_off`]): `Some(plan)` is the successor its disposition claimed
    /// (at most one attempt, `more` or terminal), `None` declines ([`Handoff::none`]); the
    /// disposition takes `takes` after the grant.
    pub fn push_handoff(&self, reply: Option<ClaimPlan>, takes: Duration) -> &Self {
        lock(&self.inner.script).handoff.push_back((reply, takes));
        self
    }

    /// Successor attempts handed out by granted handoffs (not counted in
    /// [`attempts_handed_out`](ScriptedSource::attempts_handed_out)).
    #[must_use]
    pub fn successors_handed_out(&self) -> u64 {
        self.inner.successors_handed_out.load(SeqCst)
    }

    /// The claim answer when no reply is queued, computed from the capacity asked for.
    pub fn default_claim(&self, f: impl Fn(usize) -> ClaimPlan + Send + Sync + 'static) -> &Self {
        lock(&self.inner.script).default_claim = Some(Arc::new(f));
        self
    }

    /// How long a default (unqueued) claim reply takes: a store round trip. Default zero.
    pub fn default_claim_delay(&self, delay: Duration) -> &Self {
        lock(&self.inner.script).default_claim_delay = delay;
        self
    }

    /// Queues a `next_work_at` reply.
    pub fn push_next_work_at(&self, step: Step<Due>) -> &Self {
        lock(&self.inner.script).next_work_at.push_back(step);
        self
    }

    /// The `next_work_at` answer when no reply is queued (default [`Due::Never`]).
    pub fn default_due(&self, due: Due) -> &Self {
        lock(&self.inner.script).default_due = due;
        self
    }

    /// Enables the generation probe with this cursor value.
    pub fn set_generation(&self, value: u64) -> &Self {
        lock(&self.inner.script).generation = Some(value);
        self
    }

    /// Makes the next `n` `generation` cursor reads fail.
    pub fn fail_generation_reads(&self, n: u32) -> &Self {
        lock(&self.inner.script).generation_failures = n;
        self
    }

    /// Delivers a probe event to the (next) `generation_changed` wait.
    pub fn generation_event(&self, event: GenEvent) {
        lock(&self.inner.script).events.push_back(event);
        self.inner.gen_notify.notify_one();
    }

    /// Every recorded call, in order.
    #[must_use]
    pub fn calls(&self) -> Vec<Call> {
        lock(&self.inner.calls).clone()
    }

    /// How many calls of `op` were made.
    #[must_use]
    pub fn count(&self, op: Op) -> usize {
        lock(&self.inner.calls)
            .iter()
            .filter(|c| c.op == op)
            .count()
    }

    /// The times (since creation) at which `op` was called.
    #[must_use]
    pub fn times(&self, op: Op) -> Vec<Duration> {
        lock(&self.inner.calls)
            .iter()
            .filter(|c| c.op == op)
            .map(|c| c.at)
            .collect()
    }

    /// Every claim's requested capacity, in order.
    #[must_use]
    pub fn claim_capacities(&self) -> Vec<usize> {
        lock(&self.inner.calls)
            .iter()
            .filter_map(|c| c.capacity)
            .collect()
    }

    /// Attempts currently running.
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.load(SeqCst)
    }

    /// The most attempts that ever ran at once.
    #[must_use]
    pub fn max_in_flight(&self) -> usize {
        self.inner.max_in_flight.load(SeqCst)
    }

    /// Records, inside the attempts, whenever more than `limit` run at once (see
    /// [`over_capacity`](ScriptedSource::over_capacity)).
    pub fn check_capacity(&self, limit: usize) -> &Self {
        self.inner.capacity_limit.store(limit, SeqCst);
        self
    }

    /// How often an attempt started while `limit` were already running.
    #[must_use]
    pub fn over_capacity(&self) -> u64 {
        self.inner.over_capacity.load(SeqCst)
    }

    /// Attempts handed to the controller by `claim`.
    #[must_use]
    pub fn attempts_handed_out(&self) -> u64 {
        self.inner.attempts_handed_out.load(SeqCst)
    }

    /// Attempts that started running.
    #[must_use]
    pub fn attempts_started(&self) -> u64 {
        self.inner.attempts_started.load(SeqCst)
    }

    /// Attempts that returned (any outcome, including panics).
    #[must_use]
    pub fn attempts_finished(&self) -> u64 {
        self.inner.attempts_finished.load(SeqCst)
    }

    /// Attempts that released early because they were cancelled.
    #[must_use]
    pub fn attempts_released(&self) -> u64 {
        self.inner.attempts_released.load(SeqCst)
    }

    /// Source operations whose futures ran to completion.
    #[must_use]
    pub fn ops_completed(&self) -> u64 {
        self.inner.ops_completed.load(SeqCst)
    }

    /// Source operations whose futures were dropped before completing (must stay 0).
    #[must_use]
    pub fn ops_dropped(&self) -> u64 {
        self.inner.ops_dropped.load(SeqCst)
    }

    /// Source operations that observed their cancellation token while delayed.
    #[must_use]
    pub fn ops_cancelled(&self) -> u64 {
        self.inner.ops_cancelled.load(SeqCst)
    }

    /// Asserts that the controller's snapshot agrees with what this source counted.
    ///
    /// # Panics
    ///
    /// When a counter disagrees.
    #[track_caller]
    pub fn assert_snapshot_agrees(&self, snap: &Snapshot) {
        let n = |op| self.count(op) as u64;
        assert_eq!(
            snap.check_ready_calls,
            n(Op::CheckReady),
            "check_ready calls"
        );
        assert_eq!(snap.claim_calls, n(Op::Claim), "claim calls");
        assert_eq!(
            snap.next_work_at_calls,
            n(Op::NextWorkAt),
            "next_work_at calls"
        );
        assert_eq!(snap.reconciles.total(), n(Op::Reconcile), "reconcile calls");
        assert_eq!(
            snap.generation_probes,
            n(Op::Generation) + n(Op::GenerationChanged),
            "generation probe calls"
        );
        assert_eq!(
            snap.attempts_claimed,
            self.attempts_handed_out(),
            "attempts claimed"
        );
        assert_eq!(
            snap.attempts_handed,
            self.successors_handed_out(),
            "successors handed"
        );
        assert_eq!(snap.handoffs, n(Op::Handoff), "handoffs");
        assert_eq!(
            snap.attempts_completed,
            self.attempts_finished(),
            "attempts completed"
        );
        assert_eq!(snap.in_flight, self.in_flight(), "in flight");
    }

    /// A scripted answer's attempts as a batch, counted in `handed_out`.
    fn batch(&self, plan: ClaimPlan, handed_out: &AtomicU64) -> ClaimBatch<ScriptedAttempt> {
        handed_out.fetch_add(plan.attempts.len() as u64, SeqCst);
        let attempts = plan
            .attempts
            .into_iter()
            .map(|plan| ScriptedAttempt {
                plan,
                source: self.clone(),
            })
            .collect();
        if plan.more {
            ClaimBatch::more(attempts)
        } else {
            ClaimBatch::done(attempts)
        }
    }

    fn record(&self, op: Op, capacity: Option<usize>) {
        let at = Instant::now() - self.inner.start;
        lock(&self.inner.calls).push(Call { op, at, capacity });
    }

    async fn play<T>(&self, step: Step<T>, cancel: &CancellationToken) -> Result<T, SourceError> {
        let mut guard = OpGuard {
            inner: &self.inner,
            done: false,
        };
        let mut reply = step.reply;
        if !step.delay.is_zero() {
            let cancelled = tokio::select! {
                () = tokio::time::sleep(step.delay) => false,
                () = cancel.cancelled(), if step.on_cancel != OnCancel::Ignore => true,
            };
            if cancelled {
                self.inner.ops_cancelled.fetch_add(1, SeqCst);
                if step.on_cancel == OnCancel::Error {
                    reply = Err((ErrKind::Unknown, "cancelled while in flight".into()));
                }
            }
        }
        guard.done = true;
        drop(guard);
        reply.map_err(|(kind, msg)| match kind {
            ErrKind::Unknown => SourceError::new(msg),
            ErrKind::NotCommitted => SourceError::not_committed(msg),
            ErrKind::Superseded => SourceError::superseded(msg),
        })
    }
}

struct OpGuard<'a> {
    inner: &'a Inner,
    done: bool,
}

impl Drop for OpGuard<'_> {
    fn drop(&mut self) {
        if self.done {
            self.inner.ops_completed.fetch_add(1, SeqCst);
        } else {
            self.inner.ops_dropped.fetch_add(1, SeqCst);
        }
    }
}

impl Source for ScriptedSource {
    type Attempt = ScriptedAttempt;

    async fn check_ready(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        self.record(Op::CheckReady, None);
        let step = lock(&self.inner.script)
            .check_ready
            .pop_front()
            .unwrap_or(Step::ok(()));
        self.play(step, &cancel).await
    }

    async fn reconcile(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        self.record(Op::Reconcile, None);
        let step = lock(&self.inner.script)
            .reconcile
            .pop_front()
            .unwrap_or(Step::ok(()));
        self.play(step, &cancel).await
    }

    async fn claim(
        &self,
        capacity: NonZeroUsize,
        cancel: CancellationToken,
    ) -> Result<ClaimBatch<ScriptedAttempt>, SourceError> {
        self.record(Op::Claim, Some(capacity.get()));
        let step = {
            let mut s = lock(&self.inner.script);
            match s.claim.pop_front() {
                Some(step) => step,
                None => Step::ok(match &s.default_claim {
                    Some(f) => f(capacity.get()),
                    None => ClaimPlan::empty(),
                })
                .after(s.default_claim_delay),
            }
        };
        let plan = self.play(step, &cancel).await?;
        Ok(self.batch(plan, &self.inner.attempts_handed_out))
    }

    async fn next_work_at(
        &self,
        cancel: CancellationToken,
    ) -> Result<Option<SystemTime>, SourceError> {
        self.record(Op::NextWorkAt, None);
        let step = {
            let mut s = lock(&self.inner.script);
            let default = s.default_due;
            s.next_work_at.pop_front().unwrap_or(Step::ok(default))
        };
        let due = self.play(step, &cancel).await?;
        let now = nexuscrm_worker::Clock::now(&*self.inner.clock);
        Ok(match due {
            Due::Never => None,
            Due::In(d) => Some(now + d),
            Due::Ago(d) => Some(now - d),
        })
    }

    async fn generation(
        &self,
        _cancel: CancellationToken,
    ) -> Result<Option<Generation>, SourceError> {
        self.record(Op::Generation, None);
        let mut s = lock(&self.inner.script);
        if s.generation.is_some() && s.generation_failures > 0 {
            s.generation_failures -= 1;
            return Err(SourceError::new("generation read failed"));
        }
        Ok(s.generation.map(Generation))
    }

    async fn generation_changed(
        &self,
        seen: Generation,
        cancel: CancellationToken,
    ) -> Result<Generation, SourceError> {
        self.record(Op::GenerationChanged, None);
        loop {
            let notified = self.inner.gen_notify.notified();
            let event = lock(&self.inner.script).events.pop_front();
            match event {
                Some(GenEvent::Changed(v)) => {
                    lock(&self.inner.script).generation = Some(v);
                    return Ok(Generation(v));
                }
                Some(GenEvent::Spurious) => return Ok(seen),
                Some(GenEvent::Error) => return Err(SourceError::new("generation probe lost")),
                None => {}
            }
            tokio::select! {
                () = notified => {}
                () = cancel.cancelled() => return Ok(seen),
            }
        }
    }
}

/// An attempt produced by [`ScriptedSource`]; it follows its [`AttemptPlan`].
#[derive(Debug)]
pub struct ScriptedAttempt {
    plan: AttemptPlan,
    source: ScriptedSource,
}

struct InFlightGuard<'a>(&'a Inner);

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, SeqCst);
        self.0.attempts_finished.fetch_add(1, SeqCst);
    }
}

impl Attempt for ScriptedAttempt {
    async fn run_handing_off(
        self,
        mut handoff: Handoff,
        cancel: CancellationToken,
    ) -> Result<Handed<Self>, AttemptError> {
        let source = self.source.clone();
        let hands_off = self.plan.hands_off;
        self.run(cancel).await?;
        if !hands_off || !handoff.begin() {
            return Ok(handoff.none());
        }
        source.record(Op::Handoff, Some(1));
        let (reply, takes) = lock(&source.inner.script)
            .handoff
            .pop_front()
            .unwrap_or((None, Duration::ZERO));
        tokio::time::sleep(takes).await;
        let Some(plan) = reply else {
            return Ok(handoff.none());
        };
        Ok(handoff.claimed(source.batch(plan, &source.inner.successors_handed_out)))
    }

    async fn run(self, cancel: CancellationToken) -> Result<(), AttemptError> {
        let inner = &*self.source.inner;
        inner.attempts_started.fetch_add(1, SeqCst);
        let now = inner.in_flight.fetch_add(1, SeqCst) + 1;
        inner.max_in_flight.fetch_max(now, SeqCst);
        if now > inner.capacity_limit.load(SeqCst) {
            inner.over_capacity.fetch_add(1, SeqCst);
        }
        let _guard = InFlightGuard(inner);
        let released = tokio::select! {
            () = tokio::time::sleep(self.plan.run_for) => false,
            () = cancel.cancelled(), if !self.plan.ignore_cancel => true,
        };
        if released {
            inner.attempts_released.fetch_add(1, SeqCst);
            return Ok(());
        }
        match self.plan.outcome {
            Outcome::Ok => Ok(()),
            Outcome::Err => Err(AttemptError::new("scripted attempt failure")),
            Outcome::NotCommitted => Err(AttemptError::not_committed(
                "scripted attempt: the release did not commit",
            )),
            Outcome::Panic => panic!("scripted attempt panic"),
        }
    }
}
