//! Batched disposition: a group commit for attempts whose dispositions are small.
//!
//! A [`Batcher`] lets several finished attempts commit their dispositions in one transaction
//! (as River's batch completer does), so a busy queue pays one commit, and one WAL flush, for
//! several items instead of one each, at the same durability: an attempt's
//! [`Ticket::submit`] returns only once the transaction holding its disposition committed, and
//! the attempt returns (acknowledges) only after that.
//!
//! There is no background task and no timer while nothing is submitted. The submitter that
//! completes a batch runs the flush itself, inside its own attempt's future, which the
//! controller awaits (never drops): that attempt is the *leader*, the others in the batch wait
//! for its answer. A batch is flushed as soon as one of these holds:
//!
//! - **every live attempt has submitted** (a [`Ticket`] is live from [`Batcher::enter`], taken
//!   when the attempt is claimed, until it submits or is dropped): nobody else can join soon,
//!   so waiting would only add latency;
//! - the batch holds **`max_batch`** items;
//! - its oldest item has waited **`max_wait`** (an attempt still running elsewhere does not
//!   hold a finished one's acknowledgement longer than that).
//!
//! A flush's answer is all or nothing: its results (one per item, in order) go to every item,
//! or its error goes to every item. A leader dropped mid-flush leaves its batch's outcome
//! unknown: every item in it gets [`BatchError::Abandoned`]. Either error leaves the outcome
//! unknown to the followers, so an attempt should answer it as it would its own failed
//! disposition (an [`AttemptError`](crate::AttemptError): fail-stop).

use std::fmt;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

/// Why a submitted item has no result.
#[derive(Debug)]
pub enum BatchError<E> {
    /// The flush that held the item failed; every item in it has this error.
    Flush(Arc<E>),
    /// The flush returned a different number of results than it was given items.
    Mismatch {
        /// Items in the batch.
        items: usize,
        /// Results the flush returned.
        results: usize,
    },
    /// The leader running the flush was dropped before it answered: the batch may or may not
    /// have committed.
    Abandoned,
}

impl<E: fmt::Display> fmt::Display for BatchError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BatchError::Flush(e) => write!(f, "the batched disposition failed: {e}"),
            BatchError::Mismatch { items, results } => write!(
                f,
                "the batched disposition returned {results} result(s) for {items} item(s)"
            ),
            BatchError::Abandoned => f.write_str(
                "the batched disposition was abandoned before it answered; its outcome is unknown",
            ),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for BatchError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BatchError::Flush(e) => Some(&**e),
            _ => None,
        }
    }
}

type Reply<R, E> = oneshot::Sender<Result<R, BatchError<E>>>;

struct State<T, R, E> {
    /// Tickets entered and neither submitted nor dropped.
    live: usize,
    pending: Vec<(T, Reply<R, E>)>,
    /// When the oldest pending item was submitted.
    oldest: Option<Instant>,
    /// Batches taken so far: an item submitted in epoch `e` is still pending while it is `e`.
    epoch: u64,
}

struct Shared<T, R, E> {
    state: Mutex<State<T, R, E>>,
    /// Wakes one waiting follower when a dropped ticket made the pending batch complete.
    complete: Notify,
    max_batch: usize,
    max_wait: Duration,
    flushes: AtomicU64,
    items: AtomicU64,
}

impl<T, R, E> Shared<T, R, E> {
    fn lock(&self) -> MutexGuard<'_, State<T, R, E>> {
        // No code panics while holding it; a poisoned lock still holds consistent state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the pending batch if it is due now.
    fn take_if_due(&self, s: &mut State<T, R, E>, now: Instant) -> Option<Vec<(T, Reply<R, E>)>> {
        let due = !s.pending.is_empty()
            && (s.live == 0
                || s.pending.len() >= self.max_batch
                || s.oldest.is_some_and(|o| o + self.max_wait <= now));
        due.then(|| {
            s.oldest = None;
            s.epoch += 1;
            std::mem::take(&mut s.pending)
        })
    }
}

/// A group commit for small dispositions (see the [module docs](self)). `T` is one item's
/// disposition, `R` its result, `E` the flush's error. Cloning shares the batcher.
pub struct Batcher<T, R, E> {
    shared: Arc<Shared<T, R, E>>,
}

impl<T, R, E> Clone for Batcher<T, R, E> {
    fn clone(&self) -> Self {
        Batcher {
            shared: self.shared.clone(),
        }
    }
}

