//! KV-cache groups through the vLLM adapter (vLLM's hybrid manager, `SupportsHMA`), without an
//! engine: a scheduler-side [`VllmScheduler`] and a worker-side [`VllmWorker`] in one process over
//! the in-process transport, with two groups (one sliding-window, one full, as Gemma 2 has).
//!
//! Each group's device blocks hold that group's bytes (distinct per group and block position),
//! so a load that mixed the groups up, or served one group's block for the other, is caught by
//! comparing the loaded device blocks with what was stored. How each check would fail:
//! * keys not salted per group: both groups' blocks map to one key, so one group's store is
//!   skipped as already held and its load gets the other group's bytes;
//! * the lookup counted per group: `matched_tokens` grows by twice the hit;
//! * the hit not the smallest group match: a request one group cannot serve gets a hit;
//! * a sliding-window group matched like a full one: a hit needs every block of the prefix, so
//!   the requests after the first find none (only the windows were stored); stored like a full
//!   one: the device -> host counts and `window_skipped_blocks` differ;
//! * no mark where an earlier prefix ended: the third request sharing a prefix finds no window.

#![cfg(feature = "vllm")]

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_connector::backends::memory::MemoryTier;
use kvbm_connector::connector::groups::{AttentionKind, KvCacheGroups};
use kvbm_connector::connector::metadata::ConnectorMetadata;
use kvbm_connector::connector::transport::in_process;
use kvbm_connector::frameworks::vllm::{
    NewRequestData, Request, SchedulerOutput, VllmScheduler, VllmWorker,
};
use kvbm_connector::layout::BlockOrder;
use kvbm_connector::{Config, Layout, LayoutDims, StorageTierExt, TierKind};

const BS: usize = 4;
const DEVICE_BLOCKS: usize = 96;
const WAIT: Duration = Duration::from_secs(10);

fn dims() -> LayoutDims {
    LayoutDims {
        num_layers: 1,
        outer_dim: 2,
        page_size: BS,
        inner_dim: 4,
        dtype_bytes: 2,
    }
}

/// The bytes group `g` holds at block position `i` of the prompt.
fn image(g: usize, i: usize) -> Vec<u8> {
    vec![(0x10 * (g + 1) + i) as u8; dims().bytes_per_block()]
}

struct Rig {
    sched: VllmScheduler,
    worker: VllmWorker,
    device: Arc<MemoryTier>,
    /// Every step's metadata, as the workers decoded it.
    metas: Vec<ConnectorMetadata>,
}

fn rig(groups: usize) -> Rig {
    rig_with(KvCacheGroups::full(groups).unwrap())
}

fn rig_with(groups: KvCacheGroups) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::default();
    config.host.cache_blocks = Some(64);
    config.disk.cache_blocks = Some(0);
    config.disk.dir = dir.path().to_path_buf();
    let layout = Layout::layer_separate(dims(), DEVICE_BLOCKS, BlockOrder::OuterMajor).unwrap();
    let device = Arc::new(MemoryTier::new(TierKind::Device, layout).unwrap());
    let (lt, wts) = in_process(1);
    let mut worker = VllmWorker::new(config.clone(), BS, 1, wts[0].clone()).unwrap();
    worker.set_kv_cache_groups(groups.len()).unwrap();
    let layers = vec![("l0".to_string(), vec![2, DEVICE_BLOCKS, BS, 2, 2])];
    worker
        .register_kv_caches(&layers, 2, Some(DEVICE_BLOCKS), None, device.clone())
        .unwrap();
    let mut sched = VllmScheduler::new(config, BS, lt).unwrap();
    sched.set_kv_cache_group_kinds(groups).unwrap();
    let deadline = Instant::now() + WAIT;
    while !worker.worker().is_ready() {
        assert!(Instant::now() < deadline, "worker never became ready");
        std::thread::sleep(Duration::from_millis(1));
    }
    std::mem::forget(dir);
    Rig {
        sched,
        worker,
        device,
        metas: Vec::new(),
    }
}

