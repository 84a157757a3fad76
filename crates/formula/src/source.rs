//! The Formula View [`Source`] and [`Attempt`]: the change cursor and claim, the derivation of
//! a batch of records, and the convergence sweep that reconciliation runs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::SystemTime;

use nexuscrm_persistence::sqlx::{self, AnyConnection, Row};
use nexuscrm_persistence::support::{new_token, optional_text, retrying, text, to_ms};
use nexuscrm_persistence::{Dialect, Queries, WriteError, family};
use nexuscrm_records as records;
use nexuscrm_worker::fault::CrashPoint;
use nexuscrm_worker::{Attempt, AttemptError, ClaimBatch, Generation, Source, SourceError};
use tokio_util::sync::CancellationToken;

use crate::eval::{self, Compiled, Outcome};
use crate::{Formula, MAX_DEFINITIONS, queries};

/// Change-log entries ingested per claim (the rest by the next claim, at once).
const INGEST: i64 = 1000;
/// Records marked stale per claim after a definition change.
const MARK: i64 = 1000;
/// Rows per multi-row statement.
const ROWS_PER_STATEMENT: usize = 100;
/// The name prefix of a skipped change-log id's row in `formula_cursor` (its position is the
/// time it was first skipped).
const GAP_PREFIX: &str = "gap:";
/// How long a skipped change-log id is looked for (a writer's transaction is far shorter; an
/// id missing for longer was rolled back, or the sweep finds its record).
const GAP_TTL_MS: i64 = 60_000;
/// The most skipped ids remembered at once (a cluster whose auto-increment steps by its node
/// count skips ids by design; the rest are the sweep's).
const GAP_MAX: usize = 256;

/// The ids between `position` and the last of `changes` that `changes` skips (allocated to a
/// writer that has not committed yet, or rolled back): the newest `room` of them.
fn note_gaps(position: i64, changes: &[(i64, String)], room: usize) -> Vec<i64> {
    let mut out = Vec::new();
    let mut expected = position + 1;
    for (id, _) in changes {
        // Only the newest `room` ids of a gap can be kept: no huge gap is walked id by id.
        let from = expected.max(id - room as i64);
        out.extend(from..*id);
        if out.len() > room {
            out.drain(..out.len() - room);
        }
        expected = expected.max(id + 1);
    }
    out
}

/// `(p, p, …)` of `n` placeholders, numbered from `start` on PostgreSQL.
fn list(dialect: Dialect, start: usize, n: usize) -> String {
    tuples(dialect, start, 1, n)
}

/// `rows` tuples of `cols` placeholders, numbered from `start` on PostgreSQL.
fn tuples(dialect: Dialect, start: usize, rows: usize, cols: usize) -> String {
    nexuscrm_persistence::support::placeholders(dialect, start, rows, cols)
}

/// Marks `keys` due at `now` (inserting view entries that do not exist yet, taking claimed
/// ones back).
async fn mark_due(
    c: &mut AnyConnection,
    dialect: Dialect,
    q: &Queries,
    keys: &[String],
    now: i64,
) -> Result<(), sqlx::Error> {
    for group in keys.chunks(ROWS_PER_STATEMENT) {
        let sql = format!(
            "{}{} {}",
            q.get("due_upsert_prefix"),
            tuples(dialect, 1, group.len(), 4),
            q.get("due_upsert_suffix")
        );
        let mut query = sqlx::query(&sql);
        for k in group {
            query = query.bind(k.as_str()).bind(-1_i64).bind(-1_i64).bind(now);
        }
        query.execute(&mut *c).await?;
    }
    Ok(())
}

/// The Formula View's [`Source`]: ingests the change log and claims due records; its
/// reconciliation releases older generations' claims and sweeps for divergence.
#[derive(Debug, Clone)]
pub struct FormulaSource {
    pub(crate) formula: Formula,
}

/// Where a process's rolling sweep stands: a pass (records → view, view → records and values,
/// roll-up) and the last key it covered.
#[derive(Debug, Clone, Default)]
pub(crate) struct SweepCursor {
    pass: u8,
    after: String,
}

/// What a sweep did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Chunks read (each a bounded range of one pass).
    pub chunks: u64,
    /// Statements issued, reads and repairs together.
    pub statements: u64,
    /// Records marked for rederivation because the view differed from canonical state.
    pub marked: u64,
    /// Roll-up accounts repaired to their canonical aggregate.
    pub rollups_repaired: u64,
    /// Whether every pass reached its end (a full sweep).
    pub complete: bool,
}

impl FormulaSource {
    /// The family handle.
    #[must_use]
    pub fn formula(&self) -> &Formula {
        &self.formula
    }

    /// The polled generation cursor: the change log's newest id, the definitions epoch, the
    /// owning generation and the records work signal, mixed. One statement.
    async fn read_generation(&self) -> Result<u64, sqlx::Error> {
        let db = &self.formula.inner.db;
        let row = sqlx::query(queries(db.dialect()).get("generation"))
            .fetch_one(db.pool())
            .await?;
        let parts: [Option<i64>; 4] = [
            row.try_get(0)?,
            row.try_get(1)?,
            row.try_get(2)?,
            row.try_get(3)?,
        ];
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for p in parts {
            h = (h ^ p.unwrap_or(0) as u64)
                .wrapping_mul(0x0100_0000_01b3)
                .rotate_left(17);
        }
        Ok(h)
    }

