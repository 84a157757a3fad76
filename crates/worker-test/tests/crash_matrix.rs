//! The crash matrix accepts an honest adapter and rejects every cheat with a clear message.

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nexuscrm_worker::fault::{CrashPoint, Faults};
use nexuscrm_worker::{BoxError, Declaration};
use nexuscrm_worker_test::memory::{MemoryFamily, MemoryStore, MemoryWorker};
use nexuscrm_worker_test::{CrashContext, CrashFamily, CrashMatrix, Deadlines, Phase};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cheat {
    Honest,
    IgnoresFixture,
    ReusesWorker,
    NeverCrashes,
    HangsAsync,
    HangsBlocking,
    RecoveryPanics,
    /// Returns a `Crash` from a private hook of its own; the armed hook never fires.
    ForgesCrash,
    /// Spawns a writer with plain `tokio::spawn` that keeps writing after the crash.
    SpawnsSurvivor,
}

/// The honest memory family, with one cheat switched on.
struct Cheating {
    inner: MemoryFamily,
    cheat: Cheat,
    reused: Mutex<Option<Arc<MemoryWorker>>>,
    /// Writes made by the crashed worker's stray task, and their count when restart began.
    ghost_writes: Arc<AtomicU64>,
    at_restart: AtomicU64,
}

impl Cheating {
    fn new(cheat: Cheat) -> Self {
        Cheating {
            inner: MemoryFamily::default(),
            cheat,
            reused: Mutex::new(None),
            ghost_writes: Arc::default(),
            at_restart: AtomicU64::new(0),
        }
    }
}

impl CrashFamily for Cheating {
    type Fixture = MemoryStore;
    type Worker = MemoryWorker;

    fn label(&self) -> String {
        format!("memory/{:?}", self.cheat).to_lowercase()
    }

    fn declaration(&self) -> Declaration {
        self.inner.declaration()
    }

    async fn fixture(&self) -> Result<MemoryStore, BoxError> {
        self.inner.fixture().await
    }

    async fn new_worker(
        &self,
        fixture: &Arc<MemoryStore>,
        faults: Faults,
    ) -> Result<Arc<MemoryWorker>, BoxError> {
        match self.cheat {
            Cheat::IgnoresFixture => {
                let own = Arc::new(MemoryStore::new(Duration::from_millis(200)));
                Ok(Arc::new(MemoryWorker::new(&own, faults)))
            }
            Cheat::ReusesWorker => {
                let mut reused = self.reused.lock().unwrap();
                Ok(reused
                    .get_or_insert_with(|| Arc::new(MemoryWorker::new(fixture, faults)))
                    .clone())
            }
            _ => self.inner.new_worker(fixture, faults).await,
        }
    }

