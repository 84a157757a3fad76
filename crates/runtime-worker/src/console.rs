//! The operators' console: server-rendered HTML pages on the admin server (same loopback
//! address and `Host` guard), one page per concern. No script and nothing from a CDN; pages
//! refresh themselves every 5 s with a `<meta http-equiv="refresh">`. Every value is escaped
//! by `maud` (record data is user input).
//!
//! Without `console_secret` the console is **read-only** and says so on every page. With it,
//! an uncertain pause can be resolved (`applied`, `not-applied`, `retry`) through a
//! confirmation page: the action is a POST carrying the secret and a CSRF token derived from a
//! per-process random key and the pause id, so another site cannot forge it (it can neither
//! read the page nor know the key). Other decisions (retrying a job, pausing a schedule) are
//! made with the CLI. Reads use each family's one-connection observation pool, never the
//! business pool, and every list is bounded.

use axum::Router;
use axum::extract::{Form, Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use maud::{DOCTYPE, Markup, html};
use nexuscrm_flow::spec::format_time;
use serde::Deserialize;

use crate::admin::{Admin, Store};

/// The most rows a console list shows.
pub(crate) const LIST_LIMIT: i64 = 200;

/// The console's routes (merged into the admin router).
pub(crate) fn routes() -> Router<Admin> {
    Router::new()
        .route("/console", get(families))
        .route("/console/bulk", get(bulk_jobs))
        .route("/console/schedules", get(schedules))
        .route("/console/paused", get(paused))
        .route(
            "/console/paused/{id}/resolve",
            get(resolve_page).post(resolve_action),
        )
}

/// What the console may do: nothing without a secret; resolve uncertain pauses with one.
#[derive(Clone, Debug)]
pub(crate) struct Actions {
    secret: Option<crate::resume::Secret>,
    /// The per-process key the CSRF tokens are derived from.
    csrf_key: std::sync::Arc<[u8; 32]>,
}

impl Actions {
    /// Actions allowed with `secret`; read-only without one.
    pub(crate) fn new(secret: Option<crate::resume::Secret>) -> Self {
        Actions {
            secret,
            csrf_key: std::sync::Arc::new(random_key()),
        }
    }

    fn enabled(&self) -> bool {
        self.secret.is_some()
    }

    /// The CSRF token of an action on `subject` (hex SHA-256 of the key and the subject).
    fn csrf(&self, subject: &str) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(self.csrf_key.as_slice());
        h.update(subject.as_bytes());
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    fn csrf_matches(&self, subject: &str, offered: &str) -> bool {
        let want = self.csrf(subject);
        want.len() == offered.len()
            && want
                .bytes()
                .zip(offered.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

/// 32 random bytes from the OS (`/dev/urandom`); if it cannot be read, a hash of the time, the
/// process id and an address, which is unpredictable enough for a per-process CSRF key that a
/// remote page cannot observe.
fn random_key() -> [u8; 32] {
    use std::io::Read as _;
    let mut key = [0u8; 32];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut key))
        .is_ok()
    {
        return key;
    }
    use sha2::{Digest, Sha256};
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let mut h = Sha256::new();
    h.update(nanos.to_le_bytes());
    h.update(std::process::id().to_le_bytes());
    h.update((&raw const key as usize).to_le_bytes());
    h.finalize().into()
}

/// What every page says about the console's powers.
fn notice(actions: &Actions) -> &'static str {
    if actions.enabled() {
        "Uncertain pauses can be resolved here (the console secret is asked for each \
         decision); other decisions are made with the CLI."
    } else {
        "Read-only console (no console_secret is configured): decisions are made with the CLI \
         (pause resolve, bulk retry, schedule pause|resume)."
    }
}

fn page(actions: &Actions, title: &str, body: Markup) -> Response {
    page_with(title, body, true, notice(actions))
}

/// A page; `refresh` off for forms (a refresh would drop what is typed).
fn page_with(title: &str, body: Markup, refresh: bool, notice: &str) -> Response {
    let markup = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                @if refresh { meta http-equiv="refresh" content="5"; }
                title { "NexusCRM worker: " (title) }
                style { (CSS) }
            }
            body {
                nav {
                    a href="/console" { "Families" } " "
                    a href="/console/bulk" { "Bulk jobs" } " "
                    a href="/console/schedules" { "Schedules" } " "
                    a href="/console/paused?state=uncertain" { "Paused and uncertain" }
                }
                p.readonly { (notice) " Refreshes every 5 s." }
                h1 { (title) }
                (body)
            }
        }
    };
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        markup.into_string(),
    )
        .into_response()
}

