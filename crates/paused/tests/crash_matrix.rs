//! The shared crash matrix at every required point, on SQLite, PostgreSQL and MariaDB, and on
//! a three-node Galera cluster with each restarted worker on the next node.
//!
//! Three pauses exist before the cell (their tokens are the fixture's); the producer resumes
//! them (repeating a resume it never saw acknowledged), and a worker sends their effects to a
//! local receiver that answers after 400 ms (so heartbeats run). After each injected crash a
//! fresh worker restarts on the same database until every pause is terminal. The recovery
//! assertion reads the store and the receiver's record: every pause is `completed` or
//! `uncertain`, no effect key reached the receiver twice, and every `completed` one exactly
//! once: an effect whose outcome the crash hid is quarantined, never resent.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use nexuscrm_paused::{Connector, DECLARATION, NewPause, PausedFlow, PausedOptions, ResumeToken};
use nexuscrm_persistence::testing::{GaleraDb, TestDb, causal_reads};
use nexuscrm_persistence::{Db, Dialect};
use nexuscrm_worker::fault::{CrashPoint, Faults};
use nexuscrm_worker::{Attempt, BoxError, Config, Controller, Declaration, Source};
use nexuscrm_worker_test::{CrashContext, CrashFamily, CrashMatrix};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const PAUSES: usize = 3;

/// Requests per idempotency key, for every cell of this binary (keys are unique per pause).
type Received = Arc<Mutex<HashMap<String, u32>>>;

/// One receiver on its own runtime (every cell's runtimes come and go): answers after 400 ms.
fn receiver() -> (u16, Received) {
    static R: OnceLock<(u16, Received)> = OnceLock::new();
    R.get_or_init(|| {
        let got: Received = Arc::default();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let g = got.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async move {
                listener.set_nonblocking(true).unwrap();
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let app = axum::Router::new().route(
                    "/effect",
                    axum::routing::post(move |h: axum::http::HeaderMap| {
                        let g = g.clone();
                        async move {
                            let key = h
                                .get("idempotency-key")
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or_default()
                                .to_owned();
                            *g.lock().unwrap().entry(key).or_default() += 1;
                            tokio::time::sleep(Duration::from_millis(400)).await;
                            "ok"
                        }
                    }),
                );
                let _ = axum::serve(listener, app).await;
            });
        });
        (port, got)
    })
    .clone()
}

struct PausedFamily {
    dialect: Dialect,
    /// On the three-node Galera cluster (MySQL dialect), each worker on the next node.
    galera: bool,
}

struct Fixture {
    test: TestDb,
    /// The database's URL on each Galera node (empty off Galera).
    nodes: Vec<String>,
    next: std::sync::atomic::AtomicUsize,
    tokens: Vec<ResumeToken>,
}

struct Worker {
    fixture: Arc<Fixture>,
    db: Db,
    faults: Faults,
}

fn store(worker: &Worker, generation: i64, point: CrashPoint) -> PausedFlow {
    store_with(worker, generation, point, worker.faults.clone())
}

fn store_with(worker: &Worker, generation: i64, point: CrashPoint, faults: Faults) -> PausedFlow {
    let (port, _) = receiver();
    let lease = if point == CrashPoint::LeaseExpiry {
        300
    } else {
        900
    };
    PausedFlow::without_migrations(
        worker.db.clone(),
        PausedOptions::default()
            .generation(generation)
            .connector(
                Connector::new(&format!("http://127.0.0.1:{port}/effect"))
                    .unwrap()
                    .timeout(Duration::from_secs(2)),
            )
            .lease(Duration::from_millis(lease))
            .backoff(Duration::from_millis(50))
            .generation_poll(None)
            .listen(false)
            .faults(faults),
    )
}

