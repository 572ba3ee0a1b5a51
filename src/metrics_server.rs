//! Counters over HTTP: `GET /metrics` answers [`Metrics::render_prometheus`] (Prometheus text
//! format 0.0.4), anything else 404 (405 for another method). Started by
//! [`Leader::new`](crate::connector::leader::Leader::new) at [`TcpConfig::metrics_addr`]
//! (`KVBM_METRICS_ADDR`) and by [`Worker::new`](crate::connector::worker::Worker::new) for its
//! own transfer counters at that port + 1 + rank; off when the setting is unset.
//!
//! A small responder of our own on one std thread rather than an HTTP stack: the endpoint is one
//! read-only page a scraper fetches every few seconds, and hyper/axum would bring dozens of
//! crates into the lean core for it. The thread serves every open connection at once, without
//! blocking on any: non-blocking sockets, polled every [`ACTIVE_POLL`] while connections are
//! open ([`POLL`] when none is). Each connection has one deadline, [`IO_TIMEOUT`] from its
//! accept, for reading its request (at most [`MAX_REQUEST`] bytes) and writing the page; past it
//! the connection is closed unanswered. At most [`MAX_CONNECTIONS`] are open: a new one closes
//! the oldest still reading. So clients that connect and say nothing, or send a byte a second,
//! cost at most their own connection: a scrape arriving among them is answered at once. The page
//! never touches the engine: it is built from relaxed atomic reads, with no lock the engine
//! takes. Dropping the server stops the thread within a poll.
//!
//! Listening follows [`TcpConfig::check_listen`] with no token (the endpoint has none): a
//! non-loopback address needs `KVBM_ALLOW_INSECURE`. The counters say how much was cached and
//! hit, not what: no keys or tokens are on the page.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config::{TcpConfig, METRICS_ADDR_ENV};
use crate::connector::metrics::Metrics;
use crate::error::{Error, ErrorKind, Result};

/// One connection's deadline, from its accept: reading its request and writing the answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections open at once; a new one beyond them closes the oldest still reading.
pub const MAX_CONNECTIONS: usize = 256;
/// How often the thread looks at its connections while any is open.
pub const ACTIVE_POLL: Duration = Duration::from_millis(2);
/// The longest request head read; a longer one gets a 400.
pub const MAX_REQUEST: usize = 8 * 1024;
/// How often the idle listener checks whether it should stop.
pub const POLL: Duration = Duration::from_millis(100);

/// What a metrics endpoint serves: anything that renders its counters in Prometheus text format
/// (the connector's [`Metrics`], a page store's counters).
pub trait Exposition: Send + Sync {
    /// The counters, Prometheus text format, ending with a newline.
    fn render_prometheus(&self) -> String;
}

impl Exposition for Metrics {
    fn render_prometheus(&self) -> String {
        Metrics::render_prometheus(self)
    }
}

/// A running metrics endpoint; dropping it stops the thread (within [`POLL`] plus a request in
/// progress) and closes the port.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// Whether `e` is a metrics endpoint's bind failure because another socket holds the address.
pub fn address_in_use(e: &Error) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .is_some_and(|io| io.kind() == std::io::ErrorKind::AddrInUse)
}

impl MetricsServer {
    /// Binds `addr` (checked by [`TcpConfig::check_listen`], no token) and serves `metrics`.
    /// A bind failure is an [`ErrorKind::Io`] error naming [`METRICS_ADDR_ENV`] and the address.
    pub fn start(addr: SocketAddr, tcp: &TcpConfig, metrics: Arc<Metrics>) -> Result<Self> {
        Self::start_with(addr, tcp, metrics, IO_TIMEOUT)
    }

    /// As [`MetricsServer::start`], serving any [`Exposition`].
    pub fn serve_exposition(
        addr: SocketAddr,
        tcp: &TcpConfig,
        source: Arc<dyn Exposition>,
    ) -> Result<Self> {
        Self::start_with(addr, tcp, source, IO_TIMEOUT)
    }

