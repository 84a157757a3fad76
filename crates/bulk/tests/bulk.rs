//! The Bulk family against real SQLite files, PostgreSQL and MariaDB.

mod common;

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use nexuscrm_bulk::{Bulk, BulkErrorKind, BulkOptions, NewJob, RowInput};
use nexuscrm_persistence::Dialect;
use nexuscrm_persistence::sqlx;
use nexuscrm_persistence::testing::TestDb;
use nexuscrm_worker::{Attempt, Controller, RunErrorKind, Source};
use serde_json::{Map, json};
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_jobs_drain_with_every_row_applied_exactly_once() {
    for d in DIALECTS {
        let Some((t, bulk)) = bulk_on(d, "drain", 1).await else {
            continue;
        };
        let mut ids = Vec::new();
        for j in 0..3 {
            ids.push(bulk.submit(job(j, 250, 50)).await.unwrap().job);
        }
        drain(&bulk, 2, &ids).await;
        for id in &ids {
            let s = bulk.status(*id).await.unwrap().unwrap();
            assert_eq!(s.state, "succeeded", "{d}");
            assert_eq!(
                (s.applied_rows, s.rejected_rows, s.cursor),
                (250, 0, 250),
                "{d}"
            );
        }
        let a = applied(&t.db).await;
        assert_eq!(
            a,
            Applied {
                changes: 750,
                duplicated: 0,
                revision_mismatches: 0
            },
            "{d}"
        );
        let o = bulk.observations().await.unwrap();
        assert_eq!(
            (o.succeeded, o.pending, o.running, o.poisoned),
            (3, 0, 0, 0),
            "{d}"
        );
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_rejected_before_acceptance_and_row_failures_are_recorded() {
    for d in DIALECTS {
        let Some((t, bulk)) = bulk_on(d, "badinput", 1).await else {
            continue;
        };
        let e = bulk.submit(NewJob::new("empty", vec![])).await.unwrap_err();
        assert_eq!(e.kind(), BulkErrorKind::Invalid);
        assert!(e.to_string().contains("has no rows"), "{e}");
        let mut big = job(1, 5, 1);
        big.segment_size = Some(50_000);
        let e = bulk.submit(big).await.unwrap_err();
        assert!(
            e.to_string().contains("segment size 50000 is outside"),
            "{e}"
        );
        let e = bulk
            .submit(NewJob::new("k", vec![RowInput::new("", Map::new())]))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("row 1: record key"), "{e}");
        assert_eq!((e.row(), e.kind()), (Some(0), BulkErrorKind::Invalid));
        assert!(e.detail().starts_with("record key"), "{}", e.detail());
        // A huge key is not echoed whole.
        let huge = "k".repeat(1_000_000);
        let e = bulk
            .submit(NewJob::new(huge.clone(), rows(1, 1)))
            .await
            .unwrap_err();
        assert!(e.to_string().len() < 300, "{} bytes", e.to_string().len());
        let mut ok = rows(1, 3);
        ok[2].record_key = huge;
        let e = bulk.submit(NewJob::new("huge-row", ok)).await.unwrap_err();
        assert_eq!(e.row(), Some(2));
        assert!(e.to_string().len() < 300, "{} bytes", e.to_string().len());
        assert_eq!(bulk.list(10).await.unwrap().len(), 0, "{d}: nothing stored");

        // The same idempotency key returns the same job.
        let first = bulk.submit(job(2, 10, 5)).await.unwrap();
        let again = bulk.submit(job(2, 10, 5)).await.unwrap();
        assert!(first.created && !again.created);
        assert_eq!(first.job, again.job);
        // The same key for other rows is refused and changes nothing, whichever rows differ:
        // one more row, one field value, one record key. Other options are not content.
        let mut other_segments = job(2, 10, 5);
        other_segments.segment_size = Some(3);
        assert_eq!(bulk.submit(other_segments).await.unwrap().job, first.job);
        let mut changed_field = job(2, 10, 5);
        changed_field.rows[9]
            .fields
            .insert("name".into(), json!("someone else"));
        let mut changed_key = job(2, 10, 5);
        changed_key.rows[0].record_key.push('x');
        for other in [job(2, 11, 5), changed_field, changed_key] {
            let e = bulk.submit(other).await.unwrap_err();
            assert_eq!(e.kind(), BulkErrorKind::Conflict, "{d}: {e}");
            assert!(
                e.to_string().contains(&format!(
                    "is already used by job {} with other rows",
                    first.job
                )),
                "{d}: {e}"
            );
        }
        let s = bulk.status(first.job).await.unwrap().unwrap();
        assert_eq!(s.total_rows, 10, "{d}: the stored job is unchanged");
        assert_eq!(bulk.list(10).await.unwrap().len(), 1, "{d}");

        // Row-level validation: recorded per row, the job still succeeds.
        let mut rows = rows(3, 4);
        rows[2].fields.insert("email".into(), json!("not-an-email"));
        let mut j = NewJob::new("with-bad-row", rows);
        j.segment_size = Some(2);
        let id = bulk.submit(j).await.unwrap().job;
        drain(&bulk, 2, &[first.job, id]).await;
        let s = bulk.status(id).await.unwrap().unwrap();
        assert_eq!(
            (s.state.as_str(), s.applied_rows, s.rejected_rows),
            ("succeeded", 3, 1),
            "{d}"
        );
        let msg: Vec<u8> = sqlx::query_scalar("SELECT message FROM bulk_row_error")
            .fetch_one(t.db.pool())
            .await
            .or_else(|_| Ok::<_, sqlx::Error>(Vec::new()))
            .unwrap();
        let msg = if msg.is_empty() {
            sqlx::query_scalar::<_, String>("SELECT message FROM bulk_row_error")
                .fetch_one(t.db.pool())
                .await
                .unwrap()
        } else {
            String::from_utf8(msg).unwrap()
        };
        assert!(msg.contains("invalid email"), "{msg}");
        // The same through the API the console reads: the rejected row's ordinal and reason.
        let errors = bulk.row_errors(id, 10).await.unwrap();
        assert_eq!(errors.len(), 1, "{d}: {errors:?}");
        assert_eq!(errors[0].ordinal, 2, "{d}");
        assert_eq!(errors[0].message, msg, "{d}");
        assert!(
            bulk.row_errors(first.job, 10).await.unwrap().is_empty(),
            "{d}"
        );
        let age = std::time::SystemTime::now()
            .duration_since(s.created_at)
            .unwrap();
        assert!(
            age < std::time::Duration::from_secs(600),
            "{d}: created {age:?} ago"
        );
        assert_eq!(applied(&t.db).await.duplicated, 0);
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_workers_on_separate_pools_never_apply_a_row_twice() {
    for d in DIALECTS {
        let Some((t, producer)) = bulk_on(d, "unique", 1).await else {
            continue;
        };
        let mut ids = Vec::new();
        let submitting = std::time::Instant::now();
        for j in 0..200 {
            ids.push(producer.submit(job(j, 100, 50)).await.unwrap().job);
        }
        eprintln!("{d}: 200 jobs submitted in {:?}", submitting.elapsed());
        let mut runs = Vec::new();
        let cancel = CancellationToken::new();
        for w in 0..4 {
            let db = nexuscrm_persistence::Db::connect(&t.url).await.unwrap();
            let bulk =
                Bulk::without_migrations(db, 1, BulkOptions::default().config(test_config()));
            let ctl =
                Controller::new(bulk.source(), controller_config(&format!("w{w}"), 4)).unwrap();
            let waker = ctl.waker();
            runs.push((tokio::spawn(ctl.run(cancel.clone())), waker, bulk));
        }
        let started = std::time::Instant::now();
        wait_terminal(&producer, &ids, Duration::from_secs(300)).await;
        eprintln!("{d}: 200 jobs drained in {:?}", started.elapsed());
        cancel.cancel();
        let mut claimed_by = Vec::new();
        for (run, _, bulk) in runs {
            // A worker may stop early on contention it could not resolve (a proven rollback,
            // reusable: the Runtime Worker restarts it); it must never poison.
            match run.await.unwrap() {
                Ok(ctl) => claimed_by.push(ctl.handle().snapshot().attempts_claimed),
                Err(e) => {
                    assert_eq!(e.kind(), RunErrorKind::NotCommitted, "{d}: {e}");
                    claimed_by.push(
                        e.into_controller()
                            .unwrap()
                            .handle()
                            .snapshot()
                            .attempts_claimed,
                    );
                }
            }
            bulk.db().close().await;
        }
        eprintln!("{d}: stopped after {:?}", started.elapsed());
        let a = applied(&t.db).await;
        assert_eq!(
            a,
            Applied {
                changes: 20_000,
                duplicated: 0,
                revision_mismatches: 0
            },
            "{d}"
        );
        assert!(
            claimed_by.iter().filter(|&&n| n > 0).count() >= 2,
            "{d}: work was shared {claimed_by:?}"
        );
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_generation_takes_over_mid_job_and_the_old_one_can_neither_claim_nor_commit() {
    for d in DIALECTS {
        let Some((t, gen1)) = bulk_on(d, "takeover", 1).await else {
            continue;
        };
        let id = gen1.submit(job(0, 40, 10)).await.unwrap().job;
        let src1 = gen1.source();
        let cancel = CancellationToken::new();
        let batch = src1
            .claim(NonZeroUsize::new(1).unwrap(), cancel.clone())
            .await
            .unwrap();
        let (mut attempts, _) = batch.into_parts();
        let attempt = attempts.pop().expect("claimed");
        // Generation 2 takes over while generation 1 holds the job.
        let gen2 = Bulk::without_migrations(
            t.db.clone(),
            2,
            BulkOptions::default().config(test_config()),
        );
        gen2.take_ownership("new").await.unwrap();
        // Generation 1's segment commit is fenced out: nothing applied.
        attempt.run(CancellationToken::new()).await.unwrap();
        assert_eq!(
            applied(&t.db).await.changes,
            0,
            "{d}: the fenced commit was rejected"
        );
        // Generation 1 claims nothing any more, and says why: superseded, nothing committed.
        let err = src1
            .claim(NonZeroUsize::new(4).unwrap(), cancel.clone())
            .await
            .unwrap_err();
        assert!(err.is_superseded() && err.is_not_committed(), "{d}: {err}");
        assert!(err.to_string().contains("fenced out"), "{d}: {err}");
        let err = src1.reconcile(cancel.clone()).await.unwrap_err();
        assert!(err.is_superseded(), "{d}: {err}");
        // Generation 2 reconciles (releasing generation 1's lease at once) and completes.
        drain(&gen2, 2, &[id]).await;
        assert_eq!(gen2.status(id).await.unwrap().unwrap().state, "succeeded");
        let a = applied(&t.db).await;
        assert_eq!(
            a,
            Applied {
                changes: 40,
                duplicated: 0,
                revision_mismatches: 0
            },
            "{d}"
        );
        // And generation 1 can never take ownership back.
        assert!(gen1.take_ownership("old").await.is_err());
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_workers_job_is_rescued_exactly_at_lease_expiry_from_its_last_segment() {
    for d in DIALECTS {
        let Some(t) = TestDb::create(d, "lease").await else {
            continue;
        };
        let cfg = test_config().lease(Duration::from_millis(1500));
        let a = Bulk::open(t.db.clone(), 1, BulkOptions::default().config(cfg.clone()))
            .await
            .unwrap();
        a.take_ownership("a").await.unwrap();
        let id = a.submit(job(0, 30, 10)).await.unwrap().job;
        // Worker A claims and commits one segment, then "crashes" (stops heartbeating).
        let faults = nexuscrm_worker::fault::Faults::new();
        faults.arm(nexuscrm_worker::fault::CrashPoint::DuringHeartbeat);
        let a = Bulk::without_migrations(
            t.db.clone(),
            1,
            BulkOptions::default()
                .config(cfg.clone())
                .faults(faults.clone()),
        );
        let batch = a
            .source()
            .claim(NonZeroUsize::new(1).unwrap(), CancellationToken::new())
            .await
            .unwrap();
        let claimed_at = std::time::SystemTime::now();
        let (mut atts, _) = batch.into_parts();
        assert!(
            atts.pop()
                .unwrap()
                .run(CancellationToken::new())
                .await
                .is_err(),
            "crashed"
        );
        let s = a.status(id).await.unwrap().unwrap();
        assert_eq!(
            (s.state.as_str(), s.cursor),
            ("running", 10),
            "{d}: one segment committed"
        );
        // Worker B (same deployment, restarted) sees the lease expiry as its next work time.
        let b = Bulk::without_migrations(t.db.clone(), 1, BulkOptions::default().config(cfg));
        let due = b
            .source()
            .next_work_at(CancellationToken::new())
            .await
            .unwrap()
            .expect("due");
        let lease_end = due.duration_since(claimed_at).unwrap_or_default();
        assert!(
            lease_end <= Duration::from_millis(1600),
            "{d}: due at lease end, {lease_end:?}"
        );
        let early = b
            .source()
            .claim(NonZeroUsize::new(1).unwrap(), CancellationToken::new())
            .await
            .unwrap();
        assert!(early.is_empty(), "{d}: not claimable before the lease ends");
        drain(&b, 1, &[id]).await;
        let s = b.status(id).await.unwrap().unwrap();
        assert_eq!((s.state.as_str(), s.applied_rows), ("succeeded", 30), "{d}");
        assert_eq!(
            applied(&t.db).await,
            Applied {
                changes: 30,
                duplicated: 0,
                revision_mismatches: 0
            }
        );
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_operations_blocked_on_a_lock_return_promptly_when_cancelled() {
    for d in DIALECTS {
        let Some((t, bulk)) = bulk_on(d, "blocked", 1).await else {
            continue;
        };
        bulk.submit(job(0, 5, 5)).await.unwrap();
        let src = bulk.source();
        // Another connection holds every fence stripe's lock, which every claim and reconciliation
        // takes (SQLite: the write lock).
        let mut holder = t.db.begin_write().await.unwrap();
        sqlx::query("UPDATE runtime_work_fence_stripe SET generation = generation")
            .execute(holder.conn())
            .await
            .unwrap();
        for op in ["reconcile", "claim"] {
            let cancel = CancellationToken::new();
            let c2 = cancel.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                c2.cancel();
            });
            let started = std::time::Instant::now();
            let err = match op {
                "reconcile" => src.reconcile(cancel).await.unwrap_err(),
                _ => src
                    .claim(NonZeroUsize::new(1).unwrap(), cancel)
                    .await
                    .unwrap_err(),
            };
            assert!(err.is_not_committed(), "{d} {op}: {err}");
            assert!(
                started.elapsed() < Duration::from_secs(3),
                "{d} {op} returned promptly"
            );
        }
        holder.rollback().await;
        // Nothing was claimed by the cancelled claim: the job is still pending.
        let o = bulk.observations().await.unwrap();
        assert_eq!((o.pending, o.running), (1, 0), "{d}");
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_disappears_mid_job_fails_stop_and_a_restarted_worker_recovers() {
    for d in DIALECTS {
        let Some((t, _)) = bulk_on(d, "dbgone", 1).await else {
            continue;
        };
        let db = nexuscrm_persistence::Db::connect(&t.url).await.unwrap();
        let cfg = test_config().lease(Duration::from_millis(800));
        let a = Bulk::without_migrations(db.clone(), 1, BulkOptions::default().config(cfg.clone()));
        let id = a.submit(job(0, 20, 10)).await.unwrap().job;
        let batch = a
            .source()
            .claim(NonZeroUsize::new(1).unwrap(), CancellationToken::new())
            .await
            .unwrap();
        let (mut atts, _) = batch.into_parts();
        let attempt = atts.pop().unwrap();
        db.close().await; // The database "disappears" for this worker.
        let err = attempt.run(CancellationToken::new()).await.unwrap_err();
        assert!(
            err.to_string().contains("releasing bulk job"),
            "{d}: fail-stop, {err}"
        );
        // A restarted worker (fresh pool) recovers once the lease ends.
        let b = Bulk::without_migrations(t.db.clone(), 1, BulkOptions::default().config(cfg));
        drain(&b, 1, &[id]).await;
        assert_eq!(b.status(id).await.unwrap().unwrap().state, "succeeded");
        assert_eq!(
            applied(&t.db).await,
            Applied {
                changes: 20,
                duplicated: 0,
                revision_mismatches: 0
            }
        );
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_failure_through_the_controller_poisons_it() {
    // The controller's fail-stop with a real store: a closed pool makes the release fail.
    let Some((t, _)) = bulk_on(Dialect::Sqlite, "failstop", 1).await else {
        return;
    };
    let db = nexuscrm_persistence::Db::connect(&t.url).await.unwrap();
    let a = Bulk::without_migrations(db.clone(), 1, BulkOptions::default().config(test_config()));
    a.submit(job(0, 10, 5)).await.unwrap();
    let ctl = Controller::new(a.source(), controller_config("bulk", 1)).unwrap();
    let handle = ctl.handle();
    let src = Arc::new(());
    let _ = src;
    db.close().await;
    let err = ctl.run(CancellationToken::new()).await.unwrap_err();
    assert!(matches!(
        err.kind(),
        RunErrorKind::NotReady | RunErrorKind::NotCommitted | RunErrorKind::OutcomeUnknown
    ));
    let _ = handle;
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_postgres_worker_listening_for_notifications_issues_no_queries() {
    let Some((t, bulk)) = bulk_on(Dialect::Postgres, "idle", 1).await else {
        return;
    };
    let cfg = test_config().listen(true);
    let bulk = Bulk::without_migrations(bulk.db().clone(), 1, BulkOptions::default().config(cfg));
    let ctl = Controller::new(bulk.source(), controller_config("bulk", 2)).unwrap();
    let handle = ctl.handle();
    let cancel = CancellationToken::new();
    let run = tokio::spawn(ctl.run(cancel.clone()));
    assert!(handle.ready().await);
    // Let the startup claim turn finish.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let since: i64 =
        sqlx::query_scalar("SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)")
            .fetch_one(t.db.pool())
            .await
            .unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    // Statements started by any other session of this database during the idle window
    // (pg_stat_activity shows each session's latest statement and when it started).
    let busy: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND pid <> pg_backend_pid() AND query NOT LIKE '%pg_stat_activity%' \
         AND query NOT LIKE '%clock_timestamp%' \
         AND CAST(EXTRACT(EPOCH FROM query_start) * 1000 AS BIGINT) > $1",
    )
    .bind(since)
    .fetch_one(t.db.pool())
    .await
    .unwrap();
    assert_eq!(busy, 0, "an idle worker issued statements");
    let snap = handle.snapshot();
    assert_eq!((snap.claim_calls, snap.next_work_at_calls), (1, 1));
    // A producer in another process is still noticed at once, through NOTIFY.
    let other = Bulk::without_migrations(
        t.db.clone(),
        1,
        BulkOptions::default().config(test_config().listen(true)),
    );
    let id = other.submit(job(0, 5, 5)).await.unwrap().job;
    wait_terminal(&bulk, &[id], Duration::from_secs(10)).await;
    assert!(handle.snapshot().generation_changes >= 1);
    cancel.cancel();
    run.await.unwrap().unwrap();
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_reads_now_after_its_lock_wait_so_work_due_during_the_wait_is_claimed() {
    use nexuscrm_worker_test::ManualClock;
    for d in DIALECTS {
        let Some(t) = TestDb::create(d, "lockwait").await else {
            continue;
        };
        let t0 = std::time::SystemTime::now();
        let clock = ManualClock::at(t0);
        let lease = Duration::from_secs(10);
        let bulk = Bulk::open(
            t.db.clone(),
            1,
            BulkOptions::default()
                .config(test_config().lease(lease))
                .clock(clock.clone()),
        )
        .await
        .unwrap();
        bulk.take_ownership("test").await.unwrap();
        // Due 30 s after t0: not eligible when the claim is issued.
        let mut j = job(0, 3, 3);
        j.run_at = Some(t0 + Duration::from_secs(30));
        let id = bulk.submit(j).await.unwrap().job;
        // Another connection holds every fence stripe (SQLite: the write lock), so the claim waits.
        let mut holder = t.db.begin_write().await.unwrap();
        sqlx::query("UPDATE runtime_work_fence_stripe SET generation = generation")
            .execute(holder.conn())
            .await
            .unwrap();
        let src = bulk.source();
        let claim = tokio::spawn(async move {
            src.claim(NonZeroUsize::new(4).unwrap(), CancellationToken::new())
                .await
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!claim.is_finished(), "{d}: the claim waits for the lock");
        // One minute passes during the wait; the job fell due meanwhile.
        clock.advance(Duration::from_secs(60));
        holder.rollback().await;
        let batch = claim.await.unwrap().unwrap();
        assert_eq!(
            batch.len(),
            1,
            "{d}: a claim with a 'now' read before its lock wait misses the job"
        );
        // Its lease counts from the time the lock was held, not from before the wait.
        let lease_ms: i64 = sqlx::query_scalar(if d == Dialect::Postgres {
            "SELECT lease_expires_at FROM bulk_job WHERE id = $1"
        } else {
            "SELECT lease_expires_at FROM bulk_job WHERE id = ?"
        })
        .bind(id.0)
        .fetch_one(t.db.pool())
        .await
        .unwrap();
        let want = nexuscrm_persistence::support::to_ms(t0 + Duration::from_secs(60) + lease);
        assert_eq!(lease_ms, want, "{d}");
        for a in batch.into_parts().0 {
            a.run(CancellationToken::new()).await.unwrap();
        }
        assert_eq!(bulk.status(id).await.unwrap().unwrap().state, "succeeded");
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_fields_that_do_not_parse_are_rejected_with_a_reason_never_applied_as_empty() {
    for d in DIALECTS {
        let Some((t, bulk)) = bulk_on(d, "badjson", 1).await else {
            continue;
        };
        let id = bulk.submit(job(0, 3, 10)).await.unwrap().job;
        // Corrupt one stored row behind the producer's back (a bad migration, a manual edit).
        sqlx::query(if d == Dialect::Postgres {
            "UPDATE bulk_input SET fields = '{not json' WHERE job_id = $1 AND ordinal = 1"
        } else {
            "UPDATE bulk_input SET fields = '{not json' WHERE job_id = ? AND ordinal = 1"
        })
        .bind(id.0)
        .execute(t.db.pool())
        .await
        .unwrap();
        drain(&bulk, 1, &[id]).await;
        let s = bulk.status(id).await.unwrap().unwrap();
        assert_eq!(
            (s.state.as_str(), s.applied_rows, s.rejected_rows),
            ("succeeded", 2, 1),
            "{d}"
        );
        let row = sqlx::query(if d == Dialect::Postgres {
            "SELECT message FROM bulk_row_error WHERE job_id = $1 AND ordinal = 1"
        } else {
            "SELECT message FROM bulk_row_error WHERE job_id = ? AND ordinal = 1"
        })
        .bind(id.0)
        .fetch_one(t.db.pool())
        .await
        .unwrap();
        let message = nexuscrm_persistence::support::text(&row, 0).unwrap();
        assert!(message.contains("not a JSON object"), "{d}: {message}");
        // The corrupt row wrote nothing: no record, no change-log entry.
        let records: i64 = sqlx::query_scalar(if d == Dialect::Postgres {
            "SELECT COUNT(*) FROM crm_record WHERE record_key = $1"
        } else {
            "SELECT COUNT(*) FROM crm_record WHERE record_key = ?"
        })
        .bind("rec-0-1")
        .fetch_one(t.db.pool())
        .await
        .unwrap();
        assert_eq!(records, 0, "{d}: nothing written for the corrupt row");
        assert_eq!(applied(&t.db).await.changes, 2, "{d}");
        t.drop_database().await;
    }
}

/// One claim by a fresh worker (its own handle and fault hooks) at the clock's time, run to its
/// end or to the armed crash. Returns whether it crashed.
async fn one_worker_life(
    t: &TestDb,
    clock: &Arc<nexuscrm_worker_test::ManualClock>,
    max_attempts: u32,
    crash_at: Option<nexuscrm_worker::fault::CrashPoint>,
) -> bool {
    let faults = nexuscrm_worker::fault::Faults::new();
    if let Some(p) = crash_at {
        faults.arm(p);
    }
    let bulk = Bulk::without_migrations(
        t.db.clone(),
        1,
        BulkOptions::default()
            .config(test_config().default_max_attempts(max_attempts))
            .clock(clock.clone())
            .faults(faults.clone()),
    );
    let batch = bulk
        .source()
        .claim(NonZeroUsize::new(1).unwrap(), CancellationToken::new())
        .await
        .unwrap();
    let mut crashed = false;
    for a in batch.into_parts().0 {
        crashed |= a.run(CancellationToken::new()).await.is_err();
    }
    crashed
}

/// A migrated, owned Bulk store on a manual clock, with `lease` and `max_attempts`.
async fn bulk_on_manual_clock(
    t: &TestDb,
    lease: Duration,
    max_attempts: u32,
) -> (Bulk, Arc<nexuscrm_worker_test::ManualClock>) {
    let clock = nexuscrm_worker_test::ManualClock::at(std::time::SystemTime::now());
    let bulk = Bulk::open(
        t.db.clone(),
        1,
        BulkOptions::default()
            .config(
                test_config()
                    .lease(lease)
                    .default_max_attempts(max_attempts),
            )
            .clock(clock.clone()),
    )
    .await
    .unwrap();
    bulk.take_ownership("test").await.unwrap();
    (bulk, clock)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_progresses_on_every_claim_is_never_poisoned_by_worker_crashes() {
    use nexuscrm_worker::fault::CrashPoint;
    for d in DIALECTS {
        let Some(t) = TestDb::create(d, "progress").await else {
            continue;
        };
        let lease = Duration::from_secs(10);
        let (bulk, clock) = bulk_on_manual_clock(&t, lease, 3).await;
        let id = bulk.submit(job(0, 10, 1)).await.unwrap().job;
        // Eight workers in a row (more than max_attempts) each commit one segment and die.
        for life in 1..=8 {
            assert!(
                one_worker_life(&t, &clock, 3, Some(CrashPoint::AfterEffect)).await,
                "{d}: life {life} crashed"
            );
            let s = bulk.status(id).await.unwrap().unwrap();
            assert_eq!(s.state, "running", "{d}: life {life}: {s:?}");
            assert_eq!(s.cursor, life, "{d}: the cursor moved on every claim");
            assert_eq!(
                s.stalled_claims, 0,
                "{d}: a committed segment resets the count"
            );
            assert_eq!(s.attempts, life, "{d}: every claim is still counted");
            clock.advance(lease + Duration::from_secs(1));
        }
        assert!(!one_worker_life(&t, &clock, 3, None).await);
        let s = bulk.status(id).await.unwrap().unwrap();
        assert_eq!(s.state, "succeeded", "{d}: {s:?}");
        assert_eq!(
            applied(&t.db).await,
            Applied {
                changes: 10,
                duplicated: 0,
                revision_mismatches: 0
            },
            "{d}"
        );
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_workers_always_die_before_progress_is_poisoned_and_an_operator_retries_it() {
    use nexuscrm_worker::fault::CrashPoint;
    for d in DIALECTS {
        let Some(t) = TestDb::create(d, "stalled").await else {
            continue;
        };
        let lease = Duration::from_secs(10);
        let (bulk, clock) = bulk_on_manual_clock(&t, lease, 3).await;
        let id = bulk.submit(job(0, 4, 2)).await.unwrap().job;
        // One segment commits, then three workers in a row die before their first commit.
        assert!(one_worker_life(&t, &clock, 3, Some(CrashPoint::AfterEffect)).await);
        clock.advance(lease + Duration::from_secs(1));
        for life in 1..=3 {
            assert!(one_worker_life(&t, &clock, 3, Some(CrashPoint::BeforeEffect)).await);
            let s = bulk.status(id).await.unwrap().unwrap();
            assert_eq!(
                (s.state.as_str(), s.stalled_claims),
                ("running", life),
                "{d}"
            );
            clock.advance(lease + Duration::from_secs(1));
        }
        // The fourth claim in a row without progress poisons it, with the reason.
        assert!(!one_worker_life(&t, &clock, 3, None).await);
        let s = bulk.status(id).await.unwrap().unwrap();
        assert_eq!(s.state, "poisoned", "{d}: {s:?}");
        let reason = s.last_error.clone().unwrap_or_default();
        assert!(
            reason.contains("3 consecutive claims without progress"),
            "{d}: {reason}"
        );
        assert_eq!(s.cursor, 2, "{d}: the committed segment stays");
        // Resubmitting the same key returns the poisoned job; only a retry runs it again.
        let again = bulk.submit(job(0, 4, 2)).await.unwrap();
        assert!(!again.created);
        assert_eq!(bulk.status(id).await.unwrap().unwrap().state, "poisoned");
        let retried = bulk.retry(id).await.unwrap();
        assert_eq!(
            (
                retried.state.as_str(),
                retried.stalled_claims,
                retried.last_error
            ),
            ("pending", 0, None),
            "{d}"
        );
        assert!(!one_worker_life(&t, &clock, 3, None).await);
        let s = bulk.status(id).await.unwrap().unwrap();
        assert_eq!(s.state, "succeeded", "{d}: {s:?}");
        assert_eq!(applied(&t.db).await.changes, 4, "{d}: no row applied twice");
        // A retry of a job that is not poisoned, or of no job, changes nothing.
        let e = bulk.retry(id).await.unwrap_err();
        assert_eq!(e.kind(), BulkErrorKind::Conflict, "{d}: {e}");
        assert!(e.to_string().contains("succeeded, not poisoned"), "{e}");
        let e = bulk.retry(nexuscrm_bulk::JobId(999_999)).await.unwrap_err();
        assert_eq!(e.kind(), BulkErrorKind::NotFound, "{d}: {e}");
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_byte_exact_unicode_even_on_a_latin1_mariadb_database() {
    let Some(t) =
        TestDb::create_latin1_mysql("latin1", nexuscrm_persistence::DbOptions::default()).await
    else {
        return;
    };
    let bulk = Bulk::open(
        t.db.clone(),
        1,
        BulkOptions::default().config(test_config()),
    )
    .await
    .unwrap();
    bulk.take_ownership("test").await.unwrap();
    // Distinct keys under a byte-exact collation; the same record under a default one.
    let keys = [
        "acct-1",
        "ACCT-1",
        "acct-1 ",
        "acct-\u{1F600}",
        "acct-\u{1F601}",
        "Å-ü-中",
    ];
    let rows = keys
        .iter()
        .map(|k| RowInput::new(*k, fields(0, 0)))
        .collect::<Vec<_>>();
    let mut j = NewJob::new("clé-\u{1F600}", rows);
    j.segment_size = Some(100);
    let id = bulk.submit(j).await.unwrap().job;
    drain(&bulk, 1, &[id]).await;
    let s = bulk.status(id).await.unwrap().unwrap();
    assert_eq!(
        (s.state.as_str(), s.applied_rows, s.rejected_rows),
        ("succeeded", keys.len() as i64, 0),
        "{s:?}"
    );
    assert_eq!(s.idempotency_key, "clé-\u{1F600}");
    let stored: Vec<String> = sqlx::query_scalar("SELECT record_key FROM crm_record")
        .fetch_all(t.db.pool())
        .await
        .unwrap();
    let mut want: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
    let mut got = stored.clone();
    want.sort();
    got.sort();
    assert_eq!(got, want, "every key stored once, byte for byte");
    // Every table the families created pins utf8mb4 with a byte-exact, no-pad collation.
    let bin = t.db.byte_exact_collation().await.unwrap();
    assert_ne!(bin, "utf8mb4_bin", "MariaDB has a NO PAD binary collation");
    let loose: Vec<(String, String)> = sqlx::query_as(
        "SELECT CAST(TABLE_NAME AS CHAR), CAST(TABLE_COLLATION AS CHAR) FROM information_schema.TABLES \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_COLLATION <> ?",
    )
    .bind(bin)
    .fetch_all(t.db.pool())
    .await
    .unwrap();
    assert!(loose.is_empty(), "tables without utf8mb4_bin: {loose:?}");
    let loose_columns: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() \
         AND COLLATION_NAME IS NOT NULL AND COLLATION_NAME <> ?",
    )
    .bind(bin)
    .fetch_one(t.db.pool())
    .await
    .unwrap();
    assert_eq!(loose_columns, 0);
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_cannot_reach_the_database_is_not_committed_not_fatal() {
    for d in DIALECTS {
        let options = nexuscrm_persistence::DbOptions::default()
            .max_connections(1)
            .acquire_timeout(Duration::from_millis(300));
        let Some(t) = TestDb::create_with(d, "release", options).await else {
            continue;
        };
        let bulk = Bulk::open(
            t.db.clone(),
            1,
            BulkOptions::default().config(test_config()),
        )
        .await
        .unwrap();
        bulk.take_ownership("test").await.unwrap();
        let id = bulk.submit(job(0, 4, 2)).await.unwrap().job;
        let batch = bulk
            .source()
            .claim(NonZeroUsize::new(1).unwrap(), CancellationToken::new())
            .await
            .unwrap();
        let attempt = batch.into_parts().0.pop().expect("claimed");
        // The only pooled connection is held elsewhere: the release times out waiting for it.
        let held = t.db.pool().acquire().await.unwrap();
        let cancelled = CancellationToken::new();
        cancelled.cancel();
        let err = attempt.run(cancelled).await.unwrap_err();
        assert!(err.is_not_committed(), "{d}: {err}");
        assert!(err.to_string().contains("releasing bulk job"), "{d}: {err}");
        drop(held);
        // The job is still leased to the claim (nothing committed), so it returns later.
        let s = bulk.status(id).await.unwrap().unwrap();
        assert_eq!((s.state.as_str(), s.cursor), ("running", 0), "{d}: {s:?}");
        t.drop_database().await;
    }
}

/// The MySQL dialect reads a claim's rows back by its token (TiDB ignores RETURNING): that
/// read is an index lookup on `bulk_job_claim`, never a scan of every job ever accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mysql_claim_read_back_is_an_index_lookup_on_the_claim_token() {
    let Some((t, bulk)) = bulk_on(Dialect::Mysql, "claimplan", 1).await else {
        return;
    };
    for j in 0..20 {
        bulk.submit(job(j, 1, 1)).await.unwrap();
    }
    sqlx::query("ANALYZE TABLE bulk_job")
        .execute(t.db.pool())
        .await
        .unwrap();
    let (plan, keys) = nexuscrm_persistence::testing::explain_mysql(
        &t.db,
        "SELECT id, attempts FROM bulk_job WHERE claim_token = 'c-1'",
    )
    .await
    .unwrap();
    eprintln!("claimed read-back plan: {plan:?}");
    assert_eq!(keys, vec![Some("bulk_job_claim".to_owned())], "{plan:?}");
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observed_counts_stop_at_their_cap_and_are_exact_below_it() {
    for d in DIALECTS {
        let Some((t, bulk)) = bulk_on(d, "observed_cap", 1).await else {
            continue;
        };
        for j in 0..3 {
            bulk.submit(job(j, 2, 10)).await.unwrap();
        }
        let capped = bulk.observations_capped(2).await.unwrap();
        assert_eq!(
            (
                capped.pending,
                capped.queue_depth_eligible,
                capped.running,
                capped.count_cap
            ),
            (2, 2, 0, 2),
            "{d}: {capped:?}"
        );
        assert!(capped.oldest_eligible_age.is_some(), "{d}");
        let exact = bulk.observations().await.unwrap();
        assert_eq!(
            (exact.pending, exact.queue_depth_eligible, exact.count_cap),
            (3, 3, nexuscrm_persistence::OBSERVATION_CAP),
            "{d}: {exact:?}"
        );
        t.drop_database().await;
    }
}
