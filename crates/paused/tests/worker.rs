//! The Paused Flow worker on SQLite, PostgreSQL and MariaDB, with a real local HTTP receiver:
//! each effect delivered once, ambiguous outcomes quarantined and never resent, crashes after
//! the intent quarantined at lease expiry.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use nexuscrm_paused::{Connector, NewPause, PauseStatus, PausedFlow, PausedOptions, Resolution};
use nexuscrm_persistence::Dialect;
use nexuscrm_persistence::testing::TestDb;
use nexuscrm_worker::fault::{CrashPoint, Faults};
use nexuscrm_worker::{Config, Controller, RunErrorKind};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const DIALECTS: [Dialect; 3] = [Dialect::Sqlite, Dialect::Postgres, Dialect::Mysql];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Ok,
    Reject,
    Busy,
    Hang,
}

#[derive(Clone)]
struct Receiver {
    mode: Arc<Mutex<Mode>>,
    /// Requests received per idempotency key.
    got: Arc<Mutex<HashMap<String, u32>>>,
}

impl Receiver {
    fn set(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }

    fn total(&self) -> u32 {
        self.got.lock().unwrap().values().sum()
    }

    fn max_per_key(&self) -> u32 {
        self.got
            .lock()
            .unwrap()
            .values()
            .copied()
            .max()
            .unwrap_or(0)
    }
}

