//! Bulk as an audit producer, on SQLite, PostgreSQL and MariaDB: every applied row writes its
//! `record.applied` event in the segment's transaction, and the audit controller delivers the
//! trail to a real JSON Lines file, each event once, in per-record revision order. The crash
//! matrix (`crash_matrix.rs`) checks the trail against the change log after every crash.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use common::{DIALECTS, audit_matches_changes, controller_config, drain, test_config};
use nexuscrm_audit::{Audit, AuditOptions, JsonlSink, read_lines};
use nexuscrm_bulk::{Bulk, BulkOptions, NewJob, RowInput};
use nexuscrm_persistence::Dialect;
use nexuscrm_persistence::testing::TestDb;
use nexuscrm_worker::Controller;
use serde_json::json;
use tokio_util::sync::CancellationToken;

fn sink(label: &str) -> JsonlSink {
    let dir = std::env::temp_dir().join(format!(
        "nexuscrm-bulk-audit-{label}-{}-{}",
        std::process::id(),
        nexuscrm_persistence::support::new_token()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    JsonlSink::new(dir.join("audit.jsonl"))
}

/// Three jobs over 40 records: each job applies every record once (so every record reaches
/// revision 3), in segments of 15, with rows rejected by validation (no event for those).
fn jobs() -> Vec<NewJob> {
    (0..3)
        .map(|j| {
            let mut rows: Vec<RowInput> = (0..40)
                .map(|i| {
                    let fields = json!({"name": format!("r{i} v{j}"), "n": i});
                    RowInput::new(format!("acct-{i}"), fields.as_object().unwrap().clone())
                })
                .collect();
            rows.push(RowInput::new(
                "bad",
                json!({"email": "not an address"})
                    .as_object()
                    .unwrap()
                    .clone(),
            ));
            let mut job = NewJob::new(format!("audit-{j}"), rows);
            job.segment_size = Some(15);
            job
        })
        .collect()
}

async fn applied_rows_are_audited_and_delivered_once_in_order(d: Dialect) {
    let Some(t) = TestDb::create(d, "bulkaudit").await else {
        return;
    };
    let bulk = Bulk::open(
        t.db.clone(),
        1,
        BulkOptions::default().config(test_config().audit(true)),
    )
    .await
    .unwrap();
    bulk.take_ownership("test").await.unwrap();
    let mut ids = Vec::new();
    for job in jobs() {
        ids.push(bulk.submit(job).await.unwrap().job);
    }
    drain(&bulk, 2, &ids).await;
    let n = audit_matches_changes(&t.db)
        .await
        .unwrap_or_else(|e| panic!("{d}: {e}"));
    assert_eq!(
        n, 120,
        "{d}: one event per applied row, none for rejected rows"
    );

    let audit = Audit::open(t.db.clone(), AuditOptions::new(sink("e2e")).batch(25))
        .await
        .unwrap();
    audit.take_ownership("test").await.unwrap();
    let ctl = Controller::new(audit.source(), controller_config("audit", 4)).unwrap();
    audit.set_waker(ctl.waker());
    let cancel = CancellationToken::new();
    let run = tokio::spawn(ctl.run(cancel.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while audit.observations().await.unwrap().undelivered > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{d}: the audit trail was not delivered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cancel.cancel();
    run.await.unwrap().expect("clean drain");

    let lines = read_lines(audit.sink().file().unwrap()).unwrap();
    assert_eq!(lines.len(), 120, "{d}: every event in the file");
    let distinct: HashSet<_> = lines.iter().map(|l| l.event_id.as_str()).collect();
    assert_eq!(distinct.len(), 120, "{d}: no line repeats");
    let mut revisions: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for l in &lines {
        assert_eq!(l.kind, "record.applied");
        assert_eq!(l.actor, "bulk");
        assert_eq!(
            l.body["fields"]["n"],
            json!(l.subject[5..].parse::<i64>().unwrap())
        );
        revisions
            .entry(l.subject.as_str())
            .or_default()
            .push(l.body["revision"].as_i64().unwrap());
    }
    assert_eq!(revisions.len(), 40);
    for (subject, revs) in &revisions {
        assert_eq!(
            revs,
            &[1, 2, 3],
            "{d}: {subject}'s events in revision order"
        );
    }
}

async fn without_audit_no_event_is_written(d: Dialect) {
    let Some(t) = TestDb::create(d, "bulknoaudit").await else {
        return;
    };
    nexuscrm_audit::migrate(&t.db).await.unwrap();
    let bulk = Bulk::open(
        t.db.clone(),
        1,
        BulkOptions::default().config(test_config()),
    )
    .await
    .unwrap();
    bulk.take_ownership("test").await.unwrap();
    let id = bulk.submit(jobs().remove(0)).await.unwrap().job;
    drain(&bulk, 1, &[id]).await;
    let events: i64 = nexuscrm_persistence::sqlx::query_scalar("SELECT COUNT(*) FROM audit_event")
        .fetch_one(t.db.pool())
        .await
        .unwrap();
    assert_eq!(events, 0, "{d}: audit is off by default");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_applied_rows_are_audited_and_delivered_once_in_order() {
    for d in DIALECTS {
        applied_rows_are_audited_and_delivered_once_in_order(d).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_without_audit_writes_no_event() {
    for d in DIALECTS {
        without_audit_no_event_is_written(d).await;
    }
}
