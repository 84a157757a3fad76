//! `nexuscrm-worker`: the worker lifecycle controller.
//!
//! A [`Controller`] drives one domain-owned [`Source`] without ever polling an empty queue. Work
//! is found through exact due timers ([`Source::next_work_at`]), coalesced process-local wakes
//! ([`Waker`]), generation changes ([`Source::generation_changed`]) and a low-frequency
//! reconciliation backstop ([`Config::reconcile_interval`]). Ambiguous failures stop the process
//! (fail-stop): the controller is poisoned and can never run again.
//!
//! The main types:
//!
//! - [`Source`]: check_ready, reconcile, claim(capacity), next_work_at, optional generation probe.
//!   The domain store owns every durable fact.
//! - [`ClaimBatch`] ([`ClaimBatch::more`] / [`ClaimBatch::done`]) and [`Attempt`]: one
//!   already-claimed heartbeat/effect/disposition lifecycle; [`Handoff`] lets a disposition
//!   claim its successor ([`Config::successor_handoff`]).
//! - [`SourceError`] (outcome unknown by default, [`SourceError::not_committed`] only when proven)
//!   and [`AttemptError`] (always process-fatal).
//! - [`Controller`], [`Config`], [`ControllerHandle`], [`Snapshot`], [`RunError`].
//! - [`Declaration`]: what an acknowledgement promises ([`Durability`] × [`Effect`]).
//! - [`fault`]: the crash-point vocabulary and the zero-cost [`fault::Faults`] hook.
//! - [`bridge`]: drive wakes, retimes and reconcile requests from any cross-process channel
//!   (your own `PgListener`, a bus) without this crate depending on a database client.
//!
//! # Example
//!
//! A small in-memory source: a queue of numbers, each due at a time; each attempt adds its number
//! to a total. Eligibility is decided on the controller's clock (`Config::clock`), which the
//! source shares, so a timer-fired claim and the claim's own "now" agree (a database source binds
//! that same "now" into its SQL: see [`Source`]).
//!
//! ```
//! use std::collections::BTreeMap;
//! use std::num::NonZeroUsize;
//! use std::sync::{Arc, Mutex};
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use std::time::{Duration, SystemTime};
//! // The crate alone is enough: CancellationToken is re-exported.
//! use nexuscrm_worker::{
//!     Attempt, AttemptError, CancellationToken, ClaimBatch, Clock, Config, Controller, Source,
//!     SourceError, SystemClock,
//! };
//!
//! struct Queue {
//!     clock: Arc<dyn Clock>,
//!     items: Mutex<BTreeMap<(SystemTime, u64), ()>>, // (due, number)
//!     total: Arc<AtomicU64>,
//! }
//!
//! struct Add { n: u64, total: Arc<AtomicU64> }
//!
//! impl Attempt for Add {
//!     async fn run(self, _cancel: CancellationToken) -> Result<(), AttemptError> {
//!         self.total.fetch_add(self.n, Ordering::SeqCst); // "effect + disposition"
//!         Ok(())
//!     }
//! }
//!
//! impl Source for Queue {
//!     type Attempt = Add;
//!     // Nothing external to check, nothing derived to rebuild: both may be no-ops (see Source).
//!     async fn check_ready(&self, _: CancellationToken) -> Result<(), SourceError> { Ok(()) }
//!     async fn reconcile(&self, _: CancellationToken) -> Result<(), SourceError> { Ok(()) }
//!     async fn claim(&self, capacity: NonZeroUsize, _: CancellationToken)
//!         -> Result<ClaimBatch<Add>, SourceError>
//!     {
//!         let now = self.clock.now(); // the controller's clock, as SQL would bind it
//!         let mut q = self.items.lock().unwrap();
//!         let due: Vec<_> = q.keys().take_while(|(at, _)| *at <= now)
//!             .take(capacity.get()).copied().collect();
//!         let batch: Vec<Add> = due.iter()
//!             .map(|k| { q.remove(k); Add { n: k.1, total: self.total.clone() } })
//!             .collect();
//!         let more = q.keys().next().is_some_and(|(at, _)| *at <= now);
//!         Ok(if more { ClaimBatch::more(batch) } else { ClaimBatch::done(batch) })
//!     }
//!     async fn next_work_at(&self, _: CancellationToken)
//!         -> Result<Option<SystemTime>, SourceError>
//!     {
//!         Ok(self.items.lock().unwrap().keys().next().map(|(at, _)| *at))
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let clock: Arc<dyn Clock> = Arc::new(SystemClock);
//! let queue = Arc::new(Queue {
//!     clock: clock.clone(),
//!     items: Mutex::default(),
//!     total: Arc::default(),
//! });
//! let config = Config::new("adder").clock(clock.clone());
//! let controller = Controller::from_arc(queue.clone(), config).unwrap();
//! let handle = controller.handle();
//! let cancel = CancellationToken::new();
//! let running = tokio::spawn(controller.run(cancel.clone()));
//! assert!(handle.ready().await);
//!
//! // A producer commits work that is due now, then wakes the controller.
//! let now = clock.now();
//! queue.items.lock().unwrap().extend((1..=10).map(|n| ((now, n), ())));
//! handle.waker().wake();
//! while queue.total.load(Ordering::SeqCst) < 55 {
//!     tokio::time::sleep(Duration::from_millis(1)).await;
//! }
//!
//! cancel.cancel();
//! let controller = running.await.unwrap().expect("clean drain hands the controller back");
//! let snap = controller.handle().snapshot();
//! assert_eq!(snap.attempts_completed, 10);
//! assert_eq!(snap.poisoned, None);
//! # }
//! ```
//!
//! # Contract surfaces
//!
//! | Contract surface | Rust item | Owned by the controller | What it does not prove |
//! |---|---|---|---|
//! | `CheckReady` | [`Source::check_ready`] | Read-only startup gate; an error ends `run` without poisoning | Store durability or schema correctness |
//! | generation probe | [`Source::generation`], [`Source::generation_changed`] | Read-only change hint; a changed cursor requests reconciliation | Work existence, ordering, or ownership |
//! | `Reconcile` | [`Source::reconcile`] | Serialized; startup, requested, generation, backstop | Safe replay after an error unless [`SourceError::not_committed`] |
//! | `Claim` | [`Source::claim`] | Sole immediate eligibility transition, at most the free capacity | Correct domain SQL, fairness, or cross-process uniqueness |
//! | `ClaimBatch.More` | [`ClaimBatch::more`] / [`ClaimBatch::done`] | Sole authority for an immediate bounded continuation | Future eligibility after a terminal batch |
//! | `NextWorkAt` | [`Source::next_work_at`] | One exact, strictly-future timer; overdue answers suppressed ([`Snapshot::overdue_suppressed`]) | Immediate work authority, or a reason to replay an empty claim |
//! | `Wake` | [`Waker::wake`] | Coalesced process-local claim hint | Durable work, reconciliation, or delivery |
//! | periodic reconciliation | [`Config::reconcile_interval`] | Bounded liveness backstop | A business-queue polling cadence |
//! | `Attempt.Run` | [`Attempt::run`] | Executes an already-claimed attempt; `Err`/panic is fatal | Replay safety after a non-`Ok` result |
//! | successor handoff (optional) | [`Attempt::run_handing_off`], [`Handoff`], [`Config::successor_handoff`] | A claim folded into a disposition, granted only under a standing continuation, for the one slot it frees; counted as a claim in flight | That the source's folded statement has the claim's eligibility and fence |
//!
//! Controller tests prove process-local ordering, capacity, fail-stop behaviour and Source-call
//! budgets. They cannot prove database atomicity, distributed claim uniqueness, durable recovery,
//! effect idempotency or deployed cost: each family's real store tests do that.

