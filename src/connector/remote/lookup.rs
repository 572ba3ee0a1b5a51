//! The leader's background lookups: [`LookupThread`] asks the store on a thread of its own, so
//! the engine never waits for the store when it can be asked again later.

use super::*;

/// A lookup the leader asked [`LookupThread`] for.
#[derive(Debug)]
struct LookupJob {
    /// Who asked (the request's id and the index of its first key), echoed in the answer.
    tag: (String, usize),
    keys: Vec<u128>,
    /// The store call's deadline, from when it starts.
    within: Duration,
}

/// How a background lookup turned out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LookupOutcome {
    /// The store holds this many of the keys, from the first.
    Found(usize),
    /// The store did not answer in time (a miss).
    Timeout,
    /// The store failed (a miss); the error says why.
    Failed(String),
    /// Not asked: the store is out of the lookup path (slow or unavailable, see
    /// [`StoreHealth`]; a miss).
    Skipped,
}

/// The leader's lookups: one thread that runs [`RemoteStore::lookup_prefix`] for the jobs it
/// is given, each bounded by its own deadline, and keeps the answers until taken. The
/// scheduler's thread queues a job and later takes its answer ([`LookupThread::take`]: never
/// waits), or waits for it up to a deadline of its own ([`LookupThread::wait`]: an engine that
/// must answer at once); a store that misbehaves past its deadline delays only this thread.
/// Every call's latency and outcome go to the store's [`StoreHealth`]; while that takes the
/// store out of the path, jobs are answered [`LookupOutcome::Skipped`] without asking it, so a
/// store that is down or slow costs the scheduler nothing. Jobs queue at most
/// [`LookupThread::MAX_QUEUED`] deep (beyond: refused, a miss).
#[derive(Debug)]
pub struct LookupThread {
    shared: Arc<LookupShared>,
    health: Arc<StoreHealth>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Debug, Default)]
struct LookupQueue {
    jobs: std::collections::VecDeque<LookupJob>,
    done: HashMap<(String, usize), LookupOutcome>,
    /// Jobs whose waiter gave up while they ran: their answers are dropped.
    abandoned: std::collections::HashSet<(String, usize)>,
    stop: bool,
}

#[derive(Debug, Default)]
struct LookupShared {
    queue: Mutex<LookupQueue>,
    wake: Condvar,
    answered: Condvar,
}

impl LookupThread {
    /// Most jobs waiting at once.
    pub const MAX_QUEUED: usize = 1024;
    /// Most answers kept untaken (all are dropped beyond it).
    const MAX_DONE: usize = 4096;

    /// Starts the thread; its calls inform `health`, which also decides whether they are made.
    pub fn start(store: Arc<dyn RemoteStore>, health: Arc<StoreHealth>) -> Result<Self> {
        let shared = Arc::new(LookupShared::default());
        let s = shared.clone();
        let h = health.clone();
        let name = store.describe();
        let thread = std::thread::Builder::new()
            .name("kvbm-remote-lookup".into())
            .spawn(move || loop {
                let (job, down) = {
                    let mut q = s.queue.lock();
                    loop {
                        if q.stop {
                            return;
                        }
                        if let Some(j) = q.jobs.pop_front() {
                            break (j, !h.in_path());
                        }
                        s.wake.wait(&mut q);
                    }
                };
                let outcome = if down {
                    LookupOutcome::Skipped
                } else {
                    let began = Instant::now();
                    let outcome = match store.lookup_prefix(&job.keys, Instant::now() + job.within)
                    {
                        Ok(n) => LookupOutcome::Found(n.min(job.keys.len())),
                        Err(e) if e.kind() == ErrorKind::Timeout => LookupOutcome::Timeout,
                        Err(e) => LookupOutcome::Failed(e.to_string()),
                    };
                    let call = match outcome {
                        LookupOutcome::Found(_) => CallOutcome::Answered,
                        _ => CallOutcome::Failed,
                    };
                    if let Some((from, to)) = h.record(CallKind::Lookup, began.elapsed(), call) {
                        log_state_change(&name, from, to, h.slow());
                    }
                    outcome
                };
                let mut q = s.queue.lock();
                if q.done.len() >= Self::MAX_DONE {
                    q.done.clear();
                }
                if !q.abandoned.remove(&job.tag) {
                    q.done.insert(job.tag, outcome);
                }
                s.answered.notify_all();
            })
            .map_err(|e| Error::io("start the remote lookup thread", e))?;
        Ok(Self {
            shared,
            health,
            thread: Some(thread),
        })
    }

