//! The network transport through the public API on loopback: authentication, the real leader
//! and worker offloading and onboarding over TCP, TensorRT-LLM's start-up order and an orderly
//! shutdown, and the documented protocol version. The transport's own tests (frames, handshake
//! refusals, the barrier over TCP, disconnects, round trips) reach crate-private frame and
//! barrier functions and live in `src/tcp/tests.rs`.
//!
//! Every wait is bounded; all traffic is on 127.0.0.1.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use kvbm_connector::connector::transport::{LeaderTransport, LEADER_GOODBYE};
use kvbm_connector::connector::RequestId;
use kvbm_connector::connector::{Blocking, NonBlocking};
use kvbm_connector::tcp::{TcpLeader, TcpWorker, PROTOCOL_VERSION};
use kvbm_connector::ErrorKind;

const LONG: Duration = Duration::from_secs(10);

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

#[test]
fn auth_token_is_enforced() {
    let leader = TcpLeader::bind(any_port(), 1, Some("s3cret".into())).unwrap();
    let addr = leader.local_addr();
    let started = Instant::now();
    let e = TcpWorker::connect(addr, 0, 1, Some("wrong".into()), LONG).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotReady, "{e}");
    assert!(e.to_string().contains("token mismatch"), "{e}");
    assert!(e.to_string().contains("rank 0"), "{e}");
    let e = TcpWorker::connect(addr, 0, 1, None, LONG).unwrap_err();
    assert!(e.to_string().contains("authentication required"), "{e}");
    // Refusals are final: no retries until the 10 s deadline.
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(leader.connected_ranks().is_empty());
    let w = TcpWorker::connect(addr, 0, 1, Some("s3cret".into()), LONG).unwrap();
    assert_eq!(leader.connected_ranks(), vec![0]);
    assert_eq!(w.world_size(), 1);
    // Refused connections never produced a message.
    assert!(leader.try_recv().unwrap().is_none());
}

#[test]
fn real_leader_and_worker_offload_and_onboard_over_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 8, 8);
    let lt = TcpLeader::bind(any_port(), 1, Some("tok".into())).unwrap();
    let wt = TcpWorker::connect(lt.local_addr(), 0, 1, Some("tok".into()), LONG).unwrap();
    let device = device();
    let mut worker = new_worker(cfg.clone(), 1, wt, NonBlocking).unwrap();
    worker.register(device.clone()).unwrap();
    let leader = new_leader(cfg, BS, lt.clone(), Blocking).unwrap();
    wait_until("worker ready", || worker.is_ready());
    let mut rig = Rig {
        leader,
        worker,
        device,
        dir,
    };
    let tokens: Vec<u32> = (0..16).collect();
    rig.offload(&RequestId::from("a"), &tokens, &[0, 1, 2, 3]);
    // Completions cross the network asynchronously: let every store land before matching.
    wait_until("stores to complete", || {
        rig.leader.process_completions();
        rig.leader.num_operations_in_flight() == 0
    });
    let loaded = rig.onboard(&RequestId::from("b"), &tokens, &[4, 5, 6, 7]);
    assert!(loaded >= BS, "loaded {loaded} tokens");
    assert!(lt.is_session_started());
}

/// TensorRT-LLM's order over TCP: the leader starts non-blocking, the worker registers blocking
/// and returns only once the leader is ready (barrier step 3, `LeaderMessage::Ready`), so the
/// leader is ready the moment the registration returns. Then an orderly shutdown: the leader is
/// dropped first and says goodbye, so the worker's connection ends as a departure
/// ([`LEADER_GOODBYE`], logged at INFO), not as a lost leader (a WARNING on every normal `--tp 2`
/// shutdown before).
#[test]
fn a_blocking_worker_returns_with_the_leader_ready_and_a_dropped_leader_says_goodbye() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 8, 8);
    let lt = TcpLeader::bind(any_port(), 1, None).unwrap();
    let mut leader = new_leader(cfg.clone(), BS, lt.clone(), NonBlocking).unwrap();
    let wt = TcpWorker::connect(lt.local_addr(), 0, 1, None, LONG).unwrap();
    let mut worker = new_worker(cfg, 1, wt.clone(), Blocking).unwrap();
    worker.register(device()).unwrap();
    assert!(worker.is_ready());
    assert!(leader.is_ready(), "{:?}", leader.status());
    assert!(wt.is_connected());
    drop(leader);
    drop(lt);
    wait_until("the worker to see the leader leave", || !wt.is_connected());
    assert_eq!(wt.close_reason().as_deref(), Some(LEADER_GOODBYE));
    // The worker's own calls go on: it knows its leader left.
    worker.get_finished(&[], None);
    worker.wait_idle(LONG).unwrap();
}

