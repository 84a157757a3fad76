//! The Scheduled Flow store: the producer API, observations, and the family handle.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use nexuscrm_persistence::sqlx::{self, Row};
use nexuscrm_persistence::support::{
    from_ms, is_unique_violation, new_token, retrying, text, to_ms,
};
use nexuscrm_persistence::{
    Db, DbError, Dialect, DialectQueries, Fence, GenerationProbe, Migration, Queries, WriteError,
};
use nexuscrm_worker::fault::{Crash, CrashPoint, Faults};
use nexuscrm_worker::{Clock, SystemClock};
use tokio_util::sync::CancellationToken;

use crate::FAMILY;
use crate::spec::{MisfirePolicy, Spec, Timing, timing};

/// The Scheduled Flow family's migrations.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "flow schedules and runs",
        sqlite: include_str!("../sql/sqlite/0001_flow.sql"),
        postgres: include_str!("../sql/postgres/0001_flow.sql"),
        mysql: include_str!("../sql/mysql/0001_flow.sql"),
    },
    Migration {
        version: 2,
        name: "byte-exact utf8mb4 keys (MySQL dialect; nothing elsewhere)",
        sqlite: "",
        postgres: "",
        mysql: include_str!("../sql/mysql/0002_flow.sql"),
    },
    Migration {
        version: 3,
        name: "claim-token index (MySQL dialect; RETURNING elsewhere)",
        sqlite: "",
        postgres: "",
        mysql: include_str!("../sql/mysql/0003_flow.sql"),
    },
];

/// The PostgreSQL notification channel of the Scheduled Flow family.
pub const CHANNEL: &str = "nexuscrm_flow";

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

/// Scheduled Flow settings.
#[derive(Debug, Clone)]
pub struct FlowConfig {
    pub(crate) lease: Duration,
    pub(crate) misfire_grace: Duration,
    pub(crate) chunk: usize,
    pub(crate) retry_backoff: Duration,
    pub(crate) generation_poll: Option<Duration>,
    pub(crate) listen: bool,
    pub(crate) audit: bool,
}

impl Default for FlowConfig {
    fn default() -> Self {
        FlowConfig {
            lease: Duration::from_secs(30),
            misfire_grace: Duration::from_secs(10),
            chunk: 100,
            retry_backoff: Duration::from_secs(5),
            generation_poll: Some(Duration::from_secs(5)),
            listen: true,
            audit: false,
        }
    }
}

impl FlowConfig {
    /// Write an audit event for every operator change of a schedule (`schedule.created`,
    /// `schedule.updated`, `schedule.paused`, `schedule.resumed`, `schedule.deleted`) in the
    /// change's own transaction, through the audit outbox ([`nexuscrm_audit::record`]): the
    /// event exists if and only if the change committed, and a change that changes nothing
    /// (pausing a paused schedule, creating an existing one) writes none. Its subject is
    /// `schedule:<id>`, its actor the handle's ([`Flow::acting_as`]), its body the schedule's
    /// name, flow, spec, policy and state before and after. [`Flow::open`] then also runs the
    /// audit migrations. By default off.
    #[must_use]
    pub fn audit(mut self, on: bool) -> Self {
        self.audit = on;
        self
    }

    /// How long a claim owns a schedule without a heartbeat. By default 30 seconds.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(10));
        self
    }

    /// How late an occurrence may be reserved and still count as on time under
    /// [`MisfirePolicy::Skip`]. By default 10 seconds.
    #[must_use]
    pub fn misfire_grace(mut self, grace: Duration) -> Self {
        self.misfire_grace = grace;
        self
    }

    /// Runs inserted per reservation transaction when catching up; the lease is renewed between
    /// chunks. By default 100.
    #[must_use]
    pub fn chunk(mut self, runs: usize) -> Self {
        self.chunk = runs.clamp(1, 10_000);
        self
    }

    /// How long a schedule whose reservation rolled back (a database error) waits before it is
    /// claimable again. By default 5 seconds.
    #[must_use]
    pub fn retry_backoff(mut self, backoff: Duration) -> Self {
        self.retry_backoff = backoff.max(Duration::from_millis(10));
        self
    }

    /// On PostgreSQL, `LISTEN nexuscrm_flow` as the cross-process generation probe (producers
    /// `NOTIFY` after commit). By default on; ignored on other backends. See
    /// `nexuscrm_bulk::BulkConfig::listen` for the trade-offs, which are the same.
    #[must_use]
    pub fn listen(mut self, on: bool) -> Self {
        self.listen = on;
        self
    }

    /// Interval of the polling generation probe (`MAX(id), MAX(defined_at)`, two index reads);
    /// `None` disables it. By default 5 seconds. In-process producers wake the controller
    /// directly.
    #[must_use]
    pub fn generation_poll(mut self, every: Option<Duration>) -> Self {
        self.generation_poll = every;
        self
    }
}

