//! The cross-process signal bridge drives a running controller exactly as in-process calls do.

use std::time::Duration;

use nexuscrm_worker::bridge::{Bridge, Signal};
use nexuscrm_worker::{CancellationToken, Config, Controller};
use nexuscrm_worker_test::{ScriptedSource, assert_calls};
use tokio::time::sleep;

async fn settle() {
    for _ in 0..64 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn payloads_wake_retime_and_reconcile_and_a_closed_channel_is_a_loss() {
    let src = ScriptedSource::new();
    let ctl = Controller::new(
        src.clone(),
        Config::new("bridge")
            .reconcile_jitter(Duration::ZERO)
            .clock(src.clock()),
    )
    .unwrap();
    let handle = ctl.handle();
    let cancel = CancellationToken::new();
    let run = tokio::spawn(ctl.run(cancel.clone()));
    assert!(handle.ready().await);
    settle().await;
    assert_calls!(src, reconcile = 1, claim = 1, next_work_at = 1);

    let bridge = Bridge::new(handle.clone());
    assert_eq!(bridge.payload("wake"), Signal::Wake);
    sleep(Duration::from_millis(1)).await;
    assert_calls!(src, reconcile = 1, claim = 2, next_work_at = 2);

    assert_eq!(bridge.payload(" retime\n"), Signal::Retime);
    sleep(Duration::from_millis(1)).await;
    assert_calls!(src, reconcile = 1, claim = 2, next_work_at = 3);

    // An unclear payload is still a hint that something changed: it wakes.
    assert_eq!(bridge.payload("job 42 inserted"), Signal::Wake);
    sleep(Duration::from_millis(1)).await;
    assert_calls!(src, reconcile = 1, claim = 3, next_work_at = 4);

    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let forward = tokio::spawn(bridge.clone().forward(rx, cancel.clone()));
    tx.send(Signal::Reconcile).await.unwrap();
    sleep(Duration::from_millis(1)).await;
    assert_calls!(src, reconcile = 2, claim = 4);
    drop(tx);
    forward.await.unwrap();
    sleep(Duration::from_millis(1)).await;
    assert_calls!(src, reconcile = 3, claim = 5);
    let snap = handle.snapshot();
    assert_eq!(snap.reconciles.requested, 2);
    assert_eq!((snap.wakes_received, snap.retimes_received), (2, 1));
    src.assert_snapshot_agrees(&snap);

    assert!("wake-up".parse::<Signal>().is_err());
    let long = "x".repeat(10_000);
    let err = long.parse::<Signal>().unwrap_err().to_string();
    assert!(
        err.len() < 200,
        "echoed input is truncated: {} bytes",
        err.len()
    );
    cancel.cancel();
    assert!(run.await.unwrap().is_ok());
}
