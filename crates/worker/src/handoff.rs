//! Successor handoff: a finishing attempt may claim the next item for the slot it frees, in its
//! own disposition transaction, so a busy queue needs no separate claim round trip per item.
//!
//! The controller grants the handoff through one gate per run, open only while a continuation
//! stands (the latest claim answer was `more` and no terminal answer came since), no
//! reconciliation is asked for and the run is not stopping. An attempt calls
//! [`Handoff::begin`] right before its disposition: `true` means its disposition may claim at
//! most one successor, which it returns with [`Handoff::claimed`]. A begun handoff is a claim
//! in flight: reconciliation waits for it, and only the last outstanding answer after a terminal
//! one reads `next_work_at`.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::SystemTime;

use crate::clock::Clock;
use crate::source::ClaimBatch;

/// One run's handoff gate: bit 0 is "open", the rest counts handoffs begun and not yet answered
/// to the controller. One word, so "the gate is open" and "one more began" change together: a
/// handoff can never begin after the controller closed the gate and read the count.
pub(crate) struct HandoffGate {
    state: AtomicUsize,
    clock: Arc<dyn Clock>,
}

impl fmt::Debug for HandoffGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandoffGate")
            .field("open", &self.is_open())
            .field("outstanding", &self.outstanding())
            .finish()
    }
}

const OPEN: usize = 1;
const ONE: usize = 2;

impl HandoffGate {
    pub(crate) fn new(clock: Arc<dyn Clock>) -> Self {
        HandoffGate {
            state: AtomicUsize::new(0),
            clock,
        }
    }

    /// Opens or closes the gate.
    pub(crate) fn set_open(&self, open: bool) {
        if open {
            self.state.fetch_or(OPEN, Ordering::AcqRel);
        } else {
            self.state.fetch_and(!OPEN, Ordering::AcqRel);
        }
    }

    pub(crate) fn is_open(&self) -> bool {
        self.state.load(Ordering::Acquire) & OPEN != 0
    }

    /// Handoffs begun and not yet answered. Once the gate is closed it only goes down.
    pub(crate) fn outstanding(&self) -> usize {
        self.state.load(Ordering::Acquire) / ONE
    }

    fn try_begin(&self) -> bool {
        self.state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                (s & OPEN != 0).then_some(s + ONE)
            })
            .is_ok()
    }

    /// One begun handoff was answered (or abandoned by its attempt).
    pub(crate) fn answered(&self) {
        self.state.fetch_sub(ONE, Ordering::AcqRel);
    }
}

/// The controller's offer to an attempt: it may claim its successor in its own disposition.
///
/// Passed to [`Attempt::run_handing_off`](crate::Attempt::run_handing_off). Call
/// [`begin`](Handoff::begin) right before the disposition that would claim the successor; only
/// if it returns `true` may that disposition claim, and then at most one attempt (the slot this
/// attempt frees), in the same transaction as the disposition, returned with
/// [`claimed`](Handoff::claimed). Return [`none`](Handoff::none) otherwise. A begun handoff
/// answered with `none` says nothing about the queue (the freed slot is refilled by the
/// controller's own claim); only `claimed(ClaimBatch::done(..))` is a terminal answer.
pub struct Handoff {
    gate: Option<Arc<HandoffGate>>,
    began: Option<SystemTime>,
}

impl fmt::Debug for Handoff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handoff")
            .field("offered", &self.gate.is_some())
            .field("begun", &self.is_begun())
            .finish()
    }
}

impl Handoff {
    pub(crate) fn offered(gate: Arc<HandoffGate>) -> Self {
        Handoff {
            gate: Some(gate),
            began: None,
        }
    }

    /// A handoff that is never granted: [`begin`](Handoff::begin) always returns `false`. For
    /// running an attempt outside a controller (a baseline, a test).
    #[must_use]
    pub fn refused() -> Self {
        Handoff {
            gate: None,
            began: None,
        }
    }

    /// Asks to claim the successor in this attempt's disposition. `true`: the disposition may
    /// claim at most one successor in its transaction (it is now a claim in flight, and must be
    /// answered with [`claimed`](Handoff::claimed) or [`none`](Handoff::none)). `false`: the
    /// controller does not grant it now (no standing continuation, a reconciliation asked for,
    /// stopping, or handoff off); dispose without claiming. A second call answers as the first.
    pub fn begin(&mut self) -> bool {
        if self.began.is_some() {
            return true;
        }
        match &self.gate {
            Some(gate) if gate.try_begin() => {
                // The clock is read after the gate admitted it: no later claim snapshot than
                // this one can be attributed to this handoff.
                self.began = Some(gate.clock.now());
                true
            }
            _ => false,
        }
    }

    /// Whether [`begin`](Handoff::begin) granted the handoff.
    #[must_use]
    pub fn is_begun(&self) -> bool {
        self.began.is_some()
    }

    /// No successor was claimed, and nothing is said about the queue: the slot is free. Use it
    /// when the handoff was not granted, or when a granted one could not take a successor
    /// just now (a `LIMIT 1 … SKIP LOCKED` read that raced with other claimers); say the
    /// queue is empty with `claimed(ClaimBatch::empty())`.
    #[must_use]
    pub fn none<A>(mut self) -> Handed<A> {
        Handed {
            began: self.take_began(),
            batch: None,
        }
    }

    /// The successor claimed by the disposition: at most one attempt, `more` if more work is
    /// immediately eligible, [`done`](ClaimBatch::done) (possibly empty) if not. Returning a
    /// batch without a granted [`begin`](Handoff::begin), or with more than one attempt, is a
    /// contract violation: the controller fails closed and runs none of them.
    #[must_use]
    pub fn claimed<A>(mut self, batch: ClaimBatch<A>) -> Handed<A> {
        Handed {
            began: self.take_began(),
            batch: Some(batch),
        }
    }

    fn take_began(&mut self) -> Option<SystemTime> {
        let began = self.began.take();
        if began.is_some() {
            // The controller answers it when it reads the result.
            self.gate = None;
        }
        began
    }
}

impl Drop for Handoff {
    fn drop(&mut self) {
        // Begun but never answered (the attempt failed or panicked after `begin`): it is no
        // longer in flight.
        if self.began.is_some()
            && let Some(gate) = &self.gate
        {
            gate.answered();
        }
    }
}

/// What an attempt's [`Handoff`] came to: nothing, or the successor its disposition claimed.
/// Built only by [`Handoff::none`] and [`Handoff::claimed`].
#[derive(Debug)]
pub struct Handed<A> {
    pub(crate) began: Option<SystemTime>,
    pub(crate) batch: Option<ClaimBatch<A>>,
}

impl<A> Handed<A> {
    /// Maps the successor, if any (for wrappers that decorate a source's attempts).
    #[must_use]
    pub fn map<B>(self, f: impl FnMut(A) -> B) -> Handed<B> {
        Handed {
            began: self.began,
            batch: self.batch.map(|b| {
                let (attempts, more) = b.into_parts();
                let attempts = attempts.into_iter().map(f).collect();
                if more {
                    ClaimBatch::more(attempts)
                } else {
                    ClaimBatch::done(attempts)
                }
            }),
        }
    }

    /// Whether the attempt's handoff began (its disposition was allowed to claim).
    #[must_use]
    pub fn is_begun(&self) -> bool {
        self.began.is_some()
    }

    /// The successor answer, if one was returned.
    #[must_use]
    pub fn successor(&self) -> Option<&ClaimBatch<A>> {
        self.batch.as_ref()
    }
}
