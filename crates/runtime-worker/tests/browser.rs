//! The operators' console in a real browser: Debian's headless Chromium, driven over WebDriver
//! (`chromedriver`) by `fantoccini`, against the real Runtime Worker binary on SQLite.
//!
//! It loads every page and checks its figures against the database, watches the families page
//! update in place from server-sent events (no reload), resolves an uncertain pause and pauses
//! a schedule through their forms and checks the store, and is refused without the secret.
//! Screenshots of the main pages go to `NEXUSCRM_CONSOLE_SCREENSHOTS` (an absolute directory;
//! the README's come from `NEXUSCRM_CONSOLE_SCREENSHOTS=$PWD/docs/console cargo test -p
//! nexuscrm-runtime-worker --test browser`), else to a temporary directory.
//!
//! `.ci/run` installs `chromium` and `chromium-driver`; under CI a missing browser fails the
//! test, run by a person without one it is skipped with a loud message.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use nexuscrm_persistence::testing::TestDb;
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
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const SECRET: &str = "browser-test-secret-0123456789abcdef";
/// How long any one thing may take on a loaded 2-core machine before the test gives up.
const PATIENCE: Duration = Duration::from_secs(60);

/// A child process killed when dropped (a failing test leaves nothing behind).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether the browser is here; under CI its absence is a failure.
fn browser_available() -> bool {
    let here =
        std::path::Path::new(CHROMIUM).exists() && std::path::Path::new(CHROMEDRIVER).exists();
    if !here {
        assert!(
            std::env::var_os("CI").is_none(),
            "{CHROMIUM} or {CHROMEDRIVER} is missing: .ci/run installs chromium and chromium-driver"
        );
        eprintln!(
            "\n*** SKIPPED: the console browser test needs Debian's chromium and chromium-driver \
             ({CHROMIUM}, {CHROMEDRIVER}): apt-get install chromium chromium-driver ***\n"
        );
    }
    here
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `chromedriver` on a free port, once it answers `/status`.
fn chromedriver() -> (Killed, u16) {
    let port = free_port();
    let child = Command::new(CHROMEDRIVER)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start chromedriver");
    let deadline = Instant::now() + PATIENCE;
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "chromedriver never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    (Killed(child), port)
}

/// The worker on `url` with the console secret and a Paused Flow connector to `effect_url`;
/// returns it and its admin port.
fn worker(url: &str, effect_url: &str) -> (Killed, u16, Arc<Mutex<String>>) {
    let mut child = Command::new(BIN)
        .env("NEXUSCRM_AUDIT_FILE", audit_file(url))
        .args(["--database-url", url, "run", "--admin-addr", "127.0.0.1:0"])
        .env_remove("NEXUSCRM_DATABASE_URL")
        .env("NEXUSCRM_CONSOLE_SECRET", SECRET)
        .env("NEXUSCRM_PAUSED_CONNECTOR_URL", effect_url)
        .env("NEXUSCRM_PAUSED_CONNECTOR_TIMEOUT_SECS", "0.3")
        .env("NEXUSCRM_PAUSED_LEASE_SECS", "1")
        .env("NEXUSCRM_PAUSED_GENERATION_POLL_SECS", "1")
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
        let marker = "admin listening on 127.0.0.1:";
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(i) = line.find(marker) {
                let port: String = line[i + marker.len()..]
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect();
                if let (Some(tx), Ok(p)) = (tx.take(), port.parse::<u16>()) {
                    let _ = tx.send(p);
                }
            }
            sink.lock().unwrap().push_str(&(line + "\n"));
        }
    });
    let port = rx.recv_timeout(PATIENCE).unwrap_or_else(|_| {
        panic!(
            "the worker never served admin HTTP: {}",
            log.lock().unwrap()
        )
    });
    (Killed(child), port, log)
}

