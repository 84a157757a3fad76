//! The Bulk store: producer, claim, segments, leases, observations.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use nexuscrm_persistence::sqlx::{self, AnyConnection, Row};
use nexuscrm_persistence::support::{echo, from_ms, is_unique_violation, retrying, text, to_ms};
use nexuscrm_persistence::{
    Db, DbError, Dialect, DialectQueries, Fence, GenerationProbe, Migration, Queries, WriteError,
};
use nexuscrm_worker::fault::{Crash, CrashPoint, Faults};
use nexuscrm_worker::{Clock, SystemClock};
use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;

use crate::FAMILY;

/// The Bulk family's migrations.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "bulk jobs, inputs, records and change log",
        sqlite: include_str!("../sql/sqlite/0001_bulk.sql"),
        postgres: include_str!("../sql/postgres/0001_bulk.sql"),
        mysql: include_str!("../sql/mysql/0001_bulk.sql"),
    },
    Migration {
        version: 2,
        name: "claims without progress; byte-exact utf8mb4 keys (MySQL dialect)",
        sqlite: include_str!("../sql/sqlite/0002_bulk.sql"),
        postgres: include_str!("../sql/postgres/0002_bulk.sql"),
        mysql: include_str!("../sql/mysql/0002_bulk.sql"),
    },
    Migration {
        version: 3,
        name: "claim-token index (MySQL dialect; RETURNING elsewhere)",
        sqlite: "",
        postgres: "",
        mysql: include_str!("../sql/mysql/0003_bulk.sql"),
    },
];

pub(crate) fn queries(dialect: Dialect) -> &'static Queries {
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

/// Largest accepted segment size.
pub const MAX_SEGMENT_SIZE: u32 = 10_000;
/// Largest accepted job.
pub const MAX_ROWS: usize = 1_000_000;

/// Bulk settings.
#[derive(Debug, Clone)]
pub struct BulkConfig {
    pub(crate) lease: Duration,
    pub(crate) default_segment_size: u32,
    pub(crate) default_max_attempts: u32,
    pub(crate) backoff_base: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) generation_poll: Option<Duration>,
    pub(crate) listen: bool,
    pub(crate) announce_records: bool,
    pub(crate) audit: bool,
}

impl Default for BulkConfig {
    fn default() -> Self {
        BulkConfig {
            lease: Duration::from_secs(30),
            default_segment_size: 100,
            default_max_attempts: 5,
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(300),
            generation_poll: Some(Duration::from_secs(5)),
            listen: true,
            announce_records: false,
            audit: false,
        }
    }
}

impl BulkConfig {
    /// Write an audit event (`record.applied`) for every row a segment applies, in the
    /// segment's own transaction, through the audit outbox ([`nexuscrm_audit::record`]): the
    /// event exists if and only if the change committed. Its id is
    /// `bulk-<job>-<ordinal>-r<revision>` (stable across retries, since a rolled-back segment
    /// leaves the revision where it was), its subject the record key, its actor `bulk`, its
    /// body the job, ordinal, revision and applied fields. [`Bulk::open`] then also runs the
    /// audit migrations. One more multi-row statement per 100 rows. By default off.
    #[must_use]
    pub fn audit(mut self, on: bool) -> Self {
        self.audit = on;
        self
    }

    /// After every segment that committed, announce the record changes to other processes:
    /// `NOTIFY nexuscrm_records` on PostgreSQL with LISTEN, otherwise a bump of the `records`
    /// work signal (see [`records::RECORDS_CHANNEL`](crate::records::RECORDS_CHANNEL)). For a
    /// derived family (the Formula View) in another process; one statement per segment, after
    /// its commit. Watchers in this process are woken either way
    /// ([`Bulk::watch_records`]). By default off.
    #[must_use]
    pub fn announce_records(mut self, on: bool) -> Self {
        self.announce_records = on;
        self
    }

