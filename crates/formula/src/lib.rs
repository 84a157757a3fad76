//! The Formula View work family (contract slice 5, first half): CEL formula fields and an
//! account roll-up, derived from the canonical CRM records that Bulk writes, and kept
//! convergent (`derived-reconcilable / convergent`).
//!
//! - Definitions: [`Formula::define`], [`Formula::list`], [`Formula::drop_definition`]. An
//!   expression is CEL ([`cel`](https://crates.io/crates/cel)); syntax errors are refused with
//!   the parser's message and position, unknown names are refused, and a sample record, when
//!   given, must evaluate. Every define or drop takes a new, ever-growing version from one
//!   epoch row.
//! - The view: `formula_value` (one row per record and formula: the value or that record's
//!   error, the source revision and definition version it came from) and `formula_rollup` (per
//!   account, the sum of open opportunity amounts, maintained incrementally).
//! - Work discovery: a cursor over the records domain's change log, woken in process by
//!   `Bulk::watch_records` (in `nexuscrm-bulk`) and across processes by
//!   Bulk's record announcements; a definition change marks records stale by epoch. The
//!   controller's [`FormulaSource`] claims bounded batches of due records.
//! - Convergence: [`FormulaSource`]'s reconciliation sweeps canonical state and the view in
//!   key-ordered chunks and marks exactly the rows that differ from what canonical state
//!   implies; a fresh process sweeps everything once and so converges without replaying the
//!   change history. See the README for the argument and its proof.

#![forbid(unsafe_code)]

mod eval;
mod source;

pub use eval::{ExpressionError, FUNCTIONS, VARIABLES};
pub use source::{FormulaAttempt, FormulaSource, SweepReport};

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use nexuscrm_persistence::sqlx::{self, Row};
use nexuscrm_persistence::support::{from_ms, optional_text, retrying, text, to_ms};
use nexuscrm_persistence::{
    Db, DbError, DialectQueries, Fence, GenerationProbe, Migration, Queries, WriteError,
};
use nexuscrm_worker::fault::Faults;
use nexuscrm_worker::{Clock, Declaration, Durability, Effect, SystemClock};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

/// The family's name (migrations, ownership, declarations).
pub const FAMILY: &str = "formula";

/// The Formula View declaration: canonical records stay authoritative; the view is derived
/// and a fresh process converges it without replaying events.
pub const DECLARATION: Declaration =
    Declaration::new_const(FAMILY, Durability::DerivedReconcilable, Effect::Convergent);

/// The only target a definition has today: every canonical CRM record.
pub const TARGET: &str = "crm_record";

/// The longest formula name.
pub const MAX_NAME: usize = 64;

/// The longest expression accepted.
pub const MAX_EXPRESSION: usize = 4096;

/// The most definitions at once (every record is derived under all of them).
pub const MAX_DEFINITIONS: usize = 64;

/// The family's migrations, per dialect.
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "formula definitions, derived values, roll-up and change cursor",
    sqlite: include_str!("../sql/sqlite/0001_formula.sql"),
    postgres: include_str!("../sql/postgres/0001_formula.sql"),
    mysql: include_str!("../sql/mysql/0001_formula.sql"),
}];

pub(crate) fn queries(dialect: nexuscrm_persistence::Dialect) -> &'static Queries {
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

/// The text of one of the family's named statements for `dialect`, for tools that explain or
/// measure it.
///
/// # Panics
///
/// If `name` is not a statement of the family.
#[must_use]
pub fn statement(dialect: nexuscrm_persistence::Dialect, name: &str) -> &'static str {
    queries(dialect).get(name)
}

/// A stored definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Definition {
    /// Its name (the formula's column in the view).
    pub name: String,
    /// What it applies to ([`TARGET`]).
    pub target: String,
    /// Its CEL expression.
    pub expression: String,
    /// Its version: grows with every define or drop of any formula.
    pub version: i64,
    /// When it was last defined.
    pub updated_at: SystemTime,
}

