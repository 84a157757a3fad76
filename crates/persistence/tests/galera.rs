//! The ownership fence on a three-node MariaDB Galera cluster (`scripts/galera.sh start`; CI
//! starts it). Row locks are local to a node there: a fence read's shared lock on node 1 does
//! not stop a takeover committed through node 3, but when the takeover's write set is applied
//! on node 1 it brute-force aborts the transaction holding that lock, so the old generation's
//! commit fails as a deadlock (a proven rollback) and nothing of it lands.

use nexuscrm_persistence::testing::{CutProxy, GaleraDb};
use nexuscrm_persistence::{Db, DbOptions, WriteError, sqlx};
use sqlx::Connection as _;

/// `sql` (one BIGINT) read through `url` with causal reads (`wsrep_sync_wait = 1`): the node
/// first applies every write set the cluster committed before the read. Without it a node may
/// still lag behind a commit made through another node.
async fn causal(url: &str, sql: &str) -> i64 {
    let mut c = sqlx::MySqlConnection::connect(url).await.unwrap();
    sqlx::query("SET SESSION wsrep_sync_wait = 1")
        .execute(&mut c)
        .await
        .unwrap();
    let v: i64 = sqlx::query_scalar(sql).fetch_one(&mut c).await.unwrap();
    c.close().await.unwrap();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_through_another_node_is_seen_by_the_old_generations_commit() {
    let Some(g) = GaleraDb::create("galera_fence").await else {
        return;
    };
    g.test.db.migrate_ownership().await.unwrap();
    sqlx::query("CREATE TABLE fenced_probe (id BIGINT PRIMARY KEY, generation BIGINT NOT NULL)")
        .execute(g.test.db.pool())
        .await
        .unwrap();
    let node1 = Db::connect(&g.nodes[0]).await.unwrap();
    let node3 = Db::connect(&g.nodes[2]).await.unwrap();
    let g1 = node1.take_ownership("probe", 1, "gen-1").await.unwrap();
    // Generation 1 (node 1) reads the fence under its shared lock, as every claim does ...
    let mut tx = node1.begin_write().await.unwrap();
    assert!(g1.holds(tx.conn(), &node1).await.unwrap());
    // ... generation 2 takes over through node 3 and commits ...
    node3.take_ownership("probe", 2, "gen-2").await.unwrap();
    // ... then generation 1 writes and commits.
    let wrote = sqlx::query("INSERT INTO fenced_probe (id, generation) VALUES (1, 1)")
        .execute(&mut *tx.conn())
        .await;
    let committed = match wrote {
        Ok(_) => tx.commit().await,
        Err(e) => {
            tx.rollback().await;
            Err(e)
        }
    };
    let mut rows = 0;
    for url in &g.nodes {
        rows += causal(url, "SELECT COUNT(*) FROM fenced_probe").await;
    }
    println!("galera fence: generation 1's commit after the takeover: {committed:?}, rows {rows}");
    assert!(
        committed.is_err() && rows == 0,
        "generation 1 committed after generation 2's takeover had committed ({committed:?}, \
         {rows} row): on Galera the fence's shared lock is local to node 1"
    );
    node1.close().await;
    node3.close().await;
    g.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_fails_certification_is_classified_as_not_committed() {
    let Some(g) = GaleraDb::create("galera_cert").await else {
        return;
    };
    sqlx::query("CREATE TABLE cert_probe (id BIGINT PRIMARY KEY, v BIGINT NOT NULL)")
        .execute(g.test.db.pool())
        .await
        .unwrap();
    sqlx::query("INSERT INTO cert_probe (id, v) VALUES (1, 0)")
        .execute(g.test.db.pool())
        .await
        .unwrap();
    let node1 = Db::connect(&g.nodes[0]).await.unwrap();
    let node2 = Db::connect(&g.nodes[1]).await.unwrap();
    let other = node2.clone();
    let never = tokio_util::sync::CancellationToken::new();
    // Node 1's transaction updates the row; before it commits, node 2 updates the same row and
    // commits first. Node 1's row lock is local: its COMMIT (or the statement after the other
    // write set arrives) fails certification, which rolled it back.
    let result = node1
        .write(&never, move |c| {
            Box::pin(async move {
                sqlx::query("UPDATE cert_probe SET v = 1 WHERE id = 1")
                    .execute(&mut *c)
                    .await?;
                sqlx::query("UPDATE cert_probe SET v = 2 WHERE id = 1")
                    .execute(other.pool())
                    .await?;
                // Node 2's commit is ordered before this one in the cluster's total order
                // whenever its write set arrives: node 1's COMMIT certifies after it and fails
                // (or node 1's transaction is aborted when the write set is applied). No wait.
                Ok(())
            })
        })
        .await;
    let e = result.expect_err("node 1's transaction cannot commit over node 2's");
    assert!(
        e.is_not_committed(),
        "a certification failure is a proven rollback, not an unknown outcome: {e:?}"
    );
    assert!(
        nexuscrm_persistence::support::is_contention(&e),
        "classified as contention (retried by families): {e:?}"
    );
    for url in &g.nodes {
        let v = causal(url, "SELECT v FROM cert_probe WHERE id = 1").await;
        assert_eq!(v, 2, "node 2's write won on {url}");
    }
    node1.close().await;
    node2.close().await;
    g.drop_database().await;
}

/// The port of a `mysql://user@host:port/db` URL when its host is this machine's loopback
/// (a [`CutProxy`] forwards to 127.0.0.1 only).
fn loopback_port(url: &str) -> Option<u16> {
    let authority = url.split_once("://")?.1.split('/').next()?;
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let (host, port) = host_port.rsplit_once(':')?;
    matches!(host, "127.0.0.1" | "localhost")
        .then(|| port.parse().ok())
        .flatten()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_connection_dies_is_outcome_unknown_never_not_committed() {
    let Some(g) = GaleraDb::create("galera_cut").await else {
        return;
    };
    let Some(port) = loopback_port(&g.nodes[0]) else {
        eprintln!("SKIPPED: node 1 is not on this machine's loopback; the cut proxy needs it");
        g.drop_database().await;
        return;
    };
    sqlx::query("CREATE TABLE commit_probe (id BIGINT PRIMARY KEY)")
        .execute(g.test.db.pool())
        .await
        .unwrap();
    let proxy = std::sync::Arc::new(CutProxy::start(port).await.unwrap());
    let url = proxy
        .route(&g.nodes[0], port)
        .expect("node 1's URL names its port");
    let db = Db::connect_with(&url, DbOptions::default().max_connections(1))
        .await
        .unwrap();
    let never = tokio_util::sync::CancellationToken::new();
    let cut = proxy.clone();
    // The connection dies between the transaction's last statement and its COMMIT: the COMMIT
    // either never reaches node 1 or reaches it and its answer is lost. The client cannot
    // tell which, so it must not say "not committed" (a retry could then apply it twice) or
    // "committed".
    let result = db
        .write(&never, move |c| {
            Box::pin(async move {
                sqlx::query("INSERT INTO commit_probe (id) VALUES (1)")
                    .execute(&mut *c)
                    .await?;
                cut.set_cut(true);
                Ok(())
            })
        })
        .await;
    let e = result.expect_err("the COMMIT's connection is gone");
    assert!(
        matches!(e, WriteError::OutcomeUnknown(_)),
        "a COMMIT whose connection died is outcome-unknown: {e:?}"
    );
    assert!(!e.is_not_committed(), "{e:?}");
    assert!(
        !nexuscrm_persistence::support::is_contention(&e),
        "never retried as contention: {e:?}"
    );
    db.close().await;
    proxy.set_cut(false);
    // Whichever way it went on the server, the cluster agrees on it.
    let mut seen = Vec::new();
    for url in &g.nodes {
        seen.push(causal(url, "SELECT COUNT(*) FROM commit_probe").await);
    }
    assert!(
        seen.iter().all(|&n| n == seen[0]) && seen[0] <= 1,
        "the nodes disagree or hold a duplicate: {seen:?}"
    );
    println!(
        "the cut COMMIT {} on the cluster",
        if seen[0] == 1 {
            "committed"
        } else {
            "did not commit"
        }
    );
    g.drop_database().await;
}
