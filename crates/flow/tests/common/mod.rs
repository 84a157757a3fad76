//! Helpers shared by the Scheduled Flow tests: an isolated database per test, a settable wall
//! clock, workers that restart like the Runtime Worker, and checks that read the database.

#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use nexuscrm_flow::{Flow, FlowConfig, FlowOptions};
use nexuscrm_persistence::sqlx::{self, Row};
use nexuscrm_persistence::testing::TestDb;
use nexuscrm_persistence::{Db, Dialect};
use nexuscrm_worker::{Config, Controller, RunErrorKind};
use tokio_util::sync::CancellationToken;

pub const DIALECTS: [Dialect; 3] = [Dialect::Sqlite, Dialect::Postgres, Dialect::Mysql];

#[allow(unused_imports)]
pub use nexuscrm_worker_test::ManualClock;

pub fn test_config() -> FlowConfig {
    FlowConfig::default()
        .lease(Duration::from_secs(10))
        .retry_backoff(Duration::from_millis(100))
        .generation_poll(None)
}

pub async fn flow_on(d: Dialect, label: &str, options: FlowOptions) -> Option<(TestDb, Flow)> {
    let t = TestDb::create(d, label).await?;
    let flow = Flow::open(t.db.clone(), 1, options).await.expect("migrate");
    flow.take_ownership("test").await.expect("own");
    Some((t, flow))
}

pub fn controller_config(name: &str, capacity: usize) -> Config {
    Config::new(name)
        .capacity(NonZeroUsize::new(capacity).unwrap())
        .shutdown_timeout(Duration::from_secs(20))
}

/// Runs controllers over `flow` until `cancel`, building a fresh one when a controller stops
/// on a proven rollback it could not resolve (as the Runtime Worker does). Any other stop is a
/// test failure.
pub async fn worker(flow: Flow, config: Config, cancel: CancellationToken) -> u64 {
    worker_with(flow, config, cancel, None).await
}

/// [`worker`], publishing the controller's handle (for diagnostics).
pub async fn worker_with(
    flow: Flow,
    config: Config,
    cancel: CancellationToken,
    sink: Option<Arc<Mutex<Vec<nexuscrm_worker::ControllerHandle>>>>,
) -> u64 {
    let mut ctl = Controller::new(flow.source(), config).expect("config");
    flow.set_waker(ctl.waker());
    if let Some(sink) = sink {
        sink.lock().unwrap().push(ctl.handle());
    }
    loop {
        match ctl.run(cancel.clone()).await {
            Ok(ctl) => return ctl.handle().snapshot().attempts_claimed,
            Err(e) => {
                assert_eq!(e.kind(), RunErrorKind::NotCommitted, "{e}");
                ctl = e
                    .into_controller()
                    .expect("a not-committed stop hands the controller back");
                if cancel.is_cancelled() {
                    return ctl.handle().snapshot().attempts_claimed;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Every run's occurrence, per schedule id, ascending, read from the database.
pub async fn runs_by_schedule(db: &Db) -> BTreeMap<i64, Vec<i64>> {
    let rows = sqlx::query(
        "SELECT schedule_id, occurrence_at FROM flow_run ORDER BY schedule_id, occurrence_at",
    )
    .fetch_all(db.pool())
    .await
    .unwrap();
    let mut out: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for r in rows {
        out.entry(r.try_get(0).unwrap())
            .or_default()
            .push(r.try_get(1).unwrap());
    }
    out
}

/// Each schedule's cursor (`next_occurrence_at`), read from the database.
pub async fn cursors(db: &Db) -> BTreeMap<i64, Option<i64>> {
    let rows = sqlx::query("SELECT id, next_occurrence_at FROM flow_schedule ORDER BY id")
        .fetch_all(db.pool())
        .await
        .unwrap();
    rows.iter()
        .map(|r| (r.try_get(0).unwrap(), r.try_get(1).unwrap()))
        .collect()
}

/// Total runs and distinct (schedule, occurrence) pairs.
pub async fn run_counts(db: &Db) -> (i64, i64) {
    let total: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM flow_run")
        .fetch_one(db.pool())
        .await
        .unwrap();
    let distinct: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM (SELECT DISTINCT schedule_id, occurrence_at FROM flow_run) d",
    )
    .fetch_one(db.pool())
    .await
    .unwrap();
    (total, distinct)
}

/// Checks that schedule `id` with interval `every_ms` starting at `start` has exactly one run
/// per occurrence from `start` up to (not including) its cursor, and nothing else.
pub fn assert_exact(
    label: &str,
    id: i64,
    start: i64,
    every_ms: i64,
    runs: &[i64],
    cursor: Option<i64>,
) {
    let cursor = cursor.unwrap_or_else(|| panic!("{label}: schedule {id} has no cursor"));
    assert!(
        cursor >= start,
        "{label}: schedule {id} cursor before start"
    );
    let want: Vec<i64> = (0..)
        .map(|k| start + k * every_ms)
        .take_while(|&t| t < cursor)
        .collect();
    assert_eq!(
        runs,
        &want[..],
        "{label}: schedule {id}: runs must be every occurrence before the cursor, once"
    );
}

/// Waits (real time, bounded) until every schedule's cursor is past `t`.
pub async fn wait_cursors_past(db: &Db, t: i64, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let c = cursors(db).await;
        if !c.is_empty() && c.values().all(|v| v.is_some_and(|v| v > t)) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "cursors did not pass {t} within {within:?}: {c:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn ms(t: SystemTime) -> i64 {
    nexuscrm_persistence::support::to_ms(t)
}

/// `t` rounded up to a whole second.
pub fn next_second(t: SystemTime) -> SystemTime {
    let m = ms(t);
    nexuscrm_persistence::support::from_ms((m / 1000 + 1) * 1000)
}
