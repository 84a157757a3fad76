//! The external effect: an HTTP POST to a configured endpoint, with a per-effect idempotency
//! key, timeouts, and a classification of every outcome that never guesses.
//!
//! The connection is made before any byte of the request exists, so "refused" provably sent
//! nothing; once the request may have been written, an answer that does not say what happened
//! (a timeout, a reset mid-response, a 5xx from a connector that does not dedup) is
//! [`EffectOutcome::Uncertain`], to be quarantined, never resent blindly. A connector that
//! declares idempotency support (the receiver dedups by `Idempotency-Key`) may be resent with
//! the same key ([`EffectOutcome::RetrySafe`]); one that declares an observable outcome (a `GET`
//! by key) is asked before an ambiguous answer is called uncertain.

use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// Where and how an effect is sent.
#[derive(Debug, Clone)]
pub struct Connector {
    host: String,
    port: u16,
    path: String,
    connect_timeout: Duration,
    timeout: Duration,
    idempotent: bool,
    observe_path: Option<String>,
}

/// A connector URL or setting that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectorError(String);

impl std::fmt::Display for ConnectorError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConnectorError {}

impl Connector {
    /// A connector posting to `url` (`http://host:port/path`; TLS is the deployment's proxy's
    /// job), with a 2 s connect timeout and a 10 s request timeout, not idempotent, not
    /// observable.
    ///
    /// # Errors
    ///
    /// When `url` is not `http://host[:port][/path]`.
    pub fn new(url: &str) -> Result<Connector, ConnectorError> {
        let (host, port, path) = parse_http_url(url)?;
        Ok(Connector {
            host,
            port,
            path,
            connect_timeout: Duration::from_secs(2),
            timeout: Duration::from_secs(10),
            idempotent: false,
            observe_path: None,
        })
    }

    /// How long the whole request may take once connected; past it the outcome is uncertain.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long connecting may take; past it nothing was sent.
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The receiver dedups by `Idempotency-Key`: an ambiguous answer may be resent with the
    /// same key.
    #[must_use]
    pub fn idempotent(mut self, yes: bool) -> Self {
        self.idempotent = yes;
        self
    }

    /// The receiver answers `GET {path}?key=KEY` with `{"applied": true|false}` (or 404 for a
    /// key it never applied): ambiguous answers are resolved by asking it.
    #[must_use]
    pub fn observable(mut self, path: impl Into<String>) -> Self {
        self.observe_path = Some(path.into());
        self
    }

    /// Whether the receiver declared an observable outcome ([`Connector::observable`]).
    #[must_use]
    pub fn is_observable(&self) -> bool {
        self.observe_path.is_some()
    }

