//! Test support: an isolated database per test (feature `test-support`).
//!
//! SQLite gets its own file; PostgreSQL and MariaDB get their own database, created on the
//! server named by `NEXUSCRM_TEST_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`)
//! or `NEXUSCRM_TEST_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`). When a server is
//! unreachable, [`TestDb::create`] panics under CI (`CI` set) and otherwise returns `None` after a
//! loud message, so a developer without the service can still run the rest.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::{Executor, Row};

use crate::{Db, DbOptions, Dialect};

/// An isolated test database; call [`TestDb::drop_database`] at the end to clean up.
#[derive(Debug)]
pub struct TestDb {
    /// The open handle.
    pub db: Db,
    /// Its URL (for more handles, e.g. separate pools per worker).
    pub url: String,
    dialect: Dialect,
    admin_url: String,
    name: String,
}

fn unique(label: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let clean: String = label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(24)
        .collect();
    format!(
        "t_{clean}_{}_{}_{nanos:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let base = match base.rfind('/') {
        Some(i) if i > base.find("://").map_or(0, |j| j + 2) => &base[..i],
        _ => base,
    };
    match query {
        Some(q) => format!("{base}/{name}?{q}"),
        None => format!("{base}/{name}"),
    }
}

/// Drops test databases left by test processes that no longer run (a crashed or killed run
/// cannot clean up after itself). Names end in `_<pid>_<n>_<nanos>`; a live pid is never touched.
async fn purge_stale(admin: &Db, dialect: Dialect) {
    static DONE: [std::sync::atomic::AtomicBool; 3] =
        [const { std::sync::atomic::AtomicBool::new(false) }; 3];
    let slot = match dialect {
        Dialect::Sqlite => 0,
        Dialect::Postgres => 1,
        Dialect::Mysql => 2,
    };
    if DONE[slot].swap(true, Ordering::Relaxed) {
        return;
    }
    let list = match dialect {
        Dialect::Postgres => {
            "SELECT CAST(datname AS TEXT) FROM pg_database WHERE datname LIKE 't\\_%'"
        }
        _ => {
            "SELECT CAST(schema_name AS CHAR(255)) FROM information_schema.schemata WHERE schema_name LIKE 't\\_%'"
        }
    };
    let names = match sqlx::query(list).fetch_all(admin.pool()).await {
        Ok(rows) => rows
            .iter()
            .filter_map(|r| {
                r.try_get::<String, _>(0).ok().or_else(|| {
                    r.try_get::<Vec<u8>, _>(0)
                        .ok()
                        .and_then(|b| String::from_utf8(b).ok())
                })
            })
            .collect::<Vec<_>>(),
        Err(e) => {
            eprintln!("note: cannot list stale test databases: {e}");
            return;
        }
    };
    for name in names {
        let parts: Vec<&str> = name.rsplitn(4, '_').collect();
        let Some(pid) = parts.get(2).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid == std::process::id() || std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let sql = match dialect {
            Dialect::Postgres => format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            _ => format!("DROP DATABASE IF EXISTS {name}"),
        };
        let _ = admin.pool().execute(sql.as_str()).await;
    }
}

impl TestDb {
    /// Creates an isolated database of `dialect` for the test `label`.
    ///
    /// # Panics
    ///
    /// Under CI when the server is unreachable, or when creating the database fails.
    pub async fn create(dialect: Dialect, label: &str) -> Option<TestDb> {
        TestDb::create_with(dialect, label, DbOptions::default()).await
    }

    /// As [`TestDb::create`], with pool options.
    ///
    /// # Panics
    ///
    /// As [`TestDb::create`].
    pub async fn create_with(dialect: Dialect, label: &str, options: DbOptions) -> Option<TestDb> {
        TestDb::create_inner(dialect, label, options, "").await
    }

