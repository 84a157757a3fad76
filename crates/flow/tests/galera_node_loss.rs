//! A Galera node killed (`kill -9` of its `mariadbd`) while Scheduled Flow workers on all three
//! nodes reserve runs, then rejoined. Its own test binary: it takes node 3 away from the
//! cluster for a while, and cargo runs test binaries one at a time, so no other Galera test
//! sees the cluster at two nodes.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use common::{
    assert_exact, controller_config, cursors, ms, next_second, run_counts, runs_by_schedule,
    test_config, wait_cursors_past,
};
use nexuscrm_flow::{Flow, FlowOptions, MisfirePolicy, NewSchedule, Spec};
use nexuscrm_persistence::testing::{
    GaleraDb, KilledNode, galera_nodes_are_local, supervise_on_node,
};
use nexuscrm_worker::{Controller, RunErrorKind};
use tokio_util::sync::CancellationToken;

const SCHEDULES: usize = 200;
/// How long the schedules fire: node 3 dies 3 s in and is restarted once nodes 1 and 2 have
/// carried every schedule 2 s past the kill (its rejoin takes a few seconds more).
const SECS: u64 = 20;

async fn sleep_until(t: SystemTime) {
    tokio::time::sleep(t.duration_since(SystemTime::now()).unwrap_or_default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_killed_mid_run_misses_no_occurrence_and_reserves_none_twice() {
    if !galera_nodes_are_local() {
        return;
    }
    let Some(g) = GaleraDb::create("galera_flow_loss").await else {
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
    let start = next_second(SystemTime::now()) + Duration::from_secs(2);
    for i in 0..SCHEDULES {
        let mut s = NewSchedule::new(
            format!("loss-{i}"),
            "tick",
            Spec::Every(Duration::from_secs(1)),
            MisfirePolicy::CatchUp { max: 1000 },
        );
        s.start_at = Some(start);
        producer.create(s).await.unwrap();
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
                let flow =
                    Flow::without_migrations(db, 1, FlowOptions::default().config(test_config()));
                let ctl = Controller::new(flow.source(), controller_config(&format!("w{w}"), 32))
                    .unwrap();
                flow.set_waker(ctl.waker());
                ctl.run(cancel).await.map(drop).map_err(|e| e.kind())
            },
        )));
    }
    // Node 3 dies 3 s into the run ...
    sleep_until(start + Duration::from_secs(3)).await;
    down.store(true, Ordering::SeqCst);
    let killed = tokio::task::spawn_blocking(|| KilledNode::kill(3))
        .await
        .unwrap();
    // ... nodes 1 and 2 keep every schedule going while it is down (node 3's leased schedules
    // come back at lease expiry) ...
    let killed_at = SystemTime::now();
    let reader = g.causal(0).await;
    wait_cursors_past(
        &reader,
        ms(killed_at + Duration::from_secs(2)),
        Duration::from_secs(60),
    )
    .await;
    // ... and it rejoins; its worker reconnects.
    tokio::task::spawn_blocking(move || killed.restart())
        .await
        .unwrap();
    down.store(false, Ordering::SeqCst);
    let downtime = killed_at.elapsed().unwrap_or_default();
    let end = start + Duration::from_secs(SECS);
    sleep_until(end).await;
    wait_cursors_past(&reader, ms(end), Duration::from_secs(60)).await;
    cancel.cancel();
    let mut stops = Vec::new();
    for s in slots {
        stops.push(s.await.unwrap());
    }
    reader.close().await;
    for (w, s) in stops.iter().enumerate().take(2) {
        assert!(
            s.iter().all(|k| *k == RunErrorKind::NotCommitted),
            "worker {w} (a live node) stopped for a reason other than a proven rollback: {s:?}"
        );
    }
    // Every occurrence before each cursor reserved exactly once, read back through every node
    // (node 3 included) with causal reads.
    for (i, url) in g.nodes.iter().enumerate() {
        let db = g.causal(i).await;
        let runs = runs_by_schedule(&db).await;
        let cursors = cursors(&db).await;
        assert_eq!(cursors.len(), SCHEDULES, "through {url}");
        let mut total = 0;
        for (id, cursor) in &cursors {
            let r = runs.get(id).map(Vec::as_slice).unwrap_or_default();
            assert_exact(&format!("through {url}"), *id, ms(start), 1000, r, *cursor);
            total += r.len() as i64;
        }
        assert!(total >= (SCHEDULES as i64) * SECS as i64, "{total} runs");
        assert_eq!(run_counts(&db).await, (total, total), "through {url}");
        db.close().await;
    }
    println!(
        "galera flow node loss: node 3 down for {downtime:.1?}; controller stops per worker \
         (nodes 1, 2, 3): {stops:?}"
    );
    g.drop_database().await;
}
