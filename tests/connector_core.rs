//! Leader + worker in one process over the in-process transport: the core protocol without any
//! framework adapter.

mod common;

use common::*;
use kvbm_connector::connector::RequestId;

#[test]
fn store_then_hit_from_host_then_from_disk() {
    let mut r = rig(16, 64);
    let prompt: Vec<u32> = (100..140).collect(); // 10 blocks
    let a: RequestId = "a".into();
    r.offload(&a, &prompt, &(0..10).collect::<Vec<_>>());
    // B: same prompt: 9 blocks match (the block holding the last token must be computed).
    let b: RequestId = "b".into();
    let loaded = r.onboard(&b, &prompt, &(10..20).collect::<Vec<_>>());
    assert_eq!(loaded, 36);
    r.leader.process_completions();
    let snap = r.leader.metrics().snapshot();
    assert_eq!(snap.host_hit_tokens, 36);
    assert_eq!(snap.load_error_blocks, 0);
}

/// A request that finishes while its stores are in flight is held (the engine keeps its device
/// blocks) and the hold is counted once its stores end; one whose stores ended before its finish
/// is not held and not counted.
#[test]
fn a_finish_held_for_stores_is_counted_once_they_end() {
    use kvbm_connector::connector::adapter::SchedulerStep;
    let mut r = rig(16, 0);
    let a: RequestId = "a".into();
    r.offload(
        &a,
        &(100..124).collect::<Vec<u32>>(),
        &(0..6).collect::<Vec<_>>(),
    );
    assert_eq!(
        r.leader.metrics().snapshot().finish_holds,
        0,
        "stored before its finish"
    );

    let b: RequestId = "b".into();
    let tokens: Vec<u32> = (200..224).collect();
    let meta = r.prefill_unexecuted(&b, &tokens, &[6, 7, 8, 9, 10, 11]);
    assert!(r.leader.request_finished(&b, None, None).unwrap(), "held");
    assert_eq!(r.leader.metrics().snapshot().finish_holds, 0, "still held");
    r.worker.bind_metadata(&meta).unwrap();
    r.worker.start_load().unwrap();
    r.worker.save().unwrap();
    r.worker
        .wait_idle(std::time::Duration::from_secs(10))
        .unwrap();
    r.step(SchedulerStep::default(), &[], std::slice::from_ref(&b));
    let snap = r.leader.metrics().snapshot();
    assert_eq!(snap.finish_holds, 1, "{snap:?}");
    assert!(snap.finish_hold_us > 0, "{snap:?}");
    assert!(r
        .leader
        .metrics()
        .render_prometheus()
        .contains("kvbm_finish_holds_total 1\n"));
}

/// A new request's lookup applies the completions that arrived when a store of one of its keys
/// is in flight, with no other leader call in between: what finished storing matches at once. A
/// new request none of whose keys is being stored leaves them to the step's other calls.
#[test]
fn a_new_requests_lookup_applies_the_completions_of_its_keys_stores() {
    use kvbm_connector::connector::adapter::SchedulerStep;
    use kvbm_connector::StorageTierExt;
    let mut r = rig(16, 0);
    let prompt: Vec<u32> = (100..140).collect(); // 10 blocks
    let a: RequestId = "a".into();
    let m = r
        .leader
        .get_num_new_matched_tokens(info(&a, &prompt), 0)
        .unwrap();
    assert_eq!(m.external_tokens, 0);
    let blocks: Vec<usize> = (0..10).collect();
    r.leader.update_state_after_alloc(&a, &blocks, 0).unwrap();
    let step = SchedulerStep {
        requests: vec![prefill(&a, 0, prompt.len())],
        ..Default::default()
    };
    let bytes = r.leader.build_connector_meta(&step).unwrap();
    r.worker.bind_metadata(&bytes).unwrap();
    r.worker.start_load().unwrap();
    for b in 0..10 {
        r.device
            .write_block_from_slice(b, &image(&prompt, b))
            .unwrap();
    }
    r.worker.save().unwrap();
    // Every store done and its completion sent; no leader call has applied them.
    r.worker
        .wait_idle(std::time::Duration::from_secs(10))
        .unwrap();
    r.worker.get_finished(&[], None);
    let in_flight = r.leader.num_operations_in_flight();
    assert!(in_flight > 0);
    let c: RequestId = "c".into();
    let other: Vec<u32> = (500..540).collect();
    let m = r
        .leader
        .get_num_new_matched_tokens(info(&c, &other), 0)
        .unwrap();
    assert_eq!(m.external_tokens, 0);
    assert_eq!(r.leader.num_operations_in_flight(), in_flight);
    // b shares a's prompt: the block holding its last token aside, all of it matches.
    let b: RequestId = "b".into();
    let m = r
        .leader
        .get_num_new_matched_tokens(info(&b, &prompt), 0)
        .unwrap();
    assert_eq!(m.external_tokens, 36);
    assert_eq!(r.leader.num_operations_in_flight(), 0);
}

