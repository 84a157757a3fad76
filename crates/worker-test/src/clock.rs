//! A wall clock driven by tokio's (paused) time.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nexuscrm_worker::Clock;
use tokio::time::Instant;

/// A [`Clock`] whose "now" is a fixed wall-clock base plus the tokio time elapsed since it was
/// created. Under `#[tokio::test(start_paused = true)]` domain due times and controller timers
/// then agree exactly.
#[derive(Debug, Clone, Copy)]
pub struct PausedClock {
    base: SystemTime,
    start: Instant,
}

impl PausedClock {
    /// A clock starting at 2026-01-01T00:00:00Z, now. Must be created inside a tokio runtime.
    #[must_use]
    pub fn new() -> Self {
        PausedClock::starting_at(UNIX_EPOCH + Duration::from_secs(1_767_225_600))
    }

    /// A clock whose current time is `base`.
    #[must_use]
    pub fn starting_at(base: SystemTime) -> Self {
        PausedClock {
            base,
            start: Instant::now(),
        }
    }
}

impl Default for PausedClock {
    fn default() -> Self {
        PausedClock::new()
    }
}

impl Clock for PausedClock {
    fn now(&self) -> SystemTime {
        self.base + (Instant::now() - self.start)
    }
}

/// A wall clock the test sets by hand (for store tests on real time, where a paused tokio clock
/// does not apply): "now" changes only when [`set`](ManualClock::set) or
/// [`advance`](ManualClock::advance) is called.
#[derive(Debug)]
pub struct ManualClock(std::sync::Mutex<SystemTime>);

impl ManualClock {
    /// A shared clock whose current time is `t`.
    #[must_use]
    pub fn at(t: SystemTime) -> std::sync::Arc<ManualClock> {
        std::sync::Arc::new(ManualClock(std::sync::Mutex::new(t)))
    }

    /// Sets "now".
    pub fn set(&self, t: SystemTime) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = t;
    }

    /// Moves "now" forward by `d`.
    pub fn advance(&self, d: Duration) {
        let mut now = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *now += d;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> SystemTime {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}
