//! The Bulk [`Source`] and [`Attempt`].

use std::num::NonZeroUsize;
use std::time::{Duration, SystemTime};

use nexuscrm_persistence::sqlx::AnyConnection;
use nexuscrm_persistence::sqlx::{self, Row};
use nexuscrm_persistence::{Dialect, Queries, WriteError};
use nexuscrm_worker::fault::CrashPoint;
use nexuscrm_worker::{Attempt, AttemptError, ClaimBatch, Generation, Source, SourceError};
use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;

use nexuscrm_persistence::family;
use nexuscrm_persistence::support::{new_token, retrying, text, to_ms};

use crate::store::{Bulk, JobId, SegmentCommitted, queries, row_problem};

/// The Bulk family's [`Source`]: claims due jobs (and jobs whose lease expired), answers
/// `next_work_at` from two indexed reads, and releases jobs leased by older generations on
/// reconciliation.
#[derive(Debug, Clone)]
pub struct BulkSource {
    pub(crate) bulk: Bulk,
}

/// Rows per multi-row statement (within every dialect's bind limit).
const ROWS_PER_STATEMENT: usize = 200;

/// `(p1, p2, ...), (...)` for `rows` tuples; `None` is a bind placeholder, `Some` a literal.
fn tuples(dialect: Dialect, rows: usize, pattern: &[Option<&str>]) -> String {
    let mut out = String::with_capacity(rows * pattern.len() * 5);
    let mut n = 0;
    for r in 0..rows {
        out.push_str(if r == 0 { " (" } else { ", (" });
        for (i, p) in pattern.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            match p {
                Some(lit) => out.push_str(lit),
                None if dialect == Dialect::Postgres => {
                    n += 1;
                    out.push('$');
                    out.push_str(&n.to_string());
                }
                None => out.push('?'),
            }
        }
        out.push(')');
    }
    out
}