impl<T, R, E> fmt::Debug for Batcher<T, R, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.shared.lock();
        f.debug_struct("Batcher")
            .field("live", &s.live)
            .field("pending", &s.pending.len())
            .field("max_batch", &self.shared.max_batch)
            .field("max_wait", &self.shared.max_wait)
            .finish()
    }
}

impl<T, R, E> Batcher<T, R, E> {
    /// A batcher flushing at most `max_batch` items at once, holding a finished item at most
    /// `max_wait` for attempts still running. Size `max_batch` to the capacity of the attempts
    /// that share it (a larger one is only ever reached through `live == 0`).
    #[must_use]
    pub fn new(max_batch: NonZeroUsize, max_wait: Duration) -> Self {
        Batcher {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    live: 0,
                    pending: Vec::new(),
                    oldest: None,
                    epoch: 0,
                }),
                complete: Notify::new(),
                max_batch: max_batch.get(),
                max_wait,
                flushes: AtomicU64::new(0),
                items: AtomicU64::new(0),
            }),
        }
    }

    /// A ticket for one attempt that will submit a disposition: take it when the attempt is
    /// claimed (while it is live, a batch waits for it up to `max_wait`).
    #[must_use]
    pub fn enter(&self) -> Ticket<T, R, E> {
        self.shared.lock().live += 1;
        Ticket {
            shared: Some(self.shared.clone()),
        }
    }

    /// Flushes run so far.
    #[must_use]
    pub fn flushes(&self) -> u64 {
        self.shared.flushes.load(Ordering::Relaxed)
    }

    /// Items flushed so far (successful or not).
    #[must_use]
    pub fn items(&self) -> u64 {
        self.shared.items.load(Ordering::Relaxed)
    }
}

/// One live attempt's place in a [`Batcher`]. Dropping it unsubmitted (the attempt ended
/// without a disposition) lets the others flush without waiting for it.
pub struct Ticket<T, R, E> {
    shared: Option<Arc<Shared<T, R, E>>>,
}

impl<T, R, E> fmt::Debug for Ticket<T, R, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ticket").finish_non_exhaustive()
    }
}

impl<T, R, E> Drop for Ticket<T, R, E> {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            let complete = {
                let mut s = shared.lock();
                s.live -= 1;
                s.live == 0 && !s.pending.is_empty()
            };
            if complete {
                shared.complete.notify_one();
            }
        }
    }
}

