//! `nexuscrm-evidence`: the before/after statement report.
//!
//! Runs the project's controller-driven families and a hot-polling baseline (as many tasks as
//! the capacity, each claiming through the same `Source::claim` and running the same attempts,
//! claiming again at once while claims return work and sleeping 1 s after an empty one: what
//! River, Oban and graphile-worker do) side by side on one PostgreSQL database, measured with `pg_stat_statements`, and
//! writes a Markdown report (and JSON with stable keys). Each side connects as its own role, so
//! the statement statistics of the two are separated without a second database.

#![forbid(unsafe_code)]

mod cluster;
mod formula;
mod measure;
mod report;
mod scenarios;
mod tiny;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};

pub(crate) type AnyError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    /// Every scenario and the plans.
    All,
    /// Empty queues for a window: statements per minute and hour.
    Idle,
    /// Drain Bulk work with 1, 2 and 4 replicas.
    Drain,
    /// Scheduled occurrences while idle: lateness.
    Due,
    /// Four replicas on one hot queue: lock waits and empty claims.
    Contend,
    /// EXPLAIN (ANALYZE, BUFFERS) of the claim and next-work statements at 10^3..10^6 rows.
    Explain,
    /// Formula View: convergence of N changed records, idle statements, and its plans.
    Formula,
}

#[derive(Parser, Debug)]
#[command(
    name = "nexuscrm-evidence",
    version,
    about = "Controller vs polling baseline, measured on PostgreSQL"
)]
struct Cli {
    /// What to run.
    #[arg(value_enum, default_value = "all")]
    scenario: Scenario,
    /// A PostgreSQL server URL (a superuser; `pg_stat_statements` must be in
    /// shared_preload_libraries). Default: a private cluster started from the machine's
    /// PostgreSQL binaries, removed afterwards.
    #[arg(long)]
    database_url: Option<String>,
    /// How long a baseline (hot poller) task sleeps after an empty claim, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    poll_ms: u64,
    /// The idle window per side, in seconds.
    #[arg(long, default_value_t = 60)]
    idle_secs: u64,
    /// Bulk rows in the big drain workload (in jobs of 100 rows). 200,000 lasts a few seconds
    /// per side here; 20,000 (the earlier default) lasted half a second, and its ratio swung
    /// between 0.86x and 1.18x from run to run.
    #[arg(long, default_value_t = 200_000)]
    drain_rows: usize,
    /// Tiny (one-row) jobs in the small drain workload and the contention scenario.
    #[arg(long, default_value_t = 1_000)]
    tiny_jobs: usize,
    /// Jobs of the tiny-job Source (its own table; the attempt is one small write) in the third
    /// drain workload.
    #[arg(long, default_value_t = 20_000)]
    queue_jobs: usize,
    /// The longest a baseline drain runs; its rate is measured over what it finished.
    #[arg(long, default_value_t = 20)]
    baseline_cap_secs: u64,
    /// Claims a controller may have in flight at once (`Config::claims_in_flight`); the
    /// default is the Runtime Worker's.
    #[arg(long, default_value_t = DEFAULT_CLAIMS_IN_FLIGHT)]
    claims_in_flight: usize,
    /// Whether the tiny-job controller's attempts claim their successor in their disposition
    /// (`Config::successor_handoff`; `--successor-handoff false` measures without it).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    successor_handoff: bool,
    /// Whether the tiny-job controller's attempts commit their dispositions in groups
    /// (`nexuscrm_worker::batch`: one statement deletes a group's jobs and claims the
    /// successors of its granted handoffs); the poller keeps one `DELETE` per job.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    batched_disposition: bool,
    /// Records the Formula View converges (a fresh process, then a running one).
    #[arg(long, default_value_t = 20_000)]
    formula_records: usize,
    /// Scheduled occurrences in the due scenario.
    #[arg(long, default_value_t = 40)]
    due_items: usize,
    /// Table sizes for the plans (comma separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1_000usize, 100_000, 1_000_000])]
    explain_rows: Vec<usize>,
    /// A small, fast run (for CI): short windows, small workloads, replicas 1 and 2.
    #[arg(long)]
    smoke: bool,
    /// Where to write report.md (and report.json with --json).
    #[arg(long, default_value = "evidence-report")]
    out: PathBuf,
    /// Also write report.json.
    #[arg(long)]
    json: bool,
}

/// The run's settings after `--smoke`.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) poll: Duration,
    pub(crate) idle: Duration,
    pub(crate) drain_rows: usize,
    pub(crate) tiny_jobs: usize,
    pub(crate) queue_jobs: usize,
    pub(crate) replicas: Vec<usize>,
    pub(crate) baseline_cap: Duration,
    pub(crate) due_items: usize,
    pub(crate) formula_records: usize,
    pub(crate) explain_rows: Vec<usize>,
    /// The controllers' `claims_in_flight`.
    pub(crate) claims_in_flight: std::num::NonZeroUsize,
    /// The tiny-job controller's `successor_handoff`.
    pub(crate) successor_handoff: bool,
    /// The tiny-job controller's batched disposition.
    pub(crate) batched_disposition: bool,
}

