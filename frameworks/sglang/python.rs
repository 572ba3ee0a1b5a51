//! `PageStore`: the page store SGLang's storage backend (`kvbm_connector.sglang`) is built on,
//! over [`crate::page_store::PageStore`] and the standard tiers.
//!
//! Pages reach it two ways. As tensors (SGLang's classic `set`/`get`): each tensor is read as a
//! cache tensor is (CPU, contiguous, its size), and kept by the call while its bytes are used.
//! As segments of the registered host pool (the zero-copy `*_v1`/`*_v2` calls): a page is a list
//! of `(address, length)` runs, and every run must lie inside a buffer registered with
//! [`PyPageStore::register_region`] (the pool's tensors, kept alive by the store), so an address
//! from Python is never used unless it is inside memory the store holds a reference to.
//! Destinations of one read never overlap. Calls run without the GIL and in parallel (SGLang's
//! prefetch and backup threads), panics caught.

use std::io::{IoSlice, IoSliceMut};
use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::error::{Error, Result};
use crate::identity::SequenceHash;
use crate::metrics_server::{Exposition, MetricsServer};
use crate::page_store::{PageStore, MAX_PAGES_PER_CALL};
use crate::python::tensor::{read_source_tensor, read_tensor, TensorDevice};
use crate::python::{detached, to_py_err, KvbmError, PyConfig};

/// Each page's `(address, length)` runs.
type PageRuns = Vec<Vec<(usize, usize)>>;

/// A buffer pages may be read from and written to: `[start, start + len)`, its owner kept.
struct Region {
    name: String,
    start: usize,
    len: usize,
    _owner: Py<PyAny>,
}

/// SGLang's page store; see the module docs.
#[pyclass(module = "kvbm_connector._kvbm", name = "PageStore", frozen)]
pub(crate) struct PyPageStore {
    store: Arc<PageStore>,
    regions: Mutex<Vec<Region>>,
    /// The counters over HTTP (`tcp.metrics_addr`, its port + `metrics_offset`), if set.
    metrics: Option<MetricsServer>,
}

/// A page store's counters labelled with the engine that uses it.
struct Labelled {
    store: Arc<PageStore>,
    engine: String,
}

impl Exposition for Labelled {
    fn render_prometheus(&self) -> String {
        self.store.render_prometheus(&self.engine)
    }
}

fn keys_of(
    py: Python<'_>,
    store: &PageStore,
    keys: &Bound<'_, PyAny>,
) -> PyResult<Vec<SequenceHash>> {
    let mut out = Vec::new();
    let it = keys.try_iter().map_err(|_| {
        to_py_err(
            py,
            Error::invalid_argument("keys must be a list of strings").with("field", "keys"),
        )
    })?;
    for (i, k) in it.enumerate() {
        let k = k?;
        if out.len() >= MAX_PAGES_PER_CALL {
            return Err(to_py_err(
                py,
                Error::invalid_argument(format!("more than {MAX_PAGES_PER_CALL} keys in one call"))
                    .with("field", "keys"),
            ));
        }
        let s = k.cast::<PyString>().map_err(|_| {
            let ty = k
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default();
            to_py_err(
                py,
                Error::invalid_argument(format!("keys[{i}] is a {ty}, not a string"))
                    .with("field", "keys"),
            )
        })?;
        // A str that is not valid Unicode (a lone surrogate, "\ud800") has no UTF-8 form.
        let text = s.to_cow().map_err(|_| {
            to_py_err(
                py,
                Error::invalid_argument(format!(
                    "keys[{i}] is not valid Unicode (it holds a lone surrogate); keys are text"
                ))
                .with("field", "keys"),
            )
        })?;
        out.push(store.key(text.as_bytes()));
    }
    Ok(out)
}

/// Adds `field` to a `KvbmError`'s context where it names none (the tensor reader names the
/// tensor; SGLang's callers look for the argument).
fn with_field(py: Python<'_>, e: PyErr, field: &str) -> PyErr {
    if e.is_instance_of::<KvbmError>(py) {
        if let Ok(ctx) = e.value(py).getattr("context") {
            if let Ok(d) = ctx.cast::<PyDict>() {
                if !d.contains("field").unwrap_or(true) {
                    let _ = d.set_item("field", field);
                }
            }
        }
    }
    e
}

