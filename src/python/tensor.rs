//! Cache registration from tensor-like Python objects, and the tier over their memory.
//!
//! A cache tensor is any object with `data_ptr()` (or numpy's `__array_interface__`), `shape`,
//! an element size (`element_size()`, or `dtype.itemsize`), and optionally `device` and
//! `is_contiguous()` (else `stride()`): a torch tensor, a numpy array, or a numpy-backed stand-in.
//! CPU tensors become a [`TensorTier`]; CUDA tensors (`device.type == "cuda"`, `device.index`)
//! the CUDA device tier (`super::cache` picks). Refused: another device type, a CUDA device
//! without an index, a non-contiguous or read-only tensor, a null pointer, tensors that overlap.
//!
//! The engine owns the memory. [`TensorTier`] keeps a reference to every tensor object it reads,
//! so the memory outlives the tier; the engine keeps writing its blocks (that is its job), and
//! the connector touches a device block only while the metadata says it may (stores after the
//! forward pass wrote the block, loads into blocks the engine gave a loading request).

use std::str::FromStr;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use super::error::{bad_value, to_py_err};
use crate::backends::memory::HostBlocks;
use crate::error::{Error, Result};
use crate::frameworks::trtllm::detect_trtllm;
use crate::frameworks::vllm::detect_vllm;
use crate::layout::{KvLayout, Layout, LayoutKind};
use crate::tier::TierKind;

/// What the connector reads from one cache tensor.
#[derive(Debug)]
pub(crate) struct TensorInfo {
    /// Which tensor (a layer name, or `kv_cache_tensor`), for error messages.
    pub name: String,
    /// Address of the first element.
    pub ptr: usize,
    /// `tensor.shape`.
    pub shape: Vec<usize>,
    /// Bytes per element.
    pub itemsize: usize,
    /// `product(shape) × itemsize`.
    pub nbytes: usize,
    /// Where the memory is.
    pub device: TensorDevice,
    /// The tensor object, kept alive while the tier lives.
    pub owner: Py<PyAny>,
}

/// Where a cache tensor's memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TensorDevice {
    /// Host memory (`device.type == "cpu"`, or no `device` attribute).
    Cpu,
    /// GPU `index` (`device.type == "cuda"`, `device.index`).
    Cuda(usize),
}

impl std::fmt::Display for TensorDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

fn invalid(py: Python<'_>, name: &str, message: String) -> PyErr {
    to_py_err(py, Error::invalid_argument(message).with("tensor", name))
}

/// The device of `obj`: `device.type` and `device.index` (torch); without them (or without an
/// index) `str(device)` read as `type[:index]` (numpy 2 says `"cpu"`, torch `"cuda:1"`); `None`
/// without a `device` attribute.
fn device_type(obj: &Bound<'_, PyAny>) -> PyResult<Option<(String, Option<usize>)>> {
    if !obj.hasattr("device")? {
        return Ok(None);
    }
    let device = obj.getattr("device")?;
    let text = device.str()?.to_string();
    let (parsed_ty, parsed_index) = match text.split_once(':') {
        Some((ty, i)) => (ty.to_string(), i.parse::<usize>().ok()),
        None => (text.clone(), None),
    };
    // A plain string (numpy's "cpu") has `index` and no `type`: only a device object's
    // attributes are read.
    let object = !device.is_instance_of::<PyString>();
    let ty = if object && device.hasattr("type")? {
        device.getattr("type")?.str()?.to_string()
    } else {
        parsed_ty
    };
    let index = if object && device.hasattr("index")? {
        device.getattr("index")?.extract::<Option<usize>>()?
    } else {
        None
    };
    Ok(Some((ty, index.or(parsed_index))))
}

/// Reads one cache tensor; refuses what the connector cannot use, with the reason. Loads write
/// into a cache tensor, so a read-only one is refused.
pub(crate) fn read_tensor(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    name: &str,
) -> PyResult<TensorInfo> {
    read_tensor_as(py, obj, name, true)
}

