//! The worker's end: one blocking socket to the leader, connected with retries until a
//! deadline, one reader thread and one heartbeat thread.
//!
//! Owns connecting, the worker's half of the handshake and the connection's closed state.
//! Invariants: the first reason the connection closed is the one every later call reports; a
//! failed write closes the connection (a partial frame may be on the wire);
//! [`WorkerMessage::Disconnected`] is never sent; frames are written whole under one lock
//! (heartbeats and messages never interleave); a HEARTBEAT goes out every interval the leader
//! announced in its WELCOME, from a thread of its own (so an idle or busy worker keeps
//! beating), and a leader silent for the announced timeout closes the connection.

use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpStream as StdTcpStream};
#[cfg(test)]
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::connector::transport::{
    LeaderMessage, Rank, WorkerMessage, WorkerTransport, LEADER_GOODBYE,
};
use crate::error::{Error, ErrorKind, Result};

use super::cancelled;
use super::frame::{
    encode_completions, encode_frame, encode_json, read_frame_sync, FrameError, FrameKind,
    HandshakeHello, Refusal, Welcome, MAX_HELLO_PAYLOAD, MAX_PAYLOAD, PROTOCOL_VERSION,
    READ_BUFFER,
};

/// Worker socket write timeout: a leader that stops reading for this long counts as gone.
const WORKER_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest pause between two connection attempts of a worker.
const MAX_BACKOFF: Duration = Duration::from_millis(200);

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

/// Worker end of the network transport. See the [module documentation](super) for the protocol.
#[derive(Debug)]
pub struct TcpWorker {
    rank: Rank,
    world_size: usize,
    leader: SocketAddr,
    stream: Arc<Mutex<StdTcpStream>>,
    /// Another handle on the socket, to shut it down while a send holds `stream`.
    control: StdTcpStream,
    rx: Mutex<Receiver<LeaderMessage>>,
    closed: Arc<Closed>,
    /// Dropping it stops the heartbeat thread at once.
    _stop_heartbeat: SyncSender<()>,
    /// Payload bound of COMPLETIONS frames ([`MAX_PAYLOAD`]; smaller in tests, to split).
    completions_limit: AtomicU32,
    /// MSG and COMPLETIONS frames written (heartbeats not counted).
    frames_sent: AtomicU64,
    /// Tests: set by the reader thread as it ends (once the connection closed).
    #[cfg(test)]
    reader_ended: Arc<AtomicBool>,
    /// Tests: runs in [`TcpWorker::close`] right after the goodbye was written.
    #[cfg(test)]
    pub(super) after_goodbye: Hook,
}

/// A test's code to run at one point of [`TcpWorker::close`].
#[cfg(test)]
#[derive(Default)]
pub(super) struct Hook(pub(super) Mutex<Option<Box<dyn FnOnce() + Send>>>);

