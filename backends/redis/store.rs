//! [`RedisStore`]: the [`RemoteStore`] on Redis / Valkey.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::aio::ConnectionLike;
use redis::{Cmd, ConnectionAddr, ConnectionInfo, RedisConnectionInfo, Value};
use tokio::sync::Notify;

use super::url::RedisUrl;
use super::value::{Codec, Head};
use crate::config::{PemFile, RemoteTlsFiles};
use crate::connector::remote::{RemotePut, RemoteRead, RemoteScope, RemoteStore, RemoteStoreStats};
use crate::error::{Error, ErrorKind, Result};

mod tls;

use tls::*;

/// Blocks per round of `lookup_prefix` (one `EXISTS` each): a round stops the lookup at its first
/// missing block.
const LOOKUP_ROUND: usize = 32;
/// Consecutive timed-out calls after which the connection counts as lost (a server that accepts
/// but never answers: stopped, swapping, partitioned).
const TIMEOUTS_BEFORE_RECONNECT: u32 = 3;
/// First and longest wait between reconnection attempts.
const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Settings of a [`RedisStore`] beyond its URL.
#[derive(Clone)]
pub struct RedisOptions {
    /// Deployment secret: values carry an HMAC-SHA256 keyed by it, and a value without a valid
    /// one is never served. `None`: checksums only (see docs/deployment.md for the trust model).
    pub secret: Option<Vec<u8>>,
    /// Expiry of written values (`None`: none; Redis's `maxmemory` policy evicts).
    pub ttl: Option<Duration>,
    /// Deadline of one connection attempt (TCP, TLS, AUTH, SELECT; a cluster's slot map).
    pub connect_timeout: Duration,
    /// A private CA and/or a client certificate for a `rediss://` URL (`None`: the system's
    /// roots, no client certificate).
    pub tls: Option<RemoteTlsFiles>,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            secret: None,
            ttl: None,
            connect_timeout: Duration::from_secs(2),
            tls: None,
        }
    }
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOptions")
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("ttl", &self.ttl)
            .field("connect_timeout", &self.connect_timeout)
            .field("tls", &self.tls)
            .finish()
    }
}

#[derive(Clone)]
enum Conn {
    Single(redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

#[derive(Default)]
struct Counters {
    errors: AtomicU64,
    timeouts: AtomicU64,
    reconnects: AtomicU64,
    invalid: AtomicU64,
}

struct Inner {
    url: RedisUrl,
    options: RedisOptions,
    /// The parsed `options.tls` (checked once, at [`RedisStore::connect`]).
    certs: Option<redis::TlsCertificates>,
    conn: Mutex<Option<Conn>>,
    available: AtomicBool,
    consecutive_timeouts: AtomicU32,
    /// Wakes the reconnection task.
    lost: Notify,
    /// Set when the store is dropped: the reconnection task ends.
    closed: AtomicBool,
    counters: Counters,
}

/// The remote (G4) tier on Redis / Valkey: one value per block and rank (see [`super::value`]),
/// pipelined reads and writes, a standalone server or a cluster.
///
/// Calls are synchronous and can come from any thread (the store has its own one-thread tokio
/// runtime; a caller waits on a channel until its deadline, never on the caller's runtime). While
/// the server is unreachable every call fails at once ([`ErrorKind::NotReady`]) and a background
/// task reconnects with exponential backoff (50 ms to 5 s); [`RemoteStore::stats`] counts
/// errors, timeouts, reconnections and invalid values.
pub struct RedisStore {
    inner: Arc<Inner>,
    scope: RemoteScope,
    codec: Codec,
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.inner.url)
            .field("scope", &self.scope)
            .field("mac", &self.codec.has_secret())
            .finish()
    }
}

