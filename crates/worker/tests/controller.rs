//! Controller semantics under tokio's paused clock, with exact Source-call budgets.
//!
//! Every test ends by checking that the controller's snapshot agrees with the calls the scripted
//! source counted.

use std::num::NonZeroUsize;
use std::time::Duration;

use nexuscrm_worker::{Config, Controller, ControllerHandle, RunError, RunErrorKind};
use nexuscrm_worker_test::{
    AttemptPlan, ClaimPlan, Due, GenEvent, OnCancel, Op, ScriptedSource, Step, assert_calls,
};
use tokio::task::JoinHandle;
use tokio::time::sleep;
use tokio_util::sync::CancellationToken;

type Ctl = Controller<ScriptedSource>;
type Outcome = Result<Ctl, RunError<ScriptedSource>>;

const SEC: Duration = Duration::from_secs(1);

fn nz(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).unwrap()
}

fn config(src: &ScriptedSource) -> Config {
    Config::new("test")
        .capacity(nz(4))
        .reconcile_interval(Duration::from_secs(300))
        .reconcile_jitter(Duration::ZERO)
        .shutdown_timeout(Duration::from_secs(10))
        .clock(src.clock())
}

struct Running {
    task: JoinHandle<Outcome>,
    handle: ControllerHandle,
    cancel: CancellationToken,
}

impl Running {
    async fn stop(self) -> Outcome {
        self.cancel.cancel();
        self.task.await.expect("run task")
    }
}

fn start_with(src: &ScriptedSource, cfg: Config) -> Running {
    let ctl = Controller::new(src.clone(), cfg).expect("valid config");
    let handle = ctl.handle();
    let cancel = CancellationToken::new();
    let task = tokio::spawn(ctl.run(cancel.clone()));
    Running {
        task,
        handle,
        cancel,
    }
}

fn start(src: &ScriptedSource) -> Running {
    start_with(src, config(src))
}

/// Lets every task run to quiescence without moving the paused clock.
async fn settle() {
    for _ in 0..64 {
        tokio::task::yield_now().await;
    }
}

fn ops(src: &ScriptedSource) -> Vec<Op> {
    src.calls().into_iter().map(|c| c.op).collect()
}

#[tokio::test(start_paused = true)]
async fn startup_runs_check_ready_then_generation_then_reconcile_then_ready_then_claim() {
    let src = ScriptedSource::new();
    src.set_generation(7);
    // Hold reconcile for 1 s so Ready can be observed to come only after it.
    src.push_reconcile(Step::ok(()).after(SEC));
    let r = start(&src);
    settle().await;
    assert!(
        !r.handle.snapshot().ready,
        "not Ready before the startup reconciliation"
    );
    assert_calls!(
        src,
        check_ready = 1,
        generation = 1,
        reconcile = 1,
        claim = 0
    );
    assert!(r.handle.ready().await);
    settle().await;
    // The probe's change wait runs concurrently; the protocol order is about the rest.
    let order: Vec<Op> = ops(&src)
        .into_iter()
        .filter(|o| *o != Op::GenerationChanged)
        .collect();
    assert_eq!(
        order,
        vec![
            Op::CheckReady,
            Op::Generation,
            Op::Reconcile,
            Op::Claim,
            Op::NextWorkAt
        ]
    );
    assert_eq!(
        src.times(Op::Claim),
        vec![SEC],
        "claim only after the reconcile finished"
    );
    src.assert_snapshot_agrees(&r.handle.snapshot());
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn check_ready_error_ends_run_without_poison_and_a_second_run_works() {
    let src = ScriptedSource::new();
    src.push_check_ready(Step::err("schema missing"));
    let ctl = Controller::new(src.clone(), config(&src)).unwrap();
    let handle = ctl.handle();
    let err = ctl.run(CancellationToken::new()).await.unwrap_err();
    assert_eq!(err.kind(), RunErrorKind::NotReady);
    assert!(!err.is_poisoned());
    assert!(err.to_string().contains("schema missing"), "{err}");
    assert_calls!(
        src,
        check_ready = 1,
        reconcile = 0,
        claim = 0,
        next_work_at = 0
    );
    assert!(!handle.is_poisoned());

    let ctl = err.into_controller().expect("handed back");
    let cancel = CancellationToken::new();
    let task = tokio::spawn(ctl.run(cancel.clone()));
    assert!(handle.ready().await);
    settle().await;
    assert_calls!(
        src,
        check_ready = 2,
        reconcile = 1,
        claim = 1,
        next_work_at = 1
    );
    cancel.cancel();
    assert!(task.await.unwrap().is_ok());
    let snap = handle.snapshot();
    assert_eq!(snap.runs, 2);
    src.assert_snapshot_agrees(&snap);
}

#[tokio::test(start_paused = true)]
async fn a_claim_cooldown_batches_refills_while_attempts_run_but_never_delays_an_idle_claim() {
    let src = ScriptedSource::new();
    src.check_capacity(4);
    // Endless work; attempts end 10, 20, 30 and 40 ms after their claim.
    src.default_claim(|cap| {
        ClaimPlan::more(
            (0..cap)
                .map(|i| AttemptPlan::ok(Duration::from_millis(10 * (i as u64 + 1))))
                .collect(),
        )
    });
    let r = start_with(
        &src,
        config(&src).claim_cooldown(Duration::from_millis(100)),
    );
    sleep(Duration::from_millis(1010)).await;
    // Without the cooldown each freed slot would be refilled alone (claims for 1 slot every
    // 10 ms); with it the controller waits while attempts run and refills all four slots when
    // the last one ends (40 ms, inside the cooldown): nothing in flight means no waiting.
    let caps = src.claim_capacities();
    assert_eq!(caps, vec![4; 26], "{caps:?}");
    let times = src.times(Op::Claim);
    assert!(
        times
            .windows(2)
            .all(|w| w[1] - w[0] == Duration::from_millis(40)),
        "{times:?}"
    );
    assert_eq!(src.over_capacity(), 0);
    assert!(r.stop().await.is_ok());

    // A long attempt keeps the cooldown in force: the three short slots are refilled together
    // 100 ms after the claim, not one by one.
    let src = ScriptedSource::new();
    src.push_claim(Step::ok(ClaimPlan::more(vec![
        AttemptPlan::ok(Duration::from_millis(10)),
        AttemptPlan::ok(Duration::from_millis(20)),
        AttemptPlan::ok(Duration::from_millis(30)),
        AttemptPlan::ok(Duration::from_secs(10)),
    ])));
    src.push_claim(Step::ok(ClaimPlan::done(vec![])));
    let r = start_with(
        &src,
        config(&src).claim_cooldown(Duration::from_millis(100)),
    );
    sleep(Duration::from_millis(500)).await;
    assert_eq!(src.claim_capacities(), vec![4, 3]);
    assert_eq!(
        src.times(Op::Claim),
        vec![Duration::ZERO, Duration::from_millis(100)]
    );
    assert!(r.stop().await.is_ok());

    // Idle (nothing in flight): a due timer claims at once, even right after a claim.
    let src = ScriptedSource::new();
    src.push_next_work_at(Step::ok(Due::In(Duration::from_millis(5))));
    let r = start_with(&src, config(&src).claim_cooldown(Duration::from_secs(1)));
    sleep(Duration::from_millis(50)).await;
    settle().await;
    assert_eq!(
        src.times(Op::Claim),
        vec![Duration::ZERO, Duration::from_millis(5)]
    );
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn claim_never_asks_for_more_than_free_capacity_nor_for_zero() {
    let src = ScriptedSource::new();
    src.check_capacity(4);
    // Endless work: every claim fills what it was asked for, attempts of varying length.
    src.default_claim(|cap| {
        ClaimPlan::more(
            (0..cap)
                .map(|i| AttemptPlan::ok(Duration::from_millis(100 + 37 * i as u64)))
                .collect(),
        )
    });
    let r = start(&src);
    sleep(Duration::from_secs(30)).await;
    let caps = src.claim_capacities();
    assert!(caps.len() > 100, "kept claiming: {}", caps.len());
    assert_eq!(caps[0], 4, "first claim asks for the whole capacity");
    assert!(caps.iter().all(|&c| (1..=4).contains(&c)), "{caps:?}");
    assert!(
        caps.iter().any(|&c| c < 4),
        "partial capacity was offered too"
    );
    assert_eq!(src.over_capacity(), 0, "never more than 4 attempts at once");
    assert_eq!(src.max_in_flight(), 4);
    assert_calls!(src, next_work_at = 0);
    src.assert_snapshot_agrees(&r.handle.snapshot());
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_batch_larger_than_asked_fails_closed_and_poisons() {
    let src = ScriptedSource::new();
    src.push_claim(Step::ok(ClaimPlan::done(vec![AttemptPlan::ok(SEC); 5])));
    let r = start(&src);
    let err = r.task.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), RunErrorKind::ContractViolation);
    assert!(err.is_poisoned());
    assert!(
        err.to_string().contains("5 attempts for a capacity of 4"),
        "{err}"
    );
    assert_eq!(src.attempts_started(), 0, "none of the oversized batch ran");
    assert_calls!(src, claim = 1, next_work_at = 0);
    assert!(r.handle.is_poisoned());
}

#[tokio::test(start_paused = true)]
async fn an_empty_batch_asking_for_more_is_a_contract_violation() {
    let src = ScriptedSource::new();
    src.push_claim(Step::ok(ClaimPlan::more(vec![])));
    let r = start(&src);
    let err = r.task.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), RunErrorKind::ContractViolation);
    assert_calls!(src, claim = 1, next_work_at = 0);
}