    /// Queues a lookup of `keys` for `(request, first)`, whose store call gets `within`; false
    /// when the queue is full (nothing queued).
    pub fn submit(&self, request: &str, first: usize, keys: Vec<u128>, within: Duration) -> bool {
        let mut q = self.shared.queue.lock();
        if q.jobs.len() >= Self::MAX_QUEUED {
            return false;
        }
        let tag = (request.to_owned(), first);
        q.done.remove(&tag);
        q.abandoned.remove(&tag);
        q.jobs.push_back(LookupJob { tag, keys, within });
        self.shared.wake.notify_one();
        true
    }

    /// The answer for `(request, first)`, if it arrived (taken: a second call answers `None`).
    pub fn take(&self, request: &str, first: usize) -> Option<LookupOutcome> {
        self.shared
            .queue
            .lock()
            .done
            .remove(&(request.to_owned(), first))
    }

    /// Waits until the answer for `(request, first)` arrived or `deadline` passed; takes it.
    /// `None` past the deadline (the job is withdrawn if it has not started).
    pub fn wait(&self, request: &str, first: usize, deadline: Instant) -> Option<LookupOutcome> {
        let tag = (request.to_owned(), first);
        let mut q = self.shared.queue.lock();
        loop {
            if let Some(o) = q.done.remove(&tag) {
                return Some(o);
            }
            if self
                .shared
                .answered
                .wait_until(&mut q, deadline)
                .timed_out()
            {
                if let Some(o) = q.done.remove(&tag) {
                    return Some(o);
                }
                let queued = q.jobs.len();
                q.jobs.retain(|j| j.tag != tag);
                if q.jobs.len() == queued {
                    // Running now: its answer is dropped when it comes.
                    if q.abandoned.len() >= Self::MAX_DONE {
                        q.abandoned.clear();
                    }
                    q.abandoned.insert(tag);
                }
                return None;
            }
        }
    }

    /// Withdraws the job of `(request, first)` if it has not started; drops its answer when it
    /// comes if it has (the waiter went on without it).
    pub fn abandon(&self, request: &str, first: usize) {
        let tag = (request.to_owned(), first);
        let mut q = self.shared.queue.lock();
        if q.done.remove(&tag).is_some() {
            return;
        }
        let queued = q.jobs.len();
        q.jobs.retain(|j| j.tag != tag);
        if q.jobs.len() == queued {
            if q.abandoned.len() >= Self::MAX_DONE {
                q.abandoned.clear();
            }
            q.abandoned.insert(tag);
        }
    }

    /// The store's health, which these lookups inform.
    pub fn health(&self) -> &Arc<StoreHealth> {
        &self.health
    }

    /// Forgets `request`'s answers and queued jobs (it finished).
    pub fn forget(&self, request: &str) {
        let mut q = self.shared.queue.lock();
        q.jobs.retain(|j| j.tag.0 != request);
        q.done.retain(|k, _| k.0 != request);
        q.abandoned.retain(|k| k.0 != request);
    }
}

