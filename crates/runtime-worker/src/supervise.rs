//! `run`: open, migrate, take ownership, supervise one controller per enabled family, serve
//! admin HTTP, drain on a signal, and choose the exit code.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use nexuscrm_bulk::{Bulk, BulkConfig, BulkOptions, DECLARATION};
use nexuscrm_persistence::Db;
use nexuscrm_worker::fault::{CrashPoint, Faults};
use nexuscrm_worker::{Config, Controller, Source};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::{AnyError, admin, listen_for_signals, owner};

/// How a supervised controller ended.
enum Ended {
    Clean,
    Poisoned(String),
}

/// Runs `ctl` until `cancel`; a proven not-committed stop restarts it with backoff (1 s doubling
/// to 60 s); a poisoned controller ends supervision.
async fn supervise<S: Source>(mut ctl: Controller<S>, cancel: CancellationToken) -> Ended {
    let name = ctl.config().get_name().to_owned();
    let mut backoff = Duration::from_secs(1);
    loop {
        match ctl.run(cancel.clone()).await {
            Ok(_) => return Ended::Clean,
            Err(e) if e.is_poisoned() => {
                tracing::error!(controller = %name, kind = ?e.kind(), in_flight = e.in_flight(), "controller poisoned: {e}");
                return Ended::Poisoned(e.to_string());
            }
            Err(e) => {
                if cancel.is_cancelled() {
                    return Ended::Clean;
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
                backoff = (backoff * 2).min(Duration::from_secs(60));
            }
        }
    }
}

pub(crate) async fn run(s: Settings) -> Result<ExitCode, AnyError> {
    if !s.bulk.enabled {
        return Err("no family is enabled (bulk.enabled = false): nothing to run".into());
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
        .generation_poll(Some(s.bulk.generation_poll));
    // Test-only: NEXUSCRM_FAULT=<crash-point> arms the real fault hook (process-level fail-stop
    // tests). Unset, the hook is the zero-cost unarmed default.
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
    let bulk = Bulk::open(
        db,
        s.generation,
        BulkOptions::default().config(cfg).faults(faults),
    )
    .await?;
    let capacity =
        std::num::NonZeroUsize::new(s.bulk.capacity).ok_or("bulk.capacity must be at least 1")?;
    let ctl = Controller::new(
        crate::stall::Stalling::from_env(bulk.source())?,
        Config::new("bulk")
            .capacity(capacity)
            .reconcile_interval(s.bulk.reconcile_interval)
            .reconcile_jitter(s.bulk.reconcile_interval / 10)
            .shutdown_timeout(s.shutdown_timeout),
    )?;
    bulk.set_waker(ctl.waker());
    let admin_state = admin::Admin {
        families: Arc::new(vec![admin::Family {
            declaration: DECLARATION,
            handle: ctl.handle(),
            bulk: bulk.clone(),
        }]),
    };
    let listener = tokio::net::TcpListener::bind(s.admin_addr)
        .await
        .map_err(|e| format!("cannot serve admin HTTP on {}: {e}", s.admin_addr))?;
    let addr = listener.local_addr()?;
    tracing::info!(
        "admin listening on {addr}; running bulk on {} (generation {})",
        bulk.db().url(),
        s.generation
    );
    let admin_stop = CancellationToken::new();
    let stop = admin_stop.clone();
    let server = tokio::spawn(async move {
        axum::serve(listener, admin::router(admin_state))
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await
    });
    // Admin HTTP is up before ownership and the startup reconciliation: /livez answers during a
    // slow start and /readyz says "not ready" until the controller reports Ready.
    if let Err(e) = bulk.take_ownership(&owner()).await {
        admin_stop.cancel();
        let _ = server.await;
        return Err(e.into());
    }
    let ended = supervise(ctl, cancel.clone()).await;
    cancel.cancel();
    signals.abort();
    admin_stop.cancel();
    let _ = server.await;
    Ok(match ended {
        Ended::Clean => {
            tracing::info!("drained cleanly");
            ExitCode::SUCCESS
        }
        Ended::Poisoned(reason) => {
            tracing::error!(
                "exiting: a poisoned controller must be replaced with the process: {reason}"
            );
            ExitCode::from(2)
        }
    })
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
