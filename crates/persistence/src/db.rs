//! Opening a database from a URL.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::pool::PoolConnection;
use sqlx::{Any, AnyPool, ConnectOptions, Connection, Executor};

use crate::error::DbError;

/// The SQL dialect of a database.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// Embedded SQLite (the default).
    Sqlite,
    /// PostgreSQL.
    Postgres,
    /// The MySQL dialect: MariaDB or MySQL here, TiDB in production.
    Mysql,
}

impl Dialect {
    /// The folder name of this dialect's SQL files: `sqlite`, `postgres`, `mysql`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Dialect::Sqlite => "sqlite",
            Dialect::Postgres => "postgres",
            Dialect::Mysql => "mysql",
        }
    }
}

impl fmt::Display for Dialect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Pool settings. Defaults: 8 connections, 10 s acquire timeout, 5 s SQLite busy timeout, the
/// fence checked on all 16 stripes, exclusively on TiDB only.
#[derive(Debug, Clone)]
pub struct DbOptions {
    max_connections: u32,
    acquire_timeout: Duration,
    busy_timeout: Duration,
    fence_stripes: u32,
    exclusive_fence: bool,
    ping_if_idle_for: Duration,
}

impl Default for DbOptions {
    fn default() -> Self {
        DbOptions {
            max_connections: 8,
            acquire_timeout: Duration::from_secs(10),
            busy_timeout: Duration::from_secs(5),
            fence_stripes: crate::ownership::FENCE_STRIPES,
            exclusive_fence: false,
            ping_if_idle_for: PING_IF_IDLE_FOR,
        }
    }
}

/// How long a pooled connection may sit idle before it is pinged on acquire (pgxpool's
/// `ShouldPing` default): [`DbOptions::ping_if_idle_for`].
pub const PING_IF_IDLE_FOR: Duration = Duration::from_secs(1);

impl DbOptions {
    /// Maximum pool connections. By default 8.
    #[must_use]
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// How long to wait for a pooled connection. By default 10 seconds.
    #[must_use]
    pub fn acquire_timeout(mut self, d: Duration) -> Self {
        self.acquire_timeout = d;
        self
    }

    /// A connection idle for at least this long is pinged before it is handed out, and
    /// replaced if the ping fails; one used more recently is handed out as it is. By default
    /// [`PING_IF_IDLE_FOR`] (1 s, as pgx's pool does); `Duration::ZERO` pings on every acquire
    /// (sqlx's default).
    ///
    /// A busy queue then spends no round trip per transaction on a ping. What that costs: a
    /// recently used connection that died since (the server restarted, a proxy cut it) is found
    /// by its `BEGIN`, which fails before anything ran; [`Db::write`] reports that as
    /// [`WriteError::NotCommitted`](crate::WriteError::NotCommitted), which every family
    /// retries, and the pool replaces the connection.
    #[must_use]
    pub fn ping_if_idle_for(mut self, d: Duration) -> Self {
        self.ping_if_idle_for = d;
        self
    }

    /// SQLite's busy timeout: how long a writer waits for the single write lock. By default 5
    /// seconds.
    #[must_use]
    pub fn busy_timeout(mut self, d: Duration) -> Self {
        self.busy_timeout = d;
        self
    }

    /// Over how many of the fence's stripes this handle's writers spread their fence checks
    /// (1 to [`FENCE_STRIPES`](crate::FENCE_STRIPES), clamped; by default all of them). Every
    /// takeover writes every stripe whatever this says, so any value is safe; fewer stripes
    /// only concentrate the writers' locks, which is how the contention figures in
    /// `docs/tidb.md` measure one fence row against sixteen.
    #[must_use]
    pub fn fence_stripes(mut self, n: u32) -> Self {
        self.fence_stripes = n.clamp(1, crate::ownership::FENCE_STRIPES);
        self
    }

    /// Checks the fence with an exclusive lock (`FOR UPDATE`) on any MySQL-dialect server, as
    /// is always done on TiDB (which has no shared row locks). Off by default; for measuring
    /// TiDB's fence contention on MariaDB and Galera.
    #[must_use]
    pub fn exclusive_fence(mut self, on: bool) -> Self {
        self.exclusive_fence = on;
        self
    }
}

