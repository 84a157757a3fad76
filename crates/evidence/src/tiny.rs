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
use std::time::{Duration, SystemTime};

use nexuscrm_persistence::Db;
use nexuscrm_worker::batch::{Batcher, Ticket};
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

/// One attempt's disposition in a batch: its job and claim, and whether its handoff was granted
/// (the batch then claims a successor for its slot).
#[derive(Debug)]
pub(crate) struct Disposition {
    id: i64,
    attempts: i32,
    wants_successor: bool,
}

/// A successor a batch claimed for a slot, already entered in the batcher (live before any
/// follower hears its answer, so no batch closes early without it).
#[derive(Debug)]
pub(crate) struct Successor {
    id: i64,
    attempts: i32,
    ticket: TinyTicket,
}

/// One attempt's place in the batcher.
pub(crate) type TinyTicket = Ticket<Disposition, Option<Successor>, sqlx::Error>;

/// The group commit shared by one replica's attempts ([`nexuscrm_worker::batch`]).
pub(crate) type TinyBatcher = Batcher<Disposition, Option<Successor>, sqlx::Error>;

/// How long a finished attempt waits for one still running before its batch commits without
/// it. Tiny attempts finish within microseconds of each other, so a batch normally closes on
/// "every live attempt submitted" long before this.
pub(crate) const BATCH_MAX_WAIT: Duration = Duration::from_millis(2);

/// The Source. With `batch`, dispositions are committed in groups ([`TinyBatcher`]): one
/// statement deletes every finished job of the group and claims a successor for each granted
/// handoff.
#[derive(Debug, Clone)]
pub(crate) struct TinySource {
    pub(crate) db: Db,
    pub(crate) batch: Option<TinyBatcher>,
}

impl TinySource {
    /// The plain Source: one `DELETE` per job.
    pub(crate) fn new(db: Db) -> Self {
        TinySource { db, batch: None }
    }

    /// The Source whose dispositions are batched, at most `capacity` to a statement.
    pub(crate) fn batched(db: Db, capacity: NonZeroUsize) -> Self {
        TinySource {
            db,
            batch: Some(Batcher::new(capacity, BATCH_MAX_WAIT)),
        }
    }
}

/// One claimed job.
#[derive(Debug)]
pub(crate) struct TinyAttempt {
    db: Db,
    id: i64,
    attempts: i32,
    /// Its place in the batcher, when dispositions are batched.
    batch: Option<(TinyBatcher, TinyTicket)>,
}

