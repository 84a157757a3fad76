//! Settings: a TOML file, then environment variables, then flags (each overrides the one
//! before), validated once into [`Settings`].

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

/// The default database: an embedded SQLite file in the current directory.
pub(crate) const DEFAULT_DATABASE: &str = "sqlite://nexuscrm-worker.db";
/// The default admin address (loopback only).
pub(crate) const DEFAULT_ADMIN_ADDR: &str = "127.0.0.1:9464";

/// The config file's shape. Every key is optional; unknown keys are rejected.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawConfig {
    pub(crate) database_url: Option<String>,
    pub(crate) generation: Option<i64>,
    pub(crate) admin_addr: Option<String>,
    pub(crate) admin_allowed_hosts: Option<Vec<String>>,
    pub(crate) shutdown_timeout_secs: Option<u64>,
    pub(crate) log_format: Option<String>,
    /// Export tracing spans over OTLP/HTTP (JSON) to this URL (off when absent).
    pub(crate) otlp_traces_endpoint: Option<String>,
    /// The secret the console asks for before a decision (read-only without one).
    pub(crate) console_secret: Option<crate::resume::SecretText>,
    pub(crate) bulk: Option<RawBulk>,
    pub(crate) flow: Option<RawFlow>,
    pub(crate) paused: Option<RawPaused>,
    pub(crate) formula: Option<RawFormula>,
    pub(crate) audit: Option<RawAudit>,
    pub(crate) telemetry: Option<RawTelemetry>,
}

/// The `[telemetry]` table (best-effort product usage events over OTLP/HTTP).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTelemetry {
    pub(crate) enabled: Option<bool>,
    /// The OTLP/HTTP logs URL; without one nothing is exported.
    pub(crate) endpoint: Option<String>,
    /// The tenant the usage events name.
    pub(crate) tenant: Option<String>,
    pub(crate) buffer: Option<usize>,
    pub(crate) batch: Option<usize>,
    pub(crate) interval_ms: Option<u64>,
    pub(crate) timeout_secs: Option<f64>,
}

/// Validated `[telemetry]` settings.
#[derive(Debug, Clone)]
pub(crate) struct TelemetrySettings {
    pub(crate) enabled: bool,
    pub(crate) endpoint: Option<String>,
    pub(crate) tenant: String,
    pub(crate) buffer: usize,
    pub(crate) batch: usize,
    pub(crate) interval: Duration,
    pub(crate) timeout: Duration,
}

/// The `[audit]` table (the audit outbox and its JSON Lines file sink).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawAudit {
    pub(crate) enabled: Option<bool>,
    /// The JSON Lines file the trail is appended to.
    pub(crate) file: Option<String>,
    /// The size at which the file rotates.
    pub(crate) max_bytes: Option<u64>,
    /// Rotated files kept (`<file>.1` newest).
    pub(crate) keep: Option<usize>,
    /// Events per delivered batch (one fsync each).
    pub(crate) batch: Option<usize>,
    pub(crate) lease_secs: Option<f64>,
    pub(crate) reconcile_interval_secs: Option<u64>,
    /// `file` (the default) or `http`.
    pub(crate) sink: Option<String>,
    /// The HTTP receiver's URL (`sink = "http"`).
    pub(crate) http_url: Option<String>,
    /// Each POST's bound.
    pub(crate) http_timeout_secs: Option<f64>,
}

/// The default audit file, beside the default database.
pub(crate) const DEFAULT_AUDIT_FILE: &str = "nexuscrm-audit.jsonl";

/// Validated `[audit]` settings.
#[derive(Debug, Clone)]
pub(crate) struct AuditSettings {
    pub(crate) enabled: bool,
    pub(crate) file: std::path::PathBuf,
    pub(crate) max_bytes: u64,
    pub(crate) keep: usize,
    pub(crate) batch: usize,
    pub(crate) lease: Duration,
    pub(crate) reconcile_interval: Duration,
    /// The HTTP receiver, when `sink = "http"` (otherwise the file).
    pub(crate) http: Option<nexuscrm_audit::HttpSink>,
}

impl AuditSettings {
    /// The file sink these settings describe.
    pub(crate) fn sink(&self) -> nexuscrm_audit::JsonlSink {
        nexuscrm_audit::JsonlSink::new(&self.file)
            .max_bytes(self.max_bytes)
            .keep(self.keep)
    }
}

/// The `[formula]` table (Formula View).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawFormula {
    pub(crate) enabled: Option<bool>,
    pub(crate) capacity: Option<usize>,
    pub(crate) reconcile_interval_secs: Option<u64>,
    pub(crate) lease_secs: Option<f64>,
    pub(crate) keys_per_attempt: Option<usize>,
    pub(crate) sweep_chunk: Option<usize>,
    pub(crate) sweep_chunks_per_turn: Option<usize>,
    /// Connections of the reconciliation pool (its own, beside the business pool).
    pub(crate) reconcile_connections: Option<u32>,
    pub(crate) listen: Option<bool>,
    pub(crate) generation_poll_secs: Option<u64>,
}

/// The `[paused]` table (Paused Flow). The family runs only with a `connector_url`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPaused {
    pub(crate) enabled: Option<bool>,
    pub(crate) capacity: Option<usize>,
    pub(crate) reconcile_interval_secs: Option<u64>,
    pub(crate) lease_secs: Option<f64>,
    pub(crate) connector_url: Option<String>,
    pub(crate) connector_timeout_secs: Option<f64>,
    pub(crate) connector_idempotent: Option<bool>,
    pub(crate) connector_observe_path: Option<String>,
    pub(crate) generation_poll_secs: Option<u64>,
    /// Serve `POST /paused/resume` on the admin server (default off).
    pub(crate) resume_endpoint: Option<bool>,
    /// The bearer secret the resume endpoint requires (at least 32 bytes).
    pub(crate) resume_secret: Option<crate::resume::SecretText>,
}

