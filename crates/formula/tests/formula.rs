//! The Formula View against real SQLite files, PostgreSQL and MariaDB: definitions, derivation
//! through the controller, error values, the roll-up, corruption repair, and idle cost.

mod common;

use std::time::Duration;

use common::*;
use nexuscrm_formula::{Formula, FormulaErrorKind, FormulaOptions};
use nexuscrm_persistence::Dialect;
use nexuscrm_persistence::sqlx;
use nexuscrm_worker::fault::Faults;
use serde_json::json;
use tokio_util::sync::CancellationToken;

fn view(fx: &Fx) -> Formula {
    Formula::without_migrations(fx.t.db.clone(), FormulaOptions::default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn definitions_are_versioned_and_bad_ones_are_refused_with_the_reason() {
    for d in DIALECTS {
        let Some(fx) = fx(d, "defs").await else {
            continue;
        };
        let f = view(&fx);
        let a = f
            .define("weighted", "record.amount * record.probability / 100", None)
            .await
            .unwrap();
        assert!(a.changed);
        let same = f
            .define("weighted", "record.amount * record.probability / 100", None)
            .await
            .unwrap();
        assert!(!same.changed, "{d:?}: an unchanged define is a no-op");
        assert_eq!(same.definition.version, a.definition.version);
        let b = f
            .define("weighted", "record.amount / 2", None)
            .await
            .unwrap();
        assert!(b.definition.version > a.definition.version);
        f.define("label", "record.name + ' (' + record.stage + ')'", None)
            .await
            .unwrap();
        let names: Vec<String> = f
            .list()
            .await
            .unwrap()
            .into_iter()
            .map(|d| d.name)
            .collect();
        assert_eq!(names, ["label", "weighted"]);

        // Syntax: the parser's message and position.
        let e = f
            .define("broken", "record.amount *", None)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), FormulaErrorKind::Invalid);
        assert!(e.to_string().contains("1:16"), "{e}");
        // Unknown names.
        let e = f.define("broken", "amount * 2", None).await.unwrap_err();
        assert!(e.to_string().contains("unknown variable `amount`"), "{e}");
        let e = f.define("broken", "shell(record)", None).await.unwrap_err();
        assert!(e.to_string().contains("unknown function `shell`"), "{e}");
        // A sample record that fails.
        let sample = json!({"amount": 10, "probability": 0});
        let e = f
            .define(
                "broken",
                "record.amount / record.probability",
                Some(&sample),
            )
            .await
            .unwrap_err();
        assert!(e.to_string().contains("fails on the sample record"), "{e}");
        assert!(
            f.define("ok", "record.amount / 2", Some(&sample))
                .await
                .is_ok()
        );
        // Names.
        for bad in ["", "Upper", "1st", "has space", &"x".repeat(65)] {
            let e = f.define(bad, "1", None).await.unwrap_err();
            assert_eq!(e.kind(), FormulaErrorKind::Invalid, "{bad:?}");
        }
        assert!(
            f.get("broken").await.unwrap().is_none(),
            "nothing refused was stored"
        );
        // Drop: a new version, then gone; dropping again is NotFound.
        let v = f.drop_definition("ok").await.unwrap();
        assert!(v > b.definition.version);
        assert_eq!(
            f.drop_definition("ok").await.unwrap_err().kind(),
            FormulaErrorKind::NotFound
        );
        fx.t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_derives_values_errors_and_the_rollup_from_bulk_records() {
    for d in DIALECTS {
        let Some(fx) = fx(d, "derive").await else {
            continue;
        };
        let f = view(&fx);
        f.define("weighted", "record.amount * record.probability / 100", None)
            .await
            .unwrap();
        f.define("per_point", "record.amount / record.probability", None)
            .await
            .unwrap();
        let rows: Vec<_> = (0..40)
            .map(|i| {
                opportunity(
                    i,
                    100 * i as i64,
                    if i % 5 == 0 { "closed_won" } else { "open" },
                )
            })
            .collect();
        apply(&fx, rows).await;
        run_worker(&fx.t.db, 1, Faults::none(), |o| o)
            .await
            .unwrap();
        let (got, want) = (observed(&fx.t.db).await, expected(&fx.t.db).await);
        assert_eq!(got, want, "{d:?}");
        assert_eq!(got.values.len(), 80);
        // opp-00003: amount 300, probability 30.
        let shown = f.show("opp-00003").await.unwrap().expect("derived");
        assert_eq!(shown.source_revision, 1);
        assert!(!shown.stale);
        let w = shown
            .values
            .iter()
            .find(|v| v.formula == "weighted")
            .unwrap();
        assert_eq!(w.value, Some(json!(90)));
        // opp-00010 has probability 0: its error is stored, not a crash, not a null.
        let e = f.show("opp-00010").await.unwrap().unwrap();
        let p = e.values.iter().find(|v| v.formula == "per_point").unwrap();
        assert_eq!(p.value, None);
        assert!(
            p.error.as_deref().unwrap().to_lowercase().contains("zero"),
            "{p:?}"
        );
        let obs = f.observations().await.unwrap();
        assert_eq!(
            obs.records_with_errors, 4,
            "{d:?}: probability 0 for i % 10 == 0"
        );
        assert_eq!(obs.stale, 0);
        // The roll-up: open opportunities per account.
        let acct0: i64 = (0..40)
            .filter(|i| i % 7 == 0 && i % 5 != 0)
            .map(|i| 100 * i as i64)
            .sum();
        let r = got.rollups.iter().find(|r| r.account == "acct-0").unwrap();
        assert_eq!(r.total, acct0);

        // Changes: new revisions, a redefinition and a drop converge too.
        apply(
            &fx,
            (0..10).map(|i| opportunity(i, 7, "closed_lost")).collect(),
        )
        .await;
        f.define("weighted", "record.amount * 2", None)
            .await
            .unwrap();
        f.drop_definition("per_point").await.unwrap();
        run_worker(&fx.t.db, 1, Faults::none(), |o| o)
            .await
            .unwrap();
        let (got, want) = (observed(&fx.t.db).await, expected(&fx.t.db).await);
        assert_eq!(got, want, "{d:?}");
        assert_eq!(got.values.len(), 40);
        assert_eq!(
            f.show("opp-00003").await.unwrap().unwrap().source_revision,
            2
        );
        fx.t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_record_leaves_the_view_and_the_rollup() {
    for d in DIALECTS {
        let Some(fx) = fx(d, "delete").await else {
            continue;
        };
        let f = view(&fx);
        f.define("weighted", "record.amount * 2", None)
            .await
            .unwrap();
        apply(&fx, (0..10).map(|i| opportunity(i, 10, "open")).collect()).await;
        run_worker(&fx.t.db, 1, Faults::none(), |o| o)
            .await
            .unwrap();
        // The records domain deletes two records (Bulk has no delete operation yet; the
        // change log has no entry for a delete, so reconciliation finds it).
        sqlx::query("DELETE FROM crm_record WHERE record_key IN ('opp-00000', 'opp-00007')")
            .execute(fx.t.db.pool())
            .await
            .unwrap();
        run_worker(&fx.t.db, 2, Faults::none(), |o| o)
            .await
            .unwrap();
        let got = observed(&fx.t.db).await;
        assert_eq!(got, expected(&fx.t.db).await, "{d:?}");
        assert_eq!(got.values.len(), 8);
        assert!(f.show("opp-00000").await.unwrap().is_none());
        assert!(
            got.rollups.iter().all(|r| r.account != "acct-0"),
            "{:?}",
            got.rollups
        );
        fx.t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciliation_repairs_exactly_the_rows_edited_by_hand() {
    for d in DIALECTS {
        let Some(fx) = fx(d, "repair").await else {
            continue;
        };
        let f = view(&fx);
        f.define("weighted", "record.amount * 3", None)
            .await
            .unwrap();
        f.define("label", "record.name", None).await.unwrap();
        apply(
            &fx,
            (0..50).map(|i| opportunity(i, i as i64, "open")).collect(),
        )
        .await;
        run_worker(&fx.t.db, 1, Faults::none(), |o| o)
            .await
            .unwrap();
        let clean = observed(&fx.t.db).await;
        let derived_at = |db: nexuscrm_persistence::Db| async move {
            let rows: Vec<(String, i64)> = sqlx::query_as(
                "SELECT record_key, derived_at FROM formula_record ORDER BY record_key",
            )
            .fetch_all(db.pool())
            .await
            .unwrap();
            rows
        };
        let before = derived_at(fx.t.db.clone()).await;
        let exec = |sql: &'static str| {
            let db = fx.t.db.clone();
            async move { sqlx::query(sql).execute(db.pool()).await.unwrap() }
        };
        // Deleted, altered (value only: its digest no longer matches), added (no such record),
        // and a roll-up total changed.
        exec("DELETE FROM formula_value WHERE record_key = 'opp-00001' AND formula = 'weighted'")
            .await;
        exec("UPDATE formula_value SET value = '999' WHERE record_key = 'opp-00002' AND formula = 'label'").await;
        exec("INSERT INTO formula_value (record_key, formula, value, error, source_revision, definition_version, digest) \
              VALUES ('opp-99999', 'weighted', '1', NULL, 1, 1, 'x')").await;
        exec("UPDATE formula_rollup SET total = total + 5 WHERE account = 'acct-3'").await;
        assert_ne!(observed(&fx.t.db).await, clean);

        let formula = Formula::without_migrations(fx.t.db.clone(), options(1, Faults::none()));
        let report = formula
            .source()
            .sweep_all(&CancellationToken::new())
            .await
            .unwrap();
        assert_eq!(
            report.marked, 3,
            "{d:?}: exactly the three edited records: {report:?}"
        );
        assert_eq!(report.rollups_repaired, 1, "{d:?}: {report:?}");
        assert!(report.complete);
        assert_eq!(f.observations().await.unwrap().stale, 3);
        run_worker(&fx.t.db, 1, Faults::none(), |o| o)
            .await
            .unwrap();
        assert_eq!(
            observed(&fx.t.db).await,
            clean,
            "{d:?}: repaired to what canonical state implies"
        );
        let after = derived_at(fx.t.db.clone()).await;
        let rederived: Vec<&str> = before
            .iter()
            .zip(&after)
            .filter(|(b, a)| b.1 != a.1)
            .map(|(b, _)| b.0.as_str())
            .collect();
        assert!(
            rederived
                .iter()
                .all(|k| ["opp-00001", "opp-00002"].contains(k)),
            "{d:?}: only the edited records were rederived: {rederived:?}"
        );
        // A sweep of a converged view marks nothing.
        let report = formula
            .source()
            .sweep_all(&CancellationToken::new())
            .await
            .unwrap();
        assert_eq!((report.marked, report.rollups_repaired), (0, 0), "{d:?}");
        fx.t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rollup_sweep_repairs_accounts_on_every_side_of_its_chunk_boundaries() {
    for d in DIALECTS {
        let Some(fx) = fx(d, "rollupchunks").await else {
            continue;
        };
        let f = view(&fx);
        f.define("weighted", "record.amount * 3", None)
            .await
            .unwrap();
        // 60 accounts of 2 or 3 records each, so ranges of 10 records close inside and at the
        // end of accounts.
        let records: Vec<(String, serde_json::Value)> = (0..130)
            .map(|i| {
                (
                    format!("opp-{i:05}"),
                    serde_json::json!({
                        "name": format!("Deal {i}"),
                        "account": format!("acct-{:03}", i % 60),
                        "amount": i as i64,
                        "stage": "open",
                    }),
                )
            })
            .collect();
        apply(&fx, records).await;
        run_worker(&fx.t.db, 1, Faults::none(), |o| o)
            .await
            .unwrap();
        let clean = observed(&fx.t.db).await;
        let exec = |sql: &'static str| {
            let db = fx.t.db.clone();
            async move { sqlx::query(sql).execute(db.pool()).await.unwrap() }
        };
        // The first account, a middle one, the last one altered; one deleted; two added
        // (before every account and after every account), neither with records.
        exec("UPDATE formula_rollup SET total = total + 1 WHERE account = 'acct-000'").await;
        exec("UPDATE formula_rollup SET records = records + 1 WHERE account = 'acct-024'").await;
        exec("UPDATE formula_rollup SET total = 0 WHERE account = 'acct-059'").await;
        exec("DELETE FROM formula_rollup WHERE account = 'acct-036'").await;
        exec("INSERT INTO formula_rollup (account, total, records) VALUES ('acct-', 7, 1)").await;
        exec("INSERT INTO formula_rollup (account, total, records) VALUES ('zzz', 7, 1)").await;
        assert_ne!(observed(&fx.t.db).await, clean, "{d:?}");
        let formula =
            Formula::without_migrations(fx.t.db.clone(), options(1, Faults::none()).sweep(10, 1));
        let report = formula
            .source()
            .sweep_all(&CancellationToken::new())
            .await
            .unwrap();
        assert_eq!(report.rollups_repaired, 6, "{d:?}: {report:?}");
        assert_eq!(report.marked, 0, "{d:?}: {report:?}");
        assert_eq!(
            observed(&fx.t.db).await,
            clean,
            "{d:?}: repaired by the sweep alone"
        );
        let report = formula
            .source()
            .sweep_all(&CancellationToken::new())
            .await
            .unwrap();
        assert_eq!((report.marked, report.rollups_repaired), (0, 0), "{d:?}");
        fx.t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_chunk_costs_a_bounded_number_of_statements() {
    let Some(fx) = fx(Dialect::Sqlite, "sweepcost").await else {
        return;
    };
    let f = view(&fx);
    f.define("weighted", "record.amount * 3", None)
        .await
        .unwrap();
    apply(
        &fx,
        (0..1000)
            .map(|i| opportunity(i, i as i64, "open"))
            .collect(),
    )
    .await;
    run_worker(&fx.t.db, 1, Faults::none(), |o| o)
        .await
        .unwrap();
    let formula =
        Formula::without_migrations(fx.t.db.clone(), options(1, Faults::none()).sweep(100, 1));
    let report = formula
        .source()
        .sweep_all(&CancellationToken::new())
        .await
        .unwrap();
    // 1000 records and 1000 entries in chunks of 100 (10 + a short last one each): 2
    // statements per records chunk, 3 per view chunk. The roll-up is chunked by records, not
    // accounts: 7 accounts of ~143 records each are 7 ranges (each closes at the account of
    // the 100th record after the cursor, so takes the whole account) and an empty tail, 3
    // statements each; none to repair, plus the fence check of each chunk's transaction (not
    // counted). A whole-table aggregate would have been one chunk.
    assert_eq!(report.chunks, 11 + 11 + 8, "{report:?}");
    assert_eq!(report.statements, 11 * 2 + 11 * 3 + 8 * 3, "{report:?}");
    assert_eq!(report.marked, 0);
    fx.t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_postgres_view_issues_no_statements_between_changes() {
    let Some(fx) = fx(Dialect::Postgres, "idle").await else {
        return;
    };
    let f = view(&fx);
    f.define("weighted", "record.amount * 3", None)
        .await
        .unwrap();
    apply(
        &fx,
        (0..20).map(|i| opportunity(i, i as i64, "open")).collect(),
    )
    .await;
    let formula = Formula::without_migrations(
        fx.t.db.clone(),
        FormulaOptions::default()
            .listen(true)
            .generation_poll(Some(Duration::from_secs(1))),
    );
    formula.take_ownership("test").await.unwrap();
    let ctl = nexuscrm_worker::Controller::new(formula.source(), controller("formula", 2)).unwrap();
    formula.set_waker(ctl.waker());
    let handle = ctl.handle();
    let cancel = CancellationToken::new();
    let run = tokio::spawn(ctl.run(cancel.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !(handle.snapshot().in_flight == 0 && idle(&formula).await) {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let since: i64 =
        sqlx::query_scalar("SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)")
            .fetch_one(fx.t.db.pool())
            .await
            .unwrap();
    let claims = handle.snapshot().claim_calls;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let busy: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND pid <> pg_backend_pid() AND query NOT LIKE '%pg_stat_activity%' \
         AND query NOT LIKE '%clock_timestamp%' \
         AND CAST(EXTRACT(EPOCH FROM query_start) * 1000 AS BIGINT) > $1",
    )
    .bind(since)
    .fetch_one(fx.t.db.pool())
    .await
    .unwrap();
    assert_eq!(busy, 0, "an idle view issued statements");
    assert_eq!(handle.snapshot().claim_calls, claims, "no claim while idle");
    // A change in another process (Bulk announcing record changes) is noticed through NOTIFY.
    let other = nexuscrm_bulk::Bulk::without_migrations(
        fx.t.db.clone(),
        1,
        nexuscrm_bulk::BulkOptions::default()
            .config(bulk_config().listen(true).announce_records(true)),
    );
    let fx2 = Fx {
        t: nexuscrm_persistence::testing::TestDb::create(Dialect::Sqlite, "unused")
            .await
            .unwrap(),
        bulk: other,
        jobs: std::sync::atomic::AtomicUsize::new(100),
    };
    apply(&fx2, vec![opportunity(3, 1234, "open")]).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let v = f.show("opp-00003").await.unwrap().unwrap();
        if v.source_revision == 2 && !v.stale {
            assert_eq!(v.values[0].value, Some(json!(3702)));
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the change was not noticed: {v:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(handle.snapshot().generation_changes >= 1);
    cancel.cancel();
    run.await.unwrap().unwrap();
    fx2.t.drop_database().await;
    fx.t.drop_database().await;
}

/// Change-log ids are allocated at insert and become visible at commit, so a writer can commit
/// an id below one the cursor has already passed. The cursor remembers the id it skipped and
/// finds the entry on a later claim: the record is rederived without waiting for a sweep.
/// (SQLite has one writer at a time, so its ids always commit in order.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_committed_after_a_higher_id_is_still_found_by_the_cursor() {
    use nexuscrm_worker::Source;
    for d in [Dialect::Postgres, Dialect::Mysql] {
        let Some(fx) = fx(d, "latecommit").await else {
            continue;
        };
        let f = view(&fx);
        f.define("weighted", "record.amount * 2", None)
            .await
            .unwrap();
        apply(
            &fx,
            vec![opportunity(0, 10, "open"), opportunity(1, 20, "open")],
        )
        .await;
        run_worker(&fx.t.db, 1, Faults::none(), |o| o)
            .await
            .unwrap();
        // A writer allocates the next change id for opp-00000 and holds its transaction open
        // (a Bulk segment slower than the next one) ...
        let mut late = fx.t.db.pool().begin().await.unwrap();
        sqlx::query(
            "UPDATE crm_record SET revision = 2, data = '{\"amount\": 50, \"stage\": \"open\", \
             \"probability\": 10, \"account\": \"acct-0\"}' WHERE record_key = 'opp-00000'",
        )
        .execute(&mut *late)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO crm_record_change (job_id, ordinal, record_key, revision, applied_at) \
             VALUES (0, 0, 'opp-00000', 2, 0)",
        )
        .execute(&mut *late)
        .await
        .unwrap();
        // ... while Bulk commits a higher id for opp-00001, and a worker drains past it.
        apply(&fx, vec![opportunity(1, 30, "open")]).await;
        run_worker(&fx.t.db, 2, Faults::none(), |o| o)
            .await
            .unwrap();
        assert_eq!(
            f.show("opp-00001").await.unwrap().unwrap().source_revision,
            2
        );
        assert_eq!(
            f.show("opp-00000").await.unwrap().unwrap().source_revision,
            1
        );
        late.commit().await.unwrap();
        // No sweep: one claim by the process that is running finds the late entry.
        let owner = Formula::without_migrations(fx.t.db.clone(), options(2, Faults::none()));
        let batch = owner
            .source()
            .claim(
                std::num::NonZeroUsize::new(2).unwrap(),
                CancellationToken::new(),
            )
            .await
            .unwrap();
        let keys: Vec<&str> = batch
            .attempts()
            .iter()
            .flat_map(|a| a.keys())
            .map(String::as_str)
            .collect();
        assert_eq!(keys, ["opp-00000"], "{d:?}: the late change is claimed");
        drop(batch);
        // Once found, the skipped id is forgotten: the cursor holds no gap rows any more.
        let gaps: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM formula_cursor WHERE name LIKE 'gap:%'")
                .fetch_one(fx.t.db.pool())
                .await
                .unwrap();
        assert_eq!(gaps, 0, "{d:?}");
        run_worker(&fx.t.db, 3, Faults::none(), |o| o)
            .await
            .unwrap();
        let (got, want) = (observed(&fx.t.db).await, expected(&fx.t.db).await);
        assert_eq!(got, want, "{d:?}");
        fx.t.drop_database().await;
    }
}
