//! Bad input from the engine: every case is a typed error, and nothing already stored is lost.

mod common;

use common::*;
use kvbm_connector::connector::adapter::SchedulerStep;
use kvbm_connector::connector::metadata::{BlockTransfer, ConnectorMetadata, Load, OperationId};
use kvbm_connector::connector::RequestId;
use kvbm_connector::{ErrorKind, TierKind};

fn prompt() -> Vec<u32> {
    (1000..1024).collect() // 6 blocks
}

/// A rig with `prompt()` offloaded, plus a check that it still hits afterwards.
fn stored_rig() -> Rig {
    let mut r = rig(16, 32);
    r.offload(&"stored".into(), &prompt(), &(0..6).collect::<Vec<_>>());
    r
}

fn still_hits(r: &mut Rig, id: &str) {
    let got = r.onboard(&id.into(), &prompt(), &(10..16).collect::<Vec<_>>());
    assert_eq!(got, 5 * BS, "stored blocks were lost");
}

#[test]
fn unknown_request_ids_are_not_found() {
    let mut r = stored_rig();
    let ghost: RequestId = "ghost".into();
    let e = r
        .leader
        .update_state_after_alloc(&ghost, &[1, 2], 0)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert_eq!(e.context_value("request"), Some("ghost"));
    let step = SchedulerStep {
        requests: vec![prefill(&ghost, 0, 4)],
        ..Default::default()
    };
    let e = r.leader.build_connector_meta(&step).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    let step = SchedulerStep {
        preempted: vec![ghost.clone()],
        ..Default::default()
    };
    assert_eq!(
        r.leader.build_connector_meta(&step).unwrap_err().kind(),
        ErrorKind::NotFound
    );
    // Finishing a request the leader never saw holds nothing.
    assert!(!r.leader.request_finished(&ghost, None, None).unwrap());
    still_hits(&mut r, "after-unknown");
}

#[test]
fn duplicate_ids_are_refused() {
    let mut r = stored_rig();
    let a: RequestId = "a".into();
    let tokens: Vec<u32> = (1..9).collect();
    r.leader
        .get_num_new_matched_tokens(info(&a, &tokens), 0)
        .unwrap();
    r.leader.update_state_after_alloc(&a, &[20, 21], 0).unwrap();
    let step = SchedulerStep {
        requests: vec![prefill(&a, 0, 8), prefill(&a, 0, 8)],
        ..Default::default()
    };
    let e = r.leader.build_connector_meta(&step).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("twice"), "{e}");
    // A request that held nothing is forgotten at once; finishing it again holds nothing either.
    assert!(!r.leader.request_finished(&a, None, Some(0)).unwrap());
    assert_eq!(r.leader.request_state(&a), None);
    assert!(!r.leader.request_finished(&a, None, None).unwrap());
    still_hits(&mut r, "after-duplicates");
}

#[test]
fn finishing_a_held_request_twice_is_an_invalid_state() {
    let mut r = rig(16, 32);
    let a: RequestId = "a".into();
    let tokens = prompt();
    // Built but never executed: the stores are in flight when the request finishes.
    r.prefill_unexecuted(&a, &tokens, &[0, 1, 2, 3, 4, 5]);
    assert!(r.leader.request_finished(&a, None, None).unwrap());
    let e = r.leader.request_finished(&a, None, None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidState);
    assert_eq!(e.context_value("request"), Some("a"));
}

#[test]
fn device_block_ids_out_of_range_are_refused() {
    let mut r = stored_rig();
    let a: RequestId = "a".into();
    let tokens = prompt();
    let m = r
        .leader
        .get_num_new_matched_tokens(info(&a, &tokens), 0)
        .unwrap();
    assert_eq!(m.external_tokens, 5 * BS);
    let e = r
        .leader
        .update_state_after_alloc(&a, &[10, 11, 12, DEVICE_BLOCKS, 14, 15], m.external_tokens)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange);
    assert_eq!(e.context_value("request"), Some("a"));
    // The staging survived the refused call: a corrected call loads.
    r.leader
        .update_state_after_alloc(&a, &[10, 11, 12, 13, 14, 15], m.external_tokens)
        .unwrap();
    let mut step = prefill(&a, 0, 4);
    step.new_block_ids = vec![DEVICE_BLOCKS + 7];
    let e = r
        .leader
        .build_connector_meta(&SchedulerStep {
            requests: vec![step],
            ..Default::default()
        })
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange);
}

#[test]
fn external_token_count_must_match_the_staging() {
    let mut r = stored_rig();
    let a: RequestId = "a".into();
    let tokens = prompt();
    let m = r
        .leader
        .get_num_new_matched_tokens(info(&a, &tokens), 0)
        .unwrap();
    let e = r
        .leader
        .update_state_after_alloc(&a, &[10, 11, 12, 13, 14, 15], m.external_tokens - BS)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let b: RequestId = "b".into();
    let other: Vec<u32> = (1..9).collect();
    r.leader
        .get_num_new_matched_tokens(info(&b, &other), 0)
        .unwrap();
    let e = r
        .leader
        .update_state_after_alloc(&b, &[20, 21], 8)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
}

