//! The audit outbox work family (contract slice 5, second half): `durable-critical /
//! idempotent-or-observable`.
//!
//! - Producers write an [`AuditEvent`] **in their own transaction**, through [`record`]: the
//!   event exists if and only if the change it describes committed (a transactional outbox;
//!   the tables are this family's).
//! - Delivery: the controller's [`AuditSource`] holds a delivery lease (one holder at a time,
//!   so events leave in sequence order, which keeps every subject's order), claims a batch of
//!   undelivered events, and its [`AuditAttempt`] appends them to the [`JsonlSink`] (fsync per
//!   batch), then marks them delivered. A crash between the write and the mark is recovered by
//!   reading the file's tail before the next write: the events found there are marked, not
//!   written again, so no line is ever duplicated and none is lost.
//! - Observations: undelivered count and the oldest undelivered event's age.

#![forbid(unsafe_code)]

mod http;
mod sink;

pub use http::HttpSink;
pub use sink::{JsonlSink, Line, read_lines};

/// Where delivered events go.
#[derive(Debug, Clone)]
pub enum Sink {
    /// An append-only JSON Lines file (fsync per batch, tail recovery).
    File(JsonlSink),
    /// A receiver over HTTP (batch POST with an idempotency key; it deduplicates).
    Http(HttpSink),
}

impl Sink {
    /// The file sink, when it is one.
    #[must_use]
    pub fn file(&self) -> Option<&JsonlSink> {
        match self {
            Sink::File(f) => Some(f),
            Sink::Http(_) => None,
        }
    }
}

impl fmt::Display for Sink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Sink::File(s) => write!(f, "file {}", s.path().display()),
            Sink::Http(h) => write!(f, "http {}", h.url()),
        }
    }
}

use std::fmt;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use nexuscrm_persistence::sqlx::{self, AnyConnection, Row};
use nexuscrm_persistence::support::{from_ms, new_token, placeholders, text, to_ms};
use nexuscrm_persistence::{
    Db, DbError, Dialect, DialectQueries, Fence, Migration, Queries, family,
};
use nexuscrm_worker::fault::{CrashPoint, Faults};
use nexuscrm_worker::{
    Attempt, AttemptError, ClaimBatch, Clock, Declaration, Durability, Effect, Source, SourceError,
    SystemClock,
};
use tokio_util::sync::CancellationToken;

/// The family's name (migrations, ownership, declarations).
pub const FAMILY: &str = "audit";

/// The audit declaration: an accepted event reaches the sink exactly once (recovery reads the
/// sink to learn what a crash left undisposed).
pub const DECLARATION: Declaration = Declaration::new_const(
    FAMILY,
    Durability::DurableCritical,
    Effect::IdempotentOrObservable,
);

/// The family's migrations, per dialect.
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "audit outbox and delivery lease",
    sqlite: include_str!("../sql/sqlite/0001_audit.sql"),
    postgres: include_str!("../sql/postgres/0001_audit.sql"),
    mysql: include_str!("../sql/mysql/0001_audit.sql"),
}];

/// The longest event id, subject and actor.
pub const MAX_ID: usize = 191;
/// The longest kind.
pub const MAX_KIND: usize = 64;

static QUERIES: OnceLock<DialectQueries> = OnceLock::new();

fn queries(d: Dialect) -> &'static Queries {
    QUERIES
        .get_or_init(|| {
            DialectQueries::new(
                include_str!("../sql/sqlite/queries.sql"),
                include_str!("../sql/postgres/queries.sql"),
                include_str!("../sql/mysql/queries.sql"),
            )
        })
        .for_dialect(d)
}

/// One audit event, as a producer writes it.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditEvent {
    /// A stable id, unique across the outbox (the same change always gets the same id, so a
    /// duplicate write is refused rather than delivered twice).
    pub event_id: String,
    /// What the event is about (a record key, a schedule, a paused item).
    pub subject: String,
    /// What happened (`record.applied`, `pause.resolved`, ...).
    pub kind: String,
    /// Who did it (an operator, a job, a family).
    pub actor: String,
    /// When (the producer's transaction time).
    pub at: SystemTime,
    /// The event's JSON body.
    pub body: serde_json::Value,
}

