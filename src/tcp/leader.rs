//! The leader's end: one listening socket, a handshake per connection, then a reader and a
//! writer task per admitted worker on a one-thread tokio runtime.
//!
//! Owns admission (authentication, rank and world-size checks, the rejoin policy) and the
//! per-rank connection table. Invariants: a rank has at most one admitted connection; the
//! [`WorkerMessage::Disconnected`] of a rank's old connection is queued before anything its next
//! connection delivers (both happen under the table's lock); once the session started no rank is
//! admitted again; at most [`MAX_PENDING_HANDSHAKES`] handshakes run at once; a connection
//! delivers a message only while it is its rank's current one (checked under the table's lock),
//! so nothing arrives from it after its `Disconnected`; an admitted connection that delivers no
//! frame (heartbeats included) for the heartbeat timeout is closed as lost, and the leader
//! sends a HEARTBEAT whenever it has written nothing for the heartbeat interval.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::{tcp_config_from_env, TcpConfig, AUTH_TOKEN_ENV, HEARTBEAT_TIMEOUT_ENV};
use crate::connector::transport::{LeaderMessage, LeaderTransport, Rank, WorkerMessage, GOODBYE};
use crate::error::{Error, Result};

use super::cancelled;
use super::frame::{
    encode_frame, encode_json, read_frame_async, CompletionsDecoder, FrameKind, HandshakeHello,
    Refusal, Welcome, MAX_HELLO_PAYLOAD, MAX_PAYLOAD, READ_BUFFER,
};

/// How long the leader waits for a HELLO after accepting a connection (by default).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Handshakes the leader runs at once; further connections are closed until one finishes.
const MAX_PENDING_HANDSHAKES: usize = 64;

/// How long dropping the leader waits for queued frames to be written.
const DROP_FLUSH_TIMEOUT: Duration = Duration::from_secs(1);

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
    /// Interval between heartbeats (both ways) and the silence after which a rank is lost.
    heartbeat: Duration,
    heartbeat_timeout: Duration,
    session_started: AtomicBool,
    next_conn: AtomicU64,
    ranks: Mutex<Ranks>,
    incoming: Sender<(Rank, WorkerMessage)>,
    pending: Arc<Semaphore>,
    /// Writer tasks still running (the leader's drop waits for them to flush, briefly).
    live_writers: AtomicUsize,
    /// What admitted workers sent ([`Received`]).
    received: ReceivedCounters,
}

/// Counts of what the leader received from admitted workers since it was bound (heartbeats not
/// counted): what completions cost in messages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Received {
    /// MSG frames (JSON messages: barrier, and any completions sent that way).
    pub msg_frames: u64,
    /// COMPLETIONS frames.
    pub completion_frames: u64,
    /// Completions delivered (from either kind), an operation split over frames counted once.
    pub completions: u64,
}

#[derive(Debug, Default)]
struct ReceivedCounters {
    msg_frames: AtomicU64,
    completion_frames: AtomicU64,
    completions: AtomicU64,
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