/// What a define did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Defined {
    /// The definition now stored.
    pub definition: Definition,
    /// `false` when the same expression was already defined (nothing changed).
    pub changed: bool,
}

/// One derived value of a record.
#[derive(Debug, Clone, PartialEq)]
pub struct DerivedValue {
    /// The formula.
    pub formula: String,
    /// The value, or `None` when the record produced an error.
    pub value: Option<Value>,
    /// The record's evaluation error, if it produced one.
    pub error: Option<String>,
    /// The record revision it was derived from.
    pub source_revision: i64,
    /// The definition version it was derived under.
    pub definition_version: i64,
}

/// A record's place in the view.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordView {
    /// The record revision its values come from (`-1`: never derived yet).
    pub source_revision: i64,
    /// Whether it waits for (re)derivation.
    pub stale: bool,
    /// When it was last derived.
    pub derived_at: Option<SystemTime>,
    /// Its values, by formula name.
    pub values: Vec<DerivedValue>,
}

/// One account's roll-up: the sum of its open opportunity amounts (records with a string
/// `account`, an integer `amount`, and a `stage` that does not start with `closed`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rollup {
    /// The account.
    pub account: String,
    /// The sum of amounts.
    pub total: i64,
    /// How many records contribute.
    pub records: i64,
}

/// Queue observations of the view.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FormulaObservations {
    /// Records waiting for (re)derivation, claimed ones included (capped).
    pub stale: i64,
    /// How long the oldest unclaimed stale record has waited.
    pub oldest_stale_age: Option<Duration>,
    /// Records with at least one evaluation error (capped).
    pub records_with_errors: i64,
    /// Where every count stops.
    pub count_cap: i64,
}

/// Why a Formula View call failed.
#[derive(Debug)]
pub struct FormulaError {
    kind: FormulaErrorKind,
    message: String,
}

/// The kind of a [`FormulaError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FormulaErrorKind {
    /// The input was refused (a bad name, an invalid expression, a failing sample): nothing
    /// was written.
    Invalid,
    /// No such definition.
    NotFound,
    /// The write provably did not commit; retrying is safe.
    NotAccepted,
    /// The write may or may not have committed; read back before retrying.
    OutcomeUnknown,
    /// A read failed.
    Database,
}

impl FormulaError {
    fn new(kind: FormulaErrorKind, message: impl Into<String>) -> Self {
        FormulaError {
            kind,
            message: message.into(),
        }
    }

    fn write(context: &str, e: &WriteError) -> Self {
        let kind = if e.is_not_committed() {
            FormulaErrorKind::NotAccepted
        } else {
            FormulaErrorKind::OutcomeUnknown
        };
        FormulaError::new(kind, format!("{context}: {e}"))
    }

    fn db(context: &str, e: &sqlx::Error) -> Self {
        FormulaError::new(FormulaErrorKind::Database, format!("{context}: {e}"))
    }

    /// The kind.
    #[must_use]
    pub fn kind(&self) -> FormulaErrorKind {
        self.kind
    }
}

impl fmt::Display for FormulaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for FormulaError {}

/// How a [`Formula`] handle is built.
#[derive(Debug, Clone)]
pub struct FormulaOptions {
    clock: Arc<dyn Clock>,
    generation: i64,
    lease: Duration,
    keys_per_attempt: usize,
    keys_per_write: usize,
    sweep_chunk: i64,
    sweep_chunks_per_turn: usize,
    reconcile_db: Option<Db>,
    generation_poll: Option<Duration>,
    listen: bool,
    faults: Faults,
}

impl Default for FormulaOptions {
    fn default() -> Self {
        FormulaOptions {
            clock: Arc::new(SystemClock),
            generation: 1,
            lease: Duration::from_secs(30),
            keys_per_attempt: 100,
            keys_per_write: 100,
            sweep_chunk: 1000,
            sweep_chunks_per_turn: 4,
            reconcile_db: None,
            generation_poll: Some(Duration::from_secs(5)),
            listen: true,
            faults: Faults::none(),
        }
    }
}

