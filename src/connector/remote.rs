//! The remote (G4) tier: a shared block store beyond this machine (Redis / Valkey, standalone
//! or cluster) that every instance of a deployment looks up, reads and writes.
//!
//! The core knows the store only through the [`RemoteStore`] trait (a storage backend provides
//! it through [`TierFactory::remote_store`](super::worker::TierFactory::remote_store)); every call
//! is bounded by a deadline, and a value is never served unless verified. Around it the core
//! builds:
//!
//! * [`RemoteScope::for_instance`] — the scope both the leader and every worker build from the
//!   same facts (namespace, block dimensions, sharding, key hash), so they agree on keys;
//! * [`RemoteSource`] / [`RemoteSink`] — one load's or one write's view of the store as a
//!   [`StorageTier`], so reads and writes run through the transfer engine like any other copy
//!   (batched: one pipelined `get`/`put` per transfer batch; a missing or invalid value fails
//!   its block only);
//! * [`LookupThread`] — the leader's background lookups (the engine never waits for the store
//!   when it can be asked again later);
//! * [`StoreHealth`] (`store_health.rs`) — the store's verdict (healthy, slow, unavailable) from
//!   its recent calls, which takes a slow or failing store out of the path;
//! * [`MemoryRemoteStore`] — an in-process store with injectable faults (down, slow, invalid
//!   values): the test double of the trait.
//!
//! Correctness never depends on a lookup: the store may evict a value between a lookup and the
//! read, and a value may have been planted or damaged; the read then fails that block (a load
//! error the engine recomputes), it never serves wrong bytes.

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::config::Config;
use crate::error::{Error, ErrorKind, Result};
use crate::identity::HashAlgorithm;
use crate::layout::{KvLayout, Layout, LayoutDims};
use crate::tier::{BatchCopy, Capability, StorageTier, TierKind};

pub use super::store_health::{log_state_change, CallKind, CallOutcome, StoreHealth, StoreState};

/// Width of the block keys the scope covers, in bits.
pub const KEY_BITS: u32 = 128;

/// What a [`RemoteStore`]'s values belong to: two instances share blocks through a store only
/// when their scopes are equal (same model and layout, same sharding, same keys).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RemoteScope {
    /// Fingerprint of everything that makes two instances' blocks interchangeable (model and
    /// layout description, page size, one rank's bytes per block, world size, key hash and
    /// width), as lowercase hex; built by [`RemoteScope::new`]. Stores put it in their keys.
    pub fingerprint: String,
    /// Tensor-parallel size: every block is stored as one value per rank.
    pub world_size: usize,
    /// Bytes of one rank's share of a block (the length of every value's payload).
    pub bytes_per_block: usize,
}

impl RemoteScope {
    /// The scope of an instance as the leader and every worker build it: the namespace
    /// (`remote.namespace`), one rank's block dimensions `dims`, `world_size` ranks of
    /// `bytes_per_block` bytes each, and the configured key hash.
    pub fn for_instance(
        config: &Config,
        dims: &LayoutDims,
        world_size: usize,
        bytes_per_block: usize,
    ) -> Result<Self> {
        let description = format!(
            "kvbm-v1;ns={:?};layers={};outer={};page={};inner={};dtype={}",
            config.remote.namespace.as_deref().unwrap_or(""),
            dims.num_layers,
            dims.outer_dim,
            dims.page_size,
            dims.inner_dim,
            dims.dtype_bytes
        );
        Self::new(
            &description,
            dims.page_size,
            world_size,
            bytes_per_block,
            config.hash,
        )
    }

    /// The scope of an instance: `description` names the model and layout (anything whose
    /// change makes blocks incompatible: dtype, layers, heads, head size, block order).
    pub fn new(
        description: &str,
        page_size: usize,
        world_size: usize,
        bytes_per_block: usize,
        hash: HashAlgorithm,
    ) -> Result<Self> {
        if world_size == 0 || page_size == 0 || bytes_per_block == 0 {
            return Err(Error::invalid_argument(format!(
                "remote scope needs a non-zero world size ({world_size}), page size \
                 ({page_size}) and bytes per block ({bytes_per_block})"
            )));
        }
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for part in [
            description.as_bytes(),
            &(page_size as u64).to_le_bytes(),
            &(world_size as u64).to_le_bytes(),
            &(bytes_per_block as u64).to_le_bytes(),
            format!("{hash:?}").as_bytes(),
            &KEY_BITS.to_le_bytes(),
        ] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part);
        }
        let digest = h.finalize();
        let fingerprint = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        Ok(Self {
            fingerprint,
            world_size,
            bytes_per_block,
        })
    }
}

