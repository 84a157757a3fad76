//! The scenarios: idle, drain, due, contend, and the plans.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant, SystemTime};

use nexuscrm_bulk::{Bulk, BulkOptions, NewJob, RowInput};
use nexuscrm_flow::{Flow, FlowOptions, MisfirePolicy, NewSchedule, Spec};
use nexuscrm_persistence::{Db, Dialect};
use nexuscrm_worker::{Attempt, Config, Controller, ControllerHandle, Source};
use nexuscrm_worker_test::scenarios::{Counted, Counts};
use serde::Serialize;
use serde_json::{Map, Value, json};
use sqlx::{Connection, PgConnection, Row};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::measure::{Digest, Env, Side, Totals, totals};
use crate::{AnyError, Plan};

/// The baseline: a hot poller, what River, Oban and graphile-worker do. `capacity` tasks,
/// each claiming one item through the same `Source::claim` and running the same attempt, and
/// claiming again at once while claims return work; a task sleeps `idle` only after an empty
/// (or failed) claim. Nothing wakes it early: new work waits for the sleep to end.
async fn hot_poll<S>(src: S, capacity: usize, idle: Duration, stop: CancellationToken)
where
    S: Source + Send + Sync + 'static,
{
    let src = Arc::new(src);
    let one = NonZeroUsize::MIN;
    let mut tasks: JoinSet<()> = JoinSet::new();
    for _ in 0..capacity {
        let (src, stop) = (src.clone(), stop.clone());
        tasks.spawn(async move {
            let never = CancellationToken::new();
            while !stop.is_cancelled() {
                let attempts = match src.claim(one, never.clone()).await {
                    Ok(batch) => batch.into_parts().0,
                    Err(_) => Vec::new(),
                };
                if attempts.is_empty() {
                    tokio::select! {
                        () = stop.cancelled() => break,
                        () = tokio::time::sleep(idle) => {}
                    }
                    continue;
                }
                for a in attempts {
                    let _ = a.run(stop.clone()).await;
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// One replica of one family, either side.
struct Replica {
    task: tokio::task::JoinHandle<()>,
    handle: Option<ControllerHandle>,
    counts: Arc<Counts>,
    db: Db,
    /// Scheduled Flow only: each reserved occurrence's lateness in milliseconds, at the clock's
    /// resolution (from [`Flow::on_runs_reserved`]; the stored `reserved_at` keeps whole ms).
    lateness: Arc<std::sync::Mutex<Vec<f64>>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    Bulk,
    Flow,
    /// The tiny-job Source ([`crate::tiny`]).
    Tiny,
}

async fn replica(
    env: &Env,
    side: Side,
    family: Family,
    plan: &Plan,
    stop: &CancellationToken,
) -> Result<Replica, AnyError> {
    let db = Db::connect(&env.url(side)).await?;
    let stop = stop.clone();
    // The Runtime Worker's defaults: Bulk refills batch for up to 20 ms while attempts run;
    // Scheduled Flow's due timers are precise.
    // The tiny jobs' attempts claim their successor in their disposition (successor handoff).
    let (capacity, name, cooldown, precise, handoff) = match family {
        Family::Bulk => (4, "bulk", Duration::from_millis(20), false, false),
        Family::Flow => (8, "flow", Duration::ZERO, true, false),
        // As the user wrote it: capacity 8, no cooldown.
        Family::Tiny => (8, "tiny", Duration::ZERO, false, plan.successor_handoff),
    };
    macro_rules! start {
        ($source:expr, $set_waker:expr) => {{
            let source = Counted::new($source);
            let counts = source.counts();
            match side {
                Side::Controller => {
                    let ctl = Controller::new(
                        source,
                        Config::new(name)
                            .capacity(NonZeroUsize::new(capacity).expect("> 0"))
                            .claim_cooldown(cooldown)
                            .claims_in_flight(plan.claims_in_flight)
                            .precise_timers(precise)
                            .successor_handoff(handoff),
                    )?;
                    ($set_waker)(ctl.waker());
                    let handle = ctl.handle();
                    let task = tokio::spawn(async move {
                        let _ = ctl.run(stop).await;
                    });
                    (task, Some(handle), counts)
                }
                Side::Baseline => {
                    let idle = plan.poll;
                    (
                        tokio::spawn(hot_poll(source, capacity, idle, stop)),
                        None,
                        counts,
                    )
                }
            }
        }};
    }
    let lateness = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (task, handle, counts) = match family {
        Family::Bulk => {
            let bulk = Bulk::without_migrations(db.clone(), 1, BulkOptions::default());
            let b = bulk.clone();
            start!(bulk.source(), |w| b.set_waker(w))
        }
        Family::Flow => {
            let flow = Flow::without_migrations(db.clone(), 1, FlowOptions::default());
            let late = lateness.clone();
            flow.on_runs_reserved(move |r| {
                let mut v = late
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                for o in &r.occurrences {
                    let ms = match r.reserved_at.duration_since(*o) {
                        Ok(d) => d.as_secs_f64() * 1e3,
                        Err(e) => -e.duration().as_secs_f64() * 1e3,
                    };
                    v.push(ms);
                }
            });
            let f = flow.clone();
            start!(flow.source(), |w| f.set_waker(w))
        }
        // Its drain is submitted before the replicas start: no wake source is needed.
        Family::Tiny => {
            let source = if side == Side::Controller && plan.batched_disposition {
                crate::tiny::TinySource::batched(
                    db.clone(),
                    NonZeroUsize::new(capacity).expect("> 0"),
                )
            } else {
                crate::tiny::TinySource::new(db.clone())
            };
            start!(source, |_| ())
        }
    };
    Ok(Replica {
        task,
        handle,
        counts,
        db,
        lateness,
    })
}

async fn ready(replicas: &[Replica]) {
    for r in replicas {
        if let Some(h) = &r.handle {
            let _ = tokio::time::timeout(Duration::from_secs(30), h.ready()).await;
        }
    }
}

async fn stop_all(replicas: Vec<Replica>, stop: &CancellationToken) -> (u64, u64, u64) {
    stop.cancel();
    let mut c = (0, 0, 0);
    for r in replicas {
        let _ = r.task.await;
        if let Some(h) = &r.handle {
            let s = h.snapshot();
            eprintln!(
                "    {}: {} claims ({} empty, {} full), {} handoffs ({} declined, {} empty, {} \
                 successors), {} next_work_at, {} reconciliations{}",
                s.name,
                s.claim_calls,
                s.claims_empty,
                s.claims_full,
                s.handoffs,
                s.handoffs_declined,
                s.handoffs_empty,
                s.attempts_handed,
                s.next_work_at_calls,
                s.reconciles.total(),
                s.poisoned
                    .as_deref()
                    .map(|p| format!("; poisoned: {p}"))
                    .unwrap_or_default(),
            );
        }
        c.0 += r.counts.claim.load(Relaxed);
        c.1 += r.counts.empty_claims();
        c.2 += r.counts.claim_errors.load(Relaxed);
        r.db.close().await;
    }
    c
}

/// One side of the idle scenario.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct IdleSide {
    pub(crate) window_secs: f64,
    pub(crate) statements: i64,
    pub(crate) statements_per_minute: f64,
    pub(crate) statements_per_hour: f64,
    pub(crate) claims: u64,
    pub(crate) digests: Vec<Digest>,
}

/// The idle scenario.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Idle {
    pub(crate) controller: IdleSide,
    pub(crate) baseline: IdleSide,
    /// Statements one requested reconciliation of both controllers caused (reconcile, claim,
    /// next_work_at per family): the cost of one backstop.
    pub(crate) controller_statements_per_reconciliation: i64,
    pub(crate) backstop_secs: u64,
    /// (3600 / backstop) x statements per reconciliation (the LISTEN probe costs nothing).
    pub(crate) controller_bound_per_hour: f64,
}

pub(crate) async fn idle(env: &Env, plan: &Plan) -> Result<Idle, AnyError> {
    let mut sides = Vec::new();
    let mut per_reconciliation = 0;
    for side in [Side::Controller, Side::Baseline] {
        env.reset_tables().await?;
        env.reset_stats().await?;
        let stop = CancellationToken::new();
        let replicas = vec![
            replica(env, side, Family::Bulk, plan, &stop).await?,
            replica(env, side, Family::Flow, plan, &stop).await?,
        ];
        ready(&replicas).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let claims_before: u64 = replicas.iter().map(|r| r.counts.claim.load(Relaxed)).sum();
        env.reset_stats().await?;
        let started = Instant::now();
        tokio::time::sleep(plan.idle).await;
        let digests = env.digests(side).await?;
        let window = started.elapsed().as_secs_f64();
        let claims_after: u64 = replicas.iter().map(|r| r.counts.claim.load(Relaxed)).sum();
        if side == Side::Controller {
            // What one backstop costs: request a reconciliation of both controllers and count
            // every statement it causes (reconcile, claim, next_work_at).
            env.reset_stats().await?;
            for r in &replicas {
                if let Some(h) = &r.handle {
                    h.request_reconcile();
                }
            }
            tokio::time::sleep(Duration::from_millis(1000)).await;
            per_reconciliation = totals(&env.digests(side).await?).statements;
        }
        stop_all(replicas, &stop).await;
        let n = totals(&digests).statements;
        sides.push(IdleSide {
            window_secs: window,
            statements: n,
            statements_per_minute: n as f64 * 60.0 / window,
            statements_per_hour: n as f64 * 3600.0 / window,
            claims: claims_after - claims_before,
            digests,
        });
    }
    let baseline = sides.pop().expect("two sides");
    let controller = sides.pop().expect("two sides");
    let backstop = 300;
    Ok(Idle {
        controller,
        baseline,
        controller_statements_per_reconciliation: per_reconciliation,
        backstop_secs: backstop,
        controller_bound_per_hour: 3600.0 / backstop as f64 * per_reconciliation as f64,
    })
}

fn rows(prefix: &str, n: usize) -> Vec<RowInput> {
    (0..n)
        .map(|i| {
            let mut m = Map::new();
            m.insert("name".into(), Value::String(format!("Contact {i}")));
            m.insert("email".into(), Value::String(format!("c{i}@example.com")));
            RowInput::new(format!("{prefix}-{i}"), m)
        })
        .collect()
}

async fn submit(env: &Env, workload: &str, jobs: usize, per_job: usize) -> Result<(), AnyError> {
    let producer = Bulk::without_migrations(env.db.clone(), 1, BulkOptions::default());
    for j in 0..jobs {
        let key = format!("{workload}-{j}");
        let mut job = NewJob::new(key.clone(), rows(&key, per_job));
        job.segment_size = Some(100);
        producer.submit(job).await?;
    }
    Ok(())
}

/// One drain run.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct DrainRun {
    pub(crate) workload: String,
    pub(crate) side: &'static str,
    pub(crate) replicas: usize,
    pub(crate) items: i64,
    pub(crate) items_done: i64,
    pub(crate) secs: f64,
    pub(crate) items_per_s: f64,
    pub(crate) statements_per_item: f64,
    pub(crate) rows_per_item: f64,
    pub(crate) blks_hit_per_item: f64,
    pub(crate) blks_read_per_item: f64,
    pub(crate) claims: u64,
    pub(crate) empty_claims: u64,
    pub(crate) digests: Vec<Digest>,
}

const DONE_JOBS: &str = "SELECT COUNT(*) FROM bulk_job WHERE state IN ('succeeded', 'poisoned')";

/// What one drain run drains.
#[derive(Clone, Copy)]
enum Work {
    /// Bulk jobs of `per_job` rows.
    Bulk { jobs: usize, per_job: usize },
    /// Jobs of the tiny-job Source.
    Tiny { jobs: usize },
}

async fn one_drain(
    env: &Env,
    plan: &Plan,
    side: Side,
    replicas: usize,
    workload: &str,
    work: Work,
) -> Result<(DrainRun, u64), AnyError> {
    env.reset_tables().await?;
    crate::tiny::reset(&env.db).await?;
    let (family, items, done_sql) = match work {
        Work::Bulk { jobs, per_job } => {
            submit(env, workload, jobs, per_job).await?;
            (Family::Bulk, jobs as i64, DONE_JOBS.to_owned())
        }
        Work::Tiny { jobs } => {
            crate::tiny::submit(&env.db, jobs).await?;
            (
                Family::Tiny,
                jobs as i64,
                format!("SELECT {jobs} - COUNT(*) FROM tiny_job"),
            )
        }
    };
    env.reset_stats().await?;
    let stop = CancellationToken::new();
    let started = Instant::now();
    let mut rs = Vec::new();
    for _ in 0..replicas {
        rs.push(replica(env, side, family, plan, &stop).await?);
    }
    let cap = match side {
        Side::Controller => Duration::from_secs(300),
        Side::Baseline => plan.baseline_cap,
    };
    env.wait_count(&done_sql, items, cap).await;
    let secs = started.elapsed().as_secs_f64();
    let digests = env.digests(side).await?;
    let (claims, empty, _) = stop_all(rs, &stop).await;
    // Items finished within the measured time (a capped baseline stops mid-way).
    let (items, items_done): (i64, i64) = match work {
        Work::Bulk { per_job: 1, .. } => (
            items,
            sqlx::query_scalar(DONE_JOBS)
                .fetch_one(env.db.pool())
                .await?,
        ),
        Work::Bulk { jobs, per_job } => (
            (jobs * per_job) as i64,
            sqlx::query_scalar(
                "SELECT CAST(COALESCE(SUM(applied_rows), 0) AS BIGINT) FROM bulk_job",
            )
            .fetch_one(env.db.pool())
            .await?,
        ),
        Work::Tiny { .. } => (
            items,
            sqlx::query_scalar(&done_sql)
                .fetch_one(env.db.pool())
                .await?,
        ),
    };
    let t: Totals = totals(&digests);
    let per = |x: i64| x as f64 / items_done.max(1) as f64;
    Ok((
        DrainRun {
            workload: workload.into(),
            side: side.key(),
            replicas,
            items,
            items_done,
            secs,
            items_per_s: items_done as f64 / secs,
            statements_per_item: per(t.statements),
            rows_per_item: per(t.rows),
            blks_hit_per_item: per(t.blks_hit),
            blks_read_per_item: per(t.blks_read),
            claims,
            empty_claims: empty,
            digests,
        },
        claims,
    ))
}

pub(crate) async fn drain(env: &Env, plan: &Plan) -> Result<Vec<DrainRun>, AnyError> {
    let workloads = [
        (
            format!(
                "bulk {} rows in {} jobs",
                plan.drain_rows,
                plan.drain_rows / 100
            ),
            Work::Bulk {
                jobs: plan.drain_rows / 100,
                per_job: 100,
            },
        ),
        (
            format!("{} one-row jobs", plan.tiny_jobs),
            Work::Bulk {
                jobs: plan.tiny_jobs,
                per_job: 1,
            },
        ),
        (
            format!("{} tiny jobs (own table)", plan.queue_jobs),
            Work::Tiny {
                jobs: plan.queue_jobs,
            },
        ),
    ];
    let mut out = Vec::new();
    for (name, work) in &workloads {
        for &r in &plan.replicas {
            for side in [Side::Controller, Side::Baseline] {
                eprintln!("  {name}, {r} replica(s), {}", side.key());
                out.push(one_drain(env, plan, side, r, name, *work).await?.0);
            }
        }
    }
    Ok(out)
}

/// Lateness statistics, in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Lateness {
    pub(crate) n: usize,
    pub(crate) min: f64,
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) max: f64,
}

fn lateness(mut v: Vec<f64>) -> Lateness {
    v.sort_by(f64::total_cmp);
    let q = |p: f64| {
        if v.is_empty() {
            f64::NAN
        } else {
            v[((v.len() - 1) as f64 * p).round() as usize]
        }
    };
    Lateness {
        n: v.len(),
        min: q(0.0),
        p50: q(0.5),
        p99: q(0.99),
        max: q(1.0),
    }
}

/// The due scenario.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Due {
    /// From the reservation's clock reading (microseconds and finer).
    pub(crate) controller: Lateness,
    pub(crate) baseline: Lateness,
    /// From the stored whole-millisecond columns (`reserved_at - occurrence_at`), as a check.
    pub(crate) controller_stored: Lateness,
    pub(crate) baseline_stored: Lateness,
    /// Where the controller's time went, from its own snapshot (means over the scenario).
    pub(crate) controller_parts: DueParts,
}

