//! The remote (G4) tier end to end in one process, against the in-memory store
//! (`MemoryRemoteStore`, the test double of `RemoteStore`, with injected faults): two instances
//! share prefixes through it; a lookup never blocks an engine that can be asked again, and is
//! bounded by `remote.lookup_timeout_ms` for one that cannot; a store that is down, slow,
//! emptied or holding invalid values costs misses or load errors (recomputed), never an error to
//! the engine and never wrong bytes. The same scenarios against real Redis servers are in
//! tests/redis_e2e.rs.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvbm_connector::backends::StandardTiers;
use kvbm_connector::connector::adapter::{Engine, ScheduledTokens, SchedulerStep};
use kvbm_connector::connector::groups::{AttentionKind, KvCacheGroups};
use kvbm_connector::connector::leader::RequestInfo;
use kvbm_connector::connector::remote::{
    MemoryFaults, MemoryRemoteData, MemoryRemoteStore, RemoteScope, RemoteStore,
};
use kvbm_connector::connector::transport::TierCounts;
use kvbm_connector::connector::worker::{TierFactory, WorkerTiers};
use kvbm_connector::connector::{Blocking, RequestId};
use kvbm_connector::{Config, Result, StorageTier, StorageTierExt, TierKind};

/// The standard tiers plus an in-memory remote store over shared `data`, with `faults`.
#[derive(Debug)]
struct MemoryRemoteTiers {
    data: MemoryRemoteData,
    faults: Arc<MemoryFaults>,
    /// Every store built (the leader's and the worker's).
    built: parking_lot::Mutex<Vec<MemoryRemoteStore>>,
}

impl MemoryRemoteTiers {
    /// (lookups, gets, puts) over every store built.
    fn calls(&self) -> (u64, u64, u64) {
        self.built.lock().iter().fold((0, 0, 0), |a, s| {
            let c = s.calls();
            (a.0 + c.0, a.1 + c.1, a.2 + c.2)
        })
    }
}

impl TierFactory for MemoryRemoteTiers {
    fn build(
        &self,
        config: &Config,
        rank: usize,
        device: Arc<dyn StorageTier>,
        counts: TierCounts,
    ) -> Result<WorkerTiers> {
        StandardTiers.build(config, rank, device, counts)
    }

    fn remote_store(
        &self,
        config: &Config,
        scope: &RemoteScope,
    ) -> Result<Option<Arc<dyn RemoteStore>>> {
        let _ = config;
        let store =
            MemoryRemoteStore::shared(scope.clone(), self.data.clone(), self.faults.clone());
        self.built.lock().push(store.clone());
        Ok(Some(Arc::new(store)))
    }
}

/// vLLM's way: "ask again later" is allowed.
struct Deferred;
impl Engine for Deferred {
    type Adapter = ScheduledTokens;
    type LeaderInit = Blocking;
    type WorkerInit = Blocking;
    const DEFERRED_MATCH: bool = true;
}

type Sync_ = TestEngine<Blocking, Blocking>;

/// An instance (leader + worker) sharing `data`; its own faults.
fn instance<E: Engine<Adapter = ScheduledTokens>>(
    data: &MemoryRemoteData,
    tweak: impl FnOnce(&mut Config),
) -> (Rig, Arc<MemoryFaults>) {
    let (r, f) = instance_with::<E>(data, tweak);
    (r, f.faults.clone())
}

fn instance_with<E: Engine<Adapter = ScheduledTokens>>(
    data: &MemoryRemoteData,
    tweak: impl FnOnce(&mut Config),
) -> (Rig, Arc<MemoryRemoteTiers>) {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path(), 16, 0);
    // Never contacted: the factory above builds the store.
    config.remote.url = Some("redis://127.0.0.1:1".into());
    config.remote.lookup_timeout_ms = Some(50);
    config.remote.io_timeout_ms = Some(2000);
    tweak(&mut config);
    let factory = Arc::new(MemoryRemoteTiers {
        data: data.clone(),
        faults: Arc::default(),
        built: Default::default(),
    });
    (rig_of_engine::<E>(config, dir, factory.clone()), factory)
}

fn id(s: &str) -> RequestId {
    s.into()
}

/// 3 full blocks and one token.
fn prompt() -> Vec<u32> {
    (0..13).map(|t| 900 + t).collect()
}

fn values(data: &MemoryRemoteData) -> usize {
    data.lock().len()
}

/// Instance A offloads the prompt: host, then the store.
fn publish(data: &MemoryRemoteData) -> Rig {
    let (mut a, _) = instance::<Sync_>(data, |_| {});
    a.offload(&id("a"), &prompt(), &[0, 1, 2, 3]);
    assert_eq!(values(data), 3, "A wrote its 3 full blocks to the store");
    let m = a.leader.metrics().snapshot();
    assert_eq!(
        m.transfer(TierKind::Host, TierKind::Remote)
            .map(|t| t.blocks),
        Some(3)
    );
    a
}

