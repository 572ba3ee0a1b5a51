//! One GPU and what we own on it: its primary context ([`CudaDevice`]), owned device and pinned
//! allocations ([`DeviceBuffer`], [`PinnedBuffer`]), and the driver objects a device tier copies
//! with (non-blocking streams, pooled completion events, the enqueueing of one planned copy).
//!
//! Invariants: every owned driver object is released exactly once, on drop, in its device's
//! context; every driver call answers a [`Result`] (through [`cuda_err`]); a device is reached
//! only after [`probe()`](super::probe()) found the driver.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;
use cudarc::driver::CudaContext;
use parking_lot::Mutex;

use super::cuda_err;
use super::plan::{CopyOp, Direction};
use super::probe::{probe, GpuInfo};
use crate::error::{Error, Result};

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
pub(super) struct Stream {
    pub(super) raw: sys::CUstream,
    device: Arc<CudaDevice>,
}

impl Stream {
    pub(super) fn new(device: &Arc<CudaDevice>) -> Result<Self> {
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
pub(super) struct EventPool {
    device: Arc<CudaDevice>,
    free: Mutex<Vec<usize>>,
}

const EVENT_FLAGS: u32 = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
    | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;

impl EventPool {
    /// An empty pool; events are created on demand in `device`'s context.
    pub(super) fn new(device: &Arc<CudaDevice>) -> Self {
        Self {
            device: device.clone(),
            free: Mutex::new(Vec::new()),
        }
    }

    pub(super) fn get(&self) -> Result<sys::CUevent> {
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

    pub(super) fn put(&self, ev: sys::CUevent) {
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

/// Whether `addr` is page-locked host memory known to the driver (`cuMemHostAlloc`ed or
/// registered); pageable memory answers an error, read as no.
pub(super) fn host_is_pinned(addr: usize) -> bool {
    pointer_attribute(
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        addr as u64,
    )
    .is_ok_and(|t| t == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32)
}

pub(super) fn pointer_attribute(attr: sys::CUpointer_attribute, ptr: u64) -> Result<u32> {
    let mut v: u32 = 0;
    // SAFETY: both attributes queried here are 32-bit values; the driver validates `ptr`.
    unsafe { sys::cuPointerGetAttribute((&mut v as *mut u32).cast::<c_void>(), attr, ptr) }
        .result()
        .map_err(|e| cuda_err("cuPointerGetAttribute", e).with("ptr", format!("{ptr:#x}")))?;
    Ok(v)
}

/// Enqueues one copy on `stream`.
///
/// # Safety
/// Both ranges are valid for the copy (device memory of the stream's context; host memory that
/// stays valid and untouched until the stream passes this copy).
pub(super) unsafe fn enqueue(
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
