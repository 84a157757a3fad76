//! The Paused Flow [`Source`] and [`Attempt`]: claims resumable (and timed-out) pauses under the
//! ownership fence with a claim token and lease, commits an effect intent before the request
//! leaves, heartbeats while it runs, and completes with one fenced transaction. A pause whose
//! lease expired (or whose owner was fenced out) after its intent was committed is quarantined
//! as `uncertain`, never resent.

use std::num::NonZeroUsize;
use std::time::{Duration, SystemTime};

use nexuscrm_persistence::WriteError;
use nexuscrm_persistence::family;
use nexuscrm_persistence::sqlx::{self, Row};
use nexuscrm_persistence::support::{new_token, retrying, text, to_ms};
use nexuscrm_worker::fault::CrashPoint;
use nexuscrm_worker::{Attempt, AttemptError, ClaimBatch, Generation, Source, SourceError};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::connector::EffectOutcome;
use crate::{PauseError, PauseErrorKind, PauseStatus, PausedFlow, json_at, queries};

/// The evidence a quarantine by recovery records.
fn recovery_evidence(why: &str) -> String {
    json!({
        "error": why,
        "quarantined_by": "recovery",
    })
    .to_string()
}

/// A write error for an attempt, with the write's own message.
fn attempt_error(e: WriteError) -> AttemptError {
    family::attempt_error(e.to_string(), &e)
}

/// The Paused Flow family's [`Source`].
#[derive(Debug, Clone)]
pub struct PausedSource {
    pub(crate) store: PausedFlow,
}

/// Where recovery puts a pause whose request may have left: `observing` when the receiver
/// can be asked (the next claim asks it), `uncertain` otherwise.
fn quarantine_state(store: &PausedFlow) -> &'static str {
    match &store.worker.connector {
        Some(c) if c.is_observable() => "observing",
        _ => "uncertain",
    }
}

impl PausedSource {
    /// The store.
    #[must_use]
    pub fn store(&self) -> &PausedFlow {
        &self.store
    }

    async fn read_generation(&self) -> Result<u64, sqlx::Error> {
        let db = &self.store.db;
        let row = sqlx::query(queries(db.dialect()).get("generation"))
            .fetch_one(db.pool())
            .await?;
        // Each part only grows: a new pause, a resume, an operator's resolution.
        let id: Option<i64> = row.try_get(0)?;
        let resumed: Option<i64> = row.try_get(1)?;
        let resolved: Option<i64> = row.try_get(2)?;
        // The work signal: changes for every signalled commit whatever its id (see
        // `GenerationProbe::signal`).
        let signal: Option<i64> = row.try_get(3)?;
        let signal = (signal.unwrap_or(0) as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        Ok(signal
            .wrapping_add(resumed.unwrap_or(0) as u64)
            .wrapping_mul(1_000_003)
            .wrapping_add(id.unwrap_or(0) as u64)
            .wrapping_add((resolved.unwrap_or(0) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)))
    }

    /// Timeouts, then recovery of expired leases, in the caller's transaction: an expired
    /// lease with a committed intent becomes `uncertain`, one without returns to its queue.
    async fn sweep(
        c: &mut sqlx::AnyConnection,
        q: &'static nexuscrm_persistence::Queries,
        now: i64,
        quarantine: &'static str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(q.get("time_out"))
            .bind(now)
            .bind(now)
            .execute(&mut *c)
            .await?;
        sqlx::query(q.get("quarantine_expired"))
            .bind(quarantine)
            .bind(recovery_evidence(
                "the lease expired after the effect intent was committed: the request may \
                 have been sent",
            ))
            .bind(now)
            .bind(now)
            .execute(&mut *c)
            .await?;
        sqlx::query(q.get("release_expired"))
            .bind(now)
            .bind(now)
            .execute(&mut *c)
            .await?;
        Ok(())
    }
}

impl Source for PausedSource {
    type Attempt = PausedAttempt;

    async fn check_ready(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        tokio::select! {
            biased;
            () = cancel.cancelled() => Err(SourceError::not_committed("cancelled")),
            r = self.read_generation() => r.map(drop).map_err(|e| {
                SourceError::new(format!("the paused_step table is not readable: {e}"))
            }),
        }
    }

