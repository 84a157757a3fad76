//! Bulk on a three-node MariaDB Galera cluster (`scripts/galera.sh start`; CI starts it): a
//! real multi-primary engine whose row locks are local to a node and whose conflicts surface at
//! COMMIT (certification failure, reported as a deadlock), the failure shape of TiDB's lost
//! pessimistic locks. Safety must rest on claim tokens, the fence and truthful COMMIT
//! classification, not on row locks.

mod common;

use std::time::Duration;

use common::{Applied, applied, controller_config, job, test_config, wait_terminal};
use nexuscrm_bulk::{Bulk, BulkOptions};
use nexuscrm_persistence::testing::GaleraDb;
use nexuscrm_persistence::{Db, sqlx};
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

/// The polled generation probe sees a job whose id is lower than one it has already seen. On a
/// multi-primary engine ids are allocated per node before commit (Galera's offsets, TiDB's
/// per-server id caches), so `MAX(id)` alone misses such a commit and leaves the job to the
/// reconciliation backstop; the work signal every producer bumps after its commit does not.
///
/// The interleaving is forced: through node 1 a producer's insert takes its id and then waits
/// on a uniqueness lock held by another transaction on node 1; meanwhile a job submitted
/// through node 3 (a higher id) commits and the worker on node 2 claims it and goes idle; then
/// the lock is released and node 1's lower-id job commits. The worker's backstop is an hour
/// away, so only the probe can find the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_polled_probe_sees_a_lower_id_committed_through_another_node() {
    let Some(g) = GaleraDb::create("galera_probe").await else {
        return;
    };
    let config = || test_config().generation_poll(Some(Duration::from_millis(50)));
    let node1 = Bulk::open(
        g.test.db.clone(),
        1,
        BulkOptions::default().config(config()),
    )
    .await
    .expect("migrate through node 1");
    node1.take_ownership("test").await.unwrap();
    let node3 = Bulk::without_migrations(
        Db::connect(&g.nodes[2]).await.unwrap(),
        1,
        BulkOptions::default().config(config()),
    );
    let worker = Bulk::without_migrations(
        Db::connect(&g.nodes[1]).await.unwrap(),
        1,
        BulkOptions::default().config(config()),
    );
    let max_id = || async {
        let db = g.causal(1).await;
        let v: Option<i64> = sqlx::query_scalar("SELECT MAX(id) FROM bulk_job")
            .fetch_one(db.pool())
            .await
            .unwrap();
        db.close().await;
        v.unwrap_or(0)
    };
    let cancel = CancellationToken::new();
    let ctl = Controller::new(
        worker.source(),
        controller_config("node2", 2).reconcile_interval(Duration::from_secs(3600)),
    )
    .unwrap();
    let handle = ctl.handle();
    let run = tokio::spawn(ctl.run(cancel.clone()));

    // Node 1: another transaction holds the key the producer will use, uncommitted.
    let blocker = Db::connect(&g.nodes[0]).await.unwrap();
    let mut hold = blocker.begin_write().await.unwrap();
    sqlx::query(
        "INSERT INTO bulk_job (idempotency_key, state, max_attempts, run_at, total_rows, \
         segment_size, created_at, updated_at) VALUES ('late', 'succeeded', 1, 0, 0, 1, 0, 0)",
    )
    .execute(hold.conn())
    .await
    .unwrap();
    let mut j = job(1, 3, 3);
    j.idempotency_key = "late".into();
    let late = tokio::spawn({
        let node1 = node1.clone();
        async move { node1.submit(j).await }
    });
    // Let node 1's insert take its id and queue behind the held key.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!late.is_finished(), "node 1's submit waits on the held key");

    // A key above "late": node 3's insert does not land in the gap node 1's waiting insert
    // locks (which would brute-force abort it).
    // Two jobs: node 3's ids step by 3 from its own offset, so the second is above node 1's.
    let mut early = Vec::new();
    for n in 0..2 {
        let mut e = job(2 + n, 3, 3);
        e.idempotency_key = format!("zz-early-{n}");
        early.push(node3.submit(e).await.unwrap().job);
    }
    wait_terminal(&node3, &early, Duration::from_secs(60)).await;
    let early = early[1];
    let seen_max = max_id().await;
    assert_eq!(
        seen_max, early.0,
        "node 3's job is the highest id committed"
    );

    hold.rollback().await;
    let late = late.await.unwrap().unwrap().job;
    assert!(
        late.0 < early.0,
        "node 1's job took its id first: {late:?} < {early:?}"
    );
    assert_eq!(
        max_id().await,
        seen_max,
        "MAX(id) did not move: an id probe alone would miss this job"
    );
    wait_terminal(&node1, &[late], Duration::from_secs(30)).await;
    let snap = handle.snapshot();
    assert!(
        snap.generation_changes >= 2,
        "both jobs were found through the probe: {snap:?}"
    );
    cancel.cancel();
    run.await.unwrap().unwrap();
    for b in [&node3, &worker] {
        b.db().close().await;
    }
    blocker.close().await;
    g.drop_database().await;
}
