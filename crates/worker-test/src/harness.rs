//! Proof harnesses for the two non-durable-critical declarations.
//!
//! - [`ConvergenceHarness`] for `derived-reconcilable / convergent`: after a crash at any
//!   point of deriving, while canonical state keeps changing, a *fresh* worker (which never
//!   saw the earlier changes as events) converges the derived state to exactly what the
//!   canonical state implies. A family that replays events it kept in process memory fails.
//! - [`LossHarness`] for `best-effort / loss-tolerant`: whatever is lost (a crash mid-way, a
//!   dropped send) is counted and reported, the reported deliveries match what the sink really
//!   holds, and the path never claims completeness while anything was lost.
//!
//! Each runs its cases on a fresh runtime per case and returns a [`HarnessReport`]; the kit's
//! `tests/harness.rs` shows honest reference families passing and cheats rejected.

use std::fmt;
use std::future::Future;

use nexuscrm_worker::fault::{CrashPoint, Faults};
use nexuscrm_worker::{BoxError, Declaration, Durability, Effect};
use tokio_util::sync::CancellationToken;

/// The points a derivation must survive: around its effect and its disposition, and its
/// heartbeat.
pub const CONVERGENCE_POINTS: [CrashPoint; 5] = [
    CrashPoint::BeforeEffect,
    CrashPoint::AfterEffect,
    CrashPoint::BeforeDisposition,
    CrashPoint::AfterDisposition,
    CrashPoint::DuringHeartbeat,
];

/// One case's outcome.
#[derive(Debug, Clone)]
pub struct CaseResult {
    /// `<label>/<case>`.
    pub name: String,
    /// `None` when the case passed, otherwise why not.
    pub failure: Option<String>,
}

/// Every case's outcome.
#[derive(Debug, Clone)]
pub struct HarnessReport {
    /// The family label.
    pub family: String,
    /// The cases that ran.
    pub cases: Vec<CaseResult>,
    /// Why the whole run is invalid (a wrong declaration), if it is.
    pub invalid: Option<String>,
}

impl HarnessReport {
    /// Whether at least one case ran and every case passed.
    #[must_use]
    pub fn passed(&self) -> bool {
        self.invalid.is_none()
            && !self.cases.is_empty()
            && self.cases.iter().all(|c| c.failure.is_none())
    }

    /// Panics with the report unless it [`passed`](Self::passed).
    ///
    /// # Panics
    ///
    /// When a case failed or none ran.
    #[track_caller]
    pub fn assert_passed(&self) {
        assert!(self.passed(), "harness failed:\n{self}");
    }
}

impl fmt::Display for HarnessReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "harness for {}", self.family)?;
        if let Some(why) = &self.invalid {
            writeln!(f, "  INVALID: {why}")?;
        }
        for c in &self.cases {
            match &c.failure {
                None => writeln!(f, "  PASS {}", c.name)?,
                Some(why) => writeln!(f, "  FAIL {}: {why}", c.name)?,
            }
        }
        let passed = self.cases.iter().filter(|c| c.failure.is_none()).count();
        write!(f, "  {passed} of {} cases passed", self.cases.len())
    }
}

fn run_case<T>(fut: impl Future<Output = Result<T, String>>) -> Result<T, String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot build a runtime: {e}"))?;
    let r = rt.block_on(async {
        tokio::time::timeout(std::time::Duration::from_secs(120), fut)
            .await
            .map_err(|_| "timed out after 120 s".to_string())?
    });
    rt.shutdown_background();
    r
}