const CSS: &str = "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}\
td,th{border:1px solid #ccc;padding:.25em .5em;text-align:left;vertical-align:top}\
.readonly{color:#555}.bad{color:#a00}pre{margin:0;white-space:pre-wrap}";

fn store_error(actions: &Actions, what: &str, e: impl std::fmt::Display) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        page(
            actions,
            "Unavailable",
            html! { p.bad { "reading " (what) " failed: " (e.to_string()) } },
        ),
    )
        .into_response()
}

async fn families(State(admin): State<Admin>) -> Response {
    let mut rows = Vec::new();
    for f in admin.families.iter() {
        let s = f.handle.snapshot();
        let observed = f.observed.get(&f.store).await;
        rows.push(html! {
            tr {
                td { (f.declaration.family()) }
                td { (f.declaration.to_string()) }
                td { @if s.poisoned.is_some() { span.bad { "poisoned" } } @else if s.ready { "ready" } @else { "not ready" } }
                td { (s.in_flight) " / " (s.capacity) }
                td { (s.claim_calls) " (" (s.claims_empty) " empty, " (s.claims_full) " full)" }
                td { (s.attempts_completed) " (" (s.attempts_failed) " failed)" }
                td { (s.timers_armed) " / " (s.timers_fired) }
                td { (s.overdue_suppressed) }
                td { @if let Some(p) = &s.poisoned { span.bad { (p) } } @else { "-" } }
                td {
                    @match &observed {
                        Ok((json, _, age)) => {
                            pre { (serde_json::to_string_pretty(json).unwrap_or_default()) }
                            "read " (format!("{:.1}", age.as_secs_f64())) " s ago"
                        }
                        Err(e) => span.bad { (e) },
                    }
                }
            }
        });
    }
    page(
        &admin.console,
        "Families",
        html! {
            table {
                tr {
                    th { "family" } th { "declaration" } th { "state" } th { "in flight / capacity" }
                    th { "claims" } th { "attempts completed" } th { "timers armed / fired" }
                    th { "overdue suppressed" } th { "poison reason" } th { "queue observations" }
                }
                @for r in &rows { (r) }
            }
        },
    )
}

/// Links to `path` filtered by each of `states`, and unfiltered.
fn filter_links(path: &str, states: &[&str]) -> Markup {
    html! {
        "Filter: "
        @for s in states {
            a href={ (path) "?state=" (s) } { (s) } " "
        }
        a href=(path) { "all" }
    }
}

/// `?state=` filter of a list page.
#[derive(Debug, Deserialize)]
struct StateFilter {
    state: Option<String>,
}

fn find(admin: &Admin, pick: impl Fn(&Store) -> bool) -> Option<&Store> {
    admin.families.iter().map(|f| &f.store).find(|s| pick(s))
}

