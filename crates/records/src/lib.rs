//! The records domain's read path, for families that derive from canonical records (the
//! Formula View): records by key in the caller's transaction, the change log after a cursor,
//! and how a process learns that records changed (an in-process [`Waker`] per watcher and,
//! across processes, [`RECORDS_CHANNEL`]).
//!
//! Derived families read canonical state only through these functions and never write it.
//! The records are written by the Bulk family (its migrations own `crm_record` and
//! `crm_record_change`); this crate exists so that a derived family depends on the records
//! domain, not on another family (the architecture boundary in
//! `crates/runtime-worker/tests/architecture.rs`).

use std::sync::OnceLock;

use nexuscrm_persistence::sqlx::{self, AnyConnection, Row};
use nexuscrm_persistence::support::text;
use nexuscrm_persistence::{Dialect, DialectQueries, Queries};
use serde_json::Value;

/// This crate's named statements per dialect.
fn queries(dialect: Dialect) -> &'static Queries {
    static Q: OnceLock<DialectQueries> = OnceLock::new();
    Q.get_or_init(|| {
        DialectQueries::new(
            include_str!("../sql/sqlite/queries.sql"),
            include_str!("../sql/postgres/queries.sql"),
            include_str!("../sql/mysql/queries.sql"),
        )
    })
    .for_dialect(dialect)
}

/// The PostgreSQL channel (and, where the probe polls, the work-signal name) on which Bulk
/// announces committed record changes when its `BulkConfig::announce_records` is on.
pub const RECORDS_CHANNEL: &str = "nexuscrm_records";

/// The work-signal name a polled probe sums to see announced record changes.
pub const RECORDS_SIGNAL: &str = "records";

/// Keys per `IN (...)` read (within every dialect's bind limit).
const KEYS_PER_STATEMENT: usize = 500;

/// A canonical record as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// Its key.
    pub key: String,
    /// Its revision: 1 when first written, one more per applied change.
    pub revision: i64,
    /// Its fields (a JSON object).
    pub data: Value,
}

/// The records among `keys` that exist, in the caller's transaction (a key that does not
/// exist is absent from the answer).
///
/// # Errors
///
/// A statement's error, or a record whose data is not JSON.
pub async fn read(
    c: &mut AnyConnection,
    dialect: Dialect,
    keys: &[String],
) -> Result<Vec<Record>, sqlx::Error> {
    let q = queries(dialect);
    let mut out = Vec::with_capacity(keys.len());
    for group in keys.chunks(KEYS_PER_STATEMENT) {
        let sql = format!(
            "{} ({})",
            q.get("records_read_prefix"),
            placeholders(dialect, group.len())
        );
        let mut query = sqlx::query(&sql);
        for k in group {
            query = query.bind(k.as_str());
        }
        for row in query.fetch_all(&mut *c).await? {
            let data = text(&row, 2)?;
            out.push(Record {
                key: text(&row, 0)?,
                revision: row.try_get(1)?,
                data: serde_json::from_str(&data).map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
            });
        }
    }
    Ok(out)
}

/// Up to `limit` change-log entries after `after` (by id), as `(id, record key)`.
///
/// # Errors
///
/// The statement's error.
pub async fn changes_after(
    c: &mut AnyConnection,
    dialect: Dialect,
    after: i64,
    limit: i64,
) -> Result<Vec<(i64, String)>, sqlx::Error> {
    let rows = sqlx::query(queries(dialect).get("changes_after"))
        .bind(after)
        .bind(limit)
        .fetch_all(&mut *c)
        .await?;
    rows.iter()
        .map(|r| Ok((r.try_get(0)?, text(r, 1)?)))
        .collect()
}

/// The change-log entries among `ids` that exist (committed and visible to the caller), as
/// `(id, record key)` in id order. How a cursor over the log finds an entry whose id was
/// allocated before an entry it already read but whose transaction committed after it.
///
/// # Errors
///
/// The statement's error.
pub async fn changes_with_ids(
    c: &mut AnyConnection,
    dialect: Dialect,
    ids: &[i64],
) -> Result<Vec<(i64, String)>, sqlx::Error> {
    let q = queries(dialect);
    let mut out = Vec::new();
    for group in ids.chunks(KEYS_PER_STATEMENT) {
        let sql = format!(
            "{} ({})",
            q.get("changes_with_ids_prefix"),
            placeholders(dialect, group.len())
        );
        let mut query = sqlx::query(&sql);
        for id in group {
            query = query.bind(*id);
        }
        for row in query.fetch_all(&mut *c).await? {
            out.push((row.try_get(0)?, text(&row, 1)?));
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// The newest change-log id (0 when the log is empty).
///
/// # Errors
///
/// The statement's error.
pub async fn last_change(c: &mut AnyConnection, dialect: Dialect) -> Result<i64, sqlx::Error> {
    let v: Option<i64> = sqlx::query(queries(dialect).get("change_max"))
        .fetch_one(&mut *c)
        .await?
        .try_get(0)?;
    Ok(v.unwrap_or(0))
}

/// `n` bind placeholders, comma-separated.
fn placeholders(dialect: Dialect, n: usize) -> String {
    (1..=n)
        .map(|i| {
            if dialect == Dialect::Postgres {
                format!("${i}")
            } else {
                "?".to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}