/// The controller's share of due lateness, from its snapshot: means in milliseconds.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct DueParts {
    /// From the due time to the claim's start (the timer and the task's wake-up).
    pub(crate) timer_ms: f64,
    /// A claim's round trip (the claim transaction), over every claim of the scenario.
    pub(crate) claim_ms: f64,
    /// Timers that fired, and claims.
    pub(crate) timers: u64,
    pub(crate) claims: u64,
}

pub(crate) async fn due(env: &Env, plan: &Plan) -> Result<Due, AnyError> {
    let mut sides = Vec::new();
    let mut parts = DueParts::default();
    for side in [Side::Controller, Side::Baseline] {
        env.reset_tables().await?;
        let stop = CancellationToken::new();
        let rs = vec![replica(env, side, Family::Flow, plan, &stop).await?];
        ready(&rs).await;
        // A producer in "another process": the controller hears of it through NOTIFY.
        let producer = Flow::without_migrations(env.db.clone(), 1, FlowOptions::default());
        let t0 = SystemTime::now() + Duration::from_secs(2);
        let spacing = Duration::from_millis(137);
        for i in 0..plan.due_items {
            let mut s = NewSchedule::new(
                format!("due-{i}"),
                "probe",
                Spec::Every(Duration::from_secs(3600)),
                MisfirePolicy::FireOnce,
            );
            s.start_at = Some(t0 + spacing * i as u32);
            producer.create(s).await?;
        }
        let last = t0 + spacing * plan.due_items as u32;
        let wait = last.duration_since(SystemTime::now()).unwrap_or_default()
            + plan.poll * 2
            + Duration::from_secs(2);
        env.wait_count("SELECT COUNT(*) FROM flow_run", plan.due_items as i64, wait)
            .await;
        let late = rs[0].lateness.clone();
        if let Some(h) = &rs[0].handle {
            let snap = h.snapshot();
            let (timers, claims) = (snap.due_lateness.count(), snap.claim_latency.count());
            parts = DueParts {
                timer_ms: snap.due_lateness.sum as f64 / 1e6 / timers.max(1) as f64,
                claim_ms: snap.claim_latency.sum.as_secs_f64() * 1e3 / claims.max(1) as f64,
                timers,
                claims,
            };
        }
        stop_all(rs, &stop).await;
        let stored: Vec<f64> = sqlx::query("SELECT reserved_at - occurrence_at FROM flow_run")
            .fetch_all(env.db.pool())
            .await?
            .iter()
            .map(|r| r.try_get::<i64, _>(0).map(|v| v as f64))
            .collect::<Result<_, _>>()?;
        let precise = std::mem::take(
            &mut *late
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        // The hook saw every committed run (one process, no crash): the same count as the
        // store's.
        if precise.len() != stored.len() {
            return Err(format!(
                "the reservation hook saw {} runs, the store holds {}",
                precise.len(),
                stored.len()
            )
            .into());
        }
        sides.push((lateness(precise), lateness(stored)));
    }
    let (baseline, baseline_stored) = sides.pop().expect("two sides");
    let (controller, controller_stored) = sides.pop().expect("two sides");
    Ok(Due {
        controller,
        baseline,
        controller_stored,
        baseline_stored,
        controller_parts: parts,
    })
}

/// One side of the contention scenario.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ContendSide {
    pub(crate) replicas: usize,
    pub(crate) items: i64,
    pub(crate) items_done: i64,
    pub(crate) secs: f64,
    pub(crate) items_per_s: f64,
    pub(crate) claims: u64,
    pub(crate) empty_claims: u64,
    pub(crate) claim_errors: u64,
    pub(crate) lock_wait_samples: i64,
    pub(crate) samples: i64,
    pub(crate) statements_per_item: f64,
}