impl FormulaOptions {
    /// The wall clock for leases and due times. By default the system clock.
    #[must_use]
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The deployment generation this handle claims and commits as. By default 1.
    #[must_use]
    pub fn generation(mut self, generation: i64) -> Self {
        self.generation = generation;
        self
    }

    /// How long a claim holds its records. By default 30 seconds.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(10));
        self
    }

    /// Records per attempt (one controller slot) and per write transaction inside it (with a
    /// lease heartbeat between writes). By default 100 and 100.
    #[must_use]
    pub fn batch(mut self, keys_per_attempt: usize, keys_per_write: usize) -> Self {
        self.keys_per_attempt = keys_per_attempt.clamp(1, 10_000);
        self.keys_per_write = keys_per_write.clamp(1, self.keys_per_attempt);
        self
    }

    /// Rows per reconciliation chunk (one bounded range read each way), and chunks per
    /// backstop turn after the first, full sweep of a process. By default 1000 and 4.
    #[must_use]
    pub fn sweep(mut self, chunk: usize, chunks_per_turn: usize) -> Self {
        self.sweep_chunk = chunk.clamp(1, 100_000) as i64;
        self.sweep_chunks_per_turn = chunks_per_turn.max(1);
        self
    }

    /// A separate, small pool for reconciliation, so a sweep never competes with the business
    /// connection pool. By default the family's own handle.
    #[must_use]
    pub fn reconcile_db(mut self, db: Db) -> Self {
        self.reconcile_db = Some(db);
        self
    }

    /// Interval of the polled generation probe (`None`: off). By default 5 seconds.
    #[must_use]
    pub fn generation_poll(mut self, every: Option<Duration>) -> Self {
        self.generation_poll = every;
        self
    }

    /// On PostgreSQL, `LISTEN nexuscrm_records` instead of polling. By default on.
    #[must_use]
    pub fn listen(mut self, on: bool) -> Self {
        self.listen = on;
        self
    }

    /// The fault hook (tests only).
    #[must_use]
    pub fn faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }
}

/// The Formula View over one database for one deployment generation: definitions, reads of
/// the view, observations, and the [`FormulaSource`] constructor.
#[derive(Debug, Clone)]
pub struct Formula {
    pub(crate) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) db: Db,
    pub(crate) reconcile_db: Db,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) fence: Fence,
    pub(crate) lease: Duration,
    pub(crate) keys_per_attempt: usize,
    pub(crate) keys_per_write: usize,
    pub(crate) sweep_chunk: i64,
    pub(crate) sweep_chunks_per_turn: usize,
    pub(crate) probe: GenerationProbe,
    pub(crate) faults: Faults,
    pub(crate) waker: OnceLock<nexuscrm_worker::Waker>,
    /// Compiled programs by (name, version).
    pub(crate) programs: Mutex<HashMap<(String, i64), Arc<eval::Compiled>>>,
    /// Where this process's rolling sweep stands; `None` until its first full sweep.
    pub(crate) sweep: tokio::sync::Mutex<Option<source::SweepCursor>>,
}

impl Formula {
    /// Runs the migrations (ownership first) and returns a handle. Does not take ownership:
    /// call [`Formula::take_ownership`]. The records domain's tables must exist (open Bulk
    /// first).
    ///
    /// # Errors
    ///
    /// A migration error (including a schema newer than this code).
    pub async fn open(db: Db, options: FormulaOptions) -> Result<Formula, DbError> {
        db.migrate_ownership().await?;
        db.migrate(FAMILY, MIGRATIONS).await?;
        Ok(Formula::without_migrations(db, options))
    }