impl RedisStore {
    /// Connects to `url` for `scope`. A server that cannot be reached does not fail this: the
    /// store starts unavailable and keeps reconnecting in the background. Fails on a server that
    /// refuses the credentials ([`ErrorKind::InvalidConfig`] naming `remote.url`), on a database
    /// the server does not have, and when the runtime cannot start. With TLS, fails on PEM files
    /// that hold no usable certificate or key, a key that is not the certificate's, TLS files
    /// with a plain `redis://` URL, and a server whose certificate is not trusted or that refuses
    /// ours (each [`ErrorKind::InvalidConfig`] naming its `remote.tls_*_file` setting).
    pub fn connect(url: &RedisUrl, scope: RemoteScope, options: RedisOptions) -> Result<Self> {
        let codec = Codec::new(&scope, options.secret.as_deref())?;
        if url.tls {
            // rustls needs a process-wide crypto provider; ring unless the program chose one.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let certs = match &options.tls {
            Some(files) if !url.tls => {
                let file = files.ca.as_ref().or(files.client.as_ref().map(|(c, _)| c));
                return Err(Error::invalid_config(
                    file.map_or("remote.tls_ca_file", |f| f.key),
                    file.map_or_else(String::new, |f| f.path.display().to_string()),
                    "TLS files need a TLS remote.url (rediss:// or rediss+cluster://)",
                ));
            }
            Some(files) => Some(tls_certificates(files)?),
            None => None,
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvbm-redis")
            .enable_all()
            .build()
            .map_err(|e| Error::io("start the Redis client's runtime", e))?;
        let inner = Arc::new(Inner {
            url: url.clone(),
            options,
            certs,
            conn: Mutex::new(None),
            available: AtomicBool::new(false),
            consecutive_timeouts: AtomicU32::new(0),
            lost: Notify::new(),
            closed: AtomicBool::new(false),
            counters: Counters::default(),
        });
        let store = Self {
            inner: inner.clone(),
            scope,
            codec,
            runtime: Some(runtime),
        };
        let handle = store.handle()?;
        let deadline = Instant::now() + inner.options.connect_timeout;
        let first = {
            let inner = inner.clone();
            wait(&handle, deadline, async move { open(&inner).await })
        };
        match first {
            Ok(Ok(conn)) => {
                *inner.conn.lock() = Some(conn);
                inner.available.store(true, Ordering::Release);
            }
            Ok(Err(e)) if refused(&e) => {
                return Err(Error::invalid_config(
                    "remote.url",
                    &inner.url,
                    format!("the server refused the connection's setup: {e}"),
                ))
            }
            Ok(Err(e)) => {
                if let Some((key, why)) = tls_rejection(&e) {
                    return Err(tls_refused(&inner, &e, key, &why));
                }
                tracing::warn!(url = %inner.url, error = %e, "Redis unreachable; the remote tier reconnects in the background");
            }
            Err(_) if inner.url.tls => {
                // A TLS handshake with a server that does not speak TLS gets no answer at all
                // (a plain redis-server waits for the rest of a command): say so.
                tracing::warn!(url = %inner.url, "Redis did not answer the TLS handshake in time: is the server listening for TLS on this port (a rediss:// URL needs the server's tls-port, not its plain port)? The remote tier reconnects in the background");
            }
            Err(_) => {
                tracing::warn!(url = %inner.url, "Redis did not answer in time; the remote tier reconnects in the background");
            }
        }
        handle.spawn(reconnect_loop(inner.clone()));
        if !inner.available.load(Ordering::Acquire) {
            inner.lost.notify_one();
        }
        Ok(store)
    }

    fn handle(&self) -> Result<tokio::runtime::Handle> {
        self.runtime
            .as_ref()
            .map(|r| r.handle().clone())
            .ok_or_else(|| Error::internal("the Redis store's runtime is gone"))
    }

    /// The connection, or a fast failure while there is none.
    fn conn(&self) -> Result<Conn> {
        match self.inner.conn.lock().clone() {
            Some(c) => Ok(c),
            None => {
                self.inner.counters.errors.fetch_add(1, Ordering::Relaxed);
                Err(Error::new(
                    ErrorKind::NotReady,
                    "Redis is unavailable (reconnecting in the background)",
                )
                .with("remote", &self.inner.url))
            }
        }
    }

    /// Runs `commands` (each answered by one value, in order) by `deadline`; a failure is
    /// counted and, when it means the connection is lost, hands over to the reconnection task.
    fn run(&self, commands: Vec<Cmd>, deadline: Instant) -> Result<Vec<Value>> {
        self.run_calls(commands, deadline, false)
    }

    /// As [`RedisStore::run`]; with `lose_on_timeout` a missed deadline counts the connection
    /// lost at once (not after [`TIMEOUTS_BEFORE_RECONNECT`] in a row). For value reads: the
    /// connection is pipelined, so every reply behind one that has not arrived waits for it, and
    /// on a path that passes small replies but stalls values (a half-broken proxy or link) the
    /// loads, lookups and writes queued behind one stalled value all waited their own deadlines,
    /// seconds in all, before three timeouts reset it.
    fn run_calls(
        &self,
        commands: Vec<Cmd>,
        deadline: Instant,
        lose_on_timeout: bool,
    ) -> Result<Vec<Value>> {
        if commands.is_empty() {
            return Ok(Vec::new());
        }
        if Instant::now() >= deadline {
            self.inner.counters.timeouts.fetch_add(1, Ordering::Relaxed);
            return Err(Error::new(
                ErrorKind::Timeout,
                "Redis call past its deadline before it started",
            ));
        }
        let conn = self.conn()?;
        let handle = self.handle()?;
        match wait(&handle, deadline, execute(conn, commands)) {
            Ok(Ok(values)) => {
                self.inner.consecutive_timeouts.store(0, Ordering::Relaxed);
                self.inner.available.store(true, Ordering::Release);
                Ok(values)
            }
            Ok(Err(e)) => {
                self.inner.counters.errors.fetch_add(1, Ordering::Relaxed);
                if lost(&e) {
                    self.inner.lose(&e.to_string());
                }
                let kind = if refused(&e) {
                    ErrorKind::InvalidConfig
                } else if e.is_timeout() {
                    ErrorKind::Timeout
                } else {
                    ErrorKind::Io
                };
                Err(Error::new(kind, format!("Redis call failed: {e}"))
                    .with("remote", &self.inner.url))
            }
            Err(()) => {
                self.inner.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                let n = self
                    .inner
                    .consecutive_timeouts
                    .fetch_add(1, Ordering::Relaxed)
                    + 1;
                if n >= TIMEOUTS_BEFORE_RECONNECT {
                    self.inner
                        .lose(&format!("{n} calls in a row missed their deadline"));
                } else if lose_on_timeout {
                    self.inner.lose(
                        "a read of values missed its deadline (the replies queued behind it wait for it)",
                    );
                }
                Err(
                    Error::new(ErrorKind::Timeout, "Redis did not answer by the deadline")
                        .with("remote", &self.inner.url),
                )
            }
        }
    }

    /// Deletes invalid values in the background (nobody waits): otherwise a lookup would keep
    /// matching them, and `SET NX` would never replace them with a good value.
    fn withdraw(&self, names: Vec<String>) {
        if names.is_empty() {
            return;
        }
        let (Ok(conn), Ok(handle)) = (self.conn(), self.handle()) else {
            return;
        };
        let commands = names
            .into_iter()
            .map(|n| {
                let mut c = redis::cmd("UNLINK");
                c.arg(n);
                c
            })
            .collect();
        let timeout = self.inner.options.connect_timeout;
        handle.spawn(async move {
            if let Ok(Err(e)) = tokio::time::timeout(timeout, execute(conn, commands)).await {
                tracing::debug!(error = %e, "could not withdraw invalid Redis values");
            }
        });
    }

    /// Which of `keys[i]` for `i` in `which` exist (rank `rank`'s names): one EXISTS each, in one
    /// round trip within `deadline`. An error or a late answer says none (they stay misses).
    fn existing(
        &self,
        rank: usize,
        keys: &[u128],
        which: &[usize],
        deadline: Instant,
    ) -> Vec<usize> {
        if which.is_empty() {
            return Vec::new();
        }
        let commands = which
            .iter()
            .filter_map(|&i| keys.get(i))
            .map(|&k| {
                let mut c = redis::cmd("EXISTS");
                c.arg(self.codec.key(k, rank));
                c
            })
            .collect();
        match self.run(commands, deadline) {
            Ok(values) => which
                .iter()
                .zip(values)
                .filter(|(_, v)| matches!(v, Value::Int(1)))
                .map(|(&i, _)| i)
                .collect(),
            Err(e) => {
                tracing::debug!(error = %e, "could not tell empty Redis values from missing keys");
                Vec::new()
            }
        }
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.scope.world_size {
            return Err(Error::out_of_range("rank", rank, self.scope.world_size));
        }
        Ok(())
    }
}

impl Inner {
    /// The connection is lost: drop it, mark unavailable, wake the reconnection task.
    fn lose(&self, why: &str) {
        if self.conn.lock().take().is_some() {
            tracing::warn!(url = %self.url, why, "Redis connection lost; reconnecting in the background");
        }
        self.available.store(false, Ordering::Release);
        self.lost.notify_one();
    }
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        self.inner.closed.store(true, Ordering::Release);
        self.inner.lost.notify_one();
        if let Some(rt) = self.runtime.take() {
            // Never blocks (and never panics inside another runtime).
            rt.shutdown_background();
        }
    }
}