/// The Runtime Worker's `claims_in_flight` for every family.
const DEFAULT_CLAIMS_IN_FLIGHT: usize = 1;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

async fn run(cli: Cli) -> Result<(), AnyError> {
    if cli.poll_ms == 0 {
        return Err("--poll-ms must be at least 1".into());
    }
    let mut plan = Plan {
        poll: Duration::from_millis(cli.poll_ms),
        idle: Duration::from_secs(cli.idle_secs.max(1)),
        drain_rows: cli.drain_rows.max(100),
        tiny_jobs: cli.tiny_jobs.max(1),
        queue_jobs: cli.queue_jobs.max(1),
        replicas: vec![1, 2, 4],
        baseline_cap: Duration::from_secs(cli.baseline_cap_secs.max(1)),
        due_items: cli.due_items.max(1),
        formula_records: cli.formula_records.max(1),
        explain_rows: cli.explain_rows.clone(),
        claims_in_flight: std::num::NonZeroUsize::new(cli.claims_in_flight)
            .filter(|n| n.get() <= 4)
            .ok_or("--claims-in-flight must be 1 to 4 (at most the smallest capacity)")?,
        successor_handoff: cli.successor_handoff,
        batched_disposition: cli.batched_disposition,
    };
    if cli.smoke {
        plan.idle = Duration::from_secs(3);
        plan.drain_rows = 2_000;
        plan.tiny_jobs = 100;
        plan.queue_jobs = 500;
        plan.replicas = vec![1, 2];
        plan.baseline_cap = Duration::from_secs(3);
        plan.due_items = 10;
        plan.formula_records = 2_000;
        plan.explain_rows = vec![1_000, 10_000];
    }
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    // The cluster (if private) lives until the end of the run and is removed on drop.
    let (_cluster, admin_url) = match &cli.database_url {
        Some(url) => (None, url.clone()),
        None => {
            eprintln!("starting a private PostgreSQL cluster with pg_stat_statements ...");
            let c = cluster::Cluster::start().await?;
            eprintln!("  cluster at {}", c.dir().display());
            let url = c.url("postgres", "postgres");
            (Some(c), url)
        }
    };
    let env = measure::Env::prepare(&admin_url).await?;
    let mut report = report::Report::new(command, &env, &plan).await?;
    let which = cli.scenario;
    if matches!(which, Scenario::All | Scenario::Idle) {
        eprintln!("idle: {:?} per side ...", plan.idle);
        report.idle = Some(scenarios::idle(&env, &plan).await?);
    }
    if matches!(which, Scenario::All | Scenario::Drain) {
        eprintln!(
            "drain: {} rows, {} one-row jobs and {} tiny jobs ...",
            plan.drain_rows, plan.tiny_jobs, plan.queue_jobs
        );
        report.drain = scenarios::drain(&env, &plan).await?;
    }
    if matches!(which, Scenario::All | Scenario::Due) {
        eprintln!("due: {} occurrences ...", plan.due_items);
        report.due = Some(scenarios::due(&env, &plan).await?);
    }
    if matches!(which, Scenario::All | Scenario::Contend) {
        eprintln!("contend: 4 replicas, {} tiny jobs ...", plan.tiny_jobs);
        report.contend = Some(scenarios::contend(&env, &plan).await?);
    }
    if matches!(which, Scenario::All | Scenario::Explain) {
        eprintln!("explain at {:?} rows ...", plan.explain_rows);
        report.plans = scenarios::explain(&env, &plan).await?;
    }
    if matches!(which, Scenario::All | Scenario::Formula) {
        eprintln!("formula: {} records ...", plan.formula_records);
        report.formula = Some(formula::formula(&env, &plan).await?);
    }
    std::fs::create_dir_all(&cli.out)
        .map_err(|e| format!("cannot create {}: {e}", cli.out.display()))?;
    let md = cli.out.join("report.md");
    // The cluster figures come from their own tool (they need the Galera cluster); the report
    // carries the latest ones written beside it.
    let cluster = std::fs::read_to_string(cli.out.join("cluster.md")).ok();
    let markdown = report.markdown() + &report::Report::cluster_section(cluster.as_deref());
    std::fs::write(&md, markdown)?;
    eprintln!("wrote {}", md.display());
    if cli.json {
        let js = cli.out.join("report.json");
        std::fs::write(&js, serde_json::to_string_pretty(&report.json())?)?;
        eprintln!("wrote {}", js.display());
    }
    print!("{}", report.summary());
    env.cleanup().await;
    Ok(())
}