/// As [`read_tensor`], for a tensor whose bytes are only read (the source of a store): a
/// read-only one is taken.
pub(crate) fn read_source_tensor(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    name: &str,
) -> PyResult<TensorInfo> {
    read_tensor_as(py, obj, name, false)
}

fn read_tensor_as(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    name: &str,
    written: bool,
) -> PyResult<TensorInfo> {
    let ty = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default();
    let device = read_device(py, obj, name)?;
    let shape = read_shape(py, obj, name, &ty)?;
    let itemsize = read_itemsize(py, obj, name, &ty)?;
    let array_interface = if obj.hasattr("__array_interface__")? {
        Some(obj.getattr("__array_interface__")?)
    } else {
        None
    };
    let ptr = read_data_ptr(py, obj, name, &ty, array_interface.as_ref())?;
    check_contiguous(py, obj, name, &shape, itemsize, array_interface.as_ref())?;
    if let Some(ai) = array_interface.as_ref().filter(|_| written) {
        let readonly = ai
            .get_item("data")
            .and_then(|d| d.get_item(1))
            .and_then(|v| v.is_truthy())
            .unwrap_or(false);
        if readonly {
            return Err(invalid(
                py,
                name,
                format!("cache tensor {name} is read-only; loads write into it"),
            ));
        }
    }

    let nbytes = shape
        .iter()
        .try_fold(itemsize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            to_py_err(
                py,
                Error::invalid_layout(format!(
                    "cache tensor {name}: shape {shape:?} × {itemsize} bytes overflows"
                ))
                .with("tensor", name),
            )
        })?;
    if ptr == 0 && nbytes > 0 {
        return Err(invalid(
            py,
            name,
            format!("cache tensor {name} has a null data pointer"),
        ));
    }
    Ok(TensorInfo {
        name: name.to_string(),
        ptr,
        shape,
        itemsize,
        nbytes,
        device,
        owner: obj.clone().unbind(),
    })
}

/// Where cache tensor `name` (`obj`) lives: the CPU (also without a `device` attribute) or a
/// CUDA device with its index. Refused: CUDA without an index, any other device type.
fn read_device(py: Python<'_>, obj: &Bound<'_, PyAny>, name: &str) -> PyResult<TensorDevice> {
    match device_type(obj).map_err(|e| bad_value(py, &format!("{name}.device"), e))? {
        None => Ok(TensorDevice::Cpu),
        Some((d, _)) if d == "cpu" => Ok(TensorDevice::Cpu),
        Some((d, Some(i))) if d == "cuda" => Ok(TensorDevice::Cuda(i)),
        Some((d, None)) if d == "cuda" => Err(invalid(
            py,
            name,
            format!("cache tensor {name} is on device cuda without an index; register tensors whose device.index names their GPU"),
        )),
        Some((d, _)) => Err(to_py_err(
            py,
            Error::unsupported(format!(
                "cache tensor {name} is on device {d}; only CPU and CUDA tensors are supported"
            ))
            .with("tensor", name)
            .with("device", d),
        )),
    }
}

/// `obj.shape` of cache tensor `name` (of Python type `ty`), a sequence of non-negative
/// integers.
fn read_shape(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    name: &str,
    ty: &str,
) -> PyResult<Vec<usize>> {
    let shape_obj = obj.getattr("shape").map_err(|_| {
        invalid(
            py,
            name,
            format!("cache tensor {name} ({ty}) has no shape attribute"),
        )
    })?;
    shape_obj
        .try_iter()
        .and_then(|it| it.map(|d| d.and_then(|d| d.extract::<usize>())).collect())
        .map_err(|e| {
            invalid(
                py,
                name,
                format!(
                    "cache tensor {name}: shape must be a sequence of non-negative integers ({e})"
                ),
            )
        })
}