/// A `derived-reconcilable / convergent` family under test.
pub trait ConvergentFamily: Send + Sync + 'static {
    /// The store: canonical and derived state.
    type Fixture: Send + Sync + 'static;
    /// A comparable picture of the derived state.
    type State: PartialEq + fmt::Debug + Send;

    /// The case label prefix, e.g. `formula/postgres`.
    fn label(&self) -> String;
    /// Must be `derived-reconcilable / convergent`.
    fn declaration(&self) -> Declaration;
    /// A fresh, isolated store.
    fn fixture(&self) -> impl Future<Output = Result<Self::Fixture, BoxError>> + Send;
    /// Changes canonical state as the domain's producers would (change number `step`).
    fn change(
        &self,
        fixture: &Self::Fixture,
        step: usize,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;
    /// Runs one worker "process" that derives, with `faults` threaded through its real code,
    /// until it has converged (returns `Ok`) or crashed (returns the injected crash error).
    fn derive(
        &self,
        fixture: &Self::Fixture,
        faults: Faults,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;
    /// The derived state the canonical state implies, computed independently of the worker.
    fn expected(
        &self,
        fixture: &Self::Fixture,
    ) -> impl Future<Output = Result<Self::State, BoxError>> + Send;
    /// The derived state as stored.
    fn observed(
        &self,
        fixture: &Self::Fixture,
    ) -> impl Future<Output = Result<Self::State, BoxError>> + Send;
}

/// Proves convergence: per point, changes, a worker crashed at the point while deriving, more
/// changes, then a fresh worker whose derived state must equal what canonical state implies.
#[derive(Debug)]
pub struct ConvergenceHarness<F> {
    family: F,
    changes: usize,
}

impl<F: ConvergentFamily> ConvergenceHarness<F> {
    /// A harness applying 10 canonical changes per case.
    #[must_use]
    pub fn new(family: F) -> Self {
        ConvergenceHarness {
            family,
            changes: 10,
        }
    }

    /// Runs every point of [`CONVERGENCE_POINTS`], then a crash-free case.
    pub fn run(&self) -> HarnessReport {
        let declaration = self.family.declaration();
        let mut report = HarnessReport {
            family: self.family.label(),
            cases: Vec::new(),
            invalid: None,
        };
        if (declaration.durability(), declaration.effect())
            != (Durability::DerivedReconcilable, Effect::Convergent)
        {
            report.invalid = Some(format!(
                "{declaration} is not derived-reconcilable/convergent"
            ));
            return report;
        }
        let cases: Vec<Option<CrashPoint>> = CONVERGENCE_POINTS
            .iter()
            .copied()
            .map(Some)
            .chain([None])
            .collect();
        for point in cases {
            let name = format!(
                "{}/{}",
                report.family,
                point.map_or("no-crash", CrashPoint::as_str)
            );
            let failure = run_case(self.case(point)).err();
            report.cases.push(CaseResult { name, failure });
        }
        report
    }

    async fn case(&self, point: Option<CrashPoint>) -> Result<(), String> {
        let fam = &self.family;
        let fixture = fam.fixture().await.map_err(|e| format!("fixture: {e}"))?;
        let half = self.changes / 2;
        for step in 0..half {
            fam.change(&fixture, step)
                .await
                .map_err(|e| format!("change {step}: {e}"))?;
        }
        if let Some(point) = point {
            let faults = Faults::new();
            faults.arm(point);
            let r = fam
                .derive(&fixture, faults.clone(), CancellationToken::new())
                .await;
            if faults.fired() != Some(point) {
                return Err(format!(
                    "the crash at {point} never fired (derive returned {:?})",
                    r.err().map(|e| e.to_string())
                ));
            }
        }
        // Canonical state moves on while the derived state is stale (or half written).
        for step in half..self.changes {
            fam.change(&fixture, step)
                .await
                .map_err(|e| format!("change {step}: {e}"))?;
        }
        fam.derive(&fixture, Faults::none(), CancellationToken::new())
            .await
            .map_err(|e| format!("the fresh worker failed: {e}"))?;
        let want = fam
            .expected(&fixture)
            .await
            .map_err(|e| format!("expected: {e}"))?;
        let got = fam
            .observed(&fixture)
            .await
            .map_err(|e| format!("observed: {e}"))?;
        if got == want {
            Ok(())
        } else {
            Err(format!(
                "a fresh worker did not converge: derived {got:?}, canonical implies {want:?}"
            ))
        }
    }
}

/// What a loss-tolerant path says about itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accounting {
    /// Items it reports delivered.
    pub delivered: u64,
    /// Items it reports lost (dropped, shed, or abandoned by a crash).
    pub lost: u64,
    /// Whether it claims to have delivered everything.
    pub complete: bool,
}