/// How one block of a [`RemoteStore::get`] turned out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteRead {
    /// Read and verified (key, length, checksum, and MAC when a secret is configured); the
    /// destination holds the block.
    Hit,
    /// Not in the store (never written, or evicted / expired): a miss, the engine recomputes.
    Missing,
    /// A value was there but failed verification (wrong key, truncated, bad checksum or MAC):
    /// never served; the reason names what was wrong.
    Invalid(String),
}

/// What a [`RemoteStore::put`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemotePut {
    /// Values written.
    pub written: usize,
    /// Values already present, not rewritten.
    pub present: usize,
}

/// Counters of a [`RemoteStore`] for metrics and reports (totals since the store was built).
/// Each worker sends its store's to the leader when they change
/// ([`WorkerMessage::StoreStats`](crate::connector::transport::WorkerMessage::StoreStats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RemoteStoreStats {
    /// Whether the store answered its last call (false while it is down / reconnecting).
    pub available: bool,
    /// Calls that failed (connection refused or lost, server error).
    pub errors: u64,
    /// Calls that missed their deadline.
    pub timeouts: u64,
    /// Successful reconnections after a failure.
    pub reconnects: u64,
    /// Values that failed verification on read.
    pub invalid: u64,
}

impl RemoteStoreStats {
    /// The counters of `self` and `other` added (`available`: both answered).
    pub fn plus(self, other: RemoteStoreStats) -> RemoteStoreStats {
        RemoteStoreStats {
            available: self.available && other.available,
            errors: self.errors.saturating_add(other.errors),
            timeouts: self.timeouts.saturating_add(other.timeouts),
            reconnects: self.reconnects.saturating_add(other.reconnects),
            invalid: self.invalid.saturating_add(other.invalid),
        }
    }
}

/// A shared block store beyond this machine (the G4 tier), as a storage backend provides it
/// (e.g. Redis / Valkey). Keys are 128-bit block keys ([`SequenceHash`](crate::identity::SequenceHash)`.0`); the store scopes
/// them by its [`RemoteScope`] and by rank. Every call is bounded by `deadline`: a store that is
/// down or slow answers [`crate::ErrorKind::Timeout`] or another error, never hangs, and
/// reconnects in the background. A value is never served unless verified.
pub trait RemoteStore: Send + Sync + std::fmt::Debug {
    /// Where it is, for logs and metrics (no password or secret).
    fn describe(&self) -> String;

    /// The scope it was built for.
    fn scope(&self) -> &RemoteScope;

    /// Leader: how many of `keys`, from the first, the store holds for every one of the scope's
    /// ranks (stops at the first key missing for any rank). An error (timeout, unreachable)
    /// is for the caller to count as a miss.
    fn lookup_prefix(&self, keys: &[u128], deadline: std::time::Instant) -> Result<usize>;

    /// Worker `rank`: reads each of `keys` into the matching buffer of `dst` (each exactly
    /// [`RemoteScope::bytes_per_block`] long), one pipelined batch. One outcome per key; an error
    /// means the whole batch failed (nothing in `dst` may be used).
    fn get(
        &self,
        rank: usize,
        keys: &[u128],
        dst: &mut [&mut [u8]],
        deadline: std::time::Instant,
    ) -> Result<Vec<RemoteRead>>;

    /// Worker `rank`: stores each `(key, bytes)` (bytes exactly `bytes_per_block` long) unless
    /// already present, one pipelined batch.
    fn put(
        &self,
        rank: usize,
        blocks: &[(u128, &[u8])],
        deadline: std::time::Instant,
    ) -> Result<RemotePut>;

    /// Its counters.
    fn stats(&self) -> RemoteStoreStats;
}

/// The error of a block a [`RemoteStore::get`] did not serve.
fn read_error(key: u128, outcome: &RemoteRead) -> Error {
    let e = match outcome {
        RemoteRead::Missing => Error::new(
            ErrorKind::NotFound,
            "block not in the remote store (never written, evicted or expired)",
        ),
        RemoteRead::Invalid(why) => Error::new(
            ErrorKind::Corrupt,
            format!("remote value failed verification: {why}"),
        ),
        RemoteRead::Hit => Error::internal("a hit reported as a failure"),
    };
    e.with("tier", TierKind::Remote)
        .with("key", format!("{key:032x}"))
}

fn remote_capability() -> Capability {
    Capability {
        host_addressable: false,
        direct_io_alignment: 1,
        checksummed: true,
        max_in_flight: 4,
    }
}

