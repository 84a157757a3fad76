//! `nexuscrm-worker-test`: the conformance kit for `nexuscrm-worker` sources.
//!
//! - [`scripted`]: a scripted, recording [`Source`](nexuscrm_worker::Source) and
//!   [`assert_calls!`] for Source-call budgets.
//! - [`PausedClock`]: a wall clock driven by tokio's paused time.
//! - [`CrashPoint`] and [`Faults`]: the crash vocabulary, re-exported from
//!   `nexuscrm_worker::fault` so production code never depends on this crate.

#![forbid(unsafe_code)]

pub mod clock;
pub mod matrix;
pub mod memory;
pub mod scripted;

pub use clock::PausedClock;
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
/// `reconcile`, `claim`, `next_work_at`.
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
