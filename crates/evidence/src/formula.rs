//! The Formula View scenario: idle statements, convergence of N changed records (a fresh
//! process by its startup sweep; a running one by the change cursor, woken by Bulk's segments),
//! and the plans of its claim, next-work and sweep statements at 10^3..10^6 records.

use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use nexuscrm_bulk::{Bulk, BulkConfig, BulkOptions, NewJob, RowInput};
use nexuscrm_formula::{Formula, FormulaOptions};
use nexuscrm_persistence::{Db, DbOptions, Dialect};
use nexuscrm_worker::{Config, Controller, ControllerHandle};
use serde::Serialize;
use serde_json::{Map, Value};
use sqlx::{Connection, PgConnection};
use tokio_util::sync::CancellationToken;

use crate::measure::{Digest, Env, Side, totals};
use crate::scenarios::{Explained, explain_one};
use crate::{AnyError, Plan};

/// The definitions the scenario derives.
const FORMULAS: [(&str, &str); 2] = [
    ("weighted", "record.amount * record.probability / 100"),
    (
        "label",
        "record.stage == 'won' ? 'won: ' + record.account : record.account",
    ),
];

/// Records per Bulk job when the scenario writes records.
const PER_JOB: usize = 1000;

/// One convergence run.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Converged {
    /// Which path found the changed records.
    pub(crate) path: &'static str,
    pub(crate) records: usize,
    /// From the start (of the process, or of the Bulk burst) until every record is derived.
    pub(crate) secs: f64,
    pub(crate) records_per_s: f64,
    /// Statements of the view's own role (Bulk's writes are not counted).
    pub(crate) statements: i64,
    pub(crate) statements_per_record: f64,
    /// For the live path: how long the view trailed Bulk's last segment.
    pub(crate) lag_after_last_write_secs: Option<f64>,
    pub(crate) digests: Vec<Digest>,
}

/// The Formula View's figures.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct FormulaEvidence {
    pub(crate) records: usize,
    pub(crate) converged: Vec<Converged>,
    pub(crate) idle_window_secs: f64,
    pub(crate) idle_statements: i64,
    pub(crate) idle_digests: Vec<Digest>,
    /// Statements of one requested backstop turn (release of older claims, the rolling
    /// sweep's chunks, the claim and next_work_at it causes).
    pub(crate) statements_per_backstop: i64,
    pub(crate) sweep_chunk: usize,
    pub(crate) sweep_chunks_per_turn: usize,
    pub(crate) plans: Vec<Explained>,
}

/// The Runtime Worker's defaults for the view.
const CHUNK: usize = 1000;
const CHUNKS_PER_TURN: usize = 4;

fn rows(prefix: &str, from: usize, n: usize, round: i64) -> Vec<RowInput> {
    (from..from + n)
        .map(|i| {
            let mut m = Map::new();
            m.insert("name".into(), Value::String(format!("Deal {i}")));
            m.insert("account".into(), Value::String(format!("acct-{}", i % 500)));
            m.insert(
                "amount".into(),
                Value::from(100 + (i as i64 * 37) % 900 + round),
            );
            m.insert("probability".into(), Value::from((i % 10) as i64 * 10));
            m.insert(
                "stage".into(),
                Value::String(if i % 4 == 0 { "won" } else { "open" }.into()),
            );
            RowInput::new(format!("{prefix}-{i}"), m)
        })
        .collect()
}

/// Submits `n` records (revision `round + 1` of each) as jobs the running Bulk controller
/// applies.
async fn write(bulk: &Bulk, n: usize, round: i64) -> Result<(), AnyError> {
    for (j, from) in (0..n).step_by(PER_JOB).enumerate() {
        let mut job = NewJob::new(
            format!("formula-r{round}-{j}"),
            rows("deal", from, PER_JOB.min(n - from), round),
        );
        job.segment_size = Some(500);
        bulk.submit(job).await?;
    }
    Ok(())
}