/// One load's view of the store: block `k` of this tier is `keys[k]` of rank `rank`. Reads go
/// through the store's pipelined [`RemoteStore::get`], one batch per transfer batch (its
/// [`BatchCopy::copy_to`]), all bounded by one deadline, `budget` after the load was created (the
/// worker passes `remote.load_timeout_ms` and creates it when the engine submits the load): a
/// load queued behind others on a stalled connection fails when its own budget is spent, not a
/// budget after its turn came (loads that timed out one after another, 500 ms each, had
/// delayed the last of them by 1.5 s). A block that is missing or fails
/// verification fails alone (never written to the destination). Writes are refused.
#[derive(Debug)]
pub struct RemoteSource {
    store: Arc<dyn RemoteStore>,
    rank: usize,
    keys: Vec<u128>,
    layout: Layout,
    deadline: Instant,
}

/// The layout of `n` values of `store` for a rank whose blocks have dimensions `dims`: refused
/// when the store's values are not exactly one such block.
fn value_layout(store: &dyn RemoteStore, dims: LayoutDims, n: usize) -> Result<Layout> {
    let layout = Layout::fully_contiguous(dims, n)?;
    let want = store.scope().bytes_per_block;
    if layout.bytes_per_block() != want {
        return Err(Error::invalid_layout(format!(
            "remote values hold {want} bytes but this rank's blocks are {}",
            layout.bytes_per_block()
        )));
    }
    Ok(layout)
}

impl RemoteSource {
    /// The source of a load of `keys` for worker `rank`, whose blocks have dimensions `dims`;
    /// its reads end by `budget` from now.
    pub fn new(
        store: Arc<dyn RemoteStore>,
        rank: usize,
        keys: Vec<u128>,
        dims: LayoutDims,
        budget: Duration,
    ) -> Result<Self> {
        let layout = value_layout(store.as_ref(), dims, keys.len())?;
        Ok(Self {
            store,
            rank,
            keys,
            layout,
            deadline: Instant::now() + budget,
        })
    }

    /// Reads `blocks` (indices into the keys) in one batch: one buffer or error per block.
    fn fetch(&self, blocks: &[usize]) -> Vec<Result<Vec<u8>>> {
        let bpb = self.layout.bytes_per_block();
        let mut keys = Vec::with_capacity(blocks.len());
        for &b in blocks {
            match self.keys.get(b) {
                Some(k) => keys.push(*k),
                None => {
                    let e = Error::out_of_range("block", b, self.keys.len())
                        .with("tier", TierKind::Remote);
                    return blocks.iter().map(|_| Err(e.clone())).collect();
                }
            }
        }
        let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; bpb]).collect();
        let outcome = {
            let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            self.store.get(self.rank, &keys, &mut dst, self.deadline)
        };
        match outcome {
            Ok(reads) if reads.len() == keys.len() => bufs
                .into_iter()
                .zip(reads.iter().zip(&keys))
                .map(|(buf, (r, k))| match r {
                    RemoteRead::Hit => Ok(buf),
                    other => Err(read_error(*k, other)),
                })
                .collect(),
            Ok(reads) => {
                let e = Error::internal(format!(
                    "the remote store answered {} outcomes for {} keys",
                    reads.len(),
                    keys.len()
                ));
                keys.iter().map(|_| Err(e.clone())).collect()
            }
            Err(e) => keys.iter().map(|_| Err(e.clone())).collect(),
        }
    }
}

impl StorageTier for RemoteSource {
    fn kind(&self) -> TierKind {
        TierKind::Remote
    }
    fn capability(&self) -> Capability {
        remote_capability()
    }
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        let len = crate::tier::total_len(dst);
        crate::tier::check_io(
            TierKind::Remote,
            "read",
            block,
            self.keys.len(),
            len,
            self.layout.bytes_per_block(),
        )?;
        let buf = self
            .fetch(&[block])
            .pop()
            .unwrap_or_else(|| Err(Error::internal("the remote store answered nothing")))?;
        crate::tier::copy_segments(&[IoSlice::new(&buf)], dst);
        Ok(())
    }
    fn write_block(&self, block: usize, _src: &[IoSlice<'_>]) -> Result<()> {
        Err(Error::unsupported("a remote load's source is read-only")
            .with("tier", TierKind::Remote)
            .with("block", block))
    }
    fn batch_copy(&self) -> Option<&dyn BatchCopy> {
        Some(self)
    }
}

impl BatchCopy for RemoteSource {
    fn copy_to(&self, dst: &dyn StorageTier, pairs: &[(usize, usize)]) -> Option<Vec<Result<()>>> {
        let blocks: Vec<usize> = pairs.iter().map(|p| p.0).collect();
        let bufs = self.fetch(&blocks);
        Some(
            bufs.into_iter()
                .zip(pairs)
                .map(|(buf, &(_, d))| dst.write_block(d, &[IoSlice::new(&buf?)]))
                .collect(),
        )
    }

    fn copy_from(
        &self,
        _src: &dyn StorageTier,
        _pairs: &[(usize, usize)],
    ) -> Option<Vec<Result<()>>> {
        None
    }
}

