//! Leader/worker transports for Python: in-process (one process, tests) and TCP
//! (`KVBM_LEADER_ADDR`, one process per rank).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::prelude::*;

use super::{detached, to_py_err};
use crate::config::{auth_token_from_env, leader_addr_from, leader_addr_from_env};
use crate::connector::tcp::{TcpLeader, TcpWorker};
use crate::connector::transport::{
    in_process, LeaderMessage, LeaderTransport, Rank, WorkerMessage, WorkerTransport,
};
use crate::error::{Error, Result};

/// The leader's end of a transport (pass it to a scheduler).
#[pyclass(module = "kvbm_connector._kvbm", name = "LeaderTransport", frozen)]
pub(crate) struct PyLeaderTransport {
    pub(crate) inner: Arc<dyn LeaderTransport>,
    kind: &'static str,
    address: Option<SocketAddr>,
}

#[pymethods]
impl PyLeaderTransport {
    /// `"in_process"` or `"tcp"`.
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
                "LeaderTransport(tcp, {a}, world_size={})",
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
    /// `"in_process"` or `"tcp"`.
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
        if rank >= world_size {
            return Err(Error::out_of_range("rank", rank, world_size));
        }
        if !connect_timeout_secs.is_finite() || connect_timeout_secs <= 0.0 {
            return Err(Error::invalid_argument(format!(
                "connect_timeout_secs must be a positive number, got {connect_timeout_secs}"
            )));
        }
        let addr = resolve_addr(address.as_deref())?;
        Ok(PyWorkerTransport {
            inner: Arc::new(LazyTcpWorker {
                addr,
                rank,
                world_size,
                token: auth_token.or_else(auth_token_from_env),
                deadline: Duration::from_secs_f64(connect_timeout_secs),
                conn: Mutex::new(None),
            }),
            kind: "tcp",
        })
    })
}

/// A TCP worker end that connects on first use; a failed connect is remembered and returned to
/// every later call.
#[derive(Debug)]
struct LazyTcpWorker {
    addr: SocketAddr,
    rank: Rank,
    world_size: usize,
    token: Option<String>,
    deadline: Duration,
    conn: Mutex<Option<Result<Arc<TcpWorker>>>>,
}

impl LazyTcpWorker {
    fn get(&self) -> Result<Arc<TcpWorker>> {
        let mut conn = self.conn.lock();
        if conn.is_none() {
            *conn = Some(TcpWorker::connect(
                self.addr,
                self.rank,
                self.world_size,
                self.token.clone(),
                self.deadline,
            ));
        }
        match conn.as_ref() {
            Some(Ok(w)) => Ok(w.clone()),
            Some(Err(e)) => Err(e.clone()),
            None => Err(Error::internal("connection slot empty after connecting")),
        }
    }
}

impl WorkerTransport for LazyTcpWorker {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn send(&self, msg: WorkerMessage) -> Result<()> {
        self.get()?.send(msg)
    }

    fn recv_timeout(&self, timeout: Duration) -> Result<Option<LeaderMessage>> {
        self.get()?.recv_timeout(timeout)
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyLeaderTransport>()?;
    m.add_class::<PyWorkerTransport>()?;
    m.add_function(wrap_pyfunction!(in_process_transport, m)?)?;
    m.add_function(wrap_pyfunction!(tcp_leader, m)?)?;
    m.add_function(wrap_pyfunction!(tcp_worker, m)?)?;
    Ok(())
}
