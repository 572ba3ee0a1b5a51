//! The `cuda` backend: the engine's GPU cache as the device tier (G1), page-locked host memory as
//! the host tier (G2), and the copies between them on dedicated CUDA streams.
//!
//! Built on cudarc's driver API with `dynamic-loading`: nothing CUDA is needed to build, and
//! `libcuda.so.1` is opened at run time. [`probe`] is the one door: it checks the library can be
//! opened (`dlopen`) before cudarc touches it, guards cudarc's first calls with `catch_unwind`
//! (cudarc panics when a library or symbol is missing), and answers an [`Error`] that names the
//! library or the driver call that failed. Every constructor here goes through it, so no driver or
//! no GPU is an error, never a panic.
//!
//! * [`CudaDevice`] — one GPU: its primary context (the one the engine uses), shared by the tiers.
//! * [`CudaDeviceTier`] — the engine's KV cache as a [`StorageTier`]: registered device pointers
//!   (one per allocation of the [`Layout`]) that the engine owns; we never allocate or free them.
//! * [`PinnedHostTier`] — page-locked host memory (`cuMemHostAlloc`), host addressable like the
//!   memory tier; what G2 should be when CUDA is on.
//! * [`DeviceBuffer`], [`PinnedBuffer`] — owned GPU and pinned allocations (tests, the bench, and
//!   the device tier's bounce buffers).
//!
//! ## Copies
//!
//! Each device tier has two non-blocking streams: a *store* stream for device → host reads and a
//! *load* stream for host → device writes. A batch of block pairs becomes a list of [`CopyOp`]s
//! ([`plan_copies`]): runs adjacent on both sides merge into one copy (a fully contiguous cache
//! with consecutive blocks is one copy per batch), and a run repeated at a fixed stride over
//! consecutive blocks (a layer-separate cache) becomes one strided 2D copy (`cuMemcpy2DAsync`) per
//! run instead of one copy per run per block; what neither covers is one async copy per run. The
//! batch's copies are enqueued back to back, one CUDA event is recorded after them, and the calling
//! thread — a transfer task on the transfer engine's blocking pool, never the engine's thread —
//! waits on that event (`CU_EVENT_BLOCKING_SYNC`: it sleeps, it does not spin).
//!
//! The transfer engine reaches these batches through [`copy_batch`] (its CUDA hook): any transfer
//! with a [`CudaDeviceTier`] on one side and a host-addressable tier on the other copies straight
//! between the device and the host tier's memory; with a tier that is not host addressable (disk)
//! on the other side, through a pinned bounce buffer, one block per slot, so a disk block that
//! fails its checksum fails alone.
//!
//! ## Store gating
//!
//! The engine records a CUDA event at the end of its forward pass (TensorRT-LLM's forward-pass
//! callable, vLLM's last layer). [`CudaDeviceTier::gate_stores_on`] makes the store stream wait for
//! it (`cuStreamWaitEvent`): every device read enqueued afterwards runs after the forward pass on
//! the GPU, and the CPU never blocks on it.
//!
//! ## Soundness
//!
//! Device blocks are guarded like the memory tier's: a per-block reader/writer lock, taken in
//! ascending block order for a batch, held until the batch's event completed; the host side's
//! blocks are lent by its own `with_block`/`with_block_mut` (again in ascending order) for as long.
//! The copies never outlive the locks: when enqueueing fails half way, what was enqueued is waited
//! for before the error returns.

use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::io::{IoSlice, IoSliceMut};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;
use cudarc::driver::CudaContext;
use parking_lot::{Mutex, RwLock};
use serde::Serialize;

use crate::backends::memory::HostBlocks;
use crate::error::{Error, ErrorKind, Result};
use crate::layout::{KvLayout, Layout};
use crate::tier::{check_io, total_len, Capability, StorageTier, TierKind};

/// The cudarc this backend is built on, for callers that need raw driver types (events, streams).
pub use cudarc;

/// Largest number of blocks handled as one batch of copies (and one bounce buffer).
pub const MAX_BATCH_BLOCKS: usize = 256;

/// The driver library names tried, in order.
pub const DRIVER_LIBRARIES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// Bounce buffers a device tier keeps for reuse.
const BOUNCE_POOL: usize = 4;

/// Largest pinned bounce buffer (a batch through one is cut to fit, at least one block).
pub const MAX_BOUNCE_BYTES: usize = 64 << 20;

// ------------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------------

fn describe(e: DriverError) -> String {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    match e.error_string() {
        Ok(s) => format!("{name} ({})", s.to_string_lossy()),
        Err(_) => name,
    }
}

/// A failed driver call during a copy or an allocation.
pub(crate) fn cuda_err(call: &'static str, e: DriverError) -> Error {
    Error::new(ErrorKind::Io, format!("{call} failed: {}", describe(e))).with("cuda_call", call)
}