    /// Queues `msg` from `conn` if it is still `rank`'s current connection (under the lock
    /// `release` takes, so nothing follows the connection's `Disconnected`). Returns false when
    /// the connection is no longer current or the leader is gone.
    fn deliver(&self, rank: Rank, conn: u64, msg: WorkerMessage) -> bool {
        let ranks = self.ranks.lock();
        let current = ranks
            .peers
            .get(rank)
            .and_then(Option::as_ref)
            .is_some_and(|p| p.conn == conn);
        current && self.incoming.send((rank, msg)).is_ok()
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

/// Leader end of the network transport. See the [module documentation](super) for the protocol.
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
    /// The other settings (heartbeats, `allow_insecure`) come from the environment
    /// ([`tcp_config_from_env`]); [`Self::bind_with`] takes them explicitly.
    ///
    /// A non-loopback `addr` without a token is refused unless `KVBM_ALLOW_INSECURE` is set (see
    /// [`TcpConfig::check_listen`]).
    pub fn bind(
        addr: SocketAddr,
        world_size: usize,
        auth_token: Option<String>,
    ) -> Result<Arc<TcpLeader>> {
        let tcp = TcpConfig {
            auth_token,
            ..tcp_config_from_env()?
        };
        Self::bind_with(addr, world_size, &tcp)
    }

    /// As [`Self::bind`], with every setting from `tcp`: its auth token, heartbeat interval and
    /// timeout, and `allow_insecure` (its `leader_addr` is ignored: `addr` is used).
    pub fn bind_with(
        addr: SocketAddr,
        world_size: usize,
        tcp: &TcpConfig,
    ) -> Result<Arc<TcpLeader>> {
        if world_size == 0 {
            return Err(Error::invalid_argument("world_size must be at least 1"));
        }
        let token = tcp.auth_token();
        tcp.check_listen("kvbm leader", addr, token.is_some())?;
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
            heartbeat: tcp.heartbeat(),
            heartbeat_timeout: tcp.heartbeat_timeout(),
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
            received: ReceivedCounters::default(),
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
                "kvbm leader listens on a non-loopback address without {AUTH_TOKEN_ENV} (allowed by KVBM_ALLOW_INSECURE): anyone who can reach it can join as a worker"
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

    /// Closes `rank`'s connection as lost, saying `reason`: [`WorkerMessage::Disconnected`] is
    /// queued for it (after everything it delivered, before anything a new connection would)
    /// and nothing more arrives from that connection. For a caller that found the rank dead by
    /// other means (a missed deadline of its own), so the leader's in-flight operations on the
    /// rank fail as for a killed worker. Returns whether the rank was connected.
    pub fn disconnect(&self, rank: Rank, reason: &str) -> bool {
        let conn = {
            let ranks = self.shared.ranks.lock();
            ranks
                .peers
                .get(rank)
                .and_then(Option::as_ref)
                .map(|p| p.conn)
        };
        let Some(conn) = conn else {
            return false;
        };
        // Dropping the peer's queue ends its writer, which closes the connection.
        let done = self.shared.release(rank, conn, Some(reason.to_string()));
        if done {
            tracing::warn!(rank, reason, "kvbm leader dropped a worker");
        }
        done
    }

    /// What admitted workers sent so far (frames by kind, completions); see [`Received`].
    pub fn received(&self) -> Received {
        let r = &self.shared.received;
        Received {
            msg_frames: r.msg_frames.load(Ordering::Relaxed),
            completion_frames: r.completion_frames.load(Ordering::Relaxed),
            completions: r.completions.load(Ordering::Relaxed),
        }
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
        // reason), then close the connection. A goodbye goes last: the worker then knows this
        // is an orderly shutdown, not a lost leader.
        let peers: Vec<Peer> = self
            .shared
            .ranks
            .lock()
            .peers
            .iter_mut()
            .filter_map(Option::take)
            .collect();
        if let Ok(goodbye) = encode_json(FrameKind::Msg, &LeaderMessage::Goodbye) {
            for peer in &peers {
                let _ = peer.out.send(goodbye.clone());
            }
        }
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
        heartbeat_ms: millis(shared.heartbeat).max(1),
        heartbeat_timeout_ms: millis(shared.heartbeat_timeout).max(1),
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
    let mut writer = tokio::spawn(write_loop(wr, out_rx, live, shared.heartbeat));
    let reason = tokio::select! {
        r = read_loop(&shared, rank, conn, rd) => r,
        w = &mut writer => w.unwrap_or_else(|e| format!("writer task ended: {e}")),
    };
    writer.abort();
    let logged = reason.clone();
    if shared.release(rank, conn, Some(reason)) {
        if logged == GOODBYE {
            tracing::info!(peer = %peer, rank, "kvbm worker left (it said goodbye)");
        } else {
            tracing::warn!(peer = %peer, rank, reason = %logged, "kvbm worker disconnected");
        }
    }
}

/// Reads MSG, COMPLETIONS and HEARTBEAT frames until the connection ends or stays silent for
/// the heartbeat timeout; returns why it ended. A COMPLETIONS frame is delivered as one
/// [`WorkerMessage::Completed`] (an operation continued into the next frame waits for it).
async fn read_loop(shared: &Shared, rank: Rank, conn: u64, rd: OwnedReadHalf) -> String {
    let mut rd = BufReader::with_capacity(READ_BUFFER, rd);
    let timeout = shared.heartbeat_timeout;
    let mut completions = CompletionsDecoder::default();
    let counts = &shared.received;
    loop {
        // Cancelling a read mid-frame loses its bytes; the connection is closed right after.
        let read = tokio::time::timeout(timeout, read_frame_async(&mut rd, MAX_PAYLOAD)).await;
        let payload = match read {
            Err(_) => {
                return format!(
                    "no frame from rank {rank} for {:.1}s (heartbeat timeout, {HEARTBEAT_TIMEOUT_ENV}): the worker is stopped, hung or unreachable",
                    timeout.as_secs_f64()
                )
            }
            Ok(Ok((FrameKind::Msg, payload))) => payload,
            Ok(Ok((FrameKind::Completions, payload))) => {
                counts.completion_frames.fetch_add(1, Ordering::Relaxed);
                let list = match completions.decode(&payload) {
                    Ok(list) => list,
                    Err(e) => return format!("undecodable completions: {e}"),
                };
                if list.is_empty() {
                    continue;
                }
                counts
                    .completions
                    .fetch_add(list.len() as u64, Ordering::Relaxed);
                if !shared.deliver(rank, conn, WorkerMessage::Completed(list)) {
                    return "the leader closed the connection".to_string();
                }
                continue;
            }
            Ok(Ok((FrameKind::Heartbeat, _))) => continue,
            Ok(Ok((kind, _))) => return format!("unexpected {kind} frame after the handshake"),
            Ok(Err(e)) => return e.to_string(),
        };
        let msg: WorkerMessage = match serde_json::from_slice(&payload) {
            Ok(m) => m,
            Err(e) => return format!("undecodable message: {e}"),
        };
        counts.msg_frames.fetch_add(1, Ordering::Relaxed);
        match &msg {
            WorkerMessage::Disconnected(_) => {
                return "peer sent Disconnected, which is never sent on the wire".to_string()
            }
            WorkerMessage::Goodbye => return GOODBYE.to_string(),
            WorkerMessage::Ready => shared.note_ready(rank, conn),
            WorkerMessage::Completed(list) => {
                counts
                    .completions
                    .fetch_add(list.len() as u64, Ordering::Relaxed);
            }
            _ => {}
        }
        if !shared.deliver(rank, conn, msg) {
            return "the leader closed the connection".to_string();
        }
    }
}

/// Writes queued frames, and a HEARTBEAT after each `heartbeat` with nothing written, until the
/// queue closes or a write fails; returns why it stopped.
async fn write_loop(
    mut wr: OwnedWriteHalf,
    mut out: UnboundedReceiver<Vec<u8>>,
    _live: LiveWriter,
    heartbeat: Duration,
) -> String {
    let beat = match encode_frame(FrameKind::Heartbeat, &[]) {
        Ok(f) => f,
        Err(e) => return format!("cannot encode a heartbeat: {e}"),
    };
    let next_beat = tokio::time::sleep(heartbeat);
    tokio::pin!(next_beat);
    loop {
        let frame = tokio::select! {
            f = out.recv() => match f {
                Some(f) => f,
                None => break,
            },
            () = &mut next_beat => beat.clone(),
        };
        if let Err(e) = wr.write_all(&frame).await {
            return format!("write failed: {e}");
        }
        next_beat
            .as_mut()
            .reset(tokio::time::Instant::now() + heartbeat);
    }
    let _ = wr.shutdown().await;
    "the leader closed the connection".to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

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