    /// A MySQL-dialect test database whose default character set is `latin1` with the
    /// server's case-insensitive collation: the tables a migration creates there must pin
    /// `utf8mb4` and a byte-exact collation themselves.
    ///
    /// # Panics
    ///
    /// As [`TestDb::create`].
    pub async fn create_latin1_mysql(label: &str, options: DbOptions) -> Option<TestDb> {
        TestDb::create_inner(
            Dialect::Mysql,
            label,
            options,
            " CHARACTER SET latin1 COLLATE latin1_swedish_ci",
        )
        .await
    }

    async fn create_inner(
        dialect: Dialect,
        label: &str,
        options: DbOptions,
        create_suffix: &str,
    ) -> Option<TestDb> {
        TestDb::create_at(dialect, None, label, options, create_suffix).await
    }

    async fn create_at(
        dialect: Dialect,
        server: Option<(&str, &str)>,
        label: &str,
        options: DbOptions,
        create_suffix: &str,
    ) -> Option<TestDb> {
        let name = unique(label);
        let admin_url = match dialect {
            _ if server.is_some() => server.map(|(url, _)| url.to_owned()).unwrap_or_default(),
            Dialect::Sqlite => {
                let dir = std::env::temp_dir().join("nexuscrm-tests");
                std::fs::create_dir_all(&dir).expect("create the SQLite test directory");
                let path = dir.join(format!("{name}.db"));
                let url = format!("sqlite://{}", path.display());
                let db = Db::connect_with(&url, options)
                    .await
                    .expect("open a SQLite test file");
                return Some(TestDb {
                    db,
                    url,
                    dialect,
                    admin_url: path.display().to_string(),
                    name,
                });
            }
            Dialect::Postgres => std::env::var("NEXUSCRM_TEST_POSTGRES_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into()),
            Dialect::Mysql => std::env::var("NEXUSCRM_TEST_MYSQL_URL")
                .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into()),
        };
        let admin = match Db::connect_with(&admin_url, DbOptions::default().max_connections(1))
            .await
        {
            Ok(db) => db,
            Err(e) => {
                let what = server.map_or_else(|| dialect.to_string(), |(_, w)| w.to_owned());
                if std::env::var_os("CI").is_some() {
                    panic!("{what} test server unavailable under CI: {e}");
                }
                let hint = match (server, dialect) {
                    (Some(_), _) => {
                        "Start it with scripts/galera.sh start, or set NEXUSCRM_TEST_GALERA_URLS"
                    }
                    (None, Dialect::Postgres) => "Start it, or set NEXUSCRM_TEST_POSTGRES_URL",
                    (None, _) => "Start it, or set NEXUSCRM_TEST_MYSQL_URL",
                };
                eprintln!(
                    "\n*** SKIPPING {label} on {what}: test server unavailable ({e}). \
                         {hint}. CI fails instead of skipping. ***\n"
                );
                return None;
            }
        };
        purge_stale(&admin, dialect).await;
        admin
            .pool()
            .execute(format!("CREATE DATABASE {name}{create_suffix}").as_str())
            .await
            .expect("create the test database");
        admin.close().await;
        let url = with_database(&admin_url, &name);
        let db = Db::connect_with(&url, options)
            .await
            .expect("open the test database");
        Some(TestDb {
            db,
            url,
            dialect,
            admin_url,
            name,
        })
    }

    /// Closes the pool and drops the database (or deletes the SQLite file).
    pub async fn drop_database(self) {
        self.db.close().await;
        match self.dialect {
            Dialect::Sqlite => {
                for suffix in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", self.admin_url));
                }
            }
            _ => {
                if let Ok(admin) =
                    Db::connect_with(&self.admin_url, DbOptions::default().max_connections(1)).await
                {
                    let sql = match self.dialect {
                        Dialect::Postgres => {
                            format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name)
                        }
                        _ => format!("DROP DATABASE IF EXISTS {}", self.name),
                    };
                    let _ = admin.pool().execute(sql.as_str()).await;
                    admin.close().await;
                }
            }
        }
    }
}