    /// How long a claim owns a job without a heartbeat. By default 30 seconds; heartbeats run
    /// between segments, so a segment must take well under this.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(10));
        self
    }

    /// Rows per segment for jobs that do not choose. By default 100.
    #[must_use]
    pub fn default_segment_size(mut self, n: u32) -> Self {
        self.default_segment_size = n.clamp(1, MAX_SEGMENT_SIZE);
        self
    }

    /// Claims before a job is poisoned, for jobs that do not choose. By default 5.
    #[must_use]
    pub fn default_max_attempts(mut self, n: u32) -> Self {
        self.default_max_attempts = n.max(1);
        self
    }

    /// First retry delay after a transient error, doubling per attempt up to `max`. By default
    /// 1 second and 5 minutes.
    #[must_use]
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_max = max.max(base);
        self
    }

    /// On PostgreSQL, use `LISTEN nexuscrm_bulk` as the cross-process generation probe: no query
    /// while idle; producers `NOTIFY` after commit, outside the claim path, with an empty
    /// payload. It is a lossy hint: a lost connection is reported as a generation loss (the
    /// controller reconciles), and reconciliation and the due timer carry correctness. By default
    /// on; turn it off behind a transaction-pooling proxy, where `LISTEN` does not work, to fall
    /// back to [`generation_poll`](BulkConfig::generation_poll). Ignored on other backends.
    #[must_use]
    pub fn listen(mut self, on: bool) -> Self {
        self.listen = on;
        self
    }

    /// Interval of the cross-process generation probe (a `MAX(id)` read of the primary key
    /// index, which changes when any process accepts a job); `None` disables it. By default 5
    /// seconds. In-process producers wake the controller directly.
    #[must_use]
    pub fn generation_poll(mut self, every: Option<Duration>) -> Self {
        self.generation_poll = every;
        self
    }
}

/// One input row: a record key and the fields to write.
#[derive(Debug, Clone, PartialEq)]
pub struct RowInput {
    /// The `crm_record` key (1 to 255 characters, no control characters).
    pub record_key: String,
    /// The fields; must serialize to at most 64 KiB. An `email` field that is not a string
    /// containing `@` is a row-level validation failure, recorded without failing the job.
    pub fields: Map<String, Value>,
}

impl RowInput {
    /// A row.
    #[must_use]
    pub fn new(record_key: impl Into<String>, fields: Map<String, Value>) -> Self {
        RowInput {
            record_key: record_key.into(),
            fields,
        }
    }
}

/// A job to accept.
#[derive(Debug, Clone, PartialEq)]
pub struct NewJob {
    /// Repeating a submit with the same key returns the same job.
    pub idempotency_key: String,
    /// The rows, applied in order.
    pub rows: Vec<RowInput>,
    /// Rows per segment (1 to 10,000); `None`: the configured default.
    pub segment_size: Option<u32>,
    /// Claims before poisoning; `None`: the configured default.
    pub max_attempts: Option<u32>,
    /// Not before this time; `None`: now.
    pub run_at: Option<SystemTime>,
}

impl NewJob {
    /// A job with defaults.
    #[must_use]
    pub fn new(idempotency_key: impl Into<String>, rows: Vec<RowInput>) -> Self {
        NewJob {
            idempotency_key: idempotency_key.into(),
            rows,
            segment_size: None,
            max_attempts: None,
            run_at: None,
        }
    }
}

/// A job identifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(pub i64);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// An acknowledged submit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Submitted {
    /// The job.
    pub job: JobId,
    /// `false` when the idempotency key already named this job.
    pub created: bool,
}

/// A Bulk error.
#[derive(Debug)]
pub struct BulkError {
    kind: BulkErrorKind,
    row: Option<usize>,
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// The kind of a [`BulkError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BulkErrorKind {
    /// Malformed input, rejected before anything was stored.
    Invalid,
    /// The database failed; nothing was accepted.
    NotAccepted,
    /// The commit's answer was lost: the job may or may not be accepted. Retry with the same
    /// idempotency key.
    OutcomeUnknown,
    /// An injected crash.
    Crashed,
    /// No such job.
    NotFound,
    /// The request contradicts the stored state (an idempotency key reused for other content,
    /// a retry of a job that is not poisoned); nothing was changed.
    Conflict,
    /// Any other database error.
    Database,
}

impl BulkError {
    fn new(kind: BulkErrorKind, message: impl Into<String>) -> Self {
        BulkError {
            kind,
            row: None,
            message: message.into(),
            source: None,
        }
    }

    fn invalid(message: impl Into<String>) -> Self {
        BulkError::new(BulkErrorKind::Invalid, message)
    }

    /// An invalid row: `index` is its place in [`NewJob::rows`] (from 0).
    fn invalid_row(index: usize, message: impl Into<String>) -> Self {
        BulkError {
            row: Some(index),
            ..BulkError::invalid(message)
        }
    }

