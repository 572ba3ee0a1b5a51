//! Running the metadata's operations: each checked on the engine's thread and turned into a
//! [`Job`] (its tiers, its fence for a load from a tier doing I/O, what to count when it ends),
//! then copied on that thread (a memcpy between a device tier in host memory and another memory
//! tier) or started on the worker's runtime; [`complete`] applies every operation's outcome —
//! transfer statistics, failed blocks (a request's wait in its slot for `get_finished`), the
//! counts in flight — and queues its completion for the leader.

use super::*;
use crate::connector::metadata::BlockTransfer;
use crate::connector::metadata::BuiltinKind;

impl Worker {
    pub(super) fn submit_where(&mut self, pick: impl Fn(&dyn Operation) -> bool) -> Result<()> {
        let Some(meta) = self.current.as_ref() else {
            return Ok(());
        };
        let ops: Vec<Box<dyn Operation>> = meta
            .operations
            .iter()
            .filter(|op| pick(op.as_ref()))
            .cloned()
            .collect();
        if ops.is_empty() {
            return Ok(());
        }
        let tiers = self
            .tiers()
            .cloned()
            .ok_or_else(|| Error::new(ErrorKind::NotReady, "worker is not ready"))?;
        let (here, elsewhere): (Vec<Job>, Vec<Job>) = ops
            .into_iter()
            .filter_map(|op| {
                let orphan = self.orphans.contains(&op.id());
                self.prepare(&tiers, op, orphan)
            })
            .partition(|job| job.inline);
        // Copies to or from disk and the store start first, so they run while this thread copies.
        self.start_jobs(elsewhere);
        for job in here {
            job.run_here(&self.shared, &self.outbox);
        }
        Ok(())
    }

    /// Starts checked operations: all of them from one task on the worker's runtime, so the
    /// engine's thread hands a step's operations over with one wake-up of the runtime, not two
    /// spawns per operation (each transfer still runs as its own task, concurrently).
    pub(super) fn start_jobs(&self, mut jobs: Vec<Job>) {
        if jobs.is_empty() {
            return;
        }
        let shared = self.shared.clone();
        let outbox = self.outbox.clone();
        let handle = self.runtime.handle().clone();
        if jobs.len() == 1 {
            if let Some(job) = jobs.pop() {
                let _enter = self.runtime.handle().enter();
                job.start(&handle, shared, outbox);
            }
            return;
        }
        self.runtime.handle().spawn(async move {
            for job in jobs {
                job.start(&handle, shared.clone(), outbox.clone());
            }
        });
    }

    /// Checks one operation and counts it in flight; returns what starts it, or `None` when it
    /// completed at once (refused: an `orphan`, naming a request no metadata announced; no tier
    /// for one of its sides; a transfer [`TransferEngine::validate`] refuses).
    pub(super) fn prepare(
        &self,
        tiers: &WorkerTiers,
        op: Box<dyn Operation>,
        orphan: bool,
    ) -> Option<Job> {
        let t = op.transfer().clone();
        let direction = op.direction();
        let mut done = self.count_started(&t, direction);
        done.keys = stored_keys(op.as_ref());
        let touches_device = done.touches_device;
        let shared = self.shared.clone();
        let outbox = self.outbox.clone();
        if orphan {
            let (done, e) = orphaned(done, &t);
            complete(&shared, &outbox, done, Err(e));
            return None;
        }
        if let Some(e) = unkeyed_load(&shared, op.as_ref()) {
            complete(&shared, &outbox, done, Err(e));
            return None;
        }
        let (src, dst) = match self.endpoints(tiers, op.as_ref()) {
            Ok(sides) => sides,
            Err(e) => {
                complete(&shared, &outbox, done, Err(e));
                return None;
            }
        };
        let engine = self.engine_for(t.src, t.dst);
        let bytes_per_block = dst.bytes_per_block();
        // A load from a tier doing I/O writes the device through a fence, and has a deadline.
        let fence = (direction == Direction::Load
            && t.dst == TierKind::Device
            && !src.capability().host_addressable)
            .then(|| Arc::new(FencedDevice::new(dst.clone())));
        let target = match &fence {
            Some(f) => f.clone() as Arc<dyn StorageTier>,
            None => dst,
        };
        let (src_kind, dst_kind) = (t.src, t.dst);
        // Kept only for a fenced load, to name its failed pairs if it is abandoned.
        let pairs = if fence.is_some() {
            t.pairs.clone()
        } else {
            Vec::new()
        };
        let same = Arc::ptr_eq(&src, &target);
        if let Err(e) = TransferEngine::validate(src.as_ref(), target.as_ref(), same, &t.pairs) {
            complete(&shared, &outbox, done, Err(e));
            return None;
        }
        // A device tier in host memory (an engine on the CPU) and another memory tier: a memcpy
        // of this step's blocks, done at once on this thread (`transfer.inline_device_copies`).
        let inline = self.config.transfer.inline_device_copies
            && touches_device
            && fence.is_none()
            && src.capability().host_addressable
            && target.capability().host_addressable;
        Some(Job {
            inline,
            engine: engine.clone(),
            src,
            target,
            pairs: t.pairs,
            fence,
            fence_pairs: pairs,
            kinds: (src_kind, dst_kind),
            bytes_per_block,
            deadline: self.config.transfer.load_timeout(),
            done,
        })
    }

