//! The Paused Flow work family (contract slice 4): a flow run's step that waits for an
//! external resume (an approval, a partner's callback) or a timeout.
//!
//! This crate holds the family's store and producer: [`PausedFlow::pause`] persists a pause and
//! returns an unguessable [`ResumeToken`] (256 random bits; only its SHA-256 is stored), and
//! [`PausedFlow::resume`] turns it `resumable`, idempotently. The worker that claims resumable
//! pauses, runs their external effect and quarantines ambiguous outcomes as `uncertain` is the
//! next part of slice 4 (see the README).
//!
//! ```text
//! paused ──resume──▶ resumable ──claim──▶ leased ──▶ completed | uncertain | poisoned
//!   │  └──timeout──▶ timed_out ──claim──▶ leased
//!   └──cancel──▶ cancelled
//! ```

pub mod connector;
mod worker;

pub use connector::{Connector, ConnectorError, EffectOutcome, Evidence};
pub use worker::{PausedAttempt, PausedSource, Resolution};

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use nexuscrm_persistence::sqlx::{self, AnyConnection, Row};
use nexuscrm_persistence::support::{echo, from_ms, is_unique_violation, retrying, text, to_ms};
use nexuscrm_persistence::{
    Db, DbError, DialectQueries, Fence, GenerationProbe, Migration, Queries, TxFuture, WriteError,
};
use nexuscrm_worker::fault::{CrashPoint, Faults};
use nexuscrm_worker::{Clock, SystemClock};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

/// The family's name (migrations, ownership, declarations).
pub const FAMILY: &str = "paused";

/// The Paused Flow declaration: accepted resumes survive crashes; the effect leaves the
/// database, and an ambiguous outcome is quarantined as `uncertain`, never replayed blindly.
pub const DECLARATION: nexuscrm_worker::Declaration = nexuscrm_worker::Declaration::new_const(
    FAMILY,
    nexuscrm_worker::Durability::DurableCritical,
    nexuscrm_worker::Effect::OutcomeUncertain,
);

/// Queue observations of the Paused Flow store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PausedObservations {
    /// Pauses per state, in [`PausedObservations::STATES`] order.
    pub by_state: Vec<(&'static str, i64)>,
    /// How long the oldest `uncertain` pause has waited for a person.
    pub oldest_uncertain_age: Option<Duration>,
    /// Where every count stops: a count equal to it means at least this many
    /// ([`OBSERVATION_CAP`](nexuscrm_persistence::OBSERVATION_CAP) unless asked otherwise).
    pub count_cap: i64,
}

impl PausedObservations {
    /// Every state a pause can be in.
    pub const STATES: [&'static str; 9] = [
        "paused",
        "resumable",
        "timed_out",
        "leased",
        "observing",
        "completed",
        "uncertain",
        "poisoned",
        "cancelled",
    ];

    /// The count of one state.
    #[must_use]
    pub fn count(&self, state: &str) -> i64 {
        self.by_state
            .iter()
            .find(|(s, _)| *s == state)
            .map_or(0, |(_, n)| *n)
    }
}

/// The family's migrations, per dialect.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "paused steps with hashed resume tokens",
        sqlite: include_str!("../sql/sqlite/0001_paused.sql"),
        postgres: include_str!("../sql/postgres/0001_paused.sql"),
        mysql: include_str!("../sql/mysql/0001_paused.sql"),
    },
    Migration {
        version: 2,
        name: "claim-token index (MySQL dialect; RETURNING elsewhere)",
        sqlite: "",
        postgres: "",
        mysql: include_str!("../sql/mysql/0002_paused.sql"),
    },
];

/// The largest pause or resume payload accepted, as JSON text.
pub const MAX_PAYLOAD_BYTES: usize = 64 * 1024;

/// The longest pause accepted.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(366 * 24 * 3600);

/// The prefix of every resume token.
const TOKEN_PREFIX: &str = "prt_";

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

/// A resume token: `prt_` and 64 hex digits (256 bits from the operating system's CSPRNG).
/// Shown once, to the producer that paused; the store keeps only its SHA-256. Its `Debug`
/// output hides it, so it is never logged by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct ResumeToken(String);

impl ResumeToken {
    fn generate() -> Result<ResumeToken, PauseError> {
        let mut bytes = [0u8; 32];
        getrandom::getrandom(&mut bytes).map_err(|e| {
            PauseError::new(
                PauseErrorKind::NotAccepted,
                format!("no randomness for a resume token: {e}"),
            )
        })?;
        Ok(ResumeToken(format!("{TOKEN_PREFIX}{}", hex(&bytes))))
    }