    /// Sweeps everything once: canonical records against the view, the view against canonical
    /// records (values checked by digest, version and revision), and the roll-up against its
    /// canonical aggregate, in chunks, marking every record that differs. How a fresh process
    /// converges without the change history.
    ///
    /// # Errors
    ///
    /// As a fenced write's (superseded, or a write error).
    pub async fn sweep_all(&self, cancel: &CancellationToken) -> Result<SweepReport, SourceError> {
        let mut cursor = SweepCursor::default();
        let mut report = SweepReport::default();
        loop {
            if self.sweep_step(&mut cursor, &mut report, cancel).await? {
                report.complete = true;
                return Ok(report);
            }
        }
    }

    /// One chunk of the sweep at `cursor`; `true` when it finished the last pass (the cursor
    /// wraps to the start).
    async fn sweep_step(
        &self,
        cursor: &mut SweepCursor,
        report: &mut SweepReport,
        cancel: &CancellationToken,
    ) -> Result<bool, SourceError> {
        let inner = &self.formula.inner;
        let db = inner.reconcile_db.clone();
        let dialect = db.dialect();
        let q = queries(dialect);
        let chunk = inner.sweep_chunk;
        let (pass, after) = (cursor.pass, cursor.after.clone());
        let formula = self.formula.clone();
        let step = family::fenced(&db, &inner.fence, &inner.clock, cancel, move |c, now| {
            let (after, formula) = (after.clone(), formula.clone());
            Box::pin(async move {
                match pass {
                    0 => sweep_records(c, dialect, q, &after, chunk, now).await,
                    1 => sweep_view(c, dialect, q, &formula, &after, chunk, now).await,
                    _ => sweep_rollup(c, q, &after, chunk).await,
                }
            })
        })
        .await?;
        report.chunks += 1;
        report.statements += step.statements;
        report.marked += step.marked;
        report.rollups_repaired += step.repaired;
        if step.marked > 0 {
            self.formula.wake();
        }
        match step.next {
            Some(last) => {
                cursor.after = last;
                Ok(false)
            }
            None if cursor.pass < 2 => {
                cursor.pass += 1;
                cursor.after.clear();
                Ok(false)
            }
            None => {
                *cursor = SweepCursor::default();
                Ok(true)
            }
        }
    }
}

/// One sweep chunk's outcome.
struct Step {
    /// Where the pass continues, or `None` when it reached its end.
    next: Option<String>,
    statements: u64,
    marked: u64,
    repaired: u64,
}

/// Pass 0: canonical records in `(after, …]` LEFT JOIN the view: a record the view lacks, or
/// holds at another revision or epoch while not already due, is marked.
async fn sweep_records(
    c: &mut AnyConnection,
    dialect: Dialect,
    q: &Queries,
    after: &str,
    chunk: i64,
    now: i64,
) -> Result<Step, sqlx::Error> {
    let epoch: i64 = sqlx::query_scalar(q.get("epoch_read"))
        .fetch_one(&mut *c)
        .await?;
    let rows = sqlx::query(q.get("sweep_records"))
        .bind(after)
        .bind(chunk)
        .fetch_all(&mut *c)
        .await?;
    let mut stale = Vec::new();
    let mut last = None;
    for r in &rows {
        let key = text(r, 0)?;
        let revision: i64 = r.try_get(1)?;
        let src: Option<i64> = r.try_get(2)?;
        let ep: Option<i64> = r.try_get(3)?;
        let due: Option<i64> = r.try_get(4)?;
        let diverged = match (src, ep) {
            (Some(s), Some(e)) => due.is_none() && (s != revision || e != epoch),
            _ => true,
        };
        if diverged {
            stale.push(key.clone());
        }
        last = Some(key);
    }
    let marked = stale.len() as u64;
    mark_due(c, dialect, q, &stale, now).await?;
    Ok(Step {
        next: if rows.len() as i64 == chunk {
            last
        } else {
            None
        },
        statements: 2 + stale.len().div_ceil(ROWS_PER_STATEMENT) as u64,
        marked,
        repaired: 0,
    })
}

