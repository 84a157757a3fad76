//! The admin HTTP server's connection handling: a header-read timeout, a connection cap that
//! sheds the oldest idle connection (so `/livez` answers under a flood of idle or half-open
//! connections), a `Host` check against DNS rebinding, and a log line whenever a limit acts.
//!
//! `axum::serve` has none of these (no header timeout, no cap), so connections are served here
//! with hyper's HTTP/1 builder and the axum router as the service.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long a client may take to send a request's headers before its connection is closed.
pub(crate) const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once. At the cap, the oldest connection not serving a request is
/// closed to admit the new one; if every connection is mid-request, the new one is refused.
pub(crate) const MAX_CONNECTIONS: usize = 64;
/// At most one log line per limit per this interval (with the count since the last line).
const LOG_EVERY: Duration = Duration::from_secs(10);

/// The admin server's limits.
#[derive(Debug, Clone)]
pub(crate) struct Limits {
    pub(crate) header_timeout: Duration,
    pub(crate) max_connections: usize,
    /// Host names accepted besides `localhost`, `*.localhost` and loopback IP literals.
    pub(crate) allowed_hosts: Vec<String>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: HEADER_TIMEOUT,
            max_connections: MAX_CONNECTIONS,
            allowed_hosts: Vec::new(),
        }
    }
}

/// Whether `host` (a `Host` header's value, port included or not) names this loopback server:
/// `localhost`, a name under `.localhost`, a loopback IP literal, or one of `extra`. A
/// DNS-rebinding page sends its own domain name, which none of these match.
pub(crate) fn host_allowed(host: &str, extra: &[String]) -> bool {
    let host = host.trim();
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return ip.is_loopback();
    }
    let name = if let Some(rest) = host.strip_prefix('[') {
        // [v6]:port
        match rest.split_once(']') {
            Some((v6, _)) => v6,
            None => return false,
        }
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if port.chars().all(|c| c.is_ascii_digit()) => name,
            _ => host,
        }
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    if name.is_empty() {
        return false;
    }
    if name == "localhost" || name.ends_with(".localhost") {
        return true;
    }
    if let Ok(ip) = name.parse::<std::net::IpAddr>() {
        return ip.is_loopback();
    }
    extra.iter().any(|h| h.eq_ignore_ascii_case(&name))
}

/// A rate-limited counter behind a log line.
struct Throttled {
    what: &'static str,
    count: AtomicU64,
    last: Mutex<Option<Instant>>,
}

impl Throttled {
    const fn new(what: &'static str) -> Self {
        Throttled {
            what,
            count: AtomicU64::new(0),
            last: Mutex::new(None),
        }
    }

    fn hit(&self, detail: &dyn std::fmt::Display) {
        let n = self.count.fetch_add(1, Relaxed) + 1;
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
            *last = Some(Instant::now());
            self.count.store(0, Relaxed);
            tracing::warn!(
                "admin HTTP: {} ({n} since the last such line): {detail}",
                self.what
            );
        }
    }
}

struct Conn {
    busy: Arc<AtomicUsize>,
    kill: CancellationToken,
}

struct State {
    conns: Mutex<BTreeMap<u64, Conn>>,
    shed: Throttled,
    refused: Throttled,
    accept_failed: Throttled,
    bad_host: Throttled,
}

