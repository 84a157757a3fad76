//! The shared crash matrix at every required point, on SQLite, PostgreSQL and MariaDB.
//!
//! Three catch-up schedules every second backfill from 12 s before the fixture was made, in
//! chunks of 5 runs (so reservations heartbeat between chunks). After each injected crash a
//! fresh worker restarts on the same database and reserves until every cursor is past the time
//! it restarted; the recovery assertion then reads the database: each due occurrence has
//! exactly one `flow_run` row, none is missing, and each cursor is past them.

mod common;

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use common::{assert_exact, controller_config, cursors, ms, run_counts, runs_by_schedule};
use nexuscrm_flow::{DECLARATION, Flow, FlowConfig, FlowOptions, MisfirePolicy, NewSchedule, Spec};
use nexuscrm_persistence::testing::{GaleraDb, TestDb, causal_reads};
use nexuscrm_persistence::{Db, Dialect};
use nexuscrm_worker::fault::{CrashPoint, Faults};
use nexuscrm_worker::{Attempt, BoxError, Controller, Declaration, Source};
use nexuscrm_worker_test::{CrashContext, CrashFamily, CrashMatrix};
use tokio_util::sync::CancellationToken;

const SCHEDULES: usize = 3;
const BACKFILL_SECS: u64 = 12;

struct FlowFamily {
    dialect: Dialect,
    /// On the three-node Galera cluster (MySQL dialect), each worker on the next node.
    galera: bool,
}

struct Fixture {
    test: TestDb,
    /// The database's URL on each Galera node (empty off Galera).
    nodes: Vec<String>,
    next: std::sync::atomic::AtomicUsize,
    start: SystemTime,
}

struct Worker {
    fixture: Arc<Fixture>,
    db: Db,
    faults: Faults,
}

fn config(point: Option<CrashPoint>) -> FlowConfig {
    let lease = if point == Some(CrashPoint::LeaseExpiry) {
        300
    } else {
        1000
    };
    FlowConfig::default()
        .lease(Duration::from_millis(lease))
        .chunk(5)
        .retry_backoff(Duration::from_millis(100))
        .generation_poll(None)
}

fn flow(worker: &Worker, generation: i64, cfg: FlowConfig) -> Flow {
    Flow::without_migrations(
        worker.db.clone(),
        generation,
        FlowOptions::default()
            .config(cfg)
            .faults(worker.faults.clone()),
    )
}

fn schedule(fixture: &Fixture, i: usize) -> NewSchedule {
    let mut s = NewSchedule::new(
        format!("crash-{i}"),
        "tick",
        Spec::Every(Duration::from_secs(1)),
        MisfirePolicy::CatchUp { max: 1000 },
    );
    s.start_at = Some(fixture.start);
    s
}

