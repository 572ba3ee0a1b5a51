//! Waiting for the worker's operations: for stores still reading device blocks (before the next
//! metadata may reuse them), for every operation (shutdown, tests), for all but stuck host → disk
//! copies (`kvbm replay`'s deterministic steps), for a remote load.

use super::*;

impl Worker {
    /// Waits until no store is reading device blocks.
    pub(super) fn wait_device_reads(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut n = self.shared.device_reads.lock();
        while *n > 0 {
            if self
                .shared
                .device_reads_done
                .wait_until(&mut n, deadline)
                .timed_out()
            {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "{} store(s) still reading device blocks after {:.0}s",
                        *n,
                        timeout.as_secs_f64()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Waits until every submitted operation has completed (for shutdown and tests). A load
    /// abandoned at its deadline is complete: its stuck I/O is not waited for.
    pub fn wait_idle(&self, timeout: Duration) -> Result<()> {
        let done = self.wait_idle_inner(timeout);
        // What completed is the leader's now: callers look for it next.
        self.outbox.flush();
        done
    }

    pub(super) fn wait_idle_inner(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.shared.active.lock().all;
            let busy = {
                let st = self.shared.state.lock();
                st.slots.values().any(|s| s.device_ops > 0 || s.loads > 0)
            } || *self.shared.device_reads.lock() > 0
                || self.shared.active.lock().all > 0;
            if !busy {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    "operations still running at the deadline",
                ));
            }
            self.wait_for_a_completion(seen);
        }
    }

    /// As [`Worker::wait_idle`], except for the remote store and copies touching no device block:
    /// writes of host blocks to the remote store (write-behind) and loads from it (each bounded
    /// by `remote.load_timeout_ms`; the engine runs other requests meanwhile, as vLLM and
    /// TensorRT-LLM do while a request's KV is fetched) are never waited for, and host → disk copies,
    /// once everything else is done, are not waited for while any of them has been running for
    /// `grace` or more (the disk is stuck: they finish in the background). For callers that wait
    /// every iteration, like `kvbm replay`: a frozen disk then delays one iteration by `grace`,
    /// not every iteration by the freeze, and a shared store's round trips none (an engine never
    /// waits for write-behind), while runs without a remote store stay reproducible.
    pub fn wait_idle_or_stuck(&self, timeout: Duration, grace: Duration) -> Result<()> {
        let done = self.wait_idle_or_stuck_inner(timeout, grace);
        self.outbox.flush();
        done
    }

    pub(super) fn wait_idle_or_stuck_inner(
        &self,
        timeout: Duration,
        grace: Duration,
    ) -> Result<()> {
        let start = Instant::now();
        loop {
            let device_busy = {
                let st = self.shared.state.lock();
                st.slots
                    .values()
                    .any(|s| s.device_ops > s.remote_loads || s.loads > s.remote_loads)
            } || *self.shared.device_reads.lock() > 0;
            let seen = self.shared.active.lock().all;
            let (all, off_device, stuck) = {
                let a = self.shared.active.lock();
                let stuck = a.off_device.values().any(|t| t.elapsed() >= grace);
                let waited_for = a
                    .all
                    .saturating_sub(a.behind)
                    .saturating_sub(a.remote_loads);
                (waited_for, a.off_device.len(), stuck)
            };
            let waited = start.elapsed();
            if !device_busy && all == 0 {
                return Ok(());
            }
            if !device_busy && all == off_device && stuck {
                if let Some(n) = self.shared.stuck_warn.lock().event(1) {
                    tracing::warn!(
                        copies = off_device,
                        grace_s = grace.as_secs_f64(),
                        steps = n,
                        "kvbm worker: host -> disk copies running past the grace (a slow or \
                         stuck disk); steps go on without them, the copies finish in the background"
                    );
                }
                return Ok(());
            }
            if waited >= timeout {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    "operations still running at the deadline",
                ));
            }
            self.wait_for_a_completion(seen);
        }
    }

    /// Waits up to `max` for an operation to complete while loads from the remote store are in
    /// flight (at once otherwise). For a caller that steps an engine with nothing to schedule
    /// but requests waiting for their remote loads: it waits for them instead of spinning.
    pub fn wait_for_remote_loads(&self, max: Duration) {
        let mut active = self.shared.active.lock();
        if active.remote_loads > 0 {
            let _ = self.shared.active_done.wait_for(&mut active, max);
        }
    }

    /// Between two polls of [`Worker::wait_idle`]: returns once an operation completed since
    /// `seen` operations were in flight, or after 200 µs (what else the wait checks — a copy
    /// running past its grace — changes without a completion). A host copy takes microseconds:
    /// a caller waiting every iteration, like `kvbm replay`, should not sleep a fixed 200 µs.
    pub(super) fn wait_for_a_completion(&self, seen: usize) {
        let pause = Duration::from_micros(200);
        let mut active = self.shared.active.lock();
        if active.all != seen {
            return;
        }
        if active.all == 0 {
            drop(active);
            std::thread::sleep(pause);
            return;
        }
        let _ = self.shared.active_done.wait_for(&mut active, pause);
    }
}