    fn write(context: &str, e: WriteError) -> Self {
        let kind = if e.is_not_committed() {
            BulkErrorKind::NotAccepted
        } else {
            BulkErrorKind::OutcomeUnknown
        };
        BulkError {
            kind,
            row: None,
            message: format!("{context}: {e}"),
            source: Some(Box::new(e)),
        }
    }

    fn db(context: &str, e: impl std::error::Error + Send + Sync + 'static) -> Self {
        BulkError {
            kind: BulkErrorKind::Database,
            row: None,
            message: format!("{context}: {e}"),
            source: Some(Box::new(e)),
        }
    }

    /// What went wrong.
    #[must_use]
    pub fn kind(&self) -> BulkErrorKind {
        self.kind
    }

    /// For an invalid row, its index in [`NewJob::rows`] (from 0), so a caller that read the
    /// rows from a file can name the file and line; the display says `row N` (from 1).
    #[must_use]
    pub fn row(&self) -> Option<usize> {
        self.row
    }

    /// The message without the `row N: ` prefix of an invalid row.
    #[must_use]
    pub fn detail(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for BulkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(i) = self.row {
            write!(f, "row {}: ", i + 1)?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for BulkError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl From<Crash> for BulkError {
    fn from(c: Crash) -> Self {
        BulkError {
            kind: BulkErrorKind::Crashed,
            row: None,
            message: c.to_string(),
            source: Some(Box::new(c)),
        }
    }
}

/// A segment that committed (see [`Bulk::on_segment_committed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentCommitted {
    /// The job.
    pub job: JobId,
    /// Rows the segment applied.
    pub applied: u64,
    /// Rows the segment rejected (with their reasons).
    pub rejected: u64,
}

/// A job's state, as the store records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobStatus {
    /// The job.
    pub id: JobId,
    /// Its idempotency key.
    pub idempotency_key: String,
    /// `pending`, `running`, `succeeded` or `poisoned`.
    pub state: String,
    /// Claims so far.
    pub attempts: i64,
    /// Claims allowed.
    pub max_attempts: i64,
    /// Next input ordinal to apply.
    pub cursor: i64,
    /// Input rows.
    pub total_rows: i64,
    /// Rows applied.
    pub applied_rows: i64,
    /// Rows rejected by row-level validation.
    pub rejected_rows: i64,
    /// The last transient error or the poison reason.
    pub last_error: Option<String>,
    /// Consecutive claims without a committed segment: poison counts these against
    /// `max_attempts`, so a job that makes progress on every claim is never poisoned by the
    /// crashes of its workers. A committed segment resets it; so does [`Bulk::retry`].
    pub stalled_claims: i64,
    /// When the job was submitted.
    pub created_at: SystemTime,
}

/// A row that row-level validation rejected, with its reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowError {
    /// The row's input ordinal (0-based, in submission order).
    pub ordinal: i64,
    /// Why it was rejected.
    pub message: String,
}

impl JobStatus {
    /// Whether the job reached a terminal state (`succeeded` or `poisoned`).
    #[must_use]
    pub fn is_terminal(&self) -> bool {
        self.state == "succeeded" || self.state == "poisoned"
    }
}

/// Queue observations (domain-owned, read from the store).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observations {
    /// Pending jobs (eligible now or later).
    pub pending: i64,
    /// Pending jobs eligible now.
    pub queue_depth_eligible: i64,
    /// Age of the oldest eligible job.
    pub oldest_eligible_age: Option<Duration>,
    /// Jobs leased by a worker.
    pub running: i64,
    /// Jobs that succeeded.
    pub succeeded: i64,
    /// Jobs poisoned.
    pub poisoned: i64,
    /// Where every count above stops: a count equal to it means at least this many
    /// ([`OBSERVATION_CAP`](nexuscrm_persistence::OBSERVATION_CAP) unless asked otherwise).
    pub count_cap: i64,
}

/// The Bulk family over one database, for one deployment generation.
///
/// Cheap to clone. Holds the producer API ([`Bulk::submit`]), the observation reads, and the
/// [`BulkSource`](crate::BulkSource) constructor.
#[derive(Clone)]
pub struct Bulk {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) db: Db,
    pub(crate) cfg: BulkConfig,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) faults: Faults,
    pub(crate) fence: Fence,
    pub(crate) waker: OnceLock<nexuscrm_worker::Waker>,
    pub(crate) probe: GenerationProbe,
    pub(crate) records_probe: Option<GenerationProbe>,
    pub(crate) record_watchers: std::sync::Mutex<Vec<nexuscrm_worker::Waker>>,
    pub(crate) segment_hooks: nexuscrm_persistence::support::Hooks<SegmentCommitted>,
}

