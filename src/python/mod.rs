//! Python bindings (feature `python`): the extension module `kvbm_connector._kvbm`.
//!
//! The Python package (`python/kvbm_connector/`) is the public face: its `trtllm`, `vllm` and
//! `sglang` modules are the classes the engines load, and they hand the engine's objects
//! (requests, scheduler outputs, tensors) to the extension. Each engine's binding — the classes
//! that read those objects into its adapter's calls — lives in the engine's folder
//! (`frameworks/<engine>/python.rs`, built with this feature); this module holds what they share
//! (the shared calls, tensors and caches, transports, configuration, errors, logging) and
//! registers every class in `_kvbm`. It owns the boundary rules:
//!
//! * every error is a `kvbm_connector.KvbmError` carrying the message, the [`ErrorKind`] name
//!   (`.kind`) and the key/value context (`.context`) (`error.rs`);
//! * every call into the core runs with the GIL released (`Python::detach`), so a blocking
//!   start-up barrier, a wait for a previous iteration's stores, or a TCP connect never stalls
//!   other Python threads; and inside `catch_unwind`, so a panic becomes a `KvbmError` of kind
//!   `internal` and the object that panicked refuses further calls ([`Guarded`]);
//! * cache tensors are read from any object with `data_ptr()`, `shape`, `dtype` and `device`
//!   (torch tensors, or numpy-backed stand-ins) (`tensor.rs`); CPU tensors become a tier over
//!   their memory, CUDA tensors (feature `cuda`) the CUDA device tier (`cache.rs`, `cuda.rs`).
//!
//! The building blocks are public, so an engine binding outside this module — another module of
//! the crate, or a crate of one's own that builds its own extension module over this library —
//! keeps the same rules without copying them: [`Guarded`] (one call at a time, GIL released,
//! panics caught), [`detached`], [`to_py_err`] / [`KvbmError`], the readiness helpers
//! ([`leader_ready`], [`worker_ready`], [`wait_until`], [`secs`]), [`metrics_json`], and
//! [`PyConfig`] (`kvbm_connector.Config`: take it as an argument and read it with
//! [`PyConfig::config`]). Inside the crate, `scheduler_methods!` / `worker_methods!`
//! (`common.rs`) add the calls every engine's scheduler and worker share to a class.
//!
//! [`ErrorKind`]: crate::ErrorKind

pub(crate) mod cache;
pub(crate) mod common;
#[cfg(feature = "cuda")]
mod cuda;
mod error;
mod log;
pub(crate) mod tensor;
pub(crate) mod transport;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::config::{Config, ENV_VARS};
use crate::error::{Error, Result};

pub use common::{leader_ready, metrics_json, secs, wait_until, worker_ready};
pub use error::{to_py_err, KvbmError};

/// A Rust object shared with Python: one call at a time, each with the GIL released and panics
/// caught. After a panic the object is left unusable (its state may be half-updated).
pub struct Guarded<T> {
    what: &'static str,
    inner: Mutex<T>,
    poisoned: AtomicBool,
}

impl<T: Send> Guarded<T> {
    /// `inner`, shared with Python; `what` names it in errors (`"VllmScheduler"`).
    pub fn new(what: &'static str, inner: T) -> Self {
        Self {
            what,
            inner: Mutex::new(inner),
            poisoned: AtomicBool::new(false),
        }
    }

    /// Runs `f` on the object without the GIL; errors and panics become `KvbmError`.
    pub fn call<R: Send>(
        &self,
        py: Python<'_>,
        op: &'static str,
        f: impl FnOnce(&mut T) -> Result<R> + Send,
    ) -> PyResult<R> {
        if self.poisoned.load(Ordering::Acquire) {
            return Err(to_py_err(
                py,
                Error::internal(format!(
                    "this {} is unusable: an earlier call panicked",
                    self.what
                ))
                .with("op", op),
            ));
        }
        let out = py.detach(|| {
            catch_unwind(AssertUnwindSafe(|| {
                let mut guard = self.inner.lock();
                f(&mut guard)
            }))
        });
        log::drain(py);
        match out {
            Ok(r) => r.map_err(|e| to_py_err(py, e.with("op", op))),
            Err(panic) => {
                self.poisoned.store(true, Ordering::Release);
                Err(to_py_err(py, panic_error(self.what, op, panic.as_ref())))
            }
        }
    }