/// The integers of `values` (addresses or lengths of runs) as `usize`: one that is not an
/// integer or does not fit (negative, or past the address space: host indices past the pool
/// give such addresses) is a `KvbmError` naming `field`.
fn usizes(py: Python<'_>, values: &Bound<'_, PyAny>, field: &str) -> PyResult<Vec<usize>> {
    let it = values.try_iter().map_err(|_| {
        to_py_err(
            py,
            Error::invalid_argument(format!("{field} must be a list of integers"))
                .with("field", field),
        )
    })?;
    let mut out = Vec::new();
    for (j, v) in it.enumerate() {
        let v = v?;
        let n = v.extract::<usize>().map_err(|_| {
            let shown: String = v
                .repr()
                .map(|r| r.to_string())
                .unwrap_or_default()
                .chars()
                .take(40)
                .collect();
            to_py_err(
                py,
                Error::invalid_argument(format!(
                    "{field}[{j}] = {shown} is not an integer in [0, 2^{}): no {} in this \
                     process",
                    usize::BITS,
                    if field == "sizes" {
                        "length"
                    } else {
                        "address"
                    }
                ))
                .with("field", field),
            )
        })?;
        out.push(n);
    }
    Ok(out)
}

/// The `(address, length)` runs of each page: `ptrs`/`sizes` hold `keys` pages' runs, the same
/// number per page, each run inside a registered region.
fn page_runs(
    regions: &[Region],
    n_pages: usize,
    ptrs: &[usize],
    sizes: &[usize],
) -> Result<PageRuns> {
    if ptrs.len() != sizes.len() {
        return Err(Error::invalid_argument(format!(
            "{} addresses but {} sizes",
            ptrs.len(),
            sizes.len()
        ))
        .with("field", "sizes"));
    }
    if n_pages == 0 {
        return if ptrs.is_empty() {
            Ok(Vec::new())
        } else {
            Err(Error::invalid_argument("runs given for no page").with("field", "ptrs"))
        };
    }
    if ptrs.is_empty() || ptrs.len() % n_pages != 0 {
        return Err(Error::invalid_argument(format!(
            "{} runs do not divide into {n_pages} pages",
            ptrs.len()
        ))
        .with("field", "ptrs"));
    }
    let per = ptrs.len() / n_pages;
    for (j, (&p, &s)) in ptrs.iter().zip(sizes).enumerate() {
        let inside = regions
            .iter()
            .any(|r| p >= r.start && p.checked_add(s).is_some_and(|end| end <= r.start + r.len));
        if !inside {
            let known: Vec<String> = regions
                .iter()
                .map(|r| format!("{} [{:#x}, +{})", r.name, r.start, r.len))
                .collect();
            return Err(Error::invalid_argument(format!(
                "run {j} ({p:#x}, {s} bytes) is not inside a registered buffer (registered: {})",
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            ))
            .with("field", "ptrs"));
        }
    }
    Ok((0..n_pages)
        .map(|i| {
            (i * per..(i + 1) * per)
                .map(|j| (ptrs[j], sizes[j]))
                .collect()
        })
        .collect())
}

/// Refuses destinations that overlap (two pages, or two runs of one, writing the same bytes).
fn check_disjoint(pages: &[Vec<(usize, usize)>]) -> Result<()> {
    let mut runs: Vec<(usize, usize)> = pages
        .iter()
        .flatten()
        .copied()
        .filter(|r| r.1 > 0)
        .collect();
    runs.sort_unstable();
    for w in runs.windows(2) {
        if w[0].0 + w[0].1 > w[1].0 {
            return Err(Error::invalid_argument(format!(
                "destinations overlap: {:#x} (+{}) and {:#x}",
                w[0].0, w[0].1, w[1].0
            ))
            .with("field", "destinations"));
        }
    }
    Ok(())
}

/// Reads page tensors: CPU, contiguous; their runs and the objects that keep them alive.
/// `written`: the call writes into them (a read), so a read-only one is refused; the source of
/// a store may be read-only.
fn tensor_runs(
    py: Python<'_>,
    tensors: &Bound<'_, PyAny>,
    what: &str,
    written: bool,
) -> PyResult<(PageRuns, Vec<Py<PyAny>>)> {
    let mut runs = Vec::new();
    let mut owners = Vec::new();
    for (i, t) in tensors.try_iter()?.enumerate() {
        let t = t?;
        let name = format!("{what}[{i}]");
        let info = if written {
            read_tensor(py, &t, &name)
        } else {
            read_source_tensor(py, &t, &name)
        }
        .map_err(|e| with_field(py, e, what))?;
        if info.device != TensorDevice::Cpu {
            return Err(to_py_err(
                py,
                Error::unsupported(format!(
                    "{name} is on {}; SGLang's host pool pages are CPU tensors",
                    info.device
                ))
                .with("field", what),
            ));
        }
        runs.push(vec![(info.ptr, info.nbytes)]);
        owners.push(info.owner);
    }
    Ok((runs, owners))
}