async fn drive(flow: &Flow, fixture: &Fixture, ctx: &CrashContext) -> Result<(), BoxError> {
    for i in 0..SCHEDULES {
        // A producer that never saw an acknowledgement retries the same create.
        flow.create(schedule(fixture, i)).await?;
    }
    let target = ms(SystemTime::now());
    let ctl = Controller::new(flow.source(), controller_config("flow", 2))?;
    flow.set_waker(ctl.waker());
    let cancel = ctx.cancel().child_token();
    let run = ctx.spawn(ctl.run(cancel.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let c = cursors(flow.db()).await;
        if c.len() == SCHEDULES && c.values().all(|v| v.is_some_and(|v| v > target)) {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("cursors did not pass {target}: {c:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cancel.cancel();
    match run.await? {
        Ok(_) => Ok(()),
        Err(e) => Err(format!("controller: {e}").into()),
    }
}

impl CrashFamily for FlowFamily {
    type Fixture = Fixture;
    type Worker = Worker;

    fn label(&self) -> String {
        if self.galera {
            "flow/galera".into()
        } else {
            format!("flow/{}", self.dialect)
        }
    }

    fn declaration(&self) -> Declaration {
        DECLARATION
    }

    async fn fixture(&self) -> Result<Fixture, BoxError> {
        let (test, nodes) = if self.galera {
            let g = GaleraDb::create("crash")
                .await
                .ok_or("Galera cluster unavailable")?;
            (g.test, g.nodes)
        } else {
            let t = TestDb::create(self.dialect, "crash")
                .await
                .ok_or("test database unavailable")?;
            (t, Vec::new())
        };
        Flow::open(test.db.clone(), 1, FlowOptions::default()).await?;
        let now = ms(SystemTime::now());
        let start = nexuscrm_persistence::support::from_ms(
            (now / 1000) * 1000 - BACKFILL_SECS as i64 * 1000,
        );
        Ok(Fixture {
            test,
            start,
            nodes,
            next: Default::default(),
        })
    }

    async fn new_worker(
        &self,
        fixture: &Arc<Fixture>,
        faults: Faults,
    ) -> Result<Arc<Worker>, BoxError> {
        let url = match fixture.nodes.len() {
            0 => fixture.test.url.clone(),
            n => fixture.nodes[fixture
                .next
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                % n]
                .clone(),
        };
        let db = nexuscrm_persistence::testing::worker_db(&url).await?;
        Ok(Arc::new(Worker {
            fixture: fixture.clone(),
            db,
            faults,
        }))
    }

    fn worker_fixture<'a>(&self, worker: &'a Worker) -> &'a Arc<Fixture> {
        &worker.fixture
    }

    async fn crash(
        &self,
        point: CrashPoint,
        worker: Arc<Worker>,
        ctx: CrashContext,
    ) -> Result<(), BoxError> {
        if point == CrashPoint::OwnershipTransfer {
            // Generation 1 is alive and holds a lease on a schedule it has not reserved;
            // generation 2 (the worker under test) takes over: its fence write commits, then it
            // crashes before its first claim, a transfer half done.
            let old = Flow::without_migrations(
                worker.db.clone(),
                1,
                FlowOptions::default().config(config(Some(point))),
            );
            old.take_ownership("gen-1").await?;
            for i in 0..SCHEDULES {
                old.create(schedule(&worker.fixture, i)).await?;
            }
            let held = old
                .source()
                .claim(NonZeroUsize::new(1).unwrap(), CancellationToken::new())
                .await?;
            if held.is_empty() {
                return Err("generation 1 claimed nothing: no lease is held".into());
            }
            let new = flow(&worker, 2, config(Some(point)));
            new.take_ownership("gen-2").await?;
            return Err("the takeover committed without reaching the crash point".into());
        }
        let flow = flow(&worker, 1, config(Some(point)));
        flow.take_ownership("gen-1").await?;
        if point == CrashPoint::LeaseExpiry {
            // The worker stalls past its lease, then resumes: its reservation finds the lease
            // gone and must not commit.
            flow.create(schedule(&worker.fixture, 0)).await?;
            let batch = flow
                .source()
                .claim(NonZeroUsize::new(1).unwrap(), CancellationToken::new())
                .await?;
            tokio::time::sleep(Duration::from_millis(450)).await;
            for attempt in batch.into_parts().0 {
                attempt.run(CancellationToken::new()).await?;
            }
            return Ok(());
        }
        drive(&flow, &worker.fixture, &ctx).await
    }

    async fn restart(
        &self,
        point: CrashPoint,
        worker: Arc<Worker>,
        ctx: CrashContext,
    ) -> Result<(), BoxError> {
        // A process restart in the same deployment keeps its generation (the lease must
        // expire); otherwise a new deployment generation takes over.
        let generation = match point {
            CrashPoint::DuringHeartbeat | CrashPoint::LeaseExpiry => 1,
            _ => 2,
        };
        let flow = flow(&worker, generation, config(Some(point)));
        flow.take_ownership("restart").await?;
        drive(&flow, &worker.fixture, &ctx).await
    }

    async fn recover(&self, point: CrashPoint, fixture: Arc<Fixture>) -> Result<(), BoxError> {
        // On Galera, read through node 1 causally: the last commits may have gone through
        // another node, which node 1 may still be applying.
        let causal = match fixture.nodes.first() {
            Some(url) => Some(causal_reads(url).await?),
            None => None,
        };
        let db = causal.as_ref().unwrap_or(&fixture.test.db);
        let runs = runs_by_schedule(db).await;
        let cursors = cursors(db).await;
        if cursors.len() != SCHEDULES {
            return Err(format!(
                "after {point}: {} schedules, want {SCHEDULES}",
                cursors.len()
            )
            .into());
        }
        let start = ms(fixture.start);
        let mut total = 0;
        for (id, cursor) in &cursors {
            let r = runs.get(id).map(Vec::as_slice).unwrap_or_default();
            let label = format!("after {point}");
            std::panic::catch_unwind(|| assert_exact(&label, *id, start, 1000, r, *cursor))
                .map_err(|e| {
                    e.downcast_ref::<String>()
                        .cloned()
                        .unwrap_or_else(|| format!("{label}: runs are not exact"))
                })?;
            if r.len() < BACKFILL_SECS as usize {
                return Err(format!("after {point}: schedule {id} has {} runs", r.len()).into());
            }
            total += r.len() as i64;
        }
        let (rows, distinct) = run_counts(db).await;
        if (rows, distinct) != (total, total) {
            return Err(
                format!("after {point}: {rows} runs, {distinct} distinct, want {total}").into(),
            );
        }
        Ok(())
    }
}

fn run_matrix(dialect: Dialect) {
    if !nexuscrm_persistence::testing::available_blocking(dialect) {
        return;
    }
    let report = CrashMatrix::new(FlowFamily {
        dialect,
        galera: false,
    })
    .run();
    println!("{report}");
    report.assert_passed();
}

#[test]
fn flow_sqlite_crash_matrix() {
    run_matrix(Dialect::Sqlite);
}

#[test]
fn flow_postgres_crash_matrix() {
    run_matrix(Dialect::Postgres);
}

#[test]
fn flow_mysql_crash_matrix() {
    run_matrix(Dialect::Mysql);
}

/// On the three-node Galera cluster: each restarted worker on the next node, so recovery and
/// the takeover run through other nodes than the crash.
#[test]
fn flow_galera_crash_matrix() {
    if !nexuscrm_persistence::testing::galera_available_blocking() {
        return;
    }
    let report = CrashMatrix::new(FlowFamily {
        dialect: Dialect::Mysql,
        galera: true,
    })
    .run();
    println!("{report}");
    report.assert_passed();
}