/// Waits until every one of `n` records is derived at `revision` with both formulas.
async fn derived(env: &Env, n: usize, revision: i64, within: Duration) -> Result<(), AnyError> {
    let sql = format!(
        "SELECT COUNT(*) FROM formula_record WHERE due_at IS NULL AND source_revision = {revision}"
    );
    let got = env.wait_count(&sql, n as i64, within).await;
    if got < n as i64 {
        return Err(format!("the view derived {got} of {n} records at revision {revision}").into());
    }
    let values = env
        .wait_count(
            &format!("SELECT COUNT(*) FROM formula_value WHERE source_revision = {revision}"),
            (n * FORMULAS.len()) as i64,
            within,
        )
        .await;
    if values < (n * FORMULAS.len()) as i64 {
        return Err(format!("the view holds {values} values at revision {revision}").into());
    }
    Ok(())
}

/// A view controller as the measured role, its sweep on a pool of its own.
async fn view(env: &Env) -> Result<(Formula, Db, Db), AnyError> {
    let url = env.url(Side::Controller);
    let db = Db::connect(&url).await?;
    let sweep = Db::connect_with(&url, DbOptions::default().max_connections(2)).await?;
    let f = Formula::without_migrations(
        db.clone(),
        FormulaOptions::default()
            .sweep(CHUNK, CHUNKS_PER_TURN)
            .reconcile_db(sweep.clone()),
    );
    Ok((f, db, sweep))
}

fn controller(
    f: &Formula,
) -> Result<
    (
        Controller<nexuscrm_formula::FormulaSource>,
        ControllerHandle,
    ),
    AnyError,
> {
    let ctl = Controller::new(
        f.source(),
        Config::new("formula").capacity(NonZeroUsize::new(2).expect("2")),
    )?;
    f.set_waker(ctl.waker());
    let handle = ctl.handle();
    Ok((ctl, handle))
}

