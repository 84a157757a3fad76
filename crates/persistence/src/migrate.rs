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

impl Db {
    /// The schema version recorded for `component` (0 when none).
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn schema_version(&self, component: &str) -> Result<i64, DbError> {
        let q = queries().for_dialect(self.dialect());
        self.pool()
            .execute(q.get("schema_create"))
            .await
            .map_err(|e| DbError::sql("creating nexuscrm_schema", e))?;
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
            for stmt in statements(m.sql(self.dialect())) {
                self.pool().execute(stmt).await.map_err(|e| {
                    DbError::new(
                        DbErrorKind::Migration,
                        format!(
                            "migration {component} v{} ({}) failed on {}: {e}",
                            m.version,
                            m.name,
                            self.dialect()
                        ),
                    )
                })?;
            }
            let updated = sqlx::query(q.get("schema_update"))
                .bind(m.version)
                .bind(component)
                .execute(self.pool())
                .await
                .map_err(|e| DbError::sql("recording the schema version", e))?;
            if updated.rows_affected() == 0 {
                // A concurrent migrator may have inserted it meanwhile; tolerate that.
                let _ = sqlx::query(q.get("schema_insert"))
                    .bind(component)
                    .bind(m.version)
                    .execute(self.pool())
                    .await;
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
