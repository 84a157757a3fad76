//! Write transactions that are safe under cancellation.

use std::future::Future;
use std::pin::Pin;

use sqlx::pool::PoolConnection;
use sqlx::{Any, AnyConnection, Executor};
use tokio_util::sync::CancellationToken;

use crate::db::{Db, Dialect};

/// The future a [`Db::write`] closure returns.
pub type TxFuture<'c, T> = Pin<Box<dyn Future<Output = Result<T, sqlx::Error>> + Send + 'c>>;

/// Why a write transaction did not (knowably) commit.
#[derive(Debug)]
pub enum WriteError {
    /// Provably not committed: `COMMIT` was never sent (cancelled, a statement failed, the
    /// connection could not be had), or the server answered `COMMIT` with an error that means
    /// the transaction was rolled back ([`commit_rolled_back`]). Safe to report as "not
    /// committed".
    NotCommitted(sqlx::Error),
    /// Cancelled before `COMMIT` was sent: not committed.
    Cancelled,
    /// `COMMIT` was sent and its answer was lost (or was an error that does not say the
    /// transaction rolled back): the outcome is unknown.
    OutcomeUnknown(sqlx::Error),
}

impl WriteError {
    /// Whether the transaction provably did not commit.
    #[must_use]
    pub fn is_not_committed(&self) -> bool {
        !matches!(self, WriteError::OutcomeUnknown(_))
    }
}

impl std::fmt::Display for WriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriteError::NotCommitted(e) => write!(f, "transaction rolled back: {e}"),
            WriteError::Cancelled => f.write_str("cancelled before commit; nothing was written"),
            WriteError::OutcomeUnknown(e) => write!(f, "commit outcome unknown: {e}"),
        }
    }
}

impl std::error::Error for WriteError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            WriteError::NotCommitted(e) | WriteError::OutcomeUnknown(e) => Some(e),
            WriteError::Cancelled => None,
        }
    }
}

/// An open write transaction on a pooled connection (`BEGIN IMMEDIATE` on SQLite, `BEGIN` on
/// PostgreSQL, `START TRANSACTION` on the MySQL dialect).
///
/// Dropped without [`commit`](WriteTx::commit) or [`rollback`](WriteTx::rollback), its
/// connection is closed instead of returned to the pool, so the server rolls the transaction
/// back and no later user can inherit it.
#[derive(Debug)]
pub struct WriteTx {
    conn: Option<PoolConnection<Any>>,
}

impl WriteTx {
    /// The connection, for statements inside the transaction.
    pub fn conn(&mut self) -> &mut AnyConnection {
        self.conn.as_mut().expect("open transaction")
    }

    /// Commits.
    ///
    /// # Errors
    ///
    /// The commit's error: its outcome is unknown (the connection is then discarded).
    pub async fn commit(mut self) -> Result<(), sqlx::Error> {
        // The connection stays inside `self` while COMMIT is in flight: if this future is
        // dropped mid-await, Drop closes the connection instead of pooling an open transaction.
        self.conn().execute("COMMIT").await?;
        if let Some(conn) = self.conn.take() {
            drop(conn); // Back to the pool: the transaction is closed.
        }
        Ok(())
    }

    /// Rolls back (discarding the connection if even that fails).
    pub async fn rollback(mut self) {
        if self.conn().execute("ROLLBACK").await.is_ok()
            && let Some(conn) = self.conn.take()
        {
            drop(conn);
        }
        // Otherwise Drop closes the connection.
    }
}

impl Drop for WriteTx {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            // Close rather than reuse a connection with an open transaction.
            drop(conn.detach());
        }
    }
}

impl Db {
    /// Begins a write transaction.
    ///
    /// # Errors
    ///
    /// No connection, or `BEGIN` failed (nothing was written).
    pub async fn begin_write(&self) -> Result<WriteTx, sqlx::Error> {
        // Wrapped before BEGIN is sent: dropped mid-BEGIN, the connection is closed rather than
        // returned to the pool holding a transaction (and, on SQLite, the write lock).
        let mut tx = WriteTx {
            conn: Some(self.acquire().await?),
        };
        let begin = match self.dialect() {
            Dialect::Sqlite => "BEGIN IMMEDIATE",
            Dialect::Postgres => "BEGIN",
            Dialect::Mysql => "START TRANSACTION",
        };
        tx.conn().execute(begin).await?;
        Ok(tx)
    }

    /// Runs `work` in one write transaction and commits, honouring `cancel` without ever
    /// abandoning a commit.
    ///
    /// If `cancel` fires before `COMMIT` is sent, the work is stopped, the connection closed
    /// (the server rolls back) and [`WriteError::Cancelled`] returned: nothing committed. Once
    /// `COMMIT` is sent it is awaited to completion.
    ///
    /// # Errors
    ///
    /// [`WriteError`], saying whether anything may have committed.
    ///
    /// # Cancel safety
    ///
    /// Cancel through `cancel`. Dropping the future is also safe before commit (the connection
    /// is closed), but a dropped commit has an unknown outcome.
    pub async fn write<T, F>(&self, cancel: &CancellationToken, work: F) -> Result<T, WriteError>
    where
        F: for<'c> FnOnce(&'c mut AnyConnection) -> TxFuture<'c, T>,
    {
        let mut tx = tokio::select! {
            biased;
            () = cancel.cancelled() => return Err(WriteError::Cancelled),
            tx = self.begin_write() => tx.map_err(WriteError::NotCommitted)?,
        };
        let result = {
            let fut = work(tx.conn());
            tokio::select! {
                biased;
                r = fut => Some(r),
                () = cancel.cancelled() => None,
            }
        };
        match result {
            None => {
                drop(tx);
                Err(WriteError::Cancelled)
            }
            Some(Err(e)) => {
                tx.rollback().await;
                Err(WriteError::NotCommitted(e))
            }
            Some(Ok(v)) => match tx.commit().await {
                Ok(()) => Ok(v),
                Err(e) if commit_rolled_back(self.dialect(), &e) => {
                    Err(WriteError::NotCommitted(e))
                }
                Err(e) => Err(WriteError::OutcomeUnknown(e)),
            },
        }
    }
}

/// Whether an error returned *by `COMMIT`* means the server rolled the transaction back, so
/// nothing committed. Only definite aborts qualify; every other commit error (a lost connection,
/// a timeout, an unknown code) stays outcome-unknown.
///
/// - PostgreSQL: SQLSTATE `40001` (serialization failure, e.g. a serializable conflict found at
///   commit) and `40P01` (deadlock detected, e.g. in a deferred constraint trigger).
/// - MySQL dialect: `1213` (deadlock; InnoDB rolls back the whole transaction, and a Galera
///   certification failure at commit is reported this way), and TiDB's `8002` (a `SELECT ...
///   FOR UPDATE` write conflict that cannot be retried), `8005` (write conflict, transaction
///   rolled back) and `9007` (write conflict with a lost pessimistic lock).
/// - SQLite: none; a failed `COMMIT` on SQLite leaves the transaction open or its outcome is
///   the file's, so it is never claimed to be rolled back.
#[must_use]
pub fn commit_rolled_back(dialect: Dialect, error: &sqlx::Error) -> bool {
    let Some(db) = error.as_database_error() else {
        return false;
    };
    match dialect {
        Dialect::Postgres => matches!(db.code().as_deref(), Some("40001" | "40P01")),
        Dialect::Mysql => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|e| matches!(e.number(), 1213 | 8002 | 8005 | 9007)),
        Dialect::Sqlite => false,
    }
}
