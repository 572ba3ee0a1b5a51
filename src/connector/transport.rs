//! How leader and workers talk outside the engine: the start-up barrier and operation completions.
//!
//! Metadata travels through the engine (leader → workers, once per iteration). Everything else goes
//! over a transport: each worker's `bytes_per_block` and device block count (barrier step 1), the
//! leader's host and disk block counts (step 2), each worker's readiness, then the leader's
//! (step 3), the completion of every operation (so the leader registers stored blocks and
//! releases held ones), and — for
//! engines that may stop building metadata while a finished request is held (TensorRT-LLM) — the
//! work a finished request still needs ([`LeaderMessage::Finish`], ordered after a metadata
//! iteration; see [`FinishWork`]).
//!
//! [`LeaderTransport`] and [`WorkerTransport`] are small object-safe traits; this module ships the
//! in-process implementation ([`in_process`]) over channels. A network transport implements the
//! same traits.

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::connector::metadata::OperationId;
use crate::error::{Error, ErrorKind, Result};
use crate::layout::LayoutDims;

/// Index of a worker (its tensor-parallel rank).
pub type Rank = usize;

/// Barrier step 1: what a worker reports about its registered cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerHello {
    /// The worker's rank.
    pub rank: Rank,
    /// How many ranks the worker believes there are.
    pub world_size: usize,
    /// Bytes of one block of this rank's shard.
    pub bytes_per_block: usize,
    /// Device blocks the engine gave this rank.
    pub num_device_blocks: usize,
    /// Block dimensions of this rank's shard.
    pub dims: LayoutDims,
}

/// Barrier step 2: what the leader tells every worker to allocate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierCounts {
    /// Host (G2) blocks per rank; 0 disables the tier.
    pub num_host_blocks: usize,
    /// Disk (G3) blocks per rank; 0 disables the tier.
    pub num_disk_blocks: usize,
    /// Device blocks the leader schedules with (the minimum over ranks).
    pub num_device_blocks: usize,
}

/// One operation finished on one worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Completion {
    /// The operation.
    pub op: OperationId,
    /// Destination blocks that were not written correctly (empty on success).
    pub failed_dst_blocks: Vec<usize>,
    /// Why, when something failed.
    pub error: Option<String>,
}

/// Worker → leader.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WorkerMessage {
    /// Barrier step 1.
    Hello(WorkerHello),
    /// The worker allocated its tiers and is ready.
    Ready,
    /// The worker could not allocate its tiers.
    Failed(String),
    /// Barrier step 2, before [`WorkerMessage::Ready`]: `(block, key)` pairs its disk tier
    /// already holds (a persisted tier reopened, `disk.persist`), in chunks of at most
    /// [`DISK_INDEX_CHUNK`]. The leader serves a block only when every rank holds its key there.
    DiskIndex(Vec<(usize, u128)>),
    /// Operations finished.
    Completed(Vec<Completion>),
    /// The counters of this rank's remote store (totals since it was built), sent at the end
    /// of an engine iteration when they changed: the leader adds every rank's to its own store's
    /// in the metrics and reports (what a worker's loads and writes saw — values withdrawn,
    /// timeouts, reconnections — is otherwise only in that worker's log).
    StoreStats(crate::connector::remote::RemoteStoreStats),
    /// This worker is closing its connection on purpose (its engine shut down): the leader's
    /// transport then reports the connection's end as [`GOODBYE`], logged as a departure, not
    /// as a lost worker. What it had not reported still counts as failed there, as for any
    /// rank that leaves.
    Goodbye,
    /// The connection to this rank was lost; the text says how (end of stream, I/O error,
    /// undecodable frame). Generated locally by a network transport (see
    /// [`tcp`](crate::tcp)); never sent on the wire: a leader that receives it from a
    /// peer closes that connection. After it, nothing more arrives from this rank's connection.
    Disconnected(String),
}

/// The most `(block, key)` pairs one [`WorkerMessage::DiskIndex`] carries (its frame stays
/// well below the network transport's payload bound).
pub const DISK_INDEX_CHUNK: usize = 65_536;

/// The reason of the [`WorkerMessage::Disconnected`] of a rank that said
/// [`WorkerMessage::Goodbye`] before closing its connection.
pub const GOODBYE: &str =
    "the worker closed its connection after saying goodbye (its engine shut down)";

/// What the leader decided when a request finished (its last stores and the hold on its device
/// blocks), sent to every worker at once instead of with the next metadata, so that it runs even
/// if the engine builds no further metadata (TensorRT-LLM calls only `get_finished` while nothing
/// is scheduled).
///
/// Ordering: `after_iteration` is the iteration of a metadata the leader built before this message
/// and which announced every request the message names (the last metadata built, or the next one
/// when a named request's slot is still queued). A worker applies the message in `get_finished`
/// (the end of an engine iteration) once it has bound a metadata of that iteration or a later one:
/// it never runs an operation for a request before the metadata that announced the request's
/// slot, nor before that iteration's forward pass on this rank wrote the request's last KV.
/// Messages to one worker arrive in the order sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FinishWork {
    /// Apply only after binding the metadata of this iteration (or a later one).
    pub after_iteration: u64,
    /// An encoded [`ConnectorMetadata`](crate::connector::metadata::ConnectorMetadata) holding
    /// the operations and holds of the finished requests only (binary; a JSON array of bytes on
    /// the TCP transport).
    pub metadata: Vec<u8>,
}