    fn worker_fixture<'a>(&self, worker: &'a MemoryWorker) -> &'a Arc<MemoryStore> {
        worker.store()
    }

    async fn crash(
        &self,
        point: CrashPoint,
        worker: Arc<MemoryWorker>,
        ctx: CrashContext,
    ) -> Result<(), BoxError> {
        match self.cheat {
            Cheat::NeverCrashes => Ok(()),
            Cheat::HangsAsync => {
                // Ignores cancellation forever.
                std::future::pending::<()>().await;
                Ok(())
            }
            Cheat::HangsBlocking => {
                std::thread::sleep(Duration::from_secs(20));
                Ok(())
            }
            Cheat::ForgesCrash => {
                let private = Faults::new();
                private.arm(point);
                Err(Box::new(private.hit(point).unwrap_err()))
            }
            Cheat::SpawnsSurvivor => {
                let ghost = self.ghost_writes.clone();
                // Not through `ctx.spawn`: the matrix must still end it with the crash.
                tokio::spawn(async move {
                    loop {
                        ghost.fetch_add(1, SeqCst);
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                });
                tokio::time::sleep(Duration::from_millis(20)).await;
                self.inner.crash(point, worker, ctx).await
            }
            _ => self.inner.crash(point, worker, ctx).await,
        }
    }

    async fn restart(
        &self,
        point: CrashPoint,
        worker: Arc<MemoryWorker>,
        ctx: CrashContext,
    ) -> Result<(), BoxError> {
        if self.cheat == Cheat::SpawnsSurvivor {
            self.at_restart
                .store(self.ghost_writes.load(SeqCst), SeqCst);
            // Give a surviving writer time to show itself.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.inner.restart(point, worker, ctx).await
    }

    async fn recover(&self, point: CrashPoint, fixture: Arc<MemoryStore>) -> Result<(), BoxError> {
        if self.cheat == Cheat::RecoveryPanics {
            panic!("recovery assertion exploded");
        }
        if self.cheat == Cheat::SpawnsSurvivor {
            let (then, now) = (self.at_restart.load(SeqCst), self.ghost_writes.load(SeqCst));
            if then == 0 || now != then {
                return Err(format!(
                    "the crashed worker's task kept writing after the crash ({then} -> {now})"
                )
                .into());
            }
        }
        self.inner.recover(point, fixture).await
    }
}

fn short() -> Deadlines {
    Deadlines {
        construct: Duration::from_secs(10),
        crash: Duration::from_secs(2),
        restart: Duration::from_secs(20),
        recover: Duration::from_secs(10),
    }
}

fn one_cell(cheat: Cheat) -> (Phase, String) {
    let report = CrashMatrix::new(Cheating::new(cheat))
        .filter(None)
        .deadlines(short())
        .run_points(&[CrashPoint::AfterClaim]);
    assert!(!report.passed(), "{cheat:?} must be rejected:\n{report}");
    let cell = report.cell(CrashPoint::AfterClaim).expect("cell ran");
    cell.failure.clone().expect("failed")
}

#[test]
fn an_honest_adapter_passes_every_required_point() {
    let report = CrashMatrix::new(Cheating::new(Cheat::Honest))
        .filter(None)
        .run();
    report.assert_passed();
    assert_eq!(report.cells.len(), CrashPoint::ALL.len());
    let shown = report.to_string();
    assert!(shown.contains("PASS memory/honest/after-claim"), "{shown}");
    assert!(shown.contains("10 of 10 cells passed"), "{shown}");
}

#[test]
fn a_fixture_ignoring_adapter_is_rejected() {
    let (phase, why) = one_cell(Cheat::IgnoresFixture);
    assert_eq!(phase, Phase::Construct);
    assert!(why.contains("not bound to the fixture"), "{why}");
}

#[test]
fn a_single_reused_worker_is_rejected() {
    let (phase, why) = one_cell(Cheat::ReusesWorker);
    assert_eq!(phase, Phase::Construct);
    assert!(why.contains("same worker twice"), "{why}");
}

#[test]
fn a_crash_callback_that_never_reaches_the_point_is_rejected_naming_it() {
    let (phase, why) = one_cell(Cheat::NeverCrashes);
    assert_eq!(phase, Phase::Crash);
    assert!(
        why.contains("the crash at after-claim never fired"),
        "{why}"
    );
}

#[test]
fn a_callback_that_hangs_asynchronously_times_out_and_the_suite_goes_on() {
    let report = CrashMatrix::new(Cheating::new(Cheat::HangsAsync))
        .filter(None)
        .deadlines(short())
        .run_points(&[CrashPoint::AfterClaim, CrashPoint::BeforeEffect]);
    assert_eq!(report.cells.len(), 2, "the matrix went on to the next cell");
    for cell in &report.cells {
        let (phase, why) = cell.failure.clone().expect("failed");
        assert_eq!(phase, Phase::Crash);
        assert!(why.contains("timed out after 2s"), "{why}");
    }
}

#[test]
fn a_callback_that_blocks_its_thread_still_meets_the_deadline() {
    let started = std::time::Instant::now();
    let (phase, why) = one_cell(Cheat::HangsBlocking);
    assert_eq!(phase, Phase::Crash);
    assert!(why.contains("timed out"), "{why}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "did not wait for the blocked thread"
    );
}

#[test]
fn a_panicking_recovery_assertion_fails_the_cell() {
    let (phase, why) = one_cell(Cheat::RecoveryPanics);
    assert_eq!(phase, Phase::Recover);
    assert!(why.contains("recovery assertion exploded"), "{why}");
}

#[test]
fn a_filter_that_selects_nothing_fails() {
    let report = CrashMatrix::new(Cheating::new(Cheat::Honest))
        .filter(Some("no-such-cell"))
        .run();
    assert!(!report.passed());
    assert!(report.invalid.unwrap().contains("selected no cell"));
}

#[test]
fn a_filter_selects_cells_by_label() {
    let report = CrashMatrix::new(Cheating::new(Cheat::Honest))
        .filter(Some("honest/lease-expiry"))
        .run();
    report.assert_passed();
    assert_eq!(report.cells.len(), 1);
    assert_eq!(report.cells[0].point, CrashPoint::LeaseExpiry);
}

#[test]
fn a_non_durable_declaration_is_not_a_crash_matrix_subject() {
    struct Derived(Cheating);
    impl CrashFamily for Derived {
        type Fixture = MemoryStore;
        type Worker = MemoryWorker;
        fn label(&self) -> String {
            "derived".into()
        }
        fn declaration(&self) -> Declaration {
            "derived=derived-reconcilable/convergent".parse().unwrap()
        }
        async fn fixture(&self) -> Result<MemoryStore, BoxError> {
            self.0.fixture().await
        }
        async fn new_worker(
            &self,
            f: &Arc<MemoryStore>,
            faults: Faults,
        ) -> Result<Arc<MemoryWorker>, BoxError> {
            self.0.new_worker(f, faults).await
        }
        fn worker_fixture<'a>(&self, w: &'a MemoryWorker) -> &'a Arc<MemoryStore> {
            w.store()
        }
        async fn crash(
            &self,
            p: CrashPoint,
            w: Arc<MemoryWorker>,
            c: CrashContext,
        ) -> Result<(), BoxError> {
            self.0.crash(p, w, c).await
        }
        async fn restart(
            &self,
            p: CrashPoint,
            w: Arc<MemoryWorker>,
            c: CrashContext,
        ) -> Result<(), BoxError> {
            self.0.restart(p, w, c).await
        }
        async fn recover(&self, p: CrashPoint, f: Arc<MemoryStore>) -> Result<(), BoxError> {
            self.0.recover(p, f).await
        }
    }
    let report = CrashMatrix::new(Derived(Cheating::new(Cheat::Honest))).run();
    assert!(!report.passed());
    assert!(report.invalid.unwrap().contains("not durable-critical"));
}

#[test]
fn a_forged_crash_from_a_private_hook_is_rejected() {
    let (phase, why) = one_cell(Cheat::ForgesCrash);
    assert_eq!(phase, Phase::Crash);
    assert!(why.contains("never fired"), "{why}");
}

#[test]
fn a_task_spawned_by_the_crashed_worker_dies_with_it() {
    let report = CrashMatrix::new(Cheating::new(Cheat::SpawnsSurvivor))
        .filter(None)
        .deadlines(short())
        .run_points(&[CrashPoint::AfterClaim, CrashPoint::AfterDisposition]);
    // The stray writer ran before the crash and wrote nothing after it.
    report.assert_passed();
}
