//! The operators' console: server-rendered HTML pages on the admin server (same loopback
//! address and `Host` guard), one page per concern, with nothing from a CDN. Every value is
//! escaped by `maud` (record data is user input).
//!
//! - `/console`: every family with its declaration, proof and controller state, updated in
//!   place from server-sent events (`/console/events`) by the one vendored script
//!   (`/console/live.js`, which sets text, never HTML); without scripts it reloads every 5 s.
//! - `/console/bulk` (filters `state` and `age`), `/console/bulk/{id}`: progress, rejected rows
//!   with their reasons, the last error.
//! - `/console/schedules`, `/console/schedules/{id}`: spec and zone, policy, next occurrence,
//!   recent runs, pause and resume.
//! - `/console/paused`: every pause, and each uncertain one's evidence and resolve page.
//!
//! Without `console_secret` the console is **read-only** and says so on every page. With it,
//! an uncertain pause can be resolved (`applied`, `not-applied`, `retry`) through a
//! confirmation page and a schedule paused or resumed: each action is a POST carrying the
//! secret and a CSRF token derived from a per-process random key and the action's subject, so
//! another site cannot forge it (it can neither read the page nor know the key). Other
//! decisions (retrying a poisoned job) are made with the CLI. Reads use each family's
//! one-connection observation pool, never the business pool, and every list is bounded.

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
        .route("/console/events", get(family_events))
        .route("/console/live.js", get(live_script))
        .route("/console/bulk", get(bulk_jobs))
        .route("/console/bulk/{id}", get(bulk_job))
        .route("/console/schedules", get(schedules))
        .route("/console/schedules/{id}", get(schedule_page))
        .route(
            "/console/schedules/{id}/{action}",
            axum::routing::post(schedule_action),
        )
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
    /// Cancelled when the admin server stops: event streams end then.
    stopping: tokio_util::sync::CancellationToken,
}

impl Actions {
    /// Actions allowed with `secret`; read-only without one.
    pub(crate) fn new(secret: Option<crate::resume::Secret>) -> Self {
        Actions {
            secret,
            csrf_key: std::sync::Arc::new(random_key()),
            stopping: tokio_util::sync::CancellationToken::new(),
        }
    }

    /// Ends the console's event streams when `stop` is cancelled (the admin server's stop), so
    /// an open page never holds a stopping server for its connection grace period.
    pub(crate) fn ending_with(mut self, stop: tokio_util::sync::CancellationToken) -> Self {
        self.stopping = stop;
        self
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
        "Uncertain pauses can be resolved and schedules paused or resumed here (the console \
         secret is asked for each decision); other decisions are made with the CLI."
    } else {
        "Read-only console (no console_secret is configured): decisions are made with the CLI \
         (pause resolve, bulk retry, schedule pause|resume)."
    }
}

fn page(actions: &Actions, title: &str, body: Markup) -> Response {
    page_with(title, body, Refresh::Reload, notice(actions))
}

/// How a page stays current.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Refresh {
    /// Reloads itself every 5 s (`<meta http-equiv="refresh">`).
    Reload,
    /// Updated in place from `/console/events` by the vendored `live.js`; reloads every 5 s
    /// when scripts are off.
    Live,
    /// Never (a form: a refresh would drop what is typed).
    Off,
}