    async fn reconcile(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        let store = &self.store;
        let q = queries(store.db.dialect());
        let quarantine = quarantine_state(store);
        let generation = store.worker.fence.generation();
        family::fenced(
            &store.db,
            &store.worker.fence,
            &store.clock,
            &cancel,
            move |c, now| {
                Box::pin(async move {
                    PausedSource::sweep(c, q, now, quarantine).await?;
                    // A takeover: an older generation's effect with an intent may be in flight,
                    // so it is quarantined, never released as if nothing was sent.
                    sqlx::query(q.get("quarantine_older"))
                        .bind(quarantine)
                        .bind(recovery_evidence(
                            "a newer generation took over after the effect intent was committed: \
                         the request may have been sent",
                        ))
                        .bind(now)
                        .bind(generation)
                        .execute(&mut *c)
                        .await?;
                    sqlx::query(q.get("release_older"))
                        .bind(now)
                        .bind(generation)
                        .execute(&mut *c)
                        .await?;
                    Ok(())
                })
            },
        )
        .await
    }

    async fn claim(
        &self,
        capacity: NonZeroUsize,
        cancel: CancellationToken,
    ) -> Result<ClaimBatch<PausedAttempt>, SourceError> {
        let store = &self.store;
        if store.worker.connector.is_none() {
            // No connector configured: nothing can be sent, so nothing is claimed.
            return Ok(ClaimBatch::empty());
        }
        let dialect = store.db.dialect();
        let q = queries(dialect);
        let token = new_token();
        let lease_ms = store.worker.lease.as_millis() as i64;
        let limit = capacity.get() as i64;
        let quarantine = quarantine_state(store);
        let generation = store.worker.fence.generation();
        let claim_token = token.clone();
        let claimed: Vec<Claimed> = family::fenced(
            &store.db,
            &store.worker.fence,
            &store.clock,
            &cancel,
            move |c, now| {
                let claim_token = claim_token.clone();
                Box::pin(async move {
                    PausedSource::sweep(c, q, now, quarantine).await?;
                    let ids: Vec<i64> = sqlx::query_scalar(q.get("eligible"))
                        .bind(now)
                        .bind(limit)
                        .fetch_all(&mut *c)
                        .await?;
                    for id in &ids {
                        sqlx::query(q.get("lease"))
                            .bind(claim_token.as_str())
                            .bind(now + lease_ms)
                            .bind(generation)
                            .bind(now)
                            .bind(*id)
                            .execute(&mut *c)
                            .await?;
                    }
                    let rows = sqlx::query(q.get("claimed"))
                        .bind(claim_token.as_str())
                        .fetch_all(&mut *c)
                        .await?;
                    rows.iter()
                        .map(|r| {
                            Ok(Claimed {
                                id: r.try_get(0)?,
                                run: text(r, 1)?,
                                step: text(r, 2)?,
                                payload: json_at(r, 3)?,
                                resume_payload: crate::optional_json_at(r, 4)?,
                                effect_key: text(r, 5)?,
                                attempt: r.try_get(6)?,
                                // Claimed with an intent: an `observing` pause, whose request
                                // may have left; it is asked about, never resent.
                                observe: r.try_get::<Option<i64>, _>(7)?.is_some(),
                            })
                        })
                        .collect()
                })
            },
        )
        .await?;
        store
            .worker
            .faults
            .hit(CrashPoint::AfterClaim)
            .map_err(SourceError::new)?;
        let attempts: Vec<PausedAttempt> = claimed
            .into_iter()
            .map(|c| PausedAttempt {
                store: store.clone(),
                token: token.clone(),
                claimed: c,
            })
            .collect();
        Ok(family::batch(attempts, capacity))
    }

    async fn next_work_at(
        &self,
        cancel: CancellationToken,
    ) -> Result<Option<SystemTime>, SourceError> {
        if self.store.worker.connector.is_none() {
            return Ok(None);
        }
        let db = &self.store.db;
        let q = queries(db.dialect());
        let statements = [
            q.get("next_timeout"),
            q.get("next_lease_expiry"),
            q.get("next_available"),
        ];
        family::next_work_at(db, &cancel, &statements).await
    }

    async fn generation(
        &self,
        cancel: CancellationToken,
    ) -> Result<Option<Generation>, SourceError> {
        family::generation(&self.store.worker.probe, &cancel, || self.read_generation()).await
    }

    async fn generation_changed(
        &self,
        seen: Generation,
        cancel: CancellationToken,
    ) -> Result<Generation, SourceError> {
        let probe = &self.store.worker.probe;
        family::generation_changed(probe, seen, &cancel, || self.read_generation()).await
    }
}

#[derive(Debug, Clone)]
struct Claimed {
    id: i64,
    run: String,
    step: String,
    payload: Value,
    resume_payload: Option<Value>,
    effect_key: String,
    attempt: i64,
    observe: bool,
}

/// One claimed pause: its effect, sent at most once per intent.
#[derive(Debug)]
pub struct PausedAttempt {
    store: PausedFlow,
    token: String,
    claimed: Claimed,
}

/// How an attempt ends, in its fenced completion.
#[derive(Clone)]
enum Disposition {
    Finish(&'static str, Value),
    Release(Duration, Value),
    /// Released before anything was sent (a drain): the claim's attempt is given back.
    Unclaim(Value),
}

impl PausedAttempt {
    /// The pause this attempt runs.
    #[must_use]
    pub fn pause_id(&self) -> i64 {
        self.claimed.id
    }

