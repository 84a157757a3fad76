//! The Source protocol: what a domain store offers the controller.

use std::error::Error;
use std::fmt;
use std::future::Future;
use std::num::NonZeroUsize;
use std::time::SystemTime;

use tokio_util::sync::CancellationToken;

use crate::handoff::{Handed, Handoff};

/// Boxed error type carried inside [`SourceError`] and [`AttemptError`].
pub type BoxError = Box<dyn Error + Send + Sync + 'static>;

/// An opaque generation cursor read by the optional generation probe.
///
/// The controller only compares cursors for equality: a changed cursor requests a
/// reconciliation. It proves nothing about work existence, ordering or ownership.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub u64);

/// A domain-owned work source driven by a [`Controller`](crate::Controller).
///
/// The source owns every durable fact: acceptance, work identity, queue state, claim tokens,
/// leases, ordering and fairness. The controller owns only process-local scheduling: wakes,
/// exact due timers, continuation, capacity, reconcile cadence and drain.
///
/// Every method receives a [`CancellationToken`] and must honor it: once it is cancelled the
/// operation must return promptly. The controller never drops an in-flight operation; it awaits
/// it (each operation runs on its own task, so it also survives the `run` future being
/// dropped).
///
/// `reconcile` and `claim` may mutate durable state, so their errors are *outcome unknown*
/// unless built with [`SourceError::not_committed`]; such an error permanently poisons the
/// controller. `check_ready`, `next_work_at` and the generation probe are read-only; their errors
/// never poison. A source fenced out by a newer owner says so with [`SourceError::superseded`].
///
/// # One clock: bind the controller's "now" into eligibility
///
/// The controller arms its due timer on [`Config::clock`](crate::Config::clock) (by default the
/// system clock). If `claim` decides eligibility on the *database's* clock (`run_at <= now()`)
/// while the timer runs on the process's, a database clock that lags makes the timer-fired claim
/// come back empty, and the job then waits for the reconciliation backstop. Read the same clock
/// the controller uses and bind it, as the Bulk family does:
///
/// ```text
/// -- claim: `$now` is Config::clock's now(), read once the transaction holds its locks
/// UPDATE job SET token = $token, lease_until = $now + $lease
///  WHERE id IN (SELECT id FROM job WHERE run_at <= $now OR lease_until <= $now
///               ORDER BY run_at LIMIT $capacity FOR UPDATE SKIP LOCKED)
/// RETURNING id;
/// -- next_work_at: the same facts, so the answer and the claim agree
/// SELECT MIN(run_at) FROM job WHERE token IS NULL;
/// ```
///
/// Read "now" *inside* the transaction, after it holds its locks (and again on every retry): a
/// time read before a long lock wait is stale by the time the statement runs.
///
/// # When a no-op `check_ready` or `reconcile` is correct
///
/// - `check_ready` may return `Ok(())` at once when the source has no external dependency to
///   verify (an in-memory queue), or when the process already proved the store reachable and its
///   schema current before building the controller. Otherwise read something cheap that fails
///   when the schema is missing.
/// - `reconcile` may be a no-op when every eligible item is found by `claim` itself and by
///   `next_work_at`: nothing derived needs materializing, no accepted-but-not-queued state exists,
///   and leases held by dead or older owners expire into eligibility on their own (the claim
///   takes expired leases, and `next_work_at` reports the earliest expiry). If a dead owner's
///   lease can only be released by a write (an older deployment generation's claims, say), or
///   acceptance happens outside the claimable table, `reconcile` must do that work.
pub trait Source: Send + Sync + 'static {
    /// The already-claimed unit of work this source hands out.
    type Attempt: Attempt;

    /// Read-only startup gate (schema present, store reachable).
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancelling it changes no durable state. An error ends `run` without poisoning.
    fn check_ready(
        &self,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Serialized opportunity to materialize derived state or durable acceptance.
    ///
    /// Called once at startup before Ready, and again on [`request_reconcile`], on a generation
    /// change or loss, and by the periodic backstop. Never called concurrently with `claim`.
    ///
    /// # Cancel safety
    ///
    /// May commit. If cancelled mid-way, the source must return; unless it can prove that nothing
    /// committed (and says so with [`SourceError::not_committed`]) the error is outcome-unknown
    /// and poisons the controller.
    ///
    /// [`request_reconcile`]: crate::ControllerHandle::request_reconcile
    fn reconcile(
        &self,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// The sole immediate eligibility and durable-ownership transition.
    ///
    /// Claims at most `capacity` attempts (the immediately free execution slots, never zero).
    /// Returning more than `capacity` attempts is a contract violation: the controller fails
    /// closed, runs none of them, and poisons (their leases return them to the queue).
    ///
    /// Because the result is `Result<ClaimBatch, SourceError>`, "a not-committed marker together
    /// with claimed attempts" cannot be expressed: an error carries no attempts.
    ///
    /// # Cancel safety
    ///
    /// May commit ownership. Cancelled mid-way, the source must return promptly; if it returns
    /// attempts anyway (the claim committed), the controller runs them with an already-cancelled
    /// token so each can release its claim. An error is outcome-unknown unless `not_committed`.
    fn claim(
        &self,
        capacity: NonZeroUsize,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<ClaimBatch<Self::Attempt>, SourceError>> + Send;

    /// Read-only: the earliest strictly-future execution opportunity after a terminal batch.
    ///
    /// `None` means nothing is scheduled. A time that is already due is not re-armed (see
    /// [`Snapshot::overdue_suppressed`](crate::Snapshot::overdue_suppressed)), unless it is
    /// later than the start of the claim just made: work that fell due while that claim ran is
    /// claimed at once ([`Snapshot::due_during_claim`](crate::Snapshot::due_during_claim)).
    ///
    /// # Cancel safety
    ///
    /// Read-only. An error is recorded and never poisons; the previous timer stays armed.
    fn next_work_at(
        &self,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<Option<SystemTime>, SourceError>> + Send;

    /// Read-only: the current generation cursor, or `None` (the default) when the source has no
    /// generation probe.
    ///
    /// # Cancel safety
    ///
    /// Read-only. An error is recorded as a generation loss and answered with a reconciliation.
    fn generation(
        &self,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<Option<Generation>, SourceError>> + Send {
        let _ = cancel;
        async { Ok(None) }
    }

    /// Read-only: waits until the generation may differ from `seen`, then returns the current
    /// cursor. It may return spuriously (the same cursor); the controller compares and an
    /// unchanged cursor causes no other Source call.
    ///
    /// Only called when [`generation`](Source::generation) returned `Some`. The default waits for
    /// cancellation.
    ///
    /// # Cancel safety
    ///
    /// Read-only; must return once `cancel` fires. An error is recorded as a generation loss.
    fn generation_changed(
        &self,
        seen: Generation,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<Generation, SourceError>> + Send {
        async move {
            cancel.cancelled().await;
            Ok(seen)
        }
    }
}

/// One already-claimed heartbeat/effect/disposition lifecycle.
pub trait Attempt: Send + 'static {
    /// Runs the attempt to a durable disposition.
    ///
    /// Return `Ok(())` only after the domain has durably handled the outcome (success, retry,
    /// poison, uncertainty, or release on cancellation). Any `Err` is process-fatal: the
    /// controller cannot infer whether replay is safe, so it stops, drains and poisons. A panic is
    /// treated the same way.
    ///
    /// # Cancel safety
    ///
    /// When `cancel` fires the attempt should reach a safe durable point (finish or release its
    /// claim) and return within the controller's shutdown bound. The controller never drops or
    /// aborts a running attempt; one that overruns the bound is reported as in flight and the
    /// controller is poisoned.
    fn run(
        self,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<(), AttemptError>> + Send;

    /// Runs the attempt like [`run`](Attempt::run), and may claim its successor in its own
    /// disposition: what the controller calls. The default runs [`run`](Attempt::run) and claims
    /// nothing.
    ///
    /// A source whose disposition is one small transaction can fold the next claim into it
    /// (successor handoff, [`Config::successor_handoff`](crate::Config::successor_handoff)):
    /// call [`Handoff::begin`] right before the disposition; if it returns `true`, the same
    /// transaction may claim at most one successor (the slot this attempt frees), returned with
    /// [`Handoff::claimed`], `more` when more work is immediately eligible, terminal when not.
    /// Otherwise dispose as `run` does and return [`Handoff::none`]. The successor is a claim:
    /// the same eligibility, the same ownership transition, the same fence.
    ///
    /// # Cancel safety
    ///
    /// As for [`run`](Attempt::run). Once the controller begins to stop, `begin` returns
    /// `false`; a disposition granted just before is awaited like any attempt, and its
    /// successor runs with the cancelled token (it releases its claim).
    fn run_handing_off(
        self,
        handoff: Handoff,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<Handed<Self>, AttemptError>> + Send
    where
        Self: Sized,
    {
        let run = self.run(cancel);
        async move { run.await.map(|()| handoff.none()) }
    }
}

/// The answer to one `claim`: claimed attempts and whether to continue at once.
#[derive(Debug)]
pub struct ClaimBatch<A> {
    attempts: Vec<A>,
    more: bool,
}

impl<A> ClaimBatch<A> {
    /// More work is immediately eligible: claim again as soon as capacity is free.
    ///
    /// The batch must not be empty: an empty batch that asks for continuation would be an empty
    /// query loop, so the controller treats it as a contract violation.
    #[must_use]
    pub fn more(attempts: Vec<A>) -> Self {
        ClaimBatch {
            attempts,
            more: true,
        }
    }

    /// A terminal batch (possibly empty): the controller asks `next_work_at` once.
    #[must_use]
    pub fn done(attempts: Vec<A>) -> Self {
        ClaimBatch {
            attempts,
            more: false,
        }
    }

    /// An empty terminal batch.
    #[must_use]
    pub fn empty() -> Self {
        ClaimBatch::done(Vec::new())
    }

    /// Whether the source requested an immediate bounded continuation.
    #[must_use]
    pub fn has_more(&self) -> bool {
        self.more
    }

    /// The claimed attempts.
    #[must_use]
    pub fn attempts(&self) -> &[A] {
        &self.attempts
    }

    /// Number of claimed attempts.
    #[must_use]
    pub fn len(&self) -> usize {
        self.attempts.len()
    }

    /// Whether no attempt was claimed.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.attempts.is_empty()
    }

    /// Splits into attempts and the continuation flag.
    #[must_use]
    pub fn into_parts(self) -> (Vec<A>, bool) {
        (self.attempts, self.more)
    }
}

/// An error from a [`Source`] operation.
///
/// By default the outcome is *unknown*: a durable transition may have committed before the error.
/// Use [`SourceError::not_committed`] only when the source can prove that nothing committed (for
/// example the transaction was rolled back before commit was sent).
pub struct SourceError {
    committed: Commit,
    inner: BoxError,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Commit {
    Unknown,
    NotCommitted,
    Superseded,
}

impl SourceError {
    /// An error whose durable outcome is unknown (the safe default).
    pub fn new(error: impl Into<BoxError>) -> Self {
        SourceError {
            committed: Commit::Unknown,
            inner: error.into(),
        }
    }

    /// An error for which the source proves that no durable transition committed.
    pub fn not_committed(error: impl Into<BoxError>) -> Self {
        SourceError {
            committed: Commit::NotCommitted,
            inner: error.into(),
        }
    }

    /// The source has been fenced out: a newer deployment generation owns its work, and this
    /// operation committed nothing (the fence check inside its transaction said so).
    ///
    /// The controller stops the run without poisoning
    /// ([`RunErrorKind::Superseded`](crate::RunErrorKind::Superseded)); it is not a transient
    /// failure to restart after, so a supervisor should stop the process with its "superseded
    /// generation" exit path. Readiness goes false when the run ends.
    pub fn superseded(error: impl Into<BoxError>) -> Self {
        SourceError {
            committed: Commit::Superseded,
            inner: error.into(),
        }
    }

    /// Whether a durable transition may have committed (the default).
    #[must_use]
    pub fn is_outcome_unknown(&self) -> bool {
        self.committed == Commit::Unknown
    }

    /// Whether the source proved that nothing committed (also true when
    /// [`superseded`](SourceError::superseded)).
    #[must_use]
    pub fn is_not_committed(&self) -> bool {
        matches!(self.committed, Commit::NotCommitted | Commit::Superseded)
    }

    /// Whether a newer owner fenced this source out ([`SourceError::superseded`]).
    #[must_use]
    pub fn is_superseded(&self) -> bool {
        self.committed == Commit::Superseded
    }

    /// The underlying error.
    #[must_use]
    pub fn get_ref(&self) -> &(dyn Error + Send + Sync + 'static) {
        &*self.inner
    }
}

impl fmt::Debug for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SourceError")
            .field("committed", &self.committed)
            .field("error", &self.inner)
            .finish()
    }
}

impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.committed {
            Commit::Unknown => write!(f, "{} (outcome unknown)", self.inner),
            Commit::NotCommitted => write!(f, "{} (not committed)", self.inner),
            Commit::Superseded => write!(f, "{} (superseded; not committed)", self.inner),
        }
    }
}

impl Error for SourceError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&*self.inner)
    }
}