/// The documents say the wire protocol version this build speaks: `docs/deployment.md` by number
/// (checked here), `src/tcp/mod.rs` by naming [`PROTOCOL_VERSION`].
#[test]
fn the_docs_name_the_wire_protocol_version_this_build_speaks() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let deployment = std::fs::read_to_string(root.join("docs/deployment.md")).unwrap();
    for needle in [
        format!("## The wire protocol (version {PROTOCOL_VERSION})"),
        format!("`u16` big-endian, `{PROTOCOL_VERSION}`"),
    ] {
        assert!(
            deployment.contains(&needle),
            "docs/deployment.md lacks {needle:?}"
        );
    }
    let module = std::fs::read_to_string(root.join("src/tcp/mod.rs")).unwrap();
    assert!(
        module.contains("| version  | [`PROTOCOL_VERSION`], `u16` big-endian |"),
        "src/tcp/mod.rs's header table must name PROTOCOL_VERSION"
    );
    assert!(
        !module.contains("currently"),
        "src/tcp/mod.rs states a version of its own"
    );
}

// ------------------------------------------------------------------------------------------------
// Batched completions (issue 16, item 3): one message per iteration and rank, never later
// ------------------------------------------------------------------------------------------------

use std::collections::HashSet;
use std::io::{IoSlice, IoSliceMut};
use std::sync::{Arc, Condvar, Mutex};

use kvbm_connector::connector::adapter::{ScheduledTokens, SchedulerStep};
use kvbm_connector::connector::leader::Leader;
use kvbm_connector::connector::worker::Worker;
use kvbm_connector::{Capability, Layout, StorageTier, StorageTierExt, TierKind};

/// The engine's device cache, where reading a *gated* block (a store copying it out) waits until
/// the test opens its gate: a store that stays in flight as long as the test wants.
#[derive(Debug)]
struct GatedDevice {
    inner: Arc<dyn StorageTier>,
    gated: Mutex<HashSet<usize>>,
    opened: Condvar,
}

impl GatedDevice {
    fn close(&self, block: usize) {
        self.gated.lock().unwrap().insert(block);
    }
    fn open(&self, block: usize) {
        self.gated.lock().unwrap().remove(&block);
        self.opened.notify_all();
    }
    fn pass(&self, block: usize) {
        let mut g = self.gated.lock().unwrap();
        while g.contains(&block) {
            g = self.opened.wait(g).unwrap();
        }
    }
}

