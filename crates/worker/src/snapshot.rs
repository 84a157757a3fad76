//! Process-level observations of one controller.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

/// Upper bounds (inclusive) of the claim latency buckets; a last, unbounded bucket follows.
pub const CLAIM_LATENCY_BOUNDS: [Duration; 8] = [
    Duration::from_millis(1),
    Duration::from_millis(2),
    Duration::from_millis(5),
    Duration::from_millis(10),
    Duration::from_millis(25),
    Duration::from_millis(100),
    Duration::from_millis(500),
    Duration::from_secs(2),
];

/// Claim round-trip latencies: a small fixed-bucket histogram with sum and maximum, measured on
/// tokio's clock from the moment a claim is issued until its answer (success or error) arrives.
///
/// `buckets[i]` counts claims with latency `<= CLAIM_LATENCY_BOUNDS[i]` and above the previous
/// bound; `buckets[8]` counts the slower ones. [`cumulative`](ClaimLatency::cumulative) gives
/// Prometheus-style `le` counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimLatency {
    /// Per-bucket counts (not cumulative); the last bucket is unbounded.
    pub buckets: [u64; CLAIM_LATENCY_BOUNDS.len() + 1],
    /// Sum of all latencies.
    pub sum: Duration,
    /// The slowest claim.
    pub max: Duration,
}

impl ClaimLatency {
    /// Claims measured.
    #[must_use]
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// Cumulative counts per bound (`le`), the last one being `+Inf` (= [`count`](Self::count)).
    #[must_use]
    pub fn cumulative(&self) -> [u64; CLAIM_LATENCY_BOUNDS.len() + 1] {
        let mut out = self.buckets;
        for i in 1..out.len() {
            out[i] += out[i - 1];
        }
        out
    }

    /// Mean latency, if any claim was measured.
    #[must_use]
    pub fn mean(&self) -> Option<Duration> {
        let n = self.count();
        (n > 0).then(|| self.sum / u32::try_from(n).unwrap_or(u32::MAX))
    }
}

/// The unit of a [`Histogram`]'s bounds and sum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum HistogramUnit {
    /// Nanoseconds (exported in seconds).
    #[default]
    Nanoseconds,
    /// A count of items.
    Items,
}

/// Upper bounds (inclusive) of the claim batch-size buckets, in attempts; a last, unbounded
/// bucket follows.
pub const CLAIM_BATCH_BOUNDS: [u64; 9] = [0, 1, 2, 4, 8, 16, 32, 64, 256];

/// Upper bounds (inclusive) of the attempt-duration buckets, in nanoseconds; a last, unbounded
/// bucket follows.
pub const ATTEMPT_DURATION_BOUNDS: [u64; 10] = [
    1_000_000,
    5_000_000,
    10_000_000,
    25_000_000,
    100_000_000,
    500_000_000,
    1_000_000_000,
    5_000_000_000,
    30_000_000_000,
    120_000_000_000,
];

/// Upper bounds (inclusive) of the due-lateness buckets, in nanoseconds; a last, unbounded
/// bucket follows.
pub const DUE_LATENESS_BOUNDS: [u64; 9] = [
    100_000,
    1_000_000,
    2_000_000,
    5_000_000,
    10_000_000,
    25_000_000,
    100_000_000,
    500_000_000,
    2_000_000_000,
];

/// A fixed-bucket histogram's reading, for metrics exporters.
///
/// `buckets[i]` counts observations `<= bounds[i]` and above the previous bound;
/// `buckets[bounds.len()]` counts the larger ones.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Histogram {
    /// Upper bounds (inclusive), ascending, in [`unit`](Self::unit).
    pub bounds: &'static [u64],
    /// Per-bucket counts (not cumulative), `bounds.len() + 1` of them.
    pub buckets: Vec<u64>,
    /// Sum of all observations, in [`unit`](Self::unit).
    pub sum: u64,
    /// The unit of the bounds and the sum.
    pub unit: HistogramUnit,
}

impl Histogram {
    /// Observations recorded.
    #[must_use]
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// `v` (in [`unit`](Self::unit)) in the unit an exporter shows: seconds for durations.
    #[must_use]
    pub fn scaled(&self, v: u64) -> f64 {
        match self.unit {
            HistogramUnit::Nanoseconds => v as f64 / 1e9,
            HistogramUnit::Items => v as f64,
        }
    }
}

/// The most buckets an [`AtomicHistogram`] holds (bounds plus the unbounded one).
const MAX_BUCKETS: usize = 16;

/// Which bounds a histogram uses.
pub(crate) trait Bounds {
    const BOUNDS: &'static [u64];
    const UNIT: HistogramUnit;
}