#[test]
fn malformed_metadata_bytes_are_decode_errors_and_change_nothing() {
    let mut r = stored_rig();
    for bad in [
        &b"garbage"[..],
        &b"{\"version\":1}"[..],
        &[0xff, 0x00, 0x13][..],
    ] {
        let e = r.worker.bind_metadata(bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Decode, "{e}");
    }
    still_hits(&mut r, "after-garbage");
}

#[test]
fn forged_operations_fail_cleanly_on_the_worker() {
    let mut r = stored_rig();
    let mut meta = ConnectorMetadata::empty(999);
    meta.new_slots.push("forged".into());
    // Blocks far out of range, and a source tier the worker does not have.
    meta.operations.push(Box::new(Load(BlockTransfer {
        id: OperationId(1_000_000),
        request_id: Some("forged".into()),
        src: TierKind::Host,
        dst: TierKind::Device,
        pairs: vec![(usize::MAX, 3)],
    })));
    meta.operations.push(Box::new(Load(BlockTransfer {
        id: OperationId(1_000_001),
        request_id: Some("forged".into()),
        src: TierKind::Remote,
        dst: TierKind::Device,
        pairs: vec![(0, 4)],
    })));
    // A request no metadata announced: refused without running, nothing tracked.
    meta.operations.push(Box::new(Load(BlockTransfer {
        id: OperationId(1_000_002),
        request_id: Some("never-announced".into()),
        src: TierKind::Host,
        dst: TierKind::Device,
        pairs: vec![(0, 5)],
    })));
    r.worker.bind_metadata(&meta.encode().unwrap()).unwrap();
    r.worker.start_load().unwrap();
    r.worker
        .wait_idle(std::time::Duration::from_secs(5))
        .unwrap();
    // The failed blocks are the engine's to hear of with the load's end.
    let (_, loaded) = r.worker.get_finished(&["forged".into()], None);
    assert_eq!(loaded, vec![RequestId::from("forged")]);
    let mut errors = r.worker.take_load_errors();
    errors.sort_unstable();
    assert_eq!(errors, vec![3, 4]);
    assert_eq!(r.worker.num_slots(), 0);
    // The leader ignores completions of operations it never issued.
    r.leader.process_completions();
    still_hits(&mut r, "after-forgery");
}

/// An adapter whose metadata hook fails once.
struct FlakyHook {
    fail_next: bool,
}

impl kvbm_connector::connector::adapter::SchedulerAdapter for FlakyHook {
    fn name(&self) -> &'static str {
        "flaky"
    }
    fn computed_after(
        &self,
        r: &kvbm_connector::connector::adapter::ScheduledRequest,
    ) -> kvbm_connector::Result<usize> {
        kvbm_connector::connector::adapter::ScheduledTokens.computed_after(r)
    }
    fn extend_metadata(&mut self, _meta: &mut ConnectorMetadata) -> kvbm_connector::Result<()> {
        if std::mem::take(&mut self.fail_next) {
            return Err(kvbm_connector::Error::invalid_argument(
                "hook failed on purpose",
            ));
        }
        Ok(())
    }
}

#[test]
fn a_failing_metadata_hook_loses_no_operation() {
    use kvbm_connector::connector::leader::Leader;
    use kvbm_connector::connector::transport::in_process;
    use kvbm_connector::connector::{Blocking, Engine, NonBlocking};
    struct Flaky;
    impl Engine for Flaky {
        type Adapter = FlakyHook;
        type LeaderInit = Blocking;
        type WorkerInit = NonBlocking;
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 16, 0);
    let (lt, wts) = in_process(1);
    let mut worker = new_worker(cfg.clone(), 1, wts[0].clone(), NonBlocking).unwrap();
    worker.register(device()).unwrap();
    let mut leader = Leader::new::<Flaky>(FlakyHook { fail_next: false }, cfg, BS, lt).unwrap();
    let a: RequestId = "a".into();
    let tokens = prompt();
    leader
        .get_num_new_matched_tokens(info(&a, &tokens), 0)
        .unwrap();
    leader
        .update_state_after_alloc(&a, &[0, 1, 2, 3, 4, 5], 0)
        .unwrap();
    leader.adapter_mut().fail_next = true;
    let step = SchedulerStep {
        requests: vec![prefill(&a, 0, 24)],
        ..Default::default()
    };
    let e = leader.build_connector_meta(&step).unwrap_err();
    assert!(e.to_string().contains("on purpose"));
    // The next metadata carries the slot and the six stores decided by the failed call.
    let meta = ConnectorMetadata::decode(
        &leader
            .build_connector_meta(&SchedulerStep::default())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(meta.new_slots, vec![a.clone()]);
    let stored: usize = meta
        .operations
        .iter()
        .map(|o| o.transfer().pairs.len())
        .sum();
    assert_eq!(stored, 6);
}
