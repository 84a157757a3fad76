//! Fault vocabulary: crash points and the [`Faults`] hook that production code calls at each
//! durable boundary.
//!
//! Production code calls [`Faults::hit`] at every boundary of its real producer, store, claim,
//! effect, heartbeat, disposition and ownership paths. The default hook is unarmed: `hit` is one
//! branch on a `None` and returns `Ok(())`. Only tests arm it (the crash matrix in
//! `nexuscrm-worker-test`); production code never depends on the test kit.
//!
//! ```
//! use nexuscrm_worker::fault::{Crash, CrashPoint, Faults};
//! fn write_disposition(faults: &Faults) -> Result<(), Crash> {
//!     faults.hit(CrashPoint::BeforeDisposition)?;
//!     // ... commit ...
//!     faults.hit(CrashPoint::AfterDisposition)
//! }
//! assert!(write_disposition(&Faults::none()).is_ok());
//! let faults = Faults::new();
//! faults.arm(CrashPoint::AfterDisposition);
//! assert!(write_disposition(&faults).is_err());
//! assert_eq!(faults.hits(CrashPoint::BeforeDisposition), 1);
//! assert_eq!(faults.fired(), Some(CrashPoint::AfterDisposition));
//! ```

use std::error::Error;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::classification::{Declaration, Durability};

/// A boundary at which a durable-critical path must survive a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CrashPoint {
    /// Before the producer transaction commits acceptance.
    BeforeAcceptance,
    /// After acceptance committed, before the producer saw the acknowledgement.
    AfterAcceptance,
    /// After a claim committed, before the attempt started.
    AfterClaim,
    /// Before the effect is applied.
    BeforeEffect,
    /// After the effect is applied, before the disposition.
    AfterEffect,
    /// Before the disposition commits.
    BeforeDisposition,
    /// After the disposition committed.
    AfterDisposition,
    /// While extending the lease.
    DuringHeartbeat,
    /// While ownership passes to a newer deployment generation.
    OwnershipTransfer,
    /// After the worker stopped heartbeating and its lease expired.
    LeaseExpiry,
}

impl CrashPoint {
    /// Every crash point, in lifecycle order.
    pub const ALL: [CrashPoint; 10] = [
        CrashPoint::BeforeAcceptance,
        CrashPoint::AfterAcceptance,
        CrashPoint::AfterClaim,
        CrashPoint::BeforeEffect,
        CrashPoint::AfterEffect,
        CrashPoint::BeforeDisposition,
        CrashPoint::AfterDisposition,
        CrashPoint::DuringHeartbeat,
        CrashPoint::OwnershipTransfer,
        CrashPoint::LeaseExpiry,
    ];

    /// The points a durable-critical declaration must survive: all of them.
    pub const DURABLE_CRITICAL: &'static [CrashPoint] = &CrashPoint::ALL;

    /// The points the crash matrix requires for `declaration`: every point for
    /// durable-critical work, none otherwise (derived and best-effort work prove convergence or
    /// declared loss instead).
    #[must_use]
    pub fn required_for(declaration: &Declaration) -> &'static [CrashPoint] {
        match declaration.durability() {
            Durability::DurableCritical => CrashPoint::DURABLE_CRITICAL,
            Durability::DerivedReconcilable | Durability::BestEffort => &[],
        }
    }

    /// The kebab-case name, e.g. `after-claim`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            CrashPoint::BeforeAcceptance => "before-acceptance",
            CrashPoint::AfterAcceptance => "after-acceptance",
            CrashPoint::AfterClaim => "after-claim",
            CrashPoint::BeforeEffect => "before-effect",
            CrashPoint::AfterEffect => "after-effect",
            CrashPoint::BeforeDisposition => "before-disposition",
            CrashPoint::AfterDisposition => "after-disposition",
            CrashPoint::DuringHeartbeat => "during-heartbeat",
            CrashPoint::OwnershipTransfer => "ownership-transfer",
            CrashPoint::LeaseExpiry => "lease-expiry",
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for CrashPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown crash point name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownCrashPoint(String);

impl fmt::Display for UnknownCrashPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown crash point {:?}; expected one of: ", self.0)?;
        for (i, p) in CrashPoint::ALL.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(p.as_str())?;
        }
        Ok(())
    }
}

impl Error for UnknownCrashPoint {}

impl FromStr for CrashPoint {
    type Err = UnknownCrashPoint;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CrashPoint::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| UnknownCrashPoint(s.to_owned()))
    }
}

/// The error an armed [`Faults`] hook returns: the process "crashed" at `point`.
///
/// It cannot be mistaken for a domain error: detect it anywhere in an error chain with
/// [`Crash::find`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Crash {
    point: CrashPoint,
}