/// The `[flow]` table (Scheduled Flow).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawFlow {
    pub(crate) enabled: Option<bool>,
    pub(crate) capacity: Option<usize>,
    pub(crate) reconcile_interval_secs: Option<u64>,
    pub(crate) lease_secs: Option<f64>,
    pub(crate) misfire_grace_secs: Option<f64>,
    pub(crate) listen: Option<bool>,
    pub(crate) generation_poll_secs: Option<u64>,
}

/// The default `bulk.claim_cooldown_ms`: refills of freed Bulk slots batch for up to 20 ms
/// while other attempts run (one claim per batch instead of one per freed slot).
pub(crate) const DEFAULT_BULK_CLAIM_COOLDOWN_MS: u64 = 20;

/// The `[bulk]` table.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawBulk {
    pub(crate) enabled: Option<bool>,
    pub(crate) capacity: Option<usize>,
    pub(crate) reconcile_interval_secs: Option<u64>,
    pub(crate) lease_secs: Option<f64>,
    pub(crate) segment_size: Option<u32>,
    pub(crate) max_attempts: Option<u32>,
    pub(crate) listen: Option<bool>,
    pub(crate) generation_poll_secs: Option<u64>,
    pub(crate) claim_cooldown_ms: Option<u64>,
}

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

/// Validated settings.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) database_url: String,
    pub(crate) generation: i64,
    pub(crate) admin_addr: SocketAddr,
    /// Host names the admin server answers to besides loopback ones (DNS-rebinding guard).
    pub(crate) admin_allowed_hosts: Vec<String>,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) log_format: LogFormat,
    /// Where spans go over OTLP/HTTP (JSON), when traces are exported.
    pub(crate) otlp_traces_endpoint: Option<String>,
    /// The console's secret; read-only without one.
    pub(crate) console_secret: Option<crate::resume::Secret>,
    pub(crate) bulk: BulkSettings,
    pub(crate) flow: FlowSettings,
    pub(crate) paused: PausedSettings,
    pub(crate) formula: FormulaSettings,
    pub(crate) audit: AuditSettings,
    pub(crate) telemetry: TelemetrySettings,
}

/// Validated `[formula]` settings.
#[derive(Debug, Clone)]
pub(crate) struct FormulaSettings {
    pub(crate) enabled: bool,
    pub(crate) capacity: usize,
    pub(crate) reconcile_interval: Duration,
    pub(crate) lease: Duration,
    pub(crate) keys_per_attempt: usize,
    pub(crate) sweep_chunk: usize,
    pub(crate) sweep_chunks_per_turn: usize,
    pub(crate) reconcile_connections: u32,
    pub(crate) listen: bool,
    pub(crate) generation_poll: Duration,
}

/// Validated `[paused]` settings.
#[derive(Debug, Clone)]
pub(crate) struct PausedSettings {
    /// Enabled and a connector configured.
    pub(crate) enabled: bool,
    pub(crate) capacity: usize,
    pub(crate) reconcile_interval: Duration,
    pub(crate) lease: Duration,
    pub(crate) connector: Option<nexuscrm_paused::Connector>,
    pub(crate) generation_poll: Duration,
    /// The resume endpoint's secret, when the endpoint is on.
    pub(crate) resume_secret: Option<crate::resume::Secret>,
}

/// Validated `[flow]` settings.
#[derive(Debug, Clone)]
pub(crate) struct FlowSettings {
    pub(crate) enabled: bool,
    pub(crate) capacity: usize,
    pub(crate) reconcile_interval: Duration,
    pub(crate) lease: Duration,
    pub(crate) misfire_grace: Duration,
    pub(crate) listen: bool,
    pub(crate) generation_poll: Duration,
}

/// Validated `[bulk]` settings.
#[derive(Debug, Clone)]
pub(crate) struct BulkSettings {
    pub(crate) enabled: bool,
    pub(crate) capacity: usize,
    pub(crate) reconcile_interval: Duration,
    pub(crate) lease: Duration,
    pub(crate) segment_size: u32,
    pub(crate) max_attempts: u32,
    pub(crate) listen: bool,
    pub(crate) generation_poll: Duration,
    pub(crate) claim_cooldown: Duration,
}

pub(crate) fn bad(key: &str, why: impl std::fmt::Display) -> String {
    format!("config key `{key}`: {why}")
}

/// `value` when it lies in `lo..=hi`, else the error naming `key` and the range.
fn within<T: PartialOrd + std::fmt::Display + Copy>(
    key: &str,
    value: T,
    lo: T,
    hi: T,
) -> Result<T, String> {
    if (lo..=hi).contains(&value) {
        Ok(value)
    } else {
        Err(bad(key, format!("{value} must be {lo} to {hi}")))
    }
}

/// A backstop interval in whole seconds: at least 1, so it never becomes a poll.
fn backstop(key: &str, secs: u64) -> Result<Duration, String> {
    if secs == 0 {
        return Err(bad(
            key,
            "must be at least 1 (the backstop must not become a poll)",
        ));
    }
    Ok(Duration::from_secs(secs))
}

/// A generation-probe interval in whole seconds: at least 1.
fn poll_interval(key: &str, secs: u64) -> Result<Duration, String> {
    if secs == 0 {
        return Err(bad(key, "must be at least 1"));
    }
    Ok(Duration::from_secs(secs))
}

