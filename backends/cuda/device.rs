//! The engine's GPU KV cache as a [`StorageTier`] (G1): [`CudaDeviceTier`].
//!
//! The tier registers device memory the engine owns (one pointer per allocation of the
//! [`Layout`]); it never allocates or frees it. It owns two non-blocking streams — a *store* stream
//! for every device read, a *load* stream for every device write — and runs every copy as planned
//! copies enqueued back to back, one event recorded after them, and the calling thread sleeping on
//! that event (`CU_EVENT_BLOCKING_SYNC`). That thread is a transfer task on the transfer engine's
//! blocking pool, never the engine's thread.
//!
//! ## Store gating
//!
//! The engine records a CUDA event at the end of its forward pass (TensorRT-LLM's forward-pass
//! callable, vLLM's last layer). [`CudaDeviceTier::gate_stores_on`] makes the store stream wait for
//! it (`cuStreamWaitEvent`): every device read enqueued afterwards runs after the forward pass on
//! the GPU, and the CPU never blocks on it.
//!
//! ## Invariants
//!
//! * Each device block has a reader/writer lock, like the memory tier's, held for as long as any
//!   copy touching the block is in flight.
//! * No copy outlives its locks or its host memory: when enqueueing fails half way, what was
//!   enqueued is waited for before the error returns.
//! * Live tiers are recorded by the address of their value in a registry (a `Weak` each, removed on
//!   drop), so [`device_of`] and the batch hook recognise one behind any `&dyn StorageTier`.

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use parking_lot::{Mutex, RwLock};
use serde::Serialize;

use super::cuda_err;
use super::gpu::{
    enqueue, host_is_pinned, pointer_attribute, CudaDevice, EventPool, PinnedBuffer, Stream,
};
use super::plan::{block_pieces, plan_copies, CopyOp, Direction};
use crate::error::{Error, Result};
use crate::layout::{KvLayout, Layout};
use crate::tier::{check_io, total_len, BatchCopy, Capability, StorageTier, TierKind};

/// Bounce buffers a device tier keeps for reuse.
const BOUNCE_POOL: usize = 4;

/// Copies issued by a device tier, for tests and the bench.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CopyStats {
    /// Plain copies.
    pub copies_1d: u64,
    /// Strided (2D) copies.
    pub copies_2d: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Batches (one event wait each).
    pub batches: u64,
}

#[derive(Debug, Default)]
struct Counters {
    copies_1d: AtomicU64,
    copies_2d: AtomicU64,
    bytes: AtomicU64,
    batches: AtomicU64,
}

/// One run of a device block: where it is on the GPU and where it goes in the canonical image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRun {
    /// Device address.
    pub ptr: u64,
    /// Bytes.
    pub len: usize,
    /// Offset in the block's canonical image.
    pub canonical_offset: usize,
}

/// The engine's GPU KV cache as a [`StorageTier`] (G1).
///
/// Not host addressable: [`StorageTier::read_block`] and [`StorageTier::write_block`] are
/// device ↔ host copies, and [`StorageTier::with_block`]/[`StorageTier::with_block_mut`] work
/// through a pinned staging copy of the block (slow; for tests, verification and simulators). The
/// transfer engine sends it whole batches through its [`BatchCopy`] hook instead
/// ([`StorageTier::batch_copy`]).
pub struct CudaDeviceTier {
    device: Arc<CudaDevice>,
    layout: Layout,
    bases: Vec<u64>,
    locks: Box<[RwLock<()>]>,
    pub(super) store: Stream,
    pub(super) load: Stream,
    events: EventPool,
    bounce: Mutex<Vec<PinnedBuffer>>,
    counters: Counters,
    /// Objects that own the registered memory (the engine's tensors, for the Python bindings),
    /// kept until the tier drops. Declared last: dropped after the streams.
    owners: Mutex<Vec<Box<dyn std::any::Any + Send + Sync>>>,
}

// SAFETY: device addresses are only used through driver calls, under the block locks; streams,
// events and pinned buffers are thread-safe driver objects or behind a mutex.
unsafe impl Send for CudaDeviceTier {}
// SAFETY: see above.
unsafe impl Sync for CudaDeviceTier {}