/// Applies a segment's valid rows: per group of distinct keys, one multi-row upsert (bumping
/// each record's revision) and one multi-row change-log insert. Returns the rows applied.
async fn apply_rows(
    c: &mut AnyConnection,
    dialect: Dialect,
    q: &Queries,
    job: i64,
    rows: &[(i64, String, String)],
    now: i64,
    audit: bool,
) -> Result<i64, sqlx::Error> {
    let mut start = 0;
    while start < rows.len() {
        // A key may appear once per statement: a repeat starts the next group.
        let mut keys = std::collections::HashSet::new();
        let mut end = start;
        while end < rows.len() && end - start < ROWS_PER_STATEMENT && keys.insert(&rows[end].1) {
            end += 1;
        }
        let group = &rows[start..end];
        let sql = format!(
            "{}{} {}",
            q.get("record_upsert_prefix"),
            tuples(dialect, group.len(), &[None, Some("1"), None, None]),
            q.get("record_upsert_suffix")
        );
        let mut upsert = sqlx::query(&sql);
        for (_, key, fields) in group {
            upsert = upsert.bind(key.as_str()).bind(fields.as_str()).bind(now);
        }
        let returned = if dialect == Dialect::Mysql {
            upsert.execute(&mut *c).await?;
            let sql = format!(
                "{} ({})",
                q.get("record_revisions_prefix"),
                vec!["?"; group.len()].join(", ")
            );
            let mut read = sqlx::query(&sql);
            for (_, key, _) in group {
                read = read.bind(key.as_str());
            }
            read.fetch_all(&mut *c).await?
        } else {
            upsert.fetch_all(&mut *c).await?
        };
        let mut revision = std::collections::HashMap::with_capacity(group.len());
        for r in &returned {
            revision.insert(text(r, 0)?, r.try_get::<i64, _>(1)?);
        }
        let sql = format!(
            "{}{}",
            q.get("change_insert_prefix"),
            tuples(dialect, group.len(), &[None, None, None, None, None])
        );
        let mut changes = sqlx::query(&sql);
        for (ordinal, key, _) in group {
            let rev = *revision.get(key).ok_or_else(|| {
                sqlx::Error::Protocol(format!("the upsert returned no revision for record {key}"))
            })?;
            changes = changes
                .bind(job)
                .bind(*ordinal)
                .bind(key.as_str())
                .bind(rev)
                .bind(now);
        }
        changes.execute(&mut *c).await?;
        if audit {
            // The audit trail commits (or rolls back) with the change it describes.
            let at = nexuscrm_persistence::support::from_ms(now);
            let mut events = Vec::with_capacity(group.len());
            for (ordinal, key, fields) in group {
                let rev = revision.get(key).copied().unwrap_or_default();
                let fields: Value = serde_json::from_str(fields).unwrap_or(Value::Null);
                events.push(
                    nexuscrm_audit::AuditEvent::new(
                        format!("bulk-{job}-{ordinal}-r{rev}"),
                        key.as_str(),
                        "record.applied",
                        "bulk",
                        serde_json::json!({
                            "job": job,
                            "ordinal": ordinal,
                            "revision": rev,
                            "fields": fields,
                        }),
                    )
                    .at(at),
                );
            }
            nexuscrm_audit::record(c, dialect, &events).await?;
        }
        start = end;
    }
    Ok(rows.len() as i64)
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Claimed {
    id: i64,
    attempts: i64,
    max_attempts: i64,
    cursor: i64,
    total: i64,
    segment_size: i64,
    /// Consecutive claims without a committed segment, this one included.
    stalled: i64,
}

fn decode_claimed(r: &sqlx::any::AnyRow) -> Result<Claimed, sqlx::Error> {
    Ok(Claimed {
        id: r.try_get(0)?,
        attempts: r.try_get(1)?,
        max_attempts: r.try_get(2)?,
        cursor: r.try_get(3)?,
        total: r.try_get(4)?,
        segment_size: r.try_get(5)?,
        stalled: r.try_get(6)?,
    })
}

impl BulkSource {
    /// The family handle.
    #[must_use]
    pub fn bulk(&self) -> &Bulk {
        &self.bulk
    }

    /// The polled generation cursor: `MAX(id)` and the work signal's sum, which change when any
    /// process accepts a job (the sum even when the job's id is lower than one seen), mixed with the fence's generation, which grows when a newer deployment takes over (so a
    /// fenced-out replica reconciles, learns it is superseded and stops). One statement.
    async fn max_id(&self) -> Result<u64, sqlx::Error> {
        let q = queries(self.bulk.inner.db.dialect());
        let row = sqlx::query(q.get("generation"))
            .fetch_one(self.bulk.inner.db.pool())
            .await?;
        let id: Option<i64> = row.try_get(0)?;
        let owner: Option<i64> = row.try_get(1)?;
        // The work signal: changes for every accepted job whatever its id (see
        // `GenerationProbe::signal`).
        let signal: Option<i64> = row.try_get(2)?;
        Ok(mix_cursor(id.unwrap_or(0), owner.unwrap_or(0))
            .wrapping_add((signal.unwrap_or(0) as u64).wrapping_mul(SIGNAL_MIX)))
    }
}

/// Folds the work signal's sum into a polled cursor.
pub(crate) const SIGNAL_MIX: u64 = 0xBF58_476D_1CE4_E5B9;

/// Folds the owning generation into a polled cursor (the controller only compares for equality).
pub(crate) fn mix_cursor(id: i64, owner: i64) -> u64 {
    (id as u64).wrapping_add((owner as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

impl Source for BulkSource {
    type Attempt = BulkAttempt;

    async fn check_ready(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        let db = &self.bulk.inner.db;
        let q = queries(db.dialect());
        tokio::select! {
            biased;
            () = cancel.cancelled() => Err(SourceError::not_committed("cancelled")),
            r = sqlx::query(q.get("generation")).fetch_one(db.pool()) => r
                .map(drop)
                .map_err(|e| SourceError::new(format!("the bulk schema is not readable: {e}"))),
        }
    }

    async fn reconcile(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        let inner = &self.bulk.inner;
        let release = queries(inner.db.dialect()).get("release_older_generations");
        family::release_older_generations(&inner.db, &inner.fence, &inner.clock, &cancel, release)
            .await
    }

    async fn claim(
        &self,
        capacity: NonZeroUsize,
        cancel: CancellationToken,
    ) -> Result<ClaimBatch<BulkAttempt>, SourceError> {
        let inner = &self.bulk.inner;
        let dialect = inner.db.dialect();
        let q = queries(dialect);
        let token = new_token();
        let lease_ms = inner.cfg.lease.as_millis() as i64;
        let limit = capacity.get() as i64;
        let generation = inner.fence.generation();
        let claim_token = token.clone();
        let mut jobs: Vec<Claimed> = family::fenced(
            &inner.db,
            &inner.fence,
            &inner.clock,
            &cancel,
            move |c, now| {
                let claim_token = claim_token.clone();
                Box::pin(async move {
                    let claim = sqlx::query(q.get("claim"))
                        .bind(claim_token.as_str())
                        .bind(now + lease_ms)
                        .bind(generation)
                        .bind(now)
                        .bind(now)
                        .bind(now)
                        .bind(limit);
                    let rows =
                        family::claim_rows(c, dialect, claim, q.get("claimed"), &claim_token)
                            .await?;
                    rows.iter().map(decode_claimed).collect()
                })
            },
        )
        .await?;
        inner
            .faults
            .hit(CrashPoint::AfterClaim)
            .map_err(SourceError::new)?;
        jobs.sort_by_key(|j| j.id);
        let attempts: Vec<BulkAttempt> = jobs
            .into_iter()
            .map(|job| BulkAttempt {
                bulk: self.bulk.clone(),
                job,
                token: token.clone(),
            })
            .collect();
        Ok(family::batch(attempts, capacity))
    }

    async fn next_work_at(
        &self,
        cancel: CancellationToken,
    ) -> Result<Option<SystemTime>, SourceError> {
        let db = &self.bulk.inner.db;
        let q = queries(db.dialect());
        family::next_work_at(
            db,
            &cancel,
            &[q.get("next_run_at"), q.get("next_lease_expiry")],
        )
        .await
    }

    async fn generation(
        &self,
        cancel: CancellationToken,
    ) -> Result<Option<Generation>, SourceError> {
        family::generation(&self.bulk.inner.probe, &cancel, || self.max_id()).await
    }

    async fn generation_changed(
        &self,
        seen: Generation,
        cancel: CancellationToken,
    ) -> Result<Generation, SourceError> {
        family::generation_changed(&self.bulk.inner.probe, seen, &cancel, || self.max_id()).await
    }
}

/// One claimed Bulk job: segments until done, heartbeating between them.
#[derive(Debug)]
pub struct BulkAttempt {
    bulk: Bulk,
    job: Claimed,
    token: String,
}

enum Segment {
    Lost,
    Progress {
        cursor: i64,
        done: bool,
        /// Rows this segment applied and rejected.
        applied: u64,
        rejected: u64,
    },
}

fn crash(e: nexuscrm_worker::fault::Crash) -> AttemptError {
    AttemptError::new(e)
}

impl BulkAttempt {
    /// Ends the claim: back to pending (after `delay`), or poisoned. `refund` gives the attempt
    /// back (a graceful release is not a failed attempt).
    async fn release(
        &self,
        state: &'static str,
        delay: Duration,
        refund: bool,
        error: Option<String>,
    ) -> Result<(), AttemptError> {
        let inner = &self.bulk.inner;
        let db = inner.db.clone();
        let fence = inner.fence.clone();
        let q = queries(db.dialect());
        let clock = inner.clock.clone();
        let delay_ms = delay.as_millis() as i64;
        let (id, token) = (self.job.id, self.token.clone());
        let never = CancellationToken::new();
        inner
            .db
            .write(&never, move |c| {
                Box::pin(async move {
                    if !fence.holds(c, &db).await? {
                        return Ok(());
                    }
                    let now = to_ms(clock.now());
                    let run_at = now + delay_ms;
                    sqlx::query(q.get("release"))
                        .bind(state)
                        .bind(run_at)
                        .bind(i64::from(refund))
                        .bind(i64::from(refund))
                        .bind(error)
                        .bind(now)
                        .bind(id)
                        .bind(token.as_str())
                        .execute(&mut *c)
                        .await?;
                    Ok(())
                })
            })
            .await
            .map_err(|e| {
                family::attempt_error(format!("releasing bulk job {id} failed: {e}"), &e)
            })?;
        // The schedule changed (the job is claimable now or at its backoff): attempt completion
        // alone never causes a claim, so offer the controller a claim turn.
        if let Some(w) = inner.waker.get() {
            w.wake();
        }
        Ok(())
    }

    async fn heartbeat(&self) -> Result<bool, WriteError> {
        let inner = &self.bulk.inner;
        let db = inner.db.clone();
        let dialect = db.dialect();
        let fence = inner.fence.clone();
        let q = queries(db.dialect());
        let clock = inner.clock.clone();
        let lease_ms = inner.cfg.lease.as_millis() as i64;
        let (id, token) = (self.job.id, self.token.clone());
        let never = CancellationToken::new();
        inner
            .db
            .write(&never, move |c| {
                Box::pin(async move {
                    if !fence.holds(c, &db).await? {
                        return Ok(false);
                    }
                    let now = to_ms(clock.now());
                    let lease_until = now + lease_ms;
                    let heartbeat = sqlx::query(q.get("heartbeat"))
                        .bind(lease_until)
                        .bind(now)
                        .bind(id)
                        .bind(token.as_str());
                    // PostgreSQL reuses $2 for the expiry check; the others bind it again.
                    let heartbeat = if dialect == Dialect::Postgres {
                        heartbeat
                    } else {
                        heartbeat.bind(now)
                    };
                    let r = heartbeat.execute(&mut *c).await?;
                    Ok(r.rows_affected() == 1)
                })
            })
            .await
    }

    /// One segment transaction (rows applied, cursor advanced, the job's disposition when it
    /// is the last), in a `disposition` span with the job and generation.
    async fn segment(&self, cancel: &CancellationToken) -> Result<Segment, WriteError> {
        tracing::Instrument::instrument(
            self.segment_inner(cancel),
            tracing::info_span!(
                "disposition",
                family = "bulk",
                item = self.job.id,
                generation = self.bulk.inner.fence.generation()
            ),
        )
        .await
    }

    async fn segment_inner(&self, cancel: &CancellationToken) -> Result<Segment, WriteError> {
        let inner = &self.bulk.inner;
        let db = inner.db.clone();
        let fence = inner.fence.clone();
        let dialect = db.dialect();
        let q = queries(dialect);
        let lease_ms = inner.cfg.lease.as_millis() as i64;
        let clock = inner.clock.clone();
        let audit = inner.cfg.audit;
        let (id, token) = (self.job.id, self.token.clone());
        inner
            .db
            .write(cancel, move |c| {
                Box::pin(async move {
                    if !fence.holds(c, &db).await? {
                        return Ok(Segment::Lost);
                    }
                    // "Now" once the transaction holds its locks (and anew on every retry).
                    let now = to_ms(clock.now());
                    let Some(job) = sqlx::query(q.get("job_for_segment"))
                        .bind(id)
                        .bind(token.as_str())
                        .bind(now)
                        .fetch_optional(&mut *c)
                        .await?
                    else {
                        return Ok(Segment::Lost);
                    };
                    let cursor: i64 = job.try_get(0)?;
                    let total: i64 = job.try_get(1)?;
                    let size: i64 = job.try_get(2)?;
                    let mut applied: i64 = job.try_get(3)?;
                    let mut rejected: i64 = job.try_get(4)?;
                    let before = (applied, rejected);
                    let rows = sqlx::query(q.get("segment_rows"))
                        .bind(id)
                        .bind(cursor)
                        .bind(size)
                        .fetch_all(&mut *c)
                        .await?;
                    let mut next = cursor;
                    let mut valid: Vec<(i64, String, String)> = Vec::with_capacity(rows.len());
                    for row in &rows {
                        let ordinal: i64 = row.try_get(0)?;
                        let key = text(row, 1)?;
                        let fields = text(row, 2)?;
                        next = ordinal + 1;
                        // Stored fields that do not parse as a JSON object are a row-level
                        // rejection with its reason, never a silent write of `{}`.
                        let problem = match serde_json::from_str::<Map<String, Value>>(&fields) {
                            Ok(parsed) => row_problem(&parsed),
                            Err(e) => Some(format!(
                                "stored fields are not a JSON object ({e}); the row was not \
                                 applied"
                            )),
                        };
                        if let Some(problem) = problem {
                            sqlx::query(q.get("row_error_insert"))
                                .bind(id)
                                .bind(ordinal)
                                .bind(problem)
                                .execute(&mut *c)
                                .await?;
                            rejected += 1;
                        } else {
                            valid.push((ordinal, key, fields));
                        }
                    }
                    applied += apply_rows(c, dialect, q, id, &valid, now, audit).await?;
                    let done = next >= total || rows.is_empty();
                    // The renewed lease counts from the commit, not from the segment's start.
                    let lease_until = to_ms(clock.now()) + lease_ms;
                    let state = if done { "succeeded" } else { "running" };
                    let keep_token: Option<&str> = if done { None } else { Some(token.as_str()) };
                    let r = sqlx::query(q.get("segment_commit"))
                        .bind(next)
                        .bind(applied)
                        .bind(rejected)
                        .bind(lease_until)
                        .bind(state)
                        .bind(keep_token)
                        .bind(now)
                        .bind(id)
                        .bind(token.as_str())
                        .execute(&mut *c)
                        .await?;
                    if r.rows_affected() != 1 {
                        // Roll the segment back: we no longer hold the job.
                        return Err(sqlx::Error::RowNotFound);
                    }
                    Ok(Segment::Progress {
                        cursor: next,
                        done,
                        applied: (applied - before.0).max(0) as u64,
                        rejected: (rejected - before.1).max(0) as u64,
                    })
                })
            })
            .await
    }

    fn backoff(&self) -> Duration {
        let cfg = &self.bulk.inner.cfg;
        let exp = (self.job.stalled.max(1) - 1).min(20) as u32;
        cfg.backoff_base
            .saturating_mul(2u32.saturating_pow(exp))
            .min(cfg.backoff_max)
    }
}

impl BulkAttempt {
    /// The attempt itself; [`Attempt::run`] runs it in its span.
    async fn execute(self, cancel: CancellationToken) -> Result<(), AttemptError> {
        let faults = self.bulk.inner.faults.clone();
        if self.job.stalled > self.job.max_attempts {
            // Every earlier claim in a row ended without committing a segment (its worker
            // died, or the lease ran out): this work cannot make progress.
            let reason = format!(
                "poisoned after {} consecutive claims without progress (max {}); \
                 the job never committed a segment in them",
                self.job.stalled - 1,
                self.job.max_attempts
            );
            return self.poison(reason).await;
        }
        faults.hit(CrashPoint::BeforeEffect).map_err(crash)?;
        let mut cursor = self.job.cursor;
        let mut progressed = false;
        let mut first = true;
        loop {
            if cancel.is_cancelled() {
                return self.release("pending", Duration::ZERO, true, None).await;
            }
            if !first {
                faults.hit(CrashPoint::DuringHeartbeat).map_err(crash)?;
                match retrying(&cancel, || self.heartbeat()).await {
                    Ok(true) => {}
                    Ok(false) => {
                        faults.hit(CrashPoint::LeaseExpiry).map_err(crash)?;
                        return Ok(()); // Lost the lease: the new holder owns the job.
                    }
                    Err(e) => {
                        return self
                            .transient(format!("heartbeat failed: {e}"), progressed)
                            .await;
                    }
                }
            }
            first = false;
            // The segment that will complete the job carries its disposition.
            if cursor + self.job.segment_size >= self.job.total {
                faults.hit(CrashPoint::BeforeDisposition).map_err(crash)?;
            }
            let seg = retrying(&cancel, || self.segment(&cancel)).await;
            match seg {
                Ok(Segment::Lost) => {
                    faults.hit(CrashPoint::LeaseExpiry).map_err(crash)?;
                    return Ok(());
                }
                Ok(Segment::Progress {
                    cursor: next,
                    done,
                    applied,
                    rejected,
                }) => {
                    cursor = next;
                    progressed = true;
                    self.bulk.records_changed().await;
                    self.bulk.segment_committed(SegmentCommitted {
                        job: JobId(self.job.id),
                        applied,
                        rejected,
                    });
                    faults.hit(CrashPoint::AfterEffect).map_err(crash)?;
                    if done {
                        faults.hit(CrashPoint::AfterDisposition).map_err(crash)?;
                        return Ok(());
                    }
                }
                Err(WriteError::Cancelled) => {
                    return self.release("pending", Duration::ZERO, true, None).await;
                }
                Err(WriteError::NotCommitted(sqlx::Error::RowNotFound)) => return Ok(()),
                Err(e) => {
                    return self
                        .transient(format!("segment failed: {e}"), progressed)
                        .await;
                }
            }
        }
    }
}

impl Attempt for BulkAttempt {
    async fn run(self, cancel: CancellationToken) -> Result<(), AttemptError> {
        let span = tracing::info_span!(
            "bulk.job",
            item = self.job.id,
            generation = self.bulk.inner.fence.generation()
        );
        tracing::Instrument::instrument(self.execute(cancel), span).await
    }
}

impl BulkAttempt {
    /// A transient failure: retry later with backoff, or poison when this claim is the last of
    /// `max_attempts` in a row without progress (a claim that committed a segment never
    /// poisons). If even that cannot be written, fail stop (the lease will return the job).
    async fn transient(&self, error: String, progressed: bool) -> Result<(), AttemptError> {
        if !progressed && self.job.stalled >= self.job.max_attempts {
            let reason = format!(
                "poisoned after {} consecutive claims without progress; last error: {error}",
                self.job.stalled
            );
            self.poison(reason).await
        } else {
            self.release("pending", self.backoff(), false, Some(error))
                .await
        }
    }

    /// Poisons the job with `reason`, logged at WARN: an operator's `bulk retry` undoes it.
    async fn poison(&self, reason: String) -> Result<(), AttemptError> {
        self.release("poisoned", Duration::ZERO, false, Some(reason.clone()))
            .await?;
        tracing::warn!(
            job = self.job.id,
            claims = self.job.attempts,
            cursor = self.job.cursor,
            total = self.job.total,
            reason = %reason,
            "bulk job poisoned; `bulk retry {}` runs it again once the cause is fixed",
            self.job.id
        );
        Ok(())
    }
}