/// Serves `router` on `listener` until `stop`, then closes every connection gracefully.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    stop: CancellationToken,
) {
    let state = Arc::new(State {
        conns: Mutex::new(BTreeMap::new()),
        shed: Throttled::new("connection limit reached, closed the oldest idle connection"),
        refused: Throttled::new("connection limit reached with every connection busy, refused"),
        accept_failed: Throttled::new("accept failed"),
        bad_host: Throttled::new("refused a request for a host that is not this loopback server"),
    });
    let limits = Arc::new(limits);
    let mut tasks = JoinSet::new();
    let mut next_id: u64 = 0;
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            a = listener.accept() => a,
        };
        let (tcp, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors (EMFILE) and the like: back off a little instead of
                // spinning, and say so.
                state.accept_failed.hit(&e);
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(Duration::from_millis(50)) => continue,
                }
            }
        };
        let busy = Arc::new(AtomicUsize::new(0));
        let kill = CancellationToken::new();
        {
            let mut conns = state.conns.lock().unwrap_or_else(|e| e.into_inner());
            if conns.len() >= limits.max_connections {
                let idle = conns
                    .iter()
                    .find(|(_, c)| c.busy.load(Relaxed) == 0)
                    .map(|(id, _)| *id);
                match idle {
                    Some(id) => {
                        if let Some(c) = conns.remove(&id) {
                            c.kill.cancel();
                        }
                        state.shed.hit(&format_args!("admitted {peer}"));
                    }
                    None => {
                        state.refused.hit(&format_args!("{peer}"));
                        drop(tcp);
                        continue;
                    }
                }
            }
            next_id += 1;
            conns.insert(
                next_id,
                Conn {
                    busy: busy.clone(),
                    kill: kill.clone(),
                },
            );
        }
        let id = next_id;
        let state = state.clone();
        let limits = limits.clone();
        let router = router.clone();
        let stop = stop.clone();
        tasks.spawn(async move {
            serve_one(tcp, router, &limits, &state, busy, kill, stop).await;
            state
                .conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
        });
    }
    // Stopping: every connection finishes its request in flight, then closes (bounded).
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    tasks.abort_all();
}

async fn serve_one(
    tcp: tokio::net::TcpStream,
    router: Router,
    limits: &Limits,
    state: &Arc<State>,
    busy: Arc<AtomicUsize>,
    kill: CancellationToken,
    stop: CancellationToken,
) {
    let inner = TowerToHyperService::new(router);
    let extra = limits.allowed_hosts.clone();
    let state2 = state.clone();
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let busy = busy.clone();
        let host = req
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .map(str::to_owned);
        let allowed = host.as_deref().is_some_and(|h| host_allowed(h, &extra));
        if !allowed {
            state2.bad_host.hit(&format_args!(
                "Host {:?}",
                truncate(host.as_deref().unwrap_or(""))
            ));
        }
        let fut = allowed.then(|| hyper::service::Service::call(&inner, req));
        async move {
            let Some(fut) = fut else {
                return Ok::<_, std::convert::Infallible>(
                    Response::builder()
                        .status(StatusCode::MISDIRECTED_REQUEST)
                        .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
                        .body(Body::from(
                            "this admin server answers only to loopback host names \
                             (localhost, 127.0.0.1, [::1]) and admin_allowed_hosts\n",
                        ))
                        .unwrap_or_default(),
                );
            };
            busy.fetch_add(1, Relaxed);
            let r = fut.await;
            busy.fetch_sub(1, Relaxed);
            r
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(64 * 1024);
    let conn = builder.serve_connection(TokioIo::new(tcp), svc);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        () = kill.cancelled() => {}
        () = stop.cancelled() => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(Duration::from_secs(1), conn.as_mut()).await;
        }
    }
}

fn truncate(s: &str) -> String {
    crate::echo(s, 80)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_names_and_configured_hosts_are_allowed() {
        let none: Vec<String> = Vec::new();
        for ok in [
            "localhost",
            "localhost:9464",
            "LOCALHOST.",
            "app.localhost:1",
            "127.0.0.1",
            "127.0.0.1:9464",
            "127.1.2.3:80",
            "[::1]:9464",
            "[::1]",
            "::1",
        ] {
            assert!(host_allowed(ok, &none), "{ok}");
        }
        for bad in [
            "",
            ":9464",
            "evil.example",
            "evil.example:9464",
            "localhost.evil.example",
            "10.0.0.1:9464",
            "192.168.1.2",
            "[2001:db8::1]:80",
            "[::1",
        ] {
            assert!(!host_allowed(bad, &none), "{bad}");
        }
        let extra = vec!["worker.internal".to_owned()];
        assert!(host_allowed("Worker.Internal:9464", &extra));
        assert!(!host_allowed("other.internal", &extra));
    }

    #[test]
    fn echoed_hosts_are_truncated() {
        let long = "x".repeat(10_000);
        let t = truncate(&long);
        assert!(t.len() < 120, "{t}");
        assert!(t.contains("10000 bytes"));
        assert_eq!(truncate("short"), "short");
    }
}