    /// The token's text, to hand to whoever will resume.
    #[must_use]
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// A token from its text; `None` unless it has the shape of one (the store still decides
    /// whether it is known).
    #[must_use]
    pub fn parse(text: &str) -> Option<ResumeToken> {
        let hexits = text.strip_prefix(TOKEN_PREFIX)?;
        (hexits.len() == 64
            && hexits
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .then(|| ResumeToken(text.to_owned()))
    }

    fn hash(&self) -> String {
        sha256_hex(self.0.as_bytes())
    }
}

impl fmt::Debug for ResumeToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ResumeToken(<hidden>)")
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex(&Sha256::digest(bytes))
}

/// A pause to persist.
#[derive(Debug, Clone)]
pub struct NewPause {
    /// The flow run it belongs to (a Scheduled Flow run id, or a producer's own reference).
    pub run: String,
    /// The step that pauses; a run pauses at most once per step.
    pub step: String,
    /// How long it waits for a resume before it times out (1 s to 366 days).
    pub timeout: Duration,
    /// What the step carries to whoever resumes it (JSON, at most 64 KiB).
    pub payload: Value,
}

impl NewPause {
    /// A pause of `run` at `step` for `timeout`, with `payload`.
    #[must_use]
    pub fn new(
        run: impl Into<String>,
        step: impl Into<String>,
        timeout: Duration,
        payload: Value,
    ) -> Self {
        NewPause {
            run: run.into(),
            step: step.into(),
            timeout,
            payload,
        }
    }
}

/// A persisted pause and its resume token (the only time the token is seen).
#[derive(Debug, Clone)]
pub struct Paused {
    /// The pause's id.
    pub id: i64,
    /// Its resume token.
    pub token: ResumeToken,
    /// When it times out.
    pub timeout_at: SystemTime,
}

/// The acknowledgement of a resume: the same for a repeated resume with the same payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resumed {
    /// The pause.
    pub id: i64,
    /// When the (first) resume committed.
    pub resumed_at: SystemTime,
    /// `false` when this was a repeat of an earlier, identical resume.
    pub first: bool,
}

/// A pause as the store records it (never its token).
#[derive(Debug, Clone, PartialEq)]
pub struct PauseStatus {
    /// The pause's id.
    pub id: i64,
    /// Its run.
    pub run: String,
    /// Its step.
    pub step: String,
    /// `paused`, `resumable`, `timed_out`, `leased`, `observing`, `completed`, `uncertain`,
    /// `poisoned` or `cancelled`.
    pub state: String,
    /// The pause's payload.
    pub payload: Value,
    /// The resume's payload, once resumed.
    pub resume_payload: Option<Value>,
    /// When it times out.
    pub timeout_at: SystemTime,
    /// When it was resumed.
    pub resumed_at: Option<SystemTime>,
    /// Claims of its effect so far.
    pub attempts: i64,
    /// When it was paused.
    pub created_at: SystemTime,
    /// The effect's result or, for an `uncertain` pause, its evidence.
    pub outcome: Option<Value>,
    /// The idempotency key its effect is sent with.
    pub effect_key: String,
    /// When an attempt committed its intent to send the effect (a request may have left).
    pub intent_at: Option<SystemTime>,
}

/// The kind of a [`PauseError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PauseErrorKind {
    /// Malformed input (a bad run or step name, timeout, payload, or text that is not a resume
    /// token), refused before anything was read or stored.
    Invalid,
    /// No pause has this resume token.
    UnknownToken,
    /// The pause timed out before this resume: nothing changed.
    Expired,
    /// The pause was cancelled: nothing changed.
    Cancelled,
    /// The request contradicts the stored state (the token was already used with another
    /// payload, the run already paused at this step, a cancel of a pause that is not paused);
    /// nothing changed.
    Conflict,
    /// No pause with this id.
    NotFound,
    /// The database failed before commit: nothing was stored. Safe to retry.
    NotAccepted,
    /// The commit's answer was lost: the change may or may not be stored. A resume may be
    /// retried with the same token and payload (it is idempotent); read a pause back by id.
    OutcomeUnknown,
    /// Any other database error.
    Database,
    /// An injected crash (the crash matrix).
    Crashed,
}