#[cfg(test)]
impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hook")
    }
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
            Err(FrameError::BadVersion(theirs)) => {
                return Err(Attempt::Fail(version_mismatch(addr, rank, theirs)))
            }
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
                Self::start(stream, addr, rank, &w).map_err(Attempt::Fail)
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
        welcome: &Welcome,
    ) -> Result<TcpWorker> {
        let err =
            |what: &'static str, e| Error::io(what, e).with("rank", rank).with("leader", addr);
        let heartbeat = Duration::from_millis(welcome.heartbeat_ms.max(1));
        let silence = Duration::from_millis(welcome.heartbeat_timeout_ms).max(heartbeat * 2);
        // The reader's idle limit: no byte from the leader for this long closes the connection.
        stream
            .set_read_timeout(Some(silence))
            .map_err(|e| err("configure the leader connection", e))?;
        let reader = stream
            .try_clone()
            .map_err(|e| err("clone the leader connection", e))?;
        let control = stream
            .try_clone()
            .map_err(|e| err("clone the leader connection", e))?;
        let (tx, rx) = channel();
        let closed = Arc::new(Closed::default());
        #[cfg(test)]
        let reader_ended = Arc::new(AtomicBool::new(false));
        let c = closed.clone();
        std::thread::Builder::new()
            .name(format!("kvbm-tcp-worker-{rank}"))
            .spawn({
                #[cfg(test)]
                let ended = reader_ended.clone();
                move || {
                    worker_reader(reader, addr, rank, tx, c, silence);
                    #[cfg(test)]
                    ended.store(true, std::sync::atomic::Ordering::SeqCst);
                }
            })
            .map_err(|e| err("spawn the worker reader thread", e))?;
        let stream = Arc::new(Mutex::new(stream));
        let (stop, stopped) = std::sync::mpsc::sync_channel(0);
        let beat = Heartbeat {
            stream: stream.clone(),
            closed: closed.clone(),
            every: heartbeat,
            stopped,
        };
        if let Err(e) = std::thread::Builder::new()
            .name(format!("kvbm-tcp-heartbeat-{rank}"))
            .spawn(move || beat.run())
        {
            let _ = control.shutdown(Shutdown::Both);
            return Err(err("spawn the worker heartbeat thread", e));
        }
        Ok(TcpWorker {
            rank,
            world_size: welcome.world_size,
            leader: addr,
            stream,
            control,
            rx: Mutex::new(rx),
            closed,
            _stop_heartbeat: stop,
            completions_limit: AtomicU32::new(MAX_PAYLOAD),
            frames_sent: AtomicU64::new(0),
            #[cfg(test)]
            reader_ended,
            #[cfg(test)]
            after_goodbye: Hook::default(),
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

    /// MSG and COMPLETIONS frames this worker has written so far (heartbeats not counted): the
    /// messages its completions cost, for benchmarks and tests.
    pub fn frames_sent(&self) -> u64 {
        self.frames_sent.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bounds COMPLETIONS payloads to `limit` bytes (tests exercise splitting with small ones).
    #[cfg(test)]
    pub(super) fn set_completions_limit(&self, limit: u32) {
        self.completions_limit
            .store(limit, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the leader connection is still open.
    pub fn is_connected(&self) -> bool {
        self.closed.reason().is_none()
    }

    /// Why the leader connection closed (`None` while open): [`LEADER_GOODBYE`] when the leader
    /// shut down in order, "this worker closed its connection" when this side did, else how the
    /// connection was lost.
    pub fn close_reason(&self) -> Option<String> {
        self.closed.reason()
    }

    /// Closes the connection to the leader (dropping the worker does the same); the leader sees
    /// [`WorkerMessage::Disconnected`] for this rank.
    pub fn close(&self) {
        // Closed before the goodbye leaves: the leader closes its end as soon as it reads it,
        // and this worker's reader must then find the connection closed by this side, not lost
        // (it warned, now and then, on every normal shutdown).
        if self
            .closed
            .close("this worker closed its connection".to_string())
        {
            // Best effort and never blocking (a send in progress holds the stream): the leader
            // then logs this rank's departure instead of a lost worker.
            if let (Some(mut stream), Ok(frame)) = (
                self.stream.try_lock(),
                encode_json(FrameKind::Msg, &WorkerMessage::Goodbye),
            ) {
                let _ = stream.write_all(&frame);
            }
            #[cfg(test)]
            {
                let hook = self.after_goodbye.0.lock().take();
                if let Some(hook) = hook {
                    hook();
                }
            }
        }
        let _ = self.control.shutdown(Shutdown::Both);
    }

    /// Tests: whether the reader thread ended (the connection is closed, nothing more arrives).
    #[cfg(test)]
    pub(super) fn reader_ended(&self) -> bool {
        self.reader_ended.load(std::sync::atomic::Ordering::SeqCst)
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

/// The heartbeat thread: a HEARTBEAT frame every `every` until the worker is dropped or the
/// connection closes.
struct Heartbeat {
    stream: Arc<Mutex<StdTcpStream>>,
    closed: Arc<Closed>,
    every: Duration,
    stopped: Receiver<()>,
}

impl Heartbeat {
    fn run(self) {
        let Ok(beat) = encode_frame(FrameKind::Heartbeat, &[]) else {
            return;
        };
        while let Err(RecvTimeoutError::Timeout) = self.stopped.recv_timeout(self.every) {
            if self.closed.reason().is_some() {
                return;
            }
            let mut stream = self.stream.lock();
            if let Err(e) = stream.write_all(&beat) {
                self.closed.close(format!("heartbeat write failed: {e}"));
                let _ = stream.shutdown(Shutdown::Both);
                return;
            }
        }
    }
}

fn worker_reader(
    stream: StdTcpStream,
    addr: SocketAddr,
    rank: Rank,
    tx: Sender<LeaderMessage>,
    closed: Arc<Closed>,
    silence: Duration,
) {
    let mut rd = std::io::BufReader::with_capacity(READ_BUFFER, &stream);
    let reason = loop {
        match read_frame_sync(&mut rd, MAX_PAYLOAD) {
            Ok((FrameKind::Heartbeat, _)) => {}
            Err(FrameError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break format!(
                    "nothing from the leader for {:.1}s (the heartbeat timeout it announced): it is stopped, hung or unreachable",
                    silence.as_secs_f64()
                );
            }
            Ok((FrameKind::Msg, payload)) => {
                match serde_json::from_slice::<LeaderMessage>(&payload) {
                    Ok(m) => {
                        let goodbye = m == LeaderMessage::Goodbye;
                        if tx.send(m).is_err() {
                            break "this worker closed its connection".to_string();
                        }
                        if goodbye {
                            break LEADER_GOODBYE.to_string();
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
        if reason == LEADER_GOODBYE {
            tracing::info!(leader = %addr, rank, "kvbm leader left (it said goodbye)");
        } else {
            tracing::warn!(leader = %addr, rank, reason = %reason, "kvbm leader connection lost");
        }
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
        // Completions go as COMPLETIONS frames (binary, split at the frame limit); everything
        // else as one MSG frame of JSON.
        let frames = match &msg {
            WorkerMessage::Completed(list) => encode_completions(
                list,
                self.completions_limit
                    .load(std::sync::atomic::Ordering::Relaxed),
            )?,
            _ => vec![encode_json(FrameKind::Msg, &msg)?],
        };
        if !self.is_connected() {
            return Err(self.gone("send"));
        }
        // One lock for every frame of the message: nothing interleaves with a split batch.
        let mut stream = self.stream.lock();
        for frame in &frames {
            // Counted before the write: once the leader has a frame, `frames_sent` includes it
            // (counted after, a reader that saw the leader receive it could find it missing).
            self.frames_sent
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if let Err(e) = stream.write_all(frame) {
                self.frames_sent
                    .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                // A partial frame may be on the wire: the stream is unusable from here on.
                self.closed.close(format!("write failed: {e}"));
                let _ = stream.shutdown(Shutdown::Both);
                drop(stream);
                return Err(self.gone("send").with_source(e));
            }
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

/// A leader that answered in another wire protocol version: no retry helps, the two sides run
/// different releases.
fn version_mismatch(addr: SocketAddr, rank: Rank, theirs: u16) -> Error {
    Error::new(
        ErrorKind::Unsupported,
        format!(
            "the kvbm leader at {addr} speaks wire protocol version {theirs} and rank {rank} speaks version {PROTOCOL_VERSION}: run the same kvbm-connector release on the leader and every worker"
        ),
    )
    .with("rank", rank)
    .with("leader", addr)
    .with("leader_protocol", theirs)
    .with("worker_protocol", PROTOCOL_VERSION)
}
