//! The measured database: roles per side, `pg_stat_statements` reads, table resets.

use std::time::Duration;

use nexuscrm_bulk::{Bulk, BulkOptions};
use nexuscrm_flow::{Flow, FlowOptions};
use nexuscrm_persistence::Db;
use serde::Serialize;
use sqlx::{Connection, PgConnection, Row};

use crate::AnyError;

/// The database both sides use.
pub(crate) const DATABASE: &str = "nexuscrm_evidence";

/// Who issues the statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Controller,
    Baseline,
}

impl Side {
    pub(crate) fn role(self) -> &'static str {
        match self {
            Side::Controller => "ev_controller",
            Side::Baseline => "ev_baseline",
        }
    }

    pub(crate) fn key(self) -> &'static str {
        match self {
            Side::Controller => "controller",
            Side::Baseline => "baseline",
        }
    }
}

/// The measured server and database.
#[derive(Debug)]
pub(crate) struct Env {
    admin_url: String,
    /// The database as the tool itself (statements not counted for either side).
    pub(crate) db: Db,
    pub(crate) server_version: String,
}

fn with_db(url: &str, user: Option<&str>, db: &str) -> String {
    // postgres://user@host:port/db?params -> replace user and db.
    let (scheme, rest) = url.split_once("://").unwrap_or(("postgres", url));
    let (authority, tail) = rest.split_once('/').unwrap_or((rest, ""));
    let query = tail
        .split_once('?')
        .map(|(_, q)| format!("?{q}"))
        .unwrap_or_default();
    let authority = match user {
        Some(u) => {
            let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
            format!("{u}@{host}")
        }
        None => authority.to_owned(),
    };
    format!("{scheme}://{authority}/{db}{query}")
}

impl Env {
    /// Creates (afresh) the evidence database, the two roles, the extension, and the schema.
    pub(crate) async fn prepare(admin_url: &str) -> Result<Env, AnyError> {
        let mut admin = PgConnection::connect(admin_url)
            .await
            .map_err(|e| format!("cannot connect to {admin_url}: {e}"))?;
        let preload: String = sqlx::query_scalar("SHOW shared_preload_libraries")
            .fetch_one(&mut admin)
            .await?;
        if !preload.contains("pg_stat_statements") {
            return Err(format!(
                "the server at {admin_url} does not preload pg_stat_statements \
                 (shared_preload_libraries = {preload:?}); omit --database-url to use a private \
                 cluster"
            )
            .into());
        }
        let server_version: String = sqlx::query_scalar("SHOW server_version")
            .fetch_one(&mut admin)
            .await?;
        sqlx::query(&format!("DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)"))
            .execute(&mut admin)
            .await?;
        sqlx::query(&format!("CREATE DATABASE {DATABASE}"))
            .execute(&mut admin)
            .await?;
        for side in [Side::Controller, Side::Baseline] {
            let role = side.role();
            let exists: Option<i32> =
                sqlx::query_scalar("SELECT 1 FROM pg_roles WHERE rolname = $1")
                    .bind(role)
                    .fetch_optional(&mut admin)
                    .await?;
            if exists.is_none() {
                sqlx::query(&format!("CREATE ROLE {role} LOGIN SUPERUSER"))
                    .execute(&mut admin)
                    .await
                    .map_err(|e| format!("cannot create role {role}: {e}"))?;
            }
        }
        admin.close().await?;
        let url = with_db(admin_url, None, DATABASE);
        let db = Db::connect(&url).await?;
        sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(db.pool())
            .await?;
        // Both sides run as deployment generation 1 of each family.
        Bulk::open(db.clone(), 1, BulkOptions::default())
            .await?
            .take_ownership("nexuscrm-evidence")
            .await?;
        Flow::open(db.clone(), 1, FlowOptions::default())
            .await?
            .take_ownership("nexuscrm-evidence")
            .await?;
        nexuscrm_formula::Formula::open(db.clone(), nexuscrm_formula::FormulaOptions::default())
            .await?
            .take_ownership("nexuscrm-evidence")
            .await?;
        Ok(Env {
            admin_url: admin_url.to_owned(),
            db,
            server_version,
        })
    }

