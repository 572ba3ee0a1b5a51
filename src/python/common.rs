//! Small pieces the framework bindings share.

use std::time::{Duration, Instant};

use crate::connector::adapter::SchedulerAdapter;
use crate::connector::leader::{Leader, LeaderStatus};
use crate::connector::metrics::Metrics;
use crate::connector::worker::Worker;
use crate::error::{Error, ErrorKind, Result};

/// A timeout given in seconds from Python.
pub fn secs(v: f64) -> Result<Duration> {
    if !v.is_finite() || v < 0.0 {
        return Err(Error::invalid_argument(format!(
            "timeout must be a finite number of seconds >= 0, got {v}"
        )));
    }
    Ok(Duration::from_secs_f64(v))
}

/// Polls `ready` until it says true, fails, or `timeout_secs` passed.
pub fn wait_until(
    timeout_secs: f64,
    what: &str,
    mut ready: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let deadline = Instant::now() + secs(timeout_secs)?;
    loop {
        if ready()? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("{what} did not complete within {timeout_secs} s"),
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// True once the leader's barrier completed; its error if it failed.
pub fn leader_ready<A: SchedulerAdapter>(leader: &mut Leader<A>) -> Result<bool> {
    if leader.is_ready() {
        return Ok(true);
    }
    match leader.status() {
        LeaderStatus::Failed(e) => Err(e),
        _ => Ok(false),
    }
}

/// True once the worker's barrier completed; its error if it failed.
pub fn worker_ready(worker: &Worker) -> Result<bool> {
    if worker.is_ready() {
        return Ok(true);
    }
    match worker.init_error() {
        Some(e) => Err(e),
        None => Ok(false),
    }
}

/// The counters as JSON text.
pub fn metrics_json(metrics: &Metrics) -> Result<String> {
    serde_json::to_string(&metrics.snapshot())
        .map_err(|e| Error::internal(format!("cannot encode the metrics: {e}")))
}

/// The calls every engine's scheduler binding has — readiness, completions, counters — added to
/// the `#[pyclass]` `$ty` (a second `#[pymethods]` block: pyo3's `multiple-pymethods`). `$ty`
/// keeps its adapter in `inner: Guarded<_>`, and the adapter has `leader()` / `leader_mut()`.
/// An engine's binding writes only its engine's own calls.
macro_rules! scheduler_methods {
    ($ty:ty) => {
        #[pymethods]
        impl $ty {
            /// True once the start-up barrier completed; raises its error if it failed.
            fn is_ready(&self, py: Python<'_>) -> PyResult<bool> {
                self.inner.call(py, "is_ready", |s| {
                    $crate::python::common::leader_ready(s.leader_mut())
                })
            }

            /// Waits (GIL released) until the barrier completed; raises on failure or at the
            /// deadline.
            fn wait_ready(&self, py: Python<'_>, timeout_secs: f64) -> PyResult<()> {
                self.inner.call(py, "wait_ready", move |s| {
                    $crate::python::common::wait_until(
                        timeout_secs,
                        "the scheduler's start-up barrier",
                        || $crate::python::common::leader_ready(s.leader_mut()),
                    )
                })
            }

            /// Applies operation completions that arrived.
            fn process_completions(&self, py: Python<'_>) -> PyResult<()> {
                self.inner.call(py, "process_completions", |s| {
                    s.leader_mut().process_completions();
                    Ok(())
                })
            }

            /// True while operations are in flight or queued.
            fn has_pending_work(&self, py: Python<'_>) -> PyResult<bool> {
                self.inner.call(py, "has_pending_work", |s| {
                    Ok(s.leader().has_pending_work())
                })
            }

            /// The counters as JSON text, after applying the completions workers already
            /// reported (an idle engine makes no other leader call that would).
            fn metrics_json(&self, py: Python<'_>) -> PyResult<String> {
                self.inner.call(py, "metrics_json", |s| {
                    s.leader_mut().process_completions();
                    $crate::python::common::metrics_json(s.leader().metrics())
                })
            }

            /// The counters in Prometheus text format.
            fn metrics_prometheus(&self, py: Python<'_>) -> PyResult<String> {
                self.inner.call(py, "metrics_prometheus", |s| {
                    s.leader_mut().process_completions();
                    Ok(s.leader().metrics().render_prometheus())
                })
            }
        }
    };
}

/// The calls every engine's worker binding has — readiness and draining — added to the
/// `#[pyclass]` `$ty`, whose `inner: Guarded<_>` adapter has `worker()`.
macro_rules! worker_methods {
    ($ty:ty) => {
        #[pymethods]
        impl $ty {
            /// True once the barrier completed; raises its error if it failed.
            fn is_ready(&self, py: Python<'_>) -> PyResult<bool> {
                self.inner.call(py, "is_ready", |w| {
                    $crate::python::common::worker_ready(w.worker())
                })
            }

            /// Waits (GIL released) until the barrier completed; raises on failure or at the
            /// deadline.
            fn wait_ready(&self, py: Python<'_>, timeout_secs: f64) -> PyResult<()> {
                self.inner.call(py, "wait_ready", move |w| {
                    $crate::python::common::wait_until(
                        timeout_secs,
                        "the worker's start-up barrier",
                        || $crate::python::common::worker_ready(w.worker()),
                    )
                })
            }

            /// Waits (GIL released) until every submitted operation completed.
            fn wait_idle(&self, py: Python<'_>, timeout_secs: f64) -> PyResult<()> {
                self.inner.call(py, "wait_idle", move |w| {
                    w.worker()
                        .wait_idle($crate::python::common::secs(timeout_secs)?)
                })
            }
        }
    };
}

pub(crate) use {scheduler_methods, worker_methods};
