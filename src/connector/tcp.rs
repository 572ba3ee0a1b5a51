//! The network transport: leader and workers in separate processes, one TCP connection per worker.
//!
//! [`TcpLeader`] implements [`LeaderTransport`] and [`TcpWorker`] implements [`WorkerTransport`],
//! so the start-up barrier ([`barrier`](crate::connector::barrier)) and the leader's completion
//! handling run over the network unchanged.
//!
//! # Wire protocol (version 1)
//!
//! Every message in either direction is one *frame*: a 12-byte header followed by a JSON payload.
//!
//! | offset | size | field    | value |
//! |--------|------|----------|-------|
//! | 0      | 4    | magic    | the ASCII bytes `KVBM` (`4B 56 42 4D`) |
//! | 4      | 2    | version  | protocol version, `u16` big-endian; currently [`PROTOCOL_VERSION`] = 1 |
//! | 6      | 1    | kind     | `1` HELLO, `2` WELCOME, `3` REFUSED, `4` MSG ([`FrameKind`]) |
//! | 7      | 1    | reserved | senders write `0`; receivers ignore it |
//! | 8      | 4    | length   | payload length in bytes, `u32` big-endian |
//! | 12     | n    | payload  | UTF-8 JSON, exactly `length` bytes |
//!
//! Payloads by kind:
//!
//! * **HELLO** (worker → leader, first frame only): [`HandshakeHello`],
//!   `{"rank":0,"world_size":2,"token":"secret"}` (`token` is `null` when the worker has none).
//!   At most [`MAX_HELLO_PAYLOAD`] bytes (64 KiB).
//! * **WELCOME** (leader → worker, answers HELLO): [`Welcome`], `{"rank":0,"world_size":2}`.
//! * **REFUSED** (leader → worker, answers HELLO, then the leader closes): [`Refusal`],
//!   `{"reason":"authentication token mismatch"}`.
//! * **MSG** (both directions, after WELCOME): from a worker a
//!   [`WorkerMessage`], from the leader a [`LeaderMessage`], in serde's externally tagged JSON form:
//!   `"Ready"`, `{"Failed":"why"}`,
//!   `{"Hello":{"rank":0,"world_size":2,"bytes_per_block":4096,"num_device_blocks":32,"dims":{...}}}`,
//!   `{"Completed":[{"op":7,"failed_dst_blocks":[],"error":null}]}`,
//!   `{"Allocate":{"num_host_blocks":8,"num_disk_blocks":0,"num_device_blocks":32}}`,
//!   `{"Refused":"why"}`. At most [`MAX_PAYLOAD`] bytes (16 MiB).
//!   [`WorkerMessage::Disconnected`] is generated locally and never sent; a leader that receives
//!   it from a peer closes that connection.
//!
//! Unknown JSON fields are ignored (a later version may add fields without a version bump).
//!
//! # Handshake
//!
//! ```text
//!  worker                                   leader
//!    |-- connect (retried until deadline) --->|
//!    |-- HELLO {rank, world_size, token} ---->|   within HANDSHAKE_TIMEOUT (5 s) of connecting
//!    |<------------ WELCOME {rank, world} ----|   admitted: MSG frames both ways from now on
//!    |<------------ REFUSED {reason} ---------|   or refused: the leader closes the connection
//! ```
//!
//! The leader refuses a HELLO (answers REFUSED with the reason, logs it with the peer address and
//! rank, and closes that connection) when, checked in this order:
//!
//! 1. it has an auth token ([`AUTH_TOKEN_ENV`]) and the HELLO carries none or another one (the
//!    comparison is in constant time, over SHA-256 digests of both tokens);
//! 2. `rank >= world_size`, or `world_size` differs from the leader's;
//! 3. the session has started (see below): "rank N already joined this session; restart the
//!    leader to rejoin" (or, for a rank that never joined, "the session already started without
//!    rank N; restart the leader to add it");
//! 4. that rank is connected already: "rank N is already connected (from ADDR)".
//!
//! It also refuses, with a REFUSED frame, a client that speaks the protocol (right magic) but
//! sends another protocol version, another frame kind than HELLO first, an oversized or
//! undecodable HELLO, and a client that sends no complete HELLO within the handshake timeout.
//! Bytes that do not start with the magic (an HTTP request, random data) get no answer: the
//! connection is just closed. At most 64 handshakes are pending at once; more connections are
//! closed at once.
//!
//! # After the handshake
//!
//! A frame with a wrong magic or version, an unknown kind, a kind other than MSG, a length above
//! [`MAX_PAYLOAD`], or JSON that does not decode closes *that* connection with a logged reason
//! (`tracing::warn!` with the peer address and rank); other connections are not affected. When an
//! admitted worker's connection ends for any reason (end of stream, I/O error, a frame as above),
//! the leader logs it with the rank and delivers [`WorkerMessage::Disconnected`] for that rank
//! through [`LeaderTransport::recv_timeout`] / [`LeaderTransport::try_recv`], after every message
//! that connection delivered. [`LeaderTransport::send`] to a rank that is not connected is an
//! [`ErrorKind::Cancelled`] error naming the rank. On the worker side, once the leader connection
//! is gone, [`WorkerTransport::recv_timeout`] (after the messages already received) and
//! [`WorkerTransport::send`] are [`ErrorKind::Cancelled`] errors saying why.
//!
//! # Rejoining: refused once the session started
//!
//! The session starts when every rank has confirmed its allocation ([`WorkerMessage::Ready`] from
//! all `world_size` ranks over their current connections, i.e. when the barrier completes), or
//! when the leader calls [`TcpLeader::mark_session_started`], whichever comes first. Before that, a
//! rank whose connection dropped may connect again; its old connection's
//! [`WorkerMessage::Disconnected`] is queued before anything the new connection sends, so the
//! barrier can forget the old report and take the new one. After it, a returning rank is refused with "rank N already joined this session;
//! restart the leader to rejoin": a restarted worker lost the contents of its host and disk
//! tiers, while the leader's block pools still record those blocks as stored on every rank, so
//! serving a prefix hit from them would load garbage on that rank's shard. Restarting the leader
//! restarts the accounting from empty.
//!
//! # Deployment and threads
//!
//! The leader binds [`leader_addr_from_env`] ([`LEADER_ADDR_ENV`], default `127.0.0.1:5557`,
//! loopback only); a multi-node deployment sets it to an address the workers can reach, and
//! should set [`AUTH_TOKEN_ENV`] on leader and workers (without it anyone who reaches the port can
//! join as a worker; the leader warns when it binds a non-loopback address without a token). The
//! token is an authenticator only: traffic is not encrypted.
//!
//! [`TcpLeader`] owns a tokio runtime with one worker thread (`kvbm-tcp-leader`): an accept loop,
//! and per connection a reader task (feeding one `std::sync::mpsc` channel read by
//! `recv_timeout`/`try_recv`) and a writer task (fed by a per-rank channel; `send` never blocks).
//! Dropping it gives the writers up to one second to send what is queued (so a refusal's reason
//! reaches the worker), then stops the runtime and closes every connection; workers then see
//! [`ErrorKind::Cancelled`]. Dropping it inside another tokio runtime skips the flush. [`TcpWorker`] uses blocking
//! sockets: `send` writes the frame on the caller's thread, and one reader thread
//! (`kvbm-tcp-worker-N`) feeds `recv_timeout`.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream as StdTcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::connector::transport::{
    LeaderMessage, LeaderTransport, Rank, WorkerMessage, WorkerTransport,
};
use crate::error::{Error, ErrorKind, Result};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"KVBM";
/// The protocol version this build speaks (bytes 4..6 of every frame, big-endian).
pub const PROTOCOL_VERSION: u16 = 1;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 12;
/// Largest MSG payload (16 MiB); a larger length closes the connection.
pub const MAX_PAYLOAD: u32 = 16 * 1024 * 1024;
/// Largest HELLO payload (64 KiB), read before the peer is authenticated.
pub const MAX_HELLO_PAYLOAD: u32 = 64 * 1024;
/// How long the leader waits for a HELLO after accepting a connection (by default).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// The environment variable naming the leader's address.
pub const LEADER_ADDR_ENV: &str = "KVBM_LEADER_ADDR";
/// The environment variable holding the shared secret workers present.
pub const AUTH_TOKEN_ENV: &str = "KVBM_AUTH_TOKEN";
/// The leader's address when [`LEADER_ADDR_ENV`] is not set (loopback).
pub const DEFAULT_LEADER_ADDR: &str = "127.0.0.1:5557";