/// A page.
fn page_with(title: &str, body: Markup, refresh: Refresh, notice: &str) -> Response {
    let markup = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                @match refresh {
                    Refresh::Reload => { meta http-equiv="refresh" content="5"; }
                    Refresh::Live => {
                        noscript { meta http-equiv="refresh" content="5"; }
                        script src="/console/live.js" defer {}
                    }
                    Refresh::Off => {}
                }
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
                p.readonly {
                    (notice)
                    @match refresh {
                        Refresh::Reload => " Refreshes every 5 s.",
                        Refresh::Live => { " Live: " span #live { "connecting…" } }
                        Refresh::Off => "",
                    }
                }
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

/// Where each family's declaration is proven, from the registry (whose unit test checks
/// that every named test exists): one line per proof file.
pub(crate) fn proof_of(family: &str) -> Vec<String> {
    crate::registry::lookup(family)
        .map(|p| {
            p.proofs
                .iter()
                .map(|f| format!("{} ({}): {}", f.file, f.backends, f.what))
                .collect()
        })
        .unwrap_or_default()
}

/// One family's live figures, each already formatted as the families page shows it (the
/// page's cells carry `data-live="FAMILY:FIELD"`; `live.js` sets their text from this).
async fn family_figures(f: &crate::admin::Family) -> serde_json::Map<String, serde_json::Value> {
    use serde_json::Value::String as S;
    let s = f.handle.snapshot();
    let state = if s.poisoned.is_some() {
        "poisoned"
    } else if s.ready {
        "ready"
    } else {
        "not ready"
    };
    let observed = match f.observed.get(&f.store).await {
        Ok((json, _, age)) => format!(
            "{}\nread {:.1} s ago",
            serde_json::to_string_pretty(&json).unwrap_or_default(),
            age.as_secs_f64()
        ),
        Err(e) => format!("observations unavailable: {e}"),
    };
    let mut m = serde_json::Map::new();
    for (k, v) in [
        ("state", state.to_owned()),
        ("in_flight", format!("{} / {}", s.in_flight, s.capacity)),
        (
            "claims",
            format!(
                "{} ({} empty, {} full)",
                s.claim_calls, s.claims_empty, s.claims_full
            ),
        ),
        (
            "last_claim",
            s.last_claim_at.map_or_else(|| "never".into(), format_time),
        ),
        (
            "attempts",
            format!("{} ({} failed)", s.attempts_completed, s.attempts_failed),
        ),
        ("timers", format!("{} / {}", s.timers_armed, s.timers_fired)),
        ("overdue", s.overdue_suppressed.to_string()),
        ("poison", s.poisoned.clone().unwrap_or_else(|| "-".into())),
        ("observed", observed),
    ] {
        m.insert(k.into(), S(v));
    }
    m
}

/// The live fields of the families page, in column order.
const LIVE_FIELDS: [&str; 9] = [
    "state",
    "in_flight",
    "claims",
    "last_claim",
    "attempts",
    "timers",
    "overdue",
    "poison",
    "observed",
];

async fn families(State(admin): State<Admin>) -> Response {
    let mut rows = Vec::new();
    for f in admin.families.iter() {
        let name = f.declaration.family();
        let figures = family_figures(f).await;
        let text = |k: &str| {
            figures
                .get(k)
                .and_then(|v| v.as_str())
                .unwrap_or_default()
                .to_owned()
        };
        rows.push(html! {
            tr {
                td { (name) }
                td { (f.declaration.to_string()) }
                td {
                    ul { @for p in proof_of(name) { li { (p) } } }
                }
                @for k in LIVE_FIELDS {
                    @let v = text(k);
                    @let bad = (k == "state" || k == "poison") && v != "-" && v != "ready" && v != "not ready";
                    td {
                        @if k == "observed" {
                            pre data-live={ (name) ":" (k) } { (v) }
                        } @else if bad {
                            span.bad data-live={ (name) ":" (k) } { (v) }
                        } @else {
                            span data-live={ (name) ":" (k) } { (v) }
                        }
                    }
                }
            }
        });
    }
    page_with(
        "Families",
        html! {
            table #families {
                tr {
                    th { "family" } th { "declaration" } th { "proof" } th { "state" }
                    th { "in flight / capacity" } th { "claims" } th { "last claim (UTC)" }
                    th { "attempts completed" } th { "timers armed / fired" }
                    th { "overdue suppressed" } th { "poison reason" } th { "queue observations" }
                }
                @for r in &rows { (r) }
            }
        },
        Refresh::Live,
        notice(&admin.console),
    )
}

/// How often `/console/events` sends the families' figures.
const EVENT_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// Server-sent events: every [`EVENT_EVERY`], one `families` event whose data is a JSON object
/// `{family: {field: text}}` of the families page's live cells. Queue observations come from
/// the shared cache ([`OBSERVATION_TTL`](crate::admin::OBSERVATION_TTL)), so an open page
/// costs the database at most one bounded reading per family per TTL, however many watch.
async fn family_events(State(admin): State<Admin>) -> Response {
    use axum::response::sse::{Event, KeepAlive, Sse};
    use futures_util::StreamExt as _;
    let stopping = admin.console.stopping.clone().cancelled_owned();
    let stream = futures_util::stream::unfold((admin, true), |(admin, first)| async move {
        if !first {
            tokio::time::sleep(EVENT_EVERY).await;
        }
        let mut all = serde_json::Map::new();
        for f in admin.families.iter() {
            all.insert(
                f.declaration.family().to_owned(),
                serde_json::Value::Object(family_figures(f).await),
            );
        }
        let event = Event::default()
            .event("families")
            .data(serde_json::Value::Object(all).to_string());
        Some((Ok::<_, std::convert::Infallible>(event), (admin, false)))
    })
    .take_until(stopping);
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// The console's one script, vendored here (no CDN): it listens to `/console/events` and sets
/// the text (never the HTML) of each `data-live` cell. Without it the page reloads itself.
const LIVE_JS: &str = r#"(function () {
  "use strict";
  var status = document.getElementById("live");
  if (!window.EventSource) { if (status) { status.textContent = "unsupported: reload the page"; } return; }
  var source = new EventSource("/console/events");
  source.addEventListener("families", function (e) {
    var all = JSON.parse(e.data);
    Object.keys(all).forEach(function (family) {
      Object.keys(all[family]).forEach(function (field) {
        var cell = document.querySelector('[data-live="' + family + ":" + field + '"]');
        if (cell) { cell.textContent = all[family][field]; }
      });
    });
    if (status) { status.textContent = "updated " + new Date().toISOString(); }
  });
  source.onerror = function () { if (status) { status.textContent = "disconnected, retrying…"; } };
})();
"#;