fn put_runs(
    store: &PageStore,
    keys: &[SequenceHash],
    runs: &[Vec<(usize, usize)>],
) -> Result<Vec<bool>> {
    // SAFETY: every run lies in memory the caller keeps alive for this call (a registered
    // region, whose owner the store holds, or a tensor argument of the call); SGLang does not
    // free or reuse a page while it is being backed up.
    let pages: Vec<Vec<IoSlice<'_>>> = runs
        .iter()
        .map(|p| {
            p.iter()
                .map(|&(ptr, len)| {
                    IoSlice::new(unsafe { std::slice::from_raw_parts(ptr as *const u8, len) })
                })
                .collect()
        })
        .collect();
    store.put(keys, &pages)
}

fn get_runs(
    store: &PageStore,
    keys: &[SequenceHash],
    runs: &[Vec<(usize, usize)>],
) -> Result<Vec<Option<String>>> {
    check_disjoint(runs)?;
    // SAFETY: as in `put_runs`, and the runs are disjoint (checked above), so no two mutable
    // slices alias.
    let mut pages: Vec<Vec<IoSliceMut<'_>>> = runs
        .iter()
        .map(|p| {
            p.iter()
                .map(|&(ptr, len)| {
                    IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) })
                })
                .collect()
        })
        .collect();
    Ok(store
        .get(keys, &mut pages)?
        .into_iter()
        .map(|t| t.map(|k| k.to_string()))
        .collect())
}

/// Ports a store tries for its metrics endpoint before it runs without one.
pub const METRICS_TRIES: u16 = 16;

/// The metrics endpoint at `addr`'s port + `offset`, or `stride` ports further for each port
/// another process holds (see [`PyPageStore`]'s constructor); `None` when all are taken.
fn serve_metrics(
    addr: std::net::SocketAddr,
    config: &crate::Config,
    source: Arc<dyn Exposition>,
    offset: u16,
    stride: u16,
) -> Result<Option<MetricsServer>> {
    if addr.port() == 0 {
        return MetricsServer::serve_exposition(addr, &config.tcp, source).map(Some);
    }
    let tries = if stride == 0 { 1 } else { METRICS_TRIES };
    for k in 0..tries {
        let port = u32::from(addr.port()) + u32::from(offset) + u32::from(k) * u32::from(stride);
        let port = u16::try_from(port).map_err(|_| {
            Error::invalid_config(
                "tcp.metrics_addr",
                addr,
                format!("its port + {offset} (this rank's) + {k} × {stride} is above 65535"),
            )
        })?;
        let mut at = addr;
        at.set_port(port);
        match MetricsServer::serve_exposition(at, &config.tcp, Arc::clone(&source)) {
            Ok(server) => {
                if k > 0 {
                    tracing::info!(%at, "kvbm metrics: the rank's first port was in use; serving here");
                }
                return Ok(Some(server));
            }
            Err(e) if crate::metrics_server::address_in_use(&e) => continue,
            Err(e) => return Err(e),
        }
    }
    tracing::warn!(%addr, offset, stride, tries,
        "kvbm metrics: every port tried is in use; the page store runs without its HTTP endpoint (stats() still has the counters)");
    Ok(None)
}

#[pymethods]
impl PyPageStore {
    /// A store of `page_bytes`-byte pages named in `namespace`, over the tiers `config` sizes
    /// (in pages) and the remote store `config` names. With `tcp.metrics_addr` set, its counters
    /// are served over HTTP at that address's port + `metrics_offset` (one port per rank),
    /// labelled `engine`; a port another process holds moves it `metrics_stride` ports up (at
    /// most [`METRICS_TRIES`] times; 0: never), and where every one is taken the store runs
    /// without the endpoint (a warning says so), the engine unharmed.
    #[new]
    #[pyo3(signature = (config, namespace, page_bytes, engine="sglang", metrics_offset=0, metrics_stride=0))]
    fn new(
        py: Python<'_>,
        config: &PyConfig,
        namespace: String,
        page_bytes: usize,
        engine: &str,
        metrics_offset: u16,
        metrics_stride: u16,
    ) -> PyResult<Self> {
        let config = config.inner.clone();
        let engine = engine.to_string();
        let (store, metrics) = detached(py, "PageStore", move || {
            crate::backends::remote::check(&config)?;
            let store = Arc::new(crate::backends::standard::page_store(
                &config, &namespace, page_bytes,
            )?);
            let metrics = match config.tcp.metrics_addr {
                Some(addr) => {
                    let source: Arc<dyn Exposition> = Arc::new(Labelled {
                        store: Arc::clone(&store),
                        engine,
                    });
                    serve_metrics(addr, &config, source, metrics_offset, metrics_stride)?
                }
                None => None,
            };
            Ok((store, metrics))
        })?;
        Ok(Self {
            store,
            regions: Mutex::new(Vec::new()),
            metrics,
        })
    }

