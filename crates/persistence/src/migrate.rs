//! Versioned migrations, per component and dialect.

use sqlx::{Executor, Row};

use crate::db::{Db, Dialect};
use crate::error::{DbError, DbErrorKind};
use crate::{OWNERSHIP_MIGRATIONS, queries};

/// One migration: a version, a name, and its SQL per dialect (statements separated by `;` at
/// the end of a line). Statements should be idempotent (`IF NOT EXISTS`): MySQL-dialect DDL
/// commits implicitly, so a migration interrupted there is re-run.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Strictly increasing from 1.
    pub version: i64,
    /// A short name.
    pub name: &'static str,
    /// SQLite SQL.
    pub sqlite: &'static str,
    /// PostgreSQL SQL.
    pub postgres: &'static str,
    /// MySQL-dialect SQL.
    pub mysql: &'static str,
}

impl Migration {
    fn sql(&self, dialect: Dialect) -> &'static str {
        match dialect {
            Dialect::Sqlite => self.sqlite,
            Dialect::Postgres => self.postgres,
            Dialect::Mysql => self.mysql,
        }
    }
}

fn statements(sql: &str) -> impl Iterator<Item = &str> {
    sql.split(";\n")
        .map(str::trim)
        .map(|s| s.trim_end_matches(';').trim())
        .filter(|s| {
            !s.is_empty()
                && s.lines().any(|l| {
                    let l = l.trim();
                    !l.is_empty() && !l.starts_with("--")
                })
        })
}

async fn record_version(
    db: &Db,
    q: &crate::queries::Queries,
    component: &str,
    version: i64,
) -> Result<(), DbError> {
    let updated = sqlx::query(q.get("schema_update"))
        .bind(version)
        .bind(component)
        .execute(db.pool())
        .await
        .map_err(|e| DbError::sql("recording the schema version", e))?;
    if updated.rows_affected() == 0 {
        // A concurrent migrator may have inserted it meanwhile; tolerate that.
        let _ = sqlx::query(q.get("schema_insert"))
            .bind(component)
            .bind(version)
            .execute(db.pool())
            .await;
    }
    Ok(())
}

/// Spelled in the MySQL-dialect migrations; replaced by [`Db::byte_exact_collation`].
const BIN: &str = "COLLATE utf8mb4_bin";

