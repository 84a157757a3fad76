//! `nexuscrm-cluster-evidence`: the drain and contend scenarios on the three-node MariaDB
//! Galera cluster (`scripts/galera.sh start`), next to the same runs on the single MariaDB
//! server.
//!
//! For 1, 2 and 4 Bulk replicas, each on its own pool to its own node (replica `i` on node
//! `i % nodes`, with the Runtime Worker's Bulk defaults: capacity 4, 20 ms claim cooldown, 5 s
//! generation poll), it drains two workloads submitted through node 1 beforehand: Bulk jobs of
//! 100 rows (the drain scenario) and one-row jobs (the contend scenario: every claim races the
//! other replicas for the same few rows). It reports rows per second, client statements per row
//! (the servers' `Questions` deltas summed over the nodes, minus this tool's own reads),
//! certification failures and brute-force aborts (`wsrep_local_cert_failures`,
//! `wsrep_local_bf_aborts`), claims, empty claims, and controller restarts after a proven
//! rollback. Each run uses a scratch database of its own, dropped afterwards.

#![forbid(unsafe_code)]

use std::num::NonZeroUsize;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clap::Parser;
use nexuscrm_bulk::{Bulk, BulkConfig, BulkOptions, NewJob, RowInput};
use nexuscrm_persistence::{Db, DbOptions, sqlx};
use nexuscrm_worker::{Config, Controller, RunErrorKind};
use nexuscrm_worker_test::scenarios::Counted;
use serde_json::{Map, Value};
use sqlx::Row;
use tokio_util::sync::CancellationToken;

type AnyError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Parser, Debug)]
#[command(
    name = "nexuscrm-cluster-evidence",
    version,
    about = "Bulk drain and contention on a Galera cluster and on one MariaDB server"
)]
struct Cli {
    /// The cluster's nodes (comma separated `mysql://` server URLs; `root` may create
    /// databases).
    #[arg(
        long,
        value_delimiter = ',',
        default_values_t = [
            "mysql://root@127.0.0.1:23307/test".to_owned(),
            "mysql://root@127.0.0.1:23308/test".to_owned(),
            "mysql://root@127.0.0.1:23309/test".to_owned(),
        ]
    )]
    nodes: Vec<String>,
    /// The single server to compare with (empty: none).
    #[arg(long, default_value = "mysql://root@127.0.0.1:3306/test")]
    single: String,
    /// Rows of the drain workload (in jobs of 100 rows).
    #[arg(long, default_value_t = 20_000)]
    rows: usize,
    /// One-row jobs of the contend workload.
    #[arg(long, default_value_t = 1_000)]
    tiny_jobs: usize,
    /// Replica counts (comma separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4])]
    replicas: Vec<usize>,
    /// A small, fast run (for CI): 1,000 rows, 100 one-row jobs, replicas 1 and 2.
    #[arg(long)]
    smoke: bool,
}

/// One run's figures.
struct Run {
    target: &'static str,
    workload: String,
    replicas: usize,
    rows: usize,
    secs: f64,
    statements: i64,
    conflicts: Option<i64>,
    claims: u64,
    empty_claims: u64,
    restarts: u64,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::from(1)
        }
    }
}

/// `url` with its database replaced by `name`.
fn with_database(url: &str, name: &str) -> Result<String, AnyError> {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let scheme_end = base.find("://").ok_or("a URL has no scheme")? + 3;
    let path = base[scheme_end..].find('/').map(|i| i + scheme_end);
    let server = path.map_or(base, |i| &base[..i]);
    Ok(match query {
        Some(q) => format!("{server}/{name}?{q}"),
        None => format!("{server}/{name}"),
    })
}