/// A schedule identifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScheduleId(pub i64);

impl fmt::Display for ScheduleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// A schedule to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSchedule {
    /// Unique name (1 to 255 characters, no control characters). Creating an existing name
    /// with the same definition returns it; with another definition it is a conflict.
    pub name: String,
    /// The flow each run starts (1 to 255 characters).
    pub flow: String,
    /// When it fires.
    pub spec: Spec,
    /// What happens to occurrences missed while no worker ran.
    pub policy: MisfirePolicy,
    /// The first occurrence is at or after this; an interval is anchored here. `None`: now for
    /// the first occurrence, the Unix epoch for the interval anchor. A start in the past with
    /// [`MisfirePolicy::CatchUp`] backfills.
    pub start_at: Option<SystemTime>,
    /// Create paused.
    pub paused: bool,
}

impl NewSchedule {
    /// An enabled schedule starting now.
    #[must_use]
    pub fn new(
        name: impl Into<String>,
        flow: impl Into<String>,
        spec: Spec,
        policy: MisfirePolicy,
    ) -> Self {
        NewSchedule {
            name: name.into(),
            flow: flow.into(),
            spec,
            policy,
            start_at: None,
            paused: false,
        }
    }
}

/// A schedule's state as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleStatus {
    /// The schedule.
    pub id: ScheduleId,
    /// Its unique name.
    pub name: String,
    /// The flow its runs start.
    pub flow: String,
    /// When it fires.
    pub spec: Spec,
    /// Its misfire policy.
    pub policy: MisfirePolicy,
    /// `active`, `leased` (a worker is reserving) or `paused`.
    pub state: String,
    /// Bumped by every producer change.
    pub version: i64,
    /// The occurrence cursor: the next occurrence to reserve; `None` when it never fires again.
    pub next_occurrence_at: Option<SystemTime>,
    /// The latest occurrence a run was reserved for.
    pub last_occurrence_at: Option<SystemTime>,
    /// Runs reserved so far.
    pub runs: i64,
    pub(crate) anchor_ms: i64,
}

impl ScheduleStatus {
    /// Whether the schedule is enabled (not paused).
    #[must_use]
    pub fn enabled(&self) -> bool {
        self.state != "paused"
    }
}

/// A reserved run of a flow, one per schedule and occurrence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowRun {
    /// The run.
    pub id: i64,
    /// Its schedule.
    pub schedule: ScheduleId,
    /// The flow it starts.
    pub flow: String,
    /// The occurrence it is for.
    pub occurrence_at: SystemTime,
    /// When the reservation committed.
    pub reserved_at: SystemTime,
    /// The schedule version that reserved it.
    pub schedule_version: i64,
}

/// An acknowledged create.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Created {
    /// The schedule.
    pub id: ScheduleId,
    /// `false` when the name already held this definition.
    pub created: bool,
}

/// A change to a schedule; `None` keeps the current value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScheduleUpdate {
    /// A new spec (cron expression and zone, or interval).
    pub spec: Option<Spec>,
    /// A new misfire policy.
    pub policy: Option<MisfirePolicy>,
    /// Reject the update unless the schedule is at this version (optimistic concurrency).
    pub expected_version: Option<i64>,
}

/// A Scheduled Flow error.
#[derive(Debug)]
pub struct FlowError {
    kind: FlowErrorKind,
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// The kind of a [`FlowError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FlowErrorKind {
    /// Malformed input, rejected before anything was stored.
    Invalid,
    /// No such schedule.
    NotFound,
    /// The name holds another definition, or the expected version did not match.
    Conflict,
    /// The database failed; nothing was changed.
    NotCommitted,
    /// The commit's answer was lost: the change may or may not have been applied.
    OutcomeUnknown,
    /// An injected crash.
    Crashed,
    /// Any other database error.
    Database,
}

impl FlowError {
    pub(crate) fn new(kind: FlowErrorKind, message: impl Into<String>) -> Self {
        FlowError {
            kind,
            message: message.into(),
            source: None,
        }
    }

    fn write(context: &str, e: WriteError) -> Self {
        let kind = if e.is_not_committed() {
            FlowErrorKind::NotCommitted
        } else {
            FlowErrorKind::OutcomeUnknown
        };
        FlowError {
            kind,
            message: format!("{context}: {e}"),
            source: Some(Box::new(e)),
        }
    }

