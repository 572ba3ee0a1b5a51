//! Counters over HTTP: `GET /metrics` answers [`Metrics::render_prometheus`] (Prometheus text
//! format 0.0.4), anything else 404 (405 for another method). Started by
//! [`Leader::new`](crate::connector::leader::Leader::new) at [`TcpConfig::metrics_addr`]
//! (`KVBM_METRICS_ADDR`) and by [`Worker::new`](crate::connector::worker::Worker::new) for its
//! own transfer counters at that port + 1 + rank; off when the setting is unset.
//!
//! A small responder of our own on one std thread rather than an HTTP stack: the endpoint is one
//! read-only page a scraper fetches every few seconds, and hyper/axum would bring dozens of
//! crates into the lean core for it. Connections are answered one at a time, each bounded by
//! [`IO_TIMEOUT`] for reading the request (at most [`MAX_REQUEST`] bytes) and writing the page,
//! so a client that connects and says nothing delays the next scrape by that much at most and
//! never touches the engine: the page is built from relaxed atomic reads, with no lock the
//! engine takes. The listener polls (every [`POLL`]) so that dropping the server stops the
//! thread promptly without a self-connection.
//!
//! Listening follows [`TcpConfig::check_listen`] with no token (the endpoint has none): a
//! non-loopback address needs `KVBM_ALLOW_INSECURE`. The counters say how much was cached and
//! hit, not what: no keys or tokens are on the page.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::config::{TcpConfig, METRICS_ADDR_ENV};
use crate::connector::metrics::Metrics;
use crate::error::{Error, ErrorKind, Result};

/// Deadline for reading one request and for writing one answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest request head read; a longer one gets a 400.
pub const MAX_REQUEST: usize = 8 * 1024;
/// How often the idle listener checks whether it should stop.
pub const POLL: Duration = Duration::from_millis(100);

/// A running metrics endpoint; dropping it stops the thread (within [`POLL`] plus a request in
/// progress) and closes the port.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `addr` (checked by [`TcpConfig::check_listen`], no token) and serves `metrics`.
    /// A bind failure is an [`ErrorKind::Io`] error naming [`METRICS_ADDR_ENV`] and the address.
    pub fn start(addr: SocketAddr, tcp: &TcpConfig, metrics: Arc<Metrics>) -> Result<Self> {
        tcp.check_listen("kvbm metrics endpoint", addr, false)?;
        let bind_err = |e: std::io::Error| {
            Error::new(
                ErrorKind::Io,
                format!("cannot listen for metrics on {addr}: {e}"),
            )
            .with("setting", METRICS_ADDR_ENV)
        };
        let listener = TcpListener::bind(addr).map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        let addr = listener.local_addr().map_err(bind_err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kvbm-metrics".into())
            .spawn(move || serve(&listener, &flag, &metrics))
            .map_err(|e| Error::internal(format!("cannot start the metrics thread: {e}")))?;
        Ok(Self {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The address it listens on (the bound port when 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(listener: &TcpListener, stop: &AtomicBool, metrics: &Metrics) {
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = answer(stream, metrics) {
                    tracing::debug!(error = %e, "metrics endpoint: request failed");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(e) => {
                tracing::warn!(error = %e, "metrics endpoint: accept failed");
                std::thread::sleep(POLL);
            }
        }
    }
}

/// Reads one request head and writes one answer; the connection is closed after it.
fn answer(mut stream: TcpStream, metrics: &Metrics) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    let complete = loop {
        if head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n") {
            break true;
        }
        if head.len() >= MAX_REQUEST {
            break false;
        }
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break head.contains(&b'\n');
        }
        head.extend_from_slice(&buf[..n]);
    };
    let (status, body) = if !complete {
        ("400 Bad Request", "bad request\n".to_string())
    } else {
        route(&head, metrics)
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(reply.as_bytes())?;
    stream.flush()
}

/// The status and body for a request head.
fn route(head: &[u8], metrics: &Metrics) -> (&'static str, String) {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics") => ("200 OK", metrics.render_prometheus()),
        (_, "/metrics") => ("405 Method Not Allowed", "only GET\n".to_string()),
        _ => ("404 Not Found", "see /metrics\n".to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::TierKind;
    use std::net::Ipv4Addr;

    fn get(addr: SocketAddr, request: &str) -> String {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.write_all(request.as_bytes()).expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("read");
        out
    }

    #[test]
    fn serves_the_counters_and_nothing_else() {
        let m = Arc::new(Metrics::new());
        m.record_lookup(32, 16);
        m.record_hit(TierKind::Host, 16);
        let server = MetricsServer::start(
            (Ipv4Addr::LOCALHOST, 0).into(),
            &TcpConfig::default(),
            m.clone(),
        )
        .expect("start");
        let page = get(server.addr(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(page.starts_with("HTTP/1.1 200 OK\r\n"), "{page}");
        assert!(page.contains(&m.render_prometheus()), "{page}");
        let page = get(server.addr(), "GET / HTTP/1.1\r\n\r\n");
        assert!(page.starts_with("HTTP/1.1 404"), "{page}");
        let page = get(server.addr(), "POST /metrics HTTP/1.1\r\n\r\n");
        assert!(page.starts_with("HTTP/1.1 405"), "{page}");
        let page = get(server.addr(), &"X".repeat(MAX_REQUEST));
        assert!(page.starts_with("HTTP/1.1 400"), "{page}");
        // A silent client delays the next scrape by IO_TIMEOUT at most.
        let silent = TcpStream::connect(server.addr()).expect("connect");
        let t = std::time::Instant::now();
        let page = get(server.addr(), "GET /metrics HTTP/1.0\r\n\r\n");
        assert!(page.starts_with("HTTP/1.1 200 OK\r\n"), "{page}");
        assert!(t.elapsed() < IO_TIMEOUT * 2, "{:?}", t.elapsed());
        drop(silent);
        let addr = server.addr();
        drop(server);
        assert!(TcpStream::connect(addr).is_err(), "port closed after drop");
    }

    #[test]
    fn non_loopback_needs_the_insecure_setting() {
        let m = Arc::new(Metrics::new());
        let any: SocketAddr = (Ipv4Addr::UNSPECIFIED, 0).into();
        let e = MetricsServer::start(any, &TcpConfig::default(), m.clone()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
        let tcp = TcpConfig {
            allow_insecure: true,
            ..TcpConfig::default()
        };
        MetricsServer::start(any, &tcp, m).expect("allowed when insecure is set");
    }
}
