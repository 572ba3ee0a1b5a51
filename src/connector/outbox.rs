//! A worker's completions on their way to the leader: queued, then sent in batches, one
//! [`WorkerMessage::Completed`] per flush (over TCP one COMPLETIONS frame, split only at the
//! frame limit), instead of one message per operation.
//!
//! When a batch leaves (the [`Worker`](super::worker::Worker) calls these):
//!
//! * [`Outbox::end_iteration`] — `get_finished`, the end of the engine's iteration, *after* it
//!   read which requests finished and *before* it returns: the engine never hears that an
//!   operation finished before its completion is on its way to the leader, and everything that
//!   finished during the iteration leaves with it (the leader looks for completions at its next
//!   call, which follows the engine's iteration);
//! * [`Outbox::settled`] — between iterations (after `get_finished`, before the next
//!   `bind_metadata`), the worker's last operation in flight just finished: nothing more can
//!   join the batch before the engine adds work, so waiting would only delay it (during an
//!   iteration, `get_finished` comes anyway, and the worker settles every time a quick copy
//!   finishes before the engine submitted the next one);
//! * [`Outbox::begin_iteration`] (`bind_metadata`), [`Outbox::flush`] (`wait_idle`, dropping the
//!   worker) — whatever is still queued;
//! * between iterations (after `get_finished`, before the next `bind_metadata`), a completion
//!   queued while other operations are still in flight leaves after at most [`LINGER`]: an
//!   engine that stops iterating (nothing scheduled) while a slow copy (host → disk) runs must
//!   not keep the others' stored blocks unmatchable until the copy ends.
//!
//! So a completion never waits for a later iteration. Invariants: completions leave in the order
//! queued; one flush at a time (a flush returns only after what was queued before it was
//! handed to the transport, even by another thread's flush); a failed send is logged, and the
//! leader then counts the rank as lost (its transport reports the disconnection), which fails
//! every operation the rank had not reported.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::connector::transport::{Completion, WorkerMessage, WorkerTransport};

/// The longest a completion queued between iterations waits while other operations are in
/// flight.
pub const LINGER: Duration = Duration::from_millis(5);

#[derive(Debug, Default)]
struct Queue {
    list: Vec<Completion>,
    /// Between `bind_metadata` and `get_finished`.
    in_iteration: bool,
    /// A [`LINGER`] flush is scheduled.
    timer: bool,
}

/// A worker's queue of completions; see the [module documentation](self).
#[derive(Debug)]
pub(crate) struct Outbox {
    transport: Arc<dyn WorkerTransport>,
    runtime: tokio::runtime::Handle,
    queue: Mutex<Queue>,
    /// Held while a batch is handed to the transport.
    sending: Mutex<()>,
    /// A send failed (logged once).
    failed: AtomicBool,
}

impl Outbox {
    /// An outbox sending through `transport`, whose [`LINGER`] timers run on `runtime`.
    pub(crate) fn new(
        transport: Arc<dyn WorkerTransport>,
        runtime: tokio::runtime::Handle,
    ) -> Arc<Self> {
        Arc::new(Self {
            transport,
            runtime,
            queue: Mutex::new(Queue::default()),
            sending: Mutex::new(()),
            failed: AtomicBool::new(false),
        })
    }

    /// Queues one completion (sent by a later flush).
    pub(crate) fn push(self: &Arc<Self>, c: Completion) {
        let arm = {
            let mut q = self.queue.lock();
            q.list.push(c);
            let arm = !q.in_iteration && !q.timer;
            q.timer |= arm;
            arm
        };
        if arm {
            let me = self.clone();
            self.runtime.spawn(async move {
                tokio::time::sleep(LINGER).await;
                // An iteration that started meanwhile keeps its batch for its end.
                me.flush_if(|q| {
                    q.timer = false;
                    !q.in_iteration
                });
            });
        }
    }

    /// The worker has no operation in flight any more: between iterations, sends what is queued.
    pub(crate) fn settled(&self) {
        self.flush_if(|q| !q.in_iteration);
    }

    /// An iteration starts (`bind_metadata`): sends what an earlier one left.
    pub(crate) fn begin_iteration(&self) {
        self.flush_if(|q| {
            q.in_iteration = true;
            true
        });
    }

    /// The iteration ends (`get_finished`): sends everything queued.
    pub(crate) fn end_iteration(&self) {
        self.flush_if(|q| {
            q.in_iteration = false;
            true
        });
    }

    /// Sends what is queued, as one message.
    pub(crate) fn flush(&self) {
        self.flush_if(|_| true);
    }

