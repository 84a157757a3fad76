//! The kit's conformance scenarios against the real Paused Flow store, once per dialect. A work
//! item is a resumed pause (or one whose timeout passes); it completes when its effect, sent to
//! a local receiver, is recorded `completed`.

use std::any::Any;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, SystemTime};

use nexuscrm_paused::{Connector, NewPause, PausedFlow, PausedOptions, PausedSource};
use nexuscrm_persistence::testing::{TestDb, hold_fence, lock_family_against_reads, lock_rows};
use nexuscrm_persistence::{Dialect, sqlx};
use nexuscrm_worker::BoxError;
use nexuscrm_worker_test::scenarios::{self, ScenarioAdapter};
use serde_json::json;
use sqlx::Executor;

struct PausedScenarios {
    dialect: Dialect,
    next: AtomicUsize,
}

/// One receiver for every scenario of a test binary: answers each effect at once.
async fn receiver_port() -> u16 {
    static PORT: OnceLock<u16> = OnceLock::new();
    if let Some(p) = PORT.get() {
        return *p;
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // Its own runtime on its own thread: it outlives every scenario's runtime.
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async move {
            listener.set_nonblocking(true).unwrap();
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let app = axum::Router::new().route("/effect", axum::routing::post(|| async { "ok" }));
            let _ = axum::serve(listener, app).await;
        });
    });
    *PORT.get_or_init(|| port)
}

impl PausedScenarios {
    async fn options(&self) -> PausedOptions {
        let port = receiver_port().await;
        PausedOptions::default()
            .connector(Connector::new(&format!("http://127.0.0.1:{port}/effect")).unwrap())
            .lease(Duration::from_secs(2))
            .backoff(Duration::from_millis(50))
            .generation_poll(Some(Duration::from_millis(100)))
    }

    async fn pause_and_resume(&self, store: &PausedFlow) -> Result<(), BoxError> {
        let n = self.next.fetch_add(1, Relaxed);
        let p = store
            .pause(NewPause::new(
                format!("run-{n}"),
                "step",
                Duration::from_secs(3600),
                json!({}),
            ))
            .await?;
        store.resume(p.token.expose(), &json!({"n": n})).await?;
        Ok(())
    }
}

impl ScenarioAdapter for PausedScenarios {
    type Source = PausedSource;

    fn label(&self) -> String {
        format!("paused/{}", self.dialect)
    }

    async fn source(&self) -> Result<PausedSource, BoxError> {
        let t = TestDb::create(self.dialect, "scenario")
            .await
            .ok_or("database unavailable")?;
        let store = PausedFlow::open(t.db.clone(), self.options().await).await?;
        store.take_ownership("scenarios").await?;
        Ok(store.source())
    }

    async fn submit(&self, source: &PausedSource, n: usize) -> Result<(), BoxError> {
        for _ in 0..n {
            self.pause_and_resume(source.store()).await?;
        }
        Ok(())
    }

    async fn submit_due(&self, source: &PausedSource, at: SystemTime) -> Result<(), BoxError> {
        // A pause nobody resumes becomes eligible when it times out (at least 1 s away).
        let n = self.next.fetch_add(1, Relaxed);
        let timeout = at
            .duration_since(SystemTime::now())
            .unwrap_or_default()
            .max(Duration::from_secs(1));
        source
            .store()
            .pause(NewPause::new(
                format!("due-{n}"),
                "step",
                timeout,
                json!({}),
            ))
            .await?;
        Ok(())
    }

    async fn completed(&self, source: &PausedSource) -> Result<u64, BoxError> {
        let o = source.store().observations().await?;
        Ok(o.count("completed") as u64)
    }

    async fn charged_attempts(&self, source: &PausedSource) -> Result<Option<u64>, BoxError> {
        let sql = if self.dialect == Dialect::Mysql {
            "SELECT CAST(COALESCE(SUM(attempts), 0) AS SIGNED) FROM paused_step"
        } else {
            "SELECT CAST(COALESCE(SUM(attempts), 0) AS BIGINT) FROM paused_step"
        };
        let n: i64 = sqlx::query_scalar(sql)
            .fetch_one(source.store().db().pool())
            .await?;
        Ok(Some(n as u64))
    }

