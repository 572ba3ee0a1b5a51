//! The engine channel: how the simulated engine reaches a rank in a child process (`kvbm
//! worker`). A frame is a u32 big-endian length and a JSON [`RankRequest`] or [`RankResponse`],
//! over loopback TCP. This is the simulated engine's own RPC (what TensorRT-LLM does with MPI and
//! vLLM with its executor); the connector's leader ↔ worker traffic runs over its own transport.
//!
//! Joining ([`accept_ranks`]): a rank connects and greets with its rank number (one frame).
//! Greetings are read from every pending connection at once, without blocking, so the start-up
//! deadline holds whatever clients do: a connection that stays silent is dropped after
//! [`GREETING_TIMEOUT`], one that sends garbage or an oversized frame at once, and at most
//! [`MAX_PENDING_GREETINGS`] wait at a time (the oldest is dropped for a newcomer).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use kvbm_connector::error::{Error, ErrorKind, Result};

use super::messages::{
    RankDriver, RankRequest, RankResponse, RankStats, StepCommand, StepReply, Verify,
};
use super::rank::RankExecutor;

/// Largest frame on the engine channel.
const MAX_FRAME: usize = 256 << 20;

/// Writes one frame.
pub fn write_frame<T: Serialize>(stream: &mut TcpStream, value: &T) -> Result<()> {
    let body = serde_json::to_vec(value)
        .map_err(|e| Error::internal(format!("cannot encode a frame: {e}")))?;
    let len = u32::try_from(body.len()).map_err(|_| Error::invalid_argument("frame too large"))?;
    stream
        .write_all(&len.to_be_bytes())
        .and_then(|()| stream.write_all(&body))
        .map_err(|e| Error::io("write to the engine channel", e))
}

/// Reads one frame.
pub fn read_frame<T: for<'de> Deserialize<'de>>(stream: &mut TcpStream) -> Result<T> {
    let mut len = [0u8; 4];
    stream
        .read_exact(&mut len)
        .map_err(|e| Error::new(ErrorKind::Cancelled, format!("engine channel closed: {e}")))?;
    let n = u32::from_be_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(Error::new(
            ErrorKind::Decode,
            format!("engine frame of {n} bytes is too large"),
        ));
    }
    let mut body = vec![0u8; n];
    stream
        .read_exact(&mut body)
        .map_err(|e| Error::new(ErrorKind::Cancelled, format!("engine channel closed: {e}")))?;
    serde_json::from_slice(&body)
        .map_err(|e| Error::new(ErrorKind::Decode, format!("malformed engine frame: {e}")))
}

/// Longest a connection may take to send its greeting before it is dropped.
pub const GREETING_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections waiting for their greeting at once; a newcomer beyond this drops the oldest.
pub const MAX_PENDING_GREETINGS: usize = 64;

/// Largest greeting body: a rank number in JSON.
const MAX_GREETING: usize = 20;

/// A connection whose greeting (its rank) is being read without blocking.
struct Greeting {
    stream: TcpStream,
    peer: SocketAddr,
    buf: Vec<u8>,
    since: Instant,
}

impl Greeting {
    fn new(stream: TcpStream, peer: SocketAddr) -> std::io::Result<Self> {
        stream.set_nonblocking(true)?;
        Ok(Self {
            stream,
            peer,
            buf: Vec::with_capacity(4 + MAX_GREETING),
            since: Instant::now(),
        })
    }

    /// Reads what has arrived (never more than the greeting): the rank once it is complete,
    /// `None` while it is not, an error for a closed connection or a malformed greeting.
    fn poll(&mut self) -> Result<Option<usize>> {
        loop {
            let want = if self.buf.len() < 4 {
                4
            } else {
                let mut len = [0u8; 4];
                len.copy_from_slice(&self.buf[..4]);
                let n = u32::from_be_bytes(len) as usize;
                if n > MAX_GREETING {
                    return Err(Error::new(
                        ErrorKind::Decode,
                        format!("greeting of {n} bytes is too large"),
                    ));
                }
                4 + n
            };
            if self.buf.len() == want && want > 4 {
                return serde_json::from_slice(&self.buf[4..])
                    .map(Some)
                    .map_err(|e| {
                        Error::new(ErrorKind::Decode, format!("malformed greeting: {e}"))
                    });
            }
            let mut chunk = [0u8; 4 + MAX_GREETING];
            let room = want - self.buf.len();
            match self.stream.read(&mut chunk[..room]) {
                Ok(0) => {
                    return Err(Error::new(
                        ErrorKind::Cancelled,
                        "closed before its greeting",
                    ))
                }
                Ok(k) => self.buf.extend_from_slice(&chunk[..k]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("read a greeting", e)),
            }
        }
    }
}