/// Loads what `who` matched into `blocks` (sentinel-filled first) and runs until it loaded;
/// the load errors.
fn load(r: &mut Rig, who: &RequestId, blocks: &[usize], external: usize) -> Vec<usize> {
    r.leader
        .update_state_after_alloc(who, blocks, external)
        .unwrap();
    let mut loaded = Vec::new();
    let mut errors = Vec::new();
    for _ in 0..5 {
        let (_, l) = r.step(SchedulerStep::default(), &[], &[]);
        loaded.extend(l);
        errors.extend(r.worker.take_load_errors());
        if !loaded.is_empty() {
            break;
        }
    }
    assert_eq!(loaded, vec![who.clone()]);
    errors
}

fn sentinel(r: &Rig, blocks: &[usize]) -> Vec<u8> {
    let s = vec![0xEE; dims().bytes_per_block()];
    for &b in blocks {
        r.device.write_block_from_slice(b, &s).unwrap();
    }
    s
}

#[test]
fn a_second_instance_onboards_the_first_ones_prefix_through_the_store() {
    let data = MemoryRemoteData::default();
    let _a = publish(&data);
    let (mut b, fb) = instance_with::<Sync_>(&data, |_| {});
    let tokens = prompt();
    assert_eq!(b.onboard(&id("b"), &tokens, &[5, 6, 7, 8]), 12);
    let last = b.leader.last_match();
    assert_eq!((last.host_tokens, last.remote_tokens), (0, 12));
    let m = b.leader.metrics().snapshot();
    assert_eq!(m.remote_hit_tokens, 12);
    assert_eq!(m.remote_lookups, 1);
    assert!(m.remote_available);
    assert_eq!(m.load_error_blocks, 0);
    // B recomputes nothing it loaded and rewrites nothing the store holds.
    let (_, _, puts_before) = fb.calls();
    b.leader.request_finished(&id("b"), None, Some(12)).unwrap();
    for _ in 0..3 {
        b.step(SchedulerStep::default(), &[], &[id("b")]);
    }
    assert_eq!(values(&data), 3);
    assert_eq!(
        fb.calls().2,
        puts_before,
        "known blocks are not offered again"
    );
    let text = b.leader.metrics().render_prometheus();
    assert!(
        text.contains("kvbm_hit_tokens_total{tier=\"remote\"} 12"),
        "{text}"
    );
    assert!(
        text.contains("kvbm_remote_lookups_total{outcome=\"answered\"} 1"),
        "{text}"
    );
    assert!(text.contains("kvbm_remote_available 1"), "{text}");
}

/// An engine that keeps a placeholder block before a sliding window (as vLLM's null block).
struct WithPlaceholder;
impl Engine for WithPlaceholder {
    type Adapter = ScheduledTokens;
    type LeaderInit = Blocking;
    type WorkerInit = Blocking;
    const PLACEHOLDER_BLOCK: Option<usize> = Some(0);
}

/// A sliding-window group (5 tokens: the block before a hit) finds nothing in host or disk; the
/// store holds A's 3 blocks, so the hit is all 12 tokens and only the window's block (A's third)
/// crosses from the store. Without the store in the windowed match, no hit; loading the
/// skipped blocks too, 12 remote hit tokens. An engine without a placeholder is refused.
#[test]
fn a_sliding_window_hit_loads_only_its_window_from_the_store() {
    let data = MemoryRemoteData::default();
    let a = publish(&data);
    let (mut b, _) = instance_with::<WithPlaceholder>(&data, |_| {});
    let groups = KvCacheGroups::new(vec![AttentionKind::SlidingWindow { tokens: 5 }]).unwrap();
    let tokens = prompt();
    let info = RequestInfo {
        id: &id("b"),
        tokens: &tokens,
        cache_salt: None,
        lora_name: None,
    };
    let m = b.leader.match_groups(&groups, info, 0, 0).unwrap();
    assert_eq!((m.external_tokens, m.remote_tokens), (12, 12), "{m:?}");
    sentinel(&b, &[7]);
    let errors = load(&mut b, &id("b"), &[0, 0, 7, 8], 12);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(
        b.device.read_block_to_vec(7).unwrap(),
        a.device.read_block_to_vec(2).unwrap()
    );
    assert_eq!(b.leader.metrics().snapshot().remote_hit_tokens, 4);

    let (mut c, _) = instance_with::<Sync_>(&data, |_| {});
    let info = RequestInfo {
        id: &id("c"),
        tokens: &tokens,
        cache_salt: None,
        lora_name: None,
    };
    let e = c.leader.match_groups(&groups, info, 0, 0).unwrap_err();
    assert!(e.to_string().contains("placeholder"), "{e}");
}