#[derive(Debug)]
pub(crate) struct ClaimBatch;
impl Bounds for ClaimBatch {
    const BOUNDS: &'static [u64] = &CLAIM_BATCH_BOUNDS;
    const UNIT: HistogramUnit = HistogramUnit::Items;
}

#[derive(Debug)]
pub(crate) struct AttemptDuration;
impl Bounds for AttemptDuration {
    const BOUNDS: &'static [u64] = &ATTEMPT_DURATION_BOUNDS;
    const UNIT: HistogramUnit = HistogramUnit::Nanoseconds;
}

#[derive(Debug)]
pub(crate) struct DueLateness;
impl Bounds for DueLateness {
    const BOUNDS: &'static [u64] = &DUE_LATENESS_BOUNDS;
    const UNIT: HistogramUnit = HistogramUnit::Nanoseconds;
}

/// A lock-free fixed-bucket histogram: one relaxed increment and one add per observation.
#[derive(Debug)]
pub(crate) struct AtomicHistogram<B> {
    buckets: [AtomicU64; MAX_BUCKETS],
    sum: AtomicU64,
    _bounds: std::marker::PhantomData<B>,
}

impl<B: Bounds> Default for AtomicHistogram<B> {
    fn default() -> Self {
        const { assert!(B::BOUNDS.len() < MAX_BUCKETS) };
        AtomicHistogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum: AtomicU64::new(0),
            _bounds: std::marker::PhantomData,
        }
    }
}

impl<B: Bounds> AtomicHistogram<B> {
    pub(crate) fn record(&self, v: u64) {
        let i = B::BOUNDS
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(B::BOUNDS.len());
        bump(&self.buckets[i]);
        self.sum.fetch_add(v, Relaxed);
    }

    pub(crate) fn record_duration(&self, d: Duration) {
        self.record(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    pub(crate) fn read(&self) -> Histogram {
        Histogram {
            bounds: B::BOUNDS,
            buckets: self.buckets[..=B::BOUNDS.len()]
                .iter()
                .map(|c| c.load(Relaxed))
                .collect(),
            sum: self.sum.load(Relaxed),
            unit: B::UNIT,
        }
    }
}

/// Why a reconciliation ran. Requests that arrive together coalesce into one reconciliation,
/// counted once under the first cause in this order: startup, requested, generation change,
/// generation loss, backstop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReconcileCause {
    /// The startup reconciliation before Ready.
    Startup,
    /// [`ControllerHandle::request_reconcile`](crate::ControllerHandle::request_reconcile).
    Requested,
    /// The generation probe saw a changed cursor.
    GenerationChange,
    /// The generation probe failed (a lost change signal).
    GenerationLoss,
    /// The periodic liveness backstop.
    Backstop,
}

/// Reconciliations counted by cause.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReconcileCounts {
    /// Startup reconciliations (one per run that got that far).
    pub startup: u64,
    /// Explicitly requested.
    pub requested: u64,
    /// Caused by a generation change.
    pub generation_change: u64,
    /// Caused by a generation probe loss.
    pub generation_loss: u64,
    /// Caused by the periodic backstop.
    pub backstop: u64,
}

impl ReconcileCounts {
    /// All reconciliation calls.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.startup
            + self.requested
            + self.generation_change
            + self.generation_loss
            + self.backstop
    }
}

