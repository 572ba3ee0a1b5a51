//! Start-up: both init modes on both sides, the deadline, disagreeing ranks, "not ready".

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvbm_connector::backends::memory::MemoryTier;
use kvbm_connector::backends::StandardTiers;
use kvbm_connector::connector::adapter::SchedulerStep;
use kvbm_connector::connector::leader::LeaderStatus;
use kvbm_connector::connector::metadata::{BlockTransfer, ConnectorMetadata, Load, OperationId};
use kvbm_connector::connector::transport::{in_process, TierCounts};
use kvbm_connector::connector::worker::{TierFactory, WorkerTiers};
use kvbm_connector::connector::RequestId;
use kvbm_connector::connector::{Blocking, NonBlocking};
use kvbm_connector::{
    Config, ErrorKind, Layout, LayoutDims, StorageTier, StorageTierExt, TierKind,
};

#[test]
fn leader_deadline_names_the_missing_rank() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), 8, 0);
    cfg.init_timeout_secs = 0.3;
    let (lt, wts) = in_process(2);
    let mut w0 = new_worker(cfg.clone(), 2, wts[0].clone(), NonBlocking).unwrap();
    w0.register(device()).unwrap();
    let started = Instant::now();
    let e = new_leader(cfg, BS, lt, Blocking).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert_eq!(e.context_value("missing_ranks"), Some("[1]"), "{e}");
    assert!(e.to_string().contains("step 1"), "{e}");
}

#[test]
fn worker_deadline_without_a_leader() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), 8, 0);
    cfg.init_timeout_secs = 0.2;
    let (_lt, wts) = in_process(1);
    let mut w = new_worker(cfg, 1, wts[0].clone(), Blocking).unwrap();
    let e = w.register(device()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert_eq!(e.context_value("rank"), Some("0"));
}

#[test]
fn non_blocking_leader_answers_not_ready_until_the_worker_registers() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 8, 8);
    let (lt, wts) = in_process(1);
    let mut leader = new_leader(cfg.clone(), BS, lt, NonBlocking).unwrap();
    assert!(!leader.is_ready());
    assert!(matches!(leader.status(), LeaderStatus::NotReady));
    let id: RequestId = "early".into();
    let tokens: Vec<u32> = (0..16).collect();
    let m = leader
        .get_num_new_matched_tokens(info(&id, &tokens), 0)
        .unwrap();
    assert_eq!((m.external_tokens, m.load_async), (0, false));
    leader
        .update_state_after_alloc(&id, &[0, 1, 2, 3], 0)
        .unwrap();
    let meta = ConnectorMetadata::decode(
        &leader
            .build_connector_meta(&SchedulerStep::default())
            .unwrap(),
    )
    .unwrap();
    assert!(meta.is_empty());
    assert!(!leader.request_finished(&id, None, None).unwrap());
    // TensorRT-LLM order: the worker registers blocking while the leader waits in the background.
    let mut worker = new_worker(cfg, 1, wts[0].clone(), Blocking).unwrap();
    worker.register(device()).unwrap();
    assert!(worker.is_ready());
    wait_until("leader ready", || leader.is_ready());
    match leader.status() {
        LeaderStatus::Ready(r) => {
            assert_eq!(r.counts.num_host_blocks, 8);
            assert_eq!(r.counts.num_device_blocks, DEVICE_BLOCKS);
            assert_eq!(r.total_bytes_per_block(), dims().bytes_per_block());
        }
        other => panic!("not ready: {other:?}"),
    }
}

#[test]
fn worker_refuses_operations_before_it_is_ready() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 8, 0);
    let (_lt, wts) = in_process(1);
    let mut w = new_worker(cfg, 1, wts[0].clone(), NonBlocking).unwrap();
    w.register(device()).unwrap();
    assert!(!w.is_ready());
    w.bind_metadata(&ConnectorMetadata::empty(1).encode().unwrap())
        .unwrap();
    let mut meta = ConnectorMetadata::empty(2);
    meta.operations.push(Box::new(Load(BlockTransfer {
        id: OperationId(1),
        request_id: None,
        src: TierKind::Host,
        dst: TierKind::Device,
        pairs: vec![(0, 0)],
    })));
    assert_eq!(
        w.bind_metadata(&meta.encode().unwrap()).unwrap_err().kind(),
        ErrorKind::NotReady
    );
}

