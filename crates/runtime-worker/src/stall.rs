//! A test-only hook: attempts that ignore cancellation for a while before running.
//!
//! `NEXUSCRM_TEST_STALL_ATTEMPT_SECS=N` makes every Bulk attempt sleep N seconds, ignoring
//! cancellation, before running the real attempt, so a process test can prove that a drain
//! which overruns its bound exits non-zero. Unset (production), the wrapper only forwards.

use std::num::NonZeroUsize;
use std::time::{Duration, SystemTime};

use nexuscrm_worker::{Attempt, AttemptError, ClaimBatch, Generation, Source, SourceError};
use tokio_util::sync::CancellationToken;

/// Forwards every call to `inner`; attempts optionally stall first.
#[derive(Debug)]
pub(crate) struct Stalling<S> {
    pub(crate) inner: S,
    pub(crate) stall: Option<Duration>,
}

impl<S> Stalling<S> {
    pub(crate) fn from_env(inner: S) -> Result<Self, String> {
        let stall = match std::env::var("NEXUSCRM_TEST_STALL_ATTEMPT_SECS") {
            Ok(v) if !v.is_empty() => {
                Some(Duration::from_secs_f64(v.parse::<f64>().map_err(|e| {
                    format!("NEXUSCRM_TEST_STALL_ATTEMPT_SECS={v:?}: {e}")
                })?))
            }
            _ => None,
        };
        if let Some(d) = stall {
            tracing::warn!(
                "NEXUSCRM_TEST_STALL_ATTEMPT_SECS: attempts ignore cancellation for {d:?}"
            );
        }
        Ok(Stalling { inner, stall })
    }
}

/// An attempt that may stall before running.
#[derive(Debug)]
pub(crate) struct StallingAttempt<A> {
    inner: A,
    stall: Option<Duration>,
}

impl<A: Attempt> Attempt for StallingAttempt<A> {
    async fn run(self, cancel: CancellationToken) -> Result<(), AttemptError> {
        if let Some(d) = self.stall {
            tokio::time::sleep(d).await;
        }
        self.inner.run(cancel).await
    }
}

impl<S: Source> Source for Stalling<S> {
    type Attempt = StallingAttempt<S::Attempt>;

    async fn check_ready(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        self.inner.check_ready(cancel).await
    }

    async fn reconcile(&self, cancel: CancellationToken) -> Result<(), SourceError> {
        self.inner.reconcile(cancel).await
    }

    async fn claim(
        &self,
        capacity: NonZeroUsize,
        cancel: CancellationToken,
    ) -> Result<ClaimBatch<Self::Attempt>, SourceError> {
        let (attempts, more) = self.inner.claim(capacity, cancel).await?.into_parts();
        let attempts = attempts
            .into_iter()
            .map(|inner| StallingAttempt {
                inner,
                stall: self.stall,
            })
            .collect();
        Ok(if more {
            ClaimBatch::more(attempts)
        } else {
            ClaimBatch::done(attempts)
        })
    }

    async fn next_work_at(
        &self,
        cancel: CancellationToken,
    ) -> Result<Option<SystemTime>, SourceError> {
        self.inner.next_work_at(cancel).await
    }

    async fn generation(
        &self,
        cancel: CancellationToken,
    ) -> Result<Option<Generation>, SourceError> {
        self.inner.generation(cancel).await
    }

    async fn generation_changed(
        &self,
        seen: Generation,
        cancel: CancellationToken,
    ) -> Result<Generation, SourceError> {
        self.inner.generation_changed(seen, cancel).await
    }
}