async fn live_script() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        LIVE_JS,
    )
        .into_response()
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

/// `/console/bulk`'s filters: `?state=` and `?age=` (submitted within, e.g. `1h`, `7d`).
#[derive(Debug, Deserialize)]
struct BulkFilter {
    state: Option<String>,
    age: Option<String>,
}

async fn bulk_jobs(State(admin): State<Admin>, Query(filter): Query<BulkFilter>) -> Response {
    let Some(Store::Bulk(bulk)) = find(&admin, |s| matches!(s, Store::Bulk(_))) else {
        return page(
            &admin.console,
            "Bulk jobs",
            html! { p { "Bulk does not run in this process." } },
        );
    };
    let age = match filter.age.as_deref().filter(|a| !a.is_empty()) {
        None => None,
        Some(a) => match nexuscrm_flow::spec::parse_duration(a) {
            Ok(d) => Some((a.to_owned(), d)),
            Err(e) => return refused(&admin, StatusCode::BAD_REQUEST, &format!("age: {e}")),
        },
    };
    let jobs = match bulk.list(LIST_LIMIT).await {
        Ok(jobs) => jobs,
        Err(e) => return store_error(&admin.console, "the jobs", e),
    };
    let state = filter.state.filter(|s| !s.is_empty());
    let now = std::time::SystemTime::now();
    let shown: Vec<_> = jobs
        .iter()
        .filter(|j| state.as_deref().is_none_or(|s| j.state == s))
        .filter(|j| {
            age.as_ref()
                .is_none_or(|(_, max)| now.duration_since(j.created_at).unwrap_or_default() <= *max)
        })
        .collect();
    let keep_age = age.as_ref().map(|(a, _)| a.clone()).unwrap_or_default();
    let keep_state = state.clone().unwrap_or_default();
    page(
        &admin.console,
        "Bulk jobs",
        html! {
            p {
                "The newest " (LIST_LIMIT) " jobs"
                @if let Some(s) = &state { ", state " code { (s) } }
                @if let Some((a, _)) = &age { ", submitted within " code { (a) } }
                ": " (shown.len()) " shown."
            }
            p {
                "State: "
                @for st in ["pending", "running", "succeeded", "poisoned"] {
                    a href={ "/console/bulk?state=" (st) "&age=" (keep_age) } { (st) } " "
                }
                a href={ "/console/bulk?age=" (keep_age) } { "any" }
                " · Submitted within: "
                @for a in ["1h", "1d", "7d"] {
                    a href={ "/console/bulk?state=" (keep_state) "&age=" (a) } { (a) } " "
                }
                a href={ "/console/bulk?state=" (keep_state) } { "any time" }
            }
            table #jobs {
                tr {
                    th { "id" } th { "idempotency key" } th { "state" } th { "submitted (UTC)" }
                    th { "progress" } th { "rows applied / total" } th { "rejected" }
                    th { "attempts" } th { "last error" }
                }
                @for j in &shown {
                    tr data-job=(j.id.0) {
                        td { a href={ "/console/bulk/" (j.id.0) } { (j.id.0) } }
                        td { (j.idempotency_key) }
                        td.state { @if j.state == "poisoned" { span.bad { (j.state) } } @else { (j.state) } }
                        td { (format_time(j.created_at)) }
                        td { (progress(j)) }
                        td.applied { (j.applied_rows) " / " (j.total_rows) }
                        td.rejected { (j.rejected_rows) }
                        td { (j.attempts) " of " (j.max_attempts) }
                        td { @if let Some(e) = &j.last_error { span.bad { (e) } } @else { "-" } }
                    }
                }
            }
        },
    )
}