/// Runs `fut` on `handle` and waits for it until `deadline` (`Err(())`: it did not finish; it
/// is then cancelled at the deadline by the runtime).
fn wait<T: Send + 'static>(
    handle: &tokio::runtime::Handle,
    deadline: Instant,
    fut: impl std::future::Future<Output = T> + Send + 'static,
) -> std::result::Result<T, ()> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let at = tokio::time::Instant::from_std(deadline);
    handle.spawn(async move {
        if let Ok(v) = tokio::time::timeout_at(at, fut).await {
            let _ = tx.send(v);
        }
    });
    rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
        .map_err(|_| ())
}

/// One command per value: a standalone server gets them as one pipeline; a cluster gets one
/// request per command, all in flight at once (a cluster pipeline must stay within one slot, and
/// consecutive commands here are for different blocks, so different slots). A server error for
/// one command (e.g. `WRONGTYPE`) comes back as that command's value ([`as_server_error`]).
async fn execute(conn: Conn, commands: Vec<Cmd>) -> redis::RedisResult<Vec<Value>> {
    match conn {
        Conn::Single(mut c) => {
            let mut pipe = redis::pipe();
            for cmd in commands {
                pipe.add_command(cmd);
            }
            let n = commands_len(&pipe);
            c.req_packed_commands(&pipe, 0, n).await
        }
        Conn::Cluster(c) => {
            let futures = commands.into_iter().map(|cmd| {
                let mut c = c.clone();
                async move {
                    match c.req_packed_command(&cmd).await {
                        Ok(v) => Ok(v),
                        Err(e) if lost(&e) || e.is_timeout() => Err(e),
                        Err(e) => Ok(Value::SimpleString(format!("{SERVER_ERROR}{e}"))),
                    }
                }
            });
            futures_util::future::join_all(futures)
                .await
                .into_iter()
                .collect()
        }
    }
}