impl std::fmt::Debug for CudaDeviceTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDeviceTier")
            .field("device", &self.device)
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

type Registry = Mutex<HashMap<usize, Weak<CudaDeviceTier>>>;

/// Live device tiers by the address of their value, so [`device_of`] and the batch hook can
/// recognise one behind `&dyn StorageTier` (the trait has no downcast).
fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// The GPU of `tier` when it is a [`CudaDeviceTier`] (behind any `&dyn StorageTier`).
pub fn device_of(tier: &dyn StorageTier) -> Option<Arc<CudaDevice>> {
    lookup(tier).map(|t| t.device().clone())
}

pub(super) fn lookup(tier: &dyn StorageTier) -> Option<Arc<CudaDeviceTier>> {
    if tier.kind() != TierKind::Device || tier.capability().host_addressable {
        return None;
    }
    let key = tier as *const dyn StorageTier as *const () as usize;
    registry().lock().get(&key).and_then(Weak::upgrade)
}

impl CudaDeviceTier {
    /// Registers the engine's cache: `allocations[i]` is the device address of allocation `i` of
    /// `layout` (one for fully contiguous, one per layer for layer separate), each
    /// `layout.allocation_bytes()` long, on `device`. Checks each allocation's first and last byte
    /// are device memory of that GPU. The tier never frees them.
    ///
    /// # Safety
    /// The allocations must stay allocated, and must not be freed or reused for anything else,
    /// while the tier (or a transfer using it) lives. The engine must not write a block while a
    /// store reads it, nor read one a load is writing, except as ordered by
    /// [`CudaDeviceTier::gate_stores_on`] and the connector's completions.
    pub unsafe fn register(
        device: Arc<CudaDevice>,
        layout: Layout,
        allocations: &[u64],
    ) -> Result<Arc<Self>> {
        if allocations.len() != layout.num_allocations() {
            return Err(Error::invalid_layout(format!(
                "{} device allocations given, the {} layout has {}",
                allocations.len(),
                layout.kind(),
                layout.num_allocations()
            )));
        }
        device.bind()?;
        let ordinal = device.ordinal() as u32;
        for (i, &base) in allocations.iter().enumerate() {
            let last = base.checked_add(layout.allocation_bytes() as u64 - 1);
            let (Some(last), false) = (last, base == 0) else {
                return Err(Error::invalid_argument(format!(
                    "device allocation {i} at {base:#x} is null or overflows"
                )));
            };
            for p in [base, last] {
                let mt = pointer_attribute(
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                    p,
                )
                .map_err(|e| e.with("allocation", i))?;
                if mt != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
                    return Err(Error::invalid_argument(format!(
                        "allocation {i}: {p:#x} is not device memory (memory type {mt})"
                    )));
                }
                let ord = pointer_attribute(
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    p,
                )
                .map_err(|e| e.with("allocation", i))?;
                if ord != ordinal {
                    return Err(Error::invalid_argument(format!(
                        "allocation {i}: {p:#x} is on GPU {ord}, not GPU {ordinal}"
                    )));
                }
            }
        }
        let tier = Arc::new(Self {
            store: Stream::new(&device)?,
            load: Stream::new(&device)?,
            events: EventPool::new(&device),
            locks: (0..layout.num_blocks()).map(|_| RwLock::new(())).collect(),
            bases: allocations.to_vec(),
            layout,
            device,
            bounce: Mutex::new(Vec::new()),
            counters: Counters::default(),
            owners: Mutex::new(Vec::new()),
        });
        registry()
            .lock()
            .insert(Arc::as_ptr(&tier) as usize, Arc::downgrade(&tier));
        Ok(tier)
    }

    /// The GPU.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// The registered allocation addresses.
    pub fn allocation_ptrs(&self) -> &[u64] {
        &self.bases
    }

    /// The runs of `block` on the device, in canonical order.
    pub fn device_runs(&self, block: usize) -> Result<Vec<DeviceRun>> {
        self.layout
            .regions(block)?
            .map(|r| {
                let base = self
                    .bases
                    .get(r.allocation)
                    .ok_or_else(|| Error::internal("region names a missing allocation"))?;
                Ok(DeviceRun {
                    ptr: base + r.offset as u64,
                    len: r.len,
                    canonical_offset: r.canonical_offset,
                })
            })
            .collect()
    }

    pub(super) fn runs(&self, block: usize) -> Result<Vec<(u64, usize)>> {
        Ok(self
            .device_runs(block)?
            .into_iter()
            .map(|r| (r.ptr, r.len))
            .collect())
    }

    /// Copies issued so far.
    pub fn copy_stats(&self) -> CopyStats {
        let c = &self.counters;
        CopyStats {
            copies_1d: c.copies_1d.load(Ordering::Relaxed),
            copies_2d: c.copies_2d.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            batches: c.batches.load(Ordering::Relaxed),
        }
    }

    /// Makes the store stream wait, on the GPU, for the work recorded in `event` (the engine's
    /// end-of-forward-pass event): every device read enqueued after this call — stores,
    /// offloads, `read_block` — runs after that work. Returns at once; the CPU does not wait.
    ///
    /// # Safety
    /// `event` is a live `CUevent` (a `cudaEvent_t` is one) created in this GPU's primary
    /// context; it may be destroyed once this returns.
    pub unsafe fn gate_stores_on(&self, event: sys::CUevent) -> Result<()> {
        self.wait_on(&self.store, event)
    }

    /// Like [`CudaDeviceTier::gate_stores_on`], for the load stream (device writes).
    ///
    /// # Safety
    /// As for [`CudaDeviceTier::gate_stores_on`].
    pub unsafe fn gate_loads_on(&self, event: sys::CUevent) -> Result<()> {
        self.wait_on(&self.load, event)
    }

    /// Store gating from the engine's stream itself: records an event on `stream` (the engine's
    /// compute stream, e.g. `torch.cuda.current_stream().cuda_stream`; `0` is the legacy default
    /// stream) and gates the store stream on it, as [`CudaDeviceTier::gate_stores_on`]. Every
    /// device read enqueued afterwards runs after the work enqueued on `stream` so far. Returns at
    /// once.
    ///
    /// # Safety
    /// `stream` is `0` or a live `CUstream` of this GPU's primary context.
    pub unsafe fn gate_stores_on_stream(&self, stream: sys::CUstream) -> Result<()> {
        self.order(stream, self.store.raw)
    }

    /// Like [`CudaDeviceTier::gate_stores_on_stream`], for the load stream: every device write
    /// enqueued afterwards runs after the work enqueued on `stream` so far (a load never writes a
    /// block the engine's earlier kernels still touch).
    ///
    /// # Safety
    /// As for [`CudaDeviceTier::gate_stores_on_stream`].
    pub unsafe fn gate_loads_on_stream(&self, stream: sys::CUstream) -> Result<()> {
        self.order(stream, self.load.raw)
    }

    /// The opposite direction: makes `stream` (the engine's) wait, on the GPU, for every load
    /// copy enqueued on this tier so far. For engines that read loaded blocks without waiting for
    /// the connector's completion report; returns at once.
    ///
    /// # Safety
    /// As for [`CudaDeviceTier::gate_stores_on_stream`].
    pub unsafe fn order_stream_after_loads(&self, stream: sys::CUstream) -> Result<()> {
        self.order(self.load.raw, stream)
    }

    /// Keeps `owner` (whatever owns the registered memory) alive until the tier drops.
    pub fn keep_alive(&self, owner: Box<dyn std::any::Any + Send + Sync>) {
        self.owners.lock().push(owner);
    }

    /// `to` waits on the GPU for the work enqueued on `from` so far: a pooled event recorded on
    /// `from`, `cuStreamWaitEvent(to, event)`. The event goes back to the pool at once (the wait
    /// captured its state).
    fn order(&self, from: sys::CUstream, to: sys::CUstream) -> Result<()> {
        self.device.bind()?;
        let ev = self.events.get()?;
        // SAFETY: our pooled event; the streams are ours or vouched for by the caller.
        let r = unsafe { sys::cuEventRecord(ev, from) }
            .result()
            .map_err(|e| cuda_err("cuEventRecord", e))
            .and_then(|()| {
                // SAFETY: as above.
                unsafe { sys::cuStreamWaitEvent(to, ev, 0) }
                    .result()
                    .map_err(|e| cuda_err("cuStreamWaitEvent", e))
            });
        self.events.put(ev);
        r
    }

    fn wait_on(&self, stream: &Stream, event: sys::CUevent) -> Result<()> {
        if event.is_null() {
            return Err(Error::invalid_argument("null CUDA event"));
        }
        self.device.bind()?;
        // SAFETY: the caller vouches for `event`; the stream is ours.
        unsafe { sys::cuStreamWaitEvent(stream.raw, event, 0) }
            .result()
            .map_err(|e| cuda_err("cuStreamWaitEvent", e))
    }

    /// Enqueues `ops` on `stream`, records an event after them and waits for it. When an enqueue
    /// fails, what was enqueued is still waited for before the error returns.
    pub(super) fn run(&self, stream: &Stream, dir: Direction, ops: &[CopyOp]) -> Result<()> {
        self.device.bind()?;
        let mut first: Option<Error> = None;
        let issue = |op: &CopyOp| -> Result<()> {
            // SAFETY: callers hold the device blocks' locks and the host memory (locked host
            // blocks or an owned bounce buffer) until this returns, after the wait below.
            unsafe { enqueue(op, dir, stream.raw) }.map_err(|(call, e)| cuda_err(call, e))?;
            let c = &self.counters;
            if op.height == 1 {
                c.copies_1d.fetch_add(1, Ordering::Relaxed);
            } else {
                c.copies_2d.fetch_add(1, Ordering::Relaxed);
            }
            c.bytes.fetch_add(op.bytes() as u64, Ordering::Relaxed);
            Ok(())
        };
        for op in ops {
            let r = if op.height > 1 && !host_is_pinned(op.host) {
                // Strided copies are for page-locked host memory; pageable memory (the plain
                // memory tier) gets one copy per row.
                (0..op.height).try_for_each(|row| {
                    issue(&CopyOp {
                        device: op.device + (row * op.device_pitch) as u64,
                        host: op.host + row * op.host_pitch,
                        width: op.width,
                        height: 1,
                        device_pitch: op.width,
                        host_pitch: op.width,
                    })
                })
            } else {
                issue(op)
            };
            if let Err(e) = r {
                first = Some(e);
                break;
            }
        }
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        let waited = self.wait_stream(stream);
        match first {
            Some(e) => Err(e),
            None => waited,
        }
    }

    fn wait_stream(&self, stream: &Stream) -> Result<()> {
        let by_event = self.events.get().and_then(|ev| {
            // SAFETY: our event and stream, in the current context.
            let r = unsafe { sys::cuEventRecord(ev, stream.raw) }
                .result()
                .map_err(|e| cuda_err("cuEventRecord", e))
                .and_then(|()| {
                    // SAFETY: as above; blocking-sync event, so this thread sleeps.
                    unsafe { sys::cuEventSynchronize(ev) }
                        .result()
                        .map_err(|e| cuda_err("cuEventSynchronize", e))
                });
            self.events.put(ev);
            r
        });
        match by_event {
            Ok(()) => Ok(()),
            Err(e) => {
                // Whatever happened, nothing enqueued may outlive the caller's locks.
                // SAFETY: our stream.
                let _ = unsafe { cu::stream::synchronize(stream.raw) };
                Err(e)
            }
        }
    }

    pub(super) fn take_bounce(&self, bytes: usize) -> Result<PinnedBuffer> {
        {
            let mut pool = self.bounce.lock();
            if let Some(i) = pool.iter().position(|b| b.len() >= bytes) {
                return Ok(pool.swap_remove(i));
            }
        }
        self.device.alloc_pinned(bytes)
    }

    pub(super) fn put_bounce(&self, buf: PinnedBuffer) {
        let mut pool = self.bounce.lock();
        if pool.len() < BOUNCE_POOL {
            pool.push(buf);
        }
    }

    pub(super) fn lock_for(&self, block: usize) -> Result<&RwLock<()>> {
        self.locks
            .get(block)
            .ok_or_else(|| Error::out_of_range("block", block, self.locks.len()))
    }

    /// Reads `block` into a pinned staging buffer (under the caller's lock).
    fn stage_in(&self, block: usize) -> Result<PinnedBuffer> {
        let bpb = self.bytes_per_block();
        let buf = self.take_bounce(bpb)?;
        let pieces = [block_pieces(
            &self.runs(block)?,
            &[(buf.as_ptr() as usize, bpb)],
        )];
        match self.run(
            &self.store,
            Direction::DeviceToHost,
            &plan_copies(&pieces, self.device.max_pitch()),
        ) {
            Ok(()) => Ok(buf),
            Err(e) => {
                self.put_bounce(buf);
                Err(e)
            }
        }
    }
}

