//! The kit's conformance scenarios against the real Bulk store, once per dialect.

mod common;

use std::any::Any;
use std::time::{Duration, SystemTime};

use common::{job, test_config};
use nexuscrm_bulk::{Bulk, BulkOptions, BulkSource, NewJob};
use nexuscrm_persistence::testing::{
    TestDb, fail_inserts, heal_inserts, hold_fence, lock_family_against_reads, lock_rows,
};
use nexuscrm_persistence::{Dialect, sqlx};
use nexuscrm_worker::BoxError;
use nexuscrm_worker_test::scenarios::{self, ScenarioAdapter};

struct BulkScenarios {
    dialect: Dialect,
}

impl ScenarioAdapter for BulkScenarios {
    type Source = BulkSource;

    fn label(&self) -> String {
        format!("bulk/{}", self.dialect)
    }

    async fn source(&self) -> Result<BulkSource, BoxError> {
        let t = TestDb::create(self.dialect, "scenario")
            .await
            .ok_or("database unavailable")?;
        let cfg = test_config().generation_poll(Some(Duration::from_millis(100)));
        let bulk = Bulk::open(t.db.clone(), 1, BulkOptions::default().config(cfg)).await?;
        bulk.take_ownership("scenarios").await?;
        Ok(bulk.source())
    }

    async fn submit(&self, source: &BulkSource, n: usize) -> Result<(), BoxError> {
        let base = source
            .bulk()
            .list(1)
            .await?
            .first()
            .map_or(0, |s| s.id.0 as usize + 1);
        for i in 0..n {
            source.bulk().submit(job(base + i, 3, 10)).await?;
        }
        Ok(())
    }

    async fn submit_due(&self, source: &BulkSource, at: SystemTime) -> Result<(), BoxError> {
        let mut j: NewJob = job(1_000_000, 3, 10);
        j.run_at = Some(at);
        source.bulk().submit(j).await?;
        Ok(())
    }

    async fn completed(&self, source: &BulkSource) -> Result<u64, BoxError> {
        Ok(source.bulk().observations().await?.succeeded as u64)
    }

    async fn block(&self, source: &BulkSource) -> Result<Box<dyn Any + Send>, BoxError> {
        // Hold every fence stripe (every claim and reconciliation locks one; SQLite: the write lock).
        Ok(Box::new(hold_fence(source.bulk().db()).await?))
    }

    async fn block_reads(
        &self,
        source: &BulkSource,
    ) -> Result<Option<Box<dyn Any + Send>>, BoxError> {
        // Every table the family's reads touch (SQLite: None, its readers never wait).
        let lock =
            lock_family_against_reads(source.bulk().db(), &["bulk_job", "bulk_input"]).await?;
        Ok(lock.map(|l| Box::new(l) as Box<dyn Any + Send>))
    }

    async fn hold_items(
        &self,
        source: &BulkSource,
    ) -> Result<Option<Box<dyn Any + Send>>, BoxError> {
        // Only PostgreSQL's claim skips held rows (FOR UPDATE SKIP LOCKED).
        if self.dialect != Dialect::Postgres {
            return Ok(None);
        }
        let lock = lock_rows(source.bulk().db(), "SELECT id FROM bulk_job FOR UPDATE").await?;
        Ok(Some(Box::new(lock)))
    }

    async fn break_attempts(&self, source: &BulkSource) -> Result<bool, BoxError> {
        fail_inserts(source.bulk().db(), "crm_record_change").await?;
        Ok(true)
    }

    async fn heal_attempts(&self, source: &BulkSource) -> Result<(), BoxError> {
        heal_inserts(source.bulk().db(), "crm_record_change").await?;
        Ok(())
    }

    async fn bump_generation(&self, source: &BulkSource) -> Result<bool, BoxError> {
        // Work accepted by another process is seen through the MAX(id) generation probe.
        let other = Bulk::without_migrations(source.bulk().db().clone(), 1, BulkOptions::default());
        other.submit(job(2_000_000, 3, 10)).await?;
        Ok(true)
    }

    async fn charged_attempts(&self, source: &BulkSource) -> Result<Option<u64>, BoxError> {
        let sql = if self.dialect == Dialect::Mysql {
            "SELECT CAST(COALESCE(SUM(attempts), 0) AS SIGNED) FROM bulk_job"
        } else {
            "SELECT CAST(COALESCE(SUM(attempts), 0) AS BIGINT) FROM bulk_job"
        };
        let n: i64 = sqlx::query_scalar(sql)
            .fetch_one(source.bulk().db().pool())
            .await?;
        Ok(Some(n as u64))
    }

    async fn break_generation(&self, source: &BulkSource) -> Result<bool, BoxError> {
        if self.dialect != Dialect::Postgres {
            // The polled probe (the one TiDB uses) has no connection to kill: drop its stream.
            source.bulk().interrupt_generation_probe();
            return Ok(true);
        }
        // Kill the LISTEN connection, as a proxy restart or network cut would.
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND query LIKE 'LISTEN%' AND pid <> pg_backend_pid()",
        )
        .execute(source.bulk().db().pool())
        .await?;
        Ok(true)
    }
}

async fn run(dialect: Dialect) {
    if !nexuscrm_persistence::testing::available(dialect).await {
        return;
    }
    let report = scenarios::run_all(&BulkScenarios { dialect }).await;
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
