//! Bulk on a three-node MariaDB Galera cluster (`scripts/galera.sh start`; CI starts it): a
//! real multi-primary engine whose row locks are local to a node and whose conflicts surface at
//! COMMIT (certification failure, reported as a deadlock), the failure shape of TiDB's lost
//! pessimistic locks. Safety must rest on claim tokens, the fence and truthful COMMIT
//! classification, not on row locks.

mod common;

use std::time::Duration;

use common::{Applied, applied, controller_config, job, test_config, wait_terminal};
use nexuscrm_bulk::{Bulk, BulkOptions};
use nexuscrm_persistence::Db;
use nexuscrm_persistence::testing::GaleraDb;
use nexuscrm_worker::{Controller, RunErrorKind};
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_workers_over_three_galera_nodes_apply_every_row_exactly_once() {
    let Some(g) = GaleraDb::create("galera_bulk").await else {
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
    for j in 0..200 {
        ids.push(producer.submit(job(j, 100, 50)).await.unwrap().job);
    }
    let before = g.conflicts().await;
    let cancel = CancellationToken::new();
    let mut slots = Vec::new();
    for w in 0..4usize {
        // Each worker on its own pool to its own node: 1, 2, 3, 1.
        let url = g.nodes[w % g.nodes.len()].clone();
        let cancel = cancel.clone();
        slots.push(tokio::spawn(async move {
            let db = Db::connect(&url).await.unwrap();
            let (mut claimed, mut restarts) = (0u64, 0u32);
            loop {
                let bulk = Bulk::without_migrations(
                    db.clone(),
                    1,
                    BulkOptions::default().config(test_config()),
                );
                let ctl =
                    Controller::new(bulk.source(), controller_config(&format!("w{w}"), 4)).unwrap();
                bulk.set_waker(ctl.waker());
                match ctl.run(cancel.clone()).await {
                    Ok(ctl) => {
                        claimed += ctl.handle().snapshot().attempts_claimed;
                        break;
                    }
                    // Contention it could not resolve within its retries: a proven rollback,
                    // reusable, so a supervisor starts it again. Never a poison.
                    Err(e) => {
                        assert_eq!(e.kind(), RunErrorKind::NotCommitted, "worker {w}: {e}");
                        claimed += e
                            .into_controller()
                            .map_or(0, |c| c.handle().snapshot().attempts_claimed);
                        if cancel.is_cancelled() {
                            break;
                        }
                        restarts += 1;
                        assert!(restarts < 50, "worker {w} keeps stopping");
                    }
                }
            }
            db.close().await;
            (claimed, restarts)
        }));
    }
    wait_terminal(&producer, &ids, Duration::from_secs(300)).await;
    cancel.cancel();
    let mut claimed_by = Vec::new();
    let mut restarts = 0;
    for s in slots {
        let (c, r) = s.await.unwrap();
        claimed_by.push(c);
        restarts += r;
    }
    let after = g.conflicts().await;
    // Read back through every node, with causal reads (a node may otherwise still be
    // applying the last write sets): the cluster agrees.
    for (i, url) in g.nodes.iter().enumerate() {
        let db = g.causal(i).await;
        assert_eq!(
            applied(&db).await,
            Applied {
                changes: 20_000,
                duplicated: 0,
                revision_mismatches: 0
            },
            "through {url}"
        );
        db.close().await;
    }
    assert!(
        claimed_by.iter().filter(|&&n| n > 0).count() >= 2,
        "work was shared: {claimed_by:?}"
    );
    println!(
        "galera: claims per worker {claimed_by:?}, {restarts} reusable restarts, {} \
         certification failures or brute-force aborts on the cluster meanwhile",
        after - before
    );
    g.drop_database().await;
}