/// A database handle: one pool, its dialect, and whether it is TiDB.
///
/// Every family runs its own per-dialect SQL through it (see [`Queries`](crate::Queries)).
#[derive(Clone)]
pub struct Db {
    pool: AnyPool,
    dialect: Dialect,
    tidb: bool,
    fence_stripes: u32,
    exclusive_fence: bool,
    url_redacted: String,
    secret_url: String,
}

impl fmt::Debug for Db {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Db")
            .field("url", &self.url_redacted)
            .field("dialect", &self.dialect)
            .field("tidb", &self.tidb)
            .finish()
    }
}

/// Query parameters whose value is a credential or names one (every driver's spelling).
const SECRET_PARAMS: &[&str] = &[
    "password",
    "pass",
    "passwd",
    "pwd",
    "sslpassword",
    "passfile",
    "sslkey",
    "secret",
    "token",
    "auth_token",
    "access_token",
];

/// `url` with every credential hidden: the password in `scheme://user:password@host`, and the
/// value of every credential-bearing query parameter (`password`, `sslpassword`, `passfile`,
/// `sslkey`, `token` and the like, in any case). Use it wherever a database URL is printed.
///
/// ```
/// use nexuscrm_persistence::redact_url;
/// assert_eq!(
///     redact_url("postgres://u:S3cret@db/app?user=u&password=S3cret"),
///     "postgres://u:***@db/app?user=u&password=***"
/// );
/// ```
#[must_use]
pub fn redact_url(url: &str) -> String {
    let (body, fragment) = match url.split_once('#') {
        Some((b, f)) => (b, Some(f)),
        None => (url, None),
    };
    let (base, query) = match body.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (body, None),
    };
    let mut out = String::with_capacity(url.len());
    match base.split_once("://") {
        Some((scheme, rest)) => {
            out.push_str(scheme);
            out.push_str("://");
            // The authority ends at the first '/'; its userinfo ends at its last '@'.
            let (authority, path) = match rest.find('/') {
                Some(i) => rest.split_at(i),
                None => (rest, ""),
            };
            match authority.rsplit_once('@') {
                Some((creds, host)) => {
                    match creds.split_once(':') {
                        Some((user, _)) => {
                            out.push_str(user);
                            out.push_str(":***");
                        }
                        None => out.push_str(creds),
                    }
                    out.push('@');
                    out.push_str(host);
                }
                None => out.push_str(authority),
            }
            out.push_str(path);
        }
        None => out.push_str(base),
    }
    if let Some(query) = query {
        out.push('?');
        for (i, pair) in query.split('&').enumerate() {
            if i > 0 {
                out.push('&');
            }
            let (key, value) = match pair.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (pair, None),
            };
            out.push_str(key);
            if let Some(value) = value {
                out.push('=');
                let secret = SECRET_PARAMS.iter().any(|p| key.eq_ignore_ascii_case(p));
                out.push_str(if secret { "***" } else { value });
            }
        }
    }
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(fragment);
    }
    out
}

fn redact(url: &str) -> String {
    redact_url(url)
}

impl Db {
    /// Opens `url` with default options.
    ///
    /// `sqlite://path/to/file.db` (created if missing; WAL, busy timeout), `postgres://…`, or
    /// `mysql://…` (MariaDB, MySQL, TiDB).
    ///
    /// # Errors
    ///
    /// A malformed or unsupported URL, or an unreachable server, with the URL (password hidden)
    /// in the message.
    pub async fn connect(url: &str) -> Result<Db, DbError> {
        Db::connect_with(url, DbOptions::default()).await
    }