    /// One fenced write on this claim: `Ok(false)` when the lease or the fence is lost (it
    /// wrote nothing).
    /// [`fenced_inner`](Self::fenced_inner) in a `disposition` span with the pause, the
    /// generation and what is written (intent, heartbeat or done).
    async fn fenced(&self, cancel: &CancellationToken, what: Fenced) -> Result<bool, WriteError> {
        let kind = match &what {
            Fenced::Intent => "intent",
            Fenced::Heartbeat => "heartbeat",
            Fenced::Done(_) => "done",
        };
        let span = tracing::info_span!(
            "disposition",
            family = "paused",
            item = self.claimed.id,
            generation = self.store.worker.fence.generation(),
            write = kind
        );
        tracing::Instrument::instrument(self.fenced_inner(cancel, what), span).await
    }

    async fn fenced_inner(
        &self,
        cancel: &CancellationToken,
        what: Fenced,
    ) -> Result<bool, WriteError> {
        let store = &self.store;
        let q = queries(store.db.dialect());
        let id = self.claimed.id;
        let lease_ms = store.worker.lease.as_millis() as i64;
        // Lock contention (a deadlock, a serialization failure) is a proven rollback: retried,
        // so a busy store never turns a finished effect into an expired lease (and then into
        // an uncertain pause).
        retrying(cancel, || {
            let (db, fence, clock) = (
                store.db.clone(),
                store.worker.fence.clone(),
                store.clock.clone(),
            );
            let (token, what) = (self.token.clone(), what.clone());
            store.db.write(cancel, move |c| {
                Box::pin(async move {
                    if !fence.holds(c, &db).await? {
                        return Ok(false);
                    }
                    let now = to_ms(clock.now());
                    let n = match what {
                        Fenced::Intent => {
                            sqlx::query(q.get("intent"))
                                .bind(now)
                                .bind(now)
                                .bind(id)
                                .bind(token.as_str())
                                .bind(now)
                                .execute(&mut *c)
                                .await?
                        }
                        Fenced::Heartbeat => {
                            sqlx::query(q.get("heartbeat"))
                                .bind(now + lease_ms)
                                .bind(now)
                                .bind(id)
                                .bind(token.as_str())
                                .bind(now)
                                .execute(&mut *c)
                                .await?
                        }
                        Fenced::Done(Disposition::Finish(state, outcome)) => {
                            sqlx::query(q.get("finish"))
                                .bind(state)
                                .bind(outcome.to_string())
                                .bind(now)
                                .bind(now)
                                .bind(id)
                                .bind(token.as_str())
                                .bind(now)
                                .execute(&mut *c)
                                .await?
                        }
                        Fenced::Done(Disposition::Unclaim(outcome)) => {
                            sqlx::query(q.get("release_unclaimed"))
                                .bind(now)
                                .bind(outcome.to_string())
                                .bind(now)
                                .bind(id)
                                .bind(token.as_str())
                                .bind(now)
                                .execute(&mut *c)
                                .await?
                        }
                        Fenced::Done(Disposition::Release(after, outcome)) => {
                            sqlx::query(q.get("release"))
                                .bind(now + after.as_millis() as i64)
                                .bind(outcome.to_string())
                                .bind(now)
                                .bind(id)
                                .bind(token.as_str())
                                .bind(now)
                                .execute(&mut *c)
                                .await?
                        }
                    };
                    Ok(n.rows_affected() == 1)
                })
            })
        })
        .await
    }
}

#[derive(Clone)]
enum Fenced {
    /// Records the intent to send.
    Intent,
    Heartbeat,
    Done(Disposition),
}

impl PausedAttempt {
    /// Recovery of an `observing` pause: its request may have left before a crash or lease
    /// expiry, and the receiver can say whether it applied it. Applied: completed. Not
    /// applied: released to be sent again with the same key. The receiver cannot say:
    /// `uncertain`, for a person.
    async fn observe(&self, connector: &crate::Connector) -> Result<(), AttemptError> {
        let disposition = match connector.observe(&self.claimed.effect_key).await {
            Ok(true) => Disposition::Finish(
                "completed",
                json!({"observed": true, "applied": true, "by": "recovery"}),
            ),
            Ok(false) => Disposition::Release(
                Duration::ZERO,
                json!({"observed": true, "applied": false, "by": "recovery"}),
            ),
            Err(e) => Disposition::Finish(
                "uncertain",
                json!({
                    "error": format!("the request may have been sent, and the observation could not say: {e}"),
                    "quarantined_by": "recovery",
                }),
            ),
        };
        self.fenced(&CancellationToken::new(), Fenced::Done(disposition))
            .await
            .map_err(attempt_error)?;
        Ok(())
    }
}

impl PausedAttempt {
    /// The attempt itself; [`Attempt::run`] runs it in its span.
    async fn execute(self, cancel: CancellationToken) -> Result<(), AttemptError> {
        let store = self.store.clone();
        let faults = &store.worker.faults;
        let Some(connector) = store.worker.connector.clone() else {
            return Err(AttemptError::not_committed("no connector configured"));
        };
        if self.claimed.observe {
            return self.observe(&connector).await;
        }
        // The intent commits before any byte leaves: from here on every reader knows a
        // request may have been sent. Cancelled before it (a drain), nothing was sent: the
        // pause is released at once.
        let intent = if cancel.is_cancelled() {
            Err(WriteError::Cancelled)
        } else {
            self.fenced(&cancel, Fenced::Intent).await
        };
        match intent {
            Ok(true) => {}
            Ok(false) => {
                // Lost the lease before anything was sent: the new holder owns the pause.
                faults
                    .hit(CrashPoint::LeaseExpiry)
                    .map_err(AttemptError::new)?;
                return Ok(());
            }
            Err(WriteError::Cancelled) => {
                let release = Disposition::Unclaim(json!({"released": "drain"}));
                self.fenced(&CancellationToken::new(), Fenced::Done(release))
                    .await
                    .map_err(attempt_error)?;
                return Ok(());
            }
            Err(e) => {
                // Nothing was sent. Hand the pause back at once rather than leave it leased
                // until its lease expires (if even that fails, the lease returns it).
                if e.is_not_committed() {
                    let release = Disposition::Release(
                        store.worker.backoff,
                        json!({"not_applied": format!("the effect intent failed: {e}")}),
                    );
                    let _ = self
                        .fenced(&CancellationToken::new(), Fenced::Done(release))
                        .await;
                }
                return Err(attempt_error(e));
            }
        }
        faults
            .hit(CrashPoint::BeforeEffect)
            .map_err(AttemptError::new)?;
        let body = json!({
            "pause": self.claimed.id,
            "run": self.claimed.run,
            "step": self.claimed.step,
            "payload": self.claimed.payload,
            "resume": self.claimed.resume_payload,
            "attempt": self.claimed.attempt,
        });
        // The request is not cancelled by a drain: once it may have left, its answer decides
        // (bounded by the connector's timeout). Heartbeats keep the lease while it runs.
        let beat_every = store.worker.lease / 3;
        let uncancelled = CancellationToken::new();
        let send = connector.send(&self.claimed.effect_key, &body, &uncancelled);
        tokio::pin!(send);
        let outcome = loop {
            tokio::select! {
                o = &mut send => break o,
                () = tokio::time::sleep(beat_every) => {
                    faults.hit(CrashPoint::DuringHeartbeat).map_err(AttemptError::new)?;
                    match self.fenced(&CancellationToken::new(), Fenced::Heartbeat).await {
                        Ok(true) => {}
                        // Lost: the effect is in flight; its completion will be refused and
                        // recovery quarantines the pause.
                        Ok(false) => {}
                        Err(_) => {}
                    }
                }
            }
        };
        faults
            .hit(CrashPoint::AfterEffect)
            .map_err(AttemptError::new)?;
        let disposition = match outcome {
            EffectOutcome::Applied {
                status,
                response,
                observed,
            } => Disposition::Finish(
                "completed",
                json!({"status": status, "response": response, "observed": observed}),
            ),
            EffectOutcome::Rejected { status, response } => Disposition::Finish(
                "poisoned",
                json!({"status": status, "response": response, "rejected": true}),
            ),
            EffectOutcome::NotApplied {
                reason,
                retry_after,
            } => Disposition::Release(
                retry_after.unwrap_or_default().max(store.worker.backoff),
                json!({"not_applied": reason}),
            ),
            EffectOutcome::RetrySafe { evidence } => {
                Disposition::Release(store.worker.backoff, evidence.to_json())
            }
            EffectOutcome::Uncertain { evidence } => {
                Disposition::Finish("uncertain", evidence.to_json())
            }
        };
        faults
            .hit(CrashPoint::BeforeDisposition)
            .map_err(AttemptError::new)?;
        // The fenced completion: 0 rows means the lease was lost, and nothing else is written.
        let done = self
            .fenced(&CancellationToken::new(), Fenced::Done(disposition))
            .await
            .map_err(attempt_error)?;
        if done {
            faults
                .hit(CrashPoint::AfterDisposition)
                .map_err(AttemptError::new)?;
        } else {
            // The lease was lost while the effect ran: recovery quarantines the pause.
            faults
                .hit(CrashPoint::LeaseExpiry)
                .map_err(AttemptError::new)?;
        }
        Ok(())
    }
}

impl Attempt for PausedAttempt {
    async fn run(self, cancel: CancellationToken) -> Result<(), AttemptError> {
        let span = tracing::info_span!(
            "paused.step",
            item = self.claimed.id,
            generation = self.store.worker.fence.generation()
        );
        tracing::Instrument::instrument(self.execute(cancel), span).await
    }
}

/// An operator's decision about an `uncertain` pause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// The effect was applied (checked with the receiver): the step is completed.
    Applied,
    /// The effect was not applied: send it again.
    NotApplied,
    /// Send it again under a new attempt with the same idempotency key (the receiver
    /// dedups, or a person accepts the risk).
    Retry,
}

impl PausedFlow {
    /// Resolves an `uncertain` pause: an explicit operator decision.
    ///
    /// # Errors
    ///
    /// [`PauseErrorKind::NotFound`] for an unknown pause, [`PauseErrorKind::Conflict`] for one
    /// that is not uncertain; database errors as for [`PausedFlow::pause`].
    pub async fn resolve(
        &self,
        id: i64,
        resolution: Resolution,
        actor: &str,
    ) -> Result<PauseStatus, PauseError> {
        let q = queries(self.db.dialect());
        let now = to_ms(self.clock.now());
        let (state, decision) = match resolution {
            Resolution::Applied => ("completed", "applied"),
            Resolution::NotApplied => ("resumable", "not-applied"),
            Resolution::Retry => ("resumable", "retry"),
        };
        let before = self
            .status(id)
            .await?
            .ok_or_else(|| PauseError::new(PauseErrorKind::NotFound, format!("no pause {id}")))?;
        let outcome = json!({
            "resolved": decision,
            "by": actor,
            "at_ms": now,
            "evidence": before.outcome,
        })
        .to_string();
        let finished = (state == "completed").then_some(now);
        let event = self.worker.audit.then(|| {
            nexuscrm_audit::AuditEvent::new(
                format!(
                    "pause-{id}-resolved-{}",
                    nexuscrm_persistence::support::new_token()
                ),
                format!("pause:{id}"),
                "pause.resolved",
                actor,
                json!({
                    "pause": id,
                    "run": before.run,
                    "step": before.step,
                    "decision": decision,
                    "state": state,
                    "evidence": before.outcome,
                }),
            )
            .at(nexuscrm_persistence::support::from_ms(now))
        });
        let dialect = self.db.dialect();
        let never = CancellationToken::new();
        let n = self
            .db
            .write(&never, move |c| {
                let event = event.clone();
                Box::pin(async move {
                    let r = sqlx::query(q.get("resolve"))
                        .bind(state)
                        .bind(now)
                        .bind(outcome)
                        .bind(finished)
                        .bind(now)
                        .bind(now)
                        .bind(id)
                        .execute(&mut *c)
                        .await?;
                    if r.rows_affected() == 1
                        && let Some(event) = event
                    {
                        nexuscrm_audit::record(c, dialect, &[event]).await?;
                    }
                    Ok(r.rows_affected())
                })
            })
            .await
            .map_err(|e| PauseError::write("resolving the pause", e))?;
        if n == 0 {
            return Err(PauseError::new(
                PauseErrorKind::Conflict,
                format!(
                    "pause {id} is {}, not uncertain: only an uncertain pause is resolved",
                    before.state
                ),
            ));
        }
        if let Some(w) = self.worker.waker.get() {
            w.wake();
        }
        self.worker.probe.notify(&self.db).await;
        self.status(id)
            .await?
            .ok_or_else(|| PauseError::new(PauseErrorKind::NotFound, format!("no pause {id}")))
    }

    /// Registers the controller's waker so that a resume or resolution in this process wakes
    /// it after commit.
    pub fn set_waker(&self, waker: nexuscrm_worker::Waker) {
        let _ = self.worker.waker.set(waker);
    }
}