/// Accepts the `tp` ranks' connections on `listener` until each rank greeted, reading every
/// greeting concurrently (see the [module docs](self)). `check` runs between polls (the
/// barrier's own error wins); past `until` the error is a `Timeout` naming the missing ranks.
pub fn accept_ranks(
    listener: &TcpListener,
    tp: usize,
    until: Instant,
    timeout: Duration,
    mut check: impl FnMut() -> Result<()>,
) -> Result<Vec<RemoteRank>> {
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("configure the engine channel", e))?;
    let mut ranks: Vec<Option<RemoteRank>> = (0..tp).map(|_| None).collect();
    let mut pending: std::collections::VecDeque<Greeting> = std::collections::VecDeque::new();
    while ranks.iter().any(Option::is_none) {
        // At most a pending table's worth of accepts per round, so a flood of connections
        // cannot keep the greetings from being read.
        for _ in 0..MAX_PENDING_GREETINGS {
            match listener.accept() {
                Ok((stream, peer)) => {
                    if pending.len() >= MAX_PENDING_GREETINGS {
                        if let Some(old) = pending.pop_front() {
                            tracing::warn!(peer = %old.peer, "engine channel: too many pending greetings; oldest closed");
                        }
                    }
                    match Greeting::new(stream, peer) {
                        Ok(g) => pending.push_back(g),
                        Err(e) => {
                            tracing::warn!(%peer, error = %e, "engine channel: cannot configure a connection; closed")
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("accept on the engine channel", e)),
            }
        }
        let mut waiting = std::collections::VecDeque::with_capacity(pending.len());
        while let Some(mut g) = pending.pop_front() {
            match g.poll() {
                Ok(Some(rank)) => match ranks.get_mut(rank) {
                    Some(slot @ None) => {
                        g.stream
                            .set_nonblocking(false)
                            .map_err(|e| Error::io("configure the engine channel", e))?;
                        let _ = g.stream.set_nodelay(true);
                        *slot = Some(RemoteRank::new(rank, g.stream));
                    }
                    _ => {
                        tracing::warn!(peer = %g.peer, rank, "engine channel: unexpected rank; closed")
                    }
                },
                Ok(None) if g.since.elapsed() > GREETING_TIMEOUT => {
                    tracing::warn!(peer = %g.peer, "engine channel: no greeting within {GREETING_TIMEOUT:?}; closed");
                }
                Ok(None) => waiting.push_back(g),
                Err(e) => {
                    tracing::warn!(peer = %g.peer, error = %e, "engine channel: bad greeting; closed")
                }
            }
        }
        pending = waiting;
        if ranks.iter().all(Option::is_some) {
            break;
        }
        check()?;
        if Instant::now() > until {
            let missing: Vec<usize> = ranks
                .iter()
                .enumerate()
                .filter(|(_, r)| r.is_none())
                .map(|(i, _)| i)
                .collect();
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "rank(s) {missing:?} did not join within {:.0}s",
                    timeout.as_secs_f64()
                ),
            )
            .with("missing_ranks", format!("{missing:?}")));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(ranks.into_iter().flatten().collect())
}

/// A rank in a child process, reached over the engine channel.
pub struct RemoteRank {
    /// The rank.
    pub rank: usize,
    stream: TcpStream,
}

impl RemoteRank {
    /// Wraps an accepted connection.
    pub fn new(rank: usize, stream: TcpStream) -> Self {
        Self { rank, stream }
    }

    fn call(&mut self, req: &RankRequest) -> Result<RankResponse> {
        write_frame(&mut self.stream, req)?;
        match read_frame::<RankResponse>(&mut self.stream)? {
            RankResponse::Error(e) => Err(Error::new(
                ErrorKind::Internal,
                format!("rank {}: {e}", self.rank),
            )),
            other => Ok(other),
        }
    }
}

fn unexpected(rank: usize) -> Error {
    Error::new(
        ErrorKind::Decode,
        format!("rank {rank} answered out of turn"),
    )
}

impl RankDriver for RemoteRank {
    fn step(&mut self, cmd: &StepCommand) -> Result<StepReply> {
        match self.call(&RankRequest::Step(cmd.clone()))? {
            RankResponse::Step(r) => Ok(r),
            _ => Err(unexpected(self.rank)),
        }
    }
    fn verify(&mut self, v: &Verify) -> Result<usize> {
        match self.call(&RankRequest::Verify(v.clone()))? {
            RankResponse::Verified(n) => Ok(n),
            _ => Err(unexpected(self.rank)),
        }
    }
    fn finish(&mut self) -> Result<RankStats> {
        match self.call(&RankRequest::Finish)? {
            RankResponse::Finished(s) => Ok(s),
            _ => Err(unexpected(self.rank)),
        }
    }
}

/// Serves engine requests on `stream` until the engine closes it or sends `Finish`.
pub fn serve(mut exec: RankExecutor, mut stream: TcpStream) -> Result<()> {
    loop {
        let req: RankRequest = match read_frame(&mut stream) {
            Ok(r) => r,
            Err(e) if e.kind() == ErrorKind::Cancelled => return Ok(()),
            Err(e) => return Err(e),
        };
        let (resp, last) = match req {
            RankRequest::Step(cmd) => (exec.step(&cmd).map(RankResponse::Step), false),
            RankRequest::Verify(v) => (exec.verify(&v).map(RankResponse::Verified), false),
            RankRequest::Finish => (exec.finish().map(RankResponse::Finished), true),
        };
        let resp = resp.unwrap_or_else(|e| RankResponse::Error(e.to_string()));
        write_frame(&mut stream, &resp)?;
        if last {
            return Ok(());
        }
    }
}
