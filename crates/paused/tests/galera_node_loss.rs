//! A Galera node killed (`kill -9` of its `mariadbd`) while Paused Flow workers on all three
//! nodes resume and deliver effects, then rejoined. Its own test binary: it takes node 3 away
//! from the cluster for a while, and cargo runs test binaries one at a time, so no other Galera
//! test sees the cluster at two nodes.
//!
//! What a lost node may do to an outcome-uncertain family: a worker on node 3 may have sent an
//! effect whose completion never committed. Recovery must then quarantine that pause as
//! `uncertain` (for a person), never send it again; every other pause completes with its
//! effect delivered exactly once.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nexuscrm_paused::{Connector, NewPause, PausedFlow, PausedOptions};
use nexuscrm_persistence::testing::{
    GaleraDb, KilledNode, galera_nodes_are_local, supervise_on_node,
};
use nexuscrm_persistence::{Db, sqlx};
use nexuscrm_worker::{Config, Controller, RunErrorKind};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// Pauses resumed before the kill, and as many again while node 3 is down.
const HALF: usize = 200;
const PAUSES: usize = 2 * HALF;

/// Requests per idempotency key.
type Received = Arc<Mutex<HashMap<String, u32>>>;

/// The receiver: counts every request per key and answers after 100 ms, so deliveries are in
/// flight when the node dies.
async fn receiver() -> (u16, Received) {
    let got: Received = Arc::default();
    let g = got.clone();
    let app = axum::Router::new().route(
        "/effect",
        axum::routing::post(move |h: axum::http::HeaderMap| {
            let g = g.clone();
            async move {
                let key = h
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                *g.lock().unwrap().entry(key).or_default() += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (port, got)
}

async fn terminal(db: &Db) -> i64 {
    sqlx::query_scalar(
        "SELECT COUNT(*) FROM paused_step WHERE state IN ('completed', 'uncertain', 'poisoned')",
    )
    .fetch_one(db.pool())
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_killed_mid_delivery_sends_no_effect_twice_and_every_pause_ends_terminal() {
    if !galera_nodes_are_local() {
        return;
    }
    let Some(g) = GaleraDb::create("galera_paused_loss").await else {
        return;
    };
    let (port, received) = receiver().await;
    let options = move || {
        PausedOptions::default()
            .connector(
                Connector::new(&format!("http://127.0.0.1:{port}/effect"))
                    .unwrap()
                    .timeout(Duration::from_secs(5)),
            )
            // Short, so node 3's leases come back to nodes 1 and 2 while it is down.
            .lease(Duration::from_secs(2))
            .backoff(Duration::from_millis(20))
            .generation_poll(Some(Duration::from_millis(200)))
    };
    let producer = PausedFlow::open(g.test.db.clone(), PausedOptions::default())
        .await
        .expect("migrate through node 1");
    producer.take_ownership("test").await.unwrap();
    let down = Arc::new(AtomicBool::new(false));
    let cancel = CancellationToken::new();
    let mut slots = Vec::new();
    for w in 0..3usize {
        // One worker per node, each its own supervisor.
        slots.push(tokio::spawn(supervise_on_node(
            g.nodes[w].clone(),
            (w == 2).then(|| down.clone()),
            cancel.clone(),
            move |db, cancel| async move {
                let store = PausedFlow::without_migrations(db, options());
                let ctl = Controller::new(
                    store.source(),
                    Config::new(format!("paused-{w}"))
                        .capacity(NonZeroUsize::new(8).unwrap())
                        .shutdown_timeout(Duration::from_secs(20)),
                )
                .unwrap();
                store.set_waker(ctl.waker());
                ctl.run(cancel).await.map(drop).map_err(|e| e.kind())
            },
        )));
    }
    let resume = async |range: std::ops::Range<usize>| {
        for i in range {
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
    };
    resume(0..HALF).await;
    // Kill node 3 once deliveries are under way ...
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while terminal(&g.test.db).await < 30 {
        assert!(tokio::time::Instant::now() < deadline, "no progress");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    down.store(true, Ordering::SeqCst);
    let killed = tokio::task::spawn_blocking(|| KilledNode::kill(3))
        .await
        .unwrap();
    // ... nodes 1 and 2 go on, with as many pauses again resumed through node 1 ...
    let at_kill = terminal(&g.test.db).await;
    resume(HALF..PAUSES).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while terminal(&g.test.db).await < at_kill + 60 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "nodes 1 and 2 made no progress while node 3 was down"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let while_down = terminal(&g.test.db).await - at_kill;
    // ... and node 3 rejoins; its worker reconnects. Every pause ends terminal.
    tokio::task::spawn_blocking(move || killed.restart())
        .await
        .unwrap();
    down.store(false, Ordering::SeqCst);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    while terminal(&g.test.db).await < PAUSES as i64 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {PAUSES} pauses terminal after the node rejoined",
            terminal(&g.test.db).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cancel.cancel();
    let mut stops = Vec::new();
    for s in slots {
        stops.push(s.await.unwrap());
    }
    for (w, s) in stops.iter().enumerate().take(2) {
        assert!(
            s.iter().all(|k| *k == RunErrorKind::NotCommitted),
            "worker {w} (a live node) stopped for a reason other than a proven rollback: {s:?}"
        );
    }
    let received = received.lock().unwrap().clone();
    let twice: Vec<_> = received.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "effects sent more than once: {twice:?}");
    // Read back through every node (node 3 included) with causal reads: the cluster agrees.
    let mut uncertain = 0;
    for (i, url) in g.nodes.iter().enumerate() {
        let db = g.causal(i).await;
        let store = PausedFlow::without_migrations(db.clone(), PausedOptions::default());
        let all = store.list(None, 10_000).await.unwrap();
        assert_eq!(all.len(), PAUSES, "through {url}");
        uncertain = 0;
        for p in &all {
            let sent = received.get(&p.effect_key).copied().unwrap_or(0);
            match p.state.as_str() {
                "completed" if sent == 1 => {}
                "uncertain" if sent <= 1 => uncertain += 1,
                state => panic!(
                    "through {url}: pause {} is {state} and its effect was sent {sent} time(s)",
                    p.id
                ),
            }
        }
        db.close().await;
    }
    println!(
        "galera paused node loss: {while_down} pauses finished while node 3 was down; \
         {uncertain} quarantined as uncertain (an effect in flight on the lost node), the rest \
         completed once; controller stops per worker (nodes 1, 2, 3): {stops:?}"
    );
    g.drop_database().await;
}