    /// Opens `url` with `options`.
    ///
    /// # Errors
    ///
    /// As [`Db::connect`].
    pub async fn connect_with(url: &str, options: DbOptions) -> Result<Db, DbError> {
        sqlx::any::install_default_drivers();
        let shown = redact(url);
        let (dialect, connect_options, url) = parse_url(url)?;
        let mut tidb = false;
        if dialect != Dialect::Sqlite {
            // One direct connection first: a refused connection, an unknown host or a failed
            // login is reported at once, with its cause, instead of as "pool timed out" after
            // the acquire timeout (the pool retries connect errors silently until then).
            match tokio::time::timeout(options.acquire_timeout, connect_options.connect()).await {
                Ok(Ok(mut conn)) => {
                    if dialect == Dialect::Mysql {
                        let version: String = sqlx::query_scalar("SELECT VERSION()")
                            .fetch_one(&mut conn)
                            .await
                            .map_err(|e| {
                                DbError::unavailable(format!("cannot read server version: {e}"))
                            })?;
                        tidb = is_tidb_version(&version);
                    }
                    let _ = sqlx::Connection::close(conn).await;
                }
                Ok(Err(e)) => {
                    return Err(DbError::unavailable(format!(
                        "cannot open database {shown}: {e}"
                    )));
                }
                Err(_) => {
                    return Err(DbError::unavailable(format!(
                        "cannot open database {shown}: no answer within {:?}",
                        options.acquire_timeout
                    )));
                }
            }
        }
        let busy_ms = options.busy_timeout.as_millis();
        let ping_if_idle_for = options.ping_if_idle_for;
        let pool = AnyPoolOptions::new()
            .max_connections(options.max_connections)
            .acquire_timeout(options.acquire_timeout)
            .test_before_acquire(false)
            .before_acquire(move |conn, meta| {
                Box::pin(async move {
                    // An error closes the connection hard and the pool tries another, as
                    // sqlx's own ping does.
                    if meta.idle_for >= ping_if_idle_for {
                        conn.ping().await?;
                    }
                    Ok(true)
                })
            })
            .after_connect(move |conn, _meta| {
                Box::pin(async move {
                    match dialect {
                        Dialect::Sqlite => {
                            conn.execute("PRAGMA journal_mode = WAL").await?;
                            conn.execute(format!("PRAGMA busy_timeout = {busy_ms}").as_str())
                                .await?;
                            conn.execute("PRAGMA foreign_keys = ON").await?;
                            conn.execute("PRAGMA synchronous = NORMAL").await?;
                        }
                        Dialect::Mysql => {
                            if tidb {
                                // Pessimistic, whatever the cluster's default: every claim and
                                // disposition takes its row locks as it runs (as on MariaDB), so
                                // a conflict is a lock wait or a definite rollback (8002, 8005,
                                // 9007) rather than an optimistic abort of a transaction that
                                // already did its work; and TiDB's READ COMMITTED exists only in
                                // pessimistic mode. See docs/tidb.md.
                                conn.execute("SET SESSION tidb_txn_mode = 'pessimistic'")
                                    .await?;
                            }
                            conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                                .await?;
                        }
                        Dialect::Postgres => {
                            // Server NOTICEs ("relation ... already exists, skipping") are
                            // noise in a CLI's output; warnings and errors still arrive.
                            conn.execute("SET client_min_messages = warning").await?;
                            // Every execution is planned with its own parameters. sqlx prepares
                            // each statement once per connection, and PostgreSQL switches a
                            // prepared statement to a generic plan after five executions and
                            // keeps it until the table is next analyzed: a plan made while a
                            // queue table was nearly empty (a sequential scan) then stays while
                            // it grows. The evidence tool measured it: a 100-key DELETE of the
                            // Formula View at 128 ms (1,000 blocks) instead of under 1 ms.
                            // Planning our short statements costs far less than one such scan.
                            conn.execute("SET plan_cache_mode = force_custom_plan")
                                .await?;
                        }
                    }
                    Ok(())
                })
            })
            .connect_with(connect_options)
            .await
            .map_err(|e| DbError::unavailable(format!("cannot open database {shown}: {e}")))?;
        Ok(Db {
            pool,
            dialect,
            tidb,
            fence_stripes: options.fence_stripes,
            exclusive_fence: options.exclusive_fence,
            url_redacted: shown,
            secret_url: url,
        })
    }

    /// The dialect.
    #[must_use]
    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// Whether the server is TiDB (its version string contains `TiDB`). TiDB parses
    /// `SKIP LOCKED` and `RETURNING` but ignores them, so the MySQL-dialect SQL never relies on
    /// them.
    #[must_use]
    pub fn is_tidb(&self) -> bool {
        self.tidb
    }

    /// Over how many fence stripes this handle's writers spread ([`DbOptions::fence_stripes`]).
    #[must_use]
    pub fn fence_stripes(&self) -> u32 {
        self.fence_stripes
    }

    /// Whether the fence check takes an exclusive lock: on TiDB always, elsewhere when
    /// [`DbOptions::exclusive_fence`] asks for it.
    #[must_use]
    pub fn exclusive_fence(&self) -> bool {
        self.dialect == Dialect::Mysql && (self.tidb || self.exclusive_fence)
    }