    /// The URL a side's replicas connect with.
    pub(crate) fn url(&self, side: Side) -> String {
        with_db(&self.admin_url, Some(side.role()), DATABASE)
    }

    /// The URL the tool itself uses (not counted for either side).
    pub(crate) fn tool_url(&self) -> String {
        with_db(&self.admin_url, None, DATABASE)
    }

    /// Empties every family table (and resets ownership) between phases.
    pub(crate) async fn reset_tables(&self) -> Result<(), AnyError> {
        sqlx::query(
            "TRUNCATE bulk_job, bulk_input, bulk_row_error, crm_record, crm_record_change, \
             flow_schedule, flow_run, formula_definition, formula_record, formula_value, \
             formula_rollup, formula_cursor RESTART IDENTITY",
        )
        .execute(self.db.pool())
        .await?;
        Ok(())
    }

    /// Forgets all statement statistics.
    pub(crate) async fn reset_stats(&self) -> Result<(), AnyError> {
        sqlx::query("SELECT pg_stat_statements_reset()")
            .execute(self.db.pool())
            .await?;
        Ok(())
    }

    /// The statements `side` issued in this database since the last reset, per digest.
    pub(crate) async fn digests(&self, side: Side) -> Result<Vec<Digest>, AnyError> {
        let rows = sqlx::query(
            "SELECT s.query, s.calls, s.rows, s.shared_blks_hit, s.shared_blks_read, \
                    s.total_exec_time \
             FROM pg_stat_statements s JOIN pg_roles r ON r.oid = s.userid \
             WHERE r.rolname = $1 \
               AND s.dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
             ORDER BY s.calls DESC, s.query",
        )
        .bind(side.role())
        .fetch_all(self.db.pool())
        .await?;
        let mut out = Vec::new();
        for r in rows {
            let query: String = text(&r, 0)?;
            let calls: i64 = r.try_get(1)?;
            let total_ms: f64 = r.try_get(5)?;
            out.push(Digest {
                query: squash(&query),
                calls,
                rows: r.try_get(2)?,
                blks_hit: r.try_get(3)?,
                blks_read: r.try_get(4)?,
                mean_ms: if calls > 0 {
                    total_ms / calls as f64
                } else {
                    0.0
                },
            });
        }
        Ok(out)
    }

    /// Waits until `sql` (a count) reaches `want`, or `within` passes; returns the last count.
    pub(crate) async fn wait_count(&self, sql: &str, want: i64, within: Duration) -> i64 {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let n: i64 = sqlx::query_scalar(sql)
                .fetch_one(self.db.pool())
                .await
                .unwrap_or(0);
            if n >= want || tokio::time::Instant::now() >= deadline {
                return n;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Drops the evidence database (a private cluster is removed anyway).
    pub(crate) async fn cleanup(&self) {
        self.db.close().await;
        if let Ok(mut admin) = PgConnection::connect(&self.admin_url).await {
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)"))
                .execute(&mut admin)
                .await;
        }
    }
}

fn text(r: &sqlx::any::AnyRow, i: usize) -> Result<String, sqlx::Error> {
    nexuscrm_persistence::support::text(r, i)
}

/// Whitespace collapsed, at most 160 characters.
fn squash(q: &str) -> String {
    let s = q.split_whitespace().collect::<Vec<_>>().join(" ");
    if s.chars().count() > 160 {
        s.chars().take(157).collect::<String>() + "..."
    } else {
        s
    }
}

/// One statement digest's counters.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Digest {
    pub(crate) query: String,
    pub(crate) calls: i64,
    pub(crate) rows: i64,
    pub(crate) blks_hit: i64,
    pub(crate) blks_read: i64,
    pub(crate) mean_ms: f64,
}

/// Totals over digests.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct Totals {
    pub(crate) statements: i64,
    pub(crate) rows: i64,
    pub(crate) blks_hit: i64,
    pub(crate) blks_read: i64,
}

pub(crate) fn totals(d: &[Digest]) -> Totals {
    d.iter().fold(Totals::default(), |t, x| Totals {
        statements: t.statements + x.calls,
        rows: t.rows + x.rows,
        blks_hit: t.blks_hit + x.blks_hit,
        blks_read: t.blks_read + x.blks_read,
    })
}