    /// The transfer engine a copy between tiers `src` and `dst` runs on: the I/O engine when
    /// either does I/O (disk, remote), so a stuck disk never takes the memory copies' permits.
    fn engine_for(&self, src: TierKind, dst: TierKind) -> &TransferEngine {
        let does_io = |k: TierKind| matches!(k, TierKind::Disk | TierKind::Remote);
        if does_io(src) || does_io(dst) {
            &self.io_engine
        } else {
            &self.engine
        }
    }

    /// Counts operation `t` as started (in the worker's active counts, by kind, and as a device
    /// read), until [`complete`] counts it done: every path after this ends there. Returns what
    /// completing it needs.
    fn count_started(&self, t: &BlockTransfer, direction: Direction) -> OpDone {
        let touches_device = t.reads_device() || t.writes_device();
        let behind = !touches_device && t.dst == TierKind::Remote;
        let remote_load = direction == Direction::Load && t.src == TierKind::Remote;
        {
            let mut active = self.shared.active.lock();
            active.all += 1;
            if behind {
                active.behind += 1;
            } else if remote_load {
                active.remote_loads += 1;
            } else if !touches_device {
                active.off_device.insert(t.id, Instant::now());
            }
        }
        if t.reads_device() {
            *self.shared.device_reads.lock() += 1;
        }
        OpDone {
            op: t.id,
            request: t.request_id.clone(),
            direction,
            touches_device,
            off_device: !touches_device && !behind,
            behind,
            remote_load,
            reads_device: t.reads_device(),
            writes_device: t.writes_device(),
            dst_blocks: t.pairs.iter().map(|p| p.1).collect(),
            keys: Vec::new(),
        }
    }

    /// The source and destination tiers of `op` on this worker: its own tiers, or a view of the
    /// remote store (with the store's load and I/O deadlines) for a remote load or write. Errors
    /// name the operation: a remote view that cannot be built, or a tier this worker lacks.
    fn endpoints(
        &self,
        tiers: &WorkerTiers,
        op: &dyn Operation,
    ) -> Result<(Arc<dyn StorageTier>, Arc<dyn StorageTier>)> {
        let t = op.transfer();
        let deadlines = (
            self.config.remote.load_timeout(),
            self.config.remote.io_timeout(),
        );
        let rank = self.rank();
        let (src, dst) =
            remote_sides(tiers, op, rank, deadlines).map_err(|e| e.with("op", t.id))?;
        match (src, dst) {
            (Some(s), Some(d)) => Ok((s, d.clone())),
            _ => Err(Error::unsupported(format!(
                "{} → {} has no tier on this worker",
                t.src, t.dst
            ))
            .with("op", t.id)),
        }
    }
}