/// Pass 1: view entries in `(after, …]` LEFT JOIN canonical records, with their value rows:
/// an entry whose record is gone, a value row that is missing, extra, of another version or
/// revision, or whose digest does not match (edited by hand) marks its record.
async fn sweep_view(
    c: &mut AnyConnection,
    dialect: Dialect,
    q: &Queries,
    formula: &Formula,
    after: &str,
    chunk: i64,
    now: i64,
) -> Result<Step, sqlx::Error> {
    let defs: HashMap<String, i64> = sqlx::query(q.get("def_list"))
        .fetch_all(&mut *c)
        .await?
        .iter()
        .map(|r| Ok((text(r, 0)?, r.try_get::<i64, _>(3)?)))
        .collect::<Result<_, sqlx::Error>>()?;
    let _ = formula;
    let rows = sqlx::query(q.get("sweep_view"))
        .bind(after)
        .bind(chunk)
        .fetch_all(&mut *c)
        .await?;
    let full = rows.len() as i64 == chunk;
    // key -> (source revision, whether it is clean and its record exists)
    let mut entries: BTreeMap<String, (i64, bool)> = BTreeMap::new();
    let mut stale: HashSet<String> = HashSet::new();
    let mut last = None;
    for r in &rows {
        let key = text(r, 0)?;
        let src: i64 = r.try_get(1)?;
        let due: Option<i64> = r.try_get(3)?;
        let revision: Option<i64> = r.try_get(4)?;
        if due.is_none() && revision.is_none() {
            stale.insert(key.clone()); // Its record is gone.
        }
        entries.insert(key.clone(), (src, due.is_none() && revision.is_some()));
        last = Some(key);
    }
    let mut statements = 2;
    let values = if full {
        let upper = last.clone().unwrap_or_default();
        sqlx::query(q.get("sweep_values"))
            .bind(after)
            .bind(upper)
            .fetch_all(&mut *c)
            .await?
    } else {
        sqlx::query(q.get("sweep_values_tail"))
            .bind(after)
            .bind(chunk * (MAX_DEFINITIONS as i64 + 1))
            .fetch_all(&mut *c)
            .await?
    };
    statements += 1;
    let tail_full = !full && values.len() as i64 == chunk * (MAX_DEFINITIONS as i64 + 1);
    let mut seen: HashMap<String, HashSet<String>> = HashMap::new();
    let mut last_value_key = None;
    for r in &values {
        let key = text(r, 0)?;
        let name = text(r, 1)?;
        let value: Option<String> = optional_text(r, 2)?;
        let error: Option<String> = optional_text(r, 3)?;
        let src: i64 = r.try_get(4)?;
        let version: i64 = r.try_get(5)?;
        let digest = text(r, 6)?;
        last_value_key = Some(key.clone());
        let Some(&(entry_src, clean)) = entries.get(&key) else {
            stale.insert(key); // A value row without a view entry (added by hand).
            continue;
        };
        if !clean {
            continue;
        }
        let valid = defs.get(&name) == Some(&version)
            && src == entry_src
            && digest
                == eval::digest(
                    &key,
                    &name,
                    value.as_deref(),
                    error.as_deref(),
                    src,
                    version,
                )
            && value.is_some() != error.is_some();
        if !valid {
            stale.insert(key.clone());
        }
        seen.entry(key).or_default().insert(name);
    }
    for (key, (_, clean)) in &entries {
        if *clean {
            let have = seen.get(key).map_or(0, HashSet::len);
            if have != defs.len() {
                stale.insert(key.clone()); // A value row is missing.
            }
        }
    }
    let stale: Vec<String> = stale.into_iter().collect();
    mark_due(c, dialect, q, &stale, now).await?;
    statements += stale.len().div_ceil(ROWS_PER_STATEMENT) as u64;
    let next = if full {
        last
    } else if tail_full {
        last_value_key
    } else {
        None
    };
    Ok(Step {
        next,
        statements,
        marked: stale.len() as u64,
        repaired: 0,
    })
}

/// Pass 2: the roll-up in `(after, …]` against its canonical aggregate (per account, the sum
/// of the view's contributions, an index range over `formula_record_account`); an account that
/// differs is repaired under its row lock from a fresh sum.
///
/// A chunk is bounded by records, not by accounts: the account at record offset `chunk - 1`
/// closes the range, so a table with few accounts is still read `chunk` records at a time (an
/// account with more records than a chunk is one range of its own), and no backstop turn is an
/// aggregate over the whole table.
async fn sweep_rollup(
    c: &mut AnyConnection,
    q: &Queries,
    after: &str,
    chunk: i64,
) -> Result<Step, sqlx::Error> {
    let bound = sqlx::query(q.get("sweep_rollup_bound"))
        .bind(after)
        .bind(chunk - 1)
        .fetch_optional(&mut *c)
        .await?
        .map(|r| text(&r, 0))
        .transpose()?;
    let canonical = match &bound {
        Some(upper) => {
            sqlx::query(q.get("sweep_rollup_canonical"))
                .bind(after)
                .bind(upper.as_str())
                .fetch_all(&mut *c)
                .await?
        }
        None => {
            sqlx::query(q.get("sweep_rollup_canonical_tail"))
                .bind(after)
                .fetch_all(&mut *c)
                .await?
        }
    };
    let full = bound.is_some();
    let mut want: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for r in &canonical {
        want.insert(text(r, 0)?, (r.try_get(1)?, r.try_get(2)?));
    }
    let stored = match &bound {
        Some(upper) => {
            sqlx::query(q.get("sweep_rollup_stored"))
                .bind(after)
                .bind(upper.as_str())
                .fetch_all(&mut *c)
                .await?
        }
        None => {
            sqlx::query(q.get("sweep_rollup_stored_tail"))
                .bind(after)
                .bind(chunk)
                .fetch_all(&mut *c)
                .await?
        }
    };
    let tail_full = !full && stored.len() as i64 == chunk;
    let mut have: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    let mut last_stored = None;
    for r in &stored {
        let account = text(r, 0)?;
        have.insert(account.clone(), (r.try_get(1)?, r.try_get(2)?));
        last_stored = Some(account);
    }
    if tail_full {
        // The stored side stopped at `last_stored`; accounts after it are the next chunk's.
        if let Some(last) = &last_stored {
            want.retain(|account, _| account <= last);
        }
    }
    let mut statements = 3;
    let mut repaired = 0;
    let accounts: Vec<String> = want
        .keys()
        .chain(have.keys())
        .cloned()
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    for account in accounts {
        let w = want.get(&account).copied().unwrap_or((0, 0));
        let h = have.get(&account).copied();
        let matches = match h {
            Some(h) => h == w,
            None => w == (0, 0),
        };
        if matches && h != Some((0, 0)) {
            continue;
        }
        // Locked first, then summed fresh: a derivation that committed meanwhile is counted,
        // one still running adds its delta after this.
        sqlx::query(q.get("rollup_ensure"))
            .bind(account.as_str())
            .execute(&mut *c)
            .await?;
        sqlx::query(q.get("rollup_lock"))
            .bind(account.as_str())
            .fetch_optional(&mut *c)
            .await?;
        let row = sqlx::query(q.get("rollup_sum"))
            .bind(account.as_str())
            .fetch_one(&mut *c)
            .await?;
        let (total, records): (i64, i64) = (row.try_get(0)?, row.try_get(1)?);
        sqlx::query(q.get("rollup_set"))
            .bind(total)
            .bind(records)
            .bind(account.as_str())
            .execute(&mut *c)
            .await?;
        sqlx::query(q.get("rollup_prune"))
            .bind(account.as_str())
            .execute(&mut *c)
            .await?;
        statements += 5;
        if !matches {
            repaired += 1;
        }
    }
    let next = if full {
        bound
    } else if tail_full {
        last_stored
    } else {
        None
    };
    Ok(Step {
        next,
        statements,
        marked: 0,
        repaired,
    })
}