impl AuditEvent {
    /// An event at the current time.
    #[must_use]
    pub fn new(
        event_id: impl Into<String>,
        subject: impl Into<String>,
        kind: impl Into<String>,
        actor: impl Into<String>,
        body: serde_json::Value,
    ) -> Self {
        AuditEvent {
            event_id: event_id.into(),
            subject: subject.into(),
            kind: kind.into(),
            actor: actor.into(),
            at: SystemTime::now(),
            body,
        }
    }

    /// The same event at `at`.
    #[must_use]
    pub fn at(mut self, at: SystemTime) -> Self {
        self.at = at;
        self
    }

    fn check(&self) -> Result<(), String> {
        for (what, v, max) in [
            ("event id", &self.event_id, MAX_ID),
            ("subject", &self.subject, MAX_ID),
            ("kind", &self.kind, MAX_KIND),
            ("actor", &self.actor, MAX_ID),
        ] {
            if v.is_empty() || v.len() > max {
                return Err(format!(
                    "an audit event's {what} must be 1 to {max} bytes, not {}",
                    v.len()
                ));
            }
        }
        Ok(())
    }
}

/// Events per multi-row insert.
const EVENTS_PER_STATEMENT: usize = 100;

/// Writes `events` in the caller's transaction `c` (a transactional outbox: they commit or
/// roll back with the change they describe). One statement per 100 events.
///
/// # Errors
///
/// An invalid event (empty or too long a field), or the statement's error (a duplicate event
/// id is a unique violation: the transaction must not commit).
pub async fn record(
    c: &mut AnyConnection,
    dialect: Dialect,
    events: &[AuditEvent],
) -> Result<(), sqlx::Error> {
    for e in events {
        e.check().map_err(sqlx::Error::Protocol)?;
    }
    for group in events.chunks(EVENTS_PER_STATEMENT) {
        let sql = format!(
            "{}{}",
            queries(dialect).get("record_prefix"),
            placeholders(dialect, 1, group.len(), 6)
        );
        let mut q = sqlx::query(&sql);
        for e in group {
            q = q
                .bind(e.event_id.as_str())
                .bind(e.subject.as_str())
                .bind(e.kind.as_str())
                .bind(e.actor.as_str())
                .bind(to_ms(e.at))
                .bind(e.body.to_string());
        }
        q.execute(&mut *c).await?;
    }
    Ok(())
}

/// The audit family's settings.
#[derive(Debug, Clone)]
pub struct AuditOptions {
    generation: i64,
    sink: Sink,
    batch: usize,
    lease: Duration,
    clock: Arc<dyn Clock>,
    faults: Faults,
}

impl AuditOptions {
    /// Options delivering to the file `sink`: generation 1, batches of 100, a 30 s delivery
    /// lease.
    #[must_use]
    pub fn new(sink: JsonlSink) -> Self {
        Self::to(Sink::File(sink))
    }

    /// Options delivering to the HTTP receiver `sink` (otherwise as [`AuditOptions::new`]).
    #[must_use]
    pub fn http(sink: HttpSink) -> Self {
        Self::to(Sink::Http(sink))
    }

    fn to(sink: Sink) -> Self {
        AuditOptions {
            generation: 1,
            sink,
            batch: 100,
            lease: Duration::from_secs(30),
            clock: Arc::new(SystemClock),
            faults: Faults::none(),
        }
    }

    /// The deployment generation this handle delivers as.
    #[must_use]
    pub fn generation(mut self, generation: i64) -> Self {
        self.generation = generation;
        self
    }