/// The contention scenario.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Contend {
    pub(crate) controller: ContendSide,
    pub(crate) baseline: ContendSide,
}

pub(crate) async fn contend(env: &Env, plan: &Plan) -> Result<Contend, AnyError> {
    let mut sides = Vec::new();
    for side in [Side::Controller, Side::Baseline] {
        env.reset_tables().await?;
        submit(env, "hot", plan.tiny_jobs, 1).await?;
        env.reset_stats().await?;
        let stop = CancellationToken::new();
        let started = Instant::now();
        let mut rs = Vec::new();
        for _ in 0..4 {
            rs.push(replica(env, side, Family::Bulk, plan, &stop).await?);
        }
        let cap = match side {
            Side::Controller => Duration::from_secs(300),
            Side::Baseline => plan.baseline_cap,
        };
        let deadline = Instant::now() + cap;
        let (mut waits, mut samples) = (0i64, 0i64);
        loop {
            let done: i64 = sqlx::query_scalar(DONE_JOBS)
                .fetch_one(env.db.pool())
                .await?;
            if done >= plan.tiny_jobs as i64 || Instant::now() >= deadline {
                break;
            }
            let w: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND usename = $1 AND wait_event_type = 'Lock'",
            )
            .bind(side.role())
            .fetch_one(env.db.pool())
            .await?;
            waits += w;
            samples += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let secs = started.elapsed().as_secs_f64();
        let digests = env.digests(side).await?;
        let (claims, empty, errors) = stop_all(rs, &stop).await;
        let done: i64 = sqlx::query_scalar(DONE_JOBS)
            .fetch_one(env.db.pool())
            .await?;
        sides.push(ContendSide {
            replicas: 4,
            items: plan.tiny_jobs as i64,
            items_done: done,
            secs,
            items_per_s: done as f64 / secs,
            claims,
            empty_claims: empty,
            claim_errors: errors,
            lock_wait_samples: waits,
            samples,
            statements_per_item: totals(&digests).statements as f64 / done.max(1) as f64,
        });
    }
    let baseline = sides.pop().expect("two sides");
    let controller = sides.pop().expect("two sides");
    Ok(Contend {
        controller,
        baseline,
    })
}