fn cli(url: &str, args: &[&str]) -> String {
    let out = Command::new(BIN)
        .env("NEXUSCRM_AUDIT_FILE", audit_file(url))
        .args(["--database-url", url])
        .args(args)
        .env_remove("NEXUSCRM_DATABASE_URL")
        .output()
        .expect("run the CLI");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A receiver that never answers: every effect sent to it ends uncertain.
async fn hanging_receiver() -> u16 {
    let app = axum::Router::new().route(
        "/effect",
        axum::routing::post(|| async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            "never"
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    port
}

async fn scalar(db: &Db, sql: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(db.pool())
        .await
        .unwrap()
}

async fn text_of(db: &Db, sql: &str) -> String {
    sqlx::query_scalar::<_, String>(sql)
        .fetch_one(db.pool())
        .await
        .unwrap()
}

/// Polls `check` (async) every 100 ms until it is true, or fails with `what`.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + PATIENCE;
    while !check().await {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn screenshot_dir() -> PathBuf {
    let dir = std::env::var_os("NEXUSCRM_CONSOLE_SCREENSHOTS").map_or_else(
        || std::env::temp_dir().join(format!("nexuscrm-console-{}", std::process::id())),
        PathBuf::from,
    );
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn screenshot(browser: &Client, dir: &std::path::Path, name: &str) {
    let png = browser.screenshot().await.unwrap();
    assert!(png.starts_with(b"\x89PNG"), "{name}: not a PNG");
    std::fs::write(dir.join(format!("{name}.png")), png).unwrap();
}

/// The rendered text of the first element matching `css`, once there is one. Read in the
/// page by script, so a navigation or a live update between finding and reading cannot make
/// it stale.
async fn text(browser: &Client, css: &str) -> String {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let got = browser
            .execute(
                "const e = document.querySelector(arguments[0]); return e ? e.innerText : null;",
                vec![serde_json::json!(css)],
            )
            .await;
        if let Ok(serde_json::Value::String(t)) = got {
            return t;
        }
        assert!(Instant::now() < deadline, "{css}: never found ({got:?})");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits for the element `at` names, then clicks it.
async fn click(browser: &Client, at: Locator<'_>) {
    browser
        .wait()
        .at_most(PATIENCE)
        .for_element(at)
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

/// Types `keys` into the (emptied) form field named `name`.
async fn fill(browser: &Client, name: &str, keys: &str) {
    let field = browser
        .wait()
        .at_most(PATIENCE)
        .for_element(Locator::Css(&format!("input[name={name}]")))
        .await
        .unwrap();
    field.clear().await.unwrap();
    field.send_keys(keys).await.unwrap();
}

/// Clicks the form's submit button and waits for the answer page, whose `h1` satisfies `want`
/// (the form page's own `h1` never does), then returns that `h1`.
async fn submit(browser: &Client, want: impl Fn(&str) -> bool) -> String {
    click(browser, Locator::Css("button[type=submit]")).await;
    let deadline = Instant::now() + PATIENCE;
    loop {
        let h1 = text(browser, "h1").await;
        if want(&h1) {
            return h1;
        }
        assert!(
            Instant::now() < deadline,
            "the answer page never came: {h1:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_in_headless_chromium_shows_the_store_and_acts_only_with_the_secret() {
    if !browser_available() {
        return;
    }
    let t = TestDb::create(Dialect::Sqlite, "browser").await.unwrap();
    let receiver = hanging_receiver().await;
    let (_worker, port, log) = worker(&t.url, &format!("http://127.0.0.1:{receiver}/effect"));
    let base = format!("http://127.0.0.1:{port}");

    // Work of every family: a job with a rejected row, a job of 200 rows, two schedules, and a
    // pause resumed into a receiver that never answers (so it ends uncertain).
    let dir = std::env::temp_dir().join(format!("nexuscrm-browser-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let csv = dir.join("contacts.csv");
    std::fs::write(
        &csv,
        "record_key,name,email\nc-1,Ada,ada@example.com\nc-2,<b>Bob</b>,not-an-email\nc-3,Cy,cy@example.com\n",
    )
    .unwrap();
    cli(
        &t.url,
        &[
            "bulk",
            "submit",
            "--key",
            "contacts",
            "--file",
            csv.to_str().unwrap(),
        ],
    );
    cli(
        &t.url,
        &["bulk", "submit", "--key", "sample-200", "--sample", "200"],
    );
    cli(
        &t.url,
        &[
            "schedule",
            "create",
            "nightly-report",
            "--flow",
            "report",
            "--cron",
            "0 0 3 * * *",
            "--zone",
            "Europe/Paris",
        ],
    );
    cli(
        &t.url,
        &[
            "schedule",
            "create",
            "heartbeat",
            "--flow",
            "ping",
            "--every",
            "1s",
        ],
    );
    let created = cli(&t.url, &["pause", "create", "order-42", "charge"]);
    let mut lines = created.lines();
    let pause_id: i64 = lines.next().unwrap().trim().parse().unwrap();
    let token = lines.next().unwrap().trim().to_owned();
    cli(
        &t.url,
        &["pause", "resume", &token, "--payload", "{\"amount\": 42}"],
    );
    eventually("both jobs succeeded", || async {
        scalar(
            &t.db,
            "SELECT COUNT(*) FROM bulk_job WHERE state = 'succeeded'",
        )
        .await
            == 2
    })
    .await;
    eventually("the pause is uncertain", || async {
        scalar(
            &t.db,
            "SELECT COUNT(*) FROM paused_step WHERE state = 'uncertain'",
        )
        .await
            == 1
    })
    .await;

    let (_driver, driver_port) = chromedriver();
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": CHROMIUM,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,900"],
        }),
    );
    let browser = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{driver_port}"))
        .await
        .expect("a WebDriver session in headless Chromium");
    let shots = screenshot_dir();

    // Families: live over server-sent events, without a reload (a marker set on the page
    // survives), and the figures agree with the database.
    browser.goto(&format!("{base}/console")).await.unwrap();
    browser
        .execute("window.__noReload = 'still here';", vec![])
        .await
        .unwrap();
    let started = text(&browser, "#live").await;
    let deadline = Instant::now() + PATIENCE;
    loop {
        let live = text(&browser, "#live").await;
        let observed = text(&browser, r#"[data-live="paused:observed"]"#).await;
        if live.starts_with("updated") && observed.contains("\"uncertain\": 1") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the families page never updated live: {live:?} (was {started:?}); {observed}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let marker = browser
        .execute("return window.__noReload;", vec![])
        .await
        .unwrap();
    assert_eq!(marker, "still here", "updated in place, not reloaded");
    for family in ["bulk", "flow", "paused"] {
        let state = text(&browser, &format!(r#"[data-live="{family}:state"]"#)).await;
        assert_eq!(state, "ready", "{family}");
    }
    let bulk_observed = text(&browser, r#"[data-live="bulk:observed"]"#).await;
    assert!(
        bulk_observed.contains("\"succeeded\": 2"),
        "{bulk_observed}"
    );
    let page = browser.source().await.unwrap();
    assert!(
        page.contains("crates/paused/tests/crash_matrix.rs"),
        "proofs shown"
    );
    screenshot(&browser, &shots, "families").await;

    // Bulk jobs: every job in the database is listed with its figures.
    browser.goto(&format!("{base}/console/bulk")).await.unwrap();
    let rows = browser
        .find_all(Locator::Css("tr[data-job]"))
        .await
        .unwrap();
    assert_eq!(
        rows.len() as i64,
        scalar(&t.db, "SELECT COUNT(*) FROM bulk_job").await
    );
    for row in rows {
        let id: i64 = row
            .attr("data-job")
            .await
            .unwrap()
            .unwrap()
            .parse()
            .unwrap();
        let applied = row
            .find(Locator::Css("td.applied"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let want = text_of(
            &t.db,
            &format!(
                "SELECT CAST(applied_rows AS TEXT) || ' / ' || CAST(total_rows AS TEXT) \
                 FROM bulk_job WHERE id = {id}"
            ),
        )
        .await;
        assert_eq!(applied, want, "job {id}");
    }
    screenshot(&browser, &shots, "bulk-jobs").await;
    // The job with the bad row: its reason, from bulk_row_error, escaped.
    let contacts = scalar(
        &t.db,
        "SELECT id FROM bulk_job WHERE idempotency_key = 'contacts'",
    )
    .await;
    browser
        .goto(&format!("{base}/console/bulk/{contacts}"))
        .await
        .unwrap();
    let reasons = text(&browser, "#row-errors").await;
    let stored = text_of(&t.db, "SELECT message FROM bulk_row_error").await;
    assert!(
        reasons.contains(&stored) && stored.contains("invalid email"),
        "{reasons}"
    );
    assert_eq!(text(&browser, "#applied").await, "2 / 3");
    assert_eq!(text(&browser, "#rejected").await, "1");
    screenshot(&browser, &shots, "bulk-job").await;

    // Schedules: listed as stored; the heartbeat's runs appear on its page.
    browser
        .goto(&format!("{base}/console/schedules"))
        .await
        .unwrap();
    let listed = browser
        .find_all(Locator::Css("tr[data-schedule]"))
        .await
        .unwrap()
        .len();
    assert_eq!(listed, 2);
    let table = text(&browser, "#schedules").await;
    assert!(
        table.contains("cron '0 0 3 * * *' in Europe/Paris"),
        "{table}"
    );
    screenshot(&browser, &shots, "schedules").await;
    let nightly = scalar(
        &t.db,
        "SELECT id FROM flow_schedule WHERE name = 'nightly-report'",
    )
    .await;
    let heartbeat = scalar(
        &t.db,
        "SELECT id FROM flow_schedule WHERE name = 'heartbeat'",
    )
    .await;
    eventually("the heartbeat reserved runs", || async {
        scalar(&t.db, "SELECT COUNT(*) FROM flow_run").await >= 2
    })
    .await;
    browser
        .goto(&format!("{base}/console/schedules/{heartbeat}"))
        .await
        .unwrap();
    assert!(text(&browser, "#runs").await.contains("occurrence"));

    // Pausing a schedule: refused without the secret, done with it.
    browser
        .goto(&format!("{base}/console/schedules/{nightly}"))
        .await
        .unwrap();
    submit(&browser, |h| h == "Refused").await;
    let refused = text(&browser, "p.bad").await;
    assert!(refused.contains("secret is wrong or missing"), "{refused}");
    let state = || async {
        text_of(
            &t.db,
            &format!("SELECT state FROM flow_schedule WHERE id = {nightly}"),
        )
        .await
    };
    assert_eq!(state().await, "active", "refused: nothing changed");
    browser
        .goto(&format!("{base}/console/schedules/{nightly}"))
        .await
        .unwrap();
    fill(&browser, "secret", SECRET).await;
    let h1 = submit(&browser, |h| h.ends_with("paused") || h == "Refused").await;
    assert_eq!(h1, "Schedule nightly-report paused");
    assert_eq!(text(&browser, "#state").await, "paused");
    assert_eq!(state().await, "paused");

    // The uncertain pause: its evidence, then the confirmation page, refused with a wrong
    // secret, resolved with the right one.
    browser
        .goto(&format!("{base}/console/paused?state=uncertain"))
        .await
        .unwrap();
    let listed = text(&browser, "table").await;
    assert!(
        listed.contains("order-42 / charge") && listed.contains("no answer within"),
        "{listed}"
    );
    screenshot(&browser, &shots, "uncertain").await;
    click(&browser, Locator::LinkText("resolve…")).await;
    click(&browser, Locator::Css("input[value=applied]")).await;
    screenshot(&browser, &shots, "resolve").await;
    let pause_state = || async {
        text_of(
            &t.db,
            &format!("SELECT state FROM paused_step WHERE id = {pause_id}"),
        )
        .await
    };
    fill(&browser, "secret", "not-the-secret").await;
    submit(&browser, |h| h == "Refused").await;
    let refused = text(&browser, "p.bad").await;
    assert!(refused.contains("secret is wrong or missing"), "{refused}");
    assert_eq!(pause_state().await, "uncertain", "refused: nothing changed");
    browser.back().await.unwrap();
    click(&browser, Locator::Css("input[value=applied]")).await;
    fill(&browser, "secret", SECRET).await;
    let done = submit(&browser, |h| h.ends_with("resolved") || h == "Refused").await;
    assert_eq!(done, format!("Pause {pause_id} resolved"));
    assert_eq!(pause_state().await, "completed");
    let by = text_of(
        &t.db,
        &format!("SELECT outcome FROM paused_step WHERE id = {pause_id}"),
    )
    .await;
    assert!(by.contains("console"), "the decision names its maker: {by}");
    // Each decision wrote one audit event in its transaction, by `console`; the refused
    // attempts wrote none.
    let decisions: Vec<(String, String, String)> = nexuscrm_audit::outbox(&t.db)
        .await
        .unwrap()
        .into_iter()
        .filter(|l| l.kind == "pause.resolved" || l.kind == "schedule.paused")
        .map(|l| (l.kind, l.subject, l.actor))
        .collect();
    assert_eq!(
        decisions,
        [
            (
                "schedule.paused".to_owned(),
                format!("schedule:{nightly}"),
                "console".to_owned()
            ),
            (
                "pause.resolved".to_owned(),
                format!("pause:{pause_id}"),
                "console".to_owned()
            ),
        ],
        "the console's decisions in the audit outbox"
    );

    browser.close().await.unwrap();
    assert!(
        !log.lock().unwrap().contains(SECRET),
        "the console secret never reaches the log"
    );
    eprintln!("console screenshots in {}", shots.display());
    t.drop_database().await;
}