/// A failed driver call while finding the driver or a device: the backend is unusable here.
fn unusable(call: &'static str, e: DriverError) -> Error {
    Error::unsupported(format!("{call} failed: {}", describe(e))).with("cuda_call", call)
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic without a message".to_string()
    }
}

// ------------------------------------------------------------------------------------------------
// Probe
// ------------------------------------------------------------------------------------------------

/// One GPU as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Device name, e.g. "NVIDIA H200".
    pub name: String,
    /// Device memory in bytes.
    pub total_memory: usize,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
}

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CudaInfo {
    /// The driver library that was opened.
    pub library: String,
    /// `cuDriverGetVersion`: 1000 × major + 10 × minor (12040 is 12.4).
    pub driver_version: i32,
    /// Every visible GPU.
    pub devices: Vec<GpuInfo>,
}

impl CudaInfo {
    /// The driver's CUDA version as `major.minor`.
    pub fn driver_version_string(&self) -> String {
        format!(
            "{}.{}",
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10
        )
    }
}

/// Finds the CUDA driver and its GPUs. Never panics: no driver library, a driver cudarc cannot
/// bind, a failing `cuInit` or no device is an [`ErrorKind::Unsupported`] error whose message
/// names the library or the call. The answer is computed once per process.
pub fn probe() -> Result<CudaInfo> {
    static PROBE: OnceLock<Result<CudaInfo>> = OnceLock::new();
    PROBE.get_or_init(probe_uncached).clone()
}

fn probe_uncached() -> Result<CudaInfo> {
    let library = find_driver_library().map_err(|why| {
        Error::unsupported(format!(
            "no CUDA driver: cannot load the driver library ({why})"
        ))
        .with("library", DRIVER_LIBRARIES[0])
    })?;
    // cudarc resolves the library and its symbols on first use and panics if that fails (a
    // driver older than the bindings): keep that panic inside.
    match catch_unwind(AssertUnwindSafe(query_driver)) {
        Ok(Ok((driver_version, devices))) => Ok(CudaInfo {
            library: library.to_string(),
            driver_version,
            devices,
        }),
        Ok(Err(e)) => Err(e.with("library", library)),
        Err(p) => Err(Error::unsupported(format!(
            "cudarc could not bind the CUDA driver API in {library} (a driver older than CUDA 12.0?): {}",
            panic_text(p.as_ref())
        ))
        .with("library", library)),
    }
}