/// One explained statement at one table size.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Explained {
    pub(crate) family: &'static str,
    pub(crate) statement: &'static str,
    pub(crate) rows: usize,
    pub(crate) eligible: usize,
    pub(crate) seq_scan: bool,
    pub(crate) buffers: String,
    pub(crate) execution_ms: f64,
    pub(crate) plan: String,
}

pub(crate) async fn explain_one(
    c: &mut PgConnection,
    sql: &str,
    args: &str,
) -> Result<(String, bool, String, f64), AnyError> {
    sqlx::query("BEGIN").execute(&mut *c).await?;
    sqlx::query(&format!("PREPARE ev_q AS {sql}"))
        .execute(&mut *c)
        .await?;
    let lines: Vec<String> = sqlx::query(&format!("EXPLAIN (ANALYZE, BUFFERS) EXECUTE ev_q{args}"))
        .fetch_all(&mut *c)
        .await?
        .iter()
        .map(|r| r.try_get::<String, _>(0))
        .collect::<Result<_, _>>()?;
    sqlx::query("ROLLBACK").execute(&mut *c).await?;
    sqlx::query("DEALLOCATE ev_q").execute(&mut *c).await?;
    let plan = lines.join("\n");
    let seq = plan.contains("Seq Scan");
    let buffers = lines
        .iter()
        .find_map(|l| l.trim().strip_prefix("Buffers: ").map(str::to_owned))
        .unwrap_or_else(|| "none".into());
    let ms = lines
        .iter()
        .find_map(|l| {
            l.trim()
                .strip_prefix("Execution Time: ")
                .and_then(|r| r.trim_end_matches(" ms").parse().ok())
        })
        .unwrap_or(f64::NAN);
    Ok((plan, seq, buffers, ms))
}