/// A Paused Flow error: what went wrong, in a sentence that names the pause.
#[derive(Debug)]
pub struct PauseError {
    kind: PauseErrorKind,
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl PauseError {
    fn new(kind: PauseErrorKind, message: impl Into<String>) -> Self {
        PauseError {
            kind,
            message: message.into(),
            source: None,
        }
    }

    fn write(context: &str, e: WriteError) -> Self {
        let kind = if e.is_not_committed() {
            PauseErrorKind::NotAccepted
        } else {
            PauseErrorKind::OutcomeUnknown
        };
        PauseError {
            kind,
            message: format!("{context}: {e}"),
            source: Some(Box::new(e)),
        }
    }

    fn db(context: &str, e: sqlx::Error) -> Self {
        PauseError {
            kind: PauseErrorKind::Database,
            message: format!("{context}: {e}"),
            source: Some(Box::new(e)),
        }
    }

    /// What went wrong.
    #[must_use]
    pub fn kind(&self) -> PauseErrorKind {
        self.kind
    }
}

impl fmt::Display for PauseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PauseError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Paused Flow options.
#[derive(Debug, Clone)]
pub struct PausedOptions {
    clock: Arc<dyn Clock>,
    generation: i64,
    lease: Duration,
    backoff: Duration,
    connector: Option<Connector>,
    generation_poll: Option<Duration>,
    listen: bool,
    faults: Faults,
    audit: bool,
}

impl Default for PausedOptions {
    fn default() -> Self {
        PausedOptions {
            clock: Arc::new(SystemClock),
            generation: 1,
            lease: Duration::from_secs(30),
            backoff: Duration::from_secs(1),
            connector: None,
            generation_poll: Some(Duration::from_secs(5)),
            listen: true,
            faults: Faults::none(),
            audit: false,
        }
    }
}

impl PausedOptions {
    /// Write an audit event (`pause.resolved`) for every operator resolution of an uncertain
    /// pause, in the resolution's own transaction, through the audit outbox
    /// ([`nexuscrm_audit::record`]): the event exists if and only if the decision committed, and
    /// a refused resolution (the pause is not uncertain) writes none. Subject `pause:<id>`,
    /// actor the one given to [`PausedFlow::resolve`], body the decision, the new state and the
    /// evidence the operator decided on. [`PausedFlow::open`] then also runs the audit
    /// migrations. By default off.
    #[must_use]
    pub fn audit(mut self, on: bool) -> Self {
        self.audit = on;
        self
    }

    /// The wall clock for pause, resume, timeout and lease times. By default the system clock.
    #[must_use]
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// This deployment's generation (the ownership fence). Default 1.
    #[must_use]
    pub fn generation(mut self, generation: i64) -> Self {
        self.generation = generation;
        self
    }

    /// How long a claim holds a pause; heartbeats extend it every third of it. Default 30 s.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long a provably not-applied effect waits before it is sent again (a receiver's
    /// Retry-After wins when longer). Default 1 s.
    #[must_use]
    pub fn backoff(mut self, backoff: Duration) -> Self {
        self.backoff = backoff;
        self
    }

    /// Where resumed steps send their effect. Without one, the worker claims nothing.
    #[must_use]
    pub fn connector(mut self, connector: Connector) -> Self {
        self.connector = Some(connector);
        self
    }

    /// The polled generation probe's period (`None`: no poll); PostgreSQL LISTENs when
    /// `listen` is on (the default).
    #[must_use]
    pub fn generation_poll(mut self, every: Option<Duration>) -> Self {
        self.generation_poll = every;
        self
    }

    /// Whether PostgreSQL LISTENs for resumes by other processes. Default on.
    #[must_use]
    pub fn listen(mut self, on: bool) -> Self {
        self.listen = on;
        self
    }

    /// Fault hooks for the crash matrix (none by default).
    #[must_use]
    pub fn faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }
}

/// The PostgreSQL notification channel of the Paused Flow family.
pub const CHANNEL: &str = "nexuscrm_paused";

/// The Paused Flow store and producer.
#[derive(Debug, Clone)]
pub struct PausedFlow {
    pub(crate) db: Db,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) worker: Arc<WorkerSettings>,
}

/// What the worker needs beside the database.
#[derive(Debug)]
pub(crate) struct WorkerSettings {
    pub(crate) fence: Fence,
    pub(crate) lease: Duration,
    pub(crate) backoff: Duration,
    pub(crate) connector: Option<Connector>,
    pub(crate) probe: GenerationProbe,
    pub(crate) faults: Faults,
    pub(crate) waker: std::sync::OnceLock<nexuscrm_worker::Waker>,
    /// Whether operator decisions write audit events.
    pub(crate) audit: bool,
}

/// What a resume's transaction found.
enum ResumeOutcome {
    Resumed(i64, i64),
    Repeated(i64, i64),
    Refused(PauseErrorKind, String),
}

