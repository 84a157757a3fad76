//! The admin HTTP server (loopback only): `/livez`, `/readyz`, `/snapshot`, `/families`,
//! `/metrics`, and
//! `POST /paused/resume` when it is configured (see [`crate::resume`]).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use nexuscrm_bulk::Bulk;
use nexuscrm_flow::Flow;
use nexuscrm_persistence::{Db, sqlx};
use nexuscrm_worker::{ControllerHandle, Declaration, Snapshot};
use serde_json::{Value, json};

/// One family as the admin server sees it.
#[derive(Clone, Debug)]
pub(crate) struct Family {
    pub(crate) declaration: Declaration,
    pub(crate) handle: ControllerHandle,
    /// The family's store on the observation pool (one connection, not the business pool).
    pub(crate) store: Store,
    /// The last reading of the observations, shared for [`OBSERVATION_TTL`].
    pub(crate) observed: ObservationCache,
}

/// How long one reading of a family's observations serves `/metrics` and `/snapshot`: a flood
/// of scrapes costs each family at most one bounded reading per this interval. The staleness is
/// stated with every answer (`nexuscrm_observations_age_seconds`, `observed_age_ms`).
pub(crate) const OBSERVATION_TTL: std::time::Duration = std::time::Duration::from_secs(10);

/// Gauges of one family's observations: `(name, state label if any, value)`.
pub(crate) type Gauges = Vec<(&'static str, Option<&'static str>, f64)>;

/// A family's last observations and when they were read; one reading at a time.
#[derive(Clone, Debug, Default)]
pub(crate) struct ObservationCache {
    last: Arc<tokio::sync::Mutex<Option<(tokio::time::Instant, Value, Gauges)>>>,
}

impl ObservationCache {
    /// The observations no older than [`OBSERVATION_TTL`], read from `store` when the last
    /// reading is older (errors are not kept: the next scrape tries again), with their age.
    pub(crate) async fn get(
        &self,
        store: &Store,
    ) -> Result<(Value, Gauges, std::time::Duration), String> {
        self.get_at(store, tokio::time::Instant::now()).await
    }

    /// [`get`](Self::get) as of `now` (tests pass their own instants).
    async fn get_at(
        &self,
        store: &Store,
        now: tokio::time::Instant,
    ) -> Result<(Value, Gauges, std::time::Duration), String> {
        let mut last = self.last.lock().await;
        if let Some((at, json, gauges)) = &*last {
            let age = now.saturating_duration_since(*at);
            if age < OBSERVATION_TTL {
                return Ok((json.clone(), gauges.clone(), age));
            }
        }
        let (json, gauges) = store.observations().await?;
        *last = Some((now, json.clone(), gauges.clone()));
        Ok((json, gauges, std::time::Duration::ZERO))
    }
}

/// A family's store, for its observations.
#[derive(Clone, Debug)]
pub(crate) enum Store {
    Bulk(Bulk),
    Flow(Flow),
    Paused(nexuscrm_paused::PausedFlow),
    Formula(nexuscrm_formula::Formula),
    Audit(nexuscrm_audit::Audit),
}

