//! `nexuscrm-flow`: the Scheduled Flow work family (`durable-critical` / `transactional`).
//!
//! A schedule belongs to a flow and has a [`Spec`] (cron with seconds in an IANA zone, or a
//! fixed interval), a [`MisfirePolicy`], an enabled/paused state, a version, and its occurrence
//! cursor `next_occurrence_at`.
//!
//! - [`Flow`]: the family over one [`Db`](nexuscrm_persistence::Db) for one deployment
//!   generation: the producer API ([`Flow::create`], [`Flow::update`], [`Flow::pause`],
//!   [`Flow::resume`], [`Flow::delete`]: each one transaction, acknowledged after commit),
//!   reads, and [`Observations`].
//! - [`FlowSource`]: the controller's [`Source`](nexuscrm_worker::Source). A claim leases due
//!   schedules (`next_occurrence_at <= now`, enabled) with a fresh claim token, bounded by the
//!   `(state, next_occurrence_at)` index; `next_work_at` is the earliest cursor of an enabled
//!   schedule or the earliest lease expiry, so the controller sleeps exactly until the next
//!   occurrence.
//! - [`FlowAttempt`]: the reservation. One transaction checks the claim token, the schedule
//!   version and the ownership fence, inserts a `flow_run` row per occurrence the policy runs
//!   (unique on schedule and occurrence), and advances the cursor. A producer update bumps the
//!   version, so a reservation made under the old spec is rejected and the new spec governs.
//!
//! See the crate README for the schema, the state machine, the SQL per backend and the proofs.

#![forbid(unsafe_code)]

mod source;
pub mod spec;
mod store;

use nexuscrm_worker::{Declaration, Durability, Effect};

pub use source::{FlowAttempt, FlowSource};
pub use spec::{MisfirePolicy, Spec};
pub use store::{
    CHANNEL, Created, Flow, FlowConfig, FlowError, FlowErrorKind, FlowOptions, FlowRun, MIGRATIONS,
    NewSchedule, Observations, RunsReserved, ScheduleId, ScheduleStatus, ScheduleUpdate,
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
pub const FAMILY: &str = "flow";

/// The Scheduled Flow declaration: accepted schedules and their reserved runs survive crashes;
/// runs and the cursor commit together.
pub const DECLARATION: Declaration =
    Declaration::new_const(FAMILY, Durability::DurableCritical, Effect::Transactional);
