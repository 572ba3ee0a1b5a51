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
//!
//! Deadlines: the engine's call to a rank ([`RemoteRank`]) must be answered within the call
//! timeout (`KVBM_CALL_TIMEOUT_SECS`, `tcp.call_timeout_secs`), and fails sooner when the
//! connector's transport lost the rank (its heartbeat timeout); either way the rank's connector
//! connection is dropped too, so the leader treats the rank exactly as a killed worker. A rank
//! waits for the engine's next request, and writes its answer, with no deadline (an engine may
//! idle) but gives up as soon as its connector connection to the leader is lost. The channel has no authentication:
//! it listens on loopback unless `KVBM_ALLOW_INSECURE` says otherwise.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use kvbm_connector::config::CALL_TIMEOUT_ENV;
use kvbm_connector::error::{Error, ErrorKind, Result};
use kvbm_connector::tcp::TcpLeader;

use super::messages::{
    RankDriver, RankRequest, RankResponse, RankStats, StepCommand, StepReply, Verify,
};
use super::rank::RankExecutor;

/// Largest frame on the engine channel.
const MAX_FRAME: usize = 256 << 20;

/// Writes one frame.
pub fn write_frame<T: Serialize>(stream: &mut TcpStream, value: &T) -> Result<()> {
    stream
        .write_all(&encode(value)?)
        .map_err(|e| Error::io("write to the engine channel", e))
}

fn closed(e: std::io::Error) -> Error {
    Error::new(ErrorKind::Cancelled, format!("engine channel closed: {e}"))
}

/// Decodes one frame whose bytes `fill` reads.
fn decode_frame<T: for<'de> Deserialize<'de>>(
    mut fill: impl FnMut(&mut [u8]) -> Result<()>,
) -> Result<T> {
    let mut len = [0u8; 4];
    fill(&mut len)?;
    let n = u32::from_be_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(Error::new(
            ErrorKind::Decode,
            format!("engine frame of {n} bytes is too large"),
        ));
    }
    let mut body = vec![0u8; n];
    fill(&mut body)?;
    serde_json::from_slice(&body)
        .map_err(|e| Error::new(ErrorKind::Decode, format!("malformed engine frame: {e}")))
}

/// How often a bounded wait on the channel looks at its deadline and at the peer's liveness.
const POLL: Duration = Duration::from_millis(100);

/// What a bounded wait gives up on: a deadline (`None`: none) and a liveness check that names
/// why the peer is lost.
struct Bound<'a> {
    /// The deadline, and the timeout it came from (for the message).
    until: Option<(Instant, Duration)>,
    what: &'a str,
    lost: &'a dyn Fn() -> Option<String>,
}