impl Crash {
    /// Where the crash was injected.
    #[must_use]
    pub fn point(&self) -> CrashPoint {
        self.point
    }

    /// Finds an injected crash in `error` or its `source()` chain.
    #[must_use]
    pub fn find<'a>(error: &'a (dyn Error + 'static)) -> Option<&'a Crash> {
        let mut cur: Option<&(dyn Error + 'static)> = Some(error);
        while let Some(e) = cur {
            if let Some(c) = e.downcast_ref::<Crash>() {
                return Some(c);
            }
            cur = e.source();
        }
        None
    }
}

impl fmt::Display for Crash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "injected crash at {}", self.point)
    }
}

impl Error for Crash {}

/// A cheap, clonable fault hook threaded through a family's real code paths.
///
/// [`Faults::none`] (the `Default`) is the production hook: [`hit`](Faults::hit) costs one branch.
/// A hook made with [`Faults::new`] records how often each point is reached; once
/// [`arm`](Faults::arm)ed at a point, reaching it returns [`Crash`], and from then on *every*
/// `hit` returns `Crash` too: a crashed process runs nothing after the crash.
#[derive(Clone, Default)]
pub struct Faults {
    state: Option<Arc<FaultState>>,
}

#[derive(Default)]
struct FaultState {
    hits: [AtomicU64; CrashPoint::ALL.len()],
    armed: Mutex<Armed>,
    fired: tokio::sync::Notify,
}

#[derive(Default, Clone, Copy)]
struct Armed {
    at: Option<CrashPoint>,
    fired: Option<CrashPoint>,
}

impl fmt::Debug for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.state {
            None => f.write_str("Faults(none)"),
            Some(s) => {
                let a = *s.armed.lock().unwrap_or_else(|e| e.into_inner());
                f.debug_struct("Faults")
                    .field("armed", &a.at)
                    .field("fired", &a.fired)
                    .finish()
            }
        }
    }
}

impl Faults {
    /// The production hook: never crashes, records nothing.
    #[must_use]
    pub const fn none() -> Self {
        Faults { state: None }
    }

    /// A recording hook, initially unarmed.
    #[must_use]
    pub fn new() -> Self {
        Faults {
            state: Some(Arc::default()),
        }
    }

    /// Arms the hook: the next time `point` is reached, the code path crashes. Does nothing on
    /// [`Faults::none`].
    pub fn arm(&self, point: CrashPoint) {
        if let Some(s) = &self.state {
            s.armed.lock().unwrap_or_else(|e| e.into_inner()).at = Some(point);
        }
    }

    /// Marks a boundary. Returns `Err(Crash)` when armed here, or when a crash already fired.
    ///
    /// # Errors
    ///
    /// The injected [`Crash`]; the caller must return it at once without any further durable
    /// write (propagate it with `?`).
    #[inline]
    pub fn hit(&self, point: CrashPoint) -> Result<(), Crash> {
        match &self.state {
            None => Ok(()),
            Some(s) => s.hit(point),
        }
    }

    /// How often `point` was reached (0 on [`Faults::none`]).
    #[must_use]
    pub fn hits(&self, point: CrashPoint) -> u64 {
        self.state
            .as_ref()
            .map_or(0, |s| s.hits[point.index()].load(Relaxed))
    }

    /// Where the crash fired, if it did.
    #[must_use]
    pub fn fired(&self) -> Option<CrashPoint> {
        self.state
            .as_ref()
            .and_then(|s| s.armed.lock().unwrap_or_else(|e| e.into_inner()).fired)
    }

    /// Whether a crash fired (the "process" is dead).
    #[must_use]
    pub fn is_crashed(&self) -> bool {
        self.fired().is_some()
    }

    /// Waits until the crash fires. On [`Faults::none`] it never resolves.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub async fn crashed(&self) -> CrashPoint {
        let Some(s) = &self.state else {
            return std::future::pending().await;
        };
        loop {
            let notified = s.fired.notified();
            if let Some(p) = self.fired() {
                return p;
            }
            notified.await;
        }
    }

    /// Whether this is a recording hook (not [`Faults::none`]).
    #[must_use]
    pub fn is_recording(&self) -> bool {
        self.state.is_some()
    }
}

impl FaultState {
    #[cold]
    fn hit(&self, point: CrashPoint) -> Result<(), Crash> {
        self.hits[point.index()].fetch_add(1, Relaxed);
        let mut a = self.armed.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(fired) = a.fired {
            return Err(Crash { point: fired });
        }
        if a.at == Some(point) {
            a.fired = Some(point);
            drop(a);
            self.fired.notify_waiters();
            return Err(Crash { point });
        }
        Ok(())
    }
}