impl Store {
    /// The observations as JSON, and as gauges `(name, extra labels, value)`.
    async fn observations(&self) -> Result<(Value, Gauges), String> {
        match self {
            Store::Bulk(bulk) => {
                let o = bulk.observations().await.map_err(|e| e.to_string())?;
                let json = json!({
                    "pending": o.pending, "queue_depth_eligible": o.queue_depth_eligible,
                    "oldest_eligible_age_ms": o.oldest_eligible_age.map(|d| d.as_millis() as u64),
                    "running": o.running, "succeeded": o.succeeded, "poisoned": o.poisoned,
                    "count_cap": o.count_cap,
                });
                let mut g: Gauges = [
                    ("pending", o.pending),
                    ("running", o.running),
                    ("succeeded", o.succeeded),
                    ("poisoned", o.poisoned),
                ]
                .into_iter()
                .map(|(state, n)| ("nexuscrm_queue_jobs", Some(state), n as f64))
                .collect();
                g.push((
                    "nexuscrm_queue_eligible",
                    None,
                    o.queue_depth_eligible as f64,
                ));
                g.push((
                    "nexuscrm_queue_oldest_eligible_age_seconds",
                    None,
                    o.oldest_eligible_age.map_or(0.0, |d| d.as_secs_f64()),
                ));
                Ok((json, g))
            }
            Store::Flow(flow) => {
                let o = flow.observations().await.map_err(|e| e.to_string())?;
                let json = json!({
                    "pending": o.active, "active": o.active, "leased": o.leased, "paused": o.paused,
                    "oldest_due_age_ms": o.oldest_due_age.map(|d| d.as_millis() as u64),
                    "runs": o.runs, "count_cap": o.count_cap,
                });
                let mut g: Gauges = [
                    ("active", o.active),
                    ("leased", o.leased),
                    ("paused", o.paused),
                ]
                .into_iter()
                .map(|(state, n)| ("nexuscrm_flow_schedules", Some(state), n as f64))
                .collect();
                g.push(("nexuscrm_flow_runs", None, o.runs as f64));
                g.push((
                    "nexuscrm_flow_oldest_due_age_seconds",
                    None,
                    o.oldest_due_age.map_or(0.0, |d| d.as_secs_f64()),
                ));
                Ok((json, g))
            }
            Store::Paused(paused) => {
                let o = paused.observations().await.map_err(|e| e.to_string())?;
                let mut json = serde_json::Map::new();
                for (state, n) in &o.by_state {
                    json.insert((*state).to_owned(), json!(n));
                }
                // "pending" is what the status table shows: waiting for their effect.
                json.insert(
                    "pending".into(),
                    json!(o.count("resumable") + o.count("timed_out")),
                );
                json.insert("count_cap".into(), json!(o.count_cap));
                json.insert(
                    "oldest_uncertain_age_ms".into(),
                    json!(o.oldest_uncertain_age.map(|d| d.as_millis() as u64)),
                );
                let mut g: Gauges = o
                    .by_state
                    .iter()
                    .map(|(state, n)| ("nexuscrm_paused_steps", Some(*state), *n as f64))
                    .collect();
                g.push((
                    "nexuscrm_paused_oldest_uncertain_age_seconds",
                    None,
                    o.oldest_uncertain_age.map_or(0.0, |d| d.as_secs_f64()),
                ));
                Ok((Value::Object(json), g))
            }
            Store::Formula(formula) => {
                let o = formula.observations().await.map_err(|e| e.to_string())?;
                let json = json!({
                    "pending": o.stale, "stale": o.stale,
                    "oldest_stale_age_ms": o.oldest_stale_age.map(|d| d.as_millis() as u64),
                    "records_with_errors": o.records_with_errors, "count_cap": o.count_cap,
                });
                let g: Gauges = vec![
                    ("nexuscrm_formula_stale_records", None, o.stale as f64),
                    (
                        "nexuscrm_formula_oldest_stale_age_seconds",
                        None,
                        o.oldest_stale_age.map_or(0.0, |d| d.as_secs_f64()),
                    ),
                    (
                        "nexuscrm_formula_records_with_errors",
                        None,
                        o.records_with_errors as f64,
                    ),
                ];
                Ok((json, g))
            }
            Store::Audit(audit) => {
                let o = audit.observations().await.map_err(|e| e.to_string())?;
                let lag = o
                    .oldest_undelivered
                    .and_then(|t| std::time::SystemTime::now().duration_since(t).ok());
                let json = json!({
                    "pending": o.undelivered, "undelivered": o.undelivered,
                    "delivery_lag_ms": lag.map(|d| d.as_millis() as u64),
                    "sink": audit.sink().to_string(),
                    "file": audit.sink().file().map(|f| f.path().display().to_string()),
                });
                let g: Gauges = vec![
                    (
                        "nexuscrm_audit_undelivered_events",
                        None,
                        o.undelivered as f64,
                    ),
                    (
                        "nexuscrm_audit_delivery_lag_seconds",
                        None,
                        lag.map_or(0.0, |d| d.as_secs_f64()),
                    ),
                ];
                Ok((json, g))
            }
        }
    }
}

/// How long `/readyz` waits for the database to answer `SELECT 1`.
pub(crate) const READY_DB_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);
/// How long one answer of the database serves `/readyz` (so a flood of probes costs the
/// database at most one `SELECT 1` a second). `/readyz` follows the database within
/// `READY_DB_TIMEOUT + READY_DB_CACHE` (3 s).
pub(crate) const READY_DB_CACHE: std::time::Duration = std::time::Duration::from_secs(1);

/// `/readyz`'s check of the database: a `SELECT 1` bounded by [`READY_DB_TIMEOUT`], its answer
/// shared for [`READY_DB_CACHE`], one check at a time.
#[derive(Debug)]
pub(crate) struct DatabaseCheck {
    db: Db,
    last: tokio::sync::Mutex<Option<(tokio::time::Instant, Result<(), String>)>>,
}