impl RawConfig {
    /// Reads a TOML file.
    pub(crate) fn from_file(path: &Path) -> Result<RawConfig, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read config file {}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("config file {}: {e}", path.display()))
    }

    /// Overlays `other` (a higher-precedence source) onto `self`.
    pub(crate) fn overlay(mut self, other: RawConfig) -> RawConfig {
        macro_rules! take {
            ($($f:ident),*) => { $( if other.$f.is_some() { self.$f = other.$f; } )* };
        }
        take!(
            database_url,
            generation,
            admin_addr,
            admin_allowed_hosts,
            shutdown_timeout_secs,
            log_format,
            otlp_traces_endpoint,
            console_secret
        );
        if let Some(ob) = other.bulk {
            let mut b = self.bulk.take().unwrap_or_default();
            macro_rules! takeb {
                ($($f:ident),*) => { $( if ob.$f.is_some() { b.$f = ob.$f; } )* };
            }
            takeb!(
                enabled,
                capacity,
                reconcile_interval_secs,
                lease_secs,
                segment_size,
                max_attempts,
                listen,
                generation_poll_secs,
                claim_cooldown_ms
            );
            self.bulk = Some(b);
        }
        if let Some(of) = other.flow {
            let mut f = self.flow.take().unwrap_or_default();
            macro_rules! takef {
                ($($f:ident),*) => { $( if of.$f.is_some() { f.$f = of.$f; } )* };
            }
            takef!(
                enabled,
                capacity,
                reconcile_interval_secs,
                lease_secs,
                misfire_grace_secs,
                listen,
                generation_poll_secs
            );
            self.flow = Some(f);
        }
        if let Some(op) = other.paused {
            let mut p = self.paused.take().unwrap_or_default();
            macro_rules! takep {
                ($($f:ident),*) => { $( if op.$f.is_some() { p.$f = op.$f; } )* };
            }
            takep!(
                enabled,
                capacity,
                reconcile_interval_secs,
                lease_secs,
                connector_url,
                connector_timeout_secs,
                connector_idempotent,
                connector_observe_path,
                generation_poll_secs,
                resume_endpoint,
                resume_secret
            );
            self.paused = Some(p);
        }
        if let Some(ox) = other.formula {
            let mut x = self.formula.take().unwrap_or_default();
            macro_rules! takex {
                ($($f:ident),*) => { $( if ox.$f.is_some() { x.$f = ox.$f; } )* };
            }
            takex!(
                enabled,
                capacity,
                reconcile_interval_secs,
                lease_secs,
                keys_per_attempt,
                sweep_chunk,
                sweep_chunks_per_turn,
                reconcile_connections,
                listen,
                generation_poll_secs
            );
            self.formula = Some(x);
        }
        if let Some(oa) = other.audit {
            let mut a = self.audit.take().unwrap_or_default();
            macro_rules! takea {
                ($($f:ident),*) => { $( if oa.$f.is_some() { a.$f = oa.$f; } )* };
            }
            takea!(
                enabled,
                file,
                max_bytes,
                keep,
                batch,
                lease_secs,
                reconcile_interval_secs,
                sink,
                http_url,
                http_timeout_secs
            );
            self.audit = Some(a);
        }
        if let Some(ot) = other.telemetry {
            let mut t = self.telemetry.take().unwrap_or_default();
            macro_rules! taket {
                ($($f:ident),*) => { $( if ot.$f.is_some() { t.$f = ot.$f; } )* };
            }
            taket!(
                enabled,
                endpoint,
                tenant,
                buffer,
                batch,
                interval_ms,
                timeout_secs
            );
            self.telemetry = Some(t);
        }
        self
    }

    /// Values from `NEXUSCRM_*` environment variables.
    pub(crate) fn from_env() -> Result<RawConfig, String> {
        fn var(name: &str) -> Option<String> {
            std::env::var(name).ok().filter(|v| !v.is_empty())
        }
        fn parse<T: std::str::FromStr>(name: &str) -> Result<Option<T>, String>
        where
            T::Err: std::fmt::Display,
        {
            var(name)
                .map(|v| {
                    v.parse::<T>()
                        .map_err(|e| format!("environment variable {name}={v:?}: {e}"))
                })
                .transpose()
        }
        let bulk = RawBulk {
            enabled: parse("NEXUSCRM_BULK_ENABLED")?,
            capacity: parse("NEXUSCRM_BULK_CAPACITY")?,
            reconcile_interval_secs: parse("NEXUSCRM_BULK_RECONCILE_INTERVAL_SECS")?,
            lease_secs: parse("NEXUSCRM_BULK_LEASE_SECS")?,
            segment_size: parse("NEXUSCRM_BULK_SEGMENT_SIZE")?,
            max_attempts: parse("NEXUSCRM_BULK_MAX_ATTEMPTS")?,
            listen: parse("NEXUSCRM_BULK_LISTEN")?,
            generation_poll_secs: parse("NEXUSCRM_BULK_GENERATION_POLL_SECS")?,
            claim_cooldown_ms: parse("NEXUSCRM_BULK_CLAIM_COOLDOWN_MS")?,
        };
        let flow = RawFlow {
            enabled: parse("NEXUSCRM_FLOW_ENABLED")?,
            capacity: parse("NEXUSCRM_FLOW_CAPACITY")?,
            reconcile_interval_secs: parse("NEXUSCRM_FLOW_RECONCILE_INTERVAL_SECS")?,
            lease_secs: parse("NEXUSCRM_FLOW_LEASE_SECS")?,
            misfire_grace_secs: parse("NEXUSCRM_FLOW_MISFIRE_GRACE_SECS")?,
            listen: parse("NEXUSCRM_FLOW_LISTEN")?,
            generation_poll_secs: parse("NEXUSCRM_FLOW_GENERATION_POLL_SECS")?,
        };
        let paused = RawPaused {
            enabled: parse("NEXUSCRM_PAUSED_ENABLED")?,
            capacity: parse("NEXUSCRM_PAUSED_CAPACITY")?,
            reconcile_interval_secs: parse("NEXUSCRM_PAUSED_RECONCILE_INTERVAL_SECS")?,
            lease_secs: parse("NEXUSCRM_PAUSED_LEASE_SECS")?,
            connector_url: var("NEXUSCRM_PAUSED_CONNECTOR_URL"),
            connector_timeout_secs: parse("NEXUSCRM_PAUSED_CONNECTOR_TIMEOUT_SECS")?,
            connector_idempotent: parse("NEXUSCRM_PAUSED_CONNECTOR_IDEMPOTENT")?,
            connector_observe_path: var("NEXUSCRM_PAUSED_CONNECTOR_OBSERVE_PATH"),
            generation_poll_secs: parse("NEXUSCRM_PAUSED_GENERATION_POLL_SECS")?,
            resume_endpoint: parse("NEXUSCRM_PAUSED_RESUME_ENDPOINT")?,
            resume_secret: var("NEXUSCRM_PAUSED_RESUME_SECRET").map(crate::resume::SecretText),
        };
        let formula = RawFormula {
            enabled: parse("NEXUSCRM_FORMULA_ENABLED")?,
            capacity: parse("NEXUSCRM_FORMULA_CAPACITY")?,
            reconcile_interval_secs: parse("NEXUSCRM_FORMULA_RECONCILE_INTERVAL_SECS")?,
            lease_secs: parse("NEXUSCRM_FORMULA_LEASE_SECS")?,
            keys_per_attempt: parse("NEXUSCRM_FORMULA_KEYS_PER_ATTEMPT")?,
            sweep_chunk: parse("NEXUSCRM_FORMULA_SWEEP_CHUNK")?,
            sweep_chunks_per_turn: parse("NEXUSCRM_FORMULA_SWEEP_CHUNKS_PER_TURN")?,
            reconcile_connections: parse("NEXUSCRM_FORMULA_RECONCILE_CONNECTIONS")?,
            listen: parse("NEXUSCRM_FORMULA_LISTEN")?,
            generation_poll_secs: parse("NEXUSCRM_FORMULA_GENERATION_POLL_SECS")?,
        };
        let audit = RawAudit {
            enabled: parse("NEXUSCRM_AUDIT_ENABLED")?,
            file: var("NEXUSCRM_AUDIT_FILE"),
            max_bytes: parse("NEXUSCRM_AUDIT_MAX_BYTES")?,
            keep: parse("NEXUSCRM_AUDIT_KEEP")?,
            batch: parse("NEXUSCRM_AUDIT_BATCH")?,
            lease_secs: parse("NEXUSCRM_AUDIT_LEASE_SECS")?,
            reconcile_interval_secs: parse("NEXUSCRM_AUDIT_RECONCILE_INTERVAL_SECS")?,
            sink: var("NEXUSCRM_AUDIT_SINK"),
            http_url: var("NEXUSCRM_AUDIT_HTTP_URL"),
            http_timeout_secs: parse("NEXUSCRM_AUDIT_HTTP_TIMEOUT_SECS")?,
        };
        let telemetry = RawTelemetry {
            enabled: parse("NEXUSCRM_TELEMETRY_ENABLED")?,
            endpoint: var("NEXUSCRM_TELEMETRY_ENDPOINT"),
            tenant: var("NEXUSCRM_TELEMETRY_TENANT"),
            buffer: parse("NEXUSCRM_TELEMETRY_BUFFER")?,
            batch: parse("NEXUSCRM_TELEMETRY_BATCH")?,
            interval_ms: parse("NEXUSCRM_TELEMETRY_INTERVAL_MS")?,
            timeout_secs: parse("NEXUSCRM_TELEMETRY_TIMEOUT_SECS")?,
        };
        Ok(RawConfig {
            audit: Some(audit),
            telemetry: Some(telemetry),
            flow: Some(flow),
            paused: Some(paused),
            formula: Some(formula),
            database_url: var("NEXUSCRM_DATABASE_URL"),
            generation: parse("NEXUSCRM_GENERATION")?,
            admin_addr: var("NEXUSCRM_ADMIN_ADDR"),
            admin_allowed_hosts: var("NEXUSCRM_ADMIN_ALLOWED_HOSTS").map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|h| !h.is_empty())
                    .map(str::to_owned)
                    .collect()
            }),
            shutdown_timeout_secs: parse("NEXUSCRM_SHUTDOWN_TIMEOUT_SECS")?,
            log_format: var("NEXUSCRM_LOG_FORMAT"),
            otlp_traces_endpoint: var("NEXUSCRM_OTLP_TRACES_ENDPOINT"),
            console_secret: var("NEXUSCRM_CONSOLE_SECRET").map(crate::resume::SecretText),
            bulk: Some(bulk),
        })
    }

    /// Applies defaults and validates.
    pub(crate) fn validate(self) -> Result<Settings, String> {
        let generation = self.generation.unwrap_or(1);
        if generation < 1 {
            return Err(bad(
                "generation",
                format!("{generation} must be at least 1"),
            ));
        }
        let admin = self.admin_addr.unwrap_or_else(|| DEFAULT_ADMIN_ADDR.into());
        let admin_addr: SocketAddr = admin.parse().map_err(|e| {
            bad(
                "admin_addr",
                format!("{admin:?} is not an address:port ({e})"),
            )
        })?;
        if !admin_addr.ip().is_loopback() {
            return Err(bad(
                "admin_addr",
                format!(
                    "{admin_addr} is not a loopback address; the admin server only serves loopback"
                ),
            ));
        }
        let admin_allowed_hosts = self.admin_allowed_hosts.unwrap_or_default();
        for h in &admin_allowed_hosts {
            let ok = !h.is_empty()
                && h.len() <= 253
                && h.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-');
            if !ok {
                return Err(bad(
                    "admin_allowed_hosts",
                    format!("{h:?} is not a host name (letters, digits, '.' and '-', no port)"),
                ));
            }
        }
        let shutdown = self.shutdown_timeout_secs.unwrap_or(30);
        if shutdown > 3600 {
            return Err(bad(
                "shutdown_timeout_secs",
                format!("{shutdown} is over an hour"),
            ));
        }
        let log_format = match self.log_format.as_deref().unwrap_or("text") {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => {
                return Err(bad(
                    "log_format",
                    format!("{other:?} must be \"text\" or \"json\""),
                ));
            }
        };
        let otlp_traces_endpoint = match self.otlp_traces_endpoint {
            Some(u) if u.trim().is_empty() => None,
            Some(u) => {
                let u = u.trim().to_owned();
                let rest = u
                    .strip_prefix("http://")
                    .or_else(|| u.strip_prefix("https://"));
                if rest.is_none_or(|r| r.is_empty() || r.starts_with('/')) {
                    return Err(bad(
                        "otlp_traces_endpoint",
                        format!("{u:?} is not an http:// or https:// URL with a host"),
                    ));
                }
                Some(u)
            }
            None => None,
        };
        let console_secret = match &self.console_secret {
            None => None,
            Some(crate::resume::SecretText(secret))
                if secret.len() < crate::resume::MIN_SECRET_BYTES =>
            {
                // The message never repeats the secret.
                return Err(bad(
                    "console_secret",
                    format!(
                        "is {} bytes; at least {} are needed (for example `openssl rand -hex 32`)",
                        secret.len(),
                        crate::resume::MIN_SECRET_BYTES
                    ),
                ));
            }
            Some(crate::resume::SecretText(secret)) => Some(crate::resume::Secret::new(secret)),
        };
        let b = self.bulk.unwrap_or_default();
        let capacity = within("bulk.capacity", b.capacity.unwrap_or(4), 1, 1024)?;
        let reconcile = b.reconcile_interval_secs.unwrap_or(300);
        if reconcile == 0 {
            return Err(bad(
                "bulk.reconcile_interval_secs",
                "must be at least 1 (the backstop must not become a poll)",
            ));
        }
        let lease = within("bulk.lease_secs", b.lease_secs.unwrap_or(30.0), 0.1, 3600.0)?;
        let segment_size = b.segment_size.unwrap_or(100);
        if segment_size == 0 || segment_size > nexuscrm_bulk::MAX_SEGMENT_SIZE {
            return Err(bad(
                "bulk.segment_size",
                format!(
                    "{segment_size} must be 1 to {}",
                    nexuscrm_bulk::MAX_SEGMENT_SIZE
                ),
            ));
        }
        let max_attempts = b.max_attempts.unwrap_or(5);
        if max_attempts == 0 || max_attempts > 100 {
            return Err(bad(
                "bulk.max_attempts",
                format!("{max_attempts} must be 1 to 100"),
            ));
        }
        let poll = b.generation_poll_secs.unwrap_or(5);
        if poll == 0 {
            return Err(bad("bulk.generation_poll_secs", "must be at least 1"));
        }
        let cooldown = b
            .claim_cooldown_ms
            .unwrap_or(DEFAULT_BULK_CLAIM_COOLDOWN_MS);
        if cooldown > 10_000 {
            return Err(bad(
                "bulk.claim_cooldown_ms",
                format!("{cooldown} must be 0 to 10000"),
            ));
        }
        let f = self.flow.unwrap_or_default();
        let flow_capacity = within("flow.capacity", f.capacity.unwrap_or(8), 1, 1024)?;
        let flow_reconcile = f.reconcile_interval_secs.unwrap_or(300);
        if flow_reconcile == 0 {
            return Err(bad(
                "flow.reconcile_interval_secs",
                "must be at least 1 (the backstop must not become a poll)",
            ));
        }
        let flow_lease = within("flow.lease_secs", f.lease_secs.unwrap_or(30.0), 0.1, 3600.0)?;
        let grace = f.misfire_grace_secs.unwrap_or(10.0);
        if !(0.0..=86_400.0).contains(&grace) {
            return Err(bad(
                "flow.misfire_grace_secs",
                format!("{grace} must be 0 to 86400"),
            ));
        }
        let flow_poll = f.generation_poll_secs.unwrap_or(5);
        if flow_poll == 0 {
            return Err(bad("flow.generation_poll_secs", "must be at least 1"));
        }
        let flow = FlowSettings {
            enabled: f.enabled.unwrap_or(true),
            capacity: flow_capacity,
            reconcile_interval: Duration::from_secs(flow_reconcile),
            lease: Duration::from_secs_f64(flow_lease),
            misfire_grace: Duration::from_secs_f64(grace),
            listen: f.listen.unwrap_or(true),
            generation_poll: Duration::from_secs(flow_poll),
        };
        let paused = validate_paused(self.paused.unwrap_or_default())?;
        let formula = validate_formula(self.formula.unwrap_or_default())?;
        let audit = validate_audit(self.audit.unwrap_or_default())?;
        let telemetry = validate_telemetry(self.telemetry.unwrap_or_default())?;
        Ok(Settings {
            audit,
            telemetry,
            flow,
            paused,
            formula,
            database_url: self.database_url.unwrap_or_else(|| DEFAULT_DATABASE.into()),
            generation,
            admin_addr,
            admin_allowed_hosts,
            shutdown_timeout: Duration::from_secs(shutdown),
            log_format,
            otlp_traces_endpoint,
            console_secret,
            bulk: BulkSettings {
                enabled: b.enabled.unwrap_or(true),
                capacity,
                reconcile_interval: Duration::from_secs(reconcile),
                lease: Duration::from_secs_f64(lease),
                segment_size,
                max_attempts,
                listen: b.listen.unwrap_or(true),
                generation_poll: Duration::from_secs(poll),
                claim_cooldown: Duration::from_millis(cooldown),
            },
        })
    }
}

