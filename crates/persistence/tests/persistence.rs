//! Persistence against real SQLite files, PostgreSQL and MariaDB (one database per test).

use nexuscrm_persistence::testing::TestDb;
use nexuscrm_persistence::{Db, DbErrorKind, Dialect, Fence, Migration, WriteError, sqlx};
use tokio_util::sync::CancellationToken;

const DIALECTS: [Dialect; 3] = [Dialect::Sqlite, Dialect::Postgres, Dialect::Mysql];

#[tokio::test]
async fn bad_urls_and_unreachable_servers_give_clear_errors() {
    let e = Db::connect("redis://127.0.0.1").await.unwrap_err();
    assert_eq!(e.kind(), DbErrorKind::Config);
    assert!(e.to_string().contains("unsupported database URL"), "{e}");
    let e = Db::connect("postgres://postgres:secret@127.0.0.1:1/test")
        .await
        .unwrap_err();
    assert_eq!(e.kind(), DbErrorKind::Unavailable);
    assert!(
        e.to_string().contains("postgres:***@127.0.0.1:1"),
        "password hidden: {e}"
    );
    assert!(!e.to_string().contains("secret"));
}

#[test]
fn every_credential_in_a_url_is_hidden() {
    use nexuscrm_persistence::redact_url;
    for (url, want) in [
        (
            "postgres://host/db?user=u&password=S3cret",
            "postgres://host/db?user=u&password=***",
        ),
        (
            "postgres://u:S3cret@host:5432/db?sslmode=require&sslpassword=K3y&passfile=/p/f",
            "postgres://u:***@host:5432/db?sslmode=require&sslpassword=***&passfile=***",
        ),
        (
            "mysql://root@127.0.0.1:3306/test",
            "mysql://root@127.0.0.1:3306/test",
        ),
        (
            "mysql://r:p%40ss@h/db?PASSWORD=x#frag",
            "mysql://r:***@h/db?PASSWORD=***#frag",
        ),
        (
            "postgres://h/db?sslkey=/k&token=t&pwd=w",
            "postgres://h/db?sslkey=***&token=***&pwd=***",
        ),
        ("sqlite://./a.db?mode=rwc", "sqlite://./a.db?mode=rwc"),
        ("not a url?password=x", "not a url?password=***"),
        ("postgres://u:a@b@host/db", "postgres://u:***@host/db"),
    ] {
        assert_eq!(redact_url(url), want, "{url}");
    }
}

#[tokio::test]
async fn an_unreachable_server_is_reported_at_once_with_its_cause_and_no_secret() {
    // The pool alone would retry silently and report "pool timed out" after 60 s.
    let options = nexuscrm_persistence::DbOptions::default()
        .acquire_timeout(std::time::Duration::from_secs(60));
    let started = std::time::Instant::now();
    let e = Db::connect_with(
        "postgres://127.0.0.1:1/test?user=u&password=S3cret",
        options,
    )
    .await
    .unwrap_err();
    let shown = e.to_string();
    assert_eq!(e.kind(), DbErrorKind::Unavailable);
    assert!(!shown.contains("S3cret"), "{shown}");
    assert!(shown.contains("password=***"), "{shown}");
    assert!(
        shown.to_ascii_lowercase().contains("refused"),
        "the cause is named: {shown}"
    );
    assert!(!shown.contains("pool timed out"), "{shown}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(50),
        "reported before the acquire timeout"
    );
    let e = Db::connect("mysql://root:S3cret@127.0.0.1:1/test")
        .await
        .unwrap_err();
    assert!(
        e.to_string().to_ascii_lowercase().contains("refused"),
        "{e}"
    );
    assert!(!e.to_string().contains("S3cret"), "{e}");
}