/// An operation checked on the engine's thread, to be started on the worker's runtime.
pub(super) struct Job {
    /// Run on the engine's thread when submitted ([`Job::run_here`]), not on the runtime.
    inline: bool,
    engine: TransferEngine,
    src: Arc<dyn StorageTier>,
    /// The destination tier, or its fence for a load from a tier doing I/O.
    target: Arc<dyn StorageTier>,
    pairs: Vec<(usize, usize)>,
    /// A load from a tier doing I/O writes the device through this, and has `deadline`.
    fence: Option<Arc<FencedDevice>>,
    /// The pairs again, kept only for a fenced load (to name its failed pairs if abandoned).
    fence_pairs: Vec<(usize, usize)>,
    kinds: (TierKind, TierKind),
    bytes_per_block: usize,
    deadline: Duration,
    done: OpDone,
}

impl Job {
    /// Copies on the calling thread and completes the operation (a copy between two memory
    /// tiers: no fence, no deadline).
    fn run_here(self, shared: &Shared, outbox: &Arc<Outbox>) {
        let outcome = self
            .engine
            .copy_here(self.src.as_ref(), self.target.as_ref(), &self.pairs);
        complete(shared, outbox, self.done, Ok(outcome));
    }

    /// Starts the transfer on `runtime` and a task that completes the operation when it ends.
    fn start(self, runtime: &tokio::runtime::Handle, shared: Arc<Shared>, outbox: Arc<Outbox>) {
        let Job {
            inline: _,
            engine,
            src,
            target,
            pairs,
            fence,
            fence_pairs,
            kinds,
            bytes_per_block,
            deadline,
            done,
        } = self;
        let h = engine.start_on(runtime, src, target, pairs);
        runtime.spawn(async move {
            let outcome = match fence {
                None => h.await,
                Some(fence) => match tokio::time::timeout(deadline, h).await {
                    Ok(outcome) => outcome,
                    // The transfer runs on (dropping its handle does not stop it), but
                    // nothing it reads reaches the device any more.
                    Err(_) => Ok(abandoned(
                        kinds,
                        bytes_per_block,
                        &fence_pairs,
                        &fence.close(),
                        deadline,
                    )),
                },
            };
            complete(&shared, &outbox, done, outcome);
        });
    }
}

struct OpDone {
    op: OperationId,
    request: Option<RequestId>,
    direction: Direction,
    touches_device: bool,
    /// Counted as off-device in [`Active`] at submission (kept as submitted).
    off_device: bool,
    /// Counted as a write-behind to the remote store in [`Active`].
    behind: bool,
    /// Counted as a load from the remote store in [`Active`] and the request's slot.
    remote_load: bool,
    reads_device: bool,
    writes_device: bool,
    dst_blocks: Vec<usize>,
    /// `(destination block, key)` of a keyed store (a persisted disk tier), else empty.
    keys: Vec<(usize, u128)>,
}

/// An operation naming a request no metadata announced: refused, counted as a store touching no
/// device block (nothing of the engine's waits on it).
fn orphaned(done: OpDone, t: &BlockTransfer) -> (OpDone, Error) {
    let e = Error::invalid_argument(format!(
        "operation {} names request {:?}, which no metadata announced",
        t.id,
        t.request_id.as_ref().map(RequestId::as_str)
    ));
    let done = OpDone {
        request: None,
        touches_device: false,
        reads_device: false,
        writes_device: false,
        direction: Direction::Store,
        ..done
    };
    (done, e)
}

/// `(destination block, key)` of a keyed store (a persisted disk tier), else empty.
fn stored_keys(op: &dyn Operation) -> Vec<(usize, u128)> {
    if op.builtin_kind() != Some(BuiltinKind::KeyedStore) {
        return Vec::new();
    }
    let pairs = &op.transfer().pairs;
    pairs
        .iter()
        .map(|p| p.1)
        .zip(op.block_keys().iter().copied())
        .collect()
}

