//! `nexuscrm-runtime-worker`: the Runtime Worker process.
//!
//! Exit codes: 0 after a clean drain; 1 for bad input or an unreachable database; 2 when a
//! controller was poisoned (an attempt failed, an outcome-unknown store error, or a drain that
//! overran its bound): the supervisor must replace the process.

#![forbid(unsafe_code)]

use std::num::NonZeroUsize;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};
use nexuscrm_bulk::{Bulk, BulkOptions, JobId, NewJob, RowInput};
use nexuscrm_flow::{
    Flow, FlowOptions, FlowRun, MisfirePolicy, NewSchedule, ScheduleId, ScheduleStatus, Spec, spec,
};
use nexuscrm_paused::{NewPause, PausedFlow, PausedOptions, Resolution};
use nexuscrm_persistence::Db;
use nexuscrm_worker::{Config, Controller};
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

mod admin;
mod audit_cli;
mod config;
mod console;
mod formula_cli;
mod http;
mod metrics;
mod registry;
mod resume;
mod stall;
mod supervise;

use config::RawConfig;

#[derive(Parser, Debug)]
#[command(
    name = "nexuscrm-runtime-worker",
    version,
    about = "The NexusCRM Runtime Worker"
)]
struct Cli {
    /// Database URL: sqlite://FILE (default sqlite://nexuscrm-worker.db), postgres://…, mysql://…
    /// [env: NEXUSCRM_DATABASE_URL]
    #[arg(long, global = true)]
    database_url: Option<String>,
    /// A TOML config file (overridden by NEXUSCRM_* environment variables, then by flags).
    #[arg(long, global = true)]
    config: Option<std::path::PathBuf>,
    /// Log format: text (default) or json. [env: NEXUSCRM_LOG_FORMAT]
    #[arg(long, global = true)]
    log_format: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Start the worker, submit sample Bulk work, show progress until done, print the snapshot.
    Demo {
        /// Sample jobs to submit.
        #[arg(long, default_value_t = 5)]
        jobs: usize,
        /// Rows per sample job.
        #[arg(long, default_value_t = 400)]
        rows: usize,
    },
    /// Run the worker until SIGINT/SIGTERM, then drain.
    Run {
        /// This deployment's generation (a newer one fences older ones out). Default 1.
        #[arg(long)]
        generation: Option<i64>,
        /// Admin HTTP address, loopback only. Default 127.0.0.1:9464.
        #[arg(long)]
        admin_addr: Option<String>,
        /// Concurrent Bulk attempts. Default 4.
        #[arg(long)]
        bulk_capacity: Option<usize>,
        /// Bulk lease, in seconds. Default 30.
        #[arg(long)]
        bulk_lease_secs: Option<f64>,
        /// Drain bound after a stop signal, in seconds. Default 30.
        #[arg(long)]
        shutdown_timeout_secs: Option<u64>,
    },
    /// Print a running worker's snapshot (from its admin server).
    Status {
        /// Admin HTTP address. Default 127.0.0.1:9464.
        #[arg(long, default_value = config::DEFAULT_ADMIN_ADDR)]
        admin_addr: String,
    },
    /// Apply the database migrations and exit.
    Migrate,
    /// Bulk jobs: submit, status, list.
    Bulk {
        #[command(subcommand)]
        command: BulkCommand,
    },
    /// Scheduled Flow schedules: create, list, pause, resume, delete, runs.
    Schedule {
        #[command(subcommand)]
        command: ScheduleCommand,
    },
    /// Paused flow steps: create, list, show, resume, cancel.
    Pause {
        #[command(subcommand)]
        command: PauseCommand,
    },
    /// Formula View: define, list, drop formulas; show a record's derived values; the roll-up.
    Formula {
        #[command(subcommand)]
        command: formula_cli::FormulaCommand,
    },
    /// The audit trail: the last events in the audit file, what waits for delivery.
    Audit {
        #[command(subcommand)]
        command: audit_cli::AuditCommand,
    },
    /// Every asynchronous path this worker runs: its declaration, owner crate and proofs.
    Families {
        /// Print JSON (the `/families` document) instead of the table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
enum PauseCommand {
    /// Pause a run at a step (as a flow would); prints the pause id and its resume token,
    /// shown this once.
    Create {
        /// The run.
        run: String,
        /// The step.
        step: String,
        /// How long it waits for a resume: 30s, 5m, 2h, 1d (at most 366 days).
        #[arg(long, default_value = "1d")]
        timeout: String,
        /// The pause's payload, as JSON.
        #[arg(long, default_value = "{}")]
        payload: String,
    },
    /// The newest pauses, of one state or of all.
    List {
        /// Only this state: paused, resumable, timed_out, leased, observing, completed,
        /// uncertain, poisoned, cancelled.
        #[arg(long)]
        state: Option<String>,
        /// How many.
        #[arg(long, default_value_t = 20)]
        limit: i64,
    },
    /// One pause with its payloads (never its token).
    Show {
        /// The pause id.
        id: i64,
    },
    /// Resume a pause with its token (idempotent: the same token and payload again is
    /// acknowledged again).
    Resume {
        /// The resume token (prt_…).
        token: String,
        /// The resume payload, as JSON.
        #[arg(long, default_value = "{}")]
        payload: String,
    },
    /// Cancel a pause that is still paused.
    Cancel {
        /// The pause id.
        id: i64,
    },
    /// Resolve an uncertain pause: an explicit, recorded decision. --applied completes it;
    /// --not-applied and --retry send its effect again with the same idempotency key.
    Resolve {
        /// The pause id.
        id: i64,
        /// The effect was applied (checked with the receiver).
        #[arg(long, conflicts_with_all = ["not_applied", "retry"], required_unless_present_any = ["not_applied", "retry"])]
        applied: bool,
        /// The effect was not applied.
        #[arg(long, conflicts_with = "retry")]
        not_applied: bool,
        /// Send it again under a new attempt with the same idempotency key.
        #[arg(long)]
        retry: bool,
        /// Who decides (recorded with the decision). Default: $USER.
        #[arg(long)]
        by: Option<String>,
    },
}

/// The pause states `pause list --state` accepts.
const PAUSE_STATES: [&str; 9] = [
    "paused",
    "resumable",
    "timed_out",
    "leased",
    "observing",
    "completed",
    "uncertain",
    "poisoned",
    "cancelled",
];

/// `text` as JSON, refused with the flag's name and the parser's position.
fn json_arg(flag: &str, text: &str) -> Result<Value, AnyError> {
    serde_json::from_str(text)
        .map_err(|e| format!("--{flag} is not JSON ({e}): {:?}", echo(text, 80)).into())
}

async fn pause_command(
    url: &str,
    audit: bool,
    command: PauseCommand,
) -> Result<ExitCode, AnyError> {
    let db = Db::connect(url).await?;
    // `pause resolve` writes its decision's audit event when `audit.enabled`.
    let store = PausedFlow::open(db, PausedOptions::default().audit(audit)).await?;
    match command {
        PauseCommand::Create {
            run,
            step,
            timeout,
            payload,
        } => {
            let timeout = spec::parse_duration(&timeout)?;
            let payload = json_arg("payload", &payload)?;
            let p = store
                .pause(NewPause::new(run, step, timeout, payload))
                .await?;
            println!("{}", p.id);
            println!("{}", p.token.expose());
            eprintln!(
                "(pause {} times out at {}; the token is shown once: keep it)",
                p.id,
                spec::format_time(p.timeout_at)
            );
        }
        PauseCommand::List { state, limit } => {
            if let Some(s) = &state
                && !PAUSE_STATES.contains(&s.as_str())
            {
                return Err(format!(
                    "unknown state {:?}: one of {}",
                    echo(s, 40),
                    PAUSE_STATES.join(", ")
                )
                .into());
            }
            println!(
                "{:>6}  {:<10} {:<25} {:<24} run / step",
                "id", "state", "times out", "resumed"
            );
            for p in store.list(state.as_deref(), limit).await? {
                println!(
                    "{:>6}  {:<10} {:<25} {:<24} {} / {}",
                    p.id,
                    p.state,
                    spec::format_time(p.timeout_at),
                    p.resumed_at.map_or_else(|| "-".into(), spec::format_time),
                    p.run,
                    p.step
                );
            }
        }
        PauseCommand::Show { id } => {
            let p = store
                .status(id)
                .await?
                .ok_or_else(|| format!("no pause {id}"))?;
            println!(
                "{}",
                json!({
                    "id": p.id,
                    "run": p.run,
                    "step": p.step,
                    "state": p.state,
                    "payload": p.payload,
                    "resume_payload": p.resume_payload,
                    "timeout_at": spec::format_time(p.timeout_at),
                    "resumed_at": p.resumed_at.map(spec::format_time),
                    "attempts": p.attempts,
                    "created_at": spec::format_time(p.created_at),
                    "effect_key": p.effect_key,
                    "intent_at": p.intent_at.map(spec::format_time),
                    "outcome": p.outcome,
                })
            );
        }
        PauseCommand::Resume { token, payload } => {
            let payload = json_arg("payload", &payload)?;
            let r = store.resume(&token, &payload).await?;
            println!("{}", r.id);
            if !r.first {
                eprintln!("(already resumed with this payload)");
            }
        }
        PauseCommand::Cancel { id } => {
            let p = store.cancel(id).await?;
            println!("pause {} {}", p.id, p.state);
        }
        PauseCommand::Resolve {
            id,
            applied,
            not_applied,
            retry: _,
            by,
        } => {
            let resolution = if applied {
                Resolution::Applied
            } else if not_applied {
                Resolution::NotApplied
            } else {
                Resolution::Retry
            };
            let actor = by
                .or_else(|| std::env::var("USER").ok())
                .unwrap_or_else(|| "operator".into());
            let p = store.resolve(id, resolution, &actor).await?;
            tracing::warn!(pause = id, decision = ?resolution, by = %actor, "uncertain pause resolved");
            println!("pause {} {} (resolved by {actor})", p.id, p.state);
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Subcommand, Debug)]
enum ScheduleCommand {
    /// Create a schedule (acknowledged after commit); prints its id. Repeating the same create
    /// is safe; the same name with another definition is refused.
    Create {
        /// Unique schedule name.
        name: String,
        /// The flow each run starts.
        #[arg(long)]
        flow: String,
        /// A cron expression: six fields with seconds (`0 30 9 * * MON-FRI`) or five.
        #[arg(long, conflicts_with = "every", required_unless_present = "every")]
        cron: Option<String>,
        /// The IANA time zone of the cron expression.
        #[arg(long, default_value = "UTC", requires = "cron")]
        zone: String,
        /// A fixed interval instead: 30s, 5m, 2h, 1d.
        #[arg(long)]
        every: Option<String>,
        /// Missed occurrences: fire-once, skip or catch-up.
        #[arg(long, default_value = "fire-once")]
        policy: String,
        /// The bound of catch-up.
        #[arg(long, default_value_t = 100)]
        catch_up_max: u32,
        /// First occurrence at or after now plus this (e.g. 10s); anchors an interval there.
        #[arg(long)]
        start_in: Option<String>,
        /// Create it paused.
        #[arg(long)]
        paused: bool,
    },
    /// List schedules.
    List {
        /// How many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Pause a schedule by name.
    Pause {
        /// The schedule name.
        name: String,
    },
    /// Resume a paused schedule by name (from now: paused occurrences are not run).
    Resume {
        /// The schedule name.
        name: String,
    },
    /// Delete a schedule by name (its runs stay).
    Delete {
        /// The schedule name.
        name: String,
    },
    /// Reserved runs, newest first: of one schedule, or of all.
    Runs {
        /// The schedule name (all schedules when omitted).
        name: Option<String>,
        /// How many.
        #[arg(long, default_value_t = 20)]
        limit: i64,
    },
}

#[derive(Subcommand, Debug)]
enum BulkCommand {
    /// Accept a job (acknowledged only after commit); prints the job id.
    Submit {
        /// Idempotency key (default: generated).
        #[arg(long)]
        key: Option<String>,
        /// A generated sample of N rows.
        #[arg(long, conflicts_with = "file")]
        sample: Option<usize>,
        /// A JSON Lines file (one {"record_key": "...", "fields": {...}} per line), or a .csv file
        /// with a header row naming record_key and the field columns.
        #[arg(long)]
        file: Option<std::path::PathBuf>,
        /// Rows per segment.
        #[arg(long)]
        segment_size: Option<u32>,
    },
    /// One job's status.
    Status {
        /// The job id.
        job: i64,
    },
    /// The newest jobs.
    List {
        /// How many.
        #[arg(long, default_value_t = 20)]
        limit: i64,
    },
    /// Run a poisoned job again (an operator decision, logged): it returns to pending with a
    /// fresh count of claims without progress; rows already applied stay applied.
    Retry {
        /// The job id.
        job: i64,
    },
}

fn main() -> ExitCode {
    // A usage error is bad input: exit 1 (2 is reserved for "poisoned, replace the process").
    // --help and --version still exit 0.
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let settings = match settings(&cli) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    let traces = match init_logs(
        settings.log_format,
        settings.otlp_traces_endpoint.as_deref(),
    ) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let code = match rt.block_on(run(cli, settings)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    };
    drop(rt);
    drop(traces);
    code
}

pub(crate) type AnyError = Box<dyn std::error::Error + Send + Sync>;

/// The CLI's Flow handle: its schedule changes write audit events (as `cli:$USER`) when
/// `audit.enabled`.
async fn open_flow(url: &str, audit: bool) -> Result<Flow, AnyError> {
    let db = Db::connect(url).await?;
    let options = FlowOptions::default().config(nexuscrm_flow::FlowConfig::default().audit(audit));
    let actor = std::env::var("USER").map_or_else(|_| "cli".to_owned(), |u| format!("cli:{u}"));
    Ok(Flow::open(db, 1, options).await?.acting_as(&actor))
}

async fn find(flow: &Flow, name: &str) -> Result<ScheduleId, AnyError> {
    Ok(flow
        .by_name(name)
        .await?
        .ok_or_else(|| format!("no schedule named {name:?}"))?
        .id)
}

fn print_schedule_header() {
    println!(
        "{:>5}  {:<28} {:<14} {:<8} {:>4} {:<25} {:>6}  spec / policy",
        "id", "name", "flow", "state", "ver", "next occurrence", "runs"
    );
}

fn print_schedule(s: &ScheduleStatus) {
    println!(
        "{:>5}  {:<28} {:<14} {:<8} {:>4} {:<25} {:>6}  {} / {}",
        s.id,
        s.name,
        s.flow,
        s.state,
        s.version,
        s.next_occurrence_at
            .map_or_else(|| "never".into(), spec::format_time),
        s.runs,
        s.spec,
        s.policy
    );
}

fn print_runs(runs: &[FlowRun]) {
    println!(
        "{:>7}  {:>8}  {:<14} {:<25} reserved",
        "run", "schedule", "flow", "occurrence"
    );
    for r in runs {
        println!(
            "{:>7}  {:>8}  {:<14} {:<25} {}",
            r.id,
            r.schedule,
            r.flow,
            spec::format_time(r.occurrence_at),
            spec::format_time(r.reserved_at)
        );
    }
}

async fn schedule_command(
    url: &str,
    audit: bool,
    command: ScheduleCommand,
) -> Result<ExitCode, AnyError> {
    let flow = open_flow(url, audit).await?;
    match command {
        ScheduleCommand::Create {
            name,
            flow: flow_name,
            cron,
            zone,
            every,
            policy,
            catch_up_max,
            start_in,
            paused,
        } => {
            let spec = match (cron, every) {
                (Some(expr), None) => Spec::cron(expr, zone),
                (None, Some(d)) => Spec::Every(spec::parse_duration(&d)?),
                _ => return Err("give --cron EXPR or --every DURATION".into()),
            };
            let policy = MisfirePolicy::parse(&policy, catch_up_max)?;
            let mut new = NewSchedule::new(name, flow_name, spec, policy);
            new.paused = paused;
            if let Some(d) = start_in {
                new.start_at = Some(SystemTime::now() + spec::parse_duration(&d)?);
            }
            let c = flow.create(new).await?;
            println!("{}", c.id);
            if !c.created {
                eprintln!("(an existing schedule with this name and definition)");
            }
        }
        ScheduleCommand::List { limit } => {
            print_schedule_header();
            for s in flow.list(limit).await? {
                print_schedule(&s);
            }
        }
        ScheduleCommand::Pause { name } => {
            let s = flow.pause(find(&flow, &name).await?).await?;
            print_schedule_header();
            print_schedule(&s);
        }
        ScheduleCommand::Resume { name } => {
            let s = flow.resume(find(&flow, &name).await?).await?;
            print_schedule_header();
            print_schedule(&s);
        }
        ScheduleCommand::Delete { name } => {
            flow.delete(find(&flow, &name).await?).await?;
            println!("deleted {name}");
        }
        ScheduleCommand::Runs { name, limit } => {
            let id = match name {
                Some(n) => Some(find(&flow, &n).await?),
                None => None,
            };
            print_runs(&flow.runs(id, limit).await?);
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn open(url: &str, generation: i64) -> Result<Bulk, AnyError> {
    let db = Db::connect(url).await?;
    Ok(Bulk::open(db, generation, BulkOptions::default()).await?)
}

/// File, then environment, then flags.
fn settings(cli: &Cli) -> Result<config::Settings, String> {
    let file = match &cli.config {
        Some(path) => RawConfig::from_file(path)?,
        None => RawConfig::default(),
    };
    let mut flags = RawConfig {
        database_url: cli.database_url.clone(),
        log_format: cli.log_format.clone(),
        ..RawConfig::default()
    };
    if let Command::Run {
        generation,
        admin_addr,
        bulk_capacity,
        bulk_lease_secs,
        shutdown_timeout_secs,
    } = &cli.command
    {
        flags.generation = *generation;
        flags.admin_addr = admin_addr.clone();
        flags.shutdown_timeout_secs = *shutdown_timeout_secs;
        flags.bulk = Some(config::RawBulk {
            capacity: *bulk_capacity,
            lease_secs: *bulk_lease_secs,
            ..config::RawBulk::default()
        });
    }
    file.overlay(RawConfig::from_env()?)
        .overlay(flags)
        .validate()
}

/// The OTLP span pipeline, when traces are exported: flushed and shut down at exit.
struct Traces(opentelemetry_sdk::trace::SdkTracerProvider);

impl Drop for Traces {
    fn drop(&mut self) {
        // Export what is buffered before the process ends; an unreachable collector only
        // costs the exporter's timeout.
        if let Err(e) = self.0.shutdown() {
            eprintln!("warning: exporting the last spans failed: {e}");
        }
    }
}

/// Logs to stderr (text or JSON), and, when `otlp` names a collector, every span (claim,
/// attempt, disposition, reconcile; with family, item and generation) over OTLP/HTTP as JSON
/// too, in batches from a thread of its own, so an absent collector never slows the work.
fn init_logs(format: config::LogFormat, otlp: Option<&str>) -> Result<Option<Traces>, AnyError> {
    use std::io::IsTerminal as _;
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal());
    let fmt = match format {
        config::LogFormat::Json => fmt.json().boxed(),
        config::LogFormat::Text => fmt.boxed(),
    };
    let level = tracing_subscriber::filter::LevelFilter::INFO;
    let Some(endpoint) = otlp else {
        let _ = tracing_subscriber::registry()
            .with(fmt.with_filter(level))
            .try_init();
        return Ok(None);
    };
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_otlp::WithExportConfig as _;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpJson)
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| format!("otlp_traces_endpoint {endpoint}: {e}"))?;
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name("nexuscrm-runtime-worker")
                .build(),
        )
        .build();
    let tracer = provider.tracer("nexuscrm-runtime-worker");
    let _ = tracing_subscriber::registry()
        .with(fmt.with_filter(level))
        .with(
            tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_filter(level),
        )
        .try_init();
    Ok(Some(Traces(provider)))
}

async fn run(cli: Cli, settings: config::Settings) -> Result<ExitCode, AnyError> {
    let url = settings.database_url.clone();
    match cli.command {
        Command::Status { admin_addr } => supervise::print_status(&admin_addr).await,
        Command::Families { json } => {
            if json {
                println!("{:#}", registry::json(&[]));
            } else {
                print!("{}", registry::table());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Migrate => {
            let bulk = open(&url, 1).await?;
            Flow::open(bulk.db().clone(), 1, FlowOptions::default()).await?;
            PausedFlow::open(bulk.db().clone(), PausedOptions::default()).await?;
            formula_cli::open_formula(bulk.db().clone()).await?;
            nexuscrm_audit::migrate(bulk.db()).await?;
            println!(
                "migrated bulk, flow, paused, formula and audit on {} ({})",
                bulk.db().url(),
                bulk.db().dialect()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Bulk { command } => bulk_command(&url, command).await,
        Command::Schedule { command } => {
            schedule_command(&url, settings.audit.enabled, command).await
        }
        Command::Pause { command } => pause_command(&url, settings.audit.enabled, command).await,
        Command::Formula { command } => formula_cli::formula_command(&url, command).await,
        Command::Audit { command } => audit_cli::audit_command(&settings, command).await,
        Command::Run { .. } => supervise::run(settings).await,
        Command::Demo { jobs, rows } => demo(&url, &settings, jobs, rows).await,
    }
}

pub(crate) fn owner() -> String {
    format!("pid-{}", std::process::id())
}

fn exit_for(result: Result<(), (bool, String)>) -> ExitCode {
    match result {
        Ok(()) => {
            eprintln!("nexuscrm-runtime-worker: drained cleanly");
            ExitCode::SUCCESS
        }
        Err((true, e)) => {
            eprintln!("nexuscrm-runtime-worker: {e}");
            ExitCode::from(2)
        }
        Err((false, e)) => {
            eprintln!("nexuscrm-runtime-worker: stopped: {e}");
            ExitCode::from(1)
        }
    }
}

/// Registers SIGINT/SIGTERM handlers now (synchronously, so no signal between this call and
/// the first await is lost to the default action), then returns the task that cancels `cancel`
/// on the first signal and exits with 130 on the second.
pub(crate) fn listen_for_signals(
    cancel: CancellationToken,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        Ok(tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::info!("stop signal: draining");
            cancel.cancel();
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::warn!("second signal: exiting at once");
            std::process::exit(130);
        }))
    }
    #[cfg(not(unix))]
    {
        Ok(tokio::spawn(async move {
            let _ = tokio::signal::ctrl_c().await;
            cancel.cancel();
        }))
    }
}

/// The sample records' accounts (the roll-up's groups).
const DEMO_ACCOUNTS: [&str; 5] = ["Acme", "Globex", "Initech", "Umbrella", "Hooli"];
/// The sample records' stages with their win probabilities.
const DEMO_STAGES: [(&str, u32); 4] = [
    ("prospecting", 10),
    ("negotiation", 60),
    ("closed-won", 100),
    ("closed-lost", 0),
];
/// The demo's formula fields: `(name, CEL expression)`.
const DEMO_FORMULAS: [(&str, &str); 2] = [
    (
        "weighted_amount",
        "record.amount * record.probability / 100",
    ),
    (
        "deal_label",
        "record.stage == 'closed-won' ? 'won: ' + record.account : record.account + ' (' + record.stage + ')'",
    ),
];

fn sample_rows(prefix: &str, n: usize) -> Vec<RowInput> {
    (0..n)
        .map(|i| {
            // Opportunity-like fields, so the demo's formulas and the roll-up have input.
            let (stage, probability) = DEMO_STAGES[i % DEMO_STAGES.len()];
            let fields = match json!({
                "name": format!("Contact {i}"),
                "email": format!("contact{i}@example.com"),
                "account": DEMO_ACCOUNTS[i % DEMO_ACCOUNTS.len()],
                "amount": 100 + (i * 37) % 900,
                "stage": stage,
                "probability": probability,
            }) {
                Value::Object(m) => m,
                _ => Map::new(),
            };
            RowInput::new(format!("{prefix}-{i}"), fields)
        })
        .collect()
}

fn stamp() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

async fn bulk_command(url: &str, command: BulkCommand) -> Result<ExitCode, AnyError> {
    let bulk = open(url, 1).await?;
    match command {
        BulkCommand::Submit {
            key,
            sample,
            file,
            segment_size,
        } => {
            let key = key.unwrap_or_else(|| format!("cli-{}", stamp()));
            // A spinner on stderr while a large file is read and submitted; hidden when stderr
            // is not a terminal, so scripts see only the job id.
            let spinner = indicatif::ProgressBar::new_spinner();
            let (rows, source) = match (sample, file) {
                (Some(n), None) => (sample_rows(&key, n), None),
                (None, Some(path)) => {
                    spinner.set_message(format!("reading {}", path.display()));
                    spinner.enable_steady_tick(Duration::from_millis(100));
                    let input = read_rows(&path);
                    let input = match input {
                        Ok(input) => input,
                        Err(e) => {
                            spinner.finish_and_clear();
                            return Err(e);
                        }
                    };
                    (input.rows, Some((path.display().to_string(), input.lines)))
                }
                _ => return Err("give --sample N or --file PATH".into()),
            };
            spinner.set_message(format!("submitting {} rows (one transaction)", rows.len()));
            let mut job = NewJob::new(key, rows);
            job.segment_size = segment_size;
            let submitted = bulk.submit(job).await;
            spinner.finish_and_clear();
            let s = match submitted {
                Ok(s) => s,
                // A refused row is named by its file and line, as parse errors are.
                Err(e) => {
                    return Err(match (e.row(), &source) {
                        (Some(i), Some((name, lines))) if i < lines.len() => {
                            format!("{name}:{}: {}", lines[i], e.detail()).into()
                        }
                        _ => e.into(),
                    });
                }
            };
            println!("{}", s.job);
            if !s.created {
                eprintln!("(an existing job with this idempotency key)");
            }
        }
        BulkCommand::Status { job } => match bulk.status(JobId(job)).await? {
            Some(s) => println!(
                "job {} [{}] {}: {}/{} rows applied, {} rejected, {} attempt(s){}",
                s.id,
                s.idempotency_key,
                s.state,
                s.applied_rows,
                s.total_rows,
                s.rejected_rows,
                s.attempts,
                s.last_error
                    .map(|e| format!(", last error: {e}"))
                    .unwrap_or_default()
            ),
            None => return Err(format!("no bulk job {job}").into()),
        },
        BulkCommand::Retry { job } => {
            let s = bulk.retry(JobId(job)).await?;
            println!(
                "job {} [{}] {}: retried at row {} of {}",
                s.id, s.idempotency_key, s.state, s.cursor, s.total_rows
            );
        }
        BulkCommand::List { limit } => {
            println!(
                "{:>6}  {:<10}  {:>9}  {:>9}  key",
                "id", "state", "applied", "total"
            );
            for s in bulk.list(limit).await? {
                println!(
                    "{:>6}  {:<10}  {:>9}  {:>9}  {}",
                    s.id, s.state, s.applied_rows, s.total_rows, s.idempotency_key
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Rows read from a file, with the line each one starts on (from 1), so a row the store
/// refuses is named `file:line` like a parse error.
#[derive(Debug)]
struct Input {
    rows: Vec<RowInput>,
    lines: Vec<u64>,
}

/// Rows from a `.csv` file (a header row naming `record_key` and the field columns; every
/// other column becomes a string field, empty cells are left out) or JSON Lines otherwise.
fn read_rows(path: &std::path::Path) -> Result<Input, AnyError> {
    let is_csv = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("csv"));
    if !is_csv {
        return read_jsonl(path);
    }
    let file =
        std::fs::File::open(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    parse_csv(file, &path.display().to_string())
}

fn parse_csv(input: impl std::io::Read, name: &str) -> Result<Input, AnyError> {
    let mut reader = csv::ReaderBuilder::new()
        .trim(csv::Trim::All)
        .from_reader(input);
    let headers = reader
        .headers()
        .map_err(|e| format!("{name}: unreadable CSV header: {e}"))?
        .clone();
    let mut seen = std::collections::HashSet::new();
    for (i, h) in headers.iter().enumerate() {
        if h.is_empty() {
            return Err(format!("{name}:1: column {} has an empty header", i + 1).into());
        }
        if !seen.insert(h) {
            return Err(format!(
                "{name}:1: the CSV header names column {:?} twice: every column must be distinct",
                echo(h, 64)
            )
            .into());
        }
    }
    let key_col = headers
        .iter()
        .position(|h| h == "record_key")
        .ok_or_else(|| format!("{name}: the CSV header has no \"record_key\" column"))?;
    let mut rows = Vec::new();
    let mut lines = Vec::new();
    for (n, record) in reader.records().enumerate() {
        // Line n + 2 unless the reader knows better (a quoted field may span lines): the header
        // is line 1.
        let record = record.map_err(|e| {
            let line = e.position().map_or(n as u64 + 2, csv::Position::line);
            format!("{name}:{line}: {e}")
        })?;
        let line = record.position().map_or(n as u64 + 2, csv::Position::line);
        let key = record.get(key_col).unwrap_or_default();
        if key.is_empty() {
            return Err(format!("{name}:{line}: empty record_key").into());
        }
        let mut fields = Map::new();
        for (i, value) in record.iter().enumerate() {
            if i != key_col && !value.is_empty() {
                fields.insert(headers[i].to_owned(), Value::String(value.to_owned()));
            }
        }
        rows.push(RowInput::new(key, fields));
        lines.push(line);
    }
    Ok(Input { rows, lines })
}

fn read_jsonl(path: &std::path::Path) -> Result<Input, AnyError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    parse_jsonl(&text, &path.display().to_string())
}

/// JSON Lines rows: one `{"record_key": "...", "fields": {...}}` per non-blank line.
fn parse_jsonl(text: &str, name: &str) -> Result<Input, AnyError> {
    // A byte-order mark is accepted, as it is for CSV.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut rows = Vec::new();
    let mut lines = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: Value =
            serde_json::from_str(line).map_err(|e| format!("{}:{}: not JSON: {e}", name, n + 1))?;
        let key = v
            .get("record_key")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("{}:{}: missing string \"record_key\"", name, n + 1))?;
        let fields = match v.get("fields") {
            Some(Value::Object(m)) => m.clone(),
            None => Map::new(),
            Some(_) => {
                return Err(format!("{}:{}: \"fields\" must be an object", name, n + 1).into());
            }
        };
        rows.push(RowInput::new(key, fields));
        lines.push(n as u64 + 1);
    }
    Ok(Input { rows, lines })
}

pub(crate) use nexuscrm_persistence::support::echo;

/// The demo's schedules: names unique to this run, deleted at the end.
fn demo_schedules(run_id: u128) -> Vec<NewSchedule> {
    let mut every = NewSchedule::new(
        format!("demo-{run_id}-every-1s"),
        "sync-contacts",
        Spec::Every(Duration::from_secs(1)),
        MisfirePolicy::CatchUp { max: 100 },
    );
    every.start_at = Some(SystemTime::now() + Duration::from_millis(500));
    let cron = NewSchedule::new(
        format!("demo-{run_id}-cron-2s"),
        "digest",
        Spec::cron("*/2 * * * * *", "Europe/Berlin"),
        MisfirePolicy::FireOnce,
    );
    // Started 5 s ago with catch-up: the first reservation backfills the missed occurrences.
    let mut backfill = NewSchedule::new(
        format!("demo-{run_id}-backfill"),
        "rollup",
        Spec::Every(Duration::from_secs(1)),
        MisfirePolicy::CatchUp { max: 100 },
    );
    backfill.start_at = Some(SystemTime::now() - Duration::from_secs(5));
    vec![every, cron, backfill]
}

async fn demo(
    url: &str,
    settings: &config::Settings,
    jobs: usize,
    rows: usize,
) -> Result<ExitCode, AnyError> {
    let db = Db::connect(url).await?;
    let bulk = Bulk::open(
        db,
        1,
        BulkOptions::default()
            .config(nexuscrm_bulk::BulkConfig::default().audit(settings.audit.enabled)),
    )
    .await?;
    bulk.take_ownership(&owner()).await?;
    // Usage telemetry, best-effort: exported when `telemetry.endpoint` is set, otherwise every
    // event is counted as dropped (`no_exporter`); the demo prints which.
    let telemetry = supervise::start_telemetry(settings)?;
    {
        let (t, tenant) = (telemetry.clone(), settings.telemetry.tenant.clone());
        bulk.on_segment_committed(move |seg| {
            t.emit(nexuscrm_telemetry::UsageEvent::new(
                tenant.as_str(),
                "bulk.rows_applied",
                seg.applied,
            ));
        });
    }
    let demo_audit = if settings.audit.enabled {
        Some(DemoAudit::start(&bulk, settings).await?)
    } else {
        None
    };
    let flow = Flow::open(
        bulk.db().clone(),
        1,
        FlowOptions::default()
            .config(nexuscrm_flow::FlowConfig::default().audit(settings.audit.enabled)),
    )
    .await?
    .acting_as("demo");
    flow.take_ownership(&owner()).await?;
    let flow_ctl = Controller::new(
        flow.source(),
        Config::new("flow").capacity(NonZeroUsize::new(8).expect("8")),
    )?;
    let flow_handle = flow_ctl.handle();
    flow.set_waker(flow_ctl.waker());
    let flow_cancel = CancellationToken::new();
    let flow_run = tokio::spawn(flow_ctl.run(flow_cancel.clone()));
    let demo_formula = DemoFormula::start(&bulk).await?;
    let config = Config::new("bulk")
        .capacity(NonZeroUsize::new(4).expect("4"))
        .claim_cooldown(Duration::from_millis(
            config::DEFAULT_BULK_CLAIM_COOLDOWN_MS,
        ));
    let ctl = Controller::new(bulk.source(), config)?;
    let handle = ctl.handle();
    bulk.set_waker(ctl.waker());
    let cancel = CancellationToken::new();
    let run = tokio::spawn(ctl.run(cancel.clone()));
    if !handle.ready().await {
        return Err("the bulk controller stopped before it was ready".into());
    }
    println!(
        "Runtime Worker demo on {} ({})",
        bulk.db().url(),
        bulk.db().dialect()
    );
    let run_id = stamp();
    let mut schedules = Vec::new();
    for new in demo_schedules(run_id) {
        let what = format!("{} / {}", new.spec, new.policy);
        let c = flow.create(new).await?;
        println!(
            "  created schedule {} ({what}, acknowledged after commit)",
            c.id
        );
        schedules.push(c.id);
    }
    let schedules_created = Instant::now();
    let mut ids = Vec::new();
    for j in 0..jobs {
        let key = format!("demo-{run_id}-{j}");
        let mut job = NewJob::new(key.clone(), sample_rows(&key, rows));
        job.segment_size = Some(50);
        let s = bulk.submit(job).await?;
        println!(
            "  accepted bulk job {} ({} rows, acknowledged after commit)",
            s.job, rows
        );
        ids.push(s.job);
    }
    let started = Instant::now();
    let total = (jobs * rows) as i64;
    // Drawn on stderr, and only when it is a terminal; stdout gets the final figures either
    // way, so a piped or logged demo still shows the work.
    let bar = indicatif::ProgressBar::new(u64::try_from(total).unwrap_or(0));
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "  bulk [{bar:30}] {pos}/{len} rows, {msg} ({elapsed})",
        )
        .map_err(|e| format!("progress template: {e}"))?
        .progress_chars("#>-"),
    );
    let (applied, terminal) = loop {
        let mut applied = 0;
        let mut terminal = 0;
        for id in &ids {
            if let Some(s) = bulk.status(*id).await? {
                applied += s.applied_rows + s.rejected_rows;
                terminal += usize::from(s.is_terminal());
            }
        }
        bar.set_position(u64::try_from(applied).unwrap_or(0));
        bar.set_message(format!("{terminal}/{jobs} jobs"));
        if terminal == jobs {
            break (applied, terminal);
        }
        if run.is_finished() {
            bar.abandon();
            return Err("the bulk controller stopped before the work was done".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    bar.finish_and_clear();
    println!("  bulk: {applied}/{total} rows, {terminal}/{jobs} jobs");
    println!("  done in {:.2?}", started.elapsed());
    cancel.cancel();
    let result = run.await?;
    let last = jobs
        .checked_sub(1)
        .map(|j| format!("demo-{run_id}-{j}-{}", rows.saturating_sub(1)));
    let shown: Vec<String> = (0..rows.min(3))
        .map(|i| format!("demo-{run_id}-0-{i}"))
        .chain(last.filter(|_| rows > 3))
        .collect();
    demo_formula.report(&shown).await?;
    // Let the schedules fire a few times, then show their runs.
    let watch = Duration::from_secs(5);
    if let Some(rest) = watch.checked_sub(schedules_created.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    println!("\nScheduled Flow runs (one per schedule and occurrence, reserved transactionally):");
    let mut runs = Vec::new();
    for id in &schedules {
        runs.extend(flow.runs(Some(*id), 100).await?);
    }
    runs.sort_by_key(|r| (r.occurrence_at, r.schedule));
    print_runs(&runs);
    println!();
    print_schedule_header();
    for id in &schedules {
        if let Some(s) = flow.schedule(*id).await? {
            print_schedule(&s);
        }
    }
    flow_cancel.cancel();
    let flow_result = flow_run.await?;
    // The demo's every-second schedules would keep firing in a later `run`: remove them.
    for id in &schedules {
        flow.delete(*id).await?;
    }
    let fsnap = flow_handle.snapshot();
    println!(
        "\nController snapshot (flow): claims {}  reservations {}  timers armed {} fired {}  \
         overdue suppressed {}",
        fsnap.claim_calls,
        fsnap.attempts_completed,
        fsnap.timers_armed,
        fsnap.timers_fired,
        fsnap.overdue_suppressed
    );
    if let Err(e) = flow_result {
        return Ok(exit_for(Err((e.is_poisoned(), e.to_string()))));
    }
    let snap = handle.snapshot();
    println!("\nController snapshot (bulk):");
    println!(
        "  claims {}  attempts claimed {}  completed {}  failed {}",
        snap.claim_calls, snap.attempts_claimed, snap.attempts_completed, snap.attempts_failed
    );
    println!(
        "  reconciles {} (startup {}, requested {}, backstop {})",
        snap.reconciles.total(),
        snap.reconciles.startup,
        snap.reconciles.requested,
        snap.reconciles.backstop
    );
    println!(
        "  next_work_at {}  timers armed {} fired {}  overdue suppressed {}",
        snap.next_work_at_calls, snap.timers_armed, snap.timers_fired, snap.overdue_suppressed
    );
    println!(
        "  wakes received {} coalesced {}  poisoned {:?}",
        snap.wakes_received, snap.wakes_coalesced, snap.poisoned
    );
    let o = bulk.observations().await?;
    println!(
        "Bulk observations: pending {}  running {}  succeeded {}  poisoned {}",
        o.pending, o.running, o.succeeded, o.poisoned
    );
    if let Err(e) = result {
        return Ok(exit_for(Err((e.is_poisoned(), e.to_string()))));
    }
    let code = demo_paused(url, bulk.db().clone(), run_id).await?;
    // Last, the trail: the rows Bulk applied, and the operator decisions (the schedules'
    // creation and deletion, the uncertain pause's resolution through the CLI).
    if let Some(a) = demo_audit {
        a.report(shown.first().map(String::as_str)).await?;
    }
    let within = settings.telemetry.timeout.min(Duration::from_secs(5));
    let report = tokio::task::spawn_blocking(move || telemetry.shutdown(within))
        .await
        .map_err(|e| format!("telemetry: {e}"))?;
    println!("Usage: {report}");
    Ok(code)
}

/// A demo family's controller, running: its handle, its stop token and its task.
fn spawn_demo_controller<S>(
    ctl: Controller<S>,
) -> (
    nexuscrm_worker::ControllerHandle,
    CancellationToken,
    tokio::task::JoinHandle<Result<(), String>>,
)
where
    S: nexuscrm_worker::Source + Send + Sync + 'static,
{
    let handle = ctl.handle();
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    let run = tokio::spawn(async move { ctl.run(stop).await.map(drop).map_err(|e| e.to_string()) });
    (handle, cancel, run)
}

/// The demo's audit part: the outbox's controller delivering the trail Bulk writes (one
/// `record.applied` event per applied row, in the segment's transaction) to `audit.file`.
struct DemoAudit {
    audit: nexuscrm_audit::Audit,
    handle: nexuscrm_worker::ControllerHandle,
    cancel: CancellationToken,
    run: tokio::task::JoinHandle<Result<(), String>>,
    started: Instant,
}

impl DemoAudit {
    async fn start(bulk: &Bulk, settings: &config::Settings) -> Result<DemoAudit, AnyError> {
        let audit =
            nexuscrm_audit::Audit::open(bulk.db().clone(), supervise::audit_options(settings))
                .await
                .map_err(|e| format!("config key `audit.file`: {e}"))?;
        audit.take_ownership(&owner()).await?;
        let ctl = Controller::new(audit.source(), Config::new("audit"))?;
        audit.set_waker(ctl.waker());
        bulk.watch_records(ctl.waker());
        let (handle, cancel, run) = spawn_demo_controller(ctl);
        Ok(DemoAudit {
            audit,
            handle,
            cancel,
            run,
            started: Instant::now(),
        })
    }

    /// Waits until every event is delivered, then prints the file's last lines (and those of
    /// `subject`).
    async fn report(self, subject: Option<&str>) -> Result<(), AnyError> {
        let deadline = Instant::now() + Duration::from_secs(60);
        // The CLI that resolved the pause is another process: wake the controller for its
        // event (a running worker finds it through its reconciliation backstop or a wake).
        self.audit.wake();
        loop {
            let o = self.audit.observations().await?;
            if o.undelivered == 0 {
                break;
            }
            if self.run.is_finished() || Instant::now() > deadline {
                return Err(format!(
                    "the audit trail was not delivered: {} events wait",
                    o.undelivered
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let sink = self
            .audit
            .sink()
            .file()
            .cloned()
            .ok_or("the demo's audit trail goes to a file")?;
        println!(
            "\nAudit trail ({}): every event delivered to {} ({:.2?} after the outbox \
             started); its last lines (`audit tail`):",
            nexuscrm_audit::DECLARATION,
            sink.path().display(),
            self.started.elapsed(),
        );
        for l in audit_cli::tail(&sink, None, 3)? {
            println!("  {}", audit_cli::format_line(&l));
        }
        let lines = nexuscrm_audit::read_lines(&sink)?;
        let mut kinds = std::collections::BTreeMap::<&str, usize>::new();
        for l in &lines {
            *kinds.entry(l.kind.as_str()).or_default() += 1;
        }
        println!(
            "  {} lines: {}",
            lines.len(),
            kinds
                .iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let decisions: Vec<_> = lines
            .iter()
            .filter(|l| l.kind != "record.applied")
            .rev()
            .take(3)
            .collect();
        if !decisions.is_empty() {
            println!("  the latest operator decisions:");
            for l in decisions.into_iter().rev() {
                println!("  {}", audit_cli::format_line(l));
            }
        }
        if let Some(subject) = subject {
            println!("  events about {subject} (`audit tail --subject {subject}`):");
            for l in audit_cli::tail(&sink, Some(subject), 3)? {
                println!("  {}", audit_cli::format_line(&l));
            }
        }
        let snap = self.handle.snapshot();
        println!(
            "Controller snapshot (audit): claims {}  attempts {}  reconciles {}  wakes {}",
            snap.claim_calls,
            snap.attempts_completed,
            snap.reconciles.total(),
            snap.wakes_received
        );
        self.cancel.cancel();
        if let Err(e) = self.run.await? {
            return Err(format!("the audit controller stopped: {e}").into());
        }
        Ok(())
    }
}

/// The demo's Formula View part: two formula fields over the demo's Bulk records, derived by
/// their own controller as Bulk's segments commit, and the account roll-up.
struct DemoFormula {
    formula: nexuscrm_formula::Formula,
    versions: Vec<(String, i64)>,
    handle: nexuscrm_worker::ControllerHandle,
    cancel: CancellationToken,
    run: tokio::task::JoinHandle<Result<(), String>>,
    started: Instant,
}

impl DemoFormula {
    /// Defines the demo's formulas and starts the view's controller, woken by `bulk`.
    async fn start(bulk: &Bulk) -> Result<DemoFormula, AnyError> {
        let formula = nexuscrm_formula::Formula::open(
            bulk.db().clone(),
            nexuscrm_formula::FormulaOptions::default(),
        )
        .await?;
        formula.take_ownership(&owner()).await?;
        let sample = Value::Object(
            sample_rows("sample", 1)
                .pop()
                .map(|r| r.fields)
                .unwrap_or_default(),
        );
        let mut versions = Vec::new();
        for (name, expr) in DEMO_FORMULAS {
            let d = formula.define(name, expr, Some(&sample)).await?;
            versions.push((name.to_owned(), d.definition.version));
        }
        let ctl = Controller::new(
            formula.source(),
            Config::new("formula").capacity(NonZeroUsize::new(2).expect("2")),
        )?;
        formula.set_waker(ctl.waker());
        bulk.watch_records(ctl.waker());
        let (handle, cancel, run) = spawn_demo_controller(ctl);
        Ok(DemoFormula {
            formula,
            versions,
            handle,
            cancel,
            run,
            started: Instant::now(),
        })
    }

    /// Waits until the records in `keys` carry every demo formula's current version, prints
    /// them, the definitions and the roll-up, and stops the controller.
    async fn report(self, keys: &[String]) -> Result<(), AnyError> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let views = loop {
            let mut views = Vec::new();
            for key in keys {
                if let Some(v) = self.formula.show(key).await?
                    && !v.stale
                    && self.versions.iter().all(|(name, version)| {
                        v.values
                            .iter()
                            .any(|d| &d.formula == name && d.definition_version == *version)
                    })
                {
                    views.push((key, v));
                }
            }
            if views.len() == keys.len() && self.formula.observations().await?.stale == 0 {
                break views;
            }
            if self.run.is_finished() || Instant::now() > deadline {
                return Err("the formula view did not converge on the demo's records".into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        println!(
            "\nFormula View ({}), converged {:.2?} after start:",
            nexuscrm_formula::DECLARATION,
            self.started.elapsed()
        );
        for d in self.formula.list().await? {
            println!(
                "  formula {} (version {}): {}",
                d.name, d.version, d.expression
            );
        }
        for (key, view) in &views {
            formula_cli::print_view(key, view);
        }
        println!("Account roll-up (open opportunity amounts, maintained incrementally):");
        formula_cli::print_rollups(&self.formula.rollups(10).await?);
        self.cancel.cancel();
        let result = self.run.await?;
        let snap = self.handle.snapshot();
        println!(
            "Controller snapshot (formula): claims {}  attempts {}  reconciles {}  wakes {}",
            snap.claim_calls,
            snap.attempts_completed,
            snap.reconciles.total(),
            snap.wakes_received
        );
        if let Err(e) = result {
            return Err(format!("the formula controller stopped: {e}").into());
        }
        Ok(())
    }
}

/// The demo's Paused Flow part: three runs pause, the CLI resumes them, a local receiver
/// answers two effects and hangs on the third, which becomes `uncertain` with its evidence
/// until the CLI resolves it.
async fn demo_paused(url: &str, db: Db, run_id: u128) -> Result<ExitCode, AnyError> {
    // The receiver: answers every effect at once, except a "charge" step, which it swallows.
    let app = axum::Router::new().route(
        "/effect",
        axum::routing::post(|body: String| async move {
            if body.contains("\"step\":\"charge\"") {
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
            "{\"accepted\": true}"
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let receiver = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let connector = nexuscrm_paused::Connector::new(&format!("http://127.0.0.1:{port}/effect"))?
        .timeout(Duration::from_secs(1));
    let paused = PausedFlow::open(
        db,
        PausedOptions::default()
            .connector(connector)
            .lease(Duration::from_secs(3))
            .generation_poll(Some(Duration::from_millis(200))),
    )
    .await?;
    paused.take_ownership(&owner()).await?;
    let ctl = Controller::new(
        paused.source(),
        Config::new("paused").capacity(NonZeroUsize::new(4).expect("4")),
    )?;
    paused.set_waker(ctl.waker());
    let cancel = CancellationToken::new();
    let run = tokio::spawn(ctl.run(cancel.clone()));
    println!(
        "\nPaused Flow (effects to a local receiver on 127.0.0.1:{port}, which hangs on \"charge\"):"
    );
    let mut ids = Vec::new();
    for (run_name, step) in [("a", "approve"), ("b", "approve"), ("c", "charge")] {
        let p = paused
            .pause(NewPause::new(
                format!("demo-{run_id}-{run_name}"),
                step,
                Duration::from_secs(3600),
                json!({"amount": 1200}),
            ))
            .await?;
        println!(
            "  paused run demo-…-{run_name} at {step}: pause {} (resume token {}…, shown once)",
            p.id,
            &p.token.expose()[..12]
        );
        // Resumed through the CLI, as a partner's callback or an approver would.
        let out = std::process::Command::new(std::env::current_exe()?)
            .args(["--database-url", url, "pause", "resume", p.token.expose()])
            .args(["--payload", "{\"approved\": true}"])
            .output()?;
        if !out.status.success() {
            return Err(format!(
                "pause resume failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        ids.push(p.id);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut states = Vec::new();
        for id in &ids {
            states.push(
                paused
                    .status(*id)
                    .await?
                    .map(|p| p.state)
                    .unwrap_or_default(),
            );
        }
        if states == ["completed", "completed", "uncertain"] {
            break;
        }
        if Instant::now() > deadline || run.is_finished() {
            return Err(format!("the paused demo did not settle: {states:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let uncertain = paused.status(ids[2]).await?.ok_or("no pause")?;
    println!(
        "  pauses {} and {} completed; pause {} is UNCERTAIN (the request may have been applied), \
         never resent; evidence: {}",
        ids[0],
        ids[1],
        uncertain.id,
        uncertain.outcome.unwrap_or_default()
    );
    // A person checks with the receiver and records the decision through the CLI.
    let out = std::process::Command::new(std::env::current_exe()?)
        .args([
            "--database-url",
            url,
            "pause",
            "resolve",
            &ids[2].to_string(),
        ])
        .args(["--applied", "--by", "demo-operator"])
        .output()?;
    print!(
        "  pause resolve {} --applied: {}",
        ids[2],
        String::from_utf8_lossy(&out.stdout)
    );
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned().into());
    }
    cancel.cancel();
    let result = run.await?;
    receiver.abort();
    let o = paused.observations().await?;
    println!(
        "Paused Flow observations: {}",
        o.by_state
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(s, n)| format!("{s} {n}"))
            .collect::<Vec<_>>()
            .join("  ")
    );
    Ok(exit_for(
        result
            .map(drop)
            .map_err(|e| (e.is_poisoned(), e.to_string())),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_rows_map_the_header_to_fields_and_reject_bad_input() {
        let csv = "record_key,name,email\nacct-1,Acme,ops@acme.test\n\"acct,2\",\"Quote, Inc\",\n";
        let rows = parse_csv(csv.as_bytes(), "t.csv").unwrap().rows;
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].record_key, "acct-1");
        assert_eq!(rows[0].fields["email"], "ops@acme.test");
        assert_eq!(rows[1].record_key, "acct,2");
        assert_eq!(rows[1].fields["name"], "Quote, Inc");
        assert!(
            !rows[1].fields.contains_key("email"),
            "empty cells are left out"
        );
        let e = parse_csv("name\nx\n".as_bytes(), "t.csv").unwrap_err();
        assert!(e.to_string().contains("no \"record_key\" column"), "{e}");
        for (header, want) in [
            (
                "record_key,name,name\nk,a,b\n",
                "names column \"name\" twice",
            ),
            (
                "record_key,record_key\nk,k\n",
                "names column \"record_key\" twice",
            ),
            ("record_key,,x\nk,a,b\n", "column 2 has an empty header"),
        ] {
            let e = parse_csv(header.as_bytes(), "t.csv").unwrap_err();
            assert!(e.to_string().contains(want), "{header:?}: {e}");
            assert!(e.to_string().starts_with("t.csv:1:"), "{e}");
        }
        let long = format!("record_key,{0},{0}\n", "c".repeat(1_000_000));
        let e = parse_csv(long.as_bytes(), "t.csv").unwrap_err().to_string();
        assert!(
            e.len() < 300,
            "a huge header is not echoed whole: {} bytes",
            e.len()
        );
        let e = parse_csv("record_key,name\n,x\n".as_bytes(), "t.csv").unwrap_err();
        assert!(e.to_string().contains("t.csv:2: empty record_key"), "{e}");
        let e = parse_csv("record_key,name\na,b,c\n".as_bytes(), "t.csv").unwrap_err();
        assert!(e.to_string().starts_with("t.csv:2:"), "{e}");
    }

    #[test]
    fn json_lines_with_a_byte_order_mark_are_accepted() {
        let path = std::env::temp_dir().join(format!("nexuscrm-bom-{}.jsonl", std::process::id()));
        std::fs::write(
            &path,
            "\u{feff}{\"record_key\": \"k1\", \"fields\": {\"a\": 1}}\n{\"record_key\": \"k2\"}\n",
        )
        .unwrap();
        let input = read_jsonl(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let rows = input.rows;
        assert_eq!(rows.len(), 2);
        assert_eq!(input.lines, [1, 2]);
        assert_eq!(rows[0].record_key, "k1");
    }

    /// Cases per arbitrary-input property (`NEXUSCRM_PROPTEST_CASES`, 2,000 by default).
    fn arbitrary_cases() -> proptest::test_runner::Config {
        proptest::test_runner::Config::with_cases(
            nexuscrm_persistence::testing::arbitrary_case_count(),
        )
    }

    proptest::proptest! {
        #![proptest_config(arbitrary_cases())]

        /// Any bytes as a CSV file: rows or a clear `file:line` refusal, never a panic, and
        /// never an echo longer than the input's first characters.
        #[test]
        fn csv_input_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            match parse_csv(&bytes[..], "in.csv") {
                Ok(input) => {
                    proptest::prop_assert_eq!(input.rows.len(), input.lines.len());
                    for r in input.rows {
                        proptest::prop_assert!(!r.record_key.is_empty());
                    }
                }
                Err(e) => {
                    let e = e.to_string();
                    proptest::prop_assert!(e.starts_with("in.csv"), "{e}");
                }
            }
        }

        /// Any text as JSON Lines: rows, each with its line, or a clear `file:line` refusal;
        /// never a panic.
        #[test]
        fn json_lines_input_never_panics(text in "(\\PC|\n|[{}\":,])*") {
            match parse_jsonl(&text, "in.jsonl") {
                Ok(input) => {
                    proptest::prop_assert_eq!(input.rows.len(), input.lines.len());
                    let total = text.lines().count() as u64;
                    proptest::prop_assert!(input.lines.iter().all(|l| (1..=total).contains(l)));
                }
                Err(e) => {
                    let e = e.to_string();
                    proptest::prop_assert!(e.starts_with("in.jsonl:"), "{e}");
                }
            }
        }

        /// JSON Lines written from arbitrary keys and field values parse back exactly, each row
        /// with its line.
        #[test]
        fn json_lines_rows_never_change_in_a_round_trip(
            keys in proptest::collection::vec("\\PC{1,12}", 1..6),
            value in proptest::prelude::any::<i64>(),
        ) {
            let text: String = keys
                .iter()
                .map(|k| format!("{}\n", json!({"record_key": k, "fields": {"n": value}})))
                .collect();
            let input = parse_jsonl(&text, "r.jsonl").unwrap();
            proptest::prop_assert_eq!(input.rows.len(), keys.len());
            for (i, (row, key)) in input.rows.iter().zip(&keys).enumerate() {
                proptest::prop_assert_eq!(&row.record_key, key);
                proptest::prop_assert_eq!(&row.fields["n"], &json!(value));
                proptest::prop_assert_eq!(input.lines[i], i as u64 + 1);
            }
        }

        /// CSV-shaped text with arbitrary headers: duplicate headers are always refused.
        #[test]
        fn duplicate_csv_headers_are_always_refused(h in "[a-z_]{1,8}", v in "[a-z]{0,5}") {
            let text = format!("record_key,{h},{h}\nk,{v},{v}\n");
            proptest::prop_assert!(parse_csv(text.as_bytes(), "d.csv").is_err());
        }

        /// Any TOML text: a config or a clear refusal, never a panic.
        #[test]
        fn toml_config_never_panics(text in ".{0,200}") {
            if let Ok(raw) = toml::from_str::<RawConfig>(&text) {
                let _ = raw.validate();
            }
        }

        /// Any URL-shaped text: a password or token put in it never appears in the redaction.
        #[test]
        fn redacted_urls_never_show_the_secret(
            scheme in "(postgres|mysql|sqlite)", user in "[a-z]{1,6}",
            host in "[a-z0-9.]{1,12}", key in "(password|PassWord|sslpassword|passfile|token)",
        ) {
            let secret = "Zq9SecretZq9";
            for url in [
                format!("{scheme}://{user}:{secret}@{host}/db"),
                format!("{scheme}://{host}/db?user={user}&{key}={secret}"),
                format!("{scheme}://{user}@{host}/db?a=b&{key}={secret}#x"),
            ] {
                let shown = nexuscrm_persistence::redact_url(&url);
                proptest::prop_assert!(!shown.contains(secret), "{url} -> {shown}");
            }
        }
    }
}