#[test]
fn tensor_parallel_counts_use_the_sum_of_bytes_and_the_minimum_device_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), 0, 0);
    cfg.host.cache_blocks = None;
    // 1 MB of host cache over two ranks whose shards are 512 B each: 1e6 / 1024 blocks.
    cfg.host.cache_gb = Some(0.001);
    let (lt, wts) = in_process(2);
    let mut workers = Vec::new();
    for (rank, n) in [(0usize, 32usize), (1, 20)] {
        let dev: Arc<dyn StorageTier> = Arc::new(
            MemoryTier::new(
                TierKind::Device,
                Layout::fully_contiguous(dims(), n).unwrap(),
            )
            .unwrap(),
        );
        let mut w = new_worker(cfg.clone(), 2, wts[rank].clone(), NonBlocking).unwrap();
        w.register(dev).unwrap();
        workers.push(w);
    }
    let leader = new_leader(cfg, BS, lt, Blocking).unwrap();
    let LeaderStatus::Ready(r) = leader.status() else {
        panic!("leader not ready")
    };
    assert_eq!(dims().bytes_per_block(), 256);
    assert_eq!(r.counts.num_host_blocks, 1_000_000 / 512);
    assert_eq!(r.counts.num_device_blocks, 20);
    for w in &workers {
        wait_until("workers ready", || w.is_ready());
        assert_eq!(w.tiers().unwrap().counts, r.counts);
    }
}

#[test]
fn ranks_with_disagreeing_layouts_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), 8, 0);
    cfg.init_timeout_secs = 5.0;
    let (lt, wts) = in_process(2);
    let other = LayoutDims {
        num_layers: 3,
        ..dims()
    };
    let mut w0 = new_worker(cfg.clone(), 2, wts[0].clone(), NonBlocking).unwrap();
    w0.register(device()).unwrap();
    let mut w1 = new_worker(cfg.clone(), 2, wts[1].clone(), NonBlocking).unwrap();
    w1.register(Arc::new(
        MemoryTier::new(
            TierKind::Device,
            Layout::fully_contiguous(other, 32).unwrap(),
        )
        .unwrap(),
    ))
    .unwrap();
    let e = new_leader(cfg, BS, lt, Blocking).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidLayout, "{e}");
    assert!(
        e.to_string().contains("rank 1") || e.to_string().contains("rank 0"),
        "{e}"
    );
    // The refused worker learns why instead of waiting for the deadline.
    let refused = [&w0, &w1].iter().any(|w| {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(e) = w.init_error() {
                break e.to_string().contains("refused");
            }
            if Instant::now() > deadline {
                break false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    });
    assert!(refused);
}

#[test]
fn a_leader_whose_page_size_differs_from_the_workers_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 8, 0);
    let (lt, wts) = in_process(1);
    let mut w = new_worker(cfg.clone(), 1, wts[0].clone(), NonBlocking).unwrap();
    w.register(device()).unwrap();
    let e = new_leader(cfg, BS * 2, lt, Blocking).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidLayout, "{e}");
    assert!(e.to_string().contains("4-token blocks"), "{e}");
    wait_until("worker refused", || w.init_error().is_some());
}

/// A tier factory that records the counts it was asked for and defers to the standard one.
#[derive(Debug, Default)]
struct Recording(std::sync::Mutex<Vec<TierCounts>>);

impl TierFactory for Recording {
    fn build(
        &self,
        config: &Config,
        rank: usize,
        device: Arc<dyn StorageTier>,
        counts: TierCounts,
    ) -> kvbm_connector::Result<WorkerTiers> {
        self.0.lock().unwrap().push(counts);
        StandardTiers.build(config, rank, device, counts)
    }
}