async fn bulk_jobs(State(admin): State<Admin>, Query(filter): Query<StateFilter>) -> Response {
    let Some(Store::Bulk(bulk)) = find(&admin, |s| matches!(s, Store::Bulk(_))) else {
        return page(
            &admin.console,
            "Bulk jobs",
            html! { p { "Bulk does not run in this process." } },
        );
    };
    let jobs = match bulk.list(LIST_LIMIT).await {
        Ok(jobs) => jobs,
        Err(e) => return store_error(&admin.console, "the jobs", e),
    };
    let state = filter.state.filter(|s| !s.is_empty());
    let shown: Vec<_> = jobs
        .iter()
        .filter(|j| state.as_deref().is_none_or(|s| j.state == s))
        .collect();
    page(
        &admin.console,
        "Bulk jobs",
        html! {
            p {
                "The newest " (LIST_LIMIT) " jobs"
                @if let Some(s) = &state { ", state " code { (s) } }
                ": " (shown.len()) " shown. "
                (filter_links("/console/bulk", &["pending", "running", "succeeded", "poisoned"]))
            }
            table {
                tr {
                    th { "id" } th { "idempotency key" } th { "state" } th { "rows applied / total" }
                    th { "rejected" } th { "attempts" } th { "last error" }
                }
                @for j in &shown {
                    tr {
                        td { (j.id.0) }
                        td { (j.idempotency_key) }
                        td { @if j.state == "poisoned" { span.bad { (j.state) } } @else { (j.state) } }
                        td { (j.applied_rows) " / " (j.total_rows) }
                        td { (j.rejected_rows) }
                        td { (j.attempts) " of " (j.max_attempts) }
                        td { @if let Some(e) = &j.last_error { span.bad { (e) } } @else { "-" } }
                    }
                }
            }
        },
    )
}

async fn schedules(State(admin): State<Admin>) -> Response {
    let Some(Store::Flow(flow)) = find(&admin, |s| matches!(s, Store::Flow(_))) else {
        return page(
            &admin.console,
            "Schedules",
            html! { p { "Scheduled Flow does not run in this process." } },
        );
    };
    let list = match flow.list(LIST_LIMIT).await {
        Ok(list) => list,
        Err(e) => return store_error(&admin.console, "the schedules", e),
    };
    page(
        &admin.console,
        "Schedules",
        html! {
            table {
                tr {
                    th { "id" } th { "name" } th { "flow" } th { "state" } th { "spec" }
                    th { "misfire policy" } th { "next occurrence (UTC)" } th { "last occurrence" } th { "runs" }
                }
                @for s in &list {
                    tr {
                        td { (s.id.0) }
                        td { (s.name) }
                        td { (s.flow) }
                        td { (s.state) }
                        td { (s.spec.to_string()) }
                        td { (s.policy.to_string()) }
                        td { (s.next_occurrence_at.map_or_else(|| "never".into(), format_time)) }
                        td { (s.last_occurrence_at.map_or_else(|| "-".into(), format_time)) }
                        td { (s.runs) }
                    }
                }
            }
        },
    )
}

async fn paused(State(admin): State<Admin>, Query(filter): Query<StateFilter>) -> Response {
    let Some(Store::Paused(store)) = find(&admin, |s| matches!(s, Store::Paused(_))) else {
        return page(
            &admin.console,
            "Paused and uncertain",
            html! { p { "Paused Flow does not run in this process." } },
        );
    };
    let state = filter.state.filter(|s| !s.is_empty());
    let list = match store.list(state.as_deref(), LIST_LIMIT).await {
        Ok(list) => list,
        Err(e) => return store_error(&admin.console, "the pauses", e),
    };
    page(
        &admin.console,
        "Paused and uncertain",
        html! {
            p {
                (list.len()) " pause(s)"
                @if let Some(s) = &state { " in state " code { (s) } }
                ". An " code { "uncertain" } " pause's effect may or may not have been applied; \
                 it waits for a person: "
                code { "nexuscrm-runtime-worker pause resolve ID --applied|--not-applied|--retry" }
                ". "
                (filter_links("/console/paused", &nexuscrm_paused::PausedObservations::STATES))
            }
            table {
                tr {
                    th { "id" } th { "run / step" } th { "state" } th { "attempts" }
                    th { "intent recorded" } th { "timeout" } th { "evidence (request, response or error, timings)" }
                }
                @for p in &list {
                    tr {
                        td { (p.id) }
                        td { (p.run) " / " (p.step) }
                        td {
                            @if p.state == "uncertain" {
                                span.bad { (p.state) }
                                @if admin.console.enabled() {
                                    " " a href={ "/console/paused/" (p.id) "/resolve" } { "resolve…" }
                                }
                            } @else { (p.state) }
                        }
                        td { (p.attempts) }
                        td { (p.intent_at.map_or_else(|| "-".into(), format_time)) }
                        td { (format_time(p.timeout_at)) }
                        td {
                            @if let Some(o) = &p.outcome {
                                pre { (serde_json::to_string_pretty(o).unwrap_or_default()) }
                            } @else { "-" }
                        }
                    }
                }
            }
        },
    )
}