async fn receiver() -> (u16, Receiver) {
    let r = Receiver {
        mode: Arc::new(Mutex::new(Mode::Ok)),
        got: Arc::default(),
    };
    let app =
        Router::new()
            .route(
                "/effect",
                post(|State(r): State<Receiver>, h: HeaderMap| async move {
                    let key = h
                        .get("idempotency-key")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned();
                    *r.got.lock().unwrap().entry(key).or_default() += 1;
                    let mode = *r.mode.lock().unwrap();
                    match mode {
                        Mode::Ok => (StatusCode::OK, "done").into_response(),
                        Mode::Reject => (StatusCode::UNPROCESSABLE_ENTITY, "no").into_response(),
                        Mode::Busy => (
                            StatusCode::SERVICE_UNAVAILABLE,
                            [("retry-after", "1")],
                            "busy",
                        )
                            .into_response(),
                        Mode::Hang => {
                            tokio::time::sleep(Duration::from_secs(3600)).await;
                            StatusCode::OK.into_response()
                        }
                    }
                }),
            )
            .route(
                "/observe",
                axum::routing::get(
                    |State(r): State<Receiver>,
                     axum::extract::RawQuery(q): axum::extract::RawQuery| async move {
                        let key = q.unwrap_or_default().trim_start_matches("key=").to_owned();
                        let applied = r.got.lock().unwrap().contains_key(&key);
                        axum::Json(json!({ "applied": applied }))
                    },
                ),
            )
            .with_state(r.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (port, r)
}

fn options(port: u16, faults: Faults) -> PausedOptions {
    PausedOptions::default()
        .connector(
            Connector::new(&format!("http://127.0.0.1:{port}/effect"))
                .unwrap()
                .timeout(Duration::from_millis(300)),
        )
        .lease(Duration::from_secs(1))
        .backoff(Duration::from_millis(100))
        .generation_poll(Some(Duration::from_millis(100)))
        .listen(false)
        .faults(faults)
}

async fn store_on(t: &TestDb, port: u16, faults: Faults) -> PausedFlow {
    let store = PausedFlow::open(t.db.clone(), options(port, faults))
        .await
        .unwrap();
    store.take_ownership("test").await.unwrap();
    store
}

/// Runs a controller over `store` until `done` holds for its pauses, then drains it.
async fn run_until(
    store: &PausedFlow,
    within: Duration,
    done: impl Fn(&[PauseStatus]) -> bool,
) -> Vec<PauseStatus> {
    let ctl = Controller::new(
        store.source(),
        Config::new("paused")
            .capacity(NonZeroUsize::new(4).unwrap())
            .shutdown_timeout(Duration::from_secs(10)),
    )
    .unwrap();
    store.set_waker(ctl.handle().waker());
    let cancel = CancellationToken::new();
    let run = tokio::spawn(ctl.run(cancel.clone()));
    let deadline = Instant::now() + within;
    let last = loop {
        let all = store.list(None, 1_000).await.unwrap();
        if done(&all) {
            break all;
        }
        assert!(
            Instant::now() < deadline,
            "not done within {within:?}: {:?}",
            all.iter()
                .map(|p| (p.id, p.state.clone()))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    cancel.cancel();
    run.await.unwrap().unwrap();
    last
}

fn all_in(state: &'static str) -> impl Fn(&[PauseStatus]) -> bool {
    move |all| !all.is_empty() && all.iter().all(|p| p.state == state)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumed_and_timed_out_pauses_are_delivered_once_and_completed() {
    for d in DIALECTS {
        let Some(t) = TestDb::create(d, "pdeliver").await else {
            continue;
        };
        let (port, rx) = receiver().await;
        let store = store_on(&t, port, Faults::none()).await;
        for i in 0..12 {
            let p = store
                .pause(NewPause::new(
                    format!("run-{i}"),
                    "approve",
                    Duration::from_secs(3600),
                    json!({"i": i}),
                ))
                .await
                .unwrap();
            store
                .resume(p.token.expose(), &json!({"ok": i}))
                .await
                .unwrap();
        }
        // One nobody resumes: it times out after 1 s and its effect runs then.
        store
            .pause(NewPause::new(
                "run-late",
                "approve",
                Duration::from_secs(1),
                json!({}),
            ))
            .await
            .unwrap();
        let all = run_until(&store, Duration::from_secs(30), all_in("completed")).await;
        assert_eq!(all.len(), 13, "{d}");
        assert_eq!(rx.total(), 13, "{d}: each effect sent once");
        assert_eq!(rx.max_per_key(), 1, "{d}");
        let late = all.iter().find(|p| p.run == "run-late").unwrap();
        assert_eq!(late.resume_payload, None, "{d}: completed by its timeout");
        for p in &all {
            assert_eq!(p.outcome.as_ref().unwrap()["status"], 200, "{d}");
            assert!(p.intent_at.is_some(), "{d}: the intent preceded the effect");
        }
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ambiguous_effect_is_quarantined_never_resent_until_a_person_retries() {
    for d in DIALECTS {
        let Some(t) = TestDb::create(d, "puncertain").await else {
            continue;
        };
        let (port, rx) = receiver().await;
        rx.set(Mode::Hang);
        let store = store_on(&t, port, Faults::none()).await;
        let p = store
            .pause(NewPause::new(
                "run-1",
                "charge",
                Duration::from_secs(3600),
                json!({}),
            ))
            .await
            .unwrap();
        store.resume(p.token.expose(), &json!({})).await.unwrap();
        let all = run_until(&store, Duration::from_secs(20), all_in("uncertain")).await;
        let evidence = all[0].outcome.clone().unwrap();
        assert!(
            evidence["error"]
                .as_str()
                .unwrap()
                .contains("no answer within"),
            "{d}: {evidence}"
        );
        // Left alone across another worker's lifetime and a lease's length: never resent.
        rx.set(Mode::Ok);
        let quiet_from = Instant::now();
        let still = run_until(&store, Duration::from_secs(10), |all| {
            quiet_from.elapsed() > Duration::from_millis(1500)
                && all.iter().all(|p| p.state == "uncertain")
        })
        .await;
        assert_eq!(still[0].state, "uncertain", "{d}");
        assert_eq!(rx.total(), 1, "{d}: the uncertain effect was not resent");
        // Decisions go through a handle that writes their audit events.
        let decisions = PausedFlow::open(t.db.clone(), PausedOptions::default().audit(true))
            .await
            .unwrap();
        // Bad resolutions change nothing.
        let e = decisions
            .resolve(999_999, Resolution::Retry, "ops")
            .await
            .unwrap_err();
        assert_eq!(e.kind(), nexuscrm_paused::PauseErrorKind::NotFound, "{d}");
        // A person decides: retry under the same key.
        let r = decisions
            .resolve(p.id, Resolution::Retry, "ops@acme.test")
            .await
            .unwrap();
        assert_eq!(r.state, "resumable", "{d}");
        assert_eq!(r.outcome.as_ref().unwrap()["by"], "ops@acme.test", "{d}");
        let all = run_until(&store, Duration::from_secs(20), all_in("completed")).await;
        assert_eq!(all[0].effect_key, still[0].effect_key, "{d}: same key");
        assert_eq!(
            rx.total(),
            2,
            "{d}: sent again once, by the person's decision"
        );
        let e = decisions
            .resolve(p.id, Resolution::Applied, "ops")
            .await
            .unwrap_err();
        assert_eq!(
            e.kind(),
            nexuscrm_paused::PauseErrorKind::Conflict,
            "{d}: {e}"
        );
        // Exactly one audit event: the decision that committed, with its evidence; the
        // refused ones wrote none.
        let events = nexuscrm_audit::outbox(&t.db).await.unwrap();
        assert_eq!(events.len(), 1, "{d}: {events:?}");
        let e = &events[0];
        assert_eq!(
            (e.kind.as_str(), e.subject.clone(), e.actor.as_str()),
            ("pause.resolved", format!("pause:{}", p.id), "ops@acme.test"),
            "{d}"
        );
        let body = &e.body;
        assert_eq!(body["decision"], "retry", "{d}: {body}");
        assert_eq!(body["state"], "resumable", "{d}: {body}");
        assert_eq!(body["evidence"], evidence, "{d}: {body}");
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_is_final_and_a_busy_receiver_is_retried_after_its_retry_after() {
    for d in DIALECTS {
        let Some(t) = TestDb::create(d, "preject").await else {
            continue;
        };
        let (port, rx) = receiver().await;
        rx.set(Mode::Reject);
        let store = store_on(&t, port, Faults::none()).await;
        let p = store
            .pause(NewPause::new(
                "run-1",
                "s",
                Duration::from_secs(3600),
                json!({}),
            ))
            .await
            .unwrap();
        store.resume(p.token.expose(), &json!({})).await.unwrap();
        let all = run_until(&store, Duration::from_secs(20), all_in("poisoned")).await;
        assert_eq!(all[0].outcome.as_ref().unwrap()["status"], 422, "{d}");
        assert_eq!(rx.total(), 1, "{d}: a rejection is not retried");
        // Busy (503 + Retry-After 1): released, then delivered once the receiver recovers.
        rx.set(Mode::Busy);
        let q = store
            .pause(NewPause::new(
                "run-2",
                "s",
                Duration::from_secs(3600),
                json!({}),
            ))
            .await
            .unwrap();
        store.resume(q.token.expose(), &json!({})).await.unwrap();
        let flip = rx.clone();
        tokio::spawn(async move {
            while flip.total() < 2 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            flip.set(Mode::Ok);
        });
        let all = run_until(&store, Duration::from_secs(20), |all| {
            all.iter()
                .any(|p| p.run == "run-2" && p.state == "completed")
        })
        .await;
        let done = all.iter().find(|p| p.run == "run-2").unwrap();
        assert!(done.attempts >= 2, "{d}: {done:?}");
        assert!(rx.total() >= 3, "{d}");
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_intent_is_quarantined_at_lease_expiry_and_never_resent() {
    for d in DIALECTS {
        for (point, sent) in [(CrashPoint::BeforeEffect, 0), (CrashPoint::AfterEffect, 1)] {
            let Some(t) = TestDb::create(d, "pcrash").await else {
                continue;
            };
            let (port, rx) = receiver().await;
            let faults = Faults::new();
            faults.arm(point);
            let crashing = store_on(&t, port, faults.clone()).await;
            let p = crashing
                .pause(NewPause::new(
                    "run-1",
                    "charge",
                    Duration::from_secs(3600),
                    json!({}),
                ))
                .await
                .unwrap();
            crashing.resume(p.token.expose(), &json!({})).await.unwrap();
            let ctl = Controller::new(crashing.source(), Config::new("paused")).unwrap();
            let out =
                tokio::time::timeout(Duration::from_secs(20), ctl.run(CancellationToken::new()))
                    .await
                    .expect("the crash stops the controller");
            assert_eq!(
                out.err().map(|e| e.kind()),
                Some(RunErrorKind::AttemptFailed),
                "{d} {point:?}"
            );
            assert_eq!(faults.fired(), Some(point), "{d}");
            assert_eq!(rx.total(), sent, "{d} {point:?}");
            // A fresh worker: at lease expiry the pause is quarantined, not resent.
            let fresh = PausedFlow::without_migrations(t.db.clone(), options(port, Faults::none()));
            let all = run_until(&fresh, Duration::from_secs(20), all_in("uncertain")).await;
            assert_eq!(
                all[0].outcome.as_ref().unwrap()["quarantined_by"],
                "recovery",
                "{d} {point:?}"
            );
            assert_eq!(rx.total(), sent, "{d} {point:?}: never resent blindly");
            t.drop_database().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_observable_receiver_a_crashed_effect_is_resolved_by_asking_never_resent_blindly() {
    for d in DIALECTS {
        // Before the effect nothing was sent: the receiver says "not applied", so it is sent
        // (once). After the effect: "applied", so it completes without a second request.
        for (point, want_total) in [(CrashPoint::BeforeEffect, 1), (CrashPoint::AfterEffect, 1)] {
            let Some(t) = TestDb::create(d, "pobserve").await else {
                continue;
            };
            let (port, rx) = receiver().await;
            let observable = |faults: Faults| {
                PausedOptions::default()
                    .connector(
                        Connector::new(&format!("http://127.0.0.1:{port}/effect"))
                            .unwrap()
                            .timeout(Duration::from_millis(300))
                            .observable("/observe"),
                    )
                    .lease(Duration::from_secs(1))
                    .backoff(Duration::from_millis(100))
                    .generation_poll(Some(Duration::from_millis(100)))
                    .listen(false)
                    .faults(faults)
            };
            let faults = Faults::new();
            faults.arm(point);
            let crashing = PausedFlow::open(t.db.clone(), observable(faults.clone()))
                .await
                .unwrap();
            crashing.take_ownership("test").await.unwrap();
            let p = crashing
                .pause(NewPause::new(
                    "run-1",
                    "charge",
                    Duration::from_secs(3600),
                    json!({}),
                ))
                .await
                .unwrap();
            crashing.resume(p.token.expose(), &json!({})).await.unwrap();
            let ctl = Controller::new(crashing.source(), Config::new("paused")).unwrap();
            let out =
                tokio::time::timeout(Duration::from_secs(20), ctl.run(CancellationToken::new()))
                    .await
                    .expect("the crash stops the controller");
            assert!(out.is_err(), "{d} {point:?}");
            let fresh = PausedFlow::without_migrations(t.db.clone(), observable(Faults::none()));
            let all = run_until(&fresh, Duration::from_secs(20), all_in("completed")).await;
            let outcome = all[0].outcome.clone().unwrap();
            assert_eq!(rx.total(), want_total, "{d} {point:?}: {outcome}");
            assert_eq!(rx.max_per_key(), 1, "{d} {point:?}");
            if point == CrashPoint::AfterEffect {
                assert_eq!(outcome["observed"], true, "{d}: {outcome}");
                assert_eq!(outcome["by"], "recovery", "{d}: {outcome}");
            }
            t.drop_database().await;
        }
    }
}
