//! The report: Markdown for people, JSON (stable keys) for tools.

use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::measure::{Digest, Env};
use crate::scenarios::{self, Contend, DrainRun, Due, Explained, Idle};
use crate::{AnyError, Plan};

/// Everything one run measured.
#[derive(Debug)]
pub(crate) struct Report {
    command: String,
    cores: usize,
    postgres: String,
    plan: Plan,
    pub(crate) idle: Option<Idle>,
    pub(crate) drain: Vec<DrainRun>,
    pub(crate) due: Option<Due>,
    pub(crate) contend: Option<Contend>,
    pub(crate) plans: Vec<Explained>,
    pub(crate) formula: Option<crate::formula::FormulaEvidence>,
}

fn f(x: f64) -> String {
    if x.is_nan() {
        "n/a".into()
    } else if x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x.abs() >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

fn digest_table(out: &mut String, d: &[Digest]) {
    if d.is_empty() {
        out.push_str("_no statements_\n\n");
        return;
    }
    out.push_str("| calls | rows | blocks hit | blocks read | mean ms | statement |\n|---:|---:|---:|---:|---:|---|\n");
    for x in d {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | `{}` |",
            x.calls,
            x.rows,
            x.blks_hit,
            x.blks_read,
            f(x.mean_ms),
            x.query.replace('|', "\\|").replace('`', "'")
        );
    }
    out.push('\n');
}

impl Report {
    pub(crate) async fn new(command: String, env: &Env, plan: &Plan) -> Result<Report, AnyError> {
        Ok(Report {
            command,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            postgres: env.server_version.clone(),
            plan: plan.clone(),
            idle: None,
            drain: Vec::new(),
            due: None,
            contend: None,
            plans: Vec::new(),
            formula: None,
        })
    }

    fn drain_pick(&self, side: &str) -> Option<&DrainRun> {
        self.drain_at(side, "bulk", 1)
    }

    /// The drain run of `side` on the workload whose name contains `workload`, with `replicas`.
    fn drain_at(&self, side: &str, workload: &str, replicas: usize) -> Option<&DrainRun> {
        self.drain
            .iter()
            .find(|d| d.side == side && d.replicas == replicas && d.workload.contains(workload))
    }

    /// The summary table.
    pub(crate) fn summary(&self) -> String {
        let mut out = String::new();
        out.push_str("| side | idle statements/hour | drain items/s | statements/item | due lateness p50 ms | due lateness p99 ms |\n|---|---:|---:|---:|---:|---:|\n");
        for side in ["controller", "baseline"] {
            let idle = self.idle.as_ref().map(|i| {
                if side == "controller" {
                    i.controller.statements_per_hour
                } else {
                    i.baseline.statements_per_hour
                }
            });
            let d = self.drain_pick(side);
            let due = self.due.as_ref().map(|d| {
                if side == "controller" {
                    &d.controller
                } else {
                    &d.baseline
                }
            });
            let _ = writeln!(
                out,
                "| {side} | {} | {} | {} | {} | {} |",
                idle.map_or("-".into(), f),
                d.map_or("-".into(), |d| f(d.items_per_s)),
                d.map_or("-".into(), |d| f(d.statements_per_item)),
                due.map_or("-".into(), |l| f(l.p50)),
                due.map_or("-".into(), |l| f(l.p99)),
            );
        }
        out
    }

    /// Each target, its measured value, and whether it is met.
    /// The drain targets' runs: (label, replicas, controller, baseline) for Bulk and the tiny
    /// jobs, at one replica and at the most replicas of the plan.
    fn drain_pairs(&self) -> Vec<(&'static str, usize, &DrainRun, &DrainRun)> {
        let most = self.plan.replicas.iter().copied().max().unwrap_or(1);
        let mut counts = vec![1];
        if most > 1 {
            counts.push(most);
        }
        let mut pairs = Vec::new();
        for (workload, label) in [("bulk", "Bulk"), ("own table", "tiny jobs")] {
            for &r in &counts {
                if let (Some(c), Some(b)) = (
                    self.drain_at("controller", workload, r),
                    self.drain_at("baseline", workload, r),
                ) {
                    pairs.push((label, r, c, b));
                }
            }
        }
        pairs
    }