impl PausedFlow {
    /// Migrates the family's tables and returns the store.
    ///
    /// # Errors
    ///
    /// When the migrations cannot be applied.
    pub async fn open(db: Db, options: PausedOptions) -> Result<PausedFlow, DbError> {
        db.migrate_ownership().await?;
        db.migrate(FAMILY, MIGRATIONS).await?;
        if options.audit {
            nexuscrm_audit::migrate(&db).await?;
        }
        Ok(PausedFlow::without_migrations(db, options))
    }

    /// A store over an already-migrated database.
    #[must_use]
    pub fn without_migrations(db: Db, options: PausedOptions) -> PausedFlow {
        let probe = GenerationProbe::new(&db, CHANNEL, options.listen, options.generation_poll)
            .signal(FAMILY);
        PausedFlow {
            worker: Arc::new(WorkerSettings {
                fence: Fence::new(FAMILY, options.generation),
                lease: options.lease,
                backoff: options.backoff,
                connector: options.connector,
                probe,
                faults: options.faults,
                waker: std::sync::OnceLock::new(),
                audit: options.audit,
            }),
            db,
            clock: options.clock,
        }
    }

    /// Takes ownership of the family for this generation (older generations are fenced out:
    /// their claims and completions commit nothing).
    ///
    /// # Errors
    ///
    /// When the ownership cannot be written, or a newer generation owns the family.
    pub async fn take_ownership(&self, owner: &str) -> Result<(), PauseError> {
        self.db
            .take_ownership(FAMILY, self.worker.fence.generation(), owner)
            .await
            .map_err(|e| {
                PauseError::new(
                    PauseErrorKind::Database,
                    format!("taking ownership of paused: {e}"),
                )
            })?;
        // The transfer is half done here: the new fence is committed, this generation has not
        // claimed yet, and older generations may still hold leases.
        self.worker
            .faults
            .hit(CrashPoint::OwnershipTransfer)
            .map_err(crashed)?;
        self.worker.probe.notify(&self.db).await;
        Ok(())
    }

    /// Ends the generation probe's current stream (tests: a lost LISTEN or polled probe).
    pub fn interrupt_generation_probe(&self) {
        self.worker.probe.interrupt();
    }

    /// The worker's [`Source`](nexuscrm_worker::Source) over this store.
    #[must_use]
    pub fn source(&self) -> PausedSource {
        PausedSource {
            store: self.clone(),
        }
    }

    /// The database handle.
    #[must_use]
    pub fn db(&self) -> &Db {
        &self.db
    }

    fn validate(pause: &NewPause) -> Result<String, PauseError> {
        for (what, name) in [("run", &pause.run), ("step", &pause.step)] {
            if name.is_empty() || name.len() > 255 || name.chars().any(char::is_control) {
                return Err(PauseError::new(
                    PauseErrorKind::Invalid,
                    format!(
                        "{what} {:?} must be 1 to 255 characters without control characters",
                        echo(name, 80)
                    ),
                ));
            }
        }
        if pause.timeout < Duration::from_secs(1) || pause.timeout > MAX_TIMEOUT {
            return Err(PauseError::new(
                PauseErrorKind::Invalid,
                format!("timeout {:?} is outside 1 s to 366 days", pause.timeout),
            ));
        }
        payload_text(&pause.payload, "pause payload")
    }

    /// Persists `pause` in its own transaction and returns its resume token (acknowledged
    /// after commit). See [`PausedFlow::pause_in`] to pause inside the run's own transaction.
    ///
    /// # Errors
    ///
    /// [`PauseErrorKind::Invalid`] for bad input, [`PauseErrorKind::Conflict`] when the run
    /// already paused at this step, [`PauseErrorKind::NotAccepted`] or
    /// [`PauseErrorKind::OutcomeUnknown`] when the database failed.
    pub async fn pause(&self, pause: NewPause) -> Result<Paused, PauseError> {
        let payload = PausedFlow::validate(&pause)?;
        let token = ResumeToken::generate()?;
        let now = to_ms(self.clock.now());
        let timeout_at = now.saturating_add(pause.timeout.as_millis() as i64);
        let q = queries(self.db.dialect());
        let (run, step, hash) = (pause.run.clone(), pause.step.clone(), token.hash());
        let never = CancellationToken::new();
        // Lock contention (a deadlock, a serialization failure) is a proven rollback: retried.
        let outcome = retrying(&never, || {
            let (run, step, hash, payload) =
                (run.clone(), step.clone(), hash.clone(), payload.clone());
            self.db.write(&never, move |c| {
                insert_pause(c, q, run, step, hash, payload, timeout_at, now)
            })
        })
        .await;
        match outcome {
            Ok(id) => Ok(Paused {
                id,
                token,
                timeout_at: from_ms(timeout_at),
            }),
            Err(WriteError::NotCommitted(e)) if is_unique_violation(&e) => {
                Err(self.already_paused(&pause).await)
            }
            Err(e) => Err(PauseError::write("persisting the pause", e)),
        }
    }