async fn run(mut cli: Cli) -> Result<(), AnyError> {
    if cli.smoke {
        cli.rows = 1_000;
        cli.tiny_jobs = 100;
        cli.replicas = vec![1, 2];
    }
    if cli.nodes.is_empty() || cli.replicas.contains(&0) || cli.rows < 100 || cli.tiny_jobs == 0 {
        return Err(
            "--nodes needs a URL, replicas must be at least 1, --rows at least 100 and \
                    --tiny-jobs at least 1"
                .into(),
        );
    }
    for u in cli.nodes.iter().chain(std::iter::once(&cli.single)) {
        if !u.is_empty() && !u.starts_with("mysql://") && !u.starts_with("mariadb://") {
            return Err(format!("{u} is not a mysql:// URL").into());
        }
    }
    let mut targets: Vec<(&'static str, Vec<String>)> =
        vec![("Galera (3 nodes)", cli.nodes.clone())];
    if !cli.single.is_empty() {
        targets.push(("MariaDB (1 server)", vec![cli.single.clone()]));
    }
    let mut runs = Vec::new();
    for (target, nodes) in &targets {
        for &replicas in &cli.replicas {
            for (workload, jobs, per_job) in [
                ("drain: jobs of 100 rows", cli.rows / 100, 100),
                ("contend: one-row jobs", cli.tiny_jobs, 1),
            ] {
                eprintln!("{target}: {workload}, {replicas} replica(s) ...");
                let r = one_run(target, nodes, workload, jobs, per_job, replicas).await?;
                eprintln!(
                    "  {} rows in {:.1} s, {} statements",
                    r.rows, r.secs, r.statements
                );
                runs.push(r);
            }
        }
    }
    println!(
        "\n| target | workload | replicas | rows | rows/s | statements/row | certification failures + BF aborts | claims | empty claims | restarts after a rollback |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in &runs {
        println!(
            "| {} | {} | {} | {} | {:.0} | {:.2} | {} | {} | {} | {} |",
            r.target,
            r.workload,
            r.replicas,
            r.rows,
            r.rows as f64 / r.secs,
            r.statements as f64 / r.rows as f64,
            r.conflicts.map_or("n/a".to_owned(), |n| n.to_string()),
            r.claims,
            r.empty_claims,
            r.restarts
        );
    }
    Ok(())
}

/// The servers' counters: `Questions`, and certification failures + BF aborts (`None` on a
/// server without wsrep).
async fn counters(nodes: &[Db]) -> Result<(i64, Option<i64>), AnyError> {
    let (mut questions, mut conflicts) = (0, None);
    for db in nodes {
        let rows = sqlx::query(
            "SELECT VARIABLE_NAME, CAST(VARIABLE_VALUE AS SIGNED) FROM information_schema.GLOBAL_STATUS \
             WHERE VARIABLE_NAME IN ('QUESTIONS', 'WSREP_LOCAL_CERT_FAILURES', 'WSREP_LOCAL_BF_ABORTS')",
        )
        .fetch_all(db.pool())
        .await?;
        for r in rows {
            let name: String = r.try_get(0)?;
            let v: i64 = r.try_get(1)?;
            if name.eq_ignore_ascii_case("QUESTIONS") {
                questions += v;
            } else {
                conflicts = Some(conflicts.unwrap_or(0) + v);
            }
        }
    }
    Ok((questions, conflicts))
}

fn rows(prefix: &str, n: usize) -> Vec<RowInput> {
    (0..n)
        .map(|i| {
            let mut m = Map::new();
            m.insert("name".into(), Value::String(format!("Contact {i}")));
            m.insert("email".into(), Value::String(format!("c{i}@example.com")));
            RowInput::new(format!("{prefix}-{i}"), m)
        })
        .collect()
}

async fn one_run(
    target: &'static str,
    servers: &[String],
    workload: &str,
    jobs: usize,
    per_job: usize,
    replicas: usize,
) -> Result<Run, AnyError> {
    let name = format!("cluster_evidence_{}", std::process::id());
    let admin = Db::connect(&servers[0]).await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name}"))
        .execute(admin.pool())
        .await?;
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(admin.pool())
        .await?;
    let result = measured(target, servers, &name, workload, jobs, per_job, replicas).await;
    let dropped = sqlx::query(&format!("DROP DATABASE {name}"))
        .execute(admin.pool())
        .await;
    admin.close().await;
    let run = result?;
    dropped?;
    Ok(run)
}