impl Source for FormulaSource {
    type Attempt = FormulaAttempt;

    async fn check_ready(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        tokio::select! {
            biased;
            () = cancel.cancelled() => Err(SourceError::not_committed("cancelled")),
            r = self.read_generation() => r.map(drop).map_err(|e| {
                SourceError::new(format!("the formula view is not readable: {e}"))
            }),
        }
    }

    /// Claims of older generations back at once, then the sweep: all of it on this process's
    /// first reconciliation (a fresh process converges without replay), a few chunks per
    /// backstop turn after that (bounded statements per turn, on the reconcile pool).
    async fn reconcile(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        let inner = &self.formula.inner;
        let release = queries(inner.db.dialect()).get("release_older");
        family::release_older_generations(&inner.db, &inner.fence, &inner.clock, &cancel, release)
            .await?;
        let mut guard = inner.sweep.lock().await;
        match guard.as_mut() {
            None => {
                // The change cursor starts at the log's end: what came before is the sweep's.
                self.init_cursor(&cancel).await?;
                let report = self.sweep_all(&cancel).await?;
                tracing::info!(
                    family = "formula",
                    chunks = report.chunks,
                    statements = report.statements,
                    marked = report.marked,
                    rollups_repaired = report.rollups_repaired,
                    "full convergence sweep"
                );
                *guard = Some(SweepCursor::default());
            }
            Some(cursor) => {
                let mut report = SweepReport::default();
                for _ in 0..inner.sweep_chunks_per_turn {
                    if self.sweep_step(cursor, &mut report, &cancel).await? {
                        break;
                    }
                }
            }
        }
        Ok(())
    }

    async fn claim(
        &self,
        capacity: NonZeroUsize,
        cancel: CancellationToken,
    ) -> Result<ClaimBatch<FormulaAttempt>, SourceError> {
        let inner = &self.formula.inner;
        let dialect = inner.db.dialect();
        let q = queries(dialect);
        let token = new_token();
        let lease_ms = inner.lease.as_millis() as i64;
        let per = inner.keys_per_attempt;
        let limit = (capacity.get() * per) as i64;
        let generation = inner.fence.generation();
        let t = token.clone();
        let keys: Vec<String> = family::fenced(
            &inner.db,
            &inner.fence,
            &inner.clock,
            &cancel,
            move |c, now| {
                let t = t.clone();
                Box::pin(async move {
                    ingest(c, dialect, q, now).await?;
                    let claim = sqlx::query(q.get("claim"))
                        .bind(t.as_str())
                        .bind(now + lease_ms)
                        .bind(generation)
                        .bind(now)
                        .bind(limit);
                    let rows = family::claim_rows(c, dialect, claim, q.get("claimed"), &t).await?;
                    rows.iter().map(|r| text(r, 0)).collect()
                })
            },
        )
        .await?;
        inner
            .faults
            .hit(CrashPoint::AfterClaim)
            .map_err(SourceError::new)?;
        let full = keys.len() as i64 == limit;
        let attempts: Vec<FormulaAttempt> = keys
            .chunks(per)
            .map(|k| FormulaAttempt {
                formula: self.formula.clone(),
                token: token.clone(),
                keys: k.to_vec(),
            })
            .collect();
        Ok(if full && !attempts.is_empty() {
            ClaimBatch::more(attempts)
        } else {
            ClaimBatch::done(attempts)
        })
    }