/// Opens and closes each candidate with `dlopen`; the first that opens is the one.
fn find_driver_library() -> std::result::Result<&'static str, String> {
    let mut why = Vec::new();
    for (name, cname) in DRIVER_LIBRARIES
        .iter()
        .zip([c"libcuda.so.1", c"libcuda.so"])
    {
        // SAFETY: a valid NUL-terminated name; the handle is closed right away.
        let handle = unsafe { libc::dlopen(cname.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
        if !handle.is_null() {
            // SAFETY: `handle` came from dlopen above and is closed once.
            unsafe { libc::dlclose(handle) };
            return Ok(name);
        }
        // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl call.
        let err = unsafe { libc::dlerror() };
        let msg = if err.is_null() {
            format!("{name}: not found")
        } else {
            // SAFETY: see above; copied out at once.
            unsafe { CStr::from_ptr(err) }
                .to_string_lossy()
                .into_owned()
        };
        why.push(msg);
    }
    Err(why.join("; "))
}

fn query_driver() -> Result<(i32, Vec<GpuInfo>)> {
    cu::init().map_err(|e| unusable("cuInit", e))?;
    let mut version = 0;
    // SAFETY: writes one int.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| unusable("cuDriverGetVersion", e))?;
    let count = cu::device::get_count().map_err(|e| unusable("cuDeviceGetCount", e))?;
    if count <= 0 {
        return Err(Error::unsupported(
            "no CUDA device: cuDeviceGetCount found none",
        ));
    }
    let mut devices = Vec::new();
    for ordinal in 0..count {
        let dev = cu::device::get(ordinal).map_err(|e| unusable("cuDeviceGet", e))?;
        let name = cu::device::get_name(dev).map_err(|e| unusable("cuDeviceGetName", e))?;
        // SAFETY: `dev` is a valid device handle from cuDeviceGet.
        let total_memory =
            unsafe { cu::device::total_mem(dev) }.map_err(|e| unusable("cuDeviceTotalMem", e))?;
        let attr = |a| {
            // SAFETY: as above.
            unsafe { cu::device::get_attribute(dev, a) }
                .map_err(|e| unusable("cuDeviceGetAttribute", e))
        };
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        devices.push(GpuInfo {
            ordinal: ordinal as usize,
            name,
            total_memory,
            compute_capability: (major, minor),
        });
    }
    Ok((version, devices))
}

// ------------------------------------------------------------------------------------------------
// Device, streams, events, buffers
// ------------------------------------------------------------------------------------------------

/// One GPU: its primary context (shared with the engine, as PyTorch and TensorRT-LLM use it).
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    info: GpuInfo,
    max_pitch: usize,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.info.ordinal)
            .field("name", &self.info.name)
            .finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Retains GPU `ordinal`'s primary context. Errors if [`probe`] fails or there is no such GPU.
    pub fn open(ordinal: usize) -> Result<Arc<Self>> {
        let info = probe()?;
        let gpu = info
            .devices
            .get(ordinal)
            .cloned()
            .ok_or_else(|| Error::out_of_range("CUDA device", ordinal, info.devices.len()))?;
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", e))?;
        let max_pitch = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH)
            .ok()
            .and_then(|p| usize::try_from(p).ok())
            .filter(|&p| p > 0)
            .unwrap_or(i32::MAX as usize);
        Ok(Arc::new(Self {
            ctx,
            info: gpu,
            max_pitch,
        }))
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.info.ordinal
    }

    /// What the driver reports about it.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// cudarc's handle on the primary context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Largest pitch a strided copy may use on this device.
    pub fn max_pitch(&self) -> usize {
        self.max_pitch
    }

    /// Makes the context current on the calling thread (every entry point here does it).
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))
    }

    /// Allocates `bytes` of zeroed device memory owned by the returned buffer.
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<DeviceBuffer> {
        if bytes == 0 {
            return Err(Error::invalid_argument(
                "a device buffer needs at least one byte",
            ));
        }
        self.bind()?;
        // SAFETY: plain allocation in the current (this device's) context.
        let ptr = unsafe { cu::malloc_sync(bytes) }.map_err(|e| cuda_err("cuMemAlloc", e))?;
        let buf = DeviceBuffer {
            device: self.clone(),
            ptr,
            len: bytes,
        };
        // SAFETY: `ptr` is `bytes` of device memory just allocated.
        unsafe { cu::memset_d8_sync(ptr, 0, bytes) }.map_err(|e| cuda_err("cuMemsetD8", e))?;
        Ok(buf)
    }

    /// Allocates `bytes` of zeroed page-locked host memory (`cuMemHostAlloc`, portable).
    pub fn alloc_pinned(self: &Arc<Self>, bytes: usize) -> Result<PinnedBuffer> {
        if bytes == 0 {
            return Err(Error::invalid_argument(
                "a pinned buffer needs at least one byte",
            ));
        }
        self.bind()?;
        // SAFETY: plain allocation; the memory is zeroed below before any read.
        let raw = unsafe { cu::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| cuda_err("cuMemHostAlloc", e).with("bytes", bytes))?;
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| Error::internal("cuMemHostAlloc returned a null pointer"))?;
        // SAFETY: `bytes` writable bytes at `ptr`, owned by nobody else yet.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
        Ok(PinnedBuffer {
            device: self.clone(),
            ptr,
            len: bytes,
        })
    }
}

/// Device memory owned by this buffer (freed on drop). The device tier never owns the engine's
/// cache; this is for tests, the bench and callers that want their own.
pub struct DeviceBuffer {
    device: Arc<CudaDevice>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceBuffer {
    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Never true (zero-length buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Sets every byte to `value` (synchronously).
    pub fn fill(&self, value: u8) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the whole buffer is ours.
        unsafe { cu::memset_d8_sync(self.ptr, value, self.len) }
            .map_err(|e| cuda_err("cuMemsetD8", e))
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: allocated by cuMemAlloc in `CudaDevice::alloc`, freed once.
            let _ = unsafe { cu::free_sync(self.ptr) };
        }
    }
}

// SAFETY: a device address and an Arc; the memory is only reached through driver calls.
unsafe impl Send for DeviceBuffer {}
// SAFETY: see above.
unsafe impl Sync for DeviceBuffer {}

/// Page-locked host memory owned by this buffer (freed on drop).
pub struct PinnedBuffer {
    device: Arc<CudaDevice>,
    ptr: NonNull<u8>,
    len: usize,
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl PinnedBuffer {
    /// Base address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Never true (zero-length buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes owned by this buffer; `&self` excludes `&mut` access.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc in `CudaDevice::alloc_pinned`, freed once.
            let _ = unsafe { cu::free_host(self.ptr.as_ptr().cast::<c_void>()) };
        }
    }
}

// SAFETY: owned host memory; shared access is read-only through `&self`.
unsafe impl Send for PinnedBuffer {}
// SAFETY: see above.
unsafe impl Sync for PinnedBuffer {}

/// A non-blocking stream owned by a tier.
struct Stream {
    raw: sys::CUstream,
    device: Arc<CudaDevice>,
}

