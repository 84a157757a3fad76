//! The convergence proofs of the Formula View (`derived-reconcilable / convergent`), on SQLite,
//! PostgreSQL and MariaDB:
//!
//! - the kit's [`ConvergenceHarness`]: canonical records change through Bulk, a worker crashes
//!   at each point while deriving, records change again, and a *fresh* worker (a new
//!   generation, no memory of the changes) converges the view to exactly what canonical state
//!   implies;
//! - a property test: random interleavings of record upserts (through Bulk) and deletes,
//!   definition defines, redefines and drops, and worker crashes at random points; after a
//!   fresh worker's reconciliation and drain the view equals its recomputation, and no view
//!   row ever went back to an older revision;
//! - four replicas converging one burst of changes.

mod common;

use std::sync::atomic::{AtomicI64, Ordering};

use common::*;
use nexuscrm_formula::{DECLARATION, Formula, FormulaOptions};
use nexuscrm_persistence::Dialect;
use nexuscrm_persistence::sqlx;
use nexuscrm_worker::BoxError;
use nexuscrm_worker::fault::{CrashPoint, Faults};
use nexuscrm_worker_test::harness::{ConvergenceHarness, ConvergentFamily};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};

struct FormulaFamily(Dialect);

struct Fixture {
    fx: Fx,
    generation: AtomicI64,
}

impl ConvergentFamily for FormulaFamily {
    type Fixture = Fixture;
    type State = View;

    fn label(&self) -> String {
        format!("formula/{}", self.0.as_str())
    }

    fn declaration(&self) -> nexuscrm_worker::Declaration {
        DECLARATION
    }

    async fn fixture(&self) -> Result<Fixture, BoxError> {
        let fx = fx(self.0, "harness").await.ok_or("database unavailable")?;
        let f = Formula::without_migrations(fx.t.db.clone(), FormulaOptions::default());
        f.define("weighted", "record.amount * record.probability / 100", None)
            .await?;
        f.define("per_point", "record.amount / record.probability", None)
            .await?;
        Ok(Fixture {
            fx,
            generation: AtomicI64::new(1),
        })
    }

    async fn change(&self, fixture: &Fixture, step: usize) -> Result<(), BoxError> {
        // New records and new revisions of earlier ones; a redefinition half-way.
        let rows = (0..6)
            .map(|i| {
                opportunity(
                    step * 3 + i,
                    (step * 10 + i) as i64,
                    if i == 0 { "closed" } else { "open" },
                )
            })
            .collect();
        apply(&fixture.fx, rows).await;
        if step == 6 {
            let f = Formula::without_migrations(fixture.fx.t.db.clone(), FormulaOptions::default());
            f.define("weighted", "record.amount * 2", None).await?;
        }
        Ok(())
    }

    async fn derive(
        &self,
        fixture: &Fixture,
        faults: Faults,
        _cancel: tokio_util::sync::CancellationToken,
    ) -> Result<(), BoxError> {
        let generation = fixture.generation.fetch_add(1, Ordering::SeqCst);
        run_worker(&fixture.fx.t.db, generation, faults, |o| o.batch(10, 1))
            .await
            .map_err(Into::into)
    }

    async fn expected(&self, fixture: &Fixture) -> Result<View, BoxError> {
        Ok(expected(&fixture.fx.t.db).await)
    }

    async fn observed(&self, fixture: &Fixture) -> Result<View, BoxError> {
        Ok(observed(&fixture.fx.t.db).await)
    }
}

#[test]
fn a_fresh_worker_converges_after_a_crash_at_every_point() {
    for d in DIALECTS {
        if !available(d) {
            continue;
        }
        let report = ConvergenceHarness::new(FormulaFamily(d)).run();
        eprintln!("{report}");
        report.assert_passed();
    }
}

fn available(d: Dialect) -> bool {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(nexuscrm_persistence::testing::available(d))
}