    /// Events per delivered batch (1 to 10,000; one fsync each).
    #[must_use]
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.clamp(1, 10_000);
        self
    }

    /// How long the delivery lease lasts without a claim (another replica takes over after).
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(10));
        self
    }

    /// The clock for leases and delivery times.
    #[must_use]
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The fault hook (tests only).
    #[must_use]
    pub fn faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }
}

/// The audit outbox over one database for one deployment generation.
#[derive(Debug, Clone)]
pub struct Audit {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    db: Db,
    sink: Sink,
    batch: usize,
    lease: Duration,
    clock: Arc<dyn Clock>,
    fence: Fence,
    faults: Faults,
    /// This handle's delivery-lease identity.
    holder: String,
    /// Whether this process has read the sink's tail since it started or since an attempt
    /// failed (until then a crashed holder's last batch may be in the file, unmarked).
    recovered: AtomicBool,
    /// One batch at a time, whatever the controller's capacity.
    in_flight: AtomicBool,
    waker: OnceLock<nexuscrm_worker::Waker>,
}

/// What the outbox holds now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditObservations {
    /// Events not yet delivered.
    pub undelivered: i64,
    /// When the oldest undelivered event was written.
    pub oldest_undelivered: Option<SystemTime>,
}

/// An audit error: what failed and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditError(String);

impl fmt::Display for AuditError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for AuditError {}

impl Audit {
    /// Runs the migrations (ownership first) and returns a handle; checks that the sink's file
    /// can be opened.
    ///
    /// # Errors
    ///
    /// A migration error, or a sink path that cannot be written.
    pub async fn open(db: Db, options: AuditOptions) -> Result<Audit, AuditError> {
        if let Sink::File(file) = &options.sink {
            file.check().map_err(AuditError)?;
        }
        migrate(&db)
            .await
            .map_err(|e| AuditError(format!("audit migrations: {e}")))?;
        Ok(Audit::without_migrations(db, options))
    }

    /// A handle over an already-migrated database.
    #[must_use]
    pub fn without_migrations(db: Db, options: AuditOptions) -> Audit {
        Audit {
            inner: Arc::new(Inner {
                db,
                sink: options.sink,
                batch: options.batch,
                lease: options.lease,
                clock: options.clock,
                fence: Fence::new(FAMILY, options.generation),
                faults: options.faults,
                holder: format!("g{}:{}", options.generation, new_token()),
                recovered: AtomicBool::new(false),
                in_flight: AtomicBool::new(false),
                waker: OnceLock::new(),
            }),
        }
    }

    /// Takes ownership of the family for this handle's generation.
    ///
    /// # Errors
    ///
    /// A newer generation owns it, or a database error.
    pub async fn take_ownership(&self, owner: &str) -> Result<(), AuditError> {
        self.inner
            .db
            .take_ownership(FAMILY, self.inner.fence.generation(), owner)
            .await
            .map(drop)
            .map_err(|e| AuditError(format!("taking ownership of audit: {e}")))
    }

    /// The sink.
    #[must_use]
    pub fn sink(&self) -> &Sink {
        &self.inner.sink
    }

    /// The controller's waker (woken when a batch finishes, so the next one is claimed; a
    /// producer may wake it after committing events).
    pub fn set_waker(&self, waker: nexuscrm_worker::Waker) {
        let _ = self.inner.waker.set(waker);
    }

    /// Wakes the controller, if one is set.
    pub fn wake(&self) {
        if let Some(w) = self.inner.waker.get() {
            w.wake();
        }
    }

    /// The controller's [`Source`].
    #[must_use]
    pub fn source(&self) -> AuditSource {
        AuditSource {
            audit: self.clone(),
        }
    }

    /// Undelivered events and the oldest one's time.
    ///
    /// # Errors
    ///
    /// The read's error.
    pub async fn observations(&self) -> Result<AuditObservations, AuditError> {
        let q = queries(self.inner.db.dialect());
        let row = sqlx::query(q.get("undelivered"))
            .fetch_one(self.inner.db.pool())
            .await
            .map_err(|e| AuditError(format!("reading the audit outbox: {e}")))?;
        let undelivered: i64 = row.try_get(0).unwrap_or(0);
        let oldest: Option<i64> = row.try_get(1).unwrap_or(None);
        Ok(AuditObservations {
            undelivered,
            oldest_undelivered: oldest.map(from_ms),
        })
    }
}

