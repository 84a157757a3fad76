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
use nexuscrm_worker::{Attempt, AttemptError, ClaimBatch, Source, SourceError};
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
        let attempts: Vec<TinyAttempt> = rows
            .into_iter()
            .map(|(id, attempts)| TinyAttempt {
                db: self.db.clone(),
                id,
                attempts,
            })
            .collect();
        Ok(nexuscrm_persistence::family::batch(attempts, capacity))
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
}