/// A job's progress: rows done (applied or rejected) of its rows, as a bar and a percentage.
fn progress(j: &nexuscrm_bulk::JobStatus) -> Markup {
    let done = j.applied_rows + j.rejected_rows;
    let pct = if j.total_rows > 0 {
        done * 100 / j.total_rows
    } else {
        100
    };
    html! { progress value=(done) max=(j.total_rows.max(1)) {} " " (pct) "%" }
}

/// One job: its progress, its rejected rows with their reasons, its last error.
async fn bulk_job(State(admin): State<Admin>, Path(id): Path<i64>) -> Response {
    let Some(Store::Bulk(bulk)) = find(&admin, |s| matches!(s, Store::Bulk(_))) else {
        return refused(
            &admin,
            StatusCode::NOT_FOUND,
            "Bulk does not run in this process",
        );
    };
    let job = nexuscrm_bulk::JobId(id);
    let j = match bulk.status(job).await {
        Ok(Some(j)) => j,
        Ok(None) => return refused(&admin, StatusCode::NOT_FOUND, &format!("no job {id}")),
        Err(e) => return store_error(&admin.console, "the job", e),
    };
    let errors = match bulk.row_errors(job, LIST_LIMIT).await {
        Ok(e) => e,
        Err(e) => return store_error(&admin.console, "the rejected rows", e),
    };
    page(
        &admin.console,
        &format!("Bulk job {id}"),
        html! {
            table {
                tr { th { "idempotency key" } td { (j.idempotency_key) } }
                tr { th { "state" } td #state { @if j.state == "poisoned" { span.bad { (j.state) } } @else { (j.state) } } }
                tr { th { "submitted (UTC)" } td { (format_time(j.created_at)) } }
                tr { th { "progress" } td { (progress(&j)) } }
                tr { th { "rows applied / total" } td #applied { (j.applied_rows) " / " (j.total_rows) } }
                tr { th { "rows rejected" } td #rejected { (j.rejected_rows) } }
                tr { th { "attempts" } td { (j.attempts) " of " (j.max_attempts) " (" (j.stalled_claims) " stalled in a row)" } }
                tr { th { "last error" } td { @if let Some(e) = &j.last_error { span.bad { (e) } } @else { "-" } } }
            }
            @if j.state == "poisoned" {
                p { "A poisoned job runs again only when a person says so: "
                    code { "nexuscrm-runtime-worker bulk retry " (id) } }
            }
            h2 { "Rejected rows" }
            @if errors.is_empty() {
                p { "None." }
            } @else {
                p {
                    "Rows that failed row-level validation (the job goes on without them)"
                    @if (errors.len() as i64) < j.rejected_rows {
                        "; the first " (errors.len()) " of " (j.rejected_rows) " shown"
                    }
                    "."
                }
                table #row-errors {
                    tr { th { "row (0-based)" } th { "reason" } }
                    @for e in &errors { tr { td { (e.ordinal) } td { (e.message) } } }
                }
            }
            p { a href="/console/bulk" { "All jobs" } }
        },
    )
}

async fn schedules(State(admin): State<Admin>) -> Response {
    let Some(flow) = flow_store(&admin) else {
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
            p { (list.len()) " schedule(s). Open one for its recent runs"
                @if admin.console.enabled() { " and to pause or resume it" } "." }
            table #schedules {
                tr {
                    th { "id" } th { "name" } th { "flow" } th { "state" } th { "spec (zone)" }
                    th { "misfire policy" } th { "next occurrence (UTC)" } th { "last occurrence" } th { "runs" }
                }
                @for s in &list {
                    tr data-schedule=(s.id.0) {
                        td { (s.id.0) }
                        td { a href={ "/console/schedules/" (s.id.0) } { (s.name) } }
                        td { (s.flow) }
                        td.state { (s.state) }
                        td { (s.spec.to_string()) }
                        td { (s.policy.to_string()) }
                        td { (s.next_occurrence_at.map_or_else(|| "never".into(), format_time)) }
                        td { (s.last_occurrence_at.map_or_else(|| "-".into(), format_time)) }
                        td.runs { (s.runs) }
                    }
                }
            }
        },
    )
}