/// Leader → worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaderMessage {
    /// Barrier step 2.
    Allocate(TierCounts),
    /// The leader refuses this worker (the reason says why).
    Refused(String),
    /// After start-up: a finished request's last work, outside the metadata ([`FinishWork`]).
    Finish(FinishWork),
    /// Barrier step 3: every rank confirmed its allocation and the leader is ready — sent only
    /// once the leader's own calls see it ready. A worker that starts up blocking (TensorRT-LLM's)
    /// returns from its registration on it, so the engine's first request finds the leader
    /// ready (see [`barrier`](crate::connector::barrier)).
    Ready,
    /// The leader is closing its connection on purpose (it shut down): the worker's transport
    /// then reports the connection's end as [`LEADER_GOODBYE`], logged as a departure, not as a
    /// lost leader. Sent by a network transport as the last message of an orderly close.
    Goodbye,
}

/// Why a worker's connection ended when its leader said [`LeaderMessage::Goodbye`] first.
pub const LEADER_GOODBYE: &str =
    "the leader closed its connection after saying goodbye (it shut down)";

/// The leader's end.
pub trait LeaderTransport: Send + Sync + std::fmt::Debug {
    /// Ranks expected.
    fn world_size(&self) -> usize;
    /// Sends to one rank.
    fn send(&self, rank: Rank, msg: LeaderMessage) -> Result<()>;
    /// Next message from any rank, if one is waiting.
    fn try_recv(&self) -> Result<Option<(Rank, WorkerMessage)>>;
    /// Next message from any rank, waiting up to `timeout`.
    fn recv_timeout(&self, timeout: Duration) -> Result<Option<(Rank, WorkerMessage)>>;
}

/// A worker's end.
pub trait WorkerTransport: Send + Sync + std::fmt::Debug {
    /// This worker's rank.
    fn rank(&self) -> Rank;
    /// Sends to the leader.
    fn send(&self, msg: WorkerMessage) -> Result<()>;
    /// Next message from the leader, waiting up to `timeout`.
    fn recv_timeout(&self, timeout: Duration) -> Result<Option<LeaderMessage>>;
}

fn disconnected(what: &str) -> Error {
    Error::new(
        ErrorKind::Cancelled,
        format!("{what}: the other end is gone"),
    )
}

/// Leader end of the in-process transport.
#[derive(Debug)]
pub struct InProcessLeader {
    rx: Mutex<Receiver<(Rank, WorkerMessage)>>,
    to_workers: Vec<Sender<LeaderMessage>>,
}

/// Worker end of the in-process transport.
#[derive(Debug)]
pub struct InProcessWorker {
    rank: Rank,
    tx: Sender<(Rank, WorkerMessage)>,
    rx: Mutex<Receiver<LeaderMessage>>,
}

/// A leader end and `world_size` worker ends connected by channels.
pub fn in_process(world_size: usize) -> (Arc<InProcessLeader>, Vec<Arc<InProcessWorker>>) {
    let (tx, rx) = channel();
    let mut to_workers = Vec::with_capacity(world_size);
    let mut workers = Vec::with_capacity(world_size);
    for rank in 0..world_size {
        let (wtx, wrx) = channel();
        to_workers.push(wtx);
        workers.push(Arc::new(InProcessWorker {
            rank,
            tx: tx.clone(),
            rx: Mutex::new(wrx),
        }));
    }
    (
        Arc::new(InProcessLeader {
            rx: Mutex::new(rx),
            to_workers,
        }),
        workers,
    )
}

impl LeaderTransport for InProcessLeader {
    fn world_size(&self) -> usize {
        self.to_workers.len()
    }

    fn send(&self, rank: Rank, msg: LeaderMessage) -> Result<()> {
        let tx = self
            .to_workers
            .get(rank)
            .ok_or_else(|| Error::out_of_range("rank", rank, self.to_workers.len()))?;
        tx.send(msg)
            .map_err(|_| disconnected("leader send").with("rank", rank))
    }

    fn try_recv(&self) -> Result<Option<(Rank, WorkerMessage)>> {
        match self.rx.lock().try_recv() {
            Ok(m) => Ok(Some(m)),
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Disconnected) => Err(disconnected("leader receive")),
        }
    }

    fn recv_timeout(&self, timeout: Duration) -> Result<Option<(Rank, WorkerMessage)>> {
        match self.rx.lock().recv_timeout(timeout) {
            Ok(m) => Ok(Some(m)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(disconnected("leader receive")),
        }
    }
}

impl WorkerTransport for InProcessWorker {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn send(&self, msg: WorkerMessage) -> Result<()> {
        self.tx
            .send((self.rank, msg))
            .map_err(|_| disconnected("worker send").with("rank", self.rank))
    }

    fn recv_timeout(&self, timeout: Duration) -> Result<Option<LeaderMessage>> {
        match self.rx.lock().recv_timeout(timeout) {
            Ok(m) => Ok(Some(m)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => {
                Err(disconnected("worker receive").with("rank", self.rank))
            }
        }
    }
}