/// Bytes per element of cache tensor `name`: `element_size()` (torch), else `dtype.itemsize`
/// (numpy).
fn read_itemsize(py: Python<'_>, obj: &Bound<'_, PyAny>, name: &str, ty: &str) -> PyResult<usize> {
    if obj.hasattr("element_size")? {
        obj.call_method0("element_size")
            .and_then(|v| v.extract())
            .map_err(|e| bad_value(py, &format!("{name}.element_size()"), e))
    } else if obj.hasattr("dtype")? {
        obj.getattr("dtype")
            .and_then(|d| d.getattr("itemsize"))
            .and_then(|v| v.extract())
            .map_err(|e| {
                invalid(
                    py,
                    name,
                    format!("cache tensor {name}: cannot read the element size from dtype.itemsize ({e})"),
                )
            })
    } else {
        Err(invalid(
            py,
            name,
            format!("cache tensor {name} ({ty}) has neither element_size() nor dtype"),
        ))
    }
}

/// The address of cache tensor `name`'s first element: `data_ptr()` (torch), else the first
/// item of `__array_interface__['data']` (numpy).
fn read_data_ptr(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    name: &str,
    ty: &str,
    array_interface: Option<&Bound<'_, PyAny>>,
) -> PyResult<usize> {
    if obj.hasattr("data_ptr")? {
        obj.call_method0("data_ptr")
            .and_then(|v| v.extract())
            .map_err(|e| bad_value(py, &format!("{name}.data_ptr()"), e))
    } else if let Some(ai) = array_interface {
        ai.get_item("data")
            .and_then(|d| d.get_item(0))
            .and_then(|v| v.extract())
            .map_err(|e| bad_value(py, &format!("{name}.__array_interface__['data']"), e))
    } else {
        Err(invalid(
            py,
            name,
            format!("cache tensor {name} ({ty}) has neither data_ptr() nor __array_interface__"),
        ))
    }
}

/// Refuses cache tensor `name` unless it is contiguous: the tensor's own answer when it has one
/// (`is_contiguous()`), else torch's element strides (`stride()`), else numpy's byte strides
/// (none: contiguous); a tensor that says nothing is taken as contiguous.
fn check_contiguous(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    name: &str,
    shape: &[usize],
    itemsize: usize,
    array_interface: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let contiguous = if obj.hasattr("is_contiguous")? {
        obj.call_method0("is_contiguous")
            .and_then(|v| v.is_truthy())
            .map_err(|e| bad_value(py, &format!("{name}.is_contiguous()"), e))?
    } else if obj.hasattr("stride")? {
        let strides: Vec<isize> = obj
            .call_method0("stride")
            .and_then(|v| v.extract())
            .map_err(|e| bad_value(py, &format!("{name}.stride()"), e))?;
        c_strides(shape, 1) == strides
    } else if let Some(ai) = array_interface {
        let strides = ai.get_item("strides")?;
        if strides.is_none() {
            true
        } else {
            let strides: Vec<isize> = strides
                .extract()
                .map_err(|e| bad_value(py, &format!("{name}.__array_interface__['strides']"), e))?;
            c_strides(shape, itemsize) == strides
        }
    } else {
        true
    };
    if !contiguous {
        return Err(to_py_err(
            py,
            Error::invalid_layout(format!(
                "cache tensor {name} of shape {shape:?} is not contiguous; register the engine's contiguous cache tensor, not a view of it"
            ))
            .with("tensor", name),
        ));
    }
    Ok(())
}

fn c_strides(shape: &[usize], itemsize: usize) -> Vec<isize> {
    let mut out = vec![0isize; shape.len()];
    let mut acc = itemsize as isize;
    for (i, &d) in shape.iter().enumerate().rev() {
        out[i] = acc;
        acc = acc.saturating_mul(d as isize);
    }
    out
}

/// The device tier over an engine's cache tensors (CPU memory the engine owns).
///
/// Soundness: blocks are reached only under a per-block reader/writer lock, so the connector
/// never holds a mutable and another slice of one block; distinct blocks never overlap (layout
/// invariant, and [`TensorTier::from_tensors`] refuses overlapping tensors). The engine writing
/// its own blocks while the connector reads others is the sharing every engine connector has.
pub(crate) struct TensorTier {
    blocks: HostBlocks,
    /// The tensor objects: keep the memory alive (dropped without the GIL, pyo3 defers the
    /// reference decrement to the next time it holds it). Declared after `blocks`.
    _owners: Vec<Py<PyAny>>,
}

