//! Small pieces the framework bindings share.

use std::time::{Duration, Instant};

use crate::connector::adapter::SchedulerAdapter;
use crate::connector::leader::{Leader, LeaderStatus};
use crate::connector::metrics::Metrics;
use crate::connector::worker::Worker;
use crate::error::{Error, ErrorKind, Result};

/// A timeout given in seconds from Python.
pub(crate) fn secs(v: f64) -> Result<Duration> {
    if !v.is_finite() || v < 0.0 {
        return Err(Error::invalid_argument(format!(
            "timeout must be a finite number of seconds >= 0, got {v}"
        )));
    }
    Ok(Duration::from_secs_f64(v))
}

/// Polls `ready` until it says true, fails, or `timeout_secs` passed.
pub(crate) fn wait_until(
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
pub(crate) fn leader_ready<A: SchedulerAdapter>(leader: &mut Leader<A>) -> Result<bool> {
    if leader.is_ready() {
        return Ok(true);
    }
    match leader.status() {
        LeaderStatus::Failed(e) => Err(e),
        _ => Ok(false),
    }
}

/// True once the worker's barrier completed; its error if it failed.
pub(crate) fn worker_ready(worker: &Worker) -> Result<bool> {
    if worker.is_ready() {
        return Ok(true);
    }
    match worker.init_error() {
        Some(e) => Err(e),
        None => Ok(false),
    }
}

/// The counters as JSON text.
pub(crate) fn metrics_json(metrics: &Metrics) -> Result<String> {
    serde_json::to_string(&metrics.snapshot())
        .map_err(|e| Error::internal(format!("cannot encode the metrics: {e}")))
}
