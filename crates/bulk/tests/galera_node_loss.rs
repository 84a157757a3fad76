//! A Galera node killed mid-run (`kill -9` of its `mariadbd`) and rejoined, with Bulk workers on
//! all three nodes. Its own test binary: it takes node 3 away from the cluster for a while, and
//! cargo runs test binaries one at a time, so no other Galera test sees the cluster at two nodes.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{Applied, applied, controller_config, job, test_config, wait_terminal};
use nexuscrm_bulk::{Bulk, BulkOptions};
use nexuscrm_persistence::testing::{
    GaleraDb, KilledNode, galera_nodes_are_local, supervise_on_node,
};
use nexuscrm_persistence::{Db, sqlx};
use nexuscrm_worker::{Controller, RunErrorKind};
use tokio_util::sync::CancellationToken;

async fn terminal(db: &Db) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM bulk_job WHERE state IN ('succeeded', 'poisoned')")
        .fetch_one(db.pool())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_killed_mid_run_loses_nothing_and_after_it_rejoins_every_row_is_applied_once() {
    if !galera_nodes_are_local() {
        return;
    }
    let Some(g) = GaleraDb::create("galera_node_loss").await else {
        return;
    };
    let producer = Bulk::open(
        g.test.db.clone(),
        1,
        BulkOptions::default().config(test_config()),
    )
    .await
    .expect("migrate through node 1");
    producer.take_ownership("test").await.unwrap();
    let mut ids = Vec::new();
    for j in 0..100 {
        ids.push(producer.submit(job(j, 100, 20)).await.unwrap().job);
    }
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
                let bulk =
                    Bulk::without_migrations(db, 1, BulkOptions::default().config(test_config()));
                let ctl =
                    Controller::new(bulk.source(), controller_config(&format!("w{w}"), 4)).unwrap();
                bulk.set_waker(ctl.waker());
                ctl.run(cancel).await.map(drop).map_err(|e| e.kind())
            },
        )));
    }
    // Kill node 3 once the run is under way ...
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while terminal(&g.test.db).await < 15 {
        assert!(tokio::time::Instant::now() < deadline, "no progress");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    down.store(true, Ordering::SeqCst);
    let killed = tokio::task::spawn_blocking(|| KilledNode::kill(3))
        .await
        .unwrap();
    // ... the workers on nodes 1 and 2 go on (node 3's leased jobs come back at lease
    // expiry) ...
    let at_kill = terminal(&g.test.db).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while terminal(&g.test.db).await < at_kill + 15 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "nodes 1 and 2 made no progress while node 3 was down"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let while_down = terminal(&g.test.db).await - at_kill;
    // ... and node 3 rejoins; its worker reconnects.
    tokio::task::spawn_blocking(move || killed.restart())
        .await
        .unwrap();
    down.store(false, Ordering::SeqCst);
    wait_terminal(&producer, &ids, Duration::from_secs(300)).await;
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
    // Every job succeeded (none poisoned by the lost node), and every row was applied exactly
    // once, read back through each node (node 3 included) with causal reads.
    let poisoned: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM bulk_job WHERE state <> 'succeeded'")
            .fetch_one(g.test.db.pool())
            .await
            .unwrap();
    assert_eq!(poisoned, 0, "jobs not succeeded");
    for (i, url) in g.nodes.iter().enumerate() {
        let db = g.causal(i).await;
        assert_eq!(
            applied(&db).await,
            Applied {
                changes: 10_000,
                duplicated: 0,
                revision_mismatches: 0
            },
            "through {url}"
        );
        db.close().await;
    }
    println!(
        "galera node loss: {while_down} jobs finished while node 3 was down; controller stops \
         per worker (nodes 1, 2, 3): {stops:?}"
    );
    g.drop_database().await;
}