impl std::fmt::Debug for TensorTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorTier")
            .field("layout", self.blocks.layout())
            .field("tensors", &self._owners.len())
            .finish_non_exhaustive()
    }
}

impl TensorTier {
    /// A device tier with `layout` over `tensors` (one per allocation of the layout, in order).
    ///
    /// Checks the tensor count, that each tensor holds exactly `layout.allocation_bytes()` and
    /// that no two overlap.
    ///
    /// # Safety
    ///
    /// Each tensor's `ptr` must address `nbytes` bytes of CPU memory, valid for reads and writes
    /// for as long as its `owner` object lives, and not resized or freed meanwhile (torch and
    /// numpy guarantee this for their tensors; a stand-in object that reports another address is
    /// the caller's bug, as with `ctypes`).
    pub(crate) unsafe fn from_tensors(layout: Layout, tensors: Vec<TensorInfo>) -> Result<Self> {
        check_tensors(&layout, &tensors)?;
        let bases = tensors.iter().map(|t| t.ptr as *mut u8).collect();
        // SAFETY: this function's contract: each tensor's memory is valid while its owner lives,
        // and the owners are kept (dropped after `blocks`); sizes were checked above.
        let blocks = unsafe { HostBlocks::new(TierKind::Device, layout, bases)? };
        Ok(Self {
            blocks,
            _owners: tensors.into_iter().map(|t| t.owner).collect(),
        })
    }
}

/// Checks `tensors` fit `layout`: one per allocation, in order, each exactly
/// `layout.allocation_bytes()` long, no two overlapping (any device).
pub(crate) fn check_tensors(layout: &Layout, tensors: &[TensorInfo]) -> Result<()> {
    if tensors.len() != layout.num_allocations() {
        return Err(Error::internal(format!(
            "{} tensors for a layout of {} allocations",
            tensors.len(),
            layout.num_allocations()
        )));
    }
    let want = layout.allocation_bytes();
    for t in tensors {
        if t.nbytes != want {
            return Err(Error::invalid_layout(format!(
                "cache tensor {} holds {} bytes but its layout needs {want}",
                t.name, t.nbytes
            ))
            .with("tensor", &t.name));
        }
    }
    let mut spans: Vec<(usize, usize, &str)> = tensors
        .iter()
        .map(|t| (t.ptr, t.nbytes, t.name.as_str()))
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[0].0 + w[0].1 > w[1].0 {
            return Err(Error::invalid_layout(format!(
                "cache tensors {} and {} share memory; each layer needs its own tensor",
                w[0].2, w[1].2
            )));
        }
    }
    Ok(())
}

crate::backends::memory::host_blocks_tier!(TensorTier);

/// Parses a layout override name (`fully_contiguous`, `layer_separate_block_major`,
/// `layer_separate_outer_major`, `layer_separate_head_major`).
pub(crate) fn parse_layout_kind(
    py: Python<'_>,
    name: Option<&str>,
) -> PyResult<Option<LayoutKind>> {
    name.map(|n| {
        LayoutKind::from_str(n).map_err(|_| {
            to_py_err(
                py,
                Error::invalid_argument(format!(
                    "unknown layout {n:?}: expected fully_contiguous, layer_separate_block_major, layer_separate_outer_major or layer_separate_head_major"
                ))
                .with("argument", "layout"),
            )
        })
    })
    .transpose()
}

/// The layout as a dict (`kind`, `num_blocks`, `bytes_per_block`, and the dims).
pub(crate) fn layout_dict<'py>(py: Python<'py>, layout: &Layout) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let dims = layout.dims();
    d.set_item("kind", layout.kind().to_string())?;
    d.set_item("num_blocks", layout.num_blocks())?;
    d.set_item("num_layers", dims.num_layers)?;
    d.set_item("outer_dim", dims.outer_dim)?;
    d.set_item("page_size", dims.page_size)?;
    d.set_item("inner_dim", dims.inner_dim)?;
    d.set_item("dtype_bytes", dims.dtype_bytes)?;
    d.set_item("bytes_per_block", layout.bytes_per_block())?;
    if let Layout::LayerSeparate(l) = layout {
        d.set_item("num_heads", l.num_heads())?;
    }
    Ok(d)
}