    /// Where the counters are served (`host:port`), or `None`.
    #[getter]
    fn metrics_addr(&self) -> Option<String> {
        self.metrics.as_ref().map(|m| m.addr().to_string())
    }

    /// Bytes of one page.
    #[getter]
    fn page_bytes(&self) -> usize {
        self.store.page_bytes()
    }

    /// The namespace.
    #[getter]
    fn namespace(&self) -> String {
        self.store.namespace().to_string()
    }

    /// The tiers that hold pages, in read order (`host`, `disk`, `remote`).
    #[getter]
    fn tiers(&self) -> Vec<String> {
        self.store.tiers().iter().map(|t| t.to_string()).collect()
    }

    /// Registers a CPU tensor (the host pool's buffer) whose memory page runs may name; the
    /// store keeps a reference to it.
    fn register_region(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        name: &str,
    ) -> PyResult<()> {
        let info = read_tensor(py, tensor, name)?;
        if info.device != TensorDevice::Cpu {
            return Err(to_py_err(
                py,
                Error::unsupported(format!(
                    "host buffer {name} is on {}, not the CPU",
                    info.device
                ))
                .with("field", name),
            ));
        }
        self.regions.lock().push(Region {
            name: info.name,
            start: info.ptr,
            len: info.nbytes,
            _owner: info.owner,
        });
        Ok(())
    }

    /// Stores page tensors (`tensors[i]` the page of `keys[i]`). Per page, whether it is held.
    fn put_tensors(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        tensors: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<bool>> {
        let ks = keys_of(py, &self.store, keys)?;
        let (runs, _owners) = tensor_runs(py, tensors, "values", false)?;
        let store = Arc::clone(&self.store);
        detached(py, "put", move || put_runs(&store, &ks, &runs))
    }

    /// Reads pages into tensors. Per page, the tier that served it or `None`.
    fn get_tensors(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        tensors: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Option<String>>> {
        let ks = keys_of(py, &self.store, keys)?;
        let (runs, _owners) = tensor_runs(py, tensors, "target_locations", true)?;
        let store = Arc::clone(&self.store);
        detached(py, "get", move || get_runs(&store, &ks, &runs))
    }

    /// Stores pages given as runs of registered buffers (`ptrs`/`sizes`: the same number of runs
    /// per page, pages in key order).
    fn put_runs(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        ptrs: &Bound<'_, PyAny>,
        sizes: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<bool>> {
        let ks = keys_of(py, &self.store, keys)?;
        let (ptrs, sizes) = (usizes(py, ptrs, "ptrs")?, usizes(py, sizes, "sizes")?);
        let runs = page_runs(&self.regions.lock(), ks.len(), &ptrs, &sizes)
            .map_err(|e| to_py_err(py, e))?;
        let store = Arc::clone(&self.store);
        detached(py, "put", move || put_runs(&store, &ks, &runs))
    }

    /// Reads pages into runs of registered buffers. Per page, the tier or `None`.
    fn get_runs(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        ptrs: &Bound<'_, PyAny>,
        sizes: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Option<String>>> {
        let ks = keys_of(py, &self.store, keys)?;
        let (ptrs, sizes) = (usizes(py, ptrs, "ptrs")?, usizes(py, sizes, "sizes")?);
        let runs = page_runs(&self.regions.lock(), ks.len(), &ptrs, &sizes)
            .map_err(|e| to_py_err(py, e))?;
        let store = Arc::clone(&self.store);
        detached(py, "get", move || get_runs(&store, &ks, &runs))
    }

    /// How many of `keys`, from the first, the store holds.
    fn prefix_len(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let ks = keys_of(py, &self.store, keys)?;
        let store = Arc::clone(&self.store);
        detached(py, "exists", move || store.prefix_len(&ks))
    }

    /// Forgets every page of the local tiers (the shared store is not cleared); a persisted
    /// disk tier's index is emptied on disk before this returns.
    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        let store = Arc::clone(&self.store);
        detached(py, "clear", move || store.clear())
    }

    /// Saves the persisted disk tier's index now (`disk.persist`): its pages are found again
    /// by the next process. A no-op without a persisted tier.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let store = Arc::clone(&self.store);
        detached(py, "flush", move || store.flush())
    }

    /// The counters, as JSON.
    fn stats_json(&self, py: Python<'_>) -> PyResult<String> {
        serde_json::to_string(&self.store.stats())
            .map_err(|e| to_py_err(py, Error::internal(format!("stats: {e}"))))
    }
}
