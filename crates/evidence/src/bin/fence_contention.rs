//! `nexuscrm-fence-contention`: how much the ownership fence serializes a family's writers on
//! a MySQL-dialect server (MariaDB or one Galera node), before and after striping.
//!
//! Every claim, segment, heartbeat and release checks the fence inside its transaction. TiDB
//! has no shared row locks, so there the check is `SELECT … FOR UPDATE`: with one fence row per
//! family every writer of every replica waits for the previous writer's COMMIT. This tool runs
//! `--writers` tasks, each committing transactions of the shape every family commits (the fence
//! check, then one small write to a row of its own, then COMMIT), for `--secs` per variant:
//!
//! - `shared, 1 stripe` and `shared, 16 stripes`: MariaDB's `LOCK IN SHARE MODE`;
//! - `exclusive, 1 stripe`: TiDB's `FOR UPDATE` on a single fence row (the design before
//!   issue 17);
//! - `exclusive, 16 stripes`: TiDB's lock on one of 16 stripes (the design now).
//!
//! It reports transactions per second and the server's `Innodb_row_lock_waits` and
//! `Innodb_row_lock_time` deltas over each variant (server-wide counters: run it on a quiet
//! server). It works in a scratch database of its own, dropped at the end.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use nexuscrm_persistence::{Db, DbOptions, FENCE_STRIPES, sqlx};
use sqlx::Row;

type AnyError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Parser, Debug)]
#[command(
    name = "nexuscrm-fence-contention",
    version,
    about = "Fence contention on a MySQL-dialect server: one fence row against 16 stripes"
)]
struct Cli {
    /// A MySQL-dialect server URL whose user may create and drop a database.
    #[arg(long, default_value = "mysql://root@127.0.0.1:3306/test")]
    database_url: String,
    /// Concurrent writers (each with its own connection and its own data row).
    #[arg(long, default_value_t = 16)]
    writers: usize,
    /// Seconds per variant.
    #[arg(long, default_value_t = 10)]
    secs: u64,
}

/// One variant's figures.
struct Figures {
    txns: u64,
    elapsed: Duration,
    lock_waits: i64,
    lock_time_ms: i64,
    retried: u64,
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
    let scheme_end = base.find("://").ok_or("the URL has no scheme")? + 3;
    let path = base[scheme_end..].find('/').map(|i| i + scheme_end);
    let server = path.map_or(base, |i| &base[..i]);
    Ok(match query {
        Some(q) => format!("{server}/{name}?{q}"),
        None => format!("{server}/{name}"),
    })
}

async fn run(cli: Cli) -> Result<(), AnyError> {
    if !cli.database_url.starts_with("mysql://") && !cli.database_url.starts_with("mariadb://") {
        return Err("--database-url must be a mysql:// URL (the fence contention is a MySQL-dialect question)".into());
    }
    if cli.writers == 0 || cli.secs == 0 {
        return Err("--writers and --secs must be at least 1".into());
    }
    let name = format!("fence_contention_{}", std::process::id());
    let admin = Db::connect(&cli.database_url).await?;
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(admin.pool())
        .await?;
    let result = measure(&cli, &with_database(&cli.database_url, &name)?).await;
    let dropped = sqlx::query(&format!("DROP DATABASE {name}"))
        .execute(admin.pool())
        .await;
    admin.close().await;
    let rows = result?;
    dropped?;
    println!(
        "\n| fence check | stripes | writers | txns/s | row lock waits | row lock time (ms) | contention retries |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (label, stripes, f) in rows {
        println!(
            "| {label} | {stripes} | {} | {:.0} | {} | {} | {} |",
            cli.writers,
            f.txns as f64 / f.elapsed.as_secs_f64(),
            f.lock_waits,
            f.lock_time_ms,
            f.retried
        );
    }
    Ok(())
}

