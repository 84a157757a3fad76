//! The convergence and declared-loss harnesses accept honest reference families and reject
//! cheats with a clear message.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

use nexuscrm_worker::fault::{CrashPoint, Faults};
use nexuscrm_worker::{BoxError, CancellationToken, Declaration, Durability, Effect};
use nexuscrm_worker_test::harness::{
    Accounting, ConvergenceHarness, ConvergentFamily, LossHarness, LossTolerantFamily,
};

const DERIVED: Declaration = Declaration::new_const(
    "totals",
    Durability::DerivedReconcilable,
    Effect::Convergent,
);
const TELEMETRY: Declaration =
    Declaration::new_const("telemetry", Durability::BestEffort, Effect::LossTolerant);

/// Canonical: account -> amounts. Derived: account -> total.
#[derive(Default)]
struct Totals {
    canonical: Mutex<BTreeMap<u32, Vec<i64>>>,
    derived: Mutex<BTreeMap<u32, i64>>,
    /// Change events as an in-process subscriber saw them (the cheat's only input).
    events: Mutex<Vec<(u32, i64)>>,
}

#[derive(Clone, Copy, PartialEq)]
enum Derive {
    /// Recomputes every total from canonical state.
    Honest,
    /// Applies only the events it was told about since it started (a fresh process starts with
    /// none): the "replay what you saw" shortcut.
    ReplaysEvents,
    /// Writes totals but never reaches the crash points (no fault hook threaded).
    IgnoresFaults,
}

struct TotalsFamily(Derive);

impl ConvergentFamily for TotalsFamily {
    type Fixture = Totals;
    type State = BTreeMap<u32, i64>;

    fn label(&self) -> String {
        "totals".into()
    }

    fn declaration(&self) -> Declaration {
        DERIVED
    }

    async fn fixture(&self) -> Result<Totals, BoxError> {
        Ok(Totals::default())
    }

    async fn change(&self, f: &Totals, step: usize) -> Result<(), BoxError> {
        let (account, amount) = ((step % 3) as u32, step as i64 * 10 + 1);
        f.canonical
            .lock()
            .unwrap()
            .entry(account)
            .or_default()
            .push(amount);
        f.events.lock().unwrap().push((account, amount));
        Ok(())
    }

    async fn derive(
        &self,
        f: &Totals,
        faults: Faults,
        _cancel: CancellationToken,
    ) -> Result<(), BoxError> {
        let hit = |p| -> Result<(), BoxError> {
            if self.0 == Derive::IgnoresFaults {
                Ok(())
            } else {
                faults.hit(p).map_err(|c| Box::new(c) as BoxError)
            }
        };
        let wanted: Vec<(u32, i64)> = match self.0 {
            Derive::ReplaysEvents => {
                // Only the events since this process started: drained, so a crashed process
                // takes them to its grave.
                let seen: Vec<_> = f.events.lock().unwrap().drain(..).collect();
                let mut d = f.derived.lock().unwrap().clone();
                for (a, x) in seen {
                    *d.entry(a).or_default() += x;
                }
                d.into_iter().collect()
            }
            _ => f
                .canonical
                .lock()
                .unwrap()
                .iter()
                .map(|(a, xs)| (*a, xs.iter().sum()))
                .collect(),
        };
        for (i, (account, total)) in wanted.into_iter().enumerate() {
            if i > 0 {
                hit(CrashPoint::DuringHeartbeat)?;
            }
            hit(CrashPoint::BeforeEffect)?;
            if i == 1 {
                hit(CrashPoint::BeforeDisposition)?;
            }
            f.derived.lock().unwrap().insert(account, total);
            hit(CrashPoint::AfterEffect)?;
            if i == 1 {
                hit(CrashPoint::AfterDisposition)?;
            }
        }
        Ok(())
    }

    async fn expected(&self, f: &Totals) -> Result<BTreeMap<u32, i64>, BoxError> {
        Ok(f.canonical
            .lock()
            .unwrap()
            .iter()
            .map(|(a, xs)| (*a, xs.iter().sum()))
            .collect())
    }

    async fn observed(&self, f: &Totals) -> Result<BTreeMap<u32, i64>, BoxError> {
        Ok(f.derived.lock().unwrap().clone())
    }
}

#[test]
fn an_honest_derivation_converges_after_a_crash_at_every_point() {
    let report = ConvergenceHarness::new(TotalsFamily(Derive::Honest)).run();
    println!("{report}");
    report.assert_passed();
    assert_eq!(report.cases.len(), 6);
}

#[test]
fn replaying_remembered_events_does_not_converge_after_a_crash() {
    let report = ConvergenceHarness::new(TotalsFamily(Derive::ReplaysEvents)).run();
    assert!(!report.passed(), "{report}");
    let shown = report.to_string();
    assert!(shown.contains("did not converge"), "{shown}");
}