    async fn next_work_at(
        &self,
        cancel: CancellationToken,
    ) -> Result<Option<SystemTime>, SourceError> {
        let db = &self.formula.inner.db;
        let q = queries(db.dialect());
        family::next_work_at(db, &cancel, &[q.get("next_due"), q.get("next_backlog")]).await
    }

    async fn generation(
        &self,
        cancel: CancellationToken,
    ) -> Result<Option<Generation>, SourceError> {
        family::generation(&self.formula.inner.probe, &cancel, || {
            self.read_generation()
        })
        .await
    }

    async fn generation_changed(
        &self,
        seen: Generation,
        cancel: CancellationToken,
    ) -> Result<Generation, SourceError> {
        let probe = &self.formula.inner.probe;
        family::generation_changed(probe, seen, &cancel, || self.read_generation()).await
    }
}

impl FormulaSource {
    async fn init_cursor(&self, cancel: &CancellationToken) -> Result<(), SourceError> {
        let inner = &self.formula.inner;
        let dialect = inner.db.dialect();
        let q = queries(dialect);
        family::fenced(
            &inner.db,
            &inner.fence,
            &inner.clock,
            cancel,
            move |c, _now| {
                Box::pin(async move {
                    let last = records::last_change(c, dialect).await?;
                    sqlx::query(q.get("cursor_init"))
                        .bind("changes")
                        .bind(last)
                        .execute(&mut *c)
                        .await?;
                    Ok(())
                })
            },
        )
        .await
    }
}

/// The claim's first half, under the cursor's row lock: change-log entries after the cursor
/// mark their records due, and after a definition change a bounded batch of records derived
/// under an older epoch is marked.
///
/// Change-log ids are allocated when a writer inserts, not when it commits, so a writer can
/// commit an id below one the cursor has already passed (two Bulk segments in flight: the one
/// with the higher ids commits first). The cursor therefore remembers every id it skipped
/// ([`note_gaps`]) as a `gap:<id>` row of `formula_cursor` (read by the same locking
/// statement, so no gap costs nothing), looks those ids up again on every ingest while any are
/// open, and marks the records of the ones that appeared; an id still missing after
/// [`GAP_TTL_MS`] was a rolled-back insert (or a writer slower than that, which the
/// convergence sweep covers) and is forgotten.
async fn ingest(
    c: &mut AnyConnection,
    dialect: Dialect,
    q: &Queries,
    now: i64,
) -> Result<(), sqlx::Error> {
    let rows = sqlx::query(q.get("cursor_lock")).fetch_all(&mut *c).await?;
    let mut cursors: HashMap<String, i64> = HashMap::new();
    let mut gaps: Vec<(i64, i64)> = Vec::new();
    for r in &rows {
        let (name, position) = (text(r, 0)?, r.try_get::<i64, _>(1)?);
        match name.strip_prefix(GAP_PREFIX).map(str::parse::<i64>) {
            Some(Ok(id)) => gaps.push((id, position)),
            _ => {
                cursors.insert(name, position);
            }
        }
    }
    let position = match cursors.get("changes") {
        Some(p) => *p,
        None => {
            // Never reconciled here: start at the log's end (the sweep covers the rest).
            let last = records::last_change(c, dialect).await?;
            sqlx::query(q.get("cursor_init"))
                .bind("changes")
                .bind(last)
                .execute(&mut *c)
                .await?;
            last
        }
    };
    let mut keys: Vec<String> = Vec::new();
    let mut closed: Vec<i64> = Vec::new();
    if !gaps.is_empty() {
        let ids: Vec<i64> = gaps.iter().map(|(id, _)| *id).collect();
        let found = records::changes_with_ids(c, dialect, &ids).await?;
        let found_ids: HashSet<i64> = found.iter().map(|(id, _)| *id).collect();
        keys.extend(found.into_iter().map(|(_, k)| k));
        closed.extend(
            gaps.iter()
                .filter(|(id, seen)| found_ids.contains(id) || *seen < now - GAP_TTL_MS)
                .map(|(id, _)| *id),
        );
    }
    let changes = records::changes_after(c, dialect, position, INGEST).await?;
    let open = gaps.len() - closed.len();
    let opened = note_gaps(position, &changes, GAP_MAX.saturating_sub(open));
    keys.extend(changes.iter().map(|(_, k)| k.clone()));
    if !keys.is_empty() {
        keys.sort();
        keys.dedup();
        mark_due(c, dialect, q, &keys, now).await?;
    }
    for group in closed.chunks(ROWS_PER_STATEMENT) {
        let sql = format!(
            "{}{}",
            q.get("cursor_delete_prefix"),
            list(dialect, 1, group.len())
        );
        let mut query = sqlx::query(&sql);
        for id in group {
            query = query.bind(format!("{GAP_PREFIX}{id}"));
        }
        query.execute(&mut *c).await?;
    }
    for group in opened.chunks(ROWS_PER_STATEMENT) {
        let sql = format!(
            "{}{} {}",
            q.get("cursor_insert_prefix"),
            tuples(dialect, 1, group.len(), 2),
            q.get("cursor_insert_suffix")
        );
        let mut query = sqlx::query(&sql);
        for id in group {
            query = query.bind(format!("{GAP_PREFIX}{id}")).bind(now);
        }
        query.execute(&mut *c).await?;
    }
    if let Some((last, _)) = changes.last() {
        sqlx::query(q.get("cursor_set"))
            .bind("changes")
            .bind(*last)
            .execute(&mut *c)
            .await?;
    }
    let epoch: i64 = sqlx::query_scalar(q.get("epoch_read"))
        .fetch_one(&mut *c)
        .await?;
    let marked_epoch = cursors.get("epoch").copied().unwrap_or(0);
    if marked_epoch < epoch {
        let n = sqlx::query(q.get("mark_epoch"))
            .bind(now)
            .bind(epoch)
            .bind(MARK)
            .execute(&mut *c)
            .await?
            .rows_affected();
        if (n as i64) < MARK {
            sqlx::query(q.get("cursor_set"))
                .bind("epoch")
                .bind(epoch)
                .execute(&mut *c)
                .await?;
        }
    }
    Ok(())
}