async fn measure(cli: &Cli, url: &str) -> Result<Vec<(&'static str, u32, Figures)>, AnyError> {
    let setup = Db::connect(url).await?;
    setup.migrate_ownership().await?;
    sqlx::query("CREATE TABLE fence_bench (id BIGINT PRIMARY KEY, n BIGINT NOT NULL)")
        .execute(setup.pool())
        .await?;
    for w in 0..cli.writers {
        sqlx::query("INSERT INTO fence_bench (id, n) VALUES (?, 0)")
            .bind(w as i64)
            .execute(setup.pool())
            .await?;
    }
    let mut out = Vec::new();
    for (label, exclusive, stripes) in [
        ("shared (MariaDB)", false, 1),
        ("shared (MariaDB)", false, FENCE_STRIPES),
        ("exclusive (TiDB)", true, 1),
        ("exclusive (TiDB)", true, FENCE_STRIPES),
    ] {
        let db = Db::connect_with(
            url,
            DbOptions::default()
                .max_connections(u32::try_from(cli.writers).unwrap_or(u32::MAX))
                .fence_stripes(stripes)
                .exclusive_fence(exclusive),
        )
        .await?;
        let fence = db.take_ownership("fence_bench", 1, "bench").await?;
        let before = lock_status(&setup).await?;
        let txns = Arc::new(AtomicU64::new(0));
        let retried = Arc::new(AtomicU64::new(0));
        let start = Instant::now();
        let deadline = start + Duration::from_secs(cli.secs);
        let mut tasks = Vec::new();
        for w in 0..cli.writers {
            let (db, fence, txns, retried) =
                (db.clone(), fence.clone(), txns.clone(), retried.clone());
            tasks.push(tokio::spawn(async move {
                while Instant::now() < deadline {
                    let mut tx = db.begin_write().await?;
                    if !fence.holds(tx.conn(), &db).await? {
                        tx.rollback().await;
                        return Err::<(), AnyError>("the fence was lost".into());
                    }
                    let wrote = sqlx::query("UPDATE fence_bench SET n = n + 1 WHERE id = ?")
                        .bind(w as i64)
                        .execute(&mut *tx.conn())
                        .await;
                    let committed = match wrote {
                        Ok(_) => tx.commit().await,
                        Err(e) => {
                            tx.rollback().await;
                            Err(e)
                        }
                    };
                    match committed {
                        Ok(()) => {
                            txns.fetch_add(1, Ordering::Relaxed);
                        }
                        // A deadlock or certification failure is a rollback: count and go on.
                        Err(sqlx::Error::Database(d))
                            if d.message().contains("Deadlock")
                                || d.message().contains("deadlock") =>
                        {
                            retried.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                Ok(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        let elapsed = start.elapsed();
        let after = lock_status(&setup).await?;
        db.close().await;
        let f = Figures {
            txns: txns.load(Ordering::Relaxed),
            elapsed,
            lock_waits: after.0 - before.0,
            lock_time_ms: after.1 - before.1,
            retried: retried.load(Ordering::Relaxed),
        };
        eprintln!(
            "{label}, {stripes} stripe(s): {} txns in {:.1} s",
            f.txns,
            elapsed.as_secs_f64()
        );
        out.push((label, stripes, f));
    }
    setup.close().await;
    Ok(out)
}

/// The server's `Innodb_row_lock_waits` and `Innodb_row_lock_time` (ms).
async fn lock_status(db: &Db) -> Result<(i64, i64), AnyError> {
    let rows = sqlx::query(
        "SELECT VARIABLE_NAME, CAST(VARIABLE_VALUE AS SIGNED) FROM information_schema.GLOBAL_STATUS \
         WHERE VARIABLE_NAME IN ('INNODB_ROW_LOCK_WAITS', 'INNODB_ROW_LOCK_TIME')",
    )
    .fetch_all(db.pool())
    .await?;
    let (mut waits, mut time) = (0, 0);
    for r in rows {
        let name: String = r.try_get(0)?;
        let v: i64 = r.try_get(1)?;
        match name.to_ascii_uppercase().as_str() {
            "INNODB_ROW_LOCK_WAITS" => waits = v,
            "INNODB_ROW_LOCK_TIME" => time = v,
            _ => {}
        }
    }
    Ok((waits, time))
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn the_scratch_database_replaces_the_urls_database() {
        assert_eq!(
            with_database("mysql://root@127.0.0.1:3306/test", "x").unwrap(),
            "mysql://root@127.0.0.1:3306/x"
        );
        assert_eq!(
            with_database("mysql://root@h:1/test?ssl-mode=disabled", "x").unwrap(),
            "mysql://root@h:1/x?ssl-mode=disabled"
        );
        assert_eq!(
            with_database("mysql://root@h:1", "x").unwrap(),
            "mysql://root@h:1/x"
        );
        assert!(with_database("nonsense", "x").is_err());
    }
}