    fn db(context: &str, e: impl std::error::Error + Send + Sync + 'static) -> Self {
        FlowError {
            kind: FlowErrorKind::Database,
            message: format!("{context}: {e}"),
            source: Some(Box::new(e)),
        }
    }

    /// What went wrong.
    #[must_use]
    pub fn kind(&self) -> FlowErrorKind {
        self.kind
    }
}

impl fmt::Display for FlowError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for FlowError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl From<Crash> for FlowError {
    fn from(c: Crash) -> Self {
        FlowError {
            kind: FlowErrorKind::Crashed,
            message: c.to_string(),
            source: Some(Box::new(c)),
        }
    }
}

/// Schedule counts (domain-owned, read from the store).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observations {
    /// Enabled schedules waiting for their next occurrence (or due now).
    pub active: i64,
    /// Schedules a worker is reserving.
    pub leased: i64,
    /// Paused schedules.
    pub paused: i64,
    /// How late the most overdue enabled schedule is.
    pub oldest_due_age: Option<Duration>,
    /// Runs reserved in all.
    pub runs: i64,
    /// Where every count above stops: a count equal to it means at least this many
    /// ([`OBSERVATION_CAP`](nexuscrm_persistence::OBSERVATION_CAP) unless asked otherwise).
    pub count_cap: i64,
}

/// The Scheduled Flow family over one database, for one deployment generation.
///
/// Cheap to clone: the producer API, the observation reads and the
/// [`FlowSource`](crate::FlowSource) constructor.
#[derive(Clone)]
pub struct Flow {
    pub(crate) inner: Arc<Inner>,
    /// Who the audit events of this handle's changes name (`operator` unless set).
    actor: Arc<str>,
}

pub(crate) struct Inner {
    pub(crate) db: Db,
    pub(crate) cfg: FlowConfig,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) faults: Faults,
    pub(crate) fence: Fence,
    pub(crate) waker: OnceLock<nexuscrm_worker::Waker>,
    pub(crate) probe: GenerationProbe,
    pub(crate) reserved_hooks: nexuscrm_persistence::support::Hooks<RunsReserved>,
}

/// Runs that one reservation transaction committed (see [`Flow::on_runs_reserved`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunsReserved {
    /// The schedule.
    pub schedule: ScheduleId,
    /// The schedule's flow.
    pub flow: String,
    /// The occurrences reserved, in order (the stored milliseconds).
    pub occurrences: Vec<SystemTime>,
    /// The clock's reading the runs' `reserved_at` was taken from, at its full resolution
    /// (the stored column keeps milliseconds): an occurrence's lateness is
    /// `reserved_at - occurrence`.
    pub reserved_at: SystemTime,
}

impl Inner {
    pub(crate) fn now_ms(&self) -> i64 {
        to_ms(self.clock.now())
    }
}

impl fmt::Debug for Flow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Flow")
            .field("db", &self.inner.db)
            .field("generation", &self.inner.fence.generation())
            .finish_non_exhaustive()
    }
}

/// How a [`Flow`] handle is built.
#[derive(Debug, Clone)]
pub struct FlowOptions {
    config: FlowConfig,
    clock: Arc<dyn Clock>,
    faults: Faults,
}

impl Default for FlowOptions {
    fn default() -> Self {
        FlowOptions {
            config: FlowConfig::default(),
            clock: Arc::new(SystemClock),
            faults: Faults::none(),
        }
    }
}

impl FlowOptions {
    /// The family settings.
    #[must_use]
    pub fn config(mut self, config: FlowConfig) -> Self {
        self.config = config;
        self
    }