impl Stream {
    fn new(device: &Arc<CudaDevice>) -> Result<Self> {
        device.bind()?;
        let raw = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(|e| cuda_err("cuStreamCreate", e))?;
        Ok(Self {
            raw,
            device: device.clone(),
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: created in `Stream::new`, destroyed once; pending work completes first
            // (cuStreamDestroy does not wait, but every batch waited for its own event).
            let _ = unsafe { cu::stream::destroy(self.raw) };
        }
    }
}

/// Reusable completion events: blocking-sync (the waiter sleeps) and without timing.
struct EventPool {
    device: Arc<CudaDevice>,
    free: Mutex<Vec<usize>>,
}

const EVENT_FLAGS: u32 = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
    | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;

impl EventPool {
    fn get(&self) -> Result<sys::CUevent> {
        if let Some(e) = self.free.lock().pop() {
            return Ok(e as sys::CUevent);
        }
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event handle; the context is current (callers bind first).
        unsafe { sys::cuEventCreate(&mut ev, EVENT_FLAGS) }
            .result()
            .map_err(|e| cuda_err("cuEventCreate", e))?;
        Ok(ev)
    }

    fn put(&self, ev: sys::CUevent) {
        self.free.lock().push(ev as usize);
    }
}

impl Drop for EventPool {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            for e in self.free.get_mut().drain(..) {
                // SAFETY: created by cuEventCreate in `get`, idle (waited for), destroyed once.
                let _ = unsafe { cu::event::destroy(e as sys::CUevent) };
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Copy planning (pure; unit-tested without a GPU)
// ------------------------------------------------------------------------------------------------

/// Which way a batch copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Direction {
    /// Device → host (stores, offloads): the store stream.
    DeviceToHost,
    /// Host → device (loads, onboards): the load stream.
    HostToDevice,
}

/// `len` bytes of one block between device address `device` and host address `host`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Device address.
    pub device: u64,
    /// Host address.
    pub host: usize,
    /// Bytes.
    pub len: usize,
}

/// One copy as enqueued: `height` rows of `width` bytes, row `i` at `device + i × device_pitch`
/// and `host + i × host_pitch`. `height == 1` is a plain (1D) copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    /// Device address of row 0.
    pub device: u64,
    /// Host address of row 0.
    pub host: usize,
    /// Bytes per row.
    pub width: usize,
    /// Rows.
    pub height: usize,
    /// Device bytes from one row to the next.
    pub device_pitch: usize,
    /// Host bytes from one row to the next.
    pub host_pitch: usize,
}

impl CopyOp {
    /// Bytes moved.
    pub fn bytes(&self) -> usize {
        self.width * self.height
    }
}

/// Cuts one block's device runs and host runs — `(address, len)` in canonical order, the same
/// total on both sides — into pieces at every boundary of either, merging pieces that are
/// adjacent on both sides.
pub fn block_pieces(device_runs: &[(u64, usize)], host_runs: &[(usize, usize)]) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::with_capacity(device_runs.len().max(host_runs.len()));
    let (mut di, mut doff, mut hi, mut hoff) = (0usize, 0usize, 0usize, 0usize);
    while di < device_runs.len() && hi < host_runs.len() {
        let (dbase, dlen) = device_runs[di];
        let (hbase, hlen) = host_runs[hi];
        let n = (dlen - doff).min(hlen - hoff);
        if n > 0 {
            let p = Piece {
                device: dbase + doff as u64,
                host: hbase + hoff,
                len: n,
            };
            match out.last_mut() {
                Some(last)
                    if last.device + last.len as u64 == p.device
                        && last.host + last.len == p.host =>
                {
                    last.len += n
                }
                _ => out.push(p),
            }
        }
        doff += n;
        hoff += n;
        if doff == dlen {
            di += 1;
            doff = 0;
        }
        if hoff == hlen {
            hi += 1;
            hoff = 0;
        }
    }
    out
}

/// Per-piece (device, host) strides from block `a` to block `b`, if every piece of `b` is the
/// matching piece of `a` moved forward by a stride that keeps rows apart and fits `max_pitch`.
fn strides(a: &[Piece], b: &[Piece], max_pitch: usize) -> Option<Vec<(usize, usize)>> {
    if a.len() != b.len() || a.is_empty() {
        return None;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            if x.len != y.len {
                return None;
            }
            let dp = usize::try_from(y.device.checked_sub(x.device)?).ok()?;
            let hp = y.host.checked_sub(x.host)?;
            let back_to_back = dp == x.len && hp == x.len;
            let strided = dp >= x.len && hp >= x.len && dp <= max_pitch && hp <= max_pitch;
            (back_to_back || strided).then_some((dp, hp))
        })
        .collect()
}

fn push_op(ops: &mut Vec<CopyOp>, op: CopyOp) {
    let op = if op.height > 1 && op.device_pitch == op.width && op.host_pitch == op.width {
        let bytes = op.width * op.height;
        CopyOp {
            width: bytes,
            height: 1,
            device_pitch: bytes,
            host_pitch: bytes,
            ..op
        }
    } else {
        op
    };
    if op.height == 1 {
        if let Some(last) = ops.last_mut() {
            if last.height == 1
                && last.device + last.width as u64 == op.device
                && last.host + last.width == op.host
            {
                last.width += op.width;
                last.device_pitch = last.width;
                last.host_pitch = last.width;
                return;
            }
        }
    }
    ops.push(op);
}

