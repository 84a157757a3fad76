//! The Scheduled Flow [`Source`] and [`Attempt`].

use std::num::NonZeroUsize;
use std::time::{Duration, SystemTime};

use nexuscrm_persistence::family::{self, attempt_error};
use nexuscrm_persistence::sqlx::{self, Row};
use nexuscrm_persistence::support::{from_ms, new_token, retrying, text, to_ms};
use nexuscrm_persistence::{Dialect, WriteError};
use nexuscrm_worker::fault::CrashPoint;
use nexuscrm_worker::{Attempt, AttemptError, ClaimBatch, Generation, Source, SourceError};
use tokio_util::sync::CancellationToken;

use crate::spec::{MisfirePolicy, Spec, plan, timing};
use crate::store::{Flow, RunsReserved, ScheduleId, queries};

/// The Scheduled Flow family's [`Source`]: claims due schedules (and schedules whose lease
/// expired) with a claim token; `next_work_at` is the earliest cursor of an enabled schedule or
/// the earliest lease expiry (two indexed reads); reconciliation releases schedules leased by
/// older generations.
#[derive(Debug, Clone)]
pub struct FlowSource {
    pub(crate) flow: Flow,
}

impl FlowSource {
    /// The claim transaction on SQLite and the MySQL dialect: the fence read
    /// ([`family::fenced`]), then the claim statement. The claimed `(id, version)`s.
    async fn claim_after_fence_read(
        &self,
        token: &str,
        limit: i64,
        cancel: &CancellationToken,
    ) -> Result<Vec<(i64, i64)>, SourceError> {
        let inner = &self.flow.inner;
        let dialect = inner.db.dialect();
        let q = queries(dialect);
        let lease_ms = inner.cfg.lease.as_millis() as i64;
        let generation = inner.fence.generation();
        let claim_token = token.to_owned();
        family::fenced(
            &inner.db,
            &inner.fence,
            &inner.clock,
            cancel,
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
                    rows.iter()
                        .map(|r| Ok((r.try_get::<i64, _>(0)?, r.try_get::<i64, _>(1)?)))
                        .collect()
                })
            },
        )
        .await
    }

    /// The claim transaction on PostgreSQL: the fence read folded into the claim statement
    /// (`claim_fenced`), so the transaction is `BEGIN`, one statement and `COMMIT`, a round
    /// trip fewer than [`claim_after_fence_read`](Self::claim_after_fence_read), with the same
    /// lock held to the same commit. Lock contention is retried as there.
    async fn claim_fence_folded(
        &self,
        token: &str,
        limit: i64,
        cancel: &CancellationToken,
    ) -> Result<Vec<(i64, i64)>, SourceError> {
        let inner = &self.flow.inner;
        let q = queries(Dialect::Postgres);
        let lease_ms = inner.cfg.lease.as_millis() as i64;
        let generation = inner.fence.generation();
        let ours = retrying(cancel, || {
            let (token, clock) = (token.to_owned(), inner.clock.clone());
            let (family, stripe) = (
                inner.fence.family().to_owned(),
                inner.fence.stripe(&inner.db),
            );
            inner.db.write(cancel, move |c| {
                Box::pin(async move {
                    let now = to_ms(clock.now());
                    let rows = sqlx::query(q.get("claim_fenced"))
                        .bind(token.as_str())
                        .bind(now + lease_ms)
                        .bind(generation)
                        .bind(now)
                        .bind(now)
                        .bind(now)
                        .bind(limit)
                        .bind(family.as_str())
                        .bind(stripe)
                        .fetch_all(&mut *c)
                        .await?;
                    let mut claimed = Vec::with_capacity(rows.len());
                    let mut ours = false;
                    for r in &rows {
                        ours = r.try_get::<i64, _>(0)? == generation;
                        let id: Option<i64> = r.try_get(1)?;
                        let version: Option<i64> = r.try_get(2)?;
                        if let (Some(id), Some(version)) = (id, version) {
                            claimed.push((id, version));
                        }
                    }
                    // Fenced out: the statement claimed nothing (its UPDATE is gated on the
                    // generation), and nothing else ran.
                    Ok(ours.then_some(claimed))
                })
            })
        })
        .await
        .map_err(family::source_error)?;
        ours.ok_or_else(|| family::superseded(inner.fence.family(), generation))
    }

    /// The family handle.
    #[must_use]
    pub fn flow(&self) -> &Flow {
        &self.flow
    }

    async fn probe(&self) -> Result<u64, sqlx::Error> {
        read_generation(&self.flow.inner.db).await
    }
}