fn req<'a>(id: &'a str, tokens: &'a [u32], computed: usize) -> Request<'a> {
    Request {
        request_id: id,
        all_token_ids: tokens,
        cache_salt: None,
        lora_name: None,
        num_computed_tokens: computed,
    }
}

impl Rig {
    /// One engine step: metadata, the worker's calls, and its report.
    fn step(&mut self, out: &SchedulerOutput) -> (HashSet<String>, HashSet<String>) {
        let bytes = self.sched.build_connector_meta(out).unwrap();
        self.metas.push(ConnectorMetadata::decode(&bytes).unwrap());
        self.worker.bind_connector_metadata(&bytes).unwrap();
        self.worker.start_load_kv().unwrap();
        self.worker.save_kv_layer("l0").unwrap();
        self.worker.wait_for_save().unwrap();
        self.worker.worker().wait_idle(WAIT).unwrap();
        let (s, r) = self.worker.get_finished(&out.finished_req_ids);
        self.worker.clear_connector_metadata().unwrap();
        self.sched.update_connector_output();
        (s.unwrap_or_default(), r.unwrap_or_default())
    }
}

/// Request `a` (12 tokens, 3 blocks per group) is computed and stored in both groups; request
/// `b` with the same first 8 tokens then matches 8 in both, and its loads put each group's own
/// bytes in that group's device blocks; it is reported loaded once, after both groups.
#[test]
fn two_groups_store_and_load_each_groups_own_blocks() {
    let mut r = rig(2);
    let a: Vec<u32> = (100..112).collect();
    let (blocks_a, null) = (vec![vec![1, 2, 3], vec![4, 5, 6]], 0usize);
    assert_eq!(
        r.sched
            .get_num_new_matched_tokens(&req("a", &a, 0), 0)
            .unwrap(),
        (Some(0), false)
    );
    r.sched
        .update_state_after_alloc(&req("a", &a, 0), &blocks_a, 0)
        .unwrap();
    for (g, list) in blocks_a.iter().enumerate() {
        for (i, &b) in list.iter().enumerate() {
            r.device.write_block_from_slice(b, &image(g, i)).unwrap();
        }
    }
    let mut out = SchedulerOutput::default();
    out.scheduled_new_reqs.push(NewRequestData {
        req_id: "a".into(),
        prompt_token_ids: a.clone(),
        first_token_index: 0,
        block_ids: blocks_a.clone(),
        num_computed_tokens: 0,
    });
    out.num_scheduled_tokens.insert("a".into(), a.len());
    r.step(&out);
    let (held, _) = r.sched.request_finished(&req("a", &a, 12), &[]).unwrap();
    let mut out = SchedulerOutput::default();
    out.finished_req_ids.insert("a".into());
    let (sending, _) = r.step(&out);
    assert_eq!(
        held,
        sending.contains("a"),
        "a is released once, as a whole"
    );
    let m = r.sched.leader().metrics().snapshot();
    assert_eq!(
        m.transfer(TierKind::Device, TierKind::Host).unwrap().blocks,
        6,
        "3 blocks of each group stored"
    );

    let mut b: Vec<u32> = a[..8].to_vec();
    b.extend(900..903);
    let before = r.sched.leader().metrics().snapshot();
    let (ext, load_async) = r
        .sched
        .get_num_new_matched_tokens(&req("b", &b, 0), 0)
        .unwrap();
    assert_eq!((ext, load_async), (Some(8), true));
    let after = r.sched.leader().metrics().snapshot();
    assert_eq!(
        after.matched_tokens - before.matched_tokens,
        8,
        "one lookup counted, not one per group"
    );
    // Group 0 (sliding window) keeps block 0 of b as vLLM's null block; group 1 (full) all.
    let blocks_b = vec![vec![null, 11, 12], vec![13, 14, 15]];
    r.sched
        .update_state_after_alloc(&req("b", &b, 8), &blocks_b, 8)
        .unwrap();
    let (_, recving) = r.step(&SchedulerOutput::default());
    assert_eq!(recving, HashSet::from(["b".to_string()]));
    assert_eq!(
        r.device.read_block_to_vec(11).unwrap(),
        image(0, 1),
        "group 0 block 1"
    );
    assert_eq!(
        r.device.read_block_to_vec(13).unwrap(),
        image(1, 0),
        "group 1 block 0"
    );
    assert_eq!(
        r.device.read_block_to_vec(14).unwrap(),
        image(1, 1),
        "group 1 block 1"
    );
    assert!(r.worker.get_block_ids_with_load_errors().is_empty());
}