/// Plans a batch: `blocks[i]` is pair `i`'s pieces (see [`block_pieces`]). Consecutive blocks
/// whose pieces repeat at fixed strides share one strided copy per piece; copies adjacent on both
/// sides merge. The ops together move exactly the pieces' bytes, each byte once.
pub fn plan_copies(blocks: &[Vec<Piece>], max_pitch: usize) -> Vec<CopyOp> {
    let mut ops = Vec::new();
    let mut i = 0;
    while i < blocks.len() {
        let mut j = i + 1;
        let mut group: Option<Vec<(usize, usize)>> = None;
        while j < blocks.len() {
            match strides(&blocks[j - 1], &blocks[j], max_pitch) {
                Some(s) if group.as_ref().is_none_or(|g| *g == s) => {
                    group = Some(s);
                    j += 1;
                }
                _ => break,
            }
        }
        let height = j - i;
        for (k, p) in blocks[i].iter().enumerate() {
            let (device_pitch, host_pitch) = group.as_ref().map_or((p.len, p.len), |g| g[k]);
            push_op(
                &mut ops,
                CopyOp {
                    device: p.device,
                    host: p.host,
                    width: p.len,
                    height,
                    device_pitch,
                    host_pitch,
                },
            );
        }
        i = j;
    }
    ops
}

/// Enqueues one copy on `stream`.
///
/// # Safety
/// Both ranges are valid for the copy (device memory of the stream's context; host memory that
/// stays valid and untouched until the stream passes this copy).
unsafe fn enqueue(
    op: &CopyOp,
    dir: Direction,
    stream: sys::CUstream,
) -> std::result::Result<(), (&'static str, DriverError)> {
    if op.height == 1 {
        return match dir {
            Direction::DeviceToHost => {
                // SAFETY: per the function's contract.
                unsafe {
                    sys::cuMemcpyDtoHAsync_v2(op.host as *mut c_void, op.device, op.width, stream)
                }
                .result()
                .map_err(|e| ("cuMemcpyDtoHAsync", e))
            }
            Direction::HostToDevice => {
                // SAFETY: per the function's contract.
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(op.device, op.host as *const c_void, op.width, stream)
                }
                .result()
                .map_err(|e| ("cuMemcpyHtoDAsync", e))
            }
        };
    }
    let host = sys::CUmemorytype::CU_MEMORYTYPE_HOST;
    let device = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
    let (src_type, dst_type) = match dir {
        Direction::DeviceToHost => (device, host),
        Direction::HostToDevice => (host, device),
    };
    let (src_host, dst_host, src_dev, dst_dev, src_pitch, dst_pitch) = match dir {
        Direction::DeviceToHost => (
            std::ptr::null(),
            op.host as *mut c_void,
            op.device,
            0,
            op.device_pitch,
            op.host_pitch,
        ),
        Direction::HostToDevice => (
            op.host as *const c_void,
            std::ptr::null_mut(),
            0,
            op.device,
            op.host_pitch,
            op.device_pitch,
        ),
    };
    let p = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: src_type,
        srcHost: src_host,
        srcDevice: src_dev,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: dst_type,
        dstHost: dst_host,
        dstDevice: dst_dev,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: op.width,
        Height: op.height,
    };
    // SAFETY: per the function's contract; `p` outlives the call (the driver copies it).
    unsafe { sys::cuMemcpy2DAsync_v2(&p, stream) }
        .result()
        .map_err(|e| ("cuMemcpy2DAsync", e))
}