    /// A handle over an already-migrated database.
    #[must_use]
    pub fn without_migrations(db: Db, options: FormulaOptions) -> Formula {
        let probe = GenerationProbe::new(
            &db,
            nexuscrm_records::RECORDS_CHANNEL,
            options.listen,
            options.generation_poll,
        )
        .signal(nexuscrm_records::RECORDS_SIGNAL);
        Formula {
            inner: Arc::new(Inner {
                reconcile_db: options.reconcile_db.unwrap_or_else(|| db.clone()),
                db,
                clock: options.clock,
                fence: Fence::new(FAMILY, options.generation),
                lease: options.lease,
                keys_per_attempt: options.keys_per_attempt,
                keys_per_write: options.keys_per_write,
                sweep_chunk: options.sweep_chunk,
                sweep_chunks_per_turn: options.sweep_chunks_per_turn,
                probe,
                faults: options.faults,
                waker: OnceLock::new(),
                programs: Mutex::new(HashMap::new()),
                sweep: tokio::sync::Mutex::new(None),
            }),
        }
    }

    /// Takes ownership of the family for this handle's generation (fencing out older ones).
    ///
    /// # Errors
    ///
    /// A newer generation owns it, or a database error.
    pub async fn take_ownership(&self, owner: &str) -> Result<(), FormulaError> {
        self.inner
            .db
            .take_ownership(FAMILY, self.inner.fence.generation(), owner)
            .await
            .map_err(|e| {
                FormulaError::new(
                    FormulaErrorKind::Database,
                    format!("taking ownership of formula: {e}"),
                )
            })?;
        self.inner.probe.notify(&self.inner.db).await;
        Ok(())
    }

    /// The database handle.
    #[must_use]
    pub fn db(&self) -> &Db {
        &self.inner.db
    }

    /// The generation this handle claims as.
    #[must_use]
    pub fn generation(&self) -> i64 {
        self.inner.fence.generation()
    }

    /// The controller's waker: defines and drops wake it (record changes do through
    /// `Bulk::watch_records` (in `nexuscrm-bulk`)).
    pub fn set_waker(&self, waker: nexuscrm_worker::Waker) {
        let _ = self.inner.waker.set(waker);
    }

    /// The controller's [`Source`](nexuscrm_worker::Source).
    #[must_use]
    pub fn source(&self) -> FormulaSource {
        FormulaSource {
            formula: self.clone(),
        }
    }

    fn wake(&self) {
        if let Some(w) = self.inner.waker.get() {
            w.wake();
        }
    }