/// One write's view of the store: block `k` of this tier is `keys[k]` of rank `rank`. Writes go
/// through the store's pipelined [`RemoteStore::put`] (a value already present is not
/// rewritten), one batch per transfer batch, each bounded by `io_timeout`. Reads are refused.
#[derive(Debug)]
pub struct RemoteSink {
    store: Arc<dyn RemoteStore>,
    rank: usize,
    keys: Vec<u128>,
    layout: Layout,
    io_timeout: Duration,
    written: AtomicU64,
    present: AtomicU64,
}

impl RemoteSink {
    /// The destination of a write of `keys` by worker `rank`, whose blocks have dimensions
    /// `dims`.
    pub fn new(
        store: Arc<dyn RemoteStore>,
        rank: usize,
        keys: Vec<u128>,
        dims: LayoutDims,
        io_timeout: Duration,
    ) -> Result<Self> {
        let layout = value_layout(store.as_ref(), dims, keys.len())?;
        Ok(Self {
            store,
            rank,
            keys,
            layout,
            io_timeout,
            written: AtomicU64::new(0),
            present: AtomicU64::new(0),
        })
    }

    /// Values written and values found already present so far.
    pub fn counts(&self) -> RemotePut {
        RemotePut {
            written: self.written.load(Ordering::Relaxed) as usize,
            present: self.present.load(Ordering::Relaxed) as usize,
        }
    }

    fn put_batch(&self, blocks: &[(usize, Vec<u8>)]) -> Result<()> {
        let mut batch = Vec::with_capacity(blocks.len());
        for (b, bytes) in blocks {
            let key = self.keys.get(*b).ok_or_else(|| {
                Error::out_of_range("block", *b, self.keys.len()).with("tier", TierKind::Remote)
            })?;
            batch.push((*key, bytes.as_slice()));
        }
        let done = self
            .store
            .put(self.rank, &batch, Instant::now() + self.io_timeout)?;
        self.written
            .fetch_add(done.written as u64, Ordering::Relaxed);
        self.present
            .fetch_add(done.present as u64, Ordering::Relaxed);
        Ok(())
    }
}

impl StorageTier for RemoteSink {
    fn kind(&self) -> TierKind {
        TierKind::Remote
    }
    fn capability(&self) -> Capability {
        remote_capability()
    }
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn read_block(&self, block: usize, _dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        Err(
            Error::unsupported("a remote write's destination is write-only")
                .with("tier", TierKind::Remote)
                .with("block", block),
        )
    }
    fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> Result<()> {
        let len = crate::tier::total_len(src);
        crate::tier::check_io(
            TierKind::Remote,
            "write",
            block,
            self.keys.len(),
            len,
            self.layout.bytes_per_block(),
        )?;
        let bytes: Vec<u8> = src.iter().flat_map(|s| s.iter().copied()).collect();
        self.put_batch(&[(block, bytes)])
    }
    fn batch_copy(&self) -> Option<&dyn BatchCopy> {
        Some(self)
    }
}

impl BatchCopy for RemoteSink {
    fn copy_to(
        &self,
        _dst: &dyn StorageTier,
        _pairs: &[(usize, usize)],
    ) -> Option<Vec<Result<()>>> {
        None
    }

    fn copy_from(
        &self,
        src: &dyn StorageTier,
        pairs: &[(usize, usize)],
    ) -> Option<Vec<Result<()>>> {
        let bpb = self.layout.bytes_per_block();
        let mut results: Vec<Result<()>> = Vec::with_capacity(pairs.len());
        let mut batch = Vec::with_capacity(pairs.len());
        let mut slots = Vec::with_capacity(pairs.len());
        for (i, &(s, d)) in pairs.iter().enumerate() {
            let mut buf = vec![0u8; bpb];
            match src.read_block(s, &mut [IoSliceMut::new(&mut buf)]) {
                Ok(()) => {
                    batch.push((d, buf));
                    slots.push(i);
                    results.push(Ok(()));
                }
                Err(e) => results.push(Err(e)),
            }
        }
        if !batch.is_empty() {
            if let Err(e) = self.put_batch(&batch) {
                for i in slots {
                    results[i] = Err(e.clone());
                }
            }
        }
        Some(results)
    }
}

/// A lookup the leader asked [`LookupThread`] for.
#[derive(Debug)]
struct LookupJob {
    /// Who asked (the request's id and the index of its first key), echoed in the answer.
    tag: (String, usize),
    keys: Vec<u128>,
    /// The store call's deadline, from when it starts.
    within: Duration,
}

/// How a background lookup turned out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LookupOutcome {
    /// The store holds this many of the keys, from the first.
    Found(usize),
    /// The store did not answer in time (a miss).
    Timeout,
    /// The store failed (a miss); the error says why.
    Failed(String),
    /// Not asked: the store is out of the lookup path (slow or unavailable, see
    /// [`StoreHealth`]; a miss).
    Skipped,
}