fn validate_audit(a: RawAudit) -> Result<AuditSettings, String> {
    let file = a.file.unwrap_or_else(|| DEFAULT_AUDIT_FILE.into());
    if file.trim().is_empty() {
        return Err(bad("audit.file", "must name a file"));
    }
    let timeout = Duration::from_secs_f64(within(
        "audit.http_timeout_secs",
        a.http_timeout_secs.unwrap_or(10.0),
        0.1,
        300.0,
    )?);
    let http = match a.sink.as_deref().unwrap_or("file") {
        "file" => None,
        "http" => {
            let url = a.http_url.as_deref().unwrap_or("");
            if url.trim().is_empty() {
                return Err(bad(
                    "audit.http_url",
                    "is required when `audit.sink` is \"http\"",
                ));
            }
            Some(
                nexuscrm_audit::HttpSink::new(url)
                    .map_err(|e| bad("audit.http_url", e))?
                    .timeout(timeout),
            )
        }
        other => {
            return Err(bad(
                "audit.sink",
                format!("must be \"file\" or \"http\", not {other:?}"),
            ));
        }
    };
    Ok(AuditSettings {
        http,
        enabled: a.enabled.unwrap_or(true),
        file: file.into(),
        max_bytes: within(
            "audit.max_bytes",
            a.max_bytes.unwrap_or(64 << 20),
            4096,
            1 << 40,
        )?,
        keep: within("audit.keep", a.keep.unwrap_or(4), 1, 1000)?,
        batch: within("audit.batch", a.batch.unwrap_or(100), 1, 10_000)?,
        lease: Duration::from_secs_f64(within(
            "audit.lease_secs",
            a.lease_secs.unwrap_or(30.0),
            0.1,
            3600.0,
        )?),
        reconcile_interval: backstop(
            "audit.reconcile_interval_secs",
            a.reconcile_interval_secs.unwrap_or(300),
        )?,
    })
}