    /// For every drain target the controller missed: where the time went, from the runs'
    /// digests (database time = calls x mean time, summed), so a "no" comes with its reason.
    fn why_drain_targets_miss(&self, out: &mut String) {
        let rows: Vec<_> = self
            .drain_pairs()
            .into_iter()
            .filter(|(_, _, c, b)| c.items_per_s < 1.5 * b.items_per_s)
            .collect();
        if rows.is_empty() {
            return;
        }
        out.push_str(
            "### Why the drain targets marked no are missed\n\n\
             Database time is each digest's calls x mean time, summed over the run's \
             statements; *shared* is the part spent in statements both sides ran equally often \
             (the attempts' own work, the same code on both sides), which no claim path can \
             remove. Where database time is most of the wall time, the drain is bound by the \
             database on these 2 shared cores, and the shared part is its floor; where it is a \
             small part, the limit is the process's own CPU and round trips on the same cores.\n\n\
             | target | controller wall s | controller database s (shared) | poller wall s | \
             poller database s (shared) |\n|---|---:|---:|---:|---:|\n",
        );
        for (label, r, c, b) in rows {
            let ((c_db, c_shared), (b_db, b_shared)) = (drain_split(c, b), drain_split(b, c));
            let (c_secs, b_secs) = (c.secs, b.secs);
            let _ = writeln!(
                out,
                "| {label}, {r} replica(s) | {} | {} ({}) | {} | {} ({}) |",
                f(c_secs),
                f(c_db),
                f(c_shared),
                f(b_secs),
                f(b_db),
                f(b_shared)
            );
        }
        out.push('\n');
    }

    fn targets(&self) -> Vec<(String, String, bool)> {
        let mut t = Vec::new();
        if let Some(i) = &self.idle {
            t.push((
                "controller idle statements/hour <= (3600 / backstop) x statements per reconciliation".into(),
                format!(
                    "{} measured, bound {}",
                    f(i.controller.statements_per_hour),
                    f(i.controller_bound_per_hour)
                ),
                i.controller.statements_per_hour <= i.controller_bound_per_hour,
            ));
            let worst = i
                .controller
                .statements_per_hour
                .max(i.controller_bound_per_hour)
                .max(1.0);
            let ratio = i.baseline.statements_per_hour / worst;
            t.push((
                "at least 100x fewer idle statements than the baseline (against the bound, the worse case)".into(),
                format!("{}x", f(ratio)),
                ratio >= 100.0,
            ));
        }
        for (label, r, c, b) in self.drain_pairs() {
            let ratio = c.items_per_s / b.items_per_s.max(f64::MIN_POSITIVE);
            t.push((
                format!("{label}, {r} replica(s): drain at least 1.5x the hot poller's"),
                format!(
                    "{}x ({} vs {} items/s)",
                    f(ratio),
                    f(c.items_per_s),
                    f(b.items_per_s)
                ),
                ratio >= 1.5,
            ));
            t.push((
                format!(
                    "{label}, {r} replica(s): statements per item no more than the hot poller's"
                ),
                format!(
                    "{} vs {} (claims: the controller {} for {} items, the poller {} for {})",
                    f(c.statements_per_item),
                    f(b.statements_per_item),
                    c.claims,
                    c.items_done,
                    b.claims,
                    b.items_done
                ),
                c.statements_per_item <= b.statements_per_item,
            ));
        }
        if let Some(c) = self.drain_pick("controller") {
            t.push((
                "well under 1 statement per Bulk row".into(),
                f(c.statements_per_item),
                c.statements_per_item < 0.5,
            ));
        }
        if let Some(d) = &self.due {
            t.push((
                "due lateness p50 at most 2 ms".into(),
                format!("{} ms", f(d.controller.p50)),
                d.controller.p50 <= 2.0,
            ));
            t.push((
                "due lateness p99 at most 5 ms".into(),
                format!("{} ms", f(d.controller.p99)),
                d.controller.p99 <= 5.0,
            ));
            t.push((
                "Scheduled Flow reservation within 50 ms of the due time".into(),
                format!("max {} ms", f(d.controller.max)),
                d.controller.max <= 50.0,
            ));
        }
        if !self.plans.is_empty() {
            let seq = self.plans.iter().filter(|e| e.seq_scan).count();
            t.push((
                "claim and next-work plans on the eligibility index at every size (no sequential scan)".into(),
                format!("{seq} of {} plans scan sequentially", self.plans.len()),
                seq == 0,
            ));
        }
        if let Some(fx) = &self.formula {
            t.push((
                "Formula View idle: no statement between changes (the backstop only)".into(),
                format!(
                    "{} statements in {:.1} s",
                    fx.idle_statements, fx.idle_window_secs
                ),
                fx.idle_statements == 0,
            ));
            // A table of at most one sweep chunk is read whole by the planner's own
            // choice, and a chunk's read is what a sweep statement costs anyway; the
            // target is the sizes where a sequential scan would cost more than a chunk.
            let above: Vec<_> = fx
                .plans
                .iter()
                .filter(|e| e.rows > fx.sweep_chunk)
                .collect();
            let seq = above.iter().filter(|e| e.seq_scan).count();
            t.push((
                format!(
                    "Formula View claim, next-work, change-cursor and sweep plans on an index above one sweep chunk ({} records): no sequential scan",
                    fx.sweep_chunk
                ),
                format!("{seq} of {} plans scan sequentially", above.len()),
                seq == 0 && !above.is_empty(),
            ));
        }
        t
    }

