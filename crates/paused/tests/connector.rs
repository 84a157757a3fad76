//! The connector against a real local HTTP server: every outcome class, and what the receiver
//! actually received.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use nexuscrm_paused::{Connector, EffectOutcome};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// Every request the receiver got: (path, idempotency key).
type Received = Arc<Mutex<Vec<(String, String)>>>;

fn record(r: &Received, path: &str, h: &HeaderMap) {
    r.lock().unwrap().push((path.to_owned(), key_of(h)));
}

fn key_of(h: &HeaderMap) -> String {
    h.get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// A receiver on a loopback port: `/ok` 200, `/reject` 422, `/busy` 503 + Retry-After,
/// `/error` 500 (after applying), `/hang` never answers, `/observe?key=` reports the keys
/// `/error` applied.
async fn receiver() -> (u16, Received) {
    let received: Received = Arc::default();
    let app = Router::new()
        .route(
            "/ok",
            post(|State(r): State<Received>, h: HeaderMap| async move {
                record(&r, "/ok", &h);
                (StatusCode::OK, "{\"id\": 1}")
            }),
        )
        .route(
            "/reject",
            post(|State(r): State<Received>, h: HeaderMap| async move {
                record(&r, "/reject", &h);
                (StatusCode::UNPROCESSABLE_ENTITY, "no such account")
            }),
        )
        .route(
            "/busy",
            post(|State(r): State<Received>, h: HeaderMap| async move {
                record(&r, "/busy", &h);
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    [("retry-after", "3")],
                    "busy",
                )
                    .into_response()
            }),
        )
        .route(
            "/error",
            post(|State(r): State<Received>, h: HeaderMap| async move {
                record(&r, "/error", &h);
                (StatusCode::INTERNAL_SERVER_ERROR, "applied, then failed")
            }),
        )
        .route(
            "/hang",
            post(|State(r): State<Received>, h: HeaderMap| async move {
                record(&r, "/hang", &h);
                tokio::time::sleep(Duration::from_secs(3600)).await;
                StatusCode::OK
            }),
        )
        .route(
            "/observe",
            get(
                |State(r): State<Received>, RawQuery(q): RawQuery| async move {
                    // Keys here are plain: `key=` and the key, no escapes.
                    let key = q
                        .unwrap_or_default()
                        .strip_prefix("key=")
                        .unwrap_or_default()
                        .to_owned();
                    let applied = r
                        .lock()
                        .unwrap()
                        .iter()
                        .any(|(p, k)| p == "/error" && *k == key);
                    axum::Json(json!({ "applied": applied }))
                },
            ),
        )
        .with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (port, received)
}

/// A receiver that reads the whole request, then closes the connection without answering.
async fn dropper() -> (u16, Arc<Mutex<u32>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let count = Arc::new(Mutex::new(0));
    let c = count.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            let mut buf = vec![0u8; 64 * 1024];
            let mut got = Vec::new();
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
                if got.windows(4).any(|w| w == b"\r\n\r\n") && got.ends_with(b"}") {
                    break;
                }
            }
            *c.lock().unwrap() += 1;
            let _ = s.shutdown().await;
        }
    });
    (port, count)
}