    /// The pool, for reads.
    #[must_use]
    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// The URL this handle connected with, credentials included: for opening a dedicated
    /// connection (a PostgreSQL `LISTEN`). Never log it; use [`Db::url`].
    #[must_use]
    pub fn connect_url(&self) -> &str {
        &self.secret_url
    }

    /// The URL with any password hidden.
    #[must_use]
    pub fn url(&self) -> &str {
        &self.url_redacted
    }

    pub(crate) async fn acquire(&self) -> Result<PoolConnection<Any>, sqlx::Error> {
        self.pool.acquire().await
    }

    /// Closes the pool.
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// The dialect and connect options `url` names, without connecting: `sqlite:` (created when
/// missing), `postgres://` / `postgresql://`, `mysql://` / `mariadb://`. Every refusal is a
/// config error naming the URL with its credentials hidden. Also the URL as connected
/// (`mariadb://` spelled `mysql://`, SQLite's `mode=rwc`).
fn parse_url(url: &str) -> Result<(Dialect, AnyConnectOptions, String), DbError> {
    let shown = redact(url);
    let dialect = if url.starts_with("sqlite:") {
        Dialect::Sqlite
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Dialect::Postgres
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        Dialect::Mysql
    } else {
        return Err(DbError::config(format!(
            "unsupported database URL {shown:?}: expected sqlite://FILE, postgres://… or mysql://…"
        )));
    };
    let url = if let Some(rest) = url.strip_prefix("mariadb://") {
        format!("mysql://{rest}")
    } else if dialect == Dialect::Sqlite && !url.contains("mode=") {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}mode=rwc")
    } else {
        url.to_owned()
    };
    let connect_options = AnyConnectOptions::from_str(&url)
        .map_err(|e| DbError::config(format!("invalid database URL {shown:?}: {e}")))?
        .disable_statement_logging();
    Ok((dialect, connect_options, url))
}

/// Whether a `SELECT VERSION()` string is TiDB's (e.g. `8.0.11-TiDB-v7.5.0`).
#[must_use]
pub fn is_tidb_version(version: &str) -> bool {
    version.contains("TiDB")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cases per arbitrary-input property (`NEXUSCRM_PROPTEST_CASES`, 2,000 by default).
    fn arbitrary_cases() -> proptest::test_runner::Config {
        proptest::test_runner::Config::with_cases(crate::testing::arbitrary_case_count())
    }

    #[test]
    fn urls_name_their_dialect_and_unsupported_ones_are_refused() {
        sqlx::any::install_default_drivers();
        for (url, want) in [
            ("sqlite://x.db", Dialect::Sqlite),
            ("sqlite::memory:", Dialect::Sqlite),
            ("postgres://u:p@h:5432/d", Dialect::Postgres),
            ("postgresql://h/d", Dialect::Postgres),
            ("mysql://root@h:3306/d", Dialect::Mysql),
            ("mariadb://root@h/d", Dialect::Mysql),
        ] {
            assert_eq!(parse_url(url).map(|p| p.0).ok(), Some(want), "{url}");
        }
        let e = parse_url("redis://u:S3cret@h/0").unwrap_err().to_string();
        assert!(e.contains("unsupported database URL"), "{e}");
        assert!(!e.contains("S3cret"), "{e}");
    }

    proptest::proptest! {
        #![proptest_config(arbitrary_cases())]

        /// Any text as a database URL: a dialect or a clear refusal, never a panic, and a
        /// secret put in it never appears in the refusal.
        #[test]
        fn database_urls_never_panic_and_never_show_a_secret(
            scheme in "(sqlite:|sqlite://|postgres://|postgresql://|mysql://|mariadb://|[a-z]{0,8}://)",
            rest in "\\PC{0,60}",
            key in "(password|sslpassword|token)",
        ) {
            sqlx::any::install_default_drivers();
            let secret = "Zq9SecretZq9";
            for url in [
                format!("{scheme}{rest}"),
                format!("{scheme}u:{secret}@{rest}"),
                format!("{scheme}h/d?{key}={secret}&{rest}"),
            ] {
                if let Err(e) = parse_url(&url) {
                    let e = e.to_string();
                    proptest::prop_assert!(!e.contains(secret), "{}", e);
                    proptest::prop_assert!(e.contains("database URL"), "{}", e);
                }
            }
        }
    }
}