/// The paused store of this process, if Paused Flow runs here.
fn paused_store(admin: &Admin) -> Option<&nexuscrm_paused::PausedFlow> {
    match find(admin, |s| matches!(s, Store::Paused(_))) {
        Some(Store::Paused(store)) => Some(store),
        _ => None,
    }
}

fn no_paused(admin: &Admin) -> Response {
    refused(
        admin,
        StatusCode::NOT_FOUND,
        "Paused Flow does not run in this process",
    )
}

fn refused(admin: &Admin, status: StatusCode, why: &str) -> Response {
    (
        status,
        page(&admin.console, "Refused", html! { p.bad { (why) } }),
    )
        .into_response()
}

/// The confirmation step: the pause's evidence and a form that asks for the decision and the
/// console secret.
async fn resolve_page(State(admin): State<Admin>, Path(id): Path<i64>) -> Response {
    if !admin.console.enabled() {
        return refused(
            &admin,
            StatusCode::FORBIDDEN,
            "read-only console: no console_secret is configured",
        );
    }
    let Some(store) = paused_store(&admin) else {
        return no_paused(&admin);
    };
    let p = match store.status(id).await {
        Ok(Some(p)) => p,
        Ok(None) => return refused(&admin, StatusCode::NOT_FOUND, &format!("no pause {id}")),
        Err(e) => return store_error(&admin.console, "the pause", e),
    };
    let csrf = admin.console.csrf(&format!("resolve:{id}"));
    page_with(
        &format!("Resolve pause {id}"),
        html! {
            p {
                "Run " code { (p.run) } ", step " code { (p.step) } ", state " b { (p.state) }
                ", " (p.attempts) " attempt(s)."
            }
            @if let Some(o) = &p.outcome {
                h2 { "Evidence" }
                pre { (serde_json::to_string_pretty(o).unwrap_or_default()) }
            }
            @if p.state == "uncertain" {
                form method="post" action={ "/console/paused/" (id) "/resolve" } {
                    input type="hidden" name="csrf" value=(csrf);
                    p {
                        label { input type="radio" name="decision" value="applied"; " applied: the effect took place; complete the step" } br;
                        label { input type="radio" name="decision" value="not-applied"; " not applied: send it again" } br;
                        label { input type="radio" name="decision" value="retry"; " retry: send it again with the same idempotency key" }
                    }
                    p { label { "Console secret " input type="password" name="secret" autocomplete="off"; } }
                    p { button type="submit" { "Confirm this decision" } " " a href="/console/paused?state=uncertain" { "cancel" } }
                }
            } @else {
                p { "Only an uncertain pause can be resolved." }
            }
        },
        false,
        notice(&admin.console),
    )
}

/// The resolve form's fields.
#[derive(Deserialize)]
struct ResolveForm {
    csrf: Option<String>,
    secret: Option<String>,
    decision: Option<String>,
}

impl std::fmt::Debug for ResolveForm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResolveForm")
            .field("decision", &self.decision)
            .finish_non_exhaustive()
    }
}