    /// Sends `body` as a JSON POST with `Idempotency-Key: key`, and classifies the outcome.
    /// Cancellation before the connection exists sends nothing ([`EffectOutcome::NotApplied`]);
    /// after it, the outcome is uncertain unless the connector says otherwise.
    pub async fn send(&self, key: &str, body: &Value, cancel: &CancellationToken) -> EffectOutcome {
        let started = Instant::now();
        let sent_at = SystemTime::now();
        let evidence =
            |status: Option<u16>, error: Option<String>, response: Option<String>| Evidence {
                status,
                error,
                response,
                sent_at,
                elapsed: started.elapsed(),
            };
        // Connect first: until this succeeds, no byte of the request exists.
        let stream = tokio::select! {
            biased;
            () = cancel.cancelled() => {
                return EffectOutcome::NotApplied {
                    reason: "cancelled before connecting: nothing was sent".into(),
                    retry_after: None,
                };
            }
            r = tokio::time::timeout(
                self.connect_timeout,
                TcpStream::connect((self.host.as_str(), self.port)),
            ) => r,
        };
        let stream = match stream {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                return EffectOutcome::NotApplied {
                    reason: format!(
                        "cannot connect to {}:{}: {e}; nothing was sent",
                        self.host, self.port
                    ),
                    retry_after: None,
                };
            }
            Err(_) => {
                return EffectOutcome::NotApplied {
                    reason: format!(
                        "no connection to {}:{} within {:?}; nothing was sent",
                        self.host, self.port, self.connect_timeout
                    ),
                    retry_after: None,
                };
            }
        };
        let exchange = self.exchange(stream, "POST", &self.path, key, Some(body));
        let answer = tokio::select! {
            biased;
            () = cancel.cancelled() => Err("cancelled after connecting: the request may have been sent".to_owned()),
            r = tokio::time::timeout(self.timeout, exchange) => match r {
                Ok(r) => r,
                Err(_) => Err(format!("no answer within {:?} after the request was sent", self.timeout)),
            },
        };
        let outcome = match answer {
            Ok((status, text)) => classify(status, text, |s, t| evidence(Some(s), None, Some(t))),
            Err(error) => Ambiguous(evidence(None, Some(error), None)),
        };
        match outcome {
            Classified::Final(o) => o,
            Ambiguous(ev) => self.resolve(key, ev).await,
        }
    }

    /// An ambiguous answer: resolved by the observable outcome, resent when the connector
    /// dedups, otherwise uncertain.
    async fn resolve(&self, key: &str, evidence: Evidence) -> EffectOutcome {
        if self.observe_path.is_some() {
            match self.observe(key).await {
                Ok(true) => {
                    return EffectOutcome::Applied {
                        status: evidence.status.unwrap_or(0),
                        response: "observed as applied".into(),
                        observed: true,
                    };
                }
                Ok(false) => {
                    return EffectOutcome::NotApplied {
                        reason: format!("observed as not applied after: {}", evidence.summary()),
                        retry_after: None,
                    };
                }
                Err(_) => {}
            }
        }
        if self.idempotent {
            EffectOutcome::RetrySafe { evidence }
        } else {
            EffectOutcome::Uncertain { evidence }
        }
    }

    /// Asks the receiver whether `key` was applied (`GET {observe}?key=KEY`).
    ///
    /// # Errors
    ///
    /// No observable outcome declared, or the receiver could not say.
    pub async fn observe(&self, key: &str) -> Result<bool, String> {
        let path = self
            .observe_path
            .as_deref()
            .ok_or("the connector declares no observable outcome")?;
        let stream = tokio::time::timeout(
            self.connect_timeout,
            TcpStream::connect((self.host.as_str(), self.port)),
        )
        .await
        .map_err(|_| "no connection for the observation".to_owned())?
        .map_err(|e| format!("cannot connect for the observation: {e}"))?;
        let sep = if path.contains('?') { '&' } else { '?' };
        let target = format!("{path}{sep}key={}", percent_encode(key));
        let (status, text) = tokio::time::timeout(
            self.timeout,
            self.exchange(stream, "GET", &target, key, None),
        )
        .await
        .map_err(|_| "the observation timed out".to_owned())??;
        match status {
            404 => Ok(false),
            200..=299 => {
                let v: Value = serde_json::from_str(&text)
                    .map_err(|e| format!("the observation is not JSON: {e}"))?;
                v.get("applied")
                    .and_then(Value::as_bool)
                    .ok_or_else(|| "the observation has no boolean \"applied\"".to_owned())
            }
            s => Err(format!("the observation answered {s}")),
        }
    }

    async fn exchange(
        &self,
        stream: TcpStream,
        method: &str,
        target: &str,
        key: &str,
        body: Option<&Value>,
    ) -> Result<(u16, String), String> {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP handshake failed: {e}"))?;
        let driver = tokio::spawn(async move {
            let _ = conn.await;
        });
        let bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let request = Request::builder()
            .method(method)
            .uri(target)
            .header("host", format!("{}:{}", self.host, self.port))
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Full::new(bytes))
            .map_err(|e| format!("cannot build the request: {e}"))?;
        let result = async {
            let response = sender
                .send_request(request)
                .await
                .map_err(|e| format!("the request failed after connecting: {e}"))?;
            let status = response.status();
            let retry_after = response
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok());
            let collected = response
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("the response broke off after status {status}: {e}"))?;
            let text = String::from_utf8_lossy(&collected.to_bytes()).into_owned();
            Ok((status, retry_after, text))
        }
        .await;
        driver.abort();
        result.map(|(status, retry_after, text)| {
            // Retry-After travels in the text's first line for `classify`.
            let text = match retry_after {
                Some(secs) => format!("retry-after:{secs}\n{text}"),
                None => text,
            };
            (status.as_u16(), text)
        })
    }
}

enum Classified {
    Final(EffectOutcome),
    Ambiguous(Evidence),
}
use Classified::Ambiguous;

/// The outcome of one answered request, by its status alone.
fn classify(status: u16, text: String, evidence: impl Fn(u16, String) -> Evidence) -> Classified {
    let (retry_after, text) = match text.strip_prefix("retry-after:") {
        Some(rest) => {
            let (secs, body) = rest.split_once('\n').unwrap_or((rest, ""));
            (
                secs.parse::<u64>().ok().map(Duration::from_secs),
                body.to_owned(),
            )
        }
        None => (None, text),
    };
    let short = nexuscrm_persistence::support::echo(&text, 512);
    match StatusCode::from_u16(status).ok() {
        Some(s) if s.is_success() => Classified::Final(EffectOutcome::Applied {
            status,
            response: short,
            observed: false,
        }),
        // The server says it did nothing: 408 (it gave up waiting for the request), 429, and
        // 503 with Retry-After.
        Some(StatusCode::REQUEST_TIMEOUT | StatusCode::TOO_MANY_REQUESTS) => {
            Classified::Final(EffectOutcome::NotApplied {
                reason: format!("the receiver answered {status}: not applied"),
                retry_after,
            })
        }
        Some(StatusCode::SERVICE_UNAVAILABLE) if retry_after.is_some() => {
            Classified::Final(EffectOutcome::NotApplied {
                reason: format!("the receiver answered {status} with Retry-After: not applied"),
                retry_after,
            })
        }
        Some(s) if s.is_client_error() => Classified::Final(EffectOutcome::Rejected {
            status,
            response: short,
        }),
        // 5xx and anything else: the receiver may or may not have applied it.
        _ => Ambiguous(evidence(status, short)),
    }
}