    async fn block(&self, source: &PausedSource) -> Result<Box<dyn Any + Send>, BoxError> {
        // Hold every fence stripe (every claim and reconciliation locks one; SQLite: the write lock).
        Ok(Box::new(hold_fence(source.store().db()).await?))
    }

    async fn block_reads(
        &self,
        source: &PausedSource,
    ) -> Result<Option<Box<dyn Any + Send>>, BoxError> {
        let lock = lock_family_against_reads(source.store().db(), &["paused_step"]).await?;
        Ok(lock.map(|l| Box::new(l) as Box<dyn Any + Send>))
    }

    async fn hold_items(
        &self,
        source: &PausedSource,
    ) -> Result<Option<Box<dyn Any + Send>>, BoxError> {
        if self.dialect != Dialect::Postgres {
            return Ok(None);
        }
        let lock = lock_rows(source.store().db(), "SELECT id FROM paused_step FOR UPDATE").await?;
        Ok(Some(Box::new(lock)))
    }

    async fn break_attempts(&self, source: &PausedSource) -> Result<bool, BoxError> {
        // The store refuses every effect intent: a real error inside the attempt's own
        // transaction, before anything is sent.
        let sql = match self.dialect {
            Dialect::Sqlite => {
                "CREATE TRIGGER nexuscrm_fail_intent BEFORE UPDATE OF intent_at ON paused_step \
                 WHEN NEW.intent_at IS NOT NULL \
                 BEGIN SELECT RAISE(ABORT, 'injected store error'); END"
            }
            Dialect::Postgres => {
                source
                    .store()
                    .db()
                    .pool()
                    .execute(
                        "CREATE OR REPLACE FUNCTION nexuscrm_fail_intent() RETURNS trigger \
                         LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'injected store error'; \
                         END $$",
                    )
                    .await?;
                "CREATE TRIGGER nexuscrm_fail_intent BEFORE UPDATE OF intent_at ON paused_step \
                 FOR EACH ROW WHEN (NEW.intent_at IS NOT NULL) \
                 EXECUTE FUNCTION nexuscrm_fail_intent()"
            }
            Dialect::Mysql => {
                "CREATE TRIGGER nexuscrm_fail_intent BEFORE UPDATE ON paused_step FOR EACH ROW \
                 BEGIN IF NEW.intent_at IS NOT NULL AND OLD.intent_at IS NULL THEN \
                 SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'injected store error'; END IF; END"
            }
        };
        source.store().db().pool().execute(sql).await?;
        Ok(true)
    }

    async fn heal_attempts(&self, source: &PausedSource) -> Result<(), BoxError> {
        let sql = match self.dialect {
            Dialect::Postgres => "DROP TRIGGER IF EXISTS nexuscrm_fail_intent ON paused_step",
            _ => "DROP TRIGGER IF EXISTS nexuscrm_fail_intent",
        };
        source.store().db().pool().execute(sql).await?;
        Ok(())
    }

    async fn bump_generation(&self, source: &PausedSource) -> Result<bool, BoxError> {
        // A resume by another process is seen through the generation probe.
        let other =
            PausedFlow::without_migrations(source.store().db().clone(), PausedOptions::default());
        self.pause_and_resume(&other).await?;
        Ok(true)
    }

    async fn break_generation(&self, source: &PausedSource) -> Result<bool, BoxError> {
        if self.dialect != Dialect::Postgres {
            source.store().interrupt_generation_probe();
            return Ok(true);
        }
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND query LIKE 'LISTEN%' AND pid <> pg_backend_pid()",
        )
        .execute(source.store().db().pool())
        .await?;
        Ok(true)
    }
}

async fn run(dialect: Dialect) {
    if !nexuscrm_persistence::testing::available(dialect).await {
        return;
    }
    let report = scenarios::run_all(&PausedScenarios {
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