impl StorageTier for GatedDevice {
    fn kind(&self) -> TierKind {
        self.inner.kind()
    }
    fn capability(&self) -> Capability {
        self.inner.capability()
    }
    fn layout(&self) -> &Layout {
        self.inner.layout()
    }
    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> kvbm_connector::Result<()> {
        self.pass(block);
        self.inner.read_block(block, dst)
    }
    fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> kvbm_connector::Result<()> {
        self.inner.write_block(block, src)
    }
    fn with_block(
        &self,
        block: usize,
        f: &mut dyn FnMut(&[IoSlice<'_>]) -> kvbm_connector::Result<()>,
    ) -> kvbm_connector::Result<()> {
        self.pass(block);
        self.inner.with_block(block, f)
    }
    fn with_block_mut(
        &self,
        block: usize,
        f: &mut dyn FnMut(&mut [IoSliceMut<'_>]) -> kvbm_connector::Result<()>,
    ) -> kvbm_connector::Result<()> {
        self.inner.with_block_mut(block, f)
    }
}

/// A real leader and one real worker over TCP whose device is gated.
struct Gated {
    leader: Leader<ScheduledTokens>,
    worker: Worker,
    device: Arc<GatedDevice>,
    lt: Arc<TcpLeader>,
    wt: Arc<TcpWorker>,
    _dir: tempfile::TempDir,
}

impl Drop for Gated {
    fn drop(&mut self) {
        // A failed assertion must not leave a store blocked: the worker's runtime waits for it.
        let blocks: Vec<usize> = self
            .device
            .gated
            .lock()
            .map(|g| g.iter().copied().collect())
            .unwrap_or_default();
        for b in blocks {
            self.device.open(b);
        }
    }
}

fn gated_rig() -> Gated {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), 32, 0);
    // The gate holds a store while the worker's threads run it, as a GPU's copy engine would: a
    // device tier in host memory is otherwise copied on the caller's thread, which it would hold.
    cfg.transfer.inline_device_copies = false;
    let lt = TcpLeader::bind(any_port(), 1, None).unwrap();
    let wt = TcpWorker::connect(lt.local_addr(), 0, 1, None, LONG).unwrap();
    let device = Arc::new(GatedDevice {
        inner: device(),
        gated: Mutex::new(HashSet::new()),
        opened: Condvar::new(),
    });
    let mut worker = new_worker(cfg.clone(), 1, wt.clone(), NonBlocking).unwrap();
    worker.register(device.clone()).unwrap();
    let leader = new_leader(cfg, BS, lt.clone(), Blocking).unwrap();
    wait_until("worker ready", || worker.is_ready());
    Gated {
        leader,
        worker,
        device,
        lt,
        wt,
        _dir: dir,
    }
}

impl Gated {
    /// One iteration's first half: `n` new one-block requests prefilled on device blocks
    /// `first..first + n`, the last one's store held by the gate; the worker binds, writes and
    /// saves, and the stores of the others finish. Returns the requests.
    fn iteration_with_a_slow_store(
        &mut self,
        tag: usize,
        first: usize,
        n: usize,
    ) -> Vec<RequestId> {
        let mut step = SchedulerStep::default();
        let mut ids = Vec::new();
        for k in 0..n {
            let id = RequestId::from(format!("r{tag}-{k}"));
            let tokens: Vec<u32> = (0..BS as u32)
                .map(|t| 1000 * (tag * n + k) as u32 + t)
                .collect();
            let m = self
                .leader
                .get_num_new_matched_tokens(info(&id, &tokens), 0)
                .unwrap();
            assert_eq!(m.external_tokens, 0);
            self.leader
                .update_state_after_alloc(&id, &[first + k], 0)
                .unwrap();
            self.device
                .inner
                .write_block_from_slice(first + k, &image(&tokens, 0))
                .unwrap();
            step.requests.push(prefill(&id, 0, BS));
            ids.push(id);
        }
        self.device.close(first + n - 1);
        let bytes = self.leader.build_connector_meta(&step).unwrap();
        assert_eq!(
            self.leader.num_operations_in_flight(),
            n,
            "one store per request"
        );
        let stored_before: u64 = self.worker.transfer_stats().iter().map(|p| p.blocks).sum();
        self.worker.bind_metadata(&bytes).unwrap();
        self.worker.start_load().unwrap();
        self.worker.save().unwrap();
        wait_until("the quick stores on the worker", || {
            let stored: u64 = self.worker.transfer_stats().iter().map(|p| p.blocks).sum();
            stored == stored_before + n as u64 - 1
        });
        ids
    }

    fn in_flight_at_leader(&mut self) -> usize {
        self.leader.process_completions();
        self.leader.num_operations_in_flight()
    }

    fn registered_on_host(&self) -> usize {
        self.leader
            .pool_stats()
            .unwrap()
            .0
            .map_or(0, |s| s.registered)
    }
}

#[test]
fn each_completion_reaches_the_leader_in_the_iteration_it_finished_in_one_message() {
    const N: usize = 5;
    let mut r = gated_rig();
    for it in 0..4 {
        let first = it * N;
        let ids = r.iteration_with_a_slow_store(it, first, N);
        // N - 1 stores finished, one is in flight: nothing is sent during the iteration.
        std::thread::sleep(Duration::from_millis(50));
        let before = r.lt.received();
        assert_eq!(
            r.in_flight_at_leader(),
            N,
            "iteration {it}: sent before its end"
        );
        // The iteration ends: its N - 1 completions leave in one message, with no further
        // worker call, while the slow store is still running.
        let (released, _) = r.worker.get_finished(&[], None);
        assert!(released.is_empty());
        let end = Instant::now() + LONG;
        while r.in_flight_at_leader() != 1 {
            assert!(
                Instant::now() < end,
                "iteration {it}: its completions did not reach the leader after get_finished"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let after = r.lt.received();
        assert_eq!(
            after.completion_frames,
            before.completion_frames + 1,
            "{after:?}"
        );
        assert_eq!(after.completions, before.completions + N as u64 - 1);
        assert_eq!(r.registered_on_host(), it * N + N - 1);
        // Between iterations the slow store finishes: the worker has nothing else in flight, so
        // it is sent at once, not with the next iteration.
        r.device.open(first + N - 1);
        wait_until("the slow store's completion", || {
            r.in_flight_at_leader() == 0
        });
        assert_eq!(
            r.lt.received().completion_frames,
            after.completion_frames + 1
        );
        assert_eq!(r.registered_on_host(), (it + 1) * N);
        for id in &ids {
            assert!(!r.leader.request_finished(id, None, None).unwrap());
        }
    }
    // 4 iterations × 5 completions in 8 messages (one per message before batching).
    let total = r.lt.received();
    assert_eq!((total.completions, total.completion_frames), (20, 8));
    assert_eq!(
        r.wt.frames_sent(),
        total.completion_frames + total.msg_frames
    );
}

#[test]
fn a_worker_lost_with_completions_queued_fails_them_at_the_leader_without_a_hang() {
    const N: usize = 4;
    let mut r = gated_rig();
    let _ids = r.iteration_with_a_slow_store(0, 0, N);
    // Three stores done and queued on the worker, one in flight: the worker dies.
    r.wt.close();
    let end = Instant::now() + LONG;
    while r.leader.dead_ranks().is_empty() {
        r.leader.process_completions();
        assert!(
            Instant::now() < end,
            "the leader never noticed the lost worker"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // Every operation the rank had not reported counts as failed there: none is left waiting,
    // none of their blocks is registered (the leader never learnt they were stored).
    assert_eq!(r.leader.num_operations_in_flight(), 0);
    assert_eq!(r.registered_on_host(), 0);
    // The worker's own calls go on without a hang or a panic; its sends fail (logged).
    r.device.open(N - 1);
    r.worker.get_finished(&[], None);
    r.worker.wait_idle(LONG).unwrap();
}

/// The transport and the metrics server moved out of `connector/` (issue 27); their old paths
/// stay as re-exports of the same items, so code written against them still builds.
#[test]
fn the_old_paths_name_the_same_items() {
    use kvbm_connector::connector;
    let _: Option<kvbm_connector::tcp::TcpLeader> = None::<connector::tcp::TcpLeader>;
    let _: Option<kvbm_connector::tcp::TcpWorker> = None::<connector::tcp::TcpWorker>;
    let _: Option<kvbm_connector::tcp::Received> = None::<connector::tcp::Received>;
    let _: Option<kvbm_connector::tcp::rendezvous::RendezvousLeader> =
        None::<connector::tcp::rendezvous::RendezvousLeader>;
    let _: Option<kvbm_connector::tcp::LazyTcpWorker> = None::<connector::tcp::LazyTcpWorker>;
    let _: Option<kvbm_connector::metrics_server::MetricsServer> =
        None::<connector::metrics_server::MetricsServer>;
    assert_eq!(
        kvbm_connector::tcp::HANDSHAKE_TIMEOUT,
        connector::tcp::HANDSHAKE_TIMEOUT
    );
    assert_eq!(
        kvbm_connector::metrics_server::IO_TIMEOUT,
        connector::metrics_server::IO_TIMEOUT
    );
}
