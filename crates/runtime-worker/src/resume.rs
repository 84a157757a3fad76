//! `POST /paused/resume`: the Paused Flow resume endpoint on the admin server, off by default.
//!
//! A partner's callback or an approval service resumes a pause with its token over HTTP:
//!
//! ```text
//! POST /paused/resume
//! Authorization: Bearer <paused.resume_secret>
//! Content-Type: application/json
//!
//! {"token": "prt_…", "payload": {"approved": true}}
//! ```
//!
//! The token travels in the body, never in the path, so access logs do not record it. The
//! answers are the store's own refusals, each with a distinct status: `200` resumed (or the same
//! resume again: `"first": false`), `400` malformed request, `401` missing or wrong secret,
//! `404` unknown token, `409` token already used with another payload, `410` expired or
//! cancelled, `413` body too large, `429` too many bad requests (with `Retry-After`), `503` the
//! database failed before commit (retry), `500` the commit's answer was lost (retry: a resume
//! is idempotent).
//!
//! Bad requests (a wrong secret, a token that is unknown or not a token's shape) draw from one
//! bucket of [`BAD_BURST`] that refills at one per [`BAD_REFILL`]; while it is empty every
//! resume is answered `429` before the secret or the token is looked at. The bucket is shared
//! because the admin server serves loopback only: every remote caller arrives through the same
//! local proxy, so a per-address limit would be one limit anyway. A legitimate caller that
//! meets a `429` retries after `Retry-After` with the same token and payload.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use nexuscrm_paused::{MAX_PAYLOAD_BYTES, PauseErrorKind, PausedFlow, ResumeToken};
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::time::Instant;

/// Bad requests accepted at once before the endpoint answers `429`.
pub(crate) const BAD_BURST: u32 = 10;
/// One more bad request is accepted per this interval.
pub(crate) const BAD_REFILL: Duration = Duration::from_secs(1);
/// The shortest secret accepted (bytes).
pub(crate) const MIN_SECRET_BYTES: usize = 32;
/// The largest request body: a payload at the store's limit, its token and some framing.
const MAX_BODY_BYTES: usize = MAX_PAYLOAD_BYTES + 1024;

/// The bearer secret; its `Debug` never shows it.
#[derive(Clone)]
pub(crate) struct Secret(Arc<[u8; 32]>);

impl Secret {
    /// Keeps only the secret's SHA-256, which the comparison uses.
    pub(crate) fn new(text: &str) -> Self {
        Secret(Arc::new(Sha256::digest(text.as_bytes()).into()))
    }