/// The flow store of this process, if Scheduled Flow runs here.
fn flow_store(admin: &Admin) -> Option<&nexuscrm_flow::Flow> {
    match find(admin, |s| matches!(s, Store::Flow(_))) {
        Some(Store::Flow(flow)) => Some(flow),
        _ => None,
    }
}

/// The most recent runs a schedule's page lists.
const RECENT_RUNS: i64 = 20;

/// One schedule: its spec, policy, cursor, recent runs and (with a secret) pause or resume.
async fn schedule_page(State(admin): State<Admin>, Path(id): Path<i64>) -> Response {
    let Some(flow) = flow_store(&admin) else {
        return refused(
            &admin,
            StatusCode::NOT_FOUND,
            "Scheduled Flow does not run in this process",
        );
    };
    let sid = nexuscrm_flow::ScheduleId(id);
    let s = match flow.schedule(sid).await {
        Ok(Some(s)) => s,
        Ok(None) => return refused(&admin, StatusCode::NOT_FOUND, &format!("no schedule {id}")),
        Err(e) => return store_error(&admin.console, "the schedule", e),
    };
    let runs = match flow.runs(Some(sid), RECENT_RUNS).await {
        Ok(r) => r,
        Err(e) => return store_error(&admin.console, "the runs", e),
    };
    let action = if s.enabled() { "pause" } else { "resume" };
    let csrf = admin.console.csrf(&format!("schedule:{id}:{action}"));
    page_with(
        &format!("Schedule {}", s.name),
        html! {
            table {
                tr { th { "id" } td { (id) } }
                tr { th { "flow" } td { (s.flow) } }
                tr { th { "state" } td #state { (s.state) } }
                tr { th { "spec (zone)" } td { (s.spec.to_string()) } }
                tr { th { "misfire policy" } td { (s.policy.to_string()) } }
                tr { th { "next occurrence (UTC)" } td { (s.next_occurrence_at.map_or_else(|| "never".into(), format_time)) } }
                tr { th { "last occurrence" } td { (s.last_occurrence_at.map_or_else(|| "-".into(), format_time)) } }
                tr { th { "runs" } td { (s.runs) } }
            }
            @if admin.console.enabled() {
                form method="post" action={ "/console/schedules/" (id) "/" (action) } {
                    input type="hidden" name="csrf" value=(csrf);
                    p {
                        @if action == "pause" { "Pause: no run is reserved until it is resumed. " }
                        @else { "Resume: occurrences missed while paused follow the misfire policy. " }
                        label { "Console secret " input type="password" name="secret" autocomplete="off"; }
                        " " button type="submit" { "Confirm: " (action) " this schedule" }
                    }
                }
            } @else {
                p { code { "nexuscrm-runtime-worker schedule " (action) " " (s.name) } }
            }
            h2 { "Recent runs" }
            @if runs.is_empty() { p { "None yet." } } @else {
                table #runs {
                    tr { th { "run" } th { "occurrence (UTC)" } th { "reserved (UTC)" } th { "schedule version" } }
                    @for r in &runs {
                        tr { td { (r.id) } td { (format_time(r.occurrence_at)) } td { (format_time(r.reserved_at)) } td { (r.schedule_version) } }
                    }
                }
            }
            p { a href="/console/schedules" { "All schedules" } }
        },
        Refresh::Off,
        notice(&admin.console),
    )
}

/// A POSTed action's fields: its CSRF token and the console secret.
#[derive(Deserialize)]
struct ActionForm {
    csrf: Option<String>,
    secret: Option<String>,
}

impl std::fmt::Debug for ActionForm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActionForm").finish_non_exhaustive()
    }
}

/// The checks every action passes first, in this order: the console allows actions (403),
/// the CSRF token is this process's for `subject` (403), the secret matches (401); the
/// refusal, or `None` when allowed.
fn authorize(
    admin: &Admin,
    subject: &str,
    csrf: Option<&str>,
    secret: Option<&str>,
) -> Option<Response> {
    let Some(want) = admin.console.secret.as_ref() else {
        return Some(refused(
            admin,
            StatusCode::FORBIDDEN,
            "read-only console: no console_secret is configured",
        ));
    };
    if !csrf.is_some_and(|t| admin.console.csrf_matches(subject, t)) {
        return Some(refused(
            admin,
            StatusCode::FORBIDDEN,
            "the form's CSRF token is missing or not this console's: open the page again",
        ));
    }
    if !secret.is_some_and(|s| want.matches(s.as_bytes())) {
        tracing::warn!(
            subject,
            "console: an action was refused: wrong or missing secret"
        );
        return Some(refused(
            admin,
            StatusCode::UNAUTHORIZED,
            "the console secret is wrong or missing",
        ));
    }
    None
}