    /// The Formula View section.
    fn formula_markdown(&self, out: &mut String) {
        let Some(fx) = &self.formula else {
            return;
        };
        let _ = writeln!(
            out,
            "## Formula View\n\n{} canonical records written through Bulk (as the tool; its \
             statements are not counted), two CEL formulas and the account roll-up; the view \
             runs as `ev_controller`, capacity 2, 100 records per attempt, its sweep on a pool \
             of its own in chunks of {} ({} per backstop turn after the first, full sweep). \
             First a **fresh process** converges the view from nothing (its startup sweep \
             marks every record, its claims derive them: no change history is replayed); then \
             Bulk changes every record once more while the process runs, and the view follows \
             through the **change cursor**, woken by Bulk's segments. Times run until every \
             record is derived at its latest revision with both values.\n",
            fx.records, fx.sweep_chunk, fx.sweep_chunks_per_turn
        );
        out.push_str(
            "| path | records | seconds | records/s | statements | statements/record | lag \
             after the last write s |\n|---|---:|---:|---:|---:|---:|---:|\n",
        );
        for c in &fx.converged {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} |",
                c.path,
                c.records,
                f(c.secs),
                f(c.records_per_s),
                c.statements,
                f(c.statements_per_record),
                c.lag_after_last_write_secs.map_or("-".into(), f)
            );
        }
        let _ = writeln!(
            out,
            "\nIdle: {} statements in a {:.1} s window after convergence (LISTEN for record \
             announcements issues none); one requested backstop turn (release of older \
             generations' claims, {} sweep chunks, and the claim and next_work_at it causes) \
             cost {} statements.\n",
            fx.idle_statements,
            fx.idle_window_secs,
            fx.sweep_chunks_per_turn,
            fx.statements_per_backstop
        );
        for c in &fx.converged {
            let _ = writeln!(out, "### Digests: {}\n", c.path);
            digest_table(out, &c.digests);
        }
        out.push_str(
            "### Formula View plans\n\n`EXPLAIN (ANALYZE, BUFFERS)` with every record derived \
             and 10 due, n / 10 accounts, one change-log entry per record; the sweep statements \
             read one chunk after a key, the roll-up check one chunk of records (the accounts \
             after a key up to the bound `sweep_rollup_bound` finds one chunk ahead). A table \
             of at most one chunk may be read whole (the planner's choice, and no more than a \
             chunk costs); the target applies above that size.\n\n\
             | statement | records | sequential scan | buffers | execution ms |\n\
             |---|---:|---|---|---:|\n",
        );
        for e in &fx.plans {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} |",
                e.statement,
                e.rows,
                if e.seq_scan { "yes" } else { "no" },
                e.buffers,
                f(e.execution_ms)
            );
        }
        out.push('\n');
        if let Some(n) = fx.plans.iter().map(|e| e.rows).max() {
            let _ = writeln!(out, "#### Formula View plans at {n} records\n");
            for e in fx.plans.iter().filter(|e| e.rows == n) {
                let _ = writeln!(out, "`{}`:\n\n```\n{}\n```\n", e.statement, e.plan);
            }
        }
    }

    /// The whole report as Markdown.
    pub(crate) fn markdown(&self) -> String {
        let p = &self.plan;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# NexusCRM Runtime Worker: evidence report\n\nProduced by:\n\n```sh\n{}\n```\n",
            self.command
        );
        let _ = writeln!(
            out,
            "Machine: {} cores; PostgreSQL {} (private cluster unless `--database-url` was given), \
             `pg_stat_statements` reset before every phase and filtered to the side's own role \
             (`ev_controller`, `ev_baseline`) in one database. Baseline: a **hot poller**, what \
             River, Oban and graphile-worker do: as many tasks as the capacity (4 for Bulk, 8 \
             for Flow and the tiny jobs, as the controllers), each claiming one item through \
             the same `Source::claim` and running the same attempt, claiming again at once \
             while claims return work, and sleeping {} ms only after an empty claim. \
             Controllers: the Runtime Worker's settings, {} claim(s) in flight at once \
             (`claims_in_flight`; `--claims-in-flight` sets it); the tiny-job controller's \
             successor handoff {} (`Config::successor_handoff`: a finishing attempt's one \
             statement deletes its job and claims the next for its slot; \
             `--successor-handoff` sets it; the poller runs the plain attempt). \
             Utility statements (BEGIN, COMMIT) count as statements.\n",
            self.cores,
            self.postgres,
            p.poll.as_millis(),
            p.claims_in_flight,
            if p.successor_handoff { "on" } else { "off" }
        );
        out.push_str("## Summary\n\n");
        out.push_str(&self.summary());
        out.push_str(
            "\nDrain columns: the Bulk workload with one replica; idle: both families running \
             on empty tables; due: Scheduled Flow occurrences. Targets (goals for the code, \
             measured here): controller idle statements/hour at most (3600 / backstop) x \
             (statements per reconciliation), at least 100x fewer than the baseline; Bulk and \
             tiny jobs (a small Source over its own table, as a user would write one), 1 and 4 \
             replicas: drain at least 1.5x the hot poller with no more statements per item; due \
             lateness p50 under 2 ms and p99 under 5 ms.\n\n",
        );
        out.push_str("## Targets\n\n| target | measured | met |\n|---|---|---|\n");
        for (target, measured, met) in self.targets() {
            let _ = writeln!(
                out,
                "| {target} | {measured} | {} |",
                if met { "yes" } else { "**no**" }
            );
        }
        out.push('\n');
        self.why_drain_targets_miss(&mut out);
        if let Some(i) = &self.idle {
            let _ = writeln!(
                out,
                "## Idle\n\nWindow {:.1} s per side, after start-up. Controller: {} statements \
                 ({} claims) in the window, {} per hour extrapolated; one reconciliation of both \
                 controllers (requested after the window: reconcile, claim, next_work_at per \
                 family) costs {} statements, so the backstop every {} s bounds it at {} per \
                 hour (the LISTEN probe issues none). Baseline: {} \
                 statements ({} claims), {} per hour. Ratio: {}.\n",
                i.controller.window_secs,
                i.controller.statements,
                i.controller.claims,
                f(i.controller.statements_per_hour),
                i.controller_statements_per_reconciliation,
                i.backstop_secs,
                f(i.controller_bound_per_hour),
                i.baseline.statements,
                i.baseline.claims,
                f(i.baseline.statements_per_hour),
                if i.controller.statements_per_hour > 0.0 {
                    format!(
                        "{}x",
                        f(i.baseline.statements_per_hour / i.controller.statements_per_hour)
                    )
                } else {
                    format!(
                        "controller 0 in the window; baseline / bound = {}x",
                        f(i.baseline.statements_per_hour / i.controller_bound_per_hour.max(1.0))
                    )
                }
            );
            out.push_str("### Controller digests (idle window)\n\n");
            digest_table(&mut out, &i.controller.digests);
            out.push_str("### Baseline digests (idle window)\n\n");
            digest_table(&mut out, &i.baseline.digests);
        }
        if !self.drain.is_empty() {
            let _ = writeln!(
                out,
                "## Drain\n\nA baseline run stops after {} s; its rate is over what it finished. \
                 Rows are those returned or affected (pg_stat_statements `rows`).\n",
                p.baseline_cap.as_secs()
            );
            out.push_str("| workload | side | replicas | items done | seconds | items/s | statements/item | rows/item | blocks hit/item | blocks read/item | claims | empty claims |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
            for d in &self.drain {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {}/{} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    d.workload,
                    d.side,
                    d.replicas,
                    d.items_done,
                    d.items,
                    f(d.secs),
                    f(d.items_per_s),
                    f(d.statements_per_item),
                    f(d.rows_per_item),
                    f(d.blks_hit_per_item),
                    f(d.blks_read_per_item),
                    d.claims,
                    d.empty_claims
                );
            }
            out.push('\n');
            for side in ["controller", "baseline"] {
                if let Some(d) = self.drain_pick(side) {
                    let _ = writeln!(out, "### {side} digests ({}, 1 replica)\n", d.workload);
                    digest_table(&mut out, &d.digests);
                }
            }
        }
        if let Some(d) = &self.due {
            let _ = writeln!(
                out,
                "## Due\n\n{} Scheduled Flow occurrences 137 ms apart, created by another \
                 handle while the worker is idle (the controller hears of them through \
                 NOTIFY). Lateness = the reservation's clock reading minus the occurrence \
                 (`Flow::on_runs_reserved`, at the clock's full resolution), so it includes \
                 the timer, the claim transaction and the reservation transaction up to its \
                 inserts. The `stored` rows are the same runs' whole-millisecond columns \
                 (`reserved_at - occurrence_at` of each `flow_run`), as a check.\n\n\
                 | side | n | min ms | p50 ms | p99 ms | max ms |\n|---|---:|---:|---:|---:|---:|",
                p.due_items
            );
            for (side, l) in [
                ("controller", &d.controller),
                ("baseline", &d.baseline),
                ("controller (stored ms)", &d.controller_stored),
                ("baseline (stored ms)", &d.baseline_stored),
            ] {
                let _ = writeln!(
                    out,
                    "| {side} | {} | {} | {} | {} | {} |",
                    l.n,
                    f(l.min),
                    f(l.p50),
                    f(l.p99),
                    f(l.max)
                );
            }
            let parts = &d.controller_parts;
            let _ = writeln!(
                out,
                "\nThe controller's share, from its own snapshot: {} timers fired, mean {} ms \
                 from the due time to the claim's start; {} claims, mean {} ms per claim \
                 transaction. The rest of a run's lateness is the reservation transaction up \
                 to its inserts.",
                parts.timers,
                f(parts.timer_ms),
                parts.claims,
                f(parts.claim_ms)
            );
            out.push('\n');
        }
        if let Some(c) = &self.contend {
            let _ = writeln!(
                out,
                "## Contend\n\n4 replicas, {} one-row jobs in one hot queue. Lock waits are \
                 5 ms samples of the side's sessions waiting on a lock.\n\n| side | items done | \
                 seconds | items/s | claims | empty claims | claim errors | lock-wait samples / \
                 samples | statements/item |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|",
                p.tiny_jobs
            );
            for (side, s) in [("controller", &c.controller), ("baseline", &c.baseline)] {
                let _ = writeln!(
                    out,
                    "| {side} | {}/{} | {} | {} | {} | {} | {} | {}/{} | {} |",
                    s.items_done,
                    s.items,
                    f(s.secs),
                    f(s.items_per_s),
                    s.claims,
                    s.empty_claims,
                    s.claim_errors,
                    s.lock_wait_samples,
                    s.samples,
                    f(s.statements_per_item)
                );
            }
            out.push('\n');
        }
        if !self.plans.is_empty() {
            out.push_str(
                "## Plans\n\n`EXPLAIN (ANALYZE, BUFFERS)` of each family's claim and next-work \
                 statements (the claim inside a rolled-back transaction), with 10 eligible rows \
                 and the rest ineligible (finished jobs; schedules whose cursor is far ahead).\n\n\
                 | family | statement | rows | sequential scan | buffers | execution ms |\n\
                 |---|---|---:|---|---|---:|\n",
            );
            for e in &self.plans {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {} |",
                    e.family,
                    e.statement,
                    e.rows,
                    if e.seq_scan { "yes" } else { "no" },
                    e.buffers,
                    f(e.execution_ms)
                );
            }
            out.push('\n');
            if let Some(n) = self.plans.iter().map(|e| e.rows).max() {
                let _ = writeln!(out, "### Plans at {n} rows\n");
                for e in self.plans.iter().filter(|e| e.rows == n) {
                    let _ = writeln!(
                        out,
                        "{} `{}`:\n\n```\n{}\n```\n",
                        e.family, e.statement, e.plan
                    );
                }
            }
        }
        self.formula_markdown(&mut out);
        out.push_str(
            "## Benchmarks\n\nProcess-local CPU and allocations per attempt are criterion \
             benchmarks in their crates: `cargo bench -p nexuscrm-worker --bench controller` \
             (see crates/worker/README.md).\n",
        );
        out
    }

    /// The report's section on the Galera cluster: the figures table of `cluster_md` (the
    /// `cluster.md` that `nexuscrm-cluster-evidence` figures go into, beside `report.md`) when
    /// there is one, else how to produce it.
    pub(crate) fn cluster_section(cluster_md: Option<&str>) -> String {
        let mut out = String::from(
            "\n## On the Galera cluster\n\nThe drain and contend scenarios on the three-node \
             MariaDB Galera cluster (1, 2 and 4 replicas over the nodes) next to the single \
             MariaDB server, from `nexuscrm-cluster-evidence`; the command, the machine and what \
             the figures say are in [cluster.md](cluster.md).\n\n",
        );
        let table: Vec<&str> = cluster_md
            .unwrap_or_default()
            .lines()
            .filter(|l| l.trim_start().starts_with('|'))
            .collect();
        if table.is_empty() {
            out.push_str(
                "No cluster figures beside this report: run `bash scripts/galera.sh start` and \
                 `cargo run --release -p nexuscrm-evidence --bin nexuscrm-cluster-evidence`, and \
                 put its table in cluster.md.\n",
            );
        } else {
            for l in table {
                out.push_str(l.trim());
                out.push('\n');
            }
        }
        out
    }

    /// The report as JSON (stable keys under `summary`).
    pub(crate) fn json(&self) -> Value {
        let mut v = scenarios::keys(self.idle.as_ref(), &self.drain, self.due.as_ref());
        v["machine"] = json!({"cores": self.cores, "postgres": self.postgres});
        v["targets"] = self
            .targets()
            .into_iter()
            .map(|(target, measured, met)| json!({"target": target, "measured": measured, "met": met}))
            .collect();
        v["command"] = json!(self.command);
        v["workload"] = json!({
            "poll_ms": self.plan.poll.as_millis() as u64,
            "claims_in_flight": self.plan.claims_in_flight.get(),
            "successor_handoff": self.plan.successor_handoff,
            "idle_secs": self.plan.idle.as_secs_f64(),
            "drain_rows": self.plan.drain_rows,
            "tiny_jobs": self.plan.tiny_jobs,
            "replicas": self.plan.replicas,
            "due_items": self.plan.due_items,
            "explain_rows": self.plan.explain_rows,
            "formula_records": self.plan.formula_records,
        });
        v["details"] = json!({
            "idle": self.idle,
            "drain_runs": self.drain,
            "due": self.due,
            "contend": self.contend,
            "plans": self.plans,
            "formula": self.formula,
        });
        v
    }
}