/// `detect_trtllm_layout(tensor, tokens_per_block)`: the layout TensorRT-LLM's one cache tensor
/// describes, as a dict; raises `KvbmError` for a tensor the worker would refuse.
#[pyfunction]
fn detect_trtllm_layout<'py>(
    py: Python<'py>,
    tensor: &Bound<'py, PyAny>,
    tokens_per_block: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let t = read_tensor(py, tensor, "kv_cache_tensor")?;
    let layout = detect_trtllm(&t.shape, t.itemsize, tokens_per_block, None)
        .map_err(|e| to_py_err(py, e.with("tensor", "kv_cache_tensor")))?;
    layout_dict(py, &layout)
}

/// `detect_vllm_layout(kv_caches, block_size, num_blocks=None, layout=None)`: the layout vLLM's
/// per-layer tensors (a dict layer name → tensor) describe, as a dict.
#[pyfunction]
#[pyo3(signature = (kv_caches, block_size, num_blocks=None, layout=None))]
fn detect_vllm_layout<'py>(
    py: Python<'py>,
    kv_caches: &Bound<'py, PyAny>,
    block_size: usize,
    num_blocks: Option<usize>,
    layout: Option<&str>,
) -> PyResult<Bound<'py, PyDict>> {
    let tensors = read_layer_tensors(py, kv_caches)?;
    let l = vllm_layout(
        py,
        &tensors,
        block_size,
        num_blocks,
        parse_layout_kind(py, layout)?,
    )?;
    layout_dict(py, &l)
}

/// Reads vLLM's `kv_caches` (a dict, or a sequence of `(name, tensor)` pairs) in order.
pub(crate) fn read_layer_tensors(
    py: Python<'_>,
    kv_caches: &Bound<'_, PyAny>,
) -> PyResult<Vec<TensorInfo>> {
    let items: Vec<(String, Bound<'_, PyAny>)> = if let Ok(d) = kv_caches.cast::<PyDict>() {
        d.iter()
            .map(|(k, v)| Ok((k.str()?.to_string(), v)))
            .collect::<PyResult<_>>()?
    } else {
        kv_caches
            .try_iter()
            .and_then(|it| it.map(|p| p.and_then(|p| p.extract())).collect())
            .map_err(|e| bad_value(py, "kv_caches (a dict of layer name -> tensor)", e))?
    };
    if items.is_empty() {
        return Err(to_py_err(
            py,
            Error::invalid_layout("no per-layer cache tensors registered"),
        ));
    }
    items
        .iter()
        .map(|(name, t)| read_tensor(py, t, name))
        .collect()
}

/// The layer-separate layout vLLM's tensors describe; every layer must share one element size.
pub(crate) fn vllm_layout(
    py: Python<'_>,
    tensors: &[TensorInfo],
    block_size: usize,
    num_blocks: Option<usize>,
    layout: Option<LayoutKind>,
) -> PyResult<Layout> {
    let itemsize = tensors.first().map_or(0, |t| t.itemsize);
    if let Some(t) = tensors.iter().find(|t| t.itemsize != itemsize) {
        return Err(to_py_err(
            py,
            Error::invalid_layout(format!(
                "layer {} has {}-byte elements but layer {} has {itemsize}-byte elements",
                t.name, t.itemsize, tensors[0].name
            ))
            .with("tensor", &t.name),
        ));
    }
    let shapes: Vec<Vec<usize>> = tensors.iter().map(|t| t.shape.clone()).collect();
    detect_vllm(&shapes, itemsize, block_size, num_blocks, layout).map_err(|e| to_py_err(py, e))
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(detect_trtllm_layout, m)?)?;
    m.add_function(wrap_pyfunction!(detect_vllm_layout, m)?)?;
    Ok(())
}