/// Runs the audit migrations (and ownership's) on `db`: producers that write events in their
/// transactions call it when they open.
///
/// # Errors
///
/// A migration error.
pub async fn migrate(db: &Db) -> Result<(), DbError> {
    db.migrate_ownership().await?;
    db.migrate(FAMILY, MIGRATIONS).await.map(drop)
}

/// Takes ownership of `family` for `generation` (as [`Db::take_ownership`]) and, when the
/// ownership changes (a first owner, or a newer generation taking over), writes an
/// `ownership.taken` audit event in the takeover's own transaction: subject `family:<family>`,
/// actor `owner`, body the family, the generation and the one it replaced. Its id,
/// `ownership-<family>-g<generation>`, is stable: a generation takes a family once. The same
/// generation taking it again writes nothing. The audit migrations must have run.
///
/// # Errors
///
/// As for [`Db::take_ownership`]; an invalid event (a family or owner longer than 191 bytes)
/// rolls the takeover back.
pub async fn take_ownership_audited(
    db: &Db,
    family: &str,
    generation: i64,
    owner: &str,
) -> Result<Fence, DbError> {
    let dialect = db.dialect();
    let (f, o) = (family.to_owned(), owner.to_owned());
    db.take_ownership_noting(family, generation, owner, &move |c, previous| {
        let event = AuditEvent::new(
            format!("ownership-{f}-g{generation}"),
            format!("family:{f}"),
            "ownership.taken",
            o.clone(),
            serde_json::json!({ "family": f, "generation": generation, "previous": previous }),
        );
        Box::pin(async move { record(c, dialect, &[event]).await })
    })
    .await
}

/// Every event in the outbox, delivered or not, in sequence order: for inspection and tests
/// (what the producers wrote, whatever the sink has received).
///
/// # Errors
///
/// The database's error, or a row that is not an event (a schema other than this family's).
pub async fn outbox(db: &Db) -> Result<Vec<Line>, AuditError> {
    let read = |e: sqlx::Error| AuditError(format!("reading the audit outbox: {e}"));
    let rows = sqlx::query(queries(db.dialect()).get("stored"))
        .fetch_all(db.pool())
        .await
        .map_err(read)?;
    rows.iter()
        .map(line_of)
        .collect::<Result<Vec<_>, sqlx::Error>>()
        .map_err(read)
}

/// An outbox row (`seq, event_id, subject, kind, actor, at, body`) as a sink line.
fn line_of(r: &sqlx::any::AnyRow) -> Result<Line, sqlx::Error> {
    let body = text(r, 6)?;
    Ok(Line {
        seq: r.try_get(0)?,
        event_id: text(r, 1)?,
        subject: text(r, 2)?,
        kind: text(r, 3)?,
        actor: text(r, 4)?,
        at_ms: r.try_get(5)?,
        body: serde_json::from_str(&body).unwrap_or(serde_json::Value::String(body)),
    })
}

/// The generation in a lease holder's name (`g<generation>:<token>`; 0 for none).
fn holder_generation(holder: &str) -> i64 {
    holder
        .strip_prefix('g')
        .and_then(|h| h.split_once(':'))
        .and_then(|(g, _)| g.parse().ok())
        .unwrap_or(0)
}

/// A claimed event.
#[derive(Debug, Clone)]
struct Pending {
    line: Line,
}

/// The audit [`Source`]: one batch at a time under the delivery lease.
#[derive(Debug, Clone)]
pub struct AuditSource {
    audit: Audit,
}

impl Source for AuditSource {
    type Attempt = AuditAttempt;