#[tokio::test(start_paused = true)]
async fn more_continues_at_once_and_waits_for_capacity_when_none_is_free() {
    let src = ScriptedSource::new();
    // Two slots. First batch fills both and asks for more: no slot is free, so the next claim
    // waits until the 10 s attempt finishes.
    let cfg = config(&src).capacity(nz(2));
    src.push_claim(Step::ok(ClaimPlan::more(vec![
        AttemptPlan::ok(Duration::from_secs(10)),
        AttemptPlan::ok(Duration::from_secs(20)),
    ])));
    // One slot free: a batch of one that asks for more; still one slot busy... then continue.
    src.push_claim(Step::ok(ClaimPlan::more(vec![AttemptPlan::ok(
        Duration::from_secs(5),
    )])));
    // A partially-filled batch with `more` continues at once while a slot is free.
    src.push_claim(Step::ok(ClaimPlan::done(vec![])));
    let r = start_with(&src, cfg);
    settle().await;
    assert_calls!(src, claim = 1, next_work_at = 0);
    sleep(Duration::from_secs(9)).await;
    assert_calls!(src, claim = 1, next_work_at = 0);
    sleep(SEC).await;
    settle().await;
    // At 10 s: one slot free -> claim(1) -> more, but no slot free again -> wait.
    assert_calls!(src, claim = 2, next_work_at = 0);
    assert_eq!(src.claim_capacities(), vec![2, 1]);
    sleep(Duration::from_secs(5)).await;
    settle().await;
    // At 15 s the 5 s attempt finished: the pending continuation claims at once.
    assert_calls!(src, claim = 3, next_work_at = 1);
    assert_eq!(
        src.times(Op::Claim),
        vec![Duration::ZERO, 10 * SEC, 15 * SEC]
    );
    assert_eq!(src.claim_capacities(), vec![2, 1, 1]);
    src.assert_snapshot_agrees(&r.handle.snapshot());
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_terminal_batch_calls_next_work_at_exactly_once() {
    let src = ScriptedSource::new();
    src.push_claim(Step::ok(ClaimPlan::done(vec![AttemptPlan::ok(SEC); 3])));
    let r = start(&src);
    sleep(Duration::from_secs(299)).await;
    // Attempt completions free capacity only: no further claim or next_work_at before the
    // backstop at 300 s.
    assert_calls!(src, claim = 1, next_work_at = 1, reconcile = 1);
    let snap = r.handle.snapshot();
    assert_eq!(snap.attempts_completed, 3);
    src.assert_snapshot_agrees(&snap);
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_due_time_90s_ahead_claims_exactly_once_at_90s_and_never_before() {
    let src = ScriptedSource::new();
    src.push_next_work_at(Step::ok(Due::In(Duration::from_secs(90))));
    let r = start(&src);
    sleep(Duration::from_secs(89)).await;
    assert_calls!(src, claim = 1, next_work_at = 1);
    sleep(Duration::from_millis(999)).await;
    assert_calls!(src, claim = 1);
    sleep(Duration::from_millis(1)).await;
    settle().await;
    assert_calls!(src, claim = 2, next_work_at = 2, reconcile = 1);
    assert_eq!(src.times(Op::Claim), vec![Duration::ZERO, 90 * SEC]);
    let snap = r.handle.snapshot();
    assert_eq!((snap.timers_armed, snap.timers_fired), (1, 1));
    src.assert_snapshot_agrees(&snap);
    assert!(r.stop().await.is_ok());
}

/// Precise timers change when the thread wakes, never what the controller asks or when, as
/// tokio's clock sees it: the same single claim at exactly 90 s, none a millisecond before.
#[tokio::test(start_paused = true)]
async fn a_precise_timer_claims_exactly_once_at_its_due_time_and_never_before() {
    let src = ScriptedSource::new();
    src.push_next_work_at(Step::ok(Due::In(Duration::from_secs(90))));
    let r = start_with(&src, config(&src).precise_timers(true));
    sleep(Duration::from_secs(89)).await;
    assert_calls!(src, claim = 1, next_work_at = 1);
    // Past the wheel's early wake (90 s - PRECISE_TIMER_LEAD), still before the due time.
    sleep(Duration::from_millis(999)).await;
    settle().await;
    assert_calls!(src, claim = 1, next_work_at = 1);
    sleep(Duration::from_millis(1)).await;
    settle().await;
    assert_calls!(src, claim = 2, next_work_at = 2, reconcile = 1);
    assert_eq!(src.times(Op::Claim), vec![Duration::ZERO, 90 * SEC]);
    let snap = r.handle.snapshot();
    assert_eq!((snap.timers_armed, snap.timers_fired), (1, 1));
    src.assert_snapshot_agrees(&snap);
    assert!(r.stop().await.is_ok());
}

/// On the real clock (the blocking-pool sleep really runs), a precise timer still never fires
/// before its due time. Only "not before" is asserted: how soon after is the evidence tool's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_precise_timer_on_the_real_clock_never_fires_before_its_due_time() {
    for _ in 0..5 {
        let src = ScriptedSource::new();
        src.push_next_work_at(Step::ok(Due::In(Duration::from_millis(30))));
        let r = start_with(&src, config(&src).precise_timers(true));
        let begun = tokio::time::Instant::now();
        while src.times(Op::Claim).len() < 2 {
            assert!(begun.elapsed() < Duration::from_secs(60), "the timer fired");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let times = src.times(Op::Claim);
        let answered = src.times(Op::NextWorkAt)[0];
        assert!(
            times[1] >= answered + Duration::from_millis(30),
            "claimed at {:?}, due at {:?}",
            times[1],
            answered + Duration::from_millis(30)
        );
        assert!(r.stop().await.is_ok());
    }
}

#[tokio::test(start_paused = true)]
async fn a_newer_earlier_due_time_replaces_the_older_timer() {
    let src = ScriptedSource::new();
    src.push_next_work_at(Step::ok(Due::In(Duration::from_secs(90))));
    src.push_next_work_at(Step::ok(Due::In(Duration::from_secs(20))));
    let r = start(&src);
    assert!(r.handle.ready().await);
    settle().await;
    sleep(Duration::from_secs(10)).await;
    r.handle.waker().wake();
    settle().await;
    // The wake's claim got `next_work_at` = 10 s + 20 s; the 90 s timer is gone.
    assert_calls!(src, claim = 2, next_work_at = 2);
    sleep(Duration::from_secs(100)).await;
    assert_eq!(
        src.times(Op::Claim),
        vec![Duration::ZERO, 10 * SEC, 30 * SEC]
    );
    assert_calls!(src, claim = 3, next_work_at = 3);
    let snap = r.handle.snapshot();
    assert_eq!((snap.timers_armed, snap.timers_fired), (2, 1));
    src.assert_snapshot_agrees(&snap);
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_retime_rereads_next_work_at_and_rearms_without_a_claim() {
    let src = ScriptedSource::new();
    src.push_next_work_at(Step::ok(Due::Never));
    src.push_next_work_at(Step::ok(Due::In(10 * SEC)));
    let r = start(&src);
    sleep(SEC).await;
    settle().await;
    assert_calls!(src, reconcile = 1, claim = 1, next_work_at = 1);
    // An attempt committed a new due time: two retimes coalesce into one read, no claim.
    r.handle.waker().retime();
    r.handle.waker().retime();
    settle().await;
    assert_calls!(src, reconcile = 1, claim = 1, next_work_at = 2);
    sleep(10 * SEC).await;
    settle().await;
    assert_calls!(src, reconcile = 1, claim = 2, next_work_at = 3);
    assert_eq!(src.times(Op::Claim), vec![Duration::ZERO, 11 * SEC]);
    let snap = r.handle.snapshot();
    assert_eq!((snap.retimes_received, snap.timers_fired), (2, 1));
    src.assert_snapshot_agrees(&snap);
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn work_that_fell_due_during_the_claim_is_claimed_at_once_but_only_once() {
    let src = ScriptedSource::new();
    // The first claim takes 2 s; the answer after it is due 1 s ago, i.e. 1 s after that
    // claim began: it fell due while the claim ran, so it is claimed again at once. The second
    // answer is due 5 s ago, before the second claim began: suppressed, no replay.
    src.push_claim(Step::ok(ClaimPlan::empty()).after(2 * SEC));
    src.push_next_work_at(Step::ok(Due::Ago(SEC)));
    src.push_next_work_at(Step::ok(Due::Ago(5 * SEC)));
    let r = start(&src);
    sleep(10 * SEC).await;
    settle().await;
    assert_calls!(src, reconcile = 1, claim = 2, next_work_at = 2);
    assert_eq!(src.times(Op::Claim), vec![Duration::ZERO, 2 * SEC]);
    let snap = r.handle.snapshot();
    assert_eq!((snap.due_during_claim, snap.overdue_suppressed), (1, 1));
    assert_eq!(snap.timers_armed, 0);
    src.assert_snapshot_agrees(&snap);
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn an_always_due_source_costs_two_claims_after_startup_and_two_per_backstop_turn() {
    // A store round trip of 10 ms per claim, and a `next_work_at` that always answers "due now"
    // (a row another replica holds, or a store clock behind ours): without the bound on
    // `due_during_claim` this was 6,001 empty claims in one idle minute.
    let src = ScriptedSource::new();
    src.default_claim_delay(Duration::from_millis(10));
    src.default_due(Due::Ago(Duration::ZERO));
    let r = start(&src);
    sleep(SEC).await;
    settle().await;
    // Start-up claim, its one due re-claim, then suppression.
    assert_calls!(src, reconcile = 1, claim = 2, next_work_at = 2);
    let snap = r.handle.snapshot();
    assert_eq!((snap.due_during_claim, snap.overdue_suppressed), (1, 1));
    // Nothing more for the rest of the backstop period.
    sleep(Duration::from_secs(298)).await;
    settle().await;
    assert_calls!(src, reconcile = 1, claim = 2, next_work_at = 2);
    // Each backstop turn costs one reconcile and at most two claims.
    for turn in 1..=3u64 {
        sleep(Duration::from_secs(300)).await;
        settle().await;
        let n = 1 + turn as usize;
        assert_calls!(src, reconcile = n, claim = 2 * n, next_work_at = 2 * n);
    }
    let snap = r.handle.snapshot();
    assert_eq!((snap.due_during_claim, snap.overdue_suppressed), (4, 4));
    assert_eq!(snap.timers_armed, 0);
    src.assert_snapshot_agrees(&snap);
    // A wake is a new fact: one claim, one due re-claim, then quiet again.
    r.handle.waker().wake();
    sleep(Duration::from_millis(100)).await;
    settle().await;
    assert_calls!(src, reconcile = 4, claim = 10, next_work_at = 10);
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_due_time_inside_one_claim_is_claimed_once_and_not_left_for_the_backstop() {
    // The claim takes 2 s; the answer is due 1 s after it began. It is claimed at once (not
    // after 300 s), and the re-claim's own answer (due in 60 s) arms a timer normally.
    let src = ScriptedSource::new();
    src.push_claim(Step::ok(ClaimPlan::empty()).after(2 * SEC));
    src.push_next_work_at(Step::ok(Due::Ago(SEC)));
    src.push_next_work_at(Step::ok(Due::In(Duration::from_secs(60))));
    let r = start(&src);
    sleep(3 * SEC).await;
    settle().await;
    assert_calls!(src, claim = 2, next_work_at = 2);
    assert_eq!(src.times(Op::Claim), vec![Duration::ZERO, 2 * SEC]);
    let snap = r.handle.snapshot();
    assert_eq!(
        (
            snap.due_during_claim,
            snap.overdue_suppressed,
            snap.timers_armed
        ),
        (1, 0, 1)
    );
    sleep(Duration::from_secs(60)).await;
    settle().await;
    assert_calls!(src, claim = 3);
    assert_eq!(src.times(Op::Claim)[2], Duration::from_secs(62));
    src.assert_snapshot_agrees(&r.handle.snapshot());
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn an_already_due_next_work_at_is_not_armed_and_nothing_runs_until_wake_or_backstop() {
    for due in [Due::Ago(Duration::ZERO), Due::Ago(Duration::from_secs(5))] {
        let src = ScriptedSource::new();
        src.push_next_work_at(Step::ok(due));
        let r = start(&src);
        sleep(Duration::from_secs(299)).await;
        let snap = r.handle.snapshot();
        assert_eq!(snap.overdue_suppressed, 1, "{due:?}");
        assert_eq!(snap.timers_armed, 0);
        assert_calls!(src, reconcile = 1, claim = 1, next_work_at = 1);
        // The backstop at 300 s recovers.
        sleep(SEC).await;
        settle().await;
        assert_calls!(src, reconcile = 2, claim = 2, next_work_at = 2);
        src.assert_snapshot_agrees(&r.handle.snapshot());
        assert!(r.stop().await.is_ok());
    }
}

#[tokio::test(start_paused = true)]
async fn attempt_completion_while_a_future_timer_is_armed_makes_no_source_call() {
    let src = ScriptedSource::new();
    src.push_claim(Step::ok(ClaimPlan::done(vec![
        AttemptPlan::ok(SEC),
        AttemptPlan::ok(2 * SEC),
    ])));
    src.push_next_work_at(Step::ok(Due::In(Duration::from_secs(60))));
    let r = start(&src);
    sleep(Duration::from_secs(59)).await;
    assert_eq!(r.handle.snapshot().attempts_completed, 2);
    assert_calls!(src, claim = 1, next_work_at = 1);
    src.assert_snapshot_agrees(&r.handle.snapshot());
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_thousand_wakes_during_an_in_flight_claim_cause_exactly_one_more_claim_turn() {
    let src = ScriptedSource::new();
    let r = start(&src);
    assert!(r.handle.ready().await);
    settle().await;
    src.push_claim(Step::ok(ClaimPlan::empty()).after(SEC));
    let waker = r.handle.waker();
    waker.wake();
    settle().await;
    assert_calls!(src, claim = 2);
    for _ in 0..1000 {
        waker.wake();
    }
    sleep(Duration::from_secs(10)).await;
    assert_calls!(src, claim = 3, next_work_at = 3, reconcile = 1);
    let snap = r.handle.snapshot();
    assert_eq!(snap.wakes_received, 1001);
    assert_eq!(snap.wakes_coalesced, 999);
    src.assert_snapshot_agrees(&snap);
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn wakes_before_a_claim_turn_coalesce_and_never_reconcile() {
    let src = ScriptedSource::new();
    let r = start(&src);
    assert!(r.handle.ready().await);
    settle().await;
    for _ in 0..50 {
        r.handle.waker().wake();
    }
    settle().await;
    assert_calls!(src, reconcile = 1, claim = 2, next_work_at = 2);
    assert_eq!(r.handle.snapshot().wakes_coalesced, 49);
    src.assert_snapshot_agrees(&r.handle.snapshot());
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn request_reconcile_reconciles_before_the_next_claim_and_requests_coalesce() {
    let src = ScriptedSource::new();
    let r = start(&src);
    assert!(r.handle.ready().await);
    settle().await;
    for _ in 0..10 {
        r.handle.request_reconcile();
    }
    r.handle.waker().wake();
    settle().await;
    assert_calls!(src, reconcile = 2, claim = 2, next_work_at = 2);
    let order = ops(&src);
    assert_eq!(
        &order[5..],
        &[Op::Reconcile, Op::Claim, Op::NextWorkAt],
        "reconcile before claim: {order:?}"
    );
    let snap = r.handle.snapshot();
    assert_eq!(snap.reconciles.requested, 1);
    assert_eq!(snap.reconciles.startup, 1);
    src.assert_snapshot_agrees(&snap);
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_changed_generation_reconciles_and_an_unchanged_one_costs_nothing() {
    let src = ScriptedSource::new();
    src.set_generation(1);
    let r = start(&src);
    assert!(r.handle.ready().await);
    settle().await;
    assert_calls!(
        src,
        reconcile = 1,
        claim = 1,
        next_work_at = 1,
        generation_changed = 1
    );

    // Spurious returns with the same cursor: the probe waits again, nothing else happens.
    for _ in 0..5 {
        src.generation_event(GenEvent::Spurious);
        settle().await;
    }
    assert_calls!(
        src,
        reconcile = 1,
        claim = 1,
        next_work_at = 1,
        generation_changed = 6
    );
    assert_eq!(r.handle.snapshot().generation_spurious, 5);

    src.generation_event(GenEvent::Changed(2));
    settle().await;
    assert_calls!(
        src,
        reconcile = 2,
        claim = 2,
        next_work_at = 2,
        generation_changed = 7
    );
    let order: Vec<Op> = ops(&src)
        .into_iter()
        .filter(|o| *o != Op::GenerationChanged)
        .collect();
    assert_eq!(
        &order[order.len() - 3..],
        &[Op::Reconcile, Op::Claim, Op::NextWorkAt]
    );
    let snap = r.handle.snapshot();
    assert_eq!(snap.generation_changes, 1);
    assert_eq!(snap.reconciles.generation_change, 1);
    src.assert_snapshot_agrees(&snap);
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_generation_error_is_a_loss_that_reconciles_once_and_never_poisons() {
    let src = ScriptedSource::new();
    src.set_generation(1);
    let cfg = config(&src).generation_retry(SEC);
    let r = start_with(&src, cfg);
    assert!(r.handle.ready().await);
    settle().await;
    // The probe fails, and its re-reads fail twice more (one loss streak).
    src.fail_generation_reads(2);
    src.generation_event(GenEvent::Error);
    settle().await;
    assert_calls!(src, reconcile = 2, claim = 2, next_work_at = 2);
    // Retries at +1 s and +2 s fail; at +4 s the read succeeds with an unchanged cursor.
    sleep(Duration::from_secs(10)).await;
    assert_calls!(
        src,
        reconcile = 2,
        claim = 2,
        next_work_at = 2,
        generation = 4
    );
    let snap = r.handle.snapshot();
    assert_eq!(snap.generation_losses, 3);
    assert_eq!(snap.reconciles.generation_loss, 1);
    assert_eq!(snap.poisoned, None);
    assert_eq!(src.times(Op::Generation)[1..], [SEC, 3 * SEC, 7 * SEC]);
    src.assert_snapshot_agrees(&snap);
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_failed_startup_generation_read_is_recorded_and_does_not_poison() {
    let src = ScriptedSource::new();
    src.set_generation(1).fail_generation_reads(1);
    let r = start(&src);
    assert!(r.handle.ready().await);
    settle().await;
    assert_calls!(src, reconcile = 1, claim = 1);
    assert_eq!(r.handle.snapshot().generation_losses, 1);
    // The probe re-establishes after the retry delay; with no cursor to compare against it
    // reconciles once, in case a change was missed.
    sleep(Duration::from_secs(2)).await;
    assert_calls!(src, reconcile = 2, claim = 2, generation = 2);
    src.assert_snapshot_agrees(&r.handle.snapshot());
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn ten_idle_hours_cost_exactly_the_backstop_and_nothing_else() {
    let src = ScriptedSource::new();
    src.set_generation(1);
    let r = start(&src);
    sleep(Duration::from_secs(10 * 3600)).await;
    settle().await;
    // Startup (1) + one backstop every 5 minutes (120), each followed by one claim and one
    // next_work_at. The generation probe sits in a single change wait.
    assert_calls!(
        src,
        check_ready = 1,
        generation = 1,
        generation_changed = 1,
        reconcile = 121,
        claim = 121,
        next_work_at = 121
    );
    let snap = r.handle.snapshot();
    assert_eq!(snap.reconciles.backstop, 120);
    let times = src.times(Op::Reconcile);
    assert!(
        times
            .windows(2)
            .all(|w| w[1] - w[0] == Duration::from_secs(300)),
        "backstop is exact with zero jitter"
    );
    src.assert_snapshot_agrees(&snap);
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn jitter_only_shortens_the_backstop_period() {
    let src = ScriptedSource::new();
    let cfg = config(&src).reconcile_jitter(Duration::from_secs(60));
    let r = start_with(&src, cfg);
    sleep(Duration::from_secs(3600)).await;
    let times = src.times(Op::Reconcile);
    assert!(times.len() >= 13, "{times:?}");
    for w in times.windows(2) {
        let gap = w[1] - w[0];
        assert!(
            gap >= Duration::from_secs(240) && gap <= Duration::from_secs(300),
            "{gap:?}"
        );
    }
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn an_outcome_unknown_reconcile_error_poisons_and_the_controller_is_gone() {
    let src = ScriptedSource::new();
    src.push_reconcile(Step::ok(()));
    src.push_reconcile(Step::err("connection reset"));
    let r = start(&src);
    assert!(r.handle.ready().await);
    r.handle.request_reconcile();
    let err = r.task.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), RunErrorKind::OutcomeUnknown);
    assert_eq!(err.operation(), Some("reconcile"));
    assert!(err.is_outcome_unknown() && err.is_poisoned());
    assert!(
        err.into_controller().is_none(),
        "a poisoned controller is never handed back"
    );
    let reason = r.handle.poison_reason().expect("poisoned");
    assert!(reason.contains("connection reset"), "{reason}");
    assert!(!r.handle.snapshot().ready);
    assert_calls!(src, reconcile = 2, claim = 1);
}

#[tokio::test(start_paused = true)]
async fn an_outcome_unknown_claim_error_poisons() {
    let src = ScriptedSource::new();
    src.push_claim(Step::err("lost response"));
    let r = start(&src);
    let err = r.task.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), RunErrorKind::OutcomeUnknown);
    assert_eq!(err.operation(), Some("claim"));
    assert!(err.is_poisoned());
    assert!(r.handle.is_poisoned());
    assert_calls!(src, claim = 1, next_work_at = 0);
    src.assert_snapshot_agrees(&r.handle.snapshot());
}

#[tokio::test(start_paused = true)]
async fn a_claim_error_caused_by_cancellation_still_poisons() {
    let src = ScriptedSource::new();
    let r = start(&src);
    assert!(r.handle.ready().await);
    settle().await;
    // The next claim is in flight for 60 s and errors when cancelled (response lost).
    src.push_claim(Step::ok(ClaimPlan::empty()).after(Duration::from_secs(60)));
    r.handle.waker().wake();
    settle().await;
    assert_calls!(src, claim = 2);
    let err = r.stop().await.unwrap_err();
    assert_eq!(err.kind(), RunErrorKind::OutcomeUnknown);
    assert!(err.to_string().contains("during cancellation"), "{err}");
    assert!(err.is_poisoned());
    assert_eq!(src.ops_cancelled(), 1);
    assert_eq!(src.ops_dropped(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_superseded_source_stops_ready_without_poison_and_says_why() {
    for op in [Op::Reconcile, Op::Claim] {
        let src = ScriptedSource::new();
        // The startup reconcile and claim succeed; the fence answers "superseded" on the next.
        match op {
            Op::Reconcile => {
                src.push_reconcile(Step::ok(()));
                src.push_reconcile(Step::superseded("generation 2 owns bulk"));
            }
            _ => {
                src.push_claim(Step::ok(ClaimPlan::empty()));
                src.push_claim(Step::superseded("generation 2 owns bulk"));
            }
        };
        let ctl = Controller::new(src.clone(), config(&src)).unwrap();
        let handle = ctl.handle();
        let task = tokio::spawn(ctl.run(CancellationToken::new()));
        assert!(handle.ready().await);
        assert!(handle.snapshot().ready);
        match op {
            Op::Reconcile => handle.request_reconcile(),
            _ => handle.waker().wake(),
        }
        let err = task.await.unwrap().unwrap_err();
        assert_eq!(err.kind(), RunErrorKind::Superseded, "{op:?}");
        assert!(err.is_superseded() && !err.is_poisoned() && !err.is_outcome_unknown());
        assert_eq!(err.operation(), Some(op.name()));
        assert!(err.to_string().contains("generation 2 owns bulk"), "{err}");
        assert!(!handle.snapshot().ready, "readiness goes false");
        assert!(!handle.is_poisoned());
        src.assert_snapshot_agrees(&handle.snapshot());
    }
}

#[tokio::test(start_paused = true)]
async fn the_snapshot_reports_claim_batch_sizes_and_latency() {
    let src = ScriptedSource::new();
    // Startup claim: 10 ms, empty. Then a wake: 30 ms, full (4 of 4, more). Then 600 ms, 1 of 4.
    src.push_claim(Step::ok(ClaimPlan::empty()).after(Duration::from_millis(10)));
    src.push_claim(
        Step::ok(ClaimPlan::more(vec![AttemptPlan::ok(Duration::ZERO); 4]))
            .after(Duration::from_millis(30)),
    );
    src.push_claim(
        Step::ok(ClaimPlan::done(vec![AttemptPlan::ok(Duration::ZERO)]))
            .after(Duration::from_millis(600)),
    );
    let before_any = std::time::SystemTime::now();
    let r = start(&src);
    assert_eq!(r.handle.snapshot().last_claim_at, None, "no claim yet");
    sleep(SEC).await;
    r.handle.waker().wake();
    sleep(2 * SEC).await;
    settle().await;
    let snap = r.handle.snapshot();
    // The wall clock of the last claim's return (the paused tokio clock does not move it).
    let last = snap.last_claim_at.expect("claimed");
    assert!(
        last + Duration::from_millis(1) >= before_any && last <= std::time::SystemTime::now(),
        "{last:?}"
    );
    assert_eq!(src.claim_capacities(), vec![4, 4, 4]);
    assert_eq!(snap.claim_calls, 3);
    assert_eq!(snap.claim_capacity_asked, 12);
    assert_eq!(snap.attempts_claimed, 5);
    assert_eq!((snap.claims_empty, snap.claims_full), (1, 1));
    let l = snap.claim_latency;
    assert_eq!(l.count(), 3);
    assert_eq!(l.sum, Duration::from_millis(640));
    assert_eq!(l.max, Duration::from_millis(600));
    // 10 ms -> le 10 ms; 30 ms -> le 100 ms; 600 ms -> le 2 s.
    let bounds = nexuscrm_worker::CLAIM_LATENCY_BOUNDS;
    let at = |d: Duration| bounds.iter().position(|b| *b == d).unwrap();
    let mut want = [0u64; 9];
    want[at(Duration::from_millis(10))] = 1;
    want[at(Duration::from_millis(100))] = 1;
    want[at(Duration::from_secs(2))] = 1;
    assert_eq!(l.buckets, want);
    assert_eq!(l.cumulative()[8], 3);
    src.assert_snapshot_agrees(&snap);
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_not_committed_error_ends_run_but_leaves_the_controller_reusable() {
    for op in [Op::Reconcile, Op::Claim] {
        let src = ScriptedSource::new();
        match op {
            Op::Reconcile => src.push_reconcile(Step::not_committed("serialization failure")),
            _ => src.push_claim(Step::not_committed("deadlock, rolled back")),
        };
        let ctl = Controller::new(src.clone(), config(&src)).unwrap();
        let handle = ctl.handle();
        let err = ctl.run(CancellationToken::new()).await.unwrap_err();
        assert_eq!(err.kind(), RunErrorKind::NotCommitted, "{op:?}");
        assert_eq!(err.operation(), Some(op.name()));
        assert!(!err.is_poisoned());
        assert!(!handle.is_poisoned());
        let ctl = err.into_controller().expect("reusable");
        let cancel = CancellationToken::new();
        let task = tokio::spawn(ctl.run(cancel.clone()));
        assert!(handle.ready().await);
        cancel.cancel();
        assert!(task.await.unwrap().is_ok());
        src.assert_snapshot_agrees(&handle.snapshot());
    }
}

#[tokio::test(start_paused = true)]
async fn a_not_committed_error_caused_by_our_own_cancellation_is_a_clean_stop() {
    let src = ScriptedSource::new();
    let r = start(&src);
    assert!(r.handle.ready().await);
    settle().await;
    src.push_claim(
        Step::not_committed("interrupted before commit")
            .after(Duration::from_secs(60))
            .on_cancel(OnCancel::Finish),
    );
    r.handle.waker().wake();
    settle().await;
    let handle = r.handle.clone();
    assert!(
        r.stop().await.is_ok(),
        "nothing committed and we were stopping anyway"
    );
    assert!(!handle.is_poisoned());
    assert_calls!(src, claim = 2);
}

#[tokio::test(start_paused = true)]
async fn an_attempt_error_cancels_the_others_drains_and_poisons() {
    fail_one_attempt(AttemptPlan::failing(SEC), RunErrorKind::AttemptFailed).await;
}

#[tokio::test(start_paused = true)]
async fn an_attempt_panic_cancels_the_others_drains_and_poisons() {
    fail_one_attempt(AttemptPlan::panicking(SEC), RunErrorKind::AttemptPanicked).await;
}

#[tokio::test(start_paused = true)]
async fn an_attempt_proven_not_committed_stops_the_controller_reusable_not_poisoned() {
    let src = ScriptedSource::new();
    let long = AttemptPlan::ok(Duration::from_secs(3600));
    src.push_claim(Step::ok(ClaimPlan::done(vec![
        long,
        AttemptPlan::not_committing(SEC),
        long,
    ])));
    let t0 = tokio::time::Instant::now();
    let r = start(&src);
    let handle = r.handle.clone();
    let err = r.task.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), RunErrorKind::NotCommitted, "{err}");
    assert!(!err.is_poisoned());
    assert!(!handle.is_poisoned());
    assert!(err.to_string().contains("did not commit"), "{err}");
    assert_eq!(err.in_flight(), 0, "the others released within the bound");
    assert_eq!(src.attempts_released(), 2, "the others were cancelled");
    assert_eq!(tokio::time::Instant::now() - t0, SEC, "stopped at once");
    assert_calls!(src, claim = 1);
    let snap = handle.snapshot();
    assert_eq!(snap.attempts_failed, 1);
    assert!(snap.poisoned.is_none());
    src.assert_snapshot_agrees(&snap);
}

async fn fail_one_attempt(bad: AttemptPlan, kind: RunErrorKind) {
    let src = ScriptedSource::new();
    let long = AttemptPlan::ok(Duration::from_secs(3600));
    src.push_claim(Step::ok(ClaimPlan::done(vec![long, bad, long])));
    let t0 = tokio::time::Instant::now();
    let r = start(&src);
    let err = r.task.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), kind);
    assert!(err.is_poisoned());
    assert_eq!(err.in_flight(), 0, "the others released within the bound");
    assert_eq!(
        src.attempts_released(),
        2,
        "the other attempts were cancelled"
    );
    assert_eq!(src.in_flight(), 0);
    assert_eq!(tokio::time::Instant::now() - t0, SEC, "stopped at once");
    assert_calls!(src, claim = 1);
    let snap = r.handle.snapshot();
    assert_eq!(snap.attempts_failed, 1);
    assert!(snap.poisoned.is_some());
    src.assert_snapshot_agrees(&snap);
}

#[tokio::test(start_paused = true)]
async fn graceful_drain_of_cancelled_attempts_returns_ok_and_a_reusable_controller() {
    let src = ScriptedSource::new();
    src.push_claim(Step::ok(ClaimPlan::done(vec![
        AttemptPlan::ok(
            Duration::from_secs(3600)
        );
        3
    ])));
    let r = start(&src);
    sleep(SEC).await;
    assert_eq!(src.in_flight(), 3);
    let handle = r.handle.clone();
    let ctl = r.stop().await.expect("clean drain");
    assert_eq!(src.attempts_released(), 3);
    assert_eq!(handle.snapshot().in_flight, 0);
    assert!(!handle.is_poisoned());
    src.assert_snapshot_agrees(&handle.snapshot());
    // Reusable.
    let cancel = CancellationToken::new();
    let task = tokio::spawn(ctl.run(cancel.clone()));
    assert!(handle.ready().await);
    cancel.cancel();
    assert!(task.await.unwrap().is_ok());
}

#[tokio::test(start_paused = true)]
async fn an_attempt_ignoring_cancellation_gives_the_in_flight_count_after_exactly_the_bound() {
    let src = ScriptedSource::new();
    src.push_claim(Step::ok(ClaimPlan::done(vec![
        AttemptPlan::ok(Duration::from_secs(3600)).ignoring_cancel(),
        AttemptPlan::ok(Duration::from_secs(3600)),
    ])));
    let r = start(&src);
    let handle = r.handle.clone();
    sleep(SEC).await;
    let stopped_at = tokio::time::Instant::now();
    let err = r.stop().await.unwrap_err();
    assert_eq!(
        tokio::time::Instant::now() - stopped_at,
        Duration::from_secs(10)
    );
    assert_eq!(err.kind(), RunErrorKind::ShutdownTimeout);
    assert_eq!(err.in_flight(), 1);
    assert!(err.is_poisoned());
    assert_eq!(
        src.in_flight(),
        1,
        "the stubborn attempt is still running, not aborted"
    );
    assert_eq!(handle.snapshot().in_flight, 1);
    assert!(handle.poison_reason().unwrap().contains("1 attempt(s)"));
    // It was never aborted: it finishes on its own.
    sleep(Duration::from_secs(3600)).await;
    assert_eq!(src.in_flight(), 0);
    assert_eq!(src.attempts_finished(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_claim_in_flight_when_cancellation_arrives_is_awaited_to_completion() {
    let src = ScriptedSource::new();
    let r = start_with(&src, config(&src).shutdown_timeout(Duration::from_secs(60)));
    assert!(r.handle.ready().await);
    settle().await;
    // The claim commits during cancellation and returns its attempt anyway.
    src.push_claim(
        Step::ok(ClaimPlan::done(vec![AttemptPlan::ok(Duration::from_secs(
            60,
        ))]))
        .after(Duration::from_secs(30))
        .on_cancel(OnCancel::Ignore),
    );
    r.handle.waker().wake();
    sleep(SEC).await;
    let completed_before = src.ops_completed();
    let cancelled_at = tokio::time::Instant::now();
    let ctl = r
        .stop()
        .await
        .expect("clean: the claimed attempt released on cancellation");
    assert_eq!(
        tokio::time::Instant::now() - cancelled_at,
        Duration::from_secs(29)
    );
    assert_eq!(
        src.ops_completed(),
        completed_before + 1,
        "the claim future completed"
    );
    assert_eq!(src.ops_dropped(), 0, "no Source future was dropped");
    assert_eq!(
        src.attempts_released(),
        1,
        "the late attempt ran with a cancelled token"
    );
    assert_calls!(src, claim = 2, next_work_at = 1);
    src.assert_snapshot_agrees(&ctl.handle().snapshot());
}

#[tokio::test(start_paused = true)]
async fn a_source_operation_ignoring_cancellation_past_the_bound_poisons() {
    let src = ScriptedSource::new();
    let r = start(&src);
    assert!(r.handle.ready().await);
    settle().await;
    src.push_reconcile(
        Step::ok(())
            .after(Duration::from_secs(3600))
            .on_cancel(OnCancel::Ignore),
    );
    r.handle.request_reconcile();
    settle().await;
    let err = r.stop().await.unwrap_err();
    assert_eq!(err.kind(), RunErrorKind::ShutdownTimeout);
    assert_eq!(err.operation(), Some("reconcile"));
    assert_eq!(
        src.ops_dropped(),
        0,
        "left running on its task, not dropped"
    );
}

#[tokio::test(start_paused = true)]
async fn dropping_the_run_future_poisons_and_leaves_attempts_running() {
    let src = ScriptedSource::new();
    src.push_claim(Step::ok(ClaimPlan::done(vec![
        AttemptPlan::ok(Duration::from_secs(60)).ignoring_cancel(),
    ])));
    let ctl = Controller::new(src.clone(), config(&src)).unwrap();
    let handle = ctl.handle();
    let cancel = CancellationToken::new();
    let task = tokio::spawn(ctl.run(cancel));
    sleep(SEC).await;
    task.abort();
    let _ = task.await;
    assert!(handle.is_poisoned());
    assert_eq!(src.in_flight(), 1, "the attempt was not aborted");
    sleep(Duration::from_secs(60)).await;
    assert_eq!(src.attempts_finished(), 1);
}

#[tokio::test(start_paused = true)]
async fn cancellation_before_ready_stops_cleanly() {
    let src = ScriptedSource::new();
    src.push_check_ready(Step::ok(()).after(SEC).on_cancel(OnCancel::Finish));
    let r = start(&src);
    settle().await;
    let handle = r.handle.clone();
    assert!(r.stop().await.is_ok());
    assert!(!handle.ready().await, "stopped before Ready");
    assert_calls!(src, check_ready = 1, reconcile = 0, claim = 0);
}

#[tokio::test(start_paused = true)]
async fn invalid_configs_are_rejected_with_the_setting_named() {
    let src = ScriptedSource::new();
    let bad = [
        (
            config(&src).reconcile_interval(Duration::ZERO),
            "reconcile_interval",
        ),
        (
            config(&src).reconcile_jitter(Duration::from_secs(300)),
            "reconcile_jitter",
        ),
        (
            config(&src).generation_retry(Duration::ZERO),
            "generation_retry",
        ),
        (Config::new(""), "name"),
    ];
    for (cfg, setting) in bad {
        let err = Controller::new(src.clone(), cfg).unwrap_err();
        assert_eq!(err.setting(), setting);
        assert!(err.to_string().contains(setting));
    }
}

#[tokio::test(start_paused = true)]
async fn the_snapshot_reports_batch_sizes_attempt_durations_and_due_lateness_histograms() {
    let src = ScriptedSource::new();
    // Startup claim: 3 attempts (3 ms, 100 ms, 200 s); the slow one is still in flight when the
    // due timers fire, so the claim cooldown applies to the second one.
    src.push_claim(Step::ok(ClaimPlan::done(vec![
        AttemptPlan::ok(Duration::from_millis(3)),
        AttemptPlan::ok(Duration::from_millis(100)),
        AttemptPlan::ok(Duration::from_secs(200)),
    ])));
    // Due at 90 s: claimed at once (lateness 0). Then due 5 ms after that claim, but the claim
    // cooldown (20 ms from the previous claim) holds it to 90.020 s: 15 ms late.
    src.push_next_work_at(Step::ok(Due::In(Duration::from_secs(90))));
    src.push_next_work_at(Step::ok(Due::In(Duration::from_millis(5))));
    let r = start_with(&src, config(&src).claim_cooldown(Duration::from_millis(20)));
    // Past the slow attempt's end, before the 300 s backstop.
    sleep(Duration::from_secs(250)).await;
    settle().await;
    assert_eq!(
        src.times(Op::Claim),
        vec![
            Duration::ZERO,
            90 * SEC,
            90 * SEC + Duration::from_millis(20)
        ]
    );
    let snap = r.handle.snapshot();
    let ms = |n: u64| n * 1_000_000;

    let b = &snap.claim_batch;
    assert_eq!(b.unit, nexuscrm_worker::HistogramUnit::Items);
    assert_eq!(b.bounds, &nexuscrm_worker::CLAIM_BATCH_BOUNDS[..]);
    // Two empty claims (le 0) and one of 3 (le 4).
    let mut want = vec![0u64; b.bounds.len() + 1];
    want[0] = 2;
    want[3] = 1;
    assert_eq!((b.buckets.clone(), b.sum, b.count()), (want, 3, 3));

    let a = &snap.attempt_duration;
    assert_eq!(a.unit, nexuscrm_worker::HistogramUnit::Nanoseconds);
    // 3 ms (le 5 ms), 100 ms (le 100 ms), 200 s (above the last bound, 120 s).
    let at = |bounds: &[u64], v: u64| bounds.iter().position(|b| *b == v).unwrap();
    let mut want = vec![0u64; a.bounds.len() + 1];
    want[at(a.bounds, ms(5))] = 1;
    want[at(a.bounds, ms(100))] = 1;
    want[a.bounds.len()] = 1;
    assert_eq!(a.buckets, want);
    assert_eq!(a.sum, ms(3) + ms(100) + ms(200_000));
    assert_eq!(a.scaled(a.sum), 200.103);

    let l = &snap.due_lateness;
    // 0 (le 0.1 ms) and 15 ms (le 25 ms).
    let mut want = vec![0u64; l.bounds.len() + 1];
    want[0] = 1;
    want[at(l.bounds, ms(25))] = 1;
    assert_eq!((l.buckets.clone(), l.sum), (want, ms(15)));
    assert_eq!((snap.timers_armed, snap.timers_fired), (2, 2));
    src.assert_snapshot_agrees(&snap);
    assert!(r.stop().await.is_ok());
}

/// The claims of the pipelining scenario: a claim of 4 whose attempts free two slots at 5 ms
/// and two at 50 ms (so slots free while the second claim, 100 ms long, is in flight), then a
/// short terminal claim with one attempt. The default claim after that is empty.
fn pipelining_script(src: &ScriptedSource, on_cancel: OnCancel) {
    src.check_capacity(4);
    let ms = Duration::from_millis;
    src.push_claim(
        Step::ok(ClaimPlan::more(vec![
            AttemptPlan::ok(ms(5)),
            AttemptPlan::ok(ms(5)),
            AttemptPlan::ok(ms(50)),
            AttemptPlan::ok(ms(50)),
        ]))
        .after(ms(10)),
    );
    src.push_claim(
        Step::ok(ClaimPlan::more(vec![
            AttemptPlan::ok(ms(5)),
            AttemptPlan::ok(ms(5)),
        ]))
        .after(ms(100))
        .on_cancel(on_cancel),
    );
    src.push_claim(
        Step::ok(ClaimPlan::done(vec![AttemptPlan::ok(ms(5))]))
            .after(ms(10))
            .on_cancel(on_cancel),
    );
}

#[tokio::test(start_paused = true)]
async fn two_claims_in_flight_refill_freed_slots_under_a_standing_continuation_within_capacity() {
    let ms = Duration::from_millis;
    // One claim at a time (the default): the slots freed at 60 ms wait for the claim in flight.
    let src = ScriptedSource::new();
    pipelining_script(&src, OnCancel::Error);
    let r = start(&src);
    sleep(SEC).await;
    settle().await;
    assert_eq!(src.times(Op::Claim), vec![ms(0), ms(15), ms(115)]);
    assert_eq!(src.claim_capacities(), vec![4, 2, 2]);
    assert_calls!(src, claim = 3, next_work_at = 1);
    src.assert_snapshot_agrees(&r.handle.snapshot());
    assert!(r.stop().await.is_ok());

    // Two in flight: at 60 ms the freed slots are refilled beside the claim in flight, under
    // the continuation of the first claim's `more`. Its terminal answer (70 ms) ends the
    // continuation but, another claim being in flight, reads no `next_work_at`: the slot its
    // attempt frees at 75 ms is not refilled. The last claim's `more` (115 ms) continues; the
    // empty terminal answer after it reads `next_work_at` once. Nothing ever exceeds capacity.
    let src = ScriptedSource::new();
    pipelining_script(&src, OnCancel::Error);
    let r = start_with(&src, config(&src).claims_in_flight(nz(2)));
    sleep(SEC).await;
    settle().await;
    assert_eq!(src.times(Op::Claim), vec![ms(0), ms(15), ms(60), ms(115)]);
    assert_eq!(src.claim_capacities(), vec![4, 2, 2, 2]);
    assert_calls!(src, claim = 4, next_work_at = 1);
    assert_eq!(src.times(Op::NextWorkAt), vec![ms(115)]);
    assert_eq!(src.over_capacity(), 0);
    let snap = r.handle.snapshot();
    assert_eq!(snap.claims_empty, 1, "only the last claim came back empty");
    src.assert_snapshot_agrees(&snap);
    // Idle now: no claim without a new fact.
    sleep(10 * SEC).await;
    assert_calls!(src, claim = 4, next_work_at = 1);
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn with_claims_in_flight_a_reconcile_request_waits_for_them_and_stops_the_refill() {
    let ms = Duration::from_millis;
    let src = ScriptedSource::new();
    pipelining_script(&src, OnCancel::Error);
    let r = start_with(&src, config(&src).claims_in_flight(nz(2)));
    sleep(ms(20)).await;
    r.handle.request_reconcile();
    sleep(SEC).await;
    settle().await;
    // No claim beside the one in flight at 60 ms; the reconciliation runs when it answers
    // (115 ms), before the next claim. That answer's `more` still stands after it, so the
    // slots its attempts free at 120 ms are refilled beside the claim of 115 ms; the later
    // of the two terminal answers (125 ms) reads `next_work_at`, once.
    assert_eq!(src.times(Op::Claim), vec![ms(0), ms(15), ms(115), ms(120)]);
    assert_eq!(src.times(Op::Reconcile), vec![ms(0), ms(115)]);
    assert_eq!(src.times(Op::NextWorkAt), vec![ms(125)]);
    let order: Vec<Op> = ops(&src)
        .into_iter()
        .filter(|o| *o != Op::GenerationChanged)
        .collect();
    assert_eq!(
        &order[order.len() - 4..],
        &[Op::Reconcile, Op::Claim, Op::Claim, Op::NextWorkAt],
        "{order:?}"
    );
    src.assert_snapshot_agrees(&r.handle.snapshot());
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn cancellation_waits_for_every_claim_in_flight_and_their_attempts_then_drains_clean() {
    let ms = Duration::from_millis;
    let src = ScriptedSource::new();
    // The claims finish their work although cancelled (as a store call committing would).
    pipelining_script(&src, OnCancel::Ignore);
    let r = start_with(&src, config(&src).claims_in_flight(nz(2)));
    sleep(ms(65)).await;
    // Two claims are in flight (since 15 and 60 ms): both are awaited, never dropped, and
    // their attempts run with the cancelled token; no further claim and no `next_work_at`.
    assert_eq!(src.times(Op::Claim), vec![ms(0), ms(15), ms(60)]);
    let stopping = tokio::time::Instant::now();
    let outcome = r.stop().await;
    assert!(
        stopping.elapsed() >= ms(50),
        "waited for the claim answering at 115 ms: {:?}",
        stopping.elapsed()
    );
    assert!(outcome.is_ok(), "{:?}", outcome.err());
    assert_calls!(src, claim = 3, next_work_at = 0);
    let snap = outcome.unwrap().handle().snapshot();
    assert_eq!(snap.attempts_claimed, 4 + 2 + 1);
    assert_eq!(snap.attempts_completed, 7);
    assert_eq!(snap.in_flight, 0);
    src.assert_snapshot_agrees(&snap);
}

#[test]
fn claims_in_flight_above_the_capacity_is_refused() {
    let e = Controller::new(
        ScriptedSource::new(),
        Config::new("x").capacity(nz(2)).claims_in_flight(nz(3)),
    )
    .unwrap_err();
    assert_eq!(e.setting(), "claims_in_flight");
    assert!(e.to_string().contains("more than the capacity 2"), "{e}");
    assert!(
        Controller::new(
            ScriptedSource::new(),
            Config::new("x").capacity(nz(2)).claims_in_flight(nz(2))
        )
        .is_ok()
    );
}

/// Two slots; the first claim fills both with attempts that ask for the successor handoff.
fn handoff_script(src: &ScriptedSource) {
    let ms = Duration::from_millis;
    src.push_claim(Step::ok(ClaimPlan::more(vec![
        AttemptPlan::ok(ms(10)).handing_off(),
        AttemptPlan::ok(ms(20)).handing_off(),
    ])));
    // The first granted handoff (10 ms) takes a successor and says more may follow; the
    // second (20 ms) finds the queue empty: a terminal answer.
    src.push_handoff(
        Some(ClaimPlan::more(vec![AttemptPlan::ok(ms(15)).handing_off()])),
        Duration::ZERO,
    );
    src.push_handoff(Some(ClaimPlan::empty()), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn successor_handoffs_refill_freed_slots_without_a_claim_and_a_terminal_one_reads_next_work_at_once()
 {
    let ms = Duration::from_millis;
    // Off (the default): no handoff is ever granted; the slot freed at 10 ms is refilled by a
    // claim under the standing continuation, whose empty answer reads `next_work_at`.
    let src = ScriptedSource::new();
    handoff_script(&src);
    let r = start_with(&src, config(&src).capacity(nz(2)));
    sleep(SEC).await;
    settle().await;
    assert_eq!(src.times(Op::Claim), vec![ms(0), ms(10)]);
    assert_calls!(src, claim = 2, handoff = 0, next_work_at = 1);
    src.assert_snapshot_agrees(&r.handle.snapshot());
    assert!(r.stop().await.is_ok());

    // On: the attempt finishing at 10 ms claims its successor in its disposition (granted:
    // the first claim's `more` stands), so no claim runs. The handoff at 20 ms answers
    // terminal: the offer closes at once, `next_work_at` is read once, and the successor
    // finishing at 25 ms is not granted a handoff (no standing continuation).
    let src = ScriptedSource::new();
    handoff_script(&src);
    let r = start_with(&src, config(&src).capacity(nz(2)).successor_handoff(true));
    sleep(SEC).await;
    settle().await;
    assert_eq!(src.times(Op::Claim), vec![ms(0)]);
    assert_eq!(src.times(Op::Handoff), vec![ms(10), ms(20)]);
    assert_eq!(src.times(Op::NextWorkAt), vec![ms(20)]);
    assert_calls!(src, claim = 1, handoff = 2, next_work_at = 1);
    assert_eq!(src.over_capacity(), 0);
    let snap = r.handle.snapshot();
    assert_eq!(snap.handoffs, 2);
    assert_eq!(snap.handoffs_empty, 1);
    assert_eq!(snap.attempts_handed, 1);
    assert_eq!(snap.attempts_completed, 3);
    src.assert_snapshot_agrees(&snap);
    // Idle now: nothing without a new fact.
    sleep(10 * SEC).await;
    assert_calls!(src, claim = 1, handoff = 2, next_work_at = 1);
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_reconcile_request_closes_the_handoff_offer_and_waits_for_a_begun_handoff() {
    let ms = Duration::from_millis;
    let src = ScriptedSource::new();
    src.push_claim(Step::ok(ClaimPlan::more(vec![
        AttemptPlan::ok(ms(10)).handing_off(),
    ])));
    // Granted at 10 ms, the disposition takes 20 ms and claims a successor; the successor's
    // own handoff (40 ms) has no reply queued: it declines, saying nothing about the queue.
    src.push_handoff(
        Some(ClaimPlan::more(vec![AttemptPlan::ok(ms(10)).handing_off()])),
        ms(20),
    );
    let r = start_with(&src, config(&src).capacity(nz(1)).successor_handoff(true));
    sleep(ms(15)).await;
    r.handle.request_reconcile();
    sleep(SEC).await;
    settle().await;
    // The reconciliation waits for the begun handoff (a claim in flight) and runs when it
    // answers (30 ms). Its `more` still stands after it, so the successor's handoff at 40 ms
    // is granted; its decline frees the slot, which the controller's own claim (due to the
    // reconciliation) refills; that claim's empty answer reads `next_work_at`.
    assert_eq!(src.times(Op::Reconcile), vec![ms(0), ms(30)]);
    assert_eq!(src.times(Op::Handoff), vec![ms(10), ms(40)]);
    assert_eq!(src.times(Op::Claim), vec![ms(0), ms(40)]);
    assert_eq!(src.times(Op::NextWorkAt), vec![ms(40)]);
    let snap = r.handle.snapshot();
    assert_eq!(snap.handoffs_declined, 1);
    assert_eq!(snap.attempts_handed, 1);
    src.assert_snapshot_agrees(&snap);
    assert!(r.stop().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn cancellation_waits_for_a_begun_handoff_and_its_successor_releases() {
    let ms = Duration::from_millis;
    let src = ScriptedSource::new();
    src.push_claim(Step::ok(ClaimPlan::more(vec![
        AttemptPlan::ok(ms(10)).handing_off(),
    ])));
    src.push_handoff(
        Some(ClaimPlan::more(vec![
            AttemptPlan::ok(ms(100)).handing_off(),
        ])),
        ms(20),
    );
    let r = start_with(&src, config(&src).capacity(nz(1)).successor_handoff(true));
    sleep(ms(15)).await;
    let stopping = tokio::time::Instant::now();
    let outcome = r.stop().await;
    // The begun disposition (10 to 30 ms) is awaited, never dropped; its successor starts
    // with the cancelled token, releases at once, and is granted no handoff of its own.
    assert_eq!(stopping.elapsed(), ms(15));
    assert!(outcome.is_ok(), "{:?}", outcome.err());
    assert_calls!(src, claim = 1, handoff = 1, next_work_at = 0);
    let snap = outcome.unwrap().handle().snapshot();
    assert_eq!(snap.attempts_handed, 1);
    assert_eq!(snap.attempts_completed, 2);
    assert_eq!(snap.in_flight, 0);
    src.assert_snapshot_agrees(&snap);
}

#[tokio::test(start_paused = true)]
async fn a_handoff_with_more_than_one_successor_fails_closed_and_poisons() {
    let ms = Duration::from_millis;
    let src = ScriptedSource::new();
    src.push_claim(Step::ok(ClaimPlan::more(vec![
        AttemptPlan::ok(ms(10)).handing_off(),
    ])));
    src.push_handoff(
        Some(ClaimPlan::more(vec![AttemptPlan::ok(ms(10)); 2])),
        Duration::ZERO,
    );
    let r = start_with(&src, config(&src).capacity(nz(1)).successor_handoff(true));
    let err = r.task.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), RunErrorKind::ContractViolation);
    assert_eq!(err.operation(), Some("handoff"));
    assert!(err.is_poisoned());
    assert!(err.to_string().contains("2 successors"), "{err}");
    assert_eq!(src.attempts_started(), 1, "neither successor ran");
}
