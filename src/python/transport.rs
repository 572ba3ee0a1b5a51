//! Leader/worker transports for Python: in-process (one process, tests), TCP
//! (`KVBM_LEADER_ADDR`, one process per rank) and rendezvous (TCP on an ephemeral loopback port,
//! found through a private per-user file named from an id both halves know; the vLLM default).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;

use super::{detached, to_py_err};
use crate::config::{
    auth_token_from_env, leader_addr_from, leader_addr_from_env, rendezvous_dir_from_env,
};
use crate::connector::transport::{in_process, LeaderTransport, WorkerTransport};
use crate::error::{Error, Result};
use crate::tcp::{LazyTcpWorker, LeaderTarget, RendezvousLeader, TcpLeader};

/// The leader's end of a transport (pass it to a scheduler).
#[pyclass(
    module = "kvbm_connector._kvbm",
    name = "LeaderTransport",
    frozen,
    weakref
)]
pub(crate) struct PyLeaderTransport {
    pub(crate) inner: Arc<dyn LeaderTransport>,
    kind: &'static str,
    address: Option<SocketAddr>,
    rendezvous: Option<Arc<RendezvousLeader>>,
}

#[pymethods]
impl PyLeaderTransport {
    /// Rendezvous: removes the rendezvous file now (while it is still this leader's), for a
    /// process about to exit where the transport may never be dropped; connected workers stay
    /// connected. Idempotent; does nothing for the other kinds.
    fn unpublish(&self) {
        if let Some(r) = &self.rendezvous {
            r.unpublish();
        }
    }

    /// Rendezvous: the path of the rendezvous file; `None` for the other kinds.
    #[getter]
    fn rendezvous_path(&self) -> Option<PathBuf> {
        self.rendezvous.as_ref().map(|r| r.path().to_path_buf())
    }

    /// `"in_process"`, `"tcp"` or `"rendezvous"`.
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind
    }

    /// The TCP address listened on (`"ip:port"`, with the real port when bound to port 0);
    /// `None` in process.
    #[getter]
    fn address(&self) -> Option<String> {
        self.address.map(|a| a.to_string())
    }

    /// Ranks expected.
    #[getter]
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn __repr__(&self) -> String {
        match self.address {
            Some(a) => format!(
                "LeaderTransport({}, {a}, world_size={})",
                self.kind,
                self.inner.world_size()
            ),
            None => format!(
                "LeaderTransport({}, world_size={})",
                self.kind,
                self.inner.world_size()
            ),
        }
    }
}

/// A worker's end of a transport (pass it to a worker).
#[pyclass(module = "kvbm_connector._kvbm", name = "WorkerTransport", frozen)]
pub(crate) struct PyWorkerTransport {
    pub(crate) inner: Arc<dyn WorkerTransport>,
    kind: &'static str,
}

#[pymethods]
impl PyWorkerTransport {
    /// `"in_process"`, `"tcp"` or `"rendezvous"`.
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind
    }

    /// This worker's rank.
    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn __repr__(&self) -> String {
        format!("WorkerTransport({}, rank={})", self.kind, self.inner.rank())
    }
}

/// `in_process_transport(world_size) -> (LeaderTransport, [WorkerTransport])`: ends connected
/// by channels, for a leader and workers in one process.
#[pyfunction]
fn in_process_transport(
    py: Python<'_>,
    world_size: usize,
) -> PyResult<(PyLeaderTransport, Vec<PyWorkerTransport>)> {
    if world_size == 0 {
        return Err(to_py_err(
            py,
            Error::invalid_argument("world_size must be at least 1"),
        ));
    }
    let (leader, workers) = in_process(world_size);
    Ok((
        PyLeaderTransport {
            inner: leader,
            kind: "in_process",
            address: None,
            rendezvous: None,
        },
        workers
            .into_iter()
            .map(|w| PyWorkerTransport {
                inner: w,
                kind: "in_process",
            })
            .collect(),
    ))
}

fn resolve_addr(addr: Option<&str>) -> Result<SocketAddr> {
    match addr {
        Some(a) => leader_addr_from(Some(a)),
        None => leader_addr_from_env(),
    }
}

/// `tcp_leader(world_size, address=None, auth_token=None)`: listens for `world_size` workers.
/// `address` defaults to `$KVBM_LEADER_ADDR` (else `127.0.0.1:5557`; port 0 picks a free port);
/// `auth_token` to `$KVBM_AUTH_TOKEN` (`""` means none).
#[pyfunction]
#[pyo3(signature = (world_size, address=None, auth_token=None))]
fn tcp_leader(
    py: Python<'_>,
    world_size: usize,
    address: Option<String>,
    auth_token: Option<String>,
) -> PyResult<PyLeaderTransport> {
    detached(py, "tcp_leader", move || {
        let addr = resolve_addr(address.as_deref())?;
        let token = auth_token.or_else(auth_token_from_env);
        let leader = TcpLeader::bind(addr, world_size, token)?;
        let address = Some(leader.local_addr());
        Ok(PyLeaderTransport {
            inner: leader,
            kind: "tcp",
            address,
            rendezvous: None,
        })
    })
}