    /// The wall clock for occurrences and leases. By default the system clock.
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

/// The stored columns of a schedule definition.
struct Stored {
    kind: &'static str,
    cron: String,
    zone: String,
    interval_ms: i64,
    anchor_ms: i64,
    policy: &'static str,
    catch_up_max: i64,
}

fn stored(spec: &Spec, policy: MisfirePolicy, anchor_ms: i64) -> Stored {
    let (cron, zone, interval_ms) = match spec {
        Spec::Cron { expr, zone } => (expr.clone(), zone.clone(), 0),
        Spec::Every(d) => (String::new(), String::new(), d.as_millis() as i64),
    };
    Stored {
        kind: spec.kind(),
        cron,
        zone,
        interval_ms,
        anchor_ms,
        policy: policy.name(),
        catch_up_max: i64::from(policy.catch_up_max()),
    }
}

fn check_name(what: &str, s: &str) -> Result<(), FlowError> {
    if s.is_empty() || s.len() > 255 || s.chars().any(char::is_control) {
        return Err(FlowError::new(
            FlowErrorKind::Invalid,
            format!("{what} {s:?} must be 1 to 255 characters without control characters"),
        ));
    }
    Ok(())
}

pub(crate) fn decode_schedule(r: &sqlx::any::AnyRow) -> Result<ScheduleStatus, sqlx::Error> {
    let kind = text(r, 3)?;
    let interval_ms: i64 = r.try_get(6)?;
    let spec = if kind == "cron" {
        Spec::cron(text(r, 4)?, text(r, 5)?)
    } else {
        Spec::Every(Duration::from_millis(interval_ms.max(0) as u64))
    };
    let policy_name = text(r, 8)?;
    let max: i64 = r.try_get(9)?;
    let policy = MisfirePolicy::parse(&policy_name, max.clamp(0, i64::from(u32::MAX)) as u32)
        .map_err(|e| sqlx::Error::Decode(e.into()))?;
    let next: Option<i64> = r.try_get(12)?;
    let last: Option<i64> = r.try_get(13)?;
    Ok(ScheduleStatus {
        id: ScheduleId(r.try_get(0)?),
        name: text(r, 1)?,
        flow: text(r, 2)?,
        spec,
        policy,
        anchor_ms: r.try_get(7)?,
        state: text(r, 10)?,
        version: r.try_get(11)?,
        next_occurrence_at: next.map(from_ms),
        last_occurrence_at: last.map(from_ms),
        runs: r.try_get(14)?,
    })
}

fn decode_run(r: &sqlx::any::AnyRow) -> Result<FlowRun, sqlx::Error> {
    Ok(FlowRun {
        id: r.try_get(0)?,
        schedule: ScheduleId(r.try_get(1)?),
        flow: text(r, 2)?,
        occurrence_at: from_ms(r.try_get(3)?),
        reserved_at: from_ms(r.try_get(4)?),
        schedule_version: r.try_get(5)?,
    })
}

/// What a producer transaction found.
enum Change {
    Inserted(ScheduleStatus),
    Done(ScheduleStatus),
    Missing,
    Conflict(String),
}

impl Flow {
    /// Runs the migrations (ownership first) and returns a handle for `generation`. Does not take
    /// ownership: call [`Flow::take_ownership`].
    ///
    /// # Errors
    ///
    /// A migration error (including a schema newer than this code).
    pub async fn open(db: Db, generation: i64, options: FlowOptions) -> Result<Flow, DbError> {
        db.migrate_ownership().await?;
        db.migrate(FAMILY, MIGRATIONS).await?;
        if options.config.audit {
            nexuscrm_audit::migrate(&db).await?;
        }
        Ok(Flow::without_migrations(db, generation, options))
    }

    /// A handle over an already-migrated database.
    #[must_use]
    pub fn without_migrations(db: Db, generation: i64, options: FlowOptions) -> Flow {
        let probe = GenerationProbe::new(
            &db,
            CHANNEL,
            options.config.listen,
            options.config.generation_poll,
        )
        .signal(FAMILY);
        Flow {
            inner: Arc::new(Inner {
                probe,
                db,
                cfg: options.config,
                clock: options.clock,
                faults: options.faults,
                fence: Fence::new(FAMILY, generation),
                waker: OnceLock::new(),
                reserved_hooks: nexuscrm_persistence::support::Hooks::default(),
            }),
            actor: Arc::from("operator"),
        }
    }

    /// Calls `hook` after every reservation transaction that commits runs in this process
    /// (after the commit, outside the transaction, on the attempt's task: a hook must not
    /// block; product telemetry pushes into a bounded buffer and returns). A crash between the
    /// commit and the hook loses the call, never the runs.
    pub fn on_runs_reserved(&self, hook: impl Fn(&RunsReserved) + Send + Sync + 'static) {
        self.inner.reserved_hooks.add(hook);
    }

    /// Runs the reservation hooks (nothing when no runs were reserved).
    pub(crate) fn runs_reserved(&self, done: &RunsReserved) {
        if !done.occurrences.is_empty() {
            self.inner.reserved_hooks.call(done);
        }
    }

    /// This handle, naming `actor` in the audit events of the changes made through it (`cli`,
    /// `console`, a user name; 1 to 191 bytes, longer names are cut at a character boundary).
    #[must_use]
    pub fn acting_as(&self, actor: &str) -> Flow {
        let mut end = actor.len().min(nexuscrm_audit::MAX_ID);
        while !actor.is_char_boundary(end) {
            end -= 1;
        }
        let actor = if actor.is_empty() {
            "operator"
        } else {
            &actor[..end]
        };
        Flow {
            inner: self.inner.clone(),
            actor: Arc::from(actor),
        }
    }