#![forbid(unsafe_code)]

/// Emits a tracing event when the `tracing` feature is on; expands to nothing otherwise.
macro_rules! log_event {
    ($level:ident, $($arg:tt)*) => {
        #[cfg(feature = "tracing")]
        {
            ::tracing::$level!($($arg)*);
        }
    };
}

/// `$fut` inside an info span `$name` with `$fields` when the `tracing` feature is on; `$fut`
/// itself otherwise (the fields are then never evaluated).
#[cfg(feature = "tracing")]
macro_rules! traced {
    ($fut:expr, $name:literal $(, $($fields:tt)*)?) => {
        ::tracing::Instrument::instrument($fut, ::tracing::info_span!($name $(, $($fields)*)?))
    };
}

#[cfg(not(feature = "tracing"))]
macro_rules! traced {
    ($fut:expr, $name:literal $(, $($fields:tt)*)?) => {
        $fut
    };
}

pub mod batch;
pub mod bridge;
mod classification;
mod clock;
mod config;
mod controller;
pub mod fault;
mod handoff;
mod snapshot;
mod source;

pub use classification::{Classification, Declaration, DeclarationError, Durability, Effect};
pub use clock::{Clock, SystemClock};
pub use config::{Config, ConfigError};
pub use controller::{
    Controller, ControllerHandle, PRECISE_TIMER_LEAD, RunError, RunErrorKind, Waker,
};
pub use handoff::{Handed, Handoff};
pub use snapshot::{
    ATTEMPT_DURATION_BOUNDS, CLAIM_BATCH_BOUNDS, CLAIM_LATENCY_BOUNDS, ClaimLatency,
    DUE_LATENESS_BOUNDS, Histogram, HistogramUnit, ReconcileCause, ReconcileCounts, Snapshot,
};
pub use source::{Attempt, AttemptError, BoxError, ClaimBatch, Generation, Source, SourceError};
/// Re-exported so that a `Source` written against this crate needs no direct `tokio-util`
/// dependency: every Source and Attempt method receives one.
pub use tokio_util::sync::CancellationToken;

#[allow(dead_code)]
fn assert_send<T: Send>(_: &T) {}

#[allow(dead_code)]
fn run_future_is_send<S: Source>(c: Controller<S>) {
    assert_send(&c.run(CancellationToken::new()));
}