impl DatabaseCheck {
    pub(crate) fn new(db: Db) -> Self {
        DatabaseCheck {
            db,
            last: tokio::sync::Mutex::new(None),
        }
    }

    async fn check(&self) -> Result<(), String> {
        let mut last = self.last.lock().await;
        if let Some((at, answer)) = &*last
            && at.elapsed() < READY_DB_CACHE
        {
            return answer.clone();
        }
        // A read: dropping it at the timeout commits nothing.
        let probe = sqlx::query("SELECT 1").execute(self.db.pool());
        let answer = match tokio::time::timeout(READY_DB_TIMEOUT, probe).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("database {}: {e}", self.db.url())),
            Err(_) => Err(format!(
                "database {}: no answer within {READY_DB_TIMEOUT:?}",
                self.db.url()
            )),
        };
        *last = Some((tokio::time::Instant::now(), answer.clone()));
        answer
    }
}

/// Shared admin state.
#[derive(Clone, Debug)]
pub(crate) struct Admin {
    pub(crate) families: Arc<Vec<Family>>,
    pub(crate) database: Arc<DatabaseCheck>,
    /// `POST /paused/resume`, when `paused.resume_endpoint` is on.
    pub(crate) resume: Option<crate::resume::ResumeEndpoint>,
    /// What the console may do (read-only without `console_secret`).
    pub(crate) console: crate::console::Actions,
    /// Product telemetry, when `[telemetry]` is enabled (best-effort figures).
    pub(crate) telemetry: Option<nexuscrm_telemetry::Telemetry>,
}

pub(crate) fn router(admin: Admin) -> Router {
    let resume = admin.resume.clone();
    let router = Router::new()
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/snapshot", get(snapshot))
        .route("/families", get(families))
        .route("/metrics", get(metrics))
        .merge(crate::console::routes())
        .with_state(admin);
    match resume {
        Some(endpoint) => router.merge(endpoint.router()),
        None => router,
    }
}

async fn readyz(State(admin): State<Admin>) -> Response {
    let mut problems = Vec::new();
    if let Err(e) = admin.database.check().await {
        problems.push(e);
    }
    for f in admin.families.iter() {
        let s = f.handle.snapshot();
        if let Some(p) = &s.poisoned {
            problems.push(format!("{}: poisoned: {p}", s.name));
        } else if !s.ready {
            problems.push(format!("{}: not ready", s.name));
        }
    }
    if problems.is_empty() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, problems.join("\n") + "\n").into_response()
    }
}

fn snapshot_json(s: &Snapshot) -> Value {
    json!({
        "name": s.name, "runs": s.runs, "ready": s.ready, "capacity": s.capacity,
        "in_flight": s.in_flight, "check_ready_calls": s.check_ready_calls,
        "claim_calls": s.claim_calls, "attempts_claimed": s.attempts_claimed,
        "claim_capacity_asked": s.claim_capacity_asked, "claims_empty": s.claims_empty,
        "claims_full": s.claims_full,
        "claim_latency": {
            "count": s.claim_latency.count(),
            "sum_seconds": s.claim_latency.sum.as_secs_f64(),
            "max_seconds": s.claim_latency.max.as_secs_f64(),
            "buckets": s.claim_latency.buckets,
        },
        "attempts_completed": s.attempts_completed, "attempts_failed": s.attempts_failed,
        "next_work_at_calls": s.next_work_at_calls, "next_work_at_errors": s.next_work_at_errors,
        "reconciles": {
            "startup": s.reconciles.startup, "requested": s.reconciles.requested,
            "generation_change": s.reconciles.generation_change,
            "generation_loss": s.reconciles.generation_loss, "backstop": s.reconciles.backstop,
        },
        "wakes_received": s.wakes_received, "wakes_coalesced": s.wakes_coalesced,
        "timers_armed": s.timers_armed, "timers_fired": s.timers_fired,
        "overdue_suppressed": s.overdue_suppressed, "due_during_claim": s.due_during_claim,
        "retimes_received": s.retimes_received,
        "generation_probes": s.generation_probes,
        "generation_changes": s.generation_changes, "generation_losses": s.generation_losses,
        "poisoned": s.poisoned,
        "last_claim_at_ms": s.last_claim_at.map(nexuscrm_persistence::support::to_ms),
    })
}