/// The leader's lookups: one thread that runs [`RemoteStore::lookup_prefix`] for the jobs it
/// is given, each bounded by its own deadline, and keeps the answers until taken. The
/// scheduler's thread queues a job and later takes its answer ([`LookupThread::take`]: never
/// waits), or waits for it up to a deadline of its own ([`LookupThread::wait`]: an engine that
/// must answer at once); a store that misbehaves past its deadline delays only this thread.
/// Every call's latency and outcome go to the store's [`StoreHealth`]; while that takes the
/// store out of the path, jobs are answered [`LookupOutcome::Skipped`] without asking it, so a
/// store that is down or slow costs the scheduler nothing. Jobs queue at most
/// [`LookupThread::MAX_QUEUED`] deep (beyond: refused, a miss).
#[derive(Debug)]
pub struct LookupThread {
    shared: Arc<LookupShared>,
    health: Arc<StoreHealth>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Debug, Default)]
struct LookupQueue {
    jobs: std::collections::VecDeque<LookupJob>,
    done: HashMap<(String, usize), LookupOutcome>,
    /// Jobs whose waiter gave up while they ran: their answers are dropped.
    abandoned: std::collections::HashSet<(String, usize)>,
    stop: bool,
}

#[derive(Debug, Default)]
struct LookupShared {
    queue: Mutex<LookupQueue>,
    wake: Condvar,
    answered: Condvar,
}

impl LookupThread {
    /// Most jobs waiting at once.
    pub const MAX_QUEUED: usize = 1024;
    /// Most answers kept untaken (all are dropped beyond it).
    const MAX_DONE: usize = 4096;

    /// Starts the thread; its calls inform `health`, which also decides whether they are made.
    pub fn start(store: Arc<dyn RemoteStore>, health: Arc<StoreHealth>) -> Result<Self> {
        let shared = Arc::new(LookupShared::default());
        let s = shared.clone();
        let h = health.clone();
        let name = store.describe();
        let thread = std::thread::Builder::new()
            .name("kvbm-remote-lookup".into())
            .spawn(move || loop {
                let (job, down) = {
                    let mut q = s.queue.lock();
                    loop {
                        if q.stop {
                            return;
                        }
                        if let Some(j) = q.jobs.pop_front() {
                            break (j, !h.in_path());
                        }
                        s.wake.wait(&mut q);
                    }
                };
                let outcome = if down {
                    LookupOutcome::Skipped
                } else {
                    let began = Instant::now();
                    let outcome = match store.lookup_prefix(&job.keys, Instant::now() + job.within)
                    {
                        Ok(n) => LookupOutcome::Found(n.min(job.keys.len())),
                        Err(e) if e.kind() == ErrorKind::Timeout => LookupOutcome::Timeout,
                        Err(e) => LookupOutcome::Failed(e.to_string()),
                    };
                    let call = match outcome {
                        LookupOutcome::Found(_) => CallOutcome::Answered,
                        _ => CallOutcome::Failed,
                    };
                    if let Some((from, to)) = h.record(CallKind::Lookup, began.elapsed(), call) {
                        log_state_change(&name, from, to, h.slow());
                    }
                    outcome
                };
                let mut q = s.queue.lock();
                if q.done.len() >= Self::MAX_DONE {
                    q.done.clear();
                }
                if !q.abandoned.remove(&job.tag) {
                    q.done.insert(job.tag, outcome);
                }
                s.answered.notify_all();
            })
            .map_err(|e| Error::io("start the remote lookup thread", e))?;
        Ok(Self {
            shared,
            health,
            thread: Some(thread),
        })
    }

    /// Queues a lookup of `keys` for `(request, first)`, whose store call gets `within`; false
    /// when the queue is full (nothing queued).
    pub fn submit(&self, request: &str, first: usize, keys: Vec<u128>, within: Duration) -> bool {
        let mut q = self.shared.queue.lock();
        if q.jobs.len() >= Self::MAX_QUEUED {
            return false;
        }
        let tag = (request.to_owned(), first);
        q.done.remove(&tag);
        q.abandoned.remove(&tag);
        q.jobs.push_back(LookupJob { tag, keys, within });
        self.shared.wake.notify_one();
        true
    }

    /// The answer for `(request, first)`, if it arrived (taken: a second call answers `None`).
    pub fn take(&self, request: &str, first: usize) -> Option<LookupOutcome> {
        self.shared
            .queue
            .lock()
            .done
            .remove(&(request.to_owned(), first))
    }