fn validate_telemetry(t: RawTelemetry) -> Result<TelemetrySettings, String> {
    let endpoint = t.endpoint.filter(|e| !e.trim().is_empty());
    if let Some(e) = &endpoint {
        nexuscrm_telemetry::check_endpoint(e).map_err(|why| bad("telemetry.endpoint", why))?;
    }
    let tenant = t.tenant.unwrap_or_else(|| "default".into());
    if tenant.trim().is_empty() || tenant.len() > 191 {
        return Err(bad("telemetry.tenant", "must be 1 to 191 bytes"));
    }
    Ok(TelemetrySettings {
        enabled: t.enabled.unwrap_or(true),
        endpoint,
        tenant,
        buffer: within("telemetry.buffer", t.buffer.unwrap_or(10_000), 1, 1_000_000)?,
        batch: within("telemetry.batch", t.batch.unwrap_or(512), 1, 100_000)?,
        interval: Duration::from_millis(within(
            "telemetry.interval_ms",
            t.interval_ms.unwrap_or(5_000),
            1,
            3_600_000,
        )?),
        timeout: Duration::from_secs_f64(within(
            "telemetry.timeout_secs",
            t.timeout_secs.unwrap_or(10.0),
            0.1,
            300.0,
        )?),
    })
}

fn validate_formula(x: RawFormula) -> Result<FormulaSettings, String> {
    Ok(FormulaSettings {
        enabled: x.enabled.unwrap_or(true),
        capacity: within("formula.capacity", x.capacity.unwrap_or(2), 1, 1024)?,
        reconcile_interval: backstop(
            "formula.reconcile_interval_secs",
            x.reconcile_interval_secs.unwrap_or(300),
        )?,
        lease: Duration::from_secs_f64(within(
            "formula.lease_secs",
            x.lease_secs.unwrap_or(30.0),
            0.1,
            3600.0,
        )?),
        keys_per_attempt: within(
            "formula.keys_per_attempt",
            x.keys_per_attempt.unwrap_or(100),
            1,
            10_000,
        )?,
        sweep_chunk: within(
            "formula.sweep_chunk",
            x.sweep_chunk.unwrap_or(1000),
            1,
            100_000,
        )?,
        sweep_chunks_per_turn: within(
            "formula.sweep_chunks_per_turn",
            x.sweep_chunks_per_turn.unwrap_or(4),
            1,
            10_000,
        )?,
        reconcile_connections: within(
            "formula.reconcile_connections",
            x.reconcile_connections.unwrap_or(2),
            1,
            64,
        )?,
        listen: x.listen.unwrap_or(true),
        generation_poll: poll_interval(
            "formula.generation_poll_secs",
            x.generation_poll_secs.unwrap_or(5),
        )?,
    })
}

