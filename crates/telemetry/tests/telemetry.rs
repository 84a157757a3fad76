//! Telemetry against a local OTLP/HTTP receiver started by each test: the kit's loss-tolerant
//! harness (clean, lossy receiver, a crash before and after a batch), a full buffer counted as
//! overflow, no exporter, and a hung receiver that never delays a Bulk segment on SQLite,
//! PostgreSQL and MariaDB.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use nexuscrm_bulk::{Bulk, BulkConfig, BulkOptions, NewJob, RowInput};
use nexuscrm_persistence::Dialect;
use nexuscrm_persistence::testing::TestDb;
use nexuscrm_telemetry::{
    DECLARATION, DropReason, OtlpExporter, Telemetry, TelemetryOptions, UsageEvent,
};
use nexuscrm_worker::fault::Faults;
use nexuscrm_worker::{Config, Controller, Declaration};
use nexuscrm_worker_test::harness::{Accounting, LossHarness, LossTolerantFamily};
use tokio_util::sync::CancellationToken;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How the receiver answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// 200 for every request.
    Accept,
    /// 500 for every second request (its records are not kept).
    FailEverySecond,
    /// Never answers.
    Hang,
}

/// A local OTLP/HTTP logs receiver: keeps the records of the requests it accepts.
#[derive(Clone)]
struct Receiver {
    mode: Arc<Mutex<Mode>>,
    requests: Arc<AtomicU64>,
    /// Accepted records: (tenant, kind, count).
    records: Arc<Mutex<Vec<(String, String, i64)>>>,
    addr: SocketAddr,
}

impl Receiver {
    async fn start(mode: Mode) -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let r = Receiver {
            mode: Arc::new(Mutex::new(mode)),
            requests: Arc::new(AtomicU64::new(0)),
            records: Arc::new(Mutex::new(Vec::new())),
            addr: listener.local_addr().unwrap(),
        };
        let app = Router::new()
            .route("/v1/logs", post(receive))
            .with_state(r.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        r
    }

    fn endpoint(&self) -> String {
        format!("http://{}/v1/logs", self.addr)
    }

    fn received(&self) -> u64 {
        self.records.lock().unwrap().len() as u64
    }
}

async fn receive(State(r): State<Receiver>, body: String) -> StatusCode {
    let n = r.requests.fetch_add(1, Ordering::SeqCst) + 1;
    let mode = *r.mode.lock().unwrap();
    match mode {
        Mode::Hang => std::future::pending::<StatusCode>().await,
        Mode::FailEverySecond if n % 2 == 0 => StatusCode::INTERNAL_SERVER_ERROR,
        _ => {
            let Ok(doc) = serde_json::from_str::<serde_json::Value>(&body) else {
                return StatusCode::BAD_REQUEST;
            };
            let mut got = Vec::new();
            for rl in doc["resourceLogs"].as_array().into_iter().flatten() {
                for sl in rl["scopeLogs"].as_array().into_iter().flatten() {
                    for rec in sl["logRecords"].as_array().into_iter().flatten() {
                        let attr = |k: &str| {
                            rec["attributes"]
                                .as_array()
                                .into_iter()
                                .flatten()
                                .find(|a| a["key"] == k)
                                .map(|a| a["value"].clone())
                                .unwrap_or_default()
                        };
                        let count = match &attr("count")["intValue"] {
                            serde_json::Value::String(s) => s.parse().unwrap_or(-1),
                            v => v.as_i64().unwrap_or(-1),
                        };
                        got.push((
                            attr("tenant")["stringValue"]
                                .as_str()
                                .unwrap_or("")
                                .to_owned(),
                            attr("kind")["stringValue"]
                                .as_str()
                                .unwrap_or("")
                                .to_owned(),
                            count,
                        ));
                    }
                }
            }
            r.records.lock().unwrap().extend(got);
            StatusCode::OK
        }
    }
}

/// Telemetry exporting to `r` in batches of 10, flushed every 10 ms.
fn telemetry_to(r: &Receiver, buffer: usize, faults: Faults) -> Telemetry {
    let exporter = OtlpExporter::new(&r.endpoint(), Duration::from_secs(10)).unwrap();
    Telemetry::start(
        exporter,
        TelemetryOptions::default()
            .buffer(buffer)
            .batch(10)
            .interval(Duration::from_millis(10))
            .faults(faults),
    )
    .unwrap()
}

