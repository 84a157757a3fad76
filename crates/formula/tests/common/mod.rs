//! Helpers shared by the Formula View tests: an isolated database per test with Bulk (the
//! records domain) and the view, record changes applied through Bulk, a worker run to
//! convergence, and the view read back and recomputed from canonical state.

#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::time::Duration;

use nexuscrm_bulk::{Bulk, BulkConfig, BulkOptions, NewJob, RowInput};
use nexuscrm_formula::{DerivedValue, Formula, FormulaOptions, Rollup};
use nexuscrm_persistence::sqlx::{self, Row};
use nexuscrm_persistence::support::{optional_text, text};
use nexuscrm_persistence::testing::TestDb;
use nexuscrm_persistence::{Db, Dialect};
use nexuscrm_worker::fault::Faults;
use nexuscrm_worker::{Config, Controller, Source};
use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;

pub const DIALECTS: [Dialect; 3] = [Dialect::Sqlite, Dialect::Postgres, Dialect::Mysql];

pub struct Fx {
    pub t: TestDb,
    pub bulk: Bulk,
    pub jobs: std::sync::atomic::AtomicUsize,
}

pub fn bulk_config() -> BulkConfig {
    BulkConfig::default()
        .lease(Duration::from_secs(10))
        .backoff(Duration::from_millis(50), Duration::from_millis(200))
        .generation_poll(None)
        .default_segment_size(500)
}

pub async fn fx(d: Dialect, label: &str) -> Option<Fx> {
    let t = TestDb::create(d, label).await?;
    let bulk = Bulk::open(
        t.db.clone(),
        1,
        BulkOptions::default().config(bulk_config()),
    )
    .await
    .expect("migrate bulk");
    bulk.take_ownership("test").await.expect("own bulk");
    Formula::open(t.db.clone(), FormulaOptions::default())
        .await
        .expect("migrate formula");
    Some(Fx {
        t,
        bulk,
        jobs: std::sync::atomic::AtomicUsize::new(0),
    })
}

/// Options for a worker "process" of `generation` with `faults`.
pub fn options(generation: i64, faults: Faults) -> FormulaOptions {
    FormulaOptions::default()
        .generation(generation)
        .generation_poll(None)
        .listen(false)
        .lease(Duration::from_secs(30))
        .faults(faults)
}

pub fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        other => panic!("not an object: {other}"),
    }
}