/// Group 1 of request `a` had its first block as the null block when it was computed (nothing
/// stored there), so a later request sharing `a`'s first 8 tokens finds 2 blocks in group 0
/// and none in group 1: the hit is what every group can serve, 0, and nothing stays staged
/// (without the trim, group 0's 2 blocks would be held and loaded for a request group 1 cannot
/// serve).
#[test]
fn the_hit_is_the_smallest_group_match() {
    let mut r = rig(2);
    let a: Vec<u32> = (100..112).collect();
    let blocks_a = vec![vec![1, 2, 3], vec![0, 5, 6]];
    r.sched
        .get_num_new_matched_tokens(&req("a", &a, 0), 0)
        .unwrap();
    r.sched
        .update_state_after_alloc(&req("a", &a, 0), &blocks_a, 0)
        .unwrap();
    let mut out = SchedulerOutput::default();
    out.scheduled_new_reqs.push(NewRequestData {
        req_id: "a".into(),
        prompt_token_ids: a.clone(),
        first_token_index: 0,
        block_ids: blocks_a,
        num_computed_tokens: 0,
    });
    out.num_scheduled_tokens.insert("a".into(), a.len());
    r.step(&out);
    let m = r.sched.leader().metrics().snapshot();
    assert_eq!(
        m.transfer(TierKind::Device, TierKind::Host).unwrap().blocks,
        5,
        "3 blocks of group 0, 2 of group 1 (its null block is not stored)"
    );
    let mut b: Vec<u32> = a[..8].to_vec();
    b.extend(900..903);
    let got = r
        .sched
        .get_num_new_matched_tokens(&req("b", &b, 0), 0)
        .unwrap();
    assert_eq!(got, (Some(0), false));
    let (host, _) = r.sched.leader().pool_stats().unwrap();
    assert_eq!(host.unwrap().active, 0, "nothing staged for b");
    // The group count is fixed once requests exist.
    assert!(r.sched.set_kv_cache_groups(3).is_err());
}

/// Computes request `id` (its whole prompt in one step, every device block real as vLLM has them
/// while the request runs) with group `g`'s block `i` at device block `blocks[g][i]` holding
/// `bytes(g, i)`, then finishes it.
fn compute(
    r: &mut Rig,
    id: &str,
    tokens: &[u32],
    blocks: &[Vec<usize>],
    bytes: impl Fn(usize, usize) -> Vec<u8>,
) {
    let (ext, _) = r
        .sched
        .get_num_new_matched_tokens(&req(id, tokens, 0), 0)
        .unwrap();
    assert_eq!(ext, Some(0), "{id} is computed, not loaded");
    r.sched
        .update_state_after_alloc(&req(id, tokens, 0), blocks, 0)
        .unwrap();
    for (g, list) in blocks.iter().enumerate() {
        for (i, &b) in list.iter().enumerate() {
            r.device.write_block_from_slice(b, &bytes(g, i)).unwrap();
        }
    }
    let mut out = SchedulerOutput::default();
    out.scheduled_new_reqs.push(NewRequestData {
        req_id: id.into(),
        prompt_token_ids: tokens.to_vec(),
        first_token_index: 0,
        block_ids: blocks.to_vec(),
        num_computed_tokens: 0,
    });
    out.num_scheduled_tokens.insert(id.into(), tokens.len());
    r.step(&out);
    r.sched
        .request_finished(&req(id, tokens, tokens.len()), &[])
        .unwrap();
    let mut out = SchedulerOutput::default();
    out.finished_req_ids.insert(id.into());
    r.step(&out);
}