    /// Waits until the answer for `(request, first)` arrived or `deadline` passed; takes it.
    /// `None` past the deadline (the job is withdrawn if it has not started).
    pub fn wait(&self, request: &str, first: usize, deadline: Instant) -> Option<LookupOutcome> {
        let tag = (request.to_owned(), first);
        let mut q = self.shared.queue.lock();
        loop {
            if let Some(o) = q.done.remove(&tag) {
                return Some(o);
            }
            if self
                .shared
                .answered
                .wait_until(&mut q, deadline)
                .timed_out()
            {
                if let Some(o) = q.done.remove(&tag) {
                    return Some(o);
                }
                let queued = q.jobs.len();
                q.jobs.retain(|j| j.tag != tag);
                if q.jobs.len() == queued {
                    // Running now: its answer is dropped when it comes.
                    if q.abandoned.len() >= Self::MAX_DONE {
                        q.abandoned.clear();
                    }
                    q.abandoned.insert(tag);
                }
                return None;
            }
        }
    }

    /// Withdraws the job of `(request, first)` if it has not started; drops its answer when it
    /// comes if it has (the waiter went on without it).
    pub fn abandon(&self, request: &str, first: usize) {
        let tag = (request.to_owned(), first);
        let mut q = self.shared.queue.lock();
        if q.done.remove(&tag).is_some() {
            return;
        }
        let queued = q.jobs.len();
        q.jobs.retain(|j| j.tag != tag);
        if q.jobs.len() == queued {
            if q.abandoned.len() >= Self::MAX_DONE {
                q.abandoned.clear();
            }
            q.abandoned.insert(tag);
        }
    }

    /// The store's health, which these lookups inform.
    pub fn health(&self) -> &Arc<StoreHealth> {
        &self.health
    }

    /// Forgets `request`'s answers and queued jobs (it finished).
    pub fn forget(&self, request: &str) {
        let mut q = self.shared.queue.lock();
        q.jobs.retain(|j| j.tag.0 != request);
        q.done.retain(|k, _| k.0 != request);
        q.abandoned.retain(|k| k.0 != request);
    }
}

impl Drop for LookupThread {
    fn drop(&mut self) {
        self.shared.queue.lock().stop = true;
        self.shared.wake.notify_all();
        // A lookup stuck in the store is bounded by its deadline; it is not waited for here.
        drop(self.thread.take());
    }
}

/// Faults a [`MemoryRemoteStore`] injects (each can be changed while it runs).
#[derive(Debug, Default)]
pub struct MemoryFaults {
    /// Every call fails at once (connection refused) while set.
    pub down: AtomicBool,
    /// Every call first sleeps this many milliseconds (0: none), then answers
    /// [`ErrorKind::Timeout`] if that passed its deadline.
    pub delay_ms: AtomicU64,
    /// Reads of stored values answer [`RemoteRead::Invalid`] while set (a planted or damaged
    /// value).
    pub invalid: AtomicBool,
}

/// An in-process [`RemoteStore`]: values in a map under `(scope, rank, key)`, with injectable
/// [`MemoryFaults`]. Cloning the `Arc` of its map lets several instances (in one process)
/// share one store, as instances share a Redis. The test double of the trait; also what
/// `kvbm replay` uses for `--remote-url memory://`.
#[derive(Debug, Clone)]
pub struct MemoryRemoteStore {
    scope: RemoteScope,
    data: MemoryRemoteData,
    /// The faults in effect.
    pub faults: Arc<MemoryFaults>,
    counters: Arc<MemoryCounters>,
}

#[derive(Debug, Default)]
struct MemoryCounters {
    errors: AtomicU64,
    timeouts: AtomicU64,
    invalid: AtomicU64,
    available: AtomicBool,
    gets: AtomicU64,
    puts: AtomicU64,
    lookups: AtomicU64,
}

/// The values of [`MemoryRemoteStore`]s that share them.
pub type MemoryRemoteData = Arc<Mutex<HashMap<(String, usize, u128), Vec<u8>>>>;

impl MemoryRemoteStore {
    /// An empty store for `scope`.
    pub fn new(scope: RemoteScope) -> Self {
        Self::shared(scope, MemoryRemoteData::default(), Arc::default())
    }

    /// A store for `scope` over `data` (shared with other stores) and `faults`.
    pub fn shared(scope: RemoteScope, data: MemoryRemoteData, faults: Arc<MemoryFaults>) -> Self {
        let counters = Arc::new(MemoryCounters::default());
        counters.available.store(true, Ordering::Relaxed);
        Self {
            scope,
            data,
            faults,
            counters,
        }
    }

    /// Values held (all scopes and ranks).
    pub fn len(&self) -> usize {
        self.data.lock().len()
    }