/// The polled generation cursor: both parts only grow (a new schedule raises `MAX(id)`, an
/// update or resume `MAX(defined_at)`); two index reads.
async fn read_generation(db: &nexuscrm_persistence::Db) -> Result<u64, sqlx::Error> {
    let q = queries(db.dialect());
    let row = sqlx::query(q.get("generation"))
        .fetch_one(db.pool())
        .await?;
    let id: Option<i64> = row.try_get(0)?;
    let defined: Option<i64> = row.try_get(1)?;
    // The fence's generation grows when a newer deployment takes over: a fenced-out replica
    // then reconciles, learns it is superseded and stops.
    let owner: Option<i64> = row.try_get(2)?;
    let (id, defined) = (id.unwrap_or(0) as u64, defined.unwrap_or(0) as u64);
    let owner = owner.unwrap_or(0) as u64;
    // The work signal: changes for every defined, updated or resumed schedule whatever its id
    // (see `GenerationProbe::signal`).
    let signal: Option<i64> = row.try_get(3)?;
    let signal = (signal.unwrap_or(0) as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    Ok(signal
        .wrapping_add(defined)
        .wrapping_mul(1_000_003)
        .wrapping_add(id)
        .wrapping_add(owner.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
}

impl Source for FlowSource {
    type Attempt = FlowAttempt;

    async fn check_ready(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        tokio::select! {
            biased;
            () = cancel.cancelled() => Err(SourceError::not_committed("cancelled")),
            r = self.probe() => r.map(drop).map_err(|e| {
                SourceError::new(format!("the flow schedule table is not readable: {e}"))
            }),
        }
    }

    async fn reconcile(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        let inner = &self.flow.inner;
        let release = queries(inner.db.dialect()).get("release_older_generations");
        family::release_older_generations(&inner.db, &inner.fence, &inner.clock, &cancel, release)
            .await
    }

    async fn claim(
        &self,
        capacity: NonZeroUsize,
        cancel: CancellationToken,
    ) -> Result<ClaimBatch<FlowAttempt>, SourceError> {
        let inner = &self.flow.inner;
        let token = new_token();
        let limit = capacity.get() as i64;
        let mut schedules = if inner.db.dialect() == Dialect::Postgres {
            self.claim_fence_folded(&token, limit, &cancel).await?
        } else {
            self.claim_after_fence_read(&token, limit, &cancel).await?
        };
        inner
            .faults
            .hit(CrashPoint::AfterClaim)
            .map_err(SourceError::new)?;
        schedules.sort_unstable();
        let attempts: Vec<FlowAttempt> = schedules
            .into_iter()
            .map(|(id, version)| FlowAttempt {
                flow: self.flow.clone(),
                id,
                version,
                token: token.clone(),
            })
            .collect();
        Ok(family::batch(attempts, capacity))
    }

    async fn next_work_at(
        &self,
        cancel: CancellationToken,
    ) -> Result<Option<SystemTime>, SourceError> {
        let db = &self.flow.inner.db;
        let q = queries(db.dialect());
        family::next_work_at(
            db,
            &cancel,
            &[q.get("next_occurrence"), q.get("next_lease_expiry")],
        )
        .await
    }

    async fn generation(
        &self,
        cancel: CancellationToken,
    ) -> Result<Option<Generation>, SourceError> {
        family::generation(&self.flow.inner.probe, &cancel, || self.probe()).await
    }

    async fn generation_changed(
        &self,
        seen: Generation,
        cancel: CancellationToken,
    ) -> Result<Generation, SourceError> {
        family::generation_changed(&self.flow.inner.probe, seen, &cancel, || self.probe()).await
    }
}

/// One claimed schedule: reserves its due occurrences, in chunks when catching up.
#[derive(Debug)]
pub struct FlowAttempt {
    flow: Flow,
    id: i64,
    version: i64,
    token: String,
}

/// What one reservation transaction did.
enum Reserved {
    /// The claim is no longer ours (lease lost, schedule updated, paused or deleted).
    Stale,
    /// Runs inserted and the cursor advanced; `complete` when nothing due is left.
    Progress {
        complete: bool,
        cursor: Option<i64>,
        /// What committed, for the [`Flow::on_runs_reserved`] hooks (`None` when none is
        /// registered: nothing is built for nobody).
        reserved: Option<RunsReserved>,
    },
}

fn crash(e: nexuscrm_worker::fault::Crash) -> AttemptError {
    AttemptError::new(e)
}

impl FlowAttempt {
    /// The schedule this attempt reserves.
    #[must_use]
    pub fn schedule_id(&self) -> i64 {
        self.id
    }

    /// One reservation transaction: check the token, version, lease and fence; insert the runs
    /// of the plan; advance the cursor; keep the lease if more remain.
    /// [`reserve_inner`](Self::reserve_inner) in a `disposition` span with the schedule and
    /// generation.
    async fn reserve(&self, cancel: &CancellationToken) -> Result<Reserved, WriteError> {
        tracing::Instrument::instrument(
            self.reserve_inner(cancel),
            tracing::info_span!(
                "disposition",
                family = "flow",
                item = self.id,
                generation = self.flow.inner.fence.generation()
            ),
        )
        .await
    }

    async fn reserve_inner(&self, cancel: &CancellationToken) -> Result<Reserved, WriteError> {
        let inner = &self.flow.inner;
        let (db, fence) = (inner.db.clone(), inner.fence.clone());
        let q = queries(db.dialect());
        let grace = inner.cfg.misfire_grace.as_millis() as i64;
        let chunk = inner.cfg.chunk;
        let lease_ms = inner.cfg.lease.as_millis() as i64;
        let clock = inner.clock.clone();
        let (id, version, token) = (self.id, self.version, self.token.clone());
        let hooked = !inner.reserved_hooks.is_empty();
        inner
            .db
            .write(cancel, move |c| {
                Box::pin(async move {
                    let read = if db.dialect() == Dialect::Postgres {
                        // The fence read folded into the schedule's read: a round trip fewer,
                        // the same locks to the same commit. "Now" is read before the locks
                        // are: a cursor that a long lock wait made due by the commit is
                        // claimed again at once (the wake after a complete reservation).
                        let now = to_ms(clock.now());
                        sqlx::query(q.get("reserve_read_fenced"))
                            .bind(id)
                            .bind(token.as_str())
                            .bind(version)
                            .bind(now)
                            .bind(fence.family())
                            .bind(fence.stripe(&db))
                            .bind(fence.generation())
                            .fetch_optional(&mut *c)
                            .await?
                            .map(|row| (row, now))
                    } else {
                        if !fence.holds(c, &db).await? {
                            return Ok(Reserved::Stale);
                        }
                        // "Now" once the transaction holds its locks: a cursor computed from a
                        // time read before a long lock wait could already be due at commit.
                        let now = to_ms(clock.now());
                        sqlx::query(q.get("reserve_read"))
                            .bind(id)
                            .bind(token.as_str())
                            .bind(version)
                            .bind(now)
                            .fetch_optional(&mut *c)
                            .await?
                            .map(|row| (row, now))
                    };
                    let Some((row, now)) = read else {
                        return Ok(Reserved::Stale);
                    };
                    let flow = text(&row, 0)?;
                    let kind = text(&row, 1)?;
                    let spec = if kind == "cron" {
                        Spec::cron(text(&row, 2)?, text(&row, 3)?)
                    } else {
                        let ms: i64 = row.try_get(4)?;
                        Spec::Every(Duration::from_millis(ms.max(0) as u64))
                    };
                    let anchor: i64 = row.try_get(5)?;
                    let max: i64 = row.try_get(7)?;
                    let policy = MisfirePolicy::parse(&text(&row, 6)?, max.max(0) as u32)
                        .map_err(|e| sqlx::Error::Decode(e.into()))?;
                    let cursor: Option<i64> = row.try_get(8)?;
                    let timing =
                        timing(&spec, anchor).map_err(|e| sqlx::Error::Decode(e.into()))?;
                    let p = match cursor {
                        Some(cursor) => plan(&timing, policy, cursor, now, grace, chunk),
                        None => crate::spec::Plan {
                            runs: Vec::new(),
                            cursor: None,
                            complete: true,
                        },
                    };
                    let reserved_clock = clock.now();
                    let reserved_at = to_ms(reserved_clock);
                    for &occurrence in &p.runs {
                        // Unique on (schedule_id, occurrence_at): a second reservation of one
                        // occurrence fails here and rolls back, it is never hidden.
                        sqlx::query(q.get("run_insert"))
                            .bind(id)
                            .bind(flow.as_str())
                            .bind(occurrence)
                            .bind(reserved_at)
                            .bind(version)
                            .bind(fence.generation())
                            .execute(&mut *c)
                            .await?;
                    }
                    let (state, keep_token, lease) = if p.complete {
                        ("active", None, None)
                    } else {
                        ("leased", Some(token.as_str()), Some(reserved_at + lease_ms))
                    };
                    let r = sqlx::query(q.get("reserve_commit"))
                        .bind(p.cursor)
                        .bind(p.runs.last().copied())
                        .bind(p.runs.len() as i64)
                        .bind(state)
                        .bind(keep_token)
                        .bind(lease)
                        .bind(reserved_at)
                        .bind(id)
                        .bind(token.as_str())
                        .bind(version)
                        .execute(&mut *c)
                        .await?;
                    if r.rows_affected() != 1 {
                        return Err(sqlx::Error::RowNotFound); // Roll back: no longer ours.
                    }
                    Ok(Reserved::Progress {
                        complete: p.complete,
                        cursor: p.cursor,
                        reserved: hooked.then(|| RunsReserved {
                            schedule: ScheduleId(id),
                            flow,
                            occurrences: p.runs.iter().map(|&o| from_ms(o)).collect(),
                            reserved_at: reserved_clock,
                        }),
                    })
                })
            })
            .await
    }

    async fn heartbeat(&self) -> Result<bool, WriteError> {
        let inner = &self.flow.inner;
        let (db, fence) = (inner.db.clone(), inner.fence.clone());
        let q = queries(db.dialect());
        let now = inner.now_ms();
        let lease_until = now + inner.cfg.lease.as_millis() as i64;
        let (id, version, token) = (self.id, self.version, self.token.clone());
        inner
            .db
            .write(&CancellationToken::new(), move |c| {
                Box::pin(async move {
                    if !fence.holds(c, &db).await? {
                        return Ok(false);
                    }
                    let r = sqlx::query(q.get("heartbeat"))
                        .bind(lease_until)
                        .bind(now)
                        .bind(id)
                        .bind(token.as_str())
                        .bind(version)
                        .bind(now)
                        .execute(&mut *c)
                        .await?;
                    Ok(r.rows_affected() == 1)
                })
            })
            .await
    }

    /// A reservation or heartbeat rolled back: give the claim up until `retry_backoff` from
    /// now (the lease-expiry half of the claim takes it again then), instead of a hot retry.
    async fn defer(&self, error: &WriteError) -> Result<(), AttemptError> {
        let inner = &self.flow.inner;
        let (db, fence) = (inner.db.clone(), inner.fence.clone());
        let q = queries(db.dialect());
        let now = inner.now_ms();
        let until = now + inner.cfg.retry_backoff.as_millis() as i64;
        let (id, token) = (self.id, self.token.clone());
        inner
            .db
            .write(&CancellationToken::new(), move |c| {
                Box::pin(async move {
                    if fence.holds(c, &db).await? {
                        sqlx::query(q.get("defer"))
                            .bind(until)
                            .bind(now)
                            .bind(id)
                            .bind(token.as_str())
                            .execute(&mut *c)
                            .await?;
                    }
                    Ok(())
                })
            })
            .await
            .map_err(|e| {
                attempt_error(
                    format!("schedule {id}: {error}; deferring the claim failed too: {e}"),
                    &e,
                )
            })?;
        if let Some(w) = inner.waker.get() {
            w.wake();
        }
        Ok(())
    }

    /// Gives the claim back (cancelled before finishing): the schedule is claimable at once.
    async fn release(&self) -> Result<(), AttemptError> {
        let inner = &self.flow.inner;
        let (db, fence) = (inner.db.clone(), inner.fence.clone());
        let q = queries(db.dialect());
        let now = inner.now_ms();
        let (id, token) = (self.id, self.token.clone());
        inner
            .db
            .write(&CancellationToken::new(), move |c| {
                Box::pin(async move {
                    if fence.holds(c, &db).await? {
                        sqlx::query(q.get("release"))
                            .bind(now)
                            .bind(id)
                            .bind(token.as_str())
                            .execute(&mut *c)
                            .await?;
                    }
                    Ok(())
                })
            })
            .await
            .map_err(|e| attempt_error(format!("releasing schedule {id} failed: {e}"), &e))?;
        if let Some(w) = inner.waker.get() {
            w.wake();
        }
        Ok(())
    }
}

impl FlowAttempt {
    /// The attempt itself; [`Attempt::run`] runs it in its span.
    async fn execute(self, cancel: CancellationToken) -> Result<(), AttemptError> {
        let faults = self.flow.inner.faults.clone();
        faults.hit(CrashPoint::BeforeEffect).map_err(crash)?;
        let mut first = true;
        loop {
            if cancel.is_cancelled() {
                return self.release().await;
            }
            if !first {
                faults.hit(CrashPoint::DuringHeartbeat).map_err(crash)?;
                match retrying(&cancel, || self.heartbeat()).await {
                    Ok(true) => {}
                    Ok(false) => {
                        faults.hit(CrashPoint::LeaseExpiry).map_err(crash)?;
                        return Ok(()); // Lost the lease: the new holder reserves.
                    }
                    Err(WriteError::Cancelled) => return self.release().await,
                    Err(e) if e.is_not_committed() => return self.defer(&e).await,
                    Err(e) => {
                        // Ambiguous: fail stop (the lease returns the schedule).
                        return Err(AttemptError::new(format!(
                            "schedule {}: heartbeat outcome unknown: {e}",
                            self.id
                        )));
                    }
                }
            }
            first = false;
            // The reservation commits runs and cursor together: effect and disposition are one.
            faults.hit(CrashPoint::BeforeDisposition).map_err(crash)?;
            match retrying(&cancel, || self.reserve(&cancel)).await {
                Ok(Reserved::Stale) | Err(WriteError::NotCommitted(sqlx::Error::RowNotFound)) => {
                    faults.hit(CrashPoint::LeaseExpiry).map_err(crash)?;
                    return Ok(());
                }
                Ok(Reserved::Progress {
                    complete,
                    cursor,
                    reserved,
                }) => {
                    if let Some(reserved) = &reserved {
                        self.flow.runs_reserved(reserved);
                    }
                    faults.hit(CrashPoint::AfterEffect).map_err(crash)?;
                    if complete {
                        // The cursor moved: the controller re-reads next_work_at (no claim),
                        // so it sleeps exactly until this schedule's next occurrence; if that
                        // is already due (a commit slower than the interval), it claims.
                        if let Some(w) = self.flow.inner.waker.get() {
                            match cursor {
                                Some(t) if t <= self.flow.inner.now_ms() => w.wake(),
                                _ => w.retime(),
                            }
                        }
                        faults.hit(CrashPoint::AfterDisposition).map_err(crash)?;
                        return Ok(());
                    }
                }
                Err(WriteError::Cancelled) => return self.release().await,
                Err(e) if e.is_not_committed() => return self.defer(&e).await,
                Err(e) => {
                    // The commit's answer was lost: fail stop rather than guess (a restart
                    // re-reads the cursor; the unique run key makes the retry exact).
                    return Err(AttemptError::new(format!(
                        "schedule {}: reservation outcome unknown: {e}",
                        self.id
                    )));
                }
            }
        }
    }
}

impl Attempt for FlowAttempt {
    async fn run(self, cancel: CancellationToken) -> Result<(), AttemptError> {
        let span = tracing::info_span!(
            "flow.schedule",
            item = self.id,
            generation = self.flow.inner.fence.generation()
        );
        tracing::Instrument::instrument(self.execute(cancel), span).await
    }
}