/// A TCP proxy in front of a database server that a test or the chaos suite can cut and
/// restore: a cut closes every open connection and black-holes new ones (accepted, never
/// answered, like a dead host); a restore frees them. Point a URL at [`CutProxy::port`]
/// instead of the server's.
#[derive(Debug)]
pub struct CutProxy {
    port: u16,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    epoch: std::sync::Arc<tokio::sync::watch::Sender<u64>>,
}

impl CutProxy {
    /// Listens on a free loopback port and forwards to `127.0.0.1:upstream`. Must run inside
    /// a tokio runtime, which carries its tasks.
    ///
    /// # Errors
    ///
    /// When no loopback port can be bound.
    pub async fn start(upstream: u16) -> std::io::Result<CutProxy> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (tx, _) = tokio::sync::watch::channel(0u64);
        let epoch = std::sync::Arc::new(tx);
        let (c, e) = (cut.clone(), epoch.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    continue;
                };
                let cut = c.clone();
                let mut changed = e.subscribe();
                tokio::spawn(async move {
                    if cut.load(Ordering::SeqCst) {
                        // Black hole: hold the connection, answer nothing.
                        let _ = changed.changed().await;
                        return;
                    }
                    let Ok(mut outbound) =
                        tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = changed.changed() => {}
                    }
                });
            }
        });
        Ok(CutProxy { port, cut, epoch })
    }

    /// The loopback port it listens on.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Cuts (`true`) or restores (`false`) the database; either way every open connection
    /// through the proxy ends.
    pub fn set_cut(&self, on: bool) {
        self.cut.store(on, Ordering::SeqCst);
        self.epoch.send_modify(|g| *g += 1);
    }

    /// `url` with its `:upstream/` port replaced by the proxy's, or `None` when `url` does not
    /// name that port.
    #[must_use]
    pub fn route(&self, url: &str, upstream: u16) -> Option<String> {
        let from = format!(":{upstream}/");
        url.contains(&from)
            .then(|| url.replacen(&from, &format!(":{}/", self.port), 1))
    }
}

/// Holds locks taken from a connection of its own until dropped (the connection is closed, so
/// the server releases them). See [`lock_tables_against_reads`] and [`lock_rows`].
pub struct ReadLock {
    _conn: sqlx::AnyConnection,
}

impl std::fmt::Debug for ReadLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReadLock")
    }
}