    async fn check_ready(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        let inner = &self.audit.inner;
        let sink = inner.sink.clone();
        tokio::select! {
            biased;
            () = cancel.cancelled() => Err(SourceError::not_committed("cancelled")),
            r = sqlx::query(queries(inner.db.dialect()).get("undelivered")).fetch_one(inner.db.pool()) => {
                r.map_err(|e| SourceError::new(format!("the audit outbox is not readable: {e}")))?;
                match &sink {
                    Sink::File(file) => file.check().map_err(SourceError::new),
                    // A receiver that is down is retried by the attempts, not refused here.
                    Sink::Http(_) => Ok(()),
                }
            }
        }
    }

    /// Nothing to release: an undelivered event stays undelivered until a batch containing it
    /// is marked, and the sink's tail tells what a crashed holder wrote.
    async fn reconcile(&self, _cancel: CancellationToken) -> Result<(), SourceError> {
        Ok(())
    }

    async fn claim(
        &self,
        _capacity: NonZeroUsize,
        cancel: CancellationToken,
    ) -> Result<ClaimBatch<AuditAttempt>, SourceError> {
        let inner = &self.audit.inner;
        if inner.in_flight.load(Ordering::Acquire) {
            // The batch in flight wakes the controller when it ends.
            return Ok(ClaimBatch::done(Vec::new()));
        }
        let dialect = inner.db.dialect();
        let q = queries(dialect);
        let generation = inner.fence.generation();
        let (holder, lease_ms, batch) = (
            inner.holder.clone(),
            inner.lease.as_millis() as i64,
            inner.batch as i64,
        );
        let rows: Option<(Vec<Line>, bool)> = family::fenced(
            &inner.db,
            &inner.fence,
            &inner.clock,
            &cancel,
            move |c, now| {
                let holder = holder.clone();
                Box::pin(async move {
                    let lease = sqlx::query(q.get("lease_lock")).fetch_one(&mut *c).await?;
                    let (current, until): (String, i64) = (text(&lease, 0)?, lease.try_get(1)?);
                    // A newer deployment generation takes the lease at once (the older one
                    // is fenced out anyway); a replica of the same one after the lease ends.
                    if current != holder
                        && until >= now
                        && holder_generation(&current) >= generation
                    {
                        return Ok(None); // Another replica delivers.
                    }
                    let rows = sqlx::query(q.get("pending"))
                        .bind(batch)
                        .fetch_all(&mut *c)
                        .await?;
                    let lines = rows
                        .iter()
                        .map(line_of)
                        .collect::<Result<Vec<_>, sqlx::Error>>()?;
                    if !lines.is_empty() || current == holder {
                        sqlx::query(q.get("lease_take"))
                            .bind(holder.as_str())
                            .bind(now + lease_ms)
                            .execute(&mut *c)
                            .await?;
                    }
                    // Taken from another holder: its last batch may be in the sink unmarked.
                    Ok(Some((lines, current != holder)))
                })
            },
        )
        .await?;
        inner
            .faults
            .hit(CrashPoint::AfterClaim)
            .map_err(SourceError::new)?;
        let (lines, taken_over) = rows.unwrap_or_default();
        if taken_over {
            inner.recovered.store(false, Ordering::Release);
        }
        if lines.is_empty() {
            return Ok(ClaimBatch::done(Vec::new()));
        }
        let full = lines.len() == inner.batch;
        inner.in_flight.store(true, Ordering::Release);
        let attempt = AuditAttempt {
            audit: self.audit.clone(),
            events: lines.into_iter().map(|line| Pending { line }).collect(),
        };
        Ok(if full {
            ClaimBatch::more(vec![attempt])
        } else {
            ClaimBatch::done(vec![attempt])
        })
    }