    /// Compares in time independent of where `offered` differs (both sides are hashed first, so
    /// its length does not show either).
    pub(crate) fn matches(&self, offered: &[u8]) -> bool {
        let offered: [u8; 32] = Sha256::digest(offered).into();
        offered
            .iter()
            .zip(self.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// The secret's text as configured; its `Debug` never shows it.
#[derive(Clone, Deserialize)]
#[serde(transparent)]
pub(crate) struct SecretText(pub(crate) String);

impl std::fmt::Debug for SecretText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// A token bucket of bad requests: `burst` at once, one more per `refill`.
#[derive(Debug)]
struct Bucket {
    burst: u32,
    refill: Duration,
    tokens: u32,
    refilled: Instant,
}

impl Bucket {
    fn full(burst: u32, refill: Duration) -> Self {
        Bucket {
            burst,
            refill,
            tokens: burst,
            refilled: Instant::now(),
        }
    }

    fn refill(&mut self) {
        let now = Instant::now();
        let earned = (now.duration_since(self.refilled).as_nanos() / self.refill.as_nanos().max(1))
            .min(u128::from(self.burst)) as u32;
        if earned > 0 {
            self.tokens = (self.tokens + earned).min(self.burst);
            self.refilled = if self.tokens == self.burst {
                now
            } else {
                self.refilled + self.refill * earned
            };
        }
    }

    /// `None` when a request may go on; otherwise how long until one may.
    fn wait(&mut self) -> Option<Duration> {
        self.refill();
        (self.tokens == 0).then(|| self.refill.saturating_sub(self.refilled.elapsed()))
    }

    fn spend(&mut self) {
        self.refill();
        self.tokens = self.tokens.saturating_sub(1);
    }
}

/// The endpoint's state.
#[derive(Clone, Debug)]
pub(crate) struct ResumeEndpoint {
    store: PausedFlow,
    secret: Secret,
    bad: Arc<Mutex<Bucket>>,
}

impl ResumeEndpoint {
    pub(crate) fn new(store: PausedFlow, secret: Secret) -> Self {
        ResumeEndpoint::with_limit(store, secret, BAD_BURST, BAD_REFILL)
    }

    /// As [`ResumeEndpoint::new`], with another bad-request limit.
    pub(crate) fn with_limit(
        store: PausedFlow,
        secret: Secret,
        burst: u32,
        refill: Duration,
    ) -> Self {
        ResumeEndpoint {
            store,
            secret,
            bad: Arc::new(Mutex::new(Bucket::full(burst, refill))),
        }
    }

    fn bucket(&self) -> std::sync::MutexGuard<'_, Bucket> {
        self.bad.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The routes, to merge into the admin router.
    pub(crate) fn router(self) -> Router {
        Router::new()
            .route("/paused/resume", post(resume))
            .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
            .with_state(self)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResumeRequest {
    token: String,
    #[serde(default)]
    payload: Value,
}

fn refusal(status: StatusCode, error: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({ "error": error, "message": message.into() })),
    )
        .into_response()
}

async fn resume(
    State(ep): State<ResumeEndpoint>,
    headers: HeaderMap,
    body: Result<Json<ResumeRequest>, JsonRejection>,
) -> Response {
    if let Some(wait) = ep.bucket().wait() {
        let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
        let mut r = refusal(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limited",
            format!("too many bad resume requests; retry in {secs} s"),
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        return r;
    }
    let offered = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
    if !offered.is_some_and(|o| ep.secret.matches(o)) {
        ep.bucket().spend();
        let mut r = refusal(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a resume needs `Authorization: Bearer <paused.resume_secret>`",
        );
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return r;
    }
    let request = match body {
        Ok(Json(r)) => r,
        Err(e) => {
            return refusal(e.status(), "bad_request", e.body_text());
        }
    };
    if ResumeToken::parse(&request.token).is_none() {
        ep.bucket().spend();
        return refusal(
            StatusCode::BAD_REQUEST,
            "invalid",
            "`token` is not a resume token (prt_ and 64 hex digits)",
        );
    }
    // The resume commits to the database: it runs in its own task so that a client that hangs
    // up does not drop it mid-commit (the answer is then simply not read).
    let store = ep.store.clone();
    let task = tokio::spawn(async move { store.resume(&request.token, &request.payload).await });
    let outcome = match task.await {
        Ok(o) => o,
        Err(e) => {
            return refusal(
                StatusCode::INTERNAL_SERVER_ERROR,
                "outcome_unknown",
                format!(
                    "the resume stopped ({e}); retry with the same token and payload, a resume \
                     is idempotent"
                ),
            );
        }
    };
    match outcome {
        Ok(r) => (
            StatusCode::OK,
            Json(json!({
                "id": r.id,
                "resumed_at": nexuscrm_flow::spec::format_time(r.resumed_at),
                "first": r.first,
            })),
        )
            .into_response(),
        Err(e) => {
            let (status, error) = match e.kind() {
                PauseErrorKind::Invalid => (StatusCode::BAD_REQUEST, "invalid"),
                PauseErrorKind::UnknownToken => (StatusCode::NOT_FOUND, "unknown_token"),
                PauseErrorKind::Expired => (StatusCode::GONE, "expired"),
                PauseErrorKind::Cancelled => (StatusCode::GONE, "cancelled"),
                PauseErrorKind::Conflict => (StatusCode::CONFLICT, "conflict"),
                PauseErrorKind::NotAccepted => (StatusCode::SERVICE_UNAVAILABLE, "not_accepted"),
                _ => (StatusCode::INTERNAL_SERVER_ERROR, "outcome_unknown"),
            };
            // A guess at a token costs from the bucket; a refusal of a real token does not.
            if e.kind() == PauseErrorKind::UnknownToken {
                ep.bucket().spend();
            }
            refusal(status, error, e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use nexuscrm_paused::{NewPause, PausedOptions};
    use nexuscrm_persistence::Dialect;
    use nexuscrm_persistence::testing::TestDb;
    use nexuscrm_worker_test::clock::ManualClock;
    use std::time::SystemTime;
    use tower::ServiceExt as _;

    const SECRET: &str = "0123456789abcdef0123456789abcdef-test";

    async fn call(
        router: &Router,
        auth: Option<&str>,
        body: &str,
    ) -> (StatusCode, Value, HeaderMap) {
        let mut req =
            Request::post("/paused/resume").header(header::CONTENT_TYPE, "application/json");
        if let Some(a) = auth {
            req = req.header(header::AUTHORIZATION, a);
        }
        let resp = router
            .clone()
            .oneshot(req.body(Body::from(body.to_owned())).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap();
        let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (status, v, headers)
    }

    fn bearer() -> String {
        format!("Bearer {SECRET}")
    }

    fn body(token: &str, payload: Value) -> String {
        json!({ "token": token, "payload": payload }).to_string()
    }

    async fn store(label: &str, clock: Arc<ManualClock>) -> (TestDb, PausedFlow) {
        let db = TestDb::create(Dialect::Sqlite, label)
            .await
            .expect("SQLite is always here");
        let store = PausedFlow::open(db.db.clone(), PausedOptions::default().clock(clock))
            .await
            .unwrap();
        (db, store)
    }

    #[tokio::test]
    async fn answers_each_outcome_with_its_own_status_and_refusals_change_nothing() {
        let clock = ManualClock::at(SystemTime::UNIX_EPOCH + Duration::from_secs(1_900_000_000));
        let (_db, store) = store("resume_endpoint", clock.clone()).await;
        let router = ResumeEndpoint::new(store.clone(), Secret::new(SECRET)).router();
        let p = store
            .pause(NewPause::new(
                "run-1",
                "approve",
                Duration::from_secs(60),
                json!({"n": 1}),
            ))
            .await
            .unwrap();
        let token = p.token.expose().to_owned();

        // No secret, a wrong one, a wrong scheme: 401, nothing read.
        for auth in [None, Some("Bearer nope"), Some(&*format!("Basic {SECRET}"))] {
            let (s, v, h) = call(&router, auth, &body(&token, json!({}))).await;
            assert_eq!(s, StatusCode::UNAUTHORIZED, "{v}");
            assert_eq!(h[header::WWW_AUTHENTICATE], "Bearer");
        }
        // Malformed requests: 400 (or 413 for a body past the limit).
        for bad in [
            "{",
            "[]",
            r#"{"payload": {}}"#,
            r#"{"token": "prt_1", "extra": 1}"#,
        ] {
            let (s, v, _) = call(&router, Some(&bearer()), bad).await;
            assert!(
                s == StatusCode::BAD_REQUEST || s == StatusCode::UNPROCESSABLE_ENTITY,
                "{bad}: {s} {v}"
            );
        }
        let (s, v, _) = call(&router, Some(&bearer()), &body("not-a-token", json!({}))).await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("invalid"))
        );
        let huge = body(&token, json!({ "x": "y".repeat(2 * MAX_PAYLOAD_BYTES) }));
        let (s, _, _) = call(&router, Some(&bearer()), &huge).await;
        assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
        // Within the body limit, past the store's payload limit: the store's own refusal.
        let over = body(&token, json!({ "x": "y".repeat(MAX_PAYLOAD_BYTES) }));
        let (s, v, _) = call(&router, Some(&bearer()), &over).await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("invalid")),
            "{v}"
        );
        let unknown = format!("prt_{}", "0".repeat(64));
        let (s, v, _) = call(&router, Some(&bearer()), &body(&unknown, json!({}))).await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::NOT_FOUND, Some("unknown_token"))
        );
        let st = store.status(p.id).await.unwrap().unwrap();
        assert_eq!((st.state.as_str(), st.resume_payload), ("paused", None));

        // The resume, its repeat, and another payload for the used token.
        let (s, v, _) = call(&router, Some(&bearer()), &body(&token, json!({"ok": true}))).await;
        assert_eq!(
            (s, v["id"].as_i64(), v["first"].as_bool()),
            (StatusCode::OK, Some(p.id), Some(true)),
            "{v}"
        );
        let (s, v2, _) = call(&router, Some(&bearer()), &body(&token, json!({"ok": true}))).await;
        assert_eq!((s, v2["first"].as_bool()), (StatusCode::OK, Some(false)));
        assert_eq!(v["resumed_at"], v2["resumed_at"]);
        let (s, v, _) = call(
            &router,
            Some(&bearer()),
            &body(&token, json!({"ok": false})),
        )
        .await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::CONFLICT, Some("conflict")),
            "{v}"
        );
        let st = store.status(p.id).await.unwrap().unwrap();
        assert_eq!(
            (st.state.as_str(), st.resume_payload),
            ("resumable", Some(json!({"ok": true})))
        );

        // Cancelled and expired pauses: 410, each with its own error.
        let c = store
            .pause(NewPause::new(
                "run-2",
                "approve",
                Duration::from_secs(60),
                json!({}),
            ))
            .await
            .unwrap();
        store.cancel(c.id).await.unwrap();
        let (s, v, _) = call(&router, Some(&bearer()), &body(c.token.expose(), json!({}))).await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::GONE, Some("cancelled"))
        );
        let e = store
            .pause(NewPause::new(
                "run-3",
                "approve",
                Duration::from_secs(60),
                json!({}),
            ))
            .await
            .unwrap();
        clock.set(e.timeout_at + Duration::from_secs(1));
        let (s, v, _) = call(&router, Some(&bearer()), &body(e.token.expose(), json!({}))).await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::GONE, Some("expired"))
        );
        assert_eq!(
            store.status(e.id).await.unwrap().unwrap().resume_payload,
            None
        );
    }

    #[tokio::test]
    async fn bad_requests_exhaust_the_bucket_then_every_resume_waits() {
        let clock = ManualClock::at(SystemTime::UNIX_EPOCH + Duration::from_secs(1_900_000_000));
        let (_db, store) = store("resume_limit", clock).await;
        // A refill of an hour: nothing earns a token back while the test runs.
        let router = ResumeEndpoint::with_limit(
            store.clone(),
            Secret::new(SECRET),
            3,
            Duration::from_secs(3600),
        )
        .router();
        let p = store
            .pause(NewPause::new(
                "run-1",
                "approve",
                Duration::from_secs(60),
                json!({}),
            ))
            .await
            .unwrap();
        let good = body(p.token.expose(), json!({}));
        // Refusals of a real token (here: a repeat resume is fine, a conflict is not a guess)
        // cost nothing.
        let unknown = body(&format!("prt_{}", "f".repeat(64)), json!({}));
        let (s, _, _) = call(&router, Some("Bearer wrong"), &good).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        let (s, _, _) = call(&router, Some(&bearer()), &unknown).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        let (s, _, _) = call(&router, Some(&bearer()), &body("prt_short", json!({}))).await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        // Three bad requests spent the bucket: even the right secret and token now wait.
        let (s, v, h) = call(&router, Some(&bearer()), &good).await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::TOO_MANY_REQUESTS, Some("rate_limited"))
        );
        let after: u64 = h[header::RETRY_AFTER].to_str().unwrap().parse().unwrap();
        assert!((1..=3600).contains(&after), "{after}");
        assert_eq!(store.status(p.id).await.unwrap().unwrap().state, "paused");
    }

    #[tokio::test(start_paused = true)]
    async fn the_bucket_refills_one_request_per_interval() {
        let mut b = Bucket::full(2, Duration::from_secs(1));
        assert_eq!(b.wait(), None);
        b.spend();
        b.spend();
        assert_eq!(b.wait(), Some(Duration::from_secs(1)));
        tokio::time::advance(Duration::from_millis(400)).await;
        assert_eq!(b.wait(), Some(Duration::from_millis(600)));
        tokio::time::advance(Duration::from_millis(600)).await;
        assert_eq!(b.wait(), None);
        b.spend();
        assert!(b.wait().is_some());
        // A long quiet time refills to the burst, no further.
        tokio::time::advance(Duration::from_secs(3600)).await;
        b.spend();
        b.spend();
        assert!(b.wait().is_some());
    }

    #[test]
    fn the_secret_never_shows_and_compares_whole() {
        let s = Secret::new(SECRET);
        assert!(s.matches(SECRET.as_bytes()));
        assert!(!s.matches(&SECRET.as_bytes()[1..]));
        assert!(!s.matches(b""));
        assert!(!format!("{s:?}").contains(SECRET));
        assert!(!format!("{:?}", SecretText(SECRET.into())).contains(SECRET));
    }
}
