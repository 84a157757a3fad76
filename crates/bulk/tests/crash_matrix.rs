//! The shared crash matrix at every required point, on SQLite, PostgreSQL and MariaDB.
//!
//! After each injected crash a fresh worker restarts on the same database; the recovery
//! assertion then reads the database: every accepted job succeeded, every input row was applied
//! exactly once (change log and revisions), and no acknowledged job was lost.

mod common;

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use common::{Applied, applied, controller_config, job, test_config, wait_terminal};
use nexuscrm_bulk::{Bulk, BulkConfig, BulkOptions, DECLARATION};
use nexuscrm_persistence::testing::{GaleraDb, TestDb, causal_reads};
use nexuscrm_persistence::{Db, Dialect, sqlx};
use nexuscrm_worker::fault::{CrashPoint, Faults};
use nexuscrm_worker::{Attempt, BoxError, Controller, Declaration, Source};
use nexuscrm_worker_test::{CrashContext, CrashFamily, CrashMatrix};
use tokio_util::sync::CancellationToken;

const JOBS: usize = 3;
const ROWS: usize = 30;

struct BulkFamily {
    dialect: Dialect,
    /// On the three-node Galera cluster (MySQL dialect), each worker on the next node.
    galera: bool,
}

struct Fixture {
    test: TestDb,
    /// The database's URL on each Galera node (empty off Galera).
    nodes: Vec<String>,
    next: std::sync::atomic::AtomicUsize,
}

struct Worker {
    fixture: Arc<Fixture>,
    db: Db,
    faults: Faults,
}

fn config(point: Option<CrashPoint>) -> BulkConfig {
    let lease = if point == Some(CrashPoint::LeaseExpiry) {
        300
    } else {
        1000
    };
    // Every applied row also writes its audit event in the segment's transaction: recovery
    // checks that the trail and the change log agree after every crash.
    test_config()
        .lease(Duration::from_millis(lease))
        .audit(true)
}

fn bulk(worker: &Worker, generation: i64, cfg: BulkConfig) -> Bulk {
    Bulk::without_migrations(
        worker.db.clone(),
        generation,
        BulkOptions::default()
            .config(cfg)
            .faults(worker.faults.clone()),
    )
}

async fn drive(bulk: &Bulk, ctx: &CrashContext) -> Result<(), BoxError> {
    let mut ids = Vec::new();
    for j in 0..JOBS {
        // A producer that never saw an acknowledgement retries with the same key.
        ids.push(bulk.submit(job(j, ROWS, 10)).await?.job);
    }
    let ctl = Controller::new(bulk.source(), controller_config("bulk", 2))?;
    bulk.set_waker(ctl.waker());
    let cancel = ctx.cancel().child_token();
    let run = ctx.spawn(ctl.run(cancel.clone()));
    wait_terminal(bulk, &ids, Duration::from_secs(90)).await;
    cancel.cancel();
    match run.await? {
        Ok(_) => Ok(()),
        Err(e) => Err(format!("controller: {e}").into()),
    }
}

impl CrashFamily for BulkFamily {
    type Fixture = Fixture;
    type Worker = Worker;