async fn shutdown(t: &Telemetry) -> nexuscrm_telemetry::TelemetryReport {
    let t = t.clone();
    tokio::task::spawn_blocking(move || t.shutdown(Duration::from_secs(30)))
        .await
        .unwrap()
}

/// The telemetry path under the kit's loss harness.
struct TelemetryFamily;

struct Fixture {
    receiver: Receiver,
    telemetry: Mutex<Option<Telemetry>>,
}

impl LossTolerantFamily for TelemetryFamily {
    type Fixture = Fixture;

    fn label(&self) -> String {
        "telemetry/otlp-http".into()
    }

    fn declaration(&self) -> Declaration {
        DECLARATION
    }

    async fn fixture(&self, lossy: bool) -> Result<Fixture, BoxError> {
        let mode = if lossy {
            Mode::FailEverySecond
        } else {
            Mode::Accept
        };
        Ok(Fixture {
            receiver: Receiver::start(mode).await,
            telemetry: Mutex::new(None),
        })
    }

    async fn emit(&self, f: &Fixture, n: u64, faults: Faults) -> Result<(), BoxError> {
        let t = telemetry_to(&f.receiver, 10_000, faults.clone());
        *f.telemetry.lock().unwrap() = Some(t.clone());
        for i in 0..n {
            t.emit(UsageEvent::new(
                format!("tenant-{}", i % 3),
                "bulk.rows_applied",
                i,
            ));
        }
        let report = shutdown(&t).await;
        if report.dropped(DropReason::Crash) > 0 {
            return Err(format!("injected crash ({:?})", faults.fired()).into());
        }
        Ok(())
    }

    async fn accounting(&self, f: &Fixture) -> Result<Accounting, BoxError> {
        let t = f.telemetry.lock().unwrap().clone().ok_or("never emitted")?;
        let r = t.report();
        Ok(Accounting {
            delivered: r.exported,
            lost: r.dropped_total() + r.pending,
            // Best-effort: never a claim of completeness.
            complete: false,
        })
    }

    async fn delivered(&self, f: &Fixture) -> Result<u64, BoxError> {
        Ok(f.receiver.received())
    }
}