/// An error from [`Attempt::run`]: the attempt could not reach a durable disposition.
///
/// By default ([`AttemptError::new`]) it is process-fatal: whether the attempt's last write
/// committed is unknown, so the controller poisons itself and the process must be replaced
/// (fail-stop). When the attempt *proves* that its last write did not commit (the database
/// refused the connection, the pool timed out, the transaction rolled back before `COMMIT`),
/// it returns [`AttemptError::not_committed`]: the item is still leased and returns when its
/// lease ends, nothing is ambiguous, and the controller stops with
/// [`RunErrorKind::NotCommitted`](crate::RunErrorKind::NotCommitted), reusable and not poisoned
/// (the Runtime Worker restarts it after a back-off, as it does for a claim that did not
/// commit).
pub struct AttemptError {
    inner: BoxError,
    not_committed: bool,
}

impl AttemptError {
    /// Wraps the error that made the attempt unable to reach a durable disposition, with an
    /// unknown outcome: the controller poisons itself.
    pub fn new(error: impl Into<BoxError>) -> Self {
        AttemptError {
            inner: error.into(),
            not_committed: false,
        }
    }

    /// Wraps an error proven not to have committed anything the attempt wrote last (only
    /// when the store says so: a connection that was never made, a transaction rolled back
    /// before `COMMIT`). The controller stops without poisoning itself.
    pub fn not_committed(error: impl Into<BoxError>) -> Self {
        AttemptError {
            inner: error.into(),
            not_committed: true,
        }
    }

    /// Whether the attempt proved that its last write did not commit.
    #[must_use]
    pub fn is_not_committed(&self) -> bool {
        self.not_committed
    }

    /// The underlying error.
    #[must_use]
    pub fn get_ref(&self) -> &(dyn Error + Send + Sync + 'static) {
        &*self.inner
    }

    pub(crate) fn into_inner(self) -> BoxError {
        self.inner
    }
}

impl fmt::Debug for AttemptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AttemptError")
            .field("inner", &self.inner)
            .field("not_committed", &self.not_committed)
            .finish()
    }
}

impl fmt::Display for AttemptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.inner, f)?;
        if self.not_committed {
            f.write_str(" (not committed)")?;
        }
        Ok(())
    }
}

impl Error for AttemptError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&*self.inner)
    }
}
