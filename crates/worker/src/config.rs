//! Controller configuration, validated once by [`Controller::new`](crate::Controller::new).

use std::error::Error;
use std::fmt;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, SystemClock};

/// Controller settings. Private fields, `#[must_use]` builder methods, validated once.
///
/// ```
/// use std::{num::NonZeroUsize, time::Duration};
/// let config = nexuscrm_worker::Config::new("bulk")
///     .capacity(NonZeroUsize::new(8).unwrap())
///     .reconcile_interval(Duration::from_secs(600));
/// assert_eq!(config.get_capacity().get(), 8);
/// ```
#[derive(Clone)]
pub struct Config {
    pub(crate) name: String,
    pub(crate) capacity: NonZeroUsize,
    pub(crate) reconcile_interval: Duration,
    pub(crate) reconcile_jitter: Duration,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) generation_retry: Duration,
    pub(crate) claim_cooldown: Duration,
    pub(crate) claims_in_flight: NonZeroUsize,
    pub(crate) precise_timers: bool,
    pub(crate) successor_handoff: bool,
    pub(crate) clock: Arc<dyn Clock>,
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("name", &self.name)
            .field("capacity", &self.capacity)
            .field("reconcile_interval", &self.reconcile_interval)
            .field("reconcile_jitter", &self.reconcile_jitter)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .field("generation_retry", &self.generation_retry)
            .field("claim_cooldown", &self.claim_cooldown)
            .field("claims_in_flight", &self.claims_in_flight)
            .field("precise_timers", &self.precise_timers)
            .field("successor_handoff", &self.successor_handoff)
            .field("clock", &self.clock)
            .finish()
    }
}

impl Default for Config {
    fn default() -> Self {
        Config::new("worker")
    }
}

/// Longest accepted duration setting (one year); longer values are almost certainly unit errors.
const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

impl Config {
    /// Defaults for a controller named `name` (the name appears in errors, snapshots and logs).
    #[must_use]
    pub fn new(name: impl Into<String>) -> Self {
        Config {
            name: name.into(),
            capacity: NonZeroUsize::new(4).expect("4 is not zero"),
            reconcile_interval: Duration::from_secs(300),
            reconcile_jitter: Duration::from_secs(30),
            shutdown_timeout: Duration::from_secs(30),
            generation_retry: Duration::from_secs(1),
            claim_cooldown: Duration::ZERO,
            claims_in_flight: NonZeroUsize::MIN,
            precise_timers: false,
            successor_handoff: false,
            clock: Arc::new(SystemClock),
        }
    }

    /// Maximum attempts executing at once. By default 4.
    ///
    /// `claim` is never asked for more than the free slots, and never for zero.
    #[must_use]
    pub fn capacity(mut self, capacity: NonZeroUsize) -> Self {
        self.capacity = capacity;
        self
    }

    /// Period of the reconciliation backstop. By default 5 minutes.
    ///
    /// It is a liveness backstop for a lost wake, a bypassed producer or drift, not a polling
    /// cadence: every backstop costs one `reconcile`, one `claim` and one `next_work_at`. The
    /// period restarts after every reconciliation, whatever caused it. Must be at least 1 second.
    #[must_use]
    pub fn reconcile_interval(mut self, interval: Duration) -> Self {
        self.reconcile_interval = interval;
        self
    }

    /// Up to this much is subtracted at random from each backstop period, so that replicas
    /// started together do not reconcile in lock-step. By default 30 seconds; `Duration::ZERO`
    /// makes the backstop exact. Must be smaller than the interval.
    #[must_use]
    pub fn reconcile_jitter(mut self, jitter: Duration) -> Self {
        self.reconcile_jitter = jitter;
        self
    }

    /// How long cancellation waits for in-flight attempts and Source operations. By default 30
    /// seconds.
    ///
    /// Past it, `run` returns the in-flight count and the controller is poisoned: the abandoned
    /// work may still be executing, so the process supervisor must end the process before
    /// replacing the controller.
    #[must_use]
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// First delay before re-probing after a generation probe error; it doubles per consecutive
    /// error up to the reconcile interval. By default 1 second.
    #[must_use]
    pub fn generation_retry(mut self, delay: Duration) -> Self {
        self.generation_retry = delay;
        self
    }

    /// While attempts are in flight, a claim turn starts no sooner than this after the previous
    /// one began, so slots freed meanwhile are refilled by one claim instead of one claim each.
    /// By default zero (refill every freed slot at once). It never delays a claim when nothing
    /// is in flight (a due timer, a wake or start-up on an idle controller). At most 10 s.
    #[must_use]
    pub fn claim_cooldown(mut self, cooldown: Duration) -> Self {
        self.claim_cooldown = cooldown;
        self
    }

    /// How many claims may be in flight at once. By default 1: one claim turn at a time.
    ///
    /// With more, the controller keeps slots busy while a claim's round trip is under way:
    /// as long as the latest claim answer asked for continuation (`more`) and no terminal
    /// answer came since, a slot freed meanwhile is refilled by another claim without waiting
    /// for the one in flight. Capacity is reserved, never exceeded: attempts in flight plus
    /// the slots asked by outstanding claims are at most [`capacity`](Config::capacity), and a
    /// claim that comes back short returns its unused slots. A terminal answer ends the
    /// continuation at once (no new claim starts until a wake, a timer, a reconciliation or
    /// another `more`), and only the answer of the last outstanding claim asks `next_work_at`,
    /// so at the end of a burst at most `claims_in_flight - 1` claims come back empty, and an
    /// empty queue is never polled. A wake, timer or reconciliation cause never starts a claim
    /// beside one in flight. Reconciliation waits for outstanding claims. At most the capacity.
    #[must_use]
    pub fn claims_in_flight(mut self, claims: NonZeroUsize) -> Self {
        self.claims_in_flight = claims;
        self
    }