pub(crate) async fn formula(env: &Env, plan: &Plan) -> Result<FormulaEvidence, AnyError> {
    let n = plan.formula_records;
    env.reset_tables().await?;
    // Canonical records through Bulk, as the tool (not counted), before any view runs.
    let bulk = Bulk::without_migrations(
        env.db.clone(),
        1,
        BulkOptions::default().config(BulkConfig::default()),
    );
    let bulk_ctl = Controller::new(
        bulk.source(),
        Config::new("bulk").capacity(NonZeroUsize::new(4).expect("4")),
    )?;
    bulk.set_waker(bulk_ctl.waker());
    let bulk_stop = CancellationToken::new();
    let bulk_task = tokio::spawn(bulk_ctl.run(bulk_stop.clone()));
    write(&bulk, n, 0).await?;
    let done = env
        .wait_count(
            "SELECT COUNT(*) FROM crm_record WHERE revision = 1",
            n as i64,
            Duration::from_secs(600),
        )
        .await;
    if done < n as i64 {
        return Err(format!("Bulk wrote {done} of {n} records").into());
    }
    let tool = Formula::without_migrations(env.db.clone(), FormulaOptions::default());
    for (name, expr) in FORMULAS {
        tool.define(name, expr, None).await?;
    }
    let mut converged = Vec::new();

    // 1. A fresh process: its startup sweep finds every record, its claims derive them.
    eprintln!("  fresh process over {n} records ...");
    let (f, db, sweep) = view(env).await?;
    let (ctl, handle) = controller(&f)?;
    env.reset_stats().await?;
    let started = Instant::now();
    let stop = CancellationToken::new();
    let task = tokio::spawn(ctl.run(stop.clone()));
    derived(env, n, 1, Duration::from_secs(600)).await?;
    let secs = started.elapsed().as_secs_f64();
    let digests = env.digests(Side::Controller).await?;
    converged.push(summary(
        "fresh process (startup sweep)",
        n,
        secs,
        None,
        digests,
    ));

    // 2. The running process: Bulk changes every record again, the view follows its segments.
    eprintln!("  live: Bulk changes {n} records ...");
    bulk.watch_records(handle.waker());
    tokio::time::sleep(Duration::from_millis(300)).await;
    env.reset_stats().await?;
    let started = Instant::now();
    write(&bulk, n, 1).await?;
    let written = env
        .wait_count(
            "SELECT COUNT(*) FROM crm_record WHERE revision = 2",
            n as i64,
            Duration::from_secs(600),
        )
        .await;
    let last_write = started.elapsed().as_secs_f64();
    if written < n as i64 {
        return Err(format!("Bulk changed {written} of {n} records").into());
    }
    derived(env, n, 2, Duration::from_secs(600)).await?;
    let secs = started.elapsed().as_secs_f64();
    let s = handle.snapshot();
    eprintln!(
        "  live: Bulk done after {last_write:.2} s, view after {secs:.2} s; claims {} (full {}, empty {}), attempts {}, next_work_at {}, timers fired {}, wakes {} ({} coalesced), attempt time {:?}",
        s.claim_calls,
        s.claims_full,
        s.claims_empty,
        s.attempts_completed,
        s.next_work_at_calls,
        s.timers_fired,
        s.wakes_received,
        s.wakes_coalesced,
        std::time::Duration::from_nanos(s.attempt_duration.sum),
    );
    let digests = env.digests(Side::Controller).await?;
    converged.push(summary(
        "running process (change cursor, woken by Bulk's segments)",
        n,
        secs,
        Some((secs - last_write).max(0.0)),
        digests,
    ));

    // 3. Idle: nothing changes; then one requested backstop turn.
    eprintln!("  idle: {:?} ...", plan.idle);
    tokio::time::sleep(Duration::from_millis(500)).await;
    env.reset_stats().await?;
    let idle_started = Instant::now();
    tokio::time::sleep(plan.idle).await;
    let idle_digests = env.digests(Side::Controller).await?;
    let idle_window_secs = idle_started.elapsed().as_secs_f64();
    env.reset_stats().await?;
    handle.request_reconcile();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let statements_per_backstop = totals(&env.digests(Side::Controller).await?).statements;
    stop.cancel();
    let _ = task.await;
    bulk_stop.cancel();
    let _ = bulk_task.await;
    db.close().await;
    sweep.close().await;

    eprintln!("  plans at {:?} records ...", plan.explain_rows);
    let plans = explain(env, plan).await?;
    Ok(FormulaEvidence {
        records: n,
        converged,
        idle_window_secs,
        idle_statements: totals(&idle_digests).statements,
        idle_digests,
        statements_per_backstop,
        sweep_chunk: CHUNK,
        sweep_chunks_per_turn: CHUNKS_PER_TURN,
        plans,
    })
}

fn summary(
    path: &'static str,
    n: usize,
    secs: f64,
    lag: Option<f64>,
    digests: Vec<Digest>,
) -> Converged {
    let statements = totals(&digests).statements;
    Converged {
        path,
        records: n,
        secs,
        records_per_s: n as f64 / secs.max(f64::MIN_POSITIVE),
        statements,
        statements_per_record: statements as f64 / n.max(1) as f64,
        lag_after_last_write_secs: lag,
        digests: digests.into_iter().take(12).collect(),
    }
}