/// The decision, checked in this order: the console allows actions (403), the CSRF token is
/// this process's for this pause (403), the secret matches (401), the decision is one of the
/// three (400); then the store resolves it in one transaction (409 when it is not uncertain).
async fn resolve_action(
    State(admin): State<Admin>,
    Path(id): Path<i64>,
    Form(form): Form<ResolveForm>,
) -> Response {
    let Some(secret) = admin.console.secret.clone() else {
        return refused(
            &admin,
            StatusCode::FORBIDDEN,
            "read-only console: no console_secret is configured",
        );
    };
    if !form
        .csrf
        .as_deref()
        .is_some_and(|t| admin.console.csrf_matches(&format!("resolve:{id}"), t))
    {
        return refused(
            &admin,
            StatusCode::FORBIDDEN,
            "the form's CSRF token is missing or not this console's: open the resolve page again",
        );
    }
    if !form
        .secret
        .as_deref()
        .is_some_and(|s| secret.matches(s.as_bytes()))
    {
        tracing::warn!(
            pause = id,
            "console: a resolve was refused: wrong or missing secret"
        );
        return refused(
            &admin,
            StatusCode::UNAUTHORIZED,
            "the console secret is wrong or missing",
        );
    }
    let resolution = match form.decision.as_deref() {
        Some("applied") => nexuscrm_paused::Resolution::Applied,
        Some("not-applied") => nexuscrm_paused::Resolution::NotApplied,
        Some("retry") => nexuscrm_paused::Resolution::Retry,
        _ => {
            return refused(
                &admin,
                StatusCode::BAD_REQUEST,
                "choose a decision: applied, not-applied or retry",
            );
        }
    };
    let Some(store) = paused_store(&admin) else {
        return no_paused(&admin);
    };
    match store.resolve(id, resolution, "console").await {
        Ok(p) => {
            tracing::info!(pause = id, decision = ?resolution, state = %p.state, "console: pause resolved");
            page(
                &admin.console,
                &format!("Pause {id} resolved"),
                html! {
                    p { "Pause " (id) " is now " b { (p.state) } " (decision: " (form.decision.unwrap_or_default()) ", by console)." }
                    p { a href="/console/paused?state=uncertain" { "Back to the uncertain pauses" } }
                },
            )
        }
        Err(e) => {
            use nexuscrm_paused::PauseErrorKind as K;
            let status = match e.kind() {
                K::NotFound => StatusCode::NOT_FOUND,
                K::Conflict => StatusCode::CONFLICT,
                K::Invalid => StatusCode::BAD_REQUEST,
                _ => StatusCode::SERVICE_UNAVAILABLE,
            };
            refused(&admin, status, &e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use axum::body::Body;
    use axum::http::Request;
    use nexuscrm_bulk::{Bulk, BulkOptions, NewJob, RowInput};
    use nexuscrm_paused::{NewPause, PausedFlow, PausedOptions};
    use nexuscrm_persistence::Dialect;
    use nexuscrm_persistence::testing::TestDb;
    use nexuscrm_worker::{Config, Controller};
    use tower::ServiceExt as _;

    use super::*;
    use crate::admin::{DatabaseCheck, Family, ObservationCache};

    async fn get(router: &Router, path: &str) -> (StatusCode, String) {
        let resp = router
            .clone()
            .oneshot(
                Request::get(path)
                    .header(header::HOST, "127.0.0.1")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    }

    #[tokio::test]
    async fn every_page_shows_the_store_escapes_user_data_and_says_it_is_read_only() {
        let t = TestDb::create(Dialect::Sqlite, "console")
            .await
            .expect("SQLite is always here");
        let bulk = Bulk::open(t.db.clone(), 1, BulkOptions::default())
            .await
            .unwrap();
        let paused = PausedFlow::open(t.db.clone(), PausedOptions::default())
            .await
            .unwrap();
        let hostile = "<script>alert(1)</script>";
        bulk.submit(NewJob::new(
            hostile,
            vec![RowInput::new("r", serde_json::Map::new())],
        ))
        .await
        .unwrap();
        paused
            .pause(NewPause::new(
                "run-<b>1</b>",
                "approve",
                Duration::from_secs(3600),
                serde_json::json!({"note": "<img src=x>"}),
            ))
            .await
            .unwrap();
        let bulk_ctl = Controller::new(bulk.source(), Config::new("bulk")).unwrap();
        let paused_ctl = Controller::new(paused.source(), Config::new("paused")).unwrap();
        let families = vec![
            Family {
                declaration: nexuscrm_bulk::DECLARATION,
                handle: bulk_ctl.handle(),
                store: Store::Bulk(bulk.clone()),
                observed: ObservationCache::default(),
            },
            Family {
                declaration: nexuscrm_paused::DECLARATION,
                handle: paused_ctl.handle(),
                store: Store::Paused(paused.clone()),
                observed: ObservationCache::default(),
            },
        ];
        let router = crate::admin::router(Admin {
            families: Arc::new(families),
            database: Arc::new(DatabaseCheck::new(t.db.clone())),
            resume: None,
            console: Actions::new(None),
        });
        for path in [
            "/console",
            "/console/bulk",
            "/console/schedules",
            "/console/paused",
        ] {
            let (status, body) = get(&router, path).await;
            assert_eq!(status, StatusCode::OK, "{path}: {body}");
            assert!(body.contains("Read-only console"), "{path}");
            assert!(!body.contains("<script>"), "{path} must escape: {body}");
        }
        let (_, families) = get(&router, "/console").await;
        assert!(families.contains("bulk=durable-critical"), "{families}");
        assert!(families.contains("not ready"), "{families}");
        // The queue observation (one pending job) is shown with its age.
        assert!(families.contains("&quot;pending&quot;: 1"), "{families}");
        let (_, jobs) = get(&router, "/console/bulk").await;
        assert!(
            jobs.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{jobs}"
        );
        assert!(jobs.contains("1 shown"), "{jobs}");
        assert!(jobs.contains("0 / 1"), "rows applied / total: {jobs}");
        let (_, poisoned) = get(&router, "/console/bulk?state=poisoned").await;
        assert!(poisoned.contains("0 shown"), "{poisoned}");
        let (_, schedules) = get(&router, "/console/schedules").await;
        assert!(schedules.contains("does not run in this process"));
        let (_, pauses) = get(&router, "/console/paused?state=paused").await;
        assert!(pauses.contains("1 pause(s)"), "{pauses}");
        assert!(
            pauses.contains("run-&lt;b&gt;1&lt;/b&gt; / approve"),
            "{pauses}"
        );
        let (_, uncertain) = get(&router, "/console/paused?state=uncertain").await;
        assert!(uncertain.contains("0 pause(s)"), "{uncertain}");
        t.drop_database().await;
    }

    async fn post(router: &Router, path: &str, form: &str) -> (StatusCode, String) {
        let resp = router
            .clone()
            .oneshot(
                Request::post(path)
                    .header(header::HOST, "127.0.0.1")
                    .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
                    .body(Body::from(form.to_owned()))
                    .unwrap(),
            )
            .await
            .unwrap();
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    }

    const SECRET: &str = "0123456789abcdef0123456789abcdef-console";

    #[tokio::test]
    async fn an_uncertain_pause_is_resolved_through_the_confirmation_page_only_with_secret_and_csrf()
     {
        let t = TestDb::create(Dialect::Sqlite, "console_resolve")
            .await
            .expect("SQLite is always here");
        let paused = PausedFlow::open(t.db.clone(), PausedOptions::default())
            .await
            .unwrap();
        let p = paused
            .pause(NewPause::new(
                "run-1",
                "charge",
                Duration::from_secs(3600),
                serde_json::json!({}),
            ))
            .await
            .unwrap();
        // As recovery leaves it when an effect's outcome is unknown.
        nexuscrm_persistence::sqlx::query(
            "UPDATE paused_step SET state = 'uncertain', \
             outcome = '{\"error\": \"<i>timed out</i> after the send\"}' WHERE id = ?",
        )
        .bind(p.id)
        .execute(t.db.pool())
        .await
        .unwrap();
        let ctl = Controller::new(paused.source(), Config::new("paused")).unwrap();
        let admin = |console: Actions| {
            crate::admin::router(Admin {
                families: Arc::new(vec![Family {
                    declaration: nexuscrm_paused::DECLARATION,
                    handle: ctl.handle(),
                    store: Store::Paused(paused.clone()),
                    observed: ObservationCache::default(),
                }]),
                database: Arc::new(DatabaseCheck::new(t.db.clone())),
                resume: None,
                console,
            })
        };
        let path = format!("/console/paused/{}/resolve", p.id);
        let state = || async { paused.status(p.id).await.unwrap().unwrap().state };

        // Without a console secret: read-only, every action refused.
        let read_only = admin(Actions::new(None));
        let (_, list) = get(&read_only, "/console/paused?state=uncertain").await;
        assert!(
            list.contains("Read-only console") && !list.contains("resolve…"),
            "{list}"
        );
        assert_eq!(get(&read_only, &path).await.0, StatusCode::FORBIDDEN);
        let (status, _) = post(
            &read_only,
            &path,
            &format!("secret={SECRET}&decision=applied"),
        )
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        assert_eq!(state().await, "uncertain");

        // With one: the list links to the confirmation page, which shows the (escaped)
        // evidence and carries the CSRF token.
        let console = Actions::new(Some(crate::resume::Secret::new(SECRET)));
        let router = admin(console.clone());
        let (_, list) = get(&router, "/console/paused?state=uncertain").await;
        assert!(
            list.contains(&format!("/console/paused/{}/resolve", p.id)),
            "{list}"
        );
        let (status, confirm) = get(&router, &path).await;
        assert_eq!(status, StatusCode::OK, "{confirm}");
        assert!(
            confirm.contains("&lt;i&gt;timed out&lt;/i&gt;"),
            "{confirm}"
        );
        assert!(
            !confirm.contains("http-equiv=\"refresh\""),
            "a form page does not refresh"
        );
        let csrf = console.csrf(&format!("resolve:{}", p.id));
        assert!(confirm.contains(&csrf));

        // Refusals change nothing: no or another pause's CSRF token, a wrong secret, no decision.
        let other = console.csrf("resolve:999");
        for (form, want) in [
            (
                format!("secret={SECRET}&decision=applied"),
                StatusCode::FORBIDDEN,
            ),
            (
                format!("csrf={other}&secret={SECRET}&decision=applied"),
                StatusCode::FORBIDDEN,
            ),
            (
                format!("csrf={csrf}&secret=wrong-secret&decision=applied"),
                StatusCode::UNAUTHORIZED,
            ),
            (
                format!("csrf={csrf}&secret={SECRET}"),
                StatusCode::BAD_REQUEST,
            ),
            (
                format!("csrf={csrf}&secret={SECRET}&decision=maybe"),
                StatusCode::BAD_REQUEST,
            ),
        ] {
            let (status, body) = post(&router, &path, &form).await;
            assert_eq!(status, want, "{body}");
            assert_eq!(state().await, "uncertain", "{form:?} changed nothing");
        }
        // A token from another process (another key) is refused too.
        let elsewhere = Actions::new(Some(crate::resume::Secret::new(SECRET)))
            .csrf(&format!("resolve:{}", p.id));
        let (status, _) = post(
            &router,
            &path,
            &format!("csrf={elsewhere}&secret={SECRET}&decision=applied"),
        )
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN);

        // The decision: applied completes the step, once.
        let form = format!("csrf={csrf}&secret={SECRET}&decision=applied");
        let (status, done) = post(&router, &path, &form).await;
        assert_eq!(status, StatusCode::OK, "{done}");
        assert!(done.contains("is now <b>completed</b>"), "{done}");
        assert_eq!(state().await, "completed");
        let (status, again) = post(&router, &path, &form).await;
        assert_eq!(status, StatusCode::CONFLICT, "{again}");
        assert_eq!(state().await, "completed");
        t.drop_database().await;
    }
}
