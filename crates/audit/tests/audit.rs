//! The audit outbox against real SQLite files, PostgreSQL and MariaDB and a real file sink:
//! events commit with their change, are delivered exactly once in per-subject order through a
//! crash at every point, a torn line is recovered, and a newer generation takes delivery over.

use std::collections::{BTreeMap, HashSet};
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nexuscrm_audit::{
    Audit, AuditEvent, AuditOptions, HttpSink, JsonlSink, Line, read_lines, record,
};
use nexuscrm_persistence::sqlx;
use nexuscrm_persistence::testing::TestDb;
use nexuscrm_persistence::{Db, Dialect};
use nexuscrm_worker::fault::{CrashPoint, Faults};
use nexuscrm_worker::{Config, Controller};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const DIALECTS: [Dialect; 3] = [Dialect::Sqlite, Dialect::Postgres, Dialect::Mysql];

/// Every point a delivery can crash at.
const CRASH_POINTS: [CrashPoint; 5] = [
    CrashPoint::AfterClaim,
    CrashPoint::BeforeEffect,
    CrashPoint::AfterEffect,
    CrashPoint::BeforeDisposition,
    CrashPoint::AfterDisposition,
];

fn sink_path(label: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "nexuscrm-audit-{label}-{}-{}",
        std::process::id(),
        nexuscrm_persistence::support::new_token()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("audit.jsonl")
}

async fn setup(d: Dialect, label: &str) -> Option<(TestDb, JsonlSink)> {
    let t = TestDb::create(d, label).await?;
    nexuscrm_audit::migrate(&t.db).await.unwrap();
    sqlx::query("CREATE TABLE a_change (subject VARCHAR(64) NOT NULL, n BIGINT NOT NULL)")
        .execute(t.db.pool())
        .await
        .unwrap();
    Some((t, JsonlSink::new(sink_path(label))))
}

/// Writes `n` changes (subjects `s-0`..`s-4` in turn), each with its event, one transaction
/// per 10; and one rolled-back transaction whose event must never appear.
async fn produce(db: &Db, from: usize, n: usize) {
    produce_in(db, from, n, 10).await;
}

/// [`produce`] with `per_tx` changes per transaction.
async fn produce_in(db: &Db, from: usize, n: usize, per_tx: usize) {
    let cancel = CancellationToken::new();
    for start in (from..from + n).step_by(per_tx) {
        let end = (start + per_tx).min(from + n);
        let dialect = db.dialect();
        db.write(&cancel, move |c| {
            Box::pin(async move {
                let mut events = Vec::new();
                for i in start..end {
                    let subject = format!("s-{}", i % 5);
                    sqlx::query(
                        "INSERT INTO a_change (subject, n) VALUES ($1, $2)"
                            .replace_placeholders(dialect)
                            .as_str(),
                    )
                    .bind(subject.clone())
                    .bind(i as i64)
                    .execute(&mut *c)
                    .await?;
                    events.push(AuditEvent::new(
                        format!("ev-{i}"),
                        subject,
                        "change.applied",
                        "test",
                        json!({ "n": i }),
                    ));
                }
                record(c, dialect, &events).await
            })
        })
        .await
        .unwrap();
    }
    let dialect = db.dialect();
    let r: Result<(), _> = db
        .write(&cancel, move |c| {
            Box::pin(async move {
                record(
                    c,
                    dialect,
                    &[AuditEvent::new(
                        "ev-rolled-back",
                        "s-0",
                        "change.applied",
                        "test",
                        json!({}),
                    )],
                )
                .await?;
                Err(sqlx::Error::Protocol("the change failed".into()))
            })
        })
        .await;
    assert!(r.is_err());
}

trait Placeholders {
    fn replace_placeholders(&self, d: Dialect) -> String;
}

impl Placeholders for str {
    fn replace_placeholders(&self, d: Dialect) -> String {
        if d == Dialect::Postgres {
            self.to_owned()
        } else {
            self.replace("$1", "?").replace("$2", "?")
        }
    }
}

