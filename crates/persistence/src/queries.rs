//! Named SQL statements loaded from a family's per-dialect `.sql` files.

use std::collections::HashMap;

use crate::db::Dialect;

/// A set of named statements for one dialect, parsed from text whose statements are each
/// introduced by a `-- name: NAME` line.
///
/// ```
/// let q = nexuscrm_persistence::Queries::parse("-- name: one\nSELECT 1\n-- name: two\nSELECT 2;\n");
/// assert_eq!(q.get("two"), "SELECT 2");
/// ```
#[derive(Debug, Clone)]
pub struct Queries {
    statements: HashMap<&'static str, String>,
}

impl Queries {
    /// Parses `-- name:` sections. Comment-only lines and a trailing `;` are dropped.
    #[must_use]
    pub fn parse(text: &'static str) -> Self {
        let mut statements = HashMap::new();
        let mut rest = text;
        while let Some(start) = rest.find("-- name:") {
            let after = &rest[start + "-- name:".len()..];
            let (name, body) = after.split_once('\n').unwrap_or((after, ""));
            let end = body.find("-- name:").unwrap_or(body.len());
            let sql: Vec<&str> = body[..end]
                .lines()
                .filter(|l| !l.trim_start().starts_with("--"))
                .collect();
            let sql = sql.join("\n");
            statements.insert(
                name.trim(),
                sql.trim().trim_end_matches(';').trim().to_owned(),
            );
            rest = &body[end..];
        }
        Queries { statements }
    }

    /// The statement called `name`.
    ///
    /// # Panics
    ///
    /// When the SQL file has no such statement: a build-time bug, caught by every test.
    #[must_use]
    pub fn get(&self, name: &str) -> &str {
        self.statements
            .get(name)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("SQL statement `{name}` is missing from its .sql file"))
    }
}

/// A family's statements for the three dialects.
#[derive(Debug, Clone)]
pub struct DialectQueries {
    sqlite: Queries,
    postgres: Queries,
    mysql: Queries,
}

impl DialectQueries {
    /// Parses the three files.
    #[must_use]
    pub fn new(sqlite: &'static str, postgres: &'static str, mysql: &'static str) -> Self {
        DialectQueries {
            sqlite: Queries::parse(sqlite),
            postgres: Queries::parse(postgres),
            mysql: Queries::parse(mysql),
        }
    }

    /// The statements for `dialect`.
    #[must_use]
    pub fn for_dialect(&self, dialect: Dialect) -> &Queries {
        match dialect {
            Dialect::Sqlite => &self.sqlite,
            Dialect::Postgres => &self.postgres,
            Dialect::Mysql => &self.mysql,
        }
    }
}