    /// Defines (or redefines) formula `name` as the CEL `expression`. The expression is
    /// compiled (a syntax error is refused with the parser's message and position; names
    /// other than `record`, `key`, `revision` and the interpreter's functions are refused) and,
    /// when `sample` is given (a record's fields), evaluated on it: an error there is refused
    /// too. Redefining the same expression changes nothing. Every change marks every record
    /// stale for this formula (by epoch), and the view rederives in the background.
    ///
    /// # Errors
    ///
    /// [`FormulaErrorKind::Invalid`] with the reason, or a write error.
    pub async fn define(
        &self,
        name: &str,
        expression: &str,
        sample: Option<&Value>,
    ) -> Result<Defined, FormulaError> {
        validate_name(name)?;
        if expression.trim().is_empty() || expression.len() > MAX_EXPRESSION {
            return Err(FormulaError::new(
                FormulaErrorKind::Invalid,
                format!("an expression must be 1 to {MAX_EXPRESSION} bytes"),
            ));
        }
        let program = eval::compile(expression).map_err(|e| {
            FormulaError::new(
                FormulaErrorKind::Invalid,
                format!("formula `{name}` is not valid CEL: {}", e.message),
            )
        })?;
        if let Some(sample) = sample {
            if !sample.is_object() {
                return Err(FormulaError::new(
                    FormulaErrorKind::Invalid,
                    "a sample record must be a JSON object of fields",
                ));
            }
            if let eval::Outcome::Error(e) = eval::evaluate(&program, "sample", 1, sample) {
                return Err(FormulaError::new(
                    FormulaErrorKind::Invalid,
                    format!("formula `{name}` fails on the sample record: {e}"),
                ));
            }
        }
        let inner = &self.inner;
        let q = queries(inner.db.dialect());
        let clock = inner.clock.clone();
        let (name2, expr2) = (name.to_owned(), expression.to_owned());
        let never = CancellationToken::new();
        let out = retrying(&never, || {
            let (clock, name, expr) = (clock.clone(), name2.clone(), expr2.clone());
            inner.db.write(&never, move |c| {
                Box::pin(async move {
                    // The epoch row first: defines are serial, and ordered against every
                    // derivation (which holds a share lock on it).
                    sqlx::query(q.get("epoch_bump")).execute(&mut *c).await?;
                    let version: i64 = sqlx::query_scalar(q.get("epoch_read"))
                        .fetch_one(&mut *c)
                        .await?;
                    let existing = sqlx::query(q.get("def_get"))
                        .bind(name.as_str())
                        .fetch_optional(&mut *c)
                        .await?
                        .map(|r| definition(&r))
                        .transpose()?;
                    if let Some(d) = existing
                        && d.expression == expr
                    {
                        // Unchanged: give the epoch back by rolling back.
                        return Err(sqlx::Error::Protocol(format!("unchanged:{}", d.version)));
                    }
                    let count: i64 = sqlx::query(q.get("def_list"))
                        .fetch_all(&mut *c)
                        .await?
                        .len() as i64;
                    if count >= MAX_DEFINITIONS as i64 {
                        return Err(sqlx::Error::Protocol("too many".into()));
                    }
                    let now = to_ms(clock.now());
                    sqlx::query(q.get("def_upsert"))
                        .bind(name.as_str())
                        .bind(TARGET)
                        .bind(expr.as_str())
                        .bind(version)
                        .bind(now)
                        .execute(&mut *c)
                        .await?;
                    Ok(Definition {
                        name,
                        target: TARGET.to_owned(),
                        expression: expr,
                        version,
                        updated_at: from_ms(now),
                    })
                })
            })
        })
        .await;
        match out {
            Ok(definition) => {
                inner.probe.notify(&inner.db).await;
                self.wake();
                Ok(Defined {
                    definition,
                    changed: true,
                })
            }
            Err(WriteError::NotCommitted(sqlx::Error::Protocol(m)))
                if m.starts_with("unchanged:") =>
            {
                let d = self.get(name).await?.ok_or_else(|| {
                    FormulaError::new(FormulaErrorKind::NotFound, format!("no formula `{name}`"))
                })?;
                Ok(Defined {
                    definition: d,
                    changed: false,
                })
            }
            Err(WriteError::NotCommitted(sqlx::Error::Protocol(m))) if m == "too many" => {
                Err(FormulaError::new(
                    FormulaErrorKind::Invalid,
                    format!("at most {MAX_DEFINITIONS} formulas can be defined; drop one first"),
                ))
            }
            Err(e) => Err(FormulaError::write(
                &format!("defining formula `{name}`"),
                &e,
            )),
        }
    }

    /// Drops formula `name`: its values leave the view as records are rederived.
    ///
    /// # Errors
    ///
    /// [`FormulaErrorKind::NotFound`], or a write error.
    pub async fn drop_definition(&self, name: &str) -> Result<i64, FormulaError> {
        validate_name(name)?;
        let inner = &self.inner;
        let q = queries(inner.db.dialect());
        let never = CancellationToken::new();
        let name2 = name.to_owned();
        let out = retrying(&never, || {
            let name = name2.clone();
            inner.db.write(&never, move |c| {
                Box::pin(async move {
                    sqlx::query(q.get("epoch_bump")).execute(&mut *c).await?;
                    let r = sqlx::query(q.get("def_delete"))
                        .bind(name.as_str())
                        .execute(&mut *c)
                        .await?;
                    if r.rows_affected() == 0 {
                        return Err(sqlx::Error::RowNotFound);
                    }
                    sqlx::query_scalar::<_, i64>(q.get("epoch_read"))
                        .fetch_one(&mut *c)
                        .await
                })
            })
        })
        .await;
        match out {
            Ok(v) => {
                inner.probe.notify(&inner.db).await;
                self.wake();
                Ok(v)
            }
            Err(WriteError::NotCommitted(sqlx::Error::RowNotFound)) => Err(FormulaError::new(
                FormulaErrorKind::NotFound,
                format!("no formula `{name}`"),
            )),
            Err(e) => Err(FormulaError::write(
                &format!("dropping formula `{name}`"),
                &e,
            )),
        }
    }