    /// Completions queued and not sent yet.
    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        self.queue.lock().list.len()
    }

    /// Sends what is queued if `f` (which may update the queue's state) says so.
    fn flush_if(&self, f: impl FnOnce(&mut Queue) -> bool) {
        let _sending = self.sending.lock();
        let list = {
            let mut q = self.queue.lock();
            if !f(&mut q) {
                return;
            }
            std::mem::take(&mut q.list)
        };
        if list.is_empty() {
            return;
        }
        let n = list.len();
        if let Err(e) = self.transport.send(WorkerMessage::Completed(list)) {
            if !self.failed.swap(true, Ordering::Relaxed) {
                tracing::warn!(rank = self.transport.rank(), completions = n, error = %e, "cannot report completions to the leader (later failures are not logged)");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::connector::metadata::OperationId;
    use crate::connector::transport::{in_process, LeaderTransport};

    fn done(op: u64) -> Completion {
        Completion {
            op: OperationId(op),
            failed_dst_blocks: vec![],
            error: None,
        }
    }

    fn rig() -> (
        tokio::runtime::Runtime,
        Arc<crate::connector::transport::InProcessLeader>,
        Arc<Outbox>,
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_time()
            .build()
            .unwrap();
        let (lt, wts) = in_process(1);
        let outbox = Outbox::new(wts[0].clone(), rt.handle().clone());
        (rt, lt, outbox)
    }

    /// Every message waiting at the leader, as lists of op numbers.
    fn sent(lt: &dyn LeaderTransport) -> Vec<Vec<u64>> {
        let mut out = Vec::new();
        while let Some((_, m)) = lt.try_recv().unwrap() {
            match m {
                WorkerMessage::Completed(list) => {
                    out.push(list.iter().map(|c| c.op.0).collect());
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        out
    }

    #[test]
    fn an_iteration_s_completions_leave_together_at_its_end_in_order() {
        let (_rt, lt, outbox) = rig();
        outbox.begin_iteration();
        for op in [3, 1, 2] {
            outbox.push(done(op));
        }
        // Held during the iteration: no timer runs there.
        std::thread::sleep(LINGER * 4);
        assert!(sent(lt.as_ref()).is_empty());
        assert_eq!(outbox.queued(), 3);
        outbox.end_iteration();
        assert_eq!(sent(lt.as_ref()), vec![vec![3, 1, 2]]);
        assert_eq!(outbox.queued(), 0);
        // Nothing queued: a flush sends nothing.
        outbox.end_iteration();
        outbox.settled();
        assert!(sent(lt.as_ref()).is_empty());
    }

    #[test]
    fn leftovers_leave_when_the_next_iteration_starts_or_the_worker_settles_between_them() {
        let (_rt, lt, outbox) = rig();
        outbox.begin_iteration();
        outbox.push(done(1));
        // Settling during an iteration waits for its end.
        outbox.settled();
        assert!(sent(lt.as_ref()).is_empty());
        outbox.begin_iteration();
        assert_eq!(sent(lt.as_ref()), vec![vec![1]]);
        outbox.push(done(2));
        outbox.end_iteration();
        outbox.push(done(3));
        assert_eq!(sent(lt.as_ref()), vec![vec![2]]);
        // Between iterations, settling sends at once (no LINGER wait).
        outbox.settled();
        assert_eq!(sent(lt.as_ref()), vec![vec![3]]);
    }

    #[test]
    fn between_iterations_a_completion_waits_at_most_the_linger() {
        let (_rt, lt, outbox) = rig();
        outbox.end_iteration();
        let t = Instant::now();
        outbox.push(done(7));
        outbox.push(done(8));
        let mut got = Vec::new();
        while got.is_empty() {
            assert!(t.elapsed() < Duration::from_secs(5), "never sent");
            std::thread::sleep(Duration::from_millis(1));
            got = sent(lt.as_ref());
        }
        assert_eq!(got, vec![vec![7, 8]]);
        assert!(t.elapsed() >= LINGER, "{:?}", t.elapsed());
        // A timer armed between iterations does not cut the batch of one that started meanwhile.
        outbox.push(done(9));
        outbox.begin_iteration();
        assert_eq!(sent(lt.as_ref()), vec![vec![9]]);
        outbox.push(done(10));
        std::thread::sleep(LINGER * 4);
        assert!(sent(lt.as_ref()).is_empty());
        outbox.end_iteration();
        assert_eq!(sent(lt.as_ref()), vec![vec![10]]);
    }
}
