//! The shape every work family's [`Source`](nexuscrm_worker::Source) shares, so that a family
//! crate holds only its own SQL, state machine and attempt (the way River's drivers share one
//! conformance suite):
//!
//! - [`fenced`]: one write transaction, retried on lock contention, whose work runs only while
//!   this deployment generation owns the family (the fence row is locked first) with "now" read
//!   once the transaction holds its locks; fenced out, it writes nothing and answers
//!   [`superseded`];
//! - [`claim_rows`]: a claim statement's rows, through `RETURNING` or, on the MySQL dialect
//!   (TiDB ignores `RETURNING`), read back by the claim token;
//! - [`batch`]: a claim's attempts as a [`ClaimBatch`] (a full batch may have more behind it);
//! - [`next_work_at`], [`generation`], [`generation_changed`]: the controller's timer and
//!   generation reads, cancellable, over [`earliest`](crate::support::earliest) and a
//!   [`GenerationProbe`];
//! - [`source_error`], [`attempt_error`], [`probe_error`]: store errors classified for the
//!   controller (provably not committed, or ambiguous: fail-stop).

use std::future::Future;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::SystemTime;

use nexuscrm_worker::{AttemptError, ClaimBatch, Clock, Generation, SourceError};
use sqlx::any::{AnyArguments, AnyRow};
use sqlx::{Any, AnyConnection};
use tokio_util::sync::CancellationToken;

use crate::support::{earliest, from_ms, retrying, to_ms};
use crate::{Db, Dialect, Fence, GenerationProbe, ProbeError, TxFuture, WriteError};

/// A write error for the controller: `not_committed` when the transaction provably did not
/// commit, otherwise ambiguous (the controller fail-stops).
#[must_use]
pub fn source_error(e: WriteError) -> SourceError {
    if e.is_not_committed() {
        SourceError::not_committed(e)
    } else {
        SourceError::new(e)
    }
}

/// A disposition write that failed, for the controller, as `message`: proven not committed
/// (the lease still holds the item and returns it when it ends, so the controller need not be
/// replaced), or ambiguous (fail-stop).
#[must_use]
pub fn attempt_error(message: impl Into<String>, e: &WriteError) -> AttemptError {
    let message = message.into();
    if e.is_not_committed() {
        AttemptError::not_committed(message)
    } else {
        AttemptError::new(message)
    }
}

/// A probe error for the controller: a cancelled probe read committed nothing.
#[must_use]
pub fn probe_error(e: ProbeError) -> SourceError {
    match e {
        ProbeError::Cancelled => SourceError::not_committed("cancelled"),
        other => SourceError::new(other),
    }
}

/// The error of a generation the fence has shut out of `family`.
#[must_use]
pub fn superseded(family: &str, generation: i64) -> SourceError {
    SourceError::superseded(format!(
        "generation {generation} is fenced out of `{family}`: a newer deployment generation \
         owns it"
    ))
}

/// A claim's attempts: a batch that filled every slot asked for may have more behind it (the
/// controller claims again at once); a partial one is terminal.
#[must_use]
pub fn batch<A>(attempts: Vec<A>, asked: NonZeroUsize) -> ClaimBatch<A> {
    if attempts.len() == asked.get() {
        ClaimBatch::more(attempts)
    } else {
        ClaimBatch::done(attempts)
    }
}

/// One fenced write transaction: `work(conn, now_ms)` runs only after the fence row shows that
/// `fence`'s generation still owns its family, with `now_ms` read from `clock` once the
/// transaction holds that lock (and anew on every retry: a "now" read before a long lock wait
/// would miss work that fell due during it). Lock contention (a deadlock, a serialization
/// failure) is a proven rollback and is retried.
///
/// # Errors
///
/// [`superseded`] when the fence is lost (nothing written); otherwise the write's error as
/// [`source_error`] classifies it.
pub async fn fenced<T, F>(
    db: &Db,
    fence: &Fence,
    clock: &Arc<dyn Clock>,
    cancel: &CancellationToken,
    work: F,
) -> Result<T, SourceError>
where
    T: Send + 'static,
    F: for<'c> Fn(&'c mut AnyConnection, i64) -> TxFuture<'c, T> + Clone + Send + Sync + 'static,
{
    let done = retrying(cancel, || {
        let (db2, fence, clock, work) = (db.clone(), fence.clone(), clock.clone(), work.clone());
        db.write(cancel, move |c| {
            Box::pin(async move {
                if !fence.holds(c, &db2).await? {
                    return Ok(None); // Fenced out: write nothing.
                }
                let now = to_ms(clock.now());
                work(c, now).await.map(Some)
            })
        })
    })
    .await
    .map_err(source_error)?;
    done.ok_or_else(|| superseded(fence.family(), fence.generation()))
}