/// Resumes every pause (idempotent: a resume never acknowledged is repeated), then runs a
/// controller until none is left to do.
async fn drive(store: &PausedFlow, fixture: &Fixture, ctx: &CrashContext) -> Result<(), BoxError> {
    for t in &fixture.tokens {
        store.resume(t.expose(), &json!({"approved": true})).await?;
    }
    let ctl = Controller::new(
        store.source(),
        Config::new("paused")
            .capacity(NonZeroUsize::new(PAUSES).unwrap())
            .shutdown_timeout(Duration::from_secs(20)),
    )?;
    store.set_waker(ctl.waker());
    let cancel = ctx.cancel().child_token();
    let run = ctx.spawn(ctl.run(cancel.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let all = store.list(None, 100).await?;
        if all.len() == PAUSES
            && all
                .iter()
                .all(|p| p.state == "completed" || p.state == "uncertain")
        {
            break;
        }
        if run.is_finished() || tokio::time::Instant::now() > deadline {
            cancel.cancel();
            let out = run.await?;
            return Err(format!(
                "not terminal ({out:?}): {:?}",
                all.iter().map(|p| (p.id, &p.state)).collect::<Vec<_>>()
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cancel.cancel();
    match run.await? {
        Ok(_) => Ok(()),
        Err(e) => Err(format!("controller: {e}").into()),
    }
}

impl CrashFamily for PausedFamily {
    type Fixture = Fixture;
    type Worker = Worker;

    fn label(&self) -> String {
        if self.galera {
            "paused/galera".into()
        } else {
            format!("paused/{}", self.dialect)
        }
    }

    fn declaration(&self) -> Declaration {
        DECLARATION
    }

    async fn fixture(&self) -> Result<Fixture, BoxError> {
        let (test, nodes) = if self.galera {
            let g = GaleraDb::create("crash")
                .await
                .ok_or("Galera cluster unavailable")?;
            (g.test, g.nodes)
        } else {
            let t = TestDb::create(self.dialect, "crash")
                .await
                .ok_or("test database unavailable")?;
            (t, Vec::new())
        };
        let store = PausedFlow::open(test.db.clone(), PausedOptions::default()).await?;
        let mut tokens = Vec::new();
        for i in 0..PAUSES {
            let p = store
                .pause(NewPause::new(
                    format!("run-{i}"),
                    "charge",
                    Duration::from_secs(3600),
                    json!({"i": i}),
                ))
                .await?;
            tokens.push(p.token);
        }
        Ok(Fixture {
            test,
            nodes,
            next: Default::default(),
            tokens,
        })
    }

    async fn new_worker(
        &self,
        fixture: &Arc<Fixture>,
        faults: Faults,
    ) -> Result<Arc<Worker>, BoxError> {
        let url = match fixture.nodes.len() {
            0 => fixture.test.url.clone(),
            n => fixture.nodes[fixture
                .next
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                % n]
                .clone(),
        };
        let db = nexuscrm_persistence::testing::worker_db(&url).await?;
        Ok(Arc::new(Worker {
            fixture: fixture.clone(),
            db,
            faults,
        }))
    }

    fn worker_fixture<'a>(&self, worker: &'a Worker) -> &'a Arc<Fixture> {
        &worker.fixture
    }

    async fn crash(
        &self,
        point: CrashPoint,
        worker: Arc<Worker>,
        ctx: CrashContext,
    ) -> Result<(), BoxError> {
        if point == CrashPoint::OwnershipTransfer {
            // Generation 1 is alive and holds a lease on a resumed pause; generation 2 (the
            // worker under test) takes over: its fence commits, then it crashes before its
            // first claim, a transfer half done.
            // The old generation is another process: not the one whose hook is armed.
            let old = store_with(&worker, 1, point, Faults::none());
            old.take_ownership("gen-1").await?;
            old.resume(
                worker.fixture.tokens[0].expose(),
                &json!({"approved": true}),
            )
            .await?;
            let held = old
                .source()
                .claim(NonZeroUsize::new(1).unwrap(), CancellationToken::new())
                .await?;
            if held.is_empty() {
                return Err("generation 1 claimed nothing: no lease is held".into());
            }
            let new = store(&worker, 2, point);
            new.take_ownership("gen-2").await?;
            return Err("the takeover committed without reaching the crash point".into());
        }
        let s = store(&worker, 1, point);
        s.take_ownership("gen-1").await?;
        if point == CrashPoint::LeaseExpiry {
            // The worker stalls past its lease before its intent: the intent finds the lease
            // gone and nothing is sent.
            s.resume(
                worker.fixture.tokens[0].expose(),
                &json!({"approved": true}),
            )
            .await?;
            let batch = s
                .source()
                .claim(NonZeroUsize::new(1).unwrap(), CancellationToken::new())
                .await?;
            tokio::time::sleep(Duration::from_millis(450)).await;
            // A rescuer claims it in between (the lease has expired).
            let _rescued = s
                .source()
                .claim(NonZeroUsize::new(1).unwrap(), CancellationToken::new())
                .await?;
            for attempt in batch.into_parts().0 {
                attempt.run(CancellationToken::new()).await?;
            }
            return Ok(());
        }
        drive(&s, &worker.fixture, &ctx).await
    }

    async fn restart(
        &self,
        point: CrashPoint,
        worker: Arc<Worker>,
        ctx: CrashContext,
    ) -> Result<(), BoxError> {
        let generation = match point {
            CrashPoint::DuringHeartbeat | CrashPoint::LeaseExpiry => 1,
            _ => 2,
        };
        let s = store(&worker, generation, point);
        s.take_ownership("restart").await?;
        drive(&s, &worker.fixture, &ctx).await
    }

    async fn recover(&self, point: CrashPoint, fixture: Arc<Fixture>) -> Result<(), BoxError> {
        // On Galera, read through node 1 causally: the last commits may have gone through
        // another node, which node 1 may still be applying.
        let causal = match fixture.nodes.first() {
            Some(url) => Some(causal_reads(url).await?),
            None => None,
        };
        let db = causal.as_ref().unwrap_or(&fixture.test.db);
        let store = PausedFlow::without_migrations(db.clone(), PausedOptions::default());
        let all = store.list(None, 100).await;
        if let Some(c) = causal {
            c.close().await;
        }
        let all = all?;
        let (_, received) = receiver();
        let received = received.lock().unwrap().clone();
        if all.len() != PAUSES {
            return Err(format!("after {point}: {} pauses, want {PAUSES}", all.len()).into());
        }
        for p in &all {
            let sent = received.get(&p.effect_key).copied().unwrap_or(0);
            match p.state.as_str() {
                "completed" if sent == 1 => {}
                "uncertain" if sent <= 1 => {}
                state => {
                    return Err(format!(
                        "after {point}: pause {} is {state} and its effect was sent {sent} \
                         time(s)",
                        p.id
                    )
                    .into());
                }
            }
        }
        Ok(())
    }
}

fn run_matrix(dialect: Dialect) {
    if !nexuscrm_persistence::testing::available_blocking(dialect) {
        return;
    }
    let report = CrashMatrix::new(PausedFamily {
        dialect,
        galera: false,
    })
    .run();
    println!("{report}");
    report.assert_passed();
}

#[test]
fn paused_sqlite_crash_matrix() {
    run_matrix(Dialect::Sqlite);
}

#[test]
fn paused_postgres_crash_matrix() {
    run_matrix(Dialect::Postgres);
}

#[test]
fn paused_mysql_crash_matrix() {
    run_matrix(Dialect::Mysql);
}

/// On the three-node Galera cluster: each restarted worker on the next node, so recovery and
/// the takeover run through other nodes than the crash.
#[test]
fn paused_galera_crash_matrix() {
    if !nexuscrm_persistence::testing::galera_available_blocking() {
        return;
    }
    let report = CrashMatrix::new(PausedFamily {
        dialect: Dialect::Mysql,
        galera: true,
    })
    .run();
    println!("{report}");
    report.assert_passed();
}