#[test]
fn telemetry_passes_the_kits_loss_harness_against_a_local_otlp_receiver() {
    let report = LossHarness::new(TelemetryFamily).run();
    report.assert_passed();
    assert_eq!(report.cases.len(), 4, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_reach_the_receiver_as_otlp_log_records_with_their_attributes() {
    let r = Receiver::start(Mode::Accept).await;
    let t = telemetry_to(&r, 100, Faults::none());
    t.emit(UsageEvent::new("acme", "bulk.rows_applied", 42));
    t.emit(UsageEvent::new("globex", "bulk.rows_rejected", 3));
    let report = shutdown(&t).await;
    assert_eq!((report.emitted, report.exported), (2, 2), "{report}");
    assert_eq!(report.dropped_total(), 0, "{report}");
    let mut got = r.records.lock().unwrap().clone();
    got.sort();
    assert_eq!(
        got,
        [
            ("acme".to_owned(), "bulk.rows_applied".to_owned(), 42),
            ("globex".to_owned(), "bulk.rows_rejected".to_owned(), 3),
        ]
    );
    let text = report.to_string();
    assert!(text.contains("best-effort"), "{text}");
    assert!(text.contains("2 exported, 0 dropped"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_buffer_drops_and_counts_overflow_and_shutdown_counts_what_was_left() {
    let r = Receiver::start(Mode::Hang).await;
    let t = telemetry_to(&r, 20, Faults::none());
    for i in 0..100 {
        t.emit(UsageEvent::new("acme", "bulk.rows_applied", i));
    }
    // The thread holds one batch of 10 in a request that never ends; 20 more fill the buffer.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while r.requests.load(Ordering::SeqCst) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "no request came");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = t.report();
    assert_eq!(before.emitted, 100);
    assert!(
        before.dropped(DropReason::Overflow) >= 70,
        "at most 10 in flight and 20 buffered: {before}"
    );
    assert_eq!(
        before.dropped(DropReason::Overflow) + before.pending,
        100,
        "{before}"
    );
    let t2 = t.clone();
    let after = tokio::task::spawn_blocking(move || t2.shutdown(Duration::from_millis(200)))
        .await
        .unwrap();
    assert_eq!(after.exported, 0, "{after}");
    assert_eq!(after.pending, 0, "{after}");
    assert_eq!(
        after.dropped(DropReason::Overflow) + after.dropped(DropReason::Shutdown),
        100,
        "every event is accounted for: {after}"
    );
    // Emits after shutdown are dropped and counted too.
    t.emit(UsageEvent::new("acme", "late", 1));
    assert_eq!(
        t.report().dropped(DropReason::Shutdown),
        after.dropped(DropReason::Shutdown) + 1
    );
    assert!(after.to_string().contains("may be incomplete"), "{after}");
}

#[test]
fn without_an_exporter_every_event_is_counted_as_dropped_and_bad_endpoints_are_refused() {
    let t = Telemetry::disabled();
    t.emit(UsageEvent::new("acme", "bulk.rows_applied", 1));
    let r = t.report();
    assert_eq!(
        (r.emitted, r.exported, r.dropped(DropReason::NoExporter)),
        (1, 0, 1)
    );
    assert!(r.to_string().contains("no exporter configured"), "{r}");
    for bad in [
        "",
        "ftp://collector/v1/logs",
        "http://",
        "localhost:4318/v1/logs",
    ] {
        let e = OtlpExporter::new(bad, Duration::from_secs(1)).unwrap_err();
        assert!(e.contains("telemetry endpoint"), "{bad}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_exporter_never_delays_a_bulk_segment() {
    for d in [Dialect::Sqlite, Dialect::Postgres, Dialect::Mysql] {
        let Some(db) = TestDb::create(d, "telemetryhung").await else {
            continue;
        };
        let r = Receiver::start(Mode::Hang).await;
        // An exporter timeout of an hour: the thread stays inside the request all test long.
        let exporter = OtlpExporter::new(&r.endpoint(), Duration::from_secs(3600)).unwrap();
        let t = Telemetry::start(
            exporter,
            TelemetryOptions::default()
                .buffer(5)
                .batch(1)
                .interval(Duration::from_millis(1)),
        )
        .unwrap();
        let bulk = Bulk::open(
            db.db.clone(),
            1,
            BulkOptions::default().config(BulkConfig::default().generation_poll(None)),
        )
        .await
        .unwrap();
        bulk.take_ownership("test").await.unwrap();
        let sink = t.clone();
        bulk.on_segment_committed(move |s| {
            sink.emit(UsageEvent::new("acme", "bulk.rows_applied", s.applied));
        });
        let rows: Vec<RowInput> = (0..200)
            .map(|i| {
                RowInput::new(
                    format!("acct-{i}"),
                    serde_json::json!({ "n": i }).as_object().unwrap().clone(),
                )
            })
            .collect();
        let mut job = NewJob::new("hung-exporter", rows);
        job.segment_size = Some(10);
        let id = bulk.submit(job).await.unwrap().job;
        let ctl = Controller::new(
            bulk.source(),
            Config::new("bulk").capacity(NonZeroUsize::new(2).unwrap()),
        )
        .unwrap();
        bulk.set_waker(ctl.waker());
        let cancel = CancellationToken::new();
        let run = tokio::spawn(ctl.run(cancel.clone()));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        loop {
            let s = bulk.status(id).await.unwrap().unwrap();
            if s.state == "succeeded" {
                assert_eq!(s.applied_rows, 200, "{d}");
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{d}: the job did not finish beside a hung exporter: {s:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        cancel.cancel();
        run.await.unwrap().expect("clean drain");
        // The job finished while the exporter was still inside its first request: nothing was
        // exported, 20 segments were reported, and every one is accounted for.
        let report = t.report();
        assert_eq!(
            r.requests.load(Ordering::SeqCst),
            1,
            "{d}: one request, still open"
        );
        assert_eq!(report.exported, 0, "{d}: {report}");
        assert_eq!(report.emitted, 20, "{d}: {report}");
        assert_eq!(
            report.dropped(DropReason::Overflow) + report.pending,
            20,
            "{d}: {report}"
        );
        let final_report = tokio::task::spawn_blocking(move || t.shutdown(Duration::ZERO))
            .await
            .unwrap();
        assert_eq!(final_report.dropped_total(), 20, "{d}: {final_report}");
        db.drop_database().await;
    }
}