    /// True when it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `(lookups, gets, puts)` calls so far.
    pub fn calls(&self) -> (u64, u64, u64) {
        (
            self.counters.lookups.load(Ordering::Relaxed),
            self.counters.gets.load(Ordering::Relaxed),
            self.counters.puts.load(Ordering::Relaxed),
        )
    }

    /// Replaces the value of `key` for `rank` (tests: plant a value).
    pub fn plant(&self, rank: usize, key: u128, bytes: Vec<u8>) {
        self.data
            .lock()
            .insert((self.scope.fingerprint.clone(), rank, key), bytes);
    }

    /// Empties the store (a restarted server).
    pub fn clear(&self) {
        self.data.lock().clear();
    }

    /// Applies the faults before a call: down, then the delay against `deadline`.
    fn enter(&self, deadline: Instant) -> Result<()> {
        if self.faults.down.load(Ordering::Relaxed) {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            self.counters.available.store(false, Ordering::Relaxed);
            return Err(Error::io(
                "reach the remote store",
                std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
            ));
        }
        let delay = self.faults.delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            let now = Instant::now();
            let wait = Duration::from_millis(delay);
            if now + wait > deadline {
                std::thread::sleep(deadline.saturating_duration_since(now));
                self.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                return Err(Error::new(
                    ErrorKind::Timeout,
                    "the remote store did not answer before the deadline",
                ));
            }
            std::thread::sleep(wait);
        }
        self.counters.available.store(true, Ordering::Relaxed);
        Ok(())
    }
}

impl RemoteStore for MemoryRemoteStore {
    fn describe(&self) -> String {
        "memory".to_string()
    }

    fn scope(&self) -> &RemoteScope {
        &self.scope
    }

    fn lookup_prefix(&self, keys: &[u128], deadline: Instant) -> Result<usize> {
        self.counters.lookups.fetch_add(1, Ordering::Relaxed);
        self.enter(deadline)?;
        let data = self.data.lock();
        let fp = &self.scope.fingerprint;
        Ok(keys
            .iter()
            .take_while(|k| {
                (0..self.scope.world_size).all(|r| data.contains_key(&(fp.clone(), r, **k)))
            })
            .count())
    }

    fn get(
        &self,
        rank: usize,
        keys: &[u128],
        dst: &mut [&mut [u8]],
        deadline: Instant,
    ) -> Result<Vec<RemoteRead>> {
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        if keys.len() != dst.len() {
            return Err(Error::invalid_argument(format!(
                "{} keys but {} buffers",
                keys.len(),
                dst.len()
            )));
        }
        self.enter(deadline)?;
        let data = self.data.lock();
        let invalid = self.faults.invalid.load(Ordering::Relaxed);
        let mut out = Vec::with_capacity(keys.len());
        for (k, buf) in keys.iter().zip(dst.iter_mut()) {
            match data.get(&(self.scope.fingerprint.clone(), rank, *k)) {
                None => out.push(RemoteRead::Missing),
                Some(_) if invalid => {
                    self.counters.invalid.fetch_add(1, Ordering::Relaxed);
                    out.push(RemoteRead::Invalid("checksum mismatch (injected)".into()));
                }
                Some(v) if v.len() != buf.len() => {
                    self.counters.invalid.fetch_add(1, Ordering::Relaxed);
                    out.push(RemoteRead::Invalid(format!(
                        "value holds {} bytes, expected {}",
                        v.len(),
                        buf.len()
                    )));
                }
                Some(v) => {
                    buf.copy_from_slice(v);
                    out.push(RemoteRead::Hit);
                }
            }
        }
        Ok(out)
    }

