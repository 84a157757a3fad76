//! The chaos suite: the real Runtime Worker binary under `kill -9` cycles, a producer that is
//! itself killed mid-submit and retried with the same key, a pauser whose resumes are killed
//! and retried, optional database outages, then a clean drain, verified in SQL on the store and
//! against the record of the suite's own effect receiver (Paused Flow).
//!
//! ```text
//! cargo build --release -p nexuscrm-runtime-worker -p nexuscrm-chaos
//! target/release/nexuscrm-chaos --backend postgres --cycles 1000 --outages
//! ```
//!
//! Each run gets its own database (a fresh SQLite file, or a fresh PostgreSQL / MariaDB
//! database on the servers `nexuscrm_persistence::testing` names), dropped at the end unless
//! `--keep` is given. Exit 0 when every check holds, 1 when any anomaly was found (each is
//! printed), 2 when the suite itself could not run.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use nexuscrm_persistence::support::text;
use nexuscrm_persistence::testing::{CutProxy, TestDb};
use nexuscrm_persistence::{Db, Dialect, sqlx};

#[derive(Parser, Debug)]
#[command(name = "nexuscrm-chaos", about = "The NexusCRM chaos suite", version)]
struct Args {
    /// The store: sqlite, postgres or mysql (MariaDB).
    #[arg(long)]
    backend: String,
    /// Worker kills (kill -9) before the clean drain, over two workers.
    #[arg(long, default_value_t = 30)]
    cycles: u64,
    /// Cut the database (through a TCP proxy) for 0.3-1.5 s every 2-6 s while the workers run
    /// (PostgreSQL and MariaDB only).
    #[arg(long)]
    outages: bool,
    /// Random seed (printed; the same seed repeats the same schedule of lifetimes).
    #[arg(long)]
    seed: Option<u64>,
    /// The Runtime Worker binary (default: `nexuscrm-runtime-worker` beside this one).
    #[arg(long)]
    worker: Option<PathBuf>,
    /// Keep the database and the worker logs, and print where they are.
    #[arg(long)]
    keep: bool,
    /// Bound of the clean drain, in seconds.
    #[arg(long, default_value_t = 300)]
    drain_timeout_secs: u64,
}

/// xorshift64*: a small, seedable generator (the suite needs repeatable lifetimes, not
/// cryptographic randomness).
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `lo..=hi`.
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// What the run phase counted.
#[derive(Debug, Default)]
struct Counts {
    kills: AtomicU64,
    self_exits: AtomicU64,
    fail_stops: AtomicU64,
    producer_kills: AtomicU64,
    submits: AtomicU64,
    outages: AtomicU64,
    resume_kills: AtomicU64,
    orphan_creates: AtomicU64,
}

/// The jobs the producer saw acknowledged (exit 0), by key, with their row counts.
type Acknowledged = Arc<Mutex<BTreeMap<String, u64>>>;

/// Resumes the CLI acknowledged (exit 0): pause id, and the payload sent.
type Resumes = Arc<Mutex<BTreeMap<i64, String>>>;

/// How long each chaos pause waits for its resume; one in eight is never resumed and runs its
/// effect when this passes.
const PAUSE_TIMEOUT: &str = "20s";

const SEGMENT: u64 = 25;
/// The schedules every run creates: name, CLI definition, interval in ms.
const SCHEDULES: [(&str, &[&str], i64); 2] = [
    (
        "chaos-every-1s",
        &[
            "--every",
            "1s",
            "--policy",
            "catch-up",
            "--catch-up-max",
            "1000",
        ],
        1_000,
    ),
    (
        "chaos-cron-2s",
        &[
            "--cron",
            "*/2 * * * * *",
            "--policy",
            "catch-up",
            "--catch-up-max",
            "1000",
        ],
        2_000,
    ),
];