async fn measured(
    target: &'static str,
    servers: &[String],
    name: &str,
    workload: &str,
    jobs: usize,
    per_job: usize,
    replicas: usize,
) -> Result<Run, AnyError> {
    let urls = servers
        .iter()
        .map(|s| with_database(s, name))
        .collect::<Result<Vec<_>, _>>()?;
    let producer_db = Db::connect(&urls[0]).await?;
    let producer = Bulk::open(producer_db.clone(), 1, BulkOptions::default()).await?;
    producer.take_ownership("cluster-evidence").await?;
    for j in 0..jobs {
        let key = format!("job-{j}");
        let mut job = NewJob::new(key.clone(), rows(&key, per_job));
        job.segment_size = Some(100);
        producer.submit(job).await?;
    }
    let mut probes = Vec::new();
    for u in &urls {
        probes.push(Db::connect_with(u, DbOptions::default().max_connections(1)).await?);
    }
    // Let every node apply the submissions before the clock starts (causal read).
    for p in &probes {
        sqlx::query("SET SESSION wsrep_sync_wait = 1")
            .execute(p.pool())
            .await
            .ok();
    }
    let mut own = 0i64;
    let (q0, c0) = counters(&probes).await?;
    own += probes.len() as i64;
    let stop = CancellationToken::new();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..replicas {
        let (url, stop) = (urls[i % urls.len()].clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let db = Db::connect(&url).await?;
            let (mut claims, mut empty, mut restarts) = (0u64, 0u64, 0u64);
            // A supervisor: a controller stopped by a proven rollback is started again.
            while !stop.is_cancelled() {
                let cfg = BulkConfig::default()
                    .listen(false)
                    .generation_poll(Some(Duration::from_secs(5)));
                let bulk =
                    Bulk::without_migrations(db.clone(), 1, BulkOptions::default().config(cfg));
                let source = Counted::new(bulk.source());
                let counts = source.counts();
                let ctl = Controller::new(
                    source,
                    Config::new("bulk")
                        .capacity(NonZeroUsize::new(4).expect("> 0"))
                        .claim_cooldown(Duration::from_millis(20)),
                )?;
                bulk.set_waker(ctl.waker());
                let outcome = ctl.run(stop.clone()).await;
                claims += counts.claim.load(Ordering::Relaxed);
                empty += counts.empty_claims();
                match outcome {
                    Ok(_) => {}
                    Err(e) if e.kind() == RunErrorKind::NotCommitted => restarts += 1,
                    Err(e) => return Err::<_, AnyError>(format!("replica {i}: {e}").into()),
                }
            }
            db.close().await;
            Ok((claims, empty, restarts))
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let done: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM bulk_job WHERE state IN ('succeeded', 'poisoned')",
        )
        .fetch_one(probes[0].pool())
        .await?;
        own += 1;
        if done as usize >= jobs {
            break;
        }
        if Instant::now() > deadline {
            stop.cancel();
            return Err(format!("{target}: {done} of {jobs} jobs done after 600 s").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let secs = start.elapsed().as_secs_f64();
    let (q1, c1) = counters(&probes).await?;
    stop.cancel();
    let (mut claims, mut empty_claims, mut restarts) = (0, 0, 0);
    for t in tasks {
        let (c, e, r) = t.await??;
        claims += c;
        empty_claims += e;
        restarts += r;
    }
    for p in probes {
        p.close().await;
    }
    producer_db.close().await;
    Ok(Run {
        target,
        workload: workload.to_owned(),
        replicas,
        rows: jobs * per_job,
        secs,
        statements: q1 - q0 - own,
        conflicts: c0.zip(c1).map(|(a, b)| b - a),
        claims,
        empty_claims,
        restarts,
    })
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn the_scratch_database_replaces_the_urls_database() {
        assert_eq!(
            with_database("mysql://root@127.0.0.1:23307/test", "x").unwrap(),
            "mysql://root@127.0.0.1:23307/x"
        );
        assert!(with_database("nonsense", "x").is_err());
    }
}
