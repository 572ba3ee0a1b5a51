//! The one door to the driver: finding `libcuda` and its GPUs ([`probe`]), and how a failed driver
//! call becomes an [`Error`].
//!
//! Invariants: nothing here panics, whatever the machine has. The library is opened with `dlopen`
//! before cudarc touches it, and cudarc's first calls (it panics when a library or a symbol is
//! missing) run inside `catch_unwind`; every failure is an [`ErrorKind::Unsupported`] error that
//! names the library or the call. The answer is computed once per process, and every constructor
//! in the backend goes through it, so no driver or no GPU is an error, never a panic.

use std::ffi::CStr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;
use serde::Serialize;

use crate::error::{Error, ErrorKind, Result};

/// The driver library names tried, in order: cudarc's own order (it loads the first of its
/// candidates that opens, `libcuda.so` before `libcuda.so.1`), so the library the probe checks
/// and reports is the one cudarc then binds. (Checked on a GPU machine: with the probe trying
/// `libcuda.so.1` first, a broken `libcuda.so.1` passed the dlopen check while cudarc bound the
/// real driver under `libcuda.so`.)
pub const DRIVER_LIBRARIES: [&str; 2] = ["libcuda.so", "libcuda.so.1"];

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
        .zip([c"libcuda.so", c"libcuda.so.1"])
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