#[test]
fn the_worker_builds_its_tiers_with_the_factory_it_was_given() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 8, 4);
    let (lt, wts) = in_process(1);
    let factory = Arc::new(Recording::default());
    let mut w = new_worker(cfg.clone(), 1, wts[0].clone(), NonBlocking).unwrap();
    w.set_tier_factory(factory.clone()).unwrap();
    w.register(device()).unwrap();
    let e = w.set_tier_factory(StandardTiers::shared()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
    let _leader = new_leader(cfg, BS, lt, Blocking).unwrap();
    wait_until("worker ready", || w.is_ready());
    let built = factory.0.lock().unwrap().clone();
    assert_eq!(built.len(), 1);
    assert_eq!((built[0].num_host_blocks, built[0].num_disk_blocks), (8, 4));
    let tiers = w.tiers().unwrap();
    assert_eq!(tiers.host.as_ref().map(|t| t.num_blocks()), Some(8));
    assert_eq!(tiers.disk.as_ref().map(|t| t.num_blocks()), Some(4));
}

/// A request the engine admits while the leader's barrier is still running (TensorRT-LLM admits
/// requests once its workers registered, which can be before the leader saw them) is followed
/// all the same: once the leader is ready, what it computed meanwhile is stored, and a later
/// request with its prefix matches it from host. Deterministic: the worker registers only after
/// the request was admitted and prefilled. How it would fail: an untracked request is never
/// offloaded, and the second request matches 0 tokens.
#[test]
fn a_request_admitted_before_the_leader_is_ready_is_offloaded_once_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 8, 0);
    let (lt, wts) = in_process(1);
    let mut leader = new_leader(cfg.clone(), BS, lt, NonBlocking).unwrap();
    assert!(!leader.is_ready());
    let early: RequestId = "early".into();
    let tokens: Vec<u32> = (100..116).collect();
    let m = leader
        .get_num_new_matched_tokens(info(&early, &tokens), 0)
        .unwrap();
    assert_eq!(m.external_tokens, 0);
    let blocks = [4, 5, 6, 7];
    leader.update_state_after_alloc(&early, &blocks, 0).unwrap();
    // Its prefill runs while the leader is not ready: no metadata to carry anything yet.
    let step = SchedulerStep {
        requests: vec![prefill(&early, 0, tokens.len())],
        ..Default::default()
    };
    let meta = ConnectorMetadata::decode(&leader.build_connector_meta(&step).unwrap()).unwrap();
    assert!(meta.operations.is_empty());
    // Now the worker registers (TensorRT-LLM's order) and the leader becomes ready.
    let dev = device();
    for (b, &d) in blocks.iter().enumerate() {
        dev.write_block_from_slice(d, &image(&tokens, b)).unwrap();
    }
    let mut worker = new_worker(cfg, 1, wts[0].clone(), Blocking).unwrap();
    worker.register(dev.clone()).unwrap();
    wait_until("leader ready", || leader.is_ready());
    // The request finishes: its computed blocks are stored (nothing was lost while not ready).
    leader.request_finished(&early, None, None).unwrap();
    for _ in 0..3 {
        let bytes = leader
            .build_connector_meta(&SchedulerStep::default())
            .unwrap();
        worker.bind_metadata(&bytes).unwrap();
        worker.start_load().unwrap();
        worker.save().unwrap();
        worker.wait_idle(Duration::from_secs(10)).unwrap();
        leader.process_completions();
        let _ = worker.get_finished(std::slice::from_ref(&early), None);
    }
    let later: RequestId = "later".into();
    let m = leader
        .get_num_new_matched_tokens(info(&later, &tokens), 0)
        .unwrap();
    assert_eq!(
        (m.external_tokens, m.host_tokens),
        (12, 12),
        "the early request's blocks were stored"
    );
}