/// Handshakes the leader runs at once; further connections are closed until one finishes.
const MAX_PENDING_HANDSHAKES: usize = 64;
/// Worker socket write timeout: a leader that stops reading for this long counts as gone.
const WORKER_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest pause between two connection attempts of a worker.
const MAX_BACKOFF: Duration = Duration::from_millis(200);
/// How long dropping the leader waits for queued frames to be written.
const DROP_FLUSH_TIMEOUT: Duration = Duration::from_secs(1);
/// Read-buffer size of a connection.
const READ_BUFFER: usize = 64 * 1024;

/// The kind byte of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// Worker → leader, first frame: [`HandshakeHello`].
    Hello = 1,
    /// Leader → worker: admitted ([`Welcome`]).
    Welcome = 2,
    /// Leader → worker: refused ([`Refusal`]); the leader closes the connection.
    Refused = 3,
    /// A [`WorkerMessage`] or [`LeaderMessage`], after the handshake.
    Msg = 4,
}

impl FrameKind {
    /// The kind for a byte, if it names one.
    pub fn from_byte(b: u8) -> Option<Self> {
        match b {
            1 => Some(Self::Hello),
            2 => Some(Self::Welcome),
            3 => Some(Self::Refused),
            4 => Some(Self::Msg),
            _ => None,
        }
    }
}

impl std::fmt::Display for FrameKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Hello => "HELLO",
            Self::Welcome => "WELCOME",
            Self::Refused => "REFUSED",
            Self::Msg => "MSG",
        })
    }
}

/// HELLO payload: who the connecting worker is.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandshakeHello {
    /// The worker's rank.
    pub rank: Rank,
    /// How many ranks the worker believes there are.
    pub world_size: usize,
    /// The shared secret, when the worker has one.
    pub token: Option<String>,
}

impl std::fmt::Debug for HandshakeHello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandshakeHello")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// WELCOME payload: the leader admitted the worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// The rank admitted.
    pub rank: Rank,
    /// The leader's world size.
    pub world_size: usize,
}

/// REFUSED payload: why the leader refused the worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    /// One line saying why.
    pub reason: String,
}

/// One frame (header and payload) ready to write. Fails when the payload exceeds [`MAX_PAYLOAD`].
pub fn encode_frame(kind: FrameKind, payload: &[u8]) -> Result<Vec<u8>> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|l| *l <= MAX_PAYLOAD)
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "{kind} payload of {} bytes exceeds the {MAX_PAYLOAD}-byte frame limit",
                payload.len()
            ))
        })?;
    let mut frame = Vec::with_capacity(HEADER_LEN + payload.len());
    frame.extend_from_slice(&MAGIC);
    frame.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    frame.push(kind as u8);
    frame.push(0);
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(payload);
    Ok(frame)
}

fn encode_json(kind: FrameKind, value: &impl Serialize) -> Result<Vec<u8>> {
    let payload = serde_json::to_vec(value)
        .map_err(|e| Error::internal(format!("cannot encode a {kind} payload as JSON: {e}")))?;
    encode_frame(kind, &payload)
}

/// Why reading a frame failed.
#[derive(Debug)]
enum FrameError {
    /// The peer closed the connection.
    Closed,
    Io(std::io::Error),
    BadMagic([u8; 4]),
    BadVersion(u16),
    UnknownKind(u8),
    TooLarge {
        len: u32,
        max: u32,
    },
}

