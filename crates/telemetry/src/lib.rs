//! Product telemetry (contract slice 5, second half): `best-effort / loss-tolerant`.
//!
//! - Producers call [`Telemetry::emit`] with a [`UsageEvent`] (a tenant, what happened, how
//!   many). It never blocks and never fails: the event goes into a **bounded in-memory buffer**,
//!   or, when the buffer is full, is dropped and counted (`overflow`).
//! - A thread of its own (never a task on the business runtime, so a hung collector cannot
//!   take a worker thread from a transaction) takes batches from the buffer and hands them to
//!   an [`Export`]: [`OtlpExporter`] sends them as OTLP/HTTP log records with the OpenTelemetry
//!   crates, or there is no exporter at all and every event is counted as `no_exporter`.
//! - Every loss is counted by reason ([`DropReason`]): `overflow`, `exporter_error` (a
//!   refused or failed batch is not retried), `shutdown` (still buffered when the process
//!   stopped), `crash` (an injected crash abandoned the buffer; a real crash loses the
//!   counters with it), `no_exporter`. A [`TelemetryReport`] never claims completeness: it
//!   says how much was exported and how much was dropped, and that it is best-effort.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use nexuscrm_worker::fault::{CrashPoint, Faults};
use nexuscrm_worker::{Declaration, Durability, Effect};

/// The path's name (the registry, metrics).
pub const FAMILY: &str = "telemetry";

/// The telemetry declaration: events may be lost; every loss is counted and reported.
pub const DECLARATION: Declaration =
    Declaration::new_const(FAMILY, Durability::BestEffort, Effect::LossTolerant);

/// One product usage event.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageEvent {
    /// Whose usage it is.
    pub tenant: String,
    /// What happened (`bulk.rows_applied`, ...).
    pub kind: String,
    /// How many.
    pub count: u64,
    /// When.
    pub at: SystemTime,
}

impl UsageEvent {
    /// An event at the current time.
    #[must_use]
    pub fn new(tenant: impl Into<String>, kind: impl Into<String>, count: u64) -> Self {
        UsageEvent {
            tenant: tenant.into(),
            kind: kind.into(),
            count,
            at: SystemTime::now(),
        }
    }
}

/// Why events were dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum DropReason {
    /// The buffer was full when the event was emitted.
    Overflow,
    /// The exporter failed or refused the batch (not retried).
    ExporterError,
    /// Still buffered (or in a batch that did not finish) when telemetry shut down.
    Shutdown,
    /// Abandoned by an injected crash.
    Crash,
    /// No exporter is configured.
    NoExporter,
}

impl DropReason {
    /// Every reason, in the order reports list them.
    pub const ALL: [DropReason; 5] = [
        DropReason::Overflow,
        DropReason::ExporterError,
        DropReason::Shutdown,
        DropReason::Crash,
        DropReason::NoExporter,
    ];

    /// The reason's label (`telemetry_dropped_total{reason="..."}`).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Overflow => "overflow",
            DropReason::ExporterError => "exporter_error",
            DropReason::Shutdown => "shutdown",
            DropReason::Crash => "crash",
            DropReason::NoExporter => "no_exporter",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where batches go. Runs on the telemetry thread only; it may block (up to its own timeout).
pub trait Export: Send + 'static {
    /// Sends one batch; an error drops it (counted as `exporter_error`).
    ///
    /// # Errors
    ///
    /// Why the batch was not accepted.
    fn export(&mut self, batch: &[UsageEvent]) -> Result<(), String>;
}

/// The telemetry settings.
#[derive(Debug, Clone)]
pub struct TelemetryOptions {
    buffer: usize,
    batch: usize,
    interval: Duration,
    faults: Faults,
}

impl Default for TelemetryOptions {
    fn default() -> Self {
        TelemetryOptions {
            buffer: 10_000,
            batch: 512,
            interval: Duration::from_secs(5),
            faults: Faults::none(),
        }
    }
}

impl TelemetryOptions {
    /// Events the buffer holds before new ones are dropped (`overflow`). By default 10,000;
    /// at least 1.
    #[must_use]
    pub fn buffer(mut self, events: usize) -> Self {
        self.buffer = events.max(1);
        self
    }

    /// Events per exported batch. By default 512; at least 1.
    #[must_use]
    pub fn batch(mut self, events: usize) -> Self {
        self.batch = events.max(1);
        self
    }

