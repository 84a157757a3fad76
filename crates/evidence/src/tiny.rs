//! The tiny-job workload: a small `Source` over its own table, as a new user would write one
//! (issue 16's "tried as a new user would"): claim is one
//! `UPDATE … WHERE id IN (SELECT … FOR UPDATE SKIP LOCKED LIMIT $free) RETURNING`, the attempt
//! is the job's one small write, `DELETE … WHERE id = $1 AND attempts = $2`. Both sides of the
//! comparison run this same Source, so the difference is how each drives it.
//!
//! A benchmark's Source, not a family: a claimed row is leased for 30 s by `available_at`, and
//! `next_work_at` answers `None` (nothing is due later in a drain), so a crashed attempt's row
//! waits for the next reconciliation rather than an exact timer.

use std::num::NonZeroUsize;
use std::time::SystemTime;

use nexuscrm_persistence::Db;
use nexuscrm_worker::{Attempt, AttemptError, ClaimBatch, Handed, Handoff, Source, SourceError};
use tokio_util::sync::CancellationToken;

use crate::AnyError;

/// The table, created (empty) by [`reset`].
const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS tiny_job (
    id           BIGSERIAL PRIMARY KEY,
    payload      TEXT   NOT NULL,
    attempts     INT    NOT NULL DEFAULT 0,
    available_at BIGINT NOT NULL DEFAULT 0
)";

const CLAIM: &str = "UPDATE tiny_job SET attempts = attempts + 1, \
     available_at = (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT + 30000 \
     WHERE id IN (SELECT id FROM tiny_job \
                  WHERE available_at <= (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT \
                  ORDER BY id FOR UPDATE SKIP LOCKED LIMIT $1) \
     RETURNING id, attempts";

const DONE: &str = "DELETE FROM tiny_job WHERE id = $1 AND attempts = $2";

/// The disposition with the successor handoff: the same `DELETE` and the same claim (for the
/// one slot it frees) in one statement, so one transaction.
const DONE_AND_NEXT: &str = "WITH done AS (DELETE FROM tiny_job WHERE id = $1 AND attempts = $2), \
     next AS (SELECT id FROM tiny_job \
              WHERE available_at <= (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT \
                AND id <> $1 \
              ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1) \
     UPDATE tiny_job t SET attempts = t.attempts + 1, \
     available_at = (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT + 30000 \
     FROM next WHERE t.id = next.id \
     RETURNING t.id, t.attempts";

/// Creates the table (if missing) and empties it.
pub(crate) async fn reset(db: &Db) -> Result<(), AnyError> {
    sqlx::query(SCHEMA).execute(db.pool()).await?;
    sqlx::query("TRUNCATE tiny_job RESTART IDENTITY")
        .execute(db.pool())
        .await?;
    Ok(())
}

/// Inserts `n` jobs, 1,000 per statement.
pub(crate) async fn submit(db: &Db, n: usize) -> Result<(), AnyError> {
    let mut left = n;
    while left > 0 {
        let chunk = left.min(1_000);
        sqlx::query(
            "INSERT INTO tiny_job (payload) SELECT 'job ' || g FROM generate_series(1, $1) g",
        )
        .bind(chunk as i64)
        .execute(db.pool())
        .await?;
        left -= chunk;
    }
    Ok(())
}

/// The Source.
#[derive(Debug, Clone)]
pub(crate) struct TinySource {
    pub(crate) db: Db,
}

/// One claimed job.
#[derive(Debug)]
pub(crate) struct TinyAttempt {
    db: Db,
    id: i64,
    attempts: i32,
}

/// The attempts of claimed `(id, attempts)` rows.
fn attempts(db: &Db, rows: Vec<(i64, i32)>) -> Vec<TinyAttempt> {
    rows.into_iter()
        .map(|(id, attempts)| TinyAttempt {
            db: db.clone(),
            id,
            attempts,
        })
        .collect()
}

fn is_deadlock(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if matches!(d.code().as_deref(), Some("40P01" | "40001")))
}

fn source_error(e: sqlx::Error) -> SourceError {
    // A single statement in autocommit whose answer was lost may have committed.
    SourceError::new(e)
}

impl Source for TinySource {
    type Attempt = TinyAttempt;

    async fn check_ready(&self, _cancel: CancellationToken) -> Result<(), SourceError> {
        Ok(())
    }

    async fn reconcile(&self, _cancel: CancellationToken) -> Result<(), SourceError> {
        Ok(())
    }

    async fn claim(
        &self,
        capacity: NonZeroUsize,
        _cancel: CancellationToken,
    ) -> Result<ClaimBatch<TinyAttempt>, SourceError> {
        let rows: Vec<(i64, i32)> = sqlx::query_as(CLAIM)
            .bind(capacity.get() as i64)
            .fetch_all(self.db.pool())
            .await
            .map_err(source_error)?;
        Ok(nexuscrm_persistence::family::batch(
            attempts(&self.db, rows),
            capacity,
        ))
    }

    async fn next_work_at(
        &self,
        _cancel: CancellationToken,
    ) -> Result<Option<SystemTime>, SourceError> {
        Ok(None)
    }
}

impl Attempt for TinyAttempt {
    async fn run(self, _cancel: CancellationToken) -> Result<(), AttemptError> {
        sqlx::query(DONE)
            .bind(self.id)
            .bind(self.attempts)
            .execute(self.db.pool())
            .await
            .map(drop)
            .map_err(AttemptError::new)
    }

    /// With the handoff granted, the disposition claims the successor in the same statement.
    async fn run_handing_off(
        self,
        mut handoff: Handoff,
        cancel: CancellationToken,
    ) -> Result<Handed<Self>, AttemptError> {
        if !handoff.begin() {
            self.run(cancel).await?;
            return Ok(handoff.none());
        }
        let rows: Vec<(i64, i32)> = match sqlx::query_as(DONE_AND_NEXT)
            .bind(self.id)
            .bind(self.attempts)
            .fetch_all(self.db.pool())
            .await
        {
            Ok(rows) => rows,
            // The statement both waits (its DELETE, behind a row lock another claim's `FOR
            // UPDATE` left on a row that then failed its recheck) and holds locks (its claim),
            // so two of them can deadlock: PostgreSQL rolls one back (40P01), a proven
            // rollback. Dispose as without the handoff and take no successor.
            Err(e) if is_deadlock(&e) => {
                self.run(cancel).await?;
                return Ok(handoff.none());
            }
            Err(e) => return Err(AttemptError::new(e)),
        };
        let next = attempts(&self.db, rows);
        // A `LIMIT 1 … SKIP LOCKED` read racing with other claimers can come back empty while
        // work remains: that says nothing about the queue, so it is no terminal answer (the
        // controller's own claim, which is, refills the slot).
        if next.is_empty() {
            return Ok(handoff.none());
        }
        Ok(handoff.claimed(ClaimBatch::more(next)))
    }
}