#[derive(Debug, Clone)]
enum Op {
    /// Upsert these records (index, amount, stage) through one Bulk job.
    Upsert(Vec<(usize, i64, &'static str)>),
    /// The records domain deletes a record.
    Delete(usize),
    /// Define (or redefine) formula `f{0}` as expression number `1`.
    Define(usize, usize),
    /// Drop formula `f{0}` (if defined).
    Drop(usize),
    /// A worker crashed at this point while deriving (if it reaches it).
    Crash(usize),
}

const EXPRESSIONS: [&str; 5] = [
    "record.amount * 2",
    "record.amount / record.probability",
    "record.stage == 'open' ? record.amount : 0",
    "record.name + '/' + string(revision)",
    "record.missing_field + 1",
];

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => prop::collection::vec((0usize..12, -50i64..500, prop::sample::select(vec!["open", "closed_won", "won"])), 1..6).prop_map(Op::Upsert),
        1 => (0usize..12).prop_map(Op::Delete),
        2 => (0usize..3, 0usize..EXPRESSIONS.len()).prop_map(|(f, e)| Op::Define(f, e)),
        1 => (0usize..3).prop_map(Op::Drop),
        2 => (0usize..CrashPoint::ALL.len()).prop_map(Op::Crash),
    ]
}

async fn run_case(d: Dialect, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let Some(fx) = fx(d, "prop").await else {
        return Ok(());
    };
    let db = fx.t.db.clone();
    let f = Formula::without_migrations(db.clone(), FormulaOptions::default());
    let mut generation = 1;
    let mut seen = std::collections::BTreeMap::new();
    let mut check_monotonic =
        |now: std::collections::BTreeMap<String, i64>| -> Result<(), TestCaseError> {
            for (k, r) in &now {
                if let Some(prev) = seen.get(k) {
                    prop_assert!(r >= prev, "{k} went back from revision {prev} to {r}");
                }
            }
            seen = now;
            Ok(())
        };
    for op in ops {
        match op {
            Op::Upsert(rows) => {
                let mut keys = std::collections::HashSet::new();
                let rows: Vec<_> = rows
                    .into_iter()
                    .filter(|(i, _, _)| keys.insert(*i))
                    .map(|(i, amount, stage)| opportunity(i, amount, stage))
                    .collect();
                apply(&fx, rows).await;
            }
            Op::Delete(i) => {
                sqlx::query(
                    "DELETE FROM crm_record WHERE record_key = ?"
                        .replace('?', if d == Dialect::Postgres { "$1" } else { "?" })
                        .as_str(),
                )
                .bind(format!("opp-{i:05}"))
                .execute(db.pool())
                .await
                .unwrap();
            }
            Op::Define(n, e) => {
                f.define(&format!("f{n}"), EXPRESSIONS[e], None)
                    .await
                    .unwrap();
            }
            Op::Drop(n) => {
                let _ = f.drop_definition(&format!("f{n}")).await;
            }
            Op::Crash(p) => {
                let faults = Faults::new();
                faults.arm(CrashPoint::ALL[p]);
                let _ = run_worker(&db, generation, faults, |o| o.batch(3, 1)).await;
                generation += 1;
                check_monotonic(view_revisions(&db).await)?;
            }
        }
    }
    run_worker(&db, generation, Faults::none(), |o| o.batch(3, 1))
        .await
        .unwrap();
    check_monotonic(view_revisions(&db).await)?;
    let (got, want) = (observed(&db).await, expected(&db).await);
    fx.t.drop_database().await;
    prop_assert_eq!(got, want);
    Ok(())
}

/// Cases per dialect: `NEXUSCRM_FORMULA_CASES` (CI: 6; the documented full run: 100).
fn cases() -> u32 {
    std::env::var("NEXUSCRM_FORMULA_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6)
}

#[test]
fn random_interleavings_with_crashes_converge_to_canonical_state() {
    for d in DIALECTS {
        if !available(d) {
            continue;
        }
        let mut runner = TestRunner::new(ProptestConfig {
            cases: cases(),
            failure_persistence: None,
            ..ProptestConfig::default()
        });
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let result = runner.run(&prop::collection::vec(op(), 1..10), |ops| {
            rt.block_on(run_case(d, ops))
        });
        if let Err(e) = result {
            panic!("{d:?}: {e}");
        }
    }
}

/// Records in the four-replica burst: `NEXUSCRM_FORMULA_BURST` (CI: 5,000; the issue's
/// figure, 100,000, in the documented full run).
fn burst() -> usize {
    std::env::var("NEXUSCRM_FORMULA_BURST")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000)
}