    /// Persists `pause` inside the caller's open transaction `conn` (the run's own
    /// transaction, so the run and its pause commit together) and returns its resume token,
    /// valid once the caller commits.
    ///
    /// # Errors
    ///
    /// [`PauseErrorKind::Invalid`] for bad input; [`PauseErrorKind::Database`] for a failed
    /// statement (a unique violation means the run already paused at this step), after which
    /// the caller must roll back.
    pub async fn pause_in(
        &self,
        conn: &mut AnyConnection,
        pause: NewPause,
    ) -> Result<Paused, PauseError> {
        let payload = PausedFlow::validate(&pause)?;
        let token = ResumeToken::generate()?;
        let now = to_ms(self.clock.now());
        let timeout_at = now.saturating_add(pause.timeout.as_millis() as i64);
        let q = queries(self.db.dialect());
        let id = insert_pause(
            conn,
            q,
            pause.run,
            pause.step,
            token.hash(),
            payload,
            timeout_at,
            now,
        )
        .await
        .map_err(|e| PauseError::db("persisting the pause", e))?;
        Ok(Paused {
            id,
            token,
            timeout_at: from_ms(timeout_at),
        })
    }

    async fn already_paused(&self, pause: &NewPause) -> PauseError {
        let q = queries(self.db.dialect());
        let id: Option<i64> = sqlx::query(q.get("pause_by_run_step"))
            .bind(&pause.run)
            .bind(&pause.step)
            .fetch_optional(self.db.pool())
            .await
            .ok()
            .flatten()
            .and_then(|r| r.try_get(0).ok());
        PauseError::new(
            PauseErrorKind::Conflict,
            format!(
                "run {:?} already paused at step {:?}{}: a run pauses once per step",
                echo(&pause.run, 80),
                echo(&pause.step, 80),
                id.map(|id| format!(" (pause {id})")).unwrap_or_default()
            ),
        )
    }