/// The PostgreSQL notification channel of the Bulk family.
pub const CHANNEL: &str = "nexuscrm_bulk";

impl fmt::Debug for Bulk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bulk")
            .field("db", &self.inner.db)
            .field("generation", &self.inner.fence.generation())
            .finish_non_exhaustive()
    }
}

/// How a [`Bulk`] handle is built.
#[derive(Debug, Clone)]
pub struct BulkOptions {
    config: BulkConfig,
    clock: Arc<dyn Clock>,
    faults: Faults,
}

impl Default for BulkOptions {
    fn default() -> Self {
        BulkOptions {
            config: BulkConfig::default(),
            clock: Arc::new(SystemClock),
            faults: Faults::none(),
        }
    }
}

impl BulkOptions {
    /// The family settings.
    #[must_use]
    pub fn config(mut self, config: BulkConfig) -> Self {
        self.config = config;
        self
    }

    /// The wall clock for leases and due times. By default the system clock.
    #[must_use]
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The fault hook (tests only). By default [`Faults::none`].
    #[must_use]
    pub fn faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }
}

impl Bulk {
    /// Runs the migrations (ownership first) and returns a handle for `generation`. Does not take
    /// ownership: call [`Bulk::take_ownership`].
    ///
    /// # Errors
    ///
    /// A migration error (including a schema newer than this code).
    pub async fn open(db: Db, generation: i64, options: BulkOptions) -> Result<Bulk, DbError> {
        db.migrate_ownership().await?;
        db.migrate(FAMILY, MIGRATIONS).await?;
        if options.config.audit {
            nexuscrm_audit::migrate(&db).await?;
        }
        Ok(Bulk::without_migrations(db, generation, options))
    }

    /// A handle over an already-migrated database.
    #[must_use]
    pub fn without_migrations(db: Db, generation: i64, options: BulkOptions) -> Bulk {
        let probe = GenerationProbe::new(
            &db,
            CHANNEL,
            options.config.listen,
            options.config.generation_poll,
        )
        .signal(FAMILY);
        let records_probe = options.config.announce_records.then(|| {
            GenerationProbe::new(
                &db,
                crate::records::RECORDS_CHANNEL,
                options.config.listen,
                options.config.generation_poll,
            )
            .signal(crate::records::RECORDS_SIGNAL)
        });
        Bulk {
            inner: Arc::new(Inner {
                probe,
                records_probe,
                record_watchers: std::sync::Mutex::new(Vec::new()),
                segment_hooks: nexuscrm_persistence::support::Hooks::default(),
                db,
                cfg: options.config,
                clock: options.clock,
                faults: options.faults,
                fence: Fence::new(FAMILY, generation),
                waker: OnceLock::new(),
            }),
        }
    }

    /// Wakes `waker` after every segment that commits record changes in this process (a
    /// derived family's in-process hint; other processes see
    /// [`BulkConfig::announce_records`]).
    pub fn watch_records(&self, waker: nexuscrm_worker::Waker) {
        self.inner
            .record_watchers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(waker);
    }

    /// Calls `hook` after every segment that commits in this process, with the rows it applied
    /// and rejected (after the commit, outside the transaction, on the attempt's task: a hook
    /// must not block; product telemetry pushes into a bounded buffer and returns).
    pub fn on_segment_committed(&self, hook: impl Fn(&SegmentCommitted) + Send + Sync + 'static) {
        self.inner.segment_hooks.add(hook);
    }

    /// Runs the segment hooks.
    pub(crate) fn segment_committed(&self, done: SegmentCommitted) {
        self.inner.segment_hooks.call(&done);
    }

    /// Tells watchers (and, when announcing, other processes) that a segment committed.
    pub(crate) async fn records_changed(&self) {
        let watchers = self
            .inner
            .record_watchers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        for w in &watchers {
            w.wake();
        }
        if let Some(p) = &self.inner.records_probe {
            p.notify(&self.inner.db).await;
        }
    }