fn commands_len(pipe: &redis::Pipeline) -> usize {
    pipe.cmd_iter().count()
}

/// Prefix of the simple string standing for one cluster command's server error.
const SERVER_ERROR: &str = "\u{0}kvbm-server-error: ";

/// The text of a server error answering one command, if `v` is one.
fn as_server_error(v: &Value) -> Option<String> {
    match v {
        Value::ServerError(e) => Some(format!("{e:?}")),
        Value::SimpleString(s) => s.strip_prefix(SERVER_ERROR).map(str::to_owned),
        _ => None,
    }
}

/// Whether `e` means the connection is gone (or never came).
fn lost(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.kind() == redis::ErrorKind::ClusterConnectionNotFound
}

/// Whether the server refused our setup (credentials, ACL, database): retrying cannot help.
fn refused(e: &redis::RedisError) -> bool {
    matches!(e.kind(), redis::ErrorKind::AuthenticationFailed)
        || e.code()
            .is_some_and(|c| c == "NOAUTH" || c == "WRONGPASS" || c == "NOPERM")
        || e.to_string().contains("invalid DB index")
        || e.to_string().contains("DB index is out of range")
}

fn connection_info(url: &RedisUrl, host: &str, port: u16) -> ConnectionInfo {
    ConnectionInfo {
        addr: if url.tls {
            ConnectionAddr::TcpTls {
                host: host.to_owned(),
                port,
                insecure: false,
                tls_params: None,
            }
        } else {
            ConnectionAddr::Tcp(host.to_owned(), port)
        },
        redis: RedisConnectionInfo {
            db: url.db,
            username: url.username.clone(),
            password: url.password().map(str::to_owned),
            ..Default::default()
        },
    }
}