/// A point-in-time copy of a controller's counters; cheap, lock-free reads.
///
/// It is the only process-level observation. Queue depth, age, poison and uncertain counts are
/// domain observations and come from each family's store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Snapshot {
    /// Controller name.
    pub name: String,
    /// Calls of `run` (including ones that failed at `check_ready`).
    pub runs: u64,
    /// Whether the current run has reported Ready and has not stopped.
    pub ready: bool,
    /// Configured capacity.
    pub capacity: usize,
    /// Attempts executing now.
    pub in_flight: usize,
    /// `check_ready` calls.
    pub check_ready_calls: u64,
    /// `claim` calls.
    pub claim_calls: u64,
    /// Slots asked for, summed over every `claim` call (the capacity argument). With
    /// `attempts_claimed` and `claim_calls` this gives the mean batch asked and returned.
    pub claim_capacity_asked: u64,
    /// Successful claims that returned no attempt.
    pub claims_empty: u64,
    /// Successful claims that filled every slot asked for.
    pub claims_full: u64,
    /// Claim round-trip latencies.
    pub claim_latency: ClaimLatency,
    /// Attempts returned per successful claim.
    pub claim_batch: Histogram,
    /// How long attempts ran, from spawn until they returned or panicked.
    pub attempt_duration: Histogram,
    /// How late a claim driven by an exact due timer was issued after the due time (timer and
    /// scheduling delay, plus any claim cooldown): the controller's share of due lateness.
    pub due_lateness: Histogram,
    /// Attempts returned by `claim`.
    pub attempts_claimed: u64,
    /// Begun successor handoffs answered ([`Config::successor_handoff`](crate::Config::successor_handoff)).
    pub handoffs: u64,
    /// Begun handoffs answered with an empty terminal batch (the queue ran dry).
    pub handoffs_empty: u64,
    /// Begun handoffs answered with [`Handoff::none`](crate::Handoff::none): no successor and
    /// no answer about the queue; the freed slot is refilled by a claim.
    pub handoffs_declined: u64,
    /// Successor attempts claimed by handoffs (not counted in `attempts_claimed`).
    pub attempts_handed: u64,
    /// Attempts that returned (`Ok`, `Err` or panic).
    pub attempts_completed: u64,
    /// Attempts that returned `Err` or panicked.
    pub attempts_failed: u64,
    /// `next_work_at` calls.
    pub next_work_at_calls: u64,
    /// `next_work_at` errors (recorded, never poisoning).
    pub next_work_at_errors: u64,
    /// Reconciliations by cause.
    pub reconciles: ReconcileCounts,
    /// Wakes received through [`Waker::wake`](crate::Waker::wake).
    pub wakes_received: u64,
    /// Wakes absorbed by a wake or claim turn that was already pending.
    pub wakes_coalesced: u64,
    /// Exact due timers armed (an armed timer replaced by a newer answer counts again).
    pub timers_armed: u64,
    /// Due timers that fired and offered a claim turn.
    pub timers_fired: u64,
    /// Already-due `next_work_at` answers that were deliberately not armed.
    pub overdue_suppressed: u64,
    /// `next_work_at` answers due after the latest claim began (work that fell due during or
    /// after that claim): claimed again at once.
    pub due_during_claim: u64,
    /// [`Waker::retime`](crate::Waker::retime) calls received.
    pub retimes_received: u64,
    /// Generation probe calls (`generation` and `generation_changed`).
    pub generation_probes: u64,
    /// Changed generation cursors observed.
    pub generation_changes: u64,
    /// Probe returns with an unchanged cursor (no other Source call follows).
    pub generation_spurious: u64,
    /// Generation probe errors.
    pub generation_losses: u64,
    /// Why the controller was poisoned, once it is. A poisoned controller never runs again.
    pub poisoned: Option<String>,
    /// When the last claim returned (wall clock), `None` before the first: an operator's "is it
    /// claiming at all" (the idle controller's last claim may be long ago, by design).
    pub last_claim_at: Option<std::time::SystemTime>,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) runs: AtomicU64,
    pub(crate) ready: AtomicBool,
    pub(crate) in_flight: AtomicUsize,
    pub(crate) check_ready_calls: AtomicU64,
    pub(crate) claim_calls: AtomicU64,
    pub(crate) claim_capacity_asked: AtomicU64,
    pub(crate) claims_empty: AtomicU64,
    pub(crate) claims_full: AtomicU64,
    pub(crate) claim_latency_buckets: [AtomicU64; CLAIM_LATENCY_BOUNDS.len() + 1],
    pub(crate) claim_latency_sum_ns: AtomicU64,
    pub(crate) claim_latency_max_ns: AtomicU64,
    pub(crate) claim_batch: AtomicHistogram<ClaimBatch>,
    pub(crate) attempt_duration: AtomicHistogram<AttemptDuration>,
    pub(crate) due_lateness: AtomicHistogram<DueLateness>,
    pub(crate) attempts_claimed: AtomicU64,
    pub(crate) handoffs: AtomicU64,
    pub(crate) handoffs_empty: AtomicU64,
    pub(crate) handoffs_declined: AtomicU64,
    pub(crate) attempts_handed: AtomicU64,
    pub(crate) attempts_completed: AtomicU64,
    pub(crate) attempts_failed: AtomicU64,
    pub(crate) next_work_at_calls: AtomicU64,
    pub(crate) next_work_at_errors: AtomicU64,
    pub(crate) reconcile_startup: AtomicU64,
    pub(crate) reconcile_requested: AtomicU64,
    pub(crate) reconcile_generation_change: AtomicU64,
    pub(crate) reconcile_generation_loss: AtomicU64,
    pub(crate) reconcile_backstop: AtomicU64,
    pub(crate) wakes_received: AtomicU64,
    pub(crate) wakes_coalesced: AtomicU64,
    pub(crate) timers_armed: AtomicU64,
    pub(crate) timers_fired: AtomicU64,
    pub(crate) overdue_suppressed: AtomicU64,
    pub(crate) due_during_claim: AtomicU64,
    pub(crate) retimes_received: AtomicU64,
    pub(crate) generation_probes: AtomicU64,
    pub(crate) generation_changes: AtomicU64,
    pub(crate) generation_spurious: AtomicU64,
    pub(crate) generation_losses: AtomicU64,
    pub(crate) poisoned: OnceLock<String>,
    /// Wall-clock milliseconds since the Unix epoch of the last claim's return; 0 before one.
    pub(crate) last_claim_ms: AtomicU64,
}

pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Relaxed);
}

impl Counters {
    pub(crate) fn claim_latency(&self, latency: Duration) {
        let i = CLAIM_LATENCY_BOUNDS
            .iter()
            .position(|b| latency <= *b)
            .unwrap_or(CLAIM_LATENCY_BOUNDS.len());
        bump(&self.claim_latency_buckets[i]);
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.claim_latency_sum_ns.fetch_add(ns, Relaxed);
        self.claim_latency_max_ns.fetch_max(ns, Relaxed);
    }

    /// Records that a claim returned now (wall clock).
    pub(crate) fn claimed_now(&self) {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        self.last_claim_ms.store(ms.max(1), Relaxed);
    }

    pub(crate) fn reconcile(&self, cause: ReconcileCause) {
        bump(match cause {
            ReconcileCause::Startup => &self.reconcile_startup,
            ReconcileCause::Requested => &self.reconcile_requested,
            ReconcileCause::GenerationChange => &self.reconcile_generation_change,
            ReconcileCause::GenerationLoss => &self.reconcile_generation_loss,
            ReconcileCause::Backstop => &self.reconcile_backstop,
        });
    }

    pub(crate) fn snapshot(&self, name: &str, capacity: usize) -> Snapshot {
        let l = |c: &AtomicU64| c.load(Relaxed);
        Snapshot {
            name: name.to_owned(),
            runs: l(&self.runs),
            ready: self.ready.load(Relaxed),
            capacity,
            in_flight: self.in_flight.load(Relaxed),
            check_ready_calls: l(&self.check_ready_calls),
            claim_calls: l(&self.claim_calls),
            claim_capacity_asked: l(&self.claim_capacity_asked),
            claims_empty: l(&self.claims_empty),
            claims_full: l(&self.claims_full),
            claim_latency: ClaimLatency {
                buckets: std::array::from_fn(|i| l(&self.claim_latency_buckets[i])),
                sum: Duration::from_nanos(l(&self.claim_latency_sum_ns)),
                max: Duration::from_nanos(l(&self.claim_latency_max_ns)),
            },
            claim_batch: self.claim_batch.read(),
            attempt_duration: self.attempt_duration.read(),
            due_lateness: self.due_lateness.read(),
            attempts_claimed: l(&self.attempts_claimed),
            handoffs: l(&self.handoffs),
            handoffs_empty: l(&self.handoffs_empty),
            handoffs_declined: l(&self.handoffs_declined),
            attempts_handed: l(&self.attempts_handed),
            attempts_completed: l(&self.attempts_completed),
            attempts_failed: l(&self.attempts_failed),
            next_work_at_calls: l(&self.next_work_at_calls),
            next_work_at_errors: l(&self.next_work_at_errors),
            reconciles: ReconcileCounts {
                startup: l(&self.reconcile_startup),
                requested: l(&self.reconcile_requested),
                generation_change: l(&self.reconcile_generation_change),
                generation_loss: l(&self.reconcile_generation_loss),
                backstop: l(&self.reconcile_backstop),
            },
            wakes_received: l(&self.wakes_received),
            wakes_coalesced: l(&self.wakes_coalesced),
            timers_armed: l(&self.timers_armed),
            timers_fired: l(&self.timers_fired),
            overdue_suppressed: l(&self.overdue_suppressed),
            due_during_claim: l(&self.due_during_claim),
            retimes_received: l(&self.retimes_received),
            generation_probes: l(&self.generation_probes),
            generation_changes: l(&self.generation_changes),
            generation_spurious: l(&self.generation_spurious),
            generation_losses: l(&self.generation_losses),
            poisoned: self.poisoned.get().cloned(),
            last_claim_at: match l(&self.last_claim_ms) {
                0 => None,
                ms => Some(std::time::UNIX_EPOCH + Duration::from_millis(ms)),
            },
        }
    }
}