fn main() -> ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(run(args)) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Runs the suite; the number of anomalies found.
async fn run(args: Args) -> Result<usize, String> {
    let dialect = match args.backend.as_str() {
        "sqlite" => Dialect::Sqlite,
        "postgres" | "postgresql" => Dialect::Postgres,
        "mysql" | "mariadb" => Dialect::Mysql,
        other => {
            return Err(format!(
                "unknown backend {other:?}: sqlite, postgres or mysql"
            ));
        }
    };
    if args.outages && dialect == Dialect::Sqlite {
        return Err("--outages needs a server (postgres or mysql): SQLite is a file".into());
    }
    if args.cycles == 0 {
        return Err("--cycles must be at least 1".into());
    }
    let worker = match &args.worker {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .map_err(|e| format!("cannot find this binary: {e}"))?
            .with_file_name("nexuscrm-runtime-worker"),
    };
    if !worker.exists() {
        return Err(format!(
            "no Runtime Worker at {}: build it first (cargo build -p nexuscrm-runtime-worker), \
             or pass --worker PATH",
            worker.display()
        ));
    }
    let seed = args.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            | 1
    });
    let t = TestDb::create(dialect, "chaos").await.ok_or_else(|| {
        format!(
            "no {} server reachable (see the message above)",
            args.backend
        )
    })?;
    let logs = std::env::temp_dir().join(format!("nexuscrm-chaos-{}", std::process::id()));
    std::fs::create_dir_all(&logs).map_err(|e| format!("{}: {e}", logs.display()))?;
    println!(
        "chaos {}: seed {seed}, {} cycles{}, logs in {}",
        args.backend,
        args.cycles,
        if args.outages { ", with outages" } else { "" },
        logs.display()
    );
    let upstream = match dialect {
        Dialect::Postgres => 5432,
        Dialect::Mysql => 3306,
        Dialect::Sqlite => 0,
    };
    let proxy = if args.outages {
        Some(
            CutProxy::start(upstream)
                .await
                .map_err(|e| format!("cannot start the outage proxy: {e}"))?,
        )
    } else {
        None
    };
    let worker_url = match &proxy {
        Some(p) => p
            .route(&t.url, upstream)
            .ok_or_else(|| format!("the test URL does not name port {upstream}"))?,
        None => t.url.clone(),
    };
    let receiver = Receiver::start()
        .await
        .map_err(|e| format!("cannot start the effect receiver: {e}"))?;
    let ctx = Ctx {
        worker,
        url: t.url.clone(),
        logs: logs.clone(),
        connector: receiver.url.clone(),
    };
    let started = Instant::now();
    ctx.cli(&["migrate"])?;
    for (name, def, _) in SCHEDULES {
        let mut a = vec!["schedule", "create", name, "--flow", "chaos"];
        a.extend_from_slice(def);
        ctx.cli(&a)?;
    }

    // The run phase: two workers killed at random, a producer killed at random, outages.
    let counts = Arc::new(Counts::default());
    let acknowledged: Acknowledged = Arc::default();
    let resumes: Resumes = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut rng = Rng(seed);
    let mut threads = Vec::new();
    for slot in 0..2u64 {
        let (ctx, counts, stop) = (ctx.clone(), counts.clone(), stop.clone());
        let url = worker_url.clone();
        let mut rng = Rng(rng.next() | 1);
        let cycles = args.cycles;
        threads.push(std::thread::spawn(move || {
            killer(&ctx, &url, slot, cycles, &mut rng, &counts, &stop);
        }));
    }
    let producer = {
        let (ctx, counts, stop, ack) = (
            ctx.clone(),
            counts.clone(),
            stop.clone(),
            acknowledged.clone(),
        );
        let url = worker_url.clone();
        let mut rng = Rng(rng.next() | 1);
        std::thread::spawn(move || producer(&ctx, &url, &mut rng, &counts, &stop, &ack))
    };
    let pauser = {
        let (ctx, counts, stop, resumed) =
            (ctx.clone(), counts.clone(), stop.clone(), resumes.clone());
        let url = worker_url.clone();
        let mut rng = Rng(rng.next() | 1);
        std::thread::spawn(move || pauser(&ctx, &url, &mut rng, &counts, &stop, &resumed))
    };
    let mut outage_rng = Rng(rng.next() | 1);
    while threads.iter().any(|t| !t.is_finished()) {
        if let Some(p) = &proxy {
            tokio::time::sleep(Duration::from_millis(outage_rng.between(2_000, 6_000))).await;
            if threads.iter().all(|t| t.is_finished()) {
                break;
            }
            p.set_cut(true);
            counts.outages.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(outage_rng.between(300, 1_500))).await;
            p.set_cut(false);
        } else {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        let _ = t.join();
    }
    let _ = producer.join();
    let _ = pauser.join();
    let run_phase = started.elapsed();

    // The clean drain: one worker, direct to the store, until every job is terminal and every
    // schedule has caught up; then SIGTERM, which must exit 0.
    let mut drain = ctx.spawn_worker(&t.url, "drain")?;
    let drained = wait_drained(&t.db, Duration::from_secs(args.drain_timeout_secs)).await;
    // Pause the schedules first so their cursors stop moving before the check.
    for (name, _, _) in SCHEDULES {
        ctx.cli(&["schedule", "pause", name])?;
    }
    let stopped = terminate(&mut drain, Duration::from_secs(60));
    let mut anomalies = Vec::new();
    if let Err(e) = drained {
        anomalies.push(e);
    }
    if let Err(e) = stopped {
        anomalies.push(format!("the drain worker: {e}"));
    }
    let acknowledged = acknowledged
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let v = verify(&t.db, &acknowledged).await?;
    anomalies.extend(v.anomalies.iter().cloned());
    let resumes = resumes.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let p = verify_paused(&t.db, &resumes, &receiver.received()).await?;
    anomalies.extend(p.anomalies.iter().cloned());
    let panics = count_in_logs(&logs, "panicked");
    if panics > 0 {
        anomalies.push(format!("{panics} worker panic(s) in the logs"));
    }
    let c = &counts;
    println!(
        "chaos {}: {} worker kills ({} self-exits, {} fail-stops), {} producer kills, {} submits, \
         {} outages over {:.0} s; {} jobs ({} acknowledged), {} rows applied, {} schedule runs; \
         anomalies {} (lost {}, duplicated {}, poisoned {}, unterminated {}, occurrence gaps {}, \
         panics {panics}); total {:.0} s",
        args.backend,
        c.kills.load(Ordering::Relaxed),
        c.self_exits.load(Ordering::Relaxed),
        c.fail_stops.load(Ordering::Relaxed),
        c.producer_kills.load(Ordering::Relaxed),
        c.submits.load(Ordering::Relaxed),
        c.outages.load(Ordering::Relaxed),
        run_phase.as_secs_f64(),
        v.jobs,
        v.acknowledged,
        v.rows,
        v.runs,
        anomalies.len(),
        v.lost,
        v.duplicated,
        v.poisoned,
        v.unterminated,
        v.gaps,
        started.elapsed().as_secs_f64(),
    );
    println!(
        "  paused flow: {} pauses ({} created by a killed or refused create, {} resumes \
         acknowledged, {} resume kills), {} effects received; {} completed, {} uncertain ({} of \
         them received: a kill after the send), {} timed out unresumed; anomalies: {} effects \
         delivered twice, {} completed without delivery, {} unterminated, {} resumes lost",
        p.pauses,
        c.orphan_creates.load(Ordering::Relaxed),
        p.acknowledged,
        c.resume_kills.load(Ordering::Relaxed),
        p.received,
        p.completed,
        p.uncertain,
        p.uncertain_received,
        p.timed_out,
        p.delivered_twice,
        p.phantom,
        p.unterminated,
        p.lost,
    );
    for a in &anomalies {
        println!("  anomaly: {a}");
    }
    if args.keep || !anomalies.is_empty() {
        println!("  kept: database {}, logs {}", t.url, logs.display());
    } else {
        t.drop_database().await;
        let _ = std::fs::remove_dir_all(&logs);
    }
    Ok(anomalies.len())
}

