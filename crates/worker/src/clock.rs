//! The wall clock the controller reads to convert domain due times into timer deadlines.

use std::fmt;
use std::time::SystemTime;

/// A source of wall-clock "now".
///
/// Domain due times ([`Source::next_work_at`](crate::Source::next_work_at)) are wall-clock; the
/// controller's timers run on [`tokio::time::Instant`]. The controller converts between them at
/// the boundary by reading this clock, so tests can drive both from tokio's paused time (the
/// test kit ships such a clock).
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current wall-clock time.
    fn now(&self) -> SystemTime;
}

/// The operating system's clock ([`SystemTime::now`]); the default.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}