    /// Now while undelivered events wait and this handle holds (or may take) the delivery
    /// lease; the lease's end while another replica holds it; `None` when nothing waits.
    async fn next_work_at(
        &self,
        cancel: CancellationToken,
    ) -> Result<Option<SystemTime>, SourceError> {
        let inner = &self.audit.inner;
        if inner.in_flight.load(Ordering::Acquire) {
            return Ok(None); // The batch in flight wakes the controller when it ends.
        }
        let now = to_ms(inner.clock.now());
        let read =
            sqlx::query(queries(inner.db.dialect()).get("next_pending")).fetch_one(inner.db.pool());
        let row = tokio::select! {
            biased;
            () = cancel.cancelled() => return Err(SourceError::not_committed("cancelled")),
            r = read => r.map_err(SourceError::new)?,
        };
        let waiting: i64 = row.try_get(0).map_err(SourceError::new)?;
        let holder = text(&row, 1).map_err(SourceError::new)?;
        let until: i64 = row.try_get(2).map_err(SourceError::new)?;
        if waiting == 0 {
            return Ok(None);
        }
        let ours = holder == inner.holder
            || until < now
            || holder_generation(&holder) < inner.fence.generation();
        Ok(Some(from_ms(if ours { now } else { until + 1 })))
    }
}

/// One batch of events: recovery (when due), the sink write with its fsync, the mark.
#[derive(Debug)]
pub struct AuditAttempt {
    audit: Audit,
    events: Vec<Pending>,
}

impl AuditAttempt {
    /// The event ids of the batch, in sequence order.
    #[must_use]
    pub fn event_ids(&self) -> Vec<&str> {
        self.events
            .iter()
            .map(|e| e.line.event_id.as_str())
            .collect()
    }

    async fn mark(&self, ids: Vec<String>, cancel: &CancellationToken) -> Result<(), AttemptError> {
        if ids.is_empty() {
            return Ok(());
        }
        let inner = &self.audit.inner;
        let dialect = inner.db.dialect();
        let q = queries(dialect);
        family::fenced(
            &inner.db,
            &inner.fence,
            &inner.clock,
            cancel,
            move |c, now| {
                let ids = ids.clone();
                Box::pin(async move {
                    for group in ids.chunks(EVENTS_PER_STATEMENT) {
                        let sql = format!(
                            "{}{}",
                            q.get("delivered_prefix"),
                            placeholders(dialect, 2, 1, group.len())
                        );
                        let mut query = sqlx::query(&sql).bind(now);
                        for id in group {
                            query = query.bind(id.as_str());
                        }
                        query.execute(&mut *c).await?;
                    }
                    Ok(())
                })
            },
        )
        .await
        .map_err(|e| {
            if e.is_not_committed() {
                AttemptError::not_committed(format!("marking audit events delivered: {e}"))
            } else {
                AttemptError::new(format!("marking audit events delivered: {e}"))
            }
        })
    }

    async fn deliver(&self, cancel: &CancellationToken) -> Result<(), AttemptError> {
        let inner = &self.audit.inner;
        if cancel.is_cancelled() {
            // Shutting down before anything was written: the batch stays undelivered.
            return Ok(());
        }
        let sink = match &inner.sink {
            Sink::File(file) => file.clone(),
            Sink::Http(http) => return self.post(http, cancel).await,
        };
        // From here on the batch runs to its mark even if shutdown begins: a short write and
        // one transaction, inside the controller's drain bound (past it the controller stops
        // waiting and reports the attempt abandoned; the next holder reads the tail).
        let cancel = &CancellationToken::new();
        let faults = &inner.faults;
        faults
            .hit(CrashPoint::BeforeEffect)
            .map_err(AttemptError::new)?;
        let mut skip = std::collections::HashSet::new();
        if !inner.recovered.load(Ordering::Acquire) {
            // A crashed holder's last batch may be at the file's end, written and unmarked.
            let n = inner.batch;
            let s = sink.clone();
            let found = tokio::task::spawn_blocking(move || s.recover(n))
                .await
                .map_err(AttemptError::new)?
                .map_err(|e| AttemptError::new(format!("reading the audit file's tail: {e}")))?;
            self.mark(found.clone(), cancel).await?;
            skip.extend(found);
            inner.recovered.store(true, Ordering::Release);
        }
        let lines: Vec<Line> = self
            .events
            .iter()
            .filter(|e| !skip.contains(&e.line.event_id))
            .map(|e| e.line.clone())
            .collect();
        let s = sink.clone();
        tokio::task::spawn_blocking(move || s.append(&lines))
            .await
            .map_err(AttemptError::new)?
            .map_err(|e| {
                AttemptError::new(format!(
                    "writing the audit file {}: {e}",
                    sink.path().display()
                ))
            })?;
        self.written(cancel).await
    }