/// How to start the binary, where it writes.
#[derive(Debug, Clone)]
struct Ctx {
    worker: PathBuf,
    url: String,
    logs: PathBuf,
    /// The Paused Flow connector: the suite's own effect receiver.
    connector: String,
}

impl Ctx {
    fn command(&self, url: &str) -> Command {
        let mut c = Command::new(&self.worker);
        c.args(["--database-url", url])
            .env_remove("NEXUSCRM_DATABASE_URL")
            .stdin(Stdio::null());
        c
    }

    /// Runs a CLI command to completion on the direct URL.
    fn cli(&self, args: &[&str]) -> Result<String, String> {
        let out = self
            .command(&self.url)
            .args(args)
            .output()
            .map_err(|e| format!("cannot run {}: {e}", self.worker.display()))?;
        if !out.status.success() {
            return Err(format!(
                "`{}` failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Starts `run` with short leases, its stderr appended to `logs/<name>.log`.
    fn spawn_worker(&self, url: &str, name: &str) -> Result<Child, String> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.logs.join(format!("{name}.log")))
            .map_err(|e| format!("cannot open the {name} log: {e}"))?;
        self.command(url)
            .args([
                "run",
                "--admin-addr",
                "127.0.0.1:0",
                "--bulk-lease-secs",
                "0.5",
                "--shutdown-timeout-secs",
                "10",
            ])
            .env("NEXUSCRM_FLOW_LEASE_SECS", "0.5")
            .env("NEXUSCRM_PAUSED_CONNECTOR_URL", &self.connector)
            .env("NEXUSCRM_PAUSED_CONNECTOR_TIMEOUT_SECS", "0.5")
            .env("NEXUSCRM_PAUSED_LEASE_SECS", "1")
            .env("NEXUSCRM_PAUSED_GENERATION_POLL_SECS", "1")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.worker.display()))
    }
}