impl<T, R, E> Ticket<T, R, E> {
    /// Submits this attempt's disposition and waits until the transaction holding it answered:
    /// `Ok` only once it committed. If this submission makes the batch due, or the batch comes
    /// due while it waits, this call is the leader and runs `flush` on the batch (its items in
    /// submission order; it must return one result per item, in that order, committing all of
    /// them in one transaction or none). Otherwise `flush` is not called.
    ///
    /// # Errors
    ///
    /// [`BatchError`]: the flush failed (every item in it gets its error), answered with the
    /// wrong number of results, or was abandoned. The item's outcome is then unknown.
    pub async fn submit<F, Fut>(mut self, item: T, flush: F) -> Result<R, BatchError<E>>
    where
        F: FnOnce(Vec<T>) -> Fut,
        Fut: Future<Output = Result<Vec<R>, E>>,
    {
        let Some(shared) = self.shared.take() else {
            return Err(BatchError::Abandoned);
        };
        let (tx, mut rx) = oneshot::channel();
        let (batch, epoch) = {
            let mut s = shared.lock();
            s.live -= 1;
            let now = Instant::now();
            if s.pending.is_empty() {
                s.oldest = Some(now);
            }
            s.pending.push((item, tx));
            let epoch = s.epoch;
            (shared.take_if_due(&mut s, now), epoch)
        };
        if let Some(batch) = batch {
            run_flush(&shared, batch, flush).await;
            return answer(rx.await);
        }
        loop {
            // Once this item's batch was taken, only its answer is awaited: this attempt does
            // not lead a later batch.
            let deadline = {
                let s = shared.lock();
                if s.epoch == epoch {
                    s.oldest.map(|o| o + shared.max_wait)
                } else {
                    None
                }
            };
            tokio::select! {
                r = &mut rx => return answer(r),
                () = sleep_until(deadline) => {}
                () = shared.complete.notified() => {}
            }
            let batch = {
                let mut s = shared.lock();
                if s.epoch == epoch {
                    shared.take_if_due(&mut s, Instant::now())
                } else {
                    None
                }
            };
            if let Some(batch) = batch {
                run_flush(&shared, batch, flush).await;
                return answer(rx.await);
            }
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        // This item is in a flush in flight: its answer comes on the channel.
        None => std::future::pending().await,
    }
}

fn answer<R, E>(
    r: Result<Result<R, BatchError<E>>, oneshot::error::RecvError>,
) -> Result<R, BatchError<E>> {
    r.unwrap_or(Err(BatchError::Abandoned))
}

async fn run_flush<T, R, E, F, Fut>(
    shared: &Shared<T, R, E>,
    batch: Vec<(T, Reply<R, E>)>,
    flush: F,
) where
    F: FnOnce(Vec<T>) -> Fut,
    Fut: Future<Output = Result<Vec<R>, E>>,
{
    let n = batch.len();
    shared.flushes.fetch_add(1, Ordering::Relaxed);
    shared.items.fetch_add(n as u64, Ordering::Relaxed);
    let (items, replies): (Vec<T>, Vec<Reply<R, E>>) = batch.into_iter().unzip();
    // If this future is dropped here, `replies` go with it: every follower hears `Abandoned`.
    match flush(items).await {
        Ok(results) if results.len() == n => {
            for (reply, r) in replies.into_iter().zip(results) {
                // A follower that stopped listening has nothing left to acknowledge.
                let _ = reply.send(Ok(r));
            }
        }
        Ok(results) => {
            for reply in replies {
                let _ = reply.send(Err(BatchError::Mismatch {
                    items: n,
                    results: results.len(),
                }));
            }
        }
        Err(e) => {
            let e = Arc::new(e);
            for reply in replies {
                let _ = reply.send(Err(BatchError::Flush(e.clone())));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroUsize;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{BatchError, Batcher};

    type B = Batcher<u32, u32, String>;
    /// Each flush's batch and when it ran, from the test's start.
    type Log = Arc<Mutex<Vec<(Vec<u32>, Duration)>>>;
    type Flushed = std::pin::Pin<Box<dyn Future<Output = Result<Vec<u32>, String>> + Send>>;

    fn batcher(max_batch: usize, max_wait_ms: u64) -> B {
        Batcher::new(
            NonZeroUsize::new(max_batch).unwrap(),
            Duration::from_millis(max_wait_ms),
        )
    }

    /// A flush that records its batch and the time it ran, takes `cost` and answers `item * 10`.
    fn recorder(
        log: &Log,
        start: Instant,
        cost: Duration,
    ) -> impl FnOnce(Vec<u32>) -> Flushed + use<> {
        let log = log.clone();
        move |items: Vec<u32>| {
            Box::pin(async move {
                log.lock().unwrap().push((items.clone(), start.elapsed()));
                tokio::time::sleep(cost).await;
                Ok(items.into_iter().map(|i| i * 10).collect())
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_flushes_at_once_when_every_live_attempt_has_submitted() {
        let b = batcher(8, 50);
        let log = Arc::default();
        let start = Instant::now();
        let tickets: Vec<_> = (0..4).map(|_| b.enter()).collect();
        let mut set = tokio::task::JoinSet::new();
        for (i, t) in tickets.into_iter().enumerate() {
            let flush = recorder(&log, start, Duration::from_millis(3));
            set.spawn(async move { t.submit(i as u32, flush).await });
        }
        let results: Vec<u32> = set
            .join_all()
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let mut sorted = results.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![0, 10, 20, 30]);
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 1, "one flush for the four: {log:?}");
        assert_eq!(log[0].1, Duration::ZERO, "no waiting: nobody else was live");
        assert_eq!(b.flushes(), 1);
        assert_eq!(b.items(), 4);
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(3),
            "one flush's cost"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_finished_attempt_waits_at_most_max_wait_for_one_still_running() {
        let b = batcher(8, 5);
        let log = Arc::default();
        let start = Instant::now();
        let early = b.enter();
        let late = b.enter();
        let first = tokio::spawn({
            let flush = recorder(&log, start, Duration::from_millis(1));
            async move { early.submit(1, flush).await }
        });
        // The other attempt runs 20 ms: the first is flushed alone after 5.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(first.await.unwrap().unwrap(), 10);
        let flush = recorder(&log, start, Duration::from_millis(1));
        assert_eq!(late.submit(2, flush).await.unwrap(), 20);
        let log = log.lock().unwrap();
        assert_eq!(
            *log,
            vec![
                (vec![1], Duration::from_millis(5)),
                (vec![2], Duration::from_millis(20))
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn batches_hold_at_most_max_batch_items() {
        let b = batcher(2, 50);
        let log = Arc::default();
        let start = Instant::now();
        let tickets: Vec<_> = (0..5).map(|_| b.enter()).collect();
        let mut tasks = Vec::new();
        for (i, t) in tickets.into_iter().enumerate() {
            let flush = recorder(&log, start, Duration::from_millis(1));
            tasks.push(tokio::spawn(async move { t.submit(i as u32, flush).await }));
            // Each submission is seen before the next.
            tokio::task::yield_now().await;
        }
        for (i, t) in tasks.into_iter().enumerate() {
            assert_eq!(t.await.unwrap().unwrap(), i as u32 * 10);
        }
        let log = log.lock().unwrap();
        let batches: Vec<_> = log.iter().map(|(items, _)| items.clone()).collect();
        // Two full batches, then the last item alone once nobody else is live.
        assert_eq!(batches, vec![vec![0, 1], vec![2, 3], vec![4]]);
        assert!(log.iter().all(|(_, at)| *at == Duration::ZERO), "{log:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_flush_fails_every_item_in_it_and_the_next_batch_still_runs() {
        let b = batcher(8, 50);
        let (t1, t2) = (b.enter(), b.enter());
        let calls = Arc::new(Mutex::new(0));
        let failing = |calls: Arc<Mutex<u32>>| {
            move |_items: Vec<u32>| async move {
                *calls.lock().unwrap() += 1;
                Err::<Vec<u32>, _>("commit failed".to_owned())
            }
        };
        let a = tokio::spawn(t1.submit(1, failing(calls.clone())));
        tokio::task::yield_now().await;
        let r2 = t2.submit(2, failing(calls.clone())).await;
        let r1 = a.await.unwrap();
        for r in [r1, r2] {
            match r {
                Err(BatchError::Flush(e)) => assert_eq!(*e, "commit failed"),
                other => panic!("expected the flush's error, got {other:?}"),
            }
        }
        assert_eq!(*calls.lock().unwrap(), 1, "one flush for both");
        let ok = b
            .enter()
            .submit(3, |items: Vec<u32>| async move { Ok::<_, String>(items) });
        assert_eq!(ok.await.unwrap(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_flush_answering_the_wrong_count_fails_every_item() {
        let b = batcher(8, 50);
        let r = b
            .enter()
            .submit(1, |_items: Vec<u32>| async { Ok::<_, String>(vec![]) })
            .await;
        assert!(
            matches!(
                r,
                Err(BatchError::Mismatch {
                    items: 1,
                    results: 0
                })
            ),
            "{r:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_ticket_dropped_unsubmitted_lets_the_others_flush_without_waiting() {
        let b = batcher(8, 1_000);
        let log = Arc::default();
        let start = Instant::now();
        let (t1, t2) = (b.enter(), b.enter());
        let a = tokio::spawn({
            let flush = recorder(&log, start, Duration::from_millis(1));
            async move { t1.submit(1, flush).await }
        });
        tokio::time::sleep(Duration::from_millis(7)).await;
        // The second attempt ends without a disposition.
        drop(t2);
        assert_eq!(a.await.unwrap().unwrap(), 10);
        assert_eq!(
            *log.lock().unwrap(),
            vec![(vec![1], Duration::from_millis(7))]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_dropped_mid_flush_leaves_its_followers_abandoned_not_waiting() {
        let b = batcher(8, 50);
        let (t1, t2) = (b.enter(), b.enter());
        let follower =
            tokio::spawn(t1.submit(1, |items: Vec<u32>| async move { Ok::<_, String>(items) }));
        tokio::task::yield_now().await;
        // The leader's flush never answers; its future is dropped after 10 ms.
        let leader = t2.submit(2, |_items: Vec<u32>| std::future::pending());
        assert!(
            tokio::time::timeout(Duration::from_millis(10), leader)
                .await
                .is_err()
        );
        assert!(matches!(
            follower.await.unwrap(),
            Err(BatchError::Abandoned)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_runs_and_no_timer_is_armed_while_nothing_is_submitted() {
        let b = batcher(8, 5);
        let _live = b.enter();
        tokio::time::sleep(Duration::from_secs(3_600)).await;
        assert_eq!((b.flushes(), b.items()), (0, 0));
    }
}