    /// How long a partial batch waits before it is exported anyway. By default 5 seconds.
    #[must_use]
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Injected faults: `BeforeEffect` and `AfterEffect` crash the export thread around a
    /// batch (tests).
    #[must_use]
    pub fn faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }
}

/// What telemetry says about itself: best-effort figures, never a claim of completeness.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TelemetryReport {
    /// Events emitted (offered to the buffer).
    pub emitted: u64,
    /// Events in batches the exporter accepted.
    pub exported: u64,
    /// Events dropped, by reason (in [`DropReason::ALL`] order).
    pub dropped: [(DropReason, u64); 5],
    /// Events buffered or in the batch being exported now.
    pub pending: u64,
    /// Whether an exporter is configured.
    pub exporting: bool,
}

impl TelemetryReport {
    /// Every dropped event, whatever the reason.
    #[must_use]
    pub fn dropped_total(&self) -> u64 {
        self.dropped.iter().map(|(_, n)| n).sum()
    }

    /// Dropped for `reason`.
    #[must_use]
    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.dropped[reason.index()].1
    }
}

impl fmt::Display for TelemetryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.exporting {
            return write!(
                f,
                "telemetry (best-effort): no exporter configured; {} events dropped (no_exporter)",
                self.dropped_total()
            );
        }
        write!(
            f,
            "telemetry (best-effort, may be incomplete): {} exported, {} dropped",
            self.exported,
            self.dropped_total()
        )?;
        let reasons: Vec<String> = self
            .dropped
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(r, n)| format!("{r} {n}"))
            .collect();
        if !reasons.is_empty() {
            write!(f, " ({})", reasons.join(", "))?;
        }
        write!(f, ", {} pending", self.pending)
    }
}

struct Buffer {
    events: VecDeque<UsageEvent>,
    /// Events taken for the batch being exported now.
    in_flight: u64,
    stopping: bool,
    /// The export thread is gone (crashed or finished): emits are dropped.
    gone: Option<DropReason>,
}

struct Inner {
    buffer: Mutex<Buffer>,
    ready: Condvar,
    done: Condvar,
    capacity: usize,
    batch: usize,
    emitted: AtomicU64,
    exported: AtomicU64,
    dropped: [AtomicU64; 5],
    exporting: bool,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Buffer> {
        self.buffer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn drop_n(&self, reason: DropReason, n: u64) {
        self.dropped[reason.index()].fetch_add(n, Ordering::Relaxed);
    }
}

/// The telemetry pipeline: cheap to clone; every clone emits into the same buffer.
#[derive(Clone)]
pub struct Telemetry {
    inner: Arc<Inner>,
}

impl fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Telemetry")
            .field("report", &self.report())
            .finish()
    }
}

impl Telemetry {
    /// Telemetry without an exporter: every event is dropped and counted as `no_exporter`.
    #[must_use]
    pub fn disabled() -> Telemetry {
        Telemetry {
            inner: Arc::new(Self::inner(&TelemetryOptions::default(), false)),
        }
    }

    /// Telemetry exporting to `exporter` from a thread of its own.
    ///
    /// # Errors
    ///
    /// The thread could not be started.
    pub fn start(
        exporter: impl Export,
        options: TelemetryOptions,
    ) -> Result<Telemetry, std::io::Error> {
        let inner = Arc::new(Self::inner(&options, true));
        let for_thread = inner.clone();
        let (interval, faults) = (options.interval, options.faults.clone());
        std::thread::Builder::new()
            .name("nexuscrm-telemetry".into())
            .spawn(move || export_loop(&for_thread, exporter, interval, &faults))?;
        Ok(Telemetry { inner })
    }

    fn inner(options: &TelemetryOptions, exporting: bool) -> Inner {
        Inner {
            buffer: Mutex::new(Buffer {
                events: VecDeque::new(),
                in_flight: 0,
                stopping: false,
                gone: None,
            }),
            ready: Condvar::new(),
            done: Condvar::new(),
            capacity: options.buffer,
            batch: options.batch,
            emitted: AtomicU64::new(0),
            exported: AtomicU64::new(0),
            dropped: Default::default(),
            exporting,
        }
    }