/// For a keyed load (from a persisted disk tier): the error when a source block does not hold
/// the key the leader expects by this worker's own index (a stale view fails the load and the
/// engine recomputes; another key's bytes are never served). `None`: it may run.
fn unkeyed_load(shared: &Shared, op: &dyn Operation) -> Option<Error> {
    if op.builtin_kind() != Some(BuiltinKind::KeyedLoad) {
        return None;
    }
    let t = op.transfer();
    let wrong = match shared.disk_keys.get() {
        Some(keys) => keys.first_mismatch(&t.pairs, op.block_keys()),
        None => t.pairs.first().map(|p| p.0),
    }?;
    Some(
        Error::corrupt(format!(
            "disk block {wrong} does not hold the key the leader expects (persisted disk \
             index); the load is refused"
        ))
        .with("op", t.id)
        .with("block", wrong),
    )
}

/// Adds a finished transfer to the worker's counters and its per-path totals.
fn record_path(shared: &Shared, o: &TransferOutcome) {
    shared
        .metrics
        .record_transfer(o.src, o.dst, o.blocks as u64, o.bytes);
    let mut paths = shared.paths.lock();
    match paths.iter_mut().find(|p| p.src == o.src && p.dst == o.dst) {
        Some(p) => {
            p.blocks += o.blocks as u64;
            p.bytes += o.bytes;
            p.busy += o.elapsed;
        }
        None => paths.push(PathStats {
            src: o.src,
            dst: o.dst,
            blocks: o.blocks as u64,
            bytes: o.bytes,
            busy: o.elapsed,
        }),
    }
}

/// A finished operation's effect on its request's slot: failed device blocks become load errors
/// (the slot's, or the worker's when the request already left), and its counts go down.
fn settle_request(shared: &Shared, done: &OpDone, failed: &[usize]) {
    let mut st = shared.state.lock();
    let st = &mut *st;
    // Only device blocks are the engine's to recompute. A request's wait in its slot until
    // `get_finished` reports its load done (the engine reads them right after that call: one
    // completing in between must not reach it an iteration before its request's end).
    if done.writes_device && !failed.is_empty() {
        match done.request.as_ref().and_then(|id| st.slots.get_mut(id)) {
            Some(s) => s.load_errors.extend(failed.iter().copied()),
            None => {
                st.load_errors.extend(failed.iter().copied());
                if let Some(id) = &done.request {
                    st.failed_loads.insert(id.clone());
                }
            }
        }
    }
    if let Some(id) = &done.request {
        if let Some(s) = st.slots.get_mut(id) {
            if done.touches_device {
                s.device_ops = s.device_ops.saturating_sub(1);
            }
            if done.direction == Direction::Load {
                s.loads = s.loads.saturating_sub(1);
            }
            if done.remote_load {
                s.remote_loads = s.remote_loads.saturating_sub(1);
            }
        }
    }
}

fn complete(shared: &Shared, outbox: &Arc<Outbox>, done: OpDone, outcome: Result<TransferOutcome>) {
    if let Ok(o) = &outcome {
        record_path(shared, o);
    }
    let (failed, error): (Vec<usize>, Option<String>) = match outcome {
        Ok(o) if o.is_ok() => (Vec::new(), None),
        Ok(o) => {
            let first = o.failed.first().map(|f| f.error.to_string());
            (o.failed.iter().map(|f| f.dst_block).collect(), first)
        }
        Err(e) => (done.dst_blocks.clone(), Some(e.to_string())),
    };
    if let Some(e) = &error {
        tracing::debug!(op = %done.op, failed = failed.len(), error = %e, "operation failed");
        if let Some(n) = shared.failure_warn.lock().event(failed.len() as u64) {
            tracing::warn!(op = %done.op, direction = ?done.direction, blocks = n, error = %e, "kvbm: block transfers failed (rate-limited; count since the last warning)");
        }
    }
    // A persisted disk tier's index learns what was written before the leader can reuse a block.
    if !done.keys.is_empty() {
        if let Some(keys) = shared.disk_keys.get() {
            keys.record(&done.keys, &failed);
        }
    }
    // Queue it for the leader first: the engine learns the operation is done (below) only in
    // `get_finished`, which sends the queue before it returns, so a later match can already
    // find what it stored.
    outbox.push(Completion {
        op: done.op,
        failed_dst_blocks: failed.clone(),
        error,
    });
    settle_request(shared, &done, &failed);
    if done.reads_device {
        let mut n = shared.device_reads.lock();
        *n = n.saturating_sub(1);
        shared.device_reads_done.notify_all();
    }
    let settled = {
        let mut active = shared.active.lock();
        active.all = active.all.saturating_sub(1);
        if done.off_device {
            active.off_device.remove(&done.op);
        }
        if done.behind {
            active.behind = active.behind.saturating_sub(1);
        }
        if done.remote_load {
            active.remote_loads = active.remote_loads.saturating_sub(1);
        }
        active.all == 0
    };
    if settled {
        outbox.settled();
    }
    shared.active_done.notify_all();
}