fn options(sink: &JsonlSink, generation: i64, faults: Faults) -> AuditOptions {
    AuditOptions::new(sink.clone())
        .generation(generation)
        .batch(7)
        .lease(Duration::from_secs(30))
        .faults(faults)
}

/// Runs one delivery "process" until the outbox is empty (`Ok`) or its crash fires (`Err`).
async fn run(db: &Db, sink: &JsonlSink, generation: i64, faults: Faults) -> Result<(), String> {
    run_with(db, options(sink, generation, faults.clone()), faults).await
}

/// [`run`] with any options (`faults` must be the ones in `options`).
async fn run_with(db: &Db, options: AuditOptions, faults: Faults) -> Result<(), String> {
    let audit = Audit::without_migrations(db.clone(), options);
    audit
        .take_ownership("test")
        .await
        .map_err(|e| e.to_string())?;
    let ctl = Controller::new(
        audit.source(),
        Config::new("audit")
            .capacity(NonZeroUsize::new(1).unwrap())
            .shutdown_timeout(Duration::from_secs(20)),
    )
    .unwrap();
    audit.set_waker(ctl.waker());
    let cancel = CancellationToken::new();
    let mut task = tokio::spawn(ctl.run(cancel.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        tokio::select! {
            r = &mut task => {
                return match r.unwrap() {
                    Err(e) if faults.is_crashed() => Err(format!("crashed: {e}")),
                    other => panic!("the audit controller stopped: {other:?}"),
                };
            }
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
        if faults.is_crashed() {
            cancel.cancel();
            let _ = task.await;
            return Err("crashed".into());
        }
        if audit.observations().await.unwrap().undelivered == 0 {
            cancel.cancel();
            task.await.unwrap().map_err(|e| e.to_string())?;
            return Ok(());
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "audit did not drain"
        );
    }
}

/// Every committed event is in the file exactly once, no other line is, and each subject's
/// events are in the order they were written.
async fn assert_delivered_once(db: &Db, sink: &JsonlSink, n: usize, what: &str) {
    let lines: Vec<Line> = read_lines(sink).unwrap();
    let ids: Vec<&str> = lines.iter().map(|l| l.event_id.as_str()).collect();
    let unique: HashSet<&str> = ids.iter().copied().collect();
    assert_eq!(
        unique.len(),
        ids.len(),
        "{what}: a line was delivered twice"
    );
    let want: HashSet<String> = (0..n).map(|i| format!("ev-{i}")).collect();
    let got: HashSet<String> = unique.iter().map(|s| (*s).to_owned()).collect();
    assert_eq!(got, want, "{what}: every committed event, and only those");
    let mut per_subject: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for l in &lines {
        per_subject
            .entry(&l.subject)
            .or_default()
            .push(l.body["n"].as_i64().unwrap());
    }
    for (s, ns) in per_subject {
        assert!(
            ns.windows(2).all(|w| w[0] < w[1]),
            "{what}: {s} out of order: {ns:?}"
        );
    }
    // No event exists without its change, nor a change without its event.
    let changes: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM a_change")
        .fetch_one(db.pool())
        .await
        .unwrap();
    let events: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM audit_event")
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!((changes, events), (n as i64, n as i64), "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_commit_with_their_change_and_are_delivered_once_in_subject_order() {
    for d in DIALECTS {
        let Some((t, sink)) = setup(d, "once").await else {
            continue;
        };
        produce(&t.db, 0, 40).await;
        run(&t.db, &sink, 1, Faults::none()).await.unwrap();
        assert_delivered_once(&t.db, &sink, 40, &format!("{d:?}")).await;
        // More events later: appended after, still once.
        produce(&t.db, 40, 25).await;
        run(&t.db, &sink, 2, Faults::none()).await.unwrap();
        assert_delivered_once(&t.db, &sink, 65, &format!("{d:?} second run")).await;
        let audit = Audit::without_migrations(t.db.clone(), options(&sink, 1, Faults::none()));
        assert_eq!(audit.observations().await.unwrap().undelivered, 0);
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_every_point_delivers_every_event_exactly_once_after_recovery() {
    for d in DIALECTS {
        for point in CRASH_POINTS {
            let Some((t, sink)) = setup(d, "crash").await else {
                continue;
            };
            // Ten events delivered cleanly, then twenty more, and a process that crashes at
            // `point` on its first batch.
            produce(&t.db, 0, 10).await;
            run(&t.db, &sink, 1, Faults::none()).await.unwrap();
            produce(&t.db, 10, 20).await;
            let faults = Faults::new();
            faults.arm(point);
            let r = run(&t.db, &sink, 2, faults.clone()).await;
            assert!(r.is_err(), "{d:?}: the crash at {point:?} fired");
            assert_eq!(faults.fired(), Some(point));
            // A fresh process (a newer generation: it takes the lease over at once).
            run(&t.db, &sink, 3, Faults::none()).await.unwrap();
            assert_delivered_once(&t.db, &sink, 30, &format!("{d:?} crash {point:?}")).await;
            t.drop_database().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_last_line_is_truncated_and_its_events_delivered_once() {
    let Some((t, sink)) = setup(Dialect::Sqlite, "torn").await else {
        return;
    };
    produce(&t.db, 0, 10).await;
    run(&t.db, &sink, 1, Faults::none()).await.unwrap();
    produce(&t.db, 10, 10).await;
    // A crash in the middle of writing a line: half a line at the end of the file.
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(sink.path())
        .unwrap();
    f.write_all(br#"{"seq":11,"event_id":"ev-10","subj"#)
        .unwrap();
    drop(f);
    run(&t.db, &sink, 2, Faults::none()).await.unwrap();
    assert_delivered_once(&t.db, &sink, 20, "torn").await;
    let text = std::fs::read_to_string(sink.path()).unwrap();
    assert!(text.ends_with('\n') && !text.contains("\"subj{"), "{text}");
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_rotates_by_size_and_no_event_is_lost_or_repeated_across_files() {
    let Some((t, sink)) = setup(Dialect::Sqlite, "rotate").await else {
        return;
    };
    let sink = sink.max_bytes(2048).keep(50);
    produce(&t.db, 0, 100).await;
    run(&t.db, &sink, 1, Faults::none()).await.unwrap();
    assert!(sink.rotated(1).exists(), "rotated at 2 KiB");
    assert_delivered_once(&t.db, &sink, 100, "rotation").await;
    t.drop_database().await;
}

#[tokio::test]
async fn bad_events_and_an_unwritable_sink_are_clear_errors() {
    let Some((t, sink)) = setup(Dialect::Sqlite, "bad").await else {
        return;
    };
    let dialect = t.db.dialect();
    let r =
        t.db.write(&CancellationToken::new(), move |c| {
            Box::pin(async move {
                record(c, dialect, &[AuditEvent::new("", "s", "k", "a", json!({}))]).await
            })
        })
        .await;
    assert!(
        r.unwrap_err()
            .to_string()
            .contains("event id must be 1 to 191 bytes")
    );
    // The same event id twice is refused, not delivered twice.
    let r =
        t.db.write(&CancellationToken::new(), move |c| {
            Box::pin(async move {
                let e = AuditEvent::new("dup", "s", "k", "a", json!({}));
                record(c, dialect, std::slice::from_ref(&e)).await?;
                record(c, dialect, &[e]).await
            })
        })
        .await;
    assert!(r.is_err());
    let bad = JsonlSink::new("/nonexistent-dir/for/audit.jsonl");
    let e = Audit::open(t.db.clone(), AuditOptions::new(bad))
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("cannot open audit file /nonexistent-dir"),
        "{e}"
    );
    drop(sink);
    t.drop_database().await;
}

/// How many events the replica test delivers: 100,000 with `NEXUSCRM_AUDIT_EVENTS=100000`
/// (the documented full-size run), 3,000 by default (CI, on each backend).
fn replica_events() -> usize {
    std::env::var("NEXUSCRM_AUDIT_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3_000)
}

/// One replica: a controller over its own handle (same database, same sink, same generation).
fn spawn_replica(
    db: &Db,
    sink: &JsonlSink,
    faults: Faults,
    cancel: &CancellationToken,
) -> tokio::task::JoinHandle<Result<(), String>> {
    spawn_replica_handle(db, sink, faults, cancel).1
}

/// [`spawn_replica`], also returning the replica's handle (to wake it).
fn spawn_replica_handle(
    db: &Db,
    sink: &JsonlSink,
    faults: Faults,
    cancel: &CancellationToken,
) -> (Audit, tokio::task::JoinHandle<Result<(), String>>) {
    let audit = Audit::without_migrations(
        db.clone(),
        AuditOptions::new(sink.clone())
            .generation(1)
            .batch(100)
            .lease(Duration::from_secs(1))
            .faults(faults),
    );
    let ctl = Controller::new(
        audit.source(),
        Config::new("audit")
            .capacity(NonZeroUsize::new(1).unwrap())
            .shutdown_timeout(Duration::from_secs(20)),
    )
    .unwrap();
    audit.set_waker(ctl.waker());
    let cancel = cancel.clone();
    let handle = audit.clone();
    let task = tokio::spawn(async move {
        audit
            .take_ownership("test")
            .await
            .map_err(|e| e.to_string())?;
        ctl.run(cancel).await.map(drop).map_err(|e| e.to_string())
    });
    (handle, task)
}

async fn wait_for(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !done().await {
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_replica_taking_delivery_back_from_a_crashed_one_reads_the_tail_again() {
    for d in DIALECTS {
        let Some((t, sink)) = setup(d, "back").await else {
            continue;
        };
        let cancel = CancellationToken::new();
        // Replica A delivers (and has read the tail once), then goes idle.
        produce(&t.db, 0, 20).await;
        let (a, a_task) = spawn_replica_handle(&t.db, &sink, Faults::none(), &cancel);
        let probe = Audit::without_migrations(t.db.clone(), options(&sink, 1, Faults::none()));
        wait_for(&format!("{d:?}: A delivers"), async || {
            probe.observations().await.unwrap().undelivered == 0
        })
        .await;
        // A is idle once its lease (renewed by each of its claims) has lapsed: its last claim
        // and the `next_work_at` after it are over, and nothing wakes it (events written
        // during that turn would have been A's to deliver, not B's).
        wait_for(&format!("{d:?}: A's lease lapses"), async || {
            let until: i64 =
                sqlx::query_scalar("SELECT lease_until FROM audit_delivery WHERE id = 1")
                    .fetch_one(t.db.pool())
                    .await
                    .unwrap();
            until < nexuscrm_persistence::support::to_ms(std::time::SystemTime::now())
        })
        .await;
        // Replica B takes the lease, writes a batch and crashes unmarked.
        produce(&t.db, 20, 20).await;
        let faults = Faults::new();
        faults.arm(CrashPoint::AfterEffect);
        let b_task = spawn_replica(&t.db, &sink, faults.clone(), &cancel);
        wait_for(&format!("{d:?}: B crashes"), async || faults.is_crashed()).await;
        assert!(b_task.await.unwrap().is_err());
        // A takes delivery back after B's lease: it must read the tail again, not rewrite it.
        a.wake();
        wait_for(&format!("{d:?}: A delivers again"), async || {
            probe.observations().await.unwrap().undelivered == 0
        })
        .await;
        cancel.cancel();
        a_task.await.unwrap().unwrap();
        assert_delivered_once(&t.db, &sink, 40, &format!("{d:?} taken back")).await;
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_replicas_deliver_every_event_once_in_subject_order_after_two_crashed_holders() {
    let n = replica_events();
    for d in DIALECTS {
        let Some((t, sink)) = setup(d, "replicas").await else {
            continue;
        };
        let cancel = CancellationToken::new();
        // Replica 0 takes the first batch and crashes after writing it, before marking it.
        produce_in(&t.db, 0, 50, 50).await;
        let first = Faults::new();
        first.arm(CrashPoint::AfterEffect);
        let r0 = spawn_replica(&t.db, &sink, first.clone(), &cancel);
        wait_for(&format!("{d:?}: replica 0 crashes"), async || {
            first.is_crashed()
        })
        .await;
        assert!(
            r0.await.unwrap().is_err(),
            "{d:?}: replica 0 stopped on its crash"
        );
        assert!(
            !read_lines(&sink).unwrap().is_empty(),
            "{d:?}: the batch was written"
        );
        // Its restart takes over once the lease runs out, reads the tail, and crashes before
        // marking its own first batch.
        produce_in(&t.db, 50, 50, 50).await;
        let second = Faults::new();
        second.arm(CrashPoint::BeforeDisposition);
        let r1 = spawn_replica(&t.db, &sink, second.clone(), &cancel);
        wait_for(&format!("{d:?}: replica 1 crashes"), async || {
            second.is_crashed()
        })
        .await;
        assert!(
            r1.await.unwrap().is_err(),
            "{d:?}: replica 1 stopped on its crash"
        );
        // Four replicas deliver the rest while the producer writes it.
        let replicas: Vec<_> = (0..4)
            .map(|_| spawn_replica(&t.db, &sink, Faults::none(), &cancel))
            .collect();
        produce_in(&t.db, 100, n - 100, 50).await;
        let audit =
            Audit::without_migrations(t.db.clone(), AuditOptions::new(sink.clone()).generation(1));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
        while audit.observations().await.unwrap().undelivered > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{d:?}: the replicas did not drain: {:?}",
                audit.observations().await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        cancel.cancel();
        for r in replicas {
            r.await.unwrap().unwrap();
        }
        assert_delivered_once(&t.db, &sink, n, &format!("{d:?} 4 replicas")).await;
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_that_is_down_loses_nothing_and_gets_every_event_when_it_returns() {
    for d in DIALECTS {
        let Some((t, _)) = setup(d, "down").await else {
            continue;
        };
        let dir = sink_path("down").parent().unwrap().to_path_buf();
        let sink = JsonlSink::new(dir.join("sink").join("audit.jsonl"));
        std::fs::create_dir_all(dir.join("sink")).unwrap();
        produce(&t.db, 0, 20).await;
        run(&t.db, &sink, 1, Faults::none()).await.unwrap();
        // The sink goes away under a running controller: its directory is moved aside and a
        // plain file stands in its place, so opening the sink fails.
        let audit = Audit::without_migrations(t.db.clone(), options(&sink, 2, Faults::none()));
        audit.take_ownership("test").await.unwrap();
        let ctl = Controller::new(audit.source(), Config::new("audit")).unwrap();
        audit.set_waker(ctl.waker());
        let cancel = CancellationToken::new();
        let task = tokio::spawn(ctl.run(cancel.clone()));
        std::fs::rename(dir.join("sink"), dir.join("away")).unwrap();
        std::fs::write(dir.join("sink"), b"not a directory").unwrap();
        produce(&t.db, 20, 20).await;
        audit.wake();
        // The write fails: the controller stops (a supervisor restarts the process), the
        // error names the file, and the events stay undelivered.
        let e = tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("the controller stopped on the failed write")
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(e.contains("audit.jsonl"), "{d:?}: {e}");
        assert_eq!(audit.observations().await.unwrap().undelivered, 20, "{d:?}");
        // A restart while it is still down is refused at check_ready, still nothing lost.
        let again = Audit::without_migrations(t.db.clone(), options(&sink, 3, Faults::none()));
        again.take_ownership("test").await.unwrap();
        let ctl = Controller::new(again.source(), Config::new("audit")).unwrap();
        let e = ctl
            .run(CancellationToken::new())
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot open audit file"), "{d:?}: {e}");
        assert_eq!(again.observations().await.unwrap().undelivered, 20);
        // It returns: everything is delivered, once, after what it already held.
        std::fs::remove_file(dir.join("sink")).unwrap();
        std::fs::rename(dir.join("away"), dir.join("sink")).unwrap();
        run(&t.db, &sink, 4, Faults::none()).await.unwrap();
        assert_delivered_once(&t.db, &sink, 40, &format!("{d:?} sink down")).await;
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ownership_takeover_writes_one_event_in_its_transaction_and_a_refused_one_none() {
    for d in DIALECTS {
        let Some((t, _sink)) = setup(d, "owntaken").await else {
            continue;
        };
        let take = |g: i64, owner: &'static str| {
            let db = t.db.clone();
            async move { nexuscrm_audit::take_ownership_audited(&db, "bulk", g, owner).await }
        };
        take(1, "host-a").await.unwrap();
        take(1, "host-a").await.unwrap(); // The same generation again: no change, no event.
        let fence = take(2, "host-b").await.unwrap();
        assert_eq!(fence.generation(), 2, "{d}");
        let e = take(1, "host-a").await.unwrap_err();
        assert_eq!(
            e.kind(),
            nexuscrm_persistence::DbErrorKind::Superseded,
            "{d}: {e}"
        );
        let events = nexuscrm_audit::outbox(&t.db).await.unwrap();
        let seen: Vec<(&str, &str, &str, &str)> = events
            .iter()
            .map(|l| {
                (
                    l.event_id.as_str(),
                    l.kind.as_str(),
                    l.subject.as_str(),
                    l.actor.as_str(),
                )
            })
            .collect();
        assert_eq!(
            seen,
            [
                (
                    "ownership-bulk-g1",
                    "ownership.taken",
                    "family:bulk",
                    "host-a"
                ),
                (
                    "ownership-bulk-g2",
                    "ownership.taken",
                    "family:bulk",
                    "host-b"
                ),
            ],
            "{d}"
        );
        assert_eq!(
            events[0].body,
            json!({"family": "bulk", "generation": 1, "previous": null}),
            "{d}"
        );
        assert_eq!(
            events[1].body,
            json!({"family": "bulk", "generation": 2, "previous": 1}),
            "{d}"
        );
        // An event that cannot be written rolls the takeover back: generation 2 still owns.
        let long = "x".repeat(nexuscrm_audit::MAX_ID + 1);
        let e = nexuscrm_audit::take_ownership_audited(&t.db, "bulk", 3, &long)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("191 bytes"), "{d}: {e}");
        let e = take(2, "host-b").await;
        assert!(e.is_ok(), "{d}: generation 2 still owns bulk: {e:?}");
        assert_eq!(nexuscrm_audit::outbox(&t.db).await.unwrap().len(), 2, "{d}");
        t.drop_database().await;
    }
}

/// How the local audit receiver answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RxMode {
    /// Keeps the batch (deduplicating by event id) and answers 200.
    Accept,
    /// Keeps the batch but answers 503 for the next `n` requests (the answer is lost: the
    /// sender cannot know it was kept).
    KeepButFail(usize),
    /// 503 without keeping anything (down).
    Down,
    /// 422 with a reason: a permanent rejection.
    Reject,
}

#[derive(Debug)]
struct RxState {
    mode: RxMode,
    /// Every request's `Idempotency-Key`, in arrival order.
    keys: Vec<String>,
    /// The events kept, each once, in arrival order.
    events: Vec<Line>,
    /// Events received again and dropped by the deduplication.
    duplicates: usize,
    /// The keys each event arrived under.
    keys_of: BTreeMap<String, HashSet<String>>,
}

/// A local HTTP receiver for the audit sink: it deduplicates by event id, as the sink's
/// contract asks of a receiver.
#[derive(Clone)]
struct Receiver {
    state: Arc<Mutex<RxState>>,
    url: String,
}

impl Receiver {
    async fn start(mode: RxMode) -> Receiver {
        let state = Arc::new(Mutex::new(RxState {
            mode,
            keys: Vec::new(),
            events: Vec::new(),
            duplicates: 0,
            keys_of: BTreeMap::new(),
        }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/audit", listener.local_addr().unwrap());
        let app = axum::Router::new()
            .route("/audit", axum::routing::post(receive))
            .with_state(state.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Receiver { state, url }
    }

    fn set(&self, mode: RxMode) {
        self.state.lock().unwrap().mode = mode;
    }

    fn sink(&self) -> HttpSink {
        HttpSink::new(&self.url)
            .unwrap()
            .timeout(Duration::from_secs(5))
            .max_backoff(Duration::from_millis(50))
    }

    fn options(&self, generation: i64, faults: Faults) -> AuditOptions {
        AuditOptions::http(self.sink())
            .generation(generation)
            .batch(7)
            .lease(Duration::from_secs(30))
            .faults(faults)
    }
}

async fn receive(
    axum::extract::State(state): axum::extract::State<Arc<Mutex<RxState>>>,
    headers: axum::http::HeaderMap,
    body: String,
) -> (axum::http::StatusCode, String) {
    use axum::http::StatusCode;
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let mut s = state.lock().unwrap();
    s.keys.push(key.clone());
    if doc["idempotency_key"] != key.as_str() {
        return (StatusCode::BAD_REQUEST, "the body's key differs".into());
    }
    let keep = |s: &mut RxState| {
        let lines: Vec<Line> = serde_json::from_value(doc["events"].clone()).unwrap();
        for l in lines {
            s.keys_of
                .entry(l.event_id.clone())
                .or_default()
                .insert(key.clone());
            if s.events.iter().any(|e| e.event_id == l.event_id) {
                s.duplicates += 1;
            } else {
                s.events.push(l);
            }
        }
    };
    match s.mode {
        RxMode::Accept => {
            keep(&mut s);
            (StatusCode::OK, "{}".into())
        }
        RxMode::KeepButFail(n) => {
            keep(&mut s);
            s.mode = if n <= 1 {
                RxMode::Accept
            } else {
                RxMode::KeepButFail(n - 1)
            };
            (StatusCode::SERVICE_UNAVAILABLE, "lost answer".into())
        }
        RxMode::Down => (StatusCode::SERVICE_UNAVAILABLE, "down".into()),
        RxMode::Reject => (
            StatusCode::UNPROCESSABLE_ENTITY,
            "schema mismatch: no field `tenant`".into(),
        ),
    }
}

/// The receiver holds every committed event exactly once (its deduplication is by event id,
/// so this checks the sender never lost one and never sent an event under two keys), in
/// per-subject order, and the outbox has marked them all.
async fn assert_received_once(db: &Db, rx: &Receiver, n: usize, what: &str) {
    {
        let s = rx.state.lock().unwrap();
        let got: HashSet<String> = s.events.iter().map(|l| l.event_id.clone()).collect();
        let want: HashSet<String> = (0..n).map(|i| format!("ev-{i}")).collect();
        assert_eq!(got, want, "{what}: every committed event, and only those");
        let mut per_subject: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
        for l in &s.events {
            per_subject
                .entry(&l.subject)
                .or_default()
                .push(l.body["n"].as_i64().unwrap());
        }
        for (subject, ns) in per_subject {
            assert!(
                ns.windows(2).all(|w| w[0] < w[1]),
                "{what}: {subject} out of order: {ns:?}"
            );
        }
        // An event always travels under one key: a batch is resent whole, never re-cut.
        for (id, keys) in &s.keys_of {
            assert_eq!(keys.len(), 1, "{what}: {id} under {keys:?}");
        }
    }
    let audit = Audit::without_migrations(db.clone(), rx.options(1, Faults::none()));
    assert_eq!(audit.observations().await.unwrap().undelivered, 0, "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_sink_resends_an_ambiguous_batch_under_its_key_and_delivers_each_event_once() {
    for d in DIALECTS {
        let Some((t, _)) = setup(d, "http").await else {
            continue;
        };
        produce(&t.db, 0, 40).await;
        // The receiver keeps the first three requests but its answers are lost (503).
        let rx = Receiver::start(RxMode::KeepButFail(3)).await;
        run_with(&t.db, rx.options(1, Faults::none()), Faults::none())
            .await
            .unwrap();
        assert_received_once(&t.db, &rx, 40, &format!("{d:?} http")).await;
        {
            let s = rx.state.lock().unwrap();
            // Each lost answer was followed by the same batch under the same key.
            assert_eq!(s.keys[0], s.keys[1], "{d:?}: {:?}", s.keys);
            assert_eq!(s.keys[1], s.keys[2], "{d:?}: {:?}", s.keys);
            assert_eq!(s.keys[2], s.keys[3], "{d:?}: {:?}", s.keys);
            assert_eq!(
                s.duplicates,
                3 * 7,
                "{d:?}: three resends of a batch of 7, deduplicated"
            );
            // 40 events in batches of 7: 6 batches, 3 of them sent again.
            assert_eq!(s.keys.len(), 6 + 3, "{d:?}: {:?}", s.keys);
        }
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_sink_delivers_every_event_once_after_a_crash_at_every_point() {
    for d in DIALECTS {
        for point in CRASH_POINTS {
            let Some((t, _)) = setup(d, "httpcrash").await else {
                continue;
            };
            let rx = Receiver::start(RxMode::Accept).await;
            produce(&t.db, 0, 10).await;
            run_with(&t.db, rx.options(1, Faults::none()), Faults::none())
                .await
                .unwrap();
            produce(&t.db, 10, 20).await;
            let faults = Faults::new();
            faults.arm(point);
            let r = run_with(&t.db, rx.options(2, faults.clone()), faults.clone()).await;
            assert!(r.is_err(), "{d:?}: the crash at {point:?} fired");
            assert_eq!(faults.fired(), Some(point));
            run_with(&t.db, rx.options(3, Faults::none()), Faults::none())
                .await
                .unwrap();
            let what = format!("{d:?} http crash {point:?}");
            assert_received_once(&t.db, &rx, 30, &what).await;
            {
                let s = rx.state.lock().unwrap();
                if matches!(
                    point,
                    CrashPoint::AfterEffect | CrashPoint::BeforeDisposition
                ) {
                    // Sent, not marked: the next holder sent that batch again, under its key.
                    assert_eq!(s.duplicates, 7, "{what}: {:?}", s.keys);
                } else {
                    assert_eq!(s.duplicates, 0, "{what}: {:?}", s.keys);
                }
            }
            t.drop_database().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_is_down_gets_everything_when_it_returns_and_a_rejection_stops_delivery() {
    for d in DIALECTS {
        let Some((t, _)) = setup(d, "httpdown").await else {
            continue;
        };
        produce(&t.db, 0, 20).await;
        let rx = Receiver::start(RxMode::Down).await;
        let audit = Audit::without_migrations(t.db.clone(), rx.options(1, Faults::none()));
        audit.take_ownership("test").await.unwrap();
        let ctl = Controller::new(audit.source(), Config::new("audit")).unwrap();
        audit.set_waker(ctl.waker());
        let cancel = CancellationToken::new();
        let task = tokio::spawn(ctl.run(cancel.clone()));
        wait_for("the down receiver to be tried three times", async || {
            rx.state.lock().unwrap().keys.len() >= 3
        })
        .await;
        assert!(
            !task.is_finished(),
            "{d:?}: a receiver that is down is retried"
        );
        assert_eq!(audit.observations().await.unwrap().undelivered, 20, "{d:?}");
        rx.set(RxMode::Accept);
        wait_for("delivery after the receiver returned", async || {
            audit.observations().await.unwrap().undelivered == 0
        })
        .await;
        cancel.cancel();
        task.await.unwrap().unwrap();
        assert_received_once(&t.db, &rx, 20, &format!("{d:?} down")).await;

        // A permanent rejection stops the controller with the receiver's reason; the batch
        // stays undelivered, nothing is lost.
        produce(&t.db, 20, 5).await;
        rx.set(RxMode::Reject);
        let again = Audit::without_migrations(t.db.clone(), rx.options(2, Faults::none()));
        again.take_ownership("test").await.unwrap();
        let ctl = Controller::new(again.source(), Config::new("audit")).unwrap();
        again.set_waker(ctl.waker());
        let e = tokio::time::timeout(Duration::from_secs(60), ctl.run(CancellationToken::new()))
            .await
            .expect("the controller stopped on the rejection")
            .unwrap_err()
            .to_string();
        assert!(e.contains("rejected batch audit-"), "{d:?}: {e}");
        assert!(e.contains("422 schema mismatch"), "{d:?}: {e}");
        assert_eq!(again.observations().await.unwrap().undelivered, 5, "{d:?}");
        rx.set(RxMode::Accept);
        run_with(&t.db, rx.options(3, Faults::none()), Faults::none())
            .await
            .unwrap();
        assert_received_once(&t.db, &rx, 25, &format!("{d:?} after the rejection")).await;
        t.drop_database().await;
    }
}