impl FrameError {
    fn from_io(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Self::Closed
        } else {
            Self::Io(e)
        }
    }

    /// Whether the peer speaks this protocol (the magic matched), so a REFUSED answer helps it.
    fn speaks_protocol(&self) -> bool {
        matches!(
            self,
            Self::BadVersion(_) | Self::UnknownKind(_) | Self::TooLarge { .. }
        )
    }
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Closed => f.write_str("connection closed by the peer"),
            Self::Io(e) => write!(f, "I/O error: {e}"),
            Self::BadMagic(m) => write!(
                f,
                "bad magic {m:02x?} (expected \"KVBM\"): not a kvbm peer"
            ),
            Self::BadVersion(v) => write!(
                f,
                "protocol version {v} is not supported (this side speaks version {PROTOCOL_VERSION})"
            ),
            Self::UnknownKind(k) => write!(f, "unknown frame kind {k}"),
            Self::TooLarge { len, max } => {
                write!(f, "frame payload of {len} bytes exceeds the limit of {max}")
            }
        }
    }
}

/// Checks a header; returns the kind and payload length.
fn parse_header(h: &[u8; HEADER_LEN], max: u32) -> Result<(FrameKind, u32), FrameError> {
    let [m0, m1, m2, m3, v0, v1, k, _reserved, l0, l1, l2, l3] = *h;
    let magic = [m0, m1, m2, m3];
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    let version = u16::from_be_bytes([v0, v1]);
    if version != PROTOCOL_VERSION {
        return Err(FrameError::BadVersion(version));
    }
    let kind = FrameKind::from_byte(k).ok_or(FrameError::UnknownKind(k))?;
    let len = u32::from_be_bytes([l0, l1, l2, l3]);
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    Ok((kind, len))
}

fn payload_buffer(len: u32) -> Result<Vec<u8>, FrameError> {
    let n = usize::try_from(len).map_err(|_| FrameError::TooLarge { len, max: 0 })?;
    Ok(vec![0u8; n])
}

async fn read_frame_async<R: AsyncRead + Unpin>(
    r: &mut R,
    max: u32,
) -> Result<(FrameKind, Vec<u8>), FrameError> {
    let mut h = [0u8; HEADER_LEN];
    r.read_exact(&mut h).await.map_err(FrameError::from_io)?;
    let (kind, len) = parse_header(&h, max)?;
    let mut payload = payload_buffer(len)?;
    r.read_exact(&mut payload)
        .await
        .map_err(FrameError::from_io)?;
    Ok((kind, payload))
}