    /// Resumes the pause `token` names with `payload`: it becomes `resumable` (acknowledged
    /// after commit). Idempotent: the same token and payload again returns the same
    /// acknowledgement (`first: false`), whatever happened to the pause since.
    ///
    /// # Errors
    ///
    /// Each refusal changes nothing: [`PauseErrorKind::Invalid`] (not a token's shape, a bad
    /// payload), [`PauseErrorKind::UnknownToken`], [`PauseErrorKind::Expired`] (timed out),
    /// [`PauseErrorKind::Cancelled`], [`PauseErrorKind::Conflict`] (already resumed with
    /// another payload); [`PauseErrorKind::NotAccepted`] or [`PauseErrorKind::OutcomeUnknown`]
    /// when the database failed (retry with the same token and payload).
    pub async fn resume(&self, token: &str, payload: &Value) -> Result<Resumed, PauseError> {
        let token = ResumeToken::parse(token).ok_or_else(|| {
            PauseError::new(
                PauseErrorKind::Invalid,
                format!(
                    "{:?} is not a resume token (prt_ and 64 hex digits)",
                    echo(token, 12)
                ),
            )
        })?;
        let text = payload_text(payload, "resume payload")?;
        self.worker
            .faults
            .hit(CrashPoint::BeforeAcceptance)
            .map_err(crashed)?;
        let digest = sha256_hex(text.as_bytes());
        let hash = token.hash();
        let now = to_ms(self.clock.now());
        let q = queries(self.db.dialect());
        let never = CancellationToken::new();
        // Lock contention (a deadlock, a serialization failure) is a proven rollback: retried.
        let outcome = retrying(&never, || {
            let (hash, text, digest) = (hash.clone(), text.clone(), digest.clone());
            self.db.write(&never, move |c| {
                Box::pin(async move {
                    let Some(row) = sqlx::query(q.get("pause_by_token"))
                        .bind(&hash)
                        .fetch_optional(&mut *c)
                        .await?
                    else {
                        return Ok(ResumeOutcome::Refused(
                            PauseErrorKind::UnknownToken,
                            "no pause has this resume token".into(),
                        ));
                    };
                    let s = status_of(&row)?;
                    let stored_digest = text_at(&row, 11)?;
                    let resumed_at = row.try_get::<Option<i64>, _>(7)?;
                    match (s.state.as_str(), resumed_at) {
                        ("paused", _) if to_ms(s.timeout_at) <= now => Ok(ResumeOutcome::Refused(
                            PauseErrorKind::Expired,
                            format!("pause {} timed out before this resume", s.id),
                        )),
                        ("paused", _) => {
                            sqlx::query(q.get("pause_resume"))
                                .bind(&text)
                                .bind(&digest)
                                .bind(now)
                                .bind(now)
                                .bind(now)
                                .bind(s.id)
                                .execute(&mut *c)
                                .await?;
                            Ok(ResumeOutcome::Resumed(s.id, now))
                        }
                        ("cancelled", _) => Ok(ResumeOutcome::Refused(
                            PauseErrorKind::Cancelled,
                            format!("pause {} was cancelled", s.id),
                        )),
                        ("timed_out", None) => Ok(ResumeOutcome::Refused(
                            PauseErrorKind::Expired,
                            format!("pause {} timed out before this resume", s.id),
                        )),
                        (_, Some(at)) if stored_digest == digest => {
                            Ok(ResumeOutcome::Repeated(s.id, at))
                        }
                        (state, _) => Ok(ResumeOutcome::Refused(
                            PauseErrorKind::Conflict,
                            format!(
                                "pause {} was already resumed with another payload (it is \
                                 {state}): a resume token is used once",
                                s.id
                            ),
                        )),
                    }
                })
            })
        })
        .await
        .map_err(|e| PauseError::write("resuming the pause", e))?;
        if !matches!(outcome, ResumeOutcome::Refused(..)) {
            self.worker
                .faults
                .hit(CrashPoint::AfterAcceptance)
                .map_err(crashed)?;
        }
        match outcome {
            ResumeOutcome::Resumed(id, at) => {
                // After commit: this process's controller at once, others through the probe.
                if let Some(w) = self.worker.waker.get() {
                    w.wake();
                }
                self.worker.probe.notify(&self.db).await;
                Ok(Resumed {
                    id,
                    resumed_at: from_ms(at),
                    first: true,
                })
            }
            ResumeOutcome::Repeated(id, at) => Ok(Resumed {
                id,
                resumed_at: from_ms(at),
                first: false,
            }),
            ResumeOutcome::Refused(kind, message) => Err(PauseError::new(kind, message)),
        }
    }

    /// Cancels a pause that is still `paused`: its token can no longer resume it.
    ///
    /// # Errors
    ///
    /// [`PauseErrorKind::NotFound`] for an unknown id, [`PauseErrorKind::Conflict`] for a pause
    /// that is no longer paused; database errors as for [`PausedFlow::pause`].
    pub async fn cancel(&self, id: i64) -> Result<PauseStatus, PauseError> {
        let q = queries(self.db.dialect());
        let now = to_ms(self.clock.now());
        let never = CancellationToken::new();
        let changed = self
            .db
            .write(&never, move |c| {
                Box::pin(async move {
                    let n = sqlx::query(q.get("pause_cancel"))
                        .bind(now)
                        .bind(id)
                        .execute(&mut *c)
                        .await?
                        .rows_affected();
                    Ok(n)
                })
            })
            .await
            .map_err(|e| PauseError::write("cancelling the pause", e))?;
        let status = self
            .status(id)
            .await?
            .ok_or_else(|| PauseError::new(PauseErrorKind::NotFound, format!("no pause {id}")))?;
        if changed == 0 {
            return Err(PauseError::new(
                PauseErrorKind::Conflict,
                format!(
                    "pause {id} is {}, not paused: only a paused step can be cancelled",
                    status.state
                ),
            ));
        }
        Ok(status)
    }

    /// One pause, or `None`.
    ///
    /// # Errors
    ///
    /// When the database cannot be read.
    pub async fn status(&self, id: i64) -> Result<Option<PauseStatus>, PauseError> {
        let q = queries(self.db.dialect());
        let row = sqlx::query(q.get("pause_by_id"))
            .bind(id)
            .fetch_optional(self.db.pool())
            .await
            .map_err(|e| PauseError::db("reading the pause", e))?;
        row.map(|r| status_of(&r))
            .transpose()
            .map_err(|e| PauseError::db("decoding the pause", e))
    }