/// One claimed batch of records: derived in write transactions of a bounded size (lease
/// heartbeats between them), then released in one disposition.
#[derive(Debug)]
pub struct FormulaAttempt {
    formula: Formula,
    token: String,
    keys: Vec<String>,
}

fn crash(e: nexuscrm_worker::fault::Crash) -> AttemptError {
    AttemptError::new(e)
}

fn write_error(what: &str, e: &WriteError) -> AttemptError {
    family::attempt_error(format!("formula {what} failed: {e}"), e)
}

impl FormulaAttempt {
    /// The records this attempt derives.
    #[must_use]
    pub fn keys(&self) -> &[String] {
        &self.keys
    }

    async fn execute(self, cancel: CancellationToken) -> Result<(), AttemptError> {
        let inner = &self.formula.inner;
        let faults = inner.faults.clone();
        faults.hit(CrashPoint::BeforeEffect).map_err(crash)?;
        let per = inner.keys_per_write;
        for (i, chunk) in self.keys.chunks(per).enumerate() {
            if cancel.is_cancelled() {
                break; // Drained: the rest is given back by the disposition.
            }
            if i > 0 {
                faults.hit(CrashPoint::DuringHeartbeat).map_err(crash)?;
                let rest = self.keys[i * per..].to_vec();
                match retrying(&cancel, || self.heartbeat(rest.clone())).await {
                    Ok(true) => {}
                    Ok(false) => {
                        faults.hit(CrashPoint::LeaseExpiry).map_err(crash)?;
                        return Ok(()); // Fenced out: a newer generation owns the view.
                    }
                    Err(WriteError::Cancelled) => break,
                    Err(e) => return Err(write_error("heartbeat", &e)),
                }
            }
            match retrying(&cancel, || self.derive(chunk.to_vec())).await {
                Ok(_) => {}
                Err(WriteError::Cancelled) => break,
                Err(e) => return Err(write_error("derivation", &e)),
            }
        }
        faults.hit(CrashPoint::AfterEffect).map_err(crash)?;
        faults.hit(CrashPoint::BeforeDisposition).map_err(crash)?;
        // Never cancelled: it only ends the claim.
        let never = CancellationToken::new();
        retrying(&never, || self.release())
            .await
            .map_err(|e| write_error("disposition", &e))?;
        faults.hit(CrashPoint::AfterDisposition).map_err(crash)?;
        Ok(())
    }

    /// Extends the lease of `keys`; `false` when fenced out.
    async fn heartbeat(&self, keys: Vec<String>) -> Result<bool, WriteError> {
        let inner = &self.formula.inner;
        let db = inner.db.clone();
        let dialect = db.dialect();
        let q = queries(dialect);
        let (fence, clock, token) = (inner.fence.clone(), inner.clock.clone(), self.token.clone());
        let lease_ms = inner.lease.as_millis() as i64;
        let never = CancellationToken::new();
        inner
            .db
            .write(&never, move |c| {
                Box::pin(async move {
                    if !fence.holds(c, &db).await? {
                        return Ok(false);
                    }
                    let now = to_ms(clock.now());
                    let sql = format!(
                        "{}{}",
                        q.get("heartbeat_prefix"),
                        list(dialect, 3, keys.len())
                    );
                    let mut query = sqlx::query(&sql).bind(now + lease_ms).bind(token.as_str());
                    for k in &keys {
                        query = query.bind(k.as_str());
                    }
                    query.execute(&mut *c).await?;
                    Ok(true)
                })
            })
            .await
    }

    /// Ends the claim: records derived under the current epoch are clean; the rest (a
    /// definition changed meanwhile, or skipped) are due again at once.
    async fn release(&self) -> Result<(), WriteError> {
        let inner = &self.formula.inner;
        let db = inner.db.clone();
        let dialect = db.dialect();
        let q = queries(dialect);
        let (fence, clock, token) = (inner.fence.clone(), inner.clock.clone(), self.token.clone());
        let keys = self.keys.clone();
        let never = CancellationToken::new();
        inner
            .db
            .write(&never, move |c| {
                Box::pin(async move {
                    if !fence.holds(c, &db).await? {
                        return Ok(());
                    }
                    let now = to_ms(clock.now());
                    let epoch: i64 = sqlx::query_scalar(q.get("epoch_share"))
                        .fetch_one(&mut *c)
                        .await?;
                    for group in keys.chunks(ROWS_PER_STATEMENT * 5) {
                        let sql = format!(
                            "{}{}",
                            q.get("release_prefix"),
                            list(dialect, 3, group.len())
                        );
                        let mut query = sqlx::query(&sql).bind(token.as_str()).bind(epoch);
                        for k in group {
                            query = query.bind(k.as_str());
                        }
                        let done = query.execute(&mut *c).await?.rows_affected();
                        if (done as usize) < group.len() {
                            let sql = format!(
                                "{}{}",
                                q.get("unclaim_prefix"),
                                list(dialect, 3, group.len())
                            );
                            let mut query = sqlx::query(&sql).bind(now).bind(token.as_str());
                            for k in group {
                                query = query.bind(k.as_str());
                            }
                            query.execute(&mut *c).await?;
                        }
                    }
                    Ok(())
                })
            })
            .await?;
        if let Some(w) = inner.waker.get() {
            w.wake(); // Records may be due again; completion alone never claims.
        }
        Ok(())
    }