/// Applies `rows` as one Bulk job and runs Bulk until it is done.
pub async fn apply(fx: &Fx, rows: Vec<(String, Value)>) {
    let n = fx.jobs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let rows: Vec<RowInput> = rows
        .into_iter()
        .map(|(k, v)| RowInput::new(k, object(v)))
        .collect();
    let id = fx
        .bulk
        .submit(NewJob::new(format!("formula-test-{n}"), rows))
        .await
        .expect("submit")
        .job;
    let ctl = Controller::new(fx.bulk.source(), controller("bulk", 2)).unwrap();
    fx.bulk.set_waker(ctl.waker());
    let cancel = CancellationToken::new();
    let run = tokio::spawn(ctl.run(cancel.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    loop {
        let s = fx.bulk.status(id).await.unwrap().expect("job");
        if s.is_terminal() {
            assert_eq!(s.state, "succeeded", "{s:?}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "bulk job not done: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cancel.cancel();
    run.await.unwrap().expect("bulk drains");
}

pub fn controller(name: &str, capacity: usize) -> Config {
    Config::new(name)
        .capacity(NonZeroUsize::new(capacity).unwrap())
        .shutdown_timeout(Duration::from_secs(20))
}

/// Whether the view has nothing left to do: no due record and no backlog.
pub async fn idle(formula: &Formula) -> bool {
    formula.observations().await.unwrap().stale == 0
        && formula
            .source()
            .next_work_at(CancellationToken::new())
            .await
            .unwrap()
            .is_none()
}

/// Runs one worker process (`generation`, `faults`) until the view is idle (`Ok`) or an
/// injected crash stops it (`Err`).
pub async fn run_worker(
    db: &Db,
    generation: i64,
    faults: Faults,
    opts: impl FnOnce(FormulaOptions) -> FormulaOptions,
) -> Result<(), String> {
    let formula =
        Formula::without_migrations(db.clone(), opts(options(generation, faults.clone())));
    formula
        .take_ownership("test")
        .await
        .map_err(|e| e.to_string())?;
    let ctl = Controller::new(formula.source(), controller("formula", 2)).unwrap();
    formula.set_waker(ctl.waker());
    let handle = ctl.handle();
    let cancel = CancellationToken::new();
    let mut run = tokio::spawn(ctl.run(cancel.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    loop {
        tokio::select! {
            r = &mut run => {
                let r = r.unwrap();
                return match r {
                    Ok(_) => Err("the controller stopped by itself".into()),
                    Err(e) if faults.is_crashed() => Err(format!("crashed: {e}")),
                    Err(e) => panic!("the formula controller failed: {e}"),
                };
            }
            () = tokio::time::sleep(Duration::from_millis(25)) => {}
        }
        if faults.is_crashed() {
            cancel.cancel();
            let _ = run.await;
            return Err("crashed".into());
        }
        let snap = handle.snapshot();
        if snap.reconciles.total() > 0 && snap.in_flight == 0 && idle(&formula).await {
            cancel.cancel();
            run.await.unwrap().map_err(|e| e.to_string())?;
            return Ok(());
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the view did not converge: {:?}",
            formula.observations().await
        );
    }
}

/// The stored view, as comparable values.
#[derive(Debug, Clone, PartialEq)]
pub struct View {
    pub values: Vec<(String, DerivedValue)>,
    pub rollups: Vec<Rollup>,
}

pub async fn observed(db: &Db) -> View {
    let rows = sqlx::query(
        "SELECT record_key, formula, value, error, source_revision, definition_version \
         FROM formula_value",
    )
    .fetch_all(db.pool())
    .await
    .unwrap();
    let mut values: Vec<(String, DerivedValue)> = rows
        .iter()
        .map(|r| {
            let value: Option<String> = optional_text(r, 2).unwrap();
            (
                text(r, 0).unwrap(),
                DerivedValue {
                    formula: text(r, 1).unwrap(),
                    value: value.map(|v| serde_json::from_str(&v).unwrap()),
                    error: optional_text(r, 3).unwrap(),
                    source_revision: r.try_get(4).unwrap(),
                    definition_version: r.try_get(5).unwrap(),
                },
            )
        })
        .collect();
    values.sort_by(|a, b| (&a.0, &a.1.formula).cmp(&(&b.0, &b.1.formula)));
    let formula = Formula::without_migrations(db.clone(), FormulaOptions::default());
    let mut rollups = formula.rollups(1_000_000).await.unwrap();
    rollups.sort();
    View { values, rollups }
}

/// Canonical records, read directly.
pub async fn records(db: &Db) -> Vec<nexuscrm_bulk::records::Record> {
    let rows = sqlx::query("SELECT record_key, revision, data FROM crm_record")
        .fetch_all(db.pool())
        .await
        .unwrap();
    rows.iter()
        .map(|r| nexuscrm_bulk::records::Record {
            key: text(r, 0).unwrap(),
            revision: r.try_get(1).unwrap(),
            data: serde_json::from_str(&text(r, 2).unwrap()).unwrap(),
        })
        .collect()
}

/// What canonical state implies.
pub async fn expected(db: &Db) -> View {
    let formula = Formula::without_migrations(db.clone(), FormulaOptions::default());
    let defs = formula.list().await.unwrap();
    let (values, mut rollups) = nexuscrm_formula::recompute(&defs, &records(db).await);
    rollups.sort();
    View { values, rollups }
}

/// Every record's view revision (for monotonicity checks).
pub async fn view_revisions(db: &Db) -> BTreeMap<String, i64> {
    let rows = sqlx::query("SELECT record_key, source_revision FROM formula_value")
        .fetch_all(db.pool())
        .await
        .unwrap();
    let mut out = BTreeMap::new();
    for r in &rows {
        let k = text(r, 0).unwrap();
        let v: i64 = r.try_get(1).unwrap();
        let e = out.entry(k).or_insert(v);
        *e = (*e).max(v);
    }
    out
}

/// A sample opportunity.
pub fn opportunity(i: usize, amount: i64, stage: &str) -> (String, Value) {
    (
        format!("opp-{i:05}"),
        serde_json::json!({
            "name": format!("Deal {i}"),
            "account": format!("acct-{}", i % 7),
            "amount": amount,
            "probability": (i % 10) as i64 * 10,
            "stage": stage,
        }),
    )
}
