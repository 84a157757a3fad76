//! The kit's conformance scenarios against the real Scheduled Flow store, once per dialect. A
//! work item is a schedule whose (first) occurrence is due; it completes when its run is
//! reserved.

mod common;

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, SystemTime};

use common::test_config;
use nexuscrm_flow::{Flow, FlowOptions, FlowSource, MisfirePolicy, NewSchedule, Spec};
use nexuscrm_persistence::testing::{
    TestDb, fail_inserts, heal_inserts, hold_fence, lock_family_against_reads, lock_rows,
};
use nexuscrm_persistence::{Dialect, sqlx};
use nexuscrm_worker::BoxError;
use nexuscrm_worker_test::scenarios::{self, ScenarioAdapter};

struct FlowScenarios {
    dialect: Dialect,
    next: AtomicUsize,
}

impl FlowScenarios {
    fn schedule(&self, at: SystemTime) -> NewSchedule {
        let n = self.next.fetch_add(1, Relaxed);
        let mut s = NewSchedule::new(
            format!("scenario-{n}"),
            "f",
            Spec::Every(Duration::from_secs(24 * 3600)),
            MisfirePolicy::CatchUp { max: 10 },
        );
        s.start_at = Some(at);
        s
    }
}

impl ScenarioAdapter for FlowScenarios {
    type Source = FlowSource;

    fn label(&self) -> String {
        format!("flow/{}", self.dialect)
    }

    async fn source(&self) -> Result<FlowSource, BoxError> {
        let t = TestDb::create(self.dialect, "scenario")
            .await
            .ok_or("database unavailable")?;
        let cfg = test_config().generation_poll(Some(Duration::from_millis(100)));
        let flow = Flow::open(t.db.clone(), 1, FlowOptions::default().config(cfg)).await?;
        flow.take_ownership("scenarios").await?;
        Ok(flow.source())
    }

    async fn submit(&self, source: &FlowSource, n: usize) -> Result<(), BoxError> {
        let now = SystemTime::now();
        for _ in 0..n {
            source.flow().create(self.schedule(now)).await?;
        }
        Ok(())
    }

    async fn submit_due(&self, source: &FlowSource, at: SystemTime) -> Result<(), BoxError> {
        source.flow().create(self.schedule(at)).await?;
        Ok(())
    }

    async fn completed(&self, source: &FlowSource) -> Result<u64, BoxError> {
        Ok(source.flow().observations().await?.runs as u64)
    }

    async fn block(&self, source: &FlowSource) -> Result<Box<dyn Any + Send>, BoxError> {
        // Hold every fence stripe (every claim and reconciliation locks one; SQLite: the write lock).
        Ok(Box::new(hold_fence(source.flow().db()).await?))
    }

    async fn block_reads(
        &self,
        source: &FlowSource,
    ) -> Result<Option<Box<dyn Any + Send>>, BoxError> {
        // Every table the family's reads touch (SQLite: None, its readers never wait).
        let lock =
            lock_family_against_reads(source.flow().db(), &["flow_schedule", "flow_run"]).await?;
        Ok(lock.map(|l| Box::new(l) as Box<dyn Any + Send>))
    }

    async fn hold_items(
        &self,
        source: &FlowSource,
    ) -> Result<Option<Box<dyn Any + Send>>, BoxError> {
        // Only PostgreSQL's claim skips held rows (FOR UPDATE SKIP LOCKED).
        if self.dialect != Dialect::Postgres {
            return Ok(None);
        }
        let lock = lock_rows(
            source.flow().db(),
            "SELECT id FROM flow_schedule FOR UPDATE",
        )
        .await?;
        Ok(Some(Box::new(lock)))
    }

    async fn break_attempts(&self, source: &FlowSource) -> Result<bool, BoxError> {
        fail_inserts(source.flow().db(), "flow_run").await?;
        Ok(true)
    }

    async fn heal_attempts(&self, source: &FlowSource) -> Result<(), BoxError> {
        heal_inserts(source.flow().db(), "flow_run").await?;
        Ok(())
    }

    async fn bump_generation(&self, source: &FlowSource) -> Result<bool, BoxError> {
        // A schedule created by another process is seen through the generation probe.
        let other = Flow::without_migrations(source.flow().db().clone(), 1, FlowOptions::default());
        other.create(self.schedule(SystemTime::now())).await?;
        Ok(true)
    }

    async fn break_generation(&self, source: &FlowSource) -> Result<bool, BoxError> {
        if self.dialect != Dialect::Postgres {
            // The polled probe (the one TiDB uses) has no connection to kill: drop its stream.
            source.flow().interrupt_generation_probe();
            return Ok(true);
        }
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND query LIKE 'LISTEN%' AND pid <> pg_backend_pid()",
        )
        .execute(source.flow().db().pool())
        .await?;
        Ok(true)
    }
}

async fn run(dialect: Dialect) {
    if !nexuscrm_persistence::testing::available(dialect).await {
        return;
    }
    let report = scenarios::run_all(&FlowScenarios {
        dialect,
        next: AtomicUsize::new(0),
    })
    .await;
    println!("{report}");
    // Every other scenario applies on every backend (the polled probe is losable too).
    report.assert_all_passed_except(nexuscrm_persistence::testing::scenarios_not_applicable(
        dialect,
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_scenarios_pass_on_sqlite() {
    run(Dialect::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_scenarios_pass_on_postgres() {
    run(Dialect::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_scenarios_pass_on_mysql() {
    run(Dialect::Mysql).await;
}