impl Bound<'_> {
    /// The error that ends the wait when the peer is lost.
    fn check_lost(&self) -> Result<()> {
        match (self.lost)() {
            Some(why) => Err(Error::new(
                ErrorKind::Cancelled,
                format!("{}: {why}", self.what),
            )),
            None => Ok(()),
        }
    }

    /// The next slice of waiting, or the deadline's error.
    fn next_wait(&self) -> Result<Duration> {
        let Some((until, timeout)) = self.until else {
            return Ok(POLL);
        };
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "{}: no answer within {:.1}s ({CALL_TIMEOUT_ENV})",
                    self.what,
                    timeout.as_secs_f64()
                ),
            ));
        }
        Ok(left.min(POLL))
    }

    /// Moves `len` bytes with `step` (a read or a write at an offset, under a socket timeout
    /// that `arm` sets to the next slice), keeping partial progress across slices. Whether the
    /// peer is lost is asked only after a slice passed with nothing moved: bytes it sent before
    /// it went (a rank's last answer, written before its connector said goodbye) are read.
    fn transfer(
        &self,
        stream: &mut TcpStream,
        len: usize,
        arm: fn(&TcpStream, Option<Duration>) -> std::io::Result<()>,
        mut step: impl FnMut(&mut TcpStream, usize) -> std::io::Result<usize>,
    ) -> Result<()> {
        let mut done = 0;
        while done < len {
            arm(stream, Some(self.next_wait()?))
                .map_err(|e| Error::io("configure the engine channel", e))?;
            match step(stream, done) {
                Ok(0) => return Err(closed(std::io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => done += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) =>
                {
                    self.check_lost()?
                }
                Err(e) => return Err(closed(e)),
            }
        }
        Ok(())
    }

    /// Fills `buf` from `stream`.
    fn read(&self, stream: &mut TcpStream, buf: &mut [u8]) -> Result<()> {
        let len = buf.len();
        self.transfer(stream, len, TcpStream::set_read_timeout, |s, at| {
            s.read(&mut buf[at..])
        })
    }

    /// Writes all of `bytes` to `stream`.
    fn write(&self, stream: &mut TcpStream, bytes: &[u8]) -> Result<()> {
        self.transfer(
            stream,
            bytes.len(),
            TcpStream::set_write_timeout,
            |s, at| s.write(&bytes[at..]),
        )
    }
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    let body = serde_json::to_vec(value)
        .map_err(|e| Error::internal(format!("cannot encode a frame: {e}")))?;
    let len = u32::try_from(body.len()).map_err(|_| Error::invalid_argument("frame too large"))?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
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
/// Each rank's calls are then bounded by `call_timeout` and tied to `leader`'s view of the rank
/// ([`RemoteRank`]).
pub fn accept_ranks(
    listener: &TcpListener,
    tp: usize,
    until: Instant,
    timeout: Duration,
    leader: &Arc<TcpLeader>,
    call_timeout: Duration,
    mut check: impl FnMut() -> Result<()>,
) -> Result<Vec<RemoteRank>> {
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("configure the engine channel", e))?;
    let mut ranks: Vec<Option<RemoteRank>> = (0..tp).map(|_| None).collect();
    let mut pending: std::collections::VecDeque<Greeting> = std::collections::VecDeque::new();
    while ranks.iter().any(Option::is_none) {
        accept_some(listener, &mut pending)?;
        pending = read_greetings(pending, &mut ranks, leader, call_timeout)?;
        if ranks.iter().all(Option::is_some) {
            break;
        }
        check()?;
        if Instant::now() > until {
            return Err(missing_ranks(&ranks, timeout));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(ranks.into_iter().flatten().collect())
}

/// Accepts the connections waiting on `listener` into `pending`: at most a pending table's
/// worth per round, so a flood of connections cannot keep the greetings from being read; past
/// [`MAX_PENDING_GREETINGS`] the oldest pending connection is closed.
fn accept_some(
    listener: &TcpListener,
    pending: &mut std::collections::VecDeque<Greeting>,
) -> Result<()> {
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
    Ok(())
}

/// Reads what each pending connection sent: a greeting naming a free rank seats that rank
/// (blocking again, no delay, its calls bounded by `call_timeout`); an unexpected rank, a bad
/// greeting or none within [`GREETING_TIMEOUT`] closes the connection. Returns the connections
/// still waiting for their greeting, in order.
fn read_greetings(
    mut pending: std::collections::VecDeque<Greeting>,
    ranks: &mut [Option<RemoteRank>],
    leader: &Arc<TcpLeader>,
    call_timeout: Duration,
) -> Result<std::collections::VecDeque<Greeting>> {
    let mut waiting = std::collections::VecDeque::with_capacity(pending.len());
    while let Some(mut g) = pending.pop_front() {
        match g.poll() {
            Ok(Some(rank)) => match ranks.get_mut(rank) {
                Some(slot @ None) => {
                    g.stream
                        .set_nonblocking(false)
                        .map_err(|e| Error::io("configure the engine channel", e))?;
                    let _ = g.stream.set_nodelay(true);
                    *slot = Some(RemoteRank::new(
                        rank,
                        g.stream,
                        leader.clone(),
                        call_timeout,
                    ));
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
    Ok(waiting)
}

/// The `Timeout` error naming the ranks that did not join within `timeout`.
fn missing_ranks(ranks: &[Option<RemoteRank>], timeout: Duration) -> Error {
    let missing: Vec<usize> = ranks
        .iter()
        .enumerate()
        .filter(|(_, r)| r.is_none())
        .map(|(i, _)| i)
        .collect();
    Error::new(
        ErrorKind::Timeout,
        format!(
            "rank(s) {missing:?} did not join within {:.0}s",
            timeout.as_secs_f64()
        ),
    )
    .with("missing_ranks", format!("{missing:?}"))
}

/// A rank in a child process, reached over the engine channel.
pub struct RemoteRank {
    /// The rank.
    pub rank: usize,
    stream: TcpStream,
    /// The connector's leader transport: a rank it lost is lost here too, and a rank lost here
    /// is dropped there.
    leader: Arc<TcpLeader>,
    /// Deadline of one call.
    timeout: Duration,
}

impl RemoteRank {
    /// Wraps an accepted connection; each call must be answered within `timeout`.
    pub fn new(rank: usize, stream: TcpStream, leader: Arc<TcpLeader>, timeout: Duration) -> Self {
        Self {
            rank,
            stream,
            leader,
            timeout,
        }
    }

    fn call(&mut self, req: &RankRequest) -> Result<RankResponse> {
        let rank = self.rank;
        let answer = self.exchange(req);
        if let Err(e) = &answer {
            // Lost as a killed worker is: the leader fails its operations on this rank.
            self.leader
                .disconnect(rank, &format!("the engine lost rank {rank}: {e}"));
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
        }
        match answer? {
            RankResponse::Error(e) => {
                Err(Error::new(ErrorKind::Internal, format!("rank {rank}: {e}")))
            }
            other => Ok(other),
        }
    }

    fn exchange(&mut self, req: &RankRequest) -> Result<RankResponse> {
        let rank = self.rank;
        let leader = self.leader.clone();
        let lost = move || {
            leader.peer_addr(rank).is_none().then(|| {
                "the connector's transport lost it (heartbeat timeout or disconnect)".to_string()
            })
        };
        let bound = Bound {
            until: Some((Instant::now() + self.timeout, self.timeout)),
            what: &format!("rank {rank}"),
            lost: &lost,
        };
        let frame = encode(req)?;
        bound.write(&mut self.stream, &frame)?;
        let stream = &mut self.stream;
        decode_frame(|buf| bound.read(stream, buf))
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

/// Serves engine requests on `stream` until the engine closes it or sends `Finish`, or `lost`
/// names why the leader is gone (checked while waiting for a request).
pub fn serve(
    mut exec: RankExecutor,
    mut stream: TcpStream,
    lost: &dyn Fn() -> Option<String>,
) -> Result<()> {
    let bound = Bound {
        until: None,
        what: "waiting for the engine",
        lost,
    };
    loop {
        let next = decode_frame(|buf| bound.read(&mut stream, buf));
        let req: RankRequest = match next {
            Ok(r) => r,
            // The engine closed the channel: the run is over. A lost leader is an error.
            Err(e) if e.kind() == ErrorKind::Cancelled && lost().is_none() => return Ok(()),
            Err(e) => return Err(e),
        };
        let (resp, last) = match req {
            RankRequest::Step(cmd) => (exec.step(&cmd).map(RankResponse::Step), false),
            RankRequest::Verify(v) => (exec.verify(&v).map(RankResponse::Verified), false),
            RankRequest::Finish => (exec.finish().map(RankResponse::Finished), true),
        };
        let resp = resp.unwrap_or_else(|e| RankResponse::Error(e.to_string()));
        bound.write(&mut stream, &encode(&resp)?)?;
        if last {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{SocketAddr, TcpListener};

    use kvbm_connector::connector::transport::{LeaderTransport, WorkerMessage};
    use kvbm_connector::tcp::TcpWorker;

    use super::*;

    const LONG: Duration = Duration::from_secs(10);

    /// A connector leader with rank 0 connected, and a rank on the engine channel that never
    /// answers (the accepted end, and the silent peer's end to keep open).
    fn silent_rank(timeout: Duration) -> (RemoteRank, Arc<TcpLeader>, Arc<TcpWorker>, TcpStream) {
        let any: SocketAddr = ([127, 0, 0, 1], 0).into();
        let leader = TcpLeader::bind(any, 1, None).unwrap();
        let worker = TcpWorker::connect(leader.local_addr(), 0, 1, None, LONG).unwrap();
        let engine = TcpListener::bind(any).unwrap();
        let silent = TcpStream::connect(engine.local_addr().unwrap()).unwrap();
        let (accepted, _) = engine.accept().unwrap();
        let rank = RemoteRank::new(0, accepted, leader.clone(), timeout);
        (rank, leader, worker, silent)
    }

    fn disconnected(leader: &TcpLeader) -> Option<String> {
        let end = Instant::now() + LONG;
        while Instant::now() < end {
            if let Some((0, WorkerMessage::Disconnected(why))) =
                leader.recv_timeout(Duration::from_millis(50)).unwrap()
            {
                return Some(why);
            }
        }
        None
    }

    #[test]
    fn a_silent_rank_misses_the_call_deadline_and_is_dropped_from_the_connector() {
        let (mut rank, leader, _worker, _silent) = silent_rank(Duration::from_millis(300));
        let started = Instant::now();
        let e = rank.finish().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert!(e.to_string().contains(CALL_TIMEOUT_ENV), "{e}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        // Lost as a killed worker is: the leader's transport reports it.
        let why = disconnected(&leader).expect("Disconnected for rank 0");
        assert!(why.contains("the engine lost rank 0"), "{why}");
        assert!(leader.connected_ranks().is_empty());
    }

    /// A rank answers `Finish`, then its connector says goodbye (the leader forgets it) before
    /// the engine reads the answer (a busy host): the answer is read, the rank is not lost. The
    /// replay counted such a rank as failed when it asked whether the rank was lost before
    /// reading what had arrived (seen under load in tests/cli.rs).
    #[test]
    fn an_answer_sent_before_the_rank_left_is_read() {
        let (mut rank, leader, worker, mut silent) = silent_rank(Duration::from_secs(60));
        let answer = encode(&RankResponse::Finished(RankStats { paths: Vec::new() })).unwrap();
        silent.write_all(&answer).unwrap();
        worker.close();
        let deadline = Instant::now() + LONG;
        while !leader.connected_ranks().is_empty() {
            assert!(
                Instant::now() < deadline,
                "the leader never saw the rank leave"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let stats = rank.finish().unwrap();
        assert!(stats.paths.is_empty());
    }

    #[test]
    fn a_rank_the_connector_lost_fails_its_call_at_once() {
        let (mut rank, _leader, worker, _silent) = silent_rank(Duration::from_secs(60));
        worker.close();
        let started = Instant::now();
        let e = rank.finish().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Cancelled, "{e}");
        assert!(
            e.to_string().contains("connector's transport lost it"),
            "{e}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }
}