    /// Derives `keys` in one fenced transaction under the epoch's share lock: the records are
    /// read through the records domain, every definition evaluated, the view rows replaced,
    /// the roll-up adjusted by each record's change in contribution. Returns how many records
    /// it derived (0 when fenced out).
    async fn derive(&self, keys: Vec<String>) -> Result<usize, WriteError> {
        let inner = &self.formula.inner;
        let db = inner.db.clone();
        let dialect = db.dialect();
        let q = queries(dialect);
        let (fence, clock, token) = (inner.fence.clone(), inner.clock.clone(), self.token.clone());
        let formula = self.formula.clone();
        let never = CancellationToken::new();
        inner
            .db
            .write(&never, move |c| {
                Box::pin(async move {
                    if !fence.holds(c, &db).await? {
                        return Ok(0);
                    }
                    let now = to_ms(clock.now());
                    let epoch: i64 = sqlx::query_scalar(q.get("epoch_share"))
                        .fetch_one(&mut *c)
                        .await?;
                    let defs = programs(c, q, &formula).await?;
                    let sql = format!(
                        "{}{} {}",
                        q.get("lock_claimed_prefix"),
                        list(dialect, 2, keys.len()),
                        q.get("lock_suffix")
                    );
                    let mut query = sqlx::query(&sql).bind(token.as_str());
                    for k in &keys {
                        query = query.bind(k.as_str());
                    }
                    let mut held: BTreeMap<String, (i64, Option<String>, i64)> = BTreeMap::new();
                    for r in query.fetch_all(&mut *c).await? {
                        held.insert(
                            text(&r, 0)?,
                            (r.try_get(1)?, optional_text(&r, 2)?, r.try_get(3)?),
                        );
                    }
                    if held.is_empty() {
                        return Ok(0); // Taken back (changed again, or another generation).
                    }
                    let held_keys: Vec<String> = held.keys().cloned().collect();
                    let found: HashMap<String, records::Record> =
                        records::read(c, dialect, &held_keys)
                            .await?
                            .into_iter()
                            .map(|r| (r.key.clone(), r))
                            .collect();
                    let mut deltas: BTreeMap<String, (i64, i64)> = BTreeMap::new();
                    let mut values: Vec<[Option<String>; 3]> = Vec::new();
                    let mut value_meta: Vec<(i64, i64, String)> = Vec::new();
                    let mut derived: Vec<(String, i64, Option<String>, i64, i64)> = Vec::new();
                    let mut gone: Vec<String> = Vec::new();
                    let mut replaced: Vec<String> = Vec::new();
                    for (key, (src, old_account, old_contribution)) in &held {
                        let new = match found.get(key) {
                            None => None,
                            Some(r) if r.revision < *src => continue, // Never backwards.
                            Some(r) => Some(r),
                        };
                        if let Some(a) = old_account {
                            let d = deltas.entry(a.clone()).or_default();
                            d.0 -= old_contribution;
                            d.1 -= 1;
                        }
                        replaced.push(key.clone());
                        let Some(record) = new else {
                            gone.push(key.clone());
                            continue;
                        };
                        let mut errors = 0;
                        for def in &defs {
                            let outcome = match &def.program {
                                Ok(p) => eval::evaluate(p, key, record.revision, &record.data),
                                Err(e) => Outcome::Error(e.clone()),
                            };
                            let (value, error) = match outcome {
                                Outcome::Value(v) => (Some(v.to_string()), None),
                                Outcome::Error(e) => {
                                    errors += 1;
                                    (None, Some(e))
                                }
                            };
                            let digest = eval::digest(
                                key,
                                &def.name,
                                value.as_deref(),
                                error.as_deref(),
                                record.revision,
                                def.version,
                            );
                            values.push([Some(key.clone()), value, error]);
                            value_meta.push((
                                record.revision,
                                def.version,
                                format!("{}\u{0}{digest}", def.name),
                            ));
                        }
                        let contribution = eval::contribution(&record.data);
                        if let Some((a, amount)) = &contribution {
                            let d = deltas.entry(a.clone()).or_default();
                            d.0 += amount;
                            d.1 += 1;
                        }
                        let (account, amount) =
                            contribution.map_or((None, 0), |(a, n)| (Some(a), n));
                        derived.push((key.clone(), record.revision, account, amount, errors));
                    }
                    // The view rows of these records, replaced.
                    for group in replaced.chunks(ROWS_PER_STATEMENT * 5) {
                        let sql = format!(
                            "{}{}",
                            q.get("values_delete_prefix"),
                            list(dialect, 1, group.len())
                        );
                        let mut query = sqlx::query(&sql);
                        for k in group {
                            query = query.bind(k.as_str());
                        }
                        query.execute(&mut *c).await?;
                    }
                    let rows: Vec<_> = values.into_iter().zip(value_meta).collect();
                    for group in rows.chunks(ROWS_PER_STATEMENT) {
                        let sql = format!(
                            "{}{}",
                            q.get("value_insert_prefix"),
                            tuples(dialect, 1, group.len(), 7)
                        );
                        let mut query = sqlx::query(&sql);
                        for ([key, value, error], (src, version, name_digest)) in group {
                            let (name, digest) =
                                name_digest.split_once('\u{0}').unwrap_or((name_digest, ""));
                            query = query
                                .bind(key.clone())
                                .bind(name.to_owned())
                                .bind(value.clone())
                                .bind(error.clone())
                                .bind(*src)
                                .bind(*version)
                                .bind(digest.to_owned());
                        }
                        query.execute(&mut *c).await?;
                    }
                    // The roll-up, by account in order (so concurrent derivations lock alike).
                    for (account, (total, records)) in &deltas {
                        if (*total, *records) == (0, 0) {
                            continue;
                        }
                        sqlx::query(q.get("rollup_add"))
                            .bind(account.as_str())
                            .bind(*total)
                            .bind(*records)
                            .execute(&mut *c)
                            .await?;
                    }
                    for group in derived.chunks(ROWS_PER_STATEMENT) {
                        let sql = format!(
                            "{}{} {}",
                            q.get("derived_upsert_prefix"),
                            tuples(dialect, 1, group.len(), 7),
                            q.get("derived_upsert_suffix")
                        );
                        let mut query = sqlx::query(&sql);
                        for (key, revision, account, amount, errors) in group {
                            query = query
                                .bind(key.as_str())
                                .bind(*revision)
                                .bind(epoch)
                                .bind(account.clone())
                                .bind(*amount)
                                .bind(*errors)
                                .bind(now);
                        }
                        query.execute(&mut *c).await?;
                    }
                    for key in &gone {
                        sqlx::query(q.get("derived_delete"))
                            .bind(key.as_str())
                            .bind(token.as_str())
                            .execute(&mut *c)
                            .await?;
                    }
                    Ok(derived.len() + gone.len())
                })
            })
            .await
    }
}