/// One worker slot: start, live 50-1500 ms, kill -9; until `cycles` kills in all.
fn killer(
    ctx: &Ctx,
    url: &str,
    slot: u64,
    cycles: u64,
    rng: &mut Rng,
    c: &Counts,
    stop: &AtomicBool,
) {
    let name = format!("worker-{}", ["a", "b"][slot as usize % 2]);
    while !stop.load(Ordering::SeqCst) && c.kills.load(Ordering::SeqCst) < cycles {
        let Ok(mut child) = ctx.spawn_worker(url, &name) else {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        };
        std::thread::sleep(Duration::from_millis(rng.between(50, 1_500)));
        match child.try_wait() {
            Ok(Some(status)) => {
                // It stopped by itself (a fail-stop during an outage exits 2).
                c.self_exits.fetch_add(1, Ordering::Relaxed);
                if status.code() == Some(2) {
                    c.fail_stops.fetch_add(1, Ordering::Relaxed);
                }
            }
            _ => {
                let _ = child.kill(); // SIGKILL: no drain, no cleanup.
                let _ = child.wait();
                c.kills.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
}

/// Submits jobs of 50-400 sample rows; half the submits are killed after 0-80 ms and retried
/// with the same key until one exits 0 (acknowledged).
fn producer(
    ctx: &Ctx,
    url: &str,
    rng: &mut Rng,
    c: &Counts,
    stop: &AtomicBool,
    ack: &Acknowledged,
) {
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let key = format!("chaos-{n}");
        let rows = rng.between(50, 400);
        loop {
            let spawned = ctx
                .command(url)
                .args(["bulk", "submit", "--key", &key, "--sample"])
                .arg(rows.to_string())
                .args(["--segment-size", &SEGMENT.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let Ok(mut child) = spawned else {
                std::thread::sleep(Duration::from_millis(100));
                continue;
            };
            c.submits.fetch_add(1, Ordering::Relaxed);
            if rng.next().is_multiple_of(2) {
                std::thread::sleep(Duration::from_millis(rng.between(0, 80)));
                if matches!(child.try_wait(), Ok(None)) {
                    let _ = child.kill();
                    c.producer_kills.fetch_add(1, Ordering::Relaxed);
                }
            }
            match child.wait() {
                Ok(s) if s.success() => {
                    ack.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(key.clone(), rows);
                    break;
                }
                // Killed, or refused during an outage: the same key again. Once stopped, an
                // unacknowledged key is left as it is (accepted or not, the checks cover it).
                _ if stop.load(Ordering::SeqCst) => return,
                _ => std::thread::sleep(Duration::from_millis(rng.between(0, 50))),
            }
        }
        n += 1;
        std::thread::sleep(Duration::from_millis(rng.between(50, 250)));
    }
}

/// Pauses runs and resumes them through the CLI; half the resumes are killed after 0-80 ms and
/// retried with the same token and payload until one exits 0 (acknowledged). One pause in
/// eight is left to time out.
fn pauser(ctx: &Ctx, url: &str, rng: &mut Rng, c: &Counts, stop: &AtomicBool, resumed: &Resumes) {
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let run = format!("chaos-run-{n}");
        let payload = format!("{{\"n\":{n}}}");
        let created = loop {
            let out = ctx
                .command(url)
                .args([
                    "pause",
                    "create",
                    &run,
                    "charge",
                    "--timeout",
                    PAUSE_TIMEOUT,
                ])
                .args(["--payload", &payload])
                .output();
            match out {
                Ok(o) if o.status.success() => {
                    let text = String::from_utf8_lossy(&o.stdout).into_owned();
                    let mut lines = text.lines();
                    let id = lines.next().and_then(|l| l.trim().parse::<i64>().ok());
                    let token = lines.next().map(|l| l.trim().to_owned());
                    break id.zip(token);
                }
                // A create refused during an outage whose commit did land: its token never
                // reached us, so it times out and runs its effect then.
                Ok(o) if String::from_utf8_lossy(&o.stderr).contains("already paused") => {
                    c.orphan_creates.fetch_add(1, Ordering::Relaxed);
                    break None;
                }
                _ if stop.load(Ordering::SeqCst) => return,
                _ => std::thread::sleep(Duration::from_millis(rng.between(20, 100))),
            }
        };
        if let Some((id, token)) = created
            && !rng.next().is_multiple_of(8)
        {
            let answer = format!("{{\"ok\":{n}}}");
            loop {
                let spawned = ctx
                    .command(url)
                    .args(["pause", "resume", &token, "--payload", &answer])
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn();
                let Ok(mut child) = spawned else {
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                };
                if rng.next().is_multiple_of(2) {
                    std::thread::sleep(Duration::from_millis(rng.between(0, 80)));
                    if matches!(child.try_wait(), Ok(None)) {
                        let _ = child.kill();
                        c.resume_kills.fetch_add(1, Ordering::Relaxed);
                    }
                }
                match child.wait_with_output() {
                    Ok(o) if o.status.success() => {
                        resumed
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .insert(id, answer);
                        break;
                    }
                    // Timed out before a resume got through (a long outage): it runs anyway.
                    Ok(o) if String::from_utf8_lossy(&o.stderr).contains("timed out") => break,
                    _ if stop.load(Ordering::SeqCst) => return,
                    _ => std::thread::sleep(Duration::from_millis(rng.between(0, 50))),
                }
            }
        }
        n += 1;
        std::thread::sleep(Duration::from_millis(rng.between(20, 120)));
    }
}

/// The Paused Flow connector's receiver: answers 200 to every effect and records each
/// `Idempotency-Key` it received. One effect in ten takes 300 ms, so kills land mid-effect.
struct Receiver {
    url: String,
    seen: Arc<Mutex<HashMap<String, u32>>>,
}

impl Receiver {
    async fn start() -> std::io::Result<Receiver> {
        let seen: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
        let record = seen.clone();
        let app = axum::Router::new().route(
            "/effect",
            axum::routing::post(move |headers: axum::http::HeaderMap| {
                let record = record.clone();
                async move {
                    let key = headers
                        .get("idempotency-key")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned();
                    let slow = key
                        .bytes()
                        .fold(0u32, |a, b| a.wrapping_mul(31).wrapping_add(u32::from(b)))
                        .is_multiple_of(10);
                    *record
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry(key)
                        .or_default() += 1;
                    tokio::time::sleep(Duration::from_millis(if slow { 300 } else { 5 })).await;
                    "applied"
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/effect", listener.local_addr()?);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Receiver { url, seen })
    }

    /// Requests received, by idempotency key.
    fn received(&self) -> HashMap<String, u32> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// What the Paused Flow store and the receiver say after the drain.
#[derive(Debug, Default)]
struct PausedVerified {
    pauses: usize,
    acknowledged: usize,
    received: usize,
    completed: usize,
    uncertain: usize,
    uncertain_received: usize,
    timed_out: usize,
    delivered_twice: usize,
    phantom: usize,
    unterminated: usize,
    lost: usize,
    anomalies: Vec<String>,
}

/// Every pause terminal (`completed` or `uncertain`: the receiver never refuses), no effect
/// received twice (nobody asked for a retry), none completed without being received, none
/// received that the store does not know, every acknowledged resume stored with its payload.
async fn verify_paused(
    db: &Db,
    resumes: &BTreeMap<i64, String>,
    received: &HashMap<String, u32>,
) -> Result<PausedVerified, String> {
    use sqlx::Row;
    let err = |e: sqlx::Error| format!("reading the paused steps: {e}");
    let rows =
        sqlx::query("SELECT id, state, effect_key, resume_payload, resumed_at FROM paused_step")
            .fetch_all(db.pool())
            .await
            .map_err(err)?;
    let mut v = PausedVerified {
        pauses: rows.len(),
        acknowledged: resumes.len(),
        received: received.values().map(|&n| n as usize).sum(),
        ..PausedVerified::default()
    };
    let mut keys = std::collections::HashSet::new();
    let mut stored = HashMap::new();
    for r in &rows {
        let id: i64 = r.try_get(0).map_err(err)?;
        let state = text(r, 1).map_err(err)?;
        let key = text(r, 2).map_err(err)?;
        let payload = text(r, 3).ok();
        let resumed_at: Option<i64> = r.try_get(4).map_err(err)?;
        let times = received.get(&key).copied().unwrap_or(0);
        match state.as_str() {
            "completed" if times == 0 => {
                v.completed += 1;
                v.phantom += 1;
                v.anomalies.push(format!(
                    "pause {id} completed, but its effect was never received"
                ));
            }
            "completed" => v.completed += 1,
            "uncertain" => {
                v.uncertain += 1;
                if times > 0 {
                    v.uncertain_received += 1;
                }
            }
            other => {
                v.unterminated += 1;
                v.anomalies
                    .push(format!("pause {id} is {other}, not completed or uncertain"));
            }
        }
        if resumed_at.is_none() && matches!(state.as_str(), "completed" | "uncertain") {
            v.timed_out += 1;
        }
        if times > 1 {
            v.delivered_twice += 1;
            v.anomalies.push(format!(
                "pause {id}: its effect was received {times} times (no retry was asked for)"
            ));
        }
        keys.insert(key);
        stored.insert(id, payload);
    }
    for key in received.keys() {
        if !keys.contains(key) {
            v.anomalies
                .push(format!("an effect with unknown key {key:?} was received"));
        }
    }
    for (id, sent) in resumes {
        match stored.get(id) {
            Some(Some(p)) if p == sent => {}
            other => {
                v.lost += 1;
                v.anomalies.push(format!(
                    "pause {id}: resume {sent} acknowledged, stored {other:?}"
                ));
            }
        }
    }
    Ok(v)
}

/// SIGTERM, then the exit status within `within`: 0 is a clean stop.
fn terminate(child: &mut Child, within: Duration) -> Result<(), String> {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + within;
    loop {
        match child.try_wait() {
            Ok(Some(s)) if s.success() => return Ok(()),
            Ok(Some(s)) => return Err(format!("SIGTERM exited {s}, not 0")),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no exit {within:?} after SIGTERM"));
            }
        }
    }
}

async fn scalar(db: &Db, sql: &str) -> Result<i64, String> {
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(db.pool())
        .await
        .map_err(|e| format!("{sql}: {e}"))
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Until no job is pending or running and every schedule's next occurrence is in the future.
async fn wait_drained(db: &Db, within: Duration) -> Result<(), String> {
    let deadline = Instant::now() + within;
    loop {
        let open = scalar(
            db,
            "SELECT COUNT(*) FROM bulk_job WHERE state IN ('pending', 'running')",
        )
        .await?;
        let pauses = scalar(
            db,
            "SELECT COUNT(*) FROM paused_step \
             WHERE state IN ('paused', 'resumable', 'timed_out', 'leased', 'observing')",
        )
        .await?;
        let behind = scalar(
            db,
            &format!(
                "SELECT COUNT(*) FROM flow_schedule WHERE state = 'active' \
                 AND next_occurrence_at < {}",
                now_ms() - 1_000
            ),
        )
        .await?;
        if open == 0 && behind == 0 && pauses == 0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "not drained within {within:?}: {open} job(s) open, {behind} schedule(s) \
                 behind, {pauses} pause(s) open"
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the store says after the drain.
#[derive(Debug, Default)]
struct Verified {
    jobs: usize,
    acknowledged: usize,
    rows: i64,
    runs: usize,
    lost: usize,
    duplicated: i64,
    poisoned: usize,
    unterminated: usize,
    gaps: usize,
    anomalies: Vec<String>,
}

/// The checks, in SQL on the store.
async fn verify(db: &Db, acknowledged: &BTreeMap<String, u64>) -> Result<Verified, String> {
    let mut v = Verified {
        acknowledged: acknowledged.len(),
        ..Verified::default()
    };
    let err = |e: sqlx::Error| format!("reading the store: {e}");
    let jobs = sqlx::query(
        "SELECT idempotency_key, state, total_rows, applied_rows, rejected_rows, last_error \
         FROM bulk_job",
    )
    .fetch_all(db.pool())
    .await
    .map_err(err)?;
    let mut stored = HashMap::new();
    let mut expected_rows = 0;
    for r in &jobs {
        use sqlx::Row;
        let key = text(r, 0).map_err(err)?;
        let state = text(r, 1).map_err(err)?;
        let total: i64 = r.try_get(2).map_err(err)?;
        let applied: i64 = r.try_get(3).map_err(err)?;
        let rejected: i64 = r.try_get(4).map_err(err)?;
        let last_error = text(r, 5).unwrap_or_default();
        expected_rows += total;
        match state.as_str() {
            "succeeded" => {}
            "poisoned" => {
                v.poisoned += 1;
                v.anomalies.push(format!(
                    "job {key} is poisoned (healthy work): {last_error}"
                ));
            }
            other => {
                v.unterminated += 1;
                v.anomalies
                    .push(format!("job {key} is {other}, not terminal"));
            }
        }
        if state == "succeeded" && (applied != total || rejected != 0) {
            v.anomalies.push(format!(
                "job {key} succeeded with {applied} of {total} rows applied, {rejected} rejected"
            ));
        }
        stored.insert(key, total);
    }
    v.jobs = jobs.len();
    for (key, rows) in acknowledged {
        match stored.get(key) {
            None => {
                v.lost += 1;
                v.anomalies
                    .push(format!("acknowledged job {key} is not stored"));
            }
            Some(&t) if t != *rows as i64 => v
                .anomalies
                .push(format!("acknowledged job {key} has {t} rows, not {rows}")),
            Some(_) => {}
        }
    }
    v.rows = scalar(db, "SELECT COUNT(*) FROM crm_record_change").await?;
    v.duplicated = scalar(
        db,
        "SELECT COUNT(*) FROM (SELECT job_id, ordinal FROM crm_record_change \
         GROUP BY job_id, ordinal HAVING COUNT(*) > 1) d",
    )
    .await?;
    if v.duplicated > 0 {
        v.anomalies
            .push(format!("{} row(s) applied more than once", v.duplicated));
    }
    if v.rows != expected_rows {
        v.anomalies.push(format!(
            "{} row changes recorded, {expected_rows} rows accepted",
            v.rows
        ));
    }
    let revisions = scalar(db, "SELECT COUNT(*) FROM crm_record WHERE revision <> 1").await?;
    if revisions > 0 {
        v.anomalies
            .push(format!("{revisions} record(s) written more than once"));
    }
    let records = scalar(db, "SELECT COUNT(*) FROM crm_record").await?;
    if records != expected_rows {
        v.anomalies.push(format!(
            "{records} records stored, {expected_rows} rows accepted"
        ));
    }

    // Schedules: each occurrence reserved once, none skipped (catch-up covers every downtime
    // here), and the schedule's own run count agrees.
    let schedules = sqlx::query("SELECT id, name, runs FROM flow_schedule")
        .fetch_all(db.pool())
        .await
        .map_err(err)?;
    for s in &schedules {
        use sqlx::Row;
        let id: i64 = s.try_get(0).map_err(err)?;
        let name = text(s, 1).map_err(err)?;
        let counted: i64 = s.try_get(2).map_err(err)?;
        let Some(&(_, _, every)) = SCHEDULES.iter().find(|(n, _, _)| *n == name) else {
            continue;
        };
        let occurrences: Vec<i64> = sqlx::query_scalar(&format!(
            "SELECT occurrence_at FROM flow_run WHERE schedule_id = {id} ORDER BY occurrence_at"
        ))
        .fetch_all(db.pool())
        .await
        .map_err(err)?;
        v.runs += occurrences.len();
        if occurrences.len() as i64 != counted {
            v.anomalies.push(format!(
                "schedule {name}: {} runs stored, {counted} counted",
                occurrences.len()
            ));
        }
        for w in occurrences.windows(2) {
            match w[1] - w[0] {
                d if d == every => {}
                0 => {
                    v.duplicated += 1;
                    v.anomalies.push(format!(
                        "schedule {name}: occurrence {} reserved twice",
                        w[0]
                    ));
                }
                d => {
                    v.gaps += 1;
                    v.anomalies.push(format!(
                        "schedule {name}: {} occurrence(s) missing after {}",
                        d / every - 1,
                        w[0]
                    ));
                }
            }
        }
        if occurrences.is_empty() {
            v.anomalies.push(format!("schedule {name} never ran"));
        }
    }
    Ok(v)
}

/// Lines containing `needle` in every log under `dir`.
fn count_in_logs(dir: &Path, needle: &str) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .map(|s| s.lines().filter(|l| l.contains(needle)).count())
        .sum()
}
