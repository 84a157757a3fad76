//! Helpers every work family needs around its SQL: epoch-millisecond times, text columns that
//! MariaDB reports as BLOB, unique-violation and lock-contention detection, contention retries,
//! and claim tokens.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::Row;
use tokio_util::sync::CancellationToken;

use crate::{Dialect, WriteError};

/// `t` as epoch milliseconds (the store's time unit); times before the epoch are 0.
#[must_use]
pub fn to_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Epoch milliseconds as a time; negative values are the epoch.
#[must_use]
pub fn from_ms(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

/// `input` shortened to at most `max` bytes (on a character boundary) for a message, with its
/// full length: a 1 MB key is never echoed whole into an error or a log line.
#[must_use]
pub fn echo(input: &str, max: usize) -> String {
    if input.len() <= max {
        return input.to_owned();
    }
    let mut end = max;
    while !input.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &input[..end], input.len())
}

/// Reads a text column, which MariaDB reports as BLOB through the `Any` driver.
///
/// # Errors
///
/// The column is missing, NULL, or not UTF-8.
pub fn text(r: &sqlx::any::AnyRow, index: usize) -> Result<String, sqlx::Error> {
    match r.try_get::<String, _>(index) {
        Ok(s) => Ok(s),
        Err(_) => {
            let bytes: Vec<u8> = r.try_get(index)?;
            String::from_utf8(bytes).map_err(|e| sqlx::Error::Decode(Box::new(e)))
        }
    }
}

/// Reads a nullable text column ([`text`], with SQL NULL as `None`).
///
/// # Errors
///
/// The column is missing or not UTF-8.
pub fn optional_text(r: &sqlx::any::AnyRow, index: usize) -> Result<Option<String>, sqlx::Error> {
    match r.try_get::<Option<String>, _>(index) {
        Ok(s) => Ok(s),
        Err(_) => {
            let bytes: Option<Vec<u8>> = r.try_get(index)?;
            bytes
                .map(|b| String::from_utf8(b).map_err(|e| sqlx::Error::Decode(Box::new(e))))
                .transpose()
        }
    }
}

/// Whether `e` is a unique-constraint violation, on any backend.
#[must_use]
pub fn is_unique_violation(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(d) => {
            d.is_unique_violation() || {
                let m = d.message().to_ascii_lowercase();
                m.contains("unique") || m.contains("duplicate")
            }
        }
        _ => false,
    }
}

/// Whether a rolled-back transaction failed only because of lock contention (a deadlock or
/// serialization failure, or SQLite's busy lock): safe and sensible to retry at once.
#[must_use]
pub fn is_contention(e: &WriteError) -> bool {
    let WriteError::NotCommitted(sqlx::Error::Database(d)) = e else {
        return false;
    };
    if let Some(m) = d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        // By error number (the SQLSTATE of TiDB's conflicts is the generic HY000): 1213
        // deadlock (also a Galera certification failure), TiDB's 8002 / 8005 / 9007 write
        // conflicts; each a definite rollback. A lock wait timeout (1205) is not: it ends only
        // the statement, and waiting again would not help.
        return matches!(m.number(), 1213 | 8002 | 8005 | 9007);
    }
    let code = d.code().unwrap_or_default();
    matches!(code.as_ref(), "40001" | "40P01" | "5" | "6" | "517")
        || d.message().contains("Deadlock found")
        || d.message().contains("database is locked")
}

/// Runs `op` again (up to 8 times, 5 ms doubling to 200 ms with jitter, cancel-aware) while it
/// fails with lock contention, which is a proven rollback.
///
/// # Errors
///
/// The last error, or [`WriteError::Cancelled`] when cancelled between tries.
pub async fn retrying<T, F, Fut>(cancel: &CancellationToken, mut op: F) -> Result<T, WriteError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, WriteError>>,
{
    let mut delay = Duration::from_millis(5);
    for _ in 0..8 {
        match op().await {
            Err(e) if is_contention(&e) && !cancel.is_cancelled() => {
                let jitter = Duration::from_micros(
                    u64::from(
                        SystemTime::now()
                            .duration_since(UNIX_EPOCH)
                            .map(|d| d.subsec_micros())
                            .unwrap_or(0),
                    ) % (delay.as_micros() as u64 + 1),
                );
                tokio::select! {
                    () = cancel.cancelled() => return Err(WriteError::Cancelled),
                    () = tokio::time::sleep(delay + jitter) => {}
                }
                delay = (delay * 2).min(Duration::from_millis(200));
            }
            other => return other,
        }
    }
    op().await
}

/// Whether `e` says the connection itself broke (an I/O or protocol error; PostgreSQL's
/// connection-exception class `08` or an administrator or crash shutdown `57P01`-`57P03`;
/// MySQL's "server has gone away" / "lost connection" `2006` / `2013`), not that the statement
/// failed: a read that hit it is safe to run again on another connection.
#[must_use]
pub fn is_connection_lost(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(d) => {
            if let Some(m) = d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
                return matches!(m.number(), 2006 | 2013);
            }
            let code = d.code().unwrap_or_default();
            code.starts_with("08") || matches!(code.as_ref(), "57P01" | "57P02" | "57P03")
        }
        _ => false,
    }
}

/// How many times a read-only domain read ([`earliest`]) is run again after its connection
/// broke: enough for the pool to get past the dead connections a server restart left in it
/// (each is closed when it fails), never a loop.
pub const READ_RETRIES_ON_LOST_CONNECTION: usize = 3;