fn read_frame_sync(r: &mut impl Read, max: u32) -> Result<(FrameKind, Vec<u8>), FrameError> {
    let mut h = [0u8; HEADER_LEN];
    r.read_exact(&mut h).map_err(FrameError::from_io)?;
    let (kind, len) = parse_header(&h, max)?;
    let mut payload = payload_buffer(len)?;
    r.read_exact(&mut payload).map_err(FrameError::from_io)?;
    Ok((kind, payload))
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Equality of two digests in time independent of where they differ.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a
        .iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

fn cancelled(message: String) -> Error {
    Error::new(ErrorKind::Cancelled, message)
}

// ------------------------------------------------------------------------------------------------
// Configuration from the environment
// ------------------------------------------------------------------------------------------------

/// The leader address from [`LEADER_ADDR_ENV`], or [`DEFAULT_LEADER_ADDR`] when it is unset or
/// empty. An invalid value is an [`ErrorKind::InvalidConfig`] error naming the variable and value.
pub fn leader_addr_from_env() -> Result<SocketAddr> {
    leader_addr_from(std::env::var(LEADER_ADDR_ENV).ok().as_deref())
}

/// Parses a leader address as [`leader_addr_from_env`] does: `None` or empty gives
/// [`DEFAULT_LEADER_ADDR`]; otherwise `ip:port`, `[ipv6]:port` or `host:port` (resolved; the
/// first address wins).
pub fn leader_addr_from(value: Option<&str>) -> Result<SocketAddr> {
    let v = value.map(str::trim).filter(|v| !v.is_empty());
    let text = v.unwrap_or(DEFAULT_LEADER_ADDR);
    if let Ok(a) = text.parse::<SocketAddr>() {
        return Ok(a);
    }
    let invalid = |why: String| Error::invalid_config(LEADER_ADDR_ENV, text, why);
    match text.to_socket_addrs() {
        Ok(mut addrs) => addrs
            .next()
            .ok_or_else(|| invalid("the host name resolves to no address".to_string())),
        Err(e) => Err(invalid(format!("expected ip:port or host:port ({e})"))),
    }
}

/// The shared secret from [`AUTH_TOKEN_ENV`]; unset or empty means none.
pub fn auth_token_from_env() -> Option<String> {
    std::env::var(AUTH_TOKEN_ENV).ok().filter(|t| !t.is_empty())
}

// ------------------------------------------------------------------------------------------------
// Leader
// ------------------------------------------------------------------------------------------------

/// One admitted connection.
#[derive(Debug)]
struct Peer {
    conn: u64,
    addr: SocketAddr,
    out: UnboundedSender<Vec<u8>>,
}

#[derive(Debug)]
struct Ranks {
    peers: Vec<Option<Peer>>,
    /// Ranks that were admitted at least once.
    joined: Vec<bool>,
    /// Ranks that sent `Ready` over their current connection.
    ready: Vec<bool>,
}

#[derive(Debug)]
struct Shared {
    world_size: usize,
    token: Option<[u8; 32]>,
    handshake_timeout_ms: AtomicU64,
    session_started: AtomicBool,
    next_conn: AtomicU64,
    ranks: Mutex<Ranks>,
    incoming: Sender<(Rank, WorkerMessage)>,
    pending: Arc<Semaphore>,
    /// Writer tasks still running (the leader's drop waits for them to flush, briefly).
    live_writers: AtomicUsize,
}

/// Counts one running writer task.
struct LiveWriter(Arc<Shared>);

impl LiveWriter {
    fn new(shared: Arc<Shared>) -> Self {
        shared.live_writers.fetch_add(1, Ordering::SeqCst);
        Self(shared)
    }
}

impl Drop for LiveWriter {
    fn drop(&mut self) {
        self.0.live_writers.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Shared {
    fn handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.handshake_timeout_ms.load(Ordering::Relaxed))
    }

    fn start_session(&self, why: &str) {
        if !self.session_started.swap(true, Ordering::SeqCst) {
            tracing::info!(
                world_size = self.world_size,
                why,
                "kvbm session started: returning ranks are refused from now on"
            );
        }
    }

    /// Admits `hello` or says why not. On success the rank's peer slot holds the new connection.
    fn admit(
        &self,
        hello: &HandshakeHello,
        addr: SocketAddr,
    ) -> std::result::Result<(u64, UnboundedReceiver<Vec<u8>>), String> {
        let rank = hello.rank;
        if let Some(expected) = &self.token {
            match &hello.token {
                None => {
                    return Err(format!(
                        "authentication required: this leader has an auth token ({AUTH_TOKEN_ENV}) and rank {rank} presented none"
                    ))
                }
                Some(t) if !constant_time_eq(&digest(t), expected) => {
                    return Err(format!(
                        "authentication token mismatch for rank {rank} (check {AUTH_TOKEN_ENV})"
                    ))
                }
                Some(_) => {}
            }
        }
        if hello.rank >= hello.world_size {
            return Err(format!(
                "rank {rank} is not below its world_size {}",
                hello.world_size
            ));
        }
        if hello.world_size != self.world_size {
            return Err(format!(
                "rank {rank} expects world_size {} but the leader has {}",
                hello.world_size, self.world_size
            ));
        }
        let mut ranks = self.ranks.lock();
        if self.session_started.load(Ordering::SeqCst) {
            return Err(if ranks.joined.get(rank).copied().unwrap_or(false) {
                format!("rank {rank} already joined this session; restart the leader to rejoin")
            } else {
                format!(
                    "the session already started without rank {rank}; restart the leader to add it"
                )
            });
        }
        let Some(slot) = ranks.peers.get_mut(rank) else {
            return Err(format!(
                "rank {rank} is out of range for world_size {}",
                self.world_size
            ));
        };
        if let Some(p) = slot {
            return Err(format!(
                "rank {rank} is already connected (from {})",
                p.addr
            ));
        }
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let (out, out_rx) = unbounded_channel();
        *slot = Some(Peer { conn, addr, out });
        if let Some(r) = ranks.ready.get_mut(rank) {
            *r = false;
        }
        Ok((conn, out_rx))
    }

    /// Forgets `conn` for `rank` if it is still the rank's current connection and then, when
    /// `reason` is given, queues [`WorkerMessage::Disconnected`] for it. Both happen under the
    /// lock `admit` takes, so a reconnection's messages always come after the old
    /// connection's `Disconnected`.
    fn release(&self, rank: Rank, conn: u64, reason: Option<String>) -> bool {
        let mut ranks = self.ranks.lock();
        let current = ranks
            .peers
            .get(rank)
            .and_then(Option::as_ref)
            .is_some_and(|p| p.conn == conn);
        if current {
            if let Some(slot) = ranks.peers.get_mut(rank) {
                *slot = None;
            }
            if let Some(r) = ranks.ready.get_mut(rank) {
                *r = false;
            }
            if let Some(reason) = reason {
                let _ = self
                    .incoming
                    .send((rank, WorkerMessage::Disconnected(reason)));
            }
        }
        current
    }

    fn note_joined(&self, rank: Rank) {
        if let Some(j) = self.ranks.lock().joined.get_mut(rank) {
            *j = true;
        }
    }

    fn note_ready(&self, rank: Rank, conn: u64) {
        let all = {
            let mut ranks = self.ranks.lock();
            let current = ranks
                .peers
                .get(rank)
                .and_then(Option::as_ref)
                .is_some_and(|p| p.conn == conn);
            if !current {
                return;
            }
            if let Some(r) = ranks.ready.get_mut(rank) {
                *r = true;
            }
            ranks.ready.iter().all(|r| *r)
        };
        if all {
            self.start_session("every rank confirmed its allocation");
        }
    }
}

/// Leader end of the network transport. See the [module documentation](self) for the protocol.
pub struct TcpLeader {
    shared: Arc<Shared>,
    rx: Mutex<Receiver<(Rank, WorkerMessage)>>,
    local_addr: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for TcpLeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpLeader")
            .field("local_addr", &self.local_addr)
            .field("world_size", &self.shared.world_size)
            .field("connected_ranks", &self.connected_ranks())
            .field("session_started", &self.is_session_started())
            .field("auth", &self.shared.token.is_some())
            .finish()
    }
}