    /// Takes ownership of the Bulk family for this handle's generation (fencing out older
    /// generations).
    ///
    /// # Errors
    ///
    /// A newer generation owns it, an injected crash, or a database error.
    pub async fn take_ownership(&self, owner: &str) -> Result<(), BulkError> {
        self.inner
            .db
            .take_ownership(FAMILY, self.inner.fence.generation(), owner)
            .await
            .map_err(|e| BulkError::db("taking ownership of bulk", e))?;
        // The transfer is half done here: the new fence is committed, this generation has not
        // claimed yet, and older generations may still hold leases.
        self.inner.faults.hit(CrashPoint::OwnershipTransfer)?;
        // Tell fenced-out replicas at once (PostgreSQL NOTIFY; the polled cursor includes the
        // fence): they reconcile, learn they are superseded and stop.
        self.inner.probe.notify(&self.inner.db).await;
        Ok(())
    }

    /// Drops this handle's generation change stream as a reconnect would (see
    /// [`GenerationProbe::interrupt`](nexuscrm_persistence::GenerationProbe::interrupt)): its
    /// controller records a generation loss and reconciles.
    pub fn interrupt_generation_probe(&self) {
        self.inner.probe.interrupt();
    }

    /// The database.
    #[must_use]
    pub fn db(&self) -> &Db {
        &self.inner.db
    }

    /// The fault hook.
    #[must_use]
    pub fn faults(&self) -> &Faults {
        &self.inner.faults
    }

    /// This handle's deployment generation.
    #[must_use]
    pub fn generation(&self) -> i64 {
        self.inner.fence.generation()
    }

    /// Registers the controller's waker so that [`Bulk::submit`] wakes it after commit.
    pub fn set_waker(&self, waker: nexuscrm_worker::Waker) {
        let _ = self.inner.waker.set(waker);
    }

    fn validate(&self, job: &NewJob) -> Result<(i64, i64), BulkError> {
        let key = &job.idempotency_key;
        if key.is_empty() || key.len() > 255 || key.chars().any(char::is_control) {
            return Err(BulkError::invalid(format!(
                "idempotency key {:?} must be 1 to 255 characters without control characters",
                echo(key, 80)
            )));
        }
        if job.rows.is_empty() {
            return Err(BulkError::invalid(format!(
                "job {:?} has no rows: an empty job is rejected",
                echo(key, 80)
            )));
        }
        if job.rows.len() > MAX_ROWS {
            return Err(BulkError::invalid(format!(
                "job {:?} has {} rows; at most {MAX_ROWS} are accepted",
                echo(key, 80),
                job.rows.len()
            )));
        }
        let segment = job
            .segment_size
            .unwrap_or(self.inner.cfg.default_segment_size);
        if segment == 0 || segment > MAX_SEGMENT_SIZE {
            return Err(BulkError::invalid(format!(
                "segment size {segment} is outside 1..={MAX_SEGMENT_SIZE}"
            )));
        }
        let attempts = job
            .max_attempts
            .unwrap_or(self.inner.cfg.default_max_attempts);
        if attempts == 0 || attempts > 100 {
            return Err(BulkError::invalid(format!(
                "max attempts {attempts} is outside 1..=100"
            )));
        }
        for (i, row) in job.rows.iter().enumerate() {
            let k = &row.record_key;
            if k.is_empty() || k.len() > 255 || k.chars().any(char::is_control) {
                return Err(BulkError::invalid_row(
                    i,
                    format!(
                        "record key {:?} must be 1 to 255 characters without control characters",
                        echo(k, 80)
                    ),
                ));
            }
            let size = serde_json::to_string(&row.fields)
                .map(|s| s.len())
                .unwrap_or(0);
            if size > 64 * 1024 {
                return Err(BulkError::invalid_row(
                    i,
                    format!("fields are {size} bytes; at most 65536 are accepted"),
                ));
            }
        }
        Ok((i64::from(segment), i64::from(attempts)))
    }