/// Opens a connection (no deadline of its own: the caller bounds it).
async fn open(inner: &Inner) -> redis::RedisResult<Conn> {
    let url = &inner.url;
    let timeout = inner.options.connect_timeout;
    if url.cluster {
        let seeds: Vec<ConnectionInfo> = url
            .nodes
            .iter()
            .map(|(h, p)| connection_info(url, h, *p))
            .collect();
        let mut b = redis::cluster::ClusterClientBuilder::new(seeds)
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .retries(2)
            .min_retry_wait(5)
            .max_retry_wait(50);
        if let Some(u) = &url.username {
            b = b.username(u.clone());
        }
        if let Some(p) = url.password() {
            b = b.password(p.to_owned());
        }
        if url.tls {
            b = b.tls(redis::TlsMode::Secure);
        }
        if let Some(certs) = &inner.certs {
            b = b.certs(certs.clone());
        }
        let client = b.build()?;
        let mut c = client.get_async_connection().await?;
        // The slot map may come from one live seed while a node is down: ask once.
        let _: Value = redis::cmd("PING").query_async(&mut c).await?;
        Ok(Conn::Cluster(c))
    } else {
        let (host, port) = &url.nodes[0];
        let info = connection_info(url, host, *port);
        let client = match &inner.certs {
            Some(certs) => redis::Client::build_with_tls(info, certs.clone())?,
            None => redis::Client::open(info)?,
        };
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(timeout)
            .set_response_timeout(timeout);
        let mut c = client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        // Without credentials nothing was sent yet: a server that requires them says so here
        // (NOAUTH), not at the first read.
        let _: Value = redis::cmd("PING").query_async(&mut c).await?;
        Ok(Conn::Single(c))
    }
}

async fn reconnect_loop(inner: Arc<Inner>) {
    let mut backoff = BACKOFF_MIN;
    let mut connected_at: Option<tokio::time::Instant> = None;
    loop {
        inner.lost.notified().await;
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        if inner.conn.lock().is_some() {
            continue;
        }
        // A connection lost soon after it was made (a flapping server) waits out the backoff
        // before the next attempt; one that held for a while starts over from the minimum.
        match connected_at {
            Some(t) if t.elapsed() < BACKOFF_MAX => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
            _ => backoff = BACKOFF_MIN,
        }
        loop {
            if inner.closed.load(Ordering::Acquire) {
                return;
            }
            match tokio::time::timeout(inner.options.connect_timeout, open(&inner)).await {
                Ok(Ok(conn)) => {
                    *inner.conn.lock() = Some(conn);
                    inner.consecutive_timeouts.store(0, Ordering::Relaxed);
                    inner.available.store(true, Ordering::Release);
                    inner.counters.reconnects.fetch_add(1, Ordering::Relaxed);
                    connected_at = Some(tokio::time::Instant::now());
                    tracing::info!(url = %inner.url, "Redis reconnected");
                    break;
                }
                Ok(Err(e)) if refused(&e) => {
                    tracing::error!(url = %inner.url, error = %e, "Redis refused the connection's setup; retrying");
                }
                Ok(Err(e)) => {
                    tracing::debug!(url = %inner.url, error = %e, "Redis reconnection failed");
                }
                Err(_) => tracing::debug!(url = %inner.url, "Redis reconnection timed out"),
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }
}

/// One argument made of a value's head and its payload, written into the command without first
/// copying the payload into a value of its own.
struct Joined<'a>(Head, &'a [u8]);

impl redis::ToRedisArgs for Joined<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        use std::io::Write;
        let mut w = out.writer_for_next_arg();
        // Writes into the command's own buffer: they cannot fail.
        let _ = w.write_all(self.0.as_slice());
        let _ = w.write_all(self.1);
    }
}

impl RemoteStore for RedisStore {
    fn describe(&self) -> String {
        format!("redis {}", self.inner.url)
    }

    fn scope(&self) -> &RemoteScope {
        &self.scope
    }

    fn lookup_prefix(&self, keys: &[u128], deadline: Instant) -> Result<usize> {
        let mut found = 0;
        for round in keys.chunks(LOOKUP_ROUND) {
            let commands = round
                .iter()
                .map(|&k| {
                    let mut c = redis::cmd("EXISTS");
                    for rank in 0..self.scope.world_size {
                        c.arg(self.codec.key(k, rank));
                    }
                    c
                })
                .collect();
            let values = self.run(commands, deadline)?;
            for v in &values {
                match v {
                    Value::Int(n) if *n == self.scope.world_size as i64 => found += 1,
                    Value::Int(_) => return Ok(found),
                    other => {
                        return Err(Error::new(
                            ErrorKind::Io,
                            format!("Redis answered EXISTS with {other:?}"),
                        ))
                    }
                }
            }
            if values.len() < round.len() {
                return Ok(found);
            }
        }
        Ok(found)
    }

