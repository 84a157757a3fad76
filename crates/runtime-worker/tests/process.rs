//! Process-level proof: the real binary, started as a child process, killed and restarted.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nexuscrm_persistence::testing::{CutProxy, TestDb};
use nexuscrm_persistence::{Db, Dialect, sqlx};

const BIN: &str = env!("CARGO_BIN_EXE_nexuscrm-runtime-worker");

/// The audit file of the worker over `url` (one per database, outside the source tree: event
/// ids repeat across databases, so two databases must never share a file).
fn audit_file(url: &str) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    url.hash(&mut h);
    std::env::temp_dir()
        .join(format!("nexuscrm-test-audit-{:016x}.jsonl", h.finish()))
        .display()
        .to_string()
}

struct Worker {
    child: Child,
    port: u16,
    log: Arc<Mutex<String>>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Never leave a worker behind when a test fails.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until `w` answers `/readyz` with 200, failing with its log after `within`.
async fn wait_ready(w: &Worker, within: Duration) {
    let deadline = Instant::now() + within;
    while get(w.port, "/readyz").map(|r| r.0) != Some(200) {
        assert!(
            Instant::now() < deadline,
            "never ready: {}",
            w.log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn start(url: &str, extra: &[&str]) -> Worker {
    start_leased(url, "0.5", extra)
}

fn start_leased(url: &str, lease_secs: &str, extra: &[&str]) -> Worker {
    start_with_env(url, lease_secs, extra, &[])
}

fn start_with_env(url: &str, lease_secs: &str, extra: &[&str], env: &[(&str, &str)]) -> Worker {
    let mut child = Command::new(BIN)
        .env("NEXUSCRM_AUDIT_FILE", audit_file(url))
        .args([
            "--database-url",
            url,
            "run",
            "--admin-addr",
            "127.0.0.1:0",
            "--bulk-lease-secs",
            lease_secs,
            "--shutdown-timeout-secs",
            "10",
        ])
        .args(extra)
        .env_remove("NEXUSCRM_DATABASE_URL")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the worker");
    let stderr = child.stderr.take().unwrap();
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let sink = log.clone();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(i) = line.find("admin listening on 127.0.0.1:") {
                let rest = &line[i + "admin listening on 127.0.0.1:".len()..];
                let port: String = rest.chars().take_while(char::is_ascii_digit).collect();
                if let (Some(tx), Ok(p)) = (tx.take(), port.parse::<u16>()) {
                    let _ = tx.send(p);
                }
            }
            sink.lock().unwrap().push_str(&(line + "\n"));
        }
    });
    let port = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| {
            panic!(
                "the worker never served admin HTTP: {}",
                log.lock().unwrap()
            )
        });
    Worker { child, port, log }
}

fn get(port: u16, path: &str) -> Option<(u16, String)> {
    get_as(port, path, &format!("127.0.0.1:{port}"))
}

fn get_as(port: u16, path: &str, host: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    Some((
        code,
        text.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default(),
    ))
}

fn signal(w: &Worker, sig: &str) {
    Command::new("kill")
        .args([sig, &w.child.id().to_string()])
        .status()
        .unwrap();
}