#[test]
fn an_engine_that_can_be_asked_again_never_waits_for_a_lookup() {
    let data = MemoryRemoteData::default();
    let _a = publish(&data);
    // A long lookup wait: the request waits (pending) for the store's answer.
    let (mut b, faults) = instance::<Deferred>(&data, |c| c.remote.lookup_wait_ms = Some(10_000));
    // The store takes 300 ms to answer (within its lookup deadline); every match returns at once
    // meanwhile (pending). A match that waited for the store would find its answer on the first
    // call: `pending` stays 0.
    faults.delay_ms.store(300, Ordering::Relaxed);
    let tokens = prompt();
    let who = id("b");
    let started = Instant::now();
    let mut pending = 0;
    let m = loop {
        let m = b
            .leader
            .get_num_new_matched_tokens(info(&who, &tokens), 0)
            .unwrap();
        if !m.pending {
            break m;
        }
        assert_eq!(m.external_tokens, 0);
        pending += 1;
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "never answered"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(pending > 0, "the first answer was pending");
    assert_eq!((m.external_tokens, m.remote_tokens), (12, 12));
    let blocks = [5, 6, 7, 8];
    sentinel(&b, &blocks);
    assert!(load(&mut b, &who, &blocks, 12).is_empty());
    for (k, &d) in blocks.iter().enumerate().take(3) {
        assert_eq!(b.device.read_block_to_vec(d).unwrap(), image(&tokens, k));
    }
}

/// `remote.lookup_wait_ms`: a request of an engine that asks again waits for its lookup at most
/// that long (from its first ask); then it goes on with the local tiers' match, and keeps that
/// answer (it is not asked of the store again while its prefix stays where it was).
#[test]
fn a_deferred_lookup_past_its_wait_is_a_miss_and_stays_one() {
    let data = MemoryRemoteData::default();
    let _a = publish(&data);
    let (mut b, faults) = instance::<Deferred>(&data, |c| c.remote.lookup_wait_ms = Some(20));
    faults.delay_ms.store(300, Ordering::Relaxed);
    let tokens = prompt();
    let who = id("b");
    let started = Instant::now();
    let mut pending = 0;
    let m = loop {
        let m = b
            .leader
            .get_num_new_matched_tokens(info(&who, &tokens), 0)
            .unwrap();
        if !m.pending {
            break m;
        }
        pending += 1;
        assert!(started.elapsed() < Duration::from_secs(5), "never answered");
        std::thread::sleep(Duration::from_millis(2));
    };
    assert!(pending > 0, "pending while it waited");
    assert_eq!(m.external_tokens, 0, "past the wait: a miss");
    assert_eq!(b.leader.metrics().snapshot().remote_lookup_timeouts, 1);
    // Asked again (e.g. it could not be allocated): the same miss, at once, after the store
    // answered too.
    std::thread::sleep(Duration::from_millis(350));
    let m = b
        .leader
        .get_num_new_matched_tokens(info(&who, &tokens), 0)
        .unwrap();
    assert_eq!((m.pending, m.external_tokens), (false, 0));
    let _ = faults;
}

/// A store whose calls keep missing their deadline is taken out of the path only once a window
/// of calls says so (`StoreHealth::MIN_SAMPLES`), not after a few late answers; then it is not
/// asked at all.
#[test]
fn a_slow_store_leaves_the_lookup_path_after_a_window_of_calls() {
    let data = MemoryRemoteData::default();
    let _a = publish(&data);
    let (mut b, faults) = instance::<Sync_>(&data, |c| {
        c.remote.lookup_timeout_ms = Some(10);
        c.remote.io_timeout_ms = Some(30);
    });
    faults.delay_ms.store(2_000, Ordering::Relaxed);
    let tokens = prompt();
    let deadline = Instant::now() + Duration::from_secs(20);
    let (mut asked, mut skipped) = (0u64, 0);
    while skipped == 0 && Instant::now() < deadline {
        let before = b.leader.metrics().snapshot();
        let m = b
            .leader
            .get_num_new_matched_tokens(info(&id(&format!("c{asked}")), &tokens), 0)
            .unwrap();
        assert_eq!(m.external_tokens, 0);
        let snap = b.leader.metrics().snapshot();
        skipped = snap.remote_lookup_skipped;
        if skipped > 0 {
            // A skipped lookup never reached the store: had it asked, its 10 ms wait would
            // have counted one more timeout. (Structural, not timed.)
            assert_eq!(snap.remote_lookup_timeouts, before.remote_lookup_timeouts);
        } else {
            asked += 1;
        }
        // Let the lookup thread's call reach its own (30 ms) deadline: one sample each.
        std::thread::sleep(Duration::from_millis(40));
    }
    assert_eq!(skipped, 1, "the store was never taken out");
    assert!(
        asked >= kvbm_connector::connector::remote::StoreHealth::MIN_SAMPLES as u64,
        "taken out after only {asked} late lookups"
    );
    let snap = b.leader.metrics().snapshot();
    assert_eq!(
        snap.remote_state,
        Some(kvbm_connector::connector::remote::StoreState::Unavailable)
    );
    let text = b.leader.metrics().render_prometheus();
    assert!(
        text.contains("kvbm_remote_state{state=\"unavailable\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("kvbm_remote_state{state=\"healthy\"} 0"),
        "{text}"
    );
}

#[test]
fn a_store_that_is_down_leaves_local_tiers_serving() {
    let data = MemoryRemoteData::default();
    let _a = publish(&data);
    let (mut b, faults) = instance::<Sync_>(&data, |_| {});
    faults.down.store(true, Ordering::Relaxed);
    // B's own host tier still serves what B offloaded itself.
    let own: Vec<u32> = (0..9).map(|t| 7000 + t).collect();
    b.offload(&id("own"), &own, &[10, 11, 12]);
    let m = b
        .leader
        .get_num_new_matched_tokens(info(&id("b"), &prompt()), 0)
        .unwrap();
    assert_eq!(m.external_tokens, 0);
    b.leader
        .update_state_after_alloc(&id("b"), &[5, 6, 7, 8], 0)
        .unwrap();
    assert_eq!(b.onboard(&id("own2"), &own, &[13, 14, 15]), 8);
    let snap = b.leader.metrics().snapshot();
    assert!(
        snap.remote_lookup_errors + snap.remote_lookup_skipped >= 1,
        "{snap:?}"
    );
    assert!(!snap.remote_available);
    assert!(b
        .leader
        .metrics()
        .render_prometheus()
        .contains("kvbm_remote_available 0"));
}

#[test]
fn invalid_or_evicted_values_are_load_errors_never_served() {
    let data = MemoryRemoteData::default();
    let _a = publish(&data);
    let (mut b, faults) = instance::<Sync_>(&data, |_| {});
    let tokens = prompt();
    let who = id("b");
    let m = b
        .leader
        .get_num_new_matched_tokens(info(&who, &tokens), 0)
        .unwrap();
    assert_eq!(m.remote_tokens, 12);
    // Between the lookup and the read every value turns invalid (planted / damaged).
    faults.invalid.store(true, Ordering::Relaxed);
    let blocks = [5, 6, 7, 8];
    let s = sentinel(&b, &blocks);
    let mut errors = load(&mut b, &who, &blocks, 12);
    errors.sort_unstable();
    assert_eq!(errors, vec![5, 6, 7]);
    for &d in &blocks[..3] {
        assert_eq!(
            b.device.read_block_to_vec(d).unwrap(),
            s,
            "an invalid value was served"
        );
    }
    let snap = b.leader.metrics().snapshot();
    assert_eq!((snap.load_error_blocks, snap.remote_hit_tokens), (3, 0));
    // The worker's store saw the invalid values (the leader's only looked them up): its counters
    // reach the leader's metrics (sent at the end of the iteration, applied by the next call).
    b.leader.process_completions();
    let snap = b.leader.metrics().snapshot();
    assert_eq!(snap.remote_invalid_values, 3, "{snap:?}");
    assert!(b
        .leader
        .metrics()
        .render_prometheus()
        .contains("kvbm_remote_invalid_values_total 3\n"));
    let st = b.leader.remote_store_stats().unwrap();
    assert_eq!(st.invalid, 3);

    // Evicted (a server restarted empty) between lookup and read: load errors too.
    faults.invalid.store(false, Ordering::Relaxed);
    let who = id("c");
    let m = b
        .leader
        .get_num_new_matched_tokens(info(&who, &tokens), 0)
        .unwrap();
    assert_eq!(m.remote_tokens, 12);
    data.lock().clear();
    let blocks = [9, 10, 11, 12];
    let s = sentinel(&b, &blocks);
    let errors = load(&mut b, &who, &blocks, 12);
    assert_eq!(errors.len(), 3);
    assert_eq!(b.device.read_block_to_vec(9).unwrap(), s);
    // And a store emptied before the lookup is simply a miss.
    let m = b
        .leader
        .get_num_new_matched_tokens(info(&id("d"), &tokens), 0)
        .unwrap();
    assert_eq!(m.external_tokens, 0);
}

#[test]
fn writes_are_admitted_by_frequency_and_skipped_while_the_store_fails() {
    let data = MemoryRemoteData::default();
    let (mut a, faults) = instance::<Sync_>(&data, |c| c.remote.min_frequency = Some(2));
    let tokens = prompt();
    a.offload(&id("a"), &tokens, &[0, 1, 2, 3]);
    assert_eq!(values(&data), 0, "seen once: not admitted");
    // Reused from host: seen twice, written.
    assert_eq!(a.onboard(&id("a2"), &tokens, &[4, 5, 6, 7]), 12);
    for _ in 0..3 {
        a.step(SchedulerStep::default(), &[], &[]);
    }
    assert_eq!(values(&data), 3);

    // Once a window of lookups failed, writes are skipped (nothing is sent to a store that is
    // down).
    let data2 = MemoryRemoteData::default();
    let (mut c, f2) = instance_with::<Sync_>(&data2, |_| {});
    f2.faults.down.store(true, Ordering::Relaxed);
    for k in 0..kvbm_connector::connector::remote::StoreHealth::MIN_SAMPLES {
        let m = c
            .leader
            .get_num_new_matched_tokens(info(&id(&format!("l{k}")), &tokens), 0)
            .unwrap();
        assert_eq!(m.external_tokens, 0);
    }
    assert_eq!(
        c.leader.metrics().snapshot().remote_state,
        Some(kvbm_connector::connector::remote::StoreState::Unavailable)
    );
    c.offload(&id("x"), &tokens, &[0, 1, 2, 3]);
    assert_eq!(values(&data2), 0);
    assert_eq!(f2.calls().2, 0, "no write sent while the store is failing");
    assert!(!c.leader.has_pending_work());

    // A store that fails after the lookup: the writes fail, are counted, nothing waits on them.
    let data3 = MemoryRemoteData::default();
    let (mut d, f3) = instance_with::<Sync_>(&data3, |_| {});
    let who = id("y");
    let m = d
        .leader
        .get_num_new_matched_tokens(info(&who, &tokens), 0)
        .unwrap();
    assert_eq!(m.external_tokens, 0);
    d.leader
        .update_state_after_alloc(&who, &[0, 1, 2, 3], 0)
        .unwrap();
    f3.faults.down.store(true, Ordering::Relaxed);
    let writes: Vec<(&[u32], usize, usize)> = (0..3).map(|b| (&tokens[..], b, b)).collect();
    d.step(
        SchedulerStep {
            requests: vec![prefill(&who, 0, tokens.len())],
            ..Default::default()
        },
        &writes,
        &[],
    );
    d.leader.request_finished(&who, None, None).unwrap();
    for _ in 0..3 {
        d.step(SchedulerStep::default(), &[], std::slice::from_ref(&who));
    }
    assert_eq!(values(&data3), 0);
    let snap = d.leader.metrics().snapshot();
    assert_eq!(snap.remote_store_error_blocks, 3);
    assert!(!d.leader.has_pending_work());
    let _ = faults;
}

/// `RemoteSource` / `RemoteSink`: the store as a transfer engine's source and destination.
mod tiers {
    use std::io::{IoSlice, IoSliceMut};
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use kvbm_connector::backends::memory::MemoryTier;
    use kvbm_connector::connector::remote::{
        MemoryRemoteStore, RemotePut, RemoteScope, RemoteSink, RemoteSource, RemoteStore,
    };
    use kvbm_connector::transfer::TransferEngine;
    use kvbm_connector::{Config, ErrorKind, Layout, StorageTier, StorageTierExt};

    use super::common::dims;

    fn host(n: usize) -> Arc<dyn StorageTier> {
        Arc::new(MemoryTier::host(Layout::fully_contiguous(dims(), n).unwrap()).unwrap())
    }

    fn fill(tier: &dyn StorageTier, block: usize, seed: u8) {
        let v: Vec<u8> = (0..tier.bytes_per_block())
            .map(|i| seed.wrapping_add(i as u8))
            .collect();
        tier.write_block_from_slice(block, &v).unwrap();
    }

    const IO: Duration = Duration::from_secs(2);

    fn store() -> MemoryRemoteStore {
        let config = Config::default();
        let d = dims();
        let scope = RemoteScope::for_instance(&config, &d, 1, d.bytes_per_block()).unwrap();
        MemoryRemoteStore::new(scope)
    }

    #[test]
    fn blocks_round_trip_through_the_store_with_the_transfer_engine() {
        let s = Arc::new(store());
        let h = host(4);
        for b in 0..4 {
            fill(h.as_ref(), b, b as u8 * 10);
        }
        let keys = vec![0xA1, 0xA2, 0xA3];
        let sink: Arc<dyn StorageTier> =
            Arc::new(RemoteSink::new(s.clone(), 0, keys.clone(), dims(), IO).unwrap());
        let out =
            TransferEngine::copy_blocking(h.as_ref(), sink.as_ref(), &[(1, 0), (2, 1), (3, 2)])
                .unwrap();
        assert!(out.is_ok(), "{out:?}");
        assert_eq!(s.len(), 3);
        assert_eq!(
            s.lookup_prefix(&[0xA1, 0xA2, 0xA3, 0xA4], Instant::now() + IO)
                .unwrap(),
            3
        );
        assert_eq!(
            s.lookup_prefix(&[0xA4, 0xA1], Instant::now() + IO).unwrap(),
            0
        );
        // Already present: not rewritten.
        let sink2 = RemoteSink::new(s.clone(), 0, keys.clone(), dims(), IO).unwrap();
        let out = TransferEngine::copy_blocking(h.as_ref(), &sink2, &[(0, 0)]).unwrap();
        assert!(out.is_ok());
        assert_eq!(
            sink2.counts(),
            RemotePut {
                written: 0,
                present: 1
            }
        );
        // Read back into another host tier: the bytes of blocks 1..3.
        let back = host(4);
        let src: Arc<dyn StorageTier> =
            Arc::new(RemoteSource::new(s.clone(), 0, keys, dims(), IO).unwrap());
        let out =
            TransferEngine::copy_blocking(src.as_ref(), back.as_ref(), &[(0, 3), (2, 0)]).unwrap();
        assert!(out.is_ok(), "{out:?}");
        assert_eq!(
            back.read_block_to_vec(3).unwrap(),
            h.read_block_to_vec(1).unwrap()
        );
        assert_eq!(
            back.read_block_to_vec(0).unwrap(),
            h.read_block_to_vec(3).unwrap()
        );
        // Per-block path too.
        let mut buf = vec![0u8; back.bytes_per_block()];
        src.read_block(1, &mut [IoSliceMut::new(&mut buf)]).unwrap();
        assert_eq!(buf, h.read_block_to_vec(2).unwrap());
        assert!(src.write_block(0, &[IoSlice::new(&buf)]).is_err());
    }

    #[test]
    fn missing_and_invalid_values_fail_only_their_blocks_and_are_never_written() {
        let s = Arc::new(store());
        let h = host(2);
        fill(h.as_ref(), 0, 1);
        let sink = RemoteSink::new(s.clone(), 0, vec![7], dims(), IO).unwrap();
        assert!(TransferEngine::copy_blocking(h.as_ref(), &sink, &[(0, 0)])
            .unwrap()
            .is_ok());
        // A truncated value planted under key 9; key 8 never written.
        s.plant(0, 9, vec![1, 2, 3]);
        let dst = host(3);
        for b in 0..3 {
            fill(dst.as_ref(), b, 0xEE);
        }
        let sentinel = dst.read_block_to_vec(1).unwrap();
        let src = RemoteSource::new(s.clone(), 0, vec![7, 8, 9], dims(), IO).unwrap();
        let out =
            TransferEngine::copy_blocking(&src, dst.as_ref(), &[(0, 0), (1, 1), (2, 2)]).unwrap();
        assert_eq!(out.blocks, 1);
        let mut failed: Vec<(usize, ErrorKind)> = out
            .failed
            .iter()
            .map(|f| (f.dst_block, f.error.kind()))
            .collect();
        failed.sort_by_key(|f| f.0);
        assert_eq!(
            failed,
            vec![(1, ErrorKind::NotFound), (2, ErrorKind::Corrupt)]
        );
        assert_eq!(
            dst.read_block_to_vec(0).unwrap(),
            h.read_block_to_vec(0).unwrap()
        );
        assert_eq!(dst.read_block_to_vec(1).unwrap(), sentinel);
        assert_eq!(s.stats().invalid, 1);
        // Every value invalid (a planted block with a bad MAC): nothing served.
        s.faults.invalid.store(true, Ordering::Relaxed);
        let out = TransferEngine::copy_blocking(&src, dst.as_ref(), &[(0, 1)]).unwrap();
        assert_eq!(out.failed.len(), 1);
        assert_eq!(out.failed[0].error.kind(), ErrorKind::Corrupt);
        assert_eq!(dst.read_block_to_vec(1).unwrap(), sentinel);
    }

    #[test]
    fn a_store_that_is_down_or_slow_fails_the_batch_within_its_deadline() {
        let s = Arc::new(store());
        let dst = host(2);
        s.faults.down.store(true, Ordering::Relaxed);
        let src = RemoteSource::new(s.clone(), 0, vec![1, 2], dims(), IO).unwrap();
        let out = TransferEngine::copy_blocking(&src, dst.as_ref(), &[(0, 0), (1, 1)]).unwrap();
        assert_eq!(out.failed.len(), 2);
        assert!(!s.stats().available);
        s.faults.down.store(false, Ordering::Relaxed);
        s.faults.delay_ms.store(5_000, Ordering::Relaxed);
        let src =
            RemoteSource::new(s.clone(), 0, vec![1], dims(), Duration::from_millis(30)).unwrap();
        let t = Instant::now();
        let out = TransferEngine::copy_blocking(&src, dst.as_ref(), &[(0, 0)]).unwrap();
        assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
        assert_eq!(out.failed[0].error.kind(), ErrorKind::Timeout);
        assert_eq!(s.stats().timeouts, 1);
    }

    /// A load's budget runs from when it was created (submitted), not from when its reads
    /// start: a load that waited in a queue for most of its budget gets only what is left. (A
    /// budget per read had delayed the last of three loads queued on a stalled connection by
    /// three budgets.)
    #[test]
    fn a_loads_budget_counts_from_its_submission() {
        let s = Arc::new(store());
        let src_host = host(1);
        let data = vec![9u8; dims().bytes_per_block()];
        src_host
            .write_block(0, &[std::io::IoSlice::new(&data)])
            .unwrap();
        let sink = RemoteSink::new(s.clone(), 0, vec![5], dims(), IO).unwrap();
        TransferEngine::copy_blocking(src_host.as_ref(), &sink, &[(0, 0)]).unwrap();
        // Every read takes 100 ms; the budget is 300 ms.
        s.faults.delay_ms.store(100, Ordering::Relaxed);
        let dst = host(1);
        let fresh =
            RemoteSource::new(s.clone(), 0, vec![5], dims(), Duration::from_millis(300)).unwrap();
        let out = TransferEngine::copy_blocking(&fresh, dst.as_ref(), &[(0, 0)]).unwrap();
        assert!(out.failed.is_empty(), "a fresh load fits its budget");
        // The same load, started 250 ms after it was created: 50 ms left, under one read.
        let queued =
            RemoteSource::new(s.clone(), 0, vec![5], dims(), Duration::from_millis(300)).unwrap();
        std::thread::sleep(Duration::from_millis(250));
        let out = TransferEngine::copy_blocking(&queued, dst.as_ref(), &[(0, 0)]).unwrap();
        assert_eq!(out.failed.len(), 1, "a queued load keeps only what is left");
        assert_eq!(out.failed[0].error.kind(), ErrorKind::Timeout);
    }

    #[test]
    fn a_sink_or_source_of_the_wrong_block_size_is_refused() {
        let s = Arc::new(store());
        let mut d = dims();
        d.inner_dim = 4;
        assert_eq!(
            RemoteSource::new(s.clone(), 0, vec![1], d, IO)
                .unwrap_err()
                .kind(),
            ErrorKind::InvalidLayout
        );
        assert_eq!(
            RemoteSink::new(s, 0, vec![1], d, IO).unwrap_err().kind(),
            ErrorKind::InvalidLayout
        );
    }
}

/// Write-behind is never waited for: `Worker::wait_idle_or_stuck` (what `kvbm replay` waits on
/// every iteration) returns while host → store writes are still running, however long the store
/// takes; `wait_idle` still waits for them. How it would fail: waiting for the writes runs into
/// the 3 s deadline below (the store holds each write 6 s) and returns an error.
#[test]
fn write_behind_to_a_slow_store_is_not_waited_for_each_iteration() {
    let data = MemoryRemoteData::default();
    let (mut a, faults) = instance::<Sync_>(&data, |c| c.remote.io_timeout_ms = Some(6_000));
    let who = id("a");
    let tokens = prompt();
    let m = a
        .leader
        .get_num_new_matched_tokens(info(&who, &tokens), 0)
        .unwrap();
    assert_eq!(m.external_tokens, 0);
    let blocks = [0, 1, 2, 3];
    a.leader.update_state_after_alloc(&who, &blocks, 0).unwrap();
    let writes: Vec<(&[u32], usize, usize)> = (0..3).map(|b| (&tokens[..], b, blocks[b])).collect();
    let step = SchedulerStep {
        requests: vec![prefill(&who, 0, tokens.len())],
        ..Default::default()
    };
    a.step(step, &writes, &[]);
    a.leader.request_finished(&who, None, None).unwrap();
    // From here on every write to the store takes 6 s (its whole deadline).
    faults.delay_ms.store(6_000, Ordering::Relaxed);
    let mut sent = false;
    for _ in 0..4 {
        a.step_as_replay(&SchedulerStep::default(), &[], Duration::from_secs(3))
            .expect("an iteration waited for write-behind");
        a.worker.get_finished(std::slice::from_ref(&who), None);
        sent |= a.leader.num_operations_in_flight() > 0;
    }
    assert!(sent, "no write to the store was in flight");
    assert_eq!(values(&data), 0, "the slow store holds nothing yet");
    // The writes end at their deadline; wait_idle does wait for them.
    a.worker.wait_idle(Duration::from_secs(30)).unwrap();
    a.leader.process_completions();
    assert_eq!(a.leader.num_operations_in_flight(), 0);
}

/// Writes to a store whose replies stall hold at most half the host tier: the host tier keeps
/// offloading, so a stalled store costs its own writes, not the local tiers' hits. Eight requests
/// of 3 full blocks (24 distinct blocks) go through a 16-block host tier while every write to
/// the store is held 5 s. How it would fail: without the bound the fifth request's writes hold
/// 15 host blocks and the sixth request's blocks are dropped ("host and disk tiers are full").
#[test]
fn writes_to_a_stalled_store_hold_at_most_half_the_host_tier() {
    let data = MemoryRemoteData::default();
    let (mut a, faults) = instance::<Sync_>(&data, |c| c.remote.io_timeout_ms = Some(5_000));
    faults.delay_ms.store(5_000, Ordering::Relaxed);
    for r in 0..8u32 {
        let who = id(&format!("r{r}"));
        let tokens: Vec<u32> = (0..13).map(|t| 10_000 * (r + 1) + t).collect();
        let m = a
            .leader
            .get_num_new_matched_tokens(info(&who, &tokens), 0)
            .unwrap();
        assert_eq!(m.external_tokens, 0);
        let base = 4 * r as usize;
        let blocks = [base, base + 1, base + 2, base + 3];
        a.leader.update_state_after_alloc(&who, &blocks, 0).unwrap();
        let writes: Vec<(&[u32], usize, usize)> =
            (0..3).map(|b| (&tokens[..], b, blocks[b])).collect();
        let step = SchedulerStep {
            requests: vec![prefill(&who, 0, tokens.len())],
            ..Default::default()
        };
        a.step_as_replay(&step, &writes, Duration::from_secs(3))
            .unwrap();
        a.leader.request_finished(&who, None, None).unwrap();
        for _ in 0..2 {
            a.step_as_replay(&SchedulerStep::default(), &[], Duration::from_secs(3))
                .unwrap();
            a.worker.get_finished(std::slice::from_ref(&who), None);
        }
    }
    let snap = a.leader.metrics().snapshot();
    assert_eq!(snap.offload_dropped_blocks, 0, "{snap:?}");
    assert_eq!(snap.host_store_error_blocks, 0, "{snap:?}");
    assert_eq!(
        snap.transfer(TierKind::Device, TierKind::Host)
            .map_or(0, |t| t.blocks),
        24,
        "every block reached the host tier: {snap:?}"
    );
    a.worker.wait_idle(Duration::from_secs(30)).unwrap();
    a.leader.process_completions();
}

/// `remote.load_timeout_ms` bounds a load's read, not `remote.io_timeout_ms`: a store that
/// answers the lookup and then holds the values fails the load at the load's own deadline, and
/// its blocks are load errors (recomputed). How it would fail: a load bounded by the 20 s I/O
/// deadline is still running at the 5 s wait below, which returns an error.
#[test]
fn a_load_from_the_store_ends_at_its_own_deadline() {
    let data = MemoryRemoteData::default();
    let _a = publish(&data);
    let (mut b, faults) = instance::<Sync_>(&data, |c| {
        c.remote.io_timeout_ms = Some(20_000);
        c.remote.load_timeout_ms = Some(100);
    });
    let who = id("b");
    let tokens = prompt();
    let m = b
        .leader
        .get_num_new_matched_tokens(info(&who, &tokens), 0)
        .unwrap();
    assert_eq!(m.remote_tokens, 12, "found in the store");
    // Every read from here on is held 20 s.
    faults.delay_ms.store(20_000, Ordering::Relaxed);
    let blocks = [5, 6, 7, 8];
    b.leader
        .update_state_after_alloc(&who, &blocks, 12)
        .unwrap();
    let bytes = b
        .leader
        .build_connector_meta(&SchedulerStep::default())
        .unwrap();
    b.worker.bind_metadata(&bytes).unwrap();
    b.worker.start_load().unwrap();
    b.worker.save().unwrap();
    b.worker
        .wait_idle(Duration::from_secs(5))
        .expect("the load ran past its own deadline");
    b.leader.process_completions();
    let (_, loaded) = b.worker.get_finished(&[], None);
    assert_eq!(loaded, vec![who.clone()]);
    let mut errors = b.worker.take_load_errors();
    errors.sort_unstable();
    assert_eq!(
        errors,
        vec![5, 6, 7],
        "every block of the held read is a load error"
    );
    faults.delay_ms.store(0, Ordering::Relaxed);
}