/// A statement prepared while its table was empty must not keep that table's plan once the
/// table has grown: the pool's connections plan every execution with its parameters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_prepared_on_an_empty_table_is_replanned_after_the_table_grows() {
    let Some(t) = TestDb::create(Dialect::Postgres, "replan").await else {
        return;
    };
    let db = Db::connect_with(
        &t.url,
        nexuscrm_persistence::DbOptions::default().max_connections(1),
    )
    .await
    .unwrap();
    sqlx::query(
        "CREATE TABLE p_t (k VARCHAR(64) NOT NULL, f VARCHAR(8) NOT NULL, PRIMARY KEY (k, f))",
    )
    .execute(db.pool())
    .await
    .unwrap();
    const DELETE: &str = "DELETE FROM p_t WHERE k IN ($1, $2, $3)";
    // More than the five executions after which PostgreSQL would consider a generic plan.
    for _ in 0..8 {
        sqlx::query(DELETE)
            .bind("a")
            .bind("b")
            .bind("c")
            .execute(db.pool())
            .await
            .unwrap();
    }
    sqlx::query("INSERT INTO p_t SELECT 'r-' || g, 'x' FROM generate_series(1, 20000) g")
        .execute(db.pool())
        .await
        .unwrap();
    let done = sqlx::query(DELETE)
        .bind("r-1")
        .bind("r-2")
        .bind("r-3")
        .execute(db.pool())
        .await
        .unwrap();
    assert_eq!(done.rows_affected(), 3);
    let (generic, custom): (i64, i64) = sqlx::query_as(
        "SELECT CAST(generic_plans AS BIGINT), CAST(custom_plans AS BIGINT) \
         FROM pg_prepared_statements WHERE statement = $1",
    )
    .bind(DELETE)
    .fetch_one(db.pool())
    .await
    .unwrap();
    assert_eq!(
        (generic, custom),
        (0, 9),
        "every execution planned with its parameters, none with a cached generic plan"
    );
    let mode: String = sqlx::query_scalar("SELECT current_setting('plan_cache_mode')")
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(mode, "force_custom_plan");
    db.close().await;
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrators_apply_each_migration_once_and_all_succeed() {
    for d in DIALECTS {
        let Some(t) = TestDb::create(d, "migrators").await else {
            continue;
        };
        let ms: &[Migration] = &[
            Migration {
                version: 1,
                name: "table",
                sqlite: "CREATE TABLE IF NOT EXISTS m_t (id BIGINT PRIMARY KEY)",
                postgres: "CREATE TABLE IF NOT EXISTS m_t (id BIGINT PRIMARY KEY)",
                mysql: "CREATE TABLE IF NOT EXISTS m_t (id BIGINT PRIMARY KEY)",
            },
            Migration {
                version: 2,
                name: "column",
                sqlite: "ALTER TABLE m_t ADD COLUMN c BIGINT NOT NULL DEFAULT 0",
                postgres: "ALTER TABLE m_t ADD COLUMN IF NOT EXISTS c BIGINT NOT NULL DEFAULT 0",
                mysql: "ALTER TABLE m_t ADD COLUMN IF NOT EXISTS c BIGINT NOT NULL DEFAULT 0",
            },
        ];
        let mut runs = Vec::new();
        for _ in 0..4 {
            let db = Db::connect(&t.url).await.unwrap();
            runs.push(tokio::spawn(async move { db.migrate("m", ms).await }));
        }
        for r in runs {
            r.await.unwrap().unwrap_or_else(|e| panic!("{d}: {e}"));
        }
        assert_eq!(t.db.schema_version("m").await.unwrap(), 2, "{d}");
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_migration_leaves_no_half_applied_version_on_transactional_backends() {
    for d in [Dialect::Sqlite, Dialect::Postgres] {
        let Some(t) = TestDb::create(d, "halfmig").await else {
            continue;
        };
        let bad = [Migration {
            version: 1,
            name: "half",
            sqlite: "CREATE TABLE h_t (id BIGINT PRIMARY KEY);\nTHIS IS NOT SQL",
            postgres: "CREATE TABLE h_t (id BIGINT PRIMARY KEY);\nTHIS IS NOT SQL",
            mysql: "",
        }];
        let e = t.db.migrate("h", &bad).await.unwrap_err();
        assert_eq!(e.kind(), DbErrorKind::Migration, "{d}: {e}");
        assert_eq!(t.db.schema_version("h").await.unwrap(), 0, "{d}");
        // The first statement rolled back with the second: a fixed migration applies cleanly.
        let good = [Migration {
            version: 1,
            name: "whole",
            sqlite: "CREATE TABLE h_t (id BIGINT PRIMARY KEY)",
            postgres: "CREATE TABLE h_t (id BIGINT PRIMARY KEY)",
            mysql: "",
        }];
        assert_eq!(t.db.migrate("h", &good).await.unwrap(), 1, "{d}");
        t.drop_database().await;
    }
}

#[test]
fn tidb_is_recognised_from_its_version_string() {
    assert!(nexuscrm_persistence::is_tidb_version("8.0.11-TiDB-v7.5.0"));
    assert!(!nexuscrm_persistence::is_tidb_version(
        "10.11.19-MariaDB-0+deb12u1"
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_apply_once_and_refuse_a_newer_schema() {
    for d in DIALECTS {
        let Some(t) = TestDb::create(d, "migrate").await else {
            continue;
        };
        let m1 = Migration {
            version: 1,
            name: "t",
            sqlite: "CREATE TABLE IF NOT EXISTS t (id BIGINT PRIMARY KEY);\nCREATE INDEX IF NOT EXISTS t_id ON t (id);\n",
            postgres: "CREATE TABLE IF NOT EXISTS t (id BIGINT PRIMARY KEY);\nCREATE INDEX IF NOT EXISTS t_id ON t (id);\n",
            mysql: "CREATE TABLE IF NOT EXISTS t (id BIGINT PRIMARY KEY);\nCREATE INDEX IF NOT EXISTS t_id ON t (id);\n",
        };
        assert_eq!(t.db.migrate("comp", &[m1]).await.unwrap(), 1, "{d}");
        assert_eq!(
            t.db.migrate("comp", &[m1]).await.unwrap(),
            0,
            "{d}: idempotent"
        );
        assert_eq!(t.db.schema_version("comp").await.unwrap(), 1);
        // Code that only knows version 0 meets a v1 schema.
        let e = t.db.migrate("comp", &[]).await.unwrap_err();
        assert_eq!(e.kind(), DbErrorKind::SchemaTooNew, "{d}");
        assert!(e.to_string().contains("newer than this build knows"), "{e}");
        let bad = Migration {
            version: 2,
            name: "bad",
            sqlite: "CREATE TABLLE x (a INT);\n",
            postgres: "CREATE TABLLE x (a INT);\n",
            mysql: "CREATE TABLLE x (a INT);\n",
        };
        let e = t.db.migrate("comp", &[m1, bad]).await.unwrap_err();
        assert_eq!(e.kind(), DbErrorKind::Migration);
        assert!(e.to_string().contains("comp v2 (bad)"), "{e}");
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_generation_fences_out_an_older_one_which_can_never_take_back() {
    for d in DIALECTS {
        let Some(t) = TestDb::create(d, "ownership").await else {
            continue;
        };
        t.db.migrate_ownership().await.unwrap();
        let g1 = t.db.take_ownership("bulk", 1, "a").await.unwrap();
        let mut tx = t.db.begin_write().await.unwrap();
        assert!(g1.holds(tx.conn(), &t.db).await.unwrap(), "{d}");
        tx.rollback().await;
        t.db.take_ownership("bulk", 1, "a")
            .await
            .expect("idempotent");
        t.db.take_ownership("bulk", 2, "b").await.unwrap();
        let mut tx = t.db.begin_write().await.unwrap();
        assert!(
            !g1.holds(tx.conn(), &t.db).await.unwrap(),
            "{d}: generation 1 is fenced out"
        );
        assert!(Fence::new("bulk", 2).holds(tx.conn(), &t.db).await.unwrap());
        tx.rollback().await;
        let e = t.db.take_ownership("bulk", 1, "a").await.unwrap_err();
        assert_eq!(e.kind(), DbErrorKind::Superseded, "{d}");
        assert_eq!(t.db.owner_generation("bulk").await.unwrap(), Some(2));
        // Another family is independent.
        t.db.take_ownership("flow", 1, "a").await.unwrap();
        t.drop_database().await;
    }
}

/// Taking ownership is the transaction that contends with every writer of the family's fence
/// stripes, so losing to contention (here SQLite's busy lock, with no busy wait; on Galera a
/// certification failure at COMMIT, which CI's Galera crash matrix hit) is retried rather than
/// reported, and the error when the contention outlasts the retries says "not committed".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn taking_ownership_retries_contention_and_says_not_committed_when_it_outlasts_the_retries() {
    let Some(t) = TestDb::create(Dialect::Sqlite, "owncontend").await else {
        return;
    };
    t.db.migrate_ownership().await.unwrap();
    let contender = Db::connect_with(
        &t.url,
        nexuscrm_persistence::DbOptions::default().busy_timeout(std::time::Duration::ZERO),
    )
    .await
    .unwrap();
    // Held throughout: every try is refused, and the error is a proven rollback.
    let holder = t.db.begin_write().await.unwrap();
    let e = contender
        .take_ownership("bulk", 1, "a")
        .await
        .expect_err("the file is locked for every try");
    assert!(e.to_string().contains("not committed"), "{e}");
    assert_eq!(t.db.owner_generation("bulk").await.unwrap(), None);
    // Held for a moment (the retries span about 0.7 s): a later try takes ownership.
    let take = tokio::spawn({
        let contender = contender.clone();
        async move { contender.take_ownership("bulk", 1, "a").await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    holder.rollback().await;
    take.await.unwrap().expect("taken once the lock is free");
    assert_eq!(t.db.owner_generation("bulk").await.unwrap(), Some(1));
    contender.close().await;
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_cancelled_while_blocked_on_a_lock_returns_promptly_and_commits_nothing() {
    for d in DIALECTS {
        let Some(t) = TestDb::create(d, "cancel").await else {
            continue;
        };
        let create = "CREATE TABLE c (id BIGINT PRIMARY KEY, v BIGINT NOT NULL)";
        sqlx::query(create).execute(t.db.pool()).await.unwrap();
        sqlx::query("INSERT INTO c (id, v) VALUES (1, 0)")
            .execute(t.db.pool())
            .await
            .unwrap();
        // Another connection holds the lock.
        let mut holder = t.db.begin_write().await.unwrap();
        sqlx::query("UPDATE c SET v = 100 WHERE id = 1")
            .execute(holder.conn())
            .await
            .unwrap();
        let cancel = CancellationToken::new();
        let c2 = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            c2.cancel();
        });
        let started = std::time::Instant::now();
        let r =
            t.db.write(&cancel, |conn| {
                Box::pin(async move {
                    sqlx::query("UPDATE c SET v = v + 1 WHERE id = 1")
                        .execute(&mut *conn)
                        .await?;
                    Ok(())
                })
            })
            .await;
        assert!(matches!(r, Err(WriteError::Cancelled)), "{d}: {r:?}");
        assert!(r.unwrap_err().is_not_committed());
        assert!(
            started.elapsed() < std::time::Duration::from_secs(4),
            "{d}: returned promptly"
        );
        holder.rollback().await;
        // Nothing committed: the value is untouched once the lock holder rolled back.
        let v: i64 = loop {
            match sqlx::query_scalar("SELECT v FROM c WHERE id = 1")
                .fetch_one(t.db.pool())
                .await
            {
                Ok(v) => break v,
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            }
        };
        assert_eq!(v, 0, "{d}");
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_dropped_mid_begin_never_leaves_an_open_transaction_in_the_pool() {
    let t = TestDb::create(Dialect::Sqlite, "dropbegin").await.unwrap();
    sqlx::query("CREATE TABLE d (id BIGINT PRIMARY KEY)")
        .execute(t.db.pool())
        .await
        .unwrap();
    let holder = t.db.begin_write().await.unwrap();
    // Dropped (by the timeout) while BEGIN IMMEDIATE waits for the holder's write lock.
    let dropped =
        tokio::time::timeout(std::time::Duration::from_millis(200), t.db.begin_write()).await;
    assert!(dropped.is_err(), "the begin was still waiting");
    holder.rollback().await;
    // The next writers get the lock promptly: no pooled connection holds a transaction.
    for _ in 0..8 {
        let started = std::time::Instant::now();
        let mut tx = t.db.begin_write().await.expect("write lock available");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(3),
            "waited {:?}",
            started.elapsed()
        );
        sqlx::query("INSERT INTO d (id) VALUES (1)")
            .execute(tx.conn())
            .await
            .unwrap();
        tx.rollback().await;
    }
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serialization_failure_at_commit_is_not_committed_and_other_commit_errors_stay_unknown() {
    let Some(t) = TestDb::create(Dialect::Postgres, "commitabort").await else {
        return;
    };
    // A deferred constraint trigger runs at COMMIT: it raises the SQLSTATE we choose, so the
    // error comes from COMMIT itself (not from a statement before it).
    for stmt in [
        "CREATE TABLE c (id BIGINT PRIMARY KEY, code TEXT NOT NULL)",
        "CREATE FUNCTION c_check() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
         IF NEW.code = 'ok' THEN RETURN NULL; END IF; \
         RAISE EXCEPTION 'forced at commit' USING ERRCODE = NEW.code; END $$",
        "CREATE CONSTRAINT TRIGGER c_at_commit AFTER INSERT ON c DEFERRABLE INITIALLY DEFERRED \
         FOR EACH ROW EXECUTE FUNCTION c_check()",
    ] {
        sqlx::query(stmt).execute(t.db.pool()).await.unwrap();
    }
    let never = CancellationToken::new();
    let mut id = 0;
    for (code, rolled_back) in [
        ("40001", true),  // serialization_failure
        ("40P01", true),  // deadlock_detected
        ("P0001", false), // raise_exception: not a definite abort code, stays unknown
        ("ok", false),    // commits
    ] {
        id += 1;
        let r =
            t.db.write(&never, move |c| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO c (id, code) VALUES ($1, $2)")
                        .bind(id)
                        .bind(code)
                        .execute(&mut *c)
                        .await?;
                    Ok(())
                })
            })
            .await;
        let stored: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM c WHERE id = $1")
            .bind(id)
            .fetch_one(t.db.pool())
            .await
            .unwrap();
        match (code, r) {
            ("ok", Ok(())) => assert_eq!(stored, 1),
            (_, Err(e)) => {
                assert_eq!(stored, 0, "{code}: the server rolled back");
                assert_eq!(e.is_not_committed(), rolled_back, "{code}: {e}");
                assert!(
                    matches!(
                        (&e, rolled_back),
                        (WriteError::NotCommitted(_), true)
                            | (WriteError::OutcomeUnknown(_), false)
                    ),
                    "{code}: {e:?}"
                );
            }
            (_, Ok(())) => panic!("{code}: the commit must fail"),
        }
    }
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mysql_deadlock_is_classified_as_rolled_back() {
    use nexuscrm_persistence::commit_rolled_back;
    let Some(t) = TestDb::create(Dialect::Mysql, "deadlock").await else {
        return;
    };
    sqlx::query("CREATE TABLE d (id BIGINT PRIMARY KEY, v BIGINT) ENGINE=InnoDB")
        .execute(t.db.pool())
        .await
        .unwrap();
    sqlx::query("INSERT INTO d VALUES (1, 0), (2, 0)")
        .execute(t.db.pool())
        .await
        .unwrap();
    let mut a = t.db.begin_write().await.unwrap();
    let mut b = t.db.begin_write().await.unwrap();
    sqlx::query("UPDATE d SET v = 1 WHERE id = 1")
        .execute(a.conn())
        .await
        .unwrap();
    sqlx::query("UPDATE d SET v = 1 WHERE id = 2")
        .execute(b.conn())
        .await
        .unwrap();
    // a waits for b's row; then b asks for a's row: InnoDB picks a victim at once.
    let a_waits = tokio::spawn(async move {
        let r = sqlx::query("UPDATE d SET v = 2 WHERE id = 2")
            .execute(a.conn())
            .await
            .map(drop);
        (a, r)
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let rb = sqlx::query("UPDATE d SET v = 2 WHERE id = 1")
        .execute(b.conn())
        .await
        .map(drop);
    let err = match rb {
        Err(e) => {
            b.rollback().await;
            let (a, ra) = a_waits.await.unwrap();
            ra.unwrap();
            a.rollback().await;
            e
        }
        Ok(()) => {
            let (a, ra) = a_waits.await.unwrap();
            a.rollback().await;
            b.rollback().await;
            ra.unwrap_err()
        }
    };
    assert!(commit_rolled_back(Dialect::Mysql, &err), "{err}");
    // The same text from another dialect, and a non-database error, are never "rolled back".
    assert!(!commit_rolled_back(Dialect::Sqlite, &err));
    assert!(!commit_rolled_back(
        Dialect::Mysql,
        &sqlx::Error::PoolTimedOut
    ));
    t.drop_database().await;
}

/// A fixed wall clock for the fenced write's "now".
#[derive(Debug)]
struct At(std::time::SystemTime);

impl nexuscrm_worker::Clock for At {
    fn now(&self) -> std::time::SystemTime {
        self.0
    }
}

/// The fenced write under test: records its "now".
fn insert(c: &mut sqlx::AnyConnection, now: i64) -> nexuscrm_persistence::TxFuture<'_, i64> {
    Box::pin(async move {
        sqlx::query(&format!("INSERT INTO fenced_probe (at) VALUES ({now})"))
            .execute(&mut *c)
            .await?;
        Ok(now)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_write_runs_only_while_its_generation_owns_the_family() {
    use nexuscrm_persistence::family;
    use std::sync::Arc;
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(1_900_000_000_123);
    let clock: Arc<dyn nexuscrm_worker::Clock> = Arc::new(At(at));
    for d in DIALECTS {
        let Some(t) = TestDb::create(d, "fenced").await else {
            continue;
        };
        t.db.migrate_ownership().await.unwrap();
        sqlx::query("CREATE TABLE fenced_probe (at BIGINT NOT NULL)")
            .execute(t.db.pool())
            .await
            .unwrap();
        let never = CancellationToken::new();
        let g1 = t.db.take_ownership("probe", 1, "a").await.unwrap();
        // Owned: the work runs with "now" from the clock, and commits.
        let now = family::fenced(&t.db, &g1, &clock, &never, insert)
            .await
            .unwrap();
        assert_eq!(now, 1_900_000_000_123, "{d}");
        // Fenced out by generation 2: superseded, and nothing written.
        t.db.take_ownership("probe", 2, "b").await.unwrap();
        let e = family::fenced(&t.db, &g1, &clock, &never, insert)
            .await
            .unwrap_err();
        assert!(e.is_superseded(), "{d}: {e}");
        assert!(
            e.to_string()
                .contains("generation 1 is fenced out of `probe`"),
            "{e}"
        );
        let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM fenced_probe")
            .fetch_one(t.db.pool())
            .await
            .unwrap();
        assert_eq!(rows, 1, "{d}");
        // Cancelled before it began: provably not committed.
        let cancelled = CancellationToken::new();
        cancelled.cancel();
        let g2 = Fence::new("probe", 2);
        let e = family::fenced(&t.db, &g2, &clock, &cancelled, insert)
            .await
            .unwrap_err();
        assert!(e.is_not_committed(), "{d}: {e}");
        t.drop_database().await;
    }
}

#[test]
fn a_batch_that_filled_every_slot_asks_for_more() {
    use nexuscrm_persistence::family::batch;
    let three = std::num::NonZeroUsize::new(3).unwrap();
    assert!(batch(vec![1, 2, 3], three).has_more());
    assert!(!batch(vec![1, 2], three).has_more());
    assert!(!batch(Vec::<i32>::new(), three).has_more());
}

/// TiDB's definite-rollback errors (8002, 8005, 9007) and the deadlock / certification error
/// (1213) are classified by error number as "rolled back, retry"; a lock wait timeout, a
/// duplicate key and a lost connection are not. The errors are real server errors: MariaDB's
/// `SIGNAL` raises each number with TiDB's generic SQLSTATE, as TiDB itself reports them.
#[tokio::test]
async fn tidb_and_galera_rollback_errors_are_classified_by_number_from_a_real_server() {
    use nexuscrm_persistence::support::is_contention;
    let Some(t) = TestDb::create(Dialect::Mysql, "rollbackcodes").await else {
        return;
    };
    for (number, rolled_back) in [
        (1213, true),
        (8002, true),
        (8005, true),
        (9007, true),
        (1205, false),
        (1062, false),
        (2013, false),
    ] {
        let e = sqlx::query(&format!(
            "SIGNAL SQLSTATE 'HY000' SET MYSQL_ERRNO = {number}, MESSAGE_TEXT = 'signalled {number}'"
        ))
        .execute(t.db.pool())
        .await
        .unwrap_err();
        assert_eq!(
            nexuscrm_persistence::commit_rolled_back(Dialect::Mysql, &e),
            rolled_back,
            "commit error {number}: {e}"
        );
        assert_eq!(
            is_contention(&WriteError::NotCommitted(e)),
            rolled_back,
            "retryable {number}"
        );
    }
    t.drop_database().await;
}

/// Kills the server session behind `db`'s single pooled connection, from another connection.
async fn kill_pooled_session(db: &Db, url: &str) {
    let (pid_sql, kill) = match db.dialect() {
        Dialect::Postgres => ("SELECT CAST(pg_backend_pid() AS BIGINT)", "pg_terminate"),
        _ => ("SELECT CAST(CONNECTION_ID() AS SIGNED)", "kill"),
    };
    let pid: i64 = sqlx::query_scalar(pid_sql)
        .fetch_one(db.pool())
        .await
        .unwrap();
    let other = Db::connect_with(
        url,
        nexuscrm_persistence::DbOptions::default().max_connections(1),
    )
    .await
    .unwrap();
    if kill == "pg_terminate" {
        let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend(CAST($1 AS INTEGER))")
            .bind(pid)
            .fetch_one(other.pool())
            .await
            .unwrap();
        assert!(killed, "session {pid} terminated");
    } else {
        sqlx::query(&format!("KILL {pid}"))
            .execute(other.pool())
            .await
            .unwrap();
    }
    other.pool().close().await;
}

/// A test database on a pool of one connection pinged after `ping_if_idle_for`, with an empty
/// table `p (id)`.
async fn one_connection_db(
    d: Dialect,
    label: &str,
    ping_if_idle_for: std::time::Duration,
) -> Option<TestDb> {
    let options = nexuscrm_persistence::DbOptions::default()
        .max_connections(1)
        .ping_if_idle_for(ping_if_idle_for);
    let t = TestDb::create_with(d, label, options).await?;
    sqlx::query("CREATE TABLE p (id BIGINT PRIMARY KEY)")
        .execute(t.db.pool())
        .await
        .unwrap();
    Some(t)
}

async fn insert_row(db: &Db, id: i64) -> Result<(), WriteError> {
    let sql = match db.dialect() {
        Dialect::Postgres => "INSERT INTO p (id) VALUES ($1)",
        _ => "INSERT INTO p (id) VALUES (?)",
    };
    db.write(&CancellationToken::new(), move |c| {
        Box::pin(async move {
            sqlx::query(sql).bind(id).execute(&mut *c).await?;
            Ok(())
        })
    })
    .await
}

/// The pool pings only a connection idle for `ping_if_idle_for` (1 s by default), so a busy
/// queue spends no round trip per transaction on it. A recently used connection that died is
/// found by the next write's `BEGIN`: not committed (which every family retries), nothing
/// written, and the write after it runs on a new connection. With `ping_if_idle_for(ZERO)`
/// (ping on every acquire) the dead connection is replaced before the write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recently_used_connection_that_died_fails_its_begin_as_not_committed() {
    use nexuscrm_persistence::PING_IF_IDLE_FOR;
    use std::time::Duration;
    assert_eq!(PING_IF_IDLE_FOR, Duration::from_secs(1));
    for d in [Dialect::Postgres, Dialect::Mysql] {
        for ping_every_time in [false, true] {
            // An hour is long enough that no scheduling delay on a loaded machine reaches it.
            let window = if ping_every_time {
                Duration::ZERO
            } else {
                Duration::from_secs(3600)
            };
            let Some(t) = one_connection_db(d, "deadconn", window).await else {
                return;
            };
            kill_pooled_session(&t.db, &t.url).await;
            let first = insert_row(&t.db, 1).await;
            if ping_every_time {
                first.unwrap_or_else(|e| panic!("{d}: the ping replaced the connection: {e}"));
            } else {
                let e = first.expect_err("the dead connection's BEGIN fails");
                assert!(e.is_not_committed(), "{d}: {e:?}");
                let WriteError::NotCommitted(cause) = &e else {
                    unreachable!()
                };
                assert!(
                    nexuscrm_persistence::support::is_connection_lost(cause),
                    "{d}: a dead connection reads as lost: {cause:?}"
                );
            }
            insert_row(&t.db, 2)
                .await
                .unwrap_or_else(|e| panic!("{d}: the next write runs on a new connection: {e}"));
            let stored: Vec<i64> = sqlx::query_scalar("SELECT id FROM p ORDER BY id")
                .fetch_all(t.db.pool())
                .await
                .unwrap();
            let want = if ping_every_time { vec![1, 2] } else { vec![2] };
            assert_eq!(stored, want, "{d}, ping every time: {ping_every_time}");
            t.drop_database().await;
        }
    }
}

/// A domain read (`support::earliest`, behind every family's `next_work_at`) whose connection
/// died in the ping window runs again on a new connection instead of failing: a failed
/// `next_work_at` would leave the controller without its due timer until the backstop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_next_work_read_on_a_connection_that_died_runs_again_on_a_new_one() {
    use std::time::Duration;
    for d in [Dialect::Postgres, Dialect::Mysql] {
        let Some(t) = one_connection_db(d, "deadread", Duration::from_secs(3600)).await else {
            return;
        };
        insert_row(&t.db, 7).await.unwrap();
        kill_pooled_session(&t.db, &t.url).await;
        let earliest = nexuscrm_persistence::support::earliest(&t.db, &["SELECT MIN(id) FROM p"])
            .await
            .unwrap_or_else(|e| panic!("{d}: the read runs again: {e}"));
        assert_eq!(earliest, Some(7), "{d}");
        t.drop_database().await;
    }
}