/// A drain run's database time and its shared part (statements `other` ran equally often), in
/// seconds.
fn drain_split(run: &DrainRun, other: &DrainRun) -> (f64, f64) {
    let time = |d: &Digest| d.calls as f64 * d.mean_ms / 1e3;
    let total = run.digests.iter().map(time).sum();
    let shared = run
        .digests
        .iter()
        .filter(|d| {
            other
                .digests
                .iter()
                .any(|o| o.query == d.query && o.calls == d.calls)
        })
        .map(time)
        .sum();
    (total, shared)
}

#[cfg(test)]
mod tests {
    use super::Report;

    #[test]
    fn the_cluster_section_carries_the_cluster_table_or_says_how_to_make_it() {
        let md = "# Evidence on the cluster\n\nprose | not a row\n\n| target | rows/s |\n|---|---|\n\
                  | Galera (3 nodes) | 21996 |\n\nWhat the figures say.\n";
        let s = Report::cluster_section(Some(md));
        assert!(s.contains("## On the Galera cluster"));
        assert!(s.contains("| target | rows/s |\n|---|---|\n| Galera (3 nodes) | 21996 |\n"));
        assert!(!s.contains("prose"), "only the table's rows: {s}");
        assert!(!s.contains("No cluster figures"));
        for missing in [None, Some("no table here\n")] {
            let s = Report::cluster_section(missing);
            assert!(s.contains("No cluster figures beside this report"), "{s}");
            assert!(!s.contains("| Galera"));
        }
    }

