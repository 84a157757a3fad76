//! Four workers on separate pools resume-and-deliver many pauses at once: each effect is
//! delivered once (the receiver records every idempotency key under a PRIMARY KEY, so a second
//! delivery is a constraint violation it counts), and each pause completes once; also with the
//! workers spread over a three-node Galera cluster.
//!
//! CI runs 1,000 pauses per backend (Galera included); `NEXUSCRM_PAUSED_LOAD=10000 cargo test --release -p
//! nexuscrm-paused --test load` runs the full size.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

use nexuscrm_paused::{Connector, NewPause, PausedFlow, PausedOptions};
use nexuscrm_persistence::support::is_unique_violation;
use nexuscrm_persistence::testing::{GaleraDb, TestDb};
use nexuscrm_persistence::{Db, Dialect, sqlx};
use nexuscrm_worker::{Config, Controller, RunErrorKind};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const WORKERS: usize = 4;

fn size() -> usize {
    std::env::var("NEXUSCRM_PAUSED_LOAD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000)
}

/// The receiver: every request's key goes into `effect_received` (PRIMARY KEY); a duplicate
/// is counted and answered 409, so it can never pass unnoticed.
async fn receiver(db: Db, duplicates: Arc<AtomicU64>) -> u16 {
    sqlx::query("CREATE TABLE effect_received (effect_key VARCHAR(64) PRIMARY KEY)")
        .execute(db.pool())
        .await
        .unwrap();
    let insert = match db.dialect() {
        Dialect::Postgres => "INSERT INTO effect_received (effect_key) VALUES ($1)",
        _ => "INSERT INTO effect_received (effect_key) VALUES (?)",
    };
    let app = axum::Router::new().route(
        "/effect",
        axum::routing::post(move |h: axum::http::HeaderMap| {
            let (db, duplicates) = (db.clone(), duplicates.clone());
            async move {
                let key = h
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                match sqlx::query(insert).bind(key).execute(db.pool()).await {
                    Ok(_) => axum::http::StatusCode::OK,
                    Err(e) if is_unique_violation(&e) => {
                        duplicates.fetch_add(1, SeqCst);
                        axum::http::StatusCode::CONFLICT
                    }
                    // Busy: the receiver did nothing, and says so.
                    Err(_) => axum::http::StatusCode::TOO_MANY_REQUESTS,
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    port
}

async fn scalar(db: &Db, sql: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(db.pool())
        .await
        .unwrap()
}

async fn four_workers_deliver_each_effect_once(dialect: Dialect) {
    let Some(t) = TestDb::create(dialect, "pload").await else {
        return;
    };
    deliver_on(
        &dialect.to_string(),
        &t.db,
        &t.db,
        std::slice::from_ref(&t.url),
        size(),
    )
    .await;
    t.drop_database().await;
}

/// Runs `ctl` until `cancel` as the Runtime Worker's supervisor does: a proven not-committed
/// stop (on Galera, a claim that kept losing certification beyond its retries) hands the
/// controller back and it runs again; anything else fails the test. Returns the restarts.
async fn supervised(
    mut ctl: Controller<nexuscrm_paused::PausedSource>,
    cancel: CancellationToken,
) -> u32 {
    let mut restarts = 0;
    loop {
        match ctl.run(cancel.clone()).await {
            Ok(_) => return restarts,
            Err(e) => {
                assert_eq!(e.kind(), RunErrorKind::NotCommitted, "{e}");
                ctl = e
                    .into_controller()
                    .expect("a not-committed stop hands the controller back");
                if cancel.is_cancelled() {
                    return restarts;
                }
                restarts += 1;
                assert!(restarts < 50, "a worker keeps stopping");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// `n` pauses paused and resumed through `producer_db` while four workers resume-and-deliver
/// them, worker `w` on its own pool to `urls[w % urls.len()]` (the receiver records through
/// the first); `read` is where the checks read (on Galera, a causal read).
async fn deliver_on(dialect: &str, producer_db: &Db, read: &Db, urls: &[String], n: usize) {
    let duplicates = Arc::new(AtomicU64::new(0));
    let receiver_db = Db::connect(&urls[0]).await.unwrap();
    let port = receiver(receiver_db, duplicates.clone()).await;
    let options = || {
        PausedOptions::default()
            .connector(
                Connector::new(&format!("http://127.0.0.1:{port}/effect"))
                    .unwrap()
                    .timeout(Duration::from_secs(20)),
            )
            .lease(Duration::from_secs(60))
            .backoff(Duration::from_millis(20))
            .generation_poll(Some(Duration::from_millis(200)))
    };
    let producer = PausedFlow::open(producer_db.clone(), PausedOptions::default())
        .await
        .unwrap();
    producer.take_ownership("load").await.unwrap();
    let started = Instant::now();
    // The workers run while the producer pauses and resumes: resumes arrive concurrently.
    let mut runs = Vec::new();
    let cancel = CancellationToken::new();
    for w in 0..WORKERS {
        let db = Db::connect(&urls[w % urls.len()]).await.unwrap();
        let store = PausedFlow::without_migrations(db, options());
        let ctl = Controller::new(
            store.source(),
            Config::new(format!("paused-{w}"))
                .capacity(NonZeroUsize::new(8).unwrap())
                .shutdown_timeout(Duration::from_secs(30)),
        )
        .unwrap();
        store.set_waker(ctl.waker());
        runs.push(tokio::spawn(supervised(ctl, cancel.clone())));
    }
    for i in 0..n {
        let p = producer
            .pause(NewPause::new(
                format!("run-{i}"),
                "notify",
                Duration::from_secs(3600),
                json!({"i": i}),
            ))
            .await
            .unwrap();
        producer
            .resume(p.token.expose(), &json!({"ok": true}))
            .await
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let done = scalar(
            read,
            "SELECT COUNT(*) FROM paused_step WHERE state = 'completed'",
        )
        .await;
        if done == n as i64 {
            break;
        }
        if Instant::now() > deadline {
            let stuck = PausedFlow::without_migrations(read.clone(), PausedOptions::default());
            let left: Vec<_> = stuck
                .list(None, 100_000)
                .await
                .unwrap()
                .into_iter()
                .filter(|p| p.state != "completed")
                .map(|p| (p.id, p.state, p.attempts, p.outcome))
                .collect();
            cancel.cancel();
            let mut finished = Vec::new();
            for r in runs {
                finished.push(match r.await {
                    Ok(restarts) => format!("drained after {restarts} reusable restarts"),
                    Err(e) => e.to_string(),
                });
            }
            panic!(
                "{dialect}: {done} of {n} completed; left {left:?}; workers finished {finished:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cancel.cancel();
    let mut restarts = 0;
    for r in runs {
        restarts += r.await.unwrap();
    }
    let elapsed = started.elapsed();
    assert_eq!(
        duplicates.load(SeqCst),
        0,
        "{dialect}: an effect was delivered twice"
    );
    assert_eq!(
        scalar(read, "SELECT COUNT(*) FROM effect_received").await,
        n as i64,
        "{dialect}: every effect delivered"
    );
    assert_eq!(
        scalar(
            read,
            "SELECT COUNT(*) FROM paused_step WHERE state <> 'completed' OR intent_at IS NULL"
        )
        .await,
        0,
        "{dialect}"
    );
    println!(
        "{dialect}: {n} pauses resumed and delivered by {WORKERS} workers in {elapsed:.1?} \
         ({:.0}/s), 0 duplicates, {restarts} reusable restarts",
        n as f64 / elapsed.as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_workers_deliver_each_effect_once_on_sqlite() {
    four_workers_deliver_each_effect_once(Dialect::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_workers_deliver_each_effect_once_on_postgres() {
    four_workers_deliver_each_effect_once(Dialect::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_workers_deliver_each_effect_once_on_mysql() {
    four_workers_deliver_each_effect_once(Dialect::Mysql).await;
}

/// The same on the three-node Galera cluster, the workers spread over the nodes (1, 2, 3, 1):
/// a resume or a delivery intent that loses certification at COMMIT rolled back and is
/// retried, so each effect is still delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_workers_over_three_galera_nodes_deliver_each_effect_once() {
    let Some(g) = GaleraDb::create("galera_pload").await else {
        return;
    };
    let n = size();
    let before = g.conflicts().await;
    let read = g.causal(2).await;
    deliver_on("galera", &g.test.db, &read, &g.nodes, n).await;
    read.close().await;
    println!(
        "galera: {} certification failures or brute-force aborts meanwhile",
        g.conflicts().await - before
    );
    g.drop_database().await;
}