impl Drop for CudaDeviceTier {
    fn drop(&mut self) {
        let key = self as *const Self as usize;
        let mut reg = registry().lock();
        if reg.get(&key).is_some_and(|w| w.strong_count() == 0) {
            reg.remove(&key);
        }
    }
}

impl StorageTier for CudaDeviceTier {
    fn kind(&self) -> TierKind {
        TierKind::Device
    }

    fn capability(&self) -> Capability {
        Capability {
            host_addressable: false,
            direct_io_alignment: 1,
            checksummed: false,
            // Batches share one stream per direction; a few in flight overlap their CPU-side
            // planning and waiting with the copies.
            max_in_flight: 4,
        }
    }

    fn layout(&self) -> &Layout {
        &self.layout
    }

    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        check_io(
            TierKind::Device,
            "read_block",
            block,
            self.num_blocks(),
            total_len(dst),
            self.bytes_per_block(),
        )?;
        let _g = self.lock_for(block)?.read();
        let host: Vec<(usize, usize)> = dst
            .iter_mut()
            .map(|s| (s.as_mut_ptr() as usize, s.len()))
            .collect();
        let pieces = [block_pieces(&self.runs(block)?, &host)];
        self.run(
            &self.store,
            Direction::DeviceToHost,
            &plan_copies(&pieces, self.device.max_pitch()),
        )
    }

    fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> Result<()> {
        check_io(
            TierKind::Device,
            "write_block",
            block,
            self.num_blocks(),
            total_len(src),
            self.bytes_per_block(),
        )?;
        let _g = self.lock_for(block)?.write();
        let host: Vec<(usize, usize)> =
            src.iter().map(|s| (s.as_ptr() as usize, s.len())).collect();
        let pieces = [block_pieces(&self.runs(block)?, &host)];
        self.run(
            &self.load,
            Direction::HostToDevice,
            &plan_copies(&pieces, self.device.max_pitch()),
        )
    }

    /// Lends a pinned staging copy of the block (its canonical image, one segment).
    fn with_block(
        &self,
        block: usize,
        f: &mut dyn FnMut(&[IoSlice<'_>]) -> Result<()>,
    ) -> Result<()> {
        let _g = self.lock_for(block)?.read();
        let buf = self.stage_in(block)?;
        let r = f(&[IoSlice::new(&buf.as_slice()[..self.bytes_per_block()])]);
        self.put_bounce(buf);
        r
    }

    /// Lends a pinned staging copy of the block and writes it back when `f` succeeds.
    fn with_block_mut(
        &self,
        block: usize,
        f: &mut dyn FnMut(&mut [IoSliceMut<'_>]) -> Result<()>,
    ) -> Result<()> {
        let _g = self.lock_for(block)?.write();
        let bpb = self.bytes_per_block();
        let mut buf = self.stage_in(block)?;
        let r = f(&mut [IoSliceMut::new(&mut buf.as_mut_slice()[..bpb])]).and_then(|()| {
            let pieces = [block_pieces(
                &self.runs(block)?,
                &[(buf.as_ptr() as usize, bpb)],
            )];
            self.run(
                &self.load,
                Direction::HostToDevice,
                &plan_copies(&pieces, self.device.max_pitch()),
            )
        });
        self.put_bounce(buf);
        r
    }

    /// Whole batches to and from any tier but another device tier (see [`BatchCopy`]).
    fn batch_copy(&self) -> Option<&dyn BatchCopy> {
        Some(self)
    }
}