/// The outcome of a load abandoned at its `deadline`: the device blocks in `written` are loaded,
/// every other pair failed with [`ErrorKind::Timeout`].
fn abandoned(
    (src, dst): (TierKind, TierKind),
    bytes_per_block: usize,
    pairs: &[(usize, usize)],
    written: &HashSet<usize>,
    deadline: Duration,
) -> TransferOutcome {
    let failed: Vec<BlockFailure> = pairs
        .iter()
        .filter(|(_, d)| !written.contains(d))
        .map(|&(s, d)| BlockFailure {
            src_block: s,
            dst_block: d,
            error: Error::new(
                ErrorKind::Timeout,
                format!(
                    "load missed its deadline of {:.1}s (transfer.load_timeout_secs); the engine recomputes the block",
                    deadline.as_secs_f64()
                ),
            )
            .with("src_tier", src)
            .with("src_block", s)
            .with("dst_block", d),
        })
        .collect();
    let blocks = pairs.len() - failed.len();
    TransferOutcome {
        src,
        dst,
        blocks,
        bytes: blocks as u64 * bytes_per_block as u64,
        failed,
        elapsed: deadline,
    }
}

type Sides = (Option<Arc<dyn StorageTier>>, Option<Arc<dyn StorageTier>>);

/// The source and destination tiers of `op` on this worker: its own tiers, or, for a side that
/// is the remote store, that operation's view of it ([`RemoteSource`] for a load, keyed by the
/// pairs' source index, each read batch bounded by `deadlines.0` (`remote.load_timeout_ms`);
/// [`RemoteSink`] for a write, keyed by their destination index, each batch bounded by
/// `deadlines.1` (`remote.io_timeout_ms`)).
fn remote_sides(
    tiers: &WorkerTiers,
    op: &dyn Operation,
    rank: usize,
    deadlines: (Duration, Duration),
) -> Result<Sides> {
    let t = op.transfer();
    if t.src != TierKind::Remote && t.dst != TierKind::Remote {
        return Ok((tiers.get(t.src).cloned(), tiers.get(t.dst).cloned()));
    }
    let Some(store) = tiers.remote.clone() else {
        return Err(Error::unsupported(
            "an operation on the remote tier, but this worker has no remote store (remote.url / KVBM_REMOTE_URL)",
        ));
    };
    let keys = op.block_keys().to_vec();
    let idx = |p: &(usize, usize)| if t.src == TierKind::Remote { p.0 } else { p.1 };
    if let Some(bad) = t.pairs.iter().map(idx).find(|&k| k >= keys.len()) {
        return Err(Error::out_of_range("remote key index", bad, keys.len()));
    }
    if t.src == TierKind::Remote {
        let dims = *tiers.device.layout().dims();
        let src: Arc<dyn StorageTier> =
            Arc::new(RemoteSource::new(store, rank, keys, dims, deadlines.0)?);
        Ok((Some(src), tiers.get(t.dst).cloned()))
    } else {
        let Some(host) = tiers.get(t.src).cloned() else {
            return Ok((None, None));
        };
        let dims = *host.layout().dims();
        let dst: Arc<dyn StorageTier> =
            Arc::new(RemoteSink::new(store, rank, keys, dims, deadlines.1)?);
        Ok((Some(host), Some(dst)))
    }
}