    /// The audit event of a committed change from `before` (`None`: created) to `after`
    /// (`None`: deleted).
    fn audit_event(
        &self,
        kind: &str,
        before: Option<&ScheduleStatus>,
        after: Option<&ScheduleStatus>,
    ) -> Option<nexuscrm_audit::AuditEvent> {
        if !self.inner.cfg.audit {
            return None;
        }
        let s = after.or(before)?;
        let describe = |s: &ScheduleStatus| {
            serde_json::json!({
                "state": s.state,
                "spec": s.spec.to_string(),
                "policy": s.policy.to_string(),
                "version": s.version,
            })
        };
        Some(
            nexuscrm_audit::AuditEvent::new(
                format!("schedule-{}-{}-{}", s.id.0, kind, new_token()),
                format!("schedule:{}", s.id.0),
                format!("schedule.{kind}"),
                self.actor.to_string(),
                serde_json::json!({
                    "schedule": s.id.0,
                    "name": s.name,
                    "flow": s.flow,
                    "before": before.map(describe),
                    "after": after.map(describe),
                }),
            )
            .at(from_ms(self.inner.now_ms())),
        )
    }

    /// Takes ownership of the Scheduled Flow family for this handle's generation.
    ///
    /// # Errors
    ///
    /// A newer generation owns it, an injected crash, or a database error.
    pub async fn take_ownership(&self, owner: &str) -> Result<(), FlowError> {
        self.inner
            .db
            .take_ownership(FAMILY, self.inner.fence.generation(), owner)
            .await
            .map_err(|e| FlowError::db("taking ownership of flow", e))?;
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

    /// This handle's deployment generation.
    #[must_use]
    pub fn generation(&self) -> i64 {
        self.inner.fence.generation()
    }

    /// Registers the controller's waker so that producer changes wake it after commit.
    pub fn set_waker(&self, waker: nexuscrm_worker::Waker) {
        let _ = self.inner.waker.set(waker);
    }

    /// The source a [`Controller`](nexuscrm_worker::Controller) drives.
    #[must_use]
    pub fn source(&self) -> crate::FlowSource {
        crate::FlowSource { flow: self.clone() }
    }

    async fn notify(&self) {
        if let Some(w) = self.inner.waker.get() {
            w.wake();
        }
        // A lossy cross-process hint, after commit and outside any claim transaction.
        self.inner.probe.notify(&self.inner.db).await;
    }

    /// Creates a schedule in one transaction, acknowledged after commit, and wakes the
    /// in-process controller. The cursor is the first occurrence at or after `start_at` (or
    /// now).
    ///
    /// # Errors
    ///
    /// [`FlowErrorKind::Invalid`] (bad name, spec, zone, policy, or a spec that never fires)
    /// before anything is stored; [`FlowErrorKind::Conflict`] when the name holds another
    /// definition; [`FlowErrorKind::NotCommitted`] / [`FlowErrorKind::OutcomeUnknown`] from the
    /// database (retrying the same create is safe).
    pub async fn create(&self, new: NewSchedule) -> Result<Created, FlowError> {
        check_name("schedule name", &new.name)?;
        check_name("flow name", &new.flow)?;
        let inner = &self.inner;
        let now = inner.now_ms();
        let start = new.start_at.map(to_ms);
        let anchor = start.unwrap_or(0);
        let t = timing(&new.spec, anchor).map_err(|e| FlowError::new(FlowErrorKind::Invalid, e))?;
        let cursor = t.at_or_after(start.unwrap_or(now)).ok_or_else(|| {
            FlowError::new(
                FlowErrorKind::Invalid,
                format!("{} never fires after its start", new.spec),
            )
        })?;
        inner.faults.hit(CrashPoint::BeforeAcceptance)?;
        let q = queries(inner.db.dialect());
        let state = if new.paused { "paused" } else { "active" };
        let wanted = new.clone();
        let never = CancellationToken::new();
        let dialect = inner.db.dialect();
        let outcome = retrying(&never, || {
            let (name, flow) = (new.name.clone(), new.flow.clone());
            let def = stored(&new.spec, new.policy, anchor);
            let this = self.clone();
            inner.db.write(&never, move |c| {
                Box::pin(async move {
                    if let Some(row) = sqlx::query(q.get("schedule_by_name"))
                        .bind(name.as_str())
                        .fetch_optional(&mut *c)
                        .await?
                    {
                        return Ok(Change::Done(decode_schedule(&row)?));
                    }
                    sqlx::query(q.get("schedule_insert"))
                        .bind(name.as_str())
                        .bind(flow.as_str())
                        .bind(def.kind)
                        .bind(def.cron.as_str())
                        .bind(def.zone.as_str())
                        .bind(def.interval_ms)
                        .bind(def.anchor_ms)
                        .bind(def.policy)
                        .bind(def.catch_up_max)
                        .bind(state)
                        .bind(cursor)
                        .bind(now)
                        .bind(now)
                        .bind(now)
                        .execute(&mut *c)
                        .await?;
                    let row = sqlx::query(q.get("schedule_by_name"))
                        .bind(name.as_str())
                        .fetch_one(&mut *c)
                        .await?;
                    let status = decode_schedule(&row)?;
                    if let Some(event) = this.audit_event("created", None, Some(&status)) {
                        nexuscrm_audit::record(c, dialect, &[event]).await?;
                    }
                    Ok(Change::Inserted(status))
                })
            })
        })
        .await;
        let (status, created) = match outcome {
            Ok(Change::Inserted(s)) => (s, true),
            Ok(Change::Done(s)) => (s, false),
            Ok(Change::Missing | Change::Conflict(_)) => {
                return Err(FlowError::new(
                    FlowErrorKind::Database,
                    "creating the schedule: unexpected outcome",
                ));
            }
            Err(WriteError::NotCommitted(e)) if is_unique_violation(&e) => {
                // A concurrent create of the same name won.
                let s = self.by_name(&new.name).await?.ok_or_else(|| {
                    FlowError::new(FlowErrorKind::Conflict, "the schedule vanished")
                })?;
                (s, false)
            }
            Err(e) => return Err(FlowError::write("creating the schedule", e)),
        };
        if !created
            && (status.flow != wanted.flow
                || status.spec != wanted.spec
                || status.policy != wanted.policy
                || status.anchor_ms != anchor)
        {
            return Err(FlowError::new(
                FlowErrorKind::Conflict,
                format!(
                    "a schedule named {:?} already exists with another definition ({} for flow {})",
                    wanted.name, status.spec, status.flow
                ),
            ));
        }
        inner.faults.hit(CrashPoint::AfterAcceptance)?;
        if created {
            self.notify().await;
        }
        Ok(Created {
            id: status.id,
            created,
        })
    }

    /// Runs `change` on the locked schedule row in one transaction.
    async fn change<F>(
        &self,
        id: ScheduleId,
        what: &str,
        change: F,
    ) -> Result<ScheduleStatus, FlowError>
    where
        F: Fn(&ScheduleStatus) -> Result<Option<Apply>, String> + Send + Sync + 'static,
    {
        let inner = &self.inner;
        let q = queries(inner.db.dialect());
        let change = Arc::new(change);
        let never = CancellationToken::new();
        let dialect = inner.db.dialect();
        let outcome = retrying(&never, || {
            let change = change.clone();
            let this = self.clone();
            inner.db.write(&never, move |c| {
                Box::pin(async move {
                    let Some(row) = sqlx::query(q.get("schedule_for_update"))
                        .bind(id.0)
                        .fetch_optional(&mut *c)
                        .await?
                    else {
                        return Ok(Change::Missing);
                    };
                    let current = decode_schedule(&row)?;
                    match change(&current) {
                        Err(conflict) => return Ok(Change::Conflict(conflict)),
                        Ok(None) => return Ok(Change::Done(current)),
                        Ok(Some(Apply::Delete)) => {
                            sqlx::query(q.get("schedule_delete"))
                                .bind(id.0)
                                .execute(&mut *c)
                                .await?;
                            if let Some(event) = this.audit_event("deleted", Some(&current), None) {
                                nexuscrm_audit::record(c, dialect, &[event]).await?;
                            }
                            return Ok(Change::Done(current));
                        }
                        Ok(Some(Apply::State { state, cursor, now })) => {
                            sqlx::query(q.get("schedule_set_state"))
                                .bind(state)
                                .bind(cursor)
                                .bind(now)
                                .bind(now)
                                .bind(id.0)
                                .execute(&mut *c)
                                .await?;
                        }
                        Ok(Some(Apply::Define {
                            def,
                            cursor,
                            state,
                            now,
                        })) => {
                            sqlx::query(q.get("schedule_update"))
                                .bind(def.kind)
                                .bind(def.cron.as_str())
                                .bind(def.zone.as_str())
                                .bind(def.interval_ms)
                                .bind(def.anchor_ms)
                                .bind(def.policy)
                                .bind(def.catch_up_max)
                                .bind(cursor)
                                .bind(state)
                                .bind(now)
                                .bind(now)
                                .bind(id.0)
                                .execute(&mut *c)
                                .await?;
                        }
                    }
                    let row = sqlx::query(q.get("schedule_by_id"))
                        .bind(id.0)
                        .fetch_one(&mut *c)
                        .await?;
                    let after = decode_schedule(&row)?;
                    let kind = match after.state.as_str() {
                        _ if after.spec != current.spec
                            || after.policy != current.policy
                            || after.anchor_ms != current.anchor_ms =>
                        {
                            "updated"
                        }
                        "paused" if current.enabled() => "paused",
                        _ if !current.enabled() && after.enabled() => "resumed",
                        _ => "updated",
                    };
                    if let Some(event) = this.audit_event(kind, Some(&current), Some(&after)) {
                        nexuscrm_audit::record(c, dialect, &[event]).await?;
                    }
                    Ok(Change::Done(after))
                })
            })
        })
        .await
        .map_err(|e| FlowError::write(what, e))?;
        match outcome {
            Change::Done(s) | Change::Inserted(s) => {
                self.notify().await;
                Ok(s)
            }
            Change::Missing => Err(FlowError::new(
                FlowErrorKind::NotFound,
                format!("{what}: no schedule {id}"),
            )),
            Change::Conflict(m) => Err(FlowError::new(
                FlowErrorKind::Conflict,
                format!("{what}: {m}"),
            )),
        }
    }

    /// Changes a schedule's spec and/or policy in one transaction: the cursor is recomputed
    /// (the first occurrence of the new spec at or after now), the version bumped, and any
    /// in-flight reservation made under the old version is rejected when it tries to commit.
    ///
    /// # Errors
    ///
    /// [`FlowErrorKind::Invalid`] before anything is stored; [`FlowErrorKind::NotFound`];
    /// [`FlowErrorKind::Conflict`] when `expected_version` does not match; database errors.
    pub async fn update(
        &self,
        id: ScheduleId,
        update: ScheduleUpdate,
    ) -> Result<ScheduleStatus, FlowError> {
        if let Some(spec) = &update.spec {
            timing(spec, 0).map_err(|e| FlowError::new(FlowErrorKind::Invalid, e))?;
        }
        let clock = self.inner.clock.clone();
        self.change(id, "updating the schedule", move |current| {
            if let Some(v) = update.expected_version
                && v != current.version
            {
                return Err(format!(
                    "schedule {id} is at version {}, not {v}",
                    current.version
                ));
            }
            let spec = update.spec.clone().unwrap_or_else(|| current.spec.clone());
            let policy = update.policy.unwrap_or(current.policy);
            let now = to_ms(clock.now());
            let t = timing(&spec, current.anchor_ms)?;
            let cursor = t
                .at_or_after(now.max(current.anchor_ms))
                .ok_or_else(|| format!("{spec} never fires again"))?;
            let state = if current.enabled() {
                "active"
            } else {
                "paused"
            };
            Ok(Some(Apply::Define {
                def: stored(&spec, policy, current.anchor_ms),
                cursor,
                state,
                now,
            }))
        })
        .await
    }

    /// Pauses a schedule: no reservations until [`Flow::resume`]; an in-flight reservation is
    /// rejected. Pausing a paused schedule changes nothing.
    ///
    /// # Errors
    ///
    /// [`FlowErrorKind::NotFound`] or a database error.
    pub async fn pause(&self, id: ScheduleId) -> Result<ScheduleStatus, FlowError> {
        let clock = self.inner.clock.clone();
        self.change(id, "pausing the schedule", move |current| {
            if !current.enabled() {
                return Ok(None);
            }
            Ok(Some(Apply::State {
                state: "paused",
                cursor: current.next_occurrence_at.map(to_ms),
                now: to_ms(clock.now()),
            }))
        })
        .await
    }

    /// Resumes a paused schedule from now: occurrences that fell while it was paused are not
    /// run (pausing is deliberate, not a misfire). Resuming an enabled schedule changes nothing.
    ///
    /// # Errors
    ///
    /// [`FlowErrorKind::NotFound`] or a database error.
    pub async fn resume(&self, id: ScheduleId) -> Result<ScheduleStatus, FlowError> {
        let clock = self.inner.clock.clone();
        self.change(id, "resuming the schedule", move |current| {
            if current.enabled() {
                return Ok(None);
            }
            let now = to_ms(clock.now());
            let t: Timing = timing(&current.spec, current.anchor_ms)?;
            Ok(Some(Apply::State {
                state: "active",
                cursor: t.at_or_after(now.max(current.anchor_ms)),
                now,
            }))
        })
        .await
    }

    /// Deletes a schedule (its runs stay, as history); an in-flight reservation is rejected.
    ///
    /// # Errors
    ///
    /// [`FlowErrorKind::NotFound`] or a database error.
    pub async fn delete(&self, id: ScheduleId) -> Result<(), FlowError> {
        self.change(id, "deleting the schedule", |_| Ok(Some(Apply::Delete)))
            .await
            .map(drop)
    }

    /// One schedule by id.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn schedule(&self, id: ScheduleId) -> Result<Option<ScheduleStatus>, FlowError> {
        let q = queries(self.inner.db.dialect());
        self.fetch_schedule(sqlx::query(q.get("schedule_by_id")).bind(id.0))
            .await
    }

