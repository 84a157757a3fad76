//! The cross-process generation probe every family shares: `LISTEN`/`NOTIFY` on PostgreSQL,
//! or a polled read of a cheap cursor (an index `MAX`) elsewhere. Either way it is a lossy hint:
//! the controller's reconciliation and due timers carry correctness.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

use crate::{Db, Dialect};

/// Why a probe call did not answer.
#[derive(Debug)]
pub enum ProbeError {
    /// The caller's cancellation fired first.
    Cancelled,
    /// The change stream was lost (the LISTEN connection dropped, or
    /// [`GenerationProbe::interrupt`]): changes may have been missed.
    Lost(String),
    /// Reading the cursor failed.
    Read(sqlx::Error),
}

impl fmt::Display for ProbeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProbeError::Cancelled => f.write_str("cancelled"),
            ProbeError::Lost(why) => write!(f, "the change stream was lost: {why}"),
            ProbeError::Read(e) => write!(f, "reading the generation cursor failed: {e}"),
        }
    }
}

impl std::error::Error for ProbeError {}

/// One family's generation probe.
pub struct GenerationProbe {
    channel: &'static str,
    signal: Option<&'static str>,
    dialect: Dialect,
    listen: bool,
    poll: Option<Duration>,
    url: String,
    listener: tokio::sync::Mutex<Option<PgListener>>,
    interrupted: std::sync::atomic::AtomicBool,
    wake: tokio::sync::Notify,
}

impl fmt::Debug for GenerationProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GenerationProbe")
            .field("channel", &self.channel)
            .field("listen", &self.listen)
            .field("poll", &self.poll)
            .finish_non_exhaustive()
    }
}

impl GenerationProbe {
    /// A probe on `channel`: LISTEN when `listen` and `db` is PostgreSQL, else a read every
    /// `poll` (`None`: no probe at all).
    #[must_use]
    pub fn new(db: &Db, channel: &'static str, listen: bool, poll: Option<Duration>) -> Self {
        GenerationProbe {
            channel,
            signal: None,
            dialect: db.dialect(),
            listen: listen && db.dialect() == Dialect::Postgres,
            poll,
            url: db.connect_url().to_owned(),
            listener: tokio::sync::Mutex::new(None),
            interrupted: std::sync::atomic::AtomicBool::new(false),
            wake: tokio::sync::Notify::new(),
        }
    }

    /// Makes [`notify`](Self::notify) bump `family`'s work signal (`runtime_work_signal`, one
    /// of 16 stripes, after the producer's commit) where the probe polls a server: PostgreSQL
    /// without LISTEN, and the MySQL dialect. The family's polled cursor then includes the
    /// signal's sum, which changes for every signalled commit; an id `MAX` alone misses a commit
    /// whose id is lower than one already seen (auto-increment ids are allocated before commit,
    /// and interleave across Galera's or TiDB's nodes). SQLite has one writer at a time and
    /// commit-ordered ids, so it needs no signal.
    #[must_use]
    pub fn signal(mut self, family: &'static str) -> Self {
        self.signal = Some(family);
        self
    }

    /// Whether [`notify`](Self::notify) bumps a work signal.
    #[must_use]
    pub fn signals(&self) -> bool {
        self.signal.is_some() && !self.listen && self.dialect != Dialect::Sqlite
    }

    /// Drops the current change stream as a reconnect would: the waiting (or next)
    /// [`changed`](Self::changed) returns [`ProbeError::Lost`], so the controller records a
    /// generation loss and reconciles. For operators forcing a resync, and for tests that must
    /// lose the polled probe (which has no connection to kill).
    pub fn interrupt(&self) {
        self.interrupted
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.wake.notify_waiters();
    }