impl Db {
    /// The MySQL-dialect collation the migrations pin on every table: byte-exact *and* NO PAD,
    /// so keys that differ only in case, accents, emoji or trailing spaces are distinct.
    /// `utf8mb4_bin` alone is byte-exact but PAD SPACE on MariaDB and TiDB (`'a' = 'a '`), so
    /// the first that the server has of `utf8mb4_nopad_bin` (MariaDB 10.2+) and
    /// `utf8mb4_0900_bin` (MySQL 8, TiDB 7.4+) is used, else `utf8mb4_bin`.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn byte_exact_collation(&self) -> Result<&'static str, DbError> {
        let found: Vec<String> = sqlx::query_scalar(
            "SELECT CAST(COLLATION_NAME AS CHAR) FROM information_schema.COLLATIONS \
             WHERE COLLATION_NAME IN ('utf8mb4_nopad_bin', 'utf8mb4_0900_bin')",
        )
        .fetch_all(self.pool())
        .await
        .map_err(|e| DbError::sql("reading the server's collations", e))?;
        Ok(if found.iter().any(|c| c == "utf8mb4_nopad_bin") {
            "utf8mb4_nopad_bin"
        } else if found.iter().any(|c| c == "utf8mb4_0900_bin") {
            "utf8mb4_0900_bin"
        } else {
            "utf8mb4_bin"
        })
    }

    async fn dialect_sql(
        &self,
        sql: &'static str,
    ) -> Result<std::borrow::Cow<'static, str>, DbError> {
        if self.dialect() == Dialect::Mysql && sql.contains(BIN) {
            let c = self.byte_exact_collation().await?;
            Ok(sql.replace(BIN, &format!("COLLATE {c}")).into())
        } else {
            Ok(sql.into())
        }
    }

    /// The schema version recorded for `component` (0 when none).
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn schema_version(&self, component: &str) -> Result<i64, DbError> {
        let q = queries().for_dialect(self.dialect());
        let create = self.dialect_sql(q.get("schema_create")).await?;
        // Concurrent `CREATE TABLE IF NOT EXISTS` can collide on PostgreSQL's catalog: the
        // loser gets a unique violation (`pg_type_typname_nsp_index`) or, when the winner
        // committed between its check and its insert, "relation already exists" (42P07). It
        // sees the winner's table on a second try.
        let mut tries = 0;
        loop {
            match self.pool().execute(create.as_ref()).await {
                Ok(_) => break,
                Err(e)
                    if tries < 3
                        && (crate::support::is_unique_violation(&e) || is_duplicate_table(&e)) =>
                {
                    tries += 1;
                }
                Err(e) => return Err(DbError::sql("creating nexuscrm_schema", e)),
            }
        }
        let row = sqlx::query(q.get("schema_read"))
            .bind(component)
            .fetch_optional(self.pool())
            .await
            .map_err(|e| DbError::sql("reading the schema version", e))?;
        Ok(match row {
            Some(r) => r
                .try_get::<i64, _>(0)
                .map_err(|e| DbError::sql("decoding the schema version", e))?,
            None => 0,
        })
    }

    /// Applies `component`'s migrations that are newer than its recorded version, in order.
    /// Returns the number applied.
    ///
    /// # Errors
    ///
    /// [`DbErrorKind::SchemaTooNew`] when the database records a version this code does not
    /// know (newer code wrote it: refuse to run rather than misread it);
    /// [`DbErrorKind::Migration`] when a statement fails.
    pub async fn migrate(
        &self,
        component: &str,
        migrations: &[Migration],
    ) -> Result<usize, DbError> {
        let latest = migrations.iter().map(|m| m.version).max().unwrap_or(0);
        let current = self.schema_version(component).await?;
        if current > latest {
            return Err(DbError::new(
                DbErrorKind::SchemaTooNew,
                format!(
                    "the database schema of `{component}` is at version {current}, newer than \
                     this build knows ({latest}): upgrade this binary instead of running it"
                ),
            ));
        }
        let q = queries().for_dialect(self.dialect());
        let mut applied = 0;
        for m in migrations.iter().filter(|m| m.version > current) {
            let failed = |e: sqlx::Error| {
                DbError::new(
                    DbErrorKind::Migration,
                    format!(
                        "migration {component} v{} ({}) failed on {}: {e}",
                        m.version,
                        m.name,
                        self.dialect()
                    ),
                )
            };
            if self.dialect() == Dialect::Mysql {
                // MySQL-dialect DDL commits implicitly: statements are idempotent and re-run.
                let sql = self.dialect_sql(m.sql(self.dialect())).await?;
                for stmt in statements(&sql) {
                    self.pool().execute(stmt).await.map_err(failed)?;
                }
                record_version(self, q, component, m.version).await?;
            } else {
                // SQLite and PostgreSQL run DDL in a transaction: a migration and its version
                // commit together, and a concurrent migrator (SQLite: BEGIN IMMEDIATE waits;
                // PostgreSQL: an advisory transaction lock) sees it done and skips it.
                let mut tx = self.begin_write().await.map_err(failed)?;
                if self.dialect() == Dialect::Postgres {
                    // Serializes migrators (concurrent CREATE ... IF NOT EXISTS can collide).
                    tx.conn()
                        .execute("SELECT pg_advisory_xact_lock(7208466217383)")
                        .await
                        .map_err(failed)?;
                }
                let seen: Option<i64> = sqlx::query_scalar(q.get("schema_read"))
                    .bind(component)
                    .fetch_optional(tx.conn())
                    .await
                    .map_err(failed)?;
                if seen.unwrap_or(0) >= m.version {
                    tx.rollback().await;
                    continue;
                }
                for stmt in statements(m.sql(self.dialect())) {
                    tx.conn().execute(stmt).await.map_err(failed)?;
                }
                let updated = sqlx::query(q.get("schema_update"))
                    .bind(m.version)
                    .bind(component)
                    .execute(tx.conn())
                    .await
                    .map_err(failed)?;
                if updated.rows_affected() == 0 {
                    sqlx::query(q.get("schema_insert"))
                        .bind(component)
                        .bind(m.version)
                        .execute(tx.conn())
                        .await
                        .map_err(failed)?;
                }
                tx.commit().await.map_err(failed)?;
            }
            applied += 1;
        }
        Ok(applied)
    }

    /// Applies the ownership/fence migrations (every family calls this first).
    ///
    /// # Errors
    ///
    /// As [`Db::migrate`].
    pub async fn migrate_ownership(&self) -> Result<usize, DbError> {
        self.migrate("runtime_work", OWNERSHIP_MIGRATIONS).await
    }
}

/// PostgreSQL's "relation already exists" (SQLSTATE 42P07), which a `CREATE TABLE IF NOT
/// EXISTS` racing another one can still return.
fn is_duplicate_table(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("42P07"))
}
