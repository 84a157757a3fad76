//! The operators' console: server-rendered HTML pages on the admin server (same loopback
//! address and `Host` guard), one page per concern. No script and nothing from a CDN; pages
//! refresh themselves every 5 s with a `<meta http-equiv="refresh">`. Every value is escaped
//! by `maud` (record data is user input).
//!
//! This first cut is **read-only** and says so on every page: a decision (resolving an
//! uncertain pause, retrying a job, pausing a schedule) is made with the CLI, which writes it
//! transactionally. Reads use each family's one-connection observation pool, never the
//! business pool, and every list is bounded.

use axum::Router;
use axum::extract::{Query, State};
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
}

fn page(title: &str, body: Markup) -> Response {
    let markup = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta http-equiv="refresh" content="5";
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
                    "Read-only console: decisions are made with the CLI ("
                    code { "pause resolve" } ", " code { "bulk retry" } ", "
                    code { "schedule pause|resume" } "). Refreshes every 5 s."
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

fn store_error(what: &str, e: impl std::fmt::Display) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        page(
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
            "Bulk jobs",
            html! { p { "Bulk does not run in this process." } },
        );
    };
    let jobs = match bulk.list(LIST_LIMIT).await {
        Ok(jobs) => jobs,
        Err(e) => return store_error("the jobs", e),
    };
    let state = filter.state.filter(|s| !s.is_empty());
    let shown: Vec<_> = jobs
        .iter()
        .filter(|j| state.as_deref().is_none_or(|s| j.state == s))
        .collect();
    page(
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
            "Schedules",
            html! { p { "Scheduled Flow does not run in this process." } },
        );
    };
    let list = match flow.list(LIST_LIMIT).await {
        Ok(list) => list,
        Err(e) => return store_error("the schedules", e),
    };
    page(
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
            "Paused and uncertain",
            html! { p { "Paused Flow does not run in this process." } },
        );
    };
    let state = filter.state.filter(|s| !s.is_empty());
    let list = match store.list(state.as_deref(), LIST_LIMIT).await {
        Ok(list) => list,
        Err(e) => return store_error("the pauses", e),
    };
    page(
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
                        td { @if p.state == "uncertain" { span.bad { (p.state) } } @else { (p.state) } }
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
}
