//! Persistence errors.

use std::error::Error;
use std::fmt;

/// What went wrong opening or migrating a database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DbErrorKind {
    /// A bad URL or setting.
    Config,
    /// The server could not be reached or refused us.
    Unavailable,
    /// The schema was written by newer code than this binary.
    SchemaTooNew,
    /// A migration failed.
    Migration,
    /// A newer deployment generation owns the family.
    Superseded,
    /// Any other database error.
    Database,
}

/// A persistence error with a clear message.
#[derive(Debug)]
pub struct DbError {
    kind: DbErrorKind,
    message: String,
    source: Option<sqlx::Error>,
}

impl DbError {
    pub(crate) fn new(kind: DbErrorKind, message: impl Into<String>) -> Self {
        DbError {
            kind,
            message: message.into(),
            source: None,
        }
    }

    pub(crate) fn config(message: impl Into<String>) -> Self {
        DbError::new(DbErrorKind::Config, message)
    }

    pub(crate) fn unavailable(message: impl Into<String>) -> Self {
        DbError::new(DbErrorKind::Unavailable, message)
    }

    pub(crate) fn sql(context: impl Into<String>, e: sqlx::Error) -> Self {
        DbError {
            kind: DbErrorKind::Database,
            message: format!("{}: {e}", context.into()),
            source: Some(e),
        }
    }

    /// The kind of failure.
    #[must_use]
    pub fn kind(&self) -> DbErrorKind {
        self.kind
    }
}

impl fmt::Display for DbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl Error for DbError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source.as_ref().map(|e| e as &(dyn Error + 'static))
    }
}