/// A claim statement's rows: `claim` is an `UPDATE … RETURNING` on SQLite and PostgreSQL; on
/// the MySQL dialect, where TiDB ignores `RETURNING`, it is executed and the rows carrying
/// `token` are read back with `claimed` (one `?` bound to the token).
///
/// # Errors
///
/// The statement's error.
pub async fn claim_rows<'q>(
    c: &mut AnyConnection,
    dialect: Dialect,
    claim: sqlx::query::Query<'q, Any, AnyArguments<'q>>,
    claimed: &'q str,
    token: &'q str,
) -> Result<Vec<AnyRow>, sqlx::Error> {
    if dialect == Dialect::Mysql {
        claim.execute(&mut *c).await?;
        sqlx::query(claimed).bind(token).fetch_all(&mut *c).await
    } else {
        claim.fetch_all(&mut *c).await
    }
}

/// The earliest time any of `statements` (each one `SELECT MIN(…)` of epoch milliseconds)
/// names, or `None`; `not_committed` when cancelled (a read commits nothing).
///
/// # Errors
///
/// A statement's error.
pub async fn next_work_at(
    db: &Db,
    cancel: &CancellationToken,
    statements: &[&str],
) -> Result<Option<SystemTime>, SourceError> {
    tokio::select! {
        biased;
        () = cancel.cancelled() => Err(SourceError::not_committed("cancelled")),
        r = earliest(db, statements) => r.map(|t| t.map(from_ms)).map_err(SourceError::new),
    }
}

/// The probe's current generation ([`GenerationProbe::start`]), for
/// [`Source::generation`](nexuscrm_worker::Source::generation).
///
/// # Errors
///
/// As [`probe_error`] classifies the probe's.
pub async fn generation<F, Fut>(
    probe: &GenerationProbe,
    cancel: &CancellationToken,
    read: F,
) -> Result<Option<Generation>, SourceError>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<u64, sqlx::Error>>,
{
    probe
        .start(cancel, read)
        .await
        .map(|g| g.map(Generation))
        .map_err(probe_error)
}

/// The next generation after `seen` ([`GenerationProbe::changed`]), for
/// [`Source::generation_changed`](nexuscrm_worker::Source::generation_changed).
///
/// # Errors
///
/// As [`probe_error`] classifies the probe's.
pub async fn generation_changed<F, Fut>(
    probe: &GenerationProbe,
    seen: Generation,
    cancel: &CancellationToken,
    read: F,
) -> Result<Generation, SourceError>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<u64, sqlx::Error>>,
{
    probe
        .changed(seen.0, cancel, read)
        .await
        .map(Generation)
        .map_err(probe_error)
}

/// The reconciliation of a family whose effects are transactional: under the fence, one
/// statement `release_older` (bound to `now_ms`, then this generation) gives every lease an
/// older generation holds back to the queue. Only safe where an attempt's effect commits with
/// its disposition; a family whose effect leaves the database must quarantine instead.
///
/// # Errors
///
/// As [`fenced`].
pub async fn release_older_generations(
    db: &Db,
    fence: &Fence,
    clock: &Arc<dyn Clock>,
    cancel: &CancellationToken,
    release_older: &'static str,
) -> Result<(), SourceError> {
    let generation = fence.generation();
    fenced(db, fence, clock, cancel, move |c, now| {
        Box::pin(async move {
            sqlx::query(release_older)
                .bind(now)
                .bind(generation)
                .execute(&mut *c)
                .await
                .map(drop)
        })
    })
    .await
}
