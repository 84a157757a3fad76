//! Cross-process signals: a small adapter from any notification channel (PostgreSQL
//! `LISTEN`/`NOTIFY` through your own `sqlx::postgres::PgListener`, a message bus, a webhook)
//! to a controller's [`Waker::wake`](crate::Waker::wake), [`Waker::retime`](crate::Waker::retime)
//! and [`ControllerHandle::request_reconcile`](crate::ControllerHandle::request_reconcile).
//!
//! Signals are hints, never delivery: a lost signal costs latency (the reconciliation backstop
//! still finds the work), never correctness. When the channel says it may have dropped
//! messages (a reconnect, a lagging subscriber), call [`Bridge::lost`]: it requests a
//! reconciliation, as the controller's own generation probe does on a loss.
//!
//! A user's own `PgListener` loop needs no dependency of this crate on sqlx:
//!
//! ```text
//! let mut listener = PgListener::connect_with(&pool).await?;
//! listener.listen("my_jobs").await?;
//! let bridge = Bridge::new(handle.clone());
//! loop {
//!     match listener.try_recv().await {
//!         // The producer runs `NOTIFY my_jobs, 'wake'` (or 'retime', 'reconcile') after commit.
//!         Ok(Some(n)) => bridge.payload(n.payload()),
//!         // The connection dropped and was re-established: notifications may be lost.
//!         Ok(None) => bridge.lost(),
//!         Err(_) => { bridge.lost(); tokio::time::sleep(Duration::from_secs(1)).await; }
//!     }
//! }
//! ```
//!
//! Or feed a channel and let [`Bridge::forward`] do the loop:
//!
//! ```
//! use nexuscrm_worker::bridge::{Bridge, Signal};
//! # use nexuscrm_worker::{CancellationToken, ClaimBatch, Config, Controller, Source, SourceError, Attempt, AttemptError};
//! # struct Empty;
//! # struct Never;
//! # impl Attempt for Never { async fn run(self, _: CancellationToken) -> Result<(), AttemptError> { Ok(()) } }
//! # impl Source for Empty {
//! #     type Attempt = Never;
//! #     async fn check_ready(&self, _: CancellationToken) -> Result<(), SourceError> { Ok(()) }
//! #     async fn reconcile(&self, _: CancellationToken) -> Result<(), SourceError> { Ok(()) }
//! #     async fn claim(&self, _: std::num::NonZeroUsize, _: CancellationToken) -> Result<ClaimBatch<Never>, SourceError> { Ok(ClaimBatch::empty()) }
//! #     async fn next_work_at(&self, _: CancellationToken) -> Result<Option<std::time::SystemTime>, SourceError> { Ok(None) }
//! # }
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let controller = Controller::new(Empty, Config::new("jobs")).unwrap();
//! let handle = controller.handle();
//! let (tx, rx) = tokio::sync::mpsc::channel(64);
//! let cancel = CancellationToken::new();
//! let bridge = tokio::spawn(Bridge::new(handle.clone()).forward(rx, cancel.clone()));
//! tx.send(Signal::Wake).await.unwrap();
//! tx.send("reconcile".parse::<Signal>().unwrap()).await.unwrap();
//! drop(tx); // A closed channel counts as a loss: one reconciliation is requested.
//! bridge.await.unwrap();
//! assert_eq!(handle.snapshot().wakes_received, 1);
//! # }
//! ```

use std::error::Error;
use std::fmt;
use std::str::FromStr;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::controller::ControllerHandle;

/// What an external notification asks of the controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Signal {
    /// New work may be claimable now: [`Waker::wake`](crate::Waker::wake).
    Wake,
    /// The next due time may have moved: [`Waker::retime`](crate::Waker::retime).
    Retime,
    /// Derived or accepted state changed elsewhere:
    /// [`ControllerHandle::request_reconcile`](crate::ControllerHandle::request_reconcile).
    Reconcile,
}

impl Signal {
    /// The payload text: `wake`, `retime` or `reconcile`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Signal::Wake => "wake",
            Signal::Retime => "retime",
            Signal::Reconcile => "reconcile",
        }
    }
}

impl fmt::Display for Signal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A payload that names no [`Signal`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownSignal(String);

impl fmt::Display for UnknownSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut shown: String = self.0.chars().take(64).collect();
        if shown.len() < self.0.len() {
            shown.push('…');
        }
        write!(
            f,
            "unknown signal {shown:?}; expected `wake`, `retime` or `reconcile`"
        )
    }
}

impl Error for UnknownSignal {}

impl FromStr for Signal {
    type Err = UnknownSignal;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "wake" => Ok(Signal::Wake),
            "retime" => Ok(Signal::Retime),
            "reconcile" => Ok(Signal::Reconcile),
            _ => Err(UnknownSignal(s.to_owned())),
        }
    }
}

/// Applies external [`Signal`]s to one controller. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Bridge {
    handle: ControllerHandle,
}

impl Bridge {
    /// A bridge to the controller behind `handle`.
    #[must_use]
    pub fn new(handle: ControllerHandle) -> Self {
        Bridge { handle }
    }

    /// Applies one signal (coalesced by the controller like any in-process call).
    pub fn signal(&self, signal: Signal) {
        match signal {
            Signal::Wake => self.handle.waker().wake(),
            Signal::Retime => self.handle.waker().retime(),
            Signal::Reconcile => self.handle.request_reconcile(),
        }
    }

    /// Applies a text payload. An empty or unknown payload is still a hint that something
    /// changed, so it wakes (the safe reading of a notification whose meaning is unclear); the
    /// returned value says what was applied.
    pub fn payload(&self, text: &str) -> Signal {
        let signal = text.parse().unwrap_or(Signal::Wake);
        self.signal(signal);
        signal
    }

    /// The channel may have dropped signals (it reconnected, lagged, or closed): requests one
    /// reconciliation so nothing waits for the backstop.
    pub fn lost(&self) {
        self.handle.request_reconcile();
    }

    /// Forwards signals from `rx` until `cancel` fires or every sender is gone; a closed
    /// channel is reported as [`lost`](Bridge::lost) (its producer may have died mid-stream).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only forwards hints.
    pub async fn forward(self, mut rx: mpsc::Receiver<Signal>, cancel: CancellationToken) {
        loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => return,
                next = rx.recv() => match next {
                    Some(signal) => self.signal(signal),
                    None => {
                        self.lost();
                        return;
                    }
                },
            }
        }
    }
}
