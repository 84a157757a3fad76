//! Scheduled Flow against real SQLite, PostgreSQL and MariaDB: the producer API, misfire
//! policies after downtime, an update racing a reservation, exact claim budgets while idle, and
//! four workers reserving 500 schedules every second (also over a three-node Galera cluster).

mod common;

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use common::*;
use nexuscrm_flow::{
    Flow, FlowErrorKind, FlowOptions, FlowSource, MisfirePolicy, NewSchedule, ScheduleUpdate, Spec,
};
use nexuscrm_persistence::support::from_ms;
use nexuscrm_persistence::testing::GaleraDb;
use nexuscrm_persistence::{Db, Dialect};
use nexuscrm_worker::{Attempt, Source};
use nexuscrm_worker_test::scenarios::Counted;
use tokio_util::sync::CancellationToken;

const MIN: i64 = 60_000;

fn every(secs: u64) -> Spec {
    Spec::Every(Duration::from_secs(secs))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_producer_rejects_bad_input_before_storing_and_changes_in_one_transaction() {
    for d in DIALECTS {
        let Some((t, flow)) = flow_on(d, "producer", FlowOptions::default()).await else {
            continue;
        };
        let bad = [
            (Spec::cron("0 61 * * * *", "UTC"), "invalid cron expression"),
            (
                Spec::cron("0 0 * * * *", "Mars/Olympus"),
                "unknown time zone",
            ),
            (Spec::cron("0 0 0 30 2 *", "UTC"), "never fires"),
            (Spec::Every(Duration::from_millis(5)), "outside"),
        ];
        for (spec, why) in bad {
            let e = flow
                .create(NewSchedule::new("s", "f", spec, MisfirePolicy::FireOnce))
                .await
                .unwrap_err();
            assert_eq!(e.kind(), FlowErrorKind::Invalid, "{d}: {e}");
            assert!(e.to_string().contains(why), "{d}: {e}");
        }
        let e = flow
            .create(NewSchedule::new("", "f", every(1), MisfirePolicy::Skip))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), FlowErrorKind::Invalid);
        assert!(
            flow.list(10).await.unwrap().is_empty(),
            "{d}: nothing stored"
        );

        // Create is idempotent for the same definition, a conflict for another.
        let def = NewSchedule::new(
            "nightly",
            "digest",
            Spec::cron("0 30 2 * * *", "Europe/Berlin"),
            MisfirePolicy::CatchUp { max: 3 },
        );
        let a = flow.create(def.clone()).await.unwrap();
        let b = flow.create(def.clone()).await.unwrap();
        assert!(a.created && !b.created && a.id == b.id, "{d}");
        let mut other = def.clone();
        other.spec = every(60);
        let e = flow.create(other).await.unwrap_err();
        assert_eq!(e.kind(), FlowErrorKind::Conflict, "{d}: {e}");

        let s = flow.schedule(a.id).await.unwrap().unwrap();
        assert_eq!((s.version, s.state.as_str(), s.runs), (1, "active", 0));
        let next = s.next_occurrence_at.unwrap();
        assert!(
            next > SystemTime::now(),
            "{d}: the cursor is the next 02:30 in Berlin"
        );

        // Update: new spec, cursor recomputed, version bumped; optimistic version check.
        let u = flow
            .update(
                a.id,
                ScheduleUpdate {
                    spec: Some(every(3600)),
                    policy: Some(MisfirePolicy::Skip),
                    expected_version: Some(1),
                },
            )
            .await
            .unwrap();
        assert_eq!(u.version, 2);
        assert_eq!(u.policy, MisfirePolicy::Skip);
        let c = ms(u.next_occurrence_at.unwrap());
        assert_eq!(c % 3_600_000, 0, "{d}: aligned to the hour (epoch anchor)");
        assert!(c >= ms(SystemTime::now()) - 1000 && c <= ms(SystemTime::now()) + 3_600_000);
        let e = flow
            .update(
                a.id,
                ScheduleUpdate {
                    expected_version: Some(1),
                    ..ScheduleUpdate::default()
                },
            )
            .await
            .unwrap_err();
        assert_eq!(e.kind(), FlowErrorKind::Conflict, "{d}: {e}");
        let e = flow
            .update(
                a.id,
                ScheduleUpdate {
                    spec: Some(Spec::cron("nope", "UTC")),
                    ..ScheduleUpdate::default()
                },
            )
            .await
            .unwrap_err();
        assert_eq!(e.kind(), FlowErrorKind::Invalid);
        assert_eq!(flow.schedule(a.id).await.unwrap().unwrap().version, 2);

        // Pause, resume, delete.
        let p = flow.pause(a.id).await.unwrap();
        assert_eq!((p.state.as_str(), p.version), ("paused", 3));
        assert_eq!(flow.pause(a.id).await.unwrap().version, 3, "idempotent");
        let r = flow.resume(a.id).await.unwrap();
        assert_eq!((r.state.as_str(), r.version), ("active", 4));
        flow.delete(a.id).await.unwrap();
        assert!(flow.schedule(a.id).await.unwrap().is_none());
        let e = flow.pause(a.id).await.unwrap_err();
        assert_eq!(e.kind(), FlowErrorKind::NotFound);
        t.drop_database().await;
    }
}