/// Loads request `id`'s match of `hit` tokens into `blocks` and waits until it is reported.
fn load(r: &mut Rig, id: &str, tokens: &[u32], blocks: &[Vec<usize>], hit: usize) {
    r.sched
        .update_state_after_alloc(&req(id, tokens, 0), blocks, hit)
        .unwrap();
    let (_, recving) = r.step(&SchedulerOutput::default());
    assert_eq!(recving, HashSet::from([id.to_string()]));
    assert!(r.worker.get_block_ids_with_load_errors().is_empty());
}

fn stored(r: &Rig) -> (u64, u64) {
    let m = r.sched.leader().metrics().snapshot();
    (
        m.transfer(TierKind::Device, TierKind::Host)
            .map_or(0, |t| t.blocks),
        m.window_skipped_blocks,
    )
}

fn ids(from: usize, n: usize) -> Vec<usize> {
    (from..from + n).collect()
}

/// A full and a sliding-window group (window 8 tokens = 2 blocks of 4 before a hit). Request
/// `a` (40 tokens, 10 blocks) stores every full block but only the window before its prompt's
/// end in the sliding group; `b` (a's prompt and more) is served whole, loading 10 full blocks
/// and the 2 window blocks; `c`, sharing a's first 20 tokens, finds the full group's prefix but
/// no window there: no hit, and that point is marked, so `c` stores the window before it and
/// `d`, sharing the same 20 tokens, is served.
#[test]
fn a_sliding_window_group_stores_and_loads_only_the_windows_hits_need() {
    let groups = KvCacheGroups::new(vec![
        AttentionKind::Full,
        AttentionKind::SlidingWindow { tokens: 8 },
    ])
    .unwrap();
    let mut r = rig_with(groups);
    let a: Vec<u32> = (100..140).collect();
    compute(&mut r, "a", &a, &[ids(1, 10), ids(11, 10)], image);
    assert_eq!(
        stored(&r),
        (13, 7),
        "10 full blocks; of the sliding group the 3 blocks from the window before the prompt's last block on"
    );

    let mut b = a.clone();
    b.extend(900..904);
    let got = r
        .sched
        .get_num_new_matched_tokens(&req("b", &b, 0), 0)
        .unwrap();
    assert_eq!(got, (Some(40), true));
    let mut swa = vec![0usize; 8];
    swa.extend([32, 33, 34]);
    load(&mut r, "b", &b, &[ids(21, 11), swa], 40);
    for i in 0..10 {
        assert_eq!(r.device.read_block_to_vec(21 + i).unwrap(), image(0, i));
    }
    assert_eq!(r.device.read_block_to_vec(32).unwrap(), image(1, 8));
    assert_eq!(r.device.read_block_to_vec(33).unwrap(), image(1, 9));

    let mut c: Vec<u32> = a[..20].to_vec();
    c.extend(500..520);
    let other = |g: usize, i: usize| {
        if i < 5 {
            image(g, i)
        } else {
            vec![0xee; dims().bytes_per_block()]
        }
    };
    let before = stored(&r);
    compute(&mut r, "c", &c, &[ids(41, 10), ids(51, 10)], other);
    let after = stored(&r);
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (10, 5),
        "5 new full blocks; the sliding group's window before the shared 20 tokens (2) and before its prompt's end (3)"
    );

    let mut d: Vec<u32> = a[..20].to_vec();
    d.extend(700..720);
    let got = r
        .sched
        .get_num_new_matched_tokens(&req("d", &d, 0), 0)
        .unwrap();
    assert_eq!(got, (Some(20), true), "the marked window serves d");
    let mut swa = vec![0usize; 3];
    swa.extend([71, 72]);
    swa.extend(ids(73, 5));
    load(&mut r, "d", &d, &[ids(61, 10), swa], 20);
    assert_eq!(r.device.read_block_to_vec(71).unwrap(), image(1, 3));
    assert_eq!(r.device.read_block_to_vec(72).unwrap(), image(1, 4));
    for i in 0..5 {
        assert_eq!(r.device.read_block_to_vec(61 + i).unwrap(), image(0, i));
    }
}