impl Drop for LookupThread {
    fn drop(&mut self) {
        self.shared.queue.lock().stop = true;
        self.shared.wake.notify_all();
        // A lookup stuck in the store is bounded by its deadline; it is not waited for here.
        drop(self.thread.take());
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{store, IO};
    use super::*;

    #[test]
    fn lookups_answer_later_wait_up_to_a_deadline_and_back_off() {
        // The store's values, kept here too: holding their lock holds a store call in
        // progress (below), so no step depends on how fast this machine runs the threads.
        let data = MemoryRemoteData::default();
        let s = Arc::new(MemoryRemoteStore::shared(
            store().scope().clone(),
            data.clone(),
            Arc::default(),
        ));
        s.plant(0, 1, vec![0; 1]);
        s.plant(0, 2, vec![0; 1]);
        // Out of the path for 2 s after a verdict: the steps that expect it out run well within
        // that on a loaded machine; the step after it waits for its end.
        let health = Arc::new(StoreHealth::new(
            Duration::from_millis(20),
            Duration::from_secs(2),
        ));
        let t = LookupThread::start(s.clone(), health).unwrap();
        // Asked, then answered later (taken once).
        assert!(t.submit("r", 0, vec![1, 2, 3], IO));
        let deadline = Instant::now() + IO;
        let mut got = None;
        while got.is_none() && Instant::now() < deadline {
            got = t.take("r", 0);
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(got, Some(LookupOutcome::Found(2)));
        assert_eq!(t.take("r", 0), None);
        // Waited for: within the deadline.
        assert!(t.submit("r", 5, vec![3, 1], IO));
        assert_eq!(
            t.wait("r", 5, Instant::now() + IO),
            Some(LookupOutcome::Found(0))
        );
        // A store that has not answered: the wait ends at its own deadline, not with the store
        // call (held in the store until after the wait returned); the answer, when it comes, is
        // dropped.
        let held = data.lock();
        let (asked, _, _) = s.calls();
        assert!(t.submit("q", 0, vec![1], IO));
        let until = Instant::now() + 5 * IO;
        while s.calls().0 == asked {
            assert!(Instant::now() < until, "the lookup never reached the store");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            t.wait("q", 0, Instant::now() + Duration::from_millis(5)),
            None
        );
        let tag = ("q".to_owned(), 0);
        assert!(t.shared.queue.lock().abandoned.contains(&tag));
        drop(held);
        while t.shared.queue.lock().abandoned.contains(&tag) {
            assert!(Instant::now() < until, "the held lookup never ended");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(t.take("q", 0), None, "an abandoned answer is dropped");
        s.faults.delay_ms.store(30, Ordering::Relaxed);
        // Slow for a window's worth of calls (30 ms against the health's 20 ms): out of the
        // path, answered without asking the store.
        let mut k = 0;
        while t.health.in_path() && k < 64 {
            k += 1;
            assert!(t.submit("q", 10 + k, vec![1], IO));
            assert_eq!(
                t.wait("q", 10 + k, Instant::now() + IO),
                Some(LookupOutcome::Found(1))
            );
        }
        assert_eq!(t.health.state(), StoreState::Slow);
        // The three calls above were the window's first samples: the verdict comes with the
        // window's MIN_SAMPLES-th call, not before.
        assert_eq!(k, StoreHealth::MIN_SAMPLES - 3, "{k} calls took it out");
        let (lookups, _, _) = s.calls();
        assert!(t.submit("q", 1, vec![1], IO));
        assert_eq!(
            t.wait("q", 1, Instant::now() + IO),
            Some(LookupOutcome::Skipped)
        );
        assert_eq!(s.calls().0, lookups, "a store out of the path is not asked");
        // Down (after the back-off): failed at once.
        s.faults.delay_ms.store(0, Ordering::Relaxed);
        s.faults.down.store(true, Ordering::Relaxed);
        let until = Instant::now() + 5 * IO;
        while !t.health.in_path() {
            assert!(Instant::now() < until, "the back-off never ended");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(t.submit("d", 0, vec![1], IO));
        assert!(matches!(
            t.wait("d", 0, Instant::now() + IO),
            Some(LookupOutcome::Failed(_))
        ));
        // Forgotten requests leave nothing behind.
        t.forget("d");
        t.forget("r");
        assert!(t.shared.queue.lock().done.is_empty());
    }
}