    fn label(&self) -> String {
        if self.galera {
            "bulk/galera".into()
        } else {
            format!("bulk/{}", self.dialect)
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
        Bulk::open(
            test.db.clone(),
            1,
            BulkOptions::default().config(BulkConfig::default().audit(true)),
        )
        .await?;
        Ok(Fixture {
            test,
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
            // Generation 1 is alive and holds a lease on a job it has not finished; generation 2
            // (the worker under test) takes over: its fence write commits, then it crashes
            // before its first claim, a transfer half done.
            let old = Bulk::without_migrations(
                worker.db.clone(),
                1,
                BulkOptions::default().config(config(Some(point))),
            );
            old.take_ownership("gen-1").await?;
            for j in 0..JOBS {
                old.submit(job(j, ROWS, 10)).await?;
            }
            let held = old
                .source()
                .claim(NonZeroUsize::new(1).unwrap(), CancellationToken::new())
                .await?;
            if held.is_empty() {
                return Err("generation 1 claimed nothing: no lease is held".into());
            }
            let new = bulk(&worker, 2, config(Some(point)));
            new.take_ownership("gen-2").await?;
            return Err("the takeover committed without reaching the crash point".into());
        }
        let bulk = bulk(&worker, 1, config(Some(point)));
        bulk.take_ownership("gen-1").await?;
        if point == CrashPoint::LeaseExpiry {
            // The worker stalls past its lease (a long GC pause, a frozen VM), then resumes:
            // its next segment finds the lease gone and must not commit.
            bulk.submit(job(0, ROWS, 10)).await?;
            let batch = bulk
                .source()
                .claim(NonZeroUsize::new(1).unwrap(), CancellationToken::new())
                .await?;
            tokio::time::sleep(Duration::from_millis(450)).await;
            for attempt in batch.into_parts().0 {
                attempt.run(CancellationToken::new()).await?;
            }
            return Ok(());
        }
        drive(&bulk, &ctx).await
    }

    async fn restart(
        &self,
        point: CrashPoint,
        worker: Arc<Worker>,
        ctx: CrashContext,
    ) -> Result<(), BoxError> {
        // A process restart in the same deployment keeps its generation (the lease must expire);
        // otherwise a new deployment generation takes over.
        let generation = match point {
            CrashPoint::DuringHeartbeat | CrashPoint::LeaseExpiry => 1,
            _ => 2,
        };
        let bulk = bulk(&worker, generation, config(Some(point)));
        bulk.take_ownership("restart").await?;
        drive(&bulk, &ctx).await
    }

    async fn recover(&self, point: CrashPoint, fixture: Arc<Fixture>) -> Result<(), BoxError> {
        // On Galera, read through node 1 causally: the last commits may have gone through
        // another node, which node 1 may still be applying.
        let causal = match fixture.nodes.first() {
            Some(url) => Some(causal_reads(url).await?),
            None => None,
        };
        let db = causal.as_ref().unwrap_or(&fixture.test.db);
        let jobs: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM bulk_job")
            .fetch_one(db.pool())
            .await?;
        let done: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM bulk_job WHERE state = 'succeeded'")
                .fetch_one(db.pool())
                .await?;
        if jobs != JOBS as i64 || done != jobs {
            return Err(
                format!("after {point}: {done} of {jobs} jobs succeeded, want {JOBS}").into(),
            );
        }
        let a = applied(db).await;
        let want = Applied {
            changes: (JOBS * ROWS) as i64,
            duplicated: 0,
            revision_mismatches: 0,
        };
        if a != want {
            return Err(format!("after {point}: {a:?}, want {want:?}").into());
        }
        common::audit_matches_changes(db)
            .await
            .map_err(|e| format!("after {point}: the audit trail: {e}"))?;
        Ok(())
    }
}

fn run_matrix(dialect: Dialect) {
    if !nexuscrm_persistence::testing::available_blocking(dialect) {
        return;
    }
    let report = CrashMatrix::new(BulkFamily {
        dialect,
        galera: false,
    })
    .run();
    println!("{report}");
    report.assert_passed();
}

#[test]
fn bulk_sqlite_crash_matrix() {
    run_matrix(Dialect::Sqlite);
}

#[test]
fn bulk_postgres_crash_matrix() {
    run_matrix(Dialect::Postgres);
}

#[test]
fn bulk_mysql_crash_matrix() {
    run_matrix(Dialect::Mysql);
}

/// On the three-node Galera cluster: each restarted worker on the next node, so recovery and
/// the takeover run through other nodes than the crash.
#[test]
fn bulk_galera_crash_matrix() {
    if !nexuscrm_persistence::testing::galera_available_blocking() {
        return;
    }
    let report = CrashMatrix::new(BulkFamily {
        dialect: Dialect::Mysql,
        galera: true,
    })
    .run();
    println!("{report}");
    report.assert_passed();
}