    /// The newest pauses, of one state or of all.
    ///
    /// # Errors
    ///
    /// When the database cannot be read.
    pub async fn list(
        &self,
        state: Option<&str>,
        limit: i64,
    ) -> Result<Vec<PauseStatus>, PauseError> {
        let q = queries(self.db.dialect());
        let rows = match state {
            Some(s) => {
                sqlx::query(q.get("pause_list_state"))
                    .bind(s.to_owned())
                    .bind(limit)
                    .fetch_all(self.db.pool())
                    .await
            }
            None => {
                sqlx::query(q.get("pause_list"))
                    .bind(limit)
                    .fetch_all(self.db.pool())
                    .await
            }
        }
        .map_err(|e| PauseError::db("listing pauses", e))?;
        rows.iter()
            .map(status_of)
            .collect::<Result<_, _>>()
            .map_err(|e| PauseError::db("decoding a pause", e))
    }

    /// Counts per state (each bounded by
    /// [`OBSERVATION_CAP`](nexuscrm_persistence::OBSERVATION_CAP)) and the age of the oldest
    /// `uncertain` pause.
    ///
    /// # Errors
    ///
    /// When the database cannot be read.
    pub async fn observations(&self) -> Result<PausedObservations, PauseError> {
        self.observations_capped(nexuscrm_persistence::OBSERVATION_CAP)
            .await
    }