/// `POST /console/schedules/{id}/pause|resume`, authorized by [`authorize`].
async fn schedule_action(
    State(admin): State<Admin>,
    Path((id, action)): Path<(i64, String)>,
    Form(form): Form<ActionForm>,
) -> Response {
    if action != "pause" && action != "resume" {
        return refused(
            &admin,
            StatusCode::NOT_FOUND,
            "the action is pause or resume",
        );
    }
    if let Some(r) = authorize(
        &admin,
        &format!("schedule:{id}:{action}"),
        form.csrf.as_deref(),
        form.secret.as_deref(),
    ) {
        return r;
    }
    let Some(flow) = flow_store(&admin) else {
        return refused(
            &admin,
            StatusCode::NOT_FOUND,
            "Scheduled Flow does not run in this process",
        );
    };
    let sid = nexuscrm_flow::ScheduleId(id);
    let done = if action == "pause" {
        flow.acting_as("console").pause(sid).await
    } else {
        flow.acting_as("console").resume(sid).await
    };
    match done {
        Ok(s) => {
            tracing::info!(schedule = id, action = %action, state = %s.state, "console: schedule changed");
            page(
                &admin.console,
                &format!("Schedule {} {}d", s.name, action),
                html! {
                    p { "Schedule " (s.name) " is now " b #state { (s.state) } " (by console)." }
                    p { a href={ "/console/schedules/" (id) } { "Back to the schedule" } }
                },
            )
        }
        Err(e) => {
            use nexuscrm_flow::FlowErrorKind as K;
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
        Refresh::Off,
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
    if let Some(r) = authorize(
        &admin,
        &format!("resolve:{id}"),
        form.csrf.as_deref(),
        form.secret.as_deref(),
    ) {
        return r;
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

    /// One family as the admin server sees it, observed through `store`.
    fn family(
        declaration: nexuscrm_worker::Declaration,
        handle: nexuscrm_worker::ControllerHandle,
        store: Store,
    ) -> Family {
        Family {
            declaration,
            handle,
            store,
            observed: ObservationCache::default(),
        }
    }

    /// The admin router over `families` on `db` (no resume endpoint) with `console`'s powers.
    fn router(db: &nexuscrm_persistence::Db, families: Vec<Family>, console: Actions) -> Router {
        crate::admin::router(Admin {
            families: Arc::new(families),
            database: Arc::new(DatabaseCheck::new(db.clone())),
            resume: None,
            console,
            telemetry: None,
        })
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
            family(
                nexuscrm_bulk::DECLARATION,
                bulk_ctl.handle(),
                Store::Bulk(bulk.clone()),
            ),
            family(
                nexuscrm_paused::DECLARATION,
                paused_ctl.handle(),
                Store::Paused(paused.clone()),
            ),
        ];
        let router = router(&t.db, families, Actions::new(None));
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
            let paused = Store::Paused(paused.clone());
            router(
                &t.db,
                vec![family(nexuscrm_paused::DECLARATION, ctl.handle(), paused)],
                console,
            )
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

    #[test]
    fn the_families_page_names_the_registrys_proofs() {
        for family in ["bulk", "flow", "paused", "formula"] {
            let proofs = proof_of(family);
            assert!(!proofs.is_empty(), "{family} has no proof listed");
            assert!(proofs[0].starts_with("crates/"), "{proofs:?}");
        }
        assert!(proof_of("stranger").is_empty());
    }

    #[tokio::test]
    async fn the_families_page_updates_live_from_server_sent_events() {
        use futures_util::StreamExt as _;
        let t = TestDb::create(Dialect::Sqlite, "console_live")
            .await
            .expect("SQLite is always here");
        let bulk = Bulk::open(t.db.clone(), 1, BulkOptions::default())
            .await
            .unwrap();
        let ctl = Controller::new(bulk.source(), Config::new("bulk")).unwrap();
        let stopping = tokio_util::sync::CancellationToken::new();
        let bulk_family = family(
            nexuscrm_bulk::DECLARATION,
            ctl.handle(),
            Store::Bulk(bulk.clone()),
        );
        let router = router(
            &t.db,
            vec![bulk_family],
            Actions::new(None).ending_with(stopping.clone()),
        );
        let (_, page) = get(&router, "/console").await;
        assert!(page.contains("crates/bulk/tests/crash_matrix.rs"), "{page}");
        assert!(page.contains(r#"data-live="bulk:in_flight""#), "{page}");
        assert!(
            page.contains(r#"<script src="/console/live.js" defer>"#),
            "{page}"
        );
        assert!(
            page.contains("<noscript><meta http-equiv=\"refresh\""),
            "{page}"
        );
        let (status, js) = get(&router, "/console/live.js").await;
        assert_eq!(status, StatusCode::OK);
        assert!(js.contains("new EventSource(\"/console/events\")"));
        assert!(
            js.contains("textContent") && !js.contains("innerHTML"),
            "text, never HTML"
        );

        let resp = router
            .clone()
            .oneshot(
                Request::get("/console/events")
                    .header(header::HOST, "127.0.0.1")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(
            resp.headers()[header::CONTENT_TYPE],
            "text/event-stream",
            "server-sent events"
        );
        let mut body = resp.into_body().into_data_stream();
        let first = body.next().await.unwrap().unwrap();
        let first = String::from_utf8_lossy(&first).into_owned();
        let data = first
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .unwrap_or_else(|| panic!("no data line in {first:?}"));
        assert!(first.starts_with("event: families"), "{first}");
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["bulk"]["in_flight"], "0 / 4", "{v}");
        assert_eq!(v["bulk"]["state"], "not ready", "{v}");
        assert_eq!(v["bulk"]["last_claim"], "never", "{v}");
        for k in LIVE_FIELDS {
            assert!(v["bulk"][k].is_string(), "{k} missing in {v}");
            assert!(
                page.contains(&format!(r#"data-live="bulk:{k}""#)),
                "{k} has no cell"
            );
        }
        // The admin server stopping ends the stream (an open page never holds the shutdown).
        stopping.cancel();
        let rest = tokio::time::timeout(Duration::from_secs(10), async {
            while body.next().await.is_some() {}
        })
        .await;
        assert!(
            rest.is_ok(),
            "the event stream ended when the server stopped"
        );
        t.drop_database().await;
    }

    #[tokio::test]
    async fn a_job_page_shows_its_progress_and_rejected_rows_and_the_list_filters_by_age() {
        let t = TestDb::create(Dialect::Sqlite, "console_job")
            .await
            .expect("SQLite is always here");
        let bulk = Bulk::open(t.db.clone(), 1, BulkOptions::default())
            .await
            .unwrap();
        let mut bad = serde_json::Map::new();
        bad.insert("email".into(), serde_json::json!("<b>not-an-email</b>"));
        let job = bulk
            .submit(NewJob::new(
                "with-a-bad-row",
                vec![
                    RowInput::new("a", serde_json::Map::new()),
                    RowInput::new("b", bad),
                ],
            ))
            .await
            .unwrap()
            .job;
        bulk.take_ownership("console-test").await.unwrap();
        let ctl = Controller::new(bulk.source(), Config::new("bulk")).unwrap();
        let handle = ctl.handle();
        bulk.set_waker(ctl.waker());
        let cancel = tokio_util::sync::CancellationToken::new();
        let run = tokio::spawn(ctl.run(cancel.clone()));
        for _ in 0..200 {
            if bulk.status(job).await.unwrap().unwrap().is_terminal() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        cancel.cancel();
        run.await.unwrap().unwrap();
        let bulk_family = family(
            nexuscrm_bulk::DECLARATION,
            handle,
            Store::Bulk(bulk.clone()),
        );
        let router = router(&t.db, vec![bulk_family], Actions::new(None));
        let (status, page) = get(&router, &format!("/console/bulk/{job}")).await;
        assert_eq!(status, StatusCode::OK, "{page}");
        assert!(page.contains("succeeded"), "{page}");
        assert!(page.contains(r#"<progress value="2" max="2">"#), "{page}");
        assert!(page.contains("1 / 2"), "applied / total: {page}");
        // The rejected row, with its reason, escaped.
        assert!(page.contains("<td>1</td><td>"), "row 1 rejected: {page}");
        assert!(page.contains("invalid email"), "{page}");
        assert!(!page.contains("<b>not-an-email"), "escaped: {page}");
        assert_eq!(
            get(&router, "/console/bulk/999").await.0,
            StatusCode::NOT_FOUND
        );
        let (_, recent) = get(&router, "/console/bulk?age=1h").await;
        assert!(recent.contains("1 shown"), "{recent}");
        let (_, both) = get(&router, "/console/bulk?state=succeeded&age=1d").await;
        assert!(both.contains("1 shown"), "{both}");
        // Backdated by two hours: no longer within the last hour.
        nexuscrm_persistence::sqlx::query("UPDATE bulk_job SET created_at = created_at - 7200000")
            .execute(t.db.pool())
            .await
            .unwrap();
        let (_, old) = get(&router, "/console/bulk?age=1h").await;
        assert!(old.contains("0 shown"), "{old}");
        let (status, bad_age) = get(&router, "/console/bulk?age=soon").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad_age}");
        assert!(bad_age.contains("invalid duration"), "{bad_age}");
        t.drop_database().await;
    }

    #[tokio::test]
    async fn a_schedule_is_paused_and_resumed_from_its_page_only_with_secret_and_csrf() {
        use nexuscrm_flow::{Flow, FlowOptions, MisfirePolicy, NewSchedule, Spec};
        let t = TestDb::create(Dialect::Sqlite, "console_schedule")
            .await
            .expect("SQLite is always here");
        let flow = Flow::open(t.db.clone(), 1, FlowOptions::default())
            .await
            .unwrap();
        let id = flow
            .create(NewSchedule::new(
                "nightly <report>",
                "report",
                Spec::cron("0 3 * * *", "Europe/Paris"),
                MisfirePolicy::Skip,
            ))
            .await
            .unwrap()
            .id;
        let ctl = Controller::new(flow.source(), Config::new("flow")).unwrap();
        let admin = |console: Actions| {
            let flow = Store::Flow(flow.clone());
            router(
                &t.db,
                vec![family(nexuscrm_flow::DECLARATION, ctl.handle(), flow)],
                console,
            )
        };
        let state = || async { flow.schedule(id).await.unwrap().unwrap().state };
        let page_path = format!("/console/schedules/{}", id.0);
        let pause = format!("/console/schedules/{}/pause", id.0);

        let read_only = admin(Actions::new(None));
        let (status, page) = get(&read_only, &page_path).await;
        assert_eq!(status, StatusCode::OK, "{page}");
        assert!(page.contains("nightly &lt;report&gt;"), "{page}");
        assert!(page.contains("Europe/Paris"), "the zone: {page}");
        assert!(page.contains("None yet."), "no runs: {page}");
        assert!(!page.contains("<form"), "read-only: {page}");
        let (status, _) = post(&read_only, &pause, &format!("secret={SECRET}")).await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        assert_eq!(state().await, "active");

        let console = Actions::new(Some(crate::resume::Secret::new(SECRET)));
        let router = admin(console.clone());
        let (_, page) = get(&router, &page_path).await;
        let csrf = console.csrf(&format!("schedule:{}:pause", id.0));
        assert!(page.contains(&csrf) && page.contains(&pause), "{page}");
        // The resume token does not authorize a pause, nor a wrong secret.
        let resume_token = console.csrf(&format!("schedule:{}:resume", id.0));
        for (form, want) in [
            (
                format!("csrf={resume_token}&secret={SECRET}"),
                StatusCode::FORBIDDEN,
            ),
            (
                format!("csrf={csrf}&secret=wrong"),
                StatusCode::UNAUTHORIZED,
            ),
            (format!("csrf={csrf}"), StatusCode::UNAUTHORIZED),
        ] {
            assert_eq!(post(&router, &pause, &form).await.0, want, "{form}");
            assert_eq!(state().await, "active");
        }
        let (status, done) = post(&router, &pause, &format!("csrf={csrf}&secret={SECRET}")).await;
        assert_eq!(status, StatusCode::OK, "{done}");
        assert_eq!(state().await, "paused");
        // Now the page offers resume, with its own token.
        let (_, page) = get(&router, &page_path).await;
        assert!(page.contains(&resume_token), "{page}");
        let resume = format!("/console/schedules/{}/resume", id.0);
        let (status, _) = post(
            &router,
            &resume,
            &format!("csrf={resume_token}&secret={SECRET}"),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(state().await, "active");
        let (status, _) = post(
            &router,
            "/console/schedules/1/delete",
            &format!("csrf={csrf}&secret={SECRET}"),
        )
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND, "only pause and resume");
        assert_eq!(
            get(&router, "/console/schedules/999").await.0,
            StatusCode::NOT_FOUND
        );
        t.drop_database().await;
    }
}