    fn run(side: &'static str, digests: &[(&str, i64, f64)]) -> super::DrainRun {
        super::DrainRun {
            workload: "tiny".into(),
            side,
            replicas: 1,
            items: 100,
            items_done: 100,
            secs: 1.0,
            items_per_s: 100.0,
            statements_per_item: 1.0,
            rows_per_item: 1.0,
            blks_hit_per_item: 0.0,
            blks_read_per_item: 0.0,
            claims: 1,
            empty_claims: 0,
            digests: digests
                .iter()
                .map(|&(query, calls, mean_ms)| super::Digest {
                    query: query.into(),
                    calls,
                    rows: calls,
                    blks_hit: 0,
                    blks_read: 0,
                    mean_ms,
                })
                .collect(),
        }
    }

    #[test]
    fn the_shared_database_time_is_only_the_statements_both_sides_ran_equally_often() {
        let c = run("controller", &[("DELETE", 100, 0.5), ("CLAIM", 10, 2.0)]);
        let b = run("baseline", &[("DELETE", 100, 0.6), ("CLAIM", 100, 1.0)]);
        let (c_db, c_shared) = super::drain_split(&c, &b);
        assert!((c_db - 0.07).abs() < 1e-9, "{c_db}");
        assert!((c_shared - 0.05).abs() < 1e-9, "{c_shared}");
        let (b_db, b_shared) = super::drain_split(&b, &c);
        assert!((b_db - 0.16).abs() < 1e-9, "{b_db}");
        assert!((b_shared - 0.06).abs() < 1e-9, "{b_shared}");
    }
}
