//! Leader + worker in one process over the in-process transport: the core protocol without any
//! framework adapter.

use std::sync::Arc;
use std::time::Duration;

use kvbm_connector::backends::memory::MemoryTier;
use kvbm_connector::connector::adapter::{ScheduledRequest, ScheduledTokens, SchedulerStep};
use kvbm_connector::connector::barrier::InitMode;
use kvbm_connector::connector::leader::{Leader, RequestInfo};
use kvbm_connector::connector::transport::in_process;
use kvbm_connector::connector::worker::Worker;
use kvbm_connector::connector::RequestId;
use kvbm_connector::layout::BlockOrder;
use kvbm_connector::{Config, Layout, LayoutDims, StorageTier, StorageTierExt, TierKind};

const BS: usize = 4;

fn dims() -> LayoutDims {
    LayoutDims {
        num_layers: 2,
        outer_dim: 2,
        page_size: BS,
        inner_dim: 8,
        dtype_bytes: 2,
    }
}

fn image(tokens: &[u32], block: usize) -> Vec<u8> {
    // KV of a block depends on every token up to its end (like a real model).
    let end = (block + 1) * BS;
    let mut h: u64 = 1469598103934665603;
    for t in &tokens[..end] {
        h = (h ^ u64::from(*t)).wrapping_mul(1099511628211);
    }
    (0..dims().bytes_per_block())
        .map(|i| (h.wrapping_add(i as u64 * 31) >> 7) as u8)
        .collect()
}

struct Rig {
    leader: Leader<ScheduledTokens>,
    worker: Worker,
    device: Arc<dyn StorageTier>,
    _dir: tempfile::TempDir,
}

fn rig(host: usize, disk: usize) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::default();
    config.host.cache_blocks = Some(host);
    config.disk.cache_blocks = Some(disk);
    config.disk.dir = dir.path().to_path_buf();
    let (lt, wts) = in_process(1);
    let device: Arc<dyn StorageTier> = Arc::new(
        MemoryTier::new(
            TierKind::Device,
            Layout::layer_separate(dims(), 32, BlockOrder::OuterMajor).unwrap(),
        )
        .unwrap(),
    );
    let mut worker = Worker::new(config.clone(), 1, wts[0].clone(), InitMode::NonBlocking).unwrap();
    worker.register(device.clone()).unwrap();
    let mut leader = Leader::new(ScheduledTokens, config, BS, lt, InitMode::Blocking).unwrap();
    assert!(leader.is_ready());
    for _ in 0..1000 {
        if worker.is_ready() {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(worker.is_ready());
    Rig {
        leader,
        worker,
        device,
        _dir: dir,
    }
}

impl Rig {
    /// One engine iteration: build + bind metadata, write the KV the step computes, save.
    fn step(
        &mut self,
        step: SchedulerStep,
        writes: &[(&[u32], usize, usize)],
    ) -> (Vec<RequestId>, Vec<RequestId>) {
        let bytes = self.leader.build_connector_meta(&step).unwrap();
        self.worker.bind_metadata(&bytes).unwrap();
        self.worker.start_load().unwrap();
        for (tokens, block, device_block) in writes {
            self.device
                .write_block_from_slice(*device_block, &image(tokens, *block))
                .unwrap();
        }
        self.worker.save().unwrap();
        self.worker.wait_idle(Duration::from_secs(10)).unwrap();
        self.worker.get_finished(&[], None)
    }
}

#[test]
fn store_then_hit_from_host_then_from_disk() {
    let mut r = rig(16, 64);
    let prompt: Vec<u32> = (100..140).collect(); // 10 blocks
    let a: RequestId = "a".into();
    let m = r
        .leader
        .get_num_new_matched_tokens(
            RequestInfo {
                id: &a,
                tokens: &prompt,
                cache_salt: None,
                lora_name: None,
            },
            0,
        )
        .unwrap();
    assert_eq!(m.external_tokens, 0);
    let blocks_a: Vec<usize> = (0..10).collect();
    r.leader.update_state_after_alloc(&a, &blocks_a, 0).unwrap();
    let step = SchedulerStep {
        requests: vec![ScheduledRequest {
            request_id: a.clone(),
            new_tokens: vec![],
            new_block_ids: vec![],
            num_computed_tokens: 0,
            num_scheduled_tokens: Some(40),
            ..Default::default()
        }],
        ..Default::default()
    };
    let writes: Vec<(&[u32], usize, usize)> =
        (0..10).map(|b| (&prompt[..], b, blocks_a[b])).collect();
    r.step(step, &writes);
    // Finished: its stores may or may not be done yet; either answer is legal.
    let held = r.leader.request_finished(&a, None, None).unwrap();
    let (released, _) = {
        let bytes = r
            .leader
            .build_connector_meta(&SchedulerStep::default())
            .unwrap();
        r.worker.bind_metadata(&bytes).unwrap();
        r.worker.save().unwrap();
        r.worker.wait_idle(Duration::from_secs(10)).unwrap();
        r.worker.get_finished(std::slice::from_ref(&a), None)
    };
    assert_eq!(released.contains(&a), held);
    // Clobber A's device blocks so a hit must really load.
    for b in 0..10 {
        r.device
            .write_block_from_slice(b, &vec![0u8; dims().bytes_per_block()])
            .unwrap();
    }
    // B: same prompt: 9 blocks match (the last one must be computed).
    let b: RequestId = "b".into();
    let m = r
        .leader
        .get_num_new_matched_tokens(
            RequestInfo {
                id: &b,
                tokens: &prompt,
                cache_salt: None,
                lora_name: None,
            },
            0,
        )
        .unwrap();
    assert_eq!(m.external_tokens, 36);
    assert!(m.load_async);
    let blocks_b: Vec<usize> = (10..20).collect();
    r.leader
        .update_state_after_alloc(&b, &blocks_b, 36)
        .unwrap();
    let (_, loaded) = r.step(SchedulerStep::default(), &[]);
    let loaded = if loaded.is_empty() {
        r.step(SchedulerStep::default(), &[]).1
    } else {
        loaded
    };
    assert_eq!(loaded, vec![b.clone()]);
    for (k, &dev) in blocks_b.iter().enumerate().take(9) {
        assert_eq!(
            r.device.read_block_to_vec(dev).unwrap(),
            image(&prompt, k),
            "block {k}"
        );
    }
    r.leader.process_completions();
    let snap = r.leader.metrics().snapshot();
    assert_eq!(snap.host_hit_tokens, 36);
    assert_eq!(snap.load_error_blocks, 0);
}
