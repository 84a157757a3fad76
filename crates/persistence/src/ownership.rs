//! Runtime work ownership and the fence: which deployment generation may claim or commit.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::{AnyConnection, Row};

use crate::db::{Db, Dialect};
use crate::error::{DbError, DbErrorKind};
use crate::queries;
use crate::tx::WriteError;

/// How many stripes each family's fence has. A takeover writes all of them; each writer checks
/// one, so writers contend with each other on a sixteenth of the rows and with every takeover.
pub const FENCE_STRIPES: u32 = 16;

/// The next writer's stripe: round-robin from a per-process start, so replicas spread too.
fn next_stripe(stripes: u32) -> u32 {
    static SEED: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let seed = *SEED.get_or_init(|| {
        std::process::id()
            ^ SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0)
    });
    seed.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) % stripes.max(1)
}

/// A family's fence for one deployment generation.
///
/// Every claim and every disposition commit calls [`Fence::holds`] inside its own transaction,
/// so a fenced-out generation can neither claim nor commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    family: String,
    generation: i64,
}

impl Fence {
    /// The fence of `family` for `generation` (not checked until [`Fence::holds`]).
    #[must_use]
    pub fn new(family: impl Into<String>, generation: i64) -> Self {
        Fence {
            family: family.into(),
            generation,
        }
    }

    /// The family.
    #[must_use]
    pub fn family(&self) -> &str {
        &self.family
    }

    /// The deployment generation.
    #[must_use]
    pub fn generation(&self) -> i64 {
        self.generation
    }

    /// The fence stripe the next fenced statement should lock (the stripes spread replicas'
    /// share locks over several rows). For a family that folds the fence read into its own
    /// statement (`FOR SHARE` on `runtime_work_fence_stripe` at `(family, stripe)`, comparing
    /// the generation), as Scheduled Flow's claim does on PostgreSQL; [`Fence::holds`] picks
    /// its stripe the same way.
    #[must_use]
    pub fn stripe(&self, db: &Db) -> i32 {
        i32::try_from(next_stripe(db.fence_stripes())).unwrap_or(0)
    }

    /// Inside the caller's write transaction: whether this generation still owns the family.
    /// Locks one of the fence's [`FENCE_STRIPES`] stripes (PostgreSQL `FOR SHARE`, MariaDB
    /// `LOCK IN SHARE MODE`, TiDB `FOR UPDATE`; SQLite's `BEGIN IMMEDIATE` already serializes
    /// writers). A takeover writes every stripe, so it cannot commit between this check and the
    /// caller's commit; writers on different stripes never wait for each other, even where the
    /// lock is exclusive.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn holds(&self, conn: &mut AnyConnection, db: &Db) -> Result<bool, sqlx::Error> {
        let q = queries().for_dialect(db.dialect());
        let stmt = if db.exclusive_fence() {
            q.get("fence_read_tidb")
        } else {
            q.get("fence_read")
        };
        let stripe = self.stripe(db);
        let row = sqlx::query(stmt)
            .bind(&self.family)
            .bind(stripe)
            .fetch_optional(&mut *conn)
            .await?;
        Ok(match row {
            Some(r) => r.try_get::<i64, _>(0)? == self.generation,
            None => false,
        })
    }
}