fn connector(port: u16, path: &str) -> Connector {
    Connector::new(&format!("http://127.0.0.1:{port}{path}"))
        .unwrap()
        .timeout(Duration::from_millis(500))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_is_classified_and_the_key_travels_with_each_request() {
    let (port, received) = receiver().await;
    let never = CancellationToken::new();
    let body = json!({"pause": 1});
    let o = connector(port, "/ok").send("k-ok", &body, &never).await;
    assert!(
        matches!(&o, EffectOutcome::Applied { status: 200, observed: false, response } if response.contains("\"id\"")),
        "{o:?}"
    );
    let o = connector(port, "/reject")
        .send("k-rej", &body, &never)
        .await;
    assert!(
        matches!(&o, EffectOutcome::Rejected { status: 422, response } if response == "no such account"),
        "{o:?}"
    );
    let o = connector(port, "/busy").send("k-busy", &body, &never).await;
    assert_eq!(
        o,
        EffectOutcome::NotApplied {
            reason: "the receiver answered 503 with Retry-After: not applied".into(),
            retry_after: Some(Duration::from_secs(3)),
        }
    );
    // A 5xx from a connector that does not dedup: uncertain, with the evidence.
    let o = connector(port, "/error").send("k-err", &body, &never).await;
    match &o {
        EffectOutcome::Uncertain { evidence } => {
            assert_eq!(evidence.status, Some(500));
            assert_eq!(evidence.response.as_deref(), Some("applied, then failed"));
        }
        other => panic!("{other:?}"),
    }
    // The same 5xx from a connector that dedups: safe to resend with the same key.
    let o = connector(port, "/error")
        .idempotent(true)
        .send("k-err2", &body, &never)
        .await;
    assert!(matches!(o, EffectOutcome::RetrySafe { .. }), "{o:?}");
    let got = received.lock().unwrap().clone();
    assert_eq!(
        got,
        [
            ("/ok", "k-ok"),
            ("/reject", "k-rej"),
            ("/busy", "k-busy"),
            ("/error", "k-err"),
            ("/error", "k-err2"),
        ]
        .map(|(p, k)| (p.to_owned(), k.to_owned())),
        "each request once, with its idempotency key"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_past_the_timeout_and_a_dropped_connection_are_uncertain_a_refusal_sent_nothing() {
    let (port, received) = receiver().await;
    let never = CancellationToken::new();
    let body = json!({"pause": 2});
    let o = connector(port, "/hang").send("k-hang", &body, &never).await;
    match &o {
        EffectOutcome::Uncertain { evidence } => {
            assert_eq!(evidence.status, None);
            assert!(
                evidence
                    .error
                    .as_deref()
                    .unwrap()
                    .contains("no answer within"),
                "{evidence:?}"
            );
            assert!(evidence.elapsed >= Duration::from_millis(500));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        received.lock().unwrap().len(),
        1,
        "the hung request arrived"
    );
    let (drop_port, count) = dropper().await;
    let o = connector(drop_port, "/x")
        .send("k-drop", &body, &never)
        .await;
    assert!(matches!(o, EffectOutcome::Uncertain { .. }), "{o:?}");
    assert_eq!(*count.lock().unwrap(), 1, "the dropped request was read");
    // Nothing listens: refused before any byte was sent.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_port = closed.local_addr().unwrap().port();
    drop(closed);
    let o = connector(closed_port, "/x")
        .send("k-none", &body, &never)
        .await;
    match o {
        EffectOutcome::NotApplied {
            reason,
            retry_after,
        } => {
            assert!(reason.contains("nothing was sent"), "{reason}");
            assert_eq!(retry_after, None);
        }
        other => panic!("{other:?}"),
    }
    // Cancelled before connecting: nothing sent either.
    let cancelled = CancellationToken::new();
    cancelled.cancel();
    let o = connector(port, "/ok")
        .send("k-cancel", &body, &cancelled)
        .await;
    assert!(matches!(o, EffectOutcome::NotApplied { .. }), "{o:?}");
    assert_eq!(received.lock().unwrap().len(), 1, "nothing more arrived");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observable_connector_resolves_an_ambiguous_answer_by_asking() {
    let (port, received) = receiver().await;
    let never = CancellationToken::new();
    let body = json!({"pause": 3});
    // /error applied the request, then failed: the observation says applied.
    let o = connector(port, "/error")
        .observable("/observe")
        .send("k-obs", &body, &never)
        .await;
    assert!(
        matches!(o, EffectOutcome::Applied { observed: true, .. }),
        "{o:?}"
    );
    // A hang the receiver never applied (it records only /error): observed as not applied.
    let o = connector(port, "/hang")
        .observable("/observe")
        .send("k-obs2", &body, &never)
        .await;
    assert!(matches!(o, EffectOutcome::NotApplied { .. }), "{o:?}");
    assert_eq!(
        connector(port, "/x")
            .observable("/observe")
            .observe("k-obs")
            .await,
        Ok(true)
    );
    assert!(
        connector(port, "/x").observe("k").await.is_err(),
        "not declared"
    );
    assert_eq!(received.lock().unwrap().len(), 2);
}