/// Locks `tables` from a connection of its own so that other sessions cannot even read them:
/// `LOCK TABLE … IN ACCESS EXCLUSIVE MODE` in a transaction on PostgreSQL, `LOCK TABLES … WRITE`
/// on MariaDB and MySQL. `Ok(None)` on SQLite, whose WAL readers never wait for a writer.
///
/// # Errors
///
/// When the connection or the lock fails.
pub async fn lock_tables_against_reads(
    db: &Db,
    tables: &[&str],
) -> Result<Option<ReadLock>, sqlx::Error> {
    let sql = match db.dialect() {
        Dialect::Sqlite => return Ok(None),
        Dialect::Postgres => format!("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE", tables.join(", ")),
        Dialect::Mysql => format!(
            "LOCK TABLES {}",
            tables
                .iter()
                .map(|t| format!("{t} WRITE"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    // Detached: dropping it closes the connection instead of returning it, locks held, to the
    // pool.
    let mut conn = db.pool().acquire().await?.detach();
    if db.dialect() == Dialect::Postgres {
        conn.execute("BEGIN").await?;
    }
    conn.execute(sql.as_str()).await?;
    Ok(Some(ReadLock { _conn: conn }))
}

/// Runs `locking_select` (for example `SELECT id FROM t FOR UPDATE`) in a transaction on a
/// connection of its own and holds the row locks it took until the guard is dropped, as
/// another replica's claim would.
///
/// # Errors
///
/// When the connection or the statement fails.
pub async fn lock_rows(db: &Db, locking_select: &str) -> Result<ReadLock, sqlx::Error> {
    let mut conn = db.pool().acquire().await?.detach();
    conn.execute("BEGIN").await?;
    conn.execute(locking_select).await?;
    Ok(ReadLock { _conn: conn })
}

/// Makes every insert into `table` fail with a real store error ("injected store error"), by
/// a trigger, until [`heal_inserts`]: a family's own attempt then meets the error a full disk
/// or a constraint would give it, inside its own transaction.
///
/// # Errors
///
/// When the trigger cannot be created.
pub async fn fail_inserts(db: &Db, table: &str) -> Result<(), sqlx::Error> {
    let name = format!("nexuscrm_fail_{table}");
    // Plain (unprepared) statements: MariaDB does not prepare CREATE TRIGGER.
    match db.dialect() {
        Dialect::Sqlite => {
            db.pool()
                .execute(
                    format!(
                        "CREATE TRIGGER {name} BEFORE INSERT ON {table} \
                         BEGIN SELECT RAISE(ABORT, 'injected store error'); END"
                    )
                    .as_str(),
                )
                .await?;
        }
        Dialect::Postgres => {
            db.pool()
                .execute(
                    format!(
                        "CREATE OR REPLACE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql \
                         AS $$ BEGIN RAISE EXCEPTION 'injected store error'; END $$"
                    )
                    .as_str(),
                )
                .await?;
            db.pool()
                .execute(
                    format!(
                        "CREATE TRIGGER {name} BEFORE INSERT ON {table} \
                         FOR EACH ROW EXECUTE FUNCTION {name}()"
                    )
                    .as_str(),
                )
                .await?;
        }
        Dialect::Mysql => {
            db.pool()
                .execute(
                    format!(
                        "CREATE TRIGGER {name} BEFORE INSERT ON {table} FOR EACH ROW \
                         SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'injected store error'"
                    )
                    .as_str(),
                )
                .await?;
        }
    }
    Ok(())
}

/// Undoes [`fail_inserts`].
///
/// # Errors
///
/// When the trigger cannot be dropped.
pub async fn heal_inserts(db: &Db, table: &str) -> Result<(), sqlx::Error> {
    let name = format!("nexuscrm_fail_{table}");
    let sql = match db.dialect() {
        Dialect::Postgres => format!("DROP TRIGGER IF EXISTS {name} ON {table}"),
        _ => format!("DROP TRIGGER IF EXISTS {name}"),
    };
    db.pool().execute(sql.as_str()).await?;
    Ok(())
}

/// Cases per arbitrary-input property test: `NEXUSCRM_PROPTEST_CASES` (the documented full run
/// uses 100,000), 2,000 by default (what CI runs).
#[must_use]
pub fn arbitrary_case_count() -> u32 {
    std::env::var("NEXUSCRM_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000)
}

/// Holds every stripe of the ownership fence in an open write transaction until the returned guard is
/// dropped (rolled back): every fenced claim, reconciliation and completion of any family then
/// blocks on it (on SQLite, the write lock blocks every writer). On SQLite a write cancelled a
/// moment ago may still hold the lock (sqlx finishes its queued statement on a worker thread),
/// so `BEGIN` is retried a few times.
///
/// # Errors
///
/// When no write transaction can be begun, or the fence stripes cannot be locked.
pub async fn hold_fence(db: &Db) -> Result<crate::WriteTx, sqlx::Error> {
    let mut tries = 0;
    let mut tx = loop {
        match db.begin_write().await {
            Ok(tx) => break tx,
            Err(e) if tries < 5 => {
                tries += 1;
                eprintln!("hold_fence: retrying after {e}");
            }
            Err(e) => return Err(e),
        }
    };
    sqlx::query("UPDATE runtime_work_fence_stripe SET generation = generation")
        .execute(tx.conn())
        .await?;
    Ok(tx)
}

/// The three-node Galera cluster of `scripts/galera.sh` (or `NEXUSCRM_TEST_GALERA_URLS`, three
/// comma-separated `mysql://` server URLs): one client URL per node.
#[must_use]
pub fn galera_servers() -> Vec<String> {
    match std::env::var("NEXUSCRM_TEST_GALERA_URLS") {
        Ok(v) if !v.trim().is_empty() => v.split(',').map(|u| u.trim().to_owned()).collect(),
        _ => (1..=3)
            .map(|n| format!("mysql://root@127.0.0.1:{}/test", 23306 + n))
            .collect(),
    }
}

/// An isolated database on the Galera cluster: created through node 1 (DDL replicates), with
/// its URL on every node.
#[derive(Debug)]
pub struct GaleraDb {
    /// The database through node 1 (dropped by [`GaleraDb::drop_database`]).
    pub test: TestDb,
    /// The database's URL on each node, node 1 first.
    pub nodes: Vec<String>,
}

impl GaleraDb {
    /// Creates the database, or `None` (after a loud message) when the cluster is not running
    /// outside CI.
    ///
    /// # Panics
    ///
    /// Under CI when the cluster is unreachable, or when creating the database fails.
    pub async fn create(label: &str) -> Option<GaleraDb> {
        let servers = galera_servers();
        let test = TestDb::create_at(
            Dialect::Mysql,
            Some((&servers[0], "the Galera cluster")),
            label,
            DbOptions::default(),
            "",
        )
        .await?;
        let nodes = servers
            .iter()
            .map(|s| with_database(s, &test.name))
            .collect();
        Some(GaleraDb { test, nodes })
    }

    /// Drops the database (through node 1).
    pub async fn drop_database(self) {
        self.test.drop_database().await;
    }

    /// A one-connection handle on node `i` (0-based) with causal reads
    /// (`wsrep_sync_wait = 1`): a read through it waits until the node has applied every write
    /// set the cluster committed before it, so a read-back after a run sees everything.
    ///
    /// # Panics
    ///
    /// When the node cannot be reached.
    pub async fn causal(&self, i: usize) -> Db {
        causal_reads(&self.nodes[i])
            .await
            .unwrap_or_else(|e| panic!("galera node {}: {e}", i + 1))
    }

    /// Certification failures and brute-force aborts so far, summed over the nodes that are up
    /// (`wsrep_local_cert_failures + wsrep_local_bf_aborts`): the conflicts that surfaced at
    /// COMMIT. Take it before and after a run; the difference is the run's.
    pub async fn conflicts(&self) -> i64 {
        let mut n = 0;
        for url in &self.nodes {
            let Ok(db) = Db::connect_with(url, DbOptions::default().max_connections(1)).await
            else {
                continue;
            };
            let rows: Vec<(String, String)> = sqlx::query_as(
                "SELECT VARIABLE_NAME, VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS \
                 WHERE VARIABLE_NAME IN ('WSREP_LOCAL_CERT_FAILURES', 'WSREP_LOCAL_BF_ABORTS')",
            )
            .fetch_all(db.pool())
            .await
            .unwrap_or_default();
            n += rows
                .iter()
                .map(|(_, v)| v.parse::<i64>().unwrap_or(0))
                .sum::<i64>();
            db.close().await;
        }
        n
    }
}

/// A one-connection handle on the Galera node at `url` whose reads are causal
/// (`wsrep_sync_wait = 1`): each waits until the node has applied every write set the cluster
/// committed before it.
///
/// # Errors
///
/// When the node cannot be reached or refuses the setting.
pub async fn causal_reads(url: &str) -> Result<Db, crate::DbError> {
    let db = Db::connect_with(url, DbOptions::default().max_connections(1)).await?;
    if let Err(e) = sqlx::query("SET SESSION wsrep_sync_wait = 1")
        .execute(db.pool())
        .await
    {
        db.close().await;
        return Err(crate::DbError::sql("wsrep_sync_wait", e));
    }
    Ok(db)
}

/// Whether the Galera cluster is the one `scripts/galera.sh` runs on this machine (its nodes
/// can be killed and restarted), rather than an external one named by
/// `NEXUSCRM_TEST_GALERA_URLS`. A test that kills a node skips, loudly, when it is not.
#[must_use]
pub fn galera_nodes_are_local() -> bool {
    if std::env::var("NEXUSCRM_TEST_GALERA_URLS").is_ok_and(|v| !v.trim().is_empty()) {
        eprintln!(
            "SKIPPED: NEXUSCRM_TEST_GALERA_URLS names an external cluster; a node-loss test \
             kills and restarts a node of the scripts/galera.sh cluster only"
        );
        return false;
    }
    true
}

fn galera_script(command: &str, node: u32) {
    let script =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/galera.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .arg(command)
        .arg(node.to_string())
        .output()
        .unwrap_or_else(|e| panic!("bash {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "galera.sh {command} {node}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A node of the `scripts/galera.sh` cluster killed with `kill -9` (its `mariadbd` gets no
/// chance to close anything). [`KilledNode::restart`] rejoins it; dropping the guard while the
/// node is still down (a test that ends or panics early) rejoins it too, so the cluster is
/// whole again for whatever runs next. Both block for seconds: call them from
/// `spawn_blocking`.
#[derive(Debug)]
pub struct KilledNode {
    node: u32,
    down: bool,
}

impl KilledNode {
    /// Kills node `node` (1 to 3) and returns once its process is gone.
    ///
    /// # Panics
    ///
    /// When the script fails.
    #[must_use]
    pub fn kill(node: u32) -> KilledNode {
        galera_script("kill-node", node);
        KilledNode { node, down: true }
    }

    /// Restarts the node and returns once it has rejoined the cluster (synced).
    ///
    /// # Panics
    ///
    /// When the script fails.
    pub fn restart(mut self) {
        self.down = false;
        galera_script("restart-node", self.node);
    }
}

impl Drop for KilledNode {
    fn drop(&mut self) {
        if std::mem::take(&mut self.down) {
            galera_script("restart-node", self.node);
        }
    }
}

/// A worker process and its supervisor on one Galera node, as a node-loss test needs them:
/// `run` builds a family and a controller on a fresh pool to `url` and runs it until `cancel`;
/// when it stops, the stop's kind is recorded and it is started again on a fresh pool once the
/// node answers (the Runtime Worker's process supervisor does the same by exiting and being
/// restarted). While `hold` is set (the node is being killed) it does not reconnect. Returns
/// every stop's kind once `cancel` fires.
///
/// # Panics
///
/// After 200 stops: a worker that keeps stopping is a failure, not a supervisor's job.
pub async fn supervise_on_node<F, Fut>(
    url: String,
    hold: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    cancel: tokio_util::sync::CancellationToken,
    mut run: F,
) -> Vec<nexuscrm_worker::RunErrorKind>
where
    F: FnMut(Db, tokio_util::sync::CancellationToken) -> Fut,
    Fut: std::future::Future<Output = Result<(), nexuscrm_worker::RunErrorKind>>,
{
    let mut stops = Vec::new();
    while !cancel.is_cancelled() {
        if hold.as_ref().is_some_and(|h| h.load(Ordering::SeqCst)) {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        }
        let Ok(db) = Db::connect(&url).await else {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        if let Err(kind) = run(db.clone(), cancel.clone()).await {
            stops.push(kind);
        }
        db.close().await;
        assert!(
            stops.len() < 200,
            "{url}: the worker keeps stopping: {stops:?}"
        );
    }
    stops
}

/// Whether a `dialect` server is reachable for tests (an isolated database is created and
/// dropped again). Under CI an unreachable server panics, as in [`TestDb::create`]; otherwise
/// the message is printed and `false` returned, so the caller skips.
pub async fn available(dialect: Dialect) -> bool {
    match TestDb::create(dialect, "probe").await {
        Some(t) => {
            t.drop_database().await;
            true
        }
        None => false,
    }
}

/// [`available`] from synchronous code (a crash matrix drives its own runtimes).
///
/// # Panics
///
/// When no tokio runtime can be started.
#[must_use]
pub fn available_blocking(dialect: Dialect) -> bool {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime for the availability probe")
        .block_on(available(dialect))
}

/// Whether the Galera cluster is reachable (as [`available_blocking`], through
/// [`GaleraDb::create`]).
///
/// # Panics
///
/// As [`available_blocking`].
#[must_use]
pub fn galera_available_blocking() -> bool {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime for the availability probe")
        .block_on(async {
            match GaleraDb::create("probe").await {
                Some(g) => {
                    g.drop_database().await;
                    true
                }
                None => false,
            }
        })
}

/// A worker's own handle on `url`, as a separate process would have: its own pool, with 20 s of
/// SQLite busy time (a killed worker's last statement may still be finishing on its connection
/// thread when the next one starts).
///
/// # Errors
///
/// When the database cannot be opened.
pub async fn worker_db(url: &str) -> Result<Db, crate::DbError> {
    Db::connect_with(
        url,
        DbOptions::default().busy_timeout(std::time::Duration::from_secs(20)),
    )
    .await
}

/// The tables every family's reads touch besides its own: the ownership fence and the schema
/// versions.
pub const SHARED_TABLES: &[&str] = &[
    "runtime_work_fence",
    "runtime_work_fence_stripe",
    "runtime_work_signal",
    "runtime_work_ownership",
    "nexuscrm_schema",
];

/// [`lock_tables_against_reads`] of a family's own `tables` and the [`SHARED_TABLES`]: every
/// read the family makes then waits.
///
/// # Errors
///
/// As [`lock_tables_against_reads`].
pub async fn lock_family_against_reads(
    db: &Db,
    tables: &[&str],
) -> Result<Option<ReadLock>, sqlx::Error> {
    let all: Vec<&str> = tables.iter().chain(SHARED_TABLES).copied().collect();
    lock_tables_against_reads(db, &all).await
}

/// The conformance scenarios (by name) that cannot apply to a family on `dialect`, whatever the
/// family: SQLite in WAL mode never makes a reader wait, so reads cannot be blocked, and its
/// claim waits for the write lock rather than skipping a held row (no overdue suppression to
/// observe); the MySQL dialect's claim waits on a held row too (no `SKIP LOCKED` on TiDB).
#[must_use]
pub fn scenarios_not_applicable(dialect: Dialect) -> &'static [&'static str] {
    match dialect {
        Dialect::Sqlite => &["cancellation-of-blocked-reads", "overdue-suppression"],
        Dialect::Mysql => &["overdue-suppression"],
        Dialect::Postgres => &[],
    }
}

/// The MySQL-dialect plan of `select`, one line per table (`table type=… key=… rows=…`), and
/// the index each table is read through (`None`: a full scan). For proving that a statement is an
/// index lookup.
///
/// # Errors
///
/// When `EXPLAIN` fails.
pub async fn explain_mysql(
    db: &Db,
    select: &str,
) -> Result<(Vec<String>, Vec<Option<String>>), sqlx::Error> {
    let rows = sqlx::query(&format!("EXPLAIN {select}"))
        .fetch_all(db.pool())
        .await?;
    let mut lines = Vec::new();
    let mut keys = Vec::new();
    for r in rows {
        let col = |name: &str| -> Option<String> {
            r.try_get::<Option<String>, _>(name)
                .ok()
                .flatten()
                .or_else(|| {
                    r.try_get::<Option<Vec<u8>>, _>(name)
                        .ok()
                        .flatten()
                        .map(|b| String::from_utf8_lossy(&b).into_owned())
                })
        };
        let rows_est = r
            .try_get::<Option<i64>, _>("rows")
            .ok()
            .flatten()
            .map_or_else(|| col("rows").unwrap_or_default(), |n| n.to_string());
        let key = col("key");
        lines.push(format!(
            "{} type={} key={} rows={} {}",
            col("table").unwrap_or_default(),
            col("type").unwrap_or_default(),
            key.as_deref().unwrap_or("NULL"),
            rows_est,
            col("Extra").unwrap_or_default()
        ));
        keys.push(key);
    }
    Ok((lines, keys))
}
