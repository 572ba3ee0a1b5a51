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
