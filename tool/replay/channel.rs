//! The engine channel: how the simulated engine reaches a rank in a child process (`kvbm
//! worker`). A frame is a u32 big-endian length and a JSON [`RankRequest`] or [`RankResponse`],
//! over loopback TCP. This is the simulated engine's own RPC (what TensorRT-LLM does with MPI and
//! vLLM with its executor); the connector's leader ↔ worker traffic runs over its own transport.

use std::io::{Read, Write};
use std::net::TcpStream;

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