/// `tcp_worker(rank, world_size, address=None, auth_token=None, connect_timeout_secs=60.0)`:
/// the worker end for `rank`. It connects on first use (inside the start-up barrier, which may
/// run in the background), retrying until `connect_timeout_secs` passed, so a worker may be built
/// before its leader listens (vLLM builds workers first).
#[pyfunction]
#[pyo3(signature = (rank, world_size, address=None, auth_token=None, connect_timeout_secs=60.0))]
fn tcp_worker(
    py: Python<'_>,
    rank: usize,
    world_size: usize,
    address: Option<String>,
    auth_token: Option<String>,
    connect_timeout_secs: f64,
) -> PyResult<PyWorkerTransport> {
    detached(py, "tcp_worker", move || {
        let deadline = connect_deadline(connect_timeout_secs)?;
        let target = LeaderTarget::Address {
            addr: resolve_addr(address.as_deref())?,
            token: auth_token.or_else(auth_token_from_env),
        };
        lazy_worker(target, rank, world_size, deadline, "tcp")
    })
}

fn connect_deadline(secs: f64) -> Result<Duration> {
    if !secs.is_finite() || secs <= 0.0 || secs > 1e9 {
        return Err(Error::invalid_argument(format!(
            "connect_timeout_secs must be a positive number of seconds, got {secs}"
        )));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn lazy_worker(
    target: LeaderTarget,
    rank: usize,
    world_size: usize,
    deadline: Duration,
    kind: &'static str,
) -> Result<PyWorkerTransport> {
    Ok(PyWorkerTransport {
        inner: Arc::new(LazyTcpWorker::new(target, rank, world_size, deadline)?),
        kind,
    })
}

fn rendezvous_dir(directory: Option<PathBuf>) -> Result<PathBuf> {
    match directory {
        Some(d) => Ok(d),
        None => rendezvous_dir_from_env(),
    }
}

/// `rendezvous_leader(world_size, instance, directory=None)`: listens for `world_size` workers
/// on an ephemeral loopback port with a fresh token, and publishes both in the rendezvous file of
/// `instance` in `directory` (default: `$KVBM_RENDEZVOUS_DIR`, else `$XDG_RUNTIME_DIR/kvbm-<uid>`,
/// else `<temp dir>/kvbm-<uid>`; private, 0700). The file is removed when the transport is
/// dropped. See `tcp::rendezvous`.
#[pyfunction]
#[pyo3(signature = (world_size, instance, directory=None))]
fn rendezvous_leader(
    py: Python<'_>,
    world_size: usize,
    instance: String,
    directory: Option<PathBuf>,
) -> PyResult<PyLeaderTransport> {
    detached(py, "rendezvous_leader", move || {
        let dir = rendezvous_dir(directory)?;
        let leader = RendezvousLeader::bind(&dir, &instance, world_size)?;
        let address = Some(leader.local_addr());
        Ok(PyLeaderTransport {
            inner: leader.clone(),
            kind: "rendezvous",
            address,
            rendezvous: Some(leader),
        })
    })
}

/// `rendezvous_worker(rank, world_size, instance, directory=None, connect_timeout_secs=60.0)`:
/// the worker end for `rank`. On first use (inside the start-up barrier) it waits for the
/// leader's rendezvous file of `instance` (ignoring a stale one of a dead process), then connects
/// with the token it holds, all within `connect_timeout_secs`. `directory` as for
/// `rendezvous_leader`; it is checked (private to this user) now.
#[pyfunction]
#[pyo3(signature = (rank, world_size, instance, directory=None, connect_timeout_secs=60.0))]
fn rendezvous_worker(
    py: Python<'_>,
    rank: usize,
    world_size: usize,
    instance: String,
    directory: Option<PathBuf>,
    connect_timeout_secs: f64,
) -> PyResult<PyWorkerTransport> {
    detached(py, "rendezvous_worker", move || {
        let deadline = connect_deadline(connect_timeout_secs)?;
        let target = LeaderTarget::Rendezvous {
            dir: rendezvous_dir(directory)?,
            instance,
        };
        lazy_worker(target, rank, world_size, deadline, "rendezvous")
    })
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyLeaderTransport>()?;
    m.add_class::<PyWorkerTransport>()?;
    m.add_function(wrap_pyfunction!(in_process_transport, m)?)?;
    m.add_function(wrap_pyfunction!(tcp_leader, m)?)?;
    m.add_function(wrap_pyfunction!(tcp_worker, m)?)?;
    m.add_function(wrap_pyfunction!(rendezvous_leader, m)?)?;
    m.add_function(wrap_pyfunction!(rendezvous_worker, m)?)?;
    Ok(())
}