fn wait_exit(w: &mut Worker, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = w.child.try_wait().unwrap() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "the worker did not exit: {}",
            w.log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGTERM, then require a clean (exit 0) drain within 20 s.
fn stop_clean(w: &mut Worker) {
    signal(w, "-TERM");
    let status = wait_exit(w, Duration::from_secs(20));
    assert!(
        status.success(),
        "clean drain expected: {}",
        w.log.lock().unwrap()
    );
}

fn submit(url: &str, key: &str, rows: usize, segment: u32) {
    let out = Command::new(BIN)
        .env("NEXUSCRM_AUDIT_FILE", audit_file(url))
        .args([
            "--database-url",
            url,
            "bulk",
            "submit",
            "--key",
            key,
            "--sample",
            &rows.to_string(),
            "--segment-size",
            &segment.to_string(),
        ])
        .env_remove("NEXUSCRM_DATABASE_URL")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "submit failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn scalar(db: &Db, sql: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(db.pool())
        .await
        .unwrap()
}

async fn wait_all_succeeded(db: &Db, jobs: i64, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let done = scalar(
            db,
            "SELECT COUNT(*) FROM bulk_job WHERE state = 'succeeded'",
        )
        .await;
        if done == jobs {
            return;
        }
        assert!(Instant::now() < deadline, "{done} of {jobs} jobs succeeded");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn assert_exactly_once(db: &Db, rows: i64) {
    assert_eq!(
        scalar(db, "SELECT COUNT(*) FROM crm_record_change").await,
        rows,
        "every row applied"
    );
    assert_eq!(
        scalar(db, "SELECT COUNT(*) FROM (SELECT job_id, ordinal FROM crm_record_change GROUP BY job_id, ordinal HAVING COUNT(*) > 1) d").await,
        0,
        "no row applied twice"
    );
    assert_eq!(
        scalar(db, "SELECT COUNT(*) FROM crm_record WHERE revision <> 1").await,
        0,
        "revisions"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_snapshot_and_metrics_answer_and_sigterm_exits_zero() {
    let t = TestDb::create(Dialect::Sqlite, "admin").await.unwrap();
    let mut w = start(&t.url, &[]);
    wait_ready(&w, Duration::from_secs(30)).await;
    assert_eq!(get(w.port, "/livez").unwrap().0, 200);
    let (code, body) = get(w.port, "/snapshot").unwrap();
    assert_eq!(code, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["families"][0]["declaration"],
        "bulk=durable-critical/transactional"
    );
    assert_eq!(v["families"][0]["controller"]["ready"], true);
    assert_eq!(
        v["families"][1]["declaration"],
        "flow=durable-critical/transactional"
    );
    assert_eq!(v["families"][1]["controller"]["ready"], true);
    assert_eq!(v["families"][1]["observations"]["runs"], 0);
    assert_eq!(
        v["families"][2]["declaration"],
        "formula=derived-reconcilable/convergent"
    );
    assert_eq!(v["families"][2]["observations"]["stale"], 0);
    // `/families`: the registry, each path marked with whether this process runs it; every
    // controller in `/snapshot` is a registered path with the same declaration.
    let (code, body) = get(w.port, "/families").unwrap();
    assert_eq!(code, 200);
    let registry: serde_json::Value = serde_json::from_str(&body).unwrap();
    let paths = registry["paths"].as_array().unwrap();
    for running in v["families"].as_array().unwrap() {
        let path = paths
            .iter()
            .find(|p| p["family"] == running["family"])
            .unwrap_or_else(|| panic!("{running} is not registered: {body}"));
        assert_eq!(path["declaration"], running["declaration"]);
        assert_eq!(path["running"], true, "{path}");
        assert!(!path["proofs"].as_array().unwrap().is_empty(), "{path}");
    }
    // Paused Flow runs only with a connector, which this worker has not.
    let paused = paths.iter().find(|p| p["family"] == "paused").unwrap();
    assert_eq!(paused["running"], false);
    let (ok, out, err) = cli(&t.url, &["families"]);
    assert!(ok, "{err}");
    for p in paths {
        assert!(out.contains(p["declaration"].as_str().unwrap()), "{out}");
    }
    let (code, metrics) = get(w.port, "/metrics").unwrap();
    assert_eq!(code, 200);
    // OpenMetrics text: ends with `# EOF`, and a Prometheus text parser reads it back.
    assert!(metrics.ends_with("# EOF\n"), "{metrics}");
    let scrape =
        prometheus_parse::Scrape::parse(metrics.lines().map(|l| Ok(l.to_owned()))).unwrap();
    assert!(
        scrape
            .samples
            .iter()
            .any(|s| s.metric == "nexuscrm_worker_attempt_duration_seconds"
                && matches!(s.value, prometheus_parse::Value::Histogram(_))),
        "{metrics}"
    );
    assert!(scrape.samples.len() > 20, "{metrics}");
    let mut samples = 0;
    for line in metrics.lines() {
        if line.starts_with("# HELP ") || line.starts_with("# TYPE ") || line == "# EOF" {
            continue;
        }
        let (name_labels, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad line {line:?}"));
        assert!(value.parse::<f64>().is_ok(), "bad value in {line:?}");
        let name = name_labels.split('{').next().unwrap();
        assert!(
            name.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
            "bad name in {line:?}"
        );
        assert!(
            name_labels.ends_with('}')
                && (name_labels.contains("family=\"bulk\"")
                    || name_labels.contains("family=\"flow\"")
                    || name_labels.contains("family=\"formula\"")
                    || name_labels.contains("family=\"audit\"")
                    || name_labels.contains("family=\"telemetry\"")),
            "{line:?}"
        );
        samples += 1;
    }
    assert!(samples > 20, "{metrics}");
    // Claim figures to tune with: batch sizes asked and returned, and a latency histogram.
    for want in [
        "# TYPE nexuscrm_worker_claim_latency_seconds histogram",
        "nexuscrm_worker_claim_latency_seconds_bucket{le=\"+Inf\",family=\"bulk\"}",
        "nexuscrm_worker_claim_latency_seconds_count{family=\"flow\"}",
        "nexuscrm_worker_claim_capacity_asked_total{family=\"bulk\"}",
        "nexuscrm_worker_claims_empty_total{family=\"bulk\"}",
        "# TYPE nexuscrm_worker_claim_batch_size histogram",
        "# TYPE nexuscrm_worker_attempt_duration_seconds histogram",
        "# TYPE nexuscrm_worker_due_lateness_seconds histogram",
        "nexuscrm_worker_claim_batch_size_bucket{le=\"0.0\",family=\"bulk\"}",
        "nexuscrm_formula_stale_records{family=\"formula\"} 0",
        "nexuscrm_formula_records_with_errors{family=\"formula\"} 0",
    ] {
        assert!(metrics.contains(want), "{want} missing from:\n{metrics}");
    }
    let asked = v["families"][0]["controller"]["claim_capacity_asked"]
        .as_u64()
        .unwrap();
    assert!(asked >= 1, "the startup claim asked for slots");
    // The start-up claim is asked when it is issued and timed when it answers: ready can come
    // between the two, so wait for its answer.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, body) = get(w.port, "/snapshot").unwrap();
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        if v["families"][0]["controller"]["claim_latency"]["count"].as_u64() >= Some(1) {
            break;
        }
        assert!(Instant::now() < deadline, "no claim answered: {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    signal(&w, "-TERM");
    let status = wait_exit(&mut w, Duration::from_secs(20));
    assert!(status.success(), "{status:?}: {}", w.log.lock().unwrap());
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_segment_in_flight_drains_and_exits_zero() {
    let t = TestDb::create(Dialect::Sqlite, "sigterm").await.unwrap();
    submit(&t.url, "big", 30_000, 10_000);
    let mut w = start_leased(&t.url, "30", &[]);
    let db = Db::connect(&t.url).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while scalar(&db, "SELECT COUNT(*) FROM bulk_job WHERE state = 'running'").await == 0 {
        assert!(Instant::now() < deadline, "never claimed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let stopped = Instant::now();
    signal(&w, "-TERM");
    let status = wait_exit(&mut w, Duration::from_secs(20));
    assert!(
        status.success(),
        "drained within the bound: {}",
        w.log.lock().unwrap()
    );
    assert!(stopped.elapsed() < Duration::from_secs(12));
    // A restarted worker finishes the job with every row applied once.
    let mut w = start_leased(&t.url, "30", &[]);
    wait_all_succeeded(&db, 1, Duration::from_secs(120)).await;
    stop_clean(&mut w);
    assert_exactly_once(&db, 30_000).await;
    db.close().await;
    t.drop_database().await;
}

async fn kill_nine_twenty_times(dialect: Dialect) {
    let Some(t) = TestDb::create(dialect, "kill9").await else {
        return;
    };
    for j in 0..10 {
        submit(&t.url, &format!("job-{j}"), 200, 20);
    }
    let db = Db::connect(&t.url).await.unwrap();
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..20 {
        let mut w = start(&t.url, &[]);
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        std::thread::sleep(Duration::from_millis(50 + seed % 400));
        w.child.kill().unwrap(); // SIGKILL: no drain, no cleanup.
        let _ = w.child.wait();
    }
    let mut w = start(&t.url, &[]);
    wait_all_succeeded(&db, 10, Duration::from_secs(180)).await;
    stop_clean(&mut w);
    assert_exactly_once(&db, 2_000).await;
    db.close().await;
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_nine_twenty_times_on_sqlite_loses_nothing_and_applies_nothing_twice() {
    kill_nine_twenty_times(Dialect::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_nine_twenty_times_on_postgres_loses_nothing_and_applies_nothing_twice() {
    kill_nine_twenty_times(Dialect::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_on_postgres_never_apply_a_row_twice() {
    let Some(t) = TestDb::create(Dialect::Postgres, "twoproc").await else {
        return;
    };
    submit(&t.url, "seed", 1, 1);
    let mut a = start(&t.url, &[]);
    let mut b = start(&t.url, &[]);
    for j in 0..20 {
        submit(&t.url, &format!("job-{j}"), 200, 20);
    }
    let db = Db::connect(&t.url).await.unwrap();
    wait_all_succeeded(&db, 21, Duration::from_secs(180)).await;
    signal(&a, "-TERM");
    signal(&b, "-TERM");
    assert!(wait_exit(&mut a, Duration::from_secs(20)).success());
    assert!(wait_exit(&mut b, Duration::from_secs(20)).success());
    assert_exactly_once(&db, 4_001).await;
    db.close().await;
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_generation_takes_over_and_the_older_one_exits_superseded() {
    let Some(t) = TestDb::create(Dialect::Postgres, "takeover").await else {
        return;
    };
    submit(&t.url, "seed", 1, 1);
    let mut old = start(&t.url, &["--generation", "1"]);
    let db = Db::connect(&t.url).await.unwrap();
    wait_all_succeeded(&db, 1, Duration::from_secs(60)).await;
    // Bulk has run a job; the process is ready once every controller has reconciled.
    wait_ready(&old, Duration::from_secs(30)).await;
    let mut new = start(&t.url, &["--generation", "2"]);
    // The takeover notifies the family channel: the fenced-out process reconciles, learns it
    // is superseded, goes unready and exits 1 (not 2: nothing is in doubt), well before any
    // backstop.
    let status = wait_exit(&mut old, Duration::from_secs(30));
    assert_eq!(status.code(), Some(1), "{}", old.log.lock().unwrap());
    assert!(
        old.log.lock().unwrap().contains("superseded generation"),
        "{}",
        old.log.lock().unwrap()
    );
    for j in 0..5 {
        submit(&t.url, &format!("job-{j}"), 50, 10);
    }
    wait_all_succeeded(&db, 6, Duration::from_secs(60)).await;
    // An older generation cannot start against a newer owner.
    let out = Command::new(BIN)
        .env("NEXUSCRM_AUDIT_FILE", audit_file(&t.url))
        .args([
            "--database-url",
            &t.url,
            "run",
            "--admin-addr",
            "127.0.0.1:0",
            "--generation",
            "1",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("can never take it back"));
    signal(&new, "-TERM");
    assert!(wait_exit(&mut new, Duration::from_secs(20)).success());
    assert_exactly_once(&db, 251).await;
    // The cutover fence wrote its audit trail: one `ownership.taken` per family and generation,
    // the second naming the first as the one it replaced; the refused start wrote none.
    let taken: Vec<(String, serde_json::Value)> = nexuscrm_audit::outbox(&db)
        .await
        .unwrap()
        .into_iter()
        .filter(|l| l.kind == "ownership.taken")
        .map(|l| (l.event_id, l.body))
        .collect();
    for family in ["bulk", "flow", "formula", "audit"] {
        let of = |g: i64| {
            taken
                .iter()
                .filter(|(id, _)| *id == format!("ownership-{family}-g{g}"))
                .map(|(_, b)| b.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(of(1).len(), 1, "{family}: {taken:?}");
        assert_eq!(
            of(2),
            [serde_json::json!({"family": family, "generation": 2, "previous": 1})],
            "{family}: {taken:?}"
        );
    }
    db.close().await;
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_not_200_until_the_startup_reconciliation_completes() {
    let Some(t) = TestDb::create(Dialect::Postgres, "readyz").await else {
        return;
    };
    submit(&t.url, "seed", 1, 1); // migrates
    let db = Db::connect(&t.url).await.unwrap();
    db.take_ownership("bulk", 1, "test").await.unwrap();
    // Hold every fence stripe: the worker's startup reconciliation blocks on it.
    let mut holder = db.begin_write().await.unwrap();
    sqlx::query("UPDATE runtime_work_fence_stripe SET generation = generation")
        .execute(holder.conn())
        .await
        .unwrap();
    let mut w = start(&t.url, &[]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (code, body) = get(w.port, "/readyz").unwrap();
    assert_eq!(
        code, 503,
        "not ready before the startup reconciliation: {body}"
    );
    assert!(body.contains("not ready"), "{body}");
    assert_eq!(
        get(w.port, "/livez").unwrap().0,
        200,
        "alive while starting"
    );
    holder.rollback().await;
    wait_ready(&w, Duration::from_secs(30)).await;
    stop_clean(&mut w);
    db.close().await;
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poisoned_controller_exits_two_and_a_restart_recovers() {
    let t = TestDb::create(Dialect::Sqlite, "poison").await.unwrap();
    submit(&t.url, "job", 100, 10);
    // The attempt crashes mid-job (an attempt error): the controller is poisoned.
    let out = Command::new(BIN)
        .env("NEXUSCRM_AUDIT_FILE", audit_file(&t.url))
        .args([
            "--database-url",
            &t.url,
            "run",
            "--admin-addr",
            "127.0.0.1:0",
            "--bulk-lease-secs",
            "0.5",
        ])
        .env("NEXUSCRM_FAULT", "after-effect")
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{log}");
    assert!(log.contains("poisoned"), "{log}");
    let mut w = start(&t.url, &[]);
    let db = Db::connect(&t.url).await.unwrap();
    wait_all_succeeded(&db, 1, Duration::from_secs(60)).await;
    stop_clean(&mut w);
    assert_exactly_once(&db, 100).await;
    db.close().await;
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_an_attempt_ignoring_cancellation_exits_two_after_the_bound() {
    let t = TestDb::create(Dialect::Sqlite, "overrun").await.unwrap();
    submit(&t.url, "job", 50, 10);
    let mut child = Command::new(BIN)
        .env("NEXUSCRM_AUDIT_FILE", audit_file(&t.url))
        .args([
            "--database-url",
            &t.url,
            "run",
            "--admin-addr",
            "127.0.0.1:0",
            "--shutdown-timeout-secs",
            "1",
        ])
        .env("NEXUSCRM_TEST_STALL_ATTEMPT_SECS", "30")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let db = Db::connect(&t.url).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while scalar(&db, "SELECT COUNT(*) FROM bulk_job WHERE state = 'running'").await == 0 {
        assert!(Instant::now() < deadline, "never claimed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stopped = Instant::now();
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(20),
            "did not exit after the bound"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = stopped.elapsed();
    let mut log = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(took >= Duration::from_secs(1), "waited the bound: {took:?}");
    assert!(
        log.contains("ignored cancellation beyond the shutdown bound"),
        "{log}"
    );
    db.close().await;
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_as_soon_as_the_admin_server_is_up_is_a_clean_stop() {
    let t = TestDb::create(Dialect::Sqlite, "earlyterm").await.unwrap();
    for _ in 0..5 {
        // Signal handlers are registered before anything else, so even a signal during
        // start-up drains cleanly instead of killing the process.
        let mut w = start(&t.url, &[]);
        stop_clean(&mut w);
    }
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_audit_file_that_cannot_be_opened_is_a_start_up_error() {
    let t = TestDb::create(Dialect::Sqlite, "auditbad").await.unwrap();
    let out = Command::new(BIN)
        .args([
            "--database-url",
            &t.url,
            "run",
            "--admin-addr",
            "127.0.0.1:0",
        ])
        .env_remove("NEXUSCRM_DATABASE_URL")
        .env("NEXUSCRM_AUDIT_FILE", "/nonexistent-dir/audit.jsonl")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("`audit.file`") && err.contains("/nonexistent-dir/audit.jsonl"),
        "{err}"
    );
    let out = Command::new(BIN)
        .args(["--database-url", &t.url, "run"])
        .env_remove("NEXUSCRM_DATABASE_URL")
        .env("NEXUSCRM_AUDIT_KEEP", "0")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("`audit.keep`"), "{err}");
    t.drop_database().await;
}

fn cli(url: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN)
        .env("NEXUSCRM_AUDIT_FILE", audit_file(url))
        .args(["--database-url", url])
        .args(args)
        .env_remove("NEXUSCRM_DATABASE_URL")
        .output()
        .expect("run the CLI");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn runs_of(db: &Db, name: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT COUNT(*) FROM flow_run r JOIN flow_schedule s ON s.id = r.schedule_id \
         WHERE s.name = $1",
    )
    .bind(name.to_owned())
    .fetch_one(db.pool())
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedule_commands_drive_a_running_worker_across_processes() {
    let Some(t) = TestDb::create(Dialect::Postgres, "schedcli").await else {
        return;
    };
    // Bad input is refused with the reason, before anything is stored.
    let (ok, _, err) = cli(
        &t.url,
        &[
            "schedule",
            "create",
            "x",
            "--flow",
            "f",
            "--cron",
            "0 61 * * * *",
        ],
    );
    assert!(!ok && err.contains("invalid cron expression"), "{err}");
    let (ok, _, err) = cli(
        &t.url,
        &[
            "schedule", "create", "x", "--flow", "f", "--every", "1s", "--policy", "often",
        ],
    );
    assert!(!ok && err.contains("unknown misfire policy"), "{err}");
    let (ok, _, err) = cli(
        &t.url,
        &[
            "schedule",
            "create",
            "x",
            "--flow",
            "f",
            "--cron",
            "0 0 * * * *",
            "--zone",
            "Nowhere/Land",
        ],
    );
    assert!(!ok && err.contains("unknown time zone"), "{err}");
    let (ok, list, _) = cli(&t.url, &["schedule", "list"]);
    assert!(ok && !list.contains(" x "), "{list}");

    let mut w = start(&t.url, &[]);
    // Another process creates the schedule; the worker hears of it through LISTEN/NOTIFY.
    let (ok, id, err) = cli(
        &t.url,
        &[
            "schedule", "create", "tick", "--flow", "sync", "--every", "1s", "--policy", "catch-up",
        ],
    );
    assert!(ok, "{err}");
    assert!(id.trim().parse::<i64>().is_ok(), "{id}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while runs_of(&t.db, "tick").await < 3 {
        assert!(
            Instant::now() < deadline,
            "no runs: {}",
            w.log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (ok, out, err) = cli(&t.url, &["schedule", "pause", "tick"]);
    assert!(ok && out.contains("paused"), "{out}{err}");
    let paused_at = runs_of(&t.db, "tick").await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        runs_of(&t.db, "tick").await,
        paused_at,
        "a paused schedule does not run"
    );
    let (ok, out, _) = cli(&t.url, &["schedule", "resume", "tick"]);
    assert!(ok && out.contains("active"), "{out}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while runs_of(&t.db, "tick").await < paused_at + 2 {
        assert!(Instant::now() < deadline, "no runs after resume");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (ok, runs, _) = cli(&t.url, &["schedule", "runs", "tick", "--limit", "3"]);
    assert!(ok && runs.lines().count() == 4, "{runs}");
    let (ok, list, _) = cli(&t.url, &["schedule", "list"]);
    assert!(
        ok && list.contains("tick") && list.contains("every 1s"),
        "{list}"
    );
    let (ok, _, _) = cli(&t.url, &["schedule", "delete", "tick"]);
    assert!(ok);
    let (ok, _, err) = cli(&t.url, &["schedule", "pause", "tick"]);
    assert!(!ok && err.contains("no schedule named"), "{err}");
    stop_clean(&mut w);
    // Exactly one run per occurrence.
    let dup: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) - COUNT(DISTINCT (schedule_id, occurrence_at)) FROM flow_run",
    )
    .fetch_one(t.db.pool())
    .await
    .unwrap();
    assert_eq!(dup, 0);
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_server_answers_only_loopback_host_names() {
    let t = TestDb::create(Dialect::Sqlite, "hosts").await.unwrap();
    let mut w = start(&t.url, &[]);
    let port = w.port;
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        format!("[::1]:{port}"),
    ] {
        assert_eq!(get_as(port, "/snapshot", &host).unwrap().0, 200, "{host}");
    }
    // A DNS-rebinding page sends its own name: refused, for every path, and logged.
    for host in [
        "evil.example",
        "evil.example:9464",
        "localhost.evil.example",
        "10.1.2.3",
    ] {
        let (code, body) = get_as(port, "/metrics", host).unwrap();
        assert_eq!(code, 421, "{host}: {body}");
        assert!(!body.contains("nexuscrm_"), "{host}: nothing leaks");
    }
    stop_clean(&mut w);
    assert!(w.log.lock().unwrap().contains("not this loopback server"));
    // A name the operator allows is served.
    let mut w = start_with_env(
        &t.url,
        "0.5",
        &[],
        &[(
            "NEXUSCRM_ADMIN_ALLOWED_HOSTS",
            "worker.internal, other.internal",
        )],
    );
    assert_eq!(
        get_as(w.port, "/livez", "worker.internal:1").unwrap().0,
        200
    );
    assert_eq!(get_as(w.port, "/livez", "Other.Internal").unwrap().0, 200);
    assert_eq!(get_as(w.port, "/livez", "third.internal").unwrap().0, 421);
    stop_clean(&mut w);
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn livez_answers_under_a_flood_of_idle_connections_and_the_limit_is_logged() {
    let t = TestDb::create(Dialect::Sqlite, "flood").await.unwrap();
    let mut w = start(&t.url, &[]);
    // 300 connections that never send a byte (more than the cap of 64).
    let mut idle = Vec::new();
    for _ in 0..300 {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", w.port)) {
            idle.push(s);
        }
    }
    assert!(idle.len() >= 200, "opened {} idle connections", idle.len());
    // While every one of them is still open, /livez answers (the oldest idle one is shed).
    for i in 0..20 {
        let r = get(w.port, "/livez");
        assert_eq!(r.map(|r| r.0), Some(200), "livez {i} under the flood");
    }
    // A half-sent request is closed after the header timeout (5 s), never held forever.
    let mut slow = TcpStream::connect(("127.0.0.1", w.port)).unwrap();
    slow.write_all(b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let started = Instant::now();
    let mut buf = Vec::new();
    let _ = slow.read_to_end(&mut buf);
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "a slow client was held {:?}",
        started.elapsed()
    );
    drop(idle);
    stop_clean(&mut w);
    let log = w.log.lock().unwrap().clone();
    assert!(log.contains("connection limit reached"), "{log}");
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_database_within_three_seconds() {
    let Some(t) = TestDb::create(Dialect::Postgres, "readydb").await else {
        return;
    };
    let proxy = CutProxy::start(5432).await.unwrap();
    let url = proxy.route(&t.url, 5432).expect("a URL on port 5432");
    let mut w = start(&url, &[]);
    wait_ready(&w, Duration::from_secs(30)).await;
    proxy.set_cut(true);
    let cut_at = Instant::now();
    // When readiness was first lost, by either sign: a non-200 answer, or no answer at all.
    let mut unanswered_since: Option<Duration> = None;
    let (code, body) = loop {
        let asked = cut_at.elapsed();
        let Some((code, body)) = get(w.port, "/readyz") else {
            // No answer: the process may be failing stop (a commit cut mid-flight is
            // outcome-unknown, exit 2), which is "not ready" too; the supervisor replaces it.
            // The bound is on losing readiness; the exit itself waits for the other
            // controllers' drain (their statements meet the black hole), bounded by the
            // shutdown timeout.
            let lost = *unanswered_since.get_or_insert(asked);
            if let Ok(Some(status)) = w.child.try_wait() {
                assert_eq!(status.code(), Some(2), "{}", w.log.lock().unwrap());
                assert!(
                    lost < Duration::from_secs(5),
                    "readiness lost after {lost:?}"
                );
                t.drop_database().await;
                return;
            }
            assert!(
                cut_at.elapsed() < Duration::from_secs(45),
                "/readyz unanswered and the process still running: {}",
                w.log.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        if let Some(lost) = unanswered_since {
            // It answered again after a silence: the silence counted as "not ready".
            assert!(
                lost < Duration::from_secs(5),
                "readiness lost after {lost:?}"
            );
            assert_ne!(code, 200, "ready again with the database still cut: {body}");
        }
        if code != 200 {
            break (code, body);
        }
        assert!(
            cut_at.elapsed() < Duration::from_secs(20),
            "still ready with the database gone"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let took = unanswered_since.unwrap_or_else(|| cut_at.elapsed());
    assert_eq!(code, 503, "{body}");
    // A controller may notice first (its LISTEN connection died): the database check says so
    // too within the same bound.
    let mut body = body;
    while !body.contains("database") {
        assert!(
            cut_at.elapsed() < Duration::from_secs(5),
            "the database check never failed: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        if let Some((_, b)) = get(w.port, "/readyz") {
            body = b;
        }
    }
    // The stated bound is 3 s (2 s probe timeout + 1 s shared answer); 2 s of slack for a
    // loaded machine.
    assert!(
        took < Duration::from_secs(5),
        "readiness followed after {took:?}"
    );
    assert_eq!(
        get(w.port, "/livez").unwrap().0,
        200,
        "liveness does not follow the database"
    );
    proxy.set_cut(false);
    wait_ready(&w, Duration::from_secs(60)).await;
    stop_clean(&mut w);
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_errors_exit_one_help_exits_zero_and_retry_refuses_a_job_that_is_not_poisoned() {
    let t = TestDb::create(Dialect::Sqlite, "usage").await.unwrap();
    for args in [
        &["run", "--bulk-capacity", "abc"][..],
        &["bulk", "submit", "--segment-size", "-1"][..],
        &["no-such-command"][..],
    ] {
        let out = Command::new(BIN)
            .env("NEXUSCRM_AUDIT_FILE", audit_file(&t.url))
            .args(["--database-url", &t.url])
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(!out.stderr.is_empty(), "{args:?}: the error is printed");
    }
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let (ok, _, err) = cli(&t.url, &["bulk", "retry", "12345"]);
    assert!(!ok);
    assert!(err.contains("no bulk job 12345"), "{err}");
    submit(&t.url, "usage-job", 3, 3);
    let (ok, _, err) = cli(&t.url, &["bulk", "retry", "1"]);
    assert!(!ok);
    assert!(err.contains("not poisoned"), "{err}");
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_names_a_refused_row_by_file_and_line_and_refuses_a_key_reused_for_other_rows() {
    let t = TestDb::create(Dialect::Sqlite, "fileline").await.unwrap();
    let dir = std::env::temp_dir().join(format!("nexuscrm-fileline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Line 3 (after a blank line) holds a key the store refuses: too long.
    let bad = dir.join("bad.jsonl");
    let long_key = "k".repeat(300);
    std::fs::write(
        &bad,
        format!(
            "{{\"record_key\": \"a\"}}\n\n{{\"record_key\": \"{long_key}\"}}\n{{\"record_key\": \"b\"}}\n"
        ),
    )
    .unwrap();
    let (ok, _, err) = cli(
        &t.url,
        &[
            "bulk",
            "submit",
            "--key",
            "f1",
            "--file",
            bad.to_str().unwrap(),
        ],
    );
    assert!(!ok);
    assert!(
        err.contains(&format!("{}:3: record key", bad.display())),
        "{err}"
    );
    let csv = dir.join("bad.csv");
    std::fs::write(&csv, format!("record_key,name\na,x\n{long_key},y\n")).unwrap();
    let (ok, _, err) = cli(
        &t.url,
        &[
            "bulk",
            "submit",
            "--key",
            "f2",
            "--file",
            csv.to_str().unwrap(),
        ],
    );
    assert!(!ok);
    assert!(
        err.contains(&format!("{}:3: record key", csv.display())),
        "{err}"
    );
    // A key reused with another file: refused with exit 1, the first job unchanged.
    let one = dir.join("one.jsonl");
    std::fs::write(&one, "{\"record_key\": \"a\"}\n").unwrap();
    let two = dir.join("two.jsonl");
    std::fs::write(&two, "{\"record_key\": \"a\"}\n{\"record_key\": \"b\"}\n").unwrap();
    let (ok, id, err) = cli(
        &t.url,
        &[
            "bulk",
            "submit",
            "--key",
            "k",
            "--file",
            one.to_str().unwrap(),
        ],
    );
    assert!(ok);
    // stderr is not a terminal here: the progress spinner draws nothing.
    assert!(
        !err.contains("reading") && !err.contains("submitting"),
        "{err}"
    );
    let (ok, again, err) = cli(
        &t.url,
        &[
            "bulk",
            "submit",
            "--key",
            "k",
            "--file",
            one.to_str().unwrap(),
        ],
    );
    assert!(
        ok && again == id,
        "the same file again is the same job: {err}"
    );
    let out = Command::new(BIN)
        .env("NEXUSCRM_AUDIT_FILE", audit_file(&t.url))
        .args([
            "--database-url",
            &t.url,
            "bulk",
            "submit",
            "--key",
            "k",
            "--file",
        ])
        .arg(&two)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is already used by job"), "{err}");
    let db = Db::connect(&t.url).await.unwrap();
    assert_eq!(scalar(&db, "SELECT COUNT(*) FROM bulk_input").await, 1);
    db.close().await;
    let _ = std::fs::remove_dir_all(&dir);
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_commands_resume_once_and_refuse_bad_input_with_nothing_changed() {
    for dialect in [Dialect::Sqlite, Dialect::Postgres, Dialect::Mysql] {
        let Some(t) = TestDb::create(dialect, "pausecli").await else {
            continue;
        };
        let (ok, out, err) = cli(
            &t.url,
            &[
                "pause",
                "create",
                "run-7",
                "approve",
                "--timeout",
                "1h",
                "--payload",
                r#"{"amount": 1200}"#,
            ],
        );
        assert!(ok, "{dialect}: {err}");
        let mut lines = out.lines();
        let id = lines.next().unwrap().to_owned();
        let token = lines.next().unwrap().to_owned();
        assert!(token.starts_with("prt_") && token.len() == 68, "{token}");
        let show = |id: &str| {
            let (ok, out, err) = cli(&t.url, &["pause", "show", id]);
            assert!(ok, "{err}");
            assert!(!out.contains(&token[4..]), "show never prints the token");
            serde_json::from_str::<serde_json::Value>(&out).unwrap()
        };
        assert_eq!(show(&id)["state"], "paused", "{dialect}");
        // Bad input: each a clear error, exit 1, nothing changed.
        for (args, want) in [
            (
                vec!["pause", "resume", &token, "--payload", "{not json"],
                "--payload is not JSON",
            ),
            (
                vec!["pause", "resume", "prt_guess", "--payload", "{}"],
                "is not a resume token",
            ),
            (
                vec![
                    "pause",
                    "resume",
                    "prt_0000000000000000000000000000000000000000000000000000000000000000",
                ],
                "no pause has this resume token",
            ),
            (
                vec!["pause", "create", "run-7", "approve"],
                "already paused at step",
            ),
            (
                vec!["pause", "create", "run-8", "s", "--timeout", "999999d"],
                "is too large",
            ),
            (vec!["pause", "list", "--state", "bogus"], "unknown state"),
            (vec!["pause", "show", "424242"], "no pause 424242"),
        ] {
            let out = Command::new(BIN)
                .env("NEXUSCRM_AUDIT_FILE", audit_file(&t.url))
                .args(["--database-url", &t.url])
                .args(&args)
                .env_remove("NEXUSCRM_DATABASE_URL")
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{dialect}: {args:?}: {err}");
            assert!(err.contains(want), "{dialect}: {args:?}: {err}");
        }
        let huge = format!(r#"{{"blob": "{}"}}"#, "x".repeat(70 * 1024));
        let (ok, _, err) = cli(&t.url, &["pause", "resume", &token, "--payload", &huge]);
        assert!(!ok && err.contains("at most 65536"), "{dialect}: {err}");
        assert_eq!(show(&id)["state"], "paused", "{dialect}: nothing changed");
        // Resume, again with the same payload (acknowledged), then with another (refused).
        let (ok, out, err) = cli(
            &t.url,
            &["pause", "resume", &token, "--payload", r#"{"ok": true}"#],
        );
        assert!(ok && out.trim() == id, "{dialect}: {err}");
        let (ok, out, err) = cli(
            &t.url,
            &["pause", "resume", &token, "--payload", r#"{"ok": true}"#],
        );
        assert!(
            ok && out.trim() == id && err.contains("already resumed"),
            "{dialect}: {err}"
        );
        let (ok, _, err) = cli(
            &t.url,
            &["pause", "resume", &token, "--payload", r#"{"ok": false}"#],
        );
        assert!(!ok && err.contains("another payload"), "{dialect}: {err}");
        let shown = show(&id);
        assert_eq!(
            (&shown["state"], &shown["resume_payload"]["ok"]),
            (&serde_json::json!("resumable"), &serde_json::json!(true)),
            "{dialect}"
        );
        let (ok, out, _) = cli(&t.url, &["pause", "list", "--state", "resumable"]);
        assert!(ok && out.contains("run-7 / approve"), "{dialect}: {out}");
        // Cancel: only a paused step.
        let (ok, out, _) = cli(&t.url, &["pause", "create", "run-9", "s"]);
        assert!(ok);
        let other = out.lines().next().unwrap().to_owned();
        let (ok, out, err) = cli(&t.url, &["pause", "cancel", &other]);
        assert!(ok && out.contains("cancelled"), "{dialect}: {err}");
        let (ok, _, err) = cli(&t.url, &["pause", "cancel", &id]);
        assert!(!ok && err.contains("not paused"), "{dialect}: {err}");
        t.drop_database().await;
    }
}

/// A receiver for Paused Flow effects: hangs while `hang` is set, answers 200 otherwise, and
/// counts the requests.
async fn effect_receiver() -> (
    u16,
    Arc<std::sync::atomic::AtomicBool>,
    Arc<std::sync::atomic::AtomicU32>,
) {
    use std::sync::atomic::Ordering::SeqCst;
    let hang = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let count = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let (h, c) = (hang.clone(), count.clone());
    let app = axum::Router::new().route(
        "/effect",
        axum::routing::post(move || {
            let (h, c) = (h.clone(), c.clone());
            async move {
                c.fetch_add(1, SeqCst);
                if h.load(SeqCst) {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                }
                "done"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (port, hang, count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_flow_runs_in_the_worker_and_an_uncertain_effect_waits_for_a_person() {
    use std::sync::atomic::Ordering::SeqCst;
    let t = TestDb::create(Dialect::Sqlite, "pausedrun").await.unwrap();
    let (port, hang, count) = effect_receiver().await;
    let url = format!("http://127.0.0.1:{port}/effect");
    let mut w = start_with_env(
        &t.url,
        "0.5",
        &[],
        &[
            ("NEXUSCRM_PAUSED_CONNECTOR_URL", url.as_str()),
            ("NEXUSCRM_PAUSED_CONNECTOR_TIMEOUT_SECS", "0.3"),
            ("NEXUSCRM_PAUSED_LEASE_SECS", "1"),
            ("NEXUSCRM_PAUSED_GENERATION_POLL_SECS", "1"),
        ],
    );
    let (ok, out, err) = cli(&t.url, &["pause", "create", "run-1", "charge"]);
    assert!(ok, "{err}");
    let mut lines = out.lines();
    let id = lines.next().unwrap().to_owned();
    let token = lines.next().unwrap().to_owned();
    let (ok, _, err) = cli(
        &t.url,
        &["pause", "resume", &token, "--payload", "{\"ok\": 1}"],
    );
    assert!(ok, "{err}");
    let state = |id: &str| {
        let (ok, out, err) = cli(&t.url, &["pause", "show", id]);
        assert!(ok, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    // The hanging receiver: uncertain, with its evidence, within a few seconds.
    let deadline = Instant::now() + Duration::from_secs(30);
    let shown = loop {
        let s = state(&id);
        if s["state"] == "uncertain" {
            break s;
        }
        assert!(Instant::now() < deadline, "never uncertain: {s}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        shown["outcome"]["error"]
            .as_str()
            .unwrap()
            .contains("no answer within"),
        "{shown}"
    );
    let (_, snapshot) = get(w.port, "/snapshot").unwrap();
    assert!(
        snapshot.contains("paused=durable-critical/outcome-uncertain"),
        "{snapshot}"
    );
    let (_, metrics) = get(w.port, "/metrics").unwrap();
    assert!(
        metrics.contains("nexuscrm_paused_steps{family=\"paused\",state=\"uncertain\"} 1"),
        "{metrics}"
    );
    // Not resent while it waits for a person (longer than its lease).
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(count.load(SeqCst), 1, "the uncertain effect was not resent");
    // Resolve: a usage error without a decision, a conflict for a pause that is not
    // uncertain, then a retry that sends it once more and completes it.
    let (ok, _, err) = cli(&t.url, &["pause", "resolve", &id]);
    assert!(!ok && err.contains("required"), "{err}");
    hang.store(false, SeqCst);
    let (ok, out, err) = cli(&t.url, &["pause", "resolve", &id, "--retry", "--by", "ops"]);
    assert!(
        ok && out.contains("resumable (resolved by ops)"),
        "{out} {err}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = state(&id);
        if s["state"] == "completed" {
            assert_eq!(s["outcome"]["status"], 200, "{s}");
            break;
        }
        assert!(Instant::now() < deadline, "never completed: {s}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(count.load(SeqCst), 2, "sent again once, by the decision");
    let (ok, _, err) = cli(&t.url, &["pause", "resolve", &id, "--applied"]);
    assert!(!ok && err.contains("not uncertain"), "{err}");
    stop_clean(&mut w);
    t.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_shows_bulk_schedules_derived_values_and_a_paused_resumed_and_uncertain_step_twice()
 {
    let t = TestDb::create(Dialect::Sqlite, "demo").await.unwrap();
    for round in 0..2 {
        let out = Command::new(BIN)
            .env("NEXUSCRM_AUDIT_FILE", audit_file(&t.url))
            .args([
                "--database-url",
                &t.url,
                "demo",
                "--jobs",
                "2",
                "--rows",
                "50",
            ])
            .env_remove("NEXUSCRM_DATABASE_URL")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "round {round}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for want in [
            "100/100 rows, 2/2 jobs",
            "Scheduled Flow runs",
            "is UNCERTAIN",
            "never resent; evidence:",
            "completed (resolved by demo-operator)",
            "Formula View (formula=derived-reconcilable/convergent)",
            "formula weighted_amount",
            "weighted_amount      = 10 ",
            "(from revision 1, definition version ",
            "\"won: Initech\"",
            "Account roll-up",
            "Audit trail (audit=durable-critical/idempotent-or-observable): every event delivered",
            "record.applied",
            "the latest operator decisions:",
            "pause.resolved",
            "Usage: telemetry (best-effort): no exporter configured;",
        ] {
            assert!(stdout.contains(want), "round {round}: {want:?} in {stdout}");
        }
    }
    // The audit file holds one line per applied row of both rounds and one per operator
    // decision (three schedules created and deleted, one uncertain pause resolved, per round;
    // ownership taken once per family by the first round), each once.
    let file = audit_file(&t.url);
    let text = std::fs::read_to_string(&file).unwrap();
    let mut kinds = std::collections::BTreeMap::<String, i64>::new();
    let ids: Vec<String> = text
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            *kinds
                .entry(v["kind"].as_str().unwrap().to_owned())
                .or_default() += 1;
            if v["kind"] == "pause.resolved" {
                assert_eq!(v["actor"], "demo-operator", "{l}");
                assert_eq!(v["body"]["decision"], "applied", "{l}");
            }
            if v["kind"].as_str().unwrap().starts_with("schedule.") {
                assert_eq!(v["actor"], "demo", "{l}");
            }
            v["event_id"].as_str().unwrap().to_owned()
        })
        .collect();
    let changes: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM crm_record_change")
        .fetch_one(t.db.pool())
        .await
        .unwrap();
    assert_eq!(
        kinds["record.applied"], changes,
        "one line per applied row: {kinds:?}"
    );
    assert_eq!(changes, 200);
    assert_eq!(kinds["schedule.created"], 6, "{kinds:?}");
    assert_eq!(kinds["schedule.deleted"], 6, "{kinds:?}");
    assert_eq!(kinds["pause.resolved"], 2, "{kinds:?}");
    let decisions: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM audit_event WHERE kind <> 'record.applied'")
            .fetch_one(t.db.pool())
            .await
            .unwrap();
    assert_eq!(
        decisions,
        kinds
            .iter()
            .filter(|(k, _)| *k != "record.applied")
            .map(|(_, n)| n)
            .sum::<i64>(),
        "every decision's event is in the file, and only those: {kinds:?}"
    );
    let distinct: std::collections::HashSet<&String> = ids.iter().collect();
    assert_eq!(distinct.len(), ids.len(), "no line repeats");
    let (ok, out, err) = cli(&t.url, &["audit", "tail", "-n", "2"]);
    assert!(ok, "{err}");
    assert_eq!(out.lines().count(), 2, "{out}");
    let first: serde_json::Value = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["kind"] == "record.applied")
        .unwrap();
    let subject = first["subject"].as_str().unwrap();
    let (ok, out, err) = cli(&t.url, &["audit", "tail", "--subject", subject, "--json"]);
    assert!(ok, "{err}");
    assert_eq!(out.lines().count(), 1, "{out}");
    assert!(out.contains(first["event_id"].as_str().unwrap()), "{out}");
    let (ok, out, err) = cli(&t.url, &["audit", "pending"]);
    assert!(ok && out.contains("undelivered: 0"), "{out}{err}");
    let _ = std::fs::remove_file(&file);
    t.drop_database().await;
}

/// `POST path` with `body` and optional `Authorization`; the status and body.
fn post(port: u16, path: &str, auth: Option<&str>, body: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let auth = auth.map_or_else(String::new, |a| format!("Authorization: {a}\r\n"));
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}Content-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    Some((
        code,
        text.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_resume_endpoint_is_off_by_default_needs_its_secret_and_resumes_once() {
    use std::sync::atomic::Ordering::SeqCst;
    const SECRET: &str = "process-test-secret-0123456789abcdef";
    let t = TestDb::create(Dialect::Sqlite, "resumehttp").await.unwrap();
    let (port, hang, count) = effect_receiver().await;
    hang.store(false, SeqCst);
    let url = format!("http://127.0.0.1:{port}/effect");
    let (ok, out, err) = cli(&t.url, &["pause", "create", "run-1", "approve"]);
    assert!(ok, "{err}");
    let mut lines = out.lines();
    let id = lines.next().unwrap().to_owned();
    let token = lines.next().unwrap().to_owned();
    let body = format!(r#"{{"token": "{token}", "payload": {{"approved": true}}}}"#);

    // Off by default: no such route.
    let mut w = start_with_env(
        &t.url,
        "0.5",
        &[],
        &[("NEXUSCRM_PAUSED_CONNECTOR_URL", url.as_str())],
    );
    let bearer = format!("Bearer {SECRET}");
    let (code, _) = post(w.port, "/paused/resume", Some(&bearer), &body).unwrap();
    assert_eq!(code, 404, "the endpoint is off unless configured");
    stop_clean(&mut w);

    // On without a secret, or with a short one: a configuration error that names the key and
    // never repeats the secret.
    for (secret, says) in [
        (None, "has no secret"),
        (Some("short-secret"), "at least 32"),
    ] {
        let mut cmd = Command::new(BIN);
        cmd.env("NEXUSCRM_AUDIT_FILE", audit_file(&t.url));
        cmd.args([
            "--database-url",
            &t.url,
            "run",
            "--admin-addr",
            "127.0.0.1:0",
        ])
        .env("NEXUSCRM_PAUSED_RESUME_ENDPOINT", "true")
        .env_remove("NEXUSCRM_PAUSED_RESUME_SECRET");
        if let Some(s) = secret {
            cmd.env("NEXUSCRM_PAUSED_RESUME_SECRET", s);
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains("paused.resume_secret") && err.contains(says),
            "{err}"
        );
        assert!(
            !err.contains("short-secret"),
            "the secret is never printed: {err}"
        );
    }

    let mut w = start_with_env(
        &t.url,
        "0.5",
        &[],
        &[
            ("NEXUSCRM_PAUSED_CONNECTOR_URL", url.as_str()),
            ("NEXUSCRM_PAUSED_RESUME_ENDPOINT", "true"),
            ("NEXUSCRM_PAUSED_RESUME_SECRET", SECRET),
        ],
    );
    let (code, answer) = post(w.port, "/paused/resume", None, &body).unwrap();
    assert_eq!(code, 401, "{answer}");
    let (code, answer) = post(w.port, "/paused/resume", Some("Bearer wrong"), &body).unwrap();
    assert_eq!(code, 401, "{answer}");
    let (code, answer) = post(w.port, "/paused/resume", Some(&bearer), "{not json").unwrap();
    assert_eq!(code, 400, "{answer}");
    let (code, answer) = post(w.port, "/paused/resume", Some(&bearer), &body).unwrap();
    assert_eq!(code, 200, "{answer}");
    let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(
        (v["id"].to_string(), &v["first"]),
        (id.clone(), &serde_json::json!(true))
    );
    let (code, answer) = post(w.port, "/paused/resume", Some(&bearer), &body).unwrap();
    assert_eq!(code, 200, "{answer}");
    assert!(answer.contains("\"first\":false"), "{answer}");
    // The worker sends the effect once and completes the step.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (ok, out, err) = cli(&t.url, &["pause", "show", &id]);
        assert!(ok, "{err}");
        let s: serde_json::Value = serde_json::from_str(&out).unwrap();
        if s["state"] == "completed" {
            assert_eq!(
                s["resume_payload"],
                serde_json::json!({"approved": true}),
                "{s}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "never completed: {s}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(count.load(SeqCst), 1);
    stop_clean(&mut w);
    let log = w.log.lock().unwrap().clone();
    assert!(log.contains("POST /paused/resume"), "{log}");
    assert!(!log.contains(SECRET) && !log.contains(&token[4..]), "{log}");
    t.drop_database().await;
}

/// A local OTLP/HTTP (JSON) receiver: records every span's name and attributes.
async fn otlp_receiver() -> (u16, Arc<Mutex<Vec<(String, serde_json::Value)>>>) {
    let spans: Arc<Mutex<Vec<(String, serde_json::Value)>>> = Arc::default();
    let sink = spans.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: String| {
            let sink = sink.clone();
            async move {
                let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                let mut got = sink.lock().unwrap();
                for rs in v["resourceSpans"].as_array().into_iter().flatten() {
                    for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                        for span in ss["spans"].as_array().into_iter().flatten() {
                            let mut attrs = serde_json::Map::new();
                            for a in span["attributes"].as_array().into_iter().flatten() {
                                let value = a["value"]
                                    .as_object()
                                    .and_then(|o| o.values().next().cloned())
                                    .unwrap_or_default();
                                attrs.insert(a["key"].as_str().unwrap_or("").to_owned(), value);
                            }
                            got.push((
                                span["name"].as_str().unwrap_or("").to_owned(),
                                serde_json::Value::Object(attrs),
                            ));
                        }
                    }
                }
                "{}"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (port, spans)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_over_otlp_when_configured_with_family_item_and_generation() {
    let t = TestDb::create(Dialect::Sqlite, "otlp").await.unwrap();
    submit(&t.url, "traced", 120, 50);
    let (port, spans) = otlp_receiver().await;
    let endpoint = format!("http://127.0.0.1:{port}/v1/traces");
    let mut w = start_with_env(
        &t.url,
        "0.5",
        &[],
        &[("NEXUSCRM_OTLP_TRACES_ENDPOINT", endpoint.as_str())],
    );
    let db = Db::connect(&t.url).await.unwrap();
    wait_all_succeeded(&db, 1, Duration::from_secs(60)).await;
    // OTLP JSON carries 64-bit integers as strings.
    let job = scalar(&db, "SELECT id FROM bulk_job").await.to_string();
    // SIGTERM: the drain ends, and the exporter flushes what it holds before the exit.
    stop_clean(&mut w);
    let spans = spans.lock().unwrap().clone();
    let named = |name: &str| -> Vec<&serde_json::Value> {
        spans
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, a)| a)
            .collect()
    };
    for name in ["reconcile", "claim", "attempt", "next_work_at"] {
        assert!(
            named(name).iter().any(|a| a["family"] == "bulk"),
            "a {name} span of bulk among {spans:?}"
        );
    }
    let job_spans = named("bulk.job");
    assert!(
        job_spans
            .iter()
            .any(|a| a["item"] == job.as_str() && a["generation"] == "1"),
        "the job's attempt span with its id and generation: {spans:?}"
    );
    // 120 rows in segments of 50: three segment transactions, each a disposition span.
    let dispositions: Vec<_> = named("disposition")
        .into_iter()
        .filter(|a| a["family"] == "bulk" && a["item"] == job.as_str())
        .collect();
    assert_eq!(dispositions.len(), 3, "{spans:?}");
    assert!(named("reconcile").iter().any(|a| a["cause"] == "Startup"));
    db.close().await;
    t.drop_database().await;
}

#[test]
fn a_bad_otlp_endpoint_is_refused_before_anything_starts() {
    let out = Command::new(BIN)
        .env("NEXUSCRM_AUDIT_FILE", audit_file("sqlite::memory:"))
        .args(["--database-url", "sqlite::memory:", "run"])
        .env("NEXUSCRM_OTLP_TRACES_ENDPOINT", "collector:4318")
        .env_remove("NEXUSCRM_DATABASE_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("otlp_traces_endpoint"), "{err}");
}

/// Polls `f` every 100 ms until it is `Some`, for at most `within`.
async fn eventually<T>(within: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn formula_commands_define_show_and_drop_while_a_running_worker_derives_the_view() {
    for dialect in [Dialect::Sqlite, Dialect::Postgres, Dialect::Mysql] {
        let Some(t) = TestDb::create(dialect, "formulacli").await else {
            continue;
        };
        // Refused with the parser's position or the reason; nothing stored.
        let (ok, _, err) = cli(
            &t.url,
            &["formula", "define", "weighted", "--expr", "record.amount *"],
        );
        assert!(!ok && err.contains("1:16"), "{dialect}: {err}");
        let (ok, _, err) = cli(
            &t.url,
            &[
                "formula",
                "define",
                "w",
                "--expr",
                "record.a / record.b",
                "--sample",
                "{\"a\": 1, \"b\": 0}",
            ],
        );
        assert!(
            !ok && err.contains("fails on the sample record"),
            "{dialect}: {err}"
        );
        let (ok, _, err) = cli(
            &t.url,
            &["formula", "define", "w", "--expr", "1", "--sample", "{"],
        );
        assert!(
            !ok && err.contains("--sample is not JSON"),
            "{dialect}: {err}"
        );
        let (ok, out, _) = cli(&t.url, &["formula", "list"]);
        assert!(
            ok && out.contains("no formulas defined"),
            "{dialect}: {out}"
        );
        // Two formulas: one that evaluates, one that fails on every sample record (no `seats`).
        let (ok, out, err) = cli(
            &t.url,
            &[
                "formula",
                "define",
                "weighted",
                "--expr",
                "record.amount * record.probability / 100",
                "--sample",
                "{\"amount\": 100, \"probability\": 50}",
            ],
        );
        assert!(
            ok && out.starts_with("defined weighted (version "),
            "{dialect}: {out}{err}"
        );
        let (ok, _, err) = cli(
            &t.url,
            &[
                "formula",
                "define",
                "per_seat",
                "--expr",
                "record.amount / record.seats",
            ],
        );
        assert!(ok, "{dialect}: {err}");
        let (ok, out, _) = cli(&t.url, &["formula", "list"]);
        assert!(
            ok && out.contains("per_seat") && out.contains("weighted"),
            "{out}"
        );

        let mut w = start(&t.url, &[]);
        submit(&t.url, "fx", 20, 10);
        // fx-0: amount 100, probability 10 (the sample rows' fields).
        let shown = eventually(Duration::from_secs(60), "fx-0 derived", || {
            let (ok, out, _) = cli(&t.url, &["formula", "show", "fx-0"]);
            (ok && out.contains("revision 1") && !out.contains("stale") && out.contains("per_seat"))
                .then_some(out)
        })
        .await;
        assert!(
            shown.contains("weighted             = 10 "),
            "{dialect}: {shown}"
        );
        assert!(
            shown.contains("per_seat             = error: "),
            "{dialect}: {shown}"
        );
        assert!(
            shown.contains("(from revision 1, definition version "),
            "{shown}"
        );
        // The observations and metrics count the evaluation errors (read at most every 10 s).
        eventually(
            Duration::from_secs(30),
            "the error count in /snapshot",
            || {
                let (_, body) = get(w.port, "/snapshot")?;
                let v: serde_json::Value = serde_json::from_str(&body).ok()?;
                let f = v["families"]
                    .as_array()?
                    .iter()
                    .find(|f| f["family"] == "formula")?
                    .clone();
                (f["observations"]["records_with_errors"] == 20 && f["observations"]["stale"] == 0)
                    .then_some(())
            },
        )
        .await;
        let (_, metrics) = get(w.port, "/metrics").unwrap();
        assert!(
            metrics.contains("nexuscrm_formula_records_with_errors{family=\"formula\"} 20"),
            "{metrics}"
        );
        let (ok, out, _) = cli(&t.url, &["formula", "rollup"]);
        assert!(ok && out.contains("Acme"), "{out}");
        // A drop: the values leave the view as the running worker rederives.
        let (ok, out, _) = cli(&t.url, &["formula", "drop", "per_seat"]);
        assert!(ok && out.starts_with("dropped per_seat"), "{out}");
        let (ok, _, err) = cli(&t.url, &["formula", "drop", "per_seat"]);
        assert!(!ok && err.contains("no formula `per_seat`"), "{err}");
        eventually(Duration::from_secs(60), "per_seat gone from fx-19", || {
            let (ok, out, _) = cli(&t.url, &["formula", "show", "fx-19"]);
            (ok && !out.contains("per_seat") && out.contains("weighted") && !out.contains("stale"))
                .then_some(())
        })
        .await;
        let (ok, _, err) = cli(&t.url, &["formula", "show", "no-such-record"]);
        assert!(!ok && err.contains("has no entry in the view"), "{err}");
        stop_clean(&mut w);
        t.drop_database().await;
    }
}

/// A local OTLP/HTTP logs receiver: the usage records it accepted, as (tenant, kind, count).
async fn otlp_logs_receiver() -> (u16, Arc<Mutex<Vec<(String, String, i64)>>>) {
    let records: Arc<Mutex<Vec<(String, String, i64)>>> = Arc::default();
    let sink = records.clone();
    let app = axum::Router::new().route(
        "/v1/logs",
        axum::routing::post(move |body: String| {
            let sink = sink.clone();
            async move {
                let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                let mut got = sink.lock().unwrap();
                for rl in v["resourceLogs"].as_array().into_iter().flatten() {
                    for sl in rl["scopeLogs"].as_array().into_iter().flatten() {
                        for rec in sl["logRecords"].as_array().into_iter().flatten() {
                            let attr = |k: &str| {
                                rec["attributes"]
                                    .as_array()
                                    .into_iter()
                                    .flatten()
                                    .find(|a| a["key"] == k)
                                    .and_then(|a| a["value"].as_object())
                                    .and_then(|o| o.values().next().cloned())
                                    .unwrap_or_default()
                            };
                            let count = match attr("count") {
                                serde_json::Value::String(s) => s.parse().unwrap_or(-1),
                                v => v.as_i64().unwrap_or(-1),
                            };
                            got.push((
                                attr("tenant").as_str().unwrap_or("").to_owned(),
                                attr("kind").as_str().unwrap_or("").to_owned(),
                                count,
                            ));
                        }
                    }
                }
                "{}"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (port, records)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_events_reach_a_local_otlp_receiver_and_drops_are_counted_by_reason() {
    let t = TestDb::create(Dialect::Sqlite, "usage").await.unwrap();
    submit(&t.url, "usage", 120, 50);
    let (port, records) = otlp_logs_receiver().await;
    let endpoint = format!("http://127.0.0.1:{port}/v1/logs");
    let mut w = start_with_env(
        &t.url,
        "0.5",
        &[],
        &[
            ("NEXUSCRM_TELEMETRY_ENDPOINT", endpoint.as_str()),
            ("NEXUSCRM_TELEMETRY_TENANT", "acme"),
            ("NEXUSCRM_TELEMETRY_INTERVAL_MS", "20"),
        ],
    );
    let db = Db::connect(&t.url).await.unwrap();
    wait_all_succeeded(&db, 1, Duration::from_secs(60)).await;
    // Three segments (50, 50, 20 rows): three events, exported within a few intervals.
    let exported = |text: &str| -> Option<u64> {
        text.lines()
            .find(|l| l.starts_with("telemetry_exported_total{"))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let metrics = loop {
        let (_, m) = get(w.port, "/metrics").unwrap();
        if exported(&m) == Some(3) {
            break m;
        }
        assert!(Instant::now() < deadline, "not exported: {m}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for reason in [
        "overflow",
        "exporter_error",
        "shutdown",
        "crash",
        "no_exporter",
    ] {
        assert!(
            metrics.contains(&format!(
                "telemetry_dropped_total{{family=\"telemetry\",reason=\"{reason}\"}} 0"
            )),
            "{reason} in {metrics}"
        );
    }
    let (_, snapshot) = get(w.port, "/snapshot").unwrap();
    let v: serde_json::Value = serde_json::from_str(&snapshot).unwrap();
    let tel = &v["telemetry"];
    assert_eq!(tel["best_effort"], true, "{tel}");
    assert_eq!(
        tel["declaration"], "telemetry=best-effort/loss-tolerant",
        "{tel}"
    );
    assert_eq!(
        (tel["emitted"].as_u64(), tel["exported"].as_u64()),
        (Some(3), Some(3)),
        "{tel}"
    );
    assert!(
        tel["summary"]
            .as_str()
            .unwrap()
            .contains("best-effort, may be incomplete"),
        "{tel}"
    );
    let (_, families) = get(w.port, "/families").unwrap();
    let f: serde_json::Value = serde_json::from_str(&families).unwrap();
    let paths = f["paths"].as_array().cloned().unwrap_or_default();
    let telemetry = paths
        .iter()
        .find(|p| p["family"] == "telemetry")
        .unwrap_or_else(|| panic!("telemetry in {families}"));
    assert_eq!(telemetry["running"], true, "{families}");
    stop_clean(&mut w);
    let mut got = records.lock().unwrap().clone();
    got.sort();
    assert_eq!(
        got,
        [
            ("acme".to_owned(), "bulk.rows_applied".to_owned(), 20),
            ("acme".to_owned(), "bulk.rows_applied".to_owned(), 50),
            ("acme".to_owned(), "bulk.rows_applied".to_owned(), 50),
        ]
    );
    db.close().await;
    t.drop_database().await;
}

#[test]
fn a_bad_telemetry_setting_is_refused_before_anything_starts() {
    for (key, value, named) in [
        (
            "NEXUSCRM_TELEMETRY_ENDPOINT",
            "collector:4318/v1/logs",
            "telemetry.endpoint",
        ),
        ("NEXUSCRM_TELEMETRY_BUFFER", "0", "telemetry.buffer"),
        (
            "NEXUSCRM_TELEMETRY_TIMEOUT_SECS",
            "0",
            "telemetry.timeout_secs",
        ),
    ] {
        let out = Command::new(BIN)
            .env("NEXUSCRM_AUDIT_FILE", audit_file("sqlite::memory:"))
            .args(["--database-url", "sqlite::memory:", "run"])
            .env(key, value)
            .env_remove("NEXUSCRM_DATABASE_URL")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{key}={value}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(named), "{key}={value}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_trail_goes_to_an_http_receiver_when_configured() {
    let t = TestDb::create(Dialect::Sqlite, "audithttp").await.unwrap();
    submit(&t.url, "audited", 30, 10);
    // A receiver that deduplicates by event id and answers its first request 503 (after
    // keeping it): the worker sends that batch again under the same key.
    let seen: Arc<Mutex<(Vec<String>, std::collections::BTreeSet<String>)>> = Arc::default();
    let sink = seen.clone();
    let app = axum::Router::new().route(
        "/audit",
        axum::routing::post(move |headers: axum::http::HeaderMap, body: String| {
            let sink = sink.clone();
            async move {
                let key = headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned();
                let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                let mut s = sink.lock().unwrap();
                s.0.push(key);
                for e in v["events"].as_array().into_iter().flatten() {
                    s.1.insert(e["event_id"].as_str().unwrap_or("").to_owned());
                }
                if s.0.len() == 1 {
                    axum::http::StatusCode::SERVICE_UNAVAILABLE
                } else {
                    axum::http::StatusCode::OK
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/audit", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let mut w = start_with_env(
        &t.url,
        "0.5",
        &[],
        &[
            ("NEXUSCRM_AUDIT_SINK", "http"),
            ("NEXUSCRM_AUDIT_HTTP_URL", url.as_str()),
        ],
    );
    let db = Db::connect(&t.url).await.unwrap();
    wait_all_succeeded(&db, 1, Duration::from_secs(60)).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while scalar(
        &db,
        "SELECT COUNT(*) FROM audit_event WHERE delivered_at IS NULL",
    )
    .await
        > 0
    {
        assert!(
            Instant::now() < deadline,
            "audit not delivered: {}",
            w.log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_clean(&mut w);
    let events = scalar(&db, "SELECT COUNT(*) FROM audit_event").await;
    let (keys, ids) = seen.lock().unwrap().clone();
    assert_eq!(ids.len() as i64, events, "every event reached the receiver");
    assert!(
        ids.iter().filter(|i| i.starts_with("bulk-")).count() == 30,
        "{ids:?}"
    );
    assert!(
        keys.len() >= 2 && keys[0] == keys[1],
        "resent under its key: {keys:?}"
    );
    // No file was written: the trail went over HTTP.
    assert!(!std::path::Path::new(&audit_file(&t.url)).exists());
    db.close().await;
    t.drop_database().await;
}