impl TcpLeader {
    /// Listens on `addr` for `world_size` workers. `auth_token` (`Some("")` counts as none), when
    /// given, must be presented by every worker. Port 0 picks a free port ([`Self::local_addr`]).
    pub fn bind(
        addr: SocketAddr,
        world_size: usize,
        auth_token: Option<String>,
    ) -> Result<Arc<TcpLeader>> {
        if world_size == 0 {
            return Err(Error::invalid_argument("world_size must be at least 1"));
        }
        let token = auth_token.filter(|t| !t.is_empty());
        let std_listener = std::net::TcpListener::bind(addr)
            .map_err(|e| Error::io("bind the kvbm leader socket", e).with("addr", addr))?;
        std_listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("configure the kvbm leader socket", e).with("addr", addr))?;
        let local_addr = std_listener
            .local_addr()
            .map_err(|e| Error::io("read the kvbm leader address", e).with("addr", addr))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvbm-tcp-leader")
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| Error::io("start the kvbm leader runtime", e))?;
        let listener = {
            let _guard = runtime.enter();
            TcpListener::from_std(std_listener)
                .map_err(|e| Error::io("register the kvbm leader socket", e).with("addr", addr))?
        };
        let (tx, rx) = channel();
        let shared = Arc::new(Shared {
            world_size,
            token: token.as_deref().map(digest),
            handshake_timeout_ms: AtomicU64::new(millis(HANDSHAKE_TIMEOUT)),
            session_started: AtomicBool::new(false),
            next_conn: AtomicU64::new(1),
            ranks: Mutex::new(Ranks {
                peers: (0..world_size).map(|_| None).collect(),
                joined: vec![false; world_size],
                ready: vec![false; world_size],
            }),
            incoming: tx,
            pending: Arc::new(Semaphore::new(MAX_PENDING_HANDSHAKES)),
            live_writers: AtomicUsize::new(0),
        });
        runtime.spawn(accept_loop(shared.clone(), listener));
        tracing::info!(
            addr = %local_addr,
            world_size,
            auth = token.is_some(),
            "kvbm leader listening"
        );
        if token.is_none() && !local_addr.ip().is_loopback() {
            tracing::warn!(
                addr = %local_addr,
                "kvbm leader listens on a non-loopback address without {AUTH_TOKEN_ENV}: anyone who can reach it can join as a worker"
            );
        }
        Ok(Arc::new(TcpLeader {
            shared,
            rx: Mutex::new(rx),
            local_addr,
            runtime: Some(runtime),
        }))
    }

    /// The address the leader listens on (with the actual port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Ranks connected now, ascending.
    pub fn connected_ranks(&self) -> Vec<Rank> {
        self.shared
            .ranks
            .lock()
            .peers
            .iter()
            .enumerate()
            .filter(|(_, p)| p.is_some())
            .map(|(r, _)| r)
            .collect()
    }

    /// The address `rank` is connected from, if it is connected.
    pub fn peer_addr(&self, rank: Rank) -> Option<SocketAddr> {
        self.shared
            .ranks
            .lock()
            .peers
            .get(rank)
            .and_then(Option::as_ref)
            .map(|p| p.addr)
    }

    /// Says the start-up barrier finished: from now on a rank that connects again is refused
    /// ("rank N already joined this session; restart the leader to rejoin"). The transport also
    /// does this by itself once every rank sent [`WorkerMessage::Ready`]; calling it again is
    /// harmless.
    pub fn mark_session_started(&self) {
        self.shared.start_session("marked by the leader");
    }

    /// Whether the session started (see [`Self::mark_session_started`]).
    pub fn is_session_started(&self) -> bool {
        self.shared.session_started.load(Ordering::SeqCst)
    }

    /// How long a new connection may take to send its HELLO (default [`HANDSHAKE_TIMEOUT`]);
    /// applies to connections accepted afterwards.
    pub fn set_handshake_timeout(&self, timeout: Duration) {
        self.shared
            .handshake_timeout_ms
            .store(millis(timeout).max(1), Ordering::Relaxed);
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Drop for TcpLeader {
    fn drop(&mut self) {
        let Some(rt) = self.runtime.take() else {
            return;
        };
        // Closing every rank's queue lets its writer send what is queued (e.g. a refusal's
        // reason), then close the connection.
        let peers: Vec<Peer> = self
            .shared
            .ranks
            .lock()
            .peers
            .iter_mut()
            .filter_map(Option::take)
            .collect();
        drop(peers);
        // Blocking is not allowed inside another runtime: there the runtime stops in the
        // background without the flush.
        if tokio::runtime::Handle::try_current().is_ok() {
            rt.shutdown_background();
            return;
        }
        let shared = self.shared.clone();
        rt.block_on(async move {
            let end = tokio::time::Instant::now() + DROP_FLUSH_TIMEOUT;
            while shared.live_writers.load(Ordering::SeqCst) > 0
                && tokio::time::Instant::now() < end
            {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
        // Dropping the remaining tasks closes every socket.
        rt.shutdown_timeout(Duration::from_secs(1));
    }
}

impl LeaderTransport for TcpLeader {
    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn send(&self, rank: Rank, msg: LeaderMessage) -> Result<()> {
        if rank >= self.shared.world_size {
            return Err(Error::out_of_range("rank", rank, self.shared.world_size));
        }
        let frame = encode_json(FrameKind::Msg, &msg)?;
        let ranks = self.shared.ranks.lock();
        let Some(peer) = ranks.peers.get(rank).and_then(Option::as_ref) else {
            return Err(
                cancelled(format!("kvbm leader send: rank {rank} is not connected"))
                    .with("rank", rank),
            );
        };
        peer.out.send(frame).map_err(|_| {
            cancelled(format!(
                "kvbm leader send: the connection of rank {rank} ({}) is closing",
                peer.addr
            ))
            .with("rank", rank)
            .with("peer", peer.addr)
        })
    }

    fn try_recv(&self) -> Result<Option<(Rank, WorkerMessage)>> {
        match self.rx.lock().try_recv() {
            Ok(m) => Ok(Some(m)),
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Disconnected) => Err(cancelled(
                "kvbm leader receive: the transport is shut down".to_string(),
            )),
        }
    }

    fn recv_timeout(&self, timeout: Duration) -> Result<Option<(Rank, WorkerMessage)>> {
        match self.rx.lock().recv_timeout(timeout) {
            Ok(m) => Ok(Some(m)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(cancelled(
                "kvbm leader receive: the transport is shut down".to_string(),
            )),
        }
    }
}

async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => match shared.pending.clone().try_acquire_owned() {
                Ok(permit) => {
                    tokio::spawn(serve_connection(shared.clone(), stream, peer, permit));
                }
                Err(_) => {
                    tracing::warn!(
                        peer = %peer,
                        "closing connection: {MAX_PENDING_HANDSHAKES} handshakes already pending"
                    );
                }
            },
            Err(e) => {
                // E.g. out of file descriptors: pause rather than spin.
                tracing::warn!(error = %e, "kvbm leader accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Writes a REFUSED frame (best effort, bounded in time) and closes the write side.
async fn refuse(stream: &mut TcpStream, reason: &str) {
    let refusal = Refusal {
        reason: reason.to_string(),
    };
    if let Ok(frame) = encode_json(FrameKind::Refused, &refusal) {
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            stream.write_all(&frame).await?;
            stream.shutdown().await
        })
        .await;
    }
}

struct Admitted {
    rank: Rank,
    conn: u64,
    stream: TcpStream,
    out_rx: UnboundedReceiver<Vec<u8>>,
}

async fn handshake(shared: &Shared, mut stream: TcpStream, peer: SocketAddr) -> Option<Admitted> {
    let timeout = shared.handshake_timeout();
    let first =
        tokio::time::timeout(timeout, read_frame_async(&mut stream, MAX_HELLO_PAYLOAD)).await;
    let payload = match first {
        Err(_) => {
            let reason = format!(
                "no HELLO within the {:.1}s handshake timeout",
                timeout.as_secs_f64()
            );
            tracing::warn!(peer = %peer, reason = %reason, "kvbm leader refused a connection");
            refuse(&mut stream, &reason).await;
            return None;
        }
        Ok(Err(e)) => {
            tracing::warn!(peer = %peer, reason = %e, "kvbm leader closed a connection during the handshake");
            if e.speaks_protocol() {
                refuse(&mut stream, &e.to_string()).await;
            }
            return None;
        }
        Ok(Ok((FrameKind::Hello, payload))) => payload,
        Ok(Ok((kind, _))) => {
            let reason = format!("expected a HELLO frame first, got {kind}");
            tracing::warn!(peer = %peer, reason = %reason, "kvbm leader refused a connection");
            refuse(&mut stream, &reason).await;
            return None;
        }
    };
    let hello: HandshakeHello = match serde_json::from_slice(&payload) {
        Ok(h) => h,
        Err(e) => {
            let reason = format!("undecodable HELLO payload: {e}");
            tracing::warn!(peer = %peer, reason = %reason, "kvbm leader refused a connection");
            refuse(&mut stream, &reason).await;
            return None;
        }
    };
    let rank = hello.rank;
    let (conn, out_rx) = match shared.admit(&hello, peer) {
        Ok(x) => x,
        Err(reason) => {
            tracing::warn!(peer = %peer, rank, reason = %reason, "kvbm leader refused a worker");
            refuse(&mut stream, &reason).await;
            return None;
        }
    };
    let welcome = Welcome {
        rank,
        world_size: shared.world_size,
    };
    let written = match encode_json(FrameKind::Welcome, &welcome) {
        Ok(frame) => tokio::time::timeout(timeout, stream.write_all(&frame))
            .await
            .map_err(|_| "timed out".to_string())
            .and_then(|r| r.map_err(|e| e.to_string())),
        Err(e) => Err(e.to_string()),
    };
    if let Err(e) = written {
        shared.release(rank, conn, None);
        tracing::warn!(peer = %peer, rank, error = %e, "kvbm leader could not welcome a worker");
        return None;
    }
    shared.note_joined(rank);
    tracing::info!(peer = %peer, rank, "kvbm worker joined");
    Some(Admitted {
        rank,
        conn,
        stream,
        out_rx,
    })
}

async fn serve_connection(
    shared: Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    permit: OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let Some(Admitted {
        rank,
        conn,
        stream,
        out_rx,
    }) = handshake(&shared, stream, peer).await
    else {
        return;
    };
    drop(permit);
    let (rd, wr) = stream.into_split();
    let live = LiveWriter::new(shared.clone());
    let mut writer = tokio::spawn(write_loop(wr, out_rx, live));
    let reason = tokio::select! {
        r = read_loop(&shared, rank, conn, rd) => r,
        w = &mut writer => w.unwrap_or_else(|e| format!("writer task ended: {e}")),
    };
    writer.abort();
    let logged = reason.clone();
    if shared.release(rank, conn, Some(reason)) {
        tracing::warn!(peer = %peer, rank, reason = %logged, "kvbm worker disconnected");
    }
}

/// Reads MSG frames until the connection ends; returns why it ended.
async fn read_loop(shared: &Shared, rank: Rank, conn: u64, rd: OwnedReadHalf) -> String {
    let mut rd = BufReader::with_capacity(READ_BUFFER, rd);
    loop {
        let payload = match read_frame_async(&mut rd, MAX_PAYLOAD).await {
            Ok((FrameKind::Msg, payload)) => payload,
            Ok((kind, _)) => return format!("unexpected {kind} frame after the handshake"),
            Err(e) => return e.to_string(),
        };
        let msg: WorkerMessage = match serde_json::from_slice(&payload) {
            Ok(m) => m,
            Err(e) => return format!("undecodable message: {e}"),
        };
        match msg {
            WorkerMessage::Disconnected(_) => {
                return "peer sent Disconnected, which is never sent on the wire".to_string()
            }
            WorkerMessage::Ready => shared.note_ready(rank, conn),
            _ => {}
        }
        if shared.incoming.send((rank, msg)).is_err() {
            return "the leader is shutting down".to_string();
        }
    }
}

/// Writes queued frames until the queue closes or a write fails; returns why it stopped.
async fn write_loop(
    mut wr: OwnedWriteHalf,
    mut out: UnboundedReceiver<Vec<u8>>,
    _live: LiveWriter,
) -> String {
    while let Some(frame) = out.recv().await {
        if let Err(e) = wr.write_all(&frame).await {
            return format!("write failed: {e}");
        }
    }
    let _ = wr.shutdown().await;
    "the leader closed the connection".to_string()
}

// ------------------------------------------------------------------------------------------------
// Worker
// ------------------------------------------------------------------------------------------------

/// Why a worker's connection is closed, once it is.
#[derive(Debug, Default)]
struct Closed {
    reason: Mutex<Option<String>>,
}

impl Closed {
    /// Records the first reason; returns whether this call closed it.
    fn close(&self, reason: String) -> bool {
        let mut r = self.reason.lock();
        if r.is_some() {
            return false;
        }
        *r = Some(reason);
        true
    }

    fn reason(&self) -> Option<String> {
        self.reason.lock().clone()
    }
}

/// Worker end of the network transport. See the [module documentation](self) for the protocol.
#[derive(Debug)]
pub struct TcpWorker {
    rank: Rank,
    world_size: usize,
    leader: SocketAddr,
    stream: Mutex<StdTcpStream>,
    /// Another handle on the socket, to shut it down while a send holds `stream`.
    control: StdTcpStream,
    rx: Mutex<Receiver<LeaderMessage>>,
    closed: Arc<Closed>,
}

enum Attempt {
    /// Worth another try (the leader is not up yet, or restarting).
    Retry(String),
    /// Final (refused, or not a kvbm leader).
    Fail(Error),
}

impl TcpWorker {
    /// Connects to the leader at `addr` as `rank` of `world_size`, presenting `auth_token`.
    ///
    /// Connection attempts are retried with a short backoff until `deadline` has passed, so a
    /// worker may start before its leader; missing it is an [`ErrorKind::Timeout`] error. A
    /// REFUSED answer is an [`ErrorKind::NotReady`] error carrying the leader's reason, at once
    /// (no retry); a peer that does not speak the protocol is an [`ErrorKind::Decode`] error.
    pub fn connect(
        addr: SocketAddr,
        rank: Rank,
        world_size: usize,
        auth_token: Option<String>,
        deadline: Duration,
    ) -> Result<Arc<TcpWorker>> {
        if rank >= world_size {
            return Err(Error::out_of_range("rank", rank, world_size));
        }
        let hello = HandshakeHello {
            rank,
            world_size,
            token: auth_token.filter(|t| !t.is_empty()),
        };
        let hello_frame = encode_json(FrameKind::Hello, &hello)?;
        let started = Instant::now();
        let end = started + deadline;
        let mut backoff = Duration::from_millis(10);
        let mut attempts = 0u32;
        let mut last: Option<String> = None;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            // Keep the previous failure when no attempt fits before the deadline.
            if !left.is_zero() {
                last = {
                    attempts += 1;
                    match StdTcpStream::connect_timeout(&addr, left.min(Duration::from_secs(1))) {
                        Ok(stream) => match Self::handshake(stream, addr, rank, &hello_frame, left)
                        {
                            Ok(w) => {
                                tracing::info!(leader = %addr, rank, attempts, "kvbm worker connected");
                                return Ok(Arc::new(w));
                            }
                            Err(Attempt::Fail(e)) => return Err(e),
                            Err(Attempt::Retry(why)) => Some(why),
                        },
                        Err(e) => Some(format!("connect: {e}")),
                    }
                };
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "rank {rank} could not reach the kvbm leader at {addr} within {:.1}s ({attempts} attempts; last: {})",
                        deadline.as_secs_f64(),
                        last.as_deref().unwrap_or("no attempt made")
                    ),
                )
                .with("rank", rank)
                .with("leader", addr));
            }
            if let Some(why) = &last {
                tracing::debug!(leader = %addr, rank, error = %why, "kvbm leader not reachable yet; retrying");
            }
            std::thread::sleep(backoff.min(left));
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    fn handshake(
        mut stream: StdTcpStream,
        addr: SocketAddr,
        rank: Rank,
        hello_frame: &[u8],
        left: Duration,
    ) -> std::result::Result<TcpWorker, Attempt> {
        let io = |what: &str, e: std::io::Error| Attempt::Retry(format!("{what}: {e}"));
        stream.set_nodelay(true).map_err(|e| io("set_nodelay", e))?;
        stream
            .set_read_timeout(Some(left.max(Duration::from_secs(1))))
            .map_err(|e| io("set_read_timeout", e))?;
        stream
            .set_write_timeout(Some(WORKER_WRITE_TIMEOUT))
            .map_err(|e| io("set_write_timeout", e))?;
        stream
            .write_all(hello_frame)
            .map_err(|e| io("send HELLO", e))?;
        let protocol = |why: String| {
            Attempt::Fail(
                Error::new(
                    ErrorKind::Decode,
                    format!("the peer at {addr} is not a compatible kvbm leader: {why}"),
                )
                .with("rank", rank)
                .with("leader", addr),
            )
        };
        let (kind, payload) = match read_frame_sync(&mut stream, MAX_HELLO_PAYLOAD) {
            Ok(f) => f,
            Err(FrameError::Closed) => {
                return Err(Attempt::Retry(
                    "the leader closed the connection during the handshake".to_string(),
                ))
            }
            Err(FrameError::Io(e)) => return Err(io("read the handshake answer", e)),
            Err(e) => return Err(protocol(e.to_string())),
        };
        match kind {
            FrameKind::Welcome => {
                let w: Welcome = serde_json::from_slice(&payload)
                    .map_err(|e| protocol(format!("undecodable WELCOME: {e}")))?;
                if w.rank != rank {
                    return Err(protocol(format!(
                        "WELCOME names rank {} but this worker is rank {rank}",
                        w.rank
                    )));
                }
                let world_size = w.world_size;
                Self::start(stream, addr, rank, world_size).map_err(Attempt::Fail)
            }
            FrameKind::Refused => {
                let reason = serde_json::from_slice::<Refusal>(&payload)
                    .map(|r| r.reason)
                    .unwrap_or_else(|e| format!("(undecodable REFUSED payload: {e})"));
                tracing::warn!(leader = %addr, rank, reason = %reason, "kvbm leader refused this worker");
                Err(Attempt::Fail(
                    Error::new(
                        ErrorKind::NotReady,
                        format!("the kvbm leader at {addr} refused rank {rank}: {reason}"),
                    )
                    .with("rank", rank)
                    .with("leader", addr)
                    .with("reason", reason),
                ))
            }
            other => Err(protocol(format!(
                "expected WELCOME or REFUSED, got {other}"
            ))),
        }
    }

    fn start(
        stream: StdTcpStream,
        addr: SocketAddr,
        rank: Rank,
        world_size: usize,
    ) -> Result<TcpWorker> {
        let err =
            |what: &'static str, e| Error::io(what, e).with("rank", rank).with("leader", addr);
        stream
            .set_read_timeout(None)
            .map_err(|e| err("configure the leader connection", e))?;
        let reader = stream
            .try_clone()
            .map_err(|e| err("clone the leader connection", e))?;
        let control = stream
            .try_clone()
            .map_err(|e| err("clone the leader connection", e))?;
        let (tx, rx) = channel();
        let closed = Arc::new(Closed::default());
        let c = closed.clone();
        std::thread::Builder::new()
            .name(format!("kvbm-tcp-worker-{rank}"))
            .spawn(move || worker_reader(reader, addr, rank, tx, c))
            .map_err(|e| err("spawn the worker reader thread", e))?;
        Ok(TcpWorker {
            rank,
            world_size,
            leader: addr,
            stream: Mutex::new(stream),
            control,
            rx: Mutex::new(rx),
            closed,
        })
    }

    /// The leader's address.
    pub fn leader_addr(&self) -> SocketAddr {
        self.leader
    }

    /// The world size the leader confirmed.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Whether the leader connection is still open.
    pub fn is_connected(&self) -> bool {
        self.closed.reason().is_none()
    }

    /// Closes the connection to the leader (dropping the worker does the same); the leader sees
    /// [`WorkerMessage::Disconnected`] for this rank.
    pub fn close(&self) {
        self.closed
            .close("this worker closed its connection".to_string());
        let _ = self.control.shutdown(Shutdown::Both);
    }

    fn gone(&self, op: &str) -> Error {
        let why = self
            .closed
            .reason()
            .unwrap_or_else(|| "connection closed".to_string());
        cancelled(format!(
            "rank {} {op}: the connection to the kvbm leader at {} is closed: {why}",
            self.rank, self.leader
        ))
        .with("rank", self.rank)
        .with("leader", self.leader)
    }
}

fn worker_reader(
    stream: StdTcpStream,
    addr: SocketAddr,
    rank: Rank,
    tx: Sender<LeaderMessage>,
    closed: Arc<Closed>,
) {
    let mut rd = std::io::BufReader::with_capacity(READ_BUFFER, &stream);
    let reason = loop {
        match read_frame_sync(&mut rd, MAX_PAYLOAD) {
            Ok((FrameKind::Msg, payload)) => {
                match serde_json::from_slice::<LeaderMessage>(&payload) {
                    Ok(m) => {
                        if tx.send(m).is_err() {
                            break "this worker closed its connection".to_string();
                        }
                    }
                    Err(e) => break format!("undecodable message from the leader: {e}"),
                }
            }
            Ok((FrameKind::Refused, payload)) => {
                let why = serde_json::from_slice::<Refusal>(&payload)
                    .map(|r| r.reason)
                    .unwrap_or_else(|e| format!("(undecodable REFUSED payload: {e})"));
                break format!("the leader refused this worker: {why}");
            }
            Ok((kind, _)) => break format!("unexpected {kind} frame from the leader"),
            Err(e) => break e.to_string(),
        }
    };
    if closed.close(reason.clone()) {
        tracing::warn!(leader = %addr, rank, reason = %reason, "kvbm leader connection lost");
    }
    let _ = stream.shutdown(Shutdown::Both);
}

impl Drop for TcpWorker {
    fn drop(&mut self) {
        self.close();
    }
}

impl WorkerTransport for TcpWorker {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn send(&self, msg: WorkerMessage) -> Result<()> {
        if matches!(msg, WorkerMessage::Disconnected(_)) {
            return Err(Error::invalid_argument(
                "WorkerMessage::Disconnected is generated by the leader's transport and is never sent",
            )
            .with("rank", self.rank));
        }
        let frame = encode_json(FrameKind::Msg, &msg)?;
        if !self.is_connected() {
            return Err(self.gone("send"));
        }
        let mut stream = self.stream.lock();
        if let Err(e) = stream.write_all(&frame) {
            // A partial frame may be on the wire: the stream is unusable from here on.
            self.closed.close(format!("write failed: {e}"));
            let _ = stream.shutdown(Shutdown::Both);
            drop(stream);
            return Err(self.gone("send").with_source(e));
        }
        Ok(())
    }

    fn recv_timeout(&self, timeout: Duration) -> Result<Option<LeaderMessage>> {
        match self.rx.lock().recv_timeout(timeout) {
            Ok(m) => Ok(Some(m)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(self.gone("receive")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(magic: &[u8; 4], version: u16, kind: u8, len: u32) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(magic);
        h[4..6].copy_from_slice(&version.to_be_bytes());
        h[6] = kind;
        h[8..].copy_from_slice(&len.to_be_bytes());
        h
    }

    #[test]
    fn frame_layout_is_as_documented() {
        let f = encode_frame(FrameKind::Msg, b"\"Ready\"").unwrap();
        assert_eq!(&f[..4], b"KVBM");
        assert_eq!(&f[4..6], &[0, 1]);
        assert_eq!(f[6], 4);
        assert_eq!(f[7], 0);
        assert_eq!(&f[8..12], &[0, 0, 0, 7]);
        assert_eq!(&f[12..], b"\"Ready\"");
        let h: [u8; HEADER_LEN] = f[..HEADER_LEN].try_into().unwrap();
        assert_eq!(parse_header(&h, MAX_PAYLOAD).unwrap(), (FrameKind::Msg, 7));
    }

    #[test]
    fn bad_headers_are_rejected() {
        let cases = [
            (header(b"GET ", 1, 4, 0), "bad magic"),
            (header(b"KVBM", 2, 4, 0), "version 2"),
            (header(b"KVBM", 1, 9, 0), "kind 9"),
            (header(b"KVBM", 1, 0, 0), "kind 0"),
            (header(b"KVBM", 1, 4, MAX_PAYLOAD + 1), "exceeds"),
        ];
        for (h, want) in cases {
            let e = parse_header(&h, MAX_PAYLOAD).unwrap_err().to_string();
            assert!(e.contains(want), "{e} should contain {want}");
        }
    }

    #[test]
    fn oversized_payloads_are_not_encoded() {
        let big = vec![0u8; MAX_PAYLOAD as usize + 1];
        let e = encode_frame(FrameKind::Msg, &big).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn leader_address_parsing() {
        assert_eq!(
            leader_addr_from(None).unwrap(),
            "127.0.0.1:5557".parse().unwrap()
        );
        assert_eq!(
            leader_addr_from(Some("  ")).unwrap(),
            "127.0.0.1:5557".parse().unwrap()
        );
        assert_eq!(
            leader_addr_from(Some("10.0.0.7:6000")).unwrap(),
            "10.0.0.7:6000".parse().unwrap()
        );
        assert_eq!(
            leader_addr_from(Some("[::1]:6000")).unwrap(),
            "[::1]:6000".parse().unwrap()
        );
        for bad in ["not-an-address", "127.0.0.1", "127.0.0.1:99999"] {
            let e = leader_addr_from(Some(bad)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{bad}: {e}");
            assert!(e.to_string().contains(LEADER_ADDR_ENV), "{e}");
            assert!(e.to_string().contains(bad), "{e}");
        }
    }

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(&digest("a"), &digest("a")));
        assert!(!constant_time_eq(&digest("a"), &digest("b")));
        assert!(!constant_time_eq(&digest("a"), &digest("")));
        let h = HandshakeHello {
            rank: 0,
            world_size: 1,
            token: Some("secret".into()),
        };
        assert!(!format!("{h:?}").contains("secret"));
    }
}