/// Every layer sliding (one group, as Mistral): no full group says where a prefix ends, so the
/// keys the group computed do; the engine must keep its placeholder before the window, and a
/// real block there is refused by name before anything loads.
#[test]
fn one_sliding_group_marks_shared_prefixes_and_refuses_a_real_block_before_the_window() {
    let mut r =
        rig_with(KvCacheGroups::new(vec![AttentionKind::SlidingWindow { tokens: 8 }]).unwrap());
    let a: Vec<u32> = (100..140).collect();
    compute(&mut r, "a", &a, &[ids(1, 10)], image);
    assert_eq!(stored(&r), (3, 7));
    let mut c: Vec<u32> = a[..20].to_vec();
    c.extend(500..520);
    compute(&mut r, "c", &c, &[ids(11, 10)], image);
    assert_eq!(stored(&r), (3 + 5, 7 + 5));
    let mut d: Vec<u32> = a[..20].to_vec();
    d.extend(700..720);
    let got = r
        .sched
        .get_num_new_matched_tokens(&req("d", &d, 0), 0)
        .unwrap();
    assert_eq!(got, (Some(20), true));
    let mut table = vec![0usize; 3];
    table.extend(ids(21, 7));
    table[1] = 40;
    let e = r
        .sched
        .update_state_after_alloc(&req("d", &d, 0), &[table.clone()], 20)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("device block 40 at block position 1")
            && e.to_string().contains("before the sliding window"),
        "{e}"
    );
    table[1] = 0;
    load(&mut r, "d", &d, &[table], 20);
    assert_eq!(r.device.read_block_to_vec(21).unwrap(), image(0, 3));
    assert_eq!(r.device.read_block_to_vec(22).unwrap(), image(0, 4));
}

/// The metadata of a hybrid request (issue 25 item 5), pinned: a Gemma 2 style model (group 0
/// sliding over 8 tokens, group 1 full) computes request `a` (12 tokens, 3 blocks a group), then
/// request `b` shares its first 8 tokens. Each group travels as a request of its own (`a`, and
/// `a` + `GROUP_SEP` + `1`), with its own keys (salted per group) and block ids; the sliding
/// group stores only what a later hit can use and loads only the window before the hit, never
/// the null block. A change to what any group stores, loads or how it is named shows here.
#[test]
fn a_hybrid_requests_metadata() {
    let mut r = rig_with(
        KvCacheGroups::new(vec![
            AttentionKind::SlidingWindow { tokens: 8 },
            AttentionKind::Full,
        ])
        .unwrap(),
    );
    let a: Vec<u32> = (100..112).collect();
    compute(&mut r, "a", &a, &[vec![1, 2, 3], vec![4, 5, 6]], image);
    let mut b: Vec<u32> = a[..8].to_vec();
    b.extend(900..903);
    let (ext, _) = r
        .sched
        .get_num_new_matched_tokens(&req("b", &b, 0), 0)
        .unwrap();
    assert_eq!(ext, Some(8));
    load(&mut r, "b", &b, &[vec![0, 11, 12], vec![13, 14, 15]], 8);
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path("../snapshots");
    settings.set_prepend_module_to_snapshot(false);
    settings.bind(|| insta::assert_yaml_snapshot!("vllm__hybrid_request", r.metas));
}