/// The earliest value of the single-value reads `statements` (each a `SELECT MIN(...)`, NULL
/// when it finds nothing): how a family answers `next_work_at` from its indexed due and lease
/// columns. A read whose connection broke ([`is_connection_lost`]: a connection that died in
/// the pool's ping window, see [`DbOptions::ping_if_idle_for`](crate::DbOptions::ping_if_idle_for))
/// is run again, up to [`READ_RETRIES_ON_LOST_CONNECTION`] times: a lost `next_work_at` would
/// leave the controller without its due timer until the backstop.
///
/// # Errors
///
/// A failed read.
pub async fn earliest(db: &crate::Db, statements: &[&str]) -> Result<Option<i64>, sqlx::Error> {
    let mut tries = 0;
    loop {
        match earliest_once(db, statements).await {
            Err(e) if is_connection_lost(&e) && tries < READ_RETRIES_ON_LOST_CONNECTION => {
                tries += 1;
            }
            other => return other,
        }
    }
}

async fn earliest_once(db: &crate::Db, statements: &[&str]) -> Result<Option<i64>, sqlx::Error> {
    let mut out: Option<i64> = None;
    for sql in statements {
        let v: Option<i64> = sqlx::query(sql).fetch_one(db.pool()).await?.try_get(0)?;
        out = match (out, v) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    Ok(out)
}

/// A fresh 128-bit claim token, as 32 hex digits.
#[must_use]
pub fn new_token() -> String {
    use std::collections::hash_map::RandomState;
    use std::hash::{BuildHasher, Hasher};
    let mut a = RandomState::new().build_hasher();
    a.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    let mut b = RandomState::new().build_hasher();
    b.write_u64(a.finish());
    format!("{:016x}{:016x}", a.finish(), b.finish())
}

/// ` (p, p), (p, p)`: `rows` tuples of `cols` bind placeholders for a multi-row statement,
/// numbered from `start` on PostgreSQL (`$start`, `$start+1`, ...), `?` elsewhere.
#[must_use]
pub fn placeholders(dialect: Dialect, start: usize, rows: usize, cols: usize) -> String {
    let mut out = String::with_capacity(rows * cols * 5);
    let mut n = start;
    for r in 0..rows {
        out.push_str(if r == 0 { " (" } else { ", (" });
        for c in 0..cols {
            if c > 0 {
                out.push_str(", ");
            }
            if dialect == Dialect::Postgres {
                out.push('$');
                out.push_str(&n.to_string());
                n += 1;
            } else {
                out.push('?');
            }
        }
        out.push(')');
    }
    out
}

/// Callbacks a family runs after a commit (Bulk's `on_segment_committed`, Scheduled Flow's
/// `on_runs_reserved`): registered at any time, called in registration order, after the
/// commit and outside the transaction, on the caller's task. A hook must not block.
///
/// ```
/// use std::sync::{Arc, atomic::{AtomicUsize, Ordering}};
/// let hooks = nexuscrm_persistence::support::Hooks::<usize>::default();
/// assert!(hooks.is_empty());
/// let seen = Arc::new(AtomicUsize::new(0));
/// let s = seen.clone();
/// hooks.add(move |n: &usize| { s.fetch_add(*n, Ordering::Relaxed); });
/// hooks.call(&3);
/// assert_eq!(seen.load(Ordering::Relaxed), 3);
/// ```
pub struct Hooks<T: ?Sized> {
    list: std::sync::Mutex<Vec<Hook<T>>>,
}

type Hook<T> = std::sync::Arc<dyn Fn(&T) + Send + Sync>;

impl<T: ?Sized> Default for Hooks<T> {
    fn default() -> Self {
        Hooks {
            list: std::sync::Mutex::new(Vec::new()),
        }
    }
}

impl<T: ?Sized> std::fmt::Debug for Hooks<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("registered", &self.lock().len())
            .finish()
    }
}

impl<T: ?Sized> Hooks<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Hook<T>>> {
        // A hook never runs under the lock, so a poisoned lock holds a consistent list.
        self.list
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers `hook`.
    pub fn add(&self, hook: impl Fn(&T) + Send + Sync + 'static) {
        self.lock().push(std::sync::Arc::new(hook));
    }

    /// Whether no hook is registered (so the caller can skip building what it would pass).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Calls every registered hook with `value` (outside the lock: a hook may register another).
    pub fn call(&self, value: &T) {
        let hooks = self.lock().clone();
        for h in &hooks {
            h(value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_distinct_and_times_round_trip() {
        assert_ne!(new_token(), new_token());
        assert_eq!(new_token().len(), 32);
        let t = from_ms(1_700_000_000_123);
        assert_eq!(to_ms(t), 1_700_000_000_123);
        assert_eq!(to_ms(from_ms(-5)), 0);
    }

    #[test]
    fn placeholders_number_from_start_on_postgres_only() {
        assert_eq!(
            placeholders(Dialect::Postgres, 2, 2, 2),
            " ($2, $3), ($4, $5)"
        );
        assert_eq!(placeholders(Dialect::Mysql, 2, 2, 2), " (?, ?), (?, ?)");
        assert_eq!(placeholders(Dialect::Sqlite, 1, 1, 3), " (?, ?, ?)");
    }
}