/// A `best-effort / loss-tolerant` family under test.
pub trait LossTolerantFamily: Send + Sync + 'static {
    /// The store and sink.
    type Fixture: Send + Sync + 'static;

    /// The case label prefix, e.g. `telemetry/file`.
    fn label(&self) -> String;
    /// Must be `best-effort / loss-tolerant`.
    fn declaration(&self) -> Declaration;
    /// A fresh, isolated store and sink; `lossy` makes the sink drop some sends.
    fn fixture(&self, lossy: bool) -> impl Future<Output = Result<Self::Fixture, BoxError>> + Send;
    /// Emits `n` items through the path, with `faults` threaded through its real code; a crash
    /// mid-way returns the injected error.
    fn emit(
        &self,
        fixture: &Self::Fixture,
        n: u64,
        faults: Faults,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;
    /// What the path reports (after a fresh process reads its own records).
    fn accounting(
        &self,
        fixture: &Self::Fixture,
    ) -> impl Future<Output = Result<Accounting, BoxError>> + Send;
    /// Items the sink really holds, read independently of the path.
    fn delivered(
        &self,
        fixture: &Self::Fixture,
    ) -> impl Future<Output = Result<u64, BoxError>> + Send;
}

/// Proves declared loss: clean, lossy, and crashed-at-each-point runs whose accounting adds up
/// to what was emitted, matches the sink, and never claims completeness after a loss.
#[derive(Debug)]
pub struct LossHarness<F> {
    family: F,
    items: u64,
}

impl<F: LossTolerantFamily> LossHarness<F> {
    /// A harness emitting 100 items per case.
    #[must_use]
    pub fn new(family: F) -> Self {
        LossHarness { family, items: 100 }
    }

    /// Runs a clean case, a lossy-sink case, and a crash at before/after effect.
    pub fn run(&self) -> HarnessReport {
        let declaration = self.family.declaration();
        let mut report = HarnessReport {
            family: self.family.label(),
            cases: Vec::new(),
            invalid: None,
        };
        if (declaration.durability(), declaration.effect())
            != (Durability::BestEffort, Effect::LossTolerant)
        {
            report.invalid = Some(format!("{declaration} is not best-effort/loss-tolerant"));
            return report;
        }
        let cases = [
            ("clean", false, None),
            ("lossy-sink", true, None),
            ("before-effect", false, Some(CrashPoint::BeforeEffect)),
            ("after-effect", false, Some(CrashPoint::AfterEffect)),
        ];
        for (case, lossy, point) in cases {
            let name = format!("{}/{case}", report.family);
            let failure = run_case(self.case(lossy, point)).err();
            report.cases.push(CaseResult { name, failure });
        }
        report
    }

    async fn case(&self, lossy: bool, point: Option<CrashPoint>) -> Result<(), String> {
        let fam = &self.family;
        let n = self.items;
        let fixture = fam
            .fixture(lossy)
            .await
            .map_err(|e| format!("fixture: {e}"))?;
        let faults = Faults::new();
        if let Some(p) = point {
            faults.arm(p);
        }
        let r = fam.emit(&fixture, n, faults.clone()).await;
        match point {
            Some(p) if faults.fired() != Some(p) => {
                return Err(format!("the crash at {p} never fired"));
            }
            None => r.map_err(|e| format!("emit: {e}"))?,
            Some(_) => {}
        }
        let acc = fam
            .accounting(&fixture)
            .await
            .map_err(|e| format!("accounting: {e}"))?;
        let real = fam
            .delivered(&fixture)
            .await
            .map_err(|e| format!("delivered: {e}"))?;
        if acc.delivered != real {
            return Err(format!(
                "the path reports {} delivered, the sink holds {real}",
                acc.delivered
            ));
        }
        if acc.delivered + acc.lost != n {
            return Err(format!(
                "{n} emitted, {} delivered + {} reported lost: {} unaccounted for",
                acc.delivered,
                acc.lost,
                n as i128 - (acc.delivered + acc.lost) as i128
            ));
        }
        if acc.lost > 0 && acc.complete {
            return Err(format!(
                "{} lost, yet the path claims completeness",
                acc.lost
            ));
        }
        if (lossy || point.is_some()) && acc.lost == 0 && real < n {
            return Err("losses happened but none was reported".into());
        }
        Ok(())
    }
}