#[test]
fn four_replicas_converge_one_burst_with_the_last_revision_winning() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for d in [Dialect::Postgres, Dialect::Mysql, Dialect::Sqlite] {
        rt.block_on(async move {
            let Some(fx) = fx(d, "replicas").await else {
                return;
            };
            let db = fx.t.db.clone();
            let f = Formula::without_migrations(db.clone(), FormulaOptions::default());
            f.define("weighted", "record.amount * record.probability / 100", None)
                .await
                .unwrap();
            f.take_ownership("test").await.unwrap();
            let n = burst();
            // A second revision of every tenth record lands while the replicas run.
            let replicas: Vec<_> = (0..4)
                .map(|r| {
                    let db = db.clone();
                    tokio::spawn(async move {
                        let formula = Formula::without_migrations(
                            db.clone(),
                            options(1, Faults::none()).batch(25, 25),
                        );
                        let ctl = nexuscrm_worker::Controller::new(
                            formula.source(),
                            controller(&format!("formula-{r}"), 4),
                        )
                        .unwrap();
                        formula.set_waker(ctl.waker());
                        let waker = ctl.waker();
                        let handle = ctl.handle();
                        let cancel = tokio_util::sync::CancellationToken::new();
                        let run = tokio::spawn(ctl.run(cancel.clone()));
                        (formula, handle, cancel, run, waker)
                    })
                })
                .collect();
            let mut running = Vec::new();
            for r in replicas {
                running.push(r.await.unwrap());
            }
            // Every replica finishes its startup reconciliation (a full sweep) before the
            // burst, and hears of Bulk's segments through its waker, so the split below is
            // decided by claims, not by which replica happened to start first.
            let ready_by = tokio::time::Instant::now() + std::time::Duration::from_secs(120);
            while !running.iter().all(|r| r.1.snapshot().ready) {
                assert!(
                    tokio::time::Instant::now() < ready_by,
                    "{d:?}: replicas not ready"
                );
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            for r in &running {
                fx.bulk.watch_records(r.4.clone());
            }
            apply(
                &fx,
                (0..n).map(|i| opportunity(i, i as i64, "open")).collect(),
            )
            .await;
            apply(
                &fx,
                (0..n)
                    .step_by(10)
                    .map(|i| opportunity(i, 1_000_000 + i as i64, "open"))
                    .collect(),
            )
            .await;
            let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(600);
            loop {
                let busy = running.iter().any(|r| r.1.snapshot().in_flight > 0);
                if !busy && idle(&running[0].0).await {
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{d:?}: not converged"
                );
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            let mut attempts = Vec::new();
            for (_, handle, cancel, run, _) in running {
                attempts.push(handle.snapshot().attempts_completed);
                cancel.cancel();
                run.await.unwrap().unwrap();
            }
            let (got, want) = (observed(&db).await, expected(&db).await);
            assert_eq!(got.values.len(), n, "{d:?}");
            assert!(got == want, "{d:?}: the view differs from canonical state");
            let last: Option<(i64,)> = sqlx::query_as(
                "SELECT source_revision FROM formula_value WHERE record_key = 'opp-00010'",
            )
            .fetch_optional(db.pool())
            .await
            .unwrap();
            assert_eq!(last, Some((2,)), "{d:?}: the last revision wins");
            let working = attempts.iter().filter(|a| **a > 0).count();
            eprintln!("{d:?}: {n} records, attempts per replica {attempts:?}");
            assert!(
                working >= 2,
                "{d:?}: work was not split across replicas: {attempts:?}"
            );
            fx.t.drop_database().await;
        });
    }
}