    /// Offers `event` to the buffer. Never blocks on the exporter (it holds the buffer's lock
    /// only to push) and never fails: a full buffer drops the event (`overflow`).
    pub fn emit(&self, event: UsageEvent) {
        let inner = &self.inner;
        inner.emitted.fetch_add(1, Ordering::Relaxed);
        if !inner.exporting {
            inner.drop_n(DropReason::NoExporter, 1);
            return;
        }
        let mut b = inner.lock();
        if let Some(reason) = b.gone {
            drop(b);
            inner.drop_n(reason, 1);
            return;
        }
        if b.events.len() >= inner.capacity {
            drop(b);
            inner.drop_n(DropReason::Overflow, 1);
            return;
        }
        b.events.push_back(event);
        let full = b.events.len() >= inner.batch;
        drop(b);
        if full {
            inner.ready.notify_one();
        }
    }

    /// The figures so far.
    #[must_use]
    pub fn report(&self) -> TelemetryReport {
        let inner = &self.inner;
        let pending = {
            let b = inner.lock();
            b.events.len() as u64 + b.in_flight
        };
        let mut dropped = [(DropReason::Overflow, 0); 5];
        for (slot, reason) in dropped.iter_mut().zip(DropReason::ALL) {
            *slot = (
                reason,
                inner.dropped[reason.index()].load(Ordering::Relaxed),
            );
        }
        TelemetryReport {
            emitted: inner.emitted.load(Ordering::Relaxed),
            exported: inner.exported.load(Ordering::Relaxed),
            dropped,
            pending,
            exporting: inner.exporting,
        }
    }