    /// [`MetricsServer::start`] with another per-connection deadline (tests).
    pub fn start_with(
        addr: SocketAddr,
        tcp: &TcpConfig,
        metrics: Arc<dyn Exposition>,
        io_timeout: Duration,
    ) -> Result<Self> {
        tcp.check_listen("kvbm metrics endpoint", addr, false)?;
        let bind_err = |e: std::io::Error| {
            Error::new(
                ErrorKind::Io,
                format!("cannot listen for metrics on {addr}: {e}"),
            )
            .with("setting", METRICS_ADDR_ENV)
            .with_source(e)
        };
        let listener = TcpListener::bind(addr).map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        let addr = listener.local_addr().map_err(bind_err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kvbm-metrics".into())
            .spawn(move || serve(&listener, &flag, metrics.as_ref(), io_timeout))
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

/// One open connection: the request read so far, then the answer being written.
struct Conn {
    stream: TcpStream,
    deadline: Instant,
    head: Vec<u8>,
    /// The answer and how much of it is written, once the request is read.
    out: Option<(Vec<u8>, usize)>,
}

/// What a connection needs next.
enum Next {
    Keep,
    Close,
}

fn serve(
    listener: &TcpListener,
    stop: &AtomicBool,
    metrics: &dyn Exposition,
    io_timeout: Duration,
) {
    let mut conns: Vec<Conn> = Vec::new();
    while !stop.load(Ordering::Acquire) {
        let mut busy = false;
        loop {
            match listener.accept() {
                Ok((stream, _)) => {
                    busy = true;
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    if conns.len() >= MAX_CONNECTIONS {
                        // The oldest one still reading its request goes (answers in progress
                        // finish): the newest client may be the scraper.
                        match conns.iter().position(|c| c.out.is_none()) {
                            Some(i) => {
                                conns.remove(i);
                            }
                            None => continue,
                        }
                    }
                    conns.push(Conn {
                        stream,
                        deadline: Instant::now() + io_timeout,
                        head: Vec::with_capacity(512),
                        out: None,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics endpoint: accept failed");
                    break;
                }
            }
        }
        let now = Instant::now();
        conns.retain_mut(|c| {
            if now >= c.deadline {
                tracing::debug!("metrics endpoint: a connection missed its deadline; closed");
                return false;
            }
            match step(c, metrics) {
                Ok((Next::Keep, progressed)) => {
                    busy |= progressed;
                    true
                }
                Ok((Next::Close, _)) => false,
                Err(e) => {
                    tracing::debug!(error = %e, "metrics endpoint: request failed");
                    false
                }
            }
        });
        if !busy {
            std::thread::sleep(if conns.is_empty() { POLL } else { ACTIVE_POLL });
        }
    }
}

/// Reads what arrived, or writes what the socket takes, without blocking. Returns whether the
/// connection stays open and whether anything moved.
fn step(c: &mut Conn, metrics: &dyn Exposition) -> std::io::Result<(Next, bool)> {
    let mut progressed = false;
    if c.out.is_none() {
        let mut buf = [0u8; 1024];
        let complete = loop {
            if c.head.windows(4).any(|w| w == b"\r\n\r\n")
                || c.head.windows(2).any(|w| w == b"\n\n")
            {
                break Some(true);
            }
            if c.head.len() >= MAX_REQUEST {
                break Some(false);
            }
            match c.stream.read(&mut buf) {
                Ok(0) => {
                    break if c.head.contains(&b'\n') {
                        Some(true)
                    } else {
                        return Ok((Next::Close, true));
                    };
                }
                Ok(n) => {
                    progressed = true;
                    let take = n.min(MAX_REQUEST - c.head.len());
                    c.head.extend_from_slice(&buf[..take]);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break None,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        };
        let Some(complete) = complete else {
            return Ok((Next::Keep, progressed));
        };
        let (status, body) = if complete {
            route(&c.head, metrics)
        } else {
            ("400 Bad Request", "bad request\n".to_string())
        };
        let reply = format!(
            "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        c.out = Some((reply.into_bytes(), 0));
        progressed = true;
    }
    let Some((out, written)) = c.out.as_mut() else {
        return Ok((Next::Keep, progressed));
    };
    while *written < out.len() {
        match c.stream.write(&out[*written..]) {
            Ok(0) => return Ok((Next::Close, progressed)),
            Ok(n) => {
                *written += n;
                progressed = true;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                return Ok((Next::Keep, progressed))
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    let _ = c.stream.flush();
    Ok((Next::Close, progressed))
}

/// The status and body for a request head.
fn route(head: &[u8], metrics: &dyn Exposition) -> (&'static str, String) {
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

    #[test]
    fn a_port_another_socket_holds_is_told_apart_from_other_failures() {
        let taken = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
        let addr = taken.local_addr().expect("addr");
        let tcp = TcpConfig::default();
        let err = MetricsServer::start(addr, &tcp, Arc::new(Metrics::default())).unwrap_err();
        assert!(address_in_use(&err), "{err}");
        assert_eq!(err.context_value("setting"), Some(METRICS_ADDR_ENV));
        // Another failure (not loopback, no token: refused before binding) is not "in use".
        let open: SocketAddr = "0.0.0.0:0".parse().expect("addr");
        let err = MetricsServer::start(open, &tcp, Arc::new(Metrics::default())).unwrap_err();
        assert!(!address_in_use(&err), "{err}");
    }

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

    /// Issue 26 item 4: clients holding half-sent requests cost only their own connections.
    /// 100 of them (then 300, beyond [`MAX_CONNECTIONS`]) each send part of a request line and
    /// wait; the server's per-connection deadline here is 30 s. A scrape is answered while they
    /// are all still connected: its read gives up after 20 s, before any slow client's deadline,
    /// so a server that answered connections one at a time (the scrape after 100 × 30 s) fails
    /// it; and afterwards every slow client is still open (not closed by its deadline).
    #[test]
    fn a_scrape_is_answered_while_slow_clients_hold_half_sent_requests() {
        let m = Arc::new(Metrics::new());
        m.record_lookup(32, 16);
        let server = MetricsServer::start_with(
            (Ipv4Addr::LOCALHOST, 0).into(),
            &TcpConfig::default(),
            m.clone(),
            Duration::from_secs(30),
        )
        .expect("start");
        for slow_clients in [100, 300] {
            let mut slow = Vec::new();
            for _ in 0..slow_clients {
                let mut c = TcpStream::connect(server.addr()).expect("connect");
                c.write_all(b"GET /metr").expect("write");
                slow.push(c);
            }
            let t = std::time::Instant::now();
            let mut s = TcpStream::connect(server.addr()).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                .unwrap();
            let mut page = String::new();
            s.read_to_string(&mut page)
                .expect("the scrape was not answered while the slow clients were connected");
            println!(
                "scrape answered in {:.1} ms with {slow_clients} slow clients connected",
                t.elapsed().as_secs_f64() * 1e3
            );
            assert!(page.starts_with("HTTP/1.1 200 OK\r\n"), "{page}");
            assert!(page.contains(&m.render_prometheus()), "{page}");
            let mut open = 0;
            for c in &mut slow {
                c.set_nonblocking(true).unwrap();
                let mut b = [0u8; 1];
                if matches!(c.read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock) {
                    open += 1;
                }
            }
            // All of them, or (past MAX_CONNECTIONS) all but those the newest closed.
            assert!(
                open >= slow_clients.min(MAX_CONNECTIONS - 1),
                "{open} of {slow_clients} slow clients still connected"
            );
        }
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