    /// One definition.
    ///
    /// # Errors
    ///
    /// A read error.
    pub async fn get(&self, name: &str) -> Result<Option<Definition>, FormulaError> {
        let q = queries(self.inner.db.dialect());
        sqlx::query(q.get("def_get"))
            .bind(name)
            .fetch_optional(self.inner.db.pool())
            .await
            .map_err(|e| FormulaError::db("reading a definition", &e))?
            .map(|r| definition(&r))
            .transpose()
            .map_err(|e| FormulaError::db("reading a definition", &e))
    }

    /// Every definition, by name.
    ///
    /// # Errors
    ///
    /// A read error.
    pub async fn list(&self) -> Result<Vec<Definition>, FormulaError> {
        let q = queries(self.inner.db.dialect());
        let rows = sqlx::query(q.get("def_list"))
            .fetch_all(self.inner.db.pool())
            .await
            .map_err(|e| FormulaError::db("listing definitions", &e))?;
        rows.iter()
            .map(definition)
            .collect::<Result<_, _>>()
            .map_err(|e| FormulaError::db("listing definitions", &e))
    }

    /// A record's derived values with the revision and version they came from, or `None` when
    /// the view has no entry for it.
    ///
    /// # Errors
    ///
    /// A read error.
    pub async fn show(&self, record_key: &str) -> Result<Option<RecordView>, FormulaError> {
        let q = queries(self.inner.db.dialect());
        let pool = self.inner.db.pool();
        let err = |e: sqlx::Error| FormulaError::db("reading the view", &e);
        let Some(rec) = sqlx::query(q.get("record_of"))
            .bind(record_key)
            .fetch_optional(pool)
            .await
            .map_err(err)?
        else {
            return Ok(None);
        };
        let rows = sqlx::query(q.get("values_of"))
            .bind(record_key)
            .fetch_all(pool)
            .await
            .map_err(err)?;
        let mut values = Vec::with_capacity(rows.len());
        for r in &rows {
            let value: Option<String> = optional_text(r, 1).map_err(err)?;
            values.push(DerivedValue {
                formula: text(r, 0).map_err(err)?,
                value: value.and_then(|v| serde_json::from_str(&v).ok()),
                error: optional_text(r, 2).map_err(err)?,
                source_revision: r.try_get(3).map_err(err)?,
                definition_version: r.try_get(4).map_err(err)?,
            });
        }
        let due: Option<i64> = rec.try_get(2).map_err(err)?;
        let derived: Option<i64> = rec.try_get(3).map_err(err)?;
        Ok(Some(RecordView {
            source_revision: rec.try_get(0).map_err(err)?,
            stale: due.is_some(),
            derived_at: derived.map(from_ms),
            values,
        }))
    }