    /// Accepts a job and its rows in one transaction, acknowledging only after commit, then
    /// wakes the in-process controller. A repeated idempotency key returns the existing job.
    ///
    /// # Errors
    ///
    /// [`BulkErrorKind::Invalid`] before anything is stored; [`BulkErrorKind::NotAccepted`] when
    /// the transaction rolled back; [`BulkErrorKind::OutcomeUnknown`] when the commit's answer
    /// was lost (retry with the same key).
    pub async fn submit(&self, job: NewJob) -> Result<Submitted, BulkError> {
        let (segment, attempts) = self.validate(&job)?;
        let inner = &self.inner;
        inner.faults.hit(CrashPoint::BeforeAcceptance)?;
        let now = to_ms(inner.clock.now());
        let run_at = job.run_at.map_or(now, to_ms);
        let dialect = inner.db.dialect();
        let q = queries(dialect);
        let rows: Vec<(String, String)> = job
            .rows
            .iter()
            .map(|r| {
                (
                    r.record_key.clone(),
                    Value::Object(r.fields.clone()).to_string(),
                )
            })
            .collect();
        let digest = content_digest(&rows);
        let rows = Arc::new(rows);
        let never = CancellationToken::new();
        // Retried while it rolls back on contention (a deadlock, or a certification failure
        // when another node of a multi-primary cluster wrote a neighbouring key): the
        // idempotency key makes a second try safe, and only a proven rollback is retried.
        let outcome = retrying(&never, || {
            let key = job.idempotency_key.clone();
            let mine = digest.clone();
            let rows = Arc::clone(&rows);
            inner.db.write(&never, move |c| {
                Box::pin(async move {
                    if let Some(row) = sqlx::query(q.get("job_by_key"))
                        .bind(&key)
                        .fetch_optional(&mut *c)
                        .await?
                    {
                        return Ok(Existing::Found(row.try_get(0)?, text(&row, 1)?));
                    }
                    sqlx::query(q.get("job_insert"))
                        .bind(&key)
                        .bind(attempts)
                        .bind(run_at)
                        .bind(rows.len() as i64)
                        .bind(segment)
                        .bind(now)
                        .bind(now)
                        .bind(&mine)
                        .execute(&mut *c)
                        .await?;
                    let id: i64 = sqlx::query(q.get("job_by_key"))
                        .bind(&key)
                        .fetch_one(&mut *c)
                        .await?
                        .try_get(0)?;
                    insert_inputs(c, dialect, q, id, &rows).await?;
                    Ok(Existing::Created(id))
                })
            })
        })
        .await;
        let existing = match outcome {
            Ok(Existing::Created(id)) => Err(id),
            Ok(Existing::Found(id, stored)) => Ok((id, stored)),
            Err(WriteError::NotCommitted(e)) if is_unique_violation(&e) => {
                // A concurrent submit with the same key won: compare against its job.
                let row = sqlx::query(q.get("job_by_key"))
                    .bind(&job.idempotency_key)
                    .fetch_one(inner.db.pool())
                    .await
                    .map_err(|e| BulkError::db("reading the existing job", e))?;
                let id: i64 = row
                    .try_get(0)
                    .map_err(|e| BulkError::db("decoding the job id", e))?;
                let stored =
                    text(&row, 1).map_err(|e| BulkError::db("decoding the job digest", e))?;
                Ok((id, stored))
            }
            Err(e) => return Err(BulkError::write("accepting the bulk job", e)),
        };
        let submitted = match existing {
            Err(id) => Submitted {
                job: JobId(id),
                created: true,
            },
            // '' is a job accepted before digests were stored: nothing to compare against.
            Ok((id, stored)) if stored.is_empty() || stored == digest => Submitted {
                job: JobId(id),
                created: false,
            },
            Ok((id, stored)) => {
                return Err(BulkError::new(
                    BulkErrorKind::Conflict,
                    format!(
                        "idempotency key {} is already used by job {id} with other rows \
                         (content digest {} here, {} stored): use a new key for new content, \
                         or submit the same rows again",
                        echo(&job.idempotency_key, 80),
                        &digest[..12],
                        echo(&stored, 12),
                    ),
                ));
            }
        };
        inner.faults.hit(CrashPoint::AfterAcceptance)?;
        if let Some(w) = inner.waker.get() {
            w.wake();
        }
        if submitted.created {
            // A lossy cross-process hint, after commit and outside any claim transaction.
            inner.probe.notify(&inner.db).await;
        }
        Ok(submitted)
    }