async fn claim_all(source: &FlowSource) -> Vec<nexuscrm_flow::FlowAttempt> {
    source
        .claim(NonZeroUsize::new(64).unwrap(), CancellationToken::new())
        .await
        .unwrap()
        .into_parts()
        .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_downtime_a_restarted_worker_applies_each_misfire_policy_exactly() {
    for d in DIALECTS {
        let t0 = from_ms(1_800_000_000_000); // A whole minute.
        let clock = ManualClock::at(t0 - Duration::from_secs(1));
        let options = FlowOptions::default()
            .clock(clock.clone())
            .config(test_config().chunk(4));
        let Some((t, flow)) = flow_on(d, "downtime", options).await else {
            continue;
        };
        // The reservation hook sees what each committed reservation stored.
        let seen = Arc::new(Mutex::new(Vec::<nexuscrm_flow::RunsReserved>::new()));
        let s2 = seen.clone();
        flow.on_runs_reserved(move |r| s2.lock().unwrap().push(r.clone()));
        let policies = [
            ("catch-up-all", MisfirePolicy::CatchUp { max: 100 }),
            ("catch-up-3", MisfirePolicy::CatchUp { max: 3 }),
            ("fire-once", MisfirePolicy::FireOnce),
            ("skip", MisfirePolicy::Skip),
        ];
        let mut ids = Vec::new();
        for (name, policy) in policies {
            let mut s = NewSchedule::new(name, "report", every(60), policy);
            s.start_at = Some(t0);
            ids.push(flow.create(s).await.unwrap().id);
        }
        // A skip schedule whose latest occurrence is within the grace when the worker returns.
        let mut s = NewSchedule::new("skip-on-time", "report", every(60), MisfirePolicy::Skip);
        s.start_at = Some(t0 + Duration::from_secs(10 * 60 + 25));
        ids.push(flow.create(s).await.unwrap().id);

        // No worker ran for 10.5 minutes: occurrences t0 .. t0+10m (11 of them) are due.
        let back = t0 + Duration::from_secs(10 * 60 + 30);
        clock.set(back);
        let cancel = CancellationToken::new();
        let cfg = controller_config("downtime", 8).clock(clock.clone());
        let run = tokio::spawn(worker(flow.clone(), cfg, cancel.clone()));
        wait_cursors_past(&t.db, ms(back), Duration::from_secs(60)).await;
        cancel.cancel();
        run.await.unwrap();

        let runs = runs_by_schedule(&t.db).await;
        let at = |m: i64| ms(t0) + m * MIN;
        let want: [Vec<i64>; 5] = [
            (0..=10).map(at).collect(),
            vec![at(8), at(9), at(10)],
            vec![at(10)],
            vec![],
            vec![at(10) + 25_000],
        ];
        for (i, id) in ids.iter().enumerate() {
            let got = runs.get(&id.0).cloned().unwrap_or_default();
            assert_eq!(got, want[i], "{d}: schedule {i}");
            let s = flow.schedule(*id).await.unwrap().unwrap();
            let cursor = ms(s.next_occurrence_at.unwrap());
            let expect = if i == 4 { at(11) + 25_000 } else { at(11) };
            assert_eq!(cursor, expect, "{d}: schedule {i} resumes after now");
            assert_eq!(s.state, "active");
        }
        let mut hooked: std::collections::BTreeMap<i64, Vec<i64>> = Default::default();
        for r in seen.lock().unwrap().iter() {
            assert_eq!(r.flow, "report", "{d}");
            assert_eq!(r.reserved_at, back, "{d}: the reservation's clock reading");
            assert!(!r.occurrences.is_empty(), "{d}: no call without runs");
            let e = hooked.entry(r.schedule.0).or_default();
            e.extend(r.occurrences.iter().map(|&o| ms(o)));
        }
        let stored: std::collections::BTreeMap<i64, Vec<i64>> =
            runs.into_iter().filter(|(_, v)| !v.is_empty()).collect();
        assert_eq!(hooked, stored, "{d}: the hook saw exactly the stored runs");
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_racing_a_reservation_rejects_the_stale_reservation_and_the_new_spec_governs() {
    for d in DIALECTS {
        let t0 = from_ms(1_800_000_000_000);
        let clock = ManualClock::at(t0 - Duration::from_secs(1));
        let options = FlowOptions::default()
            .clock(clock.clone())
            .config(test_config());
        let Some((t, flow)) = flow_on(d, "race", options).await else {
            continue;
        };
        let mut s = NewSchedule::new("r", "f", every(60), MisfirePolicy::CatchUp { max: 10 });
        s.start_at = Some(t0);
        let id = flow.create(s).await.unwrap().id;
        clock.set(t0 + Duration::from_secs(1));
        let source = flow.source();
        let mut claimed = claim_all(&source).await;
        assert_eq!(claimed.len(), 1);
        // The producer changes the spec while the reservation is in flight.
        let u = flow
            .update(
                id,
                ScheduleUpdate {
                    spec: Some(every(3600)),
                    ..ScheduleUpdate::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(u.version, 2);
        let new_cursor = ms(t0) + 3_600_000;
        assert_eq!(ms(u.next_occurrence_at.unwrap()), new_cursor);
        claimed
            .pop()
            .unwrap()
            .run(CancellationToken::new())
            .await
            .unwrap();
        assert!(
            runs_by_schedule(&t.db).await.is_empty(),
            "{d}: the stale reservation inserted nothing"
        );
        let s = flow.schedule(id).await.unwrap().unwrap();
        assert_eq!((s.version, s.state.as_str()), (2, "active"));
        assert_eq!(ms(s.next_occurrence_at.unwrap()), new_cursor, "{d}");
        // Nothing is due under the new spec until its first occurrence.
        assert!(claim_all(&source).await.is_empty());
        clock.set(from_ms(new_cursor + 1));
        for a in claim_all(&source).await {
            a.run(CancellationToken::new()).await.unwrap();
        }
        let runs = flow.runs(Some(id), 10).await.unwrap();
        assert_eq!(runs.len(), 1);
        assert_eq!(ms(runs[0].occurrence_at), new_cursor);
        assert_eq!(
            runs[0].schedule_version, 2,
            "{d}: reserved under the new version"
        );

        // Concurrent races: whichever commits first, each occurrence has at most one run, and
        // after the update the cursor is the new spec's.
        for round in 0..10i64 {
            let base = new_cursor + (round + 1) * 7_200_000;
            let spec = if round % 2 == 0 {
                every(60)
            } else {
                every(3600)
            };
            flow.update(
                id,
                ScheduleUpdate {
                    spec: Some(spec),
                    ..ScheduleUpdate::default()
                },
            )
            .await
            .unwrap();
            clock.set(from_ms(base + 1));
            let attempts = claim_all(&source).await;
            let racer = flow.clone();
            let update = tokio::spawn(async move {
                racer
                    .update(
                        id,
                        ScheduleUpdate {
                            spec: Some(every(1800)),
                            ..ScheduleUpdate::default()
                        },
                    )
                    .await
                    .unwrap()
            });
            for a in attempts {
                a.run(CancellationToken::new()).await.unwrap();
            }
            let u = update.await.unwrap();
            let s = flow.schedule(id).await.unwrap().unwrap();
            assert_eq!(s.version, u.version, "{d}: the update is the last word");
            let c = ms(s.next_occurrence_at.unwrap());
            assert_eq!((c - ms(t0)) % 1_800_000, 0, "{d}: the new spec governs");
        }
        let (total, distinct) = run_counts(&t.db).await;
        assert_eq!(total, distinct, "{d}: no occurrence reserved twice");
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_worker_claims_only_at_due_times_and_never_between_them() {
    for d in DIALECTS {
        let Some((t, flow)) =
            flow_on(d, "idle", FlowOptions::default().config(test_config())).await
        else {
            continue;
        };
        // One schedule, every second from the next whole second + 1 s: after each
        // reservation the controller must re-arm for the next occurrence by itself.
        let start = next_second(SystemTime::now()) + Duration::from_secs(1);
        let mut s = NewSchedule::new("s", "f", every(1), MisfirePolicy::Skip);
        s.start_at = Some(start);
        flow.create(s).await.unwrap();
        let source = Counted::new(flow.source());
        let counts = source.counts();
        let ctl = nexuscrm_worker::Controller::new(source, controller_config("idle", 4)).unwrap();
        flow.set_waker(ctl.waker());
        let cancel = CancellationToken::new();
        let run = tokio::spawn(ctl.run(cancel.clone()));
        tokio::time::sleep(
            start.duration_since(SystemTime::now()).unwrap_or_default()
                + Duration::from_millis(5_500),
        )
        .await;
        cancel.cancel();
        let ctl = run.await.unwrap().expect("clean stop");
        let claims = counts.batches();
        let runs: i64 = runs_by_schedule(&t.db)
            .await
            .values()
            .map(|v| v.len() as i64)
            .sum();
        // Occurrences at start+0..=5 s: six reservations, each claimed at its due time.
        assert!(runs >= 5, "{d}: {runs} runs");
        assert_eq!(
            claims[0], 0,
            "{d}: the start-up claim finds nothing due yet"
        );
        assert!(
            claims[1..].iter().all(|&n| n > 0),
            "{d}: a claim between due times found nothing: {claims:?}"
        );
        assert_eq!(
            claims[1..].iter().sum::<usize>() as i64,
            runs,
            "{d}: {claims:?}"
        );
        let snap = ctl.handle().snapshot();
        assert_eq!(snap.claim_calls as usize, claims.len());
        assert_eq!(snap.overdue_suppressed, 0, "{d}");
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_postgres_worker_issues_no_statements_between_due_times() {
    let Some((t, flow)) = flow_on(
        Dialect::Postgres,
        "idlepg",
        FlowOptions::default().config(test_config().listen(true)),
    )
    .await
    else {
        return;
    };
    let due = next_second(SystemTime::now()) + Duration::from_secs(3);
    let mut s = NewSchedule::new("hourly", "f", every(3600), MisfirePolicy::Skip);
    s.start_at = Some(due);
    flow.create(s).await.unwrap();
    let ctl = nexuscrm_worker::Controller::new(flow.source(), controller_config("pg", 4)).unwrap();
    flow.set_waker(ctl.waker());
    let cancel = CancellationToken::new();
    let run = tokio::spawn(ctl.run(cancel.clone()));
    // Let start-up finish, then watch a window that ends before the due time.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let window_start = SystemTime::now();
    tokio::time::sleep(
        due.duration_since(SystemTime::now()).unwrap_or_default() - Duration::from_millis(300),
    )
    .await;
    let busy: i64 = nexuscrm_persistence::sqlx::query_scalar(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND pid <> pg_backend_pid() AND query NOT LIKE '%pg_stat_activity%' \
         AND query_start > now() - make_interval(secs => $1)",
    )
    .bind(
        SystemTime::now()
            .duration_since(window_start)
            .unwrap()
            .as_secs_f64(),
    )
    .fetch_one(t.db.pool())
    .await
    .unwrap();
    assert_eq!(
        busy, 0,
        "an idle worker issued statements before the due time"
    );
    wait_cursors_past(&t.db, ms(due), Duration::from_secs(10)).await;
    cancel.cancel();
    run.await.unwrap().expect("clean stop");
    let runs = flow.runs(None, 10).await.unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].occurrence_at, due);
    t.drop_database().await;
}

fn load_secs(default: u64) -> u64 {
    std::env::var("NEXUSCRM_FLOW_LOAD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

async fn load(d: Dialect) {
    let Some((t, producer)) =
        flow_on(d, "load", FlowOptions::default().config(test_config())).await
    else {
        return;
    };
    load_on(
        &d.to_string(),
        &producer,
        &t.db,
        std::slice::from_ref(&t.url),
        load_secs(30),
    )
    .await;
    t.drop_database().await;
}

/// 500 schedules firing every second for `secs`, reserved by four workers, worker `w` on its
/// own pool to `urls[w % urls.len()]`; `read` is where the checks read (on Galera, a causal
/// read). Returns the runs reserved.
async fn load_on(d: &str, producer: &Flow, read: &Db, urls: &[String], secs: u64) -> usize {
    let start = next_second(SystemTime::now()) + Duration::from_secs(2);
    for i in 0..500 {
        let mut s = NewSchedule::new(
            format!("load-{i}"),
            "tick",
            every(1),
            MisfirePolicy::CatchUp { max: 1000 },
        );
        s.start_at = Some(start);
        producer.create(s).await.unwrap();
    }
    let cancel = CancellationToken::new();
    let mut workers = Vec::new();
    let handles = Arc::new(Mutex::new(Vec::new()));
    for w in 0..4 {
        let db = Db::connect(&urls[w % urls.len()]).await.unwrap();
        let flow = nexuscrm_flow::Flow::without_migrations(
            db,
            1,
            FlowOptions::default().config(test_config()),
        );
        workers.push(tokio::spawn(worker_with(
            flow,
            controller_config(&format!("w{w}"), 64),
            cancel.clone(),
            Some(handles.clone()),
        )));
    }
    let end = start + Duration::from_secs(secs);
    tokio::time::sleep(end.duration_since(SystemTime::now()).unwrap_or_default()).await;
    // Every occurrence up to the end is reserved shortly after it is due (a worker that
    // stopped surfaces its own failure here).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(i) = workers.iter().position(|w| w.is_finished()) {
            let w = workers.remove(i);
            panic!("{d}: worker {i} stopped early: {:?}", w.await);
        }
        let c = cursors(read).await;
        if c.values().all(|v| v.is_some_and(|v| v > ms(end))) {
            break;
        }
        let min = c.values().flatten().min().copied().unwrap_or(0);
        if tokio::time::Instant::now() >= deadline {
            let snaps: Vec<_> = handles
                .lock()
                .unwrap()
                .iter()
                .map(|h| h.snapshot())
                .collect();
            let states: Vec<(String, i64)> = nexuscrm_persistence::sqlx::query_as(
                "SELECT state, COUNT(*) FROM flow_schedule GROUP BY state",
            )
            .fetch_all(read.pool())
            .await
            .unwrap_or_default();
            panic!(
                "{d}: cursors did not pass the end; the slowest is {} ms behind; \
                 states {states:?}; workers {snaps:#?}",
                ms(end) - min
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cancel.cancel();
    let mut claimed = Vec::new();
    for w in workers {
        claimed.push(w.await.unwrap());
    }
    let runs = runs_by_schedule(read).await;
    let cursors = cursors(read).await;
    assert_eq!(cursors.len(), 500);
    let mut total = 0;
    for (id, cursor) in &cursors {
        let r = runs.get(id).map(Vec::as_slice).unwrap_or_default();
        assert_exact(d, *id, ms(start), 1000, r, *cursor);
        total += r.len();
    }
    let (rows, distinct) = run_counts(read).await;
    assert_eq!((rows, distinct), (total as i64, total as i64), "{d}");
    assert!(total >= 500 * secs as usize, "{d}: {total} runs");
    println!("{d}: {total} runs by 4 workers (claimed {claimed:?})");
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_workers_reserve_500_schedules_every_second_exactly_once_on_sqlite() {
    load(Dialect::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_workers_reserve_500_schedules_every_second_exactly_once_on_postgres() {
    load(Dialect::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_workers_reserve_500_schedules_every_second_exactly_once_on_mysql() {
    load(Dialect::Mysql).await;
}

/// The same load on the three-node Galera cluster, the workers spread over the nodes (1, 2, 3,
/// 1), each on its own pool: a reservation that loses certification at COMMIT rolled back and
/// is retried, so every occurrence is still reserved exactly once (checked through a causal
/// read). 20 s of schedules here; `NEXUSCRM_FLOW_LOAD_SECS` sets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_workers_over_three_galera_nodes_reserve_500_schedules_every_second_exactly_once() {
    let Some(g) = GaleraDb::create("galera_flow").await else {
        return;
    };
    let producer = Flow::open(
        g.test.db.clone(),
        1,
        FlowOptions::default().config(test_config()),
    )
    .await
    .expect("migrate through node 1");
    producer.take_ownership("test").await.unwrap();
    let before = g.conflicts().await;
    let read = g.causal(2).await;
    let total = load_on("galera", &producer, &read, &g.nodes, load_secs(20)).await;
    read.close().await;
    println!(
        "galera: {total} runs; {} certification failures or brute-force aborts meanwhile",
        g.conflicts().await - before
    );
    g.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_generation_fenced_out_while_alive_can_neither_claim_nor_reserve() {
    for d in DIALECTS {
        let Some((t, gen1)) = flow_on(d, "fenced", FlowOptions::default()).await else {
            continue;
        };
        // Due at once: one occurrence one second ago.
        let mut s = NewSchedule::new("fenced", "tick", every(60), MisfirePolicy::FireOnce);
        s.start_at = Some(SystemTime::now() - Duration::from_secs(1));
        gen1.create(s).await.unwrap();
        let src1 = gen1.source();
        let mut held = claim_all(&src1).await;
        assert_eq!(held.len(), 1, "{d}");
        // Generation 2 takes over while generation 1 still holds the schedule's lease.
        let gen2 = nexuscrm_flow::Flow::without_migrations(
            t.db.clone(),
            2,
            FlowOptions::default().config(test_config()),
        );
        gen2.take_ownership("new").await.unwrap();
        // Generation 1's reservation is fenced out: no run is written.
        held.pop()
            .unwrap()
            .run(CancellationToken::new())
            .await
            .unwrap();
        assert_eq!(
            run_counts(&t.db).await,
            (0, 0),
            "{d}: the fenced reservation wrote nothing"
        );
        // Generation 1 claims and reconciles no more, and says why.
        let err = src1
            .claim(NonZeroUsize::new(4).unwrap(), CancellationToken::new())
            .await
            .unwrap_err();
        assert!(err.is_superseded() && err.is_not_committed(), "{d}: {err}");
        let err = src1.reconcile(CancellationToken::new()).await.unwrap_err();
        assert!(err.is_superseded(), "{d}: {err}");
        // Generation 2 reconciles (releasing generation 1's lease at once) and reserves it once.
        let src2 = gen2.source();
        src2.reconcile(CancellationToken::new()).await.unwrap();
        for a in claim_all(&src2).await {
            a.run(CancellationToken::new()).await.unwrap();
        }
        assert_eq!(run_counts(&t.db).await, (1, 1), "{d}");
        assert!(gen1.take_ownership("old").await.is_err(), "{d}");
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_operations_blocked_on_a_lock_commit_nothing_when_cancelled() {
    for d in DIALECTS {
        let Some((t, flow)) = flow_on(d, "blocked", FlowOptions::default()).await else {
            continue;
        };
        let mut s = NewSchedule::new("blocked", "tick", every(60), MisfirePolicy::FireOnce);
        s.start_at = Some(SystemTime::now() - Duration::from_secs(1));
        flow.create(s).await.unwrap();
        let src = flow.source();
        // Another connection holds every fence stripe, which every claim and reconciliation takes
        // (SQLite: the write lock).
        let mut holder = t.db.begin_write().await.unwrap();
        nexuscrm_persistence::sqlx::query(
            "UPDATE runtime_work_fence_stripe SET generation = generation",
        )
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
        // The domain proof that nothing committed: the schedule is not leased, no run exists,
        // and a fresh claim takes it at once.
        let o = flow.observations().await.unwrap();
        assert_eq!((o.active, o.leased, o.runs), (1, 0, 0), "{d}");
        assert_eq!(claim_all(&src).await.len(), 1, "{d}");
        t.drop_database().await;
    }
}

/// The MySQL dialect reads a claim's schedules back by its token (TiDB ignores RETURNING):
/// an index lookup on `flow_schedule_claim`, never a scan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mysql_claim_read_back_is_an_index_lookup_on_the_claim_token() {
    let Some((t, _flow)) = flow_on(Dialect::Mysql, "claimplan", FlowOptions::default()).await
    else {
        return;
    };
    let (plan, keys) = nexuscrm_persistence::testing::explain_mysql(
        &t.db,
        "SELECT id, version FROM flow_schedule WHERE claim_token = 'c-1'",
    )
    .await
    .unwrap();
    eprintln!("claimed read-back plan: {plan:?}");
    assert_eq!(
        keys,
        vec![Some("flow_schedule_claim".to_owned())],
        "{plan:?}"
    );
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observed_counts_stop_at_their_cap_and_are_exact_below_it() {
    for d in DIALECTS {
        let Some((t, flow)) = flow_on(d, "observed_cap", FlowOptions::default()).await else {
            continue;
        };
        for name in ["a", "b", "c"] {
            flow.create(NewSchedule::new(name, "f", every(60), MisfirePolicy::Skip))
                .await
                .unwrap();
        }
        let capped = flow.observations_capped(2).await.unwrap();
        assert_eq!(
            (capped.active, capped.leased, capped.paused, capped.runs),
            (2, 0, 0, 0),
            "{d}: {capped:?}"
        );
        assert_eq!(capped.count_cap, 2, "{d}");
        let exact = flow.observations().await.unwrap();
        assert_eq!((exact.active, exact.runs), (3, 0), "{d}: {exact:?}");
        assert_eq!(
            exact.count_cap,
            nexuscrm_persistence::OBSERVATION_CAP,
            "{d}"
        );
        t.drop_database().await;
    }
}

/// The audit events in the outbox, as `(kind, subject, actor)`.
async fn audit_trail(db: &Db) -> Vec<(String, String, String)> {
    nexuscrm_audit::outbox(db)
        .await
        .unwrap()
        .into_iter()
        .map(|l| (l.kind, l.subject, l.actor))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_schedule_change_writes_one_audit_event_in_its_transaction_and_no_op_changes_none() {
    for d in DIALECTS {
        let options =
            FlowOptions::default().config(nexuscrm_flow::FlowConfig::default().audit(true));
        let Some((t, flow)) = flow_on(d, "flowaudit", options).await else {
            continue;
        };
        let ops = flow.acting_as("ops@acme.test");
        let def = NewSchedule::new("nightly", "digest", every(60), MisfirePolicy::Skip);
        let id = ops.create(def.clone()).await.unwrap().id;
        // Changes that change nothing write nothing.
        assert!(!ops.create(def.clone()).await.unwrap().created, "{d}");
        let mut other = def.clone();
        other.spec = every(30);
        ops.create(other).await.unwrap_err();
        ops.pause(id).await.unwrap();
        ops.pause(id).await.unwrap();
        flow.resume(id).await.unwrap();
        flow.resume(id).await.unwrap();
        ops.update(
            id,
            ScheduleUpdate {
                spec: Some(every(120)),
                ..ScheduleUpdate::default()
            },
        )
        .await
        .unwrap();
        // A refused update (a stale version) writes nothing either.
        ops.update(
            id,
            ScheduleUpdate {
                expected_version: Some(1),
                ..ScheduleUpdate::default()
            },
        )
        .await
        .unwrap_err();
        ops.delete(id).await.unwrap();
        let subject = format!("schedule:{}", id.0);
        let want: Vec<(String, String, String)> = [
            ("schedule.created", "ops@acme.test"),
            ("schedule.paused", "ops@acme.test"),
            ("schedule.resumed", "operator"),
            ("schedule.updated", "ops@acme.test"),
            ("schedule.deleted", "ops@acme.test"),
        ]
        .into_iter()
        .map(|(k, a)| (k.to_owned(), subject.clone(), a.to_owned()))
        .collect();
        assert_eq!(audit_trail(&t.db).await, want, "{d}");
        // The update's body says what changed, before and after.
        let events = nexuscrm_audit::outbox(&t.db).await.unwrap();
        let updated = &events[3].body;
        assert_eq!(updated["name"], "nightly", "{d}: {updated}");
        assert_eq!(updated["before"]["spec"], every(60).to_string(), "{d}");
        assert_eq!(updated["after"]["spec"], every(120).to_string(), "{d}");
        assert!(events[4].body["after"].is_null(), "{d}: deleted");
        assert!(
            events
                .iter()
                .all(|e| e.event_id.starts_with(&format!("schedule-{}-", id.0))),
            "{d}"
        );
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flow_without_audit_writes_no_events_and_needs_no_audit_tables() {
    for d in DIALECTS {
        let Some((t, flow)) = flow_on(d, "flownoaudit", FlowOptions::default()).await else {
            continue;
        };
        let def = NewSchedule::new("nightly", "digest", every(60), MisfirePolicy::Skip);
        let id = flow.create(def).await.unwrap().id;
        flow.pause(id).await.unwrap();
        flow.delete(id).await.unwrap();
        // The audit tables were never created: the outbox cannot be read.
        assert!(nexuscrm_audit::outbox(&t.db).await.is_err(), "{d}");
        t.drop_database().await;
    }
}
