//! `nexuscrm-bulk`: the Bulk work family (`durable-critical` / `transactional`).
//!
//! A bulk job applies a set of record changes to `crm_record` in segments. Each applied row bumps
//! the record's `revision` and appends a `crm_record_change` row, so a double application is
//! visible in the database rather than hidden by an idempotent upsert.
//!
//! - [`Bulk`]: the family over one [`Db`](nexuscrm_persistence::Db) for one deployment
//!   generation: the producer ([`Bulk::submit`], one transaction, acknowledged after commit,
//!   idempotent by key), status, list and [`Observations`].
//! - [`BulkSource`]: the controller's [`Source`](nexuscrm_worker::Source). Claims are fenced
//!   by the ownership authority and write a fresh claim token and lease; `next_work_at` is the
//!   earliest `run_at` of a pending job or lease expiry of a running one, so a crashed worker's
//!   job is rescued exactly when its lease ends; reconciliation releases jobs leased by older
//!   generations.
//! - [`BulkAttempt`]: segments, each committing its record writes and the job's cursor in one
//!   transaction that checks the claim token and the fence; heartbeats between segments;
//!   transient errors release with exponential backoff; the last attempt poisons with its reason.
//!
//! See the crate README for the schema, the state machine, and the SQL per backend.

#![forbid(unsafe_code)]

/// The records domain's read path (re-exported: Bulk writes the records it reads).
pub use nexuscrm_records as records;
mod source;
mod store;

use nexuscrm_worker::{Declaration, Durability, Effect};

pub use source::{BulkAttempt, BulkSource};
pub use store::{
    Bulk, BulkConfig, BulkError, BulkErrorKind, BulkOptions, CHANNEL, JobId, JobStatus, MAX_ROWS,
    MAX_SEGMENT_SIZE, MIGRATIONS, NewJob, Observations, RowError, RowInput, SegmentCommitted,
    Submitted,
};

/// The text of one of the family's named statements for `dialect` (from
/// `sql/<dialect>/queries.sql`), for tools that explain or measure it.
///
/// # Panics
///
/// If `name` is not a statement of the family.
#[must_use]
pub fn statement(dialect: nexuscrm_persistence::Dialect, name: &str) -> &'static str {
    store::queries(dialect).get(name)
}

/// The family name used for ownership and migrations.
pub const FAMILY: &str = "bulk";

/// The Bulk declaration: accepted jobs survive crashes; effect and disposition commit together.
pub const DECLARATION: Declaration =
    Declaration::new_const(FAMILY, Durability::DurableCritical, Effect::Transactional);
