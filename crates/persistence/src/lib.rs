//! `nexuscrm-persistence`: database handles, migrations, and the runtime work ownership
//! authority that every NexusCRM work family builds on.
//!
//! - [`Db`]: one sqlx pool opened from a URL (`sqlite://…`, the embedded default; `postgres://…`;
//!   `mysql://…` for MariaDB, MySQL or TiDB), its [`Dialect`], and TiDB detection.
//! - [`Queries`] / [`DialectQueries`]: a family's named statements from its per-dialect `.sql`
//!   files. Families own their SQL; nothing here is templated.
//! - [`Migration`] and [`Db::migrate`]: versioned migrations per component, refusing a schema
//!   newer than the code.
//! - [`Db::write`] / [`WriteTx`]: write transactions that are safe under cancellation and say
//!   whether anything may have committed ([`WriteError`]).
//! - [`Db::take_ownership`] and [`Fence`]: which deployment generation may claim or commit a
//!   family, checked inside the same transaction as every claim and commit.
//!
//! - [`GenerationProbe`]: the cross-process generation probe (LISTEN/NOTIFY on PostgreSQL,
//!   a polled cursor read elsewhere).
//! - [`family`]: the shape every family's `Source` shares: the fenced transaction, the claim's
//!   rows and batch, timer and generation reads, error classification.
//! - [`support`]: epoch-millisecond times, text decoding, unique-violation and contention
//!   detection, contention retries, claim tokens.
//!
//! The handle is a `sqlx::AnyPool` with per-dialect SQL text rather than an enum of three typed
//! pools: one Rust code path per statement, the dialect's own SQL file per statement.

#![forbid(unsafe_code)]

mod db;
mod error;
pub mod family;
mod migrate;
mod ownership;
mod probe;
mod queries;
pub mod support;
mod tx;

#[cfg(feature = "test-support")]
pub mod testing;

use std::sync::OnceLock;

pub use db::{Db, DbOptions, Dialect, PING_IF_IDLE_FOR, is_tidb_version, redact_url};

/// Where the families' observed counts stop (`/metrics`, `/snapshot`, `status`): each count
/// reads at most this many index entries, so a scrape costs the same over a history of
/// millions of rows. A count equal to the cap means "at least this many".
pub const OBSERVATION_CAP: i64 = 100_000;
pub use error::{DbError, DbErrorKind};
pub use migrate::Migration;
pub use ownership::{FENCE_STRIPES, Fence, OnTaken};
pub use probe::{GenerationProbe, ProbeError};
pub use queries::{DialectQueries, Queries};
pub use sqlx;
pub use tx::{TxFuture, WriteError, WriteTx, commit_rolled_back};

/// The ownership authority's own migrations.
pub const OWNERSHIP_MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "ownership and fence",
        sqlite: include_str!("../sql/sqlite/0001_ownership.sql"),
        postgres: include_str!("../sql/postgres/0001_ownership.sql"),
        mysql: include_str!("../sql/mysql/0001_ownership.sql"),
    },
    Migration {
        version: 2,
        name: "byte-exact utf8mb4 keys (MySQL dialect; nothing elsewhere)",
        sqlite: "",
        postgres: "",
        mysql: include_str!("../sql/mysql/0002_ownership.sql"),
    },
    Migration {
        version: 3,
        name: "the fence in 16 stripes; the cross-node work signal",
        sqlite: include_str!("../sql/sqlite/0003_ownership.sql"),
        postgres: include_str!("../sql/postgres/0003_ownership.sql"),
        mysql: include_str!("../sql/mysql/0003_ownership.sql"),
    },
];

fn queries() -> &'static DialectQueries {
    static Q: OnceLock<DialectQueries> = OnceLock::new();
    Q.get_or_init(|| {
        DialectQueries::new(
            include_str!("../sql/sqlite/queries.sql"),
            include_str!("../sql/postgres/queries.sql"),
            include_str!("../sql/mysql/queries.sql"),
        )
    })
}