    /// Whether a due timer fires within microseconds of its time instead of within tokio's
    /// millisecond timer wheel. By default off.
    ///
    /// Tokio rounds a deadline up to its next millisecond tick and the driver's wait rounds
    /// again, so a due timer fires on average about 1 ms late (0 to 2 ms). With precise
    /// timers the controller arms the wheel [`PRECISE_TIMER_LEAD`](crate::PRECISE_TIMER_LEAD)
    /// early and waits out the rest with `std::thread::sleep` on tokio's blocking pool
    /// (`nanosleep`, tens of microseconds of slack): one blocking-pool hop of at most 2 ms per
    /// due timer, nothing per claim. Nothing else changes: the same timer fires at the same
    /// due time, never before it, and asks the same one claim, so every Source-call budget
    /// holds. The backstop and the cooldown stay on the wheel. For families whose items have a
    /// due time (Scheduled Flow). Under tokio's paused clock the last part runs on the paused
    /// wheel, so tests see the same times either way.
    #[must_use]
    pub fn precise_timers(mut self, precise: bool) -> Self {
        self.precise_timers = precise;
        self
    }

    /// Whether a finishing attempt may claim its successor in its own disposition
    /// ([`Attempt::run_handing_off`](crate::Attempt::run_handing_off)). By default off.
    ///
    /// The offer ([`Handoff`](crate::Handoff)) is granted only under a standing continuation
    /// (the latest claim answer was `more` and no terminal answer came since), with no
    /// reconciliation asked for and the run not stopping; the successor takes the slot its
    /// attempt frees, so attempts in flight never exceed the capacity. A begun handoff is a
    /// claim in flight: reconciliation waits for it, a terminal answer (from a claim or a
    /// handoff) closes the offer at once, and only the last outstanding answer reads
    /// `next_work_at`. On a busy queue of short jobs each slot then needs one round trip per
    /// item instead of a disposition plus a share of a claim. Sources whose attempts keep the
    /// default `run_handing_off` are unaffected.
    #[must_use]
    pub fn successor_handoff(mut self, on: bool) -> Self {
        self.successor_handoff = on;
        self
    }

    /// Whether [`successor_handoff`](Config::successor_handoff) is on.
    #[must_use]
    pub fn get_successor_handoff(&self) -> bool {
        self.successor_handoff
    }

    /// Whether [`precise_timers`](Config::precise_timers) is on.
    #[must_use]
    pub fn get_precise_timers(&self) -> bool {
        self.precise_timers
    }

    /// The wall clock used to convert `next_work_at` times into timers. By default the system
    /// clock; tests use a clock driven by tokio's paused time.
    #[must_use]
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The controller's name.
    #[must_use]
    pub fn get_name(&self) -> &str {
        &self.name
    }

    /// The configured capacity.
    #[must_use]
    pub fn get_capacity(&self) -> NonZeroUsize {
        self.capacity
    }

    /// The configured backstop period.
    #[must_use]
    pub fn get_reconcile_interval(&self) -> Duration {
        self.reconcile_interval
    }

    /// The configured wall clock.
    #[must_use]
    pub fn get_clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// The configured number of claims that may be in flight at once.
    #[must_use]
    pub fn get_claims_in_flight(&self) -> NonZeroUsize {
        self.claims_in_flight
    }

    /// The configured shutdown bound.
    #[must_use]
    pub fn get_shutdown_timeout(&self) -> Duration {
        self.shutdown_timeout
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let bad = |setting: &'static str, reason: String| Err(ConfigError { setting, reason });
        if self.name.is_empty() {
            return bad("name", "must not be empty".into());
        }
        if self.reconcile_interval < Duration::from_secs(1)
            || self.reconcile_interval > MAX_DURATION
        {
            return bad(
                "reconcile_interval",
                format!(
                    "{:?} is outside 1s..=365d (the backstop must not become a poll)",
                    self.reconcile_interval
                ),
            );
        }
        if self.reconcile_jitter >= self.reconcile_interval {
            return bad(
                "reconcile_jitter",
                format!(
                    "{:?} must be smaller than reconcile_interval {:?}",
                    self.reconcile_jitter, self.reconcile_interval
                ),
            );
        }
        if self.shutdown_timeout > MAX_DURATION {
            return bad(
                "shutdown_timeout",
                format!("{:?} is longer than a year", self.shutdown_timeout),
            );
        }
        if self.claim_cooldown > Duration::from_secs(10) {
            return bad(
                "claim_cooldown",
                format!("{:?} is longer than 10 s", self.claim_cooldown),
            );
        }
        if self.claims_in_flight > self.capacity {
            return bad(
                "claims_in_flight",
                format!(
                    "{} is more than the capacity {} (each claim asks for at least one slot)",
                    self.claims_in_flight, self.capacity
                ),
            );
        }
        if self.generation_retry.is_zero() || self.generation_retry > MAX_DURATION {
            return bad(
                "generation_retry",
                format!("{:?} is outside (0, 365d]", self.generation_retry),
            );
        }
        Ok(())
    }
}

/// A rejected [`Config`]: names the setting and says why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    setting: &'static str,
    reason: String,
}

impl ConfigError {
    /// The setting that was rejected.
    #[must_use]
    pub fn setting(&self) -> &'static str {
        self.setting
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid controller setting `{}`: {}",
            self.setting, self.reason
        )
    }
}

impl Error for ConfigError {}
