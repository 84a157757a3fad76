//! `nexuscrm-worker-test`: the conformance kit for `nexuscrm-worker` work families.
//!
//! Every durable-critical family proves itself with this kit, against its real store:
//!
//! - [`CrashMatrix`] ([`matrix`]): for every required [`CrashPoint`], one store fixture, two
//!   distinct workers built by the family's `new_worker` with that exact fixture, the first
//!   driven into an injected crash (its tasks then killed), the second restarted and drained, and
//!   the family's recovery assertion run on the same fixture. Each phase has a deadline that holds
//!   even when a callback hangs or blocks a thread. Cells are labelled `family/backend/point`
//!   and filtered by `NEXUSCRM_CRASH_FILTER`; a filter that selects nothing fails.
//! - [`scenarios`]: conformance scenarios any adapter runs once per dialect
//!   ([`scenarios::run_all`]): readiness, cancellation of every Source operation, wake
//!   coalescing, exact-due scheduling, capacity and continuation, attempt error and panic
//!   shutdown, graceful drain, shutdown-timeout fail-stop, generation change and loss, snapshot
//!   accounting.
//! - [`harness`]: the proof shapes for `derived-reconcilable / convergent`
//!   ([`harness::ConvergenceHarness`]: a fresh worker converges after a crash at any point) and
//!   `best-effort / loss-tolerant` ([`harness::LossHarness`]: every loss counted and reported,
//!   never a claim of completeness after one).
//! - [`ScriptedSource`] ([`scripted`]): a scripted, recording Source for controller tests on a
//!   paused clock, with [`assert_calls!`] for exact call budgets and [`PausedClock`].
//! - [`memory`]: a complete reference family (in-memory store, real controller, faults at every
//!   boundary) showing how a family writes `new_worker`, the crash callback, restart and the
//!   recovery assertion.
//! - [`CrashPoint`], [`Faults`], [`Crash`]: re-exported from `nexuscrm_worker::fault`, so
//!   production code threads the hook without depending on this crate.
//!
//! # Example
//!
//! ```no_run
//! use nexuscrm_worker_test::{CrashMatrix, memory::MemoryFamily};
//!
//! // In a plain `#[test]` (the matrix runs each cell on its own runtime):
//! let report = CrashMatrix::new(MemoryFamily::default()).run();
//! println!("{report}");
//! report.assert_passed();
//! ```
//!
//! # What passing proves
//!
//! The matrix proves the *sequence*: the lifecycle objects were really created and handed over,
//! each boundary really crashed, a fresh worker restarted on the same store, and the family's
//! assertion ran on it. The matrix cannot see what the callbacks did with them; the family's own
//! recovery assertion, reading persisted state (rows applied exactly once, no acknowledged job
//! lost), is what proves durability. Likewise the scenarios prove process-local protocol
//! behaviour against the adapter; they do not prove database atomicity or cross-process claim
//! uniqueness, which need the family's store tests.

#![forbid(unsafe_code)]

pub mod clock;
pub mod harness;
pub mod matrix;
pub mod memory;
pub mod scenarios;
pub mod scripted;

pub use clock::{ManualClock, PausedClock};
pub use matrix::{Cell, CrashContext, CrashFamily, CrashMatrix, Deadlines, Phase, Report};
pub use nexuscrm_worker::fault::{Crash, CrashPoint, Faults};
pub use scripted::{
    AttemptPlan, Call, ClaimPlan, Due, GenEvent, OnCancel, Op, ScriptedAttempt, ScriptedSource,
    Step,
};

/// Asserts exact Source-call budgets on a [`ScriptedSource`]:
/// `assert_calls!(source, claim = 3, next_work_at = 1, reconcile = 0)`.
///
/// Names are the Source method names: `check_ready`, `generation`, `generation_changed`,
/// `reconcile`, `claim`, `next_work_at`, and `handoff` (granted successor handoffs).
#[macro_export]
macro_rules! assert_calls {
    ($source:expr, $($op:ident = $n:expr),+ $(,)?) => {{
        let source = &$source;
        $(
            let op = $crate::Op::from_name(stringify!($op))
                .unwrap_or_else(|| panic!("unknown Source operation `{}`", stringify!($op)));
            assert_eq!(
                source.count(op),
                $n,
                "`{}` calls; all calls: {:?}",
                stringify!($op),
                source.calls()
            );
        )+
    }};
}