    /// Runs `f` on the object with the GIL held, for calls that read Python objects as they work
    /// (only what is new, straight into the Rust state) and whose work is too short to be worth
    /// releasing the GIL; `f` may release it itself (`py.detach`) for a long part. The object's
    /// lock is awaited with the GIL released (another thread may hold it while it works without
    /// the GIL; nothing run under the lock takes the GIL, so neither waits on the other). Errors
    /// of `f` are Python errors already; panics poison the object as in [`Guarded::call`].
    pub fn call_attached<R>(
        &self,
        py: Python<'_>,
        op: &'static str,
        f: impl FnOnce(&mut T) -> PyResult<R>,
    ) -> PyResult<R> {
        if self.poisoned.load(Ordering::Acquire) {
            return Err(to_py_err(
                py,
                Error::internal(format!(
                    "this {} is unusable: an earlier call panicked",
                    self.what
                ))
                .with("op", op),
            ));
        }
        let mut guard = loop {
            if let Some(g) = self.inner.try_lock() {
                break g;
            }
            py.detach(|| drop(self.inner.lock()));
        };
        let out = catch_unwind(AssertUnwindSafe(|| f(&mut guard)));
        drop(guard);
        log::drain(py);
        match out {
            Ok(r) => r,
            Err(panic) => {
                self.poisoned.store(true, Ordering::Release);
                Err(to_py_err(py, panic_error(self.what, op, panic.as_ref())))
            }
        }
    }
}

/// Runs `f` without the GIL and with panics caught, for calls that need no shared object.
pub fn detached<R: Send>(
    py: Python<'_>,
    op: &'static str,
    f: impl FnOnce() -> Result<R> + Send,
) -> PyResult<R> {
    let out = py.detach(|| catch_unwind(AssertUnwindSafe(f)));
    log::drain(py);
    match out {
        Ok(r) => r.map_err(|e| to_py_err(py, e.with("op", op))),
        Err(panic) => Err(to_py_err(py, panic_error("call", op, panic.as_ref()))),
    }
}

fn panic_error(what: &str, op: &str, panic: &(dyn std::any::Any + Send)) -> Error {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_string());
    Error::internal(format!("panic in {what}.{op}: {text}"))
}

/// The effective configuration: defaults, then the TOML file, then the environment; the same
/// `Config::load` the Rust side and the `kvbm` CLI use.
#[pyclass(module = "kvbm_connector._kvbm", name = "Config", frozen)]
#[derive(Clone)]
pub struct PyConfig {
    pub(crate) inner: Config,
}

impl PyConfig {
    /// The configuration it carries (for an engine binding built on these blocks).
    pub fn config(&self) -> &Config {
        &self.inner
    }
}

#[pymethods]
impl PyConfig {
    /// `Config.load(path=None)`: the file at `path` (else `$KVBM_CONFIG`, else none), then the
    /// `DYN_KVBM_*` and `KVBM_*` environment variables.
    #[staticmethod]
    #[pyo3(signature = (path=None))]
    fn load(py: Python<'_>, path: Option<std::path::PathBuf>) -> PyResult<Self> {
        detached(py, "Config.load", move || {
            let inner = Config::load(path.as_deref())?;
            // The store `remote.url` names checks its own settings, before an engine starts.
            crate::backends::remote::check(&inner)?;
            Ok(Self { inner })
        })
    }

    /// `Config.load_with(overrides, path=None)`: as [`PyConfig::load`], with `overrides`
    /// (environment variable name → value, e.g. `{"KVBM_DISK_CACHE_GB": "8"}`) read before the
    /// environment: an engine's own configuration of the connector (SGLang's extra config)
    /// wins over the process environment. A name that is not a `KVBM_*` setting is refused.
    #[staticmethod]
    #[pyo3(signature = (overrides, path=None))]
    fn load_with(
        py: Python<'_>,
        overrides: std::collections::HashMap<String, String>,
        path: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        detached(py, "Config.load_with", move || {
            if let Some(name) = overrides
                .keys()
                .find(|k| !ENV_VARS.iter().any(|v| v.name == k.as_str()))
            {
                return Err(Error::invalid_config(
                    name,
                    &overrides[name],
                    "not a KVBM setting",
                ));
            }
            let inner = Config::load_with(path.as_deref(), |name| {
                overrides
                    .get(name)
                    .cloned()
                    .or_else(|| std::env::var(name).ok())
            })?;
            crate::backends::remote::check(&inner)?;
            Ok(Self { inner })
        })
    }

    /// `Config.from_toml(text)`: the file format alone, without the environment.
    #[staticmethod]
    fn from_toml(py: Python<'_>, text: String) -> PyResult<Self> {
        detached(py, "Config.from_toml", move || {
            Config::from_toml_str(&text).map(|inner| Self { inner })
        })
    }

    /// The built-in defaults, without file or environment.
    #[staticmethod]
    fn defaults() -> Self {
        Self {
            inner: Config::default(),
        }
    }

    /// The configuration as TOML (the file format).
    fn to_toml(&self, py: Python<'_>) -> PyResult<String> {
        self.inner.to_toml().map_err(|e| to_py_err(py, e))
    }

    /// The configuration as JSON text (`json.loads` it for a dict).
    fn to_json(&self, py: Python<'_>) -> PyResult<String> {
        serde_json::to_string(&self.inner).map_err(|e| {
            to_py_err(
                py,
                Error::internal(format!("cannot encode the configuration: {e}")),
            )
        })
    }