fn validate_paused(p: RawPaused) -> Result<PausedSettings, String> {
    let capacity = within("paused.capacity", p.capacity.unwrap_or(8), 1, 1024)?;
    let reconcile = p.reconcile_interval_secs.unwrap_or(300);
    if reconcile == 0 {
        return Err(bad(
            "paused.reconcile_interval_secs",
            "must be at least 1 (the backstop must not become a poll)",
        ));
    }
    let lease = within(
        "paused.lease_secs",
        p.lease_secs.unwrap_or(30.0),
        0.1,
        3600.0,
    )?;
    let timeout = p.connector_timeout_secs.unwrap_or(10.0);
    if !(0.01..=600.0).contains(&timeout) {
        return Err(bad(
            "paused.connector_timeout_secs",
            format!("{timeout} must be 0.01 to 600"),
        ));
    }
    // The lease must outlive the request, or every slow answer would lose its lease.
    if lease <= timeout {
        return Err(bad(
            "paused.lease_secs",
            format!("{lease} must be longer than paused.connector_timeout_secs ({timeout})"),
        ));
    }
    let poll = p.generation_poll_secs.unwrap_or(5);
    if poll == 0 {
        return Err(bad("paused.generation_poll_secs", "must be at least 1"));
    }
    let connector = match &p.connector_url {
        None => None,
        Some(url) => {
            let mut c = nexuscrm_paused::Connector::new(url)
                .map_err(|e| bad("paused.connector_url", e))?
                .timeout(Duration::from_secs_f64(timeout))
                .idempotent(p.connector_idempotent.unwrap_or(false));
            if let Some(path) = &p.connector_observe_path {
                if !path.starts_with('/') {
                    return Err(bad(
                        "paused.connector_observe_path",
                        format!("{path:?} must start with /"),
                    ));
                }
                c = c.observable(path.clone());
            }
            Some(c)
        }
    };
    let resume_secret = match (p.resume_endpoint.unwrap_or(false), &p.resume_secret) {
        (false, _) => None,
        (true, None) => {
            return Err(bad(
                "paused.resume_secret",
                "the resume endpoint is on (paused.resume_endpoint) but has no secret; set \
                 paused.resume_secret or NEXUSCRM_PAUSED_RESUME_SECRET",
            ));
        }
        (true, Some(crate::resume::SecretText(secret)))
            if secret.len() < crate::resume::MIN_SECRET_BYTES =>
        {
            // The message never repeats the secret.
            return Err(bad(
                "paused.resume_secret",
                format!(
                    "is {} bytes; at least {} are needed (for example `openssl rand -hex 32`)",
                    secret.len(),
                    crate::resume::MIN_SECRET_BYTES
                ),
            ));
        }
        (true, Some(crate::resume::SecretText(secret))) => Some(crate::resume::Secret::new(secret)),
    };
    Ok(PausedSettings {
        resume_secret,
        enabled: p.enabled.unwrap_or(true) && connector.is_some(),
        capacity,
        reconcile_interval: Duration::from_secs(reconcile),
        lease: Duration::from_secs_f64(lease),
        connector,
        generation_poll: Duration::from_secs(poll),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_resume_endpoint_is_off_by_default_and_needs_a_long_secret_it_never_shows() {
        let s = RawConfig::default().validate().unwrap();
        assert!(s.paused.resume_secret.is_none());
        let raw: RawConfig = toml::from_str("[paused]\nresume_endpoint = true").unwrap();
        assert!(raw.validate().unwrap_err().contains("has no secret"));
        let raw: RawConfig =
            toml::from_str("[paused]\nresume_endpoint = true\nresume_secret = 'tiny-secret'")
                .unwrap();
        let e = raw.validate().unwrap_err();
        assert!(
            e.contains("`paused.resume_secret`") && !e.contains("tiny-secret"),
            "{e}"
        );
        let long = "s".repeat(40);
        let raw: RawConfig = toml::from_str(&format!(
            "[paused]\nresume_endpoint = true\nresume_secret = '{long}'"
        ))
        .unwrap();
        assert!(!format!("{raw:?}").contains(&long));
        let s = raw.validate().unwrap();
        assert!(s.paused.resume_secret.is_some());
        assert!(!format!("{s:?}").contains(&long));
        // A secret without the endpoint switched on serves nothing.
        let raw: RawConfig =
            toml::from_str(&format!("[paused]\nresume_secret = '{long}'")).unwrap();
        assert!(raw.validate().unwrap().paused.resume_secret.is_none());
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_key() {
        let e = toml::from_str::<RawConfig>("databse_url = 'x'")
            .unwrap_err()
            .to_string();
        assert!(e.contains("databse_url"), "{e}");
        let e = toml::from_str::<RawConfig>("[bulk]\ncapacty = 3")
            .unwrap_err()
            .to_string();
        assert!(e.contains("capacty"), "{e}");
        let raw: RawConfig = toml::from_str("[bulk]\ncapacity = 0").unwrap();
        assert!(raw.validate().unwrap_err().contains("`bulk.capacity`"));
        let raw: RawConfig = toml::from_str("admin_addr = '0.0.0.0:9464'").unwrap();
        assert!(raw.validate().unwrap_err().contains("not a loopback"));
        let raw: RawConfig = toml::from_str("otlp_traces_endpoint = 'localhost:4318'").unwrap();
        assert!(
            raw.validate()
                .unwrap_err()
                .contains("`otlp_traces_endpoint`")
        );
        let raw: RawConfig =
            toml::from_str("otlp_traces_endpoint = 'http://127.0.0.1:4318/v1/traces'").unwrap();
        assert_eq!(
            raw.validate().unwrap().otlp_traces_endpoint.as_deref(),
            Some("http://127.0.0.1:4318/v1/traces")
        );
        assert_eq!(
            RawConfig::default()
                .validate()
                .unwrap()
                .otlp_traces_endpoint,
            None,
            "off by default"
        );
        let raw: RawConfig = toml::from_str("console_secret = 'short'").unwrap();
        let e = raw.validate().unwrap_err();
        assert!(
            e.contains("`console_secret`") && !e.contains("short"),
            "{e}"
        );
        let raw: RawConfig =
            toml::from_str("console_secret = '0123456789abcdef0123456789abcdef'").unwrap();
        assert!(raw.validate().unwrap().console_secret.is_some());
        let raw: RawConfig = toml::from_str("log_format = 'yaml'").unwrap();
        assert!(raw.validate().unwrap_err().contains("`log_format`"));
    }

    #[test]
    fn later_sources_override_earlier_ones_and_defaults_fill_the_rest() {
        let file: RawConfig =
            toml::from_str("generation = 3\n[bulk]\ncapacity = 2\nlease_secs = 5").unwrap();
        let env = RawConfig {
            generation: Some(4),
            ..RawConfig::default()
        };
        let flags = RawConfig {
            bulk: Some(RawBulk {
                capacity: Some(8),
                ..RawBulk::default()
            }),
            ..RawConfig::default()
        };
        let s = file.overlay(env).overlay(flags).validate().unwrap();
        assert_eq!(s.generation, 4);
        assert_eq!(s.bulk.capacity, 8);
        assert_eq!(s.bulk.lease, Duration::from_secs(5));
        assert_eq!(s.database_url, DEFAULT_DATABASE);
        assert_eq!(s.admin_addr.to_string(), DEFAULT_ADMIN_ADDR);
        assert!(s.flow.enabled, "Scheduled Flow is on by default");
        assert_eq!(s.flow.capacity, 8);
    }

    #[test]
    fn the_bulk_claim_cooldown_is_bounded_and_defaults_to_20_ms() {
        let raw: RawConfig = toml::from_str("[bulk]\nclaim_cooldown_ms = 20000").unwrap();
        assert!(
            raw.validate()
                .unwrap_err()
                .contains("`bulk.claim_cooldown_ms`")
        );
        let s = RawConfig::default().validate().unwrap();
        assert_eq!(s.bulk.claim_cooldown, Duration::from_millis(20));
        let raw: RawConfig = toml::from_str("[bulk]\nclaim_cooldown_ms = 0").unwrap();
        assert_eq!(raw.validate().unwrap().bulk.claim_cooldown, Duration::ZERO);
    }

    #[test]
    fn the_flow_table_is_validated() {
        let raw: RawConfig = toml::from_str("[flow]\ncapacity = 0").unwrap();
        assert!(raw.validate().unwrap_err().contains("`flow.capacity`"));
        let raw: RawConfig = toml::from_str("[flow]\nmisfire_grace_secs = -1").unwrap();
        assert!(
            raw.validate()
                .unwrap_err()
                .contains("`flow.misfire_grace_secs`")
        );
        assert!(toml::from_str::<RawConfig>("[flow]\nlease = 3").is_err());
        let raw: RawConfig =
            toml::from_str("[flow]\nenabled = false\nlease_secs = 2.5\nmisfire_grace_secs = 1")
                .unwrap();
        let s = raw.validate().unwrap();
        assert!(!s.flow.enabled);
        assert_eq!(s.flow.lease, Duration::from_millis(2500));
        assert_eq!(s.flow.misfire_grace, Duration::from_secs(1));
    }

    #[test]
    fn the_formula_table_is_validated_and_on_by_default() {
        let s = RawConfig::default().validate().unwrap();
        assert!(s.formula.enabled, "Formula View is on by default");
        assert_eq!(s.formula.capacity, 2);
        assert_eq!(s.formula.reconcile_connections, 2);
        assert_eq!(s.formula.reconcile_interval, Duration::from_secs(300));
        for (toml, key) in [
            ("capacity = 0", "`formula.capacity`"),
            (
                "reconcile_interval_secs = 0",
                "`formula.reconcile_interval_secs`",
            ),
            ("lease_secs = 0.0", "`formula.lease_secs`"),
            ("keys_per_attempt = 0", "`formula.keys_per_attempt`"),
            ("sweep_chunk = 1000000", "`formula.sweep_chunk`"),
            (
                "sweep_chunks_per_turn = 0",
                "`formula.sweep_chunks_per_turn`",
            ),
            (
                "reconcile_connections = 0",
                "`formula.reconcile_connections`",
            ),
            ("generation_poll_secs = 0", "`formula.generation_poll_secs`"),
        ] {
            let raw: RawConfig = toml::from_str(&format!("[formula]\n{toml}")).unwrap();
            let e = raw.validate().unwrap_err();
            assert!(e.contains(key), "{toml}: {e}");
        }
        assert!(toml::from_str::<RawConfig>("[formula]\nchunk = 3").is_err());
        let file: RawConfig =
            toml::from_str("[formula]\nenabled = false\nsweep_chunk = 50").unwrap();
        let flags = RawConfig {
            formula: Some(RawFormula {
                capacity: Some(3),
                ..RawFormula::default()
            }),
            ..RawConfig::default()
        };
        let s = file.overlay(flags).validate().unwrap();
        assert!(!s.formula.enabled);
        assert_eq!(s.formula.sweep_chunk, 50);
        assert_eq!(s.formula.capacity, 3);
    }

    #[test]
    fn the_audit_table_is_validated_and_on_by_default() {
        let s = RawConfig::default().validate().unwrap();
        assert!(s.audit.enabled, "the audit outbox is on by default");
        assert_eq!(s.audit.file, std::path::PathBuf::from(DEFAULT_AUDIT_FILE));
        assert_eq!(s.audit.max_bytes, 64 << 20);
        assert_eq!(s.audit.keep, 4);
        assert_eq!(s.audit.batch, 100);
        for (toml, key) in [
            ("file = \"  \"", "`audit.file`"),
            ("max_bytes = 10", "`audit.max_bytes`"),
            ("keep = 0", "`audit.keep`"),
            ("batch = 0", "`audit.batch`"),
            ("lease_secs = 0.0", "`audit.lease_secs`"),
            (
                "reconcile_interval_secs = 0",
                "`audit.reconcile_interval_secs`",
            ),
            ("sink = \"kafka\"", "`audit.sink`"),
            ("sink = \"http\"", "`audit.http_url`: is required"),
            (
                "sink = \"http\"\nhttp_url = \"https://audit.example/in\"",
                "https is not built in",
            ),
            (
                "sink = \"http\"\nhttp_url = \"http://127.0.0.1:9/in\"\nhttp_timeout_secs = 0",
                "`audit.http_timeout_secs`",
            ),
        ] {
            let raw: RawConfig = toml::from_str(&format!("[audit]\n{toml}")).unwrap();
            let e = raw.validate().unwrap_err();
            assert!(e.contains(key), "{toml}: {e}");
        }
        assert!(toml::from_str::<RawConfig>("[audit]\npath = \"x\"").is_err());
        assert!(s.audit.http.is_none(), "the file sink by default");
        let http: RawConfig =
            toml::from_str("[audit]\nsink = \"http\"\nhttp_url = \"http://127.0.0.1:8080/audit\"")
                .unwrap();
        let h = http.validate().unwrap().audit.http.expect("the HTTP sink");
        assert_eq!(h.url(), "http://127.0.0.1:8080/audit");
        let file: RawConfig =
            toml::from_str("[audit]\nfile = \"/var/log/crm.jsonl\"\nkeep = 9").unwrap();
        let flags = RawConfig {
            audit: Some(RawAudit {
                enabled: Some(false),
                ..RawAudit::default()
            }),
            ..RawConfig::default()
        };
        let s = file.overlay(flags).validate().unwrap();
        assert!(!s.audit.enabled);
        assert_eq!(s.audit.file, std::path::PathBuf::from("/var/log/crm.jsonl"));
        assert_eq!(s.audit.keep, 9);
    }
}