/// The current definitions, compiled once per (name, version).
async fn programs(
    c: &mut AnyConnection,
    q: &Queries,
    formula: &Formula,
) -> Result<Vec<Arc<Compiled>>, sqlx::Error> {
    let rows = sqlx::query(q.get("def_list")).fetch_all(&mut *c).await?;
    let mut out = Vec::with_capacity(rows.len());
    let mut cache = formula
        .inner
        .programs
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for r in &rows {
        let name = text(r, 0)?;
        let expression = text(r, 2)?;
        let version: i64 = r.try_get(3)?;
        let key = (name.clone(), version);
        if let Some(p) = cache.get(&key) {
            out.push(p.clone());
            continue;
        }
        // Stored definitions compiled when defined; one that no longer does (a newer
        // interpreter) evaluates to an error on every record instead of stopping the view.
        let program = eval::compile(&expression)
            .map_err(|e| format!("the definition no longer compiles: {}", e.message));
        let compiled = Arc::new(Compiled {
            name,
            version,
            program,
        });
        cache.insert(key, compiled.clone());
        out.push(compiled);
    }
    Ok(out)
}

impl Attempt for FormulaAttempt {
    async fn run(self, cancel: CancellationToken) -> Result<(), AttemptError> {
        let span = tracing::info_span!(
            "formula.derive",
            family = "formula",
            records = self.keys.len(),
            generation = self.formula.inner.fence.generation()
        );
        tracing::Instrument::instrument(self.execute(cancel), span).await
    }
}

#[cfg(test)]
mod tests {
    use super::note_gaps;

    fn log(ids: &[i64]) -> Vec<(i64, String)> {
        ids.iter().map(|i| (*i, format!("k{i}"))).collect()
    }

    #[test]
    fn the_ids_a_read_skips_are_noted_newest_first_kept_and_bounded() {
        assert_eq!(note_gaps(10, &log(&[11, 12, 13]), 256), Vec::<i64>::new());
        assert_eq!(note_gaps(10, &log(&[12, 13, 16]), 256), vec![11, 14, 15]);
        assert_eq!(note_gaps(10, &log(&[]), 256), Vec::<i64>::new());
        // Bounded by the room left, the newest kept.
        assert_eq!(note_gaps(10, &log(&[12, 13, 16]), 2), vec![14, 15]);
        assert_eq!(note_gaps(10, &log(&[12]), 0), Vec::<i64>::new());
        // A huge gap (a rolled-back million-row insert) is not walked id by id.
        let out = note_gaps(0, &log(&[5_000_000_001]), 256);
        assert_eq!(out.len(), 256);
        assert_eq!(*out.last().unwrap(), 5_000_000_000);
    }
}