/// `/families`: the registry of asynchronous paths (declaration, owner, proofs), each marked
/// with whether this process runs it.
async fn families(State(admin): State<Admin>) -> Response {
    let mut running: Vec<&str> = admin
        .families
        .iter()
        .map(|f| f.declaration.family())
        .collect();
    if admin.telemetry.is_some() {
        running.push(nexuscrm_telemetry::FAMILY);
    }
    axum::Json(crate::registry::json(&running)).into_response()
}

async fn snapshot(State(admin): State<Admin>) -> Response {
    let mut families = Vec::new();
    for f in admin.families.iter() {
        let observations = match f.observed.get(&f.store).await {
            Ok((mut o, _, age)) => {
                if let Value::Object(m) = &mut o {
                    m.insert("observed_age_ms".into(), json!(age.as_millis() as u64));
                }
                o
            }
            Err(e) => json!({ "error": e }),
        };
        families.push(json!({
            "family": f.declaration.family(),
            "declaration": f.declaration.to_string(),
            "controller": snapshot_json(&f.handle.snapshot()),
            "observations": observations,
        }));
    }
    let telemetry = admin
        .telemetry
        .as_ref()
        .map(|t| telemetry_json(&t.report()));
    axum::Json(json!({ "families": families, "telemetry": telemetry })).into_response()
}

/// Telemetry's figures: best-effort, so never a total that claims completeness.
pub(crate) fn telemetry_json(r: &nexuscrm_telemetry::TelemetryReport) -> Value {
    let dropped: serde_json::Map<String, Value> = r
        .dropped
        .iter()
        .map(|(reason, n)| (reason.as_str().to_owned(), json!(n)))
        .collect();
    json!({
        "family": nexuscrm_telemetry::FAMILY,
        "declaration": nexuscrm_telemetry::DECLARATION.to_string(),
        "best_effort": true,
        "exporting": r.exporting,
        "emitted": r.emitted,
        "exported": r.exported,
        "dropped": dropped,
        "dropped_total": r.dropped_total(),
        "pending": r.pending,
        "summary": r.to_string(),
    })
}

/// `/metrics`: every family's controller figures and cached observations, encoded by
/// [`crate::metrics`] as OpenMetrics text.
async fn metrics(State(admin): State<Admin>) -> Response {
    let mut readings = Vec::new();
    for f in admin.families.iter() {
        let observed = f
            .observed
            .get(&f.store)
            .await
            .ok()
            .map(|(_, gauges, age)| (gauges, age));
        readings.push(crate::metrics::Reading {
            family: f.declaration.family().to_owned(),
            snapshot: f.handle.snapshot(),
            observed,
        });
    }
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        crate::metrics::render(readings, admin.telemetry.map(|t| t.report())),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use nexuscrm_bulk::{BulkOptions, NewJob, RowInput};
    use nexuscrm_persistence::Dialect;
    use nexuscrm_persistence::testing::TestDb;

    use super::*;

    #[tokio::test]
    async fn observations_are_read_once_per_ttl_and_state_their_age() {
        let t = TestDb::create(Dialect::Sqlite, "observed_ttl")
            .await
            .expect("SQLite is always here");
        let bulk = Bulk::open(t.db.clone(), 1, BulkOptions::default())
            .await
            .unwrap();
        let store = Store::Bulk(bulk.clone());
        let cache = ObservationCache::default();
        let t0 = tokio::time::Instant::now();
        let (first, _, age) = cache.get_at(&store, t0).await.unwrap();
        assert_eq!((&first["pending"], age), (&json!(0), Duration::ZERO));
        assert_eq!(first["count_cap"], nexuscrm_persistence::OBSERVATION_CAP);
        bulk.submit(NewJob::new(
            "k",
            vec![RowInput::new("r", serde_json::Map::new())],
        ))
        .await
        .unwrap();
        // Within the TTL: the same reading (no statement), and how old it is.
        let almost = OBSERVATION_TTL - Duration::from_millis(1);
        let (cached, _, age) = cache.get_at(&store, t0 + almost).await.unwrap();
        assert_eq!((&cached["pending"], age), (&json!(0), almost));
        // Past it: read again.
        let (fresh, gauges, age) = cache.get_at(&store, t0 + OBSERVATION_TTL).await.unwrap();
        assert_eq!((&fresh["pending"], age), (&json!(1), Duration::ZERO));
        assert!(
            gauges.contains(&("nexuscrm_queue_jobs", Some("pending"), 1.0)),
            "{gauges:?}"
        );
        t.drop_database().await;
    }
}