/// What an effect's request led to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EffectOutcome {
    /// 2xx (or observed as applied): complete the step.
    Applied {
        /// The HTTP status (0 when only observed).
        status: u16,
        /// The response body, cut at 512 bytes.
        response: String,
        /// Whether the answer came from the observable outcome.
        observed: bool,
    },
    /// A definite rejection (4xx other than 408 and 429): the step's failure, never retried.
    Rejected {
        /// The HTTP status.
        status: u16,
        /// The response body, cut at 512 bytes.
        response: String,
    },
    /// Provably not applied (nothing was sent, the receiver said so, or the observable outcome
    /// said so): safe to send again later.
    NotApplied {
        /// Why.
        reason: String,
        /// The receiver's Retry-After, if it gave one.
        retry_after: Option<Duration>,
    },
    /// Ambiguous, from a connector that dedups by key: resend with the same key.
    RetrySafe {
        /// What was seen.
        evidence: Evidence,
    },
    /// Ambiguous: the request may have been applied. Quarantine; never resend without a
    /// person's decision or an observable outcome.
    Uncertain {
        /// What was seen.
        evidence: Evidence,
    },
}

/// What an ambiguous effect left behind, for the person who resolves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evidence {
    /// The HTTP status, if one arrived.
    pub status: Option<u16>,
    /// The transport error or timeout, if any.
    pub error: Option<String>,
    /// The response body, cut at 512 bytes, if one arrived.
    pub response: Option<String>,
    /// When the request was started.
    pub sent_at: SystemTime,
    /// How long it took until the outcome.
    pub elapsed: Duration,
}

impl Evidence {
    /// The evidence as JSON, as the store records it.
    #[must_use]
    pub fn to_json(&self) -> Value {
        json!({
            "status": self.status,
            "error": self.error,
            "response": self.response,
            "sent_at_ms": nexuscrm_persistence::support::to_ms(self.sent_at),
            "elapsed_ms": self.elapsed.as_millis() as u64,
        })
    }

    fn summary(&self) -> String {
        match (&self.status, &self.error) {
            (Some(s), _) => format!("status {s}"),
            (None, Some(e)) => e.clone(),
            (None, None) => "no answer".into(),
        }
    }
}

fn parse_http_url(url: &str) -> Result<(String, u16, String), ConnectorError> {
    let bad = |why: &str| {
        ConnectorError(format!(
            "connector URL {:?} {why}: expected http://host[:port][/path]",
            nexuscrm_persistence::support::echo(url, 80)
        ))
    };
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| bad("is not http://"))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if authority.is_empty() || authority.contains('@') {
        return Err(bad("has no host, or has credentials"));
    }
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) => (h, p.parse::<u16>().map_err(|_| bad("has a bad port"))?),
        None => (authority, 80),
    };
    if host.is_empty() || port == 0 || path.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(bad("is malformed"));
    }
    Ok((host.to_owned(), port, path.to_owned()))
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_or_are_refused_with_the_reason() {
        assert_eq!(
            parse_http_url("http://127.0.0.1:8080/hook").unwrap(),
            ("127.0.0.1".into(), 8080, "/hook".into())
        );
        assert_eq!(
            parse_http_url("http://example.test").unwrap(),
            ("example.test".into(), 80, "/".into())
        );
        for bad in [
            "https://x/",
            "http://",
            "http://u:p@x/",
            "http://x:0/",
            "http://x:99999/",
            "http://x/a b",
        ] {
            assert!(parse_http_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn statuses_are_classified_without_guessing() {
        let ev = |s: u16, t: String| Evidence {
            status: Some(s),
            error: None,
            response: Some(t),
            sent_at: SystemTime::UNIX_EPOCH,
            elapsed: Duration::ZERO,
        };
        let final_of = |status: u16, text: &str| match classify(status, text.into(), ev) {
            Classified::Final(o) => Some(o),
            Ambiguous(_) => None,
        };
        assert!(matches!(
            final_of(201, "ok"),
            Some(EffectOutcome::Applied { status: 201, .. })
        ));
        assert!(matches!(
            final_of(422, "bad"),
            Some(EffectOutcome::Rejected { status: 422, .. })
        ));
        assert!(matches!(
            final_of(429, "retry-after:7\nslow down"),
            Some(EffectOutcome::NotApplied { retry_after: Some(d), .. }) if d == Duration::from_secs(7)
        ));
        assert!(matches!(
            final_of(408, ""),
            Some(EffectOutcome::NotApplied { .. })
        ));
        assert!(matches!(
            final_of(503, "retry-after:2\n"),
            Some(EffectOutcome::NotApplied { .. })
        ));
        assert_eq!(
            final_of(503, "down"),
            None,
            "503 without Retry-After is ambiguous"
        );
        assert_eq!(final_of(500, "oops"), None);
        assert_eq!(final_of(502, ""), None);
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(
            nexuscrm_persistence::testing::arbitrary_case_count(),
        ))]

        /// Any text as a connector URL: parsed or refused, never a panic.
        #[test]
        fn connector_urls_never_panic(s in "(http://)?\\PC{0,60}") {
            let _ = parse_http_url(&s);
        }
    }
}