    /// Returns a poisoned job to `pending` at once, with a fresh count of claims without
    /// progress: an explicit operator decision ("the cause is fixed, run it again"), logged at
    /// WARN with the poison reason it clears. Its cursor, applied rows and attempts stay: rows
    /// already applied are never applied again.
    ///
    /// # Errors
    ///
    /// [`BulkErrorKind::NotFound`] for an unknown job, [`BulkErrorKind::Conflict`] for a job
    /// that is not poisoned (nothing is changed), or a database error.
    pub async fn retry(&self, job: JobId) -> Result<JobStatus, BulkError> {
        let inner = &self.inner;
        let before = self
            .status(job)
            .await?
            .ok_or_else(|| BulkError::new(BulkErrorKind::NotFound, format!("no bulk job {job}")))?;
        if before.state != "poisoned" {
            return Err(BulkError::new(
                BulkErrorKind::Conflict,
                format!(
                    "bulk job {job} is {}, not poisoned: only a poisoned job can be retried",
                    before.state
                ),
            ));
        }
        let q = queries(inner.db.dialect());
        let now = to_ms(inner.clock.now());
        let retry = sqlx::query(q.get("retry")).bind(now);
        let retry = if inner.db.dialect() == Dialect::Postgres {
            retry
        } else {
            retry.bind(now)
        };
        let done = retry
            .bind(job.0)
            .execute(inner.db.pool())
            .await
            .map_err(|e| BulkError::db("retrying the job", e))?;
        if done.rows_affected() != 1 {
            return Err(BulkError::new(
                BulkErrorKind::Conflict,
                format!("bulk job {job} changed state meanwhile; nothing was retried"),
            ));
        }
        tracing::warn!(
            job = job.0,
            key = %before.idempotency_key,
            cleared = before.last_error.as_deref().unwrap_or(""),
            "bulk job retried by an operator"
        );
        if let Some(w) = inner.waker.get() {
            w.wake();
        }
        inner.probe.notify(&inner.db).await;
        self.status(job)
            .await?
            .ok_or_else(|| BulkError::new(BulkErrorKind::NotFound, format!("no bulk job {job}")))
    }