    /// Observations whose counts stop at `cap` (at least 1): each count reads at most `cap`
    /// entries of a `(state, …)` index, however many completed pauses the history holds.
    ///
    /// # Errors
    ///
    /// When the database cannot be read.
    pub async fn observations_capped(&self, cap: i64) -> Result<PausedObservations, PauseError> {
        let cap = cap.max(1);
        let q = queries(self.db.dialect());
        let mut counted = sqlx::query(q.get("pause_counts_capped"));
        for _ in PausedObservations::STATES {
            counted = counted.bind(cap);
        }
        let counts: Vec<(String, i64)> = counted
            .fetch_all(self.db.pool())
            .await
            .map_err(|e| PauseError::db("counting pauses", e))?
            .iter()
            .map(|r| Ok((text(r, 0)?, r.try_get(1)?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(|e| PauseError::db("decoding the counts", e))?;
        let oldest: Option<i64> = sqlx::query_scalar(q.get("oldest_uncertain"))
            .fetch_one(self.db.pool())
            .await
            .map_err(|e| PauseError::db("reading the oldest uncertain pause", e))?;
        let now = to_ms(self.clock.now());
        Ok(PausedObservations {
            by_state: PausedObservations::STATES
                .iter()
                .map(|s| {
                    (
                        *s,
                        counts.iter().find(|(c, _)| c == s).map_or(0, |(_, n)| *n),
                    )
                })
                .collect(),
            oldest_uncertain_age: oldest
                .map(|at| Duration::from_millis(now.saturating_sub(at).max(0) as u64)),
            count_cap: cap,
        })
    }

    /// How many pauses are in each state, exactly (an unbounded `GROUP BY`: for an operator's
    /// question, not for a scrape; [`PausedFlow::observations`] is bounded).
    ///
    /// # Errors
    ///
    /// When the database cannot be read.
    pub async fn counts(&self) -> Result<Vec<(String, i64)>, PauseError> {
        let q = queries(self.db.dialect());
        let rows = sqlx::query(q.get("pause_counts"))
            .fetch_all(self.db.pool())
            .await
            .map_err(|e| PauseError::db("counting pauses", e))?;
        rows.iter()
            .map(|r| Ok((text(r, 0)?, r.try_get(1)?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(|e| PauseError::db("decoding the counts", e))
    }
}

#[allow(clippy::too_many_arguments)]
fn insert_pause<'c>(
    c: &'c mut AnyConnection,
    q: &'static Queries,
    run: String,
    step: String,
    hash: String,
    payload: String,
    timeout_at: i64,
    now: i64,
) -> TxFuture<'c, i64> {
    Box::pin(async move {
        sqlx::query(q.get("pause_insert"))
            .bind(&run)
            .bind(&step)
            .bind(&hash)
            .bind(&payload)
            .bind(timeout_at)
            .bind(now)
            .bind(now)
            .bind(format!(
                "nxp-{}",
                nexuscrm_persistence::support::new_token()
            ))
            .execute(&mut *c)
            .await?;
        let id: i64 = sqlx::query(q.get("pause_by_run_step"))
            .bind(&run)
            .bind(&step)
            .fetch_one(&mut *c)
            .await?
            .try_get(0)?;
        Ok(id)
    })
}

fn crashed(c: nexuscrm_worker::fault::Crash) -> PauseError {
    PauseError {
        kind: PauseErrorKind::Crashed,
        message: c.to_string(),
        source: Some(Box::new(c)),
    }
}

/// `payload` as JSON text, refused when larger than [`MAX_PAYLOAD_BYTES`].
fn payload_text(payload: &Value, what: &str) -> Result<String, PauseError> {
    let text = payload.to_string();
    if text.len() > MAX_PAYLOAD_BYTES {
        return Err(PauseError::new(
            PauseErrorKind::Invalid,
            format!(
                "the {what} is {} bytes of JSON; at most {MAX_PAYLOAD_BYTES} are accepted",
                text.len()
            ),
        ));
    }
    Ok(text)
}

fn text_at(r: &sqlx::any::AnyRow, i: usize) -> Result<String, sqlx::Error> {
    text(r, i)
}

pub(crate) fn json_at(r: &sqlx::any::AnyRow, i: usize) -> Result<Value, sqlx::Error> {
    serde_json::from_str(&text(r, i)?).map_err(|e| sqlx::Error::Decode(Box::new(e)))
}

/// A nullable JSON text column.
pub(crate) fn optional_json_at(
    r: &sqlx::any::AnyRow,
    i: usize,
) -> Result<Option<Value>, sqlx::Error> {
    match r.try_get::<Option<String>, _>(i) {
        Ok(None) => Ok(None),
        Ok(Some(s)) => Ok(Some(
            serde_json::from_str(&s).map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
        )),
        // MariaDB reports TEXT as BLOB through the Any driver.
        Err(_) => match r.try_get::<Option<Vec<u8>>, _>(i)? {
            None => Ok(None),
            Some(_) => Ok(Some(json_at(r, i)?)),
        },
    }
}

fn status_of(r: &sqlx::any::AnyRow) -> Result<PauseStatus, sqlx::Error> {
    let resume_payload = optional_json_at(r, 5)?;
    Ok(PauseStatus {
        id: r.try_get(0)?,
        run: text(r, 1)?,
        step: text(r, 2)?,
        state: text(r, 3)?,
        payload: json_at(r, 4)?,
        resume_payload,
        timeout_at: from_ms(r.try_get(6)?),
        resumed_at: r.try_get::<Option<i64>, _>(7)?.map(from_ms),
        attempts: r.try_get(8)?,
        created_at: from_ms(r.try_get(9)?),
        outcome: optional_json_at(r, 12)?,
        effect_key: text(r, 13)?,
        intent_at: r.try_get::<Option<i64>, _>(14)?.map(from_ms),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_256_random_bits_hidden_from_debug_and_parsed_strictly() {
        let a = ResumeToken::generate().unwrap();
        let b = ResumeToken::generate().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.expose().len(), TOKEN_PREFIX.len() + 64);
        assert_eq!(ResumeToken::parse(a.expose()), Some(a.clone()));
        assert!(!format!("{a:?}").contains(&a.expose()[4..]));
        assert_ne!(a.hash(), a.expose());
        for bad in [
            "",
            "prt_",
            "prt_xyz",
            &a.expose()[..60],
            &a.expose().to_uppercase(),
            &format!("{}0", a.expose()),
        ] {
            assert_eq!(ResumeToken::parse(bad), None, "{bad:?}");
        }
    }

    /// Cases per arbitrary-input property (`NEXUSCRM_PROPTEST_CASES`, 2,000 by default).
    fn arbitrary_cases() -> proptest::test_runner::Config {
        proptest::test_runner::Config::with_cases(
            nexuscrm_persistence::testing::arbitrary_case_count(),
        )
    }

    proptest::proptest! {
        #![proptest_config(arbitrary_cases())]

        /// Any text as a resume token: parsed only when it has a token's exact shape, never a
        /// panic.
        #[test]
        fn resume_tokens_never_panic_and_parse_only_their_shape(s in "(prt_)?\\PC{0,70}") {
            if let Some(t) = ResumeToken::parse(&s) {
                proptest::prop_assert_eq!(t.expose(), s.as_str());
                proptest::prop_assert_eq!(s.len(), 68);
            }
        }
    }
}

#[cfg(test)]
mod crash_tests {
    use super::*;

    #[test]
    fn an_injected_crash_is_found_through_a_pause_error() {
        let f = Faults::new();
        f.arm(CrashPoint::OwnershipTransfer);
        let e = f
            .hit(CrashPoint::OwnershipTransfer)
            .map_err(crashed)
            .unwrap_err();
        let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(e);
        assert!(nexuscrm_worker::fault::Crash::find(&*boxed).is_some());
    }
}
