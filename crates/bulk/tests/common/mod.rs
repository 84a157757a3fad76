//! Helpers shared by the Bulk tests: an isolated database per test, sample rows, and checks
//! that read the database (never the worker's own report).

#![allow(dead_code, unreachable_pub)]

use std::num::NonZeroUsize;
use std::time::Duration;

use nexuscrm_bulk::{Bulk, BulkConfig, BulkOptions, JobId, NewJob, RowInput};
use nexuscrm_persistence::sqlx::{self, Row};
use nexuscrm_persistence::testing::TestDb;
use nexuscrm_persistence::{Db, Dialect};
use nexuscrm_worker::{Config, Controller};
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

pub const DIALECTS: [Dialect; 3] = [Dialect::Sqlite, Dialect::Postgres, Dialect::Mysql];

pub fn test_config() -> BulkConfig {
    BulkConfig::default()
        .lease(Duration::from_secs(10))
        .backoff(Duration::from_millis(50), Duration::from_millis(200))
        .generation_poll(None)
}

pub async fn bulk_on(d: Dialect, label: &str, generation: i64) -> Option<(TestDb, Bulk)> {
    let t = TestDb::create(d, label).await?;
    let bulk = Bulk::open(
        t.db.clone(),
        generation,
        BulkOptions::default().config(test_config()),
    )
    .await
    .expect("migrate");
    bulk.take_ownership("test").await.expect("own");
    Some((t, bulk))
}

pub fn fields(job: usize, row: usize) -> Map<String, Value> {
    match json!({"name": format!("record {job}-{row}"), "n": row}) {
        Value::Object(m) => m,
        _ => unreachable!(),
    }
}

pub fn rows(job: usize, n: usize) -> Vec<RowInput> {
    (0..n)
        .map(|i| RowInput::new(format!("rec-{job}-{i}"), fields(job, i)))
        .collect()
}

pub fn job(job: usize, n: usize, segment: u32) -> NewJob {
    let mut j = NewJob::new(format!("job-{job}"), rows(job, n));
    j.segment_size = Some(segment);
    j
}

pub fn controller_config(name: &str, capacity: usize) -> Config {
    Config::new(name)
        .capacity(NonZeroUsize::new(capacity).unwrap())
        .shutdown_timeout(Duration::from_secs(20))
}

/// Runs a controller over `bulk` until every listed job is terminal, then drains it.
pub async fn drain(bulk: &Bulk, capacity: usize, jobs: &[JobId]) {
    let ctl = Controller::new(bulk.source(), controller_config("bulk", capacity)).unwrap();
    bulk.set_waker(ctl.waker());
    let cancel = CancellationToken::new();
    let mut run = tokio::spawn(ctl.run(cancel.clone()));
    tokio::select! {
        () = wait_terminal(bulk, jobs, Duration::from_secs(120)) => {}
        r = &mut run => panic!("the controller stopped before the jobs were done: {:?}", r.unwrap().err()),
    }
    cancel.cancel();
    run.await.unwrap().expect("clean drain");
}

pub async fn wait_terminal(bulk: &Bulk, jobs: &[JobId], within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let mut all = true;
        for j in jobs {
            let s = bulk.status(*j).await.unwrap().expect("job exists");
            if !s.is_terminal() {
                all = false;
                break;
            }
        }
        if all {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            let mut states = Vec::new();
            for j in jobs.iter().take(5) {
                states.push(bulk.status(*j).await.unwrap());
            }
            panic!(
                "jobs not terminal within {within:?} on {}: {states:#?}",
                bulk.db().dialect()
            );
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn scalar(db: &Db, sql: &str) -> i64 {
    sqlx::query(sql)
        .fetch_one(db.pool())
        .await
        .unwrap()
        .try_get::<i64, _>(0)
        .unwrap()
}

/// What the database says was applied.
#[derive(Debug, PartialEq, Eq)]
pub struct Applied {
    /// Change-log rows.
    pub changes: i64,
    /// (job, ordinal) pairs applied more than once.
    pub duplicated: i64,
    /// Records whose revision differs from their change count.
    pub revision_mismatches: i64,
}

pub async fn applied(db: &Db) -> Applied {
    Applied {
        changes: scalar(db, "SELECT COUNT(*) FROM crm_record_change").await,
        duplicated: scalar(
            db,
            "SELECT COUNT(*) FROM (SELECT job_id, ordinal FROM crm_record_change \
             GROUP BY job_id, ordinal HAVING COUNT(*) > 1) d",
        )
        .await,
        revision_mismatches: scalar(
            db,
            // One grouped pass (a correlated COUNT per record is quadratic without an index on
            // crm_record_change.record_key, which the product does not need).
            "SELECT COUNT(*) FROM crm_record r LEFT JOIN \
             (SELECT record_key, COUNT(*) AS n FROM crm_record_change GROUP BY record_key) c \
             ON c.record_key = r.record_key WHERE r.revision <> COALESCE(c.n, 0)",
        )
        .await,
    }
}

/// Checks the audit trail against the change log: one `record.applied` event per applied row
/// (`bulk-<job>-<ordinal>-r<revision>`, subject the record key) and none without its change.
pub async fn audit_matches_changes(db: &Db) -> Result<usize, String> {
    use nexuscrm_persistence::support::text;
    use std::collections::BTreeSet;
    let changes =
        sqlx::query("SELECT job_id, ordinal, record_key, revision FROM crm_record_change")
            .fetch_all(db.pool())
            .await
            .map_err(|e| e.to_string())?;
    let mut want = BTreeSet::new();
    for r in &changes {
        let (job, ordinal, rev): (i64, i64, i64) = (r.get(0), r.get(1), r.get(3));
        let key = text(r, 2).map_err(|e| e.to_string())?;
        want.insert((format!("bulk-{job}-{ordinal}-r{rev}"), key));
    }
    let events = sqlx::query("SELECT event_id, subject, kind FROM audit_event")
        .fetch_all(db.pool())
        .await
        .map_err(|e| e.to_string())?;
    let mut got = BTreeSet::new();
    for r in &events {
        let kind = text(r, 2).map_err(|e| e.to_string())?;
        if kind != "record.applied" {
            return Err(format!(
                "an audit event of kind {kind:?}, want record.applied"
            ));
        }
        got.insert((
            text(r, 0).map_err(|e| e.to_string())?,
            text(r, 1).map_err(|e| e.to_string())?,
        ));
    }
    if got.len() != events.len() {
        return Err("an audit event id repeats".into());
    }
    let missing: Vec<_> = want.difference(&got).take(3).collect();
    let orphan: Vec<_> = got.difference(&want).take(3).collect();
    if !missing.is_empty() || !orphan.is_empty() {
        return Err(format!(
            "{} changes, {} audit events; changes without their event (first 3): {missing:?}; \
             events without their change (first 3): {orphan:?}",
            want.len(),
            got.len()
        ));
    }
    Ok(got.len())
}