#[test]
fn a_derivation_that_never_reaches_the_crash_points_is_rejected() {
    let report = ConvergenceHarness::new(TotalsFamily(Derive::IgnoresFaults)).run();
    assert!(!report.passed());
    assert!(report.to_string().contains("never fired"), "{report}");
}

#[test]
fn a_durable_declaration_is_not_a_convergence_subject() {
    struct Wrong(TotalsFamily);
    impl ConvergentFamily for Wrong {
        type Fixture = Totals;
        type State = BTreeMap<u32, i64>;
        fn label(&self) -> String {
            "wrong".into()
        }
        fn declaration(&self) -> Declaration {
            nexuscrm_worker_test::memory::DECLARATION
        }
        async fn fixture(&self) -> Result<Totals, BoxError> {
            self.0.fixture().await
        }
        async fn change(&self, f: &Totals, s: usize) -> Result<(), BoxError> {
            self.0.change(f, s).await
        }
        async fn derive(
            &self,
            f: &Totals,
            x: Faults,
            c: CancellationToken,
        ) -> Result<(), BoxError> {
            self.0.derive(f, x, c).await
        }
        async fn expected(&self, f: &Totals) -> Result<BTreeMap<u32, i64>, BoxError> {
            self.0.expected(f).await
        }
        async fn observed(&self, f: &Totals) -> Result<BTreeMap<u32, i64>, BoxError> {
            self.0.observed(f).await
        }
    }
    let report = ConvergenceHarness::new(Wrong(TotalsFamily(Derive::Honest))).run();
    assert!(!report.passed());
    assert!(report.invalid.unwrap().contains("not derived-reconcilable"));
}

/// A telemetry path: a sink (a vector), a lossy flag, and the path's own counters.
#[derive(Default)]
struct Telemetry {
    lossy: bool,
    sink: Mutex<Vec<u64>>,
    lost: AtomicU64,
    attempted: AtomicU64,
}

#[derive(Clone, Copy, PartialEq)]
enum Report {
    Honest,
    /// Counts only sink drops, not the items a crash abandoned.
    ForgetsCrashLosses,
    /// Says "complete" whatever happened.
    ClaimsComplete,
}

struct TelemetryFamily(Report);

impl LossTolerantFamily for TelemetryFamily {
    type Fixture = Telemetry;

    fn label(&self) -> String {
        "telemetry".into()
    }

    fn declaration(&self) -> Declaration {
        TELEMETRY
    }

    async fn fixture(&self, lossy: bool) -> Result<Telemetry, BoxError> {
        Ok(Telemetry {
            lossy,
            ..Telemetry::default()
        })
    }

    async fn emit(&self, f: &Telemetry, n: u64, faults: Faults) -> Result<(), BoxError> {
        // The emitter records how many it was asked to send before sending any, so a fresh
        // process can account for what a crash abandoned.
        f.attempted.store(n, SeqCst);
        for i in 0..n {
            if i == n / 2 {
                faults.hit(CrashPoint::BeforeEffect)?;
            }
            if f.lossy && i % 7 == 0 {
                f.lost.fetch_add(1, SeqCst); // dropped by a full buffer: counted
            } else {
                f.sink.lock().unwrap().push(i);
            }
            if i == n / 2 {
                faults.hit(CrashPoint::AfterEffect)?;
            }
        }
        Ok(())
    }

    async fn accounting(&self, f: &Telemetry) -> Result<Accounting, BoxError> {
        let delivered = f.sink.lock().unwrap().len() as u64;
        let dropped = f.lost.load(SeqCst);
        let abandoned = f.attempted.load(SeqCst) - delivered - dropped;
        let lost = match self.0 {
            Report::ForgetsCrashLosses => dropped,
            _ => dropped + abandoned,
        };
        Ok(Accounting {
            delivered,
            lost,
            complete: self.0 == Report::ClaimsComplete || lost == 0,
        })
    }

    async fn delivered(&self, f: &Telemetry) -> Result<u64, BoxError> {
        Ok(f.sink.lock().unwrap().len() as u64)
    }
}

#[test]
fn an_honest_loss_tolerant_path_accounts_for_every_item() {
    let report = LossHarness::new(TelemetryFamily(Report::Honest)).run();
    println!("{report}");
    report.assert_passed();
    assert_eq!(report.cases.len(), 4);
}

#[test]
fn a_path_that_forgets_what_a_crash_abandoned_is_rejected() {
    let report = LossHarness::new(TelemetryFamily(Report::ForgetsCrashLosses)).run();
    assert!(!report.passed(), "{report}");
    assert!(report.to_string().contains("unaccounted for"), "{report}");
}

#[test]
fn a_path_that_claims_completeness_after_a_loss_is_rejected() {
    let report = LossHarness::new(TelemetryFamily(Report::ClaimsComplete)).run();
    assert!(!report.passed(), "{report}");
    assert!(
        report.to_string().contains("claims completeness"),
        "{report}"
    );
}