    /// `Config.tier_share(fraction)`: this configuration for one of several stacks splitting the
    /// host and disk tiers (sizes in GB scaled by `fraction`, in `(0, 1]`; see
    /// `Config::tier_share`).
    fn tier_share(&self, py: Python<'_>, fraction: f64) -> PyResult<Self> {
        self.inner
            .tier_share(fraction)
            .map(|inner| Self { inner })
            .map_err(|e| to_py_err(py, e))
    }

    /// What start-up should say about the tier sizes (the default host tier is in use, or
    /// every tier is 0), or None.
    fn tier_warning(&self) -> Option<String> {
        self.inner.tier_warning()
    }

    /// The start-up barrier's deadline in seconds.
    #[getter]
    fn init_timeout_secs(&self) -> f64 {
        self.inner.init_timeout_secs
    }

    /// The deadline of one load from an I/O tier, in seconds (`transfer.load_timeout_secs`).
    #[getter]
    fn load_timeout_secs(&self) -> f64 {
        self.inner.transfer.load_timeout_secs
    }

    /// The private directory of rendezvous files (`tcp.rendezvous_dir`, else the default:
    /// `$XDG_RUNTIME_DIR/kvbm-<uid>`, else `<temp dir>/kvbm-<uid>`).
    #[getter]
    fn rendezvous_dir(&self) -> PathBuf {
        self.inner.tcp.rendezvous_dir()
    }

    fn __repr__(&self) -> String {
        format!("Config({:?})", self.inner)
    }
}

/// `(name, toml key, is_dynamo_alias)` for every environment variable the configuration reads,
/// in the order applied (later wins).
#[pyfunction]
fn env_vars() -> Vec<(&'static str, &'static str, bool)> {
    ENV_VARS
        .iter()
        .map(|v| (v.name, v.key, v.dynamo_alias))
        .collect()
}

/// Raises a `KvbmError` of the given kind (tests of the error mapping) or panics inside a
/// guarded call (tests of the panic boundary). Test builds only (feature `python-test-hooks`).
#[cfg(feature = "python-test-hooks")]
#[pyfunction]
#[pyo3(signature = (kind, message, panic=false))]
fn _raise(py: Python<'_>, kind: &str, message: String, panic: bool) -> PyResult<()> {
    let kind = error::kind_from_name(kind).ok_or_else(|| {
        to_py_err(
            py,
            Error::invalid_argument(format!("unknown error kind {kind:?}")),
        )
    })?;
    detached(py, "_raise", move || {
        if panic {
            panic!("{message}");
        }
        Err(Error::new(kind, message).with("test", "yes"))
    })
}

/// A guarded object for tests of the panic boundary: `panic()` panics inside a guarded call,
/// after which every call (`ok()` included) raises. Test builds only (feature
/// `python-test-hooks`).
#[cfg(feature = "python-test-hooks")]
#[pyclass(module = "kvbm_connector._kvbm", name = "_PanicProbe", frozen)]
struct PanicProbe {
    inner: Guarded<u32>,
}

#[cfg(feature = "python-test-hooks")]
#[pymethods]
impl PanicProbe {
    #[new]
    fn new() -> Self {
        Self {
            inner: Guarded::new("_PanicProbe", 0),
        }
    }

    fn ok(&self, py: Python<'_>) -> PyResult<u32> {
        self.inner.call(py, "ok", |n| {
            *n += 1;
            Ok(*n)
        })
    }

    fn panic(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.call(py, "panic", |_| -> Result<()> {
            panic!("probe panicked");
        })
    }
}

/// The extension module.
#[pymodule]
#[pyo3(name = "_kvbm")]
fn kvbm_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    log::install();
    m.add_function(wrap_pyfunction!(log::drain_logs, m)?)?;
    m.add("KvbmError", py.get_type::<KvbmError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // An unoptimised build (scripts/test.sh installs one): benches refuse to time it.
    m.add("DEBUG_BUILD", cfg!(debug_assertions))?;
    m.add("ERROR_KINDS", error::kind_names())?;
    m.add_class::<PyConfig>()?;
    m.add_class::<crate::frameworks::sglang::python::PyPageStore>()?;
    m.add_function(wrap_pyfunction!(env_vars, m)?)?;
    #[cfg(feature = "python-test-hooks")]
    {
        m.add_function(wrap_pyfunction!(_raise, m)?)?;
        m.add_function(wrap_pyfunction!(log::_warn, m)?)?;
        m.add_class::<PanicProbe>()?;
    }
    transport::register(m)?;
    tensor::register(m)?;
    #[cfg(feature = "cuda")]
    cuda::register_class(m)?;
    m.add("HAVE_CUDA", cfg!(feature = "cuda"))?;
    crate::frameworks::trtllm::python::register(m)?;
    crate::frameworks::vllm::python::register(m)?;
    Ok(())
}