/// The attempts of claimed `(id, attempts)` rows.
fn attempts(db: &Db, batch: Option<&TinyBatcher>, rows: Vec<(i64, i32)>) -> Vec<TinyAttempt> {
    rows.into_iter()
        .map(|(id, attempts)| TinyAttempt {
            db: db.clone(),
            id,
            attempts,
            batch: batch.map(|b| (b.clone(), b.enter())),
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

/// The `VALUES` list of a batch's `(id, attempts)` pairs, as placeholders from `$1`.
fn values(n: usize) -> String {
    (0..n)
        .map(|i| format!("(${}::BIGINT, ${}::INT)", 2 * i + 1, 2 * i + 2))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One statement (so one transaction) that deletes every job of the batch and, with
/// `successors > 0`, claims up to that many others, as `DONE_AND_NEXT` does for one.
fn batch_sql(n: usize, successors: usize) -> String {
    let d = values(n);
    if successors == 0 {
        return format!(
            "WITH d(id, attempts) AS (VALUES {d}) \
             DELETE FROM tiny_job t USING d WHERE t.id = d.id AND t.attempts = d.attempts"
        );
    }
    format!(
        "WITH d(id, attempts) AS (VALUES {d}), \
         done AS (DELETE FROM tiny_job t USING d WHERE t.id = d.id AND t.attempts = d.attempts), \
         next AS (SELECT id FROM tiny_job \
                  WHERE available_at <= (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT \
                    AND id NOT IN (SELECT id FROM d) \
                  ORDER BY id FOR UPDATE SKIP LOCKED LIMIT {successors}) \
         UPDATE tiny_job t SET attempts = t.attempts + 1, \
         available_at = (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT + 30000 \
         FROM next WHERE t.id = next.id \
         RETURNING t.id, t.attempts"
    )
}

async fn run_batch_sql(
    db: &Db,
    items: &[Disposition],
    successors: usize,
) -> Result<Vec<(i64, i32)>, sqlx::Error> {
    let sql = batch_sql(items.len(), successors);
    let mut q = sqlx::query_as(&sql);
    for d in items {
        q = q.bind(d.id).bind(d.attempts);
    }
    q.fetch_all(db.pool()).await
}

/// Commits a batch of dispositions in one statement and hands each granted handoff a successor
/// while claimed ones last. A deadlock (two batches each holding successors and waiting for a
/// row the other locked) is a proven rollback: the batch is then committed by its `DELETE`
/// alone, without successors (retried, as a rollback again, at most three times).
async fn flush(
    db: Db,
    batcher: TinyBatcher,
    items: Vec<Disposition>,
) -> Result<Vec<Option<Successor>>, sqlx::Error> {
    let wanted = items.iter().filter(|d| d.wants_successor).count();
    let mut rows = match run_batch_sql(&db, &items, wanted).await {
        Ok(rows) => rows,
        Err(e) if is_deadlock(&e) => {
            let mut tries = 0;
            loop {
                match run_batch_sql(&db, &items, 0).await {
                    Ok(_) => break Vec::new(),
                    Err(e) if is_deadlock(&e) && tries < 3 => tries += 1,
                    Err(e) => return Err(e),
                }
            }
        }
        Err(e) => return Err(e),
    }
    .into_iter();
    Ok(items
        .iter()
        .map(|d| {
            if !d.wants_successor {
                return None;
            }
            rows.next().map(|(id, attempts)| Successor {
                id,
                attempts,
                ticket: batcher.enter(),
            })
        })
        .collect())
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
            attempts(&self.db, self.batch.as_ref(), rows),
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

/// The batched disposition of job `id` at `attempts`: returns once the statement holding it
/// committed, with the successor it claimed for this slot, if asked and one was left.
async fn dispose_batched(
    db: Db,
    (id, attempts): (i64, i32),
    (batcher, ticket): (TinyBatcher, TinyTicket),
    wants_successor: bool,
) -> Result<Option<TinyAttempt>, AttemptError> {
    let item = Disposition {
        id,
        attempts,
        wants_successor,
    };
    let (flush_db, b) = (db.clone(), batcher.clone());
    let successor = ticket
        .submit(item, move |items| flush(flush_db, b, items))
        .await
        .map_err(AttemptError::new)?;
    Ok(successor.map(|s| TinyAttempt {
        db,
        id: s.id,
        attempts: s.attempts,
        batch: Some((batcher, s.ticket)),
    }))
}

impl Attempt for TinyAttempt {
    async fn run(mut self, _cancel: CancellationToken) -> Result<(), AttemptError> {
        if let Some(batch) = self.batch.take() {
            return dispose_batched(self.db, (self.id, self.attempts), batch, false)
                .await
                .map(drop);
        }
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
        mut self,
        mut handoff: Handoff,
        cancel: CancellationToken,
    ) -> Result<Handed<Self>, AttemptError> {
        if let Some(batch) = self.batch.take() {
            let wants = handoff.begin();
            let job = (self.id, self.attempts);
            return Ok(match dispose_batched(self.db, job, batch, wants).await? {
                Some(next) => handoff.claimed(ClaimBatch::more(vec![next])),
                // Not granted, or the batch's `SKIP LOCKED` read ran out: no terminal answer.
                None => handoff.none(),
            });
        }
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
        let next = attempts(&self.db, None, rows);
        // A `LIMIT 1 … SKIP LOCKED` read racing with other claimers can come back empty while
        // work remains: that says nothing about the queue, so it is no terminal answer (the
        // controller's own claim, which is, refills the slot).
        if next.is_empty() {
            return Ok(handoff.none());
        }
        Ok(handoff.claimed(ClaimBatch::more(next)))
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroUsize;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use nexuscrm_persistence::Dialect;
    use nexuscrm_persistence::sqlx::{self, AnyConnection, Connection, Executor};
    use nexuscrm_persistence::testing::TestDb;
    use nexuscrm_worker::{ClaimBatch, Config, Controller, Source, SourceError};
    use tokio::sync::Mutex;
    use tokio_util::sync::CancellationToken;

    use super::{TinyAttempt, TinySource, reset, submit};

    /// The tiny Source, except that its first claim, once it returned, has connection `other`
    /// take job 1's row lock (as a claimer whose `FOR UPDATE` recheck failed would): the
    /// claimed attempt's disposition then waits on it.
    struct LockAfterFirstClaim {
        inner: TinySource,
        other: Arc<Mutex<AnyConnection>>,
        locked: AtomicBool,
    }

    impl Source for LockAfterFirstClaim {
        type Attempt = TinyAttempt;

        async fn check_ready(&self, cancel: CancellationToken) -> Result<(), SourceError> {
            self.inner.check_ready(cancel).await
        }

        async fn reconcile(&self, cancel: CancellationToken) -> Result<(), SourceError> {
            self.inner.reconcile(cancel).await
        }

        async fn claim(
            &self,
            capacity: NonZeroUsize,
            cancel: CancellationToken,
        ) -> Result<ClaimBatch<TinyAttempt>, SourceError> {
            let batch = self.inner.claim(capacity, cancel).await?;
            if !self.locked.swap(true, Ordering::SeqCst) {
                let mut guard = self.other.lock().await;
                let conn = &mut *guard;
                conn.execute("BEGIN").await.map_err(SourceError::new)?;
                conn.execute("SELECT id FROM tiny_job WHERE id = 1 FOR UPDATE")
                    .await
                    .map_err(SourceError::new)?;
            }
            Ok(batch)
        }

        async fn next_work_at(
            &self,
            cancel: CancellationToken,
        ) -> Result<Option<std::time::SystemTime>, SourceError> {
            self.inner.next_work_at(cancel).await
        }
    }

    async fn lock_waiters(db: &nexuscrm_persistence::Db) -> i64 {
        sqlx::query_scalar(
            "SELECT COUNT(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(db.pool())
        .await
        .expect("pg_stat_activity")
    }

    /// Two handoff statements can deadlock (each holds the successor it claimed and waits for
    /// the row it deletes). The one PostgreSQL rolls back (40P01) must dispose with the plain
    /// `DELETE` and claim nothing: no attempt error (which would stop the worker), no job lost
    /// or run twice. Here the deadlock is made on purpose: job 1's attempt claims job 2 and
    /// waits for job 1's row, which another transaction holds and which then asks for job 2's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handoff_rolled_back_by_a_deadlock_disposes_plainly_and_loses_nothing() {
        let Some(t) = TestDb::create(Dialect::Postgres, "tiny_deadlock").await else {
            return;
        };
        let db = t.db.clone();
        reset(&db).await.unwrap();
        submit(&db, 3).await.unwrap();
        let mut other = AnyConnection::connect(db.connect_url()).await.unwrap();
        // The attempt's deadlock check fires first (the server's 1 s default), so it is the
        // one rolled back, not this transaction.
        other.execute("SET deadlock_timeout = '60s'").await.unwrap();
        let other = Arc::new(Mutex::new(other));
        let source = LockAfterFirstClaim {
            inner: TinySource::new(db.clone()),
            other: other.clone(),
            locked: AtomicBool::new(false),
        };
        let ctl = Controller::new(
            source,
            Config::new("tiny")
                .capacity(NonZeroUsize::new(1).unwrap())
                .successor_handoff(true),
        )
        .unwrap();
        let handle = ctl.handle();
        let stop = CancellationToken::new();
        let run = tokio::spawn({
            let stop = stop.clone();
            async move { ctl.run(stop).await }
        });
        // Job 1's handoff statement has claimed job 2 and waits for job 1's row.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while lock_waiters(&db).await == 0 {
            assert!(tokio::time::Instant::now() < deadline, "no attempt waited");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Close the cycle: this waits for job 2's row until the attempt's statement is rolled
        // back; its claim of job 2 went with it.
        let attempts: i32 = {
            let mut guard = other.lock().await;
            let conn = &mut *guard;
            let row: (i32,) =
                sqlx::query_as("SELECT attempts FROM tiny_job WHERE id = 2 FOR UPDATE")
                    .fetch_one(&mut *conn)
                    .await
                    .unwrap();
            conn.execute("COMMIT").await.unwrap();
            row.0
        };
        assert_eq!(
            attempts, 0,
            "the rolled-back handoff's claim of job 2 did not stand"
        );
        while sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM tiny_job")
            .fetch_one(db.pool())
            .await
            .unwrap()
            > 0
        {
            let poisoned = handle.snapshot().poisoned;
            assert_eq!(
                poisoned, None,
                "the attempt failed instead of disposing plainly"
            );
            assert!(
                tokio::time::Instant::now() < deadline,
                "the queue did not drain"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let snap = handle.snapshot();
        assert_eq!(snap.poisoned, None);
        assert_eq!(snap.attempts_failed, 0);
        assert_eq!(snap.attempts_completed, 3, "each job ran once");
        // Job 1's handoff (the deadlock) and job 3's (an empty queue) claimed nothing; job 2's
        // claimed job 3.
        assert_eq!(
            (snap.handoffs, snap.handoffs_declined, snap.attempts_handed),
            (3, 2, 1)
        );
        stop.cancel();
        run.await.unwrap().unwrap();
        t.drop_database().await;
    }

    /// Batched disposition with the handoff: every job runs exactly once, none is lost, and the
    /// statements that commit dispositions are fewer than the jobs (groups, not one per job).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batched_dispositions_drain_every_job_once_in_fewer_commits_than_jobs() {
        let Some(t) = TestDb::create(Dialect::Postgres, "tiny_batched").await else {
            return;
        };
        let db = t.db.clone();
        reset(&db).await.unwrap();
        submit(&db, 500).await.unwrap();
        let capacity = NonZeroUsize::new(8).unwrap();
        let source = TinySource::batched(db.clone(), capacity);
        let batcher = source.batch.clone().unwrap();
        let ctl = Controller::new(
            source,
            Config::new("tiny")
                .capacity(capacity)
                .successor_handoff(true),
        )
        .unwrap();
        let handle = ctl.handle();
        let stop = CancellationToken::new();
        let run = tokio::spawn({
            let stop = stop.clone();
            async move { ctl.run(stop).await }
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while handle.snapshot().attempts_completed < 500 {
            assert_eq!(handle.snapshot().poisoned, None);
            assert!(
                tokio::time::Instant::now() < deadline,
                "the queue did not drain"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let left: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM tiny_job")
            .fetch_one(db.pool())
            .await
            .unwrap();
        assert_eq!(left, 0, "every job's disposition committed");
        let snap = handle.snapshot();
        assert_eq!((snap.attempts_completed, snap.attempts_failed), (500, 0));
        assert_eq!(batcher.items(), 500, "each job disposed once");
        assert!(
            batcher.flushes() < 250,
            "dispositions were grouped: {} flushes for 500 jobs",
            batcher.flushes()
        );
        stop.cancel();
        run.await.unwrap().unwrap();
        t.drop_database().await;
    }
}
