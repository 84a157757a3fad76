//! The Paused Flow store and producer against real SQLite files, PostgreSQL and MariaDB.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use nexuscrm_paused::{NewPause, PauseErrorKind, PausedFlow, PausedOptions, ResumeToken};
use nexuscrm_persistence::testing::TestDb;
use nexuscrm_persistence::{Dialect, sqlx};
use nexuscrm_worker::Clock;
use serde_json::json;

const DIALECTS: [Dialect; 3] = [Dialect::Sqlite, Dialect::Postgres, Dialect::Mysql];

/// A wall clock the test moves by hand.
#[derive(Debug)]
struct ManualClock(Mutex<SystemTime>);

impl ManualClock {
    fn advance(&self, by: Duration) {
        *self.0.lock().unwrap() += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> SystemTime {
        *self.0.lock().unwrap()
    }
}

async fn paused_on(d: Dialect, label: &str) -> Option<(TestDb, PausedFlow, Arc<ManualClock>)> {
    let t = TestDb::create(d, label).await?;
    let clock = Arc::new(ManualClock(Mutex::new(SystemTime::now())));
    let store = PausedFlow::open(t.db.clone(), PausedOptions::default().clock(clock.clone()))
        .await
        .expect("migrate");
    Some((t, store, clock))
}

fn pause(run: &str) -> NewPause {
    NewPause::new(
        run,
        "approve",
        Duration::from_secs(3600),
        json!({"ask": "approve the discount", "amount": 1200}),
    )
}

async fn text_columns(t: &TestDb) -> Vec<String> {
    let sql = "SELECT run_ref, step, token_hash, state, payload FROM paused_step";
    let rows = sqlx::query(sql).fetch_all(t.db.pool()).await.unwrap();
    let mut out = Vec::new();
    for r in &rows {
        for i in 0..5 {
            out.push(nexuscrm_persistence::support::text(r, i).unwrap());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_returns_an_unguessable_token_and_only_its_hash_is_stored() {
    for d in DIALECTS {
        let Some((t, store, _)) = paused_on(d, "token").await else {
            continue;
        };
        let a = store.pause(pause("run-1")).await.unwrap();
        let b = store.pause(pause("run-2")).await.unwrap();
        assert_ne!(a.token, b.token, "{d}");
        assert_eq!(a.token.expose().len(), 68, "{d}: prt_ and 256 bits in hex");
        let stored = text_columns(&t).await;
        for token in [&a.token, &b.token] {
            let secret = &token.expose()[4..];
            assert!(
                stored.iter().all(|c| !c.contains(secret)),
                "{d}: the token itself is stored: {stored:?}"
            );
        }
        let s = store.status(a.id).await.unwrap().unwrap();
        assert_eq!(
            (s.state.as_str(), s.run.as_str()),
            ("paused", "run-1"),
            "{d}"
        );
        assert_eq!(s.payload["amount"], 1200, "{d}");
        assert_eq!(s.resume_payload, None, "{d}");
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_is_idempotent_and_every_refusal_is_distinct_and_changes_nothing() {
    for d in DIALECTS {
        let Some((t, store, clock)) = paused_on(d, "resume").await else {
            continue;
        };
        let p = store.pause(pause("run-1")).await.unwrap();
        let yes = json!({"approved": true, "by": "ops@acme.test"});
        let first = store.resume(p.token.expose(), &yes).await.unwrap();
        assert!(first.first, "{d}");
        clock.advance(Duration::from_secs(5));
        let again = store.resume(p.token.expose(), &yes).await.unwrap();
        assert_eq!(
            (again.id, again.resumed_at, again.first),
            (first.id, first.resumed_at, false),
            "{d}: a repeated resume gets the same acknowledgement"
        );
        let before = store.status(p.id).await.unwrap().unwrap();
        assert_eq!(before.state, "resumable", "{d}");
        assert_eq!(before.resume_payload, Some(yes.clone()), "{d}");

        // Each refusal is its own kind and changes nothing.
        let e = store
            .resume(p.token.expose(), &json!({"approved": false}))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), PauseErrorKind::Conflict, "{d}: {e}");
        assert!(e.to_string().contains("another payload"), "{d}: {e}");
        let unknown = "prt_".to_owned() + &"ab".repeat(32);
        let e = store.resume(&unknown, &yes).await.unwrap_err();
        assert_eq!(e.kind(), PauseErrorKind::UnknownToken, "{d}: {e}");
        let e = store.resume("not-a-token", &yes).await.unwrap_err();
        assert_eq!(e.kind(), PauseErrorKind::Invalid, "{d}: {e}");
        let huge = json!({"blob": "x".repeat(70 * 1024)});
        let e = store.resume(p.token.expose(), &huge).await.unwrap_err();
        assert_eq!(e.kind(), PauseErrorKind::Invalid, "{d}: {e}");
        assert!(e.to_string().contains("at most 65536"), "{d}: {e}");
        assert_eq!(store.status(p.id).await.unwrap().unwrap(), before, "{d}");

        // Cancelled, then expired: distinct kinds, nothing changed.
        let c = store.pause(pause("run-2")).await.unwrap();
        let cancelled = store.cancel(c.id).await.unwrap();
        assert_eq!(cancelled.state, "cancelled", "{d}");
        let e = store.resume(c.token.expose(), &yes).await.unwrap_err();
        assert_eq!(e.kind(), PauseErrorKind::Cancelled, "{d}: {e}");
        let e = store.cancel(c.id).await.unwrap_err();
        assert_eq!(e.kind(), PauseErrorKind::Conflict, "{d}: {e}");
        let e = store.cancel(999_999).await.unwrap_err();
        assert_eq!(e.kind(), PauseErrorKind::NotFound, "{d}: {e}");
        let x = store.pause(pause("run-3")).await.unwrap();
        clock.advance(Duration::from_secs(3600));
        let e = store.resume(x.token.expose(), &yes).await.unwrap_err();
        assert_eq!(e.kind(), PauseErrorKind::Expired, "{d}: {e}");
        let s = store.status(x.id).await.unwrap().unwrap();
        assert_eq!(
            (s.state.as_str(), s.resume_payload),
            ("paused", None),
            "{d}"
        );
        // A resumed pause stays resumed after its timeout: the repeat still acknowledges.
        let late = store.resume(p.token.expose(), &yes).await.unwrap();
        assert_eq!((late.id, late.first), (p.id, false), "{d}");

        let counts = store.counts().await.unwrap();
        for (state, n) in [("resumable", 1), ("cancelled", 1), ("paused", 1)] {
            assert!(
                counts.contains(&(state.to_owned(), n)),
                "{d}: {state} {n} in {counts:?}"
            );
        }
        assert_eq!(
            store.list(Some("resumable"), 10).await.unwrap().len(),
            1,
            "{d}"
        );
        assert_eq!(store.list(None, 10).await.unwrap().len(), 3, "{d}");
        // The scrape's observations: bounded counts, exact below the cap.
        store.pause(pause("run-4")).await.unwrap();
        store.pause(pause("run-5")).await.unwrap();
        let capped = store.observations_capped(2).await.unwrap();
        assert_eq!(
            (
                capped.count("paused"),
                capped.count("resumable"),
                capped.count("cancelled"),
                capped.count_cap
            ),
            (2, 1, 1, 2),
            "{d}: {capped:?}"
        );
        let exact = store.observations().await.unwrap();
        assert_eq!(exact.count("paused"), 3, "{d}: {exact:?}");
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_pauses_are_refused_before_anything_is_stored() {
    for d in DIALECTS {
        let Some((t, store, _)) = paused_on(d, "badpause").await else {
            continue;
        };
        let mut bad = Vec::new();
        bad.push(NewPause::new("", "s", Duration::from_secs(60), json!({})));
        bad.push(NewPause::new(
            "r\n",
            "s",
            Duration::from_secs(60),
            json!({}),
        ));
        bad.push(NewPause::new(
            "r",
            "x".repeat(256),
            Duration::from_secs(60),
            json!({}),
        ));
        bad.push(NewPause::new(
            "r",
            "s",
            Duration::from_millis(999),
            json!({}),
        ));
        bad.push(NewPause::new(
            "r",
            "s",
            Duration::from_secs(367 * 24 * 3600),
            json!({}),
        ));
        bad.push(NewPause::new(
            "r",
            "s",
            Duration::from_secs(60),
            json!({"blob": "x".repeat(70 * 1024)}),
        ));
        for p in bad {
            let e = store.pause(p.clone()).await.unwrap_err();
            assert_eq!(e.kind(), PauseErrorKind::Invalid, "{d}: {p:?}: {e}");
            assert!(e.to_string().len() < 300, "{d}: the echo is bounded");
        }
        assert!(store.list(None, 10).await.unwrap().is_empty(), "{d}");
        // A run pauses once per step.
        let first = store.pause(pause("run-1")).await.unwrap();
        let e = store.pause(pause("run-1")).await.unwrap_err();
        assert_eq!(e.kind(), PauseErrorKind::Conflict, "{d}: {e}");
        assert!(
            e.to_string().contains(&format!("(pause {})", first.id)),
            "{d}: {e}"
        );
        assert_eq!(store.list(None, 10).await.unwrap().len(), 1, "{d}");
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_in_the_runs_transaction_commits_or_rolls_back_with_it() {
    for d in DIALECTS {
        let Some((t, store, _)) = paused_on(d, "pausein").await else {
            continue;
        };
        let mut tx = t.db.begin_write().await.unwrap();
        let lost = store.pause_in(tx.conn(), pause("run-1")).await.unwrap();
        tx.rollback().await;
        let e = store
            .resume(lost.token.expose(), &json!({}))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), PauseErrorKind::UnknownToken, "{d}: rolled back");
        assert!(store.list(None, 10).await.unwrap().is_empty(), "{d}");
        let mut tx = t.db.begin_write().await.unwrap();
        let kept = store.pause_in(tx.conn(), pause("run-1")).await.unwrap();
        tx.commit().await.unwrap();
        let r = store.resume(kept.token.expose(), &json!({})).await.unwrap();
        assert_eq!((r.id, r.first), (kept.id, true), "{d}");
        t.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_resumes_of_one_token_resume_it_exactly_once() {
    for d in DIALECTS {
        let Some((t, store, _)) = paused_on(d, "race").await else {
            continue;
        };
        // The same payload from eight callers: one first acknowledgement, seven repeats.
        let p = store.pause(pause("run-1")).await.unwrap();
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let (store, token) = (store.clone(), p.token.expose().to_owned());
            tasks.push(tokio::spawn(async move {
                store.resume(&token, &json!({"ok": 1})).await
            }));
        }
        let mut firsts = 0;
        for task in tasks {
            let r = task.await.unwrap().unwrap();
            firsts += usize::from(r.first);
        }
        assert_eq!(firsts, 1, "{d}");
        // Eight different payloads: exactly one wins, the others conflict.
        let q = store.pause(pause("run-2")).await.unwrap();
        let mut tasks = Vec::new();
        for i in 0..8 {
            let (store, token) = (store.clone(), q.token.expose().to_owned());
            tasks.push(tokio::spawn(async move {
                store.resume(&token, &json!({"caller": i})).await
            }));
        }
        let (mut won, mut conflicts) = (0, 0);
        for task in tasks {
            match task.await.unwrap() {
                Ok(r) => {
                    assert!(r.first, "{d}");
                    won += 1;
                }
                Err(e) if e.kind() == PauseErrorKind::Conflict => conflicts += 1,
                Err(e) => panic!("{d}: {e}"),
            }
        }
        assert_eq!((won, conflicts), (1, 7), "{d}");
        t.drop_database().await;
    }
}

#[test]
fn a_token_is_only_ever_shown_through_expose() {
    let text = "prt_".to_owned() + &"0f".repeat(32);
    let token = ResumeToken::parse(&text).unwrap();
    assert_eq!(token.expose(), text);
    assert!(!format!("{token:?}").contains("0f0f"));
}

/// The MySQL dialect reads a claim's steps back by its token (TiDB ignores RETURNING): an
/// index lookup on `paused_step_claim`, never a scan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mysql_claim_read_back_is_an_index_lookup_on_the_claim_token() {
    let Some((t, store, _clock)) = paused_on(Dialect::Mysql, "claimplan").await else {
        return;
    };
    for i in 0..50 {
        store.pause(pause(&format!("run-{i}"))).await.unwrap();
    }
    nexuscrm_persistence::sqlx::query("ANALYZE TABLE paused_step")
        .execute(t.db.pool())
        .await
        .unwrap();
    let (plan, keys) = nexuscrm_persistence::testing::explain_mysql(
        &t.db,
        "SELECT id FROM paused_step WHERE claim_token = 'c-1' AND state = 'leased' ORDER BY id",
    )
    .await
    .unwrap();
    eprintln!("claimed read-back plan: {plan:?}");
    assert_eq!(keys, vec![Some("paused_step_claim".to_owned())], "{plan:?}");
    t.drop_database().await;
}