    fn get(
        &self,
        rank: usize,
        keys: &[u128],
        dst: &mut [&mut [u8]],
        deadline: Instant,
    ) -> Result<Vec<RemoteRead>> {
        self.check_rank(rank)?;
        if dst.len() != keys.len() {
            return Err(Error::invalid_argument(format!(
                "{} keys but {} destination buffers",
                keys.len(),
                dst.len()
            )));
        }
        if let Some((i, d)) = dst
            .iter()
            .enumerate()
            .find(|(_, d)| d.len() != self.scope.bytes_per_block)
        {
            return Err(Error::invalid_argument(format!(
                "destination {i} holds {} bytes, a block's share is {}",
                d.len(),
                self.scope.bytes_per_block
            )));
        }
        // GETRANGE bounds what crosses the wire: at most one byte more than the longest valid
        // value, so a longer one is seen as such without reading it whole. (A missing key reads
        // as empty, as does an empty value: both are a miss.)
        let last = self.codec.max_value_len();
        let commands = keys
            .iter()
            .map(|&k| {
                let mut c = redis::cmd("GETRANGE");
                c.arg(self.codec.key(k, rank)).arg(0).arg(last);
                c
            })
            .collect();
        let values = self.run_calls(commands, deadline, true)?;
        if values.len() != keys.len() {
            return Err(Error::new(
                ErrorKind::Io,
                format!("Redis answered {} of {} reads", values.len(), keys.len()),
            ));
        }
        let mut out = Vec::with_capacity(keys.len());
        let mut withdraw = Vec::new();
        // An empty answer is a missing key or an empty value; which one, EXISTS says (only
        // asked for those, rarely any). An empty value is invalid: withdrawn like any other
        // (safe: writes use NX, so no valid value can replace it before it is deleted).
        let empty: Vec<usize> = values
            .iter()
            .enumerate()
            .filter(|(_, v)| matches!(v, Value::BulkString(b) if b.is_empty()))
            .map(|(i, _)| i)
            .collect();
        let planted_empty = self.existing(rank, keys, &empty, deadline);
        for (i, ((&k, v), d)) in keys.iter().zip(values).zip(dst.iter_mut()).enumerate() {
            let read = match v {
                v if as_server_error(&v).is_some() => RemoteRead::Invalid(format!(
                    "the server answered {}",
                    as_server_error(&v).unwrap_or_default()
                )),
                Value::Nil => RemoteRead::Missing,
                Value::BulkString(b) if b.is_empty() => {
                    if planted_empty.contains(&i) {
                        RemoteRead::Invalid("an empty value".to_string())
                    } else {
                        RemoteRead::Missing
                    }
                }
                Value::BulkString(b) => self.codec.decode_into(k, rank, &b, d),
                other => RemoteRead::Invalid(format!("unexpected answer {other:?}")),
            };
            if let RemoteRead::Invalid(why) = &read {
                self.inner.counters.invalid.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(key = %self.codec.key(k, rank), why, "invalid value in Redis; withdrawn");
                withdraw.push(self.codec.key(k, rank));
            }
            out.push(read);
        }
        self.withdraw(withdraw);
        Ok(out)
    }

    fn put(&self, rank: usize, blocks: &[(u128, &[u8])], deadline: Instant) -> Result<RemotePut> {
        self.check_rank(rank)?;
        if let Some((i, (_, b))) = blocks
            .iter()
            .enumerate()
            .find(|(_, (_, b))| b.len() != self.scope.bytes_per_block)
        {
            return Err(Error::invalid_argument(format!(
                "block {i} has {} bytes, a block's share is {}",
                b.len(),
                self.scope.bytes_per_block
            )));
        }
        let ttl_ms = self
            .inner
            .options
            .ttl
            .map(|t| t.as_millis().clamp(1, i64::MAX as u128) as i64);
        let commands = blocks
            .iter()
            .map(|&(k, bytes)| {
                let mut c = redis::cmd("SET");
                c.arg(self.codec.key(k, rank))
                    .arg(Joined(self.codec.head(k, rank, bytes), bytes))
                    .arg("NX");
                if let Some(ms) = ttl_ms {
                    c.arg("PX").arg(ms);
                }
                c
            })
            .collect();
        let values = self.run(commands, deadline)?;
        let mut put = RemotePut::default();
        for v in values {
            if let Some(e) = as_server_error(&v) {
                // e.g. OOM with `maxmemory` and `noeviction`: the block is not stored.
                self.inner.counters.errors.fetch_add(1, Ordering::Relaxed);
                return Err(
                    Error::new(ErrorKind::Io, format!("Redis refused a write: {e}"))
                        .with("remote", &self.inner.url),
                );
            }
            match v {
                Value::Okay => put.written += 1,
                Value::SimpleString(s) if s == "OK" => put.written += 1,
                Value::Nil => put.present += 1,
                other => {
                    return Err(Error::new(
                        ErrorKind::Io,
                        format!("Redis answered SET with {other:?}"),
                    ))
                }
            }
        }
        Ok(put)
    }