pub(crate) async fn explain(env: &Env, plan: &Plan) -> Result<Vec<Explained>, AnyError> {
    const ELIGIBLE: usize = 10;
    let mut c = PgConnection::connect(&env.tool_url()).await?;
    let now = nexuscrm_persistence::support::to_ms(SystemTime::now());
    let claim_args = format!("('tok', {}, 1, {now}, {now}, {now}, 4)", now + 30_000);
    let statements: [(&'static str, &'static str, &'static str, String); 6] = [
        (
            "bulk",
            "claim",
            nexuscrm_bulk::statement(Dialect::Postgres, "claim"),
            claim_args.clone(),
        ),
        (
            "bulk",
            "next_run_at",
            nexuscrm_bulk::statement(Dialect::Postgres, "next_run_at"),
            String::new(),
        ),
        (
            "bulk",
            "next_lease_expiry",
            nexuscrm_bulk::statement(Dialect::Postgres, "next_lease_expiry"),
            String::new(),
        ),
        (
            "flow",
            "claim",
            nexuscrm_flow::statement(Dialect::Postgres, "claim"),
            claim_args,
        ),
        (
            "flow",
            "next_occurrence",
            nexuscrm_flow::statement(Dialect::Postgres, "next_occurrence"),
            String::new(),
        ),
        (
            "flow",
            "next_lease_expiry",
            nexuscrm_flow::statement(Dialect::Postgres, "next_lease_expiry"),
            String::new(),
        ),
    ];
    let mut out = Vec::new();
    for &n in &plan.explain_rows {
        eprintln!("  {n} rows");
        env.reset_tables().await?;
        // Ineligible rows dominate: finished jobs, schedules whose cursor is far ahead.
        sqlx::query(
            "INSERT INTO bulk_job (idempotency_key, state, max_attempts, run_at, total_rows, \
             segment_size, created_at, updated_at) \
             SELECT 'k' || g, CASE WHEN g <= $2 THEN 'pending' ELSE 'succeeded' END, 5, 0, 1, \
             100, 0, 0 FROM generate_series(1, $1) g",
        )
        .bind(n as i64)
        .bind(ELIGIBLE as i64)
        .execute(&mut c)
        .await?;
        sqlx::query(
            "INSERT INTO flow_schedule (name, flow, spec_kind, interval_ms, policy, catch_up_max, \
             state, version, next_occurrence_at, defined_at, created_at, updated_at) \
             SELECT 's' || g, 'f', 'interval', 1000, 'skip', 1, 'active', 1, \
             CASE WHEN g <= $2 THEN 0 ELSE 4000000000000 END, 0, 0, 0 \
             FROM generate_series(1, $1) g",
        )
        .bind(n as i64)
        .bind(ELIGIBLE as i64)
        .execute(&mut c)
        .await?;
        sqlx::query("ANALYZE bulk_job").execute(&mut c).await?;
        sqlx::query("ANALYZE flow_schedule").execute(&mut c).await?;
        for (family, name, sql, args) in &statements {
            let (text, seq, buffers, ms) = explain_one(&mut c, sql, args).await?;
            out.push(Explained {
                family,
                statement: name,
                rows: n,
                eligible: ELIGIBLE,
                seq_scan: seq,
                buffers,
                execution_ms: ms,
                plan: text,
            });
        }
    }
    c.close().await?;
    env.reset_tables().await?;
    Ok(out)
}

/// The summary keys of one run, for the JSON report.
pub(crate) fn keys(
    idle: Option<&Idle>,
    drain: &[DrainRun],
    due: Option<&Due>,
) -> serde_json::Value {
    let pick = |side: &str| {
        drain
            .iter()
            .find(|d| d.side == side && d.replicas == 1 && d.workload.starts_with("bulk"))
    };
    json!({
        "idle": idle.map(|i| json!({
            "controller": {"statements_per_hour": i.controller.statements_per_hour,
                           "statements_per_minute": i.controller.statements_per_minute,
                           "bound_per_hour": i.controller_bound_per_hour},
            "baseline": {"statements_per_hour": i.baseline.statements_per_hour,
                         "statements_per_minute": i.baseline.statements_per_minute},
        })),
        "drain": {
            "controller": pick("controller").map(|d| json!({"items_per_s": d.items_per_s, "statements_per_item": d.statements_per_item})),
            "baseline": pick("baseline").map(|d| json!({"items_per_s": d.items_per_s, "statements_per_item": d.statements_per_item})),
        },
        "due": due.map(|d| json!({
            "controller": {"lateness_ms": d.controller},
            "baseline": {"lateness_ms": d.baseline},
        })),
    })
}