    /// The roll-up: accounts with at least one contributing record, by account (at most
    /// `limit`).
    ///
    /// # Errors
    ///
    /// A read error.
    pub async fn rollups(&self, limit: i64) -> Result<Vec<Rollup>, FormulaError> {
        let q = queries(self.inner.db.dialect());
        let err = |e: sqlx::Error| FormulaError::db("reading the roll-up", &e);
        let rows = sqlx::query(q.get("rollups"))
            .bind(limit)
            .fetch_all(self.inner.db.pool())
            .await
            .map_err(err)?;
        rows.iter()
            .map(|r| {
                Ok(Rollup {
                    account: text(r, 0)?,
                    total: r.try_get(1)?,
                    records: r.try_get(2)?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(err)
    }

    /// Queue observations, each count capped at
    /// [`OBSERVATION_CAP`](nexuscrm_persistence::OBSERVATION_CAP).
    ///
    /// # Errors
    ///
    /// A read error.
    pub async fn observations(&self) -> Result<FormulaObservations, FormulaError> {
        let cap = nexuscrm_persistence::OBSERVATION_CAP;
        let q = queries(self.inner.db.dialect());
        let pool = self.inner.db.pool();
        let err = |e: sqlx::Error| FormulaError::db("reading formula observations", &e);
        let stale: i64 = sqlx::query_scalar(q.get("stale_count"))
            .bind(cap)
            .fetch_one(pool)
            .await
            .map_err(err)?;
        let oldest: Option<i64> = sqlx::query_scalar(q.get("oldest_stale"))
            .fetch_one(pool)
            .await
            .map_err(err)?;
        let errors: i64 = sqlx::query_scalar(q.get("error_count"))
            .bind(cap)
            .fetch_one(pool)
            .await
            .map_err(err)?;
        let now = self.inner.clock.now();
        Ok(FormulaObservations {
            stale,
            oldest_stale_age: oldest.map(|t| now.duration_since(from_ms(t)).unwrap_or_default()),
            records_with_errors: errors,
            count_cap: cap,
        })
    }
}

/// What canonical state implies for the view, computed directly from `definitions` and
/// `records` without the worker, the change log or any stored view row: every record's value
/// (or error) per formula with the revision and version it must come from, and the roll-up.
/// The convergence proofs compare the stored view with this.
#[must_use]
pub fn recompute(
    definitions: &[Definition],
    records: &[nexuscrm_records::Record],
) -> (Vec<(String, DerivedValue)>, Vec<Rollup>) {
    let programs: Vec<(&Definition, Result<cel::Program, String>)> = definitions
        .iter()
        .map(|d| {
            let p = eval::compile(&d.expression)
                .map_err(|e| format!("the definition no longer compiles: {}", e.message));
            (d, p)
        })
        .collect();
    let mut values = Vec::new();
    let mut sums: std::collections::BTreeMap<String, (i64, i64)> =
        std::collections::BTreeMap::new();
    for r in records {
        for (d, p) in &programs {
            let outcome = match p {
                Ok(p) => eval::evaluate(p, &r.key, r.revision, &r.data),
                Err(e) => eval::Outcome::Error(e.clone()),
            };
            let (value, error) = match outcome {
                eval::Outcome::Value(v) => (Some(v), None),
                eval::Outcome::Error(e) => (None, Some(e)),
            };
            values.push((
                r.key.clone(),
                DerivedValue {
                    formula: d.name.clone(),
                    value,
                    error,
                    source_revision: r.revision,
                    definition_version: d.version,
                },
            ));
        }
        if let Some((account, amount)) = eval::contribution(&r.data) {
            let s = sums.entry(account).or_default();
            s.0 += amount;
            s.1 += 1;
        }
    }
    values.sort_by(|a, b| (&a.0, &a.1.formula).cmp(&(&b.0, &b.1.formula)));
    let rollups = sums
        .into_iter()
        .map(|(account, (total, records))| Rollup {
            account,
            total,
            records,
        })
        .collect();
    (values, rollups)
}

fn validate_name(name: &str) -> Result<(), FormulaError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(FormulaError::new(
            FormulaErrorKind::Invalid,
            format!(
                "a formula name is 1 to {MAX_NAME} characters of a-z, 0-9 and _, starting with \
                 a letter; got {:?}",
                nexuscrm_persistence::support::echo(name, 80)
            ),
        ))
    }
}

fn definition(r: &sqlx::any::AnyRow) -> Result<Definition, sqlx::Error> {
    Ok(Definition {
        name: text(r, 0)?,
        target: text(r, 1)?,
        expression: text(r, 2)?,
        version: r.try_get(3)?,
        updated_at: from_ms(r.try_get(4)?),
    })
}