// ------------------------------------------------------------------------------------------------
// The device tier
// ------------------------------------------------------------------------------------------------

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
/// transfer engine's CUDA hook ([`copy_batch`]) batches whole transfers instead.
pub struct CudaDeviceTier {
    device: Arc<CudaDevice>,
    layout: Layout,
    bases: Vec<u64>,
    locks: Box<[RwLock<()>]>,
    store: Stream,
    load: Stream,
    events: EventPool,
    bounce: Mutex<Vec<PinnedBuffer>>,
    counters: Counters,
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

/// Live device tiers by the address of their value, so the transfer hook can recognise them
/// behind `&dyn StorageTier` (the trait has no downcast).
fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// The GPU of `tier` when it is a [`CudaDeviceTier`] (behind any `&dyn StorageTier`).
pub fn device_of(tier: &dyn StorageTier) -> Option<Arc<CudaDevice>> {
    lookup(tier).map(|t| t.device().clone())
}

fn lookup(tier: &dyn StorageTier) -> Option<Arc<CudaDeviceTier>> {
    if tier.kind() != TierKind::Device || tier.capability().host_addressable {
        return None;
    }
    let key = tier as *const dyn StorageTier as *const () as usize;
    registry().lock().get(&key).and_then(Weak::upgrade)
}

/// Whether `addr` is page-locked host memory known to the driver (`cuMemHostAlloc`ed or
/// registered); pageable memory answers an error, read as no.
fn host_is_pinned(addr: usize) -> bool {
    pointer_attribute(
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        addr as u64,
    )
    .is_ok_and(|t| t == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32)
}

fn pointer_attribute(attr: sys::CUpointer_attribute, ptr: u64) -> Result<u32> {
    let mut v: u32 = 0;
    // SAFETY: both attributes queried here are 32-bit values; the driver validates `ptr`.
    unsafe { sys::cuPointerGetAttribute((&mut v as *mut u32).cast::<c_void>(), attr, ptr) }
        .result()
        .map_err(|e| cuda_err("cuPointerGetAttribute", e).with("ptr", format!("{ptr:#x}")))?;
    Ok(v)
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
            events: EventPool {
                device: device.clone(),
                free: Mutex::new(Vec::new()),
            },
            locks: (0..layout.num_blocks()).map(|_| RwLock::new(())).collect(),
            bases: allocations.to_vec(),
            layout,
            device,
            bounce: Mutex::new(Vec::new()),
            counters: Counters::default(),
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

    fn runs(&self, block: usize) -> Result<Vec<(u64, usize)>> {
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
    fn run(&self, stream: &Stream, dir: Direction, ops: &[CopyOp]) -> Result<()> {
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

    fn take_bounce(&self, bytes: usize) -> Result<PinnedBuffer> {
        {
            let mut pool = self.bounce.lock();
            if let Some(i) = pool.iter().position(|b| b.len() >= bytes) {
                return Ok(pool.swap_remove(i));
            }
        }
        self.device.alloc_pinned(bytes)
    }

    fn put_bounce(&self, buf: PinnedBuffer) {
        let mut pool = self.bounce.lock();
        if pool.len() < BOUNCE_POOL {
            pool.push(buf);
        }
    }

    fn lock_for(&self, block: usize) -> Result<&RwLock<()>> {
        self.locks
            .get(block)
            .ok_or_else(|| Error::out_of_range("block", block, self.locks.len()))
    }

    /// Copies device blocks into `dst` (`(device block, dst block)` pairs); one result per pair.
    /// A host-addressable `dst` is written in place; any other through a pinned bounce buffer.
    pub fn copy_to(&self, dst: &dyn StorageTier, pairs: &[(usize, usize)]) -> Vec<Result<()>> {
        self.batched(dst, pairs, Direction::DeviceToHost)
    }

    /// Copies blocks of `src` into device blocks (`(src block, device block)` pairs); one result
    /// per pair. A host-addressable `src` is read in place; any other through a pinned bounce.
    pub fn copy_from(&self, src: &dyn StorageTier, pairs: &[(usize, usize)]) -> Vec<Result<()>> {
        self.batched(src, pairs, Direction::HostToDevice)
    }

    fn batched(
        &self,
        other: &dyn StorageTier,
        pairs: &[(usize, usize)],
        dir: Direction,
    ) -> Vec<Result<()>> {
        let mut out: Vec<Result<()>> = vec![Ok(()); pairs.len()];
        if self.layout.dims() != other.layout().dims() {
            let e = Error::invalid_layout(format!(
                "cannot copy between device blocks {:?} and {} blocks {:?}: dimensions differ",
                self.layout.dims(),
                other.kind(),
                other.layout().dims()
            ));
            out.iter_mut().for_each(|r| *r = Err(e.clone()));
            return out;
        }
        // (index into pairs, device block, other block)
        let mut valid = Vec::with_capacity(pairs.len());
        for (i, &(a, b)) in pairs.iter().enumerate() {
            let (dev, oth) = match dir {
                Direction::DeviceToHost => (a, b),
                Direction::HostToDevice => (b, a),
            };
            if dev >= self.num_blocks() {
                out[i] = Err(Error::out_of_range("block", dev, self.num_blocks())
                    .with("tier", TierKind::Device));
            } else if oth >= other.num_blocks() {
                out[i] = Err(Error::out_of_range("block", oth, other.num_blocks())
                    .with("tier", other.kind()));
            } else {
                valid.push((i, dev, oth));
            }
        }
        let direct = other.capability().host_addressable;
        let per_batch = if direct {
            MAX_BATCH_BLOCKS
        } else {
            (MAX_BOUNCE_BYTES / self.bytes_per_block()).clamp(1, MAX_BATCH_BLOCKS)
        };
        for chunk in valid.chunks(per_batch) {
            if direct {
                if let Err(e) = self.direct(other, chunk, dir) {
                    for &(i, _, _) in chunk {
                        out[i] = Err(e.clone());
                    }
                }
            } else {
                self.bounced(other, chunk, dir, &mut out);
            }
        }
        out
    }

    /// Device ↔ a host-addressable tier's own memory, one planned batch.
    fn direct(
        &self,
        other: &dyn StorageTier,
        chunk: &[(usize, usize, usize)],
        dir: Direction,
    ) -> Result<()> {
        let write_device = dir == Direction::HostToDevice;
        let mut dev: Vec<usize> = chunk.iter().map(|c| c.1).collect();
        let mut oth: Vec<usize> = chunk.iter().map(|c| c.2).collect();
        dev.sort_unstable();
        oth.sort_unstable();
        let (nd, no) = (dev.len(), oth.len());
        dev.dedup();
        oth.dedup();
        if (write_device && dev.len() != nd) || (!write_device && oth.len() != no) {
            return Err(Error::invalid_argument(
                "a destination block appears twice in one batch",
            ));
        }
        let _dev_guards = DeviceGuards::take(self, &dev, write_device)?;
        let mut acc = Vec::with_capacity(oth.len());
        with_host_runs(other, &oth, !write_device, &mut acc, &mut |runs| {
            let pieces = chunk
                .iter()
                .map(|&(_, d, o)| {
                    let k = oth
                        .binary_search(&o)
                        .map_err(|_| Error::internal("host block not locked"))?;
                    Ok(block_pieces(&self.runs(d)?, &runs[k]))
                })
                .collect::<Result<Vec<_>>>()?;
            let ops = plan_copies(&pieces, self.device.max_pitch);
            let stream = if write_device {
                &self.load
            } else {
                &self.store
            };
            self.run(stream, dir, &ops)
        })
    }

    /// Device ↔ a tier that is not host addressable, through a pinned bounce buffer (slot `k` for
    /// the chunk's `k`-th pair). Per-pair results.
    fn bounced(
        &self,
        other: &dyn StorageTier,
        chunk: &[(usize, usize, usize)],
        dir: Direction,
        out: &mut [Result<()>],
    ) {
        let bpb = self.bytes_per_block();
        let mut buf = match self.take_bounce(chunk.len() * bpb) {
            Ok(b) => b,
            Err(e) => {
                for &(i, _, _) in chunk {
                    out[i] = Err(e.clone());
                }
                return;
            }
        };
        let base = buf.as_ptr() as usize;
        let plan = |slots: &[(usize, usize)]| -> Result<Vec<CopyOp>> {
            let pieces = slots
                .iter()
                .map(|&(k, d)| Ok(block_pieces(&self.runs(d)?, &[(base + k * bpb, bpb)])))
                .collect::<Result<Vec<_>>>()?;
            Ok(plan_copies(&pieces, self.device.max_pitch))
        };
        match dir {
            Direction::DeviceToHost => {
                let slots: Vec<(usize, usize)> =
                    chunk.iter().enumerate().map(|(k, c)| (k, c.1)).collect();
                let mut dev: Vec<usize> = chunk.iter().map(|c| c.1).collect();
                dev.sort_unstable();
                dev.dedup();
                let read = DeviceGuards::take(self, &dev, false)
                    .and_then(|_g| self.run(&self.store, dir, &plan(&slots)?));
                for (k, &(i, _, o)) in chunk.iter().enumerate() {
                    out[i] = match &read {
                        Err(e) => Err(e.clone()),
                        Ok(()) => {
                            other.write_block(o, &[IoSlice::new(&buf.as_slice()[k * bpb..][..bpb])])
                        }
                    };
                }
            }
            Direction::HostToDevice => {
                let mut slots = Vec::with_capacity(chunk.len());
                for (k, &(i, d, o)) in chunk.iter().enumerate() {
                    let slot = &mut buf.as_mut_slice()[k * bpb..][..bpb];
                    match other.read_block(o, &mut [IoSliceMut::new(slot)]) {
                        Ok(()) => slots.push((k, d)),
                        Err(e) => out[i] = Err(e),
                    }
                }
                if !slots.is_empty() {
                    let mut dev: Vec<usize> = slots.iter().map(|s| s.1).collect();
                    dev.sort_unstable();
                    let n = dev.len();
                    dev.dedup();
                    let written = if dev.len() != n {
                        Err(Error::invalid_argument(
                            "a destination block appears twice in one batch",
                        ))
                    } else {
                        DeviceGuards::take(self, &dev, true)
                            .and_then(|_g| self.run(&self.load, dir, &plan(&slots)?))
                    };
                    if let Err(e) = written {
                        for &(k, _) in &slots {
                            out[chunk[k].0] = Err(e.clone());
                        }
                    }
                }
            }
        }
        self.put_bounce(buf);
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
            &plan_copies(&pieces, self.device.max_pitch),
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

/// Locks on a sorted, deduplicated set of device blocks, released on drop.
enum DeviceGuards<'a> {
    Read(#[allow(dead_code)] Vec<parking_lot::RwLockReadGuard<'a, ()>>),
    Write(#[allow(dead_code)] Vec<parking_lot::RwLockWriteGuard<'a, ()>>),
}

impl<'a> DeviceGuards<'a> {
    fn take(tier: &'a CudaDeviceTier, sorted: &[usize], write: bool) -> Result<Self> {
        if write {
            sorted
                .iter()
                .map(|&b| tier.lock_for(b).map(|l| l.write()))
                .collect::<Result<Vec<_>>>()
                .map(DeviceGuards::Write)
        } else {
            sorted
                .iter()
                .map(|&b| tier.lock_for(b).map(|l| l.read()))
                .collect::<Result<Vec<_>>>()
                .map(DeviceGuards::Read)
        }
    }
}

/// One host block's runs as `(address, len)`, canonical order.
type HostRuns = Vec<(usize, usize)>;

/// Lends the runs of every block in `blocks` (ascending, distinct) of a host-addressable tier to
/// `f` at once, as `(address, len)` lists in `blocks` order, nesting the tier's own
/// `with_block`/`with_block_mut` so each block's lock is held until `f` returns.
fn with_host_runs(
    tier: &dyn StorageTier,
    blocks: &[usize],
    write: bool,
    acc: &mut Vec<HostRuns>,
    f: &mut dyn FnMut(&[HostRuns]) -> Result<()>,
) -> Result<()> {
    let Some((&b, rest)) = blocks.split_first() else {
        return f(acc);
    };
    if write {
        tier.with_block_mut(b, &mut |segs| {
            acc.push(
                segs.iter_mut()
                    .map(|s| (s.as_mut_ptr() as usize, s.len()))
                    .collect(),
            );
            let r = with_host_runs(tier, rest, write, acc, f);
            acc.pop();
            r
        })
    } else {
        tier.with_block(b, &mut |segs| {
            acc.push(
                segs.iter()
                    .map(|s| (s.as_ptr() as usize, s.len()))
                    .collect(),
            );
            let r = with_host_runs(tier, rest, write, acc, f);
            acc.pop();
            r
        })
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
            &plan_copies(&pieces, self.device.max_pitch),
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
            &plan_copies(&pieces, self.device.max_pitch),
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
                &plan_copies(&pieces, self.device.max_pitch),
            )
        });
        self.put_bounce(buf);
        r
    }
}

/// The transfer engine's CUDA hook: when one side of a batch is a [`CudaDeviceTier`] and the
/// other is not, copies the batch with planned async copies and one event wait, and answers one
/// result per pair; otherwise `None` (the engine's per-block path).
pub fn copy_batch(
    src: &dyn StorageTier,
    dst: &dyn StorageTier,
    pairs: &[(usize, usize)],
) -> Option<Vec<Result<()>>> {
    match (lookup(src), lookup(dst)) {
        (Some(dev), None) => Some(dev.copy_to(dst, pairs)),
        (None, Some(dev)) => Some(dev.copy_from(src, pairs)),
        _ => None,
    }
}

// ------------------------------------------------------------------------------------------------
// The pinned host tier
// ------------------------------------------------------------------------------------------------

/// Blocks in page-locked host memory, in any layout: the host tier (G2) when CUDA is on. Like
/// the memory tier, host addressable, with a per-block reader/writer lock; device copies to and
/// from it run at the link's full rate without the driver's staging.
pub struct PinnedHostTier {
    blocks: HostBlocks,
    /// Declared after `blocks`, which points into them.
    _allocations: Vec<PinnedBuffer>,
}

impl std::fmt::Debug for PinnedHostTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedHostTier")
            .field("kind", &self.blocks.kind())
            .field("layout", self.blocks.layout())
            .finish_non_exhaustive()
    }
}

impl PinnedHostTier {
    /// Allocates a zeroed tier of `kind` with `layout` in pinned memory registered with `device`'s
    /// context (portable: usable from every context).
    pub fn new(device: &Arc<CudaDevice>, kind: TierKind, layout: Layout) -> Result<Self> {
        let allocations = (0..layout.num_allocations())
            .map(|_| device.alloc_pinned(layout.allocation_bytes()))
            .collect::<Result<Vec<_>>>()?;
        let bases = allocations.iter().map(|a| a.as_ptr()).collect();
        // SAFETY: each buffer is `allocation_bytes` long and owned by the tier, which drops it
        // after `blocks`; nothing else reaches it.
        let blocks = unsafe { HostBlocks::new(kind, layout, bases)? };
        Ok(Self {
            blocks,
            _allocations: allocations,
        })
    }

    /// A host (G2) tier.
    pub fn host(device: &Arc<CudaDevice>, layout: Layout) -> Result<Self> {
        Self::new(device, TierKind::Host, layout)
    }
}

crate::backends::memory::host_blocks_tier!(PinnedHostTier);