    fn take_interrupt(&self) -> Result<(), ProbeError> {
        if self
            .interrupted
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            Err(ProbeError::Lost("interrupted".into()))
        } else {
            Ok(())
        }
    }

    /// Whether this probe uses LISTEN/NOTIFY.
    #[must_use]
    pub fn listens(&self) -> bool {
        self.listen
    }

    /// A producer's hint after its commit (outside any claim transaction): `NOTIFY` with an
    /// empty payload when listening, a bump of the family's work signal when polling a server
    /// ([`signal`](Self::signal)). Lossy by design; errors are ignored (a bump that loses a
    /// Galera certification race to another node's bump is not needed: that bump changed the
    /// sum already).
    pub async fn notify(&self, db: &Db) {
        if self.listen {
            let _ = sqlx::query("SELECT pg_notify($1, '')")
                .bind(self.channel)
                .execute(db.pool())
                .await;
        } else if self.signals()
            && let Some(family) = self.signal
        {
            static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let stripe = (std::process::id()
                .wrapping_add(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
                % crate::FENCE_STRIPES) as i32;
            let _ = sqlx::query(
                crate::queries()
                    .for_dialect(db.dialect())
                    .get("signal_bump"),
            )
            .bind(family)
            .bind(stripe)
            .execute(db.pool())
            .await;
        }
    }

    /// The current cursor, or `None` when the probe is off. When listening, `LISTEN` is issued
    /// first, so no commit between the two is missed.
    ///
    /// # Errors
    ///
    /// Cancellation, a failed LISTEN, or a failed read.
    pub async fn start<F, Fut>(
        &self,
        cancel: &CancellationToken,
        read: F,
    ) -> Result<Option<u64>, ProbeError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<u64, sqlx::Error>>,
    {
        if self.listen {
            let mut guard = self.listener.lock().await;
            if guard.is_none() {
                let mut l = tokio::select! {
                    biased;
                    () = cancel.cancelled() => return Err(ProbeError::Cancelled),
                    l = PgListener::connect(&self.url) => l.map_err(ProbeError::Read)?,
                };
                l.listen(self.channel).await.map_err(ProbeError::Read)?;
                *guard = Some(l);
            }
        } else if self.poll.is_none() {
            return Ok(None);
        }
        tokio::select! {
            biased;
            () = cancel.cancelled() => Err(ProbeError::Cancelled),
            g = read() => g.map(Some).map_err(ProbeError::Read),
        }
    }

    /// Waits until the cursor differs from `seen` (woken by a notification, or by the poll
    /// interval) and returns it; returns `seen` when cancelled.
    ///
    /// # Errors
    ///
    /// The LISTEN connection was lost (it is reconnected by the next [`start`](Self::start)), or
    /// a read failed.
    pub async fn changed<F, Fut>(
        &self,
        seen: u64,
        cancel: &CancellationToken,
        read: F,
    ) -> Result<u64, ProbeError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<u64, sqlx::Error>>,
    {
        if self.listen {
            loop {
                let interrupted = self.wake.notified();
                self.take_interrupt()?;
                let mut guard = self.listener.lock().await;
                let Some(listener) = guard.as_mut() else {
                    return Err(ProbeError::Lost("not listening".into()));
                };
                // try_recv, not recv: recv reconnects silently, hiding lost notifications.
                let received = tokio::select! {
                    biased;
                    () = cancel.cancelled() => return Ok(seen),
                    () = interrupted => {
                        *guard = None;
                        self.interrupted.store(false, std::sync::atomic::Ordering::SeqCst);
                        return Err(ProbeError::Lost("interrupted".into()));
                    }
                    r = listener.try_recv() => r,
                };
                match received {
                    Ok(Some(_)) => {
                        drop(guard);
                        let now = read().await.map_err(ProbeError::Read)?;
                        if now != seen {
                            return Ok(now);
                        }
                    }
                    Ok(None) => {
                        *guard = None;
                        return Err(ProbeError::Lost("closed".into()));
                    }
                    Err(e) => {
                        *guard = None;
                        return Err(ProbeError::Lost(e.to_string()));
                    }
                }
            }
        }
        let every = self.poll.unwrap_or(Duration::from_secs(5));
        loop {
            let interrupted = self.wake.notified();
            self.take_interrupt()?;
            tokio::select! {
                biased;
                () = cancel.cancelled() => return Ok(seen),
                () = interrupted => {
                    self.interrupted.store(false, std::sync::atomic::Ordering::SeqCst);
                    return Err(ProbeError::Lost("interrupted".into()));
                }
                () = tokio::time::sleep(every) => {}
            }
            let now = read().await.map_err(ProbeError::Read)?;
            if now != seen {
                return Ok(now);
            }
        }
    }
}
