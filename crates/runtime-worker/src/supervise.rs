//! `run`: open, migrate, take ownership, supervise one controller per enabled family, serve
//! admin HTTP, drain on a signal, and choose the exit code.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use nexuscrm_bulk::{Bulk, BulkConfig, BulkOptions};
use nexuscrm_flow::{Flow, FlowConfig, FlowOptions};
use nexuscrm_persistence::{Db, DbOptions};
use nexuscrm_worker::fault::{CrashPoint, Faults};
use nexuscrm_worker::{Config, Controller, Source};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::{AnyError, admin, listen_for_signals, owner};

/// How a supervised controller ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    Clean,
    /// A newer deployment generation owns the family: exit 1, not a restart.
    Superseded(String),
    Poisoned(String),
}

/// The first restart delay after a not-committed stop; doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// The longest restart delay.
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// A run that lasted this long was healthy: the next restart waits [`FIRST_BACKOFF`] again
/// instead of continuing the doubling of earlier, unrelated blips.
const HEALTHY_RUN: Duration = Duration::from_secs(60);

/// Runs `ctl` until `cancel`; a proven not-committed stop restarts it with backoff (1 s doubling
/// to 60 s, back to 1 s after a run that stayed up for [`HEALTHY_RUN`]); a poisoned or
/// superseded controller ends supervision.
async fn supervise<S: Source>(mut ctl: Controller<S>, cancel: CancellationToken) -> Ended {
    let name = ctl.config().get_name().to_owned();
    let mut backoff = FIRST_BACKOFF;
    loop {
        let started = tokio::time::Instant::now();
        match ctl.run(cancel.clone()).await {
            Ok(_) => return Ended::Clean,
            Err(e) if e.is_poisoned() => {
                tracing::error!(controller = %name, kind = ?e.kind(), in_flight = e.in_flight(), "controller poisoned: {e}");
                return Ended::Poisoned(e.to_string());
            }
            Err(e) if e.is_superseded() => {
                tracing::error!(controller = %name, "superseded generation, stopping: {e}");
                return Ended::Superseded(e.to_string());
            }
            Err(e) => {
                if cancel.is_cancelled() {
                    return Ended::Clean;
                }
                if started.elapsed() >= HEALTHY_RUN {
                    backoff = FIRST_BACKOFF;
                }
                tracing::warn!(controller = %name, "controller stopped, restarting in {backoff:?}: {e}");
                let Some(back) = e.into_controller() else {
                    return Ended::Poisoned("controller not handed back".into());
                };
                ctl = back;
                tokio::select! {
                    () = cancel.cancelled() => return Ended::Clean,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// Runs `ctl` under [`supervise`]; a poisoned stop cancels the whole process's work.
async fn supervise_all<S: Source>(ctl: Option<Controller<S>>, cancel: CancellationToken) -> Ended {
    let Some(ctl) = ctl else {
        return Ended::Clean;
    };
    let ended = supervise(ctl, cancel.clone()).await;
    if matches!(ended, Ended::Poisoned(_) | Ended::Superseded(_)) {
        // One poisoned family stops the process: drain the others, then exit 2. A superseded
        // one means a newer deployment owns this process's work: drain the others, exit 1.
        cancel.cancel();
    }
    ended
}

pub(crate) async fn run(s: Settings) -> Result<ExitCode, AnyError> {
    if !s.bulk.enabled && !s.flow.enabled && !s.formula.enabled {
        return Err(
            "no family is enabled (bulk.enabled, flow.enabled and formula.enabled are \
                    false): nothing to run"
                .into(),
        );
    }
    // First of all, so that a stop signal during start-up is a clean stop, not a kill.
    let cancel = CancellationToken::new();
    let signals = listen_for_signals(cancel.clone())?;
    let db = Db::connect(&s.database_url).await?;
    let cfg = BulkConfig::default()
        .lease(s.bulk.lease)
        .default_segment_size(s.bulk.segment_size)
        .default_max_attempts(s.bulk.max_attempts)
        .listen(s.bulk.listen)
        .generation_poll(Some(s.bulk.generation_poll))
        // Formula View replicas in other processes learn of record changes this way.
        .announce_records(s.formula.enabled)
        // Every applied row writes its audit event in the segment's transaction.
        .audit(s.audit.enabled);
    // Test-only: NEXUSCRM_FAULT=<crash-point> arms the real fault hook of the Bulk family
    // (process-level fail-stop tests). Unset, the hook is the zero-cost unarmed default.
    let faults = match std::env::var("NEXUSCRM_FAULT") {
        Ok(point) if !point.is_empty() => {
            let point: CrashPoint = point.parse().map_err(|e| format!("NEXUSCRM_FAULT: {e}"))?;
            tracing::warn!("NEXUSCRM_FAULT armed at {point}: this process will crash there");
            let f = Faults::new();
            f.arm(point);
            f
        }
        _ => Faults::none(),
    };
    // Product telemetry: best-effort, from a thread of its own (a hung collector never holds
    // a worker thread or a transaction); without an endpoint nothing is exported.
    let telemetry = start_telemetry(&s)?;
    // Both families migrate (so producers can use either); each runs only when enabled.
    let bulk = Bulk::open(
        db.clone(),
        s.generation,
        BulkOptions::default().config(cfg).faults(faults),
    )
    .await?;
    {
        // Usage per committed segment: a push into the bounded buffer, never a wait.
        let (t, tenant) = (telemetry.clone(), s.telemetry.tenant.clone());
        bulk.on_segment_committed(move |seg| {
            t.emit(nexuscrm_telemetry::UsageEvent::new(
                tenant.as_str(),
                "bulk.rows_applied",
                seg.applied,
            ));
            if seg.rejected > 0 {
                t.emit(nexuscrm_telemetry::UsageEvent::new(
                    tenant.as_str(),
                    "bulk.rows_rejected",
                    seg.rejected,
                ));
            }
        });
    }
    let flow_cfg = FlowConfig::default()
        .lease(s.flow.lease)
        .misfire_grace(s.flow.misfire_grace)
        .listen(s.flow.listen)
        .generation_poll(Some(s.flow.generation_poll))
        // Schedule changes (the console's pause / resume) write their audit events.
        .audit(s.audit.enabled);
    let flow = Flow::open(
        db.clone(),
        s.generation,
        FlowOptions::default().config(flow_cfg),
    )
    .await?;
    let mut paused_options = nexuscrm_paused::PausedOptions::default()
        .audit(s.audit.enabled)
        .generation(s.generation)
        .lease(s.paused.lease)
        .generation_poll(Some(s.paused.generation_poll));
    if let Some(c) = &s.paused.connector {
        paused_options = paused_options.connector(c.clone());
    }
    let paused = nexuscrm_paused::PausedFlow::open(db.clone(), paused_options).await?;
    let in_memory = s.database_url.contains(":memory:") || s.database_url.contains("mode=memory");
    // Formula View reconciles on a small pool of its own, so a sweep never competes with the
    // business pool (an in-memory SQLite database exists only in its own pool).
    let reconcile_db = if in_memory || !s.formula.enabled {
        db.clone()
    } else {
        Db::connect_with(
            &s.database_url,
            DbOptions::default().max_connections(s.formula.reconcile_connections),
        )
        .await?
    };
    let formula = nexuscrm_formula::Formula::open(
        db.clone(),
        nexuscrm_formula::FormulaOptions::default()
            .generation(s.generation)
            .lease(s.formula.lease)
            .batch(s.formula.keys_per_attempt, s.formula.keys_per_attempt)
            .sweep(s.formula.sweep_chunk, s.formula.sweep_chunks_per_turn)
            .listen(s.formula.listen)
            .generation_poll(Some(s.formula.generation_poll))
            .reconcile_db(reconcile_db),
    )
    .await?;
    // The audit outbox: its file is checked now, so a bad `audit.file` is a start-up error.
    let audit = if s.audit.enabled {
        Some(
            nexuscrm_audit::Audit::open(db.clone(), audit_options(&s))
                .await
                .map_err(|e| format!("config key `audit.file`: {e}"))?,
        )
    } else {
        None
    };
    // Observations (`/metrics`, `/snapshot`) read through a pool of their own with one
    // connection, so scrapes never take a connection the claims and commits need; each reading
    // is bounded (counts capped) and shared for admin::OBSERVATION_TTL. An in-memory SQLite
    // database exists only in its own pool, so it is observed through that one.
    let observe_db = if in_memory {
        db.clone()
    } else {
        Db::connect_with(&s.database_url, DbOptions::default().max_connections(1)).await?
    };
    let mut families = Vec::new();
    let bulk_ctl = if s.bulk.enabled {
        let capacity = std::num::NonZeroUsize::new(s.bulk.capacity)
            .ok_or("bulk.capacity must be at least 1")?;
        let ctl = Controller::new(
            crate::stall::Stalling::from_env(bulk.source())?,
            Config::new("bulk")
                .capacity(capacity)
                .claim_cooldown(s.bulk.claim_cooldown)
                .reconcile_interval(s.bulk.reconcile_interval)
                .reconcile_jitter(s.bulk.reconcile_interval / 10)
                .shutdown_timeout(s.shutdown_timeout),
        )?;
        bulk.set_waker(ctl.waker());
        families.push(admin::Family {
            declaration: nexuscrm_bulk::DECLARATION,
            handle: ctl.handle(),
            store: admin::Store::Bulk(Bulk::without_migrations(
                observe_db.clone(),
                s.generation,
                BulkOptions::default(),
            )),
            observed: admin::ObservationCache::default(),
        });
        Some(ctl)
    } else {
        None
    };
    let flow_ctl = if s.flow.enabled {
        let capacity = std::num::NonZeroUsize::new(s.flow.capacity)
            .ok_or("flow.capacity must be at least 1")?;
        let ctl = Controller::new(
            flow.source(),
            Config::new("flow")
                .capacity(capacity)
                // A run's lateness is the product: its due timers fire within microseconds.
                .precise_timers(true)
                .reconcile_interval(s.flow.reconcile_interval)
                .reconcile_jitter(s.flow.reconcile_interval / 10)
                .shutdown_timeout(s.shutdown_timeout),
        )?;
        flow.set_waker(ctl.waker());
        families.push(admin::Family {
            declaration: nexuscrm_flow::DECLARATION,
            handle: ctl.handle(),
            // The console's schedule decisions go through this handle: they write their
            // audit events like every other decision.
            store: admin::Store::Flow(Flow::without_migrations(
                observe_db.clone(),
                s.generation,
                FlowOptions::default().config(FlowConfig::default().audit(s.audit.enabled)),
            )),
            observed: admin::ObservationCache::default(),
        });
        Some(ctl)
    } else {
        None
    };
    // Paused Flow runs only with a connector to send its effects to.
    let paused_ctl = if s.paused.enabled {
        let capacity = std::num::NonZeroUsize::new(s.paused.capacity)
            .ok_or("paused.capacity must be at least 1")?;
        let ctl = Controller::new(
            paused.source(),
            Config::new("paused")
                .capacity(capacity)
                .reconcile_interval(s.paused.reconcile_interval)
                .reconcile_jitter(s.paused.reconcile_interval / 10)
                .shutdown_timeout(s.shutdown_timeout),
        )?;
        paused.set_waker(ctl.waker());
        families.push(admin::Family {
            declaration: nexuscrm_paused::DECLARATION,
            handle: ctl.handle(),
            store: admin::Store::Paused(nexuscrm_paused::PausedFlow::without_migrations(
                observe_db.clone(),
                nexuscrm_paused::PausedOptions::default()
                    .generation(s.generation)
                    .audit(s.audit.enabled),
            )),
            observed: admin::ObservationCache::default(),
        });
        Some(ctl)
    } else {
        None
    };
    let formula_ctl = if s.formula.enabled {
        let capacity = std::num::NonZeroUsize::new(s.formula.capacity)
            .ok_or("formula.capacity must be at least 1")?;
        let ctl = Controller::new(
            formula.source(),
            Config::new("formula")
                .capacity(capacity)
                .reconcile_interval(s.formula.reconcile_interval)
                .reconcile_jitter(s.formula.reconcile_interval / 10)
                .shutdown_timeout(s.shutdown_timeout),
        )?;
        // Definition changes wake it through the formula handle, record changes of this
        // process's Bulk segments through Bulk, other processes' through the announcements.
        formula.set_waker(ctl.waker());
        bulk.watch_records(ctl.waker());
        families.push(admin::Family {
            declaration: nexuscrm_formula::DECLARATION,
            handle: ctl.handle(),
            store: admin::Store::Formula(nexuscrm_formula::Formula::without_migrations(
                observe_db.clone(),
                nexuscrm_formula::FormulaOptions::default().generation(s.generation),
            )),
            observed: admin::ObservationCache::default(),
        });
        Some(ctl)
    } else {
        None
    };
    let audit_ctl = if let Some(audit) = &audit {
        let ctl = Controller::new(
            audit.source(),
            Config::new("audit")
                .reconcile_interval(s.audit.reconcile_interval)
                .reconcile_jitter(s.audit.reconcile_interval / 10)
                .shutdown_timeout(s.shutdown_timeout),
        )?;
        // A finished batch wakes it through the audit handle; this process's Bulk segments
        // (which write events) through Bulk; other producers' events by the backstop.
        audit.set_waker(ctl.waker());
        bulk.watch_records(ctl.waker());
        families.push(admin::Family {
            declaration: nexuscrm_audit::DECLARATION,
            handle: ctl.handle(),
            store: admin::Store::Audit(nexuscrm_audit::Audit::without_migrations(
                observe_db.clone(),
                audit_options(&s),
            )),
            observed: admin::ObservationCache::default(),
        });
        Some(ctl)
    } else {
        None
    };
    // Every path this process runs is in the registry `families` prints, with its proof.
    crate::registry::check_started(families.iter().map(|f| &f.declaration))?;
    let names: Vec<&str> = families.iter().map(|f| f.declaration.family()).collect();
    // Stops the admin server, and ends the console's event streams so they do not hold it.
    let admin_stop = CancellationToken::new();
    let admin_state = admin::Admin {
        families: Arc::new(families.clone()),
        database: Arc::new(admin::DatabaseCheck::new(bulk.db().clone())),
        resume: s
            .paused
            .resume_secret
            .clone()
            .map(|secret| crate::resume::ResumeEndpoint::new(paused.clone(), secret)),
        console: crate::console::Actions::new(s.console_secret.clone())
            .ending_with(admin_stop.clone()),
        telemetry: s.telemetry.enabled.then(|| telemetry.clone()),
    };
    if admin_state.resume.is_some() {
        tracing::info!(
            "admin serves POST /paused/resume (bearer secret from paused.resume_secret)"
        );
    }
    let listener = tokio::net::TcpListener::bind(s.admin_addr)
        .await
        .map_err(|e| format!("cannot serve admin HTTP on {}: {e}", s.admin_addr))?;
    let addr = listener.local_addr()?;
    tracing::info!(
        "admin listening on {addr}; running {} on {} (generation {})",
        names.join(", "),
        bulk.db().url(),
        s.generation
    );
    let stop = admin_stop.clone();
    let limits = crate::http::Limits {
        allowed_hosts: s.admin_allowed_hosts.clone(),
        ..crate::http::Limits::default()
    };
    let server = tokio::spawn(crate::http::serve(
        listener,
        admin::router(admin_state),
        limits,
        stop,
    ));
    // Admin HTTP is up before ownership and the startup reconciliation: /livez answers during a
    // slow start and /readyz says "not ready" until every controller reports Ready.
    let owned = async {
        if audit.is_some() {
            // Each takeover writes its `ownership.taken` event in its own transaction; the
            // families' own calls below then find the generation in place and change nothing.
            let running = [
                (bulk_ctl.is_some(), nexuscrm_bulk::FAMILY),
                (flow_ctl.is_some(), nexuscrm_flow::FAMILY),
                (paused_ctl.is_some(), nexuscrm_paused::FAMILY),
                (formula_ctl.is_some(), nexuscrm_formula::FAMILY),
                (true, nexuscrm_audit::FAMILY),
            ];
            for (_, family) in running.iter().filter(|(on, _)| *on) {
                nexuscrm_audit::take_ownership_audited(&db, family, s.generation, &owner()).await?;
            }
        }
        if bulk_ctl.is_some() {
            bulk.take_ownership(&owner()).await?;
        }
        if flow_ctl.is_some() {
            flow.take_ownership(&owner()).await?;
        }
        if paused_ctl.is_some() {
            paused.take_ownership(&owner()).await?;
        }
        if formula_ctl.is_some() {
            formula.take_ownership(&owner()).await?;
        }
        if let Some(audit) = &audit {
            audit.take_ownership(&owner()).await?;
        }
        Ok::<_, AnyError>(())
    };
    if let Err(e) = owned.await {
        admin_stop.cancel();
        let _ = server.await;
        return Err(e);
    }
    let (bulk_ended, flow_ended, paused_ended, formula_ended, audit_ended) = tokio::join!(
        supervise_all(bulk_ctl, cancel.clone()),
        supervise_all(flow_ctl, cancel.clone()),
        supervise_all(paused_ctl, cancel.clone()),
        supervise_all(formula_ctl, cancel.clone()),
        supervise_all(audit_ctl, cancel.clone()),
    );
    cancel.cancel();
    signals.abort();
    admin_stop.cancel();
    let _ = server.await;
    // The last usage events get one bounded try; what is left is dropped and counted.
    let t = telemetry.clone();
    let within = s.telemetry.timeout.min(Duration::from_secs(5));
    if let Ok(report) = tokio::task::spawn_blocking(move || t.shutdown(within)).await {
        tracing::info!("{report}");
    }
    let ended = [
        bulk_ended,
        flow_ended,
        paused_ended,
        formula_ended,
        audit_ended,
    ];
    let poisoned: Vec<&String> = ended
        .iter()
        .filter_map(|e| match e {
            Ended::Poisoned(reason) => Some(reason),
            _ => None,
        })
        .collect();
    let superseded: Vec<&String> = ended
        .iter()
        .filter_map(|e| match e {
            Ended::Superseded(reason) => Some(reason),
            _ => None,
        })
        .collect();
    Ok(if poisoned.is_empty() && superseded.is_empty() {
        tracing::info!("drained cleanly");
        ExitCode::SUCCESS
    } else if poisoned.is_empty() {
        let reasons: Vec<&str> = superseded.iter().map(|s| s.as_str()).collect();
        tracing::error!(
            "exiting: superseded generation (a newer deployment owns this work): {}",
            reasons.join("; ")
        );
        ExitCode::from(1)
    } else {
        tracing::error!(
            "exiting: a poisoned controller must be replaced with the process: {}",
            poisoned
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("; ")
        );
        ExitCode::from(2)
    })
}

/// The telemetry pipeline `[telemetry]` describes: exporting over OTLP/HTTP when it names an
/// endpoint, otherwise (or when disabled) counting every event as dropped (`no_exporter`).
pub(crate) fn start_telemetry(s: &Settings) -> Result<nexuscrm_telemetry::Telemetry, AnyError> {
    let t = &s.telemetry;
    let Some(endpoint) = t.endpoint.as_deref().filter(|_| t.enabled) else {
        return Ok(nexuscrm_telemetry::Telemetry::disabled());
    };
    let exporter = nexuscrm_telemetry::OtlpExporter::new(endpoint, t.timeout)
        .map_err(|e| format!("config key `telemetry.endpoint`: {e}"))?;
    let telemetry = nexuscrm_telemetry::Telemetry::start(
        exporter,
        nexuscrm_telemetry::TelemetryOptions::default()
            .buffer(t.buffer)
            .batch(t.batch)
            .interval(t.interval),
    )
    .map_err(|e| format!("starting the telemetry thread: {e}"))?;
    tracing::info!("telemetry (best-effort) exports usage events to {endpoint}");
    Ok(telemetry)
}

/// The audit family's options from `[audit]`.
pub(crate) fn audit_options(s: &Settings) -> nexuscrm_audit::AuditOptions {
    match &s.audit.http {
        Some(http) => nexuscrm_audit::AuditOptions::http(http.clone()),
        None => nexuscrm_audit::AuditOptions::new(s.audit.sink()),
    }
    .generation(s.generation)
    .batch(s.audit.batch)
    .lease(s.audit.lease)
}

/// `status`: GET /snapshot from a running worker and print it as a table.
pub(crate) async fn print_status(addr: &str) -> Result<ExitCode, AnyError> {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("no worker admin server at {addr}: {e}"))?;
    stream
        .write_all(
            format!("GET /snapshot HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let text = String::from_utf8_lossy(&response);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let v: Value =
        serde_json::from_str(body).map_err(|e| format!("unreadable /snapshot answer: {e}"))?;
    println!(
        "{:<8} {:<6} {:>8} {:>8} {:>10} {:>10} {:>8}  declaration",
        "family", "ready", "in-fl", "claims", "claimed", "completed", "pending"
    );
    for f in v["families"].as_array().into_iter().flatten() {
        let c = &f["controller"];
        let o = &f["observations"];
        println!(
            "{:<8} {:<6} {:>8} {:>8} {:>10} {:>10} {:>8}  {}",
            f["family"].as_str().unwrap_or("?"),
            c["ready"].as_bool().unwrap_or(false),
            c["in_flight"].to_string(),
            c["claim_calls"].to_string(),
            c["attempts_claimed"].to_string(),
            c["attempts_completed"].to_string(),
            o["pending"].to_string(),
            f["declaration"].as_str().unwrap_or("?"),
        );
        if let Some(p) = c["poisoned"].as_str() {
            println!("  POISONED: {p}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nexuscrm_worker_test::{Op, ScriptedSource, Step};

    fn controller(src: &ScriptedSource) -> Controller<ScriptedSource> {
        Controller::new(
            src.clone(),
            Config::new("t")
                .reconcile_interval(Duration::from_secs(300))
                .reconcile_jitter(Duration::ZERO)
                .clock(src.clock()),
        )
        .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn restart_backoff_doubles_on_blips_and_resets_after_a_healthy_run() {
        let src = ScriptedSource::new();
        // Three start-up blips (1 s, 2 s, 4 s), a run that stays up until its 300 s backstop
        // reconciliation blips, then a blip at once.
        for _ in 0..3 {
            src.push_reconcile(Step::not_committed("pool timed out"));
        }
        src.push_reconcile(Step::ok(()));
        src.push_reconcile(Step::not_committed("pool timed out"));
        src.push_reconcile(Step::not_committed("pool timed out"));
        let cancel = CancellationToken::new();
        let task = tokio::spawn(supervise(controller(&src), cancel.clone()));
        tokio::time::sleep(Duration::from_secs(320)).await;
        let starts: Vec<u64> = src
            .times(Op::CheckReady)
            .iter()
            .map(|d| d.as_secs())
            .collect();
        // Without the reset the fifth start would come 8 s after the healthy run (315 s) and
        // the sixth 16 s later.
        assert_eq!(starts, vec![0, 1, 3, 7, 308, 310]);
        cancel.cancel();
        assert_eq!(task.await.unwrap(), Ended::Clean);
    }

    #[tokio::test(start_paused = true)]
    async fn a_superseded_controller_ends_supervision_without_restarting() {
        let src = ScriptedSource::new();
        src.push_reconcile(Step::superseded("generation 2 owns bulk"));
        let cancel = CancellationToken::new();
        let ended = supervise(controller(&src), cancel).await;
        assert!(
            matches!(&ended, Ended::Superseded(why) if why.contains("generation 2 owns bulk")),
            "{ended:?}"
        );
        tokio::time::sleep(Duration::from_secs(120)).await;
        assert_eq!(src.count(Op::CheckReady), 1, "no restart");
    }
}