    fn stats(&self) -> RemoteStoreStats {
        let c = &self.inner.counters;
        RemoteStoreStats {
            available: self.inner.available.load(Ordering::Acquire),
            errors: c.errors.load(Ordering::Relaxed),
            timeouts: c.timeouts.load(Ordering::Relaxed),
            reconnects: c.reconnects.load(Ordering::Relaxed),
            invalid: c.invalid.load(Ordering::Relaxed),
        }
    }
}

impl RedisStore {
    /// Raw pipelined `SET` of `values` under `keys` (no header, no checks): the benchmark's
    /// reference for what the client and server do with the same bytes.
    #[doc(hidden)]
    pub fn raw_set(&self, pairs: &[(String, &[u8])], deadline: Instant) -> Result<()> {
        let commands = pairs
            .iter()
            .map(|(k, v)| {
                let mut c = redis::cmd("SET");
                c.arg(k).arg(*v);
                c
            })
            .collect();
        self.run(commands, deadline).map(|_| ())
    }

    /// Raw pipelined `GET` of `keys`, copied into `dst` (the benchmark's reference); returns how
    /// many were found.
    #[doc(hidden)]
    pub fn raw_get(
        &self,
        keys: &[String],
        dst: &mut [&mut [u8]],
        deadline: Instant,
    ) -> Result<usize> {
        let commands = keys
            .iter()
            .map(|k| {
                let mut c = redis::cmd("GET");
                c.arg(k);
                c
            })
            .collect();
        let values = self.run(commands, deadline)?;
        let mut n = 0;
        for (v, d) in values.into_iter().zip(dst.iter_mut()) {
            if let Value::BulkString(b) = v {
                let len = b.len().min(d.len());
                d[..len].copy_from_slice(&b[..len]);
                n += 1;
            }
        }
        Ok(n)
    }

    /// Runs one command (tests and the benchmark: `FLUSHALL`, `CONFIG SET`, planting values).
    #[doc(hidden)]
    pub fn raw_command(&self, args: &[&[u8]], deadline: Instant) -> Result<Vec<u8>> {
        let mut c = redis::cmd(
            std::str::from_utf8(args.first().copied().unwrap_or(b"PING"))
                .map_err(|_| Error::invalid_argument("command name is not UTF-8"))?,
        );
        for a in args.iter().skip(1) {
            c.arg(*a);
        }
        let v = self.run(vec![c], deadline)?;
        if let Some(e) = v.first().and_then(as_server_error) {
            return Err(Error::new(ErrorKind::Io, format!("Redis answered: {e}")));
        }
        Ok(match v.into_iter().next() {
            Some(Value::BulkString(b)) => b,
            Some(Value::Int(n)) => n.to_string().into_bytes(),
            Some(Value::Okay) => b"OK".to_vec(),
            Some(Value::SimpleString(s)) => s.into_bytes(),
            Some(Value::Nil) | None => Vec::new(),
            Some(other) => format!("{other:?}").into_bytes(),
        })
    }

    /// The Redis key of `key`'s share of `rank` in this store's scope.
    pub fn key_name(&self, key: u128, rank: usize) -> String {
        self.codec.key(key, rank)
    }

    /// The value this store writes for `key`'s share of `rank` (tests plant altered copies).
    #[doc(hidden)]
    pub fn encode_value(&self, key: u128, rank: usize, payload: &[u8]) -> Vec<u8> {
        self.codec.encode(key, rank, payload)
    }
}