    /// Exports what is buffered, waiting at most `within` (on a blocking thread of the caller's
    /// choosing: call it from `spawn_blocking` in async code), then stops the export thread;
    /// what is left is dropped (`shutdown`). Later emits are dropped (`shutdown`) too. Returns
    /// the final report.
    pub fn shutdown(&self, within: Duration) -> TelemetryReport {
        let inner = &self.inner;
        let deadline = Instant::now() + within;
        let mut b = inner.lock();
        b.stopping = true;
        inner.ready.notify_all();
        while b.gone.is_none() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            b = inner
                .done
                .wait_timeout(b, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        if b.gone.is_none() {
            // A hung exporter: what it holds and what waits behind it are abandoned.
            b.gone = Some(DropReason::Shutdown);
            let left = b.events.len() as u64 + b.in_flight;
            b.events.clear();
            b.in_flight = 0;
            inner.drop_n(DropReason::Shutdown, left);
        }
        drop(b);
        self.report()
    }
}

/// The export thread: a batch when one is full, or when the interval passes with events
/// waiting, or at shutdown until the buffer is empty.
fn export_loop(inner: &Inner, mut exporter: impl Export, interval: Duration, faults: &Faults) {
    loop {
        let mut b = inner.lock();
        let waited_since = Instant::now();
        while !b.stopping && b.events.len() < inner.batch {
            let elapsed = waited_since.elapsed();
            if elapsed >= interval && !b.events.is_empty() {
                break;
            }
            let wait = if b.events.is_empty() {
                interval.max(Duration::from_millis(1))
            } else {
                interval
                    .saturating_sub(elapsed)
                    .max(Duration::from_millis(1))
            };
            b = inner
                .ready
                .wait_timeout(b, wait)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        if b.gone.is_some() {
            return; // Shutdown gave up on this thread while it exported.
        }
        if b.events.is_empty() {
            // Stopping with nothing left.
            b.gone = Some(DropReason::Shutdown);
            drop(b);
            inner.done.notify_all();
            return;
        }
        let n = b.events.len().min(inner.batch);
        let batch: Vec<UsageEvent> = b.events.drain(..n).collect();
        b.in_flight = n as u64;
        drop(b);
        if faults.hit(CrashPoint::BeforeEffect).is_err() {
            crash(inner);
            return;
        }
        let result = exporter.export(&batch);
        let mut b = inner.lock();
        if b.gone.is_some() {
            return; // Shutdown already counted this batch as dropped.
        }
        b.in_flight = 0;
        drop(b);
        match result {
            Ok(()) => {
                inner.exported.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) => {
                inner.drop_n(DropReason::ExporterError, n as u64);
                eprintln!("telemetry (best-effort): a batch of {n} events was dropped: {e}");
            }
        }
        if faults.hit(CrashPoint::AfterEffect).is_err() {
            crash(inner);
            return;
        }
    }
}

/// An injected crash: the buffer (and a batch not yet sent) is abandoned.
fn crash(inner: &Inner) {
    let mut b = inner.lock();
    let left = b.events.len() as u64 + b.in_flight;
    b.events.clear();
    b.in_flight = 0;
    b.gone = Some(DropReason::Crash);
    drop(b);
    inner.drop_n(DropReason::Crash, left);
    inner.done.notify_all();
}

/// Exports batches as OTLP/HTTP log records (JSON encoding) with the OpenTelemetry crates:
/// one log record per event, event name `nexuscrm.usage`, body the kind, attributes `tenant`,
/// `kind` and `count`. A non-2xx answer or a transport error (including the timeout) fails the
/// batch.
pub struct OtlpExporter {
    exporter: opentelemetry_otlp::LogExporter,
    logger: opentelemetry_sdk::logs::SdkLogger,
    scope: opentelemetry::InstrumentationScope,
    endpoint: String,
}

impl fmt::Debug for OtlpExporter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OtlpExporter")
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl OtlpExporter {
    /// An exporter posting to `endpoint` (the full logs URL, e.g.
    /// `http://127.0.0.1:4318/v1/logs`), each request bounded by `timeout`.
    ///
    /// # Errors
    ///
    /// A URL that is not `http://` or `https://`, or the exporter could not be built.
    pub fn new(endpoint: &str, timeout: Duration) -> Result<OtlpExporter, String> {
        use opentelemetry::logs::LoggerProvider as _;
        use opentelemetry_otlp::WithExportConfig as _;
        use opentelemetry_sdk::logs::LogExporter as _;
        check_endpoint(endpoint)?;
        let mut exporter = opentelemetry_otlp::LogExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpJson)
            .with_endpoint(endpoint)
            .with_timeout(timeout)
            .build()
            .map_err(|e| format!("telemetry endpoint {endpoint}: {e}"))?;
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name("nexuscrm-runtime-worker")
            .build();
        exporter.set_resource(&resource);
        // A provider without processors: only its logger's record factory is used.
        let provider = opentelemetry_sdk::logs::SdkLoggerProvider::builder().build();
        Ok(OtlpExporter {
            exporter,
            logger: provider.logger("nexuscrm-telemetry"),
            scope: opentelemetry::InstrumentationScope::builder("nexuscrm-telemetry").build(),
            endpoint: endpoint.to_owned(),
        })
    }
}

/// Checks an OTLP/HTTP endpoint URL.
///
/// # Errors
///
/// Why it is not usable.
pub fn check_endpoint(endpoint: &str) -> Result<(), String> {
    let rest = endpoint
        .strip_prefix("http://")
        .or_else(|| endpoint.strip_prefix("https://"))
        .ok_or_else(|| {
            format!("telemetry endpoint {endpoint:?} must be an http:// or https:// URL")
        })?;
    let host = rest.split(['/', '?']).next().unwrap_or("");
    if host.is_empty() || host.contains(char::is_whitespace) {
        return Err(format!("telemetry endpoint {endpoint:?} names no host"));
    }
    Ok(())
}

impl Export for OtlpExporter {
    fn export(&mut self, batch: &[UsageEvent]) -> Result<(), String> {
        use opentelemetry::logs::{AnyValue, LogRecord as _, Logger as _};
        use opentelemetry_sdk::logs::LogExporter as _;
        let records: Vec<opentelemetry_sdk::logs::SdkLogRecord> = batch
            .iter()
            .map(|e| {
                let mut r = self.logger.create_log_record();
                r.set_event_name("nexuscrm.usage");
                r.set_timestamp(e.at);
                r.set_observed_timestamp(SystemTime::now());
                r.set_body(AnyValue::from(e.kind.clone()));
                r.add_attribute("tenant", e.tenant.clone());
                r.add_attribute("kind", e.kind.clone());
                r.add_attribute("count", i64::try_from(e.count).unwrap_or(i64::MAX));
                r
            })
            .collect();
        let pairs: Vec<(
            &opentelemetry_sdk::logs::SdkLogRecord,
            &opentelemetry::InstrumentationScope,
        )> = records.iter().map(|r| (r, &self.scope)).collect();
        let batch = opentelemetry_sdk::logs::LogBatch::new(&pairs);
        futures_executor::block_on(self.exporter.export(batch)).map_err(|e| e.to_string())
    }
}