    fn put(&self, rank: usize, blocks: &[(u128, &[u8])], deadline: Instant) -> Result<RemotePut> {
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        self.enter(deadline)?;
        let mut data = self.data.lock();
        let mut done = RemotePut::default();
        for (k, bytes) in blocks {
            if bytes.len() != self.scope.bytes_per_block {
                return Err(Error::invalid_argument(format!(
                    "a value of {} bytes for blocks of {}",
                    bytes.len(),
                    self.scope.bytes_per_block
                )));
            }
            let e = data.entry((self.scope.fingerprint.clone(), rank, *k));
            match e {
                std::collections::hash_map::Entry::Occupied(_) => done.present += 1,
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(bytes.to_vec());
                    done.written += 1;
                }
            }
        }
        Ok(done)
    }

    fn stats(&self) -> RemoteStoreStats {
        RemoteStoreStats {
            available: self.counters.available.load(Ordering::Relaxed),
            errors: self.counters.errors.load(Ordering::Relaxed),
            timeouts: self.counters.timeouts.load(Ordering::Relaxed),
            reconnects: 0,
            invalid: self.counters.invalid.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims() -> LayoutDims {
        LayoutDims {
            num_layers: 2,
            outer_dim: 2,
            page_size: 4,
            inner_dim: 8,
            dtype_bytes: 2,
        }
    }

    fn store() -> MemoryRemoteStore {
        let config = Config::default();
        let d = dims();
        let scope = RemoteScope::for_instance(&config, &d, 1, d.bytes_per_block()).unwrap();
        MemoryRemoteStore::new(scope)
    }

    const IO: Duration = Duration::from_secs(2);

    #[test]
    fn scopes_differ_by_namespace_shape_sharding_and_hash() {
        let d = dims();
        let base = Config::default();
        let a = RemoteScope::for_instance(&base, &d, 1, d.bytes_per_block()).unwrap();
        assert_eq!(
            a,
            RemoteScope::for_instance(&base, &d, 1, d.bytes_per_block()).unwrap()
        );
        let mut ns = base.clone();
        ns.remote.namespace = Some("other-model".into());
        let mut xxh = base.clone();
        xxh.hash = HashAlgorithm::Xxh3;
        let mut wider = d;
        wider.inner_dim = 16;
        for other in [
            RemoteScope::for_instance(&ns, &d, 1, d.bytes_per_block()).unwrap(),
            RemoteScope::for_instance(&xxh, &d, 1, d.bytes_per_block()).unwrap(),
            RemoteScope::for_instance(&base, &d, 2, d.bytes_per_block()).unwrap(),
            RemoteScope::for_instance(&base, &wider, 1, wider.bytes_per_block()).unwrap(),
        ] {
            assert_ne!(a.fingerprint, other.fingerprint);
        }
        assert!(RemoteScope::new("x", 4, 0, 8, HashAlgorithm::Sha256).is_err());
    }

    #[test]
    fn lookups_answer_later_wait_up_to_a_deadline_and_back_off() {
        let s = Arc::new(store());
        s.plant(0, 1, vec![0; 1]);
        s.plant(0, 2, vec![0; 1]);
        let health = Arc::new(StoreHealth::new(
            Duration::from_millis(20),
            Duration::from_millis(50),
        ));
        let t = LookupThread::start(s.clone(), health).unwrap();
        // Asked, then answered later (taken once).
        assert!(t.submit("r", 0, vec![1, 2, 3], IO));
        let deadline = Instant::now() + IO;
        let mut got = None;
        while got.is_none() && Instant::now() < deadline {
            got = t.take("r", 0);
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(got, Some(LookupOutcome::Found(2)));
        assert_eq!(t.take("r", 0), None);
        // Waited for: within the deadline.
        assert!(t.submit("r", 5, vec![3, 1], IO));
        assert_eq!(
            t.wait("r", 5, Instant::now() + IO),
            Some(LookupOutcome::Found(0))
        );
        // A slow store: the wait ends at its own deadline; its answer, when it comes, is dropped.
        s.faults.delay_ms.store(30, Ordering::Relaxed);
        assert!(t.submit("q", 0, vec![1], IO));
        let start = Instant::now();
        assert_eq!(t.wait("q", 0, start + Duration::from_millis(5)), None);
        assert!(start.elapsed() < Duration::from_millis(25));
        assert_eq!(
            t.wait("q", 0, Instant::now() + Duration::from_millis(100)),
            None,
            "an abandoned answer is dropped"
        );
        // Slow for a window's worth of calls (30 ms against the health's 20 ms): out of the
        // path, answered without asking the store.
        let mut k = 0;
        while t.health.in_path() && k < 64 {
            k += 1;
            assert!(t.submit("q", 10 + k, vec![1], IO));
            assert_eq!(
                t.wait("q", 10 + k, Instant::now() + IO),
                Some(LookupOutcome::Found(1))
            );
        }
        assert_eq!(t.health.state(), StoreState::Slow);
        // The three calls above were the window's first samples: the verdict comes with the
        // window's MIN_SAMPLES-th call, not before.
        assert_eq!(k, StoreHealth::MIN_SAMPLES - 3, "{k} calls took it out");
        let (lookups, _, _) = s.calls();
        assert!(t.submit("q", 1, vec![1], IO));
        assert_eq!(
            t.wait("q", 1, Instant::now() + IO),
            Some(LookupOutcome::Skipped)
        );
        assert_eq!(s.calls().0, lookups, "a store out of the path is not asked");
        // Down (after the back-off): failed at once.
        s.faults.delay_ms.store(0, Ordering::Relaxed);
        s.faults.down.store(true, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(60));
        assert!(t.health.in_path());
        assert!(t.submit("d", 0, vec![1], IO));
        assert!(matches!(
            t.wait("d", 0, Instant::now() + IO),
            Some(LookupOutcome::Failed(_))
        ));
        // Forgotten requests leave nothing behind.
        t.forget("d");
        t.forget("r");
        assert!(t.shared.queue.lock().done.is_empty());
    }
}