    /// One job's status.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn status(&self, job: JobId) -> Result<Option<JobStatus>, BulkError> {
        let q = queries(self.inner.db.dialect());
        let row = sqlx::query(q.get("job_status"))
            .bind(job.0)
            .fetch_optional(self.inner.db.pool())
            .await
            .map_err(|e| BulkError::db("reading the job", e))?;
        row.map(|r| decode_status(&r))
            .transpose()
            .map_err(|e| BulkError::db("decoding the job", e))
    }

    /// The first `limit` rows of `job` that row-level validation rejected, by ordinal, with
    /// their reasons ([`JobStatus::rejected_rows`] counts them all).
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn row_errors(&self, job: JobId, limit: i64) -> Result<Vec<RowError>, BulkError> {
        let q = queries(self.inner.db.dialect());
        let rows = sqlx::query(q.get("row_errors"))
            .bind(job.0)
            .bind(limit)
            .fetch_all(self.inner.db.pool())
            .await
            .map_err(|e| BulkError::db("reading rejected rows", e))?;
        rows.iter()
            .map(|r| {
                Ok(RowError {
                    ordinal: r.try_get(0)?,
                    message: text(r, 1)?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(|e| BulkError::db("decoding rejected rows", e))
    }

    /// The newest `limit` jobs.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn list(&self, limit: i64) -> Result<Vec<JobStatus>, BulkError> {
        let q = queries(self.inner.db.dialect());
        let rows = sqlx::query(q.get("job_list"))
            .bind(limit)
            .fetch_all(self.inner.db.pool())
            .await
            .map_err(|e| BulkError::db("listing jobs", e))?;
        rows.iter()
            .map(decode_status)
            .collect::<Result<_, _>>()
            .map_err(|e| BulkError::db("decoding jobs", e))
    }

    /// Queue observations, each count bounded by
    /// [`OBSERVATION_CAP`](nexuscrm_persistence::OBSERVATION_CAP).
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn observations(&self) -> Result<Observations, BulkError> {
        self.observations_capped(nexuscrm_persistence::OBSERVATION_CAP)
            .await
    }

    /// Queue observations whose counts stop at `cap` (at least 1): each count reads at most
    /// `cap` entries of the `(state, run_at)` index, whatever the history holds.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn observations_capped(&self, cap: i64) -> Result<Observations, BulkError> {
        let cap = cap.max(1);
        let db = &self.inner.db;
        let q = queries(db.dialect());
        let mut o = Observations {
            count_cap: cap,
            ..Observations::default()
        };
        let rows = sqlx::query(q.get("count_by_state"))
            .bind(cap)
            .bind(cap)
            .bind(cap)
            .bind(cap)
            .fetch_all(db.pool())
            .await
            .map_err(|e| BulkError::db("counting jobs", e))?;
        for r in rows {
            let state: String = text(&r, 0).map_err(|e| BulkError::db("decoding", e))?;
            let n: i64 = r.try_get(1).map_err(|e| BulkError::db("decoding", e))?;
            match state.as_str() {
                "pending" => o.pending = n,
                "running" => o.running = n,
                "succeeded" => o.succeeded = n,
                "poisoned" => o.poisoned = n,
                _ => {}
            }
        }
        let now = to_ms(self.inner.clock.now());
        let oldest: Option<i64> = sqlx::query(q.get("oldest_eligible"))
            .bind(now)
            .fetch_one(db.pool())
            .await
            .map_err(|e| BulkError::db("reading the oldest job", e))?
            .try_get(0)
            .map_err(|e| BulkError::db("decoding", e))?;
        o.oldest_eligible_age = oldest.map(|t| Duration::from_millis((now - t).max(0) as u64));
        if oldest.is_some() {
            o.queue_depth_eligible = sqlx::query(q.get("eligible_count"))
                .bind(now)
                .bind(cap)
                .fetch_one(db.pool())
                .await
                .and_then(|r| r.try_get(0))
                .map_err(|e| BulkError::db("counting eligible jobs", e))?;
        }
        Ok(o)
    }

    /// The source a [`Controller`](nexuscrm_worker::Controller) drives.
    #[must_use]
    pub fn source(&self) -> crate::BulkSource {
        crate::BulkSource { bulk: self.clone() }
    }
}

fn decode_status(r: &sqlx::any::AnyRow) -> Result<JobStatus, sqlx::Error> {
    Ok(JobStatus {
        id: JobId(r.try_get(0)?),
        idempotency_key: text(r, 1)?,
        state: text(r, 2)?,
        attempts: r.try_get(3)?,
        max_attempts: r.try_get(4)?,
        cursor: r.try_get(5)?,
        total_rows: r.try_get(6)?,
        applied_rows: r.try_get(7)?,
        rejected_rows: r.try_get(8)?,
        last_error: Some(text(r, 9)?).filter(|e| !e.is_empty()),
        stalled_claims: r.try_get(11)?,
        created_at: from_ms(r.try_get(12)?),
    })
}

/// What a submit's transaction found for its idempotency key.
enum Existing {
    /// A new job, with its id.
    Created(i64),
    /// A job already had the key: its id and content digest.
    Found(i64, String),
}

/// The SHA-256 of a job's rows (each record key and its fields' JSON, length-prefixed, in
/// order), hex: the content an idempotency key names. The same rows give the same digest in
/// every process; any other rows give another.
fn content_digest(rows: &[(String, String)]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update((rows.len() as u64).to_be_bytes());
    for (key, fields) in rows {
        h.update((key.len() as u64).to_be_bytes());
        h.update(key.as_bytes());
        h.update((fields.len() as u64).to_be_bytes());
        h.update(fields.as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

async fn insert_inputs(
    c: &mut AnyConnection,
    dialect: Dialect,
    q: &Queries,
    job: i64,
    rows: &[(String, String)],
) -> Result<(), sqlx::Error> {
    // Multi-row inserts of up to 200 rows (4 binds each): few round trips, within every
    // dialect's bind limit.
    let prefix = q.get("input_insert_prefix");
    for (chunk_index, chunk) in rows.chunks(200).enumerate() {
        let mut sql = String::with_capacity(prefix.len() + chunk.len() * 24);
        sql.push_str(prefix);
        for i in 0..chunk.len() {
            if i > 0 {
                sql.push(',');
            }
            match dialect {
                Dialect::Postgres => {
                    let b = i * 4;
                    sql.push_str(&format!(
                        " (${}, ${}, ${}, ${})",
                        b + 1,
                        b + 2,
                        b + 3,
                        b + 4
                    ));
                }
                _ => sql.push_str(" (?, ?, ?, ?)"),
            }
        }
        let mut query = sqlx::query(&sql);
        for (i, (key, fields)) in chunk.iter().enumerate() {
            query = query
                .bind(job)
                .bind((chunk_index * 200 + i) as i64)
                .bind(key.as_str())
                .bind(fields.as_str());
        }
        query.execute(&mut *c).await?;
    }
    Ok(())
}

/// Row-level validation applied when the row is written: an `email` field must be a string
/// containing `@`.
pub(crate) fn row_problem(fields: &Map<String, Value>) -> Option<String> {
    match fields.get("email") {
        None => None,
        Some(Value::String(s)) if s.contains('@') => None,
        Some(v) => Some(format!(
            "invalid email {v}: it must be a string containing '@'"
        )),
    }
}