    /// The batch is in the sink: the mark, with the crash points around it.
    async fn written(&self, cancel: &CancellationToken) -> Result<(), AttemptError> {
        let faults = &self.audit.inner.faults;
        faults
            .hit(CrashPoint::AfterEffect)
            .map_err(AttemptError::new)?;
        faults
            .hit(CrashPoint::BeforeDisposition)
            .map_err(AttemptError::new)?;
        let ids = self
            .events
            .iter()
            .map(|e| e.line.event_id.clone())
            .collect();
        self.mark(ids, cancel).await?;
        faults
            .hit(CrashPoint::AfterDisposition)
            .map_err(AttemptError::new)?;
        Ok(())
    }
}

impl AuditAttempt {
    /// The batch to an HTTP receiver: one `POST` under the batch's key, sent again with the
    /// same key (backing off) while the outcome is ambiguous, then the mark. A permanent
    /// rejection fails the attempt with the receiver's reason: the controller stops, and the
    /// batch stays undelivered (nothing is lost; a fixed receiver gets it on restart).
    async fn post(&self, http: &HttpSink, cancel: &CancellationToken) -> Result<(), AttemptError> {
        let inner = &self.audit.inner;
        let faults = &inner.faults;
        faults
            .hit(CrashPoint::BeforeEffect)
            .map_err(AttemptError::new)?;
        let lines: Vec<Line> = self.events.iter().map(|e| e.line.clone()).collect();
        let key = HttpSink::key(&lines);
        let body = HttpSink::body(&key, &lines);
        let mut wait = Duration::from_millis(100);
        loop {
            match http.post(&key, body.clone()).await {
                http::Posted::Delivered => break,
                http::Posted::Rejected(reason) => {
                    return Err(AttemptError::new(format!(
                        "the audit receiver {} rejected batch {key} ({} events, {} to {}) \
                         permanently: {reason}; the batch stays undelivered",
                        http.url(),
                        lines.len(),
                        lines.first().map_or("", |l| l.event_id.as_str()),
                        lines.last().map_or("", |l| l.event_id.as_str()),
                    )));
                }
                http::Posted::Ambiguous(why) => {
                    tracing::warn!(
                        "audit batch {key} to {}: {why}; sending it again with the same key in {wait:?}",
                        http.url()
                    );
                    tokio::select! {
                        biased;
                        // Shutting down: the batch stays undelivered, and its next holder
                        // sends it under the same key (the receiver deduplicates).
                        () = cancel.cancelled() => return Ok(()),
                        () = tokio::time::sleep(wait) => {}
                    }
                    wait = (wait * 2).min(http.max_backoff_bound());
                }
            }
        }
        // Delivered: the mark runs to its end even if shutdown begins now.
        self.written(&CancellationToken::new()).await
    }
}

impl Attempt for AuditAttempt {
    async fn run(self, cancel: CancellationToken) -> Result<(), AttemptError> {
        let r = self.deliver(&cancel).await;
        let inner = &self.audit.inner;
        if r.is_err() {
            // Written and not marked, perhaps: read the tail again before the next write.
            inner.recovered.store(false, Ordering::Release);
        }
        r
    }
}

impl Drop for AuditAttempt {
    /// The batch is over (run, failed, or dropped unrun at shutdown): the next may be claimed.
    fn drop(&mut self) {
        self.audit.inner.in_flight.store(false, Ordering::Release);
        self.audit.wake();
    }
}