    /// One schedule by name.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn by_name(&self, name: &str) -> Result<Option<ScheduleStatus>, FlowError> {
        let q = queries(self.inner.db.dialect());
        self.fetch_schedule(sqlx::query(q.get("schedule_by_name")).bind(name.to_owned()))
            .await
    }

    async fn fetch_schedule<'q>(
        &self,
        query: sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>,
    ) -> Result<Option<ScheduleStatus>, FlowError> {
        let row = query
            .fetch_optional(self.inner.db.pool())
            .await
            .map_err(|e| FlowError::db("reading the schedule", e))?;
        row.map(|r| decode_schedule(&r))
            .transpose()
            .map_err(|e| FlowError::db("decoding the schedule", e))
    }

    /// The first `limit` schedules by id.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn list(&self, limit: i64) -> Result<Vec<ScheduleStatus>, FlowError> {
        let q = queries(self.inner.db.dialect());
        let rows = sqlx::query(q.get("schedule_list"))
            .bind(limit)
            .fetch_all(self.inner.db.pool())
            .await
            .map_err(|e| FlowError::db("listing schedules", e))?;
        rows.iter()
            .map(decode_schedule)
            .collect::<Result<_, _>>()
            .map_err(|e| FlowError::db("decoding schedules", e))
    }

    /// A schedule's newest `limit` runs (newest first), or the newest runs of all schedules.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn runs(
        &self,
        schedule: Option<ScheduleId>,
        limit: i64,
    ) -> Result<Vec<FlowRun>, FlowError> {
        let q = queries(self.inner.db.dialect());
        let query = match schedule {
            Some(id) => sqlx::query(q.get("runs_of")).bind(id.0).bind(limit),
            None => sqlx::query(q.get("runs_recent")).bind(limit),
        };
        let rows = query
            .fetch_all(self.inner.db.pool())
            .await
            .map_err(|e| FlowError::db("listing runs", e))?;
        rows.iter()
            .map(decode_run)
            .collect::<Result<_, _>>()
            .map_err(|e| FlowError::db("decoding runs", e))
    }

    /// Schedule counts, the most overdue schedule's lateness, and the run count, each count
    /// bounded by [`OBSERVATION_CAP`](nexuscrm_persistence::OBSERVATION_CAP).
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn observations(&self) -> Result<Observations, FlowError> {
        self.observations_capped(nexuscrm_persistence::OBSERVATION_CAP)
            .await
    }

    /// Observations whose counts stop at `cap` (at least 1): each count reads at most `cap`
    /// index entries, so the run history's size does not make a scrape slower.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn observations_capped(&self, cap: i64) -> Result<Observations, FlowError> {
        let cap = cap.max(1);
        let db = &self.inner.db;
        let q = queries(db.dialect());
        let err = |e| FlowError::db("reading observations", e);
        let mut o = Observations {
            count_cap: cap,
            ..Observations::default()
        };
        for r in sqlx::query(q.get("count_by_state"))
            .bind(cap)
            .bind(cap)
            .bind(cap)
            .fetch_all(db.pool())
            .await
            .map_err(err)?
        {
            let n: i64 = r.try_get(1).map_err(err)?;
            match text(&r, 0).map_err(err)?.as_str() {
                "active" => o.active = n,
                "leased" => o.leased = n,
                "paused" => o.paused = n,
                _ => {}
            }
        }
        let now = self.inner.now_ms();
        let oldest: Option<i64> = sqlx::query(q.get("oldest_due"))
            .bind(now)
            .fetch_one(db.pool())
            .await
            .and_then(|r| r.try_get(0))
            .map_err(err)?;
        o.oldest_due_age = oldest.map(|t| Duration::from_millis((now - t).max(0) as u64));
        o.runs = sqlx::query(q.get("run_count"))
            .bind(cap)
            .fetch_one(db.pool())
            .await
            .and_then(|r| r.try_get(0))
            .map_err(err)?;
        Ok(o)
    }
}

/// A producer change to apply to the locked row.
enum Apply {
    Define {
        def: Stored,
        cursor: i64,
        state: &'static str,
        now: i64,
    },
    State {
        state: &'static str,
        cursor: Option<i64>,
        now: i64,
    },
    Delete,
}