/// `tcp.metrics_addr` (`KVBM_METRICS_ADDR`): the leader serves its counters at `GET /metrics`
/// and each worker its own transfer counters (port + 1 + rank; here port 0: any free port);
/// after a prefix reuse a scrape shows the hits and the worker's copies. Without the setting
/// nothing listens.
#[test]
fn metrics_are_served_over_http_after_a_prefix_reuse() {
    use std::io::{Read, Write};
    fn scrape(addr: std::net::SocketAddr) -> String {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: kvbm\r\n\r\n")
            .unwrap();
        let mut page = String::new();
        s.read_to_string(&mut page).unwrap();
        assert!(page.starts_with("HTTP/1.1 200 OK"), "{page}");
        page
    }
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), 16, 64);
    cfg.tcp.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    let mut r = rig_with(cfg, dir);
    let leader = r
        .leader
        .metrics_addr()
        .expect("the leader's endpoint is on");
    let worker = r
        .worker
        .metrics_addr()
        .expect("the worker's endpoint is on");
    assert_ne!(leader, worker);
    let prompt: Vec<u32> = (0..24).collect();
    r.offload(&"a".into(), &prompt, &(0..6).collect::<Vec<_>>());
    r.onboard(&"b".into(), &prompt, &(6..12).collect::<Vec<_>>());
    r.leader.process_completions();
    let page = scrape(leader);
    assert!(
        page.contains("kvbm_hit_tokens_total{tier=\"host\"} 20"),
        "{page}"
    );
    let page = scrape(worker);
    for pair in [
        "{src=\"device\",dst=\"host\"} 6",
        "{src=\"host\",dst=\"device\"} 5",
    ] {
        assert!(
            page.contains(&format!("kvbm_transfer_blocks_total{pair}")),
            "worker page has {pair}:\n{page}"
        );
    }
    let off = rig(16, 64);
    assert!(off.leader.metrics_addr().is_none() && off.worker.metrics_addr().is_none());
}

#[test]
fn metrics_render_in_prometheus_format() {
    let mut r = rig(16, 64);
    let prompt: Vec<u32> = (0..24).collect();
    r.offload(&"a".into(), &prompt, &(0..6).collect::<Vec<_>>());
    r.onboard(&"b".into(), &prompt, &(6..12).collect::<Vec<_>>());
    r.leader.process_completions();
    let text = r.leader.metrics().render_prometheus();
    assert!(
        text.contains("kvbm_hit_tokens_total{tier=\"host\"} 20"),
        "{text}"
    );
    assert!(
        text.contains("kvbm_transfer_blocks_total{src=\"device\",dst=\"host\"} 6"),
        "{text}"
    );
    assert!(text.contains("# TYPE kvbm_host_hit_rate gauge"), "{text}");
}

/// Block events (for vLLM's KV events): each store decided is reported with its request and
/// block index, each block registered in the host tier as stored; a cache reset withdraws every
/// block, is reported as cleared, and a store still in flight then (what it wrote was computed
/// before the reset) is never registered. How it fails: without the epoch check b's blocks are
/// registered after the reset and match; without the pool's events nothing is reported stored.
#[test]
fn block_events_follow_the_host_tier_and_a_reset_drops_the_stores_in_flight() {
    use kvbm_connector::connector::adapter::SchedulerStep;
    use kvbm_connector::connector::leader::TierEvent;
    use kvbm_connector::TierKind;
    use std::time::Duration;

    let mut r = rig(16, 0);
    r.leader.record_block_events(256);
    let a: RequestId = "a".into();
    let prompt_a: Vec<u32> = (100..124).collect(); // 6 blocks
    r.offload(&a, &prompt_a, &(0..6).collect::<Vec<_>>());
    let ev = r.leader.take_block_events();
    let blocks: Vec<usize> = ev.submitted.iter().map(|s| s.block).collect();
    assert_eq!(blocks, (0..6).collect::<Vec<_>>(), "{ev:?}");
    assert!(ev.submitted.iter().all(|s| s.request == a), "{ev:?}");
    let keys: Vec<_> = ev.submitted.iter().map(|s| s.key).collect();
    let stored: Vec<_> = ev
        .events
        .iter()
        .filter_map(|e| match e {
            TierEvent::Stored {
                tier: TierKind::Host,
                key,
            } => Some(*key),
            _ => None,
        })
        .collect();
    assert_eq!(stored, keys, "{ev:?}");
    assert_eq!(ev.dropped, 0);

    // b's stores are in flight (its metadata built, not yet run) when the cache is reset.
    let b: RequestId = "b".into();
    let prompt_b: Vec<u32> = (200..224).collect();
    let meta = r.prefill_unexecuted(&b, &prompt_b, &(6..12).collect::<Vec<_>>());
    assert_eq!(r.leader.clear_tiers(), 6, "a's six blocks withdrawn");
    r.worker.bind_metadata(&meta).unwrap();
    r.worker.start_load().unwrap();
    r.worker.save().unwrap();
    r.worker.wait_idle(Duration::from_secs(10)).unwrap();
    r.leader.request_finished(&b, None, None).unwrap();
    for _ in 0..3 {
        r.step(SchedulerStep::default(), &[], std::slice::from_ref(&b));
    }
    let ev = r.leader.take_block_events();
    assert_eq!(
        ev.events
            .iter()
            .filter(|e| **e == TierEvent::Cleared)
            .count(),
        1,
        "{ev:?}"
    );
    assert!(
        !ev.events
            .iter()
            .any(|e| matches!(e, TierEvent::Stored { .. })),
        "a store from before the reset was registered: {ev:?}"
    );
    for (id, prompt) in [("c", &prompt_a), ("d", &prompt_b)] {
        let id: RequestId = id.into();
        let m = r
            .leader
            .get_num_new_matched_tokens(info(&id, prompt), 0)
            .unwrap();
        assert_eq!(m.external_tokens, 0, "{id} matched after the reset");
    }
}