/// Writes `generation` into every stripe of `family`'s fence (never lowering one), locking each
/// until the caller commits.
async fn write_stripes(
    conn: &mut AnyConnection,
    q: &crate::Queries,
    family: &str,
    generation: i64,
) -> Result<(), sqlx::Error> {
    for stripe in 0..FENCE_STRIPES {
        sqlx::query(q.get("fence_stripe_upsert"))
            .bind(family)
            .bind(i32::try_from(stripe).unwrap_or(0))
            .bind(generation)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// What [`Db::take_ownership_noting`] runs in the takeover's transaction: the connection and the
/// generation that owned the family before (`None` for the first owner).
pub type OnTaken = dyn for<'c> Fn(&'c mut sqlx::AnyConnection, Option<i64>) -> crate::TxFuture<'c, ()>
    + Send
    + Sync;

impl Db {
    /// Takes ownership of `family` for `generation` in one transaction; the same generation
    /// taking it again is a no-op. A newer generation fences out every older one at once: their
    /// next claim or commit fails the fence check.
    ///
    /// A transaction that lost to lock contention (a deadlock, a serialization failure, a
    /// Galera certification failure or a TiDB write conflict, at a statement or at COMMIT) is a
    /// proven rollback and is tried again (up to 8 times, with backoff): taking ownership is
    /// idempotent, and the takeover is exactly what contends with every in-flight writer of the
    /// family's fence stripes.
    ///
    /// # Errors
    ///
    /// [`DbErrorKind::Superseded`] when a newer generation already owns the family (an older
    /// generation can never take ownership back); a database error otherwise, whose message
    /// says whether the transaction provably did not commit or its COMMIT's outcome is unknown
    /// (then taking ownership again settles it: it is idempotent).
    pub async fn take_ownership(
        &self,
        family: &str,
        generation: i64,
        owner: &str,
    ) -> Result<Fence, DbError> {
        self.take_ownership_noting(family, generation, owner, &|_, _| {
            Box::pin(async { Ok(()) })
        })
        .await
    }

    /// [`Db::take_ownership`], running `on_taken(conn, previous generation)` inside the same
    /// transaction when the ownership changes (a first owner, or a newer generation taking over;
    /// not when the same generation takes it again): a caller writes the takeover's audit event
    /// there, so the event exists if and only if the takeover committed. An error from it rolls
    /// the takeover back.
    ///
    /// # Errors
    ///
    /// As for [`Db::take_ownership`].
    pub async fn take_ownership_noting(
        &self,
        family: &str,
        generation: i64,
        owner: &str,
        on_taken: &OnTaken,
    ) -> Result<Fence, DbError> {
        if generation < 1 {
            return Err(DbError::config(format!(
                "deployment generation must be at least 1, got {generation}"
            )));
        }
        let never = tokio_util::sync::CancellationToken::new();
        let tried = crate::support::retrying(&never, || {
            self.take_ownership_once(family, generation, owner, on_taken)
        })
        .await;
        match tried {
            Ok(taken) => taken,
            Err(WriteError::OutcomeUnknown(e)) => {
                Err(DbError::sql("committing ownership (outcome unknown)", e))
            }
            Err(WriteError::NotCommitted(e)) => {
                Err(DbError::sql("taking ownership (not committed)", e))
            }
            Err(WriteError::Cancelled) => Err(DbError::new(
                DbErrorKind::Database,
                "taking ownership: cancelled (not committed)",
            )),
        }
    }

    /// One try of [`Db::take_ownership`]: `Ok(Err(..))` for an answer that trying again would
    /// not change (superseded), `Err` for a transaction that did not (knowably) commit.
    async fn take_ownership_once(
        &self,
        family: &str,
        generation: i64,
        owner: &str,
        on_taken: &OnTaken,
    ) -> Result<Result<Fence, DbError>, WriteError> {
        let q = queries().for_dialect(self.dialect());
        let mut tx = self.begin_write().await.map_err(WriteError::NotCommitted)?;
        let result: Result<Option<i64>, sqlx::Error> = async {
            let current = sqlx::query(q.get("ownership_read"))
                .bind(family)
                .fetch_optional(tx.conn())
                .await?
                .map(|r| r.try_get::<i64, _>(0))
                .transpose()?;
            let now = now_ms();
            match current {
                None => {
                    sqlx::query(q.get("ownership_insert"))
                        .bind(family)
                        .bind(generation)
                        .bind(owner)
                        .bind(now)
                        .execute(tx.conn())
                        .await?;
                    sqlx::query(q.get("fence_insert"))
                        .bind(family)
                        .bind(generation)
                        .execute(tx.conn())
                        .await?;
                    write_stripes(tx.conn(), q, family, generation).await?;
                    on_taken(tx.conn(), None).await?;
                }
                Some(g) if g < generation => {
                    sqlx::query(q.get("ownership_update"))
                        .bind(generation)
                        .bind(owner)
                        .bind(now)
                        .bind(family)
                        .bind(generation)
                        .execute(tx.conn())
                        .await?;
                    sqlx::query(q.get("fence_update"))
                        .bind(generation)
                        .bind(family)
                        .bind(generation)
                        .execute(tx.conn())
                        .await?;
                    write_stripes(tx.conn(), q, family, generation).await?;
                    on_taken(tx.conn(), Some(g)).await?;
                }
                Some(_) => {}
            }
            Ok(current)
        }
        .await;
        let current = match result {
            Ok(current) => current,
            Err(e) => {
                tx.rollback().await;
                return Err(WriteError::NotCommitted(e));
            }
        };
        if let Some(g) = current
            && g > generation
        {
            tx.rollback().await;
            return Ok(Err(DbError::new(
                DbErrorKind::Superseded,
                format!(
                    "family `{family}` is owned by generation {g}; generation {generation} can \
                     never take it back"
                ),
            )));
        }
        match tx.commit().await {
            Ok(()) => Ok(Ok(Fence::new(family, generation))),
            Err(e) if crate::tx::commit_rolled_back(self.dialect(), &e) => {
                Err(WriteError::NotCommitted(e))
            }
            Err(e) => Err(WriteError::OutcomeUnknown(e)),
        }
    }

    /// The generation that owns `family`, if any.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn owner_generation(&self, family: &str) -> Result<Option<i64>, DbError> {
        let stmt = match self.dialect() {
            Dialect::Postgres => "SELECT generation FROM runtime_work_fence WHERE family = $1",
            _ => "SELECT generation FROM runtime_work_fence WHERE family = ?",
        };
        sqlx::query(stmt)
            .bind(family)
            .fetch_optional(self.pool())
            .await
            .map_err(|e| DbError::sql("reading the fence", e))?
            .map(|r| r.try_get::<i64, _>(0))
            .transpose()
            .map_err(|e| DbError::sql("decoding the fence", e))
    }
}
