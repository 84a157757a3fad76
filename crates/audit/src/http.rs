//! The HTTP sink: a batch is one `POST` of JSON with an `Idempotency-Key` (the batch's first
//! and last sequence numbers, so a resent batch carries the same key) and every event's id in
//! the body, for a receiver that deduplicates.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::Line;

/// Where and how the HTTP sink posts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpSink {
    url: String,
    host: String,
    port: u16,
    path: String,
    timeout: Duration,
    max_backoff: Duration,
}

/// What one `POST` came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Posted {
    /// 2xx: the receiver holds the batch.
    Delivered,
    /// No answer, a broken answer, 408, 425, 429 or 5xx: the receiver may or may not hold it;
    /// send it again with the same key.
    Ambiguous(String),
    /// Any other answer: the receiver will never take this batch.
    Rejected(String),
}

impl HttpSink {
    /// A sink posting to `url` (`http://host[:port]/path`): 10 s per request, retries backing
    /// off up to 30 s.
    ///
    /// # Errors
    ///
    /// A URL that is not `http://` with a host (TLS is not built in: put a local TLS-terminating
    /// proxy in front of a remote receiver), or a bad port.
    pub fn new(url: &str) -> Result<HttpSink, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| {
            if url.starts_with("https://") {
                format!(
                    "audit HTTP sink {url:?}: https is not built in; send to a local \
                     TLS-terminating proxy over http://"
                )
            } else {
                format!("audit HTTP sink {url:?} must be an http:// URL")
            }
        })?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) => (
                h,
                p.parse::<u16>()
                    .map_err(|_| format!("audit HTTP sink {url:?}: bad port {p:?}"))?,
            ),
            None => (authority, 80),
        };
        if host.is_empty() || host.contains(char::is_whitespace) || path.contains(' ') {
            return Err(format!("audit HTTP sink {url:?} names no usable host"));
        }
        Ok(HttpSink {
            url: url.to_owned(),
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
            port,
            path: path.to_owned(),
            timeout: Duration::from_secs(10),
            max_backoff: Duration::from_secs(30),
        })
    }

    /// Each request's bound (connect, send, answer). By default 10 s.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(10));
        self
    }

    /// The longest wait between two tries of an ambiguous batch (they start at 100 ms and
    /// double). By default 30 s.
    #[must_use]
    pub fn max_backoff(mut self, max: Duration) -> Self {
        self.max_backoff = max.max(Duration::from_millis(1));
        self
    }

    /// The receiver's URL.
    #[must_use]
    pub fn url(&self) -> &str {
        &self.url
    }

    pub(crate) fn max_backoff_bound(&self) -> Duration {
        self.max_backoff
    }

    /// The batch's idempotency key: the same events always get the same key.
    pub(crate) fn key(lines: &[Line]) -> String {
        match (lines.first(), lines.last()) {
            (Some(a), Some(b)) => format!("audit-{}-{}", a.seq, b.seq),
            _ => "audit-empty".to_owned(),
        }
    }

    /// The request body: the key and every event (with its id) in sequence order.
    pub(crate) fn body(key: &str, lines: &[Line]) -> Bytes {
        Bytes::from(serde_json::json!({ "idempotency_key": key, "events": lines }).to_string())
    }

    /// One `POST` of `body` under `key`, bounded by the timeout.
    pub(crate) async fn post(&self, key: &str, body: Bytes) -> Posted {
        match tokio::time::timeout(self.timeout, self.exchange(key, body)).await {
            Err(_) => Posted::Ambiguous(format!(
                "no answer within {:?} from {}",
                self.timeout, self.url
            )),
            Ok(Err(e)) => Posted::Ambiguous(e),
            Ok(Ok((status, text))) => classify(status, &text),
        }
    }

    async fn exchange(&self, key: &str, body: Bytes) -> Result<(u16, String), String> {
        let stream = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| format!("cannot connect to {}: {e}", self.url))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP handshake with {} failed: {e}", self.url))?;
        let driver = tokio::spawn(async move {
            let _ = conn.await;
        });
        let result = async {
            let request = Request::builder()
                .method("POST")
                .uri(self.path.as_str())
                .header("host", format!("{}:{}", self.host, self.port))
                .header("content-type", "application/json")
                .header("idempotency-key", key)
                .body(Full::new(body))
                .map_err(|e| format!("cannot build the request: {e}"))?;
            let response = sender
                .send_request(request)
                .await
                .map_err(|e| format!("the request to {} failed: {e}", self.url))?;
            let status = response.status().as_u16();
            let collected = response
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("the answer broke off after status {status}: {e}"))?;
            Ok((
                status,
                String::from_utf8_lossy(&collected.to_bytes()).into_owned(),
            ))
        }
        .await;
        driver.abort();
        result
    }
}

/// An answer by its status: 2xx delivered; 408, 425, 429 and 5xx ambiguous; anything else a
/// permanent rejection, with the receiver's reason (its first 500 bytes).
fn classify(status: u16, text: &str) -> Posted {
    let mut end = text.len().min(500);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let reason = format!("{status} {}", text[..end].trim());
    match status {
        200..=299 => Posted::Delivered,
        408 | 425 | 429 | 500..=599 => Posted::Ambiguous(reason),
        _ => Posted::Rejected(reason),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_and_answers_classified() {
        let s = HttpSink::new("http://127.0.0.1:8080/audit").unwrap();
        assert_eq!(
            (s.host.as_str(), s.port, s.path.as_str()),
            ("127.0.0.1", 8080, "/audit")
        );
        let s = HttpSink::new("http://receiver").unwrap();
        assert_eq!((s.port, s.path.as_str()), (80, "/"));
        for (bad, why) in [
            ("https://x/audit", "https is not built in"),
            ("ftp://x", "must be an http:// URL"),
            ("http://:80/a", "names no usable host"),
            ("http://x:port/a", "bad port"),
            ("", "must be an http:// URL"),
        ] {
            let e = HttpSink::new(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
        assert_eq!(classify(204, ""), Posted::Delivered);
        for s in [408, 425, 429, 500, 503] {
            assert!(matches!(classify(s, "busy"), Posted::Ambiguous(_)), "{s}");
        }
        for s in [301, 400, 401, 404, 413, 422] {
            assert!(matches!(classify(s, "no"), Posted::Rejected(_)), "{s}");
        }
        let long = "é".repeat(400);
        let Posted::Rejected(r) = classify(422, &long) else {
            panic!()
        };
        assert!(r.len() <= 505, "{}", r.len());
    }
}