/// The plans of the view's claim, next-work, change-cursor and sweep statements, with 10
/// records due and the rest derived.
async fn explain(env: &Env, plan: &Plan) -> Result<Vec<Explained>, AnyError> {
    const ELIGIBLE: usize = 10;
    let q = |name| nexuscrm_formula::statement(Dialect::Postgres, name);
    let now = nexuscrm_persistence::support::to_ms(std::time::SystemTime::now());
    let statements: [(&'static str, &'static str, String); 7] = [
        (
            "claim",
            q("claim"),
            format!("('tok', {}, 1, {now}, 100)", now + 30_000),
        ),
        ("next_due", q("next_due"), String::new()),
        ("next_backlog", q("next_backlog"), String::new()),
        (
            "records changes_after",
            "SELECT id, record_key FROM crm_record_change WHERE id > $1 ORDER BY id LIMIT $2",
            "(0, 1000)".into(),
        ),
        ("sweep_records", q("sweep_records"), "('r-5', 1000)".into()),
        ("sweep_view", q("sweep_view"), "('r-5', 1000)".into()),
        (
            "sweep_rollup_bound",
            q("sweep_rollup_bound"),
            "('', 999)".into(),
        ),
    ];
    let mut c = PgConnection::connect(&env.tool_url()).await?;
    let mut out = Vec::new();
    for &n in &plan.explain_rows {
        eprintln!("    {n} records");
        env.reset_tables().await?;
        // n records at revision 1, all derived (one value per record), 10 of them due, and
        // n / 10 accounts; the change log holds one entry per record.
        for sql in [
            "INSERT INTO crm_record (record_key, revision, data, updated_at) \
             SELECT 'r-' || g, 1, '{}', 0 FROM generate_series(1, $1) g",
            "INSERT INTO crm_record_change (job_id, ordinal, record_key, revision, applied_at) \
             SELECT 1, g, 'r-' || g, 1, 0 FROM generate_series(1, $1) g",
            "INSERT INTO formula_record (record_key, source_revision, epoch, account, \
             contribution, errors, due_at, derived_at) \
             SELECT 'r-' || g, 1, 1, 'a-' || (g % GREATEST($1 / 10, 1)), g % 1000, 0, \
             CASE WHEN g <= $2 THEN 0 END, 0 FROM generate_series(1, $1) g",
            "INSERT INTO formula_value (record_key, formula, value, error, source_revision, \
             definition_version, digest) \
             SELECT 'r-' || g, 'weighted', '1', NULL, 1, 1, 'd' FROM generate_series(1, $1) g",
            "INSERT INTO formula_cursor (name, position) VALUES ('changes', 0), ('epoch', 0)",
        ] {
            let mut query = sqlx::query(sql);
            if sql.contains("$1") {
                query = query.bind(n as i64);
            }
            if sql.contains("$2") {
                query = query.bind(ELIGIBLE as i64);
            }
            query.execute(&mut c).await?;
        }
        for t in [
            "crm_record",
            "crm_record_change",
            "formula_record",
            "formula_value",
        ] {
            sqlx::query(&format!("ANALYZE {t}")).execute(&mut c).await?;
        }
        // The roll-up check reads the range the bound closes (one chunk of records).
        let upper: String = sqlx::query_scalar(q("sweep_rollup_bound"))
            .bind("")
            .bind(999_i64)
            .fetch_optional(&mut c)
            .await?
            .unwrap_or_default();
        let rollup = (
            "sweep_rollup_canonical",
            q("sweep_rollup_canonical"),
            format!("('', '{upper}')"),
        );
        // The value rows of one chunk: the view's keys after 'r-5' up to the chunk's last.
        let last: String = sqlx::query_scalar(
            "SELECT record_key FROM formula_record WHERE record_key > 'r-5' \
             ORDER BY record_key LIMIT 1 OFFSET 999",
        )
        .fetch_optional(&mut c)
        .await?
        .unwrap_or_else(|| "r-999999999".into());
        let values = (
            "sweep_values",
            q("sweep_values"),
            format!("('r-5', '{last}')"),
        );
        for (name, sql, args) in statements.iter().chain([&values, &rollup]) {
            let (text, seq, buffers, ms) = explain_one(&mut c, sql, args).await?;
            out.push(Explained {
                family: "formula",
                statement: name,
                rows: n,
                eligible: ELIGIBLE,
                seq_scan: seq,
                buffers,
                execution_ms: ms,
                plan: text,
            });
        }
    }
    c.close().await?;
    env.reset_tables().await?;
    Ok(out)
}
